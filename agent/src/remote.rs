//! Calls to snapshotters: Progress and Cancel over the two transports of
//! docs/architecture.md's snapshotter protocol.
//!
//! - socket: JSON-RPC batches over HTTP/1.1 on a Unix socket, on a small pool of
//!   kept-alive connections;
//! - command: one process per call, with a bounded number running at once
//!   ([`command`] says how a command is confined);
//! - velero_plugin: a Velero plugin binary kept running, called over gRPC as Velero
//!   calls it ([`velero_plugin`]).
//!
//! Every call has a deadline. A hung or dead snapshotter costs its own operations the
//! deadline and nothing else: callers poll each snapshotter independently. Cancel goes
//! the same way as Progress (batches, bounded concurrency), and [`Caller::cancel`] as a
//! whole ends at a deadline given by the caller: what is not answered by then is
//! abandoned.

mod command;
pub mod velero_plugin;

pub use command::warn_if_unrunnable;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::caps::Cap;
use crate::sync::{lock, read, write};
use bytes::Bytes;
use futures::stream::{self, StreamExt};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use opmon_client::{
    codes, ApiVersion, OperationProgress, OperationRef, OwnerRef, PluginRef, Snapshotter,
};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;
use tokio::sync::Semaphore;

pub use command::{CommandRemote, COMMAND_PATH, MAX_STDOUT, STDERR_TAIL};

/// Largest response body read from a snapshotter.
const MAX_RESPONSE_BYTES: usize = 16 * 1024 * 1024;
/// Kept-alive connections per socket snapshotter.
const POOL_SIZE: usize = 8;

/// The bytes an answer being read holds of the total held for peers (`max_held_bytes`),
/// charged as they arrive and given back when dropped. Nothing waits for room: an answer
/// that finds none fails its call and is asked for again at the next poll, so that
/// answers half read cannot hold each other (or the calls behind them) up.
struct Held {
    total: Cap,
    charged: usize,
    held: Vec<crate::caps::Held>,
}

impl Held {
    fn begin(total: &Cap) -> Held {
        Held {
            total: total.clone(),
            charged: 0,
            held: Vec::new(),
        }
    }

    /// Makes room for `len` bytes in all, or says whose room is full.
    fn grow(&mut self, len: usize) -> Result<(), String> {
        let more = len.max(1).saturating_sub(self.charged);
        if more == 0 {
            return Ok(());
        }
        let more32 = u32::try_from(more).unwrap_or(u32::MAX);
        let held = self.total.take_many(more32).map_err(|why| {
            format!(
                "its answer of {len} bytes so far found no room ({why}); asked again at the \
                 next poll"
            )
        })?;
        self.held.push(held);
        self.charged += more;
        Ok(())
    }
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Held({} bytes)", self.charged)
    }
}

/// Tuning shared by all snapshotters.
#[derive(Clone, Debug)]
pub struct CallSettings {
    pub deadline: Duration,
    pub batch_size: usize,
    /// Batches in flight at once to one socket snapshotter.
    pub socket_concurrency: usize,
    /// Processes running at once for one command snapshotter.
    pub command_concurrency: usize,
}

/// Why a call to a snapshotter brought no progress.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The snapshotter could not be reached or did not answer in time (connection
    /// refused, reset, deadline passed, process not startable). Transient: the
    /// operation is polled again until the grace period runs out.
    #[error("{0}")]
    Unreachable(String),
    /// The snapshotter answered, with an error or with something that is not a
    /// progress: the operation fails now.
    #[error("{0}")]
    Answered(String),
    /// The snapshotter answered with an error it marked as passing (code 2003,
    /// `data.retryable: true`, a command's exit status 75): the operation is tried again
    /// with backoff while its retry budget lasts.
    #[error("{0}")]
    Transient(String),
}

impl CallError {
    pub fn message(&self) -> &str {
        match self {
            CallError::Unreachable(m) | CallError::Answered(m) | CallError::Transient(m) => m,
        }
    }
}

type Answer<T> = Result<T, CallError>;

/// How the agent reaches one snapshotter.
pub enum Remote {
    /// v1: no Progress, no Cancel; the phase machine's v1 adapter completes its
    /// operations at their first poll, and nothing is called.
    V1,
    /// A snapshotter the agent calls.
    Called(Caller),
}

/// A snapshotter the agent calls for Progress and Cancel.
pub enum Caller {
    Socket(SocketRemote),
    Command(CommandRemote),
    VeleroPlugin(velero_plugin::VeleroRemote),
    /// Registered, but not to be called: every call fails with this message (a command
    /// snapshotter left in the database that the configuration no longer allows).
    Refused(String),
}

impl Remote {
    #[cfg(test)]
    pub fn new(s: &Snapshotter, settings: &CallSettings) -> Remote {
        Remote::with_hosts(
            s,
            settings,
            &velero_plugin::Hosts::default(),
            Cap::new("bytes held for peers", 64 << 20),
        )
    }

    /// As [`Remote::new`], a Velero plugin sharing the process of `hosts` that runs its
    /// binary.
    pub fn with_hosts(
        s: &Snapshotter,
        settings: &CallSettings,
        hosts: &velero_plugin::Hosts,
        room: Cap,
    ) -> Remote {
        if let (ApiVersion::V2, Some(host)) = (s.api_version, hosts.of(s)) {
            return Remote::Called(Caller::VeleroPlugin(velero_plugin::VeleroRemote::new(
                s, host, settings,
            )));
        }
        match (s.api_version, &s.socket, &s.command) {
            (ApiVersion::V1, _, _) => Remote::V1,
            (_, Some(socket), _) => Remote::Called(Caller::Socket(SocketRemote {
                name: s.name.clone(),
                path: socket.clone(),
                pool: Mutex::new(Vec::new()),
                settings: settings.clone(),
                in_flight: Semaphore::new(settings.socket_concurrency.max(1)),
                room,
            })),
            (_, None, command) => Remote::Called(Caller::Command(CommandRemote {
                name: s.name.clone(),
                argv: command.clone().unwrap_or_default(),
                settings: settings.clone(),
                running: Semaphore::new(settings.command_concurrency.max(1)),
                room,
            })),
        }
    }
}

