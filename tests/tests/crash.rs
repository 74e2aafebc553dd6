//! End-to-end crash safety: rounds of 16 concurrent clients starting backups, adding
//! operations in batches and ending and finalizing backups, with the agent killed by
//! SIGKILL at a random moment of each round and restarted on the same state.
//!
//! After each kill: `PRAGMA integrity_check` is `ok`. After each restart: every
//! acknowledged `addOperations` is present whole; a batch in flight at the kill is
//! present whole or not at all (each batch has IDs of its own); nothing that was never
//! sent is present; the owners' phases are what was acknowledged (or what the request
//! in flight made of them): an agent restart changes no phase: InProgress stays
//! InProgress, Waiting* is polled at once and reaches Finalizing* once its operations
//! complete, Finalizing* and terminal phases are kept; and the owners of every earlier
//! round still have the phase and operations they were left with.
//!
//! `OPMON_CRASH_ROUNDS` (default 20) sets the number of rounds. Each round's seed is
//! fixed and printed; `OPMON_CRASH_SEED=S OPMON_CRASH_ROUNDS=1` replays a round's
//! workload and kill point on a fresh state (the interleaving of the clients is up to
//! the scheduler).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opmon_client::{
    ApiVersion, Client, FinalizeParams, ListParams, NewOperation, Owner, OwnerPhase, Snapshotter,
    WaitUntil,
};
use opmon_tests::{operation, Fixture, PLUGIN};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Registered as v1: its operations complete at their first poll.
const INSTANT: &str = "example.io/instant";
/// Never registered: its operations fail at their first poll.
const ORPHAN: &str = "example.io/orphan";
const CLIENTS: usize = 16;

/// One batch of `addOperations`, with IDs no other batch uses.
#[derive(Clone, Debug)]
struct Batch {
    ids: Vec<String>,
    acknowledged: bool,
}

/// A request that was sent and had no answer when the agent died.
#[derive(Clone, Debug, PartialEq)]
enum InFlight {
    Start,
    Add,
    End { failed: bool },
    Finalize,
}

/// What one client did to one backup, as far as it knows.
#[derive(Clone, Debug)]
struct Log {
    name: String,
    started: bool,
    batches: Vec<Batch>,
    /// The phases acknowledged, in order (InProgress once `start` was).
    phases: Vec<OwnerPhase>,
    in_flight: Option<InFlight>,
    /// Operation IDs that complete only once their gate file exists.
    gates: Vec<String>,
}

/// A failure seen by a client while the agent was still alive.
type Unexpected = Arc<Mutex<Vec<String>>>;

/// Whether a call failed because the agent went away (not an answer from it).
fn agent_gone(e: &opmon_client::Error) -> bool {
    e.code().is_none()
}

struct ClientRun {
    client: usize,
    round: u32,
    seed: u64,
    logs: Arc<Mutex<Vec<Log>>>,
    acknowledged: Arc<AtomicU64>,
    killed: Arc<AtomicBool>,
    unexpected: Unexpected,
}

impl ClientRun {
    fn update(&self, f: impl FnOnce(&mut Log)) {
        let mut logs = self.logs.lock().unwrap();
        f(logs.last_mut().expect("a log"));
    }

    /// A failed call: the end of this client if the agent died, else a finding.
    fn failed(&self, what: &str, e: &opmon_client::Error) {
        if !agent_gone(e) || !self.killed.load(Ordering::SeqCst) {
            self.unexpected
                .lock()
                .unwrap()
                .push(format!("client {}: {what}: {e}", self.client));
        }
    }

