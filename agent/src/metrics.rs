//! Prometheus metrics, served at `GET /metrics` on the agent's socket and, when
//! configured, on a TCP address: OpenMetrics when the scraper's `Accept` prefers it, the
//! classic text format (0.0.4) otherwise.
//!
//! Counters and histograms are updated where things happen (poll calls, commits, RPC
//! requests, refused peers, operations ending, finalize); the owner, operation and
//! database gauges are read at scrape time, so they are never stale. Labels are bounded:
//! by snapshotter (plugin), phase, outcome or method, never by operation or owner.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::clock::UnixMs;
use crate::phase::OperationState;
use crate::store::packed;
use crate::sync::lock;
use opmon_client::{codes, AgentStatus, OwnerPhase};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use rusqlite::Connection;
use std::sync::atomic::AtomicU64;

/// The OpenMetrics page's content type.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The classic text format's content type.
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndedLabels {
    snapshotter: String,
    outcome: String,
}

/// How an operation ended, as `opmon_operations_ended_total` counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Completed,
    Failed,
    Canceled,
    TimedOut,
    Stalled,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::Failed => "failed",
            Outcome::Canceled => "canceled",
            Outcome::TimedOut => "timed_out",
            Outcome::Stalled => "stalled",
        }
    }
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;
type FloatGauge = Gauge<f64, AtomicU64>;

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

fn snapshotter(name: &str) -> SnapshotterLabel {
    SnapshotterLabel {
        snapshotter: label_value(name),
    }
}

fn latency_histogram() -> Histogram {
    // 100 µs to ~3 min.
    Histogram::new(exponential_buckets(0.0001, 2.0, 21))
}

/// What a scrape reads from the database and the file system, per snapshotter and for
/// the database.
#[derive(Debug, Default)]
pub struct Scraped {
    pub snapshotters: BTreeMap<String, Unfinished>,
    pub database_bytes: u64,
    pub wal_bytes: u64,
    /// The file system holding the database: its size and what an unprivileged writer
    /// may still use.
    pub filesystem_bytes: u64,
    pub filesystem_available_bytes: u64,
}

/// A snapshotter's unfinished operations, summed.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Unfinished {
    pub count: u64,
    pub oldest_created_ms: Option<i64>,
    /// Operations whose units are bytes: done and total.
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// Operations whose progress stood still for their stall deadline or longer.
    pub stalled: u64,
    /// Operations older than their owner's item operation timeout.
    pub past_timeout: u64,
}

/// Reads the unfinished operations' sums, by snapshotter, at `now`. One pass over the
/// unfinished operations (the partial index on them), their packed states unpacked.
pub fn unfinished_by_snapshotter(
    conn: &Connection,
    now: UnixMs,
) -> rusqlite::Result<BTreeMap<String, Unfinished>> {
    let mut stmt = conn.prepare_cached(
        "SELECT o.plugin_name, o.created_ms, s.state, w.item_operation_timeout_ms, \
         COALESCE(w.stall_timeout_ms, p.stall_timeout_ms) \
         FROM operations o JOIN operation_state s ON s.op = o.id \
         JOIN owners w ON w.id = o.owner_id \
         LEFT JOIN snapshotters p ON p.name = o.plugin_name \
         WHERE o.phase IN ('New', 'InProgress')",
    )?;
    let mut rows = stmt.query([])?;
    let mut sums: BTreeMap<String, Unfinished> = BTreeMap::new();
    let now = now.0;
    while let Some(row) = rows.next()? {
        let plugin: String = row.get(0)?;
        let created_ms: i64 = row.get(1)?;
        let mut state = OperationState {
            created_ms,
            ..OperationState::default()
        };
        // A damaged state counts as a new operation's; the sweep reports it.
        let _ = packed::read_column(row, 2, &mut state);
        let timeout_ms: i64 = row.get(3)?;
        let stall_ms: Option<i64> = row.get(4)?;
        let sum = sums.entry(plugin).or_default();
        sum.count += 1;
        sum.oldest_created_ms = Some(
            sum.oldest_created_ms
                .map_or(created_ms, |o| o.min(created_ms)),
        );
        if state.operation_units.eq_ignore_ascii_case("bytes") {
            sum.bytes_done += u64::try_from(state.n_completed).unwrap_or(0);
            sum.bytes_total += u64::try_from(state.n_total).unwrap_or(0);
        }
        if let (Some(stall), Some(progressed)) = (stall_ms.filter(|&d| d > 0), state.progressed_ms)
        {
            if now.saturating_sub(progressed) >= stall {
                sum.stalled += 1;
            }
        }
        if timeout_ms > 0 && now.saturating_sub(created_ms) >= timeout_ms {
            sum.past_timeout += 1;
        }
    }
    Ok(sums)
}

