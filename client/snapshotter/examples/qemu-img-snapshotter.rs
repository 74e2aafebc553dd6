//! `qemu-img-snapshotter`: a real snapshotter built on opmon's SDK. It copies qcow2 disk
//! images (or one of their internal snapshots) into a backup directory with
//! `qemu-img convert`, and answers the agent's Progress and Cancel calls for each copy.
//!
//! It needs `qemu-img` on `PATH` (Debian/Ubuntu: `apt-get install qemu-utils`). With an
//! agent running and the README quick start's `call` helper defined, serve it, register
//! it, start a copy with its own `start` command and hand the operation ID to a backup:
//!
//! ```sh
//! cargo build -p opmon-snapshotter --example qemu-img-snapshotter
//! Q=target/debug/examples/qemu-img-snapshotter
//! $Q serve --socket /tmp/qemu-img.sock --state-dir /tmp/qis/state --backup-dir /tmp/qis/backups \
//!    --agent-socket "$OPMON_SOCKET" --plugin example.io/qemu-img &
//! call snapshotter.register '{"name":"example.io/qemu-img","apiVersion":"v2","socket":"/tmp/qemu-img.sock"}'
//!
//! qemu-img create -f qcow2 disk.qcow2 64M && qemu-io -c 'write -P 0xab 0 64M' disk.qcow2
//! ID=$($Q start --socket /tmp/qemu-img.sock --disk disk.qcow2 --rate-limit 8388608)
//!
//! call backup.start '{"name":"vm-1","uid":"7d2e"}'
//! call backup.addOperations '{"name":"vm-1","operations":[{"plugin":{"kind":"BackupItemAction","name":"example.io/qemu-img"},"resource":{"resource":"persistentvolumeclaims","namespace":"vms","name":"vm-1-disk"},"operationId":"'$ID'"}]}'
//! call backup.endInProgress '{"name":"vm-1"}'
//! call backup.operations '{"name":"vm-1"}'     # nCompleted grows to nTotal in about 8 s
//! call backup.wait '{"name":"vm-1","until":"readyToFinalize"}'
//! qemu-img compare disk.qcow2 /tmp/qis/backups/$ID.qcow2
//! ```
//!
//! Besides the snapshotter protocol's `operation.progress` and `operation.cancel`, the
//! socket serves `copy.start {disk, snapshot?, rateLimit?}` → `{operationId}`: `disk` is
//! the absolute path of a qcow2 image, `snapshot` the name of one of its internal
//! snapshots, `rateLimit` bytes per second. SIGTERM stops `serve`; copies it interrupts
//! start over at its next start.
//!
//! Invariants:
//! - A copy's record is in the state file (`<state dir>/operations.json`, the SDK's
//!   `OperationStore`) before its ID is handed out, and again whenever it finishes, so
//!   Progress answers for every copy after any restart.
//! - A copy that was running when the snapshotter stopped is started again from scratch
//!   at the next start; its qemu-img process does not outlive the snapshotter.
//! - Within one run of a copy `nCompleted` never decreases; it equals `nTotal` (the
//!   image's virtual size) once the copy has succeeded.
//! - `<id>.qcow2` in the backup directory exists only for a completed copy; qemu-img
//!   writes `<id>.qcow2.partial`, which a failed or cancelled copy removes.

use std::io;
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
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::Command;
use tokio::sync::oneshot;

/// The program every copy runs.
const QEMU_IMG: &str = "qemu-img";

#[derive(Parser)]
#[command(
    name = "qemu-img-snapshotter",
    about = "An opmon snapshotter that copies qcow2 disks with qemu-img convert"
)]
struct Cli {
    #[command(subcommand)]
    action: Action,
}

#[derive(Subcommand)]
enum Action {
    /// Serve the snapshotter protocol and copy.start on a Unix socket until SIGTERM.
    Serve(ServeArgs),
    /// Ask a running `serve` to copy a disk; prints the new operation ID.
    Start(StartArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// The Unix socket to serve on (register this path with the agent).
    #[arg(long)]
    socket: PathBuf,
    /// Where the operations are remembered across restarts; created if missing.
    #[arg(long)]
    state_dir: PathBuf,
    /// Where the copies are written, as `<operation ID>.qcow2`; created if missing.
    #[arg(long)]
    backup_dir: PathBuf,
    /// The agent's socket: when a copy finishes, tell the agent at once
    /// (`snapshotter.changed`) instead of letting it wait for its next poll.
    #[arg(long, requires = "plugin")]
    agent_socket: Option<PathBuf>,
    /// The plugin name this snapshotter is registered under, for the hints.
    #[arg(long, requires = "agent_socket")]
    plugin: Option<String>,
}

#[derive(Args)]
struct StartArgs {
    /// The socket of a running `qemu-img-snapshotter serve`.
    #[arg(long)]
    socket: PathBuf,
    /// The qcow2 image to copy (a relative path is taken from the current directory).
    #[arg(long)]
    disk: PathBuf,
    /// Copy this internal snapshot of the disk instead of its current state.
    #[arg(long)]
    snapshot: Option<String>,
    /// Copy at most this many bytes per second.
    #[arg(long)]
    rate_limit: Option<u64>,
}

/// `copy.start` params: what the `start` command sends and `serve` parses.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CopyStartParams {
    disk: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    snapshot: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rate_limit: Option<u64>,
}

