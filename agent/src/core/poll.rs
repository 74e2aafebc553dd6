//! Polling: asking snapshotters for progress, deciding with the phase machine, calling
//! Cancel where a timeout passed, and committing the changes in batches.
//!
//! [`Poller`] owns what polling remembers between passes (the registry of snapshotters,
//! since when each unreachable one has been so, which sweeps are running); the core
//! drives it and commits what it decides. [`settle_owner`] is the one place an owner's
//! phase follows from its operations, after a poll and after `endInProgress`.
//!
//! The periodic sweep polls each snapshotter's operations in a task of its own, and a
//! snapshotter whose previous sweep is still running is skipped for that tick: a hung
//! snapshotter delays only its own operations. Changes commit per chunk, with the
//! owners they touch settled in the same transaction, so an owner's phase always
//! agrees with its operations.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write;
use std::sync::{Arc, Mutex};

use crate::log_limit::LogLimit;

use opmon_client::{EventReason, OperationPhase, OwnerRef};
use rusqlite::Connection;

use super::Core;
use crate::changes::Urgency;
use crate::clock::UnixMs;
use crate::error::Error;
use crate::metrics::Metrics;
use crate::phase::{self, Observation, OperationState};
use crate::rate::Rate;
use crate::remote::{CallError, CallSettings, Registry, Remote};
use crate::store::events::{self, NewEvent};
use crate::store::queries::{self, OwnerRow, PollTarget, Targets};
use crate::sync::lock;
use std::time::Duration;

/// Operations polled and committed together in one sweep step; bounds the memory a
/// sweep holds and the size of one transaction.
const SWEEP_CHUNK: usize = 4096;
/// Most owner-object bytes sent in one Progress call (a JSON-RPC batch repeats the
/// owner's object in each request). With the default batch of 256 and objects of 64 KiB
/// a batch would pass 16 MiB, the SDK server's default request limit, and be refused
/// whole; calls are split to stay under this instead. Small objects change nothing.
const MAX_OBJECT_BYTES_PER_CALL: usize = 4 << 20;

/// A decided change to one operation, waiting to be committed.
pub(super) struct OperationChange {
    pub target: PollTarget,
    pub next: OperationState,
    /// Which limit decided it, if one did (a deadline, a retry): what its event says.
    pub why: Option<phase::Why>,
    /// Its rate after this poll's sample (unchanged unless `nCompleted` moved).
    pub rate: Rate,
    /// Whether a deadline's Cancel, sent before this change is committed, was
    /// confirmed by the snapshotter; `None` if none was sent.
    pub cancel_confirmed: Option<bool>,
}

/// What Cancel calls came to, by row.
#[derive(Debug, Default)]
pub struct Cancels {
    /// Answered without an error within the deadline.
    pub confirmed: HashSet<i64>,
    /// Not sent, with their plugin: no snapshotter is registered for it.
    pub not_sent: HashMap<i64, String>,
}

/// A Progress or Cancel call names the target's own plugin, ID and owner.
impl crate::remote::Call for PollTarget {
    fn plugin(&self) -> &opmon_client::PluginRef {
        &self.plugin
    }
    fn operation_id(&self) -> &str {
        &self.operation_id
    }
    fn owner(&self) -> &Arc<OwnerRef> {
        &self.owner
    }
}

/// Splits `targets` into runs whose owner objects add up to at most
/// [`MAX_OBJECT_BYTES_PER_CALL`] (at least one target each).
fn by_object_bytes(targets: &[PollTarget]) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, t) in targets.iter().enumerate() {
        if i > start && bytes + t.object_bytes > MAX_OBJECT_BYTES_PER_CALL {
            runs.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += t.object_bytes;
    }
    if start < targets.len() {
        runs.push(start..targets.len());
    }
    runs
}

/// Groups targets by the plugin (and so the snapshotter) that owns them.
fn by_plugin(targets: Vec<PollTarget>) -> BTreeMap<String, Vec<PollTarget>> {
    let mut groups: BTreeMap<String, Vec<PollTarget>> = BTreeMap::new();
    for t in targets {
        groups.entry(t.plugin.name.clone()).or_default().push(t);
    }
    groups
}