/// The database's and its WAL's sizes and its file system's, read at `database`; what
/// cannot be read is 0.
pub fn file_sizes(database: &Path, scraped: &mut Scraped) {
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    scraped.database_bytes = size(database);
    let mut wal = database.as_os_str().to_owned();
    wal.push("-wal");
    scraped.wal_bytes = size(Path::new(&wal));
    let dir = database.parent().unwrap_or(Path::new("."));
    // The statvfs field types differ between platforms (u32 on some 32-bit ones).
    #[allow(clippy::unnecessary_cast)]
    if let Ok(fs) = nix::sys::statvfs::statvfs(dir) {
        let fragment = fs.fragment_size() as u64;
        scraped.filesystem_bytes = (fs.blocks() as u64).saturating_mul(fragment);
        scraped.filesystem_available_bytes =
            (fs.blocks_available() as u64).saturating_mul(fragment);
    }
}

/// Declares the metrics once: each field's type, its constructor when not the default,
/// its name (after the `opmon_` prefix) and its help; `Metrics::new` registers them in
/// this order.
macro_rules! metrics {
    ($($field:ident: $ty:ty $(= $init:expr)?, $name:literal, $help:expr;)*) => {
        pub struct Metrics {
            registry: Registry,
            /// When each snapshotter last answered anything (set by polls, read at scrape).
            last_answers: Mutex<HashMap<String, Instant>>,
            /// Setting the scrape-time gauges and encoding take turns.
            encoding: Mutex<()>,
            $($field: $ty,)*
        }

        impl Metrics {
            pub fn new() -> Arc<Metrics> {
                let mut registry = Registry::with_prefix("opmon");
                $(
                    let $field: $ty = or_default!($($init)?);
                    registry.register($name, $help, $field.clone());
                )*
                Arc::new(Metrics {
                    registry,
                    last_answers: Mutex::new(HashMap::new()),
                    encoding: Mutex::new(()),
                    $($field,)*
                })
            }
        }
    };
}

macro_rules! or_default {
    () => {
        Default::default()
    };
    ($init:expr) => {
        $init
    };
}

