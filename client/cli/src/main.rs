//! `opmon`: the command line for people and shell-based backup servers. Every API
//! method is a subcommand, sent as the client library's typed params; reads print a
//! table or, with `-o json`, exactly the API's result. Exit codes: 0 success,
//! 1 PartiallyFailed, 2 Failed or error, 3 wait timed out.
//!
//! What the CLI shows a person is escaped (`opmon_client::text`): descriptions, errors
//! and IDs come from snapshotters and must not drive the terminal. Paths the user typed
//! are resolved against the CLI's working directory before they are sent, since the
//! agent has a working directory of its own.

mod args;
mod out;
mod render;
mod watch;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use opmon_client::methods::{self, Method};
use opmon_client::text::escape_controls;
use opmon_client::{
    AddOperationsParams, ApiVersion, CancelParams, CancelResult, Client, Contents,
    EndInProgressParams, EventList, EventsParams, FinalizeParams, FinalizeResult, ListParams,
    NameParams, NewOperation, NoParams, OperationSelector, OperationsParams, Owner, OwnerKind,
    OwnerParams, PluginKind, PluginRef, ServerRef, ServerStartedParams, ServerStartedResult,
    Snapshotter, StartParams, UpdatedItem, WaitUntil,
};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use args::{Cli, Command, Output, OwnerCommand, ServerCommand, SnapshotterCommand, Until};

/// The largest `events` page, which is also how many events an owner keeps: `describe`
/// reads them all in one call.
const EVENTS_PAGE: u32 = 1000;
/// Events `describe` shows without `--details`: the most recent, as `kubectl describe`.
const DESCRIBE_EVENTS: usize = 20;

/// A command's outcome: the exit code, or the message of why it failed.
type Outcome = Result<u8, String>;

