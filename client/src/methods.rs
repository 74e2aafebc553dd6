//! The API's methods, each declared once: its name, params and result types, whether a
//! lost answer may be sent again, whether it mostly waits, the errors it can answer with
//! and a line of doc. The agent registers its handlers from these declarations, the
//! typed client and its retry table call through them, the OpenRPC document
//! (`openrpc/opmon.json`) is generated from them, and the `opmon` CLI sends them.
//!
//! A declaration is a type implementing [`Method`] (as lsp-types' `Request`): the types
//! are checked where a call is made and where it is served. Owner methods are declared
//! once for both kinds: [`Start`] is `backup.start` and `restore.start`.
//!
//! Adding a method: declare it here, write its handler in the agent's core (registered
//! in agent/src/api.rs, which checks at start that every declared method is served) and
//! its `opmon` subcommand; the document and the client's retry table follow.

use crate::codes::*;
use crate::types;
use crate::OwnerKind;

/// `agent.status` etc. as plain names, for callers that build requests by hand.
pub const AGENT_STATUS: &str = Status::DECL.verb;
/// `snapshotter.register`.
pub const SNAPSHOTTER_REGISTER: &str = RegisterSnapshotter::DECL.verb;
/// `snapshotter.list`.
pub const SNAPSHOTTER_LIST: &str = ListSnapshotters::DECL.verb;
/// `snapshotter.unregister`.
pub const SNAPSHOTTER_UNREGISTER: &str = UnregisterSnapshotter::DECL.verb;
/// `rpc.discover`: the agent's OpenRPC document (client/openrpc/opmon.json).
pub const RPC_DISCOVER: &str = Discover::DECL.verb;

/// The snapshotter protocol: the agent calls these on a socket snapshotter.
pub const OPERATION_PROGRESS: &str = "operation.progress";
/// The snapshotter protocol's Cancel.
pub const OPERATION_CANCEL: &str = "operation.cancel";

/// The API version `agent.status` reports and the OpenRPC document's `info.version`.
/// The major number changes only when a call that worked stops working; additions show
/// in [`FEATURES`].
pub const API_VERSION: &str = "1.3.0";

macro_rules! features {
    ($($(#[doc = $doc:literal])* $variant:ident = $name:literal,)+) => {
        /// An optional feature `agent.status` lists, so a client can tell an agent that
        /// has it from an older agent that does not ([`crate::AgentStatus::supports`];
        /// client/REFERENCE.md says what each means).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum Feature {
            $($(#[doc = $doc])* $variant,)+
        }

        impl Feature {
            /// Every feature this version has, in the order `agent.status` lists them.
            pub const ALL: &'static [Feature] = &[$(Feature::$variant),+];

            /// Its name in `agent.status`'s `features`.
            ///
            /// ```
            /// assert_eq!(opmon_client::methods::Feature::ServerStarted.as_str(), "server.started");
            /// ```
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Feature::$variant => $name,)+
                }
            }
        }

        /// The names of [`Feature::ALL`], as `agent.status` lists them.
        pub const FEATURES: &[&str] = &[$($name),+];
    };
}

features! {
    /// `start {finalize}` for restores and the `restore_finalize` setting.
    RestoreFinalize = "restore_finalize",
    /// `server.started` and `start {server}`.
    ServerStarted = "server.started",
    /// `start {object}`, passed to snapshotters as `owner.object`.
    Object = "object",
    /// `addOperations` takes each operation's `created`.
    Created = "created",
    /// `Owner.failureReason`.
    FailureReason = "failureReason",
    /// `finalize {errors, warnings}`.
    FinalizeCounts = "finalize_counts",
    /// `rpc.discover` answers with the OpenRPC document.
    OpenRpc = "openrpc",
    /// `*.cancel`, the Canceled operation phase and `Operation.cancelRequested`.
    Cancel = "cancel",
    /// `stallTimeout` and `startTimeout` (snapshotters and `start`).
    Deadlines = "deadlines",
    /// Transient snapshotter errors (code 2003, `data.retryable`, exit 75) retried with
    /// backoff; `Operation.attempts`, `lastError`, `nextAttemptAt`.
    Retries = "retries",
    /// `events`: each owner's history, with the callers of the calls that changed it.
    Events = "events",
    /// `Operation.rate`/`eta` and `Owner.progress`: smoothed rates and ETAs.
    Rate = "rate",
    /// `snapshotter.changed`: a snapshotter's hint makes the agent poll at once.
    SnapshotterChanged = "snapshotter.changed",
    /// Owners are name and uid: `start` retires an ended owner for a new uid of its
    /// name; `uid` on the calls that read an owner; `history`; `Owner.retired`.
    Retire = "retire",
}

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

