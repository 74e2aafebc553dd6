//! End-to-end: what one peer may make the agent hold, and answers the JSON-RPC spec
//! prescribes. Each test is an attack seen from outside, asserted by what users see: a
//! clear refusal, everyone else answered, the agent's descriptors and polls bounded.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use opmon_tests::held::{CallerAs, HeldFiles};
use opmon_tests::raw::{
    agent_pid, frame, read_head, request, websocket, ws_answer, ws_closed, ws_recv, ws_send,
};
use opmon_tests::{agent_command, journal, operation, Agent, RawHttp, SdkSnapshotter};
use serde_json::{json, Value};

/// `{"jsonrpc":"2.0","id":ID,"method":"backup.start",…}` starting backup `name`.
fn start_with_id(id: &str, name: &str) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"backup.start","params":{{"name":"{name}","uid":"u"}}}}"#
    )
}

const INVALID_IDS: [&str; 4] = ["[1]", "{}", "true", "1.5"];

/// An `id` that is not a string, a number or null makes a request invalid: JSON-RPC 2.0
/// answers it with -32600 and `id: null` (it cannot be echoed), and the method is not
/// run (before, the agent answered an empty 200).
#[test]
fn ids_that_are_not_a_string_a_number_or_null_are_answered_invalid_with_id_null() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start_untraced(dir.path(), &[]);
    let mut http = RawHttp::connect(&agent.socket);
    for (n, id) in INVALID_IDS.into_iter().enumerate() {
        let name = format!("b{n}");
        let (_, text) = http.post(start_with_id(id, &name).as_bytes());
        let answer: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("id {id}: {e}: {text:?}"));
        assert_eq!(answer["error"]["code"], json!(-32600), "id {id}: {answer}");
        assert_eq!(answer["id"], Value::Null, "id {id}: {answer}");
        let got = http.call(&request("backup.get", json!({"name": name})));
        assert_eq!(
            got["error"]["code"],
            json!(1001),
            "{name} was not started: {got}"
        );
    }
    let batch = format!("[{}]", start_with_id("[1]", "in-batch"));
    let (_, text) = http.post(batch.as_bytes());
    assert!(text.contains("-32600"), "a batch: {text:?}");
}

/// The same over WebSocket.
#[test]
fn ids_that_are_not_a_string_a_number_or_null_are_answered_invalid_over_websocket() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start_untraced(dir.path(), &[]);
    let mut ws = websocket(&agent.socket);
    for (n, id) in INVALID_IDS.into_iter().enumerate() {
        ws_send(&mut ws, start_with_id(id, &format!("b{n}")).as_bytes()).unwrap();
        let (_, payload) = ws_recv(&mut ws);
        let answer: Value = serde_json::from_slice(&payload).expect("a JSON answer");
        assert_eq!(answer["error"]["code"], json!(-32600), "id {id}: {answer}");
        assert_eq!(answer["id"], Value::Null, "id {id}: {answer}");
    }
}

/// A WebSocket text frame must be UTF-8 (RFC 6455 §8.1): one that is not closes the
/// connection with 1007, and the agent serves everyone else.
#[test]
fn a_websocket_text_frame_that_is_not_utf8_is_closed_with_1007() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start_untraced(dir.path(), &[]);
    let mut ws = websocket(&agent.socket);
    let mut bad = br#"{"jsonrpc":"2.0","id":1,"method":"agent.status","params":{"x":""#.to_vec();
    bad.extend_from_slice(&[0xff, 0xfe, 0xc0]);
    bad.extend_from_slice(br#""}}"#);
    ws_send(&mut ws, &bad).unwrap();
    let (opcode, payload) = ws_recv(&mut ws);
    assert_eq!(
        opcode,
        0x8,
        "a close frame, got {:?}",
        String::from_utf8_lossy(&payload)
    );
    assert!(payload.len() >= 2, "the close frame has a status code");
    assert_eq!(u16::from_be_bytes([payload[0], payload[1]]), 1007);
    let mut http = RawHttp::connect(&agent.socket);
    let status = http.call(&request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
}

/// A WebSocket frame against RFC 6455 (5.2, 5.4, 5.5) closes the connection with 1002
/// (protocol error), as an unmasked one does: a reserved bit or opcode, a fragmented or
/// oversized control frame, a continuation with no message begun, a new message inside
/// one. (Before, all but the unmasked frame were closed with 1000, as if all was well.)
#[test]
fn websocket_frames_against_the_protocol_are_closed_with_1002() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start_untraced(dir.path(), &[]);
    let call = request("agent.status", json!({}));
    let cases: [(&str, Vec<u8>); 6] = [
        ("RSV1 set", {
            let mut f = frame(true, 0x1, call.as_bytes(), true);
            f[0] |= 0x40;
            f
        }),
        ("reserved opcode 3", frame(true, 0x3, b"x", true)),
        ("fragmented ping", frame(false, 0x9, b"x", true)),
        ("ping of 126 bytes", frame(true, 0x9, &[b'x'; 126], true)),
        (
            "continuation first",
            frame(true, 0x0, call.as_bytes(), true),
        ),
        ("text inside a text message", {
            let mut f = frame(false, 0x1, &call.as_bytes()[..5], true);
            f.extend(frame(true, 0x1, call.as_bytes(), true));
            f
        }),
    ];
    for (what, bytes) in cases {
        let mut ws = websocket(&agent.socket);
        ws.write_all(&bytes).unwrap();
        assert_eq!(ws_closed(&mut ws), Some(1002), "{what}");
    }
    let mut http = RawHttp::connect(&agent.socket);
    let status = http.call(&request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
}

/// A backup server's name follows one stated rule (empty, or `namespace/name` of
/// lowercase DNS labels and subdomains), so names that look alike are refused rather
/// than become different servers; the message names the field and the rule.
#[test]
fn server_names_that_only_look_alike_are_refused_naming_the_rule() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start_untraced(dir.path(), &[]);
    let mut http = RawHttp::connect(&agent.socket);
    let start = |http: &mut RawHttp, owner: &str, server: &str| {
        http.call(&request(
            "backup.start",
            json!({"name": owner, "uid": "u", "server": {"name": server, "instance": "pod-a"}}),
        ))
    };
    for (n, good) in ["velero/velero", "velero", "ns-1/velero.a-b", ""]
        .into_iter()
        .enumerate()
    {
        let answer = start(&mut http, &format!("ok{n}"), good);
        assert!(answer["result"].is_object(), "{good:?} refused: {answer}");
    }
    for (n, bad) in [
        "velero/velero\u{200b}",
        "velero/velero ",
        " velero/velero",
        "velero/v\u{0435}lero",
        "Velero/velero",
        "velero//velero",
        "a/b/c",
        "velero/",
    ]
    .into_iter()
    .enumerate()
    {
        let answer = start(&mut http, &format!("bad{n}"), bad);
        assert_eq!(
            answer["error"]["code"],
            json!(-32602),
            "{bad:?} accepted: {answer}"
        );
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.starts_with("server.name") && message.contains("lowercase"),
            "{bad:?}: {message}"
        );
    }
}

