//! End-to-end: faulty snapshotters, a full disk and an unwritable storage directory
//! cost the agent nothing it had, and it recovers without a restart.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use opmon_client::{codes, ApiVersion, OperationPhase, OwnerPhase, Snapshotter, WaitUntil};
use opmon_tests::{operation, Agent, Fixture, SdkSnapshotter, PLUGIN};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const LONG: Duration = Duration::from_secs(120);

fn socket_snapshotter(name: &str, socket: &Path) -> Snapshotter {
    Snapshotter {
        name: name.into(),
        api_version: ApiVersion::V2,
        socket: Some(socket.to_path_buf()),
        command: None,
        ..Default::default()
    }
}

#[tokio::test]
async fn a_snapshotter_that_crashes_and_comes_back_resumes_its_operations() {
    let mut f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    backups.start("b", "u").await.unwrap();
    backups
        .add_operations("b", vec![operation(PLUGIN, "gate-1", "a", &[])])
        .await
        .unwrap();
    backups.end_in_progress("b").await.unwrap();
    let polls_before = f.journal().len();
    f.snapshotter.kill9();
    // Polls now fail to connect; wait for the agent to have tried a few times.
    let start = Instant::now();
    loop {
        let text = f.agent.log_text();
        if text.contains("snapshotter unreachable; its operations wait for the grace period") {
            break;
        }
        assert!(
            start.elapsed() < LONG,
            "the agent never noticed the crash:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The operation says why it waits (committed just after the log line).
    let op = loop {
        let ops = backups.operations("b").await.unwrap();
        if !ops[0].last_error.as_deref().unwrap_or("").is_empty() {
            break ops[0].clone();
        }
        assert!(start.elapsed() < LONG, "lastError stayed empty: {ops:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        op.phase,
        OperationPhase::InProgress,
        "an unreachable snapshotter fails nothing yet"
    );
    assert!(
        op.last_error
            .as_deref()
            .unwrap_or("")
            .starts_with(&format!("snapshotter {PLUGIN}")),
        "{:?}",
        op.last_error
    );
    assert_eq!((op.attempts, op.error.as_deref().unwrap_or("")), (0, ""));
    f.open_gate("gate-1");
    f.snapshotter = SdkSnapshotter::start(f.dir.path(), "copier", &f.gates, &f.journal);
    let owner = backups
        .wait("b", WaitUntil::ReadyToFinalize, LONG)
        .await
        .unwrap()
        .owner;
    assert_eq!(owner.phase, OwnerPhase::Finalizing);
    assert_eq!(owner.operations_failed, 0);
    assert!(f.journal().len() > polls_before);
}

#[tokio::test]
async fn a_snapshotter_unreachable_past_the_grace_period_fails_its_operations_saying_so() {
    let f = Fixture::new(&["--unreachable-grace", "500ms", "--call-deadline", "200ms"]).await;
    let client = f.agent.client().await;
    let hung_gates = f.dir.path().join("hung-gates");
    std::fs::create_dir(&hung_gates).unwrap();
    opmon_tests::open_gate(&hung_gates, "HANG");
    let hung = SdkSnapshotter::start(
        f.dir.path(),
        "hung",
        &hung_gates,
        &f.dir.path().join("hung-journal"),
    );
    client
        .register_snapshotter(socket_snapshotter("example.io/hung", &hung.socket))
        .await
        .unwrap();
    client
        .register_snapshotter(socket_snapshotter(
            "example.io/gone",
            &f.dir.path().join("nobody.sock"),
        ))
        .await
        .unwrap();
    let backups = client.backups();
    backups.start("b", "u").await.unwrap();
    backups
        .add_operations(
            "b",
            vec![
                operation("example.io/hung", "never-1", "a", &[]),
                operation("example.io/gone", "x-2", "b", &[]),
                operation(PLUGIN, "done-3", "c", &[]),
            ],
        )
        .await
        .unwrap();
    let started = Instant::now();
    let owner = backups.end_in_progress("b").await.unwrap();
    assert_eq!(
        owner.phase,
        OwnerPhase::WaitingForPluginOperations,
        "nothing failed at once"
    );
    assert_eq!(
        owner.operations_completed, 1,
        "the healthy snapshotter's operation completed"
    );
    let owner = backups
        .wait("b", WaitUntil::ReadyToFinalize, LONG)
        .await
        .unwrap()
        .owner;
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "failed before the grace period"
    );
    assert_eq!(owner.phase, OwnerPhase::FinalizingPartiallyFailed);
    let ops = backups.operations("b").await.unwrap();
    assert!(
        ops[0].error.as_deref().unwrap_or("").starts_with("unreachable for more than 500ms: snapshotter example.io/hung did not answer within 200ms"),
        "{:?}",
        ops[0].error
    );
    assert!(
        ops[1]
            .error
            .as_deref()
            .unwrap_or("")
            .starts_with("unreachable for more than 500ms: snapshotter example.io/gone at "),
        "{:?}",
        ops[1].error
    );
    assert_eq!(ops[2].phase, OperationPhase::Completed);
}

/// Serves one kind of bad answer on a Unix socket, for every request.
async fn bad_snapshotter(socket: PathBuf, body: Vec<u8>) {
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let body = body.clone();
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buf = [0u8; 65536];
                // Read the head and the announced body, then answer.
                loop {
                    let Ok(n) = stream.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&request);
                    if let Some(head_end) = text.find("\r\n\r\n") {
                        let length: usize = text[..head_end]
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse().unwrap_or(0))
                            })
                            .unwrap_or(0);
                        if request.len() >= head_end + 4 + length {
                            break;
                        }
                    }
                }
                let head = format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len());
                let _ = stream.write_all(head.as_bytes()).await;
                let _ = stream.write_all(&body).await;
            });
        }
    });
}

