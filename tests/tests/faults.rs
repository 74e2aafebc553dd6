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
    }
}

#[tokio::test]
async fn a_snapshotter_that_crashes_and_comes_back_resumes_its_operations() {
    let mut f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    backups.start("b", "u", None).await.unwrap();
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
    let ops = backups.operations("b", None).await.unwrap();
    assert_eq!(
        ops[0].phase,
        OperationPhase::InProgress,
        "an unreachable snapshotter fails nothing yet"
    );
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
        .register_snapshotter(&socket_snapshotter("example.io/hung", &hung.socket))
        .await
        .unwrap();
    client
        .register_snapshotter(&socket_snapshotter(
            "example.io/gone",
            &f.dir.path().join("nobody.sock"),
        ))
        .await
        .unwrap();
    let backups = client.backups();
    backups.start("b", "u", None).await.unwrap();
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
    let ops = backups.operations("b", None).await.unwrap();
    assert!(
        ops[0].error.starts_with("unreachable for more than 500ms: snapshotter example.io/hung did not answer within 200ms"),
        "{}",
        ops[0].error
    );
    assert!(
        ops[1]
            .error
            .starts_with("unreachable for more than 500ms: snapshotter example.io/gone at "),
        "{}",
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
        .register_snapshotter(&socket_snapshotter("example.io/garbage", &garbage))
        .await
        .unwrap();
    client
        .register_snapshotter(&socket_snapshotter("example.io/huge", &huge))
        .await
        .unwrap();
    let backups = client.backups();
    backups.start("b", "u", None).await.unwrap();
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
    let ops = backups.operations("b", None).await.unwrap();
    assert_eq!(
        ops[0].error,
        "snapshotter example.io/garbage answered something that is not a JSON-RPC response"
    );
    assert_eq!(
        ops[1].error,
        "snapshotter example.io/huge answered more than 16777216 bytes"
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
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root to mount a small tmpfs");
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
    backups.start("kept", "u", None).await.unwrap();
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
    let ops = backups.operations("kept", None).await.unwrap();
    assert_eq!(
        ops.len(),
        1,
        "earlier state is intact and nothing half-written shows"
    );

    std::fs::remove_file(&filler).unwrap();
    let added = backups.add_operations("kept", big).await.unwrap();
    assert_eq!(added.added, 2000, "writes resume without a restart");
    assert_eq!(backups.operations("kept", None).await.unwrap().len(), 2001);
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
    backups.start("b", "u", None).await.unwrap();
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
