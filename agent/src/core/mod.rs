//! The core: decides and commits. It receives typed, validated requests from the API
//! layer (never JSON), asks the phase machine what follows, commits through the store,
//! then tells waiters. Nothing here reaches back into the API layer.

mod cancel;
mod expiry;
mod finalize;
mod hints;
mod name_locks;
mod owners;
mod poll;
mod records;
mod server;
mod snapshotters;
mod subscribe;

pub use finalize::FinalizeSettings;
pub use subscribe::OwnerStream;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use opmon_client::{methods, AgentStatus, GoDuration, OwnerKind};
use rusqlite::Connection;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::changes::Changes;
use crate::clock::UnixMs;
use crate::error::{Error, NotFound};
use crate::metrics::Metrics;
use crate::remote::CallSettings;
use crate::storage_dir::StorageDir;
use crate::store::queries::{self, OwnerRow};
use crate::store::Store;

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
    /// Whether `snapshotter.register` may register a command (which runs a program of
    /// the client's choosing as the agent's user). Commands in the config file always work.
    pub allow_api_command_snapshotters: bool,
    pub calls: CallSettings,
    /// Whether restores started without `finalize` pass through Finalizing (as every
    /// restore does from Velero 1.14 on).
    pub restore_finalize: bool,
    /// InProgress owners with no call from their server for this long fail; `None`: never.
    pub in_progress_idle_timeout: Option<Duration>,
    pub finalize: FinalizeSettings,
    /// Bytes held for all peers together (`max_held_bytes`): what the server holds for
    /// them and their snapshotters' answers being read.
    pub max_held_bytes: u64,
}

pub struct Core {
    store: Arc<Store>,
    storage: StorageDir,
    metrics: Arc<Metrics>,
    /// Item-operations files written whose marks are still to be cleared.
    records_written: records::WrittenMarks,
    /// Serialises the file work on one owner's files (by kind and name): a write, a
    /// removal, and the database reads that decide them.
    name_locks: name_locks::NameLocks,
    /// Background jobs running now, so a tick does not start a second one.
    retrying_records: AtomicBool,
    expiring: AtomicBool,
    settings: CoreSettings,
    /// Asks the snapshotters; owns what polling remembers between passes.
    poller: poll::Poller,
    changes: Changes,
    /// Wakes the poller before its next tick (after a restart, for instance).
    poll_now: Notify,
    /// Snapshotters' hints waiting for their poll.
    hints: hints::Hints,
    /// Snapshotters registered over the API ([`crate::caps::SNAPSHOTTERS`]).
    registrations: snapshotters::Registrations,
    /// Subscriptions held ([`crate::caps::SUBSCRIPTIONS`]).
    subscriptions: crate::caps::Cap,
    sweeps: TaskTracker,
    stopping: CancellationToken,
    /// Cancelled at SIGTERM, before in-flight requests are waited for: waits answer at
    /// once and file work stops.
    requests_stopping: CancellationToken,
    started: Instant,
    /// Finalize's confinement, file-work threads and per-owner turns.
    finalizer: finalize::Finalizer,
    /// When this agent started: the idle timeout does not count time before.
    started_at: UnixMs,
    /// The total of bytes held for peers, which the server and snapshotters' answers
    /// draw from.
    held_bytes: crate::caps::Cap,
}

/// Clears `flag` when dropped: a background job's "running" mark, reset however the job
/// ends.
struct Running<'a>(&'a AtomicBool);

