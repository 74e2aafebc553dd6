//! Serving JSON-RPC on a Unix socket: the one piece the agent and every SDK snapshotter
//! share.
//!
//! jsonrpsee's own server binds TCP only, so this module runs its tower service over
//! accepted Unix streams: each connection speaks HTTP/1.1 (`POST /`) or upgrades to
//! WebSocket. Shutdown is graceful by construction: once `shutdown` resolves, no new
//! connection is accepted, in-flight requests finish, and [`serve`] returns only after
//! every connection task has ended.
//!
//! Before a byte of a connection is read, an [`Admission`] decides whether it is
//! served. A refused peer is answered, not reset: its request gets the refusal's HTTP
//! status (403, 429) and a JSON-RPC error body, within a fixed time and byte budget and
//! a bounded number of refusals answered at once, so refused peers cannot tie up the
//! server.
//!
//! What a peer can make the server hold is bounded, whether or not it reads what it is
//! sent ([`ServeConfig`] has the numbers):
//! - at most `max_calls_in_flight` calls run at once, over all connections; methods that
//!   mostly wait (listed in `unmetered_methods`) take no place. A place is held while a
//!   call runs, not while its answer waits for its reader, so a peer that reads none of
//!   its answers holds no one else's places. An HTTP request takes its place once its
//!   body has been read and gives it back once its response is made (hyper reads no
//!   further request of the connection until that response is written); a WebSocket
//!   call first waits for one of its connection's `max_calls_per_connection` slots,
//!   which it keeps until its response has been written;
//! - a batch runs its calls one after another, each as it would alone, lets other tasks
//!   run between them, stops once its connection has ended, and stops with an error
//!   once its answer would pass `max_batch_response_bytes`; over WebSocket it takes one
//!   slot, and a connection builds one batch answer at a time;
//! - each connection has an [`Outbox`]: the bytes handed to it and not yet written.
//!   Subscriptions send, and a WebSocket connection's calls already read run, only
//!   while it holds less than `max_queued_bytes`, and a WebSocket connection is not read
//!   further while it is that full or has no slot free;
//! - over all connections, the bytes waiting to be written and the batch answers in the
//!   making are counted against `max_queued_bytes_total`: while the server holds more,
//!   a connection that already has [`SMALL_BACKLOG`] waiting runs no new call and sends
//!   no notification, a batch does not start (holding nothing while it waits), and a
//!   batch already running stops with an error before its next call. Single calls of
//!   connections holding little go on as before, so the peers that read nothing are
//!   the ones held back, not the others; but a call of a method that has answered with
//!   [`SMALL_BACKLOG`] or more (or of one of `listing_methods`, from its first call)
//!   counts its largest answer (at least that) before it runs, and waits for
//!   room over all connections (holding no place), alone or in a batch, so many peers
//!   each asking for one large answer are held to the bound too; such calls run
//!   [`LARGE_MAKING_AT_ONCE`] at a time, so answers larger than the largest so far pass
//!   the bound by that many answers at most;
//! - a connection whose peer takes nothing of what waits for it for
//!   `write_stall_timeout`, or whose writes fail (the peer went away), fails, WebSocket
//!   or not: its reads fail too, so it ends even while it is not being read, which frees
//!   all of the above;
//! - an HTTP request body is read before its call takes a place, so a peer that sends
//!   its body slowly, or less of it than it declared, holds no place: a connection holds
//!   at most [`SMALL_BODY`] of a body as it comes, larger bodies (or chunked ones) are
//!   read [`LARGE_BODIES_AT_ONCE`] at a time over all connections (each keeps its read
//!   with its place, and gives both back if its call mostly waits), and a body that has
//!   not come whole `request_body_timeout` after its read began, or a large one that
//!   comes slower than [`LARGE_BODY_RATE`] past [`LARGE_BODY_GRACE`], is answered with
//!   408 and its connection closed;
//! - a WebSocket message larger than [`SMALL_BODY`] takes one of the same reads of
//!   large bodies (see [`Frames`]) before the frame header that makes it large is
//!   handed to jsonrpsee, whose frame reader sets the frame's whole payload aside on the
//!   header, and keeps it until its last frame has come, at the same pace (the time the
//!   connection is full does not count) and for [`LARGE_READ_HOLD`] at most, or its
//!   connection fails; a WebSocket is opened only by a connection's first request,
//!   without a body and with nothing sent after it before the 101, and a frame without
//!   a mask fails the connection, so that every frame is seen from its first byte;
//! - a request body over `max_request_body_size` is answered with a JSON-RPC error
//!   (HTTP 413) and its rest read and dropped, so the client sees the answer rather
//!   than a reset, whether the refusal came from the declared length or from reading:
//!   up to the larger of the limit and [`MIN_DRAIN`] past the limit (32 MiB in all by
//!   default).
//!
//! Errors jsonrpsee words for itself are reworded where a client could not act on them:
//! an unknown method is named, a subscription over plain HTTP says it needs a
//! WebSocket, a wrong `Content-Type` names the header. A notification, or a batch of
//! notifications only, gets an empty body over HTTP rather than jsonrpsee's `null`.

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::body::Body;
use jsonrpsee::core::BoxError;
use jsonrpsee::server::middleware::rpc::{
    Batch, BatchEntry, BatchEntryErr, Notification, RpcService, RpcServiceBuilder, RpcServiceT,
};
use jsonrpsee::server::{
    serve_with_graceful_shutdown, stop_channel, BatchResponseBuilder, HttpBody, HttpResponse,
    MethodCallback, MethodResponse, Methods, ServerConfig,
};
use jsonrpsee::types::{ErrorObject, ErrorObjectOwned, Request};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::task::TaskTracker;
use tower::Service;

/// Renders the page served at `GET /metrics`, given the request's `Accept` header:
/// its content type and its text.
pub type MetricsPage = Arc<
    dyn Fn(Option<String>) -> Pin<Box<dyn Future<Output = (&'static str, String)> + Send>>
        + Send
        + Sync,
>;

/// Connections served at once by default.
pub const MAX_CONNECTIONS: u32 = 4096;

/// What a connection may have waiting to be written and still run calls while the
/// server as a whole holds more than `max_queued_bytes_total`.
pub const SMALL_BACKLOG: u64 = 1024 * 1024;

/// A request body of at most this many bytes is read as it comes, before its request
/// takes a place among the calls in flight: a connection holds at most this much of a
/// body no call is running for yet.
pub const SMALL_BODY: u64 = 64 * 1024;

/// Bodies larger than [`SMALL_BODY`], or of no declared length, read at once over all
/// connections; each keeps its read with its place among the calls in flight, so such
/// bodies not yet running hold at most this many times `max_request_body_size`. A call
/// that gives its place back (a method that mostly waits) gives its read back with it.
pub const LARGE_BODIES_AT_ONCE: usize = 4;

/// How fast a body larger than [`SMALL_BODY`] must come once its read has begun (and
/// [`LARGE_BODY_GRACE`] has passed), with a `request_body_timeout`: it holds one of the
/// [`LARGE_BODIES_AT_ONCE`] reads, so a peer that trickles it holds that read for
/// seconds, not for the whole timeout. A body sent at once comes far faster.
pub const LARGE_BODY_RATE: u64 = 1024 * 1024;

/// How long a large body may take to start coming before [`LARGE_BODY_RATE`] applies.
pub const LARGE_BODY_GRACE: Duration = Duration::from_secs(2);

/// Calls of methods that have answered with [`SMALL_BACKLOG`] or more made at once, over
/// all connections (those of methods that mostly wait aside).
pub const LARGE_MAKING_AT_ONCE: usize = 2;

/// Least of an oversized request body read (and dropped) past the request size limit
/// after its 413, so that a client still sending it reads the answer instead of a broken
/// pipe. At most the larger of this and the limit is read past the limit (see
/// [`drain_bound`]); a longer body is cut off by closing the connection.
pub const MIN_DRAIN: u64 = 16 * 1024 * 1024;

/// The most of a refused request body read before the connection is closed: the limit
/// and [`MIN_DRAIN`] past it, or twice the limit if that is larger. Counted from the
/// start of the body, whether the refusal came from its declared length (nothing read
/// yet) or from reading past the limit, so both refuse the same bodies cleanly.
fn drain_bound(max_body: u32) -> u64 {
    let limit = u64::from(max_body);
    limit + limit.max(MIN_DRAIN)
}

/// JSON-RPC code of jsonrpsee's "Request is too big".
pub const REQUEST_TOO_BIG: i32 = -32007;

/// Limits and extras of a served socket.
#[derive(Clone)]
pub struct ServeConfig {
    /// Largest request body accepted, in bytes; larger ones are refused unread.
    pub max_request_body_size: u32,
    /// Largest response body produced, in bytes.
    pub max_response_body_size: u32,
    /// Connections served at once; more are refused by jsonrpsee.
    pub max_connections: u32,
    /// If set, `GET /metrics` answers with this page (Prometheus text format).
    pub metrics: Option<MetricsPage>,
    /// A connection whose peer sends nothing for this long is closed.
    pub idle_timeout: Option<Duration>,
    /// Calls running at once, over all connections (an HTTP request's from once its body
    /// has been read until its response is made).
    pub max_calls_in_flight: usize,
    /// An HTTP request whose body has not arrived whole this long after its head (once
    /// it may be read) is answered with 408 and its connection closed; so is a body
    /// larger than [`SMALL_BODY`] that comes slower than [`LARGE_BODY_RATE`] after
    /// [`LARGE_BODY_GRACE`]. `None`: bodies may take any time.
    pub request_body_timeout: Option<Duration>,
    /// Methods that mostly wait (for a change, another process, a file) holding little
    /// memory: they do not count against `max_calls_in_flight`.
    pub unmetered_methods: Vec<String>,
    /// Methods whose answers grow with what is stored (listings): their calls count as
    /// large from the first, before any has answered with [`SMALL_BACKLOG`] or more, so
    /// many peers asking at once for a listing that has grown large since it was last
    /// given are made [`LARGE_MAKING_AT_ONCE`] at a time too.
    pub listing_methods: Vec<String>,
    /// Bytes a connection may have waiting to be written before its subscriptions wait
    /// and (WebSocket) its requests are no longer read and those already read wait to
    /// run.
    pub max_queued_bytes: u64,
    /// Calls one WebSocket connection may have unanswered or not yet written; more wait
    /// (holding no place among the calls in flight) and the connection is not read.
    pub max_calls_per_connection: usize,
    /// A connection whose peer takes none of the bytes waiting for it for this long is
    /// closed (WebSocket too: the stream itself fails).
    pub write_stall_timeout: Option<Duration>,
    /// Largest answer to a batch, in bytes: a batch whose answer would grow past it is
    /// answered with an error (-32011) and its remaining calls are not run. The agent
    /// reads at most 16 MiB of a snapshotter's answer, so a batch needs no more.
    pub max_batch_response_bytes: u32,
    /// Bytes waiting to be written over all connections, with batch answers in the
    /// making, past which batches wait to start or stop before their next call, only
    /// connections holding less than [`SMALL_BACKLOG`] run calls, and calls of a method
    /// that has answered with [`SMALL_BACKLOG`] or more (or of `listing_methods`) wait.
    pub max_queued_bytes_total: u64,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            max_request_body_size: 16 * 1024 * 1024,
            max_response_body_size: 256 * 1024 * 1024,
            max_connections: MAX_CONNECTIONS,
            metrics: None,
            idle_timeout: None,
            max_calls_in_flight: 64,
            request_body_timeout: Some(Duration::from_secs(30)),
            unmetered_methods: Vec::new(),
            listing_methods: Vec::new(),
            max_queued_bytes: 16 * 1024 * 1024,
            max_calls_per_connection: 16,
            write_stall_timeout: Some(Duration::from_secs(30)),
            max_batch_response_bytes: 16 * 1024 * 1024,
            max_queued_bytes_total: 64 * 1024 * 1024,
        }
    }
}

/// Binds `path`, replacing a stale socket file left by a dead process but refusing to
/// steal the socket of a live one: if something answers a connect on `path`, the error
/// is `AddrInUse` and names the path. The socket gets file mode `mode`.
pub async fn bind(path: &Path, mode: u32) -> io::Result<UnixListener> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} exists and is not a socket", path.display()),
                ));
            }
            match UnixStream::connect(path).await {
                Ok(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::AddrInUse,
                        format!("another process is serving on {}", path.display()),
                    ))
                }
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    std::fs::remove_file(path).map_err(|e| {
                        io::Error::new(
                            e.kind(),
                            format!("removing stale socket {}: {e}", path.display()),
                        )
                    })?;
                }
                Err(e) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("probing existing socket {}: {e}", path.display()),
                    ))
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!("inspecting {}: {e}", path.display()),
            ))
        }
    }
    let listener = UnixListener::bind(path)
        .map_err(|e| io::Error::new(e.kind(), format!("binding {}: {e}", path.display())))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(|e| {
        io::Error::new(e.kind(), format!("setting mode of {}: {e}", path.display()))
    })?;
    Ok(listener)
}

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