#[tokio::test]
async fn garbage_and_oversized_answers_fail_the_operation_and_nothing_else() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let garbage = f.dir.path().join("garbage.sock");
    let huge = f.dir.path().join("huge.sock");
    bad_snapshotter(garbage.clone(), b"<html>not json-rpc</html>".to_vec()).await;
    bad_snapshotter(huge.clone(), vec![b' '; 17 * 1024 * 1024]).await;
    client
        .register_snapshotter(socket_snapshotter("example.io/garbage", &garbage))
        .await
        .unwrap();
    client
        .register_snapshotter(socket_snapshotter("example.io/huge", &huge))
        .await
        .unwrap();
    let backups = client.backups();
    backups.start("b", "u").await.unwrap();
    backups
        .add_operations(
            "b",
            vec![
                operation("example.io/garbage", "g-1", "a", &[]),
                operation("example.io/huge", "h-2", "b", &[]),
                operation(PLUGIN, "done-3", "c", &[]),
            ],
        )
        .await
        .unwrap();
    let owner = backups.end_in_progress("b").await.unwrap();
    assert_eq!(owner.phase, OwnerPhase::FinalizingPartiallyFailed);
    let ops = backups.operations("b").await.unwrap();
    assert_eq!(
        ops[0].error.as_deref(),
        Some("snapshotter example.io/garbage answered something that is not a JSON-RPC response")
    );
    assert_eq!(
        ops[1].error.as_deref(),
        Some("snapshotter example.io/huge answered more than 16777216 bytes")
    );
    assert_eq!(ops[2].phase, OperationPhase::Completed);
    assert_eq!(
        client.status().await.unwrap().snapshotters,
        3,
        "the agent is unaffected"
    );
}

