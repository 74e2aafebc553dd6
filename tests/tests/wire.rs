//! End-to-end: the edge of the agent as a peer meets it on the wire, byte by byte. Each
//! test is an attack once found on the socket (or a rule a unit test of the server
//! checked from inside), replayed against the real binary and asserted by what a user
//! sees: a clear refusal, the connection closed, the agent's memory and sockets under a
//! ceiling, everyone else answered, nothing stored lost. They pin outcomes, not how the
//! server gets there, so the edge can be rebuilt under them.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use opmon_tests::raw::{
    frame, json_body, open_sockets, post_head, quiescent, read_head, read_to_close, send,
    status_bytes, status_of, websocket, ws_answer, ws_closed, ws_send, CONTINUATION, PING, TEXT,
};
use opmon_tests::{try_eventually, Agent, RawHttp};
use serde_json::{json, Value};

fn request(method: &str, params: Value) -> String {
    json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string()
}

/// `agent.status` padded with whitespace to `size` bytes: a large body that costs the
/// agent nothing to answer.
fn padded_status(size: usize) -> String {
    let call = r#"{"jsonrpc":"2.0","id":7,"method":"agent.status","params":{}"#;
    format!(
        "{call}{}}}",
        " ".repeat(size.saturating_sub(call.len() + 1))
    )
}

/// POSTs `body` on a new connection and reads the whole response (the agent closes
/// after it: `Connection: close`).
fn post_alone(socket: &Path, body: &str) -> String {
    let head = format!(
        "POST / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let mut stream = send(socket, head.as_bytes());
    stream.write_all(body.as_bytes()).expect("writing the body");
    read_to_close(&mut stream)
}

/// Asserts that `response` answers the padded `agent.status` of [`padded_status`].
fn assert_status_answered(response: &str, while_: &str) {
    assert_eq!(status_of(response), 200, "{while_}: {response}");
    let answer = json_body(response);
    assert!(
        answer["result"]["version"].is_string(),
        "{while_}: {answer}"
    );
}

/// The agent's peak resident set so far.
fn peak(agent: &Agent) -> u64 {
    status_bytes(agent.pid(), "VmHWM:")
}

/// `calls` threads each sending its bytes on a connection of its own; returns the
/// connections once every write has gone through, or fails naming `what` if that does
/// not happen within `within` (the agent did not read them).
fn all_sent(calls: Vec<(UnixStream, Vec<u8>)>, within: Duration, what: &str) -> Vec<UnixStream> {
    let (done, finished) = std::sync::mpsc::channel();
    let count = calls.len();
    for (mut stream, bytes) in calls {
        let done = done.clone();
        std::thread::spawn(move || {
            let written = stream.write_all(&bytes);
            let _ = done.send((stream, written));
        });
    }
    let deadline = std::time::Instant::now() + within;
    let mut streams = Vec::new();
    for _ in 0..count {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let (stream, written) = finished
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("not within {within:?}: {what}"));
        written.unwrap_or_else(|e| panic!("{what}: {e}"));
        streams.push(stream);
    }
    streams
}

/// Whether `stream` has neither an answer nor its end waiting: the agent still holds
/// the request.
fn still_waiting(stream: &UnixStream) -> bool {
    stream.set_nonblocking(true).expect("O_NONBLOCK");
    let mut byte = [0; 1];
    let waiting = matches!(
        (&*stream).read(&mut byte),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
    );
    stream.set_nonblocking(false).expect("blocking again");
    waiting
}

/// A WebSocket frame without a mask (which RFC 6455 forbids a client to send) closes
/// its connection before its payload is read: 40 peers each declaring a 16 MB message
/// in an unmasked frame leave the agent's memory where it was, their sockets closed,
/// and everyone else answered (before, such frames went around the bound on large
/// messages: 625 MiB).
#[test]
fn websocket_frames_without_a_mask_close_the_connection_and_hold_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let pid = agent.pid();
    let before = peak(&agent);
    let sockets = open_sockets(pid);
    let mut header = vec![0x81u8, 127];
    header.extend_from_slice(&16_000_000u64.to_be_bytes());
    let mut held: Vec<UnixStream> = (0..40)
        .map(|_| {
            let mut ws = websocket(&agent.socket);
            ws.write_all(&header).unwrap();
            // Part of the payload: the agent may close before it is written.
            let _ = ws.write_all(&[b' '; 60_000]);
            ws
        })
        .collect();
    for ws in &mut held {
        ws_closed(ws);
    }
    let mut http = RawHttp::connect(&agent.socket);
    let status = http.call(&request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
    let grown = peak(&agent).saturating_sub(before);
    assert!(
        grown < 64 << 20,
        "40 unmasked 16 MB frames grew the agent's peak RSS by {} MiB",
        grown >> 20
    );
    drop(http);
    drop(held);
    assert!(
        try_eventually(Duration::from_secs(30), || open_sockets(pid) <= sockets).is_some(),
        "the unmasked peers' sockets stayed open: {} against {sockets}",
        open_sockets(pid)
    );
}

