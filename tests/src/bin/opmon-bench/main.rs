//! opmon-bench: runs each scenario of issue 6 against the real `opmon-agent` binary over
//! its real socket, measures the baseline in the same run, and prints a table (figure,
//! value, baseline, ratio, target, pass/fail).
//!
//! ```sh
//! cargo build --release --workspace && target/release/opmon-bench [--quick]
//! ```
//!
//! The agent is the `opmon-agent` next to this executable (or `--agent PATH`); the
//! snapshotter is an SDK snapshotter served from inside this process on a Unix socket of
//! its own, answering at once. Everything lives in a temporary directory (`--dir`),
//! removed at the end unless `--keep`. The exit status is 0 whether or not targets are
//! met; 1 when a scenario could not run (the table says which and why).

mod agent;
mod finalize;
mod hint;
mod idle;
mod instructions;
mod litestream;
mod memory;
mod raw;
mod register;
mod restart;
mod rtt;
mod snap;
mod soak;
mod sqlite;
mod subscribe;
mod sweep;
mod table;

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::{Parser, ValueEnum};
use opmon_client::GoDuration;

use crate::table::{Report, Row};

/// Benchmarks opmon-agent against same-run baselines (issue 6).
#[derive(Parser, Debug)]
#[command(name = "opmon-bench")]
struct Args {
    /// About 1/10 of the full sizes; finishes in under a minute on two cores.
    #[arg(long)]
    quick: bool,
    /// Instead of the scenarios, run the whole workflow (start, add, poll to Finalizing,
    /// finalize, delete) against one agent for DURATION (`10m`, `1h`) and check that its
    /// memory and open files stay flat.
    #[arg(long, value_name = "DURATION")]
    soak: Option<GoDuration>,
    /// Run only these scenarios (default: all).
    #[arg(long, value_enum, num_args = 1.., value_name = "SCENARIO")]
    only: Vec<Scenario>,
    /// Also write the table as Markdown to FILE.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
    /// The agent binary (default: `opmon-agent` next to this executable).
    #[arg(long, value_name = "PATH")]
    agent: Option<PathBuf>,
    /// Where sockets, databases and tarballs go (default: the system temporary
    /// directory). Use a real disk: on tmpfs fsync is free and the commit figures mean
    /// nothing.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Keep the working directory (databases, agent logs) after the run.
    #[arg(long)]
    keep: bool,
    /// Start every backup with an owner `object` of about BYTES serialized (a Velero
    /// Backup padded with annotations), which the agent then passes in every Progress
    /// and Cancel call: what that costs a sweep.
    #[arg(long, value_name = "BYTES")]
    owner_object: Option<usize>,
    /// Extra environment for every agent started, KEY=VALUE (repeatable): for
    /// experiments such as MALLOC_ARENA_MAX=2.
    #[arg(long, value_name = "KEY=VALUE", value_parser = key_value)]
    agent_env: Vec<(String, String)>,
    /// Internal: be the rpc-rtt scenario's echo server process on SOCKET.
    #[arg(long, value_name = "SOCKET", hide = true)]
    echo_server: Option<PathBuf>,
}

/// A Velero Backup object of about `bytes` serialized: real fields, then annotations
/// of 64-byte values to make up the size.
fn owner_object(bytes: usize) -> serde_json::Value {
    let mut object = serde_json::json!({
        "apiVersion": "velero.io/v1",
        "kind": "Backup",
        "metadata": {
            "name": "bench",
            "namespace": "velero",
            "uid": "8f6c0f2e-55b1-4a38-9d1e-1d2f3c4b5a69",
            "labels": {"velero.io/storage-location": "default"},
            "annotations": {}
        },
        "spec": {
            "includedNamespaces": ["*"],
            "storageLocation": "default",
            "ttl": "720h0m0s",
            "itemOperationTimeout": "4h0m0s"
        }
    });
    let mut i = 0;
    while object.to_string().len() + 80 <= bytes {
        object["metadata"]["annotations"][format!("bench.example.io/pad-{i:04}")] =
            serde_json::json!("x".repeat(64));
        i += 1;
    }
    object
}

fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Scenario {
    RegisterBatch,
    RegisterConcurrent,
    RpcRtt,
    Sweep,
    Memory,
    Restart,
    Finalize,
    Subscribe,
    /// Prompt completion: change → owner's new phase, with and without the hint.
    Hint,
    /// Agent CPU while 10,000 operations wait and nothing changes.
    Idle,
    /// Agent instructions per polled-and-committed operation (needs valgrind).
    Instructions,
    /// Not in the default run: needs the `litestream` binary (issue 18).
    Litestream,
}

/// The sizes of one run: full mode is what the targets are set for, quick mode is about
/// a tenth of it.
#[derive(Clone, Debug)]
pub struct Sizes {
    /// Each throughput figure is the median of this many runs (the machine is shared:
    /// one run can be unlucky).
    pub repeats: usize,
    /// register-batch: operations in all, over `batch_backups` backups.
    pub batch_total: usize,
    pub batch_per_call: usize,
    pub batch_backups: usize,
    /// register-concurrent: clients, and calls of one operation each per client.
    pub concurrent_clients: usize,
    pub concurrent_calls: usize,
    /// rpc-rtt: measured round trips (after `rtt_warmup` unmeasured ones).
    /// Round trips are measured in `repeats` blocks, alternating agent and echo.
    pub rtt_rounds: usize,
    pub rtt_warmup: usize,
    /// sweep: unfinished operations over `sweep_backups` backups.
    pub sweep_ops: usize,
    pub sweep_backups: usize,
    /// subscribe: subscribers, spread evenly over the sweep's backups.
    pub subscribers: usize,
    /// restart: starts measured per database (the median counts).
    pub restarts: usize,
    /// finalize: tarball entries, items replaced, and random bytes per entry (which
    /// sets the compressed size: about this many bytes per entry).
    pub tar_entries: usize,
    pub tar_updates: usize,
    pub tar_random_bytes: usize,
}

impl Sizes {
    /// One header line with the sizes the rows' short names leave out.
    fn describe(&self) -> String {
        use crate::table::thousands;
        let n = |v: usize| thousands(v as f64);
        format!(
            "sizes: register-batch {} ops ({} per call), register-concurrent {} clients × {} \
             calls, sweep {} ops of {} backups, {} subscribers, finalize {} entries ({} \
             replaced); medians of {} runs",
            n(self.batch_total),
            n(self.batch_per_call),
            self.concurrent_clients,
            self.concurrent_calls,
            n(self.sweep_ops),
            self.sweep_backups,
            self.subscribers,
            n(self.tar_entries),
            n(self.tar_updates),
            self.repeats
        )
    }

    fn full() -> Sizes {
        Sizes {
            repeats: 3,
            batch_total: 100_000,
            batch_per_call: 1_000,
            batch_backups: 10,
            concurrent_clients: 64,
            concurrent_calls: 50,
            rtt_rounds: 20_000,
            rtt_warmup: 1_000,
            sweep_ops: 100_000,
            sweep_backups: 10,
            subscribers: 100,
            restarts: 5,
            tar_entries: 100_000,
            tar_updates: 1_000,
            tar_random_bytes: 1_900,
        }
    }

    fn quick() -> Sizes {
        Sizes {
            batch_total: 10_000,
            concurrent_calls: 10,
            rtt_rounds: 2_000,
            rtt_warmup: 200,
            sweep_ops: 10_000,
            restarts: 3,
            tar_entries: 10_000,
            tar_updates: 100,
            ..Sizes::full()
        }
    }
}

/// What every scenario needs: the agent binary, a directory of its own, the sizes.
pub struct Ctx {
    pub agent_bin: PathBuf,
    pub agent_env: Vec<(String, String)>,
    pub root: PathBuf,
    pub sizes: Sizes,
    pub quick: bool,
    /// The `object` backups are started with (`--owner-object`).
    pub owner_object: Option<serde_json::Value>,
}

