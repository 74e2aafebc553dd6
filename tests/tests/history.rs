//! History and rates against the real agent and the real SDK snapshotter: the events a
//! backup leaves on its way through its phases (with the caller of each call), paging
//! through them, their bound per owner, their removal with the owner, `describe` ending
//! with them, and the smoothed rate and ETA of operations that move at a known pace.

use std::process::Command;
use std::time::Duration;

use opmon_client::{Caller, Client, Event, EventsParams, FinalizeParams, Operation, WaitUntil};
use opmon_tests::{eventually_async, operation, workspace_binary, Fixture, LONG, PLUGIN};
use serde_json::Value;

/// Every event of backup `name`, a page of `limit` at a time.
async fn all_events(client: &Client, name: &str, limit: u32) -> Vec<Event> {
    let mut events = Vec::new();
    let mut after = None;
    loop {
        let page = client
            .backups()
            .request::<opmon_client::methods::Events>(EventsParams {
                name: name.into(),
                uid: None,
                after,
                limit: Some(limit),
            })
            .await
            .expect("events");
        assert!(page.items.len() <= limit as usize);
        events.extend(page.items);
        match page.next {
            Some(next) => after = Some(next),
            None => return events,
        }
    }
}

/// This test process, as the agent sees it calling.
fn me() -> Caller {
    Caller {
        uid: nix::unistd::geteuid().as_raw(),
        pid: std::process::id() as i32,
    }
}

