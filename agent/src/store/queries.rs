//! The SQL the agent runs, one function per question or change. Each takes a plain
//! `&Connection`, so the same function serves a read connection and a write job.
//! Times are stored as Unix milliseconds; JSON columns hold resource lists.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, LazyLock};

use opmon_client::{
    ApiVersion, GoDuration, NewOperation, Operation, OperationPhase, OwnerKind, OwnerPhase,
    OwnerProgress, OwnerRef, PluginKind, PluginRef, ResourceIdentifier, ServerRef, Snapshotter,
    UnitsProgress,
};
use rusqlite::{params, CachedStatement, Connection, OptionalExtension, Row};

use crate::clock::UnixMs;
use crate::phase::OperationState;
use crate::rate::Rate;
use crate::store::packed;

/// Why text column `index` does not hold what the agent writes.
fn not_text(
    index: usize,
    e: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> rusqlite::Error {
    rusqlite::Error::FromSqlConversionFailure(index, rusqlite::types::Type::Text, e.into())
}

pub(super) fn parse_column<T: std::str::FromStr<Err = String>>(
    row: &Row<'_>,
    index: usize,
) -> rusqlite::Result<T> {
    let text = row.get_ref(index)?.as_str()?;
    text.parse().map_err(|e: String| not_text(index, e))
}

fn json_column<T: serde::de::DeserializeOwned>(row: &Row<'_>, index: usize) -> rusqlite::Result<T> {
    let text = row.get_ref(index)?.as_str()?;
    serde_json::from_str(text).map_err(|e| not_text(index, e))
}

/// The item of four columns from `first` on (group, resource, namespace, name).
pub(super) fn resource_at(row: &Row<'_>, first: usize) -> rusqlite::Result<ResourceIdentifier> {
    Ok(ResourceIdentifier {
        group: row.get(first)?,
        resource: row.get(first + 1)?,
        namespace: row.get(first + 2)?,
        name: row.get(first + 3)?,
    })
}

/// A JSON column that may be NULL.
fn optional_json<T: serde::de::DeserializeOwned>(
    row: &Row<'_>,
    index: usize,
) -> rusqlite::Result<Option<T>> {
    match row.get_ref(index)? {
        rusqlite::types::ValueRef::Null => Ok(None),
        _ => json_column(row, index).map(Some),
    }
}

/// A time column that may be NULL.
fn optional_time(row: &Row<'_>, index: usize) -> rusqlite::Result<Option<opmon_client::Timestamp>> {
    row.get::<_, Option<UnixMs>>(index)?
        .map(|ms| stored_time(ms, index))
        .transpose()
}

fn to_json<T: serde::Serialize>(value: &T) -> String {
    // Serializing plain data structs to a string cannot fail.
    serde_json::to_string(value).unwrap_or_else(|_| "[]".into())
}

/// The phases of `all` that `keep` keeps, as an SQL list: written into a statement's
/// text, since a partial index serves a statement only if its text implies the
/// index's condition, which a bound parameter does not.
fn sql_list<T: Copy>(
    all: &[T],
    keep: impl Fn(T) -> bool,
    name: impl Fn(T) -> &'static str,
) -> String {
    let kept: Vec<T> = all.iter().copied().filter(|p| keep(*p)).collect();
    format!("({})", phase_list(&kept, name))
}

/// The unfinished operation phases, New and InProgress.
static UNFINISHED: LazyLock<String> = LazyLock::new(|| {
    sql_list(
        OperationPhase::ALL,
        OperationPhase::is_unfinished,
        OperationPhase::as_str,
    )
});
/// The Waiting* owner phases.
static WAITING: LazyLock<String> =
    LazyLock::new(|| sql_list(OwnerPhase::ALL, OwnerPhase::is_waiting, OwnerPhase::as_str));

/// How many operations are unfinished, from an owner's count columns (kept by
/// [`insert_operations`] and [`update_operation`]): the one place that sum is made.
fn unfinished(attempted: u64, completed: u64, failed: u64) -> u64 {
    attempted.saturating_sub(completed).saturating_sub(failed)
}

/// An owner with its row id.
#[derive(Clone, Debug)]
pub struct OwnerRow {
    pub id: i64,
    pub owner: opmon_client::Owner,
}

impl OwnerRow {
    /// How many of its operations were New or InProgress when the row was read.
    pub fn unfinished(&self) -> u64 {
        let o = &self.owner;
        unfinished(
            o.operations_attempted,
            o.operations_completed,
            o.operations_failed,
        )
    }
}

const OWNER_COLUMNS: &str = "id, kind, name, uid, phase, item_operation_timeout_ms, finalize, \
     errors, warnings, post_operation_items, created_ms, updated_ms, completed_ms, n_operations, \
     n_completed, n_failed, server_name, server_instance, failure_reason, stall_timeout_ms, \
     start_timeout_ms, retired_ms";

/// Reads the columns of one row, standing in a value for each that does not hold what
/// the agent writes and noting which and why: one damaged row (a corrupted page) must
/// not stop the answers about every other.
struct Columns<'r, 's> {
    row: &'r Row<'s>,
    damage: Vec<String>,
}

impl Columns<'_, '_> {
    fn take<T>(
        &mut self,
        index: usize,
        read: impl FnOnce(&Row<'_>, usize) -> rusqlite::Result<T>,
        stand_in: T,
    ) -> T {
        match read(self.row, index) {
            Ok(value) => value,
            Err(e) => {
                let column = OWNER_COLUMNS.split(", ").nth(index).unwrap_or("?");
                let reason = match e {
                    rusqlite::Error::FromSqlConversionFailure(_, _, inner) => inner.to_string(),
                    other => other.to_string(),
                };
                self.damage.push(format!("{column}: {reason}"));
                stand_in
            }
        }
    }

    fn time(&mut self, index: usize) -> opmon_client::Timestamp {
        self.take(
            index,
            |row, i| stored_time(row.get(i)?, i),
            UnixMs(0).time(),
        )
    }
}

/// A stored time as a timestamp, if it is one the API can write (RFC 3339: years 0
/// to 9999); the agent only stores times it read from its clock.
fn stored_time(ms: UnixMs, index: usize) -> rusqlite::Result<opmon_client::Timestamp> {
    let year = |ms: i64| {
        time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
            .map(|t| t.year())
            .ok()
    };
    match year(ms.ms()) {
        Some(0..=9999) => Ok(ms.time()),
        _ => Err(rusqlite::Error::FromSqlConversionFailure(
            index,
            rusqlite::types::Type::Integer,
            format!("{} is not a time", ms.ms()).into(),
        )),
    }
}

fn count(row: &Row<'_>, index: usize) -> rusqlite::Result<u64> {
    Ok(row.get::<_, i64>(index)?.max(0) as u64)
}

/// An owner from its row, and what of the row is damaged (empty if nothing is).
fn read_owner(row: &Row<'_>) -> rusqlite::Result<(OwnerRow, Vec<String>)> {
    let id = row.get(0)?;
    let mut c = Columns {
        row,
        damage: Vec::new(),
    };
    let post_operation_items = c.take(9, optional_json, None);
    let server = c.take(
        17,
        |row, i| {
            row.get::<_, Option<String>>(i)?
                .map(|instance| -> rusqlite::Result<ServerRef> {
                    Ok(ServerRef {
                        name: row.get(16)?,
                        instance,
                    })
                })
                .transpose()
        },
        None,
    );
    let owner = opmon_client::Owner {
        kind: c.take(1, parse_column, OwnerKind::Backup),
        name: c.take(2, |r, i| r.get(i), format!("#{id}")),
        uid: c.take(3, |r, i| r.get(i), String::new()),
        server,
        phase: c.take(4, parse_column, OwnerPhase::Failed),
        failure_reason: c
            .take(18, |r, i| r.get(i), None)
            .filter(|r: &String| !r.is_empty()),
        item_operation_timeout: GoDuration::from_millis(c.take(5, count, 0)),
        stall_timeout: c.take(19, optional_duration, None),
        start_timeout: c.take(20, optional_duration, None),
        finalize: c.take(6, |r, i| r.get(i), false),
        errors: c.take(7, |r, i| r.get(i), 0),
        warnings: c.take(8, |r, i| r.get(i), 0),
        operations_attempted: c.take(13, count, 0),
        operations_completed: c.take(14, count, 0),
        operations_failed: c.take(15, count, 0),
        post_operation_items,
        created: c.time(10),
        updated: c.time(11),
        completed: c.take(12, optional_time, None),
        retired: c.take(21, optional_time, None),
        progress: None,
    };
    Ok((OwnerRow { id, owner }, c.damage))
}

/// An owner from its row, or an error naming what of it is damaged: for the agent's
/// own decisions, which must not act on stand-in values.
fn owner_from_row(row: &Row<'_>) -> rusqlite::Result<OwnerRow> {
    let (owner, damage) = read_owner(row)?;
    if damage.is_empty() {
        return Ok(owner);
    }
    Err(rusqlite::Error::FromSqlConversionFailure(
        0,
        rusqlite::types::Type::Null,
        format!(
            "{} {} is damaged in the database ({})",
            owner.owner.kind,
            owner.owner.name,
            damage.join("; ")
        )
        .into(),
    ))
}

/// An owner from its row for a listing: a damaged one is listed with what is damaged
/// as its failure reason (and in the log), so the others are still served.
fn owner_or_damaged(row: &Row<'_>) -> rusqlite::Result<OwnerRow> {
    let (mut owner, damage) = read_owner(row)?;
    if !damage.is_empty() {
        let damage = damage.join("; ");
        tracing::error!(kind = %owner.owner.kind, name = %owner.owner.name, %damage,
            "an owner's row is damaged in the database");
        owner.owner.failure_reason = Some(format!("damaged in the database: {damage}"));
    }
    Ok(owner)
}

/// A duration column in milliseconds, NULL when unset.
fn optional_duration(row: &Row<'_>, index: usize) -> rusqlite::Result<Option<GoDuration>> {
    Ok(row
        .get::<_, Option<i64>>(index)?
        .map(|ms| GoDuration::from_millis(ms.max(0) as u64)))
}

fn optional_ms(d: Option<GoDuration>) -> Option<i64> {
    d.map(|d| crate::clock::millis(d.0))
}

/// The owner the rest of a statement (`WHERE …`) selects, if any.
fn one_owner(
    conn: &Connection,
    rest: &str,
    params: impl rusqlite::Params,
) -> rusqlite::Result<Option<OwnerRow>> {
    conn.prepare_cached(&format!("SELECT {OWNER_COLUMNS} FROM owners {rest}"))?
        .query_row(params, owner_from_row)
        .optional()
}

/// The current owner `kind`/`name` (not retired), with its counts.
pub fn owner_by_name(
    conn: &Connection,
    kind: OwnerKind,
    name: &str,
) -> rusqlite::Result<Option<OwnerRow>> {
    let rest = "WHERE kind = ?1 AND name = ?2 AND retired_ms IS NULL";
    one_owner(conn, rest, params![kind.as_str(), name])
}

/// The owner `kind`/`name` of uid `uid`, current or retired.
pub fn owner_by_uid(
    conn: &Connection,
    kind: OwnerKind,
    name: &str,
    uid: &str,
) -> rusqlite::Result<Option<OwnerRow>> {
    let rest = "WHERE kind = ?1 AND uid = ?3 AND name = ?2 \
         ORDER BY retired_ms IS NOT NULL, retired_ms DESC LIMIT 1";
    one_owner(conn, rest, params![kind.as_str(), name, uid])
}

/// Every owner that had the name `kind`/`name`: the current one first, then the
/// retired ones, latest retired first; at most `limit`.
pub fn owners_of_name(
    conn: &Connection,
    kind: OwnerKind,
    name: &str,
    limit: u32,
) -> rusqlite::Result<Vec<OwnerRow>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {OWNER_COLUMNS} FROM owners WHERE kind = ?1 AND name = ?2 \
         ORDER BY retired_ms IS NOT NULL, retired_ms DESC, id DESC LIMIT ?3"
    ))?;
    let rows = stmt.query_map(params![kind.as_str(), name, limit], owner_or_damaged)?;
    rows.collect()
}

