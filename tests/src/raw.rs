//! Raw bytes on the agent's socket: what a misbehaving or hostile client sends (request
//! heads, bodies that trickle, WebSocket frames built by hand), and what the tests read
//! back about the agent from `/proc` (its memory and its sockets).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

/// A WebSocket upgrade request, as a client sends it (the key is RFC 6455's example).
pub const WEBSOCKET_UPGRADE: &str = "GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n";

/// WebSocket opcodes (RFC 6455, 5.2).
pub const CONTINUATION: u8 = 0;
pub const TEXT: u8 = 1;
pub const CLOSE: u8 = 8;
pub const PING: u8 = 9;
pub const PONG: u8 = 10;

/// A JSON-RPC request with id 1.
pub fn request(method: &str, params: Value) -> String {
    json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string()
}

/// The agent's pid, from the lock file it holds next to its database.
pub fn agent_pid(state_dir: &Path) -> u32 {
    let lock = state_dir.join("agent.db.lock");
    let text = std::fs::read_to_string(&lock)
        .unwrap_or_else(|e| panic!("reading {}: {e}", lock.display()));
    text.trim()
        .parse()
        .unwrap_or_else(|e| panic!("{} holds {text:?}: {e}", lock.display()))
}

/// A field of `/proc/<pid>/status`, in bytes (the `kB` values): `VmRSS:` is the
/// resident set now, `VmHWM:` its peak so far.
pub fn status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("reading status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/<pid>/status"));
    kib * 1024
}

/// How many sockets `pid` has open: its listener and its connections. (Other
/// descriptors come and go with its pool of database connections.)
pub fn open_sockets(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("reading /proc/<pid>/fd")
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path())
                .is_ok_and(|target| target.to_string_lossy().starts_with("socket:"))
        })
        .count()
}

/// A `POST /` head declaring a JSON body of `length` bytes.
pub fn post_head(length: usize) -> String {
    format!(
        "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {length}\r\n\r\n"
    )
}

/// A new connection to `socket` on which `bytes` were written (a 60 s read timeout, so
/// a test that waits for an answer that never comes fails rather than hangs).
pub fn send(socket: &Path, bytes: &[u8]) -> UnixStream {
    let mut stream = UnixStream::connect(socket).expect("connecting");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("read timeout");
    stream.write_all(bytes).expect("writing");
    stream
}

/// Bytes written on `stream` that the agent has not read yet: on a Unix socket,
/// TIOCOUTQ counts what still sits in the peer's receive queue.
pub fn unread_by_agent(stream: &UnixStream) -> usize {
    use std::os::fd::AsRawFd;
    let mut queued: libc::c_int = 0;
    // SAFETY: TIOCOUTQ writes one c_int through the pointer, which outlives the call.
    let r = unsafe { libc::ioctl(stream.as_raw_fd(), libc::TIOCOUTQ, &mut queued) };
    assert_eq!(r, 0, "TIOCOUTQ: {}", std::io::Error::last_os_error());
    usize::try_from(queued).unwrap_or(0)
}

/// Reads until the end of an HTTP response head.
pub fn read_head(stream: &mut UnixStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            other => panic!(
                "reading a response head: {other:?} after {:?}",
                String::from_utf8_lossy(&head)
            ),
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// Everything the agent sends on `stream` until it closes it (or the read timeout
/// passes, which fails the test).
pub fn read_to_close(stream: &mut UnixStream) -> String {
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .unwrap_or_else(|e| panic!("{e} before the agent closed, after {answer:?}"));
    String::from_utf8_lossy(&answer).into_owned()
}

/// The status code of an HTTP response.
pub fn status_of(response: &str) -> u16 {
    response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {response:?}"))
}

/// The JSON body of a whole HTTP response (head and body as read to the close).
pub fn json_body(response: &str) -> Value {
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body)
        .unwrap_or_else(|| panic!("no body in {response:?}"));
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {response:?}"))
}

/// A connection to `socket` upgraded to WebSocket (a 60 s read timeout, as [`send`]).
pub fn websocket(socket: &Path) -> UnixStream {
    let mut ws = UnixStream::connect(socket).expect("connecting");
    ws.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("read timeout");
    ws.write_all(WEBSOCKET_UPGRADE.as_bytes())
        .expect("writing the upgrade");
    let head = read_head(&mut ws);
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    ws
}

/// A client's WebSocket frame: `fin`, `opcode` and `payload`, masked with key 0 (the
/// payload as is) unless `masked` is false.
pub fn frame(fin: bool, opcode: u8, payload: &[u8], masked: bool) -> Vec<u8> {
    let n = payload.len();
    let mask = if masked { 0x80 } else { 0 };
    let mut frame = vec![if fin { 0x80 } else { 0 } | opcode];
    if n < 126 {
        frame.push(mask | n as u8);
    } else if n < 65536 {
        frame.push(mask | 126);
        frame.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        frame.push(mask | 127);
        frame.extend_from_slice(&(n as u64).to_be_bytes());
    }
    if masked {
        frame.extend_from_slice(&[0, 0, 0, 0]);
    }
    frame.extend_from_slice(payload);
    frame
}

