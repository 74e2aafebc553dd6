//! The typed async client: every API method as a Rust call, on the agent's Unix socket.
//!
//! Calls are HTTP/1.1 `POST /` on pooled keep-alive connections (hyper's), each driven
//! by the calling task; subscriptions are WebSocket connections of their own
//! ([`crate::subscription`]). The client is built to outlive agent restarts:
//!
//! - A call whose connection cannot be made (the agent is restarting) is tried again
//!   with backoff until the call timeout. A call that was sent and whose answer was lost
//!   is sent again only if its method is safe to repeat ([`crate::methods::Retry`]):
//!   reads, `start`, `addOperations`, `finalize`, `wait`, `snapshotter.register`.
//!   `endInProgress`, `delete` and `snapshotter.unregister` then fail with
//!   [`Error::Interrupted`].
//! - Every call has a deadline ([`ClientBuilder::call_timeout`], default 2 minutes;
//!   `finalize`, which may rewrite a tarball of many gigabytes, has
//!   [`ClientBuilder::finalize_timeout`], default 1 hour; `wait` adds its own timeout).
//! - [`ClientBuilder::connect`] makes one round trip within the connect timeout (default
//!   5 s), so an agent that is not running fails at once and one that does not answer
//!   (stopped, hung) fails with [`Error::Timeout`] instead of hanging.
//!
//! ```no_run
//! # async fn demo() -> Result<(), opmon_client::Error> {
//! use std::time::Duration;
//! use opmon_client::{Client, NewOperation, PluginKind, PluginRef, ResourceIdentifier};
//!
//! let client = Client::builder(opmon_client::default_socket_path())
//!     .call_timeout(Duration::from_secs(30))
//!     .connect()
//!     .await?;
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
//! let owner = backups.end_in_progress("nightly-1").errors(2).await?;
//! println!("{} is {}", owner.name, owner.phase);
//! # Ok(()) }
//! ```

use std::fmt;
use std::future::{Future, IntoFuture};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::connection::{Answer, Conn, Failure, Pool};
use crate::duration::GoDuration;
use crate::error::Error;
use crate::methods::{self, OwnerMethod, Retry};
use crate::subscription::Subscription;
use crate::types::*;

/// Longest single `wait` the client asks the agent for (the agent allows 10 minutes);
/// longer waits are split.
const WAIT_SLICE: Duration = Duration::from_secs(60);

/// Defaults of [`ClientBuilder`].
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const CALL_TIMEOUT: Duration = Duration::from_secs(120);
const FINALIZE_TIMEOUT: Duration = Duration::from_secs(3600);
const MAX_CONNECTIONS: usize = 32;
/// Largest answer read (a `list` of 1,000 owners or an `operations` of a big backup).
const MAX_RESPONSE: usize = 256 * 1024 * 1024;

/// Waits between reconnect attempts: 20 ms doubling to 1 s.
pub(crate) struct Backoff(Duration);

impl Backoff {
    pub fn new() -> Backoff {
        Backoff(Duration::from_millis(20))
    }

    /// Sleeps the next wait, or less if `deadline` comes first.
    pub async fn sleep(&mut self, deadline: Instant) {
        let wake = (Instant::now() + self.0).min(deadline);
        tokio::time::sleep_until(wake).await;
        self.0 = (self.0 * 2).min(Duration::from_secs(1));
    }
}

/// Settings of a [`Client`], from its builder.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub connect_timeout: Duration,
    pub call_timeout: Duration,
    pub finalize_timeout: Duration,
    pub max_connections: usize,
    pub max_response: usize,
    /// Uids besides root and this process's own that may serve the agent's socket.
    pub agent_uids: Vec<u32>,
}

/// Builds a [`Client`]: `Client::builder(socket).connect_timeout(..).call_timeout(..).connect()`.
#[derive(Clone, Debug)]
pub struct ClientBuilder {
    path: PathBuf,
    config: Config,
}

