//! The register baselines: raw rusqlite inserts of the same rows into the same tables
//! with the agent's pragmas (WAL, `synchronous=FULL`, foreign keys on).

use std::path::Path;
use std::time::{Duration, Instant};

use opmon_client::NewOperation;
use rusqlite::{params, Connection};

const INSERT: &str = "INSERT OR IGNORE INTO operations (owner_id, plugin_kind, plugin_name, \
     res_group, res_resource, res_namespace, res_name, operation_id, post_operation_items, \
     created_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)";

fn now_ms() -> i64 {
    (time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64
}

/// A database at `path` with the agent's schema and pragmas, and `owners` backups.
fn open(path: &Path, owners: usize) -> Result<Connection, String> {
    let sql = |e: rusqlite::Error| format!("baseline database {}: {e}", path.display());
    let mut conn = Connection::open(path).map_err(sql)?;
    let mode: String = conn
        .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
        .map_err(sql)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(format!("baseline database: journal mode stayed {mode}"));
    }
    conn.execute_batch(
        "PRAGMA foreign_keys = ON; PRAGMA synchronous = FULL; PRAGMA busy_timeout = 10000;",
    )
    .map_err(sql)?;
    // The agent's own schema, by its own migrations: the baseline writes the same rows
    // into the same tables and indexes.
    opmon_agent::store::schema::migrate(&mut conn).map_err(|e| e.to_string())?;
    let now = now_ms();
    for i in 0..owners {
        conn.execute(
            "INSERT INTO owners (kind, name, uid, phase, item_operation_timeout_ms, finalize, \
             created_ms, updated_ms) VALUES ('backup', ?1, ?2, 'InProgress', 14400000, 1, ?3, ?3)",
            params![format!("baseline-{i}"), format!("uid-{i}"), now],
        )
        .map_err(sql)?;
    }
    Ok(conn)
}

/// One row's values, prepared before the clock starts: a raw insert of ready values.
struct Values {
    owner: i64,
    kind: &'static str,
    plugin: String,
    group: String,
    resource: String,
    namespace: String,
    name: String,
    id: String,
    post: String,
}

fn values(owner: i64, op: &NewOperation) -> Values {
    Values {
        owner,
        kind: op.plugin.kind.as_str(),
        plugin: op.plugin.name.clone(),
        group: op.resource.group.clone(),
        resource: op.resource.resource.clone(),
        namespace: op.resource.namespace.clone(),
        name: op.resource.name.clone(),
        id: op.operation_id.clone(),
        post: serde_json::to_string(&op.post_operation_items).unwrap_or_else(|_| "[]".into()),
    }
}

/// An operation's row and, as the agent adds it, its state row (schema 12).
fn insert(conn: &Connection, v: &Values, now: i64) -> rusqlite::Result<usize> {
    let inserted = conn.prepare_cached(INSERT)?.execute(params![
        v.owner,
        v.kind,
        v.plugin,
        v.group,
        v.resource,
        v.namespace,
        v.name,
        v.id,
        v.post,
        now
    ])?;
    if inserted > 0 {
        conn.prepare_cached(
            "INSERT INTO operation_state (op, phase, state) VALUES (?1, 'New', ?2)",
        )?
        .execute(params![
            conn.last_insert_rowid(),
            opmon_agent::store::packed::initial()?
        ])?;
    }
    Ok(inserted)
}

/// Inserts `owners[i]`'s operations into backup `i`, `per_tx` rows per transaction;
/// returns the time the inserts took.
pub fn batched(
    path: &Path,
    owners: &[Vec<NewOperation>],
    per_tx: usize,
) -> Result<Duration, String> {
    let conn = open(path, owners.len())?;
    let rows: Vec<Vec<Values>> = owners
        .iter()
        .enumerate()
        .map(|(i, ops)| ops.iter().map(|op| values(i as i64 + 1, op)).collect())
        .collect();
    let sql = |e: rusqlite::Error| format!("baseline insert: {e}");
    let began = Instant::now();
    for owner in &rows {
        for chunk in owner.chunks(per_tx.max(1)) {
            let now = now_ms();
            conn.execute_batch("BEGIN IMMEDIATE").map_err(sql)?;
            for v in chunk {
                insert(&conn, v, now).map_err(sql)?;
            }
            conn.execute_batch("COMMIT").map_err(sql)?;
        }
    }
    Ok(began.elapsed())
}

/// Inserts each of `ops` into one backup, one committed transaction per row.
pub fn one_per_commit(path: &Path, ops: &[NewOperation]) -> Result<Duration, String> {
    batched(path, &[ops.to_vec()], 1)
}
