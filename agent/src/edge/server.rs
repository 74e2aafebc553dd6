//! Serving the agent's JSON-RPC on its Unix socket: jsonrpsee's tower service over
//! accepted Unix streams (HTTP/1.1 `POST /`, or an upgrade to WebSocket), after an
//! [`Admission`] has decided, before a byte is read, whether a connection is served.
//!
//! Invariants:
//! - Framing and its limits are jsonrpsee's ([`ServeConfig`] names which); the global
//!   caps (`caps.rs`) bound calls in flight ([`caps::CALLS`], mostly-waiting methods
//!   aside) and all bytes held for peers (`max_held_bytes`): bodies being read, answers
//!   not yet written, listings and updates being made ([`caps::LISTINGS`] at a time).
//! - A WebSocket is not read while it owes `unread_bytes_per_connection` or has
//!   `calls_per_connection` calls unfinished, so a peer that does not read holds one
//!   answer per subscription at most.
//! - Every body and WebSocket message comes whole within `request_body_timeout`; a peer
//!   that takes nothing for `write_stall_timeout` or sends nothing for `idle_timeout` is
//!   closed, a WebSocket with a close frame (1008) saying which: never a silent close
//!   of a peer that can still read.
//! - jsonrpsee's errors a client could not act on are reworded (an unknown method
//!   named, a subscription over HTTP, a wrong `Content-Type`, an invalid id).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::body::Body;
use jsonrpsee::core::BoxError;
use jsonrpsee::server::middleware::rpc::{
    Batch, BatchEntry, BatchEntryErr, Notification, RpcService, RpcServiceBuilder, RpcServiceT,
};

use opmon_client::methods::{decl_of, Decl};

use super::traffic;
use crate::log_limit::LogLimit;
use jsonrpsee::server::{
    serve_with_graceful_shutdown, stop_channel, BatchRequestConfig, BatchResponseBuilder, HttpBody,
    HttpResponse, MethodCallback, MethodResponse, Methods, ServerConfig,
};
use jsonrpsee::types::{ErrorObject, ErrorObjectOwned, Request};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tokio_util::task::TaskTracker;

use crate::caps::{self, Cap, Held};
use tower::Service;

/// Renders the page served at `GET /metrics`, given the request's `Accept` header:
/// its content type and its text.
pub type MetricsPage = Arc<
    dyn Fn(Option<String>) -> Pin<Box<dyn Future<Output = (&'static str, String)> + Send>>
        + Send
        + Sync,
>;

/// An HTTP body of at most this many bytes is not charged to its peer's request bytes
/// (a connection holds at most one).
pub const SMALL_BODY: u64 = 64 * 1024;

/// Most of a refused request body read (and dropped) past the limit after its 413, so a
/// client still sending it reads the answer instead of a broken pipe.
pub const MIN_DRAIN: u64 = 16 * 1024 * 1024;

/// JSON-RPC code of jsonrpsee's "Request is too big".
pub const REQUEST_TOO_BIG: i32 = -32007;

/// JSON-RPC code a handler answers with for a call it gave up because the server is
/// stopping: the call is not answered, as if the process had died (over HTTP its
/// connection is closed at once), so that a client repeats it once the server is back.
pub const GIVEN_UP: i32 = -32099;

/// JSON-RPC code of a batch stopped because the total of bytes held for peers is full
/// (the same code as a refused connection).
pub const OVER_TOTAL: i32 = -32003;

/// Limits of the served socket: what reaches jsonrpsee's server, and the global caps.
#[derive(Clone)]
pub struct ServeConfig {
    /// Largest HTTP request body, in bytes (jsonrpsee); larger ones get 413.
    pub max_request_body_size: u32,
    /// Largest WebSocket message, in bytes (jsonrpsee): small, as soketto sets a
    /// message's whole size aside once it has its frame header.
    pub max_message_size: u32,
    /// Largest single answer, in bytes (jsonrpsee).
    pub max_response_body_size: u32,
    /// Largest answer to a batch, in bytes: past it the batch gets one error (-32011)
    /// and its remaining calls are not run.
    pub max_batch_response_bytes: u32,
    /// Most calls in a batch (jsonrpsee's `BatchRequestConfig::Limit`).
    pub max_batch_len: u32,
    /// Requests and WebSocket connections served at once (jsonrpsee's own bound, past
    /// the admission's: root's and the agent's own connections are not in
    /// [`caps::CONNECTIONS`]).
    pub max_connections: u32,
    /// Subscriptions on one WebSocket connection (jsonrpsee).
    pub max_subscriptions_per_connection: u32,
    /// Messages waiting for a WebSocket's writer (jsonrpsee's message buffer).
    pub message_buffer: u32,
    /// A connection whose peer sends nothing for this long is closed.
    pub idle_timeout: Option<Duration>,
    /// A connection whose peer takes nothing of what is written to it for this long is
    /// closed.
    pub write_stall_timeout: Option<Duration>,
    /// An HTTP body not whole this long after its read began is answered with 408.
    pub request_body_timeout: Option<Duration>,
    /// Calls one WebSocket connection may have unfinished before it is not read.
    pub calls_per_connection: usize,
    /// Bytes held for all peers together (`max_held_bytes`): request bodies and answers
    /// not yet written, and snapshotters' answers being read.
    pub held: Cap,
    /// Answer bytes one connection may have unwritten before it waits to run more.
    pub unread_bytes_per_connection: u64,
    /// Once `shutdown` is done, how long calls in flight have to finish; the connections
    /// of those still running are then closed without their answers.
    pub stop_timeout: Duration,
    /// If set, `GET /metrics` answers with this page (Prometheus text format).
    pub metrics: Option<MetricsPage>,
    /// If set, told of every answer: its method (`batch` for a batch) and its error code
    /// (0 for a result).
    pub answered: Option<Answered>,
}

/// See [`ServeConfig::answered`].
pub type Answered = Arc<dyn Fn(&str, i32) + Send + Sync>;

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            max_request_body_size: 16 * 1024 * 1024,
            max_message_size: 1024 * 1024,
            max_response_body_size: 256 * 1024 * 1024,
            max_batch_response_bytes: 16 * 1024 * 1024,
            max_batch_len: 10_000,
            max_connections: 2 * caps::CONNECTIONS as u32,
            max_subscriptions_per_connection: 1024,
            message_buffer: 16,
            idle_timeout: None,
            write_stall_timeout: Some(Duration::from_secs(30)),
            request_body_timeout: Some(Duration::from_secs(30)),
            calls_per_connection: 16,
            held: Cap::new("bytes held for peers", 64 * 1024 * 1024),
            unread_bytes_per_connection: 1024 * 1024,
            stop_timeout: Duration::from_secs(10),
            metrics: None,
            answered: None,
        }
    }
}