/// A text message may come in fragments, a character split between two and a ping
/// between them: it is answered. A text message that is not UTF-8 once its fragments
/// are put together (one ends within a character, the next does not finish it) is
/// answered as an invalid request (jsonrpsee's own reading of it), the connection
/// goes on, and the agent serves everyone else.
#[test]
fn text_in_fragments_is_answered_and_broken_utf8_across_them_is_an_invalid_request() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let call = request("backup.get", json!({"name": "é€😀"}));
    let bytes = call.as_bytes();
    let euro = bytes.iter().position(|&b| b == 0xe2).unwrap() + 1;
    let (first, second) = bytes.split_at(euro);
    let mut ws = websocket(&agent.socket);
    let message = [
        frame(false, TEXT, first, true),
        frame(true, PING, b"\xff", true),
        frame(true, CONTINUATION, second, true),
    ]
    .concat();
    ws.write_all(&message).unwrap();
    let answer = ws_answer(&mut ws);
    assert_eq!(answer["id"], 1, "{answer}");
    assert_eq!(
        answer["error"]["code"], -32602,
        "the name was read: {answer}"
    );

    let broken = [
        frame(false, TEXT, first, true),
        frame(true, CONTINUATION, b"x\"}}", true),
    ]
    .concat();
    ws.write_all(&broken).unwrap();
    let answer = ws_answer(&mut ws);
    assert_eq!(answer["error"]["code"], -32600, "{answer}");
    ws_send(&mut ws, request("agent.status", json!({})).as_bytes()).unwrap();
    let answer = ws_answer(&mut ws);
    assert!(
        answer["result"]["version"].is_string(),
        "the connection goes on: {answer}"
    );

    let mut other = websocket(&agent.socket);
    ws_send(&mut other, request("agent.status", json!({})).as_bytes()).unwrap();
    let answer = ws_answer(&mut other);
    assert!(answer["result"]["version"].is_string(), "{answer}");
}

/// A large message may come in small fragments, with pings between them: it is
/// answered. Peers that send small fragments adding up past what is small and then
/// stop are closed within seconds, and meanwhile a large request of someone else is
/// answered (the fragments add up as one message: before, each fragment was small on
/// its own and nothing bounded them).
#[test]
fn large_websocket_messages_in_small_fragments_are_answered_or_closed_when_they_stall() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let text = padded_status(100_000);
    let pieces: Vec<&[u8]> = text.as_bytes().chunks(20_000).collect();
    let mut message = Vec::new();
    for (i, piece) in pieces.iter().enumerate() {
        let opcode = if i == 0 { TEXT } else { CONTINUATION };
        message.extend(frame(i == pieces.len() - 1, opcode, piece, true));
        message.extend(frame(true, PING, b"p", true));
    }
    let mut ws = websocket(&agent.socket);
    ws.write_all(&message).unwrap();
    let answer = ws_answer(&mut ws);
    assert!(answer["result"]["version"].is_string(), "{answer}");

    let unfinished: Vec<u8> = pieces[..4]
        .iter()
        .enumerate()
        .flat_map(|(i, piece)| frame(false, if i == 0 { TEXT } else { CONTINUATION }, piece, true))
        .collect();
    let mut stalled: Vec<UnixStream> = (0..8)
        .map(|_| {
            let mut ws = websocket(&agent.socket);
            ws.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            ws.write_all(&unfinished).unwrap();
            ws
        })
        .collect();
    let response = post_alone(&agent.socket, &padded_status(200_000));
    assert_status_answered(&response, "8 fragmented messages stalled");
    for ws in &mut stalled {
        ws_closed(ws);
    }
}

