//! `wait`: follows the owner's subscription until it reaches the phase asked for. On a
//! terminal, live progress bars (one per unfinished operation and one overall), each
//! line cut to the terminal's width so that redrawing leaves no stale lines behind;
//! when stdout is not a terminal, one plain line per change, for logs and scripts.
//! While the agent cannot be reached (restarting), both say so until it is back.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use opmon_client::{
    Client, Operation, OperationPhase, Owner, OwnerKind, OwnerUpdate, ResourceIdentifier, WaitUntil,
};

use crate::out;
use crate::render::{self, clean};

/// Which operation a bar or a remembered state belongs to. An operation is known by its
/// plugin, its item and its ID together (the agent's identity of an operation): two
/// items' operations may carry the same ID, and each needs a bar of its own.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct OpKey {
    plugin: String,
    item: ResourceIdentifier,
    operation_id: String,
}

impl OpKey {
    fn of(op: &Operation) -> OpKey {
        OpKey {
            plugin: op.plugin.name.clone(),
            item: op.resource.clone(),
            operation_id: op.operation_id.clone(),
        }
    }
}

/// How the changes are shown; by default, not at all.
trait View {
    fn show(&mut self, _: &OwnerUpdate, _: &BTreeMap<OpKey, Operation>) -> Result<(), String> {
        Ok(())
    }
    fn finish(&mut self) {}
    /// The agent cannot be reached: the subscription is reconnecting.
    fn agent_gone(&mut self) {}
}

/// What the agent's absence looks like on screen.
const RECONNECTING: &str = "agent restarting, reconnecting…";

/// How long without an update before `wait` checks that the agent is still there.
const PROBE_AFTER: Duration = Duration::from_secs(2);

/// The owner's progress for its bar: `(done, total, units)`. When every operation counts
/// in one unit and knows its total, the sum of their progress in that unit (the bar
/// moves with the bytes copied, not only when an operation ends); otherwise its
/// operations, finished or not, with no unit.
fn owner_progress(owner: &Owner, ops: &BTreeMap<OpKey, Operation>) -> (u64, u64, Option<String>) {
    let by_operations = (
        owner.operations_completed + owner.operations_failed,
        owner.operations_attempted,
        None,
    );
    let Some(units) = ops.values().next().map(|o| o.operation_units.clone()) else {
        return by_operations;
    };
    let one_unit = ops.len() as u64 == owner.operations_attempted
        && !units.is_empty()
        && ops
            .values()
            .all(|o| o.operation_units == units && o.n_total > 0);
    if !one_unit {
        return by_operations;
    }
    let (mut done, mut total) = (0u64, 0u64);
    for o in ops.values() {
        let n_total = o.n_total.max(0) as u64;
        total += n_total;
        done += if o.phase.is_unfinished() {
            (o.n_completed.max(0) as u64).min(n_total)
        } else {
            n_total
        };
    }
    (done, total, Some(units))
}

/// Plain lines: the owner when it changes, then each changed operation.
struct Lines {
    last_owner: Option<(opmon_client::OwnerPhase, u64, u64)>,
    /// The agent is gone, and this was said.
    gone: bool,
}

impl View for Lines {
    fn show(
        &mut self,
        update: &OwnerUpdate,
        _ops: &BTreeMap<OpKey, Operation>,
    ) -> Result<(), String> {
        let o = &update.owner;
        let summary = (o.phase, o.operations_completed, o.operations_failed);
        let now = time::OffsetDateTime::now_utc();
        let mut text = String::new();
        if std::mem::take(&mut self.gone) {
            text.push_str("agent back\n");
        }
        if self.last_owner != Some(summary) {
            text.push_str(&format!(
                "{} {}: {} ({}/{} operations completed, {} failed)",
                o.kind,
                clean(&o.name),
                o.phase,
                o.operations_completed,
                o.operations_attempted,
                o.operations_failed
            ));
            if let Some(rate) = render::owner_rate(o, now) {
                text.push_str(&format!(" {rate}"));
            }
            text.push('\n');
            self.last_owner = Some(summary);
        }
        for op in &update.operations {
            let mut error = if op.phase == OperationPhase::Failed {
                format!(": {}", clean(op.error.as_deref().unwrap_or("")))
            } else {
                String::new()
            };
            if let Some(last) = render::last_error(op) {
                error.push_str(&format!(" (last error: {last})"));
            }
            // The agent's rate and ETA while it runs (a finished one needs neither).
            let rate = render::rate_and_eta(op, now)
                .filter(|_| op.phase.is_unfinished())
                .map(|r| format!(" {r}"))
                .unwrap_or_default();
            // The item too: operations of two items may share an ID.
            text.push_str(&format!(
                "  {} {} {} {}{rate}{error}\n",
                render::item(&op.resource),
                clean(&op.operation_id),
                op.phase,
                render::progress(op)
            ));
        }
        out::emit(&text)
    }

