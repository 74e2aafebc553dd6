#![doc = include_str!("../README.md")]

mod server;
mod store;

use std::future::Future;
use std::io;
use std::path::Path;
use std::sync::Arc;

use jsonrpsee::types::ErrorObjectOwned;

/// The JSON-RPC library the SDK serves with, at the version it uses: for methods of a
/// snapshotter's own beside [`rpc_module`]'s (see [`serve_methods`]).
pub use jsonrpsee;
pub use jsonrpsee::types::ErrorObjectOwned as RpcError;
pub use jsonrpsee::RpcModule;
/// Binds a socket path as [`serve`] does (a stale socket replaced, a live one refused).
pub use server::bind;

pub use crate::store::{child, OperationStore, StoreError};

use opmon_client::types::{OperationProgress, OperationRef};
use opmon_client::{codes, methods};

/// What kind of failure a [`SnapshotterError`] is: the agent acts on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// This snapshotter should not be handling the item (code 2001): the operation fails.
    OperationsNotSupported,
    /// The operation ID is unknown, e.g. forgotten after a restart (code 2002): the
    /// operation fails.
    InvalidOperationId,
    /// A failure that may pass (a busy backend, a storage connection lost for a moment):
    /// the agent tries again with backoff, and fails the operation with this message
    /// only once the snapshotter's retry budget is spent (code 2003).
    Transient,
    /// Anything else: the operation fails with this message.
    Other,
}

