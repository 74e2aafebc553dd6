//! restart: spawn to first answered call of an agent whose database holds the `sweep`
//! scenario's operations, against an agent with an empty database.

use std::path::Path;

use crate::agent::Spec;
use crate::register::QUIET;
use crate::snap::Bench;
use crate::table::{dur, median, Row};
use crate::Ctx;

/// The rows: `spec`'s agent (its database holding the sweep's operations) started again and
/// again, and one in `dir/empty`.
pub async fn rows(ctx: &Ctx, spec: &Spec, snap: &Bench, dir: &Path) -> Result<Vec<Row>, String> {
    let s = &ctx.sizes;
    let mut rows = Vec::new();
    snap.release();
    const LIST: &[u8] = br#"{"jsonrpc":"2.0","id":1,"method":"snapshotter.list"}"#;
    // Starts alternate between the two probes: `agent.status` (the figure) and the
    // cheap `snapshotter.list` (which tells start-up from the status call's cost).
    let starts = |spec: Spec| async move {
        let (mut status, mut list) = (Vec::new(), Vec::new());
        for _ in 0..s.restarts {
            let (mut a, ready) = spec.start().await?;
            status.push(ready);
            a.terminate()?;
            let (mut a, ready) = spec.start_probing(LIST).await?;
            list.push(ready);
            a.terminate()?;
        }
        Ok::<_, String>((median(status), median(list)))
    };
    let (full_status, full_list) = starts(spec.clone()).await?;
    let empty_dir = dir.join("empty");
    std::fs::create_dir_all(&empty_dir)
        .map_err(|e| format!("creating {}: {e}", empty_dir.display()))?;
    let empty_spec = Spec::new(ctx, &empty_dir, QUIET);
    let (mut first, _) = empty_spec.start().await?;
    first.terminate()?;
    let (empty_status, empty_list) = starts(empty_spec).await?;
    rows.push(Row::ratio_at_most(
        "restart",
        dur(full_status),
        dur(empty_status),
        2.0,
    ));
    rows.push(Row::info_vs(
        "restart, first list",
        dur(full_list),
        dur(empty_list),
    ));
    Ok(rows)
}
