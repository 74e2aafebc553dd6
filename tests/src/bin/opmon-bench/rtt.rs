//! rpc-rtt: `agent.status` round trips on one kept-alive HTTP/1.1 connection (POST /)
//! against a raw Unix-socket echo of the same request bytes.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::agent::Spec;
use crate::register::QUIET;
use crate::table::{dur, quantile, thousands, Row};
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

/// Agent and echo round trips in alternating blocks (so both see the same machine),
/// each sorted.
fn alternating(
    agent: &Path,
    echo: &Path,
    warmup: usize,
    rounds: usize,
    blocks: usize,
) -> Result<(Vec<Duration>, Vec<Duration>), String> {
    let request = raw::post_request(raw::STATUS);
    let mut back = vec![0u8; request.len()];
    let mut a = raw::Conn::connect(agent).map_err(|e| format!("connecting: {e}"))?;
    let mut e = raw::Conn::connect(echo).map_err(|e| format!("connecting to echo: {e}"))?;
    for _ in 0..warmup {
        status_once(&mut a, &request)?;
        echo_once(&mut e, &request, &mut back)?;
    }
    let per_block = (rounds / blocks.max(1)).max(1);
    let (mut at, mut et) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for _ in 0..blocks.max(1) {
        for _ in 0..per_block {
            at.push(status_once(&mut a, &request)?);
        }
        for _ in 0..per_block {
            et.push(echo_once(&mut e, &request, &mut back)?);
        }
    }
    at.sort();
    et.sort();
    Ok((at, et))
}

pub async fn run(ctx: &Ctx) -> Result<Vec<Row>, String> {
    let s = &ctx.sizes;
    let dir = ctx.subdir("rpc-rtt")?;
    let spec = Spec::new(ctx, &dir, QUIET);
    let (mut agent, _) = spec.start().await?;
    let echo_socket = dir.join("echo.sock");
    raw::start_echo(&echo_socket).map_err(|e| format!("starting the echo server: {e}"))?;
    let (warmup, rounds, blocks) = (s.rtt_warmup, s.rtt_rounds, s.repeats * 4);
    let socket = spec.socket.clone();
    let (agent_times, echo_times) = tokio::task::spawn_blocking(move || {
        alternating(&socket, &echo_socket, warmup, rounds, blocks)
    })
    .await
    .map_err(|e| format!("the measuring thread failed: {e}"))??;

    // The typed client (WebSocket), for context.
    let client = agent.client().await?;
    let mut ws = Vec::with_capacity(rounds / 4);
    for i in 0..warmup + rounds / 4 {
        let began = Instant::now();
        client
            .status()
            .await
            .map_err(|e| format!("agent.status over WebSocket: {e}"))?;
        if i >= warmup {
            ws.push(began.elapsed());
        }
    }
    ws.sort();
    drop(client);
    agent.terminate()?;

    let p = |v: &[Duration], q| dur(quantile(v, q));
    Ok(vec![
        Row::ratio_at_most(
            format!(
                "rpc-rtt: agent.status p50, HTTP keep-alive POST on one connection, {} calls \
                 (baseline: Unix-socket echo of the same bytes, in alternating blocks)",
                thousands(agent_times.len() as f64)
            ),
            p(&agent_times, 0.5),
            p(&echo_times, 0.5),
            2.5,
        ),
        Row::info_vs(
            "rpc-rtt: agent.status p99 (same runs)",
            p(&agent_times, 0.99),
            p(&echo_times, 0.99),
        ),
        Row::info_vs(
            "rpc-rtt: agent.status p50 over the typed WebSocket client (vs echo p50)",
            p(&ws, 0.5),
            p(&echo_times, 0.5),
        ),
    ])
}
