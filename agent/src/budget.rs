//! One budget per peer: what a peer uid may make the agent hold, counted against quotas
//! set in one place (the `max_*_per_uid` settings), and the totals that need
//! descriptors derived from what the process may open.
//!
//! Invariants:
//! - Every quota is per uid, root and the agent's own included: quotas bound what one
//!   peer holds; the totals keep room for the operator: uids other than root and the
//!   agent's own take at most three quarters of any [`Budget`]'s total (connections,
//!   finalizes; the server's calls in flight follow the same rule).
//! - A charge is given back when its [`Charge`] is dropped, however the work ends.
//! - Totals that need descriptors (connections, registered snapshotters' connections,
//!   finalizes' files) add up to less than the descriptor limit, with [`OWN_DESCRIPTORS`]
//!   left for the database and the log: no combination of quotas runs the descriptors
//!   out.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::sync::lock;

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

/// Counts of one resource by peer uid, against a per-uid quota named by its setting.
pub struct PerUid {
    /// The setting that sets the quota, named in refusals.
    setting: &'static str,
    /// What is counted, in the plural (`subscriptions`).
    what: &'static str,
    quota: u32,
    held: Mutex<HashMap<u32, u32>>,
}

/// One unit of a [`PerUid`] held by a uid, given back on drop.
pub struct Charge {
    of: Arc<PerUid>,
    uid: u32,
}

impl Drop for Charge {
    fn drop(&mut self) {
        let mut held = lock(&self.of.held);
        if let Some(n) = held.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.uid);
            }
        }
    }
}

impl Charge {
    /// The uid charged.
    pub fn uid(&self) -> u32 {
        self.uid
    }
}

impl std::fmt::Debug for Charge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Charge({} of uid {})", self.of.what, self.uid)
    }
}

impl PerUid {
    pub fn new(setting: &'static str, what: &'static str, quota: u32) -> Arc<PerUid> {
        Arc::new(PerUid {
            setting,
            what,
            quota,
            held: Mutex::new(HashMap::new()),
        })
    }

    /// Charges one unit to `uid`, or says which quota it is over.
    pub fn charge(self: &Arc<Self>, uid: u32) -> Result<Charge, String> {
        self.charge_within(uid, u32::MAX, String::new)
    }

    /// [`charge`](Self::charge), with the quota lowered to `share` (and `why` said)
    /// where that is less.
    fn charge_within(
        self: &Arc<Self>,
        uid: u32,
        share: u32,
        why: impl FnOnce() -> String,
    ) -> Result<Charge, String> {
        let mut held = lock(&self.held);
        let n = held.entry(uid).or_insert(0);
        if *n >= self.quota {
            return Err(format!(
                "uid {uid} already holds {n} {}, the most {} allows",
                self.what, self.setting
            ));
        }
        if *n >= share {
            return Err(format!(
                "uid {uid} already holds {n} {}, {}",
                self.what,
                why()
            ));
        }
        *n += 1;
        Ok(Charge {
            of: self.clone(),
            uid,
        })
    }
}

/// Whether `uid` is root or the agent's own: the operator, for whom the totals keep a
/// reserve.
pub fn is_operator(uid: u32) -> bool {
    static OWN: std::sync::LazyLock<u32> =
        std::sync::LazyLock::new(|| nix::unistd::geteuid().as_raw());
    uid == 0 || uid == *OWN
}

/// A resource charged per uid against its quota, within a total over all peers of
/// which uids other than the operator's take at most three quarters.
pub struct Budget {
    per_uid: Arc<PerUid>,
    all: Arc<Semaphore>,
    others: Arc<Semaphore>,
    total: usize,
    others_limit: usize,
    /// What one uid other than the operator's may hold, whatever its quota: a quarter
    /// of the others' share, so that one or two peers cannot take it all.
    share: u32,
}

/// One unit of a [`Budget`] held, given back on drop.
#[derive(Debug)]
pub struct Held {
    uid: Option<Charge>,
    _all: OwnedSemaphorePermit,
    _other: Option<OwnedSemaphorePermit>,
}

impl Held {
    /// The uid charged, if any.
    pub fn uid(&self) -> Option<u32> {
        self.uid.as_ref().map(Charge::uid)
    }
}

