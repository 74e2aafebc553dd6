//! opmon-agent: the per-node daemon that monitors long-running backup and restore
//! plugin operations (see docs/architecture.md).
//!
//! A request travels socket → [`api`] (parse, validate) → [`core`] (decide, with the
//! pure [`phase`] machine) → [`store`] (commit) → reply. The poller, inside [`core`],
//! reaches snapshotters through [`remote`].

pub mod api;
pub mod caps;
pub mod changes;
pub mod clock;
pub mod config;
pub mod confine;
pub mod core;
pub mod edge;
pub mod error;
pub mod filework;
pub mod gojson;
pub mod log_limit;
pub mod metrics;
pub mod openrpc;
pub mod phase;
pub mod rate;
pub mod reload;
pub mod remote;
pub mod replica;
pub mod storage_dir;
pub mod store;
pub mod sync;
pub mod tarball;

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;

use crate::config::Settings;
use crate::core::Core;
use crate::edge::access::PeerCheck;
use crate::edge::server::{self, ServeConfig};
use crate::metrics::Metrics;
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

/// Refuses a socket directory that another user could use to put their own socket in
/// the agent's place: one owned by a uid other than the agent's or root, or one the
/// agent owns that its group or others may write. A root-owned directory others may
/// write (`/tmp`, a Kubernetes `emptyDir`) was shared on purpose by the administrator:
/// it is served, with a warning, since no other user can have made it.
fn check_socket_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir)
        .map_err(|e| format!("reading the socket directory {}: {e}", dir.display()))?;
    let own = nix::unistd::geteuid().as_raw();
    let shared = meta.mode() & 0o022 != 0;
    if meta.uid() != own && meta.uid() != 0 {
        return Err(format!(
            "the socket directory {} belongs to uid {}, not to the agent's uid {own}: \
             another user could replace the socket; remove it or choose another `socket`",
            dir.display(),
            meta.uid()
        ));
    }
    if shared && meta.uid() == own {
        return Err(format!(
            "the socket directory {} may be written by its group or others (mode {:04o}): \
             another user could replace the socket; `chmod go-w` it or choose another `socket`",
            dir.display(),
            meta.mode() & 0o7777
        ));
    }
    if shared {
        tracing::warn!(dir = %dir.display(), mode = format!("{:04o}", meta.mode() & 0o7777),
            "the socket directory is root's and others may write it: clients must check \
             who serves the socket (the opmon client does)");
    }
    Ok(())
}

/// The listening socket: the one systemd passed (socket activation, `LISTEN_FDS`), or
/// one bound here with the configured mode and group.
async fn listener(settings: &Settings) -> Result<(tokio::net::UnixListener, bool), String> {
    let passed: Vec<_> = sd_notify::listen_fds()
        .map_err(|e| format!("reading LISTEN_FDS: {e}"))?
        .collect();
    if let Some(&fd) = passed.first() {
        use std::os::fd::FromRawFd;
        // SAFETY: systemd hands us this descriptor to own (sd_listen_fds protocol); it is
        // taken exactly once, here.
        let std_listener = unsafe { std::os::unix::net::UnixListener::from_raw_fd(fd) };
        let passed_error =
            |e: &dyn std::fmt::Display| format!("using the socket passed by systemd: {e}");
        // Snapshotter commands must not inherit the listening socket.
        nix::fcntl::fcntl(
            &std_listener,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        )
        .map_err(|e| passed_error(&e))?;
        std_listener
            .set_nonblocking(true)
            .map_err(|e| passed_error(&e))?;
        tracing::info!(fd, "serving on the socket passed by systemd");
        let listener =
            tokio::net::UnixListener::from_std(std_listener).map_err(|e| passed_error(&e))?;
        return Ok((listener, true));
    }
    if let Some(parent) = settings.socket.parent() {
        let parent = match parent.as_os_str().is_empty() {
            true => Path::new("."),
            false => parent,
        };
        ensure_dir(parent, 0o750, "socket directory")?;
        check_socket_dir(parent)?;
    }
    let listener = server::bind(&settings.socket, settings.socket_mode_bits())
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AddrInUse => format!("{e}: is another opmon-agent running?"),
            _ => e.to_string(),
        })?;
    if let Some(gid) = settings.socket_gid()? {
        nix::unistd::chown(
            &settings.socket,
            None,
            Some(nix::unistd::Gid::from_raw(gid)),
        )
        .map_err(|e| format!("giving {} to group {gid}: {e}", settings.socket.display()))?;
    }
    Ok((listener, false))
}

