//! Settings, from four layers in order of precedence: flags, `OPMON_*` environment
//! variables, the TOML config file (`--config`, else `/etc/opmon/agent.toml` when it
//! exists), and the defaults of ARCHITECTURE.md. With none given the agent runs as is.
//!
//! Every resolved value remembers where it came from, so `--print-config` can show it
//! and an error can say which flag, variable or file line to fix.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, ValueEnum};
use opmon_client::paths::first_path_of;
use opmon_client::{ApiVersion, GoDuration, Snapshotter};
use serde::Deserialize;
use toml::Spanned;

use crate::core::CoreSettings;
use crate::remote::CallSettings;
use crate::replica::Checkpoint;

/// The config file read when `--config` is not given, if it exists.
pub const DEFAULT_CONFIG: &str = "/etc/opmon/agent.toml";

/// Connections one peer uid may hold at once unless configured.
pub const DEFAULT_MAX_CONNECTIONS_PER_UID: u32 = 256;

/// `OPMON_*` variables that are not settings of the agent but belong to other opmon
/// programs: an operator's shell or a pod may set them for those, and the agent must
/// still start. `OPMON_SOCKET`, the one variable the CLI reads, is also a setting. A
/// variable the CLI (or a snapshotter SDK) starts reading belongs in this list.
///
/// Every other `OPMON_*` variable that is not a setting stops the agent (a misspelt
/// setting must not be silently ignored). Programs that start the agent with variables
/// of their own (test harnesses) remove those from its environment.
pub const OTHER_PROGRAMS_VARIABLES: &[(&str, &str)] = &[
    ("OPMON_PLUGIN", "command snapshotters"),
    ("OPMON_PLUGIN_KIND", "command snapshotters"),
    ("OPMON_OWNER_KIND", "command snapshotters"),
    ("OPMON_OWNER_NAME", "command snapshotters"),
    ("OPMON_OWNER_UID", "command snapshotters"),
];

/// The environment variable of every setting, read from the flags' definitions (so a
/// new setting is known here by being declared once).
pub fn setting_variables() -> Vec<String> {
    Args::command()
        .get_arguments()
        .filter_map(|a| a.get_env())
        .map(|v| v.to_string_lossy().into_owned())
        .collect()
}

/// Refuses an `OPMON_*` variable in `vars` that is neither a setting nor one of
/// [`OTHER_PROGRAMS_VARIABLES`], naming it (and the settings it resembles).
pub fn check_environment(
    vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Result<(), String> {
    let known = setting_variables();
    let mut unknown: Vec<String> = vars
        .into_iter()
        .map(|(name, _)| name.to_string_lossy().into_owned())
        .filter(|name| name.starts_with("OPMON_"))
        .filter(|name| {
            !known.iter().any(|k| k == name)
                && !OTHER_PROGRAMS_VARIABLES.iter().any(|(k, _)| k == name)
        })
        .collect();
    unknown.sort();
    let Some(first) = unknown.first() else {
        return Ok(());
    };
    let mut alike: Vec<&str> = known
        .iter()
        .filter(|k| k.starts_with(first.as_str()) || first.starts_with(k.as_str()))
        .map(String::as_str)
        .collect();
    alike.sort_unstable();
    let hint = if alike.is_empty() {
        "see opmon-agent --help for the settings' variables".to_string()
    } else {
        format!("did you mean {}?", alike.join(" or "))
    };
    Err(format!(
        "environment variable {first} is not an opmon-agent setting ({hint})"
    ))
}

/// Refuses a log filter that would silently log nothing or not what was meant: every
/// comma-separated directive must be a level (`info`) or `target=level`. A bare word
/// such as `verbose` is a valid `tracing` directive (all levels of a target named
/// `verbose`, nothing else), which turns logging off.
pub fn check_log_level(filter: &str) -> Result<(), String> {
    use tracing_subscriber::filter::LevelFilter;
    for directive in filter.split(',').map(str::trim) {
        if directive.is_empty() || directive.contains('=') {
            continue;
        }
        if directive.parse::<LevelFilter>().is_err() {
            return Err(format!(
                "{directive:?} is not a level (trace, debug, info, warn, error, off) or a directive like opmon_agent=debug"
            ));
        }
    }
    tracing_subscriber::EnvFilter::try_new(filter)
        .map(|_| ())
        .map_err(|e| format!("{filter:?}: {e}"))
}

fn go_duration(text: &str) -> Result<GoDuration, String> {
    text.parse::<GoDuration>().map_err(|e| e.to_string())
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Human,
    Json,
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LogFormat::Human => "human",
            LogFormat::Json => "json",
        })
    }
}

