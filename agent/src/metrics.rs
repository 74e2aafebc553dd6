//! Prometheus metrics, in the text exposition format, served at `GET /metrics` on the
//! agent's socket and, when configured, on a TCP address.
//!
//! Counters and histograms are updated where things happen (poll calls, commits, RPC
//! requests, refused peers); the owner and operation gauges are read from the database
//! at scrape time, so they are never stale.

use std::sync::Mutex;
use std::time::Duration;

use crate::sync::lock;
use jsonrpsee::server::middleware::rpc::RpcServiceT;
use jsonrpsee::server::MethodResponse;
use jsonrpsee::types::Request;
use opmon_client::{codes, AgentStatus, OwnerPhase};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::Arc;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SnapshotterLabel {
    pub snapshotter: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RpcLabels {
    method: String,
    code: i32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// `value` escaped for a label value of the text format (`\\`, `\"`, `\n`), which the
/// encoder writes as given. Snapshotter names follow Velero's plugin-name rule, whose
/// part after the `/` may hold quotes and backslashes.
fn label_value(value: &str) -> String {
    let mut escaped = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => escaped.push_str("\\\\"),
            '"' => escaped.push_str("\\\""),
            '\n' => escaped.push_str("\\n"),
            c => escaped.push(c),
        }
    }
    escaped
}

fn latency_histogram() -> Histogram {
    // 100 µs to ~3 min.
    Histogram::new(exponential_buckets(0.0001, 2.0, 21))
}

pub struct Metrics {
    registry: Registry,
    poll_calls: Family<SnapshotterLabel, Counter>,
    poll_errors: Family<SnapshotterLabel, Counter>,
    poll_latency: HistogramFamily<SnapshotterLabel>,
    cancel_calls: Family<SnapshotterLabel, Counter>,
    cancel_errors: Family<SnapshotterLabel, Counter>,
    commit_batch_size: Histogram,
    commit_latency: Histogram,
    rpc_requests: Family<RpcLabels, Counter>,
    refused_connections: Counter,
    owners: Family<PhaseLabel, Gauge>,
    unfinished_operations: Gauge,
    /// Encoding is not concurrent; scrapes take turns.
    encoding: Mutex<()>,
}

impl Metrics {
    pub fn new() -> Arc<Metrics> {
        let mut registry = Registry::with_prefix("opmon");
        let poll_calls = Family::<SnapshotterLabel, Counter>::default();
        let poll_errors = Family::<SnapshotterLabel, Counter>::default();
        let poll_latency: HistogramFamily<SnapshotterLabel> =
            Family::new_with_constructor(latency_histogram);
        let cancel_calls = Family::<SnapshotterLabel, Counter>::default();
        let cancel_errors = Family::<SnapshotterLabel, Counter>::default();
        let commit_batch_size = Histogram::new(exponential_buckets(1.0, 2.0, 14));
        let commit_latency = latency_histogram();
        let rpc_requests = Family::<RpcLabels, Counter>::default();
        let refused_connections = Counter::default();
        let owners = Family::<PhaseLabel, Gauge>::default();
        let unfinished_operations = Gauge::default();
        registry.register("owners", "Backups and restores by phase", owners.clone());
        registry.register(
            "unfinished_operations",
            "Operations New or InProgress",
            unfinished_operations.clone(),
        );
        registry.register(
            "poll_calls",
            "Progress calls made, by snapshotter",
            poll_calls.clone(),
        );
        registry.register(
            "poll_errors",
            "Progress calls that failed, by snapshotter",
            poll_errors.clone(),
        );
        registry.register(
            "poll_latency_seconds",
            "Time for one snapshotter to answer a chunk of progress calls",
            poll_latency.clone(),
        );
        registry.register(
            "cancel_calls",
            "Cancel calls made, by snapshotter",
            cancel_calls.clone(),
        );
        registry.register(
            "cancel_errors",
            "Cancel calls that failed or were abandoned at the call deadline, by snapshotter",
            cancel_errors.clone(),
        );
        registry.register(
            "commit_batch_size",
            "Requests committed together in one transaction",
            commit_batch_size.clone(),
        );
        registry.register(
            "commit_latency_seconds",
            "Time from BEGIN to a durable COMMIT",
            commit_latency.clone(),
        );
        registry.register(
            "rpc_requests",
            "JSON-RPC requests by method and result code (0 for success)",
            rpc_requests.clone(),
        );
        registry.register(
            "refused_connections",
            "Connections refused by the peer credential check",
            refused_connections.clone(),
        );
        Arc::new(Metrics {
            registry,
            poll_calls,
            poll_errors,
            poll_latency,
            cancel_calls,
            cancel_errors,
            commit_batch_size,
            commit_latency,
            rpc_requests,
            refused_connections,
            owners,
            unfinished_operations,
            encoding: Mutex::new(()),
        })
    }

