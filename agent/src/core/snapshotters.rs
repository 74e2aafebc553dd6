//! `snapshotter.*`: the registry of who owns which plugin's operations. The database
//! is the record; the in-memory registry follows each commit.

use opmon_client::Snapshotter;

use super::Core;
use crate::error::{Error, NotFound};
use crate::store::queries;

impl Core {
    /// Registers or replaces a snapshotter (already validated).
    pub async fn register_snapshotter(&self, s: Snapshotter) -> Result<Snapshotter, Error> {
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
        Ok(removed)
    }
}
