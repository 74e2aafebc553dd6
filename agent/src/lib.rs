//! opmon-agent: the per-node daemon that monitors long-running backup and restore
//! plugin operations (see ARCHITECTURE.md).
//!
//! A request travels socket → [`api`] (parse, validate) → [`core`] (decide, with the
//! pure [`phase`] machine) → [`store`] (commit) → reply. The poller, inside [`core`],
//! reaches snapshotters through [`remote`].

pub mod api;
pub mod changes;
pub mod config;
pub mod core;
pub mod error;
pub mod phase;
pub mod remote;
pub mod storage;
pub mod store;
pub mod tarball;

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;

use opmon_client::server::{self, AdmitAll, ServeConfig};

use crate::config::Settings;
use crate::core::Core;
use crate::store::Store;

/// Creates `dir` (and parents) with `mode` if it does not exist yet.
fn ensure_dir(dir: &Path, mode: u32, what: &str) -> Result<(), String> {
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(dir)
        .map_err(|e| format!("creating {what} {}: {e}", dir.display()))?;
    // The umask may have narrowed the mode; the socket's group needs what we asked for.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("setting mode of {what} {}: {e}", dir.display()))
}

/// Runs the agent until SIGTERM or SIGINT: opens the database, serves the socket,
/// polls; then stops accepting, finishes in-flight requests and closes the database.
pub async fn run(settings: Settings) -> Result<(), String> {
    ensure_dir(&settings.state_dir, 0o700, "state directory")?;
    let db = settings.database();
    let store = Arc::new(Store::open(&db, |_| {}).map_err(|e| e.to_string())?);
    if let Some(parent) = settings.socket.parent() {
        ensure_dir(parent, 0o750, "socket directory")?;
    }
    let listener = server::bind(&settings.socket, 0o660)
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AddrInUse => format!("{e}: is another opmon-agent running?"),
            _ => e.to_string(),
        })?;
    let storage = storage::Storage::new(settings.storage_dir.clone());
    let core = Core::new(store.clone(), storage, settings.core.clone())
        .await
        .map_err(|e| e.to_string())?;
    core.recover().await.map_err(|e| e.to_string())?;
    let background = tokio::spawn({
        let core = core.clone();
        async move { core.run_background().await }
    });
    tracing::info!(socket = %settings.socket.display(), database = %db.display(), "serving");
    let config = ServeConfig {
        max_request_body_size: settings.max_request_size,
        ..ServeConfig::default()
    };
    server::serve(
        listener,
        api::rpc_module(core.clone()),
        config,
        AdmitAll,
        opmon_client::snapshotter::termination(),
    )
    .await;
    tracing::info!("stopping: requests finished");
    core.stop();
    let _ = background.await;
    let _ = std::fs::remove_file(&settings.socket);
    drop(core);
    tokio::task::spawn_blocking(move || store.close())
        .await
        .map_err(|e| format!("closing the database: {e}"))?;
    tracing::info!("stopped");
    Ok(())
}