#[tokio::test]
async fn a_full_disk_fails_requests_with_1004_keeps_what_was_stored_and_recovers() {
    if !opmon_tests::root_or_skip("to mount a small tmpfs") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk");
    std::fs::create_dir(&disk).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
        .arg(&disk)
        .status()
        .unwrap();
    assert!(mounted.success(), "mounting a tmpfs");
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
    let _unmount = Unmount(disk.clone());
    let mut agent = Agent::start_at(
        dir.path(),
        &dir.path().join("run/agent.sock"),
        &disk.join("state"),
        &[],
    );
    let client = agent.client().await;
    let backups = client.backups();
    backups.start("kept", "u").await.unwrap();
    backups
        .add_operations("kept", vec![operation(PLUGIN, "op-1", "a", &[])])
        .await
        .unwrap();

    // Fill the file system to the last block.
    let filler = disk.join("filler");
    let mut file = std::fs::File::create(&filler).unwrap();
    let block = vec![0xa5u8; 64 * 1024];
    while file.write_all(&block).is_ok() {}
    let _ = file.write_all(&[0u8; 512]);
    drop(file);

    let big: Vec<_> = (0..2000)
        .map(|i| {
            operation(
                PLUGIN,
                &format!("fill-{i:04}-{}", "x".repeat(200)),
                "b",
                &[],
            )
        })
        .collect();
    let err = backups
        .add_operations("kept", big.clone())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(codes::STORAGE_FAILURE), "{err}");
    assert!(
        err.to_string()
            .contains("disk holding the database is full"),
        "{err}"
    );
    let ops = backups.operations("kept").await.unwrap();
    assert_eq!(
        ops.len(),
        1,
        "earlier state is intact and nothing half-written shows"
    );

    std::fs::remove_file(&filler).unwrap();
    let added = backups.add_operations("kept", big).await.unwrap();
    assert_eq!(added.added, 2000, "writes resume without a restart");
    assert_eq!(backups.operations("kept").await.unwrap().len(), 2001);
    agent.kill9();
    let check = rusqlite::Connection::open(disk.join("state/agent.db")).unwrap();
    let integrity: String = check
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(integrity, "ok");
}

