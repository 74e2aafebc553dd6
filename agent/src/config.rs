//! Settings, from four layers in order of precedence: flags, `OPMON_*` environment
//! variables, the TOML config file (`--config`, else `/etc/opmon/agent.toml` when it
//! exists), and the defaults.
//!
//! Each setting is declared once, in the `settings!` invocation below: its key, type,
//! default, bound and doc. From it come the field of [`Settings`], the config file's
//! key, the `OPMON_<KEY>` variable, the `--key-with-dashes` flag (with its `--help`),
//! the `--print-config` line and the table of docs/configuration.md (a test compares
//! it). Every value remembers where it came from, so that an error can say which flag,
//! variable or file line to fix.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{
    Arg, ArgAction, ArgMatches, Command, CommandFactory, FromArgMatches, Parser, ValueEnum,
};
use opmon_client::first_path_of;
use opmon_client::{GoDuration, Snapshotter};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use toml::Spanned;

use crate::core::CoreSettings;
use crate::remote::CallSettings;
use crate::replica::Checkpoint;

/// The config file read when `--config` is not given, if it exists.
pub const DEFAULT_CONFIG: &str = "/etc/opmon/agent.toml";

/// Connections one peer uid may hold at once unless configured.
pub const DEFAULT_MAX_CONNECTIONS_PER_UID: u32 = 256;

/// `OPMON_*` variables of other opmon programs, which an operator's shell or a pod may
/// set beside the agent. Any other `OPMON_*` variable that is no setting stops the agent,
/// so that a misspelt setting is not silently ignored.
pub const OTHER_PROGRAMS_VARIABLES: &[(&str, &str)] = &[
    ("OPMON_PLUGIN", "command snapshotters"),
    ("OPMON_PLUGIN_KIND", "command snapshotters"),
    ("OPMON_OWNER_KIND", "command snapshotters"),
    ("OPMON_OWNER_NAME", "command snapshotters"),
    ("OPMON_OWNER_UID", "command snapshotters"),
    ("OPMON_AGENT_UID", "the opmon CLI"),
    ("OPMON_VELERO_ORIGINAL", "opmon-velero-plugin"),
    ("OPMON_VELERO_AGENT_TIMEOUT", "opmon-velero-plugin"),
];

/// The variable of `--config`, the one flag with a variable that is not a setting.
const CONFIG_VARIABLE: &str = "OPMON_CONFIG";

