//! Threads of its own for finalize's file work (opening, rewriting and renaming
//! tarballs), so that file work never takes tokio's blocking threads, which database
//! reads need.
//!
//! Invariants:
//! - work is [`FileWork::admit`]ted before it starts: at most [`crate::caps::FINALIZES`]
//!   over all peers, one more refused at once naming the limit; the charge is given back
//!   only once the work and all its threads have ended;
//! - each job runs on a thread of its own, so a small finalize never waits behind
//!   large ones;
//! - every job has a deadline from its submission: past it the caller gets an error,
//!   the job's stop flag is raised and its temporary output removed;
//! - [`FileWork::stop`] (shutdown) raises every stop flag and removes every temporary
//!   output still registered, without waiting for a thread stuck in a system call.

use std::collections::HashMap;
use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::caps::{Cap, Held};
use crate::confine::{remove_leftover, TempOutput};
use crate::error::Error;
use crate::sync::lock;

/// Work admitted: its charge, held until the work and every thread it started end.
#[derive(Clone, Debug)]
pub struct Admitted {
    _held: Arc<Held>,
}

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
    pub fn stop(&self) -> &AtomicBool {
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
    /// Cancelled with `stopping` raised: callers stop waiting for their jobs.
    stopped: tokio_util::sync::CancellationToken,
    /// Stop flags of jobs admitted and not finished.
    running: Mutex<HashMap<u64, Arc<AtomicBool>>>,
    leftovers: Mutex<HashMap<u64, (OwnedFd, OsString)>>,
}

/// The file work of the agent.
pub struct FileWork {
    admission: Cap,
    shared: Arc<Shared>,
    next_id: AtomicU64,
}

impl FileWork {
    /// File work of at most `total` finalizes at once.
    pub fn start(total: usize) -> FileWork {
        FileWork {
            admission: Cap::new("finalizes", total),
            shared: Arc::new(Shared {
                stopping: AtomicBool::new(false),
                stopped: tokio_util::sync::CancellationToken::new(),
                running: Mutex::new(HashMap::new()),
                leftovers: Mutex::new(HashMap::new()),
            }),
            next_id: AtomicU64::new(0),
        }
    }

    /// Admits a finalize, or refuses it naming the limit it is over.
    pub fn admit(&self) -> Result<Admitted, Error> {
        if self.shared.stopping.load(Ordering::SeqCst) {
            return Err(Error::Stopping);
        }
        let held = self.admission.take().map_err(Error::OverQuota)?;
        Ok(Admitted {
            _held: Arc::new(held),
        })
    }

    /// Runs `work` of `admitted` on a thread of its own and waits for it, at most
    /// `deadline` (`what` names it in the error).
    pub async fn run<T: Send + 'static>(
        &self,
        admitted: &Admitted,
        what: &str,
        deadline: Duration,
        work: impl FnOnce(&JobContext) -> Result<T, Error> + Send + 'static,
    ) -> Result<T, Error> {
        if self.shared.stopping.load(Ordering::SeqCst) {
            return Err(Error::Stopping);
        }
        let permit = admitted.clone();
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
        let finished = tokio::select! {
            finished = tokio::time::timeout(deadline, rx) => finished,
            // A job's thread may be stuck in a system call: shutdown does not wait for it.
            () = self.shared.stopped.cancelled() => return Err(Error::Stopping),
        };
        match finished {
            // Whatever work ends with once shutdown stopped it (its stop flag raised, its
            // temporary file removed) is no failure of the finalize: it is given up, and
            // a failure of its own is answered to the client's repeat.
            Ok(Ok(Err(_))) if self.shared.stopping.load(Ordering::SeqCst) => Err(Error::Stopping),
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
        self.shared.stopped.cancel();
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

    /// Finalizes admitted whose work or threads have not all ended.
    pub fn admitted(&self) -> usize {
        self.admission.held()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job past its deadline may still be running (stuck in a system call): its
    /// thread keeps its place, so peers cannot queue more by giving up on calls, and
    /// the cap counts threads that are really there.
    #[tokio::test]
    async fn a_job_past_its_deadline_keeps_its_charge_until_its_thread_ends() {
        let pool = FileWork::start(1);
        let admitted = pool.admit().unwrap();
        let (gate, stuck) = std::sync::mpsc::channel::<()>();
        let late = pool
            .run(
                &admitted,
                "a stuck job",
                Duration::from_millis(1),
                move |_| {
                    let _ = stuck.recv();
                    Ok(())
                },
            )
            .await
            .unwrap_err();
        assert!(late.to_string().contains("did not finish"), "{late}");
        drop(admitted);
        let refused = pool.admit().unwrap_err();
        assert_eq!(
            refused.to_string(),
            "1 of the 1 finalizes the agent holds at once for all its peers are held; try \
             again later"
        );
        drop(gate);
    }
}
