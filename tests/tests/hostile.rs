//! End-to-end: hostile clients. A client that hangs up in the middle of a large
//! `addOperations` leaves all of it or none of it, and nothing behind; a thousand idle
//! connections are held without the agent's memory passing 64 MiB while other clients
//! are served as usual.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use opmon_tests::raw::{
    content_length, open_sockets, post_head, quiescent, read_head, request, send_from_thread,
    status_bytes, try_ws_recv, websocket, ws_answer, ws_recv, ws_send, WEBSOCKET_UPGRADE,
};
use opmon_tests::{operation, Agent, RawHttp};
use serde_json::{json, Value};

const PLUGIN: &str = "example.io/unregistered";

/// Whether `condition` comes to hold within `within` (the harness's polling).
fn eventually(within: Duration, condition: impl FnMut() -> bool) -> bool {
    opmon_tests::try_eventually(within, condition).is_some()
}

/// The number of operations of backup `name`.
fn operation_count(http: &mut RawHttp, name: &str) -> u64 {
    let answer = http.call(&request("backup.get", json!({"name": name})));
    answer["result"]["operationsAttempted"]
        .as_u64()
        .unwrap_or_else(|| panic!("no operation count in {answer}"))
}

/// Where the hostile client stops.
#[derive(Clone, Copy, Debug)]
enum Cut {
    /// In the middle of the request head.
    Head,
    /// After the head, before any of the body.
    NoBody,
    /// After this share (per mille) of the body.
    Body(usize),
    /// After the whole body, closing at once without reading the answer.
    Whole,
    /// After the whole body, shutting down only its own direction.
    WholeHalfClosed,
}

