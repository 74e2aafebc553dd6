//! Command snapshotters: one process per call, `COMMAND… VERB -- OPERATION_ID`.
//!
//! Invariants, each a defence against a command that misbehaves or a peer's text:
//! - nothing a peer wrote stands where a program reads options: the operation ID comes
//!   after `--` (IDs may begin with `-`), and plugin and owner names are only in the
//!   environment;
//! - the command runs in a process group of its own, and the whole group is killed
//!   (SIGKILL) when the call ends: at its deadline, when the call is abandoned (the
//!   agent stops, a cancel runs out of time), and once the command has exited, so
//!   nothing it started outlives the call;
//! - its environment is cleared: it sees `PATH` ([`COMMAND_PATH`]) and the `OPMON_*`
//!   variables of [`environment`], nothing of the agent's;
//! - stdin holds the call's params (the `OperationRef`, as a socket snapshotter gets
//!   them) followed by EOF;
//! - at most [`MAX_STDOUT`] bytes of stdout are read (more fails the call) and the
//!   last [`STDERR_TAIL`] bytes of stderr are kept;
//! - the answer is what stdout held when the command exited: a process it left in the
//!   background that keeps the pipe open does not hold the answer back;
//! - a command starts only once it has one of the agent's process places
//!   ([`crate::caps::PROCESSES`]).

use std::os::fd::AsFd;
use std::process::Stdio;
use std::sync::Arc;

use opmon_client::OperationRef;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;

use super::{Answer, CallError, CallSettings};

/// `PATH` of a command: a fixed, conventional default rather than the agent's own.
pub const COMMAND_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Largest stdout read from a command, as for a socket snapshotter's answer.
pub const MAX_STDOUT: usize = 16 * 1024 * 1024;
/// How much of the end of a command's stderr is kept for its error message.
pub const STDERR_TAIL: usize = 64 * 1024;

/// Command processes running at once over all snapshotters ([`crate::caps::PROCESSES`]),
/// so that a full task limit makes a command wait rather than another's fork fail.
static PLACES: std::sync::LazyLock<Arc<Semaphore>> =
    std::sync::LazyLock::new(|| Arc::new(Semaphore::new(crate::caps::PROCESSES)));

/// Why `program` cannot run as a command's program, looked up as a call looks it up
/// (a path, else a name on [`COMMAND_PATH`]); `None` if it can run now.
pub fn unrunnable(program: &str) -> Option<String> {
    use nix::unistd::{access, AccessFlags};
    use std::path::{Path, PathBuf};
    let runs = |path: &Path| path.is_file() && access(path, AccessFlags::X_OK).is_ok();
    if !program.contains('/') {
        let found = COMMAND_PATH
            .split(':')
            .map(|dir| Path::new(dir).join(program))
            .any(|path| runs(&path));
        return (!found)
            .then(|| format!("no program {program} on the commands' PATH ({COMMAND_PATH})"));
    }
    let path = PathBuf::from(program);
    match std::fs::metadata(&path) {
        Err(e) => Some(format!("{program}: {e}")),
        Ok(m) if !m.is_file() => Some(format!("{program} is not a file")),
        Ok(_) if !runs(&path) => Some(format!("{program} is not executable")),
        Ok(_) => None,
    }
}

/// Warns if the command of snapshotter `s` (from the config file, at start or reload)
/// cannot run now. Not refused: whether it runs is a fact of the moment (a package or a
/// volume may bring it later), checked again by every call.
pub fn warn_if_unrunnable(s: &opmon_client::Snapshotter) {
    let Some(program) = s.command.as_ref().and_then(|argv| argv.first()) else {
        return;
    };
    if let Some(why) = unrunnable(program) {
        tracing::warn!(
            snapshotter = %s.name,
            program = %program,
            "the snapshotter's command cannot run: {why}; its operations wait until it can, \
             and fail once unreachable_grace has passed"
        );
    }
}

