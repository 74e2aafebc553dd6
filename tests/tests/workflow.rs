//! End-to-end: backups and restores through their phases, against the real agent and
//! real snapshotter processes.

use std::time::Duration;

use opmon_client::{
    codes, ApiVersion, ListParams, OperationPhase, OwnerPhase, Snapshotter, StartParams, WaitUntil,
};
use opmon_tests::{command_snapshotter_script, operation, pvc, restore_operation, Fixture, PLUGIN};

const LONG: Duration = Duration::from_secs(120);

#[tokio::test]
async fn completed_operations_take_a_backup_to_finalizing_with_the_union_of_post_items() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    let owner = backups.start("nightly-1", "uid-1").await.unwrap();
    assert_eq!(owner.phase, OwnerPhase::InProgress);
    let added = backups
        .add_operations(
            "nightly-1",
            vec![
                operation(PLUGIN, "done-1", "data", &["vsb-data", "shared"]),
                operation(PLUGIN, "gate-2", "logs", &["shared", "vsb-logs"]),
            ],
        )
        .await
        .unwrap();
    assert_eq!((added.added, added.already_known), (2, 0));

    let owner = backups.end_in_progress("nightly-1").await.unwrap();
    assert_eq!(owner.phase, OwnerPhase::WaitingForPluginOperations);
    assert_eq!(
        owner.operations_completed, 1,
        "done-1 finished at the immediate poll"
    );
    assert_eq!(
        owner.post_operation_items, None,
        "set only once nothing is unfinished"
    );

    f.open_gate("gate-2");
    let waited = backups
        .wait("nightly-1", WaitUntil::ReadyToFinalize, LONG)
        .await
        .unwrap();
    assert!(!waited.timed_out);
    let owner = waited.owner;
    assert_eq!(owner.phase, OwnerPhase::Finalizing);
    assert_eq!(
        (
            owner.operations_attempted,
            owner.operations_completed,
            owner.operations_failed
        ),
        (2, 2, 0)
    );
    assert_eq!(
        owner.post_operation_items,
        Some(vec![pvc("shared"), pvc("vsb-data"), pvc("vsb-logs")])
    );
    let ops = backups.operations("nightly-1").await.unwrap();
    assert!(ops.iter().all(|o| o.phase == OperationPhase::Completed));
    assert_eq!(ops[1].n_completed, 100);
    assert_eq!(ops[1].operation_units, "byte");
    assert!(ops[1].started.is_some());
}

#[tokio::test]
async fn one_failed_operation_makes_the_backup_finalizing_partially_failed() {
    let f = Fixture::new(&[]).await;
    let b = f
        .backup("b")
        .operation(operation(PLUGIN, "fail-1", "a", &[]))
        .operation(operation(PLUGIN, "gate-2", "b", &[]));
    let owner = b.end_in_progress().await;
    assert_eq!(
        owner.phase,
        OwnerPhase::WaitingForPluginOperationsPartiallyFailed
    );
    assert_eq!(owner.errors, 1);
    f.open_gate("gate-2");
    let owner = b.wait(WaitUntil::ReadyToFinalize).await;
    assert_eq!(owner.phase, OwnerPhase::FinalizingPartiallyFailed);
    assert_eq!(owner.operations_failed, 1);
    let failed = f
        .client
        .backups()
        .operations("b")
        .phases(vec![OperationPhase::Failed])
        .await
        .unwrap();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].operation_id, "fail-1");
    assert_eq!(failed[0].error.as_deref(), Some("copy failed"));
}

#[tokio::test]
async fn errors_reported_at_end_of_in_progress_carry_into_waiting_partially_failed() {
    let f = Fixture::new(&[]).await;
    let b = f
        .backup("b")
        .operation(operation(PLUGIN, "gate-1", "a", &[]))
        .errors(3)
        .warnings(2);
    let owner = b.end_in_progress().await;
    assert_eq!(
        owner.phase,
        OwnerPhase::WaitingForPluginOperationsPartiallyFailed
    );
    assert_eq!((owner.errors, owner.warnings), (3, 2));
    f.open_gate("gate-1");
    let owner = b.wait(WaitUntil::ReadyToFinalize).await;
    assert_eq!(owner.phase, OwnerPhase::FinalizingPartiallyFailed);
}

