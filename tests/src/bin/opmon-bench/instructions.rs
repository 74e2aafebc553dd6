//! instructions: the agent's instructions per polled-and-committed operation
//! (issue 17.2), counted by valgrind's callgrind, which counts work rather than time
//! and so holds on a shared machine.
//!
//! The `sweep` database in small: 10 backups of unfinished operations, each answer a
//! new `nCompleted`, so every poll is committed. The agent runs under callgrind with
//! instrumentation off; the pass is set up as `sweep` sets it up (the snapshotter holds
//! the first calls until the agent is idle), instrumentation is switched on
//! (`callgrind_control -i on`), the calls are released, and it is switched off once the
//! last change is committed. Instructions counted ÷ operations is the figure; the
//! baseline is the same pass with `--batch-size 1 --socket-concurrency 1`.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use opmon_client::OwnerPhase;

use crate::agent::Spec;
use crate::register::{add_operations, end_in_progress, operation, start_backups, QUIET};
use crate::snap::Bench;
use crate::sweep::{wait_committed, wait_idle, PASS_WITHIN};
use crate::table::{thousands, Row};
use crate::Ctx;

const PLUGIN: &str = "example.io/bench";
const BACKUPS: usize = 10;
/// Instructions per operation at the start of issue 17.2's work: commit a01a773's
/// agent, measured by this scenario in full mode on 2026-11-22 (33,429; its serial
/// baseline 62,572). The target is half of it.
const AT_START: f64 = 33_429.0;

fn callgrind_control(pid: u32, on: bool) -> Result<(), String> {
    let out = Command::new("callgrind_control")
        .args(["-i", if on { "on" } else { "off" }, &pid.to_string()])
        .output()
        .map_err(|e| format!("running callgrind_control (install valgrind): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "callgrind_control -i on {pid}: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

/// The `totals:` line of a callgrind output file: instructions executed.
fn totals(path: &Path) -> Result<f64, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    text.lines()
        .find_map(|l| l.strip_prefix("totals:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("{} has no totals line", path.display()))
}

/// One pass of the agent of `spec` under callgrind; instructions per operation.
async fn counted(spec: &Spec, snap: &Bench, n: usize, out: &Path) -> Result<f64, String> {
    let mut spec = spec.clone();
    spec.wrapper = vec![
        "valgrind".into(),
        "--tool=callgrind".into(),
        "--instr-atstart=no".into(),
        format!("--callgrind-out-file={}", out.display()),
    ];
    snap.hold();
    snap.arm(n as u64);
    let (mut agent, _) = spec.start().await?;
    snap.wait_held(1, Duration::from_secs(300)).await?;
    wait_idle(&agent, Duration::from_millis(500)).await?;
    tokio::task::block_in_place(|| callgrind_control(agent.pid, true))?;
    snap.release();
    let marked = snap.wait_marked(PASS_WITHIN).await?;
    wait_committed(&spec.database(), &marked).await?;
    tokio::task::block_in_place(|| callgrind_control(agent.pid, false))?;
    agent.terminate()?;
    Ok(totals(out)? / n as f64)
}

pub async fn run(ctx: &Ctx) -> Result<Vec<Row>, String> {
    let n = if ctx.quick { 2_000 } else { 10_000 };
    let dir = ctx.subdir("instructions")?;
    let snap = Bench::start(&dir.join("snapshotter.sock")).await?;
    let spec = Spec::new(ctx, &dir, QUIET);
    let (mut agent, _) = spec.start().await?;
    let client = agent.client().await?;
    snap.register(&client, PLUGIN).await?;
    let per = n / BACKUPS;
    let names: Vec<String> = (0..BACKUPS).map(|b| format!("instr-{b}")).collect();
    start_backups(ctx, &client, &names).await?;
    for (b, name) in names.iter().enumerate() {
        let ops: Vec<_> = (0..per).map(|i| operation(PLUGIN, b, i)).collect();
        add_operations(&client, name, &ops).await?;
        end_in_progress(&client, name, OwnerPhase::WaitingForPluginOperations).await?;
    }
    drop(client);
    agent.terminate()?;
    let n = per * BACKUPS;
    let batched = counted(&spec, &snap, n, &dir.join("callgrind.batched")).await?;
    let serial_spec =
        spec.with_args(&[QUIET, &["--batch-size", "1", "--socket-concurrency", "1"]].concat());
    let serial = counted(&serial_spec, &snap, n, &dir.join("callgrind.serial")).await?;
    let text = |v: f64| format!("{} instructions/op", thousands(v));
    let target = AT_START / 2.0;
    Ok(vec![Row {
        figure: "instructions per op".into(),
        value: text(batched),
        baseline: text(serial),
        ratio: format!("{:.2}×", batched / serial),
        target: if target.is_finite() {
            format!(
                "≤ {} (half of {} at the start)",
                thousands(target),
                thousands(AT_START)
            )
        } else {
            "–".into()
        },
        verdict: if !target.is_finite() {
            crate::table::Verdict::Info
        } else if batched <= target {
            crate::table::Verdict::Pass
        } else {
            crate::table::Verdict::Fail
        },
    }])
}
