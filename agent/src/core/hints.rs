//! Hinted polls: `snapshotter.changed` lets a snapshotter say that some of its
//! operations changed, and the agent polls them at once instead of at its next tick.
//!
//! Invariants:
//! - A hint decides only *when* to poll; what is recorded comes from the poll's answers,
//!   exactly as for the periodic sweep. A false or hostile hint costs a poll, nothing else.
//! - Hints are merged while they wait: per plugin, a set of operation IDs (at most
//!   [`MAX_PENDING_IDS`]; past that, "all of the plugin's operations"). Plugins are
//!   registered ones only, so what waits is bounded.
//! - One hinted poll runs at a time, the next at least [`REST_FACTOR`] times its length
//!   later: hints take at most 1 / (1 + [`REST_FACTOR`]) of the agent's time.
//! - An operation (or a plugin as a whole) is hint-polled at most once per
//!   [`POLL_GAP`]; its hints meanwhile coalesce.
//! - A hinted poll takes the plugin's sweep turn, so no operation is polled by two tasks
//!   that could commit out of order.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::Core;
use crate::error::{Error, NotFound};
use crate::store::queries::{self, Targets};
use crate::sync::lock;

/// Most operation IDs kept waiting per plugin; more make the next poll cover all of
/// the plugin's operations.
pub const MAX_PENDING_IDS: usize = 4096;
/// The shortest wait between two hinted polls.
pub const MIN_GAP: Duration = Duration::from_millis(5);
/// After a hinted poll that took `t`, the next starts no sooner than `REST_FACTOR × t`.
pub const REST_FACTOR: u32 = 4;
/// The shortest wait between two hinted polls of one operation (or of all of one
/// plugin's): hints for it coalesce, so a flood of them polls it about once per gap.
pub const POLL_GAP: Duration = Duration::from_secs(1);
/// Most operations remembered as recently polled by a hint; past that, hints wait.
const MAX_REMEMBERED: usize = 65_536;

/// What to poll for one plugin.
#[derive(Debug, PartialEq, Eq)]
enum Hinted {
    All,
    Some(HashSet<String>),
}

impl Hinted {
    fn add(&mut self, ids: Option<Vec<String>>) {
        match (&mut *self, ids) {
            (Hinted::All, _) => {}
            (_, None) => *self = Hinted::All,
            (Hinted::Some(set), Some(ids)) => {
                set.extend(ids);
                if set.len() > MAX_PENDING_IDS {
                    *self = Hinted::All;
                }
            }
        }
    }

    fn merge(&mut self, other: Hinted) {
        match other {
            Hinted::All => *self = Hinted::All,
            Hinted::Some(ids) => self.add(Some(ids.into_iter().collect())),
        }
    }
}

/// When hinted polls last covered each plugin (all of its operations) and each named
/// operation, for [`POLL_GAP`]: what was polled since is held back until then.
#[derive(Default)]
struct Recent {
    plugins: HashMap<String, Instant>,
    operations: HashMap<(String, String), Instant>,
}

impl Recent {
    /// Forgets polls before `cutoff`.
    fn forget_before(&mut self, cutoff: Instant) {
        self.plugins.retain(|_, at| *at > cutoff);
        self.operations.retain(|_, at| *at > cutoff);
    }

    /// Splits `hinted` of `plugin` into what may be polled at `now` and what waits
    /// (with when it may be polled).
    fn split(
        &self,
        plugin: &str,
        hinted: Hinted,
        now: Instant,
    ) -> (Option<Hinted>, Option<(Hinted, Instant)>) {
        if let Some(at) = self.plugins.get(plugin) {
            return (None, Some((hinted, *at + POLL_GAP)));
        }
        let Hinted::Some(ids) = hinted else {
            return (Some(Hinted::All), None);
        };
        // Too many remembered: the plugin waits as a whole (what is kept stays bounded).
        if self.operations.len() >= MAX_REMEMBERED {
            return (None, Some((Hinted::Some(ids), now + POLL_GAP)));
        }
        let mut due = HashSet::new();
        let mut held = HashSet::new();
        let mut until: Option<Instant> = None;
        for id in ids {
            match self.operations.get(&(plugin.to_string(), id.clone())) {
                Some(at) => {
                    until = Some(until.map_or(*at, |u| u.min(*at)));
                    held.insert(id);
                }
                None => {
                    due.insert(id);
                }
            }
        }
        let now_part = (!due.is_empty()).then_some(Hinted::Some(due));
        let held_part = until.map(|at| (Hinted::Some(held), at + POLL_GAP));
        (now_part, held_part)
    }

    /// Notes that `hinted` of `plugin` is polled at `now`.
    fn polled(&mut self, plugin: &str, hinted: &Hinted, now: Instant) {
        match hinted {
            Hinted::All => {
                self.plugins.insert(plugin.to_string(), now);
            }
            Hinted::Some(ids) => {
                for id in ids {
                    self.operations
                        .insert((plugin.to_string(), id.clone()), now);
                }
            }
        }
    }
}

/// The hints waiting for a poll, and the wake-up of the task that polls them.
#[derive(Default)]
pub(super) struct Hints {
    pending: Mutex<HashMap<String, Hinted>>,
    wake: Notify,
}

impl Hints {
    fn add(&self, plugin: String, ids: Option<Vec<String>>) {
        let hinted = ids.map_or(Hinted::All, |ids| Hinted::Some(ids.into_iter().collect()));
        self.put_back(plugin, hinted);
        // Stores a permit if the task is busy: it looks again when done.
        self.wake.notify_one();
    }