/// Retires an ended owner: its name is free for a new owner, its history is kept. Its
/// item-operations file is no longer rewritten: the name's files are the new owner's
/// (`start` marks the new owner's due, so its first write replaces them).
pub fn retire_owner(conn: &Connection, id: i64, now: UnixMs) -> rusqlite::Result<()> {
    conn.prepare_cached("UPDATE owners SET retired_ms = ?2 WHERE id = ?1")?
        .execute(params![id, now])?;
    conn.prepare_cached("DELETE FROM records_due WHERE owner_id = ?1")?
        .execute([id])?;
    Ok(())
}

/// What a call that adds to an owner needs of it: its row, phase and operations so
/// far; `None` if there is no such owner. Three columns, not the whole owner
/// ([`owner_by_name`]): it is read on every `addOperations`.
pub fn owner_phase_by_name(
    conn: &Connection,
    kind: OwnerKind,
    name: &str,
) -> rusqlite::Result<Option<(i64, OwnerPhase, u64)>> {
    conn.prepare_cached(
        "SELECT id, phase, n_operations FROM owners WHERE kind = ?1 AND name = ?2 \
         AND retired_ms IS NULL",
    )?
    .query_row(params![kind.as_str(), name], |row| {
        Ok((
            row.get(0)?,
            parse_column(row, 1)?,
            row.get::<_, i64>(2)?.max(0) as u64,
        ))
    })
    .optional()
}

/// The owner with row id `id`, with its counts.
pub fn owner_by_id(conn: &Connection, id: i64) -> rusqlite::Result<Option<OwnerRow>> {
    one_owner(conn, "WHERE id = ?1", [id])
}

/// What a new owner is created with.
#[derive(Clone, Copy, Debug)]
pub struct NewOwner<'a> {
    pub kind: OwnerKind,
    pub name: &'a str,
    pub uid: &'a str,
    pub timeout: GoDuration,
    pub finalize: bool,
    pub server: Option<&'a ServerRef>,
    /// The backup server's representation of the owner, serialized.
    pub object: Option<&'a str>,
    /// The owner's own deadlines (`start {stallTimeout, startTimeout}`).
    pub stall_timeout: Option<GoDuration>,
    pub start_timeout: Option<GoDuration>,
}