/// opmon-agent: monitors the long-running operations of backup and restore plugins.
///
/// Every setting can also come from an OPMON_* environment variable or the TOML config
/// file; flags win over variables, variables over the file.
#[derive(Parser, Debug, Clone)]
#[command(version, about)]
pub struct Args {
    /// TOML config file [default: /etc/opmon/agent.toml if it exists].
    #[arg(long, env = "OPMON_CONFIG")]
    pub config: Option<PathBuf>,
    /// Print the effective configuration, with where each value came from, and exit.
    #[arg(long)]
    pub print_config: bool,
    /// Unix socket to serve the API on.
    #[arg(long, env = "OPMON_SOCKET")]
    pub socket: Option<PathBuf>,
    /// File mode of the socket, octal.
    #[arg(long, env = "OPMON_SOCKET_MODE")]
    pub socket_mode: Option<String>,
    /// Group owning the socket, by name or number.
    #[arg(long, env = "OPMON_SOCKET_GROUP")]
    pub socket_group: Option<String>,
    /// Directory of the database.
    #[arg(long, env = "OPMON_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Directory of the Velero object-store layout.
    #[arg(long, env = "OPMON_STORAGE_DIR")]
    pub storage_dir: Option<PathBuf>,
    /// How often unfinished operations are polled (at least 100ms).
    #[arg(long, env = "OPMON_POLL_INTERVAL", value_parser = go_duration)]
    pub poll_interval: Option<GoDuration>,
    /// Deadline of every call to a snapshotter.
    #[arg(long, env = "OPMON_CALL_DEADLINE", value_parser = go_duration)]
    pub call_deadline: Option<GoDuration>,
    /// Progress requests per JSON-RPC batch sent to a socket snapshotter.
    #[arg(long, env = "OPMON_BATCH_SIZE")]
    pub batch_size: Option<u32>,
    /// Batches in flight at once to one socket snapshotter.
    #[arg(long, env = "OPMON_SOCKET_CONCURRENCY")]
    pub socket_concurrency: Option<u32>,
    /// Processes running at once for one command snapshotter.
    #[arg(long, env = "OPMON_COMMAND_CONCURRENCY")]
    pub command_concurrency: Option<u32>,
    /// Item operation timeout of owners started without one.
    #[arg(long, env = "OPMON_ITEM_OPERATION_TIMEOUT", value_parser = go_duration)]
    pub item_operation_timeout: Option<GoDuration>,
    /// How long terminal backups and restores are kept.
    #[arg(long, env = "OPMON_RETENTION", value_parser = go_duration)]
    pub retention: Option<GoDuration>,
    /// How long a snapshotter may be unreachable before its operations fail.
    #[arg(long, env = "OPMON_UNREACHABLE_GRACE", value_parser = go_duration)]
    pub unreachable_grace: Option<GoDuration>,
    /// Connections with no traffic for this long are closed.
    #[arg(long, env = "OPMON_IDLE_TIMEOUT", value_parser = go_duration)]
    pub idle_timeout: Option<GoDuration>,
    /// Largest request body accepted, in bytes.
    #[arg(long, env = "OPMON_MAX_REQUEST_SIZE")]
    pub max_request_size: Option<u32>,
    /// Largest decompressed size of a backup tarball finalize reads, in bytes.
    #[arg(long, env = "OPMON_MAX_DECOMPRESSED_SIZE")]
    pub max_decompressed_size: Option<u64>,
    /// Directories besides the storage directory where finalize may read its input and
    /// write its output, comma-separated absolute paths [default: none].
    #[arg(long, env = "OPMON_FINALIZE_DIRS", value_delimiter = ',')]
    pub finalize_dirs: Vec<PathBuf>,
    /// How long one finalize's tarball rewrite may take.
    #[arg(long, env = "OPMON_FINALIZE_DEADLINE", value_parser = go_duration)]
    pub finalize_deadline: Option<GoDuration>,
    /// Uids allowed to connect besides the agent's own and root (always allowed),
    /// comma-separated.
    #[arg(long, env = "OPMON_ALLOWED_UIDS", value_delimiter = ',')]
    pub allowed_uids: Vec<u32>,
    /// Gids allowed to connect (primary or supplementary group of the peer),
    /// comma-separated [default: none].
    #[arg(long, env = "OPMON_ALLOWED_GIDS", value_delimiter = ',')]
    pub allowed_gids: Vec<u32>,
    /// Connections one peer uid may hold open at once.
    #[arg(long, env = "OPMON_MAX_CONNECTIONS_PER_UID")]
    pub max_connections_per_uid: Option<u32>,
    /// Log line format.
    #[arg(long, env = "OPMON_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// Log filter: a level (info, debug, …) or tracing directives.
    #[arg(long, env = "OPMON_LOG_LEVEL")]
    pub log_level: Option<String>,
    /// Also serve GET /metrics on this TCP address (host:port).
    #[arg(long, env = "OPMON_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
    /// Let clients register command snapshotters over the API (true|false): each runs a
    /// program of the client's choosing as the agent's user [default: false].
    #[arg(long, env = "OPMON_ALLOW_API_COMMAND_SNAPSHOTTERS")]
    pub allow_api_command_snapshotters: Option<bool>,
    /// Restores started without `finalize` pass through Finalizing (true|false), as
    /// every restore does from Velero 1.14 on.
    #[arg(long, env = "OPMON_RESTORE_FINALIZE", value_parser = clap::value_parser!(bool))]
    pub restore_finalize: Option<bool>,
    /// Fail InProgress owners no call has touched for this long (0s: never).
    #[arg(long, env = "OPMON_IN_PROGRESS_IDLE_TIMEOUT", value_parser = go_duration)]
    pub in_progress_idle_timeout: Option<GoDuration>,
    /// Who checkpoints the WAL: sqlite (automatically) or external (a replicator such
    /// as Litestream; the agent never does).
    #[arg(long, env = "OPMON_CHECKPOINT", value_enum)]
    pub checkpoint: Option<Checkpoint>,
}

