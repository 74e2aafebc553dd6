//! HTTP/1.1 on the agent's Unix socket, for calls: one request at a time per
//! connection, kept alive and pooled.
//!
//! A call is written and its answer read by the calling task itself, with no background
//! task in between: a round trip costs the two socket operations and nothing else
//! (the WebSocket client this replaced handed every request to a task of its own and
//! back, which doubled `agent.status`'s round trip).
//!
//! Whether a failed request reached the agent is kept apart ([`Failure::NotSent`] vs
//! [`Failure::Lost`]), because only the caller knows whether its method may be repeated.
//! Everything read is bounded: the head by [`MAX_HEAD`], the body by the caller's limit.

use std::io;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// Largest response head (status line and headers) accepted.
pub(crate) const MAX_HEAD: usize = 64 * 1024;

/// An idle connection older than this is closed rather than reused, so a request
/// never races the agent's idle timeout closing it (which would make the request's
/// fate unknown).
const MAX_IDLE: Duration = Duration::from_secs(30);

/// Idle connections kept per client.
const MAX_POOLED: usize = 16;

/// One HTTP answer.
pub(crate) struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
}

/// Why an exchange failed.
pub(crate) enum Failure {
    /// The request did not reach the agent (no connection, or it could not be written
    /// in full): sending it again is always safe.
    NotSent(io::Error),
    /// The request was sent, and the connection broke before the whole answer came.
    Lost(io::Error),
    /// The answer broke the protocol or a limit.
    Protocol(String),
}

/// One keep-alive connection.
pub(crate) struct Conn {
    stream: UnixStream,
    /// Read buffer, reused between requests; empty between exchanges.
    buf: Vec<u8>,
    idle_since: Instant,
}

impl Conn {
    pub async fn open(path: &Path) -> io::Result<Conn> {
        Ok(Conn {
            stream: UnixStream::connect(path).await?,
            buf: Vec::with_capacity(8 * 1024),
            idle_since: Instant::now(),
        })
    }

    /// Whether an idle connection may carry another request: recently used, not closed
    /// by the agent, and with nothing unread on it.
    fn is_reusable(&self) -> bool {
        if self.idle_since.elapsed() > MAX_IDLE {
            return false;
        }
        let mut probe = [0u8; 1];
        matches!(self.stream.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    /// POSTs `body` to `/` and reads the answer, at most `max_body` bytes of it.
    /// Returns the answer and whether the connection may be reused.
    pub async fn post(&mut self, body: &[u8], max_body: usize) -> Result<(Answer, bool), Failure> {
        let mut request = Vec::with_capacity(body.len() + 128);
        request.extend_from_slice(
            format!(
                "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                body.len()
            )
            .as_bytes(),
        );
        request.extend_from_slice(body);
        self.stream
            .write_all(&request)
            .await
            .map_err(Failure::NotSent)?;
        let result = self.read_answer(max_body).await;
        self.idle_since = Instant::now();
        result
    }

    async fn fill(&mut self) -> Result<usize, Failure> {
        if self.buf.capacity() - self.buf.len() < 4096 {
            self.buf.reserve(8 * 1024);
        }
        self.stream
            .read_buf(&mut self.buf)
            .await
            .map_err(Failure::Lost)
    }

    async fn read_answer(&mut self, max_body: usize) -> Result<(Answer, bool), Failure> {
        self.buf.clear();
        let (status, head_len, framing, close) = loop {
            if self.fill().await? == 0 {
                return Err(Failure::Lost(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the agent closed the connection before answering",
                )));
            }
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut response = httparse::Response::new(&mut headers);
            match response.parse(&self.buf) {
                Ok(httparse::Status::Complete(len)) => {
                    let status = response.code.unwrap_or(0);
                    let (framing, close) = framing_of(response.headers)?;
                    break (status, len, framing, close);
                }
                Ok(httparse::Status::Partial) if self.buf.len() < MAX_HEAD => continue,
                Ok(httparse::Status::Partial) => {
                    return Err(Failure::Protocol(format!(
                        "a response head over {MAX_HEAD} bytes"
                    )))
                }
                Err(e) => return Err(Failure::Protocol(format!("a malformed response ({e})"))),
            }
        };
        let body = match framing {
            Framing::Length(len) => {
                if len > max_body {
                    return Err(Failure::Protocol(format!(
                        "a response of {len} bytes, over the limit of {max_body}"
                    )));
                }
                while self.buf.len() < head_len + len {
                    if self.fill().await? == 0 {
                        return Err(Failure::Lost(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the agent closed the connection in the middle of an answer",
                        )));
                    }
                }
                let body = self.buf[head_len..head_len + len].to_vec();
                let leftover = self.buf.len() > head_len + len;
                self.buf.clear();
                return Ok((Answer { status, body }, !close && !leftover));
            }
            Framing::Chunked => self.read_chunked(head_len, max_body).await?,
            Framing::UntilClose => {
                while self.fill().await? != 0 {
                    if self.buf.len() - head_len > max_body {
                        return Err(Failure::Protocol(format!(
                            "a response over the limit of {max_body} bytes"
                        )));
                    }
                }
                let body = self.buf[head_len..].to_vec();
                self.buf.clear();
                return Ok((Answer { status, body }, false));
            }
        };
        let reusable = !close && self.buf.is_empty();
        self.buf.clear();
        Ok((Answer { status, body }, reusable))
    }

