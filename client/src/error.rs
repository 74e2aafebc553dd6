//! Why a call or a subscription failed.
//!
//! Each variant's message says what this layer was doing; the underlying cause, where
//! there is one, is [`std::error::Error::source`] (print the chain, as the `opmon` CLI
//! and `anyhow`'s `{:#}` do, for the whole story). Variants say whether the agent
//! answered (`Rpc`, `Http`), could not be reached (`Connect`, `Timeout`), or was lost in
//! the middle of something (`Interrupted`, `AgentGone`), because a backup server acts
//! differently on each.

use std::path::PathBuf;
use std::time::Duration;

use crate::codes::Code;
use crate::duration::GoDuration;
use crate::OwnerPhase;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Nothing answers on the socket: no such file, connection refused, permission
    /// denied. The agent is not running (or not reachable by this user).
    #[error("cannot connect to {peer} at {}", path.display())]
    Connect {
        path: PathBuf,
        /// Who was expected there: "the opmon agent", or what
        /// [`crate::ClientBuilder::peer`] said (a snapshotter's name).
        peer: String,
        #[source]
        source: std::io::Error,
    },
    /// The agent did not answer in time: `what` is the step that timed out (connecting,
    /// or a call with its method name).
    #[error("{what} at {} timed out after {}", path.display(), GoDuration(*after))]
    Timeout {
        path: PathBuf,
        what: String,
        after: Duration,
    },
    /// The agent answered with a JSON-RPC error: its typed `code` (match on it, or use
    /// [`Error::is_not_found`] and the other helpers), its `message` (which names what
    /// was wrong) and its `data`, as the agent sent it (a wrong-phase error's `data`
    /// has the phase: [`Error::phase`]).
    #[error("{message} (code {})", code.number())]
    Rpc {
        code: Code,
        message: String,
        data: Option<serde_json::Value>,
    },
    /// The agent answered with an HTTP error that is not a JSON-RPC answer (for
    /// example 403 for a peer it does not admit); `body` is its text, control
    /// characters escaped.
    #[error("the opmon agent at {} answered HTTP {status}: {body}", path.display())]
    Http {
        path: PathBuf,
        status: u16,
        body: String,
    },
    /// The connection broke after `method` was sent, and the method is not safe to
    /// repeat (see [`crate::methods::Retry`]): the agent may or may not have applied it.
    /// Read the owner back to see.
    #[error("the connection to the opmon agent broke after {method} was sent; it may or may not have been applied")]
    Interrupted {
        method: String,
        #[source]
        source: Box<Error>,
    },
    /// The agent this client had reached went away (a call could not be sent, or a
    /// subscription's connection broke) and did not come back within the call timeout.
    #[error("lost the opmon agent at {} and it did not come back within {}", path.display(), GoDuration(*after))]
    AgentGone {
        path: PathBuf,
        after: Duration,
        #[source]
        source: Box<Error>,
    },
    /// The agent ended a subscription before the owner was terminal, saying why (the
    /// owner was deleted).
    #[error("{kind} {name}: the agent ended the subscription: {reason}")]
    SubscriptionEnded {
        kind: crate::OwnerKind,
        name: String,
        reason: String,
    },
    /// Reading or writing the socket failed mid-exchange.
    #[error("talking to the opmon agent at {}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The agent's answer was not what the protocol says (bad HTTP, bad JSON, a result
    /// of another type, a frame too large).
    #[error("the opmon agent at {} answered {what}", path.display())]
    Protocol {
        path: PathBuf,
        what: String,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The params could not be serialized.
    #[error("serializing the params of {method}")]
    Params {
        method: String,
        #[source]
        source: serde_json::Error,
    },
}