/// What a call about one operation names: its plugin, its ID and its owner. The
/// sweep's targets name them themselves, so a call copies none of them.
pub trait Call: Sync {
    /// The plugin whose operation it is (its snapshotter's).
    fn plugin(&self) -> &PluginRef;
    /// The operation's ID, as the plugin gave it.
    fn operation_id(&self) -> &str;
    /// The owner, shared by its operations: a batch encodes each owner (with its
    /// object, up to 64 KiB) once and copies it, recognising it by this `Arc`.
    fn owner(&self) -> &Arc<OwnerRef>;

    /// The call's params as the protocol names them, copied.
    fn to_ref(&self) -> OperationRef {
        OperationRef {
            plugin: self.plugin().clone(),
            operation_id: self.operation_id().to_string(),
            owner: self.owner().clone(),
        }
    }
}

impl Call for OperationRef {
    fn plugin(&self) -> &PluginRef {
        &self.plugin
    }
    fn operation_id(&self) -> &str {
        &self.operation_id
    }
    fn owner(&self) -> &Arc<OwnerRef> {
        &self.owner
    }
}

impl Caller {
    /// Progress of each operation, in order. Calls still unanswered at `deadline` (if
    /// any) are abandoned and answered unreachable, saying so: the caller's wait has a
    /// bound whatever the snapshotter does.
    pub async fn progress<C: Call>(
        &self,
        ops: &[C],
        deadline: Option<tokio::time::Instant>,
    ) -> Vec<Answer<OperationProgress>> {
        // Each piece of work answers for the ops from its start index on.
        let mut pieces = match self {
            Caller::Refused(why) => {
                return ops
                    .iter()
                    .map(|_| Err(CallError::Answered(why.clone())))
                    .collect()
            }
            Caller::Socket(s) => s.progress(ops),
            Caller::VeleroPlugin(v) => {
                stream::once(async move { (0, v.progress(ops).await) }).boxed()
            }
            // Indices rather than references keep the stream's closure free of
            // higher-ranked lifetimes, so the future stays Send.
            Caller::Command(c) => stream::iter(0..ops.len())
                .map(move |i| async move { (i, vec![c.progress(ops[i].to_ref()).await]) })
                .buffer_unordered(c.settings.command_concurrency.max(1))
                .boxed(),
        };
        let mut answers: Vec<Option<Answer<OperationProgress>>> =
            ops.iter().map(|_| None).collect();
        loop {
            let next = match deadline {
                Some(at) => tokio::time::timeout_at(at, pieces.next())
                    .await
                    .ok()
                    .flatten(),
                None => pieces.next().await,
            };
            let Some((start, piece)) = next else { break };
            for (slot, answer) in answers[start..].iter_mut().zip(piece) {
                *slot = Some(answer);
            }
        }
        // The plugin's name is its snapshotter's.
        answers
            .into_iter()
            .zip(ops)
            .map(|(a, op)| {
                a.unwrap_or_else(|| {
                    Err(CallError::Unreachable(format!(
                        "snapshotter {} did not answer before the call's deadline",
                        op.plugin().name
                    )))
                })
            })
            .collect()
    }

    /// Asks the snapshotter to cancel each of `ops`, as Progress is asked (batches to a
    /// socket, a bounded number of processes at once), until `deadline`. One answer per
    /// op, in order; `None` for a call abandoned unanswered at the deadline.
    pub async fn cancel<C: Call>(
        &self,
        ops: &[C],
        deadline: tokio::time::Instant,
    ) -> Vec<Option<Answer<()>>> {
        let mut answers: Vec<Option<Answer<()>>> = ops.iter().map(|_| None).collect();
        // Each piece of work answers for the ops from its start index on.
        let mut pieces = match self {
            Caller::Refused(why) => {
                return ops
                    .iter()
                    .map(|_| Some(Err(CallError::Answered(why.clone()))))
                    .collect()
            }
            Caller::Socket(s) => {
                let size = s.settings.batch_size.max(1);
                stream::iter((0..ops.len()).step_by(size))
                    .map(move |start| async move {
                        let end = (start + size).min(ops.len());
                        // Any result is a success (the protocol's is `null`).
                        let answers = s
                            .batch("operation.cancel", &ops[start..end], |_| Ok(()))
                            .await;
                        (start, answers)
                    })
                    .buffer_unordered(s.settings.socket_concurrency.max(1))
                    .boxed()
            }
            Caller::Command(c) => stream::iter(0..ops.len())
                .map(move |i| async move {
                    let answer = c.run("cancel", &ops[i].to_ref()).await.map(|_| ());
                    (i, vec![answer])
                })
                .buffer_unordered(c.settings.command_concurrency.max(1))
                .boxed(),
            Caller::VeleroPlugin(v) => stream::iter(0..ops.len())
                .map(move |i| async move { (i, vec![v.cancel_one(&ops[i]).await]) })
                .buffer_unordered(v.concurrency())
                .boxed(),
        };
        while let Ok(Some((start, piece))) = tokio::time::timeout_at(deadline, pieces.next()).await
        {
            for (slot, answer) in answers[start..].iter_mut().zip(piece) {
                *slot = Some(answer);
            }
        }
        answers
    }
}

