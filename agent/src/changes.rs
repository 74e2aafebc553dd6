//! Change notification: who is waiting on which owner.
//!
//! After a commit that changed an owner or its operations, the committer calls
//! [`Changes::notify`]; `wait` (and later subscriptions) hold a receiver and re-read the
//! owner when told. A notification carries no state, so a lagging receiver loses
//! nothing: it re-reads the latest committed state.

use std::collections::HashMap;
use std::sync::Mutex;

use opmon_client::OwnerKind;
use tokio::sync::broadcast;

type Key = (OwnerKind, String);

#[derive(Default)]
pub struct Changes {
    senders: Mutex<HashMap<Key, broadcast::Sender<()>>>,
}

impl Changes {
    /// A receiver told of every later change to the owner.
    pub fn subscribe(&self, kind: OwnerKind, name: &str) -> broadcast::Receiver<()> {
        let mut senders = self.senders.lock().unwrap_or_else(|p| p.into_inner());
        senders
            .entry((kind, name.to_string()))
            .or_insert_with(|| broadcast::channel(16).0)
            .subscribe()
    }

    /// Tells the owner's receivers that it changed; forgets owners nobody watches.
    pub fn notify(&self, kind: OwnerKind, name: &str) {
        let mut senders = self.senders.lock().unwrap_or_else(|p| p.into_inner());
        let key = (kind, name.to_string());
        if let Some(sender) = senders.get(&key) {
            if sender.send(()).is_err() {
                senders.remove(&key);
            }
        }
    }
}
