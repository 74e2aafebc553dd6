//! HTTP/1.1 on the agent's Unix socket, for calls: hyper's client connections, one
//! request at a time per connection, kept alive and pooled here.
//!
//! hyper's driver future, which does a connection's I/O, is polled by the calling task
//! next to its request rather than by a task of its own, so a round trip wakes no other
//! task; an idle connection's driver is probed once when it is taken from the pool.
//!
//! Whether a failed request reached the agent is kept apart ([`Failure::NotSent`] vs
//! [`Failure::Lost`]), because only the caller knows whether its method may be repeated.
//! hyper hands back a request it did not write, which is what tells the two apart.
//! Everything read is bounded: the head by hyper's buffer limit, the body by the caller's.

use std::future::Future;
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

/// An idle connection older than this is closed rather than reused, so a request
/// never races the agent's idle timeout closing it (which would make the request's
/// fate unknown).
const MAX_IDLE: Duration = Duration::from_secs(30);

/// Idle connections kept per client.
const MAX_POOLED: usize = 16;

/// Connects to the agent's socket at `path` and checks who serves it: the peer's
/// SO_PEERCRED uid must be root, this process's own, or one of `agent_uids`. Whoever
/// can write the socket's directory could otherwise put their own socket in its place,
/// and the answers would be theirs; the kernel's word on the peer cannot be forged.
pub(crate) async fn connect_trusted(path: &Path, agent_uids: &[u32]) -> io::Result<UnixStream> {
    let stream = UnixStream::connect(path).await?;
    let peer = stream.peer_cred()?.uid();
    let own = nix::unistd::geteuid().as_raw();
    if peer == 0 || peer == own || agent_uids.contains(&peer) {
        return Ok(stream);
    }
    Err(io::Error::new(
        io::ErrorKind::PermissionDenied,
        crate::error::UntrustedAgent { peer, own },
    ))
}

/// One HTTP answer.
pub(crate) struct Answer {
    pub status: u16,
    pub body: Bytes,
}

/// Why an exchange failed.
pub(crate) enum Failure {
    /// The request did not reach the agent (no connection, or hyper did not write it):
    /// sending it again is always safe.
    NotSent(io::Error),
    /// The request was sent, and the connection broke before the whole answer came.
    Lost(io::Error),
    /// The answer broke the protocol or a limit.
    Protocol(String),
}

type Driver = http1::Connection<TokioIo<UnixStream>, Full<Bytes>>;

/// One keep-alive connection: hyper's request handle and the driver that does its I/O.
pub(crate) struct Conn {
    sender: http1::SendRequest<Full<Bytes>>,
    driver: Pin<Box<Driver>>,
    idle_since: Instant,
}

impl Conn {
    pub async fn open(path: &Path, agent_uids: &[u32]) -> io::Result<Conn> {
        let stream = connect_trusted(path, agent_uids).await?;
        // The handshake of an HTTP/1 client connection only builds the state machine.
        let (sender, driver) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(io::Error::other)?;
        Ok(Conn {
            sender,
            driver: Box::pin(driver),
            idle_since: Instant::now(),
        })
    }

    /// Whether an idle connection may carry another request: recently used, and not
    /// closed by the agent. Polling the driver once lets it see an end of stream (or
    /// bytes nobody asked for, which hyper treats as an error) without waiting.
    fn is_reusable(&mut self) -> bool {
        if self.idle_since.elapsed() > MAX_IDLE || self.sender.is_closed() {
            return false;
        }
        let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
        match self.driver.as_mut().poll(&mut cx) {
            Poll::Pending => !self.sender.is_closed(),
            Poll::Ready(_) => false,
        }
    }

