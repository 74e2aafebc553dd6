//! The API's machine-readable contract: OpenRPC 1.3 documents of the agent's API
//! (`openrpc/opmon.json`, what `rpc.discover` answers) and of the snapshotter protocol
//! (`openrpc/snapshotter.json`).
//!
//! The documents are checked in and embedded here, so a library user gets them without
//! compiling anything more. With the `schema` feature they are *generated*: every schema
//! comes from the Rust types themselves (schemars derives), and the only hand-written
//! part is the method table below (summaries and which errors each method can return).
//! A test (tests/tests/openrpc.rs) fails when the checked-in files and the generated ones
//! differ; `OPMON_BLESS=1 cargo test -p opmon-tests --test openrpc` rewrites them.

/// The agent's OpenRPC document, as checked in (`client/openrpc/opmon.json`).
pub const AGENT_DOCUMENT: &str = include_str!("../openrpc/opmon.json");

/// The snapshotter protocol's OpenRPC document (`client/openrpc/snapshotter.json`).
pub const SNAPSHOTTER_DOCUMENT: &str = include_str!("../openrpc/snapshotter.json");

#[cfg(feature = "schema")]
pub use generate::{agent_document, error_codes, snapshotter_document, ErrorDoc, Rfc3339};

#[cfg(feature = "schema")]
mod generate {
    use std::borrow::Cow;

    use schemars::generate::SchemaSettings;
    use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
    use serde_json::{json, Map, Value};

    use crate::codes;
    use crate::methods::{self, OwnerMethod};
    use crate::types::*;
    use crate::GoDuration;

    /// A time as the API writes it: RFC 3339 (the agent writes UTC, `Z`).
    pub struct Rfc3339;

    impl JsonSchema for Rfc3339 {
        fn inline_schema() -> bool {
            true
        }

        fn schema_name() -> Cow<'static, str> {
            "Timestamp".into()
        }

