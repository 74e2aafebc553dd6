//! Store tests on real database files.

use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};

use opmon_client::{GoDuration, OperationPhase, OwnerKind, OwnerPhase};
use rusqlite::Connection;

use super::schema::{self, CURRENT_VERSION};
use super::{queries, OpenError, StorageFailure, Store};
use crate::clock::UnixMs;
use crate::rate::Rate;

/// A backup named `name` as `start` creates it, without an object.
fn backup(name: &str, timeout: GoDuration) -> queries::NewOwner<'_> {
    queries::NewOwner {
        kind: OwnerKind::Backup,
        name,
        uid: "u",
        timeout,
        finalize: true,
        server: None,
        object: None,
        stall_timeout: None,
        start_timeout: None,
    }
}

fn temp_db() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("agent.db");
    (dir, db)
}

/// Migration 14 keeps each owner's events, numbers, order and paging; the next event
/// recorded follows the owner's last.
fn check_events_after_migration_14(conn: &Connection, backup: i64, version: u32) {
    use super::events::{self, NewEvent};
    use opmon_client::EventReason;
    if version < 10 {
        // No history before migration 10.
        assert_eq!(events::count(conn, backup).unwrap(), 0);
        return;
    }
    let said = |owner, after| -> Vec<(u64, String, Option<u32>, Option<String>)> {
        events::page(conn, owner, after, 10)
            .unwrap()
            .into_iter()
            .map(|e| {
                let op = e.operation.map(|o| o.operation_id);
                (e.seq, e.message, e.caller.map(|c| c.uid), op)
            })
            .collect()
    };
    let backup_events = vec![
        (1, "backup started".to_string(), Some(1000), None),
        (
            2,
            "added: é".to_string(),
            Some(1000),
            Some("op-1".to_string()),
        ),
    ];
    assert_eq!(said(backup, 0), backup_events, "from version {version}");
    assert_eq!(
        said(backup, 1),
        backup_events[1..],
        "from version {version}"
    );
    let restore: Vec<u64> = said(2, 0).into_iter().map(|e| e.0).collect();
    assert_eq!(restore, vec![1, 2], "from version {version}");
    let event = NewEvent {
        reason: EventReason::PhaseChanged,
        operation: None,
        caller: None,
        message: "next",
    };
    events::record(conn, backup, &event, UnixMs(5000)).unwrap();
    assert_eq!(said(backup, 2)[0].0, 3, "from version {version}");
}

/// Writes rows the way an agent at schema `version` would have.
fn fill_old_database(conn: &Connection, version: u32) {
    if version >= 1 {
        conn.execute_batch(
            "INSERT INTO owners (id, kind, name, uid, phase, item_operation_timeout_ms, errors,
                 warnings, created_ms, updated_ms)
             VALUES (1, 'backup', 'old-backup', 'u1', 'WaitingForPluginOperations', 14400000,
                 0, 0, 1000, 1000),
                    (2, 'restore', 'old-restore', 'u2', 'InProgress', 60000, 0, 0, 1000, 1000);
             INSERT INTO operations (owner_id, plugin_kind, plugin_name, res_group, res_resource,
                 res_namespace, res_name, operation_id, created_ms)
             VALUES (1, 'BackupItemAction', 'example.io/copier', '', 'pods', 'ns', 'p', 'op-1', 1000);
             INSERT INTO operations (owner_id, plugin_kind, plugin_name, res_group, res_resource,
                 res_namespace, res_name, operation_id, phase, created_ms)
             VALUES (1, 'BackupItemAction', 'example.io/copier', '', 'pods', 'ns', 'q', 'op-2',
                     'Completed', 1000),
                    (1, 'BackupItemAction', 'example.io/copier', '', 'pods', 'ns', 'r', 'op-3',
                     'Failed', 1000);",
        )
        .unwrap();
    }
    if version >= 2 {
        conn.execute_batch(
            "INSERT INTO snapshotters (name, api_version, socket)
             VALUES ('example.io/copier', 'v2', '/run/copier.sock');",
        )
        .unwrap();
    }
    if version >= 3 {
        // From version 3 on, agents store the finalize flag when they create an owner.
        conn.execute_batch("UPDATE owners SET finalize = 1 WHERE kind = 'backup';")
            .unwrap();
    }
    if version >= 4 {
        conn.execute_batch(
            "UPDATE owners SET finalize_result = '{\"contentsFile\":null,\"replaced\":0,\"added\":0}'
             WHERE name = 'old-backup';",
        )
        .unwrap();
    }
    if version >= 11 {
        // From version 11 on, each operation has its progress row, added with it.
        conn.execute_batch(
            "INSERT INTO operation_progress (op, phase) SELECT id, phase FROM operations;",
        )
        .unwrap();
    }
    // Where progress is: in `operations` before version 11, in its own row from then on.
    let (progress, op_1) = if version >= 11 {
        ("operation_progress", "op = 1")
    } else {
        ("operations", "id = 1")
    };
    if version >= 1 {
        // Progress recorded by a poll: the plugin's started and updated.
        conn.execute_batch(&format!(
            "UPDATE operations SET phase = 'InProgress', started_ms = 1500
             WHERE operation_id = 'op-1';
             UPDATE {progress} SET updated_ms = 2000, n_completed = 5, n_total = 10
             WHERE {op_1};"
        ))
        .unwrap();
    }
    if version >= 1 {
        // A failure recorded by a poll, and the units of a progress.
        conn.execute_batch(
            "UPDATE operations SET error = 'boom: é' WHERE operation_id = 'op-3';
             UPDATE operations SET operation_units = 'bytes' WHERE operation_id = 'op-1';",
        )
        .unwrap();
    }
    if version >= 10 {
        // From version 10 on, a poll that moves the counts samples the rate.
        conn.execute_batch(&format!(
            "UPDATE {progress} SET rate = 2.5, rate_n = 4, rate_at_ms = 1900,
                 rate_seen_ms = 1950 WHERE {op_1};"
        ))
        .unwrap();
    }
    if version >= 10 {
        // From version 10 on, each owner's history, stored by owner (until migration 14),
        // recorded in an order that is not the owners'.
        conn.execute_batch(
            "INSERT INTO events (owner_id, seq, at_ms, reason, operation_row, caller_uid,
                 caller_pid, message)
             VALUES (2, 1, 900, 'Started', NULL, 1000, 42, 'restore started'),
                    (1, 1, 1000, 'Started', NULL, 1000, 42, 'backup started'),
                    (2, 2, 1050, 'Failed', NULL, NULL, NULL, 'restore failed'),
                    (1, 2, 1100, 'OperationsAdded', 1, 1000, 43, 'added: é');",
        )
        .unwrap();
    }
    if version == 11 {
        // A progress row lost, and a text that is not UTF-8 (no agent wrote either):
        // migration 12 keeps the operations and the rest of the text.
        conn.execute_batch(
            "DELETE FROM operation_progress WHERE op = 2;
             UPDATE operation_progress SET description = CAST(x'6f6bff' AS TEXT) WHERE op = 3;",
        )
        .unwrap();
    }
    if version >= 6 {
        // From version 6 on, agents count each owner's operations as they add them (the
        // trigger counts phase changes, which the rows above were inserted with).
        conn.execute_batch(
            "UPDATE owners SET n_operations = 3, n_completed = 1, n_failed = 1 WHERE id = 1;",
        )
        .unwrap();
    }
    if version >= 7 {
        // From version 7 on, an owner's creation is its server's first call.
        conn.execute_batch("UPDATE owners SET last_call_ms = created_ms;")
            .unwrap();
    }
    if version >= 8 {
        // From version 8 on, a poll records the plugin's own updated as well.
        conn.execute_batch(&format!(
            "UPDATE {progress} SET plugin_updated_ms = 2000 WHERE {op_1};"
        ))
        .unwrap();
    }
    if version >= 9 {
        // From version 9 on, a poll that moves the progress records when it saw it, and
        // transient errors are retried (on op-2, finished: the checks of migration 9
        // cancel op-1).
        conn.execute_batch(&format!(
            "UPDATE {progress} SET progressed_ms = updated_ms;
             UPDATE operations SET attempts = 3, last_error = 'busy', next_attempt_ms = 2100,
                 retrying_since_ms = 1800 WHERE id = 2;"
        ))
        .unwrap();
    }
}

