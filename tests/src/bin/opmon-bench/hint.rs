//! hint: prompt completion (issue 17.4). How long after a snapshotter's operation
//! finishes its owner reaches its next phase (Finalizing), as a client waiting on the
//! owner sees it: with the SDK's `snapshotter.changed` hint, and without it (the agent
//! finds the change at its next poll, every 10 s by default).
//!
//! One agent at the default poll interval; `n` backups of one `until-` operation each,
//! all waiting. Their operations finish one after another, evenly spread over three
//! poll intervals (so the polls fall anywhere between them); every other one is hinted.
//! A `backup.wait` per backup, in place before the change, returns at the new phase.

use std::time::{Duration, Instant};

use opmon_client::{Client, OwnerPhase, WaitUntil};
use opmon_snapshotter::Hints;

use crate::agent::Spec;
use crate::register::{add_operations, end_in_progress, operation, start_backups};
use crate::snap::Bench;
use crate::table::{dur, quantile, Row};
use crate::Ctx;

const PLUGIN: &str = "example.io/bench";
/// The agent's default poll interval, which the figure without hints follows.
const POLL: Duration = Duration::from_secs(10);
/// The target for the hinted p50.
const TARGET_P50: Duration = Duration::from_millis(50);

pub async fn run(ctx: &Ctx) -> Result<Vec<Row>, String> {
    let (n, span) = if ctx.quick {
        (20, POLL)
    } else {
        (100, 3 * POLL)
    };
    let dir = ctx.subdir("hint")?;
    let snap = Bench::start(&dir.join("snapshotter.sock")).await?;
    let spec = Spec::new(ctx, &dir, &[]);
    let (mut agent, _) = spec.start().await?;
    let client = Client::builder(&spec.socket)
        .max_connections(n + 4)
        .connect()
        .await
        .map_err(|e| format!("connecting to the agent: {e}"))?;
    snap.register(&client, PLUGIN).await?;
    let names: Vec<String> = (0..n).map(|i| format!("hint-{i}")).collect();
    start_backups(ctx, &client, &names).await?;
    let mut ids = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let mut op = operation(PLUGIN, i, 0);
        op.operation_id = format!("until-{i}");
        ids.push(op.operation_id.clone());
        add_operations(&client, name, &[op]).await?;
        end_in_progress(&client, name, OwnerPhase::WaitingForPluginOperations).await?;
    }
    let hints = Hints::new(&spec.socket, PLUGIN);
    let waiters: Vec<_> = names
        .iter()
        .map(|name| {
            let (client, name) = (client.clone(), name.clone());
            tokio::spawn(async move {
                let waited = client
                    .backups()
                    .wait(&name, WaitUntil::ReadyToFinalize, span + 4 * POLL)
                    .await;
                (Instant::now(), name, waited)
            })
        })
        .collect();
    // The waits reach the agent before the first change.
    let began = Instant::now() + Duration::from_secs(1);
    let mut changed = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        tokio::time::sleep_until((began + span * i as u32 / n as u32).into()).await;
        snap.finish(id);
        changed.push(Instant::now());
        if i % 2 == 0 {
            hints.changed(id);
        }
    }
    let (mut hinted, mut unhinted) = (Vec::new(), Vec::new());
    for (i, waiter) in waiters.into_iter().enumerate() {
        let (at, name, waited) = waiter.await.map_err(|e| format!("a waiter failed: {e}"))?;
        let waited = waited.map_err(|e| format!("backup.wait {name}: {e}"))?;
        if waited.timed_out || waited.owner.phase != OwnerPhase::Finalizing {
            return Err(format!(
                "{name} is {} {} after its operation finished",
                waited.owner.phase,
                if waited.timed_out { "(timed out)" } else { "" }
            ));
        }
        let latency = at.saturating_duration_since(changed[i]);
        if i % 2 == 0 {
            hinted.push(latency);
        } else {
            unhinted.push(latency);
        }
    }
    agent.terminate()?;
    hinted.sort();
    unhinted.sort();
    let (p50, p99) = (quantile(&hinted, 0.5), quantile(&hinted, 0.99));
    let (base50, base99) = (quantile(&unhinted, 0.5), quantile(&unhinted, 0.99));
    let pair = |a: Duration, b: Duration| format!("{} / {}", dur(a).1, dur(b).1);
    Ok(vec![Row {
        figure: "hint p50 / p99".into(),
        value: pair(p50, p99),
        baseline: pair(base50, base99),
        ratio: format!("{:.3}×", p50.as_secs_f64() / base50.as_secs_f64()),
        target: format!("p50 ≤ {} ms", TARGET_P50.as_millis()),
        verdict: if p50 <= TARGET_P50 {
            crate::table::Verdict::Pass
        } else {
            crate::table::Verdict::Fail
        },
    }])
}
