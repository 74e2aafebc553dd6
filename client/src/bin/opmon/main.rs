//! `opmon`: the command line for people and shell-based backup servers. Every API
//! method is a subcommand; reads print a table or, with `-o json`, exactly the API's
//! result. Exit codes: 0 success, 1 PartiallyFailed, 2 Failed or error, 3 wait timed out.

mod args;
mod render;
mod watch;

use std::io::Read;
use std::path::Path;
use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use opmon_client::{
    Client, Contents, FinalizeParams, FinalizeResult, ListParams, NameParams, NewOperation, Owner,
    OwnerKind, PluginKind, PluginRef, Snapshotter, StartParams, UpdatedItem, WaitUntil,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};

use args::{Cli, Command, Output, OwnerCommand, SnapshotterCommand, Until};

/// A command's outcome: what to print and the exit code.
type Outcome = Result<u8, String>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("opmon: starting the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("opmon: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> Outcome {
    if let Command::Completions { shell } = cli.command {
        clap_complete::generate(shell, &mut Cli::command(), "opmon", &mut std::io::stdout());
        return Ok(0);
    }
    let socket = cli
        .socket
        .clone()
        .unwrap_or_else(opmon_client::default_socket_path);
    let client = Client::connect(&socket).await.map_err(|e| e.to_string())?;
    let out = cli.output;
    match cli.command {
        Command::Status => {
            let value: Value = call(&client, "agent.status", json!({})).await?;
            print(out, &value, render::status)
        }
        Command::Backup(cmd) => owner_command(&client, out, OwnerKind::Backup, cmd).await,
        Command::Restore(cmd) => owner_command(&client, out, OwnerKind::Restore, cmd).await,
        Command::Snapshotter(cmd) => snapshotter_command(&client, out, cmd).await,
        Command::Completions { .. } => Ok(0),
    }
}

async fn call<P: Serialize + Send>(
    client: &Client,
    method: &str,
    params: P,
) -> Result<Value, String> {
    client.call(method, params).await.map_err(|e| e.to_string())
}

/// Prints `value` as JSON, or as `table` renders its typed form.
fn print<T: DeserializeOwned>(out: Output, value: &Value, table: impl Fn(&T) -> String) -> Outcome {
    match out {
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(value).map_err(|e| e.to_string())?
        ),
        Output::Table => {
            let typed: T = serde_json::from_value(value.clone())
                .map_err(|e| format!("the agent answered in an unexpected form: {e}"))?;
            print!("{}", table(&typed));
        }
    }
    Ok(0)
}

fn read_json_file<T: DeserializeOwned>(path: &Path) -> Result<T, String> {
    let mut text = String::new();
    if path == Path::new("-") {
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| format!("reading standard input: {e}"))?;
    } else {
        text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
    }
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn one_line(owner: &Owner) -> String {
    format!("{} {} is {}\n", owner.kind, owner.name, owner.phase)
}

