//! Commits made durable off the writer's thread: the writer commits with
//! `synchronous=NORMAL` and the syncer thread fsyncs the WAL once for every commit
//! since its last, then sends their replies, while the writer runs the next group.
//!
//! Invariants (what `synchronous=FULL` gave):
//! - a write's reply is sent only once the WAL holding its commit is on disk;
//! - a read returns only once every commit it may have seen is on disk
//!   ([`Durability::settle`]); the writer counts a commit as begun before SQLite makes
//!   it, so a reader that saw a commit finds it counted;
//! - after a failed fsync of the WAL nothing more is acknowledged and the agent stops
//!   (the kernel may have dropped the pages). A failed fsync in a checkpoint is not
//!   fatal: the WAL restarts only after a complete checkpoint, so nothing is lost.
//!
//! Checkpoints stay SQLite's own, on the writer's connection, so each completes before
//! the writer appends again and the WAL restarts from its start.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tokio::sync::{watch, Notify};

use super::writer::Pending;
use super::StorageFailure;

/// Sends SQLite's error log (`sqlite3_log`: I/O errors of checkpoints and recovery,
/// which no statement returns) to the agent's log. Must run before SQLite is first used
/// in the process; a later call changes nothing (SQLite refuses it).
pub fn log_sqlite_errors() {
    fn log(code: std::ffi::c_int, message: &str) {
        // The primary result code: SQLITE_IOERR 10, SQLITE_CORRUPT 11, SQLITE_FULL 13,
        // SQLITE_NOTICE 27, SQLITE_WARNING 28.
        match code & 0xff {
            10 | 11 | 13 => tracing::error!(code, "sqlite: {message}"),
            27 | 28 => tracing::info!(code, "sqlite: {message}"),
            _ => tracing::debug!(code, "sqlite: {message}"),
        }
    }
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: `config_log` must not race other SQLite calls; it runs once, before the
        // agent opens its first connection (`lib::run`), when no other thread uses SQLite.
        if let Err(e) = unsafe { rusqlite::trace::config_log(Some(log)) } {
            tracing::debug!(error = %e, "SQLite's error log is not forwarded");
        }
    });
}

/// Which commits are on disk.
#[derive(Clone, Default)]
struct Synced {
    /// Every commit up to this number is on disk.
    durable: u64,
    /// Set by a failed fsync, for good.
    failed: Option<StorageFailure>,
}

/// The commits the writer has begun and those the syncer has made durable.
pub struct Durability {
    /// The number of the last commit the writer has begun.
    begun: AtomicU64,
    synced: watch::Sender<Synced>,
    /// Told once `synced` holds a failure. [`lost`](Self::lost) waits on it rather than
    /// on `synced`, which changes at every sync and would wake its waiter each time.
    failing: Notify,
}

impl Default for Durability {
    fn default() -> Self {
        Durability {
            begun: AtomicU64::new(0),
            synced: watch::Sender::new(Synced::default()),
            failing: Notify::new(),
        }
    }
}

impl Durability {
    /// Counts a commit as begun, before SQLite is asked to make it.
    pub(super) fn begin_commit(&self) {
        self.begun.fetch_add(1, Ordering::SeqCst);
    }

    /// The number of the last commit begun.
    pub(super) fn begun(&self) -> u64 {
        self.begun.load(Ordering::SeqCst)
    }

    /// Waits until every commit begun so far is on disk: all that a read that has just
    /// ended may have seen. Fails once an fsync has failed.
    pub async fn settle(&self) -> Result<(), StorageFailure> {
        let need = self.begun();
        let done = |s: &Synced| s.durable >= need || s.failed.is_some();
        let outcome = |s: &Synced| match &s.failed {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        };
        {
            let now = self.synced.borrow();
            if done(&now) {
                return outcome(&now);
            }
        }
        let mut rx = self.synced.subscribe();
        // The sender lives as long as `self`, so the wait cannot fail.
        let settled = match rx.wait_for(done).await {
            Ok(s) => outcome(&s),
            Err(_) => Err(StorageFailure::closed()),
        };
        settled
    }

