//! End-to-end: command snapshotters are real shell scripts run by the real agent. They
//! leave nothing behind (their whole process group dies at the deadline, after they
//! exit, and when the agent stops), their answer is taken when they exit even if a
//! child keeps stdout open, they see exactly the documented environment and their
//! params on stdin, what they print is bounded, and only the operator decides whether a
//! client may register one.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use opmon_tests::{Agent, RawHttp};
use serde_json::{json, Value};

const PLUGIN: &str = "example.io/script";
const LONG: Duration = Duration::from_secs(60);

fn request(method: &str, params: Value) -> String {
    json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string()
}

fn operation(id: &str) -> Value {
    json!({"plugin": {"kind": "BackupItemAction", "name": PLUGIN},
           "resource": {"resource": "persistentvolumeclaims", "namespace": "app", "name": "data"},
           "operationId": id})
}

/// Writes an executable script `name` into `dir`.
fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// Starts an agent whose config file registers `command` for [`PLUGIN`].
fn agent_with_command(dir: &Path, command: &[&str], extra: &[&str]) -> Agent {
    let config = dir.join("agent.toml");
    let argv: Vec<String> = command.iter().map(|c| format!("{c:?}")).collect();
    std::fs::write(
        &config,
        format!(
            "[[snapshotter]]\nname = \"{PLUGIN}\"\napi_version = \"v2\"\ncommand = [{}]\n",
            argv.join(", ")
        ),
    )
    .unwrap();
    let mut args = vec!["--config", config.to_str().unwrap()];
    args.extend_from_slice(extra);
    Agent::start(dir, &args)
}

/// Starts backup `name` with the operations `ids` and ends its InProgress phase; returns
/// the owner as `endInProgress` answered.
fn run_backup(http: &mut RawHttp, name: &str, ids: &[&str]) -> Value {
    let started = http.call(&request(
        "backup.start",
        json!({"name": name, "uid": "u-1"}),
    ));
    assert!(started.get("result").is_some(), "{started}");
    let ops: Vec<Value> = ids.iter().map(|id| operation(id)).collect();
    let added = http.call(&request(
        "backup.addOperations",
        json!({"name": name, "operations": ops}),
    ));
    assert_eq!(added["result"]["added"], ids.len(), "{added}");
    let ended = http.call(&request("backup.endInProgress", json!({"name": name})));
    ended["result"].clone()
}

fn operations(http: &mut RawHttp, name: &str) -> Vec<Value> {
    let answer = http.call(&request("backup.operations", json!({"name": name})));
    answer["result"]
        .as_array()
        .unwrap_or_else(|| panic!("{answer}"))
        .clone()
}