#[tokio::test]
async fn timed_out_operation_is_cancelled_then_failed() {
    let f = Fixture::new(&[]).await;
    let slow = f
        .backup("slow")
        .item_operation_timeout(Duration::from_secs(1))
        .operation(operation(PLUGIN, "never-1", "a", &[]));
    let owner = slow.end_in_progress().await;
    assert_eq!(owner.phase, OwnerPhase::WaitingForPluginOperations);
    let owner = slow.wait(WaitUntil::ReadyToFinalize).await;
    assert_eq!(owner.phase, OwnerPhase::FinalizingPartiallyFailed);
    let ops = f.client.backups().operations("slow").await.unwrap();
    assert_eq!(ops[0].phase, OperationPhase::Failed);
    assert_eq!(
        ops[0].error.as_deref(),
        Some("Asynchronous action timed out")
    );
    let journal = f.journal();
    let cancel = journal.iter().position(|l| l == "cancel never-1 slow");
    assert!(cancel.is_some(), "snapshotter saw no cancel: {journal:?}");
}

#[tokio::test]
async fn a_restore_goes_straight_to_completed() {
    let f = Fixture::new(&[]).await;
    let owner = f
        .restore("r1")
        .operation(operation(PLUGIN, "done-1", "a", &[]))
        .end_in_progress()
        .await;
    assert_eq!(owner.phase, OwnerPhase::Completed);
    assert!(owner.completed.is_some());

    let r2 = f
        .restore("r2")
        .operation(operation(PLUGIN, "gate-r2", "a", &[]));
    let owner = r2.end_in_progress().await;
    assert_eq!(owner.phase, OwnerPhase::WaitingForPluginOperations);
    f.open_gate("gate-r2");
    let owner = r2.wait(WaitUntil::Terminal).await;
    assert_eq!(owner.phase, OwnerPhase::Completed);
    // Backups and restores are separate name spaces.
    assert_eq!(
        f.client.backups().get("r1").await.unwrap_err().code(),
        Some(codes::NOT_FOUND)
    );
}

#[tokio::test]
async fn failed_true_fails_the_backup_and_cancels_unfinished_operations() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    backups.start("doomed", "u").await.unwrap();
    backups
        .add_operations(
            "doomed",
            vec![
                operation(PLUGIN, "never-1", "a", &[]),
                operation(PLUGIN, "never-2", "b", &[]),
            ],
        )
        .await
        .unwrap();
    let owner = backups
        .end_in_progress("doomed")
        .errors(1)
        .failed()
        .await
        .unwrap();
    assert_eq!(owner.phase, OwnerPhase::Failed);
    assert_eq!(
        owner.failure_reason.as_deref(),
        Some("the backup server ended InProgress with failed: true")
    );
    assert_eq!(backups.get("doomed").await.unwrap(), owner);
    assert!(
        f.agent
            .log_text()
            .contains("the backup server ended InProgress with failed: true"),
        "the reason is logged"
    );
    let journal = f.journal();
    for id in ["never-1", "never-2"] {
        assert!(
            journal.contains(&format!("cancel {id} doomed")),
            "{journal:?}"
        );
        assert!(
            !journal.contains(&format!("progress {id} doomed")),
            "a failed backup is not polled"
        );
    }
    let ops = backups.operations("doomed").await.unwrap();
    assert!(ops.iter().all(|o| o.phase == OperationPhase::Failed
        && o.error.as_deref() == Some("canceled: the backup failed")));
}

