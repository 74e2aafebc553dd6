//! End-to-end: the restart workflow, crash safety and the process lifecycle.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use opmon_client::{OperationPhase, OwnerPhase, WaitUntil};
use opmon_tests::{operation, Agent, Fixture, PLUGIN};

const LONG: Duration = Duration::from_secs(120);

#[tokio::test]
async fn a_backup_waiting_when_the_agent_is_killed_still_reaches_finalizing() {
    let mut f = Fixture::new(&[]).await;
    {
        let client = f.agent.client().await;
        let backups = client.backups();
        let owner = opmon_tests::start_and_end_in_progress(
            &backups,
            "b",
            vec![operation(PLUGIN, "gate-1", "a", &["vsb"])],
        )
        .await;
        assert_eq!(owner.phase, OwnerPhase::WaitingForPluginOperations);
    }
    f.agent.kill9();
    f.open_gate("gate-1");
    f.agent.restart();
    let client = f.agent.client().await;
    let owner = client
        .backups()
        .wait("b", WaitUntil::ReadyToFinalize, LONG)
        .await
        .unwrap()
        .owner;
    assert_eq!(owner.phase, OwnerPhase::Finalizing);
    assert_eq!(owner.post_operation_items.map(|p| p.len()), Some(1));
}

#[tokio::test]
async fn an_in_progress_backup_is_failed_after_a_restart_and_its_operations_cancelled() {
    let mut f = Fixture::new(&[]).await;
    {
        let client = f.agent.client().await;
        let backups = client.backups();
        backups.start("interrupted", "u", None).await.unwrap();
        backups
            .add_operations("interrupted", vec![operation(PLUGIN, "never-1", "a", &[])])
            .await
            .unwrap();
        opmon_tests::start_and_end_in_progress(
            &backups,
            "finalizing",
            vec![operation(PLUGIN, "done-1", "a", &[])],
        )
        .await;
        client
            .restores()
            .start("restore-interrupted", "u", None)
            .await
            .unwrap();
    }
    f.agent.kill9();
    f.agent.restart();
    let client = f.agent.client().await;
    let owner = client.backups().get("interrupted").await.unwrap();
    assert_eq!(owner.phase, OwnerPhase::Failed);
    assert!(owner.completed.is_some());
    let ops = client
        .backups()
        .operations("interrupted", None)
        .await
        .unwrap();
    assert_eq!(ops[0].phase, OperationPhase::Failed);
    assert_eq!(
        ops[0].error,
        "cancelled: the agent restarted while the backup was InProgress"
    );
    assert_eq!(
        client
            .restores()
            .get("restore-interrupted")
            .await
            .unwrap()
            .phase,
        OwnerPhase::Failed
    );
    assert_eq!(
        client.backups().get("finalizing").await.unwrap().phase,
        OwnerPhase::Finalizing,
        "finalizing owners keep waiting for finalize"
    );
    // The agent sends that cancel in the background after it starts serving (a hung
    // snapshotter must not delay start-up), so wait for the condition, bounded.
    let start = std::time::Instant::now();
    while !f
        .journal()
        .contains(&"cancel never-1 interrupted".to_string())
    {
        assert!(
            start.elapsed() < LONG,
            "no cancel after restart: {:?}",
            f.journal()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn sigterm_finishes_cleanly_and_the_state_survives() {
    let mut f = Fixture::new(&[]).await;
    {
        let client = f.agent.client().await;
        client.backups().start("kept", "u", None).await.unwrap();
    }
    let status = f.agent.terminate();
    assert!(
        status.success(),
        "exit status {status}\n{}",
        f.agent.log_text()
    );
    assert!(
        !f.agent.socket.exists(),
        "the socket file is removed on exit"
    );
    let db = f.agent.state_dir.join("agent.db");
    let wal = f.agent.state_dir.join("agent.db-wal");
    assert!(
        !wal.exists() || std::fs::metadata(&wal).unwrap().len() == 0,
        "closing the database checkpoints the WAL"
    );
    assert!(db.exists());
    f.agent.restart();
    let client = f.agent.client().await;
    assert_eq!(client.backups().get("kept").await.unwrap().uid, "u");
}

#[tokio::test]
async fn files_and_sockets_get_their_modes_and_a_second_agent_refuses_to_start() {
    let f = Fixture::new(&[]).await;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&f.agent.socket), 0o660);
    assert_eq!(mode(f.agent.socket.parent().unwrap()), 0o750);
    assert_eq!(mode(&f.agent.state_dir.join("agent.db")), 0o600);

    // Same database: refused, naming the database and the holder's pid.
    let second = clone_paths(&f.agent);
    let out = second.spawn().wait_with_output().unwrap();
    assert!(!out.status.success());
    let log = std::fs::read_to_string(&second.log).unwrap();
    let db = f.agent.state_dir.join("agent.db");
    assert!(
        log.contains(&format!(
            "database {} is in use by another opmon-agent (pid ",
            db.display()
        )),
        "{log}"
    );
}

/// An agent description sharing `a`'s socket and state, logging elsewhere; not started.
fn clone_paths(a: &Agent) -> Agent {
    let dir = a.dir.join("second");
    std::fs::create_dir_all(&dir).unwrap();
    Agent::unstarted(&dir, &a.socket, &a.state_dir)
}

#[tokio::test]
async fn a_live_socket_is_not_stolen_and_a_stale_one_is_replaced() {
    let f = Fixture::new(&[]).await;
    // Another agent with its own database but the live socket: refused.
    let dir = f.dir.path().join("other");
    std::fs::create_dir_all(&dir).unwrap();
    let other = Agent::unstarted(&dir, &f.agent.socket, &dir.join("state"));
    let out = other.spawn().wait_with_output().unwrap();
    assert!(!out.status.success());
    let log = std::fs::read_to_string(&other.log).unwrap();
    assert!(
        log.contains(&format!(
            "another process is serving on {}",
            f.agent.socket.display()
        )),
        "{log}"
    );

    // A socket file whose owner died: replaced.
    let stale_dir = tempfile::tempdir().unwrap();
    let stale = stale_dir.path().join("run/agent.sock");
    std::fs::create_dir_all(stale.parent().unwrap()).unwrap();
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let agent = Agent::start(stale_dir.path(), &[]);
    let status = agent.client().await.status().await.unwrap();
    assert_eq!(status.version, env!("CARGO_PKG_VERSION"));
}

#[test]
fn curl_can_call_agent_status() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let out = std::process::Command::new("curl")
        .args(["-sS", "--unix-socket"])
        .arg(&agent.socket)
        .args([
            "http://localhost/",
            "-H",
            "content-type: application/json",
            "-d",
        ])
        .arg(r#"{"jsonrpc":"2.0","id":7,"method":"agent.status"}"#)
        .output()
        .expect("running curl");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answer["id"], 7);
    assert_eq!(answer["result"]["unfinishedOperations"], 0);
    assert!(answer["result"]["uptime"].as_str().unwrap().ends_with('s'));
}

#[tokio::test]
async fn terminal_owners_are_removed_after_the_retention_period_and_others_kept() {
    let f = Fixture::new(&["--retention", "300ms"]).await;
    let client = f.agent.client().await;
    let restores = client.restores();
    let finished = opmon_tests::start_and_end_in_progress(
        &restores,
        "finished",
        vec![operation(PLUGIN, "done-1", "a", &[])],
    )
    .await;
    assert_eq!(finished.phase, OwnerPhase::Completed);
    let completed = finished
        .completed
        .expect("a terminal owner has a completion time");
    restores.start("running", "u", None).await.unwrap();
    // The periodic task removes it once it is older than 300ms; wait for that, bounded.
    let start = std::time::Instant::now();
    while restores.get("finished").await.is_ok() {
        assert!(
            start.elapsed() < LONG,
            "the completed restore was never removed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let age = time::OffsetDateTime::now_utc() - completed;
    assert!(
        age >= time::Duration::milliseconds(300),
        "removed {age} after completion"
    );
    assert_eq!(
        restores.get("running").await.unwrap().phase,
        OwnerPhase::InProgress
    );
}
