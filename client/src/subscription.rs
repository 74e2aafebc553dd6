//! `subscribe` as a stream that outlives the agent: each subscription has a WebSocket
//! connection of its own, read by whoever polls the stream (no background task), and
//! when that connection breaks the stream reconnects and subscribes again, marking the
//! first update after it [`Update::resumed`] (it carries the full state, as the first
//! update of any subscription does, so nothing that changed in the gap is lost).
//!
//! How a subscription ends, and what the consumer sees:
//! - the owner reached a terminal phase: that update, then `None`;
//! - the agent ended it (the owner was deleted): `Some(Err(SubscriptionEnded))`, then `None`;
//! - the agent went away and did not come back within the call timeout:
//!   `Some(Err(AgentGone))`, then `None`.
//!
//! While the consumer waits, the stream pings every [`PING_EVERY`]; a ping unanswered by
//! the next one counts as a lost connection (a stopped agent keeps its socket open but
//! answers nothing). A stream nobody polls sends no pings, and the agent may close it as
//! idle; the next poll then resumes it.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use serde::Deserialize;
use serde_json::value::RawValue;
use tokio::time::Instant;

use crate::client::{Backoff, Client, Update};
use crate::error::Error;
use crate::methods::{Method, Subscribe};
use crate::types::{NameParams, OwnerKind, OwnerUpdate};
use crate::websocket::{Message, OpenError, WebSocket, WsError};

/// How often a waiting subscription pings the agent.
pub(crate) const PING_EVERY: Duration = Duration::from_secs(30);

/// The updates of one owner; see the module's documentation. Implements
/// [`futures_core::Stream`]; [`Subscription::next`] needs no extension trait.
pub struct Subscription {
    kind: OwnerKind,
    name: String,
    updates: Pin<Box<dyn futures_core::Stream<Item = Result<Update, Error>> + Send>>,
}

/// What one poll of the state machine gives: an item (or the end), and the state to go
/// on with (none once ended).
type Step = (Option<Result<Update, Error>>, Option<State>);

struct Live {
    ws: WebSocket,
    /// The subscription's id, as the agent gave it (a number or a string).
    id: serde_json::Value,
}

struct State {
    client: Client,
    kind: OwnerKind,
    name: String,
    live: Option<Live>,
    /// The next update is the first after a reconnect.
    resumed: bool,
    /// When the connection was lost, for the give-up deadline.
    lost_at: Option<Instant>,
}

/// A notification's params: an update or the reason the agent ended the subscription.
#[derive(Deserialize)]
struct NotificationParams<'a> {
    subscription: serde_json::Value,
    #[serde(borrow, default)]
    result: Option<&'a RawValue>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Incoming<'a> {
    #[serde(default)]
    id: Option<serde_json::Value>,
    #[serde(default)]
    method: Option<String>,
    #[serde(borrow, default)]
    params: Option<NotificationParams<'a>>,
    #[serde(borrow, default)]
    result: Option<&'a RawValue>,
    #[serde(default)]
    error: Option<crate::client::RpcErrorObject>,
}

/// Why one attempt at (re)subscribing failed.
enum Attempt {
    /// Worth another try: the agent is not (yet) reachable.
    Again(Error),
    /// Final: the agent answered no.
    Fatal(Error),
}

