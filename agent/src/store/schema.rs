//! The database schema and its forward migrations.
//!
//! `PRAGMA user_version` is the number of migrations applied. Opening a database runs
//! the missing ones in order inside one transaction, so a crash mid-upgrade leaves the
//! old version intact. A database newer than this agent is refused rather than guessed
//! at. Migrations are append-only: a released step is never edited.

use rusqlite::Connection;

/// Each entry moves the schema from version `index` to `index + 1`.
pub const MIGRATIONS: &[&str] = &[
    // 1: owners and their operations.
    "CREATE TABLE owners (
        id INTEGER PRIMARY KEY,
        kind TEXT NOT NULL CHECK (kind IN ('backup', 'restore')),
        name TEXT NOT NULL,
        uid TEXT NOT NULL,
        phase TEXT NOT NULL,
        item_operation_timeout_ms INTEGER NOT NULL,
        errors INTEGER NOT NULL DEFAULT 0,
        warnings INTEGER NOT NULL DEFAULT 0,
        post_operation_items TEXT,
        created_ms INTEGER NOT NULL,
        updated_ms INTEGER NOT NULL,
        completed_ms INTEGER,
        UNIQUE (kind, name)
    );
    CREATE INDEX owners_by_phase ON owners (phase);
    CREATE TABLE operations (
        id INTEGER PRIMARY KEY,
        owner_id INTEGER NOT NULL REFERENCES owners (id) ON DELETE CASCADE,
        plugin_kind TEXT NOT NULL,
        plugin_name TEXT NOT NULL,
        res_group TEXT NOT NULL,
        res_resource TEXT NOT NULL,
        res_namespace TEXT NOT NULL,
        res_name TEXT NOT NULL,
        operation_id TEXT NOT NULL,
        post_operation_items TEXT NOT NULL DEFAULT '[]',
        phase TEXT NOT NULL DEFAULT 'New',
        error TEXT NOT NULL DEFAULT '',
        n_completed INTEGER NOT NULL DEFAULT 0,
        n_total INTEGER NOT NULL DEFAULT 0,
        operation_units TEXT NOT NULL DEFAULT '',
        description TEXT NOT NULL DEFAULT '',
        created_ms INTEGER NOT NULL,
        started_ms INTEGER,
        updated_ms INTEGER,
        UNIQUE (owner_id, plugin_kind, plugin_name, operation_id)
    );
    CREATE INDEX operations_by_owner_phase ON operations (owner_id, phase);",
    // 2: registered snapshotters survive restarts.
    "CREATE TABLE snapshotters (
        name TEXT PRIMARY KEY,
        api_version TEXT NOT NULL CHECK (api_version IN ('v1', 'v2')),
        socket TEXT,
        command TEXT
    );",
    // 3: restores may opt into the Finalizing phases; backups always pass through them.
    "ALTER TABLE owners ADD COLUMN finalize INTEGER NOT NULL DEFAULT 0;
    UPDATE owners SET finalize = 1 WHERE kind = 'backup';",
    // 4: the result of finalize, returned again when finalize is repeated.
    "ALTER TABLE owners ADD COLUMN finalize_result TEXT;",
    // 5: the sweep pages through each snapshotter's unfinished operations.
    "CREATE INDEX operations_unfinished_by_plugin ON operations (plugin_name, id)
        WHERE phase IN ('New', 'InProgress');",
    // 6: each owner counts its operations by phase, so reading an owner scans none of
    // them; a trigger counts phase changes in the transaction that makes them.
    "ALTER TABLE owners ADD COLUMN n_operations INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE owners ADD COLUMN n_completed INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE owners ADD COLUMN n_failed INTEGER NOT NULL DEFAULT 0;
    UPDATE owners SET
        n_operations = (SELECT COUNT(*) FROM operations WHERE owner_id = owners.id),
        n_completed = (SELECT COUNT(*) FROM operations
            WHERE owner_id = owners.id AND phase = 'Completed'),
        n_failed = (SELECT COUNT(*) FROM operations
            WHERE owner_id = owners.id AND phase = 'Failed');
    CREATE TRIGGER operations_counted_on_phase AFTER UPDATE OF phase ON operations
        WHEN OLD.phase != NEW.phase
    BEGIN
        UPDATE owners SET
            n_completed = n_completed + (NEW.phase = 'Completed') - (OLD.phase = 'Completed'),
            n_failed = n_failed + (NEW.phase = 'Failed') - (OLD.phase = 'Failed')
        WHERE id = NEW.owner_id;
    END;",
    // 7: owners know the server (and run) that started them, why they failed and when
    // the server last called; result-file work (`records_due`, `removals`) is recorded
    // in the transaction that makes it due, so a crash loses none of it.
    "ALTER TABLE owners ADD COLUMN server_name TEXT NOT NULL DEFAULT '';
    ALTER TABLE owners ADD COLUMN server_instance TEXT;
    ALTER TABLE owners ADD COLUMN failure_reason TEXT NOT NULL DEFAULT '';
    ALTER TABLE owners ADD COLUMN last_call_ms INTEGER NOT NULL DEFAULT 0;
    UPDATE owners SET last_call_ms = updated_ms;
    CREATE INDEX owners_by_completion ON owners (completed_ms) WHERE completed_ms IS NOT NULL;
    CREATE TABLE records_due (
        owner_id INTEGER PRIMARY KEY REFERENCES owners (id) ON DELETE CASCADE,
        generation INTEGER NOT NULL DEFAULT 1
    );
    CREATE TABLE removals (
        id INTEGER PRIMARY KEY,
        kind TEXT NOT NULL CHECK (kind IN ('backup', 'restore')),
        name TEXT NOT NULL
    );",
    // 8: an operation is known by its item too, as in Velero: the table is rebuilt (ids
    // kept) since SQLite cannot change a UNIQUE constraint, with its indexes and
    // trigger made again. Also the plugin's own `updated`, and each owner's `object`.
    "ALTER TABLE owners ADD COLUMN object TEXT;
    CREATE TABLE operations_v8 (
        id INTEGER PRIMARY KEY,
        owner_id INTEGER NOT NULL REFERENCES owners (id) ON DELETE CASCADE,
        plugin_kind TEXT NOT NULL,
        plugin_name TEXT NOT NULL,
        res_group TEXT NOT NULL,
        res_resource TEXT NOT NULL,
        res_namespace TEXT NOT NULL,
        res_name TEXT NOT NULL,
        operation_id TEXT NOT NULL,
        post_operation_items TEXT NOT NULL DEFAULT '[]',
        phase TEXT NOT NULL DEFAULT 'New',
        error TEXT NOT NULL DEFAULT '',
        n_completed INTEGER NOT NULL DEFAULT 0,
        n_total INTEGER NOT NULL DEFAULT 0,
        operation_units TEXT NOT NULL DEFAULT '',
        description TEXT NOT NULL DEFAULT '',
        created_ms INTEGER NOT NULL,
        started_ms INTEGER,
        updated_ms INTEGER,
        plugin_updated_ms INTEGER,
        UNIQUE (owner_id, plugin_kind, plugin_name, operation_id, res_group, res_resource,
            res_namespace, res_name)
    );
    INSERT INTO operations_v8 (id, owner_id, plugin_kind, plugin_name, res_group,
        res_resource, res_namespace, res_name, operation_id, post_operation_items, phase,
        error, n_completed, n_total, operation_units, description, created_ms, started_ms,
        updated_ms, plugin_updated_ms)
    SELECT id, owner_id, plugin_kind, plugin_name, res_group, res_resource, res_namespace,
        res_name, operation_id, post_operation_items, phase, error, n_completed, n_total,
        operation_units, description, created_ms, started_ms, updated_ms, updated_ms
    FROM operations;
    DROP TABLE operations;
    ALTER TABLE operations_v8 RENAME TO operations;
    CREATE INDEX operations_by_owner_phase ON operations (owner_id, phase);
    CREATE INDEX operations_unfinished_by_plugin ON operations (plugin_name, id)
        WHERE phase IN ('New', 'InProgress');
    CREATE TRIGGER operations_counted_on_phase AFTER UPDATE OF phase ON operations
        WHEN OLD.phase != NEW.phase
    BEGIN
        UPDATE owners SET
            n_completed = n_completed + (NEW.phase = 'Completed') - (OLD.phase = 'Completed'),
            n_failed = n_failed + (NEW.phase = 'Failed') - (OLD.phase = 'Failed')
        WHERE id = NEW.owner_id;
    END;",
    // 9: control over operations (issue 16): Canceled (counted as failed, as Velero
    // counts it), the stall deadline's last progress, transient errors and retries;
    // owners' and snapshotters' deadlines and retry budgets (NULL: unset).
    "ALTER TABLE operations ADD COLUMN cancel_requested INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE operations ADD COLUMN progressed_ms INTEGER;
    ALTER TABLE operations ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE operations ADD COLUMN last_error TEXT NOT NULL DEFAULT '';
    ALTER TABLE operations ADD COLUMN next_attempt_ms INTEGER;
    ALTER TABLE operations ADD COLUMN retrying_since_ms INTEGER;
    UPDATE operations SET progressed_ms = updated_ms;
    ALTER TABLE owners ADD COLUMN stall_timeout_ms INTEGER;
    ALTER TABLE owners ADD COLUMN start_timeout_ms INTEGER;
    ALTER TABLE snapshotters ADD COLUMN stall_timeout_ms INTEGER;
    ALTER TABLE snapshotters ADD COLUMN start_timeout_ms INTEGER;
    ALTER TABLE snapshotters ADD COLUMN retry_attempts INTEGER;
    ALTER TABLE snapshotters ADD COLUMN retry_backoff_ms INTEGER;
    ALTER TABLE snapshotters ADD COLUMN retry_within_ms INTEGER;
    CREATE INDEX operations_cancel_requested ON operations (id) WHERE cancel_requested = 1;
    DROP TRIGGER operations_counted_on_phase;
    CREATE TRIGGER operations_counted_on_phase AFTER UPDATE OF phase ON operations
        WHEN OLD.phase != NEW.phase
    BEGIN
        UPDATE owners SET
            n_completed = n_completed + (NEW.phase = 'Completed') - (OLD.phase = 'Completed'),
            n_failed = n_failed + (NEW.phase IN ('Failed', 'Canceled'))
                - (OLD.phase IN ('Failed', 'Canceled'))
        WHERE id = NEW.owner_id;
    END;",
    // 10: each owner's history (`seq` numbers it per owner and pages it), and each
    // operation's smoothed rate, so a restart keeps it.
    "CREATE TABLE events (
        owner_id INTEGER NOT NULL REFERENCES owners (id) ON DELETE CASCADE,
        seq INTEGER NOT NULL,
        at_ms INTEGER NOT NULL,
        reason TEXT NOT NULL,
        operation_row INTEGER,
        caller_uid INTEGER,
        caller_pid INTEGER,
        message TEXT NOT NULL,
        PRIMARY KEY (owner_id, seq)
    ) WITHOUT ROWID;
    ALTER TABLE operations ADD COLUMN rate REAL;
    ALTER TABLE operations ADD COLUMN rate_n INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE operations ADD COLUMN rate_at_ms INTEGER;
    ALTER TABLE operations ADD COLUMN rate_seen_ms INTEGER;",
    // 11: an operation's progress in a narrow table of its own (issue 17.2), since a
    // sweep writes it for every operation; inserted by `insert_operations` (a trigger
    // would make every INSERT keep a statement journal), its phase copied by a trigger
    // so a write guards on it without reading the wide row.
    "CREATE TABLE operation_progress (
        op INTEGER PRIMARY KEY REFERENCES operations (id) ON DELETE CASCADE,
        phase TEXT NOT NULL,
        n_completed INTEGER NOT NULL DEFAULT 0,
        n_total INTEGER NOT NULL DEFAULT 0,
        description TEXT NOT NULL DEFAULT '',
        updated_ms INTEGER,
        plugin_updated_ms INTEGER,
        progressed_ms INTEGER,
        rate REAL,
        rate_n INTEGER NOT NULL DEFAULT 0,
        rate_at_ms INTEGER,
        rate_seen_ms INTEGER
    );
    INSERT INTO operation_progress (op, phase, n_completed, n_total, description, updated_ms,
        plugin_updated_ms, progressed_ms, rate, rate_n, rate_at_ms, rate_seen_ms)
    SELECT id, phase, n_completed, n_total, description, updated_ms, plugin_updated_ms,
        progressed_ms, rate, rate_n, rate_at_ms, rate_seen_ms
    FROM operations;
    ALTER TABLE operations DROP COLUMN n_completed;
    ALTER TABLE operations DROP COLUMN n_total;
    ALTER TABLE operations DROP COLUMN description;
    ALTER TABLE operations DROP COLUMN updated_ms;
    ALTER TABLE operations DROP COLUMN plugin_updated_ms;
    ALTER TABLE operations DROP COLUMN progressed_ms;
    ALTER TABLE operations DROP COLUMN rate;
    ALTER TABLE operations DROP COLUMN rate_n;
    ALTER TABLE operations DROP COLUMN rate_at_ms;
    ALTER TABLE operations DROP COLUMN rate_seen_ms;
    CREATE TRIGGER operation_progress_phase AFTER UPDATE OF phase ON operations
        WHEN OLD.phase != NEW.phase
    BEGIN
        UPDATE operation_progress SET phase = NEW.phase WHERE op = NEW.id;
    END;",
    // 12: an operation's mutable state packed into one column (`store::packed`), which
    // costs a sweep one column instead of 17. SQL cannot pack: `pack_states` fills the
    // table and drops the old columns (`PACKED_COLUMNS_DROPPED`).
    "CREATE TABLE operation_state (
        op INTEGER PRIMARY KEY REFERENCES operations (id) ON DELETE CASCADE,
        phase TEXT NOT NULL,
        state BLOB NOT NULL
    );",
    // 13: every packed state rewritten in layout 2 (`repack_states`); the version stops
    // an agent of schema 12, which reads only layout 1.
    "",
    // 14: events stored in the order they are recorded (issue 17.3), so a group commit
    // of many owners' events writes the table's last page, not one page per owner.
    // Events of an owner that is gone could not be listed and are not kept.
    "CREATE TABLE events_v14 (
        id INTEGER PRIMARY KEY,
        owner_id INTEGER NOT NULL REFERENCES owners (id) ON DELETE CASCADE,
        seq INTEGER NOT NULL,
        at_ms INTEGER NOT NULL,
        reason TEXT NOT NULL,
        operation_row INTEGER,
        caller_uid INTEGER,
        caller_pid INTEGER,
        message TEXT NOT NULL
    );
    INSERT INTO events_v14 (owner_id, seq, at_ms, reason, operation_row, caller_uid,
        caller_pid, message)
    SELECT owner_id, seq, at_ms, reason, operation_row, caller_uid, caller_pid, message
    FROM events WHERE owner_id IN (SELECT id FROM owners) ORDER BY at_ms, owner_id, seq;
    DROP TABLE events;
    ALTER TABLE events_v14 RENAME TO events;
    CREATE UNIQUE INDEX events_by_owner ON events (owner_id, seq);",
    // 15: Velero plugin snapshotters: `{"path", "args", "env"}` as JSON.
    "ALTER TABLE snapshotters ADD COLUMN velero_plugin TEXT;",
    // 16: an owner is its name and uid, as in Velero (issue 47): a name is unique among
    // owners not retired (`retired_ms`). The table is rebuilt to drop UNIQUE (kind,
    // name), with foreign keys off (`migrate_to`), its indexes and trigger made again.
    "DROP TRIGGER operations_counted_on_phase;
    CREATE TABLE owners_v16 (
        id INTEGER PRIMARY KEY,
        kind TEXT NOT NULL CHECK (kind IN ('backup', 'restore')),
        name TEXT NOT NULL,
        uid TEXT NOT NULL,
        phase TEXT NOT NULL,
        item_operation_timeout_ms INTEGER NOT NULL,
        errors INTEGER NOT NULL DEFAULT 0,
        warnings INTEGER NOT NULL DEFAULT 0,
        post_operation_items TEXT,
        created_ms INTEGER NOT NULL,
        updated_ms INTEGER NOT NULL,
        completed_ms INTEGER,
        finalize INTEGER NOT NULL DEFAULT 0,
        finalize_result TEXT,
        n_operations INTEGER NOT NULL DEFAULT 0,
        n_completed INTEGER NOT NULL DEFAULT 0,
        n_failed INTEGER NOT NULL DEFAULT 0,
        server_name TEXT NOT NULL DEFAULT '',
        server_instance TEXT,
        failure_reason TEXT NOT NULL DEFAULT '',
        last_call_ms INTEGER NOT NULL DEFAULT 0,
        object TEXT,
        stall_timeout_ms INTEGER,
        start_timeout_ms INTEGER,
        retired_ms INTEGER
    );
    INSERT INTO owners_v16 (id, kind, name, uid, phase, item_operation_timeout_ms, errors, warnings,
        post_operation_items, created_ms, updated_ms, completed_ms, finalize, finalize_result,
        n_operations, n_completed, n_failed, server_name, server_instance, failure_reason,
        last_call_ms, object, stall_timeout_ms, start_timeout_ms)
    SELECT id, kind, name, uid, phase, item_operation_timeout_ms, errors, warnings,
        post_operation_items, created_ms, updated_ms, completed_ms, finalize, finalize_result,
        n_operations, n_completed, n_failed, server_name, server_instance, failure_reason,
        last_call_ms, object, stall_timeout_ms, start_timeout_ms
    FROM owners;
    DROP TABLE owners;
    ALTER TABLE owners_v16 RENAME TO owners;
    CREATE INDEX owners_by_phase ON owners (phase);
    CREATE INDEX owners_by_completion ON owners (completed_ms) WHERE completed_ms IS NOT NULL;
    CREATE UNIQUE INDEX owners_current ON owners (kind, name) WHERE retired_ms IS NULL;
    CREATE INDEX owners_by_uid ON owners (kind, uid);
    CREATE TRIGGER operations_counted_on_phase AFTER UPDATE OF phase ON operations
        WHEN OLD.phase != NEW.phase
    BEGIN
        UPDATE owners SET
            n_completed = n_completed + (NEW.phase = 'Completed') - (OLD.phase = 'Completed'),
            n_failed = n_failed + (NEW.phase IN ('Failed', 'Canceled'))
                - (OLD.phase IN ('Failed', 'Canceled'))
        WHERE id = NEW.owner_id;
    END;",
];

