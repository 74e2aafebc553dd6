//! `restic-snapshotter`: a file-level data mover built on opmon's SDK. It backs up a
//! directory into a restic repository with `restic backup --json` and restores a
//! snapshot with `restic restore`, and answers the agent's Progress and Cancel calls for
//! each.
//!
//! It needs `restic` on `PATH` (Debian/Ubuntu: `apt-get install restic`), a repository
//! made with `restic init`, and its password in a file (`--password-file`, passed to
//! restic as `RESTIC_PASSWORD_FILE`). Quick start: docs/restic-quickstart.md.
//!
//! Besides the snapshotter protocol, the socket serves `backup.start {path}` and
//! `restore.start {snapshot, target}`, each → `{operationId}`; the `start-backup` and
//! `start-restore` commands call them and print the ID.
//!
//! - Backup progress is restic's own status lines (`bytes_done` of `total_bytes`); on
//!   success the operation's description is `snapshot <ID>`, which the backup server
//!   reads from Progress (and from the item-operations file).
//! - Restic 0.14's `restore` prints no progress: a restore's `nCompleted` is the bytes
//!   of regular files written under its target so far, against the snapshot's size from
//!   `restic stats --mode restore-size`.
//! - Cancel sends restic SIGINT, on which restic removes its repository lock and exits
//!   (then `restic unlock` clears a lock it had no time to remove); the operation fails
//!   with `canceled`. A restic that exits otherwise fails the
//!   operation with restic's last error line.
//! - Operations are recorded in `<state dir>/operations.json` (the SDK's
//!   `OperationStore`) before their ID is handed out and whenever they end; one running when the
//!   snapshotter stopped is run again from the start at its next start (restic's
//!   deduplication makes a repeated backup cheap), so no operation is lost; then
//!   `restic unlock` removes the lock the killed restic left.

use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::sync::Arc;

use clap::{Args, Parser, Subcommand};
use jsonrpsee::types::error::INTERNAL_ERROR_CODE;
use jsonrpsee::types::ErrorObjectOwned;
use opmon_client::codes;
use opmon_client::error::chain;
use opmon_client::{OperationProgress, OperationRef, Timestamp};
use opmon_snapshotter::child::{die_with_parent, last_line, last_line_of};
use opmon_snapshotter::{
    rpc_module, serve_methods, termination, Hints, OperationHandler, OperationStore,
    SnapshotterError,
};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::Command;
use tokio::sync::oneshot;

const RESTIC: &str = "restic";

#[derive(Parser)]
#[command(
    name = "restic-snapshotter",
    about = "An opmon snapshotter that backs up and restores directories with restic"
)]
struct Cli {
    #[command(subcommand)]
    action: Action,
}

#[derive(Subcommand)]
enum Action {
    /// Serve the snapshotter protocol, backup.start and restore.start until SIGTERM.
    Serve(ServeArgs),
    /// Ask a running `serve` to back up a directory; prints the operation ID.
    StartBackup {
        #[arg(long)]
        socket: PathBuf,
        /// The directory to back up.
        #[arg(long)]
        path: PathBuf,
    },
    /// Ask a running `serve` to restore a snapshot; prints the operation ID.
    StartRestore {
        #[arg(long)]
        socket: PathBuf,
        /// The snapshot ID (as a backup's description gives it).
        #[arg(long)]
        snapshot: String,
        /// The directory to restore into.
        #[arg(long)]
        target: PathBuf,
    },
}