/// A JSON-RPC error response without an id, as HTTP `status`.
fn rpc_error(status: hyper::StatusCode, code: i32, message: &str) -> HttpResponse {
    // A string always serializes.
    let message = serde_json::to_string(message).unwrap_or_else(|_| "\"\"".into());
    let text =
        format!(r#"{{"jsonrpc":"2.0","id":null,"error":{{"code":{code},"message":{message}}}}}"#);
    let mut response = HttpResponse::new(HttpBody::from(text));
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

/// At most `limit` characters of a peer's text, for an error message.
fn shown(text: &str, limit: usize) -> String {
    match text.char_indices().nth(limit) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}

/// What to do with a POST's `Content-Type`.
enum ContentType {
    /// JSON, as jsonrpsee wants it.
    Json,
    /// Absent, or a form (what `curl -d` and Python's urllib send by default): the body
    /// is read as JSON anyway, so the README's curl line works as printed.
    TakenAsJson,
    /// Anything else: refused, naming it.
    Other(String),
}

fn content_type(headers: &hyper::HeaderMap) -> ContentType {
    let Some(value) = headers.get(hyper::header::CONTENT_TYPE) else {
        return ContentType::TakenAsJson;
    };
    let text = String::from_utf8_lossy(value.as_bytes()).into_owned();
    let media = text.split(';').next().unwrap_or_default().trim();
    if media.eq_ignore_ascii_case("application/json")
        || media.eq_ignore_ascii_case("application/json-rpc")
    {
        if jsonrpsee::server::http::is_json(Some(value)) {
            ContentType::Json
        } else {
            // JSON with parameters jsonrpsee does not know (`charset="UTF-8"`).
            ContentType::TakenAsJson
        }
    } else if media.eq_ignore_ascii_case("application/x-www-form-urlencoded") {
        ContentType::TakenAsJson
    } else {
        ContentType::Other(text)
    }
}

/// Whether the client waits for `100 Continue` before sending its body: then an unread
/// body is never sent, and there is nothing to drain.
fn expects_continue(headers: &hyper::HeaderMap) -> bool {
    headers
        .get(hyper::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

/// The `Content-Length` of a request, if it declares one.
fn declared_length(headers: &hyper::HeaderMap) -> Option<u64> {
    headers
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
}

/// Reads and drops the rest of a refused body after the answer, so the client, still
/// writing, is not cut off before it reads the answer. `read` bytes of the body have
/// been read already; at most `bound` in all are: a longer body (declared or not) is cut
/// off by closing the connection. Each chunk is dropped as it comes, so a drain holds
/// no more than hyper's read buffer.
fn drain<B>(mut body: B, headers: &hyper::HeaderMap, read: u64, bound: u64)
where
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
{
    if expects_continue(headers) || declared_length(headers).is_some_and(|length| length > bound) {
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
    /// The connection failed while it was read.
    Failed(hyper::Error),
    /// It had not come whole in time: this many bytes had, and it was too slow by the
    /// rule named.
    Late(usize, Lateness),
}

/// Which deadline a request body missed.
#[derive(Clone, Copy)]
enum Lateness {
    /// It was not whole within `request_body_timeout`.
    Whole(Duration),
    /// A large body came slower than [`LARGE_BODY_RATE`], past [`LARGE_BODY_GRACE`].
    Pace,
}

/// Reads a request body whole, up to `max_body` bytes, whether or not it declared its
/// length; no more than [`SMALL_BODY`] is set aside before the bytes arrive. With a
/// `timeout`, the body must come whole within it and, if `paced` (a large body, holding
/// one of the reads of large bodies at once), keep up with [`LARGE_BODY_RATE`] after
/// [`LARGE_BODY_GRACE`].
async fn read_body(
    mut body: hyper::body::Incoming,
    declared: Option<u64>,
    max_body: u32,
    timeout: Option<Duration>,
    paced: bool,
) -> Result<hyper::body::Bytes, Unread> {
    let expected = declared.unwrap_or(0).min(SMALL_BODY) as usize;
    let mut collected = Vec::with_capacity(expected);
    let start = tokio::time::Instant::now();
    loop {
        let deadline = timeout.map(|timeout| {
            let whole = (start + timeout, Lateness::Whole(timeout));
            let kept_up = start
                + LARGE_BODY_GRACE
                + Duration::from_secs_f64(collected.len() as f64 / LARGE_BODY_RATE as f64);
            if paced && kept_up < whole.0 {
                (kept_up, Lateness::Pace)
            } else {
                whole
            }
        });
        let frame = match deadline {
            Some((at, lateness)) => match tokio::time::timeout_at(at, body.frame()).await {
                Ok(frame) => frame,
                Err(_) => return Err(Unread::Late(collected.len(), lateness)),
            },
            None => body.frame().await,
        };
        let Some(frame) = frame else { break };
        let frame = frame.map_err(Unread::Failed)?;
        if let Ok(data) = frame.into_data() {
            let read = collected.len() + data.len();
            if read > max_body as usize {
                return Err(Unread::TooBig(body, read as u64));
            }
            collected.extend_from_slice(&data);
        }
    }
    Ok(hyper::body::Bytes::from(collected))
}

/// The answer to a request whose body did not arrive in time; the connection is closed
/// after it (the rest of the body is not read).
fn body_late(lateness: Lateness, got: usize, declared: Option<u64>) -> HttpResponse {
    let expected = match declared {
        Some(length) => format!("{got} of its {length} bytes came"),
        None => format!("{got} bytes came, not its last chunk"),
    };
    let late = match lateness {
        Lateness::Whole(timeout) => format!(
            "the request body did not arrive within {}s of its head",
            timeout.as_secs_f64()
        ),
        Lateness::Pace => format!(
            "the request body, larger than {} KiB, came slower than {} KiB/s after its \
             first {}s",
            SMALL_BODY / 1024,
            LARGE_BODY_RATE / 1024,
            LARGE_BODY_GRACE.as_secs_f64()
        ),
    };
    closing(rpc_error(
        hyper::StatusCode::REQUEST_TIMEOUT,
        jsonrpsee::types::error::INVALID_REQUEST_CODE,
        &format!("{late} ({expected}); send the whole body at once"),
    ))
}

/// `response`, after which the connection is closed.
fn closing(mut response: HttpResponse) -> HttpResponse {
    response.headers_mut().insert(
        hyper::header::CONNECTION,
        hyper::header::HeaderValue::from_static("close"),
    );
    response
}

/// Whether a request opens a WebSocket.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Upgrade {
    No,
    Yes,
    /// It asks to, but not as its connection's first request, with a body, or with more
    /// sent after its head: the frames would not be seen from their first byte.
    Refused,
}

/// The longest JSON-RPC id of a request over [`SMALL_BODY`] that calls a method that
/// mostly waits, in bytes (as sent): an id is echoed, not compacted.
pub const MAX_ID: usize = 1024;

/// Set on an HTTP request over [`SMALL_BODY`] that calls a method that mostly waits and
/// stays large without its whitespace: it keeps its place and read while it runs.
#[derive(Clone, Copy)]
struct LargeWait;

/// What a large request body is, as to methods that mostly wait.
enum Waiting {
    /// It calls none (or is not JSON-RPC: jsonrpsee answers that).
    No,
    /// It calls one, and is at most [`SMALL_BODY`] without its whitespace: this.
    Small(Vec<u8>),
    /// It calls one and is larger all the same.
    Large,
    /// One of its ids is this long, over [`MAX_ID`].
    LongId(usize),
}

/// A JSON-RPC call or notification as sent, its params unparsed.
#[derive(serde::Deserialize)]
struct Envelope<'a> {
    #[serde(borrow)]
    jsonrpc: &'a serde_json::value::RawValue,
    #[serde(borrow, default)]
    id: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    method: std::borrow::Cow<'a, str>,
    #[serde(borrow, default)]
    params: Option<&'a serde_json::value::RawValue>,
}

impl Envelope<'_> {
    /// The call without the whitespace of its params.
    fn compact(&self) -> Result<Compact<'_>, serde_json::Error> {
        Ok(Compact {
            jsonrpc: self.jsonrpc,
            id: self.id,
            method: &self.method,
            params: self
                .params
                .map(|params| serde_json::from_str(params.get()))
                .transpose()?,
        })
    }
}

/// An [`Envelope`] with its params parsed, to be written without whitespace.
#[derive(serde::Serialize)]
struct Compact<'a> {
    jsonrpc: &'a serde_json::value::RawValue,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a serde_json::value::RawValue>,
    method: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    params: Option<serde_json::Value>,
}

/// Whether a large body calls a method that mostly waits, and how large it is without
/// its whitespace: such a call waits holding its request, so one padded with spaces
/// (or with a long id) must not hold much while it waits, nor keep a read of a large
/// body from everyone for as long.
fn waiting(body: &[u8], unmetered: &HashSet<String>) -> Waiting {
    let batch = body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[');
    let calls = if batch {
        serde_json::from_slice::<Vec<Envelope<'_>>>(body)
    } else {
        serde_json::from_slice(body).map(|call| vec![call])
    };
    let Ok(calls) = calls else {
        return Waiting::No;
    };
    if !calls
        .iter()
        .any(|call| unmetered.contains(call.method.as_ref()))
    {
        return Waiting::No;
    }
    if let Some(id) = calls
        .iter()
        .filter_map(|call| call.id)
        .find(|id| id.get().len() > MAX_ID)
    {
        return Waiting::LongId(id.get().len());
    }
    let compact: Result<Vec<Compact<'_>>, _> = calls.iter().map(Envelope::compact).collect();
    let compact = compact.and_then(|compact| match compact.as_slice() {
        [call] if !batch => serde_json::to_vec(call),
        calls => serde_json::to_vec(calls),
    });
    // A batch is charged as the calls it holds: one of waits that is large only because
    // it holds many (up to [`WAITS_PER_BATCH`] of about [`WAIT_BYTES`] each) holds no read
    // while it waits either.
    let allowed = if calls.len() <= WAITS_PER_BATCH {
        SMALL_BODY.max(calls.len() as u64 * WAIT_BYTES)
    } else {
        SMALL_BODY
    };
    match compact {
        Ok(compact) if compact.len() as u64 <= allowed => Waiting::Small(compact),
        _ => Waiting::Large,
    }
}

/// Whether a request (or any call of a batch) that jsonrpsee took for a notification
/// has an `id` that is not a string, an integer or null: JSON-RPC answers it -32600
/// with `id: null`, where jsonrpsee would run nothing and answer nothing.
fn has_invalid_id(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Probe<'a> {
        #[serde(borrow, default)]
        id: Option<&'a serde_json::value::RawValue>,
    }
    let bad = |probe: &Probe<'_>| {
        probe.id.is_some_and(|id| {
            !matches!(
                serde_json::from_str::<serde_json::Value>(id.get()),
                Ok(serde_json::Value::String(_) | serde_json::Value::Null)
            ) && !matches!(
                serde_json::from_str::<serde_json::Value>(id.get()),
                Ok(serde_json::Value::Number(n)) if n.is_i64() || n.is_u64()
            )
        })
    };
    let batch = body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[');
    if batch {
        serde_json::from_slice::<Vec<Probe<'_>>>(body).is_ok_and(|calls| calls.iter().any(bad))
    } else {
        serde_json::from_slice::<Probe<'_>>(body).is_ok_and(|call| bad(&call))
    }
}

/// Most calls of a batch of waits that holds no read of a large body while it waits.
const WAITS_PER_BATCH: usize = 1000;
/// What one call of such a batch may take without whitespace, in bytes (an id of up to
/// [`MAX_ID`] and a wait's params).
const WAIT_BYTES: u64 = 1280;

/// Which transport a call came by; set on every request `serve` routes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Http,
    WebSocket,
}

/// The place (in `max_calls_in_flight`) an HTTP request took once its body was read,
/// with its read of a large body (one of [`LARGE_BODIES_AT_ONCE`]) if it had one; an
/// unmetered method gives both back as soon as it is known, a call that must wait for
/// room before it runs gives both back while it waits. It stays in the transport: the
/// methods never see it.
#[derive(Clone)]
pub(crate) struct Place(Arc<Mutex<[Option<OwnedSemaphorePermit>; 2]>>);

impl Place {
    fn new(place: Option<OwnedSemaphorePermit>, large_body: Option<OwnedSemaphorePermit>) -> Place {
        Place(Arc::new(Mutex::new([place, large_body])))
    }

    /// Gives the place back, and the large body's read if the call had one (once;
    /// later calls do nothing): another call may run.
    fn give_back(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = [None, None];
    }

    /// Gives back the place among the calls in flight alone, for a call that has done
    /// its work and now only waits (as a write waits for the disk). A large body's
    /// read stays counted among those at once: the body is kept until the answer.
    #[cfg(test)]
    fn leave_running(&self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner())[0] = None;
    }
}

impl std::fmt::Debug for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.0.lock().unwrap_or_else(|p| p.into_inner())[0].is_some();
        f.debug_struct("Place").field("held", &held).finish()
    }
}

/// What routing needs of the server's configuration.
struct Shared {
    page: Option<MetricsPage>,
    max_body: u32,
    places: Arc<Semaphore>,
    /// Reads of bodies larger than [`SMALL_BODY`] (or of no declared length) at once.
    large_bodies: Arc<Semaphore>,
    body_timeout: Option<Duration>,
    /// Methods that mostly wait (`unmetered_methods`).
    unmetered: HashSet<String>,
}

/// Answers `GET /metrics` from the page when there is one; everything else is JSON-RPC.
/// A POST's body is read here, up to `max_body` (a chunked one past it gets 413 like a
/// declared one, not an internal error) and within `body_timeout`, before the request
/// waits for its place among the calls in flight.
async fn route<S>(
    request: hyper::Request<hyper::body::Incoming>,
    upgrade: Upgrade,
    mut rpc: S,
    shared: Arc<Shared>,
    outbox: Arc<Outbox>,
    caller: Option<crate::types::Caller>,
) -> Result<HttpResponse, BoxError>
where
    S: Service<hyper::Request<HttpBody>, Response = HttpResponse, Error = BoxError>,
{
    if let Some(page) = &shared.page {
        if request.method() == hyper::Method::GET && request.uri().path() == "/metrics" {
            return Ok(metrics_response(page, &request).await);
        }
    }
    let (mut parts, body) = request.into_parts();
    parts.extensions.insert(outbox.clone());
    // Who is calling, for the handlers that record it (the agent's history).
    if let Some(caller) = caller {
        parts.extensions.insert(caller);
    }
    if upgrade == Upgrade::Refused {
        return Ok(closing(rpc_error(
            hyper::StatusCode::BAD_REQUEST,
            jsonrpsee::types::error::INVALID_REQUEST_CODE,
            "a WebSocket is opened by the first request of a connection, without a body, \
             and its client sends nothing more until the 101 answer (RFC 6455, 4.1); open \
             a new connection and wait for the 101",
        )));
    }
    if upgrade == Upgrade::Yes {
        parts.extensions.insert(Transport::WebSocket);
        return rpc
            .call(hyper::Request::from_parts(parts, HttpBody::new(body)))
            .await;
    }
    parts.extensions.insert(Transport::Http);
    if parts.method != hyper::Method::POST {
        // jsonrpsee answers with 405 and what it wants.
        return rpc
            .call(hyper::Request::from_parts(parts, HttpBody::new(body)))
            .await;
    }
    let max_body = shared.max_body;
    let drain_bound = drain_bound(max_body);
    match content_type(&parts.headers) {
        ContentType::Json => {}
        ContentType::TakenAsJson => {
            parts.headers.insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("application/json"),
            );
        }
        ContentType::Other(text) => {
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
    }
    let declared = declared_length(&parts.headers);
    if declared.is_some_and(|length| length > u64::from(max_body)) {
        drain(body, &parts.headers, 0, drain_bound);
        return Ok(too_big(max_body));
    }
    // The body is read before the request takes a place, so a peer that sends its body
    // slowly (or less of it than it declared) holds no place. A large body first waits
    // for one of the few reads of large bodies at once, which it keeps with its place
    // (until its response is made, or until its call gives the place back because it
    // waits): what bodies hold before their calls run is bounded.
    let mut large = match declared {
        Some(length) if length <= SMALL_BODY => None,
        _ => shared.large_bodies.clone().acquire_owned().await.ok(),
    };
    let read = read_body(
        body,
        declared,
        max_body,
        shared.body_timeout,
        large.is_some(),
    )
    .await;
    // Kept (a reference, not a copy) for a request jsonrpsee takes for a notification;
    // a small one only, so a large body is not held past its parsing.
    let sent = read
        .as_ref()
        .ok()
        .filter(|bytes| bytes.len() as u64 <= SMALL_BODY)
        .cloned();
    let body = match read {
        Ok(bytes) if large.is_some() => match waiting(&bytes, &shared.unmetered) {
            Waiting::No => HttpBody::new(http_body_util::Full::new(bytes)),
            Waiting::Small(compact) => {
                // A call that waits, small once its whitespace is gone: it holds
                // neither its read nor its bytes while it waits.
                large = None;
                HttpBody::new(http_body_util::Full::new(hyper::body::Bytes::from(compact)))
            }
            Waiting::Large => {
                // It keeps its read and place while it runs.
                parts.extensions.insert(LargeWait);
                HttpBody::new(http_body_util::Full::new(bytes))
            }
            Waiting::LongId(length) => {
                return Ok(rpc_error(
                    hyper::StatusCode::BAD_REQUEST,
                    jsonrpsee::types::error::INVALID_REQUEST_CODE,
                    &format!("an id of {length} bytes; an id may have at most {MAX_ID} bytes"),
                ))
            }
        },
        Ok(bytes) => HttpBody::new(http_body_util::Full::new(bytes)),
        Err(Unread::TooBig(body, read)) => {
            drain(body, &parts.headers, read, drain_bound);
            return Ok(too_big(max_body));
        }
        Err(Unread::Late(got, lateness)) => return Ok(body_late(lateness, got, declared)),
        Err(Unread::Failed(e)) => return Err(e.into()),
    };
    let place = Place::new(shared.places.clone().acquire_owned().await.ok(), large);
    parts.extensions.insert(place.clone());
    let mut response = rpc.call(hyper::Request::from_parts(parts, body)).await?;
    if response.extensions().get::<Unanswered>().is_some() {
        if sent.as_deref().is_some_and(has_invalid_id) {
            place.give_back();
            return Ok(rpc_error(
                hyper::StatusCode::BAD_REQUEST,
                jsonrpsee::types::error::INVALID_REQUEST_CODE,
                "Invalid request: an id must be a string, an integer or null",
            ));
        }
        // jsonrpsee's HTTP answer to a notification is the body `null`; JSON-RPC's is
        // nothing at all.
        *response.body_mut() = HttpBody::empty();
        response.headers_mut().remove(hyper::header::CONTENT_TYPE);
    }
    // The place bounds work, not answers waiting for their reader: hyper reads no
    // further request of this connection until this response has been written.
    place.give_back();
    let length = response.body().size_hint().exact().unwrap_or(0) as usize;
    outbox.respond(length, None);
    Ok(response)
}