/// One peer cannot register snapshotters without bound (each costs connections or
/// processes once polled): past its quota a registration is refused naming the setting,
/// replacing one of its own still works, and unregistering gives the room back.
#[test]
fn snapshotter_registrations_of_one_peer_are_bounded_with_a_clear_refusal() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start_untraced(dir.path(), &["--max-snapshotters-per-uid", "8"]);
    let mut http = RawHttp::connect(&agent.socket);
    let register = |http: &mut RawHttp, n: usize| {
        http.call(&request(
            "snapshotter.register",
            json!({"name": format!("example.io/p{n}"), "apiVersion": "v2",
                   "socket": format!("/nonexistent/p{n}.sock")}),
        ))
    };
    for n in 0..8 {
        let answer = register(&mut http, n);
        assert!(answer["result"].is_object(), "registration {n}: {answer}");
    }
    let refused = register(&mut http, 8);
    let message = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(
        refused["error"]["code"].is_i64() && message.contains("max_snapshotters_per_uid"),
        "{refused}"
    );
    let replaced = register(&mut http, 3);
    assert!(
        replaced["result"].is_object(),
        "replacing its own: {replaced}"
    );
    let gone = http.call(&request(
        "snapshotter.unregister",
        json!({"name": "example.io/p0"}),
    ));
    assert!(gone["result"].is_object(), "{gone}");
    let again = register(&mut http, 8);
    assert!(
        again["result"].is_object(),
        "after unregistering one: {again}"
    );
}

/// One peer cannot hold subscriptions without bound (each costs the agent memory for
/// as long as it lasts): past its quota, over any number of connections, a subscription
/// is refused naming the setting, and the agent goes on serving.
#[test]
fn subscriptions_of_one_peer_are_bounded_with_a_clear_refusal() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start_untraced(dir.path(), &["--max-subscriptions-per-uid", "20"]);
    let mut http = RawHttp::connect(&agent.socket);
    http.call(&request("backup.start", json!({"name": "b1", "uid": "u1"})));
    let subscribe = request("backup.subscribe", json!({"name": "b1"}));
    let mut sockets = Vec::new();
    let mut refusal = None;
    for n in 0..30 {
        // Ten to a connection: the quota is the peer's, not the connection's.
        if n % 10 == 0 {
            sockets.push(websocket(&agent.socket));
        }
        let ws = sockets.last_mut().expect("a connection");
        ws_send(ws, subscribe.as_bytes()).unwrap();
        let answer = ws_answer(ws);
        if answer.get("error").is_some() {
            refusal = Some((n, answer));
            break;
        }
        assert!(
            answer["result"].is_string() || answer["result"].is_number(),
            "{answer}"
        );
    }
    let (n, answer) = refusal.expect("a subscription past the quota is refused");
    assert_eq!(n, 20, "refused at the quota: {answer}");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("max_subscriptions_per_uid"), "{answer}");
    let status = http.call(&request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
    // A connection that goes gives its subscriptions back.
    sockets.remove(0);
    let mut ws = websocket(&agent.socket);
    let accepted = opmon_tests::try_eventually(Duration::from_secs(30), || {
        ws_send(&mut ws, subscribe.as_bytes()).unwrap();
        ws_answer(&mut ws).get("error").is_none()
    });
    assert!(
        accepted.is_some(),
        "a closed connection's subscriptions were given back"
    );
}

/// Hints for one operation coalesce: however fast clients send `snapshotter.changed`,
/// the operation is polled about once a second at most (before, four clients made the
/// agent call one snapshotter thousands of times a second).
#[test]
fn a_flood_of_hints_polls_an_operation_about_once_a_second_at_most() {
    let dir = tempfile::tempdir().unwrap();
    let gates = dir.path().join("gates");
    std::fs::create_dir(&gates).unwrap();
    let journal_path = dir.path().join("journal");
    let snapshotter = SdkSnapshotter::start(dir.path(), "copier", &gates, &journal_path);
    let agent = Agent::start_polling_every(dir.path(), "1h", &[]);
    let mut http = RawHttp::connect(&agent.socket);
    let plugin = "example.io/copier";
    let registered = http.call(&request(
        "snapshotter.register",
        json!({"name": plugin, "apiVersion": "v2", "socket": snapshotter.socket}),
    ));
    assert!(registered["result"].is_object(), "{registered}");
    http.call(&request("backup.start", json!({"name": "b1", "uid": "u1"})));
    let op = serde_json::to_value(operation(plugin, "gate-1", "pvc-1", &[])).unwrap();
    let added = http.call(&request(
        "backup.addOperations",
        json!({"name": "b1", "operations": [op]}),
    ));
    assert!(added["result"].is_object(), "{added}");
    let ended = http.call(&request("backup.endInProgress", json!({"name": "b1"})));
    assert!(ended["result"].is_object(), "{ended}");
    let polls = || {
        journal(&journal_path)
            .iter()
            .filter(|l| l.starts_with("progress gate-1 "))
            .count()
    };
    let before = polls();
    let began = Instant::now();
    let flood = Duration::from_secs(3);
    let hint = request(
        "snapshotter.changed",
        json!({"plugin": plugin, "operations": ["gate-1"]}),
    );
    let senders: Vec<_> = (0..4)
        .map(|_| {
            let socket = agent.socket.clone();
            let hint = hint.clone();
            std::thread::spawn(move || {
                let mut http = RawHttp::connect(&socket);
                let mut sent = 0u32;
                while began.elapsed() < flood {
                    let answer = http.call(&hint);
                    assert!(answer.get("error").is_none(), "{answer}");
                    sent += 1;
                }
                sent
            })
        })
        .collect();
    let sent: u32 = senders.into_iter().map(|t| t.join().unwrap()).sum();
    let elapsed = began.elapsed().as_secs() as usize;
    let polled = polls() - before;
    assert!(sent > 100, "the flood sent only {sent} hints");
    assert!(
        polled >= 1,
        "the hints were heard: {:?}\n{}",
        journal(&journal_path),
        agent.log_text()
    );
    assert!(
        polled <= elapsed + 2,
        "{sent} hints in {elapsed} s polled gate-1 {polled} times"
    );
    drop(snapshotter);
}

