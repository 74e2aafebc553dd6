//! Serving JSON-RPC on a Unix socket: the one piece the agent and every SDK snapshotter
//! share.
//!
//! jsonrpsee's own server binds TCP only, so this module runs its tower service over
//! accepted Unix streams: each connection speaks HTTP/1.1 (`POST /`) or upgrades to
//! WebSocket. Shutdown is graceful by construction: once `shutdown` resolves, no new
//! connection is accepted, in-flight requests finish, and [`serve`] returns only after
//! every connection task has ended.
//!
//! Before a byte of a connection is read, an [`Admission`] decides whether it is
//! served. A refused peer is answered, not reset: its request gets the refusal's HTTP
//! status (403, 429) and a JSON-RPC error body, within a fixed time and byte budget and
//! a bounded number of refusals answered at once, so refused peers cannot tie up the
//! server.

use std::future::Future;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;

use jsonrpsee::core::BoxError;
use jsonrpsee::server::middleware::rpc::{RpcService, RpcServiceBuilder, RpcServiceT};
use jsonrpsee::server::{
    serve_with_graceful_shutdown, stop_channel, HttpBody, HttpResponse, MethodResponse, Methods,
    ServerConfig,
};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::task::TaskTracker;
use tower::Service;

/// Renders the page served at `GET /metrics`.
pub type MetricsPage = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = String> + Send>> + Send + Sync>;

/// Connections served at once by default.
pub const MAX_CONNECTIONS: u32 = 4096;

/// Limits and extras of a served socket.
#[derive(Clone)]
pub struct ServeConfig {
    /// Largest request body accepted, in bytes; larger ones are refused unread.
    pub max_request_body_size: u32,
    /// Largest response body produced, in bytes.
    pub max_response_body_size: u32,
    /// Connections served at once; more are refused by jsonrpsee.
    pub max_connections: u32,
    /// If set, `GET /metrics` answers with this page (Prometheus text format).
    pub metrics: Option<MetricsPage>,
    /// A connection whose peer sends nothing for this long is closed.
    pub idle_timeout: Option<std::time::Duration>,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            max_request_body_size: 16 * 1024 * 1024,
            max_response_body_size: 256 * 1024 * 1024,
            max_connections: MAX_CONNECTIONS,
            metrics: None,
            idle_timeout: None,
        }
    }
}

/// Binds `path`, replacing a stale socket file left by a dead process but refusing to
/// steal the socket of a live one: if something answers a connect on `path`, the error
/// is `AddrInUse` and names the path. The socket gets file mode `mode`.
pub async fn bind(path: &Path, mode: u32) -> io::Result<UnixListener> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} exists and is not a socket", path.display()),
                ));
            }
            match UnixStream::connect(path).await {
                Ok(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::AddrInUse,
                        format!("another process is serving on {}", path.display()),
                    ))
                }
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    std::fs::remove_file(path).map_err(|e| {
                        io::Error::new(
                            e.kind(),
                            format!("removing stale socket {}: {e}", path.display()),
                        )
                    })?;
                }
                Err(e) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("probing existing socket {}: {e}", path.display()),
                    ))
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!("inspecting {}: {e}", path.display()),
            ))
        }
    }
    let listener = UnixListener::bind(path)
        .map_err(|e| io::Error::new(e.kind(), format!("binding {}: {e}", path.display())))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(|e| {
        io::Error::new(e.kind(), format!("setting mode of {}: {e}", path.display()))
    })?;
    Ok(listener)
}

/// Answers `GET /metrics` from `page` when there is one; everything else is JSON-RPC.
/// A body without a declared length (chunked) is read up to `max_body` here, so one
/// past the limit gets 413 like a declared one, not an internal error.
async fn route<S>(
    request: hyper::Request<hyper::body::Incoming>,
    mut rpc: S,
    page: Option<MetricsPage>,
    max_body: u32,
) -> Result<HttpResponse, BoxError>
where
    S: Service<hyper::Request<HttpBody>, Response = HttpResponse, Error = BoxError>,
{
    if let Some(page) = page {
        if request.method() == hyper::Method::GET && request.uri().path() == "/metrics" {
            let mut response = HttpResponse::new(HttpBody::from(page().await));
            response.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            return Ok(response);
        }
    }
    let (parts, body) = request.into_parts();
    let unsized_post = parts.method == hyper::Method::POST
        && !parts.headers.contains_key(hyper::header::CONTENT_LENGTH);
    let body = if unsized_post {
        use http_body_util::BodyExt;
        match http_body_util::Limited::new(body, max_body as usize)
            .collect()
            .await
        {
            Ok(collected) => HttpBody::new(http_body_util::Full::new(collected.to_bytes())),
            Err(e)
                if e.downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some() =>
            {
                let text = format!(
                    r#"{{"jsonrpc":"2.0","id":null,"error":{{"code":-32007,"message":"Request is too big: over {max_body} bytes"}}}}"#
                );
                let mut response = HttpResponse::new(HttpBody::from(text));
                *response.status_mut() = hyper::StatusCode::PAYLOAD_TOO_LARGE;
                return Ok(response);
            }
            Err(e) => return Err(e),
        }
    } else {
        HttpBody::new(body)
    };
    rpc.call(hyper::Request::from_parts(parts, body)).await
}

