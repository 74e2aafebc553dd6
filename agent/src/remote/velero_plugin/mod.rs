//! Velero plugin snapshotters: a plugin binary built with Velero's plugin framework, run
//! by the agent ([`host`]) and asked for Progress and Cancel through BackupItemAction v2
//! and RestoreItemAction v2 as Velero's plugin manager asks it.
//!
//! - each call names the plugin (one binary serves many by the request's `plugin`), the
//!   operation ID and the owner's object as JSON, Velero's Backup or Restore;
//! - a `started` or `updated` of Go's zero time means unset, as in Velero;
//! - a plugin's own error comes as gRPC code Unknown (with a `generated.Stack` detail)
//!   and fails the operation; a plugin that is down or does not answer by the deadline
//!   is unreachable, as a socket snapshotter that refuses connections is;
//! - gRPC has no batches: calls go one per operation, up to `socket_concurrency` ×
//!   `batch_size` at once over the binary's one HTTP/2 connection.

mod host;
pub mod wire;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};

use futures::stream::{self, StreamExt};
use opmon_client::{OperationProgress, OwnerKind, PluginKind, Snapshotter};
use tonic::codegen::http::uri::PathAndQuery;

use super::{Answer, Call, CallError, CallSettings};
use crate::sync::lock;
pub use host::{Host, HostKey};

/// The binaries running, shared by the snapshotters that name them.
#[derive(Default)]
pub struct Hosts(Mutex<HashMap<HostKey, Weak<Host>>>);

impl Hosts {
    /// The host of `s`'s binary: the running one if another snapshotter named it too.
    pub fn of(&self, s: &Snapshotter) -> Option<Arc<Host>> {
        let key = key(s)?;
        let mut hosts = lock(&self.0);
        hosts.retain(|_, h| h.strong_count() > 0);
        if let Some(host) = hosts.get(&key).and_then(Weak::upgrade) {
            return Some(host);
        }
        let host = Arc::new(Host::new(key.clone()));
        hosts.insert(key, Arc::downgrade(&host));
        Some(host)
    }
}

fn key(s: &Snapshotter) -> Option<HostKey> {
    Some(HostKey {
        path: s.velero_plugin.clone()?,
        args: s.args.clone().unwrap_or_default(),
        env: s.env.clone().unwrap_or_default(),
    })
}

/// A snapshotter served by a Velero plugin binary.
pub struct VeleroRemote {
    name: String,
    host: Arc<Host>,
    pub(super) settings: CallSettings,
}

impl VeleroRemote {
    pub fn new(s: &Snapshotter, host: Arc<Host>, settings: &CallSettings) -> VeleroRemote {
        VeleroRemote {
            name: s.name.clone(),
            host,
            settings: settings.clone(),
        }
    }

    /// Calls in flight at once.
    pub(super) fn concurrency(&self) -> usize {
        (self.settings.socket_concurrency.max(1) * self.settings.batch_size.max(1)).min(1024)
    }

    /// Starts the binary if it is not running and checks that it serves this
    /// snapshotter's plugin as an action with Progress; otherwise says what it serves.
    pub async fn check_served(&self) -> Result<(), String> {
        let connection = self.host.connection().await?;
        let v2 = [wire::KIND_BACKUP_V2, wire::KIND_RESTORE_V2];
        if connection
            .served
            .iter()
            .any(|p| p.name == self.name && v2.contains(&p.kind.as_str()))
        {
            return Ok(());
        }
        let served: Vec<String> = connection
            .served
            .iter()
            .map(|p| format!("{} {}", p.kind, p.name))
            .collect();
        Err(format!(
            "{} does not serve {} as a {} or {} (it serves: {})",
            self.host.path().display(),
            self.name,
            wire::KIND_BACKUP_V2,
            wire::KIND_RESTORE_V2,
            if served.is_empty() {
                "nothing".to_string()
            } else {
                served.join(", ")
            }
        ))
    }

