//! Durable state: one SQLite file in WAL mode; every change is on disk before anyone
//! hears of it.
//!
//! Writes go through the group-commit [`writer`], whose commits the [`durable`] syncer
//! makes durable (an fsync of the WAL) before their replies; reads use a small pool of
//! their own connections and, thanks to WAL, never wait for the writer, only (once done)
//! for the fsync of any commit they may have seen. The database file is
//! created 0600 and guarded by an exclusive `flock` on its directory (the state
//! directory), which nobody without write access to *its* parent can replace; the pid
//! is written to `<db>.lock` (also locked, for agents of older versions) so a second
//! agent can say who has it.

mod durable;
pub mod events;
pub mod packed;
pub mod queries;
pub mod schema;
mod tally;
pub mod writer;

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use nix::fcntl::{Flock, FlockArg};
use rusqlite::{Connection, ErrorCode, OpenFlags};

pub use self::durable::log_sqlite_errors;
use self::durable::Durability;
pub use self::tally::Counts;
use self::tally::Tally;
pub use self::writer::StorageCause;
use self::writer::Writer;

/// A storage failure (error 1004), of the database or of a file in the storage
/// directory, described for an operator: what failed and why.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct StorageFailure {
    pub message: String,
    pub disk_full: bool,
}

impl StorageFailure {
    fn closed() -> Self {
        StorageFailure {
            message: "the agent is shutting down; the database is closed".into(),
            disk_full: false,
        }
    }
}

impl From<rusqlite::Error> for StorageFailure {
    fn from(e: rusqlite::Error) -> Self {
        let disk_full = matches!(e.sqlite_error_code(), Some(ErrorCode::DiskFull));
        let message = if disk_full {
            format!("the disk holding the database is full ({e})")
        } else {
            format!("database error: {e}")
        };
        StorageFailure { message, disk_full }
    }
}

/// Why the store could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("database {db} is in use by another opmon-agent (pid {pid})")]
    Locked { db: PathBuf, pid: String },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("opening database {db}: {source}")]
    Sqlite {
        db: PathBuf,
        source: rusqlite::Error,
    },
    #[error("database {db}: {source}")]
    Migrate {
        db: PathBuf,
        source: schema::MigrateError,
    },
}

/// The open database.
pub struct Store {
    path: PathBuf,
    writer: Writer,
    readers: Mutex<Vec<Connection>>,
    /// A place among the [`MAX_READERS`] reads that run at once.
    read_slots: Arc<tokio::sync::Semaphore>,
    /// `agent.status`'s counts between commits; the writer forgets them.
    tally: Arc<Tally>,
    /// Which commits are on disk: reads wait for those they may have seen.
    durability: Arc<Durability>,
    _lock: Lock,
}

/// The single-agent lock: the directory's, and the pid file's.
struct Lock {
    _dir: Flock<File>,
    _pid_file: Flock<File>,
}

/// How many reads run at once, each on a connection of its own. Every read connection
/// keeps a page cache of up to SQLite's default 2 MB, and each read holds a thread of
/// the blocking pool: without a bound, a burst of calls (256 subscriptions opened at
/// once on one WebSocket) opened as many connections and grew the agent by 100 MiB and
/// more. Reads beyond it wait for a place, holding neither.
pub const MAX_READERS: usize = 8;

/// Prepared statements the writer's connection keeps: it runs more than rusqlite's
/// default 16 (with 16, each `addOperations` prepared one again and finalized another).
/// The readers, each with a few, keep the default.
const WRITER_STATEMENTS_KEPT: usize = 128;

/// WAL pages after which the writer's commit checkpoints (SQLite's default is 1,000).
/// A checkpoint stops the writer for three fsyncs (the WAL before copying, the database
/// after, the WAL's new header after it restarts), 1.5–2 ms on the bench's disk, while
/// every caller waits; a group commit of 64 callers writes about 28 pages, so at 1,000
/// pages the writer stopped every 36 commits, about 12% of its time. At 4,000 it stops a
/// quarter as often, and the WAL stays under about 17 MB, reused from its start after
/// each checkpoint.
pub const CHECKPOINT_PAGES: u32 = 4000;

/// The writer's `synchronous` level once the database is open: commits are made
/// durable by the syncer's fsync of the WAL before any reply (see [`durable`]), not by
/// SQLite. docs/trust.md states it; a test keeps the two in step.
pub const WRITER_SYNCHRONOUS: &str = "NORMAL";