/// The predicates on the agent's error codes, declared once: `is_x()` is true when the
/// agent answered with that code.
macro_rules! code_predicates {
    ($($(#[doc = $doc:literal])* $name:ident = $code:ident;)+) => {
        impl Error {
            $($(#[doc = $doc])* pub fn $name(&self) -> bool {
                self.rpc_code() == Some(Code::$code)
            })+
        }
    };
}

code_predicates! {
    /// The named owner or snapshotter does not exist (code 1001).
    is_not_found = NotFound;
    /// The name is taken by an owner with another uid (code 1002).
    is_already_exists = AlreadyExists;
    /// The owner is not in a phase that allows the request (code 1003); [`Error::phase`]
    /// says which phase it is in.
    ///
    /// ```
    /// # use opmon_client::{codes::Code, Error};
    /// let e = Error::Rpc { code: Code::WrongPhase, message: "…".into(), data: None };
    /// assert!(e.is_wrong_phase() && !e.is_not_found());
    /// ```
    is_wrong_phase = WrongPhase;
    /// The params were refused (code -32602); the message names the field.
    is_invalid_params = InvalidParams;
    /// The agent's database or storage directory failed (code 1004).
    is_storage_failure = StorageFailure;
    /// `finalize` could not produce its results (code 1005).
    is_finalize_failed = FinalizeFailed;
}

impl Error {
    /// The JSON-RPC error code's number, if the agent answered with an error.
    ///
    /// ```
    /// # use opmon_client::{codes::{self, Code}, Error};
    /// let e = Error::Rpc { code: Code::NotFound, message: "backup b not found".into(), data: None };
    /// assert_eq!(e.code(), Some(codes::NOT_FOUND));
    /// ```
    pub fn code(&self) -> Option<i32> {
        self.rpc_code().map(Code::number)
    }

    /// The typed JSON-RPC error code, if the agent answered with an error.
    ///
    /// ```
    /// # use opmon_client::{codes::Code, Error};
    /// # fn handle(e: Error) {
    /// match e.rpc_code() {
    ///     Some(Code::NotFound) => println!("gone already"),
    ///     Some(Code::WrongPhase) => println!("too late: {e}"),
    ///     _ => println!("failed: {}", e.chain()),
    /// }
    /// # }
    /// ```
    pub fn rpc_code(&self) -> Option<Code> {
        match self {
            Error::Rpc { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The `data` of the agent's error answer, if it sent one.
    pub fn data(&self) -> Option<&serde_json::Value> {
        match self {
            Error::Rpc { data, .. } => data.as_ref(),
            _ => None,
        }
    }

    /// The request or its answer was over a limit of the agent (codes -32007, -32008,
    /// -32010, -32011, or HTTP 413).
    pub fn is_too_big(&self) -> bool {
        matches!(
            self.rpc_code(),
            Some(
                Code::OversizedRequest
                    | Code::OversizedResponse
                    | Code::OversizedBatchRequest
                    | Code::OversizedBatchResponse
            )
        ) || matches!(self, Error::Http { status: 413, .. })
    }

    /// The agent did not admit this client (code -32003, or HTTP 403 or 429).
    pub fn is_refused(&self) -> bool {
        self.rpc_code() == Some(Code::Refused)
            || matches!(
                self,
                Error::Http {
                    status: 403 | 429,
                    ..
                }
            )
    }

    /// The owner's phase a wrong-phase error reports (its `data.phase`), if the agent
    /// sent it (this version of the agent does).
    ///
    /// ```
    /// # use opmon_client::{codes::Code, Error};
    /// use opmon_client::OwnerPhase;
    /// let data = serde_json::json!({"phase": "Completed"});
    /// let e = Error::Rpc { code: Code::WrongPhase, message: "…".into(), data: Some(data) };
    /// assert_eq!(e.phase(), Some(OwnerPhase::Completed));
    /// ```
    pub fn phase(&self) -> Option<OwnerPhase> {
        let phase = self.data()?.get("phase")?;
        serde_json::from_value(phase.clone()).ok()
    }

    /// Whether the failure is the transport's (the agent stopped, restarted, or never
    /// answered), as opposed to an answer: a call that failed this way may be tried
    /// again when the agent is back.
    ///
    /// ```
    /// # use opmon_client::{codes::Code, Error};
    /// let e = Error::Rpc { code: Code::NotFound, message: "…".into(), data: None };
    /// assert!(!e.is_transport()); // the agent answered
    /// ```
    pub fn is_transport(&self) -> bool {
        matches!(
            self,
            Error::Connect { .. }
                | Error::Timeout { .. }
                | Error::Io { .. }
                | Error::Interrupted { .. }
                | Error::AgentGone { .. }
        )
    }

    /// This error's message followed by each source's, joined by `": "`.
    ///
    /// ```
    /// # use opmon_client::{codes::Code, Error};
    /// let e = Error::Rpc { code: Code::NotFound, message: "backup b not found".into(), data: None };
    /// assert_eq!(e.chain(), "backup b not found (code 1001)");
    /// ```
    pub fn chain(&self) -> String {
        chain(self)
    }
}

/// The message of `error` followed by each source's, joined by `": "` (as `anyhow`'s
/// `{:#}` prints them): for errors of any type.
///
/// ```
/// let io = std::io::Error::other("disk full");
/// assert_eq!(opmon_client::error::chain(&io), "disk full");
/// ```
pub fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(e) = next {
        text.push_str(": ");
        text.push_str(&e.to_string());
        next = e.source();
    }
    text
}

/// Why the client refused the process serving the socket: its uid (`SO_PEERCRED`) is
/// not root, this process's own, or one it was told to trust
/// ([`crate::ClientBuilder::agent_uid`]). It is the source of [`Error::Connect`]'s
/// `io::Error` (kind `PermissionDenied`), so a caller can tell it from the socket's own
/// permissions and name the uid to trust.
#[derive(Debug, thiserror::Error)]
#[error(
    "refusing the agent: the socket is served by uid {peer}, which is not root, this user \
     (uid {own}) or a configured agent uid; another user may have put their socket in the \
     agent's place"
)]
pub struct UntrustedAgent {
    /// The uid serving the socket.
    pub peer: u32,
    /// This process's effective uid.
    pub own: u32,
}