impl ClientBuilder {
    /// How long [`connect`](Self::connect), and each reconnect attempt of a
    /// subscription, may take (default 5 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.config.connect_timeout = timeout;
        self
    }

    /// How long a call may take, reconnects and repeats included (default 2 min). A
    /// subscription that lost its connection gives up after this long without the agent.
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.config.call_timeout = timeout;
        self
    }

    /// How long a `finalize` may take (default 1 h): it streams the backup tarball.
    pub fn finalize_timeout(mut self, timeout: Duration) -> Self {
        self.config.finalize_timeout = timeout;
        self
    }

    /// Connections a client opens at once for calls (default 32); more calls in
    /// parallel wait for one to be free (within their timeout).
    pub fn max_connections(mut self, n: usize) -> Self {
        self.config.max_connections = n.max(1);
        self
    }

    /// Trusts `uid` to serve the agent's socket, besides root and this process's own
    /// uid (the agent runs as another user, e.g. 65532 in the container). A socket served
    /// by any other uid is refused with a [`Error::Connect`] saying so.
    pub fn agent_uid(mut self, uid: u32) -> Self {
        self.config.agent_uids.push(uid);
        self
    }

    /// Connects and makes one round trip (`agent.status`; a JSON-RPC error answer, as
    /// a snapshotter gives, counts as an answer too). Fails at once if nothing listens
    /// on the socket, and with [`Error::Timeout`] if nothing answers within the connect
    /// timeout.
    pub async fn connect(self) -> Result<Client, Error> {
        let client = Client {
            inner: Arc::new(Inner {
                slots: Semaphore::new(self.config.max_connections),
                path: self.path,
                config: self.config,
                pool: Pool::default(),
                next_id: AtomicU64::new(1),
            }),
        };
        let timeout = client.inner.config.connect_timeout;
        let probe = async {
            let body = client
                .inner
                .request_body(methods::AGENT_STATUS, &NoParams {})?;
            match client.inner.exchange(&body).await {
                // Any JSON-RPC answer proves the peer serves; an HTTP refusal (a peer
                // the agent does not admit) is the error to report.
                Ok(answer) => match client
                    .inner
                    .decode::<serde_json::Value>(methods::AGENT_STATUS, answer)
                {
                    Ok(_) | Err(Error::Rpc { .. }) => Ok(()),
                    Err(e) => Err(e),
                },
                Err(Failure::NotSent(source)) => Err(Error::Connect {
                    path: client.inner.path.clone(),
                    source,
                }),
                Err(f) => Err(client.inner.failure_error(methods::AGENT_STATUS, f)),
            }
        };
        match tokio::time::timeout(timeout, probe).await {
            Ok(Ok(())) => Ok(client),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(Error::Timeout {
                path: client.inner.path.clone(),
                what: "connecting to the opmon agent".into(),
                after: timeout,
            }),
        }
    }
}

/// `{}`: the params of methods that take none.
#[derive(Serialize)]
struct NoParams {}

struct Inner {
    path: PathBuf,
    config: Config,
    pool: Pool,
    /// Bounds the connections open for calls.
    slots: Semaphore,
    next_id: AtomicU64,
}

/// A JSON-RPC request with params by name.
#[derive(Serialize)]
struct Request<'a, P> {
    jsonrpc: &'static str,
    id: u64,
    method: &'a str,
    params: &'a P,
}

/// A JSON-RPC answer, the result left unparsed until the error is ruled out.
#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(borrow, default)]
    result: Option<&'a RawValue>,
    #[serde(default)]
    error: Option<RpcErrorObject>,
}

#[derive(Deserialize)]
struct RpcErrorObject {
    code: i32,
    message: String,
}

