//! The typed async client: every API method as a Rust call, on the agent's Unix socket.
//!
//! Calls are HTTP/1.1 `POST /` on pooled keep-alive connections (hyper's), each driven
//! by the calling task; subscriptions are WebSocket connections of their own
//! ([`Subscription`]). The client is built to outlive agent restarts:
//!
//! - A call whose connection cannot be made (the agent is restarting) is tried again
//!   with backoff until the call timeout. A call that was sent and whose answer was lost
//!   is sent again only if its method is safe to repeat (its declaration's
//!   [`crate::methods::Retry`]); `endInProgress`, `delete`, `cancel` and
//!   `snapshotter.unregister` then fail with [`Error::Interrupted`].
//! - Every call has a deadline ([`ClientBuilder::call_timeout`], default 2 minutes;
//!   `finalize`, which may rewrite a tarball of many gigabytes, has
//!   [`ClientBuilder::finalize_timeout`], default 1 hour; `wait` adds its own timeout).
//! - [`ClientBuilder::connect`] makes one round trip within the connect timeout (default
//!   5 s), so an agent that is not running fails at once and one that does not answer
//!   (stopped, hung) fails with [`Error::Timeout`] instead of hanging.
//!
//! Every method returns a [`Call`]: required arguments in the call, optional ones as
//! its builder methods, sent when awaited.

use std::fmt;
use std::future::Future;
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
use crate::methods::{self, Method, Retry};
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
    /// Who serves the socket, as errors name it.
    pub peer: String,
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

    /// Who serves the socket, as errors name it (default "the opmon agent"): for a
    /// client of a snapshotter's own methods, say which.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), opmon_client::Error> {
    /// let copier = opmon_client::Client::builder("/run/copier/copier.sock")
    ///     .peer("snapshotter example.io/copier")
    ///     .connect()
    ///     .await?; // "cannot connect to snapshotter example.io/copier at /run/copier/copier.sock"
    /// # Ok(()) }
    /// ```
    pub fn peer(mut self, peer: impl Into<String>) -> Self {
        self.config.peer = peer.into();
        self
    }

    /// Trusts `uid` to serve the agent's socket, besides root and this process's own
    /// uid (the agent runs as another user, e.g. 65532 in the container). A socket served
    /// by any other uid is refused with a [`Error::Connect`] saying so.
    ///
    /// No errors of its own; [`ClientBuilder::connect`] refuses a socket of another uid.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = opmon_client::Client::builder("/run/opmon/agent.sock")
    ///     .agent_uid(65532)
    ///     .connect()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn agent_uid(mut self, uid: u32) -> Self {
        self.config.agent_uids.push(uid);
        self
    }

    /// Connects and makes one round trip (`agent.status`; a JSON-RPC error answer, as
    /// a snapshotter gives, counts as an answer too). Fails at once if nothing listens
    /// on the socket, and with [`Error::Timeout`] if nothing answers within the connect
    /// timeout.
    ///
    /// # Errors
    /// [`Error::Connect`] if nothing listens (or the socket's owner is not trusted, see
    /// [`ClientBuilder::agent_uid`]), [`Error::Timeout`] if nothing answers in time,
    /// [`Error::Http`] if the agent refuses this client.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = opmon_client::Client::builder(opmon_client::default_socket_path())
    ///     .connect()
    ///     .await?;
    /// # Ok(()) }
    /// ```
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
                    peer: client.inner.config.peer.clone(),
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
                what: format!("connecting to {}", client.inner.config.peer),
                after: timeout,
            }),
        }
    }
}

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
pub(crate) struct RpcErrorObject {
    code: i32,
    message: String,
    #[serde(default)]
    data: Option<serde_json::Value>,
}

