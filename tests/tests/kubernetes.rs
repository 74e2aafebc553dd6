//! The Kubernetes examples, run as local processes (there is no cluster here): every
//! container of ours with the command, environment, user, groups and capabilities its
//! manifest gives it, in a mount namespace of its own whose root is read-only and holds
//! only the host's `/usr`, an empty `/tmp` and the container's volume mounts at their
//! `mountPath`s. Then the agent's probes must pass, and a backup must complete through
//! the socket as the backup server's uid, with finalize reading and writing tarballs in
//! the shared storage directory.
//!
//! Volumes are directories of the test, set up the way the kubelet sets them up:
//! `emptyDir` mode 0777 (with `fsGroup`: group-owned, setgid), a PVC root 0755 (with
//! `fsGroup` likewise), `hostPath` with `DirectoryOrCreate` 0755 root-owned and shared
//! by every pod naming the same path, ConfigMaps as files 0644. Kubernetes gives a
//! container `runAsGroup` as its group and `fsGroup` plus `supplementalGroups` as
//! supplementary groups; `setpriv` does the same here, drops the capabilities the
//! manifest drops, and sets no-new-privileges.
//!
//! The examples are kustomize overlays, rendered with `kubectl kustomize` over the
//! tests' stand-in for a Velero Deployment (`tests/kubernetes/velero.yaml`). What runs:
//! the agent (the image's entrypoint, `container/Dockerfile`), the DaemonSet's busybox
//! init step (its `sh -c` with the host's shell), a snapshotter container the test adds
//! as a user would (the tests' SDK snapshotter, registered in `agent.toml`), opmon's
//! Velero plugin installer, and the backup server's container (the `opmon` CLI and tar
//! in place of Velero). The plugins' own init containers (their images) are not run:
//! the copy they make is made by the test, the Go test plugin playing the asynchronous
//! plugin, and the agent's table for it, documented commented out in `agent.toml`, is
//! uncommented as a user would: the agent starts only if it can run its copy.
//!
//! Needs root, `unshare`, `nsenter`, `setpriv` (util-linux), python3 with PyYAML and
//! kubectl (Debian package kubernetes-client).

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use opmon_tests::deploy::{self, Image};
use opmon_tests::{velero, workspace_binary};
use serde_json::Value;

const LONG: Duration = Duration::from_secs(60);

/// The namespace `valueFrom.fieldRef: metadata.namespace` resolves to.
const NAMESPACE: &str = "velero";

fn chown(path: &Path, uid: u32, gid: u32) {
    nix::unistd::chown(
        path,
        Some(nix::unistd::Uid::from_raw(uid)),
        Some(nix::unistd::Gid::from_raw(gid)),
    )
    .unwrap_or_else(|e| panic!("chown {}: {e}", path.display()));
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

/// Single-quotes `text` for sh.
fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// The node: where volumes live, shared hostPath directories by path.
struct Node {
    dir: tempfile::TempDir,
    host_paths: HashMap<String, PathBuf>,
    next: usize,
}

impl Node {
    fn new() -> Node {
        let dir = tempfile::tempdir().expect("node directory");
        chmod(dir.path(), 0o755);
        Node {
            dir,
            host_paths: HashMap::new(),
            next: 0,
        }
    }

    fn fresh_dir(&mut self, what: &str) -> PathBuf {
        self.next += 1;
        let path = self.dir.path().join(format!("{}-{what}", self.next));
        std::fs::create_dir(&path).expect("volume directory");
        path
    }
}

/// One pod of a manifest, its volumes made.
struct Pod<'a> {
    name: String,
    spec: &'a Value,
    volumes: HashMap<String, PathBuf>,
}