pub use opmon_snapshotter::bind;

/// The `GET /metrics` answer to `request`: the page in the format its `Accept` asks for.
pub async fn metrics_response<B>(page: &MetricsPage, request: &hyper::Request<B>) -> HttpResponse {
    let accept = request
        .headers()
        .get(hyper::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let (content_type, text) = page(accept).await;
    let mut response = HttpResponse::new(HttpBody::from(text));
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    response
}

/// A JSON-RPC error object without an id, as text.
fn error_body(code: i32, message: &str) -> String {
    let message = serde_json::Value::from(message);
    format!(r#"{{"jsonrpc":"2.0","id":null,"error":{{"code":{code},"message":{message}}}}}"#)
}

/// A JSON-RPC error response without an id, as HTTP `status`.
fn rpc_error(status: hyper::StatusCode, code: i32, message: &str) -> HttpResponse {
    let mut response = HttpResponse::new(HttpBody::from(error_body(code, message)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json; charset=utf-8"),
    );
    response
}

fn too_big(max_body: u32) -> HttpResponse {
    rpc_error(
        hyper::StatusCode::PAYLOAD_TOO_LARGE,
        REQUEST_TOO_BIG,
        &format!("Request is too big: over {max_body} bytes"),
    )
}

/// `response`, after which the connection is closed.
fn closing(mut response: HttpResponse) -> HttpResponse {
    response.headers_mut().insert(
        hyper::header::CONNECTION,
        hyper::header::HeaderValue::from_static("close"),
    );
    response
}

/// At most `limit` characters of a peer's text, for an error message.
fn shown(text: &str, limit: usize) -> String {
    match text.char_indices().nth(limit) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}

/// Makes a POST's `Content-Type` what jsonrpsee takes, or says why it is refused. An
/// absent one or a form (what `curl -d` sends) is read as JSON, so the README's curl
/// line works as printed.
fn accept_content_type(headers: &mut hyper::HeaderMap) -> Result<(), String> {
    let Some(value) = headers.get(hyper::header::CONTENT_TYPE) else {
        headers.insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        return Ok(());
    };
    let text = String::from_utf8_lossy(value.as_bytes()).into_owned();
    let media = text.split(';').next().unwrap_or_default().trim();
    let json = ["application/json", "application/json-rpc"]
        .iter()
        .any(|m| media.eq_ignore_ascii_case(m));
    if json && jsonrpsee::server::http::is_json(Some(value)) {
        return Ok(());
    }
    if json || media.eq_ignore_ascii_case("application/x-www-form-urlencoded") {
        headers.insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        return Ok(());
    }
    Err(text)
}

/// The `Content-Length` of a request, if it declares one.
fn declared_length(headers: &hyper::HeaderMap) -> Option<u64> {
    headers
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
}

/// Reads and drops the rest of a refused body after the answer, so the client, still
/// writing, reads the answer rather than a reset. At most `bound` bytes of the body in
/// all (`read` of them already) are read; a longer one is cut off by closing.
fn drain<B>(mut body: B, headers: &hyper::HeaderMap, read: u64, bound: u64)
where
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
{
    let continues = headers
        .get(hyper::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if continues || declared_length(headers).is_some_and(|length| length > bound) {
        return;
    }
    tokio::spawn(async move {
        let mut left = bound.saturating_sub(read);
        while let Some(Ok(frame)) = body.frame().await {
            if let Ok(data) = frame.into_data() {
                let n = hyper::body::Buf::remaining(&data) as u64;
                if n > left {
                    return;
                }
                left -= n;
            }
        }
    });
}

/// Why a request body was not read whole.
enum Unread {
    /// It passed the limit after this many bytes; the rest is the caller's to drain.
    TooBig(hyper::body::Incoming, u64),
    Failed(hyper::Error),
    /// It had not come whole in time: this many bytes had.
    Late(usize),
}

/// Reads a request body whole, up to `max_body` bytes, within `timeout`.
async fn read_body(
    mut body: hyper::body::Incoming,
    declared: Option<u64>,
    max_body: u32,
    timeout: Option<Duration>,
) -> Result<hyper::body::Bytes, Unread> {
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    // Set aside as declared: the body is charged that much already.
    let mut collected = Vec::with_capacity(declared.unwrap_or(0) as usize);
    loop {
        let frame = match deadline {
            Some(at) => match tokio::time::timeout_at(at, body.frame()).await {
                Ok(frame) => frame,
                Err(_) => return Err(Unread::Late(collected.len())),
            },
            None => body.frame().await,
        };
        let Some(frame) = frame else { break };
        if let Ok(data) = frame.map_err(Unread::Failed)?.into_data() {
            let read = collected.len() + data.len();
            if read > max_body as usize {
                return Err(Unread::TooBig(body, read as u64));
            }
            collected.extend_from_slice(&data);
        }
    }
    Ok(hyper::body::Bytes::from(collected))
}

/// Whether a request (or any call of a batch) has an `id` that is not a string, an
/// integer or null: jsonrpsee takes it for a notification, where JSON-RPC answers it
/// -32600 with `id: null`.
fn has_invalid_id(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Probe<'a> {
        #[serde(borrow, default)]
        id: Option<&'a serde_json::value::RawValue>,
    }
    let bad = |probe: &Probe<'_>| {
        probe
            .id
            .is_some_and(|id| match serde_json::from_str(id.get()) {
                Ok(serde_json::Value::String(_) | serde_json::Value::Null) => false,
                Ok(serde_json::Value::Number(n)) => !(n.is_i64() || n.is_u64()),
                _ => true,
            })
    };
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'[') => {
            serde_json::from_slice::<Vec<Probe<'_>>>(body).is_ok_and(|calls| calls.iter().any(bad))
        }
        _ => serde_json::from_slice::<Probe<'_>>(body).is_ok_and(|call| bad(&call)),
    }
}

const INVALID_ID: &str = "Invalid request: an id must be a string, an integer or null";

/// The bytes held for peers (`max_held_bytes`, shared with snapshotters' answers), and
/// the few places where large answers are made, so what is made and not yet charged is
/// a few answers whatever the number of peers.
struct Bytes {
    held: Cap,
    makers: Cap,
}

