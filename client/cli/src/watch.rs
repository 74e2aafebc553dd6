//! `wait`: follows the owner's subscription until it reaches the phase asked for. On a
//! terminal, live progress bars (one per unfinished operation and one overall); when
//! stdout is not a terminal, one plain line per change, for logs and scripts.

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

/// How the changes are shown.
trait View {
    fn show(
        &mut self,
        update: &OwnerUpdate,
        ops: &BTreeMap<OpKey, Operation>,
    ) -> Result<(), String>;
    fn finish(&mut self);
}

/// Plain lines: the owner when it changes, then each changed operation.
struct Lines {
    last_owner: Option<(opmon_client::OwnerPhase, u64, u64)>,
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
            let error = if op.phase == OperationPhase::Failed {
                format!(": {}", clean(&op.error))
            } else {
                String::new()
            };
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

    fn finish(&mut self) {}
}

/// indicatif bars: one overall, one per operation while it runs.
struct Bars {
    multi: MultiProgress,
    overall: ProgressBar,
    ops: BTreeMap<OpKey, ProgressBar>,
}

impl Bars {
    fn new() -> Bars {
        let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stdout());
        let overall = multi.add(ProgressBar::new(0));
        overall.set_style(
            ProgressStyle::with_template(
                "{prefix:.bold} [{bar:40.green/white}] {pos}/{len} operations  {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        overall.enable_steady_tick(Duration::from_millis(200));
        Bars {
            multi,
            overall,
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
        let template = if op.operation_units.starts_with("byte") {
            "  {prefix:40} [{bar:30.cyan/blue}] {bytes}/{total_bytes}  {msg}"
        } else {
            "  {prefix:40} [{bar:30.cyan/blue}] {pos}/{len}  {msg}"
        };
        bar.set_style(
            ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()),
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
        self.overall.set_length(o.operations_attempted);
        self.overall
            .set_position(o.operations_completed + o.operations_failed);
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
            match op.phase {
                OperationPhase::Completed => bar.finish_with_message("completed"),
                OperationPhase::Failed => {
                    bar.abandon_with_message(format!("failed: {}", clean(&op.error)))
                }
                // Its error already says `canceled: <reason>`.
                OperationPhase::Canceled => bar.abandon_with_message(clean(&op.error).into_owned()),
                _ => bar.set_message(match render::rate_and_eta(op, now) {
                    Some(rate) => format!("{}  {rate}", op.phase),
                    None => op.phase.to_string(),
                }),
            }
        }
        Ok(())
    }

    fn finish(&mut self) {
        self.overall.finish();
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
        Box::new(Lines { last_owner: None })
    };
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    let mut ops: BTreeMap<OpKey, Operation> = BTreeMap::new();
    loop {
        let next = match deadline {
            Some(d) => match tokio::time::timeout_at(d, updates.next()).await {
                Ok(next) => next,
                Err(_) => {
                    view.finish();
                    return Ok(None);
                }
            },
            None => updates.next().await,
        };
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

impl View for Quiet {
    fn show(&mut self, _: &OwnerUpdate, _: &BTreeMap<OpKey, Operation>) -> Result<(), String> {
        Ok(())
    }
    fn finish(&mut self) {}
}

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