impl<'a> Pod<'a> {
    fn new(node: &mut Node, docs: &[Value], name: &str, spec: &'a Value) -> Pod<'a> {
        let fs_group = spec["securityContext"]["fsGroup"]
            .as_u64()
            .map(|g| g as u32);
        let mut volumes = HashMap::new();
        for v in spec["volumes"].as_array().expect("volumes") {
            let vname = v["name"].as_str().expect("volume name").to_string();
            let path = if v["emptyDir"].is_object() {
                let dir = node.fresh_dir(&vname);
                match fs_group {
                    Some(g) => {
                        chown(&dir, 0, g);
                        chmod(&dir, 0o2777);
                    }
                    None => chmod(&dir, 0o777),
                }
                dir
            } else if v["persistentVolumeClaim"].is_object() {
                let dir = node.fresh_dir(&vname);
                match fs_group {
                    Some(g) => {
                        chown(&dir, 0, g);
                        chmod(&dir, 0o2775);
                    }
                    None => chmod(&dir, 0o755),
                }
                dir
            } else if let Some(host) = v["hostPath"]["path"].as_str() {
                match node.host_paths.get(host) {
                    Some(dir) => dir.clone(),
                    None => {
                        assert_eq!(
                            v["hostPath"]["type"], "DirectoryOrCreate",
                            "{name}: hostPath {host} does not exist on the node yet"
                        );
                        let dir = node.fresh_dir(&vname);
                        chmod(&dir, 0o755);
                        node.host_paths.insert(host.to_string(), dir.clone());
                        dir
                    }
                }
            } else if let Some(map) = v["configMap"]["name"].as_str() {
                let doc = docs
                    .iter()
                    .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == map)
                    .unwrap_or_else(|| panic!("no ConfigMap {map}"));
                let dir = node.fresh_dir(&vname);
                chmod(&dir, 0o755);
                for (key, text) in doc["data"].as_object().expect("data") {
                    let file = dir.join(key);
                    std::fs::write(&file, text.as_str().expect("text")).expect("config file");
                    chmod(&file, 0o644);
                    if let Some(g) = fs_group {
                        chown(&file, 0, g);
                    }
                }
                dir
            } else {
                // A secret the test has no content for: an empty directory.
                let dir = node.fresh_dir(&vname);
                chmod(&dir, 0o755);
                dir
            };
            volumes.insert(vname, path);
        }
        Pod {
            name: name.to_string(),
            spec,
            volumes,
        }
    }

    /// The host directory behind `container`'s mount at `mount_path`.
    fn host_dir(&self, container: &Value, mount_path: &str) -> PathBuf {
        let mount = container["volumeMounts"]
            .as_array()
            .and_then(|l| l.iter().find(|m| m["mountPath"] == mount_path))
            .unwrap_or_else(|| panic!("{} mounts nothing at {mount_path}", container["name"]));
        self.volumes[mount["name"].as_str().expect("name")].clone()
    }
}

/// How to run one container: its user, groups, capabilities, environment and mounts.
struct Spec {
    name: String,
    uid: u32,
    gid: u32,
    groups: Vec<u32>,
    caps_added: Vec<String>,
    env: Vec<(String, String)>,
    /// `(host path, mountPath, read-only)`, volumes and the image's own files.
    mounts: Vec<(PathBuf, String, bool)>,
    read_only_root: bool,
}

impl Spec {
    fn of(pod: &Pod, container: &Value, image: Option<&Image>) -> Spec {
        let name = container["name"].as_str().expect("name").to_string();
        let security = |key: &str| deploy::security(pod.spec, container, key).as_u64();
        let (image_uid, image_gid) = image.map(Image::uid_gid).unwrap_or((0, 0));
        let uid = security("runAsUser").map(|u| u as u32).unwrap_or(image_uid);
        let gid = security("runAsGroup")
            .map(|g| g as u32)
            .unwrap_or(image_gid);
        if deploy::security(pod.spec, container, "runAsNonRoot") == true {
            assert_ne!(uid, 0, "{name}: runAsNonRoot with uid 0 would not start");
        }
        let mut groups: Vec<u32> = Vec::new();
        groups.extend(
            pod.spec["securityContext"]["fsGroup"]
                .as_u64()
                .map(|g| g as u32),
        );
        if let Some(list) = pod.spec["securityContext"]["supplementalGroups"].as_array() {
            groups.extend(list.iter().filter_map(Value::as_u64).map(|g| g as u32));
        }
        // Every container runs with no capabilities but those it adds (stricter than a
        // kubelet for Velero's container, which keeps the runtime's defaults: the CLI
        // standing in for it needs none).
        let sc = &container["securityContext"];
        let caps_added = sc["capabilities"]["add"]
            .as_array()
            .map(|l| {
                l.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_lowercase)
                    .collect()
            })
            .unwrap_or_default();
        let mut env: Vec<(String, String)> = vec![
            (
                "PATH".into(),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            ),
            ("HOSTNAME".into(), pod.name.replace('/', "-").to_lowercase()),
        ];
        if let Some(image) = image {
            env.extend(image.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        for var in container["env"].as_array().into_iter().flatten() {
            let key = var["name"].as_str().expect("env name").to_string();
            let value = if let Some(v) = var["value"].as_str() {
                v.to_string()
            } else if var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace" {
                NAMESPACE.to_string()
            } else {
                continue;
            };
            env.retain(|(k, _)| *k != key);
            env.push((key, value));
        }
        let mut mounts = Vec::new();
        for m in container["volumeMounts"].as_array().into_iter().flatten() {
            let path = m["mountPath"].as_str().expect("mountPath").to_string();
            mounts.push((
                pod.volumes[m["name"].as_str().expect("name")].clone(),
                path,
                m["readOnly"] == true,
            ));
        }
        Spec {
            name,
            uid,
            gid,
            groups,
            caps_added,
            env,
            mounts,
            read_only_root: sc["readOnlyRootFilesystem"] == true,
        }
    }

