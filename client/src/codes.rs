//! Every error code of the opmon API, in one table: the JSON-RPC 2.0 ones, the server
//! limits the agent answers with, the agent's own, and the snapshotter protocol's.
//!
//! The constants, the OpenRPC documents' error objects (`components.errors` and each
//! method's `errors`) and the client's typed [`Code`] all come from the table below.
//! The numbers are part of the contract: backup servers branch on them, so they never
//! change meaning.

/// One error code as documented: its number, its name in the OpenRPC document, the
/// start of its `message` (for the agent's own codes the message says what exactly was
/// wrong) and when it is answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ErrorDoc {
    pub code: i32,
    pub name: &'static str,
    pub message: &'static str,
    pub meaning: &'static str,
}

macro_rules! error_table {
    (
        agent { $($(#[doc = $doc:literal])* $const:ident = $code:literal, $variant:ident, $message:literal, $meaning:literal;)+ }
        snapshotter { $($(#[doc = $sdoc:literal])* $sconst:ident = $scode:literal, $svariant:ident, $smessage:literal, $smeaning:literal;)+ }
    ) => {
        $($(#[doc = $doc])* pub const $const: i32 = $code;)+
        $($(#[doc = $sdoc])* pub const $sconst: i32 = $scode;)+

        /// The codes the agent answers with, in the order the OpenRPC document lists them.
        pub const AGENT_ERRORS: &[ErrorDoc] = &[$(ErrorDoc {
            code: $code,
            name: stringify!($variant),
            message: $message,
            meaning: $meaning,
        }),+];

        /// The codes a snapshotter answers the agent with (the snapshotter protocol).
        pub const SNAPSHOTTER_ERRORS: &[ErrorDoc] = &[$(ErrorDoc {
            code: $scode,
            name: stringify!($svariant),
            message: $smessage,
            meaning: $smeaning,
        }),+, ErrorDoc {
            code: INTERNAL_ERROR,
            name: "Other",
            message: "Internal error",
            meaning: "any other failure (the SDK's SnapshotterError::other); the operation \
                      fails with the message. The agent takes any code it does not know \
                      the same way",
        }];

        /// An error code of the agent's answers, typed: match on it, or use the
        /// `is_*` helpers of [`crate::Error`]. A code this client does not know (a newer
        /// agent's) is [`Code::Other`].
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Code {
            $($(#[doc = $doc])* $variant,)+
            /// A code this version of the client does not know.
            Other(i32),
        }

        impl Code {
            /// The typed code of the number `code`.
            ///
            /// ```
            /// use opmon_client::codes::Code;
            /// assert_eq!(Code::of(1001), Code::NotFound);
            /// assert_eq!(Code::of(4242), Code::Other(4242));
            /// ```
            pub fn of(code: i32) -> Code {
                match code {
                    $($code => Code::$variant,)+
                    other => Code::Other(other),
                }
            }

            /// The number on the wire.
            ///
            /// ```
            /// use opmon_client::codes::Code;
            /// assert_eq!(Code::WrongPhase.number(), 1003);
            /// ```
            pub fn number(self) -> i32 {
                match self {
                    $(Code::$variant => $code,)+
                    Code::Other(code) => code,
                }
            }
        }
    };
}

error_table! {
    agent {
        /// JSON-RPC: the request body is not JSON.
        PARSE_ERROR = -32700, ParseError, "Parse error", "the body is not JSON";
        /// JSON-RPC: the body is JSON but not a request.
        INVALID_REQUEST = -32600, InvalidRequest, "Invalid request", "not a JSON-RPC 2.0 request; also a POST whose Content-Type is not JSON or a form (HTTP 415), and a subscription called in a batch";
        /// JSON-RPC: no such method.
        METHOD_NOT_FOUND = -32601, MethodNotFound, "Method not found", "no such method; also a `*.subscribe` called over plain HTTP (it needs a WebSocket)";
        /// JSON-RPC: the params are wrong; the message names the field.
        INVALID_PARAMS = -32602, InvalidParams, "Invalid params", "the params are wrong; the message starts with the offending field's path (`operations[3].resource.name: ...`)";
        /// The connection is not admitted (the agent's admission check, in the
        /// implementation-defined server error range).
        REFUSED = -32003, Refused, "refused", "the connection is not admitted: the peer's uid and groups are not allowed (HTTP 403), or its uid holds max_connections_per_uid connections, or other uids hold all the connections the agent takes (HTTP 429); or a call would pass a cap of the agent's over all peers (subscriptions, snapshotters, finalizes; the message names it), or max_held_bytes: a batch stops before its next call while the agent holds that much for its peers";
        /// JSON-RPC: a bug in the agent.
        INTERNAL_ERROR = -32603, InternalError, "Internal error", "a bug in the agent: report it with the agent's log";
        /// jsonrpsee's limit of subscriptions on one WebSocket connection.
        TOO_MANY_SUBSCRIPTIONS = -32006, TooManySubscriptions, "Too many subscriptions on the connection", "jsonrpsee's limit of 1024 subscriptions on one WebSocket connection";
        /// The request is over the agent's `max_request_size`.
        OVERSIZED_REQUEST = -32007, OversizedRequest, "Request is too big", "the request is over max_request_size (HTTP 413)";
        /// The response would be over the agent's limit.
        OVERSIZED_RESPONSE = -32008, OversizedResponse, "Response is too big", "the response would be over 256 MiB";
        /// A batch of more calls than the agent takes.
        OVERSIZED_BATCH_REQUEST = -32010, OversizedBatchRequest, "The batch request was too large", "a batch of more than 10000 calls: none is run";
        /// A batch's answer grew too large.
        OVERSIZED_BATCH_RESPONSE = -32011, OversizedBatchResponse, "the answer to this batch grew past 16777216 bytes", "a batch's answer would be over 16 MiB: the batch is answered with this one error (id null) instead of a list, and its calls after the cut are not run";
        /// The named owner (or snapshotter) does not exist.
        NOT_FOUND = 1001, NotFound, "not found", "the named owner or snapshotter does not exist";
        /// The name is taken by another owner (different uid).
        ALREADY_EXISTS = 1002, AlreadyExists, "already exists", "the name is taken by an owner with another uid that has not ended (the message says its phase), or the uid is a retired owner's of the name";
        /// The owner is not in a phase that allows the request.
        WRONG_PHASE = 1003, WrongPhase, "wrong phase", "the owner is not in a phase that allows the request; the error's data says the phase: {\"phase\": ...} for the owner's, {\"operation\": {\"index\", \"operationId\", \"phase\"}} for a chosen operation that is finished";
        /// The database or the storage directory failed (disk full, I/O); the message says which.
        STORAGE_FAILURE = 1004, StorageFailure, "storage failure", "the database or the storage directory failed (disk full, I/O); the message says which";
        /// `finalize` could not produce its results.
        FINALIZE_FAILED = 1005, FinalizeFailed, "finalize failed", "finalize could not produce its results; the message says why";
    }
    snapshotter {
        /// Snapshotter protocol: this snapshotter does not handle the operation's item.
        OPERATIONS_NOT_SUPPORTED = 2001, OperationsNotSupported, "operations not supported", "this snapshotter does not handle the operation's item; the operation fails";
        /// Snapshotter protocol: the operation ID is unknown to the snapshotter.
        INVALID_OPERATION_ID = 2002, InvalidOperationId, "invalid operation ID", "the operation ID is unknown to the snapshotter; the operation fails";
        /// Snapshotter protocol: the call failed for a reason that may pass (a busy
        /// backend, a lost connection to storage); the agent tries again with backoff, up
        /// to the snapshotter's retry budget. Any error whose `data` has `retryable: true`
        /// is taken the same way.
        TRANSIENT = 2003, Transient, "transient failure", "the failure may pass: the agent asks again with backoff within the snapshotter's retry budget, then fails the operation with the message (any error with data.retryable true counts the same)";
    }
}

/// What the table says of `code` among the agent's errors.
pub fn agent_error(code: i32) -> Option<&'static ErrorDoc> {
    AGENT_ERRORS.iter().find(|e| e.code == code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_unique_and_typed_both_ways() {
        for (i, e) in AGENT_ERRORS.iter().enumerate() {
            assert!(AGENT_ERRORS[..i].iter().all(|o| o.code != e.code), "{e:?}");
            assert_eq!(Code::of(e.code).number(), e.code);
            assert_ne!(Code::of(e.code), Code::Other(e.code));
        }
        assert_eq!(Code::of(1001), Code::NotFound);
        assert_eq!(Code::of(4242), Code::Other(4242));
    }
}
