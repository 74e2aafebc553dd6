//! memory: the agent's resident memory once it has swept the `sweep` scenario's
//! database (measured in its passes; this file makes the figures).

use crate::table::{mib, thousands, Row};

/// The rows for `n` unfinished operations of `owners` backups: `rss` the highest resident
/// size after a pass, `peak` the highest VmHWM, `empty` the resident size of an agent
/// with an empty database, all in KiB. What the operations add is taken as growing in
/// proportion to their number, which makes "within 64 MiB" an estimate.
pub fn rows(n: usize, owners: usize, rss: u64, peak: u64, empty: u64) -> Vec<Row> {
    let mut rows = Vec::new();
    rows.push(Row::absolute(
        "memory after sweep",
        mib(rss),
        "≤ 64 MiB",
        rss <= 64 * 1024,
    ));
    rows.push(Row::info("memory peak", mib(peak)));
    rows.push(Row::info("memory empty", mib(empty)));
    let per_op = rss.saturating_sub(empty) as f64 / n.max(1) as f64;
    rows.push(Row::info(
        "memory per 10k ops",
        format!("{:.1} MiB", per_op * 10_000.0 / 1024.0),
    ));
    if per_op > 0.0 {
        let ops = (64.0 * 1024.0 - empty as f64) / per_op;
        let per_owner = n as f64 / owners.max(1) as f64;
        rows.push(Row::info(
            "held in 64 MiB",
            format!(
                "{} ops, {} owners of {} ops",
                thousands(ops),
                thousands(ops / per_owner),
                thousands(per_owner)
            ),
        ));
    }
    rows
}