    /// Runs backups until the agent dies.
    async fn run(self, socket: std::path::PathBuf) {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let client = match Client::connect(&socket).await {
            Ok(c) => c,
            Err(e) => return self.failed("connect", &e),
        };
        let backups = client.backups();
        for k in 0.. {
            let name = format!("r{}-c{}-b{k}", self.round, self.client);
            self.logs.lock().unwrap().push(Log {
                name: name.clone(),
                started: false,
                batches: Vec::new(),
                phases: Vec::new(),
                in_flight: Some(InFlight::Start),
                gates: Vec::new(),
            });
            if let Err(e) = backups.start(&name, &format!("uid-{name}")).await {
                return self.failed(&format!("start {name}"), &e);
            }
            self.acknowledged.fetch_add(1, Ordering::SeqCst);
            self.update(|l| {
                l.started = true;
                l.phases.push(OwnerPhase::InProgress);
                l.in_flight = None;
            });
            // The kind of backup: its operations complete at once (v1), some fail
            // (no snapshotter), or they wait for their gates (SDK snapshotter).
            let style = rng.random_range(0..10);
            for n in 0..rng.random_range(1..=4) {
                let size = if style >= 8 {
                    rng.random_range(1..=5)
                } else {
                    rng.random_range(1..=50)
                };
                let mut ops: Vec<NewOperation> = Vec::with_capacity(size);
                let mut gates = Vec::new();
                for j in 0..size {
                    let suffix = format!("r{}c{}b{k}n{n}-{j}", self.round, self.client);
                    let op = match style {
                        0..=4 => operation(INSTANT, &format!("i-{suffix}"), "data", &[]),
                        5..=7 if j % 7 == 3 => {
                            operation(ORPHAN, &format!("o-{suffix}"), "data", &[])
                        }
                        5..=7 => operation(INSTANT, &format!("i-{suffix}"), "data", &[]),
                        _ if j % 2 == 0 => {
                            let id = format!("gate-{suffix}");
                            gates.push(id.clone());
                            operation(PLUGIN, &id, "data", &["vsb"])
                        }
                        _ => operation(PLUGIN, &format!("done-{suffix}"), "data", &[]),
                    };
                    ops.push(op);
                }
                let ids: Vec<String> = ops.iter().map(|o| o.operation_id.clone()).collect();
                let count = ids.len() as u64;
                self.update(|l| {
                    l.batches.push(Batch {
                        ids,
                        acknowledged: false,
                    });
                    l.gates.extend(gates);
                    l.in_flight = Some(InFlight::Add);
                });
                match backups.add_operations(&name, ops).await {
                    Ok(r) => {
                        self.acknowledged.fetch_add(1, Ordering::SeqCst);
                        if r.added != count || r.already_known != 0 {
                            self.unexpected.lock().unwrap().push(format!(
                                "{name}: a batch of {count} new operations was answered {r:?}"
                            ));
                        }
                        self.update(|l| {
                            l.batches.last_mut().unwrap().acknowledged = true;
                            l.in_flight = None;
                        });
                    }
                    Err(e) => return self.failed(&format!("addOperations {name}"), &e),
                }
            }
            // Most backups are ended, some left InProgress; a few fail outright.
            if rng.random_bool(0.35) {
                continue;
            }
            let failed = rng.random_bool(0.1);
            self.update(|l| l.in_flight = Some(InFlight::End { failed }));
            let owner = match backups
                .request::<opmon_client::methods::EndInProgress>(
                    opmon_client::EndInProgressParams {
                        name: name.to_string(),
                        failed,
                        ..Default::default()
                    },
                )
                .await
            {
                Ok(o) => o,
                Err(e) => return self.failed(&format!("endInProgress {name}"), &e),
            };
            self.acknowledged.fetch_add(1, Ordering::SeqCst);
            self.update(|l| {
                l.phases.push(owner.phase);
                l.in_flight = None;
            });
            if owner.phase.is_finalizing() && rng.random_bool(0.5) {
                self.update(|l| l.in_flight = Some(InFlight::Finalize));
                let params = FinalizeParams {
                    name: name.clone(),
                    contents: None,
                    updated_items: Vec::new(),
                    ..Default::default()
                };
                match backups
                    .request::<opmon_client::methods::Finalize>(params)
                    .await
                {
                    Ok(r) => {
                        self.acknowledged.fetch_add(1, Ordering::SeqCst);
                        self.update(|l| {
                            l.phases.push(r.owner.phase);
                            l.in_flight = None;
                        });
                    }
                    Err(e) => return self.failed(&format!("finalize {name}"), &e),
                }
            }
        }
    }
}

