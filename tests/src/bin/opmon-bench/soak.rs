//! --soak DURATION: the whole workflow, over and over, against one agent (start, add
//! operations, subscribe, endInProgress, poll to Finalizing, finalize with a tarball,
//! delete), with the agent's resident memory and open descriptors sampled each second.
//! Both must be flat: the end no higher than the start plus a small tolerance.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opmon_client::{Client, Contents, FinalizeParams, OwnerPhase, UpdatedItem, WaitUntil};

use crate::agent::{self, Spec};
use crate::register::{operation, uid};
use crate::snap::Bench;
use crate::table::{mib, thousands, Row, Verdict};
use crate::Ctx;

const PLUGIN: &str = "example.io/soak";
const WORKERS: usize = 4;
const OPS_PER_BACKUP: usize = 20;
/// How long the agent is left alone before an idle sample.
const SETTLE: Duration = Duration::from_secs(2);

#[derive(Default)]
struct Counts {
    iterations: AtomicU64,
    errors: AtomicU64,
    first_errors: Mutex<Vec<String>>,
}

impl Counts {
    fn failed(&self, e: String) {
        self.errors.fetch_add(1, Ordering::SeqCst);
        if let Ok(mut first) = self.first_errors.lock() {
            if first.len() < 5 {
                first.push(e);
            }
        }
    }
}

/// One pass of the workflow for backup `name`.
async fn workflow(
    client: &Client,
    name: &str,
    tarball: &std::path::Path,
    worker: usize,
    i: usize,
) -> Result<(), String> {
    let backups = client.backups();
    backups
        .start(name, &uid(name))
        .await
        .map_err(|e| format!("start {name}: {e}"))?;
    let ops = (0..OPS_PER_BACKUP)
        .map(|k| {
            let mut op = operation(PLUGIN, worker, i * OPS_PER_BACKUP + k);
            op.operation_id = format!("soak-{worker}-{i}-{k}");
            op
        })
        .collect();
    backups
        .add_operations(name, ops)
        .await
        .map_err(|e| format!("addOperations {name}: {e}"))?;
    let mut updates = backups
        .subscribe(name)
        .await
        .map_err(|e| format!("subscribe {name}: {e}"))?;
    let watcher = tokio::spawn(async move {
        let mut seen = 0u64;
        while let Some(update) = updates.next().await {
            update.map_err(|e| format!("an update: {e}"))?;
            seen += 1;
        }
        Ok::<_, String>(seen)
    });
    let owner = backups
        .end_in_progress(name)
        .await
        .map_err(|e| format!("endInProgress {name}: {e}"))?;
    if owner.phase != OwnerPhase::WaitingForPluginOperations {
        return Err(format!("{name} is {} after endInProgress", owner.phase));
    }
    let waited = backups
        .wait(name, WaitUntil::ReadyToFinalize, Duration::from_secs(60))
        .await
        .map_err(|e| format!("wait {name}: {e}"))?;
    if waited.timed_out || waited.owner.phase != OwnerPhase::Finalizing {
        return Err(format!(
            "{name} is {} after waiting for ReadyToFinalize (timed out: {})",
            waited.owner.phase, waited.timed_out
        ));
    }
    let updated_items = (0..2)
        .map(|k| {
            let (resource, api_version, kind) = crate::finalize::item(k * 4);
            UpdatedItem {
                object: serde_json::json!({
                    "apiVersion": api_version, "kind": kind,
                    "metadata": {"name": resource.name, "namespace": resource.namespace},
                }),
                resource,
            }
        })
        .collect();
    let done = backups
        .request::<opmon_client::methods::Finalize>(FinalizeParams {
            name: name.into(),
            contents: Some(Contents {
                input: tarball.to_path_buf(),
                // The backup server's file, not the agent's (delete leaves it): one
                // per worker, overwritten each time, so the disk does not fill up.
                output: format!("soak-output/{worker}.tar.gz").into(),
            }),
            updated_items,
            ..Default::default()
        })
        .await
        .map_err(|e| format!("finalize {name}: {e}"))?;
    if done.owner.phase != OwnerPhase::Completed {
        return Err(format!("{name} is {} after finalize", done.owner.phase));
    }
    let records = backups
        .item_operations(name)
        .await
        .map_err(|e| format!("itemOperations {name}: {e}"))?;
    if records.len() != OPS_PER_BACKUP {
        return Err(format!("{name} has {} item operations", records.len()));
    }
    backups
        .delete(name)
        .await
        .map_err(|e| format!("delete {name}: {e}"))?;
    match tokio::time::timeout(Duration::from_secs(30), watcher).await {
        Ok(Ok(Ok(_))) => Ok(()),
        Ok(Ok(Err(e))) => Err(format!("subscription of {name}: {e}")),
        Ok(Err(e)) => Err(format!("subscription task of {name}: {e}")),
        Err(_) => Err(format!(
            "the subscription of {name} did not end within 30 s of the terminal phase"
        )),
    }
}

#[derive(Clone, Copy, Debug)]
struct Sample {
    rss_kib: u64,
    fds: u64,
}

