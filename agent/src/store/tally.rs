//! `agent.status`'s counts (owners by phase, unfinished operations), kept in memory
//! between commits so a status request reads no database.
//!
//! The writer thread, which runs every transaction, forgets the counts when it opens one
//! and again when it has ended it; a count read from the database is kept only if no
//! transaction was open or ended while it was read. So the cache is right whichever
//! code wrote, with no rule for callers to remember.

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
    /// A transaction is open.
    writing: bool,
    /// Transactions ended so far.
    generation: u64,
    counts: Option<Counts>,
}

/// What a reader saw before reading the database: hand it back to [`Tally::keep`].
pub struct Seen {
    generation: u64,
}

impl Tally {
    /// The writer opens a transaction.
    pub fn begin(&self) {
        let mut s = lock(&self.0);
        s.writing = true;
        s.counts = None;
    }

    /// The writer has committed or rolled back its transaction.
    pub fn end(&self) {
        let mut s = lock(&self.0);
        s.writing = false;
        s.generation += 1;
        s.counts = None;
    }

    /// The counts if they are known now; else what to pass to [`Tally::keep`] with the
    /// counts read from the database next.
    pub fn cached(&self) -> Result<Counts, Seen> {
        let s = lock(&self.0);
        match &s.counts {
            Some(counts) if !s.writing => Ok(counts.clone()),
            _ => Err(Seen {
                generation: s.generation,
            }),
        }
    }

    /// Keeps `counts`, read after `seen`, unless a transaction was open or ended since.
    pub fn keep(&self, seen: Seen, counts: &Counts) {
        let mut s = lock(&self.0);
        if !s.writing && s.generation == seen.generation {
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
    fn counts_read_across_a_transaction_are_not_kept() {
        let tally = Tally::default();
        let Err(seen) = tally.cached() else {
            panic!("nothing is cached at first")
        };
        tally.begin();
        tally.keep(seen, &counts(1));
        assert!(tally.cached().is_err(), "read while a transaction was open");
        tally.end();
        assert!(
            tally.cached().is_err(),
            "forgotten at the end of a transaction"
        );

        let Err(seen) = tally.cached() else {
            panic!("nothing is cached yet")
        };
        tally.begin();
        tally.end();
        tally.keep(seen, &counts(2));
        assert!(
            tally.cached().is_err(),
            "a transaction ended while it was read"
        );

        let Err(seen) = tally.cached() else {
            panic!("nothing is cached yet")
        };
        tally.keep(seen, &counts(3));
        assert_eq!(tally.cached().ok(), Some(counts(3)));
        tally.begin();
        assert!(tally.cached().is_err(), "a transaction is open");
    }
}