impl<'a> Running<'a> {
    /// Marks the job running; `None` if it already was.
    fn start(flag: &'a AtomicBool) -> Option<Running<'a>> {
        (!flag.swap(true, Ordering::SeqCst)).then_some(Running(flag))
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// `n` and `noun`, plural unless `n` is 1: "1 operation", "2 operations".
pub(crate) fn counted(n: impl Into<u64>, noun: &str) -> String {
    let n = n.into();
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// Why a command snapshotter not in the config file is not run.
fn command_refusal(name: &str) -> String {
    format!(
        "snapshotter {name} runs a command, which only the config file may register \
         (allow_api_command_snapshotters is false)"
    )
}

/// The owner `kind` `name`, or the error that says it does not exist.
fn require(conn: &Connection, kind: OwnerKind, name: &str) -> Result<OwnerRow, Error> {
    queries::owner_by_name(conn, kind, name)?
        .ok_or_else(|| Error::NotFound(NotFound::Owner(kind, name.to_string())))
}

/// The owner `kind` `name` of `uid`, current or retired; without `uid`, the name's
/// current owner ([`require`]).
fn require_owner(
    conn: &Connection,
    kind: OwnerKind,
    name: &str,
    uid: Option<&str>,
) -> Result<OwnerRow, Error> {
    let Some(uid) = uid else {
        return require(conn, kind, name);
    };
    queries::owner_by_uid(conn, kind, name, uid)?.ok_or_else(|| {
        Error::NotFound(NotFound::OwnerOfUid(
            kind,
            name.to_string(),
            uid.to_string(),
        ))
    })
}

impl Core {
    /// Builds the core on an open store and loads the registered snapshotters.
    pub async fn new(
        store: Arc<Store>,
        storage: StorageDir,
        metrics: Arc<Metrics>,
        settings: CoreSettings,
    ) -> Result<Arc<Core>, Error> {
        let finalizer = finalize::Finalizer::new(storage.root(), &settings.finalize);
        let held_bytes = crate::caps::Cap::new(
            "bytes held for peers",
            usize::try_from(settings.max_held_bytes).unwrap_or(usize::MAX),
        );
        let poller = poll::Poller::new(
            settings.calls.clone(),
            settings.unreachable_grace,
            metrics.clone(),
            held_bytes.clone(),
        );
        let core = Arc::new(Core {
            store,
            storage,
            metrics,
            records_written: records::WrittenMarks::default(),
            name_locks: name_locks::NameLocks::default(),
            retrying_records: AtomicBool::new(false),
            expiring: AtomicBool::new(false),
            settings,
            poller,
            changes: Changes::default(),
            poll_now: Notify::new(),
            hints: hints::Hints::default(),
            registrations: snapshotters::Registrations::default(),
            subscriptions: crate::caps::Cap::new("subscriptions", crate::caps::SUBSCRIPTIONS),
            sweeps: TaskTracker::new(),
            stopping: CancellationToken::new(),
            requests_stopping: CancellationToken::new(),
            started: Instant::now(),
            started_at: UnixMs::now(),
            finalizer,
            held_bytes,
        });
        let registered = core
            .store
            .read(|conn| queries::snapshotters(conn).map_err(Error::from))
            .await?;
        for s in &registered {
            if (s.command.is_some() || s.velero_plugin.is_some())
                && !core.settings.allow_api_command_snapshotters
            {
                // Registered over the API before the setting was off, or by a config
                // file that no longer has it: the config file registers its own again
                // right after this.
                core.poller
                    .remotes
                    .refuse(&s.name, command_refusal(&s.name));
            } else {
                core.poller.remotes.insert(s, &core.settings.calls);
            }
        }
        Ok(core)
    }

    /// Takes one of the subscriptions all peers may hold, given back when dropped.
    pub fn take_subscription(&self) -> Result<crate::caps::Held, Error> {
        self.subscriptions.take().map_err(Error::OverQuota)
    }

    /// `agent.status`.
    pub async fn status(&self) -> Result<AgentStatus, Error> {
        let (owners, unfinished) = self.store.counts().await?;
        Ok(AgentStatus {
            version: env!("CARGO_PKG_VERSION").to_string(),
            uptime: GoDuration(Duration::from_secs(self.started.elapsed().as_secs())),
            owners,
            unfinished_operations: unfinished,
            snapshotters: self.poller.remotes.count() as u64,
            api_version: methods::API_VERSION.to_string(),
            features: methods::FEATURES.iter().map(|f| f.to_string()).collect(),
        })
    }

    /// The metrics page in the format `accept` asks for: counters plus gauges read now.
    pub async fn metrics_page(&self, accept: Option<&str>) -> (&'static str, String) {
        let now = UnixMs::now();
        let read = async {
            let status = self.status().await?;
            let unfinished = self
                .store
                .read(move |conn| {
                    crate::metrics::unfinished_by_snapshotter(conn, now).map_err(Error::from)
                })
                .await?;
            Ok::<_, Error>((status, unfinished))
        };
        match read.await {
            Ok((status, snapshotters)) => {
                let mut scraped = crate::metrics::Scraped {
                    snapshotters,
                    ..Default::default()
                };
                crate::metrics::file_sizes(self.store.path(), &mut scraped);
                self.metrics.render(&status, &scraped, accept)
            }
            Err(e) => (
                crate::metrics::TEXT_CONTENT_TYPE,
                format!("# metrics unavailable: {e}\n"),
            ),
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
        self.sweeps.spawn(self.clone().poll_hinted());
        loop {
            tokio::select! {
                _ = self.stopping.cancelled() => break,
                _ = poll.tick() => {
                    self.spawn_records_retry();
                    self.fail_idle().await;
                    self.sweep().await;
                }
                _ = self.poll_now.notified() => self.sweep().await,
                _ = feed.tick() => self.report_status(watchdog).await,
                // Off this loop: a large expiry must not hold up polls or the watchdog.
                _ = retention.tick() => self.spawn_expiry(),
            }
        }
        self.sweeps.close();
        self.sweeps.wait().await;
        self.flush_records_written().await;
    }

    /// The total of bytes held for peers (`max_held_bytes`), for the server to draw on.
    pub fn held_bytes(&self) -> crate::caps::Cap {
        self.held_bytes.clone()
    }

    /// Stops the background work; sweeps in flight are abandoned before they commit.
    pub fn stop(&self) {
        self.stopping.cancel();
        self.finalizer.stop();
    }

    /// Ends what in-flight requests wait for (at SIGTERM, before they are waited for):
    /// waits answer at once with what they have seen, and finalize's running rewrites
    /// end, their temporary files removed and their calls unanswered.
    pub fn stop_requests(&self) {
        self.requests_stopping.cancel();
        self.finalizer.stop();
    }
}
