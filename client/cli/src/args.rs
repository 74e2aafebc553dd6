//! The command line, as clap sees it. Every API method has a subcommand; `backup` and
//! `restore` share one definition.

use std::ffi::OsStr;
use std::path::PathBuf;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use clap_complete::ArgValueCompleter;
use opmon_client::{
    ApiVersion, GoDuration, OperationPhase, OwnerKind, OwnerPhase, PluginKind, Timestamp,
};

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

/// The command line as the user sees it: [`Cli`], with what differs between `backup`
/// and `restore`, which share [`OwnerCommand`]: `--finalize` is a restore's alone, so a
/// backup's help does not offer it (given anyway, it is refused with the reason).
///
/// Names complete from the running agent: a backup's or restore's NAME from its list, a
/// snapshotter's and `--plugin` from the registered snapshotters.
pub fn command() -> clap::Command {
    let owners = |kind: OwnerKind| {
        move |owner: clap::Command| {
            let subcommands: Vec<String> = owner
                .get_subcommands()
                .filter(|c| c.get_name() != "start")
                .filter(|c| c.get_arguments().any(|a| a.get_id() == "name"))
                .map(|c| c.get_name().to_string())
                .collect();
            subcommands.iter().fold(owner, |owner, name| {
                owner.mut_subcommand(name, |sub| {
                    sub.mut_arg("name", |arg| {
                        arg.add(ArgValueCompleter::new(move |current: &OsStr| {
                            complete::owners(kind, current)
                        }))
                    })
                })
            })
        }
    };
    Cli::command()
        .mut_subcommand("backup", owners(OwnerKind::Backup))
        .mut_subcommand("restore", owners(OwnerKind::Restore))
        .mut_subcommand("backup", |backup| {
            backup.mut_subcommand("start", |start| {
                start.mut_arg("finalize", |finalize| finalize.hide(true))
            })
        })
}

/// Shell completion of names, asked of the agent the line being completed names
/// (`--socket`, `--agent-uid`, else their variables) while the user presses tab. An
/// agent that cannot be reached within a second completes nothing.
mod complete {
    use std::ffi::OsStr;
    use std::time::Duration;

    use clap_complete::CompletionCandidate;
    use opmon_client::{Client, OwnerKind, Snapshotter};

    fn ask<T, F: std::future::Future<Output = Option<T>>>(
        call: impl FnOnce(Client) -> F,
    ) -> Option<T> {
        let (socket, agent_uid) = super::AGENT.get()?.clone();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?;
        runtime.block_on(async {
            let client = agent_uid
                .iter()
                .fold(Client::builder(socket), |b, &uid| b.agent_uid(uid))
                .connect_timeout(Duration::from_secs(1))
                .call_timeout(Duration::from_secs(1))
                .connect()
                .await
                .ok()?;
            call(client).await
        })
    }

    fn candidates(names: Vec<String>, current: &OsStr) -> Vec<CompletionCandidate> {
        let current = current.to_string_lossy();
        names
            .into_iter()
            .filter(|n| n.starts_with(current.as_ref()))
            .map(CompletionCandidate::new)
            .collect()
    }

    pub fn owners(kind: OwnerKind, current: &OsStr) -> Vec<CompletionCandidate> {
        let names = ask(|client: Client| async move {
            let list = client.owners(kind).list().limit(1000).await.ok()?;
            Some(list.items.into_iter().map(|o| o.name).collect())
        });
        candidates(names.unwrap_or_default(), current)
    }

    pub fn snapshotters(current: &OsStr) -> Vec<CompletionCandidate> {
        let names = ask(|client: Client| async move {
            let list: Vec<Snapshotter> = client.snapshotters().await.ok()?;
            Some(list.into_iter().map(|s| s.name).collect())
        });
        candidates(names.unwrap_or_default(), current)
    }
}

/// The agent completion asks: set by [`completing`] from the words being completed.
static AGENT: std::sync::OnceLock<(PathBuf, Vec<u32>)> = std::sync::OnceLock::new();