/// The environment of a call for `op`: exactly these variables.
pub fn environment(op: &OperationRef) -> [(&'static str, String); 6] {
    [
        ("PATH", COMMAND_PATH.to_string()),
        ("OPMON_PLUGIN", op.plugin.name.clone()),
        ("OPMON_PLUGIN_KIND", op.plugin.kind.as_str().to_string()),
        ("OPMON_OWNER_KIND", op.owner.kind.as_str().to_string()),
        ("OPMON_OWNER_NAME", op.owner.name.clone()),
        ("OPMON_OWNER_UID", op.owner.uid.clone()),
    ]
}

/// A snapshotter run as a command per call.
pub struct CommandRemote {
    pub(super) name: String,
    pub(super) argv: Vec<String>,
    pub(super) settings: CallSettings,
    pub(super) running: Semaphore,
    /// Where stdout's bytes are charged while read.
    pub(super) room: crate::caps::Cap,
}

/// Kills a process group when dropped: however a call ends, nothing of it survives.
struct Group(nix::unistd::Pid);

impl Drop for Group {
    fn drop(&mut self) {
        // ESRCH (nobody left) is the usual, quiet case.
        let _ = nix::sys::signal::killpg(self.0, nix::sys::signal::Signal::SIGKILL);
    }
}

/// The last `STDERR_TAIL` bytes written to stderr.
#[derive(Default)]
struct Tail(Vec<u8>);

impl Tail {
    fn push(&mut self, data: &[u8]) {
        self.0.extend_from_slice(data);
        if self.0.len() > 2 * STDERR_TAIL {
            let cut = self.0.len() - STDERR_TAIL;
            self.0.drain(..cut);
        }
    }

    /// The last non-empty line.
    fn last_line(&self) -> String {
        let start = self.0.len().saturating_sub(STDERR_TAIL);
        let text = String::from_utf8_lossy(&self.0[start..]);
        text.lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("")
            .trim()
            .to_string()
    }
}

/// Reads what `pipe` holds right now without waiting (the pipe is non-blocking), until
/// it is empty or closed, passing each piece to `take`; `take` returns false to stop.
fn drain_now(pipe: impl AsFd, buf: &mut [u8], mut take: impl FnMut(&[u8]) -> bool) {
    loop {
        match nix::unistd::read(pipe.as_fd(), buf) {
            Ok(0) => return,
            Ok(n) => {
                if !take(&buf[..n]) {
                    return;
                }
            }
            Err(nix::errno::Errno::EINTR) => continue,
            // EAGAIN: empty for now; anything else: nothing more to read.
            Err(_) => return,
        }
    }
}

/// The exit status of a command that failed transiently (sysexits.h `EX_TEMPFAIL`):
/// the call is tried again, as a JSON-RPC error with code 2003 would be.
pub const EXIT_TRANSIENT: i32 = 75;

impl CommandRemote {
    /// Progress of `op`: one `OperationProgress` object on stdout.
    pub(super) async fn progress(
        &self,
        op: OperationRef,
    ) -> Answer<opmon_client::OperationProgress> {
        let stdout = self.run("progress", &op).await?;
        serde_json::from_slice(&stdout).map_err(|e| {
            self.failed(format!(
                "printed an invalid progress for {}: {e}",
                op.operation_id
            ))
        })
    }

    /// Stdout found no room (see [`super::Held`]): asked again later.
    fn full(&self, why: String) -> CallError {
        CallError::Unreachable(format!("snapshotter {}: {why}", self.name))
    }

    fn failed(&self, message: impl std::fmt::Display) -> CallError {
        CallError::Answered(format!("snapshotter {} {message}", self.name))
    }

    /// Runs `argv… VERB -- OPERATION_ID` for `op`; returns its stdout, or fails with
    /// stderr's last line when it exits non-zero.
    pub(super) async fn run(&self, verb: &str, op: &OperationRef) -> Answer<Vec<u8>> {
        let _permit = self.running.acquire().await;
        // Never closed; held until the call ends and its group is killed.
        let _place = PLACES.clone().acquire_owned().await.ok();
        let Some((program, args)) = self.argv.split_first() else {
            return Err(self.failed("has an empty command"));
        };
        let input = serde_json::to_vec(op).map_err(|e| self.failed(format!("params: {e}")))?;
        let mut command = tokio::process::Command::new(program);
        // If the agent dies without running its clean-up (SIGKILL, the OOM killer),
        // the kernel kills the command with it instead of leaving it to run on.
        // SAFETY: the closure runs between fork and exec and only makes one
        // async-signal-safe system call.
        let agent = nix::unistd::getpid();
        unsafe {
            command.pre_exec(move || {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
                // The agent died before the line above: nobody is there to answer.
                if nix::unistd::getppid() != agent {
                    return Err(std::io::Error::other("the agent is gone"));
                }
                Ok(())
            });
        }
        let mut child = command
            .args(args)
            .arg(verb)
            .arg("--")
            .arg(&op.operation_id)
            .env_clear()
            .envs(environment(op))
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                CallError::Unreachable(format!("snapshotter {}: running {program}: {e}", self.name))
            })?;
        // The child leads its group, so the group's id is its pid.
        let _group = child
            .id()
            .map(|pid| Group(nix::unistd::Pid::from_raw(pid as i32)));
        let call = self.converse(&mut child, &input, verb, op);
        match tokio::time::timeout(self.settings.deadline, call).await {
            Ok(answer) => answer,
            Err(_) => Err(CallError::Unreachable(format!(
                "snapshotter {} did not answer within {}",
                self.name,
                opmon_client::GoDuration(self.settings.deadline)
            ))),
        }
        // `_group` drops here: whatever the command left running is killed.
    }

    /// Feeds stdin, reads stdout and stderr until the command exits, then takes what
    /// they hold.
    async fn converse(
        &self,
        child: &mut tokio::process::Child,
        input: &[u8],
        verb: &str,
        op: &OperationRef,
    ) -> Answer<Vec<u8>> {
        let (Some(mut stdin), Some(mut stdout), Some(mut stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(self.failed("has no pipes to talk to"));
        };
        let too_much = || self.failed(format!("printed more than {MAX_STDOUT} bytes on stdout"));
        // A command may exit without reading stdin: a write error is no error of the call.
        let feed = async move {
            let _ = stdin.write_all(input).await;
        };
        tokio::pin!(feed);
        let mut fed = false;
        let mut out = Vec::new();
        // Charged from its first byte on.
        let mut room = super::Held::begin(&self.room);
        let mut err = Tail::default();
        let (mut out_open, mut err_open) = (true, true);
        let mut chunk = vec![0u8; 64 * 1024];
        let mut err_chunk = vec![0u8; 64 * 1024];
        let status = loop {
            tokio::select! {
                status = child.wait() => break status,
                () = &mut feed, if !fed => fed = true,
                read = stdout.read(&mut chunk), if out_open => match read {
                    Ok(0) | Err(_) => out_open = false,
                    Ok(n) => {
                        if out.len() + n > MAX_STDOUT {
                            return Err(too_much());
                        }
                        room.grow(out.len() + n).map_err(|e| self.full(e))?;
                        out.extend_from_slice(&chunk[..n]);
                    }
                },
                read = stderr.read(&mut err_chunk), if err_open => match read {
                    Ok(0) | Err(_) => err_open = false,
                    Ok(n) => err.push(&err_chunk[..n]),
                },
            }
        };
        let status = status
            .map_err(|e| CallError::Unreachable(format!("snapshotter {}: {e}", self.name)))?;
        // The command has exited, so all it wrote is in the pipes now. Take it without
        // waiting for EOF, which a process it left behind may hold back forever.
        let mut over = false;
        let mut full = None;
        drain_now(&stdout, &mut chunk, |data| {
            over = out.len() + data.len() > MAX_STDOUT;
            if over {
                return false;
            }
            if let Err(e) = room.grow(out.len() + data.len()) {
                full = Some(e);
                return false;
            }
            out.extend_from_slice(data);
            true
        });
        if over {
            return Err(too_much());
        }
        if let Some(e) = full {
            return Err(self.full(e));
        }
        drain_now(&stderr, &mut chunk, |data| {
            err.push(data);
            true
        });
        if status.success() {
            return Ok(out);
        }
        if status.code() == Some(EXIT_TRANSIENT) {
            return Err(CallError::Transient(format!(
                "snapshotter {} {verb} {} failed transiently ({status}): {}",
                self.name,
                op.operation_id,
                err.last_line()
            )));
        }
        Err(self.failed(format!(
            "{verb} {} failed ({status}): {}",
            op.operation_id,
            err.last_line()
        )))
    }
}
