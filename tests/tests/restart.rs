//! End-to-end: the restart workflow, crash safety and the process lifecycle.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use opmon_client::{
    codes, OperationPhase, OwnerKind, OwnerPhase, ServerRef, ServerStartedParams,
    ServerStartedResult, StartParams, WaitUntil,
};
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
async fn an_agent_restart_keeps_in_progress_owners_in_progress_and_cancels_nothing() {
    let mut f = Fixture::new(&[]).await;
    {
        let client = f.agent.client().await;
        let backups = client.backups();
        backups.start("running", "u").await.unwrap();
        backups
            .add_operations("running", vec![operation(PLUGIN, "gate-1", "a", &[])])
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
            .start("restore-running", "u")
            .await
            .unwrap();
    }
    f.agent.kill9();
    f.agent.restart();
    let client = f.agent.client().await;
    let backups = client.backups();
    let owner = backups.get("running").await.unwrap();
    assert_eq!(owner.phase, OwnerPhase::InProgress);
    assert_eq!(owner.failure_reason, None);
    assert_eq!(owner.completed, None);
    let ops = backups.operations("running").await.unwrap();
    assert_eq!(
        (ops[0].phase, ops[0].error.as_deref().unwrap_or("")),
        (OperationPhase::New, "")
    );
    assert_eq!(
        client
            .restores()
            .get("restore-running")
            .await
            .unwrap()
            .phase,
        OwnerPhase::InProgress
    );
    assert_eq!(
        backups.get("finalizing").await.unwrap().phase,
        OwnerPhase::Finalizing,
        "finalizing owners keep waiting for finalize"
    );

    // The backup server, alive all along, goes on where it was.
    let added = backups
        .add_operations("running", vec![operation(PLUGIN, "gate-2", "b", &[])])
        .await
        .unwrap();
    assert_eq!((added.added, added.already_known), (1, 0));
    f.open_gate("gate-1");
    f.open_gate("gate-2");
    let owner = backups.end_in_progress("running").await.unwrap();
    assert_eq!(owner.phase, OwnerPhase::Finalizing);
    assert_eq!(owner.operations_completed, 2);
    let restore = client
        .restores()
        .end_in_progress("restore-running")
        .await
        .unwrap();
    assert_eq!(restore.phase, OwnerPhase::Completed);
    let cancels: Vec<String> = f
        .journal()
        .into_iter()
        .filter(|l| l.starts_with("cancel "))
        .collect();
    assert!(cancels.is_empty(), "nothing is cancelled: {cancels:?}");
}

