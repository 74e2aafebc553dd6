//! The command line, as clap sees it. Every API method has a subcommand; `backup` and
//! `restore` share one definition.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use opmon_client::{ApiVersion, GoDuration, OperationPhase, OwnerPhase, PluginKind, Timestamp};

fn go_duration(text: &str) -> Result<GoDuration, String> {
    text.parse::<GoDuration>().map_err(|e| e.to_string())
}

fn owner_phase(text: &str) -> Result<OwnerPhase, String> {
    text.parse()
}

fn operation_phase(text: &str) -> Result<OperationPhase, String> {
    text.parse()
}

fn plugin_kind(text: &str) -> Result<PluginKind, String> {
    text.parse()
}

fn rfc3339(text: &str) -> Result<Timestamp, String> {
    Timestamp::parse(text, &time::format_description::well_known::Rfc3339)
        .map_err(|e| format!("not an RFC 3339 time such as 2026-01-02T15:04:05Z ({e})"))
}

/// A uid, or a user name looked up in the user database.
fn user_id(text: &str) -> Result<u32, String> {
    if let Ok(uid) = text.parse() {
        return Ok(uid);
    }
    match nix::unistd::User::from_name(text) {
        Ok(Some(user)) => Ok(user.uid.as_raw()),
        Ok(None) => Err(format!("no user named {text:?}")),
        Err(e) => Err(format!("looking up user {text:?}: {e}")),
    }
}

fn api_version(text: &str) -> Result<ApiVersion, String> {
    text.parse()
}

/// opmon: drive and watch the opmon agent's backups, restores and snapshotters.
///
/// Exit codes: 0 success; 1 the owner is PartiallyFailed (or on its way there);
/// 2 it Failed, or the command failed; 3 `wait` timed out.
#[derive(Parser, Debug)]
#[command(name = "opmon", version, about, long_about)]
pub struct Cli {
    /// The agent's socket [default: as the agent resolves it].
    #[arg(long, env = "OPMON_SOCKET", global = true)]
    pub socket: Option<PathBuf>,

    /// Users (names or uids) trusted to serve the socket besides root and yourself: the
    /// agent's user when it is neither. A socket served by anyone else is refused.
    #[arg(long, env = "OPMON_AGENT_UID", value_delimiter = ',', value_parser = user_id, global = true)]
    pub agent_uid: Vec<u32>,