/// Writes the changes of still-unfinished operations; returns, per owner row touched,
/// how many of its operations newly failed.
pub(super) fn apply_changes(
    conn: &Connection,
    changes: &[OperationChange],
    now: UnixMs,
    ended: &mut Vec<Ended>,
) -> rusqlite::Result<HashMap<i64, u32>> {
    let mut touched: HashMap<i64, u32> = HashMap::new();
    // Changes come in runs of one owner: its count is kept here until the run ends (one
    // map entry per owner, not per operation: this is the sweep's hot path).
    let mut run: Option<(i64, u32)> = None;
    let mut updates = queries::OperationUpdates::new(conn);
    for c in changes {
        let phase_changed = c.next.phase != c.target.state.phase;
        if updates.write(c.target.row, &c.target.state, &c.next, &c.rate)? {
            if let Some(why) = c.why {
                log_limit(c, why);
            }
            if phase_changed && !c.next.phase.is_unfinished() {
                ended.push(Ended::of(c));
            }
            let owner = c.target.owner_row;
            let failed = match &mut run {
                Some((row, failed)) if *row == owner => failed,
                _ => {
                    if let Some((row, failed)) = run.take() {
                        *touched.entry(row).or_default() += failed;
                    }
                    &mut run.insert((owner, 0)).1
                }
            };
            if c.next.phase == OperationPhase::Failed {
                *failed += 1;
            }
            // Progress alone is no event: a phase change is, and so is what a limit
            // decided (a deadline, a retry scheduled or spent, a recovery).
            if phase_changed || c.why.is_some() {
                record_operation_change(conn, c, now)?;
            }
        }
    }
    if let Some((row, failed)) = run {
        *touched.entry(row).or_default() += failed;
    }
    Ok(touched)
}

/// Logs a retry a limit decided, once it is written (an ending is [`Ended`]'s).
fn log_limit(c: &OperationChange, why: phase::Why) {
    use phase::Why;
    let (t, next) = (&c.target, &c.next);
    match why {
        Why::RetryScheduled => {
            OPERATION_LINES.log(|| {
                tracing::info!(owner = %t.owner.name, plugin = %t.plugin.name,
                    operation = %t.operation_id, attempt = next.attempts,
                    reason = %next.last_error, next_attempt_ms = next.next_attempt_ms,
                    "transient error; retrying")
            });
        }
        Why::Recovered => {
            OPERATION_LINES.log(|| {
                tracing::info!(owner = %t.owner.name, plugin = %t.plugin.name,
                    operation = %t.operation_id, attempts = next.attempts,
                    "answered again after transient errors")
            });
        }
        _ => {}
    }
}

/// A polled operation that ended in a transaction: logged and counted once the
/// transaction has committed ([`Ended::report`]).
pub(super) struct Ended {
    owner: String,
    plugin: String,
    operation: String,
    reason: String,
    outcome: crate::metrics::Outcome,
    /// What failed it, for an outcome of `failed`.
    by: &'static str,
}

impl Ended {
    fn of(c: &OperationChange) -> Ended {
        use crate::metrics::Outcome;
        use phase::Why;
        let (t, next) = (&c.target, &c.next);
        let outcome = match (next.phase, c.why) {
            (OperationPhase::Completed, _) => Outcome::Completed,
            (OperationPhase::Canceled, _) => Outcome::Canceled,
            (_, Some(Why::Stalled)) => Outcome::Stalled,
            (_, Some(Why::TimedOut)) => Outcome::TimedOut,
            _ if next.error == phase::TIMED_OUT => Outcome::TimedOut,
            _ => Outcome::Failed,
        };
        let by = match c.why {
            Some(Why::NotStarted) => "not started",
            Some(Why::Unreachable) => "snapshotter unreachable",
            Some(Why::RetriesSpent) => "retries spent",
            _ => "snapshotter's report",
        };
        Ended {
            owner: t.owner.name.clone(),
            plugin: t.plugin.name.clone(),
            operation: t.operation_id.clone(),
            reason: next.error.clone(),
            outcome,
            by,
        }
    }

