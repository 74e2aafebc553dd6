//! Threads of its own for finalize's file work (opening, rewriting and renaming
//! tarballs), so that file work never takes tokio's blocking threads, which database
//! reads need.
//!
//! Invariants:
//! - work is [`FileWork::admit`]ted before it starts: at most [`crate::caps::FINALIZES`]
//!   over all peers; one more is refused at once with a message naming the limit. The
//!   charge is held by the work and by each
//!   of its jobs' threads, so it is given back only once the work and its threads have
//!   all ended (success, failure, deadline, a caller gone, shutdown);
//! - each job runs on a thread of its own. No job waits behind another: a small
//!   finalize is not held up by large ones (what one rewrite may write is bounded by
//!   `max_decompressed_size`);
//! - the CPU is shared among uids, not among jobs ([`Turns`]): a job's threads compute
//!   only while they hold one of as many turns as the machine runs threads at once,
//!   and give it back before they wait (for the disk, for another thread) and every
//!   chunk of work; a freed turn goes to the waiting uid that holds fewest. One peer's
//!   many finalizes take no more than another's one (root's and the agent's own are
//!   peers like the others here);
//! - every job has a deadline, counted from its submission: past it the caller gets an
//!   error, the job's stop flag is raised (a rewrite checks it every 64 KiB, a thread
//!   waiting for a turn stops waiting) and its temporary output is removed;
//! - [`FileWork::stop`] (shutdown) raises every job's stop flag and removes every
//!   temporary output still registered, even one whose thread is stuck in a system
//!   call; nothing waits for such a thread, and the process's exit ends it.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::Thread;
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
    uid: Option<u32>,
}

/// The CPU turns of file work, shared among peer uids: as many as the machine runs
/// threads at once. A freed turn goes to the uid that holds fewest among those waiting
/// (of uids holding as many, the one served longest ago), and among one uid's threads
/// to the first that asked.
pub struct Turns {
    state: Mutex<TurnState>,
}

struct TurnState {
    free: usize,
    /// Uids holding or waiting for turns (none once they do neither).
    peers: HashMap<Option<u32>, Peer>,
    /// Counts turns given, to order peers by when they were last served.
    given: u64,
}

#[derive(Default)]
struct Peer {
    held: usize,
    served: u64,
    waiting: VecDeque<Waiter>,
}

struct Waiter {
    thread: Thread,
    granted: Arc<AtomicBool>,
}

impl TurnState {
    fn give(&mut self, uid: Option<u32>) {
        self.free -= 1;
        self.given += 1;
        let peer = self.peers.entry(uid).or_default();
        peer.held += 1;
        peer.served = self.given;
    }

    /// Hands free turns to waiters, the uid holding fewest first.
    fn hand_out(&mut self) {
        while self.free > 0 {
            let next = self
                .peers
                .iter()
                .filter(|(_, p)| !p.waiting.is_empty())
                .min_by_key(|(_, p)| (p.held, p.served))
                .map(|(uid, _)| *uid);
            let Some(uid) = next else { return };
            self.give(uid);
            let waiter = self.peers.get_mut(&uid).and_then(|p| p.waiting.pop_front());
            if let Some(waiter) = waiter {
                waiter.granted.store(true, Ordering::SeqCst);
                waiter.thread.unpark();
            }
        }
    }

    fn forget_if_idle(&mut self, uid: Option<u32>) {
        if self
            .peers
            .get(&uid)
            .is_some_and(|p| p.held == 0 && p.waiting.is_empty())
        {
            self.peers.remove(&uid);
        }
    }
}

impl Turns {
    /// `count` turns (at least one).
    pub fn new(count: usize) -> Arc<Turns> {
        Arc::new(Turns {
            state: Mutex::new(TurnState {
                free: count.max(1),
                peers: HashMap::new(),
                given: 0,
            }),
        })
    }

    /// As many turns as the machine runs threads at once.
    pub fn of_machine() -> Arc<Turns> {
        Turns::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// Waits for a turn of `uid`; false once `stop` is raised (and [`Turns::wake`]
    /// called) before one came.
    fn take(&self, uid: Option<u32>, stop: &AtomicBool) -> bool {
        let granted = Arc::new(AtomicBool::new(false));
        {
            let mut state = lock(&self.state);
            if state.free > 0 {
                state.give(uid);
                return true;
            }
            state
                .peers
                .entry(uid)
                .or_default()
                .waiting
                .push_back(Waiter {
                    thread: std::thread::current(),
                    granted: granted.clone(),
                });
        }
        loop {
            if stop.load(Ordering::SeqCst) && !granted.load(Ordering::SeqCst) {
                let mut state = lock(&self.state);
                // Not granted meanwhile (that happens under the lock): still waiting.
                if !granted.load(Ordering::SeqCst) {
                    if let Some(peer) = state.peers.get_mut(&uid) {
                        peer.waiting.retain(|w| !Arc::ptr_eq(&w.granted, &granted));
                    }
                    state.forget_if_idle(uid);
                    return false;
                }
            }
            if granted.load(Ordering::SeqCst) {
                return true;
            }
            std::thread::park();
        }
    }

    fn give_back(&self, uid: Option<u32>) {
        let mut state = lock(&self.state);
        state.free += 1;
        if let Some(peer) = state.peers.get_mut(&uid) {
            peer.held = peer.held.saturating_sub(1);
        }
        state.forget_if_idle(uid);
        state.hand_out();
    }

    /// Wakes every waiting thread to look at its stop flag.
    fn wake(&self) {
        let state = lock(&self.state);
        for peer in state.peers.values() {
            for waiter in &peer.waiting {
                waiter.thread.unpark();
            }
        }
    }

    #[cfg(test)]
    fn waiting(&self) -> usize {
        let state = lock(&self.state);
        state.peers.values().map(|p| p.waiting.len()).sum()
    }
}

/// One thread's share of the CPU in a job: it computes only while [`Cpu::compute`] has
/// given it a turn, and gives it back ([`Cpu::pause`], or when dropped) before it waits.
pub struct Cpu {
    turns: Arc<Turns>,
    uid: Option<u32>,
    stop: Arc<AtomicBool>,
    holding: Cell<bool>,
}

impl Cpu {
    fn new(turns: Arc<Turns>, uid: Option<u32>, stop: Arc<AtomicBool>) -> Cpu {
        let holding = Cell::new(false);
        Cpu {
            turns,
            uid,
            stop,
            holding,
        }
    }

