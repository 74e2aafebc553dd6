//! End-to-end: bad input gets the specified error, the connection stays usable, and
//! nothing stored changes; what JSON-RPC gives no answer (notifications) gets an empty
//! one.

use opmon_tests::{operation, Fixture, RawHttp, PLUGIN};
use serde_json::{json, Value};

fn request(method: &str, params: Value) -> String {
    json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string()
}

/// The stored state of backup `b`: the owner and its operations.
fn snapshot(http: &mut RawHttp) -> (Value, Value) {
    let mut owner = http.call(&request("backup.get", json!({"name": "b"})))["result"].clone();
    // `updated` moves only on change; keep it, it is part of what must not change.
    owner.as_object_mut().map(|o| o.remove("uptime"));
    let ops = http.call(&request("backup.operations", json!({"name": "b"})))["result"].clone();
    (owner, ops)
}

fn error_of(answer: &Value) -> (i64, String) {
    let e = &answer["error"];
    (
        e["code"]
            .as_i64()
            .unwrap_or_else(|| panic!("no error in {answer}")),
        e["message"].as_str().unwrap_or_default().to_string(),
    )
}

#[tokio::test]
async fn each_bad_request_gets_its_error_and_leaves_connection_and_state_intact() {
    let f = Fixture::new(&[]).await;
    let mut http = RawHttp::connect(&f.agent.socket);
    let start = http.call(&request("backup.start", json!({"name": "b", "uid": "u"})));
    assert_eq!(start["result"]["phase"], "InProgress");
    let added = http.call(&request(
        "backup.addOperations",
        json!({"name": "b", "operations": [operation(PLUGIN, "gate-1", "a", &[])]}),
    ));
    assert_eq!(added["result"]["added"], 1);
    let before = snapshot(&mut http);

    let huge_id = "x".repeat(1024 * 1024);
    let cases: Vec<(String, i64, String)> = vec![
        ("{\"jsonrpc\": \"2.0\", \"id\": 1, \"method\": ".into(), -32700, "Parse error".into()),
        (request("backup.explode", json!({})), -32601, "Method not found: backup.explode".into()),
        (
            request("backup.subscribe", json!({"name": "b"})),
            -32601,
            "backup.subscribe needs a WebSocket: subscriptions send notifications, which an HTTP \
             POST cannot carry; upgrade the connection (GET / with Upgrade: websocket) and call \
             it there"
                .into(),
        ),
        (
            request("backup.get", json!("b")),
            -32602,
            "params: invalid type: string \"b\", expected an object with name, uid".into(),
        ),
        (
            request("snapshotter.register", json!(5)),
            -32602,
            "params: invalid type: integer `5`, expected an object with name, apiVersion, socket, command, veleroPlugin, args, env, stallTimeout, startTimeout, retryAttempts, retryBackoff, retryWithin".into(),
        ),
        (
            request("backup.addOperations", json!({"name": "b", "operations": [{"plugin": "x", "resource": {"resource": "pods", "name": "a"}, "operationId": "z"}]})),
            -32602,
            "operations[0].plugin: invalid type: string \"x\", expected an object".into(),
        ),
        (
            request("backup.addOperations", json!({"name": "b", "operations": [{"plugin": {"kind": "BackupItemAction", "name": PLUGIN}, "resource": {"resource": "pods", "name": 42}, "operationId": "z"}]})),
            -32602,
            "operations[0].resource.name: invalid type: integer `42`, expected a string".into(),
        ),
        (
            request("backup.start", json!({"name": "b", "uid": 5})),
            -32602,
            "uid: invalid type: integer `5`, expected a string".into(),
        ),
        (
            request("backup.get", json!({"name": "a/b"})),
            -32602,
            "name: must be a DNS subdomain (lowercase letters, digits, '-' and '.', starting and ending with a letter or digit, at most 253 characters)".into(),
        ),
        (
            request("backup.start", json!({"name": "..", "uid": "u"})),
            -32602,
            "name: must be a DNS subdomain (lowercase letters, digits, '-' and '.', starting and ending with a letter or digit, at most 253 characters)".into(),
        ),
        (
            request("backup.addOperations", json!({"name": "b", "operations": [operation(PLUGIN, "ok-1", "a", &[]), operation(PLUGIN, &huge_id, "a", &[])]})),
            -32602,
            "operations[1].operationId: must be at most 1024 bytes (got 1048576)".into(),
        ),
        (
            request("backup.addOperations", json!({"name": "b", "operations": [operation(PLUGIN, "ok-2", "../etc", &[])]})),
            -32602,
            "operations[0].resource.name: must not contain '/' (a Kubernetes name is a path segment: no '/', '%' or control characters)".into(),
        ),
        (
            request("backup.get", json!({"nmae": "b"})),
            -32602,
            "nmae: unknown field `nmae`, expected `name` or `uid`".into(),
        ),
        (
            request("backup.get", json!(["b"])),
            -32602,
            "params must be passed by name, as a JSON object".into(),
        ),
        (
            request("backup.get", json!({"name": "missing"})),
            1001,
            "backup missing not found".into(),
        ),
        (
            request("backup.list", json!({"limit": 0})),
            -32602,
            "limit: must be between 1 and 1000".into(),
        ),
    ];
    for (body, code, message) in cases {
        let answer: Value = serde_json::from_str(&http.post(body.as_bytes()).1).unwrap();
        assert_eq!(
            error_of(&answer),
            (code, message),
            "for {}",
            &body[..body.len().min(120)]
        );
        assert_eq!(
            snapshot(&mut http),
            before,
            "state changed by {}",
            &body[..body.len().min(120)]
        );
    }

    // addOperations after endInProgress: wrong phase, and nothing is added.
    let ended = http.call(&request("backup.endInProgress", json!({"name": "b"})));
    assert_eq!(ended["result"]["phase"], "WaitingForPluginOperations");
    let after_end = snapshot(&mut http);
    let late = http.call(&request(
        "backup.addOperations",
        json!({"name": "b", "operations": [operation(PLUGIN, "late-1", "a", &[])]}),
    ));
    assert_eq!(
        error_of(&late),
        (
            1003,
            "backup b is WaitingForPluginOperations; addOperations is allowed only while InProgress".into()
        )
    );
    assert_eq!(snapshot(&mut http).1, after_end.1, "no operation was added");
    let again = http.call(&request("backup.endInProgress", json!({"name": "b"})));
    assert_eq!(error_of(&again).0, 1003);
}