fn main() -> ExitCode {
    // `COMPLETE=<shell> opmon -- <words>`: the shell asking for completions (see
    // `opmon completions`); answered and exited here.
    clap_complete::CompleteEnv::with_factory(args::completing).complete();
    let cli = args::parse();
    let fields = args::Fields::of(&cli.command);
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            out::warn(&format!("opmon: starting the runtime: {e}"));
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            let e = fields.name_flags(&e);
            out::warn(&format!("opmon: {}", escape_controls(&e)));
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> Outcome {
    if let Command::Completions { shell } = cli.command {
        // The script calls `COMPLETE=<shell> opmon -- …` at each tab, so names complete
        // from the running agent; see `main`.
        let name = shell.to_string();
        let shells = clap_complete::env::Shells::builtins();
        let completer = shells
            .completer(&name)
            .ok_or_else(|| format!("no completion for {name}"))?;
        let mut script = Vec::new();
        completer
            .write_registration("COMPLETE", "opmon", "opmon", "opmon", &mut script)
            .map_err(|e| e.to_string())?;
        out::emit(&String::from_utf8_lossy(&script))?;
        return Ok(0);
    }
    // `args::parse` has filled it in from the variable or the default.
    let socket = cli.socket.clone().unwrap_or_default();
    let client = cli
        .agent_uid
        .iter()
        .fold(Client::builder(&socket), |b, &uid| b.agent_uid(uid))
        .connect()
        .await
        .map_err(|e| unreachable_agent(&socket, &e))?;
    let out = cli.output;
    match cli.command {
        Command::Status => {
            let value: Value = call_agent::<methods::Status>(&client, NoParams {}).await?;
            print(out, &value, render::status)
        }
        Command::Backup(cmd) => owner_command(&client, out, OwnerKind::Backup, cmd).await,
        Command::Restore(cmd) => owner_command(&client, out, OwnerKind::Restore, cmd).await,
        Command::Snapshotter(cmd) => snapshotter_command(&client, out, cmd).await,
        Command::Server(ServerCommand::Started { name, instance }) => {
            let params = ServerStartedParams {
                name: name.clone(),
                instance: instance.clone(),
            };
            let value = call_agent::<methods::ServerStarted>(&client, params).await?;
            print(out, &value, |r: &ServerStartedResult| {
                render::server_started(&name, &instance, r)
            })
        }
        Command::Completions { .. } => Ok(0),
    }
}

/// The error of a first connection, with what a person can do about its usual causes.
fn unreachable_agent(socket: &Path, error: &opmon_client::Error) -> String {
    use std::io::ErrorKind;
    use std::os::unix::fs::FileTypeExt;
    let opmon_client::Error::Connect { source, .. } = error else {
        return error.chain();
    };
    // The client's own check of who serves the socket, not the socket's permissions:
    // root may open any socket, and is told which uid to trust instead.
    if let Some(refused) = source
        .get_ref()
        .and_then(|e| e.downcast_ref::<opmon_client::UntrustedAgent>())
    {
        let uid = refused.peer;
        return format!(
            "{}. If uid {uid} runs the agent you mean, trust it with --agent-uid {uid} or \
             OPMON_AGENT_UID={uid}.",
            error.chain()
        );
    }
    let hint = match source.kind() {
        ErrorKind::NotFound => {
            "Is the agent running? Start opmon-agent, or give its socket with --socket or OPMON_SOCKET"
        }
        ErrorKind::PermissionDenied => {
            "This user may not open the socket or its directory: the agent's socket_mode and \
             socket_group say who may (docs/operations.md, \"Access and trust\")"
        }
        ErrorKind::ConnectionRefused
            if std::fs::metadata(socket).is_ok_and(|m| !m.file_type().is_socket()) =>
        {
            "It is not a socket: --socket and OPMON_SOCKET name the agent's socket file"
        }
        ErrorKind::ConnectionRefused => "Nothing listens on it: the agent has stopped",
        _ => return error.chain(),
    };
    format!("{}. {hint}.", error.chain())
}

/// Calls the declared method `M`, named for owners of `kind`, with its typed `params`;
/// the answer is kept as JSON so `-o json` prints exactly what the agent said.
async fn call<M: Method>(
    client: &Client,
    kind: OwnerKind,
    params: M::Params,
) -> Result<Value, String> {
    client
        .call(M::DECL.name(kind), params)
        .await
        .map_err(|e| e.chain())
}

/// [`call`] for an agent-wide method.
async fn call_agent<M: Method>(client: &Client, params: M::Params) -> Result<Value, String> {
    call::<M>(client, OwnerKind::Backup, params).await
}

/// Prints `value` as JSON, or as `table` renders its typed form.
fn print<T: DeserializeOwned>(out: Output, value: &Value, table: impl Fn(&T) -> String) -> Outcome {
    match out {
        Output::Json => out::emit(&format!("{}\n", pretty(value)?))?,
        Output::Table => out::emit(&table(&typed::<T>(value)?))?,
    }
    Ok(0)
}

fn pretty(value: &Value) -> Result<String, String> {
    serde_json::to_string_pretty(value).map_err(|e| e.to_string())
}

fn typed<T: DeserializeOwned>(value: &Value) -> Result<T, String> {
    T::deserialize(value).map_err(|e| format!("the agent answered in an unexpected form: {e}"))
}

fn read_json_file<T: DeserializeOwned>(flag: &str, path: &Path) -> Result<T, String> {
    let mut text = String::new();
    let stdin = path == Path::new("-");
    if stdin {
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| format!("reading standard input: {e}"))?;
    } else {
        text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
    }
    serde_json::from_str(&text).map_err(|e| {
        if stdin {
            format!("{flag} -: standard input: {e}")
        } else {
            format!("{flag} {}: {e}", path.display())
        }
    })
}

/// `path` as the user meant it: relative paths are relative to where the CLI runs,
/// not to the agent's working directory. (`..` is kept; the agent resolves it.)
fn absolute(flag: &str, path: PathBuf) -> Result<PathBuf, String> {
    std::path::absolute(&path).map_err(|e| format!("{flag} {}: {e}", path.display()))
}

fn one_line(owner: &Owner) -> String {
    format!(
        "{} {} is {}\n",
        owner.kind,
        escape_controls(&owner.name),
        owner.phase
    )
}

