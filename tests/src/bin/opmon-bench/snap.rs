//! The snapshotter the agent polls: an SDK snapshotter (`serve_methods`) served from a
//! task of this process on a Unix socket of its own, so the agent talks to it across a
//! real socket and process boundary. It answers at once:
//!
//! - operations whose ID starts with `soak-` are InProgress at their first call and
//!   completed at their second;
//! - those starting with `steady-` answer the same InProgress progress every time
//!   (nothing changes, so nothing is committed: the `idle` scenario);
//! - those starting with `until-` are InProgress until [`Bench::finish`] names them,
//!   then completed (the `hint` scenario);
//! - every other operation never completes, and each answer carries a new `nCompleted`
//!   (a counter over all calls), so every poll changes the operation and is committed.
//!
//! For measuring one sweep, the snapshotter can *hold* calls (they wait until
//! released) and *mark* a call: the `n`-th answer after arming is recorded with the
//! operation it was for, so the bench can tell when that change is committed.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opmon_client::{ApiVersion, Client, OperationProgress, OperationRef, Snapshotter};
use opmon_snapshotter::{rpc_module, serve_methods, OperationHandler, SnapshotterError};
use time::OffsetDateTime;
use tokio::sync::{oneshot, watch, Notify};

/// The call marked by [`Bench::arm`]: which operation got which value, and when.
#[derive(Clone, Debug)]
pub struct Marked {
    pub owner: String,
    pub plugin_kind: String,
    pub plugin: String,
    pub operation_id: String,
    pub value: i64,
    pub at: Instant,
}

struct State {
    hold: watch::Sender<bool>,
    held: AtomicU64,
    answered: AtomicU64,
    /// The last `nCompleted` handed out.
    value: AtomicI64,
    /// The value whose call is recorded in `marked`.
    mark: AtomicI64,
    marked: Mutex<Option<Marked>>,
    reached: Notify,
    soak: Mutex<HashSet<String>>,
    /// `until-` operations that [`Bench::finish`] completed.
    finished: Mutex<HashSet<String>>,
}

struct Snap(Arc<State>);

fn started() -> OffsetDateTime {
    OffsetDateTime::UNIX_EPOCH + time::Duration::days(20_000)
}

impl OperationHandler for Snap {
    async fn progress(&self, op: OperationRef) -> Result<OperationProgress, SnapshotterError> {
        let s = &self.0;
        let mut hold = s.hold.subscribe();
        if *hold.borrow_and_update() {
            s.held.fetch_add(1, Ordering::SeqCst);
            let _ = hold.wait_for(|h| !*h).await;
            s.held.fetch_sub(1, Ordering::SeqCst);
        }
        let constant = |completed: bool| OperationProgress {
            completed,
            n_completed: if completed { 100 } else { 50 },
            n_total: 100,
            operation_units: "bytes".into(),
            description: if completed { "done" } else { "copying" }.into(),
            started: Some(started()),
            ..Default::default()
        };
        if op.operation_id.starts_with("steady-") {
            return Ok(constant(false));
        }
        if op.operation_id.starts_with("until-") {
            let done = s
                .finished
                .lock()
                .map(|f| f.contains(&op.operation_id))
                .unwrap_or(false);
            return Ok(constant(done));
        }
        if op.operation_id.starts_with("soak-") {
            // Seen before: completed now (and forgotten, so the set stays small).
            let seen = match s.soak.lock() {
                Ok(mut seen) => {
                    !seen.insert(op.operation_id.clone()) && seen.remove(&op.operation_id)
                }
                Err(_) => true,
            };
            return Ok(OperationProgress {
                completed: seen,
                n_completed: if seen { 100 } else { 50 },
                n_total: 100,
                operation_units: "bytes".into(),
                description: if seen { "done" } else { "copying" }.into(),
                started: Some(started()),
                ..Default::default()
            });
        }
        let value = s.value.fetch_add(1, Ordering::SeqCst) + 1;
        s.answered.fetch_add(1, Ordering::SeqCst);
        if value == s.mark.load(Ordering::SeqCst) {
            if let Ok(mut marked) = s.marked.lock() {
                *marked = Some(Marked {
                    owner: op.owner.name.clone(),
                    plugin_kind: op.plugin.kind.as_str().to_string(),
                    plugin: op.plugin.name.clone(),
                    operation_id: op.operation_id.clone(),
                    value,
                    at: Instant::now(),
                });
            }
            s.reached.notify_waiters();
        }
        Ok(OperationProgress {
            completed: false,
            err: None,
            n_completed: value,
            n_total: 1 << 40,
            operation_units: "bytes".into(),
            description: "copying".into(),
            started: Some(started()),
            updated: None,
        })
    }