#[test]
fn a_client_hanging_up_mid_request_leaves_all_of_its_batch_or_none() {
    const OPS: usize = 2000;
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let pid = agent.pid();
    let mut http = RawHttp::connect(&agent.socket);
    // Answered, so accepted: the baseline counts this connection.
    http.call(&request("agent.status", json!({})));
    let baseline_sockets = open_sockets(pid);
    let cuts = [
        Cut::Head,
        Cut::NoBody,
        Cut::Body(1),
        Cut::Body(500),
        Cut::Body(999),
        Cut::Whole,
        Cut::WholeHalfClosed,
        Cut::Body(250),
        Cut::Whole,
        Cut::Whole,
    ];
    let mut committed = Vec::new();
    for (round, cut) in cuts.iter().enumerate() {
        let name = format!("cut-{round}");
        let started = http.call(&request("backup.start", json!({"name": name, "uid": "u"})));
        assert_eq!(started["result"]["phase"], "InProgress", "{started}");
        let ops: Vec<_> = (0..OPS)
            .map(|i| operation(PLUGIN, &format!("{name}-op-{i}"), "data", &[]))
            .collect();
        let body = request(
            "backup.addOperations",
            json!({"name": name, "operations": ops}),
        )
        .into_bytes();
        let head = post_head(body.len()).into_bytes();
        let (head_part, body_part) = match cut {
            Cut::Head => (&head[..head.len() / 2], &body[..0]),
            Cut::NoBody => (&head[..], &body[..0]),
            Cut::Body(per_mille) => (&head[..], &body[..body.len() * per_mille / 1000]),
            Cut::Whole | Cut::WholeHalfClosed => (&head[..], &body[..]),
        };
        {
            let mut stream = UnixStream::connect(&agent.socket).unwrap();
            stream.write_all(head_part).unwrap();
            stream.write_all(body_part).unwrap();
            if let Cut::WholeHalfClosed = cut {
                stream.shutdown(std::net::Shutdown::Write).unwrap();
            }
            // Dropped here: the connection closes with the request unanswered.
        }
        let whole = matches!(cut, Cut::Whole | Cut::WholeHalfClosed);
        // Every observation is all or nothing, until the agent has let go of the
        // connection (after which nothing of the request can be queued any more) and a
        // later write has committed (so whatever was queued before it has too).
        let mut seen = Vec::new();
        let released = eventually(Duration::from_secs(10), || {
            seen.push(operation_count(&mut http, &name));
            open_sockets(pid) <= baseline_sockets
        });
        assert!(
            released,
            "{cut:?}: the agent still holds the connection 10 s after the client hung up"
        );
        http.call(&request(
            "backup.start",
            json!({"name": format!("{name}-barrier"), "uid": "u"}),
        ));
        seen.push(operation_count(&mut http, &name));
        assert!(
            seen.iter().all(|n| *n == 0 || *n == OPS as u64),
            "{cut:?}: the batch was seen partly committed: {seen:?}"
        );
        assert!(
            whole || seen.iter().all(|n| *n == 0),
            "{cut:?}: an incomplete request was committed: {seen:?}"
        );
        committed.push((*cut, *seen.last().unwrap() == OPS as u64));
        // The batch is not stuck half-way either: the same request, sent again whole,
        // gives exactly the missing operations.
        let again = http.call(std::str::from_utf8(&body).unwrap());
        let added = again["result"]["added"].as_u64().expect("added");
        let known = again["result"]["alreadyKnown"]
            .as_u64()
            .expect("alreadyKnown");
        assert!(
            (added, known) == (OPS as u64, 0) || (added, known) == (0, OPS as u64),
            "{cut:?}: resending the batch added {added} and found {known}"
        );
        assert_eq!(operation_count(&mut http, &name), OPS as u64);
    }
    println!("committed after the hang-up: {committed:?}");
    let status = http.call(&request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
}

/// Raises this process's soft limit on open files (the agent, started after, inherits
/// it) to at least `want`, within the hard limit.
fn raise_open_files(want: u64) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    let raised = if soft < want { want.min(hard) } else { soft };
    if raised != soft {
        setrlimit(Resource::RLIMIT_NOFILE, raised, hard).expect("setrlimit");
    }
    assert!(
        raised >= want,
        "RLIMIT_NOFILE is {raised} (hard limit {hard}); this test needs {want}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_idle_connections_are_held_in_bounded_memory_while_others_are_served() {
    const IDLE: usize = 1000;
    const RSS_LIMIT: u64 = 64 * 1024 * 1024;
    raise_open_files(4096);
    let dir = tempfile::tempdir().unwrap();
    // Every connection here is this process's uid: lift the per-uid limit (access.rs
    // tests it) to see what a thousand idle connections cost.
    let agent = Agent::start(dir.path(), &["--max-connections-per-uid", "4096"]);
    let pid = agent.pid();

    // Warm up with a few requests, so the baseline includes what any serving agent
    // has allocated.
    let client = agent.client().await;
    let backups = client.backups();
    backups.start("warm", "u").await.unwrap();
    backups
        .add_operations(
            "warm",
            (0..100)
                .map(|i| operation(PLUGIN, &format!("warm-{i}"), "data", &[]))
                .collect(),
        )
        .await
        .unwrap();
    let baseline_rss = status_bytes(pid, "VmRSS:");
    let baseline_sockets = open_sockets(pid);

    // The idle crowd: silent connections, keep-alive connections idle after one
    // answered request, half-sent request heads, and idle WebSocket connections.
    let socket = agent.socket.clone();
    let held: Vec<(&'static str, UnixStream)> = tokio::task::spawn_blocking(move || {
        let mut held = Vec::with_capacity(IDLE);
        for i in 0..IDLE {
            let mut s =
                UnixStream::connect(&socket).unwrap_or_else(|e| panic!("connection {i}: {e}"));
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let kind = match i % 10 {
                0..=3 => "silent",
                4..=6 => {
                    let body = request("agent.status", json!({}));
                    write!(s, "{}{body}", post_head(body.len())).unwrap();
                    let head = read_head(&mut s);
                    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
                    let length = content_length(&head).expect("content-length");
                    let mut body = vec![0; length];
                    s.read_exact(&mut body).unwrap();
                    "keep-alive"
                }
                7 | 8 => {
                    s.write_all(b"POST / HTTP/1.1\r\nHost: local").unwrap();
                    "half-head"
                }
                _ => {
                    s.write_all(WEBSOCKET_UPGRADE.as_bytes()).unwrap();
                    let head = read_head(&mut s);
                    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
                    "websocket"
                }
            };
            held.push((kind, s));
        }
        held
    })
    .await
    .unwrap();
    // All of them accepted, not waiting in the listen backlog.
    assert!(
        eventually(Duration::from_secs(30), || open_sockets(pid)
            >= baseline_sockets + IDLE),
        "the agent holds {} sockets, {baseline_sockets} + {IDLE} expected",
        open_sockets(pid)
    );

    // Other clients are served as usual meanwhile.
    let served = Instant::now();
    let other = agent.client().await;
    let backups = other.backups();
    backups.start("busy", "u").await.unwrap();
    for batch in 0..10 {
        let ops = (0..100)
            .map(|i| operation(PLUGIN, &format!("busy-{batch}-{i}"), "data", &[]))
            .collect();
        let added = backups.add_operations("busy", ops).await.unwrap();
        assert_eq!(added.added, 100);
    }
    let owner = backups.get("busy").await.unwrap();
    assert_eq!(owner.operations_attempted, 1000);
    let ended = backups.end_in_progress("busy").await.unwrap();
    assert!(ended.phase.is_finalizing(), "{}", ended.phase);
    let status = other.status().await.unwrap();
    assert_eq!(status.unfinished_operations, 100, "warm's operations");
    let took = served.elapsed();

    let held_rss = status_bytes(pid, "VmRSS:");
    let fds = open_sockets(pid);
    println!(
        "agent RSS: {:.1} MiB before, {:.1} MiB with {IDLE} idle connections ({fds} sockets); \
         the other client's 14 requests took {took:?}",
        baseline_rss as f64 / 1048576.0,
        held_rss as f64 / 1048576.0,
    );
    assert!(
        held_rss <= RSS_LIMIT,
        "the agent's RSS is {held_rss} bytes with {IDLE} idle connections (limit {RSS_LIMIT}); \
         it was {baseline_rss} before them"
    );
    assert!(
        fds >= baseline_sockets + IDLE,
        "the agent dropped idle connections while others were served: {fds} sockets"
    );

    // The idle connections still work: each kind gets an answer to a request now.
    let mut by_kind = std::collections::BTreeMap::new();
    for (kind, s) in held {
        by_kind.entry(kind).or_insert_with(Vec::new).push(s);
    }
    for (kind, streams) in by_kind.iter_mut() {
        let s = streams.first_mut().unwrap();
        let body = request("agent.status", json!({}));
        let answer = match *kind {
            "websocket" => continue,
            "half-head" => format!(
                "host\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            ),
            _ => format!("{}{body}", post_head(body.len())),
        };
        s.write_all(answer.as_bytes()).unwrap();
        let head = read_head(s);
        assert!(
            head.starts_with("HTTP/1.1 200"),
            "a {kind} connection answered {head}"
        );
    }
    drop(by_kind);
    // A handle owns its share of the client: the connection closes with the last one.
    drop(backups);
    drop(other);
    assert!(
        eventually(Duration::from_secs(30), || open_sockets(pid)
            <= baseline_sockets),
        "{} sockets after the idle clients left, {baseline_sockets} before",
        open_sockets(pid)
    );
}

/// An oversized request is answered with 413 as soon as it is known to be too large:
/// from its declared length before any of the body is read, or, with chunked
/// encoding, once the limit is passed, without waiting for the rest.
#[test]
fn requests_over_the_default_size_limit_are_refused_without_reading_them_whole() {
    const LIMIT: usize = 16 * 1024 * 1024;
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let chunk = vec![b'a'; 64 * 1024];

    // A declared length past the limit, with a fraction of the body sent.
    let mut s = UnixStream::connect(&agent.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(s, "{}", post_head(LIMIT + 1)).unwrap();
    // The agent may refuse and close before this part of the body is written.
    if let Err(e) = s.write_all(&chunk) {
        assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            ),
            "writing the body: {e}"
        );
    }
    let head = read_head(&mut s);
    assert!(
        head.starts_with("HTTP/1.1 413"),
        "declared length {}: {head}",
        LIMIT + 1
    );

    // Chunked, with no end: the answer comes once the limit is passed.
    let mut s = UnixStream::connect(&agent.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(
        b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
    )
    .unwrap();
    let mut writer = s.try_clone().unwrap();
    let sender = std::thread::spawn(move || {
        // A request whose one string never ends.
        let start = br#"{"jsonrpc":"2.0","id":1,"method":"agent.status","params":{"pad":""#;
        let mut sent = start.len();
        let frame = [format!("{:x}\r\n", start.len()).as_bytes(), start, b"\r\n"].concat();
        if writer.write_all(&frame).is_err() {
            return sent;
        }
        while sent < 4 * LIMIT {
            let frame = [
                format!("{:x}\r\n", chunk.len()).as_bytes(),
                &chunk[..],
                b"\r\n",
            ]
            .concat();
            if writer.write_all(&frame).is_err() {
                break;
            }
            sent += chunk.len();
        }
        sent
    });
    let head = read_head(&mut s);
    drop(s);
    let sent = sender.join().unwrap();
    assert!(head.starts_with("HTTP/1.1 413"), "chunked: {head}");
    assert!(
        sent < 4 * LIMIT,
        "the agent read {sent} bytes of a request it had to refuse past {LIMIT}"
    );

    let mut http = RawHttp::connect(&agent.socket);
    let answer = http.call(&request("backup.list", json!({})));
    assert_eq!(answer["result"]["items"], json!([]), "nothing was stored");
}

/// An agent in `dir` once at rest, with its pid and how many sockets it has open then
/// (the start's readiness probe connected and left: once the agent is at rest, it has
/// closed that connection too).
fn at_rest(dir: &std::path::Path) -> (Agent, u32, usize) {
    let agent = Agent::start(dir, &[]);
    let pid = agent.pid();
    quiescent(pid, Duration::from_secs(30));
    let baseline = open_sockets(pid);
    (agent, pid, baseline)
}

#[test]
fn subscriptions_a_client_never_reads_hold_the_agent_to_a_bound() {
    const SUBSCRIPTIONS: usize = 256;
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let pid = agent.pid();
    let mut http = RawHttp::connect(&agent.socket);
    http.call(&request("backup.start", json!({"name": "big", "uid": "u"})));
    // Each update carries every operation: about 650 KB.
    let ops: Vec<_> = (0..600)
        .map(|i| operation(PLUGIN, &format!("{i:04}-{}", "x".repeat(1000)), "data", &[]))
        .collect();
    let added = http.call(&request(
        "backup.addOperations",
        json!({"name": "big", "operations": ops}),
    ));
    assert_eq!(added["result"]["added"], 600);
    let baseline = status_bytes(pid, "VmRSS:");

    let mut ws = websocket(&agent.socket);
    // The agent may stop reading this connection: send from a thread of its own.
    let mut writer = ws.try_clone().unwrap();
    let sender = std::thread::spawn(move || {
        for i in 0..SUBSCRIPTIONS {
            let call = json!({"jsonrpc": "2.0", "id": i, "method": "backup.subscribe",
                              "params": {"name": "big"}});
            if ws_send(&mut writer, call.to_string()).is_err() {
                return i;
            }
        }
        SUBSCRIPTIONS
    });
    quiescent(pid, Duration::from_secs(120));
    let peak = status_bytes(pid, "VmHWM:");
    println!(
        "agent RSS {:.1} MiB before, peak {:.1} MiB with {SUBSCRIPTIONS} unread subscriptions",
        baseline as f64 / 1048576.0,
        peak as f64 / 1048576.0
    );
    assert!(
        peak < baseline + 64 * 1024 * 1024,
        "peak RSS {peak} with unread subscriptions of updates of 650 KB; {baseline} before"
    );
    // Others are served meanwhile.
    let status = http.call(&request("agent.status", json!({})));
    assert_eq!(status["result"]["unfinishedOperations"], 600, "{status}");

    // Reading the connection resumes the flow: answers and first updates arrive.
    ws.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let (mut answers, mut updates) = (0, 0);
    while updates < 32 {
        let message: serde_json::Value = serde_json::from_slice(&ws_recv(&mut ws).1).unwrap();
        if message.get("id").is_some() {
            assert!(
                message["result"].is_number() || message["result"].is_string(),
                "{message}"
            );
            answers += 1;
        } else {
            assert_eq!(message["params"]["result"]["owner"]["name"], "big");
            assert_eq!(
                message["params"]["result"]["operations"]
                    .as_array()
                    .map(Vec::len),
                Some(600)
            );
            updates += 1;
        }
    }
    assert!(answers >= updates, "{answers} answers, {updates} updates");
    drop(ws);
    let sent = sender.join().unwrap();
    assert!(sent > 0);
}

/// The agent's count of batches answered without error, from its metrics page.
fn batches_counted(socket: &std::path::Path) -> u64 {
    let mut s = UnixStream::connect(socket).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(r#"opmon_rpc_requests_total{method="batch",code="0"} "#))
        .map_or(0, |n| n.parse().unwrap_or_else(|e| panic!("{n:?}: {e}")))
}

/// A batch of notifications only gets nothing back over WebSocket, so it must not wait
/// for its answer to be written to give back its place among the calls in flight (32 in
/// all) and its count among its connection's unanswered calls (16): two connections
/// sending 16 such batches each would otherwise stop being read, and leave no place
/// for anyone's call.
#[test]
fn batches_of_notifications_only_over_websocket_hold_no_call_places() {
    const BATCHES: usize = 16;
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let batch = json!([{"jsonrpc": "2.0", "method": "snapshotter.changed",
                        "params": {"plugin": PLUGIN}}])
    .to_string();
    let mut connections: Vec<UnixStream> = (0..2)
        .map(|_| {
            let mut ws = websocket(&agent.socket);
            ws.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            for _ in 0..BATCHES {
                ws_send(&mut ws, &batch).unwrap();
            }
            ws
        })
        .collect();
    let all = 2 * BATCHES as u64;
    assert!(
        eventually(Duration::from_secs(30), || batches_counted(&agent.socket)
            >= all),
        "the agent handled {} of {all} batches",
        batches_counted(&agent.socket)
    );

    let mut http = RawHttp::connect(&agent.socket);
    let status = http.call(&request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
    for (i, ws) in connections.iter_mut().enumerate() {
        ws_send(ws, request("agent.status", json!({}))).unwrap();
        let answer: Value = serde_json::from_slice(&ws_recv(ws).1).unwrap();
        assert!(
            answer["result"]["version"].is_string(),
            "connection {i}: {answer}"
        );
    }
}

#[test]
fn many_concurrent_large_lists_are_served_within_a_memory_ceiling() {
    const OWNERS: usize = 300;
    const CLIENTS: usize = 400;
    raise_open_files(4096);
    let dir = tempfile::tempdir().unwrap();
    // All clients are this test's uid: lift the per-uid limit so memory is what is tested.
    let agent = Agent::start(dir.path(), &["--max-connections-per-uid", "1024"]);
    let pid = agent.pid();
    let mut http = RawHttp::connect(&agent.socket);
    for i in 0..OWNERS {
        let name = format!("backup-{i:04}-{}", "n".repeat(220));
        let started = http.call(&request(
            "backup.start",
            json!({"name": name, "uid": "u".repeat(100)}),
        ));
        assert_eq!(started["result"]["phase"], "InProgress");
    }
    let list = request("backup.list", json!({"limit": 1000}));
    let one = http.call(&list);
    let items = one["result"]["items"].as_array().map(Vec::len);
    assert_eq!(items, Some(OWNERS));
    let baseline = status_bytes(pid, "VmRSS:");

    // Every client sends its request before any reads an answer.
    let post = format!(
        "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{list}",
        list.len()
    );
    let mut clients: Vec<UnixStream> = (0..CLIENTS)
        .map(|_| UnixStream::connect(&agent.socket).unwrap())
        .collect();
    for c in &mut clients {
        c.write_all(post.as_bytes()).unwrap();
    }
    let mut sizes = Vec::new();
    for mut c in clients {
        c.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
        let mut answer = Vec::new();
        c.read_to_end(&mut answer).unwrap();
        sizes.push(answer.len());
    }
    let peak = status_bytes(pid, "VmHWM:");
    let answer = sizes[0];
    println!(
        "agent RSS {:.1} MiB before, peak {:.1} MiB for {CLIENTS} concurrent lists of {} KiB",
        baseline as f64 / 1048576.0,
        peak as f64 / 1048576.0,
        answer / 1024
    );
    assert!(
        sizes.iter().all(|s| *s == answer && *s > 100_000),
        "every client got the whole list: {sizes:?}"
    );
    assert!(
        peak < baseline + 64 * 1024 * 1024,
        "peak RSS {peak} for {CLIENTS} concurrent lists of {answer} bytes; {baseline} before"
    );
}

/// What a simple client (Python's `http.client`, say) does with a request: writes the
/// head with `framing` and all of `body`, and only then reads the answer. Returns the
/// answer's head and its JSON body.
fn post_whole_then_read(socket: &std::path::Path, framing: &str, body: &[u8]) -> (String, Value) {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{framing}\r\n\r\n"
    )
    .unwrap();
    s.write_all(body)
        .unwrap_or_else(|e| panic!("{framing}: the agent stopped reading the body: {e}"));
    let head = read_head(&mut s);
    let length =
        content_length(&head).unwrap_or_else(|| panic!("{framing}: no content-length in {head}"));
    let mut answer = vec![0; length];
    s.read_exact(&mut answer).unwrap();
    let value = serde_json::from_slice(&answer)
        .unwrap_or_else(|e| panic!("{framing}: {e}: {}", String::from_utf8_lossy(&answer)));
    (head, value)
}

/// `body` in chunks of at most `size` bytes, with the chunked encoding's last chunk.
fn chunked(body: &[u8], size: usize) -> Vec<u8> {
    body.chunks(size)
        .flat_map(|c| {
            [
                format!("{:x}\r\n", c.len()).into_bytes(),
                c.to_vec(),
                b"\r\n".to_vec(),
            ]
        })
        .flatten()
        .chain(b"0\r\n\r\n".iter().copied())
        .collect()
}

#[test]
fn a_client_that_sends_an_oversized_body_whole_reads_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &["--max-request-size", "65536"]);
    let body = request(
        "backup.start",
        json!({"name": "b", "uid": "x".repeat(2_000_000)}),
    );
    let cases = [
        (
            format!("Content-Length: {}", body.len()),
            body.as_bytes().to_vec(),
        ),
        (
            "Transfer-Encoding: chunked".to_string(),
            chunked(body.as_bytes(), 100_000),
        ),
    ];
    for (framing, bytes) in cases {
        let (head, value) = post_whole_then_read(&agent.socket, &framing, &bytes);
        assert!(head.starts_with("HTTP/1.1 413"), "{framing}: {head}");
        assert_eq!(
            value,
            json!({"jsonrpc": "2.0", "id": null,
                   "error": {"code": -32007, "message": "Request is too big: over 65536 bytes"}}),
            "{framing}"
        );
    }
}

