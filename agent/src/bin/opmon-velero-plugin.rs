//! `opmon-velero-plugin`: a Velero plugin that stands in for an asynchronous plugin, so
//! that stock Velero's operations are watched by the opmon agent.
//!
//! Velero starts it as any plugin (go-plugin's handshake, gRPC on a Unix socket). It
//! starts the original plugin beside it through the agent's go-plugin host, lists what
//! the original serves under the same names, and passes every call on unchanged, bytes
//! and errors alike, except four:
//! - `Execute` of BackupItemAction v2 / RestoreItemAction v2 goes to the original too;
//!   when it answers an operation ID, the operation is registered with the agent (the
//!   Backup or Restore is the owner, created at its first Execute) before Velero hears
//!   the answer;
//! - `Progress` is answered from the agent's record of the operation (the agent polls
//!   its own copy of the original, with its retries and deadlines); Velero's first
//!   Progress of an owner ends its InProgress phase, since Velero asks it once every
//!   Execute of the backup is done, at the end of InProgress (`backup_controller.go`);
//!   with the agent away, Progress answers at once what it last answered (not
//!   completed), so Velero asks again rather than failing an operation the agent keeps;
//! - `Cancel` cancels through the agent (or, with the agent away, the original itself);
//! - go-plugin's Shutdown ends the stand-in and the original with it.
//!
//! It also serves a DeleteItemAction of its own, `opmon.io/forget-<this file's name>`:
//! Velero's backup deletion calls it with the Backup for the items the original's
//! BackupItemActions apply to, and it removes the agent's owner of that Backup (its
//! unfinished operations are cancelled), as Velero removes the backup.
//!
//! It keeps no state of its own: a Velero restarted with new plugin processes asks
//! Progress of operations this process never saw, and gets the same answer.
//!
//! The original is not in Velero's plugin directory: Velero's discovery runs every
//! executable file anywhere under it (subdirectories too) and refuses to start when two
//! serve one name. `install` copies it to [`ORIGINALS`], a volume of opmon's own that
//! Velero's container mounts elsewhere, and the stand-in finds it there by its own file
//! name.
//!
//! Environment (Velero passes its own to plugins, and the stand-in passes it on to the
//! original; the Deployment sets these): `OPMON_VELERO_ORIGINAL`, the original binary
//! (default: `/opmon/plugins/<this file's name>`), `OPMON_SOCKET`, the agent's socket
//! (default: the client's default path), and `OPMON_VELERO_AGENT_TIMEOUT`, how long to
//! the calls of one outage of the agent wait for it in all
//! (`10s`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes};
use hyper_util::rt::{TokioExecutor, TokioIo};
use opmon_agent::remote::velero_plugin::{wire, Host, HostKey};
use opmon_client::codes::Code;
use opmon_client::serde_json::{self, json, Value};
use opmon_client::{Client, Error as ClientError};
use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::codegen::http::{Request as HttpRequest, Response as HttpResponse};
use tonic::{Request, Response, Status};

/// How long the stand-in waits for the agent before telling Velero it is unreachable
/// (`OPMON_VELERO_AGENT_TIMEOUT`, a Go duration): within Velero's own plugin call
/// timeouts, and longer than an agent's restart.
const AGENT_TIMEOUT: Duration = Duration::from_secs(10);
/// Where `install` copies the originals and the stand-in looks for its own: outside
/// Velero's plugin directory (`/plugins`, read recursively), an emptyDir volume of its
/// own in Velero's pod.
const ORIGINALS: &str = "/opmon/plugins";
/// How long one call may take once the agent has been away for a whole agent timeout,
/// and every Progress and Cancel: a call to an agent that answers takes milliseconds, so
/// Velero's controller, which calls each operation's Progress in turn, is held at most
/// this long per call while the agent is away.
const ATTEMPT: Duration = Duration::from_secs(1);
/// The backup server the owners belong to, for `server.started`.
const SERVER: &str = "velero";
/// The prefix of the stand-in's own DeleteItemAction, whose name goes on with the
/// stand-in's file name: Velero refuses two plugins of one kind and name, and each
/// stand-in in Velero's plugin directory has a file name of its own.
const FORGET_PREFIX: &str = "opmon.io/forget-";

/// The Velero process this stand-in serves, its parent: the boot, its pid and its start
/// time (a pid alone is reused). Velero starts plugin processes at its own start (to
/// list them) and as it needs them; all of one Velero's life share this.
fn velero_instance() -> String {
    let parent = nix::unistd::getppid();
    let started = std::fs::read_to_string(format!("/proc/{parent}/stat"))
        .ok()
        .and_then(|stat| {
            // Field 22, counted after the command's closing parenthesis (field 2).
            let (_, rest) = stat.rsplit_once(')')?;
            rest.split_whitespace().nth(19).map(str::to_string)
        })
        .unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}/{parent}/{started}", boot.trim())
}

/// Bytes in, bytes out: a call passed on without being decoded, so that fields the
/// stand-in does not know reach the other side unchanged.
#[derive(Clone, Copy, Default)]
struct Raw;

impl Codec for Raw {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl Encoder for Raw {
    type Item = Bytes;
    type Error = Status;
    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = Bytes;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// Which of Velero's two asynchronous action kinds a call is for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Backup,
    Restore,
}

impl Kind {
    /// The agent's owner kind, as its methods are prefixed.
    fn owner(self) -> &'static str {
        match self {
            Kind::Backup => "backup",
            Kind::Restore => "restore",
        }
    }
    fn plugin_kind(self) -> &'static str {
        match self {
            Kind::Backup => "BackupItemAction",
            Kind::Restore => "RestoreItemAction",
        }
    }
    fn cancel_path(self) -> &'static str {
        match self {
            Kind::Backup => wire::BACKUP_CANCEL,
            Kind::Restore => wire::RESTORE_CANCEL,
        }
    }
}