    /// Counts and logs the operations that ended: one line each, a WARN for each that
    /// did not complete, within a budget per plugin, outcome and cause (each owner's
    /// events keep every one).
    pub(super) fn report(ended: &[Ended], metrics: &Metrics) {
        use crate::metrics::Outcome;
        for e in ended {
            metrics.ended(&e.plugin, e.outcome);
            let (owner, plugin, operation, reason) = (&e.owner, &e.plugin, &e.operation, &e.reason);
            if e.outcome == Outcome::Completed {
                tracing::debug!(%owner, %plugin, %operation, "operation completed");
                continue;
            }
            OPERATION_LINES.log(|| match e.outcome {
                Outcome::Completed => {}
                Outcome::Stalled => {
                    tracing::warn!(%owner, %plugin, %operation, %reason, "operation stalled");
                }
                Outcome::TimedOut => {
                    tracing::warn!(%owner, %plugin, %operation, %reason, "operation timed out");
                }
                Outcome::Canceled => {
                    tracing::warn!(%owner, %plugin, %operation, %reason, "operation canceled");
                }
                Outcome::Failed => {
                    tracing::warn!(%owner, %plugin, %operation, %reason, by = e.by,
                        "operation failed");
                }
            });
        }
    }
}

/// The lines of operations retried, recovered or ended without completing (their
/// owners' events have them all).
static OPERATION_LINES: std::sync::LazyLock<LogLimit> =
    std::sync::LazyLock::new(|| LogLimit::new("operations retried, recovered or ended"));

/// Snapshotters' reachability changes.
static REACHABILITY: std::sync::LazyLock<LogLimit> =
    std::sync::LazyLock::new(|| LogLimit::new("snapshotters' reachability"));

/// The events of a polled operation's change: what a limit decided (a deadline passed,
/// a retry scheduled or spent, a recovery), and the phase change unless the limit's
/// event already says it (a failure).
fn record_operation_change(
    conn: &Connection,
    c: &OperationChange,
    now: UnixMs,
) -> rusqlite::Result<()> {
    use phase::Why;
    let next = &c.next;
    let record = |reason, message: &str| {
        let event = NewEvent::new(reason, None, message).about(c.target.row);
        events::record(conn, c.target.owner_row, &event, now)
    };
    let failed = next.phase == OperationPhase::Failed;
    match c.why {
        Some(Why::TimedOut | Why::Stalled | Why::NotStarted) => {
            record(EventReason::DeadlineExceeded, &next.error)?;
            if let Some(confirmed) = c.cancel_confirmed {
                let message = if confirmed {
                    "Cancel sent after the deadline; confirmed by the snapshotter"
                } else {
                    "Cancel sent after the deadline; not confirmed by the snapshotter \
                     within the call deadline"
                };
                record(EventReason::CancelSent, message)?;
            }
            return Ok(());
        }
        Some(Why::Unreachable) => return record(EventReason::OperationFailed, &next.error),
        Some(Why::RetriesSpent) => {
            let message = format!(
                "retries spent after {} attempts: {}",
                next.attempts, next.error
            );
            return record(EventReason::OperationFailed, &message);
        }
        Some(Why::RetryScheduled) => {
            let at = next
                .next_attempt_ms
                .map(phase::rfc3339_seconds)
                .unwrap_or_default();
            let message = format!(
                "attempt {} failed transiently: {}; next attempt at {at}",
                next.attempts, next.last_error
            );
            record(EventReason::Retrying, &message)?;
        }
        Some(Why::Recovered) => {
            let message = format!("answered again after {} transient errors", next.attempts);
            record(EventReason::Recovered, &message)?;
        }
        None => {}
    }
    if next.phase == c.target.state.phase {
        return Ok(());
    }
    if failed {
        let reason = if next.error == phase::TIMED_OUT {
            EventReason::DeadlineExceeded
        } else {
            EventReason::OperationFailed
        };
        return record(reason, &next.error);
    }
    let mut message = format!("{} → {}", c.target.state.phase, next.phase);
    if next.n_total > 0 {
        let _ = write!(
            message,
            " at {} of {} {}",
            next.n_completed, next.n_total, next.operation_units
        );
    }
    record(EventReason::OperationPhaseChanged, &message)
}

/// Why an owner is settled.
pub(super) enum Settle {
    /// A poll changed some of a waiting owner's operations.
    Poll,
    /// `endInProgress {failed: false}`, with the server's counts, after its poll, by
    /// `caller`.
    EndInProgress {
        errors: u32,
        warnings: u32,
        caller: Option<opmon_client::Caller>,
    },
}

