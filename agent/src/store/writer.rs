//! The single writer, with group commit: one thread owns the only read-write
//! connection, and each transaction takes every request queued, each in its own
//! savepoint (one that fails is rolled back alone). Invariant: a reply is sent only
//! after the [`durable`](super::durable) syncer has the transaction on disk. The
//! [`Tally`] is told of every transaction, so cached counts never outlive a commit.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use rusqlite::Connection;
use tokio::sync::{mpsc, oneshot};

use super::durable::{self, Batch, Durability};
use super::tally::Tally;
use super::StorageFailure;
use crate::sync::lock;

/// Most requests folded into one transaction.
const MAX_GROUP: usize = 4096;

/// A request that has run inside the transaction and waits for its commit.
pub(super) trait Pending: Send {
    fn finish(self: Box<Self>, commit: Result<(), StorageFailure>);
}

/// A request waiting to run.
trait Job: Send {
    /// Runs the request in its savepoint. The second value is set when the request's
    /// failure made SQLite roll back the whole transaction (it does so for a full disk
    /// and some I/O errors): then every request run so far in it has lost its changes.
    fn run(self: Box<Self>, conn: &Connection) -> (Box<dyn Pending>, Option<StorageFailure>);
    fn abort(self: Box<Self>, error: StorageFailure);
}

/// Turns a request's error into the storage error that explains a lost transaction.
pub trait StorageCause {
    fn storage_cause(&self) -> StorageFailure;
}

impl StorageCause for StorageFailure {
    fn storage_cause(&self) -> StorageFailure {
        self.clone()
    }
}

struct TypedJob<T, E, F> {
    work: F,
    reply: oneshot::Sender<Result<T, E>>,
}

struct TypedPending<T, E> {
    result: Result<T, E>,
    reply: oneshot::Sender<Result<T, E>>,
}

impl<T, E, F> Job for TypedJob<T, E, F>
where
    T: Send + 'static,
    E: From<StorageFailure> + StorageCause + Send + 'static,
    F: FnOnce(&Connection) -> Result<T, E> + Send + 'static,
{
    fn run(self: Box<Self>, conn: &Connection) -> (Box<dyn Pending>, Option<StorageFailure>) {
        let TypedJob { work, reply } = *self;
        let result = match execute_cached(conn, "SAVEPOINT request") {
            Err(e) => Err(E::from(StorageFailure::from(e))),
            Ok(()) => {
                let result = work(conn);
                if conn.is_autocommit() {
                    let cause = match &result {
                        Err(e) => e.storage_cause(),
                        Ok(_) => StorageFailure {
                            message: "the transaction ended inside a request".into(),
                            disk_full: false,
                        },
                    };
                    let pending = Box::new(TypedPending {
                        result: Err(E::from(cause.clone())),
                        reply,
                    });
                    return (pending, Some(cause));
                }
                let end = if result.is_ok() {
                    execute_cached(conn, "RELEASE request")
                } else {
                    execute_cached(conn, "ROLLBACK TO request")
                        .and_then(|()| execute_cached(conn, "RELEASE request"))
                };
                match end {
                    Ok(()) => result,
                    Err(e) => Err(E::from(StorageFailure::from(e))),
                }
            }
        };
        let pending = Box::new(TypedPending { result, reply });
        (pending, None)
    }

    fn abort(self: Box<Self>, error: StorageFailure) {
        let _ = self.reply.send(Err(E::from(error)));
    }
}

impl<T: Send, E: From<StorageFailure> + Send> Pending for TypedPending<T, E> {
    fn finish(self: Box<Self>, commit: Result<(), StorageFailure>) {
        let outcome = match commit {
            Ok(()) => self.result,
            Err(e) => Err(E::from(e)),
        };
        // The requester may have gone (client hung up); its change is committed anyway.
        let _ = self.reply.send(outcome);
    }
}

