//! The API's types, defined once: the agent deserializes exactly what the client
//! serializes. Field names are camelCase, times RFC 3339 UTC, durations Go strings, as
//! docs/architecture.md ("The API") fixes them.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::duration::GoDuration;

/// A point in time, serialized as RFC 3339 in UTC.
pub type Timestamp = OffsetDateTime;

/// Whether an owner is a backup or a restore. One implementation serves both; the kind
/// only picks method names, file names and the few phase rules that differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum OwnerKind {
    Backup,
    Restore,
}

impl OwnerKind {
    pub const ALL: [OwnerKind; 2] = [OwnerKind::Backup, OwnerKind::Restore];

    pub fn as_str(self) -> &'static str {
        match self {
            OwnerKind::Backup => "backup",
            OwnerKind::Restore => "restore",
        }
    }
}

impl fmt::Display for OwnerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for OwnerKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "backup" => Ok(OwnerKind::Backup),
            "restore" => Ok(OwnerKind::Restore),
            other => Err(format!("unknown owner kind {other:?} (backup or restore)")),
        }
    }
}

/// Declares a string-valued enum whose wire names equal the variant names, with
/// `as_str`, `Display` and `FromStr`, so the database and the API spell phases alike.
///
/// With `; unknown Variant`, a name this version does not know (a newer agent's) decodes
/// to that catch-all instead of failing the whole answer. The catch-all is in neither
/// `ALL`, `FromStr` nor the JSON Schema, and the agent refuses it in params.
macro_rules! wire_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident),+ $(,)? }) => {
        wire_enum!(@def $(#[$meta])* $name { $($(#[$vmeta])* $variant),+ } {});
    };
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident),+ $(,)? ; unknown $other:ident }) => {
        wire_enum!(@def $(#[$meta])* $name { $($(#[$vmeta])* $variant),+ } {
            // Undocumented for the schema generator, which would otherwise describe the
            // enum variant by variant although it skips this one.
            #[cfg_attr(
                not(feature = "schema"),
                doc = "A name this version of the client does not know: sent by a newer \
                       agent. Never sent by this client nor accepted by the agent in params."
            )]
            #[serde(other)]
            #[cfg_attr(feature = "schema", schemars(skip))]
            $other
        });
    };
    (@def $(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident),+ } { $($(#[$ometa:meta])* $other:ident)? }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
        pub enum $name { $($(#[$vmeta])* $variant,)+ $($(#[$ometa])* $other)? }

        impl $name {
            /// Every value this version knows.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The wire name.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => stringify!($variant),)+
                    $($name::$other => stringify!($other),)?
                }
            }

            /// Whether this version knows the value (it is not the catch-all of a newer
            /// agent's name).
            pub fn is_known(self) -> bool {
                $(if self == $name::$other { return false; })?
                true
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $(stringify!($variant) => Ok($name::$variant),)+
                    other => Err(format!(
                        concat!("unknown ", stringify!($name), " {:?}"), other
                    )),
                }
            }
        }
    };
}

wire_enum! {
    /// The phase of a backup or restore, with the names Velero gives them.
    OwnerPhase {
        /// Exists for compatibility; the agent never creates an owner in it.
        New,
        /// Exists for compatibility; the backup server handles validation.
        FailedValidation,
        InProgress,
        WaitingForPluginOperations,
        WaitingForPluginOperationsPartiallyFailed,
        Finalizing,
        FinalizingPartiallyFailed,
        Completed,
        PartiallyFailed,
        Failed;
        unknown Unknown
    }
}

impl OwnerPhase {
    /// Completed, PartiallyFailed, Failed or FailedValidation: nothing more happens.
    ///
    /// ```
    /// use opmon_client::OwnerPhase;
    /// assert!(OwnerPhase::PartiallyFailed.is_terminal() && !OwnerPhase::Finalizing.is_terminal());
    /// ```
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            OwnerPhase::Completed
                | OwnerPhase::PartiallyFailed
                | OwnerPhase::Failed
                | OwnerPhase::FailedValidation
        )
    }

    /// The phases in which the poller watches the owner's operations.
    pub fn is_waiting(self) -> bool {
        matches!(
            self,
            OwnerPhase::WaitingForPluginOperations
                | OwnerPhase::WaitingForPluginOperationsPartiallyFailed
        )
    }

    /// The phases that wait for `finalize`.
    pub fn is_finalizing(self) -> bool {
        matches!(
            self,
            OwnerPhase::Finalizing | OwnerPhase::FinalizingPartiallyFailed
        )
    }
}

wire_enum! {
    /// The phase of one operation.
    #[derive(Default)]
    OperationPhase {
        #[default]
        New,
        InProgress,
        Completed,
        Failed,
        /// Cancelled on request (`*.cancel`). Velero has no such phase: its
        /// item-operations file says `Failed` with the error `canceled: <reason>`.
        Canceled;
        unknown Unknown
    }
}

impl OperationPhase {
    /// New or InProgress: the operation is still polled.
    ///
    /// ```
    /// use opmon_client::OperationPhase;
    /// assert!(OperationPhase::New.is_unfinished() && !OperationPhase::Canceled.is_unfinished());
    /// ```
    pub fn is_unfinished(self) -> bool {
        matches!(self, OperationPhase::New | OperationPhase::InProgress)
    }

    /// Failed or Canceled: counted in `operationsFailed`, as Velero counts them.
    pub fn is_failure(self) -> bool {
        matches!(self, OperationPhase::Failed | OperationPhase::Canceled)
    }

    /// The phase Velero's item-operations file has for this one (which knows no
    /// Canceled).
    ///
    /// ```
    /// use opmon_client::OperationPhase;
    /// assert_eq!(OperationPhase::Canceled.in_velero(), OperationPhase::Failed);
    /// ```
    pub fn in_velero(self) -> OperationPhase {
        match self {
            OperationPhase::Canceled => OperationPhase::Failed,
            other => other,
        }
    }
}

wire_enum! {
    /// Which kind of Velero plugin started an operation.
    PluginKind {
        BackupItemAction,
        RestoreItemAction,
        VolumeSnapshotter;
        unknown Unknown
    }
}

