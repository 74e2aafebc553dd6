//! Each owner's history: phase changes, failures, and the calls that changed it with
//! their callers, recorded by [`record`] inside the write transaction of the change
//! itself, so the history never disagrees with the state (a rolled-back change leaves
//! no event, a committed one always has its event).
//!
//! Invariants:
//! - events are numbered per owner (`seq` 1, 2, …), never reused while the owner lives;
//!   `seq` is the paging cursor;
//! - an owner keeps at most [`MAX_PER_OWNER`] events: recording one more drops the
//!   oldest, in the same statement sequence, so no owner's history grows without bound;
//! - events are removed with their owner (`ON DELETE CASCADE`: `delete` and expiry);
//! - progress alone is no event: the sweep's progress-only commits call nothing here.

use opmon_client::{Caller, Event, EventOperation, EventReason, PluginRef};
use rusqlite::{params, Connection, Row};

use super::queries::{parse_column, resource_at};

use crate::clock::UnixMs;

/// The most events an owner keeps; older ones are dropped as new ones come.
pub const MAX_PER_OWNER: i64 = 1000;
/// Default and largest `events` page.
pub const DEFAULT_PAGE: u32 = 100;
pub const MAX_PAGE: u32 = 1000;

/// What happened, to be recorded.
#[derive(Clone, Copy, Debug)]
pub struct NewEvent<'a> {
    pub reason: EventReason,
    /// The row of the operation it is about, if any.
    pub operation: Option<i64>,
    /// Who called, for an event of a call; `None` for what the agent did by itself.
    pub caller: Option<Caller>,
    pub message: &'a str,
}

impl<'a> NewEvent<'a> {
    /// An event about the owner as a whole; [`NewEvent::about`] names an operation.
    pub fn new(reason: EventReason, caller: Option<Caller>, message: &'a str) -> Self {
        NewEvent {
            reason,
            operation: None,
            caller,
            message,
        }
    }

    /// The same event, about the operation of row `operation`.
    pub fn about(self, operation: i64) -> Self {
        NewEvent {
            operation: Some(operation),
            ..self
        }
    }
}

/// Records `event` for owner row `owner_id` at `now`, inside the caller's write
/// transaction, and drops the owner's oldest event once it has more than
/// [`MAX_PER_OWNER`]. The one way events are written: every change that is an event
/// calls this in the transaction that makes the change.
pub fn record(
    conn: &Connection,
    owner_id: i64,
    event: &NewEvent<'_>,
    now: UnixMs,
) -> rusqlite::Result<()> {
    // The owner's last event is one step away in its index.
    let last: i64 = conn
        .prepare_cached("SELECT COALESCE(MAX(seq), 0) FROM events WHERE owner_id = ?1")?
        .query_row([owner_id], |r| r.get(0))?;
    let seq = last + 1;
    conn.prepare_cached(
        "INSERT INTO events (owner_id, seq, at_ms, reason, operation_row, caller_uid, \
         caller_pid, message) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?
    .execute(params![
        owner_id,
        seq,
        now,
        event.reason.as_str(),
        event.operation,
        event.caller.map(|c| c.uid),
        event.caller.map(|c| c.pid),
        event.message
    ])?;
    if seq > MAX_PER_OWNER {
        // Each record drops at most what the one before it left: normally one row.
        conn.prepare_cached("DELETE FROM events WHERE owner_id = ?1 AND seq <= ?2")?
            .execute(params![owner_id, seq - MAX_PER_OWNER])?;
    }
    Ok(())
}

fn event_from_row(row: &Row<'_>) -> rusqlite::Result<Event> {
    let operation = match row.get::<_, Option<String>>(6)? {
        Some(operation_id) => Some(EventOperation {
            plugin: PluginRef {
                kind: parse_column(row, 7)?,
                name: row.get(8)?,
            },
            resource: resource_at(row, 9)?,
            operation_id,
        }),
        None => None,
    };
    let caller = match (row.get::<_, Option<u32>>(4)?, row.get::<_, Option<i32>>(5)?) {
        (Some(uid), pid) => Some(Caller {
            uid,
            pid: pid.unwrap_or(0),
        }),
        _ => None,
    };
    Ok(Event {
        seq: row.get::<_, i64>(0)?.max(0) as u64,
        time: row.get::<_, UnixMs>(1)?.time(),
        reason: row
            .get::<_, String>(2)?
            .parse()
            .unwrap_or(EventReason::Unknown),
        message: row.get(3)?,
        caller,
        operation,
    })
}

/// The owner's events after `after`, oldest first, at most `limit`.
pub fn page(
    conn: &Connection,
    owner_id: i64,
    after: u64,
    limit: u32,
) -> rusqlite::Result<Vec<Event>> {
    // A cursor past what SQLite's integers hold matches nothing; it is not an error.
    let after = i64::try_from(after).unwrap_or(i64::MAX);
    let mut stmt = conn.prepare_cached(
        "SELECT e.seq, e.at_ms, e.reason, e.message, e.caller_uid, e.caller_pid, \
         o.operation_id, o.plugin_kind, o.plugin_name, o.res_group, o.res_resource, \
         o.res_namespace, o.res_name \
         FROM events e LEFT JOIN operations o ON o.id = e.operation_row \
         WHERE e.owner_id = ?1 AND e.seq > ?2 ORDER BY e.seq LIMIT ?3",
    )?;
    let rows = stmt.query_map(params![owner_id, after, limit], event_from_row)?;
    rows.collect()
}

/// How many events the owner keeps now.
#[cfg(test)]
pub fn count(conn: &Connection, owner_id: i64) -> rusqlite::Result<i64> {
    conn.prepare_cached("SELECT COUNT(*) FROM events WHERE owner_id = ?1")?
        .query_row([owner_id], |r| r.get(0))
}