/// One served connection as its calls and its stream see it: what it owes its peer and
/// whether it has failed. Every request's extensions carry it.
pub struct Connection {
    bytes: Arc<Bytes>,
    /// Bytes of answers not yet written whole (an answer counts whole until its last
    /// byte is written: its buffer lives that long).
    owed: AtomicU64,
    /// The answers handed over, oldest first: their sizes, what is left to write, and
    /// their charge.
    queued: Mutex<std::collections::VecDeque<(u64, u64, Held)>>,
    /// WebSocket calls read and not finished.
    running: AtomicUsize,
    websocket: AtomicBool,
    /// Something came of the bytes read last: a call began or a byte was written.
    heard: AtomicBool,
    failed: AtomicBool,
    turn: tokio::sync::Mutex<()>,
    room_changed: tokio::sync::Notify,
    reader: Mutex<Option<Waker>>,
    room: u64,
    calls: usize,
}

/// A place among the large answers being made (see `Bytes`), held until the answer's
/// bytes are charged.
pub struct Making {
    _held: Held,
}

impl Connection {
    /// A place to make a large answer (a subscription's update), once there is one;
    /// hold it until the answer is charged ([`Connection::owe`]).
    pub async fn making(&self) -> Making {
        Making {
            _held: self.bytes.makers.acquire_many(1).await,
        }
    }

    /// Charges an answer of `bytes` to the total, once it has room for it (an answer
    /// larger than the total takes all of it), before it is handed over to be written:
    /// what subscribers have not read stays within the total.
    pub async fn owe(&self, bytes: usize) {
        let charge = u32::try_from(bytes).unwrap_or(u32::MAX).max(1);
        let held = self.bytes.held.acquire_many(charge).await;
        self.queue(bytes, held);
    }

    /// Charges a call's answer of `bytes` with what the total has room for now: it was
    /// begun only while it had room ([`Connection::total_room`]), so what it holds passes
    /// it by at most the answers being made.
    fn owe_made(&self, bytes: usize) {
        let charge = u32::try_from(bytes).unwrap_or(u32::MAX).max(1);
        let held = self.bytes.held.take_up_to(charge);
        self.queue(bytes, held);
    }

    fn queue(&self, bytes: usize, held: Held) {
        let bytes = bytes as u64;
        self.lock_queued().push_back((bytes, bytes, held));
        self.owed.fetch_add(bytes, Ordering::Relaxed);
    }

    fn lock_queued(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::VecDeque<(u64, u64, Held)>> {
        self.queued.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `written` bytes went out: answers written whole are no longer charged.
    fn paid(&self, written: usize) {
        let mut written = written as u64;
        let mut whole = 0;
        let mut charges = Vec::new();
        {
            let mut queued = self.lock_queued();
            while let Some((bytes, left, _)) = queued.front_mut() {
                let n = written.min(*left);
                *left -= n;
                written -= n;
                if *left > 0 {
                    break;
                }
                whole += *bytes;
                charges.extend(queued.pop_front().map(|(_, _, held)| held));
            }
        }
        // Given back outside the lock.
        drop(charges);
        self.heard.store(true, Ordering::Relaxed);
        if whole > 0 {
            self.owed.fetch_sub(whole, Ordering::Relaxed);
            self.room_changed.notify_waiters();
            if self.websocket() {
                self.wake_reader();
            }
        }
    }

    /// The connection's turn to make an answer, once it owes less than its room and the
    /// total has room for more (or it has failed: the caller finds out). Subscriptions
    /// send holding it.
    pub async fn room(&self) -> tokio::sync::MutexGuard<'_, ()> {
        let turn = self.turn.lock().await;
        loop {
            let changed = self.room_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.owed.load(Ordering::Relaxed) < self.room || self.ended() {
                break;
            }
            changed.await;
        }
        self.total_room().await;
        turn
    }

    /// Once the total holds less than it may, or the connection has ended.
    async fn total_room(&self) {
        loop {
            let changed = self.room_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.ended() {
                return;
            }
            tokio::select! {
                _ = self.bytes.held.acquire_many(1) => return,
                _ = changed => {}
            }
        }
    }

    /// Whether the connection has failed (its peer went away or stopped reading).
    pub fn ended(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    fn fail(&self) {
        self.failed.store(true, Ordering::Relaxed);
        self.room_changed.notify_waiters();
        self.wake_reader();
    }

    fn wake_reader(&self) {
        if let Some(waker) = self
            .reader
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            waker.wake_by_ref();
        }
    }

    /// Whether it was upgraded to a WebSocket (by its first request).
    fn websocket(&self) -> bool {
        self.websocket.load(Ordering::Relaxed)
    }

    /// Whether a WebSocket connection should not be read now.
    fn full(&self) -> bool {
        self.websocket()
            && (self.running.load(Ordering::Relaxed) >= self.calls
                || self.owed.load(Ordering::Relaxed) >= self.room)
    }

    /// What the total holds besides a batch's `own` answers, if that is all it may, or
    /// if it leaves the batch's answers no room.
    fn over_total(&self, own: &Own) -> Option<u64> {
        let total = &self.bytes.held;
        let held = (total.held() as u64).saturating_sub(own.held());
        (held >= total.total() as u64 || (own.1 && held > 0)).then_some(held)
    }
}

/// A WebSocket call counted among its connection's unfinished ones while it lives.
struct Running(Option<Arc<Connection>>);

impl Running {
    fn of(conn: &Arc<Connection>) -> Running {
        conn.heard.store(true, Ordering::Relaxed);
        let conn = conn.websocket().then(|| conn.clone());
        if let Some(conn) = &conn {
            conn.running.fetch_add(1, Ordering::Relaxed);
        }
        Running(conn)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(conn) = &self.0 {
            conn.running.fetch_sub(1, Ordering::Relaxed);
            conn.wake_reader();
        }
    }
}

/// The stream a connection is served on: pays its connection's charge as bytes are
/// written, applies the stall, idle and message deadlines, and is not read while a
/// WebSocket connection is full.
struct Metered {
    inner: UnixStream,
    conn: Arc<Connection>,
    /// The admission's ticket: held as long as the stream, which outlives hyper's
    /// connection once it is upgraded to a WebSocket.
    _ticket: Box<dyn Send>,
    idle: Option<Duration>,
    stall: Option<Duration>,
    /// One timer for the idle timeout, moved on lazily from the last read (a timer per
    /// read would cost more than the read).
    idle_at: Option<Pin<Box<tokio::time::Sleep>>>,
    last_read: tokio::time::Instant,
    stall_at: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Over WebSocket, armed by bytes read that nothing came of yet (no call begun, no
    /// byte written): a whole message always makes one or the other, so bytes that make
    /// neither within `message_timeout` are a message that stopped coming.
    message_at: Option<Pin<Box<tokio::time::Sleep>>>,
    message_timeout: Option<Duration>,
    /// Where the frames written stand, so a close frame goes between two.
    frames: OutFrames,
}

/// Follows the frames the server writes (unmasked, RFC 6455 5.2) to know when one ends,
/// from the end of the 101 answer's head on.
#[derive(Default)]
struct OutFrames {
    /// Bytes of the head's closing `\r\n\r\n` seen so far (4: the head has ended).
    opened: usize,
    head: Vec<u8>,
    left: u64,
}

impl OutFrames {
    fn wrote(&mut self, mut bytes: &[u8]) {
        while self.opened < 4 {
            let Some((&b, rest)) = bytes.split_first() else {
                return;
            };
            bytes = rest;
            let next = b"\r\n\r\n"[self.opened];
            self.opened = match b {
                _ if b == next => self.opened + 1,
                b'\r' => 1,
                _ => 0,
            };
        }
        while !bytes.is_empty() {
            if self.left > 0 {
                let n = (bytes.len() as u64).min(self.left);
                self.left -= n;
                bytes = &bytes[n as usize..];
                continue;
            }
            self.head.push(bytes[0]);
            bytes = &bytes[1..];
            let [_, second, ..] = self.head[..] else {
                continue;
            };
            let extra = match second & 0x7f {
                126 => 2,
                127 => 8,
                _ => 0,
            };
            if self.head.len() < 2 + extra {
                continue;
            }
            self.left = match extra {
                0 => u64::from(second & 0x7f),
                n => self.head[2..2 + n]
                    .iter()
                    .fold(0, |l, b| l << 8 | u64::from(*b)),
            };
            self.head.clear();
        }
    }

