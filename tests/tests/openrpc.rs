//! The API's OpenRPC documents: generated from the Rust types, checked in, served by
//! `rpc.discover`, and every request and response of a real agent's traffic validated
//! against them by an independent validator (Python's `jsonschema`), which also drives
//! a backup to Completed from the checked-in document alone.

use std::path::{Path, PathBuf};

use opmon_client::openrpc;
use serde_json::Value;

/// The checked-in document `name` under client/openrpc/.
fn checked_in(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../client/openrpc")
        .join(name)
}

/// Compares the checked-in `name` with `generated`, or rewrites it with `OPMON_BLESS=1`.
fn check_or_bless(name: &str, generated: Value) {
    let path = checked_in(name);
    if std::env::var_os("OPMON_BLESS").is_some_and(|v| v == "1") {
        let text = serde_json::to_string_pretty(&generated).expect("serializing") + "\n";
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        return;
    }
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let stored: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        stored == generated,
        "{} differs from the document generated from the API types; regenerate it with \
         `OPMON_BLESS=1 cargo test -p opmon-tests --test openrpc` and review the diff",
        path.display()
    );
}

#[test]
fn checked_in_agent_document_is_the_generated_one() {
    check_or_bless("opmon.json", openrpc::agent_document());
}

#[test]
fn checked_in_snapshotter_document_is_the_generated_one() {
    check_or_bless("snapshotter.json", openrpc::snapshotter_document());
}