#[derive(Args)]
struct ServeArgs {
    /// The Unix socket to serve on (register this path with the agent).
    #[arg(long)]
    socket: PathBuf,
    /// Where the operations are remembered across restarts; created if missing.
    #[arg(long)]
    state_dir: PathBuf,
    /// The restic repository (`restic -r`).
    #[arg(long)]
    repo: String,
    /// The file holding the repository's password.
    #[arg(long)]
    password_file: PathBuf,
    /// The agent's socket, to tell it at once when an operation ends.
    #[arg(long, requires = "plugin")]
    agent_socket: Option<PathBuf>,
    /// The plugin name this snapshotter is registered under, for those hints.
    #[arg(long, requires = "agent_socket")]
    plugin: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct BackupStartParams {
    path: PathBuf,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RestoreStartParams {
    snapshot: String,
    target: PathBuf,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Started {
    operation_id: String,
}

/// What an operation does.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
enum Job {
    Backup { path: PathBuf },
    Restore { snapshot: String, target: PathBuf },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "camelCase")]
enum Status {
    Running,
    Completed,
    Failed { error: String },
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Record {
    job: Job,
    status: Status,
    n_completed: i64,
    n_total: i64,
    /// The backup's snapshot, once restic has written it.
    #[serde(default)]
    snapshot_id: Option<String>,
    #[serde(with = "time::serde::rfc3339::option")]
    started: Option<Timestamp>,
    #[serde(with = "time::serde::rfc3339::option")]
    updated: Option<Timestamp>,
}

impl Record {
    fn progress(&self) -> OperationProgress {
        let description = match (&self.job, &self.snapshot_id) {
            (Job::Backup { .. }, Some(id)) => format!("snapshot {id}"),
            (Job::Backup { path }, None) => format!("backing up {}", path.display()),
            (Job::Restore { snapshot, target }, _) => {
                format!("restoring snapshot {snapshot} to {}", target.display())
            }
        };
        OperationProgress {
            completed: self.status != Status::Running,
            err: match &self.status {
                Status::Failed { error } => Some(error.clone()),
                _ => None,
            },
            n_completed: self.n_completed,
            n_total: self.n_total,
            operation_units: "bytes".into(),
            description,
            started: self.started,
            updated: self.updated,
        }
    }
}

struct Mover {
    repo: String,
    password_file: PathBuf,
    ops: OperationStore<Record>,
    hints: Hints,
}

#[derive(Clone)]
struct ResticSnapshotter(Arc<Mover>);

impl OperationHandler for ResticSnapshotter {
    async fn progress(&self, op: OperationRef) -> Result<OperationProgress, SnapshotterError> {
        let record = self.0.ops.get(&op.operation_id);
        let Some(mut record) = record else {
            return Err(SnapshotterError::invalid_operation_id(op.operation_id));
        };
        // A restore's progress is what is on disk under its target, read now.
        if let (Job::Restore { target, .. }, Status::Running) = (&record.job, &record.status) {
            let target = target.clone();
            let written = tokio::task::spawn_blocking(move || bytes_under(&target))
                .await
                .unwrap_or(0);
            record.n_completed = i64::try_from(written)
                .unwrap_or(i64::MAX)
                .min(record.n_total);
        }
        Ok(record.progress())
    }

    /// Stops restic if it runs and returns once it has exited (its lock removed) and
    /// the failure is recorded; a finished or unknown operation is left alone.
    async fn cancel(&self, op: OperationRef) -> Result<(), SnapshotterError> {
        self.0.ops.stop(&op.operation_id).await;
        Ok(())
    }
}

impl Mover {
    fn open(args: &ServeArgs, hints: Hints) -> Result<Mover, String> {
        let password_file = std::path::absolute(&args.password_file)
            .map_err(|e| format!("--password-file {}: {e}", args.password_file.display()))?;
        Ok(Mover {
            repo: args.repo.clone(),
            password_file,
            ops: OperationStore::open(&args.state_dir).map_err(|e| chain(&e))?,
            hints,
        })
    }

    fn restic(&self) -> Command {
        let mut command = Command::new(RESTIC);
        command
            .arg("--repo")
            .arg(&self.repo)
            .env("RESTIC_PASSWORD_FILE", &self.password_file)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        die_with_parent(&mut command);
        command
    }

    /// Records `job` durably under a new ID, then starts it.
    async fn start(self: &Arc<Self>, job: Job, n_total: i64) -> Result<Started, ErrorObjectOwned> {
        let record = Record {
            job,
            status: Status::Running,
            n_completed: 0,
            n_total,
            snapshot_id: None,
            started: None,
            updated: None,
        };
        let id = self
            .ops
            .insert("restic", record)
            .await
            .map_err(|e| internal(chain(&e)))?;
        self.launch(&id, false);
        Ok(Started { operation_id: id })
    }

    /// Runs again, from the start, the operations the state file says were running.
    fn resume_interrupted(self: &Arc<Self>) {
        for id in self.ops.ids(|r| r.status == Status::Running) {
            eprintln!("{id}: interrupted by a restart; running it again");
            self.launch(&id, true);
        }
    }

    /// `interrupted`: the operation's first restic was killed with this snapshotter and
    /// left its lock.
    fn launch(self: &Arc<Self>, id: &str, interrupted: bool) {
        let (mover, task_id) = (Arc::clone(self), id.to_string());
        self.ops.launch(id, |stopped| async move {
            mover.run(task_id, stopped, interrupted).await
        });
    }

    async fn run(self: Arc<Self>, id: String, stopped: oneshot::Receiver<()>, interrupted: bool) {
        let Some(job) = self.ops.get(&id).map(|r| r.job) else {
            return;
        };
        let mut command = self.restic();
        match &job {
            Job::Backup { path } => {
                command.args(["backup", "--json"]).arg(path);
            }
            Job::Restore { snapshot, target } => {
                command
                    .args(["restore", snapshot.as_str(), "--target"])
                    .arg(target);
            }
        }
        let outcome = self.supervise(&id, command, stopped).await;
        if interrupted {
            // The killed restic's lock stays until `restic unlock`; by now its process
            // is surely gone (a lock whose process still exists is not stale).
            self.unlock(&id).await;
        }
        match &outcome {
            Ok(()) => eprintln!("{id}: completed"),
            Err(e) => eprintln!("{id}: failed: {e}"),
        }
        self.finish(&id, outcome).await;
    }

    /// Runs restic until it exits or `stopped` fires (then SIGINT, and waits for it).
    async fn supervise(
        &self,
        id: &str,
        mut command: Command,
        stopped: oneshot::Receiver<()>,
    ) -> Result<(), String> {
        let mut child = command
            .spawn()
            .map_err(|e| format!("cannot run {RESTIC}: {e}"))?;
        let now = OffsetDateTime::now_utc();
        self.ops.update(id, |record| {
            record.started = Some(now);
            record.updated = Some(now);
        });
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let pid = child.id();
        let work = async {
            let (status, (), last) = tokio::join!(
                child.wait(),
                self.follow_status(id, stdout),
                last_line_of(stderr)
            );
            (status, last)
        };
        tokio::pin!(work);
        let (status, last, canceled) = tokio::select! {
            (status, last) = &mut work => (status, last, false),
            Ok(()) = stopped => {
                // restic removes its lock on SIGINT before it exits.
                if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGINT,
                    );
                }
                let (status, last) = work.await;
                (status, last, true)
            }
        };
        if canceled {
            // restic removes its lock on SIGINT, except when the signal lands while it is
            // still taking the lock; `restic unlock` removes only locks whose process
            // is gone, so it cannot disturb another restic.
            self.unlock(id).await;
            return Err("canceled".into());
        }
        match status {
            Ok(status) if status.success() => Ok(()),
            Ok(status) => Err(last.unwrap_or_else(|| format!("{RESTIC} exited with {status}"))),
            Err(e) => Err(format!("waiting for {RESTIC}: {e}")),
        }
    }

    /// `restic unlock`: removes only locks whose process is gone, so it cannot disturb
    /// another restic.
    async fn unlock(&self, id: &str) {
        match self.restic().arg("unlock").output().await {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "{id}: restic unlock: {}",
                last_line(&String::from_utf8_lossy(&out.stderr)).unwrap_or_default()
            ),
            Err(e) => eprintln!("{id}: cannot run {RESTIC} unlock: {e}"),
        }
    }

