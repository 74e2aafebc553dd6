//! `snapshotter.*`: the registry of who owns which plugin's operations. The database
//! is the record; the in-memory registry follows each commit.

//!
//! A registration over the API is charged to the peer uid that made it (each one costs
//! connections or processes once polled), in a [`Budget`]: at most
//! `max_snapshotters_per_uid` per uid and `max_snapshotters` in all, of which uids other
//! than root and the agent's own take at most three quarters. The config file's
//! registrations are the operator's and are not charged. Charges are kept in memory:
//! after a restart, the registrations stored earlier count for no one.

use std::collections::HashMap;
use std::sync::Mutex;

use opmon_client::Snapshotter;

use super::Core;
use crate::budget::{Budget, Held};
use crate::error::{Error, NotFound};
use crate::store::queries;
use crate::sync::lock;

/// Who registered which snapshotter over the API.
pub(super) struct Registrations {
    budget: Budget,
    by_name: Mutex<HashMap<String, Held>>,
}

impl Registrations {
    pub(super) fn new(per_uid: u32, total: usize) -> Registrations {
        Registrations {
            budget: Budget::new("max_snapshotters_per_uid", "snapshotters", per_uid, total),
            by_name: Mutex::new(HashMap::new()),
        }
    }
}

impl Core {
    /// Registers or replaces a snapshotter (already validated) from the config file.
    pub async fn register_snapshotter(&self, s: Snapshotter) -> Result<Snapshotter, Error> {
        let name = s.name.clone();
        let s = self.store_snapshotter(s, None).await?;
        lock(&self.registrations.by_name).remove(&name);
        Ok(s)
    }

    /// Registers or replaces a snapshotter (already validated) for peer `uid`, within
    /// its quota; replacing one it registered costs nothing more.
    pub async fn register_snapshotter_for(
        &self,
        s: Snapshotter,
        uid: u32,
    ) -> Result<Snapshotter, Error> {
        let name = s.name.clone();
        let charge = {
            let by_name = lock(&self.registrations.by_name);
            let replaced = by_name.get(&name).and_then(Held::uid);
            if replaced == Some(uid) {
                None
            } else {
                Some(
                    self.registrations
                        .budget
                        .take(Some(uid))
                        .map_err(Error::OverQuota)?,
                )
            }
        };
        let s = self.store_snapshotter(s, Some(uid)).await?;
        if let Some(charge) = charge {
            lock(&self.registrations.by_name).insert(name, charge);
        }
        Ok(s)
    }

    /// Stores `s`, its answers charged to `uid` (`None`: the agent's own).
    async fn store_snapshotter(
        &self,
        s: Snapshotter,
        uid: Option<u32>,
    ) -> Result<Snapshotter, Error> {
        let remote = self.poller.remotes.build(&s, &self.settings.calls, uid);
        // A Velero plugin is started now, so that a binary that does not serve the name
        // is refused here rather than failing every operation later.
        if let crate::remote::Remote::Called(crate::remote::Caller::VeleroPlugin(v)) = &*remote {
            v.check_served()
                .await
                .map_err(|e| Error::InvalidParams(format!("veleroPlugin: {e}")))?;
        }
        let stored = s.clone();
        self.store
            .write(move |conn| queries::upsert_snapshotter(conn, &stored).map_err(Error::from))
            .await?;
        self.poller.remotes.put(&s, remote);
        tracing::info!(snapshotter = %s.name, "snapshotter registered");
        Ok(s)
    }

    /// The owners waiting on unfinished operations of snapshotter `name` (a few, named,
    /// and how many in all): what unregistering it would leave with nobody to poll.
    pub async fn owners_waiting_on(&self, name: &str) -> Result<(Vec<String>, i64), Error> {
        let plugin = name.to_string();
        self.store
            .read(move |conn| queries::owners_waiting_on(conn, &plugin, 5).map_err(Error::from))
            .await
    }

    /// Whether `snapshotter.register` may register a command snapshotter.
    pub fn allows_api_command_snapshotters(&self) -> bool {
        self.settings.allow_api_command_snapshotters
    }

    pub async fn snapshotters(&self) -> Result<Vec<Snapshotter>, Error> {
        self.store
            .read(|conn| queries::snapshotters(conn).map_err(Error::from))
            .await
    }

    pub async fn unregister_snapshotter(&self, name: String) -> Result<Snapshotter, Error> {
        let key = name.clone();
        let removed = self
            .store
            .write(move |conn| queries::delete_snapshotter(conn, &key).map_err(Error::from))
            .await?;
        let removed =
            removed.ok_or_else(|| Error::NotFound(NotFound::Snapshotter(name.clone())))?;
        self.poller.remotes.remove(&name);
        lock(&self.registrations.by_name).remove(&name);
        Ok(removed)
    }
}
