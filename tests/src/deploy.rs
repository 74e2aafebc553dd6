//! Reading the deployment files the tests check: the Kubernetes manifests (through
//! python3 and PyYAML, the way a YAML 1.1 reader like kubectl's sees them, with the
//! TOML of ConfigMaps parsed by Python's tomllib) and the container image's Dockerfile.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// The Kubernetes examples, relative to the repository root.
pub const MANIFESTS: &[&str] = &[
    "container/kubernetes/velero-with-opmon.yaml",
    "container/kubernetes/opmon-daemonset.yaml",
];

/// The documents of the manifest at `relative`, as JSON. Each ConfigMap `data` entry
/// whose key ends in `.toml` is also given parsed, under `"_toml": {key: table}`.
pub fn manifest(relative: &str) -> Vec<Value> {
    let path = repo().join(relative);
    let out = Command::new("python3")
        .args([
            "-c",
            "import json, sys, tomllib, yaml\n\
             with open(sys.argv[1]) as f:\n    docs = [d for d in yaml.safe_load_all(f) if d is not None]\n\
             for d in docs:\n    if d.get('kind') == 'ConfigMap':\n        d['_toml'] = {k: tomllib.loads(v) for k, v in d.get('data', {}).items() if k.endswith('.toml')}\n\
             json.dump(docs, sys.stdout)",
        ])
        .arg(&path)
        .output()
        .expect("running python3 (needs PyYAML: Debian package python3-yaml)");
    assert!(
        out.status.success(),
        "python3 could not read {} (needs PyYAML: Debian package python3-yaml):\n{}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("python3 printed JSON")
}

/// What the runtime stage of `container/Dockerfile` sets up.
#[derive(Debug, Clone)]
pub struct Image {
    pub from: String,
    pub env: BTreeMap<String, String>,
    pub volumes: Vec<String>,
    pub entrypoint: Vec<String>,
    pub user: String,
    /// Destinations of the COPY instructions.
    pub copied: Vec<String>,
}

impl Image {
    /// The numeric uid and gid of `USER`.
    pub fn uid_gid(&self) -> (u32, u32) {
        let mut parts = self.user.split(':');
        let uid = parts
            .next()
            .and_then(|u| u.parse().ok())
            .unwrap_or_else(|| panic!("USER should be a numeric uid, is {:?}", self.user));
        let gid = parts.next().and_then(|g| g.parse().ok()).unwrap_or(uid);
        (uid, gid)
    }
}

/// The instructions of the Dockerfile's last stage, as `(INSTRUCTION, arguments)`, with
/// continuation lines joined and comments dropped.
fn final_stage(dockerfile: &str) -> Vec<(String, String)> {
    let mut instructions = Vec::new();
    let mut current = String::new();
    for raw in dockerfile.lines() {
        let line = raw.trim();
        if current.is_empty() && (line.is_empty() || line.starts_with('#')) {
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            current.push_str(head);
            current.push(' ');
            continue;
        }
        current.push_str(line);
        let text = std::mem::take(&mut current);
        let (keyword, args) = text.split_once(char::is_whitespace).unwrap_or((&text, ""));
        instructions.push((keyword.to_uppercase(), args.trim().to_string()));
    }
    let last_from = instructions
        .iter()
        .rposition(|(k, _)| k == "FROM")
        .expect("the Dockerfile has a FROM");
    instructions.split_off(last_from)
}

/// The runtime image of `container/Dockerfile`.
pub fn image() -> Image {
    let path = repo().join("container/Dockerfile");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let stage = final_stage(&text);
    let mut image = Image {
        from: stage[0].1.clone(),
        env: BTreeMap::new(),
        volumes: Vec::new(),
        entrypoint: Vec::new(),
        user: String::new(),
        copied: Vec::new(),
    };
    for (keyword, args) in &stage {
        match keyword.as_str() {
            "ENV" => {
                let tokens: Vec<&str> = args.split_whitespace().collect();
                if tokens.first().is_some_and(|t| !t.contains('=')) {
                    image
                        .env
                        .insert(tokens[0].to_string(), tokens[1..].join(" "));
                } else {
                    for token in tokens {
                        let (k, v) = token
                            .split_once('=')
                            .unwrap_or_else(|| panic!("ENV {args}: {token:?}"));
                        image
                            .env
                            .insert(k.to_string(), v.trim_matches('"').to_string());
                    }
                }
            }
            "VOLUME" => {
                let list: Vec<String> = if args.starts_with('[') {
                    serde_json::from_str(args).unwrap_or_else(|e| panic!("VOLUME {args}: {e}"))
                } else {
                    args.split_whitespace().map(str::to_string).collect()
                };
                image.volumes.extend(list);
            }
            "ENTRYPOINT" => {
                image.entrypoint = serde_json::from_str(args)
                    .unwrap_or_else(|e| panic!("ENTRYPOINT should be a JSON array: {args}: {e}"));
            }
            "USER" => image.user = args.clone(),
            "COPY" => {
                let dest = args.split_whitespace().last().expect("COPY destination");
                image.copied.push(dest.to_string());
            }
            _ => {}
        }
    }
    image
}

/// The image reference of the agent in the manifests (built from `container/Dockerfile`).
pub const AGENT_IMAGE_PREFIX: &str = "registry.example.com/opmon:";

/// Every pod template of `docs`: `(workload kind/name, pod spec)`.
pub fn pod_templates(docs: &[Value]) -> Vec<(String, &Value)> {
    docs.iter()
        .filter(|d| d["spec"]["template"]["spec"].is_object())
        .map(|d| {
            (
                format!(
                    "{}/{}",
                    d["kind"].as_str().unwrap_or("?"),
                    d["metadata"]["name"].as_str().unwrap_or("?")
                ),
                &d["spec"]["template"]["spec"],
            )
        })
        .collect()
}

/// Init containers, then containers, of a pod spec.
pub fn containers(pod: &Value) -> Vec<&Value> {
    let mut all: Vec<&Value> = Vec::new();
    for key in ["initContainers", "containers"] {
        if let Some(list) = pod[key].as_array() {
            all.extend(list.iter());
        }
    }
    all
}

/// The value of environment variable `name` of a container, if it sets one.
pub fn env_of<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str())
}

/// A container's security setting `key`, else the pod's.
pub fn security<'a>(pod: &'a Value, container: &'a Value, key: &str) -> &'a Value {
    match &container["securityContext"][key] {
        Value::Null => &pod["securityContext"][key],
        v => v,
    }
}

/// The pod volume a container mounts at `path`, if any.
pub fn volume_at<'a>(pod: &'a Value, container: &Value, path: &str) -> Option<&'a Value> {
    let mount = container["volumeMounts"]
        .as_array()?
        .iter()
        .find(|m| m["mountPath"] == path)?;
    pod["volumes"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == mount["name"])
}

/// The parsed `agent.toml` of the ConfigMap mounted at `/etc/opmon` in `container`.
pub fn agent_config<'a>(docs: &'a [Value], pod: &Value, container: &Value) -> &'a Value {
    let volume = volume_at(pod, container, "/etc/opmon")
        .unwrap_or_else(|| panic!("{} mounts no config at /etc/opmon", container["name"]));
    let name = &volume["configMap"]["name"];
    let map = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && &d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no ConfigMap {name} in the manifest"));
    &map["_toml"]["agent.toml"]
}
