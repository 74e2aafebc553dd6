//! The phase machine: pure functions from facts to the next phase.
//!
//! Nothing here reads the clock, the database or a snapshotter; time comes in as
//! milliseconds since the Unix epoch. Every rule of docs/architecture.md's "Phases" section
//! lives in this file and is tested here, row by row.

use opmon_client::{GoDuration, OperationPhase, OperationProgress, OwnerKind, OwnerPhase};

/// The error an operation gets when its item operation timeout passes.
pub const TIMED_OUT: &str = "Asynchronous action timed out";

/// Largest stored `description` of an operation, in bytes.
pub const MAX_DESCRIPTION: usize = 4096;
/// Largest stored `error` of an operation (a snapshotter's `err` or error message).
pub const MAX_ERROR: usize = 4096;
/// Largest stored `operationUnits`.
pub const MAX_UNITS: usize = 64;

/// `text` cut to at most `limit` bytes, on a UTF-8 boundary, ending with a marker that
/// says how much was cut (`… [truncated 15000000 bytes]`). What a snapshotter reports is
/// stored, served and written into every result file: its size must have a bound. The
/// cut is a pure function of the text, so the same long text stored twice is equal and
/// an unchanged report costs no write.
pub fn bounded(text: String, limit: usize) -> String {
    if text.len() <= limit {
        return text;
    }
    // The marker's length depends on the number in it; the number is at most the
    // whole length, so size the marker for that.
    let marker_len = format!("… [truncated {} bytes]", text.len()).len();
    let mut keep = limit.saturating_sub(marker_len);
    while !text.is_char_boundary(keep) {
        keep -= 1;
    }
    let cut = text.len() - keep;
    format!("{}… [truncated {cut} bytes]", &text[..keep])
}

/// The failure reason of an owner the backup server ended with `failed: true`.
pub const FAILED_BY_SERVER: &str = "the backup server ended InProgress with failed: true";

/// The failure reason of an owner still InProgress when a new instance of its backup
/// server started: Velero's own words for it (`pkg/cmd/server/server.go`).
pub fn server_restarted_reason(kind: OwnerKind) -> String {
    format!(
        "found a {kind} with status \"{}\" during the server starting, mark it as \"{}\"",
        OwnerPhase::InProgress,
        OwnerPhase::Failed
    )
}

/// The failure reason of an owner left InProgress with no call from its server for
/// longer than `timeout` (`in_progress_idle_timeout`); `last_call` is RFC 3339.
pub fn idle_reason(last_call: &str, timeout: GoDuration) -> String {
    format!(
        "no call from the backup server since {last_call}, longer than \
         in_progress_idle_timeout ({timeout}): InProgress abandoned"
    )
}

/// The error of the unfinished operations of an owner that failed (Cancel is called).
pub fn cancelled_with(kind: OwnerKind) -> String {
    format!("canceled: the {kind} failed")
}

/// The reason `*.cancel` uses when the caller gives none.
pub const DEFAULT_CANCEL_REASON: &str = "canceled by request";

/// The error of an operation canceled on request, and the failure reason of an owner
/// canceled whole: what Velero's item-operations file shows, as it has no Canceled.
pub fn canceled_because(reason: &str) -> String {
    bounded(format!("canceled: {reason}"), MAX_ERROR)
}

/// Longest delay between two attempts after transient errors.
pub const MAX_BACKOFF_MS: i64 = 300_000;

/// How many transient errors an operation may meet, and for how long, before it fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryBudget {
    /// Transient errors retried per operation; 0: the first one fails it.
    pub attempts: u32,
    /// The delay before the first retry, doubled for each next one (at most
    /// [`MAX_BACKOFF_MS`]).
    pub backoff_ms: i64,
    /// How long a run of transient errors may last (from its first) before the operation
    /// fails.
    pub within_ms: i64,
}

impl RetryBudget {
    /// The budget of a snapshotter that sets none: 5 retries, from 1 s, within 10 min.
    pub const DEFAULT: RetryBudget = RetryBudget {
        attempts: 5,
        backoff_ms: 1_000,
        within_ms: 600_000,
    };

    /// The delay before attempt number `attempt` + 1, after `attempt` transient errors.
    pub fn backoff(&self, attempt: u32) -> i64 {
        let doublings = attempt.saturating_sub(1).min(32);
        self.backoff_ms
            .max(0)
            .saturating_mul(1_i64 << doublings)
            .min(MAX_BACKOFF_MS)
    }
}

impl Default for RetryBudget {
    fn default() -> Self {
        RetryBudget::DEFAULT
    }
}

/// What limits one operation besides its snapshotter's answers, all in ms.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// The item operation timeout, from `created`.
    pub timeout_ms: i64,
    /// Fail when progress has not changed for this long (`None` or 0: never).
    pub stall_ms: Option<i64>,
    /// Fail when still New this long after `created` (`None` or 0: never).
    pub start_ms: Option<i64>,
    pub retry: RetryBudget,
}

fn duration(ms: i64) -> GoDuration {
    GoDuration::from_millis(ms.max(0) as u64)
}

/// `ms` as RFC 3339 to the second, as the reasons show times.
pub fn rfc3339_seconds(ms: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp(ms.div_euclid(1000))
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| format!("{ms} ms after the epoch"))
}

fn is_bytes(units: &str) -> bool {
    matches!(units.to_ascii_lowercase().as_str(), "byte" | "bytes" | "b")
}

/// An amount of `units`: bytes in decimal units to one decimal (`8.4 GB`), anything
/// else as the number and the snapshotter's unit.
fn amount(n: i64, units: &str) -> String {
    if is_bytes(units) {
        const STEPS: [&str; 6] = ["kB", "MB", "GB", "TB", "PB", "EB"];
        let mut value = n as f64;
        if value.abs() < 1000.0 {
            return format!("{n} B");
        }
        let mut unit = "B";
        for step in STEPS {
            if value.abs() < 1000.0 {
                break;
            }
            value /= 1000.0;
            unit = step;
        }
        format!("{value:.1} {unit}")
    } else if units.is_empty() {
        n.to_string()
    } else {
        format!("{n} {units}")
    }
}

