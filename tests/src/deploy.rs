//! Reading the deployment files the tests check: the Kubernetes examples (kustomize
//! overlays rendered by `kubectl kustomize`, then read through python3 and PyYAML, the
//! way a YAML 1.1 reader like kubectl's sees them, with the TOML of ConfigMaps parsed by
//! Python's tomllib) and the container image's Dockerfile.

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

/// The Kubernetes examples: each a name and the kustomize directories (under
/// `container/kubernetes/`) that together make it.
pub const EXAMPLES: &[(&str, &[&str])] = &[
    ("sidecar", &["sidecar"]),
    ("sidecar-litestream", &["sidecar-litestream"]),
    // daemonset-velero includes ../daemonset, the agent alone.
    ("daemonset", &["daemonset-velero"]),
];

/// The stand-in for the user's Velero Deployment that the overlays patch.
pub const VELERO_INPUT: &str = "tests/kubernetes/velero.yaml";

/// The replica settings the tests give the Litestream example (its `replica.env`).
pub const TEST_REPLICA_ENV: &str = "REPLICA_BUCKET=opmon-test\n\
REPLICA_ENDPOINT=http://127.0.0.1:9\n\
LITESTREAM_ACCESS_KEY_ID=test\n\
LITESTREAM_SECRET_ACCESS_KEY=test\n";

/// The documents of YAML `text`, as JSON, the way a YAML 1.1 reader like kubectl's sees
/// them. Each ConfigMap `data` entry whose key ends in `.toml` is also given parsed,
/// under `"_toml": {key: table}`.
pub fn parse_yaml(text: &str, what: &str) -> Vec<Value> {
    use std::io::Write;
    let mut child = Command::new("python3")
        .args([
            "-c",
            "import json, sys, tomllib, yaml\n\
             docs = [d for d in yaml.safe_load_all(sys.stdin) if d is not None]\n\
             for d in docs:\n    if isinstance(d, dict) and d.get('kind') == 'ConfigMap':\n        d['_toml'] = {k: tomllib.loads(v) for k, v in d.get('data', {}).items() if k.endswith('.toml')}\n\
             json.dump(docs, sys.stdout)",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running python3 (needs PyYAML: Debian package python3-yaml)");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("writing to python3");
    let out = child.wait_with_output().expect("python3");
    assert!(
        out.status.success(),
        "python3 could not read {what} (needs PyYAML: Debian package python3-yaml):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("python3 printed JSON")
}

/// The documents of the YAML file at `relative` (see [`parse_yaml`]).
pub fn manifest(relative: &str) -> Vec<Value> {
    let path = repo().join(relative);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    parse_yaml(&text, relative)
}

/// A copy of `container/kubernetes` in a temporary directory with the inputs a user
/// supplies: [`VELERO_INPUT`] as each overlay's `velero.yaml`, and, unless
/// `without_replica_env`, [`TEST_REPLICA_ENV`] as `replica.env`.
pub fn kubernetes_tree(without_replica_env: bool) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temporary directory");
    let source = repo().join("container/kubernetes");
    let velero = std::fs::read_to_string(repo().join(VELERO_INPUT)).expect(VELERO_INPUT);
    for entry in std::fs::read_dir(&source).expect("container/kubernetes") {
        let entry = entry.expect("directory entry");
        if !entry.file_type().expect("file type").is_dir() {
            continue;
        }
        let to = dir.path().join(entry.file_name());
        std::fs::create_dir(&to).expect("overlay directory");
        for file in std::fs::read_dir(entry.path()).expect("overlay") {
            let file = file.expect("overlay file");
            std::fs::copy(file.path(), to.join(file.file_name())).expect("copying overlay");
        }
        let kustomization = std::fs::read_to_string(to.join("kustomization.yaml"))
            .unwrap_or_else(|e| panic!("{}: no kustomization.yaml: {e}", entry.path().display()));
        if kustomization.contains("- velero.yaml") {
            std::fs::write(to.join("velero.yaml"), &velero).expect("velero.yaml");
        }
        if kustomization.contains("replica.env") && !without_replica_env {
            std::fs::write(to.join("replica.env"), TEST_REPLICA_ENV).expect("replica.env");
        }
    }
    dir
}

/// `kubectl kustomize DIR`: its exit status, standard output and standard error. Needs
/// kubectl (Debian package kubernetes-client; its kustomize needs no cluster).
pub fn kustomize(dir: &Path) -> (bool, String, String) {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .expect(
        "running kubectl, which renders the kustomize overlays (Debian package kubernetes-client)",
    );
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The documents of example `name` of [`EXAMPLES`], rendered by `kubectl kustomize`
/// from its directories with the tests' inputs.
pub fn rendered(name: &str) -> Vec<Value> {
    let (_, dirs) = EXAMPLES
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no example {name}"));
    let tree = kubernetes_tree(false);
    let mut docs = Vec::new();
    for dir in *dirs {
        let (ok, out, err) = kustomize(&tree.path().join(dir));
        assert!(
            ok,
            "kubectl kustomize container/kubernetes/{dir} failed:\n{err}"
        );
        // What `kubectl apply -k` would print to the user too (deprecated fields).
        assert!(
            err.is_empty(),
            "kubectl kustomize container/kubernetes/{dir} warned:\n{err}"
        );
        docs.extend(parse_yaml(&out, dir));
    }
    docs
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