/// Declares the settings: see the module's doc. Makes [`Settings`], the config file's
/// form, [`declarations`] (what the flags, `--help` and the configuration table are made
/// from) and [`Settings::provenance`].
macro_rules! settings {
    ($(
        $(#[doc = $doc:literal])+
        $key:ident: $ty:ty = $default:expr, shown $shown:expr, check $check:expr;
    )+
    removed {$(
        #[doc = $why:literal]
        $gone:ident;
    )+}) => {
        /// The settings the agent runs on: every declared setting's value, and the
        /// config file's `[[snapshotter]]` tables.
        #[derive(Clone, Debug)]
        pub struct Settings {
            $(pub $key: $ty,)+
            pub config_file: Option<PathBuf>,
            /// The `[[snapshotter]]` tables, checked and with their names in canonical form.
            pub snapshotters: Vec<Snapshotter>,
            /// What works but is likely a mistake or a risk, each naming its key.
            pub warnings: Vec<String>,
            sources: Vec<(&'static str, Source)>,
        }

        /// The config file's form: each setting under its key, and `[[snapshotter]]`.
        #[derive(Deserialize, Default)]
        #[serde(deny_unknown_fields)]
        struct FileConfig {
            $($key: Option<Spanned<$ty>>,)+
            #[serde(default)]
            snapshotter: Vec<Snapshotter>,
            $($gone: Option<Spanned<toml::Value>>,)+
        }

        /// Settings an earlier agent had, and why each went. Found in the config file,
        /// a variable or a flag, each is ignored with a warning naming it, so that an
        /// upgrade neither fails nor is silently misread.
        pub const REMOVED: &[(&str, &str)] = &[$((stringify!($gone), $why)),+];

        /// Every setting as declared, in order.
        pub fn declarations() -> Vec<Declaration> {
            vec![$(Declaration {
                key: stringify!($key),
                doc: join_doc(&[$($doc),+]),
                default: $shown.render(|| {
                    let default: $ty = $default;
                    SettingType::to_toml(&default)
                }),
                arg: <$ty as SettingType>::arg,
            }),+]
        }

        impl Settings {
            /// Each setting from the first layer that has it, checked against its bound.
            fn take(layers: &Layers<'_>, file: &mut FileConfig) -> Result<Settings, String> {
                let mut sources = Vec::new();
                $(
                    let ($key, source): ($ty, Source) =
                        layers.take(stringify!($key), file.$key.take(), || $default);
                    checked(&$key, $check).map_err(|e| bad(stringify!($key), &source, e))?;
                    sources.push((stringify!($key), source));
                )+
                let mut warnings = Vec::new();
                $(
                    let (_, source): (toml::Value, Source) =
                        layers.take(stringify!($gone), file.$gone.take(), || false.into());
                    if source != Source::Default {
                        warnings.push(format!(
                            "{} (from {source}) is no longer a setting and is ignored: {}",
                            stringify!($gone),
                            $why.trim()
                        ));
                    }
                )+
                Ok(Settings {
                    $($key,)+
                    config_file: None,
                    snapshotters: Vec::new(),
                    warnings,
                    sources,
                })
            }

            /// The `--print-config` lines, in declaration order.
            pub fn provenance(&self) -> Vec<Provenance> {
                vec![$(Provenance {
                    key: stringify!($key),
                    value: SettingType::to_toml(&self.$key),
                    source: self.source(stringify!($key)).clone(),
                }),+]
            }
        }
    };
}

// The settings, in the order of `--print-config`, `--help` and docs/configuration.md's table.
// Each entry: doc (the table's "meaning", Markdown), `key: Type = default`, how the
// table shows the default, and the bound every layer's value must keep.
settings! {
    /// the API socket (ignored when systemd passes one)
    socket: PathBuf = opmon_client::standard_socket_path(),
        shown Shown::Text("`$RUNTIME_DIRECTORY/agent.sock`, else `/run/opmon/agent.sock` as root, else `$XDG_RUNTIME_DIR/opmon/agent.sock`, else `/tmp/opmon-<uid>/agent.sock`"),
        check any;
    /// its file mode
    socket_mode: String = "0660".into(), shown Shown::Value,
        check |m: &String| usable_socket_mode(m).map(drop);
    /// its group, by name or number
    socket_group: String = String::new(), shown Shown::Text("the agent's group"), check any;
    /// holds `agent.db`; a relative path is taken against the working directory at start
    state_dir: PathBuf = default_state_dir(),
        shown Shown::Text("`$STATE_DIRECTORY`, else `/var/lib/opmon` as root, else `$XDG_STATE_HOME/opmon`, else `~/.local/state/opmon`"),
        check any;
    /// Velero object-store layout of the results (relative: as `state_dir`); result
    /// paths handed to clients are absolute
    storage_dir: PathBuf = PathBuf::new(), shown Shown::Text("`<state_dir>/storage`"), check any;
    /// how often unfinished operations are polled
    poll_interval: GoDuration = GoDuration::from_secs(10),
        shown Shown::ValueAnd("(at least `100ms`)"), check at_least_100ms;
    /// deadline of every snapshotter call
    call_deadline: GoDuration = GoDuration::from_secs(30), shown Shown::Value, check positive;
    /// progress requests per JSON-RPC batch to a socket snapshotter
    batch_size: u32 = 256, shown Shown::Value, check between(1, 100_000);
    /// batches in flight per socket snapshotter
    socket_concurrency: u32 = 4, shown Shown::Value, check between(1, 1024);
    /// processes at once per command snapshotter
    command_concurrency: u32 = 8, shown Shown::Value, check between(1, 1024);
    /// for owners started without one
    item_operation_timeout: GoDuration = GoDuration::from_secs(4 * 3600), shown Shown::Value,
        check positive;
    /// how long terminal owners are kept
    retention: GoDuration = GoDuration::from_secs(30 * 24 * 3600),
        shown Shown::ValueAnd("(30 days)"), check positive;
    /// how long a snapshotter may be unreachable (refused, reset, past its deadline)
    /// before its operations fail saying so
    unreachable_grace: GoDuration = GoDuration::from_secs(600), shown Shown::Value,
        check positive;
    /// connections whose client sends nothing for this long are closed (the client
    /// library pings)
    idle_timeout: GoDuration = GoDuration::from_secs(15 * 60), shown Shown::Value,
        check positive;
    /// bytes; larger requests are refused unread
    max_request_size: u32 = 16 * 1024 * 1024, shown Shown::Value, check between(1, u32::MAX);
    /// bytes a finalized tarball may expand to
    max_decompressed_size: u64 = 16 * 1024 * 1024 * 1024, shown Shown::ValueAnd("(16 GiB)"),
        check any;
    /// absolute directories besides the storage directory where `finalize` may read its
    /// input and write its output; env/flag: comma-separated
    finalize_dirs: Vec<PathBuf> = Vec::new(), shown Shown::Text("none"),
        check |dirs: &Vec<PathBuf>| all_absolute(dirs);
    /// how long one finalize's tarball rewrite may take; past it the call fails and the
    /// partial output is removed
    finalize_deadline: GoDuration = GoDuration::from_secs(3600), shown Shown::Value,
        check positive;
    /// peers (SO_PEERCRED) allowed to connect besides the agent's own uid and root, which
    /// always are; env/flag: comma-separated
    allowed_uids: Vec<u32> = Vec::new(), shown Shown::Text("none"), check any;
    /// groups whose members may connect: the peer's primary or any supplementary group
    /// (SO_PEERGROUPS)
    allowed_gids: Vec<u32> = Vec::new(), shown Shown::Text("none"), check any;
    /// connections one peer uid may hold at once (root's and the agent's own uid's are
    /// not counted in the agent's total of 4096)
    max_connections_per_uid: u32 = DEFAULT_MAX_CONNECTIONS_PER_UID, shown Shown::Value,
        check between(1, crate::caps::CONNECTIONS as u32);
    /// bytes held for all peers together: request bodies being read or held, answers
    /// not yet read, and snapshotters' answers being read
    max_held_bytes: u64 = 64 * 1024 * 1024, shown Shown::ValueAnd("(64 MiB)"),
        check |b: &u64| match *b >= 1 << 20 {
            true => Ok(()),
            false => Err("must be at least 1048576 (1 MiB)".to_string()),
        };
    /// or `"json"`
    log_format: LogFormat = LogFormat::Human, shown Shown::Value, check any;
    /// a level or `tracing` directives (`info,opmon_agent=debug`); a bare word that is
    /// no level (`verbose`) is refused
    log_level: String = "info".into(), shown Shown::Value,
        check |l: &String| check_log_level(l);
    /// also serve `GET /metrics` on this TCP `host:port`
    metrics_listen: String = String::new(), shown Shown::Text("off"),
        check |l: &String| listen_address(l).map(drop);
    /// let clients register `command` snapshotters over the API (each runs a program of
    /// the client's choosing as the agent's user); those in the config file always work
    allow_api_command_snapshotters: bool = false, shown Shown::Value, check any;
    /// restores started without `finalize` pass through Finalizing and wait for
    /// `restore.finalize`, as in Velero 1.14 and later; `false` matches Velero 1.11–1.13
    restore_finalize: bool = false, shown Shown::Value, check any;
    /// an InProgress owner no call has touched for this long (`start` again or
    /// `addOperations`, even with no operations, count as calls) fails with a failure
    /// reason saying since when; time the agent was down does not count
    in_progress_idle_timeout: GoDuration = GoDuration::from_secs(0),
        shown Shown::ValueAnd("(off)"), check any;
    /// who checkpoints the WAL into `agent.db`: `"sqlite"` (automatically) or
    /// `"external"` (Litestream, once it has copied the WAL: see docs/operations.md,
    /// "Surviving the loss of a node"; without one running the WAL grows)
    checkpoint: Checkpoint = Checkpoint::Sqlite, shown Shown::Value, check any;
    /// start with an empty database although an agent has run with this storage
    /// directory before (`agent.db` missing or empty), forgetting its backups and
    /// restores; without it such a start is refused, to restore the database instead
    start_anew: bool = false, shown Shown::Value, check any;
    removed {
        /// subscriptions are bounded for all peers together (see docs/trust.md)
        max_subscriptions_per_uid;
        /// snapshotters registered over the API are bounded for all peers together (see docs/trust.md)
        max_snapshotters_per_uid;
        /// finalizes are bounded for all peers together (see docs/trust.md)
        max_finalizes_per_uid;
        /// calls in flight are bounded for all peers together (see docs/trust.md)
        max_calls_per_uid;
        /// request bytes are bounded for all peers together by max_held_bytes (see docs/trust.md)
        max_request_bytes_per_uid;
        /// unread answers are bounded for all peers together by max_held_bytes (see docs/trust.md)
        max_unread_bytes_per_uid;
    }
}

/// How the configuration table shows a setting's default.
pub enum Shown {
    /// The default value itself, as TOML.
    Value,
    /// The value, then a note.
    ValueAnd(&'static str),
    /// Words instead: the default depends on the machine or on other settings.
    Text(&'static str),
}

impl Shown {
    fn render(self, value: impl FnOnce() -> String) -> String {
        match self {
            Shown::Value => format!("`{}`", value()),
            Shown::ValueAnd(note) => format!("`{}` {note}", value()),
            Shown::Text(text) => text.to_string(),
        }
    }
}

/// One declared setting: what its flag, variable, `--help` line and table row are made of.
pub struct Declaration {
    pub key: &'static str,
    /// What it means, as Markdown (the table's words).
    pub doc: String,
    /// Its default as the table shows it.
    pub default: String,
    /// Makes the flag parse the setting's type.
    arg: fn(Arg) -> Arg,
}

/// `OPMON_<KEY>`.
fn variable(key: &str) -> String {
    format!("OPMON_{}", key.to_uppercase())
}

/// `--key-with-dashes`.
fn flag(key: &str) -> String {
    format!("--{}", key.replace('_', "-"))
}

impl Declaration {
    pub fn variable(&self) -> String {
        variable(self.key)
    }

    pub fn flag(&self) -> String {
        flag(self.key)
    }

    fn clap_arg(&self) -> Arg {
        let plain = |text: &str| text.replace('`', "");
        let help = format!("{} [default: {}]", plain(&self.doc), plain(&self.default));
        let arg = (self.arg)(
            Arg::new(self.key)
                .long(self.key.replace('_', "-"))
                .env(self.variable())
                .value_name(self.key.to_uppercase())
                .help(help),
        );
        // `--poll-interval -1s` reaches the duration's parser, which names the setting
        // and refuses a negative value, rather than clap reading `-1` as a flag.
        let duration = arg.get_value_parser().type_id() == std::any::TypeId::of::<GoDuration>();
        arg.allow_hyphen_values(duration)
    }
}

/// A doc comment's lines as one paragraph.
fn join_doc(lines: &[&str]) -> String {
    lines.iter().map(|l| l.trim()).collect::<Vec<_>>().join(" ")
}

/// A type a setting can have: how a flag or variable is parsed into it (by clap, so a
/// bad value gets clap's message). The config file reads it and `--print-config` writes
/// it with serde.
pub trait SettingType:
    Clone + fmt::Debug + Send + Sync + DeserializeOwned + Serialize + 'static
{
    /// `arg` made to parse this type.
    fn arg(arg: Arg) -> Arg;
    /// The value a flag or variable gave, if one did.
    fn given(matches: &ArgMatches, id: &str) -> Option<Self>;
    /// The value as TOML; what TOML cannot hold (a path that is not UTF-8, a number past
    /// `i64`) as Rust writes it.
    fn to_toml(&self) -> String {
        toml::Value::try_from(self).map_or_else(|_| format!("{self:?}"), |v| v.to_string())
    }
}

macro_rules! scalar_setting {
    ($($ty:ty),+) => {$(
        impl SettingType for $ty {
            fn arg(arg: Arg) -> Arg {
                arg.value_parser(clap::value_parser!($ty)).action(ArgAction::Set)
            }
            fn given(matches: &ArgMatches, id: &str) -> Option<Self> {
                matches.try_get_one::<$ty>(id).ok().flatten().cloned()
            }
        }
    )+};
}

scalar_setting!(PathBuf, String, GoDuration, u32, u64, bool, LogFormat, Checkpoint);

/// A removed setting's value: whatever it was, read as text from a flag or variable.
impl SettingType for toml::Value {
    fn arg(arg: Arg) -> Arg {
        arg.action(ArgAction::Set)
    }
    fn given(matches: &ArgMatches, id: &str) -> Option<Self> {
        let text = matches.try_get_one::<String>(id).ok().flatten()?;
        Some(toml::Value::String(text.clone()))
    }
}

/// Lists: comma-separated in a flag or variable (or the flag repeated), an array in
/// the file. An empty list given by flag or variable counts as not given.
macro_rules! list_setting {
    ($($item:ty),+) => {$(
        impl SettingType for Vec<$item> {
            fn arg(arg: Arg) -> Arg {
                arg.value_parser(clap::value_parser!($item))
                    .value_delimiter(',')
                    .action(ArgAction::Append)
            }
            fn given(matches: &ArgMatches, id: &str) -> Option<Self> {
                let items = matches.try_get_many::<$item>(id).ok().flatten()?;
                let list: Vec<$item> = items.cloned().collect();
                (!list.is_empty()).then_some(list)
            }
        }
    )+};
}

list_setting!(PathBuf, u32);

/// The bound of a setting that has none.
fn any<T>(_: &T) -> Result<(), String> {
    Ok(())
}

fn positive(d: &GoDuration) -> Result<(), String> {
    if d.0.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(())
}

fn at_least_100ms(d: &GoDuration) -> Result<(), String> {
    if d.0 < Duration::from_millis(100) {
        return Err(format!("{d} is below the minimum of 100ms"));
    }
    Ok(())
}

fn between(min: u32, max: u32) -> impl Fn(&u32) -> Result<(), String> {
    move |v| {
        if *v < min || *v > max {
            return Err(format!("must be between {min} and {max}"));
        }
        Ok(())
    }
}

fn all_absolute(dirs: &[PathBuf]) -> Result<(), String> {
    match dirs.iter().find(|d| !d.is_absolute()) {
        Some(relative) => Err(format!(
            "{:?} is not an absolute path",
            relative.display().to_string()
        )),
        None => Ok(()),
    }
}

/// Applies `check` to `value` (a function, so a generic check like [`any`] gets its type
/// from the value).
fn checked<T>(value: &T, check: impl Fn(&T) -> Result<(), String>) -> Result<(), String> {
    check(value)
}

/// `"0660"` (or `"0o660"`) as a mode.
fn parse_mode(text: &str) -> Result<u32, String> {
    u32::from_str_radix(text.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{text:?} is not an octal file mode like \"0660\""))
}

/// A socket mode the agent's own user can connect with (connecting needs write).
fn usable_socket_mode(text: &str) -> Result<u32, String> {
    let mode = parse_mode(text)?;
    if mode & 0o200 == 0 {
        return Err(format!(
            "{text:?} does not let the owner write the socket, which connecting needs"
        ));
    }
    Ok(mode)
}

/// Why `dir` cannot hold the agent's files, if it is in a kernel file system
/// (`/dev/shm` is the tmpfs for shared memory, and holds files).
fn kernel_file_system(dir: &Path) -> Option<String> {
    ["/proc", "/sys", "/dev"]
        .into_iter()
        .find(|k| dir.starts_with(k) && !dir.starts_with("/dev/shm"))
        .map(|k| {
            format!(
                "{} is in {k}, a kernel file system, which cannot hold its files",
                dir.display()
            )
        })
}

/// A group by name or number; none for `""`.
fn group_id(text: &str) -> Result<Option<u32>, String> {
    if text.is_empty() {
        return Ok(None);
    }
    if let Ok(gid) = text.parse::<u32>() {
        return Ok(Some(gid));
    }
    let group = nix::unistd::Group::from_name(text)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("no group named {text:?}"))?;
    Ok(Some(group.gid.as_raw()))
}

/// A `host:port` to listen on; none for `""`.
fn listen_address(text: &str) -> Result<Option<SocketAddr>, String> {
    if text.is_empty() {
        return Ok(None);
    }
    text.parse::<SocketAddr>()
        .map(Some)
        .map_err(|e| format!("{text:?} is not host:port ({e})"))
}

/// The environment variable of every setting, and `OPMON_CONFIG`.
pub fn setting_variables() -> Vec<String> {
    let mut known: Vec<String> = declarations().iter().map(Declaration::variable).collect();
    known.push(CONFIG_VARIABLE.to_string());
    known
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
                && !REMOVED.iter().any(|(k, _)| variable(k) == *name)
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

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Human,
    Json,
}

/// The command line: [`Args`], and a flag (with its variable) for every declared
/// setting.
pub fn command() -> Command {
    let command = declarations()
        .iter()
        .fold(Args::command(), |command, d| command.arg(d.clap_arg()));
    // A removed setting's flag and variable still parse (unlisted), to be warned of.
    REMOVED.iter().fold(command, |command, (key, _)| {
        command.arg(
            Arg::new(*key)
                .long(key.replace('_', "-"))
                .env(variable(key))
                .hide(true)
                .action(ArgAction::Set),
        )
    })
}

/// The two flags that are not settings; every setting is read from the matches.
#[derive(Parser, Debug, Clone, Default)]
#[command(
    name = "opmon-agent",
    version,
    about = "opmon-agent: monitors the long-running operations of backup and restore plugins",
    long_about = "opmon-agent: monitors the long-running operations of backup and restore \
                  plugins.\n\nEvery setting can also come from an OPMON_* environment variable \
                  or the TOML config file; flags win over variables, variables over the file."
)]
pub struct Args {
    /// TOML config file [default: /etc/opmon/agent.toml if it exists]
    #[arg(long, env = CONFIG_VARIABLE, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the effective configuration, with where each value came from, and exit
    #[arg(long)]
    pub print_config: bool,
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

impl Settings {
    pub fn database(&self) -> PathBuf {
        self.state_dir.join("agent.db")
    }