/// A server with two owners InProgress restarts; another server and owners started
/// without a server share the agent.
#[tokio::test]
async fn a_restarted_server_fails_only_its_own_in_progress_owners_in_veleros_words() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let server = |name: &str, instance: &str| {
        Some(ServerRef {
            name: name.into(),
            instance: instance.into(),
        })
    };
    let start = |kind: OwnerKind, name: &str, server: Option<ServerRef>| {
        let client = &client;
        let name = name.to_string();
        async move {
            let owners = match kind {
                OwnerKind::Backup => client.backups(),
                OwnerKind::Restore => client.restores(),
            };
            owners
                .request::<opmon_client::methods::Start>(StartParams {
                    name: name.clone(),
                    uid: format!("uid-{name}"),
                    server,
                    ..Default::default()
                })
                .await
                .unwrap()
        }
    };
    let velero = "velero/velero";
    let started = start(OwnerKind::Backup, "a1", server(velero, "pod-1")).await;
    assert_eq!(started.server, server(velero, "pod-1"));
    start(OwnerKind::Restore, "a2", server(velero, "pod-1")).await;
    start(OwnerKind::Backup, "a3", server(velero, "pod-1")).await;
    start(OwnerKind::Backup, "b1", server("other/velero", "pod-1")).await;
    start(OwnerKind::Backup, "n1", None).await;
    let backups = client.backups();
    backups
        .add_operations("a1", vec![operation(PLUGIN, "never-1", "a", &[])])
        .await
        .unwrap();
    backups
        .add_operations("a3", vec![operation(PLUGIN, "gate-3", "a", &[])])
        .await
        .unwrap();
    backups.end_in_progress("a3").await.unwrap();
    // Started by the new instance before it said so: not its predecessor's.
    start(OwnerKind::Backup, "a4", server(velero, "pod-2")).await;

    let started = |name: &str, instance: &str| {
        let params = ServerStartedParams {
            name: name.into(),
            instance: instance.into(),
        };
        let client = &client;
        async move {
            client
                .call::<_, ServerStartedResult>("server.started", params)
                .await
                .unwrap()
        }
    };
    let result = started(velero, "pod-2").await;
    let failed: Vec<(OwnerKind, &str, &str)> = result
        .failed
        .iter()
        .map(|o| (o.kind, o.name.as_str(), o.uid.as_str()))
        .collect();
    assert_eq!(
        failed,
        [
            (OwnerKind::Backup, "a1", "uid-a1"),
            (OwnerKind::Restore, "a2", "uid-a2")
        ]
    );
    let a1 = backups.get("a1").await.unwrap();
    assert_eq!(a1.phase, OwnerPhase::Failed);
    assert_eq!(
        a1.failure_reason.as_deref(),
        Some("found a backup with status \"InProgress\" during the server starting, mark it as \"Failed\"")
    );
    assert!(a1.completed.is_some());
    let a2 = client.restores().get("a2").await.unwrap();
    assert_eq!(
        a2.failure_reason.as_deref(),
        Some("found a restore with status \"InProgress\" during the server starting, mark it as \"Failed\"")
    );
    let ops = backups.operations("a1").await.unwrap();
    assert_eq!(
        (ops[0].phase, ops[0].error.as_deref().unwrap_or("")),
        (OperationPhase::Failed, "canceled: the backup failed")
    );
    let late = backups
        .add_operations("a1", vec![operation(PLUGIN, "done-9", "b", &[])])
        .await
        .unwrap_err();
    assert_eq!(late.code(), Some(codes::WRONG_PHASE));

    // Other phases, other servers, other instances and unnamed owners are untouched.
    for (name, phase) in [
        ("a3", OwnerPhase::WaitingForPluginOperations),
        ("a4", OwnerPhase::InProgress),
        ("b1", OwnerPhase::InProgress),
        ("n1", OwnerPhase::InProgress),
    ] {
        let owner = backups.get(name).await.unwrap();
        assert_eq!(
            (owner.phase, owner.failure_reason.as_deref().unwrap_or("")),
            (phase, ""),
            "{name}"
        );
    }
    assert!(
        started(velero, "pod-2").await.failed.is_empty(),
        "idempotent"
    );
    // Owners started without a server belong to the unnamed one.
    let unnamed = started("", "boot-7").await;
    assert_eq!(unnamed.failed.len(), 1);
    assert_eq!(unnamed.failed[0].name, "n1");

    // Cancel and the item-operations file follow in the background: wait, bounded.
    let file = f
        .agent
        .state_dir
        .join("storage/backups/a1/a1-itemoperations.json.gz");
    let start = std::time::Instant::now();
    while !(f.journal().contains(&"cancel never-1 a1".to_string()) && file.exists()) {
        assert!(
            start.elapsed() < LONG,
            "no cancel or file after server.started: {:?}",
            f.journal()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let log = f.agent.log_text();
    assert!(
        log.contains("during the server starting, mark it as"),
        "the reason is logged: {log}"
    );
}

#[tokio::test]
async fn server_started_names_the_bad_field() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let call = |params: serde_json::Value| {
        let client = &client;
        async move {
            client
                .call::<_, serde_json::Value>("server.started", params)
                .await
                .unwrap_err()
        }
    };
    let e = call(serde_json::json!({"name": "velero/velero"})).await;
    assert_eq!(e.code(), Some(codes::INVALID_PARAMS));
    assert_eq!(
        e.to_string(),
        "params: missing field `instance` (code -32602)"
    );
    let e = call(serde_json::json!({"name": "velero/velero", "instance": ""})).await;
    assert_eq!(
        e.to_string(),
        "instance: must be non-empty printable text of at most 253 bytes (code -32602)"
    );
    let e = call(serde_json::json!({"name": "x".repeat(254), "instance": "i"})).await;
    assert_eq!(
        e.to_string(),
        "name: must be empty, NAME or NAMESPACE/NAME, each of lowercase letters, digits, '-' \
         and '.' beginning and ending with a letter or digit, at most 253 bytes (code -32602)"
    );
}

