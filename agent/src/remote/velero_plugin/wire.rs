//! The gRPC messages and method paths the host uses, written for prost by hand from the
//! field numbers of Velero's `pkg/plugin/proto` and hashicorp go-plugin's internal protos,
//! so building the agent needs no `protoc`. Only the fields the host reads or sends are
//! declared; prost skips the others.

/// `generated.PluginLister/ListPlugins`: every (kind, name) a binary serves.
pub const LIST_PLUGINS: &str = "/generated.PluginLister/ListPlugins";
/// BackupItemAction v2 (proto package `v2`).
pub const BACKUP_PROGRESS: &str = "/v2.BackupItemAction/Progress";
pub const BACKUP_CANCEL: &str = "/v2.BackupItemAction/Cancel";
/// RestoreItemAction v2 (proto package `v2`).
pub const RESTORE_PROGRESS: &str = "/v2.RestoreItemAction/Progress";
pub const RESTORE_CANCEL: &str = "/v2.RestoreItemAction/Cancel";
/// go-plugin (1.2 on): the plugin's stdout and stderr, once it serves.
pub const STREAM_STDIO: &str = "/plugin.GRPCStdio/StreamStdio";

/// The plugin kinds of Velero's framework that have Progress and Cancel.
pub const KIND_BACKUP_V2: &str = "BackupItemActionV2";
pub const KIND_RESTORE_V2: &str = "RestoreItemActionV2";

/// `generated.Empty` and `google.protobuf.Empty` alike: no fields.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Empty {}

/// `generated.PluginIdentifier`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PluginIdentifier {
    #[prost(string, tag = "1")]
    pub command: String,
    #[prost(string, tag = "2")]
    pub kind: String,
    #[prost(string, tag = "3")]
    pub name: String,
}

/// `generated.ListPluginsResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ListPluginsResponse {
    #[prost(message, repeated, tag = "1")]
    pub plugins: Vec<PluginIdentifier>,
}

/// `v2.BackupItemActionProgressRequest`, `…CancelRequest` and the RestoreItemAction
/// pair: the same three fields, the third the Backup or Restore as JSON.
#[derive(Clone, PartialEq, prost::Message)]
pub struct OperationRequest {
    #[prost(string, tag = "1")]
    pub plugin: String,
    #[prost(string, tag = "2")]
    pub operation_id: String,
    #[prost(bytes = "vec", tag = "3")]
    pub owner: Vec<u8>,
}

/// `v2.BackupItemActionProgressResponse` and `v2.RestoreItemActionProgressResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProgressResponse {
    #[prost(message, optional, tag = "1")]
    pub progress: Option<OperationProgress>,
}

/// `generated.OperationProgress`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct OperationProgress {
    #[prost(bool, tag = "1")]
    pub completed: bool,
    #[prost(string, tag = "2")]
    pub err: String,
    #[prost(int64, tag = "3")]
    pub n_completed: i64,
    #[prost(int64, tag = "4")]
    pub n_total: i64,
    #[prost(string, tag = "5")]
    pub operation_units: String,
    #[prost(string, tag = "6")]
    pub description: String,
    #[prost(message, optional, tag = "7")]
    pub started: Option<Timestamp>,
    #[prost(message, optional, tag = "8")]
    pub updated: Option<Timestamp>,
}

/// `google.protobuf.Timestamp`.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct Timestamp {
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

/// Seconds of Go's zero `time.Time` (0001-01-01T00:00:00Z) since the Unix epoch: what
/// Velero's framework sends for a `started` or `updated` it does not know.
pub const GO_ZERO_SECONDS: i64 = -62_135_596_800;

/// `generated.Stack`: the detail of a plugin's error.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Stack {
    #[prost(message, repeated, tag = "1")]
    pub frames: Vec<StackFrame>,
}

/// `generated.StackFrame`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StackFrame {
    #[prost(string, tag = "1")]
    pub file: String,
    #[prost(int32, tag = "2")]
    pub line: i32,
    #[prost(string, tag = "3")]
    pub function: String,
}