/// Handle to the writer thread.
pub struct Writer {
    queue: Mutex<Option<mpsc::UnboundedSender<Box<dyn Job>>>>,
    /// Requests sent but not yet taken into a transaction.
    queued: Arc<AtomicUsize>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Writer {
    /// Starts the writer thread on `conn`, which must be the only writer of the
    /// database at `db`, and its syncer. `on_commit` is told the size of every group
    /// made durable and how long it took from its start.
    pub fn start(
        db: &std::path::Path,
        conn: Connection,
        tally: Arc<Tally>,
        durability: Arc<Durability>,
        on_commit: impl Fn(usize, std::time::Duration) + Send + 'static,
    ) -> Writer {
        let (tx, rx) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let taken = queued.clone();
        let (syncer, sync_thread) = durable::start(db, durability.clone(), on_commit);
        let thread = std::thread::Builder::new()
            .name("opmon-store-writer".into())
            .spawn(move || {
                let conn = run(conn, rx, &taken, &tally, &durability, syncer);
                // Every reply is sent before the connection closes.
                let _ = sync_thread.join();
                if let Err((_, e)) = conn.close() {
                    tracing::error!(error = %e, "closing the database");
                }
            })
            .expect("spawning the store writer thread");
        Writer {
            queue: Mutex::new(Some(tx)),
            queued,
            thread: Mutex::new(Some(thread)),
        }
    }

    /// Runs `work` in the next group transaction, in a savepoint of its own; resolves
    /// once that transaction is on disk (with `work`'s result) or has failed (with the
    /// commit's error).
    pub async fn write<T, E, F>(&self, work: F) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<StorageFailure> + StorageCause + Send + 'static,
        F: FnOnce(&Connection) -> Result<T, E> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let job: Box<dyn Job> = Box::new(TypedJob { work, reply });
        // Counted and sent under the queue's lock, which `queued` takes too: a count
        // read there is of requests the writer can take.
        let sent = match lock(&self.queue).as_ref() {
            Some(q) => {
                self.queued.fetch_add(1, Ordering::SeqCst);
                q.send(job).map_err(|_| {
                    self.queued.fetch_sub(1, Ordering::SeqCst);
                })
            }
            None => Err(()),
        };
        if sent.is_err() {
            return Err(E::from(StorageFailure::closed()));
        }
        answer
            .await
            .unwrap_or_else(|_| Err(E::from(StorageFailure::closed())))
    }

    /// Requests waiting for the next transaction.
    pub fn queued(&self) -> usize {
        let _queue = lock(&self.queue);
        self.queued.load(Ordering::SeqCst)
    }

    /// Stops accepting work, lets queued work commit, and waits for the thread to close
    /// the connection.
    pub fn close(&self) {
        lock(&self.queue).take();
        let thread = lock(&self.thread).take();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }
}

/// Runs one of the transaction's or savepoint's statements, prepared once (parsing
/// them for every request costs half as much again).
fn execute_cached(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(|_| ())
}

/// Opens the group transaction.
fn begin(conn: &Connection) -> Result<(), StorageFailure> {
    execute_cached(conn, "BEGIN IMMEDIATE").map_err(StorageFailure::from)
}

/// Has SQLite set `flag` whenever a row of `owners` changes on `conn`, by SQLite's own
/// hook (rusqlite's wrapper allocates the names on every row a sweep writes). `flag`
/// must stay alive until the hook is removed.
fn watch_owners(conn: &Connection, flag: &std::sync::atomic::AtomicBool) {
    use std::ffi::{c_char, c_int, c_void, CStr};
    unsafe extern "C" fn changed(
        flag: *mut c_void,
        _op: c_int,
        _db: *const c_char,
        table: *const c_char,
        _row: i64,
    ) {
        // SAFETY: SQLite passes the table's name as a NUL-terminated string, and `flag`
        // is the `AtomicBool` registered with the hook, alive while the hook is.
        let (table, flag) = unsafe {
            (
                CStr::from_ptr(table),
                &*(flag as *const std::sync::atomic::AtomicBool),
            )
        };
        if table.to_bytes() == b"owners" {
            flag.store(true, Ordering::Relaxed);
        }
    }
    // SAFETY: a valid connection, used on this thread only; `changed` matches the hook's
    // signature and its argument is `flag`, which the writer keeps until it removes the
    // hook before closing.
    unsafe {
        rusqlite::ffi::sqlite3_update_hook(
            conn.handle(),
            Some(changed),
            flag as *const std::sync::atomic::AtomicBool as *mut c_void,
        );
    }
}

