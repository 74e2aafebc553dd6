//! Serving JSON-RPC on a Unix socket: the one piece the agent and every SDK snapshotter
//! share.
//!
//! jsonrpsee's own server binds TCP only, so this module runs its tower service over
//! accepted Unix streams: each connection speaks HTTP/1.1 (`POST /`) or upgrades to
//! WebSocket. Shutdown is graceful by construction: once `shutdown` resolves, no new
//! connection is accepted, in-flight requests finish, and [`serve`] returns only after
//! every connection task has ended.

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
            max_connections: 4096,
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
    fn admit(&self, stream: &UnixStream) -> bool;
}

/// Admits every connection: the socket's file mode is the only gate.
pub struct AdmitAll;

impl Admission for AdmitAll {
    fn admit(&self, _stream: &UnixStream) -> bool {
        true
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
        if !admission.admit(&stream) {
            continue;
        }
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