#[tokio::test]
async fn an_owner_no_call_touches_for_the_idle_timeout_fails_saying_since_when() {
    let f = Fixture::new(&["--in-progress-idle-timeout", "1s"]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    backups.start("abandoned", "u").await.unwrap();
    let before_call = time::OffsetDateTime::now_utc();
    backups
        .add_operations("abandoned", vec![operation(PLUGIN, "never-1", "a", &[])])
        .await
        .unwrap();
    let start = std::time::Instant::now();
    let owner = loop {
        let owner = backups.get("abandoned").await.unwrap();
        if owner.phase != OwnerPhase::InProgress {
            break owner;
        }
        assert!(start.elapsed() < LONG, "never failed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(owner.phase, OwnerPhase::Failed);
    let reason = owner.failure_reason.unwrap_or_default();
    let since = reason
        .strip_prefix("no call from the backup server since ")
        .and_then(|r| {
            r.strip_suffix(", longer than in_progress_idle_timeout (1s): InProgress abandoned")
        })
        .unwrap_or_else(|| panic!("unexpected reason {reason:?}"));
    let since =
        time::OffsetDateTime::parse(since, &time::format_description::well_known::Rfc3339).unwrap();
    assert!(
        since >= before_call - time::Duration::milliseconds(1),
        "the addOperations call counts: since {since}, called at {before_call}"
    );
    // Cancel follows in the background: wait, bounded.
    while !f
        .journal()
        .contains(&"cancel never-1 abandoned".to_string())
    {
        assert!(start.elapsed() < LONG, "no cancel: {:?}", f.journal());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn sigterm_finishes_cleanly_and_the_state_survives() {
    let mut f = Fixture::new(&[]).await;
    {
        let client = f.agent.client().await;
        client.backups().start("kept", "u").await.unwrap();
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

/// SIGTERM ends a wait at once (a client would have it until its timeout, and every stop
/// would take that long): it is answered with what it saw, as its timeout would.
#[tokio::test]
async fn sigterm_answers_a_running_wait_at_once_and_the_agent_stops() {
    use opmon_tests::raw;
    let mut f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    client.backups().start("b", "u").await.unwrap();
    let body = raw::request(
        "backup.wait",
        serde_json::json!({"name": "b", "until": "terminal", "timeout": "10m"}),
    );
    let mut waiting = raw::send(
        &f.agent.socket,
        format!("{}{body}", raw::post_head(body.len())).as_bytes(),
    );
    let read = opmon_tests::try_eventually(LONG, || raw::unread_by_agent(&waiting) == 0);
    assert!(read.is_some(), "the agent did not read the wait");

    let status = f.agent.terminate();
    assert!(status.success(), "{status}:\n{}", f.agent.log_text());
    let answer = raw::json_body(&raw::read_to_close(&mut waiting));
    assert_eq!(answer["result"]["timedOut"], true, "{answer}");
    assert_eq!(answer["result"]["owner"]["phase"], "InProgress", "{answer}");
    assert!(
        !f.agent.log_text().contains("left unanswered"),
        "{}",
        f.agent.log_text()
    );
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
    restores.start("running", "u").await.unwrap();
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

#[tokio::test]
async fn an_emptied_or_missing_database_is_refused_where_an_agent_has_run() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = Agent::start(dir.path(), &[]);
    {
        let client = agent.client().await;
        client.backups().start("kept", "u").await.unwrap();
    }
    assert!(agent.terminate().success());
    let db = agent.state_dir.join("agent.db");
    let storage = agent.state_dir.join("storage");
    for (damage, state) in [("truncated", "empty"), ("removed", "missing")] {
        match damage {
            "truncated" => std::fs::File::create(&db).map(drop).unwrap(),
            _ => std::fs::remove_file(&db).unwrap(),
        }
        let out = opmon_tests::agent_command()
            .arg("--socket")
            .arg(&agent.socket)
            .arg("--state-dir")
            .arg(&agent.state_dir)
            .env("OPMON_CONFIG", "/dev/null")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{damage}: started on it: {said}");
        assert!(
            said.contains(&format!(
                "the database {} is {state}, but an agent has run with the storage directory {} before",
                db.display(),
                storage.display()
            )) && said.contains("litestream restore")
                && said.contains("start_anew = true"),
            "{damage}: {said}"
        );
    }
    // Said explicitly, it starts with nothing.
    let mut anew = Agent::start(dir.path(), &["--start-anew", "true"]);
    let client = anew.client().await;
    let listed = client.backups().list().await.unwrap();
    assert!(listed.items.is_empty());
    drop(client);
    assert!(anew.terminate().success());
    // And the new database is guarded again.
    std::fs::File::create(&db).unwrap();
    let out = opmon_tests::agent_command()
        .arg("--socket")
        .arg(&anew.socket)
        .arg("--state-dir")
        .arg(&anew.state_dir)
        .env("OPMON_CONFIG", "/dev/null")
        .output()
        .unwrap();
    assert!(!out.status.success());
}