impl From<RpcErrorObject> for Error {
    fn from(e: RpcErrorObject) -> Error {
        Error::Rpc {
            code: crate::codes::Code::of(e.code),
            message: e.message,
            data: e.data,
        }
    }
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
            Failure::NotSent(source) => Error::Connect {
                path,
                peer: self.config.peer.clone(),
                source,
            },
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
            Ok(Envelope { error: Some(e), .. }) => Err(e.into()),
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
            // The agent went away after this client reached it and did not come back:
            // say for how long it was waited for, not only the last refusal.
            let gone = |error| Error::AgentGone {
                path: self.path.clone(),
                after: timeout,
                source: Box::new(error),
            };
            if Instant::now() >= deadline {
                return Err(gone(error));
            }
            backoff.sleep(deadline).await;
            if Instant::now() >= deadline {
                return Err(gone(error));
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
    /// A builder for a client of the agent on the Unix socket `socket`; nothing is
    /// connected until [`ClientBuilder::connect`].
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), opmon_client::Error> {
    /// use std::time::Duration;
    /// let client = opmon_client::Client::builder(opmon_client::default_socket_path())
    ///     .call_timeout(Duration::from_secs(30))
    ///     .connect()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn builder(socket: impl AsRef<Path>) -> ClientBuilder {
        ClientBuilder {
            path: socket.as_ref().to_path_buf(),
            config: Config {
                connect_timeout: CONNECT_TIMEOUT,
                call_timeout: CALL_TIMEOUT,
                finalize_timeout: FINALIZE_TIMEOUT,
                max_connections: MAX_CONNECTIONS,
                max_response: MAX_RESPONSE,
                peer: "the opmon agent".into(),
                agent_uids: Vec::new(),
            },
        }
    }

    /// Connects with the default timeouts: `Client::builder(socket).connect()`.
    ///
    /// # Errors
    /// [`Error::Connect`] if nothing listens on `socket` (or it is not an opmon agent's
    /// and refuses), [`Error::Timeout`] if nothing answers within 5 s.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), opmon_client::Error> {
    /// let client = opmon_client::Client::connect(opmon_client::default_socket_path()).await?;
    /// # Ok(()) }
    /// ```
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

    /// Calls any `method` by name with `params` sent by name, repeated after a lost
    /// connection as [`methods::retry_of`] says: for methods of a newer agent or a
    /// snapshotter's own (the typed methods of this crate are the usual way).
    ///
    /// # Errors
    /// The agent's error answer ([`Error::Rpc`]); transport failures as for every call
    /// (see [`Error`]); [`Error::Protocol`] if the result is not an `R`.
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// let status: serde_json::Value = client.call("agent.status", serde_json::json!({})).await?;
    /// # Ok(()) }
    /// ```
    pub async fn call<P, R>(&self, method: &str, params: P) -> Result<R, Error>
    where
        P: Serialize + Send,
        R: DeserializeOwned,
    {
        let timeout = self.inner.config.call_timeout;
        self.call_with(method, &params, methods::retry_of(method), timeout)
            .await
    }

    /// A call of the declared agent-wide method `M` with `params` as they are: the
    /// typed methods below build these; this is for params built or kept elsewhere.
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// use opmon_client::{methods, NoParams};
    /// let status = client.request::<methods::Status>(NoParams {}).await?;
    /// # Ok(()) }
    /// ```
    pub fn request<M: Method>(&self, params: M::Params) -> Call<M> {
        Call::new(self.clone(), OwnerKind::Backup, params)
    }