struct StandIn {
    original: Host,
    served: Vec<wire::PluginIdentifier>,
    command: String,
    socket: PathBuf,
    /// The directory of the socket Velero dials, removed at go-plugin's Shutdown.
    socket_dir: PathBuf,
    agent: tokio::sync::Mutex<Option<Client>>,
    /// How long a call may wait for the agent before Velero hears it is unreachable.
    timeout: Duration,
    /// Since when the agent has been away, from the first call that could not reach it
    /// to the first that does: the calls of an outage wait for the agent until this
    /// plus [`StandIn::timeout`] in all, not each for a timeout of its own.
    away: std::sync::Mutex<Option<tokio::time::Instant>>,
    /// The last Progress answered for each operation (owner uid, plugin, operation
    /// ID), answered again while the agent is away.
    answered: std::sync::Mutex<
        std::collections::HashMap<(String, String, String), wire::OperationProgress>,
    >,
    /// The Velero process that started this one (see [`velero_instance`]).
    instance: String,
    /// The name of the stand-in's own DeleteItemAction, if the original serves a
    /// BackupItemAction v2 (whose operations make the owners it removes).
    forget: Option<String>,
    /// The Backups (by uid) whose owner this process has removed or found gone, or
    /// failed to: Velero calls the DeleteItemAction once for every item of the backup.
    forgotten: std::sync::Mutex<std::collections::HashMap<String, Forgetting>>,
}

/// What the stand-in's DeleteItemAction did for a Backup (by uid).
#[derive(Clone)]
enum Forgetting {
    Done,
    Failed {
        at: tokio::time::Instant,
        error: String,
    },
}

/// A failure the stand-in reports to Velero, as Velero's own plugins report theirs
/// (gRPC Unknown): Velero shows the message on the item or operation.
fn velero_error(message: String) -> Status {
    tracing::warn!("{message}");
    Status::unknown(message)
}

impl StandIn {
    /// A client of the agent, connected once and kept.
    async fn agent(&self) -> Result<Client, Status> {
        let mut agent = self.agent.lock().await;
        if let Some(client) = agent.as_ref() {
            return Ok(client.clone());
        }
        let client = Client::builder(&self.socket)
            .connect_timeout(self.timeout)
            .call_timeout(self.timeout)
            .connect()
            .await
            .map_err(|e| self.unreachable(&e))?;
        *agent = Some(client.clone());
        Ok(client)
    }

    fn unreachable(&self, e: &ClientError) -> Status {
        velero_error(self.unreachable_text(&e.to_string()))
    }

    fn unreachable_text(&self, why: &str) -> String {
        format!(
            "opmon-velero-plugin: the opmon agent at {} cannot be reached ({why}); the \
             operation is not lost, the agent keeps it, but its state is unknown until \
             the agent answers",
            self.socket.display()
        )
    }

    /// One call, tried again while the agent cannot be reached (a restarting sidecar)
    /// until the outage's deadline: the first call that fails to reach the agent
    /// starts it, [`StandIn::timeout`] away, and every call of the outage waits until
    /// then at most; past it, each call makes one attempt of at most [`ATTEMPT`]. So
    /// an agent away holds Velero once per outage, not once per call. Every call the
    /// stand-in makes is safe to repeat: `start` and `addOperations` are idempotent,
    /// and a repeated `endInProgress` or `cancel` answers 1003, which means done here.
    async fn call(&self, method: &str, params: Value) -> Result<Value, ClientError> {
        let mut pause = Duration::from_millis(20);
        loop {
            let answer = self.attempt(method, &params, self.deadline()).await;
            let Err(e) = answer else {
                return answer;
            };
            // An error the agent answered is its answer; only an agent away is waited for.
            if !is_away(&e) || tokio::time::Instant::now() + pause >= self.outage_end() {
                return Err(e);
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
        }
    }

    /// One attempt only, of at most [`ATTEMPT`]: for Progress and Cancel, which have
    /// an answer without the agent.
    async fn call_once(&self, method: &str, params: Value) -> Result<Value, ClientError> {
        let deadline = tokio::time::Instant::now() + ATTEMPT;
        self.attempt(method, &params, deadline).await
    }

    /// The end of the current outage's wait; a whole agent timeout from now if the
    /// agent is not away.
    fn outage_end(&self) -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        let away = self.away.lock().map(|a| *a).unwrap_or(None);
        away.unwrap_or(now) + self.timeout
    }