/// WAL pages past which the file is cut back once a checkpoint has let it restart: a
/// group transaction larger than [`CHECKPOINT_PAGES`] (an `addOperations` of tens of
/// thousands of operations), or a WAL left by `checkpoint = "external"`, would otherwise
/// keep its disk space while the agent runs.
pub const WAL_KEPT_PAGES: u32 = CHECKPOINT_PAGES + 1000;

/// Connection settings every connection shares (the writer's then commits with
/// `synchronous=NORMAL`, its syncer making each commit durable). `busy_timeout` covers
/// the moments a checkpoint holds the file briefly. The query planner's stability
/// guarantee keeps a cached statement's plan when new values are bound: the bundled
/// SQLite is built with STAT4, which otherwise re-prepares (parses and plans again) a
/// statement such as `… FROM events WHERE owner_id = ?1` each time `?1` changes, on
/// every write.
fn configure(conn: &Connection) -> rusqlite::Result<()> {
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG,
        true,
    )?;
    conn.execute_batch(
        "PRAGMA foreign_keys = ON;
         PRAGMA synchronous = FULL;
         PRAGMA busy_timeout = 10000;",
    )
}

impl Store {
    /// Opens (creating if needed) the database at `path`, takes its lock, migrates it,
    /// and starts the writer. `on_commit` is told the size of every committed group.
    pub fn open(
        path: &Path,
        on_commit: impl Fn(usize, std::time::Duration) + Send + 'static,
    ) -> Result<Store, OpenError> {
        let lock = lock(path)?;
        OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)
            .map_err(|source| OpenError::Io {
                what: "creating database",
                path: path.to_path_buf(),
                source,
            })?;
        let sqlite = |source| OpenError::Sqlite {
            db: path.to_path_buf(),
            source,
        };
        let mut conn = Connection::open(path).map_err(sqlite)?;
        let mode: String = conn
            .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
            .map_err(sqlite)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(OpenError::Io {
                what: "enabling WAL on",
                path: path.to_path_buf(),
                source: std::io::Error::other(format!("journal mode stayed {mode}")),
            });
        }
        configure(&conn).map_err(sqlite)?;
        conn.set_prepared_statement_cache_capacity(WRITER_STATEMENTS_KEPT);
        schema::migrate(&mut conn).map_err(|source| OpenError::Migrate {
            db: path.to_path_buf(),
            source,
        })?;
        let page: i64 = conn
            .query_row("PRAGMA page_size", [], |r| r.get(0))
            .map_err(sqlite)?;
        // A WAL frame is a page and its 24-byte header.
        let wal_kept = i64::from(WAL_KEPT_PAGES) * (page + 24);
        // Migrated under `synchronous=FULL`; from here the syncer makes commits durable.
        conn.execute_batch(&format!(
            "PRAGMA synchronous = {WRITER_SYNCHRONOUS}; PRAGMA wal_autocheckpoint = {CHECKPOINT_PAGES}; \
             PRAGMA journal_size_limit = {wal_kept};"
        ))
        .map_err(sqlite)?;
        let tally = Arc::new(Tally::default());
        let durability = Arc::new(Durability::default());
        Ok(Store {
            path: path.to_path_buf(),
            writer: Writer::start(path, conn, tally.clone(), durability.clone(), on_commit),
            readers: Mutex::new(Vec::new()),
            read_slots: Arc::new(tokio::sync::Semaphore::new(MAX_READERS)),
            tally,
            durability,
            _lock: lock,
        })
    }

    /// Write requests waiting for the next group transaction.
    pub fn queued_writes(&self) -> usize {
        self.writer.queued()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `work` in the group transaction; see [`Writer::write`].
    pub async fn write<T, E, F>(&self, work: F) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<StorageFailure> + StorageCause + Send + 'static,
        F: FnOnce(&Connection) -> Result<T, E> + Send + 'static,
    {
        self.writer.write(work).await
    }

    /// Runs `work` on a read connection, on the blocking pool, once one of the
    /// [`MAX_READERS`] places is free. Sees the last commit.
    pub async fn read<T, E, F>(self: &Arc<Self>, work: F) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<StorageFailure> + Send + 'static,
        F: FnOnce(&Connection) -> Result<T, E> + Send + 'static,
    {
        // The semaphore is never closed. The place goes with the work, so a caller that
        // gives up waiting does not free it while the read still runs.
        let slot = self.read_slots.clone().acquire_owned().await.map_err(|e| {
            E::from(StorageFailure {
                message: format!("a database read failed: {e}"),
                disk_full: false,
            })
        })?;
        let store = self.clone();
        let joined = tokio::task::spawn_blocking(move || {
            let conn = store.take_reader()?;
            let result = work(&conn);
            crate::sync::lock(&store.readers).push(conn);
            drop(slot);
            result
        })
        .await;
        let result = joined.unwrap_or_else(|e| {
            Err(E::from(StorageFailure {
                message: format!("a database read failed: {e}"),
                disk_full: false,
            }))
        });
        // What the read saw is shown or acted on only once it is on disk.
        self.durability.settle().await.map_err(E::from)?;
        result
    }

    /// Resolves when a commit could not be made durable: the agent must stop.
    pub async fn durability_lost(&self) -> StorageFailure {
        self.durability.lost().await
    }

    /// Why commits stopped being acknowledged, if they did.
    pub fn durability_failure(&self) -> Option<StorageFailure> {
        self.durability.failure()
    }

    /// `agent.status`'s counts: from memory when no commit has happened since they were
    /// last read, else from the database.
    pub async fn counts(self: &Arc<Self>) -> Result<Counts, StorageFailure> {
        let seen = match self.tally.cached() {
            Ok(counts) => return Ok(counts),
            Err(seen) => seen,
        };
        let counts = self
            .read(|conn| queries::tally(conn).map_err(StorageFailure::from))
            .await?;
        self.tally.keep(seen, &counts);
        Ok(counts)
    }

    fn take_reader(&self) -> Result<Connection, StorageFailure> {
        if let Some(conn) = crate::sync::lock(&self.readers).pop() {
            return Ok(conn);
        }
        let conn = Connection::open_with_flags(
            &self.path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        configure(&conn)?;
        conn.execute_batch("PRAGMA query_only = ON")?;
        Ok(conn)
    }

    /// Lets queued writes commit, then closes every connection (the last one to close
    /// checkpoints the WAL into the database file).
    pub fn close(&self) {
        crate::sync::lock(&self.readers).clear();
        self.writer.close();
    }
}

/// Takes the exclusive lock on the database's directory, then on `<db>.lock`, and
/// writes our pid into the latter. The directory is what counts: a file in it can be
/// replaced by a rename (and a new agent would lock the replacement), the directory
/// only by someone who may write to its parent.
fn lock(db: &Path) -> Result<Lock, OpenError> {
    let mut lock_path = db.as_os_str().to_owned();
    lock_path.push(".lock");
    let lock_path = PathBuf::from(lock_path);
    let dir = match db.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let io = |what, path: &Path| {
        let path = path.to_path_buf();
        move |source| OpenError::Io { what, path, source }
    };
    let holder = |lock_path: &Path| {
        let mut pid = String::new();
        if let Ok(mut file) = File::open(lock_path) {
            let _ = file.read_to_string(&mut pid);
        }
        let pid = pid.trim();
        OpenError::Locked {
            db: db.to_path_buf(),
            pid: if pid.is_empty() {
                "unknown".into()
            } else {
                pid.into()
            },
        }
    };
    let dir_file = File::open(&dir).map_err(io("opening the database directory", &dir))?;
    let dir_lock = match Flock::lock(dir_file, FlockArg::LockExclusiveNonblock) {
        Ok(locked) => locked,
        Err((_, errno)) if errno == nix::errno::Errno::EWOULDBLOCK => {
            return Err(holder(&lock_path))
        }
        Err((_, errno)) => return Err(io("locking", &dir)(std::io::Error::from(errno))),
    };
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .mode(0o600)
        .open(&lock_path)
        .map_err(io("opening lock file", &lock_path))?;
    let mut locked = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(locked) => locked,
        Err((_, errno)) if errno == nix::errno::Errno::EWOULDBLOCK => {
            return Err(holder(&lock_path))
        }
        Err((_, errno)) => return Err(io("locking", &lock_path)(std::io::Error::from(errno))),
    };
    locked
        .set_len(0)
        .map_err(io("writing pid to", &lock_path))?;
    locked.rewind().map_err(io("writing pid to", &lock_path))?;
    writeln!(locked, "{}", std::process::id()).map_err(io("writing pid to", &lock_path))?;
    Ok(Lock {
        _dir: dir_lock,
        _pid_file: locked,
    })
}

#[cfg(test)]
mod tests;