    async fn cancel(&self, _op: OperationRef) -> Result<(), SnapshotterError> {
        Ok(())
    }
}

/// Handle to the running snapshotter; stops it when dropped.
pub struct Bench {
    state: Arc<State>,
    pub socket: PathBuf,
    stop: Option<oneshot::Sender<()>>,
}

impl Bench {
    /// Serves the snapshotter on `socket` and waits until it accepts connections.
    pub async fn start(socket: &Path) -> Result<Bench, String> {
        let state = Arc::new(State {
            hold: watch::channel(false).0,
            held: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            value: AtomicI64::new(0),
            mark: AtomicI64::new(-1),
            marked: Mutex::new(None),
            reached: Notify::new(),
            soak: Mutex::new(HashSet::new()),
            finished: Mutex::new(HashSet::new()),
        });
        let (stop, stopped) = oneshot::channel::<()>();
        let path = socket.to_path_buf();
        let snap = Snap(state.clone());
        tokio::spawn(async move {
            if let Err(e) = serve_methods(&path, rpc_module(snap), async {
                let _ = stopped.await;
            })
            .await
            {
                eprintln!("opmon-bench: the snapshotter stopped: {e}");
            }
        });
        let began = Instant::now();
        while std::os::unix::net::UnixStream::connect(socket).is_err() {
            if began.elapsed() > Duration::from_secs(10) {
                return Err(format!(
                    "the bench snapshotter did not serve {} within 10 s",
                    socket.display()
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(Bench {
            state,
            socket: socket.to_path_buf(),
            stop: Some(stop),
        })
    }

    /// Registers this snapshotter with the agent behind `client` as the one owning the
    /// operations of `plugin`.
    pub async fn register(&self, client: &Client, plugin: &str) -> Result<(), String> {
        client
            .register_snapshotter(Snapshotter {
                name: plugin.into(),
                api_version: ApiVersion::V2,
                socket: Some(self.socket.clone()),
                ..Default::default()
            })
            .await
            .map(drop)
            .map_err(|e| format!("snapshotter.register: {e}"))
    }

    /// Completes the `until-` operation `id`: its next Progress answer says so.
    pub fn finish(&self, id: &str) {
        if let Ok(mut finished) = self.state.finished.lock() {
            finished.insert(id.to_string());
        }
    }

    /// From now on calls wait until [`Bench::release`].
    pub fn hold(&self) {
        self.state.hold.send_replace(true);
    }

    pub fn release(&self) {
        self.state.hold.send_replace(false);
    }

    /// Calls waiting to be released.
    pub fn held(&self) -> u64 {
        self.state.held.load(Ordering::SeqCst)
    }

    /// Calls answered so far (not counting `soak-` operations).
    pub fn answered(&self) -> u64 {
        self.state.answered.load(Ordering::SeqCst)
    }

    /// Marks the `n`-th call answered from now on.
    pub fn arm(&self, n: u64) {
        if let Ok(mut marked) = self.state.marked.lock() {
            *marked = None;
        }
        let now = self.state.value.load(Ordering::SeqCst);
        self.state.mark.store(now + n as i64, Ordering::SeqCst);
    }

    /// Waits for the marked call (armed by [`Bench::arm`]).
    pub async fn wait_marked(&self, within: Duration) -> Result<Marked, String> {
        let deadline = Instant::now() + within;
        loop {
            let reached = self.state.reached.notified();
            if let Some(m) = self.state.marked.lock().ok().and_then(|m| m.clone()) {
                return Ok(m);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "the agent did not make the expected progress calls within {within:?} \
                     ({} answered so far)",
                    self.answered()
                ));
            }
            // Wake up now and then as well: the notification may precede `notified()`.
            let _ = tokio::time::timeout(left.min(Duration::from_millis(50)), reached).await;
        }
    }

    /// Waits until at least `n` calls are held.
    pub async fn wait_held(&self, n: u64, within: Duration) -> Result<(), String> {
        let began = Instant::now();
        while self.held() < n {
            if began.elapsed() > within {
                return Err(format!(
                    "the agent did not start polling within {within:?} ({} calls held)",
                    self.held()
                ));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        Ok(())
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        self.release();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