/// What migration 16 must leave: every owner current, with its id (its operations and
/// events still its own); a name taken only while its owner is not retired.
fn check_identity_after_migration_16(conn: &Connection, backup: i64, from: u32) {
    let current = queries::owner_by_name(conn, OwnerKind::Backup, "old-backup")
        .unwrap()
        .expect("backup kept");
    assert_eq!(
        (current.id, current.owner.retired),
        (backup, None),
        "from version {from}"
    );
    let insert = "INSERT INTO owners (kind, name, uid, phase, item_operation_timeout_ms, \
                  created_ms, updated_ms) VALUES ('backup', 'old-backup', 'new-uid', \
                  'InProgress', 0, 0, 0)";
    assert!(conn.execute(insert, []).is_err(), "from version {from}");
    let now = crate::clock::UnixMs(5000);
    queries::retire_owner(conn, backup, now).unwrap();
    conn.execute(insert, []).unwrap();
    let history = queries::owners_of_name(conn, OwnerKind::Backup, "old-backup", 10).unwrap();
    let uids: Vec<&str> = history.iter().map(|r| r.owner.uid.as_str()).collect();
    assert_eq!(
        uids[1..],
        [current.owner.uid.as_str()],
        "from version {from}"
    );
    let retired = queries::owner_by_uid(conn, OwnerKind::Backup, "old-backup", &current.owner.uid)
        .unwrap()
        .expect("the retired one, by its uid");
    assert_eq!(retired.id, backup);
    assert_eq!(retired.owner.retired, Some(now.time()));
    assert_eq!(unfinished(conn, backup), 1, "its operations stay its own");
    // As it was, for the checks that follow.
    conn.execute_batch(
        "DELETE FROM owners WHERE uid = 'new-uid';
         UPDATE owners SET retired_ms = NULL;",
    )
    .unwrap();
}

/// What the identity migration must leave: every operation with its id, state and
/// counts; the plugin's updated time taken from the one recorded; the new key; the
/// trigger, the partial index and the owner index in place.
fn check_operations_after_identity_migration(conn: &Connection, from: u32) {
    /// id, operation ID, phase, started, updated, the plugin's updated.
    type Row = (
        i64,
        String,
        OperationPhase,
        Option<i64>,
        Option<i64>,
        Option<i64>,
    );
    let rows: Vec<Row> = packed_states(conn)
        .into_iter()
        .map(|(id, operation_id, s)| {
            let times = (s.started_ms, s.updated_ms, s.plugin_updated_ms);
            (id, operation_id, s.phase, times.0, times.1, times.2)
        })
        .collect();
    assert_eq!(
        rows,
        vec![
            (
                1,
                "op-1".into(),
                OperationPhase::InProgress,
                Some(1500),
                Some(2000),
                Some(2000)
            ),
            (
                2,
                "op-2".into(),
                OperationPhase::Completed,
                None,
                None,
                None
            ),
            (3, "op-3".into(), OperationPhase::Failed, None, None, None),
        ],
        "operations from version {from}"
    );
    let ops = queries::operations(conn, 1, None).unwrap();
    assert_eq!(ops[0].plugin_updated, Some(UnixMs(2000).time()));
    assert_eq!((ops[0].n_completed, ops[0].n_total), (5, 10));
    let mut names: Vec<String> = conn
        .prepare(
            "SELECT name FROM sqlite_master WHERE tbl_name = 'operations'
             AND type IN ('index', 'trigger') AND name NOT LIKE 'sqlite_autoindex%'",
        )
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap();
    names.sort();
    assert_eq!(
        names,
        [
            "operation_state_phase",
            "operations_by_owner_phase",
            "operations_cancel_requested",
            "operations_counted_on_phase",
            "operations_unfinished_by_plugin"
        ],
        "from version {from}"
    );
    let partial: String = conn
        .query_row(
            "SELECT sql FROM sqlite_master WHERE name = 'operations_unfinished_by_plugin'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(
        partial.contains("WHERE phase IN ('New', 'InProgress')"),
        "{partial}"
    );
    // The same operation ID on another item is another operation; on the same item it
    // is the same one.
    let insert = |name: &str| {
        conn.execute(
            "INSERT OR IGNORE INTO operations (owner_id, plugin_kind, plugin_name, res_group,
                 res_resource, res_namespace, res_name, operation_id, created_ms)
             VALUES (1, 'BackupItemAction', 'example.io/copier', '', 'pods', 'ns', ?1, 'op-1', 1)",
            [name],
        )
        .unwrap()
    };
    assert_eq!(insert("p"), 0, "op-1 on item p is known");
    assert_eq!(insert("other"), 1, "op-1 on another item is new");
    conn.execute("DELETE FROM operations WHERE res_name = 'other'", [])
        .unwrap();
    // The phase trigger counts again.
    let counts = |conn: &Connection| {
        let o = queries::owner_by_id(conn, 1).unwrap().unwrap().owner;
        (o.operations_completed, o.operations_failed)
    };
    let before = counts(conn);
    conn.execute("UPDATE operations SET phase = 'Completed' WHERE id = 1", [])
        .unwrap();
    assert_eq!(
        counts(conn),
        (before.0 + 1, before.1),
        "from version {from}"
    );
    check_state_after_migration_12(conn, from);
}

/// An operation of `example.io/copier` on pod `ns/item`, with operation ID `id`.
fn copier_op(item: &str, id: &str) -> opmon_client::NewOperation {
    use opmon_client::{NewOperation, PluginKind, PluginRef, ResourceIdentifier};
    NewOperation {
        plugin: PluginRef {
            kind: PluginKind::BackupItemAction,
            name: "example.io/copier".into(),
        },
        resource: ResourceIdentifier {
            group: String::new(),
            resource: "pods".into(),
            namespace: "ns".into(),
            name: item.into(),
        },
        operation_id: id.into(),
        post_operation_items: Vec::new(),
        created: None,
    }
}

/// Every operation's id, operation ID and state (its phase and creation from their
/// columns, the rest unpacked), in row order.
/// Migration 13 rewrites the states that decode and leaves a damaged one as it was (it
/// is read as new, and a poll writes it afresh).
#[test]
fn migration_13_leaves_a_damaged_state_as_it_was() {
    let (_dir, db) = temp_db();
    {
        let mut conn = Connection::open(&db).unwrap();
        schema::migrate_to(&mut conn, 11).unwrap();
        fill_old_database(&conn, 11);
        schema::migrate_to(&mut conn, 12).unwrap();
        write_states_in_layout_1(&conn);
        conn.execute(
            "UPDATE operation_state SET state = x'01ff' WHERE op = 3",
            [],
        )
        .unwrap();
    }
    let store = Store::open(&db, |_, _| {}).unwrap();
    let conn = Connection::open(&db).unwrap();
    let layouts = stored_states(&conn);
    let firsts: Vec<(i64, u8, usize)> =
        layouts.iter().map(|(op, b)| (*op, b[0], b.len())).collect();
    assert_eq!(firsts[2], (3, 1, 2), "the damaged state is kept");
    assert!(
        firsts[..2].iter().all(|&(_, layout, _)| layout == 2),
        "{firsts:?}"
    );
    store.close();
}

/// Every operation's stored state as bytes, by operation row.
fn stored_states(conn: &Connection) -> Vec<(i64, Vec<u8>)> {
    conn.prepare("SELECT op, state FROM operation_state ORDER BY op")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap()
}

/// Rewrites every state of a schema-12 database in layout 1; returns what each holds.
fn write_states_in_layout_1(conn: &Connection) -> Vec<(i64, (crate::phase::OperationState, Rate))> {
    let states = stored_states(conn);
    let mut held = Vec::new();
    for (op, bytes) in states {
        let (state, rate) = super::packed::unpack(&bytes).unwrap();
        let sparse = super::packed::pack_sparse(&state, &rate);
        assert_eq!(sparse[0], 1);
        conn.execute(
            "UPDATE operation_state SET state = ?2 WHERE op = ?1",
            rusqlite::params![op, sparse],
        )
        .unwrap();
        held.push((op, (state, rate)));
    }
    assert!(!held.is_empty());
    held
}

fn packed_states(conn: &Connection) -> Vec<(i64, String, crate::phase::OperationState)> {
    conn.prepare(
        "SELECT o.id, o.operation_id, o.phase, o.created_ms, s.state
         FROM operations o JOIN operation_state s ON s.op = o.id ORDER BY o.id",
    )
    .unwrap()
    .query_map([], |r| {
        let mut state = crate::phase::OperationState {
            phase: r.get::<_, String>(2)?.parse().unwrap(),
            created_ms: r.get(3)?,
            ..Default::default()
        };
        super::packed::from_column(r, 4, &mut state)?;
        Ok((r.get(0)?, r.get(1)?, state))
    })
    .unwrap()
    .collect::<rusqlite::Result<_>>()
    .unwrap()
}