#[tokio::test]
async fn snapshotter_errors_unknown_plugins_and_v1_snapshotters_are_handled_as_specified() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    client
        .register_snapshotter(Snapshotter {
            name: "example.io/legacy".into(),
            api_version: ApiVersion::V1,
            socket: None,
            command: None,
            ..Default::default()
        })
        .await
        .unwrap();
    let backups = client.backups();
    let owner = opmon_tests::start_and_end_in_progress(
        &backups,
        "mixed",
        vec![
            operation(PLUGIN, "unsupported-1", "a", &[]),
            operation(PLUGIN, "forgotten-2", "b", &[]),
            operation("example.io/nobody", "x-3", "c", &[]),
            operation("example.io/legacy", "snap-4", "d", &[]),
        ],
    )
    .await;
    assert_eq!(owner.phase, OwnerPhase::FinalizingPartiallyFailed);
    assert_eq!(
        (owner.operations_failed, owner.operations_completed),
        (3, 1)
    );
    let ops = backups.operations("mixed").await.unwrap();
    assert!(
        ops[0]
            .error
            .as_deref()
            .unwrap_or("")
            .starts_with("OperationsNotSupported: "),
        "{:?}",
        ops[0].error
    );
    assert!(
        ops[1]
            .error
            .as_deref()
            .unwrap_or("")
            .starts_with("InvalidOperationId: "),
        "{:?}",
        ops[1].error
    );
    assert_eq!(
        ops[2].error.as_deref(),
        Some("no snapshotter is registered for plugin example.io/nobody")
    );
    assert_eq!(
        ops[3].phase,
        OperationPhase::Completed,
        "v1 adapter completes at first poll"
    );
}

#[tokio::test]
async fn a_command_snapshotter_is_run_per_call_with_the_owner_in_its_environment() {
    let f = Fixture::new(&["--allow-api-command-snapshotters", "true"]).await;
    let client = f.agent.client().await;
    let journal = f.dir.path().join("command-journal");
    client
        .register_snapshotter(Snapshotter {
            name: "example.io/script".into(),
            api_version: ApiVersion::V2,
            socket: None,
            command: Some(vec![
                "/bin/sh".into(),
                command_snapshotter_script().display().to_string(),
                journal.display().to_string(),
                f.gates.display().to_string(),
            ]),
            ..Default::default()
        })
        .await
        .unwrap();
    let backups = client.backups();
    backups.start("scripted", "uid-9").await.unwrap();
    backups
        .add_operations(
            "scripted",
            vec![
                operation("example.io/script", "done-1", "a", &[]),
                operation("example.io/script", "gate-2", "b", &[]),
                operation("example.io/script", "broken-3", "c", &[]),
                operation("example.io/script", "garbage-4", "d", &[]),
            ],
        )
        .await
        .unwrap();
    let owner = backups.end_in_progress("scripted").await.unwrap();
    assert_eq!(
        owner.phase,
        OwnerPhase::WaitingForPluginOperationsPartiallyFailed
    );
    f.open_gate("gate-2");
    let owner = backups
        .wait("scripted", WaitUntil::ReadyToFinalize, LONG)
        .await
        .unwrap()
        .owner;
    assert_eq!(owner.phase, OwnerPhase::FinalizingPartiallyFailed);
    let ops = backups.operations("scripted").await.unwrap();
    assert_eq!(ops[0].phase, OperationPhase::Completed);
    assert_eq!(
        (ops[0].n_completed, ops[0].operation_units.as_str()),
        (7, "file")
    );
    assert_eq!(ops[1].phase, OperationPhase::Completed);
    assert!(
        ops[2]
            .error
            .as_deref()
            .unwrap_or("")
            .ends_with(": volume broken-3 is gone"),
        "{:?}",
        ops[2].error
    );
    assert!(
        ops[3]
            .error
            .as_deref()
            .unwrap_or("")
            .contains("invalid progress"),
        "{:?}",
        ops[3].error
    );
    let lines = opmon_tests::journal(&journal);
    assert!(
        lines.contains(&"progress done-1 backup/scripted uid-9 example.io/script".to_string()),
        "{lines:?}"
    );
}