    fn agent_gone(&mut self) {
        if !self.gone {
            self.gone = true;
            let _ = out::emit(&format!("{RECONNECTING}\n"));
        }
    }
}

/// indicatif bars: one overall, one per operation while it runs.
struct Bars {
    multi: MultiProgress,
    widths: Widths,
    overall: ProgressBar,
    /// The unit the overall bar counts in (`None`: operations).
    overall_units: Option<String>,
    ops: BTreeMap<OpKey, ProgressBar>,
}

/// The widths of a bar line's label and bar, from the terminal's: what is left after
/// them and the counts (`1023.99 MiB/1023.99 MiB`) goes to the message, which is cut to
/// fit, so every line fits a terminal of 50 columns or more.
#[derive(Clone, Copy)]
struct Widths {
    label: usize,
    bar: usize,
}

impl Widths {
    fn of_terminal() -> Widths {
        let (_, columns) = console::Term::stdout().size();
        let columns = usize::from(columns);
        let bar = columns.saturating_sub(60).clamp(5, 20);
        let label = columns.saturating_sub(bar + 38).clamp(8, 24);
        Widths { label, bar }
    }
}

/// The overall bar's style: in bytes or another unit the operations share, or in
/// operations. The message is the line's wide part, cut to what the terminal has left.
fn overall_style(widths: Widths, units: Option<&str>) -> ProgressStyle {
    let count = match units {
        Some(u) if render::is_bytes(u) => "{bytes}/{total_bytes}".to_string(),
        Some(u) => format!("{{pos}}/{{len}} {}", clean(u).replace(['{', '}'], "")),
        None => "{pos}/{len} operations".to_string(),
    };
    let Widths { label, bar } = widths;
    ProgressStyle::with_template(&format!(
        "{{prefix:{label}!.bold}} [{{bar:{bar}.green/white}}] {count}  {{wide_msg}}"
    ))
    .unwrap_or_else(|_| ProgressStyle::default_bar())
}

impl Bars {
    fn new() -> Bars {
        let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stdout());
        let widths = Widths::of_terminal();
        let overall = multi.add(ProgressBar::new(0));
        overall.set_style(overall_style(widths, None));
        overall.enable_steady_tick(Duration::from_millis(200));
        Bars {
            multi,
            widths,
            overall,
            overall_units: None,
            ops: BTreeMap::new(),
        }
    }

    fn bar_for(&mut self, op: &Operation) -> ProgressBar {
        let key = OpKey::of(op);
        if let Some(bar) = self.ops.get(&key) {
            return bar.clone();
        }
        // The rate and the time left are the agent's (in the message), not indicatif's
        // guess from what this process happened to see.
        let bar = self.multi.add(ProgressBar::new(op.n_total.max(0) as u64));
        let count = if render::is_bytes(&op.operation_units) {
            "{bytes}/{total_bytes}"
        } else {
            "{pos}/{len}"
        };
        // Indented under the owner's line, by two columns of the label's.
        let (label, width) = (self.widths.label - 2, self.widths.bar);
        let template =
            format!("  {{prefix:{label}!}} [{{bar:{width}.cyan/blue}}] {count}  {{wide_msg}}");
        bar.set_style(
            ProgressStyle::with_template(&template)
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_prefix(bar_label(op));
        self.ops.insert(key, bar.clone());
        bar
    }
}

/// A bar's label: the item and the operation ID, as the key has them.
fn bar_label(op: &Operation) -> String {
    format!("{} {}", render::item(&op.resource), clean(&op.operation_id))
}

