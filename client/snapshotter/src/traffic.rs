//! A server's JSON-RPC traffic as the peer saw it, for checking against the OpenRPC
//! documents.
//!
//! With the log filter `opmon_traffic=trace`, every call's request and response (and a
//! batch's, as arrays) and every subscription notification is logged under the target
//! [`TARGET`], one event per exchange with a single field `exchange` holding a JSON
//! object. The agent and the snapshotter SDK both serve through [`Traffic`]; the test
//! harness turns it on for every agent and SDK snapshotter of the end-to-end suite and
//! hands the logs to an independent validator (tests/openrpc/traffic.py), so the
//! documents are checked against everything the suite does, not only against one
//! scripted client. Off (the default), a call costs one filter lookup.

use jsonrpsee::core::middleware::{Batch, BatchEntry, Notification};
use jsonrpsee::server::middleware::rpc::RpcServiceT;
use jsonrpsee::server::MethodResponse;
use jsonrpsee::types::Request;
use serde_json::value::RawValue;

/// The tracing target of traffic events.
pub const TARGET: &str = "opmon_traffic";

fn enabled() -> bool {
    tracing::enabled!(target: TARGET, tracing::Level::TRACE)
}

/// Logs one exchange; `request` and `response` are JSON texts.
fn exchange(request: &str, response: &RawValue) {
    tracing::trace!(
        target: TARGET,
        exchange = %format_args!(r#"{{"request":{request},"response":{}}}"#, response.get())
    );
}

/// Logs a notification of subscription method `method` whose result is `result`.
pub fn notification(method: &str, result: &RawValue) {
    if enabled() {
        let method = serde_json::to_string(method).unwrap_or_default();
        tracing::trace!(
            target: TARGET,
            exchange = %format_args!(r#"{{"notification":{method},"result":{}}}"#, result.get())
        );
    }
}

/// The RPC middleware logging each exchange; outermost, so it sees what the peer sent
/// and what it got back.
#[derive(Clone)]
pub struct Traffic<S> {
    inner: S,
}

impl<S> Traffic<S> {
    pub fn layer(inner: S) -> Traffic<S> {
        Traffic { inner }
    }
}

impl<S> RpcServiceT for Traffic<S>
where
    S: RpcServiceT<
            MethodResponse = MethodResponse,
            BatchResponse = MethodResponse,
            NotificationResponse = MethodResponse,
        > + Clone
        + Send
        + Sync
        + 'static,
{
    type MethodResponse = MethodResponse;
    type NotificationResponse = MethodResponse;
    type BatchResponse = MethodResponse;

    fn call<'a>(
        &self,
        request: Request<'a>,
    ) -> impl std::future::Future<Output = MethodResponse> + Send + 'a {
        let inner = self.inner.clone();
        let text = enabled()
            .then(|| serde_json::to_string(&request).ok())
            .flatten();
        async move {
            let response = inner.call(request).await;
            if let Some(text) = text {
                exchange(&text, response.as_json());
            }
            response
        }
    }

    fn batch<'a>(
        &self,
        batch: Batch<'a>,
    ) -> impl std::future::Future<Output = MethodResponse> + Send + 'a {
        let inner = self.inner.clone();
        // The calls of the batch (notifications get no response; entries that did not
        // parse have no request to show).
        let text = enabled()
            .then(|| {
                let calls: Vec<&Request<'a>> = batch
                    .iter()
                    .filter_map(|entry| match entry {
                        Ok(BatchEntry::Call(request)) => Some(request),
                        _ => None,
                    })
                    .collect();
                serde_json::to_string(&calls).ok()
            })
            .flatten();
        async move {
            let response = inner.batch(batch).await;
            // A batch of notifications only is not answered: no exchange to log.
            if let Some(text) = text.filter(|_| !response.is_notification()) {
                exchange(&text, response.as_json());
            }
            response
        }
    }

    fn notification<'a>(
        &self,
        n: Notification<'a>,
    ) -> impl std::future::Future<Output = MethodResponse> + Send + 'a {
        self.inner.notification(n)
    }
}
