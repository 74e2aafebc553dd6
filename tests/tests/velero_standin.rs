//! End-to-end: stock Velero through `opmon-velero-plugin`, where Velero's own controllers
//! cannot be made to do it in a test (velero_go.rs runs those): a Go host on Velero's
//! go-plugin and its generated gRPC clients (tests/go/velero/cmd/velero-host) does what
//! Velero's plugin manager and controllers do, step by step, so that Velero can stop and
//! start again mid-operation, the agent can go away, and single calls can be made. The
//! original plugin is the test plugin on Velero's framework
//! (tests/go/velero/cmd/test-plugin); the real agent polls its own copy of it.

use std::io::{BufRead, BufReader, Lines};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};

use opmon_tests::velero::{test_plugin, velero_host, PluginDir};
use opmon_tests::{eventually, without_opmon_env, workspace_binary, Agent, RawHttp};
use serde_json::{json, Value};

const BACKUP_A: &str = "example.io/backup-a";
const RESTORE_A: &str = "example.io/restore-a";
const LONG: std::time::Duration = std::time::Duration::from_secs(60);

/// The agent with a `[[snapshotter]]` table for each plugin of the original, the
/// original's state directory, and the stand-in as Velero finds it.
struct World {
    // Dropped before its directory: the agent's log is checked when it goes.
    agent: Agent,
    dir: PluginDir,
}

impl World {
    /// `extra`: lines for each table (deadlines, retries).
    fn new(extra: &str) -> World {
        let dir = PluginDir::new();
        let state = dir.state();
        let tables: Vec<String> = [BACKUP_A, RESTORE_A]
            .iter()
            .map(|name| {
                format!(
                    "[[snapshotter]]\nname = \"{name}\"\nvelero_plugin = \"{}\"\n\
                     env = {{ OPMON_TEST_STATE = \"{}\" }}\n{extra}\n",
                    test_plugin().display(),
                    state.display()
                )
            })
            .collect();
        let config = dir.path().join("agent.toml");
        std::fs::write(&config, tables.join("\n")).unwrap();
        let agent = Agent::start(dir.path(), &["--config", config.to_str().unwrap()]);
        World { agent, dir }
    }

    fn state(&self) -> PathBuf {
        self.dir.state()
    }

    fn tmp(&self) -> PathBuf {
        let tmp = self.dir.path().join("tmp");
        std::fs::create_dir_all(&tmp).unwrap();
        tmp
    }

    fn journal(&self) -> Vec<String> {
        self.dir.journal()
    }

