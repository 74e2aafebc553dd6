//! Every agent and SDK snapshotter the harness starts logs its JSON-RPC traffic
//! (`opmon_traffic=trace`, see `opmon_agent::edge::traffic`); when the [`crate::Agent`] or
//! [`crate::SdkSnapshotter`] is dropped, its log goes to tests/openrpc/traffic.py, which
//! validates each exchange against the checked-in OpenRPC document (the agent's API, or
//! the snapshotter protocol: the agent's calls and the snapshotter's answers) with
//! Python's `jsonschema`. So the whole end-to-end suite, not one scripted client, keeps
//! the documents honest: a message a document does not admit fails the test that caused
//! it, naming the log line.
//!
//! One validator process per document serves a test binary (Python and the document
//! load once).
//! Without the `jsonschema` package the check is skipped with a note, unless `CI` is
//! set (`.ci/run` installs it, and there a missing validator is a failure).

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Mutex;

/// The log filter the harness gives every agent and SDK snapshotter: debug, plus the
/// traffic.
pub const LOG_FILTER: &str = "debug,opmon_traffic=trace";

/// The variable carrying the log filter to opmon-test-snapshotter (an agent takes
/// `OPMON_LOG_LEVEL`; the SDK leaves logging to the program that uses it).
pub const SNAPSHOTTER_LOG: &str = "OPMON_TEST_SNAPSHOTTER_LOG";

struct Validator {
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
}

/// Which checked-in document a log is validated against.
#[derive(Clone, Copy)]
pub enum Document {
    /// client/openrpc/opmon.json: an agent's API.
    Agent,
    /// client/openrpc/snapshotter.json: a snapshotter's side of the protocol.
    Snapshotter,
}

impl Document {
    fn path(self) -> PathBuf {
        let name = match self {
            Document::Agent => "opmon.json",
            Document::Snapshotter => "snapshotter.json",
        };
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../client/openrpc")
            .join(name)
    }

    fn validator(self) -> &'static Mutex<State> {
        match self {
            Document::Agent => &AGENT,
            Document::Snapshotter => &SNAPSHOTTER,
        }
    }
}

enum State {
    NotStarted,
    Running(Validator),
    /// Python or `jsonschema` is missing and `CI` is not set: nothing is checked.
    Unavailable,
}

static AGENT: Mutex<State> = Mutex::new(State::NotStarted);
static SNAPSHOTTER: Mutex<State> = Mutex::new(State::NotStarted);

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("openrpc/traffic.py")
}

/// Whether python3 can import jsonschema; when it cannot and `CI` is set, panics with
/// what is missing.
fn available() -> bool {
    let probe = Command::new("python3")
        .args(["-c", "import jsonschema"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output();
    let missing = match probe {
        Ok(out) if out.status.success() => return true,
        Ok(out) => String::from_utf8_lossy(&out.stderr).trim().to_string(),
        Err(e) => format!("python3: {e}"),
    };
    assert!(
        !crate::in_ci(),
        "validating the agent's traffic needs python3 with jsonschema (.ci/run installs \
         it): {missing}"
    );
    // Past the harness's capture, like a skipped test's line (`crate::skip`).
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED validating the agent's API traffic against the OpenRPC document: {missing}"
    );
    false
}

fn start(document: Document) -> State {
    if !available() {
        return State::Unavailable;
    }
    let mut child = Command::new("python3")
        .arg(script())
        .arg(document.path())
        .arg("--serve")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", script().display()));
    let input = child.stdin.take().expect("piped stdin");
    let output = BufReader::new(child.stdout.take().expect("piped stdout"));
    State::Running(Validator {
        child,
        input,
        output,
    })
}

/// Validates the traffic logged in `log` against `document`; panics naming the first
/// exchange the document does not admit.
pub fn check(log: &Path, document: Document) {
    assert!(
        log.exists(),
        "{} is gone before its process was dropped, so its traffic cannot be checked: \
         drop the agent or snapshotter before its temporary directory (struct fields drop \
         in declaration order, locals in reverse)",
        log.display()
    );
    let mut state = document
        .validator()
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if matches!(*state, State::NotStarted) {
        *state = start(document);
    }
    let State::Running(validator) = &mut *state else {
        return;
    };
    let mut answer = String::new();
    let asked =
        writeln!(validator.input, "{}", log.display()).and_then(|()| validator.input.flush());
    let read = asked.and_then(|()| validator.output.read_line(&mut answer));
    if !matches!(read, Ok(n) if n > 0) {
        let mut stderr = String::new();
        if let Some(err) = validator.child.stderr.as_mut() {
            let _ = err.read_to_string(&mut stderr);
        }
        *state = State::NotStarted;
        panic!(
            "{} stopped answering ({read:?}):\n{stderr}",
            script().display()
        );
    }
    let answer: serde_json::Value = serde_json::from_str(&answer)
        .unwrap_or_else(|e| panic!("{}: answer {answer:?}: {e}", script().display()));
    if answer["ok"] != serde_json::Value::Bool(true) {
        drop(state);
        panic!(
            "the traffic logged in {} does not match {}: {}",
            log.display(),
            document.path().display(),
            answer["error"].as_str().unwrap_or("(no error text)")
        );
    }
}