/// Why an operation whose progress stood still for `stall_ms` fails: what it last
/// reported and when the agent saw it change.
pub fn stall_reason(op: &OperationState, stall_ms: i64) -> String {
    let d = duration(stall_ms);
    let reported = op.n_completed != 0 || op.n_total != 0 || !op.description.is_empty();
    let reason = match op.progressed_ms {
        Some(at) if reported => {
            let units = op.operation_units.as_str();
            let last = if op.n_total == 0 {
                amount(op.n_completed, units)
            } else if is_bytes(units) {
                format!(
                    "{} of {}",
                    amount(op.n_completed, units),
                    amount(op.n_total, units)
                )
            } else {
                format!("{} of {}", op.n_completed, amount(op.n_total, units))
            };
            format!(
                "no progress for {d}: last {last} at {}",
                rfc3339_seconds(at)
            )
        }
        since => format!(
            "no progress for {d}: nothing reported since {}",
            rfc3339_seconds(since.unwrap_or(op.created_ms))
        ),
    };
    bounded(reason, MAX_ERROR)
}

/// Why an operation still New after `start_ms` fails.
pub fn not_started_reason(start_ms: i64) -> String {
    format!("not started after {}: still New", duration(start_ms))
}

/// What the agent knows about one operation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OperationState {
    pub phase: OperationPhase,
    pub error: String,
    pub n_completed: i64,
    pub n_total: i64,
    pub operation_units: String,
    pub description: String,
    pub created_ms: i64,
    pub started_ms: Option<i64>,
    /// When the operation last changed: the plugin's `updated` if it reported one with
    /// the change, else the agent's time.
    pub updated_ms: Option<i64>,
    /// The `updated` the plugin last reported (Velero's `Status.Updated`).
    pub plugin_updated_ms: Option<i64>,
    /// When the agent last saw progress (a change of counts, description, start or the
    /// plugin's `updated`), by its own clock; the stall deadline counts from it (from
    /// `created_ms` while unknown).
    pub progressed_ms: Option<i64>,
    /// Transient errors retried so far.
    pub attempts: u32,
    /// The last transient error.
    pub last_error: String,
    /// No Progress before this, after a transient error.
    pub next_attempt_ms: Option<i64>,
    /// When the current run of transient errors began; `None` after a good answer.
    pub retrying_since_ms: Option<i64>,
}

impl OperationState {
    /// A copy with `operation_units` and `description` left empty: the copy a Progress
    /// answer, which brings both, starts from (a sweep makes thousands of them).
    fn without_progress_text(&self) -> OperationState {
        OperationState {
            phase: self.phase,
            error: self.error.clone(),
            n_completed: self.n_completed,
            n_total: self.n_total,
            operation_units: String::new(),
            description: String::new(),
            created_ms: self.created_ms,
            started_ms: self.started_ms,
            updated_ms: self.updated_ms,
            plugin_updated_ms: self.plugin_updated_ms,
            progressed_ms: self.progressed_ms,
            attempts: self.attempts,
            last_error: self.last_error.clone(),
            next_attempt_ms: self.next_attempt_ms,
            retrying_since_ms: self.retrying_since_ms,
        }
    }
}

/// What one poll learned about an operation.
#[derive(Clone, Debug, PartialEq)]
pub enum Observation {
    /// The snapshotter answered Progress.
    Progress(OperationProgress),
    /// Progress could not be had: the call failed, the snapshotter said 2001/2002, or no
    /// snapshotter is registered for the plugin. The text becomes the operation's error.
    Error(String),
    /// The snapshotter speaks v1, which has no Progress: the operation is complete.
    V1Adapter,
    /// The snapshotter answered with an error it marked transient: tried again after a
    /// backoff while the retry budget lasts, then the operation fails with it.
    Transient(String),
    /// The snapshotter could not be reached (since `since_ms`, for the last time with
    /// `error`). Nothing changes until `grace_ms` has passed; then the operation fails
    /// saying so, rather than waiting hours for its timeout.
    Unreachable {
        error: String,
        since_ms: i64,
        grace_ms: i64,
    },
}

/// The outcome of a poll for one operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub next: OperationState,
    /// Cancel must be called (and answered or timed out) before `next` is committed.
    pub cancel: bool,
    /// Which limit decided, when one did (what an event of the change would say).
    pub why: Option<Why>,
}

/// A limit that decided an operation's change, besides the snapshotter's own report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// The item operation timeout passed (cancelled and failed).
    TimedOut,
    /// The stall deadline passed (cancelled and failed).
    Stalled,
    /// The start deadline passed (cancelled and failed).
    NotStarted,
    /// Unreachable past the grace period (failed).
    Unreachable,
    /// A transient error, to be retried at `next_attempt_ms`.
    RetryScheduled,
    /// A transient error with the retry budget spent (failed).
    RetriesSpent,
    /// A good answer after a run of transient errors.
    Recovered,
}

/// A deadline that has passed for `op`, as the error it fails with: the item operation
/// timeout, then the start deadline (still New), then the stall deadline.
fn deadline_passed(op: &OperationState, limits: &Limits, now_ms: i64) -> Option<(Why, String)> {
    if now_ms > op.created_ms.saturating_add(limits.timeout_ms) {
        return Some((Why::TimedOut, TIMED_OUT.to_string()));
    }
    if let Some(start) = limits.start_ms.filter(|&d| d > 0) {
        if op.phase == OperationPhase::New && now_ms.saturating_sub(op.created_ms) >= start {
            return Some((Why::NotStarted, not_started_reason(start)));
        }
    }
    if let Some(stall) = limits.stall_ms.filter(|&d| d > 0) {
        let since = op.progressed_ms.unwrap_or(op.created_ms);
        if now_ms.saturating_sub(since) >= stall {
            return Some((Why::Stalled, stall_reason(op, stall)));
        }
    }
    None
}