/// Creates an owner in InProgress; returns its row id. Its creation is its first call.
pub fn insert_owner(conn: &Connection, o: &NewOwner<'_>, now: UnixMs) -> rusqlite::Result<i64> {
    let mut stmt = conn.prepare_cached(
        "INSERT INTO owners (kind, name, uid, phase, item_operation_timeout_ms, finalize, \
         server_name, server_instance, object, created_ms, updated_ms, last_call_ms, \
         stall_timeout_ms, start_timeout_ms) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?10, ?10, ?11, ?12)",
    )?;
    stmt.execute(params![
        o.kind.as_str(),
        o.name,
        o.uid,
        OwnerPhase::InProgress.as_str(),
        crate::clock::millis(o.timeout.0),
        o.finalize,
        o.server.map(|s| s.name.as_str()).unwrap_or(""),
        o.server.map(|s| s.instance.as_str()),
        o.object,
        now,
        optional_ms(o.stall_timeout),
        optional_ms(o.start_timeout)
    ])?;
    Ok(conn.last_insert_rowid())
}

/// Records that the backup server just called about the owner (the idle timeout
/// counts from its last call).
pub fn touch_owner(conn: &Connection, id: i64, now: UnixMs) -> rusqlite::Result<()> {
    conn.prepare_cached("UPDATE owners SET last_call_ms = ?2 WHERE id = ?1")?
        .execute(params![id, now])?;
    Ok(())
}

/// The InProgress owners of server `name` started by an instance other than
/// `instance` (or, for the unnamed server, without one), by row id.
pub fn in_progress_of_other_instances(
    conn: &Connection,
    name: &str,
    instance: &str,
) -> rusqlite::Result<Vec<i64>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT id FROM owners WHERE phase = '{}' AND server_name = ?1 \
         AND (server_instance IS NULL OR server_instance != ?2) ORDER BY id",
        OwnerPhase::InProgress.as_str()
    ))?;
    let rows = stmt.query_map(params![name, instance], |r| r.get(0))?;
    rows.collect()
}

/// The InProgress owners with no call since `before`: row id and last call.
pub fn idle_in_progress(conn: &Connection, before: UnixMs) -> rusqlite::Result<Vec<(i64, UnixMs)>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT id, last_call_ms FROM owners WHERE phase = '{}' AND last_call_ms < ?1 \
         ORDER BY id",
        OwnerPhase::InProgress.as_str()
    ))?;
    let rows = stmt.query_map([before], |r| Ok((r.get(0)?, r.get(1)?)))?;
    rows.collect()
}

/// One page of the current owners of `kind`, by name, optionally filtered by phase.
pub fn list_owners(
    conn: &Connection,
    kind: OwnerKind,
    phases: Option<&[OwnerPhase]>,
    after: Option<&str>,
    limit: u32,
) -> rusqlite::Result<Vec<OwnerRow>> {
    let phase_filter = phases
        .map(|p| format!("AND phase IN ({})", phase_list(p, OwnerPhase::as_str)))
        .unwrap_or_default();
    let sql = format!(
        "SELECT {OWNER_COLUMNS} FROM owners WHERE kind = ?1 AND name > ?2 \
         AND retired_ms IS NULL {phase_filter} ORDER BY name LIMIT ?3"
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    let rows = stmt.query_map(
        params![kind.as_str(), after.unwrap_or(""), limit],
        owner_or_damaged,
    )?;
    rows.collect()
}

/// Writes an owner's mutable fields.
pub fn update_owner(conn: &Connection, row: &OwnerRow, now: UnixMs) -> rusqlite::Result<()> {
    let o = &row.owner;
    let mut stmt = conn.prepare_cached(
        "UPDATE owners SET phase = ?2, errors = ?3, warnings = ?4, post_operation_items = ?5, \
         updated_ms = ?6, completed_ms = ?7, failure_reason = ?8 WHERE id = ?1",
    )?;
    let completed = if o.phase.is_terminal() {
        Some(o.completed.map_or(now, UnixMs::of))
    } else {
        None
    };
    stmt.execute(params![
        row.id,
        o.phase.as_str(),
        o.errors,
        o.warnings,
        o.post_operation_items.as_ref().map(to_json),
        now,
        completed,
        o.failure_reason.as_deref().unwrap_or("")
    ])?;
    Ok(())
}

/// Files of a deleted owner still to be removed (a row of `removals`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Removal {
    pub id: i64,
    pub kind: OwnerKind,
    pub name: String,
}

/// Removes an owner and (by cascade) its operations, and, for a current owner, records
/// that its files are to be removed; returns that record. A retired owner's files went
/// when it was retired: the name's files are another owner's now.
pub fn delete_owner(
    conn: &Connection,
    id: i64,
    kind: OwnerKind,
    name: &str,
) -> rusqlite::Result<Option<Removal>> {
    let retired: Option<bool> = conn
        .prepare_cached("DELETE FROM owners WHERE id = ?1 RETURNING retired_ms IS NOT NULL")?
        .query_row([id], |r| r.get(0))
        .optional()?;
    match retired {
        Some(false) => removal(conn, kind, name).map(Some),
        _ => Ok(None),
    }
}

/// Records that the files of `kind`/`name` are to be removed.
fn removal(conn: &Connection, kind: OwnerKind, name: &str) -> rusqlite::Result<Removal> {
    conn.prepare_cached("INSERT INTO removals (kind, name) VALUES (?1, ?2)")?
        .execute(params![kind.as_str(), name])?;
    Ok(Removal {
        id: conn.last_insert_rowid(),
        kind,
        name: name.to_string(),
    })
}

/// Removal records after row `after`, at most `limit`, in the order they were made.
pub fn removals(conn: &Connection, after: i64, limit: i64) -> rusqlite::Result<Vec<Removal>> {
    let mut stmt = conn
        .prepare_cached("SELECT id, kind, name FROM removals WHERE id > ?1 ORDER BY id LIMIT ?2")?;
    let rows = stmt.query_map(params![after, limit], |r| {
        Ok(Removal {
            id: r.get(0)?,
            kind: parse_column(r, 1)?,
            name: r.get(2)?,
        })
    })?;
    rows.collect()
}

/// Forgets removal records once their files are gone.
pub fn clear_removals(conn: &Connection, ids: &[i64]) -> rusqlite::Result<()> {
    let mut stmt = conn.prepare_cached("DELETE FROM removals WHERE id = ?1")?;
    for id in ids {
        stmt.execute([id])?;
    }
    Ok(())
}

/// Which of `names` (of `kind`) name a current owner now.
pub fn existing_names(
    conn: &Connection,
    kind: OwnerKind,
    names: &[&str],
) -> rusqlite::Result<std::collections::HashSet<String>> {
    let mut stmt = conn.prepare_cached(
        "SELECT 1 FROM owners WHERE kind = ?1 AND name = ?2 AND retired_ms IS NULL",
    )?;
    let mut found = std::collections::HashSet::new();
    for name in names {
        if stmt.exists(params![kind.as_str(), name])? {
            found.insert(name.to_string());
        }
    }
    Ok(found)
}