    /// POSTs `body` to `/` and reads the answer, at most `max_body` bytes of it.
    /// Returns the answer and the connection if it may carry another request.
    pub async fn post(
        self,
        body: &[u8],
        max_body: usize,
    ) -> Result<(Answer, Option<Conn>), Failure> {
        let Conn {
            mut sender,
            mut driver,
            ..
        } = self;
        let (result, driver) = {
            let exchange = exchange(&mut sender, body, max_body);
            tokio::pin!(exchange);
            // The driver ends only when the connection does: then the exchange ends
            // too (with what hyper read, or an error), once the driver is dropped.
            let early = tokio::select! {
                biased;
                result = &mut exchange => Some(result),
                _ = &mut driver => None,
            };
            match early {
                Some(result) => (result, Some(driver)),
                None => {
                    drop(driver);
                    (exchange.await, None)
                }
            }
        };
        let answer = result?;
        let conn = driver.filter(|_| !sender.is_closed()).map(|driver| Conn {
            sender,
            driver,
            idle_since: Instant::now(),
        });
        Ok((answer, conn))
    }
}

/// One request and its whole answer on `sender`.
async fn exchange(
    sender: &mut http1::SendRequest<Full<Bytes>>,
    body: &[u8],
    max_body: usize,
) -> Result<Answer, Failure> {
    sender
        .ready()
        .await
        .map_err(|e| Failure::NotSent(io::Error::other(e)))?;
    let request = hyper::Request::post("/")
        .header(hyper::header::HOST, "localhost")
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::copy_from_slice(body)))
        .map_err(|e| Failure::Protocol(format!("a request hyper refused ({e})")))?;
    let response = match sender.try_send_request(request).await {
        Ok(response) => response,
        Err(mut e) => {
            let unsent = e.take_message().is_some();
            let error = io::Error::other(e.into_error());
            return Err(if unsent {
                Failure::NotSent(error)
            } else {
                Failure::Lost(error)
            });
        }
    };
    let status = response.status().as_u16();
    let body = Limited::new(response.into_body(), max_body)
        .collect()
        .await
        .map_err(|e| match e.downcast::<LengthLimitError>() {
            Ok(_) => Failure::Protocol(format!("a response over the limit of {max_body} bytes")),
            Err(e) => Failure::Lost(io::Error::other(e)),
        })?
        .to_bytes();
    Ok(Answer { status, body })
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
        while let Some(mut conn) = idle.pop() {
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::UnixListener;

    /// A peer that reads one request head and answers `answer`, then closes.
    async fn answer_once(listener: &UnixListener, answer: &[u8]) {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            stream.read_exact(&mut byte).await.unwrap();
            head.push(byte[0]);
        }
        stream.write_all(answer).await.unwrap();
        stream.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn an_answer_over_the_limit_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(async move {
            answer_once(
                &listener,
                b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n01234567890123456789",
            )
            .await
        });
        let conn = Conn::open(&path, &[]).await.unwrap();
        match conn.post(b"{}", 10).await {
            Err(Failure::Protocol(what)) => {
                assert_eq!(what, "a response over the limit of 10 bytes")
            }
            Err(_) => panic!("another failure"),
            Ok(_) => panic!("an answer over the limit was accepted"),
        }
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_kept_alive_connection_is_reused_until_the_peer_closes_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let (close, closed) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n{}") {
                stream.read_exact(&mut byte).await.unwrap();
                head.push(byte[0]);
            }
            stream
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                .await
                .unwrap();
            let _ = closed.await;
            drop(stream);
        });
        let conn = Conn::open(&path, &[]).await.unwrap();
        let Ok((answer, Some(conn))) = conn.post(b"{}", 1024).await else {
            panic!("the exchange failed or left no connection to reuse");
        };
        assert_eq!((answer.status, &answer.body[..]), (200, &b"{}"[..]));
        let pool = Pool::default();
        pool.put(conn);
        let Some(conn) = pool.take() else {
            panic!("a live kept-alive connection was not reused");
        };
        pool.put(conn);
        // The peer closes (its task is over once it has): the pool drops it.
        close.send(()).unwrap();
        server.await.unwrap();
        assert!(pool.take().is_none());
        assert_eq!(pool.len(), 0);
    }
}