    /// The `setpriv … --` prefix that becomes this container's user.
    fn setpriv(&self) -> String {
        let groups = if self.groups.is_empty() {
            "--clear-groups".to_string()
        } else {
            let list: Vec<String> = self.groups.iter().map(u32::to_string).collect();
            format!("--groups={}", list.join(","))
        };
        let mut bounding = String::from("-all");
        for cap in &self.caps_added {
            bounding.push_str(&format!(",+{cap}"));
        }
        format!(
            "/usr/bin/setpriv --reuid={} --regid={} {groups} --inh-caps=-all --bounding-set={bounding} --no-new-privs --",
            self.uid, self.gid
        )
    }

    fn env_words(&self) -> String {
        self.env
            .iter()
            .map(|(k, v)| quote(&format!("{k}={v}")))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// A command that makes this container's root under `rootfs` (a fresh mount
    /// namespace: tmpfs root, the host's /usr read-only, /proc and /dev, the mounts, then
    /// read-only) and runs `argv` in it as the container's user. The process it starts
    /// becomes the container's process (every step execs).
    fn command(&self, rootfs: &Path, argv: &[String]) -> Command {
        std::fs::create_dir_all(rootfs).expect("rootfs");
        let r = quote(&rootfs.display().to_string());
        let mut script = format!(
            "set -eu\nR={r}\nip link set lo up\nmount -t tmpfs -o mode=0755 tmpfs \"$R\"\n\
             mkdir \"$R/usr\" \"$R/etc\" \"$R/proc\" \"$R/dev\"\n\
             mkdir -m 1777 \"$R/tmp\"\n\
             mount --rbind /usr \"$R/usr\"\nmount -o remount,bind,ro \"$R/usr\"\n\
             for l in bin lib lib64 sbin; do ln -s usr/$l \"$R/$l\"; done\n\
             cp /etc/passwd /etc/group \"$R/etc/\"\n\
             mount --rbind /proc \"$R/proc\"\nmount --rbind /dev \"$R/dev\"\n\
             mount -t tmpfs -o mode=0755 tmpfs \"$R/usr/local/bin\"\n"
        );
        for (host, path, read_only) in &self.mounts {
            let is_dir = host.is_dir();
            let host = quote(&host.display().to_string());
            let target = quote(path);
            if is_dir {
                script.push_str(&format!("mkdir -p \"$R\"{target}\n"));
            } else {
                script.push_str(&format!(
                    "mkdir -p \"$(dirname \"$R\"{target})\"\ntouch \"$R\"{target}\n"
                ));
            }
            script.push_str(&format!("mount --bind {host} \"$R\"{target}\n"));
            if *read_only {
                script.push_str(&format!("mount -o remount,bind,ro \"$R\"{target}\n"));
            }
        }
        if self.read_only_root {
            script.push_str("mount -o remount,ro \"$R\"\n");
        }
        let argv: Vec<String> = argv.iter().map(|a| quote(a)).collect();
        script.push_str(&format!(
            "exec /usr/sbin/chroot \"$R\" /usr/bin/env -i {} {} {}\n",
            self.env_words(),
            self.setpriv(),
            argv.join(" ")
        ));
        // A network namespace of its own, as a pod has: the agents of two tests each bind
        // the examples' metrics port (containers here talk over the shared socket only).
        let mut cmd = Command::new("unshare");
        cmd.args([
            "--net",
            "--mount",
            "--propagation",
            "private",
            "/bin/sh",
            "-c",
            &script,
        ])
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(Stdio::null());
        cmd
    }

    /// Runs `argv` inside the running container `pid` (its mount namespace and root), as
    /// the container's user: how the kubelet runs an exec probe.
    fn exec_in(&self, pid: u32, argv: &[&str]) -> Output {
        let argv: Vec<String> = argv.iter().map(|a| quote(a)).collect();
        let script = format!(
            "exec /usr/bin/env -i {} {} {}",
            self.env_words(),
            self.setpriv(),
            argv.join(" ")
        );
        Command::new("nsenter")
            .args([
                "-t",
                &pid.to_string(),
                "-m",
                "-n",
                "-r",
                "-w",
                "--",
                "/bin/sh",
                "-c",
                &script,
            ])
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .stdin(Stdio::null())
            .output()
            .expect("nsenter")
    }
}

/// A running container process.
struct Running {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Running {
    fn start(node: &Node, spec: &Spec, argv: &[String]) -> Running {
        let log = node.dir.path().join(format!("{}.log", spec.name));
        let rootfs = node.dir.path().join(format!("rootfs-{}", spec.name));
        let child = spec
            .command(&rootfs, argv)
            .stdout(std::fs::File::create(&log).expect("log"))
            .stderr(std::fs::File::create(log.with_extension("err")).expect("log"))
            .spawn()
            .expect("unshare");
        Running {
            name: spec.name.clone(),
            child,
            log,
        }
    }