/// What runs after a migration's SQL, by the version it reaches: what SQL cannot do.
fn after_sql(to: u32) -> Option<fn(&Connection) -> rusqlite::Result<()>> {
    match to {
        12 => Some(pack_states),
        13 => Some(repack_states),
        _ => None,
    }
}

/// The end of migration 12, once the states are packed.
const PACKED_COLUMNS_DROPPED: &str = "DROP TRIGGER operation_progress_phase;
    DROP TABLE operation_progress;
    ALTER TABLE operations DROP COLUMN error;
    ALTER TABLE operations DROP COLUMN operation_units;
    ALTER TABLE operations DROP COLUMN started_ms;
    ALTER TABLE operations DROP COLUMN attempts;
    ALTER TABLE operations DROP COLUMN last_error;
    ALTER TABLE operations DROP COLUMN next_attempt_ms;
    ALTER TABLE operations DROP COLUMN retrying_since_ms;
    CREATE TRIGGER operation_state_phase AFTER UPDATE OF phase ON operations
        WHEN OLD.phase != NEW.phase
    BEGIN
        UPDATE operation_state SET phase = NEW.phase WHERE op = NEW.id;
    END;";

/// Migration 12: each operation's state, read from the columns of migrations 1 to 11,
/// packed into `operation_state`; then the old columns go.
fn pack_states(conn: &Connection) -> rusqlite::Result<()> {
    use super::packed;
    use crate::phase::OperationState;
    use crate::rate::Rate;
    // Every operation gets its state, with nothing reported if it had no progress row
    // (an agent of version 11 always made one; a row lost some other way costs its
    // progress, not its operation).
    let mut read = conn.prepare(
        "SELECT o.id, o.phase, o.error, COALESCE(p.n_completed, 0), COALESCE(p.n_total, 0), \
         o.operation_units, COALESCE(p.description, ''), o.started_ms, p.updated_ms, \
         p.plugin_updated_ms, p.progressed_ms, o.attempts, o.last_error, o.next_attempt_ms, \
         o.retrying_since_ms, p.rate, COALESCE(p.rate_n, 0), p.rate_at_ms, p.rate_seen_ms \
         FROM operations o LEFT JOIN operation_progress p ON p.op = o.id",
    )?;
    let mut write =
        conn.prepare("INSERT INTO operation_state (op, phase, state) VALUES (?1, ?2, ?3)")?;
    // A text that is not UTF-8 (written by hand: the agent writes none) is kept with
    // U+FFFD for what is not, rather than stopping the migration and so the agent.
    let text = |r: &rusqlite::Row<'_>, i: usize| -> rusqlite::Result<String> {
        Ok(match r.get_ref(i)? {
            rusqlite::types::ValueRef::Text(t) | rusqlite::types::ValueRef::Blob(t) => {
                String::from_utf8_lossy(t).into_owned()
            }
            _ => String::new(),
        })
    };
    let mut rows = read.query([])?;
    while let Some(r) = rows.next()? {
        let state = OperationState {
            error: text(r, 2)?,
            n_completed: r.get(3)?,
            n_total: r.get(4)?,
            operation_units: text(r, 5)?,
            description: text(r, 6)?,
            started_ms: r.get(7)?,
            updated_ms: r.get(8)?,
            plugin_updated_ms: r.get(9)?,
            progressed_ms: r.get(10)?,
            attempts: r.get::<_, i64>(11)?.clamp(0, i64::from(u32::MAX)) as u32,
            last_error: text(r, 12)?,
            next_attempt_ms: r.get(13)?,
            retrying_since_ms: r.get(14)?,
            ..OperationState::default()
        };
        let rate = Rate {
            per_second: r.get(15)?,
            anchor_n: r.get(16)?,
            anchor_ms: r.get(17)?,
            seen_ms: r.get(18)?,
        };
        let phase: String = r.get(1)?;
        write.execute(rusqlite::params![
            r.get::<_, i64>(0)?,
            phase,
            packed::pack(&state, &rate)?
        ])?;
    }
    drop(rows);
    conn.execute_batch(PACKED_COLUMNS_DROPPED)
}

