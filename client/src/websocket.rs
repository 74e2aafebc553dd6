//! WebSocket on the agent's Unix socket, for subscriptions: tokio-tungstenite's client
//! over a `UnixStream`, narrowed to what a subscription needs (text both ways, ping and
//! pong, close) and to errors sorted by what the subscription does next: a broken
//! connection is resumed, a broken protocol ends the stream.
//!
//! Receiving is cancel-safe (tungstenite keeps a partly read frame in its buffer), so a
//! subscription may race [`WebSocket::recv`] against its ping timer. Pings from the agent
//! are answered by tungstenite. Every message and frame is bounded by the limit given to
//! [`WebSocket::open`].

use std::io;
use std::path::Path;

use futures_util::{SinkExt, StreamExt};
use tokio::net::UnixStream;
use tokio_tungstenite::tungstenite::error::ProtocolError;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{self, Message as WsMessage};
use tokio_tungstenite::WebSocketStream;

/// What a message was.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Message {
    Text(String),
    Pong,
    /// The server closed the connection (a close frame).
    Close,
}

/// Why opening failed.
pub(crate) enum OpenError {
    /// No connection: as for calls, safe to try again.
    Connect(io::Error),
    /// The connection broke during the handshake.
    Io(io::Error),
    /// The server answered, but not with a WebSocket upgrade.
    Refused { status: u16, body: String },
    /// The answer broke the protocol.
    Protocol(String),
}

/// Why receiving or sending failed.
pub(crate) enum WsError {
    /// The connection broke (or the agent went away without a close frame): resume.
    Io(io::Error),
    /// The agent broke the protocol or a limit.
    Protocol(String),
}

/// One WebSocket connection.
pub(crate) struct WebSocket {
    stream: WebSocketStream<UnixStream>,
}

impl WebSocket {
    /// Connects to `path` and performs the opening handshake.
    pub async fn open(
        path: &Path,
        max_message: usize,
        agent_uids: &[u32],
    ) -> Result<WebSocket, OpenError> {
        let socket = crate::connection::connect_trusted(path, agent_uids)
            .await
            .map_err(OpenError::Connect)?;
        let config = WebSocketConfig::default()
            .max_message_size(Some(max_message))
            .max_frame_size(Some(max_message));
        // The URI only names the Host header and the path: the socket is already open.
        match tokio_tungstenite::client_async_with_config("ws://localhost/", socket, Some(config))
            .await
        {
            Ok((stream, _)) => Ok(WebSocket { stream }),
            Err(tungstenite::Error::Http(response)) => Err(OpenError::Refused {
                status: response.status().as_u16(),
                body: String::from_utf8_lossy(response.body().as_deref().unwrap_or_default())
                    .into_owned(),
            }),
            Err(e) => Err(match sort(e) {
                WsError::Io(e) => OpenError::Io(e),
                WsError::Protocol(what) => {
                    OpenError::Protocol(format!("a bad WebSocket handshake answer ({what})"))
                }
            }),
        }
    }

    pub async fn send_text(&mut self, text: String) -> Result<(), WsError> {
        self.stream.send(WsMessage::text(text)).await.map_err(sort)
    }

    pub async fn send_ping(&mut self) -> Result<(), WsError> {
        self.stream
            .send(WsMessage::Ping(bytes::Bytes::from_static(b"opmon")))
            .await
            .map_err(sort)
    }

    /// The next message; `Ok(None)` at the end of the stream. Pings are answered, not
    /// returned. Cancel-safe.
    pub async fn recv(&mut self) -> Result<Option<Message>, WsError> {
        loop {
            return match self.stream.next().await {
                None => Ok(None),
                Some(Err(e)) => match sort(e) {
                    // A clean end after the close handshake.
                    WsError::Io(e) if e.kind() == io::ErrorKind::NotConnected => Ok(None),
                    other => Err(other),
                },
                Some(Ok(WsMessage::Text(text))) => Ok(Some(Message::Text(text.to_string()))),
                Some(Ok(WsMessage::Binary(bytes))) => match String::from_utf8(bytes.to_vec()) {
                    Ok(text) => Ok(Some(Message::Text(text))),
                    Err(_) => Err(WsError::Protocol(
                        "a binary message that is not UTF-8".into(),
                    )),
                },
                Some(Ok(WsMessage::Pong(_))) => Ok(Some(Message::Pong)),
                Some(Ok(WsMessage::Close(_))) => Ok(Some(Message::Close)),
                Some(Ok(WsMessage::Ping(_) | WsMessage::Frame(_))) => continue,
            };
        }
    }
}

/// Sorts tungstenite's errors into "the connection is gone" and "the agent misbehaved".
fn sort(e: tungstenite::Error) -> WsError {
    use tungstenite::Error as E;
    match e {
        E::Io(e) => WsError::Io(e),
        E::ConnectionClosed | E::AlreadyClosed => WsError::Io(io::Error::new(
            io::ErrorKind::NotConnected,
            "the WebSocket connection is closed",
        )),
        // A killed agent: the stream ends without a close frame.
        E::Protocol(ProtocolError::ResetWithoutClosingHandshake) => WsError::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the agent closed the connection without a close frame",
        )),
        E::Protocol(ProtocolError::HandshakeIncomplete) => WsError::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the agent closed the connection during the WebSocket handshake",
        )),
        E::Capacity(e) => WsError::Protocol(format!("a message over the limit ({e})")),
        other => WsError::Protocol(other.to_string()),
    }
}