/// A Kubernetes object: the item an operation belongs to or an item to back up again.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ResourceIdentifier {
    /// API group; empty for the core group.
    #[serde(default)]
    pub group: String,
    /// Plural resource name, e.g. `persistentvolumeclaims`.
    pub resource: String,
    /// Empty for cluster-scoped items.
    #[serde(default)]
    pub namespace: String,
    pub name: String,
}

/// The plugin that owns an operation; `name` is `domain/name` and picks the snapshotter.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct PluginRef {
    pub kind: PluginKind,
    pub name: String,
}

/// What a snapshotter reports for one operation (Velero's `OperationProgress`).
///
/// `started` and `updated` follow Velero: absent, `null` or Go's zero time
/// (`0001-01-01T00:00:00Z`, what a Go `time.Time{}` encodes to) mean unknown; any other
/// time, the Unix epoch included, is a time (an operation reporting a `started` moves
/// from New to InProgress).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", default)]
pub struct OperationProgress {
    /// True once the operation has finished, successfully or not.
    pub completed: bool,
    /// Why the operation failed; empty if it did not (which this client reads as `None`).
    #[serde(with = "empty_is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub err: Option<String>,
    pub n_completed: i64,
    pub n_total: i64,
    pub operation_units: String,
    pub description: String,
    /// When the operation started; absent (or Go's zero time) if unknown.
    #[serde(
        with = "time::serde::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::openrpc::Rfc3339>"))]
    pub started: Option<Timestamp>,
    #[serde(
        with = "time::serde::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::openrpc::Rfc3339>"))]
    pub updated: Option<Timestamp>,
}

/// One operation as the agent keeps it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct Operation {
    pub plugin: PluginRef,
    pub resource: ResourceIdentifier,
    pub operation_id: String,
    pub post_operation_items: Vec<ResourceIdentifier>,
    pub phase: OperationPhase,
    /// Why it failed or was canceled; empty otherwise (which this client reads as
    /// `None`).
    #[serde(with = "empty_is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub error: Option<String>,
    pub n_completed: i64,
    pub n_total: i64,
    pub operation_units: String,
    pub description: String,
    /// When the plugin returned the operation (`addOperations`' `created`, else when the
    /// agent was told); the item operation timeout counts from it.
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "schema", schemars(with = "crate::openrpc::Rfc3339"))]
    pub created: Timestamp,
    /// When the plugin said the operation started.
    #[serde(with = "time::serde::rfc3339::option")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::openrpc::Rfc3339>"))]
    pub started: Option<Timestamp>,
    /// When the operation last changed: the plugin's `updated` when it reported one with
    /// the change, else when the agent saw the change.
    #[serde(with = "time::serde::rfc3339::option")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::openrpc::Rfc3339>"))]
    pub updated: Option<Timestamp>,
    /// The `updated` the plugin last reported, unknown until it reports one: what the
    /// item-operations file (and `itemOperations`) calls `updated`, as Velero does.
    #[serde(default, with = "time::serde::rfc3339::option")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::openrpc::Rfc3339>"))]
    pub plugin_updated: Option<Timestamp>,
    /// Cancel was sent to the snapshotter and has not been answered yet (`*.cancel`).
    #[serde(default)]
    pub cancel_requested: bool,
    /// How many transient errors of the snapshotter were retried for this operation.
    #[serde(default)]
    pub attempts: u32,
    /// The last transient error (kept after a retry succeeded), or why the snapshotter
    /// could not be reached while the operation waits for it; empty if none (which this
    /// client reads as `None`).
    #[serde(default, with = "empty_is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub last_error: Option<String>,
    /// When the next Progress is due after a transient error; null when not backing off.
    #[serde(default, with = "time::serde::rfc3339::option")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::openrpc::Rfc3339>"))]
    pub next_attempt_at: Option<Timestamp>,
    /// `operationUnits` per second, smoothed over the progress samples the agent has
    /// seen (an exponentially weighted moving average with a half-life of 20 s,
    /// `RATE_HALF_LIFE_SECONDS`); null until two samples apart in time have been seen
    /// (and again after `nCompleted` went backwards). Absent from agents before the
    /// feature `rate`.
    #[serde(default)]
    pub rate: Option<f64>,
    /// When the operation should finish at `rate`, counted on the agent's clock from
    /// when it saw the last sample that moved `nCompleted`; null when unknown: finished,
    /// no `nTotal`, no rate or a zero one.
    #[serde(default, with = "time::serde::rfc3339::option")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::openrpc::Rfc3339>"))]
    pub eta: Option<Timestamp>,
}

/// The half-life of an operation's smoothed `rate`, in seconds: a sample this old
/// weighs half as much as one just taken.
pub const RATE_HALF_LIFE_SECONDS: f64 = 20.0;

/// An owner's progress in one unit: the sum over its unfinished operations that report
/// `operationUnits` equal to `units`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct UnitsProgress {
    /// The operations' `operationUnits` (`""` for those that report none).
    pub units: String,
    /// How many unfinished operations report these units.
    pub operations: u64,
    pub n_completed: i64,
    pub n_total: i64,
    /// The sum of their rates (operations without a rate count as none); null when none
    /// of them has a rate.
    pub rate: Option<f64>,
}

/// An owner's aggregate progress: rates are summed per unit (bytes and items do not
/// add up), and the owner's ETA is the latest of its unfinished operations' ETAs, null
/// when any of them has none.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct OwnerProgress {
    /// One entry per distinct `operationUnits` of the unfinished operations, by units.
    pub units: Vec<UnitsProgress>,
    #[serde(default, with = "time::serde::rfc3339::option")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::openrpc::Rfc3339>"))]
    pub eta: Option<Timestamp>,
}

/// Which backup server started an owner, and which run of it: `name` says which server
/// (e.g. `velero/velero`), `instance` this run of it (e.g. its pod uid or boot time). A
/// server that restarts calls `server.started` with its new instance, and the agent
/// fails the InProgress owners its earlier instances left behind.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServerRef {
    pub name: String,
    pub instance: String,
}

