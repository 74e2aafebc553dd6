//! Property tests of the JSON-RPC edge: every method of `opmon_agent::api::rpc_module`,
//! bound to a real core on a real SQLite database, is called with hostile params:
//! random JSON trees, and valid params mutated (fields removed, added or retyped, huge
//! strings, odd unicode, lone surrogates, deep nesting, numbers at and past their
//! limits, positional or scalar params, duplicate keys).
//!
//! Properties, for every request:
//! - no panic, and an answer within a bound (no hang);
//! - an error has a code from the documented set and a non-empty message; an
//!   invalid-params (-32602) message names the field (`operations[2].resource.name:
//!   …`, ``missing field `name` ``) or says what is wrong with the params as a whole;
//! - a request that fails leaves the state unchanged: every table of the database, and
//!   the files of the storage directory;
//! - a result has the documented type (it deserializes into the client crate's type).
//!
//! The harness is rebuilt on a fresh database every few thousand cases so the state
//! stays small. `OPMON_FUZZ_PARAMS_CASES` (default 100000) sets the number of cases,
//! every run uses the same fixed seeds unless `PROPTEST_RNG_SEED` sets another
//! (the seed is printed at the start); `OPMON_FUZZ_SHRINK` caps shrinking (default 200).

mod common;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::FromArgMatches;
use jsonrpsee::RpcModule;
use opmon_agent::config::{self, Args};
use opmon_agent::core::Core;
use opmon_agent::metrics::Metrics;
use opmon_agent::storage_dir::StorageDir;
use opmon_agent::store::Store;
use opmon_client::methods;
use opmon_client::{
    AddOperationsResult, AgentStatus, DeleteResult, EventList, FinalizeResult, ItemOperation,
    Operation, Owner, OwnerKind, OwnerList, Snapshotter, WaitParams, WaitResult,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};
use rusqlite::types::Value as SqlValue;
use serde_json::{json, Map, Value};

// ---------------------------------------------------------------------------------
// The methods and their params' fields.

/// The params' fields of each owner method (names from `opmon_client::methods`).
const OWNER_METHODS: &[(&str, &[&str])] = &[
    (
        "start",
        &["name", "uid", "itemOperationTimeout", "finalize", "object"],
    ),
    ("addOperations", &["name", "operations"]),
    ("endInProgress", &["name", "errors", "warnings", "failed"]),
    ("get", &["name", "uid"]),
    ("history", &["name"]),
    ("list", &["phases", "limit", "after"]),
    ("operations", &["name", "uid", "phases"]),
    ("wait", &["name", "until", "timeout"]),
    ("itemOperations", &["name", "uid"]),
    ("events", &["name", "uid", "after", "limit"]),
    ("finalize", &["name", "contents", "updatedItems"]),
    ("delete", &["name", "uid"]),
    ("subscribe", &["name"]),
];

fn methods() -> Vec<(String, Vec<&'static str>)> {
    let mut all = vec![
        (methods::AGENT_STATUS.to_string(), vec![]),
        (
            methods::SNAPSHOTTER_REGISTER.to_string(),
            vec!["name", "apiVersion", "socket", "command"],
        ),
        (methods::SNAPSHOTTER_LIST.to_string(), vec![]),
        (methods::SNAPSHOTTER_UNREGISTER.to_string(), vec!["name"]),
        (methods::RPC_DISCOVER.to_string(), vec![]),
    ];
    for kind in OwnerKind::ALL {
        for (method, fields) in OWNER_METHODS {
            all.push((format!("{kind}.{method}"), fields.to_vec()));
        }
    }
    all
}

/// The verb of the owner method `method` names, if it names one.
fn owner_method(method: &str) -> Option<&'static str> {
    methods::decl_of(method)
        .filter(|d| d.is_owner_method())
        .map(|d| d.verb)
}

/// The error codes of the contract (docs/architecture.md, "The API").
const CODES: &[i64] = &[-32700, -32600, -32601, -32602, 1001, 1002, 1003, 1004, 1005];

// ---------------------------------------------------------------------------------
// Generation: proptest generates and shrinks small choices and seeds; the request is
// derived from them by a deterministic generator (cheap in a debug build), and printed
// whole when a property fails.

/// A splitmix64 generator.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }

    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())].clone()
    }

    fn weighted(&mut self, weights: &[u32]) -> usize {
        let total: u32 = weights.iter().sum();
        let mut x = (self.next() % u64::from(total)) as u32;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        weights.len() - 1
    }
}

#[derive(Clone, Debug)]
struct Knobs {
    method: u8,
    /// How the params are made: valid, mutated, random tree, not an object.
    shape: u8,
    seed: u64,
    mutations: Vec<(u8, u64)>,
}

