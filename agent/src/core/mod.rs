//! The core: decides and commits. It receives typed, validated requests from the API
//! layer (never JSON), asks the phase machine what follows, commits through the store,
//! then tells waiters. Nothing here reaches back into the API layer.

mod finalize;
mod owners;
mod poll;
mod records;
mod snapshotters;
mod subscribe;
mod tally;

pub use finalize::FinalizeSettings;
pub use subscribe::OwnerStream;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opmon_client::{AgentStatus, GoDuration, OwnerKind};
use time::OffsetDateTime;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::changes::Changes;
use crate::error::Error;
use crate::metrics::Metrics;
use crate::remote::{CallSettings, Registry};
use crate::storage::Storage;
use crate::store::{queries, Store};

/// What the core needs to know from the configuration.
#[derive(Clone, Debug)]
pub struct CoreSettings {
    pub poll_interval: Duration,
    pub default_item_operation_timeout: GoDuration,
    pub retention: Duration,
    /// Largest decompressed size of a tarball `finalize` reads.
    pub max_decompressed_size: u64,
    /// How long a snapshotter may be unreachable before its operations fail.
    pub unreachable_grace: Duration,
    pub calls: CallSettings,
    pub finalize: FinalizeSettings,
}

pub struct Core {
    store: Arc<Store>,
    storage: Storage,
    metrics: Arc<Metrics>,
    /// Owners whose item-operations file failed to write; retried each poll tick.
    records_pending: Mutex<BTreeSet<(OwnerKind, String)>>,
    settings: CoreSettings,
    remotes: Registry,
    changes: Changes,
    /// Wakes the poller before its next tick (after a restart, for instance).
    poll_now: Notify,
    /// Since when (Unix ms) each unreachable snapshotter, by plugin name, has been so.
    unreachable: Mutex<HashMap<String, i64>>,
    /// `agent.status`'s counts between commits.
    tally: Mutex<tally::Tally>,
    /// Plugins whose sweep is still running; the next tick skips them.
    sweeping: Mutex<HashSet<String>>,
    sweeps: TaskTracker,
    stopping: CancellationToken,
    started: Instant,
    /// Finalize's confinement, file-work threads and per-owner turns.
    finalizer: finalize::Finalizer,
}

/// The current time in Unix milliseconds: the one place the core reads the clock.
fn now_ms() -> i64 {
    queries::ms_of(OffsetDateTime::now_utc())
}

impl Core {
    /// Builds the core on an open store and loads the registered snapshotters.
    pub async fn new(
        store: Arc<Store>,
        storage: Storage,
        metrics: Arc<Metrics>,
        settings: CoreSettings,
    ) -> Result<Arc<Core>, Error> {
        let finalizer = finalize::Finalizer::new(storage.root(), &settings.finalize);
        let core = Arc::new(Core {
            store,
            storage,
            metrics,
            records_pending: Mutex::new(BTreeSet::new()),
            settings,
            remotes: Registry::default(),
            changes: Changes::default(),
            poll_now: Notify::new(),
            tally: Mutex::default(),
            sweeping: Mutex::new(HashSet::new()),
            unreachable: Mutex::new(HashMap::new()),
            sweeps: TaskTracker::new(),
            stopping: CancellationToken::new(),
            started: Instant::now(),
            finalizer,
        });
        let registered = core
            .store
            .read(|conn| queries::snapshotters(conn).map_err(Error::from))
            .await?;
        for s in &registered {
            core.remotes.insert(s, &core.settings.calls);
        }
        Ok(core)
    }

    /// `agent.status`.
    pub async fn status(&self) -> Result<AgentStatus, Error> {
        let (owners, unfinished) = self.counts().await?;
        Ok(AgentStatus {
            version: env!("CARGO_PKG_VERSION").to_string(),
            uptime: GoDuration(Duration::from_secs(self.started.elapsed().as_secs())),
            owners,
            unfinished_operations: unfinished,
            snapshotters: self.remotes.count() as u64,
        })
    }

    /// The metrics page: counters plus gauges read now.
    pub async fn metrics_page(&self) -> String {
        match self.status().await {
            Ok(status) => self.metrics.render(&status),
            Err(e) => format!("# metrics unavailable: {e}\n"),
        }
    }

    /// Tells systemd (when it asked, through `NOTIFY_SOCKET`) how things stand.
    async fn report_status(&self, watchdog: bool) {
        let status = match self.status().await {
            Ok(s) => {
                let waiting: u64 = s
                    .owners
                    .iter()
                    .filter(|(phase, _)| phase.is_waiting())
                    .map(|(_, n)| n)
                    .sum();
                format!(
                    "{waiting} backups/restores waiting, {} unfinished operations, {} snapshotters",
                    s.unfinished_operations, s.snapshotters
                )
            }
            Err(e) => format!("status unavailable: {e}"),
        };
        let mut states = vec![sd_notify::NotifyState::Status(&status)];
        if watchdog {
            states.push(sd_notify::NotifyState::Watchdog);
        }
        if let Err(e) = sd_notify::notify(false, &states) {
            tracing::debug!(error = %e, "notifying systemd failed");
        }
    }

    /// Runs the periodic work (polling, retention, systemd watchdog) until
    /// [`Core::stop`]. The watchdog is fed from this loop, so a stalled poller stops
    /// feeding it and systemd restarts the agent.
    pub async fn run_background(self: &Arc<Self>) {
        let mut watchdog_usec = 0;
        // Unset, so snapshotter commands do not inherit the watchdog variables.
        let watchdog = sd_notify::watchdog_enabled(true, &mut watchdog_usec);
        let mut feed = tokio::time::interval(if watchdog {
            Duration::from_micros(watchdog_usec / 2).max(Duration::from_millis(10))
        } else {
            Duration::from_secs(30)
        });
        feed.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut poll = tokio::time::interval(self.settings.poll_interval);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Retention is checked hourly, or more often when the retention itself is short.
        let retention_every = (self.settings.retention / 24)
            .clamp(Duration::from_millis(100), Duration::from_secs(3600));
        let mut retention = tokio::time::interval(retention_every);
        retention.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = self.stopping.cancelled() => break,
                _ = poll.tick() => {
                    self.retry_records().await;
                    self.sweep().await;
                }
                _ = self.poll_now.notified() => self.sweep().await,
                _ = feed.tick() => self.report_status(watchdog).await,
                _ = retention.tick() => {
                    if let Err(e) = self.expire().await {
                        tracing::warn!(error = %e, "removing expired owners failed");
                    }
                }
            }
        }
        self.sweeps.close();
        self.sweeps.wait().await;
    }

    /// Stops the background work; sweeps in flight are abandoned before they commit.
    pub fn stop(&self) {
        self.stopping.cancel();
        self.finalizer.stop();
    }

    /// Stops finalize's file work at once (at SIGTERM, before in-flight requests are
    /// waited for): running rewrites end and their temporary files are removed.
    pub fn stop_file_work(&self) {
        self.finalizer.stop();
    }

    /// Removes terminal owners older than the retention period, with their files.
    pub async fn expire(&self) -> Result<usize, Error> {
        let before = now_ms() - self.settings.retention.as_millis().min(i64::MAX as u128) as i64;
        let removed = self
            .write(move |conn| queries::delete_expired(conn, before).map_err(Error::from))
            .await?;
        for (kind, name) in &removed {
            tracing::info!(%kind, owner = %name, "removed: past the retention period");
            if let Err(e) = self.storage.remove_owner(*kind, name) {
                tracing::warn!(%kind, owner = %name, error = %e, "removing its files failed");
            }
        }
        Ok(removed.len())
    }
}