/// The config file's form. Keys are the flags' names with `_` for `-`.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    socket: Option<Spanned<PathBuf>>,
    socket_mode: Option<Spanned<String>>,
    socket_group: Option<Spanned<String>>,
    state_dir: Option<Spanned<PathBuf>>,
    storage_dir: Option<Spanned<PathBuf>>,
    poll_interval: Option<Spanned<GoDuration>>,
    call_deadline: Option<Spanned<GoDuration>>,
    batch_size: Option<Spanned<u32>>,
    socket_concurrency: Option<Spanned<u32>>,
    command_concurrency: Option<Spanned<u32>>,
    item_operation_timeout: Option<Spanned<GoDuration>>,
    retention: Option<Spanned<GoDuration>>,
    unreachable_grace: Option<Spanned<GoDuration>>,
    idle_timeout: Option<Spanned<GoDuration>>,
    max_request_size: Option<Spanned<u32>>,
    max_decompressed_size: Option<Spanned<u64>>,
    finalize_dirs: Option<Spanned<Vec<PathBuf>>>,
    finalize_deadline: Option<Spanned<GoDuration>>,
    allowed_uids: Option<Spanned<Vec<u32>>>,
    allowed_gids: Option<Spanned<Vec<u32>>>,
    max_connections_per_uid: Option<Spanned<u32>>,
    log_format: Option<Spanned<LogFormat>>,
    log_level: Option<Spanned<String>>,
    metrics_listen: Option<Spanned<String>>,
    allow_api_command_snapshotters: Option<Spanned<bool>>,
    restore_finalize: Option<Spanned<bool>>,
    in_progress_idle_timeout: Option<Spanned<GoDuration>>,
    checkpoint: Option<Spanned<Checkpoint>>,
    #[serde(default)]
    snapshotter: Vec<FileSnapshotter>,
}

/// A `[[snapshotter]]` table: registered at every start.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSnapshotter {
    name: String,
    api_version: ApiVersion,
    socket: Option<PathBuf>,
    command: Option<Vec<String>>,
}

/// Where a value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Default,
    File { path: PathBuf, line: usize },
    Env(String),
    Flag(String),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::File { path, line } => write!(f, "{} line {line}", path.display()),
            Source::Env(var) => write!(f, "environment {var}"),
            Source::Flag(flag) => write!(f, "flag {flag}"),
        }
    }
}

/// One line of `--print-config`.
#[derive(Clone, Debug)]
pub struct Provenance {
    pub key: &'static str,
    /// The value as TOML.
    pub value: String,
    pub source: Source,
}

/// Resolved settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub config_file: Option<PathBuf>,
    pub socket: PathBuf,
    pub socket_mode: u32,
    pub socket_group: Option<u32>,
    pub state_dir: PathBuf,
    pub storage_dir: PathBuf,
    pub max_request_size: u32,
    /// Uids allowed besides the agent's own and root, which are always allowed.
    pub allowed_uids: Vec<u32>,
    pub allowed_gids: Vec<u32>,
    pub max_connections_per_uid: u32,
    pub log_format: LogFormat,
    pub log_level: String,
    pub metrics_listen: Option<SocketAddr>,
    pub idle_timeout: Duration,
    pub snapshotters: Vec<Snapshotter>,
    pub checkpoint: Checkpoint,
    pub core: CoreSettings,
    pub provenance: Vec<Provenance>,
}