/// Moves an owner on after its operations' changes were applied in this transaction
/// (`newly_failed` of them failed): counts those failures as errors, decides the phase,
/// fills in the post-operation items once nothing is unfinished, and marks the owner's
/// item-operations file due when it should be rewritten (it left InProgress or Waiting,
/// or an operation failed). Returns the owner as stored, and whether the file is due;
/// `None` if the owner is gone or not in a phase `how` settles.
pub(super) fn settle_owner(
    conn: &Connection,
    owner_row: i64,
    newly_failed: u32,
    how: Settle,
    now: UnixMs,
) -> rusqlite::Result<Option<(OwnerRow, bool)>> {
    // Read after the changes were applied, so its operation counts are current.
    let Some(mut row) = queries::owner_by_id(conn, owner_row)? else {
        return Ok(None); // deleted meanwhile
    };
    let was = row.owner.phase;
    let unfinished = row.unfinished();
    let o = &mut row.owner;
    let mut by = None;
    let due = match how {
        Settle::Poll => {
            if !o.phase.is_waiting() {
                return Ok(None);
            }
            o.errors = o.errors.saturating_add(newly_failed);
            o.phase = phase::after_poll(o.phase, o.finalize, o.errors, unfinished);
            newly_failed > 0 || !o.phase.is_waiting()
        }
        Settle::EndInProgress {
            errors,
            warnings,
            caller,
        } => {
            if o.phase != opmon_client::OwnerPhase::InProgress {
                return Ok(None);
            }
            // Operations fail while InProgress only by `*.cancel`; those failed before
            // this poll count as errors like those it failed.
            let failed_before = o.operations_failed.saturating_sub(u64::from(newly_failed));
            let failed_before = u32::try_from(failed_before).unwrap_or(u32::MAX);
            by = caller;
            o.errors = errors
                .saturating_add(newly_failed)
                .saturating_add(failed_before);
            o.warnings = warnings;
            o.phase = phase::leave_in_progress(o.finalize, false, o.errors, unfinished);
            true
        }
    };
    if unfinished == 0 && row.owner.post_operation_items.is_none() {
        row.owner.post_operation_items = Some(queries::post_operation_items(conn, row.id)?);
    }
    queries::update_owner(conn, &row, now)?;
    if due {
        queries::mark_records_due(conn, row.id)?;
    }
    if row.owner.phase != was {
        record_owner_phase(conn, &row, was, by, now)?;
    }
    Ok(Some((row, due)))
}

/// The event of an owner's phase change from `was` (by `caller`'s call, or by the
/// agent itself): its failure with the reason, or the change with the counts.
pub(super) fn record_owner_phase(
    conn: &Connection,
    row: &OwnerRow,
    was: opmon_client::OwnerPhase,
    caller: Option<opmon_client::Caller>,
    now: UnixMs,
) -> rusqlite::Result<()> {
    let o = &row.owner;
    let (reason, message) = if o.phase == opmon_client::OwnerPhase::Failed {
        (
            EventReason::Failed,
            format!(
                "{was} → {}: {}",
                o.phase,
                o.failure_reason.as_deref().unwrap_or("")
            ),
        )
    } else {
        (
            EventReason::PhaseChanged,
            format!(
                "{was} → {}: {} of {} operations completed, {} failed, {}",
                o.phase,
                o.operations_completed,
                o.operations_attempted,
                o.operations_failed,
                super::counted(o.errors, "error")
            ),
        )
    };
    events::record(conn, row.id, &NewEvent::new(reason, caller, &message), now)
}

/// What polling remembers between passes, and the calls it makes.
pub(super) struct Poller {
    /// Who owns which plugin's operations. The database is the record; this follows
    /// each commit.
    pub remotes: Registry,
    pub calls: CallSettings,
    /// How long a snapshotter may be unreachable before its operations fail, in ms.
    grace_ms: i64,
    /// Since when (Unix ms) each unreachable snapshotter, by plugin name, has been so.
    unreachable: Mutex<HashMap<String, UnixMs>>,
    /// Plugins whose sweep is still running; the next tick skips them.
    sweeping: Mutex<HashSet<String>>,
    metrics: Arc<Metrics>,
}

