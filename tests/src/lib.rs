//! Harness for the end-to-end tests: starts the real `opmon-agent` binary and real
//! snapshotter processes on sockets in a temporary directory, and cleans them up.
//!
//! Readiness is a condition, never a sleep: a process is ready when its socket accepts a
//! connection (checked in a bounded retry loop that fails with the process's log).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use opmon_client::{Client, NewOperation, OwnerKind, PluginKind, PluginRef, ResourceIdentifier};

pub mod deploy;
pub mod held;
pub mod raw;
pub mod traffic;
pub mod velero;
pub mod workflow;

pub use workflow::{Steps, LONG};

/// How long a process may take to open its socket before the test fails.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// Something a test waits for: a condition that comes to hold (`bool`) or a value that
/// comes to exist (`Option`).
pub trait Awaited {
    type Value;
    fn ready(self) -> Option<Self::Value>;
}

impl Awaited for bool {
    type Value = ();
    fn ready(self) -> Option<()> {
        self.then_some(())
    }
}

impl<T> Awaited for Option<T> {
    type Value = T;
    fn ready(self) -> Option<T> {
        self
    }
}

/// The pace of a wait: pauses short at first (most waits are short), then growing to
/// 100 ms so a probe that runs a process or reads a database does not keep a core busy;
/// none once the deadline has passed.
struct Pace {
    deadline: Instant,
    pause: Duration,
}

impl Pace {
    fn within(within: Duration) -> Pace {
        Pace {
            deadline: Instant::now() + within,
            pause: Duration::from_millis(5),
        }
    }

    /// The pause before the next probe, or `None`: the time is up.
    fn pause(&mut self) -> Option<Duration> {
        if Instant::now() >= self.deadline {
            return None;
        }
        let pause = self.pause;
        self.pause = (pause * 2).min(Duration::from_millis(100));
        Some(pause)
    }
}

/// Probes until `probe` holds or gives a value, or `within` passes (then `None`).
/// Waiting is on a condition, never a sleep standing in for one: `within` only bounds
/// how long a broken run takes to fail. Blocks the thread between probes; async tests
/// use [`try_eventually_async`].
pub fn try_eventually<A: Awaited>(
    within: Duration,
    mut probe: impl FnMut() -> A,
) -> Option<A::Value> {
    let mut pace = Pace::within(within);
    loop {
        if let Some(value) = probe().ready() {
            return Some(value);
        }
        std::thread::sleep(pace.pause()?);
    }
}

/// [`try_eventually`] that fails the test, naming `what`, when `within` passes.
pub fn eventually<A: Awaited>(
    what: impl std::fmt::Display,
    within: Duration,
    probe: impl FnMut() -> A,
) -> A::Value {
    try_eventually(within, probe).unwrap_or_else(|| panic!("not within {within:?}: {what}"))
}

/// [`try_eventually`] for async tests: yields to the runtime between probes (the
/// request being waited on may be running on it).
pub async fn try_eventually_async<A: Awaited>(
    within: Duration,
    mut probe: impl FnMut() -> A,
) -> Option<A::Value> {
    let mut pace = Pace::within(within);
    loop {
        if let Some(value) = probe().ready() {
            return Some(value);
        }
        tokio::time::sleep(pace.pause()?).await;
    }
}

/// [`try_eventually_async`] that fails the test, naming `what`, when `within` passes.
pub async fn eventually_async<A: Awaited>(
    what: impl std::fmt::Display,
    within: Duration,
    probe: impl FnMut() -> A,
) -> A::Value {
    try_eventually_async(within, probe)
        .await
        .unwrap_or_else(|| panic!("not within {within:?}: {what}"))
}

/// Whether the tests run in CI (`CI` set and not empty, as `.ci/run` sets it): there a
/// missing tool or privilege fails a test instead of skipping it.
pub fn in_ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty())
}