    /// Reads `restic backup --json`'s lines: `status` updates move the counts, the
    /// `summary` names the snapshot.
    async fn follow_status(&self, id: &str, stdout: Option<impl AsyncRead + Unpin>) {
        let Some(stdout) = stdout else { return };
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let Ok(message) = serde_json::from_str::<ResticMessage>(&line) else {
                continue;
            };
            self.ops
                .update(id, |record| match message.message_type.as_str() {
                    "status" => {
                        let total = message.total_bytes.unwrap_or(0);
                        let done = message.bytes_done.unwrap_or(0).min(total.max(0));
                        record.n_total = total.max(record.n_total);
                        if done > record.n_completed {
                            record.n_completed = done;
                        }
                        record.updated = Some(OffsetDateTime::now_utc());
                    }
                    "summary" => {
                        record.snapshot_id = message.snapshot_id.clone();
                        if let Some(total) = message.total_bytes_processed {
                            record.n_total = total;
                            record.n_completed = total;
                        }
                        record.updated = Some(OffsetDateTime::now_utc());
                    }
                    _ => {}
                });
        }
    }

    /// Records how `id` ended: in the state file first, then in memory.
    async fn finish(&self, id: &str, outcome: Result<(), String>) {
        let now = OffsetDateTime::now_utc();
        let settle = |record: &mut Record| {
            match &outcome {
                Ok(()) => {
                    record.status = Status::Completed;
                    record.n_completed = record.n_total;
                }
                Err(error) => {
                    record.status = Status::Failed {
                        error: error.clone(),
                    }
                }
            }
            record.updated = Some(now);
        };
        if let Err(e) = self.ops.finish(id, settle).await {
            eprintln!("{id}: saving its outcome: {}", chain(&e));
        }
        self.hints.changed(id);
    }

    /// The size a restore of `snapshot` writes, from `restic stats`.
    async fn restore_size(&self, snapshot: &str) -> Result<i64, ErrorObjectOwned> {
        let mut command = self.restic();
        command.args(["stats", "--json", "--mode", "restore-size", snapshot]);
        let out = command
            .output()
            .await
            .map_err(|e| internal(format!("cannot run {RESTIC}: {e}")))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let reason = last_line(&stderr).unwrap_or_else(|| format!("exit {}", out.status));
            return Err(invalid_params(format!("snapshot: {snapshot}: {reason}")));
        }
        #[derive(Deserialize)]
        struct Stats {
            total_size: i64,
        }
        serde_json::from_slice::<Stats>(&out.stdout)
            .map(|s| s.total_size)
            .map_err(|e| internal(format!("reading restic stats: {e}")))
    }
}