    /// Until when one attempt may wait for the agent: the end of the outage's wait, and
    /// at least one [`ATTEMPT`].
    fn deadline(&self) -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        self.outage_end().max(now + ATTEMPT.min(self.timeout))
    }

    /// One attempt, within `deadline`; says whether the agent was reached.
    async fn attempt(
        &self,
        method: &str,
        params: &Value,
        deadline: tokio::time::Instant,
    ) -> Result<Value, ClientError> {
        let call = async {
            match self.agent().await {
                Ok(agent) => agent.call(method, params.clone()).await,
                Err(status) => Err(unreached(status.message().to_string())),
            }
        };
        let answer = match tokio::time::timeout_at(deadline, call).await {
            Ok(answer) => answer,
            Err(_) => Err(unreached(self.unreachable_text("no answer in time"))),
        };
        let reached = answer.as_ref().err().is_none_or(|e| !is_away(e));
        let Ok(mut away) = self.away.lock() else {
            return answer;
        };
        if reached {
            if let Some(since) = away.take() {
                tracing::info!(away = ?since.elapsed(), "the opmon agent answers again");
            }
        } else {
            if away.is_none() {
                tracing::warn!(
                    "the opmon agent cannot be reached: calls wait for it {:?} in all",
                    self.timeout
                );
            }
            away.get_or_insert_with(tokio::time::Instant::now);
            drop(away);
            // The kept client may be what broke: connect afresh.
            if let Ok(mut agent) = self.agent.try_lock() {
                *agent = None;
            }
        }
        answer
    }

    /// The call failed: Velero hears why, in words naming the agent.
    fn agent_error(&self, method: &str, e: ClientError) -> Status {
        match e {
            ClientError::Rpc {
                code: Code::Other(0),
                message,
                ..
            } => velero_error(message),
            ClientError::Rpc { .. } => {
                velero_error(format!("opmon-velero-plugin: opmon's {method}: {e}"))
            }
            e => self.unreachable(&e),
        }
    }

    /// A connection to the original plugin.
    async fn original(&self) -> Result<tonic::client::Grpc<tonic::transport::Channel>, Status> {
        let connection = self.original.connection().await.map_err(|e| {
            velero_error(format!(
                "opmon-velero-plugin: the original plugin is not running: {e}"
            ))
        })?;
        let mut grpc = tonic::client::Grpc::new(connection.channel);
        grpc.ready().await.map_err(|e| {
            velero_error(format!(
                "opmon-velero-plugin: the original plugin is not ready: {e}"
            ))
        })?;
        Ok(grpc)
    }

    /// Passes one unary call to the original and its answer (or error) back.
    async fn pass(&self, path: PathAndQuery, body: Bytes) -> Result<Bytes, Status> {
        let mut grpc = self.original().await?;
        grpc.unary(Request::new(body), path, Raw)
            .await
            .map(Response::into_inner)
    }

    /// Passes one call of any kind to the original, its messages as they come each way,
    /// and its end (status and details) back. Velero's side ending its stream early
    /// (an error) ends the original's.
    async fn pass_streaming(
        &self,
        path: PathAndQuery,
        incoming: tonic::Streaming<Bytes>,
    ) -> Result<Response<tonic::Streaming<Bytes>>, Status> {
        use futures::StreamExt;
        let mut grpc = self.original().await?;
        let outgoing = incoming
            .take_while(|m| std::future::ready(m.is_ok()))
            .filter_map(|m| std::future::ready(m.ok()));
        grpc.streaming(Request::new(outgoing), path, Raw).await
    }

    /// Execute: the original's answer, its operation registered with the agent first.
    async fn execute(&self, kind: Kind, path: PathAndQuery, body: Bytes) -> Result<Bytes, Status> {
        let request = wire::ExecuteRequest::decode(body.clone())
            .map_err(|e| velero_error(format!("opmon-velero-plugin: a malformed Execute: {e}")))?;
        let answer = self.pass(path, body).await?;
        let (operation_id, post) = match kind {
            Kind::Backup => {
                let r = wire::BackupExecuteResponse::decode(answer.clone());
                r.map(|r| (r.operation_id, r.post_operation_items))
            }
            Kind::Restore => {
                let r = wire::RestoreExecuteResponse::decode(answer.clone());
                r.map(|r| (r.operation_id, Vec::new()))
            }
        }
        .map_err(|e| {
            velero_error(format!(
                "opmon-velero-plugin: the original plugin answered a malformed Execute: {e}"
            ))
        })?;
        if operation_id.is_empty() {
            return Ok(answer);
        }
        if let Err(status) = self.register(kind, &request, &operation_id, &post).await {
            // Velero records no operation for an item whose Execute failed: the
            // original's would run unwatched, so it is cancelled (best effort).
            let cancel = wire::OperationRequest {
                plugin: request.plugin.clone(),
                operation_id: operation_id.clone(),
                owner: request.owner.clone(),
            };
            if let Ok(mut grpc) = self.original().await {
                let _ = grpc
                    .unary(
                        Request::new(Bytes::from(cancel.encode_to_vec())),
                        PathAndQuery::from_static(kind.cancel_path()),
                        Raw,
                    )
                    .await;
            }
            return Err(status);
        }
        Ok(answer)
    }

    /// Creates the owner (again: `start` returns an existing one) and adds the operation.
    async fn register(
        &self,
        kind: Kind,
        request: &wire::ExecuteRequest,
        operation_id: &str,
        post: &[wire::ResourceIdentifier],
    ) -> Result<(), Status> {
        let owner = object(&request.owner, "Backup or Restore")?;
        let item = object(&request.item, "item")?;
        let (name, uid) = name_and_uid(&owner)?;
        let mut start = json!({"name": name, "uid": uid, "object": owner,
                               "server": {"name": SERVER, "instance": self.instance}});
        if let Some(timeout) = owner
            .pointer("/spec/itemOperationTimeout")
            .and_then(Value::as_str)
        {
            start["itemOperationTimeout"] = json!(timeout);
        }
        // Velero writes its own files: the owner ends when its operations have.
        start["finalize"] = json!(false);
        let method = format!("{}.start", kind.owner());
        match self.call(&method, start.clone()).await {
            Ok(_) => {}
            Err(e) if e.is_already_exists() && self.free_name(kind, &name, &uid).await? => {
                self.call(&method, start)
                    .await
                    .map_err(|e| self.agent_error(&method, e))?;
            }
            Err(e) => return Err(self.agent_error(&method, e)),
        }
        let post: Vec<Value> = post
            .iter()
            .map(|r| {
                json!({"group": r.group, "resource": r.resource,
                       "namespace": r.namespace, "name": r.name})
            })
            .collect();
        let operation = json!({
            "plugin": {"kind": kind.plugin_kind(), "name": request.plugin},
            "resource": resource(&item),
            "operationId": operation_id,
            "postOperationItems": post,
        });
        let method = format!("{}.addOperations", kind.owner());
        self.call(&method, json!({"name": name, "operations": [operation]}))
            .await
            .map_err(|e| self.agent_error(&method, e))?;
        tracing::info!(owner = %name, operation = %operation_id, plugin = %request.plugin, "registered with the agent");
        Ok(())
    }

    /// Progress, from the agent's record.
    async fn progress(&self, kind: Kind, body: Bytes) -> Result<wire::ProgressResponse, Status> {
        let request = wire::OperationRequest::decode(body)
            .map_err(|e| velero_error(format!("opmon-velero-plugin: a malformed Progress: {e}")))?;
        let owner = object(&request.owner, "Backup or Restore")?;
        let (name, uid) = name_and_uid(&owner)?;
        let key = (
            uid.clone(),
            request.plugin.clone(),
            request.operation_id.clone(),
        );
        let answer = match self.progress_of(kind, &request, &name, &uid).await {
            Err(Away(e)) => {
                // Velero fails an operation whose Progress fails, for good; the agent
                // keeps it and will answer once back. Velero is answered what it was
                // last (not completed) and asks again at its next poll.
                tracing::warn!(
                    operation = %request.operation_id,
                    "Progress answered from the last answer: {}",
                    self.unreachable(&e).message()
                );
                let last = self.answered.lock().ok().and_then(|a| a.get(&key).cloned());
                let mut progress = last.unwrap_or_else(|| wire::OperationProgress {
                    started: Some(go_zero()),
                    updated: Some(go_zero()),
                    ..Default::default()
                });
                progress.completed = false;
                progress.err = String::new();
                return Ok(wire::ProgressResponse {
                    progress: Some(progress),
                });
            }
            Ok(answer) => answer,
        }?;
        if let Ok(mut answered) = self.answered.lock() {
            if answer.completed {
                answered.remove(&key);
            } else {
                answered.insert(key, answer.clone());
            }
        }
        Ok(wire::ProgressResponse {
            progress: Some(answer),
        })
    }

    /// The operation's progress from the agent: [`Away`] if the agent could not be
    /// reached, else the answer or the error Velero hears.
    async fn progress_of(
        &self,
        kind: Kind,
        request: &wire::OperationRequest,
        name: &str,
        uid: &str,
    ) -> Result<Result<wire::OperationProgress, Status>, Away> {
        let get = format!("{}.get", kind.owner());
        let current = match self
            .call_once(&get, json!({"name": name, "uid": uid}))
            .await
        {
            Ok(owner) => owner,
            Err(e) => return away_or(e, |e| self.agent_error(&get, e)),
        };
        if current["phase"] == "InProgress" {
            // Velero asks Progress once every Execute of its backup is done: the owner
            // stops taking operations and the agent polls them. Another process may
            // have done it meanwhile (1003); either way it is done.
            let end = format!("{}.endInProgress", kind.owner());
            match self.call_once(&end, json!({"name": name})).await {
                Ok(_) => {}
                Err(ClientError::Rpc {
                    code: Code::WrongPhase,
                    ..
                }) => {}
                Err(e) => return away_or(e, |e| self.agent_error(&end, e)),
            }
        }
        let method = format!("{}.operations", kind.owner());
        let operations = match self
            .call_once(&method, json!({"name": name, "uid": uid}))
            .await
        {
            Ok(operations) => operations,
            Err(e) => return away_or(e, |e| self.agent_error(&method, e)),
        };
        let operation = operations
            .as_array()
            .into_iter()
            .flatten()
            .find(|op| {
                op["operationId"] == request.operation_id.as_str()
                    && op["plugin"]["name"] == request.plugin.as_str()
            })
            .ok_or_else(|| {
                velero_error(format!(
                    "opmon-velero-plugin: the opmon agent has no operation {} of plugin {} \
                     in {} {name}",
                    request.operation_id,
                    request.plugin,
                    kind.owner()
                ))
            });
        Ok(operation.map(velero_progress))
    }

    /// Cancel (Velero's item operation timeout), through the agent.
    async fn cancel(&self, kind: Kind, body: Bytes) -> Result<wire::Empty, Status> {
        let request = wire::OperationRequest::decode(body)
            .map_err(|e| velero_error(format!("opmon-velero-plugin: a malformed Cancel: {e}")))?;
        let owner = object(&request.owner, "Backup or Restore")?;
        let (name, _) = name_and_uid(&owner)?;
        let method = format!("{}.cancel", kind.owner());
        let params = json!({"name": name, "operations": [request.operation_id],
                            "reason": "Velero canceled it (its item operation timeout)"});
        match self.call_once(&method, params).await {
            Ok(_) => Ok(wire::Empty {}),
            // The agent is away: the original cancels it, as it would under Velero
            // alone; the agent, once back, sees it ended.
            Err(e) if is_away(&e) => {
                let path = PathAndQuery::from_static(kind.cancel_path());
                let body = Bytes::from(request.encode_to_vec());
                self.pass(path, body).await.map(|_| wire::Empty {})
            }
            // Already finished: nothing is left to cancel, as Velero expects of a
            // plugin's Cancel.
            Err(ClientError::Rpc {
                code: Code::WrongPhase,
                ..
            }) => Ok(wire::Empty {}),
            Err(e) => Err(self.agent_error(&method, e)),
        }
    }

    /// AppliesTo of the stand-in's DeleteItemAction: the resources the original's
    /// BackupItemActions apply to (every resource if one of them applies to all, or
    /// cannot say), since the owner's operations were started on such items.
    async fn forget_applies_to(&self) -> wire::AppliesToResponse {
        let mut resources = std::collections::BTreeSet::new();
        let mut every = false;
        for p in self
            .served
            .iter()
            .filter(|p| p.kind == wire::KIND_BACKUP_V2)
        {
            let request = wire::PluginRequest {
                plugin: p.name.clone(),
            };
            let answer = self
                .pass(
                    PathAndQuery::from_static(wire::BACKUP_APPLIES_TO),
                    Bytes::from(request.encode_to_vec()),
                )
                .await
                .and_then(|b| {
                    wire::AppliesToResponse::decode(b).map_err(|e| Status::internal(e.to_string()))
                });
            match answer {
                Ok(answer) => {
                    let selector = answer.resource_selector.unwrap_or_default();
                    if selector.included_resources.is_empty()
                        || selector.included_resources.iter().any(|r| r == "*")
                    {
                        every = true;
                    }
                    resources.extend(selector.included_resources);
                }
                Err(status) => {
                    tracing::warn!(
                        "AppliesTo of {}: {}; the backup deletion action applies to \
                         every resource",
                        p.name,
                        status.message()
                    );
                    every = true;
                }
            }
        }
        wire::AppliesToResponse {
            resource_selector: Some(wire::ResourceSelector {
                included_resources: if every {
                    Vec::new()
                } else {
                    resources.into_iter().collect()
                },
                ..Default::default()
            }),
        }
    }

    /// Execute of the stand-in's DeleteItemAction: Velero is deleting the Backup, so
    /// the agent's owner of it goes too. Velero calls it for every item of the backup
    /// and logs an error and goes on: once done for a Backup it is not done again, and
    /// once the agent could not be reached, the items that follow within the agent
    /// timeout fail at once rather than each waiting for it (a later one tries again).
    async fn forget(&self, body: Bytes) -> Result<wire::Empty, Status> {
        let request = wire::ExecuteRequest::decode(body).map_err(|e| {
            velero_error(format!(
                "opmon-velero-plugin: a malformed DeleteItemAction Execute: {e}"
            ))
        })?;
        let backup = object(&request.owner, "Backup")?;
        let (name, uid) = name_and_uid(&backup)?;
        let earlier = self
            .forgotten
            .lock()
            .ok()
            .and_then(|f| f.get(&uid).cloned());
        match earlier {
            Some(Forgetting::Done) => return Ok(wire::Empty {}),
            Some(Forgetting::Failed { at, error }) if at.elapsed() < self.timeout => {
                return Err(Status::unknown(format!(
                    "{error} (for an earlier item of this backup; not waiting again)"
                )))
            }
            _ => {}
        }
        let result = self
            .forget_owner(
                Kind::Backup,
                &name,
                &uid,
                "Velero deletes the backup: its owner is removed from the agent",
            )
            .await;
        let now = match &result {
            Ok(()) => Forgetting::Done,
            Err(status) => Forgetting::Failed {
                at: tokio::time::Instant::now(),
                error: status.message().to_string(),
            },
        };
        if let Ok(mut forgotten) = self.forgotten.lock() {
            forgotten.insert(uid, now);
        }
        result.map(|()| wire::Empty {})
    }

    /// The name of Velero's object (uid `uid`) is held in the agent by an unfinished
    /// owner of another uid: Kubernetes names one live object at a time, so Velero no
    /// longer has that object (a backup failed before its upload, deleted, and made
    /// again). Removes that owner, cancelling its operations, and says whether the name
    /// is free; not if it is this uid's own retired owner (a stale request).
    async fn free_name(&self, kind: Kind, name: &str, uid: &str) -> Result<bool, Status> {
        let get = format!("{}.get", kind.owner());
        match self.call(&get, json!({"name": name, "uid": uid})).await {
            // This uid's owner is retired (it ended and the name went on to another: a
            // stale request), or current (another call of this object started it).
            Ok(owner) => return Ok(owner["retired"].is_null()),
            Err(ClientError::Rpc {
                code: Code::NotFound,
                ..
            }) => {}
            Err(e) => return Err(self.agent_error(&get, e)),
        }
        // Velero executes items in parallel: another call of this object may have freed
        // the name and started its owner meanwhile (`start` again is then the same owner).
        let current = match self.call(&get, json!({"name": name})).await {
            Ok(current) => current,
            Err(ClientError::Rpc {
                code: Code::NotFound,
                ..
            }) => return Ok(true),
            Err(e) => return Err(self.agent_error(&get, e)),
        };
        let held_by = match current["uid"].as_str() {
            Some(held) if held == uid => return Ok(true),
            Some(held) => held,
            None => return Ok(false),
        };
        let why = format!(
            "Velero made the object anew: the agent's owner of its old uid {held_by} ({}) is removed",
            current["phase"]
        );
        self.forget_owner(kind, name, held_by, &why).await?;
        Ok(true)
    }

    /// Removes the agent's owner of `kind`, name and uid (current or retired: a later
    /// object may have taken the name), logging `why`; one already gone is fine. Its
    /// unfinished operations are cancelled.
    async fn forget_owner(
        &self,
        kind: Kind,
        name: &str,
        uid: &str,
        why: &str,
    ) -> Result<(), Status> {
        let delete = format!("{}.delete", kind.owner());
        match self.call(&delete, json!({"name": name, "uid": uid})).await {
            Ok(answer) => tracing::info!(owner = %name, canceled = %answer["canceled"], "{why}"),
            Err(ClientError::Rpc {
                code: Code::NotFound,
                ..
            }) => {}
            Err(e) => return Err(self.agent_error(&delete, e)),
        }
        Ok(())
    }
}