/// A backup or restore as the agent keeps it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct Owner {
    pub kind: OwnerKind,
    pub name: String,
    pub uid: String,
    /// The server that started it; absent for owners started without `server` (they
    /// belong to the server named `""`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<ServerRef>,
    pub phase: OwnerPhase,
    /// Why the owner is Failed, as Velero's `status.failureReason`; empty otherwise
    /// (which this client reads as `None`).
    #[serde(default, with = "empty_is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub failure_reason: Option<String>,
    pub item_operation_timeout: GoDuration,
    /// The owner's own stall deadline (`start {stallTimeout}`); absent: each
    /// snapshotter's (`0s`: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall_timeout: Option<GoDuration>,
    /// The owner's own start deadline (`start {startTimeout}`); absent: each
    /// snapshotter's (`0s`: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_timeout: Option<GoDuration>,
    /// Whether this owner passes through Finalizing (always for backups; opt-in for
    /// restores).
    pub finalize: bool,
    pub errors: u32,
    pub warnings: u32,
    pub operations_attempted: u64,
    pub operations_completed: u64,
    pub operations_failed: u64,
    /// The union of the operations' post-operation items, set once no operation is
    /// unfinished.
    pub post_operation_items: Option<Vec<ResourceIdentifier>>,
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "schema", schemars(with = "crate::openrpc::Rfc3339"))]
    pub created: Timestamp,
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "schema", schemars(with = "crate::openrpc::Rfc3339"))]
    pub updated: Timestamp,
    #[serde(with = "time::serde::rfc3339::option")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::openrpc::Rfc3339>"))]
    pub completed: Option<Timestamp>,
    /// The aggregate rate and ETA of its unfinished operations. Given by `get`, `wait`,
    /// `start`, `endInProgress` and subscription notifications; absent in `list` pages
    /// (which would pay a scan of every owner's operations) and from agents before the
    /// feature `rate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<OwnerProgress>,
    /// When `start` gave its name to a new uid (the owner had ended); absent while it
    /// is the name's current owner. A retired owner is kept, with its history, until
    /// the retention period removes it: `history` lists it, and calls that read an
    /// owner find it by `uid`.
    #[serde(
        default,
        with = "time::serde::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::openrpc::Rfc3339>"))]
    pub retired: Option<Timestamp>,
}

/// `agent.status` result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct AgentStatus {
    pub version: String,
    pub uptime: GoDuration,
    /// Owner counts by phase name; phases with no owner are left out.
    pub owners: BTreeMap<OwnerPhase, u64>,
    pub unfinished_operations: u64,
    /// Number of registered snapshotters.
    pub snapshotters: u64,
    /// The version of this API the agent speaks (`major.minor.patch`; a new minor adds
    /// methods or fields); empty from an agent older than the field.
    #[serde(default)]
    pub api_version: String,
    /// The optional features the agent has (their names are listed in the reference,
    /// client/REFERENCE.md), so a client can tell an older agent before relying on one;
    /// empty from an agent older than the field.
    #[serde(default)]
    pub features: Vec<String>,
}

/// `*.start` params.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StartParams {
    pub name: String,
    pub uid: String,
    /// Defaults to `4h0m0s`, as in Velero.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub item_operation_timeout: Option<GoDuration>,
    /// Fail (and cancel) an operation whose progress (`nCompleted`, `description`, the
    /// plugin's `updated`) has not changed for this long. Overrides the snapshotter's
    /// `stallTimeout`; `0s` turns it off for this owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall_timeout: Option<GoDuration>,
    /// Fail (and cancel) an operation still New this long after it was created.
    /// Overrides the snapshotter's `startTimeout`; `0s` turns it off for this owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_timeout: Option<GoDuration>,
    /// Pass through Finalizing and wait for `finalize`. Absent: true for a backup, the
    /// agent's `restore_finalize` setting for a restore. `false` for a backup server
    /// that writes its own files (Velero through `opmon-velero-plugin`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finalize: Option<bool>,
    /// The backup server's own representation of the backup or restore (for Velero, the
    /// Backup or Restore object as JSON): a JSON object of at most 64 KiB (65,536
    /// bytes) serialized. Stored with the owner and
    /// passed to the snapshotters in every Progress and Cancel, as Velero passes the
    /// Backup or Restore to its plugins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<serde_json::Value>,
    /// The backup server starting it, so that `server.started` of a later instance of
    /// that server fails it if it is still InProgress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<ServerRef>,
}

/// `server.started` params: server `name` now runs as `instance`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServerStartedParams {
    /// Which server; `""` addresses the owners started without `server`.
    pub name: String,
    pub instance: String,
}

/// `server.started` result: the owners it failed (none when called again).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ServerStartedResult {
    pub failed: Vec<FailedOwner>,
}

/// Most operation IDs one `snapshotter.changed` may name; a snapshotter with more
/// changes names none, and all of its plugin's operations are polled.
pub const MAX_CHANGED_OPERATIONS: usize = 1000;

/// `snapshotter.changed` params: some operations of `plugin` changed (finished, failed,
/// progressed), so the agent should poll them now. A hint only decides when to poll:
/// what the agent records comes from the poll, never from the hint.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SnapshotterChangedParams {
    /// The plugin whose snapshotter saw the change, as registered.
    pub plugin: String,
    /// The operation IDs that changed (at most 1,000); absent: any
    /// of the plugin's operations may have.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operations: Option<Vec<String>>,
}

/// An owner `server.started` failed.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct FailedOwner {
    pub kind: OwnerKind,
    pub name: String,
    pub uid: String,
}

/// One operation a plugin returned, as `*.addOperations` takes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NewOperation {
    /// `domain/name`; a legacy name without `/` means `velero.io/<name>`, as in Velero.
    pub plugin: PluginRef,
    pub resource: ResourceIdentifier,
    pub operation_id: String,
    #[serde(default)]
    pub post_operation_items: Vec<ResourceIdentifier>,
    /// When the plugin returned the operation; the item operation timeout counts from
    /// it. Defaults to when the agent is told; at most a few minutes ahead of the agent's
    /// clock.
    #[serde(
        default,
        with = "time::serde::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::openrpc::Rfc3339>"))]
    pub created: Option<Timestamp>,
}

