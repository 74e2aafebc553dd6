//! The API's method names, written once: the agent registers its handlers under these,
//! the client and the CLI call them, the params fuzzer walks them. `backup.*` and
//! `restore.*` are derived from one list of verbs, so the two kinds cannot drift apart.
//!
//! The table also says which calls the client may repeat after a lost connection
//! ([`Retry`]), because that is a fact about the method, not about a caller.

use crate::OwnerKind;

/// `agent.status`.
pub const AGENT_STATUS: &str = "agent.status";
/// `snapshotter.register`.
pub const SNAPSHOTTER_REGISTER: &str = "snapshotter.register";
/// `snapshotter.list`.
pub const SNAPSHOTTER_LIST: &str = "snapshotter.list";
/// `snapshotter.unregister`.
pub const SNAPSHOTTER_UNREGISTER: &str = "snapshotter.unregister";
/// `server.started`: a backup server says it (re)started.
pub const SERVER_STARTED: &str = "server.started";
/// `snapshotter.changed`: a snapshotter's hint that some of its operations changed, so
/// the agent polls them now instead of at its next tick.
pub const SNAPSHOTTER_CHANGED: &str = "snapshotter.changed";

/// The snapshotter protocol: the agent calls these on a socket snapshotter.
pub const OPERATION_PROGRESS: &str = "operation.progress";
/// The snapshotter protocol's Cancel.
pub const OPERATION_CANCEL: &str = "operation.cancel";

/// `rpc.discover`: the agent's OpenRPC document (client/openrpc/opmon.json).
pub const RPC_DISCOVER: &str = "rpc.discover";

/// The API version `agent.status` reports and the OpenRPC document's `info.version`.
/// The major number changes only when a call that worked stops working; additions show
/// in [`FEATURES`].
pub const API_VERSION: &str = "1.2.0";

/// The optional features `agent.status` lists, so a client can tell an agent that has
/// one from an older agent that does not (client/REFERENCE.md says what each means).
pub const FEATURES: &[&str] = &[
    // `start {finalize}` for restores and the `restore_finalize` setting.
    "restore_finalize",
    // `server.started` and `start {server}`.
    "server.started",
    // `start {object}`, passed to snapshotters as `owner.object`.
    "object",
    // `addOperations` takes each operation's `created`.
    "created",
    // `Owner.failureReason`.
    "failureReason",
    // `finalize {errors, warnings}`.
    "finalize_counts",
    // `rpc.discover` answers with the OpenRPC document.
    "openrpc",
    // `*.cancel`, the Canceled operation phase and `Operation.cancelRequested`.
    "cancel",
    // `stallTimeout` and `startTimeout` (snapshotters and `start`).
    "deadlines",
    // Transient snapshotter errors (code 2003, `data.retryable`, exit 75) retried with
    // backoff; `Operation.attempts`, `lastError`, `nextAttemptAt`.
    "retries",
    // `events`: each owner's history, with the callers of the calls that changed it.
    "events",
    // `Operation.rate`/`eta` and `Owner.progress`: smoothed rates and ETAs.
    "rate",
    // `snapshotter.changed`: a snapshotter's hint makes the agent poll at once.
    "snapshotter.changed",
];

/// When the client may send a request again after the connection broke before the
/// answer arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// Always: a read, or a write that the agent makes idempotent (the same request
    /// twice has the effect of once and answers alike, or, for `addOperations`, counts
    /// the repeated operations as `alreadyKnown`).
    Always,
    /// Only if the request certainly did not reach the agent (the connection could not
    /// be made, or the request could not be written). Once sent, a second copy could do
    /// harm or mislead: a repeated `endInProgress` answers "wrong phase" for a change it
    /// made itself; a repeated `delete` could delete an owner re-created under the same
    /// name meanwhile. The caller gets [`crate::Error::Interrupted`] and reads back.
    IfNotSent,
}