/// A plugin's sweep, running while this lives: dropped however the sweep ends (done,
/// failed, stopped, panicked), so a plugin is never left marked busy.
pub(super) struct SweepTurn<'a> {
    poller: &'a Poller,
    plugin: String,
}

impl Drop for SweepTurn<'_> {
    fn drop(&mut self) {
        lock(&self.poller.sweeping).remove(&self.plugin);
    }
}

impl Poller {
    pub fn new(
        calls: CallSettings,
        unreachable_grace: Duration,
        metrics: Arc<Metrics>,
        room: crate::caps::Cap,
    ) -> Poller {
        Poller {
            remotes: Registry::new(room),
            calls,
            grace_ms: crate::clock::millis(unreachable_grace),
            unreachable: Mutex::default(),
            sweeping: Mutex::default(),
            metrics,
        }
    }

    /// Marks `plugin`'s sweep running; `None` if the previous one still is.
    pub fn start_sweep(&self, plugin: &str) -> Option<SweepTurn<'_>> {
        lock(&self.sweeping)
            .insert(plugin.to_string())
            .then(|| SweepTurn {
                poller: self,
                plugin: plugin.to_string(),
            })
    }

    /// Polls `targets` once and returns what changed. Cancel has been called (and has
    /// answered or run out of time) for every change that needs it.
    pub async fn poll(
        &self,
        targets: Vec<PollTarget>,
        deadline: Option<tokio::time::Instant>,
    ) -> Vec<OperationChange> {
        let groups = by_plugin(targets);
        let polls = groups
            .into_iter()
            .map(|(plugin, group)| async move { self.poll_group(&plugin, group, deadline).await });
        futures::future::join_all(polls)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// Polls the operations of one plugin, its calls still unanswered at `deadline`
    /// counted as unreachable. Operations backing off after a transient error are left
    /// out until their next attempt is due.
    pub async fn poll_group(
        &self,
        plugin: &str,
        targets: Vec<PollTarget>,
        deadline: Option<tokio::time::Instant>,
    ) -> Vec<OperationChange> {
        let due = UnixMs::now().ms();
        let targets: Vec<PollTarget> = targets
            .into_iter()
            .filter(|t| t.state.next_attempt_ms.is_none_or(|at| at <= due))
            .collect();
        if targets.is_empty() {
            return Vec::new();
        }
        let policy = self.remotes.policy(plugin);
        let remote = self.remotes.get(plugin);
        let observations: Vec<Observation> = match remote.as_deref() {
            None => {
                let e = format!("no snapshotter is registered for plugin {plugin}");
                targets
                    .iter()
                    .map(|_| Observation::Error(e.clone()))
                    .collect()
            }
            Some(Remote::V1) => targets.iter().map(|_| Observation::V1Adapter).collect(),
            Some(Remote::Called(remote)) => {
                let began = std::time::Instant::now();
                // The remote bounds its own calls in flight; the runs only bound sizes.
                let runs = by_object_bytes(&targets);
                let mut answers = Vec::with_capacity(targets.len());
                futures::future::join_all(
                    runs.into_iter()
                        .map(|run| remote.progress(&targets[run], deadline)),
                )
                .await
                .into_iter()
                .for_each(|run| answers.extend(run));
                let errors = answers.iter().filter(|a| a.is_err()).count();
                self.metrics
                    .polled(plugin, answers.len(), errors, began.elapsed());
                let since = self.reachability(plugin, &answers);
                let grace_ms = self.grace_ms;
                answers
                    .into_iter()
                    .map(|answer| match answer {
                        Ok(p) => Observation::Progress(p),
                        Err(CallError::Answered(e)) => Observation::Error(e),
                        Err(CallError::Transient(e)) => Observation::Transient(e),
                        Err(CallError::Unreachable(error)) => Observation::Unreachable {
                            error,
                            since_ms: since.unwrap_or_else(UnixMs::now).ms(),
                            grace_ms,
                        },
                    })
                    .collect()
            }
        };
        let now = UnixMs::now();
        let mut changes = Vec::with_capacity(targets.len());
        let mut to_cancel = Vec::new();
        for (target, observation) in targets.into_iter().zip(observations) {
            let reported = match &observation {
                Observation::Progress(p) => p.updated,
                _ => None,
            };
            // The owner's own deadlines win over the snapshotter's.
            let limits = phase::Limits {
                timeout_ms: target.timeout_ms,
                stall_ms: target.stall_timeout_ms.or(policy.stall_ms),
                start_ms: target.start_timeout_ms.or(policy.start_ms),
                retry: policy.retry,
            };
            if let Some(d) = phase::observe_within(&target.state, observation, &limits, now.ms()) {
                if d.cancel {
                    to_cancel.push(target.clone());
                }
                // Only a sample that moved `nCompleted` moves the rate (the first one
                // anchors it).
                let rate = if d.next.n_completed != target.state.n_completed
                    || target.rate.anchor_ms.is_none()
                {
                    let at = crate::rate::sample_time(reported, now.ms());
                    target.rate.sample(d.next.n_completed, at, now.ms())
                } else {
                    target.rate
                };
                changes.push(OperationChange {
                    target,
                    next: d.next,
                    why: d.why,
                    rate,
                    cancel_confirmed: d.cancel.then_some(false),
                });
            }
        }
        if !to_cancel.is_empty() {
            let confirmed = self.cancel_each(&to_cancel).await.confirmed;
            for c in &mut changes {
                if c.cancel_confirmed.is_some() {
                    c.cancel_confirmed = Some(confirmed.contains(&c.target.row));
                }
            }
        }
        changes
    }

    /// Records whether `plugin`'s snapshotter answered anything; returns since when it
    /// has been unreachable, if it is.
    fn reachability<T>(&self, plugin: &str, answers: &[Result<T, CallError>]) -> Option<UnixMs> {
        let reached = answers
            .iter()
            .any(|a| !matches!(a, Err(CallError::Unreachable(_))));
        if !answers.is_empty() {
            self.metrics.reached(plugin, reached);
        }
        let mut unreachable = lock(&self.unreachable);
        if reached || answers.is_empty() {
            if unreachable.remove(plugin).is_some() {
                REACHABILITY
                    .log(|| tracing::info!(snapshotter = plugin, "snapshotter reachable again"));
            }
            None
        } else {
            let since = *unreachable.entry(plugin.to_string()).or_insert_with(|| {
                let error = answers
                    .iter()
                    .find_map(|a| a.as_ref().err())
                    // A snapshotter's message may be megabytes: log what would be stored.
                    .map(|e| phase::bounded(e.message().to_string(), phase::MAX_ERROR))
                    .unwrap_or_default();
                REACHABILITY.log(|| {
                    tracing::warn!(snapshotter = plugin, %error,
                        "snapshotter unreachable; its operations wait for the grace period")
                });
                UnixMs::now()
            });
            Some(since)
        }
    }

    /// Calls Cancel for each target: batched per snapshotter like Progress, every
    /// snapshotter at once, and over within one call deadline. Cancel is best effort:
    /// failures are logged, and calls still unanswered at the deadline are abandoned
    /// (and logged). Says which rows the snapshotters confirmed (answered Cancel
    /// without an error within the deadline) and which were not sent at all.
    pub async fn cancel_each(&self, targets: &[PollTarget]) -> Cancels {
        let deadline = tokio::time::Instant::now() + self.calls.deadline;
        let groups = by_plugin(targets.to_vec());
        let cancels = groups.into_iter().map(|(plugin, group)| async move {
            let rows: Vec<i64> = group.iter().map(|t| t.row).collect();
            let confirmed = self.cancel_group(&plugin, group, deadline).await;
            (plugin, rows, confirmed)
        });
        let mut cancels_made = Cancels::default();
        for (plugin, rows, confirmed) in futures::future::join_all(cancels).await {
            match confirmed {
                Some(confirmed) => cancels_made.confirmed.extend(confirmed),
                None => {
                    let not_sent = rows.into_iter().map(|r| (r, plugin.clone()));
                    cancels_made.not_sent.extend(not_sent);
                }
            }
        }
        cancels_made
    }

    /// Cancels the operations of one plugin until `deadline`; returns the rows
    /// confirmed, or `None` if no snapshotter is registered for it (nothing was sent).
    async fn cancel_group(
        &self,
        plugin: &str,
        targets: Vec<PollTarget>,
        deadline: tokio::time::Instant,
    ) -> Option<Vec<i64>> {
        let Some(remote) = self.remotes.get(plugin) else {
            // One line for the group, whatever its size: the operations are in the
            // owner's events and the debug lines.
            for t in &targets {
                tracing::debug!(owner = %t.owner.name, operation = %t.operation_id,
                    plugin, "cannot cancel: no snapshotter registered");
            }
            tracing::warn!(
                plugin,
                operations = targets.len(),
                "cannot cancel: no snapshotter registered"
            );
            return None;
        };
        let answers = match &*remote {
            // Nothing to call: a v1 operation has nothing running to stop.
            Remote::V1 => targets.iter().map(|_| Some(Ok(()))).collect(),
            Remote::Called(caller) => caller.cancel(&targets, deadline).await,
        };
        let mut abandoned = 0;
        let mut errors = 0;
        let mut first_error = None;
        let mut confirmed = Vec::new();
        for (t, answer) in targets.iter().zip(&answers) {
            match answer {
                Some(Ok(())) => confirmed.push(t.row),
                Some(Err(e)) => {
                    errors += 1;
                    let error = phase::bounded(e.message().to_string(), phase::MAX_ERROR);
                    tracing::debug!(owner = %t.owner.name, operation = %t.operation_id,
                        %error, "cancel failed");
                    first_error.get_or_insert((t, error));
                }
                None => {
                    abandoned += 1;
                    tracing::debug!(owner = %t.owner.name, operation = %t.operation_id,
                        "cancel abandoned");
                }
            }
        }
        // A snapshotter that is down fails every cancel of the group the same way: one
        // line names the count and the first, not one line per operation.
        if let Some((t, error)) = first_error {
            tracing::warn!(snapshotter = plugin, failed = errors, owner = %t.owner.name,
                operation = %t.operation_id, %error, "cancel failed");
        }
        if abandoned > 0 {
            tracing::warn!(snapshotter = plugin, abandoned, deadline = %opmon_client::GoDuration(self.calls.deadline),
                "cancel calls abandoned: no answer within the call deadline");
        }
        self.metrics
            .cancelled(plugin, answers.len(), errors + abandoned);
        Some(confirmed)
    }
}