        fn json_schema(_: &mut SchemaGenerator) -> Schema {
            json_schema!({
                "type": "string",
                "format": "date-time",
                "pattern": r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})$",
            })
        }
    }

    impl JsonSchema for GoDuration {
        fn schema_name() -> Cow<'static, str> {
            "GoDuration".into()
        }

        fn json_schema(_: &mut SchemaGenerator) -> Schema {
            // What Go's time.ParseDuration accepts for non-negative values (GoDuration's
            // parser is its twin): a sequence of decimal numbers with units, or "0".
            json_schema!({
                "description": "A non-negative Go duration string, as Go's Duration.String() writes it and time.ParseDuration reads it: \"4h0m0s\", \"90s\", \"1.5h\", \"100ms\".",
                "type": "string",
                "pattern": "^\\+?(0|(([0-9]+(\\.[0-9]*)?|\\.[0-9]+)(ns|us|\u{b5}s|\u{3bc}s|ms|s|m|h))+)$",
            })
        }
    }

    /// One error a method can answer with: its code, its `message` (the start of it,
    /// for the agent's own codes the message says what exactly was wrong) and when.
    #[derive(Clone, Copy, Debug)]
    pub struct ErrorDoc {
        pub code: i32,
        pub name: &'static str,
        pub message: &'static str,
        pub meaning: &'static str,
    }

    /// Every error code the agent answers with: the JSON-RPC ones, jsonrpsee's server
    /// limits, and the agent's own ([`crate::codes`]).
    pub fn error_codes() -> Vec<ErrorDoc> {
        let e = |code, name, message, meaning| ErrorDoc {
            code,
            name,
            message,
            meaning,
        };
        vec![
            e(codes::PARSE_ERROR, "ParseError", "Parse error", "the body is not JSON"),
            e(codes::INVALID_REQUEST, "InvalidRequest", "Invalid request", "not a JSON-RPC 2.0 request; also a POST whose Content-Type is not JSON or a form (HTTP 415), and a subscription called in a batch"),
            e(codes::METHOD_NOT_FOUND, "MethodNotFound", "Method not found", "no such method; also a `*.subscribe` called over plain HTTP (it needs a WebSocket)"),
            e(codes::INVALID_PARAMS, "InvalidParams", "Invalid params", "the params are wrong; the message starts with the offending field's path (`operations[3].resource.name: ...`)"),
            e(REFUSED, "Refused", "refused", "the connection is not admitted: the peer's uid and groups are not allowed (HTTP 403), or its uid holds max_connections_per_uid connections, or other uids hold all the connections they may (HTTP 429)"),
            e(INTERNAL_ERROR, "InternalError", "Internal error", "a bug in the agent: report it with the agent's log"),
            e(TOO_MANY_SUBSCRIPTIONS, "TooManySubscriptions", "Too many subscriptions on the connection", "jsonrpsee's limit of 1024 subscriptions on one WebSocket connection"),
            e(OVERSIZED_REQUEST, "OversizedRequest", "Request is too big", "the request is over max_request_size (HTTP 413)"),
            e(OVERSIZED_RESPONSE, "OversizedResponse", "Response is too big", "the response would be over 256 MiB"),
            e(OVERSIZED_BATCH_RESPONSE, "OversizedBatchResponse", "the answer to this batch grew past 16777216 bytes", "a batch's answer would be over 16 MiB, or the agent came to hold more than 64 MiB of answers its clients have not read while the batch ran (the message says which): the batch is answered with this one error (id null) instead of a list, and its calls after the cut are not run"),
            e(codes::NOT_FOUND, "NotFound", "not found", "the named owner or snapshotter does not exist"),
            e(codes::ALREADY_EXISTS, "AlreadyExists", "already exists", "the name is taken by an owner with another uid"),
            e(codes::WRONG_PHASE, "WrongPhase", "wrong phase", "the owner is not in a phase that allows the request"),
            e(codes::STORAGE_FAILURE, "StorageFailure", "storage failure", "the database or the storage directory failed (disk full, I/O); the message says which"),
            e(codes::FINALIZE_FAILED, "FinalizeFailed", "finalize failed", "finalize could not produce its results; the message says why"),
        ]
    }

    /// jsonrpsee's codes the agent can answer with (its `types::error` constants; the
    /// client does not depend on jsonrpsee, and the reference test checks these).
    const INTERNAL_ERROR: i32 = -32603;
    /// The agent's admission check (agent/src/access.rs), in the implementation-defined
    /// server error range.
    const REFUSED: i32 = -32003;
    const TOO_MANY_SUBSCRIPTIONS: i32 = -32006;
    const OVERSIZED_REQUEST: i32 = -32007;
    const OVERSIZED_RESPONSE: i32 = -32008;
    const OVERSIZED_BATCH_RESPONSE: i32 = -32011;

    /// The errors of the snapshotter protocol.
    fn snapshotter_errors() -> Vec<ErrorDoc> {
        vec![
            ErrorDoc {
                code: codes::OPERATIONS_NOT_SUPPORTED,
                name: "OperationsNotSupported",
                message: "operations not supported",
                meaning:
                    "this snapshotter does not handle the operation's item; the operation fails",
            },
            ErrorDoc {
                code: codes::INVALID_OPERATION_ID,
                name: "InvalidOperationId",
                message: "invalid operation ID",
                meaning: "the operation ID is unknown to the snapshotter; the operation fails",
            },
            ErrorDoc {
                code: codes::TRANSIENT,
                name: "Transient",
                message: "transient failure",
                meaning: "the failure may pass: the agent asks again with backoff within the snapshotter's retry budget, then fails the operation with the message (any error with data.retryable true counts the same)",
            },
            ErrorDoc {
                code: INTERNAL_ERROR,
                name: "Other",
                message: "Internal error",
                meaning: "any other failure (the SDK's SnapshotterError::Other); the operation \
                          fails with the message. The agent takes any code it does not know \
                          the same way",
            },
        ]
    }

    fn error_object(code: i32, all: &[ErrorDoc]) -> Value {
        let doc = all
            .iter()
            .find(|e| e.code == code)
            .unwrap_or_else(|| panic!("error code {code} is not in the error table"));
        json!({"code": doc.code, "message": doc.message, "data": doc.meaning})
    }

    /// The generator: draft 7 schemas (what OpenRPC 1.3 embeds), named types under
    /// `#/components/schemas`.
    fn generator() -> SchemaGenerator {
        SchemaSettings::draft07()
            .with(|s| {
                s.definitions_path = "/components/schemas".into();
                s.meta_schema = None;
            })
            .into_generator()
    }

    fn transformed(g: &mut SchemaGenerator, mut schema: Schema) -> Value {
        for t in g.transforms_mut() {
            t.transform(&mut schema);
        }
        schema.to_value()
    }

    /// The params of a method taking `P` by name: one content descriptor per field.
    fn params_of<P: JsonSchema>(g: &mut SchemaGenerator) -> Value {
        let schema = P::json_schema(g);
        let schema = transformed(g, schema);
        let required: Vec<&str> = schema["required"]
            .as_array()
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut params = Vec::new();
        if let Some(properties) = schema["properties"].as_object() {
            for (name, field) in properties {
                let mut param = Map::new();
                param.insert("name".into(), json!(name));
                if let Some(d) = field.get("description") {
                    param.insert("description".into(), d.clone());
                }
                param.insert("required".into(), json!(required.contains(&name.as_str())));
                param.insert("schema".into(), field.clone());
                params.push(Value::Object(param));
            }
        }
        Value::Array(params)
    }

    /// A result named `name` of type `R`.
    fn result_of<R: JsonSchema>(g: &mut SchemaGenerator, name: &str) -> Value {
        let schema = g.subschema_for::<R>();
        json!({"name": name, "schema": transformed(g, schema)})
    }

    /// What the table says about one method besides its types.
    struct Meta {
        name: String,
        summary: String,
        description: Option<&'static str>,
        errors: &'static [i32],
    }

    fn method<P: JsonSchema, R: JsonSchema>(
        g: &mut SchemaGenerator,
        meta: Meta,
        result: &str,
        all_errors: &[ErrorDoc],
    ) -> Value {
        let mut m = Map::new();
        m.insert("name".into(), json!(meta.name));
        m.insert("summary".into(), json!(meta.summary));
        if let Some(d) = meta.description {
            m.insert("description".into(), json!(d));
        }
        m.insert("paramStructure".into(), json!("by-name"));
        m.insert("params".into(), params_of::<P>(g));
        m.insert("result".into(), result_of::<R>(g, result));
        let errors: Vec<Value> = meta
            .errors
            .iter()
            .map(|&c| error_object(c, all_errors))
            .collect();
        m.insert("errors".into(), Value::Array(errors));
        Value::Object(m)
    }

    /// Methods that take no params (absent, `{}` or `[]`).
    #[derive(JsonSchema)]
    #[schemars(deny_unknown_fields)]
    struct NoParams {}

    /// What `*.subscribe` answers: the subscription's id, which each notification's
    /// `params.subscription` repeats.
    #[derive(JsonSchema)]
    #[schemars(untagged)]
    #[allow(dead_code)]
    enum SubscriptionId {
        Number(u64),
        Text(String),
    }

    const IP: i32 = codes::INVALID_PARAMS;
    const NF: i32 = codes::NOT_FOUND;
    const AE: i32 = codes::ALREADY_EXISTS;
    const WP: i32 = codes::WRONG_PHASE;
    const SF: i32 = codes::STORAGE_FAILURE;
    const FF: i32 = codes::FINALIZE_FAILED;

    /// The summary, description and errors of an owner method: the one hand-written
    /// table of the document. The match is exhaustive, so a new method cannot be left
    /// out of the document.
    fn owner_meta(m: OwnerMethod, kind: OwnerKind) -> Option<Meta> {
        let (summary, description, errors): (String, Option<&'static str>, &'static [i32]) =
            match m {
                OwnerMethod::Start => (
                    format!("Starts monitoring a {kind} in InProgress; the same name and uid again returns it."),
                    Some("Same name with another uid: 1002. `finalize` is for restores only."),
                    &[IP, AE, SF],
                ),
                OwnerMethod::AddOperations => (
                    format!("Adds the operations the plugins returned for a {kind}; only while InProgress."),
                    Some("Idempotent on an operation's plugin, ID and item: repeats count as alreadyKnown."),
                    &[IP, NF, WP, SF],
                ),
                OwnerMethod::EndInProgress => (
                    format!("Ends the {kind}'s InProgress phase with the backup server's verdict; returns the owner in its new phase."),
                    Some("A repeat answers 1003: the owner is no longer InProgress."),
                    &[IP, NF, WP, SF],
                ),
                OwnerMethod::Get => (format!("The {kind}."), None, &[IP, NF, SF]),
                OwnerMethod::List => (
                    format!("A page of {kind}s in name order, optionally of some phases."),
                    None,
                    &[IP, SF],
                ),
                OwnerMethod::Operations => (
                    format!("The {kind}'s operations, optionally of some phases."),
                    None,
                    &[IP, NF, SF],
                ),
                OwnerMethod::Wait => (
                    format!("Waits (at most `timeout`, at most 10m0s) until the {kind} is ready to finalize or terminal."),
                    None,
                    &[IP, NF, SF],
                ),
                OwnerMethod::ItemOperations => (
                    format!("The records of the {kind}'s -itemoperations.json.gz, as Velero writes them."),
                    None,
                    &[IP, NF, SF],
                ),
                OwnerMethod::Events => (
                    format!("A page of the {kind}'s history, oldest first: phase changes, failures and the calls that changed it, with their callers."),
                    Some("Paged by seq: pass the previous page's next as after. limit: default 100, at most 1000. Each owner keeps its latest 1000 events; they are removed with it."),
                    &[IP, NF, SF],
                ),
                OwnerMethod::Finalize => (
                    format!("Finalizes the {kind}: Finalizing goes to Completed, FinalizingPartiallyFailed to PartiallyFailed."),
                    Some("A repeated finalize returns the first one's result. `contents` (backups only) rewrites the tarball with `updatedItems`."),
                    &[IP, NF, WP, SF, FF],
                ),
                OwnerMethod::Delete => (
                    format!("Deletes the {kind}, cancelling its unfinished operations."),
                    None,
                    &[IP, NF, SF],
                ),
                OwnerMethod::Cancel => (
                    format!("Cancels the {kind} (it ends Failed with the reason) or, with `operations`, only those operations (they end Canceled)."),
                    Some("Allowed while InProgress or WaitingForPluginOperations*; otherwise 1003 naming the phase. A chosen operation that is finished: 1003 naming its phase; one the owner lacks: 1001; an ID two items share without its resource: -32602. Cancel is sent after the commit and waited for at most one call deadline (`unconfirmed` counts the ones not confirmed); `cancelRequested` is true on the operations meanwhile. Not safe to repeat: a repeat answers 1003."),
                    &[IP, NF, WP, SF],
                ),
                OwnerMethod::Subscribe => (
                    format!("WebSocket only: a notification `{}` per change of the {kind} until it is terminal.", OwnerMethod::Changed.name(kind)),
                    Some("The first notification, and any after the subscriber fell behind (lagged), carries every operation. Over plain HTTP: -32601; in a batch: -32600 (call it on its own). A deleted owner ends the subscription with an error notification. See x-notification."),
                    &[IP, NF, SF, codes::METHOD_NOT_FOUND, codes::INVALID_REQUEST, TOO_MANY_SUBSCRIPTIONS],
                ),
                OwnerMethod::Unsubscribe => (
                    format!("Ends a subscription made with {} on this connection; true if it existed.", OwnerMethod::Subscribe.name(kind)),
                    Some("Takes the subscription id by position: `[id]`. Never an error: an unknown id answers false."),
                    &[],
                ),
                // A notification, described on `subscribe`, not a method one calls.
                OwnerMethod::Changed => return None,
            };
        Some(Meta {
            name: m.name(kind).to_string(),
            summary,
            description,
            errors,
        })
    }

    fn meta(name: &str, summary: &str, errors: &'static [i32]) -> Meta {
        Meta {
            name: name.to_string(),
            summary: summary.to_string(),
            description: None,
            errors,
        }
    }

    fn owner_method(
        g: &mut SchemaGenerator,
        m: OwnerMethod,
        kind: OwnerKind,
        all: &[ErrorDoc],
    ) -> Option<Value> {
        let meta = owner_meta(m, kind)?;
        let mut doc = match m {
            OwnerMethod::Start => method::<StartParams, Owner>(g, meta, "owner", all),
            OwnerMethod::AddOperations => {
                method::<AddOperationsParams, AddOperationsResult>(g, meta, "counts", all)
            }
            OwnerMethod::EndInProgress => {
                method::<EndInProgressParams, Owner>(g, meta, "owner", all)
            }
            OwnerMethod::Get => method::<NameParams, Owner>(g, meta, "owner", all),
            OwnerMethod::List => method::<ListParams, OwnerList>(g, meta, "page", all),
            OwnerMethod::Operations => {
                method::<OperationsParams, Vec<Operation>>(g, meta, "operations", all)
            }
            OwnerMethod::Wait => method::<WaitParams, WaitResult>(g, meta, "wait", all),
            OwnerMethod::ItemOperations => {
                method::<NameParams, Vec<ItemOperation>>(g, meta, "records", all)
            }
            OwnerMethod::Events => method::<EventsParams, EventList>(g, meta, "page", all),
            OwnerMethod::Finalize => {
                method::<FinalizeParams, FinalizeResult>(g, meta, "finalized", all)
            }
            OwnerMethod::Delete => method::<NameParams, DeleteResult>(g, meta, "deleted", all),
            OwnerMethod::Cancel => method::<CancelParams, CancelResult>(g, meta, "canceled", all),
            OwnerMethod::Subscribe => {
                method::<NameParams, SubscriptionId>(g, meta, "subscription", all)
            }
            OwnerMethod::Unsubscribe => {
                // jsonrpsee's own method, which takes the id by position, not by name.
                let mut doc = method::<NoParams, bool>(g, meta, "unsubscribed", all);
                let id = g.subschema_for::<SubscriptionId>();
                let id = transformed(g, id);
                doc["paramStructure"] = json!("by-position");
                doc["params"] = json!([{"name": "subscription", "required": true, "schema": id}]);
                doc
            }
            OwnerMethod::Changed => return None,
        };
        if m == OwnerMethod::Subscribe {
            let update = g.subschema_for::<OwnerUpdate>();
            let update = transformed(g, update);
            let id = g.subschema_for::<SubscriptionId>();
            let id = transformed(g, id);
            doc["x-notification"] = json!({
                "method": OwnerMethod::Changed.name(kind),
                "description": "Sent on the subscribing WebSocket connection, JSON-RPC notifications without an id. params.result is an update; params.error (instead of result) says why the agent ended the subscription (the owner was deleted).",
                "params": {
                    "type": "object",
                    "required": ["subscription"],
                    "properties": {
                        "subscription": id,
                        "result": update,
                        "error": {}
                    }
                }
            });
        }
        Some(doc)
    }

    /// The OpenRPC document's `info`.
    fn info(title: &str, description: &str) -> Value {
        json!({
            "title": title,
            "version": methods::API_VERSION,
            "description": description,
            "license": {"name": "Apache-2.0"},
        })
    }

    fn components(g: &mut SchemaGenerator, errors: &[ErrorDoc]) -> Value {
        let schemas = g.take_definitions(true);
        let errors: Map<String, Value> = errors
            .iter()
            .map(|e| (e.name.to_string(), error_object(e.code, errors)))
            .collect();
        json!({"schemas": schemas, "errors": errors})
    }

    /// The agent's OpenRPC document: every method the agent serves.
    pub fn agent_document() -> Value {
        let all = error_codes();
        let g = &mut generator();
        let mut list = vec![method::<NoParams, AgentStatus>(
            g,
            meta(
                methods::AGENT_STATUS,
                "The agent's version, API version, optional features, uptime and counts.",
                &[IP, SF],
            ),
            "status",
            &all,
        )];
        for kind in OwnerKind::ALL {
            for &m in OwnerMethod::ALL {
                list.extend(owner_method(g, m, kind, &all));
            }
        }
        list.push(method::<ServerStartedParams, ServerStartedResult>(
            g,
            meta(
                methods::SERVER_STARTED,
                "A backup server (re)started as `instance`: fails the InProgress owners its other instances started.",
                &[IP, SF],
            ),
            "failed",
            &all,
        ));
        list.push(method::<Snapshotter, Snapshotter>(
            g,
            meta(
                methods::SNAPSHOTTER_REGISTER,
                "Registers (or replaces) the snapshotter that owns the operations of plugin `name`; persisted.",
                &[IP, SF],
            ),
            "snapshotter",
            &all,
        ));
        list.push(method::<NoParams, Vec<Snapshotter>>(
            g,
            meta(
                methods::SNAPSHOTTER_LIST,
                "The registered snapshotters.",
                &[IP, SF],
            ),
            "snapshotters",
            &all,
        ));
        list.push(method::<NameParams, Snapshotter>(
            g,
            meta(
                methods::SNAPSHOTTER_UNREGISTER,
                "Unregisters a snapshotter; returns what was registered.",
                &[IP, NF, SF],
            ),
            "snapshotter",
            &all,
        ));
        list.push(method::<SnapshotterChangedParams, ()>(
            g,
            meta(
                methods::SNAPSHOTTER_CHANGED,
                "A snapshotter's hint that operations of `plugin` changed: the agent polls them at once (hints that arrive meanwhile are merged, and hinted polls take a bounded share of the agent's time). The hint itself changes nothing; the poll's answers do.",
                &[IP, NF],
            ),
            "result",
            &all,
        ));
        let mut discover = meta(methods::RPC_DISCOVER, "This OpenRPC document.", &[IP]);
        discover.description =
            Some("The result is the document client/openrpc/opmon.json of the agent's version.");
        list.push(method::<NoParams, serde_json::Map<String, Value>>(
            g, discover, "openrpc", &all,
        ));
        json!({
            "openrpc": "1.3.2",
            "info": info(
                "opmon agent",
                "The per-node agent that monitors long-running backup and restore plugin operations. JSON-RPC 2.0 over HTTP POST / and WebSocket on a Unix socket; params by name; client/REFERENCE.md is the prose reference.",
            ),
            "methods": list,
            "components": components(g, &all),
        })
    }

    /// The snapshotter protocol: what the agent calls on a socket snapshotter (and
    /// what a command snapshotter prints).
    pub fn snapshotter_document() -> Value {
        let all = snapshotter_errors();
        let g = &mut generator();
        const CODES: &[i32] = &[
            codes::OPERATIONS_NOT_SUPPORTED,
            codes::INVALID_OPERATION_ID,
            codes::TRANSIENT,
            INTERNAL_ERROR,
        ];
        let progress = method::<OperationRef, OperationProgress>(
            g,
            Meta {
                name: methods::OPERATION_PROGRESS.into(),
                summary: "The progress of one operation.".into(),
                description: Some("A command snapshotter gets the same params on stdin, runs as `COMMAND... progress -- OPERATION_ID` and prints the result as one JSON object on stdout; a non-zero exit is an error whose message is stderr's last line."),
                errors: CODES,
            },
            "progress",
            &all,
        );
        let cancel = method::<OperationRef, ()>(
            g,
            Meta {
                name: methods::OPERATION_CANCEL.into(),
                summary: "Cancels one operation; best effort, as Velero's Cancel.".into(),
                description: Some("A command snapshotter runs as `COMMAND... cancel -- OPERATION_ID`; what it prints is ignored."),
                errors: CODES,
            },
            "cancelled",
            &all,
        );
        json!({
            "openrpc": "1.3.2",
            "info": info(
                "opmon snapshotter protocol",
                "What the opmon agent calls on a snapshotter: JSON-RPC 2.0 over HTTP POST / on the snapshotter's Unix socket (the agent may send batches), or a command run once per call.",
            ),
            "methods": [progress, cancel],
            "components": components(g, &all),
        })
    }
}
