//! Keeping each owner's `-itemoperations.json.gz` in step with the database.
//!
//! The file is rewritten from committed state when the owner leaves InProgress, when
//! one of its operations fails, and when it reaches a finalize or terminal phase. The
//! change that makes a rewrite due marks it in `records_due` in its own transaction, so
//! a crash (or a write that fails: storage not writable, disk full) before the file is
//! written loses nothing: the poller retries marked files on every tick, and a restart
//! finds them still marked. A mark is cleared only once a file written from state at
//! least as new as the mark is durably in place (fsynced and renamed).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use opmon_client::{ItemOperation, OwnerKind};

use super::{require, Core, Running};
use crate::error::Error;
use crate::store::queries;
use crate::store::StorageFailure;
use crate::sync::lock;

/// Marks of `records_due` (owner row, generation) whose file has been written since
/// they were read, to be cleared in one transaction on the next tick (a crash before
/// that only repeats a write).
#[derive(Default)]
pub(super) struct WrittenMarks(Mutex<Vec<(i64, i64)>>);

impl WrittenMarks {
    fn push(&self, mark: (i64, i64)) {
        lock(&self.0).push(mark);
    }

    fn take(&self) -> Vec<(i64, i64)> {
        std::mem::take(&mut *lock(&self.0))
    }
}

/// Marked files looked up per database read while retrying.
const RETRY_PAGE: i64 = 256;

impl Core {
    /// Writes the owner's item-operations file now; returns its path.
    pub(super) async fn write_records(
        &self,
        kind: OwnerKind,
        name: &str,
    ) -> Result<PathBuf, Error> {
        let _held = self.name_locks.lock(kind, name).await;
        self.write_records_locked(kind, name).await
    }

    /// [`Core::write_records`] with the owner's name lock already held.
    async fn write_records_locked(&self, kind: OwnerKind, name: &str) -> Result<PathBuf, Error> {
        let storage = self.storage.clone();
        let key = name.to_string();
        let (path, mark) = self
            .store
            .read(move |conn| {
                let row = require(conn, kind, &key)?;
                // Read in the same snapshot as the records: the file holds this mark's
                // state or newer.
                let mark = queries::records_due_generation(conn, row.id)?
                    .map(|generation| (row.id, generation));
                let records: Vec<ItemOperation> = queries::operations(conn, row.id, None)?
                    .iter()
                    .map(|op| ItemOperation::from_operation(&row.owner, op))
                    .collect();
                let path = storage
                    .write_item_operations(kind, &key, &records)
                    .map_err(|e| {
                        Error::Storage(StorageFailure {
                            disk_full: e.raw_os_error() == Some(nix::libc::ENOSPC),
                            message: e.to_string(),
                        })
                    })?;
                Ok::<_, Error>((path, mark))
            })
            .await?;
        if let Some(mark) = mark {
            self.records_written.push(mark);
        }
        Ok(path)
    }

    /// Writes the files of `owners`, logging failures (they stay marked and are retried).
    pub(super) async fn refresh_records(
        &self,
        owners: impl IntoIterator<Item = (OwnerKind, String)>,
    ) {
        for (kind, name) in owners {
            match self.write_records(kind, &name).await {
                Ok(_) | Err(Error::NotFound(_)) => {}
                Err(e) => tracing::warn!(%kind, owner = %name, error = %e,
                    "writing the item-operations file failed; will retry"),
            }
        }
    }

    /// Clears the marks of the files written since the last call.
    pub(super) async fn flush_records_written(&self) {
        let written = self.records_written.take();
        if written.is_empty() {
            return;
        }
        let cleared = self
            .store
            .write(move |conn| queries::clear_records_due(conn, &written).map_err(Error::from))
            .await;
        if let Err(e) = cleared {
            // The marks stay; their files are only written once more.
            tracing::warn!(error = %e, "clearing written item-operations marks failed");
        }
    }

    /// Starts a retry of every marked file in the background, unless one is running.
    pub(super) fn spawn_records_retry(self: &Arc<Self>) {
        let core = self.clone();
        self.sweeps.spawn(async move {
            let Some(_running) = Running::start(&core.retrying_records) else {
                return;
            };
            // Not dropped at a stop: a write cut off between the rename and taking its
            // mark would leave the mark for a clean stop to clear. It checks for the
            // stop between files instead.
            core.retry_records().await;
        });
    }

    /// Writes every marked file, a page at a time. A file whose owner's lock is held is
    /// being written or removed right now and is left to that.
    async fn retry_records(&self) {
        self.flush_records_written().await;
        let mut after = 0;
        loop {
            let page = self
                .store
                .read(move |conn| {
                    queries::records_due(conn, after, RETRY_PAGE).map_err(Error::from)
                })
                .await;
            let page = match page {
                Ok(page) => page,
                Err(e) => {
                    tracing::warn!(error = %e, "finding item-operations files to write failed");
                    return;
                }
            };
            let Some(last) = page.last() else {
                return;
            };
            after = last.0;
            let full = page.len() as i64 == RETRY_PAGE;
            for (_, kind, name) in page {
                if self.stopping.is_cancelled() {
                    break;
                }
                let Some(_held) = self.name_locks.try_lock(kind, &name) else {
                    continue;
                };
                match self.write_records_locked(kind, &name).await {
                    Ok(path) => tracing::info!(%kind, owner = %name, file = %path.display(),
                        "item-operations file written"),
                    Err(Error::NotFound(_)) => {}
                    Err(e) => tracing::warn!(%kind, owner = %name, error = %e,
                        "writing the item-operations file failed; will retry"),
                }
            }
            self.flush_records_written().await;
            if !full || self.stopping.is_cancelled() {
                return;
            }
        }
    }
}