/// A snapshotter serving JSON-RPC on a Unix socket.
pub struct SocketRemote {
    name: String,
    path: PathBuf,
    pool: Mutex<Vec<SendRequest<Full<Bytes>>>>,
    settings: CallSettings,
    in_flight: Semaphore,
    room: Cap,
}

#[derive(Deserialize)]
struct ResponseEntry<'a> {
    id: Option<u64>,
    /// `Some` whenever the member is there, `null` included: Cancel answers `null`.
    #[serde(borrow, default, deserialize_with = "present")]
    result: Option<&'a RawValue>,
    error: Option<ErrorEntry>,
}

/// Deserializes a member that is present (whatever its value, `null` too) as `Some`.
fn present<'de: 'a, 'a, D: Deserializer<'de>>(d: D) -> Result<Option<&'a RawValue>, D::Error> {
    <&'a RawValue>::deserialize(d).map(Some)
}

/// Only the id of a response entry: what a malformed entry is still good for.
#[derive(Deserialize)]
struct EntryId {
    id: Option<u64>,
}

/// A batch's answers as its entries are read: one per call, by id.
struct Answers<'r, T> {
    remote: &'r SocketRemote,
    calls: Vec<Option<Answer<T>>>,
    /// What an error entry without an id said: maybe why calls went unanswered.
    orphan: Option<String>,
}

impl<'r, T> Answers<'r, T> {
    fn new(remote: &'r SocketRemote, count: usize) -> Self {
        Answers {
            remote,
            calls: (0..count).map(|_| None).collect(),
            orphan: None,
        }
    }

    /// Records the entry for call `id`: `answer` the first time, an error if the call
    /// was answered before (which answer was meant is not known), nothing for an id
    /// no call has. An entry without an id is kept only for what its `error` says.
    fn record(
        &mut self,
        id: Option<u64>,
        error: Option<&ErrorEntry>,
        answer: impl FnOnce() -> Answer<T>,
    ) {
        let Some(id) = id else {
            if let Some(e) = error {
                self.orphan = Some(format!("{} (code {})", e.message, e.code));
            }
            return;
        };
        if let Some(call) = self.calls.get_mut(id as usize) {
            *call = Some(match call {
                Some(_) => Err(self.remote.repeated(id)),
                None => answer(),
            });
        }
    }

    /// One answer per call, in order; a call with no entry is said unanswered.
    fn finish(self) -> Vec<Answer<T>> {
        let (remote, orphan) = (self.remote, self.orphan);
        self.calls
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(remote.unanswered(orphan.as_deref()))))
            .collect()
    }
}

/// A batch response read as typed entries into a list made for the `count` expected
/// (serde's own grows it by doubling and copying, entries of a few hundred bytes).
fn typed_entries<T: DeserializeOwned>(
    text: &str,
    count: usize,
) -> serde_json::Result<Vec<TypedEntry<T>>> {
    struct Entries<T>(usize, std::marker::PhantomData<T>);
    impl<'de, T: DeserializeOwned> serde::de::Visitor<'de> for Entries<T> {
        type Value = Vec<TypedEntry<T>>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON-RPC batch response")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut entries = Vec::with_capacity(self.0);
            while let Some(entry) = seq.next_element()? {
                entries.push(entry);
            }
            Ok(entries)
        }
    }
    let mut de = serde_json::Deserializer::from_str(text);
    // A batch has at most one entry per call sent: the count is ours, not the peer's.
    let entries = de.deserialize_seq(Entries::<T>(count, std::marker::PhantomData))?;
    de.end()?;
    Ok(entries)
}

/// A response entry whose result is parsed as `T` at once (`null` or absent: `None`).
#[derive(Deserialize)]
struct TypedEntry<T> {
    id: Option<u64>,
    #[serde(default = "Option::default")]
    result: Option<T>,
    error: Option<ErrorEntry>,
}

#[derive(Deserialize)]
struct ErrorEntry {
    code: i32,
    message: String,
    /// Any JSON: only `retryable` of an object is read, so data of another shape
    /// cannot make the rest of the batch unreadable.
    #[serde(default)]
    data: Option<serde_json::Value>,
}

impl ErrorEntry {
    /// Whether the snapshotter marked the error as one that may pass.
    fn transient(&self) -> bool {
        self.code == codes::TRANSIENT
            || self
                .data
                .as_ref()
                .and_then(|d| d.get("retryable"))
                .is_some_and(|r| r == &serde_json::Value::Bool(true))
    }
}

