//! SIGHUP, with the real binary: the configuration file's `[[snapshotter]]` tables and
//! `log_level` are reloaded, everything else waits for the next start (and says so), a
//! bad file changes nothing, and the agent keeps serving throughout.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

use opmon_client::{ApiVersion, Client, Snapshotter};
use opmon_tests::agent_command;

const LONG: Duration = Duration::from_secs(60);

struct Running {
    child: Child,
    log: PathBuf,
    socket: PathBuf,
}

impl Running {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn hangup(&self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGHUP,
        )
        .expect("SIGHUP");
    }

    /// Waits until the log has `n` lines containing `needle`.
    fn wait_for_lines(&self, needle: &str, n: usize) {
        let found = opmon_tests::try_eventually(LONG, || {
            self.log().lines().filter(|l| l.contains(needle)).count() >= n
        });
        assert!(
            found.is_some(),
            "no {n}× {needle:?} in the log:\n{}",
            self.log()
        );
    }

    /// Opens a connection, sends nothing, and waits until the agent closes it (after
    /// the idle timeout).
    fn idle_connection_closed(&self) {
        let mut stream = UnixStream::connect(&self.socket).expect("connect");
        stream.set_read_timeout(Some(LONG)).expect("timeout");
        let mut buf = [0u8; 16];
        assert_eq!(
            stream
                .read(&mut buf)
                .expect("the agent closes the idle connection"),
            0
        );
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(dir: &Path, config: &Path) -> Running {
    let socket = dir.join("agent.sock");
    let log = dir.join("agent.log");
    let child = agent_command()
        .arg("--config")
        .arg(config)
        .arg("--socket")
        .arg(&socket)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args(["--idle-timeout", "1s"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("starting the agent");
    let mut running = Running { child, log, socket };
    opmon_tests::wait_for_socket(&running.socket, &mut running.child, &running.log);
    running
}

async fn names(client: &Client) -> Vec<String> {
    let mut names: Vec<String> = client
        .snapshotters()
        .await
        .expect("snapshotter.list")
        .into_iter()
        .map(|s| s.name)
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn sighup_reloads_snapshotter_tables_and_log_level_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("agent.toml");
    std::fs::write(
        &config,
        "log_level = \"info\"\npoll_interval = \"10s\"\n\n[[snapshotter]]\nname = \"example.io/first\"\napi_version = \"v1\"\n\n[[snapshotter]]\nname = \"example.io/kept\"\napi_version = \"v1\"\n",
    )
    .unwrap();
    let agent = start(dir.path(), &config);
    let client = Client::connect(&agent.socket).await.unwrap();
    // One registered through the API: a reload leaves it alone.
    client
        .register_snapshotter(Snapshotter {
            name: "example.io/api".into(),
            api_version: ApiVersion::V1,
            socket: None,
            command: None,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        names(&client).await,
        ["example.io/api", "example.io/first", "example.io/kept"]
    );
    // At info, closing an idle connection is not logged.
    agent.idle_connection_closed();
    assert!(!agent.log().contains("closed an idle connection"));

    std::fs::write(
        &config,
        "log_level = \"debug\"\npoll_interval = \"5s\"\n\n[[snapshotter]]\nname = \"example.io/kept\"\napi_version = \"v1\"\n\n[[snapshotter]]\nname = \"example.io/second\"\napi_version = \"v2\"\nsocket = \"/run/second.sock\"\n",
    )
    .unwrap();
    agent.hangup();
    agent.wait_for_lines("configuration reloaded", 1);
    let log = agent.log();
    for needle in [
        "SIGHUP: reloading the configuration",
        "reload: log_level changed from=info to=debug",
        "reload: [[snapshotter]] added snapshotter=example.io/second",
        "reload: [[snapshotter]] removed from the file: unregistered snapshotter=example.io/first",
        "reload: this setting takes effect at the next start key=\"poll_interval\" running=\"10s\" configured=\"5s\"",
        "configuration reloaded changes=3",
    ] {
        assert!(log.contains(needle), "no {needle:?} in:\n{log}");
    }
    let reload_lines = &log[log.find("SIGHUP").expect("SIGHUP line")..];
    assert!(
        !reload_lines.contains("snapshotter=example.io/kept"),
        "an unchanged table is left as it is:\n{log}"
    );
    let client = Client::connect(&agent.socket).await.unwrap();
    assert_eq!(
        names(&client).await,
        ["example.io/api", "example.io/kept", "example.io/second"]
    );
    // Debug logging is on now.
    agent.idle_connection_closed();
    agent.wait_for_lines("closed an idle connection", 1);

    // A bad file changes nothing, and says why.
    std::fs::write(
        &config,
        "log_level = \"verbose\"\n\n[[snapshotter]]\nname = \"example.io/third\"\napi_version = \"v1\"\n",
    )
    .unwrap();
    agent.hangup();
    agent.wait_for_lines("reload refused", 1);
    assert!(
        agent.log().contains(&format!(
            "reload refused, the running configuration is unchanged: log_level (from {} line 1): \"verbose\" is not a level",
            config.display()
        )),
        "{}",
        agent.log()
    );
    std::fs::write(
        &config,
        "[[snapshotter]]\nname = \"example.io/fourth\"\napi_version = \"v2\"\n",
    )
    .unwrap();
    agent.hangup();
    agent.wait_for_lines("reload refused", 2);
    assert!(
        agent.log().contains("reload refused, the running configuration is unchanged: config snapshotter example.io/fourth: socket: a v2 snapshotter needs exactly one of socket, command and velero_plugin"),
        "{}",
        agent.log()
    );
    let client = Client::connect(&agent.socket).await.unwrap();
    assert_eq!(
        names(&client).await,
        ["example.io/api", "example.io/kept", "example.io/second"]
    );
    // Still at debug: the refused reloads did not touch the level.
    let before = agent
        .log()
        .lines()
        .filter(|l| l.contains("closed an idle connection"))
        .count();
    agent.idle_connection_closed();
    agent.wait_for_lines("closed an idle connection", before + 1);
    assert_eq!(client.status().await.unwrap().snapshotters, 3);
}

#[tokio::test]
async fn a_reload_that_would_orphan_unfinished_operations_is_refused_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("agent.toml");
    let script = opmon_tests::command_snapshotter_script();
    let table = format!(
        "[[snapshotter]]\nname = \"example.io/busy\"\napi_version = \"v2\"\ncommand = [{:?}, {:?}, {:?}]\n",
        script.display().to_string(),
        dir.path().join("journal").display().to_string(),
        dir.path().join("gates").display().to_string(),
    );
    std::fs::write(&config, &table).unwrap();
    let agent = start(dir.path(), &config);
    let client = Client::connect(&agent.socket).await.unwrap();
    let owner = opmon_tests::start_and_end_in_progress(
        &client.backups(),
        "b",
        vec![opmon_tests::operation(
            "example.io/busy",
            "gate-1",
            "a",
            &[],
        )],
    )
    .await;
    assert_eq!(
        owner.phase,
        opmon_client::OwnerPhase::WaitingForPluginOperations
    );
    // An emptied file would unregister the snapshotter its operation waits on.
    std::fs::write(&config, "").unwrap();
    agent.hangup();
    agent.wait_for_lines("reload refused", 1);
    assert!(
        agent.log().contains(
            "reload refused, the running configuration is unchanged: the file no longer has \
             [[snapshotter]] tables with unfinished operations: example.io/busy (waited on by \
             backup b (1))"
        ),
        "{}",
        agent.log()
    );
    assert_eq!(names(&client).await, ["example.io/busy"]);
    // A config file that never answers (a FIFO nobody writes) holds up the reload only.
    std::fs::remove_file(&config).unwrap();
    nix::unistd::mkfifo(&config, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    agent.hangup();
    agent.wait_for_lines("SIGHUP: reloading the configuration", 2);
    client.status().await.unwrap();
    assert!(
        !agent.log().contains("took longer than"),
        "the status call was answered only after the reload gave up:\n{}",
        agent.log()
    );
    agent.wait_for_lines("reading the configuration took longer than 5s", 1);
    assert_eq!(names(&client).await, ["example.io/busy"]);
}

/// A `[[snapshotter]]` whose command's program is missing is registered (a package or a
/// volume may bring the program later), but start and every reload warn, naming the
/// snapshotter and the program, until the program is there.
#[tokio::test]
async fn a_command_snapshotter_whose_program_is_missing_is_warned_of_at_start_and_reload() {
    let dir = tempfile::tempdir().unwrap();
    let program = dir.path().join("snap");
    let config = dir.path().join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "[[snapshotter]]\nname = \"example.io/cmd\"\napi_version = \"v2\"\ncommand = [{:?}]\n",
            program.display().to_string()
        ),
    )
    .unwrap();
    let agent = start(dir.path(), &config);
    let warning = format!(
        "the snapshotter's command cannot run: {}: No such file or directory (os error 2); \
         its operations wait until it can, and fail once unreachable_grace has passed \
         snapshotter=example.io/cmd program={}",
        program.display(),
        program.display()
    );
    agent.wait_for_lines(&warning, 1);
    agent.hangup();
    agent.wait_for_lines("configuration reloaded changes=0", 1);
    agent.wait_for_lines(&warning, 2);

    std::fs::write(&program, "#!/bin/sh\nexit 0\n").unwrap();
    std::fs::set_permissions(
        &program,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    agent.hangup();
    agent.wait_for_lines("configuration reloaded changes=0", 2);
    let log = agent.log();
    assert_eq!(
        log.lines().filter(|l| l.contains("cannot run")).count(),
        2,
        "{log}"
    );
    let client = Client::connect(&agent.socket).await.unwrap();
    assert_eq!(names(&client).await, ["example.io/cmd"]);
}