/// What migration 12 must leave: the mutable columns (those migration 11 moved to
/// `operation_progress`, and the errors and retries) packed into `operation_state`,
/// one row per operation with its phase (a new operation gets its row, a phase change
/// is copied by the trigger), and the old table and columns gone.
fn check_state_after_migration_12(conn: &Connection, from: u32) {
    let columns: Vec<String> = conn
        .prepare("SELECT name FROM pragma_table_info('operations')")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap();
    for moved in [
        "n_completed",
        "n_total",
        "description",
        "updated_ms",
        "rate",
        "error",
        "operation_units",
        "started_ms",
        "attempts",
        "last_error",
        "next_attempt_ms",
        "retrying_since_ms",
    ] {
        assert!(
            !columns.iter().any(|c| c == moved),
            "{moved} from version {from}"
        );
    }
    let old_table: bool = conn
        .query_row(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE name = 'operation_progress')",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(!old_table, "operation_progress from version {from}");
    let pairs = |conn: &Connection| -> Vec<(i64, String, String)> {
        conn.prepare(
            "SELECT o.id, o.phase, s.phase FROM operations o \
             LEFT JOIN operation_state s ON s.op = o.id ORDER BY o.id",
        )
        .unwrap()
        .query_map([], |r| {
            Ok((
                r.get(0)?,
                r.get(1)?,
                r.get::<_, Option<String>>(2)?.unwrap_or_default(),
            ))
        })
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap()
    };
    let all = pairs(conn);
    assert_eq!(all.len(), 3, "from version {from}");
    assert!(
        all.iter().all(|(_, o, p)| o == p),
        "{all:?} from version {from}"
    );
    conn.execute("UPDATE operations SET phase = 'Failed' WHERE id = 2", [])
        .unwrap();
    let op = copier_op("q", "op-4");
    assert_eq!(
        queries::insert_operations(conn, 1, &[op], UnixMs(1))
            .unwrap()
            .len(),
        1
    );
    let all = pairs(conn);
    assert_eq!(all.len(), 4, "from version {from}");
    assert!(
        all.iter().all(|(_, o, p)| o == p),
        "{all:?} from version {from}"
    );
    let new = &packed_states(conn)[3].2;
    assert_eq!(
        (new.n_completed, new.updated_ms),
        (0, None),
        "from version {from}"
    );
    // As it was, for the checks that follow (this connection has no foreign keys).
    conn.execute_batch(
        "UPDATE operations SET phase = 'Completed' WHERE id = 2;
         DELETE FROM operations WHERE operation_id = 'op-4';
         DELETE FROM operation_state WHERE op NOT IN (SELECT id FROM operations);
         UPDATE owners SET n_operations = n_operations - 1 WHERE id = 1;",
    )
    .unwrap();
}

#[test]
fn every_older_schema_version_opens_and_keeps_its_data() {
    for version in 0..CURRENT_VERSION {
        let (_dir, db) = temp_db();
        let sparse = {
            let mut conn = Connection::open(&db).unwrap();
            if version >= 12 {
                // What migration 12 wrote before layout 2: the data of version 11 packed
                // in layout 1; then, for later versions, their migrations.
                schema::migrate_to(&mut conn, 11).unwrap();
                fill_old_database(&conn, 11);
                assert_eq!(schema::migrate_to(&mut conn, 12).unwrap(), 12);
                let sparse = write_states_in_layout_1(&conn);
                assert_eq!(schema::migrate_to(&mut conn, version).unwrap(), version);
                sparse
            } else {
                assert_eq!(schema::migrate_to(&mut conn, version).unwrap(), version);
                fill_old_database(&conn, version);
                Vec::new()
            }
        };
        let store =
            Store::open(&db, |_, _| {}).unwrap_or_else(|e| panic!("version {version}: {e}"));
        let conn = Connection::open(&db).unwrap();
        let found: u32 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(found, CURRENT_VERSION, "from version {version}");
        // Migration 13: every state that decodes is in layout 2 now, holding what it held
        // in layout 1; a damaged one is left as it was.
        let stored = stored_states(&conn);
        assert!(!stored.is_empty() || version == 0, "from version {version}");
        for (op, bytes) in &stored {
            assert_eq!(bytes[0], 2, "op {op} from version {version}");
        }
        for (op, before) in &sparse {
            let after = super::packed::unpack(&stored.iter().find(|(o, _)| o == op).unwrap().1)
                .expect("decodes");
            assert_eq!(&after, before, "op {op} from version 12");
        }
        if version >= 1 {
            let backup = queries::owner_by_name(&conn, OwnerKind::Backup, "old-backup")
                .unwrap()
                .expect("backup kept");
            assert_eq!(backup.owner.phase, OwnerPhase::WaitingForPluginOperations);
            assert!(backup.owner.finalize, "backups always finalize");
            assert_eq!(
                (
                    backup.owner.operations_attempted,
                    backup.owner.operations_completed,
                    backup.owner.operations_failed
                ),
                (3, 1, 1),
                "counts from version {version}"
            );
            assert_eq!(unfinished(&conn, backup.id), 1);
            let restore = queries::owner_by_name(&conn, OwnerKind::Restore, "old-restore")
                .unwrap()
                .expect("restore kept");
            assert!(!restore.owner.finalize, "restores keep the default");
            // Migration 7: started by no named server, no failure, last called when
            // last updated.
            assert_eq!(restore.owner.server, None);
            assert_eq!(restore.owner.failure_reason, None);
            let last_call: i64 = conn
                .query_row(
                    "SELECT last_call_ms FROM owners WHERE id = ?1",
                    [restore.id],
                    |r| r.get(0),
                )
                .unwrap();
            assert_eq!(last_call, 1000);
            assert_eq!(
                restore.owner.item_operation_timeout,
                GoDuration::from_secs(60)
            );
        }
        if version >= 2 {
            assert_eq!(queries::snapshotters(&conn).unwrap().len(), 1);
        }
        if version >= 1 {
            check_operations_after_identity_migration(&conn, version);
            check_control_after_migration_9(&conn, version);
            // Migration 10: no history before it, and no rate yet; a rate sampled
            // from then on is kept (migration 12 packs it).
            let backup = queries::owner_by_name(&conn, OwnerKind::Backup, "old-backup")
                .unwrap()
                .expect("backup kept");
            check_events_after_migration_14(&conn, backup.id, version);
            check_identity_after_migration_16(&conn, backup.id, version);
            let ops = queries::operations(&conn, backup.id, None).unwrap();
            let rate = (version >= 10).then_some(2.5);
            assert_eq!(ops[0].rate, rate, "from version {version}");
            assert!(ops[1..].iter().all(|o| o.rate.is_none() && o.eta.is_none()));
            let states = packed_states(&conn);
            let first = &states[0].2;
            let anchor = (first.n_completed, first.progressed_ms);
            assert_eq!(anchor, (5, Some(2000)), "from version {version}");
            assert_eq!(first.operation_units, "bytes", "from version {version}");
            let retried = &states[1].2;
            let retries = (
                retried.attempts,
                retried.last_error.as_str(),
                retried.next_attempt_ms,
                retried.retrying_since_ms,
            );
            let expected = if version >= 9 {
                (3, "busy", Some(2100), Some(1800))
            } else {
                (0, "", None, None)
            };
            assert_eq!(retries, expected, "from version {version}");
            let rate: Rate = conn
                .query_row("SELECT state FROM operation_state WHERE op = 1", [], |r| {
                    let mut state = crate::phase::OperationState::default();
                    super::packed::from_column(r, 0, &mut state)
                })
                .unwrap();
            let expected = if version >= 10 {
                (4, Some(1900), Some(1950))
            } else {
                (0, None, None)
            };
            let anchor = (rate.anchor_n, rate.anchor_ms, rate.seen_ms);
            assert_eq!(anchor, expected, "from version {version}");
            assert_eq!(
                ops[2].error.as_deref(),
                Some("boom: é"),
                "from version {version}"
            );
            let text = if version >= 11 { "ok\u{fffd}" } else { "" };
            assert_eq!(ops[2].description, text, "from version {version}");
        }
        if version >= 2 {
            let s = &queries::snapshotters(&conn).unwrap()[0];
            assert_eq!(
                (s.stall_timeout, s.start_timeout, s.retry_attempts),
                (None, None, None),
                "a snapshotter registered before migration 9 sets no deadline or budget"
            );
        }
        store.close();
    }
}

/// What migration 9 must leave: no cancel out, no retries, progress seen when the
/// operation last changed (so a stall deadline set later counts from there), owners
/// without deadlines, and a Canceled operation counted with the failed ones.
fn check_control_after_migration_9(conn: &Connection, from: u32) {
    type Row = (i64, bool, Option<i64>, u32, String, Option<i64>);
    let cancel_requested: bool = conn
        .query_row(
            "SELECT cancel_requested FROM operations WHERE id = 1",
            [],
            |r| r.get(0),
        )
        .unwrap();
    let (id, _, s) = packed_states(conn).remove(0);
    let row: Row = (
        id,
        cancel_requested,
        s.progressed_ms,
        s.attempts,
        s.last_error,
        s.next_attempt_ms,
    );
    assert_eq!(
        row,
        (1, false, Some(2000), 0, String::new(), None),
        "from version {from}"
    );
    // The identity check completed op-1; it runs again.
    conn.execute(
        "UPDATE operations SET phase = 'InProgress' WHERE id = 1",
        [],
    )
    .unwrap();
    let targets = queries::poll_targets(conn, queries::Targets::Owner(1)).unwrap();
    assert_eq!(targets.len(), 1, "from version {from}");
    assert_eq!(
        (targets[0].stall_timeout_ms, targets[0].start_timeout_ms),
        (None, None)
    );
    assert_eq!(targets[0].state.progressed_ms, Some(2000));
    let backup = queries::owner_by_id(conn, 1).unwrap().unwrap().owner;
    assert_eq!((backup.stall_timeout, backup.start_timeout), (None, None));
    let failed_before = backup.operations_failed;
    let canceled =
        queries::cancel_operations(conn, 1, &[1], "canceled: test", UnixMs(3000)).unwrap();
    assert_eq!(canceled, [1]);
    let after = queries::owner_by_id(conn, 1).unwrap().unwrap();
    assert_eq!(
        after.owner.operations_failed,
        failed_before + 1,
        "from version {from}"
    );
    assert_eq!(after.unfinished(), 0);
    let ops = queries::operations(conn, 1, None).unwrap();
    assert!(ops[0].cancel_requested);
    queries::clear_cancel_requested(conn, &[1]).unwrap();
    assert!(!queries::operations(conn, 1, None).unwrap()[0].cancel_requested);
    conn.execute(
        "UPDATE operations SET phase = 'InProgress' WHERE id = 1",
        [],
    )
    .unwrap();
    assert_eq!(
        queries::owner_by_id(conn, 1)
            .unwrap()
            .unwrap()
            .owner
            .operations_failed,
        failed_before,
        "leaving Canceled is counted too"
    );
}