    pub(super) async fn progress<C: Call>(&self, ops: &[C]) -> Vec<Answer<OperationProgress>> {
        stream::iter(0..ops.len())
            .map(|i| self.progress_one(&ops[i]))
            .buffered(self.concurrency())
            .collect()
            .await
    }

    async fn progress_one<C: Call>(&self, op: &C) -> Answer<OperationProgress> {
        let path = match op.plugin().kind {
            PluginKind::BackupItemAction => wire::BACKUP_PROGRESS,
            PluginKind::RestoreItemAction => wire::RESTORE_PROGRESS,
            PluginKind::VolumeSnapshotter => return Err(self.no_volume_snapshotters()),
            // The agent refuses an unknown kind in addOperations: never stored.
            PluginKind::Unknown => return Err(self.unknown_kind()),
        };
        let answer: wire::ProgressResponse = self.unary(path, request(op)).await?;
        progress(answer.progress.unwrap_or_default()).map_err(|e| {
            CallError::Answered(format!(
                "snapshotter {} answered an invalid progress for {}: {e}",
                self.name,
                op.operation_id()
            ))
        })
    }

    pub(super) async fn cancel_one<C: Call>(&self, op: &C) -> Answer<()> {
        let path = match op.plugin().kind {
            PluginKind::BackupItemAction => wire::BACKUP_CANCEL,
            PluginKind::RestoreItemAction => wire::RESTORE_CANCEL,
            PluginKind::VolumeSnapshotter => return Err(self.no_volume_snapshotters()),
            // The agent refuses an unknown kind in addOperations: never stored.
            PluginKind::Unknown => return Err(self.unknown_kind()),
        };
        self.unary::<wire::Empty>(path, request(op))
            .await
            .map(|_| ())
    }

    fn unknown_kind(&self) -> CallError {
        CallError::Answered(format!(
            "snapshotter {}: an operation of a plugin kind this agent does not know",
            self.name
        ))
    }

    fn no_volume_snapshotters(&self) -> CallError {
        CallError::Answered(format!(
            "snapshotter {}: Velero's VolumeSnapshotter plugins have no Progress or Cancel",
            self.name
        ))
    }

    /// One call, within the deadline.
    async fn unary<T: prost::Message + Default + Send + 'static>(
        &self,
        path: &'static str,
        request: wire::OperationRequest,
    ) -> Answer<T> {
        let call = async {
            let connection =
                self.host.connection().await.map_err(|e| {
                    CallError::Unreachable(format!("snapshotter {}: {e}", self.name))
                })?;
            let mut grpc = tonic::client::Grpc::new(connection.channel.clone());
            grpc.ready()
                .await
                .map_err(|e| CallError::Unreachable(format!("snapshotter {}: {e}", self.name)))?;
            grpc.unary(
                tonic::Request::new(request),
                PathAndQuery::from_static(path),
                tonic_prost::ProstCodec::<wire::OperationRequest, T>::default(),
            )
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| self.status_error(&s, connection.exited.load(Ordering::Acquire)))
        };
        match tokio::time::timeout(self.settings.deadline, call).await {
            Ok(answer) => answer,
            Err(_) => Err(CallError::Unreachable(format!(
                "snapshotter {} did not answer within {} ms",
                self.name,
                self.settings.deadline.as_millis()
            ))),
        }
    }

    /// What a gRPC error status means for the operation.
    fn status_error(&self, s: &tonic::Status, exited: bool) -> CallError {
        use tonic::Code;
        let name = &self.name;
        // A status made on this side (the connection broke) has a cause; a plugin's
        // comes from the wire and has none.
        let local = std::error::Error::source(s).is_some();
        if exited || local {
            return CallError::Unreachable(format!(
                "snapshotter {name}: the plugin went away: {}",
                s.message()
            ));
        }
        match s.code() {
            // How Velero's framework returns a plugin's error (`common.NewGRPCError`).
            // The operation's error is what Velero records of it (the Go client's
            // error text): what Velero shows is the same through opmon as without it.
            Code::Unknown => {
                if let Some(frame) = stack(s) {
                    tracing::debug!(snapshotter = %name, "plugin error at {frame}: {}", s.message());
                }
                CallError::Answered(go_status_text(s))
            }
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => {
                CallError::Unreachable(format!("snapshotter {name}: {}", s.message()))
            }
            Code::ResourceExhausted | Code::Aborted => CallError::Transient(format!(
                "snapshotter {name}: {} ({:?})",
                s.message(),
                s.code()
            )),
            _ => CallError::Answered(go_status_text(s)),
        }
    }
}