impl View for Bars {
    fn show(
        &mut self,
        update: &OwnerUpdate,
        ops: &BTreeMap<OpKey, Operation>,
    ) -> Result<(), String> {
        let o = &update.owner;
        let now = time::OffsetDateTime::now_utc();
        self.overall
            .set_prefix(format!("{} {}", o.kind, clean(&o.name)));
        let (done, total, units) = owner_progress(o, ops);
        if units != self.overall_units {
            self.overall
                .set_style(overall_style(self.widths, units.as_deref()));
            self.overall_units = units;
        }
        self.overall.set_length(total);
        self.overall.set_position(done);
        self.overall.set_message(match render::owner_rate(o, now) {
            Some(rate) => format!("{}  {rate}", o.phase),
            None => o.phase.to_string(),
        });
        for op in ops.values() {
            let known = self.ops.contains_key(&OpKey::of(op));
            if !known && !op.phase.is_unfinished() {
                continue; // finished before we looked: nothing to watch
            }
            let bar = self.bar_for(op);
            if bar.is_finished() {
                continue;
            }
            if op.n_total > 0 {
                bar.set_length(op.n_total as u64);
            }
            bar.set_position(op.n_completed.max(0) as u64);
            let last = render::last_error(op)
                .map(|e| format!(" (last error: {e})"))
                .unwrap_or_default();
            match op.phase {
                OperationPhase::Completed => bar.finish_with_message("completed"),
                OperationPhase::Failed => bar.abandon_with_message(format!(
                    "failed: {}{last}",
                    clean(op.error.as_deref().unwrap_or(""))
                )),
                // Its error already says `canceled: <reason>`.
                OperationPhase::Canceled => {
                    bar.abandon_with_message(clean(op.error.as_deref().unwrap_or("")).into_owned())
                }
                _ => bar.set_message(match render::rate_and_eta(op, now) {
                    Some(rate) => format!("{}  {rate}{last}", op.phase),
                    None => format!("{}{last}", op.phase),
                }),
            }
        }
        Ok(())
    }

    fn finish(&mut self) {
        self.overall.finish();
    }

    fn agent_gone(&mut self) {
        // The next update (resumed, with everything) sets the message again.
        self.overall.set_message(RECONNECTING);
    }
}

/// Waits for `name`; returns the owner when `until` is reached, or `None` on timeout.
pub async fn wait(
    client: &Client,
    kind: OwnerKind,
    name: &str,
    until: WaitUntil,
    timeout: Option<Duration>,
    quiet: bool,
) -> Result<Option<Owner>, String> {
    let owners = client.owners(kind);
    let mut updates = owners.subscribe(name).await.map_err(|e| e.chain())?;
    let mut view: Box<dyn View> = if quiet {
        Box::new(Quiet)
    } else if std::io::stdout().is_terminal() {
        Box::new(Bars::new())
    } else {
        Box::new(Lines {
            last_owner: None,
            gone: false,
        })
    };
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    let mut ops: BTreeMap<OpKey, Operation> = BTreeMap::new();
    let mut probe = tokio::time::interval(PROBE_AFTER);
    probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut heard = tokio::time::Instant::now();
    loop {
        // The subscription reconnects by itself and says nothing meanwhile; a quiet
        // owner is normal, so after a quiet while `wait` looks whether the agent is
        // there. (`next` keeps its place when the probe's turn drops it.)
        let next = tokio::select! {
            next = updates.next() => next,
            _ = probe.tick() => {
                if heard.elapsed() >= PROBE_AFTER
                    && tokio::net::UnixStream::connect(client.socket()).await.is_err()
                {
                    view.agent_gone();
                }
                continue;
            }
            _ = tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)),
                if deadline.is_some() => {
                view.finish();
                return Ok(None);
            }
        };
        heard = tokio::time::Instant::now();
        let update = match next {
            Some(Ok(update)) => update,
            Some(Err(e)) => {
                view.finish();
                return Err(e.chain());
            }
            // The stream ends after a terminal update, which `until` always accepts.
            None => return Err(format!("the subscription to {kind} {name} ended")),
        };
        remember(&mut ops, &update);
        view.show(&update, &ops)?;
        if until.is_reached(update.owner.phase) {
            view.finish();
            return Ok(Some(update.update.owner));
        }
    }
}