/// Skips the calling test for `reason` (the caller returns), or fails it under CI.
///
/// A skipped test still passes, so the line goes straight to the process's stderr, past
/// the test harness's capture: `cargo test` shows `SKIPPED <test>: <reason>` among its
/// results instead of a silent `ok`.
#[track_caller]
pub fn skip(reason: impl std::fmt::Display) {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("a test");
    assert!(!in_ci(), "{test} cannot run in CI: {reason}");
    // Written to the descriptor, not with `eprintln!`, which the harness captures.
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {reason}");
}

/// Whether the test runs as root; if not, skips it (see [`skip`]) saying what root is for.
#[track_caller]
pub fn root_or_skip(needed_for: &str) -> bool {
    let root = nix::unistd::geteuid().is_root();
    if !root {
        skip(format!("needs root {needed_for}"));
    }
    root
}

/// A binary of this workspace, next to the test executables (`cargo test --workspace`
/// builds them all before running any test).
pub fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target directory");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: run the tests with `cargo test --workspace`, which builds it",
        path.display()
    );
    path
}

/// A command that runs `opmon-agent` with none of the `OPMON_*` variables of this
/// process (see [`without_opmon_env`]). Set what the agent should see on the returned
/// command.
pub fn agent_command() -> Command {
    agent_command_of(&workspace_binary("opmon-agent"))
}

/// [`agent_command`] for the agent binary `bin` (the benchmark runs the release build,
/// or another given on its command line).
pub fn agent_command_of(bin: &Path) -> Command {
    let mut command = Command::new(bin);
    without_opmon_env(&mut command);
    command
}

/// Removes from what `command` inherits every `OPMON_*` variable of this process (the
/// agent refuses variables that are not its settings, and test harnesses have their
/// own: `OPMON_CRASH_SEED`, `OPMON_FUZZ_SHRINK`, …) and systemd's hand-overs
/// (`LISTEN_*`, `NOTIFY_SOCKET`, `WATCHDOG_*`), which belong to whatever runs the tests,
/// not to the agents they start. A test that hands over a socket sets them again.
pub fn without_opmon_env(command: &mut Command) -> &mut Command {
    for (name, _) in std::env::vars_os() {
        let text = name.to_string_lossy();
        if text.starts_with("OPMON_")
            || text.starts_with("LISTEN_")
            || text == "NOTIFY_SOCKET"
            || text.starts_with("WATCHDOG_")
        {
            command.env_remove(&name);
        }
    }
    command
}

/// The SDK snapshotter built for the tests.
pub fn test_snapshotter_binary() -> PathBuf {
    workspace_binary("opmon-test-snapshotter")
}

/// The command snapshotter script.
pub fn command_snapshotter_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("snapshotters/command-snapshotter.sh")
}

