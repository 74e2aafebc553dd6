//! Why the agent refused a connection. A refused WebSocket handshake reports only its
//! HTTP status, so the client asks once more with a plain HTTP request and reads the
//! JSON-RPC error the agent answers refused peers with (403 or 429, a message naming
//! the rule). Bounded: one small request, at most 64 KiB read, within 5 seconds.

use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

const MAX_ANSWER: u64 = 64 * 1024;
const DEADLINE: Duration = Duration::from_secs(5);

/// The agent's reason for refusing connections from this process, if it gives one.
pub(crate) async fn reason(socket: &Path) -> Option<String> {
    tokio::time::timeout(DEADLINE, ask(socket)).await.ok()?
}

async fn ask(socket: &Path) -> Option<String> {
    let mut stream = UnixStream::connect(socket).await.ok()?;
    let body = r#"{"jsonrpc":"2.0","id":0,"method":"agent.status"}"#;
    let request = format!(
        "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut answer = Vec::new();
    // A reset after the answer (the agent closes at once) still leaves the answer read.
    let _ = (&mut stream)
        .take(MAX_ANSWER)
        .read_to_end(&mut answer)
        .await;
    let text = String::from_utf8_lossy(&answer);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?;
    if status == "200" {
        return None;
    }
    let error: serde_json::Value = serde_json::from_str(body.trim()).ok()?;
    let message = error["error"]["message"].as_str()?;
    Some(format!("{message} (HTTP {status})"))
}
