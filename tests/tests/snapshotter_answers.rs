//! End-to-end: what a snapshotter's answers (or their absence) may cost the agent, against
//! the real agent and real snapshotters on real sockets: a silent snapshotter does not
//! hold `endInProgress`, and fat answers of a peer's snapshotters are held to a bound.

use std::time::{Duration, Instant};

use opmon_client::{OperationPhase, OwnerPhase, WaitUntil};
use opmon_tests::{operation, Fixture, PLUGIN};

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
    assert!(took < Duration::from_secs(16), "endInProgress took {took:?}");
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
