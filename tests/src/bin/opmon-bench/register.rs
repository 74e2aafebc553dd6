//! register-batch and register-concurrent: `backup.addOperations` throughput against
//! raw rusqlite inserts of the same rows.

use std::time::Instant;

use opmon_client::{Client, NewOperation, PluginKind, PluginRef, ResourceIdentifier};

use crate::agent::{self, Spec};
use crate::table::{median_f64, per_sec, Row};
use crate::{raw, sqlite, Ctx};

/// Flags of an agent that should not poll while it is measured.
pub const QUIET: &[&str] = &["--poll-interval", "1h", "--call-deadline", "1h"];

/// Operation `i` of owner `owner` for `plugin`: a CSI-style volume snapshot of a PVC.
pub fn operation(plugin: &str, owner: usize, i: usize) -> NewOperation {
    NewOperation {
        plugin: PluginRef {
            kind: PluginKind::BackupItemAction,
            name: plugin.into(),
        },
        resource: ResourceIdentifier {
            group: String::new(),
            resource: "persistentvolumeclaims".into(),
            namespace: format!("ns-{}", i % 50),
            name: format!("data-{owner}-{i}"),
        },
        operation_id: format!(
            "ns-{}/velero-data-{owner}-{i}-{:08x}",
            i % 50,
            mix(owner, i)
        ),
        post_operation_items: Vec::new(),
        created: None,
    }
}

/// A stable pseudo-random number per (owner, i), so IDs look like Velero's.
fn mix(owner: usize, i: usize) -> u32 {
    let mut x = (owner as u64) << 32 | i as u64;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x as u32
}

/// A UUID-shaped uid derived from the name.
pub fn uid(name: &str) -> String {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        h >> 32,
        (h >> 16) & 0xffff,
        h & 0xfff,
        (h >> 4) & 0xfff,
        h & 0xffff_ffff_ffff
    )
}

/// Starts backups `names` on `client`.
/// Starts `names`, with the owner object of `ctx` (`--owner-object`) if it has one.
pub async fn start_backups(ctx: &Ctx, client: &Client, names: &[String]) -> Result<(), String> {
    for name in names {
        client
            .backups()
            .request::<opmon_client::methods::Start>(opmon_client::StartParams {
                name: name.clone(),
                uid: uid(name),
                object: ctx.owner_object.clone(),
                ..opmon_client::StartParams::default()
            })
            .await
            .map_err(|e| format!("backup.start {name}: {e}"))?;
    }
    Ok(())
}

/// Adds `ops` to backup `name`, 1,000 per call.
pub async fn add_operations(
    client: &Client,
    name: &str,
    ops: &[NewOperation],
) -> Result<(), String> {
    for chunk in ops.chunks(1000) {
        client
            .backups()
            .add_operations(name, chunk.to_vec())
            .await
            .map_err(|e| format!("backup.addOperations {name}: {e}"))?;
    }
    Ok(())
}

/// Ends backup `name`'s InProgress; fails unless it is then in phase `expected`.
pub async fn end_in_progress(
    client: &Client,
    name: &str,
    expected: opmon_client::OwnerPhase,
) -> Result<(), String> {
    let owner = client
        .backups()
        .end_in_progress(name)
        .await
        .map_err(|e| format!("backup.endInProgress {name}: {e}"))?;
    if owner.phase != expected {
        return Err(format!(
            "{name} is {} after endInProgress; expected {expected}",
            owner.phase
        ));
    }
    Ok(())
}

/// The mean size of the agent's commit groups, from its metrics.
fn mean_commit_group(socket: &std::path::Path) -> Option<f64> {
    let page = raw::metrics(socket).ok()?;
    let sum = raw::metric_sum(&page, "opmon_commit_batch_size_sum")?;
    let count = raw::metric_sum(&page, "opmon_commit_batch_size_count")?;
    (count > 0.0).then(|| sum / count)
}