/// What a declaration says besides its types.
#[derive(Debug)]
pub struct Decl {
    /// The full name of an agent-wide method (`agent.status`); for an owner method, the
    /// verb after the kind (`addOperations`).
    pub verb: &'static str,
    /// The names of an owner method for backups and restores; `None` for agent-wide ones.
    pub owner_names: Option<[&'static str; 2]>,
    /// Whether a request whose answer was lost may be sent again.
    pub retry: Retry,
    /// Whether the method mostly waits (for a change, for snapshotters, for file work)
    /// while holding little memory.
    pub waits: bool,
    /// Whether its answer grows with what is stored (a page of owners, an owner's
    /// operations, records or events): making one takes several times its size, so the
    /// server makes few at once for one peer.
    pub grows: bool,
    /// The error codes it can answer with ([`crate::codes`]).
    pub errors: &'static [i32],
    /// One line: what it does. `{kind}` stands for `backup` or `restore`.
    pub summary: &'static str,
    /// More, where a line is not enough.
    pub details: Option<&'static str>,
    /// The result's name in the OpenRPC document.
    pub result: &'static str,
}

impl Decl {
    /// The full name for owners of `kind`; an agent-wide method's name whatever `kind`.
    pub fn name(&self, kind: OwnerKind) -> &'static str {
        match (self.owner_names, kind) {
            (Some([backup, _]), OwnerKind::Backup) => backup,
            (Some([_, restore]), OwnerKind::Restore) => restore,
            (None, _) => self.verb,
        }
    }

    /// Every full name it has: one, or one per owner kind.
    pub fn names(&self) -> &[&'static str] {
        match &self.owner_names {
            Some(names) => names,
            None => std::slice::from_ref(&self.verb),
        }
    }

    /// Whether it is a method of owners (`backup.*` and `restore.*`).
    pub fn is_owner_method(&self) -> bool {
        self.owner_names.is_some()
    }
}

/// What the OpenRPC generator needs of a type (its JSON Schema) with the `schema`
/// feature, nothing without it.
#[cfg(feature = "schema")]
#[doc(hidden)]
pub trait Schema: schemars::JsonSchema {}
#[cfg(feature = "schema")]
impl<T: schemars::JsonSchema> Schema for T {}
/// What the OpenRPC generator needs of a type with the `schema` feature.
#[cfg(not(feature = "schema"))]
#[doc(hidden)]
pub trait Schema {}
#[cfg(not(feature = "schema"))]
impl<T> Schema for T {}

/// A JSON-RPC method of the agent: its params (sent by name) and result types, and its
/// [`Decl`].
pub trait Method: 'static {
    /// What the call takes.
    type Params: serde::Serialize
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + Unpin
        + Schema
        + 'static;
    /// What it answers.
    type Result: serde::Serialize + serde::de::DeserializeOwned + Clone + Send + Schema + 'static;
    /// Its name, retry rule, errors and doc.
    const DECL: Decl;
}

/// Something that walks every declared method with its types (the OpenRPC generator,
/// the agent's check that it serves them all).
pub trait Visit {
    fn visit<M: Method>(&mut self);
}