/// `*.addOperations` params.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AddOperationsParams {
    pub name: String,
    pub operations: Vec<NewOperation>,
}

/// `*.addOperations` result: how many were new and how many the agent had already.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct AddOperationsResult {
    pub added: u64,
    pub already_known: u64,
}

/// `*.endInProgress` params: the backup server's verdict on the InProgress phase.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EndInProgressParams {
    pub name: String,
    #[serde(default)]
    pub errors: u32,
    #[serde(default)]
    pub warnings: u32,
    /// The backup or restore failed outright: go to Failed, cancel what is unfinished.
    #[serde(default)]
    pub failed: bool,
}

/// Params of the methods that take none (`{}`; the agent also takes them absent).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

/// What `*.subscribe` answers: the subscription's id, which each notification's
/// `params.subscription` repeats.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(untagged)]
pub enum SubscriptionId {
    Number(u64),
    Text(String),
}

/// Params of the methods that only name an owner or snapshotter.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NameParams {
    pub name: String,
}

/// Params of the methods that name one owner: its name and, optionally, its uid. Without
/// `uid`, the name's current owner; with it, the owner of that name and uid, current
/// or retired (`Owner.retired`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OwnerParams {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

impl OwnerParams {
    /// The current owner of `name`.
    pub fn current(name: impl Into<String>) -> OwnerParams {
        OwnerParams {
            name: name.into(),
            uid: None,
        }
    }
}

/// `*.list` params: optional phase filter and paging by name.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ListParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phases: Option<Vec<OwnerPhase>>,
    /// Page size; default 100, at most 1000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    /// Return owners whose name sorts after this one (the previous page's `next`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
}

/// `*.list` result; `next` is set when more owners follow.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct OwnerList {
    pub items: Vec<Owner>,
    pub next: Option<String>,
}

/// `*.operations` params.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OperationsParams {
    pub name: String,
    /// The owner of this uid, current or retired; absent: the name's current owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phases: Option<Vec<OperationPhase>>,
}

/// What `*.wait` waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub enum WaitUntil {
    /// A Finalizing phase or a terminal one (a restore without finalize never finalizes).
    ReadyToFinalize,
    Terminal,
}

impl WaitUntil {
    pub fn is_reached(self, phase: OwnerPhase) -> bool {
        match self {
            WaitUntil::ReadyToFinalize => phase.is_finalizing() || phase.is_terminal(),
            WaitUntil::Terminal => phase.is_terminal(),
        }
    }
}

/// `*.wait` params.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WaitParams {
    pub name: String,
    pub until: WaitUntil,
    /// Defaults to 30 s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<GoDuration>,
}

/// `*.wait` result: the owner as it was when the wait ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct WaitResult {
    pub owner: Owner,
    pub timed_out: bool,
}

/// One notification of `*.subscribe`: the owner as it is now and the operations that
/// changed since the previous notification. The first notification, and any after the
/// subscriber fell behind (`lagged`), carries every operation instead.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct OwnerUpdate {
    pub owner: Owner,
    pub operations: Vec<Operation>,
    /// Notifications were dropped because this subscriber read too slowly; `operations`
    /// holds all of them so nothing is missed.
    #[serde(default)]
    pub lagged: bool,
}

wire_enum! {
    /// Why an event was recorded. A newer agent may record reasons not listed here (a
    /// client reads them as its catch-all; the message still says what happened).
    EventReason {
        /// `start` created the owner.
        Started,
        /// `addOperations` added operations (the message says how many).
        OperationsAdded,
        /// `endInProgress` was called (the message has its errors, warnings, failed).
        EndInProgress,
        /// `finalize` was called and moved the owner on.
        Finalized,
        /// `finalize` failed (the message is its error, as the caller got it); the
        /// owner stays in its phase and nothing of the attempt is kept.
        FinalizeFailed,
        /// The owner changed phase (`from → to`).
        PhaseChanged,
        /// The owner failed (the message is its failure reason).
        Failed,
        /// An operation changed phase (`from → to`).
        OperationPhaseChanged,
        /// An operation failed (the message is its error).
        OperationFailed,
        /// Cancel was asked for (an owner or chosen operations).
        CancelRequested,
        /// An operation is retried after a transient error.
        Retrying,
        /// A deadline (timeout, stall, start) passed.
        DeadlineExceeded,
        /// An operation's snapshotter answered again after transient errors.
        Recovered,
        /// Cancel calls are over (the message says how many the snapshotters
        /// confirmed, and names the plugins of any not sent for want of a registered
        /// snapshotter): those `*.cancel` asked for, a deadline's (for its operation, with
        /// its `DeadlineExceeded`), or those of an owner that failed with unfinished
        /// operations.
        CancelSent,
        /// `start` gave the owner's name to a new uid (the message names it); the
        /// owner is kept, retired.
        Retired;
        unknown Unknown
    }
}

/// Who made a call: the peer's credentials (`SO_PEERCRED`) when it connected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct Caller {
    pub uid: u32,
    /// The process that opened the connection (it may have ended since, or handed the
    /// connection on).
    pub pid: i32,
}

/// The operation an event is about.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct EventOperation {
    pub plugin: PluginRef,
    pub resource: ResourceIdentifier,
    pub operation_id: String,
}

/// One entry of an owner's history.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct Event {
    /// The event's number in its owner's history (1, 2, …; kept when older events are
    /// dropped): the cursor `events {after}` takes.
    pub seq: u64,
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "schema", schemars(with = "crate::openrpc::Rfc3339"))]
    pub time: Timestamp,
    /// One of the reasons the reference lists (`Started`, `PhaseChanged`, …); a newer
    /// agent may record others.
    // A string in the schema: reasons are added without a new API version.
    #[cfg_attr(feature = "schema", schemars(with = "String"))]
    pub reason: EventReason,
    /// The operation it is about; null for the owner's own events.
    pub operation: Option<EventOperation>,
    /// Who called, for events of a call; null for what the agent did by itself
    /// (polls, timeouts, expiry).
    pub caller: Option<Caller>,
    pub message: String,
}