#[tokio::test]
async fn a_hung_snapshotter_does_not_stall_another_snapshotters_operations() {
    // The hung snapshotter's calls get a deadline far beyond this test's waits.
    let f = Fixture::new(&["--call-deadline", "10m"]).await;
    let hung_gates = f.dir.path().join("hung-gates");
    std::fs::create_dir(&hung_gates).unwrap();
    let hung = opmon_tests::SdkSnapshotter::start(
        f.dir.path(),
        "hung",
        &hung_gates,
        &f.dir.path().join("hung-journal"),
    );
    let client = f.agent.client().await;
    client
        .register_snapshotter(Snapshotter {
            name: "example.io/hung".into(),
            api_version: ApiVersion::V2,
            socket: Some(hung.socket.clone()),
            command: None,
            ..Default::default()
        })
        .await
        .unwrap();
    let backups = client.backups();
    backups.start("stuck", "u").await.unwrap();
    backups
        .add_operations(
            "stuck",
            vec![operation("example.io/hung", "gate-s", "a", &[])],
        )
        .await
        .unwrap();
    assert_eq!(
        backups.end_in_progress("stuck").await.unwrap().phase,
        OwnerPhase::WaitingForPluginOperations
    );
    // From now on every call to the hung snapshotter blocks.
    opmon_tests::open_gate(&hung_gates, "HANG");

    opmon_tests::start_and_end_in_progress(
        &backups,
        "healthy",
        vec![operation(PLUGIN, "gate-h", "a", &[])],
    )
    .await;
    f.open_gate("gate-h");
    let waited = backups
        .wait("healthy", WaitUntil::ReadyToFinalize, LONG)
        .await
        .unwrap();
    assert!(!waited.timed_out);
    assert_eq!(waited.owner.phase, OwnerPhase::Finalizing);
    // Progress of the healthy snapshotter kept its cadence: several polls answered.
    let polls = f
        .journal()
        .iter()
        .filter(|l| l.starts_with("progress gate-h"))
        .count();
    assert!(
        polls >= 2,
        "the healthy snapshotter was polled {polls} times"
    );
    assert_eq!(
        backups.get("stuck").await.unwrap().phase,
        OwnerPhase::WaitingForPluginOperations
    );
}

#[tokio::test]
async fn start_is_idempotent_per_uid_and_operations_per_plugin_and_id() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    let first = backups.start("b", "uid-a").await.unwrap();
    let again = backups.start("b", "uid-a").await.unwrap();
    assert_eq!(first, again);
    let other = backups.start("b", "uid-b").await.unwrap_err();
    assert_eq!(other.code(), Some(codes::ALREADY_EXISTS));
    assert_eq!(
        other.to_string(),
        "backup b already exists with uid uid-a and is still InProgress: its name goes to a \
         new uid only once it has ended (a backup server reuses a name only after the object \
         of that name is gone, and this one's operations are still monitored); cancel or \
         delete it first (`opmon backup cancel b`, `opmon backup delete b`) (code 1002)"
    );

    let ops = vec![
        operation(PLUGIN, "gate-1", "a", &[]),
        operation(PLUGIN, "gate-2", "b", &[]),
    ];
    backups.add_operations("b", ops.clone()).await.unwrap();
    let again = backups.add_operations("b", ops).await.unwrap();
    assert_eq!((again.added, again.already_known), (0, 2));
    assert_eq!(backups.get("b").await.unwrap().operations_attempted, 2);
}

