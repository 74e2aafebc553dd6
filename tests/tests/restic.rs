//! End-to-end: the `restic-snapshotter` example (client/snapshotter/examples) with the real
//! `restic` (Debian's 0.14): a backup's progress and snapshot ID, a restore equal to
//! its source, a cancel that leaves the repository unlocked and usable, a restic that
//! fails or dies, and a snapshotter restart that loses no operation.
//!
//! To catch restic in the middle of its work without racing it, a test stops it
//! (SIGSTOP) once its repository lock exists, acts, and lets it go on (SIGCONT).
//! Under `CI` a missing `restic` fails the tests; elsewhere they are skipped.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use opmon_client::OperationProgress;
use opmon_tests::RawHttp;
use serde_json::{json, Value};

const PLUGIN: &str = "example.io/restic";
const LONG: Duration = Duration::from_secs(120);

fn have_restic() -> bool {
    let found = Command::new("restic")
        .arg("version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var_os("CI").is_none_or(|v| v.is_empty()),
            "restic is not installed (.ci/run installs it)"
        );
        eprintln!("skipped: restic is not installed");
    }
    found
}

fn example_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("target directory")
        .join("examples/restic-snapshotter")
}

/// A repository, a password, a source of `files` files of 1 MiB, a snapshotter.
struct Setup {
    dir: tempfile::TempDir,
    snapshotter: Option<Child>,
}

impl Setup {
    fn new(files: usize) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("password"), "opmon-test\n").unwrap();
        let init = restic(dir.path(), &["init"]);
        assert!(init.status.success(), "{init:?}");
        let source = dir.path().join("source");
        std::fs::create_dir(&source).unwrap();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..files {
            // Incompressible, distinct content, without a random-number crate.
            let bytes: Vec<u8> = (0..(1 << 20) / 8)
                .flat_map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed.to_le_bytes()
                })
                .collect();
            std::fs::write(source.join(format!("file-{i}")), bytes).unwrap();
        }
        let mut setup = Setup {
            dir,
            snapshotter: None,
        };
        setup.serve();
        setup
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn serve(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path("snapshotter.log"))
            .unwrap();
        let socket = self.path("restic.sock");
        let _ = std::fs::remove_file(&socket);
        let mut child = Command::new(example_binary())
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(self.path("state"))
            .arg("--repo")
            .arg(self.path("repo"))
            .arg("--password-file")
            .arg(self.path("password"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starting restic-snapshotter");
        opmon_tests::wait_for_socket(&socket, &mut child, &self.path("snapshotter.log"));
        self.snapshotter = Some(child);
    }

    fn kill9(&mut self) {
        if let Some(mut child) = self.snapshotter.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn call(&self, method: &str, params: Value) -> Value {
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
        RawHttp::connect(&self.path("restic.sock")).call(&body.to_string())
    }

    fn start_backup(&self) -> String {
        let answer = self.call("backup.start", json!({"path": self.path("source")}));
        answer["result"]["operationId"]
            .as_str()
            .unwrap_or_else(|| panic!("{answer}"))
            .to_string()
    }

    fn operation(&self, method: &str, id: &str) -> Value {
        self.call(
            method,
            json!({
                "plugin": {"kind": "BackupItemAction", "name": PLUGIN},
                "operationId": id,
                "owner": {"kind": "backup", "name": "b", "uid": "u"},
            }),
        )
    }

    fn progress(&self, id: &str) -> OperationProgress {
        let answer = self.operation("operation.progress", id);
        serde_json::from_value(answer["result"].clone()).unwrap_or_else(|_| panic!("{answer}"))
    }

    fn finished(&self, id: &str) -> OperationProgress {
        opmon_tests::eventually(format!("{id} finishes"), LONG, || {
            let p = self.progress(id);
            p.completed.then_some(p)
        })
    }

    fn locks(&self) -> usize {
        std::fs::read_dir(self.path("repo/locks")).map_or(0, |d| d.count())
    }

    /// The running restic's pid, once its repository lock exists; stopped.
    fn stopped_restic(&self) -> Pid {
        let repo = self.path("repo");
        let pid = opmon_tests::eventually("restic runs with its lock", LONG, || {
            let pid = restic_pids(&repo).into_iter().next()?;
            (self.locks() > 0).then_some(pid)
        });
        kill(pid, Signal::SIGSTOP).unwrap();
        pid
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.path("snapshotter.log")).unwrap_or_default()
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn restic(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new("restic")
        .arg("--repo")
        .arg(dir.join("repo"))
        .args(args)
        .env("RESTIC_PASSWORD_FILE", dir.join("password"))
        .output()
        .expect("running restic")
}

/// restic processes whose command line names `repo`.
fn restic_pids(repo: &Path) -> Vec<Pid> {
    let wanted = repo.as_os_str().as_bytes();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let mut args = c.split(|b| *b == 0);
                args.next().is_some_and(|a| a.ends_with(b"restic")) && args.any(|a| a == wanted)
            })
        })
        .map(Pid::from_raw)
        .collect()
}