/// The bytes every connection has waiting to be written, and the batch answers in the
/// making: what the server holds for peers, over all of them.
struct Backlog {
    bytes: std::sync::atomic::AtomicU64,
    limit: u64,
    /// Notified when `bytes` falls back below `limit`.
    drained: tokio::sync::Notify,
}

impl Backlog {
    fn new(limit: u64) -> Backlog {
        Backlog {
            bytes: std::sync::atomic::AtomicU64::new(0),
            limit,
            drained: tokio::sync::Notify::new(),
        }
    }

    fn add(&self, n: u64) {
        self.bytes
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }

    fn sub(&self, n: u64) {
        let before = self
            .bytes
            .fetch_sub(n, std::sync::atomic::Ordering::Relaxed);
        if before >= self.limit && before.saturating_sub(n) < self.limit {
            self.drained.notify_waiters();
        }
    }

    /// Whether the server holds more than it should: only small holders go on.
    fn over(&self) -> bool {
        self.bytes.load(std::sync::atomic::Ordering::Relaxed) >= self.limit
    }

    /// Counts `n` bytes about to be made if the server holds less than it should, in
    /// one step, so that callers let in together cannot all pass the bound.
    fn try_reserve(&self, n: u64) -> bool {
        self.bytes
            .fetch_update(
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
                |bytes| (bytes < self.limit).then_some(bytes + n),
            )
            .is_ok()
    }
}

/// An answer in the making, counted in the [`Backlog`] until it is handed over; for a
/// large one, with its turn among the [`LARGE_MAKING_AT_ONCE`].
struct Making {
    backlog: Arc<Backlog>,
    bytes: u64,
    turn: Option<OwnedSemaphorePermit>,
}

impl Making {
    /// `bytes` already counted in `backlog`: given back when dropped.
    fn counted(backlog: &Arc<Backlog>, bytes: u64) -> Making {
        Making {
            backlog: backlog.clone(),
            bytes,
            turn: None,
        }
    }

    fn with_turn(mut self, turn: Option<OwnedSemaphorePermit>) -> Making {
        self.turn = turn;
        self
    }

    fn grow(&mut self, n: usize) {
        self.bytes += n as u64;
        self.backlog.add(n as u64);
    }
}

impl Drop for Making {
    fn drop(&mut self) {
        self.backlog.sub(self.bytes);
    }
}

/// One connection's bytes handed over for writing and written: what a peer that does
/// not read can make the server hold on its behalf.
///
/// `due` counts the bytes handed over, `written` those the socket took. Responses and
/// notifications are written in the order they are handed over, so a response is out
/// once `written` reaches the `due` it was given; what it holds (a WebSocket call's or
/// batch's slot) is given back then. Headers and frames count as written but not as
/// handed over, which only ever errs towards giving back early.
pub struct Outbox {
    state: Mutex<OutboxState>,
    /// Notified whenever bytes are written.
    written: tokio::sync::Notify,
    /// One subscription sends at a time, so that waiting subscriptions hold no rendered
    /// update each.
    turn: tokio::sync::Mutex<()>,
    limit: u64,
    /// The connection's WebSocket calls unanswered or not yet written, at most
    /// `max_calls_per_connection`.
    slots: Arc<Semaphore>,
    /// Held while one of the connection's batches builds its answer.
    batches: tokio::sync::Mutex<()>,
    /// Everyone's; this connection's part is its answers not yet written whole, until
    /// it fails.
    backlog: Arc<Backlog>,
}

#[derive(Default)]
struct OutboxState {
    due: u64,
    written: u64,
    /// Per response not yet written: its `due`, and its slot.
    pending: VecDeque<(u64, Held)>,
    /// Per response or notification not yet written whole: its `due` and its size,
    /// counted whole in the backlog until its last byte is written. A response is held
    /// in memory whole until then, so a peer that reads all of each answer but its last
    /// bytes holds every answer, not their tails.
    unwritten: VecDeque<(u64, u64)>,
    /// The connection's reader, waiting for room.
    reader: Option<Waker>,
    /// The connection's reader, waiting for the peer to send: woken only if the
    /// connection fails, which it must see even if the peer sends nothing more.
    reader_on_socket: Option<Waker>,
    /// A write failed or stalled: the connection is over.
    failed: bool,
    /// The peer closed its side (a read found the end of the stream).
    peer_closed: bool,
}

/// What a response holds until it is written: a WebSocket call's or batch's slot among
/// its connection's.
type Held = Option<OwnedSemaphorePermit>;

impl OutboxState {
    fn queued(&self) -> u64 {
        self.due.saturating_sub(self.written)
    }

    fn hand_over(&mut self, bytes: usize) -> u64 {
        self.due = self.due.max(self.written) + bytes as u64;
        self.due
    }
}

/// A subscription's turn to send: held while it renders and hands over one update.
pub type OutboxTurn<'a> = tokio::sync::MutexGuard<'a, ()>;

impl Outbox {
    fn new(limit: u64, max_calls: usize, backlog: Arc<Backlog>) -> Outbox {
        Outbox {
            state: Mutex::new(OutboxState::default()),
            written: tokio::sync::Notify::new(),
            turn: tokio::sync::Mutex::new(()),
            limit,
            slots: Arc::new(Semaphore::new(max_calls.max(1))),
            batches: tokio::sync::Mutex::new(()),
            backlog,
        }
    }

    /// Hands `bytes` over in `state`, counting them in the backlog; returns their `due`.
    fn hand_over(&self, state: &mut OutboxState, bytes: usize) -> u64 {
        let due = state.hand_over(bytes);
        if !state.failed {
            self.backlog.add(bytes as u64);
            state.unwritten.push_back((due, bytes as u64));
        }
        due
    }

    /// Gives back to the backlog what `state` counts of answers written whole, or of
    /// all of them once nothing more will be written.
    fn uncount(&self, state: &mut OutboxState, all: bool) {
        let mut done = 0;
        while let Some(&(due, bytes)) = state.unwritten.front() {
            if !all && due > state.written {
                break;
            }
            done += bytes;
            state.unwritten.pop_front();
        }
        self.backlog.sub(done);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OutboxState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes handed over and not yet written.
    pub fn queued(&self) -> u64 {
        self.lock().queued()
    }

    /// Waits for this connection's turn to send a notification: one sender at a time,
    /// once less than `max_queued_bytes` waits to be written. Hand the notification
    /// over with [`Outbox::push`] before dropping the turn.
    pub async fn turn(&self) -> OutboxTurn<'_> {
        let turn = self.turn.lock().await;
        self.room().await;
        turn
    }

    /// Waits until less than `max_queued_bytes` waits to be written, and less than
    /// [`SMALL_BACKLOG`] if the server as a whole holds more than it should; or until
    /// the connection has ended (nothing more will be written then).
    async fn room(&self) {
        self.until(|| {
            let queued = self.queued();
            queued < self.limit && (queued < SMALL_BACKLOG || !self.backlog.over())
        })
        .await
    }

    /// Waits until the server as a whole holds less than `max_queued_bytes_total`, or
    /// the connection has ended.
    async fn room_in_all(&self) {
        self.until(|| !self.backlog.over()).await
    }

    /// Takes a turn among the large answers made at once (if `turns`), then counts `n`
    /// bytes about to be made against the server's backlog, waiting until it holds
    /// less than `max_queued_bytes_total` (holding nothing else meanwhile); counts
    /// nothing if the connection ends first.
    async fn reserve_in_all(&self, n: u64, turns: Option<&Arc<Semaphore>>) -> Making {
        let turn = match turns {
            Some(turns) => turns.clone().acquire_owned().await.ok(),
            None => None,
        };
        let reserved = std::sync::atomic::AtomicBool::new(false);
        self.until(|| {
            let now = self.backlog.try_reserve(n);
            reserved.store(now, std::sync::atomic::Ordering::Relaxed);
            now
        })
        .await;
        let counted = reserved.load(std::sync::atomic::Ordering::Relaxed);
        Making::counted(&self.backlog, if counted { n } else { 0 }).with_turn(turn)
    }

    /// Waits until `ready` holds or the connection has ended, looking again whenever
    /// this connection writes or the server's backlog falls below its limit.
    async fn until(&self, ready: impl Fn() -> bool) {
        loop {
            let written = self.written.notified();
            let drained = self.backlog.drained.notified();
            tokio::pin!(written, drained);
            written.as_mut().enable();
            drained.as_mut().enable();
            if self.ended() || ready() {
                return;
            }
            tokio::select! {
                _ = written => {}
                _ = drained => {}
            }
        }
    }

    /// Records a notification of `bytes` handed to the connection.
    pub fn push(&self, bytes: usize) {
        let mut state = self.lock();
        self.hand_over(&mut state, bytes);
    }

    /// Waits for one of the connection's slots for a WebSocket call or batch (`None`
    /// once the connection is gone).
    async fn slot(&self) -> Held {
        self.slots.clone().acquire_owned().await.ok()
    }

    /// Whether the connection may be read: little enough waits to be written and a
    /// slot is free.
    fn has_room(&self, state: &OutboxState) -> bool {
        state.queued() < self.limit && self.slots.available_permits() > 0
    }

    /// Records a response of `bytes`; what it `held` is given back once it is written
    /// (at once if nothing is written for it).
    fn respond(&self, bytes: usize, held: Held) {
        if bytes == 0 {
            drop(held);
            self.wake_reader();
            return;
        }
        let mut state = self.lock();
        let due = self.hand_over(&mut state, bytes);
        state.pending.push_back((due, held));
    }

    fn wrote(&self, n: usize) {
        let mut released = Vec::new();
        {
            let mut state = self.lock();
            state.written += n as u64;
            self.uncount(&mut state, false);
            while state
                .pending
                .front()
                .is_some_and(|(due, _)| *due <= state.written)
            {
                if let Some((_, held)) = state.pending.pop_front() {
                    released.push(held);
                }
            }
        }
        // Given back before the reader looks for a free slot.
        drop(released);
        self.wake_reader();
        self.written.notify_waiters();
    }

    /// Wakes the reader held back for room, if there is room now (or the connection
    /// failed, which its reads must see).
    fn wake_reader(&self) {
        let reader = {
            let mut state = self.lock();
            if state.failed || self.has_room(&state) {
                state.reader.take()
            } else {
                None
            }
        };
        if let Some(reader) = reader {
            reader.wake();
        }
    }

    /// Whether a WebSocket connection must not be read now (too much waits to be
    /// written, or no slot is free); if so, `waker` is woken when it may.
    fn full(&self, waker: &Waker) -> bool {
        let mut state = self.lock();
        if state.failed || self.has_room(&state) {
            return false;
        }
        state.reader = Some(waker.clone());
        true
    }

    /// The connection's writes failed or stalled: its reads fail from now on, and what
    /// its responses held is given back.
    fn fail(&self) {
        let (released, on_socket): (Vec<_>, _) = {
            let mut state = self.lock();
            self.uncount(&mut state, true);
            state.failed = true;
            (
                state.pending.drain(..).collect(),
                state.reader_on_socket.take(),
            )
        };
        drop(released);
        if let Some(reader) = on_socket {
            reader.wake();
        }
        self.wake_reader();
        self.written.notify_waiters();
    }

    /// Records the reader waiting for the peer to send (see `reader_on_socket`).
    fn reading(&self, waker: &Waker) {
        let mut state = self.lock();
        if !state
            .reader_on_socket
            .as_ref()
            .is_some_and(|w| w.will_wake(waker))
        {
            state.reader_on_socket = Some(waker.clone());
        }
    }

    fn failed(&self) -> bool {
        self.lock().failed
    }

    /// Records that the peer closed its side of the connection: whatever waits for room
    /// stops waiting (as it does when the connection fails).
    fn peer_closed(&self) {
        self.lock().peer_closed = true;
        self.written.notify_waiters();
    }

    /// Whether no answer can reach the peer any more: its writes failed, or it closed
    /// its side (a half-closed HTTP request is not answered either).
    fn ended(&self) -> bool {
        let state = self.lock();
        state.failed || state.peer_closed
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        let mut state = self.lock();
        self.uncount(&mut state, true);
    }
}

/// A batch's answer when it stopped before its call `at` of `calls` because the server
/// holds more than `max_queued_bytes_total` (-32011).
/// A later large call of a batch: its turn (waited for: turns are held while answers
/// are made) and `n` bytes counted, if the server holds less than it should once the
/// turn is there; `None` stops the batch.
async fn later_reservation(
    backlog: &Arc<Backlog>,
    n: u64,
    turns: Option<&Arc<Semaphore>>,
) -> Option<Making> {
    let turn = match turns {
        Some(turns) => Some(turns.clone().acquire_owned().await.ok()?),
        None => None,
    };
    backlog
        .try_reserve(n)
        .then(|| Making::counted(backlog, n).with_turn(turn))
}

fn over_bound(rules: &Rules, at: usize, calls: usize, made: u64) -> MethodResponse {
    too_big_batch(format!(
        "the server holds more than {} bytes of answers its clients have not read yet, so \
         this batch stopped at call {at} of its {calls} (its answer had reached {made} \
         bytes); try again later, or send fewer calls in a batch",
        rules.backlog.limit
    ))
}

/// A batch's answer when it was stopped for its size (-32011), saying why.
fn too_big_batch(message: String) -> MethodResponse {
    MethodResponse::error(
        jsonrpsee::types::Id::Null,
        ErrorObject::owned(
            jsonrpsee::types::error::TOO_BIG_BATCH_RESPONSE_CODE,
            message,
            None::<()>,
        ),
    )
}

/// Marks the response jsonrpsee makes for a notification, or for a batch of
/// notifications only, which JSON-RPC does not answer: over HTTP its body is left empty
/// (jsonrpsee would send `null`); over WebSocket jsonrpsee sends nothing.
#[derive(Clone, Copy, Debug)]
struct Unanswered;

/// `response`, marked [`Unanswered`] if it answers nothing.
fn marked(mut response: MethodResponse) -> MethodResponse {
    if response.is_notification() {
        response.extensions_mut().insert(Unanswered);
    }
    response
}

/// The RPC middleware `serve` puts first: keeps calls within their limits (see the
/// module's doc) and rewords jsonrpsee's errors a client cannot act on.
#[derive(Clone)]
pub struct Guard<S> {
    inner: S,
    rules: Arc<Rules>,
}

struct Rules {
    methods: Methods,
    places: Arc<Semaphore>,
    unmetered: HashSet<String>,
    /// Methods counted as large from their first call (`listing_methods`).
    listings: HashSet<String>,
    /// The most bytes of a batch's answer (`max_batch_response_bytes`).
    max_batch_response: usize,
    backlog: Arc<Backlog>,
    /// The largest answer each method served has given, for those that have given one
    /// of [`SMALL_BACKLOG`] or more (a listing of a large backup, say): a call of such a
    /// method counts that much against the backlog before it runs. Keyed by the
    /// server's own method names, so it holds at most one entry per method.
    large: Mutex<std::collections::HashMap<String, u64>>,
    /// Whether `large` has an entry: until then no call looks it up.
    any_large: std::sync::atomic::AtomicBool,
    /// Turns among the [`LARGE_MAKING_AT_ONCE`] calls of such methods that run at once,
    /// so a count that a larger answer outgrows is outgrown by that many answers at
    /// most, not by as many as the count let in.
    making: Arc<Semaphore>,
}

