//! Starting and stopping the real `opmon-agent`, and reading what the kernel knows about
//! it (resident memory, open descriptors).

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use opmon_client::Client;

use crate::{raw, Ctx};

/// Agents that died of SIGTERM instead of shutting down gracefully (the signal came
/// before they installed their handler); reported under the table.
pub static UNHANDLED_SIGTERM: AtomicU64 = AtomicU64::new(0);

fn libc_sigterm() -> i32 {
    nix::sys::signal::Signal::SIGTERM as i32
}

/// How long an agent may take to answer its first call.
const READY_WITHIN: Duration = Duration::from_secs(60);
/// How long an agent may take to stop after SIGTERM before it is killed.
const STOP_WITHIN: Duration = Duration::from_secs(30);

/// How to start an agent: binary, socket, state directory, flags.
#[derive(Clone, Debug)]
pub struct Spec {
    pub bin: PathBuf,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    pub log: PathBuf,
    pub args: Vec<String>,
    /// Extra environment (`--agent-env`), for experiments such as `MALLOC_ARENA_MAX`.
    pub env: Vec<(String, String)>,
    /// A program (with its arguments) that runs the agent, such as valgrind; empty:
    /// the agent runs itself.
    pub wrapper: Vec<String>,
}

impl Spec {
    /// An agent in `dir` (socket `dir/agent.sock`, state `dir/state`, log
    /// `dir/agent.log`) with `args`.
    pub fn new(ctx: &Ctx, dir: &Path, args: &[&str]) -> Spec {
        Spec {
            bin: ctx.agent_bin.clone(),
            socket: dir.join("agent.sock"),
            state_dir: dir.join("state"),
            log: dir.join("agent.log"),
            args: args.iter().map(|s| s.to_string()).collect(),
            env: ctx.agent_env.clone(),
            wrapper: Vec::new(),
        }
    }

    /// The same agent with other flags.
    pub fn with_args(&self, args: &[&str]) -> Spec {
        Spec {
            args: args.iter().map(|s| s.to_string()).collect(),
            ..self.clone()
        }
    }

    pub fn database(&self) -> PathBuf {
        self.state_dir.join("agent.db")
    }

    /// Starts the agent and waits for its first answered `agent.status`; returns it
    /// with the time from spawning to that answer.
    pub async fn start(&self) -> Result<(Agent, Duration), String> {
        self.start_probing(raw::STATUS).await
    }

    /// Like [`Spec::start`], with `body` (a JSON-RPC request) as the first call.
    pub async fn start_probing(&self, body: &[u8]) -> Result<(Agent, Duration), String> {
        let began = Instant::now();
        let mut agent = self.spawn()?;
        let ready = agent.wait_ready(began, body).await?;
        Ok((agent, ready))
    }

    fn spawn(&self) -> Result<Agent, String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("opening {}: {e}", self.log.display()))?;
        // Only the flags here configure the agent: the harness's command (no inherited
        // OPMON_* variables, no systemd hand-overs) and no /etc/opmon/agent.toml.
        let mut command = match self.wrapper.split_first() {
            None => opmon_tests::agent_command_of(&self.bin),
            Some((program, args)) => {
                let mut command = opmon_tests::agent_command_of(Path::new(program));
                command.args(args).arg(&self.bin);
                command
            }
        };
        let child = command
            .arg("--socket")
            .arg(&self.socket)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .args(&self.args)
            .env("OPMON_CONFIG", "/dev/null")
            .env("OPMON_LOG_LEVEL", "warn")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", self.bin.display()))?;
        Ok(Agent {
            pid: child.id(),
            child: Some(child),
            socket: self.socket.clone(),
            log: self.log.clone(),
        })
    }
}

/// A running agent; killed when dropped.
pub struct Agent {
    child: Option<Child>,
    pub pid: u32,
    pub socket: PathBuf,
    log: PathBuf,
}

impl Agent {
    /// Polls until `agent.status` is answered (every millisecond, so the figure is the
    /// agent's and not the poll's), failing with the log if the agent exits first.
    async fn wait_ready(&mut self, began: Instant, body: &[u8]) -> Result<Duration, String> {
        let request = raw::post_request(body);
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(format!(
                        "the agent exited ({status}) before answering:\n{}",
                        self.log_tail()
                    ));
                }
            }
            let socket = self.socket.clone();
            // Connected means the agent is up or about to serve: the call waits for it.
            let attempt = tokio::task::block_in_place(|| {
                raw::Conn::connect(&socket)
                    .ok()
                    .map(|mut conn| conn.call(&request))
            });
            if let Some(answer) = attempt {
                let answer =
                    answer.map_err(|e| format!("the first call: {e}\n{}", self.log_tail()))?;
                if answer.status != 200 {
                    return Err(format!(
                        "the first call answered HTTP {}: {}",
                        answer.status,
                        String::from_utf8_lossy(&answer.body)
                    ));
                }
                return Ok(began.elapsed());
            }
            if began.elapsed() > READY_WITHIN {
                return Err(format!(
                    "the agent did not serve {} within {READY_WITHIN:?}:\n{}",
                    self.socket.display(),
                    self.log_tail()
                ));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// A typed (WebSocket) client on a connection of its own.
    pub async fn client(&self) -> Result<Client, String> {
        Client::connect(&self.socket)
            .await
            .map_err(|e| format!("connecting to the agent: {e}"))
    }

    /// SIGTERM, then waits for the exit; kills the agent if it takes too long (and says
    /// so: a graceful stop should not hang).
    pub fn terminate(&mut self) -> Result<(), String> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let began = Instant::now();
        loop {
            match child.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(status)) if status.signal() == Some(libc_sigterm()) => {
                    // Died of the signal itself: it had no handler installed yet.
                    UNHANDLED_SIGTERM.fetch_add(1, Ordering::SeqCst);
                    return Ok(());
                }
                Ok(Some(status)) => {
                    return Err(format!(
                        "the agent exited with {status} after SIGTERM:\n{}",
                        self.log_tail()
                    ))
                }
                Ok(None) if began.elapsed() > STOP_WITHIN => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!(
                        "the agent did not stop within {STOP_WITHIN:?} of SIGTERM; killed:\n{}",
                        self.log_tail()
                    ));
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => return Err(format!("waiting for the agent: {e}")),
            }
        }
    }

    /// Resident memory now, in KiB.
    pub fn rss_kib(&self) -> Result<u64, String> {
        status_field(self.pid, "VmRSS:")
    }

    /// Peak resident memory, in KiB.
    pub fn peak_rss_kib(&self) -> Result<u64, String> {
        status_field(self.pid, "VmHWM:")
    }

    /// Open file descriptors now.
    pub fn open_fds(&self) -> Result<u64, String> {
        let dir = format!("/proc/{}/fd", self.pid);
        std::fs::read_dir(&dir)
            .map(|d| d.count() as u64)
            .map_err(|e| format!("reading {dir}: {e}"))
    }

    /// The end of the agent's log, for error messages.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The last lines of a log file.
pub fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(20);
    lines[from..].join("\n")
}

/// Warnings and errors the agent logged, for the report.
pub fn log_problems(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        .map(str::to_string)
        .collect()
}

fn status_field(pid: u32, field: &str) -> Result<u64, String> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("reading {path}: {e}"))?;
    text.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse().ok())
        .ok_or_else(|| format!("{path} has no {field}"))
}