fn knobs() -> impl Strategy<Value = Knobs> {
    (
        any::<u8>(),
        any::<u8>(),
        any::<u64>(),
        prop::collection::vec((any::<u8>(), any::<u64>()), 0..4),
    )
        .prop_map(|(method, shape, seed, mutations)| Knobs {
            method,
            shape,
            seed,
            mutations,
        })
}

const NAMES: &[&str] = &["b", "r", "x.y-1", "nightly-2024"];
const PLUGINS: &[&str] = &[
    "example.io/v1",
    "example.io/cmd",
    "example.io/none",
    // Legacy, mapped to velero.io/legacy.
    "legacy",
];
const OWNER_PHASES: &[&str] = &[
    "InProgress",
    "WaitingForPluginOperations",
    "Finalizing",
    "FinalizingPartiallyFailed",
    "Completed",
    "PartiallyFailed",
    "Failed",
    "New",
];
const OP_PHASES: &[&str] = &["New", "InProgress", "Completed", "Failed"];
/// A string that a text-level mutation turns into a lone UTF-16 surrogate escape.
const SURROGATE_MARK: &str = "\u{e000}surrogate";

fn weird_string(g: &mut Gen) -> String {
    if g.chance(200) {
        return "a".repeat(100_000);
    }
    match g.below(22) {
        0 => String::new(),
        1 => "a/b".into(),
        2 => "..".into(),
        3 => "../etc".into(),
        4 => "B".into(),
        5 => "\u{0}".into(),
        6 => "b\u{202e}".into(),
        7 => "\u{feff}b".into(),
        8 => "b\n".into(),
        9 => "ß".into(),
        10 => "🦀".into(),
        11 => "x".repeat(1025),
        12 => "b".repeat(254),
        13 => "a".repeat(300),
        14 => SURROGATE_MARK.into(),
        15 => "-1s".into(),
        16 => "1000000h".into(),
        17 => "1h0m1s".into(),
        18 => "NaN".into(),
        19 => "/etc/passwd".into(),
        20 => {
            let n = g.below(12);
            (0..n)
                .map(|_| char::from_u32(g.next() as u32 % 0x11_0000).unwrap_or('\u{fffd}'))
                .collect()
        }
        _ => g
            .pick(&[
                "v1",
                "v2",
                "terminal",
                "readyToFinalize",
                "BackupItemAction",
            ])
            .into(),
    }
}

fn limit_number(g: &mut Gen) -> Value {
    match g.below(12) {
        0 => json!(0),
        1 => json!(-1),
        2 => json!(u32::MAX),
        3 => json!(u64::from(u32::MAX) + 1),
        4 => json!(i64::MIN),
        5 => json!(u64::MAX),
        6 => json!(1e308),
        7 => json!(-0.0),
        8 => json!(1.5),
        9 => json!(5e-324),
        10 => json!(1000),
        _ => json!(1001),
    }
}

fn key(g: &mut Gen) -> String {
    let mut all: Vec<&str> = vec![
        "name",
        "uid",
        "operations",
        "plugin",
        "kind",
        "resource",
        "group",
        "namespace",
        "operationId",
        "postOperationItems",
        "phases",
        "limit",
        "after",
        "until",
        "timeout",
        "contents",
        "input",
        "output",
        "updatedItems",
        "object",
        "apiVersion",
        "socket",
        "command",
        "errors",
        "warnings",
        "failed",
        "finalize",
        "itemOperationTimeout",
        "created",
        "extra",
        "",
        "Name",
        "name ",
        "__proto__",
    ];
    if g.chance(10) {
        return weird_string(g);
    }
    all.sort_unstable();
    g.pick(&all).to_string()
}

/// A random JSON tree.
fn arbitrary(g: &mut Gen, depth: usize) -> Value {
    let leaf_only = depth == 0;
    match g.weighted(if leaf_only {
        &[1, 1, 2, 1, 3, 0, 0]
    } else {
        &[1, 1, 2, 1, 3, 2, 2]
    }) {
        0 => Value::Null,
        1 => json!(g.chance(2)),
        2 => limit_number(g),
        3 => json!((g.next() as i64) >> g.below(64)),
        4 => json!(weird_string(g)),
        5 => (0..g.below(4)).map(|_| arbitrary(g, depth - 1)).collect(),
        _ => {
            let mut m = Map::new();
            for _ in 0..g.below(4) {
                m.insert(key(g), arbitrary(g, depth - 1));
            }
            Value::Object(m)
        }
    }
}

fn name(g: &mut Gen) -> Value {
    json!(g.pick(NAMES))
}

fn resource(g: &mut Gen) -> Value {
    let mut r = json!({
        "resource": g.pick(&["persistentvolumeclaims", "pods", "volumesnapshots"]),
        "name": g.pick(&["data", "a", "vm-1-disk", "system:aggregate-to-admin"]),
    });
    if g.chance(2) {
        r["namespace"] = json!(g.pick(&["app", "ns"]));
    }
    if g.chance(3) {
        r["group"] = json!(g.pick(&["", "snapshot.storage.k8s.io"]));
    }
    r
}

