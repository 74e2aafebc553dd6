//! Settings: flags, each also read from an `OPMON_*` environment variable, with the
//! defaults of ARCHITECTURE.md. With none given the agent runs as is, creating the
//! directories it needs.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use opmon_client::paths::first_path_of;
use opmon_client::GoDuration;

use crate::core::CoreSettings;
use crate::remote::CallSettings;

fn go_duration(text: &str) -> Result<GoDuration, String> {
    text.parse::<GoDuration>().map_err(|e| e.to_string())
}

/// opmon-agent: monitors the long-running operations of backup and restore plugins.
#[derive(Parser, Debug, Clone)]
#[command(version, about)]
pub struct Args {
    /// Unix socket to serve the API on [default: $RUNTIME_DIRECTORY/agent.sock, else
    /// /run/opmon/agent.sock as root, else $XDG_RUNTIME_DIR/opmon/agent.sock].
    #[arg(long, env = "OPMON_SOCKET")]
    pub socket: Option<PathBuf>,

    /// Directory of the database [default: $STATE_DIRECTORY, else /var/lib/opmon as
    /// root, else $XDG_STATE_HOME/opmon].
    #[arg(long, env = "OPMON_STATE_DIR")]
    pub state_dir: Option<PathBuf>,

    /// Directory of the Velero object-store layout [default: <state dir>/storage].
    #[arg(long, env = "OPMON_STORAGE_DIR")]
    pub storage_dir: Option<PathBuf>,

    /// How often unfinished operations are polled (at least 100ms).
    #[arg(long, env = "OPMON_POLL_INTERVAL", default_value = "10s", value_parser = go_duration)]
    pub poll_interval: GoDuration,

    /// Deadline of every call to a snapshotter.
    #[arg(long, env = "OPMON_CALL_DEADLINE", default_value = "30s", value_parser = go_duration)]
    pub call_deadline: GoDuration,

    /// Progress requests per JSON-RPC batch sent to a socket snapshotter.
    #[arg(long, env = "OPMON_BATCH_SIZE", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub batch_size: u32,

    /// Batches in flight at once to one socket snapshotter.
    #[arg(long, env = "OPMON_SOCKET_CONCURRENCY", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub socket_concurrency: u32,

    /// Processes running at once for one command snapshotter.
    #[arg(long, env = "OPMON_COMMAND_CONCURRENCY", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub command_concurrency: u32,

    /// Item operation timeout of owners started without one.
    #[arg(long, env = "OPMON_ITEM_OPERATION_TIMEOUT", default_value = "4h0m0s", value_parser = go_duration)]
    pub item_operation_timeout: GoDuration,

    /// How long terminal backups and restores are kept.
    #[arg(long, env = "OPMON_RETENTION", default_value = "720h0m0s", value_parser = go_duration)]
    pub retention: GoDuration,

    /// Largest decompressed size of a backup tarball finalize reads, in bytes.
    #[arg(long, env = "OPMON_MAX_DECOMPRESSED_SIZE", default_value_t = 16 * 1024 * 1024 * 1024)]
    pub max_decompressed_size: u64,

    /// Largest request body accepted, in bytes.
    #[arg(long, env = "OPMON_MAX_REQUEST_SIZE", default_value_t = 16 * 1024 * 1024)]
    pub max_request_size: u32,
}

/// Resolved settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    pub storage_dir: PathBuf,
    pub max_request_size: u32,
    pub core: CoreSettings,
}

impl Settings {
    pub fn database(&self) -> PathBuf {
        self.state_dir.join("agent.db")
    }
}

/// `$STATE_DIRECTORY`, else `/var/lib/opmon` as root, else `$XDG_STATE_HOME/opmon`
/// (or `~/.local/state/opmon`).
pub fn default_state_dir() -> PathBuf {
    if let Some(dir) = first_path_of("STATE_DIRECTORY") {
        return dir;
    }
    if nix::unistd::geteuid().is_root() {
        return PathBuf::from("/var/lib/opmon");
    }
    if let Some(dir) = first_path_of("XDG_STATE_HOME") {
        return dir.join("opmon");
    }
    let home = first_path_of("HOME").unwrap_or_else(|| PathBuf::from("/tmp"));
    home.join(".local/state/opmon")
}

impl Args {
    pub fn resolve(self) -> Result<Settings, String> {
        if self.poll_interval.0 < Duration::from_millis(100) {
            return Err(format!(
                "poll interval {} is below the minimum of 100ms",
                self.poll_interval
            ));
        }
        for (name, value) in [
            ("call deadline", self.call_deadline),
            ("item operation timeout", self.item_operation_timeout),
            ("retention", self.retention),
        ] {
            if value.0.is_zero() {
                return Err(format!("{name} must be greater than zero"));
            }
        }
        let state_dir = self.state_dir.unwrap_or_else(default_state_dir);
        let storage_dir = self
            .storage_dir
            .unwrap_or_else(|| state_dir.join("storage"));
        Ok(Settings {
            socket: self
                .socket
                .unwrap_or_else(opmon_client::default_socket_path),
            state_dir,
            storage_dir,
            max_request_size: self.max_request_size,
            core: CoreSettings {
                poll_interval: self.poll_interval.0,
                default_item_operation_timeout: self.item_operation_timeout,
                retention: self.retention.0,
                max_decompressed_size: self.max_decompressed_size,
                calls: CallSettings {
                    deadline: self.call_deadline.0,
                    batch_size: self.batch_size as usize,
                    socket_concurrency: self.socket_concurrency as usize,
                    command_concurrency: self.command_concurrency as usize,
                },
            },
        })
    }
}
