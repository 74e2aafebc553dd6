//! Subscriptions: a stream of [`OwnerUpdate`]s for one owner, fed by the change
//! notifications of every commit that touches it, ending after its terminal phase.
//! The first update carries all operations; later ones only those that changed, except
//! after the subscriber lagged, when it gets everything again. An update for a change
//! is read and serialized once, by whichever subscriber of the owner gets there
//! first; the others send the same bytes while any of them still holds it (the change
//! channel keeps no rendering: its last changes would hold them long after).

use std::sync::Arc;

use opmon_client::{OwnerKind, OwnerUpdate};
use tokio::sync::broadcast::{
    self,
    error::{RecvError, TryRecvError},
};

use super::Core;
use crate::changes::{Changed, Rendered};
use crate::error::{Error, NotFound};
use crate::store::queries;

/// The updates of one owner, as one subscriber sees them.
///
/// Waiting for a change ([`OwnerStream::changed`]) reads nothing; the update is rendered
/// only when the subscriber is ready to send it ([`OwnerStream::take`]), so a subscriber
/// held back by a slow peer holds no rendered update, and changes that pile up meanwhile
/// are sent as one (everything, marked `lagged`, once it fell behind the channel).
pub struct OwnerStream {
    core: Arc<Core>,
    kind: OwnerKind,
    name: String,
    changes: broadcast::Receiver<Changed>,
    done: bool,
    pending: Option<Pending>,
}

/// What the next update must carry.
enum Pending {
    /// All operations (the first update, or after falling behind).
    Everything { lagged: bool },
    /// The operations of one change; its rendering is shared with the other subscribers.
    One(Changed),
    /// The operations of several changes.
    Rows(Vec<i64>),
}

impl OwnerStream {
    /// Waits until there is an update to send; false once the owner was terminal (or
    /// deleted) and said so. Cancel-safe.
    pub async fn changed(&mut self) -> bool {
        if self.done {
            return false;
        }
        if self.pending.is_some() {
            return true;
        }
        loop {
            match self.changes.recv().await {
                Ok(change) => {
                    self.pending = Some(Pending::One(change));
                    return true;
                }
                Err(RecvError::Lagged(_)) => {
                    self.pending = Some(Pending::Everything { lagged: true });
                    return true;
                }
                Err(RecvError::Closed) => {
                    self.changes = self.core.changes.subscribe(self.kind, &self.name)
                }
            }
        }
    }

    /// The pending update, with whatever else changed since, serialized; `None` if
    /// nothing is pending or the stream is done.
    pub async fn take(&mut self) -> Option<Result<Arc<Rendered>, Error>> {
        let mut pending = self.pending.take()?;
        // Changes that arrived while this subscriber waited go out with this update.
        loop {
            let more = match self.changes.try_recv() {
                Ok(change) => change,
                Err(TryRecvError::Lagged(_)) => {
                    pending = Pending::Everything { lagged: true };
                    continue;
                }
                Err(TryRecvError::Empty | TryRecvError::Closed) => break,
            };
            pending = match pending {
                Pending::Everything { lagged } => Pending::Everything { lagged },
                Pending::One(first) => Pending::Rows([&first.rows[..], &more.rows[..]].concat()),
                Pending::Rows(mut rows) => {
                    rows.extend_from_slice(&more.rows);
                    Pending::Rows(rows)
                }
            };
        }
        let (core, kind, name) = (&self.core, self.kind, self.name.as_str());
        let update = match pending {
            Pending::Everything { lagged } => core.render(kind, name, None, lagged).await,
            Pending::One(change) => {
                let mut shared = change.rendered.lock().await;
                match shared.upgrade() {
                    Some(rendered) => Ok(rendered),
                    None => {
                        let rendered = core.render(kind, name, Some(&change.rows), false).await;
                        if let Ok(rendered) = &rendered {
                            *shared = Arc::downgrade(rendered);
                        }
                        rendered
                    }
                }
            }
            Pending::Rows(mut rows) => {
                rows.sort_unstable();
                rows.dedup();
                core.render(kind, name, Some(&rows), false).await
            }
        };
        match &update {
            Ok(u) => self.done = u.terminal,
            Err(_) => self.done = true,
        }
        Some(update)
    }
}