/// The phases an owner may be in right after the restart, given what was
/// acknowledged and what was in flight.
fn allowed_after_restart(log: &Log) -> BTreeSet<OwnerPhase> {
    use OwnerPhase::*;
    // An agent restart changes no phase. Waiting owners are polled at once, but their
    // gated operations are still unfinished, so they wait on.
    let last = *log.phases.last().expect("a started owner");
    let mut allowed: BTreeSet<OwnerPhase> = [last].into_iter().collect();
    match log.in_flight {
        Some(InFlight::End { failed: true }) => {
            allowed.insert(Failed);
        }
        Some(InFlight::End { failed: false }) => {
            allowed.extend([
                WaitingForPluginOperations,
                WaitingForPluginOperationsPartiallyFailed,
                Finalizing,
                FinalizingPartiallyFailed,
            ]);
        }
        Some(InFlight::Finalize) => {
            allowed.insert(match last {
                Finalizing => Completed,
                _ => PartiallyFailed,
            });
        }
        _ => {}
    }
    allowed
}

/// `PRAGMA integrity_check` of the agent's database, opened read-only.
fn integrity(db: &Path) -> String {
    let conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .unwrap_or_else(|e| panic!("opening {} read-only: {e}", db.display()));
    let rows: Vec<String> = conn
        .prepare("PRAGMA integrity_check")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    rows.join("; ")
}

/// Every backup, by name.
async fn all_backups(client: &Client) -> BTreeMap<String, Owner> {
    let mut all = BTreeMap::new();
    let mut after = None;
    loop {
        let page = client
            .backups()
            .request::<opmon_client::methods::List>(ListParams {
                phases: None,
                limit: Some(1000),
                after: after.clone(),
            })
            .await
            .expect("listing backups");
        for o in page.items {
            all.insert(o.name.clone(), o);
        }
        match page.next {
            Some(n) => after = Some(n),
            None => return all,
        }
    }
}

