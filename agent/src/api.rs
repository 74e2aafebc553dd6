//! The API edge: the handlers of the method names in `opmon_client::methods`,
//! parameter parsing and validation. Everything
//! past this file sees typed, valid values; every error here names the offending field
//! (`operations[3].resource.name: must not contain …`). Legacy plugin names are mapped
//! to `velero.io/<name>` here, as Velero's `sanitizeName` does, so the core and the
//! store only ever see namespaced ones.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::edge::server::Connection;
use jsonrpsee::types::{ErrorObjectOwned, Params};
use jsonrpsee::RpcModule;
use opmon_client::methods::{self, Method};
use opmon_client::{
    validate, AddOperationsParams, ApiVersion, Caller, CancelParams, EndInProgressParams,
    EventsParams, FinalizeParams, ListParams, NameParams, OperationPhase, OperationsParams,
    OwnerKind, OwnerParams, OwnerPhase, Snapshotter, SnapshotterChangedParams, StartParams,
    WaitParams, MAX_CHANGED_OPERATIONS,
};
use serde::de::DeserializeOwned;
use time::OffsetDateTime;

use crate::core::Core;
use crate::error::Error;
use crate::storage_dir;
use crate::store::events;

/// Longest `wait` a single request may ask for (less than the default idle timeout);
/// the client library splits longer waits.
pub const MAX_WAIT: Duration = Duration::from_secs(600);
/// Largest `list` page.
pub const MAX_PAGE: u32 = 1000;

/// Parses params given by name into `T`, naming the field that does not fit.
fn parse<T: DeserializeOwned>(params: &Params<'_>) -> Result<T, Error> {
    let raw = params.as_str().unwrap_or("{}");
    if raw.trim_start().starts_with('[') {
        return Err(Error::InvalidParams(
            "params must be passed by name, as a JSON object".into(),
        ));
    }
    // Valid params parse on the fast path; only a failure pays for tracking the path.
    if let Ok(parsed) = serde_json::from_str(raw) {
        return Ok(parsed);
    }
    let mut de = serde_json::Deserializer::from_str(raw);
    serde_path_to_error::deserialize(&mut de).map_err(|e| clipped(said_of_params::<T>(e)))
}

/// The invalid-params error serde_json's `e` says, worded for a client.
fn said_of_params<T: DeserializeOwned>(e: serde_path_to_error::Error<serde_json::Error>) -> Error {
    let path = e.path().to_string();
    let inner = e.into_inner().to_string();
    // serde_json appends the position; the field path says more.
    let reason = match inner.find(" at line ") {
        Some(i) => inner[..i].to_string(),
        None => inner,
    };
    if path == "." || path.is_empty() {
        match reason.find("expected struct ") {
            // The params as a whole are not an object: say what they should be,
            // not the name of a Rust type.
            Some(i) => Error::InvalidParams(format!(
                "params: {}expected an object with {}",
                &reason[..i],
                fields_of::<T>()
            )),
            // A missing field, bad syntax: said of the params, like any other.
            None => Error::InvalidParams(format!("params: {reason}")),
        }
    } else {
        Error::InvalidParams(format!("{path}: {}", plain_types(&reason)))
    }
}

/// Longest invalid-params message: serde quotes what it could not take (`invalid type:
/// string "…"`, an unknown field's name), which a peer may make megabytes long.
const MAX_PARAMS_ERROR: usize = 1024;

/// `e` with the middle of a message over [`MAX_PARAMS_ERROR`] bytes left out: its start
/// names the field and what was sent, its end what was expected (`expected u32`).
fn clipped(e: Error) -> Error {
    const TAIL: usize = 256;
    let Error::InvalidParams(message) = e else {
        return e;
    };
    if message.len() <= MAX_PARAMS_ERROR {
        return Error::InvalidParams(message);
    }
    let mut tail = message.len() - TAIL;
    while !message.is_char_boundary(tail) {
        tail += 1;
    }
    // The marker's number has at most as many digits as the whole length.
    let marker = format!("… [{} bytes left out] …", message.len());
    let mut head = MAX_PARAMS_ERROR - TAIL - marker.len();
    while !message.is_char_boundary(head) {
        head -= 1;
    }
    Error::InvalidParams(format!(
        "{}… [{} bytes left out] …{}",
        &message[..head],
        tail - head,
        &message[tail..]
    ))
}