    /// The Go host, as Velero runs its plugins: the stand-in is the plugin binary it
    /// finds, the environment is what Velero's Deployment gives it.
    fn host(&self, args: &[&str]) -> Command {
        let mut command = Command::new(velero_host());
        without_opmon_env(&mut command);
        command
            .arg("-plugin")
            .arg(workspace_binary("opmon-velero-plugin"))
            .args(args)
            .env("OPMON_SOCKET", &self.agent.socket)
            .env("OPMON_VELERO_ORIGINAL", test_plugin())
            .env("OPMON_TEST_STATE", self.state())
            // Where go-plugin's plugins make their sockets: the stand-in's, and the
            // original's it runs.
            .env("TMPDIR", self.tmp())
            .stdin(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::options()
                    .create(true)
                    .append(true)
                    .open(self.dir.path().join("velero-host.log"))
                    .unwrap(),
            ));
        command
    }

    /// Runs the host to its end; its events.
    fn velero(&self, args: &[&str]) -> Vec<Value> {
        let out = self.host(args).output().expect("running the Go host");
        let events = parse(&String::from_utf8_lossy(&out.stdout));
        assert!(
            out.status.success(),
            "the host failed: {events:?}; its log: {}",
            self.host_log()
        );
        events
    }

    /// Velero backs up with `BACKUP_A`: Backup `owner` (uid `uid-<owner>`), one item
    /// (the test plugin's operation ID), `extra` flags; its events.
    fn back_up(&self, owner: &str, item: &str, extra: &[&str]) -> Vec<Value> {
        let args = backup_args(owner, item, extra);
        self.velero(&args.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// [`World::back_up`], its events as they come.
    fn back_up_spawn(&self, owner: &str, item: &str, extra: &[&str]) -> Running {
        let args = backup_args(owner, item, extra);
        self.velero_spawn(&args.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// Starts the host; its events as they come.
    fn velero_spawn(&self, args: &[&str]) -> Running {
        let mut child = self
            .host(args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the Go host");
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Running {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    fn host_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("velero-host.log")).unwrap_or_default()
    }

    fn call(&self, method: &str, params: Value) -> Value {
        let mut http = RawHttp::connect(&self.agent.socket);
        let answer = http.call(
            &json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string(),
        );
        answer
            .get("result")
            .cloned()
            .unwrap_or_else(|| panic!("{method}: {answer}"))
    }

    /// `kind` owner `name` once it is in `phase`.
    fn owner_in(&self, kind: &str, name: &str, phase: &str) -> Value {
        eventually(format!("{kind} {name} is {phase}"), LONG, || {
            let owner = self.call(&format!("{kind}.get"), json!({"name": name}));
            (owner["phase"] == phase).then_some(owner)
        })
    }
}

struct Running {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    seen: Vec<Value>,
}

impl Running {
    /// Reads events until one named `event`.
    fn until(&mut self, event: &str) -> Value {
        for line in self.lines.by_ref() {
            let line = line.expect("reading the host's output");
            let value: Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("the host printed {line:?}: {e}"));
            self.seen.push(value.clone());
            if value["event"] == event {
                return value;
            }
        }
        panic!("the host ended without {event}: {:?}", self.seen);
    }

    /// Reads to the end; every event seen.
    fn finish(mut self) -> Vec<Value> {
        for line in self.lines.by_ref() {
            let line = line.expect("reading the host's output");
            self.seen
                .push(serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}")));
        }
        let status = self.child.wait().expect("waiting for the host");
        assert!(status.success(), "the host failed: {:?}", self.seen);
        self.seen
    }
}

fn backup_args(owner: &str, item: &str, extra: &[&str]) -> Vec<String> {
    let uid = format!("uid-{owner}");
    let mut args: Vec<String> = [
        "-name", BACKUP_A, "-owner", owner, "-uid", &uid, "-item", item,
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

fn parse(text: &str) -> Vec<Value> {
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("the host printed {l:?}: {e}")))
        .collect()
}

fn events<'a>(all: &'a [Value], name: &str) -> Vec<&'a Value> {
    all.iter().filter(|e| e["event"] == name).collect()
}

fn last(all: &[Value]) -> &Value {
    all.last().expect("the host printed nothing")
}

/// An operation whose progress stands still is caught by the agent's stall deadline:
/// Velero sees it fail with the agent's reason, and the original got its Cancel.
#[test]
fn a_stall_caught_by_the_agent_reaches_velero_as_a_failure_with_its_reason() {
    let world = World::new("stall_timeout = \"1s\"");
    let all = world.back_up("b4", "stall-s", &[]);
    let end = last(&all);
    assert_eq!(
        (&end["event"], &end["by"]),
        (&json!("failed"), &json!("plugin")),
        "{all:?}"
    );
    assert!(
        end["error"]
            .as_str()
            .unwrap()
            .starts_with("no progress for 1s"),
        "{end}"
    );
    let journal = world.journal();
    assert!(
        journal.contains(&"cancel BackupItemActionV2 example.io/backup-a stall-s".to_string()),
        "{journal:?}"
    );
    let owner = world.owner_in("backup", "b4", "PartiallyFailed");
    assert_eq!(owner["operationsFailed"], 1);
}

/// The agent restarts while Velero waits: Velero's Progress calls go on (the stand-in
/// waits for the agent) and the operation completes with no failure.
#[test]
fn the_agent_restarted_mid_operation() {
    let mut world = World::new("");
    let mut velero = world.back_up_spawn("b7", "steps-40-r", &[]);
    velero.until("progress");
    world.agent.kill9();
    world.agent.restart();
    let all = velero.finish();
    assert!(events(&all, "failed").is_empty(), "{all:?}");
    assert_eq!(last(&all)["event"], "completed", "{all:?}");
    assert_eq!(events(&all, "progress").last().unwrap()["nCompleted"], 40);
}

/// Velero restarts: a new host, with a new stand-in process, asks Progress of an
/// operation it did not start in this life, and gets it.
#[test]
fn velero_restarted_asks_progress_of_operations_it_did_not_start() {
    let world = World::new("");
    let first = world.back_up("b8", "steps-20-v", &["-polls", "1"]);
    let stopped = last(&first);
    assert_eq!(stopped["event"], "stopped", "{first:?}");
    let created = stopped["created"].as_str().unwrap();
    let all = world.velero(&[
        "-name",
        BACKUP_A,
        "-owner",
        "b8",
        "-uid",
        "uid-b8",
        "-resume",
        "steps-20-v",
        "-created",
        created,
    ]);
    assert!(events(&all, "executed").is_empty(), "{all:?}");
    assert_eq!(last(&all)["event"], "completed", "{all:?}");
    assert_eq!(events(&all, "progress").last().unwrap()["nCompleted"], 20);
}

/// Velero restarts while its backup is InProgress: Velero fails that backup (its own
/// rule), and the agent fails the owner with Velero's reason once the new Velero's
/// plugin process starts, cancelling the original's operation.
#[test]
fn velero_restarted_during_in_progress_fails_the_owner_as_velero_does() {
    let world = World::new("");
    let first = world.back_up("b10", "stall-i", &["-execute-only"]);
    assert_eq!(last(&first)["event"], "stopped", "{first:?}");
    assert_eq!(
        world.call("backup.get", json!({"name": "b10"}))["phase"],
        "InProgress"
    );
    // The new Velero lists its plugins (it starts the stand-in) and backs up another.
    let all = world.back_up("b11", "done-1", &[]);
    assert_eq!(last(&all)["event"], "completed", "{all:?}");
    let owner = world.owner_in("backup", "b10", "Failed");
    assert!(
        owner["failureReason"]
            .as_str()
            .unwrap()
            .contains("during the server starting"),
        "{owner}"
    );
    eventually("the original gets Cancel", LONG, || {
        world
            .journal()
            .contains(&"cancel BackupItemActionV2 example.io/backup-a stall-i".to_string())
    });
    assert_eq!(
        world.call("backup.get", json!({"name": "b11"}))["phase"],
        "Completed"
    );
}

/// A backup that stopped after Execute (failed before its upload) leaves its owner
/// InProgress in the agent; its Backup deleted and made again under the same name (a
/// new uid), in the same Velero, backs up: the stand-in removes the old uid's owner,
/// cancelling its operation, and the new backup completes under the name.
#[test]
fn a_backup_made_again_under_its_name_in_the_same_velero_completes() {
    let world = World::new("");
    let all = world.back_up(
        "b12",
        "stall-a",
        &[
            "-execute-only",
            "-again-uid",
            "uid-b12-again",
            "-again-item",
            "done-1",
        ],
    );
    assert_eq!(events(&all, "stopped").len(), 1, "{all:?}");
    assert!(events(&all, "executeFailed").is_empty(), "{all:?}");
    assert_eq!(last(&all)["event"], "completed", "{all:?}");
    let owner = world.owner_in("backup", "b12", "Completed");
    assert_eq!(owner["uid"], "uid-b12-again", "{owner}");
    eventually("the old uid's operation is cancelled", LONG, || {
        world
            .journal()
            .contains(&"cancel BackupItemActionV2 example.io/backup-a stall-a".to_string())
    });
    let mut http = RawHttp::connect(&world.agent.socket);
    let old = http.call(
        &json!({"jsonrpc": "2.0", "id": 1, "method": "backup.get",
                "params": {"name": "b12", "uid": "uid-b12"}})
        .to_string(),
    );
    assert_eq!(
        old["error"]["code"], 1001,
        "the old uid's owner is gone: {old}"
    );
}

/// The same for a Restore: `velero restore delete` calls no plugin, so a restore deleted
/// unfinished leaves its owner; the Restore made again under its name restores.
#[test]
fn a_restore_made_again_under_its_name_in_the_same_velero_completes() {
    let world = World::new("");
    let all = world.velero(&[
        "-restore",
        "-name",
        RESTORE_A,
        "-owner",
        "r12",
        "-uid",
        "uid-r12",
        "-item",
        "stall-r",
        "-execute-only",
        "-again-uid",
        "uid-r12-again",
        "-again-item",
        "done-1",
    ]);
    assert!(events(&all, "executeFailed").is_empty(), "{all:?}");
    assert_eq!(last(&all)["event"], "completed", "{all:?}");
    let owner = world.owner_in("restore", "r12", "Completed");
    assert_eq!(owner["uid"], "uid-r12-again", "{owner}");
    eventually("the old uid's operation is cancelled", LONG, || {
        world
            .journal()
            .contains(&"cancel RestoreItemActionV2 example.io/restore-a stall-r".to_string())
    });
}

/// With no agent to answer, Execute fails for the item (the original's operation is
/// cancelled rather than left unwatched), and a deletion is told so on each item.
#[test]
fn an_unreachable_agent_is_an_error_velero_shows_at_execute_and_deletion() {
    let mut world = World::new("");
    world.agent.kill9();
    // Velero, with a stand-in that waits for the agent 300ms; its events.
    let velero = |args: &[String]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = world
            .host(&args)
            .env("OPMON_VELERO_AGENT_TIMEOUT", "300ms")
            .output()
            .expect("running the Go host");
        parse(&String::from_utf8_lossy(&out.stdout))
    };
    let all = velero(&backup_args("b9", "steps-3-u", &[]));
    let end = last(&all);
    assert_eq!(end["event"], "executeFailed", "{all:?}");
    let error = end["error"].as_str().unwrap();
    assert!(
        error.contains("the opmon agent at") && error.contains("cannot be reached"),
        "{error}"
    );
    let journal = world.journal();
    assert!(
        journal.contains(&"cancel BackupItemActionV2 example.io/backup-a steps-3-u".to_string()),
        "{journal:?}"
    );
    // Velero deletes the backup meanwhile: it logs the stand-in's error on each item
    // and goes on, as with any plugin's error.
    let args = [
        "-owner",
        "b9",
        "-uid",
        "uid-b9",
        "-delete",
        "persistentvolumeclaims/app/steps-3-u,persistentvolumeclaims/app/a,persistentvolumeclaims/app/b",
    ];
    let all = velero(&args.map(String::from));
    let ours = deletes(&all, FORGET);
    assert_eq!(ours.len(), 3, "{all:?}");
    assert!(
        ours.iter().all(|(_, e)| e.contains("cannot be reached")),
        "{ours:?}"
    );
    // The items after the first do not each wait for the agent again.
    assert!(
        ours[1..]
            .iter()
            .all(|(_, e)| e.ends_with("(for an earlier item of this backup; not waiting again)")),
        "{ours:?}"
    );
}