    /// Records one chunk of progress calls to `snapshotter`.
    pub fn polled(&self, snapshotter: &str, calls: usize, errors: usize, took: Duration) {
        let label = SnapshotterLabel {
            snapshotter: label_value(snapshotter),
        };
        self.poll_calls.get_or_create(&label).inc_by(calls as u64);
        self.poll_errors.get_or_create(&label).inc_by(errors as u64);
        self.poll_latency
            .get_or_create(&label)
            .observe(took.as_secs_f64());
    }

    /// Records `calls` Cancel calls to `snapshotter`, `errors` of them failed or abandoned.
    pub fn cancelled(&self, snapshotter: &str, calls: usize, errors: usize) {
        let label = SnapshotterLabel {
            snapshotter: snapshotter.to_string(),
        };
        self.cancel_calls.get_or_create(&label).inc_by(calls as u64);
        self.cancel_errors
            .get_or_create(&label)
            .inc_by(errors as u64);
    }

    pub fn committed(&self, size: usize, took: Duration) {
        self.commit_batch_size.observe(size as f64);
        self.commit_latency.observe(took.as_secs_f64());
    }

    pub fn refused(&self) {
        self.refused_connections.inc();
    }

    fn rpc(&self, method: &str, code: i32) {
        let method = if code == codes::METHOD_NOT_FOUND {
            "unknown" // keep arbitrary names out of the label set
        } else {
            method
        };
        self.rpc_requests
            .get_or_create(&RpcLabels {
                method: method.to_string(),
                code,
            })
            .inc();
    }

    /// The exposition text, with the gauges set from `status`.
    pub fn render(&self, status: &AgentStatus) -> String {
        for phase in OwnerPhase::ALL {
            let count = status.owners.get(phase).copied().unwrap_or(0);
            self.owners
                .get_or_create(&PhaseLabel {
                    phase: phase.to_string(),
                })
                .set(count as i64);
        }
        self.unfinished_operations
            .set(status.unfinished_operations as i64);
        let _turn = lock(&self.encoding);
        let mut text = String::new();
        if let Err(e) = encode(&mut text, &self.registry) {
            tracing::warn!(error = %e, "encoding metrics failed");
        }
        text
    }
}

/// RPC middleware counting requests by method and result code.
#[derive(Clone)]
pub struct CountRequests<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S> CountRequests<S> {
    pub fn layer(metrics: Arc<Metrics>) -> impl Fn(S) -> CountRequests<S> + Clone {
        move |inner| CountRequests {
            inner,
            metrics: metrics.clone(),
        }
    }
}

impl<S> RpcServiceT for CountRequests<S>
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
        let metrics = self.metrics.clone();
        let method = request.method_name().to_string();
        async move {
            let response = inner.call(request).await;
            metrics.rpc(&method, response.as_error_code().unwrap_or(0));
            response
        }
    }

    fn batch<'a>(
        &self,
        requests: jsonrpsee::core::middleware::Batch<'a>,
    ) -> impl std::future::Future<Output = MethodResponse> + Send + 'a {
        let inner = self.inner.clone();
        let metrics = self.metrics.clone();
        async move {
            let response = inner.batch(requests).await;
            metrics.rpc("batch", response.as_error_code().unwrap_or(0));
            response
        }
    }

    fn notification<'a>(
        &self,
        n: jsonrpsee::core::middleware::Notification<'a>,
    ) -> impl std::future::Future<Output = MethodResponse> + Send + 'a {
        self.inner.notification(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshotter_names_with_quotes_and_backslashes_stay_one_label_value() {
        let metrics = Metrics::new();
        metrics.polled(r#"example.io/a"b\c"#, 3, 1, Duration::from_millis(5));
        let status = AgentStatus {
            version: "test".into(),
            uptime: opmon_client::GoDuration::from_secs(1),
            owners: Default::default(),
            unfinished_operations: 0,
            snapshotters: 1,
            api_version: String::new(),
            features: Vec::new(),
        };
        let page = metrics.render(&status);
        assert!(
            page.lines()
                .any(|l| l == r#"opmon_poll_calls_total{snapshotter="example.io/a\"b\\c"} 3"#),
            "{page}"
        );
    }
}