/// Applies `observation` to `current` within every limit: the item operation timeout,
/// the stall and start deadlines (which cancel and fail like the timeout, saying what was
/// seen last), and the retry budget for transient errors. Returns `None` when nothing
/// changed, so an unchanged operation costs no write. Order follows Velero's controller:
/// a completed report wins; otherwise a passed deadline cancels and fails; otherwise the
/// progress is recorded and a reported start moves New to InProgress.
pub fn observe_within(
    current: &OperationState,
    observation: Observation,
    limits: &Limits,
    now_ms: i64,
) -> Option<Decision> {
    if !current.phase.is_unfinished() {
        return None;
    }
    let mut next = match observation {
        Observation::Progress(_) => current.without_progress_text(),
        _ => current.clone(),
    };
    let mut cancel = false;
    let mut why = None;
    // With a stall deadline, its clock starts at the first poll at the latest: an owner
    // may stay InProgress (unpolled) for long, and its operations are not to blame.
    if limits.stall_ms.is_some_and(|d| d > 0) && next.progressed_ms.is_none() {
        next.progressed_ms = Some(now_ms);
    }
    match observation {
        Observation::Error(message) => {
            next.phase = OperationPhase::Failed;
            next.error = bounded(message, MAX_ERROR);
            next.updated_ms = Some(now_ms);
            next.next_attempt_ms = None;
        }
        Observation::Transient(message) => {
            let message = bounded(message, MAX_ERROR);
            let since = current.retrying_since_ms.unwrap_or(now_ms);
            if let Some((deadline, reason)) = deadline_passed(&next, limits, now_ms) {
                cancel = true;
                why = Some(deadline);
                next.phase = OperationPhase::Failed;
                next.error = reason;
                next.next_attempt_ms = None;
            } else if current.attempts >= limits.retry.attempts
                || now_ms.saturating_sub(since) >= limits.retry.within_ms
            {
                why = Some(Why::RetriesSpent);
                next.phase = OperationPhase::Failed;
                next.error = message.clone();
                next.next_attempt_ms = None;
            } else {
                why = Some(Why::RetryScheduled);
                next.attempts = current.attempts.saturating_add(1);
                next.retrying_since_ms = Some(since);
                next.next_attempt_ms =
                    Some(now_ms.saturating_add(limits.retry.backoff(next.attempts)));
            }
            next.last_error = message;
            next.updated_ms = Some(now_ms);
        }
        Observation::V1Adapter => {
            next.phase = OperationPhase::Completed;
            next.updated_ms = Some(now_ms);
        }
        Observation::Unreachable {
            error,
            since_ms,
            grace_ms,
        } => {
            if let Some((deadline, reason)) = deadline_passed(&next, limits, now_ms) {
                cancel = true;
                why = Some(deadline);
                next.phase = OperationPhase::Failed;
                next.error = reason;
            } else if now_ms.saturating_sub(since_ms) >= grace_ms {
                why = Some(Why::Unreachable);
                next.phase = OperationPhase::Failed;
                let grace = opmon_client::GoDuration::from_millis(grace_ms.max(0) as u64);
                next.error = bounded(
                    format!("unreachable for more than {grace}: {error}"),
                    MAX_ERROR,
                );
            } else {
                // Nothing else changes, but the operation says why it waits (written
                // when the error changes, not at every poll), and a stall clock that
                // just started is kept.
                next.last_error = bounded(error, MAX_ERROR);
                return (next != *current).then_some(Decision { next, cancel, why });
            }
            next.updated_ms = Some(now_ms);
        }
        Observation::Progress(p) => {
            let (n_completed, n_total, impossible) = possible_counts(p.n_completed, p.n_total);
            next.n_completed = n_completed;
            next.n_total = n_total;
            if let Some(note) = impossible {
                next.last_error = note;
            }
            next.operation_units = bounded(p.operation_units, MAX_UNITS);
            next.description = bounded(p.description, MAX_DESCRIPTION);
            // As Velero's controller: only Go's zero time is "unknown"; the Unix epoch is a
            // start. A known time is kept when a later report leaves it out (Velero would
            // write the zero time then, as `null`).
            if let Some(started) = p.started.filter(|&t| !is_go_zero(t)) {
                next.started_ms = Some(ms(started));
            }
            if let Some(updated) = p.updated.filter(|&t| !is_go_zero(t)) {
                next.updated_ms = Some(ms(updated));
                next.plugin_updated_ms = Some(ms(updated));
            }
            // A good answer ends a run of transient errors (their count and the last
            // one stay, to be seen).
            next.next_attempt_ms = None;
            next.retrying_since_ms = None;
            if current.retrying_since_ms.is_some() {
                why = Some(Why::Recovered);
            }
            if next.n_completed != current.n_completed
                || next.n_total != current.n_total
                || next.description != current.description
                || next.started_ms != current.started_ms
                || next.plugin_updated_ms != current.plugin_updated_ms
            {
                next.progressed_ms = Some(now_ms);
            }
            if p.completed {
                match p.err.filter(|err| !err.is_empty()) {
                    None => next.phase = OperationPhase::Completed,
                    Some(err) => {
                        next.phase = OperationPhase::Failed;
                        next.error = bounded(err, MAX_ERROR);
                    }
                }
            } else if next.phase == OperationPhase::New && next.started_ms.is_some() {
                next.phase = OperationPhase::InProgress;
            }
            if next.phase.is_unfinished() {
                if let Some((deadline, reason)) = deadline_passed(&next, limits, now_ms) {
                    cancel = true;
                    why = Some(deadline);
                    next.phase = OperationPhase::Failed;
                    next.error = reason;
                }
            }
            if next != *current && next.updated_ms == current.updated_ms {
                next.updated_ms = Some(now_ms);
            }
        }
    }
    (next != *current).then_some(Decision { next, cancel, why })
}

/// Counts a user can be shown: none below zero, and no more completed than the total
/// when one is known (0 means unknown). An answer that breaks this is the snapshotter's
/// mistake: it is clamped, so rates, ETAs and bars stay sane, and the note saying what it
/// sent becomes the operation's `lastError`.
pub fn possible_counts(n_completed: i64, n_total: i64) -> (i64, i64, Option<String>) {
    let total = n_total.max(0);
    let mut completed = n_completed.max(0);
    if total > 0 {
        completed = completed.min(total);
    }
    let note = (completed != n_completed || total != n_total).then(|| {
        format!(
            "the snapshotter reported an impossible progress (nCompleted {n_completed}, \
             nTotal {n_total}): shown as {completed} of {total}"
        )
    });
    (completed, total, note)
}

fn ms(t: time::OffsetDateTime) -> i64 {
    // Floor, so a time before the epoch keeps its second.
    t.unix_timestamp_nanos().div_euclid(1_000_000) as i64
}

/// Go's zero `time.Time` (0001-01-01T00:00:00Z): what a Go plugin reports for a time it
/// does not know, and the only time Velero's controller reads as unknown
/// (`Time.IsZero`).
pub fn is_go_zero(t: time::OffsetDateTime) -> bool {
    const GO_ZERO_UNIX: i64 = -62_135_596_800;
    t.unix_timestamp() == GO_ZERO_UNIX && t.nanosecond() == 0
}