/// A call's error as the stand-in's marker of an agent it could not reach.
fn unreached(message: String) -> ClientError {
    ClientError::Rpc {
        code: Code::Other(0),
        message,
        data: None,
    }
}

/// The agent could not be reached: the error, for the log.
struct Away(ClientError);

/// [`Away`] if `e` says the agent could not be reached, else what `answer` makes of it.
fn away_or<T, E>(
    e: ClientError,
    answer: impl FnOnce(ClientError) -> E,
) -> Result<Result<T, E>, Away> {
    if is_away(&e) {
        Err(Away(e))
    } else {
        Ok(Err(answer(e)))
    }
}

/// Whether `e` says the agent could not be reached (rather than what it answered).
fn is_away(e: &ClientError) -> bool {
    match e {
        ClientError::Rpc { code, .. } => *code == Code::Other(0),
        _ => true,
    }
}

/// Go's zero time, as Velero reads an unset one.
fn go_zero() -> wire::Timestamp {
    wire::Timestamp {
        seconds: wire::GO_ZERO_SECONDS,
        nanos: 0,
    }
}

/// A JSON object from a call, or an error naming what it is.
fn object(bytes: &[u8], what: &str) -> Result<Value, Status> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(v) if v.is_object() => Ok(v),
        Ok(_) => Err(velero_error(format!(
            "opmon-velero-plugin: the {what} is not a JSON object"
        ))),
        Err(e) => Err(velero_error(format!(
            "opmon-velero-plugin: the {what} is not JSON: {e}"
        ))),
    }
}