impl Settings {
    pub fn database(&self) -> PathBuf {
        self.state_dir.join("agent.db")
    }

    /// The `--print-config` text: valid TOML, each value commented with its source.
    pub fn describe(&self) -> String {
        let mut out = String::new();
        if let Some(file) = &self.config_file {
            out.push_str(&format!("# config file: {}\n", file.display()));
        }
        let width = self
            .provenance
            .iter()
            .map(|p| p.key.len() + p.value.len() + 3)
            .max()
            .unwrap_or(0);
        for p in &self.provenance {
            let line = format!("{} = {}", p.key, p.value);
            out.push_str(&format!("{line:<width$}  # {}\n", p.source));
        }
        for s in &self.snapshotters {
            out.push_str("\n[[snapshotter]]\n");
            out.push_str(&format!("name = {}\n", toml_string(&s.name)));
            out.push_str(&format!("api_version = \"{}\"\n", s.api_version.as_str()));
            if let Some(socket) = &s.socket {
                out.push_str(&format!(
                    "socket = {}\n",
                    toml_string(&socket.to_string_lossy())
                ));
            }
            if let Some(command) = &s.command {
                let parts: Vec<String> = command.iter().map(|c| toml_string(c)).collect();
                out.push_str(&format!("command = [{}]\n", parts.join(", ")));
            }
        }
        out
    }
}

fn toml_string(text: &str) -> String {
    toml::Value::String(text.to_string()).to_string()
}

/// `$STATE_DIRECTORY`, else `/var/lib/opmon` as root, else `$XDG_STATE_HOME/opmon`
/// (or `~/.local/state/opmon`).
/// `dir` made absolute against the working directory (lexically: `..` is kept).
fn absolute(key: &str, dir: PathBuf) -> Result<PathBuf, String> {
    std::path::absolute(&dir).map_err(|e| format!("{key}: {}: {e}", dir.display()))
}

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

/// Collects values layer by layer and records where each came from.
struct Layers<'a> {
    matches: &'a ArgMatches,
    file_path: Option<&'a Path>,
    file_text: &'a str,
    provenance: Vec<Provenance>,
}

impl Layers<'_> {
    fn line_of(&self, span: std::ops::Range<usize>) -> usize {
        self.file_text[..span.start.min(self.file_text.len())]
            .matches('\n')
            .count()
            + 1
    }

    /// The value of setting `key` (clap id `key` too): flag or environment, else file,
    /// else `default`. `show` renders it as TOML for `--print-config`.
    fn take<T>(
        &mut self,
        key: &'static str,
        cli: Option<T>,
        file: Option<Spanned<T>>,
        default: impl FnOnce() -> T,
        show: impl Fn(&T) -> String,
    ) -> (T, Source) {
        let (value, source) = match (cli, file) {
            (Some(v), _) => {
                let source = match self.matches.value_source(key) {
                    Some(ValueSource::EnvVariable) => {
                        Source::Env(format!("OPMON_{}", key.to_uppercase()))
                    }
                    _ => Source::Flag(format!("--{}", key.replace('_', "-"))),
                };
                (v, source)
            }
            (None, Some(spanned)) => {
                let line = self.line_of(spanned.span());
                let path = self.file_path.map(Path::to_path_buf).unwrap_or_default();
                (spanned.into_inner(), Source::File { path, line })
            }
            (None, None) => (default(), Source::Default),
        };
        self.provenance.push(Provenance {
            key,
            value: show(&value),
            source: source.clone(),
        });
        (value, source)
    }
}

/// `key (from SOURCE): reason`.
fn bad(key: &str, source: &Source, reason: impl fmt::Display) -> String {
    format!("{key} (from {source}): {reason}")
}

fn show_duration(d: &GoDuration) -> String {
    format!("\"{d}\"")
}

