//! rpc-rtt: `agent.status` round trips on one kept-alive HTTP/1.1 connection (POST /)
//! against a raw Unix-socket echo of the same request bytes, and the typed client
//! (`opmon_client::Client`) against that raw POST.

use std::path::Path;

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;
use std::time::{Duration, Instant};

use crate::agent::Spec;
use crate::register::QUIET;
use crate::table::{dur, quantile, Row};
use crate::{raw, Ctx};

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// One `agent.status` call on `conn`, timed.
fn status_once(conn: &mut raw::Conn, request: &[u8]) -> Result<Duration, String> {
    let began = Instant::now();
    let answer = conn.call(request)?;
    let took = began.elapsed();
    if answer.status != 200 || !contains(&answer.body, b"\"result\"") {
        return Err(format!(
            "agent.status answered HTTP {}: {}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
        ));
    }
    Ok(took)
}

/// One echo of `request` on `conn`, timed.
fn echo_once(conn: &mut raw::Conn, request: &[u8], back: &mut [u8]) -> Result<Duration, String> {
    let began = Instant::now();
    conn.echo(request, back).map_err(|e| format!("echo: {e}"))?;
    let took = began.elapsed();
    if back != request {
        return Err("the echo server sent back other bytes".into());
    }
    Ok(took)
}

/// Round-trip times of `agent.status` over one raw HTTP connection, sorted.
pub fn agent_status(socket: &Path, warmup: usize, rounds: usize) -> Result<Vec<Duration>, String> {
    let request = raw::post_request(raw::STATUS);
    let mut conn = raw::Conn::connect(socket).map_err(|e| format!("connecting: {e}"))?;
    let mut samples = Vec::with_capacity(rounds);
    for i in 0..warmup + rounds {
        let took = status_once(&mut conn, &request)?;
        if i >= warmup {
            samples.push(took);
        }
    }
    samples.sort();
    Ok(samples)
}

/// Round trips of the agent, an echo server process and an echo thread of this
/// process, in alternating blocks (so all see the same machine), each sorted.
fn alternating(
    agent: &Path,
    echoes: [&Path; 2],
    warmup: usize,
    rounds: usize,
    blocks: usize,
) -> Result<[Vec<Duration>; 3], String> {
    let request = raw::post_request(raw::STATUS);
    let mut back = vec![0u8; request.len()];
    let mut a = raw::Conn::connect(agent).map_err(|e| format!("connecting: {e}"))?;
    let mut e = Vec::new();
    for echo in echoes {
        e.push(raw::Conn::connect(echo).map_err(|e| format!("connecting to echo: {e}"))?);
    }
    for _ in 0..warmup {
        status_once(&mut a, &request)?;
        for conn in &mut e {
            echo_once(conn, &request, &mut back)?;
        }
    }
    let per_block = (rounds / blocks.max(1)).max(1);
    let mut times: [Vec<Duration>; 3] = Default::default();
    for _ in 0..blocks.max(1) {
        for _ in 0..per_block {
            times[0].push(status_once(&mut a, &request)?);
        }
        for (i, conn) in e.iter_mut().enumerate() {
            for _ in 0..per_block {
                times[i + 1].push(echo_once(conn, &request, &mut back)?);
            }
        }
    }
    for t in &mut times {
        t.sort();
    }
    Ok(times)
}

/// Binds every thread of each process in `pids` (and so the threads they start later)
/// to `cpus`.
fn bind(pids: &[u32], cpus: &CpuSet) -> Result<(), String> {
    for pid in pids {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
            .map_err(|e| format!("listing the threads of {pid}: {e}"))?;
        for task in tasks.flatten() {
            if let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) {
                match sched_setaffinity(Pid::from_raw(tid), cpus) {
                    // The thread ended meanwhile (an idle blocking-pool thread).
                    Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
                    Err(e) => return Err(format!("binding thread {tid} of {pid}: {e}")),
                }
            }
        }
    }
    Ok(())
}

fn cpu_set(cpu: usize) -> Result<CpuSet, String> {
    let mut set = CpuSet::new();
    set.set(cpu).map_err(|e| format!("CPU {cpu}: {e}"))?;
    Ok(set)
}

/// Where the servers (agent and echo process) and the caller run.
#[derive(Clone, Copy)]
enum Placement {
    /// All on one CPU: no wake-up crosses CPUs.
    OneCpu,
    /// The servers on one CPU, the caller on another: every wake-up crosses.
    TwoCpus,
}

/// [`alternating`] with the servers (`pids`) and the measuring thread bound as
/// `placement` says, then unbound again. Equal placement for the agent and the echo
/// process; unbound, each lands where the scheduler puts it, and on a VM a wake-up of
/// another (idle) virtual CPU costs tens of microseconds, so unbound figures swing with
/// placement from run to run.
fn placed(
    placement: Placement,
    pids: &[u32],
    agent: &Path,
    echoes: [&Path; 2],
    warmup: usize,
    rounds: usize,
) -> Result<[Vec<Duration>; 3], String> {
    let all = sched_getaffinity(Pid::from_raw(0)).map_err(|e| format!("reading affinity: {e}"))?;
    let cpus: Vec<usize> = (0..CpuSet::count())
        .filter(|&c| all.is_set(c).unwrap_or(false))
        .collect();
    let (servers, caller) = match (placement, cpus.as_slice()) {
        (Placement::OneCpu, [first, ..]) => (*first, *first),
        (Placement::TwoCpus, [first, second, ..]) => (*first, *second),
        _ => return Err(format!("not enough CPUs to bind to: {cpus:?}")),
    };
    bind(pids, &cpu_set(servers)?)?;
    sched_setaffinity(Pid::from_raw(0), &cpu_set(caller)?)
        .map_err(|e| format!("binding this thread: {e}"))?;
    let measured = alternating(agent, echoes, warmup, rounds, 4);
    bind(pids, &all)?;
    sched_setaffinity(Pid::from_raw(0), &all).map_err(|e| format!("unbinding this thread: {e}"))?;
    measured
}

