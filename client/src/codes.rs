//! Error codes of the opmon API beside the JSON-RPC 2.0 ones.
//!
//! The numbers are part of the contract (docs/architecture.md, "The API"): backup servers
//! branch on them, so they never change meaning.

/// JSON-RPC: the request body is not JSON.
pub const PARSE_ERROR: i32 = -32700;
/// JSON-RPC: the body is JSON but not a request.
pub const INVALID_REQUEST: i32 = -32600;
/// JSON-RPC: no such method.
pub const METHOD_NOT_FOUND: i32 = -32601;
/// JSON-RPC: the params are wrong; the message names the field.
pub const INVALID_PARAMS: i32 = -32602;
/// The named owner (or snapshotter) does not exist.
pub const NOT_FOUND: i32 = 1001;
/// The name is taken by another owner (different uid) or snapshotter.
pub const ALREADY_EXISTS: i32 = 1002;
/// The owner is not in a phase that allows the request.
pub const WRONG_PHASE: i32 = 1003;
/// The database or the storage directory failed (disk full, I/O); the message says which.
pub const STORAGE_FAILURE: i32 = 1004;
/// `finalize` could not produce its results.
pub const FINALIZE_FAILED: i32 = 1005;
/// Snapshotter protocol: this snapshotter does not handle the operation's item.
pub const OPERATIONS_NOT_SUPPORTED: i32 = 2001;
/// Snapshotter protocol: the operation ID is unknown to the snapshotter.
pub const INVALID_OPERATION_ID: i32 = 2002;
/// Snapshotter protocol: the call failed for a reason that may pass (a busy backend, a
/// lost connection to storage); the agent tries again with backoff, up to the
/// snapshotter's retry budget. Any error whose `data` has `retryable: true` is taken the
/// same way.
pub const TRANSIENT: i32 = 2003;
