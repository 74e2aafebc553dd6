//! The agent's error, one variant per API error code, each carrying a message that
//! names what was wrong (which backup, which field, which file).

use jsonrpsee::types::ErrorObjectOwned;
use opmon_client::codes;

use crate::store::{StorageCause, StoreError};

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// -32602; the message starts with the offending field's path.
    #[error("{0}")]
    InvalidParams(String),
    /// 1001.
    #[error("{0}")]
    NotFound(String),
    /// 1002.
    #[error("{0}")]
    AlreadyExists(String),
    /// 1003.
    #[error("{0}")]
    WrongPhase(String),
    /// 1004.
    #[error("storage failure: {0}")]
    Storage(StoreError),
    /// 1005.
    #[error("finalize failed: {0}")]
    Finalize(String),
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
        }
    }
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        Error::Storage(e)
    }
}

impl From<rusqlite::Error> for Error {
    fn from(e: rusqlite::Error) -> Self {
        Error::Storage(StoreError::from(e))
    }
}

impl From<Error> for ErrorObjectOwned {
    fn from(e: Error) -> Self {
        ErrorObjectOwned::owned(e.code(), e.to_string(), None::<()>)
    }
}

impl StorageCause for Error {
    fn storage_cause(&self) -> StoreError {
        match self {
            Error::Storage(e) => e.clone(),
            other => StoreError {
                message: format!("the transaction was rolled back: {other}"),
                disk_full: false,
            },
        }
    }
}