/// Peers that send the head of a large request and then trickle its body are answered
/// 408 once the body timeout (30 s) has passed, saying how much of the body came, and
/// closed; meanwhile a large request sent whole is read and answered (before, 12
/// trickling peers delayed a large `addOperations` by 88 s). Their bodies are charged to
/// their uid's request bytes, not to everyone's reads.
#[test]
fn large_bodies_that_trickle_are_answered_408_and_leave_others_read() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let declared = 65_537;
    let mut slow: Vec<UnixStream> = (0..12)
        .map(|_| {
            send(
                &agent.socket,
                format!("{}[", post_head(declared)).as_bytes(),
            )
        })
        .collect();
    let response = post_alone(&agent.socket, &padded_status(200_000));
    assert_status_answered(&response, "12 large bodies trickled");
    for stream in &mut slow {
        let response = read_to_close(stream);
        assert_eq!(status_of(&response), 408, "{response}");
        let message = json_body(&response)["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(
            message.contains("did not arrive within 30s of its head")
                && message.contains("(1 of its 65537 bytes came)")
                && message.contains("send the whole body at once"),
            "{message}"
        );
    }
}

/// A request whose small body never comes whole is answered 408 once the agent has
/// waited long enough for it, saying how much came, and closed (before, it was held
/// until the idle timeout, 15 minutes). Takes the agent's body timeout, 30 s.
#[test]
fn a_small_body_that_never_comes_whole_is_answered_408() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let mut stream = send(&agent.socket, format!("{}{{", post_head(200)).as_bytes());
    let response = read_to_close(&mut stream);
    assert_eq!(status_of(&response), 408, "{response}");
    let message = json_body(&response)["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        message.contains("did not arrive within") && message.contains("(1 of its 200 bytes came)"),
        "{message}"
    );
}

/// `backup.wait` padded with `pad` bytes of whitespace, with `id`.
fn padded_wait(id: &str, pad: usize) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"backup.wait","params":{{"name":"b","until":"terminal","timeout":"600s"}}{}}}"#,
        " ".repeat(pad)
    )
}

/// Calls that wait, in bodies made large by whitespace, hold their bytes while they wait,
/// charged to the total of bytes held for peers (`max_held_bytes`), and no read of
/// anyone else's: six such `backup.wait` of 8 MB each are all read, a large request is answered
/// while they wait, and the agent's memory grows by what they hold, not more (before,
/// four of them held every read of a large body for their ten minutes; 30 of 16 MB held
/// 540 MiB).
#[test]
fn padded_waits_hold_their_bytes_within_the_total_and_no_one_elses_read() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let mut http = RawHttp::connect(&agent.socket);
    http.call(&request("backup.start", json!({"name": "b", "uid": "u"})));
    let before = peak(&agent);
    let wait = padded_wait("1", 8 << 20);
    let calls = (0..6)
        .map(|_| {
            let stream = send(&agent.socket, post_head(wait.len()).as_bytes());
            (stream, wait.clone().into_bytes())
        })
        .collect();
    let waiting = all_sent(calls, Duration::from_secs(60), "6 padded waits were read");
    let response = post_alone(&agent.socket, &padded_status(200_000));
    assert_status_answered(&response, "6 padded waits waited");
    assert!(
        waiting.iter().all(still_waiting),
        "a wait was answered or closed"
    );
    let grown = peak(&agent).saturating_sub(before);
    assert!(
        grown < 80 << 20,
        "6 padded waits of 8 MB grew the agent's peak RSS by {} MiB",
        grown >> 20
    );
    let got = http.call(&request("backup.get", json!({"name": "b"})));
    assert_eq!(got["result"]["phase"], "InProgress", "{got}");
}

/// A value of megabytes where a number belongs is refused with a message that names
/// the field and quotes the value cut short (before, the 2 MB string came back whole).
#[test]
fn a_huge_value_in_the_wrong_place_is_refused_with_a_short_message() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let mut http = RawHttp::connect(&agent.socket);
    let huge = "9".repeat(2 << 20);
    let answer = http.call(&request(
        "backup.events",
        json!({"name": "b", "limit": huge}),
    ));
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert_eq!(answer["error"]["code"], -32602, "{answer:.300}");
    assert!(message.starts_with("limit: "), "{message:.300}");
    assert!(
        message.len() <= 1024,
        "a message of {} bytes",
        message.len()
    );
}