fn rounds() -> u32 {
    std::env::var("OPMON_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_work_survives_sigkill_at_random_moments() {
    let started = Instant::now();
    let mut f = Fixture::new(&[]).await;
    {
        let client = f.agent.client().await;
        client
            .register_snapshotter(Snapshotter {
                name: INSTANT.into(),
                api_version: ApiVersion::V1,
                socket: None,
                command: None,
                ..Default::default()
            })
            .await
            .expect("registering the v1 snapshotter");
    }
    let db = f.agent.state_dir.join("agent.db");
    let forced: Option<u64> = std::env::var("OPMON_CRASH_SEED")
        .ok()
        .map(|s| s.parse().expect("OPMON_CRASH_SEED is a number"));
    // Owners of finished rounds: the phase and operation count they were left with.
    let mut settled: BTreeMap<String, (OwnerPhase, u64)> = BTreeMap::new();
    let (mut sent_total, mut acked_total, mut in_flight_total) = (0usize, 0usize, 0usize);
    let mut in_flight_committed = 0usize;
    // Phase changes in flight at a kill: (sent, found committed after the restart).
    let mut phase_changes = (0usize, 0usize);

    for round in 0..rounds() {
        // Fixed per round, so every run replays the same workloads and kill points.
        let seed = forced.unwrap_or(0x6f70_6d6f_6e00 + round as u64);
        println!("crash round {round} seed {seed}");
        let mut rng = StdRng::seed_from_u64(seed);
        let kill_after = rng.random_range(5..=250u64);

        // The clients, until the kill.
        let acknowledged = Arc::new(AtomicU64::new(0));
        let killed = Arc::new(AtomicBool::new(false));
        let unexpected: Unexpected = Arc::default();
        let mut logs = Vec::new();
        let mut tasks = Vec::new();
        for c in 0..CLIENTS {
            let run = ClientRun {
                client: c,
                round,
                seed: rng.random(),
                logs: Arc::default(),
                acknowledged: acknowledged.clone(),
                killed: killed.clone(),
                unexpected: unexpected.clone(),
            };
            logs.push(run.logs.clone());
            tasks.push(tokio::spawn(run.run(f.agent.socket.clone())));
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while acknowledged.load(Ordering::SeqCst) < kill_after {
            assert!(
                Instant::now() < deadline,
                "round {round} (seed {seed}): only {} requests acknowledged in 60 s; {:?}",
                acknowledged.load(Ordering::SeqCst),
                unexpected.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        killed.store(true, Ordering::SeqCst);
        f.agent.kill9();
        // The client library would retry until its call timeout and carry on with
        // the restarted agent; this test is about the agent's state at the kill, so
        // the clients stop here, their in-flight request unanswered (the client's own
        // restart behaviour is tests/tests/client_restart.rs).
        for task in tasks {
            task.abort();
            if let Err(e) = task.await {
                assert!(e.is_cancelled(), "a client panicked: {e}");
            }
        }
        let unexpected = unexpected.lock().unwrap().clone();
        assert!(
            unexpected.is_empty(),
            "round {round} (seed {seed}): {unexpected:#?}"
        );

        // The database, with the agent dead.
        assert_eq!(
            integrity(&db),
            "ok",
            "round {round} (seed {seed}): integrity_check after SIGKILL"
        );

        f.agent.restart();
        let client = f.agent.client().await;
        let backups = client.backups();
        let logs: Vec<Log> = logs
            .iter()
            .flat_map(|l| l.lock().unwrap().clone())
            .collect();
        let context = |name: &str| format!("round {round} (seed {seed}), backup {name}");

        // What the restarted agent has, before anything else touches it.
        let mut waiting: Vec<(&Log, OwnerPhase)> = Vec::new();
        let mut in_progress: Vec<&Log> = Vec::new();
        for log in &logs {
            let owner = match backups.get(&log.name).await {
                Ok(o) => o,
                Err(e) if e.code() == Some(opmon_client::codes::NOT_FOUND) => {
                    assert!(
                        !log.started,
                        "{}: acknowledged start, gone after the restart",
                        context(&log.name)
                    );
                    continue;
                }
                Err(e) => panic!("{}: get: {e}", context(&log.name)),
            };
            if !log.started {
                // Created by the start in flight: committed before the kill. Nothing
                // else can have happened to it.
                assert_eq!(
                    owner.phase,
                    OwnerPhase::InProgress,
                    "{}",
                    context(&log.name)
                );
                assert_eq!(owner.failure_reason, None, "{}", context(&log.name));
                assert_eq!(owner.operations_attempted, 0, "{}", context(&log.name));
                in_progress.push(log);
                continue;
            }
            let operations = backups
                .operations(&log.name)
                .await
                .unwrap_or_else(|e| panic!("{}: operations: {e}", context(&log.name)));
            if owner.phase == OwnerPhase::Failed {
                // Only the server's `failed: true` fails an owner here, saying so.
                assert_eq!(
                    owner.failure_reason.as_deref(),
                    Some("the backup server ended InProgress with failed: true"),
                    "{}",
                    context(&log.name)
                );
                // Failed owners are not polled: nothing of theirs is left unfinished.
                let unfinished: Vec<_> = operations
                    .iter()
                    .filter(|o| o.phase.is_unfinished())
                    .map(|o| &o.operation_id)
                    .collect();
                assert!(
                    unfinished.is_empty(),
                    "{}: Failed, with unfinished operations {unfinished:?}",
                    context(&log.name)
                );
            }
            let present: BTreeSet<String> =
                operations.into_iter().map(|o| o.operation_id).collect();
            let mut sent = BTreeSet::new();
            for (i, batch) in log.batches.iter().enumerate() {
                sent_total += 1;
                let here = batch.ids.iter().filter(|id| present.contains(*id)).count();
                if batch.acknowledged {
                    acked_total += 1;
                    assert_eq!(
                        here,
                        batch.ids.len(),
                        "{}: acknowledged batch {i} lost {} of its {} operations",
                        context(&log.name),
                        batch.ids.len() - here,
                        batch.ids.len()
                    );
                } else {
                    in_flight_total += 1;
                    in_flight_committed += usize::from(here > 0);
                    assert!(
                        here == 0 || here == batch.ids.len(),
                        "{}: the batch in flight at the kill is half there: {here} of {}",
                        context(&log.name),
                        batch.ids.len()
                    );
                }
                sent.extend(batch.ids.iter().cloned());
            }
            let unknown: Vec<&String> = present.difference(&sent).collect();
            assert!(
                unknown.is_empty(),
                "{}: operations never sent: {unknown:?}",
                context(&log.name)
            );
            assert_eq!(owner.operations_attempted, present.len() as u64);
            match log.in_flight {
                Some(InFlight::End { .. }) => {
                    phase_changes.0 += 1;
                    phase_changes.1 += usize::from(owner.phase != OwnerPhase::InProgress);
                }
                Some(InFlight::Finalize) => {
                    phase_changes.0 += 1;
                    phase_changes.1 += usize::from(owner.phase.is_terminal());
                }
                _ => {}
            }
            let allowed = allowed_after_restart(log);
            assert!(
                allowed.contains(&owner.phase),
                "{}: {} after the restart; acknowledged {:?}, in flight {:?}, allowed {allowed:?}",
                context(&log.name),
                owner.phase,
                log.phases,
                log.in_flight
            );
            if owner.phase.is_waiting() {
                waiting.push((log, owner.phase));
            } else if owner.phase == OwnerPhase::InProgress {
                in_progress.push(log);
            } else {
                settled.insert(log.name.clone(), (owner.phase, present.len() as u64));
            }
        }

        // Waiting owners are polled after the restart: once their gates open they
        // reach the matching Finalizing phase.
        for (log, _) in &waiting {
            for gate in &log.gates {
                f.open_gate(gate);
            }
        }
        for (log, phase) in waiting {
            let owner = backups
                .wait(
                    &log.name,
                    WaitUntil::ReadyToFinalize,
                    Duration::from_secs(60),
                )
                .await
                .unwrap_or_else(|e| panic!("{}: wait: {e}", context(&log.name)))
                .owner;
            let want = match phase {
                OwnerPhase::WaitingForPluginOperations => OwnerPhase::Finalizing,
                _ => OwnerPhase::FinalizingPartiallyFailed,
            };
            assert_eq!(
                owner.phase,
                want,
                "{}: was {phase} after the restart",
                context(&log.name)
            );
            settled.insert(log.name.clone(), (owner.phase, owner.operations_attempted));
        }

        // The backup server goes on with what it had InProgress: the agent accepts it.
        for log in in_progress {
            for gate in &log.gates {
                f.open_gate(gate);
            }
            let owner = backups
                .end_in_progress(&log.name)
                .await
                .unwrap_or_else(|e| panic!("{}: endInProgress: {e}", context(&log.name)));
            assert!(
                owner.phase.is_finalizing(),
                "{}: {} after endInProgress with every gate open",
                context(&log.name),
                owner.phase
            );
            settled.insert(log.name.clone(), (owner.phase, owner.operations_attempted));
        }

        // Every earlier round's backups are as they were left.
        let now = all_backups(&client).await;
        for (name, (phase, count)) in &settled {
            let owner = now
                .get(name)
                .unwrap_or_else(|| panic!("round {round} (seed {seed}): {name} is gone"));
            assert_eq!(
                (owner.phase, owner.operations_attempted),
                (*phase, *count),
                "round {round} (seed {seed}): {name} changed"
            );
        }
        assert_eq!(
            now.len(),
            settled.len(),
            "round {round} (seed {seed}): backups nobody started"
        );
        println!(
            "crash round {round}: killed after {} acknowledged requests; {} backups this round",
            acknowledged.load(Ordering::SeqCst),
            logs.len()
        );
    }

    let status = f.agent.terminate();
    assert!(status.success(), "the agent stopped with {status}");
    assert_eq!(integrity(&db), "ok", "integrity_check after a clean stop");
    println!(
        "crash: {} rounds in {:?}; {sent_total} batches checked, {acked_total} acknowledged, {in_flight_total} in flight at a kill ({in_flight_committed} of them committed); \
         {} endInProgress/finalize in flight at a kill ({} committed); {} backups",
        rounds(),
        started.elapsed(),
        phase_changes.0,
        phase_changes.1,
        settled.len()
    );
}