/// Under the default limit (16 MiB) too: a body just past it, sent whole before the
/// answer is read, is read to its end and dropped, so the client reads the 413 rather
/// than a broken pipe.
#[test]
fn a_client_that_sends_a_body_just_over_the_default_limit_whole_reads_the_error() {
    const LIMIT: usize = 16 * 1024 * 1024;
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    for size in [LIMIT + 100, 17_000_000] {
        let body = vec![b' '; size];
        let framing = format!("Content-Length: {size}");
        let (head, value) = post_whole_then_read(&agent.socket, &framing, &body);
        assert!(head.starts_with("HTTP/1.1 413"), "{framing}: {head}");
        assert_eq!(
            value,
            json!({"jsonrpc": "2.0", "id": null,
                   "error": {"code": -32007, "message": format!("Request is too big: over {LIMIT} bytes")}}),
            "{framing}"
        );
    }
}

/// A WebSocket peer that sends many calls at once and reads none of the answers: its
/// frames arrive together, so all were read before its connection could be held back.
/// Each call now waits for one of its connection's slots before it takes a place among
/// everyone's calls, and gives the place back once its answer is made, so such peers
/// stop no one else (before, 200 `agent.status` calls on one connection took every
/// place for good and every other call of the agent timed out). A peer that goes away
/// meanwhile, or reads nothing for `write_stall_timeout` (30 s), has its connection
/// ended, though the agent had stopped reading it (before, it stayed forever).
#[test]
fn websocket_peers_that_read_none_of_their_answers_stop_no_one_else() {
    let dir = tempfile::tempdir().unwrap();
    let (agent, pid, baseline) = at_rest(dir.path());
    let hostile = |calls: usize| {
        let ws = websocket(&agent.socket);
        // Answers of 70 KB (`rpc.discover`) fill the socket, so the agent's writes wait
        // for the peer.
        let calls = (0..calls).map(|i| {
            let method = if i % 4 == 0 {
                "rpc.discover"
            } else {
                "agent.status"
            };
            json!({"jsonrpc": "2.0", "id": i, "method": method}).to_string()
        });
        let sender = send_from_thread(&ws, calls);
        (ws, sender)
    };
    let (stays, stays_sender) = hostile(200);
    let (leaves, leaves_sender) = hostile(200);
    let mut http = RawHttp::connect(&agent.socket);
    for _ in 0..3 {
        // RawHttp gives up after 60 s.
        let status = http.call(&request("agent.status", json!({})));
        assert!(status["result"]["version"].is_string(), "{status}");
    }
    assert_eq!(
        open_sockets(pid),
        baseline + 3,
        "the listener's and three connections"
    );

    // A peer that goes away is noticed, though its connection is not being read.
    drop(leaves);
    leaves_sender.join().unwrap();
    assert!(
        eventually(Duration::from_secs(20), || open_sockets(pid)
            == baseline + 2),
        "{} sockets after a peer left; {baseline} before",
        open_sockets(pid)
    );
    // One that stays and reads nothing is closed once its writes waited 30 s.
    assert!(
        eventually(Duration::from_secs(90), || open_sockets(pid)
            == baseline + 1),
        "{} sockets while a peer read nothing; {baseline} before",
        open_sockets(pid)
    );
    let status = http.call(&request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
    drop(stays);
    stays_sender.join().unwrap();
}

/// A batch of calls that mostly wait takes no place among the calls in flight, as each
/// of them alone would not, and one that also holds other calls does not keep a place
/// while its wait runs: 40 batches of one `backup.wait` and 40 of a `backup.wait` then
/// an `agent.status`, over HTTP and over WebSocket, leave room for everyone else
/// (before, each batch took a place for as long as its wait ran, and 32 of them stopped
/// every other call).
#[test]
fn batches_of_waits_take_no_place() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let mut http = RawHttp::connect(&agent.socket);
    http.call(&request("backup.start", json!({"name": "b1", "uid": "u1"})));
    let wait = json!({"jsonrpc": "2.0", "id": 1, "method": "backup.wait",
                      "params": {"name": "b1", "until": "terminal", "timeout": "120s"}});
    let status = json!({"jsonrpc": "2.0", "id": 2, "method": "agent.status"});
    let waits = json!([wait]).to_string();
    let mixed = json!([wait, status]).to_string();
    let mut held = Vec::new();
    for batch in std::iter::repeat_n(&waits, 40).chain(std::iter::repeat_n(&mixed, 40)) {
        let mut s = UnixStream::connect(&agent.socket).unwrap();
        write!(s, "{}{batch}", post_head(batch.len())).unwrap();
        held.push(s);
        let mut ws = websocket(&agent.socket);
        ws_send(&mut ws, batch).unwrap();
        held.push(ws);
    }
    // RawHttp gives up after 60 s; the waits run for 120 s.
    for _ in 0..3 {
        let status = http.call(&request("agent.status", json!({})));
        assert!(status["result"]["version"].is_string(), "{status}");
    }
    drop(held);
}