    /// Calls the declared method `M` (named for `kind` if it is an owner method), with
    /// its retry rule and `timeout`.
    async fn send<M: Method>(
        &self,
        kind: OwnerKind,
        params: &M::Params,
        timeout: Duration,
    ) -> Result<M::Result, Error> {
        let decl = &M::DECL;
        self.call_with(decl.name(kind), params, decl.retry, timeout)
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

    /// The backup methods (`backup.*`): an owned handle, cheap to clone.
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// let backups = client.backups();
    /// tokio::spawn(async move { backups.get("nightly-1").await });
    /// # Ok(()) }
    /// ```
    pub fn backups(&self) -> Owners {
        self.owners(OwnerKind::Backup)
    }

    /// The restore methods (`restore.*`): an owned handle, cheap to clone.
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// let restore = client.restores().get("restore-1").await?;
    /// # Ok(()) }
    /// ```
    pub fn restores(&self) -> Owners {
        self.owners(OwnerKind::Restore)
    }

    /// The methods of owners of `kind`.
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// let page = client.owners(opmon_client::OwnerKind::Backup).list().await?;
    /// # Ok(()) }
    /// ```
    pub fn owners(&self, kind: OwnerKind) -> Owners {
        Owners {
            client: self.clone(),
            kind,
        }
    }
}

/// One call of the declared method `M`: a future, sent when first polled. Required
/// arguments were given when it was made, optional ones are set with its builder
/// methods before it is awaited (for example [`Call::errors`] of `endInProgress`).
///
/// A call that cannot connect (the agent is restarting) is tried again with backoff
/// until the call timeout; one whose answer was lost is sent again only if `M` is safe
/// to repeat ([`methods::Retry`]), and otherwise fails with [`Error::Interrupted`].
#[must_use = "a call does nothing until awaited"]
pub struct Call<M: Method> {
    client: Client,
    kind: OwnerKind,
    timeout: Duration,
    state: CallState<M>,
}

/// Before the first poll the params can still change; after it, the request runs.
enum CallState<M: Method> {
    Ready(M::Params),
    Running(Pin<Box<dyn Future<Output = Result<M::Result, Error>> + Send>>),
    Done,
}

impl<M: Method> Call<M> {
    fn new(client: Client, kind: OwnerKind, params: M::Params) -> Call<M> {
        // finalize may rewrite a tarball of many gigabytes: it has its own timeout.
        let timeout = if M::DECL.verb == methods::Finalize::DECL.verb {
            client.inner.config.finalize_timeout
        } else {
            client.inner.config.call_timeout
        };
        Call {
            client,
            kind,
            timeout,
            state: CallState::Ready(params),
        }
    }

    /// The params the call sends (`None` once it was polled).
    ///
    /// ```no_run
    /// # fn demo(client: opmon_client::Client) {
    /// let call = client.backups().get("nightly-1");
    /// assert_eq!(call.params().map(|p| p.name.as_str()), Some("nightly-1"));
    /// # }
    /// ```
    pub fn params(&self) -> Option<&M::Params> {
        match &self.state {
            CallState::Ready(params) => Some(params),
            _ => None,
        }
    }

    /// Sets an optional argument: the builder methods' common part.
    fn with(mut self, set: impl FnOnce(&mut M::Params)) -> Self {
        if let CallState::Ready(params) = &mut self.state {
            set(params);
        }
        self
    }
}

impl<M: Method> fmt::Debug for Call<M>
where
    M::Params: fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Call")
            .field("method", &M::DECL.name(self.kind))
            .field("params", &self.params())
            .finish()
    }
}

impl<M: Method> Future for Call<M> {
    type Output = Result<M::Result, Error>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = &mut *self;
        this.state = match std::mem::replace(&mut this.state, CallState::Done) {
            CallState::Ready(params) => {
                let (client, kind, timeout) = (this.client.clone(), this.kind, this.timeout);
                CallState::Running(Box::pin(async move {
                    client.send::<M>(kind, &params, timeout).await
                }))
            }
            other => other,
        };
        let CallState::Running(running) = &mut this.state else {
            panic!("a Call polled after it completed");
        };
        let output = std::task::ready!(running.as_mut().poll(cx));
        this.state = CallState::Done;
        std::task::Poll::Ready(output)
    }
}

/// The `backup.*` or `restore.*` methods; one implementation for both kinds. An owned
/// handle: cheap to clone, and it can move into a spawned task.
#[derive(Clone, Debug)]
pub struct Owners {
    client: Client,
    kind: OwnerKind,
}

impl Owners {
    /// The kind of owners these methods are of.
    pub fn kind(&self) -> OwnerKind {
        self.kind
    }

