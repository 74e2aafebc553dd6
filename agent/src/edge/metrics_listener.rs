//! `GET /metrics` on a TCP address (`metrics_listen`), with the same page as the
//! socket's. Anyone who can reach the address may connect, so the listener bounds
//! itself: at most [`CONNECTIONS`] at once (further ones wait in the kernel's backlog
//! until one ends), each closed once it has sent no request head for [`HEADER_TIMEOUT`]
//! or has lived [`LIFETIME`]. A scrape takes milliseconds; connections that send
//! nothing hold a place for seconds at most.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::server::{metrics_response, MetricsPage};
use crate::log_limit::LogLimit;

/// Connections served at once.
pub const CONNECTIONS: usize = 64;
/// How long a connection may take to send a request's head, including the wait for
/// the next request on a kept-alive connection.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest a connection is kept, whatever it does.
pub const LIFETIME: Duration = Duration::from_secs(120);

static ACCEPT_ERRORS: std::sync::LazyLock<LogLimit> =
    std::sync::LazyLock::new(|| LogLimit::new("failed accepts of metrics connections"));

/// Binds `address` and serves the metrics page there until `shutdown` is cancelled.
pub async fn serve(
    address: std::net::SocketAddr,
    page: MetricsPage,
    shutdown: CancellationToken,
) -> Result<(), String> {
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(|e| format!("binding the metrics listener {address}: {e}"))?;
    tracing::info!(%address, "serving metrics");
    tokio::spawn(serve_on(listener, page, shutdown));
    Ok(())
}

async fn serve_on(
    listener: tokio::net::TcpListener,
    page: MetricsPage,
    shutdown: CancellationToken,
) {
    let places = Arc::new(Semaphore::new(CONNECTIONS));
    let connections = tokio_util::task::TaskTracker::new();
    loop {
        let place = tokio::select! {
            _ = shutdown.cancelled() => break,
            place = places.clone().acquire_owned() => match place {
                Ok(place) => place,
                Err(_) => break,
            },
        };
        let stream = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors, most likely: wait rather than spin.
                    ACCEPT_ERRORS.log(|| {
                        tracing::warn!(error = %e, "accepting a metrics connection failed")
                    });
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let page = page.clone();
        let stop = shutdown.clone();
        connections.spawn(async move {
            let _place = place;
            let service = hyper::service::service_fn(
                move |request: hyper::Request<hyper::body::Incoming>| {
                    let page = page.clone();
                    async move {
                        let response = if request.method() == hyper::Method::GET
                            && request.uri().path() == "/metrics"
                        {
                            metrics_response(&page, &request).await
                        } else {
                            let mut response = jsonrpsee::server::HttpResponse::new(
                                jsonrpsee::server::HttpBody::from(
                                    "only GET /metrics is served here\n",
                                ),
                            );
                            *response.status_mut() = hyper::StatusCode::NOT_FOUND;
                            response
                        };
                        Ok::<_, std::convert::Infallible>(response)
                    }
                },
            );
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT);
            let connection =
                builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                _ = tokio::time::sleep(LIFETIME) => {}
                _ = stop.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(Duration::from_secs(1), connection).await;
                }
            }
        });
    }
    connections.close();
    connections.wait().await;
}
