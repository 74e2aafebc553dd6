//! Who gets in, as real processes under other uids and groups (`setpriv`, run as root):
//! the agent's own uid and root always; configured uids and groups (primary or
//! supplementary) besides; everyone else gets HTTP 403 naming the rule, over plain HTTP,
//! a WebSocket upgrade and the client library alike. One uid cannot take every
//! connection, and refused peers cannot tie the agent up.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use opmon_tests::{agent_command, workspace_binary};

const LONG: Duration = Duration::from_secs(60);

/// `program args…` as `uid`:`gid` with exactly `groups` as supplementary groups.
fn as_user(uid: u32, gid: u32, groups: &[u32], program: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={uid}"))
        .arg(format!("--regid={gid}"));
    if groups.is_empty() {
        cmd.arg("--clear-groups");
    } else {
        let list: Vec<String> = groups.iter().map(u32::to_string).collect();
        cmd.arg(format!("--groups={}", list.join(",")));
    }
    cmd.arg("--").arg(program).args(args);
    cmd
}

/// An agent in a directory every uid may enter, with a socket every uid may open: the
/// agent's own check is the only gate.
struct Open {
    uid: u32,
    dir: tempfile::TempDir,
    child: std::process::Child,
    socket: std::path::PathBuf,
}

impl Open {
    /// Starts the agent as `agent_uid` (root if 0) with `args`.
    fn start(agent_uid: u32, args: &[&str]) -> Open {
        let dir = tempfile::tempdir().expect("temporary directory");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        for sub in ["run", "state"] {
            std::fs::create_dir(dir.path().join(sub)).unwrap();
            std::fs::set_permissions(dir.path().join(sub), std::fs::Permissions::from_mode(0o755))
                .unwrap();
            nix::unistd::chown(
                &dir.path().join(sub),
                Some(nix::unistd::Uid::from_raw(agent_uid)),
                Some(nix::unistd::Gid::from_raw(agent_uid)),
            )
            .unwrap();
        }
        let socket = dir.path().join("run/agent.sock");
        let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
        let mut cmd = if agent_uid == 0 {
            agent_command()
        } else {
            let mut cmd = as_user(
                agent_uid,
                agent_uid,
                &[],
                &workspace_binary("opmon-agent"),
                &[],
            );
            opmon_tests::without_opmon_env(&mut cmd);
            cmd
        };
        let child = cmd
            .arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(["--socket-mode", "0666"])
            .args(args)
            .env("OPMON_CONFIG", "/dev/null")
            .env("OPMON_LOG_LEVEL", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starting the agent");
        let mut open = Open {
            uid: agent_uid,
            dir,
            child,
            socket,
        };
        let start = Instant::now();
        while std::os::unix::net::UnixStream::connect(&open.socket).is_err() {
            if let Ok(Some(status)) = open.child.try_wait() {
                panic!("the agent exited ({status}):\n{}", open.log());
            }
            assert!(start.elapsed() < LONG, "no socket:\n{}", open.log());
            std::thread::sleep(Duration::from_millis(10));
        }
        open
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    /// `opmon status` as `uid`:`gid` with `groups`.
    fn cli_status(&self, uid: u32, gid: u32, groups: &[u32]) -> Output {
        let socket = self.socket.to_str().expect("utf-8");
        as_user(
            uid,
            gid,
            groups,
            &workspace_binary("opmon"),
            &["--socket", socket, "status"],
        )
        .env("OPMON_AGENT_UID", self.uid.to_string())
        .output()
        .expect("running opmon")
    }

    /// curl as `uid` POSTing agent.status (plus `extra` curl arguments): status line and
    /// body.
    fn curl(&self, uid: u32, extra: &[&str]) -> (String, String) {
        let socket = self.socket.to_str().expect("utf-8");
        let mut args = vec!["-sS", "-i", "--unix-socket", socket];
        args.extend_from_slice(extra);
        let out = as_user(uid, uid, &[], Path::new("/usr/bin/curl"), &args)
            .output()
            .expect("running curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or_else(|| {
            panic!(
                "no HTTP answer: {text} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
        (
            head.lines().next().unwrap_or_default().trim().to_string(),
            body.to_string(),
        )
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn succeeded(out: &Output) -> bool {
    out.status.success()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).trim().to_string()
}

const STATUS: &str = r#"{"jsonrpc":"2.0","id":1,"method":"agent.status"}"#;

#[test]
fn the_agents_own_uid_and_root_stay_allowed_when_other_uids_are_configured() {
    if !opmon_tests::root_or_skip("to run clients as other uids") {
        return;
    }
    // The agent runs as 2000 (its "own" uid, as 65532 in the container or opmon under
    // systemd) and lets 1000 in, like the sidecar's OPMON_ALLOWED_UIDS=1000.
    let agent = Open::start(2000, &["--allowed-uids", "1000"]);
    for (uid, who) in [
        (2000, "the agent's own uid"),
        (0, "root"),
        (1000, "uid 1000"),
    ] {
        let out = agent.cli_status(uid, uid, &[]);
        assert!(succeeded(&out), "{who} was refused: {}", stderr(&out));
    }
    // The CLI's wording is its own; the agent's reason must reach the user.
    let out = agent.cli_status(1001, 1001, &[]);
    assert!(!succeeded(&out));
    assert!(
        stderr(&out).contains("uid 1001 is not in allowed_uids or allowed_gids"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_refused_peer_gets_403_naming_the_rule_over_http_and_websocket() {
    if !opmon_tests::root_or_skip("to run clients as other uids") {
        return;
    }
    let agent = Open::start(0, &[]);
    let (status, body) = agent.curl(1001, &["http://localhost/", "-d", STATUS]);
    assert_eq!(status, "HTTP/1.1 403 Forbidden");
    assert_eq!(
        body,
        r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32003,"message":"uid 1001 is not in allowed_uids or allowed_gids"}}"#
    );
    // A WebSocket upgrade gets the same answer, not an upgrade.
    let (status, body) = agent.curl(
        1001,
        &[
            "http://localhost/",
            "-H",
            "Connection: Upgrade",
            "-H",
            "Upgrade: websocket",
            "-H",
            "Sec-WebSocket-Version: 13",
            "-H",
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        ],
    );
    assert_eq!(status, "HTTP/1.1 403 Forbidden");
    assert!(
        body.contains("uid 1001 is not in allowed_uids or allowed_gids"),
        "{body}"
    );
    // Metrics are behind the same gate.
    let (status, _) = agent.curl(1001, &["http://localhost/metrics"]);
    assert_eq!(status, "HTTP/1.1 403 Forbidden");
    let log = agent.log();
    assert!(
        log.contains("refused a connection")
            && log.contains("uid=1001")
            && log.contains("reason=uid 1001 is not in allowed_uids or allowed_gids"),
        "{log}"
    );
}

#[test]
fn a_supplementary_group_in_allowed_gids_lets_a_peer_in() {
    if !opmon_tests::root_or_skip("to run clients as other uids") {
        return;
    }
    let agent = Open::start(0, &["--allowed-gids", "3000"]);
    // Primary group 1001, member of 3000 as a supplementary group: the usual setup
    // (`usermod -aG opmon velero`).
    let out = agent.cli_status(1001, 1001, &[44, 3000]);
    assert!(succeeded(&out), "{}", stderr(&out));
    let out = agent.cli_status(1001, 1001, &[44, 3001]);
    assert!(!succeeded(&out));
    assert!(
        stderr(&out).contains("uid 1001 is not in allowed_uids or allowed_gids"),
        "{}",
        stderr(&out)
    );
    // The primary group still counts.
    let out = agent.cli_status(1002, 3000, &[]);
    assert!(succeeded(&out), "{}", stderr(&out));
}

/// A python3 client that, as the uid it runs under, opens `hold` connections and makes
/// one request on each (so the agent has admitted them), prints `held`, then on each
/// line of stdin opens one more connection and prints its status line and body
/// (keeping it if it was admitted), and closes one held connection when told `close`;
/// told `ws`, the one more connection asks for a WebSocket instead (kept if upgraded).
const HOLDER: &str = r#"
import socket, sys
path, hold = sys.argv[1], int(sys.argv[2])
body = b'{"jsonrpc":"2.0","id":1,"method":"agent.status"}'
post = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
upgrade = (b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
def ask(s, req=post):
    s.sendall(req)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    return head.split(b"\r\n")[0].decode(), rest.decode()
held = []
for _ in range(hold):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    status, _ = ask(s)
    assert status == "HTTP/1.1 200 OK", status
    held.append(s)
print("held", flush=True)
for line in sys.stdin:
    if line.strip() == "close":
        held.pop().close()
        print("closed", flush=True)
        continue
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    status, body = ask(s, upgrade if line.strip() == "ws" else post)
    print(status + "|" + body, flush=True)
    if status in ("HTTP/1.1 200 OK", "HTTP/1.1 101 Switching Protocols"):
        held.append(s)
    else:
        s.close()
"#;

struct Holder {
    child: std::process::Child,
    lines: BufReader<std::process::ChildStdout>,
}

impl Holder {
    fn start(socket: &Path, uid: u32, hold: usize) -> Holder {
        let mut child = as_user(
            uid,
            uid,
            &[],
            Path::new("/usr/bin/env"),
            &[
                "python3",
                "-c",
                HOLDER,
                socket.to_str().expect("utf-8"),
                &hold.to_string(),
            ],
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        lines.read_line(&mut line).expect("holder output");
        assert_eq!(
            line.trim(),
            "held",
            "the holder could not open its connections"
        );
        Holder { child, lines }
    }

    fn send(&mut self, command: &str) -> String {
        let stdin = self.child.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{command}").expect("to the holder");
        let mut line = String::new();
        self.lines.read_line(&mut line).expect("holder output");
        line.trim().to_string()
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn one_uid_cannot_take_every_connection() {
    if !opmon_tests::root_or_skip("to run clients as other uids") {
        return;
    }
    let agent = Open::start(
        0,
        &[
            "--allowed-uids",
            "1000,1001",
            "--max-connections-per-uid",
            "8",
        ],
    );
    let mut greedy = Holder::start(&agent.socket, 1000, 8);
    assert_eq!(
        greedy.send("more"),
        r#"HTTP/1.1 429 Too Many Requests|{"jsonrpc":"2.0","id":null,"error":{"code":-32003,"message":"uid 1000 already holds 8 connections, the most max_connections_per_uid allows"}}"#
    );
    // Everyone else still gets in: another allowed uid, and root (the operator).
    let out = agent.cli_status(1001, 1001, &[]);
    assert!(succeeded(&out), "{}", stderr(&out));
    let out = agent.cli_status(0, 0, &[]);
    assert!(succeeded(&out), "{}", stderr(&out));
    // A closed connection gives its slot back.
    assert_eq!(greedy.send("close"), "closed");
    let start = Instant::now();
    loop {
        let answer = greedy.send("more");
        if answer.starts_with("HTTP/1.1 200 OK|") {
            break;
        }
        // The close may not have reached the agent yet: that answer was a 429 again.
        assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
        assert!(start.elapsed() < LONG, "the slot never came back");
        assert_eq!(greedy.send("close"), "closed");
    }
}

/// A WebSocket is a connection like any other: its uid's quota counts it for as long as
/// it is open, past its upgrade.
#[test]
fn websocket_connections_count_against_their_uids_connections() {
    if !opmon_tests::root_or_skip("to run clients as other uids") {
        return;
    }
    let agent = Open::start(
        0,
        &[
            "--allowed-uids",
            "1000,1001",
            "--max-connections-per-uid",
            "8",
        ],
    );
    let mut greedy = Holder::start(&agent.socket, 1000, 0);
    for _ in 0..8 {
        let answer = greedy.send("ws");
        assert!(answer.starts_with("HTTP/1.1 101 "), "{answer}");
    }
    let refused = r#"HTTP/1.1 429 Too Many Requests|{"jsonrpc":"2.0","id":null,"error":{"code":-32003,"message":"uid 1000 already holds 8 connections, the most max_connections_per_uid allows"}}"#;
    assert_eq!(greedy.send("ws"), refused);
    assert_eq!(greedy.send("more"), refused);
    let out = agent.cli_status(1001, 1001, &[]);
    assert!(succeeded(&out), "{}", stderr(&out));
    let out = agent.cli_status(0, 0, &[]);
    assert!(succeeded(&out), "{}", stderr(&out));
}

#[test]
fn refused_peers_that_never_send_or_read_cannot_tie_up_the_agent() {
    if !opmon_tests::root_or_skip("to run clients as other uids") {
        return;
    }
    let agent = Open::start(0, &[]);
    let pid = agent.child.id();
    // Sockets only: the store opens database files lazily (a reader for a background
    // task may come at any time after the start), which says nothing of connections.
    let fds = || {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| {
                d.flatten()
                    .filter(|e| {
                        std::fs::read_link(e.path())
                            .is_ok_and(|t| t.to_string_lossy().starts_with("socket:"))
                    })
                    .count()
            })
            .unwrap_or(0)
    };
    let before = fds();
    assert!(before >= 1, "the agent has no socket open");
    // 200 refused connections (uid 1001) that send nothing and read nothing, opened by
    // one process (python3) that then reports how each ended.
    let script = r#"
import socket, sys, time
path = sys.argv[1]
conns = []
for _ in range(200):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    conns.append(s)
print("open", flush=True)
sys.stdin.readline()
ended = 0
for s in conns:
    s.settimeout(60)
    try:
        while s.recv(65536):
            pass
        ended += 1
    except ConnectionResetError:
        ended += 1
    except socket.timeout:
        pass
print(ended, flush=True)
"#;
    let mut peers = as_user(
        1001,
        1001,
        &[],
        Path::new("/usr/bin/env"),
        &[
            "python3",
            "-c",
            script,
            agent.socket.to_str().expect("utf-8"),
        ],
    )
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .spawn()
    .expect("python3");
    let mut out = BufReader::new(peers.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "open");
    // Meanwhile an allowed client is served at once.
    let status = agent.cli_status(0, 0, &[]);
    assert!(succeeded(&status), "{}", stderr(&status));
    // Every refused connection is closed by the agent (answered within its deadline,
    // or closed unanswered past the refusals it answers at once).
    writeln!(peers.stdin.as_mut().unwrap()).unwrap();
    let mut ended = String::new();
    out.read_to_string(&mut ended).unwrap();
    let _ = peers.wait();
    assert_eq!(ended.trim(), "200", "connections the agent left open");
    let start = Instant::now();
    while fds() > before + 2 {
        assert!(
            start.elapsed() < LONG,
            "the agent holds {} sockets, {before} before",
            fds()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(agent.log().contains("refused a connection"));
}

/// The agent as `uid` with no socket setting and no runtime directory in its
/// environment: it falls back to `/tmp/opmon-<uid>/agent.sock`. Its output.
fn fallback_agent(uid: u32) -> Output {
    let state = tempfile::tempdir().expect("temporary directory");
    nix::unistd::chown(
        state.path(),
        Some(nix::unistd::Uid::from_raw(uid)),
        Some(nix::unistd::Gid::from_raw(uid)),
    )
    .unwrap();
    let mut cmd = as_user(uid, uid, &[], &workspace_binary("opmon-agent"), &[]);
    opmon_tests::without_opmon_env(&mut cmd);
    cmd.env_remove("RUNTIME_DIRECTORY")
        .env_remove("XDG_RUNTIME_DIR")
        .arg("--state-dir")
        .arg(state.path())
        .env("OPMON_CONFIG", "/dev/null")
        .stdin(Stdio::null())
        .output()
        .expect("running the agent")
}

#[test]
fn the_agent_refuses_a_socket_directory_another_user_made_or_may_write() {
    if !opmon_tests::root_or_skip("to run clients as other uids") {
        return;
    }
    // uid 4712 prepares the fallback directory of uid 4711 before its agent starts,
    // as an attacker would: mode 0777, so they can rename the socket and bind theirs.
    let dir = std::path::PathBuf::from("/tmp/opmon-4711");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    nix::unistd::chown(&dir, Some(nix::unistd::Uid::from_raw(4712)), None).unwrap();
    let out = fallback_agent(4711);
    assert!(!succeeded(&out));
    assert!(
        stderr(&out).contains(
            "the socket directory /tmp/opmon-4711 belongs to uid 4712, not to the agent's uid 4711"
        ),
        "{}",
        stderr(&out)
    );
    // Its own directory, but others may write it: refused too.
    nix::unistd::chown(&dir, Some(nix::unistd::Uid::from_raw(4711)), None).unwrap();
    let out = fallback_agent(4711);
    assert!(!succeeded(&out));
    assert!(
        stderr(&out).contains("the socket directory /tmp/opmon-4711 may be written by its group or others (mode 0777)"),
        "{}",
        stderr(&out)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_cli_refuses_a_socket_served_by_another_user_unless_told_to_trust_it() {
    if !opmon_tests::root_or_skip("to run clients as other uids") {
        return;
    }
    // uid 1002 serves a socket where uid 1001 looks for its agent.
    let other = Open::start(1002, &["--allowed-uids", "1001"]);
    let socket = other.socket.to_str().expect("utf-8");
    let status = |uid: u32, trusted: Option<&str>| {
        let mut cmd = as_user(
            uid,
            uid,
            &[],
            &workspace_binary("opmon"),
            &["--socket", socket, "status"],
        );
        cmd.env_remove("OPMON_AGENT_UID");
        if let Some(uids) = trusted {
            cmd.env("OPMON_AGENT_UID", uids);
        }
        cmd.output().expect("running opmon")
    };
    // Root may open any socket: it is told what is true (it refused who serves it) and
    // which uid to trust, not that it may not open the socket.
    for uid in [1001, 0] {
        let out = status(uid, None);
        assert!(!succeeded(&out), "uid {uid} trusted uid 1002's socket");
        assert_eq!(
            stderr(&out),
            format!(
                "opmon: cannot connect to the opmon agent at {socket}: refusing the agent: the \
                 socket is served by uid 1002, which is not root, this user (uid {uid}) or a \
                 configured agent uid; another user may have put their socket in the agent's \
                 place. If uid 1002 runs the agent you mean, trust it with --agent-uid 1002 or \
                 OPMON_AGENT_UID=1002."
            )
        );
    }
    // Configured as the agent's uid, it is trusted.
    let out = status(1001, Some("3000,1002"));
    assert!(succeeded(&out), "{}", stderr(&out));
    // The agent's own uid needs nothing configured.
    let out = status(1002, None);
    assert!(succeeded(&out), "{}", stderr(&out));
}
