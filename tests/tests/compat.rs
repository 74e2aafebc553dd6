//! Compatibility: a client of an older API version still works against today's agent.
//!
//! The requests below are the bytes the Rust client of `apiVersion` 1.1.0 sent (commit
//! 5460897, the last with that version: its `client/src/client.rs` builds the envelope,
//! `types.rs` the params, in their fields' order). They are replayed raw on today's
//! agent's socket, with that client's HTTP head, and every answer is checked against the
//! shapes that client knew: the OpenRPC document generated from its types
//! (`tests/compat/opmon-1.1.0.json`), by the validator that checks the suite's traffic
//! (`tests/openrpc/traffic.py`). That document says what the old client's serde would
//! refuse: a field it required and no longer gets, an enum value it did not know, a
//! field added to a struct it decoded with `deny_unknown_fields` (`Snapshotter`). A
//! subscription is made as that client made it, over WebSocket. The policy this holds
//! the agent to is docs/compatibility.md.

use std::path::Path;

use opmon_tests::{open_gate, Agent, RawHttp, SdkSnapshotter};
use serde_json::Value;

/// The OpenRPC document of API 1.1.0, as `rpc.discover` answered it then.
fn old_document() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("compat/opmon-1.1.0.json")
}

/// One request as the 1.1.0 client serialized it: `{"jsonrpc","id","method","params"}`.
fn request(id: u64, method: &str, params: &str) -> String {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"{method}","params":{params}}}"#)
}

/// A PVC as the 1.1.0 client's `ResourceIdentifier` serialized it.
fn pvc(name: &str) -> String {
    format!(
        r#"{{"group":"","resource":"persistentvolumeclaims","namespace":"app","name":"{name}"}}"#
    )
}

/// A `NewOperation` of the 1.1.0 client. One that completes at its first poll says when
/// it was created; on one that waits, that would start its item operation timeout.
fn new_operation(kind: &str, id: &str, item: &str, post: &[&str]) -> String {
    let post: Vec<String> = post.iter().map(|p| pvc(p)).collect();
    let created = if id.starts_with("done-") {
        r#","created":"2026-11-22T18:00:00Z""#
    } else {
        ""
    };
    format!(
        r#"{{"plugin":{{"kind":"{kind}","name":"example.io/copier"}},"resource":{},"operationId":"{id}","postOperationItems":[{}]{created}}}"#,
        pvc(item),
        post.join(",")
    )
}

/// The old client's calls, numbered as it numbered them.
struct OldClient {
    http: RawHttp,
    next_id: u64,
}

impl OldClient {
    /// Sends `method` with `params` (JSON text) and returns the whole answer.
    fn send(&mut self, method: &str, params: &str) -> Value {
        self.next_id += 1;
        // RawHttp sends the head the 1.1.0 client's hyper request had: POST /, Host:
        // localhost, Content-Type: application/json, Content-Length.
        self.http.call(&request(self.next_id, method, params))
    }

    /// [`OldClient::send`], expecting a result.
    fn call(&mut self, method: &str, params: &str) -> Value {
        let answer = self.send(method, params);
        assert!(answer.get("error").is_none(), "{method} {params}: {answer}");
        answer["result"].clone()
    }
}

