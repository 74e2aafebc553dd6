//! End-to-end: bad input gets the specified error, the connection stays usable, and
//! nothing stored changes.

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
        (request("backup.explode", json!({})), -32601, "Method not found".into()),
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
            "nmae: unknown field `nmae`, expected `name`".into(),
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