    /// Resolves when an fsync has failed, with why.
    pub async fn lost(&self) -> StorageFailure {
        loop {
            let told = self.failing.notified();
            tokio::pin!(told);
            // Registered before the check, so a failure stored after it still wakes us.
            told.as_mut().enable();
            if let Some(e) = self.failure() {
                return e;
            }
            told.await;
        }
    }

    /// The failure that stopped acknowledgements, if one did.
    pub fn failure(&self) -> Option<StorageFailure> {
        self.synced.borrow().failed.clone()
    }
}

/// What one group transaction hands the syncer.
pub(super) struct Batch {
    /// The number of the last commit begun when the group ended (its own, if it made
    /// one): its replies may tell of any commit up to it.
    pub seq: u64,
    /// The group committed changes, which must reach the disk before its replies.
    pub wrote: bool,
    /// When the group's transaction began.
    pub began: Instant,
    /// Each request's reply, with what became of the transaction that held it.
    pub replies: Vec<(Box<dyn Pending>, Result<(), StorageFailure>)>,
}

/// What the syncer does to the disk: the real one is [`Disk`]; tests fail it.
pub(super) trait Syncing {
    /// Makes everything written to the WAL so far durable.
    fn sync(&mut self) -> Result<(), StorageFailure>;
}

/// The database's WAL: `fdatasync` of the `-wal` file, opened once (the writer's
/// connection keeps the WAL while it lives).
pub(super) struct Disk {
    wal: PathBuf,
    file: Option<File>,
}

impl Disk {
    pub fn new(db: &Path) -> Disk {
        let mut wal = db.as_os_str().to_owned();
        wal.push("-wal");
        Disk {
            wal: PathBuf::from(wal),
            file: None,
        }
    }
}

impl Syncing for Disk {
    fn sync(&mut self) -> Result<(), StorageFailure> {
        let wal = &self.wal;
        let failed = |what: &str, e: std::io::Error| StorageFailure {
            message: format!(
                "{what} {} failed ({e}): what was committed since the last sync may not \
                 be on disk, so the agent acknowledges nothing more and stops; restarted, \
                 it goes on from what the disk holds",
                wal.display()
            ),
            disk_full: e.raw_os_error() == Some(nix::libc::ENOSPC),
        };
        if self.file.is_none() {
            self.file = Some(File::open(wal).map_err(|e| failed("opening", e))?);
        }
        match &self.file {
            Some(file) => file.sync_data().map_err(|e| failed("fsync of", e)),
            None => Ok(()),
        }
    }
}

/// The syncer's loop: takes every batch sent since its last round, makes them durable
/// with one `sync` when any wrote, marks them durable, then sends their replies. Ends
/// when the writer drops its sender.
pub(super) fn run(
    batches: mpsc::Receiver<Batch>,
    durability: &Durability,
    disk: &mut impl Syncing,
    on_commit: impl Fn(usize, Duration),
) {
    while let Ok(first) = batches.recv() {
        let mut round = vec![first];
        round.extend(batches.try_iter());
        let last = round.last().map_or(0, |b| b.seq);
        let wrote = round.iter().any(|b| b.wrote);
        let mut failed = durability.failure();
        if failed.is_none() && wrote {
            if let Err(e) = disk.sync() {
                tracing::error!(error = %e, "the database could not be made durable");
                failed = Some(e);
            }
        }
        match &failed {
            None => durability
                .synced
                .send_modify(|s| s.durable = s.durable.max(last)),
            Some(e) => {
                durability.synced.send_modify(|s| {
                    s.failed.get_or_insert_with(|| e.clone());
                });
                durability.failing.notify_waiters();
            }
        }
        for batch in round {
            if failed.is_none() && batch.wrote {
                let committed = batch.replies.iter().filter(|(_, c)| c.is_ok()).count();
                on_commit(committed, batch.began.elapsed());
            }
            for (pending, commit) in batch.replies {
                pending.finish(match &failed {
                    None => commit,
                    Some(e) => Err(e.clone()),
                });
            }
        }
    }
}