/// One run of register-batch in `dir`: the agent's rate, the baseline's, and the bytes
/// the agent's database files take per operation once it has stopped.
async fn batch_once(ctx: &Ctx, dir: &std::path::Path) -> Result<(f64, f64, f64), String> {
    let s = &ctx.sizes;
    let per_owner = s.batch_total / s.batch_backups;
    let owners: Vec<Vec<NewOperation>> = (0..s.batch_backups)
        .map(|b| {
            (0..per_owner)
                .map(|i| operation("example.io/bench", b, i))
                .collect()
        })
        .collect();
    let total = per_owner * s.batch_backups;

    let spec = Spec::new(ctx, dir, QUIET);
    let (mut agent, _) = spec.start().await?;
    let client = agent.client().await?;
    let names: Vec<String> = (0..s.batch_backups).map(|b| format!("batch-{b}")).collect();
    start_backups(ctx, &client, &names).await?;
    let calls: Vec<(String, Vec<NewOperation>)> = names
        .iter()
        .zip(&owners)
        .flat_map(|(name, ops)| {
            ops.chunks(s.batch_per_call)
                .map(|chunk| (name.clone(), chunk.to_vec()))
                .collect::<Vec<_>>()
        })
        .collect();
    let began = Instant::now();
    for (name, chunk) in calls {
        let n = chunk.len() as u64;
        let added = client
            .backups()
            .add_operations(&name, chunk)
            .await
            .map_err(|e| format!("backup.addOperations {name}: {e}"))?;
        if added.added != n {
            return Err(format!(
                "backup.addOperations {name} added {} of {n}",
                added.added
            ));
        }
    }
    let took = began.elapsed();
    drop(client);
    agent.terminate()?;
    let db = spec.database();
    let disk: u64 = ["", "-wal", "-shm"]
        .iter()
        .filter_map(|suffix| std::fs::metadata(format!("{}{suffix}", db.display())).ok())
        .map(|m| m.len())
        .sum();
    let base = sqlite::batched(&dir.join("baseline.db"), &owners, s.batch_per_call)?;
    Ok((
        total as f64 / took.as_secs_f64(),
        total as f64 / base.as_secs_f64(),
        disk as f64 / total as f64,
    ))
}

/// register-batch: `addOperations` of 1,000 ops per call, one call at a time, against
/// raw inserts of the same rows, 1,000 per transaction.
pub async fn batch(ctx: &Ctx) -> Result<Vec<Row>, String> {
    let s = &ctx.sizes;
    let (mut rates, mut bases, mut disk) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..s.repeats {
        let dir = ctx.subdir(&format!("register-batch/{r}"))?;
        let (rate, base, bytes_per_op) = batch_once(ctx, &dir).await?;
        rates.push(rate);
        bases.push(base);
        disk.push(bytes_per_op);
    }
    Ok(vec![
        Row::ratio_at_least(
            "register-batch",
            per_sec(median_f64(rates), "ops"),
            per_sec(median_f64(bases), "ops"),
            0.5,
        ),
        Row::info(
            "disk per 1k ops",
            format!("{:.0} KiB", median_f64(disk) * 1000.0 / 1024.0),
        ),
    ])
}

/// What one run of register-concurrent measured.
struct ConcurrentRun {
    rate: f64,
    base: f64,
    /// One lone client's calls: the p50 latency, in seconds.
    lone_p50: f64,
    group: Option<f64>,
    problems: Vec<String>,
}

