//! `agent.status`'s counts (owners by phase, unfinished operations), kept in memory
//! between the commits that could change them, so a status request reads no database.
//!
//! Every write through [`Core::write`] empties the cache before it starts and again
//! once it has committed; a count read from the database is kept only if no such write
//! began or ended while it was read. The sweep's progress-only commits bypass
//! `Core::write`: they change no phase, so no count. Debug builds check that claim on
//! every request by comparing the cache with a fresh read.

use std::collections::BTreeMap;
use std::sync::MutexGuard;

use opmon_client::OwnerPhase;
use rusqlite::Connection;

use super::Core;
use crate::error::Error;
use crate::store::queries;

/// Owners by phase, and unfinished operations in all.
pub type Counts = (BTreeMap<OwnerPhase, u64>, u64);

#[derive(Default)]
pub struct Tally {
    /// Writes that began and have not yet committed (or failed).
    writing: u32,
    /// Writes finished so far.
    generation: u64,
    counts: Option<Counts>,
}

impl Core {
    fn tally(&self) -> MutexGuard<'_, Tally> {
        self.tally.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `work` in the write transaction; forgets the counts around it.
    pub(super) async fn write<T, F>(&self, work: F) -> Result<T, Error>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, Error> + Send + 'static,
    {
        {
            let mut t = self.tally();
            t.writing += 1;
            t.counts = None;
        }
        let result = self.store.write(work).await;
        let mut t = self.tally();
        t.writing -= 1;
        t.generation += 1;
        t.counts = None;
        result
    }

    /// The counts: from memory when no write is under way, else from the database.
    pub(super) async fn counts(&self) -> Result<Counts, Error> {
        let (cached, generation) = {
            let t = self.tally();
            let cached = if t.writing == 0 {
                t.counts.clone()
            } else {
                None
            };
            (cached, t.generation)
        };
        if let Some(counts) = &cached {
            if !cfg!(debug_assertions) {
                return Ok(counts.clone());
            }
        }
        let fresh = self
            .store
            .read(|conn| queries::tally(conn).map_err(Error::from))
            .await?;
        let mut t = self.tally();
        if t.writing == 0 && t.generation == generation {
            if let Some(cached) = cached {
                assert_eq!(
                    cached, fresh,
                    "the counts kept in memory differ from the database's"
                );
            }
            t.counts = Some(fresh.clone());
        }
        Ok(fresh)
    }
}