/// Marks the owner's item-operations file as due to be rewritten, in the transaction of
/// the change that needs it.
pub fn mark_records_due(conn: &Connection, owner_id: i64) -> rusqlite::Result<()> {
    conn.prepare_cached(
        "INSERT INTO records_due (owner_id) VALUES (?1) \
         ON CONFLICT (owner_id) DO UPDATE SET generation = generation + 1",
    )?
    .execute([owner_id])?;
    Ok(())
}

/// The mark of the owner's file, if it is due.
pub fn records_due_generation(conn: &Connection, owner_id: i64) -> rusqlite::Result<Option<i64>> {
    conn.prepare_cached("SELECT generation FROM records_due WHERE owner_id = ?1")?
        .query_row([owner_id], |r| r.get(0))
        .optional()
}

/// Clears marks whose file was written from state at least as new as the mark.
pub fn clear_records_due(conn: &Connection, written: &[(i64, i64)]) -> rusqlite::Result<()> {
    let mut stmt =
        conn.prepare_cached("DELETE FROM records_due WHERE owner_id = ?1 AND generation = ?2")?;
    for (owner_id, generation) in written {
        stmt.execute(params![owner_id, generation])?;
    }
    Ok(())
}

/// Owners whose file is due, after row `after`, at most `limit`: (row, kind, name).
pub fn records_due(
    conn: &Connection,
    after: i64,
    limit: i64,
) -> rusqlite::Result<Vec<(i64, OwnerKind, String)>> {
    let mut stmt = conn.prepare_cached(
        "SELECT d.owner_id, o.kind, o.name FROM records_due d JOIN owners o ON o.id = d.owner_id \
         WHERE d.owner_id > ?1 ORDER BY d.owner_id LIMIT ?2",
    )?;
    let rows = stmt.query_map(params![after, limit], |r| {
        Ok((r.get(0)?, parse_column(r, 1)?, r.get(2)?))
    })?;
    rows.collect()
}

/// Adds operations (New) with their state rows, ignoring ones already known by plugin,
/// ID and item (a retried call adds nothing twice), counts them on the owner and
/// records the call as its server's last. Returns the rows of the added ones.
pub fn insert_operations(
    conn: &Connection,
    owner_id: i64,
    operations: &[NewOperation],
    now: UnixMs,
) -> rusqlite::Result<Vec<i64>> {
    let mut stmt = conn.prepare_cached(
        "INSERT OR IGNORE INTO operations (owner_id, plugin_kind, plugin_name, res_group, \
         res_resource, res_namespace, res_name, operation_id, post_operation_items, created_ms) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
    )?;
    let mut state = conn
        .prepare_cached("INSERT INTO operation_state (op, phase, state) VALUES (?1, 'New', ?2)")?;
    let initial = packed::initial()?;
    let mut added = Vec::new();
    for op in operations {
        let r = &op.resource;
        let inserted = stmt.execute(params![
            owner_id,
            op.plugin.kind.as_str(),
            op.plugin.name,
            r.group,
            r.resource,
            r.namespace,
            r.name,
            op.operation_id,
            to_json(&op.post_operation_items),
            op.created.map_or(now, UnixMs::of)
        ])?;
        if inserted > 0 {
            let row = conn.last_insert_rowid();
            state.execute(params![row, initial])?;
            added.push(row);
        }
    }
    // New operations count as attempted and unfinished (migration 6); the call is the
    // server's last (the idle timeout), in the same row write.
    conn.prepare_cached(
        "UPDATE owners SET n_operations = n_operations + ?2, last_call_ms = ?3 WHERE id = ?1",
    )?
    .execute(params![owner_id, added.len() as i64, now])?;
    Ok(added)
}

const OPERATION_COLUMNS: &str = "o.plugin_kind, o.plugin_name, o.res_group, o.res_resource, \
     o.res_namespace, o.res_name, o.operation_id, o.post_operation_items, o.phase, \
     o.created_ms, o.cancel_requested, s.state";

/// Operations (`o`) with their packed state (`s`, migration 12).
const OPERATIONS_WITH_STATE: &str = "operations o JOIN operation_state s ON s.op = o.id";

fn operation_from_row(row: &Row<'_>) -> rusqlite::Result<Operation> {
    let phase: OperationPhase = parse_column(row, 8)?;
    let mut state = OperationState::default();
    // A damaged state shows as such; the operation is listed all the same.
    let rate = packed::read_column(row, 11, &mut state).unwrap_or_else(|e| {
        state.error = format!("the agent cannot read what it stored of this operation: {e}");
        Rate::default()
    });
    let eta = if phase.is_unfinished() {
        rate.eta_ms(state.n_total).map(|ms| UnixMs(ms).time())
    } else {
        None
    };
    let time = |ms: Option<i64>| ms.map(|ms| UnixMs(ms).time());
    Ok(Operation {
        rate: rate.per_second,
        eta,
        plugin: PluginRef {
            kind: parse_column(row, 0)?,
            name: row.get(1)?,
        },
        resource: resource_at(row, 2)?,
        operation_id: row.get(6)?,
        post_operation_items: json_column(row, 7)?,
        phase,
        created: row.get::<_, UnixMs>(9)?.time(),
        cancel_requested: row.get(10)?,
        started: time(state.started_ms),
        updated: time(state.updated_ms),
        plugin_updated: time(state.plugin_updated_ms),
        next_attempt_at: time(state.next_attempt_ms),
        error: Some(state.error).filter(|e| !e.is_empty()),
        n_completed: state.n_completed,
        n_total: state.n_total,
        operation_units: state.operation_units,
        description: state.description,
        attempts: state.attempts,
        last_error: Some(state.last_error).filter(|e| !e.is_empty()),
    })
}

fn phase_list<T: Copy>(phases: &[T], name: impl Fn(T) -> &'static str) -> String {
    let quoted: Vec<String> = phases.iter().map(|p| format!("'{}'", name(*p))).collect();
    quoted.join(", ")
}

/// The operations of an owner in the order they were added, optionally by phase.
pub fn operations(
    conn: &Connection,
    owner_id: i64,
    phases: Option<&[OperationPhase]>,
) -> rusqlite::Result<Vec<Operation>> {
    let filter = phases
        .map(|p| format!("AND o.phase IN ({})", phase_list(p, OperationPhase::as_str)))
        .unwrap_or_default();
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {OPERATION_COLUMNS} FROM {OPERATIONS_WITH_STATE} WHERE o.owner_id = ?1 \
         {filter} ORDER BY o.id"
    ))?;
    let rows = stmt.query_map([owner_id], operation_from_row)?;
    rows.collect()
}