impl Rules {
    /// The largest answer `method` has given, if that was [`SMALL_BACKLOG`] or more; for
    /// a listing, at least [`SMALL_BACKLOG`].
    fn large(&self, method: &str) -> Option<u64> {
        let listing = self.listings.contains(method);
        if !listing && !self.any_large.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        let most = self
            .large
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(method)
            .copied();
        most.or(listing.then_some(SMALL_BACKLOG))
    }

    /// The turns a call of a large method takes: those that mostly wait take none (a
    /// wait would keep the turn from everyone).
    fn turns(&self, metered: bool) -> Option<&Arc<Semaphore>> {
        metered.then_some(&self.making)
    }

    /// A turn and `n` bytes counted for a large answer, if both are free at once.
    fn try_reserve(&self, n: u64, metered: bool) -> Option<Making> {
        let turn = match self.turns(metered) {
            Some(turns) => Some(turns.clone().try_acquire_owned().ok()?),
            None => None,
        };
        self.backlog
            .try_reserve(n)
            .then(|| Making::counted(&self.backlog, n).with_turn(turn))
    }

    /// Records that `method` answered with `bytes`: results only, so that an error
    /// that quotes what a peer sent cannot make a small method (the one a health probe
    /// calls) count as large and wait.
    fn answered(&self, method: &str, bytes: usize) {
        let bytes = bytes as u64;
        if bytes < SMALL_BACKLOG || self.methods.method(method).is_none() {
            return;
        }
        let mut large = self.large.lock().unwrap_or_else(|p| p.into_inner());
        match large.get_mut(method) {
            Some(most) => *most = (*most).max(bytes),
            None => {
                large.insert(method.to_owned(), bytes);
            }
        }
        self.any_large
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Runs `request` on `inner`, holding a place among the calls in flight while it
    /// runs if it is `metered`: the place bounds work, not answers waiting for their
    /// reader.
    async fn placed<S>(&self, inner: &S, request: Request<'_>, metered: bool) -> MethodResponse
    where
        S: RpcServiceT<MethodResponse = MethodResponse>,
    {
        let _place = if metered {
            self.places.clone().acquire_owned().await.ok()
        } else {
            None
        };
        inner.call(request).await
    }

    /// The error for calling `method` in a batch, if it cannot be: a subscription's
    /// notifications would go out before the batch's answer that names it.
    fn batch_refusal(&self, method: &str) -> Option<ErrorObjectOwned> {
        match self.methods.method(method) {
            Some(MethodCallback::Subscription(_)) => Some(ErrorObject::owned(
                jsonrpsee::types::error::INVALID_REQUEST_CODE,
                format!(
                    "{method} cannot be called in a batch: a subscription is answered at once, \
                     ahead of its batch; call it on its own"
                ),
                None::<()>,
            )),
            _ => None,
        }
    }

    /// The error for calling `method` by `transport`, if it cannot be called so.
    fn refusal(&self, method: &str, transport: Option<Transport>) -> Option<ErrorObjectOwned> {
        let code = jsonrpsee::types::error::METHOD_NOT_FOUND_CODE;
        match self.methods.method(method) {
            None => Some(ErrorObject::owned(
                code,
                format!("Method not found: {}", shown(method, 200)),
                None::<()>,
            )),
            Some(MethodCallback::Subscription(_) | MethodCallback::Unsubscription(_))
                if transport == Some(Transport::Http) =>
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
}

impl<S> RpcServiceT for Guard<S>
where
    S: RpcServiceT<
            MethodResponse = MethodResponse,
            BatchResponse = MethodResponse,
            NotificationResponse = MethodResponse,
        > + Clone
        + Send
        + Sync
        + 'static,
{
    type MethodResponse = MethodResponse;
    type NotificationResponse = MethodResponse;
    type BatchResponse = MethodResponse;

    fn call<'a>(&self, request: Request<'a>) -> impl Future<Output = MethodResponse> + Send + 'a {
        let inner = self.inner.clone();
        let rules = self.rules.clone();
        async move {
            let transport = request.extensions().get::<Transport>().copied();
            if let Some(e) = rules.refusal(request.method_name(), transport) {
                return MethodResponse::error(request.id().into_owned(), e);
            }
            let metered = !rules.unmetered.contains(request.method_name());
            let method = request.method.clone();
            let large = rules.large(&method);
            let response = match (
                transport,
                request.extensions().get::<Arc<Outbox>>().cloned(),
            ) {
                (Some(Transport::Http), outbox) => {
                    // The request took its place once its body was read. It keeps it
                    // unless the method mostly waits, or its answer must wait for the
                    // server to hold less: then it waits holding nothing.
                    let reserved = large.and_then(|n| rules.try_reserve(n, metered));
                    let waits = large.is_some() && reserved.is_none() && outbox.is_some();
                    let holds = request.extensions().get::<LargeWait>().is_some();
                    if (!metered && !holds) || waits {
                        if let Some(place) = request.extensions().get::<Place>() {
                            place.give_back();
                        }
                    }
                    let turns = rules.turns(metered);
                    let _making = match (reserved, large, &outbox) {
                        (Some(making), _, _) => Some(making),
                        (None, Some(n), Some(outbox)) => {
                            Some(outbox.reserve_in_all(n, turns).await)
                        }
                        _ => None,
                    };
                    if waits {
                        rules.placed(&inner, request, metered).await
                    } else {
                        inner.call(request).await
                    }
                }
                (Some(Transport::WebSocket), Some(outbox)) => {
                    // Frames already read wait here for their connection's slot, not
                    // among everyone's calls for a place.
                    let slot = outbox.slot().await;
                    // Calls already read run only while their connection has room: a
                    // peer that reads nothing holds `max_queued_bytes` and one answer
                    // in the making, not one answer per slot.
                    outbox.room().await;
                    let making = match large {
                        Some(n) => Some(outbox.reserve_in_all(n, rules.turns(metered)).await),
                        None => None,
                    };
                    let response = rules.placed(&inner, request, metered).await;
                    outbox.respond(response.as_json().get().len(), slot);
                    drop(making);
                    response
                }
                _ => inner.call(request).await,
            };
            if response.is_success() {
                rules.answered(&method, response.as_json().get().len());
            }
            response
        }
    }

    /// A batch runs its calls one after another, as the calls alone would: each metered
    /// call takes a place for as long as it runs (over HTTP the request's place serves
    /// them, unless the batch also holds a call that mostly waits: then it gives that
    /// place back). It lets other tasks run between its calls, stops once its
    /// connection has ended, and its answer stops growing at `max_batch_response_bytes`:
    /// past that the batch is answered with one error and its remaining calls are not
    /// run. Over WebSocket a batch holds one of its connection's slots until its answer
    /// is written, and a connection's batches that run metered calls are built one at
    /// a time, so one connection holds at most one batch answer in the making.
    fn batch<'a>(
        &self,
        mut requests: Batch<'a>,
    ) -> impl Future<Output = MethodResponse> + Send + 'a {
        let inner = self.inner.clone();
        let rules = self.rules.clone();
        async move {
            let transport = requests.extensions().get::<Transport>().copied();
            let outbox = requests.extensions().get::<Arc<Outbox>>().cloned();
            for entry in requests.iter_mut() {
                if let Ok(BatchEntry::Call(call)) = entry {
                    let refusal = rules
                        .refusal(call.method_name(), transport)
                        .or_else(|| rules.batch_refusal(call.method_name()));
                    if let Some(e) = refusal {
                        *entry = Err(BatchEntryErr::new(call.id().into_owned(), e));
                    }
                }
            }
            // Entries that get an answer: calls, and entries refused as they are.
            let answered = requests
                .iter()
                .filter(|entry| !matches!(entry, Ok(BatchEntry::Notification(_))))
                .count();
            let is_metered = |entry: &Result<BatchEntry<'_>, BatchEntryErr<'_>>| {
                matches!(entry, Ok(BatchEntry::Call(call))
                    if !rules.unmetered.contains(call.method_name()))
            };
            let metered = requests.iter().any(is_metered);
            let waits = requests
                .iter()
                .any(|entry| matches!(entry, Ok(BatchEntry::Call(_))) && !is_metered(entry));
            // A call whose answers have been large counts them before it runs, and may
            // have to wait for that (see the loop): the batch waits holding no place.
            let large = requests.iter().any(|entry| {
                matches!(entry, Ok(BatchEntry::Call(call)) if rules.large(call.method_name()).is_some())
            });
            // While the server holds more than `max_queued_bytes_total`, a batch would
            // only add to it: it starts once the server holds less, waiting with nothing.
            let crowded = metered && rules.backlog.over();
            // Over HTTP the request took its place once its body was read. It serves
            // the batch's calls, unless one of them mostly waits (a batch must not hold
            // a place for as long as its waits run) or the batch must wait to start:
            // then its calls take places of their own, as over WebSocket.
            let holds = requests.extensions().get::<LargeWait>().is_some();
            let own_places = match transport {
                Some(Transport::Http) => {
                    if (!metered || waits || crowded || large) && !holds {
                        if let Some(place) = requests.extensions().get::<Place>() {
                            place.give_back();
                        }
                    }
                    waits || crowded || large
                }
                _ => true,
            };
            if crowded {
                if let Some(outbox) = &outbox {
                    outbox.room_in_all().await;
                }
            }
            // Over WebSocket the batch's slot among its connection's: `Some` then.
            let slot = match (transport, &outbox) {
                (Some(Transport::WebSocket), Some(outbox)) => Some(outbox.slot().await),
                _ => None,
            };
            let turn = match (&slot, &outbox) {
                (Some(_), Some(outbox)) if metered => {
                    let turn = outbox.batches.lock().await;
                    outbox.room().await;
                    Some(turn)
                }
                _ => None,
            };
            let mut answer = BatchResponseBuilder::new_with_limit(rules.max_batch_response);
            let mut making = Making::counted(&rules.backlog, 0);
            let mut notified = false;
            let mut stopped = None;
            let mut run = 0;
            for entry in requests {
                if outbox.as_ref().is_some_and(|o| o.ended()) {
                    // No one will read the answer: the rest is not worth running.
                    stopped = Some(MethodResponse::notification());
                    break;
                }
                if making.bytes > 0 && rules.backlog.over() {
                    stopped = Some(over_bound(&rules, run + 1, answered, making.bytes));
                    break;
                }
                let mut method = None;
                let mut reserved = None;
                if let (Ok(BatchEntry::Call(call)), Some(outbox)) = (&entry, &outbox) {
                    if let Some(n) = rules.large(call.method_name()) {
                        let turns = rules.turns(!rules.unmetered.contains(call.method_name()));
                        if making.bytes == 0 {
                            reserved = Some(outbox.reserve_in_all(n, turns).await);
                        } else if let Some(later) =
                            later_reservation(&rules.backlog, n, turns).await
                        {
                            reserved = Some(later);
                        } else {
                            stopped = Some(over_bound(&rules, run + 1, answered, making.bytes));
                            break;
                        }
                    }
                }
                let response = match entry {
                    Ok(BatchEntry::Call(call)) => {
                        let metered = own_places && !rules.unmetered.contains(call.method_name());
                        method = Some(call.method.clone());
                        rules.placed(&inner, call, metered).await
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
                let bytes = response.as_json().get().len();
                drop(reserved);
                if let (Some(method), true) = (method, response.is_success()) {
                    rules.answered(&method, bytes);
                }
                if answer.append(response).is_err() {
                    stopped = Some(too_big_batch(format!(
                        "the answer to this batch grew past {} bytes at call {} of its \
                         {answered}, so the rest were not run; send fewer calls in a batch",
                        rules.max_batch_response,
                        run + 1
                    )));
                    break;
                }
                making.grow(bytes);
                run += 1;
                tokio::task::coop::consume_budget().await;
            }
            let response = match stopped {
                Some(refused) => refused,
                None if answer.is_empty() && notified => MethodResponse::notification(),
                None => MethodResponse::from_batch(answer.finish()),
            };
            let response = marked(response);
            // Handed over below: counted as the connection's from now on.
            drop(making);
            drop(turn);
            if let (Some(slot), Some(outbox)) = (slot, &outbox) {
                // Nothing is written for a batch of notifications only: its slot is
                // given back now, not when bytes that never come are written.
                let bytes = if response.is_notification() {
                    0
                } else {
                    response.as_json().get().len()
                };
                outbox.respond(bytes, slot);
            }
            response
        }
    }

    fn notification<'a>(
        &self,
        n: Notification<'a>,
    ) -> impl Future<Output = MethodResponse> + Send + 'a {
        let inner = self.inner.clone();
        async move { marked(inner.notification(n).await) }
    }
}

/// When a connection's peer last sent a byte.
#[derive(Clone)]
struct Activity {
    start: tokio::time::Instant,
    /// Milliseconds after `start` of the last read.
    last_ms: Arc<std::sync::atomic::AtomicU64>,
}

