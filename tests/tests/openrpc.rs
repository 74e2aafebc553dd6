//! The API's OpenRPC documents: generated from the Rust types, checked in, served by
//! `rpc.discover`, and every request and response of a real agent's traffic validated
//! against them by an independent validator (Python's `jsonschema`), which also drives
//! a backup to Completed from the checked-in document alone.

use std::path::{Path, PathBuf};

use opmon_client::openrpc;
use serde_json::Value;

/// The checked-in document `name` under client/openrpc/.
fn checked_in(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../client/openrpc")
        .join(name)
}

/// Compares the checked-in `name` with `generated`, or rewrites it with `OPMON_BLESS=1`.
fn check_or_bless(name: &str, generated: Value) {
    let path = checked_in(name);
    if std::env::var_os("OPMON_BLESS").is_some_and(|v| v == "1") {
        let text = serde_json::to_string_pretty(&generated).expect("serializing") + "\n";
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        return;
    }
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let stored: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        stored == generated,
        "{} differs from the document generated from the API types; regenerate it with \
         `OPMON_BLESS=1 cargo test -p opmon-tests --test openrpc` and review the diff",
        path.display()
    );
}

#[test]
fn checked_in_agent_document_is_the_generated_one() {
    check_or_bless("opmon.json", openrpc::agent_document());
}

#[test]
fn checked_in_snapshotter_document_is_the_generated_one() {
    check_or_bless("snapshotter.json", openrpc::snapshotter_document());
}

/// Every `description` of `value`, at any depth.
fn descriptions<'v>(value: &'v Value, found: &mut Vec<&'v str>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("description", Value::String(text)) => found.push(text),
                    _ => descriptions(v, found),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| descriptions(v, found)),
        _ => {}
    }
}

/// The documents' descriptions come from the Rust doc comments; a reader of the
/// document has no Rust, so no description may point into the crate (rustdoc's
/// ``[`crate::…`]`` links) instead of saying what it means.
#[test]
fn no_description_refers_to_rust_items() {
    for document in [openrpc::agent_document(), openrpc::snapshotter_document()] {
        let mut found = Vec::new();
        descriptions(&document, &mut found);
        assert!(found.len() >= 10, "{} descriptions", found.len());
        let rusty: Vec<_> = found
            .iter()
            .filter(|d| d.contains("[`") || d.contains("crate::") || d.contains("Self::"))
            .collect();
        assert!(
            rusty.is_empty(),
            "descriptions naming Rust items: {rusty:#?}"
        );
    }
}

/// The agent's limit on a request in the Python run: small, so the oversized request
/// the program sends stays small too.
const MAX_REQUEST: usize = 256 * 1024;

/// Runs drive.py against a fresh agent with `document` as the agent's document.
fn run_python(dir: &Path, document: &Path) -> (std::process::Output, opmon_tests::Agent) {
    let state = dir.join("python");
    std::fs::create_dir(&state).expect("python state directory");
    let max = MAX_REQUEST.to_string();
    let agent = opmon_tests::Agent::start(
        dir,
        &[
            "--allow-api-command-snapshotters",
            "true",
            "--max-request-size",
            &max,
        ],
    );
    let output = std::process::Command::new("python3")
        .arg(script())
        .arg("drive")
        .arg("--socket")
        .arg(&agent.socket)
        .arg("--document")
        .arg(document)
        .arg("--snapshotter-document")
        .arg(checked_in("snapshotter.json"))
        .arg("--state")
        .arg(&state)
        .arg("--oversized")
        .arg((MAX_REQUEST + 1).to_string())
        .output()
        .expect("running python3 (with the jsonschema package: .ci/run installs it)");
    (output, agent)
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("openrpc/drive.py")
}

/// Runs tests/openrpc/drive.py against a real agent: it validates every request and
/// response (and subscription notification, and the snapshotter calls it answers as the
/// command snapshotter) against the checked-in documents with Python's `jsonschema`, and
/// drives backup `b1` to Completed from the documents alone.
#[tokio::test]
async fn a_python_client_written_from_the_document_drives_a_backup_to_completed() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let (output, agent) = run_python(dir.path(), &checked_in("opmon.json"));
    let script = script();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{} failed ({}):\n{stderr}\n{stdout}\nagent log:\n{}",
        script.display(),
        output.status,
        agent.log_text()
    );
    let summary: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("summary line of {}: {e}: {stdout}", script.display()));
    eprintln!("validated against the OpenRPC documents: {summary}");
    // Every method of the document was called (both kinds), and each of these counts
    // is what the program's fixed script sends: a change in them is a change in the run.
    let count = |what: &str| summary[what].as_u64().unwrap_or(0);
    assert_eq!(summary["uncalled"], serde_json::json!([]), "{summary}");
    assert!(count("requests") >= 50, "{summary}");
    assert_eq!(count("responses"), count("requests") + count("refused") + 2);
    assert!(count("notifications") >= 2, "{summary}");
    assert!(count("snapshotterCalls") >= 3, "{summary}");

    // Read back over the Rust client, independently of the program's own checks.
    let answer = opmon_tests::RawHttp::connect(&agent.socket)
        .call(r#"{"jsonrpc":"2.0","id":1,"method":"backup.get","params":{"name":"b1"}}"#);
    let b1: opmon_client::Owner =
        serde_json::from_value(answer["result"].clone()).expect("backup b1");
    assert_eq!(b1.phase, opmon_client::OwnerPhase::Completed);
    assert_eq!(b1.operations_completed, 2);
}