/// The owner's operations with the given row ids, in the order they were added.
pub fn operations_by_rows(
    conn: &Connection,
    owner_id: i64,
    rows: &[i64],
) -> rusqlite::Result<Vec<Operation>> {
    let mut found = Vec::with_capacity(rows.len());
    // Row ids are integers: listing them inline is safe, and chunks keep statements small.
    for chunk in rows.chunks(500) {
        let list: Vec<String> = chunk.iter().map(i64::to_string).collect();
        let mut stmt = conn.prepare(&format!(
            "SELECT {OPERATION_COLUMNS} FROM {OPERATIONS_WITH_STATE} WHERE o.owner_id = ?1 \
             AND o.id IN ({}) ORDER BY o.id",
            list.join(", ")
        ))?;
        let ops = stmt.query_map([owner_id], operation_from_row)?;
        for op in ops {
            found.push(op?);
        }
    }
    Ok(found)
}

/// The aggregate progress of the owner's unfinished operations: per unit, their count,
/// counts and summed rates; and the latest of their ETAs, if every one has one.
pub fn owner_progress(conn: &Connection, owner_id: i64) -> rusqlite::Result<OwnerProgress> {
    // Driven by the index on (owner_id, phase): only unfinished operations are read.
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT s.state FROM {OPERATIONS_WITH_STATE} WHERE o.owner_id = ?1 AND o.phase IN {}",
        *UNFINISHED
    ))?;
    let mut rows = stmt.query([owner_id])?;
    let mut units: BTreeMap<String, UnitsProgress> = BTreeMap::new();
    let mut latest: Option<i64> = None;
    let mut every_eta = true;
    let mut state = OperationState::default();
    while let Some(row) = rows.next()? {
        // A damaged state counts nothing (its operation is listed with why), and
        // leaves the owner without an ETA: not every one has one.
        let Ok(rate) = packed::read_column(row, 0, &mut state) else {
            every_eta = false;
            continue;
        };
        let n_total = state.n_total;
        let name = std::mem::take(&mut state.operation_units);
        let entry = units.entry(name.clone()).or_insert_with(|| UnitsProgress {
            units: name,
            operations: 0,
            n_completed: 0,
            n_total: 0,
            rate: None,
        });
        entry.operations += 1;
        entry.n_completed = entry.n_completed.saturating_add(state.n_completed);
        entry.n_total = entry.n_total.saturating_add(n_total);
        if let Some(r) = rate.per_second {
            entry.rate = Some(entry.rate.unwrap_or(0.0) + r);
        }
        match rate.eta_ms(n_total) {
            Some(eta) => latest = Some(latest.map_or(eta, |l| l.max(eta))),
            None => every_eta = false,
        }
    }
    Ok(OwnerProgress {
        units: units.into_values().collect(),
        eta: latest.filter(|_| every_eta).map(|ms| UnixMs(ms).time()),
    })
}

/// The union of the owner's post-operation items, sorted and without duplicates.
pub fn post_operation_items(
    conn: &Connection,
    owner_id: i64,
) -> rusqlite::Result<Vec<ResourceIdentifier>> {
    let mut stmt = conn.prepare_cached(
        "SELECT post_operation_items FROM operations WHERE owner_id = ?1 \
         AND post_operation_items != '[]'",
    )?;
    let mut rows = stmt.query([owner_id])?;
    let mut union = std::collections::BTreeSet::new();
    while let Some(row) = rows.next()? {
        let items: Vec<ResourceIdentifier> = json_column(row, 0)?;
        union.extend(items);
    }
    Ok(union.into_iter().collect())
}

/// One unfinished operation, with what a poll of it needs to know.
#[derive(Clone, Debug)]
pub struct PollTarget {
    pub row: i64,
    pub owner_row: i64,
    pub owner: Arc<OwnerRef>,
    /// The size of the owner's object, serialized (0 without one): what every call
    /// about this operation carries besides its own few hundred bytes.
    pub object_bytes: usize,
    pub timeout_ms: i64,
    /// The owner's own stall and start deadlines in ms (`Some(0)`: off), overriding the
    /// snapshotter's.
    pub stall_timeout_ms: Option<i64>,
    pub start_timeout_ms: Option<i64>,
    /// Shared by the targets of a page that have the same.
    pub plugin: Arc<PluginRef>,
    pub operation_id: String,
    pub state: OperationState,
    /// Its smoothed rate as stored.
    pub rate: Rate,
}

/// Which unfinished operations to load.
#[derive(Clone, Copy, Debug)]
pub enum Targets<'a> {
    /// Those of one owner, whatever its phase.
    Owner(i64),
    /// A page of those of `plugin` whose owner is waiting: rows after `after`, at most
    /// `limit` of them, in row order (the periodic sweep).
    WaitingPage {
        plugin: &'a str,
        after: i64,
        limit: i64,
    },
    /// Canceled operations whose Cancel calls were out when the agent stopped (any
    /// phase: they are Canceled already), the first `limit` by row.
    CancelRequested { limit: i64 },
    /// Those of `plugin` named in `operation_ids` (a JSON array of strings) whose owner
    /// is waiting (a snapshotter's hint).
    Hinted {
        plugin: &'a str,
        operation_ids: &'a str,
    },
}

/// The plugins that have unfinished operations of waiting owners: those the sweep
/// polls. Driven by the waiting owners (by their phase index), so operations of owners
/// still InProgress cost nothing, however many.
pub fn plugins_waited_on(conn: &Connection) -> rusqlite::Result<Vec<String>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT DISTINCT o.plugin_name FROM owners w JOIN operations o ON o.owner_id = w.id \
         WHERE w.phase IN {} AND o.phase IN {} ORDER BY o.plugin_name",
        *WAITING, *UNFINISHED
    ))?;
    let rows = stmt.query_map([], |r| r.get(0))?;
    rows.collect()
}

/// The owners with unfinished operations of `plugin`, as `kind name (count)`, at most
/// `limit` of them, and how many owners there are in all.
pub fn owners_waiting_on(
    conn: &Connection,
    plugin: &str,
    limit: i64,
) -> rusqlite::Result<(Vec<String>, i64)> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT o.kind, o.name, COUNT(*) FROM operations p JOIN owners o ON o.id = p.owner_id \
         WHERE p.plugin_name = ?1 AND p.phase IN {} GROUP BY o.id ORDER BY o.kind, o.name",
        *UNFINISHED
    ))?;
    let mut named = Vec::new();
    let mut all = 0;
    let mut rows = stmt.query([plugin])?;
    while let Some(row) = rows.next()? {
        all += 1;
        if all <= limit {
            let (kind, name, n): (String, String, i64) = (row.get(0)?, row.get(1)?, row.get(2)?);
            named.push(format!("{kind} {name} ({n})"));
        }
    }
    Ok((named, all))
}

/// What the targets of one owner share: the owner as the snapshotter protocol names
/// it (its `object` parsed), the object's size, and the owner's deadlines.
struct OwnerPart {
    owner: Arc<OwnerRef>,
    object_bytes: usize,
    timeout_ms: i64,
    stall_timeout_ms: Option<i64>,
    start_timeout_ms: Option<i64>,
}