impl SocketRemote {
    /// Progress batches of `ops`, each with the index of its first op.
    fn progress<'a, C: Call>(
        &'a self,
        ops: &'a [C],
    ) -> futures::stream::BoxStream<'a, (usize, Vec<Answer<OperationProgress>>)> {
        let size = self.settings.batch_size.max(1);
        stream::iter((0..ops.len()).step_by(size))
            .map(move |start| async move {
                let parse = |raw: &RawValue| {
                    serde_json::from_str::<OperationProgress>(raw.get()).map_err(|e| {
                        CallError::Answered(format!(
                            "snapshotter {} answered an invalid progress: {e}",
                            self.name
                        ))
                    })
                };
                let end = (start + size).min(ops.len());
                (
                    start,
                    self.batch("operation.progress", &ops[start..end], parse)
                        .await,
                )
            })
            .buffer_unordered(self.settings.socket_concurrency.max(1))
            .boxed()
    }

    /// Sends one JSON-RPC batch of `method` for `ops`; one answer per op, in order.
    async fn batch<T: DeserializeOwned, C: Call>(
        &self,
        method: &str,
        ops: &[C],
        parse: impl Fn(&RawValue) -> Answer<T>,
    ) -> Vec<Answer<T>> {
        let _permit = self.in_flight.acquire().await;
        let body = match encode_batch(method, ops) {
            Ok(body) => body,
            Err(e) => {
                let e = CallError::Answered(e);
                return ops.iter().map(|_| Err(e.clone())).collect();
            }
        };
        let response = match tokio::time::timeout(
            self.settings.deadline,
            self.post(Bytes::from(body)),
        )
        .await
        {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => return ops.iter().map(|_| Err(e.clone())).collect(),
            Err(_) => {
                let e = CallError::Unreachable(format!(
                    "snapshotter {} did not answer within {}",
                    self.name,
                    opmon_client::GoDuration(self.settings.deadline)
                ));
                return ops.iter().map(|_| Err(e.clone())).collect();
            }
        };
        // Decoding reads the answer in place, its room held until it is done.
        let (response, _held) = response;
        self.decode_batch(&response, ops.len(), parse)
    }

    /// One answer per op from a batch response, each result parsed by `parse`. The
    /// usual response (every entry a result of type `T` or an error) is parsed in one
    /// pass; anything else is read entry by entry, so one bad entry fails only its own
    /// operation, with the message that says why.
    fn decode_batch<T: DeserializeOwned>(
        &self,
        response: &[u8],
        count: usize,
        parse: impl Fn(&RawValue) -> Answer<T>,
    ) -> Vec<Answer<T>> {
        // Read as text, checked once (serde_json then skips checking each string); a
        // byte that is not UTF-8 spoils only the text it is in (U+FFFD), not the batch.
        // `from_utf8` checks ASCII a word at a time; the lossy copy is for the rare
        // answer that needs it.
        let text = match std::str::from_utf8(response) {
            Ok(text) => std::borrow::Cow::Borrowed(text),
            Err(_) => String::from_utf8_lossy(response),
        };
        if let Ok(entries) = typed_entries::<T>(&text, count) {
            if entries
                .iter()
                .all(|e| e.result.is_some() || e.error.is_some())
            {
                let mut answers = Answers::new(self, count);
                for TypedEntry { id, result, error } in entries {
                    answers.record(id, error.as_ref(), || match (result, &error) {
                        (_, Some(e)) => Err(self.refused(e)),
                        (Some(result), None) => Ok(result),
                        (None, None) => Err(self.without_result()),
                    });
                }
                return answers.finish();
            }
        }
        let whole = |e: CallError| (0..count).map(|_| Err(e.clone())).collect();
        let entries: Vec<&RawValue> = match serde_json::from_str(&text) {
            Ok(entries) => entries,
            Err(_) => {
                // A single error object answers the whole batch (e.g. a parse error).
                return match serde_json::from_str::<ResponseEntry<'_>>(&text) {
                    Ok(ResponseEntry { error: Some(e), .. }) => whole(self.refused(&e)),
                    _ => whole(CallError::Answered(format!(
                        "snapshotter {} answered something that is not a JSON-RPC response",
                        self.name
                    ))),
                };
            }
        };
        let mut answers = Answers::new(self, count);
        for raw in entries {
            match serde_json::from_str::<ResponseEntry<'_>>(raw.get()) {
                Ok(entry) => answers.record(entry.id, entry.error.as_ref(), || {
                    match (entry.result, &entry.error) {
                        (_, Some(e)) => Err(self.refused(e)),
                        (Some(result), None) => parse(result),
                        (None, None) => Err(self.without_result()),
                    }
                }),
                Err(e) => {
                    // A malformed entry (an error without its message, say) fails the
                    // call its id names, if it names one, and no other.
                    let id = serde_json::from_str::<EntryId>(raw.get())
                        .ok()
                        .and_then(|entry| entry.id);
                    answers.record(id, None, || {
                        Err(CallError::Answered(format!(
                            "snapshotter {} answered an entry that is not a JSON-RPC \
                             response: {e}",
                            self.name
                        )))
                    });
                }
            }
        }
        answers.finish()
    }

    /// The call's error answer: retried later when the snapshotter marked it transient
    /// (code 2003 or `data.retryable`), final otherwise. Both ways of reading a batch
    /// use it, so they cannot disagree.
    fn refused(&self, e: &ErrorEntry) -> CallError {
        if e.transient() {
            CallError::Transient(self.describe(e))
        } else {
            CallError::Answered(self.describe(e))
        }
    }

    /// An entry with neither a result nor an error.
    fn without_result(&self) -> CallError {
        CallError::Answered(format!(
            "snapshotter {} answered without a result",
            self.name
        ))
    }

    /// A call the answer has more than one entry for: which one the snapshotter meant
    /// is not known, so none is taken. Transient: asked again at the next poll, and the
    /// operation fails with this once its retry budget is spent.
    fn repeated(&self, id: u64) -> CallError {
        CallError::Transient(format!(
            "snapshotter {} answered call {id} of the batch more than once",
            self.name
        ))
    }

    /// A call the answer has no entry for; `orphan` is what an error entry without an
    /// id said, which may be why.
    fn unanswered(&self, orphan: Option<&str>) -> CallError {
        match orphan {
            None => CallError::Answered(format!(
                "snapshotter {} left the call unanswered",
                self.name
            )),
            Some(said) => CallError::Answered(format!(
                "snapshotter {} left the call unanswered, and answered an error without an \
                 id: {said}",
                self.name
            )),
        }
    }

    fn describe(&self, e: &ErrorEntry) -> String {
        match e.code {
            codes::OPERATIONS_NOT_SUPPORTED => {
                format!(
                    "OperationsNotSupported: snapshotter {}: {}",
                    self.name, e.message
                )
            }
            codes::INVALID_OPERATION_ID => {
                format!(
                    "InvalidOperationId: snapshotter {}: {}",
                    self.name, e.message
                )
            }
            codes::TRANSIENT => format!("snapshotter {}: {}", self.name, e.message),
            code => format!("snapshotter {}: {} (code {code})", self.name, e.message),
        }
    }

    /// POSTs `body` to `/`, reusing a pooled connection when one is idle.
    /// POSTs `body` to `/`, reusing a pooled connection when one is idle; the answer
    /// comes with the room it holds.
    async fn post(&self, body: Bytes) -> Result<(Bytes, Held), CallError> {
        let pooled = lock(&self.pool).pop();
        let mut sender = match pooled {
            Some(s) if !s.is_closed() => s,
            _ => self.connect().await?,
        };
        let request = hyper::Request::post("/")
            .header(hyper::header::HOST, "localhost")
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|e| {
                CallError::Answered(format!(
                    "building a request for snapshotter {}: {e}",
                    self.name
                ))
            })?;
        let unreachable = |e: &dyn std::fmt::Display| {
            CallError::Unreachable(format!(
                "snapshotter {} at {}: {e}",
                self.name,
                self.path.display()
            ))
        };
        sender.ready().await.map_err(|e| unreachable(&e))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| unreachable(&e))?;
        let status = response.status();
        let too_much = || {
            CallError::Answered(format!(
                "snapshotter {} answered more than {MAX_RESPONSE_BYTES} bytes",
                self.name
            ))
        };
        // The answer's bytes are charged as they arrive; a length said up front is
        // charged before any is read.
        let mut held = Held::begin(&self.room);
        let said = response
            .headers()
            .get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
        if said.is_some_and(|len| len > MAX_RESPONSE_BYTES) {
            return Err(too_much());
        }
        let full = |e: String| CallError::Unreachable(format!("snapshotter {}: {e}", self.name));
        held.grow(said.unwrap_or(0)).map_err(full)?;
        let mut body = response.into_body();
        let mut bytes = Vec::with_capacity(said.unwrap_or(0));
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| unreachable(&format!("reading the answer: {e}")))?;
            if let Ok(data) = frame.into_data() {
                if bytes.len() + data.len() > MAX_RESPONSE_BYTES {
                    return Err(too_much());
                }
                held.grow(bytes.len() + data.len()).map_err(full)?;
                bytes.extend_from_slice(&data);
            }
        }
        let bytes = Bytes::from(bytes);
        if !sender.is_closed() {
            {
                let mut pool = lock(&self.pool);
                if pool.len() < POOL_SIZE {
                    pool.push(sender);
                }
            }
        }
        if !status.is_success() {
            // What the snapshotter said with it, if anything: the start of its body.
            let said = String::from_utf8_lossy(&bytes[..bytes.len().min(200)]);
            let said = said.trim();
            return Err(unreachable(&if said.is_empty() {
                format!("HTTP status {status}")
            } else {
                format!("HTTP status {status}: {said}")
            }));
        }
        Ok((bytes, held))
    }

    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, CallError> {
        let unreachable = |e: &dyn std::fmt::Display| {
            CallError::Unreachable(format!(
                "snapshotter {} at {}: {e}",
                self.name,
                self.path.display()
            ))
        };
        let stream = tokio::net::UnixStream::connect(&self.path)
            .await
            .map_err(|e| unreachable(&e))?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| unreachable(&e))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(sender)
    }
}