fn new_operation(g: &mut Gen) -> Value {
    let mut op = json!({
        "plugin": {
            "kind": g.pick(&["BackupItemAction", "RestoreItemAction", "VolumeSnapshotter"]),
            "name": g.pick(PLUGINS),
        },
        "resource": resource(g),
        "operationId": format!("op-{}", g.below(6)),
    });
    if g.chance(2) {
        op["postOperationItems"] = (0..g.below(3)).map(|_| resource(g)).collect();
    }
    if g.chance(3) {
        op["created"] = json!(g.pick(&[
            "2024-01-01T00:00:00Z",
            "1970-01-01T00:00:00.5Z",
            "2026-01-01T12:00:00.123456789+02:00",
        ]));
    }
    op
}

/// Valid params of `method` (for the state the harness sets up).
fn valid_params(g: &mut Gen, method: &str) -> Value {
    let verb = owner_method(method);
    let restore = method.starts_with("restore.");
    match (method, verb) {
        (methods::AGENT_STATUS | methods::SNAPSHOTTER_LIST | methods::RPC_DISCOVER, _) => json!({}),
        (methods::SNAPSHOTTER_REGISTER, _) => {
            let mut s = json!({"name": g.pick(PLUGINS), "apiVersion": g.pick(&["v1", "v2"])});
            match g.below(3) {
                0 => s["socket"] = json!("/nonexistent/opmon-fuzz.sock"),
                1 => s["command"] = json!(["/bin/false", "--flag"]),
                _ => {}
            }
            s
        }
        (methods::SNAPSHOTTER_UNREGISTER, _) => json!({"name": g.pick(PLUGINS)}),
        (_, Some("start")) => {
            let mut p = json!({"name": name(g), "uid": g.pick(&["u", "v"])});
            if g.chance(3) {
                p["itemOperationTimeout"] = json!(g.pick(&["1h", "90s", "4h0m0s", "1ms"]));
            }
            if restore && g.chance(2) {
                p["finalize"] = json!(g.chance(2));
            }
            if g.chance(3) {
                p["object"] = json!({"kind": "Backup", "metadata": {"namespace": "velero"}});
            }
            p
        }
        (_, Some("addOperations")) => {
            json!({"name": name(g), "operations": (0..g.below(4)).map(|_| new_operation(g)).collect::<Vec<_>>()})
        }
        (_, Some("endInProgress")) => {
            let mut p = json!({"name": name(g)});
            if g.chance(2) {
                p["errors"] = json!(g.below(3));
            }
            if g.chance(3) {
                p["warnings"] = json!(g.below(3));
            }
            if g.chance(3) {
                p["failed"] = json!(g.chance(2));
            }
            p
        }
        (_, Some("list")) => {
            let mut p = json!({});
            if g.chance(2) {
                p["phases"] = (0..g.below(3))
                    .map(|_| json!(g.pick(OWNER_PHASES)))
                    .collect();
            }
            if g.chance(2) {
                p["limit"] = json!(1 + g.below(5));
            }
            if g.chance(3) {
                p["after"] = name(g);
            }
            p
        }
        (_, Some("operations")) => {
            let mut p = json!({"name": name(g)});
            if g.chance(2) {
                p["phases"] = (0..g.below(3)).map(|_| json!(g.pick(OP_PHASES))).collect();
            }
            p
        }
        (_, Some("wait")) => {
            json!({"name": name(g), "until": g.pick(&["readyToFinalize", "terminal"]), "timeout": "1ms"})
        }
        (_, Some("finalize")) => {
            let mut p = json!({"name": name(g)});
            if !restore && g.chance(2) {
                p["contents"] = json!({
                    "input": g.pick(&["in.tar.gz", "bad.tar.gz", "missing.tar.gz"]),
                    "output": format!("out/{}.tar.gz", g.below(3)),
                });
                if g.chance(2) {
                    p["updatedItems"] = (0..g.below(3))
                        .map(|_| json!({"resource": resource(g), "object": {"apiVersion": "v1", "kind": "PersistentVolumeClaim"}}))
                        .collect();
                }
            }
            p
        }
        _ => json!({"name": name(g)}),
    }
}

