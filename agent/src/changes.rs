//! Change notification: who is waiting on which owner.
//!
//! After a commit that changed an owner or its operations, the committer calls
//! [`Changes::notify`] with the rows of the operations that changed; `wait` and
//! subscriptions hold a receiver and re-read committed state when told. The channel is
//! bounded and never blocks the committer (the poller): a receiver that falls behind
//! is told it lagged and re-reads everything, so it loses nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use opmon_client::OwnerKind;
use tokio::sync::broadcast;

type Key = (OwnerKind, String);

/// Notifications buffered per owner before a slow receiver lags.
const BUFFER: usize = 64;

/// What changed in one commit: the rows of the owner's operations that changed (empty
/// when only the owner did).
pub type Changed = Arc<Vec<i64>>;

#[derive(Default)]
pub struct Changes {
    senders: Mutex<HashMap<Key, broadcast::Sender<Changed>>>,
}

impl Changes {
    /// A receiver told of every later change to the owner.
    pub fn subscribe(&self, kind: OwnerKind, name: &str) -> broadcast::Receiver<Changed> {
        let mut senders = self.senders.lock().unwrap_or_else(|p| p.into_inner());
        senders
            .entry((kind, name.to_string()))
            .or_insert_with(|| broadcast::channel(BUFFER).0)
            .subscribe()
    }

    /// Tells the owner's receivers that it changed; forgets owners nobody watches.
    pub fn notify(&self, kind: OwnerKind, name: &str, operations: Vec<i64>) {
        let mut senders = self.senders.lock().unwrap_or_else(|p| p.into_inner());
        let key = (kind, name.to_string());
        if let Some(sender) = senders.get(&key) {
            if sender.send(Arc::new(operations)).is_err() {
                senders.remove(&key);
            }
        }
    }
}