    /// A thread with turns of its own, as many as the machine has, shared with no one
    /// (tools and tests); `stop` ends its waits.
    pub fn alone(stop: Arc<AtomicBool>) -> Cpu {
        Cpu::new(Turns::of_machine(), None, stop)
    }

    /// Another thread of the same job.
    pub fn for_thread(&self) -> Cpu {
        Cpu::new(self.turns.clone(), self.uid, self.stop.clone())
    }

    /// Raised on the deadline or at shutdown.
    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Holds a turn from now on, waiting for one if need be; an error once the job is
    /// stopped.
    pub fn compute(&self) -> io::Result<()> {
        if !self.holding.get() && !self.turns.take(self.uid, &self.stop) {
            return Err(io::Error::other("stopped"));
        }
        self.holding.set(true);
        Ok(())
    }

    /// Gives the turn back: the thread is about to wait.
    pub fn pause(&self) {
        if self.holding.replace(false) {
            self.turns.give_back(self.uid);
        }
    }

    /// Gives the turn back and waits for the next: a peer waiting goes first.
    pub fn next_turn(&self) -> io::Result<()> {
        self.pause();
        self.compute()
    }
}

impl Drop for Cpu {
    fn drop(&mut self) {
        self.pause();
    }
}

type Job = Box<dyn FnOnce() + Send + 'static>;

/// What a job sees: whether to stop, its share of the CPU, and where to register its
/// temporary output.
#[derive(Clone)]
pub struct JobContext {
    stop: Arc<AtomicBool>,
    shared: Arc<Shared>,
    id: u64,
    uid: Option<u32>,
}

impl JobContext {
    /// The job thread's share of the CPU (its other threads take theirs from it).
    pub fn cpu(&self) -> Cpu {
        Cpu::new(self.shared.turns.clone(), self.uid, self.stop.clone())
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
    turns: Arc<Turns>,
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
                turns: Turns::of_machine(),
                running: Mutex::new(HashMap::new()),
                leftovers: Mutex::new(HashMap::new()),
            }),
            next_id: AtomicU64::new(0),
        }
    }

    /// Admits a finalize of peer `uid` (`None`: from within the agent), or refuses it
    /// naming the limit it is over.
    pub fn admit(&self, uid: Option<u32>) -> Result<Admitted, Error> {
        if self.shared.stopping.load(Ordering::SeqCst) {
            return Err(Error::Stopping);
        }
        let held = self.admission.take().map_err(Error::OverQuota)?;
        Ok(Admitted {
            _held: Arc::new(held),
            uid,
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
            uid: admitted.uid,
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
                self.shared.turns.wake();
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
        self.shared.turns.wake();
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

    /// One uid with many threads waiting does not keep another from the CPU: the next
    /// turn goes to the uid served longest ago, then the two alternate.
    #[test]
    fn a_freed_turn_goes_to_the_uid_that_waited_without_one() {
        let turns = Turns::new(1);
        let never = Arc::new(AtomicBool::new(false));
        assert!(turns.take(Some(1), &never));
        let order = Arc::new(Mutex::new(Vec::new()));
        let spawn = |uid: u32| {
            let (turns, never, order) = (turns.clone(), never.clone(), order.clone());
            std::thread::spawn(move || {
                assert!(turns.take(Some(uid), &never));
                lock(&order).push(uid);
                turns.give_back(Some(uid));
            })
        };
        let mut threads = Vec::new();
        for (n, uid) in [1, 1, 1, 2].into_iter().enumerate() {
            threads.push(spawn(uid));
            // Queued in this order before the next asks.
            while turns.waiting() <= n {
                std::thread::yield_now();
            }
        }
        turns.give_back(Some(1));
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(*lock(&order), vec![2, 1, 1, 1]);
    }

    /// A thread waiting for a turn gives up when its job is stopped.
    #[test]
    fn a_stopped_job_stops_waiting_for_a_turn() {
        let turns = Turns::new(1);
        let never = AtomicBool::new(false);
        assert!(turns.take(Some(1), &never));
        let stop = Arc::new(AtomicBool::new(false));
        let waiting = {
            let (turns, stop) = (turns.clone(), stop.clone());
            std::thread::spawn(move || !turns.take(Some(2), &stop))
        };
        while turns.waiting() == 0 {
            std::thread::yield_now();
        }
        stop.store(true, Ordering::SeqCst);
        turns.wake();
        assert!(waiting.join().unwrap(), "it gave up without a turn");
        assert_eq!(turns.waiting(), 0);
    }

    /// A job past its deadline may still be running (stuck in a system call): its
    /// thread keeps its place, so peers cannot queue more by giving up on calls, and
    /// the cap counts threads that are really there.
    #[tokio::test]
    async fn a_job_past_its_deadline_keeps_its_charge_until_its_thread_ends() {
        let pool = FileWork::start(1);
        let admitted = pool.admit(Some(70_000)).unwrap();
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
        let refused = pool.admit(Some(70_000)).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "1 of the 1 finalizes the agent holds at once for all its peers are held; try \
             again later"
        );
        drop(gate);
    }
}