/// The process groups the scripts recorded in `dir/groups`, one per line.
fn recorded_groups(dir: &Path) -> Vec<i32> {
    std::fs::read_to_string(dir.join("groups"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// The live (not zombie) processes in process group `pgid`.
fn alive_in_group(pgid: i32) -> Vec<i32> {
    let mut alive = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // After the command name in parentheses: state, ppid, pgrp, …
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.len() > 2 && fields[0] != "Z" && fields[2].parse() == Ok(pgid) {
            alive.push(pid);
        }
    }
    alive
}

/// Waits until no process of any group in `groups` is alive; the survivors if some
/// still are after `within`.
fn survivors_after(groups: &[i32], within: Duration) -> Vec<i32> {
    let deadline = Instant::now() + within;
    loop {
        let alive: Vec<i32> = groups.iter().flat_map(|g| alive_in_group(*g)).collect();
        if alive.is_empty() || Instant::now() > deadline {
            return alive;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Records the script's process group in `$1/groups`: the first lines of the scripts.
const RECORD_GROUP: &str = r#"read -r _ _ _ _ pgid _ < /proc/$$/stat
echo "$pgid" >> "$1/groups"
"#;

const PROGRESS: &str = r#"{"completed":false,"nCompleted":1,"nTotal":2,"operationUnits":"file","started":"2026-01-01T00:00:00Z"}"#;

#[test]
fn a_command_past_its_deadline_is_killed_with_every_process_it_started() {
    let dir = tempfile::tempdir().unwrap();
    // The first call starts children and grandchildren and hangs; later ones answer.
    let hang = script(
        dir.path(),
        "hang.sh",
        &format!(
            r#"{RECORD_GROUP}
if [ ! -e "$1/hung" ]; then
    touch "$1/hung"
    sleep 1000 &
    ( sleep 1000 & sleep 1000 ) &
    sh -c 'sleep 1000; true' &
    wait
fi
echo '{PROGRESS}'
"#
        ),
    );
    let agent = agent_with_command(
        dir.path(),
        &[hang.to_str().unwrap(), dir.path().to_str().unwrap()],
        &["--call-deadline", "1s"],
    );
    let mut http = RawHttp::connect(&agent.socket);
    let owner = run_backup(&mut http, "b", &["op-1"]);
    assert_eq!(owner["phase"], "WaitingForPluginOperations", "{owner}");
    let first = recorded_groups(dir.path())[0];
    let survivors = survivors_after(&[first], Duration::from_secs(10));
    assert!(
        survivors.is_empty(),
        "processes of the command that ran past its deadline still live: {survivors:?}"
    );
    // The agent polls on: later calls answer, and leave nothing either.
    let start = Instant::now();
    while operations(&mut http, "b")[0]["phase"] != "InProgress" {
        assert!(start.elapsed() < LONG, "later polls never answered");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts an agent whose command answers endInProgress's call and runs `hang` (shell
/// lines) on every later call, and a Waiting backup `b` for the poller to call it on.
fn agent_with_a_command_that_hangs_after_one_answer(dir: &Path, hang: &str) -> (Agent, RawHttp) {
    let script = script(
        dir,
        "hang.sh",
        &format!(
            r#"{RECORD_GROUP}
if [ -e "$1/answered" ]; then
{hang}
fi
touch "$1/answered"
echo '{PROGRESS}'
"#
        ),
    );
    let agent = agent_with_command(
        dir,
        &[script.to_str().unwrap(), dir.to_str().unwrap()],
        &["--call-deadline", "10m"],
    );
    let mut http = RawHttp::connect(&agent.socket);
    let owner = run_backup(&mut http, "b", &["op-1"]);
    assert_eq!(owner["phase"], "WaitingForPluginOperations", "{owner}");
    (agent, http)
}

#[test]
fn stopping_the_agent_kills_the_command_it_is_running() {
    let dir = tempfile::tempdir().unwrap();
    // The poller's call hangs with children.
    let (mut agent, http) = agent_with_a_command_that_hangs_after_one_answer(
        dir.path(),
        "    sleep 1000 &\n    sh -c 'sleep 1000; true' &\n    wait",
    );
    // Wait until the poller's hanging call has started its children.
    let start = Instant::now();
    let hanging = loop {
        let groups = recorded_groups(dir.path());
        if let Some(&g) = groups.get(1) {
            if alive_in_group(g).len() >= 3 {
                break g;
            }
        }
        assert!(start.elapsed() < LONG, "the poller never called again");
        std::thread::sleep(Duration::from_millis(20));
    };
    drop(http);
    let status = agent.terminate();
    assert!(status.success(), "{status}");
    let survivors = survivors_after(&[hanging], Duration::from_secs(10));
    assert!(
        survivors.is_empty(),
        "processes of a command outlived the agent: {survivors:?}"
    );
}

#[test]
fn a_command_dies_with_an_agent_killed_without_clean_up() {
    let dir = tempfile::tempdir().unwrap();
    // The poller's call records its pid and hangs.
    let (mut agent, http) = agent_with_a_command_that_hangs_after_one_answer(
        dir.path(),
        "    echo $$ > \"$1/hanging.tmp\" && mv \"$1/hanging.tmp\" \"$1/hanging\"\n    while :; do sleep 1; done",
    );
    let start = Instant::now();
    let pid: i32 = loop {
        if let Ok(text) = std::fs::read_to_string(dir.path().join("hanging")) {
            break text.trim().parse().unwrap();
        }
        assert!(start.elapsed() < LONG, "the poller never called again");
        std::thread::sleep(Duration::from_millis(20));
    };
    let group = alive_in_group(pid);
    assert!(
        group.contains(&pid),
        "the hanging command {pid} is not running"
    );
    drop(http);
    // SIGKILL: the agent runs no clean-up; the kernel's parent-death signal must.
    agent.kill9();
    let survivors = survivors_after(&[pid], Duration::from_secs(10));
    // The loop's `sleep 1` may outlive its shell by up to a second; the shell must not.
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    assert!(
        !survivors.contains(&pid),
        "the command outlived the SIGKILLed agent: {survivors:?}"
    );
}

#[test]
fn the_answer_is_taken_when_the_command_exits_though_a_child_keeps_stdout_open() {
    let dir = tempfile::tempdir().unwrap();
    let background = script(
        dir.path(),
        "background.sh",
        &format!(
            r#"{RECORD_GROUP}
sleep 1000 &
echo '{{"completed":true,"nCompleted":2,"nTotal":2,"operationUnits":"file"}}'
"#
        ),
    );
    let agent = agent_with_command(
        dir.path(),
        &[background.to_str().unwrap(), dir.path().to_str().unwrap()],
        &["--call-deadline", "60s"],
    );
    let mut http = RawHttp::connect(&agent.socket);
    let started = Instant::now();
    let owner = run_backup(&mut http, "b", &["op-1"]);
    assert_eq!(owner["phase"], "Finalizing", "{owner}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "the answer waited for the deadline"
    );
    let ops = operations(&mut http, "b");
    assert_eq!(ops[0]["phase"], "Completed");
    assert_eq!(ops[0]["nCompleted"], 2);
    let groups = recorded_groups(dir.path());
    let survivors = survivors_after(&groups, Duration::from_secs(10));
    assert!(
        survivors.is_empty(),
        "the command's background child outlived it: {survivors:?}"
    );
}

#[test]
fn a_command_sees_exactly_the_documented_environment_and_its_params_on_stdin() {
    let dir = tempfile::tempdir().unwrap();
    let env = script(
        dir.path(),
        "env.sh",
        r#"tr '\0' '\n' < /proc/$$/environ > "$1/env-$4"
cat > "$1/stdin-$4"
echo '{"completed":true}'
"#,
    );
    let agent = agent_with_command(
        dir.path(),
        &[env.to_str().unwrap(), dir.path().to_str().unwrap()],
        &[],
    );
    let mut http = RawHttp::connect(&agent.socket);
    let owner = run_backup(&mut http, "b", &["op-1"]);
    assert_eq!(owner["phase"], "Finalizing", "{owner}");
    let mut seen: Vec<String> = std::fs::read_to_string(dir.path().join("env-op-1"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    seen.sort();
    let mut expected = vec![
        "OPMON_OWNER_KIND=backup".to_string(),
        "OPMON_OWNER_NAME=b".into(),
        "OPMON_OWNER_UID=u-1".into(),
        format!("OPMON_PLUGIN={PLUGIN}"),
        "OPMON_PLUGIN_KIND=BackupItemAction".into(),
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
    ];
    expected.sort();
    assert_eq!(
        seen, expected,
        "the environment is exactly the documented one"
    );
    let stdin: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("stdin-op-1")).unwrap()).unwrap();
    assert_eq!(
        stdin,
        json!({"plugin": {"kind": "BackupItemAction", "name": PLUGIN}, "operationId": "op-1",
               "owner": {"kind": "backup", "name": "b", "uid": "u-1"}}),
        "stdin holds the params a socket snapshotter gets"
    );
}

/// The peak resident set size of `pid`, in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/<pid>/status");
    kib * 1024
}

fn agent_pid(agent: &Agent) -> u32 {
    let lock = agent.state_dir.join("agent.db.lock");
    std::fs::read_to_string(lock)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn what_a_command_prints_is_bounded() {
    let dir = tempfile::tempdir().unwrap();
    // flood-*: 1 GiB on stdout; loud-*: 256 MiB on stderr, then a last line.
    let flood = script(
        dir.path(),
        "flood.sh",
        r#"case "$3" in
flood-*) head -c 1073741824 /dev/zero ;;
loud-*) head -c 268435456 /dev/zero >&2; printf "\nthe last line\n\n" >&2; exit 3 ;;
esac
"#,
    );
    let agent = agent_with_command(dir.path(), &[flood.to_str().unwrap()], &[]);
    let mut http = RawHttp::connect(&agent.socket);
    let owner = run_backup(&mut http, "b", &["flood-1", "loud-2"]);
    assert_eq!(owner["phase"], "FinalizingPartiallyFailed", "{owner}");
    let ops = operations(&mut http, "b");
    assert_eq!(
        ops[0]["error"],
        format!("snapshotter {PLUGIN} printed more than 16777216 bytes on stdout")
    );
    assert_eq!(
        ops[1]["error"],
        format!("snapshotter {PLUGIN} progress loud-2 failed (exit status: 3): the last line")
    );
    let peak = peak_rss(agent_pid(&agent));
    assert!(
        peak < 200 * 1024 * 1024,
        "the agent's peak RSS was {} MiB",
        peak / 1024 / 1024
    );
}

#[test]
fn only_the_operator_lets_clients_register_command_snapshotters() {
    let dir = tempfile::tempdir().unwrap();
    let ok = script(dir.path(), "ok.sh", "echo '{\"completed\":true}'\n");
    let register = request(
        "snapshotter.register",
        json!({"name": "example.io/api", "apiVersion": "v2", "command": [ok.to_str().unwrap()]}),
    );
    let socket = dir.path().join("run/agent.sock");
    let state = dir.path().join("state");

    // By default, refused, saying why and which setting allows it.
    let agent = Agent::start_at(dir.path(), &socket, &state, &[]);
    let mut http = RawHttp::connect(&agent.socket);
    let answer = http.call(&register);
    assert_eq!(
        answer["error"],
        json!({"code": -32602, "message": "command: only the config file may register a command \
            snapshotter (it runs a program as the agent's user); set \
            allow_api_command_snapshotters = true in the agent's configuration to allow it over \
            the API"}),
        "{answer}"
    );
    let list = http.call(&request("snapshotter.list", json!({})));
    assert_eq!(list["result"], json!([]), "nothing was registered");
    drop(http);
    drop(agent);

    // Allowed by the operator: registered and run.
    let agent = Agent::start_at(
        dir.path(),
        &socket,
        &state,
        &["--allow-api-command-snapshotters", "true"],
    );
    let mut http = RawHttp::connect(&agent.socket);
    let answer = http.call(&register);
    assert_eq!(answer["result"]["name"], "example.io/api", "{answer}");
    drop(http);
    drop(agent);

    // No longer allowed: the one left in the database is not run.
    let agent = Agent::start_at(dir.path(), &socket, &state, &[]);
    let mut http = RawHttp::connect(&agent.socket);
    http.call(&request("backup.start", json!({"name": "b", "uid": "u"})));
    let mut op = operation("x-1");
    op["plugin"]["name"] = json!("example.io/api");
    http.call(&request(
        "backup.addOperations",
        json!({"name": "b", "operations": [op]}),
    ));
    let ended = http.call(&request("backup.endInProgress", json!({"name": "b"})));
    assert_eq!(
        ended["result"]["phase"], "FinalizingPartiallyFailed",
        "{ended}"
    );
    assert_eq!(
        operations(&mut http, "b")[0]["error"],
        "snapshotter example.io/api runs a command, which only the config file may register \
         (allow_api_command_snapshotters is false)"
    );
}

#[test]
fn an_operation_id_reaches_a_command_after_double_dash_never_as_an_option() {
    let dir = tempfile::tempdir().unwrap();
    // Records its arguments, one per line, then answers.
    let args = script(
        dir.path(),
        "args.sh",
        r#"out=$1; shift
printf '%s\n' "$@" >> "$out/args"
echo '{"completed":true}'
"#,
    );
    let agent = agent_with_command(
        dir.path(),
        &[args.to_str().unwrap(), dir.path().to_str().unwrap()],
        &[],
    );
    let mut http = RawHttp::connect(&agent.socket);
    let owner = run_backup(&mut http, "b", &["--kubeconfig=/tmp/attacker/config"]);
    assert_eq!(owner["phase"], "Finalizing", "{owner}");
    let seen = std::fs::read_to_string(dir.path().join("args")).unwrap();
    assert_eq!(seen, "progress\n--\n--kubeconfig=/tmp/attacker/config\n");
}

#[test]
fn impossible_counts_from_a_snapshotter_are_clamped_and_said_on_the_operation() {
    let dir = tempfile::tempdir().unwrap();
    let liar = script(
        dir.path(),
        "liar.sh",
        r#"case "$3" in
over-*) echo '{"completed":false,"nCompleted":12,"nTotal":10,"started":"2026-01-01T00:00:00Z"}' ;;
neg-*) echo '{"completed":false,"nCompleted":-5,"nTotal":-1,"started":"2026-01-01T00:00:00Z"}' ;;
esac
"#,
    );
    let agent = agent_with_command(dir.path(), &[liar.to_str().unwrap()], &[]);
    let mut http = RawHttp::connect(&agent.socket);
    let owner = run_backup(&mut http, "b", &["over-1", "neg-2"]);
    assert_eq!(owner["phase"], "WaitingForPluginOperations", "{owner}");
    let ops = operations(&mut http, "b");
    assert_eq!(
        (&ops[0]["nCompleted"], &ops[0]["nTotal"]),
        (&json!(10), &json!(10))
    );
    assert_eq!(
        ops[0]["lastError"],
        "the snapshotter reported an impossible progress (nCompleted 12, nTotal 10): shown as 10 of 10"
    );
    assert_eq!(
        (&ops[1]["nCompleted"], &ops[1]["nTotal"]),
        (&json!(0), &json!(0))
    );
    assert_eq!(
        ops[1]["lastError"],
        "the snapshotter reported an impossible progress (nCompleted -5, nTotal -1): shown as 0 of 0"
    );
}
