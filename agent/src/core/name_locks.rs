//! One lock per owner name (kind and name), held around the file work on that owner's
//! files: writing its item-operations file, or removing the files of a deleted owner of
//! that name. A removal checks, under the lock, that no owner of the name exists again,
//! and a write reads the owner under it, so an old removal never takes a re-created
//! owner's new file and two writes of one file land in the order they read the state.
//!
//! The map holds only names whose lock is held or awaited: an entry is dropped with its
//! last guard.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::sync::lock;
use opmon_client::OwnerKind;
use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

type Key = (OwnerKind, String);

#[derive(Default)]
pub struct NameLocks {
    held: Mutex<HashMap<Key, Arc<AsyncMutex<()>>>>,
}

/// The lock of one name, held until dropped.
pub struct NameGuard<'a> {
    locks: &'a NameLocks,
    key: Key,
    guard: Option<OwnedMutexGuard<()>>,
}

impl NameLocks {
    fn entry(&self, key: &Key) -> Arc<AsyncMutex<()>> {
        let mut held = lock(&self.held);
        held.entry(key.clone()).or_default().clone()
    }

    /// Waits for the lock of `kind`/`name`.
    pub async fn lock(&self, kind: OwnerKind, name: &str) -> NameGuard<'_> {
        let key = (kind, name.to_string());
        let guard = self.entry(&key).lock_owned().await;
        NameGuard {
            locks: self,
            key,
            guard: Some(guard),
        }
    }

    /// The lock of `kind`/`name` if nobody holds or awaits it.
    pub fn try_lock(&self, kind: OwnerKind, name: &str) -> Option<NameGuard<'_>> {
        let key = (kind, name.to_string());
        let guard = self.entry(&key).try_lock_owned().ok();
        let guard = NameGuard {
            locks: self,
            key,
            guard,
        };
        // Dropping a guard without the lock still tidies the map.
        guard.guard.is_some().then_some(guard)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.held).len()
    }
}

impl Drop for NameGuard<'_> {
    fn drop(&mut self) {
        self.guard.take();
        let mut held = lock(&self.locks.held);
        // Clones are made under this map lock, so a count of one (the map's) means no
        // one else holds or awaits this name.
        if held
            .get(&self.key)
            .is_some_and(|l| Arc::strong_count(l) == 1)
        {
            held.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_name_is_held_by_one_at_a_time_and_forgotten_when_free() {
        let locks = NameLocks::default();
        let first = locks.lock(OwnerKind::Backup, "b").await;
        assert!(locks.try_lock(OwnerKind::Backup, "b").is_none());
        assert!(
            locks.try_lock(OwnerKind::Restore, "b").is_some(),
            "kinds are separate names"
        );
        assert_eq!(locks.len(), 1);
        drop(first);
        assert_eq!(locks.len(), 0);
        let again = locks.try_lock(OwnerKind::Backup, "b");
        assert!(again.is_some());
        drop(again);
        assert_eq!(locks.len(), 0);
    }
}
