//! A snapshotter built with the SDK, for the end-to-end tests. It is a real process on a
//! real socket; its behaviour for an operation is chosen by the operation ID's prefix:
//!
//! | prefix | Progress answers |
//! |---|---|
//! | `done-` | completed, 100/100 bytes |
//! | `fail-` | completed with err `copy failed` |
//! | `gate-` | 30/100 bytes, started; completed once the file `<gates>/<id>` exists |
//! | `failgate-` | like `gate-`, but completes with err `copy failed` |
//! | `never-` | 50/100 bytes, started, never completes (a stalled copy) |
//! | `idle-` | 0/100 bytes, not started, never completes (stays New) |
//! | `flaky-` | a transient error (2003) at its first two Progress calls, then completed |
//! | `flakier-` | a transient error at every Progress call |
//! | `evil-` | like `gate-`, with control characters (ESC, CR, LF, BEL) in its description and error; its Cancel fails with that error |
//! | `odd-` | completed with an err and a description full of characters JSON encoders disagree on (`<>&`, U+2028, non-ASCII, a tab), no counts, started at the Unix epoch, updated at 2026-11-22T09:57:45.678Z |
//! | `ctl-` | completed with an err holding a backspace and a form feed (which Go writes as `\b`, `\f` since 1.22 only) |
//! | `pace-` | moves at a known pace by its own clock: the k-th Progress call answers `nCompleted` = 1000·k + 500·(k mod 2) of 1,000,000 at `updated` = 2026-01-01T00:00:00Z + k s (so 1,500 then 500 units a second, by turns); `pace-items-` counts `item`s, others `byte`s; `pace-nototal-` has no `nTotal`; each answer is journaled as `paced N UPDATED_MS ID OWNER` |
//! | `unsupported-` | error 2001 OperationsNotSupported |
//! | anything else | error 2002 InvalidOperationId |
//!
//! While the file `<gates>/HANG` exists, every call hangs, after `held progress ID` (or
//! `held cancel ID`) is appended to the journal so a test knows the agent is waiting on
//! it. Each call answered is appended to the journal file (`progress ID OWNER` or
//! `cancel ID OWNER`, then ` OBJECT` as compact JSON when the owner has an object)
//! before it is answered, so tests can see what the agent asked and in which order.
//!
//! Given the agent's socket and a plugin name as well, it also serves `gate.open {id}`,
//! which opens the gate of `id` the way a copy finishes inside a snapshotter, and
//! tells the agent through the SDK's hints.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

use opmon_client::{OperationProgress, OperationRef};
use opmon_snapshotter::{
    rpc_module, serve_methods, termination, Hints, OperationHandler, SnapshotterError,
};
use time::OffsetDateTime;

/// What `evil-` operations report: a terminal escape (clear screen, recolour), a
/// carriage return that overwrites, a newline that forges a line, a bell.
const EVIL_DESCRIPTION: &str = "copying\u{1b}[2J\u{1b}[31m\rDONE\u{7}";
const EVIL_ERROR: &str =
    "boom\n2026-01-01T00:00:00Z  INFO opmon_agent: forged\r\u{1b}]0;pwned\u{7}";

struct Scripted {
    gates: PathBuf,
    journal: Mutex<std::fs::File>,
    /// Progress calls answered so far, per operation ID (for `flaky-`).
    calls: Mutex<std::collections::HashMap<String, u32>>,
    /// Progress calls answered so far per `pace-` operation.
    paced: Mutex<std::collections::HashMap<String, i64>>,
}

impl Scripted {
    fn record(&self, verb: &str, op: &OperationRef) {
        if let Ok(mut journal) = self.journal.lock() {
            let _ = match &op.owner.object {
                None => writeln!(journal, "{verb} {} {}", op.operation_id, op.owner.name),
                Some(object) => writeln!(
                    journal,
                    "{verb} {} {} {object}",
                    op.operation_id, op.owner.name
                ),
            };
            let _ = journal.flush();
        }
    }

    async fn hang_if_asked(&self, verb: &str, op: &OperationRef) {
        if self.gates.join("HANG").exists() {
            self.record(&format!("held {verb}"), op);
            std::future::pending::<()>().await;
        }
    }

    fn progress(n: i64, completed: bool, err: &str) -> OperationProgress {
        OperationProgress {
            completed,
            err: Some(err.into()).filter(|err: &String| !err.is_empty()),
            n_completed: n,
            n_total: 100,
            operation_units: "byte".into(),
            description: if completed {
                "done".into()
            } else {
                "copying".into()
            },
            started: Some(OffsetDateTime::UNIX_EPOCH + time::Duration::days(20_000)),
            updated: None,
        }
    }
}