impl Ctx {
    /// A fresh directory for one scenario.
    pub fn subdir(&self, name: &str) -> Result<PathBuf, String> {
        let dir = self.root.join(name);
        if dir.exists() {
            std::fs::remove_dir_all(&dir)
                .map_err(|e| format!("clearing {}: {e}", dir.display()))?;
        }
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        Ok(dir)
    }
}

/// The agent binary: `--agent`, else `opmon-agent` next to this executable.
fn locate_agent(explicit: Option<PathBuf>) -> Result<PathBuf, String> {
    let path = match explicit {
        Some(p) => p,
        None => {
            let exe = std::env::current_exe()
                .map_err(|e| format!("finding this executable's path: {e}"))?;
            exe.parent()
                .ok_or("this executable has no directory")?
                .join("opmon-agent")
        }
    };
    if !path.is_file() {
        return Err(format!(
            "the agent binary {} does not exist: build it first with \
             `cargo build --release --workspace` (cargo run -p opmon-tests does not build \
             the agent), or name one with --agent PATH",
            path.display()
        ));
    }
    Ok(path)
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// One line describing the machine, for the table's header.
fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| format!("{:.0} GiB", kb as f64 / 1024.0 / 1024.0))
        .unwrap_or_else(|| "? GiB".into());
    format!(
        "{cores} cores ({cpu}), {mem} RAM, Linux {}",
        read_trimmed("/proc/sys/kernel/osrelease")
    )
}

/// The file system type of `dir`, warning about tmpfs (free fsync).
fn filesystem(dir: &Path) -> (String, bool) {
    use nix::sys::statfs::{statfs, TMPFS_MAGIC};
    match statfs(dir) {
        Ok(s) if s.filesystem_type() == TMPFS_MAGIC => ("tmpfs".into(), true),
        Ok(s) => {
            let name = match s.filesystem_type().0 {
                0xef53 => "ext4".to_string(),
                0x5846_5342 => "xfs".to_string(),
                0x9123_683e => "btrfs".to_string(),
                0x794c_7630 => "overlayfs".to_string(),
                other => format!("file system {other:#x}"),
            };
            (name, false)
        }
        Err(e) => (format!("unknown ({e})"), false),
    }
}

fn selected(only: &[Scenario], s: Scenario) -> bool {
    (only.is_empty() && s != Scenario::Litestream) || only.contains(&s)
}