/// The JSON-RPC batch of `method` for `ops`, ids 0.. in order: what serializing each
/// [`OperationRef`] as `params` gives, but each owner (shared by its operations, its
/// `object` up to 64 KiB) and each plugin encoded once per batch and copied after.
fn encode_batch<C: Call>(method: &str, ops: &[C]) -> Result<Vec<u8>, String> {
    use std::io::Write as _;
    fn encode<T: serde::Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, String> {
        serde_json::to_vec(value).map_err(|e| format!("encoding a request: {e}"))
    }
    let method = encode(method)?;
    let mut owners: Vec<(*const OwnerRef, Vec<u8>)> = Vec::new();
    let mut plugins: Vec<(&PluginRef, Vec<u8>)> = Vec::new();
    // Room for the first entry; the rest is reserved from its size. (Reserved at 192
    // bytes an entry up front, the buffer was grown at the second entry: mimalloc's
    // realloc copies the whole old block, tens of KiB a batch.)
    let mut out = Vec::with_capacity(1024);
    out.push(b'[');
    for (id, op) in ops.iter().enumerate() {
        if id > 0 {
            if id == 1 {
                // The rest are about the size of the first: one allocation, not a
                // doubling and copy after every few. An eighth more than the first's
                // size covers longer ids and operation IDs (with exactly its size, most
                // of the bench's batches grew once, copying tens of KiB). At most 1 MiB
                // is guessed: a first entry with a 64 KiB owner object says little of
                // the others.
                let guess = (out.len() + 8).saturating_mul(ops.len() - 1);
                out.reserve((guess + guess / 8).min(1 << 20));
            }
            out.push(b',');
        }
        out.extend_from_slice(b"{\"jsonrpc\":\"2.0\",\"id\":");
        // Writing to a Vec cannot fail.
        let _ = write!(out, "{id}");
        out.extend_from_slice(b",\"method\":");
        out.extend_from_slice(&method);
        out.extend_from_slice(b",\"params\":{\"plugin\":");
        let plugin = match plugins.iter().position(|(p, _)| *p == op.plugin()) {
            Some(i) => i,
            None => {
                plugins.push((op.plugin(), encode(op.plugin())?));
                plugins.len() - 1
            }
        };
        out.extend_from_slice(&plugins[plugin].1);
        out.extend_from_slice(b",\"operationId\":");
        serde_json::to_writer(&mut out, op.operation_id())
            .map_err(|e| format!("encoding a request: {e}"))?;
        out.extend_from_slice(b",\"owner\":");
        let key = Arc::as_ptr(op.owner());
        // Operations come grouped by owner: the last one encoded is the usual match.
        let owner = match owners.iter().rposition(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                owners.push((key, encode(&**op.owner())?));
                owners.len() - 1
            }
        };
        out.extend_from_slice(&owners[owner].1);
        out.extend_from_slice(b"}}");
    }
    out.push(b']');
    Ok(out)
}