/// Starts the syncer of the database at `db`.
pub(super) fn start(
    db: &Path,
    durability: std::sync::Arc<Durability>,
    on_commit: impl Fn(usize, Duration) + Send + 'static,
) -> (mpsc::Sender<Batch>, std::thread::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel();
    let mut disk = Disk::new(db);
    let thread = std::thread::Builder::new()
        .name("opmon-store-sync".into())
        .spawn(move || run(rx, &durability, &mut disk, on_commit))
        .expect("spawning the store syncer thread");
    (tx, thread)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// A disk whose syncs succeed or fail as told, counting them.
    struct TestDisk {
        fail: bool,
        syncs: usize,
    }

    impl Syncing for TestDisk {
        fn sync(&mut self) -> Result<(), StorageFailure> {
            self.syncs += 1;
            if self.fail {
                return Err(StorageFailure {
                    message: "fsync of agent.db-wal failed (Input/output error)".into(),
                    disk_full: false,
                });
            }
            Ok(())
        }
    }

    /// A request's reply, sent to the test.
    struct Reply(mpsc::Sender<Result<(), StorageFailure>>);

    impl Pending for Reply {
        fn finish(self: Box<Self>, commit: Result<(), StorageFailure>) {
            let _ = self.0.send(commit);
        }
    }

    fn batch(
        seq: u64,
        wrote: bool,
        replies: usize,
    ) -> (Batch, mpsc::Receiver<Result<(), StorageFailure>>) {
        let (tx, rx) = mpsc::channel();
        let replies = (0..replies)
            .map(|_| (Box::new(Reply(tx.clone())) as Box<dyn Pending>, Ok(())))
            .collect();
        let batch = Batch {
            seq,
            wrote,
            began: Instant::now(),
            replies,
        };
        (batch, rx)
    }

    /// Runs the syncer over `batches` until they are all taken.
    fn sync_all(durability: &Durability, disk: &mut TestDisk, batches: Vec<Batch>) {
        let (tx, rx) = mpsc::channel();
        for b in batches {
            tx.send(b).unwrap();
        }
        drop(tx);
        run(rx, durability, disk, |_, _| {});
    }

    #[tokio::test]
    async fn a_read_waits_for_the_sync_of_every_commit_it_may_have_seen() {
        let durability = Arc::new(Durability::default());
        durability
            .settle()
            .await
            .expect("nothing begun: nothing to wait for");
        durability.begin_commit();
        durability.begin_commit();
        let mut settle = std::pin::pin!(durability.settle());
        assert!(futures::poll!(settle.as_mut()).is_pending());
        let mut disk = TestDisk {
            fail: false,
            syncs: 0,
        };
        // Commit 1 on disk: a read that may have seen commit 2 still waits.
        let (first, replies) = batch(1, true, 1);
        sync_all(&durability, &mut disk, vec![first]);
        assert!(replies.try_recv().unwrap().is_ok());
        assert!(futures::poll!(settle.as_mut()).is_pending());
        // A group that wrote nothing needs no sync; commit 2's batch does.
        let (nothing, _) = batch(1, false, 0);
        let (second, _) = batch(2, true, 1);
        sync_all(&durability, &mut disk, vec![nothing, second]);
        settle.await.expect("every commit begun is on disk");
        assert_eq!(disk.syncs, 2);
    }

    #[tokio::test]
    async fn after_a_failed_sync_nothing_more_is_acknowledged() {
        let durability = Durability::default();
        let mut disk = TestDisk {
            fail: true,
            syncs: 0,
        };
        durability.begin_commit();
        let (first, replies) = batch(1, true, 2);
        sync_all(&durability, &mut disk, vec![first]);
        for _ in 0..2 {
            let e = replies.try_recv().unwrap().unwrap_err();
            assert!(e.message.contains("fsync"), "{}", e.message);
        }
        assert!(durability.settle().await.is_err());
        assert!(durability.lost().await.message.contains("fsync"));
        // Later commits are not synced, and are answered with the first failure even
        // once the disk would take them.
        disk.fail = false;
        durability.begin_commit();
        let (second, replies) = batch(2, true, 1);
        sync_all(&durability, &mut disk, vec![second]);
        assert_eq!(disk.syncs, 1);
        assert!(replies.try_recv().unwrap().is_err());
        assert!(durability.settle().await.is_err());
    }
}
