//! The snapshotter's JSON-RPC server on a Unix socket: jsonrpsee's own service with its
//! own limits, over accepted Unix streams (jsonrpsee binds TCP only). The socket's file
//! mode decides who may connect; the agent is the one expected peer.

use std::future::Future;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use jsonrpsee::server::{serve_with_graceful_shutdown, stop_channel, Methods, ServerConfig};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::task::TaskTracker;

/// Connections served at once: the agent holds a few per snapshotter.
const MAX_CONNECTIONS: u32 = 256;
/// Largest request, in bytes: the agent's batches of progress requests are far smaller.
const MAX_REQUEST_BYTES: u32 = 16 * 1024 * 1024;
/// How long calls in flight have to finish once the server stops.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Binds `path` with file mode `mode`, replacing a stale socket file left by a dead
/// process but refusing to take the socket of a live one (`AddrInUse`, naming the path).
pub async fn bind(path: &Path, mode: u32) -> io::Result<UnixListener> {
    let named = |e: io::Error, what: &str| {
        io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))
    };
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
                    std::fs::remove_file(path).map_err(|e| named(e, "removing stale socket"))?;
                }
                Err(e) => return Err(named(e, "probing existing socket")),
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(named(e, "inspecting")),
    }
    let listener = UnixListener::bind(path).map_err(|e| named(e, "binding"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| named(e, "setting mode of"))?;
    Ok(listener)
}

/// Serves `methods` on `listener` until `shutdown` resolves, then lets the calls in
/// flight finish (for at most [`STOP_TIMEOUT`]).
pub(crate) async fn serve_listener(
    listener: UnixListener,
    methods: impl Into<Methods>,
    shutdown: impl Future<Output = ()>,
) {
    let methods: Methods = methods.into();
    let config = ServerConfig::builder()
        .max_connections(MAX_CONNECTIONS)
        .max_request_body_size(MAX_REQUEST_BYTES)
        .build();
    let builder = jsonrpsee::server::Server::builder()
        .set_config(config)
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
                    // Out of descriptors, most likely: try again shortly, not in a spin.
                    tracing::debug!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
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
    let _ = tokio::time::timeout(STOP_TIMEOUT, connections.wait()).await;
}