#[tokio::test]
async fn an_unwritable_storage_directory_fails_the_file_write_and_it_is_retried() {
    let f = Fixture::new(&[]).await;
    let storage = f.agent.state_dir.join("storage");
    std::fs::create_dir_all(&storage).unwrap();
    // A file where the backups directory should be: no user, root included, can
    // create the owner's directory under it.
    std::fs::write(storage.join("backups"), b"in the way").unwrap();
    let client = f.agent.client().await;
    let backups = client.backups();
    backups.start("b", "u").await.unwrap();
    backups
        .add_operations("b", vec![operation(PLUGIN, "done-1", "a", &[])])
        .await
        .unwrap();
    let owner = backups.end_in_progress("b").await.unwrap();
    assert_eq!(
        owner.phase,
        OwnerPhase::Finalizing,
        "the request itself succeeds"
    );
    let log = f.agent.log_text();
    assert!(
        log.contains("writing the item-operations file failed; will retry"),
        "{log}"
    );
    assert!(
        log.contains(&format!("creating {}", storage.join("backups/b").display())),
        "{log}"
    );

    std::fs::remove_file(storage.join("backups")).unwrap();
    let file = storage.join("backups/b/b-itemoperations.json.gz");
    let start = Instant::now();
    while !file.exists() {
        assert!(start.elapsed() < LONG, "the write was never retried");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn idle_connections_are_closed_after_the_idle_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &["--idle-timeout", "2s"]);
    let mut idle = std::os::unix::net::UnixStream::connect(&agent.socket).unwrap();
    idle.set_read_timeout(Some(LONG)).unwrap();
    let opened = Instant::now();
    let mut buf = [0u8; 16];
    let n = idle
        .read(&mut buf)
        .expect("the agent closes the connection");
    assert_eq!(n, 0, "closed without a word");
    assert!(
        opened.elapsed() >= Duration::from_millis(300),
        "closed before the timeout"
    );
    // A busy connection is not idle: requests keep it open past the timeout.
    let mut busy = opmon_tests::RawHttp::connect(&agent.socket);
    let kept = Instant::now();
    while kept.elapsed() < Duration::from_secs(3) {
        let answer = busy.call(r#"{"jsonrpc":"2.0","id":1,"method":"agent.status"}"#);
        assert_eq!(answer["result"]["unfinishedOperations"], 0);
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn request(method: &str, params: serde_json::Value) -> String {
    serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string()
}

/// `count` operations of `plugin` with IDs `prefix-0`, `prefix-1`, …
fn operations(plugin: &str, prefix: &str, count: usize) -> serde_json::Value {
    (0..count)
        .map(|i| {
            serde_json::to_value(operation(plugin, &format!("{prefix}-{i}"), "a", &[])).unwrap()
        })
        .collect()
}

/// Starts backup `name` with `ops` (over raw HTTP, as any client would).
fn start_with(http: &mut opmon_tests::RawHttp, name: &str, ops: serde_json::Value) {
    let started = http.call(&request(
        "backup.start",
        serde_json::json!({"name": name, "uid": "u"}),
    ));
    assert_eq!(started["result"]["phase"], "InProgress", "{started}");
    let count = ops.as_array().map_or(0, Vec::len);
    let added = http.call(&request(
        "backup.addOperations",
        serde_json::json!({"name": name, "operations": ops}),
    ));
    assert_eq!(added["result"]["added"], count, "{added}");
}

/// The agent's metrics page.
fn metrics(socket: &Path) -> String {
    let mut s = std::os::unix::net::UnixStream::connect(socket).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text
}

#[tokio::test]
async fn cancels_against_a_hung_snapshotter_end_within_one_call_deadline() {
    const OPS: usize = 1000;
    let f = Fixture::new(&["--call-deadline", "1s"]).await;
    let hung_gates = f.dir.path().join("hung-gates");
    std::fs::create_dir(&hung_gates).unwrap();
    opmon_tests::open_gate(&hung_gates, "HANG");
    let hung = SdkSnapshotter::start(
        f.dir.path(),
        "hung",
        &hung_gates,
        &f.dir.path().join("hung-journal"),
    );
    let client = f.agent.client().await;
    client
        .register_snapshotter(socket_snapshotter("example.io/hung", &hung.socket))
        .await
        .unwrap();
    let mut http = opmon_tests::RawHttp::connect(&f.agent.socket);

    // Deleting a waiting backup cancels its operations.
    start_with(
        &mut http,
        "waiting",
        operations("example.io/hung", "w", OPS),
    );
    let ended = http.call(&request(
        "backup.endInProgress",
        serde_json::json!({"name": "waiting"}),
    ));
    assert_eq!(
        ended["result"]["phase"], "WaitingForPluginOperations",
        "{ended}"
    );
    let began = Instant::now();
    let deleted = http.call(&request(
        "backup.delete",
        serde_json::json!({"name": "waiting"}),
    ));
    let took = began.elapsed();
    assert_eq!(deleted["result"]["cancelled"], OPS, "{deleted}");
    assert!(
        took < Duration::from_secs(10),
        "delete of {OPS} operations of a hung snapshotter took {took:?} with a 1s call deadline"
    );

    // So does failing one that is InProgress.
    start_with(
        &mut http,
        "failing",
        operations("example.io/hung", "f", OPS),
    );
    let began = Instant::now();
    let failed = http.call(&request(
        "backup.endInProgress",
        serde_json::json!({"name": "failing", "failed": true}),
    ));
    let took = began.elapsed();
    assert_eq!(failed["result"]["phase"], "Failed", "{failed}");
    assert!(
        took < Duration::from_secs(10),
        "endInProgress failed with {OPS} operations of a hung snapshotter took {took:?}"
    );
    let log = f.agent.log_text();
    assert!(
        log.contains("cancel calls abandoned: no answer within the call deadline"),
        "{log}"
    );
    let page = metrics(&f.agent.socket);
    assert!(
        page.contains(&format!(
            "opmon_cancel_calls_total{{snapshotter=\"example.io/hung\"}} {}\n",
            2 * OPS
        )),
        "{page}"
    );
}

#[tokio::test]
async fn every_cancel_reaches_a_healthy_snapshotter_and_its_null_answer_is_a_success() {
    const OPS: usize = 600;
    let f = Fixture::new(&[]).await;
    let mut http = opmon_tests::RawHttp::connect(&f.agent.socket);
    start_with(&mut http, "b", operations(PLUGIN, "never", OPS));
    let failed = http.call(&request(
        "backup.endInProgress",
        serde_json::json!({"name": "b", "failed": true}),
    ));
    assert_eq!(failed["result"]["phase"], "Failed", "{failed}");
    let cancels: std::collections::BTreeSet<String> = f
        .journal()
        .into_iter()
        .filter(|l| l.starts_with("cancel "))
        .collect();
    let expected: std::collections::BTreeSet<String> =
        (0..OPS).map(|i| format!("cancel never-{i} b")).collect();
    assert_eq!(cancels, expected, "each operation was cancelled once");
    let page = metrics(&f.agent.socket);
    assert!(
        page.contains(&format!(
            "opmon_cancel_calls_total{{snapshotter=\"{PLUGIN}\"}} {OPS}\n"
        )),
        "{page}"
    );
    assert!(
        page.contains(&format!(
            "opmon_cancel_errors_total{{snapshotter=\"{PLUGIN}\"}} 0\n"
        )),
        "{page}"
    );
    let log = f.agent.log_text();
    assert!(!log.contains("cancel failed"), "{log}");
}

/// Serves JSON-RPC batches on a Unix socket, answering each call with `answer(n)` for
/// the n-th request (from 1); returns the count of requests answered so far.
async fn counting_snapshotter(
    socket: PathBuf,
    answer: impl Fn(u64) -> serde_json::Value + Send + Sync + 'static,
) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let count = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let answer = std::sync::Arc::new(answer);
    let counted = count.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let answer = answer.clone();
            let count = counted.clone();
            tokio::spawn(async move {
                let mut stream = tokio::io::BufReader::new(stream);
                loop {
                    let mut length = 0usize;
                    loop {
                        let mut line = String::new();
                        match tokio::io::AsyncBufReadExt::read_line(&mut stream, &mut line).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) => {}
                        }
                        let line = line.trim_end().to_ascii_lowercase();
                        if line.is_empty() {
                            break;
                        }
                        if let Some(v) = line.strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap_or(0);
                        }
                    }
                    let mut body = vec![0; length];
                    if stream.read_exact(&mut body).await.is_err() {
                        return;
                    }
                    let calls: serde_json::Value = serde_json::from_slice(&body).unwrap();
                    let n = count.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                    let result = answer(n);
                    let answers: Vec<serde_json::Value> = calls
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|c| serde_json::json!({"jsonrpc": "2.0", "id": c["id"], "result": result}))
                        .collect();
                    let body = serde_json::to_vec(&answers).unwrap();
                    let head = format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len());
                    let stream = stream.get_mut();
                    if stream.write_all(head.as_bytes()).await.is_err()
                        || stream.write_all(&body).await.is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    count
}

