//! The agent's one policy for its in-memory state behind `std::sync::Mutex` and
//! `RwLock`:
//!
//! - A lock is held for a few statements on the data it guards, never across an
//!   `.await`, a database call or a call to a snapshotter. (Turns that must span awaits,
//!   such as an owner's name lock, are `tokio::sync::Mutex`es taken through their owner.)
//! - Every critical section leaves the data consistent after each statement (an insert, a
//!   removal, a take), so a panic in another holder cannot leave it half-changed; a
//!   poisoned lock is therefore taken as it is. Refusing it instead would stop, for good,
//!   whatever the lock guards: polling a snapshotter, announcing changes.
//!
//! [`lock`], [`read`] and [`write`] are the only ways the agent takes such a lock.

use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Takes `mutex`, whether or not a holder panicked (see the module's policy).
pub fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Reads `rw`, whether or not a writer panicked (see the module's policy).
pub fn read<T: ?Sized>(rw: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    rw.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Writes `rw`, whether or not a writer panicked (see the module's policy).
pub fn write<T: ?Sized>(rw: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    rw.write().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_still_taken_with_its_data() {
        let m = std::sync::Arc::new(Mutex::new(vec![1]));
        let held = m.clone();
        let _ = std::thread::spawn(move || {
            let mut v = held.lock().unwrap();
            v.push(2);
            panic!("a holder panics");
        })
        .join();
        assert!(m.is_poisoned());
        assert_eq!(*lock(&m), vec![1, 2]);
    }
}