/// A subscription as the 1.1.0 client made it: a WebSocket handshake as tokio-tungstenite
/// writes it, then `{"id":1,…}` with its keys in serde_json's order. Returns the
/// answer and the first notification.
fn old_subscription(socket: &Path, kind: &str, name: &str) -> (Value, Value) {
    use std::io::{Read, Write};
    let mut ws = std::os::unix::net::UnixStream::connect(socket).expect("connecting");
    ws.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .expect("read timeout");
    ws.write_all(
        b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
          Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
    )
    .expect("handshake");
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        ws.read_exact(&mut byte).expect("handshake answer");
        head.push(byte[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    let text = format!(
        r#"{{"id":1,"jsonrpc":"2.0","method":"{kind}.subscribe","params":{{"name":"{name}"}}}}"#
    );
    // One masked text frame (a zero mask leaves the bytes as they are).
    let mut frame = vec![0x81u8, 0x80 | 127];
    frame.extend_from_slice(&(text.len() as u64).to_be_bytes());
    frame.extend_from_slice(&[0, 0, 0, 0]);
    frame.extend_from_slice(text.as_bytes());
    ws.write_all(&frame).expect("subscribe");
    let mut receive = || {
        let mut h = [0u8; 2];
        ws.read_exact(&mut h).expect("a frame");
        let n = match h[1] & 0x7f {
            126 => {
                let mut b = [0u8; 2];
                ws.read_exact(&mut b).expect("a length");
                u16::from_be_bytes(b) as usize
            }
            127 => {
                let mut b = [0u8; 8];
                ws.read_exact(&mut b).expect("a length");
                u64::from_be_bytes(b) as usize
            }
            n => n as usize,
        };
        let mut payload = vec![0; n];
        ws.read_exact(&mut payload).expect("a payload");
        serde_json::from_slice::<Value>(&payload).expect("a JSON message")
    };
    (receive(), receive())
}

#[test]
fn the_requests_of_a_1_1_0_client_work_and_their_answers_fit_its_shapes() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let gates = dir.path().join("gates");
    std::fs::create_dir(&gates).expect("gates directory");
    let snapshotter =
        SdkSnapshotter::start(dir.path(), "copier", &gates, &dir.path().join("journal"));
    let agent = Agent::start(dir.path(), &[]);
    let mut old = OldClient {
        http: RawHttp::connect(&agent.socket),
        next_id: 0,
    };
    let socket = snapshotter.socket.display().to_string();

    let status = old.call("agent.status", "{}");
    assert_eq!(status["apiVersion"].as_str().map(|v| &v[..2]), Some("1."));
    old.call("rpc.discover", "{}");
    // Registered as that client's `Snapshotter` serialized it, with its deadlines.
    let registered = old.call(
        "snapshotter.register",
        &format!(r#"{{"name":"example.io/copier","apiVersion":"v2","socket":"{socket}"}}"#),
    );
    assert_eq!(registered["name"], "example.io/copier");
    old.call(
        "snapshotter.register",
        &format!(
            r#"{{"name":"example.io/other","apiVersion":"v2","socket":"{socket}","stallTimeout":"10m0s","startTimeout":"5m0s","retryAttempts":3,"retryBackoff":"2s","retryWithin":"10m0s"}}"#
        ),
    );
    let listed = old.call("snapshotter.list", "{}");
    assert_eq!(listed.as_array().map(Vec::len), Some(2), "{listed}");
    old.call("snapshotter.unregister", r#"{"name":"example.io/other"}"#);

    // A backup through every step, with each optional param that client had.
    old.call(
        "backup.start",
        r#"{"name":"old-b","uid":"uid-old-b","itemOperationTimeout":"1h0m0s","stallTimeout":"30m0s","startTimeout":"10m0s","object":{"apiVersion":"velero.io/v1","kind":"Backup"},"server":{"name":"velero","instance":"pod-1"}}"#,
    );
    let added = old.call(
        "backup.addOperations",
        &format!(
            r#"{{"name":"old-b","operations":[{},{}]}}"#,
            new_operation("BackupItemAction", "done-1", "data", &["vsb-data"]),
            new_operation("BackupItemAction", "gate-2", "logs", &[])
        ),
    );
    assert_eq!(
        (&added["added"], &added["alreadyKnown"]),
        (&2.into(), &0.into())
    );
    old.call(
        "backup.endInProgress",
        r#"{"name":"old-b","errors":0,"warnings":1,"failed":false}"#,
    );
    old.call(
        "backup.operations",
        r#"{"name":"old-b","phases":["InProgress"]}"#,
    );
    let (answer, first) = old_subscription(&agent.socket, "backup", "old-b");
    assert!(answer["error"].is_null(), "{answer}");
    assert_eq!(first["method"], "backup.changed", "{first}");
    assert_eq!(
        first["params"]["result"]["owner"]["name"], "old-b",
        "{first}"
    );
    open_gate(&gates, "gate-2");
    let waited = old.call(
        "backup.wait",
        r#"{"name":"old-b","until":"readyToFinalize","timeout":"30s"}"#,
    );
    assert_eq!(waited["timedOut"], false, "{waited}");
    assert_eq!(waited["owner"]["phase"], "Finalizing", "{waited}");
    old.call("backup.operations", r#"{"name":"old-b"}"#);
    old.call("backup.itemOperations", r#"{"name":"old-b"}"#);
    let finalized = old.call("backup.finalize", r#"{"name":"old-b"}"#);
    assert_eq!(finalized["owner"]["phase"], "Completed", "{finalized}");
    old.call("backup.get", r#"{"name":"old-b"}"#);
    old.call("backup.list", r#"{"phases":["Completed"],"limit":10}"#);
    let events = old.call("backup.events", r#"{"name":"old-b","limit":100}"#);
    assert!(events["items"].as_array().is_some_and(|e| !e.is_empty()));

    // A restore that passes through Finalizing, one operation canceled.
    old.call(
        "restore.start",
        r#"{"name":"old-r","uid":"uid-old-r","finalize":true}"#,
    );
    old.call(
        "restore.addOperations",
        &format!(
            r#"{{"name":"old-r","operations":[{},{}]}}"#,
            new_operation("RestoreItemAction", "done-r1", "data", &[]),
            new_operation("RestoreItemAction", "gate-r2", "logs", &[])
        ),
    );
    old.call(
        "restore.endInProgress",
        r#"{"name":"old-r","errors":0,"warnings":0,"failed":false}"#,
    );
    let canceled = old.call(
        "restore.cancel",
        r#"{"name":"old-r","operations":["gate-r2"],"reason":"an operator said so"}"#,
    );
    assert_eq!(canceled["canceled"], 1, "{canceled}");
    let waited = old.call(
        "restore.wait",
        r#"{"name":"old-r","until":"readyToFinalize","timeout":"30s"}"#,
    );
    assert_eq!(waited["timedOut"], false, "{waited}");
    let finalized = old.call("restore.finalize", r#"{"name":"old-r","warnings":2}"#);
    assert_eq!(
        finalized["owner"]["phase"], "PartiallyFailed",
        "{finalized}"
    );
    old.call("server.started", r#"{"name":"velero","instance":"pod-2"}"#);

    // Errors come with the codes that client branched on.
    let missing = old.send("backup.get", r#"{"name":"no-such-backup"}"#);
    assert_eq!(missing["error"]["code"], 1001, "{missing}");
    // `delete` still answers `cancelled`, the only name that client read.
    let deleted = old.call("backup.delete", r#"{"name":"old-b"}"#);
    assert_eq!(deleted["cancelled"], 0, "{deleted}");
    old.call("restore.delete", r#"{"name":"old-r"}"#);
    let calls = old.next_id;
    drop(old);

    // Every answer above, as that client's types would have decoded it.
    let probe = std::process::Command::new("python3")
        .args(["-c", "import jsonschema"])
        .output();
    if !probe.is_ok_and(|out| out.status.success()) {
        opmon_tests::skip("checking the answers needs python3 with jsonschema");
        return;
    }
    let output = std::process::Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("openrpc/traffic.py"))
        .arg(old_document())
        .arg(&agent.log)
        .output()
        .expect("running python3 (with the jsonschema package: .ci/run installs it)");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary: Value = serde_json::from_str(stdout.trim()).expect("summary line");
    // The calls above, the subscription and its notifications.
    assert!(summary["exchanges"].as_u64() > Some(calls), "{summary}");
    assert!(summary["notifications"].as_u64() >= Some(1), "{summary}");
}