    /// Where setting `key` came from.
    fn source(&self, key: &str) -> &Source {
        let found = self.sources.iter().find(|(k, _)| *k == key);
        found.map_or(&Source::Default, |(_, source)| source)
    }

    /// The socket's mode (checked when resolved).
    pub fn socket_mode_bits(&self) -> u32 {
        usable_socket_mode(&self.socket_mode).unwrap_or(0o660)
    }

    /// The socket's group, looked up by name; none for the agent's.
    pub fn socket_gid(&self) -> Result<Option<u32>, String> {
        group_id(&self.socket_group)
            .map_err(|e| bad("socket_group", self.source("socket_group"), e))
    }

    /// The metrics listener's address (checked when resolved); none when off.
    pub fn metrics_address(&self) -> Option<SocketAddr> {
        listen_address(&self.metrics_listen).ok().flatten()
    }

    /// What the core runs with.
    pub fn core(&self) -> CoreSettings {
        let idle = self.in_progress_idle_timeout.0;
        CoreSettings {
            max_held_bytes: self.max_held_bytes,
            poll_interval: self.poll_interval.0,
            default_item_operation_timeout: self.item_operation_timeout,
            retention: self.retention.0,
            max_decompressed_size: self.max_decompressed_size,
            finalize: crate::core::FinalizeSettings {
                dirs: self.finalize_dirs.clone(),
                deadline: self.finalize_deadline.0,
                state_dir: Some(self.state_dir.clone()),
                socket: Some(self.socket.clone()),
            },
            unreachable_grace: self.unreachable_grace.0,
            allow_api_command_snapshotters: self.allow_api_command_snapshotters,
            calls: CallSettings {
                deadline: self.call_deadline.0,
                batch_size: self.batch_size as usize,
                socket_concurrency: self.socket_concurrency as usize,
                command_concurrency: self.command_concurrency as usize,
            },
            restore_finalize: self.restore_finalize,
            in_progress_idle_timeout: (!idle.is_zero()).then_some(idle),
        }
    }