/// Each owner's counts as a scan of its operations finds them.
/// The owner's unfinished operations by its count columns (0 once it is gone).
fn unfinished(conn: &Connection, owner: i64) -> u64 {
    queries::owner_by_id(conn, owner)
        .unwrap()
        .map_or(0, |row| row.unfinished())
}

fn recount(conn: &Connection) -> Vec<(i64, u64, u64, u64)> {
    let mut stmt = conn
        .prepare(
            "SELECT w.id, COUNT(o.id), COUNT(o.id) FILTER (WHERE o.phase = 'Completed'),
                    COUNT(o.id) FILTER (WHERE o.phase = 'Failed')
             FROM owners w LEFT JOIN operations o ON o.owner_id = w.id GROUP BY w.id ORDER BY w.id",
        )
        .unwrap();
    let rows = stmt
        .query_map([], |r| {
            let n = |i| r.get::<_, i64>(i).map(|n| n as u64);
            Ok((r.get(0)?, n(1)?, n(2)?, n(3)?))
        })
        .unwrap();
    rows.collect::<rusqlite::Result<_>>().unwrap()
}

/// The counts stored on each owner, as `owner_by_id` reads them.
fn stored_counts(conn: &Connection) -> Vec<(i64, u64, u64, u64)> {
    let ids: Vec<i64> = conn
        .prepare("SELECT id FROM owners ORDER BY id")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap();
    ids.into_iter()
        .map(|id| {
            let o = queries::owner_by_id(conn, id).unwrap().unwrap().owner;
            (
                id,
                o.operations_attempted,
                o.operations_completed,
                o.operations_failed,
            )
        })
        .collect()
}

#[test]
fn owner_counts_follow_every_insert_phase_change_failure_and_delete() {
    use crate::phase::OperationState;
    use opmon_client::OperationPhase;

    let (_dir, db) = temp_db();
    drop(Store::open(&db, |_, _| {}).unwrap());
    let conn = Connection::open(&db).unwrap();
    conn.execute_batch("PRAGMA foreign_keys = ON").unwrap();
    let op = |id: &str| copier_op(id, id);
    let timeout = GoDuration::from_millis(60_000);
    let a = queries::insert_owner(&conn, &backup("a", timeout), UnixMs(1)).unwrap();
    let b = queries::insert_owner(&conn, &backup("b", timeout), UnixMs(1)).unwrap();
    let ops: Vec<opmon_client::NewOperation> = (0..6).map(|i| op(&format!("op-{i}"))).collect();
    let rows = queries::insert_operations(&conn, a, &ops, UnixMs(1)).unwrap();
    // Already known: ignored, not counted twice.
    assert!(queries::insert_operations(&conn, a, &ops[..2], UnixMs(1))
        .unwrap()
        .is_empty());
    queries::insert_operations(&conn, b, &ops[..3], UnixMs(1)).unwrap();
    assert_eq!(stored_counts(&conn), vec![(a, 6, 0, 0), (b, 3, 0, 0)]);

    let state = |phase| OperationState {
        phase,
        ..OperationState::default()
    };
    // New → InProgress changes no count; progress without a phase change neither.
    let write = |row, old, new| {
        queries::OperationUpdates::new(&conn)
            .write(row, &state(old), &state(new), &Rate::default())
            .unwrap()
    };
    use OperationPhase::{Completed, Failed, InProgress, New};
    assert!(write(rows[0], New, InProgress));
    assert!(write(rows[0], InProgress, InProgress));
    assert!(write(rows[0], InProgress, Completed));
    assert!(write(rows[1], New, Failed));
    // A finished operation is not updated again, so it is not counted again.
    assert!(!write(rows[0], InProgress, Failed));
    // Nor is one whose phase moved on since it was read.
    assert!(!write(rows[1], New, New));
    assert_eq!(stored_counts(&conn), recount(&conn));
    assert_eq!(stored_counts(&conn)[0], (a, 6, 1, 1));
    assert_eq!(unfinished(&conn, a), 4);

    assert_eq!(
        queries::fail_unfinished(&conn, a, "cancelled", UnixMs(2)).unwrap(),
        4
    );
    assert_eq!(stored_counts(&conn), vec![(a, 6, 1, 5), (b, 3, 0, 0)]);
    assert_eq!(stored_counts(&conn), recount(&conn));
    assert_eq!(unfinished(&conn, a), 0);

    let (owners, unfinished_in_all) = queries::tally(&conn).unwrap();
    assert_eq!(owners.get(&OwnerPhase::InProgress), Some(&2));
    assert_eq!(unfinished_in_all, 3);
    queries::delete_owner(&conn, b, OwnerKind::Backup, "b").unwrap();
    assert_eq!(queries::tally(&conn).unwrap().1, 0);
    assert_eq!(unfinished(&conn, b), 0);
    assert_eq!(stored_counts(&conn), recount(&conn));
}

#[test]
fn a_database_newer_than_the_agent_is_refused() {
    let (_dir, db) = temp_db();
    Connection::open(&db)
        .unwrap()
        .pragma_update(None, "user_version", CURRENT_VERSION + 1)
        .unwrap();
    let err = Store::open(&db, |_, _| {})
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains(&format!(
            "schema version {} is newer than this agent supports ({CURRENT_VERSION})",
            CURRENT_VERSION + 1
        )),
        "{err}"
    );
}

#[test]
fn the_database_is_created_0600_in_wal_mode_and_locked_for_one_agent() {
    let (_dir, db) = temp_db();
    let store = Store::open(&db, |_, _| {}).unwrap();
    let mode = std::fs::metadata(&db).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let journal: String = Connection::open(&db)
        .unwrap()
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(journal, "wal");
    match Store::open(&db, |_, _| {}) {
        Err(OpenError::Locked { db: locked, pid }) => {
            assert_eq!(locked, db);
            assert_eq!(pid, std::process::id().to_string());
        }
        other => panic!("expected the lock to refuse, got {:?}", other.err()),
    }
    // A lock file replaced by a rename (what a client could once do through
    // finalize) does not let a second agent in: the directory is locked.
    let mut lock = db.as_os_str().to_owned();
    lock.push(".lock");
    let fresh = db.with_file_name("fresh");
    std::fs::write(&fresh, b"").unwrap();
    std::fs::rename(&fresh, &lock).unwrap();
    match Store::open(&db, |_, _| {}) {
        Err(OpenError::Locked { .. }) => {}
        other => panic!(
            "a replaced lock file let a second store in: {:?}",
            other.err()
        ),
    }
    store.close();
    drop(store);
    Store::open(&db, |_, _| {}).expect("the lock is released with the store");
}

