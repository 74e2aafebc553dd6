//! `rpc.discover`: the agent describes itself with the OpenRPC document checked in as
//! client/openrpc/opmon.json, generated from the method declarations in
//! `opmon_client::methods` (a test keeps the two equal).
//!
//! The document is served as embedded, parsed once; the agent does not compile the
//! schema generator. Debug builds (every test's agent) check at start that the document
//! lists exactly the declared methods, which the agent serves (`api::rpc_module`).

use opmon_client::methods;
use opmon_client::openrpc::AGENT_DOCUMENT;

/// The methods the document lists.
fn documented_methods(document: &serde_json::Value) -> Vec<&str> {
    document["methods"]
        .as_array()
        .map(|methods| methods.iter().filter_map(|m| m["name"].as_str()).collect())
        .unwrap_or_default()
}

/// The document `rpc.discover` answers, parsed once per agent and kept as compact JSON
/// text, so that a call copies bytes rather than building and encoding 70 KB of values.
pub fn document() -> Box<serde_json::value::RawValue> {
    // The document is a constant of this build: failing to parse it is a bug of the
    // build, caught by every test that starts an agent.
    let document: serde_json::Value = serde_json::from_str(AGENT_DOCUMENT)
        .unwrap_or_else(|e| panic!("the embedded OpenRPC document is not JSON: {e}"));
    if cfg!(debug_assertions) {
        let mut documented = documented_methods(&document);
        let mut declared: Vec<&str> = methods::ALL
            .iter()
            .flat_map(|d| d.names().iter().copied())
            .collect();
        documented.sort_unstable();
        declared.sort_unstable();
        assert_eq!(
            documented, declared,
            "client/openrpc/opmon.json lists other methods than opmon_client::methods \
             declares; regenerate it with OPMON_BLESS=1 cargo test -p opmon-tests --test openrpc"
        );
    }
    serde_json::value::to_raw_value(&document)
        .unwrap_or_else(|e| panic!("the embedded OpenRPC document cannot be encoded: {e}"))
}
