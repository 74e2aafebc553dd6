//! What a snapshotter that starts its own operations (a `copy.start` of its own) needs
//! to keep them across restarts and to run them as child processes: re-exported by
//! [`crate`].

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::future::Future;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The state file's name inside the state directory.
const STATE_FILE: &str = "operations.json";
/// The state file's format; a store refuses files of another version.
const STATE_VERSION: u32 = 1;

/// Why an [`OperationStore`] could not open or save its state.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Creating, locking, reading or writing a file of the state directory failed.
    #[error("{what} {}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Another process holds the state directory.
    #[error("{} is in use by another snapshotter", dir.display())]
    InUse {
        dir: PathBuf,
        #[source]
        source: nix::errno::Errno,
    },
    /// The state file is not a store's, or of another version.
    #[error("the state file {} is not valid", path.display())]
    Invalid {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// The state file has another format version.
    #[error("the state file {} has version {version}; this snapshotter reads version {STATE_VERSION}", path.display())]
    Version { path: PathBuf, version: u32 },
}

#[derive(Serialize, Deserialize)]
struct StateFile<T> {
    version: u32,
    operations: T,
}

/// A change of one record, applied to what is saved.
type Change<'a, R> = dyn Fn(&mut R) + Sync + 'a;

/// An operation that runs: how to stop it and wait for its end.
struct Running {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

struct Inner<R> {
    records: BTreeMap<String, R>,
    running: HashMap<String, Running>,
}

/// The operations a snapshotter started, each a record of its own type `R` under an
/// operation ID, kept in `<state dir>/operations.json` (replaced atomically, so a crash
/// leaves the old or the new contents) and, while one runs, the task that runs it.
///
/// The rules that make Progress answer for every operation after any restart: a record
/// is saved before its ID is handed out ([`insert`](Self::insert)) and when it ends
/// ([`finish`](Self::finish), on disk before in memory, so Progress never reports an
/// outcome a crash could take back); the state directory is locked for the process's
/// life, so a second snapshotter on it fails to open instead of overwriting records.
///
/// ```no_run
/// use std::sync::Arc;
/// use opmon_snapshotter::OperationStore;
///
/// #[derive(Clone, serde::Serialize, serde::Deserialize)]
/// struct Copy { disk: String, done: bool }
///
/// # async fn demo() -> Result<(), opmon_snapshotter::StoreError> {
/// let store = Arc::new(OperationStore::<Copy>::open("/var/lib/copier".as_ref())?);
/// let id = store.insert("copy", Copy { disk: "/vm/a.qcow2".into(), done: false }).await?;
/// store.launch(&id, {
///     let (store, id) = (store.clone(), id.clone());
///     move |_stopped| async move {
///         // … copy, until done or `_stopped` fires …
///         let _ = store.finish(&id, |c| c.done = true).await;
///     }
/// });
/// # Ok(()) }
/// ```
pub struct OperationStore<R> {
    dir: PathBuf,
    inner: Mutex<Inner<R>>,
    /// Serialises saves, so that the last write holds the latest state.
    save_turn: tokio::sync::Mutex<()>,
    _lock: nix::fcntl::Flock<File>,
}

impl<R: Clone + Serialize + DeserializeOwned + Send + 'static> OperationStore<R> {
    /// Opens the state in `dir` (created if missing), locking it for this process.
    ///
    /// # Errors
    /// [`StoreError::InUse`] if another process has it open; [`StoreError::Io`],
    /// [`StoreError::Invalid`] or [`StoreError::Version`] naming the file otherwise.
    ///
    /// ```no_run
    /// use opmon_snapshotter::OperationStore;
    /// # fn demo() -> Result<(), opmon_snapshotter::StoreError> {
    /// let store = OperationStore::<String>::open("/var/lib/copier".as_ref())?;
    /// # Ok(()) }
    /// ```
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let io_error = |what, path: &Path| {
            let path = path.to_path_buf();
            move |source| StoreError::Io { what, path, source }
        };
        std::fs::create_dir_all(dir).map_err(io_error("creating", dir))?;
        let dir = std::path::absolute(dir).map_err(io_error("resolving", dir))?;
        let lock_path = dir.join("lock");
        let lock_file = File::create(&lock_path).map_err(io_error("creating", &lock_path))?;
        let lock = nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusiveNonblock)
            .map_err(|(_, source)| StoreError::InUse {
                dir: dir.clone(),
                source,
            })?;
        let path = dir.join(STATE_FILE);
        let records = match std::fs::read(&path) {
            Ok(bytes) => {
                let state: StateFile<BTreeMap<String, R>> = serde_json::from_slice(&bytes)
                    .map_err(|source| StoreError::Invalid {
                        path: path.clone(),
                        source,
                    })?;
                if state.version != STATE_VERSION {
                    let version = state.version;
                    return Err(StoreError::Version { path, version });
                }
                state.operations
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(io_error("reading", &path)(e)),
        };
        Ok(OperationStore {
            dir,
            inner: Mutex::new(Inner {
                records,
                running: HashMap::new(),
            }),
            save_turn: tokio::sync::Mutex::new(()),
            _lock: lock,
        })
    }

    /// Only map updates happen under the lock, which cannot panic halfway: a poisoned
    /// lock still holds consistent data.
    fn lock(&self) -> MutexGuard<'_, Inner<R>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The record of operation `id`.
    ///
    /// ```no_run
    /// # fn demo(store: &opmon_snapshotter::OperationStore<String>) {
    /// let known = store.get("copy-1").is_some();
    /// # }
    /// ```
    pub fn get(&self, id: &str) -> Option<R> {
        self.lock().records.get(id).cloned()
    }

    /// Changes the record of `id` in memory only (progress, which a restart may lose).
    ///
    /// ```no_run
    /// # fn demo(store: &opmon_snapshotter::OperationStore<u64>) {
    /// store.update("copy-1", |bytes| *bytes += 4096);
    /// # }
    /// ```
    pub fn update(&self, id: &str, change: impl FnOnce(&mut R)) {
        if let Some(record) = self.lock().records.get_mut(id) {
            change(record);
        }
    }

    /// The IDs of the records that `pick` chooses: the ones that were running when the
    /// snapshotter last stopped, say, to start them again.
    ///
    /// ```no_run
    /// # fn demo(store: &opmon_snapshotter::OperationStore<bool>) {
    /// let unfinished = store.ids(|done| !done);
    /// # }
    /// ```
    pub fn ids(&self, pick: impl Fn(&R) -> bool) -> Vec<String> {
        let inner = self.lock();
        inner
            .records
            .iter()
            .filter(|(_, r)| pick(r))
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Records `record` under a new operation ID (`<prefix>-<hex>`) and saves it before
    /// returning the ID; if the save fails the record is dropped again.
    ///
    /// # Errors
    /// [`StoreError::Io`] if the state file could not be written.
    ///
    /// ```no_run
    /// # async fn demo(store: &opmon_snapshotter::OperationStore<String>) -> Result<(), opmon_snapshotter::StoreError> {
    /// let id = store.insert("copy", "/vm/a.qcow2".to_string()).await?;
    /// assert!(id.starts_with("copy-"));
    /// # Ok(()) }
    /// ```
    pub async fn insert(&self, prefix: &str, record: R) -> Result<String, StoreError> {
        let id = {
            let mut inner = self.lock();
            let mut n = opmon_client::time::OffsetDateTime::now_utc().unix_timestamp_nanos();
            let id = loop {
                let id = format!("{prefix}-{n:x}");
                if !inner.records.contains_key(&id) {
                    break id;
                }
                n += 1;
            };
            inner.records.insert(id.clone(), record);
            id
        };
        if let Err(e) = self.save(None).await {
            self.lock().records.remove(&id);
            return Err(e);
        }
        Ok(id)
    }

    /// Records how `id` ended: `change` is applied, and saved, and then applied in
    /// memory; its running entry is removed. If the save fails the record still
    /// changes in memory (the operation did end) and the error is returned.
    ///
    /// # Errors
    /// [`StoreError::Io`] if the state file could not be written.
    ///
    /// ```no_run
    /// # async fn demo(store: &opmon_snapshotter::OperationStore<bool>) {
    /// if let Err(e) = store.finish("copy-1", |done| *done = true).await {
    ///     eprintln!("copy-1: saving its outcome: {e}");
    /// }
    /// # }
    /// ```
    pub async fn finish(&self, id: &str, change: impl Fn(&mut R) + Sync) -> Result<(), StoreError> {
        let saved = self.save(Some((id, &change))).await;
        let mut inner = self.lock();
        inner.running.remove(id);
        if let Some(record) = inner.records.get_mut(id) {
            change(record);
        }
        saved
    }

    /// Writes every record, with `change` applied to one, atomically.
    async fn save(&self, change: Option<(&str, &Change<'_, R>)>) -> Result<(), StoreError> {
        let _turn = self.save_turn.lock().await;
        let mut records = self.lock().records.clone();
        if let Some((id, change)) = change {
            records.get_mut(id).into_iter().for_each(change);
        }
        let path = self.dir.join(STATE_FILE);
        let io_error = |source| StoreError::Io {
            what: "writing",
            path: path.clone(),
            source,
        };
        let json = serde_json::to_vec_pretty(&StateFile {
            version: STATE_VERSION,
            operations: records,
        })
        .map_err(|e| io_error(io::Error::other(e)))?;
        let dir = self.dir.clone();
        tokio::task::spawn_blocking(move || write_atomically(&dir, &json))
            .await
            .map_err(|e| io_error(io::Error::other(e)))?
            .map_err(io_error)
    }

    /// Runs operation `id` as the task `run` makes, and remembers how to stop it: `run`
    /// gets a receiver that fires when [`stop`](Self::stop) is called (and fails,
    /// without firing, when the store is dropped: a shutdown is not a cancel). The task
    /// should end with [`finish`](Self::finish).
    ///
    /// ```no_run
    /// # fn demo(store: std::sync::Arc<opmon_snapshotter::OperationStore<bool>>) {
    /// store.launch("copy-1", |stopped| async move {
    ///     let _ = stopped.await;
    /// });
    /// # }
    /// ```
    pub fn launch<F, T>(&self, id: &str, run: F)
    where
        F: FnOnce(oneshot::Receiver<()>) -> T,
        T: Future<Output = ()> + Send + 'static,
    {
        let (stop, stopped) = oneshot::channel();
        // Under the lock, so the task cannot finish (and remove its entry) before the
        // entry exists.
        let mut inner = self.lock();
        let task = tokio::spawn(run(stopped));
        inner.running.insert(id.to_string(), Running { stop, task });
    }

    /// Stops operation `id` if it runs and returns once its task has ended (with its
    /// [`finish`](Self::finish)); a finished or unknown operation is left alone. For
    /// [`crate::OperationHandler::cancel`].
    ///
    /// ```no_run
    /// # async fn demo(store: &opmon_snapshotter::OperationStore<bool>) {
    /// store.stop("copy-1").await;
    /// # }
    /// ```
    pub async fn stop(&self, id: &str) {
        let running = self.lock().running.remove(id);
        if let Some(running) = running {
            // It may have just finished by itself; then there is nothing to stop.
            let _ = running.stop.send(());
            let _ = running.task.await;
        }
    }
}

/// Replaces `dir/operations.json` with `bytes`: a temporary file, fsync, rename, fsync
/// of the directory. The store's lock and its save turn make this the only writer.
fn write_atomically(dir: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = dir.join(format!("{STATE_FILE}.tmp"));
    let mut file = File::create(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&tmp, dir.join(STATE_FILE))?;
    File::open(dir)?.sync_all()
}

/// Child processes that run an operation: they die with the snapshotter, and their
/// last error line is what the operation's error says.
pub mod child {
    use super::*;
    use tokio::process::Command;

    /// Makes the kernel kill the child if this process dies (even by SIGKILL), so that
    /// no orphan keeps working on an operation that the next start runs again.
    ///
    /// PR_SET_PDEATHSIG fires when the spawning *thread* exits: spawn from tokio's
    /// worker threads, which live as long as the runtime.
    ///
    /// ```no_run
    /// let mut command = tokio::process::Command::new("qemu-img");
    /// opmon_snapshotter::child::die_with_parent(&mut command);
    /// ```
    pub fn die_with_parent(command: &mut Command) {
        #[cfg(target_os = "linux")]
        {
            let parent = nix::unistd::getpid();
            // SAFETY: between fork and exec the closure makes only async-signal-safe
            // system calls (prctl, getppid) and allocates nothing.
            unsafe {
                command.pre_exec(move || {
                    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
                    // The parent may have died before prctl took effect.
                    if nix::unistd::getppid() != parent {
                        return Err(nix::errno::Errno::ESRCH.into());
                    }
                    Ok(())
                });
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = command;
    }

    /// The last non-empty line of `text`, trimmed.
    ///
    /// ```
    /// use opmon_snapshotter::child::last_line;
    /// assert_eq!(last_line("warming up\nFatal: disk full\n\n").as_deref(), Some("Fatal: disk full"));
    /// ```
    pub fn last_line(text: &str) -> Option<String> {
        text.lines()
            .map(str::trim)
            .rfind(|l| !l.is_empty())
            .map(str::to_string)
    }

    /// Reads `stream` (a child's stderr) to its end and returns its last non-empty
    /// line. Only the tail is kept, so a chatty process cannot make it grow without
    /// bound.
    ///
    /// ```no_run
    /// # async fn demo(mut child: tokio::process::Child) {
    /// let last = opmon_snapshotter::child::last_line_of(child.stderr.take()).await;
    /// # }
    /// ```
    pub async fn last_line_of(stream: Option<impl AsyncRead + Unpin>) -> Option<String> {
        const KEEP: usize = 64 * 1024;
        let mut stream = stream?;
        let mut tail = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    tail.extend_from_slice(&chunk[..n]);
                    if tail.len() > 2 * KEEP {
                        tail.drain(..tail.len() - KEEP);
                    }
                }
            }
        }
        last_line(&String::from_utf8_lossy(&tail))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[tokio::test]
    async fn records_survive_a_reopen_and_a_second_process_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = OperationStore::<u32>::open(dir.path()).unwrap();
        let id = store.insert("copy", 1).await.unwrap();
        assert!(id.starts_with("copy-"));
        assert!(matches!(
            OperationStore::<u32>::open(dir.path()),
            Err(StoreError::InUse { .. })
        ));
        store.update(&id, |n| *n = 5);
        store.finish(&id, |n| *n += 10).await.unwrap();
        assert_eq!(store.get(&id), Some(15));
        drop(store);
        let again = OperationStore::<u32>::open(dir.path()).unwrap();
        assert_eq!(again.get(&id), Some(15));
        assert_eq!(again.ids(|n| *n == 15), [id]);
    }

    #[tokio::test]
    async fn stop_ends_the_task_and_waits_for_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(OperationStore::<bool>::open(dir.path()).unwrap());
        let id = store.insert("job", false).await.unwrap();
        let (s, task_id) = (store.clone(), id.clone());
        store.launch(&id, |stopped| async move {
            if stopped.await.is_ok() {
                s.finish(&task_id, |stopped| *stopped = true).await.unwrap();
            }
        });
        store.stop(&id).await;
        assert_eq!(store.get(&id), Some(true));
        // Stopping what no longer runs does nothing.
        store.stop(&id).await;
    }

    #[test]
    fn a_state_file_of_another_version_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(STATE_FILE),
            r#"{"version":2,"operations":{}}"#,
        )
        .unwrap();
        let e = OperationStore::<u32>::open(dir.path()).err().unwrap();
        assert!(matches!(e, StoreError::Version { version: 2, .. }), "{e}");
        assert!(e.to_string().contains("operations.json"), "{e}");
    }
}