impl Core {
    /// Writes the counts of operation and reachability lines not logged one by one yet,
    /// once the sweeps have stopped.
    pub fn write_log_counts(&self) {
        OPERATION_LINES.flush();
        REACHABILITY.flush();
    }

    /// Commits polled changes and settles the waiting owners they touched.
    pub(super) async fn commit_sweep(&self, changes: Vec<OperationChange>) -> Result<(), Error> {
        // Targets come grouped by owner, so consecutive runs gather each owner's rows.
        // An owner whose operations only progressed hears of it with the next progress
        // announcement; one with a phase change (its own may follow) at once.
        let mut changed: Vec<(Arc<OwnerRef>, Vec<i64>, Urgency)> = Vec::new();
        for c in &changes {
            let urgency = if c.next.phase != c.target.state.phase {
                Urgency::Now
            } else {
                Urgency::Progress
            };
            match changed.last_mut() {
                Some((owner, rows, u)) if Arc::ptr_eq(owner, &c.target.owner) => {
                    rows.push(c.target.row);
                    if urgency == Urgency::Now {
                        *u = Urgency::Now;
                    }
                }
                _ => changed.push((c.target.owner.clone(), vec![c.target.row], urgency)),
            }
        }
        let now = UnixMs::now();
        let commit = move |conn: &Connection| {
            let mut due = Vec::new();
            let mut ended = Vec::new();
            for (owner_row, failed) in apply_changes(conn, &changes, now, &mut ended)? {
                if let Some((row, true)) = settle_owner(conn, owner_row, failed, Settle::Poll, now)?
                {
                    due.push((row.owner.kind, row.owner.name));
                }
            }
            Ok::<_, Error>((due, ended))
        };
        let (due, ended) = self.store.write(commit).await?;
        Ended::report(&ended, &self.metrics);
        self.refresh_records(due).await;
        for (owner, rows, urgency) in changed {
            self.changes.notify(owner.kind, &owner.name, rows, urgency);
        }
        Ok(())
    }