/// The phase an owner settles in once the InProgress work (or a poll) is done:
/// waiting while operations are unfinished, else finalizing or terminal.
fn settle(finalize: bool, has_errors: bool, unfinished: u64) -> OwnerPhase {
    match (unfinished > 0, has_errors, finalize) {
        (true, false, _) => OwnerPhase::WaitingForPluginOperations,
        (true, true, _) => OwnerPhase::WaitingForPluginOperationsPartiallyFailed,
        (false, false, true) => OwnerPhase::Finalizing,
        (false, true, true) => OwnerPhase::FinalizingPartiallyFailed,
        (false, false, false) => OwnerPhase::Completed,
        (false, true, false) => OwnerPhase::PartiallyFailed,
    }
}

/// `endInProgress`: `failed` goes to Failed; otherwise the owner settles given the
/// errors so far (the server's plus failures found by the immediate poll) and the
/// operations still unfinished after that poll. `finalize` is true for backups and for
/// restores started with `finalize: true`.
pub fn leave_in_progress(finalize: bool, failed: bool, errors: u32, unfinished: u64) -> OwnerPhase {
    if failed {
        OwnerPhase::Failed
    } else {
        settle(finalize, errors > 0, unfinished)
    }
}

/// After a poll of a waiting owner. Once partially failed, an owner stays so.
/// Owners in other phases are not moved by polls.
pub fn after_poll(phase: OwnerPhase, finalize: bool, errors: u32, unfinished: u64) -> OwnerPhase {
    if !phase.is_waiting() {
        return phase;
    }
    let has_errors = errors > 0 || phase == OwnerPhase::WaitingForPluginOperationsPartiallyFailed;
    settle(finalize, has_errors, unfinished)
}

