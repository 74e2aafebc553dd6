//! `wait`: follows the owner's subscription until it reaches the phase asked for. On a
//! terminal, live progress bars (one per unfinished operation and one overall); when
//! stdout is not a terminal, one plain line per change, for logs and scripts.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use opmon_client::{Client, Operation, OperationPhase, Owner, OwnerKind, OwnerUpdate, WaitUntil};

use crate::out;
use crate::render::{self, clean};

/// How the changes are shown.
trait View {
    fn show(
        &mut self,
        update: &OwnerUpdate,
        ops: &BTreeMap<String, Operation>,
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
        _ops: &BTreeMap<String, Operation>,
    ) -> Result<(), String> {
        let o = &update.owner;
        let summary = (o.phase, o.operations_completed, o.operations_failed);
        let mut text = String::new();
        if self.last_owner != Some(summary) {
            text.push_str(&format!(
                "{} {}: {} ({}/{} operations completed, {} failed)\n",
                o.kind,
                clean(&o.name),
                o.phase,
                o.operations_completed,
                o.operations_attempted,
                o.operations_failed
            ));
            self.last_owner = Some(summary);
        }
        for op in &update.operations {
            let error = if op.phase == OperationPhase::Failed {
                format!(": {}", clean(&op.error))
            } else {
                String::new()
            };
            text.push_str(&format!(
                "  {} {} {}{error}\n",
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
    ops: BTreeMap<String, ProgressBar>,
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
        if let Some(bar) = self.ops.get(&op.operation_id) {
            return bar.clone();
        }
        // Rates and ETAs count from when the operation started, not from when we looked.
        let running_for = op
            .started
            .map(|t| (time::OffsetDateTime::now_utc() - t).max(time::Duration::ZERO))
            .and_then(|d| Duration::try_from(d).ok())
            .unwrap_or_default();
        let bar = self
            .multi
            .add(ProgressBar::new(op.n_total.max(0) as u64).with_elapsed(running_for));
        let template = if op.operation_units.starts_with("byte") {
            "  {prefix:24} [{bar:30.cyan/blue}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}  {msg}"
        } else {
            "  {prefix:24} [{bar:30.cyan/blue}] {pos}/{len} {per_sec} eta {eta}  {msg}"
        };
        bar.set_style(
            ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_prefix(clean(&op.operation_id).into_owned());
        self.ops.insert(op.operation_id.clone(), bar.clone());
        bar
    }
}

impl View for Bars {
    fn show(
        &mut self,
        update: &OwnerUpdate,
        ops: &BTreeMap<String, Operation>,
    ) -> Result<(), String> {
        let o = &update.owner;
        self.overall
            .set_prefix(format!("{} {}", o.kind, clean(&o.name)));
        self.overall.set_length(o.operations_attempted);
        self.overall
            .set_position(o.operations_completed + o.operations_failed);
        self.overall.set_message(o.phase.to_string());
        for op in ops.values() {
            let known = self.ops.contains_key(&op.operation_id);
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
                _ => bar.set_message(op.phase.to_string()),
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
    let mut ops: BTreeMap<String, Operation> = BTreeMap::new();
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
        // These carry every operation: start over from them.
        if update.lagged || update.resumed {
            ops.clear();
        }
        for op in &update.operations {
            ops.insert(op.operation_id.clone(), op.clone());
        }
        view.show(&update, &ops)?;
        if until.is_reached(update.owner.phase) {
            view.finish();
            return Ok(Some(update.update.owner));
        }
    }
}

/// No progress output (for `-o json`, which prints only the result).
struct Quiet;

impl View for Quiet {
    fn show(&mut self, _: &OwnerUpdate, _: &BTreeMap<String, Operation>) -> Result<(), String> {
        Ok(())
    }
    fn finish(&mut self) {}
}