/// Runs one group of scenarios, turning a failure into an error row.
async fn guarded(
    report: &mut Report,
    name: &str,
    run: impl std::future::Future<Output = Result<Vec<Row>, String>>,
) {
    eprintln!("opmon-bench: {name} …");
    let began = Instant::now();
    match run.await {
        Ok(rows) => {
            eprintln!(
                "opmon-bench: {name} done in {:.1} s",
                began.elapsed().as_secs_f64()
            );
            report.rows.extend(rows);
        }
        Err(e) => {
            eprintln!("opmon-bench: {name} FAILED: {e}");
            report.rows.push(Row::error(name, &e));
            report.failed = true;
        }
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if let Some(socket) = &args.echo_server {
        return match raw::echo_server(socket) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("opmon-bench: echo server on {}: {e}", socket.display());
                std::process::ExitCode::from(2)
            }
        };
    }
    let agent_bin = match locate_agent(args.agent.clone()) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("opmon-bench: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    if cfg!(debug_assertions) {
        eprintln!("opmon-bench: warning: this is a debug build of the bench; build with --release");
    }
    if agent_bin.components().any(|c| c.as_os_str() == "debug") {
        eprintln!(
            "opmon-bench: warning: {} looks like a debug build of the agent",
            agent_bin.display()
        );
    }
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let temp = match tempfile::Builder::new()
        .prefix("opmon-bench-")
        .tempdir_in(&base)
    {
        Ok(t) => t,
        Err(e) => {
            eprintln!(
                "opmon-bench: creating a directory in {}: {e}",
                base.display()
            );
            return std::process::ExitCode::from(2);
        }
    };
    let (fs, tmpfs) = filesystem(temp.path());
    if tmpfs {
        eprintln!(
            "opmon-bench: warning: {} is on tmpfs, where fsync costs nothing; the commit \
             figures (register-*) mean little there. Use --dir on a disk.",
            base.display()
        );
    }
    let sizes = if args.quick {
        Sizes::quick()
    } else {
        Sizes::full()
    };
    let ctx = Ctx {
        agent_bin: agent_bin.clone(),
        agent_env: args.agent_env.clone(),
        root: temp.path().to_path_buf(),
        sizes,
        quick: args.quick,
        owner_object: args.owner_object.map(owner_object),
    };
    let mode = match (&args.soak, args.quick) {
        (Some(d), _) => format!("soak {d}"),
        (None, true) => "quick".to_string(),
        (None, false) => "full".to_string(),
    };
    let mut report = Report::new(vec![
        format!(
            "opmon-bench, {mode} mode, {}",
            time::OffsetDateTime::now_utc()
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default()
        ),
        format!("machine: {}", machine()),
        format!(
            "load average at start: {}; working directory on {fs}: {}",
            read_trimmed("/proc/loadavg"),
            temp.path().display()
        ),
        format!("agent: {}", agent_bin.display()),
        ctx.sizes.describe(),
        "figures: docs/benchmarks.md says what each row measures".to_string(),
    ]);
    if !args.agent_env.is_empty() {
        let env: Vec<String> = args
            .agent_env
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        report
            .header
            .push(format!("agent environment: {}", env.join(" ")));
    }
    let began = Instant::now();

    if let Some(duration) = args.soak {
        guarded(&mut report, "soak", soak::run(&ctx, duration.0)).await;
    } else {
        let only = &args.only;
        if selected(only, Scenario::RegisterBatch) {
            guarded(&mut report, "register-batch", register::batch(&ctx)).await;
        }
        if selected(only, Scenario::RegisterConcurrent) {
            guarded(
                &mut report,
                "register-concurrent",
                register::concurrent(&ctx),
            )
            .await;
        }
        if selected(only, Scenario::RpcRtt) {
            guarded(&mut report, "rpc-rtt", rtt::run(&ctx)).await;
        }
        let want = sweep::Want {
            sweep: selected(only, Scenario::Sweep),
            memory: selected(only, Scenario::Memory),
            subscribe: selected(only, Scenario::Subscribe),
            restart: selected(only, Scenario::Restart),
        };
        if want.any() {
            guarded(
                &mut report,
                "sweep, memory, subscribe, restart",
                sweep::run(&ctx, want),
            )
            .await;
        }
        if selected(only, Scenario::Hint) {
            guarded(&mut report, "hint", hint::run(&ctx)).await;
        }
        if selected(only, Scenario::Idle) {
            guarded(&mut report, "idle", idle::run(&ctx)).await;
        }
        if selected(only, Scenario::Instructions) {
            guarded(&mut report, "instructions", instructions::run(&ctx)).await;
        }
        if selected(only, Scenario::Finalize) {
            guarded(&mut report, "finalize", finalize::run(&ctx)).await;
        }
        if selected(only, Scenario::Litestream) {
            guarded(&mut report, "litestream", litestream::run(&ctx)).await;
        }
    }
    let killed = agent::UNHANDLED_SIGTERM.load(std::sync::atomic::Ordering::SeqCst);
    if killed > 0 {
        report.header.push(format!(
            "note: {killed} agent(s) died of SIGTERM instead of stopping gracefully: the \
             signal arrived before the agent installed its handler (a start-up race in the agent)"
        ));
    }
    report.header.push(format!(
        "took {:.1} s; load average at the end: {}",
        began.elapsed().as_secs_f64(),
        read_trimmed("/proc/loadavg")
    ));

    println!("{}", report.text());
    if let Some(path) = &args.markdown {
        if let Err(e) = std::fs::write(path, report.markdown()) {
            eprintln!("opmon-bench: writing {}: {e}", path.display());
            report.failed = true;
        }
    }
    if args.keep {
        let kept = temp.keep();
        eprintln!("opmon-bench: kept {}", kept.display());
    }
    if report.failed {
        std::process::ExitCode::FAILURE
    } else {
        std::process::ExitCode::SUCCESS
    }
}
