//! The typed async client: one WebSocket connection to the agent's Unix socket, every
//! API method as a Rust call.
//!
//! ```no_run
//! # async fn demo() -> Result<(), opmon_client::Error> {
//! use opmon_client::{Client, NewOperation, PluginKind, PluginRef, ResourceIdentifier};
//!
//! let client = Client::connect(opmon_client::default_socket_path()).await?;
//! let backups = client.backups();
//! backups.start("nightly-1", "3f5c…", None).await?;
//! backups
//!     .add_operations(
//!         "nightly-1",
//!         vec![NewOperation {
//!             plugin: PluginRef { kind: PluginKind::BackupItemAction, name: "example.io/copier".into() },
//!             resource: ResourceIdentifier {
//!                 group: String::new(),
//!                 resource: "persistentvolumeclaims".into(),
//!                 namespace: "app".into(),
//!                 name: "data".into(),
//!             },
//!             operation_id: "copy-42".into(),
//!             post_operation_items: vec![],
//!             created: None,
//!         }],
//!     )
//!     .await?;
//! let owner = backups.end_in_progress("nightly-1", 0, 0, false).await?;
//! println!("{} is {}", owner.name, owner.phase);
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::Stream;
use jsonrpsee::client_transport::ws::{Url, WsTransportClientBuilder};
use jsonrpsee::core::client::{ClientBuilder, ClientT, SubscriptionClientT};
use jsonrpsee::core::traits::ToRpcParams;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::value::RawValue;
use tokio::net::UnixStream;

use crate::duration::GoDuration;
use crate::types::*;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot connect to the opmon agent at {path}: {source}")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("opmon agent at {path} refused the WebSocket handshake: {message}")]
    Handshake { path: PathBuf, message: String },
    /// The agent answered with a JSON-RPC error; `code` is one of [`crate::codes`].
    #[error("{message} (code {code})")]
    Rpc { code: i32, message: String },
    #[error("{0}")]
    Transport(String),
}

impl Error {
    /// The JSON-RPC error code, if the agent answered with an error.
    pub fn code(&self) -> Option<i32> {
        match self {
            Error::Rpc { code, .. } => Some(*code),
            _ => None,
        }
    }
}

impl From<jsonrpsee::core::client::Error> for Error {
    fn from(e: jsonrpsee::core::client::Error) -> Self {
        match e {
            jsonrpsee::core::client::Error::Call(obj) => Error::Rpc {
                code: obj.code(),
                message: obj.message().to_string(),
            },
            other => Error::Transport(other.to_string()),
        }
    }
}

/// Sends a params struct as a JSON object (params by name).
struct Named<T>(T);

impl<T: Serialize> ToRpcParams for Named<T> {
    fn to_rpc_params(self) -> Result<Option<Box<RawValue>>, serde_json::Error> {
        serde_json::value::to_raw_value(&self.0).map(Some)
    }
}

/// Longest single `wait` the client asks the agent for; longer waits are split so a
/// request never outlives the client's request timeout.
const WAIT_SLICE: Duration = Duration::from_secs(60);

/// A connection to an opmon agent.
pub struct Client {
    rpc: jsonrpsee::core::client::Client,
}

impl Client {
    /// Connects to the agent listening on the Unix socket `socket`.
    pub async fn connect(socket: impl AsRef<Path>) -> Result<Self, Error> {
        let path = socket.as_ref().to_path_buf();
        let stream = UnixStream::connect(&path)
            .await
            .map_err(|source| Error::Connect {
                path: path.clone(),
                source,
            })?;
        let url: Url = "ws://localhost/"
            .parse()
            .map_err(|e| Error::Transport(format!("{e}")))?;
        let (sender, receiver) = WsTransportClientBuilder::default()
            .max_request_size(64 * 1024 * 1024)
            .max_response_size(256 * 1024 * 1024)
            .build_with_stream(url, stream)
            .await
            .map_err(|e| Error::Handshake {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let rpc = ClientBuilder::default()
            // Pings keep a quiet connection (a long subscription) from counting as idle.
            .enable_ws_ping(
                jsonrpsee::core::client::async_client::PingConfig::new()
                    .ping_interval(Duration::from_secs(30)),
            )
            .request_timeout(WAIT_SLICE + Duration::from_secs(60))
            .max_buffer_capacity_per_subscription(1024)
            .build_with_tokio(sender, receiver);
        Ok(Client { rpc })
    }

    /// Calls `method` with `params` sent by name.
    pub async fn call<P, R>(&self, method: &str, params: P) -> Result<R, Error>
    where
        P: Serialize + Send,
        R: DeserializeOwned,
    {
        Ok(self.rpc.request(method, Named(params)).await?)
    }

    /// `agent.status`.
    pub async fn status(&self) -> Result<AgentStatus, Error> {
        Ok(self
            .rpc
            .request("agent.status", jsonrpsee::rpc_params![])
            .await?)
    }

    /// The backup methods (`backup.*`).
    pub fn backups(&self) -> Owners<'_> {
        self.owners(OwnerKind::Backup)
    }

    /// The restore methods (`restore.*`).
    pub fn restores(&self) -> Owners<'_> {
        self.owners(OwnerKind::Restore)
    }

