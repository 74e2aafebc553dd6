//! End-to-end: Velero plugin binaries as snapshotters. A plugin written on Velero's own
//! plugin framework (tests/go/velero/cmd/test-plugin, Velero v1.18.1 with the go-plugin
//! and gRPC it pins) and `opmon-velero-plugin-17`, which speaks go-plugin 1.7's side of
//! the wire (the seven-field handshake, the stdio stream it holds its output for), run
//! under the real agent, named by `[[snapshotter]]` tables.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use opmon_tests::{agent_command, eventually, velero, Agent, RawHttp};
use serde_json::{json, Value};

const LONG: Duration = Duration::from_secs(60);
const BACKUP_A: &str = "example.io/backup-a";
const BACKUP_B: &str = "example.io/backup-b";
const RESTORE_A: &str = "example.io/restore-a";

/// The Go test plugin (tests/go/velero/cmd/test-plugin), built once.
fn go_plugin() -> PathBuf {
    velero::test_plugin().to_path_buf()
}

/// `opmon-velero-plugin-17`, built by cargo beside the test executables.
fn plugin_17() -> PathBuf {
    opmon_tests::workspace_binary("opmon-velero-plugin-17")
}

fn request(method: &str, params: Value) -> String {
    json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string()
}

/// A test's directory, the plugin's state directory and the config file's tables.
struct Setup {
    dir: velero::PluginDir,
}

