//! End-to-end: the `qemu-img-snapshotter` example (client/snapshotter/examples) copying real qcow2
//! images with the real `qemu-img`, driven through the real agent: progress, cancel,
//! restarts, internal snapshots and bad input.
//!
//! Needs `qemu-img` and `qemu-io` on `PATH` (Debian: qemu-utils), and the example built,
//! which `cargo test --workspace` does.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use opmon_client::{
    codes, ApiVersion, Client, OperationPhase, OperationProgress, OwnerPhase, Snapshotter,
    WaitUntil,
};
use opmon_tests::{operation, Agent, RawHttp};
use serde_json::{json, Value};

/// The plugin name the example is registered under.
const PLUGIN: &str = "example.io/qemu-img";
const MIB: u64 = 1024 * 1024;
/// How long a condition may take before a polling loop gives up: generous, as it only
/// bounds a failure, never paces a success.
const PATIENCE: Duration = Duration::from_secs(60);
const LONG: Duration = Duration::from_secs(120);

/// The example binary, next to the test executables' directory (cargo builds examples
/// during `cargo test`).
fn example_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let path = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target directory")
        .join("examples/qemu-img-snapshotter");
    assert!(
        path.exists(),
        "{} is missing: run the tests with `cargo test --workspace`, which builds it",
        path.display()
    );
    path
}

/// Runs `program args…` and returns its output, failing the test if it cannot start.
fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {program} (is it installed?): {e}"))
}