impl OperationHandler for Scripted {
    async fn progress(&self, op: OperationRef) -> Result<OperationProgress, SnapshotterError> {
        self.hang_if_asked("progress", &op).await;
        self.record("progress", &op);
        let id = op.operation_id.as_str();
        let open = || self.gates.join(id).exists();
        let call = {
            let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
            let n = calls.entry(id.to_string()).or_default();
            *n += 1;
            *n
        };
        if id.starts_with("done-") {
            Ok(Self::progress(100, true, ""))
        } else if id.starts_with("fail-") {
            Ok(Self::progress(40, true, "copy failed"))
        } else if id.starts_with("gate-") {
            Ok(if open() {
                Self::progress(100, true, "")
            } else {
                Self::progress(30, false, "")
            })
        } else if id.starts_with("failgate-") {
            Ok(if open() {
                Self::progress(60, true, "copy failed")
            } else {
                Self::progress(30, false, "")
            })
        } else if id.starts_with("evil-") {
            let mut p = if open() {
                Self::progress(100, true, EVIL_ERROR)
            } else {
                Self::progress(30, false, "")
            };
            p.description = EVIL_DESCRIPTION.into();
            Ok(p)
        } else if id.starts_with("never-") {
            Ok(Self::progress(50, false, ""))
        } else if id.starts_with("idle-") {
            Ok(OperationProgress {
                n_total: 100,
                operation_units: "byte".into(),
                description: "queued".into(),
                ..OperationProgress::default()
            })
        } else if id.starts_with("flaky-") && call <= 2 {
            Err(SnapshotterError::transient(format!(
                "backend busy (call {call})"
            )))
        } else if id.starts_with("flaky-") {
            Ok(Self::progress(100, true, ""))
        } else if id.starts_with("flakier-") {
            Err(SnapshotterError::transient(format!(
                "backend busy (call {call})"
            )))
        } else if id.starts_with("odd-") {
            Ok(OperationProgress {
                completed: true,
                err: Some("copy <failed> & \"gave up\": ü 🦀 \u{2028}\tline\u{2029}".into()),
                description: "<b>fast</b> & ☃".into(),
                started: Some(OffsetDateTime::UNIX_EPOCH),
                updated: Some(time::macros::datetime!(2026-11-22 09:57:45.678 UTC)),
                ..OperationProgress::default()
            })
        } else if id.starts_with("ctl-") {
            Ok(Self::progress(
                1,
                true,
                "bell\u{7} back\u{8} feed\u{c} del\u{7f}",
            ))
        } else if id.starts_with("pace-") {
            let k = match self.paced.lock() {
                Ok(mut calls) => {
                    let k = calls.entry(id.to_string()).or_insert(0);
                    *k += 1;
                    *k
                }
                Err(_) => return Err(SnapshotterError::other("the pace lock")),
            };
            let n = 1000 * k + 500 * (k % 2);
            let updated = time::macros::datetime!(2026-01-01 0:00 UTC) + time::Duration::seconds(k);
            self.record(
                &format!("paced {n} {}", updated.unix_timestamp() * 1000),
                &op,
            );
            Ok(OperationProgress {
                completed: false,
                err: None,
                n_completed: n,
                n_total: if id.starts_with("pace-nototal-") {
                    0
                } else {
                    1_000_000
                },
                operation_units: if id.starts_with("pace-items-") {
                    "item".into()
                } else {
                    "byte".into()
                },
                description: "copying".into(),
                started: Some(time::macros::datetime!(2026-01-01 0:00 UTC)),
                updated: Some(updated),
            })
        } else if id.starts_with("unsupported-") {
            Err(SnapshotterError::operations_not_supported(format!(
                "{id} is not mine"
            )))
        } else {
            Err(SnapshotterError::invalid_operation_id(format!(
                "no operation {id}"
            )))
        }
    }

    async fn cancel(&self, op: OperationRef) -> Result<(), SnapshotterError> {
        self.hang_if_asked("cancel", &op).await;
        self.record("cancel", &op);
        if op.operation_id.starts_with("evil-") {
            return Err(SnapshotterError::other(EVIL_ERROR));
        }
        Ok(())
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (socket, gates, journal, hints) = match args.as_slice() {
        [_, socket, gates, journal] => (socket, gates, journal, Hints::none()),
        [_, socket, gates, journal, agent, plugin] => {
            (socket, gates, journal, Hints::new(agent, plugin.as_str()))
        }
        _ => {
            eprintln!(
                "usage: opmon-test-snapshotter SOCKET GATES_DIR JOURNAL [AGENT_SOCKET PLUGIN]"
            );
            return std::process::ExitCode::from(2);
        }
    };
    let journal = match std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(journal)
    {
        Ok(f) => f,
        Err(e) => {
            eprintln!("opening {journal}: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    // The harness validates the logged traffic against the snapshotter protocol's
    // OpenRPC document (tests/src/traffic.rs).
    if let Some(filter) = std::env::var_os(opmon_tests::traffic::SNAPSHOTTER_LOG) {
        let filter = tracing_subscriber::EnvFilter::try_new(filter.to_string_lossy())
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(false)
            .with_writer(std::io::stderr)
            .init();
    }
    let gates = PathBuf::from(gates);
    let snapshotter = Scripted {
        gates: gates.clone(),
        journal: Mutex::new(journal),
        calls: Mutex::default(),
        paced: Mutex::default(),
    };
    let mut module = rpc_module(snapshotter);
    let registered = module.register_method("gate.open", move |params, _, _| {
        #[derive(serde::Deserialize)]
        struct Gate {
            id: String,
        }
        let gate: Gate = params.parse()?;
        // A file name: no separators, nothing that leaves the gates directory.
        if gate.id.is_empty() || gate.id.contains('/') || gate.id.starts_with('.') {
            return Err(jsonrpsee::types::ErrorObjectOwned::owned(
                opmon_client::codes::INVALID_PARAMS,
                "id: must be a plain file name",
                None::<()>,
            ));
        }
        std::fs::write(gates.join(&gate.id), b"").map_err(|e| {
            jsonrpsee::types::ErrorObjectOwned::owned(
                jsonrpsee::types::error::INTERNAL_ERROR_CODE,
                format!("opening gate {}: {e}", gate.id),
                None::<()>,
            )
        })?;
        hints.changed(&gate.id);
        Ok::<_, jsonrpsee::types::ErrorObjectOwned>(())
    });
    if let Err(e) = registered {
        eprintln!("opmon-test-snapshotter: registering gate.open: {e}");
        return std::process::ExitCode::FAILURE;
    }
    match serve_methods(socket, module, termination()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("opmon-test-snapshotter: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