impl Inner {
    pub(crate) fn request_body<P: Serialize>(
        &self,
        method: &str,
        params: &P,
    ) -> Result<Vec<u8>, Error> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        serde_json::to_vec(&Request {
            jsonrpc: "2.0",
            id,
            method,
            params,
        })
        .map_err(|source| Error::Params {
            method: method.into(),
            source,
        })
    }

    /// One request on a pooled or new connection.
    async fn exchange(&self, body: &[u8]) -> Result<Answer, Failure> {
        let _slot = self
            .slots
            .acquire()
            .await
            .map_err(|_| Failure::Protocol("the client was closed".into()))?;
        let conn = match self.pool.take() {
            Some(conn) => conn,
            None => Conn::open(&self.path, &self.config.agent_uids)
                .await
                .map_err(Failure::NotSent)?,
        };
        let (answer, reusable) = conn.post(body, self.config.max_response).await?;
        if let Some(conn) = reusable {
            self.pool.put(conn);
        }
        Ok(answer)
    }

    fn failure_error(&self, method: &str, failure: Failure) -> Error {
        let path = self.path.clone();
        match failure {
            Failure::NotSent(source) => Error::Connect { path, source },
            Failure::Lost(source) => Error::Io { path, source },
            Failure::Protocol(what) => Error::Protocol {
                path,
                what: format!("{what} to {method}"),
                source: None,
            },
        }
    }

    /// The typed result of an answer, or the error it carries.
    fn decode<R: DeserializeOwned>(&self, method: &str, answer: Answer) -> Result<R, Error> {
        let envelope: Result<Envelope<'_>, _> = serde_json::from_slice(&answer.body);
        match envelope {
            Ok(Envelope { error: Some(e), .. }) => Err(Error::Rpc {
                code: e.code,
                message: e.message,
            }),
            Ok(Envelope { result, .. }) if answer.status == 200 => {
                let raw = result.map_or("null", |r| r.get());
                serde_json::from_str(raw).map_err(|e| Error::Protocol {
                    path: self.path.clone(),
                    what: format!("a result of {method} that is not its type"),
                    source: Some(Box::new(e)),
                })
            }
            Ok(_) | Err(_) if answer.status != 200 => {
                let text = String::from_utf8_lossy(&answer.body);
                let mut body = crate::text::escape_controls(text.trim()).into_owned();
                if body.len() > 512 {
                    let cut = (0..=512)
                        .rev()
                        .find(|i| body.is_char_boundary(*i))
                        .unwrap_or(0);
                    body.truncate(cut);
                    body.push('…');
                }
                Err(Error::Http {
                    path: self.path.clone(),
                    status: answer.status,
                    body,
                })
            }
            Ok(_) => Err(Error::Protocol {
                path: self.path.clone(),
                what: format!("neither a result nor an error to {method}"),
                source: None,
            }),
            Err(e) => Err(Error::Protocol {
                path: self.path.clone(),
                what: format!("something that is not JSON-RPC to {method}"),
                source: Some(Box::new(e)),
            }),
        }
    }

    /// Sends `body` until it is answered, following `retry`, by `deadline`.
    async fn call_raw<R: DeserializeOwned>(
        &self,
        method: &str,
        body: &[u8],
        retry: Retry,
        timeout: Duration,
    ) -> Result<R, Error> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff::new();
        let timed_out = || Error::Timeout {
            path: self.path.clone(),
            what: format!("the call {method}"),
            after: timeout,
        };
        loop {
            let failure = match tokio::time::timeout_at(deadline, self.exchange(body)).await {
                Err(_) => return Err(timed_out()),
                Ok(Ok(answer)) if matches!(answer.status, 429 | 503) => {
                    // Too many connections: refused before reading the request.
                    Failure::NotSent(std::io::Error::other(format!(
                        "the agent answered HTTP {}",
                        answer.status
                    )))
                }
                Ok(Ok(answer)) => return self.decode(method, answer),
                Ok(Err(failure)) => failure,
            };
            let error = match failure {
                Failure::NotSent(e) if is_transient(&e) => {
                    self.failure_error(method, Failure::NotSent(e))
                }
                Failure::Lost(source) if retry == Retry::Always => Error::Io {
                    path: self.path.clone(),
                    source,
                },
                Failure::Lost(source) => {
                    return Err(Error::Interrupted {
                        method: method.into(),
                        source: Box::new(Error::Io {
                            path: self.path.clone(),
                            source,
                        }),
                    })
                }
                other => return Err(self.failure_error(method, other)),
            };
            if Instant::now() >= deadline {
                return Err(error);
            }
            backoff.sleep(deadline).await;
            if Instant::now() >= deadline {
                return Err(error);
            }
        }
    }
}

