//! The client side of WebSocket (RFC 6455) on the agent's Unix socket, as much as
//! subscriptions need: the opening handshake, text messages both ways, ping/pong and
//! close. Written here so a client links no WebSocket stack; the agent's server is
//! jsonrpsee's.
//!
//! Reading is cancel-safe: bytes read stay in the buffer until a whole frame is there,
//! so a subscription may race [`WebSocket::read_more`] against a timer. Every message is
//! bounded by the limit given at [`WebSocket::open`].

use std::hash::{BuildHasher, Hasher};
use std::io;
use std::path::Path;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::connection::MAX_HEAD;

/// What a frame or message was.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Message {
    Text(Vec<u8>),
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

/// One WebSocket connection.
pub(crate) struct WebSocket {
    stream: UnixStream,
    buf: Vec<u8>,
    /// A message being reassembled from fragments.
    partial: Option<Vec<u8>>,
    max_message: usize,
}

/// 64 bits that differ per call and per process: masks and the handshake key need to
/// be unpredictable to intermediaries, not cryptographically strong (RFC 6455 10.3).
fn random_u64() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

impl WebSocket {
    /// Connects to `path` and performs the opening handshake.
    pub async fn open(path: &Path, max_message: usize) -> Result<WebSocket, OpenError> {
        let mut stream = UnixStream::connect(path)
            .await
            .map_err(OpenError::Connect)?;
        let mut nonce = [0u8; 16];
        nonce[..8].copy_from_slice(&random_u64().to_le_bytes());
        nonce[8..].copy_from_slice(&random_u64().to_le_bytes());
        let key = base64(&nonce);
        let request = format!(
            "GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        );
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(OpenError::Connect)?;
        let mut buf = Vec::with_capacity(8 * 1024);
        loop {
            if stream.read_buf(&mut buf).await.map_err(OpenError::Io)? == 0 {
                return Err(OpenError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the agent closed the connection during the WebSocket handshake",
                )));
            }
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut response = httparse::Response::new(&mut headers);
            match response.parse(&buf) {
                Ok(httparse::Status::Complete(len)) => {
                    let status = response.code.unwrap_or(0);
                    if status != 101 {
                        let body = String::from_utf8_lossy(&buf[len..]).into_owned();
                        return Err(OpenError::Refused { status, body });
                    }
                    let expected = accept_key(&key);
                    let accepted = response.headers.iter().any(|h| {
                        h.name.eq_ignore_ascii_case("sec-websocket-accept")
                            && h.value == expected.as_bytes()
                    });
                    if !accepted {
                        return Err(OpenError::Protocol(
                            "a WebSocket upgrade without the right Sec-WebSocket-Accept".into(),
                        ));
                    }
                    buf.drain(..len);
                    return Ok(WebSocket {
                        stream,
                        buf,
                        partial: None,
                        max_message,
                    });
                }
                Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => {}
                Ok(httparse::Status::Partial) => {
                    return Err(OpenError::Protocol(format!(
                        "a handshake answer over {MAX_HEAD} bytes"
                    )))
                }
                Err(e) => {
                    return Err(OpenError::Protocol(format!(
                        "a malformed handshake answer ({e})"
                    )))
                }
            }
        }
    }

    async fn send_frame(&mut self, opcode: u8, payload: &[u8]) -> io::Result<()> {
        let mut frame = Vec::with_capacity(payload.len() + 14);
        frame.push(0x80 | opcode);
        match payload.len() {
            n if n < 126 => frame.push(0x80 | n as u8),
            n if n <= 0xffff => {
                frame.push(0x80 | 126);
                frame.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                frame.push(0x80 | 127);
                frame.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        let mask = (random_u64() as u32).to_be_bytes();
        frame.extend_from_slice(&mask);
        frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        self.stream.write_all(&frame).await
    }

    pub async fn send_text(&mut self, text: &[u8]) -> io::Result<()> {
        self.send_frame(0x1, text).await
    }

    pub async fn send_ping(&mut self) -> io::Result<()> {
        self.send_frame(0x9, b"opmon").await
    }

    /// Reads what the socket has into the buffer; `Ok(0)` at end of stream. Cancel-safe.
    pub async fn read_more(&mut self) -> io::Result<usize> {
        if self.buf.capacity() - self.buf.len() < 4096 {
            self.buf.reserve(16 * 1024);
        }
        self.stream.read_buf(&mut self.buf).await
    }

    /// The next whole message in the buffer, if one is there. A ping is answered here
    /// (so the caller never sees it).
    pub async fn next_buffered(&mut self) -> Result<Option<Message>, WsError> {
        loop {
            let Some((fin, opcode, payload)) = self.take_frame()? else {
                return Ok(None);
            };
            match opcode {
                0x9 => self.send_frame(0xA, &payload).await.map_err(WsError::Io)?,
                0xA => return Ok(Some(Message::Pong)),
                0x8 => return Ok(Some(Message::Close)),
                0x1 | 0x2 if self.partial.is_some() => {
                    return Err(WsError::Protocol(
                        "a new message inside a fragmented one".into(),
                    ))
                }
                0x1 | 0x2 if fin => return Ok(Some(Message::Text(payload))),
                0x1 | 0x2 => self.partial = Some(payload),
                0x0 => {
                    let Some(mut message) = self.partial.take() else {
                        return Err(WsError::Protocol(
                            "a continuation frame out of place".into(),
                        ));
                    };
                    if message.len() + payload.len() > self.max_message {
                        return Err(WsError::Protocol(format!(
                            "a message over the limit of {} bytes",
                            self.max_message
                        )));
                    }
                    message.extend_from_slice(&payload);
                    if fin {
                        return Ok(Some(Message::Text(message)));
                    }
                    self.partial = Some(message);
                }
                other => return Err(WsError::Protocol(format!("a frame of opcode {other}"))),
            }
        }
    }

    /// Removes one whole frame from the buffer: (fin, opcode, unmasked payload).
    fn take_frame(&mut self) -> Result<Option<(bool, u8, Vec<u8>)>, WsError> {
        let b = &self.buf;
        if b.len() < 2 {
            return Ok(None);
        }
        let fin = b[0] & 0x80 != 0;
        let opcode = b[0] & 0x0f;
        let masked = b[1] & 0x80 != 0;
        let (len, mut at) = match b[1] & 0x7f {
            126 if b.len() >= 4 => (u64::from(u16::from_be_bytes([b[2], b[3]])), 4),
            127 if b.len() >= 10 => {
                let mut n = [0u8; 8];
                n.copy_from_slice(&b[2..10]);
                (u64::from_be_bytes(n), 10)
            }
            126 | 127 => return Ok(None),
            n => (u64::from(n), 2),
        };
        if len > self.max_message as u64 {
            return Err(WsError::Protocol(format!(
                "a frame of {len} bytes, over the limit of {}",
                self.max_message
            )));
        }
        let len = len as usize;
        let mask = if masked {
            if b.len() < at + 4 {
                return Ok(None);
            }
            let m = [b[at], b[at + 1], b[at + 2], b[at + 3]];
            at += 4;
            Some(m)
        } else {
            None
        };
        if b.len() < at + len {
            return Ok(None);
        }
        let mut payload = b[at..at + len].to_vec();
        if let Some(m) = mask {
            for (i, byte) in payload.iter_mut().enumerate() {
                *byte ^= m[i % 4];
            }
        }
        self.buf.drain(..at + len);
        Ok(Some((fin, opcode, payload)))
    }
}

/// Why reading a message failed.
pub(crate) enum WsError {
    Io(io::Error),
    Protocol(String),
}

/// `Sec-WebSocket-Accept` for `key`: base64(SHA-1(key + the RFC's GUID)).
fn accept_key(key: &str) -> String {
    base64(&sha1(
        format!("{key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11").as_bytes(),
    ))
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = (u32::from(chunk[0]) << 16)
            | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8)
            | u32::from(*chunk.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 0x3f) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// SHA-1 (FIPS 180-4), for the handshake only.
fn sha1(data: &[u8]) -> [u8; 20] {
    let mut h: [u32; 5] = [0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476, 0xC3D2E1F0];
    let mut message = data.to_vec();
    message.push(0x80);
    while message.len() % 64 != 56 {
        message.push(0);
    }
    message.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in message.chunks(64) {
        let mut w = [0u32; 80];
        for (i, word) in block.chunks(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..80 {
            w[i] = (w[i - 3] ^ w[i - 8] ^ w[i - 14] ^ w[i - 16]).rotate_left(1);
        }
        let [mut a, mut b, mut c, mut d, mut e] = h;
        for (i, wi) in w.iter().enumerate() {
            let (f, k) = match i {
                0..=19 => ((b & c) | (!b & d), 0x5A827999),
                20..=39 => (b ^ c ^ d, 0x6ED9EBA1),
                40..=59 => ((b & c) | (b & d) | (c & d), 0x8F1BBCDC),
                _ => (b ^ c ^ d, 0xCA62C1D6),
            };
            let t = a
                .rotate_left(5)
                .wrapping_add(f)
                .wrapping_add(e)
                .wrapping_add(k)
                .wrapping_add(*wi);
            e = d;
            d = c;
            c = b.rotate_left(30);
            b = a;
            a = t;
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e]) {
            *x = x.wrapping_add(y);
        }
    }
    let mut out = [0u8; 20];
    for (i, x) in h.iter().enumerate() {
        out[i * 4..i * 4 + 4].copy_from_slice(&x.to_be_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_accept_key_is_the_rfc_example() {
        // RFC 6455 section 1.3.
        assert_eq!(
            accept_key("dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    #[test]
    fn sha1_and_base64_match_known_values() {
        assert_eq!(
            base64(&sha1(b"abc")),
            base64(&[
                0xa9, 0x99, 0x3e, 0x36, 0x47, 0x06, 0x81, 0x6a, 0xba, 0x3e, 0x25, 0x71, 0x78, 0x50,
                0xc2, 0x6c, 0x9c, 0xd0, 0xd8, 0x9d
            ])
        );
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b""), "");
    }
}
