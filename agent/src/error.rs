//! The agent's error, one variant per API error code, each carrying a message that
//! names what was wrong (which backup, which field, which file).

use jsonrpsee::types::ErrorObjectOwned;
use opmon_client::{codes, OwnerKind, OwnerPhase};

use crate::store::{StorageCause, StorageFailure};

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// -32602; the message starts with the offending field's path.
    #[error("{0}")]
    InvalidParams(String),
    /// 1001.
    #[error("{0}")]
    NotFound(NotFound),
    /// 1002.
    #[error("{0}")]
    AlreadyExists(Taken),
    /// 1003.
    #[error("{0}")]
    WrongPhase(WrongPhase),
    /// 1004.
    #[error("storage failure: {0}")]
    Storage(StorageFailure),
    /// 1005.
    #[error("finalize failed: {0}")]
    Finalize(String),
    /// -32003: one of the agent's global bounds is full (connections of a uid, calls,
    /// bytes held, subscriptions, snapshotters, finalizes); the message names it.
    #[error("{0}")]
    OverQuota(String),
    /// The agent is stopping and gave the call up. The call is not answered, as if the
    /// agent had died, so that a client repeats it once the agent is back (only calls
    /// safe to repeat end so).
    #[error("the agent stopped before the call completed; repeat it once the agent is back")]
    Stopping,
}

/// What was not there (error 1001). The message is made here, when the error is shown.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NotFound {
    #[error("{0} {1} not found")]
    Owner(OwnerKind, String),
    /// `uid` named an owner the name never had (or one removed since).
    #[error("{0} {1} with uid {2} not found")]
    OwnerOfUid(OwnerKind, String, String),
    /// Deleted while a subscription followed it.
    #[error("{0} {1} was deleted")]
    Deleted(OwnerKind, String),
    #[error("{0} {1} was deleted during finalize")]
    DeletedDuringFinalize(OwnerKind, String),
    /// Its row went between two statements of one request.
    #[error("owner {0} vanished during the request")]
    Vanished(i64),
    #[error("snapshotter {0} not found")]
    Snapshotter(String),
    /// `*.cancel` named an operation the owner does not have.
    #[error("operations[{index}]: {kind} {name} has no operation {operation}")]
    Operation {
        index: usize,
        kind: OwnerKind,
        name: String,
        /// The ID as given, quoted, with its item when one was given.
        operation: String,
    },
}

/// Why `start` cannot make an owner of a name and uid (error 1002). An owner is its
/// backup server's object, name and uid: a name goes to a new uid once its owner has
/// ended (Velero reuses a name only after the object of that name is gone).
#[derive(Debug, Clone, thiserror::Error)]
pub enum Taken {
    #[error(
        "{kind} {name} already exists with uid {uid} and is still {phase}: its name goes \
         to a new uid only once it has ended (a backup server reuses a name only after \
         the object of that name is gone, and this one's operations are still \
         monitored); cancel or delete it first (`opmon {kind} cancel {name}`, \
         `opmon {kind} delete {name}`)"
    )]
    NotEnded {
        kind: OwnerKind,
        name: String,
        uid: String,
        phase: OwnerPhase,
    },
    #[error(
        "{kind} {name} with uid {uid} has ended and was replaced by another uid: a uid \
         names one object, which is not started again"
    )]
    Retired {
        kind: OwnerKind,
        name: String,
        uid: String,
    },
}

/// Why an owner's phase refuses a request (error 1003).
#[derive(Debug, Clone, thiserror::Error)]
pub enum WrongPhase {
    #[error("{kind} {name} is {phase}; {request} is allowed only while InProgress")]
    NotInProgress {
        kind: OwnerKind,
        name: String,
        phase: OwnerPhase,
        request: &'static str,
    },
    #[error("{kind} {name} was replaced during endInProgress")]
    ReplacedDuringEndInProgress { kind: OwnerKind, name: String },
    #[error("{kind} {name} is {phase}; finalize needs Finalizing or FinalizingPartiallyFailed")]
    NotFinalizing {
        kind: OwnerKind,
        name: String,
        phase: OwnerPhase,
    },
    #[error(
        "{kind} {name} is {phase}; cancel is allowed only while InProgress, \
         WaitingForPluginOperations or WaitingForPluginOperationsPartiallyFailed"
    )]
    NotCancelable {
        kind: OwnerKind,
        name: String,
        phase: OwnerPhase,
    },
    #[error(
        "operations[{index}]: operation {operation_id:?} of {kind} {name} (item {item}) is \
         {phase}; only New or InProgress operations can be canceled"
    )]
    OperationFinished {
        index: usize,
        kind: OwnerKind,
        name: String,
        operation_id: String,
        item: String,
        phase: opmon_client::OperationPhase,
    },
    #[error("{kind} {name} became {phase} during finalize")]
    ChangedDuringFinalize {
        kind: OwnerKind,
        name: String,
        phase: OwnerPhase,
    },
}

impl Error {
    pub fn code(&self) -> i32 {
        match self {
            Error::InvalidParams(_) => codes::INVALID_PARAMS,
            Error::NotFound(_) => codes::NOT_FOUND,
            Error::AlreadyExists(_) => codes::ALREADY_EXISTS,
            Error::WrongPhase(_) => codes::WRONG_PHASE,
            Error::Storage(_) => codes::STORAGE_FAILURE,
            Error::Finalize(_) => codes::FINALIZE_FAILED,
            Error::OverQuota(_) => crate::edge::access::REFUSED,
            Error::Stopping => crate::edge::server::GIVEN_UP,
        }
    }
}

impl From<StorageFailure> for Error {
    fn from(e: StorageFailure) -> Self {
        Error::Storage(e)
    }
}

impl From<rusqlite::Error> for Error {
    fn from(e: rusqlite::Error) -> Self {
        Error::Storage(StorageFailure::from(e))
    }
}

impl Error {
    /// The error's `data`: what a client can act on without parsing the message. A
    /// wrong-phase error says the owner's phase (`{"phase": "Completed"}`) and, for an
    /// operation that is finished, the operation's (`{"operation": {"index": 2,
    /// "operationId": "…", "phase": "Completed"}}`).
    fn data(&self) -> Option<serde_json::Value> {
        let Error::WrongPhase(wrong) = self else {
            return None;
        };
        Some(match wrong {
            WrongPhase::NotInProgress { phase, .. }
            | WrongPhase::NotFinalizing { phase, .. }
            | WrongPhase::NotCancelable { phase, .. }
            | WrongPhase::ChangedDuringFinalize { phase, .. } => {
                serde_json::json!({ "phase": phase })
            }
            WrongPhase::OperationFinished {
                index,
                operation_id,
                phase,
                ..
            } => serde_json::json!({
                "operation": {"index": index, "operationId": operation_id, "phase": phase}
            }),
            WrongPhase::ReplacedDuringEndInProgress { .. } => return None,
        })
    }
}

impl From<Error> for ErrorObjectOwned {
    fn from(e: Error) -> Self {
        ErrorObjectOwned::owned(e.code(), e.to_string(), e.data())
    }
}

impl StorageCause for Error {
    fn storage_cause(&self) -> StorageFailure {
        match self {
            Error::Storage(e) => e.clone(),
            other => StorageFailure {
                message: format!("the transaction was rolled back: {other}"),
                disk_full: false,
            },
        }
    }
}