/// Runs `program args…`, which must succeed.
fn run_ok(program: &str, args: &[&str]) {
    let out = run(program, args);
    assert!(
        out.status.success(),
        "{program} {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

fn arg(path: &Path) -> &str {
    path.to_str().expect("temporary paths are UTF-8")
}

/// A qcow2 image of `size_mib` MiB in `dir` with `writes` (pattern byte, offset MiB,
/// length MiB) written through qemu-io, so its clusters hold real data.
fn make_disk(dir: &Path, name: &str, size_mib: u64, writes: &[(u8, u64, u64)]) -> PathBuf {
    let disk = dir.join(name);
    run_ok(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            arg(&disk),
            &format!("{size_mib}M"),
        ],
    );
    for (pattern, offset, len) in writes {
        write_pattern(&disk, *pattern, *offset, *len);
    }
    disk
}

fn write_pattern(disk: &Path, pattern: u8, offset_mib: u64, len_mib: u64) {
    run_ok(
        "qemu-io",
        &[
            "-f",
            "qcow2",
            "-c",
            &format!("write -P {pattern:#x} {offset_mib}M {len_mib}M"),
            arg(disk),
        ],
    );
}

/// `qemu-img compare`'s exit code: 0 identical, 1 different.
fn compare(a: &Path, b: &Path) -> i32 {
    let out = run("qemu-img", &["compare", arg(a), arg(b)]);
    out.status
        .code()
        .unwrap_or_else(|| panic!("qemu-img compare died: {}", out.status))
}

/// Names of the files in `dir`, sorted.
fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .map(|e| {
            e.expect("directory entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    names
}

/// PIDs of live processes one of whose arguments is exactly `path`.
fn processes_with_argument(path: &Path) -> Vec<String> {
    let wanted = path.as_os_str().as_bytes();
    std::fs::read_dir("/proc")
        .expect("listing /proc")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().as_bytes().iter().all(u8::is_ascii_digit))
        .filter(|e| {
            // Zombies and processes gone meanwhile have no (readable) command line.
            std::fs::read(e.path().join("cmdline"))
                .map(|cmdline| cmdline.split(|b| *b == 0).any(|a| a == wanted))
                .unwrap_or(false)
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Whether process `pid` is gone or a zombie: either way its files are closed (the
/// kernel closes them before the process becomes a zombie).
fn exited(pid: &str) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses and may hold any
        // character: read after the last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => true,
    }
}

/// Polls `probe` until it returns `Some`, failing the test after [`PATIENCE`].
async fn poll_until<T>(what: &str, probe: impl FnMut() -> Option<T>) -> T {
    opmon_tests::eventually_async(what, PATIENCE, probe).await
}

/// A running `qemu-img-snapshotter serve` with its socket, state and backup directory
/// in a test's temporary directory.
struct QemuImgSnapshotter {
    child: Option<Child>,
    socket: PathBuf,
    state_dir: PathBuf,
    backup_dir: PathBuf,
    log: PathBuf,
}

impl QemuImgSnapshotter {
    fn start(dir: &Path) -> QemuImgSnapshotter {
        let mut s = QemuImgSnapshotter {
            child: None,
            socket: dir.join("qemu-img.sock"),
            state_dir: dir.join("qemu-img-state"),
            backup_dir: dir.join("backups"),
            log: dir.join("qemu-img-snapshotter.log"),
        };
        s.launch();
        s
    }

    /// Spawns `serve` and waits until its socket accepts connections.
    fn launch(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("snapshotter log");
        let mut child = Command::new(example_binary())
            .arg("serve")
            .arg("--socket")
            .arg(&self.socket)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .arg("--backup-dir")
            .arg(&self.backup_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawning qemu-img-snapshotter");
        opmon_tests::wait_for_socket(&self.socket, &mut child, &self.log);
        self.child = Some(child);
    }

    /// SIGKILL: no chance to clean up or to stop its qemu-img processes.
    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn restart(&mut self) {
        assert!(
            self.child.is_none(),
            "stop the snapshotter before restarting it"
        );
        self.launch();
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn registration(&self) -> Snapshotter {
        Snapshotter {
            name: PLUGIN.into(),
            api_version: ApiVersion::V2,
            socket: Some(self.socket.clone()),
            command: None,
            ..Default::default()
        }
    }

    /// Runs the example's `start` command with `extra` flags.
    fn start_command(&self, extra: &[&str]) -> Output {
        Command::new(example_binary())
            .arg("start")
            .arg("--socket")
            .arg(&self.socket)
            .args(extra)
            .stdin(Stdio::null())
            .output()
            .expect("running qemu-img-snapshotter start")
    }

    /// Starts a copy of `disk` with the `start` command; returns the operation ID, which
    /// must be all the command printed.
    fn start_copy(&self, disk: &Path, snapshot: Option<&str>, rate_limit: Option<u64>) -> String {
        let mut args = vec!["--disk".to_string(), arg(disk).to_string()];
        if let Some(snapshot) = snapshot {
            args.extend(["--snapshot".into(), snapshot.into()]);
        }
        if let Some(rate) = rate_limit {
            args.extend(["--rate-limit".into(), rate.to_string()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = self.start_command(&args);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "start failed: {}\n{stdout}\nlog:\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.log_text()
        );
        let id = stdout
            .strip_suffix('\n')
            .unwrap_or_else(|| panic!("{stdout:?} is not one line"));
        assert!(
            !id.is_empty() && !id.contains(char::is_whitespace),
            "{stdout:?} is not an operation ID alone"
        );
        id.to_string()
    }

    /// One JSON-RPC call on the snapshotter's socket; the whole answer.
    fn call(&self, method: &str, params: Value) -> Value {
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
        RawHttp::connect(&self.socket).call(&body.to_string())
    }

    /// The snapshotter protocol's `operation.*` call for operation `id`.
    fn call_operation(&self, method: &str, id: &str) -> Value {
        self.call(
            method,
            json!({
                "plugin": {"kind": "BackupItemAction", "name": PLUGIN},
                "operationId": id,
                "owner": {"kind": "backup", "name": "b", "uid": "u"},
            }),
        )
    }

    /// `operation.progress` of `id`, which must succeed.
    fn progress(&self, id: &str) -> OperationProgress {
        let answer = self.call_operation("operation.progress", id);
        serde_json::from_value(answer["result"].clone())
            .unwrap_or_else(|e| panic!("progress of {id}: {e}: {answer}"))
    }

    /// Polls Progress of `id` until `done` holds for it.
    async fn progress_until(
        &self,
        id: &str,
        what: &str,
        done: impl Fn(&OperationProgress) -> bool,
    ) -> OperationProgress {
        poll_until(&format!("{id} {what}"), || {
            let p = self.progress(id);
            done(&p).then_some(p)
        })
        .await
    }

    fn final_file(&self, id: &str) -> PathBuf {
        self.backup_dir.join(format!("{id}.qcow2"))
    }

    fn partial_file(&self, id: &str) -> PathBuf {
        self.backup_dir.join(format!("{id}.qcow2.partial"))
    }
}

impl Drop for QemuImgSnapshotter {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// An agent in `dir` with `s` registered for [`PLUGIN`], and a client of it.
async fn agent_for(dir: &Path, s: &QemuImgSnapshotter) -> (Agent, Client) {
    let agent = Agent::start(dir, &[]);
    let client = agent.client().await;
    client
        .register_snapshotter(s.registration())
        .await
        .expect("registering qemu-img-snapshotter");
    (agent, client)
}

/// Starts backup `name` with the one operation `id` of [`PLUGIN`] and ends InProgress.
async fn backup_of(client: &Client, name: &str, id: &str) {
    let backups = client.backups();
    backups.start(name, "uid-1").await.unwrap();
    let added = backups
        .add_operations(name, vec![operation(PLUGIN, id, "vm-disk", &[])])
        .await
        .unwrap();
    assert_eq!(added.added, 1);
    let owner = backups.end_in_progress(name).await.unwrap();
    assert!(
        owner.phase == OwnerPhase::WaitingForPluginOperations
            || owner.phase == OwnerPhase::Finalizing,
        "{:?}",
        owner.phase
    );
}

fn assert_never_decreases(samples: &[i64], source: &str) {
    assert!(
        samples.windows(2).all(|w| w[0] <= w[1]),
        "nCompleted decreased in the samples from {source}: {samples:?}"
    );
}

#[tokio::test]
async fn a_rate_limited_copy_reports_growing_progress_and_yields_an_identical_image() {
    let dir = tempfile::tempdir().unwrap();
    let disk = make_disk(
        dir.path(),
        "disk.qcow2",
        64,
        &[(0xab, 0, 40), (0x5c, 40, 24)],
    );
    let s = QemuImgSnapshotter::start(dir.path());
    let (_agent, client) = agent_for(dir.path(), &s).await;
    let id = s.start_copy(&disk, None, Some(16 * MIB));
    backup_of(&client, "nightly", &id).await;

    // Sample the progress the snapshotter reports and the one the agent records until
    // both say the copy is over.
    let backups = client.backups();
    let (mut direct, mut recorded) = (Vec::new(), Vec::new());
    let start = Instant::now();
    loop {
        let p = s.progress(&id);
        direct.push(p.n_completed);
        let ops = backups.operations("nightly").await.unwrap();
        assert_eq!(ops.len(), 1);
        recorded.push(ops[0].n_completed);
        if p.completed && !ops[0].phase.is_unfinished() {
            break;
        }
        assert!(start.elapsed() < LONG, "the copy did not finish: {p:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_never_decreases(&direct, "the snapshotter");
    assert_never_decreases(&recorded, "the agent");

    let waited = backups
        .wait("nightly", WaitUntil::ReadyToFinalize, LONG)
        .await
        .unwrap();
    assert_eq!(waited.owner.phase, OwnerPhase::Finalizing);
    assert_eq!(waited.owner.operations_completed, 1);

    let p = s.progress(&id);
    assert!(p.completed);
    assert_eq!(p.err, None);
    assert_eq!((p.n_completed, p.n_total), (64 << 20, 64 << 20));
    assert_eq!(p.operation_units, "bytes");
    assert_eq!(p.description, "copying disk.qcow2");
    let (started, updated) = (p.started.unwrap(), p.updated.unwrap());
    assert!(
        started <= updated,
        "started {started} after updated {updated}"
    );

    let op = &backups.operations("nightly").await.unwrap()[0];
    assert_eq!(op.phase, OperationPhase::Completed);
    assert_eq!(op.error, None);
    assert_eq!((op.n_completed, op.n_total), (64 << 20, 64 << 20));
    // The agent keeps times to the millisecond.
    let millis = |t: time::OffsetDateTime| t.unix_timestamp_nanos() / 1_000_000;
    assert_eq!(op.started.map(millis), Some(millis(started)));

    assert_eq!(files_in(&s.backup_dir), [format!("{id}.qcow2")]);
    assert_eq!(compare(&disk, &s.final_file(&id)), 0, "the copy differs");
}

#[tokio::test]
async fn deleting_the_backup_cancels_the_copy_and_leaves_no_file_behind() {
    let dir = tempfile::tempdir().unwrap();
    let disk = make_disk(dir.path(), "disk.qcow2", 64, &[(0xab, 0, 64)]);
    let s = QemuImgSnapshotter::start(dir.path());
    let (_agent, client) = agent_for(dir.path(), &s).await;
    // At 2 MiB/s the copy would take half a minute: it is cancelled long before.
    let id = s.start_copy(&disk, None, Some(2 * MIB));
    backup_of(&client, "doomed", &id).await;
    let p = s
        .progress_until(&id, "makes progress", |p| p.n_completed > 0 || p.completed)
        .await;
    assert!(!p.completed, "the slow copy is already over: {p:?}");
    assert!(
        s.partial_file(&id).exists(),
        "qemu-img writes the partial file"
    );
    assert_eq!(processes_with_argument(&s.partial_file(&id)).len(), 1);

    let deleted = client.backups().delete("doomed").await.unwrap();
    assert_eq!(deleted.canceled, 1);

    // Cancel returns once the copy is torn down: nothing left, nothing still writing.
    assert_eq!(files_in(&s.backup_dir), Vec::<String>::new());
    assert_eq!(
        processes_with_argument(&s.partial_file(&id)),
        Vec::<String>::new()
    );
    let p = s.progress(&id);
    assert!(p.completed);
    assert_eq!(p.err.as_deref(), Some("cancelled"));
    assert_eq!(p.n_total, 64 << 20);

    // Cancelling a finished or an unknown operation is not an error.
    for id in [id.as_str(), "copy-unknown"] {
        let answer = s.call_operation("operation.cancel", id);
        assert_eq!(answer.get("error"), None, "{answer}");
        assert_eq!(answer["result"], Value::Null);
    }
    assert_eq!(s.progress(&id).err.as_deref(), Some("cancelled"));
}

#[tokio::test]
async fn cancelling_the_backup_mid_copy_stops_qemu_img_and_fails_the_backup_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let disk = make_disk(dir.path(), "disk.qcow2", 64, &[(0xcd, 0, 64)]);
    let s = QemuImgSnapshotter::start(dir.path());
    let (_agent, client) = agent_for(dir.path(), &s).await;
    // At 2 MiB/s the copy would take half a minute: it is cancelled long before.
    let id = s.start_copy(&disk, None, Some(2 * MIB));
    backup_of(&client, "vm-1", &id).await;
    // Mid-copy: the agent has recorded progress and qemu-img is writing.
    let backups = client.backups();
    let start = Instant::now();
    while backups.operations("vm-1").await.unwrap()[0].n_completed == 0 {
        assert!(start.elapsed() < PATIENCE, "the agent recorded no progress");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(processes_with_argument(&s.partial_file(&id)).len(), 1);

    let result = backups
        .request::<opmon_client::methods::Cancel>(opmon_client::CancelParams {
            name: "vm-1".into(),
            operations: None,
            reason: Some("the VM was deleted".into()),
        })
        .await
        .unwrap();
    assert_eq!((result.canceled, result.unconfirmed), (1, 0));
    assert_eq!(result.owner.phase, OwnerPhase::Failed);
    assert_eq!(
        result.owner.failure_reason.as_deref(),
        Some("canceled: the VM was deleted")
    );

    // The answer comes once the snapshotter confirmed: the copy process is gone, its
    // partial file too.
    assert_eq!(
        processes_with_argument(&s.partial_file(&id)),
        Vec::<String>::new()
    );
    assert_eq!(files_in(&s.backup_dir), Vec::<String>::new());
    assert_eq!(s.progress(&id).err.as_deref(), Some("cancelled"));
    let op = &backups.operations("vm-1").await.unwrap()[0];
    assert_eq!(op.phase, OperationPhase::Canceled);
    assert_eq!(op.error.as_deref(), Some("canceled: the VM was deleted"));
    assert!(!op.cancel_requested);
    assert!(op.n_completed > 0 && op.n_completed < op.n_total, "{op:?}");
}

#[tokio::test]
async fn a_restarted_snapshotter_still_answers_for_its_finished_copies() {
    let dir = tempfile::tempdir().unwrap();
    let disk = make_disk(dir.path(), "disk.qcow2", 8, &[(0x11, 0, 8)]);
    let mut s = QemuImgSnapshotter::start(dir.path());
    let id = s.start_copy(&disk, None, None);
    let before = s.progress_until(&id, "completes", |p| p.completed).await;
    assert_eq!(before.err, None);

    s.kill9();
    s.restart();
    let after = s.progress(&id);
    assert_eq!(after, before, "the restart changed what Progress reports");
    assert_eq!((after.n_completed, after.n_total), (8 << 20, 8 << 20));

    let unknown = s.call_operation("operation.progress", "copy-unknown");
    assert_eq!(unknown["error"]["code"], codes::INVALID_OPERATION_ID);
    assert_eq!(
        unknown["error"]["message"],
        "invalid operation ID: copy-unknown"
    );

    // The agent, meeting the operation only now, sees it completed at once.
    let (_agent, client) = agent_for(dir.path(), &s).await;
    backup_of(&client, "late", &id).await;
    let waited = client
        .backups()
        .wait("late", WaitUntil::ReadyToFinalize, LONG)
        .await
        .unwrap();
    assert_eq!(waited.owner.phase, OwnerPhase::Finalizing);
    assert_eq!(compare(&disk, &s.final_file(&id)), 0);
}

#[tokio::test]
async fn a_copy_cut_short_by_a_crash_is_copied_again_from_scratch_after_the_restart() {
    let dir = tempfile::tempdir().unwrap();
    let disk = make_disk(dir.path(), "disk.qcow2", 16, &[(0x21, 0, 8), (0x42, 8, 8)]);
    let mut s = QemuImgSnapshotter::start(dir.path());
    // At 2 MiB/s the copy takes about 8 s: the crash comes long before its end.
    let id = s.start_copy(&disk, None, Some(2 * MIB));
    let cut = s
        .progress_until(&id, "makes progress", |p| p.n_completed > 0 || p.completed)
        .await;
    assert!(!cut.completed, "the slow copy is already over: {cut:?}");

    let copiers = processes_with_argument(&s.partial_file(&id));
    assert!(
        !copiers.is_empty(),
        "no qemu-img copying to the partial file"
    );
    s.kill9();
    // qemu-img dies with the snapshotter instead of finishing the copy as an orphan. Its
    // command line goes before its files (and the image lock) are closed, so wait for
    // the process itself to be gone or a zombie, not for the command line.
    poll_until("qemu-img exits with its snapshotter", || {
        copiers.iter().all(|pid| exited(pid)).then_some(())
    })
    .await;
    assert!(!s.final_file(&id).exists());

    s.restart();
    let restarted = s.progress(&id);
    assert!(!restarted.completed, "{restarted:?}");
    assert!(
        restarted.n_completed < cut.n_completed || restarted.started > cut.started,
        "the copy did not start over: before {cut:?}, after {restarted:?}"
    );
    let done = s.progress_until(&id, "completes", |p| p.completed).await;
    assert_eq!(done.err, None);
    assert_eq!((done.n_completed, done.n_total), (16 << 20, 16 << 20));
    assert!(done.started > cut.started, "started is that of the new run");
    assert_eq!(files_in(&s.backup_dir), [format!("{id}.qcow2")]);
    assert_eq!(compare(&disk, &s.final_file(&id)), 0);
}

#[tokio::test]
async fn copying_an_internal_snapshot_yields_the_disk_as_it_was_when_snapshotted() {
    let dir = tempfile::tempdir().unwrap();
    let disk = make_disk(dir.path(), "disk.qcow2", 8, &[(0xab, 0, 8)]);
    let then = dir.path().join("then.qcow2");
    std::fs::copy(&disk, &then).unwrap();
    run_ok("qemu-img", &["snapshot", "-c", "snap1", arg(&disk)]);
    write_pattern(&disk, 0xcd, 2, 4);
    assert_eq!(
        compare(&disk, &then),
        1,
        "the disk changed after the snapshot"
    );

    let s = QemuImgSnapshotter::start(dir.path());
    let id = s.start_copy(&disk, Some("snap1"), None);
    let p = s.progress_until(&id, "completes", |p| p.completed).await;
    assert_eq!(p.err, None);
    assert_eq!(p.description, "copying snapshot snap1 of disk.qcow2");
    assert_eq!(p.n_completed, 8 << 20);
    assert_eq!(compare(&then, &s.final_file(&id)), 0, "not the snapshot");
    assert_eq!(compare(&disk, &s.final_file(&id)), 1, "the current disk");
}

#[tokio::test]
async fn copy_start_refuses_bad_input_with_errors_that_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let disk = make_disk(dir.path(), "disk.qcow2", 1, &[]);
    let raw = dir.path().join("raw.img");
    std::fs::write(&raw, [0u8; 4096]).unwrap();
    let missing = dir.path().join("missing.qcow2");
    let s = QemuImgSnapshotter::start(dir.path());

    let refused = |extra: &[&str]| {
        let out = s.start_command(extra);
        assert!(!out.status.success(), "{extra:?} was accepted");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "", "{extra:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let prefix = "qemu-img-snapshotter: copy.start refused: ";
    assert_eq!(
        refused(&["--disk", arg(&missing)]),
        format!("{prefix}disk: {} does not exist\n", missing.display())
    );
    assert_eq!(
        refused(&["--disk", arg(dir.path())]),
        format!(
            "{prefix}disk: {} is not a regular file\n",
            dir.path().display()
        )
    );
    assert_eq!(
        refused(&["--disk", arg(&disk), "--snapshot", "nope"]),
        format!(
            "{prefix}snapshot: {} has no internal snapshot named \"nope\"\n",
            disk.display()
        )
    );
    assert_eq!(
        refused(&["--disk", arg(&disk), "--rate-limit", "0"]),
        format!("{prefix}rateLimit: must be at least 1 byte per second\n")
    );
    let not_qcow2 = refused(&["--disk", arg(&raw)]);
    let expected = format!(
        "{prefix}disk: qemu-img info {} failed: qemu-img: ",
        raw.display()
    );
    assert!(not_qcow2.starts_with(&expected), "{not_qcow2}");
    assert!(not_qcow2.contains("not in qcow2 format"), "{not_qcow2}");

    // The JSON-RPC method itself: relative paths and unknown fields are refused.
    let relative = s.call("copy.start", json!({"disk": "disk.qcow2"}));
    assert_eq!(relative["error"]["code"], codes::INVALID_PARAMS);
    assert_eq!(
        relative["error"]["message"],
        "disk: \"disk.qcow2\" is not an absolute path"
    );
    let unknown = s.call("copy.start", json!({"disk": arg(&disk), "speed": 1}));
    assert_eq!(unknown["error"]["code"], codes::INVALID_PARAMS, "{unknown}");

    // A socket nobody serves on.
    let nowhere = dir.path().join("nowhere.sock");
    let out = Command::new(example_binary())
        .args(["start", "--socket", arg(&nowhere), "--disk", arg(&disk)])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let expected = format!(
        "qemu-img-snapshotter: cannot connect to a snapshotter at {}: ",
        nowhere.display()
    );
    assert!(stderr.starts_with(&expected), "{stderr}");

    // Nothing was started or recorded.
    assert_eq!(files_in(&s.backup_dir), Vec::<String>::new());
    let state = s.state_dir.join("operations.json");
    if let Ok(text) = std::fs::read_to_string(&state) {
        let state: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(state["operations"], json!({}), "{text}");
    }
}

/// The Rust client's README example, client/examples/backup.rs (the README shows the
/// file whole), run as the README's line says beside a real agent and
/// qemu-img-snapshotter: it prints what the README says it prints; run again, its backup
/// already finalized, it says why it cannot in one plain line.
#[tokio::test]
async fn the_client_readmes_example_backs_up_a_disk_as_printed() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(repo.join("client/README.md")).expect("README");
    let program =
        std::fs::read_to_string(repo.join("client/examples/backup.rs")).expect("the example");
    assert!(
        readme.contains(&format!("```rust,no_run\n{program}```\n")),
        "client/README.md does not show client/examples/backup.rs as it is"
    );
    let line = "\ncargo run --example backup -- \"$op\"\n";
    assert!(
        readme.contains(line),
        "the README no longer runs it with{line}"
    );
    assert!(readme.contains("it prints `nightly-rust is Completed`"));

    let example = example_binary().with_file_name("backup");
    let dir = tempfile::tempdir().unwrap();
    let disk = make_disk(dir.path(), "disk.qcow2", 8, &[(0xab, 0, 8)]);
    let s = QemuImgSnapshotter::start(dir.path());
    let (agent, _client) = agent_for(dir.path(), &s).await;
    let run = |op: &str| {
        Command::new(&example)
            .arg(op)
            .env("OPMON_SOCKET", &agent.socket)
            .stdin(Stdio::null())
            .output()
            .expect("running the client's example")
    };
    let out = run(&s.start_copy(&disk, None, None));
    assert_eq!(
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).as_ref(),
            String::from_utf8_lossy(&out.stderr).as_ref()
        ),
        (Some(0), "nightly-rust is Completed\n", "")
    );
    let out = run(&s.start_copy(&disk, None, None));
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "backup nightly-rust: backup nightly-rust is Completed; \
         addOperations is allowed only while InProgress (code 1003)\n"
    );
}