/// Writes `payload` as one masked WebSocket text frame.
pub fn ws_send(stream: &mut UnixStream, payload: impl AsRef<[u8]>) -> std::io::Result<()> {
    stream.write_all(&frame(true, TEXT, payload.as_ref(), true))
}

/// Sends `messages` on `ws` from a thread of its own, until one cannot be sent: the
/// agent may stop reading the connection while its answers wait to be read.
pub fn send_from_thread(
    ws: &UnixStream,
    messages: impl Iterator<Item = String> + Send + 'static,
) -> std::thread::JoinHandle<()> {
    let mut writer = ws.try_clone().expect("cloning the connection");
    std::thread::spawn(move || {
        for message in messages {
            if ws_send(&mut writer, message).is_err() {
                return;
            }
        }
    })
}

/// Reads one WebSocket frame: its opcode and payload.
pub fn ws_recv(stream: &mut UnixStream) -> (u8, Vec<u8>) {
    try_ws_recv(stream).expect("a whole frame")
}

/// [`ws_recv`], saying how the stream ended if it ended before a whole frame.
pub fn try_ws_recv(stream: &mut UnixStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 2];
    stream.read_exact(&mut head)?;
    let n = match head[1] & 0x7f {
        126 => {
            let mut b = [0u8; 2];
            stream.read_exact(&mut b)?;
            u16::from_be_bytes(b) as usize
        }
        127 => {
            let mut b = [0u8; 8];
            stream.read_exact(&mut b)?;
            u64::from_be_bytes(b) as usize
        }
        n => n as usize,
    };
    let mut payload = vec![0; n];
    stream.read_exact(&mut payload)?;
    Ok((head[0] & 0x0f, payload))
}

/// The next answer on `ws` (a message with an `id`), past control frames and the
/// notifications before it.
pub fn ws_answer(ws: &mut UnixStream) -> Value {
    loop {
        let (opcode, payload) = ws_recv(ws);
        if opcode == PING || opcode == PONG {
            continue;
        }
        let message: Value = serde_json::from_slice(&payload)
            .unwrap_or_else(|e| panic!("{e}: opcode {opcode}, {payload:?}"));
        if message.get("id").is_some() {
            return message;
        }
    }
}

/// Reads frames until the agent closes `ws`: the close frame's status code, if it sent
/// one. Fails the test if a frame other than a control frame comes first.
pub fn ws_closed(ws: &mut UnixStream) -> Option<u16> {
    let mut code = None;
    loop {
        let mut head = [0u8; 2];
        match ws.read_exact(&mut head) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return code,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return code,
            Err(e) => panic!("{e} before the agent closed the WebSocket"),
        }
        let n = match head[1] & 0x7f {
            126 => {
                let mut b = [0u8; 2];
                ws.read_exact(&mut b).expect("frame length");
                u16::from_be_bytes(b) as usize
            }
            127 => {
                let mut b = [0u8; 8];
                ws.read_exact(&mut b).expect("frame length");
                u64::from_be_bytes(b) as usize
            }
            n => n as usize,
        };
        let mut payload = vec![0; n];
        ws.read_exact(&mut payload).expect("frame payload");
        match head[0] & 0x0f {
            CLOSE => {
                code = payload.get(..2).map(|b| u16::from_be_bytes([b[0], b[1]]));
            }
            PING | PONG => {}
            other => panic!(
                "a message (opcode {other}) where the connection was to close: {}",
                String::from_utf8_lossy(&payload)
            ),
        }
    }
}

/// The CPU time `pid` has used, in clock ticks.
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("reading stat");
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after the name.
    let field = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    field(11) + field(12)
}

/// Waits until `pid` has done (almost) no work for half a second: whatever it was busy
/// with is finished or blocked. Fails the test if that does not come within `within`.
pub fn quiescent(pid: u32, within: Duration) {
    let deadline = std::time::Instant::now() + within;
    let mut last = cpu_ticks(pid);
    let mut calm = 0;
    while calm < 5 {
        assert!(
            std::time::Instant::now() < deadline,
            "the agent never came to rest"
        );
        std::thread::sleep(Duration::from_millis(100));
        let now = cpu_ticks(pid);
        calm = if now - last <= 1 { calm + 1 } else { 0 };
        last = now;
    }
}

/// The `Content-Length` of a response head.
pub fn content_length(head: &str) -> Option<usize> {
    head.lines().find_map(|l| {
        l.to_ascii_lowercase()
            .strip_prefix("content-length:")
            .and_then(|v| v.trim().parse().ok())
    })
}