    /// The `--print-config` text: valid TOML, each value commented with its source.
    pub fn describe(&self) -> String {
        let mut out = String::new();
        if let Some(file) = &self.config_file {
            out.push_str(&format!("# config file: {}\n", file.display()));
        }
        let provenance = self.provenance();
        let width = provenance
            .iter()
            .map(|p| p.key.len() + p.value.len() + 3)
            .max()
            .unwrap_or(0);
        for p in &provenance {
            let line = format!("{} = {}", p.key, p.value);
            out.push_str(&format!("{line:<width$}  # {}\n", p.source));
        }
        for s in &self.snapshotters {
            out.push_str("\n[[snapshotter]]\n");
            // Key by key, so that `env` stays an inline table on its line.
            if let Ok(toml::Value::Table(table)) = toml::Value::try_from(s) {
                for (key, value) in table {
                    out.push_str(&format!("{} = {value}\n", file_keys(&key)));
                }
            }
        }
        out
    }
}

/// `dir` made absolute against the working directory (lexically: `..` is kept).
fn absolute(key: &str, dir: &Path) -> Result<PathBuf, String> {
    std::path::absolute(dir).map_err(|e| format!("{key}: {}: {e}", dir.display()))
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

/// The layers a value can come from: the parsed command line and environment, and the
/// config file's text (for line numbers).
struct Layers<'a> {
    matches: &'a ArgMatches,
    file_path: Option<&'a Path>,
    file_text: &'a str,
}

impl Layers<'_> {
    /// Setting `key` (also its clap id): from its flag or variable, else the file, else
    /// `default`.
    fn take<T: SettingType>(
        &self,
        key: &'static str,
        file: Option<Spanned<T>>,
        default: impl FnOnce() -> T,
    ) -> (T, Source) {
        if let Some(value) = T::given(self.matches, key) {
            let source = match self.matches.value_source(key) {
                Some(ValueSource::EnvVariable) => Source::Env(variable(key)),
                _ => Source::Flag(flag(key)),
            };
            return (value, source);
        }
        if let Some(spanned) = file {
            let line = line_of(self.file_text, spanned.span());
            let path = self.file_path.map(Path::to_path_buf).unwrap_or_default();
            return (spanned.into_inner(), Source::File { path, line });
        }
        (default(), Source::Default)
    }
}