/// `*.events` params: the owner, and paging by `seq`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EventsParams {
    pub name: String,
    /// The owner of this uid, current or retired; absent: the name's current owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// Return events after this `seq` (the previous page's `next`); from the oldest kept
    /// when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<u64>,
    /// Page size; default 100, at most 1000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

/// `*.events` result, oldest first; `next` is set when more events follow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct EventList {
    pub items: Vec<Event>,
    pub next: Option<u64>,
}

/// `*.delete` result: how many unfinished operations were canceled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct DeleteResult {
    /// Unfinished operations canceled with the owner (older agents send only
    /// `cancelled`).
    #[serde(default)]
    pub canceled: u64,
    /// Deprecated: the same number as `canceled`, under its old spelling; sent until
    /// the API's next major version (docs/compatibility.md).
    #[serde(default)]
    pub cancelled: u64,
}

impl DeleteResult {
    /// The result for `canceled` operations, in both spellings.
    pub fn new(canceled: u64) -> Self {
        DeleteResult {
            canceled,
            cancelled: canceled,
        }
    }

    /// How many operations were canceled, from an agent of any version.
    ///
    /// ```
    /// let old: opmon_client::DeleteResult = serde_json::from_str(r#"{"cancelled": 2}"#).unwrap();
    /// assert_eq!(old.count(), 2);
    /// ```
    pub fn count(&self) -> u64 {
        self.canceled.max(self.cancelled)
    }
}

/// Which operation of an owner `*.cancel` means: its operation ID, or, when two items'
/// plugins returned the same ID, the ID and the item.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(untagged)]
pub enum OperationSelector {
    /// An operation ID that names one operation of the owner.
    Id(String),
    /// An operation ID and the item it belongs to.
    Item(OperationOfItem),
}

/// An operation ID and its item, for `*.cancel`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OperationOfItem {
    pub operation_id: String,
    pub resource: ResourceIdentifier,
}

/// By hand, so that a wrong element gets an error that says what was expected (serde's
/// untagged enums only say that nothing matched).
impl<'de> Deserialize<'de> for OperationSelector {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error as _;
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::String(id) => Ok(OperationSelector::Id(id)),
            object @ serde_json::Value::Object(_) => OperationOfItem::deserialize(object)
                .map(OperationSelector::Item)
                .map_err(D::Error::custom),
            other => {
                // The kind, not the value: it may be large.
                let kind = match other {
                    serde_json::Value::Null => "null",
                    serde_json::Value::Bool(_) => "a boolean",
                    serde_json::Value::Number(_) => "a number",
                    _ => "an array",
                };
                Err(D::Error::custom(format!(
                    "expected an operation ID (a string) or {{operationId, resource}}, got {kind}"
                )))
            }
        }
    }
}

impl OperationSelector {
    pub fn operation_id(&self) -> &str {
        match self {
            OperationSelector::Id(id) => id,
            OperationSelector::Item(o) => &o.operation_id,
        }
    }
}

/// `*.cancel` params: the whole owner, or only `operations`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CancelParams {
    pub name: String,
    /// The operations to cancel; absent: the whole owner (it ends Failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operations: Option<Vec<OperationSelector>>,
    /// Why; in the operations' error (`canceled: <reason>`) and, for a whole owner, its
    /// `failureReason`. Default `canceled by request`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `*.cancel` result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct CancelResult {
    /// The owner after the cancel.
    pub owner: Owner,
    /// Operations that became Canceled.
    pub canceled: u64,
    /// Of those, the ones whose snapshotter did not confirm Cancel within the call
    /// deadline (it failed, or did not answer): the agent stopped waiting for them.
    pub unconfirmed: u64,
}

/// The backup tarball `finalize` rewrites: `input` is read, `output` written (atomically).
/// Relative paths are taken relative to the agent's storage directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Contents {
    pub input: PathBuf,
    pub output: PathBuf,
}

/// A Kubernetes object to put into the backup tarball in place of the one there, or in
/// addition if absent: the post-operation items, as they are after the operations.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UpdatedItem {
    pub resource: ResourceIdentifier,
    /// The object as the API server returns it; its `apiVersion` picks the version
    /// directory of an appended entry.
    pub object: serde_json::Value,
}

/// `*.finalize` params.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FinalizeParams {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contents: Option<Contents>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub updated_items: Vec<UpdatedItem>,
    /// Errors the finalize step found (Velero's restore finalizer counts them): added
    /// to the owner's; any makes the owner PartiallyFailed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub errors: u32,
    /// Warnings the finalize step found: added to the owner's.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub warnings: u32,
}

/// For `skip_serializing_if`: a count or size that is zero is left out.
fn is_zero<T: Default + PartialEq>(n: &T) -> bool {
    *n == T::default()
}

/// `*.finalize` result. A repeated `finalize` returns the first one's result again.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct FinalizeResult {
    pub owner: Owner,
    /// The `-itemoperations.json.gz` file.
    pub item_operations_file: PathBuf,
    /// The rewritten tarball, when `contents` was given.
    pub contents_file: Option<PathBuf>,
    /// Entries of the tarball replaced by updated items.
    pub replaced: u64,
    /// Updated items appended because the tarball lacked them (entries, not items).
    pub added: u64,
}

/// The snapshotter API a snapshotter speaks: v1 has no Progress (its operations
/// complete at their first poll), v2 has Progress and Cancel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum ApiVersion {
    V1,
    #[default]
    V2,
}

impl ApiVersion {
    pub fn as_str(self) -> &'static str {
        match self {
            ApiVersion::V1 => "v1",
            ApiVersion::V2 => "v2",
        }
    }
}

impl FromStr for ApiVersion {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "v1" => Ok(ApiVersion::V1),
            "v2" => Ok(ApiVersion::V2),
            other => Err(format!("unknown apiVersion {other:?} (v1 or v2)")),
        }
    }
}

