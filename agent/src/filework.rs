//! Threads of its own for finalize's file work (opening, rewriting and renaming
//! tarballs), so that file work never takes tokio's blocking threads, which database
//! reads need.
//!
//! Invariants:
//! - each job runs on a thread of its own, at most [`MAX_ADMITTED`] at once; one more is
//!   refused at once with a message saying so. No job waits behind another: a small
//!   finalize is not held up by large ones (the kernel shares the CPU between them, and
//!   what one rewrite may write is bounded by `max_decompressed_size`);
//! - every job has a deadline, counted from its submission: past it the caller gets an
//!   error, the job's stop flag is raised (a rewrite checks it every 64 KiB) and its
//!   temporary output is removed;
//! - [`FileWork::stop`] (shutdown) raises every job's stop flag and removes every
//!   temporary output still registered, even one whose thread is stuck in a system
//!   call; nothing waits for such a thread, and the process's exit ends it.

use std::collections::HashMap;
use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

use crate::confine::{remove_leftover, TempOutput};
use crate::error::Error;
use crate::sync::lock;

/// Jobs running at once; more are refused.
pub const MAX_ADMITTED: usize = 64;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// What a job sees: whether to stop, and where to register its temporary output.
#[derive(Clone)]
pub struct JobContext {
    stop: Arc<AtomicBool>,
    shared: Arc<Shared>,
    id: u64,
}

impl JobContext {
    /// Raised on the deadline or at shutdown.
    pub fn stop_flag(&self) -> &AtomicBool {
        &self.stop
    }

    /// Registers `temp` so shutdown removes it even if this job never returns.
    pub fn register(&self, temp: &TempOutput) {
        if let Ok(leftover) = temp.leftover() {
            lock(&self.shared.leftovers).insert(self.id, leftover);
        }
    }

    /// The temporary output was persisted or removed by its owner.
    pub fn unregister(&self) {
        lock(&self.shared.leftovers).remove(&self.id);
    }
}

struct Shared {
    stopping: AtomicBool,
    /// Stop flags of jobs admitted and not finished.
    running: Mutex<HashMap<u64, Arc<AtomicBool>>>,
    leftovers: Mutex<HashMap<u64, (OwnedFd, OsString)>>,
}

/// The file work of the agent.
pub struct FileWork {
    admission: Arc<Semaphore>,
    shared: Arc<Shared>,
    next_id: AtomicU64,
}

impl FileWork {
    pub fn start() -> FileWork {
        FileWork {
            admission: Arc::new(Semaphore::new(MAX_ADMITTED)),
            shared: Arc::new(Shared {
                stopping: AtomicBool::new(false),
                running: Mutex::new(HashMap::new()),
                leftovers: Mutex::new(HashMap::new()),
            }),
            next_id: AtomicU64::new(0),
        }
    }

    /// Runs `work` on a thread of its own and waits for it, at most `deadline` (`what`
    /// names it in the error).
    pub async fn run<T: Send + 'static>(
        &self,
        what: &str,
        deadline: Duration,
        work: impl FnOnce(&JobContext) -> Result<T, Error> + Send + 'static,
    ) -> Result<T, Error> {
        if self.shared.stopping.load(Ordering::SeqCst) {
            return Err(Error::Finalize("the agent is shutting down".into()));
        }
        let permit: OwnedSemaphorePermit =
            self.admission.clone().try_acquire_owned().map_err(|_| {
                Error::Finalize(format!(
                    "{MAX_ADMITTED} finalizes are running or waiting, the most the agent \
                     takes at once; try again later"
                ))
            })?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let ctx = JobContext {
            stop: Arc::new(AtomicBool::new(false)),
            shared: self.shared.clone(),
            id,
        };
        lock(&self.shared.running).insert(id, ctx.stop.clone());
        let (tx, rx) = oneshot::channel();
        let job_ctx = ctx.clone();
        let job: Job = Box::new(move || {
            let _permit = permit;
            let result = if job_ctx.stop.load(Ordering::SeqCst) {
                Err(Error::Finalize("stopped before it started".into()))
            } else {
                work(&job_ctx)
            };
            job_ctx.unregister();
            lock(&job_ctx.shared.running).remove(&job_ctx.id);
            let _ = tx.send(result);
        });
        std::thread::Builder::new()
            .name(format!("opmon-file-{id}"))
            .spawn(job)
            .map_err(|e| {
                lock(&self.shared.running).remove(&id);
                Error::Finalize(format!("starting a thread for {what}: {e}"))
            })?;
        match tokio::time::timeout(deadline, rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(Error::Finalize(format!("{what} stopped unexpectedly"))),
            Err(_) => {
                ctx.stop.store(true, Ordering::SeqCst);
                self.remove_leftover(id);
                Err(Error::Finalize(format!(
                    "{what} did not finish within the finalize deadline ({})",
                    opmon_client::GoDuration(deadline)
                )))
            }
        }
    }

    fn remove_leftover(&self, id: u64) {
        let leftover = lock(&self.shared.leftovers).remove(&id);
        if let Some((dir, name)) = leftover {
            remove_leftover(&dir, &name);
        }
    }

    /// Shutdown: stops every job and removes every temporary output. New jobs are
    /// refused.
    pub fn stop(&self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        {
            let running = lock(&self.shared.running);
            for flag in running.values() {
                flag.store(true, Ordering::SeqCst);
            }
        }
        let leftovers: Vec<(OwnedFd, OsString)> = lock(&self.shared.leftovers)
            .drain()
            .map(|(_, v)| v)
            .collect();
        for (dir, name) in leftovers {
            remove_leftover(&dir, &name);
        }
    }

    /// Jobs running or waiting.
    pub fn admitted(&self) -> usize {
        MAX_ADMITTED - self.admission.available_permits()
    }
}
