//! Calls to snapshotters: Progress and Cancel over the two transports of
//! ARCHITECTURE.md's snapshotter protocol.
//!
//! - socket: JSON-RPC batches over HTTP/1.1 on a Unix socket, on a small pool of
//!   kept-alive connections;
//! - command: one process per call, with a bounded number running at once.
//!
//! Every call has a deadline. A hung or dead snapshotter costs its own operations the
//! deadline and nothing else: callers poll each snapshotter independently.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::stream::{self, StreamExt};
use http_body_util::{BodyExt, Full, Limited};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use opmon_client::{codes, ApiVersion, OperationProgress, OperationRef, Snapshotter};
use serde::Deserialize;
use serde_json::value::RawValue;
use tokio::sync::Semaphore;

/// Largest response body read from a snapshotter.
const MAX_RESPONSE_BYTES: usize = 16 * 1024 * 1024;
/// Kept-alive connections per socket snapshotter.
const POOL_SIZE: usize = 8;

/// Tuning shared by all snapshotters.
#[derive(Clone, Debug)]
pub struct CallSettings {
    pub deadline: Duration,
    pub batch_size: usize,
    /// Batches in flight at once to one socket snapshotter.
    pub socket_concurrency: usize,
    /// Processes running at once for one command snapshotter.
    pub command_concurrency: usize,
}

/// Why a call to a snapshotter brought no progress.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The snapshotter could not be reached or did not answer in time (connection
    /// refused, reset, deadline passed, process not startable). Transient: the
    /// operation is polled again until the grace period runs out.
    #[error("{0}")]
    Unreachable(String),
    /// The snapshotter answered, with an error or with something that is not a
    /// progress: the operation fails now.
    #[error("{0}")]
    Answered(String),
}

impl CallError {
    pub fn message(&self) -> &str {
        match self {
            CallError::Unreachable(m) | CallError::Answered(m) => m,
        }
    }
}

type Answer<T> = Result<T, CallError>;

/// How the agent reaches one snapshotter.
pub enum Remote {
    /// v1: no Progress, no Cancel.
    V1,
    Socket(SocketRemote),
    Command(CommandRemote),
}

impl Remote {
    pub fn new(s: &Snapshotter, settings: &CallSettings) -> Remote {
        match (s.api_version, &s.socket, &s.command) {
            (ApiVersion::V1, _, _) => Remote::V1,
            (_, Some(socket), _) => Remote::Socket(SocketRemote {
                name: s.name.clone(),
                path: socket.clone(),
                pool: Mutex::new(Vec::new()),
                settings: settings.clone(),
                in_flight: Semaphore::new(settings.socket_concurrency.max(1)),
            }),
            (_, None, command) => Remote::Command(CommandRemote {
                name: s.name.clone(),
                argv: command.clone().unwrap_or_default(),
                settings: settings.clone(),
                running: Semaphore::new(settings.command_concurrency.max(1)),
            }),
        }
    }

    /// Progress of each operation, in order.
    pub async fn progress(&self, ops: &[OperationRef]) -> Vec<Answer<OperationProgress>> {
        match self {
            Remote::V1 => ops
                .iter()
                .map(|_| {
                    Ok(OperationProgress {
                        completed: true,
                        ..Default::default()
                    })
                })
                .collect(),
            Remote::Socket(s) => s.progress(ops).await,
            Remote::Command(c) => {
                // Indices rather than references keep the stream's closure free of
                // higher-ranked lifetimes, so the future stays Send.
                stream::iter(0..ops.len())
                    .map(|i| c.progress(&ops[i]))
                    .buffered(c.settings.command_concurrency.max(1))
                    .collect()
                    .await
            }
        }
    }

    /// Asks the snapshotter to cancel `op`; a no-op for v1.
    pub async fn cancel(&self, op: &OperationRef) -> Answer<()> {
        match self {
            Remote::V1 => Ok(()),
            Remote::Socket(s) => {
                let results = s.batch("operation.cancel", std::slice::from_ref(op)).await;
                results.into_iter().next().map_or(Ok(()), |r| r.map(|_| ()))
            }
            Remote::Command(c) => c.run("cancel", op).await.map(|_| ()),
        }
    }
}

/// A snapshotter serving JSON-RPC on a Unix socket.
pub struct SocketRemote {
    name: String,
    path: PathBuf,
    pool: Mutex<Vec<SendRequest<Full<Bytes>>>>,
    settings: CallSettings,
    in_flight: Semaphore,
}

#[derive(Deserialize)]
struct ResponseEntry<'a> {
    id: Option<u64>,
    #[serde(borrow)]
    result: Option<&'a RawValue>,
    error: Option<ErrorEntry>,
}

#[derive(Deserialize)]
struct ErrorEntry {
    code: i32,
    message: String,
}

