//! End-to-end floods against the agent's global bounds (docs/trust.md): allowed peers
//! are trusted with the agent's availability, and under any flood the agent stays
//! within its memory and descriptors, root connects and reads status, nothing
//! acknowledged is lost, and a connection it closes is told why. Each test is an attack
//! seen from outside, asserted by what users see.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use opmon_tests::held::{CallerAs, HeldFiles};
use opmon_tests::raw::{
    agent_pid, frame, read_head, request, websocket, ws_answer, ws_recv, ws_send,
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

/// POSTs `body` on a new connection to `socket` and reads the JSON answer, failing if it
/// takes more than 10 s.
fn call_within(socket: &Path, body: &str) -> Value {
    call_within_secs(10, socket, body)
}

/// POSTs `body` on a new connection to `socket` and reads the JSON answer, failing if it
/// takes more than `secs` seconds.
fn call_within_secs(secs: u64, socket: &Path, body: &str) -> Value {
    let mut s = UnixStream::connect(socket).expect("connecting");
    s.set_read_timeout(Some(Duration::from_secs(secs))).unwrap();
    write!(
        s,
        "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer)
        .unwrap_or_else(|e| panic!("no answer to {body:.200} within {secs} s: {e}"));
    let (_, json) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {answer}"))
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
/// whose updates are 2 to 4 MB, and that changes ten times meanwhile, grow the agent by
/// less than 128 MiB with a total of 16 MiB (what is held, and the few updates being
/// made at once); root is answered and a reading subscriber gets
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

    let subscribers: Vec<Killed> = (64011..=64013)
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
        grown < 128 << 20,
        "90 subscriptions that read nothing grew the agent by {} MiB",
        grown >> 20
    );
    let status = call_within(&socket, &request("agent.status", json!({})));
    assert_eq!(status["result"]["unfinishedOperations"], 4000, "{status}");

    // Once they are gone, a subscriber that reads gets the state as it is now: nothing
    // acknowledged was lost.
    drop(subscribers);
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
/// whatever the number of uids: 120 MiB here, 1 GB with 16 uids and 16 MiB bodies);
/// root's status is answered meanwhile, and its large call once the stalled bodies'
/// deadline has passed.
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
    let status = call_within(&socket, &request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
    let ops: Vec<Value> = (0..2000).map(padded).collect();
    let added = call_within_secs(
        60,
        &socket,
        &request(
            "backup.addOperations",
            json!({"name": "b", "operations": ops}),
        ),
    );
    assert_eq!(added["result"]["added"], 2000, "{added}");
}

/// `count` connections as `uid` that send nothing, held until stdin closes (the helper
/// raises its own open-file limit to hold them).
fn idle_as(uid: u32, socket: &Path, count: usize) -> Killed {
    let script = "import resource, socket, sys\n\
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n\
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))\n\
        held = []\n\
        for _ in range(int(sys.argv[2])):\n\
        \x20   s = socket.socket(socket.AF_UNIX)\n\
        \x20   s.connect(sys.argv[1])\n\
        \x20   held.append(s)\n\
        print('open', flush=True)\n\
        sys.stdin.read()\n";
    python_as(uid, script, socket, &[count.to_string()])
}

/// Idle connections of allowed uids holding every connection the agent takes leave root
/// answered, the database written and the agent within its descriptors and memory; a
/// further uid is refused with 429 saying so. (Before, the totals were derived from the
/// open-file limit and a quarter kept for root; now the cap is fixed and root's
/// connections are not counted in it.)
#[test]
fn idle_connections_holding_every_slot_leave_root_answered_and_the_agent_bounded() {
    if !opmon_tests::root_or_skip("to hold connections as other uids") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // What the caps need, as the unit gives (within this process's hard limit).
    let (_, hard) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .expect("the open-file limit");
    let nofile = hard.min(65536);
    assert!(
        nofile >= 8192,
        "the hard open-file limit ({hard}) is too low for this test"
    );
    let agent = Killed(agent_with_nofile(
        dir.path(),
        nofile,
        nofile,
        &[
            "--allowed-uids",
            "64001,64002,64003,64004,64005",
            "--max-connections-per-uid",
            "1024",
        ],
    ));
    let pid = agent.0.id();
    let socket = dir.path().join("run/agent.sock");
    call_within(&socket, &request("agent.status", json!({})));
    let descriptors = || {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count()
    };
    let before = descriptors();
    let _flood: Vec<Killed> = (64001..=64004)
        .map(|uid| idle_as(uid, &socket, 1024))
        .collect();
    opmon_tests::raw::quiescent(pid, Duration::from_secs(120));
    // Every slot is held: a fifth uid is refused, saying which bound.
    let script = "import socket, sys\n\
        s = socket.socket(socket.AF_UNIX)\n\
        s.connect(sys.argv[1])\n\
        s.sendall(b'POST / HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 2\\r\\n\\r\\n{}')\n\
        sys.stdout.write(s.makefile('rb').read().decode())\n";
    let out = Command::new("setpriv")
        .args(["--reuid=64005", "--regid=64005", "--clear-groups"])
        .args(["--", "/usr/bin/python3", "-c", script])
        .arg(&socket)
        .output()
        .expect("running python3 as uid 64005");
    let answer = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
    assert!(
        answer.contains("4096 of the 4096 connections the agent holds at once for all its peers"),
        "{answer}"
    );
    // Root is answered and the database written while the flood holds every slot.
    let status = call_within(&socket, &request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
    let started = call_within(
        &socket,
        &request("backup.start", json!({"name": "b1", "uid": "u1"})),
    );
    assert!(started["result"].is_object(), "{started}");
    // About one descriptor per connection: `before` may count one or two the agent
    // closed since (the first call's connection, a database reader).
    let held = descriptors() - before;
    assert!(
        (4096 - 16..4096 + 64).contains(&held),
        "4,096 idle connections hold {held} more descriptors"
    );
    let rss = opmon_tests::raw::status_bytes(pid, "VmHWM:");
    assert!(
        rss < 256 << 20,
        "the agent's peak RSS reached {} MiB",
        rss >> 20
    );
}

/// A WebSocket the agent closes for a bound is told why: a close frame, code 1008,
/// whose reason names the bound (before, the connection just ended, as seen once under
/// load: 1 of 40 connections holding 1,024 subscriptions each closed with neither an
/// error nor a close code).
#[test]
fn a_websocket_the_agent_closes_gets_a_close_code_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &["--idle-timeout", "1s"]);
    let mut ws = websocket(&agent.socket);
    let started = ws_answer_of(
        &mut ws,
        &request("backup.start", json!({"name": "b", "uid": "u"})),
    );
    assert!(started["result"].is_object(), "{started}");
    // Sends nothing more: past the idle timeout the agent closes it, saying so.
    let (opcode, payload) = ws_recv(&mut ws);
    assert_eq!(opcode, opmon_tests::raw::CLOSE, "{payload:?}");
    assert_eq!(u16::from_be_bytes([payload[0], payload[1]]), 1008);
    assert_eq!(
        String::from_utf8_lossy(&payload[2..]),
        "the client sent nothing for 1s (idle_timeout)"
    );

    // A message begun and not finished is closed too, saying so.
    let mut ws = websocket(&agent.socket);
    let call = request("agent.status", json!({}));
    let whole = frame(true, opmon_tests::raw::TEXT, call.as_bytes(), true);
    ws.write_all(&whole[..whole.len() / 2]).unwrap();
    let (opcode, payload) = ws_recv(&mut ws);
    assert_eq!(opcode, opmon_tests::raw::CLOSE, "{payload:?}");
    assert_eq!(u16::from_be_bytes([payload[0], payload[1]]), 1008);
    let reason = String::from_utf8_lossy(&payload[2..]).into_owned();
    assert!(
        reason == "the client sent nothing for 1s (idle_timeout)"
            || reason.starts_with("the rest of the client's message did not come"),
        "{reason}"
    );
}

/// Sends `call` on `ws` and returns its answer.
fn ws_answer_of(ws: &mut UnixStream, call: &str) -> Value {
    ws_send(ws, call).unwrap();
    ws_answer(ws)
}

/// Subscriptions past the agent's cap are refused with an error saying so, and no
/// connection ends without an answer to each of its calls: 40 connections of 1,024
/// subscriptions each (more than the 16,384 the agent holds) get a subscription id or
/// -32003 for every call, and stay open; root is answered meanwhile.
#[test]
fn subscriptions_past_the_cap_are_refused_and_no_connection_closes_silently() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let pid = agent.pid();
    let mut http = RawHttp::connect(&agent.socket);
    http.call(&request("backup.start", json!({"name": "b", "uid": "u"})));
    let subscribers: Vec<_> = (0..40)
        .map(|_| {
            let socket = agent.socket.clone();
            std::thread::spawn(move || {
                let mut ws = websocket(&socket);
                ws.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
                let calls: Vec<u8> = (0..1024)
                    .flat_map(|id| {
                        let call = format!(
                            r#"{{"jsonrpc":"2.0","id":{id},"method":"backup.subscribe","params":{{"name":"b"}}}}"#
                        );
                        frame(true, opmon_tests::raw::TEXT, call.as_bytes(), true)
                    })
                    .collect();
                let mut writer = ws.try_clone().unwrap();
                let sender = std::thread::spawn(move || writer.write_all(&calls));
                let (mut subscribed, mut refused) = (0, 0);
                while subscribed + refused < 1024 {
                    let (opcode, payload) = ws_recv(&mut ws);
                    assert_ne!(
                        opcode,
                        opmon_tests::raw::CLOSE,
                        "closed after {subscribed} subscriptions and {refused} refusals: {}",
                        String::from_utf8_lossy(&payload)
                    );
                    let message: Value = serde_json::from_slice(&payload).unwrap();
                    if message.get("id").is_none() {
                        continue;
                    }
                    if message.get("result").is_some() {
                        subscribed += 1;
                    } else {
                        assert_eq!(message["error"]["code"], -32003, "{message}");
                        refused += 1;
                    }
                }
                sender.join().unwrap().unwrap();
                (subscribed, refused, ws)
            })
        })
        .collect();
    let results: Vec<(usize, usize, UnixStream)> =
        subscribers.into_iter().map(|t| t.join().unwrap()).collect();
    let subscribed: usize = results.iter().map(|r| r.0).sum();
    let refused: usize = results.iter().map(|r| r.1).sum();
    assert_eq!(subscribed, opmon_agent::caps::SUBSCRIPTIONS);
    assert_eq!(refused, 40 * 1024 - opmon_agent::caps::SUBSCRIPTIONS);
    let status = http.call(&request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
    let rss = opmon_tests::raw::status_bytes(pid, "VmHWM:");
    assert!(
        rss < 512 << 20,
        "the agent's peak RSS reached {} MiB",
        rss >> 20
    );
}