    /// A call of the declared owner method `M` with `params` as they are: the typed
    /// methods below build these; this is for params built or kept elsewhere.
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// use opmon_client::{methods, OwnerParams};
    /// let owner = client
    ///     .backups()
    ///     .request::<methods::Get>(OwnerParams::current("nightly-1"))
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn request<M: Method>(&self, params: M::Params) -> Call<M> {
        Call::new(self.client.clone(), self.kind, params)
    }

    /// `wait`: until the owner reaches `until` or `timeout` passes. Long timeouts are
    /// split into several requests with the same result as one long wait; after a
    /// reconnect the slice in flight is asked again, so the wait may overrun `timeout`
    /// by up to a minute.
    ///
    /// # Errors
    /// [`Error::is_not_found`] (also if the owner is deleted meanwhile).
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// use std::time::Duration;
    /// use opmon_client::WaitUntil;
    /// let waited = client
    ///     .backups()
    ///     .wait("nightly-1", WaitUntil::ReadyToFinalize, Duration::from_secs(4 * 3600))
    ///     .await?;
    /// if waited.timed_out {
    ///     eprintln!("still {}", waited.owner.phase);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn wait(
        &self,
        name: &str,
        until: WaitUntil,
        timeout: Duration,
    ) -> Result<WaitResult, Error> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let slice = left.min(WAIT_SLICE);
            let params = WaitParams {
                name: name.into(),
                until,
                timeout: Some(GoDuration(slice)),
            };
            let call_timeout = slice + self.client.inner.config.call_timeout;
            let result = self
                .client
                .send::<methods::Wait>(self.kind, &params, call_timeout)
                .await?;
            if !result.timed_out || slice == left {
                return Ok(result);
            }
        }
    }

    /// `subscribe`: every change of the owner and its operations, until the update that
    /// shows a terminal phase. Fails at once if the owner does not exist. The stream
    /// lives through agent restarts: after a reconnect it resubscribes, and the first
    /// update then carries the full state with [`Update::resumed`] set. It ends with an
    /// error that says why when the owner is deleted ([`Error::SubscriptionEnded`]) or
    /// the agent does not come back within the call timeout ([`Error::AgentGone`]).
    ///
    /// A backup stops at Finalizing, which is not terminal: stop reading there and
    /// call [`finalize`](Self::finalize).
    ///
    /// # Errors
    /// [`Error::is_not_found`] at once; the stream's items as above.
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// let mut updates = client.backups().subscribe("nightly-1").await?;
    /// while let Some(update) = updates.next().await {
    ///     let update = update?;
    ///     if update.owner.phase.is_finalizing() || update.owner.phase.is_terminal() {
    ///         break;
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn subscribe(&self, name: &str) -> Result<Subscription, Error> {
        Subscription::start(self.client.clone(), self.kind, name).await
    }
}