/// Velero's identity is name and uid: a Backup deleted without a call to the agent
/// (no DeleteItemAction: a backup with no tarball, every restore) leaves its owner, and
/// a new Backup of the same name (a new uid) starts once that owner has ended. The old
/// owner is retired, not lost: found by its uid, listed by `history`, with its
/// operations and events.
#[tokio::test]
async fn a_new_uid_takes_the_name_of_an_ended_owner_which_is_kept_retired() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    backups.start("b", "uid-a").finalize(false).await.unwrap();
    backups
        .add_operations("b", vec![operation(PLUGIN, "gate-r", "data", &[])])
        .await
        .unwrap();
    backups.end_in_progress("b").failed().await.unwrap();

    let new = backups.start("b", "uid-b").await.unwrap();
    assert_eq!(
        (new.uid.as_str(), new.phase),
        ("uid-b", OwnerPhase::InProgress)
    );
    assert_eq!(new.retired, None);
    // Every call by name means the current owner.
    assert_eq!(backups.get("b").await.unwrap().uid, "uid-b");
    assert!(backups.operations("b").await.unwrap().is_empty());
    let listed = backups.list().await.unwrap();
    assert_eq!(
        listed
            .items
            .iter()
            .map(|o| o.uid.as_str())
            .collect::<Vec<_>>(),
        ["uid-b"]
    );
    // The old one by its uid, with its operations and history.
    let old = backups.get("b").uid("uid-a").await.unwrap();
    assert_eq!(old.phase, OwnerPhase::Failed);
    assert!(old.retired.is_some());
    let ops = backups.operations("b").uid("uid-a").await.unwrap();
    assert_eq!(ops.len(), 1);
    assert_eq!(ops[0].phase, OperationPhase::Failed);
    let events = backups.events("b").uid("uid-a").await.unwrap();
    let last = events.items.last().unwrap();
    assert_eq!(last.reason.as_str(), "Retired");
    assert_eq!(last.message, "retired: backup b was started with uid uid-b");
    let history = backups.history("b").await.unwrap();
    assert_eq!(
        history
            .iter()
            .map(|o| (o.uid.as_str(), o.retired.is_some()))
            .collect::<Vec<_>>(),
        [("uid-b", false), ("uid-a", true)]
    );
    // A uid is one object: the retired one is not started again.
    let again = backups.start("b", "uid-a").await.unwrap_err();
    assert_eq!(
        again.to_string(),
        "backup b with uid uid-a has ended and was replaced by another uid: a uid names one \
         object, which is not started again (code 1002)"
    );
    let missing = backups.get("b").uid("uid-x").await.unwrap_err();
    assert_eq!(
        missing.to_string(),
        "backup b with uid uid-x not found (code 1001)"
    );
    // Deleting the retired one leaves the current one.
    backups.delete("b").uid("uid-a").await.unwrap();
    let history = backups.history("b").await.unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!(history[0].uid, "uid-b");
}

