//! `agent.status`'s counts (owners by phase, unfinished operations), kept in memory
//! between commits so a status request reads no database.
//!
//! The counts are sums over the `owners` table alone. The writer thread, which runs
//! every transaction, sees through SQLite's update hook whether a transaction changed
//! an `owners` row (directly or through a trigger) and forgets the counts when such a
//! transaction has ended; a count read from the database is kept only if no such
//! transaction ended while it was read. So the cache is right whichever code wrote,
//! with no rule for callers to remember, and the sweep's progress-only commits, which
//! touch no owner, leave it in place.

use std::collections::BTreeMap;
use std::sync::Mutex;

use opmon_client::OwnerPhase;

use crate::sync::lock;

/// Owners by phase, and unfinished operations in all.
pub type Counts = (BTreeMap<OwnerPhase, u64>, u64);

#[derive(Default)]
pub struct Tally(Mutex<State>);

#[derive(Default)]
struct State {
    /// Transactions that changed an owner, ended so far.
    generation: u64,
    counts: Option<Counts>,
}

/// What a reader saw before reading the database: hand it back to [`Tally::keep`].
pub struct Seen {
    generation: u64,
}

impl Tally {
    /// The writer has committed or rolled back a transaction; `owners_changed` if it
    /// changed an `owners` row. Until then a database read gives what the cache holds:
    /// the last commit's counts.
    pub fn end(&self, owners_changed: bool) {
        if owners_changed {
            let mut s = lock(&self.0);
            s.generation += 1;
            s.counts = None;
        }
    }

    /// The counts if they are known now; else what to pass to [`Tally::keep`] with the
    /// counts read from the database next.
    pub fn cached(&self) -> Result<Counts, Seen> {
        let s = lock(&self.0);
        match &s.counts {
            Some(counts) => Ok(counts.clone()),
            None => Err(Seen {
                generation: s.generation,
            }),
        }
    }

    /// Keeps `counts`, read after `seen`, unless a transaction that changed an owner
    /// ended since (the read may have seen the state before it or after it).
    pub fn keep(&self, seen: Seen, counts: &Counts) {
        let mut s = lock(&self.0);
        if s.generation == seen.generation {
            s.counts = Some(counts.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(n: u64) -> Counts {
        (BTreeMap::from([(OwnerPhase::InProgress, n)]), n)
    }

    #[test]
    fn counts_read_across_a_change_of_owners_are_not_kept() {
        let tally = Tally::default();
        let Err(seen) = tally.cached() else {
            panic!("nothing is cached at first")
        };
        tally.end(true);
        tally.keep(seen, &counts(1));
        assert!(
            tally.cached().is_err(),
            "a transaction that changed owners ended while it was read"
        );

        let Err(seen) = tally.cached() else {
            panic!("nothing is cached yet")
        };
        tally.end(false);
        tally.keep(seen, &counts(2));
        assert_eq!(
            tally.cached().ok(),
            Some(counts(2)),
            "a transaction that changed no owner changes no count"
        );
        tally.end(false);
        assert_eq!(tally.cached().ok(), Some(counts(2)));
        tally.end(true);
        assert!(tally.cached().is_err(), "forgotten once owners changed");
    }
}