/// The command for `COMPLETE=<shell> opmon -- <words>`: its name completers ask the
/// agent that `<words>` (as far as they parse) or the environment name.
pub fn completing() -> clap::Command {
    let words: Vec<std::ffi::OsString> = std::env::args_os()
        .skip_while(|w| w != "--")
        .skip(1)
        .collect();
    let matches = command().ignore_errors(true).try_get_matches_from(words);
    let (socket, agent_uid) = matches
        .map(|m| {
            let socket = m.get_one::<PathBuf>("socket").cloned();
            let uids = m.get_many::<u32>("agent_uid").into_iter().flatten();
            (socket, uids.copied().collect())
        })
        .unwrap_or_default();
    if let Ok(agent) = from_environment(socket, agent_uid) {
        let _ = AGENT.set(agent);
    }
    command()
}

/// Parses the command line, then the environment for what it left out.
pub fn parse() -> Cli {
    let matches = command().get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    match from_environment(cli.socket.take(), std::mem::take(&mut cli.agent_uid)) {
        Ok((socket, agent_uid)) => {
            cli.socket = Some(socket);
            cli.agent_uid = agent_uid;
        }
        Err(e) => Cli::command()
            .error(clap::error::ErrorKind::ValueValidation, e)
            .exit(),
    }
    cli
}

/// `--socket` and `--agent-uid` as typed, else `OPMON_SOCKET` and `OPMON_AGENT_UID`,
/// else the default socket. The variables are read here rather than by clap, so that an
/// error names the variable a bad value came from and a usage line shows only what was
/// typed. A variable set but empty means unset, as for most tools.
fn from_environment(
    socket: Option<PathBuf>,
    agent_uid: Vec<u32>,
) -> Result<(PathBuf, Vec<u32>), String> {
    let variable = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    let socket = socket
        .or_else(|| variable("OPMON_SOCKET").map(PathBuf::from))
        .unwrap_or_else(opmon_client::default_socket_path);
    if !agent_uid.is_empty() {
        return Ok((socket, agent_uid));
    }
    let agent_uid = match variable("OPMON_AGENT_UID") {
        None => Vec::new(),
        Some(users) => users
            .to_string_lossy()
            .split(',')
            .map(|user| user_id(user).map_err(|e| format!("OPMON_AGENT_UID: {e}")))
            .collect::<Result<_, _>>()?,
    };
    Ok((socket, agent_uid))
}

/// The heading of the options every command takes, so that each command's own come first.
const GLOBAL: &str = "Global options";

/// opmon: drive and watch the opmon agent's backups, restores and snapshotters.
///
/// Exit codes: 0 success; 1 the owner is PartiallyFailed (or on its way there);
/// 2 it Failed, or the command failed; 3 `wait` timed out.
#[derive(Parser, Debug)]
#[command(name = "opmon", version, about, long_about)]
pub struct Cli {
    /// The agent's socket [env: OPMON_SOCKET] [default: as the agent resolves it].
    #[arg(long, global = true, help_heading = GLOBAL)]
    pub socket: Option<PathBuf>,

    /// Users (names or uids) trusted to serve the socket besides root and yourself: the
    /// agent's user when it is neither. A socket served by anyone else is refused
    /// [env: OPMON_AGENT_UID].
    #[arg(long, value_delimiter = ',', value_parser = user_id, global = true, help_heading = GLOBAL)]
    pub agent_uid: Vec<u32>,

    /// How reads are printed; json is exactly the API's result.
    #[arg(
        short = 'o',
        long = "output",
        value_enum,
        default_value_t = Output::Table,
        global = true,
        help_heading = GLOBAL
    )]
    pub output: Output,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// For people: tables, and progress bars on a terminal.
    Table,
    /// Exactly the API's result, for programs.
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
        /// The shell to complete in.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(Subcommand, Debug)]
