//! End-to-end: the client library against the real agent killed (SIGKILL), stopped
//! (SIGSTOP) and restarted. Calls go on after a restart without a new client, a
//! subscription resumes with the full state, a stopped agent makes `connect` and calls
//! time out instead of hanging, and a stream says why it ended.

use std::time::Duration;

use nix::sys::signal::Signal;
use opmon_client::{Client, Error, OwnerPhase, WaitUntil};
use opmon_tests::{operation, Fixture, PLUGIN};

/// Polls `cond` until it holds (a condition on files the processes write, checked in a
/// bounded loop; never a sleep standing in for an event). Yields to the runtime, which
/// runs the request being waited on.
async fn until(what: &str, cond: impl Fn() -> bool) {
    opmon_tests::eventually_async(what, Duration::from_secs(60), cond).await
}

#[tokio::test]
async fn calls_succeed_after_the_agent_is_killed_and_restarted() {
    let mut f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    backups.start("b", "u").await.unwrap();

    f.agent.kill9();
    f.agent.restart();
    // The same client, its pooled connection dead: the call goes through.
    assert_eq!(backups.get("b").await.unwrap().uid, "u");

    // A call made while the agent is down waits for it (within the call timeout).
    f.agent.kill9();
    let clone = client.clone();
    let pending = tokio::spawn(async move { clone.backups().get("b").await });
    f.agent.restart();
    assert_eq!(pending.await.unwrap().unwrap().name, "b");
    assert_eq!(client.status().await.unwrap().owners.len(), 1);
}

#[tokio::test]
async fn a_subscription_resumes_with_the_full_state_after_a_restart() {
    let mut f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    let owner = opmon_tests::start_and_end_in_progress(
        &backups,
        "watched",
        vec![
            operation(PLUGIN, "gate-a", "a", &[]),
            operation(PLUGIN, "done-b", "b", &[]),
        ],
    )
    .await;
    assert_eq!(owner.phase, OwnerPhase::WaitingForPluginOperations);
    let mut updates = backups.subscribe("watched").await.unwrap();
    let first = updates.next().await.unwrap().unwrap();
    assert!(!first.resumed);
    assert_eq!(first.operations.len(), 2);

    f.agent.kill9();
    f.agent.restart();
    f.open_gate("gate-a");
    // Updates sent before the kill may still be read; the first after it is marked.
    let resumed = loop {
        let update = updates.next().await.unwrap().unwrap();
        if update.resumed {
            break update;
        }
    };
    assert_eq!(
        resumed.operations.len(),
        2,
        "a resumed update carries every operation"
    );
    let mut last = resumed;
    while last.owner.phase != OwnerPhase::Finalizing {
        last = updates.next().await.unwrap().unwrap();
        assert!(
            !last.resumed,
            "only the first update after a reconnect is marked"
        );
    }
    assert_eq!(last.owner.operations_completed, 2);
}

#[tokio::test]
async fn connect_and_calls_to_a_stopped_agent_time_out_naming_the_socket() {
    let mut f = Fixture::new(&[]).await;
    let client = Client::builder(&f.agent.socket)
        .call_timeout(Duration::from_millis(500))
        .connect()
        .await
        .unwrap();
    f.agent.signal(Signal::SIGSTOP);
    let e = Client::builder(&f.agent.socket)
        .connect_timeout(Duration::from_millis(300))
        .connect()
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "connecting to the opmon agent at {} timed out after 300ms",
            f.agent.socket.display()
        )
    );
    assert!(e.is_transport());
    let e = client.status().await.unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "the call agent.status at {} timed out after 500ms",
            f.agent.socket.display()
        )
    );
    f.agent.signal(Signal::SIGCONT);
    // Once it goes on, the same client works again.
    client.status().await.unwrap();

    // A killed agent leaves its socket file behind: nothing listens, connect fails
    // at once and says why.
    f.agent.kill9();
    let e = Client::connect(&f.agent.socket).await.unwrap_err();
    assert_eq!(
        e.chain(),
        format!(
            "cannot connect to the opmon agent at {}: Connection refused (os error 111)",
            f.agent.socket.display()
        )
    );
    let source = std::error::Error::source(&e).unwrap();
    assert_eq!(
        source.downcast_ref::<std::io::Error>().unwrap().kind(),
        std::io::ErrorKind::ConnectionRefused
    );
    // The client that had reached it tries again until its call timeout, then says
    // for how long, not only the last refusal.
    let e = client.status().await.unwrap_err();
    assert!(matches!(e, Error::AgentGone { .. }), "{e:?}");
    assert_eq!(
        e.chain(),
        format!(
            "lost the opmon agent at {0} and it did not come back within 500ms: \
             cannot connect to the opmon agent at {0}: Connection refused (os error 111)",
            f.agent.socket.display()
        )
    );
}