fn name_and_uid(owner: &Value) -> Result<(String, String), Status> {
    let name = owner.pointer("/metadata/name").and_then(Value::as_str);
    let uid = owner.pointer("/metadata/uid").and_then(Value::as_str);
    match (name, uid) {
        (Some(name), Some(uid)) if !name.is_empty() => Ok((name.to_string(), uid.to_string())),
        _ => Err(velero_error(
            "opmon-velero-plugin: the Backup or Restore has no metadata.name and metadata.uid"
                .to_string(),
        )),
    }
}

/// The item as a resource identifier. The item carries its kind, not its resource:
/// the resource is the kind's lowercase plural, as Kubernetes names its own kinds' resources.
fn resource(item: &Value) -> Value {
    let api_version = item["apiVersion"].as_str().unwrap_or("");
    let group = api_version.rsplit_once('/').map(|(g, _)| g).unwrap_or("");
    let kind = item["kind"].as_str().unwrap_or("").to_ascii_lowercase();
    let resource = if kind.ends_with('s') || kind.ends_with('x') {
        format!("{kind}es")
    } else if let Some(stem) = kind.strip_suffix('y') {
        format!("{stem}ies")
    } else {
        format!("{kind}s")
    };
    json!({
        "group": group,
        "resource": resource,
        "namespace": item.pointer("/metadata/namespace").and_then(Value::as_str).unwrap_or(""),
        "name": item.pointer("/metadata/name").and_then(Value::as_str).unwrap_or(""),
    })
}