pub async fn run(ctx: &Ctx, duration: Duration) -> Result<Vec<Row>, String> {
    let dir = ctx.subdir("soak")?;
    let tarball = dir.join("small.tar.gz");
    crate::finalize::build_tarball(&tarball, 200, 400)?;
    let snap = Bench::start(&dir.join("snapshotter.sock")).await?;
    // The tarball lies beside the state directory: allowed by finalize_dirs.
    let dirs = dir.display().to_string();
    let spec = Spec::new(
        ctx,
        &dir,
        &["--poll-interval", "100ms", "--finalize-dirs", &dirs],
    );
    let (mut agent, _) = spec.start().await?;
    let admin = agent.client().await?;
    snap.register(&admin, PLUGIN).await?;
    let sample = |agent: &agent::Agent| -> Result<Sample, String> {
        Ok(Sample {
            rss_kib: agent.rss_kib()?,
            fds: agent.open_fds()?,
        })
    };
    let at_start = sample(&agent)?;

    let counts = Arc::new(Counts::default());
    let stop = Arc::new(AtomicBool::new(false));
    // Workers hold it shared for each workflow; taking it exclusively pauses them, so
    // the start and end samples are both taken with the agent idle.
    let gate = Arc::new(tokio::sync::RwLock::new(()));
    let mut workers = Vec::new();
    for w in 0..WORKERS {
        let client = agent.client().await?;
        let (counts, stop, tarball) = (counts.clone(), stop.clone(), tarball.clone());
        let gate = gate.clone();
        workers.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let name = format!("soak-{w}-{i}");
                let _turn = gate.read().await;
                match workflow(&client, &name, &tarball, w, i).await {
                    Ok(()) => {
                        counts.iterations.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(e) => {
                        counts.failed(e);
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
                i += 1;
            }
        }));
    }

    let began = Instant::now();
    let warmup = (duration / 10).min(Duration::from_secs(30));
    let mut samples: Vec<(Duration, Sample)> = Vec::new();
    let mut start: Option<Sample> = None;
    let mut reported = Instant::now();
    while began.elapsed() < duration {
        tokio::time::sleep(Duration::from_secs(1).min(duration)).await;
        let now = sample(&agent)?;
        samples.push((began.elapsed(), now));
        if start.is_none()
            && began.elapsed() >= warmup
            && counts.iterations.load(Ordering::SeqCst) > 0
        {
            let _paused = gate.write().await;
            tokio::time::sleep(SETTLE).await;
            start = Some(sample(&agent)?);
        }
        if reported.elapsed() >= Duration::from_secs(30) {
            reported = Instant::now();
            eprintln!(
                "opmon-bench: soak {:.0} s: {} workflows, {} errors, RSS {}, {} fds",
                began.elapsed().as_secs_f64(),
                counts.iterations.load(Ordering::SeqCst),
                counts.errors.load(Ordering::SeqCst),
                mib(now.rss_kib),
                now.fds
            );
        }
    }
    let busy = samples.last().map(|s| s.1).unwrap_or(at_start);
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        let _ = w.await;
    }
    tokio::time::sleep(SETTLE).await;
    let end = sample(&agent)?;
    drop(admin);
    agent.terminate()?;
    let start = start.unwrap_or(at_start);

    let iterations = counts.iterations.load(Ordering::SeqCst);
    let errors = counts.errors.load(Ordering::SeqCst);
    let max_rss = samples.iter().map(|s| s.1.rss_kib).max().unwrap_or(0);
    let max_fds = samples.iter().map(|s| s.1.fds).max().unwrap_or(0);
    let rss_allowed = start.rss_kib + (4 * 1024).max(start.rss_kib / 10);
    let fds_allowed = start.fds + 4;
    let verdict = |ok: bool| if ok { Verdict::Pass } else { Verdict::Fail };
    let mut rows = vec![
        Row::absolute(
            "soak workflows, errors",
            format!(
                "{} workflows ({:.1}/s), {errors} errors",
                thousands(iterations as f64),
                iterations as f64 / duration.as_secs_f64()
            ),
            "0 errors",
            errors == 0 && iterations > 0,
        ),
        Row {
            figure: format!(
                "soak: agent RSS at the end, idle (baseline: idle after {:.0} s of warm-up)",
                warmup.as_secs_f64()
            ),
            value: mib(end.rss_kib),
            baseline: mib(start.rss_kib),
            ratio: format!("{:.2}×", end.rss_kib as f64 / start.rss_kib.max(1) as f64),
            target: "flat: ≤ start + max(4 MiB, 10 %)".into(),
            verdict: verdict(end.rss_kib <= rss_allowed),
        },
        Row {
            figure: "soak: agent open fds at the end, idle (baseline: idle after warm-up)".into(),
            value: end.fds.to_string(),
            baseline: start.fds.to_string(),
            ratio: format!("{:.2}×", end.fds as f64 / start.fds.max(1) as f64),
            target: "flat: ≤ start + 4".into(),
            verdict: verdict(end.fds <= fds_allowed),
        },
        Row::info(
            "soak RSS / fds",
            format!(
                "{} / {}; max {} / {}; last busy {} / {}",
                mib(at_start.rss_kib),
                at_start.fds,
                mib(max_rss),
                max_fds,
                mib(busy.rss_kib),
                busy.fds
            ),
        ),
    ];
    if let Ok(first) = counts.first_errors.lock() {
        for e in first.iter() {
            rows.push(Row::info("soak: an error", e.clone()));
        }
    }
    let problems = agent::log_problems(&spec.log);
    if !problems.is_empty() {
        rows.push(Row::info(
            "soak log problems",
            format!("{}, first: {}", problems.len(), problems[0]),
        ));
    }
    Ok(rows)
}