impl Activity {
    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn touch(&self) {
        self.last_ms
            .store(self.now_ms(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Resolves once nothing has moved for `timeout`.
    async fn idle_for(&self, timeout: Duration) {
        loop {
            let last = self.last_ms.load(std::sync::atomic::Ordering::Relaxed);
            let deadline = self.start + Duration::from_millis(last) + timeout;
            tokio::time::sleep_until(deadline).await;
            if self.last_ms.load(std::sync::atomic::Ordering::Relaxed) == last {
                return;
            }
        }
    }
}

/// Where a WebSocket connection's reader is among the frames its client sends, counted
/// from the first byte after the upgrade request's head. soketto sets aside a data
/// frame's whole payload (up to the message limit) as soon as it has the frame's header,
/// before a byte of the payload has come, so the reader hands on the last part of a
/// header (its mask) that makes a message larger than [`SMALL_BODY`] only once the
/// connection holds one of the [`LARGE_BODIES_AT_ONCE`] reads of large bodies: 14 bytes
/// of a client no longer make the agent set aside 16 MiB.
#[derive(Default)]
struct Frames {
    /// The current frame's header up to its payload length (at most 10 bytes: the
    /// first two and an extended length), as far as it has come.
    head: [u8; 10],
    /// Bytes of `head` come; 0 at a frame's start.
    seen: usize,
    /// Bytes of the current frame still to come after `head`: its mask and payload.
    rest: u64,
    /// Payload of the message being received: of its data frames so far.
    message: u64,
    /// Whether the current frame ends its message (a final data frame).
    ends_message: bool,
    /// Whether it stopped at a header that needs a read of a large body.
    stopped: bool,
    /// Whether the current frame is a data frame (not a ping, pong or close).
    data_frame: bool,
    /// Whether the message being received is text, which must be UTF-8 (RFC 6455, 8.1).
    text: bool,
    /// The current frame's mask, and how far into its mask and payload the frame is.
    mask: [u8; 4],
    at: u64,
    /// The end of a text message's payload so far that may begin a character.
    carry: [u8; 3],
    carried: usize,
}

/// What [`Frames::pass`] found in the bytes it was given.
#[derive(Debug, Default, PartialEq, Eq)]
struct Passed {
    /// Bytes that may be handed on.
    bytes: usize,
    /// Of them, bytes of data frames after their headers (with their masks).
    data: u64,
    /// Whether it stopped at a header that makes its message large, which may be
    /// handed on further only with a read of a large body.
    needs_read: bool,
    /// Whether a message ended within the bytes passed (a read held for it may go).
    message_ended: bool,
    /// Whether it stopped at the header of a frame without a mask, which a client must
    /// not send (RFC 6455, 5.1) and whose payload soketto would set aside at once: the
    /// connection fails.
    unmasked: bool,
    /// Whether a text message is not UTF-8: the connection fails, closed with 1007.
    not_utf8: bool,
}

impl Frames {
    /// The header's length up to its payload length, once its second byte has come.
    fn head_len(&self) -> Option<usize> {
        (self.seen >= 2).then(|| match self.head[1] & 0x7f {
            126 => 4,
            127 => 10,
            _ => 2,
        })
    }

    /// Whether the message being received is larger than [`SMALL_BODY`].
    fn large(&self) -> bool {
        self.message > SMALL_BODY
    }

    /// How many of `bytes` (next in the stream) may be handed on, `holding` a read of
    /// a large body or not: all of them, unless a header among them makes its message
    /// large, then up to that header's payload length (its mask, and the payload, wait).
    /// It stops where a message ends too, so that a read held for that message is given
    /// back before the next one is looked at.
    fn pass(&mut self, bytes: &[u8], holding: bool) -> Passed {
        if self.stopped {
            if !holding {
                return Passed {
                    needs_read: true,
                    ..Passed::default()
                };
            }
            self.stopped = false;
        }
        let mut passed = Passed::default();
        while passed.bytes < bytes.len() {
            if self.rest > 0 {
                let left = bytes.len() - passed.bytes;
                let take = left.min(usize::try_from(self.rest).unwrap_or(usize::MAX));
                if self.data_frame && self.text && !self.utf8(&bytes[passed.bytes..][..take]) {
                    return Passed {
                        not_utf8: true,
                        ..Passed::default()
                    };
                }
                passed.bytes += take;
                if self.data_frame {
                    passed.data += take as u64;
                }
                self.rest -= take as u64;
                if self.rest == 0 && self.ends_message && self.text && self.carried > 0 {
                    // The message ends within a character.
                    return Passed {
                        not_utf8: true,
                        ..Passed::default()
                    };
                }
                if self.rest == 0 && self.frame_ended() {
                    passed.message_ended = true;
                    return passed;
                }
                continue;
            }
            if self.seen < self.head.len() {
                self.head[self.seen] = bytes[passed.bytes];
            }
            self.seen += 1;
            passed.bytes += 1;
            if self.head_len() != Some(self.seen) {
                continue;
            }
            // The header is whole up to its payload length: the mask follows.
            if self.head[1] & 0x80 == 0 {
                // Without a mask the header is whole already: none of it goes on.
                return Passed {
                    unmasked: true,
                    ..Passed::default()
                };
            }
            let payload = match self.seen {
                4 => u64::from(u16::from_be_bytes([self.head[2], self.head[3]])),
                10 => {
                    let mut length = [0; 8];
                    length.copy_from_slice(&self.head[2..10]);
                    u64::from_be_bytes(length)
                }
                _ => u64::from(self.head[1] & 0x7f),
            };
            self.data_frame = self.head[0] & 0x08 == 0;
            self.at = 0;
            match self.head[0] & 0x0f {
                0x1 => self.text = true,
                0x2 => self.text = false,
                _ => {}
            }
            if self.data_frame {
                self.message = self.message.saturating_add(payload);
                self.ends_message = self.head[0] & 0x80 != 0;
            } else {
                self.ends_message = false;
            }
            self.seen = 0;
            self.rest = payload.saturating_add(4);
            if self.data_frame && self.large() && !holding {
                self.stopped = true;
                passed.needs_read = true;
                return passed;
            }
        }
        passed
    }

    /// Whether `bytes` of the current (text) frame, after its header's length, keep its
    /// message UTF-8 so far (a character may go on in the next bytes).
    fn utf8(&mut self, bytes: &[u8]) -> bool {
        let mut plain = [0; 256];
        let mut bytes = bytes;
        while !bytes.is_empty() {
            while self.at < 4 && !bytes.is_empty() {
                self.mask[self.at as usize] = bytes[0];
                self.at += 1;
                bytes = &bytes[1..];
            }
            let carried = self.carried;
            plain[..carried].copy_from_slice(&self.carry[..carried]);
            let take = bytes.len().min(plain.len() - carried);
            for (i, (plain, byte)) in plain[carried..].iter_mut().zip(&bytes[..take]).enumerate() {
                *plain = byte ^ self.mask[(self.at as usize - 4 + i) % 4];
            }
            self.at += take as u64;
            bytes = &bytes[take..];
            self.carried = 0;
            if let Err(e) = std::str::from_utf8(&plain[..carried + take]) {
                if e.error_len().is_some() {
                    return false;
                }
                let tail = &plain[e.valid_up_to()..carried + take];
                self.carry[..tail.len()].copy_from_slice(tail);
                self.carried = tail.len();
            }
        }
        true
    }

    /// The current frame has come whole; whether that ended its message.
    fn frame_ended(&mut self) -> bool {
        if self.ends_message {
            self.ends_message = false;
            self.message = 0;
            true
        } else {
            false
        }
    }
}

/// Bytes read ahead from a WebSocket connection's stream, so that the [`Frames`] in
/// them can be looked at before they are handed on.
const GATE_STASH: usize = 16 * 1024;

/// A WebSocket connection's reads, through its [`Frames`]: a message larger than
/// [`SMALL_BODY`] is handed on only while the connection holds one of the
/// [`LARGE_BODIES_AT_ONCE`] reads of large bodies (shared with HTTP bodies), taken at
/// the header that makes it large and given back where it ends. While it is held, the
/// message's data must come at [`LARGE_BODY_RATE`] or faster after [`LARGE_BODY_GRACE`]
/// (the time the connection is not read because its calls fill it does not count), and
/// it is held [`LARGE_READ_HOLD`] at most; else the connection fails.
struct Gate {
    frames: Frames,
    stash: Box<[u8]>,
    /// Bytes of `stash` read from the stream, and of them handed on.
    stashed: usize,
    handed: usize,
    reads: tokio_util::sync::PollSemaphore,
    read: Option<OwnedSemaphorePermit>,
    /// While `read` is held: when it was taken, when its pace began (later by the time
    /// the connection was full), the message's data handed on since, since when the
    /// connection is full, and the deadline by which more must have come.
    taken: tokio::time::Instant,
    paced_from: tokio::time::Instant,
    since: u64,
    full_since: Option<tokio::time::Instant>,
    pace: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The status code the connection's close frame gives, once the frames failed it.
    close_code: Option<u16>,
}

/// The longest a WebSocket connection holds a read of a large body for one message.
pub const LARGE_READ_HOLD: Duration = Duration::from_secs(30);

impl Gate {
    fn new(reads: Arc<Semaphore>) -> Gate {
        let now = tokio::time::Instant::now();
        Gate {
            frames: Frames::default(),
            stash: vec![0; GATE_STASH].into_boxed_slice(),
            stashed: 0,
            handed: 0,
            reads: tokio_util::sync::PollSemaphore::new(reads),
            read: None,
            taken: now,
            paced_from: now,
            since: 0,
            full_since: None,
            pace: None,
            close_code: None,
        }
    }

    /// When the message being read must have come as far as it has by: the pace of
    /// large bodies from when its read was taken (while the connection is full, only
    /// the bound on holding a read).
    fn deadline(&self) -> tokio::time::Instant {
        let held = self.taken + LARGE_READ_HOLD;
        if self.full_since.is_some() {
            return held;
        }
        let paced = self.paced_from
            + LARGE_BODY_GRACE
            + Duration::from_secs_f64(self.since as f64 / LARGE_BODY_RATE as f64);
        paced.min(held)
    }

    fn reset_pace(&mut self) {
        let deadline = self.deadline();
        if let Some(pace) = &mut self.pace {
            pace.as_mut().reset(deadline);
        }
    }

    /// Whether the connection is full (its calls fill it, so it is not read): the pace
    /// waits meanwhile, holding the read no longer than [`LARGE_READ_HOLD`].
    fn full(&mut self, full: bool) {
        if self.read.is_none() || full == self.full_since.is_some() {
            return;
        }
        let now = tokio::time::Instant::now();
        match self.full_since.take() {
            Some(since) => self.paced_from += now - since,
            None => self.full_since = Some(now),
        }
        self.reset_pace();
    }

    /// Hands on what may go of the stash into `buf`: `Ready` once something went (or
    /// `buf` has no room), `Pending` while it waits for a read of a large body, `None`
    /// once the stash is all handed on.
    fn hand_on(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Option<Poll<io::Result<()>>> {
        loop {
            if self.handed == self.stashed {
                return None;
            }
            if buf.remaining() == 0 {
                return Some(Poll::Ready(Ok(())));
            }
            let room = (self.stashed - self.handed).min(buf.remaining());
            let bytes = &self.stash[self.handed..self.handed + room];
            let passed = self.frames.pass(bytes, self.read.is_some());
            if passed.unmasked {
                return Some(Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a client sent a WebSocket frame without a mask (RFC 6455, 5.1); closed",
                ))));
            }
            if passed.not_utf8 {
                self.close_code = Some(1007);
                return Some(Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a client sent a WebSocket text message that is not UTF-8 (RFC 6455, 8.1); \
                     closed with 1007",
                ))));
            }
            buf.put_slice(&bytes[..passed.bytes]);
            self.handed += passed.bytes;
            if self.read.is_some() && passed.data > 0 {
                self.since += passed.data;
                self.reset_pace();
            }
            if passed.message_ended {
                self.read = None;
                self.pace = None;
            }
            if passed.bytes > 0 {
                return Some(Poll::Ready(Ok(())));
            }
            if passed.needs_read {
                match self.reads.poll_acquire(cx) {
                    Poll::Ready(Some(read)) => {
                        self.read = Some(read);
                        self.taken = tokio::time::Instant::now();
                        self.paced_from = self.taken;
                        self.since = 0;
                        self.full_since = None;
                        self.pace = Some(Box::pin(tokio::time::sleep_until(self.deadline())));
                    }
                    Poll::Ready(None) => {
                        return Some(Poll::Ready(Err(io::Error::other("the server is stopping"))))
                    }
                    Poll::Pending => return Some(Poll::Pending),
                }
            }
        }
    }

    /// With nothing come from the stream: the error that fails the connection if the
    /// message being read has fallen behind the pace of large bodies, or held its read
    /// for [`LARGE_READ_HOLD`].
    fn late(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        let pace = self.pace.as_mut()?;
        pace.as_mut().poll(cx).is_ready().then(|| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "a WebSocket message larger than {} KiB came slower than {} KiB/s after \
                     its first {}s, or held its read of a large body for {}s ({} bytes of it \
                     came); closed",
                    SMALL_BODY / 1024,
                    LARGE_BODY_RATE / 1024,
                    LARGE_BODY_GRACE.as_secs_f64(),
                    LARGE_READ_HOLD.as_secs(),
                    self.since
                ),
            )
        })
    }
}

/// How far a connection's stream has been read as HTTP, and where the head of its first
/// request ended (0 until then): a WebSocket may be opened only by a connection's first
/// request with nothing read past its head, so that its [`Frames`] are seen from their
/// first byte (RFC 6455, 4.1: a client sends no frame before the server's 101).
#[derive(Default)]
struct HeadMark {
    read: std::sync::atomic::AtomicU64,
    end: std::sync::atomic::AtomicU64,
}

impl HeadMark {
    /// Whether the stream has been read up to the end of the first request's head and
    /// no further.
    fn at_first_head_end(&self) -> bool {
        let end = self.end.load(std::sync::atomic::Ordering::Relaxed);
        end != 0 && self.read.load(std::sync::atomic::Ordering::Relaxed) == end
    }
}

/// A connection's stream, watched: reads and writes feed its [`Activity`] and
/// [`Outbox`], a WebSocket connection whose outbox is full is not read, and a write
/// the peer leaves waiting for `stall_timeout` fails the connection. The stream does
/// this itself because an upgraded connection is served by a task jsonrpsee spawns.
struct Watched<S> {
    inner: S,
    activity: Activity,
    outbox: Arc<Outbox>,
    /// Set once the connection turned into a WebSocket: only then is reading held
    /// back (an HTTP connection has one response at a time anyway).
    websocket: Arc<std::sync::atomic::AtomicBool>,
    stall_timeout: Option<Duration>,
    /// Runs while a write waits for the peer; reset by any write that goes through.
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Bytes in the socket that the peer had not read when `stall` was last set.
    unread_at_stall: Option<u32>,
    /// Where the first request's head ended, for the WebSocket upgrade, and the last
    /// four bytes read until then.
    mark: Arc<HeadMark>,
    last_four: u32,
    /// The reads of large bodies, and the connection's [`Gate`] once it is a WebSocket.
    large_reads: Arc<Semaphore>,
    gate: Option<Gate>,
}

impl<S> Watched<S> {
    fn new(
        inner: S,
        outbox: Arc<Outbox>,
        stall_timeout: Option<Duration>,
        large_reads: Arc<Semaphore>,
    ) -> (Watched<S>, Activity) {
        let activity = Activity {
            start: tokio::time::Instant::now(),
            last_ms: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        };
        (
            Watched {
                inner,
                activity: activity.clone(),
                outbox,
                websocket: Arc::new(std::sync::atomic::AtomicBool::new(false)),
                stall_timeout,
                stall: None,
                unread_at_stall: None,
                mark: Arc::new(HeadMark::default()),
                last_four: 0,
                large_reads,
                gate: None,
            },
            activity,
        )
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.outbox.failed() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the connection's writes failed or stalled",
            )));
        }
        let websocket = self.websocket.load(std::sync::atomic::Ordering::Relaxed);
        if websocket {
            let full = self.outbox.full(cx.waker());
            if let Some(gate) = &mut self.gate {
                gate.full(full);
            }
            if full {
                // A message that holds a read of a large body holds it no longer than
                // its bound: a connection that keeps itself full (16 calls that wait)
                // does not keep it.
                if let Some(e) = self.gate.as_mut().and_then(|gate| gate.late(cx)) {
                    return Poll::Ready(Err(e));
                }
                return Poll::Pending;
            }
            return self.poll_gated(cx, buf);
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
            let this = &mut *self;
            this.saw(&buf.filled()[before..]);
        } else if matches!(polled, Poll::Ready(_)) && buf.remaining() > 0 {
            // The end of the stream (or an error): the peer is gone or half-closed.
            self.outbox.peer_closed();
        }
        if polled.is_pending() {
            self.outbox.reading(cx.waker());
        }
        polled
    }
}

impl<S: tokio::io::AsyncRead + Unpin> Watched<S> {
    /// Notes where the first request's head ends among bytes read as HTTP.
    fn saw(&mut self, bytes: &[u8]) {
        let relaxed = std::sync::atomic::Ordering::Relaxed;
        // Only this stream reads and writes the count: the other side only loads it.
        let before = self.mark.read.fetch_add(bytes.len() as u64, relaxed);
        if self.mark.end.load(relaxed) == 0 {
            for (i, &byte) in bytes.iter().enumerate() {
                self.last_four = self.last_four << 8 | u32::from(byte);
                // An empty line ends the head; hyper takes a bare `\n` as a line's end
                // too (`\n\n`, `\r\n\n`, `\n\r\n`, `\r\n\r\n`).
                if self.last_four & 0xffff == 0x0a0a || self.last_four & 0xff_ffff == 0x0a_0d0a {
                    self.mark.end.store(before + i as u64 + 1, relaxed);
                    break;
                }
            }
        }
    }

