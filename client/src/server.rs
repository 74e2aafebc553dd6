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

use jsonrpsee::server::{serve_with_graceful_shutdown, stop_channel, Methods, ServerConfig};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::task::TaskTracker;

/// Limits of a served socket.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Largest request body accepted, in bytes; larger ones are refused unread.
    pub max_request_body_size: u32,
    /// Largest response body produced, in bytes.
    pub max_response_body_size: u32,
    /// Connections served at once; more are refused by jsonrpsee.
    pub max_connections: u32,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            max_request_body_size: 16 * 1024 * 1024,
            max_response_body_size: 256 * 1024 * 1024,
            max_connections: 4096,
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

/// Serves `methods` on `listener` until `shutdown` resolves, then drains.
pub async fn serve(
    listener: UnixListener,
    methods: impl Into<Methods>,
    config: ServeConfig,
    admission: impl Admission,
    shutdown: impl Future<Output = ()>,
) {
    let methods: Methods = methods.into();
    let server_config = ServerConfig::builder()
        .max_request_body_size(config.max_request_body_size)
        .max_response_body_size(config.max_response_body_size)
        .max_connections(config.max_connections)
        .build();
    let builder = jsonrpsee::server::Server::builder()
        .set_config(server_config)
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
        let service = builder.clone().build(methods.clone(), stop_handle.clone());
        let stopped = stop_handle.clone().shutdown();
        connections.spawn(async move {
            if let Err(e) = serve_with_graceful_shutdown(stream, service, stopped).await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    let _ = server_handle.stop();
    connections.close();
    connections.wait().await;
}