/// The typed calls, declared once: each becomes a method of the handle that builds its
/// params from the required arguments (the rest default; see [`setters!`]).
macro_rules! calls {
    ($on:ty { $($(#[doc = $doc:literal])* $name:ident($($arg:ident: $ty:ty),*) -> $method:ident = $params:expr;)+ }) => {
        impl $on {
            $($(#[doc = $doc])* pub fn $name(&self, $($arg: $ty),*) -> Call<methods::$method> {
                self.request($params)
            })+
        }
    };
}

calls!(Owners {
    /// `start`: creates the owner `name` (the backup server's object's `uid`) in
    /// InProgress; the same name and uid again returns it. Options:
    /// [`Call::item_operation_timeout`], [`Call::stall_timeout`], [`Call::start_timeout`],
    /// [`Call::finalize`] (restores), [`Call::object`], [`Call::server`].
    ///
    /// # Errors
    /// [`Error::is_already_exists`] if an owner of that name has another uid;
    /// [`Error::is_invalid_params`] naming the field (a name that is not a DNS
    /// subdomain, `finalize` for a backup, an object over 64 KiB).
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// use std::time::Duration;
    /// let owner = client
    ///     .backups()
    ///     .start("nightly-1", "3f5c9a")
    ///     .item_operation_timeout(Duration::from_secs(3600))
    ///     .server("velero/velero", "velero-5d8f-abcde")
    ///     .await?;
    /// # Ok(()) }
    /// ```
    start(name: &str, uid: &str) -> Start = StartParams {
        name: name.into(),
        uid: uid.into(),
        ..Default::default()
    };
    /// `addOperations`: the operations the plugins returned for the owner `name`, while
    /// it is InProgress. Idempotent on (plugin, operationId, item): repeats count as
    /// `alreadyKnown`.
    ///
    /// # Errors
    /// [`Error::is_not_found`]; [`Error::is_wrong_phase`] once the owner left InProgress;
    /// [`Error::is_invalid_params`] naming the operation and field.
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// use opmon_client::{NewOperation, PluginKind, ResourceIdentifier};
    /// let pvc = ResourceIdentifier::namespaced("persistentvolumeclaims", "app", "data");
    /// let op = NewOperation::new(PluginKind::BackupItemAction, "example.io/copier", pvc, "copy-42");
    /// let counts = client.backups().add_operations("nightly-1", vec![op]).await?;
    /// # Ok(()) }
    /// ```
    add_operations(name: &str, operations: Vec<NewOperation>) -> AddOperations =
        AddOperationsParams { name: name.into(), operations };
    /// `endInProgress`: ends the owner's InProgress phase with the backup server's
    /// verdict ([`Call::errors`], [`Call::warnings`], [`Call::failed`]) and answers the
    /// owner in its new phase. Not repeated after a lost answer ([`Error::Interrupted`]):
    /// read the owner back.
    ///
    /// # Errors
    /// [`Error::is_not_found`]; [`Error::is_wrong_phase`] if it is no longer InProgress.
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// let owner = client.backups().end_in_progress("nightly-1").errors(2).await?;
    /// println!("{} is {}", owner.name, owner.phase);
    /// # Ok(()) }
    /// ```
    end_in_progress(name: &str) -> EndInProgress = EndInProgressParams {
        name: name.into(),
        ..Default::default()
    };
    /// `get`: the owner `name` (its current one; [`Call::uid`] for the one of a uid,
    /// current or retired). [`Error::is_not_found`] if there is none.
    get(name: &str) -> Get = OwnerParams::current(name);
    /// `history`: every owner that had the name `name`, the current one first, then
    /// the retired ones (`start` gave their name to a new uid), latest retired first.
    /// An unknown name answers an empty list.
    history(name: &str) -> History = NameParams { name: name.into() };
    /// `list`: one page of owners in name order (options: [`Call::phases`],
    /// [`Call::limit`], default 100 and at most 1,000, [`Call::after`] a name).
    ///
    /// # Errors
    /// [`Error::is_invalid_params`] for a limit of 0 or over 1,000.
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// use opmon_client::OwnerPhase;
    /// let mut after = None;
    /// loop {
    ///     let mut call = client.backups().list().phases(vec![OwnerPhase::Finalizing]);
    ///     if let Some(name) = after.take() {
    ///         call = call.after(name);
    ///     }
    ///     let page = call.await?;
    ///     for owner in &page.items {
    ///         println!("{}", owner.name);
    ///     }
    ///     match page.next {
    ///         Some(next) => after = Some(next),
    ///         None => break,
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    list() -> List = ListParams::default();
    /// `events`: one page of the owner's history, oldest first (options:
    /// [`Call::after_seq`], the previous page's `next`, and [`Call::limit`]).
    ///
    /// # Errors
    /// [`Error::is_not_found`]; [`Error::is_invalid_params`] for a limit of 0 or over 1,000.
    events(name: &str) -> Events = EventsParams {
        name: name.into(),
        ..Default::default()
    };
    /// `operations`: all of the owner's operations, or those in [`Call::phases`].
    /// [`Error::is_not_found`] if there is no such owner.
    operations(name: &str) -> Operations = OperationsParams {
        name: name.into(),
        uid: None,
        phases: None,
    };
    /// `itemOperations`: the owner's `-itemoperations.json.gz` records, as Velero
    /// writes them. [`Error::is_not_found`] if there is no such owner.
    item_operations(name: &str) -> ItemOperations = OwnerParams::current(name);
    /// `finalize`: for an owner in a Finalizing phase, writes the item-operations file,
    /// rewrites the backup tarball if [`Call::contents`] is given (with
    /// [`Call::updated_items`]), and moves the owner to its terminal phase. Idempotent:
    /// a finalized owner answers with the first result. Bounded by the finalize timeout
    /// (default 1 h), not the call timeout.
    ///
    /// # Errors
    /// [`Error::is_not_found`]; [`Error::is_wrong_phase`] before Finalizing;
    /// [`Error::is_finalize_failed`] if the files could not be written.
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// let done = client
    ///     .backups()
    ///     .finalize("nightly-1")
    ///     .contents("/var/backups/nightly-1.tar.gz", "/var/backups/nightly-1.final.tar.gz")
    ///     .await?;
    /// println!("{} is {}", done.owner.name, done.owner.phase);
    /// # Ok(()) }
    /// ```
    finalize(name: &str) -> Finalize = FinalizeParams {
        name: name.into(),
        ..Default::default()
    };
    /// `delete`: removes the owner, cancelling its unfinished operations. Not repeated
    /// after a lost answer ([`Error::Interrupted`]): a repeat could delete an owner
    /// re-created under the same name meanwhile. [`Error::is_not_found`] if there is none.
    delete(name: &str) -> Delete = OwnerParams::current(name);
    /// `cancel`: the whole owner (it ends Failed with the reason) or, with
    /// [`Call::operations`], only those operations (they end Canceled); [`Call::reason`]
    /// says why. Not repeated after a lost answer ([`Error::Interrupted`]): read back.
    ///
    /// # Errors
    /// [`Error::is_wrong_phase`] once the owner is past WaitingForPluginOperations or a
    /// chosen operation is finished; [`Error::is_not_found`] for the owner or a chosen
    /// operation it lacks.
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// let result = client
    ///     .backups()
    ///     .cancel("nightly-1")
    ///     .reason("the user deleted the backup")
    ///     .await?;
    /// # Ok(()) }
    /// ```
    cancel(name: &str) -> Cancel = CancelParams {
        name: name.into(),
        operations: None,
        reason: None,
    };
});

calls!(Client {
    /// `agent.status`: the agent's version, API version, features, uptime and counts.
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// let status = client.status().await?;
    /// if !status.supports(opmon_client::methods::Feature::Cancel) {
    ///     eprintln!("agent {} cannot cancel", status.version);
    /// }
    /// # Ok(()) }
    /// ```
    status() -> Status = NoParams {};
    /// `server.started`: the backup server `name` now runs as `instance`. The agent
    /// fails the InProgress owners that earlier instances of `name` started (with a
    /// failure reason) and answers which; calling it again fails nothing more. `""`
    /// names the owners started without a server. [`Error::is_invalid_params`] for a
    /// name or instance that is not printable text of at most 253 bytes.
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// let failed = client.server_started("velero/velero", "velero-5d8f-abcde").await?;
    /// for owner in failed.failed {
    ///     println!("{} {} failed: the server restarted", owner.kind, owner.name);
    /// }
    /// # Ok(()) }
    /// ```
    server_started(name: &str, instance: &str) -> ServerStarted = ServerStartedParams {
        name: name.into(),
        instance: instance.into(),
    };
    /// `snapshotter.register`: persisted, replaces an earlier registration of the name.
    ///
    /// # Errors
    /// [`Error::is_invalid_params`] naming the field: a name that is not
    /// `<DNS subdomain>/<name>`, a v2 snapshotter without exactly one of socket and
    /// command, a relative socket, a command while the agent does not allow them over
    /// the API.
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// use opmon_client::Snapshotter;
    /// let s = Snapshotter::socket("example.io/copier", "/run/copier/copier.sock");
    /// client.register_snapshotter(s).await?;
    /// # Ok(()) }
    /// ```
    register_snapshotter(snapshotter: Snapshotter) -> RegisterSnapshotter = snapshotter;
    /// `snapshotter.list`: the registered snapshotters.
    snapshotters() -> ListSnapshotters = NoParams {};
    /// `snapshotter.unregister`: returns what was registered; [`Error::is_not_found`] if
    /// no snapshotter has the name. Not repeated after a lost answer
    /// ([`Error::Interrupted`]): list to see.
    unregister_snapshotter(name: &str) -> UnregisterSnapshotter = NameParams { name: name.into() };
    /// `snapshotter.changed`: tells the agent that operations of `plugin` changed, so
    /// it polls them now; all of its operations unless [`Call::operations`] names some.
    /// The SDK's `snapshotter::Hints` sends these for a snapshotter.
    ///
    /// # Errors
    /// [`Error::is_not_found`] if no snapshotter is registered for `plugin`;
    /// [`Error::is_invalid_params`] for more than 1,000 IDs.
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// client
    ///     .snapshotter_changed("example.io/copier")
    ///     .operations(vec!["copy-42".into()])
    ///     .await?;
    /// # Ok(()) }
    /// ```
    snapshotter_changed(plugin: &str) -> SnapshotterChanged = SnapshotterChangedParams {
        plugin: plugin.into(),
        operations: None,
    };
});

/// The optional arguments of the typed calls, declared once: each becomes a builder
/// method of `Call<methods::M>` for every method it is listed under, setting a field of
/// the method's params; the errors are those of the call that made it.
macro_rules! setters {
    () => {};
    ($($method:ident),+ => $setters:tt $($rest:tt)*) => {
        $(setters!(@impl $method $setters);)+
        setters!($($rest)*);
    };
    (@impl $method:ident {
        $($(#[doc = $doc:literal])* $setter:ident($($arg:ident: $ty:ty),*) => |$p:ident| $set:expr;)+
    }) => {
        impl Call<methods::$method> {
            $($(#[doc = $doc])* pub fn $setter(self, $($arg: $ty),*) -> Self {
                self.with(|$p| $set)
            })+
        }
    };
}

setters! {
    Start => {
        /// How long the owner's operations may take (default `4h0m0s`, as in Velero).
        item_operation_timeout(timeout: Duration) => |p| {
            p.item_operation_timeout = Some(GoDuration(timeout))
        };
        /// Fail an operation whose progress has not changed for this long (overrides the
        /// snapshotter's `stallTimeout`; zero turns it off for this owner).
        stall_timeout(timeout: Duration) => |p| p.stall_timeout = Some(GoDuration(timeout));
        /// Fail an operation still New this long after it was created (overrides the
        /// snapshotter's `startTimeout`; zero turns it off for this owner).
        start_timeout(timeout: Duration) => |p| p.start_timeout = Some(GoDuration(timeout));
        /// Restores only: pass through Finalizing and wait for `restore.finalize` (default:
        /// the agent's `restore_finalize` setting).
        finalize(finalize: bool) => |p| p.finalize = Some(finalize);
        /// The backup server's own representation of the backup or restore (a JSON object
        /// of at most 64 KiB), passed to the snapshotters in every Progress and Cancel.
        ///
        /// ```no_run
        /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
        /// let backup = serde_json::json!({"metadata": {"name": "nightly-1"}});
        /// client.backups().start("nightly-1", "3f5c9a").object(backup).await?;
        /// # Ok(()) }
        /// ```
        object(object: serde_json::Value) => |p| p.object = Some(object);
        /// The backup server starting it (`name`, running as `instance`), so that
        /// `server.started` of a later instance fails it if it is still InProgress.
        server(name: &str, instance: &str) => |p| {
            p.server = Some(ServerRef { name: name.into(), instance: instance.into() })
        };
    }
    EndInProgress, Finalize => {
        /// Errors the backup server counted (while InProgress, or in its finalize step):
        /// added to the owner's; any makes it PartiallyFailed.
        errors(errors: u32) => |p| p.errors = errors;
        /// Warnings the backup server counted: added to the owner's.
        warnings(warnings: u32) => |p| p.warnings = warnings;
    }
    EndInProgress => {
        /// The backup or restore failed outright: Failed, unfinished operations cancelled.
        failed() => |p| p.failed = true;
    }
    List => {
        /// Only owners in these phases.
        phases(phases: Vec<OwnerPhase>) => |p| p.phases = Some(phases);
        /// Owners whose names sort after this one: the previous page's `next`.
        after(name: impl Into<String>) => |p| p.after = Some(name.into());
    }
    List, Events => {
        /// At most this many (default 100, at most 1,000).
        limit(limit: u32) => |p| p.limit = Some(limit);
    }
    Get, Operations, ItemOperations, Events, Delete => {
        /// The owner of the name with this uid, current or retired
        /// ([`crate::Owner::retired`]), rather than the name's current owner; one the name
        /// never had is [`Error::is_not_found`].
        ///
        /// ```no_run
        /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
        /// let earlier = client.backups().get("nightly-1").uid("3f5c9a").await?;
        /// # Ok(()) }
        /// ```
        uid(uid: impl Into<String>) => |p| p.uid = Some(uid.into());
    }
    Events => {
        /// Events after this `seq`: the previous page's `next`.
        after_seq(seq: u64) => |p| p.after = Some(seq);
    }
    Operations => {
        /// Only operations in these phases.
        phases(phases: Vec<OperationPhase>) => |p| p.phases = Some(phases);
    }
    Finalize => {
        /// Backups only: rewrite the tarball `input` into `output` (which may be `input`
        /// itself), with the [`updated_items`](Self::updated_items).
        contents(input: impl Into<PathBuf>, output: impl Into<PathBuf>) => |p| {
            p.contents = Some(Contents { input: input.into(), output: output.into() })
        };
        /// Items to put into the tarball in place of (or beside) what it has: the
        /// post-operation items the plugins updated.
        ///
        /// ```no_run
        /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
        /// use opmon_client::{ResourceIdentifier, UpdatedItem};
        /// let pv = UpdatedItem {
        ///     resource: ResourceIdentifier::cluster("persistentvolumes", "pv-1"),
        ///     object: serde_json::json!({"apiVersion": "v1", "kind": "PersistentVolume"}),
        /// };
        /// let finalize = client.backups().finalize("nightly-1");
        /// finalize.contents("nightly-1.tar.gz", "nightly-1.tar.gz").updated_items(vec![pv]).await?;
        /// # Ok(()) }
        /// ```
        updated_items(items: Vec<UpdatedItem>) => |p| p.updated_items = items;
    }
    Cancel => {
        /// Cancel only these operations (each an ID, or an ID and its item); the owner
        /// goes on.
        ///
        /// ```no_run
        /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
        /// use opmon_client::OperationSelector;
        /// let ids = vec![OperationSelector::Id("copy-42".into())];
        /// client.backups().cancel("nightly-1").operations(ids).await?;
        /// # Ok(()) }
        /// ```
        operations(operations: Vec<OperationSelector>) => |p| {
            p.operations = Some(operations)
        };
        /// Why (at most 1,024 bytes): in the owner's failure reason or the operations'
        /// errors, and passed on to the snapshotters.
        reason(reason: impl Into<String>) => |p| p.reason = Some(reason.into());
    }
    SnapshotterChanged => {
        /// Only these operations changed (at most 1,000 IDs).
        operations(operations: Vec<String>) => |p| p.operations = Some(operations);
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