/// `Expect: 100-continue`: a client that waits for the go-ahead gets it and then its
/// answer; one whose declared body is over the limit is refused with 413 at once,
/// without being asked for the body.
#[test]
fn a_client_expecting_100_continue_gets_it_or_the_refusal_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let body = request("agent.status", json!({}));
    let expecting = |length: usize| {
        format!(
            "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Expect: 100-continue\r\nContent-Length: {length}\r\n\r\n"
        )
    };
    let mut stream = send(&agent.socket, expecting(body.len()).as_bytes());
    let go = read_head(&mut stream);
    assert!(go.starts_with("HTTP/1.1 100"), "{go}");
    stream.write_all(body.as_bytes()).unwrap();
    let mut http = RawHttp::connect(&agent.socket);
    let head = read_head(&mut stream);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");

    let mut stream = send(&agent.socket, expecting(17 << 20).as_bytes());
    let response = read_to_close(&mut stream);
    assert_eq!(status_of(&response), 413, "{response}");
    let error = &json_body(&response)["error"];
    assert_eq!(error["code"], -32007, "{error}");
    let status = http.call(&request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
}

/// A chunked request body is read and answered; one whose chunks carry extensions
/// without end is cut off (not read into memory), and the agent goes on serving.
#[test]
fn chunked_bodies_are_answered_and_endless_chunk_extensions_are_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let body = request("agent.status", json!({}));
    let (first, second) = body.as_bytes().split_at(10);
    let mut chunked = b"POST / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
        Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        .to_vec();
    for piece in [first, second] {
        chunked.extend(format!("{:x}\r\n", piece.len()).as_bytes());
        chunked.extend(piece);
        chunked.extend(b"\r\n");
    }
    chunked.extend(b"0\r\n\r\n");
    let response = read_to_close(&mut send(&agent.socket, &chunked));
    assert_status_answered(&response, "chunked");

    let before = peak(&agent);
    let mut stream = send(
        &agent.socket,
        b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
          Transfer-Encoding: chunked\r\n\r\n",
    );
    let extension = format!(";{}={}", "e".repeat(1000), "v".repeat(1000));
    let mut sent = 0usize;
    while sent < 64 << 20 {
        let chunk = format!("1{extension}\r\n \r\n");
        if stream.write_all(chunk.as_bytes()).is_err() {
            break;
        }
        sent += chunk.len();
    }
    assert!(
        sent < 64 << 20,
        "the agent read {sent} bytes of chunk extensions"
    );
    let _ = stream.read_to_end(&mut Vec::new());
    let grown = peak(&agent).saturating_sub(before);
    assert!(grown < 32 << 20, "grew by {} MiB", grown >> 20);
    let mut http = RawHttp::connect(&agent.socket);
    let status = http.call(&request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
}

/// An answer counts whole until its last byte is written, as the agent holds it whole
/// until then: 60 clients that each ask for a 4.4 MB list and read all of it but its
/// last 400 KB leave the agent's memory bounded, not grown by every list, and everyone
/// else answered; once they read the rest, each gets its whole list (before, only the
/// unwritten tails counted: 200 such clients held 912 MiB).
#[test]
fn answers_read_all_but_their_tail_are_held_to_a_bound() {
    const CLIENTS: usize = 60;
    const OPS: usize = 4000;
    const TAIL: usize = 400 * 1024;
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start_untraced(dir.path(), &[]);
    let pid = agent.pid();
    let mut http = RawHttp::connect(&agent.socket);
    http.call(&request("backup.start", json!({"name": "big", "uid": "u"})));
    let added: Vec<_> = (0..OPS)
        .map(|i| {
            let id = format!("{i:05}-{}", "x".repeat(1000));
            opmon_tests::operation("example.io/unregistered", &id, "data", &[])
        })
        .collect();
    let added = http.call(&request(
        "backup.addOperations",
        json!({"name": "big", "operations": added}),
    ));
    assert_eq!(added["result"]["added"], OPS, "{added:.300}");
    let list = request("backup.operations", json!({"name": "big"}));
    // Asked for once before, as a client would have.
    let whole = http.call(&list);
    assert_eq!(whole["result"].as_array().map(Vec::len), Some(OPS));
    drop(whole);
    quiescent(pid, Duration::from_secs(60));
    let before = peak(&agent);
    let (go, release) = std::sync::mpsc::channel::<()>();
    let release = std::sync::Arc::new(std::sync::Mutex::new(release));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let socket = agent.socket.clone();
            let list = list.clone();
            let release = release.clone();
            std::thread::spawn(move || {
                let mut stream = send(
                    &socket,
                    format!("{}{list}", post_head(list.len())).as_bytes(),
                );
                stream
                    .set_read_timeout(Some(Duration::from_secs(600)))
                    .unwrap();
                let head = read_head(&mut stream);
                let length = opmon_tests::raw::content_length(&head).expect("a length");
                assert!(length > TAIL, "{head}");
                let mut body = vec![0; length];
                stream.read_exact(&mut body[..length - TAIL]).unwrap();
                let _ = release.lock().unwrap().recv();
                stream.read_exact(&mut body[length - TAIL..]).unwrap();
                let answer: Value = serde_json::from_slice(&body).expect("a whole JSON answer");
                answer["result"].as_array().map_or(0, Vec::len)
            })
        })
        .collect();
    // The clients have sent their calls and the agent made what it would make.
    assert!(
        try_eventually(Duration::from_secs(60), || open_sockets(pid) > CLIENTS).is_some(),
        "the clients did not connect"
    );
    quiescent(pid, Duration::from_secs(120));
    let status = http.call(&request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
    let grown = peak(&agent).saturating_sub(before);
    println!("peak RSS grew by {} MiB", grown >> 20);
    for _ in 0..CLIENTS {
        go.send(()).unwrap();
    }
    for client in clients {
        assert_eq!(client.join().expect("a client"), OPS, "a whole list");
    }
    assert!(
        grown < 160 << 20,
        "{CLIENTS} clients holding the tails of 4.4 MB lists grew the agent's peak RSS by \
         {} MiB",
        grown >> 20
    );
}