/// Every node of `v` as a JSON pointer.
fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, child) in m {
                let escaped = k.replace('~', "~0").replace('/', "~1");
                pointers(child, format!("{at}/{escaped}"), out);
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                pointers(child, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
    out.push(at);
}

/// Applies one structural mutation to `params`.
fn mutate(params: &mut Value, choice: u8, seed: u64) {
    let g = &mut Gen(seed);
    let mut all = Vec::new();
    pointers(params, String::new(), &mut all);
    let target = g.pick(&all);
    let parent_ptr = target.rsplit_once('/').map(|(p, _)| p.to_string());
    match choice % 15 {
        // Remove the node from its object or array.
        0 => {
            if let Some(parent) = parent_ptr.and_then(|p| {
                let last = target.rsplit('/').next().unwrap().to_string();
                params.pointer_mut(&p).map(|v| (v, last))
            }) {
                match parent {
                    (Value::Object(m), k) => {
                        m.remove(&k.replace("~1", "/").replace("~0", "~"));
                    }
                    (Value::Array(a), i) => {
                        if let Ok(i) = i.parse::<usize>() {
                            if i < a.len() {
                                a.remove(i);
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        // An extra key in an object.
        1 => {
            let objects: Vec<String> = all
                .iter()
                .filter(|p| params.pointer(p).is_some_and(Value::is_object))
                .cloned()
                .collect();
            if !objects.is_empty() {
                let at = g.pick(&objects);
                let k = key(g);
                let v = arbitrary(g, 2);
                if let Some(Value::Object(m)) = params.pointer_mut(&at) {
                    m.insert(k, v);
                }
            }
        }
        // Another type, or a number or string at a limit.
        2..=5 | 8..=13 => {
            let v = match g.below(3) {
                0 => arbitrary(g, 2),
                1 => limit_number(g),
                _ => json!(weird_string(g)),
            };
            if let Some(node) = params.pointer_mut(&target) {
                *node = v;
            }
        }
        // Deep nesting.
        6 => {
            if let Some(node) = params.pointer_mut(&target) {
                let mut v = node.take();
                for _ in 0..1 + g.below(200) {
                    // Built directly: `json!` would serialize `v` again at every level.
                    v = if g.chance(2) {
                        Value::Array(vec![v])
                    } else {
                        Value::Object(Map::from_iter([("a".to_string(), v)]))
                    };
                }
                *node = v;
            }
        }
        // A long array of valid-looking operations.
        7 => {
            if let Some(Value::Array(a)) = params.pointer_mut("/operations") {
                let n = 1 + g.below(300);
                for i in 0..n {
                    let mut op = new_operation(g);
                    op["operationId"] = json!(format!("bulk-{i}"));
                    a.push(op);
                }
            }
        }
        // Null where a value was.
        14 => {
            if let Some(node) = params.pointer_mut(&target) {
                *node = Value::Null;
            }
        }
        // The object's values as an array (positional params).
        _ => {
            if let Value::Object(m) = params {
                *params = Value::Array(m.values().cloned().collect());
            }
        }
    }
}

/// The request text for `knobs`: method name and params.
fn request(knobs: &Knobs, methods: &[(String, Vec<&str>)]) -> (String, String) {
    let g = &mut Gen(knobs.seed);
    let method = if knobs.method % 40 == 39 {
        g.pick(&[
            "backup.Start",
            "backup.",
            "",
            "agent.status ",
            "rpc.discover",
            "backup.start.x",
            "snapshotter",
            "backup.unsubscribe",
        ])
        .to_string()
    } else {
        methods[usize::from(knobs.method) % methods.len()].0.clone()
    };
    let mut params = Some(match knobs.shape % 10 {
        // Valid params.
        0..=2 => valid_params(g, &method),
        // Valid params, mutated.
        3..=7 => {
            let mut p = valid_params(g, &method);
            for (choice, seed) in &knobs.mutations {
                mutate(&mut p, *choice, *seed);
            }
            if knobs.mutations.is_empty() {
                mutate(&mut p, g.next() as u8, g.next());
            }
            p
        }
        // A random tree.
        8 => arbitrary(g, 4),
        // Not an object.
        _ => match g.below(6) {
            0 => Value::Null,
            1 => json!([g.pick(NAMES)]),
            2 => json!("b"),
            3 => json!(7),
            4 => json!(true),
            _ => return (method, String::new()),
        },
    });
    if let Some(p) = params.as_mut() {
        make_harmless(&method, p);
    }
    let mut text = params.map(|p| p.to_string()).unwrap_or_default();
    // Text-level mutations serde_json would not produce.
    match g.below(12) {
        0 => text = text.replace(&format!("\"{SURROGATE_MARK}\""), "\"\\ud800\""),
        1 if text.starts_with("{\"") => {
            text = format!("{{\"name\":\"b\",{}", &text[1..]);
        }
        2 if text.starts_with('{') && text.len() > 2 => {
            text = format!("{{\"limit\":1e400,{}", &text[1..]);
        }
        3 if text.starts_with('{') => text = format!(" \n\t{text} "),
        _ => {}
    }
    // A text mutation can turn invalid params into valid ones (`name` added): keep
    // such a wait short too.
    if method.ends_with(".wait") && serde_json::from_str::<WaitParams>(&text).is_ok() {
        if let Ok(mut p) = serde_json::from_str::<Value>(&text) {
            make_harmless(&method, &mut p);
            text = p.to_string();
        }
    }
    (method, text)
}

/// Keeps fuzzed requests away from the machine: absolute paths in `finalize` and
/// `snapshotter.register` are moved under the harness's directory, and commands run
/// `/bin/false`; `wait` never waits long.
fn make_harmless(method: &str, params: &mut Value) {
    let root = HARMLESS_ROOT.with(|r| r.borrow().clone());
    let relocate = |v: &mut Value| {
        if let Some(s) = v.as_str() {
            if s.starts_with('/') {
                *v = json!(format!("{}{s}", root.display()));
            }
        }
    };
    if method.ends_with(".finalize") {
        if let Some(contents) = params.get_mut("contents") {
            for k in ["input", "output"] {
                if let Some(v) = contents.get_mut(k) {
                    relocate(v);
                }
            }
        }
    }
    if method == "snapshotter.register" {
        if let Some(v) = params.get_mut("socket") {
            relocate(v);
        }
        if let Some(Value::Array(cmd)) = params.get_mut("command") {
            if let Some(first) = cmd.first_mut() {
                if first.as_str().is_some_and(|s| !s.is_empty()) {
                    *first = json!("/bin/false");
                }
            }
        }
    }
    if method.ends_with(".wait") {
        if let Ok(mut wait) = serde_json::from_value::<WaitParams>(params.clone()) {
            // Valid: wait 1 ms, unless the timeout is one the agent must refuse.
            if wait
                .timeout
                .is_none_or(|t| t.0 <= Duration::from_secs(3600))
            {
                wait.timeout = Some(opmon_client::GoDuration(Duration::from_millis(1)));
                *params = serde_json::to_value(&wait).unwrap();
            }
        }
    }
}

thread_local! {
    /// Where the current harness (one per test thread) keeps fuzzed absolute paths.
    static HARMLESS_ROOT: RefCell<PathBuf> = const { RefCell::new(PathBuf::new()) };
    /// How often each kind of answer was seen, to show what the cases exercised.
    static OUTCOMES: RefCell<BTreeMap<String, u64>> = const { RefCell::new(BTreeMap::new()) };
}

// ---------------------------------------------------------------------------------
// The harness: a core on a fresh database under /dev/shm (cheap fsyncs).

struct Harness {
    _dir: tempfile::TempDir,
    root: PathBuf,
    storage: PathBuf,
    module: RpcModule<Core>,
    db: rusqlite::Connection,
}

fn temp_dir() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    let builder = tempfile::Builder::new()
        .prefix("opmon-fuzz-params-")
        .clone();
    if shm.is_dir() {
        if let Ok(dir) = builder.tempdir_in(shm) {
            return dir;
        }
    }
    builder.tempdir().expect("temporary directory")
}

/// A small valid backup tarball.
fn tarball() -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    let body = br#"{"apiVersion":"v1","kind":"PersistentVolumeClaim"}"#;
    h.set_size(body.len() as u64);
    h.set_mode(0o644);
    b.append_data(
        &mut h,
        "resources/persistentvolumeclaims/namespaces/app/data.json",
        &body[..],
    )
    .unwrap();
    let tar = b.into_inner().unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, &tar).unwrap();
    gz.finish().unwrap()
}

impl Harness {
    async fn new() -> Harness {
        let dir = temp_dir();
        let root = dir.path().to_path_buf();
        let state = root.join("state");
        let storage = root.join("storage");
        std::fs::create_dir_all(&storage).unwrap();
        std::fs::write(storage.join("in.tar.gz"), tarball()).unwrap();
        std::fs::write(storage.join("bad.tar.gz"), b"not a tarball").unwrap();
        HARMLESS_ROOT.with(|r| *r.borrow_mut() = root.join("abs"));
        // The agent's own settings resolution, so every setting has its default.
        let argv = [
            "opmon-agent".to_string(),
            "--config".into(),
            "/dev/null".into(),
            "--state-dir".into(),
            state.display().to_string(),
            "--storage-dir".into(),
            storage.display().to_string(),
            "--call-deadline".into(),
            "2s".into(),
        ];
        let matches = config::command().try_get_matches_from(argv).unwrap();
        let args = Args::from_arg_matches(&matches).unwrap();
        let settings = config::resolve(args, &matches).unwrap();
        std::fs::create_dir_all(&settings.state_dir).unwrap();
        let store = Arc::new(Store::open(&settings.database(), |_, _| {}).unwrap());
        let core = Core::new(
            store,
            StorageDir::new(storage.clone()),
            Metrics::new(),
            settings.core(),
        )
        .await
        .unwrap();
        let db = rusqlite::Connection::open_with_flags(
            settings.database(),
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        )
        .unwrap();
        let harness = Harness {
            _dir: dir,
            root,
            storage,
            module: opmon_agent::api::rpc_module(core),
            db,
        };
        harness.populate().await;
        harness
    }

    /// Calls `method`, which must succeed.
    async fn call(&self, method: &str, params: Value) -> Value {
        let text = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
        let (answer, _) = self
            .module
            .raw_json_request(&text.to_string(), 1)
            .await
            .unwrap();
        let answer: Value = serde_json::from_str(answer.get()).unwrap();
        assert!(answer.get("error").is_none(), "{method}: {answer}");
        answer["result"].clone()
    }

    /// Owners in several phases, so requests meet every kind of state: backup `b`
    /// InProgress with operations, `x.y-1` Finalizing, `nightly-2024`
    /// FinalizingPartiallyFailed; restore `r` InProgress (finalizing), `x.y-1` Completed.
    async fn populate(&self) {
        let op = |plugin: &str, id: &str| {
            json!({"plugin": {"kind": "BackupItemAction", "name": plugin},
                   "resource": {"resource": "persistentvolumeclaims", "namespace": "app", "name": "data"},
                   "operationId": id})
        };
        self.call(
            "snapshotter.register",
            json!({"name": "example.io/v1", "apiVersion": "v1"}),
        )
        .await;
        self.call("backup.start", json!({"name": "b", "uid": "u"}))
            .await;
        self.call(
            "backup.addOperations",
            json!({"name": "b", "operations": [op("example.io/v1", "op-1"), op("example.io/none", "op-2")]}),
        )
        .await;
        self.call("backup.start", json!({"name": "x.y-1", "uid": "u"}))
            .await;
        let owner = self
            .call("backup.endInProgress", json!({"name": "x.y-1"}))
            .await;
        assert_eq!(owner["phase"], "Finalizing");
        self.call("backup.start", json!({"name": "nightly-2024", "uid": "u"}))
            .await;
        self.call(
            "backup.addOperations",
            json!({"name": "nightly-2024", "operations": [op("example.io/none", "op-3")]}),
        )
        .await;
        let owner = self
            .call("backup.endInProgress", json!({"name": "nightly-2024"}))
            .await;
        assert_eq!(owner["phase"], "FinalizingPartiallyFailed");
        self.call(
            "restore.start",
            json!({"name": "r", "uid": "u", "finalize": true}),
        )
        .await;
        self.call("restore.start", json!({"name": "x.y-1", "uid": "u"}))
            .await;
        let owner = self
            .call("restore.endInProgress", json!({"name": "x.y-1"}))
            .await;
        assert_eq!(owner["phase"], "Completed");
    }

    fn data_version(&self) -> i64 {
        self.db
            .query_row("PRAGMA data_version", [], |r| r.get(0))
            .unwrap()
    }

    /// Every row of every table.
    fn dump(&self) -> BTreeMap<String, Vec<Vec<SqlValue>>> {
        let tables: Vec<String> = self
            .db
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        tables
            .into_iter()
            .map(|t| {
                // A table without rowid (events) is ordered by its key, its first columns.
                let without_rowid: bool = self
                    .db
                    .query_row(
                        "SELECT wr FROM pragma_table_list WHERE name = ?1",
                        [&t],
                        |r| r.get(0),
                    )
                    .unwrap();
                let order = if without_rowid { "1, 2" } else { "rowid" };
                let mut stmt = self
                    .db
                    .prepare(&format!("SELECT * FROM \"{t}\" ORDER BY {order}"))
                    .unwrap();
                let n = stmt.column_count();
                let mut rows = stmt
                    .query_map([], |r| (0..n).map(|i| r.get::<_, SqlValue>(i)).collect())
                    .unwrap()
                    .collect::<Result<Vec<Vec<SqlValue>>, _>>()
                    .unwrap();
                // A failed finalize is recorded in the owner's history, and nothing else
                // of it is kept: its event is the one change a failed call may make.
                if t == "events" {
                    let failed = SqlValue::Text("FinalizeFailed".into());
                    rows.retain(|row| !row.contains(&failed));
                }
                (t, rows)
            })
            .collect()
    }

    /// Every file under the harness's directory except the database's, with its size.
    fn files(&self) -> BTreeMap<PathBuf, u64> {
        fn walk(dir: &Path, out: &mut BTreeMap<PathBuf, u64>) {
            let Ok(entries) = std::fs::read_dir(dir) else {
                return;
            };
            for e in entries.flatten() {
                let path = e.path();
                match e.metadata() {
                    Ok(m) if m.is_dir() => walk(&path, out),
                    Ok(m) => {
                        out.insert(path, m.len());
                    }
                    Err(_) => {}
                }
            }
        }
        let mut out = BTreeMap::new();
        walk(&self.storage, &mut out);
        walk(&self.root.join("abs"), &mut out);
        out
    }
}

// ---------------------------------------------------------------------------------
// The properties.

/// Whether an invalid-params message names a field of `fields` or says what is wrong
/// with the params as a whole.
fn names_what_is_wrong(fields: &[&str], message: &str) -> bool {
    if message.starts_with("params must be passed by name") {
        return true;
    }
    if message.contains("unknown field `") {
        return true;
    }
    if let Some((path, reason)) = message.split_once(": ") {
        let first = path
            .split(['.', '['])
            .next()
            .unwrap_or_default()
            .to_string();
        if fields.contains(&first.as_str()) && !reason.trim().is_empty() {
            return true;
        }
    }
    // No path: the whole params (a missing field, the wrong JSON type, bad syntax).
    let mentions_field = fields.iter().any(|f| message.contains(&format!("`{f}`")));
    mentions_field || message.contains("expected") || message.contains("EOF")
}

/// Checks that a result has the documented type of `method`.
fn check_result(method: &str, result: &Value) -> Result<(), String> {
    fn is<T: serde::de::DeserializeOwned>(v: &Value) -> Result<(), String> {
        serde_json::from_value::<T>(v.clone())
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
    let verb = owner_method(method);
    match (method, verb) {
        (methods::AGENT_STATUS, _) => is::<AgentStatus>(result),
        (methods::SNAPSHOTTER_LIST, _) => is::<Vec<Snapshotter>>(result),
        (methods::RPC_DISCOVER, _) => match result.get("openrpc") {
            Some(Value::String(_)) => Ok(()),
            _ => Err("an OpenRPC document".into()),
        },
        (methods::SNAPSHOTTER_REGISTER | methods::SNAPSHOTTER_UNREGISTER, _) => {
            is::<Snapshotter>(result)
        }
        (_, Some("start" | "endInProgress" | "get")) => is::<Owner>(result),
        (_, Some("addOperations")) => is::<AddOperationsResult>(result),
        (_, Some("list")) => is::<OwnerList>(result),
        (_, Some("history")) => is::<Vec<Owner>>(result),
        (_, Some("operations")) => is::<Vec<Operation>>(result),
        (_, Some("wait")) => is::<WaitResult>(result),
        (_, Some("itemOperations")) => is::<Vec<ItemOperation>>(result),
        (_, Some("events")) => is::<EventList>(result),
        (_, Some("finalize")) => is::<FinalizeResult>(result),
        (_, Some("delete")) => is::<DeleteResult>(result),
        (_, Some("unsubscribe")) => is::<bool>(result),
        (_, Some("subscribe")) => match result {
            Value::Number(_) | Value::String(_) => Ok(()),
            other => Err(format!("a subscription id, not {other}")),
        },
        _ => Err(format!("{method} is not a method, yet it answered")),
    }
}

fn tally(what: String) {
    OUTCOMES.with(|o| *o.borrow_mut().entry(what).or_default() += 1);
}

/// The answer's shape for the tally: method and code, or the message's reason.
fn shape(method: &str, code: i64, message: &str) -> String {
    let reason = match message.split_once(": ") {
        Some((_, r)) if code == -32602 => r,
        _ => message,
    };
    let mut reason: String = reason
        .chars()
        .map(|c| if c.is_ascii_digit() { '#' } else { c })
        .take(70)
        .collect();
    if code != -32602 {
        reason = format!("{method}: {reason}");
    }
    format!("{code} {reason}")
}

struct State {
    harness: Harness,
    /// The database dump and the files as they are now.
    dump: BTreeMap<String, Vec<Vec<SqlValue>>>,
    files: BTreeMap<PathBuf, u64>,
    version: i64,
    cases: u64,
}

/// Cases run on one database before the harness is rebuilt.
const EPOCH: u64 = 500;

async fn run_case(
    state: &mut State,
    knobs: &Knobs,
    methods: &[(String, Vec<&str>)],
) -> Result<(), String> {
    if state.cases.is_multiple_of(EPOCH) && state.cases > 0 {
        let harness = Harness::new().await;
        state.dump = harness.dump();
        state.files = harness.files();
        state.version = harness.data_version();
        state.harness = harness;
    }
    state.cases += 1;
    let (method, params) = request(knobs, methods);
    let fields: Vec<&str> = methods
        .iter()
        .find(|(m, _)| *m == method)
        .map(|(_, f)| f.clone())
        .unwrap_or_default();
    let text = if params.is_empty() {
        format!(r#"{{"jsonrpc":"2.0","id":1,"method":{}}}"#, json!(method))
    } else {
        format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":{},"params":{params}}}"#,
            json!(method)
        )
    };
    let shown = || match text.char_indices().nth(2000) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.clone(),
    };
    let answer = tokio::time::timeout(
        Duration::from_secs(20),
        state.harness.module.raw_json_request(&text, 16),
    )
    .await
    .map_err(|_| format!("no answer within 20 s to {}", shown()))?;
    let (answer, _subscription) = match answer {
        Ok(a) => a,
        Err(e) => {
            // Not a JSON-RPC request at all (bad JSON, nesting past serde_json's
            // limit): the server answers -32700 before any method runs.
            tally(format!("-32700 (not parsed: {:?})", e.classify()));
            return Ok(());
        }
    };
    let answer: Value = serde_json::from_str(answer.get())
        .map_err(|e| format!("the answer is not JSON ({e}): {answer}"))?;
    let version = state.harness.data_version();
    if let Some(error) = answer.get("error") {
        let code = error["code"]
            .as_i64()
            .ok_or_else(|| format!("no error code in {answer}"))?;
        let message = error["message"].as_str().unwrap_or_default();
        tally(shape(&method, code, message));
        if std::env::var("OPMON_FUZZ_PROBE").is_ok_and(|p| message.contains(&p)) {
            println!("PROBE {message:?} <- {}", shown());
        }
        if !CODES.contains(&code) {
            return Err(format!(
                "undocumented error code {code} ({message}) for {}",
                shown()
            ));
        }
        if message.trim().is_empty() {
            return Err(format!("an empty error message for {}", shown()));
        }
        if code == -32602 && !names_what_is_wrong(&fields, message) {
            return Err(format!(
                "the invalid-params message {message:?} names no field of {method} ({fields:?}) for {}",
                shown()
            ));
        }
        // Nothing changed.
        if version != state.version {
            let dump = state.harness.dump();
            if dump != state.dump {
                return Err(format!(
                    "the database changed although {method} failed ({code} {message}): {}",
                    shown()
                ));
            }
            state.version = version;
        }
        if matches!(
            owner_method(&method),
            Some("finalize" | "endInProgress" | "delete")
        ) {
            let files = state.harness.files();
            if files != state.files {
                return Err(format!(
                    "files changed although {method} failed ({code} {message}): {:?} → {:?} for {}",
                    state.files,
                    files,
                    shown()
                ));
            }
        }
    } else {
        let result = answer
            .get("result")
            .ok_or_else(|| format!("neither result nor error: {answer}"))?;
        check_result(&method, result)
            .map_err(|e| format!("{method} answered {result} which is not its type: {e}"))?;
        tally(format!("ok {method}"));
        if version != state.version {
            state.dump = state.harness.dump();
            state.version = version;
        }
        state.files = state.harness.files();
    }
    Ok(())
}

/// Runs `cases` requests from `seed` on a harness of its own.
fn fuzz(run: &str, cases: u32, seed: u64) {
    println!("fuzz_params {run}: {cases} cases, PROPTEST_RNG_SEED={seed}");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let methods = methods();
    let harness = runtime.block_on(Harness::new());
    let state = RefCell::new(State {
        dump: harness.dump(),
        files: harness.files(),
        version: harness.data_version(),
        harness,
        cases: 0,
    });
    let config = Config {
        cases,
        failure_persistence: None,
        // The state carries over between cases, so shrinking replays on another
        // state; keep it short.
        max_shrink_iters: std::env::var("OPMON_FUZZ_SHRINK")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(200),
        rng_seed: RngSeed::Fixed(seed),
        ..Config::default()
    };
    let started = Instant::now();
    let mut runner = TestRunner::new(config);
    let result = runner.run(&knobs(), |k| {
        let mut state = state.borrow_mut();
        runtime
            .block_on(run_case(&mut state, &k, &methods))
            .map_err(TestCaseError::fail)
    });
    println!(
        "fuzz_params {run}: {} requests (shrinking included) in {:?}",
        state.borrow().cases,
        started.elapsed()
    );
    let mut seen: Vec<(String, u64)> = OUTCOMES.with(|o| o.borrow().clone()).into_iter().collect();
    seen.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    for (what, n) in seen.iter().take(60) {
        println!("{n:>8}  {what}");
    }
    println!("({} kinds of outcome)", seen.len());
    let mut by_code: BTreeMap<&str, u64> = BTreeMap::new();
    for (what, n) in &seen {
        *by_code
            .entry(what.split(' ').next().unwrap_or_default())
            .or_default() += n;
    }
    println!("by code: {by_code:?}");
    if let Err(e) = result {
        panic!("{e}\n(replay with PROPTEST_RNG_SEED={seed} cargo test -p opmon-agent --test fuzz_params {run})");
    }
}

// The cases are split between two tests so they run on two threads.

#[test]
fn every_method_survives_hostile_params_with_documented_errors_and_no_partial_state_1() {
    let cases = common::cases("OPMON_FUZZ_PARAMS_CASES");
    fuzz("_1", cases / 2, common::seed(0));
}

#[test]
fn every_method_survives_hostile_params_with_documented_errors_and_no_partial_state_2() {
    let cases = common::cases("OPMON_FUZZ_PARAMS_CASES");
    fuzz("_2", cases - cases / 2, common::seed(0x5eed_5eed));
}