#[tokio::test]
async fn a_stream_ends_with_an_error_when_the_agent_goes_away_for_good() {
    let mut f = Fixture::new(&[]).await;
    let client = Client::builder(&f.agent.socket)
        .call_timeout(Duration::from_millis(500))
        .connect()
        .await
        .unwrap();
    let backups = client.backups();
    opmon_tests::start_and_end_in_progress(
        &backups,
        "orphaned",
        vec![operation(PLUGIN, "never-1", "a", &[])],
    )
    .await;
    let mut updates = backups.subscribe("orphaned").await.unwrap();
    updates.next().await.unwrap().unwrap();
    f.agent.kill9();
    let e = loop {
        match updates.next().await {
            Some(Ok(_)) => continue,
            Some(Err(e)) => break e,
            None => panic!("the stream ended without saying why"),
        }
    };
    assert!(matches!(e, Error::AgentGone { .. }), "{e:?}");
    assert_eq!(
        e.chain(),
        format!(
            "lost the opmon agent at {0} and it did not come back within 500ms: \
             cannot connect to the opmon agent at {0}: Connection refused (os error 111)",
            f.agent.socket.display()
        )
    );
    assert!(updates.next().await.is_none());
}

#[tokio::test]
async fn a_deleted_owner_ends_the_stream_saying_so() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    opmon_tests::start_and_end_in_progress(
        &backups,
        "doomed",
        vec![operation(PLUGIN, "never-1", "a", &[])],
    )
    .await;
    let mut updates = backups.subscribe("doomed").await.unwrap();
    updates.next().await.unwrap().unwrap();
    backups.delete("doomed").await.unwrap();
    let e = loop {
        match updates.next().await {
            Some(Ok(_)) => continue,
            Some(Err(e)) => break e,
            None => panic!("the stream ended without saying why"),
        }
    };
    assert_eq!(
        e.to_string(),
        "backup doomed: the agent ended the subscription: backup doomed was deleted"
    );
    assert!(updates.next().await.is_none());
    // An ended stream goes on answering `None` when asked again (as a select! loop may).
    assert!(updates.next().await.is_none());
    // Subscribing to an owner that does not exist fails at once with the agent's code.
    let e = backups.subscribe("doomed").await.unwrap_err();
    assert_eq!(e.code(), Some(opmon_client::codes::NOT_FOUND));
}

#[tokio::test]
async fn an_end_in_progress_lost_with_the_agent_is_not_repeated_but_a_wait_is() {
    let mut f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    let waiting = opmon_tests::start_and_end_in_progress(
        &backups,
        "waiting",
        vec![operation(PLUGIN, "gate-w", "a", &[])],
    )
    .await;
    assert_eq!(waiting.phase, OwnerPhase::WaitingForPluginOperations);
    backups.start("held", "u").await.unwrap();
    backups
        .add_operations("held", vec![operation(PLUGIN, "gate-h", "a", &[])])
        .await
        .unwrap();
    // endInProgress polls the operation once; the snapshotter holds that call, so the
    // request is inside the agent when the agent dies.
    f.open_gate("HANG");
    let clone = client.clone();
    let ending = tokio::spawn(async move { clone.backups().end_in_progress("held").await });
    until("the agent asked the snapshotter", || {
        f.journal().iter().any(|l| l == "held progress gate-h held")
    })
    .await;
    f.agent.kill9();
    let e = ending.await.unwrap().unwrap_err();
    assert_eq!(
        e.to_string(),
        "the connection to the opmon agent broke after backup.endInProgress was sent; \
         it may or may not have been applied"
    );
    assert!(matches!(e, Error::Interrupted { .. }));

    std::fs::remove_file(f.gates.join("HANG")).unwrap();
    f.agent.restart();
    // Here it was not applied: reading back says so (the agent of 28b59f4 fails
    // InProgress owners at its start; issue 12.1 keeps them InProgress).
    let phase = backups.get("held").await.unwrap().phase;
    assert!(
        matches!(phase, OwnerPhase::InProgress | OwnerPhase::Failed),
        "{phase}"
    );
    // A wait across a kill and restart is simply asked again.
    let clone = client.clone();
    let waiting = tokio::spawn(async move {
        clone
            .backups()
            .wait(
                "waiting",
                WaitUntil::ReadyToFinalize,
                Duration::from_secs(120),
            )
            .await
    });
    f.agent.kill9();
    f.agent.restart();
    f.open_gate("gate-w");
    let waited = waiting.await.unwrap().unwrap();
    assert!(!waited.timed_out);
    assert_eq!(waited.owner.phase, OwnerPhase::Finalizing);
}
