//! One budget per peer: what a peer uid may make the agent hold, counted against quotas
//! set in one place (the `max_*_per_uid` settings), and the totals that need
//! descriptors derived from what the process may open.
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

pub use opmon_snapshotter::budget::{is_operator, Budget, Charge, Held, PerUid};

/// Descriptors kept for the agent's own work: the database and its WAL, the pool of
/// readers, the listener, the log.
pub const OWN_DESCRIPTORS: u64 = 128;

/// Descriptors one finalize may hold at once: its input, the output's directory and its
/// temporary file, and the item-operations file it writes.
pub const FINALIZE_DESCRIPTORS: u64 = 4;

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

/// Totals derived from the descriptor limit.
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
}

impl Totals {
    /// Of what is left after [`OWN_DESCRIPTORS`]: up to a quarter to finalizes (at most
    /// `max_finalizes`), a quarter of the rest to snapshotters, the rest to connections
    /// (at most `max_connections`).
    pub fn of(
        descriptors: u64,
        per_snapshotter: usize,
        max_connections: u32,
        max_finalizes: usize,
    ) -> Totals {
        let free = descriptors.saturating_sub(OWN_DESCRIPTORS).max(16);
        let finalizes = (free / 4 / FINALIZE_DESCRIPTORS).clamp(1, max_finalizes.max(1) as u64);
        let free = free - finalizes * FINALIZE_DESCRIPTORS;
        let for_snapshotters = free / 4;
        let per = per_snapshotter.max(1) as u64;
        Totals {
            connections: (free - for_snapshotters).min(u64::from(max_connections)) as u32,
            snapshotters: (for_snapshotters / per).max(1) as usize,
            finalizes: finalizes as usize,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_leave_the_agents_own_descriptors() {
        let t = Totals::of(1024, 4, 4096, 64);
        assert_eq!((t.connections, t.snapshotters, t.finalizes), (504, 42, 56));
        let used = u64::from(t.connections)
            + t.snapshotters as u64 * 4
            + t.finalizes as u64 * FINALIZE_DESCRIPTORS
            + OWN_DESCRIPTORS;
        assert!(used <= 1024, "{used}");
        let t = Totals::of(1 << 20, 4, 4096, 64);
        assert_eq!((t.connections, t.finalizes), (4096, 64));
    }
}