metrics! {
    owners: Family<PhaseLabel, Gauge>, "owners", "Backups and restores by phase";
    unfinished_operations: Gauge, "unfinished_operations", "Operations New or InProgress";
    poll_calls: Family<SnapshotterLabel, Counter>,
        "poll_calls", "Progress calls made, by snapshotter";
    poll_errors: Family<SnapshotterLabel, Counter>,
        "poll_errors", "Progress calls that failed, by snapshotter";
    poll_latency: HistogramFamily<SnapshotterLabel> =
        Family::new_with_constructor(latency_histogram),
        "poll_latency_seconds", "Time for one snapshotter to answer a chunk of progress calls";
    cancel_calls: Family<SnapshotterLabel, Counter>,
        "cancel_calls", "Cancel calls made, by snapshotter";
    cancel_errors: Family<SnapshotterLabel, Counter>,
        "cancel_errors",
        "Cancel calls that failed or were abandoned at the call deadline, by snapshotter";
    commit_batch_size: Histogram = Histogram::new(exponential_buckets(1.0, 2.0, 14)),
        "commit_batch_size", "Requests committed together in one transaction";
    commit_latency: Histogram = latency_histogram(),
        "commit_latency_seconds", "Time from BEGIN to a durable COMMIT";
    rpc_requests: Family<RpcLabels, Counter>,
        "rpc_requests", "JSON-RPC requests by method and result code (0 for success)";
    refused_connections: Counter,
        "refused_connections", "Connections refused by the peer credential check";
    operations_ended: Family<EndedLabels, Counter>,
        "operations_ended",
        concat!(
            "Operations that ended, by snapshotter and outcome ",
            "(completed, failed, canceled, timed_out, stalled)"
        );
    finalize_duration: Histogram = Histogram::new(exponential_buckets(0.01, 2.0, 21)),
        "finalize_duration_seconds", "Time one finalize took, from its start to its answer";
    snapshotter_up: Family<SnapshotterLabel, Gauge>,
        "snapshotter_up",
        "Whether the snapshotter answered its last calls (1) or could not be reached (0)";
    last_answer_age: Family<SnapshotterLabel, FloatGauge>,
        "snapshotter_last_answer_age_seconds", "Seconds since the snapshotter last answered a call";
    unfinished_by_snapshotter: Family<SnapshotterLabel, Gauge>,
        "snapshotter_unfinished_operations", "Operations New or InProgress, by snapshotter";
    oldest_unfinished_age: Family<SnapshotterLabel, FloatGauge>,
        "oldest_unfinished_operation_age_seconds",
        "Age of the oldest operation New or InProgress, by snapshotter";
    stalled_operations: Family<SnapshotterLabel, Gauge>,
        "stalled_operations",
        "Unfinished operations whose progress stood still for their stall deadline, by snapshotter";
    past_timeout_operations: Family<SnapshotterLabel, Gauge>,
        "operations_past_timeout",
        "Unfinished operations older than their item operation timeout, by snapshotter";
    unfinished_done_bytes: Family<SnapshotterLabel, Gauge>,
        "unfinished_done_bytes",
        "Bytes done by the unfinished operations counted in bytes, by snapshotter";
    unfinished_size_bytes: Family<SnapshotterLabel, Gauge>,
        "unfinished_size_bytes",
        "Bytes to do in all by the unfinished operations counted in bytes, by snapshotter";
    database_size_bytes: Gauge, "database_size_bytes", "Size of the SQLite database file";
    wal_size_bytes: Gauge, "database_wal_size_bytes", "Size of the database's write-ahead log";
    filesystem_size_bytes: Gauge,
        "database_filesystem_size_bytes", "Size of the file system holding the database";
    filesystem_available_bytes: Gauge,
        "database_filesystem_available_bytes",
        "Bytes still available to the agent on the file system holding the database";
}

impl Metrics {
    /// Records one chunk of progress calls to `snapshotter`.
    pub fn polled(&self, snapshotter_name: &str, calls: usize, errors: usize, took: Duration) {
        let label = snapshotter(snapshotter_name);
        self.poll_calls.get_or_create(&label).inc_by(calls as u64);
        self.poll_errors.get_or_create(&label).inc_by(errors as u64);
        self.poll_latency
            .get_or_create(&label)
            .observe(took.as_secs_f64());
    }

    /// Records whether `snapshotter` answered its last calls.
    pub fn reached(&self, snapshotter_name: &str, reached: bool) {
        self.snapshotter_up
            .get_or_create(&snapshotter(snapshotter_name))
            .set(i64::from(reached));
        if reached {
            lock(&self.last_answers).insert(snapshotter_name.to_string(), Instant::now());
        }
    }

    /// Records `calls` Cancel calls to `snapshotter`, `errors` of them failed or abandoned.
    pub fn cancelled(&self, snapshotter_name: &str, calls: usize, errors: usize) {
        let label = snapshotter(snapshotter_name);
        self.cancel_calls.get_or_create(&label).inc_by(calls as u64);
        self.cancel_errors
            .get_or_create(&label)
            .inc_by(errors as u64);
    }