impl SocketRemote {
    async fn progress(&self, ops: &[OperationRef]) -> Vec<Answer<OperationProgress>> {
        let size = self.settings.batch_size.max(1);
        let answers: Vec<Vec<Answer<Box<RawValue>>>> = stream::iter((0..ops.len()).step_by(size))
            .map(|start| {
                self.batch(
                    "operation.progress",
                    &ops[start..(start + size).min(ops.len())],
                )
            })
            .buffered(self.settings.socket_concurrency.max(1))
            .collect()
            .await;
        answers
            .into_iter()
            .flatten()
            .map(|answer| {
                answer.and_then(|raw| {
                    serde_json::from_str::<OperationProgress>(raw.get()).map_err(|e| {
                        CallError::Answered(format!(
                            "snapshotter {} answered an invalid progress: {e}",
                            self.name
                        ))
                    })
                })
            })
            .collect()
    }

    /// Sends one JSON-RPC batch of `method` for `ops`; one answer per op, in order.
    async fn batch(&self, method: &str, ops: &[OperationRef]) -> Vec<Answer<Box<RawValue>>> {
        let _permit = self.in_flight.acquire().await;
        let body = match encode_batch(method, ops) {
            Ok(body) => body,
            Err(e) => {
                let e = CallError::Answered(e);
                return ops.iter().map(|_| Err(e.clone())).collect();
            }
        };
        let response = match tokio::time::timeout(
            self.settings.deadline,
            self.post(Bytes::from(body)),
        )
        .await
        {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(e)) => return ops.iter().map(|_| Err(e.clone())).collect(),
            Err(_) => {
                let e = CallError::Unreachable(format!(
                    "snapshotter {} did not answer within {}",
                    self.name,
                    opmon_client::GoDuration(self.settings.deadline)
                ));
                return ops.iter().map(|_| Err(e.clone())).collect();
            }
        };
        self.decode_batch(&response, ops.len())
    }

    fn decode_batch(&self, response: &[u8], count: usize) -> Vec<Answer<Box<RawValue>>> {
        let whole = |e: String| {
            (0..count)
                .map(|_| Err(CallError::Answered(e.clone())))
                .collect()
        };
        let entries: Vec<ResponseEntry<'_>> = match serde_json::from_slice(response) {
            Ok(entries) => entries,
            Err(_) => {
                // A single error object answers the whole batch (e.g. a parse error).
                return match serde_json::from_slice::<ResponseEntry<'_>>(response) {
                    Ok(ResponseEntry { error: Some(e), .. }) => whole(self.describe(&e)),
                    _ => whole(format!(
                        "snapshotter {} answered something that is not a JSON-RPC response",
                        self.name
                    )),
                };
            }
        };
        let mut answers: Vec<Answer<Box<RawValue>>> = (0..count)
            .map(|_| {
                Err(CallError::Answered(format!(
                    "snapshotter {} left the call unanswered",
                    self.name
                )))
            })
            .collect();
        for entry in entries {
            let Some(slot) = entry.id.and_then(|id| answers.get_mut(id as usize)) else {
                continue;
            };
            *slot = match (entry.result, entry.error) {
                (_, Some(e)) => Err(CallError::Answered(self.describe(&e))),
                (Some(result), None) => Ok(result.to_owned()),
                (None, None) => Err(CallError::Answered(format!(
                    "snapshotter {} answered without a result",
                    self.name
                ))),
            };
        }
        answers
    }

    fn describe(&self, e: &ErrorEntry) -> String {
        match e.code {
            codes::OPERATIONS_NOT_SUPPORTED => {
                format!(
                    "OperationsNotSupported: snapshotter {}: {}",
                    self.name, e.message
                )
            }
            codes::INVALID_OPERATION_ID => {
                format!(
                    "InvalidOperationId: snapshotter {}: {}",
                    self.name, e.message
                )
            }
            code => format!("snapshotter {}: {} (code {code})", self.name, e.message),
        }
    }

    /// POSTs `body` to `/`, reusing a pooled connection when one is idle.
    async fn post(&self, body: Bytes) -> Result<Bytes, CallError> {
        let pooled = self.pool.lock().ok().and_then(|mut p| p.pop());
        let mut sender = match pooled {
            Some(s) if !s.is_closed() => s,
            _ => self.connect().await?,
        };
        let request = hyper::Request::post("/")
            .header(hyper::header::HOST, "localhost")
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|e| {
                CallError::Answered(format!(
                    "building a request for snapshotter {}: {e}",
                    self.name
                ))
            })?;
        let unreachable = |e: &dyn std::fmt::Display| {
            CallError::Unreachable(format!(
                "snapshotter {} at {}: {e}",
                self.name,
                self.path.display()
            ))
        };
        sender.ready().await.map_err(|e| unreachable(&e))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| unreachable(&e))?;
        let status = response.status();
        let bytes = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
            .collect()
            .await
            .map_err(|e| {
                if e.downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some()
                {
                    CallError::Answered(format!(
                        "snapshotter {} answered more than {MAX_RESPONSE_BYTES} bytes",
                        self.name
                    ))
                } else {
                    unreachable(&format!("reading the answer: {e}"))
                }
            })?
            .to_bytes();
        if !sender.is_closed() {
            if let Ok(mut pool) = self.pool.lock() {
                if pool.len() < POOL_SIZE {
                    pool.push(sender);
                }
            }
        }
        if !status.is_success() {
            return Err(unreachable(&format!("HTTP status {status}")));
        }
        Ok(bytes)
    }

    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, CallError> {
        let unreachable = |e: &dyn std::fmt::Display| {
            CallError::Unreachable(format!(
                "snapshotter {} at {}: {e}",
                self.name,
                self.path.display()
            ))
        };
        let stream = tokio::net::UnixStream::connect(&self.path)
            .await
            .map_err(|e| unreachable(&e))?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| unreachable(&e))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(sender)
    }
}

