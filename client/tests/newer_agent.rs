//! The client against an agent newer than itself: answers with phases, kinds and
//! fields this version does not know still decode, and error answers keep the agent's
//! code and `data`. The "agent" is a Unix socket that answers each request with a
//! fixed HTTP response, as a newer agent would word it.

use std::path::Path;

use opmon_client::codes::Code;
use opmon_client::methods::Feature;
use opmon_client::{Client, EventReason, OperationPhase, OwnerPhase, PluginKind};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;

/// An owner as an agent with a new owner phase (`Archived`), a new plugin kind and new
/// fields would send it.
const NEWER_OWNER: &str = r#"{
    "kind": "backup", "name": "b", "uid": "u", "phase": "Archived", "failureReason": "",
    "itemOperationTimeout": "4h0m0s", "finalize": true, "errors": 0, "warnings": 0,
    "operationsAttempted": 1, "operationsCompleted": 0, "operationsFailed": 0,
    "postOperationItems": null, "created": "2026-11-25T10:00:00Z",
    "updated": "2026-11-25T10:00:01Z", "completed": null,
    "archivedTo": "s3://bucket/b", "retention": {"days": 30}
}"#;

const NEWER_OPERATIONS: &str = r#"[{
    "plugin": {"kind": "ObjectStorePlugin", "name": "example.io/copier"},
    "resource": {"group": "", "resource": "pods", "namespace": "app", "name": "p"},
    "operationId": "x", "postOperationItems": [], "phase": "Paused", "error": "",
    "nCompleted": 1, "nTotal": 2, "operationUnits": "", "description": "",
    "created": "2026-11-25T10:00:00Z", "started": null, "updated": null,
    "cancelRequested": false, "attempts": 0,
    "lastError": "", "pausedBy": "operator"
}]"#;

/// A page of history with a reason this version does not know, beside a known one.
const NEWER_EVENTS: &str = r#"{"items": [
    {"seq": 1, "time": "2026-11-25T10:00:00Z", "reason": "Started", "operation": null,
     "caller": null, "message": "started"},
    {"seq": 2, "time": "2026-11-25T10:00:01Z", "reason": "Archived", "operation": null,
     "caller": null, "message": "archived to s3://bucket/b", "archive": "s3://bucket/b"}
], "next": null}"#;

/// Serves `socket`, answering each request with the JSON-RPC answer `answer` gives for
/// its body.
fn serve(socket: &Path, answer: fn(&str) -> String) {
    let listener = UnixListener::bind(socket).expect("binding the test socket");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut stream = BufReader::new(stream);
                loop {
                    let mut length = 0;
                    loop {
                        let mut line = String::new();
                        if stream.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        let lower = line.to_ascii_lowercase();
                        if let Some(v) = lower.strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap_or(0);
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    let mut body = vec![0; length];
                    if stream.read_exact(&mut body).await.is_err() {
                        return;
                    }
                    let reply = answer(&String::from_utf8_lossy(&body));
                    let response = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{reply}",
                        reply.len()
                    );
                    if stream
                        .get_mut()
                        .write_all(response.as_bytes())
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
}

fn newer_agent(body: &str) -> String {
    let request: serde_json::Value = serde_json::from_str(body).expect("a JSON request");
    let id = &request["id"];
    let result = match request["method"].as_str() {
        Some("backup.get") => NEWER_OWNER,
        Some("backup.operations") => NEWER_OPERATIONS,
        Some("backup.events") => NEWER_EVENTS,
        Some("backup.cancel") => {
            return format!(
                r#"{{"jsonrpc":"2.0","id":{id},"error":{{"code":1003,"message":"backup b is Archived; cancel is allowed only while InProgress","data":{{"phase":"Archived","since":"2026-11-25T10:00:01Z"}}}}}}"#
            )
        }
        Some("backup.delete") => {
            return format!(
                r#"{{"jsonrpc":"2.0","id":{id},"error":{{"code":1009,"message":"b is held","data":{{"holder":"legal"}}}}}}"#
            )
        }
        _ => {
            r#"{"version":"9.0.0","uptime":"1s","owners":{"Archived":3,"Completed":1},"unfinishedOperations":0,"snapshotters":0,"apiVersion":"2.0.0","features":["cancel","archive"],"archives":3}"#
        }
    };
    format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{result}}}"#)
}

#[tokio::test]
async fn answers_of_a_newer_agent_decode_with_their_unknown_values() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let socket = dir.path().join("agent.sock");
    serve(&socket, newer_agent);
    let client = Client::connect(&socket).await.expect("connecting");

    let status = client
        .status()
        .await
        .expect("agent.status of a newer agent");
    assert!(status.supports(Feature::Cancel) && !status.supports(Feature::Rate));
    assert!(status.features.iter().any(|f| f == "archive"));
    assert_eq!(status.owners.get(&OwnerPhase::Unknown), Some(&3));

    let owner = client
        .backups()
        .get("b")
        .await
        .expect("an owner in a newer phase");
    assert_eq!(owner.phase, OwnerPhase::Unknown);
    assert!(!owner.phase.is_known() && !owner.phase.is_terminal());
    assert_eq!(owner.failure_reason, None);

    let ops = client.backups().operations("b").await.expect("operations");
    assert_eq!(ops[0].phase, OperationPhase::Unknown);
    assert_eq!(ops[0].plugin.kind, PluginKind::Unknown);
    assert_eq!((&ops[0].error, &ops[0].last_error), (&None, &None));

    let events = client.backups().events("b").await.expect("events");
    let reasons: Vec<_> = events.items.iter().map(|e| e.reason).collect();
    assert_eq!(reasons, [EventReason::Started, EventReason::Unknown]);
    assert_eq!(events.items[1].message, "archived to s3://bucket/b");
}

#[tokio::test]
async fn error_answers_keep_the_code_and_the_data() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let socket = dir.path().join("agent.sock");
    serve(&socket, newer_agent);
    let client = Client::connect(&socket).await.expect("connecting");

    let e = client.backups().cancel("b").await.unwrap_err();
    assert!(e.is_wrong_phase(), "{e:?}");
    assert_eq!(e.rpc_code(), Some(Code::WrongPhase));
    assert_eq!(e.phase(), Some(OwnerPhase::Unknown));
    assert_eq!(
        e.data().and_then(|d| d["since"].as_str()),
        Some("2026-11-25T10:00:01Z")
    );

    // A code this client does not know is kept as a number.
    let e = client.backups().delete("b").await.unwrap_err();
    assert_eq!(e.rpc_code(), Some(Code::Other(1009)));
    assert_eq!(e.code(), Some(1009));
    assert_eq!(e.data().and_then(|d| d["holder"].as_str()), Some("legal"));
    assert!(!e.is_not_found() && !e.is_wrong_phase());
}