    /// Counts an operation of `snapshotter` that ended with `outcome`.
    pub fn ended(&self, snapshotter_name: &str, outcome: Outcome) {
        self.operations_ended
            .get_or_create(&EndedLabels {
                snapshotter: label_value(snapshotter_name),
                outcome: outcome.as_str().to_string(),
            })
            .inc();
    }

    pub fn finalized(&self, took: Duration) {
        self.finalize_duration.observe(took.as_secs_f64());
    }

    pub fn committed(&self, size: usize, took: Duration) {
        self.commit_batch_size.observe(size as f64);
        self.commit_latency.observe(took.as_secs_f64());
    }

    pub fn refused(&self) {
        self.refused_connections.inc();
    }

    pub fn rpc(&self, method: &str, code: i32) {
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

    /// The page in the format `accept` prefers, with its content type; the gauges set
    /// from `status` and `scraped`.
    pub fn render(
        &self,
        status: &AgentStatus,
        scraped: &Scraped,
        accept: Option<&str>,
    ) -> (&'static str, String) {
        let _turn = lock(&self.encoding);
        self.set_gauges(status, scraped);
        let mut text = String::new();
        if let Err(e) = encode(&mut text, &self.registry) {
            tracing::warn!(error = %e, "encoding metrics failed");
        }
        if wants_openmetrics(accept) {
            (OPENMETRICS_CONTENT_TYPE, text)
        } else {
            (TEXT_CONTENT_TYPE, classic_text(&text))
        }
    }

    fn set_gauges(&self, status: &AgentStatus, scraped: &Scraped) {
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
        // The per-snapshotter sums, each read from an `Unfinished` by its gauge.
        type Read = fn(&Unfinished) -> u64;
        let sums: [(&Family<SnapshotterLabel, Gauge>, Read); 5] = [
            (&self.unfinished_by_snapshotter, |s| s.count),
            (&self.stalled_operations, |s| s.stalled),
            (&self.past_timeout_operations, |s| s.past_timeout),
            (&self.unfinished_done_bytes, |s| s.bytes_done),
            (&self.unfinished_size_bytes, |s| s.bytes_total),
        ];
        // Snapshotters with nothing unfinished any more drop out, not stay at their last
        // values.
        sums.iter().for_each(|(family, _)| family.clear());
        self.oldest_unfinished_age.clear();
        let now = UnixMs::now().0;
        let as_i64 = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        for (name, sum) in &scraped.snapshotters {
            let label = snapshotter(name);
            for (family, value) in &sums {
                family.get_or_create(&label).set(as_i64(value(sum)));
            }
            if let Some(oldest) = sum.oldest_created_ms {
                let age = now.saturating_sub(oldest).max(0) as f64 / 1000.0;
                self.oldest_unfinished_age.get_or_create(&label).set(age);
            }
        }
        for (name, at) in lock(&self.last_answers).iter() {
            self.last_answer_age
                .get_or_create(&snapshotter(name))
                .set(at.elapsed().as_secs_f64());
        }
        self.database_size_bytes.set(as_i64(scraped.database_bytes));
        self.wal_size_bytes.set(as_i64(scraped.wal_bytes));
        self.filesystem_size_bytes
            .set(as_i64(scraped.filesystem_bytes));
        self.filesystem_available_bytes
            .set(as_i64(scraped.filesystem_available_bytes));
    }
}

/// Whether `accept` (an HTTP `Accept` header) prefers OpenMetrics to the classic text
/// format: the media ranges' `q` values decide, OpenMetrics winning a tie (Prometheus
/// lists it first); without a header, or naming neither, the classic format.
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    let Some(accept) = accept else { return false };
    let (mut openmetrics, mut text) = (0.0f32, 0.0f32);
    for range in accept.split(',') {
        let mut parts = range.split(';').map(str::trim);
        let media = parts.next().unwrap_or("").to_ascii_lowercase();
        let q = parts
            .filter_map(|p| p.strip_prefix("q="))
            .find_map(|q| q.parse::<f32>().ok())
            .unwrap_or(1.0);
        match media.as_str() {
            "application/openmetrics-text" => openmetrics = openmetrics.max(q),
            "text/plain" => text = text.max(q),
            _ => {}
        }
    }
    openmetrics > 0.0 && openmetrics >= text
}

