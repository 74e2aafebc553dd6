//! The agent's global caps: what all its peers together may make it hold. Who may
//! connect is decided before (socket mode, `allowed_uids`/`allowed_gids`); an allowed
//! peer is trusted with the agent's availability (docs/trust.md), so these bound the
//! agent, not one peer against another.
//!
//! Invariants:
//! - Every cap is one fixed number over all peers. The one per-uid bound is on
//!   connections (`max_connections_per_uid`, see `access.rs`).
//! - What the caps may need together stays within [`DESCRIPTORS`] open files and
//!   [`TASKS`] tasks; the service manager bounds the process (`LimitNOFILE=`,
//!   `TasksMax=`, `MemoryMax=` in the unit), and [`check_limits`] warns at start when
//!   its limits are lower than that.
//! - A unit is taken at once or refused ([`Cap::take`], for what is refused: a
//!   finalize, a subscription) or waited for ([`Cap::acquire_many`], for what waits: a
//!   call); either way it is given back when its [`Held`] is dropped.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Connections served at once, besides root's and the agent's own uid's (each of those
/// bounded by `max_connections_per_uid` only), so that the operator can always connect.
pub const CONNECTIONS: usize = 4096;
/// Calls running at once (methods that mostly wait aside).
pub const CALLS: usize = 64;
/// Listings and subscription updates being made at once.
pub const LISTINGS: usize = 4;
/// Subscriptions held at once (and 1,024 on one connection).
pub const SUBSCRIPTIONS: usize = 16384;
/// Snapshotters registered over the API (the config file's are not counted).
pub const SNAPSHOTTERS: usize = 256;
/// Finalizes running or waiting at once.
pub const FINALIZES: usize = 64;
/// Command snapshotters' processes running at once.
pub const PROCESSES: usize = 1024;

/// Descriptors the agent keeps for its own work: the database, its WAL and readers, the
/// listener, the log.
const OWN_DESCRIPTORS: u64 = 128;
/// Descriptors a snapshotter may hold while polled (kept-alive connections, or pipes).
const SNAPSHOTTER_DESCRIPTORS: u64 = 24;
/// Descriptors a finalize may hold: input, output directory, temporary file, record.
const FINALIZE_DESCRIPTORS: u64 = 4;

/// Open files every cap full at once would need.
pub const DESCRIPTORS: u64 = OWN_DESCRIPTORS
    + CONNECTIONS as u64
    + SNAPSHOTTERS as u64 * SNAPSHOTTER_DESCRIPTORS
    + FINALIZES as u64 * FINALIZE_DESCRIPTORS
    + PROCESSES as u64 * 3;

/// Threads of the runtime's blocking pool (database reads, file work).
pub const BLOCKING_THREADS: usize = 64;

/// Tasks every cap full at once would need: the runtime's threads, each command process
/// and a program it starts, each finalize's compressing threads.
pub const TASKS: u64 = 64 + BLOCKING_THREADS as u64 + PROCESSES as u64 * 2 + FINALIZES as u64 * 6;

/// Raises the soft open-file limit to the hard one, and warns once when the limits
/// (open files, or tasks: `RLIMIT_NPROC` unless root, the cgroup's `pids.max`) are lower
/// than the caps need: the agent then refuses or fails earlier than its caps say.
pub fn check_limits() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let descriptors = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(_) => soft,
        },
        Ok((soft, _)) => soft,
        Err(_) => 0,
    };
    if descriptors < DESCRIPTORS {
        tracing::warn!(
            descriptors,
            needed = DESCRIPTORS,
            "the agent may open fewer files than its caps need: with many peers, \
             connections and finalizes fail with \"too many open files\"; raise the limit \
             (LimitNOFILE= in the unit, ulimit -n)"
        );
    }
    let nproc = match getrlimit(Resource::RLIMIT_NPROC) {
        Ok((soft, _)) if !nix::unistd::geteuid().is_root() && soft != nix::libc::RLIM_INFINITY => {
            Some(soft)
        }
        _ => None,
    };
    if let Some(tasks) = [nproc, cgroup_pids_max()].into_iter().flatten().min() {
        if tasks < TASKS {
            tracing::warn!(
                tasks,
                needed = TASKS,
                "the agent may have fewer tasks than its caps need: with many command \
                 snapshotters, processes fail to start; raise the limit (TasksMax= in the \
                 unit, ulimit -u)"
            );
        }
    }
}

/// The `pids.max` of the agent's cgroup (v2), or of the nearest ancestor that sets one.
fn cgroup_pids_max() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    let root = std::path::Path::new("/sys/fs/cgroup");
    let mut dir = root.join(path.trim_start_matches('/'));
    let mut lowest: Option<u64> = None;
    loop {
        if let Ok(n) = std::fs::read_to_string(dir.join("pids.max"))
            .unwrap_or_default()
            .trim()
            .parse::<u64>()
        {
            lowest = Some(lowest.map_or(n, |l| l.min(n)));
        }
        if dir == root || !dir.pop() {
            return lowest;
        }
    }
}

/// One global cap: at most `total` units of `what` held at once over all peers.
#[derive(Clone)]
pub struct Cap {
    what: &'static str,
    units: Arc<Semaphore>,
    total: usize,
}

/// Units of a [`Cap`] held, given back on drop.
#[derive(Debug)]
pub struct Held(Option<OwnedSemaphorePermit>);

impl Held {
    /// Units held.
    pub fn units(&self) -> usize {
        self.0.as_ref().map_or(0, OwnedSemaphorePermit::num_permits)
    }

    /// Gives back all but `keep` units.
    pub fn shrink(&mut self, keep: usize) {
        if let Some(permit) = self.0.as_mut() {
            drop(permit.split(permit.num_permits().saturating_sub(keep)));
        }
    }
}

impl Cap {
    /// At most `total` units of `what` (plural: "finalizes").
    pub fn new(what: &'static str, total: usize) -> Cap {
        let total = total.clamp(1, Semaphore::MAX_PERMITS);
        Cap {
            what,
            units: Arc::new(Semaphore::new(total)),
            total,
        }
    }

    /// Takes one unit now, or says that all are held.
    pub fn take(&self) -> Result<Held, String> {
        self.take_many(1)
    }

    /// Takes `n` units now, or says that there are not so many free.
    pub fn take_many(&self, n: u32) -> Result<Held, String> {
        self.units
            .clone()
            .try_acquire_many_owned(n)
            .map(|p| Held(Some(p)))
            .map_err(|_| {
                format!(
                    "{} of the {} {} the agent holds at once for all its peers are held; try \
                     again later",
                    self.held(),
                    self.total,
                    self.what
                )
            })
    }

    /// Takes as many of `n` units as are free now (perhaps none).
    pub fn take_up_to(&self, n: u32) -> Held {
        let free = u32::try_from(self.units.available_permits()).unwrap_or(u32::MAX);
        // Another may take what was free between the look and the take: then none.
        self.take_many(n.min(free).max(1)).unwrap_or(Held(None))
    }

    /// Takes `n` units (at most the total) once they are free.
    pub async fn acquire_many(&self, n: u32) -> Held {
        let n = n.min(u32::try_from(self.total).unwrap_or(u32::MAX));
        Held(self.units.clone().acquire_many_owned(n).await.ok())
    }

    /// The most that may ever be held.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Units held now.
    pub fn held(&self) -> usize {
        self.total - self.units.available_permits()
    }
}