/// The writer checkpoints once the WAL passes [`super::CHECKPOINT_PAGES`], not at
/// SQLite's default 1,000 pages: past 1,000 the WAL keeps growing, and past 4,000 it is
/// checkpointed and written again from its start, so it stays near that size.
#[tokio::test]
async fn the_wal_is_checkpointed_past_checkpoint_pages_and_not_before() {
    let (_dir, db) = temp_db();
    let store = Store::open(&db, |_, _| {}).unwrap();
    let page: i64 = store
        .write(|conn| {
            conn.execute_batch("CREATE TABLE filler (x BLOB)")?;
            conn.query_row("PRAGMA page_size", [], |r| r.get(0))
                .map_err(StorageFailure::from)
        })
        .await
        .unwrap();
    let frame = page.unsigned_abs() + 24;
    let mut wal = db.as_os_str().to_owned();
    wal.push("-wal");
    let wal_len = || std::fs::metadata(&wal).unwrap().len();
    // One transaction of `pages` pages: a row of 3,000 bytes fills a page of its own.
    let commit = |pages: u32| {
        store.write(move |conn| {
            conn.execute(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n \
                 WHERE i < ?1) INSERT INTO filler SELECT randomblob(3000) FROM n",
                [pages],
            )
            .map(drop)
            .map_err(StorageFailure::from)
        })
    };
    // Commits of 100 pages each.
    let fill = |pages: u32| {
        let commit = &commit;
        async move {
            for _ in 0..pages / 100 {
                commit(100).await.unwrap();
            }
        }
    };
    fill(2_000).await;
    assert!(
        wal_len() >= 2_000 * frame,
        "the WAL was checkpointed before {} pages: {} bytes after 2,000 pages",
        super::CHECKPOINT_PAGES,
        wal_len()
    );
    fill(8_000).await;
    let limit = (u64::from(super::CHECKPOINT_PAGES) + 300) * frame;
    assert!(
        wal_len() <= limit,
        "the WAL grew to {} bytes after 10,000 pages: past {limit}, so it was not \
         checkpointed and restarted",
        wal_len()
    );
    // One transaction of 8,000 pages grows the file past what is kept; once a
    // checkpoint lets the WAL restart, the next commit cuts the file back.
    commit(8_000).await.unwrap();
    assert!(
        wal_len() >= 8_000 * frame,
        "the big transaction is in the WAL"
    );
    fill(200).await;
    let kept = u64::from(super::WAL_KEPT_PAGES) * frame;
    assert!(
        wal_len() <= kept,
        "the WAL file kept {} bytes after a restart: past the {kept} it is cut back to",
        wal_len()
    );
    store.close();
}

/// Occupies the writer with a request that blocks inside its transaction until the
/// returned sender is used. Returns once the writer is inside that request, so every
/// request sent afterwards queues for the next transaction.
async fn hold_writer(
    store: &Arc<Store>,
) -> (
    tokio::task::JoinHandle<Result<(), StorageFailure>>,
    std::sync::mpsc::Sender<()>,
) {
    let (release, held) = std::sync::mpsc::channel::<()>();
    let (inside, entered) = tokio::sync::oneshot::channel::<()>();
    let blocker = tokio::spawn({
        let store = store.clone();
        async move {
            store
                .write(move |_| {
                    let _ = inside.send(());
                    held.recv().ok();
                    Ok::<_, StorageFailure>(())
                })
                .await
        }
    });
    entered.await.expect("the writer ran the blocking request");
    (blocker, release)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_share_one_transaction() {
    let (_dir, db) = temp_db();
    let groups = Arc::new(Mutex::new(Vec::new()));
    let seen = groups.clone();
    let store = Arc::new(Store::open(&db, move |n, _| seen.lock().unwrap().push(n)).unwrap());

    // Hold the writer inside a first transaction until 64 more requests are queued.
    let (blocker, release) = hold_writer(&store).await;
    let writers: Vec<_> = (0..64)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .write(move |conn| {
                        queries::insert_owner(
                            conn,
                            &backup(&format!("b{i}"), GoDuration::from_secs(60)),
                            UnixMs(0),
                        )
                        .map_err(StorageFailure::from)
                    })
                    .await
            })
        })
        .collect();
    while store.queued_writes() < 64 {
        tokio::task::yield_now().await;
    }
    release.send(()).unwrap();
    blocker.await.unwrap().unwrap();
    for w in writers {
        w.await.unwrap().unwrap();
    }
    assert_eq!(*groups.lock().unwrap(), vec![1, 64]);
    let count: i64 = Connection::open(&db)
        .unwrap()
        .query_row("SELECT COUNT(*) FROM owners", [], |r| r.get(0))
        .unwrap();
    assert_eq!(count, 64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_request_is_rolled_back_alone_within_its_group() {
    let (_dir, db) = temp_db();
    let store = Arc::new(Store::open(&db, |_, _| {}).unwrap());
    let (blocker, release) = hold_writer(&store).await;
    let insert = |name: &'static str, fail: bool| {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .write(move |conn| {
                    queries::insert_owner(conn, &backup(name, GoDuration::from_secs(1)), UnixMs(0))
                        .map_err(StorageFailure::from)?;
                    if fail {
                        return Err(StorageFailure {
                            message: "refused".into(),
                            disk_full: false,
                        });
                    }
                    Ok(())
                })
                .await
        })
    };
    let good = insert("kept", false);
    let bad = insert("dropped", true);
    while store.queued_writes() < 2 {
        tokio::task::yield_now().await;
    }
    release.send(()).unwrap();
    blocker.await.unwrap().unwrap();
    good.await.unwrap().unwrap();
    assert_eq!(bad.await.unwrap().unwrap_err().message, "refused");
    let conn = Connection::open(&db).unwrap();
    assert!(queries::owner_by_name(&conn, OwnerKind::Backup, "kept")
        .unwrap()
        .is_some());
    assert!(queries::owner_by_name(&conn, OwnerKind::Backup, "dropped")
        .unwrap()
        .is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_the_whole_group_truthfully_and_writes_resume_once_space_is_back() {
    let (_dir, db) = temp_db();
    let store = Arc::new(Store::open(&db, |_, _| {}).unwrap());
    let add = |name: &'static str| {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .write(move |conn| {
                    queries::insert_owner(conn, &backup(name, GoDuration::from_secs(1)), UnixMs(0))
                        .map_err(StorageFailure::from)
                })
                .await
        })
    };
    let (blocker, release) = hold_writer(&store).await;
    let before = add("before-full");
    while store.queued_writes() < 1 {
        tokio::task::yield_now().await;
    }
    let full = tokio::spawn({
        let store = store.clone();
        async move {
            store
                .write(|conn| {
                    // Cap the file a few pages above its current size: the 1 MiB row
                    // below cannot get its pages and fails with SQLITE_FULL, exactly as a
                    // full file system makes it, while an owner row still fits.
                    let pages: i64 = conn.query_row("PRAGMA page_count", [], |r| r.get(0))?;
                    conn.query_row(
                        &format!("PRAGMA max_page_count = {}", pages + 8),
                        [],
                        |_| Ok(()),
                    )?;
                    conn.execute(
                        "INSERT INTO snapshotters (name, api_version, command) VALUES ('a/b', 'v2', ?1)",
                        [&"x".repeat(1 << 20)],
                    )?;
                    Ok::<_, StorageFailure>(())
                })
                .await
        }
    });
    while store.queued_writes() < 2 {
        tokio::task::yield_now().await;
    }
    let after = add("after-full");
    while store.queued_writes() < 3 {
        tokio::task::yield_now().await;
    }
    release.send(()).unwrap();
    blocker.await.unwrap().unwrap();

    let err = full.await.unwrap().unwrap_err();
    assert!(err.disk_full, "{}", err.message);
    assert!(
        err.message
            .starts_with("the disk holding the database is full"),
        "{}",
        err.message
    );
    // SQLite rolled the whole transaction back: the request that ran before it in the
    // same group is told so, not acknowledged.
    let before = before.await.unwrap().unwrap_err();
    assert!(before.disk_full, "{}", before.message);
    // The one after it ran in a fresh transaction; the cap still holds, but one owner
    // row fits in the pages left under it.
    after.await.unwrap().unwrap();

    // Space comes back: writes resume on the same connection, no restart.
    store
        .write(|conn| {
            conn.query_row("PRAGMA max_page_count = 1073741823", [], |_| Ok(()))
                .map_err(StorageFailure::from)
        })
        .await
        .unwrap();
    add("after-space").await.unwrap().unwrap();
    let conn = Connection::open(&db).unwrap();
    let names: Vec<String> = conn
        .prepare("SELECT name FROM owners ORDER BY name")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(names, ["after-full", "after-space"]);
}

#[test]
fn a_records_mark_is_cleared_only_by_a_write_of_its_own_generation() {
    let (_dir, db) = temp_db();
    drop(Store::open(&db, |_, _| {}).unwrap());
    let conn = Connection::open(&db).unwrap();
    conn.execute_batch("PRAGMA foreign_keys = ON").unwrap();
    let a =
        queries::insert_owner(&conn, &backup("a", GoDuration::from_secs(60)), UnixMs(1)).unwrap();
    assert_eq!(queries::records_due_generation(&conn, a).unwrap(), None);
    queries::mark_records_due(&conn, a).unwrap();
    let read = queries::records_due_generation(&conn, a).unwrap().unwrap();
    // A change after the write read its state marks the file again.
    queries::mark_records_due(&conn, a).unwrap();
    queries::clear_records_due(&conn, &[(a, read)]).unwrap();
    let newer = queries::records_due_generation(&conn, a).unwrap();
    assert_eq!(newer, Some(read + 1), "the newer mark stays");
    queries::clear_records_due(&conn, &[(a, read + 1)]).unwrap();
    assert_eq!(queries::records_due_generation(&conn, a).unwrap(), None);
    // A deleted owner has nothing left to write.
    queries::mark_records_due(&conn, a).unwrap();
    queries::delete_owner(&conn, a, OwnerKind::Backup, "a").unwrap();
    assert!(queries::records_due(&conn, 0, 10).unwrap().is_empty());
}