    fn between(&self) -> bool {
        self.opened == 4 && self.head.is_empty() && self.left == 0
    }
}

/// Arms `timer` for `after` if it is not, and says whether it has run out.
fn ran_out(
    timer: &mut Option<Pin<Box<tokio::time::Sleep>>>,
    after: Option<Duration>,
    cx: &mut Context<'_>,
) -> bool {
    let Some(after) = after else { return false };
    timer
        .get_or_insert_with(|| Box::pin(tokio::time::sleep(after)))
        .as_mut()
        .poll(cx)
        .is_ready()
}

/// RFC 6455's close code for a connection closed by a bound of the server's (1008,
/// policy violation).
const CLOSE_POLICY: u16 = 1008;

impl Metered {
    /// Whether the peer has sent nothing for `idle` (arming the timer if need be).
    fn idle_ran_out(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(idle) = self.idle else { return false };
        let due = self.last_read + idle;
        let timer = self
            .idle_at
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
        while timer.as_mut().poll(cx).is_ready() {
            if tokio::time::Instant::now() >= self.last_read + idle {
                return true;
            }
            timer.as_mut().reset(self.last_read + idle);
        }
        false
    }

    fn failed(&self) -> io::Error {
        io::Error::new(io::ErrorKind::TimedOut, "the connection failed")
    }

    /// Fails the connection for `why`; a WebSocket between frames is first sent a close
    /// frame with code 1008 and `why` (a peer that takes nothing cannot be told).
    fn close(&mut self, why: &str) -> io::Error {
        if self.conn.websocket() && self.frames.between() && !self.conn.ended() {
            // A close frame's reason is at most 123 bytes (RFC 6455 5.5).
            let reason = &why.as_bytes()[..why.len().min(123)];
            let mut frame = vec![0x88, 2 + reason.len() as u8];
            frame.extend_from_slice(&CLOSE_POLICY.to_be_bytes());
            frame.extend_from_slice(reason);
            let _ = self.inner.try_write(&frame);
        }
        tracing::debug!(reason = why, "closed a connection");
        self.conn.fail();
        io::Error::new(io::ErrorKind::TimedOut, why.to_string())
    }

