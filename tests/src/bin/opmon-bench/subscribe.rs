//! subscribe: a sweep pass over the `sweep` scenario's database with subscribers to
//! every backup, against the same pass without them.

use crate::agent::Spec;
use crate::snap::Bench;
use crate::sweep::pass;
use crate::table::{dur, per_sec, thousands, Row};
use crate::Ctx;

/// The rows: one pass of `spec`'s agent over `n` operations of backups `names` with
/// subscribers, against `rate`, the calls/s of the passes without.
pub async fn rows(
    ctx: &Ctx,
    spec: &Spec,
    snap: &Bench,
    n: usize,
    names: &[String],
    rate: f64,
) -> Result<Vec<Row>, String> {
    let s = &ctx.sizes;
    let mut rows = Vec::new();
    let with = pass(spec, snap, n, Some((names, s.subscribers))).await?;
    let mut with_agent = with.agent;
    with_agent.terminate()?;
    let with_rate = n as f64 / with.took.as_secs_f64();
    let figures = with.subscribers.ok_or("no subscriber figures")?;
    let window = figures.window.as_secs_f64().max(1e-9);
    rows.push(Row::info(
        "subscribe notifications",
        format!(
            "{} ({} notifications carrying {} of the {} operation changes, over {})",
            per_sec(figures.notifications as f64 / window, "notifications").1,
            thousands(figures.notifications as f64),
            thousands(figures.operations as f64),
            thousands((s.subscribers * (n / names.len().max(1))) as f64),
            dur(figures.window).1
        ),
    ));
    rows.push(Row::ratio_at_least(
        "subscribe sweep",
        per_sec(with_rate, "calls"),
        per_sec(rate, "calls"),
        0.9,
    ));
    if figures.errors > 0 {
        rows.push(Row::info(
            "subscribe errors",
            format!(
                "{}: {}",
                figures.errors,
                figures.first_error.unwrap_or_default()
            ),
        ));
    }
    Ok(rows)
}