    /// Reads a WebSocket connection through its [`Gate`].
    fn poll_gated(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        let reads = &self.large_reads;
        let gate = self.gate.get_or_insert_with(|| Gate::new(reads.clone()));
        loop {
            if let Some(handed) = gate.hand_on(cx, buf) {
                if handed.is_pending() {
                    // Waiting for a read of a large body: a failed connection wakes it.
                    self.outbox.reading(cx.waker());
                }
                return handed;
            }
            let mut stash = tokio::io::ReadBuf::new(&mut gate.stash);
            let polled = Pin::new(&mut self.inner).poll_read(cx, &mut stash);
            let read = stash.filled().len();
            match polled {
                Poll::Ready(Ok(())) if read > 0 => {
                    self.activity.touch();
                    gate.stashed = read;
                    gate.handed = 0;
                }
                Poll::Ready(ended) => {
                    // The end of the stream (or an error): the peer is gone or half-closed.
                    self.outbox.peer_closed();
                    return Poll::Ready(ended);
                }
                Poll::Pending => {
                    self.outbox.reading(cx.waker());
                    return match gate.late(cx) {
                        Some(e) => Poll::Ready(Err(e)),
                        None => Poll::Pending,
                    };
                }
            }
        }
    }
}

nix::ioctl_read_bad!(socket_unread, nix::libc::TIOCOUTQ, nix::libc::c_int);

/// Bytes written to the socket `fd` that its peer has not read yet (`SIOCOUTQ`: for a
/// Unix socket, what its peer's receive queue holds of them).
fn unread_bytes(fd: &impl std::os::fd::AsRawFd) -> Option<u32> {
    let mut unread: nix::libc::c_int = 0;
    // SAFETY: TIOCOUTQ writes one c_int to the pointer, which points at `unread`.
    unsafe { socket_unread(fd.as_raw_fd(), &mut unread) }.ok()?;
    u32::try_from(unread).ok()
}

impl<S> Watched<S>
where
    S: std::os::fd::AsRawFd,
{
    /// Whether the peer read some of what waits in the socket since the stall timer was
    /// set: the kernel wakes a blocked writer only once much of the socket's buffer has
    /// drained, so a peer reading slowly but steadily can leave a write waiting longer
    /// than the stall timeout. If so, the timer starts again from now.
    fn peer_read_since_stall(&mut self) -> bool {
        let now = unread_bytes(&self.inner);
        let read = matches!((self.unread_at_stall, now), (Some(before), Some(now)) if now < before);
        self.unread_at_stall = now;
        read
    }
}

impl<S: tokio::io::AsyncWrite + std::os::fd::AsRawFd + Unpin> tokio::io::AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        // soketto closes with 1000 (normal) whatever failed the connection: the close
        // frame says why when the frames failed it (RFC 6455, 7.4.1).
        let close;
        let data = match self.gate.as_ref().and_then(|gate| gate.close_code) {
            Some(code) if data.starts_with(&[0x88, 0x02, 0x03, 0xe8]) => {
                let [high, low] = code.to_be_bytes();
                close = [0x88, 0x02, high, low];
                &close[..]
            }
            _ => data,
        };
        // Only what the peer sends counts as activity: a client that sends nothing is
        // idle even while the server is still writing to it.
        let polled = Pin::new(&mut self.inner).poll_write(cx, data);
        match &polled {
            Poll::Pending => {
                if let Some(timeout) = self.stall_timeout {
                    if self.stall.is_none() {
                        self.stall = Some(Box::pin(tokio::time::sleep(timeout)));
                        self.unread_at_stall = unread_bytes(&self.inner);
                    }
                    let mut stalled = self
                        .stall
                        .as_mut()
                        .is_some_and(|stall| stall.as_mut().poll(cx).is_ready());
                    if stalled && self.peer_read_since_stall() {
                        if let Some(stall) = self.stall.as_mut() {
                            stall.as_mut().reset(tokio::time::Instant::now() + timeout);
                            stalled = stall.as_mut().poll(cx).is_ready();
                        }
                    }
                    if stalled {
                        tracing::debug!("closed a connection whose peer stopped reading");
                        self.outbox.fail();
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the peer read nothing of what waited for it",
                        )));
                    }
                }
            }
            Poll::Ready(Ok(n)) => {
                self.stall = None;
                self.outbox.wrote(*n);
            }
            Poll::Ready(Err(_)) => self.outbox.fail(),
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Decides, before any request is read, whether a connection may be served.
pub trait Admission: Send + Sync + 'static {
    /// Held for as long as the admitted connection is served (a slot of a limit, say).
    type Ticket: Send + 'static;
    fn admit(&self, stream: &UnixStream) -> Result<Self::Ticket, Refusal>;
}

/// Why a connection is not served: the peer gets `status` and a JSON-RPC error object
/// with `message` (see [`answer_refused`]) instead of a bare close, so it can act on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// 403 (not allowed) or 429 (over a connection limit).
    pub status: hyper::StatusCode,
    /// The JSON-RPC error code of the body.
    pub code: i32,
    pub message: String,
}

/// Admits every connection: the socket's file mode is the only gate.
pub struct AdmitAll;

impl Admission for AdmitAll {
    type Ticket = ();
    fn admit(&self, _stream: &UnixStream) -> Result<(), Refusal> {
        Ok(())
    }
}

/// Serves `methods` on `listener` until `shutdown` resolves, then drains. Every call
/// passes through [`Guard`], then `rpc_middleware` (`RpcServiceBuilder::new()` for none).
pub async fn serve<L>(
    listener: UnixListener,
    methods: impl Into<Methods>,
    config: ServeConfig,
    rpc_middleware: RpcServiceBuilder<L>,
    admission: impl Admission,
    shutdown: impl Future<Output = ()>,
) where
    L: tower::Layer<Guard<RpcService>> + Clone + Send + Sync + 'static,
    L::Service: RpcServiceT<
            MethodResponse = MethodResponse,
            BatchResponse = MethodResponse,
            NotificationResponse = MethodResponse,
        > + Send
        + Sync
        + 'static,
{
    let methods: Methods = methods.into();
    let places = Arc::new(Semaphore::new(config.max_calls_in_flight.max(1)));
    let rules = Arc::new(Rules {
        methods: methods.clone(),
        places: places.clone(),
        unmetered: config.unmetered_methods.iter().cloned().collect(),
        listings: config.listing_methods.iter().cloned().collect(),
        max_batch_response: config.max_batch_response_bytes as usize,
        backlog: Arc::new(Backlog::new(config.max_queued_bytes_total)),
        large: Mutex::new(std::collections::HashMap::new()),
        any_large: std::sync::atomic::AtomicBool::new(false),
        making: Arc::new(Semaphore::new(LARGE_MAKING_AT_ONCE)),
    });
    let backlog = rules.backlog.clone();
    let guarded = rpc_middleware.layer_fn(move |inner| Guard {
        inner,
        rules: rules.clone(),
    });
    let server_config = ServerConfig::builder()
        .max_request_body_size(config.max_request_body_size)
        .max_response_body_size(config.max_response_body_size)
        .max_connections(config.max_connections)
        .build();
    let builder = jsonrpsee::server::Server::builder()
        .set_config(server_config)
        .set_rpc_middleware(guarded)
        .to_service_builder();
    let shared = Arc::new(Shared {
        page: config.metrics.clone(),
        max_body: config.max_request_body_size,
        places,
        large_bodies: Arc::new(Semaphore::new(LARGE_BODIES_AT_ONCE)),
        body_timeout: config.request_body_timeout,
        unmetered: config.unmetered_methods.iter().cloned().collect(),
    });
    let (stop_handle, server_handle) = stop_channel();
    let connections = TaskTracker::new();
    let refusals = Refusals::new();
    let accept_errors = LogThrottle::default();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors or similar: keep serving the connections we
                    // have, and try again shortly rather than spinning.
                    accept_errors.log("accepting connections failed", || {
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
                refusals.answer(stream, refusal);
                continue;
            }
        };
        // Read once per connection: what the kernel recorded when the peer connected.
        let caller = stream.peer_cred().ok().map(|cred| crate::types::Caller {
            uid: cred.uid(),
            pid: cred.pid().unwrap_or(0),
        });
        let outbox = Arc::new(Outbox::new(
            config.max_queued_bytes,
            config.max_calls_per_connection,
            backlog.clone(),
        ));
        let (stream, activity) = Watched::new(
            stream,
            outbox.clone(),
            config.write_stall_timeout,
            shared.large_bodies.clone(),
        );
        let websocket = stream.websocket.clone();
        let mark = stream.mark.clone();
        let first = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let rpc = builder.clone().build(methods.clone(), stop_handle.clone());
        let shared = shared.clone();
        let service = tower::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let first = first.swap(false, std::sync::atomic::Ordering::Relaxed);
            let mut upgrade = Upgrade::No;
            if jsonrpsee::server::ws::is_upgrade_request(&request) {
                let headers = request.headers();
                let body = headers.contains_key(hyper::header::TRANSFER_ENCODING)
                    || declared_length(headers).is_some_and(|length| length > 0);
                upgrade = if first && !body && mark.at_first_head_end() {
                    websocket.store(true, std::sync::atomic::Ordering::Relaxed);
                    Upgrade::Yes
                } else {
                    Upgrade::Refused
                };
            }
            route(
                request,
                upgrade,
                rpc.clone(),
                shared.clone(),
                outbox.clone(),
                caller,
            )
        });
        let stopped = stop_handle.clone().shutdown();
        let idle_timeout = config.idle_timeout;
        connections.spawn(async move {
            let _ticket = ticket;
            let served = serve_with_graceful_shutdown(stream, service, stopped);
            let idle = async {
                match idle_timeout {
                    Some(timeout) => activity.idle_for(timeout).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                result = served => if let Err(e) = result {
                    tracing::debug!(error = %e, "connection ended with an error");
                },
                _ = idle => tracing::debug!("closed an idle connection"),
            }
        });
    }
    drop(listener);
    let _ = server_handle.stop();
    connections.close();
    connections.wait().await;
}

/// A log line that can repeat once per failure (a descriptor error, a refused peer):
/// the first [`LogThrottle::PER_WINDOW`] of every [`LogThrottle::WINDOW`] are logged,
/// then one line says how many were not, so a peer cannot flood the log.
pub struct LogThrottle {
    state: Mutex<(std::time::Instant, u32, u32)>,
}

impl Default for LogThrottle {
    fn default() -> Self {
        LogThrottle::starting(std::time::Instant::now())
    }
}

impl LogThrottle {
    pub const PER_WINDOW: u32 = 20;
    pub const WINDOW: Duration = Duration::from_secs(10);

    /// A throttle whose first window opens at `start`.
    pub fn starting(start: std::time::Instant) -> LogThrottle {
        LogThrottle {
            state: Mutex::new((start, 0, 0)),
        }
    }

    /// Whether this occurrence gets its own line, and how many occurrences the window
    /// that just ended left unlogged (for the caller to say in one line).
    pub fn note(&self, now: std::time::Instant) -> (bool, u32) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (start, logged, unlogged) = &mut *state;
        let mut ended_unlogged = 0;
        if now.duration_since(*start) >= Self::WINDOW {
            ended_unlogged = *unlogged;
            (*start, *logged, *unlogged) = (now, 0, 0);
        }
        if *logged < Self::PER_WINDOW {
            *logged += 1;
            (true, ended_unlogged)
        } else {
            *unlogged += 1;
            (false, ended_unlogged)
        }
    }

    /// Logs with `line` within the budget, and the count of what the last window left
    /// out as a warning `what`.
    pub fn log(&self, what: &str, line: impl FnOnce()) {
        let (own_line, unlogged) = self.note(std::time::Instant::now());
        if unlogged > 0 {
            tracing::warn!(unlogged, window = ?Self::WINDOW, "{what}: more than are logged one by one");
        }
        if own_line {
            line();
        }
    }
}

/// Refused connections answered at once; past this, more are closed unanswered, so
/// refused peers cannot make the agent hold more than this many sockets and tasks.
const REFUSALS_AT_ONCE: usize = 32;
/// A refused peer has this long to send its request and take the answer.
const REFUSAL_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);
/// Bytes of a refused peer's request body read (and dropped) before answering, so a
/// small request is consumed and the close after the answer is clean.
const REFUSAL_BODY_READ: usize = 64 * 1024;

/// Answers refused connections, within [`REFUSALS_AT_ONCE`] and [`REFUSAL_DEADLINE`].
struct Refusals {
    slots: Arc<tokio::sync::Semaphore>,
}

impl Refusals {
    fn new() -> Refusals {
        Refusals {
            slots: Arc::new(tokio::sync::Semaphore::new(REFUSALS_AT_ONCE)),
        }
    }

    /// Answers `stream` with `refusal` in a task of its own, or closes it at once if
    /// too many refusals are being answered already.
    fn answer(&self, stream: UnixStream, refusal: Refusal) {
        let Ok(slot) = self.slots.clone().try_acquire_owned() else {
            tracing::debug!("closed a refused connection unanswered: too many refusals at once");
            return;
        };
        tokio::spawn(async move {
            let _slot = slot;
            if tokio::time::timeout(REFUSAL_DEADLINE, answer_refused(stream, refusal))
                .await
                .is_err()
            {
                tracing::debug!("a refused peer took too long; closed");
            }
        });
    }
}

/// The body of a refusal: a JSON-RPC error object (id null), as for a request that
/// could not be read.
fn refusal_body(refusal: &Refusal) -> String {
    let message = serde_json::Value::String(refusal.message.clone());
    format!(
        r#"{{"jsonrpc":"2.0","id":null,"error":{{"code":{},"message":{message}}}}}"#,
        refusal.code
    )
}