#[tokio::test]
async fn requests_over_the_size_limit_are_refused() {
    let f = Fixture::new(&["--max-request-size", "65536"]).await;
    let mut http = RawHttp::connect(&f.agent.socket);
    let big = request(
        "backup.start",
        json!({"name": "b", "uid": "x".repeat(100_000)}),
    );
    let (status, body) = http.post(big.as_bytes());
    assert_eq!(status, 413, "{body}");
    let mut http = RawHttp::connect(&f.agent.socket);
    let answer = http.call(&request("backup.list", json!({})));
    assert_eq!(answer["result"]["items"], json!([]), "nothing was stored");
}

/// POSTs `body` with the header lines `headers`; returns the status, the head and the
/// body.
fn post_with(socket: &std::path::Path, headers: &str, body: &str) -> (u16, String, String) {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(socket).unwrap();
    write!(
        s,
        "POST / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, head.to_string(), body.to_string())
}

#[tokio::test]
async fn the_content_type_of_curl_d_is_accepted_and_a_wrong_one_is_named() {
    let f = Fixture::new(&[]).await;
    let status = r#"{"jsonrpc":"2.0","id":1,"method":"agent.status"}"#;
    // The README's line, exactly as printed.
    let out = std::process::Command::new("curl")
        .args(["-sS", "--unix-socket"])
        .arg(&f.agent.socket)
        .args(["http://localhost/", "-d", status])
        .output()
        .unwrap();
    let answer: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    assert_eq!(answer["result"]["snapshotters"], 1, "{answer}");
    for headers in [
        "",
        "Content-Type: application/x-www-form-urlencoded\r\n",
        "Content-Type: application/json; charset=\"UTF-8\"\r\n",
    ] {
        let (code, _, body) = post_with(&f.agent.socket, headers, status);
        assert_eq!(code, 200, "{headers:?}: {body}");
    }
    let (code, head, body) = post_with(&f.agent.socket, "Content-Type: text/plain\r\n", status);
    assert_eq!(code, 415, "{body}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{head}"
    );
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        answer,
        json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32600,
               "message": "Content-Type: text/plain is not accepted; send application/json"}})
    );
}