    /// How reads are printed; json is exactly the API's result.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table, global = true)]
    pub output: Output,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// The agent's version, uptime and counts.
    Status,
    /// Backups.
    #[command(subcommand)]
    Backup(OwnerCommand),
    /// Restores.
    #[command(subcommand)]
    Restore(OwnerCommand),
    /// Snapshotters: who owns which plugin's operations.
    #[command(subcommand)]
    Snapshotter(SnapshotterCommand),
    /// Backup servers: say that one (re)started.
    #[command(subcommand)]
    Server(ServerCommand),
    /// Prints a shell completion script.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(Subcommand, Debug)]
pub enum OwnerCommand {
    /// Creates it in InProgress (same name and uid again is fine).
    Start {
        name: String,
        #[arg(long)]
        uid: String,
        /// Go duration, e.g. 4h0m0s [default: the agent's].
        #[arg(long, value_parser = go_duration)]
        item_operation_timeout: Option<GoDuration>,
        /// Restores only: pass through Finalizing and wait for `finalize`.
        #[arg(long)]
        finalize: bool,
        /// The backup server's own representation of it, a JSON object (for Velero, the
        /// Backup or Restore): a file, or - for standard input. Snapshotters get it with
        /// every Progress and Cancel.
        #[arg(long, value_name = "FILE|-")]
        object: Option<PathBuf>,
        /// The backup server starting it: `server started` of a later instance of that
        /// server fails it while it is InProgress.
        #[arg(long, requires = "instance")]
        server: Option<String>,
        /// The instance of --server now running (e.g. its pod or process start ID).
        #[arg(long, requires = "server")]
        instance: Option<String>,
        /// Cancel and fail an operation whose progress stands still this long (Go
        /// duration; 0s: never) [default: its snapshotter's].
        #[arg(long, value_parser = go_duration)]
        stall_timeout: Option<GoDuration>,
        /// Cancel and fail an operation still New this long after it was created (Go
        /// duration; 0s: never) [default: its snapshotter's].
        #[arg(long, value_parser = go_duration)]
        start_timeout: Option<GoDuration>,
    },
    /// Registers operations a plugin returned: one from flags, or many from a JSON file.
    AddOperation(AddOperation),
    /// Ends InProgress: polls every operation once and moves to the next phase.
    EndInProgress {
        name: String,
        #[arg(long, default_value_t = 0)]
        errors: u32,
        #[arg(long, default_value_t = 0)]
        warnings: u32,
        /// The backup or restore failed: go to Failed and cancel unfinished operations.
        #[arg(long)]
        failed: bool,
    },
    /// One owner.
    Get { name: String },
    /// Owners, by name, a page at a time.
    List {
        /// Only these phases (repeatable).
        #[arg(long = "phase", value_parser = owner_phase)]
        phases: Vec<OwnerPhase>,
        #[arg(long)]
        limit: Option<u32>,
        /// Start after this name (the previous page's last).
        #[arg(long)]
        after: Option<String>,
    },
    /// The owner's operations.
    Operations {
        name: String,
        #[arg(long = "phase", value_parser = operation_phase)]
        phases: Vec<OperationPhase>,
    },
    /// The owner, readable, ending with its recent events; with --details, each
    /// operation and every event kept.
    Describe {
        name: String,
        #[arg(long)]
        details: bool,
    },
    /// The owner's history (phase changes, failures, calls and their callers), oldest
    /// first, a page at a time.
    Events {
        name: String,
        /// Start after this event (the previous page's last SEQ).
        #[arg(long)]
        after: Option<u64>,
        /// At most this many events (default 100, at most 1000).
        #[arg(long)]
        limit: Option<u32>,
    },
    /// Waits, showing progress, until ready to finalize (or terminal).
    Wait {
        name: String,
        #[arg(long, value_enum, default_value_t = Until::ReadyToFinalize)]
        until: Until,
        /// Give up after this long (Go duration) with exit code 3 [default: never].
        #[arg(long, value_parser = go_duration)]
        timeout: Option<GoDuration>,
    },
    /// Finalizes: rewrites the backup tarball (with --contents-input/--contents-output)
    /// and completes.
    Finalize {
        name: String,
        /// The backup tarball to read (a relative path is resolved against the current
        /// directory before it is sent).
        #[arg(long, requires = "contents_output")]
        contents_input: Option<PathBuf>,
        /// Where to write the rewritten tarball.
        #[arg(long, requires = "contents_input")]
        contents_output: Option<PathBuf>,
        /// A JSON file with `[{"resource": …, "object": …}]`, or - for standard input.
        #[arg(long, requires = "contents_input")]
        updated_items: Option<PathBuf>,
    },
    /// The -itemoperations.json.gz records.
    ItemOperations { name: String },
    /// Removes it, cancelling unfinished operations.
    Delete { name: String },
    /// Cancels it (it ends Failed), or with --operation only those operations (they
    /// end Canceled). Allowed while InProgress or WaitingForPluginOperations*.
    Cancel {
        name: String,
        /// An operation ID to cancel (repeatable); an ID two items share is refused
        /// with the items named.
        #[arg(long = "operation", value_name = "ID")]
        operations: Vec<String>,
        /// Why, for the operations' error and the owner's failure reason [default:
        /// canceled by request].
        #[arg(long)]
        reason: Option<String>,
    },
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Until {
    ReadyToFinalize,
    Terminal,
}

#[derive(Args, Debug)]
pub struct AddOperation {
    pub name: String,
    /// A JSON file with an array of operations as the API takes them, or - for stdin.
    #[arg(long, conflicts_with_all = ["plugin", "item", "operation_id"])]
    pub file: Option<PathBuf>,
    /// Plugin name, domain/name.
    #[arg(long, required_unless_present = "file")]
    pub plugin: Option<String>,
    /// Plugin kind [default: BackupItemAction for backups, RestoreItemAction for restores].
    #[arg(long, value_parser = plugin_kind)]
    pub plugin_kind: Option<PluginKind>,
    /// The item, RESOURCE[.GROUP]/NAMESPACE/NAME or RESOURCE[.GROUP]/NAME (cluster-scoped).
    #[arg(long, required_unless_present = "file")]
    pub item: Option<String>,
    #[arg(long, required_unless_present = "file")]
    pub operation_id: Option<String>,
    /// An item to back up again once operations finish (repeatable), same form as --item.
    #[arg(long = "post-item")]
    pub post_items: Vec<String>,
    /// When the plugin returned the operation, RFC 3339; the item operation timeout
    /// counts from it [default: when the agent is told].
    #[arg(long, value_parser = rfc3339, conflicts_with = "file")]
    pub created: Option<Timestamp>,
}

#[derive(Subcommand, Debug)]
pub enum ServerCommand {
    /// Says backup server NAME now runs as --instance: the agent fails the InProgress
    /// backups and restores that its earlier instances started, and prints them. NAME
    /// "" stands for the owners started without --server.
    Started {
        name: String,
        #[arg(long)]
        instance: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum SnapshotterCommand {
    /// Registers (or replaces) a snapshotter for a plugin name.
    Register {
        /// The plugin name it serves, domain/name.
        name: String,
        #[arg(long, value_parser = api_version, default_value = "v2")]
        api_version: ApiVersion,
        /// Its JSON-RPC socket (`--socket` is the agent's); a relative path is resolved
        /// against the current directory.
        #[arg(long, conflicts_with = "command")]
        snapshotter_socket: Option<PathBuf>,
        /// A Velero plugin binary for the agent to run (docs/velero-plugins.md); the
        /// words after -- are then its arguments. A relative path is resolved against
        /// the current directory.
        #[arg(long, conflicts_with = "snapshotter_socket")]
        velero_plugin: Option<PathBuf>,
        /// KEY=VALUE in the Velero plugin's environment (repeatable).
        #[arg(long = "env", value_name = "KEY=VALUE", requires = "velero_plugin")]
        env: Vec<String>,
        /// The command to run per call (after --, e.g. -- /usr/bin/snap --flag); a
        /// program given by a relative path is resolved against the current directory.
        #[arg(last = true)]
        command: Vec<String>,
        /// Cancel and fail an operation whose progress stands still this long [default:
        /// never].
        #[arg(long, value_parser = go_duration)]
        stall_timeout: Option<GoDuration>,
        /// Cancel and fail an operation still New this long after it was created
        /// [default: never].
        #[arg(long, value_parser = go_duration)]
        start_timeout: Option<GoDuration>,
        /// Transient errors retried per operation [default: 5].
        #[arg(long)]
        retry_attempts: Option<u32>,
        /// Delay before the first retry, doubled each time up to 5m [default: 1s].
        #[arg(long, value_parser = go_duration)]
        retry_backoff: Option<GoDuration>,
        /// How long an operation may fail transiently before it fails [default: 10m].
        #[arg(long, value_parser = go_duration)]
        retry_within: Option<GoDuration>,
    },
    /// All snapshotters.
    List,
    /// Removes one.
    Unregister { name: String },
}