/// Read by a statement of its own, once per owner: a page of targets holds an owner
/// once, however many of its operations it holds, and its rows carry none of it.
fn owner_part(conn: &Connection, owner_row: i64) -> rusqlite::Result<OwnerPart> {
    conn.prepare_cached(
        "SELECT kind, name, uid, object, item_operation_timeout_ms, stall_timeout_ms, \
         start_timeout_ms FROM owners WHERE id = ?1",
    )?
    .query_row([owner_row], |row| {
        Ok(OwnerPart {
            object_bytes: row.get_ref(3)?.as_str_or_null()?.map_or(0, str::len),
            owner: Arc::new(OwnerRef {
                kind: parse_column(row, 0)?,
                name: row.get(1)?,
                uid: row.get(2)?,
                object: optional_json(row, 3)?,
            }),
            timeout_ms: row.get(4)?,
            stall_timeout_ms: row.get(5)?,
            start_timeout_ms: row.get(6)?,
        })
    })
}

/// The unfinished operations selected by `which`. Targets of one owner share one
/// [`OwnerRef`], and consecutive targets of one plugin one [`PluginRef`].
pub fn poll_targets(conn: &Connection, which: Targets<'_>) -> rusqlite::Result<Vec<PollTarget>> {
    // The operation's columns only: what the owner adds is read once per owner.
    const COLUMNS: &str = "o.id, o.owner_id, o.plugin_kind, o.plugin_name, o.operation_id, \
         o.phase, o.created_ms, s.state";
    const STATE: &str = "JOIN operation_state s ON s.op = o.id";
    let (mut stmt, mut rows);
    // A page is usually full: its rows are large, so growing the list costs copies.
    let expected = match which {
        Targets::WaitingPage { limit, .. } | Targets::CancelRequested { limit } => {
            usize::try_from(limit).unwrap_or(0).min(10_000)
        }
        _ => 0,
    };
    match which {
        Targets::Owner(id) => {
            stmt = conn.prepare_cached(&format!(
                "SELECT {COLUMNS} FROM owners w JOIN operations o ON o.owner_id = w.id {STATE} \
                 WHERE w.id = ?1 AND o.phase IN {} ORDER BY o.id",
                *UNFINISHED
            ))?;
            rows = stmt.query([id])?;
        }
        Targets::WaitingPage {
            plugin,
            after,
            limit,
        } => {
            // Driven by the partial index on unfinished operations by plugin, the
            // waiting owners listed once per page rather than joined on every row.
            stmt = conn.prepare_cached(&format!(
                "SELECT {COLUMNS} FROM operations o {STATE} \
                 WHERE o.plugin_name = ?1 AND o.id > ?2 AND o.phase IN {} \
                 AND o.owner_id IN (SELECT id FROM owners WHERE phase IN {}) \
                 ORDER BY o.id LIMIT ?3",
                *UNFINISHED, *WAITING
            ))?;
            rows = stmt.query(params![plugin, after, limit])?;
        }
        Targets::CancelRequested { limit } => {
            stmt = conn.prepare_cached(&format!(
                "SELECT {COLUMNS} FROM operations o JOIN owners w ON w.id = o.owner_id {STATE} \
                 WHERE o.cancel_requested = 1 ORDER BY o.id LIMIT ?1"
            ))?;
            rows = stmt.query([limit])?;
        }
        Targets::Hinted {
            plugin,
            operation_ids,
        } => {
            // Waiting owners first (CROSS JOIN keeps that order), then a lookup per
            // owner, kind and ID in the unique index: the cost follows the IDs named
            // and the owners waiting, not the plugin's operations.
            let kinds = PluginKind::ALL
                .iter()
                .map(|k| format!("'{}'", k.as_str()))
                .collect::<Vec<_>>()
                .join(", ");
            stmt = conn.prepare_cached(&format!(
                "SELECT {COLUMNS} FROM owners w CROSS JOIN operations o ON o.owner_id = w.id \
                 {STATE} WHERE w.phase IN {} AND o.plugin_kind IN ({kinds}) AND o.plugin_name = ?1 \
                 AND o.operation_id IN (SELECT value FROM json_each(?2)) \
                 AND o.phase IN {} ORDER BY o.owner_id, o.id",
                *WAITING, *UNFINISHED
            ))?;
            rows = stmt.query(params![plugin, operation_ids])?;
        }
    }
    let mut targets = Vec::with_capacity(expected);
    let mut plugin: Option<Arc<PluginRef>> = None;
    // Each owner's part, found by its row; rows come in runs of one owner, so the last
    // one found is looked at first (no hashing per row: this is the sweep's hot path).
    let mut parts: Vec<OwnerPart> = Vec::new();
    let mut by_row: HashMap<i64, usize> = HashMap::new();
    let mut last: Option<(i64, usize)> = None;
    while let Some(row) = rows.next()? {
        let id: i64 = row.get(0)?;
        let owner_row: i64 = row.get(1)?;
        let index = match last {
            Some((r, i)) if r == owner_row => i,
            _ => {
                let i = match by_row.entry(owner_row) {
                    std::collections::hash_map::Entry::Occupied(e) => *e.get(),
                    std::collections::hash_map::Entry::Vacant(e) => {
                        parts.push(owner_part(conn, owner_row)?);
                        *e.insert(parts.len() - 1)
                    }
                };
                last = Some((owner_row, i));
                i
            }
        };
        let part = &parts[index];
        // Rows of a page mostly name one plugin: compared as stored, parsed when new.
        let (kind, name) = (row.get_ref(2)?.as_bytes()?, row.get_ref(3)?.as_bytes()?);
        let plugin = match &plugin {
            Some(p) if p.kind.as_str().as_bytes() == kind && p.name.as_bytes() == name => p.clone(),
            _ => plugin
                .insert(Arc::new(PluginRef {
                    kind: parse_column(row, 2)?,
                    name: row.get(3)?,
                }))
                .clone(),
        };
        let mut state = OperationState {
            phase: parse_column(row, 5)?,
            created_ms: row.get(6)?,
            ..OperationState::default()
        };
        let operation_id: String = row.get(4)?;
        let rate = packed::read_column(row, 7, &mut state).unwrap_or_else(|e| {
            tracing::warn!(owner = %part.owner.name, plugin = %plugin.name,
                operation = %operation_id, row = id, error = %e,
                "the stored state of an operation is unreadable; it is polled afresh");
            Rate::default()
        });
        targets.push(PollTarget {
            row: id,
            owner_row,
            owner: part.owner.clone(),
            object_bytes: part.object_bytes,
            timeout_ms: part.timeout_ms,
            stall_timeout_ms: part.stall_timeout_ms,
            start_timeout_ms: part.start_timeout_ms,
            plugin,
            operation_id,
            state,
            rate,
        });
    }
    Ok(targets)
}

/// Writes polled operations' new states, each only if the operation is still
/// unfinished (a concurrent delete or failure wins), with statements prepared once per
/// batch: a sweep writes thousands of rows in one transaction.
pub struct OperationUpdates<'c> {
    conn: &'c Connection,
    /// The operation's phase (and with it its index entry, count trigger and the phase
    /// copied to its state row).
    phase: Option<CachedStatement<'c>>,
    /// The state row (everything else that changes), by the phase that guards it.
    state: Option<(OperationPhase, CachedStatement<'c>)>,
    /// The packed state being written.
    packed: Vec<u8>,
}