/// The agent's operation as Velero's `OperationProgress`: finished phases are
/// `completed`, failed and canceled ones with their error; unset times are Go's zero.
fn velero_progress(op: &Value) -> wire::OperationProgress {
    let phase = op["phase"].as_str().unwrap_or("");
    let completed = matches!(phase, "Completed" | "Failed" | "Canceled");
    let err = match phase {
        "Failed" | "Canceled" => match op["error"].as_str() {
            Some(e) if !e.is_empty() => e.to_string(),
            _ => format!("the operation is {phase}"),
        },
        _ => String::new(),
    };
    wire::OperationProgress {
        completed,
        err,
        n_completed: op["nCompleted"].as_i64().unwrap_or(0),
        n_total: op["nTotal"].as_i64().unwrap_or(0),
        operation_units: op["operationUnits"].as_str().unwrap_or("").to_string(),
        description: op["description"].as_str().unwrap_or("").to_string(),
        started: Some(timestamp(&op["started"])),
        updated: Some(timestamp(&op["pluginUpdated"])),
    }
}

fn timestamp(v: &Value) -> wire::Timestamp {
    let parsed = v.as_str().and_then(|s| {
        time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).ok()
    });
    match parsed {
        Some(t) => wire::Timestamp {
            seconds: t.unix_timestamp(),
            nanos: t.nanosecond() as i32,
        },
        None => wire::Timestamp {
            seconds: wire::GO_ZERO_SECONDS,
            nanos: 0,
        },
    }
}

type Body = tonic::body::Body;

/// What a call's path is answered by: the stand-in itself, or (`None`) the original.
#[derive(Clone, Copy)]
enum Own {
    ListPlugins,
    HealthCheck,
    Shutdown,
    Execute(Kind),
    Progress(Kind),
    Cancel(Kind),
    /// DeleteItemAction: the stand-in's own, or the original's passed on.
    Delete,
}

impl Own {
    fn of(path: &str) -> Option<Own> {
        let kind = if path.starts_with("/v2.BackupItemAction/") {
            Some(Kind::Backup)
        } else if path.starts_with("/v2.RestoreItemAction/") {
            Some(Kind::Restore)
        } else {
            None
        };
        match (path, kind, path.rsplit('/').next()) {
            (wire::LIST_PLUGINS, _, _) => Some(Own::ListPlugins),
            (wire::HEALTH_CHECK, _, _) => Some(Own::HealthCheck),
            (wire::CONTROLLER_SHUTDOWN, _, _) => Some(Own::Shutdown),
            (wire::DELETE_APPLIES_TO | wire::DELETE_EXECUTE, _, _) => Some(Own::Delete),
            (_, Some(kind), Some("Execute")) => Some(Own::Execute(kind)),
            (_, Some(kind), Some("Progress")) => Some(Own::Progress(kind)),
            (_, Some(kind), Some("Cancel")) => Some(Own::Cancel(kind)),
            _ => None,
        }
    }
}