/// `agent.status` says which API version and optional features the agent has, and a
/// status without them (an older agent's) still parses, with both empty.
#[tokio::test]
async fn status_reports_api_version_and_features_and_an_older_status_still_parses() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let agent = opmon_tests::Agent::start(dir.path(), &[]);
    let answer = opmon_tests::RawHttp::connect(&agent.socket)
        .call(r#"{"jsonrpc":"2.0","id":1,"method":"agent.status"}"#);
    let status: opmon_client::AgentStatus =
        serde_json::from_value(answer["result"].clone()).expect("agent.status");
    assert_eq!(status.api_version, opmon_client::methods::API_VERSION);
    assert_eq!(
        status.features,
        [
            "restore_finalize",
            "server.started",
            "object",
            "created",
            "failureReason",
            "finalize_counts",
            "openrpc",
            "cancel",
            "deadlines",
            "retries",
            "events",
            "rate",
            "snapshotter.changed",
            "retire"
        ]
    );
    let older: opmon_client::AgentStatus = serde_json::from_str(
        r#"{"version":"0.1.0","uptime":"5s","owners":{"Completed":2},"unfinishedOperations":0,"snapshotters":1}"#,
    )
    .expect("an older agent's status");
    assert_eq!(older.api_version, "");
    assert!(older.features.is_empty());
}

/// The validator is not a rubber stamp: with a document that drifted from the agent
/// (here, an owner phase missing from the schema), the same run fails, naming where.
#[tokio::test]
async fn the_python_validator_fails_on_a_document_that_drifted() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut document: Value = serde_json::from_str(openrpc::AGENT_DOCUMENT).expect("document");
    let phases = &mut document["components"]["schemas"]["OwnerPhase"]["oneOf"][0]["enum"];
    let list = phases.as_array_mut().expect("the OwnerPhase enum");
    let before = list.len();
    list.retain(|p| p != "Completed");
    assert_eq!(list.len(), before - 1, "Completed was in the enum");
    let drifted = dir.path().join("drifted.json");
    std::fs::write(&drifted, document.to_string()).expect("writing the drifted document");
    let (output, _agent) = run_python(dir.path(), &drifted);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "the run passed with a drifted document"
    );
    assert!(
        stderr.contains("AssertionError: result of backup.finalize does not match the document: "),
        "{stderr}"
    );
}

/// Runs tests/openrpc/traffic.py on `logs` with `document`.
fn validate_traffic(document: &Path, log: &Path) -> std::process::Output {
    std::process::Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("openrpc/traffic.py"))
        .arg(document)
        .arg(log)
        .output()
        .expect("running python3 (with the jsonschema package: .ci/run installs it)")
}

/// The harness validates every agent's logged traffic against the checked-in document
/// when it drops the agent (tests/src/traffic.rs). Here the same validator reads one
/// agent's log: calls, a batch, a call sent wrong, a method the document does not list
/// and subscription notifications are all there and pass; with a document that drifted
/// (an owner phase gone), the same log fails, naming the line.
#[tokio::test]
async fn the_logged_traffic_of_an_agent_is_validated_and_a_drifted_document_fails_it() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let agent = opmon_tests::Agent::start(dir.path(), &[]);
    let client = agent.client().await;
    opmon_tests::Steps::new(&client, opmon_client::OwnerKind::Backup, "b")
        .start()
        .await;
    let mut updates = client.backups().subscribe("b").await.expect("subscribing");
    let first = updates.next().await.expect("an update").expect("no error");
    assert_eq!(first.owner.phase, opmon_client::OwnerPhase::InProgress);
    let mut http = opmon_tests::RawHttp::connect(&agent.socket);
    let (status, body) = http.post(
        br#"[{"jsonrpc":"2.0","id":1,"method":"backup.get","params":{"name":"b"}},
             {"jsonrpc":"2.0","id":2,"method":"backup.get","params":{"name":7}},
             {"jsonrpc":"2.0","id":3,"method":"no.such.method"}]"#,
    );
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""id":2,"error":{"code":-32602"#), "{body}");
    drop(updates);
    drop(client);

    let output = validate_traffic(&checked_in("opmon.json"), &agent.log);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary: Value = serde_json::from_str(stdout.trim()).expect("summary line");
    assert!(summary["notifications"].as_u64() >= Some(1), "{summary}");
    // The batch's refused and unknown calls are errors the document lists.
    assert!(summary["errors"].as_u64() >= Some(2), "{summary}");
    assert!(summary["exchanges"].as_u64() >= Some(4), "{summary}");

    let mut document: Value = serde_json::from_str(openrpc::AGENT_DOCUMENT).expect("document");
    let phases = &mut document["components"]["schemas"]["OwnerPhase"]["oneOf"][0]["enum"];
    phases
        .as_array_mut()
        .expect("the OwnerPhase enum")
        .retain(|p| p != "InProgress");
    let drifted = dir.path().join("drifted.json");
    std::fs::write(&drifted, document.to_string()).expect("writing the drifted document");
    let output = validate_traffic(&drifted, &agent.log);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("agent.log:") && stderr.contains("does not match the document"),
        "{stderr}"
    );
}