pub enum OwnerCommand {
    /// Creates it in InProgress (same name and uid again is fine).
    Start {
        /// Its name, a DNS subdomain (lowercase letters, digits, '-', '.').
        name: String,
        /// Its unique ID (for Velero, the Backup's or Restore's metadata.uid): the same
        /// name with another uid is refused.
        #[arg(long)]
        uid: String,
        /// Go duration, e.g. 4h0m0s [default: the agent's].
        #[arg(long, allow_hyphen_values = true)]
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
        #[arg(long, allow_hyphen_values = true)]
        stall_timeout: Option<GoDuration>,
        /// Cancel and fail an operation still New this long after it was created (Go
        /// duration; 0s: never) [default: its snapshotter's].
        #[arg(long, allow_hyphen_values = true)]
        start_timeout: Option<GoDuration>,
    },
    /// Registers operations a plugin returned: one from flags, or many from a JSON file.
    AddOperation(AddOperation),
    /// Ends InProgress: polls every operation once and moves to the next phase.
    EndInProgress {
        /// The backup's or restore's name.
        name: String,
        /// Errors the backup server met on the items: any makes it PartiallyFailed.
        #[arg(long, default_value_t = 0)]
        errors: u32,
        /// Warnings the backup server met on the items.
        #[arg(long, default_value_t = 0)]
        warnings: u32,
        /// The backup or restore failed: go to Failed and cancel unfinished operations.
        #[arg(long)]
        failed: bool,
    },
    /// One owner.
    Get(Owner),
    /// Every owner that had the name: the current one, then the retired ones (a new
    /// uid took the name once they had ended), latest retired first.
    History {
        /// The backup's or restore's name.
        name: String,
    },
    /// Owners, by name, a page at a time.
    List {
        /// Only these phases (repeatable).
        #[arg(long = "phase")]
        phases: Vec<OwnerPhase>,
        /// At most this many (default 100, at most 1000).
        #[arg(long)]
        limit: Option<u32>,
        /// Start after this name (the previous page's last).
        #[arg(long)]
        after: Option<String>,
    },
    /// The owner's operations.
    Operations {
        #[command(flatten)]
        owner: Owner,
        /// Only operations in these phases (repeatable).
        #[arg(long = "phase")]
        phases: Vec<OperationPhase>,
    },
    /// The owner, readable, ending with its recent events; with --details, each
    /// operation and every event kept.
    Describe {
        #[command(flatten)]
        owner: Owner,
        /// Each operation in full, and every event kept.
        #[arg(long)]
        details: bool,
    },
    /// The owner's history (phase changes, failures, calls and their callers), oldest
    /// first, a page at a time.
    Events {
        #[command(flatten)]
        owner: Owner,
        /// Start after this event (the previous page's last SEQ).
        #[arg(long)]
        after: Option<u64>,
        /// At most this many events (default 100, at most 1000).
        #[arg(long)]
        limit: Option<u32>,
    },
    /// Waits, showing progress, until ready to finalize (or terminal).
    Wait {
        /// The backup's or restore's name.
        name: String,
        /// What to wait for.
        #[arg(long, value_enum, default_value_t = Until::ReadyToFinalize)]
        until: Until,
        /// Give up after this long (Go duration) with exit code 3 [default: never].
        #[arg(long, allow_hyphen_values = true)]
        timeout: Option<GoDuration>,
    },
    /// Finalizes: rewrites the backup tarball (with --contents-input/--contents-output)
    /// and completes.
    Finalize {
        /// The backup's or restore's name.
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
    ItemOperations(Owner),
    /// Removes it, cancelling unfinished operations.
    Delete(Owner),
    /// Cancels it (it ends Failed), or with --operation only those operations (they
    /// end Canceled). Allowed while InProgress or WaitingForPluginOperations*.
    Cancel {
        /// The backup's or restore's name.
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

/// One owner: the name's current one, or with --uid the one of that uid.
#[derive(Args, Debug)]
pub struct Owner {
    /// The backup's or restore's name.
    pub name: String,
    /// The owner of this uid, current or retired (see `history`), rather than the
    /// name's current owner.
    #[arg(long)]
    pub uid: Option<String>,
}

impl From<Owner> for opmon_client::OwnerParams {
    fn from(Owner { name, uid }: Owner) -> Self {
        opmon_client::OwnerParams { name, uid }
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Until {
    /// Finalizing, or a phase that ends it (Completed, PartiallyFailed, Failed).
    ReadyToFinalize,
    /// Completed, PartiallyFailed or Failed.
    Terminal,
}

#[derive(Args, Debug)]
pub struct AddOperation {
    /// The backup's or restore's name.
    pub name: String,
    /// A JSON file with an array of operations as the API takes them, or - for stdin.
    #[arg(long, conflicts_with_all = ["plugin", "item", "operation_id"])]
    pub file: Option<PathBuf>,
    /// Plugin name, domain/name.
    #[arg(long, required_unless_present = "file", add = ArgValueCompleter::new(complete::snapshotters))]
    pub plugin: Option<String>,
    /// Plugin kind [default: BackupItemAction for backups, RestoreItemAction for restores].
    #[arg(long)]
    pub plugin_kind: Option<PluginKind>,
    /// The item, RESOURCE[.GROUP]/NAMESPACE/NAME or RESOURCE[.GROUP]/NAME (cluster-scoped).
    #[arg(long, required_unless_present = "file")]
    pub item: Option<String>,
    /// The operation ID the plugin returned.
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
        /// The backup server, as `start --server` names it.
        name: String,
        /// The instance of it now running (e.g. its pod's uid).
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
        /// v2: it answers Progress and Cancel; v1: it has no Progress, and its
        /// operations complete at their first poll.
        #[arg(long, default_value = "v2")]
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
        #[arg(long, allow_hyphen_values = true)]
        stall_timeout: Option<GoDuration>,
        /// Cancel and fail an operation still New this long after it was created
        /// [default: never].
        #[arg(long, allow_hyphen_values = true)]
        start_timeout: Option<GoDuration>,
        /// Transient errors retried per operation [default: 5].
        #[arg(long)]
        retry_attempts: Option<u32>,
        /// Delay before the first retry, doubled each time up to 5m [default: 1s].
        #[arg(long, allow_hyphen_values = true)]
        retry_backoff: Option<GoDuration>,
        /// How long an operation may fail transiently before it fails [default: 10m].
        #[arg(long, allow_hyphen_values = true)]
        retry_within: Option<GoDuration>,
    },
    /// All snapshotters.
    List,
    /// Removes one.
    Unregister {
        /// The plugin name it serves.
        #[arg(add = ArgValueCompleter::new(complete::snapshotters))]
        name: String,
    },
}

/// How the agent's complaints about a field read on this command line: the API names
/// its fields (`itemOperationTimeout: …`, `operations[0].operationId: …`), the user
/// typed flags (`--item-operation-timeout`, `--operation-id`).
pub struct Fields {
    /// The flag whose JSON file holds the operations or updated items, whose paths are
    /// the file's own.
    file: Option<&'static str>,
    /// `cancel`, whose `operations` are its `--operation` flags.
    cancel: bool,
}

/// Params that are a flag of the same name in kebab case.
const SAME_AS_FLAG: &[&str] = &[
    "uid",
    "itemOperationTimeout",
    "stallTimeout",
    "startTimeout",
    "retryAttempts",
    "retryBackoff",
    "retryWithin",
    "apiVersion",
    "reason",
    "limit",
    "after",
    "object",
    "errors",
    "warnings",
    "finalize",
];

impl Fields {
    pub fn of(command: &Command) -> Fields {
        let owner = match command {
            Command::Backup(c) | Command::Restore(c) => Some(c),
            _ => None,
        };
        let file = match owner {
            Some(OwnerCommand::AddOperation(a)) if a.file.is_some() => Some("--file"),
            Some(OwnerCommand::Finalize { .. }) => Some("--updated-items"),
            _ => None,
        };
        let cancel = matches!(owner, Some(OwnerCommand::Cancel { .. }));
        Fields { file, cancel }
    }

    /// `message` with a leading field path (`path: what is wrong`) named as the flag.
    pub fn name_flags(&self, message: &str) -> String {
        match message.split_once(": ") {
            Some((path, rest)) => match self.flag(path) {
                Some(flag) => format!("{flag}: {rest}"),
                None => message.to_string(),
            },
            None => message.to_string(),
        }
    }

    fn flag(&self, path: &str) -> Option<String> {
        let exact = match path {
            "name" => "NAME",
            "server.name" => "--server",
            "server.instance" => "--instance",
            "socket" => "--snapshotter-socket",
            "veleroPlugin" => "--velero-plugin",
            "args" => "the arguments (after --)",
            "env" => "--env",
            "command" => "the command (after --)",
            "contents.input" => "--contents-input",
            "contents.output" => "--contents-output",
            _ => "",
        };
        if !exact.is_empty() {
            return Some(exact.to_string());
        }
        let head = path.split(['.', '[']).next().unwrap_or(path);
        match head {
            "operations" if self.cancel => Some("--operation".into()),
            "operations" | "updatedItems" => match self.file {
                Some(flag) => Some(format!("{flag}: {path}")),
                None => {
                    let field = path.split_once("].").map_or("", |(_, f)| f);
                    let flag = match field.split(['.', '[']).next().unwrap_or("") {
                        "plugin" if field == "plugin.kind" => "--plugin-kind",
                        "plugin" => "--plugin",
                        "resource" => "--item",
                        "operationId" => "--operation-id",
                        "postOperationItems" => "--post-item",
                        "created" => "--created",
                        _ => return None,
                    };
                    Some(flag.into())
                }
            },
            "phases" => Some("--phase".into()),
            _ if path == head && SAME_AS_FLAG.contains(&head) => {
                let mut flag = String::from("--");
                for c in head.chars() {
                    if c.is_ascii_uppercase() {
                        flag.push('-');
                    }
                    flag.push(c.to_ascii_lowercase());
                }
                Some(flag)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every subcommand, with its path from `opmon`.
    fn all(cmd: &clap::Command, path: String, out: &mut Vec<(String, clap::Command)>) {
        for sub in cmd.get_subcommands() {
            let path = format!("{path} {}", sub.get_name());
            out.push((path.clone(), sub.clone()));
            all(sub, path, out);
        }
    }

    #[test]
    fn every_argument_flag_and_command_explains_itself() {
        let mut cmd = command();
        cmd.build();
        let mut commands = vec![("opmon".to_string(), cmd.clone())];
        all(&cmd, "opmon".into(), &mut commands);
        let mut silent = Vec::new();
        for (path, sub) in &commands {
            if sub.get_about().is_none() && path != "opmon" {
                silent.push(path.clone());
            }
            for arg in sub.get_arguments() {
                let id = arg.get_id().as_str();
                if ["help", "version"].contains(&id) || arg.is_hide_set() {
                    continue;
                }
                if arg.get_help().is_none() {
                    silent.push(format!("{path}: {id}"));
                }
                // Shell names (clap_complete's) say what they are.
                let values = if id == "shell" {
                    Vec::new()
                } else {
                    arg.get_possible_values()
                };
                for value in values {
                    if value.get_help().is_none() && !value.is_hide_set() {
                        silent.push(format!("{path}: {id} = {}", value.get_name()));
                    }
                }
            }
        }
        assert!(silent.is_empty(), "no help for: {silent:#?}");
    }

    #[test]
    fn the_agents_field_names_become_the_flags_typed() {
        let parse = |argv: &[&str]| {
            let cli = Cli::from_arg_matches(&command().get_matches_from(argv)).unwrap();
            Fields::of(&cli.command)
        };
        let start = parse(&["opmon", "backup", "start", "b", "--uid", "u"]);
        assert_eq!(
            start.name_flags("itemOperationTimeout: must be positive"),
            "--item-operation-timeout: must be positive"
        );
        assert_eq!(start.name_flags("name: too long"), "NAME: too long");
        assert_eq!(
            start.name_flags("server.instance: empty"),
            "--instance: empty"
        );
        assert_eq!(
            start.name_flags("backup b not found (code 1001)"),
            "backup b not found (code 1001)"
        );
        let add = parse(&[
            "opmon",
            "backup",
            "add-operation",
            "b",
            "--plugin",
            "a/b",
            "--item",
            "pods/x",
            "--operation-id",
            "1",
        ]);
        assert_eq!(
            add.name_flags("operations[0].resource.name: must not contain '/'"),
            "--item: must not contain '/'"
        );
        assert_eq!(
            add.name_flags("operations[0].plugin.name: bad"),
            "--plugin: bad"
        );
        let file = parse(&[
            "opmon",
            "backup",
            "add-operation",
            "b",
            "--file",
            "ops.json",
        ]);
        assert_eq!(
            file.name_flags("operations[3].operationId: empty"),
            "--file: operations[3].operationId: empty"
        );
        let register = parse(&["opmon", "snapshotter", "register", "a/b"]);
        assert_eq!(
            register.name_flags("socket: must be absolute"),
            "--snapshotter-socket: must be absolute"
        );
        let cancel = parse(&["opmon", "backup", "cancel", "b", "--operation", "x"]);
        assert_eq!(
            cancel.name_flags("operations[0]: no such operation"),
            "--operation: no such operation"
        );
    }

    #[test]
    fn only_a_restore_offers_finalize() {
        let cmd = command();
        let start = |kind: &str| {
            cmd.find_subcommand(kind)
                .and_then(|c| c.find_subcommand("start"))
                .and_then(|c| c.get_arguments().find(|a| a.get_id() == "finalize"))
                .map(|a| a.is_hide_set())
        };
        assert_eq!(start("backup"), Some(true));
        assert_eq!(start("restore"), Some(false));
    }
}
