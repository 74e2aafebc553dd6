//! End-to-end: what a snapshotter's answers (or their absence) may cost the agent, against
//! the real agent and real snapshotters on real sockets: a silent snapshotter does not
//! hold `endInProgress`, and fat answers of a peer's snapshotters are held to a bound.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use opmon_client::{OperationPhase, OwnerPhase, WaitUntil};
use opmon_tests::held::CallerAs;
use opmon_tests::raw::status_bytes;
use opmon_tests::{operation, Agent, Fixture, Steps, PLUGIN};
use serde_json::json;

/// A snapshotter that takes every call and never answers (the fixture's, while its
/// `HANG` gate exists) holds `endInProgress` one call deadline, not one per round of
/// batches: the owner leaves InProgress with its operations unfinished, each saying
/// why in `lastError`, and they are polled on once the snapshotter answers again.
#[tokio::test]
async fn a_silent_snapshotter_does_not_hold_end_in_progress() {
    let f = Fixture::new(&["--call-deadline", "2s"]).await;
    // 12,000 operations are 47 batches of 256, 4 at a time: 12 rounds of the call
    // deadline if each round waited for the last.
    let ops = (0..12_000).map(|n| operation(PLUGIN, &format!("done-{n}"), "a", &[]));
    let backup = f.backup("b").operations(ops);
    backup.start().await;
    f.open_gate("HANG");
    let began = Instant::now();
    let owner = f.client.backups().end_in_progress("b").await.unwrap();
    let took = began.elapsed();
    assert_eq!(owner.phase, OwnerPhase::WaitingForPluginOperations);
    // Generous: the bound is one call deadline (2 s); 12 rounds would be 24 s.
    assert!(
        took < Duration::from_secs(16),
        "endInProgress took {took:?}"
    );
    let listed = f.client.backups().operations("b").await.unwrap();
    assert_eq!(listed.len(), 12_000);
    for op in &listed {
        assert_eq!(op.phase, OperationPhase::New, "{op:?}");
        assert!(
            op.last_error
                .as_deref()
                .is_some_and(|e| e.starts_with("snapshotter example.io/copier did not answer")),
            "{op:?}"
        );
    }
    std::fs::remove_file(f.gates.join("HANG")).unwrap();
    let owner = backup.wait(WaitUntil::ReadyToFinalize).await;
    assert_eq!(owner.phase, OwnerPhase::Finalizing);
}

/// Snapshotters a peer registered answer valid JSON padded to 15 MiB, each holding its
/// last byte until all of them are sent but that byte (or cut off): an agent that held
/// every answer whole would hold 16 × 15 MiB at once. The answers are charged to the one
/// total of bytes held for peers (`max_held_bytes`, 64 MiB), so the agent's peak stays far
/// under that, and the operations still complete, a few answers at a time.
#[tokio::test]
async fn fat_answers_of_snapshotters_are_held_to_the_agents_total() {
    if !nix::unistd::geteuid().is_root() {
        assert!(std::env::var_os("CI").is_none(), "must run as root in CI");
        eprintln!("skipped: needs root to register snapshotters as another uid");
        return;
    }
    const COUNT: usize = 16;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("snapshotters/fat-answers.py");
    let mut snapshotters = Command::new("/usr/bin/python3")
        .arg(script)
        .arg(dir.path())
        .arg(COUNT.to_string())
        .arg("15")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("running tests/snapshotters/fat-answers.py");
    let mut ready = String::new();
    BufReader::new(snapshotters.stdout.take().unwrap())
        .read_line(&mut ready)
        .unwrap();
    assert_eq!(ready.trim(), "ready");
    let agent = Agent::start_untraced(
        dir.path(),
        &["--allowed-uids", "64001", "--socket-mode", "0666"],
    );
    let socket = dir.path().join("run/agent.sock");
    std::fs::set_permissions(
        dir.path().join("run"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    let mut peer = CallerAs::start(64001, &socket);
    for i in 0..COUNT {
        let register = json!({"jsonrpc": "2.0", "id": i, "method": "snapshotter.register",
            "params": {"name": format!("example.io/fat-{i}"), "apiVersion": "v2",
                "socket": dir.path().join(format!("fat-{i}.sock"))}});
        peer.send(&i.to_string(), &register.to_string());
    }
    for _ in 0..COUNT {
        let (tag, answer) = peer.answer();
        assert!(answer["result"].is_object(), "{tag}: {answer}");
    }
    let client = agent.client().await;
    let ops = (0..COUNT).map(|i| operation(&format!("example.io/fat-{i}"), "op", "a", &[]));
    let backup = Steps::of(client.backups(), "b").operations(ops);
    backup.end_in_progress().await;
    let owner = backup.wait(WaitUntil::ReadyToFinalize).await;
    assert_eq!(owner.phase, OwnerPhase::Finalizing);
    let peak = status_bytes(agent.pid(), "VmHWM:");
    // 16 answers of 15 MiB would be 240 MiB; the total held is 64 MiB.
    assert!(
        peak < 160 << 20,
        "the agent's peak resident set: {peak} bytes"
    );
    drop(snapshotters.stdin.take());
    let _ = snapshotters.kill();
    let _ = snapshotters.wait();
}