/// A registered snapshotter; `name` equals the plugin name (`domain/name`) whose
/// operations it owns. Exactly one of `socket`, `command` and `velero_plugin` is set for
/// v2; a v1 snapshotter needs none.
///
/// The deadlines and the retry budget are the snapshotter's defaults for its
/// operations; absent means off (deadlines) or the agent's default (retries).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Snapshotter {
    pub name: String,
    pub api_version: ApiVersion,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    /// A plugin binary built with Velero's plugin framework (hashicorp go-plugin over
    /// gRPC), run by the agent and asked for Progress and Cancel as Velero asks it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub velero_plugin: Option<PathBuf>,
    /// Arguments of the `velero_plugin` binary (Velero passes its server flags).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Vec<String>>,
    /// Environment of the `velero_plugin` binary, besides go-plugin's handshake.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<std::collections::BTreeMap<String, String>>,
    /// Cancel and fail an operation whose progress has not changed for this long.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall_timeout: Option<GoDuration>,
    /// Cancel and fail an operation still New this long after it was created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_timeout: Option<GoDuration>,
    /// Transient errors retried per operation before it fails (default 5; 0: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_attempts: Option<u32>,
    /// The first retry's delay, doubled for each next one up to 5 minutes (default 1s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_backoff: Option<GoDuration>,
    /// How long an operation may keep failing transiently before it fails (default 10m).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_within: Option<GoDuration>,
}

/// Which owner an operation belongs to, as the snapshotter protocol passes it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct OwnerRef {
    pub kind: OwnerKind,
    pub name: String,
    pub uid: String,
    /// The backup server's representation of the owner, as `start` was given it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<serde_json::Value>,
}

/// Params of the snapshotter protocol's `operation.progress` and `operation.cancel`.
///
/// The owner is shared: every operation of an owner polled together points at one
/// [`OwnerRef`], so its `object` (up to 64 KiB) is held once, not once per operation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct OperationRef {
    pub plugin: PluginRef,
    pub operation_id: String,
    pub owner: Arc<OwnerRef>,
}

/// Velero's `ResourceIdentifier` as it appears in `-itemoperations.json.gz`: a Go
/// struct without JSON tags (embedding `schema.GroupResource`), so the keys are the
/// capitalised field names, in this order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct VeleroResourceIdentifier {
    #[serde(rename = "Group")]
    pub group: String,
    #[serde(rename = "Resource")]
    pub resource: String,
    #[serde(rename = "Namespace")]
    pub namespace: String,
    #[serde(rename = "Name")]
    pub name: String,
}

impl From<&ResourceIdentifier> for VeleroResourceIdentifier {
    fn from(r: &ResourceIdentifier) -> Self {
        VeleroResourceIdentifier {
            group: r.group.clone(),
            resource: r.resource.clone(),
            namespace: r.namespace.clone(),
            name: r.name.clone(),
        }
    }
}

/// The `spec` of a backup's item-operation record: Velero's `BackupOperationSpec`,
/// field for field and in its order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct BackupOperationSpec {
    pub backup_name: String,
    #[serde(rename = "backupUID")]
    pub backup_uid: String,
    pub backup_item_action: String,
    pub resource_identifier: VeleroResourceIdentifier,
    #[serde(rename = "operationID")]
    pub operation_id: String,
    /// `null` when the plugin returned none: Velero's is a Go slice that its plugin
    /// client leaves nil when the list is empty, and Go writes a nil slice as `null`.
    #[serde(default)]
    pub post_operation_items: Option<Vec<VeleroResourceIdentifier>>,
}

/// The `spec` of a restore's item-operation record: Velero's `RestoreOperationSpec`,
/// which has no post-operation items (a decoder refusing unknown fields would reject
/// the key).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct RestoreOperationSpec {
    pub restore_name: String,
    #[serde(rename = "restoreUID")]
    pub restore_uid: String,
    pub restore_item_action: String,
    pub resource_identifier: VeleroResourceIdentifier,
    #[serde(rename = "operationID")]
    pub operation_id: String,
}

/// A record's spec: the backup or the restore form.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(untagged)]
pub enum ItemOperationSpec {
    Backup(BackupOperationSpec),
    Restore(RestoreOperationSpec),
}

/// Times in item-operation records as Velero writes them (apimachinery's
/// `metav1.Time`): RFC 3339 in UTC at second precision, `2026-11-22T09:57:45Z`, the
/// fraction cut off. Any RFC 3339 time is read.
mod velero_time {
    use serde::{Deserializer, Serializer};
    use time::OffsetDateTime;

    pub fn format(t: OffsetDateTime) -> String {
        let t = t.to_offset(time::UtcOffset::UTC);
        format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        )
    }

    pub fn serialize<S: Serializer>(t: &Option<OffsetDateTime>, s: S) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => s.serialize_str(&format(*t)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<OffsetDateTime>, D::Error> {
        time::serde::rfc3339::option::deserialize(d)
    }
}

/// The `status` of an item-operation record: Velero's `OperationStatus`, whose fields
/// are all `omitempty`: an empty error, a zero count, an unknown time are left out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ItemOperationStatus {
    pub phase: OperationPhase,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub n_completed: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub n_total: i64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub operation_units: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    #[serde(default, with = "velero_time", skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::openrpc::Rfc3339>"))]
    pub created: Option<Timestamp>,
    #[serde(default, with = "velero_time", skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::openrpc::Rfc3339>"))]
    pub started: Option<Timestamp>,
    /// The plugin's own `updated` (not when the agent saw a change).
    #[serde(default, with = "velero_time", skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<crate::openrpc::Rfc3339>"))]
    pub updated: Option<Timestamp>,
}

/// One record of `-itemoperations.json.gz`, and of `*.itemOperations` (the same shape).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ItemOperation {
    pub spec: ItemOperationSpec,
    pub status: ItemOperationStatus,
}