/// Whether a connect error may clear up by itself: the agent is restarting (its socket
/// is missing or refuses), or it sheds load.
fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        NotFound | ConnectionRefused | ConnectionReset | BrokenPipe | Other
    )
}

/// A connection to an opmon agent: cheap to clone (clones share the connections), safe
/// to use from many tasks at once.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("socket", &self.inner.path)
            .field("connect_timeout", &self.inner.config.connect_timeout)
            .field("call_timeout", &self.inner.config.call_timeout)
            .field("finalize_timeout", &self.inner.config.finalize_timeout)
            .field("max_connections", &self.inner.config.max_connections)
            .field("idle_connections", &self.inner.pool.len())
            .finish()
    }
}

impl Client {
    /// A builder for a client of the agent on the Unix socket `socket`.
    pub fn builder(socket: impl AsRef<Path>) -> ClientBuilder {
        ClientBuilder {
            path: socket.as_ref().to_path_buf(),
            config: Config {
                connect_timeout: CONNECT_TIMEOUT,
                call_timeout: CALL_TIMEOUT,
                finalize_timeout: FINALIZE_TIMEOUT,
                max_connections: MAX_CONNECTIONS,
                max_response: MAX_RESPONSE,
                agent_uids: Vec::new(),
            },
        }
    }

    /// Connects with the default timeouts: `Client::builder(socket).connect()`.
    pub async fn connect(socket: impl AsRef<Path>) -> Result<Self, Error> {
        Client::builder(socket).connect().await
    }

    /// The agent's socket.
    pub fn socket(&self) -> &Path {
        &self.inner.path
    }

    pub(crate) fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Calls any `method` with `params` sent by name, repeated after a lost connection
    /// as [`methods::retry_of`] says.
    pub async fn call<P, R>(&self, method: &str, params: P) -> Result<R, Error>
    where
        P: Serialize + Send,
        R: DeserializeOwned,
    {
        let timeout = self.inner.config.call_timeout;
        self.call_with(method, &params, methods::retry_of(method), timeout)
            .await
    }

    async fn call_with<P: Serialize, R: DeserializeOwned>(
        &self,
        method: &str,
        params: &P,
        retry: Retry,
        timeout: Duration,
    ) -> Result<R, Error> {
        let body = self.inner.request_body(method, params)?;
        self.inner.call_raw(method, &body, retry, timeout).await
    }

    /// `agent.status`.
    pub async fn status(&self) -> Result<AgentStatus, Error> {
        self.call(methods::AGENT_STATUS, NoParams {}).await
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

    /// `server.started`: the backup server `name` now runs as `instance`. The agent
    /// fails the InProgress owners that earlier instances of `name` started (with a
    /// failure reason) and answers which; calling it again fails nothing more. `""`
    /// names the owners started without a server.
    pub async fn server_started(
        &self,
        name: &str,
        instance: &str,
    ) -> Result<ServerStartedResult, Error> {
        self.call(
            methods::SERVER_STARTED,
            ServerStartedParams {
                name: name.into(),
                instance: instance.into(),
            },
        )
        .await
    }

    /// `snapshotter.register`: persisted, replaces an earlier registration of the name.
    pub async fn register_snapshotter(&self, s: &Snapshotter) -> Result<Snapshotter, Error> {
        self.call(methods::SNAPSHOTTER_REGISTER, s).await
    }

    /// `snapshotter.list`.
    pub async fn snapshotters(&self) -> Result<Vec<Snapshotter>, Error> {
        self.call(methods::SNAPSHOTTER_LIST, NoParams {}).await
    }

    /// `snapshotter.unregister`.
    pub async fn unregister_snapshotter(&self, name: &str) -> Result<Snapshotter, Error> {
        self.call(
            methods::SNAPSHOTTER_UNREGISTER,
            NameParams { name: name.into() },
        )
        .await
    }

    /// `snapshotter.changed`: tells the agent that `operations` of `plugin` (all of its
    /// operations if `None`) changed, so it polls them now. The SDK's
    /// [`crate::snapshotter::Hints`] sends these for a snapshotter.
    pub async fn snapshotter_changed(
        &self,
        plugin: &str,
        operations: Option<Vec<String>>,
    ) -> Result<(), Error> {
        self.call(
            methods::SNAPSHOTTER_CHANGED,
            SnapshotterChangedParams {
                plugin: plugin.into(),
                operations,
            },
        )
        .await
    }
}

/// The `backup.*` or `restore.*` methods; one implementation for both kinds.
#[derive(Clone, Copy, Debug)]
pub struct Owners<'a> {
    client: &'a Client,
    kind: OwnerKind,
}