/// Migration 13: each state that decodes written again, now in the current layout. One
/// that does not (damaged outside the agent) is left as it is: it is read as a new
/// operation's, and a poll writes it afresh.
fn repack_states(conn: &Connection) -> rusqlite::Result<()> {
    use super::packed;
    let mut read = conn.prepare("SELECT op, state FROM operation_state")?;
    let mut write = conn.prepare("UPDATE operation_state SET state = ?2 WHERE op = ?1")?;
    let mut rows = read.query([])?;
    let mut bytes = Vec::new();
    while let Some(r) = rows.next()? {
        let mut state = crate::phase::OperationState::default();
        if let Ok(rate) = packed::read_column(r, 1, &mut state) {
            packed::pack_into(&mut bytes, &state, &rate)?;
            write.execute(rusqlite::params![r.get::<_, i64>(0)?, bytes])?;
        }
    }
    Ok(())
}

/// The schema version this agent writes.
pub const CURRENT_VERSION: u32 = MIGRATIONS.len() as u32;

/// Why the schema could not be brought to [`CURRENT_VERSION`].
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("schema version {found} is newer than this agent supports ({supported}); use a newer opmon-agent")]
    TooNew { found: u32, supported: u32 },
    #[error("migrating the schema to version {to}: {source}")]
    Sql { to: u32, source: rusqlite::Error },
}