    /// One periodic pass: starts a sweep task for each snapshotter not still busy.
    pub(super) async fn sweep(self: &Arc<Self>) {
        let plugins = match self
            .store
            .read(|conn| queries::plugins_waited_on(conn).map_err(Error::from))
            .await
        {
            Ok(plugins) => plugins,
            Err(e) => {
                tracing::warn!(error = %e, "finding operations to poll failed");
                return;
            }
        };
        for plugin in plugins {
            let core = self.clone();
            self.sweeps.spawn(async move {
                let Some(_turn) = core.poller.start_sweep(&plugin) else {
                    tracing::debug!(plugin, "previous sweep still running; skipped");
                    return;
                };
                tokio::select! {
                    _ = core.stopping.cancelled() => {}
                    result = core.sweep_plugin(&plugin) => {
                        if let Err(e) = result {
                            tracing::warn!(plugin, error = %e, "sweeping failed");
                        }
                    }
                }
            });
        }
    }

    /// Polls every unfinished operation of `plugin`'s waiting owners, a page at a time:
    /// memory is bounded by the page, whatever the number of operations.
    pub(super) async fn sweep_plugin(&self, plugin: &str) -> Result<(), Error> {
        let mut after = 0;
        loop {
            let name = plugin.to_string();
            let page = self
                .store
                .read(move |conn| {
                    let which = Targets::WaitingPage {
                        plugin: &name,
                        after,
                        limit: SWEEP_CHUNK as i64,
                    };
                    queries::poll_targets(conn, which).map_err(Error::from)
                })
                .await?;
            let Some(last) = page.last() else {
                return Ok(());
            };
            after = last.row;
            let full = page.len() == SWEEP_CHUNK;
            let changes = self.poller.poll_group(plugin, page, None).await;
            if !changes.is_empty() {
                self.commit_sweep(changes).await?;
            }
            if !full {
                return Ok(());
            }
        }
    }

