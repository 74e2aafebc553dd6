//! One budget per peer: what a peer uid may make the agent hold, counted against quotas
//! set in one place (the `max_*_per_uid` settings), and the totals that need
//! descriptors or tasks derived from what the process may open and start.
//!
//! Invariants:
//! - Connections, calls in flight, finalizes and snapshotter registrations are each a
//!   [`Budget`] (the SDK's, which the server shares): a quota per uid, of which root and
//!   the agent's own keep a quarter of the total and one other uid takes at most a
//!   quarter of the others' share; subscriptions a [`PerUid`] quota.
//! - Totals that need descriptors (connections, registered snapshotters' connections,
//!   finalizes' files) add up to less than the descriptor limit, with [`OWN_DESCRIPTORS`]
//!   left for the database and the log: no combination of quotas runs the descriptors
//!   out.
//! - Likewise for tasks (processes and threads, bounded by `RLIMIT_NPROC` and the
//!   cgroup's `pids.max`): after the agent's own threads, snapshotters registered over
//!   the API may cause at most three quarters of what is left, the config file's keep
//!   the rest, and every command process first takes one of [`Totals::processes`]
//!   places, so that a full limit makes a command wait rather than another's fork fail.

pub use opmon_snapshotter::budget::{is_operator, Budget, Charge, Held, PerUid};

/// Descriptors kept for the agent's own work: the database and its WAL, the pool of
/// readers, the listener, the log.
pub const OWN_DESCRIPTORS: u64 = 128;

/// Descriptors one finalize may hold at once: its input, the output's directory and its
/// temporary file, and the item-operations file it writes.
pub const FINALIZE_DESCRIPTORS: u64 = 4;

/// Threads of the runtime's blocking pool (database reads, file work): bounded so that
/// the agent's own tasks are known.
pub const BLOCKING_THREADS: usize = 64;

/// Tasks one command process is counted as: itself and a program it starts (a shell
/// running a command).
pub const TASKS_PER_COMMAND: u64 = 2;

/// Tasks a Velero plugin binary is counted as: a Go program's runtime threads.
pub const TASKS_PER_VELERO_PLUGIN: u64 = 16;

/// Threads one finalize may hold: its job's, the rewrite's compressing threads (at
/// most 4) and one stuck past its deadline.
pub const FINALIZE_TASKS: u64 = 6;

/// Tasks kept for the agent's own threads apart from finalizes': the runtime's workers
/// and blocking pool, the database writer, the log.
pub fn own_tasks() -> u64 {
    let workers = std::thread::available_parallelism().map_or(4, |n| n.get());
    (32 + BLOCKING_THREADS + workers) as u64
}

/// How many tasks (processes and threads) the agent's user may have at once, if
/// anything bounds it: `RLIMIT_NPROC` (which does not bind root) and the `pids.max` of
/// the agent's cgroup (systemd's `TasksMax=`), whichever is lower.
pub fn task_limit() -> Option<u64> {
    use nix::sys::resource::{getrlimit, Resource};
    let nproc = match getrlimit(Resource::RLIMIT_NPROC) {
        Ok((soft, _)) if !nix::unistd::geteuid().is_root() && soft != nix::libc::RLIM_INFINITY => {
            Some(soft)
        }
        _ => None,
    };
    [nproc, cgroup_pids_max()].into_iter().flatten().min()
}

/// The `pids.max` of the cgroup (v2) the agent runs in, or of the nearest ancestor
/// that sets one, if the file system shows it.
fn cgroup_pids_max() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    // cgroup v2: the line `0::/PATH`.
    let path = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    let mut dir = std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    let mut lowest: Option<u64> = None;
    loop {
        if let Ok(text) = std::fs::read_to_string(dir.join("pids.max")) {
            if let Ok(n) = text.trim().parse::<u64>() {
                lowest = Some(lowest.map_or(n, |l| l.min(n)));
            }
        }
        if dir == std::path::Path::new("/sys/fs/cgroup") || !dir.pop() {
            return lowest;
        }
    }
}

/// Raises the soft limit on open files to the hard limit, and returns the soft limit in
/// force (the hard one if raising failed, which cannot happen for an unprivileged raise
/// up to the hard limit).
pub fn raise_open_files() -> u64 {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(e) => {
                tracing::warn!(soft, hard, error = %e, "raising the open-file limit failed");
                soft
            }
        },
        Ok((soft, _)) => soft,
        Err(e) => {
            tracing::warn!(error = %e, "reading the open-file limit failed; assuming 1024");
            1024
        }
    }
}