impl Budget {
    /// `quota` per uid (named by `setting`) of `total` in all.
    pub fn new(setting: &'static str, what: &'static str, quota: u32, total: usize) -> Budget {
        let total = total.clamp(1, Semaphore::MAX_PERMITS);
        // A quarter, and at least one of any total the operator can share.
        let reserve = (total / 4).max(usize::from(total > 1));
        let others_limit = total - reserve;
        Budget {
            per_uid: PerUid::new(setting, what, quota),
            all: Arc::new(Semaphore::new(total)),
            others: Arc::new(Semaphore::new(others_limit)),
            total,
            others_limit,
            share: u32::try_from(others_limit / 4).unwrap_or(u32::MAX).max(1),
        }
    }

    /// Takes one unit for `uid` (`None`: a call from within the agent, charged to no
    /// uid), or says which limit it is over.
    pub fn take(&self, uid: Option<u32>) -> Result<Held, String> {
        let what = self.per_uid.what;
        let operator = uid.is_some_and(is_operator);
        let share = if operator { u32::MAX } else { self.share };
        let why = || {
            format!(
                "a quarter of what uids other than root and the agent's own may hold \
                 together ({}, which its open-file limit sets); try again later",
                self.others_limit
            )
        };
        let charge = uid
            .map(|uid| self.per_uid.charge_within(uid, share, why))
            .transpose()?;
        let other = match operator {
            true => None,
            false => Some(self.others.clone().try_acquire_owned().map_err(|_| {
                format!(
                    "other uids hold {} {what}, all the agent takes from uids other than \
                     its own and root; try again later",
                    self.others_limit
                )
            })?),
        };
        let all = self.all.clone().try_acquire_owned().map_err(|_| {
            format!(
                "{} {what} are held, all the agent takes at once (its open-file limit sets \
                 how many); try again later",
                self.total
            )
        })?;
        Ok(Held {
            uid: charge,
            _all: all,
            _other: other,
        })
    }

    /// Units held now, over all peers.
    pub fn held(&self) -> usize {
        self.total - self.all.available_permits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uid_is_held_to_its_quota_and_gets_units_back() {
        let subs = PerUid::new("max_subscriptions_per_uid", "subscriptions", 2);
        let a = subs.charge(7).unwrap();
        let _b = subs.charge(7).unwrap();
        let refused = subs.charge(7).unwrap_err();
        assert_eq!(
            refused,
            "uid 7 already holds 2 subscriptions, the most max_subscriptions_per_uid allows"
        );
        assert!(subs.charge(8).is_ok(), "another uid has its own quota");
        drop(a);
        assert!(subs.charge(7).is_ok());
    }

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

    #[test]
    fn one_other_uid_takes_at_most_a_quarter_of_the_others_share() {
        let budget = Budget::new("max_connections_per_uid", "connections", 100, 100);
        let held: Vec<Held> = (0..18)
            .map(|_| budget.take(Some(70_000)).unwrap())
            .collect();
        assert_eq!(
            budget.take(Some(70_000)).unwrap_err(),
            "uid 70000 already holds 18 connections, a quarter of what uids other than root \
             and the agent's own may hold together (75, which its open-file limit sets); try \
             again later"
        );
        assert!(
            budget.take(Some(70_001)).is_ok(),
            "another uid has its own share"
        );
        let root: Vec<Held> = (0..30).map(|_| budget.take(Some(0)).unwrap()).collect();
        drop((held, root));
    }

    #[test]
    fn other_uids_leave_a_quarter_of_the_total_to_the_operator() {
        let budget = Budget::new("max_finalizes_per_uid", "finalizes", 8, 8);
        let others: Vec<Held> = (0..6)
            .map(|n| budget.take(Some(70_000 + n)).unwrap())
            .collect();
        let refused = budget.take(Some(70_100)).unwrap_err();
        assert!(
            refused.starts_with("other uids hold 6 finalizes"),
            "{refused}"
        );
        let root: Vec<Held> = (0..2).map(|_| budget.take(Some(0)).unwrap()).collect();
        assert_eq!(
            budget.take(Some(0)).unwrap_err(),
            "8 finalizes are held, all the agent takes at once (its open-file limit sets how \
             many); try again later"
        );
        drop((others, root));
        assert_eq!(budget.held(), 0);
    }
}