impl ItemOperation {
    /// The record of `op` as Velero writes it for `owner`.
    pub fn from_operation(owner: &Owner, op: &Operation) -> Self {
        let resource_identifier = VeleroResourceIdentifier::from(&op.resource);
        let spec = match owner.kind {
            OwnerKind::Backup => ItemOperationSpec::Backup(BackupOperationSpec {
                backup_name: owner.name.clone(),
                backup_uid: owner.uid.clone(),
                backup_item_action: op.plugin.name.clone(),
                resource_identifier,
                operation_id: op.operation_id.clone(),
                post_operation_items: (!op.post_operation_items.is_empty())
                    .then(|| op.post_operation_items.iter().map(Into::into).collect()),
            }),
            OwnerKind::Restore => ItemOperationSpec::Restore(RestoreOperationSpec {
                restore_name: owner.name.clone(),
                restore_uid: owner.uid.clone(),
                restore_item_action: op.plugin.name.clone(),
                resource_identifier,
                operation_id: op.operation_id.clone(),
            }),
        };
        ItemOperation {
            spec,
            status: ItemOperationStatus {
                phase: op.phase.in_velero(),
                error: op.error.clone().unwrap_or_default(),
                n_completed: op.n_completed,
                n_total: op.n_total,
                operation_units: op.operation_units.clone(),
                description: op.description.clone(),
                created: Some(op.created),
                started: op.started,
                updated: op.plugin_updated,
            },
        }
    }
}

/// Text the API writes as `""` when there is none (as Velero's Go structs do), as an
/// `Option`: `""`, `null` and absent read as `None`, and `None` is written as `""`.
mod empty_is_none {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(text: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(text.as_deref().unwrap_or(""))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        Ok(Option::<String>::deserialize(d)?.filter(|text| !text.is_empty()))
    }
}

impl AgentStatus {
    /// Whether the agent has the optional feature `feature` (an older agent lacks newer
    /// ones). [`AgentStatus::features`] has every name the agent sent, a newer agent's
    /// too.
    ///
    /// ```
    /// use opmon_client::methods::Feature;
    /// # let status: opmon_client::AgentStatus = serde_json::from_str(r#"{"version":"0.1.0","uptime":"1s","owners":{},
    /// #   "unfinishedOperations":0,"snapshotters":0,"apiVersion":"1.2.0","features":["cancel"]}"#).unwrap();
    /// assert!(status.supports(Feature::Cancel));
    /// assert!(!status.supports(Feature::Rate));
    /// ```
    pub fn supports(&self, feature: crate::methods::Feature) -> bool {
        self.features.iter().any(|f| f == feature.as_str())
    }
}