/// `google.rpc.Status`, as `grpc-status-details-bin` carries it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RpcStatus {
    #[prost(int32, tag = "1")]
    pub code: i32,
    #[prost(string, tag = "2")]
    pub message: String,
    #[prost(message, repeated, tag = "3")]
    pub details: Vec<Any>,
}

/// `google.protobuf.Any`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Any {
    #[prost(string, tag = "1")]
    pub type_url: String,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

/// `plugin.StdioData`: channel 1 is stdout, 2 stderr.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StdioData {
    #[prost(int32, tag = "1")]
    pub channel: i32,
    #[prost(bytes = "vec", tag = "2")]
    pub data: Vec<u8>,
}

// The stand-in (`opmon-velero-plugin`) reads these from the calls it passes on; it
// forwards the bytes themselves, so fields not declared here reach Velero unchanged.

/// go-plugin's controller (the host's `Kill`) and gRPC health (its `Ping`).
pub const CONTROLLER_SHUTDOWN: &str = "/plugin.GRPCController/Shutdown";
pub const HEALTH_CHECK: &str = "/grpc.health.v1.Health/Check";

/// `v2.ExecuteRequest` and `v2.RestoreItemActionExecuteRequest`: the plugin, the item and
/// the Backup or Restore, each as JSON.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ExecuteRequest {
    #[prost(string, tag = "1")]
    pub plugin: String,
    #[prost(bytes = "vec", tag = "2")]
    pub item: Vec<u8>,
    #[prost(bytes = "vec", tag = "3")]
    pub owner: Vec<u8>,
}

/// `v2.ExecuteResponse` (BackupItemAction v2): the operation ID is field 3.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BackupExecuteResponse {
    #[prost(string, tag = "3")]
    pub operation_id: String,
    #[prost(message, repeated, tag = "4")]
    pub post_operation_items: Vec<ResourceIdentifier>,
}

/// `v2.RestoreItemActionExecuteResponse`: the operation ID is field 4.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RestoreExecuteResponse {
    #[prost(string, tag = "4")]
    pub operation_id: String,
}

/// `generated.ResourceIdentifier`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ResourceIdentifier {
    #[prost(string, tag = "1")]
    pub group: String,
    #[prost(string, tag = "2")]
    pub resource: String,
    #[prost(string, tag = "3")]
    pub namespace: String,
    #[prost(string, tag = "4")]
    pub name: String,
}

/// `grpc.health.v1.HealthCheckResponse`; status 1 is SERVING.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HealthCheckResponse {
    #[prost(int32, tag = "1")]
    pub status: i32,
}

/// DeleteItemAction (proto package `generated`): the stand-in serves one of its own
/// (Velero's backup deletion calls it with the Backup) and passes the original's on.
pub const DELETE_APPLIES_TO: &str = "/generated.DeleteItemAction/AppliesTo";
pub const DELETE_EXECUTE: &str = "/generated.DeleteItemAction/Execute";
/// The AppliesTo of the two asynchronous kinds, whose selectors the stand-in's own
/// DeleteItemAction takes as its own.
pub const BACKUP_APPLIES_TO: &str = "/v2.BackupItemAction/AppliesTo";
pub const RESTORE_APPLIES_TO: &str = "/v2.RestoreItemAction/AppliesTo";
pub const KIND_DELETE: &str = "DeleteItemAction";

/// Every AppliesTo request, and the first field of every plugin call: which of the
/// binary's plugins it is for.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PluginRequest {
    #[prost(string, tag = "1")]
    pub plugin: String,
}

/// The AppliesTo responses of every item action kind: field 1 is the selector.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AppliesToResponse {
    #[prost(message, optional, tag = "1")]
    pub resource_selector: Option<ResourceSelector>,
}

/// `generated.ResourceSelector`: empty lists mean every namespace or resource.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ResourceSelector {
    #[prost(string, repeated, tag = "1")]
    pub included_namespaces: Vec<String>,
    #[prost(string, repeated, tag = "2")]
    pub excluded_namespaces: Vec<String>,
    #[prost(string, repeated, tag = "3")]
    pub included_resources: Vec<String>,
    #[prost(string, repeated, tag = "4")]
    pub excluded_resources: Vec<String>,
    #[prost(string, tag = "5")]
    pub selector: String,
}