    fn take(&self) -> HashMap<String, Hinted> {
        std::mem::take(&mut *lock(&self.pending))
    }

    fn put_back(&self, plugin: String, hinted: Hinted) {
        lock(&self.pending)
            .entry(plugin)
            .or_insert_with(|| Hinted::Some(HashSet::new()))
            .merge(hinted);
    }
}

impl Core {
    /// `snapshotter.changed` (params validated): remembers the hint and wakes the
    /// hinted-poll task. Answers before the poll: the hint is a request to look, and
    /// its sender learns nothing from waiting.
    pub async fn snapshotter_changed(
        &self,
        plugin: String,
        operations: Option<Vec<String>>,
    ) -> Result<(), Error> {
        if self.poller.remotes.get(&plugin).is_none() {
            return Err(Error::NotFound(NotFound::Snapshotter(plugin)));
        }
        self.hints.add(plugin, operations);
        Ok(())
    }

    /// The hinted-poll task: runs until [`Core::stop`].
    pub(super) async fn poll_hinted(self: Arc<Self>) {
        let mut recent = Recent::default();
        let mut again: Option<Instant> = None;
        loop {
            let timer = async {
                match again {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = self.stopping.cancelled() => return,
                _ = self.hints.wake.notified() => {}
                _ = timer => {}
            }
            let began = Instant::now();
            if let Some(cutoff) = began.checked_sub(POLL_GAP) {
                recent.forget_before(cutoff);
            }
            again = None;
            let mut later = |at: Instant| again = Some(again.map_or(at, |a: Instant| a.min(at)));
            for (plugin, hinted) in self.hints.take() {
                let (now, wait) = recent.split(&plugin, hinted, began);
                if let Some((hinted, at)) = wait {
                    self.hints.put_back(plugin.clone(), hinted);
                    later(at);
                }
                let Some(now) = now else { continue };
                let Some(_turn) = self.poller.start_sweep(&plugin) else {
                    self.hints.put_back(plugin, now);
                    later(began + MIN_GAP);
                    continue;
                };
                recent.polled(&plugin, &now, began);
                let poll = async {
                    match now {
                        Hinted::All => self.sweep_plugin(&plugin).await,
                        Hinted::Some(ids) => self.poll_named(&plugin, ids).await,
                    }
                };
                tokio::select! {
                    _ = self.stopping.cancelled() => return,
                    result = poll => if let Err(e) = result {
                        tracing::warn!(plugin, error = %e, "hinted poll failed");
                    }
                }
            }
            let rest = (began.elapsed() * REST_FACTOR).max(MIN_GAP);
            tokio::select! {
                _ = self.stopping.cancelled() => return,
                _ = tokio::time::sleep(rest) => {}
            }
        }
    }

    /// Polls the operations of `plugin` named `ids` whose owners wait, and commits.
    async fn poll_named(&self, plugin: &str, ids: HashSet<String>) -> Result<(), Error> {
        if ids.is_empty() {
            return Ok(());
        }
        // Passed to SQLite as one JSON array (json_each), so one statement serves any count.
        let json = serde_json::Value::from(ids.into_iter().collect::<Vec<_>>()).to_string();
        let name = plugin.to_string();
        let targets = self
            .store
            .read(move |conn| {
                let which = Targets::Hinted {
                    plugin: &name,
                    operation_ids: &json,
                };
                queries::poll_targets(conn, which).map_err(Error::from)
            })
            .await?;
        let changes = self.poller.poll_group(plugin, targets, None).await;
        if !changes.is_empty() {
            self.commit_sweep(changes).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_operation_hint_polled_within_the_gap_waits_and_others_go_at_once() {
        let start = std::time::Instant::now();
        let mut recent = super::Recent::default();
        let ids = |l: &[&str]| Hinted::Some(l.iter().map(|s| s.to_string()).collect());
        recent.polled("p", &ids(&["a"]), start);
        let (now, wait) = recent.split("p", ids(&["a", "b"]), start);
        assert_eq!(now, Some(ids(&["b"])));
        assert_eq!(wait, Some((ids(&["a"]), start + super::POLL_GAP)));
        recent.forget_before(start + super::POLL_GAP);
        assert_eq!(recent.split("p", ids(&["a"]), start).0, Some(ids(&["a"])));
        recent.polled("p", &Hinted::All, start);
        assert_eq!(
            recent.split("p", ids(&["c"]), start).0,
            None,
            "the plugin as a whole waits"
        );
    }

    use super::*;

    fn ids(n: std::ops::Range<usize>) -> Vec<String> {
        n.map(|i| format!("op-{i}")).collect()
    }

    #[test]
    fn hints_merge_and_fall_back_to_all_past_the_bound() {
        let mut h = Hinted::Some(HashSet::new());
        h.add(Some(ids(0..10)));
        h.add(Some(ids(5..20)));
        assert_eq!(h, Hinted::Some(ids(0..20).into_iter().collect()));
        h.add(Some(ids(0..MAX_PENDING_IDS + 1)));
        assert_eq!(h, Hinted::All);
        h.add(Some(ids(0..1)));
        assert_eq!(h, Hinted::All);
        let mut h = Hinted::Some(ids(0..1).into_iter().collect());
        h.add(None);
        assert_eq!(h, Hinted::All);
        let mut h = Hinted::Some(ids(0..1).into_iter().collect());
        h.merge(Hinted::Some(ids(1..2).into_iter().collect()));
        assert_eq!(h, Hinted::Some(ids(0..2).into_iter().collect()));
    }
}