/// `copy.start` result.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct CopyStarted {
    operation_id: String,
}

/// What to copy, validated: `disk` is an absolute path to a regular file, `snapshot` is
/// one of its internal snapshots and `rate_limit` is positive.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct CopyJob {
    disk: PathBuf,
    snapshot: Option<String>,
    rate_limit: Option<u64>,
}

/// Where a copy stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "camelCase")]
enum CopyStatus {
    Running,
    Completed,
    Failed { error: String },
}

/// One operation, as the state file keeps it.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct CopyRecord {
    job: CopyJob,
    status: CopyStatus,
    /// The source's virtual size in bytes.
    n_total: i64,
    /// Bytes copied so far; only saved when the copy finishes.
    n_completed: i64,
    #[serde(with = "time::serde::rfc3339::option")]
    started: Option<Timestamp>,
    #[serde(with = "time::serde::rfc3339::option")]
    updated: Option<Timestamp>,
}

impl CopyRecord {
    fn progress(&self) -> OperationProgress {
        let name = self.job.disk.file_name().map_or_else(
            || self.job.disk.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        OperationProgress {
            completed: self.status != CopyStatus::Running,
            err: match &self.status {
                CopyStatus::Failed { error } => Some(error.clone()),
                _ => None,
            },
            n_completed: self.n_completed,
            n_total: self.n_total,
            operation_units: "bytes".into(),
            description: match &self.job.snapshot {
                Some(snapshot) => format!("copying snapshot {snapshot} of {name}"),
                None => format!("copying {name}"),
            },
            started: self.started,
            updated: self.updated,
        }
    }
}

/// The snapshotter's state, shared by the RPC handlers and the copy tasks.
struct Copier {
    backup_dir: PathBuf,
    /// The copies' records and the tasks of those running.
    copies: OperationStore<CopyRecord>,
    /// Tells the agent when a copy finishes (nothing without `--agent-socket`).
    hints: Hints,
}

/// The [`Snapshotter`] the SDK serves; a handle on the shared [`Copier`].
#[derive(Clone)]
struct QemuImgSnapshotter(Arc<Copier>);

impl OperationHandler for QemuImgSnapshotter {
    async fn progress(&self, op: OperationRef) -> Result<OperationProgress, SnapshotterError> {
        self.0
            .copies
            .get(&op.operation_id)
            .map(|r| r.progress())
            .ok_or(SnapshotterError::invalid_operation_id(op.operation_id))
    }

    /// Stops the copy if it runs and returns once its process is gone, its partial file
    /// removed and its failure recorded; a finished or unknown copy is left alone.
    async fn cancel(&self, op: OperationRef) -> Result<(), SnapshotterError> {
        self.0.copies.stop(&op.operation_id).await;
        Ok(())
    }
}

impl Copier {
    /// Opens the state in `state_dir`, creating both directories if needed.
    fn open(state_dir: &Path, backup_dir: &Path, hints: Hints) -> Result<Copier, String> {
        std::fs::create_dir_all(backup_dir)
            .map_err(|e| format!("--backup-dir: cannot create {}: {e}", backup_dir.display()))?;
        // Absolute, so that log lines and qemu-img's arguments do not depend on the
        // working directory.
        let backup_dir = std::path::absolute(backup_dir)
            .map_err(|e| format!("--backup-dir {}: {e}", backup_dir.display()))?;
        let copies = OperationStore::open(state_dir).map_err(|e| chain(&e))?;
        Ok(Copier {
            backup_dir,
            copies,
            hints,
        })
    }

    fn final_path(&self, id: &str) -> PathBuf {
        self.backup_dir.join(format!("{id}.qcow2"))
    }

    fn partial_path(&self, id: &str) -> PathBuf {
        self.backup_dir.join(format!("{id}.qcow2.partial"))
    }