/// The key `path` leads to, as written in TOML (`snapshotter[0].name`), short of the
/// last key when `message` already names it (an unknown field).
fn key_of(path: &serde_path_to_error::Path, message: &str) -> String {
    use serde_path_to_error::Segment;
    let mut keys: Vec<String> = Vec::new();
    for segment in path.iter() {
        match segment {
            // toml's `Spanned` is a struct of its own to serde.
            Segment::Map { key } if key.starts_with("$__serde_spanned") => {}
            Segment::Map { key } => keys.push(key.clone()),
            Segment::Seq { index } => match keys.last_mut() {
                Some(last) => last.push_str(&format!("[{index}]")),
                None => keys.push(format!("[{index}]")),
            },
            Segment::Enum { .. } | Segment::Unknown => {}
        }
    }
    if keys
        .last()
        .is_some_and(|k| message.contains(&format!("`{k}`")))
    {
        keys.pop();
    }
    keys.join(".")
}

/// The line of `text` where `span` starts.
fn line_of(text: &str, span: std::ops::Range<usize>) -> usize {
    text[..span.start.min(text.len())].matches('\n').count() + 1
}

/// `key (from SOURCE): reason`.
fn bad(key: &str, source: &Source, reason: impl fmt::Display) -> String {
    format!("{key} (from {source}): {reason}")
}

impl Settings {
    /// What involves the machine or more than one setting: directories made absolute
    /// (clients are handed paths under them), the storage directory's default under the
    /// state directory, the uid list in order.
    fn sanitize(&mut self) -> Result<(), String> {
        self.state_dir = absolute("state_dir", &self.state_dir)?;
        self.storage_dir = if *self.source("storage_dir") == Source::Default {
            self.state_dir.join("storage")
        } else {
            absolute("storage_dir", &self.storage_dir)?
        };
        self.allowed_uids.sort_unstable();
        self.allowed_uids.dedup();
        for (key, dir) in [
            ("state_dir", &self.state_dir),
            ("storage_dir", &self.storage_dir),
        ] {
            if let Some(why) = kernel_file_system(dir) {
                return Err(bad(key, self.source(key), why));
            }
        }
        let source = self.source("finalize_dirs");
        for dir in &self.finalize_dirs {
            if dir.parent().is_none() {
                return Err(bad(
                    "finalize_dirs",
                    source,
                    "/ would let finalize read and write any file the agent may: name the \
                     directories tarballs are in",
                ));
            }
            if let Some(why) = kernel_file_system(dir) {
                return Err(bad("finalize_dirs", source, why));
            }
        }
        self.socket_gid()?;
        let risks = self.risks();
        self.warnings.extend(risks);
        Ok(())
    }

    /// What works but is likely a mistake or a risk, each naming its key: logged at start.
    fn risks(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if self.socket_mode_bits() & 0o002 != 0 {
            warnings.push(format!(
                "socket_mode (from {}): {} lets every local user connect; only allowed_uids \
                 and allowed_gids then stand between them and the API",
                self.source("socket_mode"),
                self.socket_mode
            ));
        }
        for dir in &self.finalize_dirs {
            if self.state_dir.starts_with(dir) {
                warnings.push(format!(
                    "finalize_dirs (from {}): {} holds the state directory {}",
                    self.source("finalize_dirs"),
                    dir.display(),
                    self.state_dir.display()
                ));
            }
        }
        warnings
    }
}

/// The fields of [`Snapshotter`] the config file spells in snake case, as its other keys.
const FILE_KEYS: &[(&str, &str)] = &[
    ("veleroPlugin", "velero_plugin"),
    ("apiVersion", "api_version"),
    ("stallTimeout", "stall_timeout"),
    ("startTimeout", "start_timeout"),
    ("retryAttempts", "retry_attempts"),
    ("retryBackoff", "retry_backoff"),
    ("retryWithin", "retry_within"),
];

/// The API's words for [`Snapshotter`]'s fields, as the config file spells them.
fn file_keys(message: &str) -> String {
    FILE_KEYS
        .iter()
        .fold(message.to_string(), |m, (api, key)| m.replace(api, key))
}

/// The file's `[[snapshotter]]` tables in the API's spelling, so that they read as
/// [`Snapshotter`]s: `api_version` as `apiVersion` (`"v2"` when a `velero_plugin` table
/// leaves it out); a key already in the API's spelling is refused, naming its line.
fn api_spelling(
    file: &mut toml::de::DeTable<'_>,
) -> Result<(), (std::ops::Range<usize>, String, String)> {
    use toml::de::{DeString, DeValue};
    let Some(DeValue::Array(tables)) = file.get_mut("snapshotter").map(|v| v.get_mut()) else {
        return Ok(());
    };
    for (index, table) in tables.iter_mut().enumerate() {
        let span = table.span();
        let DeValue::Table(table) = table.get_mut() else {
            continue;
        };
        let mut renamed = toml::de::DeTable::new();
        for (key, value) in std::mem::take(table) {
            if let Some((api, file)) = FILE_KEYS.iter().find(|(api, _)| *key.get_ref() == *api) {
                return Err((
                    key.span(),
                    format!("snapshotter[{index}]"),
                    format!("unknown field `{api}`, spelt `{file}` in the file"),
                ));
            }
            let api = FILE_KEYS.iter().find(|(_, file)| *key.get_ref() == *file);
            let name = api.map_or(key.get_ref().clone(), |(api, _)| DeString::from(*api));
            renamed.insert(toml::Spanned::new(key.span(), name), value);
        }
        if renamed.contains_key("veleroPlugin") && !renamed.contains_key("apiVersion") {
            let v2 = DeValue::String(DeString::from("v2"));
            renamed.insert(
                toml::Spanned::new(span.clone(), DeString::from("apiVersion")),
                toml::Spanned::new(span, v2),
            );
        }
        *table = renamed;
    }
    Ok(())
}

