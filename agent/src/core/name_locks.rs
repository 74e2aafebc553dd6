//! Async locks by key, made when wanted and forgotten when free. [`NameLocks`]: one
//! lock per owner name (kind and name), held around the file work on that owner's
//! files: writing its item-operations file, or removing the files of a deleted owner of
//! that name. A removal checks, under the lock, that no owner of the name exists again,
//! and a write reads the owner under it, so an old removal never takes a re-created
//! owner's new file and two writes of one file land in the order they read the state.
//!
//! The map holds only keys whose lock is held or awaited: an entry is dropped with its
//! last guard. Finalize takes turns per owner and per output path with the same locks.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use crate::sync::lock;
use opmon_client::OwnerKind;
use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

/// One async lock per key, made when first wanted and forgotten with its last guard.
pub struct KeyedLocks<K> {
    held: Mutex<HashMap<K, Arc<AsyncMutex<()>>>>,
}

impl<K> Default for KeyedLocks<K> {
    fn default() -> Self {
        KeyedLocks {
            held: Mutex::new(HashMap::new()),
        }
    }
}

/// The lock of owner names: kind and name.
pub type NameLocks = KeyedLocks<(OwnerKind, String)>;

/// The lock of one key, held until dropped.
pub struct KeyGuard<'a, K: Eq + Hash> {
    locks: &'a KeyedLocks<K>,
    key: K,
    guard: Option<OwnedMutexGuard<()>>,
}

impl<K: Eq + Hash + Clone> KeyedLocks<K> {
    fn entry(&self, key: &K) -> Arc<AsyncMutex<()>> {
        let mut held = lock(&self.held);
        held.entry(key.clone()).or_default().clone()
    }

    /// Waits for the lock of `key`.
    pub async fn lock_key(&self, key: K) -> KeyGuard<'_, K> {
        let guard = self.entry(&key).lock_owned().await;
        KeyGuard {
            locks: self,
            key,
            guard: Some(guard),
        }
    }

    /// The lock of `key` if nobody holds or awaits it.
    pub fn try_lock_key(&self, key: K) -> Option<KeyGuard<'_, K>> {
        let guard = self.entry(&key).try_lock_owned().ok();
        let guard = KeyGuard {
            locks: self,
            key,
            guard,
        };
        // Dropping a guard without the lock still tidies the map.
        guard.guard.is_some().then_some(guard)
    }
}

impl NameLocks {
    /// Waits for the lock of `kind`/`name`.
    pub async fn lock(&self, kind: OwnerKind, name: &str) -> KeyGuard<'_, (OwnerKind, String)> {
        self.lock_key((kind, name.to_string())).await
    }

    /// The lock of `kind`/`name` if nobody holds or awaits it.
    pub fn try_lock(
        &self,
        kind: OwnerKind,
        name: &str,
    ) -> Option<KeyGuard<'_, (OwnerKind, String)>> {
        self.try_lock_key((kind, name.to_string()))
    }
}

impl<K: Eq + Hash> Drop for KeyGuard<'_, K> {
    fn drop(&mut self) {
        self.guard.take();
        let mut held = lock(&self.locks.held);
        // Clones are made under this map lock, so a count of one (the map's) means no
        // one else holds or awaits this key.
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

    impl<K: Eq + Hash + Clone> KeyedLocks<K> {
        fn len(&self) -> usize {
            lock(&self.held).len()
        }
    }

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