/// A batch of `calls` `rpc.discover` (70 KB answers each).
fn discover_batch(calls: usize) -> String {
    let calls: Vec<Value> = (0..calls)
        .map(|i| json!({"jsonrpc": "2.0", "id": i, "method": "rpc.discover"}))
        .collect();
    Value::Array(calls).to_string()
}

/// The refusal of a batch whose answer would pass the bound (16 MiB): code -32011, and
/// a message that says what to do.
fn assert_batch_refused(answer: &Value) {
    assert_eq!(answer["error"]["code"], -32011, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("the answer to this batch grew past 16777216 bytes at call ")
            && message
                .ends_with(" of its 1000, so the rest were not run; send fewer calls in a batch"),
        "{message}"
    );
}

/// Batches are bounded by their answer and run their calls as the calls alone would:
/// one WebSocket connection that sends 16 batches of 1,000 `rpc.discover` and reads
/// nothing leaves room for everyone else and holds far less than the 70 MB each answer
/// would be (before, every batch built its whole answer at once while holding one
/// place, and `agent.status` went unanswered for minutes while the agent grew past a
/// gigabyte).
#[test]
fn batches_of_many_large_answers_are_cut_off_and_hold_no_one_else() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let pid = agent.pid();
    let batch = discover_batch(1000);

    let mut http = RawHttp::connect(&agent.socket);
    assert_batch_refused(&http.call(&batch));

    let mut ws = websocket(&agent.socket);
    let sender = send_from_thread(&ws, std::iter::repeat_n(batch, 16));
    for _ in 0..3 {
        // RawHttp gives up after 60 s.
        let status = http.call(&request("agent.status", json!({})));
        assert!(status["result"]["version"].is_string(), "{status}");
    }
    for i in 0..16 {
        let answer: Value = serde_json::from_slice(&ws_recv(&mut ws).1)
            .unwrap_or_else(|e| panic!("answer {i} is not JSON: {e}"));
        assert_batch_refused(&answer);
    }
    sender.join().unwrap();
    let peak = status_bytes(pid, "VmHWM:");
    assert!(
        peak < 256 << 20,
        "the agent's peak RSS reached {} MiB",
        peak >> 20
    );
}