/// Why a snapshotter could not answer for an operation: its [`ErrorKind`], a message,
/// and the error that caused it, if any ([`SnapshotterError::caused_by`]). The agent
/// gets the message followed by the causes' messages.
///
/// ```
/// use opmon_snapshotter::{ErrorKind, SnapshotterError};
/// let io = std::io::Error::other("connection reset");
/// let e = SnapshotterError::transient("reading the copy's state").caused_by(io);
/// assert_eq!(e.kind(), ErrorKind::Transient);
/// assert_eq!(e.to_string(), "reading the copy's state");
/// assert!(std::error::Error::source(&e).is_some());
/// ```
#[derive(Debug, thiserror::Error)]
#[error("{}", self.title())]
pub struct SnapshotterError {
    kind: ErrorKind,
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl SnapshotterError {
    fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        SnapshotterError {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// The item is not this snapshotter's (code 2001).
    pub fn operations_not_supported(message: impl Into<String>) -> Self {
        SnapshotterError::new(ErrorKind::OperationsNotSupported, message)
    }

    /// The operation ID is unknown (code 2002); `message` is usually the ID.
    ///
    /// ```
    /// use opmon_snapshotter::{ErrorKind, SnapshotterError};
    /// let e = SnapshotterError::invalid_operation_id("copy-42");
    /// assert_eq!(e.to_string(), "invalid operation ID: copy-42");
    /// ```
    pub fn invalid_operation_id(message: impl Into<String>) -> Self {
        SnapshotterError::new(ErrorKind::InvalidOperationId, message)
    }

    /// A failure that may pass: the agent asks again later (code 2003).
    pub fn transient(message: impl Into<String>) -> Self {
        SnapshotterError::new(ErrorKind::Transient, message)
    }

    /// Any other failure: the operation fails with the message.
    pub fn other(message: impl Into<String>) -> Self {
        SnapshotterError::new(ErrorKind::Other, message)
    }

    /// The same error, caused by `source` (kept as [`std::error::Error::source`], and
    /// its message sent to the agent after this one's).
    pub fn caused_by(
        mut self,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        self.source = Some(source.into());
        self
    }

    /// What kind of failure it is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message, without its causes.
    pub fn message(&self) -> &str {
        &self.message
    }

    fn title(&self) -> String {
        match self.kind {
            ErrorKind::OperationsNotSupported => {
                format!("operations not supported: {}", self.message)
            }
            ErrorKind::InvalidOperationId => format!("invalid operation ID: {}", self.message),
            ErrorKind::Transient | ErrorKind::Other => self.message.clone(),
        }
    }

    /// The message and its causes', as the agent gets it.
    fn chain(&self) -> String {
        opmon_client::error::chain(self)
    }
}

impl From<SnapshotterError> for ErrorObjectOwned {
    fn from(e: SnapshotterError) -> Self {
        let code = match e.kind {
            ErrorKind::OperationsNotSupported => codes::OPERATIONS_NOT_SUPPORTED,
            ErrorKind::InvalidOperationId => codes::INVALID_OPERATION_ID,
            ErrorKind::Transient => {
                return ErrorObjectOwned::owned(
                    codes::TRANSIENT,
                    e.chain(),
                    Some(serde_json::json!({ "retryable": true })),
                )
            }
            ErrorKind::Other => codes::INTERNAL_ERROR,
        };
        ErrorObjectOwned::owned(code, e.chain(), None::<()>)
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
    /// The progress of `op`, as Velero's `Progress` reports it.
    ///
    /// Set [`OperationProgress::updated`] whenever the count moves: the agent's rate
    /// and ETA (`Operation.rate`, `eta`, the owner's `progress`) are computed from the
    /// `nCompleted` changes between successive `updated` times, so a snapshotter that
    /// leaves `updated` empty has no rate. The stall deadline also counts from the
    /// last change.
    fn progress(
        &self,
        op: OperationRef,
    ) -> impl Future<Output = Result<OperationProgress, SnapshotterError>> + Send;

    /// Cancel `op`: best effort, as Velero's `Cancel`.
    fn cancel(&self, op: OperationRef)
        -> impl Future<Output = Result<(), SnapshotterError>> + Send;
}

/// The JSON-RPC methods of `snapshotter`, for embedding into a server of your own.
///
/// No errors: the methods are registered once, under their protocol names.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// # use opmon_snapshotter::*;
/// # use opmon_client::{OperationProgress, OperationRef};
/// # struct Copier;
/// # impl OperationHandler for Copier {
/// #     async fn progress(&self, _: OperationRef) -> Result<OperationProgress, SnapshotterError> { todo!() }
/// #     async fn cancel(&self, _: OperationRef) -> Result<(), SnapshotterError> { Ok(()) }
/// # }
/// let mut module = rpc_module(Copier);
/// module.register_method("copy.version", |_, _, _| "1.0")?;
/// serve_methods("/run/copier/copier.sock", module, termination()).await?;
/// # Ok(()) }
/// ```
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
///
/// # Errors
/// The socket could not be bound (its directory missing, another process serving it).
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// # use opmon_snapshotter::*;
/// # use opmon_client::{OperationProgress, OperationRef};
/// # struct Copier;
/// # impl OperationHandler for Copier {
/// #     async fn progress(&self, _: OperationRef) -> Result<OperationProgress, SnapshotterError> { todo!() }
/// #     async fn cancel(&self, _: OperationRef) -> Result<(), SnapshotterError> { Ok(()) }
/// # }
/// serve("/run/copier/copier.sock", Copier).await?;
/// # Ok(()) }
/// ```
pub async fn serve<S: OperationHandler>(
    socket: impl AsRef<Path>,
    snapshotter: S,
) -> io::Result<()> {
    serve_methods(socket, rpc_module(snapshotter), termination()).await
}

/// Why [`serve_and_register`] stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The socket could not be bound (a directory missing, another process on it).
    #[error("binding the snapshotter socket {}", socket.display())]
    Bind {
        socket: std::path::PathBuf,
        #[source]
        source: io::Error,
    },
    /// The agent did not take the registration.
    #[error("registering snapshotter {name} with the opmon agent")]
    Register {
        name: String,
        #[source]
        source: opmon_client::Error,
    },
}

/// Binds `socket`, registers it with the agent as the v2 snapshotter `registration`
/// (its `socket` set to `socket`), and serves `methods` ([`rpc_module`]'s, and any of
/// the snapshotter's own such as a `copy.start`) there until SIGTERM or SIGINT: the
/// agent polls it from the moment the registration is answered, and no caller needs to
/// wait for the socket file. The registration stays when it stops (the agent finds the
/// snapshotter again once it is back).
///
/// # Errors
/// [`ServeError::Bind`] if the socket could not be bound, [`ServeError::Register`] if
/// the agent did not take the registration (nothing is served then).
///
/// ```no_run
/// # use opmon_snapshotter::*;
/// # use opmon_client::{OperationProgress, OperationRef};
/// # struct Copier;
/// # impl OperationHandler for Copier {
/// #     async fn progress(&self, _: OperationRef) -> Result<OperationProgress, SnapshotterError> { todo!() }
/// #     async fn cancel(&self, _: OperationRef) -> Result<(), SnapshotterError> { Ok(()) }
/// # }
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let agent = opmon_client::Client::connect(opmon_client::default_socket_path()).await?;
/// let mut methods = rpc_module(Copier);
/// methods.register_async_method("copy.start", |_params, _copier, _| async move {
///     Ok::<_, RpcError>(serde_json::json!({"operationId": "copy-1"}))
/// })?;
/// let socket = "/run/copier/copier.sock";
/// let registration = opmon_client::Snapshotter::socket("example.io/copier", socket);
/// serve_and_register(&agent, registration, socket, methods).await?;
/// # Ok(()) }
/// ```
pub async fn serve_and_register(
    agent: &opmon_client::Client,
    registration: opmon_client::Snapshotter,
    socket: impl AsRef<Path>,
    methods: impl Into<jsonrpsee::Methods> + Send + 'static,
) -> Result<(), ServeError> {
    let socket = socket.as_ref();
    let listener = server::bind(socket, 0o660)
        .await
        .map_err(|source| ServeError::Bind {
            socket: socket.to_path_buf(),
            source,
        })?;
    let registration = opmon_client::Snapshotter {
        api_version: opmon_client::ApiVersion::V2,
        socket: Some(socket.to_path_buf()),
        command: None,
        ..registration
    };
    let name = registration.name.clone();
    // Served while the registration is sent: the agent may poll before it answers.
    let serving = tokio::spawn(serve_listener(listener, methods, termination()));
    if let Err(source) = agent.register_snapshotter(registration).await {
        serving.abort();
        return Err(ServeError::Register { name, source });
    }
    let _ = serving.await;
    Ok(())
}

/// Serves any set of methods on `socket` until `shutdown` resolves: for a snapshotter
/// that adds methods of its own (say, one that starts operations) to
/// [`rpc_module`]'s.
///
/// # Errors
/// The socket could not be bound.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// # use opmon_snapshotter::*;
/// # use opmon_client::{OperationProgress, OperationRef};
/// # struct Copier;
/// # impl OperationHandler for Copier {
/// #     async fn progress(&self, _: OperationRef) -> Result<OperationProgress, SnapshotterError> { todo!() }
/// #     async fn cancel(&self, _: OperationRef) -> Result<(), SnapshotterError> { Ok(()) }
/// # }
/// let mut module = rpc_module(Copier);
/// module.register_async_method("copy.start", |_params, _copier, _| async move {
///     Ok::<_, RpcError>(serde_json::json!({"operationId": "copy-1"}))
/// })?;
/// serve_methods("/run/copier/copier.sock", module, termination()).await?;
/// # Ok(()) }
/// ```
pub async fn serve_methods(
    socket: impl AsRef<Path>,
    methods: impl Into<jsonrpsee::Methods>,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let listener = server::bind(socket.as_ref(), 0o660).await?;
    serve_listener(listener, methods, shutdown).await;
    Ok(())
}

use crate::server::serve_listener;

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
/// use opmon_snapshotter::Hints;
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
                (Some(ids), Some(id))
                    if ids.len() < opmon_client::types::MAX_CHANGED_OPERATIONS =>
                {
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
    let mut client: Option<opmon_client::Client> = None;
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
            client = opmon_client::Client::connect(&socket).await.ok();
        }
        let Some(c) = &client else {
            tracing::debug!(socket = %socket.display(), "hint dropped: cannot connect to the agent");
            continue;
        };
        let mut call = c.snapshotter_changed(&plugin);
        if let Some(ids) = ids {
            call = call.operations(ids);
        }
        if let Err(e) = call.await {
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
///
/// No errors: without signal handlers it never resolves, and the default action ends the
/// process.
///
/// ```no_run
/// # async fn demo() {
/// let stop = opmon_snapshotter::termination();
/// // … start up …
/// stop.await;
/// # }
/// ```
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
