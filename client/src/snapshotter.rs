//! The snapshotter SDK (feature `snapshotter`): implement [`OperationHandler`], call
//! [`serve`], and the agent can poll and cancel your operations over a Unix socket. (The
//! registration record the agent keeps is the API type [`crate::Snapshotter`].)
//!
//! The wire protocol is docs/architecture.md's "snapshotter protocol": JSON-RPC 2.0 over HTTP
//! POST `/` (or WebSocket) with `operation.progress` and `operation.cancel`, batches
//! allowed. Errors map to the protocol's codes: [`SnapshotterError::OperationsNotSupported`]
//! is 2001, [`SnapshotterError::InvalidOperationId`] is 2002, and
//! [`SnapshotterError::Transient`] is 2003 with `data: {"retryable": true}`: the agent
//! asks again later (with backoff, within the snapshotter's retry budget) instead of
//! failing the operation.
//!
//! ```no_run
//! use opmon_client::snapshotter::{serve, OperationHandler, SnapshotterError};
//! use opmon_client::{OperationProgress, OperationRef};
//!
//! struct Instant;
//!
//! impl OperationHandler for Instant {
//!     async fn progress(&self, op: OperationRef) -> Result<OperationProgress, SnapshotterError> {
//!         if !op.operation_id.starts_with("copy-") {
//!             return Err(SnapshotterError::InvalidOperationId(op.operation_id));
//!         }
//!         Ok(OperationProgress { completed: true, n_completed: 1, n_total: 1, ..Default::default() })
//!     }
//!
//!     async fn cancel(&self, _op: OperationRef) -> Result<(), SnapshotterError> {
//!         Ok(())
//!     }
//! }
//!
//! # async fn demo() -> std::io::Result<()> {
//! serve("/run/my-snapshotter.sock", Instant).await
//! # }
//! ```

use std::future::Future;
use std::io;
use std::path::Path;
use std::sync::Arc;

use jsonrpsee::types::ErrorObjectOwned;
use jsonrpsee::RpcModule;

use crate::server::{self, AdmitAll, ServeConfig};
use crate::types::{OperationProgress, OperationRef};
use crate::{codes, methods};

/// Why a snapshotter could not answer for an operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotterError {
    /// This snapshotter should not be handling the item (code 2001).
    #[error("operations not supported: {0}")]
    OperationsNotSupported(String),
    /// The operation ID is unknown, e.g. forgotten after a restart (code 2002).
    #[error("invalid operation ID: {0}")]
    InvalidOperationId(String),
    /// A failure that may pass (a busy backend, a storage connection lost for a moment):
    /// the agent tries again with backoff, and fails the operation with this message
    /// only once the snapshotter's retry budget is spent (code 2003).
    #[error("{0}")]
    Transient(String),
    /// Anything else: the operation fails with this message.
    #[error("{0}")]
    Other(String),
}

impl From<SnapshotterError> for ErrorObjectOwned {
    fn from(e: SnapshotterError) -> Self {
        let code = match &e {
            SnapshotterError::OperationsNotSupported(_) => codes::OPERATIONS_NOT_SUPPORTED,
            SnapshotterError::InvalidOperationId(_) => codes::INVALID_OPERATION_ID,
            SnapshotterError::Transient(_) => {
                return ErrorObjectOwned::owned(
                    codes::TRANSIENT,
                    e.to_string(),
                    Some(serde_json::json!({ "retryable": true })),
                )
            }
            SnapshotterError::Other(_) => jsonrpsee::types::error::INTERNAL_ERROR_CODE,
        };
        ErrorObjectOwned::owned(code, e.to_string(), None::<()>)
    }
}

/// What a snapshotter does for the agent: report progress of, and cancel, the
/// long-running operations it owns.
///
/// Both calls may arrive concurrently and for operations of several owners. `progress`
/// must keep answering for an operation after the snapshotter restarts (keep the state
/// somewhere durable); `cancel` should return `Ok` whether or not the operation could be
/// stopped, as Velero's Cancel does.
pub trait OperationHandler: Send + Sync + 'static {
    fn progress(
        &self,
        op: OperationRef,
    ) -> impl Future<Output = Result<OperationProgress, SnapshotterError>> + Send;

    fn cancel(&self, op: OperationRef)
        -> impl Future<Output = Result<(), SnapshotterError>> + Send;
}

/// The JSON-RPC methods of `snapshotter`, for embedding into a server of your own.
pub fn rpc_module<S: OperationHandler>(snapshotter: S) -> RpcModule<S> {
    let mut module = RpcModule::new(snapshotter);
    module
        .register_async_method(
            methods::OPERATION_PROGRESS,
            |params, s: Arc<S>, _| async move {
                let op: OperationRef = params.parse()?;
                s.progress(op).await.map_err(ErrorObjectOwned::from)
            },
        )
        .expect("method names are unique");
    module
        .register_async_method(
            methods::OPERATION_CANCEL,
            |params, s: Arc<S>, _| async move {
                let op: OperationRef = params.parse()?;
                s.cancel(op).await.map_err(ErrorObjectOwned::from)
            },
        )
        .expect("method names are unique");
    module
}

/// Serves `snapshotter` on the Unix socket `socket` (mode 0660) until SIGTERM or SIGINT.
pub async fn serve<S: OperationHandler>(
    socket: impl AsRef<Path>,
    snapshotter: S,
) -> io::Result<()> {
    serve_until(socket, snapshotter, termination()).await
}

