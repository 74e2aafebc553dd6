//! One running plugin binary, started as Velero's plugin manager starts it (hashicorp
//! go-plugin): the magic cookie and protocol version in its environment, the handshake
//! line it prints on stdout (`CORE|APP|NETWORK|ADDRESS|PROTOCOL[|CERT[|MUX]]`), gRPC over
//! the address it names, go-plugin's stdio stream opened at once so that a plugin built
//! with go-plugin 1.2 or later never blocks on its own output, and Velero's plugin lister
//! asked what it serves.
//!
//! A binary runs once however many snapshotters name it (the registry shares its
//! [`Host`]); it runs in a process group of its own, killed when the host is dropped, and
//! is started again with backoff, at the next call, once it has died.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::time::Instant;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::{Channel, Endpoint};

use super::wire;
use crate::log_limit::LogLimit;

/// What Velero's framework announces in its handshake config (`framework.Handshake`).
const MAGIC_COOKIE_KEY: &str = "VELERO_PLUGIN";
const MAGIC_COOKIE_VALUE: &str = "hello";
const APP_PROTOCOL_VERSION: &str = "2";
/// go-plugin's core protocol version, the handshake's first field.
const CORE_PROTOCOL_VERSION: &str = "1";
/// How long a binary may take to print its handshake and answer the plugin lister
/// (go-plugin's default start timeout).
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// Restarts of a binary that keeps dying wait 1s, 2s, 4s… up to this.
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// A binary that ran at least this long before dying is restarted after the first delay.
const HEALTHY_RUN: Duration = Duration::from_secs(60);
/// Longest line of a plugin's output logged as one event; longer lines are cut.
const MAX_LINE: usize = 4 * 1024;
/// Bytes of a plugin's output read per second at most, each line counting as at least
/// [`LINE_COST`]: a plugin that writes faster waits on its own pipe rather than costing
/// the agent a core.
const OUTPUT_RATE: usize = 4 * 1024 * 1024;
const LINE_COST: usize = 256;
/// Lines of a plugin's output kept for the error of a start that failed, and the
/// characters kept of each.
const LAST_LINES: usize = 5;
const LAST_LINE_CHARS: usize = 200;

/// What makes two snapshotters share one process: the same binary, arguments and
/// environment.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HostKey {
    pub path: PathBuf,
    pub args: Vec<String>,
    /// Set on top of what the plugin inherits ([`inherited_env`]).
    pub env: BTreeMap<String, String>,
}

/// The environment a plugin inherits from the process that runs it, as Velero's plugins
/// inherit Velero's (credential files, `KUBERNETES_SERVICE_*`, `VELERO_NAMESPACE`,
/// proxies): all of it but go-plugin's own variables, which [`Host::start`] sets for this
/// plugin (a stand-in started by Velero has Velero's in its environment).
fn inherited_env() -> impl Iterator<Item = (std::ffi::OsString, std::ffi::OsString)> {
    std::env::vars_os().filter(|(k, _)| {
        let k = k.to_string_lossy();
        k != MAGIC_COOKIE_KEY && !k.starts_with("PLUGIN_")
    })
}

/// A plugin binary and, while it runs, its process and gRPC channel.
pub struct Host {
    key: HostKey,
    /// The binary's file name, for the log.
    label: String,
    state: tokio::sync::Mutex<State>,
    /// Its output's lines in the log, within a limit.
    log: Arc<LogLimit>,
}

/// The last lines a plugin printed, for the error of a start that failed.
#[derive(Clone, Default)]
struct LastLines(Arc<std::sync::Mutex<std::collections::VecDeque<String>>>);

impl LastLines {
    fn push(&self, line: &str) {
        let mut lines = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if lines.len() == LAST_LINES {
            lines.pop_front();
        }
        lines.push_back(cut(line, LAST_LINE_CHARS).to_string());
    }

    /// `; its last output: …`, or nothing if it printed nothing.
    fn said(&self) -> String {
        let lines = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if lines.is_empty() {
            return String::new();
        }
        let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
        format!("; its last output: {}", lines.join(" | "))
    }
}

#[derive(Default)]
struct State {
    running: Option<Running>,
    /// Starts that failed or processes that died since the last healthy run.
    failures: u32,
    retry_at: Option<Instant>,
    last_error: String,
}