fn encode_batch(method: &str, ops: &[OperationRef]) -> Result<Vec<u8>, String> {
    #[derive(serde::Serialize)]
    struct Request<'a> {
        jsonrpc: &'static str,
        id: usize,
        method: &'a str,
        params: &'a OperationRef,
    }
    let requests: Vec<Request<'_>> = ops
        .iter()
        .enumerate()
        .map(|(id, params)| Request {
            jsonrpc: "2.0",
            id,
            method,
            params,
        })
        .collect();
    serde_json::to_vec(&requests).map_err(|e| format!("encoding a request: {e}"))
}

/// A snapshotter run as a command per call.
pub struct CommandRemote {
    name: String,
    argv: Vec<String>,
    settings: CallSettings,
    running: Semaphore,
}

impl CommandRemote {
    async fn progress(&self, op: &OperationRef) -> Answer<OperationProgress> {
        let stdout = self.run("progress", op).await?;
        serde_json::from_slice(&stdout).map_err(|e| {
            CallError::Answered(format!(
                "snapshotter {} printed an invalid progress for {}: {e}",
                self.name, op.operation_id
            ))
        })
    }

    /// Runs `argv… VERB OPERATION_ID`; returns stdout, or stderr's last line on failure.
    async fn run(&self, verb: &str, op: &OperationRef) -> Answer<Vec<u8>> {
        let _permit = self.running.acquire().await;
        let Some((program, args)) = self.argv.split_first() else {
            return Err(CallError::Answered(format!(
                "snapshotter {} has an empty command",
                self.name
            )));
        };
        let child = tokio::process::Command::new(program)
            .args(args)
            .arg(verb)
            .arg(&op.operation_id)
            .env("OPMON_PLUGIN", &op.plugin.name)
            .env("OPMON_PLUGIN_KIND", op.plugin.kind.as_str())
            .env("OPMON_OWNER_KIND", op.owner.kind.as_str())
            .env("OPMON_OWNER_NAME", &op.owner.name)
            .env("OPMON_OWNER_UID", &op.owner.uid)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                CallError::Unreachable(format!("snapshotter {}: running {program}: {e}", self.name))
            })?;
        let output =
            match tokio::time::timeout(self.settings.deadline, child.wait_with_output()).await {
                Ok(Ok(output)) => output,
                Ok(Err(e)) => {
                    return Err(CallError::Unreachable(format!(
                        "snapshotter {}: {e}",
                        self.name
                    )))
                }
                Err(_) => {
                    return Err(CallError::Unreachable(format!(
                        "snapshotter {} did not answer within {}",
                        self.name,
                        opmon_client::GoDuration(self.settings.deadline)
                    )))
                }
            };
        if output.status.success() {
            return Ok(output.stdout);
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last = stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("")
            .trim();
        Err(CallError::Answered(format!(
            "snapshotter {} {verb} {} failed ({}): {last}",
            self.name, op.operation_id, output.status
        )))
    }
}

/// The live snapshotters by plugin name, rebuilt from the database at start.
#[derive(Default)]
pub struct Registry {
    remotes: std::sync::RwLock<std::collections::HashMap<String, Arc<Remote>>>,
}

impl Registry {
    pub fn get(&self, plugin: &str) -> Option<Arc<Remote>> {
        self.remotes.read().ok()?.get(plugin).cloned()
    }

    pub fn insert(&self, s: &Snapshotter, settings: &CallSettings) {
        if let Ok(mut map) = self.remotes.write() {
            map.insert(s.name.clone(), Arc::new(Remote::new(s, settings)));
        }
    }

    pub fn remove(&self, name: &str) {
        if let Ok(mut map) = self.remotes.write() {
            map.remove(name);
        }
    }

    /// How many snapshotters are registered.
    pub fn count(&self) -> usize {
        self.remotes.read().map(|m| m.len()).unwrap_or(0)
    }
}