macro_rules! declare {
    (@names agent $verb:literal) => { None };
    (@names owner $verb:literal) => {
        Some([concat!("backup.", $verb), concat!("restore.", $verb)])
    };
    (@details) => { None };
    (@details $details:literal) => { Some($details) };
    ($(
        $(#[doc = $doc:literal])*
        $scope:ident $ty:ident = $verb:literal, $params:ty => $result:ty as $rname:literal {
            retry: $retry:ident, waits: $waits:literal, grows: $grows:literal, errors: [$($err:expr),*],
            summary: $summary:literal $(, details: $details:literal)? $(,)?
        }
    )+) => {
        $(
            $(#[doc = $doc])*
            #[derive(Clone, Copy, Debug)]
            pub struct $ty;

            impl Method for $ty {
                type Params = $params;
                type Result = $result;
                const DECL: Decl = Decl {
                    verb: $verb,
                    owner_names: declare!(@names $scope $verb),
                    retry: Retry::$retry,
                    waits: $waits,
                    grows: $grows,
                    errors: &[$($err),*],
                    summary: $summary,
                    details: declare!(@details $($details)?),
                    result: $rname,
                };
            }
        )+

        /// Every declaration, in the order the OpenRPC document lists them.
        pub const ALL: &[&Decl] = &[$(&<$ty as Method>::DECL),+];

        /// Calls `v` with every declared method's type, in the order of [`ALL`].
        pub fn visit_all(v: &mut impl Visit) {
            $(v.visit::<$ty>();)+
        }
    };
}

declare! {
    /// `agent.status`.
    agent Status = "agent.status", types::NoParams => types::AgentStatus as "status" {
        retry: Always, waits: false, grows: false, errors: [INVALID_PARAMS, STORAGE_FAILURE],
        summary: "The agent's version, API version, optional features, uptime and counts.",
    }
    /// `start`.
    owner Start = "start", types::StartParams => types::Owner as "owner" {
        // Same name and uid again returns the owner.
        retry: Always, waits: false, grows: false, errors: [INVALID_PARAMS, ALREADY_EXISTS, STORAGE_FAILURE],
        summary: "Starts monitoring a {kind} in InProgress; the same name and uid again returns it.",
        details: "An owner is its backup server's object, name and uid. Same name with another uid: the owner of the name is retired if it has ended (kept, with its history: see `history`), else 1002 saying its phase; the uid of a retired owner of the name: 1002. `finalize`: whether it waits in Finalizing for `finalize` (default: true for a backup, the `restore_finalize` setting for a restore).",
    }
    /// `addOperations`.
    owner AddOperations = "addOperations", types::AddOperationsParams => types::AddOperationsResult as "counts" {
        retry: Always, waits: false, grows: false, errors: [INVALID_PARAMS, NOT_FOUND, WRONG_PHASE, STORAGE_FAILURE],
        summary: "Adds the operations the plugins returned for a {kind}; only while InProgress.",
        details: "Idempotent on an operation's plugin, ID and item: repeats count as alreadyKnown.",
    }
    /// `endInProgress`.
    owner EndInProgress = "endInProgress", types::EndInProgressParams => types::Owner as "owner" {
        retry: IfNotSent, waits: true, grows: false, errors: [INVALID_PARAMS, NOT_FOUND, WRONG_PHASE, STORAGE_FAILURE],
        summary: "Ends the {kind}'s InProgress phase with the backup server's verdict; returns the owner in its new phase.",
        details: "A repeat answers 1003: the owner is no longer InProgress.",
    }
    /// `get`.
    owner Get = "get", types::OwnerParams => types::Owner as "owner" {
        retry: Always, waits: false, grows: false, errors: [INVALID_PARAMS, NOT_FOUND, STORAGE_FAILURE],
        summary: "The {kind}: the name's current one, or with `uid` the one of that uid, current or retired.",
    }
    /// `history`.
    owner History = "history", types::NameParams => Vec<types::Owner> as "owners" {
        retry: Always, waits: false, grows: true, errors: [INVALID_PARAMS, STORAGE_FAILURE],
        summary: "Every {kind} that had the name: the current one first, then the retired ones, latest retired first.",
        details: "An owner is retired when `start` gives its name to a new uid; it is kept until the retention period removes it. At most 1000. An unknown name: an empty list.",
    }
    /// `list`.
    owner List = "list", types::ListParams => types::OwnerList as "page" {
        retry: Always, waits: false, grows: true, errors: [INVALID_PARAMS, STORAGE_FAILURE],
        summary: "A page of current {kind}s (not retired) in name order, optionally of some phases.",
    }
    /// `operations`.
    owner Operations = "operations", types::OperationsParams => Vec<types::Operation> as "operations" {
        retry: Always, waits: false, grows: true, errors: [INVALID_PARAMS, NOT_FOUND, STORAGE_FAILURE],
        summary: "The {kind}'s operations, optionally of some phases; `uid` as in get.",
    }
    /// `wait`.
    owner Wait = "wait", types::WaitParams => types::WaitResult as "wait" {
        // Repeated with the time that is left.
        retry: Always, waits: true, grows: false, errors: [INVALID_PARAMS, NOT_FOUND, STORAGE_FAILURE],
        summary: "Waits (at most `timeout`, at most 10m0s) until the {kind} is ready to finalize or terminal.",
    }
    /// `itemOperations`.
    owner ItemOperations = "itemOperations", types::OwnerParams => Vec<types::ItemOperation> as "records" {
        retry: Always, waits: false, grows: true, errors: [INVALID_PARAMS, NOT_FOUND, STORAGE_FAILURE],
        summary: "The records of the {kind}'s -itemoperations.json.gz, as Velero writes them; `uid` as in get.",
    }
    /// `events`.
    owner Events = "events", types::EventsParams => types::EventList as "page" {
        retry: Always, waits: false, grows: true, errors: [INVALID_PARAMS, NOT_FOUND, STORAGE_FAILURE],
        summary: "A page of the {kind}'s history, oldest first: phase changes, failures and the calls that changed it, with their callers; `uid` as in get.",
        details: "Paged by seq: pass the previous page's next as after. limit: default 100, at most 1000. Each owner keeps its latest 1000 events; they are removed with it.",
    }
    /// `finalize`.
    owner Finalize = "finalize", types::FinalizeParams => types::FinalizeResult as "finalized" {
        // A finalized owner answers with the first finalize's result.
        retry: Always, waits: true, grows: false, errors: [INVALID_PARAMS, NOT_FOUND, WRONG_PHASE, STORAGE_FAILURE, FINALIZE_FAILED, REFUSED],
        summary: "Finalizes the {kind}: Finalizing goes to Completed, FinalizingPartiallyFailed to PartiallyFailed.",
        details: "A repeated finalize returns the first one's result. `contents` (backups only) rewrites the tarball with `updatedItems`. The agent runs or holds at most 64 finalizes at once over all peers: one more is refused at once with -32003 saying so.",
    }
    /// `delete`.
    owner Delete = "delete", types::OwnerParams => types::DeleteResult as "deleted" {
        // A repeat could delete an owner re-created under the same name meanwhile.
        retry: IfNotSent, waits: true, grows: false, errors: [INVALID_PARAMS, NOT_FOUND, STORAGE_FAILURE],
        summary: "Deletes the {kind}, cancelling its unfinished operations; `uid` as in get (a retired one has none).",
    }
    /// `cancel`.
    owner Cancel = "cancel", types::CancelParams => types::CancelResult as "canceled" {
        // A repeat answers 1003 (already canceled, or the owner Failed by the first).
        retry: IfNotSent, waits: true, grows: false, errors: [INVALID_PARAMS, NOT_FOUND, WRONG_PHASE, STORAGE_FAILURE],
        summary: "Cancels the {kind} (it ends Failed with the reason) or, with `operations`, only those operations (they end Canceled).",
        details: "Allowed while InProgress or WaitingForPluginOperations*; otherwise 1003 naming the phase. A chosen operation that is finished: 1003 naming its phase; one the owner lacks: 1001; an ID two items share without its resource: -32602. Cancel is sent after the commit and waited for at most one call deadline (`unconfirmed` counts the ones not confirmed); `cancelRequested` is true on the operations meanwhile. Not safe to repeat: a repeat answers 1003.",
    }
    /// `subscribe`: WebSocket only; the client resubscribes after a reconnect. Its
    /// notifications are [`changed`].
    owner Subscribe = "subscribe", types::NameParams => types::SubscriptionId as "subscription" {
        retry: Always, waits: true, grows: false, errors: [INVALID_PARAMS, NOT_FOUND, STORAGE_FAILURE, METHOD_NOT_FOUND, INVALID_REQUEST, TOO_MANY_SUBSCRIPTIONS, REFUSED],
        summary: "WebSocket only: a notification `{kind}.changed` per change of the {kind} until it is terminal.",
        details: "The first notification, and any after the subscriber fell behind (lagged), carries every operation. Over plain HTTP: -32601; in a batch: -32600 (call it on its own). A deleted owner ends the subscription with an error notification. Past the agent's 16,384 subscriptions over all peers: -32003. See x-notification.",
    }
    /// `unsubscribe`: takes the subscription id by position (jsonrpsee's own method).
    owner Unsubscribe = "unsubscribe", types::NoParams => bool as "unsubscribed" {
        retry: Always, waits: false, grows: false, errors: [],
        summary: "Ends a subscription made with {kind}.subscribe on this connection; true if it existed.",
        details: "Takes the subscription id by position: `[id]`. Never an error: an unknown id answers false.",
    }
    /// `server.started`.
    agent ServerStarted = "server.started", types::ServerStartedParams => types::ServerStartedResult as "failed" {
        // Fails only owners of other instances: a repeat fails nothing more.
        retry: Always, waits: false, grows: false, errors: [INVALID_PARAMS, STORAGE_FAILURE],
        summary: "A backup server (re)started as `instance`: fails the InProgress owners its other instances started.",
    }
    /// `snapshotter.register`.
    agent RegisterSnapshotter = "snapshotter.register", types::Snapshotter => types::Snapshotter as "snapshotter" {
        retry: Always, waits: false, grows: false, errors: [INVALID_PARAMS, STORAGE_FAILURE],
        summary: "Registers (or replaces) the snapshotter that owns the operations of plugin `name`; persisted.",
    }
    /// `snapshotter.list`.
    agent ListSnapshotters = "snapshotter.list", types::NoParams => Vec<types::Snapshotter> as "snapshotters" {
        retry: Always, waits: false, grows: false, errors: [INVALID_PARAMS, STORAGE_FAILURE],
        summary: "The registered snapshotters.",
    }
    /// `snapshotter.unregister`.
    agent UnregisterSnapshotter = "snapshotter.unregister", types::NameParams => types::Snapshotter as "snapshotter" {
        retry: IfNotSent, waits: false, grows: false, errors: [INVALID_PARAMS, NOT_FOUND, STORAGE_FAILURE],
        summary: "Unregisters a snapshotter; returns what was registered.",
    }
    /// `snapshotter.changed`.
    agent SnapshotterChanged = "snapshotter.changed", types::SnapshotterChangedParams => () as "result" {
        // A hint changes nothing by itself: a repeat at most polls once more.
        retry: Always, waits: false, grows: false, errors: [INVALID_PARAMS, NOT_FOUND],
        summary: "A snapshotter's hint that operations of `plugin` changed: the agent polls them at once (hints that arrive meanwhile are merged, and hinted polls take a bounded share of the agent's time). The hint itself changes nothing; the poll's answers do.",
    }
    /// `rpc.discover`.
    agent Discover = "rpc.discover", types::NoParams => serde_json::Map<String, serde_json::Value> as "openrpc" {
        retry: Always, waits: false, grows: false, errors: [INVALID_PARAMS],
        summary: "This OpenRPC document.",
        details: "The result is the document client/openrpc/opmon.json of the agent's version.",
    }
}

/// The notification [`Subscribe`] sends for owners of `kind` (not a method one calls).
pub fn changed(kind: OwnerKind) -> &'static str {
    match kind {
        OwnerKind::Backup => "backup.changed",
        OwnerKind::Restore => "restore.changed",
    }
}

/// The declaration of the method named `method`, if this client knows it.
pub fn decl_of(method: &str) -> Option<&'static Decl> {
    ALL.iter().copied().find(|d| d.names().contains(&method))
}

