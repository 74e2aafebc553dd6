//! Removing owners and their files: expiry after the retention period, and the files of
//! deleted owners.
//!
//! Deleting an owner records the removal of its files (`removals`) in the same
//! transaction; the files go afterwards and the record is cleared only once they are
//! gone, so a crash in between leaves a record that the next start finishes, never an
//! orphaned directory. A removal takes the name's lock and skips the files if an owner
//! of that name exists again by then: they are the new owner's (its next write replaces
//! the item-operations file).
//!
//! Expiry runs as a background job in batches of [`EXPIRY_BATCH`] owners, each its own
//! transaction followed by its file removals, so other writes, polls and the watchdog
//! go on between batches however many owners expire at once.

use std::sync::Arc;
use std::time::SystemTime;

use super::{Core, Running};
use crate::clock::UnixMs;
use crate::error::Error;
use crate::storage_dir;
use crate::store::queries::{self, Removal};

/// Owners deleted per expiry transaction, and removal records finished per step.
const EXPIRY_BATCH: i64 = 256;

impl Core {
    /// Removes the files of `removals` (as far as no owner of their name exists again)
    /// and clears the records of those done. Failures are logged and left recorded.
    pub(super) async fn remove_files(&self, mut removals: Vec<Removal>) {
        if removals.is_empty() {
            return;
        }
        // One order for taking several names' locks; a holder of one never waits for
        // another, so this cannot deadlock.
        removals.sort_by(|a, b| (a.kind, &a.name).cmp(&(b.kind, &b.name)));
        let mut held = Vec::with_capacity(removals.len());
        for r in &removals {
            held.push(self.name_locks.lock(r.kind, &r.name).await);
        }
        let asked: Vec<(opmon_client::OwnerKind, String)> =
            removals.iter().map(|r| (r.kind, r.name.clone())).collect();
        let existing = self
            .store
            .read(move |conn| {
                let mut found = std::collections::HashSet::new();
                for kind in opmon_client::OwnerKind::ALL {
                    let names: Vec<&str> = asked
                        .iter()
                        .filter(|(k, _)| *k == kind)
                        .map(|(_, n)| n.as_str())
                        .collect();
                    for name in queries::existing_names(conn, kind, &names)? {
                        found.insert((kind, name));
                    }
                }
                Ok::<_, Error>(found)
            })
            .await;
        let existing = match existing {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(error = %e, "checking owners before removing files failed");
                return;
            }
        };
        let storage = self.storage.clone();
        let done = tokio::task::spawn_blocking(move || {
            let mut done = Vec::with_capacity(removals.len());
            for r in removals {
                if existing.contains(&(r.kind, r.name.clone())) {
                    tracing::debug!(kind = %r.kind, owner = %r.name,
                        "files kept: an owner of that name exists again");
                } else if let Err(e) = storage.remove_owner(r.kind, &r.name) {
                    tracing::warn!(kind = %r.kind, owner = %r.name, error = %e,
                        "removing its files failed; will retry");
                    continue;
                }
                done.push(r.id);
            }
            done
        })
        .await
        .unwrap_or_default();
        drop(held);
        if done.is_empty() {
            return;
        }
        let cleared = self
            .store
            .write(move |conn| queries::clear_removals(conn, &done).map_err(Error::from))
            .await;
        if let Err(e) = cleared {
            tracing::warn!(error = %e, "clearing removal records failed; they are repeated");
        }
    }

    /// Starts the expiry job in the background, unless it is running.
    pub(super) fn spawn_expiry(self: &Arc<Self>) {
        let core = self.clone();
        self.sweeps.spawn(async move {
            let Some(_running) = Running::start(&core.expiring) else {
                return;
            };
            tokio::select! {
                _ = core.stopping.cancelled() => {}
                result = core.expire() => {
                    if let Err(e) = result {
                        tracing::warn!(error = %e, "removing expired owners failed");
                    }
                }
            }
        });
    }

    /// Finishes the removals a crash or a failure left recorded, then removes terminal
    /// owners older than the retention period with their files, a batch at a time.
    /// Returns how many owners expired.
    async fn expire(&self) -> Result<usize, Error> {
        self.finish_removals().await?;
        let before = UnixMs::now().before(self.settings.retention);
        let mut expired = 0;
        loop {
            let batch = self
                .store
                .write(move |conn| {
                    queries::delete_expired(conn, before, EXPIRY_BATCH).map_err(Error::from)
                })
                .await?;
            let full = batch.len() as i64 == EXPIRY_BATCH;
            expired += batch.len();
            for r in &batch {
                tracing::info!(kind = %r.kind, owner = %r.name, "removed: past the retention period");
            }
            self.remove_files(batch).await;
            if !full {
                break;
            }
            // Let the requests and polls queued meanwhile go first.
            tokio::task::yield_now().await;
        }
        if expired > EXPIRY_BATCH as usize {
            tracing::info!(expired, "expiry done");
        }
        Ok(expired)
    }

    /// Finishes every recorded removal (left by a crash, or one that failed).
    async fn finish_removals(&self) -> Result<(), Error> {
        let mut after = 0;
        loop {
            let page = self
                .store
                .read(move |conn| queries::removals(conn, after, EXPIRY_BATCH).map_err(Error::from))
                .await?;
            let Some(last) = page.last() else {
                return Ok(());
            };
            after = last.id;
            let full = page.len() as i64 == EXPIRY_BATCH;
            tracing::info!(count = page.len(), "finishing recorded file removals");
            self.remove_files(page).await;
            if !full {
                return Ok(());
            }
        }
    }

    /// Removes the temporary files writes of an earlier run left behind (result files
    /// in the storage directory, finalize outputs there and in `finalize_dirs`), in the
    /// background: the directories may be large, and start-up must not wait.
    pub(super) fn spawn_temp_cleanup(&self) {
        let roots = self.finalizer.write_roots();
        // Files of this run's writes are newer than its start.
        let before = SystemTime::now();
        let stopping = self.stopping.clone();
        self.sweeps.spawn(async move {
            let walk = tokio::task::spawn_blocking(move || {
                roots
                    .iter()
                    .map(|root| {
                        storage_dir::remove_stale_temp_files(root, before, &|| {
                            stopping.is_cancelled()
                        })
                    })
                    .sum::<usize>()
            });
            match walk.await {
                Ok(removed) => {
                    tracing::info!(removed, "looked for temporary files left by an earlier run")
                }
                Err(e) => tracing::warn!(error = %e, "looking for stale temporary files failed"),
            }
        });
    }
}