    fn output(&self) -> String {
        let mut text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.push_str(&std::fs::read_to_string(self.log.with_extension("err")).unwrap_or_default());
        text
    }

    fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "container {} exited ({status}):\n{}",
                self.name,
                self.output()
            );
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a container to completion (an init container, or a step of the backup
/// server), failing with its output unless it succeeds; returns standard output.
fn run_to_end(node: &Node, spec: &Spec, argv: &[String]) -> String {
    let rootfs = node
        .dir
        .path()
        .join(format!("rootfs-{}-{}", spec.name, argv.len()));
    let out = spec.command(&rootfs, argv).output().expect("unshare");
    assert!(
        out.status.success(),
        "container {} ({argv:?}) failed ({}):\n{}\n{}",
        spec.name,
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The container's command as Kubernetes resolves it: `command` (else the image's
/// entrypoint) followed by `args`.
fn argv_of(container: &Value, image: Option<&Image>) -> Vec<String> {
    let list = |key: &str| -> Option<Vec<String>> {
        container[key].as_array().map(|l| {
            l.iter()
                .map(|a| a.as_str().expect("string argument").to_string())
                .collect()
        })
    };
    let mut argv = list("command")
        .or_else(|| image.map(|i| i.entrypoint.clone()))
        .unwrap_or_else(|| panic!("{}: no command and no known image", container["name"]));
    argv.extend(list("args").unwrap_or_default());
    argv
}

/// Runs the probe `probe` of `container` in `running` until it passes, within what its
/// periodSeconds × failureThreshold allows.
fn probe_passes(spec: &Spec, running: &mut Running, container: &Value, probe: &str) {
    let p = &container[probe];
    let argv: Vec<&str> = p["exec"]["command"]
        .as_array()
        .unwrap_or_else(|| panic!("{}: no exec {probe}", spec.name))
        .iter()
        .map(|a| a.as_str().expect("string"))
        .collect();
    let allowed = Duration::from_secs(
        p["periodSeconds"].as_u64().unwrap_or(10) * p["failureThreshold"].as_u64().unwrap_or(3),
    )
    .min(Duration::from_secs(120));
    let start = Instant::now();
    loop {
        running.assert_running();
        let out = spec.exec_in(running.child.id(), &argv);
        if out.status.success() {
            return;
        }
        assert!(
            start.elapsed() < allowed,
            "{}'s {probe} ({argv:?}) never passed: {}\n{}",
            spec.name,
            String::from_utf8_lossy(&out.stderr),
            running.output()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn is_agent(container: &Value) -> bool {
    container["image"]
        .as_str()
        .is_some_and(|i| i.starts_with(deploy::AGENT_IMAGE_PREFIX))
        && !is_plugin_installer(container)
}

/// The init container that installs opmon's Velero plugin, from the agent's image.
fn is_plugin_installer(container: &Value) -> bool {
    container["command"][0] == "/usr/local/bin/opmon-velero-plugin"
}

/// The socket the tests' snapshotter serves on, in the agent pod's snapshotter volume.
const SNAPSHOTTER_SOCKET: &str = "/run/opmon-snapshotters/volume-copier.sock";

/// What a user adds to an example for a plugin's operations: a `[[snapshotter]]` table
/// in `agent.toml` and the snapshotter's container in the agent's pod, serving on the
/// volume the agent mounts at `/run/opmon-snapshotters`. The examples ship neither
/// (the snapshotter is yours); the tests' SDK snapshotter plays it.
fn add_snapshotter(docs: &mut [Value]) {
    let table = format!(
        "\n[[snapshotter]]\nname = \"example.io/volume-copier\"\napi_version = \"v2\"\nsocket = \"{SNAPSHOTTER_SOCKET}\"\n"
    );
    let config = docs
        .iter_mut()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "opmon-config")
        .expect("the opmon-config ConfigMap");
    let text = format!(
        "{}{table}",
        config["data"]["agent.toml"].as_str().expect("agent.toml")
    );
    config["data"]["agent.toml"] = Value::String(text);
    config["_toml"]["agent.toml"]["snapshotter"] = serde_json::json!([{
        "name": "example.io/volume-copier",
        "api_version": "v2",
        "socket": SNAPSHOTTER_SOCKET,
    }]);
    let pod = docs
        .iter_mut()
        .map(|d| &mut d["spec"]["template"]["spec"])
        .find(|p| p.is_object() && deploy::containers(p).into_iter().any(is_agent))
        .expect("the agent's pod");
    pod["containers"]
        .as_array_mut()
        .expect("containers")
        .push(serde_json::json!({
            "name": "volume-copier",
            "volumeMounts": [{"name": "opmon-snapshotters", "mountPath": "/run/opmon-snapshotters"}],
            "securityContext": {
                "runAsNonRoot": true,
                "runAsUser": 65533,
                "runAsGroup": 65533,
                "readOnlyRootFilesystem": true,
                "allowPrivilegeEscalation": false,
                "capabilities": {"drop": ["ALL"]},
            },
        }));
}

/// The plugin the Go test plugin serves that the documented table is given.
const VELERO_PLUGIN_NAME: &str = "example.io/backup-a";

/// The `[[snapshotter]]` table for the Velero plugin opmon's plugin stands in for, which
/// the example documents commented out in `agent.toml`, taken in as a user does:
/// uncommented, named for a plugin the Go test plugin serves. Its `velero_plugin` path.
fn enable_velero_plugin_table(docs: &mut [Value]) -> String {
    let config = docs
        .iter_mut()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "opmon-config")
        .expect("the opmon-config ConfigMap");
    let text = config["data"]["agent.toml"]
        .as_str()
        .expect("agent.toml")
        .to_string();
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let at = lines
        .iter()
        .position(|l| l.starts_with("# velero_plugin = \""))
        .expect("agent.toml documents a velero_plugin table");
    assert!(
        at >= 2 && lines[at - 2] == "# [[snapshotter]]" && lines[at - 1].starts_with("# name = "),
        "the documented table: {:?}",
        &lines[at.saturating_sub(2)..=at]
    );
    let path = lines[at]
        .trim_start_matches("# velero_plugin = \"")
        .trim_end_matches('"')
        .to_string();
    lines[at - 2] = "[[snapshotter]]".into();
    lines[at - 1] = format!("name = \"{VELERO_PLUGIN_NAME}\"");
    lines[at] = format!("velero_plugin = \"{path}\"");
    config["data"]["agent.toml"] = Value::String(lines.join("\n") + "\n");
    if let Some(tables) = config["_toml"]["agent.toml"]["snapshotter"].as_array_mut() {
        tables.push(serde_json::json!({"name": VELERO_PLUGIN_NAME, "velero_plugin": path}));
    }
    path
}

/// The file name the original Velero plugin has in the `plugins` volumes: the one opmon's
/// plugin installer stands in for in Velero's pod.
fn velero_plugin_file(docs: &[Value]) -> String {
    let installer = deploy::pod_templates(docs)
        .into_iter()
        .flat_map(|(_, spec)| {
            spec["initContainers"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .find(is_plugin_installer)
        .expect("opmon's plugin installer in Velero's pod");
    let target = installer["command"]
        .as_array()
        .and_then(|c| c.last())
        .and_then(Value::as_str)
        .expect("the installer's target");
    Path::new(target)
        .file_name()
        .and_then(|f| f.to_str())
        .expect("a file name")
        .to_string()
}

/// An init container that copies a Velero plugin into the pod's `plugins` volume (at
/// /target), as `velero plugin add` makes one: the plugin's image, run by the kubelet.
fn is_plugin_copier(container: &Value) -> bool {
    container["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|m| m["name"] == "plugins" && m["mountPath"] == "/target")
        && !is_plugin_installer(container)
}

/// Runs the example's pods (rendered by `kubectl kustomize`, a snapshotter added) on
/// one node and a backup through them.
fn deploy_and_back_up(example: &str) {
    let file = example;
    let mut docs = deploy::rendered(example);
    add_snapshotter(&mut docs);
    // The agent runs its own copy of the plugin opmon's plugin stands in for, from the
    // path the example documents (the Go test plugin plays it): it starts only if the
    // plugin is there and serves the name.
    let plugin_path = enable_velero_plugin_table(&mut docs);
    let plugin_file = velero_plugin_file(&docs);
    assert_eq!(
        Path::new(&plugin_path).file_name().and_then(|f| f.to_str()),
        Some(plugin_file.as_str()),
        "the agent's table names the plugin the installer stands in for"
    );
    let original = velero::test_plugin().to_path_buf();
    let image = deploy::image();
    let templates = deploy::pod_templates(&docs);
    let mut node = Node::new();
    // The DaemonSet's (or sidecar's) pod first: the backup server's pod may need the
    // node directories it creates.
    let mut order: Vec<&(String, &Value)> = templates.iter().collect();
    order.sort_by_key(|(_, spec)| !deploy::containers(spec).into_iter().any(is_agent));
    let pods: Vec<Pod> = order
        .iter()
        .map(|(name, spec)| Pod::new(&mut node, &docs, name, spec))
        .collect();

    let gates = node.fresh_dir("gates");
    chmod(&gates, 0o755);
    let journal_dir = node.fresh_dir("journal");
    chmod(&journal_dir, 0o777);
    let mut running: Vec<Running> = Vec::new();
    let mut agent: Option<(Spec, usize, &Value, &Pod)> = None;
    let mut server: Option<(Spec, &Pod, &Value)> = None;
    for pod in &pods {
        let init: Vec<&Value> = pod.spec["initContainers"]
            .as_array()
            .map(|l| l.iter().collect())
            .unwrap_or_default();
        let main: Vec<&Value> = pod.spec["containers"]
            .as_array()
            .map(|l| l.iter().collect())
            .unwrap_or_default();
        for (container, is_init) in init
            .iter()
            .map(|c| (*c, true))
            .chain(main.iter().map(|c| (*c, false)))
        {
            let name = container["name"].as_str().expect("name");
            let sidecar = is_init && container["restartPolicy"] == "Always";
            if is_agent(container) {
                let mut spec = Spec::of(pod, container, Some(&image));
                spec.mounts.push((
                    workspace_binary("opmon-agent"),
                    "/usr/local/bin/opmon-agent".into(),
                    true,
                ));
                spec.mounts.push((
                    workspace_binary("opmon"),
                    "/usr/local/bin/opmon".into(),
                    true,
                ));
                let argv = argv_of(container, Some(&image));
                let mut process = Running::start(&node, &spec, &argv);
                // The kubelet starts what follows a sidecar once its startup probe
                // passes; a DaemonSet's probes are checked the same way.
                probe_passes(&spec, &mut process, container, "startupProbe");
                // Prometheus scrapes the port the example names `metrics`.
                let port = container["ports"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|p| p["name"] == "metrics")
                    .and_then(|p| p["containerPort"].as_u64())
                    .unwrap_or_else(|| panic!("{name}: the agent has no port named metrics"));
                let url = format!("http://127.0.0.1:{port}/metrics");
                let scrape = spec.exec_in(process.child.id(), &["curl", "-sSf", &url]);
                assert!(
                    scrape.status.success()
                        && String::from_utf8_lossy(&scrape.stdout).contains("opmon_"),
                    "{name}: no metrics at {url} in the pod: {}",
                    String::from_utf8_lossy(&scrape.stderr)
                );
                running.push(process);
                agent = Some((spec, running.len() - 1, container, pod));
                assert!(sidecar || !is_init, "{name}: an init container that exits?");
            } else if is_plugin_installer(container) {
                // opmon's Velero plugin takes the place of the plugin it stands in for,
                // which that plugin's own init container (the user's image, not run
                // here) copied into the volume first: a test binary plays it.
                // (Its place after the plugins' own init containers, and its volumes, are
                // checked over Velero's own install: tests/go/velero/examples.)
                assert!(is_init && !sidecar, "{name}: an installer runs to its end");
                let argv = argv_of(container, Some(&image));
                let target = Path::new(argv.last().expect("the plugin's path"));
                let file = target.file_name().expect("a file name");
                let dir = target
                    .parent()
                    .expect("a directory")
                    .to_str()
                    .expect("utf-8");
                let volume = pod.host_dir(container, dir);
                std::fs::copy(&original, volume.join(file)).expect("the original plugin");
                let mut spec = Spec::of(pod, container, Some(&image));
                let standin = workspace_binary("opmon-velero-plugin");
                spec.mounts.push((
                    standin.clone(),
                    "/usr/local/bin/opmon-velero-plugin".into(),
                    true,
                ));
                run_to_end(&node, &spec, &argv);
                let read =
                    |p: &Path| std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                assert!(
                    read(&volume.join(file)) == read(&standin),
                    "{name}: the stand-in is not in the plugin's place"
                );
                let originals = pod.host_dir(container, "/opmon/plugins");
                assert!(
                    read(&originals.join(file)) == read(&original),
                    "{name}: the original is not in /opmon/plugins"
                );
            } else if is_init
                && is_plugin_copier(container)
                && !init.iter().any(|c| is_plugin_installer(c))
            {
                // The agent's own copy of the original, in a pod of its own (the
                // DaemonSet): the plugin's image copies it as in Velero's pod; the Go
                // test plugin plays it. (Where opmon's installer follows, it copies the
                // original itself, above.)
                let volume = pod.host_dir(container, "/target");
                std::fs::copy(&original, volume.join(&plugin_file))
                    .expect("the agent's copy of the plugin");
            } else if container["image"]
                .as_str()
                .is_some_and(|i| i.starts_with("busybox:"))
            {
                assert!(is_init, "{name}: busybox runs only to prepare the node");
                let spec = Spec::of(pod, container, None);
                run_to_end(&node, &spec, &argv_of(container, None));
            } else if name == "volume-copier" {
                // The snapshotter: the tests' SDK snapshotter on the socket agent.toml
                // names, under this container's user and mounts.
                let (_, _, agent_container, agent_pod) =
                    agent.as_ref().expect("the agent runs first");
                let config = deploy::agent_config(&docs, agent_pod.spec, agent_container);
                let socket = config["snapshotter"][0]["socket"]
                    .as_str()
                    .expect("snapshotter socket")
                    .to_string();
                let mut spec = Spec::of(pod, container, None);
                spec.mounts.push((
                    opmon_tests::test_snapshotter_binary(),
                    "/usr/local/bin/volume-copier".into(),
                    true,
                ));
                spec.mounts.push((gates.clone(), "/gates".into(), true));
                spec.mounts
                    .push((journal_dir.clone(), "/journal".into(), false));
                let argv = vec![
                    "/usr/local/bin/volume-copier".to_string(),
                    socket.clone(),
                    "/gates".into(),
                    "/journal/journal".into(),
                ];
                let process = Running::start(&node, &spec, &argv);
                let host_socket = pod
                    .host_dir(
                        container,
                        Path::new(&socket)
                            .parent()
                            .expect("dir")
                            .to_str()
                            .expect("utf-8"),
                    )
                    .join(Path::new(&socket).file_name().expect("name"));
                let start = Instant::now();
                while !host_socket.exists() {
                    assert!(
                        start.elapsed() < LONG,
                        "the snapshotter never served:\n{}",
                        process.output()
                    );
                    std::thread::sleep(Duration::from_millis(20));
                }
                running.push(process);
            } else if deploy::env_of(container, "OPMON_SOCKET").is_some() {
                let mut spec = Spec::of(pod, container, None);
                // The backup server's opmon client: the CLI in place of Velero.
                spec.mounts.push((
                    workspace_binary("opmon"),
                    "/usr/local/bin/opmon".into(),
                    true,
                ));
                server = Some((spec, pod, container));
            } else {
                eprintln!("{file}: not run: {name} ({})", container["image"]);
            }
        }
    }
    let (agent_spec, agent_index, agent_container, agent_pod) = agent.expect("an agent container");
    let (server_spec, server_pod, server_container) = server.expect("a backup server container");
    for probe in ["readinessProbe", "livenessProbe"] {
        probe_passes(
            &agent_spec,
            &mut running[agent_index],
            agent_container,
            probe,
        );
    }

    // A backup, as the backup server does it (container/README.md): register the
    // operation, leave InProgress, wait, put the tarball in the shared storage, finalize.
    let storage = image.env["OPMON_STORAGE_DIR"].clone();
    let script = |body: &str| vec!["/bin/sh".to_string(), "-euc".to_string(), body.to_string()];
    let out = run_to_end(
        &node,
        &server_spec,
        &script(
            "opmon backup start b1 --uid 3b9c0f5e-8c0e-4a57-9d84-5d8a2c1e7f10\n\
             opmon backup add-operation b1 --plugin example.io/volume-copier \
                 --item persistentvolumeclaims/app/data --operation-id gate-copy-1\n\
             opmon backup end-in-progress b1",
        ),
    );
    assert!(
        out.contains("backup b1 is WaitingForPluginOperations"),
        "{out}"
    );
    std::fs::write(gates.join("gate-copy-1"), b"").expect("gate");
    let out = run_to_end(
        &node,
        &server_spec,
        &script(&format!(
            "opmon backup wait b1 --timeout 60s >/dev/null\n\
             mkdir -p /tmp/b1/resources/persistentvolumeclaims/namespaces/app \"{storage}/velero\"\n\
             echo '{{\"kind\":\"PersistentVolumeClaim\"}}' >/tmp/b1/resources/persistentvolumeclaims/namespaces/app/data.json\n\
             tar -czf \"{storage}/velero/b1.tar.gz\" -C /tmp/b1 resources\n\
             opmon backup finalize b1 --contents-input \"{storage}/velero/b1.tar.gz\" \
                 --contents-output \"{storage}/backups/b1/b1.tar.gz\"\n\
             tar -tzf \"{storage}/backups/b1/b1.tar.gz\"\n\
             gzip -dc \"{storage}/backups/b1/b1-itemoperations.json.gz\"\n\
             opmon -o json backup get b1"
        )),
    );
    assert!(
        out.contains("resources/persistentvolumeclaims/namespaces/app/data.json"),
        "the server reads the finalized tarball: {out}"
    );
    assert!(
        out.contains("\"operationID\":\"gate-copy-1\"")
            || out.contains("\"operationID\": \"gate-copy-1\""),
        "the server reads the item operations: {out}"
    );
    assert!(out.contains("\"phase\": \"Completed\""), "{out}");
    // The results are on the storage volume the agent writes, as the agent's user.
    let results = server_pod
        .host_dir(server_container, &storage)
        .join("backups/b1/b1-itemoperations.json.gz");
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(&results).expect("item operations file");
    assert_eq!(meta.uid(), agent_spec.uid);
    assert!(
        agent_pod.host_dir(agent_container, &storage)
            == server_pod.host_dir(server_container, &storage),
        "agent and server share one storage volume"
    );
    let journal = std::fs::read_to_string(journal_dir.join("journal")).unwrap_or_default();
    assert!(journal.contains("progress gate-copy-1 b1"), "{journal}");
    // Still healthy after the work.
    for probe in ["readinessProbe", "livenessProbe"] {
        probe_passes(
            &agent_spec,
            &mut running[agent_index],
            agent_container,
            probe,
        );
    }
    assert!(
        !running[agent_index].output().contains(" ERROR "),
        "{}",
        running[agent_index].output()
    );
}

#[test]
fn the_native_sidecar_example_runs_and_completes_a_backup() {
    if !opmon_tests::root_or_skip("for mount namespaces and other uids") {
        return;
    }
    deploy_and_back_up("sidecar");
}

#[test]
fn the_daemonset_example_runs_and_completes_a_backup() {
    if !opmon_tests::root_or_skip("for mount namespaces and other uids") {
        return;
    }
    deploy_and_back_up("daemonset");
}