/// A gRPC error as Velero records it: `err.Error()` of grpc-go's status error, which
/// Velero's plugin client returns (`common.FromGRPCError`) and its operations
/// controller stores as the operation's error.
fn go_status_text(s: &tonic::Status) -> String {
    use tonic::Code;
    // grpc-go's `codes.Code.String()`; tonic spells two of them otherwise.
    let code = match s.code() {
        Code::Cancelled => "Canceled".to_string(),
        Code::Ok => "OK".to_string(),
        code => format!("{code:?}"),
    };
    format!("rpc error: code = {code} desc = {}", s.message())
}

/// The top frame of the `generated.Stack` a Velero plugin's error carries.
fn stack(s: &tonic::Status) -> Option<String> {
    use prost::Message;
    let status = wire::RpcStatus::decode(s.details()).ok()?;
    let detail = status
        .details
        .iter()
        .find(|d| d.type_url.ends_with("generated.Stack"))?;
    let stack = wire::Stack::decode(detail.value.as_slice()).ok()?;
    let top = stack.frames.first()?;
    Some(format!("{} ({}:{})", top.function, top.file, top.line))
}

/// The request for `op`: the plugin's name, the operation ID and the owner as JSON.
fn request<C: Call>(op: &C) -> wire::OperationRequest {
    let owner = op.owner();
    let object = match &owner.object {
        Some(object) => serde_json::to_vec(object),
        // Velero always sends the object; an owner started without one gets what the
        // agent knows of it, so the plugin can still decode a Backup or Restore.
        None => serde_json::to_vec(&serde_json::json!({
            "apiVersion": "velero.io/v1",
            "kind": match owner.kind {
                OwnerKind::Backup => "Backup",
                OwnerKind::Restore => "Restore",
            },
            "metadata": {"name": owner.name, "uid": owner.uid},
        })),
    };
    wire::OperationRequest {
        plugin: op.plugin().name.clone(),
        operation_id: op.operation_id().to_string(),
        // Serializing a JSON value cannot fail.
        owner: object.unwrap_or_default(),
    }
}

/// Velero's `OperationProgress` as the agent's.
fn progress(p: wire::OperationProgress) -> Result<OperationProgress, String> {
    Ok(OperationProgress {
        completed: p.completed,
        err: Some(p.err).filter(|err| !err.is_empty()),
        n_completed: p.n_completed,
        n_total: p.n_total,
        operation_units: p.operation_units,
        description: p.description,
        started: time(p.started)?,
        updated: time(p.updated)?,
    })
}

/// A timestamp; absent or Go's zero time means unset.
fn time(t: Option<wire::Timestamp>) -> Result<Option<time::OffsetDateTime>, String> {
    match t {
        None => Ok(None),
        Some(t) if t.seconds == wire::GO_ZERO_SECONDS && t.nanos == 0 => Ok(None),
        Some(t) => time::OffsetDateTime::from_unix_timestamp_nanos(
            i128::from(t.seconds) * 1_000_000_000 + i128::from(t.nanos),
        )
        .map(Some)
        .map_err(|e| format!("timestamp {}s {}ns: {e}", t.seconds, t.nanos)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_zero_time_and_absence_mean_unset_and_the_epoch_is_a_time() {
        let zero = wire::Timestamp {
            seconds: wire::GO_ZERO_SECONDS,
            nanos: 0,
        };
        assert_eq!(time(Some(zero)), Ok(None));
        assert_eq!(time(None), Ok(None));
        assert_eq!(
            time(Some(wire::Timestamp::default())),
            Ok(Some(time::OffsetDateTime::UNIX_EPOCH))
        );
    }
}