/// A waiting call holds no read of a large body: many large batches of `backup.wait`
/// (each body over 64 KiB) leave a large `addOperations` of someone else answered
/// (before, four such batches took every read of a large body for as long as their
/// waits ran).
#[test]
fn batches_of_waits_leave_large_requests_answered() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start_untraced(dir.path(), &[]);
    let mut http = RawHttp::connect(&agent.socket);
    http.call(&request(
        "backup.start",
        json!({"name": "waited", "uid": "u0"}),
    ));
    let wait = json!({"jsonrpc": "2.0", "id": 1, "method": "backup.wait",
                      "params": {"name": "waited", "until": "terminal", "timeout": "600s"}});
    let batch = Value::from(vec![wait; 1000]).to_string();
    assert!(batch.len() > 64 * 1024);
    let mut held = Vec::new();
    for _ in 0..8 {
        let mut s = UnixStream::connect(&agent.socket).unwrap();
        write!(
            s,
            "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{batch}",
            batch.len()
        )
        .unwrap();
        held.push(s);
    }
    http.call(&request(
        "backup.start",
        json!({"name": "large", "uid": "u1"}),
    ));
    let ops: Vec<Value> = (0..1000)
        .map(|n| {
            serde_json::to_value(operation(
                "example.io/x",
                &format!("op-{n:0>100}"),
                "pvc",
                &[],
            ))
            .unwrap()
        })
        .collect();
    let body = request(
        "backup.addOperations",
        json!({"name": "large", "operations": ops}),
    );
    assert!(body.len() > 150 * 1000, "{} bytes", body.len());
    let mut other = UnixStream::connect(&agent.socket).unwrap();
    // Bound a failure only: before, no answer came for minutes.
    other
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    other
        .set_write_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        other,
        "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let head = read_head(&mut other);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let got = http.call(&request("backup.get", json!({"name": "large"})));
    assert_eq!(got["result"]["operationsAttempted"], json!(1000), "{got}");
    drop(held);
}

/// Spawns the agent in `dir` (socket reachable by every uid) with soft and hard
/// descriptor limits `soft`/`hard`.
fn agent_with_nofile(dir: &Path, soft: u64, hard: u64, extra: &[&str]) -> Child {
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    for sub in ["run", "state"] {
        std::fs::create_dir(dir.join(sub)).unwrap();
        std::fs::set_permissions(dir.join(sub), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let log = std::fs::File::create(dir.join("agent.log")).unwrap();
    let mut cmd = agent_command();
    cmd.arg("--socket")
        .arg(dir.join("run/agent.sock"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args(["--socket-mode", "0666"])
        .args(extra)
        .env("OPMON_CONFIG", "/dev/null")
        .env("OPMON_LOG_LEVEL", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    // SAFETY: setrlimit is async-signal-safe; the closure allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, soft, hard)
                .map_err(std::io::Error::from)
        });
    }
    let mut child = cmd.spawn().expect("starting the agent");
    let socket = dir.join("run/agent.sock");
    let began = Instant::now();
    while UnixStream::connect(&socket).is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "the agent exited ({status}):\n{}",
                std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default()
            );
        }
        assert!(began.elapsed() < Duration::from_secs(60), "no socket");
        std::thread::sleep(Duration::from_millis(10));
    }
    child
}

/// The soft and hard limits on open files of `pid`.
fn nofile_of(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files in /proc/<pid>/limits");
    let fields: Vec<&str> = line.split_whitespace().collect();
    (fields[3].to_string(), fields[4].to_string())
}

/// The agent may open as many files as its hard limit allows: started with a soft
/// limit of 256 (and a hard one of 4096), it runs with 4096.
#[test]
fn the_agent_raises_its_open_file_limit_to_the_hard_limit() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = agent_with_nofile(dir.path(), 256, 4096, &[]);
    let pid = agent_pid(&dir.path().join("state"));
    let (soft, hard) = nofile_of(pid);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!((soft.as_str(), hard.as_str()), ("4096", "4096"));
}

/// A process as `uid` holding `count` idle connections to `socket` until its stdin
/// closes; returns once they are all open (a refused one is answered and closed by
/// the agent later).
fn idle_connections_as(uid: u32, socket: &Path, count: usize) -> Child {
    let script = "import socket, sys\n\
        held = []\n\
        for _ in range(int(sys.argv[2])):\n\
        \x20   s = socket.socket(socket.AF_UNIX)\n\
        \x20   s.connect(sys.argv[1])\n\
        \x20   held.append(s)\n\
        print('open', flush=True)\n\
        sys.stdin.read()\n";
    let mut child = Command::new("setpriv")
        .arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .arg("--clear-groups")
        .args(["--", "/usr/bin/python3", "-c", script])
        .arg(socket)
        .arg(count.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("running python3 as another uid");
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().expect("piped"))
        .read_line(&mut line)
        .expect("reading the helper");
    assert_eq!(line.trim(), "open", "the helper as uid {uid} did not start");
    child
}

/// POSTs `body` on a new connection to `socket` and reads the JSON answer, failing if it
/// takes more than 10 s.
fn call_within(socket: &Path, body: &str) -> Value {
    let mut s = UnixStream::connect(socket).expect("connecting");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer)
        .unwrap_or_else(|e| panic!("no answer to {body} within 10 s: {e}"));
    let (_, json) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {answer}"))
}