    /// The methods of owners of `kind`.
    pub fn owners(&self, kind: OwnerKind) -> Owners<'_> {
        Owners { client: self, kind }
    }

    /// `snapshotter.register`: persisted, replaces an earlier registration of the name.
    pub async fn register_snapshotter(&self, s: &Snapshotter) -> Result<Snapshotter, Error> {
        self.call("snapshotter.register", s).await
    }

    /// `snapshotter.list`.
    pub async fn snapshotters(&self) -> Result<Vec<Snapshotter>, Error> {
        Ok(self
            .rpc
            .request("snapshotter.list", jsonrpsee::rpc_params![])
            .await?)
    }

    /// `snapshotter.unregister`.
    pub async fn unregister_snapshotter(&self, name: &str) -> Result<Snapshotter, Error> {
        self.call("snapshotter.unregister", NameParams { name: name.into() })
            .await
    }
}

/// The `backup.*` or `restore.*` methods; one implementation for both kinds.
pub struct Owners<'a> {
    client: &'a Client,
    kind: OwnerKind,
}

impl Owners<'_> {
    fn method(&self, verb: &str) -> String {
        format!("{}.{verb}", self.kind)
    }

    async fn call<P: Serialize + Send, R: DeserializeOwned>(
        &self,
        verb: &str,
        params: P,
    ) -> Result<R, Error> {
        self.client.call(&self.method(verb), params).await
    }

    /// `start`: creates the owner in InProgress; the same name and uid again returns it.
    pub async fn start(
        &self,
        name: &str,
        uid: &str,
        item_operation_timeout: Option<Duration>,
    ) -> Result<Owner, Error> {
        self.start_with(StartParams {
            name: name.into(),
            uid: uid.into(),
            item_operation_timeout: item_operation_timeout.map(GoDuration),
            ..StartParams::default()
        })
        .await
    }

    /// `start` with every parameter.
    pub async fn start_with(&self, params: StartParams) -> Result<Owner, Error> {
        self.call("start", params).await
    }

    /// `addOperations`: idempotent on (plugin, operationId, item).
    pub async fn add_operations(
        &self,
        name: &str,
        operations: Vec<NewOperation>,
    ) -> Result<AddOperationsResult, Error> {
        self.call(
            "addOperations",
            AddOperationsParams {
                name: name.into(),
                operations,
            },
        )
        .await
    }

    /// `endInProgress`: returns the owner in its new phase.
    pub async fn end_in_progress(
        &self,
        name: &str,
        errors: u32,
        warnings: u32,
        failed: bool,
    ) -> Result<Owner, Error> {
        self.call(
            "endInProgress",
            EndInProgressParams {
                name: name.into(),
                errors,
                warnings,
                failed,
            },
        )
        .await
    }

    /// `get`.
    pub async fn get(&self, name: &str) -> Result<Owner, Error> {
        self.call("get", NameParams { name: name.into() }).await
    }

    /// `list`: one page.
    pub async fn list(&self, params: ListParams) -> Result<OwnerList, Error> {
        self.call("list", params).await
    }

    /// `operations`: all of the owner's operations, or those in `phases`.
    pub async fn operations(
        &self,
        name: &str,
        phases: Option<Vec<OperationPhase>>,
    ) -> Result<Vec<Operation>, Error> {
        self.call(
            "operations",
            OperationsParams {
                name: name.into(),
                phases,
            },
        )
        .await
    }

    /// `wait`: until the owner reaches `until` or `timeout` passes. Long timeouts are
    /// split into several requests; the result is the same as one long wait.
    pub async fn wait(
        &self,
        name: &str,
        until: WaitUntil,
        timeout: Duration,
    ) -> Result<WaitResult, Error> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let slice = left.min(WAIT_SLICE);
            let result: WaitResult = self
                .call(
                    "wait",
                    WaitParams {
                        name: name.into(),
                        until,
                        timeout: Some(GoDuration(slice)),
                    },
                )
                .await?;
            if !result.timed_out || slice == left {
                return Ok(result);
            }
        }
    }

    /// `itemOperations`: the `-itemoperations.json.gz` records.
    pub async fn item_operations(&self, name: &str) -> Result<Vec<ItemOperation>, Error> {
        self.call("itemOperations", NameParams { name: name.into() })
            .await
    }

    /// `finalize`: for owners in a Finalizing phase; rewrites the tarball if `contents`
    /// is given, writes the item-operations file, and moves the owner to its terminal
    /// phase. Idempotent: a finalized owner returns the same result.
    pub async fn finalize(&self, params: FinalizeParams) -> Result<FinalizeResult, Error> {
        self.call("finalize", params).await
    }

    /// `subscribe`: every change of the owner and its operations, as a stream that ends
    /// after the update showing a terminal phase (or when the owner is deleted). The
    /// first update holds all operations, later ones only those that changed.
    pub async fn subscribe(
        &self,
        name: &str,
    ) -> Result<impl Stream<Item = Result<OwnerUpdate, Error>> + Unpin + 'static, Error> {
        let subscription = self
            .client
            .rpc
            .subscribe::<OwnerUpdate, _>(
                &self.method("subscribe"),
                Named(NameParams { name: name.into() }),
                &self.method("unsubscribe"),
            )
            .await?;
        Ok(Box::pin(futures::stream::unfold(
            (subscription, false),
            |(mut subscription, done)| async move {
                if done {
                    return None;
                }
                match subscription.next().await? {
                    Ok(update) => {
                        let terminal = update.owner.phase.is_terminal();
                        Some((Ok(update), (subscription, terminal)))
                    }
                    Err(e) => Some((
                        Err(Error::Transport(format!("reading an update: {e}"))),
                        (subscription, true),
                    )),
                }
            },
        )))
    }

    /// `delete`: removes the owner, cancelling its unfinished operations.
    pub async fn delete(&self, name: &str) -> Result<DeleteResult, Error> {
        self.call("delete", NameParams { name: name.into() }).await
    }
}