impl<'a> Owners<'a> {
    async fn call<P: Serialize, R: DeserializeOwned>(
        &self,
        method: OwnerMethod,
        params: P,
    ) -> Result<R, Error> {
        let timeout = self.client.inner.config.call_timeout;
        self.client
            .call_with(method.name(self.kind), &params, method.retry(), timeout)
            .await
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
            ..Default::default()
        })
        .await
    }

    /// `start` with every parameter.
    pub async fn start_with(&self, params: StartParams) -> Result<Owner, Error> {
        self.call(OwnerMethod::Start, params).await
    }

    /// `addOperations`: idempotent on (plugin, operationId, item).
    pub async fn add_operations(
        &self,
        name: &str,
        operations: Vec<NewOperation>,
    ) -> Result<AddOperationsResult, Error> {
        self.call(
            OwnerMethod::AddOperations,
            AddOperationsParams {
                name: name.into(),
                operations,
            },
        )
        .await
    }

    /// `endInProgress`, as a builder: `.errors(n)`, `.warnings(n)`, `.failed()`, then
    /// `.await` for the owner in its new phase.
    pub fn end_in_progress(&self, name: &str) -> EndInProgress<'a> {
        EndInProgress {
            owners: Owners {
                client: self.client,
                kind: self.kind,
            },
            params: EndInProgressParams {
                name: name.into(),
                ..Default::default()
            },
        }
    }

    /// `endInProgress` with its params struct.
    pub async fn end_in_progress_with(&self, params: EndInProgressParams) -> Result<Owner, Error> {
        self.call(OwnerMethod::EndInProgress, params).await
    }

    /// `get`.
    pub async fn get(&self, name: &str) -> Result<Owner, Error> {
        self.call(OwnerMethod::Get, NameParams { name: name.into() })
            .await
    }

    /// `list`: one page.
    pub async fn list(&self, params: ListParams) -> Result<OwnerList, Error> {
        self.call(OwnerMethod::List, params).await
    }

    /// `events`: one page of the owner's history, oldest first (`next` continues it).
    pub async fn events(&self, params: EventsParams) -> Result<EventList, Error> {
        self.call(OwnerMethod::Events, params).await
    }

    /// `operations`: all of the owner's operations, or those in `phases`.
    pub async fn operations(
        &self,
        name: &str,
        phases: Option<Vec<OperationPhase>>,
    ) -> Result<Vec<Operation>, Error> {
        self.call(
            OwnerMethod::Operations,
            OperationsParams {
                name: name.into(),
                phases,
            },
        )
        .await
    }

    /// `wait`: until the owner reaches `until` or `timeout` passes. Long timeouts are
    /// split into several requests; the result is the same as one long wait. After a
    /// reconnect the slice in flight is asked again, so the wait may overrun `timeout`
    /// by up to a minute.
    pub async fn wait(
        &self,
        name: &str,
        until: WaitUntil,
        timeout: Duration,
    ) -> Result<WaitResult, Error> {
        let deadline = Instant::now() + timeout;
        let method = OwnerMethod::Wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let slice = left.min(WAIT_SLICE);
            let params = WaitParams {
                name: name.into(),
                until,
                timeout: Some(GoDuration(slice)),
            };
            let result: WaitResult = self
                .client
                .call_with(
                    method.name(self.kind),
                    &params,
                    method.retry(),
                    slice + self.client.inner.config.call_timeout,
                )
                .await?;
            if !result.timed_out || slice == left {
                return Ok(result);
            }
        }
    }

    /// `itemOperations`: the `-itemoperations.json.gz` records.
    pub async fn item_operations(&self, name: &str) -> Result<Vec<ItemOperation>, Error> {
        self.call(
            OwnerMethod::ItemOperations,
            NameParams { name: name.into() },
        )
        .await
    }

    /// `finalize`: for owners in a Finalizing phase; rewrites the tarball if `contents`
    /// is given, writes the item-operations file, and moves the owner to its terminal
    /// phase. Idempotent: a finalized owner returns the same result. Bounded by the
    /// finalize timeout, not the call timeout.
    pub async fn finalize(&self, params: FinalizeParams) -> Result<FinalizeResult, Error> {
        let method = OwnerMethod::Finalize;
        let timeout = self.client.inner.config.finalize_timeout;
        self.client
            .call_with(method.name(self.kind), &params, method.retry(), timeout)
            .await
    }

    /// `subscribe`: every change of the owner and its operations, until the update that
    /// shows a terminal phase. Fails at once if the owner does not exist. The stream
    /// lives through agent restarts: after a reconnect it resubscribes, and the first
    /// update then carries the full state with [`Update::resumed`] set. It ends with an
    /// error that says why when the owner is deleted ([`Error::SubscriptionEnded`]) or
    /// the agent does not come back within the call timeout ([`Error::AgentGone`]).
    pub async fn subscribe(&self, name: &str) -> Result<Subscription, Error> {
        Subscription::start(self.client.clone(), self.kind, name).await
    }

    /// `delete`: removes the owner, cancelling its unfinished operations.
    pub async fn delete(&self, name: &str) -> Result<DeleteResult, Error> {
        self.call(OwnerMethod::Delete, NameParams { name: name.into() })
            .await
    }

    /// `cancel`: the whole owner (`operations: None`; it ends Failed) or the chosen
    /// operations (they end Canceled). Not repeated after a lost answer: read back.
    pub async fn cancel(&self, params: CancelParams) -> Result<CancelResult, Error> {
        self.call(OwnerMethod::Cancel, params).await
    }
}