    /// Decodes a chunked body starting at `at`; leaves in `buf` whatever follows it.
    async fn read_chunked(&mut self, mut at: usize, max_body: usize) -> Result<Vec<u8>, Failure> {
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(i) = find_crlf(&self.buf[at..]) {
                    break at + i;
                }
                if self.buf.len() - at > 1024 {
                    return Err(Failure::Protocol("a chunk size line over 1 KiB".into()));
                }
                self.need_more().await?;
            };
            let size_text = std::str::from_utf8(&self.buf[at..line_end]).unwrap_or("");
            let size_text = size_text.split(';').next().unwrap_or("").trim();
            let size = usize::from_str_radix(size_text, 16)
                .map_err(|_| Failure::Protocol(format!("a bad chunk size {size_text:?}")))?;
            at = line_end + 2;
            if size == 0 {
                // Trailers, if any, end with an empty line.
                loop {
                    let line_end = loop {
                        if let Some(i) = find_crlf(&self.buf[at..]) {
                            break at + i;
                        }
                        if self.buf.len() - at > MAX_HEAD {
                            return Err(Failure::Protocol("trailers over 64 KiB".into()));
                        }
                        self.need_more().await?;
                    };
                    let empty = line_end == at;
                    at = line_end + 2;
                    if empty {
                        self.buf.drain(..at);
                        return Ok(body);
                    }
                }
            }
            if body.len() + size > max_body {
                return Err(Failure::Protocol(format!(
                    "a response over the limit of {max_body} bytes"
                )));
            }
            while self.buf.len() < at + size + 2 {
                self.need_more().await?;
            }
            body.extend_from_slice(&self.buf[at..at + size]);
            at += size + 2;
        }
    }

    async fn need_more(&mut self) -> Result<(), Failure> {
        if self.fill().await? == 0 {
            return Err(Failure::Lost(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the agent closed the connection in the middle of an answer",
            )));
        }
        Ok(())
    }
}

fn find_crlf(bytes: &[u8]) -> Option<usize> {
    bytes.windows(2).position(|w| w == b"\r\n")
}

/// How the body of an answer is delimited.
enum Framing {
    Length(usize),
    Chunked,
    UntilClose,
}

/// The body's framing and whether the agent closes the connection after it.
fn framing_of(headers: &[httparse::Header<'_>]) -> Result<(Framing, bool), Failure> {
    let mut framing = Framing::UntilClose;
    let mut close = false;
    for h in headers {
        let value = std::str::from_utf8(h.value).unwrap_or("").trim();
        if h.name.eq_ignore_ascii_case("content-length") {
            let len = value
                .parse()
                .map_err(|_| Failure::Protocol(format!("a bad Content-Length {value:?}")))?;
            framing = Framing::Length(len);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding")
            && value.to_ascii_lowercase().contains("chunked")
        {
            framing = Framing::Chunked;
        } else if h.name.eq_ignore_ascii_case("connection") && value.eq_ignore_ascii_case("close") {
            close = true;
        }
    }
    if matches!(framing, Framing::UntilClose) {
        close = true;
    }
    Ok((framing, close))
}

/// The idle connections of one client.
#[derive(Default)]
pub(crate) struct Pool {
    idle: Mutex<Vec<Conn>>,
}

impl Pool {
    /// An idle connection that is still good, if there is one; stale ones are dropped.
    pub fn take(&self) -> Option<Conn> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(conn) = idle.pop() {
            if conn.is_reusable() {
                return Some(conn);
            }
        }
        None
    }

    pub fn put(&self, conn: Conn) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < MAX_POOLED {
            idle.push(conn);
        }
    }

    pub fn len(&self) -> usize {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}