async fn owner_command(
    client: &Client,
    out: Output,
    kind: OwnerKind,
    cmd: OwnerCommand,
) -> Outcome {
    let method = |verb: &str| format!("{kind}.{verb}");
    match cmd {
        OwnerCommand::Start {
            name,
            uid,
            item_operation_timeout,
            finalize,
        } => {
            if finalize && kind == OwnerKind::Backup {
                return Err("--finalize is for restores; backups always finalize".into());
            }
            let params = StartParams {
                name,
                uid,
                item_operation_timeout,
                finalize: finalize.then_some(true),
                ..StartParams::default()
            };
            let value = call(client, &method("start"), params).await?;
            print(out, &value, one_line)
        }
        OwnerCommand::AddOperation(a) => {
            let operations: Vec<NewOperation> = match &a.file {
                Some(path) => read_json_file(path)?,
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
                        created: None,
                    }]
                }
            };
            let value = call(
                client,
                &method("addOperations"),
                json!({"name": a.name, "operations": operations}),
            )
            .await?;
            print(out, &value, |r: &opmon_client::AddOperationsResult| {
                format!("{} added, {} already known\n", r.added, r.already_known)
            })
        }
        OwnerCommand::EndInProgress {
            name,
            errors,
            warnings,
            failed,
        } => {
            let value = call(
                client,
                &method("endInProgress"),
                json!({"name": name, "errors": errors, "warnings": warnings, "failed": failed}),
            )
            .await?;
            print(out, &value, one_line)?;
            let owner: Owner = serde_json::from_value(value).map_err(|e| e.to_string())?;
            Ok(render::exit_code(owner.phase))
        }
        OwnerCommand::Get { name } => {
            let value = call(client, &method("get"), NameParams { name }).await?;
            print(out, &value, |o: &Owner| {
                render::owners(std::slice::from_ref(o))
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
            let value = call(client, &method("list"), params).await?;
            print(out, &value, |l: &opmon_client::OwnerList| {
                let mut text = render::owners(&l.items);
                if let Some(next) = &l.next {
                    text.push_str(&format!("(more: --after {next})\n"));
                }
                text
            })
        }
        OwnerCommand::Operations { name, phases } => {
            let params = json!({"name": name, "phases": (!phases.is_empty()).then_some(phases)});
            let value = call(client, &method("operations"), params).await?;
            print(out, &value, |ops: &Vec<opmon_client::Operation>| {
                render::operations(ops)
            })
        }
        OwnerCommand::Describe { name, details } => {
            let owner = call(client, &method("get"), NameParams { name: name.clone() }).await?;
            let ops = if details {
                Some(call(client, &method("operations"), NameParams { name }).await?)
            } else {
                None
            };
            match out {
                Output::Json => {
                    let mut value = json!({"owner": owner});
                    if let Some(ops) = ops {
                        value["operations"] = ops;
                    }
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&value).map_err(|e| e.to_string())?
                    );
                }
                Output::Table => {
                    let owner: Owner = serde_json::from_value(owner).map_err(|e| e.to_string())?;
                    let ops: Option<Vec<opmon_client::Operation>> = ops
                        .map(serde_json::from_value)
                        .transpose()
                        .map_err(|e| e.to_string())?;
                    print!("{}", render::describe(&owner, ops.as_deref()));
                }
            }
            Ok(0)
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
                        call(client, &method("get"), NameParams { name: name.clone() }).await?;
                    (
                        serde_json::from_value(value).map_err(|e| e.to_string())?,
                        true,
                    )
                }
            };
            match out {
                Output::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(&json!({"owner": owner, "timedOut": timed_out}))
                        .map_err(|e| e.to_string())?
                ),
                Output::Table if timed_out => {
                    print!("{}", one_line(&owner));
                    eprintln!("opmon: timed out waiting for {kind} {name}");
                }
                Output::Table => print!("{}", one_line(&owner)),
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
                (Some(input), Some(output)) => Some(Contents { input, output }),
                _ => None,
            };
            let updated_items: Vec<UpdatedItem> = match updated_items {
                Some(path) => read_json_file(&path)?,
                None => Vec::new(),
            };
            let value = call(
                client,
                &method("finalize"),
                FinalizeParams {
                    name,
                    contents,
                    updated_items,
                },
            )
            .await?;
            print(out, &value, |r: &FinalizeResult| {
                let mut text = one_line(&r.owner);
                text.push_str(&format!(
                    "item operations: {}\n",
                    r.item_operations_file.display()
                ));
                if let Some(file) = &r.contents_file {
                    text.push_str(&format!(
                        "contents: {} ({} entries replaced, {} added)\n",
                        file.display(),
                        r.replaced,
                        r.added
                    ));
                }
                text
            })?;
            let result: FinalizeResult =
                serde_json::from_value(value).map_err(|e| e.to_string())?;
            Ok(render::exit_code(result.owner.phase))
        }
        OwnerCommand::ItemOperations { name } => {
            let value = call(client, &method("itemOperations"), NameParams { name }).await?;
            print(out, &value, |r: &Vec<opmon_client::ItemOperation>| {
                render::item_operations(r)
            })
        }
        OwnerCommand::Delete { name } => {
            let value = call(client, &method("delete"), NameParams { name: name.clone() }).await?;
            print(out, &value, |r: &opmon_client::DeleteResult| {
                format!(
                    "{kind} {name} deleted, {} operations cancelled\n",
                    r.cancelled
                )
            })
        }
    }
}

async fn snapshotter_command(client: &Client, out: Output, cmd: SnapshotterCommand) -> Outcome {
    match cmd {
        SnapshotterCommand::Register {
            name,
            api_version,
            snapshotter_socket,
            command,
        } => {
            let s = Snapshotter {
                name,
                api_version,
                socket: snapshotter_socket,
                command: (!command.is_empty()).then_some(command),
            };
            let value = call(client, "snapshotter.register", s).await?;
            print(out, &value, |s: &Snapshotter| {
                format!("snapshotter {} registered\n", s.name)
            })
        }
        SnapshotterCommand::List => {
            let value = call(client, "snapshotter.list", json!({})).await?;
            print(out, &value, |l: &Vec<Snapshotter>| render::snapshotters(l))
        }
        SnapshotterCommand::Unregister { name } => {
            let value = call(client, "snapshotter.unregister", NameParams { name }).await?;
            print(out, &value, |s: &Snapshotter| {
                format!("snapshotter {} unregistered\n", s.name)
            })
        }
    }
}