#[test]
fn expiry_deletes_in_bounded_batches_oldest_first_and_records_each_removal() {
    let (_dir, db) = temp_db();
    drop(Store::open(&db, |_, _| {}).unwrap());
    let conn = Connection::open(&db).unwrap();
    conn.execute_batch("PRAGMA foreign_keys = ON").unwrap();
    for (i, name) in ["c", "a", "b", "kept", "running"].iter().enumerate() {
        let id = queries::insert_owner(&conn, &backup(name, GoDuration::from_secs(60)), UnixMs(1))
            .unwrap();
        let mut row = queries::owner_by_id(&conn, id).unwrap().unwrap();
        if *name != "running" {
            row.owner.phase = OwnerPhase::Completed;
        }
        // Completed at 10, 11, 12, …: `kept` completed after the cut-off.
        let completed = 10 + i as i64 + if *name == "kept" { 100 } else { 0 };
        queries::update_owner(&conn, &row, UnixMs(completed)).unwrap();
    }
    let first = queries::delete_expired(&conn, UnixMs(50), 2).unwrap();
    let names: Vec<&str> = first.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["c", "a"], "oldest first, at most the limit");
    let rest = queries::delete_expired(&conn, UnixMs(50), 2).unwrap();
    assert_eq!(rest.len(), 1);
    assert_eq!(rest[0].name, "b");
    assert!(queries::delete_expired(&conn, UnixMs(50), 2)
        .unwrap()
        .is_empty());
    let recorded: Vec<String> = queries::removals(&conn, 0, 10)
        .unwrap()
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(recorded, ["c", "a", "b"]);
    let left =
        queries::existing_names(&conn, OwnerKind::Backup, &["a", "kept", "running"]).unwrap();
    assert_eq!(left.len(), 2, "{left:?}");
    queries::clear_removals(&conn, &[first[0].id, first[1].id]).unwrap();
    assert_eq!(queries::removals(&conn, 0, 10).unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_counts_follow_every_commit_whatever_wrote_it() {
    let (_dir, db) = temp_db();
    let store = Arc::new(Store::open(&db, |_, _| {}).unwrap());
    let in_progress = |n: u64| {
        (
            std::collections::BTreeMap::from([(OwnerPhase::InProgress, n)]),
            0,
        )
    };
    assert_eq!(store.counts().await.unwrap(), Default::default());

    store
        .write(|conn| {
            queries::insert_owner(conn, &backup("b", GoDuration::from_secs(60)), UnixMs(0))
                .map_err(StorageFailure::from)
        })
        .await
        .unwrap();
    assert_eq!(store.counts().await.unwrap(), in_progress(1));
    // Cached now; a read again gives the same.
    assert_eq!(store.counts().await.unwrap(), in_progress(1));

    // Any write may change a phase: none has to say so.
    store
        .write(|conn| {
            conn.execute("UPDATE owners SET phase = 'Failed'", [])
                .map_err(StorageFailure::from)
        })
        .await
        .unwrap();
    let failed = std::collections::BTreeMap::from([(OwnerPhase::Failed, 1)]);
    assert_eq!(store.counts().await.unwrap(), (failed.clone(), 0));

    // Counts read while a transaction is open are the last commit's, and are not kept
    // past the commit.
    let (blocker, release) = hold_writer(&store).await;
    let insert = tokio::spawn({
        let store = store.clone();
        async move {
            store
                .write(|conn| {
                    queries::insert_owner(conn, &backup("c", GoDuration::from_secs(60)), UnixMs(0))
                        .map_err(StorageFailure::from)
                })
                .await
        }
    });
    assert_eq!(store.counts().await.unwrap(), (failed.clone(), 0));
    while store.queued_writes() < 1 {
        tokio::task::yield_now().await;
    }
    release.send(()).unwrap();
    blocker.await.unwrap().unwrap();
    insert.await.unwrap().unwrap();
    let both =
        std::collections::BTreeMap::from([(OwnerPhase::InProgress, 1), (OwnerPhase::Failed, 1)]);
    assert_eq!(store.counts().await.unwrap(), (both, 0));
}

#[tokio::test]
async fn counts_stay_cached_across_progress_and_follow_a_phase_a_trigger_counts() {
    let (_dir, db) = temp_db();
    let store = Arc::new(Store::open(&db, |_, _| {}).unwrap());
    let op = copier_op("p", "op-1");
    store
        .write(move |conn| {
            let owner =
                queries::insert_owner(conn, &backup("b", GoDuration::from_secs(60)), UnixMs(0))?;
            queries::insert_operations(conn, owner, &[op], UnixMs(0))?;
            Ok::<_, StorageFailure>(())
        })
        .await
        .unwrap();
    let in_progress = std::collections::BTreeMap::from([(OwnerPhase::InProgress, 1)]);
    assert_eq!(store.counts().await.unwrap(), (in_progress.clone(), 1));
    assert!(store.tally.cached().is_ok(), "read once, then cached");

    // Progress touches no owner: the counts stay in memory.
    store
        .write(|conn| {
            let progressed = crate::phase::OperationState {
                n_completed: 5,
                description: "x".into(),
                ..Default::default()
            };
            let state = super::packed::pack(&progressed, &Rate::default())?;
            conn.execute("UPDATE operation_state SET state = ?1", [state])
                .map_err(StorageFailure::from)
        })
        .await
        .unwrap();
    assert!(
        store.tally.cached().is_ok(),
        "a progress-only commit dropped the counts"
    );

    // A phase change reaches the owner's counts through a trigger, which the hook sees.
    store
        .write(|conn| {
            conn.execute("UPDATE operations SET phase = 'Completed'", [])
                .map_err(StorageFailure::from)
        })
        .await
        .unwrap();
    assert_eq!(store.counts().await.unwrap(), (in_progress, 0));
}

/// Migration 14 drops events whose owner is gone (left by hand, or by a tool with
/// foreign keys off), which the new table's foreign key would refuse; the rest stay.
#[test]
fn migration_14_leaves_out_events_of_owners_gone() {
    let (_dir, db) = temp_db();
    {
        let mut conn = Connection::open(&db).unwrap();
        schema::migrate_to(&mut conn, 10).unwrap();
        fill_old_database(&conn, 10);
        conn.execute_batch(
            "PRAGMA foreign_keys = OFF;
             INSERT INTO events (owner_id, seq, at_ms, reason, message)
             VALUES (99, 1, 1000, 'Started', 'of an owner gone');",
        )
        .unwrap();
    }
    let store = Store::open(&db, |_, _| {}).expect("migrates");
    let conn = Connection::open(&db).unwrap();
    let owners: Vec<i64> = conn
        .prepare("SELECT DISTINCT owner_id FROM events ORDER BY owner_id")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(owners, vec![1, 2]);
    check_events_after_migration_14(&conn, 1, 10);
    store.close();
}

/// Events of many owners recorded in one transaction (a group commit of their calls)
/// share the table's last page: the commit writes a few pages, not one per owner, as
/// it did while events were stored by owner (before migration 14).
#[test]
fn one_commit_of_many_owners_events_writes_a_few_pages() {
    use super::events::{self, NewEvent};
    use opmon_client::EventReason;

    let (_dir, db) = temp_db();
    drop(Store::open(&db, |_, _| {}).unwrap());
    let conn = Connection::open(&db).unwrap();
    conn.execute_batch("PRAGMA foreign_keys = ON; PRAGMA wal_autocheckpoint = 0")
        .unwrap();
    let record = |owner: i64, i: i64| {
        let message = format!("2 operations added (0 already known); {i} in all");
        let event = NewEvent {
            reason: EventReason::OperationsAdded,
            operation: None,
            caller: None,
            message: &message,
        };
        events::record(&conn, owner, &event, UnixMs(1000 + i)).unwrap();
    };
    let owners: Vec<i64> = (0..40)
        .map(|i| {
            let name = format!("b{i}");
            let b = backup(&name, GoDuration::from_secs(60));
            queries::insert_owner(&conn, &b, UnixMs(1)).unwrap()
        })
        .collect();
    // Each owner with a history of its own, recorded as calls come, owners interleaved.
    conn.execute_batch("BEGIN").unwrap();
    for i in 0..30 {
        for &owner in &owners {
            record(owner, i);
        }
    }
    conn.execute_batch("COMMIT").unwrap();
    let wal = db.with_extension("db-wal");
    let before = std::fs::metadata(&wal).unwrap().len();
    conn.execute_batch("BEGIN").unwrap();
    for &owner in &owners {
        record(owner, 30);
    }
    conn.execute_batch("COMMIT").unwrap();
    let frames = (std::fs::metadata(&wal).unwrap().len() - before) / (4096 + 24);
    assert!(frames >= 1, "the commit wrote its events");
    assert!(
        frames <= 10,
        "one event for each of 40 owners wrote {frames} pages"
    );
}

#[test]
fn events_are_numbered_per_owner_bounded_and_removed_with_their_owner() {
    use super::events::{self, NewEvent, MAX_PER_OWNER};
    use opmon_client::{Caller, EventReason};

    let (_dir, db) = temp_db();
    drop(Store::open(&db, |_, _| {}).unwrap());
    let conn = Connection::open(&db).unwrap();
    conn.execute_batch("PRAGMA foreign_keys = ON").unwrap();
    let a =
        queries::insert_owner(&conn, &backup("a", GoDuration::from_secs(60)), UnixMs(1)).unwrap();
    let b =
        queries::insert_owner(&conn, &backup("b", GoDuration::from_secs(60)), UnixMs(1)).unwrap();
    let caller = Caller { uid: 7, pid: 42 };
    for i in 0..MAX_PER_OWNER + 5 {
        let message = format!("event {i}");
        let event = NewEvent {
            reason: EventReason::OperationsAdded,
            operation: None,
            caller: Some(caller),
            message: &message,
        };
        events::record(&conn, a, &event, UnixMs(1000 + i)).unwrap();
    }
    let event = NewEvent {
        reason: EventReason::Started,
        operation: None,
        caller: None,
        message: "b's own",
    };
    events::record(&conn, b, &event, UnixMs(5)).unwrap();
    // The oldest five of a's went; b's numbering is its own.
    assert_eq!(events::count(&conn, a).unwrap(), MAX_PER_OWNER);
    let first = events::page(&conn, a, 0, 2).unwrap();
    assert_eq!(first[0].seq, 6);
    assert_eq!(first[0].message, "event 5");
    assert_eq!(first[0].caller, Some(caller));
    assert_eq!(first[1].seq, 7);
    let tail = events::page(&conn, a, MAX_PER_OWNER as u64, 100).unwrap();
    let seqs: Vec<u64> = tail.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1001..=1005).collect::<Vec<u64>>());
    assert!(events::page(&conn, a, u64::MAX, 10).unwrap().is_empty());
    let bs = events::page(&conn, b, 0, 10).unwrap();
    assert_eq!((bs.len(), bs[0].seq, bs[0].caller), (1, 1, None));
    queries::delete_owner(&conn, a, OwnerKind::Backup, "a").unwrap();
    assert_eq!(events::count(&conn, a).unwrap(), 0);
    assert_eq!(events::count(&conn, b).unwrap(), 1);
}