/// Runs the agent until SIGTERM or SIGINT: opens the database, serves the socket,
/// polls; then stops accepting, finishes in-flight requests and closes the database.
/// SIGHUP reloads what [`reload`] says, through `reload_with`.
pub async fn run(settings: Settings, reload_with: reload::Reload) -> Result<(), String> {
    // First of all, so SIGTERM during start-up still means a clean stop, and SIGHUP
    // (whose default action ends the process) waits for the reloader.
    let terminated = opmon_snapshotter::termination();
    let mut hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .map_err(|e| format!("installing the SIGHUP handler: {e}"))?;
    caps::check_limits();
    for warning in &settings.warnings {
        tracing::warn!("{warning}");
    }
    ensure_dir(&settings.state_dir, 0o700, "state directory")?;
    store::log_sqlite_errors();
    let db = settings.database();
    let storage = storage_dir::StorageDir::new(settings.storage_dir.clone());
    storage.check_database(&db, settings.start_anew)?;
    replica::repair_modes(&db)?;
    let metrics = Metrics::new();
    let committed = metrics.clone();
    let store = Arc::new(
        Store::open(&db, move |size, took| committed.committed(size, took))
            .map_err(|e| e.to_string())?,
    );
    replica::apply(&store, settings.checkpoint)
        .await
        .map_err(|e| e.to_string())?;
    // A passed socket belongs to systemd's socket unit: it is never removed here.
    let (listener, activated) = listener(&settings).await?;
    // Without the mark the database is only unguarded, which is no reason not to serve.
    if let Err(e) = storage.mark_ran() {
        tracing::warn!(error = %e, "could not mark the storage directory as used");
    }
    let core = Core::new(store.clone(), storage, metrics.clone(), settings.core())
        .await
        .map_err(|e| e.to_string())?;
    // Checked when the settings were resolved.
    for s in &settings.snapshotters {
        remote::warn_if_unrunnable(s);
        core.register_snapshotter(s.clone())
            .await
            .map_err(|e| format!("registering snapshotter {} from the config: {e}", s.name))?;
    }
    core.recover().await.map_err(|e| e.to_string())?;
    let page_core = core.clone();
    let page: server::MetricsPage = Arc::new(move |accept| {
        let core = page_core.clone();
        Box::pin(async move { core.metrics_page(accept.as_deref()).await })
    });
    let stop_metrics = tokio_util::sync::CancellationToken::new();
    if let Some(address) = settings.metrics_address() {
        edge::metrics_listener::serve(address, page.clone(), stop_metrics.clone()).await?;
    }
    let background = tokio::spawn({
        let core = core.clone();
        async move { core.run_background().await }
    });
    tracing::info!(socket = %settings.socket.display(), database = %db.display(), "serving");
    let config = ServeConfig {
        max_request_body_size: settings.max_request_size,
        idle_timeout: Some(settings.idle_timeout.0),
        metrics: Some(page),
        answered: Some(Arc::new({
            let metrics = metrics.clone();
            move |method: &str, code| metrics.rpc(method, code)
        })),
        held: core.held_bytes(),
        ..ServeConfig::default()
    };
    let admission = PeerCheck::new(
        &settings.allowed_uids,
        &settings.allowed_gids,
        settings.max_connections_per_uid,
        caps::CONNECTIONS,
        metrics.clone(),
    );
    let reloader = tokio::spawn({
        let core = core.clone();
        let mut running = settings.clone();
        async move {
            while hangups.recv().await.is_some() {
                tracing::info!("SIGHUP: reloading the configuration");
                reload::reload(&core, &mut running, &reload_with).await;
            }
        }
    });
    if let Err(e) = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]) {
        tracing::debug!(error = %e, "notifying systemd failed");
    }
    // Finalize's file work stops at the signal, not after the requests waiting on it.
    // A commit that could not be made durable stops the agent too: nothing after it
    // can be acknowledged.
    let stopper = core.clone();
    let failing = store.clone();
    let shutdown = async move {
        tokio::select! {
            () = terminated => {}
            lost = failing.durability_lost() => {
                tracing::error!(error = %lost, "stopping: the database cannot be made durable");
            }
        }
        stopper.stop_requests();
    };
    server::serve(
        listener,
        api::rpc_module(core.clone()),
        config,
        admission,
        shutdown,
    )
    .await;
    tracing::info!("stopping: requests finished");
    reloader.abort();
    let _ = reloader.await;
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    stop_metrics.cancel();
    core.stop();
    let _ = background.await;
    core.write_log_counts();
    if !activated {
        let _ = std::fs::remove_file(&settings.socket);
    }
    drop(core);
    let failure = store.durability_failure();
    tokio::task::spawn_blocking(move || store.close())
        .await
        .map_err(|e| format!("closing the database: {e}"))?;
    if let Some(failure) = failure {
        return Err(failure.to_string());
    }
    tracing::info!("stopped");
    Ok(())
}