/// Allowed uids holding idle connections cannot take the descriptors the agent needs:
/// with 1,024 descriptors in all, four allowed uids holding 256 idle connections each
/// leave root answered and the database writable (before, they took every descriptor:
/// root's call went unanswered and writes failed with "unable to open database file").
#[test]
fn idle_connections_of_allowed_uids_leave_the_operator_and_the_database_served() {
    if !nix::unistd::geteuid().is_root() {
        assert!(std::env::var_os("CI").is_none(), "must run as root in CI");
        eprintln!("skipped: needs root to run clients as other uids");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut agent = agent_with_nofile(
        dir.path(),
        1024,
        1024,
        &["--allowed-uids", "64001,64002,64003,64004"],
    );
    let socket = dir.path().join("run/agent.sock");
    let mut helpers: Vec<Child> = (64001..=64004)
        .map(|uid| idle_connections_as(uid, &socket, 256))
        .collect();
    // Within a bound: before, root was served only once the idle connections had been
    // closed for sending no request (30 s later).
    let status = call_within(&socket, &request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
    let started = call_within(
        &socket,
        &request("backup.start", json!({"name": "b1", "uid": "u1"})),
    );
    assert!(started["result"].is_object(), "{started}");
    for helper in &mut helpers {
        drop(helper.stdin.take());
        let _ = helper.wait();
    }
    let _ = agent.kill();
    let _ = agent.wait();
    let log = std::fs::read_to_string(dir.path().join("agent.log")).unwrap_or_default();
    assert!(
        !log.contains("unable to open database file"),
        "the database could not be opened:\n{log}"
    );
}

/// A child killed when dropped, however the test ends.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An agent (run as root, with `nofile` open files and `flags`) whose backups `names`
/// are Finalizing, with `held` tarballs `slow/held-N.tar.gz` whose reads wait until the
/// test releases them and one that does not, `small.tar.gz`, in its storage directory.
struct Finalizing {
    slow: HeldFiles,
    http: RawHttp,
    socket: std::path::PathBuf,
    storage: std::path::PathBuf,
    _agent: Killed,
    dir: tempfile::TempDir,
}

fn finalizing(nofile: u64, flags: &[&str], held: usize, names: &[&str]) -> Finalizing {
    let dir = tempfile::tempdir().unwrap();
    let agent = Killed(agent_with_nofile(dir.path(), nofile, nofile, flags));
    let socket = dir.path().join("run/agent.sock");
    let storage = dir.path().join("state/storage");
    std::fs::create_dir_all(storage.join("slow")).unwrap();
    opmon_tests::tarballs::write_zeros_tarball(&storage.join("small.tar.gz"), 16);
    let slow = HeldFiles::mount(&storage.join("small.tar.gz"), held, &storage.join("slow"));
    let mut http = RawHttp::connect(&socket);
    for name in names {
        http.call(&request("backup.start", json!({"name": name, "uid": name})));
        let ended = http.call(&request("backup.endInProgress", json!({"name": name})));
        assert_eq!(ended["result"]["phase"], json!("Finalizing"), "{ended}");
    }
    Finalizing {
        slow,
        http,
        socket,
        storage,
        _agent: agent,
        dir,
    }
}

/// `backup.finalize` of `name`, reading `input` beneath the storage directory.
fn finalize(name: &str, input: &str) -> String {
    request(
        "backup.finalize",
        json!({"name": name, "contents": {"input": input, "output": format!("out/{name}.tar.gz")}}),
    )
}

/// One peer cannot take every finalize (each can hold a thread and files for minutes on
/// a large tarball): a uid holding its `max_finalizes_per_uid` finalizes, stuck reading
/// a disk that does not answer, is refused one more naming the setting, while another
/// uid's finalize is run and answered; once its finalizes end, it may finalize again.
/// (Before, the agent took 64 finalizes from anyone, and one uid could take them all.)
#[test]
fn finalizes_of_one_peer_are_bounded_while_another_peers_finalize_is_answered() {
    if !opmon_tests::root_or_skip("to run clients as other uids and mount a FUSE file system") {
        return;
    }
    let Finalizing {
        mut slow,
        socket,
        _agent,
        dir: _dir,
        ..
    } = finalizing(
        1024,
        &[
            "--allowed-uids",
            "64001,64002",
            "--max-finalizes-per-uid",
            "2",
        ],
        2,
        &["a0", "a1", "a2", "b0"],
    );
    let mut first = CallerAs::start(64001, &socket);
    first.send("a0", &finalize("a0", "slow/held-0.tar.gz"));
    first.send("a1", &finalize("a1", "slow/held-1.tar.gz"));
    // Both are reading their input: admitted, and held until the disk answers.
    slow.wait_for_readers(2);

    first.send("a2", &finalize("a2", "small.tar.gz"));
    let (tag, refused) = first.answer();
    assert_eq!(tag, "a2", "{refused}");
    assert_eq!(refused["error"]["code"], json!(-32003), "{refused}");
    assert_eq!(
        refused["error"]["message"],
        json!("uid 64001 already holds 2 finalizes, the most max_finalizes_per_uid allows"),
        "{refused}"
    );

    let mut second = CallerAs::start(64002, &socket);
    second.send("b0", &finalize("b0", "small.tar.gz"));
    let (_, done) = second.answer();
    assert_eq!(
        done["result"]["owner"]["phase"],
        json!("Completed"),
        "{done}"
    );

    slow.release();
    let mut ended: Vec<(String, Value)> = vec![first.answer(), first.answer()];
    ended.sort_by(|a, b| a.0.cmp(&b.0));
    for (tag, answer) in &ended {
        assert_eq!(
            answer["result"]["owner"]["phase"],
            json!("Completed"),
            "{tag}: {answer}"
        );
    }
    first.send("a2", &finalize("a2", "small.tar.gz"));
    let (_, again) = first.answer();
    assert_eq!(
        again["result"]["owner"]["phase"],
        json!("Completed"),
        "{again}"
    );
}

/// Finalizes hold descriptors (their input, output and item-operations files), so their
/// total follows from what the agent may open: with 200 open files the agent takes 4 at
/// once, of which other uids hold at most 3 and one uid at most a quarter of those (one),
/// and root's finalize is still run. (Before, the total was 64 whatever the limit, and
/// one peer could take every finalize from the others.)
#[test]
fn finalizes_in_all_follow_the_open_file_limit_and_are_shared_among_peers() {
    if !opmon_tests::root_or_skip("to run clients as other uids and mount a FUSE file system") {
        return;
    }
    let Finalizing {
        mut slow,
        mut http,
        socket,
        _agent,
        dir: _dir,
        ..
    } = finalizing(
        200,
        &["--allowed-uids", "64001,64002,64003,64004"],
        3,
        &["a0", "a1", "a2", "a3", "a4", "r0"],
    );
    let mut peers: Vec<CallerAs> = (0..3)
        .map(|n| {
            let mut peer = CallerAs::start(64001 + n, &socket);
            let name = format!("a{n}");
            peer.send(&name, &finalize(&name, &format!("slow/held-{n}.tar.gz")));
            peer
        })
        .collect();
    slow.wait_for_readers(3);

    let refused_with = |peer: &mut CallerAs, name: &str, message: &str| {
        peer.send(name, &finalize(name, "small.tar.gz"));
        let (tag, refused) = peer.answer();
        assert_eq!(tag, name, "{refused}");
        assert_eq!(refused["error"]["code"], json!(-32003), "{refused}");
        assert_eq!(refused["error"]["message"], json!(message), "{refused}");
    };
    refused_with(
        &mut peers[0],
        "a3",
        "uid 64001 already holds 1 finalizes, a quarter of what uids other than root and the \
         agent's own may hold together (3, which the agent's open-file and task limits set); \
         try again later",
    );
    let mut fourth = CallerAs::start(64004, &socket);
    refused_with(
        &mut fourth,
        "a4",
        "other uids hold 3 finalizes, all the agent takes from uids other than its own and \
         root; try again later",
    );
    let done = http.call(&finalize("r0", "small.tar.gz"));
    assert_eq!(
        done["result"]["owner"]["phase"],
        json!("Completed"),
        "{done}"
    );
    slow.release();
    for peer in &mut peers {
        let (tag, answer) = peer.answer();
        assert_eq!(
            answer["result"]["owner"]["phase"],
            json!("Completed"),
            "{tag}: {answer}"
        );
    }
}

/// Snapshotter registrations over the API hold descriptors once polled, so their total
/// follows the open-file limit, and other uids leave the operator its share of it: with
/// 200 open files the agent takes 3, other uids 2 of them, one uid 1, and root still
/// registers one. (Before, one peer could take them all and root was refused.)
#[test]
fn snapshotter_registrations_leave_roots_share_of_the_total() {
    if !opmon_tests::root_or_skip("to run a client as another uid") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let _agent = Killed(agent_with_nofile(
        dir.path(),
        200,
        200,
        &["--allowed-uids", "64001,64002,64003"],
    ));
    let socket = dir.path().join("run/agent.sock");
    let register = |n: usize| {
        request(
            "snapshotter.register",
            json!({"name": format!("example.io/p{n}"), "apiVersion": "v2",
                   "socket": format!("/nonexistent/p{n}.sock")}),
        )
    };
    let answer = |uid: u32, n: usize| {
        let mut peer = CallerAs::start(uid, &socket);
        peer.send(&format!("p{n}"), &register(n));
        peer.answer().1
    };
    let refusal = |answer: Value| {
        assert_eq!(answer["error"]["code"], json!(-32003), "{answer}");
        answer["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    assert!(answer(64001, 0)["result"].is_object());
    assert_eq!(
        refusal(answer(64001, 1)),
        "uid 64001 already holds 1 snapshotters, a quarter of what uids other than root and \
         the agent's own may hold together (2, which the agent's open-file and task limits \
         set); try again later"
    );
    assert!(answer(64002, 2)["result"].is_object());
    assert_eq!(
        refusal(answer(64003, 3)),
        "other uids hold 2 snapshotters, all the agent takes from uids other than its own and \
         root; try again later"
    );
    let mut http = RawHttp::connect(&socket);
    let mine = http.call(&register(4));
    assert!(mine["result"].is_object(), "root's registration: {mine}");
    // The operator is told why so few are taken.
    let log = std::fs::read_to_string(dir.path().join("agent.log")).unwrap();
    assert!(
        log.contains("the agent may open only 200 files")
            && log.contains("connections=42 finalizes=4 snapshotters=3"),
        "{log}"
    );
}

/// A finalize whose caller hangs up runs to its end: the backup is completed and a
/// repeat returns the stored result. (Before, the work was done and thrown away, and
/// the backup stayed Finalizing with nothing said.)
#[test]
fn a_finalize_whose_caller_hangs_up_still_completes_its_backup() {
    if !opmon_tests::root_or_skip("to mount a FUSE file system") {
        return;
    }
    let Finalizing {
        mut slow,
        mut http,
        socket,
        storage,
        dir,
        _agent,
    } = finalizing(1024, &[], 1, &["b"]);
    let finalize = finalize("b", "slow/held-0.tar.gz");
    let pid = agent_pid(&dir.path().join("state"));
    let mut caller = CallerAs::start(0, &socket);
    caller.send("b", &finalize);
    slow.wait_for_readers(1);
    let sockets = opmon_tests::raw::open_sockets(pid);
    drop(caller);
    // The agent has seen its caller go before the disk answers.
    opmon_tests::eventually(
        "the agent closes the caller's connection",
        Duration::from_secs(60),
        || opmon_tests::raw::open_sockets(pid) < sockets,
    );
    slow.release();
    let wait = request(
        "backup.wait",
        json!({"name": "b", "until": "terminal", "timeout": "60s"}),
    );
    let done = http.call(&wait);
    assert_eq!(
        done["result"]["owner"]["phase"],
        json!("Completed"),
        "{done}"
    );
    let again = http.call(&finalize);
    assert_eq!(
        again["result"]["owner"]["phase"],
        json!("Completed"),
        "{again}"
    );
    assert!(storage.join("out/b.tar.gz").is_file());
}

/// Calls in flight are one more budget per peer: with the agent's writer held (another
/// process holds the database's write lock, so every write waits), three other uids
/// each holding as many calls as they can leave a fourth uid's call answered, and the
/// held calls complete once the lock is let go. (Before, one uid took 32 of the 48
/// places other uids share and a second the other 16: a third uid's call waited until
/// the held writes failed on the lock's timeout.)
#[test]
fn other_uids_holding_every_call_they_may_leave_a_further_uid_answered() {
    if !opmon_tests::root_or_skip("to run clients as other uids") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let _agent = Killed(agent_with_nofile(
        dir.path(),
        4096,
        4096,
        &["--allowed-uids", "64001,64002,64003,64004"],
    ));
    let socket = dir.path().join("run/agent.sock");
    let mut http = RawHttp::connect(&socket);
    http.call(&request("backup.start", json!({"name": "b0", "uid": "b0"})));
    // The writer waits up to its busy timeout (10 s) for the lock: the test lets it go
    // long before, and every held call then completes.
    let script = "import sqlite3, sys\n\
        db = sqlite3.connect(sys.argv[1], isolation_level=None)\n\
        db.execute('BEGIN IMMEDIATE')\n\
        print('locked', flush=True)\n\
        sys.stdin.read()\n\
        db.execute('ROLLBACK')\n";
    let mut lock = Command::new("/usr/bin/python3")
        .args(["-c", script])
        .arg(dir.path().join("state/agent.db"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("running python3");
    let mut line = String::new();
    BufReader::new(lock.stdout.as_mut().expect("piped"))
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "locked");
    let mut lock = Killed(lock);

    let pid = agent_pid(&dir.path().join("state"));
    let before = opmon_tests::raw::open_sockets(pid);
    let mut holders: Vec<CallerAs> = (0..3)
        .map(|n| {
            let mut peer = CallerAs::start(64001 + n, &socket);
            for call in 0..32 {
                let name = format!("u{n}-{call}");
                peer.send(&name, &start_with_id("1", &name));
            }
            peer
        })
        .collect();
    // Their calls are in: the agent holds their connections.
    opmon_tests::eventually(
        "the agent holds the 96 calls' connections",
        Duration::from_secs(60),
        || opmon_tests::raw::open_sockets(pid) >= before + 96,
    );
    let mut further = CallerAs::start(64004, &socket);
    further.send("get", &request("backup.get", json!({"name": "b0"})));
    let (_, got) = further.answer();
    assert_eq!(got["result"]["name"], json!("b0"), "{got}");

    drop(lock.0.stdin.take());
    let _ = lock.0.wait();
    for holder in &mut holders {
        for _ in 0..32 {
            let (tag, answer) = holder.answer();
            assert_eq!(answer["result"]["name"], json!(tag), "{tag}: {answer}");
        }
    }
}

/// A batch of listings whose own answers are over the uid's quota of unread bytes is
/// answered whole: what it has made and not yet sent does not hold it back. (Before,
/// it stopped at its second call with -32003 and its made answers were thrown away:
/// such a batch could never succeed.)
#[test]
fn a_batch_whose_own_answers_pass_the_unread_quota_is_answered_whole() {
    let dir = tempfile::tempdir().unwrap();
    let _agent = Killed(agent_with_nofile(
        dir.path(),
        1024,
        1024,
        &["--max-unread-bytes-per-uid", "4096"],
    ));
    let socket = dir.path().join("run/agent.sock");
    let mut http = RawHttp::connect(&socket);
    let starts: Vec<Value> = (0..40)
        .map(|n| {
            json!({"jsonrpc": "2.0", "id": n, "method": "backup.start",
                        "params": {"name": format!("backup-{n:04}"), "uid": format!("uid-{n}")}})
        })
        .collect();
    let started = http.call(&Value::from(starts).to_string());
    assert_eq!(started.as_array().map(Vec::len), Some(40), "{started}");
    let list = http.call(&request("backup.list", json!({})));
    assert!(
        list.to_string().len() > 4096,
        "one list is over the quota: {list}"
    );
    let lists: Vec<Value> = (0..10)
        .map(|n| json!({"jsonrpc": "2.0", "id": n, "method": "backup.list", "params": {}}))
        .collect();
    let answered = http.call(&Value::from(lists).to_string());
    let answers = answered.as_array().unwrap_or_else(|| panic!("{answered}"));
    assert_eq!(answers.len(), 10);
    for answer in answers {
        assert_eq!(answer["result"], list["result"], "{answer}");
    }
}

/// Refused peers' log lines are bounded, and what was not logged one by one is still
/// counted in the log: after a flood of refusals that then stops, the log says how many
/// were not logged (at the latest when the agent stops), under the agent's own target.
/// (Before, the last window's count was never written if no refusal followed, and the
/// count was logged as the server library's.)
#[test]
fn refusals_not_logged_one_by_one_are_counted_in_the_log_once_they_stop() {
    if !opmon_tests::root_or_skip("to connect as a uid that is not allowed") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut agent = agent_with_nofile(dir.path(), 1024, 1024, &[]);
    let pid = agent_pid(&dir.path().join("state"));
    let socket = dir.path().join("run/agent.sock");
    const REFUSALS: usize = 60;
    let script = "import socket, sys\n\
        for _ in range(int(sys.argv[2])):\n\
        \x20   s = socket.socket(socket.AF_UNIX)\n\
        \x20   s.connect(sys.argv[1])\n\
        \x20   s.sendall(b'POST / HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 2\\r\\n\\r\\n{}')\n\
        \x20   assert b' 403 ' in s.recv(65536)\n\
        \x20   s.close()\n";
    let flood = Command::new("setpriv")
        .args(["--reuid=64009", "--regid=64009", "--clear-groups"])
        .args(["--", "/usr/bin/python3", "-c", script])
        .arg(&socket)
        .arg(REFUSALS.to_string())
        .status()
        .expect("running python3 as another uid");
    assert!(flood.success());
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let _ = agent.wait();
    let log = std::fs::read_to_string(dir.path().join("agent.log")).unwrap();
    let own_lines = log.matches("refused a connection").count();
    let summaries: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("more than are logged one by one"))
        .collect();
    let unlogged: usize = summaries
        .iter()
        .map(|l| {
            let (_, n) = l.split_once("unlogged=").expect("unlogged=N");
            let n: String = n.chars().take_while(char::is_ascii_digit).collect();
            n.parse::<usize>().unwrap()
        })
        .sum();
    assert!(own_lines <= 40, "bounded lines: {own_lines}");
    assert_eq!(own_lines + unlogged, REFUSALS, "{log}");
    assert!(
        summaries.iter().all(|l| l.contains("opmon_agent::access")),
        "{summaries:?}"
    );
}

/// Outside4 P1: command snapshotters of some uids that hold their processes cannot make
/// another uid's command fail to fork. The agent runs as uid 64020 under a task limit of
/// 600 and one per CPU (`RLIMIT_NPROC`, as `TasksMax=` would set), with 20,000 open
/// files (which alone would let each peer register 38 snapshotters of 8 processes). Two uids register as
/// many command snapshotters as they may, each process held on a FIFO; then a third
/// uid's command, which itself starts a program, completes its operation. (Before, the
/// others' processes took the limit: "Cannot fork", exit status 2, the operation failed
/// for good.) The start log names the limit and what follows from it.
#[test]
fn command_snapshotters_holding_processes_leave_another_uids_command_its_fork() {
    use nix::sys::resource::{setrlimit, Resource};
    if !opmon_tests::root_or_skip("to run the agent and clients as other uids") {
        return;
    }
    const AGENT: u32 = 64020;
    const LONG: Duration = Duration::from_secs(120);
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)).unwrap();
    for sub in ["run", "state"] {
        std::fs::create_dir(root.join(sub)).unwrap();
        nix::unistd::chown(
            &root.join(sub),
            Some(nix::unistd::Uid::from_raw(AGENT)),
            Some(nix::unistd::Gid::from_raw(AGENT)),
        )
        .unwrap();
    }
    let hold = root.join("hold");
    nix::unistd::mkfifo(&hold, nix::sys::stat::Mode::from_bits_truncate(0o666)).unwrap();
    let started = root.join("started");
    std::fs::write(&started, "").unwrap();
    std::fs::set_permissions(&started, std::fs::Permissions::from_mode(0o666)).unwrap();
    let log = std::fs::File::create(root.join("agent.log")).unwrap();
    // The agent keeps one task per CPU for itself: the others' share is the same on any
    // machine.
    let nproc = 600 + std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let mut cmd = agent_command();
    cmd.arg("--socket")
        .arg(root.join("run/agent.sock"))
        .arg("--state-dir")
        .arg(root.join("state"))
        .args(["--socket-mode", "0666", "--poll-interval", "1s"])
        .args(["--call-deadline", "10m"])
        .args(["--allowed-uids", "64001,64002,64003"])
        .args(["--allow-api-command-snapshotters", "true"])
        .env("OPMON_CONFIG", "/dev/null")
        .env("OPMON_LOG_LEVEL", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    // SAFETY: these calls are async-signal-safe and allocate nothing.
    unsafe {
        cmd.pre_exec(move || {
            setrlimit(Resource::RLIMIT_NOFILE, 20_000, 20_000)?;
            setrlimit(Resource::RLIMIT_NPROC, nproc, nproc)?;
            nix::unistd::setgroups(&[])?;
            nix::unistd::setgid(nix::unistd::Gid::from_raw(AGENT))?;
            nix::unistd::setuid(nix::unistd::Uid::from_raw(AGENT))?;
            Ok(())
        });
    }
    let _agent = Killed(cmd.spawn().expect("starting the agent"));
    let socket = root.join("run/agent.sock");
    opmon_tests::eventually("the agent's socket", LONG, || {
        UnixStream::connect(&socket).is_ok()
    });
    let mut http = RawHttp::connect(&socket);
    let holding = [
        "/bin/sh".to_string(),
        "-c".to_string(),
        format!(
            "echo >> {}; read x < {}; exit 75",
            started.display(),
            hold.display()
        ),
    ];
    // Each registers what it may; root gives each snapshotter 8 operations to poll.
    let mut registered = 0;
    http.call(&request(
        "backup.start",
        json!({"name": "held", "uid": "u-held"}),
    ));
    for uid in [64001, 64002] {
        let mut peer = CallerAs::start(uid, &socket);
        for n in 0..40 {
            let name = format!("example.io/h{uid}-{n}");
            peer.send(
                "r",
                &request(
                    "snapshotter.register",
                    json!({"name": name, "apiVersion": "v2", "command": holding}),
                ),
            );
            let (_, answer) = peer.answer();
            if answer.get("result").is_none() {
                assert_eq!(answer["error"]["code"], json!(-32003), "{answer}");
                break;
            }
            registered += 1;
            let ops: Vec<Value> = (0..8)
                .map(|i| {
                    serde_json::to_value(operation(&name, &format!("{name}-{i}"), "d", &[]))
                        .unwrap()
                })
                .collect();
            let added = http.call(&request(
                "backup.addOperations",
                json!({"name": "held", "operations": ops}),
            ));
            assert_eq!(added["result"]["added"], json!(8), "{added}");
        }
    }
    assert!(registered >= 2, "{registered} registered");
    // Ending InProgress polls them, and that call waits on the held commands: it is
    // sent on a connection of its own and never read.
    let mut ending = UnixStream::connect(&socket).expect("connecting");
    let body = request("backup.endInProgress", json!({"name": "held"}));
    write!(
        ending,
        "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Every process the others may have is running and held, or (an agent that lets
    // them pass the limit) their forks have begun to fail.
    let want = registered * 8;
    let agent_log = root.join("agent.log");
    let fork_failed = || {
        std::fs::read_to_string(&agent_log)
            .unwrap_or_default()
            .contains("Resource temporarily unavailable")
    };
    opmon_tests::eventually(format!("{want} held commands"), LONG, || {
        std::fs::read_to_string(&started).map_or(0, |s| s.lines().count()) >= want || fork_failed()
    });
    // The third uid's command starts `cat`, a fork of its own.
    let mut victim = CallerAs::start(64003, &socket);
    victim.send(
        "v",
        &request(
            "snapshotter.register",
            json!({"name": "example.io/victim", "apiVersion": "v2",
                   "command": ["/bin/sh", "-c", "cat > /dev/null; echo '{\"completed\":true}'"]}),
        ),
    );
    let (_, answer) = victim.answer();
    assert!(answer["result"].is_object(), "{answer}");
    http.call(&request(
        "backup.start",
        json!({"name": "victim", "uid": "u-v"}),
    ));
    let op = serde_json::to_value(operation("example.io/victim", "v-1", "d", &[])).unwrap();
    http.call(&request(
        "backup.addOperations",
        json!({"name": "victim", "operations": [op]}),
    ));
    http.call(&request("backup.endInProgress", json!({"name": "victim"})));
    let phase = opmon_tests::eventually("the victim's backup past waiting", LONG, || {
        let got = http.call(&request("backup.get", json!({"name": "victim"})));
        let phase = got["result"]["phase"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        (phase != "WaitingForPluginOperations").then_some(phase)
    });
    let ops = http.call(&request("backup.operations", json!({"name": "victim"})));
    assert_eq!(phase, "Finalizing", "{ops}");
    assert_eq!(ops["result"][0]["phase"], json!("Completed"), "{ops}");
    assert!(!fork_failed(), "a fork failed");
    let log = std::fs::read_to_string(&agent_log).unwrap();
    // Few tasks are left at this limit: the operator is told so, with the totals.
    let totals = log
        .lines()
        .find(|l| l.contains("few are left for snapshotters' processes"))
        .unwrap_or_else(|| panic!("no line on the task limit: {log}"));
    assert!(
        totals.contains(&format!("descriptors=20000 tasks={nproc} "))
            && totals.contains("snapshotters=")
            && totals.contains("processes="),
        "{totals}"
    );
}

/// A process as `uid` that runs `script` (Python, given the socket and `args`) and
/// returns once it printed `open`; it holds what it opened until its stdin closes.
fn python_as(uid: u32, script: &str, socket: &Path, args: &[String]) -> Killed {
    let mut child = Command::new("setpriv")
        .arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .arg("--clear-groups")
        .args(["--", "/usr/bin/python3", "-c", script])
        .arg(socket)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("running python3 as another uid");
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().expect("piped"))
        .read_line(&mut line)
        .expect("reading the helper");
    assert_eq!(line.trim(), "open", "the helper as uid {uid} did not start");
    Killed(child)
}

/// `count` WebSocket connections as `uid`, each subscribed to backup `name`, none of
/// them ever read after the upgrade's answer.
fn unread_subscribers_as(uid: u32, socket: &Path, count: usize, name: &str) -> Killed {
    let script = "import socket, sys, json\n\
        held = []\n\
        for i in range(int(sys.argv[2])):\n\
        \x20   s = socket.socket(socket.AF_UNIX)\n\
        \x20   s.connect(sys.argv[1])\n\
        \x20   s.sendall(b'GET / HTTP/1.1\\r\\nHost: localhost\\r\\nUpgrade: websocket\\r\\nConnection: Upgrade\\r\\n'\n\
        \x20             b'Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\\r\\nSec-WebSocket-Version: 13\\r\\n\\r\\n')\n\
        \x20   head = b''\n\
        \x20   while not head.endswith(b'\\r\\n\\r\\n'):\n\
        \x20       head += s.recv(1)\n\
        \x20   assert b' 101 ' in head, head\n\
        \x20   call = json.dumps({'jsonrpc': '2.0', 'id': i, 'method': 'backup.subscribe', 'params': {'name': sys.argv[3]}}).encode()\n\
        \x20   s.sendall(bytes([0x81, 0x80 | 126]) + len(call).to_bytes(2, 'big') + bytes(4) + call)\n\
        \x20   held.append(s)\n\
        print('open', flush=True)\n\
        sys.stdin.read()\n";
    python_as(uid, script, socket, &[count.to_string(), name.to_string()])
}

/// `count` connections as `uid`, each posting a body of `bytes` bytes all but its last
/// byte, and then waiting.
fn stalled_bodies_as(uid: u32, socket: &Path, count: usize, bytes: usize) -> Killed {
    let script = "import socket, sys, threading\n\
        def post():\n\
        \x20   s = socket.socket(socket.AF_UNIX)\n\
        \x20   s.connect(sys.argv[1])\n\
        \x20   n = int(sys.argv[3])\n\
        \x20   s.sendall(b'POST / HTTP/1.1\\r\\nHost: localhost\\r\\nContent-Type: application/json\\r\\n'\n\
        \x20             + b'Content-Length: %d\\r\\n\\r\\n' % n)\n\
        \x20   try:\n\
        \x20       s.sendall(b' ' * (n - 1))\n\
        \x20   except OSError:\n\
        \x20       pass\n\
        \x20   held.append(s)\n\
        held = []\n\
        for _ in range(int(sys.argv[2])):\n\
        \x20   threading.Thread(target=post, daemon=True).start()\n\
        print('open', flush=True)\n\
        sys.stdin.read()\n";
    python_as(uid, script, socket, &[count.to_string(), bytes.to_string()])
}

/// An operation whose ID is padded, so that an update carrying many is large.
fn padded(n: usize) -> Value {
    json!(operation(
        "example.io/nobody",
        &format!("{n:05}-{}", "x".repeat(1000)),
        "data",
        &[],
    ))
}

/// Subscribers that do not read hold the agent to the bytes it may hold for peers,
/// whatever their number: three uids with 30 WebSocket subscriptions each to a backup
/// whose updates are 2 MB, and that changes ten times meanwhile, grow the agent by less
/// than 64 MiB with a total of 16 MiB; root is answered and a reading subscriber gets
/// the final state. (Before, every subscription made and queued its own update at once
/// and the change channel kept its last renderings: 90 × 2 MB and more, and an
/// outside run of 100 subscriptions to a backup of 10,000 operations grew it by 470 MB.)
#[test]
fn unread_subscriptions_of_many_uids_are_held_to_the_total() {
    if !opmon_tests::root_or_skip("to run subscribers as other uids") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let agent = Killed(agent_with_nofile(
        dir.path(),
        4096,
        4096,
        &[
            "--allowed-uids",
            "64011,64012,64013",
            "--max-unread-bytes-per-uid",
            "4194304",
            "--max-held-bytes",
            "16777216",
        ],
    ));
    let pid = agent.0.id();
    let socket = dir.path().join("run/agent.sock");
    let mut http = RawHttp::connect(&socket);
    http.call(&request("backup.start", json!({"name": "big", "uid": "u"})));
    let ops: Vec<Value> = (0..2000).map(padded).collect();
    let added = http.call(&request(
        "backup.addOperations",
        json!({"name": "big", "operations": ops}),
    ));
    assert_eq!(added["result"]["added"], 2000, "{added}");
    let baseline = opmon_tests::raw::status_bytes(pid, "VmRSS:");

    let _subscribers: Vec<Killed> = (64011..=64013)
        .map(|uid| unread_subscribers_as(uid, &socket, 30, "big"))
        .collect();
    for round in 0..10 {
        let ops: Vec<Value> = (0..200).map(|n| padded(2000 + round * 200 + n)).collect();
        let added = call_within(
            &socket,
            &request(
                "backup.addOperations",
                json!({"name": "big", "operations": ops}),
            ),
        );
        assert_eq!(added["result"]["added"], 200, "{added}");
    }
    opmon_tests::raw::quiescent(pid, Duration::from_secs(120));
    let grown = opmon_tests::raw::status_bytes(pid, "VmHWM:").saturating_sub(baseline);
    println!("grown by {} MiB", grown >> 20);
    assert!(
        grown < 64 << 20,
        "90 subscriptions that read nothing grew the agent by {} MiB",
        grown >> 20
    );
    let status = call_within(&socket, &request("agent.status", json!({})));
    assert_eq!(status["result"]["unfinishedOperations"], 4000, "{status}");

    // A subscriber that reads gets the state as it is now.
    let mut ws = websocket(&socket);
    ws_send(&mut ws, request("backup.subscribe", json!({"name": "big"}))).unwrap();
    ws.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    loop {
        let message: Value = serde_json::from_slice(&ws_recv(&mut ws).1).unwrap();
        if message.get("id").is_none() {
            let update = &message["params"]["result"];
            assert_eq!(update["operations"].as_array().map(Vec::len), Some(4000));
            break;
        }
    }
}

/// Request bodies that do not come are held to the total over all uids: six uids with
/// five connections each, stalled one byte short of a 4 MiB body, grow the agent by
/// less than 56 MiB with a total of 32 MiB (before, each uid held its 64 MiB quota
/// whatever the number of uids: 120 MiB here, 1 GB with 16 uids and 16 MiB bodies),
/// and root's large call is answered meanwhile.
#[test]
fn stalled_request_bodies_of_many_uids_are_held_to_the_total() {
    if !opmon_tests::root_or_skip("to post bodies as other uids") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let agent = Killed(agent_with_nofile(
        dir.path(),
        4096,
        4096,
        &[
            "--allowed-uids",
            "64021,64022,64023,64024,64025,64026",
            "--max-held-bytes",
            "33554432",
        ],
    ));
    let pid = agent.0.id();
    let socket = dir.path().join("run/agent.sock");
    call_within(
        &socket,
        &request("backup.start", json!({"name": "b", "uid": "u"})),
    );
    let baseline = opmon_tests::raw::status_bytes(pid, "VmRSS:");
    let _posters: Vec<Killed> = (64021..=64026)
        .map(|uid| stalled_bodies_as(uid, &socket, 5, 4 << 20))
        .collect();
    opmon_tests::raw::quiescent(pid, Duration::from_secs(120));
    let grown = opmon_tests::raw::status_bytes(pid, "VmHWM:").saturating_sub(baseline);
    println!("grown by {} MiB", grown >> 20);
    assert!(
        grown < 56 << 20,
        "30 stalled bodies of 4 MiB grew the agent by {} MiB",
        grown >> 20
    );
    let ops: Vec<Value> = (0..2000).map(padded).collect();
    let added = call_within(
        &socket,
        &request(
            "backup.addOperations",
            json!({"name": "b", "operations": ops}),
        ),
    );
    assert_eq!(added["result"]["added"], 2000, "{added}");
}