/// Whichever statements a change is written with (the packed state alone for most of a
/// sweep, the phase too when it changes), every field of the new state is stored: one
/// field changed at a time, then read back as the poller reads it.
#[test]
fn every_field_of_a_polled_change_is_stored_by_whichever_statement_writes_it() {
    use crate::phase::OperationState;
    use opmon_client::OperationPhase;
    let (_dir, db) = temp_db();
    let store = Store::open(&db, |_, _| {}).unwrap();
    drop(store);
    let conn = Connection::open(&db).unwrap();
    let owner =
        queries::insert_owner(&conn, &backup("b", GoDuration::from_secs(60)), UnixMs(1)).unwrap();
    let op = opmon_client::NewOperation {
        plugin: opmon_client::PluginRef {
            kind: opmon_client::PluginKind::BackupItemAction,
            name: "example.io/p".into(),
        },
        resource: opmon_client::ResourceIdentifier {
            group: String::new(),
            resource: "pods".into(),
            namespace: "ns".into(),
            name: "a".into(),
        },
        operation_id: "op".into(),
        post_operation_items: Vec::new(),
        created: None,
    };
    let row = queries::insert_operations(&conn, owner, &[op], UnixMs(1)).unwrap()[0];
    let stored = |conn: &Connection| {
        let targets = queries::poll_targets(conn, queries::Targets::Owner(owner)).unwrap();
        (targets[0].state.clone(), targets[0].rate)
    };
    let (mut old, _) = stored(&conn);
    type Change = fn(&mut OperationState, &mut Rate);
    let changes: [(&str, Change); 16] = [
        ("phase", |s, _| s.phase = OperationPhase::InProgress),
        ("nCompleted", |s, _| s.n_completed += 7),
        ("nTotal", |s, _| s.n_total = 100),
        ("description", |s, _| s.description = "copying".into()),
        ("updated", |s, _| s.updated_ms = Some(5_000)),
        ("plugin updated", |s, _| s.plugin_updated_ms = Some(4_000)),
        ("progressed", |s, _| s.progressed_ms = Some(5_001)),
        ("rate", |_, r| r.per_second = Some(2.5)),
        ("rate anchor", |_, r| {
            r.anchor_n = 3;
            r.anchor_ms = Some(4_500);
            r.seen_ms = Some(4_600);
        }),
        ("error", |s, _| s.error = "e".into()),
        ("units", |s, _| s.operation_units = "bytes".into()),
        ("started", |s, _| s.started_ms = Some(3_000)),
        ("attempts", |s, _| s.attempts = 2),
        ("last error", |s, _| s.last_error = "busy".into()),
        ("next attempt", |s, _| s.next_attempt_ms = Some(9_000)),
        ("retrying since", |s, _| s.retrying_since_ms = Some(8_000)),
    ];
    let mut rate = stored(&conn).1;
    for (what, change) in changes {
        let mut new = old.clone();
        change(&mut new, &mut rate);
        let mut updates = queries::OperationUpdates::new(&conn);
        assert!(updates.write(row, &old, &new, &rate).unwrap(), "{what}");
        drop(updates);
        let (state, stored_rate) = stored(&conn);
        assert_eq!(state, new, "after a change of {what}");
        assert_eq!(stored_rate, rate, "after a change of {what}");
        old = new;
    }
    // A cancel wins over a poll that read the state before it: the poll's write finds
    // another phase and changes nothing; what the cancel wrote stays.
    queries::cancel_operations(&conn, owner, &[row], "canceled: by test", UnixMs(9_500)).unwrap();
    // No longer a target: read as stored.
    let stored = |conn: &Connection| packed_states(conn).remove(0).2;
    let canceled = stored(&conn);
    assert_eq!(canceled.phase, OperationPhase::Canceled);
    assert_eq!(
        (
            canceled.error.as_str(),
            canceled.updated_ms,
            canceled.next_attempt_ms
        ),
        ("canceled: by test", Some(9_500), None)
    );
    let mut late = old.clone();
    late.n_completed += 1;
    let mut updates = queries::OperationUpdates::new(&conn);
    assert!(!updates.write(row, &old, &late, &rate).unwrap());
    drop(updates);
    assert_eq!(stored(&conn), canceled);
}

/// A state damaged outside the agent (cut short, of another type) stops nothing: the
/// sweep polls its operation afresh and the write repairs it, listings show the
/// operation with why, a cancel rewrites it, and the other operations are untouched.
#[test]
fn a_damaged_state_is_polled_afresh_listed_with_why_and_repaired_by_a_write() {
    let (_dir, db) = temp_db();
    drop(Store::open(&db, |_, _| {}).unwrap());
    let conn = Connection::open(&db).unwrap();
    let owner =
        queries::insert_owner(&conn, &backup("b", GoDuration::from_secs(60)), UnixMs(1)).unwrap();
    conn.execute(
        "UPDATE owners SET phase = 'WaitingForPluginOperations' WHERE id = ?1",
        [owner],
    )
    .unwrap();
    let ops: Vec<_> = (0..3)
        .map(|i| copier_op(&format!("i{i}"), &format!("op-{i}")))
        .collect();
    let rows = queries::insert_operations(&conn, owner, &ops, UnixMs(1)).unwrap();
    let mut updates = queries::OperationUpdates::new(&conn);
    let mut states = Vec::new();
    for (i, &row) in rows.iter().enumerate() {
        let old = crate::phase::OperationState {
            created_ms: 1,
            ..Default::default()
        };
        let new = crate::phase::OperationState {
            phase: OperationPhase::InProgress,
            n_completed: 10 + i as i64,
            description: "copying".into(),
            ..old.clone()
        };
        assert!(updates.write(row, &old, &new, &Rate::default()).unwrap());
        states.push(new);
    }
    drop(updates);
    for damage in ["substr(state, 1, 5)", "'text'", "x''"] {
        conn.execute(
            &format!("UPDATE operation_state SET state = {damage} WHERE op = ?1"),
            [rows[1]],
        )
        .unwrap();
        let which = queries::Targets::WaitingPage {
            plugin: "example.io/copier",
            after: 0,
            limit: 10,
        };
        let page = queries::poll_targets(&conn, which).unwrap();
        let found: Vec<i64> = page.iter().map(|t| t.state.n_completed).collect();
        assert_eq!(found, [10, 0, 12], "{damage}");
        assert_eq!(page[1].state.phase, OperationPhase::InProgress);
        let listed = queries::operations(&conn, owner, None).unwrap();
        assert_eq!(listed.len(), 3, "{damage}");
        assert!(
            listed[1]
                .error
                .as_ref()
                .is_some_and(|e| e.starts_with("the agent cannot read what it stored")),
            "{damage}: {:?}",
            listed[1].error
        );
        assert_eq!((listed[0].n_completed, listed[2].n_completed), (10, 12));
        let progress = queries::owner_progress(&conn, owner).unwrap();
        assert_eq!(progress.units.iter().map(|u| u.operations).sum::<u64>(), 2);
        // The next poll's write repairs it.
        let damaged = &page[1];
        let mut repaired = states[1].clone();
        repaired.n_completed = 99;
        let mut updates = queries::OperationUpdates::new(&conn);
        assert!(updates
            .write(damaged.row, &damaged.state, &repaired, &Rate::default())
            .unwrap());
        drop(updates);
        assert_eq!(packed_states(&conn)[1].2.n_completed, 99, "{damage}");
    }
    conn.execute(
        "UPDATE operation_state SET state = 'text' WHERE op = ?1",
        [rows[2]],
    )
    .unwrap();
    let canceled =
        queries::cancel_operations(&conn, owner, &[rows[2]], "canceled: test", UnixMs(7)).unwrap();
    assert_eq!(canceled, [rows[2]]);
    let after = packed_states(&conn);
    assert_eq!(after[2].2.error, "canceled: test");
    assert_eq!((after[0].2.n_completed, after[1].2.n_completed), (10, 99));
}