impl<'c> OperationUpdates<'c> {
    pub fn new(conn: &'c Connection) -> OperationUpdates<'c> {
        OperationUpdates {
            conn,
            phase: None,
            state: None,
            packed: Vec::new(),
        }
    }

    /// Writes `new` over `old` (the state read before the poll). Returns whether the
    /// row changed.
    pub fn write(
        &mut self,
        row: i64,
        old: &OperationState,
        new: &OperationState,
        rate: &Rate,
    ) -> rusqlite::Result<bool> {
        if new.phase != old.phase {
            let stmt = match self.phase.take() {
                Some(stmt) => stmt,
                None => self.conn.prepare_cached(&format!(
                    "UPDATE operations SET phase = ?2 WHERE id = ?1 AND phase IN {}",
                    *UNFINISHED
                ))?,
            };
            let stmt = self.phase.insert(stmt);
            if stmt.execute(params![row, new.phase.as_str()])? == 0 {
                return Ok(false);
            }
        }
        // Guarded by the phase just written (or, if it stayed, the one read).
        let stmt = match self.state.take() {
            Some((phase, stmt)) if phase == new.phase => stmt,
            _ => self.conn.prepare_cached(&update_state(new.phase))?,
        };
        let (_, stmt) = self.state.insert((new.phase, stmt));
        packed::pack_into(&mut self.packed, new, rate)?;
        let changed = stmt.execute(params![row, self.packed])?;
        Ok(changed > 0)
    }
}

/// The state row's write, guarded by `phase`, copied into the row. The phase is written
/// into the statement: bound, it cost a tenth of the write (its text copied each time).
fn update_state(phase: OperationPhase) -> String {
    format!(
        "UPDATE operation_state SET state = ?2 WHERE op = ?1 AND phase = '{}'",
        phase.as_str()
    )
}

/// `row`'s packed state, changed by `change`: the rare writes that are not a poll's
/// (a cancel, a failure), read and written whole.
fn change_state(
    conn: &Connection,
    row: i64,
    change: impl FnOnce(&mut OperationState),
) -> rusqlite::Result<()> {
    let read = conn
        .prepare_cached("SELECT state FROM operation_state WHERE op = ?1")?
        .query_row([row], |r| {
            let mut state = OperationState::default();
            // A damaged state is replaced by what the change makes of a new one's.
            let rate = packed::read_column(r, 0, &mut state).unwrap_or_else(|e| {
                tracing::warn!(row, error = %e,
                    "the stored state of an operation is unreadable; written afresh");
                Rate::default()
            });
            Ok((state, rate))
        })
        .optional()?;
    let Some((mut state, rate)) = read else {
        return Ok(());
    };
    change(&mut state);
    conn.prepare_cached("UPDATE operation_state SET state = ?2 WHERE op = ?1")?
        .execute(params![row, packed::pack(&state, &rate)?])?;
    Ok(())
}

/// One operation of an owner as `*.cancel` picks it: row id, ID, item and phase.
#[derive(Clone, Debug)]
pub struct OperationKey {
    pub row: i64,
    pub operation_id: String,
    pub resource: ResourceIdentifier,
    pub phase: OperationPhase,
}

fn operation_key(r: &Row<'_>) -> rusqlite::Result<OperationKey> {
    Ok(OperationKey {
        row: r.get(0)?,
        operation_id: r.get(1)?,
        resource: resource_at(r, 2)?,
        phase: parse_column(r, 6)?,
    })
}

/// The operations of `owner_id` with ID `operation_id` (all of them without one, for a
/// cancel that names many), in row order.
pub fn operation_keys(
    conn: &Connection,
    owner_id: i64,
    operation_id: Option<&str>,
) -> rusqlite::Result<Vec<OperationKey>> {
    let mut stmt = conn.prepare_cached(
        "SELECT id, operation_id, res_group, res_resource, res_namespace, res_name, phase \
         FROM operations WHERE owner_id = ?1 AND (?2 IS NULL OR operation_id = ?2) ORDER BY id",
    )?;
    let rows = stmt.query_map(params![owner_id, operation_id], operation_key)?;
    rows.collect()
}

/// Cancels the still-unfinished operations among `rows` of `owner_id`: Canceled with
/// `error`, and marked as having Cancel calls out. Returns the rows it changed.
pub fn cancel_operations(
    conn: &Connection,
    owner_id: i64,
    rows: &[i64],
    error: &str,
    now: UnixMs,
) -> rusqlite::Result<Vec<i64>> {
    let mut stmt = conn.prepare_cached(&format!(
        "UPDATE operations SET phase = '{}', cancel_requested = 1 \
         WHERE id = ?1 AND owner_id = ?2 AND phase IN {}",
        OperationPhase::Canceled.as_str(),
        *UNFINISHED
    ))?;
    let mut changed = Vec::new();
    for &row in rows {
        if stmt.execute(params![row, owner_id])? > 0 {
            change_state(conn, row, |s| {
                s.error = error.to_string();
                s.next_attempt_ms = None;
                s.updated_ms = Some(now.ms());
            })?;
            changed.push(row);
        }
    }
    Ok(changed)
}

/// Records that the Cancel calls for `rows` are over (answered or abandoned).
pub fn clear_cancel_requested(conn: &Connection, rows: &[i64]) -> rusqlite::Result<()> {
    let mut stmt = conn.prepare_cached(
        "UPDATE operations SET cancel_requested = 0 WHERE id = ?1 AND cancel_requested = 1",
    )?;
    for row in rows {
        stmt.execute([row])?;
    }
    Ok(())
}

/// Fails every unfinished operation of an owner with `error`; returns how many.
pub fn fail_unfinished(
    conn: &Connection,
    owner_id: i64,
    error: &str,
    now: UnixMs,
) -> rusqlite::Result<u64> {
    // Which they are, before their phase changes; each state is then read and written
    // whole (a failure of a large owner's operations is rare: one row at a time).
    let unfinished: Vec<i64> = conn
        .prepare_cached(&format!(
            "SELECT id FROM operations WHERE owner_id = ?1 AND phase IN {}",
            *UNFINISHED
        ))?
        .query_map([owner_id], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    for &row in &unfinished {
        change_state(conn, row, |s| {
            s.error = error.to_string();
            s.updated_ms = Some(now.ms());
        })?;
    }
    let changed = conn
        .prepare_cached(&format!(
            "UPDATE operations SET phase = '{}' WHERE owner_id = ?1 AND phase IN {}",
            OperationPhase::Failed.as_str(),
            *UNFINISHED
        ))?
        .execute([owner_id])?;
    Ok(changed as u64)
}

/// The stored result of an owner's `finalize`, if it was finalized.
pub fn finalize_result(conn: &Connection, id: i64) -> rusqlite::Result<Option<String>> {
    conn.prepare_cached("SELECT finalize_result FROM owners WHERE id = ?1")?
        .query_row([id], |r| r.get(0))
        .optional()
        .map(Option::flatten)
}

/// The owner other than `except` whose finalize wrote its contents to `path`.
pub fn owner_with_contents_file(
    conn: &Connection,
    path: &std::path::Path,
    except: i64,
) -> rusqlite::Result<Option<(OwnerKind, String)>> {
    // Stored as JSON strings (a path that is not UTF-8 cannot be stored).
    let path = path.to_string_lossy();
    let mut stmt = conn.prepare_cached(
        "SELECT kind, name FROM owners WHERE id != ?2 AND finalize_result IS NOT NULL \
         AND retired_ms IS NULL \
         AND CASE WHEN json_valid(finalize_result) \
         THEN json_extract(finalize_result, '$.contentsFile') END = ?1 LIMIT 1",
    )?;
    stmt.query_row(params![path, except], |r| {
        Ok((parse_column(r, 0)?, r.get(1)?))
    })
    .optional()
}

/// Records the result of an owner's `finalize`.
pub fn set_finalize_result(conn: &Connection, id: i64, result: &str) -> rusqlite::Result<()> {
    conn.prepare_cached("UPDATE owners SET finalize_result = ?2 WHERE id = ?1")?
        .execute(params![id, result])?;
    Ok(())
}

/// Deletes at most `limit` terminal owners completed before `before`, oldest first,
/// recording the removal of their files; returns those records.
pub fn delete_expired(
    conn: &Connection,
    before: UnixMs,
    limit: i64,
) -> rusqlite::Result<Vec<Removal>> {
    let terminal = sql_list(OwnerPhase::ALL, OwnerPhase::is_terminal, OwnerPhase::as_str);
    // Driven by the index on completion time; only terminal owners have one.
    let expired: Vec<(i64, OwnerKind, String)> = {
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT id, kind, name FROM owners WHERE completed_ms < ?1 \
             AND phase IN {terminal} ORDER BY completed_ms LIMIT ?2"
        ))?;
        let rows = stmt.query_map(params![before, limit], |r| {
            Ok((r.get(0)?, parse_column(r, 1)?, r.get(2)?))
        })?;
        rows.collect::<rusqlite::Result<_>>()?
    };
    let mut removals = Vec::new();
    for (id, kind, name) in expired {
        removals.extend(delete_owner(conn, id, kind, &name)?);
    }
    Ok(removals)
}