/// The config file's `[[snapshotter]]` tables, each checked as `snapshotter.register`
/// checks one (its name made canonical), so a bad table stops the agent (or refuses a
/// reload) before anything is opened.
fn config_snapshotters(tables: Vec<Snapshotter>) -> Result<Vec<Snapshotter>, String> {
    let snapshotters: Vec<Snapshotter> = tables
        .into_iter()
        .map(|mut s| {
            let given = s.name.clone();
            crate::api::check_snapshotter(&mut s).map_err(|e| {
                format!("config snapshotter {given}: {}", file_keys(&e.to_string()))
            })?;
            Ok(s)
        })
        .collect::<Result<_, String>>()?;
    // Two tables of one name (after legacy names are mapped): one would silently win.
    let mut seen = std::collections::HashSet::new();
    if let Some(twice) = snapshotters.iter().find(|s| !seen.insert(s.name.as_str())) {
        return Err(format!(
            "config snapshotter {}: two [[snapshotter]] tables have this name",
            twice.name
        ));
    }
    Ok(snapshotters)
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

/// The largest config file read: far beyond any real one, and a bound on what a wrong
/// path (`/dev/zero`) can cost.
const MAX_CONFIG_FILE: u64 = 1024 * 1024;

fn read_config_file(path: &Path) -> Result<String, String> {
    use std::io::Read;
    let failed = |e: &dyn fmt::Display| format!("reading config file {}: {e}", path.display());
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_CONFIG_FILE + 1).read_to_string(&mut text))
        .map_err(|e| failed(&e))?;
    if text.len() as u64 > MAX_CONFIG_FILE {
        return Err(failed(&format!("larger than {MAX_CONFIG_FILE} bytes")));
    }
    Ok(text)
}

/// Parses the command line (and environment) into settings, reading the config file.
/// Refuses `OPMON_*` variables that are not settings (see [`check_environment`]).
pub fn load() -> Result<(Settings, CommandLine), String> {
    drop_empty_variables();
    let matches = command()
        .try_get_matches()
        .unwrap_or_else(|e| name_the_variable(e, std::env::args_os()).exit());
    let args = Args::from_arg_matches(&matches).map_err(|e| e.to_string())?;
    check_environment(std::env::vars_os())?;
    let command_line = CommandLine { args, matches };
    command_line.resolve().map(|s| (s, command_line))
}

/// Clap's error for a bad value, naming the variable rather than the flag when the
/// value came from the environment (`OPMON_POLL_INTERVAL=fast` was not typed as
/// `--poll-interval`), as the errors of the config file name its key.
fn name_the_variable(
    error: clap::Error,
    typed: impl Iterator<Item = std::ffi::OsString>,
) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if !matches!(
        error.kind(),
        ErrorKind::InvalidValue | ErrorKind::ValueValidation
    ) {
        return error;
    }
    let Some(ContextValue::String(arg)) = error.get(ContextKind::InvalidArg) else {
        return error;
    };
    let Some(flag) = arg.split_whitespace().next() else {
        return error;
    };
    let declared = declarations();
    let Some(declared) = declared.iter().find(|d| d.flag() == flag) else {
        return error;
    };
    let typed = typed.skip(1).any(|word| {
        let word = word.to_string_lossy();
        word == flag || word.starts_with(&format!("{flag}="))
    });
    if typed {
        return error;
    }
    let value = match error.get(ContextKind::InvalidValue) {
        Some(ContextValue::String(value)) => value.clone(),
        _ => String::new(),
    };
    let why = match std::error::Error::source(&error) {
        Some(source) => source.to_string(),
        None => match error.get(ContextKind::ValidValue) {
            Some(ContextValue::Strings(valid)) => {
                format!("{value:?} is not one of {}", valid.join(", "))
            }
            _ => format!("{value:?} is not valid"),
        },
    };
    command().error(
        ErrorKind::ValueValidation,
        format!("{}: {why}", declared.variable()),
    )
}

/// Removes the `OPMON_*` variables that are set but empty: an empty variable means unset
/// (`OPMON_SOCKET=` is the CLI's way to say "the default" too), not a value of "".
/// Runs first in `main`, before any other thread could read the environment.
fn drop_empty_variables() {
    for (name, value) in std::env::vars_os() {
        if value.is_empty() && name.to_string_lossy().starts_with("OPMON_") {
            std::env::remove_var(&name);
        }
    }
}

/// Resolves the settings of `matches` (`args` parsed from them) against the config
/// file and the defaults.
pub fn resolve(args: Args, matches: &ArgMatches) -> Result<Settings, String> {
    let config_file = match args.config {
        Some(path) => Some(path),
        None if Path::new(DEFAULT_CONFIG).exists() => Some(PathBuf::from(DEFAULT_CONFIG)),
        None => None,
    };
    let file_text = match &config_file {
        Some(path) => read_config_file(path)?,
        None => String::new(),
    };
    let failed = |span: Option<std::ops::Range<usize>>, key: String, message: &str| {
        let path = config_file.as_deref().unwrap_or(Path::new("")).display();
        let at = match span {
            Some(span) => format!(" line {}", line_of(&file_text, span)),
            None => String::new(),
        };
        let key = if key.is_empty() { key } else { key + ": " };
        format!("config file {path}{at}: {key}{message}")
    };
    let mut table = toml::de::DeTable::parse(&file_text)
        .map_err(|e| failed(e.span(), String::new(), e.message()))?;
    api_spelling(table.get_mut()).map_err(|(span, key, e)| failed(Some(span), key, &e))?;
    // The key's path (serde_path_to_error's) beside the line: toml's message names only
    // the value ("invalid value: integer `-1`, expected u32").
    let mut file: FileConfig =
        serde_path_to_error::deserialize(toml::de::Deserializer::from(table)).map_err(|e| {
            let key = key_of(e.path(), e.inner().message());
            failed(
                e.inner().span(),
                file_keys(&key),
                &file_keys(e.inner().message()),
            )
        })?;
    let layers = Layers {
        matches,
        file_path: config_file.as_deref(),
        file_text: &file_text,
    };
    let mut settings = Settings::take(&layers, &mut file)?;
    settings.sanitize()?;
    settings.snapshotters = config_snapshotters(file.snapshotter)?;
    settings.config_file = config_file;
    Ok(settings)
}