/// The writer's group transaction: the requests run in it so far and their replies.
struct Group {
    open: Result<(), StorageFailure>,
    began: std::time::Instant,
    /// Requests run in the open transaction, waiting for its commit.
    pending: Vec<Box<dyn Pending>>,
    /// Replies already decided: of requests whose transaction was lost.
    replies: Vec<(Box<dyn Pending>, Result<(), StorageFailure>)>,
}

impl Group {
    fn begin(conn: &Connection, size: usize) -> Group {
        Group {
            open: begin(conn),
            began: std::time::Instant::now(),
            pending: Vec::with_capacity(size),
            replies: Vec::new(),
        }
    }

    /// Runs `job` in the open transaction. If its failure lost the transaction, the
    /// requests run in it so far are answered with that failure, and a fresh one opens.
    fn run(&mut self, conn: &Connection, job: Box<dyn Job>) {
        if let Err(e) = &self.open {
            return job.abort(e.clone());
        }
        let (done, lost) = job.run(conn);
        self.pending.push(done);
        if let Some(cause) = lost {
            self.replies
                .extend(self.pending.drain(..).map(|p| (p, Err(cause.clone()))));
            self.open = begin(conn);
        }
    }
}

/// The writer's loop. A group transaction takes every request queued and commits; the
/// syncer makes it durable and replies while the next group runs, so every fsync
/// covers all the groups committed during the one before.
fn run(
    conn: Connection,
    mut rx: mpsc::UnboundedReceiver<Box<dyn Job>>,
    queued: &AtomicUsize,
    tally: &Tally,
    durability: &Durability,
    syncer: std_mpsc::Sender<Batch>,
) -> Connection {
    // Whether the open transaction changed an `owners` row: the counts are sums over
    // that table alone.
    let owners_changed = std::sync::atomic::AtomicBool::new(false);
    watch_owners(&conn, &owners_changed);
    while let Some(first) = rx.blocking_recv() {
        // The group is what is queued now: requests that come while it runs wait for
        // the next one, so a steady stream does not hold a commit back.
        let mut jobs = vec![first];
        while jobs.len() < MAX_GROUP {
            match rx.try_recv() {
                Ok(job) => jobs.push(job),
                Err(_) => break,
            }
        }
        queued.fetch_sub(jobs.len(), Ordering::SeqCst);
        owners_changed.store(false, Ordering::Relaxed);
        let mut group = Group::begin(&conn, jobs.len());
        for job in jobs {
            group.run(&conn, job);
        }
        let Group {
            open,
            began,
            pending,
            mut replies,
        } = group;
        let commit = match open {
            Ok(()) => {
                // Counted before SQLite makes the commit visible: see `durable`.
                durability.begin_commit();
                let commit = execute_cached(&conn, "COMMIT").map_err(StorageFailure::from);
                if commit.is_err() && !conn.is_autocommit() {
                    let _ = conn.execute_batch("ROLLBACK");
                }
                commit
            }
            // No transaction is open: nothing ran since the last one was lost.
            Err(e) => Err(e),
        };
        let wrote = commit.is_ok();
        replies.extend(pending.into_iter().map(|p| (p, commit.clone())));
        tally.end(owners_changed.load(Ordering::Relaxed));
        let batch = Batch {
            seq: durability.begun(),
            wrote,
            began,
            replies,
        };
        if let Err(std_mpsc::SendError(batch)) = syncer.send(batch) {
            // The syncer is gone only if it panicked: nothing can be made durable.
            for (p, _) in batch.replies {
                p.finish(Err(StorageFailure::closed()));
            }
        }
    }
    // SAFETY: a valid connection; the hook goes before `owners_changed`, which it
    // points to, can be dropped.
    unsafe { rusqlite::ffi::sqlite3_update_hook(conn.handle(), None, std::ptr::null_mut()) };
    conn
}
