//! Prompt completion: a snapshotter's `snapshotter.changed` hint makes the agent poll the
//! named operations at once. The agents here poll every hour, so within a test only a
//! hint can explain a poll after `endInProgress`; and the poll, never the hint, decides
//! what is recorded.
//!
//! The snapshotter is the real `opmon-test-snapshotter` process, whose `gate.open`
//! finishes an operation inside the snapshotter and hints through the SDK's `Hints`.

use std::path::Path;
use std::time::{Duration, Instant};

use opmon_client::{
    codes, ApiVersion, Client, OperationPhase, OwnerKind, OwnerPhase, Snapshotter, WaitUntil,
};
use opmon_tests::{journal, operation, Agent, SdkSnapshotter, Steps, LONG};
use serde_json::json;

const PLUGIN: &str = "example.io/copier";

/// An agent that polls hourly, and the hinting snapshotter registered with it.
struct Setup {
    client: Client,
    snapshotter: SdkSnapshotter,
    journal: std::path::PathBuf,
    gates: std::path::PathBuf,
    _agent: Agent,
    _dir: tempfile::TempDir,
}

async fn setup() -> Setup {
    let dir = tempfile::tempdir().expect("temporary directory");
    let gates = dir.path().join("gates");
    std::fs::create_dir(&gates).expect("gates directory");
    let journal = dir.path().join("journal");
    let agent_socket = dir.path().join("run/agent.sock");
    let snapshotter = SdkSnapshotter::start_hinting(
        dir.path(),
        "copier",
        &gates,
        &journal,
        &agent_socket,
        PLUGIN,
    );
    let agent = Agent::start_polling_every(dir.path(), "1h", &[]);
    let client = agent.client().await;
    client
        .register_snapshotter(Snapshotter {
            name: PLUGIN.into(),
            api_version: ApiVersion::V2,
            socket: Some(snapshotter.socket.clone()),
            command: None,
            ..Default::default()
        })
        .await
        .expect("registering the snapshotter");
    Setup {
        client,
        snapshotter,
        journal,
        gates,
        _agent: agent,
        _dir: dir,
    }
}

/// The phase of operation `id` of backup `name`.
async fn phase_of(client: &Client, name: &str, id: &str) -> OperationPhase {
    client
        .backups()
        .operations(name)
        .await
        .expect("backup.operations")
        .into_iter()
        .find(|o| o.operation_id == id)
        .unwrap_or_else(|| panic!("{name} has no operation {id}"))
        .phase
}