/// A snapshotter's defaults for its operations: deadlines (ms; `None`: off) and the
/// retry budget for its transient errors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    pub stall_ms: Option<i64>,
    pub start_ms: Option<i64>,
    pub retry: crate::phase::RetryBudget,
}

impl Policy {
    pub fn of(s: &Snapshotter) -> Policy {
        let ms = |d: Option<opmon_client::GoDuration>| d.map(|d| crate::clock::millis(d.0));
        let default = crate::phase::RetryBudget::DEFAULT;
        Policy {
            stall_ms: ms(s.stall_timeout),
            start_ms: ms(s.start_timeout),
            retry: crate::phase::RetryBudget {
                attempts: s.retry_attempts.unwrap_or(default.attempts),
                backoff_ms: ms(s.retry_backoff).unwrap_or(default.backoff_ms),
                within_ms: ms(s.retry_within).unwrap_or(default.within_ms),
            },
        }
    }
}

/// The live snapshotters by plugin name, rebuilt from the database at start.
pub struct Registry {
    remotes: std::sync::RwLock<std::collections::HashMap<String, Arc<Remote>>>,
    policies: std::sync::RwLock<std::collections::HashMap<String, Policy>>,
    /// Velero plugin binaries, one process each however many snapshotters name them.
    hosts: velero_plugin::Hosts,
    /// The room all snapshotters' answers share.
    room: Cap,
}

impl Registry {
    /// An empty registry whose snapshotters' answers draw on `room`.
    pub fn new(room: Cap) -> Registry {
        Registry {
            remotes: Default::default(),
            policies: Default::default(),
            hosts: Default::default(),
            room,
        }
    }

    pub fn get(&self, plugin: &str) -> Option<Arc<Remote>> {
        read(&self.remotes).get(plugin).cloned()
    }

    /// The defaults `plugin`'s snapshotter set (the agent's if none is registered).
    pub fn policy(&self, plugin: &str) -> Policy {
        read(&self.policies)
            .get(plugin)
            .copied()
            .unwrap_or_default()
    }

    /// Registers `s` as stored.
    pub fn insert(&self, s: &Snapshotter, settings: &CallSettings) {
        let remote = Remote::with_hosts(s, settings, &self.hosts, self.room.clone());
        self.put(s, Arc::new(remote));
    }

    /// The remote `s` would be, its Velero plugin's process shared with the snapshotters
    /// registered; [`Registry::put`] registers it.
    pub fn build(&self, s: &Snapshotter, settings: &CallSettings) -> Arc<Remote> {
        Arc::new(Remote::with_hosts(
            s,
            settings,
            &self.hosts,
            self.room.clone(),
        ))
    }

    pub fn put(&self, s: &Snapshotter, remote: Arc<Remote>) {
        write(&self.remotes).insert(s.name.clone(), remote);
        write(&self.policies).insert(s.name.clone(), Policy::of(s));
    }

    /// Keeps `name` registered but refuses every call to it, saying `why`.
    pub fn refuse(&self, name: &str, why: String) {
        write(&self.remotes).insert(
            name.to_string(),
            Arc::new(Remote::Called(Caller::Refused(why))),
        );
    }

    pub fn remove(&self, name: &str) {
        write(&self.remotes).remove(name);
        write(&self.policies).remove(name);
    }