/// Many large `addOperations` at once (16 clients, 1,000 operations each) are all
/// stored, `agent.status` of someone else is answered meanwhile, and the agent's memory
/// stays within a ceiling (each keeps what it needs until its commit is on disk, and no
/// more).
#[test]
fn many_large_add_operations_at_once_are_all_stored_and_others_answered() {
    const CLIENTS: usize = 16;
    const OPS: usize = 1000;
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start_untraced(dir.path(), &[]);
    let mut http = RawHttp::connect(&agent.socket);
    http.call(&request("backup.start", json!({"name": "b", "uid": "u"})));
    let before = peak(&agent);
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let socket = agent.socket.clone();
            std::thread::spawn(move || {
                let operations: Vec<_> = (0..OPS)
                    .map(|i| {
                        opmon_tests::operation(
                            "example.io/unregistered",
                            &format!("op-{c}-{i}-{}", "x".repeat(200)),
                            "data",
                            &[],
                        )
                    })
                    .collect();
                let body = request(
                    "backup.addOperations",
                    json!({"name": "b", "operations": operations}),
                );
                let mut http = RawHttp::connect(&socket);
                http.call(&body)
            })
        })
        .collect();
    let status = http.call(&request("agent.status", json!({})));
    assert!(status["result"]["version"].is_string(), "{status}");
    for client in clients {
        let answer = client.join().expect("a client");
        assert_eq!(answer["result"]["added"], OPS, "{answer:.300}");
    }
    let got = http.call(&request("backup.get", json!({"name": "b"})));
    assert_eq!(got["result"]["operationsAttempted"], CLIENTS * OPS, "{got}");
    let grown = peak(&agent).saturating_sub(before);
    println!("peak RSS grew by {} MiB", grown >> 20);
    assert!(
        grown < 128 << 20,
        "{CLIENTS} large addOperations grew the agent's peak RSS by {} MiB",
        grown >> 20
    );
}

/// `count` `backup.wait` calls of backup `b` over `ws` ending after `timeout`, ids from 1.
fn waits(count: usize, timeout: &str) -> Vec<u8> {
    (1..=count)
        .flat_map(|id| {
            let call = json!({"jsonrpc": "2.0", "id": id, "method": "backup.wait",
                              "params": {"name": "b", "until": "terminal", "timeout": timeout}});
            frame(true, TEXT, call.to_string().as_bytes(), true)
        })
        .collect()
}

/// A client that sends a large message (900 KB) after more calls than its connection may
/// have unanswered (40 calls that take 3 s each) gets every answer: the time its
/// connection is not read, because it is full, does not count against the pace the
/// large message must come at (counted, the connection was closed after 2 s).
#[test]
fn a_large_message_after_calls_that_fill_the_connection_is_answered() {
    const CALLS: usize = 40;
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let mut http = RawHttp::connect(&agent.socket);
    http.call(&request("backup.start", json!({"name": "b", "uid": "u"})));
    let mut ws = websocket(&agent.socket);
    ws.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut sent = waits(CALLS, "3s");
    // Larger than what the socket holds (and under the 1 MiB WebSocket message limit),
    // so most of it comes once the calls are answered.
    sent.extend(frame(true, TEXT, padded_status(900 << 10).as_bytes(), true));
    let writer = {
        let mut ws = ws.try_clone().unwrap();
        std::thread::spawn(move || ws.write_all(&sent))
    };
    let mut timed_out = 0;
    let mut status = 0;
    for _ in 0..=CALLS {
        let answer = ws_answer(&mut ws);
        if answer["result"]["timedOut"] == true {
            timed_out += 1;
        } else if answer["result"]["version"].is_string() {
            status += 1;
        } else {
            panic!("{answer}");
        }
    }
    writer.join().unwrap().expect("every frame was sent");
    assert_eq!((timed_out, status), (CALLS, 1));
}