impl StandIn {
    /// The answer to a call the stand-in handles itself, encoded.
    async fn answer(self: Arc<Self>, own: Own, path: &str, body: Bytes) -> Result<Bytes, Status> {
        let path =
            PathAndQuery::try_from(path).map_err(|e| Status::unimplemented(e.to_string()))?;
        let encoded = match own {
            Own::ListPlugins => {
                let forget = self.forget.iter().map(|name| wire::PluginIdentifier {
                    command: String::new(),
                    kind: wire::KIND_DELETE.to_string(),
                    name: name.clone(),
                });
                let plugins = self.served.iter().cloned().chain(forget);
                let plugins = plugins
                    .map(|p| wire::PluginIdentifier {
                        command: self.command.clone(),
                        ..p
                    })
                    .collect();
                wire::ListPluginsResponse { plugins }.encode_to_vec()
            }
            Own::HealthCheck => wire::HealthCheckResponse { status: 1 }.encode_to_vec(),
            Own::Shutdown => {
                // Answer first, then go, leaving no process or socket behind.
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    self.original.stop().await;
                    let _ = std::fs::remove_dir_all(&self.socket_dir);
                    std::process::exit(0);
                });
                wire::Empty {}.encode_to_vec()
            }
            Own::Execute(kind) => return self.execute(kind, path, body).await,
            Own::Progress(kind) => self.progress(kind, body).await?.encode_to_vec(),
            Own::Cancel(kind) => self.cancel(kind, body).await?.encode_to_vec(),
            Own::Delete => {
                let plugin = wire::PluginRequest::decode(body.clone()).map(|r| r.plugin);
                if self.forget.is_none() || plugin.ok() != self.forget {
                    return self.pass(path, body).await;
                }
                if path.path() == wire::DELETE_APPLIES_TO {
                    self.forget_applies_to().await.encode_to_vec()
                } else {
                    self.forget(body).await?.encode_to_vec()
                }
            }
        };
        Ok(Bytes::from(encoded))
    }
}

/// One HTTP/2 request: a gRPC call, routed by its path. Requests are decoded and answers
/// encoded by the handlers, so a malformed request gets the stand-in's own error.
async fn route(
    standin: Arc<StandIn>,
    request: HttpRequest<hyper::body::Incoming>,
) -> Result<HttpResponse<Body>, std::convert::Infallible> {
    let path = request.uri().path().to_string();
    let request = request.map(Body::new);
    let response = match Own::of(&path) {
        Some(own) => {
            let service = tower::service_fn(move |r: Request<Bytes>| {
                let (s, path) = (standin.clone(), path.clone());
                async move {
                    s.answer(own, &path, r.into_inner())
                        .await
                        .map(Response::new)
                }
            });
            tonic::server::Grpc::new(Raw).unary(service, request).await
        }
        // go-plugin's broker and stdio stream: the stand-in has neither.
        None if path.starts_with("/plugin.") => {
            Status::unimplemented(format!("opmon-velero-plugin does not serve {path}")).into_http()
        }
        // Everything else, streaming or not (gRPC frames a unary call as a stream of one
        // message each way): passed on message by message.
        None => {
            let service = tower::service_fn(move |r: Request<tonic::Streaming<Bytes>>| {
                let (s, path) = (standin.clone(), PathAndQuery::try_from(path.clone()));
                async move {
                    let path = path.map_err(|e| Status::unimplemented(e.to_string()))?;
                    s.pass_streaming(path, r.into_inner()).await
                }
            });
            tonic::server::Grpc::new(Raw)
                .streaming(service, request)
                .await
        }
    };
    Ok(response)
}

/// Where the original plugin is: `OPMON_VELERO_ORIGINAL`, else its file name (the
/// stand-in's own) in [`ORIGINALS`].
fn original_path(own: &Path) -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("OPMON_VELERO_ORIGINAL") {
        return Ok(PathBuf::from(path));
    }
    let name = own
        .file_name()
        .ok_or_else(|| format!("cannot tell this binary's name from {}", own.display()))?;
    Ok(Path::new(ORIGINALS).join(name))
}