/// The agent away while Velero waits for the operations: each Progress answers at once
/// with what it answered last, not completed, so Velero polls on rather than failing an
/// operation the agent keeps (with the agent timeout of an hour, a Progress that waited
/// for the agent would hold this test for an hour, three times); once the agent is
/// back, the operation completes in Velero as if it had never been away.
#[test]
fn with_the_agent_away_progress_answers_at_once_and_nothing_is_lost() {
    let mut world = World::new("");
    let all = world.back_up("b21", "steps-6-w", &["-polls", "2"]);
    assert_eq!(last(&all)["event"], "stopped", "{all:?}");
    world.agent.kill9();
    let resume = |world: &World, polls: &str| {
        let args = [
            "-name",
            BACKUP_A,
            "-owner",
            "b21",
            "-uid",
            "uid-b21",
            "-resume",
            "steps-6-w",
            "-polls",
            polls,
        ];
        let out = world
            .host(&args)
            .env("OPMON_VELERO_AGENT_TIMEOUT", "1h")
            .output()
            .expect("running the Go host");
        parse(&String::from_utf8_lossy(&out.stdout))
    };
    // Velero restarted meanwhile: its stand-in never answered this operation.
    let all = resume(&world, "3");
    assert!(events(&all, "failed").is_empty(), "{all:?}");
    let progress = events(&all, "progress");
    assert_eq!(progress.len(), 3, "{all:?}");
    assert!(progress.iter().all(|p| p["completed"] == false), "{all:?}");
    assert_eq!(last(&all)["event"], "stopped", "{all:?}");
    world.agent.restart();
    let all = resume(&world, "0");
    assert!(events(&all, "failed").is_empty(), "{all:?}");
    assert_eq!(last(&all)["event"], "completed", "{all:?}");
    assert_eq!(events(&all, "progress").last().unwrap()["nCompleted"], 6);
}

