//! Finalize fixtures that hold work until the test says: files whose reads wait
//! ([`HeldFiles`], a FUSE file system) and callers of other uids ([`CallerAs`]).
//! (Copied from `tests/tests/budget.rs`, whose tests keep their own.)

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;

use serde_json::Value;

/// Files whose reads wait until [`HeldFiles::release`] (`tests/fuse/held-files.py`): a
/// disk that is slow for exactly as long as the test wants. Unmounted when dropped.
pub struct HeldFiles {
    child: Child,
    lines: mpsc::Receiver<String>,
    mountpoint: PathBuf,
}

/// The lines `stdout` prints, as they come.
fn lines_of(stdout: std::process::ChildStdout) -> mpsc::Receiver<String> {
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    lines
}

/// The next of `lines`; fails the test if none comes within [`crate::LONG`] (what it
/// waits for is held up).
fn next_of(lines: &mpsc::Receiver<String>, what: &str) -> String {
    match lines.recv_timeout(crate::LONG) {
        Ok(line) => line,
        Err(e) => panic!("{what}: nothing within {:?} ({e})", crate::LONG),
    }
}

impl HeldFiles {
    /// Serves `held-0.tar.gz`… (`count` of them, each with `source`'s bytes) at
    /// `mountpoint`.
    pub fn mount(source: &Path, count: usize, mountpoint: &Path) -> HeldFiles {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuse/held-files.py");
        let mut child = Command::new("/usr/bin/python3")
            .arg(script)
            .arg(source)
            .arg(count.to_string())
            .arg(mountpoint)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("running tests/fuse/held-files.py");
        let stdout = child.stdout.take().expect("piped");
        let mut held = HeldFiles {
            child,
            lines: lines_of(stdout),
            mountpoint: mountpoint.to_path_buf(),
        };
        assert_eq!(held.next_line(), "mounted", "held-files.py did not mount");
        held
    }

    fn next_line(&mut self) -> String {
        next_of(
            &self.lines,
            "held-files.py (is python3-fuse installed?), or the reads it waits for",
        )
    }

    /// Returns once reads of `count` different files are waiting (fails the test if
    /// they do not come).
    pub fn wait_for_readers(&mut self, count: usize) {
        let mut waiting = std::collections::HashSet::new();
        while waiting.len() < count {
            let line = self.next_line();
            let name = line.strip_prefix("held ");
            let name = name.unwrap_or_else(|| panic!("held-files.py said {line:?}"));
            waiting.insert(name.to_string());
        }
    }

    /// Lets every read through, now and after.
    pub fn release(&mut self) {
        if let Some(mut stdin) = self.child.stdin.take() {
            let _ = writeln!(stdin, "release");
        }
    }
}

impl Drop for HeldFiles {
    fn drop(&mut self) {
        self.release();
        // Lazily: a reader still holding a file must not keep the mount after the test.
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.mountpoint)
            .status();
        let _ = self.child.wait();
    }
}

/// A process as `uid` that posts each line `TAG BODY` of its stdin on a connection of
/// its own to `socket`, and prints `TAG ANSWER` when the answer comes.
pub struct CallerAs {
    child: Child,
    answers: mpsc::Receiver<String>,
}

impl CallerAs {
    pub fn start(uid: u32, socket: &Path) -> CallerAs {
        let script = "import socket, sys, threading\n\
            out = threading.Lock()\n\
            def call(tag, body):\n\
            \x20   s = socket.socket(socket.AF_UNIX)\n\
            \x20   s.connect(sys.argv[1])\n\
            \x20   body = body.encode()\n\
            \x20   s.sendall(b'POST / HTTP/1.1\\r\\nHost: localhost\\r\\nContent-Type: application/json\\r\\n'\n\
            \x20             + b'Content-Length: %d\\r\\nConnection: close\\r\\n\\r\\n' % len(body) + body)\n\
            \x20   answer = b''\n\
            \x20   while chunk := s.recv(65536):\n\
            \x20       answer += chunk\n\
            \x20   with out:\n\
            \x20       print(tag, answer.split(b'\\r\\n\\r\\n', 1)[-1].decode().replace('\\n', ' '), flush=True)\n\
            for line in sys.stdin:\n\
            \x20   tag, body = line.rstrip('\\n').split(' ', 1)\n\
            \x20   threading.Thread(target=call, args=(tag, body), daemon=True).start()\n";
        let mut child = Command::new("setpriv")
            .arg(format!("--reuid={uid}"))
            .arg(format!("--regid={uid}"))
            .arg("--clear-groups")
            .args(["--", "/usr/bin/python3", "-c", script])
            .arg(socket)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("running python3 as another uid");
        let stdout = child.stdout.take().expect("piped");
        CallerAs {
            child,
            answers: lines_of(stdout),
        }
    }

    pub fn send(&mut self, tag: &str, body: &str) {
        let stdin = self.child.stdin.as_mut().expect("piped");
        writeln!(stdin, "{tag} {body}").expect("writing to the caller");
    }

    /// The next answer to come, with its tag; fails the test if none comes within
    /// [`crate::LONG`] (what it waits for is held up).
    pub fn answer(&mut self) -> (String, Value) {
        let line = next_of(&self.answers, "an answer");
        let (tag, text) = line.split_once(' ').expect("`TAG ANSWER`");
        let answer = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        (tag.to_string(), answer)
    }

    /// The answers that have come and were not taken, without waiting.
    pub fn pending(&mut self) -> Vec<String> {
        self.answers.try_iter().collect()
    }
}

impl Drop for CallerAs {
    fn drop(&mut self) {
        // Its calls may still be waiting (a test that failed): they end with it.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