/// JSON-RPC answers no notification, nor a batch of notifications only ("nothing at
/// all", not an empty array): over HTTP that is a 200 with an empty body, alone or in a
/// batch. A batch with a call in it is answered for the call alone.
#[tokio::test]
async fn notifications_alone_or_in_a_batch_get_an_empty_answer() {
    let f = Fixture::new(&[]).await;
    let changed = json!({"jsonrpc": "2.0", "method": "snapshotter.changed",
                         "params": {"plugin": PLUGIN, "operations": ["x"]}});
    let json = "Content-Type: application/json\r\n";
    let unanswered = [
        ("a notification", changed.to_string()),
        ("a batch of one notification", json!([changed]).to_string()),
        (
            "a batch of notifications",
            json!([changed, {"jsonrpc": "2.0", "method": "agent.status"}]).to_string(),
        ),
    ];
    for (what, body) in unanswered {
        let (code, head, answer) = post_with(&f.agent.socket, json, &body);
        assert_eq!((code, answer.as_str()), (200, ""), "{what}: {head}");
        assert!(
            head.to_ascii_lowercase().contains("content-length: 0"),
            "{what}: {head}"
        );
    }
    let mixed = json!([changed, {"jsonrpc": "2.0", "id": 7, "method": "agent.status"}]);
    let (code, _, answer) = post_with(&f.agent.socket, json, &mixed.to_string());
    assert_eq!(code, 200, "{answer}");
    let answer: Value = serde_json::from_str(&answer).unwrap();
    let ids: Vec<&Value> = answer
        .as_array()
        .unwrap_or_else(|| panic!("a batch answered with {answer}"))
        .iter()
        .map(|r| &r["id"])
        .collect();
    assert_eq!(ids, [&json!(7)], "{answer}");
}

#[tokio::test]
async fn a_websocket_message_over_the_size_limit_gets_an_error_and_the_connection_goes_on() {
    use std::io::{Read, Write};
    let f = Fixture::new(&["--max-request-size", "65536"]).await;
    let mut s = std::os::unix::net::UnixStream::connect(&f.agent.socket).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n").unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).unwrap();
        head.push(byte[0]);
    }
    assert!(head.starts_with(b"HTTP/1.1 101"));
    let mut send = |text: &str| {
        let mut frame = vec![0x81u8, 0x80 | 127];
        frame.extend_from_slice(&(text.len() as u64).to_be_bytes());
        frame.extend_from_slice(&[0, 0, 0, 0]);
        frame.extend_from_slice(text.as_bytes());
        s.write_all(&frame).unwrap();
    };
    send(&request(
        "backup.start",
        json!({"name": "b", "uid": "x".repeat(100_000)}),
    ));
    send(&request("agent.status", json!({})));
    let mut recv = || {
        let mut h = [0u8; 2];
        s.read_exact(&mut h).unwrap();
        let n = match h[1] & 0x7f {
            126 => {
                let mut b = [0u8; 2];
                s.read_exact(&mut b).unwrap();
                u16::from_be_bytes(b) as usize
            }
            127 => {
                let mut b = [0u8; 8];
                s.read_exact(&mut b).unwrap();
                u64::from_be_bytes(b) as usize
            }
            n => n as usize,
        };
        let mut payload = vec![0; n];
        s.read_exact(&mut payload).unwrap();
        serde_json::from_slice::<Value>(&payload).unwrap()
    };
    assert_eq!(
        recv(),
        json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32007,
               "message": "Request is too big", "data": "Exceeded max limit of 65536"}})
    );
    assert_eq!(
        recv()["result"]["snapshotters"],
        1,
        "the connection goes on"
    );
}