/// Waits (at most [`LONG`], which only bounds a failure) until operation `id` of
/// backup `name` is `phase`.
async fn until_phase(client: &Client, name: &str, id: &str, phase: OperationPhase) {
    let began = Instant::now();
    let mut pause = Duration::from_millis(2);
    while phase_of(client, name, id).await != phase {
        assert!(
            began.elapsed() < LONG,
            "{id} of {name} did not become {phase} within {LONG:?}"
        );
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// How many Progress calls the snapshotter answered for `id`.
fn progress_calls(journal_path: &Path, id: &str) -> usize {
    let prefix = format!("progress {id} ");
    journal(journal_path)
        .iter()
        .filter(|l| l.starts_with(&prefix))
        .count()
}

/// Opens the gate of `id` through the snapshotter, which then hints the agent.
async fn finish_in_snapshotter(snapshotter: &SdkSnapshotter, id: &str) {
    let client = Client::connect(&snapshotter.socket)
        .await
        .expect("connecting to the snapshotter");
    client
        .call::<_, ()>("gate.open", json!({ "id": id }))
        .await
        .unwrap_or_else(|e| panic!("gate.open {id}: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hint_polls_the_named_operation_at_once_and_the_owner_moves_on() {
    let s = setup().await;
    let owner = Steps::new(&s.client, OwnerKind::Backup, "b1")
        .operations([
            operation(PLUGIN, "gate-1", "pvc-1", &[]),
            operation(PLUGIN, "gate-2", "pvc-2", &[]),
        ])
        .end_in_progress()
        .await;
    assert_eq!(owner.phase, OwnerPhase::WaitingForPluginOperations);

    // gate-2 finishes without a word to the agent; gate-1 with a hint.
    std::fs::write(s.gates.join("gate-2"), b"").expect("opening gate-2");
    finish_in_snapshotter(&s.snapshotter, "gate-1").await;
    until_phase(&s.client, "b1", "gate-1", OperationPhase::Completed).await;
    // Only the hinted operation was polled: gate-2 is done in the snapshotter, but the
    // agent has not asked since endInProgress.
    assert_eq!(
        phase_of(&s.client, "b1", "gate-2").await,
        OperationPhase::InProgress
    );
    assert_eq!(progress_calls(&s.journal, "gate-2"), 1);
    assert_eq!(progress_calls(&s.journal, "gate-1"), 2);

    finish_in_snapshotter(&s.snapshotter, "gate-2").await;
    let owner = Steps::new(&s.client, OwnerKind::Backup, "b1")
        .wait(WaitUntil::ReadyToFinalize)
        .await;
    assert_eq!(owner.phase, OwnerPhase::Finalizing);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hint_changes_nothing_by_itself() {
    let s = setup().await;
    Steps::new(&s.client, OwnerKind::Backup, "b2")
        .operation(operation(PLUGIN, "gate-3", "pvc-3", &[]))
        .end_in_progress()
        .await;
    // A hint for an operation that did not change: the agent asks, and records what
    // it is told (still 30 of 100).
    s.client
        .snapshotter_changed(PLUGIN)
        .operations(vec!["gate-3".into()])
        .await
        .expect("snapshotter.changed");
    opmon_tests::eventually_async("a second Progress call for gate-3", LONG, || {
        progress_calls(&s.journal, "gate-3") >= 2
    })
    .await;
    let ops = s
        .client
        .backups()
        .operations("b2")
        .await
        .expect("backup.operations");
    assert_eq!(ops[0].phase, OperationPhase::InProgress);
    assert_eq!(ops[0].n_completed, 30);
    let owner = s.client.backups().get("b2").await.expect("backup.get");
    assert_eq!(owner.phase, OwnerPhase::WaitingForPluginOperations);

    // A hint naming no operation polls all of the plugin's waiting operations.
    std::fs::write(s.gates.join("gate-3"), b"").expect("opening gate-3");
    s.client
        .snapshotter_changed(PLUGIN)
        .await
        .expect("snapshotter.changed");
    let owner = Steps::new(&s.client, OwnerKind::Backup, "b2")
        .wait(WaitUntil::ReadyToFinalize)
        .await;
    assert_eq!(owner.phase, OwnerPhase::Finalizing);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_hints_are_refused_naming_what_is_wrong() {
    let s = setup().await;
    let refused = |params: serde_json::Value| {
        let client = &s.client;
        async move {
            match client
                .call::<_, ()>("snapshotter.changed", params.clone())
                .await
            {
                Err(opmon_client::Error::Rpc { code, message, .. }) => (code.number(), message),
                other => panic!("snapshotter.changed {params}: expected an error, got {other:?}"),
            }
        }
    };
    assert_eq!(
        refused(json!({"plugin": "example.io/nobody"})).await,
        (
            codes::NOT_FOUND,
            "snapshotter example.io/nobody not found".to_string()
        )
    );
    assert_eq!(
        refused(json!({"plugin": PLUGIN, "operations": [""]})).await,
        (
            codes::INVALID_PARAMS,
            "operations[0]: must not be empty".to_string()
        )
    );
    let many: Vec<String> = (0..1001).map(|i| format!("op-{i}")).collect();
    assert_eq!(
        refused(json!({"plugin": PLUGIN, "operations": many})).await,
        (
            codes::INVALID_PARAMS,
            "operations: at most 1000 operation IDs (got 1001); leave it out to have all of \
             the plugin's operations polled"
                .to_string()
        )
    );
    assert_eq!(
        refused(json!({"plugin": "a/b/c"})).await,
        (
            codes::INVALID_PARAMS,
            "plugin: must have exactly two parts separated by '/' (<DNS subdomain>/<non-empty \
             name>)"
                .to_string()
        )
    );
    assert_eq!(
        refused(json!({"plugin": PLUGIN, "operation": ["x"]}))
            .await
            .0,
        codes::INVALID_PARAMS
    );
    // A legacy plugin name maps to velero.io/<name>, as in snapshotter.register.
    assert_eq!(
        refused(json!({"plugin": "copier"})).await,
        (
            codes::NOT_FOUND,
            "snapshotter velero.io/copier not found".to_string()
        )
    );
}