impl Setup {
    fn new() -> Setup {
        Setup {
            dir: velero::PluginDir::new(),
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn state(&self) -> PathBuf {
        self.dir.state()
    }

    /// A `[[snapshotter]]` table naming `binary` for `name`, `extra` lines added.
    fn table(&self, name: &str, binary: &Path, extra: &str) -> String {
        format!(
            "[[snapshotter]]\nname = \"{name}\"\nvelero_plugin = \"{}\"\n\
             args = [\"--log-level\", \"info\", \"--features=\", \"--no-such-flag\"]\n\
             env = {{ OPMON_TEST_STATE = \"{}\", TMPDIR = \"{}\", OPMON_TEST_EXPECT = \"kubeconfig\" }}\n{extra}\n",
            binary.display(),
            self.state().display(),
            self.path().display()
        )
    }

    fn config(&self, tables: &[String], settings: &str) -> PathBuf {
        let path = self.path().join("agent.toml");
        std::fs::write(&path, format!("{settings}\n{}", tables.join("\n"))).unwrap();
        path
    }

    fn agent(&self, tables: &[String], settings: &str) -> Agent {
        let config = self.config(tables, settings);
        Agent::start(self.path(), &["--config", config.to_str().unwrap()])
    }

    fn journal(&self) -> Vec<String> {
        self.dir.journal()
    }

    /// The pids of the plugin processes started, in order.
    fn started(&self) -> Vec<i32> {
        self.journal()
            .iter()
            .filter_map(|l| l.strip_prefix("started "))
            .filter_map(|l| l.split(' ').next()?.parse().ok())
            .collect()
    }
}

fn alive(pid: i32) -> bool {
    // A zombie still answers signal 0; its state in /proc says it is dead.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

/// The process group of `pid`.
fn group(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // pid (comm) state ppid pgrp …; comm may hold spaces but not ") ".
    let rest = &stat[stat.rfind(") ")? + 2..];
    rest.split(' ').nth(2)?.parse().ok()
}

/// Starts `kind` owner `name` (with its object, as Velero sends it) with `ops` as
/// (plugin, id) and ends its InProgress phase.
fn start_owner(http: &mut RawHttp, kind: &str, name: &str, ops: &[(&str, &str)]) {
    let object = json!({"apiVersion": "velero.io/v1", "kind": if kind == "backup" {"Backup"} else {"Restore"},
        "metadata": {"name": name, "namespace": "velero", "uid": format!("uid-{name}")}});
    let started = http.call(&request(
        &format!("{kind}.start"),
        json!({"name": name, "uid": format!("uid-{name}"), "object": object}),
    ));
    assert!(started.get("result").is_some(), "{started}");
    let plugin_kind = if kind == "backup" {
        "BackupItemAction"
    } else {
        "RestoreItemAction"
    };
    let ops: Vec<Value> = ops
        .iter()
        .map(|(plugin, id)| {
            json!({"plugin": {"kind": plugin_kind, "name": plugin},
                   "resource": {"resource": "persistentvolumeclaims", "namespace": "app", "name": id},
                   "operationId": id})
        })
        .collect();
    let added = http.call(&request(
        &format!("{kind}.addOperations"),
        json!({"name": name, "operations": ops}),
    ));
    assert_eq!(added["result"]["added"], ops.len(), "{added}");
    let ended = http.call(&request(
        &format!("{kind}.endInProgress"),
        json!({"name": name}),
    ));
    assert!(ended.get("result").is_some(), "{ended}");
}

fn operations(http: &mut RawHttp, kind: &str, name: &str) -> Vec<Value> {
    let answer = http.call(&request(
        &format!("{kind}.operations"),
        json!({"name": name}),
    ));
    answer["result"]
        .as_array()
        .unwrap_or_else(|| panic!("{answer}"))
        .clone()
}

fn is_final(op: &Value) -> bool {
    ["Completed", "Failed", "Canceled"].contains(&op["phase"].as_str().unwrap_or(""))
}

/// The owner's operations once all of them have finished, by ID.
fn finished(
    http: &mut RawHttp,
    kind: &str,
    name: &str,
) -> std::collections::BTreeMap<String, Value> {
    let ops = eventually(format!("{kind} {name}'s operations finish"), LONG, || {
        let ops = operations(http, kind, name);
        ops.iter().all(is_final).then_some(ops)
    });
    ops.into_iter()
        .map(|op| (op["operationId"].as_str().unwrap().to_string(), op))
        .collect()
}

/// Every case of Progress through the real go-plugin library: operations that progress,
/// complete (with Go's zero time as `started`), fail on their own, return a Velero-style
/// gRPC error or another code; two tables naming one binary share its process, which
/// gets the table's arguments and environment; a restore goes through
/// RestoreItemAction v2; the plugin's log lines reach the agent's log.
#[test]
fn go_plugin_operations_progress_complete_and_fail_as_the_plugin_says() {
    let plugin = go_plugin();
    let setup = Setup::new();
    let agent = setup.agent(
        &[
            setup.table(BACKUP_A, &plugin, ""),
            setup.table(BACKUP_B, &plugin, ""),
            setup.table(RESTORE_A, &plugin, ""),
        ],
        "",
    );
    let mut http = RawHttp::connect(&agent.socket);
    start_owner(
        &mut http,
        "backup",
        "b1",
        &[
            (BACKUP_A, "done-1"),
            (BACKUP_A, "steps-3-1"),
            (BACKUP_A, "fail-1"),
            (BACKUP_A, "error-1"),
            (BACKUP_A, "code-1"),
            (BACKUP_B, "done-2"),
        ],
    );
    start_owner(&mut http, "restore", "r1", &[(RESTORE_A, "steps-2-r")]);
    let ops = finished(&mut http, "backup", "b1");
    assert_eq!(ops["done-1"]["phase"], "Completed", "{:?}", ops["done-1"]);
    assert!(
        ops["done-1"].get("started").is_none_or(Value::is_null),
        "Go's zero time is unset: {}",
        ops["done-1"]
    );
    assert_eq!(ops["done-2"]["phase"], "Completed");
    let steps = &ops["steps-3-1"];
    assert_eq!(
        (&steps["phase"], &steps["nCompleted"], &steps["nTotal"]),
        (&json!("Completed"), &json!(3), &json!(3)),
        "{steps}"
    );
    assert_eq!(steps["description"], "step 3 of 3");
    assert!(steps["started"].is_string(), "{steps}");
    assert_eq!(ops["fail-1"]["phase"], "Failed");
    assert_eq!(ops["fail-1"]["error"], "the copy failed: disk full");
    // A gRPC error's text as Velero records it (grpc-go's `err.Error()`).
    assert_eq!(ops["error-1"]["phase"], "Failed");
    assert_eq!(
        ops["error-1"]["error"],
        "rpc error: code = Unknown desc = no snapshot named error-1"
    );
    assert_eq!(ops["code-1"]["phase"], "Failed");
    assert_eq!(
        ops["code-1"]["error"],
        "rpc error: code = FailedPrecondition desc = not ready for code-1"
    );
    let restored = finished(&mut http, "restore", "r1");
    assert_eq!(restored["steps-2-r"]["phase"], "Completed");

    let journal = setup.journal();
    let starts: Vec<&String> = journal
        .iter()
        .filter(|l| l.starts_with("started "))
        .collect();
    assert_eq!(starts.len(), 1, "one process for three tables: {journal:?}");
    assert!(
        starts[0].ends_with("--log-level info --features= --no-such-flag"),
        "{journal:?}"
    );
    assert!(journal.contains(&"env OPMON_TEST_EXPECT=kubeconfig".to_string()));
    // Each call named its plugin and carried the owner's object.
    assert!(journal
        .contains(&"progress BackupItemActionV2 example.io/backup-b done-2 Backup/b1".to_string()));
    assert!(journal.contains(
        &"progress RestoreItemActionV2 example.io/restore-a steps-2-r Restore/r1".to_string()
    ));
    // go-plugin's own log line, from the plugin's stderr, in the agent's log.
    eventually("go-plugin's log line in the agent's log", LONG, || {
        agent
            .log_text()
            .lines()
            .any(|l| l.contains("velero_plugin") && l.contains("plugin address"))
    });
}

/// A table naming a plugin the binary does not serve stops the agent, saying what the
/// binary does serve; `snapshotter.register` may name a binary only where the operator
/// allows commands, and is held to the same check.
#[test]
fn a_name_the_binary_does_not_serve_is_refused_saying_what_it_serves() {
    let plugin = go_plugin();
    let setup = Setup::new();
    let config = setup.config(&[setup.table("example.io/nope", &plugin, "")], "");
    let out = agent_command()
        .arg("--config")
        .arg(&config)
        .arg("--socket")
        .arg(setup.path().join("agent.sock"))
        .arg("--state-dir")
        .arg(setup.path().join("state"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("does not serve example.io/nope")
            && stderr.contains(
                "it serves: BackupItemActionV2 example.io/backup-a, BackupItemActionV2 \
                 example.io/backup-b, ObjectStore example.io/store, RestoreItemActionV2 \
                 example.io/restore-a, DeleteItemAction example.io/delete-a"
            ),
        "{stderr}"
    );

    let register = |name: &str| {
        request(
            "snapshotter.register",
            json!({"name": name, "apiVersion": "v2", "veleroPlugin": plugin,
                   "env": {"OPMON_TEST_STATE": setup.state()}}),
        )
    };
    let agent = Agent::start(setup.path(), &[]);
    let mut http = RawHttp::connect(&agent.socket);
    let refused = http.call(&register(BACKUP_A));
    assert_eq!(refused["error"]["code"], -32602, "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("allow_api_command_snapshotters"),
        "{refused}"
    );
    drop(http);
    drop(agent);

    let allowed = setup.path().join("allowed");
    std::fs::create_dir_all(&allowed).unwrap();
    let agent = Agent::start(&allowed, &["--allow-api-command-snapshotters", "true"]);
    let mut http = RawHttp::connect(&agent.socket);
    let unknown = http.call(&register("example.io/nope"));
    assert!(
        unknown["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("it serves: BackupItemActionV2 example.io/backup-a"),
        "{unknown}"
    );
    let ok = http.call(&register(BACKUP_A));
    assert_eq!(ok["result"]["veleroPlugin"], json!(plugin), "{ok}");
    start_owner(&mut http, "backup", "b2", &[(BACKUP_A, "done-api")]);
    assert_eq!(
        finished(&mut http, "backup", "b2")["done-api"]["phase"],
        "Completed"
    );

    // The CLI registers one too: the words after -- are the binary's arguments.
    let opmon = |args: &[&str]| {
        let out = Command::new(opmon_tests::workspace_binary("opmon"))
            .arg("--socket")
            .arg(&agent.socket)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let state = format!("OPMON_TEST_STATE={}", setup.state().display());
    let plugin = plugin.to_str().unwrap();
    opmon(&[
        "snapshotter",
        "register",
        BACKUP_B,
        "--velero-plugin",
        plugin,
        "--env",
        &state,
        "--",
        "--from-the-cli",
    ]);
    let listed = opmon(&["snapshotter", "list"]);
    assert!(
        listed.contains(&format!("velero_plugin {plugin} --from-the-cli")),
        "{listed}"
    );
    start_owner(&mut http, "backup", "b2b", &[(BACKUP_B, "done-cli")]);
    assert_eq!(
        finished(&mut http, "backup", "b2b")["done-cli"]["phase"],
        "Completed"
    );
    assert!(setup
        .journal()
        .iter()
        .any(|l| l.ends_with(" --from-the-cli")));
}

/// An operation that stops changing is failed at its stall timeout and Cancel reaches
/// the plugin; a call the plugin never answers ends at the deadline, and the operation,
/// still New at its start timeout, is cancelled in the plugin too.
#[test]
fn a_stalled_operation_is_cancelled_in_the_plugin_and_a_hung_call_ends_at_the_deadline() {
    let plugin = go_plugin();
    let setup = Setup::new();
    let agent = setup.agent(
        &[setup.table(
            BACKUP_A,
            &plugin,
            "stall_timeout = \"1s\"\nstart_timeout = \"3s\"",
        )],
        "call_deadline = \"1s\"",
    );
    let mut http = RawHttp::connect(&agent.socket);
    start_owner(
        &mut http,
        "backup",
        "b3",
        &[(BACKUP_A, "stall-1"), (BACKUP_A, "block-1")],
    );
    eventually("Cancel reaches the plugin", LONG, || {
        setup
            .journal()
            .contains(&"cancel BackupItemActionV2 example.io/backup-a stall-1".to_string())
    });
    // Never answered, it is still New at its start timeout: Cancel reaches the plugin.
    eventually(
        "Cancel of the hung operation reaches the plugin",
        LONG,
        || {
            setup
                .journal()
                .contains(&"cancel BackupItemActionV2 example.io/backup-a block-1".to_string())
        },
    );
    let ops = finished(&mut http, "backup", "b3");
    assert_eq!(ops["stall-1"]["phase"], "Failed", "{:?}", ops["stall-1"]);
    assert_eq!(ops["block-1"]["phase"], "Failed", "{:?}", ops["block-1"]);
    // Its own call's deadline or endInProgress's bound on the first poll, whichever
    // passes first (both are `call_deadline`): either says it did not answer.
    let last_error = ops["block-1"]["lastError"].as_str().unwrap_or("");
    assert!(
        last_error.contains("did not answer within 1000 ms")
            || last_error.contains("did not answer before the call's deadline"),
        "{:?}",
        ops["block-1"]
    );
}

/// A plugin that dies is started again and its operation completes; when the agent
/// stops, its plugin stops; an agent started again goes on with the operations it had.
#[test]
fn a_crashed_plugin_is_restarted_and_an_agent_restart_keeps_the_operations() {
    let plugin = go_plugin();
    let setup = Setup::new();
    let tables = [setup.table(BACKUP_A, &plugin, "")];
    let mut agent = setup.agent(&tables, "");
    let mut http = RawHttp::connect(&agent.socket);
    start_owner(&mut http, "backup", "b4", &[(BACKUP_A, "crash-1")]);
    assert_eq!(
        finished(&mut http, "backup", "b4")["crash-1"]["phase"],
        "Completed"
    );
    assert!(setup.journal().contains(&"crashing crash-1".to_string()));
    let pids = setup.started();
    assert_eq!(
        pids.len(),
        2,
        "started again after the crash: {:?}",
        setup.journal()
    );
    assert!(agent.log_text().contains("velero plugin exited"));

    start_owner(&mut http, "backup", "b5", &[(BACKUP_A, "steps-40-1")]);
    eventually("a few polls", LONG, || {
        std::fs::read_to_string(setup.state().join("polls-steps-40-1"))
            .is_ok_and(|n| n.trim().parse::<u32>().unwrap_or(0) >= 2)
    });
    drop(http);
    let running = *setup.started().last().unwrap();
    assert!(alive(running));
    assert_eq!(group(running), Some(running), "a process group of its own");
    assert!(agent.terminate().success());
    eventually("the plugin stops with the agent", LONG, || !alive(running));
    let sockets = |dir: &Path| -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with("plugin") && n != "plugin-state")
            .collect()
    };
    assert_eq!(
        sockets(setup.path()),
        Vec::<String>::new(),
        "its socket is removed"
    );

    agent.restart();
    let mut http = RawHttp::connect(&agent.socket);
    let ops = finished(&mut http, "backup", "b5");
    assert_eq!(
        ops["steps-40-1"]["phase"], "Completed",
        "{:?}",
        ops["steps-40-1"]
    );
    assert_eq!(ops["steps-40-1"]["nCompleted"], 40);
    assert_eq!(setup.started().len(), 3);

    // SIGKILL gives the agent no chance to clean up: the kernel stops the plugin.
    let running = *setup.started().last().unwrap();
    agent.kill9();
    eventually("the plugin dies with a killed agent", LONG, || {
        !alive(running)
    });
}

/// Much output on stdout and stderr does not block the plugin: the host drains both
/// pipes (go-plugin 1.0) and the stdio stream (1.7); the log holds a bounded number of
/// the lines and says how many it left out.
#[test]
fn much_output_does_not_block_a_plugin() {
    let setup = Setup::new();
    let agent = setup.agent(
        &[
            setup.table(BACKUP_A, &go_plugin(), ""),
            setup.table(RESTORE_A, &plugin_17(), ""),
        ],
        "",
    );
    let mut http = RawHttp::connect(&agent.socket);
    start_owner(
        &mut http,
        "backup",
        "b6",
        &[(BACKUP_A, "noisy-512-1"), (BACKUP_A, "noisy-512-2")],
    );
    start_owner(
        &mut http,
        "restore",
        "r6",
        &[(RESTORE_A, "noisy-512-1"), (RESTORE_A, "noisy-512-2")],
    );
    let ops = finished(&mut http, "backup", "b6");
    assert!(ops.values().all(|o| o["phase"] == "Completed"), "{ops:?}");
    let ops = finished(&mut http, "restore", "r6");
    assert!(ops.values().all(|o| o["phase"] == "Completed"), "{ops:?}");
    // The count of what was left out is written when the log's window ends: one limit
    // for every plugin's output.
    let log = eventually("the count of output lines not logged", LONG, || {
        let log = agent.log_text();
        log.contains("more lines of a Velero plugin's output were not logged one by one")
            .then_some(log)
    });
    let logged = log
        .lines()
        .filter(|l| l.contains("velero_plugin") && l.contains("xxxxxxxx"))
        .count();
    assert!(logged <= 200, "{logged} output lines logged");
}

/// The go-plugin 1.7 side of the wire: the seven-field handshake when multiplexing is
/// asked for, the stdio stream, errors and zero times as Velero's framework sends them.
#[test]
fn a_go_plugin_17_plugin_runs_its_operations() {
    let setup = Setup::new();
    let agent = setup.agent(
        &[setup.table(RESTORE_A, &plugin_17(), "").replace(
            "OPMON_TEST_EXPECT",
            "PLUGIN_MULTIPLEX_GRPC = \"true\", OPMON_TEST_X",
        )],
        "",
    );
    let mut http = RawHttp::connect(&agent.socket);
    start_owner(
        &mut http,
        "restore",
        "r7",
        &[
            (RESTORE_A, "done-1"),
            (RESTORE_A, "steps-3-1"),
            (RESTORE_A, "error-1"),
            (RESTORE_A, "fail-1"),
        ],
    );
    let ops = finished(&mut http, "restore", "r7");
    assert_eq!(ops["done-1"]["phase"], "Completed");
    assert!(ops["done-1"].get("started").is_none_or(Value::is_null));
    assert_eq!(ops["steps-3-1"]["nCompleted"], 3);
    assert_eq!(ops["fail-1"]["error"], "the copy failed: disk full");
    assert_eq!(
        ops["error-1"]["error"],
        "rpc error: code = Unknown desc = no snapshot named error-1"
    );
    assert!(setup
        .journal()
        .iter()
        .any(|l| l.starts_with("handshake 7 fields")));
}

/// The tables of docs/velero-plugins.md are accepted as printed, and what
/// `--print-config` prints of them is accepted again and prints the same.
#[test]
fn the_documented_tables_are_accepted_and_printed_back() {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/velero-plugins.md"),
    )
    .unwrap();
    let mut tables = String::new();
    let mut inside = false;
    for line in doc.lines() {
        match (inside, line) {
            (false, "```toml") => inside = true,
            (true, "```") => inside = false,
            (true, line) => {
                tables.push_str(line);
                tables.push('\n');
            }
            _ => {}
        }
    }
    assert_eq!(tables.matches("[[snapshotter]]").count(), 3, "{tables}");
    let dir = tempfile::tempdir().unwrap();
    let print = |text: &str| {
        let config = dir.path().join("agent.toml");
        std::fs::write(&config, text).unwrap();
        let out = agent_command()
            .arg("--config")
            .arg(&config)
            .arg("--print-config")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let printed = print(&tables);
    assert!(
        printed.contains(
            "velero_plugin = \"/opt/velero/velero\"\nargs = [\"run-plugins\", \"--log-level\", \
         \"info\", \"--features\", \"EnableCSI\"]\n"
        ),
        "{printed}"
    );
    let tables_only = &printed[printed.find("[[snapshotter]]").unwrap()..];
    assert_eq!(print(tables_only), printed);
}

/// At a reload, a table naming a plugin its binary does not serve is not applied, saying
/// what the binary serves; once no table names a binary, its process stops.
#[test]
fn a_reload_refuses_an_unserved_name_and_a_binary_no_table_names_stops() {
    let plugin = go_plugin();
    let setup = Setup::new();
    let agent = setup.agent(&[setup.table(BACKUP_A, &plugin, "")], "");
    let pid = eventually("the plugin starts", LONG, || {
        setup.started().first().copied()
    });
    assert!(alive(pid));
    setup.config(&[setup.table("example.io/nope", &plugin, "")], "");
    agent.signal(nix::sys::signal::Signal::SIGHUP);
    eventually("the reload refuses the table", LONG, || {
        agent.log_text().contains(
            "does not serve example.io/nope as a BackupItemActionV2 or RestoreItemActionV2 \
             (it serves: BackupItemActionV2 example.io/backup-a",
        )
    });
    eventually("the binary no table names stops", LONG, || !alive(pid));
    assert_eq!(
        setup.started(),
        [pid],
        "the refused table used the running process"
    );
}
