//! Raw bytes on Unix sockets: one keep-alive HTTP/1.1 connection to the agent (for
//! round-trip times, readiness and `GET /metrics`), and the echo server that is the
//! round-trip baseline.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Duration;

/// The `agent.status` request body.
pub const STATUS: &[u8] = br#"{"jsonrpc":"2.0","id":1,"method":"agent.status"}"#;

/// A complete HTTP/1.1 `POST /` of `body`, as one buffer (sent with one write).
pub fn post_request(body: &[u8]) -> Vec<u8> {
    let mut request = format!(
        "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    request
}

/// An HTTP answer.
pub struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
}

/// One kept-alive connection.
pub struct Conn {
    reader: BufReader<UnixStream>,
}

impl Conn {
    pub fn connect(socket: &Path) -> std::io::Result<Conn> {
        let stream = UnixStream::connect(socket)?;
        stream.set_read_timeout(Some(Duration::from_secs(60)))?;
        Ok(Conn {
            reader: BufReader::with_capacity(64 * 1024, stream),
        })
    }

    /// Sends a complete request and reads the answer (Content-Length framed).
    pub fn call(&mut self, request: &[u8]) -> Result<Answer, String> {
        self.reader
            .get_mut()
            .write_all(request)
            .map_err(|e| format!("sending: {e}"))?;
        self.read_answer()
    }

    fn read_answer(&mut self) -> Result<Answer, String> {
        let mut line = String::new();
        self.reader
            .read_line(&mut line)
            .map_err(|e| format!("reading the status line: {e}"))?;
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bad status line {line:?}"))?;
        let mut length = None;
        loop {
            line.clear();
            self.reader
                .read_line(&mut line)
                .map_err(|e| format!("reading a header: {e}"))?;
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse::<usize>().ok();
                } else if name.eq_ignore_ascii_case("transfer-encoding") {
                    return Err(format!(
                        "unexpected {header:?}: only Content-Length is read"
                    ));
                }
            }
        }
        let length = length.ok_or("the answer has no Content-Length")?;
        let mut body = vec![0; length];
        self.reader
            .read_exact(&mut body)
            .map_err(|e| format!("reading the body: {e}"))?;
        Ok(Answer { status, body })
    }

    /// Sends `request` to an echo server and reads the same number of bytes back.
    pub fn echo(&mut self, request: &[u8], back: &mut [u8]) -> std::io::Result<()> {
        self.reader.get_mut().write_all(request)?;
        self.reader.read_exact(back)
    }
}

/// `GET /metrics` on the agent's socket.
pub fn metrics(socket: &Path) -> Result<String, String> {
    let mut conn = Conn::connect(socket).map_err(|e| format!("connecting: {e}"))?;
    let answer = conn.call(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")?;
    if answer.status != 200 {
        return Err(format!("GET /metrics answered HTTP {}", answer.status));
    }
    String::from_utf8(answer.body).map_err(|e| format!("metrics are not UTF-8: {e}"))
}

/// The sum of the samples of metric `name` (all label sets) in Prometheus text.
pub fn metric_sum(page: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in page.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with(' ') || rest.starts_with('{')) {
            continue;
        }
        let value = rest.rsplit(' ').next()?.parse::<f64>().ok()?;
        *found.get_or_insert(0.0) += value;
    }
    found
}

/// Echoes every byte each connection sends, a thread per connection, until the
/// listener fails.
fn echo_loop(listener: UnixListener) {
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { break };
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match stream.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if stream.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                }
            }
        });
    }
}

/// Starts an echo server on `socket` in a thread of this process.
pub fn start_echo(socket: &Path) -> std::io::Result<()> {
    let listener = UnixListener::bind(socket)?;
    std::thread::Builder::new()
        .name("echo".into())
        .spawn(move || echo_loop(listener))?;
    Ok(())
}

/// `opmon-bench --echo-server SOCKET`: the echo server as a process of its own, as the
/// agent is. Says `ready` on stdout once it listens.
pub fn echo_server(socket: &Path) -> std::io::Result<()> {
    let listener = UnixListener::bind(socket)?;
    println!("ready");
    std::io::stdout().flush()?;
    echo_loop(listener);
    Ok(())
}

/// An echo server process on `socket`, killed when dropped.
pub struct EchoProcess(std::process::Child);

impl EchoProcess {
    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    pub fn start(socket: &Path) -> Result<EchoProcess, String> {
        let exe = std::env::current_exe().map_err(|e| format!("finding opmon-bench: {e}"))?;
        let mut child = std::process::Command::new(exe)
            .arg("--echo-server")
            .arg(socket)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting the echo server process: {e}"))?;
        let mut line = String::new();
        if let Some(out) = child.stdout.take() {
            BufReader::new(out)
                .read_line(&mut line)
                .map_err(|e| format!("reading from the echo server process: {e}"))?;
        }
        let echo = EchoProcess(child);
        if line.trim() != "ready" {
            return Err(format!("the echo server process did not start: {line:?}"));
        }
        Ok(echo)
    }
}

impl Drop for EchoProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
