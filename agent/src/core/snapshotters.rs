//! `snapshotter.*`: the registry of who owns which plugin's operations. The database
//! is the record; the in-memory registry follows each commit. Registrations over the API
//! are bounded for all peers together ([`caps::SNAPSHOTTERS`]), counted in memory; the
//! config file's are the operator's and are not counted.

use std::collections::HashSet;
use std::sync::Mutex;

use opmon_client::Snapshotter;

use super::Core;
use crate::caps;
use crate::error::{Error, NotFound};
use crate::store::queries;
use crate::sync::lock;

/// The names of the snapshotters registered over the API.
#[derive(Default)]
pub(super) struct Registrations {
    by_name: Mutex<HashSet<String>>,
}

impl Core {
    /// Registers or replaces a snapshotter (already validated) from the config file.
    pub async fn register_snapshotter(&self, s: Snapshotter) -> Result<Snapshotter, Error> {
        let name = s.name.clone();
        let s = self.store_snapshotter(s).await?;
        lock(&self.registrations.by_name).remove(&name);
        Ok(s)
    }

    /// Registers or replaces a snapshotter (already validated) for a peer, within
    /// [`caps::SNAPSHOTTERS`]; replacing one costs nothing more.
    pub async fn register_snapshotter_from_api(
        &self,
        s: Snapshotter,
    ) -> Result<Snapshotter, Error> {
        let name = s.name.clone();
        {
            let by_name = lock(&self.registrations.by_name);
            if !by_name.contains(&name) && by_name.len() >= caps::SNAPSHOTTERS {
                return Err(Error::OverQuota(format!(
                    "{} snapshotters are registered over the API, all the agent takes; \
                     unregister one first",
                    by_name.len()
                )));
            }
        }
        let s = self.store_snapshotter(s).await?;
        lock(&self.registrations.by_name).insert(name);
        Ok(s)
    }

    /// Stores `s`.
    async fn store_snapshotter(&self, s: Snapshotter) -> Result<Snapshotter, Error> {
        let remote = self.poller.remotes.build(&s, &self.settings.calls);
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
