//! The API's machine-readable contract: OpenRPC 1.3 documents of the agent's API
//! (`openrpc/opmon.json`, what `rpc.discover` answers) and of the snapshotter protocol
//! (`openrpc/snapshotter.json`).
//!
//! The documents are checked in and embedded here, so a library user gets them without
//! compiling anything more. With the `schema` feature they are *generated*: every schema
//! comes from the Rust types themselves (schemars derives), and every method from its
//! declaration in [`crate::methods`] (summary, errors, result name); the error objects
//! come from the table in [`crate::codes`].
//! A test (tests/tests/openrpc.rs) fails when the checked-in files and the generated ones
//! differ; `OPMON_BLESS=1 cargo test -p opmon-tests --test openrpc` rewrites them.

/// The agent's OpenRPC document, as checked in (`client/openrpc/opmon.json`).
pub const AGENT_DOCUMENT: &str = include_str!("../openrpc/opmon.json");

/// The snapshotter protocol's OpenRPC document (`client/openrpc/snapshotter.json`).
pub const SNAPSHOTTER_DOCUMENT: &str = include_str!("../openrpc/snapshotter.json");

#[cfg(feature = "schema")]
pub use generate::{agent_document, error_codes, snapshotter_document, Rfc3339};

#[cfg(feature = "schema")]
mod generate {
    use std::borrow::Cow;

    use schemars::generate::SchemaSettings;
    use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
    use serde_json::{json, Map, Value};

    use crate::codes::{self, ErrorDoc};
    use crate::methods::{self, Decl, Method, Visit};
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

    /// Every error code the agent answers with ([`crate::codes::AGENT_ERRORS`]).
    pub fn error_codes() -> Vec<ErrorDoc> {
        codes::AGENT_ERRORS.to_vec()
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

    /// The schema of `T` where it is used: a reference to a named type, or inline.
    fn schema_of<T: JsonSchema>(g: &mut SchemaGenerator) -> Value {
        let schema = g.subschema_for::<T>();
        transformed(g, schema)
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
        json!({"name": name, "schema": schema_of::<R>(g)})
    }

    /// What the document says about one method besides its types.
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

    /// The document's entry for the method `M` named for `kind` (agent-wide methods
    /// ignore it).
    fn declared<M: Method>(g: &mut SchemaGenerator, kind: OwnerKind, all: &[ErrorDoc]) -> Value {
        let decl: &Decl = &M::DECL;
        let meta = Meta {
            name: decl.name(kind).to_string(),
            summary: decl.summary.replace("{kind}", kind.as_str()),
            description: decl.details,
            errors: decl.errors,
        };
        let mut doc = method::<M::Params, M::Result>(g, meta, decl.result, all);
        if decl.verb == methods::Unsubscribe::DECL.verb {
            // jsonrpsee's own method, which takes the id by position, not by name.
            let id = schema_of::<SubscriptionId>(g);
            doc["paramStructure"] = json!("by-position");
            doc["params"] = json!([{"name": "subscription", "required": true, "schema": id}]);
        }
        if decl.verb == methods::Subscribe::DECL.verb {
            let update = schema_of::<OwnerUpdate>(g);
            let id = schema_of::<SubscriptionId>(g);
            doc["x-notification"] = json!({
                "method": methods::changed(kind),
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
        doc
    }

    /// Walks the declarations: an agent-wide method once, an owner method once per kind
    /// (all of the backup methods, then all of the restore methods, where the owner
    /// methods are declared).
    struct Document<'g> {
        g: &'g mut SchemaGenerator,
        all: Vec<ErrorDoc>,
        before: Vec<Value>,
        owners: [Vec<Value>; 2],
        after: Vec<Value>,
    }

    impl Visit for Document<'_> {
        fn visit<M: Method>(&mut self) {
            if M::DECL.is_owner_method() {
                for (i, kind) in OwnerKind::ALL.into_iter().enumerate() {
                    let doc = declared::<M>(self.g, kind, &self.all);
                    self.owners[i].push(doc);
                }
            } else {
                let doc = declared::<M>(self.g, OwnerKind::Backup, &self.all);
                match self.owners[0].is_empty() {
                    true => self.before.push(doc),
                    false => self.after.push(doc),
                }
            }
        }
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

    /// The agent's OpenRPC document: every method declared in [`crate::methods`].
    pub fn agent_document() -> Value {
        let g = &mut generator();
        let mut d = Document {
            g,
            all: error_codes(),
            before: Vec::new(),
            owners: [Vec::new(), Vec::new()],
            after: Vec::new(),
        };
        methods::visit_all(&mut d);
        let Document {
            g,
            all,
            before,
            owners: [backups, restores],
            after,
        } = d;
        let list: Vec<Value> = [before, backups, restores, after].concat();
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
        let all = codes::SNAPSHOTTER_ERRORS.to_vec();
        let g = &mut generator();
        const CODES: &[i32] = &[
            codes::OPERATIONS_NOT_SUPPORTED,
            codes::INVALID_OPERATION_ID,
            codes::TRANSIENT,
            codes::INTERNAL_ERROR,
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
            "canceled",
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