    /// `copy.start`: validates the request, records the copy durably, starts it.
    async fn start_copy(
        self: &Arc<Self>,
        params: CopyStartParams,
    ) -> Result<CopyStarted, ErrorObjectOwned> {
        let job = validate(params)?;
        let info = image_info(&job.disk).await?;
        if let Some(snapshot) = &job.snapshot {
            if !info.snapshots.iter().any(|s| &s.name == snapshot) {
                return Err(invalid_params(format!(
                    "snapshot: {} has no internal snapshot named {snapshot:?}",
                    job.disk.display()
                )));
            }
        }
        let n_total = i64::try_from(info.virtual_size).map_err(|_| {
            invalid_params(format!(
                "disk: {} has an impossible virtual size {}",
                job.disk.display(),
                info.virtual_size
            ))
        })?;
        let record = CopyRecord {
            job,
            status: CopyStatus::Running,
            n_total,
            n_completed: 0,
            started: None,
            updated: None,
        };
        let id = self
            .copies
            .insert("copy", record)
            .await
            .map_err(|e| ErrorObjectOwned::owned(INTERNAL_ERROR_CODE, chain(&e), None::<()>))?;
        // Nobody knows the ID before this call returns, so no Cancel can slip in
        // between recording the copy and launching it.
        self.launch(&id);
        Ok(CopyStarted { operation_id: id })
    }

    /// Restarts from scratch the copies the state file says were running: their
    /// qemu-img died with the previous snapshotter process.
    fn resume_interrupted(self: &Arc<Self>) {
        for id in self.copies.ids(|r| r.status == CopyStatus::Running) {
            self.copies.update(&id, |r| {
                r.n_completed = 0;
                r.started = None;
                r.updated = Some(OffsetDateTime::now_utc());
            });
            eprintln!("{id}: interrupted by a restart; copying again from the start");
            self.launch(&id);
        }
    }

    /// Runs copy `id` in a task of its own and remembers how to stop it.
    fn launch(self: &Arc<Self>, id: &str) {
        let (copier, task_id) = (Arc::clone(self), id.to_string());
        self.copies.launch(
            id,
            |stopped| async move { copier.run(task_id, stopped).await },
        );
    }

    /// One copy from start to recorded outcome.
    async fn run(self: Arc<Self>, id: String, stopped: oneshot::Receiver<()>) {
        let Some(job) = self.copies.get(&id).map(|r| r.job) else {
            return;
        };
        let partial = self.partial_path(&id);
        let outcome = match self.convert(&id, &job, &partial, stopped).await {
            Ok(()) => publish(&partial, &self.final_path(&id)).await,
            Err(e) => {
                if let Err(rm) = std::fs::remove_file(&partial) {
                    if rm.kind() != io::ErrorKind::NotFound {
                        eprintln!("{id}: removing {}: {rm}", partial.display());
                    }
                }
                Err(e)
            }
        };
        match &outcome {
            Ok(()) => eprintln!("{id}: completed"),
            Err(e) => eprintln!("{id}: failed: {e}"),
        }
        self.finish(&id, outcome).await;
    }

    /// Runs `qemu-img convert` for `job` into `partial` until it exits or `stopped`
    /// fires; the error is qemu-img's last stderr line, or `cancelled`.
    async fn convert(
        &self,
        id: &str,
        job: &CopyJob,
        partial: &Path,
        stopped: oneshot::Receiver<()>,
    ) -> Result<(), String> {
        let mut child = convert_command(job, partial)
            .spawn()
            .map_err(|e| format!("cannot run {QEMU_IMG}: {e}"))?;
        self.mark_started(id);
        eprintln!(
            "{id}: copying {} to {}",
            job.disk.display(),
            partial.display()
        );
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let exited = tokio::select! {
            exited = async {
                let (status, (), last) = tokio::join!(
                    child.wait(),
                    self.follow_progress(id, stdout),
                    last_line_of(stderr),
                );
                (status, last)
            } => Some(exited),
            // A dropped sender (shutdown) is not a cancel: the copy stays Running on disk.
            Ok(()) = stopped => None,
        };
        match exited {
            None => {
                // kill() also waits, so the process no longer writes once this returns.
                if let Err(e) = child.kill().await {
                    eprintln!("{id}: killing qemu-img: {e}");
                }
                Err("cancelled".into())
            }
            Some((Ok(status), _)) if status.success() => Ok(()),
            Some((Ok(status), last)) => {
                Err(last.unwrap_or_else(|| format!("{QEMU_IMG} exited with {status}")))
            }
            Some((Err(e), _)) => Err(format!("waiting for {QEMU_IMG}: {e}")),
        }
    }