#[cfg(test)]
mod tests {
    use super::*;
    use opmon_client::ApiVersion;

    #[test]
    fn the_variables_of_opmons_other_programs_do_not_stop_the_agent() {
        let vars = |names: &[&str]| {
            names
                .iter()
                .map(|n| (n.into(), "x".into()))
                .collect::<Vec<(std::ffi::OsString, std::ffi::OsString)>>()
        };
        // The stand-in's, set beside the agent where both run in one environment.
        check_environment(vars(&[
            "OPMON_VELERO_ORIGINAL",
            "OPMON_VELERO_AGENT_TIMEOUT",
        ]))
        .unwrap();
        let e = check_environment(vars(&["OPMON_VELERO_ORIGNAL"])).unwrap_err();
        assert!(e.contains("OPMON_VELERO_ORIGNAL"), "{e}");
    }

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
        let matches = command()
            .try_get_matches_from(full)
            .map_err(|e| e.to_string())?;
        let args = Args::from_arg_matches(&matches).unwrap();
        let shown = path.display().to_string();
        let mut s = resolve(args, &matches).map_err(|e| e.replace(&shown, "FILE"))?;
        s.warnings = s
            .warnings
            .iter()
            .map(|w| w.replace(&shown, "FILE"))
            .collect();
        Ok(s)
    }

    #[test]
    fn a_removed_setting_is_warned_of_naming_it_and_why_wherever_it_is_given() {
        let s = settings(
            &["--max-calls-per-uid", "8"],
            "batch_size = 5\nmax_unread_bytes_per_uid = 100\n",
        )
        .unwrap();
        assert_eq!(
            s.warnings,
            vec![
                "max_calls_per_uid (from flag --max-calls-per-uid) is no longer a setting and \
                 is ignored: calls in flight are bounded for all peers together (see \
                 docs/trust.md)"
                    .to_string(),
                "max_unread_bytes_per_uid (from FILE line 2) is no longer a setting and is \
                 ignored: unread answers are bounded for all peers together by max_held_bytes \
                 (see docs/trust.md)"
                    .to_string(),
            ]
        );
        assert!(!s.describe().contains("per_uid = 8"), "not printed back");
        let s = settings(&["--max-calls-per-uid", "8"], "max_calls_per_uid = 3\n").unwrap();
        assert_eq!(
            s.warnings,
            vec![
                "max_calls_per_uid (from flag --max-calls-per-uid) is no longer a setting and \
                 is ignored: calls in flight are bounded for all peers together (see \
                 docs/trust.md)"
                    .to_string()
            ],
            "once, naming where it wins, as a setting's source is named"
        );
        check_environment(vec![("OPMON_MAX_FINALIZES_PER_UID".into(), "8".into())]).unwrap();
        let help = command().render_long_help().to_string();
        assert!(!help.contains("max-calls-per-uid"), "{help}");
    }

    #[test]
    fn flags_win_over_the_file_and_the_file_over_defaults() {
        let s = settings(
            &["--batch-size", "64"],
            "batch_size = 32\npoll_interval = \"2s\"\n",
        )
        .unwrap();
        assert_eq!(s.core().calls.batch_size, 64);
        assert_eq!(s.core().poll_interval, Duration::from_secs(2));
        assert_eq!(s.core().calls.deadline, Duration::from_secs(30));
        let source = |key: &str| {
            s.provenance()
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
            e.starts_with("config file FILE line 3: call_deadline: invalid duration \"soon\""),
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
            e.starts_with(
                "config file FILE line 1: checkpoint: unknown variant `litestream`, expected `sqlite` or `external`"
            ),
            "{e}"
        );
    }

    #[test]
    fn restore_finalize_and_the_idle_timeout_are_off_unless_set() {
        let s = settings(&[], "").unwrap();
        assert!(!s.core().restore_finalize);
        assert_eq!(s.core().in_progress_idle_timeout, None);
        let text = s.describe();
        assert!(text.contains("restore_finalize = false"), "{text}");
        assert!(text.contains("in_progress_idle_timeout = \"0s\""), "{text}");
        let s = settings(
            &["--restore-finalize", "true"],
            "restore_finalize = false\nin_progress_idle_timeout = \"1h\"\n",
        )
        .unwrap();
        assert!(s.core().restore_finalize, "the flag wins over the file");
        assert_eq!(
            s.core().in_progress_idle_timeout,
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
        assert_eq!(s.socket_mode_bits(), 0o600);
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
    fn snapshotter_tables_take_deadlines_and_retry_budgets_and_print_them_back() {
        let table = "[[snapshotter]]\nname = \"example.io/copier\"\napi_version = \"v2\"\n\
                     socket = \"/run/copier.sock\"\nstall_timeout = \"30m\"\n\
                     start_timeout = \"5m\"\nretry_attempts = 3\nretry_backoff = \"2s\"\n\
                     retry_within = \"1h\"\n";
        let s = settings(&[], table).unwrap();
        let c = &s.snapshotters[0];
        assert_eq!(c.stall_timeout, Some(GoDuration::from_secs(1800)));
        assert_eq!(c.start_timeout, Some(GoDuration::from_secs(300)));
        assert_eq!(c.retry_attempts, Some(3));
        assert_eq!(c.retry_backoff, Some(GoDuration::from_secs(2)));
        assert_eq!(c.retry_within, Some(GoDuration::from_secs(3600)));
        let text = s.describe();
        for line in [
            "stall_timeout = \"30m0s\"",
            "start_timeout = \"5m0s\"",
            "retry_attempts = 3",
            "retry_backoff = \"2s\"",
            "retry_within = \"1h0m0s\"",
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
        let again = settings(&[], &text).unwrap();
        assert_eq!(
            again.snapshotters, s.snapshotters,
            "--print-config reads back"
        );
        let e = settings(&[], &table.replace("\"30m\"", "\"soon\""))
            .err()
            .unwrap();
        assert_eq!(
            e,
            "config file FILE line 5: snapshotter[0].stall_timeout: invalid duration \"soon\": expected a number"
        );
        let e = settings(&[], &table.replace("\"2s\"", "\"0s\""))
            .err()
            .unwrap();
        assert_eq!(
            e,
            "config snapshotter example.io/copier: retry_backoff: must be greater than zero"
        );
    }

    #[test]
    fn command_snapshotters_over_the_api_are_off_unless_allowed() {
        let s = settings(&[], "").unwrap();
        assert!(!s.core().allow_api_command_snapshotters);
        assert!(s
            .describe()
            .contains("allow_api_command_snapshotters = false"));
        let s = settings(&[], "allow_api_command_snapshotters = true\n").unwrap();
        assert!(s.core().allow_api_command_snapshotters);
        let s = settings(
            &["--allow-api-command-snapshotters", "false"],
            "allow_api_command_snapshotters = true\n",
        )
        .unwrap();
        assert!(!s.core().allow_api_command_snapshotters, "the flag wins");
    }

    /// The table row of the `[[snapshotter]]` tables, which are not a key=value setting.
    const SNAPSHOTTER_ROW: &str = "| `[[snapshotter]]` | none | tables with `name`, `api_version`, `socket` or `command`, and optionally `stall_timeout`, `start_timeout`, `retry_attempts`, `retry_backoff`, `retry_within` (see [Deadlines and retries](../client/REFERENCE.md#deadlines-and-retries)), registered at every start |";

    /// The table of docs/configuration.md, made from the declarations (a test checks that
    /// the file holds exactly this).
    fn settings_table() -> String {
        let mut out = String::from("| key | default | meaning |\n|---|---|---|\n");
        for d in declarations() {
            out.push_str(&format!("| `{}` | {} | {} |\n", d.key, d.default, d.doc));
        }
        out.push_str(SNAPSHOTTER_ROW);
        out.push('\n');
        out
    }

    #[test]
    fn the_documented_table_is_the_declarations() {
        let doc = include_str!("../../docs/configuration.md");
        let table = doc
            .split_once("<!-- settings:begin")
            .and_then(|(_, rest)| rest.split_once('\n'))
            .and_then(|(_, rest)| rest.split_once("<!-- settings:end -->"))
            .map(|(table, _)| table)
            .expect("docs/configuration.md has the settings:begin and settings:end markers");
        let declared = settings_table();
        assert!(
            table == declared,
            "docs/configuration.md's table differs from the declarations in \
             agent/src/config.rs; the table they make is:\n{declared}"
        );
    }

    #[test]
    fn every_setting_has_a_flag_a_variable_and_a_print_config_line() {
        let keys: Vec<&str> = declarations().iter().map(|d| d.key).collect();
        let s = settings(&[], "").unwrap();
        let printed: Vec<&str> = s.provenance().iter().map(|p| p.key).collect();
        assert_eq!(printed, keys);
        let command = command();
        for d in declarations() {
            let arg = command
                .get_arguments()
                .find(|a| a.get_id() == d.key)
                .unwrap_or_else(|| panic!("no flag for {}", d.key));
            assert_eq!(arg.get_long(), Some(&d.flag()[2..]));
            assert_eq!(
                arg.get_env().map(|v| v.to_string_lossy().into_owned()),
                Some(d.variable())
            );
        }
        assert!(setting_variables().contains(&"OPMON_CONFIG".to_string()));
    }

    #[test]
    fn a_list_comes_comma_separated_from_a_flag_and_as_an_array_from_the_file() {
        let s = settings(&["--allowed-uids", "1000,7,1000"], "allowed_uids = [5]\n").unwrap();
        assert_eq!(
            s.allowed_uids,
            vec![7, 1000],
            "sorted, once each; the flag wins"
        );
        let s = settings(&["--finalize-dirs", "/a,/b"], "").unwrap();
        assert_eq!(
            s.core().finalize.dirs,
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
        let e = settings(&[], "finalize_dirs = [\"/a\", \"rel\"]\n")
            .err()
            .unwrap();
        assert_eq!(
            e,
            "finalize_dirs (from FILE line 1): \"rel\" is not an absolute path"
        );
    }

    #[test]
    fn relative_directories_are_made_absolute_and_storage_follows_state() {
        let s = settings(&["--state-dir", "rel/state"], "").unwrap();
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(s.state_dir, cwd.join("rel/state"));
        assert_eq!(s.storage_dir, cwd.join("rel/state/storage"));
        let s = settings(&["--state-dir", "/s"], "storage_dir = \"out\"\n").unwrap();
        assert_eq!(s.storage_dir, cwd.join("out"));
        assert!(s
            .describe()
            .contains(&format!("storage_dir = \"{}\"", cwd.join("out").display())));
    }

    #[test]
    fn snapshotter_tables_are_the_apis_type_in_the_files_spelling() {
        let e = settings(
            &[],
            "[[snapshotter]]\nname = \"example.io/a\"\napiVersion = \"v2\"\nsocket = \"/a.sock\"\n",
        )
        .err()
        .unwrap();
        assert_eq!(
            e,
            "config file FILE line 3: snapshotter[0]: unknown field `apiVersion`, spelt `api_version` in the file"
        );
        let e = settings(
            &[],
            "[[snapshotter]]\nname = \"example.io/a\"\nsocket = \"/a.sock\"\n",
        )
        .err()
        .unwrap();
        assert!(
            e.starts_with("config file FILE line 1: snapshotter[0]: missing field `api_version`"),
            "{e}"
        );
        let e = settings(
            &[],
            "[[snapshotter]]\nname = \"example.io/a\"\napi_version = \"v2\"\nsockett = \"/a.sock\"\n",
        )
        .err()
        .unwrap();
        assert!(
            e.starts_with("config file FILE line 4: snapshotter[0]: unknown field `sockett`, expected one of `name`, `api_version`, `socket`, `command`, `velero_plugin`"),
            "{e}"
        );
        let s = settings(
            &[],
            "[[snapshotter]]\nname = \"example.io/p\"\nvelero_plugin = \"/bin/p\"\nenv = { A = \"1\" }\n",
        )
        .unwrap();
        assert_eq!(s.snapshotters[0].api_version, ApiVersion::V2);
        let text = s.describe();
        assert!(
            text.contains("api_version = \"v2\"\nvelero_plugin = \"/bin/p\"\nenv = { A = \"1\" }"),
            "{text}"
        );
    }

    #[test]
    fn a_bad_snapshotter_table_is_refused_naming_it() {
        let e = settings(
            &[],
            "[[snapshotter]]\nname = \"example.io/both\"\napi_version = \"v2\"\n",
        )
        .err()
        .unwrap();
        assert_eq!(
            e,
            "config snapshotter example.io/both: socket: a v2 snapshotter needs exactly one of socket, command and velero_plugin"
        );
        let s = settings(
            &[],
            "[[snapshotter]]\nname = \"legacy\"\napi_version = \"v1\"\n",
        )
        .unwrap();
        assert_eq!(
            s.snapshotters[0].name, "velero.io/legacy",
            "canonical, as Velero maps it"
        );
    }
}
