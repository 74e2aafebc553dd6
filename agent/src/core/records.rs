//! Keeping each owner's `-itemoperations.json.gz` in step with the database.
//!
//! The file is rewritten from committed state when the owner leaves InProgress, when
//! one of its operations fails, and when it reaches a finalize or terminal phase. A
//! write that fails (storage not writable, disk full) is logged and remembered; the
//! poller retries it on its next tick, and any later change of the owner retries it too.

use std::path::PathBuf;

use opmon_client::{ItemOperation, OwnerKind};

use super::Core;
use crate::error::Error;
use crate::store::queries;
use crate::store::StoreError;

impl Core {
    /// Writes the owner's item-operations file now; returns its path.
    pub(super) async fn write_records(
        &self,
        kind: OwnerKind,
        name: &str,
    ) -> Result<PathBuf, Error> {
        let storage = self.storage.clone();
        let key = name.to_string();
        let written = self
            .store
            .read(move |conn| {
                let Some(row) = queries::owner_by_name(conn, kind, &key)? else {
                    return Err(Error::NotFound(format!("{kind} {key} not found")));
                };
                let records: Vec<ItemOperation> = queries::operations(conn, row.id, None)?
                    .iter()
                    .map(|op| ItemOperation::from_operation(&row.owner, op))
                    .collect();
                storage
                    .write_item_operations(kind, &key, &records)
                    .map_err(|e| {
                        Error::Storage(StoreError {
                            disk_full: e.raw_os_error() == Some(nix::libc::ENOSPC),
                            message: e.to_string(),
                        })
                    })
            })
            .await;
        let mut pending = self
            .records_pending
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match &written {
            Ok(_) | Err(Error::NotFound(_)) => {
                pending.remove(&(kind, name.to_string()));
            }
            Err(_) => {
                pending.insert((kind, name.to_string()));
            }
        }
        written
    }

    /// Writes the files of `owners`, logging failures (they are retried later).
    pub(super) async fn refresh_records(
        &self,
        owners: impl IntoIterator<Item = (OwnerKind, String)>,
    ) {
        for (kind, name) in owners {
            if let Err(e) = self.write_records(kind, &name).await {
                tracing::warn!(%kind, owner = %name, error = %e,
                    "writing the item-operations file failed; will retry");
            }
        }
    }

    /// Retries the files whose last write failed.
    pub(super) async fn retry_records(&self) {
        let pending: Vec<(OwnerKind, String)> = {
            let set = self
                .records_pending
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            set.iter().cloned().collect()
        };
        if !pending.is_empty() {
            self.refresh_records(pending).await;
        }
    }
}
