//! One budget per peer: what a peer uid may make a server hold, counted against a
//! quota per uid within a total over all peers. The agent's connections, calls in
//! flight, finalizes and snapshotter registrations are each a [`Budget`].
//!
//! Invariants:
//! - Every quota is per uid, root and the agent's own included: quotas bound what one
//!   peer holds; the totals keep room for the operator: uids other than root and the
//!   process's own ([`is_operator`]) take at most three quarters of any [`Budget`]'s
//!   total, and one of them at most a quarter of that share, whatever its quota.
//! - A unit is taken at once or refused ([`Budget::take`], for what is refused: a
//!   connection, a finalize) or waited for ([`Budget::acquire`], for what waits: a
//!   call); either way it is given back when its [`Held`] is dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Whether `uid` is root or the process's own: the operator, for whom the totals keep a
/// reserve.
pub fn is_operator(uid: u32) -> bool {
    static OWN: std::sync::LazyLock<u32> =
        std::sync::LazyLock::new(|| nix::unistd::geteuid().as_raw());
    uid == 0 || uid == *OWN
}

/// Units of one resource held by uid, each uid within its quota (and, if the total is
/// shared, within its share of it).
pub struct PerUid {
    /// The setting that sets the quota, named in refusals.
    setting: &'static str,
    /// What is counted, in the plural (`subscriptions`).
    what: &'static str,
    quota: u32,
    /// What one uid other than the operator's may hold whatever its quota, and the
    /// share of the total it is a quarter of (none: no total).
    share: Option<(u32, usize)>,
    /// One semaphore per uid holding or waiting for a unit.
    held: Mutex<HashMap<u32, Arc<Semaphore>>>,
}

/// One unit of a [`PerUid`] held by a uid, given back on drop.
pub struct Charge {
    permit: Option<OwnedSemaphorePermit>,
    of: Arc<PerUid>,
    uid: u32,
}