/// Owners counted by phase, and how many operations are unfinished in all.
pub fn tally(conn: &Connection) -> rusqlite::Result<super::Counts> {
    let mut stmt = conn.prepare_cached(
        "SELECT phase, COUNT(*), SUM(n_operations), SUM(n_completed), SUM(n_failed) \
         FROM owners GROUP BY phase",
    )?;
    let mut rows = stmt.query([])?;
    let (mut owners, mut unfinished) = (BTreeMap::new(), 0);
    while let Some(row) = rows.next()? {
        owners.insert(parse_column(row, 0)?, row.get::<_, i64>(1)? as u64);
        let sum = |i| row.get::<_, i64>(i).map(|n| n.max(0) as u64);
        unfinished += self::unfinished(sum(2)?, sum(3)?, sum(4)?);
    }
    Ok((owners, unfinished))
}

fn snapshotter_from_row(row: &Row<'_>) -> rusqlite::Result<Snapshotter> {
    let api_version: ApiVersion = parse_column(row, 1)?;
    let attempts: Option<i64> = row.get(6)?;
    let (velero_plugin, args, env) = match optional_json::<VeleroPluginColumn>(row, 9)? {
        Some(p) => (Some(p.path), p.args, p.env),
        None => (None, None, None),
    };
    Ok(Snapshotter {
        velero_plugin,
        args,
        env,
        stall_timeout: optional_duration(row, 4)?,
        start_timeout: optional_duration(row, 5)?,
        retry_attempts: attempts.map(|n| n.clamp(0, i64::from(u32::MAX)) as u32),
        retry_backoff: optional_duration(row, 7)?,
        retry_within: optional_duration(row, 8)?,
        name: row.get(0)?,
        api_version,
        socket: row.get::<_, Option<String>>(2)?.map(Into::into),
        command: optional_json(row, 3)?,
    })
}

/// The `velero_plugin` column: the binary with its arguments and environment.
#[derive(serde::Serialize, serde::Deserialize)]
struct VeleroPluginColumn {
    path: std::path::PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    args: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    env: Option<std::collections::BTreeMap<String, String>>,
}

/// Registers (or replaces) a snapshotter.
pub fn upsert_snapshotter(conn: &Connection, s: &Snapshotter) -> rusqlite::Result<()> {
    conn.prepare_cached(
        "INSERT INTO snapshotters (name, api_version, socket, command, stall_timeout_ms, \
         start_timeout_ms, retry_attempts, retry_backoff_ms, retry_within_ms, velero_plugin) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10) \
         ON CONFLICT (name) DO UPDATE SET api_version = excluded.api_version, \
         socket = excluded.socket, command = excluded.command, \
         stall_timeout_ms = excluded.stall_timeout_ms, \
         start_timeout_ms = excluded.start_timeout_ms, \
         retry_attempts = excluded.retry_attempts, retry_backoff_ms = excluded.retry_backoff_ms, \
         retry_within_ms = excluded.retry_within_ms, velero_plugin = excluded.velero_plugin",
    )?
    .execute(params![
        s.name,
        s.api_version.as_str(),
        s.socket.as_ref().map(|p| p.to_string_lossy().into_owned()),
        s.command.as_ref().map(to_json),
        optional_ms(s.stall_timeout),
        optional_ms(s.start_timeout),
        s.retry_attempts,
        optional_ms(s.retry_backoff),
        optional_ms(s.retry_within),
        s.velero_plugin
            .as_ref()
            .map(|path| to_json(&VeleroPluginColumn {
                path: path.clone(),
                args: s.args.clone(),
                env: s.env.clone(),
            }))
    ])?;
    Ok(())
}

const SNAPSHOTTER_COLUMNS: &str = "name, api_version, socket, command, stall_timeout_ms, \
     start_timeout_ms, retry_attempts, retry_backoff_ms, retry_within_ms, velero_plugin";

/// All snapshotters, by name.
pub fn snapshotters(conn: &Connection) -> rusqlite::Result<Vec<Snapshotter>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {SNAPSHOTTER_COLUMNS} FROM snapshotters ORDER BY name"
    ))?;
    let rows = stmt.query_map([], snapshotter_from_row)?;
    rows.collect()
}

/// Removes a snapshotter; returns it if it existed.
pub fn delete_snapshotter(conn: &Connection, name: &str) -> rusqlite::Result<Option<Snapshotter>> {
    conn.prepare_cached(&format!(
        "DELETE FROM snapshotters WHERE name = ?1 RETURNING {SNAPSHOTTER_COLUMNS}"
    ))?
    .query_row([name], snapshotter_from_row)
    .optional()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SQLite uses a partial index only for a query whose condition is the index's own
    /// text: the derived list must read as the schema writes it.
    #[test]
    fn the_unfinished_list_is_the_partial_indexs_condition() {
        let condition = format!("WHERE phase IN {}", *UNFINISHED);
        assert_eq!(condition, "WHERE phase IN ('New', 'InProgress')");
        assert!(crate::store::schema::MIGRATIONS
            .iter()
            .any(|m| m.contains("operations_unfinished_by_plugin") && m.contains(&condition)));
    }
}