    fn mark_started(&self, id: &str) {
        let now = OffsetDateTime::now_utc();
        self.copies.update(id, |record| {
            record.started = Some(now);
            record.updated = Some(now);
        });
    }

    /// Reads qemu-img's `-p` output, `    (12.34/100%)` updates separated by `\r`, and
    /// records each percentage as bytes.
    async fn follow_progress(&self, id: &str, stdout: Option<impl AsyncRead + Unpin>) {
        let Some(mut stdout) = stdout else { return };
        let mut chunk = [0u8; 1024];
        let mut pending = String::new();
        loop {
            let n = match stdout.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            pending.push_str(&String::from_utf8_lossy(&chunk[..n]));
            while let Some(end) = pending.find(['\r', '\n']) {
                if let Some(percent) = parse_percent(&pending[..end]) {
                    self.record_progress(id, percent);
                }
                pending.drain(..=end);
            }
            // Updates are short; anything this long is not one, so do not let it grow.
            if pending.len() > 4096 {
                pending.clear();
            }
        }
    }

    /// Raises nCompleted to `percent` of nTotal; it never goes down.
    fn record_progress(&self, id: &str, percent: f64) {
        self.copies.update(id, |record| {
            let bytes = ((percent / 100.0) * record.n_total as f64) as i64;
            let bytes = bytes.clamp(0, record.n_total);
            if bytes > record.n_completed {
                record.n_completed = bytes;
                record.updated = Some(OffsetDateTime::now_utc());
            }
        });
    }

    /// Records how copy `id` ended: first in the state file, then in memory, so Progress
    /// never reports an outcome that a crash could take back.
    async fn finish(&self, id: &str, outcome: Result<(), String>) {
        let now = OffsetDateTime::now_utc();
        let settle = |record: &mut CopyRecord| {
            match &outcome {
                Ok(()) => {
                    record.status = CopyStatus::Completed;
                    record.n_completed = record.n_total;
                }
                Err(error) => {
                    record.status = CopyStatus::Failed {
                        error: error.clone(),
                    }
                }
            }
            record.updated = Some(now);
        };
        if let Err(e) = self.copies.finish(id, settle).await {
            // Still settled in memory: the copy did end; a restart reruns it.
            eprintln!("{id}: saving its outcome: {}", chain(&e));
        }
        // After the record says so: the agent's poll reads the outcome.
        self.hints.changed(id);
    }
}

/// Makes the finished copy durable, then gives it its final name.
async fn publish(partial: &Path, final_path: &Path) -> Result<(), String> {
    let (partial, final_path) = (partial.to_path_buf(), final_path.to_path_buf());
    tokio::task::spawn_blocking(move || {
        let context = |e: io::Error| format!("publishing {}: {e}", final_path.display());
        std::fs::File::open(&partial)
            .and_then(|f| f.sync_all())
            .map_err(context)?;
        std::fs::rename(&partial, &final_path).map_err(context)?;
        match final_path.parent() {
            Some(dir) => std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(context),
            None => Ok(()),
        }
    })
    .await
    .map_err(|e| format!("publishing the copy: {e}"))?
}

/// Checks what `copy.start` was given; errors name the field.
fn validate(params: CopyStartParams) -> Result<CopyJob, ErrorObjectOwned> {
    let disk = params.disk;
    // An absolute path also keeps qemu-img from reading `proto:…` as a protocol.
    if !disk.is_absolute() {
        return Err(invalid_params(format!(
            "disk: {:?} is not an absolute path",
            disk.display().to_string()
        )));
    }
    match std::fs::metadata(&disk) {
        Ok(meta) if meta.is_file() => {}
        Ok(_) => {
            return Err(invalid_params(format!(
                "disk: {} is not a regular file",
                disk.display()
            )))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(invalid_params(format!(
                "disk: {} does not exist",
                disk.display()
            )))
        }
        Err(e) => {
            return Err(invalid_params(format!(
                "disk: cannot read {}: {e}",
                disk.display()
            )))
        }
    }
    if params.snapshot.as_deref() == Some("") {
        return Err(invalid_params("snapshot: must not be empty".into()));
    }
    if params.rate_limit == Some(0) {
        return Err(invalid_params(
            "rateLimit: must be at least 1 byte per second".into(),
        ));
    }
    Ok(CopyJob {
        disk,
        snapshot: params.snapshot,
        rate_limit: params.rate_limit,
    })
}

fn invalid_params(message: String) -> ErrorObjectOwned {
    ErrorObjectOwned::owned(codes::INVALID_PARAMS, message, None::<()>)
}

/// What `qemu-img info --output=json` says about an image, as far as copies care.
#[derive(Deserialize)]
struct ImageInfo {
    #[serde(rename = "virtual-size")]
    virtual_size: u64,
    #[serde(default)]
    snapshots: Vec<SnapshotInfo>,
}

#[derive(Deserialize)]
struct SnapshotInfo {
    name: String,
}

/// Runs `qemu-img info` on `disk`, which must be a qcow2 image.
async fn image_info(disk: &Path) -> Result<ImageInfo, ErrorObjectOwned> {
    let output = Command::new(QEMU_IMG)
        .args(["info", "-f", "qcow2", "--output=json"])
        .arg(disk)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| {
            ErrorObjectOwned::owned(
                INTERNAL_ERROR_CODE,
                format!("cannot run {QEMU_IMG}: {e}"),
                None::<()>,
            )
        })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let reason = last_line(&stderr).unwrap_or_else(|| format!("exit {}", output.status));
        return Err(invalid_params(format!(
            "disk: {QEMU_IMG} info {} failed: {reason}",
            disk.display()
        )));
    }
    serde_json::from_slice(&output.stdout).map_err(|e| {
        ErrorObjectOwned::owned(
            INTERNAL_ERROR_CODE,
            format!(
                "reading {QEMU_IMG} info's output for {}: {e}",
                disk.display()
            ),
            None::<()>,
        )
    })
}