/// One line of `restic backup --json` (restic 0.14), the fields used here.
#[derive(Deserialize)]
struct ResticMessage {
    message_type: String,
    total_bytes: Option<i64>,
    bytes_done: Option<i64>,
    snapshot_id: Option<String>,
    total_bytes_processed: Option<i64>,
}

/// Bytes of the regular files under `dir` (0 if it cannot be read).
fn bytes_under(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|entry| match entry.file_type() {
            Ok(t) if t.is_dir() => bytes_under(&entry.path()),
            Ok(t) if t.is_file() => entry.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

fn invalid_params(message: String) -> ErrorObjectOwned {
    ErrorObjectOwned::owned(codes::INVALID_PARAMS, message, None::<()>)
}

fn internal(message: String) -> ErrorObjectOwned {
    ErrorObjectOwned::owned(INTERNAL_ERROR_CODE, message, None::<()>)
}

/// An absolute path to an existing directory, or the error naming `field`.
fn directory(field: &str, path: &Path) -> Result<PathBuf, ErrorObjectOwned> {
    if !path.is_absolute() {
        return Err(invalid_params(format!(
            "{field}: {} is not an absolute path",
            path.display()
        )));
    }
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Ok(path.to_path_buf()),
        Ok(_) => Err(invalid_params(format!(
            "{field}: {} is not a directory",
            path.display()
        ))),
        Err(e) => Err(invalid_params(format!("{field}: {}: {e}", path.display()))),
    }
}

async fn serve(args: ServeArgs) -> Result<(), String> {
    let hints = match (&args.agent_socket, &args.plugin) {
        (Some(agent), Some(plugin)) => Hints::new(agent, plugin.as_str()),
        _ => Hints::none(),
    };
    let mover = Arc::new(Mover::open(&args, hints)?);
    mover.resume_interrupted();
    let mut module = rpc_module(ResticSnapshotter(Arc::clone(&mover)));
    module
        .register_async_method("backup.start", |params, s, _| async move {
            let params: BackupStartParams = params.parse()?;
            let path = directory("path", &params.path)?;
            s.0.start(Job::Backup { path }, 0).await
        })
        .map_err(|e| format!("registering backup.start: {e}"))?;
    module
        .register_async_method("restore.start", |params, s, _| async move {
            let params: RestoreStartParams = params.parse()?;
            let target = directory("target", &params.target)?;
            if params.snapshot.is_empty() || params.snapshot.starts_with('-') {
                return Err(invalid_params(format!(
                    "snapshot: {:?} is not a snapshot ID",
                    params.snapshot
                )));
            }
            let size = s.0.restore_size(&params.snapshot).await?;
            let job = Job::Restore {
                snapshot: params.snapshot,
                target,
            };
            s.0.start(job, size).await
        })
        .map_err(|e| format!("registering restore.start: {e}"))?;
    eprintln!(
        "serving on {} (state {}, repository {})",
        args.socket.display(),
        args.state_dir.display(),
        args.repo
    );
    serve_methods(&args.socket, module, termination())
        .await
        .map_err(|e| e.to_string())
}

async fn call(socket: &Path, method: &str, params: serde_json::Value) -> Result<(), String> {
    let shown = socket.display();
    let client = opmon_client::Client::connect(socket)
        .await
        .map_err(|e| format!("cannot reach a snapshotter at {shown}: {}", e.chain()))?;
    let started: Started = client.call(method, params).await.map_err(|e| match e {
        opmon_client::Error::Rpc { message, .. } => format!("{method} refused: {message}"),
        other => format!("{method} on {shown}: {}", other.chain()),
    })?;
    println!("{}", started.operation_id);
    Ok(())
}

fn absolute(flag: &str, path: &Path) -> Result<PathBuf, String> {
    std::path::absolute(path).map_err(|e| format!("{flag} {}: {e}", path.display()))
}

#[tokio::main]
async fn main() -> ExitCode {
    let result = match Cli::parse().action {
        Action::Serve(args) => serve(args).await,
        Action::StartBackup { socket, path } => match absolute("--path", &path) {
            Ok(path) => call(&socket, "backup.start", serde_json::json!({ "path": path })).await,
            Err(e) => Err(e),
        },
        Action::StartRestore {
            socket,
            snapshot,
            target,
        } => match absolute("--target", &target) {
            Ok(target) => {
                let params = serde_json::json!({ "snapshot": snapshot, "target": target });
                call(&socket, "restore.start", params).await
            }
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("restic-snapshotter: {e}");
            ExitCode::FAILURE
        }
    }
}