#[tokio::test]
async fn wait_times_out_list_pages_and_delete_cancels() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    for i in 0..5 {
        let name = format!("b{i}");
        backups.start(&name, "u").await.unwrap();
        backups
            .add_operations(
                &name,
                vec![operation(PLUGIN, &format!("never-{i}"), "a", &[])],
            )
            .await
            .unwrap();
    }
    backups.end_in_progress("b3").await.unwrap();

    let waited = backups
        .wait("b3", WaitUntil::ReadyToFinalize, Duration::from_millis(300))
        .await
        .unwrap();
    assert!(waited.timed_out);
    assert_eq!(waited.owner.phase, OwnerPhase::WaitingForPluginOperations);

    let page = backups
        .request::<opmon_client::methods::List>(ListParams {
            limit: Some(2),
            ..Default::default()
        })
        .await
        .unwrap();
    let names: Vec<_> = page.items.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, ["b0", "b1"]);
    assert_eq!(page.next.as_deref(), Some("b1"));
    let page = backups
        .request::<opmon_client::methods::List>(ListParams {
            limit: Some(10),
            after: page.next,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(page.items.len(), 3);
    assert_eq!(page.next, None);
    let waiting = backups
        .request::<opmon_client::methods::List>(ListParams {
            phases: Some(vec![OwnerPhase::WaitingForPluginOperations]),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(waiting.items.len(), 1);
    assert_eq!(waiting.items[0].name, "b3");

    let deleted = backups.delete("b3").await.unwrap();
    assert_eq!((deleted.canceled, deleted.cancelled), (1, 1));
    assert!(f.journal().contains(&"cancel never-3 b3".to_string()));
    assert_eq!(
        backups.get("b3").await.unwrap_err().code(),
        Some(codes::NOT_FOUND)
    );
    let status = client.status().await.unwrap();
    assert_eq!(status.owners.get(&OwnerPhase::InProgress), Some(&4));
    assert_eq!(status.unfinished_operations, 4);
    assert_eq!(status.snapshotters, 1);
}

#[tokio::test]
async fn an_opted_in_restore_waits_in_finalizing() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let restores = client.restores();
    restores
        .request::<opmon_client::methods::Start>(StartParams {
            name: "r".into(),
            uid: "u".into(),
            finalize: Some(true),
            ..Default::default()
        })
        .await
        .unwrap();
    restores
        .add_operations("r", vec![restore_operation(PLUGIN, "done-1", "a")])
        .await
        .unwrap();
    let owner = restores.end_in_progress("r").await.unwrap();
    assert_eq!(owner.phase, OwnerPhase::Finalizing);
}

#[tokio::test]
async fn restore_finalize_sets_the_default_and_finalize_may_report_errors_and_warnings() {
    // As Velero 1.14 and later: every restore passes through Finalizing.
    let f = Fixture::new(&["--restore-finalize", "true"]).await;
    let client = f.agent.client().await;
    let restores = client.restores();
    let owner = opmon_tests::start_and_end_in_progress(
        &restores,
        "by-default",
        vec![operation(PLUGIN, "done-1", "a", &[])],
    )
    .await;
    assert!(owner.finalize);
    assert_eq!(owner.phase, OwnerPhase::Finalizing);
    // The restore finalizer found problems: errors make it PartiallyFailed.
    let finalized = restores
        .request::<opmon_client::methods::Finalize>(opmon_client::FinalizeParams {
            name: "by-default".into(),
            errors: 2,
            warnings: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(finalized.owner.phase, OwnerPhase::PartiallyFailed);
    assert_eq!((finalized.owner.errors, finalized.owner.warnings), (2, 1));

    // `finalize: false` still opts out, per restore.
    restores
        .request::<opmon_client::methods::Start>(StartParams {
            name: "opted-out".into(),
            uid: "u".into(),
            finalize: Some(false),
            ..Default::default()
        })
        .await
        .unwrap();
    let owner = restores.end_in_progress("opted-out").await.unwrap();
    assert_eq!(owner.phase, OwnerPhase::Completed);

    // Warnings alone leave a backup Completed, counted.
    let backups = client.backups();
    opmon_tests::start_and_end_in_progress(&backups, "b", vec![]).await;
    let finalized = backups
        .request::<opmon_client::methods::Finalize>(opmon_client::FinalizeParams {
            name: "b".into(),
            warnings: 3,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(finalized.owner.phase, OwnerPhase::Completed);
    assert_eq!((finalized.owner.errors, finalized.owner.warnings), (0, 3));
}

#[tokio::test]
async fn a_name_whose_files_would_not_fit_is_refused_at_start_with_the_limit() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let longest = "r".repeat(224);
    let owner = opmon_tests::start_and_end_in_progress(
        &client.restores(),
        &longest,
        vec![operation(PLUGIN, "done-1", "a", &[])],
    )
    .await;
    assert_eq!(owner.phase, OwnerPhase::Completed);
    let file = f.agent.state_dir.join(format!(
        "storage/restores/{longest}/restore-{longest}-itemoperations.json.gz"
    ));
    assert!(file.exists(), "the longest name accepted is stored");
    let e = client
        .restores()
        .start(&"r".repeat(225), "u")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(codes::INVALID_PARAMS));
    assert_eq!(
        e.to_string(),
        "name: must be at most 224 characters for a restore (got 225): its item-operations \
         file name must fit the file system's limit of 255 bytes (code -32602)"
    );
    let e = client
        .backups()
        .start(&"b".repeat(233), "u")
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("name: must be at most 232 characters for a backup (got 233)"),
        "{e}"
    );
    assert!(client.backups().start(&"b".repeat(232), "u").await.is_ok());
}

#[tokio::test]
async fn many_subscribers_see_the_changes_and_their_streams_end_after_the_terminal_phase() {
    use futures::StreamExt;
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let restores = client.restores();
    restores.start("watched", "u").await.unwrap();
    restores
        .add_operations(
            "watched",
            vec![
                restore_operation(PLUGIN, "gate-w", "a"),
                restore_operation(PLUGIN, "done-w", "b"),
            ],
        )
        .await
        .unwrap();
    let other = f.agent.client().await;
    let mut first = client.restores().subscribe("watched").await.unwrap();
    let mut second = other.restores().subscribe("watched").await.unwrap();
    for stream in [&mut first, &mut second] {
        let initial = stream.next().await.unwrap().unwrap();
        assert_eq!(initial.owner.phase, OwnerPhase::InProgress);
        assert_eq!(
            initial.operations.len(),
            2,
            "the first update carries every operation"
        );
        assert!(!initial.lagged);
    }
    restores.end_in_progress("watched").await.unwrap();
    f.open_gate("gate-w");
    for stream in [first, second] {
        let updates: Vec<_> = stream.map(|u| u.unwrap()).collect().await;
        let last = updates.last().expect("updates until the end");
        assert_eq!(last.owner.phase, OwnerPhase::Completed);
        let gate_updates: Vec<_> = updates
            .iter()
            .flat_map(|u| &u.operations)
            .filter(|op| op.operation_id == "gate-w")
            .map(|op| op.phase)
            .collect();
        assert_eq!(
            gate_updates.last(),
            Some(&OperationPhase::Completed),
            "{gate_updates:?}"
        );
        assert!(
            updates.iter().all(|u| u.operations.len() <= 2),
            "later updates carry only what changed"
        );
    }
    let missing = client
        .restores()
        .subscribe("nobody")
        .await
        .expect_err("refused");
    assert_eq!(missing.code(), Some(codes::NOT_FOUND));
}

/// `agent.status`'s counts are kept in memory between commits (debug builds, as here,
/// also compare them with the database on every call): each step must show at once.
#[tokio::test]
async fn agent_status_counts_follow_every_step_of_a_backup() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    let counts = || async {
        // Twice: the second answer comes from what the first one kept.
        let first = client.status().await.unwrap();
        let second = client.status().await.unwrap();
        assert_eq!(
            (&first.owners, first.unfinished_operations),
            (&second.owners, second.unfinished_operations)
        );
        let owners: Vec<(OwnerPhase, u64)> = second.owners.into_iter().collect();
        (owners, second.unfinished_operations)
    };
    assert_eq!(counts().await, (vec![], 0));

    backups.start("b", "u").await.unwrap();
    assert_eq!(counts().await, (vec![(OwnerPhase::InProgress, 1)], 0));
    backups
        .add_operations(
            "b",
            vec![
                operation(PLUGIN, "done-1", "a", &[]),
                operation(PLUGIN, "gate-2", "b", &[]),
                operation(PLUGIN, "gate-3", "c", &[]),
            ],
        )
        .await
        .unwrap();
    assert_eq!(counts().await, (vec![(OwnerPhase::InProgress, 1)], 3));

    backups.end_in_progress("b").await.unwrap();
    assert_eq!(
        counts().await,
        (vec![(OwnerPhase::WaitingForPluginOperations, 1)], 2),
        "done-1 finished at the immediate poll"
    );

    f.open_gate("gate-2");
    f.open_gate("gate-3");
    let waited = backups
        .wait("b", WaitUntil::ReadyToFinalize, LONG)
        .await
        .unwrap();
    assert_eq!(waited.owner.phase, OwnerPhase::Finalizing);
    assert_eq!(counts().await, (vec![(OwnerPhase::Finalizing, 1)], 0));

    backups
        .request::<opmon_client::methods::Finalize>(opmon_client::FinalizeParams {
            name: "b".into(),
            contents: None,
            updated_items: Vec::new(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(counts().await, (vec![(OwnerPhase::Completed, 1)], 0));

    backups.start("c", "u").await.unwrap();
    backups
        .add_operations("c", vec![operation(PLUGIN, "never-4", "d", &[])])
        .await
        .unwrap();
    backups.end_in_progress("c").await.unwrap();
    assert_eq!(
        counts().await,
        (
            vec![
                (OwnerPhase::WaitingForPluginOperations, 1),
                (OwnerPhase::Completed, 1)
            ],
            1
        )
    );
    backups.delete("c").await.unwrap();
    backups.delete("b").await.unwrap();
    assert_eq!(counts().await, (vec![], 0));
}