/// The answer to a batch of `calls` stopped because the agent holds all the bytes it
/// holds for its peers (`max_held_bytes`): -32003, naming the setting and where the
/// batch stopped.
fn assert_stopped_for_unread_answers(answer: &Value, calls: usize) {
    assert_eq!(answer["error"]["code"], -32003, "{answer:.300}");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("this batch stopped at call ")
            && message.contains(&format!(" of its {calls}: the agent holds "))
            && message.ends_with(
                " bytes for its peers, all max_held_bytes allows; read the answers, then ask \
                 again"
            ),
        "{message}"
    );
}

/// What many connections that read nothing make the agent hold is bounded over all of
/// them, not only per connection: 24 WebSocket clients that each send two batches of
/// 200 `rpc.discover` (14 MB answers) and read nothing leave the agent holding about
/// about 64 MiB of answers in all and 1 MiB per connection (under 256 MiB of RSS with
/// the allocator's slack), and everyone else served (before, every
/// connection built its first answer and queued it, then built its second: 24 × 28 MB,
/// and with 100 such clients the agent grew past 1.7 GB while `agent.status` took
/// seconds). Batches stopped for it say why; every client gets both of its answers, and
/// once they are read the agent's count is back down.
#[test]
fn connections_that_read_nothing_are_held_to_a_bound_over_all_of_them() {
    const CLIENTS: usize = 24;
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let pid = agent.pid();
    let batch = discover_batch(200);
    let clients: Vec<UnixStream> = (0..CLIENTS)
        .map(|_| {
            let ws = websocket(&agent.socket);
            send_from_thread(&ws, std::iter::repeat_n(batch.clone(), 2))
                .join()
                .unwrap();
            ws
        })
        .collect();
    quiescent(pid, Duration::from_secs(120));
    let peak = status_bytes(pid, "VmHWM:");
    assert!(
        peak < 256 << 20,
        "the agent's peak RSS reached {} MiB",
        peak >> 20
    );
    let mut http = RawHttp::connect(&agent.socket);
    let status = http.call(&request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
    // Read at once, each client on a thread of its own: a connection left unread for
    // 30 s would be closed as stalled.
    let readers: Vec<_> = clients
        .into_iter()
        .map(|mut ws| {
            std::thread::spawn(move || {
                (0..2)
                    .map(|_| serde_json::from_slice::<Value>(&ws_recv(&mut ws).1).unwrap())
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let answers: Vec<Value> = readers
        .into_iter()
        .flat_map(|reader| reader.join().unwrap())
        .collect();
    assert_eq!(answers.len(), 2 * CLIENTS);
    let mut stopped = 0;
    for answer in &answers {
        if let Some(list) = answer.as_array() {
            assert_eq!(list.len(), 200);
            continue;
        }
        assert_stopped_for_unread_answers(answer, 200);
        stopped += 1;
    }
    assert!(stopped > 0, "no batch was stopped");
    // Everything read, the agent's count is back down: a batch as large runs whole.
    let mut ws = websocket(&agent.socket);
    ws_send(&mut ws, &batch).unwrap();
    let answer: Value = serde_json::from_slice(&ws_recv(&mut ws).1).unwrap();
    assert_eq!(answer.as_array().map(Vec::len), Some(200), "{answer:.200}");
}

/// Batches in the making count too, however small each is: 240 WebSocket clients that
/// each send one batch of 14 `rpc.discover` (1 MB answers, under the 1 MiB a connection
/// may hold and still run calls) and read nothing make the
/// agent hold about its 64 MiB, not 240 answers (before, each batch ran whole while its
/// connection held little: 1 GB with 1,000 such clients). Batches stopped for it say
/// so, and every client gets its answer, unless the test's own wait for the agent to
/// rest (a busy machine) let it read nothing for longer than the 30 s write stall, after
/// which the agent may cut it off as too slow a reader, as documented.
#[test]
fn many_batches_in_the_making_are_held_to_the_bound_over_all_of_them() {
    const CLIENTS: usize = 240;
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let pid = agent.pid();
    let batch = discover_batch(14);
    let mut clients: Vec<UnixStream> = (0..CLIENTS).map(|_| websocket(&agent.socket)).collect();
    for ws in &mut clients {
        ws_send(ws, &batch).unwrap();
    }
    let sent = Instant::now();
    quiescent(pid, Duration::from_secs(120));
    let peak = status_bytes(pid, "VmHWM:");
    assert!(
        peak < 192 << 20,
        "the agent's peak RSS reached {} MiB",
        peak >> 20
    );
    let unread_for = sent.elapsed();
    let readers: Vec<_> = clients
        .into_iter()
        .map(|mut ws| std::thread::spawn(move || try_ws_recv(&mut ws)))
        .collect();
    let mut stopped = 0;
    for reader in readers {
        let answer = match reader.join().unwrap() {
            Ok((_, payload)) => serde_json::from_slice::<Value>(&payload).unwrap(),
            Err(e) => {
                assert!(
                    unread_for > Duration::from_secs(30),
                    "a client was cut off ({e}) after reading nothing for {unread_for:?}, \
                     within the 30 s write stall"
                );
                continue;
            }
        };
        if answer.as_array().is_some_and(|list| list.len() == 14) {
            continue;
        }
        assert_stopped_for_unread_answers(&answer, 14);
        stopped += 1;
    }
    assert!(stopped > 0, "no batch was stopped");
}

/// An HTTP connection's place among the calls in flight is given back once its response
/// is made, not when its reader takes it: 40 connections that pipeline `rpc.discover`
/// and read nothing stop no one else, while they are still open (before, each held a
/// place until its 30 s write stall closed it).
#[test]
fn http_peers_that_read_none_of_their_answers_hold_no_places() {
    let dir = tempfile::tempdir().unwrap();
    let (agent, pid, baseline) = at_rest(dir.path());
    let call = request("rpc.discover", json!({}));
    let one = format!("{}{call}", post_head(call.len()));
    let pipelined = one.repeat(100);
    let mut held = Vec::new();
    for _ in 0..40 {
        let mut s = UnixStream::connect(&agent.socket).unwrap();
        s.write_all(pipelined.as_bytes()).unwrap();
        held.push(s);
    }
    let mut http = RawHttp::connect(&agent.socket);
    for _ in 0..3 {
        let status = http.call(&request("agent.status", json!({})));
        assert!(status["result"]["version"].is_string(), "{status}");
    }
    assert_eq!(
        open_sockets(pid),
        baseline + 41,
        "the 40 that read nothing were still open when agent.status answered"
    );
    drop(held);
}

/// A request holds its place among the calls in flight only once its body has come:
/// 40 connections that each declare a 200-byte body and send one byte of it, and 8 that
/// do the same with a 1 MB body, stop no one else's calls while they are still open
/// (before, each took a place before its body was read: 32 of them left `agent.status`
/// unanswered until the idle timeout closed them, 15 minutes later).
#[test]
fn requests_whose_bodies_do_not_come_hold_no_places() {
    let dir = tempfile::tempdir().unwrap();
    let (agent, pid, baseline) = at_rest(dir.path());
    let mut held = Vec::new();
    for declared in [200; 40].into_iter().chain([1_000_000; 8]) {
        let mut s = UnixStream::connect(&agent.socket).unwrap();
        let head = format!("{}{{", post_head(declared));
        s.write_all(head.as_bytes()).unwrap();
        held.push(s);
    }
    let mut http = RawHttp::connect(&agent.socket);
    http.call(&request("backup.start", json!({"name": "b1", "uid": "u1"})));
    for _ in 0..3 {
        let status = http.call(&request("agent.status", json!({})));
        assert!(status["result"]["version"].is_string(), "{status}");
        let got = http.call(&request("backup.get", json!({"name": "b1"})));
        assert_eq!(got["result"]["phase"], "InProgress", "{got}");
    }
    assert_eq!(
        open_sockets(pid),
        baseline + 49,
        "the 48 slow bodies were still open when the calls were answered"
    );
    for mut s in held {
        s.set_nonblocking(true).unwrap();
        let mut byte = [0; 1];
        assert!(
            matches!(s.read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "a request whose body had not come was answered"
        );
    }
}

/// A WebSocket client may send several large batches before it reads: the agent keeps
/// reading while it answers them (before, a batch held all of its connection's slots, so
/// the agent stopped reading while the client, its frames unsent, read nothing, and the
/// connection was closed as stalled after 30 s).
#[test]
fn a_client_that_sends_several_large_batches_before_reading_gets_every_answer() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let calls: Vec<Value> = (0..5000)
        .map(|i| json!({"jsonrpc": "2.0", "id": i, "method": "agent.status"}))
        .collect();
    let batch = Value::Array(calls).to_string();
    let mut ws = websocket(&agent.socket);
    for _ in 0..3 {
        ws_send(&mut ws, &batch).expect("the agent reads every batch");
    }
    for i in 0..3 {
        let answer: Value = serde_json::from_slice(&ws_recv(&mut ws).1)
            .unwrap_or_else(|e| panic!("answer {i} is not JSON: {e}"));
        let answers = answer
            .as_array()
            .unwrap_or_else(|| panic!("answer {i}: {answer}"));
        assert_eq!(answers.len(), 5000, "answer {i}");
        assert!(answers.iter().all(|a| a["result"]["version"].is_string()));
    }
}

/// A subscription cannot be called in a batch (its answer would go out ahead of the
/// batch's, and again inside it); the batch's other calls are answered.
#[test]
fn subscriptions_are_refused_in_a_batch() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let mut http = RawHttp::connect(&agent.socket);
    http.call(&request("backup.start", json!({"name": "b1", "uid": "u1"})));
    let mut ws = websocket(&agent.socket);
    let batch = json!([
        {"jsonrpc": "2.0", "id": 1, "method": "backup.subscribe", "params": {"name": "b1"}},
        {"jsonrpc": "2.0", "id": 2, "method": "agent.status"},
    ]);
    ws_send(&mut ws, batch.to_string()).unwrap();
    let answer: Value = serde_json::from_slice(&ws_recv(&mut ws).1).unwrap();
    let answers = answer.as_array().unwrap_or_else(|| panic!("{answer}"));
    assert_eq!(answers.len(), 2, "{answer}");
    assert_eq!(answers[0]["id"], 1);
    assert_eq!(answers[0]["error"]["code"], -32600, "{answer}");
    assert_eq!(
        answers[0]["error"]["message"],
        "backup.subscribe cannot be called in a batch: a subscription is answered at once, \
         ahead of its batch; call it on its own"
    );
    assert!(answers[1]["result"]["version"].is_string(), "{answer}");
}

/// A batch stops once its client has gone: of 3,000 `backup.start` sent in one batch by
/// a WebSocket client that closes once the first has been run, far from all are run
/// (before, the batch held all of its connection's slots, so the agent stopped reading
/// and never saw the client go: every call was run, its answer built for no one).
#[test]
fn a_batch_stops_once_its_client_has_gone() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let calls: Vec<Value> = (0..3000)
        .map(|i| {
            json!({"jsonrpc": "2.0", "id": i, "method": "backup.start",
                   "params": {"name": format!("b{i}"), "uid": format!("u{i}")}})
        })
        .collect();
    let mut ws = websocket(&agent.socket);
    ws_send(&mut ws, Value::Array(calls).to_string()).unwrap();
    let mut http = RawHttp::connect(&agent.socket);
    let mut started = || {
        let status = http.call(&request("agent.status", json!({})));
        status["result"]["owners"]["InProgress"]
            .as_u64()
            .unwrap_or(0)
    };
    assert!(
        eventually(Duration::from_secs(60), || started() > 0),
        "the batch never started"
    );
    drop(ws);
    quiescent(agent.pid(), Duration::from_secs(120));
    let started = started();
    assert!(
        started < 3000,
        "all {started} backups were started for a client that left"
    );
}

/// Calls already read run only while their connection has room: one WebSocket client
/// that sends 16 batches of 200 `rpc.discover` (14 MB answers, under the batch limit)
/// and reads nothing makes the agent hold about two of those answers, not sixteen
/// (before, every batch read, one per slot, built its answer while the first waited for
/// the client); once the client reads, every answer comes.
#[test]
fn calls_already_read_wait_for_room_before_they_run() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let pid = agent.pid();
    let batch = discover_batch(200);
    let mut ws = websocket(&agent.socket);
    send_from_thread(&ws, std::iter::repeat_n(batch, 16))
        .join()
        .unwrap();
    quiescent(pid, Duration::from_secs(120));
    let peak = status_bytes(pid, "VmHWM:");
    assert!(
        peak < 128 << 20,
        "the agent's peak RSS reached {} MiB",
        peak >> 20
    );
    for i in 0..16 {
        let answer: Value = serde_json::from_slice(&ws_recv(&mut ws).1)
            .unwrap_or_else(|e| panic!("answer {i} is not JSON: {e}"));
        let answers = answer.as_array().unwrap_or_else(|| panic!("answer {i}"));
        assert_eq!(answers.len(), 200, "answer {i}");
    }
}

/// `clients` HTTP clients each ask for `backup.operations` of a backup of `ops`
/// operations with 1,000-byte IDs and read next to nothing (64 KiB every 5 s, so the
/// agent does not close them as stalled however long the lists take to make), after
/// the method's largest answer so far was the list of its first `first` operations (0:
/// the list was never asked for before): the agent's peak RSS stays
/// under 320 MiB, `agent.status` answers meanwhile, and every client gets its whole
/// list once it reads.
fn unread_lists_are_held_to_the_bound(first: usize, ops: usize, clients: usize) {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start_untraced(dir.path(), &[]);
    let pid = agent.pid();
    let mut http = RawHttp::connect(&agent.socket);
    http.call(&request("backup.start", json!({"name": "big", "uid": "u"})));
    let list = request("backup.operations", json!({"name": "big"}));
    let steps = if first == 0 {
        vec![(0, ops)]
    } else {
        vec![(0, first), (first, ops)]
    };
    for (from, to) in steps {
        let added: Vec<_> = (from..to)
            .map(|i| operation(PLUGIN, &format!("{i:05}-{}", "x".repeat(1000)), "data", &[]))
            .collect();
        let added = http.call(&request(
            "backup.addOperations",
            json!({"name": "big", "operations": added}),
        ));
        assert_eq!(added["result"]["added"], to - from, "{added:.300}");
        if to == first {
            let whole = http.call(&list);
            assert_eq!(whole["result"].as_array().map(Vec::len), Some(first));
        }
    }
    drop(http);

    let post = format!(
        "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{list}",
        list.len()
    );
    let held: Vec<UnixStream> = (0..clients)
        .map(|_| UnixStream::connect(&agent.socket).unwrap())
        .collect();
    // Each client reads a little every 5 s until told to read everything: a connection
    // whose peer reads nothing for 30 s is closed as stalled, and the lists take longer
    // than that to be made, 2 at a time, on a slow or busy machine. 64 KiB of a 10 MB
    // list per 5 s holds the answer all the same.
    let go = Arc::new((Mutex::new(false), Condvar::new()));
    let readers: Vec<_> = held
        .into_iter()
        .map(|mut c| {
            c.write_all(post.as_bytes()).unwrap();
            let go = go.clone();
            std::thread::spawn(move || {
                // Only so that a hung agent fails the test: a busy machine makes the
                // lists slowly (each client reads a little every 5 s meanwhile).
                c.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
                let mut answer = Vec::new();
                let mut chunk = vec![0; 64 << 10];
                loop {
                    let (told, wake) = &*go;
                    let told = told.lock().unwrap();
                    let (told, _) = wake
                        .wait_timeout_while(told, Duration::from_secs(5), |told| !*told)
                        .unwrap();
                    if *told {
                        break;
                    }
                    drop(told);
                    match c.read(&mut chunk).unwrap() {
                        0 => return answer,
                        n => answer.extend_from_slice(&chunk[..n]),
                    }
                }
                c.read_to_end(&mut answer).unwrap();
                answer
            })
        })
        .collect();
    quiescent(pid, Duration::from_secs(120));
    let peak = status_bytes(pid, "VmHWM:");
    println!("peak RSS {} MiB with {clients} unread lists", peak >> 20);
    let mut probe = RawHttp::connect(&agent.socket);
    let status = probe.call(&request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
    *go.0.lock().unwrap() = true;
    go.1.notify_all();
    let mut bytes = 0;
    for reader in readers {
        let answer = reader.join().unwrap();
        bytes = answer.len();
        let text = String::from_utf8_lossy(&answer);
        let body = text.split_once("\r\n\r\n").map_or("", |(_, body)| body);
        let value: Value =
            serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {:.300}", text.as_ref()));
        assert_eq!(
            value["result"].as_array().map(Vec::len),
            Some(ops),
            "{value:.300}"
        );
    }
    assert!(
        peak < 320 << 20,
        "the agent's peak RSS reached {} MiB for {clients} unread lists of {} KB",
        peak >> 20,
        bytes / 1000
    );
}

/// One call's answer can be large too (`backup.operations` of a backup of thousands of
/// operations): once a method has answered with 1 MiB or more, each call of it counts
/// that much against the bound over all connections before it runs, and waits, holding
/// no place, while the server holds more. 80 HTTP clients that each ask for a 5.3 MB
/// list and read nothing make the agent hold about 64 MiB of answers, not 80 lists (its
/// peak about 212 MiB with the lists being made; 582 MiB before, and some clients then
/// got a list cut short).
#[test]
fn large_answers_of_single_calls_are_held_to_the_bound_over_all_of_them() {
    unread_lists_are_held_to_the_bound(3600, 3600, 80);
}

/// Clients asking at once for lists larger than any the agent gave before (40 clients,
/// 10 MB lists, when the largest so far was 1.1 MB), reading nothing: the agent stays
/// under its memory ceiling, answers `agent.status` meanwhile, and every client gets
/// its whole list once it reads.
#[test]
fn lists_larger_than_any_given_before_keep_the_agent_under_its_memory_ceiling() {
    unread_lists_are_held_to_the_bound(800, 7200, 40);
}

/// The same for a listing no one asked for before: 40 clients each asking at once for
/// a 10 MB list, reading nothing.
#[test]
fn listings_asked_for_the_first_time_keep_the_agent_under_its_memory_ceiling() {
    unread_lists_are_held_to_the_bound(0, 7200, 40);
}

/// WebSocket clients that each send the header of a frame declaring a 16 MB message, and
/// nothing more (40 such clients, 14 bytes each, once took the agent to 639 MiB): the
/// agent answers everyone else, stays under its memory ceiling (such a message is over
/// the WebSocket message limit, so nothing is set aside for it), and closes the stalled
/// connections once their message has not come whole within the body timeout (30 s).
#[test]
fn websocket_headers_of_large_messages_that_never_come_keep_the_agent_under_its_ceiling() {
    let dir = tempfile::tempdir().unwrap();
    let (agent, pid, baseline) = at_rest(dir.path());
    let before = status_bytes(pid, "VmHWM:");
    let mut header = vec![0x81u8, 0x80 | 127];
    header.extend_from_slice(&16_000_000u64.to_be_bytes());
    header.extend_from_slice(&[0; 4]);
    let held: Vec<UnixStream> = (0..40)
        .map(|_| {
            let mut ws = websocket(&agent.socket);
            ws.write_all(&header).unwrap();
            ws
        })
        .collect();
    let mut http = RawHttp::connect(&agent.socket);
    let status = http.call(&request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
    for mut ws in held {
        ws.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let mut rest = Vec::new();
        ws.read_to_end(&mut rest)
            .expect("a stalled message's connection was closed");
    }
    let grown = status_bytes(pid, "VmHWM:") - before;
    println!("peak RSS grew by {} MiB", grown >> 20);
    assert!(
        grown < 160 << 20,
        "40 stalled 16 MB messages grew the agent's peak RSS by {} MiB",
        grown >> 20
    );
    drop(http);
    assert!(
        eventually(Duration::from_secs(30), || open_sockets(pid) == baseline),
        "the stalled connections' sockets were not all closed"
    );
}

/// A uid's unread answers are bounded by its quota over all its WebSocket connections,
/// not by each connection's room: 64 connections that each send 40 `rpc.discover`
/// (116 KB answers) and read nothing leave the agent holding about the uid's 4 MiB
/// quota, not 64 connections × 1 MiB (before, three uids of 256 such connections took
/// the agent from 17 MB to 800 MB), and HTTP calls are still answered.
#[test]
fn unread_answers_over_many_websockets_are_held_to_the_total() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &["--max-held-bytes", "4194304"]);
    let pid = agent.pid();
    let mut http = RawHttp::connect(&agent.socket);
    http.call(&request("rpc.discover", json!({})));
    let baseline = status_bytes(pid, "VmRSS:");
    let call = request("rpc.discover", json!({}));
    let mut held = Vec::new();
    for _ in 0..64 {
        let mut ws = websocket(&agent.socket);
        for _ in 0..40 {
            ws_send(&mut ws, &call).unwrap();
        }
        held.push(ws);
    }
    quiescent(pid, Duration::from_secs(120));
    let grown = status_bytes(pid, "VmRSS:").saturating_sub(baseline);
    let status = http.call(&request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
    assert!(
        grown < 40 << 20,
        "64 connections that read nothing grew the agent by {} MiB",
        grown >> 20
    );
    // What was held is answered once read.
    let answer = ws_answer(&mut held[0]);
    assert!(answer["result"]["openrpc"].is_string(), "{answer:.200}");
}