/// One WebSocket connection per entry of `connections`, each sending that many calls
/// that wait (ten minutes) and then the header of a 1 MB message; true if a large
/// request of someone else is answered within 60 s.
fn others_read_past_full_websockets(connections: &[usize]) -> bool {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &[]);
    let mut http = RawHttp::connect(&agent.socket);
    http.call(&request("backup.start", json!({"name": "b", "uid": "u"})));
    let header = &frame(true, TEXT, &vec![b' '; 1 << 20], true)[..14];
    let _full: Vec<UnixStream> = connections
        .iter()
        .map(|&count| {
            let mut ws = websocket(&agent.socket);
            ws.write_all(&[&waits(count, "600s")[..], header].concat())
                .unwrap();
            ws
        })
        .collect();
    let body = padded_status(200_000);
    let mut stream = send(&agent.socket, post_head(body.len()).as_bytes());
    stream.write_all(body.as_bytes()).unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return false,
        }
    }
    let head = String::from_utf8_lossy(&head);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    true
}

/// WebSocket connections that fill themselves with calls that wait and then send the
/// header of a large message hold what the agent set aside for that message for a
/// bounded time, not as long as their waits: a large request of someone else is
/// answered within a minute (before, four such connections held every read of a large
/// body for their ten-minute waits). Four connections of 16 waits each: 16 is how many
/// calls fill a connection today, and four as many large bodies as are read at once, so
/// this pins the case the agent was fixed for; takes about 30 s.
#[test]
fn full_websockets_announcing_a_large_message_leave_others_large_requests_read() {
    assert!(
        others_read_past_full_websockets(&[16; 4]),
        "a large request was not answered within 60 s while 4 full WebSockets announced \
         large messages"
    );
}

/// The same, whatever fills a connection: six connections for each count of waits from 1
/// to 32 (before, each full one held a read of a large body for 30 s and they took
/// turns, so a large request of someone else waited minutes; now a WebSocket message
/// holds no share of anyone's reads, and bodies are charged to their own uid).
#[test]
fn many_full_websockets_announcing_large_messages_leave_others_large_requests_read() {
    let counts: Vec<usize> = (1..=32).flat_map(|count| [count; 6]).collect();
    assert!(
        others_read_past_full_websockets(&counts),
        "a large request was not answered within 60 s while full WebSockets announced \
         large messages"
    );
}

/// A client that reads its answer slowly, a little in every while, is not taken for one
/// that stopped reading: it keeps its connection past the agent's write stall timeout
/// (30 s) and gets the whole answer. Takes about 45 s.
#[test]
#[ignore = "not fixed (#33): a write that makes no progress for 30 s fails the connection, and on a Unix socket a large write makes progress only once the peer has read a whole buffer of it; a peer reading 8 KiB every 10 s of a 15 MB answer is closed after 30 s"]
fn a_client_that_reads_slowly_is_not_taken_for_one_that_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start_untraced(dir.path(), &[]);
    let calls: Vec<Value> = (0..200)
        .map(|i| json!({"jsonrpc": "2.0", "id": i, "method": "rpc.discover"}))
        .collect();
    let batch = Value::Array(calls).to_string();
    let mut stream = send(
        &agent.socket,
        format!("{}{batch}", post_head(batch.len())).as_bytes(),
    );
    let head = read_head(&mut stream);
    let length = opmon_tests::raw::content_length(&head).expect("a length");
    let mut body = vec![0; length];
    let mut read = 0;
    // 8 KiB every 10 s, over more than the stall timeout: the pace of the attack, not a
    // wait for a condition.
    for _ in 0..5 {
        stream.read_exact(&mut body[read..read + 8192]).unwrap();
        read += 8192;
        std::thread::sleep(Duration::from_secs(10));
    }
    stream
        .read_exact(&mut body[read..])
        .expect("the rest of the answer");
    let answer: Value = serde_json::from_slice(&body).expect("a whole JSON answer");
    assert_eq!(answer.as_array().map_or(0, Vec::len), 200);
}