/// What bounds the agent, read at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Files the agent may open.
    pub descriptors: u64,
    /// Tasks its user or cgroup may have, if bounded.
    pub tasks: Option<u64>,
    /// Tasks kept for its own threads, apart from finalizes' ([`FINALIZE_TASKS`] each).
    pub own_tasks: u64,
}

/// What one snapshotter registered over the API may hold while polled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PerSnapshotter {
    pub descriptors: usize,
    /// 0 when the API may not register snapshotters that run programs.
    pub tasks: u64,
}

/// Totals derived from the descriptor and task limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Totals {
    /// Connections served at once, over all peers.
    pub connections: u32,
    /// Snapshotters registered over the API at once, over all peers (each may hold
    /// `per_snapshotter` descriptors while polled).
    pub snapshotters: usize,
    /// Finalizes running or waiting at once, over all peers (each may hold
    /// [`FINALIZE_DESCRIPTORS`]).
    pub finalizes: usize,
    /// Command processes running at once over all snapshotters, config file's included
    /// (`None`: nothing bounds tasks).
    pub processes: Option<usize>,
}

impl Totals {
    /// Of the descriptors left after [`OWN_DESCRIPTORS`]: up to a quarter to finalizes
    /// (at most `max_finalizes`), a quarter of the rest to snapshotters, the rest to
    /// connections (at most `max_connections`). Of the tasks left after the agent's
    /// own and its finalizes': three quarters to snapshotters registered over the API, which bounds their
    /// number too, and all of them in places of [`TASKS_PER_COMMAND`] to command
    /// processes.
    pub fn of(
        limits: Limits,
        per_snapshotter: PerSnapshotter,
        max_connections: u32,
        max_finalizes: usize,
    ) -> Totals {
        let free = limits.descriptors.saturating_sub(OWN_DESCRIPTORS).max(16);
        let finalizes = (free / 4 / FINALIZE_DESCRIPTORS).clamp(1, max_finalizes.max(1) as u64);
        let free = free - finalizes * FINALIZE_DESCRIPTORS;
        let for_snapshotters = free / 4;
        let per = per_snapshotter.descriptors.max(1) as u64;
        let mut snapshotters = (for_snapshotters / per).max(1);
        let own_tasks = limits.own_tasks + finalizes * FINALIZE_TASKS;
        let tasks = limits
            .tasks
            .map(|t| t.saturating_sub(own_tasks).max(TASKS_PER_VELERO_PLUGIN));
        if let (Some(tasks), 1..) = (tasks, per_snapshotter.tasks) {
            snapshotters = snapshotters.min((tasks / 4 * 3 / per_snapshotter.tasks).max(1));
        }
        Totals {
            connections: (free - for_snapshotters).min(u64::from(max_connections)) as u32,
            snapshotters: snapshotters as usize,
            finalizes: finalizes as usize,
            processes: tasks.map(|t| (t / TASKS_PER_COMMAND).max(1) as usize),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(descriptors: u64, tasks: Option<u64>) -> Limits {
        Limits {
            descriptors,
            tasks,
            own_tasks: 100,
        }
    }

    #[test]
    fn totals_leave_the_agents_own_descriptors() {
        let per = PerSnapshotter {
            descriptors: 4,
            tasks: 0,
        };
        let t = Totals::of(limits(1024, Some(500)), per, 4096, 64);
        assert_eq!((t.connections, t.snapshotters, t.finalizes), (504, 42, 56));
        let used = u64::from(t.connections)
            + t.snapshotters as u64 * 4
            + t.finalizes as u64 * FINALIZE_DESCRIPTORS
            + OWN_DESCRIPTORS;
        assert!(used <= 1024, "{used}");
        let t = Totals::of(limits(1 << 20, None), per, 4096, 64);
        assert_eq!((t.connections, t.finalizes, t.processes), (4096, 64, None));
    }

    #[test]
    fn api_snapshotters_processes_leave_the_agents_threads_and_a_quarter() {
        let per = PerSnapshotter {
            descriptors: 24,
            tasks: 16,
        };
        // The shipped unit: 65,536 descriptors alone would allow 678 snapshotters.
        let t = Totals::of(limits(65536, Some(4096)), per, 4096, 64);
        assert_eq!((t.snapshotters, t.processes), (169, Some(1806)));
        assert!(t.snapshotters as u64 * 16 <= (4096 - 100 - 64 * FINALIZE_TASKS) / 4 * 3);
        let t = Totals::of(limits(65536, None), per, 4096, 64);
        assert_eq!(t.snapshotters, 678);
    }
}