async fn run() -> Result<(), String> {
    let own = std::env::current_exe().map_err(|e| format!("finding this binary: {e}"))?;
    let original = original_path(&own)?;
    if !original.is_file() {
        return Err(format!(
            "the original plugin {} does not exist (opmon-velero-plugin install puts it \
             there; or set OPMON_VELERO_ORIGINAL)",
            original.display()
        ));
    }
    // The original gets what Velero gave the stand-in: its flags, and its environment
    // (which the host passes on, less go-plugin's variables, which it sets itself).
    let host = Host::new(HostKey {
        path: original.clone(),
        args: std::env::args().skip(1).collect(),
        env: BTreeMap::new(),
    });
    let connection = host.connection().await?;
    let served = connection.served.to_vec();
    let socket = std::env::var_os("OPMON_SOCKET")
        .map(PathBuf::from)
        .unwrap_or_else(opmon_client::default_socket_path);
    let timeout = match std::env::var("OPMON_VELERO_AGENT_TIMEOUT") {
        Ok(text) => {
            text.parse::<opmon_client::GoDuration>()
                .map_err(|e| format!("OPMON_VELERO_AGENT_TIMEOUT={text:?}: {e}"))?
                .0
        }
        Err(_) => AGENT_TIMEOUT,
    };

    // The stand-in's own DeleteItemAction, named for this file (see FORGET_PREFIX).
    let forget = served
        .iter()
        .any(|p| p.kind == wire::KIND_BACKUP_V2)
        .then(|| {
            own.file_name()
                .map(|f| format!("{FORGET_PREFIX}{}", f.to_string_lossy()))
        })
        .flatten();
    let dir = tempfile::Builder::new()
        .prefix("opmon-velero-plugin")
        .tempdir()
        .map_err(|e| format!("creating the socket's directory: {e}"))?;
    let standin = Arc::new(StandIn {
        timeout,
        instance: velero_instance(),
        original: host,
        served,
        command: own.display().to_string(),
        socket,
        socket_dir: dir.path().to_path_buf(),
        agent: tokio::sync::Mutex::new(None),
        away: std::sync::Mutex::new(None),
        answered: std::sync::Mutex::new(Default::default()),
        forget,
        forgotten: std::sync::Mutex::new(Default::default()),
    });
    let address = dir.path().join("plugin.sock");
    let listener = tokio::net::UnixListener::bind(&address)
        .map_err(|e| format!("binding {}: {e}", address.display()))?;
    // go-plugin's handshake: core protocol 1, Velero's protocol 2, where to dial, gRPC.
    {
        use std::io::Write;
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "1|2|unix|{}|grpc|", address.display())
            .and_then(|()| stdout.flush())
            .map_err(|e| format!("writing the handshake: {e}"))?;
    }
    // A Velero that (re)starts fails the backups it finds InProgress; the agent fails
    // the owners an earlier Velero left InProgress the same way. Not before the
    // handshake: Velero waits for it, and the agent may be slow or away.
    tokio::spawn({
        let standin = standin.clone();
        async move {
            let params = json!({"name": SERVER, "instance": standin.instance});
            match standin.call("server.started", params).await {
                Ok(answer) => {
                    for owner in answer["failed"].as_array().into_iter().flatten() {
                        tracing::info!(
                            "{} {} failed: Velero restarted while it was InProgress",
                            owner["kind"].as_str().unwrap_or("?"),
                            owner["name"].as_str().unwrap_or("?")
                        );
                    }
                }
                Err(e) => tracing::warn!("telling the agent that Velero started: {e}"),
            }
        }
    });
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!("accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let standin = standin.clone();
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |request| route(standin.clone(), request));
            if let Err(e) = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!("a connection ended: {e}");
            }
        });
    }
}

/// `install PLUGIN [ORIGINALS]`: puts the stand-in in the original plugin's place, as an
/// init container of Velero's pod does after the original's own has copied it into the
/// plugins volume. The original is copied to `ORIGINALS/<its name>` ([`ORIGINALS`] unless
/// given; another volume, so not renamed), outside the directory Velero's discovery
/// reads, and this binary takes its name. Run again (a restarted pod), it changes
/// nothing, or copies again an original its own init container copied over the
/// stand-in. The original is copied before the stand-in replaces it, each file written
/// whole and renamed into place: stopped at any point, a run again finishes the work.
fn install(target: &Path, originals: &Path) -> Result<String, String> {
    let own = std::env::current_exe().map_err(|e| format!("finding this binary: {e}"))?;
    let me = std::fs::read(&own).map_err(|e| format!("reading {}: {e}", own.display()))?;
    let name = target
        .file_name()
        .ok_or_else(|| format!("{} names no file", target.display()))?;
    let original = originals.join(name);
    let there = match std::fs::read(target) {
        Ok(bytes) => Some(bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("reading {}: {e}", target.display())),
    };
    match there {
        Some(bytes) if bytes == me => {
            if !original.is_file() {
                return Err(format!(
                    "{} is already the stand-in, but the original {} is missing",
                    target.display(),
                    original.display()
                ));
            }
            return Ok(format!("{} is already the stand-in", target.display()));
        }
        // Two volumes: a copy, not a rename.
        Some(bytes) => {
            std::fs::create_dir_all(originals)
                .map_err(|e| format!("creating {}: {e}", originals.display()))?;
            write_whole(&original, &bytes)?
        }
        None if original.is_file() => {}
        None => {
            return Err(format!(
                "no plugin {} to stand in for: the original's init container must copy it \
                 there first",
                target.display()
            ))
        }
    }
    write_whole(target, &me)?;
    Ok(format!(
        "{} stands in for the original, now {}",
        target.display(),
        original.display()
    ))
}

/// Writes an executable file whole: a temporary beside it (not executable, so that
/// Velero's discovery never runs it), then renamed over `path`.
fn write_whole(path: &Path, bytes: &[u8]) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let temporary = dir.join(format!(".{name}.opmon-tmp"));
    std::fs::write(&temporary, bytes)
        .and_then(|()| std::fs::File::open(&temporary)?.sync_all())
        .and_then(|()| std::fs::set_permissions(&temporary, std::fs::Permissions::from_mode(0o755)))
        .and_then(|()| std::fs::rename(&temporary, path))
        .map_err(|e| format!("writing {}: {e}", path.display()))
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("install") {
        let (target, originals) = match args.as_slice() {
            [_, target] => (target.as_str(), ORIGINALS),
            [_, target, originals] => (target.as_str(), originals.as_str()),
            _ => {
                eprintln!(
                    "usage: opmon-velero-plugin install /target/<the original plugin's file \
                     name> [<where the original goes: {ORIGINALS}>]"
                );
                std::process::exit(2);
            }
        };
        match install(Path::new(target), Path::new(originals)) {
            Ok(done) => println!("{done}"),
            Err(e) => {
                eprintln!("opmon-velero-plugin install: {e}");
                std::process::exit(1);
            }
        }
        return;
    }
    // What go-plugin's Serve checks first: run by hand, a plugin says what it is.
    if std::env::var("VELERO_PLUGIN").as_deref() != Ok("hello") {
        eprintln!(
            "opmon-velero-plugin is a Velero plugin: Velero runs it, with the original \
             plugin beside it (opmon-velero-plugin install /target/<plugin> puts it there)"
        );
        std::process::exit(1);
    }
    // go-plugin's host logs the plugin's stderr lines.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("OPMON_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    if let Err(e) = run().await {
        eprintln!("opmon-velero-plugin: {e}");
        std::process::exit(1);
    }
}