/// `qemu-img convert` of `job` into `partial`, with progress on stdout.
fn convert_command(job: &CopyJob, partial: &Path) -> Command {
    let mut command = Command::new(QEMU_IMG);
    command.args(["convert", "-p", "-f", "qcow2", "-O", "qcow2"]);
    if let Some(rate) = job.rate_limit {
        command.arg("-r").arg(rate.to_string());
    }
    if let Some(snapshot) = &job.snapshot {
        // QEMU option syntax: a comma inside a value is written twice.
        command
            .arg("-l")
            .arg(format!("snapshot.name={}", snapshot.replace(',', ",,")));
    }
    command
        .arg(&job.disk)
        .arg(partial)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // A graceful exit drops the copy tasks, and with them the processes.
        .kill_on_drop(true);
    die_with_parent(&mut command);
    command
}

/// The percentage in one `qemu-img convert -p` update such as `    (12.34/100%)`.
fn parse_percent(update: &str) -> Option<f64> {
    let number = update.trim().strip_prefix('(')?.strip_suffix("/100%)")?;
    let percent: f64 = number.trim().parse().ok()?;
    (0.0..=100.0).contains(&percent).then_some(percent)
}

/// `serve`: loads the state, restarts interrupted copies, serves until SIGTERM/SIGINT.
async fn serve(args: ServeArgs) -> Result<(), String> {
    let hints = match (&args.agent_socket, &args.plugin) {
        (Some(agent), Some(plugin)) => Hints::new(agent, plugin.as_str()),
        _ => Hints::none(),
    };
    let copier = Arc::new(Copier::open(&args.state_dir, &args.backup_dir, hints)?);
    copier.resume_interrupted();
    let mut module = rpc_module(QemuImgSnapshotter(Arc::clone(&copier)));
    module
        .register_async_method("copy.start", |params, s, _| async move {
            let params: CopyStartParams = params.parse()?;
            s.0.start_copy(params).await
        })
        .map_err(|e| format!("registering copy.start: {e}"))?;
    eprintln!(
        "serving on {} (state {}, copies into {})",
        args.socket.display(),
        args.state_dir.display(),
        args.backup_dir.display()
    );
    serve_methods(&args.socket, module, termination())
        .await
        .map_err(|e| e.to_string())
}

/// `start`: calls `copy.start` on a running `serve` and prints the operation ID.
async fn start(args: StartArgs) -> Result<(), String> {
    let socket = args.socket.display();
    let disk = std::path::absolute(&args.disk)
        .map_err(|e| format!("--disk {}: {e}", args.disk.display()))?;
    let client = opmon_client::Client::builder(&args.socket)
        .peer("a snapshotter")
        .connect()
        .await
        .map_err(|e| e.chain())?;
    let params = CopyStartParams {
        disk,
        snapshot: args.snapshot,
        rate_limit: args.rate_limit,
    };
    let started: CopyStarted = client
        .call("copy.start", params)
        .await
        .map_err(|e| match e {
            opmon_client::Error::Rpc { message, .. } => format!("copy.start refused: {message}"),
            other => format!("copy.start on {socket}: {}", other.chain()),
        })?;
    println!("{}", started.operation_id);
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.action {
        Action::Serve(args) => serve(args).await,
        Action::Start(args) => start(args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("qemu-img-snapshotter: {e}");
            ExitCode::FAILURE
        }
    }
}