    /// How many snapshotters are registered.
    pub fn count(&self) -> usize {
        read(&self.remotes).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn socket_remote() -> SocketRemote {
        let settings = CallSettings {
            deadline: Duration::from_secs(1),
            batch_size: 8,
            socket_concurrency: 1,
            command_concurrency: 1,
        };
        let s = Snapshotter {
            name: "example.io/copier".into(),
            socket: Some("/run/copier.sock".into()),
            ..Default::default()
        };
        match Remote::new(&s, &settings) {
            Remote::Called(Caller::Socket(remote)) => remote,
            _ => panic!("a socket snapshotter"),
        }
    }

    /// A snapshotter that answers with an HTTP error status is unreachable for the call,
    /// and what it said with the status (the start of its body) is in the message.
    #[tokio::test]
    async fn an_http_error_status_says_what_came_with_it() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut request = vec![0u8; 4096];
            let _ = stream.read(&mut request).await.unwrap();
            let body = "database on fire\n";
            let answer = format!(
                "HTTP/1.1 500 Internal Server Error\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            stream.write_all(answer.as_bytes()).await.unwrap();
        });
        let mut remote = remote();
        remote.path = path;
        let e = remote.post(Bytes::from_static(b"[]")).await.unwrap_err();
        server.await.unwrap();
        assert!(
            matches!(&e, CallError::Unreachable(m) if m.ends_with(
                "HTTP status 500 Internal Server Error: database on fire"
            )),
            "{e:?}"
        );
    }

    /// The batch written by hand is exactly what serde writes for each request, for
    /// owners and plugins shared or not, interleaved, and IDs that need escaping.
    #[test]
    fn an_encoded_batch_is_what_serde_writes_for_each_request() {
        use opmon_client::{OwnerKind, PluginKind};
        #[derive(serde::Serialize)]
        struct Request<'a> {
            jsonrpc: &'static str,
            id: usize,
            method: &'a str,
            params: &'a OperationRef,
        }
        let owner = |name: &str, object| {
            Arc::new(OwnerRef {
                kind: OwnerKind::Backup,
                name: name.into(),
                uid: format!("uid-{name}"),
                object,
            })
        };
        let (a, b) = (
            owner("a", None),
            owner(
                "b",
                Some(serde_json::json!({"spec": {"ttl": "720h", "q": "\"é\n"}})),
            ),
        );
        let plugin = |name: &str| PluginRef {
            kind: PluginKind::BackupItemAction,
            name: name.into(),
        };
        let ops: Vec<OperationRef> = [
            (&a, "p1", "ns/op-1"),
            (&a, "p1", "quote \" and \\ and \u{1}"),
            (&b, "p2", "ns/op-3"),
            (&a, "p2", "ns/op-4"),
            (&b, "p1", "ünïcode"),
        ]
        .into_iter()
        .map(|(owner, p, id)| OperationRef {
            plugin: plugin(p),
            operation_id: id.into(),
            owner: owner.clone(),
        })
        .collect();
        let by_serde: Vec<Request<'_>> = ops
            .iter()
            .enumerate()
            .map(|(id, params)| Request {
                jsonrpc: "2.0",
                id,
                method: "operation.progress",
                params,
            })
            .collect();
        let encoded = encode_batch("operation.progress", &ops).unwrap();
        assert_eq!(
            String::from_utf8(encoded).unwrap(),
            serde_json::to_string(&by_serde).unwrap()
        );
        assert_eq!(encode_batch::<OperationRef>("m", &[]).unwrap(), b"[]");
    }

    #[test]
    fn errors_marked_transient_by_code_or_data_are_retried_and_others_are_not() {
        let remote = socket_remote();
        let answers = remote.decode_batch::<()>(
            br#"[
                {"jsonrpc":"2.0","id":0,"error":{"code":2003,"message":"busy"}},
                {"jsonrpc":"2.0","id":1,"error":{"code":-32000,"message":"throttled","data":{"retryable":true,"after":"1s"}}},
                {"jsonrpc":"2.0","id":2,"error":{"code":-32000,"message":"gone","data":{"retryable":false}}},
                {"jsonrpc":"2.0","id":3,"error":{"code":-32000,"message":"odd","data":"text"}},
                {"jsonrpc":"2.0","id":4,"error":{"code":2002,"message":"no such op"}}
            ]"#,
            5,
            |_| Ok(()),
        );
        let errors: Vec<CallError> = answers.into_iter().map(|a| a.unwrap_err()).collect();
        assert_eq!(
            errors,
            [
                CallError::Transient("snapshotter example.io/copier: busy".into()),
                CallError::Transient(
                    "snapshotter example.io/copier: throttled (code -32000)".into()
                ),
                CallError::Answered("snapshotter example.io/copier: gone (code -32000)".into()),
                CallError::Answered("snapshotter example.io/copier: odd (code -32000)".into()),
                CallError::Answered(
                    "InvalidOperationId: snapshotter example.io/copier: no such op".into()
                ),
            ]
        );
        // One error object answering the whole batch is read the same way.
        let whole = remote.decode_batch::<()>(
            br#"{"jsonrpc":"2.0","id":null,"error":{"code":2003,"message":"overloaded"}}"#,
            2,
            |_| Ok(()),
        );
        let busy = CallError::Transient("snapshotter example.io/copier: overloaded".into());
        assert_eq!(whole, [Err(busy.clone()), Err(busy)]);
    }
    fn remote() -> SocketRemote {
        SocketRemote {
            name: "a.io/b".into(),
            path: "/nonexistent".into(),
            pool: Mutex::new(Vec::new()),
            settings: CallSettings {
                deadline: Duration::from_secs(1),
                batch_size: 256,
                socket_concurrency: 1,
                command_concurrency: 1,
            },
            in_flight: Semaphore::new(1),
            room: Cap::new("bytes held for peers", 64 << 20),
        }
    }

    fn progress(r: &SocketRemote, response: &str, count: usize) -> Vec<Answer<OperationProgress>> {
        r.decode_batch(response.as_bytes(), count, |raw| {
            serde_json::from_str::<OperationProgress>(raw.get())
                .map_err(|e| CallError::Answered(format!("invalid progress: {e}")))
        })
    }

    const DONE: &str = r#"{"completed":true,"nCompleted":1,"nTotal":1}"#;

    #[test]
    fn a_usual_batch_is_read_in_one_pass_in_id_order() {
        let r = remote();
        let response = format!(
            r#"[{{"jsonrpc":"2.0","id":1,"error":{{"code":2002,"message":"gone"}}}},{{"jsonrpc":"2.0","id":0,"result":{DONE}}}]"#
        );
        let answers = progress(&r, &response, 3);
        assert!(answers[0].as_ref().is_ok_and(|p| p.completed));
        assert_eq!(
            answers[1],
            Err(CallError::Answered(
                "InvalidOperationId: snapshotter a.io/b: gone".into()
            ))
        );
        assert_eq!(
            answers[2],
            Err(CallError::Answered(
                "snapshotter a.io/b left the call unanswered".into()
            ))
        );
    }

    /// A snapshotter that sends a byte that is not UTF-8 in one answer's text spoils
    /// that text, not the batch: the byte reads as U+FFFD.
    #[test]
    fn a_byte_that_is_not_utf8_spoils_one_text_not_the_batch() {
        let r = remote();
        let mut response = format!(
            r#"[{{"id":0,"result":{DONE}}},{{"id":1,"result":{{"description":"copy X"}}}}]"#
        )
        .into_bytes();
        let x = response.iter().rposition(|&b| b == b'X').unwrap();
        response[x] = 0xff;
        let answers = r.decode_batch(&response, 2, |raw| {
            serde_json::from_str::<OperationProgress>(raw.get())
                .map_err(|e| CallError::Answered(format!("invalid progress: {e}")))
        });
        assert!(
            answers[0].as_ref().is_ok_and(|p| p.completed),
            "{answers:?}"
        );
        assert_eq!(
            answers[1].as_ref().map(|p| p.description.as_str()),
            Ok("copy \u{fffd}")
        );
    }

    /// An entry whose error is malformed (no message, a code that is not a number)
    /// fails its own operation, saying what was wrong, not every operation of the batch.
    #[test]
    fn a_malformed_error_entry_fails_only_its_own_operation() {
        let r = remote();
        let response = format!(
            r#"[{{"id":0,"result":{DONE}}},{{"id":1,"error":{{"code":5}}}},{{"id":2,"error":{{"code":"2003","message":"x"}}}},{{"id":3,"result":{DONE}}}]"#
        );
        let answers = progress(&r, &response, 4);
        assert!(answers[0].is_ok() && answers[3].is_ok(), "{answers:?}");
        for (i, expected) in [
            (1, "missing field `message`"),
            (2, "invalid type: string \"2003\""),
        ] {
            assert!(
                matches!(&answers[i], Err(CallError::Answered(e)) if e.starts_with(
                    "snapshotter a.io/b answered an entry that is not a JSON-RPC response: "
                ) && e.contains(expected)),
                "{i}: {:?}",
                answers[i]
            );
        }
    }

    /// What an error entry without an id says reaches the calls left unanswered.
    #[test]
    fn an_error_without_an_id_is_said_for_the_calls_left_unanswered() {
        let r = remote();
        let response = format!(
            r#"[{{"id":0,"result":{DONE}}},{{"id":null,"error":{{"code":-32603,"message":"database on fire"}}}}]"#
        );
        let answers = progress(&r, &response, 2);
        assert!(answers[0].is_ok(), "{answers:?}");
        assert_eq!(
            answers[1],
            Err(CallError::Answered(
                "snapshotter a.io/b left the call unanswered, and answered an error without \
                 an id: database on fire (code -32603)"
                    .into()
            ))
        );
    }

    /// JSON-RPC answers each call once: a call answered twice (here once well and once
    /// finished, and once finished and once malformed) takes neither answer, and is
    /// asked again; the other calls keep theirs.
    #[test]
    fn a_call_answered_twice_takes_neither_answer() {
        let r = remote();
        let repeated = |id: u64| {
            Err(CallError::Transient(format!(
                "snapshotter a.io/b answered call {id} of the batch more than once"
            )))
        };
        let response = format!(
            r#"[{{"id":0,"result":{DONE}}},{{"id":1,"result":{DONE}}},{{"id":0,"result":{{"completed":false}}}}]"#
        );
        let answers = progress(&r, &response, 2);
        assert_eq!(answers[0], repeated(0));
        assert!(answers[1].is_ok(), "{answers:?}");
        // The same on the entry-by-entry reading (an error entry without its message).
        let response = format!(
            r#"[{{"id":0,"error":{{"code":1}}}},{{"id":1,"result":{DONE}}},{{"id":1,"result":{DONE}}},{{"id":0,"result":{DONE}}}]"#
        );
        let answers = progress(&r, &response, 2);
        assert_eq!(answers[0], repeated(0));
        assert_eq!(answers[1], repeated(1));
    }

    #[test]
    fn one_bad_entry_fails_only_its_own_operation() {
        let r = remote();
        let response = format!(
            r#"[{{"id":0,"result":{DONE}}},{{"id":1,"result":{{"completed":"yes"}}}},{{"id":2,"result":null}},{{"id":3}}]"#
        );
        let answers = progress(&r, &response, 4);
        assert!(answers[0].is_ok());
        assert!(
            matches!(&answers[1], Err(CallError::Answered(e)) if e.starts_with("invalid progress: invalid type: string \"yes\", expected a boolean")),
            "{:?}",
            answers[1]
        );
        assert!(
            matches!(&answers[2], Err(CallError::Answered(e)) if e.starts_with("invalid progress: invalid type: null")),
            "{:?}",
            answers[2]
        );
        assert_eq!(
            answers[3],
            Err(CallError::Answered(
                "snapshotter a.io/b answered without a result".into()
            ))
        );
        // Cancel's `null` results are successes.
        let cancels = r.decode_batch(br#"[{"id":0,"result":null}]"#, 1, |_| Ok(()));
        assert_eq!(cancels, vec![Ok(())]);
    }
}