impl Core {
    /// Starts a subscription to the owner; fails at once if it does not exist.
    pub async fn subscribe(
        self: &Arc<Self>,
        kind: OwnerKind,
        name: String,
    ) -> Result<OwnerStream, Error> {
        // Subscribe before the first read, so no change falls between them.
        let changes = self.changes.subscribe(kind, &name);
        self.get(kind, opmon_client::OwnerParams::current(&name))
            .await?;
        Ok(OwnerStream {
            core: self.clone(),
            kind,
            name,
            changes,
            done: false,
            pending: Some(Pending::Everything { lagged: false }),
        })
    }

    /// The owner now, with the operations in `rows` (all of them if `None`), as the
    /// JSON of an [`OwnerUpdate`].
    async fn render(
        &self,
        kind: OwnerKind,
        name: &str,
        rows: Option<&[i64]>,
        lagged: bool,
    ) -> Result<Arc<Rendered>, Error> {
        let name = name.to_string();
        let rows = rows.map(<[i64]>::to_vec);
        self.store
            .read(move |conn| {
                let row = queries::owner_by_name(conn, kind, &name)?
                    .ok_or_else(|| Error::NotFound(NotFound::Deleted(kind, name.clone())))?;
                let operations = match rows {
                    Some(rows) => queries::operations_by_rows(conn, row.id, &rows)?,
                    None => queries::operations(conn, row.id, None)?,
                };
                let terminal = row.owner.phase.is_terminal();
                let update = OwnerUpdate {
                    owner: super::owners::with_progress(conn, row)?,
                    operations,
                    lagged,
                };
                // Plain data with string keys always serializes.
                let json = serde_json::value::to_raw_value(&update).unwrap_or_else(|e| {
                    tracing::error!(error = %e, "serializing an update failed");
                    serde_json::value::RawValue::NULL.to_owned()
                });
                Ok(Arc::new(Rendered { json, terminal }))
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use opmon_client::{GoDuration, OwnerKind, StartParams};

    use crate::core::{Core, CoreSettings};
    use crate::remote::CallSettings;
    use crate::storage_dir::StorageDir;
    use crate::store::Store;

    async fn core(dir: &std::path::Path) -> Arc<Core> {
        let store = Arc::new(Store::open(&dir.join("agent.db"), |_, _| {}).unwrap());
        let settings = CoreSettings {
            max_held_bytes: 64 * 1024 * 1024,
            poll_interval: Duration::from_secs(10),
            default_item_operation_timeout: GoDuration::from_secs(3600),
            retention: Duration::from_secs(3600),
            max_decompressed_size: u64::MAX,
            unreachable_grace: Duration::from_secs(600),
            allow_api_command_snapshotters: false,
            calls: CallSettings {
                deadline: Duration::from_secs(1),
                batch_size: 10,
                socket_concurrency: 1,
                command_concurrency: 1,
            },
            restore_finalize: false,
            in_progress_idle_timeout: None,
            finalize: Default::default(),
        };
        Core::new(
            store,
            StorageDir::new(dir.join("storage")),
            crate::metrics::Metrics::new(),
            settings,
        )
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn a_subscriber_that_falls_behind_is_told_and_gets_everything() {
        let dir = tempfile::tempdir().unwrap();
        let core = core(dir.path()).await;
        let start = StartParams {
            name: "b".into(),
            uid: "u".into(),
            ..Default::default()
        };
        core.start(OwnerKind::Backup, start, None).await.unwrap();
        let mut stream = core.subscribe(OwnerKind::Backup, "b".into()).await.unwrap();
        let parse = |r: Arc<crate::changes::Rendered>| {
            serde_json::from_str::<opmon_client::OwnerUpdate>(r.json.get()).unwrap()
        };
        assert!(stream.changed().await);
        let first = parse(stream.take().await.unwrap().unwrap());
        assert!(!first.lagged);
        // Far more changes than the buffer holds, none read: the committer never waits.
        for _ in 0..1000 {
            core.changes.notify(
                OwnerKind::Backup,
                "b",
                vec![12345],
                crate::changes::Urgency::Now,
            );
        }
        assert!(stream.changed().await);
        let next = parse(stream.take().await.unwrap().unwrap());
        assert!(next.lagged, "the subscriber is told it lagged");
        assert_eq!(next.owner.name, "b");
    }
}
