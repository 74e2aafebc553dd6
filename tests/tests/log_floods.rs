//! End-to-end: log lines a peer or a plugin can make repeat stay within a budget, and a
//! line says how many were left out. Against the real agent, with plugins that flood
//! (`/bin/sh -c …` registered as a Velero plugin or a command snapshotter) and
//! operations failing for a plugin nobody registered.

use std::time::Duration;

use opmon_tests::{eventually, Agent, RawHttp};
use serde_json::{json, Value};

const LONG: Duration = Duration::from_secs(60);
/// Lines of one kind the agent may log before its summary; far below any flood here.
const BOUND: usize = 100;

fn request(method: &str, params: Value) -> String {
    json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string()
}

/// The numbers `unlogged=N` in `lines`, summed.
fn unlogged(lines: &[&str]) -> usize {
    lines
        .iter()
        .filter_map(|l| {
            l.split("unlogged=")
                .nth(1)?
                .split(' ')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .sum()
}

/// A Velero plugin that prints 100,000 lines on stderr and exits before its handshake:
/// the log holds a bounded number of them and a line with the count of the rest, and
/// the registration's error names the plugin's last output.
#[test]
fn a_plugin_flooding_stderr_is_logged_within_a_bound_with_a_count() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &["--allow-api-command-snapshotters", "true"]);
    let mut http = RawHttp::connect(&agent.socket);
    let lines = 100_000;
    let script = format!("yes flood-line | head -n {lines} >&2; echo last-words >&2; exit 3");
    let answer = http.call(&request(
        "snapshotter.register",
        json!({"name": "example.io/flood", "apiVersion": "v2", "veleroPlugin": "/bin/sh",
               "args": ["-c", script]}),
    ));
    let log = agent.log_text();
    let own: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("stream=\"stderr\"") && l.contains("velero_plugin=sh"))
        .collect();
    assert!(
        own.len() <= BOUND,
        "{} lines of the plugin logged",
        own.len()
    );
    let summaries: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("more lines of a Velero plugin's output were not logged one by one"))
        .collect();
    assert_eq!(own.len() + unlogged(&summaries), lines + 1, "{summaries:?}");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("exited before its handshake") && message.contains("last-words"),
        "{answer}"
    );
}

/// 300 operations of a plugin nobody registered fail at once: a bounded number of
/// "operation failed" lines, and one line with the count of the rest, written at the
/// latest when the agent stops.
#[test]
fn operations_failing_for_one_cause_are_logged_within_a_bound_with_a_count() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(dir.path(), &[]);
    let mut http = RawHttp::connect(&agent.socket);
    let count = 300;
    let started = http.call(&request(
        "backup.start",
        json!({"name": "b1", "uid": "uid-b1"}),
    ));
    assert!(started.get("result").is_some(), "{started}");
    let ops: Vec<Value> = (0..count)
        .map(|i| {
            json!({"plugin": {"kind": "BackupItemAction", "name": "example.io/nobody"},
                   "resource": {"resource": "persistentvolumeclaims", "namespace": "app", "name": format!("p{i}")},
                   "operationId": format!("op-{i}")})
        })
        .collect();
    let added = http.call(&request(
        "backup.addOperations",
        json!({"name": "b1", "operations": ops}),
    ));
    assert_eq!(added["result"]["added"], count, "{added}");
    let ended = http.call(&request("backup.endInProgress", json!({"name": "b1"})));
    assert!(ended.get("result").is_some(), "{ended}");
    eventually("the operations fail", LONG, || {
        let operations = http.call(&request("backup.operations", json!({"name": "b1"})));
        let all = operations["result"].as_array().cloned().unwrap_or_default();
        (all.len() == count && all.iter().all(|o| o["phase"] == "Failed")).then_some(())
    });
    // The count not yet written when the agent stops is written as it stops.
    drop(http);
    assert!(agent.terminate().success());
    let log = agent.log_text();
    let failed: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("operation failed") && l.contains("example.io/nobody"))
        .collect();
    assert!(failed.len() <= BOUND, "{} failure lines", failed.len());
    let summaries: Vec<&str> = log
        .lines()
        .filter(|l| {
            l.contains(
                "more lines of operations retried, recovered or ended were not logged one by one",
            )
        })
        .collect();
    assert_eq!(failed.len() + unlogged(&summaries), count, "{summaries:?}");
}
