//! The Rust client's API against the real agent (issue 37): the one call style (required
//! arguments in the call, optional ones as builder methods), owned handles that move
//! into spawned tasks, typed errors that keep the agent's `data`, and the agent
//! refusing in params the catch-all values that let a client read a newer agent.

use std::time::Duration;

use opmon_client::codes::Code;
use opmon_client::{
    NewOperation, OperationPhase, OwnerPhase, PluginKind, ResourceIdentifier, WaitUntil,
};
use opmon_tests::{Agent, PLUGIN};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_runs_through_the_builder_calls_and_handles_move_into_tasks() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let agent = Agent::start(dir.path(), &[]);
    let client = agent.client().await;
    client
        .register_snapshotter(opmon_client::Snapshotter::v1(PLUGIN))
        .await
        .expect("snapshotter.register");

    let backups = client.backups();
    let owner = backups
        .start("b1", "uid-1")
        .item_operation_timeout(Duration::from_secs(600))
        .server("velero/velero", "pod-1")
        .await
        .expect("start");
    assert_eq!(owner.phase, OwnerPhase::InProgress);
    assert_eq!(owner.item_operation_timeout.0, Duration::from_secs(600));

    // The handle is owned: it moves into a task.
    let handle = backups.clone();
    let added = tokio::spawn(async move {
        let pvc = ResourceIdentifier::namespaced("persistentvolumeclaims", "app", "data");
        let op = NewOperation::new(PluginKind::BackupItemAction, PLUGIN, pvc, "copy-1");
        handle.add_operations("b1", vec![op]).await
    })
    .await
    .expect("the task")
    .expect("addOperations");
    assert_eq!(added.added, 1);

    // A v1 snapshotter's operation is only recorded: cancel the backup while it is
    // InProgress.
    let canceled = backups
        .cancel("b1")
        .reason("the test is done")
        .await
        .expect("cancel");
    assert_eq!(canceled.owner.phase, OwnerPhase::Failed);
    assert!(
        canceled
            .owner
            .failure_reason
            .as_ref()
            .is_some_and(|f| f.contains("the test is done")),
        "{:?}",
        canceled.owner
    );
    let waited = backups
        .wait("b1", WaitUntil::Terminal, Duration::from_secs(60))
        .await
        .expect("wait");
    assert!(waited.owner.phase.is_terminal());
    let canceled_ops = backups
        .operations("b1")
        .phases(vec![OperationPhase::Canceled])
        .await
        .expect("operations");
    assert_eq!(canceled_ops.len(), 1);

    // Without operations, endInProgress goes on to Finalizing and finalize completes.
    backups.start("b2", "uid-2").await.expect("start");
    let owner = backups
        .end_in_progress("b2")
        .warnings(2)
        .await
        .expect("endInProgress");
    assert_eq!((owner.phase, owner.warnings), (OwnerPhase::Finalizing, 2));
    let done = backups.finalize("b2").await.expect("finalize");
    assert_eq!(done.owner.phase, OwnerPhase::Completed);
    let page = backups
        .list()
        .phases(vec![OwnerPhase::Completed])
        .limit(10)
        .await
        .expect("list");
    let names: Vec<&str> = page.items.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, ["b2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_phase_error_says_the_phase_in_its_data() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let agent = Agent::start(dir.path(), &[]);
    let client = agent.client().await;
    let backups = client.backups();
    backups.start("b2", "u").await.expect("start");
    backups
        .end_in_progress("b2")
        .failed()
        .await
        .expect("endInProgress");

    let e = backups.end_in_progress("b2").await.unwrap_err();
    assert!(e.is_wrong_phase(), "{e:?}");
    assert_eq!(e.phase(), Some(OwnerPhase::Failed), "{e:?}");

    let e = backups.get("nobody").await.unwrap_err();
    assert!(e.is_not_found() && !e.is_wrong_phase(), "{e:?}");
    assert_eq!(e.rpc_code(), Some(Code::NotFound));
    backups.start("b2b", "u").await.expect("start");
    let e = backups.start("b2b", "another-uid").await.unwrap_err();
    assert!(e.is_already_exists(), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_refuses_values_it_does_not_know_in_params() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let agent = Agent::start(dir.path(), &[]);
    let client = agent.client().await;
    let backups = client.backups();
    backups.start("b3", "u").await.expect("start");

    let refused = |e: opmon_client::Error| {
        assert!(e.is_invalid_params(), "{e:?}");
        e.to_string()
    };
    let message = refused(
        client
            .call::<_, serde_json::Value>(
                "backup.list",
                serde_json::json!({"phases": ["Archived"]}),
            )
            .await
            .unwrap_err(),
    );
    assert!(
        message.starts_with("phases[0]: unknown value; expected one of New, "),
        "{message}"
    );
    let message = refused(
        client
            .call::<_, serde_json::Value>(
                "backup.operations",
                serde_json::json!({"name": "b3", "phases": ["InProgress", "Paused"]}),
            )
            .await
            .unwrap_err(),
    );
    assert!(message.starts_with("phases[1]: unknown value"), "{message}");
    let op = serde_json::json!({
        "plugin": {"kind": "ObjectStorePlugin", "name": PLUGIN},
        "resource": {"resource": "pods", "namespace": "app", "name": "p"},
        "operationId": "x",
    });
    let message = refused(
        client
            .call::<_, serde_json::Value>(
                "backup.addOperations",
                serde_json::json!({"name": "b3", "operations": [op]}),
            )
            .await
            .unwrap_err(),
    );
    assert!(
        message.starts_with("operations[0].plugin.kind: unknown value; expected one of BackupItemAction, RestoreItemAction, VolumeSnapshotter"),
        "{message}"
    );
    // What the client sends itself cannot be the catch-all: it is not in `ALL`.
    assert!(!OwnerPhase::ALL.contains(&OwnerPhase::Unknown));
}

/// The README's flow (start, add, end, follow the updates, finalize) ends: a backup
/// stops at Finalizing, which is not terminal, so following it must stop there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_flow_ends_finalized() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let agent = Agent::start(dir.path(), &[]);
    let client = agent.client().await;
    let backups = client.backups();
    backups.start("nightly-1", "3f5c9a").await.expect("start");
    backups
        .end_in_progress("nightly-1")
        .errors(2)
        .await
        .expect("endInProgress");
    let mut updates = backups.subscribe("nightly-1").await.expect("subscribe");
    let followed = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(update) = updates.next().await {
            let update = update.expect("an update");
            if update.owner.phase.is_finalizing() || update.owner.phase.is_terminal() {
                return Some(update.owner.phase);
            }
        }
        None
    })
    .await
    .expect("the updates stop at Finalizing");
    assert_eq!(followed, Some(OwnerPhase::FinalizingPartiallyFailed));
    let done = backups.finalize("nightly-1").await.expect("finalize");
    assert_eq!(done.owner.phase, OwnerPhase::PartiallyFailed);
}