    /// After an agent restart: nothing changes phase. InProgress owners keep accepting
    /// calls (their backup server may well be alive; a server that restarted says so with
    /// `server.started`), waiting owners are polled at once, Finalizing owners keep
    /// waiting for `finalize`. The file work a crash interrupted (marked item-operations
    /// files, recorded removals, temporary files) is finished in the background, so the
    /// agent answers at once.
    pub async fn recover(self: &Arc<Self>) -> Result<(), Error> {
        self.spawn_temp_cleanup();
        self.spawn_records_retry();
        self.spawn_expiry();
        self.resend_cancels();
        self.poll_now.notify_one();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opmon_client::{OwnerKind, PluginKind, PluginRef};

    fn target(object_bytes: usize) -> PollTarget {
        PollTarget {
            row: 1,
            owner_row: 1,
            owner: Arc::new(OwnerRef {
                kind: OwnerKind::Backup,
                name: "b".into(),
                uid: "u".into(),
                object: None,
            }),
            object_bytes,
            timeout_ms: 1,
            stall_timeout_ms: None,
            start_timeout_ms: None,
            plugin: Arc::new(PluginRef {
                kind: PluginKind::BackupItemAction,
                name: "a.io/b".into(),
            }),
            operation_id: "op".into(),
            state: OperationState::default(),
            rate: Rate::default(),
        }
    }

    #[test]
    fn calls_carry_at_most_4_mib_of_owner_objects_and_at_least_one_operation() {
        let none: Vec<PollTarget> = (0..1000).map(|_| target(0)).collect();
        assert_eq!(by_object_bytes(&none), vec![0..none.len()]);
        let big: Vec<PollTarget> = (0..300).map(|_| target(64 * 1024)).collect();
        let runs = by_object_bytes(&big);
        assert_eq!(runs.len(), 5);
        assert!(runs.iter().all(|r| r.len() <= 64), "{runs:?}");
        assert_eq!(runs.iter().map(|r| r.len()).sum::<usize>(), 300);
        let huge = [target(5 << 20), target(5 << 20), target(1)];
        assert_eq!(by_object_bytes(&huge), [0..1, 1..2, 2..3]);
        assert!(by_object_bytes(&[]).is_empty());
    }
}