/// Waits until `socket` accepts connections, failing with `log` if `child` exits first.
pub fn wait_for_socket(socket: &Path, child: &mut Child, log: &Path) {
    let served = try_eventually(READY_WITHIN, || {
        if UnixStream::connect(socket).is_ok() {
            return true;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "process exited ({status}) before serving {}:\n{}",
                socket.display(),
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        false
    });
    assert!(
        served.is_some(),
        "{} not ready within {READY_WITHIN:?}:\n{}",
        socket.display(),
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

/// A running `opmon-agent`.
pub struct Agent {
    child: Option<Child>,
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    pub log: PathBuf,
    args: Vec<String>,
    /// `--poll-interval` (100 ms unless started with [`Agent::start_polling_every`]).
    poll_interval: String,
    /// `OPMON_LOG_LEVEL`: debug with the traffic, unless started with
    /// [`Agent::start_untraced`].
    log_filter: &'static str,
}

impl Agent {
    /// Starts an agent in `dir` (socket `dir/run/agent.sock`, state `dir/state`),
    /// polling every 100 ms, with `extra` flags.
    pub fn start(dir: &Path, extra: &[&str]) -> Agent {
        let mut agent = Agent::unstarted(dir, &dir.join("run/agent.sock"), &dir.join("state"));
        agent.args = extra.iter().map(|s| s.to_string()).collect();
        agent.launch();
        agent
    }

    /// Like [`Agent::start`], polling every `interval` (`"1h"`: a change seen within
    /// the test's time was not found by the periodic poll).
    pub fn start_polling_every(dir: &Path, interval: &str, extra: &[&str]) -> Agent {
        let mut agent = Agent::unstarted(dir, &dir.join("run/agent.sock"), &dir.join("state"));
        agent.args = extra.iter().map(|s| s.to_string()).collect();
        agent.poll_interval = interval.to_string();
        agent.launch();
        agent
    }

    /// Like [`Agent::start`], logging at debug without the traffic, for a test of what
    /// many large answers cost: their trace lines would cost as much again, which an
    /// agent run as documented does not spend, and their check would take minutes.
    pub fn start_untraced(dir: &Path, extra: &[&str]) -> Agent {
        let mut agent = Agent::unstarted(dir, &dir.join("run/agent.sock"), &dir.join("state"));
        agent.args = extra.iter().map(|s| s.to_string()).collect();
        agent.log_filter = "debug";
        agent.launch();
        agent
    }

    /// Starts an agent logging to `dir/agent.log` on `socket` and `state_dir`.
    pub fn start_at(dir: &Path, socket: &Path, state_dir: &Path, extra: &[&str]) -> Agent {
        let mut agent = Agent::unstarted(dir, socket, state_dir);
        agent.args = extra.iter().map(|s| s.to_string()).collect();
        agent.launch();
        agent
    }

    /// An agent on `socket` and `state_dir`, logging to `dir/agent.log`; not started.
    pub fn unstarted(dir: &Path, socket: &Path, state_dir: &Path) -> Agent {
        Agent {
            child: None,
            dir: dir.to_path_buf(),
            socket: socket.to_path_buf(),
            state_dir: state_dir.to_path_buf(),
            log: dir.join("agent.log"),
            args: Vec::new(),
            poll_interval: "100ms".into(),
            log_filter: traffic::LOG_FILTER,
        }
    }

    fn launch(&mut self) {
        let child = self.spawn();
        self.child = Some(child);
        let log = self.log.clone();
        let socket = self.socket.clone();
        wait_for_socket(&socket, self.child.as_mut().expect("just spawned"), &log);
    }

    /// Spawns the agent without waiting for it to serve.
    pub fn spawn(&self) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("agent log");
        agent_command()
            .arg("--socket")
            .arg(&self.socket)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .args(["--poll-interval", &self.poll_interval])
            .args(&self.args)
            .env("OPMON_LOG_LEVEL", self.log_filter)
            .env("OPMON_CONFIG", "/dev/null")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawning opmon-agent")
    }

    /// A client connected to this agent.
    pub async fn client(&self) -> Client {
        Client::connect(&self.socket)
            .await
            .expect("connecting to the agent")
    }

    /// SIGKILL: the agent gets no chance to clean up.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, then waits for the exit ([`LONG`] at most: an agent that does not stop
    /// is killed and fails the test).
    pub fn terminate(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("agent is running");
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
        match try_eventually(LONG, || child.try_wait().expect("waiting for the agent")) {
            Some(status) => status,
            None => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "the agent did not stop within {LONG:?} of SIGTERM:\n{}",
                    self.log_text()
                );
            }
        }
    }

    /// Sends `signal` to the running agent (SIGSTOP: it keeps its socket but answers
    /// nothing; SIGCONT: it goes on).
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let child = self.child.as_ref().expect("agent is running");
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        nix::sys::signal::kill(pid, signal).expect("signalling the agent");
    }

    /// Starts the agent again on the same socket and state.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "stop the agent before restarting it");
        self.launch();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The running agent's process ID.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("agent is running").id()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill9();
        // Not while a test already fails: a second panic would abort the process.
        if !std::thread::panicking() {
            traffic::check(&self.log, traffic::Document::Agent);
        }
    }
}

/// A running `opmon-test-snapshotter`.
pub struct SdkSnapshotter {
    child: Child,
    pub socket: PathBuf,
    pub log: PathBuf,
}