/// Applies the migrations `conn` lacks, all in one transaction.
pub fn migrate(conn: &mut Connection) -> Result<u32, MigrateError> {
    migrate_to(conn, CURRENT_VERSION)
}

/// Applies migrations up to `target` (tests build older databases with it).
pub fn migrate_to(conn: &mut Connection, target: u32) -> Result<u32, MigrateError> {
    let sql_err = |to| move |source| MigrateError::Sql { to, source };
    let found: u32 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(sql_err(0))?;
    if found > CURRENT_VERSION {
        return Err(MigrateError::TooNew {
            found,
            supported: CURRENT_VERSION,
        });
    }
    if found >= target {
        return Ok(found);
    }
    let began = std::time::Instant::now();
    // A migration that rebuilds a table (16) drops the old one: with foreign keys on,
    // that would delete every row referring to it. SQLite's own procedure for it: keys
    // off (outside the transaction, where the setting takes), back as they were after.
    let keys: bool = conn
        .query_row("PRAGMA foreign_keys", [], |r| r.get(0))
        .map_err(sql_err(found + 1))?;
    conn.pragma_update(None, "foreign_keys", false)
        .map_err(sql_err(found + 1))?;
    let migrated = apply(conn, found, target);
    conn.pragma_update(None, "foreign_keys", keys)
        .map_err(sql_err(target))?;
    migrated?;
    if found > 0 {
        // An upgrade: say so, and what it took (migration 12 packs every operation).
        tracing::info!(from = found, to = target, took = ?began.elapsed(),
            "database schema upgraded");
    }
    Ok(target)
}

/// Migrations `found + 1` to `target`, in one transaction.
fn apply(conn: &mut Connection, found: u32, target: u32) -> Result<(), MigrateError> {
    let sql_err = |to| move |source| MigrateError::Sql { to, source };
    let tx = conn.transaction().map_err(sql_err(found + 1))?;
    for (index, step) in MIGRATIONS
        .iter()
        .enumerate()
        .take(target as usize)
        .skip(found as usize)
    {
        let to = index as u32 + 1;
        tx.execute_batch(step).map_err(sql_err(to))?;
        if let Some(code) = after_sql(to) {
            code(&tx).map_err(sql_err(to))?;
        }
        tx.pragma_update(None, "user_version", to)
            .map_err(sql_err(to))?;
    }
    tx.commit().map_err(sql_err(target))
}