/// When a connection's peer last sent a byte.
#[derive(Clone)]
struct Activity {
    start: tokio::time::Instant,
    /// Milliseconds after `start` of the last read.
    last_ms: Arc<std::sync::atomic::AtomicU64>,
}

impl Activity {
    fn touch(&self) {
        let now = self.start.elapsed().as_millis() as u64;
        self.last_ms
            .store(now, std::sync::atomic::Ordering::Relaxed);
    }

    /// Resolves once nothing has moved for `timeout`.
    async fn idle_for(&self, timeout: std::time::Duration) {
        loop {
            let last = self.last_ms.load(std::sync::atomic::Ordering::Relaxed);
            let deadline = self.start + std::time::Duration::from_millis(last) + timeout;
            tokio::time::sleep_until(deadline).await;
            if self.last_ms.load(std::sync::atomic::Ordering::Relaxed) == last {
                return;
            }
        }
    }
}

/// A stream that records its activity, for the idle timeout.
struct Watched<S> {
    inner: S,
    activity: Activity,
}

impl<S> Watched<S> {
    fn new(inner: S) -> (Watched<S>, Activity) {
        let activity = Activity {
            start: tokio::time::Instant::now(),
            last_ms: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        };
        (
            Watched {
                inner,
                activity: activity.clone(),
            },
            activity,
        )
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        data: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        // Only what the peer sends counts as activity: a client that sends nothing is
        // idle even while the server is still writing to it.
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Decides, before any request is read, whether a connection may be served.
pub trait Admission: Send + Sync + 'static {
    /// Held for as long as the admitted connection is served (a slot of a limit, say).
    type Ticket: Send + 'static;
    fn admit(&self, stream: &UnixStream) -> Result<Self::Ticket, Refusal>;
}

/// Why a connection is not served: the peer gets `status` and a JSON-RPC error object
/// with `message` (see [`answer_refused`]) instead of a bare close, so it can act on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// 403 (not allowed) or 429 (over a connection limit).
    pub status: hyper::StatusCode,
    /// The JSON-RPC error code of the body.
    pub code: i32,
    pub message: String,
}

/// Admits every connection: the socket's file mode is the only gate.
pub struct AdmitAll;

impl Admission for AdmitAll {
    type Ticket = ();
    fn admit(&self, _stream: &UnixStream) -> Result<(), Refusal> {
        Ok(())
    }
}