async fn owner_command(
    client: &Client,
    out: Output,
    kind: OwnerKind,
    cmd: OwnerCommand,
) -> Outcome {
    match cmd {
        OwnerCommand::Start {
            name,
            uid,
            item_operation_timeout,
            finalize,
            object,
            server,
            instance,
            stall_timeout,
            start_timeout,
        } => {
            if finalize && kind == OwnerKind::Backup {
                return Err("--finalize is for restores; backups always finalize".into());
            }
            let object = object
                .map(|path| read_json_file("--object", &path))
                .transpose()?;
            let server = server
                .zip(instance)
                .map(|(name, instance)| ServerRef { name, instance });
            let params = StartParams {
                name,
                uid,
                item_operation_timeout,
                finalize: finalize.then_some(true),
                object,
                server,
                stall_timeout,
                start_timeout,
            };
            let value = call::<methods::Start>(client, kind, params).await?;
            print(out, &value, one_line)
        }
        OwnerCommand::AddOperation(a) => {
            let operations: Vec<NewOperation> = match &a.file {
                Some(path) => read_json_file("--file", path)?,
                None => {
                    let default_kind = match kind {
                        OwnerKind::Backup => PluginKind::BackupItemAction,
                        OwnerKind::Restore => PluginKind::RestoreItemAction,
                    };
                    let post_operation_items = a
                        .post_items
                        .iter()
                        .map(|i| render::parse_item(i))
                        .collect::<Result<_, _>>()?;
                    vec![NewOperation {
                        plugin: PluginRef {
                            kind: a.plugin_kind.unwrap_or(default_kind),
                            name: a.plugin.clone().unwrap_or_default(),
                        },
                        resource: render::parse_item(a.item.as_deref().unwrap_or_default())?,
                        operation_id: a.operation_id.clone().unwrap_or_default(),
                        post_operation_items,
                        created: a.created,
                    }]
                }
            };
            let plugins: std::collections::BTreeSet<String> = operations
                .iter()
                .map(|o| {
                    // As the agent keeps it: a legacy name is `velero.io/<name>`.
                    let mut name = o.plugin.name.clone();
                    opmon_client::validate::legacy_plugin_name(&mut name);
                    name
                })
                .collect();
            let params = AddOperationsParams {
                name: a.name,
                operations,
            };
            let value = call::<methods::AddOperations>(client, kind, params).await?;
            print(out, &value, |r: &opmon_client::AddOperationsResult| {
                format!("{} added, {} already known\n", r.added, r.already_known)
            })?;
            warn_unowned(client, kind, &plugins).await;
            Ok(0)
        }
        OwnerCommand::EndInProgress {
            name,
            errors,
            warnings,
            failed,
        } => {
            let params = EndInProgressParams {
                name,
                errors,
                warnings,
                failed,
            };
            let value = call::<methods::EndInProgress>(client, kind, params).await?;
            print(out, &value, one_line)?;
            let owner: Owner = typed(&value)?;
            Ok(render::exit_code(owner.phase))
        }
        OwnerCommand::Get(owner) => {
            let value = call::<methods::Get>(client, kind, owner.into()).await?;
            print(out, &value, |o: &Owner| {
                render::owners(std::slice::from_ref(o), time::OffsetDateTime::now_utc())
            })?;
            let owner: Owner = typed(&value)?;
            Ok(render::exit_code(owner.phase))
        }
        OwnerCommand::History { name } => {
            let value = call::<methods::History>(client, kind, NameParams { name }).await?;
            print(out, &value, |owners: &Vec<Owner>| {
                render::history(owners, time::OffsetDateTime::now_utc())
            })
        }
        OwnerCommand::List {
            phases,
            limit,
            after,
        } => {
            let params = ListParams {
                phases: (!phases.is_empty()).then_some(phases),
                limit,
                after,
            };
            let value = call::<methods::List>(client, kind, params).await?;
            print(out, &value, |l: &opmon_client::OwnerList| {
                let mut text = render::owners(&l.items, time::OffsetDateTime::now_utc());
                if let Some(next) = &l.next {
                    text.push_str(&format!("(more: --after {})\n", escape_controls(next)));
                }
                text
            })
        }
        OwnerCommand::Operations { owner, phases } => {
            let params = OperationsParams {
                name: owner.name,
                uid: owner.uid,
                phases: (!phases.is_empty()).then_some(phases),
            };
            let value = call::<methods::Operations>(client, kind, params).await?;
            print(out, &value, |ops: &Vec<opmon_client::Operation>| {
                render::operations(ops)
            })
        }
        OwnerCommand::Describe { owner, details } => {
            let args::Owner { name, uid } = owner;
            let params = OwnerParams {
                name: name.clone(),
                uid: uid.clone(),
            };
            let owner = call::<methods::Get>(client, kind, params).await?;
            let ops = if details {
                let params = OperationsParams {
                    name: name.clone(),
                    uid: uid.clone(),
                    phases: None,
                };
                Some(call::<methods::Operations>(client, kind, params).await?)
            } else {
                None
            };
            // An owner keeps at most as many events as one page holds: one call reads
            // them all.
            let params = EventsParams {
                name,
                uid,
                after: None,
                limit: Some(EVENTS_PAGE),
            };
            let events: EventList = typed(&call::<methods::Events>(client, kind, params).await?)?;
            // The recent ones, as kubectl shows them; --details shows every one kept.
            let shown = if details {
                events.items.len()
            } else {
                DESCRIBE_EVENTS
            };
            let omitted = events.items.len().saturating_sub(shown);
            let recent = &events.items[omitted..];
            match out {
                Output::Json => {
                    let mut value = json!({"owner": owner, "events": recent});
                    if let Some(ops) = ops {
                        value["operations"] = ops;
                    }
                    out::emit(&format!("{}\n", pretty(&value)?))?;
                }
                Output::Table => {
                    let owner: Owner = typed(&owner)?;
                    let ops: Option<Vec<opmon_client::Operation>> =
                        ops.as_ref().map(typed).transpose()?;
                    let now = time::OffsetDateTime::now_utc();
                    let mut text = render::describe(&owner, ops.as_deref(), now);
                    text.push_str(&render::events(recent, omitted, now));
                    out::emit(&text)?;
                }
            }
            Ok(render::exit_code(typed::<Owner>(&owner)?.phase))
        }
        OwnerCommand::Events {
            owner,
            after,
            limit,
        } => {
            let params = EventsParams {
                name: owner.name,
                uid: owner.uid,
                after,
                limit,
            };
            let value = call::<methods::Events>(client, kind, params).await?;
            print(out, &value, |l: &EventList| {
                let mut text = render::event_list(&l.items);
                if let Some(next) = l.next {
                    text.push_str(&format!("(more: --after {next})\n"));
                }
                text
            })
        }
        OwnerCommand::Wait {
            name,
            until,
            timeout,
        } => {
            let until = match until {
                Until::ReadyToFinalize => WaitUntil::ReadyToFinalize,
                Until::Terminal => WaitUntil::Terminal,
            };
            let quiet = out == Output::Json;
            let reached =
                watch::wait(client, kind, &name, until, timeout.map(|t| t.0), quiet).await?;
            let (owner, timed_out) = match reached {
                Some(owner) => (owner, false),
                None => {
                    let value =
                        call::<methods::Get>(client, kind, OwnerParams::current(&name)).await?;
                    (typed(&value)?, true)
                }
            };
            match out {
                Output::Json => out::emit(&format!(
                    "{}\n",
                    pretty(&json!({"owner": owner, "timedOut": timed_out}))?
                ))?,
                Output::Table if timed_out => {
                    out::emit(&one_line(&owner))?;
                    out::warn(&format!(
                        "opmon: timed out waiting for {kind} {}",
                        escape_controls(&name)
                    ));
                }
                Output::Table => out::emit(&one_line(&owner))?,
            }
            Ok(if timed_out {
                3
            } else {
                render::exit_code(owner.phase)
            })
        }
        OwnerCommand::Finalize {
            name,
            contents_input,
            contents_output,
            updated_items,
        } => {
            let contents = match (contents_input, contents_output) {
                (Some(input), Some(output)) => Some(Contents {
                    input: absolute("--contents-input", input)?,
                    output: absolute("--contents-output", output)?,
                }),
                _ => None,
            };
            let updated_items: Vec<UpdatedItem> = match updated_items {
                Some(path) => read_json_file("--updated-items", &path)?,
                None => Vec::new(),
            };
            let params = FinalizeParams {
                name,
                contents,
                updated_items,
                ..Default::default()
            };
            // Through the typed call: it has the finalize timeout, not the call one.
            let result = client
                .owners(kind)
                .request::<methods::Finalize>(params)
                .await
                .map_err(|e| e.chain())?;
            let value = serde_json::to_value(&result).map_err(|e| e.to_string())?;
            print(out, &value, |r: &FinalizeResult| {
                let mut text = one_line(&r.owner);
                text.push_str(&format!(
                    "item operations: {}\n",
                    escape_controls(&r.item_operations_file.display().to_string())
                ));
                if let Some(file) = &r.contents_file {
                    text.push_str(&format!(
                        "contents: {} ({} entries replaced, {} added)\n",
                        escape_controls(&file.display().to_string()),
                        r.replaced,
                        r.added
                    ));
                }
                text
            })?;
            Ok(render::exit_code(result.owner.phase))
        }
        OwnerCommand::ItemOperations(owner) => {
            let value = call::<methods::ItemOperations>(client, kind, owner.into()).await?;
            print(out, &value, |r: &Vec<opmon_client::ItemOperation>| {
                render::item_operations(r)
            })
        }
        OwnerCommand::Cancel {
            name,
            operations,
            reason,
        } => {
            let params = CancelParams {
                name: name.clone(),
                operations: (!operations.is_empty())
                    .then(|| operations.into_iter().map(OperationSelector::Id).collect()),
                reason,
            };
            let value = call::<methods::Cancel>(client, kind, params).await?;
            print(out, &value, |r: &CancelResult| {
                let mut text = format!(
                    "{kind} {}: {} canceled",
                    escape_controls(&name),
                    render::counted(r.canceled, "operation")
                );
                if r.unconfirmed > 0 {
                    text.push_str(&format!(
                        " ({} not confirmed by their snapshotter within the call deadline)",
                        r.unconfirmed
                    ));
                }
                text.push('\n');
                text.push_str(&one_line(&r.owner));
                text
            })?;
            Ok(render::exit_code(
                typed::<CancelResult>(&value)?.owner.phase,
            ))
        }
        OwnerCommand::Delete(owner) => {
            let name = owner.name.clone();
            let value = call::<methods::Delete>(client, kind, owner.into()).await?;
            print(out, &value, |r: &opmon_client::DeleteResult| {
                format!(
                    "{kind} {} deleted, {} canceled\n",
                    escape_controls(&name),
                    render::counted(r.count(), "operation")
                )
            })
        }
    }
}