    fn wrote(
        &mut self,
        result: Poll<io::Result<usize>>,
        written: &[u8],
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<usize>> {
        match result {
            Poll::Ready(Ok(n)) => {
                self.stall_at = None;
                if self.conn.websocket() {
                    self.frames.wrote(&written[..n.min(written.len())]);
                }
                self.conn.paid(n);
                Poll::Ready(Ok(n))
            }
            Poll::Ready(Err(e)) => {
                self.conn.fail();
                Poll::Ready(Err(e))
            }
            Poll::Pending if ran_out(&mut self.stall_at, self.stall, cx) => {
                let stall = self.stall.unwrap_or_default().as_secs();
                Poll::Ready(Err(self.close(&format!(
                    "the client took nothing of its answers for {stall}s"
                ))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for Metered {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.conn.ended() {
            return Poll::Ready(Err(this.failed()));
        }
        // Woken when the connection has room again, or fails (though no byte comes); an
        // HTTP connection's one task reads and writes, so it finds out by itself.
        let websocket = this.conn.websocket();
        if websocket {
            let mut reader = this.conn.reader.lock().unwrap_or_else(|p| p.into_inner());
            if !reader.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *reader = Some(cx.waker().clone());
            }
        }
        if this.conn.full() && !this.conn.ended() {
            // The time it is not read is not the peer's idleness, nor its slowness.
            this.last_read = tokio::time::Instant::now();
            this.message_at = None;
            return Poll::Pending;
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.last_read = tokio::time::Instant::now();
                    let heard = this.conn.heard.swap(false, Ordering::Relaxed);
                    if websocket && (heard || this.message_at.is_none()) {
                        this.message_at = this
                            .message_timeout
                            .map(|after| Box::pin(tokio::time::sleep(after)));
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => {
                this.conn.fail();
                Poll::Ready(Err(e))
            }
            Poll::Pending => {
                if this.conn.heard.load(Ordering::Relaxed) {
                    this.message_at = None;
                }
                if this.idle_ran_out(cx) {
                    let idle = this.idle.unwrap_or_default().as_secs();
                    // Operators read this at debug level.
                    tracing::debug!("closed an idle connection");
                    return Poll::Ready(Err(this.close(&format!(
                        "the client sent nothing for {idle}s (idle_timeout)"
                    ))));
                }
                if this
                    .message_at
                    .as_mut()
                    .is_some_and(|at| at.as_mut().poll(cx).is_ready())
                {
                    let after = this.message_timeout.unwrap_or_default().as_secs();
                    return Poll::Ready(Err(this.close(&format!(
                        "the rest of the client's message did not come within {after}s"
                    ))));
                }
                Poll::Pending
            }
        }
    }
}

impl AsyncWrite for Metered {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.conn.ended() {
            return Poll::Ready(Err(this.failed()));
        }
        let result = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.wrote(result, buf, cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.conn.ended() {
            return Poll::Ready(Err(this.failed()));
        }
        let result = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        let written: Vec<u8> = match (&result, this.conn.websocket()) {
            (Poll::Ready(Ok(n)), true) => bufs
                .iter()
                .flat_map(|b| b.iter())
                .take(*n)
                .copied()
                .collect(),
            _ => Vec::new(),
        };
        this.wrote(result, &written, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The RPC middleware of every call: charges it to the agent's bounds (see the module's
/// doc), rewords jsonrpsee's errors a client cannot act on, logs the exchange
/// ([`crate::edge::traffic`]) and tells [`ServeConfig::answered`].
#[derive(Clone)]
struct Guard {
    inner: RpcService,
    rules: Arc<Rules>,
}

struct Rules {
    methods: Methods,
    /// Places among the calls in flight, waited for.
    calls: Cap,
    config: Arc<ServeConfig>,
}

impl Rules {
    /// Logs an exchange whose request was `shown`, and tells `answered` of it.
    fn answered(&self, method: &str, shown: Option<String>, response: &MethodResponse) {
        if let Some(text) = shown.filter(|_| !response.is_notification()) {
            traffic::exchange(&text, response.as_json());
        }
        if let Some(answered) = &self.config.answered {
            answered(method, response.as_error_code().unwrap_or(0));
        }
    }

    /// Runs `call` in a place among the calls in flight (none if it waits); a listing
    /// first takes a place among those being made and waits for the total's room (unless
    /// its batch has `own` answers already).
    async fn run(
        &self,
        inner: &RpcService,
        conn: &Connection,
        decl: Option<&Decl>,
        call: Request<'_>,
        own: u64,
    ) -> (MethodResponse, Option<Making>) {
        let mut making = None;
        let mut place = None;
        if !decl.is_some_and(|d| d.waits) {
            if decl.is_some_and(|d| d.grows) {
                making = Some(conn.making().await);
                // A batch's own answers do not hold it back: it stops before its next
                // call while the total is full besides them.
                if own == 0 {
                    conn.total_room().await;
                }
            }
            place = Some(self.calls.acquire_many(1).await);
        }
        let response = inner.call(call).await;
        drop(place);
        (response, making)
    }

    /// The error for calling `method` on `conn`, if it cannot be called so.
    fn refusal(&self, method: &str, conn: &Connection) -> Option<ErrorObjectOwned> {
        let code = jsonrpsee::types::error::METHOD_NOT_FOUND_CODE;
        match self.methods.method(method) {
            None => Some(ErrorObject::owned(
                code,
                format!("Method not found: {}", shown(method, 200)),
                None::<()>,
            )),
            Some(MethodCallback::Subscription(_) | MethodCallback::Unsubscription(_))
                if !conn.websocket() =>
            {
                Some(ErrorObject::owned(
                    code,
                    format!(
                        "{method} needs a WebSocket: subscriptions send notifications, which an \
                         HTTP POST cannot carry; upgrade the connection (GET / with \
                         Upgrade: websocket) and call it there"
                    ),
                    None::<()>,
                ))
            }
            _ => None,
        }
    }

    /// The error for calling `method` in a batch, if it cannot be: a subscription's
    /// notifications would go out before the batch's answer that names it.
    fn batch_refusal(&self, method: &str) -> Option<ErrorObjectOwned> {
        matches!(
            self.methods.method(method),
            Some(MethodCallback::Subscription(_))
        )
        .then(|| {
            ErrorObject::owned(
                jsonrpsee::types::error::INVALID_REQUEST_CODE,
                format!(
                    "{method} cannot be called in a batch: a subscription is answered at once, \
                     ahead of its batch; call it on its own"
                ),
                None::<()>,
            )
        })
    }

    fn over_total(&self, held: u64, what: &str) -> ErrorObjectOwned {
        ErrorObject::owned(
            OVER_TOTAL,
            format!(
                "{what}: the agent holds {held} bytes for its peers, all max_held_bytes \
                 allows; read the answers, then ask again"
            ),
            None::<()>,
        )
    }
}

/// What a batch's answers have been charged so far, and whether one found no room.
struct Own(Vec<Held>, bool);

impl Own {
    fn charge(&mut self, conn: &Connection, bytes: usize) {
        let bytes = u32::try_from(bytes).unwrap_or(u32::MAX).max(1);
        // Past the total they go uncharged: `max_batch_response_bytes` bounds them.
        match conn.bytes.held.take_many(bytes) {
            Ok(held) => self.0.push(held),
            Err(_) => self.1 = true,
        }
    }

    fn held(&self) -> u64 {
        self.0.iter().map(|h| h.units() as u64).sum()
    }
}

/// A batch's answer when it was stopped, saying why.
fn stopped_batch(code: i32, message: String) -> MethodResponse {
    MethodResponse::error(
        jsonrpsee::types::Id::Null,
        ErrorObject::owned(code, message, None::<()>),
    )
}

/// Marks a call given up at shutdown ([`GIVEN_UP`]): `route` closes its connection.
#[derive(Clone, Copy, Debug)]
struct GivenUp;

/// `response`, unless its call was given up ([`GIVEN_UP`]): then over HTTP it is marked
/// for `route` to close the connection unanswered, and over WebSocket it is never sent
/// (the connection ends with the server).
async fn unless_given_up(conn: &Connection, mut response: MethodResponse) -> MethodResponse {
    if response.as_error_code() != Some(GIVEN_UP) {
        return response;
    }
    if conn.websocket() {
        std::future::pending::<()>().await;
    }
    response.extensions_mut().insert(GivenUp);
    response
}

/// Marks the response jsonrpsee makes for a notification, which JSON-RPC does not
/// answer: over HTTP its body is left empty (jsonrpsee would send `null`).
#[derive(Clone, Copy, Debug)]
struct Unanswered;

fn marked(mut response: MethodResponse) -> MethodResponse {
    if response.is_notification() {
        response.extensions_mut().insert(Unanswered);
    }
    response
}

impl RpcServiceT for Guard {
    type MethodResponse = MethodResponse;
    type NotificationResponse = MethodResponse;
    type BatchResponse = MethodResponse;

    fn call<'a>(&self, request: Request<'a>) -> impl Future<Output = MethodResponse> + Send + 'a {
        let guard = self.clone();
        let shown = traffic::enabled()
            .then(|| serde_json::to_string(&request).ok())
            .flatten();
        async move {
            let method = request.method_name().to_string();
            let response = guard.clone().charged(request).await;
            // One given up is not answered: nothing to log or count.
            if response.extensions().get::<GivenUp>().is_none() {
                guard.rules.answered(&method, shown, &response);
            }
            response
        }
    }

    fn batch<'a>(&self, batch: Batch<'a>) -> impl Future<Output = MethodResponse> + Send + 'a {
        let guard = self.clone();
        // The calls of the batch (entries that did not parse have no request to show).
        let shown = traffic::enabled()
            .then(|| {
                let calls: Vec<&Request<'a>> = batch
                    .iter()
                    .filter_map(|entry| match entry {
                        Ok(BatchEntry::Call(request)) => Some(request),
                        _ => None,
                    })
                    .collect();
                serde_json::to_string(&calls).ok()
            })
            .flatten();
        async move {
            let response = guard.clone().charged_batch(batch).await;
            guard.rules.answered("batch", shown, &response);
            response
        }
    }

    fn notification<'a>(
        &self,
        n: Notification<'a>,
    ) -> impl Future<Output = MethodResponse> + Send + 'a {
        let inner = self.inner.clone();
        async move {
            // jsonrpsee takes a request with an invalid id for a notification; over
            // WebSocket no hook tells them apart, and the agent runs no notifications.
            if n.extensions()
                .get::<Arc<Connection>>()
                .is_some_and(|c| c.websocket())
            {
                return MethodResponse::error(
                    jsonrpsee::types::Id::Null,
                    ErrorObject::owned(
                        jsonrpsee::types::error::INVALID_REQUEST_CODE,
                        format!(
                            "{INVALID_ID}; over WebSocket a request without one is answered so \
                             too, as the agent runs no notifications"
                        ),
                        None::<()>,
                    ),
                );
            }
            marked(inner.notification(n).await)
        }
    }
}

impl Guard {
    /// Runs a call charged to its peer.
    async fn charged(self, request: Request<'_>) -> MethodResponse {
        let Guard { inner, rules } = self;
        // `route` puts it on every request.
        let Some(conn) = request.extensions().get::<Arc<Connection>>().cloned() else {
            return inner.call(request).await;
        };
        let _running = Running::of(&conn);
        if let Some(e) = rules.refusal(request.method_name(), &conn) {
            return MethodResponse::error(request.id().into_owned(), e);
        }
        let decl = decl_of(request.method_name());
        if decl.is_some_and(|d| d.waits) {
            return unless_given_up(&conn, inner.call(request).await).await;
        }
        // A WebSocket's calls are made one at a time once it owes its room: a peer
        // that reads nothing holds one answer in the making, not one per call.
        let _turn = match conn.websocket() {
            true => Some(conn.room().await),
            false => None,
        };
        let (response, making) = rules.run(&inner, &conn, decl, request, 0).await;
        let response = unless_given_up(&conn, response).await;
        conn.owe_made(response.as_json().get().len());
        drop(making);
        response
    }

    /// Runs a batch's calls one after another, stopping before the next once the
    /// connection has ended, the answer would pass `max_batch_response_bytes`, or the
    /// total is full besides this batch's own answers.
    async fn charged_batch(self, mut requests: Batch<'_>) -> MethodResponse {
        let Guard { inner, rules } = self;
        let Some(conn) = requests.extensions().get::<Arc<Connection>>().cloned() else {
            return inner.batch(requests).await;
        };
        let _running = Running::of(&conn);
        for entry in requests.iter_mut() {
            if let Ok(BatchEntry::Call(call)) = entry {
                let refusal = rules
                    .refusal(call.method_name(), &conn)
                    .or_else(|| rules.batch_refusal(call.method_name()));
                if let Some(e) = refusal {
                    *entry = Err(BatchEntryErr::new(call.id().into_owned(), e));
                }
            }
        }
        let answered = requests
            .iter()
            .filter(|entry| !matches!(entry, Ok(BatchEntry::Notification(_))))
            .count();
        let metered = requests.iter().any(|entry| {
            matches!(entry, Ok(BatchEntry::Call(call)) if !decl_of(call.method_name()).is_some_and(|d| d.waits))
        });
        let _turn = match conn.websocket() && metered {
            true => Some(conn.room().await),
            false => None,
        };
        let mut answer =
            BatchResponseBuilder::new_with_limit(rules.config.max_batch_response_bytes as usize);
        // The answers made, charged as they come while the uid has room, so batches made
        // at once see each other.
        let mut own = Own(Vec::new(), false);
        let mut charged = 0;
        let mut notified = false;
        let mut stopped = None;
        for (run, entry) in requests.into_iter().enumerate() {
            if conn.ended() {
                stopped = Some(MethodResponse::notification());
                break;
            }
            // The batch's own answers, made and not yet sent, do not count: a batch
            // whose answer is over the total is bounded by `max_batch_response_bytes`.
            if let Some(owed) = conn.over_total(&own).filter(|_| charged > 0) {
                let why = rules.over_total(
                    owed,
                    &format!("this batch stopped at call {} of its {answered}", run + 1),
                );
                stopped = Some(MethodResponse::error(jsonrpsee::types::Id::Null, why));
                break;
            }
            let response = match entry {
                Ok(BatchEntry::Call(call)) => {
                    let decl = decl_of(call.method_name());
                    let (response, making) =
                        rules.run(&inner, &conn, decl, call, charged as u64).await;
                    own.charge(&conn, response.as_json().get().len());
                    drop(making);
                    response
                }
                Ok(BatchEntry::Notification(n)) => {
                    notified = true;
                    inner.notification(n).await;
                    continue;
                }
                Err(e) => {
                    let (e, id) = e.into_parts();
                    MethodResponse::error(id, e)
                }
            };
            let length = response.as_json().get().len();
            if answer.append(response).is_err() {
                stopped = Some(stopped_batch(
                    jsonrpsee::types::error::TOO_BIG_BATCH_RESPONSE_CODE,
                    format!(
                        "the answer to this batch grew past {} bytes at call {} of its \
                         {answered}, so the rest were not run; send fewer calls in a batch",
                        rules.config.max_batch_response_bytes,
                        run + 1
                    ),
                ));
                break;
            }
            charged += length;
            tokio::task::coop::consume_budget().await;
        }
        let response = match stopped {
            Some(stopped) => stopped,
            None if answer.is_empty() && notified => MethodResponse::notification(),
            None => MethodResponse::from_batch(answer.finish()),
        };
        // What was counted becomes the answer's length (or is given back).
        drop(own);
        if !response.is_notification() {
            conn.owe_made(response.as_json().get().len());
        }
        marked(response)
    }
}

/// Answers `GET /metrics`; everything else is JSON-RPC. A POST's body is read here,
/// charged to the total from before it is read until its answer is made.
async fn route<H, W>(
    request: hyper::Request<hyper::body::Incoming>,
    mut http: H,
    mut ws: W,
    config: Arc<ServeConfig>,
    conn: Arc<Connection>,
    caller: Option<opmon_client::types::Caller>,
) -> Result<HttpResponse, BoxError>
where
    H: Service<hyper::Request<HttpBody>, Response = HttpResponse, Error = BoxError>,
    W: Service<hyper::Request<HttpBody>, Response = HttpResponse, Error = BoxError>,
{
    if let Some(page) = &config.metrics {
        if request.method() == hyper::Method::GET && request.uri().path() == "/metrics" {
            return Ok(metrics_response(page, &request).await);
        }
    }
    let upgrade = jsonrpsee::server::ws::is_upgrade_request(&request);
    let (mut parts, body) = request.into_parts();
    parts.extensions.insert(conn.clone());
    if let Some(caller) = caller {
        parts.extensions.insert(caller);
    }
    if upgrade {
        conn.websocket.store(true, Ordering::Relaxed);
        return ws
            .call(hyper::Request::from_parts(parts, HttpBody::new(body)))
            .await;
    }
    if parts.method != hyper::Method::POST {
        // jsonrpsee answers with 405 and what it wants.
        return http
            .call(hyper::Request::from_parts(parts, HttpBody::new(body)))
            .await;
    }
    let max_body = config.max_request_body_size;
    let drain_bound = u64::from(max_body) + u64::from(max_body).max(MIN_DRAIN);
    if let Err(text) = accept_content_type(&mut parts.headers) {
        drain(body, &parts.headers, 0, drain_bound);
        return Ok(rpc_error(
            hyper::StatusCode::UNSUPPORTED_MEDIA_TYPE,
            jsonrpsee::types::error::INVALID_REQUEST_CODE,
            &format!(
                "Content-Type: {} is not accepted; send application/json",
                shown(&text, 100)
            ),
        ));
    }
    let declared = declared_length(&parts.headers);
    if declared.is_some_and(|length| length > u64::from(max_body)) {
        drain(body, &parts.headers, 0, drain_bound);
        return Ok(too_big(max_body));
    }
    // Charged before it is read (the most it may be, if its length is unknown).
    let charge = declared.unwrap_or(u64::from(max_body));
    let mut held = match charge > SMALL_BODY {
        true => Some(conn.bytes.held.acquire_many(charge as u32).await),
        false => None,
    };
    let bytes = match read_body(body, declared, max_body, config.request_body_timeout).await {
        Ok(bytes) => bytes,
        Err(Unread::TooBig(body, read)) => {
            drain(body, &parts.headers, read, drain_bound);
            return Ok(too_big(max_body));
        }
        Err(Unread::Late(got)) => {
            let expected = match declared {
                Some(length) => format!("{got} of its {length} bytes came"),
                None => format!("{got} bytes came, not its last chunk"),
            };
            let timeout = config
                .request_body_timeout
                .unwrap_or_default()
                .as_secs_f64();
            return Ok(closing(rpc_error(
                hyper::StatusCode::REQUEST_TIMEOUT,
                jsonrpsee::types::error::INVALID_REQUEST_CODE,
                &format!(
                    "the request body did not arrive within {timeout}s of its head \
                     ({expected}); send the whole body at once"
                ),
            )));
        }
        Err(Unread::Failed(e)) => return Err(e.into()),
    };
    if let Some(held) = held.as_mut() {
        // What was set aside for a body of unknown length and did not come.
        held.shrink(bytes.len().max(1));
    }
    // Kept (a reference) to tell a bad id from a notification; a small body only.
    let sent = (bytes.len() as u64 <= SMALL_BODY).then(|| bytes.clone());
    let body = HttpBody::new(http_body_util::Full::new(bytes));
    let mut response = http.call(hyper::Request::from_parts(parts, body)).await?;
    drop(held);
    if response.extensions().get::<GivenUp>().is_some() {
        return Err(io::Error::other("a call given up at shutdown is not answered").into());
    }
    if response.extensions().get::<Unanswered>().is_some() {
        if sent.as_deref().is_some_and(has_invalid_id) {
            return Ok(rpc_error(
                hyper::StatusCode::BAD_REQUEST,
                jsonrpsee::types::error::INVALID_REQUEST_CODE,
                INVALID_ID,
            ));
        }
        // jsonrpsee's HTTP answer to a notification is `null`; JSON-RPC's is nothing.
        *response.body_mut() = HttpBody::empty();
        response.headers_mut().remove(hyper::header::CONTENT_TYPE);
    }
    Ok(response)
}

/// Decides, before any request is read, whether a connection may be served.
pub trait Admission: Send + Sync + 'static {
    /// Held for as long as the admitted connection is served (a slot of a limit, say).
    type Ticket: Send + 'static;
    fn admit(&self, stream: &UnixStream) -> Result<Self::Ticket, Refusal>;
}

/// Why a connection is not served: the peer gets `status` and a JSON-RPC error object
/// with `message` instead of a bare close, so it can act on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// 403 (not allowed) or 429 (over a connection limit).
    pub status: hyper::StatusCode,
    /// The JSON-RPC error code of the body.
    pub code: i32,
    pub message: String,
}

/// Serves `methods` on `listener` until `shutdown` resolves, then drains.
pub async fn serve(
    listener: UnixListener,
    methods: impl Into<Methods>,
    config: ServeConfig,
    admission: impl Admission,
    shutdown: impl Future<Output = ()>,
) {
    let methods: Methods = methods.into();
    let config = Arc::new(config);
    let rules = Arc::new(Rules {
        methods: methods.clone(),
        calls: Cap::new("calls", caps::CALLS),
        config: config.clone(),
    });
    let guarded = RpcServiceBuilder::new().layer_fn(move |inner| Guard {
        inner,
        rules: rules.clone(),
    });
    let stock = |max_request_body_size| {
        let server_config = ServerConfig::builder()
            .max_request_body_size(max_request_body_size)
            .max_response_body_size(config.max_response_body_size)
            .max_connections(config.max_connections)
            .max_subscriptions_per_connection(config.max_subscriptions_per_connection)
            .set_batch_request_config(BatchRequestConfig::Limit(config.max_batch_len))
            .set_message_buffer_capacity(config.message_buffer.max(1))
            // No pings: on a Unix socket the kernel reports a peer that went away, and
            // the stream closes one that sends nothing for `idle_timeout`.
            .disable_ws_ping()
            .build();
        jsonrpsee::server::Server::builder()
            .set_config(server_config)
            .set_rpc_middleware(guarded.clone())
            .to_service_builder()
    };
    let http_builder = stock(config.max_request_body_size);
    let ws_builder = stock(config.max_message_size.min(config.max_request_body_size));
    let bytes = Arc::new(Bytes {
        held: config.held.clone(),
        makers: Cap::new("listings being made", caps::LISTINGS),
    });
    let (stop_handle, server_handle) = stop_channel();
    let connections = TaskTracker::new();
    let refusals = Arc::new(Semaphore::new(REFUSALS_AT_ONCE));
    static ACCEPT_ERRORS: std::sync::LazyLock<LogLimit> =
        std::sync::LazyLock::new(|| LogLimit::new("failed accepts"));
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors or similar: keep serving the connections we
                    // have, and try again shortly rather than spinning.
                    ACCEPT_ERRORS.log(|| {
                        tracing::warn!(error = %e, "accepting a connection failed");
                    });
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let ticket = match admission.admit(&stream) {
            Ok(ticket) => ticket,
            Err(refusal) => {
                refuse(&refusals, stream, refusal);
                continue;
            }
        };
        // What the kernel recorded when the peer connected.
        let caller = stream
            .peer_cred()
            .ok()
            .map(|cred| opmon_client::types::Caller {
                uid: cred.uid(),
                pid: cred.pid().unwrap_or(0),
            });
        let conn = Arc::new(Connection {
            bytes: bytes.clone(),
            owed: AtomicU64::new(0),
            queued: Mutex::new(std::collections::VecDeque::new()),
            running: AtomicUsize::new(0),
            websocket: AtomicBool::new(false),
            heard: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            turn: tokio::sync::Mutex::new(()),
            room_changed: tokio::sync::Notify::new(),
            reader: Mutex::new(None),
            room: config.unread_bytes_per_connection,
            calls: config.calls_per_connection.max(1),
        });
        let stream = Metered {
            inner: stream,
            conn: conn.clone(),
            _ticket: Box::new(ticket),
            idle: config.idle_timeout,
            stall: config.write_stall_timeout,
            idle_at: None,
            last_read: tokio::time::Instant::now(),
            stall_at: None,
            message_at: None,
            message_timeout: config.request_body_timeout,
            frames: OutFrames::default(),
        };
        let http = http_builder
            .clone()
            .build(methods.clone(), stop_handle.clone());
        let ws = ws_builder
            .clone()
            .build(methods.clone(), stop_handle.clone());
        let config = config.clone();
        let service = tower::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            route(
                request,
                http.clone(),
                ws.clone(),
                config.clone(),
                conn.clone(),
                caller,
            )
        });
        let stopped = stop_handle.clone().shutdown();
        connections.spawn(async move {
            if let Err(e) = serve_with_graceful_shutdown(stream, service, stopped).await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    let _ = server_handle.stop();
    connections.close();
    if tokio::time::timeout(config.stop_timeout, connections.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            connections = connections.len(),
            "stopping: connections with calls still running after {}s are closed unanswered",
            config.stop_timeout.as_secs()
        );
    }
}

/// Refused connections answered at once; past this, more are closed unanswered, so
/// refused peers cannot make the agent hold more than this many sockets and tasks.
const REFUSALS_AT_ONCE: usize = 32;
/// A refused peer has this long to send its request and take the answer.
const REFUSAL_DEADLINE: Duration = Duration::from_secs(2);
/// Bytes of a refused peer's request body read (and dropped) before answering, so a
/// small request is consumed and the close after the answer is clean.
const REFUSAL_BODY_READ: usize = 64 * 1024;

/// Answers `stream` with `refusal` in a task of its own, within [`REFUSAL_DEADLINE`],
/// or closes it at once if [`REFUSALS_AT_ONCE`] refusals are being answered already.
fn refuse(slots: &Arc<Semaphore>, stream: UnixStream, refusal: Refusal) {
    let Ok(slot) = slots.clone().try_acquire_owned() else {
        tracing::debug!("closed a refused connection unanswered: too many refusals at once");
        return;
    };
    tokio::spawn(async move {
        let _slot = slot;
        let answered = tokio::time::timeout(REFUSAL_DEADLINE, answer_refused(stream, refusal));
        if answered.await.is_err() {
            tracing::debug!("a refused peer took too long; closed");
        }
    });
}

/// Answers one HTTP request on `stream` (a WebSocket upgrade included) with `refusal`'s
/// status and JSON-RPC error, then closes.
async fn answer_refused(stream: UnixStream, refusal: Refusal) {
    let body = hyper::body::Bytes::from(error_body(refusal.code, &refusal.message));
    let status = refusal.status;
    let service =
        hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let body = body.clone();
            async move {
                let _ = http_body_util::Limited::new(request.into_body(), REFUSAL_BODY_READ)
                    .collect()
                    .await;
                let mut response = hyper::Response::new(http_body_util::Full::new(body));
                *response.status_mut() = status;
                let headers = response.headers_mut();
                headers.insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("application/json"),
                );
                headers.insert(
                    hyper::header::CONNECTION,
                    hyper::header::HeaderValue::from_static("close"),
                );
                Ok::<_, std::convert::Infallible>(response)
            }
        });
    let io = hyper_util::rt::TokioIo::new(stream);
    let _ = hyper::server::conn::http1::Builder::new()
        .keep_alive(false)
        .max_buf_size(8192)
        .serve_connection(io, service)
        .await;
}