impl ResourceIdentifier {
    /// A namespaced item of the core group (`group` empty): `resource` is the plural,
    /// lowercase (`persistentvolumeclaims`).
    ///
    /// ```
    /// let pvc = opmon_client::ResourceIdentifier::namespaced("persistentvolumeclaims", "app", "data");
    /// assert_eq!(pvc.namespace, "app");
    /// ```
    pub fn namespaced(resource: &str, namespace: &str, name: &str) -> Self {
        ResourceIdentifier {
            group: String::new(),
            resource: resource.into(),
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// A cluster-scoped item of the core group (`persistentvolumes`).
    pub fn cluster(resource: &str, name: &str) -> Self {
        ResourceIdentifier::namespaced(resource, "", name)
    }

    /// The same item in API group `group` (`snapshot.storage.k8s.io`).
    pub fn in_group(mut self, group: &str) -> Self {
        self.group = group.into();
        self
    }
}

impl NewOperation {
    /// The operation `operation_id` that the plugin `plugin` (`domain/name`) of `kind`
    /// started for `resource`; no post-operation items, created when the agent is told.
    ///
    /// ```
    /// use opmon_client::{NewOperation, PluginKind, ResourceIdentifier};
    /// let pvc = ResourceIdentifier::namespaced("persistentvolumeclaims", "app", "data");
    /// let op = NewOperation::new(PluginKind::BackupItemAction, "example.io/copier", pvc, "copy-42")
    ///     .post_operation_items(vec![ResourceIdentifier::cluster("persistentvolumes", "pv-1")]);
    /// ```
    pub fn new(
        kind: PluginKind,
        plugin: &str,
        resource: ResourceIdentifier,
        operation_id: &str,
    ) -> Self {
        NewOperation {
            plugin: PluginRef {
                kind,
                name: plugin.into(),
            },
            resource,
            operation_id: operation_id.into(),
            post_operation_items: Vec::new(),
            created: None,
        }
    }

    /// Items to back up (or restore) again once the operation is done, as Velero's
    /// `PostOperationItems`.
    pub fn post_operation_items(mut self, items: Vec<ResourceIdentifier>) -> Self {
        self.post_operation_items = items;
        self
    }

    /// When the plugin returned the operation (the item operation timeout counts from
    /// it).
    pub fn created(mut self, created: Timestamp) -> Self {
        self.created = Some(created);
        self
    }
}

impl Snapshotter {
    /// A v2 snapshotter for plugin `name` (`domain/name`) that serves the snapshotter
    /// protocol on the Unix socket `socket` (an absolute path).
    ///
    /// ```
    /// let s = opmon_client::Snapshotter::socket("example.io/copier", "/run/copier/copier.sock");
    /// ```
    pub fn socket(name: &str, socket: impl Into<PathBuf>) -> Self {
        Snapshotter {
            name: name.into(),
            api_version: ApiVersion::V2,
            socket: Some(socket.into()),
            ..Default::default()
        }
    }

    /// A v2 snapshotter for plugin `name` that is a program, run as `command… progress
    /// OPERATION_ID` and `command… cancel OPERATION_ID` (the agent allows these over the
    /// API only if its configuration says so).
    ///
    /// ```
    /// let s = opmon_client::Snapshotter::command("example.io/copier", ["/usr/local/bin/copier-status"]);
    /// ```
    pub fn command<S: Into<String>>(name: &str, command: impl IntoIterator<Item = S>) -> Self {
        Snapshotter {
            name: name.into(),
            api_version: ApiVersion::V2,
            command: Some(command.into_iter().map(Into::into).collect()),
            ..Default::default()
        }
    }

    /// A v1 snapshotter for plugin `name`: no Progress or Cancel, its operations are
    /// only recorded.
    ///
    /// ```
    /// let s = opmon_client::Snapshotter::v1("example.io/legacy");
    /// ```
    pub fn v1(name: &str) -> Self {
        Snapshotter {
            name: name.into(),
            api_version: ApiVersion::V1,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_progress_without_an_error_reads_none_and_writes_the_empty_string() {
        for wire in [
            r#"{"completed":true,"err":""}"#,
            r#"{"completed":true,"err":null}"#,
            r#"{"completed":true}"#,
        ] {
            let p: OperationProgress = serde_json::from_str(wire).unwrap();
            assert_eq!(p.err, None, "{wire}");
            assert_eq!(serde_json::to_value(&p).unwrap()["err"], "", "{wire}");
        }
        let failed: OperationProgress =
            serde_json::from_str(r#"{"completed":true,"err":"disk full"}"#).unwrap();
        assert_eq!(failed.err.as_deref(), Some("disk full"));
        assert_eq!(serde_json::to_value(&failed).unwrap()["err"], "disk full");
    }

    #[test]
    fn phases_round_trip_through_their_wire_names() {
        for phase in OwnerPhase::ALL {
            let json = serde_json::to_string(phase).unwrap();
            assert_eq!(json, format!("\"{}\"", phase.as_str()));
            assert_eq!(phase.as_str().parse::<OwnerPhase>().unwrap(), *phase);
        }
        assert!("Done".parse::<OwnerPhase>().is_err());
    }

    #[test]
    fn ready_to_finalize_includes_terminal_phases() {
        assert!(WaitUntil::ReadyToFinalize.is_reached(OwnerPhase::Finalizing));
        assert!(WaitUntil::ReadyToFinalize.is_reached(OwnerPhase::Completed));
        assert!(!WaitUntil::ReadyToFinalize.is_reached(OwnerPhase::WaitingForPluginOperations));
        assert!(!WaitUntil::Terminal.is_reached(OwnerPhase::FinalizingPartiallyFailed));
    }

    fn identifier(name: &str) -> VeleroResourceIdentifier {
        VeleroResourceIdentifier {
            group: String::new(),
            resource: "persistentvolumeclaims".into(),
            namespace: "app".into(),
            name: name.into(),
        }
    }

    fn status(phase: OperationPhase) -> ItemOperationStatus {
        ItemOperationStatus {
            phase,
            error: String::new(),
            n_completed: 0,
            n_total: 0,
            operation_units: String::new(),
            description: String::new(),
            created: Some(time::macros::datetime!(2026-11-22 09:57:45.999 UTC)),
            started: None,
            updated: None,
        }
    }

    #[test]
    fn item_operation_records_leave_out_what_velero_leaves_out() {
        let backup = ItemOperation {
            spec: ItemOperationSpec::Backup(BackupOperationSpec {
                backup_name: "b".into(),
                backup_uid: "u".into(),
                backup_item_action: "velero.io/csi".into(),
                resource_identifier: identifier("data"),
                operation_id: "op".into(),
                post_operation_items: None,
            }),
            status: status(OperationPhase::New),
        };
        assert_eq!(
            serde_json::to_string(&backup).unwrap(),
            r#"{"spec":{"backupName":"b","backupUID":"u","backupItemAction":"velero.io/csi","resourceIdentifier":{"Group":"","Resource":"persistentvolumeclaims","Namespace":"app","Name":"data"},"operationID":"op","postOperationItems":null},"status":{"phase":"New","created":"2026-11-22T09:57:45Z"}}"#
        );
        let mut full = status(OperationPhase::Failed);
        full.error = "e".into();
        full.n_completed = 1;
        full.n_total = 2;
        full.operation_units = "byte".into();
        full.description = "d".into();
        full.started = Some(OffsetDateTime::UNIX_EPOCH);
        full.updated = Some(time::macros::datetime!(2026-11-22 11:57:45.5 +02:00));
        let restore = ItemOperation {
            spec: ItemOperationSpec::Restore(RestoreOperationSpec {
                restore_name: "r".into(),
                restore_uid: "u".into(),
                restore_item_action: "velero.io/csi".into(),
                resource_identifier: identifier("data"),
                operation_id: "op".into(),
            }),
            status: full,
        };
        let json = serde_json::to_string(&restore).unwrap();
        assert_eq!(
            json,
            r#"{"spec":{"restoreName":"r","restoreUID":"u","restoreItemAction":"velero.io/csi","resourceIdentifier":{"Group":"","Resource":"persistentvolumeclaims","Namespace":"app","Name":"data"},"operationID":"op"},"status":{"phase":"Failed","error":"e","nCompleted":1,"nTotal":2,"operationUnits":"byte","description":"d","created":"2026-11-22T09:57:45Z","started":"1970-01-01T00:00:00Z","updated":"2026-11-22T09:57:45Z"}}"#
        );
        // Records read back (the client of `itemOperations` does so), times at seconds.
        let back: ItemOperation = serde_json::from_str(&json).unwrap();
        assert!(matches!(back.spec, ItemOperationSpec::Restore(_)));
        assert_eq!(
            back.status.created,
            Some(time::macros::datetime!(2026-11-22 09:57:45 UTC))
        );
        let back: ItemOperation =
            serde_json::from_str(&serde_json::to_string(&backup).unwrap()).unwrap();
        assert_eq!(back, {
            let mut b = backup.clone();
            b.status.created = Some(time::macros::datetime!(2026-11-22 09:57:45 UTC));
            b
        });
    }

    #[test]
    fn velero_times_are_cut_to_the_second_not_rounded() {
        assert_eq!(
            velero_time::format(time::macros::datetime!(1999-12-31 23:59:59.999 UTC)),
            "1999-12-31T23:59:59Z"
        );
        assert_eq!(
            velero_time::format(time::macros::datetime!(0001-01-01 00:00:00 UTC)),
            "0001-01-01T00:00:00Z"
        );
        assert_eq!(
            velero_time::format(time::macros::datetime!(1969-12-31 23:59:59.5 UTC)),
            "1969-12-31T23:59:59Z"
        );
    }

    #[test]
    fn progress_accepts_missing_fields_and_null_times() {
        let p: OperationProgress =
            serde_json::from_str(r#"{"completed":true,"started":null}"#).unwrap();
        assert!(p.completed);
        assert_eq!(p.started, None);
        assert_eq!(p.n_total, 0);
    }
}