impl SdkSnapshotter {
    /// Starts the SDK snapshotter on `dir/<name>.sock`, with gate files in `gates` and
    /// its journal at `journal`.
    pub fn start(dir: &Path, name: &str, gates: &Path, journal: &Path) -> SdkSnapshotter {
        SdkSnapshotter::spawn(dir, name, gates, journal, None)
    }

    /// Like [`SdkSnapshotter::start`], sending `snapshotter.changed` hints for `plugin`
    /// to the agent on `agent_socket` when a gate is opened with its `gate.open` method.
    pub fn start_hinting(
        dir: &Path,
        name: &str,
        gates: &Path,
        journal: &Path,
        agent_socket: &Path,
        plugin: &str,
    ) -> SdkSnapshotter {
        SdkSnapshotter::spawn(dir, name, gates, journal, Some((agent_socket, plugin)))
    }

    fn spawn(
        dir: &Path,
        name: &str,
        gates: &Path,
        journal: &Path,
        hints: Option<(&Path, &str)>,
    ) -> SdkSnapshotter {
        let socket = dir.join(format!("{name}.sock"));
        let log_path = dir.join(format!("{name}.log"));
        let log = std::fs::File::create(&log_path).expect("snapshotter log");
        let mut command = Command::new(test_snapshotter_binary());
        command.arg(&socket).arg(gates).arg(journal);
        match hints {
            Some((agent_socket, plugin)) => {
                // Its traffic is not logged: it also serves the test's own `gate.open`,
                // which is no part of the snapshotter protocol's document.
                command.arg(agent_socket).arg(plugin);
            }
            None => {
                command.env(traffic::SNAPSHOTTER_LOG, traffic::LOG_FILTER);
            }
        }
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawning opmon-test-snapshotter");
        wait_for_socket(&socket, &mut child, &log_path);
        SdkSnapshotter {
            child,
            socket,
            log: log_path,
        }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for SdkSnapshotter {
    fn drop(&mut self) {
        self.kill9();
        // Not while a test already fails: a second panic would abort the process.
        if !std::thread::panicking() {
            traffic::check(&self.log, traffic::Document::Snapshotter);
        }
    }
}

/// The journal's lines (`verb id owner`), or none if it does not exist yet.
pub fn journal(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// Opens the gate of operation `id`: the test snapshotters complete it from now on.
pub fn open_gate(gates: &Path, id: &str) {
    std::fs::write(gates.join(id), b"").expect("writing gate file");
}

/// Starts owner `name` (uid `u`) with `operations` and ends its InProgress phase, as a
/// backup server does; returns the owner in the phase that left it. (Kept for the tests
/// that call it; [`Steps`] reads better in new ones.)
pub async fn start_and_end_in_progress(
    owners: &opmon_client::Owners,
    name: &str,
    operations: Vec<NewOperation>,
) -> opmon_client::Owner {
    Steps::of(owners.clone(), name)
        .operations(operations)
        .end_in_progress()
        .await
}

/// A namespaced PVC reference.
pub fn pvc(name: &str) -> ResourceIdentifier {
    ResourceIdentifier {
        group: String::new(),
        resource: "persistentvolumeclaims".into(),
        namespace: "app".into(),
        name: name.into(),
    }
}

/// An operation of `plugin` on PVC `item` with ID `id`, re-backing up `post`.
pub fn operation(plugin: &str, id: &str, item: &str, post: &[&str]) -> NewOperation {
    NewOperation {
        plugin: PluginRef {
            kind: PluginKind::BackupItemAction,
            name: plugin.into(),
        },
        resource: pvc(item),
        operation_id: id.into(),
        post_operation_items: post.iter().map(|p| pvc(p)).collect(),
        created: None,
    }
}

/// [`operation`] for a restore: a RestoreItemAction's, which re-backs up nothing.
pub fn restore_operation(plugin: &str, id: &str, item: &str) -> NewOperation {
    NewOperation {
        plugin: PluginRef {
            kind: PluginKind::RestoreItemAction,
            name: plugin.into(),
        },
        ..operation(plugin, id, item, &[])
    }
}

/// One keep-alive HTTP/1.1 connection to a socket, for sending raw bytes and reading
/// raw answers: what a misbehaving client does.
pub struct RawHttp {
    reader: BufReader<UnixStream>,
}

impl RawHttp {
    pub fn connect(socket: &Path) -> RawHttp {
        let stream = UnixStream::connect(socket).expect("connecting raw");
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .expect("read timeout");
        RawHttp {
            reader: BufReader::new(stream),
        }
    }

    /// POSTs `body` to `/`; returns the status and the body.
    pub fn post(&mut self, body: &[u8]) -> (u16, String) {
        let head = format!(
            "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let stream = self.reader.get_mut();
        stream.write_all(head.as_bytes()).expect("writing head");
        // A server may answer (and close) before reading an oversized body: the answer
        // is still there to read.
        if let Err(e) = stream.write_all(body) {
            assert_eq!(
                e.kind(),
                std::io::ErrorKind::BrokenPipe,
                "writing body: {e}"
            );
        }
        let mut status_line = String::new();
        self.reader
            .read_line(&mut status_line)
            .expect("status line");
        let status: u16 = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
        let mut length = 0usize;
        loop {
            let mut line = String::new();
            self.reader.read_line(&mut line).expect("header line");
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse().expect("content-length");
                }
            }
        }
        let mut body = vec![0; length];
        self.reader.read_exact(&mut body).expect("body");
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    /// POSTs `body` and parses the JSON answer.
    pub fn call(&mut self, body: &str) -> serde_json::Value {
        let (status, text) = self.post(body.as_bytes());
        assert_eq!(status, 200, "{text}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    }
}

/// The plugin the fixture's SDK snapshotter is registered for.
pub const PLUGIN: &str = "example.io/copier";

/// A temporary directory with an agent and an SDK snapshotter registered for [`PLUGIN`].
pub struct Fixture {
    /// A client of the agent, for the steps ([`Fixture::backup`]) and the test.
    pub client: Client,
    pub gates: PathBuf,
    pub journal: PathBuf,
    pub snapshotter: SdkSnapshotter,
    pub agent: Agent,
    pub dir: tempfile::TempDir,
}

impl Fixture {
    /// Starts the snapshotter and an agent with `extra` flags, and registers the one
    /// with the other.
    pub async fn new(extra: &[&str]) -> Fixture {
        Fixture::polling_every("100ms", extra).await
    }

    /// Like [`Fixture::new`], the agent polling every `interval` (`"1h"`: only calls and
    /// hints poll).
    pub async fn polling_every(interval: &str, extra: &[&str]) -> Fixture {
        let dir = tempfile::tempdir().expect("temporary directory");
        let gates = dir.path().join("gates");
        std::fs::create_dir(&gates).expect("gates directory");
        let journal = dir.path().join("journal");
        let snapshotter = SdkSnapshotter::start(dir.path(), "copier", &gates, &journal);
        let agent = Agent::start_polling_every(dir.path(), interval, extra);
        let client = agent.client().await;
        client
            .register_snapshotter(opmon_client::Snapshotter {
                name: PLUGIN.into(),
                api_version: opmon_client::ApiVersion::V2,
                socket: Some(snapshotter.socket.clone()),
                command: None,
                ..Default::default()
            })
            .await
            .expect("registering the snapshotter");
        Fixture {
            client,
            gates,
            journal,
            snapshotter,
            agent,
            dir,
        }
    }

    pub fn open_gate(&self, id: &str) {
        open_gate(&self.gates, id)
    }

    /// The steps of backup `name` (see [`workflow`]).
    pub fn backup(&self, name: &str) -> Steps {
        Steps::new(&self.client, OwnerKind::Backup, name)
    }

    /// The steps of restore `name`.
    pub fn restore(&self, name: &str) -> Steps {
        Steps::new(&self.client, OwnerKind::Restore, name)
    }

    pub fn journal(&self) -> Vec<String> {
        journal(&self.journal)
    }
}

pub mod tarballs;