/// A sweep's page holds the operations of waiting owners only, `limit` of them: the
/// rows of an owner still InProgress, in between, neither fill it nor end the sweep.
#[test]
fn a_sweep_page_holds_limit_operations_of_waiting_owners_only() {
    let (_dir, db) = temp_db();
    drop(Store::open(&db, |_, _| {}).unwrap());
    let conn = Connection::open(&db).unwrap();
    let running = queries::insert_owner(
        &conn,
        &backup("running", GoDuration::from_secs(60)),
        UnixMs(1),
    )
    .unwrap();
    let waiting = queries::insert_owner(
        &conn,
        &backup("waiting", GoDuration::from_secs(60)),
        UnixMs(1),
    )
    .unwrap();
    conn.execute(
        "UPDATE owners SET phase = 'WaitingForPluginOperations' WHERE id = ?1",
        [waiting],
    )
    .unwrap();
    // Rows alternate between the owners: r0 w1 r2 w3 r4 w5 r6 w7.
    let mut rows = Vec::new();
    for i in 0..8 {
        let owner = if i % 2 == 0 { running } else { waiting };
        let op = copier_op(&format!("item-{i}"), &format!("op-{i}"));
        rows.extend(queries::insert_operations(&conn, owner, &[op], UnixMs(1)).unwrap());
    }
    let page = |after: i64| {
        let which = queries::Targets::WaitingPage {
            plugin: "example.io/copier",
            after,
            limit: 3,
        };
        queries::poll_targets(&conn, which).unwrap()
    };
    let ids = |page: &[queries::PollTarget]| -> Vec<String> {
        page.iter().map(|t| t.operation_id.clone()).collect()
    };
    let first = page(0);
    assert_eq!(ids(&first), ["op-1", "op-3", "op-5"]);
    assert!(std::sync::Arc::ptr_eq(&first[0].plugin, &first[2].plugin));
    let second = page(first[2].row);
    assert_eq!(ids(&second), ["op-7"]);
    assert!(page(rows[7]).is_empty());
}

/// Reads beyond [`super::MAX_READERS`] wait for a place: a burst of calls cannot open a
/// connection (and its page cache, and a blocking thread) each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_beyond_the_bound_wait_for_a_place() {
    use std::sync::Condvar;

    /// Reads running now, and whether the held ones may finish. Opens when dropped, so
    /// a failed assertion does not leave reads blocking the runtime's shutdown.
    #[derive(Default)]
    struct Gate {
        state: Mutex<(usize, bool)>,
        changed: Condvar,
    }
    impl Gate {
        fn open(&self) {
            self.state.lock().unwrap_or_else(|p| p.into_inner()).1 = true;
            self.changed.notify_all();
        }
    }
    struct OpenOnDrop(Arc<Gate>);
    impl Drop for OpenOnDrop {
        fn drop(&mut self) {
            self.0.open();
        }
    }
    let (_dir, db) = temp_db();
    let store = Arc::new(Store::open(&db, |_, _| {}).unwrap());
    let gate = Arc::new(Gate::default());
    let _opens = OpenOnDrop(gate.clone());
    let mut held = Vec::new();
    for _ in 0..super::MAX_READERS {
        let (store, gate) = (store.clone(), gate.clone());
        held.push(tokio::spawn(async move {
            store
                .read(move |_| {
                    let mut state = gate.state.lock().unwrap();
                    state.0 += 1;
                    gate.changed.notify_all();
                    while !state.1 {
                        state = gate.changed.wait(state).unwrap();
                    }
                    state.0 -= 1;
                    Ok::<_, StorageFailure>(())
                })
                .await
        }));
    }
    {
        let state = gate.state.lock().unwrap();
        let state = gate
            .changed
            .wait_while(state, |s| s.0 < super::MAX_READERS)
            .unwrap();
        assert_eq!(state.0, super::MAX_READERS);
    }
    assert_eq!(
        store.read_slots.available_permits(),
        0,
        "the held reads took every place"
    );
    // One more read starts only once a held one has finished.
    let more = {
        let (store, gate) = (store.clone(), gate.clone());
        tokio::spawn(async move {
            store
                .read(move |_| Ok::<_, StorageFailure>(gate.state.lock().unwrap().0))
                .await
        })
    };
    gate.open();
    let running_beside = more.await.unwrap().unwrap();
    assert!(
        running_beside < super::MAX_READERS,
        "a read ran beside {running_beside} held ones"
    );
    for read in held {
        read.await.unwrap().unwrap();
    }
    let pooled = store.readers.lock().unwrap().len();
    assert!(
        (1..=super::MAX_READERS).contains(&pooled),
        "{pooled} read connections kept"
    );
}

/// How many times the statements `conn` holds prepared were prepared again, and how many
/// it holds.
fn reprepares(conn: &Connection) -> (i64, usize) {
    use rusqlite::ffi;
    let (mut total, mut statements) = (0, 0);
    // SAFETY: the handle is the live connection's, used on this thread only while `conn`
    // is borrowed; sqlite3_next_stmt walks the statements it owns (rusqlite's cache keeps
    // them alive), and sqlite3_stmt_status only reads a counter of each.
    unsafe {
        let db = conn.handle();
        let mut stmt = ffi::sqlite3_next_stmt(db, std::ptr::null_mut());
        while !stmt.is_null() {
            total += i64::from(ffi::sqlite3_stmt_status(
                stmt,
                ffi::SQLITE_STMTSTATUS_REPREPARE,
                0,
            ));
            statements += 1;
            stmt = ffi::sqlite3_next_stmt(db, stmt);
        }
    }
    (total, statements)
}

/// The writer's statements are prepared once: with STAT4 in the bundled SQLite, a cached
/// statement whose plan looked at a bound value (`events WHERE owner_id = ?1`, a guard
/// `phase = ?2` next to a partial index) was parsed and planned again whenever the value
/// changed, on every write of another owner (a fifth of the writer's time under 64
/// concurrent registering clients).
#[test]
fn cached_statements_are_not_prepared_again_for_new_values() {
    use super::events::{self, NewEvent};
    use crate::phase::OperationState;
    use opmon_client::{EventReason, OperationPhase};

    let (_dir, db) = temp_db();
    drop(Store::open(&db, |_, _| {}).unwrap());
    let conn = Connection::open(&db).unwrap();
    super::configure(&conn).unwrap();
    let timeout = GoDuration::from_millis(60_000);
    let owners: Vec<i64> = (0..4)
        .map(|i| {
            queries::insert_owner(&conn, &backup(&format!("b{i}"), timeout), UnixMs(1)).unwrap()
        })
        .collect();
    let state = |phase| OperationState {
        phase,
        ..OperationState::default()
    };
    // As 64 clients on 64 backups and then a sweep do: each write names another owner.
    for round in 0..5 {
        for (n, &owner) in owners.iter().enumerate() {
            let op = copier_op(&format!("item-{round}-{n}"), &format!("op-{round}-{n}"));
            let rows = queries::insert_operations(&conn, owner, &[op], UnixMs(2)).unwrap();
            queries::touch_owner(&conn, owner, UnixMs(2)).unwrap();
            queries::owner_by_name(&conn, OwnerKind::Backup, &format!("b{n}")).unwrap();
            events::record(
                &conn,
                owner,
                &NewEvent {
                    reason: EventReason::OperationsAdded,
                    operation: rows.first().copied(),
                    caller: None,
                    message: "added",
                },
                UnixMs(2),
            )
            .unwrap();
            let mut updates = queries::OperationUpdates::new(&conn);
            let (old, new) = match (round + n) % 3 {
                0 => (OperationPhase::New, OperationPhase::InProgress),
                1 => (OperationPhase::New, OperationPhase::New),
                _ => (OperationPhase::New, OperationPhase::Completed),
            };
            let mut progressed = state(new);
            progressed.error = format!("e{n}");
            assert!(updates
                .write(rows[0], &state(old), &progressed, &Rate::default())
                .unwrap());
        }
    }
    let (again, statements) = reprepares(&conn);
    assert!(statements >= 6, "only {statements} statements held");
    assert_eq!(again, 0, "{again} re-prepares over {statements} statements");
}