async fn concurrent_once(ctx: &Ctx, dir: &std::path::Path) -> Result<ConcurrentRun, String> {
    let s = &ctx.sizes;
    let spec = Spec::new(ctx, dir, QUIET);
    let (mut agent, _) = spec.start().await?;
    let mut workers = Vec::new();
    for c in 0..s.concurrent_clients {
        let client = agent.client().await?;
        let name = format!("concurrent-{c}");
        start_backups(ctx, &client, std::slice::from_ref(&name)).await?;
        let ops: Vec<NewOperation> = (0..s.concurrent_calls)
            .map(|i| operation("example.io/bench", c, i))
            .collect();
        workers.push((client, name, ops));
    }
    let total = s.concurrent_clients * s.concurrent_calls;
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(s.concurrent_clients + 1));
    let tasks: Vec<_> = workers
        .into_iter()
        .map(|(client, name, ops)| {
            let start = start.clone();
            tokio::spawn(async move {
                start.wait().await;
                for op in ops {
                    let added = client
                        .backups()
                        .add_operations(&name, vec![op])
                        .await
                        .map_err(|e| format!("backup.addOperations {name}: {e}"))?;
                    if added.added != 1 {
                        return Err(format!("backup.addOperations {name} added nothing"));
                    }
                }
                Ok::<_, String>(client)
            })
        })
        .collect();
    start.wait().await;
    let began = Instant::now();
    let mut clients = Vec::new();
    for task in tasks {
        clients.push(
            task.await
                .map_err(|e| format!("a client task failed: {e}"))??,
        );
    }
    let took = began.elapsed();
    let group = mean_commit_group(&spec.socket);
    // Then one caller alone, one call at a time: group commit must not make it wait.
    let lone = clients.pop().ok_or("no clients")?;
    drop(clients);
    let name = "lone".to_string();
    start_backups(ctx, &lone, std::slice::from_ref(&name)).await?;
    let mut latencies = Vec::new();
    for i in 0..s.concurrent_calls * 4 {
        let op = operation("example.io/bench", s.concurrent_clients, i);
        let began = Instant::now();
        lone.backups()
            .add_operations(&name, vec![op])
            .await
            .map_err(|e| format!("backup.addOperations {name}: {e}"))?;
        latencies.push(began.elapsed().as_secs_f64());
    }
    drop(lone);
    agent.terminate()?;

    let ops: Vec<NewOperation> = (0..total)
        .map(|i| operation("example.io/bench", 0, i))
        .collect();
    let base = sqlite::one_per_commit(&dir.join("baseline.db"), &ops)?;
    Ok(ConcurrentRun {
        rate: total as f64 / took.as_secs_f64(),
        base: total as f64 / base.as_secs_f64(),
        lone_p50: median_f64(latencies),
        group,
        problems: agent::log_problems(&spec.log),
    })
}

/// The mean requests per group commit register-concurrent must reach.
const MIN_COMMIT_GROUP: f64 = 8.0;

/// register-concurrent: 64 clients, each on its own connection and backup, adding one
/// operation per call, against raw inserts of one row per committed transaction.
pub async fn concurrent(ctx: &Ctx) -> Result<Vec<Row>, String> {
    let mut runs = Vec::new();
    // Five runs (each the agent, then the baseline): the baseline follows the disk's
    // fsync time, which drifts, so both are measured in alternation.
    let repeats = 5;
    for r in 0..repeats {
        let dir = ctx.subdir(&format!("register-concurrent/{r}"))?;
        runs.push(concurrent_once(ctx, &dir).await?);
    }
    // The ratio follows the disk's fsync time; what group commit does on any disk is
    // how many requests share one commit, which is the target.
    let mut rows = vec![Row::info_vs(
        "register-concurrent",
        per_sec(median_f64(runs.iter().map(|r| r.rate).collect()), "ops"),
        per_sec(median_f64(runs.iter().map(|r| r.base).collect()), "ops"),
    )];
    let groups: Vec<f64> = runs.iter().filter_map(|r| r.group).collect();
    let group = (!groups.is_empty()).then(|| median_f64(groups));
    let clients = ctx.sizes.concurrent_clients;
    rows.push(Row::absolute(
        "commit group size",
        group.map_or("unknown (no metrics)".into(), |g| {
            format!("{g:.1} at {clients} clients")
        }),
        format!("≥ {MIN_COMMIT_GROUP} at {clients} clients"),
        group.is_some_and(|g| g >= MIN_COMMIT_GROUP),
    ));
    let lone = median_f64(runs.iter().map(|r| r.lone_p50).collect());
    let per_commit = median_f64(runs.iter().map(|r| 1.0 / r.base).collect());
    rows.push(Row::info_vs(
        "register-lone p50",
        crate::table::dur(std::time::Duration::from_secs_f64(lone)),
        crate::table::dur(std::time::Duration::from_secs_f64(per_commit)),
    ));
    if let Some(problems) = runs.iter().map(|r| &r.problems).find(|p| !p.is_empty()) {
        rows.push(Row::info(
            "register log problems",
            format!("{}: {}", problems.len(), problems[0]),
        ));
    }
    Ok(rows)
}