#[tokio::test]
async fn an_operation_whose_plugin_kind_or_post_items_do_not_fit_the_owner_is_refused() {
    let f = Fixture::new(&[]).await;
    let mut http = RawHttp::connect(&f.agent.socket);
    for kind in ["backup", "restore"] {
        let started = http.call(&request(
            &format!("{kind}.start"),
            json!({"name": "o", "uid": "u"}),
        ));
        assert_eq!(started["result"]["phase"], "InProgress", "{started}");
    }
    let with = |plugin_kind: &str, post: &[&str]| {
        let mut op = serde_json::to_value(operation(PLUGIN, "op-1", "a", post)).unwrap();
        op["plugin"]["kind"] = json!(plugin_kind);
        json!({"name": "o", "operations": [op]})
    };
    for (method, plugin_kind, post, message) in [
        (
            "restore.addOperations",
            "BackupItemAction",
            &[][..],
            "operations[0].plugin.kind: a restore takes RestoreItemAction operations, not BackupItemAction",
        ),
        (
            "restore.addOperations",
            "VolumeSnapshotter",
            &[],
            "operations[0].plugin.kind: a restore takes RestoreItemAction operations, not VolumeSnapshotter",
        ),
        (
            "backup.addOperations",
            "RestoreItemAction",
            &[],
            "operations[0].plugin.kind: a backup takes BackupItemAction or VolumeSnapshotter operations, not RestoreItemAction",
        ),
        (
            "restore.addOperations",
            "RestoreItemAction",
            &["b"],
            "operations[0].postOperationItems: a restore operation has none (Velero backs items up again only for backups)",
        ),
    ] {
        let answer = http.call(&request(method, with(plugin_kind, post)));
        let (code, said) = error_of(&answer);
        assert_eq!(code, -32602, "{method} {plugin_kind}: {answer}");
        assert!(said.contains(message), "{method} {plugin_kind}: {said}");
    }
    // What fits is taken, and nothing refused was stored.
    for (method, plugin_kind, post) in [
        ("restore.addOperations", "RestoreItemAction", &[][..]),
        ("backup.addOperations", "BackupItemAction", &["b"]),
        ("backup.addOperations", "VolumeSnapshotter", &[]),
    ] {
        let mut params = with(plugin_kind, post);
        params["operations"][0]["operationId"] = json!(format!("op-{plugin_kind}"));
        let answer = http.call(&request(method, params));
        assert_eq!(
            answer["result"]["added"], 1,
            "{method} {plugin_kind}: {answer}"
        );
    }
    let ops = http.call(&request("restore.operations", json!({"name": "o"})));
    assert_eq!(ops["result"].as_array().map(Vec::len), Some(1), "{ops}");
}

#[test]
fn a_bad_value_in_the_config_file_is_named_by_its_key_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("agent.toml");
    for (toml, said) in [
        (
            "batch_size = 64\nmax_connections_per_uid = -1\n",
            "line 2: max_connections_per_uid: invalid value: integer `-1`, expected u32",
        ),
        (
            "allowed_uids = [0, -1]\n",
            "line 1: allowed_uids[1]: invalid value: integer `-1`, expected u32",
        ),
        (
            "[[snapshotter]]\nname = \"example.io/a\"\nretry_attempts = \"3\"\n",
            "line 3: snapshotter[0].retry_attempts: invalid type: string \"3\", expected u32",
        ),
        // An unknown key is named once, by toml's own message.
        (
            "batchsize = 3\n",
            "line 1: unknown field `batchsize`, expected one of",
        ),
    ] {
        std::fs::write(&file, toml).unwrap();
        let out = opmon_tests::agent_command()
            .arg("--config")
            .arg(&file)
            .arg("--print-config")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains(&format!("config file {} {said}", file.display())),
            "{toml}: {stderr}"
        );
    }
}