/// Serves `methods` on `listener` until `shutdown` resolves, then drains. Every call
/// passes through `rpc_middleware` (`RpcServiceBuilder::new()` for none).
pub async fn serve<L>(
    listener: UnixListener,
    methods: impl Into<Methods>,
    config: ServeConfig,
    rpc_middleware: RpcServiceBuilder<L>,
    admission: impl Admission,
    shutdown: impl Future<Output = ()>,
) where
    L: tower::Layer<RpcService> + Clone + Send + Sync + 'static,
    L::Service: RpcServiceT<
            MethodResponse = MethodResponse,
            BatchResponse = MethodResponse,
            NotificationResponse = MethodResponse,
        > + Send
        + Sync
        + 'static,
{
    let methods: Methods = methods.into();
    let server_config = ServerConfig::builder()
        .max_request_body_size(config.max_request_body_size)
        .max_response_body_size(config.max_response_body_size)
        .max_connections(config.max_connections)
        .build();
    let builder = jsonrpsee::server::Server::builder()
        .set_config(server_config)
        .set_rpc_middleware(rpc_middleware)
        .to_service_builder();
    let (stop_handle, server_handle) = stop_channel();
    let connections = TaskTracker::new();
    let refusals = Refusals::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors or similar: keep serving the connections we
                    // have, and try again shortly rather than spinning.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let ticket = match admission.admit(&stream) {
            Ok(ticket) => ticket,
            Err(refusal) => {
                refusals.answer(stream, refusal);
                continue;
            }
        };
        let rpc = builder.clone().build(methods.clone(), stop_handle.clone());
        let page = config.metrics.clone();
        let max_body = config.max_request_body_size;
        let service = tower::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let rpc = rpc.clone();
            let page = page.clone();
            route(request, rpc, page, max_body)
        });
        let stopped = stop_handle.clone().shutdown();
        let idle_timeout = config.idle_timeout;
        connections.spawn(async move {
            let _ticket = ticket;
            let (stream, activity) = Watched::new(stream);
            let served = serve_with_graceful_shutdown(stream, service, stopped);
            let idle = async {
                match idle_timeout {
                    Some(timeout) => activity.idle_for(timeout).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                result = served => if let Err(e) = result {
                    tracing::debug!(error = %e, "connection ended with an error");
                },
                _ = idle => tracing::debug!("closed an idle connection"),
            }
        });
    }
    drop(listener);
    let _ = server_handle.stop();
    connections.close();
    connections.wait().await;
}

/// Refused connections answered at once; past this, more are closed unanswered, so
/// refused peers cannot make the agent hold more than this many sockets and tasks.
const REFUSALS_AT_ONCE: usize = 32;
/// A refused peer has this long to send its request and take the answer.
const REFUSAL_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);
/// Bytes of a refused peer's request body read (and dropped) before answering, so a
/// small request is consumed and the close after the answer is clean.
const REFUSAL_BODY_READ: usize = 64 * 1024;

/// Answers refused connections, within [`REFUSALS_AT_ONCE`] and [`REFUSAL_DEADLINE`].
struct Refusals {
    slots: Arc<tokio::sync::Semaphore>,
}

impl Refusals {
    fn new() -> Refusals {
        Refusals {
            slots: Arc::new(tokio::sync::Semaphore::new(REFUSALS_AT_ONCE)),
        }
    }

    /// Answers `stream` with `refusal` in a task of its own, or closes it at once if
    /// too many refusals are being answered already.
    fn answer(&self, stream: UnixStream, refusal: Refusal) {
        let Ok(slot) = self.slots.clone().try_acquire_owned() else {
            tracing::debug!("closed a refused connection unanswered: too many refusals at once");
            return;
        };
        tokio::spawn(async move {
            let _slot = slot;
            if tokio::time::timeout(REFUSAL_DEADLINE, answer_refused(stream, refusal))
                .await
                .is_err()
            {
                tracing::debug!("a refused peer took too long; closed");
            }
        });
    }
}

/// The body of a refusal: a JSON-RPC error object (id null), as for a request that
/// could not be read.
fn refusal_body(refusal: &Refusal) -> String {
    let message = serde_json::Value::String(refusal.message.clone());
    format!(
        r#"{{"jsonrpc":"2.0","id":null,"error":{{"code":{},"message":{message}}}}}"#,
        refusal.code
    )
}

/// Serves one HTTP request on `stream` (any method, a WebSocket upgrade included) with
/// `refusal`'s status and body, then closes. The request head is bounded by hyper's
/// smallest buffer, the body read by [`REFUSAL_BODY_READ`]; the caller bounds the time.
async fn answer_refused(stream: UnixStream, refusal: Refusal) {
    let body = hyper::body::Bytes::from(refusal_body(&refusal));
    let status = refusal.status;
    let service =
        hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let body = body.clone();
            async move {
                use http_body_util::BodyExt;
                let _ = http_body_util::Limited::new(request.into_body(), REFUSAL_BODY_READ)
                    .collect()
                    .await;
                let mut response = hyper::Response::new(http_body_util::Full::new(body));
                *response.status_mut() = status;
                let headers = response.headers_mut();
                headers.insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("application/json"),
                );
                headers.insert(
                    hyper::header::CONNECTION,
                    hyper::header::HeaderValue::from_static("close"),
                );
                Ok::<_, std::convert::Infallible>(response)
            }
        });
    let io = hyper_util::rt::TokioIo::new(stream);
    let _ = hyper::server::conn::http1::Builder::new()
        .keep_alive(false)
        .max_buf_size(8192)
        .serve_connection(io, service)
        .await;
}