#[test]
fn a_backup_reports_restics_bytes_and_its_snapshot_and_restores_equal() {
    if !have_restic() {
        return;
    }
    let s = Setup::new(16);
    let id = s.start_backup();
    let done = s.finished(&id);
    assert_eq!(done.err, None, "{}", s.log());
    assert_eq!(done.n_total, 16 << 20);
    assert_eq!(done.n_completed, done.n_total);
    let snapshot = done
        .description
        .strip_prefix("snapshot ")
        .unwrap_or_else(|| panic!("{done:?}"))
        .to_string();
    let listed = restic(s.dir.path(), &["snapshots", "--json"]);
    assert!(String::from_utf8_lossy(&listed.stdout).contains(&snapshot));

    let target = s.path("restored");
    std::fs::create_dir(&target).unwrap();
    let answer = s.call(
        "restore.start",
        json!({"snapshot": snapshot, "target": target}),
    );
    let restore = answer["result"]["operationId"]
        .as_str()
        .unwrap()
        .to_string();
    let restored = s.finished(&restore);
    assert_eq!(restored.err, None);
    assert_eq!(restored.n_total, 16 << 20);
    let diff = Command::new("diff")
        .arg("-r")
        .arg(s.path("source"))
        .arg(target.join(s.path("source").strip_prefix("/").unwrap()))
        .status()
        .unwrap();
    assert!(diff.success());
}

#[test]
fn a_cancel_stops_restic_with_its_lock_released_and_a_later_backup_works() {
    if !have_restic() {
        return;
    }
    let s = Setup::new(8);
    let id = s.start_backup();
    let pid = s.stopped_restic();
    let canceling = std::thread::spawn({
        let socket = s.path("restic.sock");
        let id = id.clone();
        move || {
            let body = json!({"jsonrpc": "2.0", "id": 1, "method": "operation.cancel",
                "params": {"plugin": {"kind": "BackupItemAction", "name": PLUGIN},
                "operationId": id, "owner": {"kind": "backup", "name": "b", "uid": "u"}}});
            RawHttp::connect(&socket).call(&body.to_string())
        }
    });
    // The cancel's SIGINT waits for restic to go on.
    opmon_tests::eventually("the cancel reaches restic", LONG, || {
        std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
            s.lines()
                .any(|l| l.starts_with("SigPnd:") && l != "SigPnd:\t0000000000000000")
                || s.lines()
                    .any(|l| l.starts_with("ShdPnd:") && l != "ShdPnd:\t0000000000000000")
        })
    });
    kill(pid, Signal::SIGCONT).unwrap();
    let answer = canceling.join().unwrap();
    assert!(answer.get("error").is_none(), "{answer}");
    let p = s.progress(&id);
    assert!(p.completed);
    assert_eq!(p.err.as_deref(), Some("canceled"));
    assert_eq!(s.locks(), 0, "restic left its lock");
    let check = restic(s.dir.path(), &["check"]);
    assert!(check.status.success(), "{check:?}");
    let again = s.start_backup();
    assert_eq!(s.finished(&again).err, None, "{}", s.log());
}

#[test]
fn a_restic_that_fails_or_dies_fails_the_operation_with_its_last_error_line() {
    if !have_restic() {
        return;
    }
    let mut s = Setup::new(4);
    // restic's own error: the wrong password.
    std::fs::write(s.path("password"), "not-the-password\n").unwrap();
    let id = s.start_backup();
    let p = s.finished(&id);
    assert_eq!(
        p.err.as_deref(),
        Some("Fatal: wrong password or no key found")
    );
    std::fs::write(s.path("password"), "opmon-test\n").unwrap();
    // restic killed in the middle.
    let id = s.start_backup();
    let pid = s.stopped_restic();
    kill(pid, Signal::SIGKILL).unwrap();
    let p = s.finished(&id);
    assert!(
        p.err
            .as_deref()
            .is_some_and(|err| err.contains("signal: 9")),
        "{p:?}"
    );
    s.kill9();
}

#[test]
fn a_restarted_snapshotter_keeps_its_operations_and_runs_the_interrupted_ones_again() {
    if !have_restic() {
        return;
    }
    let mut s = Setup::new(8);
    let first = s.start_backup();
    let done = s.finished(&first);
    let second = s.start_backup();
    let pid = s.stopped_restic();
    // The snapshotter dies; its restic dies with it (PR_SET_PDEATHSIG).
    s.kill9();
    // Gone, not a zombie: restic takes the lock of a process that still exists (a zombie
    // not yet reaped by init) for a live one, and `restic unlock` keeps it.
    opmon_tests::eventually("restic is gone", LONG, || {
        std::fs::metadata(format!("/proc/{pid}"))
            .is_err()
            .then_some(())
    });
    s.serve();
    assert_eq!(s.progress(&first).description, done.description);
    let again = s.finished(&second);
    assert_eq!(again.err, None, "{}", s.log());
    assert!(again.description.starts_with("snapshot "), "{again:?}");
    // The killed restic's lock is gone: commands that lock exclusively work again.
    let check = restic(s.dir.path(), &["check"]);
    assert!(
        check.status.success(),
        "restic check: {}",
        String::from_utf8_lossy(&check.stderr)
    );
}
