//! SIGHUP: reload the configuration file's `[[snapshotter]]` tables and `log_level`.
//!
//! The file is read again and every setting resolved under the command line and
//! environment the agent started with (so flags and variables keep their precedence).
//! Invariants:
//! - All or nothing: a file that does not parse, a bad value or an invalid
//!   `[[snapshotter]]` table (resolving the settings checks each) refuses the whole
//!   reload, logged with the reason, and the running configuration stays as it was.
//! - Only `log_level` and the `[[snapshotter]]` tables change while running. A table
//!   that is new or changed is registered (as at start); a table that was in the running
//!   configuration and is gone from the file is unregistered. Snapshotters registered
//!   through the API are not touched. Any other setting that differs is logged as taking
//!   effect at the next start.
//! - A reload that would unregister a `[[snapshotter]]` whose operations are unfinished
//!   is refused, naming the snapshotter and the owners waiting on it: those operations
//!   would fail at their next poll (an empty file removes every table).
//! - The file is read on a blocking thread, within [`READ_DEADLINE`]: a FIFO or a hung
//!   network file system holds up the reload, never the runtime that answers calls.
//! - Every change is logged; systemd hears `RELOADING=1` and then `READY=1`.
//! - A command snapshotter whose program cannot run is warned of at every reload, and
//!   still registered (see [`crate::remote::warn_if_unrunnable`]).

use std::time::Duration;

use crate::config::{CommandLine, Settings};
use crate::core::Core;

/// How long reading and resolving the config file may take before the reload is
/// refused.
pub const READ_DEADLINE: Duration = Duration::from_secs(5);

/// Applies a (validated) log filter to the running logger.
pub type SetLogLevel = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// What a reload needs from the process that started the agent.
pub struct Reload {
    pub command_line: CommandLine,
    pub set_log_level: SetLogLevel,
}

/// Reads the configuration again and applies what may change while running; logs
/// what changed, or why nothing did.
///
/// `running` is what runs now: the settings of the start, with the `log_level` and the
/// `[[snapshotter]]` tables that reloads applied since.
pub async fn reload(core: &Core, running: &mut Settings, reload: &Reload) {
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Reloading]);
    apply(core, running, reload).await;
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
}

/// The settings the file says now, read off the runtime within [`READ_DEADLINE`].
async fn read(reload: &Reload) -> Result<Settings, String> {
    let command_line = reload.command_line.clone();
    let reading = tokio::task::spawn_blocking(move || command_line.resolve());
    match tokio::time::timeout(READ_DEADLINE, reading).await {
        Ok(Ok(resolved)) => resolved,
        Ok(Err(e)) => Err(format!("reading the configuration failed: {e}")),
        Err(_) => Err(format!(
            "reading the configuration took longer than {}s (a FIFO, or a file system \
             that does not answer?)",
            READ_DEADLINE.as_secs()
        )),
    }
}

/// Why unregistering `gone` would orphan unfinished operations, if it would.
async fn orphans(core: &Core, gone: &[String]) -> Result<(), String> {
    let mut orphaned = Vec::new();
    for name in gone {
        let (owners, all) = core
            .owners_waiting_on(name)
            .await
            .map_err(|e| format!("reading the operations of snapshotter {name}: {e}"))?;
        if all > 0 {
            let more = all - owners.len() as i64;
            let more = if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            };
            orphaned.push(format!("{name} (waited on by {}{more})", owners.join(", ")));
        }
    }
    if orphaned.is_empty() {
        return Ok(());
    }
    Err(format!(
        "the file no longer has [[snapshotter]] tables with unfinished operations: {}; put \
         them back, or remove them once their operations have finished",
        orphaned.join("; ")
    ))
}

async fn apply(core: &Core, running: &mut Settings, reload: &Reload) {
    let refused = |e: String| {
        tracing::error!("reload refused, the running configuration is unchanged: {e}");
    };
    let new = match read(reload).await {
        Ok(settings) => settings,
        Err(e) => return refused(e),
    };
    let leaving: Vec<String> = running
        .snapshotters
        .iter()
        .filter(|r| !new.snapshotters.iter().any(|s| s.name == r.name))
        .map(|r| r.name.clone())
        .collect();
    if let Err(e) = orphans(core, &leaving).await {
        return refused(e);
    }
    let mut changes = 0usize;
    if new.log_level != running.log_level {
        match (reload.set_log_level)(&new.log_level) {
            Ok(()) => {
                tracing::info!(
                    from = %running.log_level,
                    to = %new.log_level,
                    "reload: log_level changed"
                );
                running.log_level = new.log_level.clone();
                changes += 1;
            }
            Err(e) => tracing::error!("reload: log_level {:?} not applied: {e}", new.log_level),
        }
    }
    for s in &new.snapshotters {
        // Every reload says so, changed or not: a reload is when the operator looks.
        crate::remote::warn_if_unrunnable(s);
        let before = running.snapshotters.iter().find(|r| r.name == s.name);
        if before == Some(s) {
            continue;
        }
        let what = if before.is_some() { "changed" } else { "added" };
        match core.register_snapshotter(s.clone()).await {
            Ok(_) => {
                tracing::info!(snapshotter = %s.name, "reload: [[snapshotter]] {what}");
                changes += 1;
            }
            Err(e) => {
                tracing::error!(snapshotter = %s.name, "reload: registering the [[snapshotter]] failed: {e}");
                continue;
            }
        }
        running.snapshotters.retain(|r| r.name != s.name);
        running.snapshotters.push(s.clone());
    }
    // Registering the file's tables changed no name that is leaving.
    for name in leaving {
        match core.unregister_snapshotter(name.clone()).await {
            Ok(_) => {
                tracing::info!(snapshotter = %name, "reload: [[snapshotter]] removed from the file: unregistered");
            }
            // Unregistered through the API meanwhile: nothing left to do.
            Err(crate::error::Error::NotFound(_)) => {}
            Err(e) => {
                tracing::error!(snapshotter = %name, "reload: unregistering failed: {e}");
                continue;
            }
        }
        changes += 1;
        running.snapshotters.retain(|r| r.name != name);
    }
    let now = running.provenance();
    for p in &new.provenance() {
        if p.key == "log_level" {
            continue;
        }
        let now = now.iter().find(|r| r.key == p.key);
        if let Some(now) = now.filter(|now| now.value != p.value) {
            tracing::warn!(
                key = p.key,
                running = %now.value,
                configured = %p.value,
                source = %p.source,
                "reload: this setting takes effect at the next start"
            );
        }
    }
    tracing::info!(changes, "configuration reloaded");
}
