//! client/REFERENCE.md against the code: its method table lists exactly the methods of
//! the OpenRPC document, its error table exactly the codes the agent and snapshotters
//! answer with, its feature table exactly `agent.status`'s features, and its limits are
//! the constants the code enforces.

use std::collections::BTreeSet;
use std::path::Path;

use opmon_agent::caps;
use opmon_agent::edge::access;
use opmon_agent::edge::server::{self, ServeConfig};
use opmon_agent::{api, changes, config, phase, storage_dir};
use opmon_client::{codes, methods, openrpc, validate, OwnerKind};

fn reference() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../client/REFERENCE.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The lines between `<!-- NAME:begin -->` and `<!-- NAME:end -->`.
fn section(text: &str, name: &str) -> Vec<String> {
    let begin = format!("<!-- {name}:begin -->");
    let end = format!("<!-- {name}:end -->");
    let lines: Vec<String> = text
        .lines()
        .skip_while(|l| *l != begin)
        .skip(1)
        .take_while(|l| *l != end)
        .map(str::to_string)
        .collect();
    assert!(!lines.is_empty(), "REFERENCE.md has no {name} section");
    lines
}

/// The first cell of each table row (header and rule rows left out).
fn first_cells(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .skip(2)
        .filter_map(|l| l.strip_prefix("| "))
        .filter_map(|l| l.split(" | ").next())
        .map(str::to_string)
        .collect()
}