fn show_list(list: &[u32]) -> String {
    let items: Vec<String> = list.iter().map(u32::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// The command line (and environment) as parsed at start: a reload resolves the
/// config file again under the same flags and variables, which keep their precedence.
#[derive(Clone, Debug)]
pub struct CommandLine {
    args: Args,
    matches: ArgMatches,
}

impl CommandLine {
    /// Reads the config file again and resolves every setting.
    pub fn resolve(&self) -> Result<Settings, String> {
        resolve(self.args.clone(), &self.matches)
    }

    /// Whether `--print-config` was given.
    pub fn print_config(&self) -> bool {
        self.args.print_config
    }
}

/// Parses the command line (and environment) into settings, reading the config file.
/// Refuses `OPMON_*` variables that are not settings (see [`check_environment`]).
pub fn load() -> Result<(Settings, CommandLine), String> {
    let matches = Args::command().get_matches();
    let args = Args::from_arg_matches(&matches).map_err(|e| e.to_string())?;
    check_environment(std::env::vars_os())?;
    let command_line = CommandLine { args, matches };
    command_line.resolve().map(|s| (s, command_line))
}

/// Resolves `args` (parsed from `matches`) against the config file and defaults.
pub fn resolve(args: Args, matches: &ArgMatches) -> Result<Settings, String> {
    let config_file = match &args.config {
        Some(path) => Some(path.clone()),
        None if Path::new(DEFAULT_CONFIG).exists() => Some(PathBuf::from(DEFAULT_CONFIG)),
        None => None,
    };
    let file_text = match &config_file {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| format!("reading config file {}: {e}", path.display()))?,
        None => String::new(),
    };
    let file: FileConfig = toml::from_str(&file_text).map_err(|e| {
        let path = config_file
            .as_deref()
            .unwrap_or(Path::new(""))
            .display()
            .to_string();
        let line = e.span().map(|s| {
            file_text[..s.start.min(file_text.len())]
                .matches('\n')
                .count()
                + 1
        });
        match line {
            Some(line) => format!("config file {path} line {line}: {}", e.message()),
            None => format!("config file {path}: {}", e.message()),
        }
    })?;
    let mut layers = Layers {
        matches,
        file_path: config_file.as_deref(),
        file_text: &file_text,
        provenance: Vec::new(),
    };
    let quote = |p: &PathBuf| toml_string(&p.to_string_lossy());

    let (socket, _) = layers.take(
        "socket",
        args.socket,
        file.socket,
        opmon_client::default_socket_path,
        quote,
    );
    let (mode_text, mode_source) = layers.take(
        "socket_mode",
        args.socket_mode,
        file.socket_mode,
        || "0660".into(),
        |m| toml_string(m),
    );
    let socket_mode = u32::from_str_radix(mode_text.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| {
            bad(
                "socket_mode",
                &mode_source,
                format!("{mode_text:?} is not an octal file mode like \"0660\""),
            )
        })?;
    let (group_text, group_source) = layers.take(
        "socket_group",
        args.socket_group,
        file.socket_group,
        String::new,
        |g| toml_string(g),
    );
    let socket_group = if group_text.is_empty() {
        None
    } else if let Ok(gid) = group_text.parse::<u32>() {
        Some(gid)
    } else {
        let group = nix::unistd::Group::from_name(&group_text)
            .map_err(|e| bad("socket_group", &group_source, e))?
            .ok_or_else(|| {
                bad(
                    "socket_group",
                    &group_source,
                    format!("no group named {group_text:?}"),
                )
            })?;
        Some(group.gid.as_raw())
    };
    let (state_dir, _) = layers.take(
        "state_dir",
        args.state_dir,
        file.state_dir,
        default_state_dir,
        quote,
    );
    // Relative directories are taken against the working directory at start, once:
    // clients are handed paths under them, and a relative one means nothing to them.
    let state_dir = absolute("state_dir", state_dir)?;
    let (storage_dir, _) = layers.take(
        "storage_dir",
        args.storage_dir,
        file.storage_dir,
        || state_dir.join("storage"),
        quote,
    );
    let storage_dir = absolute("storage_dir", storage_dir)?;
    let (poll_interval, poll_source) = layers.take(
        "poll_interval",
        args.poll_interval,
        file.poll_interval,
        || GoDuration::from_secs(10),
        show_duration,
    );
    if poll_interval.0 < Duration::from_millis(100) {
        return Err(bad(
            "poll_interval",
            &poll_source,
            format!("{poll_interval} is below the minimum of 100ms"),
        ));
    }
    let mut positive = |key: &'static str, cli, file, default: GoDuration| {
        let (value, source) = layers.take(key, cli, file, || default, show_duration);
        if value.0.is_zero() {
            return Err(bad(key, &source, "must be greater than zero"));
        }
        Ok(value)
    };
    let call_deadline = positive(
        "call_deadline",
        args.call_deadline,
        file.call_deadline,
        GoDuration::from_secs(30),
    )?;
    let item_operation_timeout = positive(
        "item_operation_timeout",
        args.item_operation_timeout,
        file.item_operation_timeout,
        GoDuration::from_secs(4 * 3600),
    )?;
    let retention = positive(
        "retention",
        args.retention,
        file.retention,
        GoDuration::from_secs(30 * 24 * 3600),
    )?;
    let unreachable_grace = positive(
        "unreachable_grace",
        args.unreachable_grace,
        file.unreachable_grace,
        GoDuration::from_secs(600),
    )?;
    let idle_timeout = positive(
        "idle_timeout",
        args.idle_timeout,
        file.idle_timeout,
        GoDuration::from_secs(15 * 60),
    )?;
    let mut count = |key: &'static str, cli, file, default: u32, max: u32| {
        let (value, source) = layers.take(key, cli, file, || default, |v: &u32| v.to_string());
        if value == 0 || value > max {
            return Err(bad(key, &source, format!("must be between 1 and {max}")));
        }
        Ok(value)
    };
    let batch_size = count("batch_size", args.batch_size, file.batch_size, 256, 100_000)?;
    let socket_concurrency = count(
        "socket_concurrency",
        args.socket_concurrency,
        file.socket_concurrency,
        4,
        1024,
    )?;
    let command_concurrency = count(
        "command_concurrency",
        args.command_concurrency,
        file.command_concurrency,
        8,
        1024,
    )?;
    let max_request_size = count(
        "max_request_size",
        args.max_request_size,
        file.max_request_size,
        16 * 1024 * 1024,
        u32::MAX,
    )?;
    let (max_decompressed_size, _) = layers.take(
        "max_decompressed_size",
        args.max_decompressed_size,
        file.max_decompressed_size,
        || 16 * 1024 * 1024 * 1024,
        u64::to_string,
    );
    let (finalize_dirs, dirs_source) = layers.take(
        "finalize_dirs",
        (!args.finalize_dirs.is_empty()).then_some(args.finalize_dirs),
        file.finalize_dirs,
        Vec::new,
        |l: &Vec<PathBuf>| {
            let items: Vec<String> = l
                .iter()
                .map(|p| toml_string(&p.to_string_lossy()))
                .collect();
            format!("[{}]", items.join(", "))
        },
    );
    if let Some(relative) = finalize_dirs.iter().find(|d| !d.is_absolute()) {
        return Err(bad(
            "finalize_dirs",
            &dirs_source,
            format!(
                "{:?} is not an absolute path",
                relative.display().to_string()
            ),
        ));
    }
    let (finalize_deadline, deadline_source) = layers.take(
        "finalize_deadline",
        args.finalize_deadline,
        file.finalize_deadline,
        || GoDuration::from_secs(3600),
        show_duration,
    );
    if finalize_deadline.0.is_zero() {
        return Err(bad(
            "finalize_deadline",
            &deadline_source,
            "must be greater than zero",
        ));
    }
    let non_empty = |v: Vec<u32>| (!v.is_empty()).then_some(v);
    // The agent's own uid and root are always admitted (see access.rs): these lists
    // only add to them, so no setting can lock the operator out.
    let (mut allowed_uids, _) = layers.take(
        "allowed_uids",
        non_empty(args.allowed_uids),
        file.allowed_uids,
        Vec::new,
        |l: &Vec<u32>| show_list(l),
    );
    allowed_uids.sort_unstable();
    allowed_uids.dedup();
    let (allowed_gids, _) = layers.take(
        "allowed_gids",
        non_empty(args.allowed_gids),
        file.allowed_gids,
        Vec::new,
        |l: &Vec<u32>| show_list(l),
    );
    let mut count = |key: &'static str, cli, file, default: u32, max: u32| {
        let (value, source) = layers.take(key, cli, file, || default, |v: &u32| v.to_string());
        if value == 0 || value > max {
            return Err(bad(key, &source, format!("must be between 1 and {max}")));
        }
        Ok(value)
    };
    let max_connections_per_uid = count(
        "max_connections_per_uid",
        args.max_connections_per_uid,
        file.max_connections_per_uid,
        DEFAULT_MAX_CONNECTIONS_PER_UID,
        opmon_client::server::MAX_CONNECTIONS,
    )?;
    let (log_format, _) = layers.take(
        "log_format",
        args.log_format,
        file.log_format,
        || LogFormat::Human,
        |f| format!("\"{f}\""),
    );
    let (log_level, level_source) = layers.take(
        "log_level",
        args.log_level,
        file.log_level,
        || "info".into(),
        |l| toml_string(l),
    );
    check_log_level(&log_level).map_err(|e| bad("log_level", &level_source, e))?;
    let (listen_text, listen_source) = layers.take(
        "metrics_listen",
        args.metrics_listen,
        file.metrics_listen,
        String::new,
        |l| toml_string(l),
    );
    let metrics_listen = if listen_text.is_empty() {
        None
    } else {
        Some(listen_text.parse::<SocketAddr>().map_err(|e| {
            bad(
                "metrics_listen",
                &listen_source,
                format!("{listen_text:?} is not host:port ({e})"),
            )
        })?)
    };
    let (allow_api_command_snapshotters, _) = layers.take(
        "allow_api_command_snapshotters",
        args.allow_api_command_snapshotters,
        file.allow_api_command_snapshotters,
        || false,
        bool::to_string,
    );
    let (restore_finalize, _) = layers.take(
        "restore_finalize",
        args.restore_finalize,
        file.restore_finalize,
        || false,
        bool::to_string,
    );
    let (in_progress_idle_timeout, _) = layers.take(
        "in_progress_idle_timeout",
        args.in_progress_idle_timeout,
        file.in_progress_idle_timeout,
        || GoDuration::from_secs(0),
        show_duration,
    );
    let (checkpoint, _) = layers.take(
        "checkpoint",
        args.checkpoint,
        file.checkpoint,
        || Checkpoint::Sqlite,
        |c| format!("\"{c}\""),
    );
    let provenance = layers.provenance;
    let snapshotters = file
        .snapshotter
        .into_iter()
        .map(|s| Snapshotter {
            name: s.name,
            api_version: s.api_version,
            socket: s.socket,
            command: s.command,
        })
        .collect();
    let finalize = crate::core::FinalizeSettings {
        dirs: finalize_dirs,
        deadline: finalize_deadline.0,
        state_dir: Some(state_dir.clone()),
        socket: Some(socket.clone()),
    };
    Ok(Settings {
        config_file,
        socket,
        socket_mode,
        socket_group,
        state_dir,
        storage_dir,
        max_request_size,
        allowed_uids,
        allowed_gids,
        max_connections_per_uid,
        log_format,
        log_level,
        metrics_listen,
        idle_timeout: idle_timeout.0,
        snapshotters,
        checkpoint,
        provenance,
        core: CoreSettings {
            poll_interval: poll_interval.0,
            default_item_operation_timeout: item_operation_timeout,
            retention: retention.0,
            max_decompressed_size,
            finalize,
            unreachable_grace: unreachable_grace.0,
            allow_api_command_snapshotters,
            calls: CallSettings {
                deadline: call_deadline.0,
                batch_size: batch_size as usize,
                socket_concurrency: socket_concurrency as usize,
                command_concurrency: command_concurrency as usize,
            },
            restore_finalize,
            in_progress_idle_timeout: (!in_progress_idle_timeout.0.is_zero())
                .then_some(in_progress_idle_timeout.0),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Resolves `argv` with `file` as the config file's content.
    fn settings(argv: &[&str], file: &str) -> Result<Settings, String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.toml");
        std::fs::write(&path, file).unwrap();
        let mut full = vec![
            "opmon-agent".to_string(),
            "--config".into(),
            path.display().to_string(),
        ];
        full.extend(argv.iter().map(|s| s.to_string()));
        let matches = Args::command()
            .try_get_matches_from(full)
            .map_err(|e| e.to_string())?;
        let args = Args::from_arg_matches(&matches).unwrap();
        resolve(args, &matches).map_err(|e| e.replace(&path.display().to_string(), "FILE"))
    }

    #[test]
    fn flags_win_over_the_file_and_the_file_over_defaults() {
        let s = settings(
            &["--batch-size", "64"],
            "batch_size = 32\npoll_interval = \"2s\"\n",
        )
        .unwrap();
        assert_eq!(s.core.calls.batch_size, 64);
        assert_eq!(s.core.poll_interval, Duration::from_secs(2));
        assert_eq!(s.core.calls.deadline, Duration::from_secs(30));
        let source = |key: &str| {
            s.provenance
                .iter()
                .find(|p| p.key == key)
                .unwrap()
                .source
                .clone()
        };
        assert_eq!(source("batch_size"), Source::Flag("--batch-size".into()));
        assert!(matches!(
            source("poll_interval"),
            Source::File { line: 2, .. }
        ));
        assert_eq!(source("call_deadline"), Source::Default);
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_key_and_line() {
        let e = settings(&[], "batch_size = 5\npol_interval = \"1s\"\n")
            .err()
            .unwrap();
        assert!(
            e.starts_with("config file FILE line 2: unknown field `pol_interval`"),
            "{e}"
        );
        let e = settings(&[], "\n\ncall_deadline = \"soon\"\n")
            .err()
            .unwrap();
        assert!(
            e.starts_with("config file FILE line 3: invalid duration \"soon\""),
            "{e}"
        );
        let e = settings(&[], "poll_interval = \"10ms\"\n").err().unwrap();
        assert_eq!(
            e,
            "poll_interval (from FILE line 1): 10ms is below the minimum of 100ms"
        );
        let e = settings(&[], "socket_mode = \"rw\"\n").err().unwrap();
        assert_eq!(
            e,
            "socket_mode (from FILE line 1): \"rw\" is not an octal file mode like \"0660\""
        );
        let e = settings(&["--batch-size", "0"], "").err().unwrap();
        assert_eq!(
            e,
            "batch_size (from flag --batch-size): must be between 1 and 100000"
        );
    }

    #[test]
    fn checkpoint_is_sqlites_unless_set_and_refuses_other_words() {
        let s = settings(&[], "").unwrap();
        assert_eq!(s.checkpoint, Checkpoint::Sqlite);
        assert!(s.describe().contains("checkpoint = \"sqlite\""));
        let s = settings(&[], "checkpoint = \"external\"\n").unwrap();
        assert_eq!(s.checkpoint, Checkpoint::External);
        let s = settings(&["--checkpoint", "sqlite"], "checkpoint = \"external\"\n").unwrap();
        assert_eq!(
            s.checkpoint,
            Checkpoint::Sqlite,
            "the flag wins over the file"
        );
        let e = settings(&[], "checkpoint = \"litestream\"\n")
            .err()
            .unwrap();
        assert!(
            e.starts_with("config file FILE line 1: unknown variant `litestream`, expected `sqlite` or `external`"),
            "{e}"
        );
    }

    #[test]
    fn restore_finalize_and_the_idle_timeout_are_off_unless_set() {
        let s = settings(&[], "").unwrap();
        assert!(!s.core.restore_finalize);
        assert_eq!(s.core.in_progress_idle_timeout, None);
        let text = s.describe();
        assert!(text.contains("restore_finalize = false"), "{text}");
        assert!(text.contains("in_progress_idle_timeout = \"0s\""), "{text}");
        let s = settings(
            &["--restore-finalize", "true"],
            "restore_finalize = false\nin_progress_idle_timeout = \"1h\"\n",
        )
        .unwrap();
        assert!(s.core.restore_finalize, "the flag wins over the file");
        assert_eq!(
            s.core.in_progress_idle_timeout,
            Some(Duration::from_secs(3600))
        );
        let e = settings(&["--restore-finalize", "yes"], "").err().unwrap();
        assert!(e.contains("invalid value 'yes'"), "{e}");
    }

    #[test]
    fn static_snapshotters_and_access_lists_are_read_from_the_file() {
        let s = settings(
            &[],
            "allowed_uids = [0, 1000]\nsocket_mode = \"0600\"\n\n[[snapshotter]]\nname = \"example.io/copier\"\napi_version = \"v2\"\nsocket = \"/run/copier.sock\"\n",
        )
        .unwrap();
        assert_eq!(s.allowed_uids, vec![0, 1000]);
        assert_eq!(s.socket_mode, 0o600);
        assert_eq!(s.snapshotters.len(), 1);
        assert_eq!(
            s.snapshotters[0].socket.as_deref(),
            Some(Path::new("/run/copier.sock"))
        );
        let text = s.describe();
        assert!(
            text.contains("[[snapshotter]]\nname = \"example.io/copier\""),
            "{text}"
        );
        let reparsed: toml::Table =
            toml::from_str(&text).expect("--print-config prints valid TOML");
        assert_eq!(reparsed["socket_mode"].as_str(), Some("0600"));
    }

    #[test]
    fn command_snapshotters_over_the_api_are_off_unless_allowed() {
        let s = settings(&[], "").unwrap();
        assert!(!s.core.allow_api_command_snapshotters);
        assert!(s
            .describe()
            .contains("allow_api_command_snapshotters = false"));
        let s = settings(&[], "allow_api_command_snapshotters = true\n").unwrap();
        assert!(s.core.allow_api_command_snapshotters);
        let s = settings(
            &["--allow-api-command-snapshotters", "false"],
            "allow_api_command_snapshotters = true\n",
        )
        .unwrap();
        assert!(!s.core.allow_api_command_snapshotters, "the flag wins");
    }
}