/// `finalize`: Finalizing → Completed, FinalizingPartiallyFailed → PartiallyFailed;
/// errors found by the finalize step itself make it PartiallyFailed too, as Velero's
/// restore finalizer does. `None` from any other phase.
pub fn finalized(phase: OwnerPhase, new_errors: u32) -> Option<OwnerPhase> {
    match phase {
        OwnerPhase::Finalizing if new_errors == 0 => Some(OwnerPhase::Completed),
        OwnerPhase::Finalizing | OwnerPhase::FinalizingPartiallyFailed => {
            Some(OwnerPhase::PartiallyFailed)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opmon_client::OwnerPhase::*;
    use time::OffsetDateTime;

    const HOUR: i64 = 3_600_000;

    /// [`observe_within`] with the item operation timeout as the only limit.
    fn observe(
        current: &OperationState,
        observation: Observation,
        timeout_ms: i64,
        now_ms: i64,
    ) -> Option<Decision> {
        let limits = Limits {
            timeout_ms,
            ..Limits::default()
        };
        observe_within(current, observation, &limits, now_ms)
    }

    fn new_op(created_ms: i64) -> OperationState {
        OperationState {
            created_ms,
            ..Default::default()
        }
    }

    fn at(ms: i64) -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000).unwrap()
    }

    fn progress(completed: bool, err: &str) -> OperationProgress {
        OperationProgress {
            completed,
            err: Some(err.into()).filter(|err: &String| !err.is_empty()),
            n_completed: 5,
            n_total: 10,
            operation_units: "byte".into(),
            ..Default::default()
        }
    }

    // The table of docs/architecture.md "Phases", leaving InProgress, one test per row.

    #[test]
    fn unfinished_ops_without_errors_wait() {
        assert_eq!(
            leave_in_progress(true, false, 0, 3),
            WaitingForPluginOperations
        );
        assert_eq!(
            leave_in_progress(false, false, 0, 3),
            WaitingForPluginOperations
        );
    }

    #[test]
    fn errors_from_in_progress_are_carried_into_waiting_partially_failed() {
        assert_eq!(
            leave_in_progress(true, false, 2, 1),
            WaitingForPluginOperationsPartiallyFailed
        );
        assert_eq!(
            leave_in_progress(false, false, 2, 1),
            WaitingForPluginOperationsPartiallyFailed
        );
    }

    #[test]
    fn completed_ops_take_a_backup_to_finalizing() {
        assert_eq!(leave_in_progress(true, false, 0, 0), Finalizing);
    }

    #[test]
    fn finished_with_errors_takes_a_backup_to_finalizing_partially_failed() {
        assert_eq!(
            leave_in_progress(true, false, 1, 0),
            FinalizingPartiallyFailed
        );
    }

    #[test]
    fn restores_go_straight_to_completed_or_partially_failed() {
        assert_eq!(leave_in_progress(false, false, 0, 0), Completed);
        assert_eq!(leave_in_progress(false, false, 1, 0), PartiallyFailed);
    }

    #[test]
    fn failed_true_goes_to_failed_whatever_else() {
        assert_eq!(leave_in_progress(true, true, 0, 5), Failed);
        assert_eq!(leave_in_progress(false, true, 3, 0), Failed);
    }

    // While waiting.

    #[test]
    fn an_error_while_waiting_moves_to_waiting_partially_failed() {
        assert_eq!(
            after_poll(WaitingForPluginOperations, true, 1, 2),
            WaitingForPluginOperationsPartiallyFailed
        );
    }

    #[test]
    fn waiting_partially_failed_stays_partially_failed_when_done() {
        assert_eq!(
            after_poll(WaitingForPluginOperationsPartiallyFailed, true, 0, 0),
            FinalizingPartiallyFailed
        );
        assert_eq!(
            after_poll(WaitingForPluginOperationsPartiallyFailed, false, 0, 0),
            PartiallyFailed
        );
    }

    #[test]
    fn waiting_owner_with_nothing_unfinished_moves_on() {
        assert_eq!(
            after_poll(WaitingForPluginOperations, true, 0, 0),
            Finalizing
        );
        assert_eq!(
            after_poll(WaitingForPluginOperations, false, 0, 0),
            Completed
        );
        assert_eq!(
            after_poll(WaitingForPluginOperations, true, 0, 1),
            WaitingForPluginOperations
        );
    }

    #[test]
    fn polls_do_not_move_owners_outside_waiting() {
        for phase in [InProgress, Finalizing, Completed, Failed] {
            assert_eq!(after_poll(phase, true, 3, 0), phase);
        }
    }

    #[test]
    fn finalize_moves_finalizing_phases_to_terminal_ones() {
        assert_eq!(finalized(Finalizing, 0), Some(Completed));
        assert_eq!(
            finalized(FinalizingPartiallyFailed, 0),
            Some(PartiallyFailed)
        );
        assert_eq!(finalized(WaitingForPluginOperations, 0), None);
        assert_eq!(finalized(Completed, 0), None);
    }

    #[test]
    fn a_restarted_server_fails_owners_in_veleros_words() {
        assert_eq!(
            server_restarted_reason(OwnerKind::Backup),
            "found a backup with status \"InProgress\" during the server starting, \
             mark it as \"Failed\""
        );
        assert_eq!(
            server_restarted_reason(OwnerKind::Restore),
            "found a restore with status \"InProgress\" during the server starting, \
             mark it as \"Failed\""
        );
    }

    #[test]
    fn errors_found_by_finalize_make_the_owner_partially_failed() {
        assert_eq!(finalized(Finalizing, 1), Some(PartiallyFailed));
        assert_eq!(
            finalized(FinalizingPartiallyFailed, 2),
            Some(PartiallyFailed)
        );
        assert_eq!(finalized(InProgress, 1), None);
    }

    // Operations.

    #[test]
    fn new_moves_to_in_progress_once_started_is_reported() {
        let op = new_op(0);
        let mut p = progress(false, "");
        let d = observe(&op, Observation::Progress(p.clone()), 4 * HOUR, 1000).unwrap();
        assert_eq!(d.next.phase, OperationPhase::New, "no start reported yet");
        p.started = Some(at(500));
        let d = observe(&d.next, Observation::Progress(p), 4 * HOUR, 2000).unwrap();
        assert_eq!(d.next.phase, OperationPhase::InProgress);
        assert_eq!(d.next.started_ms, Some(500));
        assert!(!d.cancel);
    }

    #[test]
    fn an_epoch_start_is_a_start_as_in_velero() {
        let mut p = progress(false, "");
        p.started = Some(OffsetDateTime::UNIX_EPOCH);
        let d = observe(&new_op(0), Observation::Progress(p), HOUR, 10).unwrap();
        assert_eq!(d.next.phase, OperationPhase::InProgress);
        assert_eq!(d.next.started_ms, Some(0));
    }

    #[test]
    fn go_zero_times_mean_unknown_and_keep_what_was_known() {
        let go_zero = time::macros::datetime!(0001-01-01 00:00:00 UTC);
        assert!(is_go_zero(go_zero));
        assert!(!is_go_zero(OffsetDateTime::UNIX_EPOCH));
        assert!(!is_go_zero(go_zero + time::Duration::nanoseconds(1)));
        let mut p = progress(false, "");
        p.started = Some(go_zero);
        p.updated = Some(go_zero);
        let d = observe(&new_op(0), Observation::Progress(p.clone()), HOUR, 10).unwrap();
        assert_eq!(d.next.phase, OperationPhase::New);
        assert_eq!((d.next.started_ms, d.next.plugin_updated_ms), (None, None));
        assert_eq!(d.next.updated_ms, Some(10), "the agent saw a change");

        let mut known = new_op(0);
        known.phase = OperationPhase::InProgress;
        known.started_ms = Some(500);
        known.plugin_updated_ms = Some(700);
        known.updated_ms = Some(700);
        known.n_completed = 5;
        known.n_total = 10;
        known.operation_units = "byte".into();
        assert_eq!(
            observe(&known, Observation::Progress(p), HOUR, 20),
            None,
            "a zero time reported later changes nothing"
        );
    }

    #[test]
    fn the_plugins_updated_is_kept_apart_from_the_agents_change_time() {
        let mut p = progress(false, "");
        p.started = Some(at(500));
        p.updated = Some(at(1_500));
        let d = observe(&new_op(0), Observation::Progress(p.clone()), HOUR, 2_000).unwrap();
        assert_eq!(d.next.plugin_updated_ms, Some(1_500));
        assert_eq!(d.next.updated_ms, Some(1_500));
        // An error changes the operation (updated) but not the plugin's updated.
        let failed = observe(&d.next, Observation::Error("gone".into()), HOUR, 3_000).unwrap();
        assert_eq!(failed.next.updated_ms, Some(3_000));
        assert_eq!(failed.next.plugin_updated_ms, Some(1_500));
        // The v1 adapter completes without a plugin time.
        let v1 = observe(&new_op(0), Observation::V1Adapter, HOUR, 4_000).unwrap();
        assert_eq!(
            (v1.next.updated_ms, v1.next.plugin_updated_ms),
            (Some(4_000), None)
        );
    }

    #[test]
    fn times_are_floored_to_the_millisecond_before_the_epoch_too() {
        let mut p = progress(false, "");
        p.started = Some(OffsetDateTime::UNIX_EPOCH - time::Duration::nanoseconds(1_500_000_500));
        let d = observe(&new_op(0), Observation::Progress(p), HOUR, 10).unwrap();
        assert_eq!(d.next.started_ms, Some(-1_501));
    }

    #[test]
    fn completed_progress_completes_and_completed_with_err_fails() {
        let d = observe(
            &new_op(0),
            Observation::Progress(progress(true, "")),
            HOUR,
            1,
        )
        .unwrap();
        assert_eq!(d.next.phase, OperationPhase::Completed);
        let d = observe(
            &new_op(0),
            Observation::Progress(progress(true, "disk gone")),
            HOUR,
            1,
        )
        .unwrap();
        assert_eq!(d.next.phase, OperationPhase::Failed);
        assert_eq!(d.next.error, "disk gone");
    }

    #[test]
    fn timed_out_operation_is_cancelled_then_failed() {
        let d = observe(
            &new_op(0),
            Observation::Progress(progress(false, "")),
            HOUR,
            HOUR + 1,
        )
        .unwrap();
        assert!(d.cancel);
        assert_eq!(d.next.phase, OperationPhase::Failed);
        assert_eq!(d.next.error, TIMED_OUT);
        assert_eq!(d.why, Some(Why::TimedOut));
    }

    #[test]
    fn completion_reported_after_the_timeout_still_completes() {
        let d = observe(
            &new_op(0),
            Observation::Progress(progress(true, "")),
            HOUR,
            2 * HOUR,
        )
        .unwrap();
        assert!(!d.cancel);
        assert_eq!(d.next.phase, OperationPhase::Completed);
    }

    #[test]
    fn progress_errors_fail_the_operation_with_their_message() {
        let d = observe(
            &new_op(0),
            Observation::Error("no snapshotter".into()),
            HOUR,
            5,
        )
        .unwrap();
        assert_eq!(d.next.phase, OperationPhase::Failed);
        assert_eq!(d.next.error, "no snapshotter");
        assert!(!d.cancel);
    }

    #[test]
    fn an_unreachable_snapshotter_changes_nothing_until_the_grace_period_passes() {
        let unreachable = |since_ms| Observation::Unreachable {
            error: "connection refused".into(),
            since_ms,
            grace_ms: 600_000,
        };
        // The first poll that finds it unreachable says so in lastError; later ones
        // with the same error change nothing.
        let d = observe(&new_op(0), unreachable(1_000), HOUR, 1_000).unwrap();
        assert_eq!(d.next.phase, OperationPhase::New);
        assert_eq!(d.next.last_error, "connection refused");
        assert_eq!((d.next.attempts, d.next.error.as_str()), (0, ""));
        assert!(d.why.is_none() && !d.cancel);
        assert_eq!(observe(&d.next, unreachable(1_000), HOUR, 500_000), None);
        let d = observe(&new_op(0), unreachable(1_000), HOUR, 601_000).unwrap();
        assert_eq!(d.next.phase, OperationPhase::Failed);
        assert_eq!(
            d.next.error,
            "unreachable for more than 10m0s: connection refused"
        );
        assert!(!d.cancel);
    }

    #[test]
    fn an_unreachable_snapshotter_still_times_out() {
        let d = observe(
            &new_op(0),
            Observation::Unreachable {
                error: "deadline".into(),
                since_ms: HOUR,
                grace_ms: 10 * HOUR,
            },
            HOUR,
            HOUR + 1,
        )
        .unwrap();
        assert!(d.cancel);
        assert_eq!(d.next.error, TIMED_OUT);
    }

    #[test]
    fn v1_adapter_completes_at_first_poll() {
        let d = observe(&new_op(0), Observation::V1Adapter, HOUR, 5).unwrap();
        assert_eq!(d.next.phase, OperationPhase::Completed);
    }

    #[test]
    fn unchanged_progress_needs_no_write() {
        let d = observe(
            &new_op(0),
            Observation::Progress(progress(false, "")),
            HOUR,
            5,
        )
        .unwrap();
        assert_eq!(d.next.updated_ms, Some(5));
        assert_eq!(
            observe(&d.next, Observation::Progress(progress(false, "")), HOUR, 9),
            None
        );
    }

    #[test]
    fn long_reports_are_stored_cut_with_a_marker_and_cut_the_same_way_each_time() {
        let mut p = progress(false, "");
        p.description = "é".repeat(10_000); // 20,000 bytes of two-byte characters
        p.operation_units = "u".repeat(1000);
        let first = observe(&new_op(0), Observation::Progress(p.clone()), HOUR, 1)
            .unwrap()
            .next;
        // 4096 bytes minus the 27 of the marker, down to a character boundary.
        assert_eq!(
            first.description,
            format!("{}… [truncated 15932 bytes]", "é".repeat(2034))
        );
        assert_eq!(
            first.operation_units,
            format!("{}… [truncated 962 bytes]", "u".repeat(38))
        );
        assert!(
            observe(&first, Observation::Progress(p), HOUR, 2).is_none(),
            "the same long report again changes nothing"
        );
        let failed = observe(
            &new_op(0),
            Observation::Progress(progress(true, &"e".repeat(1 << 20))),
            HOUR,
            1,
        )
        .unwrap()
        .next;
        assert_eq!(
            failed.error,
            format!("{}… [truncated 1044509 bytes]", "e".repeat(4067))
        );
        assert_eq!(failed.error.len(), MAX_ERROR);
        let error = observe(&new_op(0), Observation::Error("x".repeat(5000)), HOUR, 1)
            .unwrap()
            .next;
        assert_eq!(
            error.error,
            format!("{}… [truncated 930 bytes]", "x".repeat(4070))
        );
        assert_eq!(bounded("short".into(), 5), "short");
    }

    // Deadlines and retries (issue 16).

    const NOV_22_10_02_11: i64 = 1_795_341_731_000; // 2026-11-22T10:02:11Z
    const MIN: i64 = 60_000;

    fn limits(stall_ms: Option<i64>, start_ms: Option<i64>) -> Limits {
        Limits {
            timeout_ms: 4 * HOUR,
            stall_ms,
            start_ms,
            retry: RetryBudget::DEFAULT,
        }
    }

    fn copying(n: i64, total: i64) -> OperationProgress {
        OperationProgress {
            n_completed: n,
            n_total: total,
            operation_units: "bytes".into(),
            description: "copying".into(),
            started: Some(at(NOV_22_10_02_11 - MIN)),
            ..Default::default()
        }
    }

    #[test]
    fn a_stalled_operation_is_cancelled_and_failed_saying_what_it_saw_last() {
        let l = limits(Some(30 * MIN), None);
        let op = new_op(NOV_22_10_02_11 - 2 * MIN);
        let seen = observe_within(
            &op,
            Observation::Progress(copying(8_400_000_000, 15_400_000_000)),
            &l,
            NOV_22_10_02_11,
        )
        .unwrap()
        .next;
        assert_eq!(seen.progressed_ms, Some(NOV_22_10_02_11));
        let same = || Observation::Progress(copying(8_400_000_000, 15_400_000_000));
        assert_eq!(
            observe_within(&seen, same(), &l, NOV_22_10_02_11 + 30 * MIN - 1),
            None,
            "unchanged before the deadline: nothing to write"
        );
        let d = observe_within(&seen, same(), &l, NOV_22_10_02_11 + 30 * MIN).unwrap();
        assert!(d.cancel);
        assert_eq!(d.why, Some(Why::Stalled));
        assert_eq!(d.next.phase, OperationPhase::Failed);
        assert_eq!(
            d.next.error,
            "no progress for 30m0s: last 8.4 GB of 15.4 GB at 2026-11-22T10:02:11Z"
        );
    }

    #[test]
    fn progress_restarts_the_stall_clock_and_zero_or_none_turns_it_off() {
        let l = limits(Some(MIN), None);
        let op = new_op(0);
        let first = observe_within(&op, Observation::Progress(copying(1, 10)), &l, 10)
            .unwrap()
            .next;
        let moved = observe_within(&first, Observation::Progress(copying(2, 10)), &l, MIN).unwrap();
        assert!(!moved.cancel);
        assert_eq!(moved.next.progressed_ms, Some(MIN));
        for off in [None, Some(0)] {
            let l = limits(off, None);
            assert_eq!(
                observe_within(&first, Observation::Progress(copying(1, 10)), &l, HOUR),
                None
            );
        }
    }

    #[test]
    fn counts_in_other_units_and_silence_are_said_as_they_are() {
        let mut op = new_op(NOV_22_10_02_11);
        assert_eq!(
            stall_reason(&op, 90_000),
            "no progress for 1m30s: nothing reported since 2026-11-22T10:02:11Z"
        );
        op.n_completed = 3;
        op.n_total = 7;
        op.operation_units = "files".into();
        op.progressed_ms = Some(NOV_22_10_02_11 + 1_000);
        assert_eq!(
            stall_reason(&op, MIN),
            "no progress for 1m0s: last 3 of 7 files at 2026-11-22T10:02:12Z"
        );
        op.operation_units = "byte".into();
        op.n_completed = 999;
        op.n_total = 0;
        assert_eq!(
            stall_reason(&op, MIN),
            "no progress for 1m0s: last 999 B at 2026-11-22T10:02:12Z"
        );
    }

    #[test]
    fn an_operation_still_new_after_the_start_deadline_is_cancelled_and_failed() {
        let l = limits(None, Some(5 * MIN));
        let idle = OperationProgress {
            n_total: 10,
            ..Default::default()
        };
        let op = new_op(0);
        let d = observe_within(&op, Observation::Progress(idle.clone()), &l, 5 * MIN - 1).unwrap();
        assert_eq!(d.next.phase, OperationPhase::New, "not yet");
        let d = observe_within(&d.next, Observation::Progress(idle), &l, 5 * MIN).unwrap();
        assert!(d.cancel);
        assert_eq!(d.why, Some(Why::NotStarted));
        assert_eq!(d.next.error, "not started after 5m0s: still New");
        // Started in time: the start deadline no longer applies.
        let started = observe_within(&op, Observation::Progress(copying(1, 10)), &l, 10)
            .unwrap()
            .next;
        assert_eq!(started.phase, OperationPhase::InProgress);
        assert_eq!(
            observe_within(&started, Observation::Progress(copying(1, 10)), &l, HOUR),
            None
        );
    }

    #[test]
    fn an_unreachable_snapshotter_is_caught_by_the_deadlines_before_its_grace() {
        let l = limits(Some(MIN), None);
        let unreachable = || Observation::Unreachable {
            error: "connection refused".into(),
            since_ms: 0,
            grace_ms: HOUR,
        };
        // First polled long after it was created (its owner was InProgress): the stall
        // clock starts now, and nothing else changes.
        let first = observe_within(&new_op(0), unreachable(), &l, 2 * MIN).unwrap();
        assert!(!first.cancel);
        assert_eq!(first.next.phase, OperationPhase::New);
        assert_eq!(first.next.progressed_ms, Some(2 * MIN));
        assert_eq!(first.next.updated_ms, None, "not a change of the operation");
        assert_eq!(
            observe_within(&first.next, unreachable(), &l, 3 * MIN - 1),
            None
        );
        let d = observe_within(&first.next, unreachable(), &l, 3 * MIN).unwrap();
        assert!(d.cancel);
        assert_eq!(
            d.next.error,
            "no progress for 1m0s: nothing reported since 1970-01-01T00:02:00Z"
        );
    }

    #[test]
    fn transient_errors_back_off_doubling_and_a_good_answer_ends_the_run() {
        let l = Limits {
            retry: RetryBudget {
                attempts: 5,
                backoff_ms: 1_000,
                within_ms: HOUR,
            },
            ..limits(None, None)
        };
        let busy = || Observation::Transient("busy".into());
        let one = observe_within(&new_op(0), busy(), &l, 100).unwrap();
        assert!(!one.cancel);
        assert_eq!(one.why, Some(Why::RetryScheduled));
        assert_eq!(one.next.phase, OperationPhase::New);
        assert_eq!(
            (one.next.attempts, one.next.next_attempt_ms),
            (1, Some(1_100))
        );
        assert_eq!(one.next.retrying_since_ms, Some(100));
        let two = observe_within(&one.next, busy(), &l, 1_100).unwrap().next;
        assert_eq!((two.attempts, two.next_attempt_ms), (2, Some(3_100)));
        let ok = observe_within(&two, Observation::Progress(copying(1, 2)), &l, 3_100).unwrap();
        assert_eq!(ok.why, Some(Why::Recovered));
        let ok = ok.next;
        assert_eq!(ok.phase, OperationPhase::InProgress);
        assert_eq!(
            (ok.attempts, ok.last_error.as_str(), ok.next_attempt_ms),
            (2, "busy", None),
            "the count and the last error stay to be seen"
        );
        assert_eq!(ok.retrying_since_ms, None);
        assert_eq!(RetryBudget::DEFAULT.backoff(30), MAX_BACKOFF_MS);
    }

    #[test]
    fn transient_errors_fail_with_the_last_one_once_attempts_or_time_run_out() {
        let budget = |attempts, within_ms| Limits {
            retry: RetryBudget {
                attempts,
                backoff_ms: 10,
                within_ms,
            },
            ..limits(None, None)
        };
        let mut op = new_op(0);
        let l = budget(2, HOUR);
        for (i, now) in [1, 2].into_iter().enumerate() {
            op = observe_within(&op, Observation::Transient(format!("busy {i}")), &l, now)
                .unwrap()
                .next;
        }
        let d = observe_within(&op, Observation::Transient("busy 2".into()), &l, 3).unwrap();
        assert!(
            !d.cancel,
            "the snapshotter said the call failed: nothing to cancel"
        );
        assert_eq!(d.why, Some(Why::RetriesSpent));
        assert_eq!(d.next.phase, OperationPhase::Failed);
        assert_eq!((d.next.error.as_str(), d.next.attempts), ("busy 2", 2));
        // Out of time first.
        let l = budget(100, 1_000);
        let first = observe_within(&new_op(0), Observation::Transient("a".into()), &l, 0)
            .unwrap()
            .next;
        let d = observe_within(&first, Observation::Transient("b".into()), &l, 1_000).unwrap();
        assert_eq!(
            (d.next.phase, d.next.error.as_str()),
            (OperationPhase::Failed, "b")
        );
        // No budget: the first transient error fails.
        let d = observe_within(
            &new_op(0),
            Observation::Transient("c".into()),
            &budget(0, HOUR),
            0,
        )
        .unwrap();
        assert_eq!(d.next.phase, OperationPhase::Failed);
    }

    #[test]
    fn finished_operations_are_never_changed() {
        let mut done = new_op(0);
        done.phase = OperationPhase::Completed;
        assert_eq!(
            observe(&done, Observation::Error("late".into()), HOUR, 5),
            None
        );
    }

    #[test]
    fn impossible_counts_are_clamped_with_a_note_and_possible_ones_are_kept() {
        assert_eq!(possible_counts(3, 7), (3, 7, None));
        assert_eq!(possible_counts(7, 7), (7, 7, None));
        // A total of 0 is unknown: any count of completed units stands.
        assert_eq!(possible_counts(999, 0), (999, 0, None));
        let (c, t, note) = possible_counts(12, 10);
        assert_eq!((c, t), (10, 10));
        assert_eq!(
            note.as_deref(),
            Some("the snapshotter reported an impossible progress (nCompleted 12, nTotal 10): shown as 10 of 10")
        );
        assert_eq!(possible_counts(-5, -1).0..possible_counts(-5, -1).1, 0..0);
        assert!(possible_counts(-1, 5).2.is_some());
        assert!(possible_counts(0, -1).2.is_some());
    }

    // Pinned by mutation testing (docs/testing.md): each test below fails if one
    // operator or text of the machine changes.

    #[test]
    fn the_failure_texts_of_idle_failed_and_canceled_owners_are_exact() {
        assert_eq!(
            idle_reason("2026-11-22T10:02:11Z", GoDuration::from_secs(3600)),
            "no call from the backup server since 2026-11-22T10:02:11Z, longer than \
             in_progress_idle_timeout (1h0m0s): InProgress abandoned"
        );
        assert_eq!(
            cancelled_with(OwnerKind::Restore),
            "canceled: the restore failed"
        );
        assert_eq!(
            canceled_because("by the operator"),
            "canceled: by the operator"
        );
    }

    #[test]
    fn amounts_change_unit_at_exactly_a_thousand() {
        assert_eq!(amount(999, "bytes"), "999 B");
        assert_eq!(amount(1_000, "bytes"), "1.0 kB");
        assert_eq!(amount(1_000_000, "bytes"), "1.0 MB");
        assert_eq!(amount(999_999, "bytes"), "1000.0 kB");
    }

    #[test]
    fn any_count_or_a_description_alone_is_a_report_to_quote() {
        let mut op = new_op(NOV_22_10_02_11);
        op.progressed_ms = Some(NOV_22_10_02_11);
        op.description = "preparing".into();
        assert_eq!(
            stall_reason(&op, MIN),
            "no progress for 1m0s: last 0 at 2026-11-22T10:02:11Z"
        );
        op.description.clear();
        op.n_total = 7;
        assert_eq!(
            stall_reason(&op, MIN),
            "no progress for 1m0s: last 0 of 7 at 2026-11-22T10:02:11Z"
        );
        op.n_total = 0;
        op.n_completed = 4;
        assert_eq!(
            stall_reason(&op, MIN),
            "no progress for 1m0s: last 4 at 2026-11-22T10:02:11Z"
        );
    }

    #[test]
    fn each_of_count_total_description_start_and_update_alone_is_progress() {
        let l = limits(Some(HOUR), None);
        let base = copying(1, 10);
        let first = observe_within(&new_op(0), Observation::Progress(base.clone()), &l, 10)
            .unwrap()
            .next;
        let changed = [
            OperationProgress {
                n_completed: 2,
                ..base.clone()
            },
            OperationProgress {
                n_total: 11,
                ..base.clone()
            },
            OperationProgress {
                description: "verifying".into(),
                ..base.clone()
            },
            OperationProgress {
                started: Some(at(NOV_22_10_02_11)),
                ..base.clone()
            },
            OperationProgress {
                updated: Some(at(NOV_22_10_02_11)),
                ..base.clone()
            },
        ];
        for (i, p) in changed.into_iter().enumerate() {
            let d = observe_within(&first, Observation::Progress(p), &l, MIN).unwrap();
            assert_eq!(d.next.progressed_ms, Some(MIN), "change {i}");
        }
        // Nothing changed: the stall clock keeps its start.
        assert_eq!(
            observe_within(&first, Observation::Progress(base), &l, MIN),
            None
        );
    }

    #[test]
    fn the_timeout_passes_only_after_its_last_millisecond() {
        let busy = || Observation::Transient("busy".into());
        let unreachable = || Observation::Unreachable {
            error: "refused".into(),
            since_ms: 0,
            grace_ms: 10 * HOUR,
        };
        let running = || Observation::Progress(progress(false, ""));
        for (name, observation) in [
            ("transient", busy as fn() -> Observation),
            ("unreachable", unreachable),
            ("progress", running),
        ] {
            let at_deadline = observe(&new_op(0), observation(), HOUR, HOUR);
            assert!(
                at_deadline.is_none_or(|d| d.next.phase != OperationPhase::Failed && !d.cancel),
                "{name}: failed at the deadline itself"
            );
            let past = observe(&new_op(0), observation(), HOUR, HOUR + 1).unwrap();
            assert_eq!(past.next.error, TIMED_OUT, "{name}");
        }
    }

    #[test]
    fn zero_stall_and_start_deadlines_are_off() {
        let l = limits(Some(0), Some(0));
        let busy = observe_within(&new_op(0), Observation::Transient("busy".into()), &l, HOUR)
            .unwrap()
            .next;
        assert_eq!(busy.phase, OperationPhase::New);
        assert_eq!(
            busy.progressed_ms, None,
            "no stall clock without a deadline"
        );
        let idle = OperationProgress {
            n_total: 10,
            ..Default::default()
        };
        let d = observe_within(&new_op(0), Observation::Progress(idle), &l, HOUR).unwrap();
        assert_eq!(d.next.phase, OperationPhase::New);
        assert!(!d.cancel);
    }
}