/// A Progress error of the original reaches Velero as the original alone gives it:
/// Velero records the same error text for the operation through the stand-in as
/// without it.
#[test]
fn a_progress_error_reaches_velero_as_the_originals_text() {
    let world = World::new("");
    let through = world.back_up("b22", "error-e", &[]);
    let end = last(&through);
    assert_eq!(end["event"], "failed", "{through:?}");
    let args = backup_args("b23", "error-e", &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = world
        .host(&args)
        .env_remove("OPMON_VELERO_ORIGINAL")
        .arg("-plugin")
        .arg(test_plugin())
        .output()
        .expect("running the Go host on the original alone");
    let alone = parse(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(last(&alone)["event"], "failed", "{alone:?}");
    assert_eq!(
        end["error"],
        last(&alone)["error"],
        "through the stand-in: {through:?}; alone: {alone:?}"
    );
    assert_eq!(
        end["error"],
        "rpc error: code = Unknown desc = no snapshot named error-e"
    );
}

/// The stand-in's own DeleteItemAction, as Velero lists it beside the original's.
const FORGET: &str = "opmon.io/forget-opmon-velero-plugin";

/// The `deleteExecuted` events of plugin `name`: (item, error).
fn deletes(all: &[Value], name: &str) -> Vec<(String, String)> {
    events(all, "deleteExecuted")
        .iter()
        .filter(|e| e["name"] == name)
        .map(|e| {
            (
                e["item"].as_str().unwrap_or("").to_string(),
                e["error"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

/// The agent's answer to `backup.get`, error or result.
fn backup_get(world: &World, name: &str) -> Value {
    let mut http = RawHttp::connect(&world.agent.socket);
    http.call(
        &json!({"jsonrpc": "2.0", "id": 1, "method": "backup.get", "params": {"name": name}})
            .to_string(),
    )
}

/// Velero deletes the backup: its deletion calls the DeleteItemActions for the backup's
/// items, the stand-in's own among them (for the items the original's
/// BackupItemActions apply to), and the agent's owner of that Backup is removed. A
/// Backup of the same name with another uid leaves it; the original's own
/// DeleteItemAction gets its calls unchanged.
#[test]
fn velero_deleting_the_backup_removes_its_owner_from_the_agent() {
    let world = World::new("");
    let all = world.back_up("b20", "steps-2-d", &[]);
    assert_eq!(last(&all)["event"], "completed", "{all:?}");
    eventually("the backup completes", LONG, || {
        world.call("backup.get", json!({"name": "b20"}))["phase"] == "Completed"
    });
    let items = "persistentvolumeclaims/app/steps-2-d,pods/app/web,persistentvolumeclaims/app/logs";

    // Another Backup that once had the name: the owner is not its.
    let all = world.velero(&["-owner", "b20", "-uid", "uid-other", "-delete", items]);
    assert_eq!(
        deletes(&all, FORGET),
        vec![
            (
                "persistentvolumeclaims/app/steps-2-d".to_string(),
                String::new()
            ),
            ("persistentvolumeclaims/app/logs".to_string(), String::new()),
        ],
        "{all:?}"
    );
    assert_eq!(backup_get(&world, "b20")["result"]["uid"], "uid-b20");

    let all = world.velero(&["-owner", "b20", "-uid", "uid-b20", "-delete", items]);
    let listed: Vec<(&str, &str)> = events(&all, "listed")
        .iter()
        .map(|e| (e["kind"].as_str().unwrap(), e["name"].as_str().unwrap()))
        .collect();
    assert!(listed.contains(&("DeleteItemAction", FORGET)), "{listed:?}");
    assert!(
        listed.contains(&("DeleteItemAction", "example.io/delete-a")),
        "{listed:?}"
    );
    // It applies to what the original's BackupItemActions apply to (backup-a's PVCs,
    // backup-b's config maps): no pods.
    let applies = events(&all, "deleteAppliesTo");
    let ours = applies
        .iter()
        .find(|e| e["name"] == FORGET)
        .expect("AppliesTo");
    assert_eq!(
        ours["includedResources"],
        json!(["configmaps", "persistentvolumeclaims"])
    );
    let ours = deletes(&all, FORGET);
    assert_eq!(ours.len(), 2, "{all:?}");
    assert!(ours.iter().all(|(_, e)| e.is_empty()), "{ours:?}");
    assert_eq!(backup_get(&world, "b20")["error"]["code"], 1001);
    // The original's DeleteItemAction was passed on, with the Backup.
    let journal = world.journal();
    assert!(
        journal.contains(
            &"delete DeleteItemAction example.io/delete-a steps-2-d Backup/b20".to_string()
        ),
        "{journal:?}"
    );
    assert!(deletes(&all, "example.io/delete-a")
        .iter()
        .all(|(_, e)| e.is_empty()));

    // Deleted again (a deletion Velero retries): nothing left to remove, no error.
    let all = world.velero(&["-owner", "b20", "-uid", "uid-b20", "-delete", items]);
    assert!(
        deletes(&all, FORGET).iter().all(|(_, e)| e.is_empty()),
        "{all:?}"
    );
}

/// A Velero that restarted has forgotten which backups it is still working on, and
/// deletes one whose operations have not ended: the owner goes, and its unfinished
/// operation is cancelled in the original rather than left running unwatched.
#[test]
fn a_backup_deleted_with_its_operations_unfinished_cancels_them() {
    let world = World::new("");
    let first = world.back_up("b21", "stall-x", &["-polls", "1"]);
    assert_eq!(last(&first)["event"], "stopped", "{first:?}");
    assert_eq!(
        world.call("backup.get", json!({"name": "b21"}))["phase"],
        "WaitingForPluginOperations"
    );
    let all = world.velero(&[
        "-owner",
        "b21",
        "-uid",
        "uid-b21",
        "-delete",
        "persistentvolumeclaims/app/stall-x",
    ]);
    assert_eq!(
        deletes(&all, FORGET),
        vec![(
            "persistentvolumeclaims/app/stall-x".to_string(),
            String::new()
        )],
        "{all:?}"
    );
    assert_eq!(backup_get(&world, "b21")["error"]["code"], 1001);
    eventually("the original gets Cancel", LONG, || {
        world
            .journal()
            .contains(&"cancel BackupItemActionV2 example.io/backup-a stall-x".to_string())
    });
}

/// An ObjectStore's calls stream (PutObject takes the body in chunks, GetObject gives
/// it back in chunks): the stand-in passes them on message by message, errors and all.
#[test]
fn an_object_stores_streaming_calls_are_passed_on() {
    let world = World::new("");
    let all = world.velero(&["-name", "example.io/store", "-object", "0123456789abc"]);
    let listed: Vec<(&str, &str)> = events(&all, "listed")
        .iter()
        .map(|e| (e["kind"].as_str().unwrap(), e["name"].as_str().unwrap()))
        .collect();
    assert!(
        listed.contains(&("ObjectStore", "example.io/store")),
        "{listed:?}"
    );
    let objects = events(&all, "object");
    assert_eq!(
        (&objects[0]["data"], &objects[0]["chunks"]),
        (&json!("0123456789abc"), &json!(4)),
        "{all:?}"
    );
    assert_eq!(objects[1]["error"], "no object b/k/missing", "{all:?}");
    let journal = world.journal();
    assert!(
        journal.contains(&"put ObjectStore b/k/1 13 bytes".to_string()),
        "{journal:?}"
    );
}