/// The retry rule of any method by its full name; methods this table does not know
/// (a newer agent's, a snapshotter's own) are repeated only if not sent.
pub fn retry_of(method: &str) -> Retry {
    match method {
        // `server.started` fails only owners of other instances: a repeat fails nothing more.
        // A hint changes nothing by itself: a repeat at most polls once more.
        AGENT_STATUS | SNAPSHOTTER_LIST | SNAPSHOTTER_REGISTER | SERVER_STARTED
        | SNAPSHOTTER_CHANGED => Retry::Always,
        _ => match method.split_once('.') {
            Some((kind, verb)) if kind.parse::<OwnerKind>().is_ok() => OwnerMethod::ALL
                .iter()
                .find(|m| m.verb() == verb)
                .map_or(Retry::IfNotSent, |m| m.retry()),
            _ => Retry::IfNotSent,
        },
    }
}

macro_rules! owner_methods {
    ($($(#[$doc:meta])* $variant:ident => $verb:literal, $retry:ident;)+) => {
        /// A method of owners, the same for both kinds: `Start.name(Backup)` is
        /// `"backup.start"`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum OwnerMethod {
            $($(#[$doc])* $variant,)+
        }

        impl OwnerMethod {
            /// Every method, in the order the API lists them.
            pub const ALL: &'static [OwnerMethod] = &[$(OwnerMethod::$variant),+];

            /// The name after the kind, e.g. `addOperations`.
            pub fn verb(self) -> &'static str {
                match self {
                    $(OwnerMethod::$variant => $verb,)+
                }
            }

            /// The full method name for owners of `kind`, e.g. `restore.finalize`.
            pub fn name(self, kind: OwnerKind) -> &'static str {
                match (self, kind) {
                    $(
                        (OwnerMethod::$variant, OwnerKind::Backup) => concat!("backup.", $verb),
                        (OwnerMethod::$variant, OwnerKind::Restore) => concat!("restore.", $verb),
                    )+
                }
            }

            /// Whether the client may repeat it after a lost connection.
            pub fn retry(self) -> Retry {
                match self {
                    $(OwnerMethod::$variant => Retry::$retry,)+
                }
            }
        }
    };
}

owner_methods! {
    /// Same name and uid again returns the owner.
    Start => "start", Always;
    /// Idempotent on the operation's identity; repeats count as `alreadyKnown`.
    AddOperations => "addOperations", Always;
    /// A repeat answers 1003 (no longer InProgress).
    EndInProgress => "endInProgress", IfNotSent;
    Get => "get", Always;
    List => "list", Always;
    Operations => "operations", Always;
    /// Repeated with the time that is left.
    Wait => "wait", Always;
    ItemOperations => "itemOperations", Always;
    /// The owner's history, a page at a time.
    Events => "events", Always;
    /// A finalized owner answers with the first finalize's result.
    Finalize => "finalize", Always;
    /// A repeat could delete an owner re-created under the same name meanwhile.
    Delete => "delete", IfNotSent;
    /// A repeat answers 1003 (already canceled, or the owner Failed by the first).
    Cancel => "cancel", IfNotSent;
    /// WebSocket only; the client resubscribes after a reconnect.
    Subscribe => "subscribe", Always;
    Unsubscribe => "unsubscribe", Always;
    /// The notification `subscribe` sends (not a method one calls).
    Changed => "changed", Always;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_kind_a_dot_and_the_verb() {
        for kind in OwnerKind::ALL {
            for m in OwnerMethod::ALL {
                assert_eq!(m.name(kind), format!("{kind}.{}", m.verb()));
            }
        }
        assert_eq!(
            OwnerMethod::EndInProgress.name(OwnerKind::Restore),
            "restore.endInProgress"
        );
    }

    #[test]
    fn only_end_in_progress_delete_and_unregister_wait_for_certainty() {
        let careful: Vec<_> = OwnerMethod::ALL
            .iter()
            .filter(|m| m.retry() == Retry::IfNotSent)
            .collect();
        assert_eq!(
            careful,
            [
                &OwnerMethod::EndInProgress,
                &OwnerMethod::Delete,
                &OwnerMethod::Cancel
            ]
        );
        assert_eq!(retry_of(SNAPSHOTTER_UNREGISTER), Retry::IfNotSent);
        assert_eq!(retry_of(SNAPSHOTTER_REGISTER), Retry::Always);
        assert_eq!(retry_of("copy.start"), Retry::IfNotSent);
        assert_eq!(retry_of("restore.get"), Retry::Always);
        assert_eq!(retry_of("backup.delete"), Retry::IfNotSent);
    }
}
