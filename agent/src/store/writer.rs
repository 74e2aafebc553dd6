//! The single writer, with group commit.
//!
//! One thread owns the only read-write connection. Requests queue up while a commit is
//! being made durable (fsync under `synchronous=FULL`); the next transaction takes all of
//! them at once, so concurrent requests share one fsync. Each request runs in its own
//! savepoint: one that fails is rolled back alone and does not spoil the others.
//! Invariant: a request's reply is sent only after the transaction holding its changes
//! has committed, so anything acknowledged survives a crash. The writer also tells the
//! [`Tally`] of every transaction it opens and ends, so `agent.status`'s cached counts
//! never outlive a commit.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use rusqlite::Connection;
use tokio::sync::{mpsc, oneshot};

use super::tally::Tally;
use super::StorageFailure;
use crate::sync::lock;

/// Most requests folded into one transaction.
const MAX_GROUP: usize = 4096;

/// A request that has run inside the transaction and waits for its commit.
trait Pending: Send {
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
        let result = match savepoint(conn, "SAVEPOINT request") {
            Err(e) => Err(E::from(StorageFailure::from(e))),
            Ok(()) => {
                let result = (self.work)(conn);
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
                        reply: self.reply,
                    });
                    return (pending, Some(cause));
                }
                let end = if result.is_ok() {
                    savepoint(conn, "RELEASE request")
                } else {
                    savepoint(conn, "ROLLBACK TO request")
                        .and_then(|()| savepoint(conn, "RELEASE request"))
                };
                match end {
                    Ok(()) => result,
                    Err(e) => Err(E::from(StorageFailure::from(e))),
                }
            }
        };
        let pending = Box::new(TypedPending {
            result,
            reply: self.reply,
        });
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
    /// Starts the writer thread on `conn`, which must be the database's only writer.
    pub fn start(
        conn: Connection,
        tally: Arc<Tally>,
        on_commit: impl Fn(usize, std::time::Duration) + Send + 'static,
    ) -> Writer {
        let (tx, rx) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let taken = queued.clone();
        let thread = std::thread::Builder::new()
            .name("opmon-store-writer".into())
            .spawn(move || run(conn, rx, &taken, &tally, on_commit))
            .expect("spawning the store writer thread");
        Writer {
            queue: Mutex::new(Some(tx)),
            queued,
            thread: Mutex::new(Some(thread)),
        }
    }

    /// Runs `work` in the next group transaction; resolves after that transaction has
    /// committed (with `work`'s result) or failed (with the commit's error).
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

/// Runs one of the request savepoint's statements, prepared once: parsed anew for every
/// request (`execute_batch`), they cost about 6,000 instructions of a one-row
/// `addOperations`, prepared once about 4,000.
fn savepoint(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(|_| ())
}

fn begin(conn: &Connection) -> Result<(), StorageFailure> {
    conn.execute_batch("BEGIN IMMEDIATE")
        .map_err(StorageFailure::from)
}

/// Has SQLite set `flag` whenever a row of `owners` changes on `conn`. The hook is
/// SQLite's own, registered directly: rusqlite's wrapper makes text of the database and
/// table names on every row change and calls a boxed closure, about 280 instructions per
/// operation a sweep writes; this compares the table's name in place, about 30. `flag`
/// must stay alive until the hook is removed. (A rollback calls no update hook, so a
/// connection dropped while unwinding cannot reach a `flag` already dropped.)
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

fn run(
    conn: Connection,
    mut rx: mpsc::UnboundedReceiver<Box<dyn Job>>,
    queued: &AtomicUsize,
    tally: &Tally,
    on_commit: impl Fn(usize, std::time::Duration),
) {
    // Whether the open transaction changed an `owners` row: the counts are sums over
    // that table alone. SQLite calls the hook for every row a statement or a trigger
    // changes, on this thread.
    let owners_changed = std::sync::atomic::AtomicBool::new(false);
    watch_owners(&conn, &owners_changed);
    while let Some(first) = rx.blocking_recv() {
        let mut group = vec![first];
        while group.len() < MAX_GROUP {
            match rx.try_recv() {
                Ok(job) => group.push(job),
                Err(_) => break,
            }
        }
        let size = group.len();
        queued.fetch_sub(size, Ordering::SeqCst);
        let mut jobs = group.into_iter();
        let mut pending: Vec<Box<dyn Pending>> = Vec::with_capacity(size);
        let began = std::time::Instant::now();
        owners_changed.store(false, Ordering::Relaxed);
        let mut open = begin(&conn);
        while let Some(job) = jobs.next() {
            if let Err(e) = &open {
                job.abort(e.clone());
                jobs.by_ref().for_each(|j| j.abort(e.clone()));
                break;
            }
            let (done, lost) = job.run(&conn);
            pending.push(done);
            if let Some(cause) = lost {
                // Everything run in this transaction is gone: say so to those requests
                // and go on with the rest in a fresh transaction.
                for p in pending.drain(..) {
                    p.finish(Err(cause.clone()));
                }
                open = begin(&conn);
            }
        }
        if open.is_err() {
            tally.end(owners_changed.load(Ordering::Relaxed));
            continue;
        }
        let commit = conn.execute_batch("COMMIT").map_err(StorageFailure::from);
        if commit.is_err() && !conn.is_autocommit() {
            let _ = conn.execute_batch("ROLLBACK");
        }
        tally.end(owners_changed.load(Ordering::Relaxed));
        if commit.is_ok() {
            on_commit(pending.len(), began.elapsed());
        }
        for p in pending {
            p.finish(commit.clone());
        }
    }
    // SAFETY: a valid connection; the hook goes before `owners_changed`, which it
    // points to, can be dropped.
    unsafe { rusqlite::ffi::sqlite3_update_hook(conn.handle(), None, std::ptr::null_mut()) };
    if let Err((_, e)) = conn.close() {
        tracing::error!(error = %e, "closing the database");
    }
}