/// Serves one HTTP request on `stream` (any method, a WebSocket upgrade included) with
/// `refusal`'s status and body, then closes. The request head is bounded by hyper's
/// smallest buffer, the body read by [`REFUSAL_BODY_READ`]; the caller bounds the time.
async fn answer_refused(stream: UnixStream, refusal: Refusal) {
    let body = hyper::body::Bytes::from(refusal_body(&refusal));
    let status = refusal.status;
    let service =
        hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let body = body.clone();
            async move {
                use http_body_util::BodyExt;
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWrite;

    /// Sends `head` (with the body it declares, or part of it) on a new connection.
    async fn send(path: &Path, head: &str) -> UnixStream {
        use tokio::io::AsyncWriteExt;
        let mut stream = UnixStream::connect(path).await.expect("connecting");
        stream.write_all(head.as_bytes()).await.expect("writing");
        stream
    }

    /// Everything `stream` is sent until the server closes it.
    async fn read_all(mut stream: UnixStream) -> String {
        use tokio::io::AsyncReadExt;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.expect("reading");
        String::from_utf8_lossy(&answer).into_owned()
    }

    fn post(declared: usize, body: &str) -> String {
        format!(
            "POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n{body}"
        )
    }

    /// A server of four methods on a socket in `dir`: `ping`; `wait`, which never
    /// answers; `nap`, which answers after 5 s (both unmetered: they mostly wait); and
    /// `write`, which gives back its call's place, then never answers (see
    /// [`Place::leave_running`]). It stops when the sender is dropped.
    async fn pinged(
        dir: &Path,
        config: ServeConfig,
    ) -> (std::path::PathBuf, tokio::sync::oneshot::Sender<()>) {
        let (path, stop, _) = pinged_counting(dir, config).await;
        (path, stop)
    }

    /// [`pinged`], with a permit added for every `wait` or `write` that has begun.
    async fn pinged_counting(
        dir: &Path,
        config: ServeConfig,
    ) -> (
        std::path::PathBuf,
        tokio::sync::oneshot::Sender<()>,
        Arc<Semaphore>,
    ) {
        let path = dir.join("server.sock");
        let listener = bind(&path, 0o600).await.expect("binding");
        let begun = Arc::new(Semaphore::new(0));
        let mut module = jsonrpsee::RpcModule::new(begun.clone());
        module
            .register_method("ping", |_, _, _| "pong")
            .expect("registering");
        module
            .register_async_method("wait", |_, begun, _| async move {
                begun.add_permits(1);
                std::future::pending::<&str>().await
            })
            .expect("registering");
        module
            .register_async_method("nap", |_, _, _| async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                "awake"
            })
            .expect("registering");
        module
            .register_async_method("write", |_, begun, extensions| async move {
                let place = extensions.get::<Place>().cloned();
                let gave_back = place.is_some();
                if let Some(place) = place {
                    place.leave_running();
                    place.leave_running();
                }
                begun.add_permits(1);
                if gave_back {
                    std::future::pending::<()>().await;
                }
                "no place in the call's extensions"
            })
            .expect("registering");
        let config = ServeConfig {
            unmetered_methods: vec!["wait".to_string(), "nap".to_string()],
            ..config
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve(
            listener,
            module,
            config,
            RpcServiceBuilder::new(),
            AdmitAll,
            async move {
                let _ = stopped.await;
            },
        ));
        (path, stop, begun)
    }

    /// Eight peers that send part of a small body and, past the reads of large bodies
    /// at once, peers that send part of a large one; each with what its 408 says.
    async fn slow_bodies(path: &Path) -> Vec<(UnixStream, String)> {
        let mut slow = Vec::new();
        for _ in 0..8 {
            let stream = send(path, &post(200, "{")).await;
            slow.push((stream, "1 of its 200 bytes came".to_string()));
        }
        let large = SMALL_BODY as usize + 1;
        for _ in 0..LARGE_BODIES_AT_ONCE + 1 {
            let stream = send(path, &post(large, "[")).await;
            slow.push((stream, format!("1 of its {large} bytes came")));
        }
        slow
    }

    /// A call that leaves the calls running gives back its place and keeps its large
    /// body's read; giving everything back frees both.
    #[tokio::test]
    async fn leaving_the_running_calls_keeps_a_large_bodys_read() {
        let places = Arc::new(Semaphore::new(1));
        let large = Arc::new(Semaphore::new(1));
        let place = Place::new(
            places.clone().acquire_owned().await.ok(),
            large.clone().acquire_owned().await.ok(),
        );
        place.clone().leave_running();
        assert_eq!(places.available_permits(), 1);
        assert_eq!(large.available_permits(), 0, "the large body still counts");
        place.give_back();
        assert_eq!(large.available_permits(), 1);
    }

    /// Three `ping`s on `path` are answered (within 60 s each) while `meanwhile`.
    async fn pings_answered(path: &Path, meanwhile: &str) {
        let ping = r#"{"jsonrpc":"2.0","id":7,"method":"ping"}"#;
        for _ in 0..3 {
            let answer = read_all(send(path, &post(ping.len(), ping)).await);
            let answer = tokio::time::timeout(Duration::from_secs(60), answer)
                .await
                .unwrap_or_else(|_| panic!("ping was not answered while {meanwhile}"));
            assert!(answer.contains(r#""result":"pong""#), "{answer}");
        }
    }

    /// A method may give back its call's place (from the call's extensions) once it
    /// only waits: with one place, a call that gave it back and waits for good stops
    /// no one's `ping`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_method_that_gives_back_its_place_lets_others_run_while_it_waits() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = ServeConfig {
            max_calls_in_flight: 1,
            ..ServeConfig::default()
        };
        let (path, _stop, begun) = pinged_counting(dir.path(), config).await;
        let write = r#"{"jsonrpc":"2.0","id":1,"method":"write"}"#;
        let writing = send(&path, &post(write.len(), write)).await;
        begun.acquire().await.expect("the write began").forget();
        pings_answered(&path, "the write waited").await;
        let mut byte = [0; 1];
        assert!(
            matches!(writing.try_read(&mut byte), Err(e) if e.kind() == io::ErrorKind::WouldBlock),
            "the write was answered: it found no place to give back"
        );
    }

    /// A request whose body has not arrived holds no place among the calls in flight:
    /// with two places and no time limit on bodies, the peers of [`slow_bodies`] stop no
    /// one's call (before, each took a place before its body was read and held it until
    /// the idle timeout, 15 minutes in the agent).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_whose_bodies_do_not_arrive_hold_no_place() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = ServeConfig {
            max_calls_in_flight: 2,
            request_body_timeout: None,
            ..ServeConfig::default()
        };
        let (path, _stop) = pinged(dir.path(), config).await;
        let slow = slow_bodies(&path).await;
        pings_answered(&path, "the slow bodies held on").await;
        for (stream, _) in &slow {
            let mut byte = [0; 1];
            assert!(
                matches!(stream.try_read(&mut byte), Err(e) if e.kind() == io::ErrorKind::WouldBlock),
                "a slow body was answered or closed"
            );
        }
    }

    /// A request whose body has not arrived whole within the time limit is answered
    /// with 408, saying how much of its body came, and its connection closed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_whose_bodies_do_not_arrive_in_time_are_answered_408() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = ServeConfig {
            request_body_timeout: Some(Duration::from_millis(500)),
            ..ServeConfig::default()
        };
        let (path, _stop) = pinged(dir.path(), config).await;
        for (stream, said) in slow_bodies(&path).await {
            let answer = read_all(stream).await;
            assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
            assert!(answer.contains(&said), "{said} in {answer}");
        }
    }

    /// A client's final text frame of `payload`, masked.
    fn text(payload: &[u8]) -> Vec<u8> {
        let mask = [1, 2, 3, 4];
        let mut frame = frame(true, 1, payload.len());
        frame.truncate(frame.len() - payload.len());
        frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        frame
    }

    /// Opens a WebSocket on a new connection, sending `after` with the request head.
    async fn websocket(path: &Path, after: &[u8]) -> (UnixStream, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = UnixStream::connect(path).await.expect("connecting");
        let head = "GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
                    Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n";
        stream
            .write_all(&[head.as_bytes(), after].concat())
            .await
            .expect("writing");
        let mut answer = Vec::new();
        while !answer.ends_with(b"\r\n\r\n") {
            let mut byte = [0; 1];
            if stream.read(&mut byte).await.expect("reading") == 0 {
                break;
            }
            answer.push(byte[0]);
        }
        (stream, String::from_utf8_lossy(&answer).into_owned())
    }

    /// A call of `ping` larger than [`SMALL_BODY`].
    fn large_ping() -> String {
        let pad = " ".repeat(SMALL_BODY as usize);
        format!(r#"{{"jsonrpc":"2.0","id":7,"method":"ping","params":[{pad}]}}"#)
    }

    /// A client's WebSocket frame: header, mask and `len` bytes of payload.
    fn frame(fin: bool, opcode: u8, len: usize) -> Vec<u8> {
        let mut frame = vec![if fin { 0x80 } else { 0 } | opcode];
        match len {
            0..=125 => frame.push(0x80 | len as u8),
            126..=65535 => {
                frame.push(0x80 | 126);
                frame.extend_from_slice(&(len as u16).to_be_bytes());
            }
            _ => {
                frame.push(0x80 | 127);
                frame.extend_from_slice(&(len as u64).to_be_bytes());
            }
        }
        frame.extend_from_slice(&[1, 2, 3, 4]);
        frame.resize(frame.len() + len, b'x');
        frame
    }

    /// What [`Frames::pass`] passed: bytes, whether it needs a read, whether a message
    /// ended.
    fn pass(frames: &mut Frames, bytes: &[u8], holding: bool) -> (usize, bool, bool) {
        let passed = frames.pass(bytes, holding);
        assert!(!passed.unmasked);
        (passed.bytes, passed.needs_read, passed.message_ended)
    }

    /// A masked frame carrying `payload`.
    fn text_frame(fin: bool, opcode: u8, payload: &[u8]) -> Vec<u8> {
        let mut frame = frame(fin, opcode, payload.len());
        let start = frame.len() - payload.len();
        for (i, byte) in payload.iter().enumerate() {
            frame[start + i] = byte ^ [1, 2, 3, 4][i % 4];
        }
        frame
    }

    /// Whether the frames, handed to [`Frames::pass`] a byte at a time, keep their text
    /// UTF-8.
    fn utf8(frames: &[Vec<u8>]) -> bool {
        let mut passing = Frames::default();
        !frames
            .concat()
            .chunks(1)
            .any(|byte| passing.pass(byte, true).not_utf8)
    }

    /// A text message must be UTF-8 across its fragments (a character may be split
    /// between two, a ping may come between them); a binary one need not be.
    #[test]
    fn text_messages_are_checked_for_utf8_across_their_fragments() {
        let text = "{\"x\":\"é€😀\"}".as_bytes();
        let euro = text.iter().position(|&b| b == 0xe2).unwrap() + 1;
        let (first, second) = text.split_at(euro);
        let ping = text_frame(true, 9, b"\xff");
        assert!(utf8(&[
            text_frame(false, 1, first),
            ping.clone(),
            text_frame(true, 0, second)
        ]));
        assert!(
            !utf8(&[text_frame(true, 1, first)]),
            "ends within a character"
        );
        assert!(!utf8(&[
            text_frame(false, 1, first),
            text_frame(true, 0, b"x")
        ]));
        assert!(!utf8(&[text_frame(true, 1, b"\xc0\xaf")]), "overlong");
        assert!(
            !utf8(&[text_frame(true, 1, b"\xed\xa0\x80")]),
            "a surrogate"
        );
        assert!(utf8(&[text_frame(true, 2, b"\xff"), ping]));
    }

    /// Small messages pass whole, one message at a time, without a read of a large body;
    /// a frame whose header makes its message large stops where its mask begins until a
    /// read is held, and the message's end is where the read may go.
    #[test]
    fn frames_stop_at_the_header_that_makes_a_message_large() {
        let mut frames = Frames::default();
        let small = frame(true, 1, 100);
        let stream = [small.clone(), small.clone()].concat();
        assert_eq!(
            pass(&mut frames, &stream, false),
            (small.len(), false, true)
        );
        assert_eq!(
            pass(&mut frames, &stream[small.len()..], false),
            (small.len(), false, true)
        );

        let large = frame(true, 2, SMALL_BODY as usize + 1);
        assert_eq!(pass(&mut frames, &large, false), (10, true, false));
        assert_eq!(pass(&mut frames, &large[10..], false), (0, true, false));
        assert_eq!(
            pass(&mut frames, &large[10..1000], true),
            (990, false, false)
        );
        assert_eq!(
            pass(&mut frames, &large[1000..], true),
            (large.len() - 1000, false, true)
        );
        // Header bytes one at a time: the stop is at the same byte.
        let mut at = 0;
        while at < 10 {
            let (bytes, needs_read, _) = pass(&mut frames, &large[at..at + 1], false);
            at += bytes;
            assert_eq!(needs_read, at == 10, "{at}");
        }
        assert_eq!(
            pass(&mut frames, &large[10..], true),
            (large.len() - 10, false, true)
        );
        assert_eq!(pass(&mut frames, &small, false), (small.len(), false, true));
    }

    /// A frame without a mask is refused before the last byte of its header goes on;
    /// only data frames' bytes count as the message coming.
    #[test]
    fn unmasked_frames_are_refused_and_only_data_counts() {
        let mut frames = Frames::default();
        let mut unmasked = frame(true, 1, 10);
        unmasked[1] &= 0x7f;
        let refused = frames.pass(&unmasked, false);
        assert!(refused.unmasked && refused.bytes == 0, "{refused:?}");
        let mut frames = Frames::default();
        let first = frame(false, 1, 100);
        let ping = frame(true, 9, 100);
        assert_eq!(frames.pass(&first, false).data, 104);
        assert_eq!(frames.pass(&ping, false).data, 0);
    }

    /// A message's data frames add up, control frames between them do not, and a
    /// message of fragments that each are small is large once they add up past
    /// [`SMALL_BODY`]: the stop is at the fragment's header that does it.
    #[test]
    fn fragments_add_up_and_control_frames_do_not() {
        let mut frames = Frames::default();
        let first = frame(false, 1, 40_000);
        let ping = frame(true, 9, 125);
        let second = frame(false, 0, 20_000);
        let last = frame(true, 0, 10_000);
        assert_eq!(
            pass(&mut frames, &first, false),
            (first.len(), false, false)
        );
        assert_eq!(pass(&mut frames, &ping, false), (ping.len(), false, false));
        assert_eq!(
            pass(&mut frames, &second, false),
            (second.len(), false, false)
        );
        assert_eq!(pass(&mut frames, &last, false), (4, true, false));
        assert_eq!(
            pass(&mut frames, &last[4..], true),
            (last.len() - 4, false, true)
        );
        let again = frame(true, 1, 60_000);
        assert_eq!(pass(&mut frames, &again, false), (again.len(), false, true));
    }

    /// Reads a server's unmasked frame (of at most 64 KiB): its opcode and payload, or
    /// `None` at the end.
    async fn read_frame(stream: &mut UnixStream) -> Option<(u8, String)> {
        use tokio::io::AsyncReadExt;
        let mut head = [0; 2];
        stream.read_exact(&mut head).await.ok()?;
        let len = match head[1] & 0x7f {
            126 => {
                let mut len = [0; 2];
                stream.read_exact(&mut len).await.ok()?;
                usize::from(u16::from_be_bytes(len))
            }
            len => usize::from(len),
        };
        let mut payload = vec![0; len];
        stream.read_exact(&mut payload).await.ok()?;
        Some((
            head[0] & 0x0f,
            String::from_utf8_lossy(&payload).into_owned(),
        ))
    }

    /// The text of the next frame that is not a ping.
    async fn read_text(stream: &mut UnixStream) -> String {
        loop {
            match read_frame(stream).await {
                Some((9, _)) => continue,
                Some((_, text)) => return text,
                None => return String::new(),
            }
        }
    }

    /// Sends `call` as one text frame on `stream`; the answer's text.
    async fn ws_call(stream: &mut UnixStream, call: &str) -> String {
        use tokio::io::AsyncWriteExt;
        stream
            .write_all(&text(call.as_bytes()))
            .await
            .expect("writing");
        read_text(stream).await
    }

    /// WebSocket clients that each send the header of a frame declaring a large
    /// message, and nothing more, wait for a read of a large body before that header is
    /// handed on (soketto sets the whole payload aside once it has it), and lose it
    /// seconds later, their connection closed, when the message does not come at the
    /// pace of large bodies; then a large message sent whole, over HTTP or WebSocket, is
    /// read and answered.
    #[tokio::test(start_paused = true)]
    async fn websocket_messages_wait_for_a_read_of_a_large_body() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, _stop) = pinged(dir.path(), ServeConfig::default()).await;
        let began = tokio::time::Instant::now();
        let large = frame(true, 1, 1024 * 1024);
        let mut stalled = Vec::new();
        for _ in 0..2 * LARGE_BODIES_AT_ONCE {
            let (mut stream, answer) = websocket(&path, b"").await;
            assert!(answer.starts_with("HTTP/1.1 101 "), "{answer}");
            use tokio::io::AsyncWriteExt;
            stream.write_all(&large[..14]).await.expect("writing");
            stalled.push(stream);
        }
        let ping = large_ping();
        let answer = read_all(send(&path, &post(ping.len(), &ping)).await).await;
        assert!(answer.contains(r#""result":"pong""#), "{answer}");
        let (mut stream, _) = websocket(&path, b"").await;
        let answer = ws_call(&mut stream, &ping).await;
        assert!(answer.contains(r#""result":"pong""#), "{answer}");
        for mut stream in stalled {
            // A close frame, then the end; no answer.
            let closed = async {
                while let Some((opcode, text)) = read_frame(&mut stream).await {
                    assert_eq!(opcode, 8, "a stalled message was answered: {text}");
                }
            };
            tokio::time::timeout(Duration::from_secs(60), closed)
                .await
                .expect("a stalled message's connection was closed");
        }
        let waited = began.elapsed();
        assert!(waited < 3 * LARGE_BODY_GRACE, "{waited:?}");
    }

    /// A WebSocket connection that fills its calls with ones that wait, then sends the
    /// header of a large message, is not read further while full and holds the read it
    /// took for the message 30 s at most: it is closed then, not when its waits end, and
    /// a large body sent whole is read then (before, four such connections held every
    /// read of a large body for as long as their waits).
    #[tokio::test(start_paused = true)]
    async fn a_full_websocket_keeps_no_read_of_a_large_body() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, _stop) = pinged(dir.path(), ServeConfig::default()).await;
        let began = tokio::time::Instant::now();
        let waits: Vec<u8> = (0..ServeConfig::default().max_calls_per_connection)
            .flat_map(|id| {
                text(format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"wait"}}"#).as_bytes())
            })
            .collect();
        let mut full = Vec::new();
        for _ in 0..LARGE_BODIES_AT_ONCE {
            let (mut stream, answer) = websocket(&path, b"").await;
            assert!(answer.starts_with("HTTP/1.1 101 "), "{answer}");
            use tokio::io::AsyncWriteExt;
            let header = &frame(true, 1, 1024 * 1024)[..14];
            stream
                .write_all(&[&waits[..], header].concat())
                .await
                .expect("writing");
            full.push(stream);
        }
        let ping = large_ping();
        let answer = read_all(send(&path, &post(ping.len(), &ping)).await).await;
        assert!(answer.contains(r#""result":"pong""#), "{answer}");
        for mut stream in full {
            let closed = async { while read_frame(&mut stream).await.is_some() {} };
            tokio::time::timeout(Duration::from_secs(60), closed)
                .await
                .expect("a full connection holding a read was closed");
        }
        let waited = began.elapsed();
        assert!(waited >= LARGE_READ_HOLD, "{waited:?}");
        assert!(waited < LARGE_READ_HOLD + LARGE_BODY_GRACE, "{waited:?}");
    }

    /// A client that sends a large message after calls that fill its connection gets
    /// every answer: the time its connection is not read because it is full does not
    /// count against the message's pace.
    #[tokio::test(start_paused = true)]
    async fn a_large_message_after_calls_that_fill_the_connection_is_answered() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, _stop) = pinged(dir.path(), ServeConfig::default()).await;
        let calls = ServeConfig::default().max_calls_per_connection;
        let mut sent: Vec<u8> = (0..calls)
            .flat_map(|id| {
                text(format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"nap"}}"#).as_bytes())
            })
            .collect();
        sent.extend(text(large_ping().as_bytes()));
        let (mut stream, answer) = websocket(&path, b"").await;
        assert!(answer.starts_with("HTTP/1.1 101 "), "{answer}");
        use tokio::io::AsyncWriteExt;
        stream.write_all(&sent).await.expect("writing");
        let mut answers = Vec::new();
        for _ in 0..=calls {
            answers.push(read_text(&mut stream).await);
        }
        let awake = answers
            .iter()
            .filter(|a| a.contains(r#""result":"awake""#))
            .count();
        let pong = answers
            .iter()
            .filter(|a| a.contains(r#""result":"pong""#))
            .count();
        assert_eq!((awake, pong), (calls, 1), "{answers:?}");
    }

    /// The pace of a large message waits while its connection is full (not read
    /// because its calls fill it), and the read is held 30 s at most all the same.
    #[tokio::test(start_paused = true)]
    async fn the_pace_of_a_large_message_waits_while_its_connection_is_full() {
        let mut gate = Gate::new(Arc::new(Semaphore::new(1)));
        let header = &frame(true, 1, 1024 * 1024)[..14];
        gate.stash[..header.len()].copy_from_slice(header);
        gate.stashed = header.len();
        let mut cx = Context::from_waker(Waker::noop());
        let mut space = [0; 64];
        let mut buf = tokio::io::ReadBuf::new(&mut space);
        while gate.hand_on(&mut cx, &mut buf).is_some() {}
        assert_eq!(
            buf.filled(),
            header,
            "the header went on with the read taken"
        );
        assert!(gate.read.is_some());
        gate.full(true);
        tokio::time::advance(Duration::from_secs(20)).await;
        assert!(
            gate.late(&mut cx).is_none(),
            "late after 20 s of a full connection"
        );
        gate.full(false);
        assert!(
            gate.late(&mut cx).is_none(),
            "late as soon as it was read again"
        );
        tokio::time::advance(LARGE_BODY_GRACE + Duration::from_millis(1)).await;
        assert!(
            gate.late(&mut cx).is_some(),
            "not late past the grace, nothing come"
        );

        let mut gate = Gate::new(Arc::new(Semaphore::new(1)));
        gate.stash[..header.len()].copy_from_slice(header);
        gate.stashed = header.len();
        let mut buf = tokio::io::ReadBuf::new(&mut space);
        while gate.hand_on(&mut cx, &mut buf).is_some() {}
        gate.full(true);
        tokio::time::advance(LARGE_READ_HOLD + Duration::from_millis(1)).await;
        assert!(
            gate.late(&mut cx).is_some(),
            "a full connection held its read 30 s"
        );
    }

    /// A WebSocket is opened only by a connection's first request, with nothing sent
    /// after its head before the 101: otherwise its frames would not all be seen.
    #[tokio::test]
    async fn a_websocket_with_frames_sent_before_its_101_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, _stop) = pinged(dir.path(), ServeConfig::default()).await;
        let (_, answer) = websocket(&path, &frame(true, 1, 10)).await;
        assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
        // A head whose lines end in a bare LF ends at its first empty line too.
        let bare = "GET / HTTP/1.1\nHost: x\nUpgrade: websocket\nConnection: Upgrade\n\
                    Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\nSec-WebSocket-Version: 13\n\n";
        let hidden = [bare.as_bytes(), &frame(true, 1, 10), b"\r\n\r\n"].concat();
        let answer = read_all(send(&path, &String::from_utf8_lossy(&hidden)).await).await;
        assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
        let with_body =
            "GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
                    Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
                    Content-Length: 2\r\n\r\n";
        let answer = read_all(send(&path, with_body).await).await;
        assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
        let (mut stream, answer) = websocket(&path, b"").await;
        assert!(answer.starts_with("HTTP/1.1 101 "), "{answer}");
        let answer = ws_call(&mut stream, r#"{"jsonrpc":"2.0","id":7,"method":"ping"}"#).await;
        assert!(answer.contains(r#""result":"pong""#), "{answer}");
    }

    /// A large body that trickles is answered 408 once it falls behind the pace of
    /// large bodies, seconds after its read began rather than at the body timeout, so
    /// peers trickling large bodies hold the reads of large bodies for seconds each; a
    /// large body sent at once is read and answered.
    #[tokio::test(start_paused = true)]
    async fn large_bodies_that_trickle_give_their_read_back_within_seconds() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Bodies have the default 30 s to come whole.
        let (path, _stop) = pinged(dir.path(), ServeConfig::default()).await;
        let large = SMALL_BODY as usize + 1;
        let began = tokio::time::Instant::now();
        let mut slow = Vec::new();
        for _ in 0..2 * LARGE_BODIES_AT_ONCE {
            slow.push(send(&path, &post(large, "[")).await);
        }
        let ping = large_ping();
        let answer = read_all(send(&path, &post(ping.len(), &ping)).await).await;
        assert!(answer.contains(r#""result":"pong""#), "{answer}");
        for stream in slow {
            let answer = read_all(stream).await;
            assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
            assert!(
                answer.contains(
                    "came slower than 1024 KiB/s after its first 2s (1 of its 65537 bytes came)"
                ),
                "{answer}"
            );
        }
        // Two rounds of reads given back after the grace, then the ping's.
        let waited = began.elapsed();
        assert!(waited < 3 * LARGE_BODY_GRACE, "{waited:?}");
    }

    /// A call with a large body that mostly waits, padded with whitespace, is passed on
    /// without it and gives back its read of a large body with its place: more such
    /// calls than there are reads of large bodies at once stop no one's large body
    /// (before, each kept its read until its answer, so four calls waiting ten minutes
    /// held every large body back as long; without the read, each held its padding as
    /// long: 30 `backup.wait` calls of 16 MB, 540 MiB). One that is large all the same
    /// keeps its read while it waits, and one whose id is over 1 KiB is refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_that_wait_hold_no_read_of_a_large_body() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (path, _stop, begun) = pinged_counting(dir.path(), ServeConfig::default()).await;
        let padded = |id: &str, params: &str| {
            let pad = " ".repeat(SMALL_BODY as usize);
            let body =
                format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"wait","params":{params}{pad}}}"#);
            post(body.len(), &body)
        };
        let mut waiting = Vec::new();
        for _ in 0..2 * LARGE_BODIES_AT_ONCE {
            waiting.push(send(&path, &padded("1", "{}")).await);
        }
        let all = 2 * LARGE_BODIES_AT_ONCE as u32;
        begun.acquire_many(all).await.expect("waits begun").forget();
        let ping = large_ping();
        let answer = read_all(send(&path, &post(ping.len(), &ping)).await);
        let answer = tokio::time::timeout(Duration::from_secs(60), answer)
            .await
            .expect("a large ping was answered while calls with large bodies waited");
        assert!(answer.contains(r#""result":"pong""#), "{answer}");
        for stream in &waiting {
            let mut byte = [0; 1];
            assert!(
                matches!(stream.try_read(&mut byte), Err(e) if e.kind() == io::ErrorKind::WouldBlock),
                "a waiting call was answered or closed"
            );
        }
        let id = format!(r#""{}""#, "i".repeat(MAX_ID));
        let answer = read_all(send(&path, &padded(&id, "{}")).await).await;
        assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
        assert!(
            answer.contains("an id of 1026 bytes; an id may have at most 1024"),
            "{answer}"
        );

        // Large without its whitespace: each keeps its read while it waits.
        let params = format!(r#"{{"pad":"{}"}}"#, "x".repeat(SMALL_BODY as usize));
        for _ in 0..LARGE_BODIES_AT_ONCE {
            waiting.push(send(&path, &padded("1", &params)).await);
        }
        let all = LARGE_BODIES_AT_ONCE as u32;
        begun.acquire_many(all).await.expect("waits begun").forget();
        let answer = read_all(send(&path, &post(ping.len(), &ping)).await);
        let held = tokio::time::timeout(Duration::from_secs(5), answer).await;
        assert!(
            held.is_err(),
            "a large body was read while large waits held every read"
        );
    }

    /// Reservations are let in while the count is under the bound, one step each: of
    /// callers let in together, those after the one that passed the bound wait, and
    /// one waiting is let in once a reservation is given back.
    #[tokio::test]
    async fn reservations_wait_once_the_count_passes_the_bound() {
        let backlog = Arc::new(Backlog::new(10));
        let outbox = Outbox::new(1 << 20, 16, backlog.clone());
        let first = outbox.reserve_in_all(6, None).await;
        let second = outbox.reserve_in_all(6, None).await;
        assert_eq!(backlog.bytes.load(std::sync::atomic::Ordering::Relaxed), 12);
        assert!(!backlog.try_reserve(1), "a third was let in past the bound");
        let third = outbox.reserve_in_all(6, None);
        tokio::pin!(third);
        assert!(futures::poll!(third.as_mut()).is_pending());
        drop(first);
        let third = third.await;
        assert_eq!(third.bytes, 6);
        drop((second, third));
        assert_eq!(backlog.bytes.load(std::sync::atomic::Ordering::Relaxed), 0);
    }

    /// An answer counts whole until its last byte is written: it is held whole until
    /// then, so a peer that reads all but the tail of each answer is held to the bound
    /// by the answers, not by their tails.
    #[test]
    fn an_answer_counts_whole_until_its_last_byte_is_written() {
        let backlog = Arc::new(Backlog::new(1 << 30));
        let count = || backlog.bytes.load(std::sync::atomic::Ordering::Relaxed);
        let outbox = Outbox::new(1 << 20, 16, backlog.clone());
        outbox.respond(1000, None);
        outbox.push(500);
        assert_eq!(count(), 1500);
        outbox.wrote(990);
        assert_eq!(count(), 1500, "the first answer's tail is not written yet");
        outbox.wrote(10);
        assert_eq!(count(), 500);
        outbox.wrote(499);
        assert_eq!(count(), 500);
        drop(outbox);
        assert_eq!(
            count(),
            0,
            "a connection gone gives back what it still held"
        );
        let outbox = Outbox::new(1 << 20, 16, backlog.clone());
        outbox.respond(700, None);
        outbox.wrote(300);
        outbox.fail();
        assert_eq!(
            count(),
            0,
            "a connection failed gives back what it still held"
        );
        outbox.respond(700, None);
        assert_eq!(count(), 0, "a failed connection counts nothing more");
    }

    /// One `poll_write` of `data`, without waiting.
    async fn write_once(watched: &mut Watched<UnixStream>, data: &[u8]) -> Poll<io::Result<usize>> {
        std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *watched).poll_write(cx, data))).await
    }

    /// Writes 4 KiB at a time until a write waits for the peer; the bytes written.
    async fn fill(watched: &mut Watched<UnixStream>) -> usize {
        // Until the runtime has seen the socket writable, a write waits without trying.
        watched.inner.writable().await.expect("a writable socket");
        let chunk = [0u8; 4096];
        let mut written = 0;
        while let Poll::Ready(result) = write_once(watched, &chunk).await {
            written += result.expect("writing to a peer that is there");
        }
        written
    }

    /// Reads up to `n` bytes the peer has waiting, without waiting.
    fn peer_reads(mut peer: &std::os::unix::net::UnixStream, n: usize) -> usize {
        use std::io::Read;
        let mut buf = vec![0u8; n];
        let mut read = 0;
        while read < n {
            match peer.read(&mut buf[read..]) {
                Ok(0) | Err(_) => break,
                Ok(k) => read += k,
            }
        }
        read
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_reads_slowly_is_not_taken_for_one_that_stopped() {
        let stall = Duration::from_secs(30);
        let (ours, peer) = std::os::unix::net::UnixStream::pair().expect("a socket pair");
        ours.set_nonblocking(true).expect("O_NONBLOCK");
        peer.set_nonblocking(true).expect("O_NONBLOCK");
        let ours = UnixStream::from_std(ours).expect("a tokio stream");
        let outbox = Arc::new(Outbox::new(1 << 20, 16, Arc::new(Backlog::new(1 << 30))));
        let reads = Arc::new(Semaphore::new(1));
        let (mut watched, _) = Watched::new(ours, outbox.clone(), Some(stall), reads);
        let written = fill(&mut watched).await;
        // What the socket charges for them: their buffers' sizes, not only the data.
        let waiting = unread_bytes(&watched.inner).expect("SIOCOUTQ on a Unix socket");
        assert!(
            waiting as usize >= written,
            "{waiting} bytes unread of {written} written"
        );

        // The peer takes a little, far from enough for the kernel to wake the writer, in
        // each stall period: the connection stays.
        for period in 0..3 {
            assert_eq!(peer_reads(&peer, 8192), 8192, "period {period}");
            tokio::time::advance(stall + Duration::from_secs(1)).await;
            assert!(
                write_once(&mut watched, &[0u8; 4096]).await.is_pending(),
                "period {period}: a write went through or failed"
            );
            assert!(!outbox.failed(), "period {period}: taken for a stall");
        }

        // Then it reads nothing for a whole period: the write fails, and so does the
        // connection.
        tokio::time::advance(stall + Duration::from_secs(1)).await;
        match write_once(&mut watched, &[0u8; 4096]).await {
            Poll::Ready(Err(e)) => assert_eq!(e.kind(), io::ErrorKind::TimedOut),
            other => panic!("after a period with nothing read: {other:?}"),
        }
        assert!(outbox.failed());
    }
}