/// Says which of `plugins` no snapshotter owns: their operations would only fail later,
/// when the owner leaves InProgress ("no snapshotter is registered for plugin …"). A
/// warning, not an error: the snapshotter may be registered before then.
async fn warn_unowned(
    client: &Client,
    kind: OwnerKind,
    plugins: &std::collections::BTreeSet<String>,
) {
    let Ok(value) = call_agent::<methods::ListSnapshotters>(client, NoParams {}).await else {
        return;
    };
    let Ok(registered) = typed::<Vec<Snapshotter>>(&value) else {
        return;
    };
    for plugin in plugins {
        if !registered.iter().any(|s| &s.name == plugin) {
            out::warn(&format!(
                "opmon: warning: no snapshotter is registered for plugin {}: its operations \
                 fail when the {kind} leaves InProgress unless one is registered by then \
                 (opmon snapshotter register {})",
                escape_controls(plugin),
                escape_controls(plugin)
            ));
        }
    }
}

async fn snapshotter_command(client: &Client, out: Output, cmd: SnapshotterCommand) -> Outcome {
    match cmd {
        SnapshotterCommand::Register {
            name,
            api_version,
            snapshotter_socket,
            velero_plugin,
            env,
            mut command,
            stall_timeout,
            start_timeout,
            retry_attempts,
            retry_backoff,
            retry_within,
        } => {
            if api_version == ApiVersion::V2
                && snapshotter_socket.is_none()
                && velero_plugin.is_none()
                && command.is_empty()
            {
                return Err(
                    "a v2 snapshotter needs --snapshotter-socket PATH, --velero-plugin \
                            PATH or a command after --"
                        .into(),
                );
            }
            // With a Velero plugin, the words after -- are the binary's arguments.
            let args = match velero_plugin {
                Some(_) => Some(std::mem::take(&mut command)),
                None => None,
            };
            let env = if env.is_empty() {
                None
            } else {
                let mut vars = std::collections::BTreeMap::new();
                for pair in env {
                    let Some((key, value)) = pair.split_once('=') else {
                        return Err(format!("--env {pair:?}: expected KEY=VALUE"));
                    };
                    vars.insert(key.to_string(), value.to_string());
                }
                Some(vars)
            };
            // A program named by a path runs from the agent's directory: resolve it
            // here. A bare name is looked up in the agent's PATH, as given.
            if let Some(program) = command.first_mut() {
                if program.contains('/') {
                    *program = absolute("the command", PathBuf::from(&*program))?
                        .to_string_lossy()
                        .into_owned();
                }
            }
            let s = Snapshotter {
                name,
                api_version,
                socket: snapshotter_socket
                    .map(|s| absolute("--snapshotter-socket", s))
                    .transpose()?,
                command: (!command.is_empty()).then_some(command),
                velero_plugin: velero_plugin
                    .map(|p| absolute("--velero-plugin", p))
                    .transpose()?,
                args,
                env,
                stall_timeout,
                start_timeout,
                retry_attempts,
                retry_backoff,
                retry_within,
            };
            let value = call_agent::<methods::RegisterSnapshotter>(client, s).await?;
            print(out, &value, |s: &Snapshotter| {
                format!("snapshotter {} registered\n", escape_controls(&s.name))
            })
        }
        SnapshotterCommand::List => {
            let value = call_agent::<methods::ListSnapshotters>(client, NoParams {}).await?;
            print(out, &value, |l: &Vec<Snapshotter>| render::snapshotters(l))
        }
        SnapshotterCommand::Unregister { name } => {
            let value =
                call_agent::<methods::UnregisterSnapshotter>(client, NameParams { name }).await?;
            print(out, &value, |s: &Snapshotter| {
                format!("snapshotter {} unregistered\n", escape_controls(&s.name))
            })
        }
    }
}
