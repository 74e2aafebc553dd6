//! End-to-end: control over running operations (issue 16 items 1 to 3) against the real
//! agent and real snapshotter processes: cancel on demand (whole owners and chosen
//! operations, from the API and the CLI), stall and start deadlines (a snapshotter that
//! answers but never moves, one whose operation stays New, one that cannot be reached),
//! and retries of transient errors (socket and command snapshotters).
//!
//! Deadlines are short and the tests wait for the phase they cause; nothing sleeps to
//! let time pass.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use opmon_client::{
    codes, ApiVersion, CancelParams, GoDuration, OperationOfItem, OperationPhase,
    OperationSelector, OwnerPhase, Snapshotter, StartParams, WaitUntil,
};
use opmon_tests::{
    command_snapshotter_script, journal, operation, pvc, workspace_binary, Fixture, PLUGIN,
};

const LONG: Duration = Duration::from_secs(120);

/// The fixture's snapshotter registration, with `tune` applied.
fn copier(f: &Fixture, tune: impl FnOnce(&mut Snapshotter)) -> Snapshotter {
    let mut s = Snapshotter {
        name: PLUGIN.into(),
        api_version: ApiVersion::V2,
        socket: Some(f.snapshotter.socket.clone()),
        ..Default::default()
    };
    tune(&mut s);
    s
}

