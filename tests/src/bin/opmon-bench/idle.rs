//! idle: what an agent costs while operations wait and nothing changes (issue 17.5).
//! 10,000 `steady-` operations over 10 backups, all waiting, polled every 10 s (the
//! default) by a snapshotter that answers the same progress every time, so nothing is
//! committed. The agent's CPU time (utime + stime, /proc/PID/stat) over the window is
//! the figure; the baseline is an agent with nothing to poll, measured over the same
//! window at the same time.

use std::time::{Duration, Instant};

use opmon_client::OwnerPhase;

use crate::agent::Spec;
use crate::register::{add_operations, end_in_progress, operation, start_backups};
use crate::snap::Bench;
use crate::sweep::cpu_ticks;
use crate::table::Row;
use crate::Ctx;

const PLUGIN: &str = "example.io/bench";
const OPERATIONS: usize = 10_000;
const BACKUPS: usize = 10;
/// The target: agent CPU as a share of one core.
const TARGET: f64 = 0.01;

pub async fn run(ctx: &Ctx) -> Result<Vec<Row>, String> {
    let window = if ctx.quick {
        Duration::from_secs(20)
    } else {
        Duration::from_secs(60)
    };
    let dir = ctx.subdir("idle")?;
    let snap = Bench::start(&dir.join("snapshotter.sock")).await?;
    let spec = Spec::new(ctx, &dir, &[]);
    let (mut agent, _) = spec.start().await?;
    let empty_dir = ctx.subdir("idle-empty")?;
    let (mut empty, _) = Spec::new(ctx, &empty_dir, &[]).start().await?;
    let client = agent.client().await?;
    snap.register(&client, PLUGIN).await?;
    let per = OPERATIONS / BACKUPS;
    let names: Vec<String> = (0..BACKUPS).map(|b| format!("idle-{b}")).collect();
    start_backups(ctx, &client, &names).await?;
    for (b, name) in names.iter().enumerate() {
        let ops: Vec<_> = (0..per)
            .map(|i| {
                let mut op = operation(PLUGIN, b, i);
                op.operation_id = format!("steady-{}", op.operation_id);
                op
            })
            .collect();
        add_operations(&client, name, &ops).await?;
        end_in_progress(&client, name, OwnerPhase::WaitingForPluginOperations).await?;
    }
    drop(client);
    let ticks = |pid: u32| cpu_ticks(pid).unwrap_or(0);
    let before = (
        ticks(agent.pid),
        ticks(empty.pid),
        cpu_ticks("self").unwrap_or(0),
    );
    let began = Instant::now();
    tokio::time::sleep(window).await;
    let took = began.elapsed().as_secs_f64();
    let after = (
        ticks(agent.pid),
        ticks(empty.pid),
        cpu_ticks("self").unwrap_or(0),
    );
    agent.terminate()?;
    empty.terminate()?;
    let tick = 1.0
        / nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .unwrap_or(100) as f64;
    let share = |a: u64, b: u64| a.saturating_sub(b) as f64 * tick / took;
    let loaded = share(after.0, before.0);
    let idle = share(after.1, before.1);
    let snapshotter = share(after.2, before.2);
    let pct = |x: f64| format!("{:.2} % of one core", x * 100.0);
    Ok(vec![
        Row {
            figure: "idle CPU".into(),
            value: pct(loaded),
            baseline: pct(idle),
            ratio: "–".into(),
            target: format!("≤ {:.0} % of one core", TARGET * 100.0),
            verdict: if loaded <= TARGET {
                crate::table::Verdict::Pass
            } else {
                crate::table::Verdict::Fail
            },
        },
        Row::info("idle snapshotter CPU", pct(snapshotter)),
    ])
}
