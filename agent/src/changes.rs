//! Change notification: who is waiting on which owner.
//!
//! After a commit that changed an owner or its operations, the committer calls
//! [`Changes::notify`] with the rows of the operations that changed; `wait` and
//! subscriptions hold a receiver and re-read committed state when told (subscribers of
//! one owner share what they read and serialize for each change). The channel is
//! bounded and never blocks the committer (the poller): a receiver that falls behind
//! is told it lagged and re-reads everything, so it loses nothing.
//!
//! Progress alone ([`Urgency::Progress`]) is announced at most once per
//! [`PROGRESS_EVERY`] per owner, the rows of the changes in between merged: a poll pass
//! runs without paying for its subscribers as it goes, and they hear of it once it has
//! moved on. Anything else (a phase, an owner's change) is announced at once, with any
//! progress still held.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opmon_client::OwnerKind;
use tokio::sync::broadcast;

use crate::sync::lock;

type Key = (OwnerKind, String);

/// Notifications buffered per owner before a slow receiver lags.
const BUFFER: usize = 64;

/// What changed in one commit, shared by every receiver of the owner.
pub type Changed = Arc<OwnerChange>;

pub struct OwnerChange {
    /// The rows of the owner's operations that changed (empty when only the owner did).
    pub rows: Vec<i64>,
    /// The subscription notification for this change, built by the first subscriber
    /// that needs it and sent as is by the others while one holds it: held weakly, as
    /// the channel keeps its last changes long after they were sent.
    pub rendered: tokio::sync::Mutex<std::sync::Weak<Rendered>>,
}

/// A subscription notification, serialized.
pub struct Rendered {
    /// An `OwnerUpdate` as JSON.
    pub json: Box<serde_json::value::RawValue>,
    /// The owner was in a terminal phase: the subscription ends after this one.
    pub terminal: bool,
}

/// How often, at most, progress alone is announced per owner.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// Whether a change is announced at once or may wait to be merged with others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Urgency {
    /// A phase changed, or the owner did: announced at once.
    Now,
    /// Only progress changed: announced within [`PROGRESS_EVERY`].
    Progress,
}

/// One watched owner.
struct Watched {
    sender: broadcast::Sender<Changed>,
    /// Progress rows held for the next announcement, when one is due.
    held: Option<BTreeSet<i64>>,
}

type Watchers = Arc<Mutex<HashMap<Key, Watched>>>;

#[derive(Default)]
pub struct Changes {
    watched: Watchers,
}

/// Sends `rows` (plus any held) to the owner's receivers; forgets the owner when
/// nobody listens any more.
fn announce(watched: &mut HashMap<Key, Watched>, key: &Key, rows: Vec<i64>) {
    let Some(w) = watched.get_mut(key) else {
        return;
    };
    let rows = match w.held.take() {
        Some(mut held) => {
            held.extend(rows);
            held.into_iter().collect()
        }
        None => rows,
    };
    let change = OwnerChange {
        rows,
        rendered: Default::default(),
    };
    if w.sender.send(Arc::new(change)).is_err() {
        watched.remove(key);
    }
}

impl Changes {
    /// A receiver told of every later change to the owner.
    pub fn subscribe(&self, kind: OwnerKind, name: &str) -> broadcast::Receiver<Changed> {
        lock(&self.watched)
            .entry((kind, name.to_string()))
            .or_insert_with(|| Watched {
                sender: broadcast::channel(BUFFER).0,
                held: None,
            })
            .sender
            .subscribe()
    }

    /// Tells the owner's receivers that it changed (now, or with the next progress
    /// announcement); does nothing for owners nobody watches.
    pub fn notify(&self, kind: OwnerKind, name: &str, operations: Vec<i64>, urgency: Urgency) {
        let mut watched = lock(&self.watched);
        let key = (kind, name.to_string());
        let Some(w) = watched.get_mut(&key) else {
            return;
        };
        if urgency == Urgency::Now {
            return announce(&mut watched, &key, operations);
        }
        match &mut w.held {
            Some(held) => held.extend(operations),
            None => {
                w.held = Some(operations.into_iter().collect());
                let watched = self.watched.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(PROGRESS_EVERY).await;
                    let mut watched = lock(&watched);
                    // Announced meanwhile by an urgent change: nothing is held.
                    if watched.get(&key).is_some_and(|w| w.held.is_some()) {
                        announce(&mut watched, &key, Vec::new());
                    }
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn progress_is_merged_and_announced_once_per_interval_anything_else_at_once() {
        let changes = Changes::default();
        let mut rx = changes.subscribe(OwnerKind::Backup, "b");
        let began = tokio::time::Instant::now();
        for row in [3, 1, 2, 3] {
            changes.notify(OwnerKind::Backup, "b", vec![row], Urgency::Progress);
        }
        assert!(rx.try_recv().is_err(), "progress waits for the interval");
        let merged = rx.recv().await.unwrap();
        assert_eq!(merged.rows, vec![1, 2, 3]);
        assert_eq!(began.elapsed(), PROGRESS_EVERY);
        assert!(rx.try_recv().is_err(), "announced once");

        // A phase change goes out at once and takes the held progress with it.
        changes.notify(OwnerKind::Backup, "b", vec![7], Urgency::Progress);
        changes.notify(OwnerKind::Backup, "b", vec![5], Urgency::Now);
        let now = rx.try_recv().unwrap();
        assert_eq!(now.rows, vec![5, 7]);
        tokio::time::sleep(PROGRESS_EVERY * 2).await;
        assert!(rx.try_recv().is_err(), "nothing was left to announce");

        // Owners nobody watches cost nothing and hold nothing.
        changes.notify(OwnerKind::Restore, "b", vec![1], Urgency::Progress);
        assert!(!lock(&changes.watched).contains_key(&(OwnerKind::Restore, "b".to_string())));
    }
}