/// The typed client's `agent.status` against raw POSTs of the same request, in
/// alternating blocks on one thread: the client on a current-thread runtime of its own
/// (as the CLI runs it), so both wait for the answer on the same thread.
fn typed_vs_raw(
    socket: &Path,
    warmup: usize,
    rounds: usize,
    blocks: usize,
) -> Result<[Vec<Duration>; 2], String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("a runtime for the client: {e}"))?;
    let client = runtime
        .block_on(opmon_client::Client::connect(socket))
        .map_err(|e| format!("connecting the typed client: {}", e.chain()))?;
    let request = raw::post_request(raw::STATUS);
    let mut conn = raw::Conn::connect(socket).map_err(|e| format!("connecting: {e}"))?;
    let typed_once = || -> Result<Duration, String> {
        let began = Instant::now();
        runtime
            .block_on(async { client.status().await })
            .map_err(|e| format!("agent.status over the typed client: {}", e.chain()))?;
        Ok(began.elapsed())
    };
    for _ in 0..warmup {
        typed_once()?;
        status_once(&mut conn, &request)?;
    }
    let per_block = (rounds / blocks.max(1)).max(1);
    let mut times: [Vec<Duration>; 2] = Default::default();
    for _ in 0..blocks.max(1) {
        for _ in 0..per_block {
            times[0].push(typed_once()?);
        }
        for _ in 0..per_block {
            times[1].push(status_once(&mut conn, &request)?);
        }
    }
    for t in &mut times {
        t.sort();
    }
    Ok(times)
}

pub async fn run(ctx: &Ctx) -> Result<Vec<Row>, String> {
    let s = &ctx.sizes;
    let dir = ctx.subdir("rpc-rtt")?;
    let spec = Spec::new(ctx, &dir, QUIET);
    let (mut agent, _) = spec.start().await?;
    let process_socket = dir.join("echo-process.sock");
    let echo_process = raw::EchoProcess::start(&process_socket)?;
    let thread_socket = dir.join("echo-thread.sock");
    raw::start_echo(&thread_socket).map_err(|e| format!("starting the echo server: {e}"))?;
    let (warmup, rounds, blocks) = (s.rtt_warmup, s.rtt_rounds, s.repeats * 4);
    let socket = spec.socket.clone();
    let [agent_times, echo_times, thread_times] = tokio::task::spawn_blocking(move || {
        alternating(
            &socket,
            [&process_socket, &thread_socket],
            warmup,
            rounds,
            blocks,
        )
    })
    .await
    .map_err(|e| format!("the measuring thread failed: {e}"))??;
    let pids = [agent.pid, echo_process.pid()];
    let mut bound = Vec::new();
    for placement in [Placement::OneCpu, Placement::TwoCpus] {
        let socket = spec.socket.clone();
        let (process_socket, thread_socket) =
            (dir.join("echo-process.sock"), dir.join("echo-thread.sock"));
        let [agent, echo, _] = tokio::task::spawn_blocking(move || {
            placed(
                placement,
                &pids,
                &socket,
                [&process_socket, &thread_socket],
                warmup,
                rounds,
            )
        })
        .await
        .map_err(|e| format!("the measuring thread failed: {e}"))??;
        bound.push((agent, echo));
    }
    drop(echo_process);

    // The typed client, against raw POSTs in the same blocks.
    let socket = spec.socket.clone();
    let [typed, raw_post] =
        tokio::task::spawn_blocking(move || typed_vs_raw(&socket, warmup, rounds, blocks))
            .await
            .map_err(|e| format!("the measuring thread failed: {e}"))??;
    // And on the bench's own multi-thread runtime, as a backup server's task calls it.
    let client = agent.client().await?;
    let mut shared = Vec::with_capacity(rounds / 4);
    for i in 0..warmup + rounds / 4 {
        let began = Instant::now();
        client
            .status()
            .await
            .map_err(|e| format!("agent.status over the typed client: {e}"))?;
        if i >= warmup {
            shared.push(began.elapsed());
        }
    }
    shared.sort();
    drop(client);
    agent.terminate()?;

    let p = |v: &[Duration], q| dur(quantile(v, q));
    Ok(vec![
        Row::info_vs("rpc-rtt p50", p(&agent_times, 0.5), p(&echo_times, 0.5)),
        Row::info_vs("rpc-rtt p99", p(&agent_times, 0.99), p(&echo_times, 0.99)),
        Row::info_vs(
            "rpc-rtt p50 vs thread",
            p(&agent_times, 0.5),
            p(&thread_times, 0.5),
        ),
        Row::ratio_at_most(
            "rpc-rtt p50 two CPUs",
            p(&bound[1].0, 0.5),
            p(&bound[1].1, 0.5),
            2.5,
        ),
        Row::ratio_at_most(
            "rpc-rtt p50 one CPU",
            p(&bound[0].0, 0.5),
            p(&bound[0].1, 0.5),
            2.5,
        ),
        Row::ratio_at_most("client p50", p(&typed, 0.5), p(&raw_post, 0.5), 1.5),
        Row::info_vs(
            "client p50 multi-thread",
            p(&shared, 0.5),
            p(&agent_times, 0.5),
        ),
    ])
}