/// (reason, operation ID, caller, message) of each event.
fn summary(events: &[Event]) -> Vec<(String, Option<String>, Option<Caller>, String)> {
    events
        .iter()
        .map(|e| {
            (
                e.reason.to_string(),
                e.operation.as_ref().map(|o| o.operation_id.clone()),
                e.caller,
                e.message.clone(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_backup_through_its_phases_leaves_its_history_with_the_callers() {
    let f = Fixture::new(&[]).await;
    f.backup("b")
        .operation(operation(PLUGIN, "gate-1", "a", &[]))
        .operation(operation(PLUGIN, "fail-1", "b", &[]))
        .end_in_progress()
        .await;
    f.open_gate("gate-1");
    f.backup("b").wait(WaitUntil::ReadyToFinalize).await;
    let finalized = f
        .client
        .backups()
        .request::<opmon_client::methods::Finalize>(FinalizeParams {
            name: "b".into(),
            ..Default::default()
        })
        .await
        .expect("finalize");
    assert_eq!(
        finalized.owner.phase,
        opmon_client::OwnerPhase::PartiallyFailed
    );

    let events = all_events(&f.client, "b", 1000).await;
    let s = |r: &str, op: Option<&str>, caller: Option<Caller>, m: &str| {
        (r.to_string(), op.map(str::to_string), caller, m.to_string())
    };
    assert_eq!(
        summary(&events),
        [
            s("Started", None, Some(me()), "started in InProgress (itemOperationTimeout 4h0m0s, finalize true)"),
            s("OperationsAdded", None, Some(me()), "2 operations added (0 already known); 2 in all"),
            s("OperationPhaseChanged", Some("gate-1"), None, "New → InProgress at 30 of 100 byte"),
            s("OperationFailed", Some("fail-1"), None, "copy failed"),
            s("PhaseChanged", None, Some(me()), "InProgress → WaitingForPluginOperationsPartiallyFailed: 0 of 2 operations completed, 1 failed, 1 error"),
            s("OperationPhaseChanged", Some("gate-1"), None, "InProgress → Completed at 100 of 100 byte"),
            s("PhaseChanged", None, None, "WaitingForPluginOperationsPartiallyFailed → FinalizingPartiallyFailed: 1 of 2 operations completed, 1 failed, 1 error"),
            s("PhaseChanged", None, Some(me()), "FinalizingPartiallyFailed → PartiallyFailed: 1 of 2 operations completed, 1 failed, 1 error"),
        ]
    );
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=8).collect::<Vec<u64>>());
    // The operation is named in full: two items may share an operation ID.
    let failed = events[3].operation.as_ref().expect("an operation");
    assert_eq!(
        (failed.resource.name.as_str(), failed.plugin.name.as_str()),
        ("b", PLUGIN)
    );
    assert!(events.windows(2).all(|w| w[0].time <= w[1].time));

    // Paging: any page size gives the same history; after the last, nothing.
    for limit in [1, 3, 7] {
        assert_eq!(
            all_events(&f.client, "b", limit).await,
            events,
            "limit {limit}"
        );
    }
    let backups = f.client.backups();
    let page = backups
        .request::<opmon_client::methods::Events>(EventsParams {
            name: "b".into(),
            uid: None,
            after: Some(5),
            limit: Some(2),
        })
        .await
        .unwrap();
    assert_eq!(
        (page.items[0].seq, page.items[1].seq, page.next),
        (6, 7, Some(7))
    );
    let past = backups
        .request::<opmon_client::methods::Events>(EventsParams {
            name: "b".into(),
            uid: None,
            after: Some(u64::MAX),
            limit: None,
        })
        .await
        .unwrap();
    assert_eq!((past.items.len(), past.next), (0, None));
    for (params, code, message) in [
        (
            EventsParams {
                name: "b".into(),
                uid: None,
                after: None,
                limit: Some(0),
            },
            -32602,
            "limit: must be between 1 and 1000",
        ),
        (
            EventsParams {
                name: "b".into(),
                uid: None,
                after: None,
                limit: Some(1001),
            },
            -32602,
            "limit: must be between 1 and 1000",
        ),
        (
            EventsParams {
                name: "nope".into(),
                uid: None,
                after: None,
                limit: None,
            },
            1001,
            "backup nope not found",
        ),
    ] {
        match backups
            .request::<opmon_client::methods::Events>(params)
            .await
        {
            Err(opmon_client::Error::Rpc {
                code: c,
                message: m,
                ..
            }) => {
                assert_eq!((c.number(), m.as_str()), (code, message))
            }
            other => panic!("expected error {code}: {other:?}"),
        }
    }

    // A cursor that is no number, as a client without the types would send it.
    let mut raw = opmon_tests::RawHttp::connect(&f.agent.socket);
    for (params, message) in [
        (
            r#"{"name":"b","after":-1}"#,
            "after: invalid value: integer `-1`, expected u64",
        ),
        (
            r#"{"name":"b","after":"6"}"#,
            "after: invalid type: string \"6\", expected u64",
        ),
        (
            r#"{"name":"b","before":6}"#,
            "before: unknown field `before`, expected one of `name`, `uid`, `after`, `limit`",
        ),
    ] {
        let answer = raw.post(
            format!(r#"{{"jsonrpc":"2.0","id":1,"method":"backup.events","params":{params}}}"#)
                .as_bytes(),
        );
        let answer: Value = serde_json::from_str(&answer.1).expect("JSON");
        assert_eq!(answer["error"]["code"], -32602, "{answer}");
        assert_eq!(answer["error"]["message"], message);
    }

    // `describe`, run as a process, ends with the events as kubectl shows them.
    let out = Command::new(workspace_binary("opmon"))
        .arg("--socket")
        .arg(&f.agent.socket)
        .args(["backup", "describe", "b"])
        .output()
        .expect("running opmon");
    assert_eq!(out.status.code(), Some(1), "PartiallyFailed");
    let text = String::from_utf8_lossy(&out.stdout);
    let (_, tail) = text
        .split_once("\nEvents:\n")
        .unwrap_or_else(|| panic!("{text}"));
    let lines: Vec<&str> = tail.lines().collect();
    assert_eq!(lines.len(), 9, "a header and the 8 events:\n{text}");
    assert!(
        lines[0].starts_with("  AGE  ") && lines[0].contains("  REASON  "),
        "{text}"
    );
    let mine = format!("uid {} pid {}", me().uid, me().pid);
    let last: Vec<&str> = lines[8]
        .split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    assert_eq!(
        &last[1..],
        ["PhaseChanged", &mine, "-", "FinalizingPartiallyFailed → PartiallyFailed: 1 of 2 operations completed, 1 failed, 1 error"],
        "{text}"
    );
    assert!(
        lines[4].contains("OperationFailed")
            && lines[4].contains("  agent  ")
            && lines[4].contains("persistentvolumeclaims app/b fail-1  copy failed"),
        "{text}"
    );
    // With -o json: the same events as the API's.
    let out = Command::new(workspace_binary("opmon"))
        .arg("--socket")
        .arg(&f.agent.socket)
        .args(["-o", "json", "backup", "describe", "b"])
        .output()
        .expect("running opmon");
    let json: Value = serde_json::from_slice(&out.stdout).expect("describe -o json");
    assert_eq!(json["events"], serde_json::to_value(&events).unwrap());
}

#[tokio::test]
async fn an_owner_keeps_its_latest_1000_events() {
    let f = Fixture::new(&[]).await;
    f.backup("big").start().await;
    let backups = f.client.backups();
    // 1,005 calls that each add one operation: 1,005 events after `Started`.
    for chunk in (0..1005).collect::<Vec<u32>>().chunks(64) {
        let calls = chunk.iter().map(|i| {
            backups.add_operations(
                "big",
                vec![operation(PLUGIN, &format!("gate-{i}"), "a", &[])],
            )
        });
        for added in futures::future::join_all(calls).await {
            assert_eq!(added.expect("addOperations").added, 1);
        }
    }
    let events = all_events(&f.client, "big", 1000).await;
    assert_eq!(events.len(), 1000);
    // The first 6 (Started and 5 additions) went; numbering goes on.
    assert_eq!((events[0].seq, events[999].seq), (7, 1006));
    assert!(events
        .iter()
        .all(|e| e.reason.as_str() == "OperationsAdded"));
    assert_eq!(
        events[999].message,
        "1 operation added (0 already known); 1005 in all"
    );
    let one_page = backups
        .request::<opmon_client::methods::Events>(EventsParams {
            name: "big".into(),
            uid: None,
            after: None,
            limit: Some(1000),
        })
        .await
        .unwrap();
    assert_eq!((one_page.items.len(), one_page.next), (1000, None));
}

/// `SELECT COUNT(*) FROM table` in the agent's own database file.
fn stored(f: &Fixture, table: &str) -> i64 {
    let db = f.agent.state_dir.join("agent.db");
    let conn =
        rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .expect("opening the agent's database");
    conn.query_row(&format!("SELECT COUNT(*) FROM {table}"), [], |r| r.get(0))
        .expect("counting rows")
}

fn stored_events(f: &Fixture) -> i64 {
    stored(f, "events")
}

#[tokio::test]
async fn events_go_with_their_owner_on_delete_and_on_expiry() {
    let f = Fixture::new(&["--retention", "1s"]).await;
    let backups = f.client.backups();
    f.backup("gone")
        .operation(operation(PLUGIN, "never-1", "a", &[]))
        .end_in_progress()
        .await;
    assert_eq!(all_events(&f.client, "gone", 100).await.len(), 4);
    backups.delete("gone").await.expect("delete");
    assert_eq!(stored_events(&f), 0);
    // A new owner of the name starts its own history.
    f.backup("gone").start().await;
    let fresh = all_events(&f.client, "gone", 100).await;
    assert_eq!(summary(&fresh).len(), 1);
    assert_eq!((fresh[0].seq, fresh[0].reason.as_str()), (1, "Started"));
    backups.delete("gone").await.expect("delete");

    // Expiry: a completed backup is removed after `retention`, its events with it.
    f.backup("old").end_in_progress().await;
    backups
        .request::<opmon_client::methods::Finalize>(FinalizeParams {
            name: "old".into(),
            ..Default::default()
        })
        .await
        .expect("finalize");
    assert!(stored_events(&f) >= 3, "started, endInProgress, finalize");
    eventually_async("the completed backup expires", LONG, || {
        stored(&f, "owners") == 0
    })
    .await;
    assert_eq!(stored_events(&f), 0);
}

/// The samples an operation reported, `(nCompleted, updated ms)`, from the snapshotter's
/// journal, up to what the agent has stored of it.
fn reported_samples(f: &Fixture, op: &Operation) -> Vec<(i64, i64)> {
    f.journal()
        .iter()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            match fields.as_slice() {
                ["paced", n, at, id, _] if *id == op.operation_id => {
                    Some((n.parse().ok()?, at.parse().ok()?))
                }
                _ => None,
            }
        })
        .filter(|(n, _)| *n <= op.n_completed)
        .collect()
}

/// The rates between consecutive samples: the least and the most.
fn rate_range(samples: &[(i64, i64)]) -> (f64, f64) {
    let rates: Vec<f64> = samples
        .windows(2)
        .map(|w| (w[1].0 - w[0].0) as f64 * 1000.0 / (w[1].1 - w[0].1) as f64)
        .collect();
    let min = rates.iter().copied().fold(f64::INFINITY, f64::min);
    let max = rates.iter().copied().fold(0.0, f64::max);
    (min, max)
}

fn ms(t: opmon_client::Timestamp) -> i64 {
    (t.unix_timestamp_nanos() / 1_000_000) as i64
}

/// Checks `op`'s rate and ETA against the samples it reported (the agent saw them
/// after `since`, Unix ms); returns its rate.
fn check_rate(f: &Fixture, op: &Operation, since: i64) -> f64 {
    let samples = reported_samples(f, op);
    assert!(samples.len() >= 5, "{}: {samples:?}", op.operation_id);
    let (min, max) = rate_range(&samples);
    assert!(
        (min, max) == (500.0, 1500.0),
        "the pace alternates: {samples:?}"
    );
    let rate = op
        .rate
        .unwrap_or_else(|| panic!("{} has no rate", op.operation_id));
    assert!(
        rate >= min - 1e-6 && rate <= max + 1e-6,
        "{rate} outside [{min}, {max}]"
    );
    // The last sample is the one stored, by the snapshotter's clock.
    let &(n, at) = samples.last().expect("samples");
    assert_eq!((op.n_completed, op.updated.map(ms)), (n, Some(at)));
    // The ETA counts on the agent's clock from when it saw that sample: while this test
    // ran, and before the check.
    match op.n_total {
        0 => assert_eq!(op.eta, None, "no total, no ETA"),
        total => {
            let eta = ms(op.eta.expect("an ETA"));
            let left_ms = ((total - n) as f64 / rate * 1000.0).ceil() as i64;
            let seen = eta - left_ms;
            let now = ms(time::OffsetDateTime::now_utc());
            assert!(
                seen >= since && seen <= now,
                "seen at {seen}, not in [{since}, {now}]"
            );
        }
    }
    rate
}

#[tokio::test]
async fn rates_and_etas_follow_a_snapshotter_at_a_known_pace() {
    let f = Fixture::new(&[]).await;
    let backups = f.client.backups();
    let since = ms(time::OffsetDateTime::now_utc());
    f.backup("paced")
        .operation(operation(PLUGIN, "pace-1", "a", &[]))
        .operation(operation(PLUGIN, "pace-2", "b", &[]))
        .operation(operation(PLUGIN, "pace-items-1", "c", &[]))
        .end_in_progress()
        .await;
    f.backup("unknown")
        .operation(operation(PLUGIN, "pace-nototal-1", "a", &[]))
        .operation(operation(PLUGIN, "never-1", "b", &[]))
        .end_in_progress()
        .await;
    // Six answers to each paced operation (of which the agent committed at least five:
    // all but those of the batch in flight).
    let paced = ["pace-1", "pace-2", "pace-items-1", "pace-nototal-1"];
    eventually_async("six answers to every paced operation", LONG, || {
        let journal = f.journal();
        paced.iter().all(|id| {
            journal
                .iter()
                .filter(|l| l.starts_with("paced ") && l.contains(&format!(" {id} ")))
                .count()
                >= 6
        })
    })
    .await;
    // Hold every call, so the stored state stops moving while it is checked.
    std::fs::write(f.gates.join("HANG"), b"").expect("HANG");
    eventually_async("a call is held", LONG, || {
        f.journal().iter().any(|l| l.starts_with("held progress"))
    })
    .await;

    let ops = backups.operations("paced").await.expect("operations");
    let rates: Vec<f64> = ops.iter().map(|op| check_rate(&f, op, since)).collect();
    let owner = backups.get("paced").await.expect("get");
    let progress = owner.progress.expect("get gives the owner's progress");
    let units: Vec<(&str, u64)> = progress
        .units
        .iter()
        .map(|u| (u.units.as_str(), u.operations))
        .collect();
    assert_eq!(units, [("byte", 2), ("item", 1)]);
    assert!((progress.units[0].rate.unwrap() - (rates[0] + rates[1])).abs() < 1e-6);
    assert!((progress.units[1].rate.unwrap() - rates[2]).abs() < 1e-6);
    assert_eq!(
        progress.units[0].n_completed,
        ops[0].n_completed + ops[1].n_completed
    );
    let latest = ops.iter().filter_map(|o| o.eta).max();
    assert_eq!(
        progress.eta, latest,
        "the owner's ETA is its operations' latest"
    );

    // Unknown: no total, or no movement (never-1 reports 50 of 100 every time).
    let ops = backups.operations("unknown").await.expect("operations");
    check_rate(&f, &ops[0], since);
    assert_eq!(
        (ops[1].rate, ops[1].eta),
        (None, None),
        "never moved: {:?}",
        ops[1]
    );
    let owner = backups
        .get("unknown")
        .await
        .expect("get")
        .progress
        .expect("progress");
    assert_eq!(
        owner.eta, None,
        "an operation without an ETA leaves the owner without one"
    );
    assert_eq!(
        (owner.units[0].operations, owner.units[0].rate),
        (2, ops[0].rate)
    );

    // `wait` and the subscription show them too.
    let waited = backups
        .wait("paced", WaitUntil::Terminal, Duration::from_millis(10))
        .await
        .unwrap();
    assert_eq!(waited.owner.progress.map(|p| p.eta), Some(latest));
    let mut updates = backups.subscribe("paced").await.expect("subscribe");
    let first = updates
        .next()
        .await
        .expect("a first update")
        .expect("an update");
    assert!(first
        .operations
        .iter()
        .all(|o| o.rate.is_some() && o.eta.is_some()));
    assert_eq!(first.owner.progress.as_ref().map(|p| p.eta), Some(latest));

    // Progress alone is no event: each paced operation changed phase once.
    let events = all_events(&f.client, "paced", 1000).await;
    let per_operation: Vec<(String, String)> = events
        .iter()
        .filter_map(|e| {
            Some((
                e.operation.as_ref()?.operation_id.clone(),
                e.message.clone(),
            ))
        })
        .collect();
    assert_eq!(per_operation.len(), 3, "{per_operation:?}");
    assert!(per_operation
        .iter()
        .all(|(_, m)| m.starts_with("New → InProgress at ")));

    // The rate is stored: a restarted agent reports it as it was.
    let before = backups.operations("paced").await.expect("operations");
    drop(updates);
    let mut f = f;
    f.agent.kill9();
    f.agent.restart();
    let client = f.agent.client().await;
    let after = client
        .backups()
        .operations("paced")
        .await
        .expect("operations");
    let kept = |ops: &[Operation]| ops.iter().map(|o| (o.rate, o.eta)).collect::<Vec<_>>();
    assert_eq!(kept(&after), kept(&before));
}

#[tokio::test]
async fn a_cancel_with_no_snapshotter_to_send_it_to_names_the_plugin() {
    let f = Fixture::new(&[]).await;
    let nobody = "example.io/unregistered";
    let cases = [
        // One operation of the registered snapshotter, one of a plugin nobody registered.
        (
            "orphan",
            vec![
                operation(PLUGIN, "gate-1", "a", &[]),
                operation(nobody, "gone-1", "b", &[]),
            ],
            "Cancel sent for 1 unfinished operation of the failed owner: 1 confirmed by \
             their snapshotters, 0 not; not sent for 1 more: no snapshotter registered for \
             example.io/unregistered",
        ),
        // Only the unregistered plugin's: nothing was sent at all.
        (
            "nobody",
            vec![operation(nobody, "gone-2", "c", &[])],
            "Cancel not sent for 1 unfinished operation of the failed owner: no snapshotter \
             registered for example.io/unregistered",
        ),
    ];
    for (name, operations, expected) in cases {
        let mut backup = f.backup(name);
        for op in operations {
            backup = backup.operation(op);
        }
        backup.start().await;
        f.client
            .backups()
            .end_in_progress(name)
            .failed()
            .await
            .expect("endInProgress failed");
        let events = all_events(&f.client, name, 100).await;
        let last = events
            .last()
            .map(|e| (e.reason.as_str(), e.message.as_str()));
        assert_eq!(last, Some(("CancelSent", expected)), "{name}");
    }
}

#[tokio::test]
async fn failures_and_timeouts_are_events_with_their_reasons() {
    let f = Fixture::new(&[]).await;
    // The backup server fails the backup: one event, by it, saying what was cancelled.
    f.backup("failed")
        .operation(operation(PLUGIN, "gate-1", "a", &[]))
        .start()
        .await;
    f.client
        .backups()
        .end_in_progress("failed")
        .failed()
        .await
        .expect("endInProgress failed");
    // Then the Cancel calls it sent, and what came of them (no caller: the agent's).
    let events = all_events(&f.client, "failed", 100).await;
    let last: Vec<_> = events[events.len().saturating_sub(2)..]
        .iter()
        .map(|e| (e.reason.as_str(), e.caller, e.message.as_str()))
        .collect();
    assert_eq!(
        last,
        [
            (
                "Failed",
                Some(me()),
                "InProgress → Failed: the backup server ended InProgress with failed: true \
                 (1 unfinished operation failed and canceled)"
            ),
            (
                "CancelSent",
                None,
                "Cancel sent for 1 unfinished operation of the failed owner: 1 confirmed \
                 by their snapshotters, 0 not"
            )
        ]
    );
    // An operation past its item operation timeout: a deadline, by the agent.
    f.backup("late")
        .item_operation_timeout(Duration::from_millis(1))
        .operation(operation(PLUGIN, "never-1", "a", &[]))
        .end_in_progress()
        .await;
    let events = all_events(&f.client, "late", 100).await;
    let deadline: Vec<_> = events
        .iter()
        .filter(|e| e.reason.as_str() == "DeadlineExceeded" || e.reason.as_str() == "CancelSent")
        .map(|e| {
            (
                e.caller,
                e.message.as_str(),
                e.operation.as_ref().map(|o| o.operation_id.as_str()),
            )
        })
        .collect();
    assert_eq!(
        deadline,
        [
            (None, "Asynchronous action timed out", Some("never-1")),
            (
                None,
                "Cancel sent after the deadline; confirmed by the snapshotter",
                Some("never-1")
            )
        ]
    );
}