/// The total size of the files under `dir`.
fn size_of_tree(dir: &Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let meta = entry.metadata().unwrap();
        total += if meta.is_dir() {
            size_of_tree(&entry.path())
        } else {
            meta.len()
        };
    }
    total
}

#[tokio::test]
async fn a_huge_description_that_changes_every_poll_is_stored_cut() {
    // Far past the stored bound; every poll's report differs from the last.
    const SIZE: usize = 4_000_000;
    let f = Fixture::new(&[]).await;
    let socket = f.dir.path().join("verbose.sock");
    let answered = counting_snapshotter(socket.clone(), |n| {
        serde_json::json!({
            "completed": false, "nCompleted": n, "nTotal": 1_000_000,
            "operationUnits": "u".repeat(1000),
            "description": format!("{n:08}{}", "d".repeat(SIZE - 8)),
            "started": "2026-01-01T00:00:00Z",
        })
    })
    .await;
    let client = f.agent.client().await;
    client
        .register_snapshotter(socket_snapshotter("example.io/verbose", &socket))
        .await
        .unwrap();
    let mut http = opmon_tests::RawHttp::connect(&f.agent.socket);
    start_with(&mut http, "b", operations("example.io/verbose", "v", 1));
    http.call(&request(
        "backup.endInProgress",
        serde_json::json!({"name": "b"}),
    ));
    let start = Instant::now();
    while answered.load(std::sync::atomic::Ordering::SeqCst) < 6 {
        assert!(start.elapsed() < LONG, "the agent stopped polling");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ops = http.call(&request(
        "backup.operations",
        serde_json::json!({"name": "b"}),
    ));
    let op = &ops["result"][0];
    let description = op["description"]
        .as_str()
        .unwrap_or_else(|| panic!("{ops}"));
    assert_eq!(
        description.len(),
        4096,
        "{}",
        &description[description.len() - 40..]
    );
    assert!(
        description.ends_with("… [truncated 3995933 bytes]"),
        "{}",
        &description[description.len() - 40..]
    );
    assert_eq!(
        op["operationUnits"],
        format!("{}… [truncated 962 bytes]", "u".repeat(38))
    );
    assert!(
        op["nCompleted"].as_u64().unwrap() >= 2,
        "progress is recorded: {}",
        op["nCompleted"]
    );
    let stored = size_of_tree(&f.agent.state_dir);
    assert!(
        stored < 8 * 1024 * 1024,
        "the state directory holds {stored} bytes after six polls"
    );
}

#[tokio::test]
async fn a_damaged_owner_row_is_reported_on_that_owner_and_the_others_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(dir.path(), &[]);
    {
        let client = agent.client().await;
        for name in ["b1", "b2", "b3"] {
            client.backups().start(name, "u").await.unwrap();
        }
    }
    assert!(agent.terminate().success());
    // What a corrupted page leaves: a time past year 9999, a phase that is no phase.
    {
        let db = rusqlite::Connection::open(agent.state_dir.join("agent.db")).unwrap();
        db.execute(
            "UPDATE owners SET created_ms = 253402300800000 WHERE name = 'b2'",
            [],
        )
        .unwrap();
        db.execute(
            "UPDATE owners SET phase = 'In\u{1}Prog' WHERE name = 'b3'",
            [],
        )
        .unwrap();
    }
    agent.restart();
    let client = agent.client().await;
    let listed = client.backups().list().await.unwrap();
    let names: Vec<&str> = listed.items.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, ["b1", "b2", "b3"]);
    assert_eq!(listed.items[0].failure_reason, None);
    assert_eq!(
        listed.items[1].failure_reason.as_deref(),
        Some("damaged in the database: created_ms: 253402300800000 is not a time")
    );
    assert!(
        listed.items[2]
            .failure_reason
            .as_deref()
            .unwrap_or("")
            .starts_with("damaged in the database: phase: "),
        "{:?}",
        listed.items[2].failure_reason
    );
    // Asked for by name, the damaged one is an error that says so; the others answer.
    let error = client.backups().get("b2").await.unwrap_err().to_string();
    assert!(
        error.contains(
            "backup b2 is damaged in the database (created_ms: 253402300800000 is not a time)"
        ),
        "{error}"
    );
    assert_eq!(
        client.backups().get("b1").await.unwrap().phase,
        OwnerPhase::InProgress
    );
    let log = agent.log_text();
    assert!(
        log.contains("an owner's row is damaged in the database") && log.contains("name=b2"),
        "{log}"
    );
}