/// Folds an update into the operations known so far.
fn remember(ops: &mut BTreeMap<OpKey, Operation>, update: &opmon_client::Update) {
    // These carry every operation: start over from them.
    if update.lagged || update.resumed {
        ops.clear();
    }
    for op in &update.operations {
        ops.insert(OpKey::of(op), op.clone());
    }
}

/// No progress output (for `-o json`, which prints only the result).
struct Quiet;

impl View for Quiet {}

#[cfg(test)]
mod tests {
    use super::*;
    use opmon_client::OwnerPhase;

    fn op(item: &str, id: &str, n: i64) -> Operation {
        let mut op: Operation = serde_json::from_value(serde_json::json!({
            "plugin": {"kind": "BackupItemAction", "name": "example.io/copier"},
            "resource": {"group": "", "resource": "pods", "namespace": "", "name": ""},
            "operationId": id, "postOperationItems": [], "phase": "InProgress", "error": "",
            "nCompleted": n, "nTotal": 100, "operationUnits": "byte", "description": "",
            "created": "2026-01-01T00:00:00Z", "started": null, "updated": null
        }))
        .unwrap();
        op.resource = render::parse_item(item).unwrap();
        op
    }

    fn update(operations: Vec<Operation>, resumed: bool) -> opmon_client::Update {
        let owner: Owner = serde_json::from_value(serde_json::json!({
            "kind": "backup", "name": "b", "uid": "u", "phase": OwnerPhase::WaitingForPluginOperations,
            "itemOperationTimeout": "4h0m0s", "finalize": true, "errors": 0, "warnings": 0,
            "operationsAttempted": 2, "operationsCompleted": 0, "operationsFailed": 0,
            "postOperationItems": null, "created": "2026-01-01T00:00:00Z",
            "updated": "2026-01-01T00:00:00Z", "completed": null
        }))
        .unwrap();
        opmon_client::Update {
            update: OwnerUpdate {
                owner,
                operations,
                lagged: false,
            },
            resumed,
        }
    }

    #[test]
    fn operations_of_two_items_with_one_id_are_watched_apart() {
        let mut ops = BTreeMap::new();
        remember(
            &mut ops,
            &update(
                vec![
                    op("pods/app/a", "copy-1", 10),
                    op("pods/app/b", "copy-1", 20),
                ],
                false,
            ),
        );
        assert_eq!(ops.len(), 2);
        // A later change of one leaves the other as it was.
        remember(
            &mut ops,
            &update(vec![op("pods/app/b", "copy-1", 90)], false),
        );
        let progress: Vec<(String, i64)> = ops
            .values()
            .map(|o| (o.resource.name.clone(), o.n_completed))
            .collect();
        assert_eq!(progress, [("a".to_string(), 10), ("b".to_string(), 90)]);
        assert_eq!(
            bar_label(&op("pods/app/b", "copy-1", 0)),
            "pods app/b copy-1"
        );
    }

    #[test]
    fn the_owner_bar_sums_bytes_when_every_operation_counts_them() {
        let mut ops = BTreeMap::new();
        let u = update(
            vec![op("pods/app/a", "c-1", 40), op("pods/app/b", "c-2", 10)],
            false,
        );
        remember(&mut ops, &u);
        assert_eq!(
            owner_progress(&u.owner, &ops),
            (50, 200, Some("byte".to_string()))
        );
        // One finished counts whole; one in another unit: back to operations.
        let mut done = op("pods/app/a", "c-1", 90);
        done.phase = OperationPhase::Completed;
        remember(&mut ops, &update(vec![done], false));
        assert_eq!(
            owner_progress(&u.owner, &ops),
            (110, 200, Some("byte".into()))
        );
        let mut files = op("pods/app/b", "c-2", 3);
        files.operation_units = "files".into();
        remember(&mut ops, &update(vec![files], false));
        assert_eq!(owner_progress(&u.owner, &ops), (0, 2, None));
    }

    #[test]
    fn a_resumed_update_replaces_what_was_known() {
        let mut ops = BTreeMap::new();
        remember(
            &mut ops,
            &update(vec![op("pods/app/a", "copy-1", 10)], false),
        );
        remember(&mut ops, &update(vec![op("pods/app/b", "copy-2", 5)], true));
        let names: Vec<&str> = ops.values().map(|o| o.operation_id.as_str()).collect();
        assert_eq!(names, ["copy-2"]);
    }
}