/// A started process that answered its handshake and the plugin lister.
struct Running {
    channel: Channel,
    served: Arc<Vec<wire::PluginIdentifier>>,
    exited: Arc<AtomicBool>,
    started: Instant,
    _group: Group,
    _socket: SocketFile,
}

/// The plugin's Unix socket, removed once its process is gone (a plugin killed by
/// signal leaves it behind).
struct SocketFile(Option<PathBuf>);

impl Drop for SocketFile {
    fn drop(&mut self) {
        if let Some(path) = &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Kills a process group when dropped.
struct Group(nix::unistd::Pid);

impl Drop for Group {
    fn drop(&mut self) {
        // ESRCH (already gone) is the usual, quiet case.
        let _ = nix::sys::signal::killpg(self.0, nix::sys::signal::Signal::SIGKILL);
    }
}

/// A channel to a running binary, with what it serves.
#[derive(Clone)]
pub struct Connection {
    pub channel: Channel,
    pub served: Arc<Vec<wire::PluginIdentifier>>,
    pub exited: Arc<AtomicBool>,
}

impl Host {
    pub fn new(key: HostKey) -> Host {
        let label = key
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| key.path.display().to_string());
        let log = Arc::new(LogLimit::new("a Velero plugin's output"));
        Host {
            key,
            label,
            state: tokio::sync::Mutex::new(State::default()),
            log,
        }
    }

    pub fn path(&self) -> &std::path::Path {
        &self.key.path
    }

    /// The running binary's channel, starting it if it is not running and its backoff
    /// has passed; otherwise why it cannot be called now.
    pub async fn connection(&self) -> Result<Connection, String> {
        let mut state = self.state.lock().await;
        if let Some(running) = &state.running {
            if !running.exited.load(Ordering::Acquire) {
                return Ok(Connection {
                    channel: running.channel.clone(),
                    served: running.served.clone(),
                    exited: running.exited.clone(),
                });
            }
            let lived = running.started.elapsed();
            state.running = None;
            if lived >= HEALTHY_RUN {
                state.failures = 0;
            }
            self.failed(&mut state, "it exited".into());
        }
        if let Some(at) = state.retry_at {
            let now = Instant::now();
            if now < at {
                return Err(format!(
                    "velero plugin {} is not running ({}); next start in {} ms",
                    self.key.path.display(),
                    state.last_error,
                    (at - now).as_millis()
                ));
            }
        }
        let output = LastLines::default();
        match tokio::time::timeout(START_TIMEOUT, self.start(&output)).await {
            Ok(Ok(running)) => {
                let connection = Connection {
                    channel: running.channel.clone(),
                    served: running.served.clone(),
                    exited: running.exited.clone(),
                };
                state.running = Some(running);
                state.retry_at = None;
                Ok(connection)
            }
            Ok(Err(e)) => {
                self.failed(&mut state, e.clone());
                Err(format!("velero plugin {}: {e}", self.key.path.display()))
            }
            Err(_) => {
                let e = format!(
                    "did not start within {} s{}",
                    START_TIMEOUT.as_secs(),
                    output.said()
                );
                self.failed(&mut state, e.clone());
                Err(format!("velero plugin {}: {e}", self.key.path.display()))
            }
        }
    }

    /// Records a failed start or a death, and when to try again.
    fn failed(&self, state: &mut State, why: String) {
        state.failures = state.failures.saturating_add(1);
        let delay = Duration::from_secs(1)
            .saturating_mul(1u32 << state.failures.saturating_sub(1).min(16))
            .min(MAX_BACKOFF);
        state.retry_at = Some(Instant::now() + delay);
        state.last_error = why;
    }

    /// Where its `stream` goes: the log, and `last`.
    fn output(&self, stream: &'static str, last: &LastLines) -> Output {
        Output {
            label: self.label.clone(),
            stream,
            log: self.log.clone(),
            last: last.clone(),
        }
    }

    /// Starts the binary and connects to it.
    async fn start(&self, output: &LastLines) -> Result<Running, String> {
        let mut command = tokio::process::Command::new(&self.key.path);
        command
            .args(&self.key.args)
            .env_clear()
            .envs(inherited_env())
            .envs(&self.key.env)
            // What go-plugin's client adds to the environment (Velero asks for no
            // multiplexing and no mTLS).
            .env(MAGIC_COOKIE_KEY, MAGIC_COOKIE_VALUE)
            .env("PLUGIN_MIN_PORT", "10000")
            .env("PLUGIN_MAX_PORT", "25000")
            .env("PLUGIN_PROTOCOL_VERSIONS", APP_PROTOCOL_VERSION)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        // If the agent dies without its clean-up, the kernel kills the plugin with it.
        // SAFETY: the closure runs between fork and exec and only makes async-signal-safe
        // system calls.
        let agent = nix::unistd::getpid();
        unsafe {
            command.pre_exec(move || {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
                if nix::unistd::getppid() != agent {
                    return Err(std::io::Error::other("the agent is gone"));
                }
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .map_err(|e| format!("cannot start it: {e}"))?;
        let pid = child.id().ok_or_else(|| "it exited at once".to_string())?;
        let group = Group(nix::unistd::Pid::from_raw(pid as i32));
        let stderr = child.stderr.take().map(|stderr| {
            let out = self.output("stderr", output);
            tokio::spawn(out.log_lines(stderr))
        });
        let Some(stdout) = child.stdout.take() else {
            return Err("no stdout".into());
        };
        let mut stdout = BufReader::new(stdout);
        let mut line = Vec::new();
        read_line(&mut stdout, &mut line)
            .await
            .map_err(|e| format!("reading its handshake: {e}"))?;
        if line.is_empty() {
            let status = child
                .wait()
                .await
                .map(|s| s.to_string())
                .unwrap_or_default();
            // Whatever it left running goes, so its stderr ends and is all read.
            drop(group);
            if let Some(stderr) = stderr {
                let _ = tokio::time::timeout(Duration::from_secs(2), stderr).await;
            }
            return Err(format!(
                "it exited before its handshake ({status}){}",
                output.said()
            ));
        }
        // Whatever it prints later is drained into the log, so it never blocks on a full
        // pipe (go-plugin 1.0 plugins write there directly).
        let out = self.output("stdout", output);
        tokio::spawn(out.log_lines(stdout));
        let address = handshake(&String::from_utf8_lossy(&line))?;
        let socket = SocketFile(match &address {
            Address::Unix(path) => Some(path.clone()),
            Address::Tcp(_) => None,
        });
        let channel = connect(address).await?;
        let out = self.output("stderr", output);
        tokio::spawn(stream_stdio(out, channel.clone()));
        let served = list_plugins(channel.clone()).await?;
        let exited = Arc::new(AtomicBool::new(false));
        tokio::spawn({
            let exited = exited.clone();
            let label = self.label.clone();
            async move {
                let status = child.wait().await;
                exited.store(true, Ordering::Release);
                match status {
                    Ok(s) => tracing::warn!(velero_plugin = %label, "velero plugin exited: {s}"),
                    Err(e) => tracing::warn!(velero_plugin = %label, "velero plugin lost: {e}"),
                }
            }
        });
        tracing::info!(
            velero_plugin = %self.label,
            pid,
            serves = %served
                .iter()
                .map(|p| format!("{} {}", p.kind, p.name))
                .collect::<Vec<_>>()
                .join(", "),
            "velero plugin started"
        );
        Ok(Running {
            channel,
            served: Arc::new(served),
            exited,
            started: Instant::now(),
            _group: group,
            _socket: socket,
        })
    }
}

/// Where the handshake line says the plugin listens.
#[derive(Debug, PartialEq, Eq)]
pub enum Address {
    Unix(PathBuf),
    Tcp(String),
}

/// Reads go-plugin's handshake line: six fields (go-plugin 1.0 to 1.4 print the sixth,
/// the server's certificate, empty), a seventh (multiplexing) from 1.5 on when asked.
pub fn handshake(line: &str) -> Result<Address, String> {
    let line = line.trim();
    let parts: Vec<&str> = line.split('|').collect();
    if parts.len() < 4 {
        return Err(format!(
            "its first line is not a go-plugin handshake: {:?}",
            cut(line, 200)
        ));
    }
    if parts[0] != CORE_PROTOCOL_VERSION {
        return Err(format!(
            "it speaks go-plugin core protocol {}, not {CORE_PROTOCOL_VERSION}",
            parts[0]
        ));
    }
    if parts[1] != APP_PROTOCOL_VERSION {
        return Err(format!(
            "it speaks Velero plugin protocol {}, not {APP_PROTOCOL_VERSION}",
            parts[1]
        ));
    }
    let protocol = parts.get(4).copied().unwrap_or("netrpc");
    if protocol != "grpc" {
        return Err(format!(
            "it serves go-plugin protocol {protocol:?}; only \"grpc\" is supported"
        ));
    }
    // go-plugin itself ignores a short sixth field (older plugins print filler there).
    if parts.get(5).is_some_and(|cert| cert.len() > 50) {
        return Err("it asks for go-plugin's automatic mTLS, which Velero does not use".into());
    }
    match parts[2] {
        "unix" => Ok(Address::Unix(PathBuf::from(parts[3]))),
        "tcp" => Ok(Address::Tcp(parts[3].to_string())),
        other => Err(format!("it listens on an unknown network {other:?}")),
    }
}

async fn connect(address: Address) -> Result<Channel, String> {
    match address {
        Address::Unix(path) => {
            let shown = path.display().to_string();
            // The URI is not used: every connection goes to the plugin's socket.
            Endpoint::from_static("http://velero-plugin")
                .connect_with_connector(tower::service_fn(move |_: tonic::codegen::http::Uri| {
                    let path = path.clone();
                    async move {
                        tokio::net::UnixStream::connect(path)
                            .await
                            .map(TokioIo::new)
                    }
                }))
                .await
                .map_err(|e| format!("cannot connect to {shown}: {e}"))
        }
        Address::Tcp(address) => Endpoint::from_shared(format!("http://{address}"))
            .map_err(|e| format!("its address {address:?}: {e}"))?
            .connect()
            .await
            .map_err(|e| format!("cannot connect to {address}: {e}")),
    }
}

/// Velero's plugin lister: every (kind, name) the binary serves.
async fn list_plugins(channel: Channel) -> Result<Vec<wire::PluginIdentifier>, String> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.map_err(|e| format!("not ready: {e}"))?;
    let answer: wire::ListPluginsResponse = grpc
        .unary(
            tonic::Request::new(wire::Empty {}),
            PathAndQuery::from_static(wire::LIST_PLUGINS),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .map_err(|s| format!("its plugin lister failed: {}", s.message()))?
        .into_inner();
    Ok(answer.plugins)
}

/// go-plugin's stdio stream, read into the log for as long as the plugin serves it. A
/// plugin built with go-plugin 1.2 or later holds its writes to stdout and stderr until
/// this stream takes them; older ones do not serve it.
async fn stream_stdio(out: Output, channel: Channel) {
    let label = &out.label;
    let mut grpc = tonic::client::Grpc::new(channel);
    if grpc.ready().await.is_err() {
        return;
    }
    let stream = grpc
        .server_streaming(
            tonic::Request::new(wire::Empty {}),
            PathAndQuery::from_static(wire::STREAM_STDIO),
            tonic_prost::ProstCodec::<wire::Empty, wire::StdioData>::default(),
        )
        .await;
    let mut stream = match stream {
        Ok(s) => s.into_inner(),
        Err(s) if s.code() == tonic::Code::Unimplemented => {
            tracing::debug!(velero_plugin = %label, "the plugin has no stdio stream (go-plugin before 1.2)");
            return;
        }
        Err(s) => {
            tracing::warn!(velero_plugin = %label, "its stdio stream failed: {}", s.message());
            return;
        }
    };
    let mut partial = [Vec::new(), Vec::new()];
    let mut pace = Pace::default();
    while let Ok(Some(data)) = stream.message().await {
        pace.read(data.data.len()).await;
        let (stream, buffer) = match data.channel {
            2 => ("stderr", &mut partial[1]),
            _ => ("stdout", &mut partial[0]),
        };
        buffer.extend_from_slice(&data.data);
        while let Some(end) = buffer.iter().position(|&b| b == b'\n') {
            let rest = buffer.split_off(end + 1);
            out.line(stream, &buffer[..end]);
            *buffer = rest;
        }
        if buffer.len() > MAX_LINE {
            out.line(stream, buffer);
            buffer.clear();
        }
    }
    out.log.flush();
}

/// Keeps reading a plugin's output to [`OUTPUT_RATE`].
#[derive(Default)]
struct Pace {
    since: Option<Instant>,
    bytes: usize,
}

impl Pace {
    async fn read(&mut self, bytes: usize) {
        let now = Instant::now();
        let since = *self.since.get_or_insert(now);
        if now.duration_since(since) >= Duration::from_secs(1) {
            (self.since, self.bytes) = (Some(now), 0);
        }
        self.bytes += bytes;
        if self.bytes > OUTPUT_RATE {
            tokio::time::sleep_until(since + Duration::from_secs(1)).await;
            (self.since, self.bytes) = (None, 0);
        }
    }
}

/// Reads one line into `line`, cleared first: up to its end or [`MAX_LINE`] bytes, the
/// rest of a longer line being the next.
async fn read_line<R: AsyncRead + Unpin>(
    reader: &mut BufReader<R>,
    line: &mut Vec<u8>,
) -> std::io::Result<()> {
    line.clear();
    loop {
        let buf = reader.fill_buf().await?;
        if buf.is_empty() {
            return Ok(());
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        let take = take.min(MAX_LINE - line.len());
        line.extend_from_slice(&buf[..take]);
        reader.consume(take);
        if done || line.len() == MAX_LINE {
            return Ok(());
        }
    }
}

/// Where a plugin's output goes: the log, within the host's budget, and its last lines.
struct Output {
    label: String,
    stream: &'static str,
    log: Arc<LogLimit>,
    last: LastLines,
}

impl Output {
    /// Logs each line of `pipe` until it closes, then what the budget left out.
    async fn log_lines<R: AsyncRead + Unpin>(self, pipe: R) {
        let mut reader = BufReader::new(pipe);
        let mut line = Vec::new();
        let mut pace = Pace::default();
        while let Ok(()) = read_line(&mut reader, &mut line).await {
            if line.is_empty() {
                break;
            }
            pace.read(line.len().max(LINE_COST)).await;
            self.line(self.stream, &line);
        }
        self.log.flush();
    }

    /// One line of output: kept among the last, and logged within the budget.
    fn line(&self, stream: &'static str, line: &[u8]) {
        let text = String::from_utf8_lossy(line);
        let text = text.trim_end();
        if text.is_empty() {
            return;
        }
        self.last.push(text);
        self.log.log(|| log_line(&self.label, stream, text));
    }
}

/// One line of a plugin's output into the agent's log, at the level it names when it is
/// a JSON log entry (hclog's `@level`, logrus's `level`), else at info.
fn log_line(label: &str, stream: &str, text: &str) {
    let level = serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|v| {
            v.get("@level")
                .or_else(|| v.get("level"))
                .and_then(|l| l.as_str().map(str::to_ascii_lowercase))
        });
    match level.as_deref() {
        Some("trace") => tracing::trace!(velero_plugin = %label, stream, "{text}"),
        Some("debug") => tracing::debug!(velero_plugin = %label, stream, "{text}"),
        Some("warn" | "warning") => tracing::warn!(velero_plugin = %label, stream, "{text}"),
        Some("error" | "fatal" | "panic") => {
            tracing::error!(velero_plugin = %label, stream, "{text}")
        }
        _ => tracing::info!(velero_plugin = %label, stream, "{text}"),
    }
}

fn cut(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

impl Host {
    /// Stops the binary if it runs (its process group killed, its socket removed), as
    /// when the host is dropped; a later call starts it again.
    pub async fn stop(&self) {
        self.state.lock().await.running = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshakes_of_six_and_seven_fields_name_the_address() {
        assert_eq!(
            handshake("1|2|unix|/tmp/plugin123|grpc|\n"),
            Ok(Address::Unix("/tmp/plugin123".into()))
        );
        assert_eq!(
            handshake("1|2|tcp|127.0.0.1:10000|grpc||true"),
            Ok(Address::Tcp("127.0.0.1:10000".into()))
        );
        assert!(handshake("1|3|unix|/x|grpc|")
            .unwrap_err()
            .contains("Velero plugin protocol 3"));
        assert!(handshake("1|2|unix|/x|netrpc|")
            .unwrap_err()
            .contains("\"netrpc\""));
        assert!(handshake("hello world")
            .unwrap_err()
            .contains("not a go-plugin handshake"));
    }
}
