//! `rpc.discover`: the agent describes itself with the OpenRPC document checked in as
//! client/openrpc/opmon.json (generated from the API types; a test keeps the two equal).
//!
//! The document is served as embedded, parsed once; the agent does not compile the
//! schema generator. Debug builds (every test's agent) check at start that each method
//! the agent registered is in the document, so a method cannot be added undocumented.

use opmon_client::openrpc::AGENT_DOCUMENT;

/// The methods the document lists.
fn documented_methods(document: &serde_json::Value) -> Vec<String> {
    document["methods"]
        .as_array()
        .map(|methods| {
            methods
                .iter()
                .filter_map(|m| m["name"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// The document `rpc.discover` answers, parsed once per agent and kept as compact JSON
/// text, so that a call copies bytes rather than building and encoding 70 KB of values.
///
/// In debug builds (every test's agent) it is also checked against `registered`, the
/// methods the agent serves: each must be in the document, so none is added
/// undocumented.
pub fn document<'a>(registered: impl Iterator<Item = &'a str>) -> Box<serde_json::value::RawValue> {
    // The document is a constant of this build: failing to parse it is a bug of the
    // build, caught by every test that starts an agent.
    let document: serde_json::Value = serde_json::from_str(AGENT_DOCUMENT)
        .unwrap_or_else(|e| panic!("the embedded OpenRPC document is not JSON: {e}"));
    if cfg!(debug_assertions) {
        let documented = documented_methods(&document);
        let missing: Vec<&str> = registered
            .filter(|name| !documented.iter().any(|d| d == name))
            .collect();
        assert!(
            missing.is_empty(),
            "methods missing from client/openrpc/opmon.json: {missing:?}; regenerate it with \
             OPMON_BLESS=1 cargo test -p opmon-tests --test openrpc"
        );
    }
    serde_json::value::to_raw_value(&document)
        .unwrap_or_else(|e| panic!("the embedded OpenRPC document cannot be encoded: {e}"))
}