/// Serves `snapshotter` on `socket` until `shutdown` resolves, then finishes the calls
/// in flight and returns.
pub async fn serve_until<S: OperationHandler>(
    socket: impl AsRef<Path>,
    snapshotter: S,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    serve_methods(socket, rpc_module(snapshotter), shutdown).await
}

/// Serves any set of methods on `socket` until `shutdown` resolves: for a snapshotter
/// that adds methods of its own (say, one that starts operations) to
/// [`rpc_module`]'s.
pub async fn serve_methods(
    socket: impl AsRef<Path>,
    methods: impl Into<jsonrpsee::Methods>,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let listener = server::bind(socket.as_ref(), 0o660).await?;
    server::serve(
        listener,
        methods,
        ServeConfig::default(),
        jsonrpsee::server::middleware::rpc::RpcServiceBuilder::new()
            .layer_fn(crate::traffic::Traffic::layer),
        AdmitAll,
        shutdown,
    )
    .await;
    Ok(())
}

/// Tells the agent when operations change, so it polls them at once rather than at its
/// next poll (10 s by default): a finished copy reaches its owner in milliseconds.
///
/// Call [`Hints::changed`] whenever an operation's state changes (it finished, failed,
/// or made progress worth showing). It never blocks and never fails: hints are merged
/// and sent by a task of their own, one `snapshotter.changed` call at a time, and a hint
/// that cannot be sent is dropped (the agent's regular poll still finds the change).
/// Dropping the last clone stops the task.
///
/// ```no_run
/// # async fn demo() {
/// use opmon_client::snapshotter::Hints;
/// let hints = Hints::new("/run/opmon/agent.sock", "example.io/copier");
/// // … when copy-1 finishes:
/// hints.changed("copy-1");
/// # }
/// ```
#[derive(Clone)]
pub struct Hints {
    inner: Option<Arc<HintsInner>>,
}

struct HintsInner {
    plugin: String,
    /// IDs waiting to be sent; `None`: all of the plugin's operations.
    pending: std::sync::Mutex<Option<std::collections::BTreeSet<String>>>,
    wake: Arc<tokio::sync::Notify>,
}

impl Drop for HintsInner {
    fn drop(&mut self) {
        // Lets the sender task see that every handle is gone.
        self.wake.notify_one();
    }
}

impl Hints {
    /// Hints that go nowhere: for a snapshotter not told its agent's socket.
    pub fn none() -> Hints {
        Hints { inner: None }
    }

    /// Hints for `plugin`'s operations, sent to the agent on `agent_socket`. Must be
    /// called within a tokio runtime (it spawns the sender task).
    pub fn new(agent_socket: impl AsRef<Path>, plugin: impl Into<String>) -> Hints {
        let wake = Arc::new(tokio::sync::Notify::new());
        let inner = Arc::new(HintsInner {
            plugin: plugin.into(),
            pending: std::sync::Mutex::new(Some(Default::default())),
            wake: wake.clone(),
        });
        tokio::spawn(send_hints(
            agent_socket.as_ref().to_path_buf(),
            Arc::downgrade(&inner),
            wake,
        ));
        Hints { inner: Some(inner) }
    }

    /// Operation `operation_id` changed.
    pub fn changed(&self, operation_id: &str) {
        self.add(Some(operation_id));
    }

    /// Any of the plugin's operations may have changed (after a restart, say).
    pub fn all_changed(&self) {
        self.add(None);
    }

    fn add(&self, id: Option<&str>) {
        let Some(inner) = &self.inner else { return };
        {
            let mut pending = inner
                .pending
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match (pending.as_mut(), id) {
                // Bounded: past one call's worth, all of them.
                (Some(ids), Some(id)) if ids.len() < crate::types::MAX_CHANGED_OPERATIONS => {
                    ids.insert(id.to_string());
                }
                (Some(ids), Some(id)) if ids.contains(id) => {}
                _ => *pending = None,
            }
        }
        inner.wake.notify_one();
    }
}

/// Sends what [`Hints`] gathered, one call at a time, until every handle is dropped.
async fn send_hints(
    socket: std::path::PathBuf,
    inner: std::sync::Weak<HintsInner>,
    wake: Arc<tokio::sync::Notify>,
) {
    let mut client: Option<crate::Client> = None;
    loop {
        wake.notified().await;
        let Some(inner) = inner.upgrade() else { return };
        let taken = inner
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .replace(Default::default());
        let ids = match taken {
            Some(ids) if ids.is_empty() => continue,
            Some(ids) => Some(ids.into_iter().collect::<Vec<_>>()),
            None => None,
        };
        let plugin = inner.plugin.clone();
        drop(inner);
        if client.is_none() {
            client = crate::Client::connect(&socket).await.ok();
        }
        let Some(c) = &client else {
            tracing::debug!(socket = %socket.display(), "hint dropped: cannot connect to the agent");
            continue;
        };
        if let Err(e) = c.snapshotter_changed(&plugin, ids).await {
            // Polling finds the change anyway; a broken connection is made afresh.
            tracing::debug!(error = %e, "hint not taken by the agent");
            client = None;
        }
    }
}

/// Resolves at the first SIGTERM or SIGINT. The handlers are installed when this is
/// called, not when the future is first polled, so a signal that arrives while the
/// caller is still starting up is not lost (and does not kill the process outright).
/// Must be called within a tokio runtime.
pub fn termination() -> impl Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{signal, SignalKind};
    let handlers = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    );
    async move {
        let (Ok(mut term), Ok(mut int)) = handlers else {
            // Without handlers the process ends by the default action anyway.
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
}
