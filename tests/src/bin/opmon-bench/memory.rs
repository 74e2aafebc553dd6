//! memory: the agent's resident memory once it has swept the `sweep` scenario's
//! database (measured in its passes; this file makes the figures).

use crate::table::{mib, thousands, Row};

/// The rows for `n` unfinished operations, `rss` the highest resident size after a pass
/// and `peak` the highest VmHWM, in KiB.
pub fn rows(n: usize, rss: u64, peak: u64) -> Vec<Row> {
    let mut rows = Vec::new();
    rows.push(Row::absolute(
        format!(
            "memory: agent RSS after the sweep, {} unfinished ops (highest of the passes)",
            thousands(n as f64)
        ),
        mib(rss),
        "≤ 64 MiB",
        rss <= 64 * 1024,
    ));
    rows.push(Row::info(
        "memory: agent peak RSS (VmHWM) during start and sweep",
        mib(peak),
    ));
    rows
}