/// The classic text format (0.0.4) of an OpenMetrics page: a counter's family takes
/// its samples' `_total` name in `# HELP` and `# TYPE`, and the `# EOF` marker, which
/// the classic format does not have, goes.
fn classic_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len() + 16 * counters.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let described = ["# HELP ", "# TYPE "].into_iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        });
        match described {
            Some(line) => out.push_str(&line),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status() -> AgentStatus {
        AgentStatus {
            version: "test".into(),
            uptime: opmon_client::GoDuration::from_secs(1),
            owners: Default::default(),
            unfinished_operations: 0,
            snapshotters: 1,
            api_version: String::new(),
            features: Vec::new(),
        }
    }

    #[test]
    fn snapshotter_names_with_quotes_and_backslashes_stay_one_label_value() {
        let metrics = Metrics::new();
        metrics.polled(r#"example.io/a"b\c"#, 3, 1, Duration::from_millis(5));
        metrics.cancelled(r#"example.io/a"b\c"#, 1, 0);
        let (_, page) = metrics.render(&status(), &Scraped::default(), None);
        for line in [
            r#"opmon_poll_calls_total{snapshotter="example.io/a\"b\\c"} 3"#,
            r#"opmon_cancel_calls_total{snapshotter="example.io/a\"b\\c"} 1"#,
        ] {
            assert!(page.lines().any(|l| l == line), "{line} in {page}");
        }
    }

    /// Prometheus 2.42's own header, and what curl or a browser sends.
    #[test]
    fn the_format_follows_the_accept_header_q_values() {
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(wants_openmetrics(Some(prometheus)));
        assert!(!wants_openmetrics(None));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(!wants_openmetrics(Some("text/plain;version=0.0.4")));
        assert!(!wants_openmetrics(Some(
            "application/openmetrics-text;q=0.2, text/plain;q=0.9"
        )));
        assert!(!wants_openmetrics(Some("application/openmetrics-text;q=0")));
    }

    /// Each format names a counter's family as its content type expects: OpenMetrics
    /// without `_total` and with `# EOF`, the classic format with it and without.
    #[test]
    fn each_format_names_counters_as_its_content_type_expects() {
        let metrics = Metrics::new();
        metrics.polled("example.io/x", 2, 0, Duration::from_millis(5));
        let (kind, open) = metrics.render(
            &status(),
            &Scraped::default(),
            Some("application/openmetrics-text"),
        );
        assert_eq!(kind, OPENMETRICS_CONTENT_TYPE);
        assert!(open.contains("# TYPE opmon_poll_calls counter\n"), "{open}");
        assert!(open.ends_with("# EOF\n"), "{open}");
        let (kind, classic) = metrics.render(&status(), &Scraped::default(), None);
        assert_eq!(kind, TEXT_CONTENT_TYPE);
        assert!(
            classic.contains("# TYPE opmon_poll_calls_total counter\n"),
            "{classic}"
        );
        assert!(
            classic.contains("# HELP opmon_poll_calls_total "),
            "{classic}"
        );
        assert!(
            classic.contains("opmon_poll_calls_total{snapshotter=\"example.io/x\"} 2\n"),
            "{classic}"
        );
        assert!(!classic.contains("# EOF"), "{classic}");
        assert!(
            classic.contains("# TYPE opmon_poll_latency_seconds histogram\n"),
            "{classic}"
        );
    }
}