impl State {
    fn path_error(
        &self,
        what: String,
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Error {
        Error::Protocol {
            path: self.client.socket().to_path_buf(),
            what,
            source,
        }
    }

    /// Opens a connection and subscribes, within the connect timeout.
    async fn attempt(&self) -> Result<Live, Attempt> {
        let path = self.client.socket().to_path_buf();
        let config = self.client.config();
        let timeout = config.connect_timeout;
        let subscribe = async {
            let mut ws = match WebSocket::open(&path, config.max_response, &config.agent_uids).await
            {
                Ok(ws) => ws,
                // Another user's socket in the agent's place does not go away by itself.
                Err(OpenError::Connect(source))
                    if source.kind() == std::io::ErrorKind::PermissionDenied =>
                {
                    return Err(Attempt::Fatal(Error::Connect {
                        path,
                        peer: config.peer.clone(),
                        source,
                    }))
                }
                Err(OpenError::Connect(source)) => {
                    return Err(Attempt::Again(Error::Connect {
                        path,
                        peer: self.client.config().peer.clone(),
                        source,
                    }))
                }
                Err(OpenError::Io(source)) => {
                    return Err(Attempt::Again(Error::Io { path, source }))
                }
                Err(OpenError::Refused { status, body }) => {
                    let body = crate::text::escape_controls(body.trim()).into_owned();
                    let error = Error::Http { path, status, body };
                    // Too many connections: shed before anything was read.
                    return Err(if matches!(status, 429 | 503) {
                        Attempt::Again(error)
                    } else {
                        Attempt::Fatal(error)
                    });
                }
                Err(OpenError::Protocol(what)) => {
                    return Err(Attempt::Fatal(self.path_error(what, None)))
                }
            };
            let method = Subscribe::DECL.name(self.kind);
            let request = serde_json::json!({
                "jsonrpc": "2.0",
                "id": 1,
                "method": method,
                "params": NameParams { name: self.name.clone() },
            });
            ws.send_text(request.to_string())
                .await
                .map_err(|e| match e {
                    WsError::Io(source) => Attempt::Again(Error::Io {
                        path: path.clone(),
                        source,
                    }),
                    WsError::Protocol(what) => Attempt::Fatal(self.path_error(what, None)),
                })?;
            loop {
                let message = match ws.recv().await {
                    Ok(Some(Message::Text(text))) => text,
                    Ok(Some(Message::Pong)) => continue,
                    Ok(Some(Message::Close)) | Ok(None) => {
                        return Err(Attempt::Again(Error::Io {
                            path,
                            source: std::io::Error::new(
                                std::io::ErrorKind::UnexpectedEof,
                                "the agent closed the connection before answering subscribe",
                            ),
                        }))
                    }
                    Err(WsError::Io(source)) => {
                        return Err(Attempt::Again(Error::Io { path, source }))
                    }
                    Err(WsError::Protocol(what)) => {
                        return Err(Attempt::Fatal(self.path_error(what, None)))
                    }
                };
                let incoming: Incoming<'_> = serde_json::from_str(&message).map_err(|e| {
                    Attempt::Fatal(self.path_error(
                        "a WebSocket message that is not JSON-RPC".into(),
                        Some(Box::new(e)),
                    ))
                })?;
                if incoming.id.as_ref().and_then(|i| i.as_u64()) != Some(1) {
                    continue;
                }
                if let Some(e) = incoming.error {
                    return Err(Attempt::Fatal(e.into()));
                }
                let id = incoming
                    .result
                    .and_then(|r| serde_json::from_str(r.get()).ok())
                    .ok_or_else(|| {
                        Attempt::Fatal(
                            self.path_error("a subscribe answer without an id".into(), None),
                        )
                    })?;
                return Ok(Live { ws, id });
            }
        };
        match tokio::time::timeout(timeout, subscribe).await {
            Ok(result) => result,
            Err(_) => Err(Attempt::Again(Error::Timeout {
                path: self.client.socket().to_path_buf(),
                what: format!("subscribing to {} {}", self.kind, self.name),
                after: timeout,
            })),
        }
    }

    /// Subscribes, with backoff while the agent is not reachable, until `deadline`.
    async fn subscribe_by(&mut self, deadline: Instant) -> Result<(), Attempt> {
        let mut backoff = Backoff::new();
        loop {
            match self.attempt().await {
                Ok(live) => {
                    self.live = Some(live);
                    self.lost_at = None;
                    return Ok(());
                }
                Err(Attempt::Again(_)) if Instant::now() < deadline => {
                    backoff.sleep(deadline).await
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Subscribes again after a lost connection, until the call timeout (counted from
    /// the loss) is over.
    async fn resume(&mut self) -> Result<(), Error> {
        let after = self.client.config().call_timeout;
        let deadline = *self.lost_at.get_or_insert_with(Instant::now) + after;
        match self.subscribe_by(deadline).await {
            Ok(()) => Ok(()),
            Err(Attempt::Fatal(Error::Rpc {
                code: crate::codes::Code::NotFound,
                message,
                ..
            })) => Err(Error::SubscriptionEnded {
                kind: self.kind,
                name: self.name.clone(),
                reason: message,
            }),
            Err(Attempt::Fatal(e)) => Err(e),
            Err(Attempt::Again(e)) => Err(Error::AgentGone {
                path: self.client.socket().to_path_buf(),
                after,
                source: Box::new(e),
            }),
        }
    }

    /// The next item, and the state to go on with.
    async fn step(mut self) -> Step {
        loop {
            if self.live.is_none() {
                if let Err(e) = self.resume().await {
                    return (Some(Err(e)), None);
                }
            }
            let Some(live) = self.live.as_mut() else {
                continue;
            };
            match read_update(live, &self.client).await {
                Ok(Incoming2::Update(update)) => {
                    let terminal = update.owner.phase.is_terminal();
                    let item = Update {
                        update: *update,
                        resumed: std::mem::take(&mut self.resumed),
                    };
                    return (Some(Ok(item)), (!terminal).then_some(self));
                }
                Ok(Incoming2::Ended(reason)) => {
                    let e = Error::SubscriptionEnded {
                        kind: self.kind,
                        name: self.name.clone(),
                        reason,
                    };
                    return (Some(Err(e)), None);
                }
                Err(Lost::Connection) => {
                    self.live = None;
                    self.resumed = true;
                    self.lost_at = Some(Instant::now());
                }
                Err(Lost::Fatal(e)) => return (Some(Err(e)), None),
            }
        }
    }
}

enum Incoming2 {
    Update(Box<OwnerUpdate>),
    Ended(String),
}

enum Lost {
    /// The connection broke, closed, or stopped answering pings: resume.
    Connection,
    Fatal(Error),
}

/// Reads until the next notification of this subscription, pinging while it waits.
async fn read_update(live: &mut Live, client: &Client) -> Result<Incoming2, Lost> {
    let mut next_ping = Instant::now() + PING_EVERY;
    let mut awaiting_pong = false;
    loop {
        // `recv` is cancel-safe: losing the race to the timer loses no bytes.
        let message = tokio::select! {
            message = live.ws.recv() => message,
            _ = tokio::time::sleep_until(next_ping) => {
                if awaiting_pong || live.ws.send_ping().await.is_err() {
                    return Err(Lost::Connection);
                }
                awaiting_pong = true;
                next_ping = Instant::now() + PING_EVERY;
                continue;
            }
        };
        match message {
            Ok(Some(Message::Text(text))) => {
                if let Some(item) = parse_notification(text.as_bytes(), &live.id, client)? {
                    return Ok(item);
                }
            }
            Ok(Some(Message::Pong)) => awaiting_pong = false,
            Ok(Some(Message::Close)) | Ok(None) | Err(WsError::Io(_)) => {
                return Err(Lost::Connection)
            }
            Err(WsError::Protocol(what)) => {
                return Err(Lost::Fatal(Error::Protocol {
                    path: client.socket().to_path_buf(),
                    what,
                    source: None,
                }))
            }
        }
    }
}

/// An update or end of this subscription in `text`; `None` for anything else.
fn parse_notification(
    text: &[u8],
    id: &serde_json::Value,
    client: &Client,
) -> Result<Option<Incoming2>, Lost> {
    let protocol = |what: String, source: Option<Box<dyn std::error::Error + Send + Sync>>| {
        Lost::Fatal(Error::Protocol {
            path: client.socket().to_path_buf(),
            what,
            source,
        })
    };
    let incoming: Incoming<'_> = serde_json::from_slice(text).map_err(|e| {
        protocol(
            "a WebSocket message that is not JSON-RPC".into(),
            Some(Box::new(e)),
        )
    })?;
    let Some(params) = incoming.params else {
        return Ok(None);
    };
    if incoming.method.is_none() || &params.subscription != id {
        return Ok(None);
    }
    if let Some(error) = params.error {
        let reason = match error {
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        };
        return Ok(Some(Incoming2::Ended(reason)));
    }
    let raw = params
        .result
        .ok_or_else(|| protocol("a notification with neither result nor error".into(), None))?;
    let update: OwnerUpdate = serde_json::from_str(raw.get()).map_err(|e| {
        protocol(
            "an update that is not an OwnerUpdate".into(),
            Some(Box::new(e)),
        )
    })?;
    Ok(Some(Incoming2::Update(Box::new(update))))
}

impl Subscription {
    /// Subscribes; fails at once (after the usual reconnect attempts) if the owner
    /// does not exist, with the agent's 1001.
    pub(crate) async fn start(
        client: Client,
        kind: OwnerKind,
        name: &str,
    ) -> Result<Subscription, Error> {
        let mut state = State {
            client,
            kind,
            name: name.to_string(),
            live: None,
            resumed: false,
            lost_at: None,
        };
        let deadline = Instant::now() + state.client.config().call_timeout;
        if let Err(Attempt::Again(e) | Attempt::Fatal(e)) = state.subscribe_by(deadline).await {
            return Err(e);
        }
        // Fused: after its end the stream keeps answering `None` (an unfold would panic).
        use futures_util::StreamExt;
        let updates = futures_util::stream::unfold(Some(state), |state| async move {
            let (item, next) = state?.step().await;
            item.map(|item| (item, next))
        })
        .fuse();
        Ok(Subscription {
            kind,
            name: name.to_string(),
            updates: Box::pin(updates),
        })
    }

    /// The next update; `None` after the terminal update or after the error that ended
    /// the subscription.
    ///
    /// # Errors
    /// An item is [`Error::SubscriptionEnded`] when the agent ended the subscription (the owner
    /// was deleted), [`Error::AgentGone`] when the agent did not come back in time; `None`
    /// follows either.
    ///
    /// ```no_run
    /// # async fn demo(client: opmon_client::Client) -> Result<(), opmon_client::Error> {
    /// let mut updates = client.backups().subscribe("nightly-1").await?;
    /// while let Some(update) = updates.next().await {
    ///     let update = update?;
    ///     println!("{} ({} operations changed)", update.owner.phase, update.operations.len());
    ///     if update.owner.phase.is_finalizing() {
    ///         break;
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn next(&mut self) -> Option<Result<Update, Error>> {
        std::future::poll_fn(|cx| self.updates.as_mut().poll_next(cx)).await
    }
}

impl futures_core::Stream for Subscription {
    type Item = Result<Update, Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().updates.as_mut().poll_next(cx)
    }
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("kind", &self.kind)
            .field("name", &self.name)
            .finish()
    }
}