/// The `backticked` words of `cell`.
fn quoted(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

#[test]
fn the_method_table_lists_exactly_the_documented_methods() {
    let document: serde_json::Value =
        serde_json::from_str(openrpc::AGENT_DOCUMENT).expect("the agent document");
    let documented: BTreeSet<String> = document["methods"]
        .as_array()
        .expect("methods")
        .iter()
        .map(|m| m["name"].as_str().expect("name").to_string())
        .collect();
    let listed: BTreeSet<String> = first_cells(&section(&reference(), "methods"))
        .iter()
        .flat_map(|cell| quoted(cell))
        .collect();
    assert_eq!(listed, documented);
}

#[test]
fn the_error_table_lists_exactly_the_codes_answered() {
    let mut answered: BTreeSet<i32> = openrpc::error_codes().iter().map(|e| e.code).collect();
    answered.extend([
        codes::OPERATIONS_NOT_SUPPORTED,
        codes::INVALID_OPERATION_ID,
        codes::TRANSIENT,
    ]);
    // The codes the agent's layers define, whatever the table in openrpc.rs says.
    for code in [
        codes::PARSE_ERROR,
        codes::INVALID_REQUEST,
        codes::METHOD_NOT_FOUND,
        codes::INVALID_PARAMS,
        codes::NOT_FOUND,
        codes::ALREADY_EXISTS,
        codes::WRONG_PHASE,
        codes::STORAGE_FAILURE,
        codes::FINALIZE_FAILED,
        access::REFUSED,
        server::REQUEST_TOO_BIG,
        jsonrpsee::types::error::INTERNAL_ERROR_CODE,
        jsonrpsee::types::error::TOO_MANY_SUBSCRIPTIONS_CODE,
        jsonrpsee::types::error::OVERSIZED_RESPONSE_CODE,
        jsonrpsee::types::error::TOO_BIG_BATCH_REQUEST_CODE,
        jsonrpsee::types::error::TOO_BIG_BATCH_RESPONSE_CODE,
    ] {
        assert!(
            answered.contains(&code),
            "code {code} is missing from the error table"
        );
    }
    let listed: BTreeSet<i32> = first_cells(&section(&reference(), "errors"))
        .iter()
        .map(|c| c.parse().unwrap_or_else(|e| panic!("code {c:?}: {e}")))
        .collect();
    assert_eq!(listed, answered);
}

#[test]
fn the_feature_table_lists_exactly_the_status_features() {
    let listed: Vec<String> = first_cells(&section(&reference(), "features"))
        .iter()
        .flat_map(|cell| quoted(cell))
        .collect();
    assert_eq!(listed, methods::FEATURES);
    assert!(
        reference().contains(&format!("now `{}`", methods::API_VERSION)),
        "REFERENCE.md names another API version than {}",
        methods::API_VERSION
    );
}

#[test]
fn the_limits_are_the_codes_constants() {
    let seconds =
        |t: Option<std::time::Duration>| format!("{} seconds", t.map_or(0, |t| t.as_secs()));
    let serve = ServeConfig::default();
    let expected: Vec<(&str, String)> = vec![
        (
            "backup name",
            format!(
                "{} characters",
                storage_dir::max_owner_name_len(OwnerKind::Backup)
            ),
        ),
        (
            "restore name",
            format!(
                "{} characters",
                storage_dir::max_owner_name_len(OwnerKind::Restore)
            ),
        ),
        ("uid", format!("{} bytes", validate::MAX_UID_LEN)),
        (
            "operationId",
            format!("{} bytes", validate::MAX_OPERATION_ID_LEN),
        ),
        (
            "plugin name part",
            format!("{} bytes", validate::MAX_PLUGIN_NAME_PART),
        ),
        (
            "item name",
            format!("{} bytes", validate::MAX_ITEM_NAME_LEN),
        ),
        (
            "server name",
            format!("{} bytes", validate::MAX_SERVER_FIELD_LEN),
        ),
        (
            "object",
            format!("{} bytes", validate::MAX_OWNER_OBJECT_BYTES),
        ),
        (
            "created ahead",
            format!("{} seconds", validate::MAX_CREATED_AHEAD.as_secs()),
        ),
        ("description", format!("{} bytes", phase::MAX_DESCRIPTION)),
        ("err", format!("{} bytes", phase::MAX_ERROR)),
        ("operationUnits", format!("{} bytes", phase::MAX_UNITS)),
        ("list limit", format!("{} owners", api::MAX_PAGE)),
        ("cancel reason", format!("{} bytes", api::MAX_CANCEL_REASON)),
        (
            "cancel operations",
            format!("{}", api::MAX_CANCEL_OPERATIONS),
        ),
        (
            "events per owner",
            format!("{} events", opmon_agent::store::events::MAX_PER_OWNER),
        ),
        (
            "events page",
            format!("{} events", opmon_agent::store::events::MAX_PAGE),
        ),
        (
            "wait timeout",
            format!("{} seconds", api::MAX_WAIT.as_secs()),
        ),
        ("request", format!("{} bytes", serve.max_request_body_size)),
        (
            "WebSocket message",
            format!("{} bytes", serve.max_message_size),
        ),
        ("oversized drain", format!("{} bytes", server::MIN_DRAIN)),
        ("body deadline", seconds(serve.request_body_timeout)),
        (
            "response",
            format!("{} bytes", serve.max_response_body_size),
        ),
        (
            "batch answer",
            format!("{} bytes", serve.max_batch_response_bytes),
        ),
        ("batch calls", format!("{}", serve.max_batch_len)),
        ("connections", format!("{}", caps::CONNECTIONS)),
        (
            "connections per uid",
            format!("{}", config::DEFAULT_MAX_CONNECTIONS_PER_UID),
        ),
        ("calls in flight", format!("{}", caps::CALLS)),
        ("listings", format!("{}", caps::LISTINGS)),
        ("held bytes", format!("{} bytes", serve.held.total())),
        ("subscriptions", format!("{}", caps::SUBSCRIPTIONS)),
        ("snapshotters", format!("{}", caps::SNAPSHOTTERS)),
        ("processes", format!("{}", caps::PROCESSES)),
        (
            "unread bytes per connection",
            format!("{} bytes", serve.unread_bytes_per_connection),
        ),
        (
            "unfinished calls per connection",
            format!("{}", serve.calls_per_connection),
        ),
        ("write stall", seconds(serve.write_stall_timeout)),
        (
            "subscriptions per connection",
            format!("{}", serve.max_subscriptions_per_connection),
        ),
        (
            "progress notifications",
            format!("{} seconds", changes::PROGRESS_EVERY.as_secs()),
        ),
        ("finalizes", format!("{}", caps::FINALIZES)),
    ];
    let rows = section(&reference(), "limits");
    for (key, value) in expected {
        let row = format!("| `{key}` | {value} |");
        assert!(
            rows.iter().any(|r| r.starts_with(&row)),
            "REFERENCE.md's limits lack the row {row:?} (the code's value)"
        );
    }
}

#[test]
fn durability_is_stated_as_the_code_sets_it() {
    // The one home of the durability rule is the reference's Conventions.
    let doc = reference();
    let doc = doc.split_whitespace().collect::<Vec<_>>().join(" ");
    let stated = format!(
        "the agent commits with `synchronous={}` and a thread of its own fsyncs the WAL",
        opmon_agent::store::WRITER_SYNCHRONOUS
    );
    assert!(
        doc.contains(&stated),
        "client/REFERENCE.md's Conventions must say: {stated}"
    );
}