/// `expected struct PluginRef` → `expected an object`: a client knows no Rust types.
fn plain_types(reason: &str) -> String {
    match reason.find("expected struct ") {
        Some(i) => format!("{}expected an object", &reason[..i]),
        None => reason.to_string(),
    }
}

/// The fields of the params type `T`, as a client writes them (`name, apiVersion`).
fn fields_of<T: DeserializeOwned>() -> String {
    use serde::de::{Deserializer, Visitor};

    /// Asks `T` to deserialize itself and stops at the list of fields it asks for.
    struct Probe;

    #[derive(Debug)]
    struct Fields(Option<&'static [&'static str]>);

    impl std::fmt::Display for Fields {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("probe")
        }
    }

    impl std::error::Error for Fields {}

    impl serde::de::Error for Fields {
        fn custom<M: std::fmt::Display>(_: M) -> Self {
            Fields(None)
        }
    }

    impl<'de> Deserializer<'de> for Probe {
        type Error = Fields;

        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Fields> {
            Err(Fields(None))
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Fields> {
            Err(Fields(Some(fields)))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }

    match T::deserialize(Probe) {
        Err(Fields(Some([]))) => "no fields".to_string(),
        Err(Fields(Some(fields))) => fields.join(", "),
        _ => "named fields".to_string(),
    }
}

/// `field: reason` as an invalid-params error.
fn invalid(field: &str, reason: impl std::fmt::Display) -> Error {
    Error::InvalidParams(format!("{field}: {reason}"))
}

fn owner_name(name: &str) -> Result<(), Error> {
    validate::dns_subdomain(name).map_err(|e| invalid("name", e))
}

/// An owner's name and, when given, its uid.
fn owner_of_uid(name: &str, uid: Option<&str>) -> Result<(), Error> {
    owner_name(name)?;
    match uid {
        Some(uid) => validate::uid(uid).map_err(|e| invalid("uid", e)),
        None => Ok(()),
    }
}

/// The name of an owner to be created: a DNS subdomain whose files fit the file system
/// (the limit derives from the storage layout's file names, per kind).
fn new_owner_name(kind: OwnerKind, name: &str) -> Result<(), Error> {
    owner_name(name)?;
    let max = storage_dir::max_owner_name_len(kind);
    if name.len() > max {
        return Err(invalid(
            "name",
            format!(
                "must be at most {max} characters for a {kind} (got {}): its item-operations \
                 file name must fit the file system's limit of {} bytes",
                name.len(),
                storage_dir::NAME_MAX
            ),
        ));
    }
    Ok(())
}

fn check_server(server: &opmon_client::ServerRef, field: &str) -> Result<(), Error> {
    validate::server_name(&server.name).map_err(|e| invalid(&format!("{field}name"), e))?;
    validate::server_instance(&server.instance).map_err(|e| invalid(&format!("{field}instance"), e))
}

fn check_start(kind: OwnerKind, p: &StartParams) -> Result<(), Error> {
    new_owner_name(kind, &p.name)?;
    validate::uid(&p.uid).map_err(|e| invalid("uid", e))?;
    if let Some(server) = &p.server {
        check_server(server, "server.")?;
    }
    if let Some(object) = &p.object {
        validate::owner_object(object).map_err(|e| invalid("object", e))?;
    }
    if p.item_operation_timeout.is_some_and(|t| t.0.is_zero()) {
        return Err(invalid("itemOperationTimeout", "must be greater than zero"));
    }
    Ok(())
}

/// Maps legacy plugin names (as Velero's `sanitizeName` does), then checks every
/// operation against the agent's clock `now` and against what Velero keeps for an owner
/// of `kind`.
fn check_add(
    kind: OwnerKind,
    p: &mut AddOperationsParams,
    now: OffsetDateTime,
) -> Result<(), Error> {
    owner_name(&p.name)?;
    for (i, op) in p.operations.iter_mut().enumerate() {
        validate::legacy_plugin_name(&mut op.plugin.name);
        validate::new_operation(op, now)
            .and_then(|()| fits_owner(kind, op))
            .map_err(|(field, e)| invalid(&format!("operations[{i}].{field}"), e))?;
    }
    Ok(())
}

/// Velero's backups hold the operations of BackupItemActions (and volume snapshotters);
/// its restores only RestoreItemActions', and a restore operation has no
/// `postOperationItems` (Velero's `RestoreOperationSpec` has no such field).
fn fits_owner(kind: OwnerKind, op: &opmon_client::NewOperation) -> Result<(), (String, String)> {
    use opmon_client::PluginKind::*;
    let fits = match kind {
        OwnerKind::Backup => matches!(op.plugin.kind, BackupItemAction | VolumeSnapshotter),
        OwnerKind::Restore => op.plugin.kind == RestoreItemAction,
    };
    if !fits {
        let takes = match kind {
            OwnerKind::Backup => "BackupItemAction or VolumeSnapshotter",
            OwnerKind::Restore => "RestoreItemAction",
        };
        return Err((
            "plugin.kind".into(),
            format!("a {kind} takes {takes} operations, not {}", op.plugin.kind),
        ));
    }
    if kind == OwnerKind::Restore && !op.post_operation_items.is_empty() {
        return Err((
            "postOperationItems".into(),
            "a restore operation has none (Velero backs items up again only for backups)".into(),
        ));
    }
    Ok(())
}

/// A snapshotter's name as given: a legacy name maps to `velero.io/<name>`, as
/// `addOperations` maps plugin names, so the two meet.
fn snapshotter_name(name: &mut String) -> Result<(), Error> {
    validate::legacy_plugin_name(name);
    validate::plugin_name(name).map_err(|e| invalid("name", e))
}

fn check_finalize(kind: OwnerKind, p: &FinalizeParams) -> Result<(), Error> {
    owner_name(&p.name)?;
    if kind == OwnerKind::Restore && p.contents.is_some() {
        return Err(invalid(
            "contents",
            "a restore has no backup tarball to rewrite",
        ));
    }
    if p.contents.is_none() && !p.updated_items.is_empty() {
        return Err(invalid(
            "updatedItems",
            "needs contents: the tarball to put them in",
        ));
    }
    Ok(())
}

/// Refuses phases this version does not know (a newer client's), naming the index.
fn check_phases<T: Copy + PartialEq + std::fmt::Display>(
    phases: &Option<Vec<T>>,
    all: &[T],
) -> Result<(), Error> {
    for (i, phase) in phases.iter().flatten().enumerate() {
        validate::known(*phase, all).map_err(|e| invalid(&format!("phases[{i}]"), e))?;
    }
    Ok(())
}

fn check_list(p: &ListParams) -> Result<(), Error> {
    check_phases(&p.phases, OwnerPhase::ALL)?;
    if p.limit.is_some_and(|l| l == 0 || l > MAX_PAGE) {
        return Err(invalid(
            "limit",
            format!("must be between 1 and {MAX_PAGE}"),
        ));
    }
    Ok(())
}

/// Longest `*.cancel` reason, in bytes.
pub const MAX_CANCEL_REASON: usize = 1024;
/// Most operations one `*.cancel` may name.
pub const MAX_CANCEL_OPERATIONS: usize = 10_000;

fn check_cancel(p: &CancelParams) -> Result<(), Error> {
    owner_name(&p.name)?;
    if let Some(reason) = &p.reason {
        if reason.len() > MAX_CANCEL_REASON {
            return Err(invalid(
                "reason",
                format!(
                    "must be at most {MAX_CANCEL_REASON} bytes (got {})",
                    reason.len()
                ),
            ));
        }
    }
    if let Some(ops) = &p.operations {
        if ops.is_empty() {
            return Err(invalid(
                "operations",
                "must name at least one operation; leave it out to cancel the whole owner",
            ));
        }
        if ops.len() > MAX_CANCEL_OPERATIONS {
            return Err(invalid(
                "operations",
                format!(
                    "must name at most {MAX_CANCEL_OPERATIONS} operations (got {})",
                    ops.len()
                ),
            ));
        }
        for (i, op) in ops.iter().enumerate() {
            validate::operation_id(op.operation_id())
                .map_err(|e| invalid(&format!("operations[{i}].operationId"), e))?;
            if let opmon_client::OperationSelector::Item(o) = op {
                validate::resource(&o.resource).map_err(|(field, e)| {
                    invalid(&format!("operations[{i}].resource.{field}"), e)
                })?;
            }
        }
    }
    Ok(())
}

fn check_events(p: &EventsParams) -> Result<(), Error> {
    owner_of_uid(&p.name, p.uid.as_deref())?;
    if p.limit.is_some_and(|l| l == 0 || l > events::MAX_PAGE) {
        return Err(invalid(
            "limit",
            format!("must be between 1 and {}", events::MAX_PAGE),
        ));
    }
    Ok(())
}

fn check_wait(p: &WaitParams) -> Result<(), Error> {
    owner_name(&p.name)?;
    if p.timeout.is_some_and(|t| t.0 > MAX_WAIT) {
        return Err(invalid("timeout", "must be at most 10m0s"));
    }
    Ok(())
}

pub(crate) fn check_snapshotter(s: &mut Snapshotter) -> Result<(), Error> {
    snapshotter_name(&mut s.name)?;
    if s.retry_backoff.is_some_and(|d| d.0.is_zero()) {
        return Err(invalid("retryBackoff", "must be greater than zero"));
    }
    if s.velero_plugin.is_none() && (s.args.is_some() || s.env.is_some()) {
        return Err(invalid("args", "args and env are a veleroPlugin's"));
    }
    if let Some(path) = &s.velero_plugin {
        if !path.is_absolute() {
            return Err(invalid("veleroPlugin", "must be an absolute path"));
        }
        if s.api_version == ApiVersion::V1 || s.socket.is_some() || s.command.is_some() {
            return Err(invalid(
                "veleroPlugin",
                "a Velero plugin is a v2 snapshotter without socket or command",
            ));
        }
        if let Some(key) = s
            .env
            .iter()
            .flatten()
            .map(|(k, _)| k)
            .find(|k| k.is_empty() || k.contains('=') || k.contains('\0'))
        {
            return Err(invalid("env", format!("{key:?} is not a variable name")));
        }
        return Ok(());
    }
    match (s.api_version, &s.socket, &s.command) {
        (ApiVersion::V1, None, None) => Ok(()),
        (ApiVersion::V1, _, _) => Err(invalid(
            "apiVersion",
            "a v1 snapshotter has no Progress or Cancel; register it without socket or command",
        )),
        (ApiVersion::V2, Some(_), Some(_)) | (ApiVersion::V2, None, None) => Err(invalid(
            "socket",
            "a v2 snapshotter needs exactly one of socket, command and veleroPlugin",
        )),
        (ApiVersion::V2, Some(socket), None) if !socket.is_absolute() => {
            Err(invalid("socket", "must be an absolute path"))
        }
        (ApiVersion::V2, None, Some(command)) if command.first().is_none_or(|p| p.is_empty()) => {
            Err(invalid("command", "must name a program"))
        }
        _ => Ok(()),
    }
}

/// Maps a legacy plugin name and checks the operation IDs, at most
/// [`MAX_CHANGED_OPERATIONS`] of them.
fn check_changed(p: &mut SnapshotterChangedParams) -> Result<(), Error> {
    validate::legacy_plugin_name(&mut p.plugin);
    validate::plugin_name(&p.plugin).map_err(|e| invalid("plugin", e))?;
    if let Some(ids) = &p.operations {
        if ids.len() > MAX_CHANGED_OPERATIONS {
            return Err(invalid(
                "operations",
                format!(
                    "at most {MAX_CHANGED_OPERATIONS} operation IDs (got {}); leave it out to \
                     have all of the plugin's operations polled",
                    ids.len()
                ),
            ));
        }
        for (i, id) in ids.iter().enumerate() {
            validate::operation_id(id).map_err(|e| invalid(&format!("operations[{i}]"), e))?;
        }
    }
    Ok(())
}

/// Why `snapshotter.register` refuses a command: the operator decides who may run
/// programs as the agent's user.
pub const COMMAND_REFUSED: &str = "only the config file may register a command snapshotter \
    (it runs a program as the agent's user); set allow_api_command_snapshotters = true in the \
    agent's configuration to allow it over the API";

/// Why `snapshotter.register` refuses a Velero plugin: it runs a program, as a command does.
pub const VELERO_PLUGIN_REFUSED: &str = "only the config file may register a veleroPlugin \
    snapshotter (it runs a program as the agent's user); set allow_api_command_snapshotters = \
    true in the agent's configuration to allow it over the API";

/// Registers the declared method `M` (named for `kind` if it is an owner method): parse
/// its params, run `handler` with who called (the connection's peer credentials, for the
/// owner's history), map its error to a code.
fn register<M, F, Fut>(module: &mut RpcModule<Core>, kind: OwnerKind, handler: F)
where
    M: Method,
    F: Fn(Arc<Core>, M::Params, Option<Caller>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<M::Result, Error>> + Send + 'static,
{
    let name = M::DECL.name(kind);
    module
        .register_async_method(name, move |params, core, extensions| {
            let handler = handler.clone();
            let caller = extensions.get::<Caller>().copied();
            async move {
                let parsed: M::Params = parse(&params)?;
                // The call may wait long (for the disk, a snapshotter): without its text.
                drop(params);
                handler(core, parsed, caller)
                    .await
                    .map_err(ErrorObjectOwned::from)
            }
        })
        .unwrap_or_else(|e| panic!("method {name} registered twice: {e}"));
}

/// The owner methods of `kind`, as declared in `opmon_client::methods`.
fn register_owner_methods(module: &mut RpcModule<Core>, kind: OwnerKind) {
    register::<methods::Start, _, _>(
        module,
        kind,
        move |core, p: StartParams, caller| async move {
            check_start(kind, &p)?;
            core.start(kind, p, caller).await
        },
    );
    register::<methods::AddOperations, _, _>(
        module,
        kind,
        move |core, mut p: AddOperationsParams, caller| async move {
            check_add(kind, &mut p, OffsetDateTime::now_utc())?;
            core.add_operations(kind, p, caller).await
        },
    );
    register::<methods::EndInProgress, _, _>(
        module,
        kind,
        move |core, p: EndInProgressParams, caller| async move {
            owner_name(&p.name)?;
            core.end_in_progress(kind, p, caller).await
        },
    );
    register::<methods::Get, _, _>(module, kind, move |core, p: OwnerParams, _| async move {
        owner_of_uid(&p.name, p.uid.as_deref())?;
        core.get(kind, p).await
    });
    register::<methods::History, _, _>(module, kind, move |core, p: NameParams, _| async move {
        owner_name(&p.name)?;
        core.history(kind, p.name).await
    });
    register::<methods::List, _, _>(module, kind, move |core, p: ListParams, _| async move {
        check_list(&p)?;
        core.list(kind, p).await
    });
    register::<methods::Operations, _, _>(
        module,
        kind,
        move |core, p: OperationsParams, _| async move {
            owner_of_uid(&p.name, p.uid.as_deref())?;
            check_phases(&p.phases, OperationPhase::ALL)?;
            core.operations(kind, p).await
        },
    );
    register::<methods::Wait, _, _>(module, kind, move |core, p: WaitParams, _| async move {
        check_wait(&p)?;
        core.wait(kind, p).await
    });
    register::<methods::ItemOperations, _, _>(
        module,
        kind,
        move |core, p: OwnerParams, _| async move {
            owner_of_uid(&p.name, p.uid.as_deref())?;
            core.item_operations(kind, p).await
        },
    );
    register::<methods::Events, _, _>(module, kind, move |core, p: EventsParams, _| async move {
        check_events(&p)?;
        core.events(kind, p).await
    });
    register::<methods::Finalize, _, _>(
        module,
        kind,
        move |core, p: FinalizeParams, caller| async move {
            check_finalize(kind, &p)?;
            // Runs to its end whether or not its caller waits for it: one that hung up
            // finds the result stored (a repeat returns it), not the work thrown away.
            tokio::spawn(async move { core.finalize(kind, p, caller).await })
                .await
                .map_err(|e| Error::Finalize(format!("the finalize ended abnormally: {e}")))?
        },
    );
    register::<methods::Cancel, _, _>(
        module,
        kind,
        move |core, p: CancelParams, caller| async move {
            check_cancel(&p)?;
            core.cancel(kind, p, caller).await
        },
    );
    register::<methods::Delete, _, _>(module, kind, move |core, p: OwnerParams, _| async move {
        owner_of_uid(&p.name, p.uid.as_deref())?;
        core.delete(kind, p).await
    });
}

/// `subscribe`: over WebSocket, an [`opmon_client::OwnerUpdate`] notification per
/// change until the owner is terminal. Errors before the subscription starts are
/// answered like any call's; a deleted owner ends it with an error notification.
fn register_subscription(module: &mut RpcModule<Core>, kind: OwnerKind) {
    let subscribe = methods::Subscribe::DECL.name(kind);
    module
        .register_subscription(
            subscribe,
            methods::changed(kind),
            methods::Unsubscribe::DECL.name(kind),
            move |params, pending, core, extensions| async move {
                // Held for as long as the subscription lasts.
                let _held = match core.take_subscription() {
                    Ok(held) => held,
                    Err(e) => {
                        pending.reject(ErrorObjectOwned::from(e)).await;
                        return Ok(());
                    }
                };
                let started = async {
                    let p: NameParams = parse(&params)?;
                    owner_name(&p.name)?;
                    core.subscribe(kind, p.name).await
                };
                let started = started.await;
                let mut updates = match started {
                    Ok(updates) => updates,
                    Err(e) => {
                        pending.reject(ErrorObjectOwned::from(e)).await;
                        return Ok(());
                    }
                };
                // The connection, when served by `server::serve`: an update is made and
                // handed over only while it owes little, one subscription at a time, so a
                // peer that does not read holds the server to the bound.
                let conn = extensions.get::<Arc<Connection>>().cloned();
                let sink = pending.accept().await?;
                loop {
                    let more = tokio::select! {
                        _ = sink.closed() => return Ok(()),
                        more = updates.changed() => more,
                    };
                    if !more {
                        return Ok(());
                    }
                    // The update is made in one of the few places for large answers and
                    // charged before it is handed over.
                    let held = match &conn {
                        Some(conn) => tokio::select! {
                            _ = sink.closed() => return Ok(()),
                            held = async { (conn.room().await, conn.making().await) } => Some(held),
                        },
                        None => None,
                    };
                    match updates.take().await {
                        None => return Ok(()),
                        Some(Ok(update)) => {
                            crate::edge::traffic::notification(sink.method_name(), &update.json);
                            if let Some(conn) = &conn {
                                tokio::select! {
                                    _ = sink.closed() => return Ok(()),
                                    () = conn.owe(update.json.get().len()) => {}
                                }
                            }
                            sink.send(update.json.clone()).await?;
                        }
                        Some(Err(e)) => return Err(e.to_string().into()),
                    }
                    drop(held);
                }
            },
        )
        .unwrap_or_else(|e| panic!("method {subscribe} registered twice: {e}"));
}

/// Every method of the agent, bound to `core`: the handler of each declaration in
/// `opmon_client::methods`.
pub fn rpc_module(core: Arc<Core>) -> RpcModule<Core> {
    // Agent-wide methods take no kind; any will do.
    const AGENT: OwnerKind = OwnerKind::Backup;
    let mut module = RpcModule::from_arc(core);
    register::<methods::Status, _, _>(&mut module, AGENT, |core, _, _| async move {
        core.status().await
    });
    for kind in OwnerKind::ALL {
        register_owner_methods(&mut module, kind);
        register_subscription(&mut module, kind);
    }
    register::<methods::ServerStarted, _, _>(&mut module, AGENT, |core, p, caller| async move {
        check_server(
            &opmon_client::ServerRef {
                name: p.name.clone(),
                instance: p.instance.clone(),
            },
            "",
        )?;
        core.server_started(p, caller).await
    });
    register::<methods::RegisterSnapshotter, _, _>(
        &mut module,
        AGENT,
        |core, mut s, caller| async move {
            check_snapshotter(&mut s)?;
            if s.command.is_some() && !core.allows_api_command_snapshotters() {
                return Err(invalid("command", COMMAND_REFUSED));
            }
            if s.velero_plugin.is_some() && !core.allows_api_command_snapshotters() {
                return Err(invalid("veleroPlugin", VELERO_PLUGIN_REFUSED));
            }
            match caller {
                Some(_) => core.register_snapshotter_from_api(s).await,
                None => core.register_snapshotter(s).await,
            }
        },
    );
    register::<methods::SnapshotterChanged, _, _>(
        &mut module,
        AGENT,
        |core, mut p, _| async move {
            check_changed(&mut p)?;
            core.snapshotter_changed(p.plugin, p.operations).await
        },
    );
    register::<methods::ListSnapshotters, _, _>(&mut module, AGENT, |core, _, _| async move {
        core.snapshotters().await
    });
    register::<methods::UnregisterSnapshotter, _, _>(
        &mut module,
        AGENT,
        |core, mut p, _| async move {
            snapshotter_name(&mut p.name)?;
            core.unregister_snapshotter(p.name).await
        },
    );
    // The document is served as embedded text, not as the declaration's result type
    // (a parsed map), so that a call copies bytes.
    let document = Arc::new(crate::openrpc::document());
    let discover = methods::RPC_DISCOVER;
    module
        .register_async_method(discover, move |params, _, _| {
            let document = document.clone();
            async move {
                let _: opmon_client::NoParams = parse(&params)?;
                Ok::<_, ErrorObjectOwned>(document.as_ref().clone())
            }
        })
        .unwrap_or_else(|e| panic!("method {discover} registered twice: {e}"));
    check_served(&module);
    module
}

/// Panics unless `module` serves exactly the declared methods: a declaration without a
/// handler, or a handler without a declaration (and so without documentation or a
/// retry rule), is a bug every test that starts an agent catches.
fn check_served(module: &RpcModule<Core>) {
    let mut declared: Vec<&str> = methods::ALL
        .iter()
        .flat_map(|d| d.names().iter().copied())
        .collect();
    let mut served: Vec<&str> = module.method_names().collect();
    declared.sort_unstable();
    served.sort_unstable();
    assert_eq!(
        served, declared,
        "the agent's methods differ from the declarations in opmon_client::methods"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(json: &'static str) -> Params<'static> {
        Params::new(Some(json))
    }

    #[test]
    fn type_errors_name_the_field_path() {
        let e = parse::<AddOperationsParams>(&params(
            r#"{"name":"b","operations":[{"plugin":{"kind":"BackupItemAction","name":"a/b"},"resource":{"resource":"pods","name":5},"operationId":"x"}]}"#,
        ))
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "operations[0].resource.name: invalid type: integer `5`, expected a string"
        );
    }

    #[test]
    fn a_long_value_quoted_in_an_error_is_cut_in_its_middle() {
        let raw = format!(r#"{{"limit":"{}é"}}"#, "x".repeat(2_000_000));
        let raw: &'static str = Box::leak(raw.into_boxed_str());
        let e = parse::<ListParams>(&params(raw)).unwrap_err().to_string();
        assert!(e.len() <= MAX_PARAMS_ERROR, "{} bytes", e.len());
        assert!(e.starts_with("limit: invalid type: string \"xxxx"), "{e}");
        assert!(e.contains("… [1999"), "{e}");
        assert!(e.ends_with("xxxxé\", expected u32"), "{e}");
        // Short ones are whole.
        let e = parse::<ListParams>(&params(r#"{"limit":"ten"}"#)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "limit: invalid type: string \"ten\", expected u32"
        );
    }

    #[test]
    fn positional_params_are_refused() {
        let e = parse::<NameParams>(&params(r#"["b"]"#)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "params must be passed by name, as a JSON object"
        );
    }

    const NOW: OffsetDateTime = time::macros::datetime!(2026-11-22 09:57:45 UTC);

    fn add_params(ops: &str) -> AddOperationsParams {
        let text = format!(r#"{{"name":"b","operations":[{ops}]}}"#);
        serde_json::from_str(&text).unwrap()
    }

    #[test]
    fn validation_errors_name_the_operation_index() {
        let mut p = add_params(
            r#"{"plugin":{"kind":"BackupItemAction","name":"a/b"},"resource":{"resource":"pods","name":"ok"},"operationId":"x"},
               {"plugin":{"kind":"BackupItemAction","name":"a/b"},"resource":{"resource":"pods","name":"../etc"},"operationId":"y"}"#,
        );
        assert_eq!(
            check_add(OwnerKind::Backup, &mut p, NOW)
                .unwrap_err()
                .to_string(),
            "operations[1].resource.name: must not contain '/' (a Kubernetes name is a path \
             segment: no '/', '%' or control characters)"
        );
    }

    #[test]
    fn rbac_item_names_are_accepted_and_legacy_plugin_names_mapped() {
        let mut p = add_params(
            r#"{"plugin":{"kind":"BackupItemAction","name":"csi-pvc"},"resource":{"group":"rbac.authorization.k8s.io","resource":"clusterroles","name":"system:aggregate-to-admin"},"operationId":"x",
                "postOperationItems":[{"resource":"configmaps","namespace":"app","name":"system:config"}]}"#,
        );
        check_add(OwnerKind::Backup, &mut p, NOW).unwrap();
        assert_eq!(p.operations[0].plugin.name, "velero.io/csi-pvc");
        let mut p = add_params(
            r#"{"plugin":{"kind":"BackupItemAction","name":"a.io/b"},"resource":{"resource":"pods","namespace":"App","name":"p"},"operationId":"x"}"#,
        );
        assert_eq!(
            check_add(OwnerKind::Backup, &mut p, NOW)
                .unwrap_err()
                .to_string(),
            "operations[0].resource.namespace: must be a DNS label (lowercase letters, digits \
             and '-', starting and ending with a letter or digit, at most 63 characters)"
        );
        let mut p = add_params(
            r#"{"plugin":{"kind":"BackupItemAction","name":"a.io/b/c"},"resource":{"resource":"pods","name":"p"},"operationId":"x"}"#,
        );
        assert_eq!(
            check_add(OwnerKind::Backup, &mut p, NOW)
                .unwrap_err()
                .to_string(),
            "operations[0].plugin.name: must have exactly two parts separated by '/' \
             (<DNS subdomain>/<non-empty name>)"
        );
    }

    #[test]
    fn created_far_ahead_of_the_clock_is_refused() {
        let op = |created: &str| {
            format!(
                r#"{{"plugin":{{"kind":"BackupItemAction","name":"a.io/b"}},"resource":{{"resource":"pods","name":"p"}},"operationId":"x","created":"{created}"}}"#
            )
        };
        check_add(
            OwnerKind::Backup,
            &mut add_params(&op("2026-11-22T10:02:45Z")),
            NOW,
        )
        .unwrap();
        assert_eq!(
            check_add(
                OwnerKind::Backup,
                &mut add_params(&op("2026-11-22T10:02:46Z")),
                NOW
            )
            .unwrap_err()
            .to_string(),
            "operations[0].created: must not be more than 5m0s ahead of the agent's clock"
        );
    }

    #[test]
    fn start_takes_an_object_of_bounded_size() {
        let start = |object: serde_json::Value| StartParams {
            name: "b".into(),
            uid: "u".into(),
            object: Some(object),
            ..StartParams::default()
        };
        check_start(
            OwnerKind::Backup,
            &start(serde_json::json!({"metadata": {}})),
        )
        .unwrap();
        assert_eq!(
            check_start(OwnerKind::Backup, &start(serde_json::json!("backup")))
                .unwrap_err()
                .to_string(),
            "object: must be a JSON object (the backup server's representation of the backup \
             or restore)"
        );
        let big = serde_json::json!({"spec": "x".repeat(70_000)});
        assert_eq!(
            check_start(OwnerKind::Restore, &start(big))
                .unwrap_err()
                .to_string(),
            "object: must be at most 65536 bytes serialized (got 70011)"
        );
    }

    #[test]
    fn owner_names_must_fit_the_file_system_per_kind() {
        let start = |kind, len| {
            check_start(
                kind,
                &StartParams {
                    name: "a".repeat(len),
                    uid: "u".into(),
                    ..Default::default()
                },
            )
        };
        assert!(start(OwnerKind::Restore, 224).is_ok());
        assert_eq!(
            start(OwnerKind::Restore, 225).unwrap_err().to_string(),
            "name: must be at most 224 characters for a restore (got 225): its \
             item-operations file name must fit the file system's limit of 255 bytes"
        );
        assert!(start(OwnerKind::Backup, 232).is_ok());
        assert_eq!(
            start(OwnerKind::Backup, 233).unwrap_err().to_string(),
            "name: must be at most 232 characters for a backup (got 233): its \
             item-operations file name must fit the file system's limit of 255 bytes"
        );
    }

    #[test]
    fn server_fields_are_named_when_wrong() {
        let mut p = StartParams {
            name: "b".into(),
            uid: "u".into(),
            server: Some(opmon_client::ServerRef {
                name: "velero/velero".into(),
                instance: String::new(),
            }),
            ..Default::default()
        };
        assert_eq!(
            check_start(OwnerKind::Backup, &p).unwrap_err().to_string(),
            "server.instance: must be non-empty printable text of at most 253 bytes"
        );
        p.server = Some(opmon_client::ServerRef {
            name: "bad\nname".into(),
            instance: "pod-1".into(),
        });
        assert_eq!(
            check_start(OwnerKind::Backup, &p).unwrap_err().to_string(),
            "server.name: must be empty, NAME or NAMESPACE/NAME, each of lowercase letters, \
             digits, '-' and '.' beginning and ending with a letter or digit, at most 253 \
             bytes"
        );
    }

    #[test]
    fn snapshotters_need_one_transport() {
        let mut s = Snapshotter {
            name: "example.io/copier".into(),
            api_version: ApiVersion::V2,
            socket: None,
            command: None,
            ..Default::default()
        };
        assert!(check_snapshotter(&mut s).is_err());
        s.socket = Some("relative.sock".into());
        assert_eq!(
            check_snapshotter(&mut s).unwrap_err().to_string(),
            "socket: must be an absolute path"
        );
        s.socket = Some("/run/copier.sock".into());
        assert!(check_snapshotter(&mut s).is_ok());
        s.name = "legacy".into();
        assert!(check_snapshotter(&mut s).is_ok());
        assert_eq!(s.name, "velero.io/legacy");
    }
}