/// A snapshotter that is down fails every cancel the same way: the agent's log says so
/// in a line per group naming the count, not in a line per operation (20,000 lines for
/// a backup of 20,000 operations, before).
#[tokio::test]
async fn cancels_that_a_dead_snapshotter_fails_are_logged_once_with_their_count() {
    const OPS: usize = 300;
    let mut f = Fixture::new(&["--call-deadline", "2s"]).await;
    let mut http = opmon_tests::RawHttp::connect(&f.agent.socket);
    start_with(&mut http, "b", operations(PLUGIN, "never", OPS));
    let ended = http.call(&request(
        "backup.endInProgress",
        serde_json::json!({"name": "b"}),
    ));
    assert_eq!(
        ended["result"]["phase"], "WaitingForPluginOperations",
        "{ended}"
    );
    f.snapshotter.kill9();
    let deleted = http.call(&request("backup.delete", serde_json::json!({"name": "b"})));
    assert!(deleted["result"].is_object(), "{deleted}");
    let log = f.agent.log_text();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" WARN ") && l.contains("cancel failed"))
        .collect();
    let counted: usize = lines
        .iter()
        .filter_map(|l| l.split("failed=").nth(1))
        .filter_map(|rest| rest.split_whitespace().next()?.parse::<usize>().ok())
        .sum();
    assert!(
        !lines.is_empty() && lines.len() <= 4,
        "{} lines say cancel failed:\n{log}",
        lines.len()
    );
    assert_eq!(counted, OPS, "the lines count every failed cancel:\n{log}");
}