/// One update of a subscription: the agent's [`OwnerUpdate`] (reachable through `Deref`)
/// and whether it is the first after a reconnect.
#[derive(Clone, Debug, PartialEq)]
pub struct Update {
    pub update: OwnerUpdate,
    /// The first update after the client reconnected: like the very first one, it
    /// carries every operation (changes during the gap are in it, not before it).
    pub resumed: bool,
}

impl std::ops::Deref for Update {
    type Target = OwnerUpdate;

    fn deref(&self) -> &OwnerUpdate {
        &self.update
    }
}

/// An `endInProgress` call being built; `.await` sends it.
#[must_use = "an endInProgress call does nothing until awaited"]
pub struct EndInProgress<'a> {
    owners: Owners<'a>,
    params: EndInProgressParams,
}

impl<'a> EndInProgress<'a> {
    /// Errors the server counted while the owner was InProgress.
    pub fn errors(mut self, errors: u32) -> Self {
        self.params.errors = errors;
        self
    }

    /// Warnings the server counted.
    pub fn warnings(mut self, warnings: u32) -> Self {
        self.params.warnings = warnings;
        self
    }

    /// The backup or restore failed outright: Failed, unfinished operations cancelled.
    pub fn failed(mut self) -> Self {
        self.params.failed = true;
        self
    }
}

impl<'a> IntoFuture for EndInProgress<'a> {
    type Output = Result<Owner, Error>;
    type IntoFuture = Pin<Box<dyn Future<Output = Result<Owner, Error>> + Send + 'a>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move { self.owners.end_in_progress_with(self.params).await })
    }
}