/// The API error of `result`, as (code, message).
fn api_error<T: std::fmt::Debug>(result: Result<T, opmon_client::Error>) -> (i32, String) {
    match result {
        Err(opmon_client::Error::Rpc { code, message, .. }) => (code.number(), message),
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn cancel(name: &str) -> CancelParams {
    CancelParams {
        name: name.into(),
        ..Default::default()
    }
}

fn ids(list: &[&str]) -> Option<Vec<OperationSelector>> {
    Some(
        list.iter()
            .map(|id| OperationSelector::Id(id.to_string()))
            .collect(),
    )
}

/// How many journal lines are exactly `line`.
fn count(journal: &[String], line: &str) -> usize {
    journal.iter().filter(|l| *l == line).count()
}

/// The owner `name`'s events after its first `skip` as `(reason, operation ID, caller
/// given, message)`.
async fn history(f: &Fixture, name: &str) -> Vec<(String, Option<String>, bool, String)> {
    let page = f
        .client
        .backups()
        .request::<opmon_client::methods::Events>(opmon_client::EventsParams {
            name: name.into(),
            uid: None,
            after: None,
            limit: Some(1000),
        })
        .await
        .unwrap();
    page.items
        .into_iter()
        .map(|e| {
            (
                e.reason.to_string(),
                e.operation.map(|o| o.operation_id),
                e.caller.is_some(),
                e.message,
            )
        })
        .collect()
}

/// The events of `history` from the first with reason `from` on.
fn from_reason(
    events: Vec<(String, Option<String>, bool, String)>,
    from: &str,
) -> Vec<(String, Option<String>, bool, String)> {
    let at = events
        .iter()
        .position(|e| e.0 == from)
        .unwrap_or_else(|| panic!("no {from} event in {events:#?}"));
    events[at..].to_vec()
}

fn ev(
    reason: &str,
    op: Option<&str>,
    called: bool,
    message: &str,
) -> (String, Option<String>, bool, String) {
    (
        reason.into(),
        op.map(str::to_string),
        called,
        message.into(),
    )
}

#[tokio::test]
async fn cancelling_a_whole_backup_cancels_its_operations_and_fails_it_with_the_reason() {
    let f = Fixture::new(&[]).await;
    let owner = f
        .backup("b")
        .operations([
            operation(PLUGIN, "gate-1", "a", &[]),
            operation(PLUGIN, "never-2", "b", &[]),
            operation(PLUGIN, "done-3", "c", &[]),
        ])
        .end_in_progress()
        .await;
    assert_eq!(owner.phase, OwnerPhase::WaitingForPluginOperations);
    let backups = f.client.backups();
    let result = backups
        .request::<opmon_client::methods::Cancel>(CancelParams {
            reason: Some("the operator stopped it".into()),
            ..cancel("b")
        })
        .await
        .unwrap();
    assert_eq!((result.canceled, result.unconfirmed), (2, 0));
    assert_eq!(result.owner.phase, OwnerPhase::Failed);
    assert_eq!(
        result.owner.failure_reason.as_deref(),
        Some("canceled: the operator stopped it")
    );
    assert_eq!(
        result.owner.operations_failed, 2,
        "canceled counts as failed"
    );
    assert_eq!(result.owner.operations_completed, 1);
    let journal = f.journal();
    assert_eq!(count(&journal, "cancel gate-1 b"), 1, "{journal:?}");
    assert_eq!(count(&journal, "cancel never-2 b"), 1, "{journal:?}");
    assert_eq!(count(&journal, "cancel done-3 b"), 0, "{journal:?}");

    let ops = backups.operations("b").await.unwrap();
    let phases: Vec<_> = ops
        .iter()
        .map(|o| (o.phase, o.error.as_deref().unwrap_or("")))
        .collect();
    assert_eq!(
        phases,
        [
            (
                OperationPhase::Canceled,
                "canceled: the operator stopped it"
            ),
            (
                OperationPhase::Canceled,
                "canceled: the operator stopped it"
            ),
            (OperationPhase::Completed, ""),
        ]
    );
    assert!(
        ops.iter().all(|o| !o.cancel_requested),
        "the calls are over"
    );

    // The history: the request with its caller, each operation it canceled, the owner's
    // failure, and the Cancel calls being over.
    let reason = "canceled: the operator stopped it";
    assert_eq!(
        from_reason(history(&f, "b").await, "CancelRequested"),
        [
            ev(
                "CancelRequested",
                None,
                true,
                "cancel of the whole backup asked for: the operator stopped it"
            ),
            ev(
                "OperationPhaseChanged",
                Some("gate-1"),
                true,
                &format!("InProgress → Canceled: {reason}")
            ),
            ev(
                "OperationPhaseChanged",
                Some("never-2"),
                true,
                &format!("InProgress → Canceled: {reason}")
            ),
            ev(
                "Failed",
                None,
                true,
                &format!("WaitingForPluginOperations → Failed: {reason}")
            ),
            ev(
                "CancelSent",
                None,
                false,
                "Cancel sent for 2 operations: 2 confirmed by their snapshotters, 0 not"
            ),
        ]
    );

    // Velero's file has no Canceled: it says Failed, with the reason in the error.
    let records = backups.item_operations("b").await.unwrap();
    assert_eq!(records[0].status.phase, OperationPhase::Failed);
    assert_eq!(records[0].status.error, "canceled: the operator stopped it");
    assert_eq!(records[2].status.phase, OperationPhase::Completed);

    // Twice: the owner is terminal now, and the error says so.
    assert_eq!(
        api_error(
            backups
                .request::<opmon_client::methods::Cancel>(cancel("b"))
                .await
        ),
        (
            codes::WRONG_PHASE,
            "backup b is Failed; cancel is allowed only while InProgress, \
             WaitingForPluginOperations or WaitingForPluginOperationsPartiallyFailed"
                .into()
        )
    );
    assert_eq!(
        api_error(
            backups
                .request::<opmon_client::methods::Cancel>(cancel("nobody"))
                .await
        ),
        (codes::NOT_FOUND, "backup nobody not found".into())
    );
}

#[tokio::test]
async fn cancelling_chosen_operations_leaves_the_others_running_and_the_owner_partially_failed() {
    let f = Fixture::new(&[]).await;
    let mut same_id_twice = operation(PLUGIN, "gate-x", "d", &[]);
    same_id_twice.resource = pvc("e");
    f.backup("b")
        .operations([
            operation(PLUGIN, "gate-1", "a", &[]),
            operation(PLUGIN, "gate-2", "b", &[]),
            operation(PLUGIN, "never-3", "c", &[]),
            operation(PLUGIN, "gate-x", "d", &[]),
            same_id_twice,
        ])
        .end_in_progress()
        .await;
    let backups = f.client.backups();

    // Wrong choices are refused, naming what was wrong; nothing changes.
    assert_eq!(
        api_error(
            backups
                .request::<opmon_client::methods::Cancel>(CancelParams {
                    operations: ids(&["gate-1", "nope"]),
                    ..cancel("b")
                })
                .await
        ),
        (
            codes::NOT_FOUND,
            "operations[1]: backup b has no operation \"nope\"".into()
        )
    );
    assert_eq!(
        api_error(
            backups
                .request::<opmon_client::methods::Cancel>(CancelParams {
                    operations: ids(&["gate-x"]),
                    ..cancel("b")
                })
                .await
        ),
        (
            codes::INVALID_PARAMS,
            "operations[0]: operation ID \"gate-x\" names 2 operations of backup b (items \
             persistentvolumeclaims app/d, persistentvolumeclaims app/e); give it as \
             {operationId, resource} to say which"
                .into()
        )
    );
    assert_eq!(
        api_error(
            backups
                .request::<opmon_client::methods::Cancel>(CancelParams {
                    operations: Some(Vec::new()),
                    ..cancel("b")
                })
                .await
        ),
        (
            codes::INVALID_PARAMS,
            "operations: must name at least one operation; leave it out to cancel the whole \
             owner"
                .into()
        )
    );
    let untouched = backups.operations("b").await.unwrap();
    assert!(untouched
        .iter()
        .all(|o| o.phase == OperationPhase::InProgress));

    let result = backups
        .request::<opmon_client::methods::Cancel>(CancelParams {
            operations: Some(vec![
                OperationSelector::Id("gate-1".into()),
                OperationSelector::Item(OperationOfItem {
                    operation_id: "gate-x".into(),
                    resource: pvc("e"),
                }),
            ]),
            ..cancel("b")
        })
        .await
        .unwrap();
    assert_eq!((result.canceled, result.unconfirmed), (2, 0));
    assert_eq!(
        result.owner.phase,
        OwnerPhase::WaitingForPluginOperationsPartiallyFailed
    );
    assert_eq!(result.owner.errors, 2);
    let journal = f.journal();
    assert_eq!(count(&journal, "cancel gate-1 b"), 1, "{journal:?}");
    assert_eq!(count(&journal, "cancel gate-x b"), 1, "{journal:?}");
    assert_eq!(count(&journal, "cancel gate-2 b"), 0, "{journal:?}");

    // A finished operation cannot be canceled again; the error names its phase.
    assert_eq!(
        api_error(
            backups
                .request::<opmon_client::methods::Cancel>(CancelParams {
                    operations: ids(&["gate-1"]),
                    ..cancel("b")
                })
                .await
        ),
        (
            codes::WRONG_PHASE,
            "operations[0]: operation \"gate-1\" of backup b (item persistentvolumeclaims \
             app/a) is Canceled; only New or InProgress operations can be canceled"
                .into()
        )
    );

    // The rest go on: once they finish, the backup finalizes, partially failed.
    f.open_gate("gate-2");
    f.open_gate("gate-x");
    backups
        .request::<opmon_client::methods::Cancel>(CancelParams {
            operations: ids(&["never-3"]),
            reason: Some("stuck".into()),
            ..cancel("b")
        })
        .await
        .unwrap();
    let owner = f.backup("b").wait(WaitUntil::ReadyToFinalize).await;
    assert_eq!(owner.phase, OwnerPhase::FinalizingPartiallyFailed);
    assert_eq!(
        (owner.operations_completed, owner.operations_failed),
        (2, 3)
    );
    let ops = backups.operations("b").await.unwrap();
    assert_eq!(ops[2].error.as_deref(), Some("canceled: stuck"));
    assert_eq!(
        api_error(
            backups
                .request::<opmon_client::methods::Cancel>(cancel("b"))
                .await
        )
        .1,
        "backup b is FinalizingPartiallyFailed; cancel is allowed only while InProgress, \
         WaitingForPluginOperations or WaitingForPluginOperationsPartiallyFailed"
    );
}

#[tokio::test]
async fn operations_canceled_while_in_progress_count_as_errors_when_it_ends() {
    let f = Fixture::new(&[]).await;
    f.backup("b")
        .operations([
            operation(PLUGIN, "done-1", "a", &[]),
            operation(PLUGIN, "gate-2", "b", &[]),
        ])
        .start()
        .await;
    let backups = f.client.backups();
    let result = backups
        .request::<opmon_client::methods::Cancel>(CancelParams {
            operations: ids(&["gate-2"]),
            ..cancel("b")
        })
        .await
        .unwrap();
    assert_eq!(result.owner.phase, OwnerPhase::InProgress);
    assert_eq!(result.owner.failure_reason, None);
    let owner = backups.end_in_progress("b").errors(1).await.unwrap();
    assert_eq!(owner.phase, OwnerPhase::FinalizingPartiallyFailed);
    assert_eq!(
        owner.errors, 2,
        "the server's one and the canceled operation"
    );
    let journal = f.journal();
    assert_eq!(count(&journal, "cancel gate-2 b"), 1, "{journal:?}");
    assert_eq!(count(&journal, "progress gate-2 b"), 0, "{journal:?}");
}

#[tokio::test]
async fn a_snapshotter_that_never_confirms_cancel_holds_the_call_one_deadline_and_the_owner_not_at_all(
) {
    let f = Fixture::new(&["--call-deadline", "500ms"]).await;
    f.backup("b")
        .operation(operation(PLUGIN, "never-1", "a", &[]))
        .end_in_progress()
        .await;
    f.open_gate("HANG");
    let client = f.client.clone();
    let call = tokio::spawn(async move {
        client
            .backups()
            .request::<opmon_client::methods::Cancel>(cancel("b"))
            .await
    });
    // While the Cancel call hangs, the decision is already visible.
    opmon_tests::eventually_async("the snapshotter holds the cancel", LONG, || {
        journal(&f.journal)
            .contains(&"held cancel never-1 b".to_string())
            .then_some(())
    })
    .await;
    let backups = f.client.backups();
    let ops = backups.operations("b").await.unwrap();
    assert!(ops[0].cancel_requested, "{ops:?}");
    assert_eq!(ops[0].phase, OperationPhase::Canceled);
    assert_eq!(backups.get("b").await.unwrap().phase, OwnerPhase::Failed);

    let result = call.await.unwrap().unwrap();
    assert_eq!((result.canceled, result.unconfirmed), (1, 1));
    assert_eq!(result.owner.phase, OwnerPhase::Failed);
    let ops = backups.operations("b").await.unwrap();
    assert!(
        !ops[0].cancel_requested,
        "abandoned calls are not outstanding"
    );
}

#[tokio::test]
async fn an_operation_whose_progress_stands_still_is_cancelled_and_failed_saying_what_it_saw_last()
{
    let f = Fixture::new(&[]).await;
    f.client
        .register_snapshotter(copier(&f, |s| {
            s.stall_timeout = Some(GoDuration::from_millis(1500))
        }))
        .await
        .unwrap();
    let listed = f.client.snapshotters().await.unwrap();
    assert_eq!(listed[0].stall_timeout, Some(GoDuration::from_millis(1500)));
    let backups = f.client.backups();
    // Backup a has the snapshotter's deadline; b its own, shorter one.
    f.backup("a")
        .operation(operation(PLUGIN, "never-1", "a", &[]))
        .end_in_progress()
        .await;
    backups
        .request::<opmon_client::methods::Start>(StartParams {
            name: "b".into(),
            uid: "u".into(),
            stall_timeout: Some(GoDuration::from_millis(700)),
            ..Default::default()
        })
        .await
        .unwrap();
    let b = f
        .backup("b")
        .operation(operation(PLUGIN, "never-2", "b", &[]))
        .end_in_progress()
        .await;
    assert_eq!(b.stall_timeout, Some(GoDuration::from_millis(700)));
    for (name, id, deadline) in [("a", "never-1", "1.5s"), ("b", "never-2", "700ms")] {
        let owner = f.backup(name).wait(WaitUntil::ReadyToFinalize).await;
        assert_eq!(owner.phase, OwnerPhase::FinalizingPartiallyFailed);
        let op = &backups.operations(name).await.unwrap()[0];
        assert_eq!(op.phase, OperationPhase::Failed);
        let prefix = format!("no progress for {deadline}: last 50 B of 100 B at 20");
        assert!(
            op.error.as_deref().unwrap_or("").starts_with(&prefix)
                && op.error.as_deref().unwrap_or("").ends_with('Z'),
            "{:?}",
            op.error
        );
        let journal = f.journal();
        assert_eq!(
            count(&journal, &format!("cancel {id} {name}")),
            1,
            "{journal:?}"
        );
    }
}

/// A deadline's Cancel is recorded with the failure it follows, confirmed or not.
#[tokio::test]
async fn a_deadline_cancel_the_snapshotter_never_confirms_is_recorded_as_unconfirmed() {
    let f = Fixture::new(&["--call-deadline", "500ms"]).await;
    f.client
        .register_snapshotter(copier(&f, |s| {
            s.stall_timeout = Some(GoDuration::from_millis(700))
        }))
        .await
        .unwrap();
    f.open_gate("HANG");
    f.backup("b")
        .operation(operation(PLUGIN, "never-1", "a", &[]))
        .end_in_progress()
        .await;
    let owner = f.backup("b").wait(WaitUntil::ReadyToFinalize).await;
    assert_eq!(owner.phase, OwnerPhase::FinalizingPartiallyFailed);
    assert!(journal(&f.journal).contains(&"held cancel never-1 b".to_string()));
    let events = from_reason(history(&f, "b").await, "DeadlineExceeded");
    let error = &f.client.backups().operations("b").await.unwrap()[0]
        .error
        .clone()
        .unwrap_or_default();
    // Both in the transaction that failed the operation, before the owner moved on.
    assert_eq!(
        events[..2],
        [
            ev("DeadlineExceeded", Some("never-1"), false, error),
            ev(
                "CancelSent",
                Some("never-1"),
                false,
                "Cancel sent after the deadline; not confirmed by the snapshotter within \
                 the call deadline"
            )
        ]
    );
}

#[tokio::test]
async fn an_operation_still_new_after_the_start_deadline_is_cancelled_and_failed() {
    let f = Fixture::new(&[]).await;
    f.client
        .register_snapshotter(copier(&f, |s| {
            s.start_timeout = Some(GoDuration::from_millis(600))
        }))
        .await
        .unwrap();
    let owner = f
        .backup("b")
        .operations([
            operation(PLUGIN, "idle-1", "a", &[]),
            operation(PLUGIN, "gate-2", "b", &[]),
        ])
        .end_in_progress()
        .await;
    assert_eq!(owner.phase, OwnerPhase::WaitingForPluginOperations);
    // idle-1 fails; gate-2 has started and is left alone.
    opmon_tests::eventually_async("idle-1 fails", LONG, || {
        let journal = f.journal();
        (count(&journal, "cancel idle-1 b") == 1).then_some(())
    })
    .await;
    f.open_gate("gate-2");
    let owner = f.backup("b").wait(WaitUntil::ReadyToFinalize).await;
    assert_eq!(owner.phase, OwnerPhase::FinalizingPartiallyFailed);
    let ops = f.client.backups().operations("b").await.unwrap();
    assert_eq!(
        ops[0].error.as_deref(),
        Some("not started after 600ms: still New")
    );
    assert_eq!(ops[1].phase, OperationPhase::Completed);
    let deadline = history(&f, "b")
        .await
        .into_iter()
        .find(|e| e.0 == "DeadlineExceeded");
    assert_eq!(
        deadline,
        Some(ev(
            "DeadlineExceeded",
            Some(&ops[0].operation_id),
            false,
            "not started after 600ms: still New"
        ))
    );
}

#[tokio::test]
async fn an_unreachable_snapshotter_is_caught_by_the_stall_deadline_before_its_grace() {
    let f = Fixture::new(&["--call-deadline", "200ms"]).await;
    let gone = Snapshotter {
        name: "example.io/gone".into(),
        api_version: ApiVersion::V2,
        socket: Some(f.dir.path().join("nobody.sock")),
        stall_timeout: Some(GoDuration::from_millis(800)),
        ..Default::default()
    };
    f.client.register_snapshotter(gone).await.unwrap();
    f.backup("b")
        .operation(operation("example.io/gone", "x-1", "a", &[]))
        .end_in_progress()
        .await;
    let owner = f.backup("b").wait(WaitUntil::ReadyToFinalize).await;
    assert_eq!(owner.phase, OwnerPhase::FinalizingPartiallyFailed);
    let op = &f.client.backups().operations("b").await.unwrap()[0];
    assert!(
        op.error
            .as_deref()
            .unwrap_or("")
            .starts_with("no progress for 800ms: nothing reported since 20"),
        "{:?}",
        op.error
    );
}

#[tokio::test]
async fn transient_errors_are_retried_with_backoff_until_the_snapshotter_answers() {
    let f = Fixture::new(&[]).await;
    f.client
        .register_snapshotter(copier(&f, |s| {
            s.retry_backoff = Some(GoDuration::from_millis(100))
        }))
        .await
        .unwrap();
    let owner = f
        .backup("b")
        .operation(operation(PLUGIN, "flaky-1", "a", &[]))
        .end_in_progress()
        .await;
    assert_eq!(
        owner.phase,
        OwnerPhase::WaitingForPluginOperations,
        "a transient error fails nothing"
    );
    let owner = f.backup("b").wait(WaitUntil::ReadyToFinalize).await;
    assert_eq!(owner.phase, OwnerPhase::Finalizing);
    let op = &f.client.backups().operations("b").await.unwrap()[0];
    assert_eq!(op.phase, OperationPhase::Completed);
    assert_eq!(op.attempts, 2);
    assert_eq!(
        op.last_error.as_deref(),
        Some("snapshotter example.io/copier: backend busy (call 2)")
    );
    assert_eq!(op.next_attempt_at, None);
    assert_eq!(count(&f.journal(), "progress flaky-1 b"), 3);
    // Each retry and the recovery are events of the agent (no caller).
    let events: Vec<_> = history(&f, "b")
        .await
        .into_iter()
        .filter(|e| ["Retrying", "Recovered"].contains(&e.0.as_str()))
        .map(|e| {
            (
                e.0,
                e.1,
                e.2,
                e.3.split("; next attempt at")
                    .next()
                    .unwrap_or("")
                    .to_string(),
            )
        })
        .collect();
    assert_eq!(
        events,
        [
            ev(
                "Retrying",
                Some("flaky-1"),
                false,
                "attempt 1 failed transiently: snapshotter example.io/copier: backend busy (call 1)"
            ),
            ev(
                "Retrying",
                Some("flaky-1"),
                false,
                "attempt 2 failed transiently: snapshotter example.io/copier: backend busy (call 2)"
            ),
            ev(
                "Recovered",
                Some("flaky-1"),
                false,
                "answered again after 2 transient errors"
            ),
        ]
    );
}

#[tokio::test]
async fn transient_errors_fail_the_operation_with_the_last_one_once_the_budget_is_spent() {
    let f = Fixture::new(&[]).await;
    f.client
        .register_snapshotter(copier(&f, |s| {
            s.retry_attempts = Some(2);
            s.retry_backoff = Some(GoDuration::from_millis(100));
        }))
        .await
        .unwrap();
    f.backup("b")
        .operation(operation(PLUGIN, "flakier-1", "a", &[]))
        .end_in_progress()
        .await;
    let owner = f.backup("b").wait(WaitUntil::ReadyToFinalize).await;
    assert_eq!(owner.phase, OwnerPhase::FinalizingPartiallyFailed);
    let op = &f.client.backups().operations("b").await.unwrap()[0];
    assert_eq!(op.phase, OperationPhase::Failed);
    assert_eq!(
        op.error.as_deref(),
        Some("snapshotter example.io/copier: backend busy (call 3)")
    );
    assert_eq!((op.attempts, op.next_attempt_at), (2, None));
    assert_eq!(count(&f.journal(), "progress flakier-1 b"), 3);
    let spent = history(&f, "b")
        .await
        .into_iter()
        .find(|e| e.0 == "OperationFailed");
    assert_eq!(
        spent,
        Some(ev(
            "OperationFailed",
            Some("flakier-1"),
            false,
            "retries spent after 2 attempts: snapshotter example.io/copier: backend busy (call 3)"
        ))
    );
}

#[tokio::test]
async fn a_command_that_exits_75_is_retried_and_other_failures_are_not() {
    let f = Fixture::new(&["--allow-api-command-snapshotters", "true"]).await;
    let journal_path = f.dir.path().join("command-journal");
    let script = command_snapshotter_script();
    let command = Snapshotter {
        name: "example.io/command".into(),
        api_version: ApiVersion::V2,
        command: Some(vec![
            script.to_string_lossy().into_owned(),
            journal_path.to_string_lossy().into_owned(),
            f.gates.to_string_lossy().into_owned(),
        ]),
        retry_backoff: Some(GoDuration::from_millis(100)),
        retry_attempts: Some(1000),
        ..Default::default()
    };
    f.client.register_snapshotter(command).await.unwrap();
    f.backup("b")
        .operations([
            operation("example.io/command", "busy-1", "a", &[]),
            operation("example.io/command", "broken-2", "b", &[]),
        ])
        .end_in_progress()
        .await;
    let backups = f.client.backups();
    let started = std::time::Instant::now();
    let op = loop {
        let ops = backups.operations("b").await.unwrap();
        if ops[0].attempts >= 2 {
            break ops[0].clone();
        }
        assert!(started.elapsed() < LONG, "busy-1 was not retried: {ops:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(op.phase, OperationPhase::New);
    assert!(
        op.last_error.as_deref().unwrap_or("").starts_with(
            "snapshotter example.io/command progress busy-1 failed transiently (exit status: 75): \
             backend busy"
        ),
        "{:?}",
        op.last_error
    );
    f.open_gate("busy-1");
    let owner = f.backup("b").wait(WaitUntil::ReadyToFinalize).await;
    assert_eq!(owner.phase, OwnerPhase::FinalizingPartiallyFailed);
    let ops = backups.operations("b").await.unwrap();
    assert_eq!(ops[0].phase, OperationPhase::Completed);
    assert_eq!((ops[1].phase, ops[1].attempts), (OperationPhase::Failed, 0));
    let broken = journal(&journal_path)
        .iter()
        .filter(|l| l.starts_with("progress broken-2 "))
        .count();
    assert_eq!(broken, 1, "a failure not marked transient is not retried");
}

fn opmon(socket: &Path, args: &[&str]) -> Output {
    Command::new(workspace_binary("opmon"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .expect("running opmon")
}

#[tokio::test]
async fn the_cli_cancels_and_says_plainly_what_it_could_not_cancel() {
    let f = Fixture::new(&[]).await;
    f.backup("b")
        .operations([
            operation(PLUGIN, "gate-1", "a", &[]),
            operation(PLUGIN, "gate-2", "b", &[]),
        ])
        .end_in_progress()
        .await;
    let socket = &f.agent.socket;
    let out = opmon(socket, &["backup", "cancel", "b", "--operation", "typo"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "opmon: --operation: backup b has no operation \"typo\" (code 1001)\n"
    );
    let out = opmon(
        socket,
        &[
            "backup",
            "cancel",
            "b",
            "--operation",
            "gate-1",
            "--reason",
            "not needed",
        ],
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "backup b: 1 operation canceled\nbackup b is WaitingForPluginOperationsPartiallyFailed\n"
    );
    assert_eq!(out.status.code(), Some(1), "the owner is partially failed");
    let out = opmon(socket, &["-o", "json", "backup", "cancel", "b"]);
    assert_eq!(out.status.code(), Some(2), "the owner Failed");
    let result: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(result["canceled"], 1);
    assert_eq!(
        result["owner"]["failureReason"],
        "canceled: canceled by request"
    );
    let out = opmon(socket, &["backup", "cancel", "b"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "opmon: backup b is Failed; cancel is allowed only while InProgress, \
         WaitingForPluginOperations or WaitingForPluginOperationsPartiallyFailed (code 1003)\n"
    );
}

#[tokio::test]
async fn a_cancel_cut_short_by_an_agent_crash_is_sent_again_when_it_restarts() {
    let mut f = Fixture::new(&[]).await;
    f.backup("b")
        .operation(operation(PLUGIN, "never-1", "a", &[]))
        .end_in_progress()
        .await;
    f.open_gate("HANG");
    let client = f.client.clone();
    let call = tokio::spawn(async move {
        client
            .backups()
            .request::<opmon_client::methods::Cancel>(cancel("b"))
            .await
    });
    opmon_tests::eventually_async("the snapshotter holds the cancel", LONG, || {
        journal(&f.journal)
            .contains(&"held cancel never-1 b".to_string())
            .then_some(())
    })
    .await;
    f.agent.kill9();
    assert!(
        call.await.unwrap().is_err(),
        "the answer was lost with the agent"
    );
    std::fs::remove_file(f.gates.join("HANG")).unwrap();
    f.agent.restart();
    let client = f.agent.client().await;
    let backups = client.backups();
    // The decision was committed before the crash; the Cancel call is made again.
    assert_eq!(backups.get("b").await.unwrap().phase, OwnerPhase::Failed);
    opmon_tests::eventually_async("Cancel is sent again", LONG, || {
        journal(&f.journal)
            .contains(&"cancel never-1 b".to_string())
            .then_some(())
    })
    .await;
    let started = std::time::Instant::now();
    while backups.operations("b").await.unwrap()[0].cancel_requested {
        assert!(started.elapsed() < LONG, "cancelRequested stays set");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let op = &backups.operations("b").await.unwrap()[0];
    assert_eq!(op.phase, OperationPhase::Canceled);
}

#[tokio::test]
async fn cancel_params_that_make_no_sense_are_refused_naming_the_field() {
    let f = Fixture::new(&[]).await;
    f.backup("b")
        .operation(operation(PLUGIN, "gate-1", "a", &[]))
        .start()
        .await;
    let mut http = opmon_tests::RawHttp::connect(&f.agent.socket);
    let refused = |http: &mut opmon_tests::RawHttp, params: &str| {
        let answer = http.call(&format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"backup.cancel","params":{params}}}"#
        ));
        (
            answer["error"]["code"].as_i64().unwrap_or(0),
            answer["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        )
    };
    let long = "x".repeat(1025);
    for (params, code, message) in [
        (
            r#"{"name":"b","operations":[123]}"#.to_string(),
            -32602,
            "operations[0]: expected an operation ID (a string) or {operationId, resource}, \
             got a number",
        ),
        (
            r#"{"name":"b","operations":[{"operationId":"gate-1"}]}"#.to_string(),
            -32602,
            "operations[0]: missing field `resource`",
        ),
        (
            r#"{"name":"b","operations":[""]}"#.to_string(),
            -32602,
            "operations[0].operationId: must not be empty",
        ),
        (
            format!(r#"{{"name":"b","reason":"{long}"}}"#),
            -32602,
            "reason: must be at most 1024 bytes (got 1025)",
        ),
        (
            r#"{"name":"b","force":true}"#.to_string(),
            -32602,
            "force: unknown field `force`, expected one of `name`, `operations`, `reason`",
        ),
        (
            r#"{"name":"b","operations":[{"operationId":"gate-1","resource":{"resource":"persistentvolumeclaims","namespace":"app","name":"zzz"}}]}"#.to_string(),
            1001,
            "operations[0]: backup b has no operation \"gate-1\" of item \
             persistentvolumeclaims app/zzz",
        ),
    ] {
        assert_eq!(
            refused(&mut http, &params),
            (code, message.to_string()),
            "{params}"
        );
    }
    let ops = f.client.backups().operations("b").await.unwrap();
    assert_eq!(ops[0].phase, OperationPhase::New, "nothing was canceled");
}

#[tokio::test]
async fn a_cancel_naming_many_operations_finds_each_and_refuses_an_ambiguous_one() {
    let f = Fixture::new(&[]).await;
    let mut ops: Vec<_> = (0..20)
        .map(|i| operation(PLUGIN, &format!("gate-{i}"), &format!("item-{i}"), &[]))
        .collect();
    ops.push(operation(PLUGIN, "gate-dup", "x", &[]));
    ops.push(operation(PLUGIN, "gate-dup", "y", &[]));
    f.backup("b").operations(ops).end_in_progress().await;
    let backups = f.client.backups();
    let mut chosen: Vec<String> = (0..17).map(|i| format!("gate-{i}")).collect();
    chosen.push("gate-dup".into());
    let as_ids = |list: &[String]| {
        Some(
            list.iter()
                .map(|id| OperationSelector::Id(id.clone()))
                .collect(),
        )
    };
    assert_eq!(
        api_error(
            backups
                .request::<opmon_client::methods::Cancel>(CancelParams {
                    operations: as_ids(&chosen),
                    ..cancel("b")
                })
                .await
        ),
        (
            codes::INVALID_PARAMS,
            "operations[17]: operation ID \"gate-dup\" names 2 operations of backup b (items \
             persistentvolumeclaims app/x, persistentvolumeclaims app/y); give it as \
             {operationId, resource} to say which"
                .into()
        )
    );
    chosen.pop();
    chosen.push("gate-3".into()); // twice: canceled once
    let result = backups
        .request::<opmon_client::methods::Cancel>(CancelParams {
            operations: as_ids(&chosen),
            ..cancel("b")
        })
        .await
        .unwrap();
    assert_eq!(result.canceled, 17);
    let ops = backups.operations("b").await.unwrap();
    let canceled: Vec<&str> = ops
        .iter()
        .filter(|o| o.phase == OperationPhase::Canceled)
        .map(|o| o.operation_id.as_str())
        .collect();
    let expected: Vec<String> = (0..17).map(|i| format!("gate-{i}")).collect();
    assert_eq!(canceled, expected);
}