impl Drop for Charge {
    fn drop(&mut self) {
        drop(self.permit.take());
        // A uid that holds and awaits nothing more leaves the map.
        let mut held = self.of.lock();
        if held
            .get(&self.uid)
            .is_some_and(|s| Arc::strong_count(s) == 1)
        {
            held.remove(&self.uid);
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
    /// `quota` per uid, named by `setting`, of units of `what` (no total).
    pub fn new(setting: &'static str, what: &'static str, quota: u32) -> Arc<PerUid> {
        Arc::new(PerUid {
            setting,
            what,
            quota,
            share: None,
            held: Mutex::new(HashMap::new()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Arc<Semaphore>>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The most `uid` may hold.
    fn limit(&self, uid: u32) -> u32 {
        match self.share {
            Some((share, _)) if !is_operator(uid) => share.min(self.quota),
            _ => self.quota,
        }
    }

    /// The places of `uid`.
    fn places(&self, uid: u32) -> Arc<Semaphore> {
        let mut held = self.lock();
        if let Some(places) = held.get(&uid) {
            return places.clone();
        }
        // Left by a wait given up: no [`Charge`] drop removes it.
        held.retain(|_, places| Arc::strong_count(places) > 1);
        let places = Arc::new(Semaphore::new(self.limit(uid) as usize));
        held.insert(uid, places.clone());
        places
    }

    /// Charges one unit to `uid`, or says which quota it is over.
    pub fn charge(self: &Arc<Self>, uid: u32) -> Result<Charge, String> {
        self.charge_many(uid, 1)
    }

    /// Charges `n` units to `uid`, or says which quota it is over.
    fn charge_many(self: &Arc<Self>, uid: u32, n: u32) -> Result<Charge, String> {
        let places = self.places(uid);
        match places.clone().try_acquire_many_owned(n) {
            Ok(permit) => Ok(Charge {
                permit: Some(permit),
                of: self.clone(),
                uid,
            }),
            Err(_) => {
                let limit = self.limit(uid);
                let held = (limit as usize).saturating_sub(places.available_permits());
                let what = self.what;
                if n > 1 {
                    let whose = match self.share {
                        Some((share, others)) if limit == share && share < self.quota => format!(
                            "a quarter of what uids other than root and the agent's own may \
                             hold together ({others})"
                        ),
                        _ => format!("the most {} allows", self.setting),
                    };
                    return Err(format!(
                        "uid {uid} holds {held} {what}; {n} more would pass {limit}, {whose}; \
                         try again later"
                    ));
                }
                let n = held;
                Err(match self.share {
                    Some((share, others)) if limit == share && share < self.quota => format!(
                        "uid {uid} already holds {n} {what}, a quarter of what uids other than \
                         root and the agent's own may hold together ({others}, which the \
                         agent's open-file and task limits set); try again later"
                    ),
                    _ => format!(
                        "uid {uid} already holds {n} {what}, the most {} allows",
                        self.setting
                    ),
                })
            }
        }
    }

    /// Charges `n` units to `uid` once it is within its quota.
    async fn charge_waiting(self: &Arc<Self>, uid: u32, n: u32) -> Charge {
        let permit = self.places(uid).acquire_many_owned(n).await.ok();
        Charge {
            permit,
            of: self.clone(),
            uid,
        }
    }
}

/// A resource charged per uid against its quota, within a total over all peers of
/// which uids other than the operator's take at most three quarters, and one of them a
/// quarter of those.
#[derive(Clone)]
pub struct Budget {
    per_uid: Arc<PerUid>,
    all: Arc<Semaphore>,
    others: Arc<Semaphore>,
    total: usize,
    others_limit: usize,
}

/// One unit of a [`Budget`] held, given back on drop.
#[derive(Debug)]
pub struct Held {
    uid: Option<Charge>,
    _other: Option<OwnedSemaphorePermit>,
    _all: Option<OwnedSemaphorePermit>,
}

impl Held {
    /// The uid charged, if any.
    pub fn uid(&self) -> Option<u32> {
        self.uid.as_ref().map(Charge::uid)
    }

    /// Units held.
    pub fn units(&self) -> usize {
        self._all
            .as_ref()
            .map_or(0, OwnedSemaphorePermit::num_permits)
    }

    /// Gives back all but `keep` units.
    pub fn shrink(&mut self, keep: usize) {
        let permits = [
            self.uid.as_mut().and_then(|c| c.permit.as_mut()),
            self._other.as_mut(),
            self._all.as_mut(),
        ];
        for permit in permits.into_iter().flatten() {
            drop(permit.split(permit.num_permits().saturating_sub(keep)));
        }
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
            per_uid: Arc::new(PerUid {
                setting,
                what,
                quota,
                share: Some((Self::share_of(others_limit), others_limit)),
                held: Mutex::new(HashMap::new()),
            }),
            all: Arc::new(Semaphore::new(total)),
            others: Arc::new(Semaphore::new(others_limit)),
            total,
            others_limit,
        }
    }

    fn share_of(others_limit: usize) -> u32 {
        u32::try_from(others_limit / 4).unwrap_or(u32::MAX).max(1)
    }

    /// Another quota per uid (named by `setting`) within the same total: what one uid
    /// holds of both is bounded by each quota, what all hold by the one total.
    pub fn sharing(&self, setting: &'static str, what: &'static str, quota: u32) -> Budget {
        Budget {
            per_uid: Arc::new(PerUid {
                setting,
                what,
                quota,
                share: Some((Self::share_of(self.others_limit), self.others_limit)),
                held: Mutex::new(HashMap::new()),
            }),
            all: self.all.clone(),
            others: self.others.clone(),
            total: self.total,
            others_limit: self.others_limit,
        }
    }

    /// The most `uid` may ever hold at once: more is never granted.
    pub fn limit(&self, uid: u32) -> u64 {
        let limit = u64::from(self.per_uid.limit(uid));
        match is_operator(uid) {
            true => limit.min(self.total as u64),
            false => limit.min(self.others_limit as u64),
        }
    }

    /// Takes one unit for `uid` (`None`: work of the process's own, charged to no uid
    /// but within the others' share), or says which limit it is over.
    pub fn take(&self, uid: Option<u32>) -> Result<Held, String> {
        self.take_many(uid, 1)
    }

    /// Takes `n` units for `uid` at once, or says which limit it is over.
    pub fn take_many(&self, uid: Option<u32>, n: u32) -> Result<Held, String> {
        let what = self.per_uid.what;
        let charge = uid
            .map(|uid| self.per_uid.charge_many(uid, n))
            .transpose()?;
        let other = match uid.is_some_and(is_operator) {
            true => None,
            false => Some(self.others.clone().try_acquire_many_owned(n).map_err(|_| {
                let held = self.others_limit - self.others.available_permits();
                match n {
                    1 => format!(
                        "other uids hold {held} {what}, all the agent takes from uids other \
                         than its own and root; try again later"
                    ),
                    _ => format!(
                        "other uids hold {held} {what} of the {} the agent takes from uids \
                         other than its own and root; try again later",
                        self.others_limit
                    ),
                }
            })?),
        };
        let all = self
            .all
            .clone()
            .try_acquire_many_owned(n)
            .map_err(|_| match n {
                1 => format!(
                    "{} {what} are held, all the agent takes at once (its open-file and \
                 task limits set how many); try again later",
                    self.total
                ),
                _ => format!(
                    "{} of the {} {what} the agent holds at once are held; try again later",
                    self.total - self.all.available_permits(),
                    self.total
                ),
            })?;
        Ok(Held {
            uid: charge,
            _other: other,
            _all: Some(all),
        })
    }

    /// Takes as many of `n` units for `uid` as there are now, without waiting (none,
    /// if the uid or the total holds all it may).
    pub fn take_up_to(&self, uid: Option<u32>, n: u32) -> Held {
        // What is free may be taken by another between the look and the take: look again
        // (a few times: each miss means another took what was free).
        for _ in 0..8 {
            let mut free = self.all.available_permits();
            if !uid.is_some_and(is_operator) {
                free = free.min(self.others.available_permits());
            }
            if let Some(uid) = uid {
                free = free.min(self.per_uid.places(uid).available_permits());
            }
            let n = n.min(u32::try_from(free).unwrap_or(u32::MAX));
            if n == 0 {
                return Held {
                    uid: None,
                    _other: None,
                    _all: None,
                };
            }
            if let Ok(held) = self.take_many(uid, n) {
                return held;
            }
        }
        Held {
            uid: None,
            _other: None,
            _all: None,
        }
    }

    /// Takes one unit for `uid` once there is one: its own quota first, so that a uid
    /// waiting for its own holds none of the others' places meanwhile.
    pub async fn acquire(&self, uid: Option<u32>) -> Held {
        self.acquire_many(uid, 1).await
    }

    /// Takes `n` units for `uid` once there are (see [`Budget::acquire`]); `n` past
    /// [`Budget::limit`] is never granted: the caller refuses it first.
    pub async fn acquire_many(&self, uid: Option<u32>, n: u32) -> Held {
        let charge = match uid {
            Some(uid) => Some(self.per_uid.charge_waiting(uid, n).await),
            None => None,
        };
        let other = match uid.is_some_and(is_operator) {
            true => None,
            false => self.others.clone().acquire_many_owned(n).await.ok(),
        };
        Held {
            uid: charge,
            _other: other,
            _all: self.all.clone().acquire_many_owned(n).await.ok(),
        }
    }

    /// Units `uid` holds now.
    pub fn held_by(&self, uid: u32) -> u64 {
        let held = self.per_uid.lock();
        held.get(&uid).map_or(0, |places| {
            u64::from(self.per_uid.limit(uid)).saturating_sub(places.available_permits() as u64)
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
    fn one_other_uid_takes_at_most_a_quarter_of_the_others_share() {
        let budget = Budget::new("max_connections_per_uid", "connections", 100, 100);
        let held: Vec<Held> = (0..18)
            .map(|_| budget.take(Some(70_000)).unwrap())
            .collect();
        assert_eq!(
            budget.take(Some(70_000)).unwrap_err(),
            "uid 70000 already holds 18 connections, a quarter of what uids other than root \
             and the agent's own may hold together (75, which the agent's open-file and task \
             limits set); try again later"
        );
        assert!(
            budget.take(Some(70_001)).is_ok(),
            "another uid has its own share"
        );
        let root: Vec<Held> = (0..30).map(|_| budget.take(Some(0)).unwrap()).collect();
        drop((held, root));
        assert_eq!(budget.held(), 0);
        assert!(budget.per_uid.lock().is_empty(), "no uid is left counted");
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
            "8 finalizes are held, all the agent takes at once (its open-file and task limits \
             set how many); try again later"
        );
        drop((others, root));
        assert_eq!(budget.held(), 0);
    }

    #[test]
    fn budgets_sharing_a_total_bound_what_all_uids_hold_of_both() {
        let requests = Budget::new("max_request_bytes_per_uid", "bytes", 1000, 1000);
        let unread = requests.sharing("max_unread_bytes_per_uid", "bytes", 100);
        // Other uids share 750, one of them at most 187.
        let bodies: Vec<Held> = (0..4)
            .map(|n| requests.take_many(Some(70_000 + n), 150).unwrap())
            .collect();
        let answer = unread.take_up_to(Some(70_010), 100);
        assert_eq!(answer.units(), 100, "the uid's quota of answers");
        let refused = unread.take_many(Some(70_011), 100).unwrap_err();
        assert!(
            refused.starts_with("other uids hold 700 bytes of the 750"),
            "{refused}"
        );
        let rest = unread.take_up_to(Some(70_011), 100);
        assert_eq!(rest.units(), 50, "what is left");
        assert!(unread.take_many(Some(0), 100).is_ok(), "root's reserve");
        drop((bodies, answer));
        assert_eq!(unread.held_by(70_011), 50);
        drop(rest);
        assert_eq!(requests.held(), 0);
    }

    #[tokio::test]
    async fn a_waiting_uid_gets_its_unit_once_one_is_given_back() {
        let budget = Arc::new(Budget::new("max_calls_per_uid", "calls", 32, 64));
        // 48 for other uids, 12 for one of them.
        let first: Vec<Held> = futures_held(&budget, 70_000, 12).await;
        let mut waiting = Box::pin(budget.acquire(Some(70_000)));
        assert!(
            futures::poll!(waiting.as_mut()).is_pending(),
            "a thirteenth waits"
        );
        let others = futures_held(&budget, 70_001, 12).await;
        let root = futures_held(&budget, 0, 16).await;
        drop(first);
        let thirteenth = waiting.await;
        assert_eq!(thirteenth.uid(), Some(70_000));
        drop((thirteenth, others, root));
        assert_eq!(budget.held(), 0);
    }

    async fn futures_held(budget: &Budget, uid: u32, n: usize) -> Vec<Held> {
        let mut held = Vec::new();
        for _ in 0..n {
            held.push(budget.acquire(Some(uid)).await);
        }
        held
    }
}