/// The retry rule of any method by its full name; methods this client does not know
/// (a newer agent's, a snapshotter's own) are repeated only if not sent.
pub fn retry_of(method: &str) -> Retry {
    decl_of(method).map_or(Retry::IfNotSent, |d| d.retry)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_names_are_the_kind_a_dot_and_the_verb() {
        for d in ALL.iter().filter(|d| d.is_owner_method()) {
            for kind in OwnerKind::ALL {
                assert_eq!(d.name(kind), format!("{kind}.{}", d.verb));
            }
        }
        assert_eq!(
            EndInProgress::DECL.name(OwnerKind::Restore),
            "restore.endInProgress"
        );
        assert_eq!(Status::DECL.name(OwnerKind::Restore), "agent.status");
    }

    #[test]
    fn only_end_in_progress_delete_cancel_and_unregister_wait_for_certainty() {
        let careful: Vec<_> = ALL
            .iter()
            .filter(|d| d.retry == Retry::IfNotSent)
            .map(|d| d.verb)
            .collect();
        assert_eq!(
            careful,
            [
                "endInProgress",
                "delete",
                "cancel",
                "snapshotter.unregister"
            ]
        );
        assert_eq!(retry_of(SNAPSHOTTER_REGISTER), Retry::Always);
        assert_eq!(retry_of("copy.start"), Retry::IfNotSent);
        assert_eq!(retry_of("restore.get"), Retry::Always);
        assert_eq!(retry_of("backup.delete"), Retry::IfNotSent);
    }

    #[test]
    fn names_are_unique_and_errors_documented() {
        let mut names: Vec<&str> = ALL.iter().flat_map(|d| d.names().iter().copied()).collect();
        let count = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), count);
        for d in ALL {
            for code in d.errors {
                assert!(agent_error(*code).is_some(), "{}: code {code}", d.verb);
            }
        }
    }
}
