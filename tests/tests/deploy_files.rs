//! The deployment files: the systemd units and snippets (checked with the machine's own
//! systemd tools), and the container image and Kubernetes manifests (checked against
//! each other). `systemd_boot.rs` and `kubernetes.rs` run them for real.
//!
//! Needs `systemd-analyze`, `systemd-sysusers` and `systemd-tmpfiles` (Debian package
//! `systemd`) and `python3` with PyYAML (Debian package `python3-yaml`) to read the
//! manifest.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use opmon_tests::deploy::{self, Image};
use serde_json::{json, Value};

/// The repository root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

fn read(relative: &str) -> String {
    let path = repo().join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs `program args…`, failing the test if it cannot be started at all.
fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .env("SYSTEMD_COLORS", "0")
        .env("SYSTEMD_PAGER", "")
        .env("SYSTEMD_LOG_COLOR", "0")
        .output()
        .unwrap_or_else(|e| panic!("running {program} (Debian package systemd): {e}"))
}

/// Standard output and standard error together, as lines.
fn lines_of(out: &Output) -> Vec<String> {
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push('\n');
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    text.lines()
        .map(str::trim_end)
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

// ---------------------------------------------------------------------------------------
// Unit files

/// A unit file as `section -> [(key, value)]`, in order; comments and blank lines
/// dropped. Continuation lines are refused: the units don't use them.
type Unit = BTreeMap<String, Vec<(String, String)>>;

fn parse_unit(text: &str) -> Unit {
    let mut unit = Unit::new();
    let mut section: Option<String> = None;
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        assert!(
            !line.ends_with('\\'),
            "line {}: continuation lines are not expected",
            n + 1
        );
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = Some(name.to_string());
            unit.entry(name.to_string()).or_default();
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .unwrap_or_else(|| panic!("line {}: no '=' in {line:?}", n + 1));
        let section = section
            .clone()
            .unwrap_or_else(|| panic!("line {}: {line:?} is outside any section", n + 1));
        unit.entry(section)
            .or_default()
            .push((key.trim().to_string(), value.trim().to_string()));
    }
    unit
}

/// Every value of `key` in `section`, in order.
fn values<'a>(unit: &'a Unit, section: &str, key: &str) -> Vec<&'a str> {
    unit.get(section)
        .map(|entries| {
            entries
                .iter()
                .filter(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
                .collect()
        })
        .unwrap_or_default()
}

/// The single value of `key` in `section`.
fn value<'a>(unit: &'a Unit, section: &str, key: &str) -> &'a str {
    let all = values(unit, section, key);
    assert_eq!(
        all.len(),
        1,
        "[{section}] {key}= should be set exactly once: {all:?}"
    );
    all[0]
}

/// All space-separated words of every `key=` line in `section`.
fn words<'a>(unit: &'a Unit, section: &str, key: &str) -> Vec<&'a str> {
    values(unit, section, key)
        .into_iter()
        .flat_map(str::split_whitespace)
        .collect()
}

const SERVICE: &str = "systemd/opmon-agent.service";
const SOCKET: &str = "systemd/opmon-agent.socket";
const INSTALLED_BINARY: &str = "/usr/bin/opmon-agent";

/// Copies both units into a fresh directory, the service's `ExecStart=` pointing at
/// `binary` (the installed path does not exist on a test machine), and `edit` applied
/// to the service's text.
fn units_in_temp_dir(binary: &Path, edit: impl Fn(String) -> String) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temporary directory");
    let service = read(SERVICE);
    let exec_start = format!("ExecStart={INSTALLED_BINARY}");
    assert_eq!(
        service.lines().filter(|l| l.trim() == exec_start).count(),
        1,
        "the service should run {INSTALLED_BINARY} with no arguments"
    );
    let service = service.replace(&exec_start, &format!("ExecStart={}", binary.display()));
    std::fs::write(dir.path().join("opmon-agent.service"), edit(service)).expect("service");
    std::fs::write(dir.path().join("opmon-agent.socket"), read(SOCKET)).expect("socket");
    dir
}

/// `systemd-analyze verify` on both units in `dir`: its exit status and the lines it
/// printed about them (about a unit of ours, or naming the directory).
fn verify(dir: &Path) -> (bool, Vec<String>, Vec<String>) {
    let service = dir.join("opmon-agent.service");
    let socket = dir.join("opmon-agent.socket");
    let out = run(
        "systemd-analyze",
        &[
            "verify",
            "--man=no",
            service.to_str().expect("utf-8 path"),
            socket.to_str().expect("utf-8 path"),
        ],
    );
    let all = lines_of(&out);
    let dir_text = dir.display().to_string();
    let ours = all
        .iter()
        .filter(|l| l.contains("opmon") || l.contains(&dir_text))
        .cloned()
        .collect();
    (out.status.success(), ours, all)
}

#[test]
fn both_units_pass_systemd_analyze_verify() {
    let binary = opmon_tests::workspace_binary("opmon-agent");
    let dir = units_in_temp_dir(&binary, |s| s);
    let (ok, ours, all) = verify(dir.path());
    assert!(
        ours.is_empty(),
        "systemd-analyze verify complains about our units:\n{}",
        ours.join("\n")
    );
    assert!(ok, "systemd-analyze verify failed:\n{}", all.join("\n"));

    // The check above is only worth something if systemd-analyze reports what is wrong
    // with a unit: an unknown directive and a bad value, in a copy of ours.
    let broken = units_in_temp_dir(&binary, |s| {
        s.replacen(
            "[Service]\n",
            "[Service]\nProtectEverything=yes\nRestart=sometimes\n",
            1,
        )
    });
    let (_, ours, all) = verify(broken.path());
    for needle in ["ProtectEverything", "sometimes"] {
        assert!(
            ours.iter().any(|l| l.contains(needle)),
            "systemd-analyze verify did not report the broken {needle}:\n{}",
            all.join("\n")
        );
    }
}

/// The `Overall exposure level` number `systemd-analyze security --offline=true`
/// reports for the service file at `path`.
fn exposure(path: &Path) -> f64 {
    let out = run(
        "systemd-analyze",
        &[
            "security",
            "--offline=true",
            "--no-pager",
            path.to_str().expect("utf-8 path"),
        ],
    );
    let lines = lines_of(&out);
    assert!(
        out.status.success(),
        "systemd-analyze security failed:\n{}",
        lines.join("\n")
    );
    let overall: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("Overall exposure level for"))
        .collect();
    assert_eq!(
        overall.len(),
        1,
        "one overall exposure line expected:\n{}",
        lines.join("\n")
    );
    let (_, rest) = overall[0]
        .rsplit_once(": ")
        .unwrap_or_else(|| panic!("no ': ' in {:?}", overall[0]));
    let number = rest.split_whitespace().next().unwrap_or_default();
    number
        .parse()
        .unwrap_or_else(|e| panic!("{e}: exposure {number:?} in {:?}", overall[0]))
}

#[test]
fn the_service_is_rated_ok_by_systemd_analyze_security() {
    let score = exposure(&repo().join(SERVICE));
    assert!(
        score <= 2.0,
        "exposure {score} is above 2.0 (\"OK\"); see `systemd-analyze security --offline=true {SERVICE}`"
    );

    // The parse and the threshold mean something: the same service without its
    // hardening rates far worse.
    let dir = tempfile::tempdir().expect("temporary directory");
    let bare = dir.path().join("opmon-agent.service");
    std::fs::write(
        &bare,
        "[Unit]\nDescription=bare\n\n[Service]\nType=notify\nExecStart=/usr/bin/opmon-agent\nUser=opmon\n",
    )
    .expect("bare unit");
    let bare_score = exposure(&bare);
    assert!(
        bare_score > 2.0 && bare_score > score,
        "an unhardened service rated {bare_score}, ours {score}"
    );
}

/// The `(type, name)` and the rest of every line of a sysusers/tmpfiles snippet.
fn snippet_lines(text: &str) -> Vec<Vec<String>> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

#[test]
fn units_and_snippets_agree_with_each_other_and_the_agent() {
    let service = parse_unit(&read(SERVICE));
    let socket = parse_unit(&read(SOCKET));
    let socket_name = "opmon-agent.socket";

    // Socket activation, and the service starts alone too (Requires= pulls the socket).
    assert!(words(&service, "Unit", "Requires").contains(&socket_name));
    assert!(words(&service, "Unit", "After").contains(&socket_name));
    assert_eq!(
        values(&socket, "Socket", "Service"),
        ["opmon-agent.service"],
        "the socket activates the agent"
    );
    assert_eq!(value(&socket, "Install", "WantedBy"), "sockets.target");
    assert_eq!(value(&service, "Install", "WantedBy"), "multi-user.target");

    // What the agent does: notify, watchdog, restart.
    assert_eq!(value(&service, "Service", "Type"), "notify");
    assert_eq!(value(&service, "Service", "NotifyAccess"), "main");
    assert_eq!(value(&service, "Service", "WatchdogSec"), "60s");
    assert_eq!(value(&service, "Service", "Restart"), "on-failure");
    // `systemctl reload` is SIGHUP to the agent, with no binary a minimal system lacks.
    assert_eq!(
        value(&service, "Service", "ExecReload"),
        "/bin/sh -c 'kill -HUP $MAINPID'"
    );

    // One user, the one sysusers creates.
    let sysusers = snippet_lines(&read("systemd/opmon.sysusers"));
    let user = value(&service, "Service", "User");
    assert_eq!(user, "opmon");
    assert_eq!(value(&service, "Service", "Group"), user);
    assert_eq!(value(&socket, "Socket", "SocketUser"), user);
    assert_eq!(value(&socket, "Socket", "SocketGroup"), user);
    assert!(
        sysusers
            .iter()
            .any(|l| l.len() >= 2 && l[0] == "u" && l[1] == user),
        "opmon.sysusers should create user {user}: {sysusers:?}"
    );

    // The socket is where the agent looks by default: $RUNTIME_DIRECTORY/agent.sock.
    let listen = PathBuf::from(value(&socket, "Socket", "ListenStream"));
    let runtime = value(&service, "Service", "RuntimeDirectory");
    assert_eq!(listen, Path::new("/run").join(runtime).join("agent.sock"));
    assert_eq!(
        value(&service, "Service", "RuntimeDirectoryPreserve"),
        "yes"
    );
    assert_eq!(value(&socket, "Socket", "SocketMode"), "0660");
    let directory_mode = value(&socket, "Socket", "DirectoryMode");
    assert_eq!(directory_mode, "0750");
    assert_eq!(
        value(&service, "Service", "RuntimeDirectoryMode"),
        directory_mode
    );
    let state = value(&service, "Service", "StateDirectory");
    assert_eq!(state, "opmon");
    assert_eq!(value(&service, "Service", "StateDirectoryMode"), "0700");
    assert_eq!(
        value(&service, "Service", "ConfigurationDirectory"),
        "opmon"
    );

    // tmpfiles makes the same directories, owned by the same user, in the same modes.
    let tmpfiles = snippet_lines(&read("systemd/opmon.tmpfiles"));
    for (path, mode) in [
        (
            listen.parent().expect("socket directory").to_path_buf(),
            directory_mode,
        ),
        (Path::new("/var/lib").join(state), "0700"),
    ] {
        let line = tmpfiles
            .iter()
            .find(|l| l.len() >= 5 && Path::new(&l[1]) == path)
            .unwrap_or_else(|| panic!("opmon.tmpfiles has no line for {}", path.display()));
        assert_eq!(line[0], "d", "{line:?}");
        assert_eq!(line[2], mode, "{line:?}");
        assert_eq!(line[3], user, "{line:?}");
        assert_eq!(line[4], user, "{line:?}");
    }

    // The hardening the issue asks for, by name (the score test checks the rest).
    for (key, expected) in [
        ("ProtectSystem", "strict"),
        ("NoNewPrivileges", "yes"),
        ("PrivateTmp", "yes"),
        ("CapabilityBoundingSet", ""),
        ("SystemCallArchitectures", "native"),
        ("UMask", "0077"),
    ] {
        assert_eq!(value(&service, "Service", key), expected, "{key}=");
    }
    let filters = values(&service, "Service", "SystemCallFilter");
    assert!(filters.contains(&"@system-service"), "{filters:?}");
    assert!(filters.contains(&"~@privileged @resources"), "{filters:?}");
    assert_eq!(
        words(&service, "Service", "RestrictAddressFamilies"),
        ["AF_UNIX"]
    );
}

#[test]
fn sysusers_and_tmpfiles_snippets_create_the_user_and_directories() {
    if !opmon_tests::root_or_skip("for systemd-tmpfiles to chown to the opmon user") {
        return;
    }
    use std::os::unix::fs::MetadataExt;
    let root = tempfile::tempdir().expect("temporary root");
    let r = root.path();
    for (dir, file, text) in [
        (
            "usr/lib/sysusers.d",
            "opmon.conf",
            read("systemd/opmon.sysusers"),
        ),
        (
            "usr/lib/tmpfiles.d",
            "opmon.conf",
            read("systemd/opmon.tmpfiles"),
        ),
    ] {
        std::fs::create_dir_all(r.join(dir)).expect("snippet directory");
        std::fs::write(r.join(dir).join(file), text).expect("snippet");
    }
    std::fs::create_dir_all(r.join("etc")).expect("etc");
    let root_arg = format!("--root={}", r.display());

    let out = run("systemd-sysusers", &[&root_arg]);
    assert!(out.status.success(), "{}", lines_of(&out).join("\n"));
    let passwd = std::fs::read_to_string(r.join("etc/passwd")).expect("passwd");
    let entry: Vec<&str> = passwd
        .lines()
        .find(|l| l.starts_with("opmon:"))
        .unwrap_or_else(|| panic!("no opmon user in {passwd}"))
        .split(':')
        .collect();
    let uid: u32 = entry[2].parse().expect("uid");
    let gid: u32 = entry[3].parse().expect("gid");
    assert!(uid > 0 && uid < 1000, "a system uid, not {uid}");
    let group = std::fs::read_to_string(r.join("etc/group")).expect("group");
    assert!(
        group
            .lines()
            .any(|l| l.starts_with(&format!("opmon:x:{gid}:"))),
        "no opmon group {gid} in {group}"
    );

    let out = run("systemd-tmpfiles", &[&root_arg, "--create"]);
    assert!(out.status.success(), "{}", lines_of(&out).join("\n"));
    for (path, mode) in [("run/opmon", 0o750), ("var/lib/opmon", 0o700)] {
        let meta = std::fs::metadata(r.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(meta.is_dir(), "{path}");
        assert_eq!(meta.mode() & 0o7777, mode, "{path} mode {:o}", meta.mode());
        assert_eq!((meta.uid(), meta.gid()), (uid, gid), "{path} owner");
    }
}

// ---------------------------------------------------------------------------------------
// Container image and Kubernetes manifests

fn str_of<'a>(v: &'a Value, what: &str) -> &'a str {
    v.as_str()
        .unwrap_or_else(|| panic!("{what} should be a string, is {v}"))
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

/// The image: socket, state and storage are volumes; it runs the agent as 65532 from a
/// minimal base.
fn check_image(image: &Image) {
    for key in ["OPMON_SOCKET", "OPMON_STATE_DIR", "OPMON_STORAGE_DIR"] {
        assert!(image.env.contains_key(key), "the Dockerfile sets no {key}");
    }
    let socket = &image.env["OPMON_SOCKET"];
    let socket_dir = Path::new(socket)
        .parent()
        .expect("socket directory")
        .to_str()
        .expect("utf-8");
    for dir in [
        socket_dir,
        image.env["OPMON_STATE_DIR"].as_str(),
        image.env["OPMON_STORAGE_DIR"].as_str(),
    ] {
        assert!(
            image.volumes.iter().any(|v| v == dir),
            "{dir} should be a VOLUME: {:?}",
            image.volumes
        );
    }
    let agent_binary = "/usr/local/bin/opmon-agent";
    let cli_binary = "/usr/local/bin/opmon";
    assert_eq!(image.entrypoint, [agent_binary]);
    for binary in [agent_binary, cli_binary] {
        assert!(
            image.copied.iter().any(|c| c == binary),
            "{binary} is not copied in"
        );
    }
    assert_eq!(image.uid_gid(), (65532, 65532), "USER {}", image.user);
    assert!(
        !image.from.starts_with("rust"),
        "the runtime stage should be a minimal image, not the toolchain: {}",
        image.from
    );
}

/// The volume behind `path` in `container`: `(kind, identity)`, where containers of
/// different pods share a volume only through the same hostPath.
fn volume_identity(pod_name: &str, pod: &Value, container: &Value, path: &str) -> (String, String) {
    let volume = deploy::volume_at(pod, container, path)
        .unwrap_or_else(|| panic!("{} mounts nothing at {path}", container["name"]));
    if let Some(host) = volume["hostPath"]["path"].as_str() {
        return ("hostPath".into(), host.to_string());
    }
    let kind = ["emptyDir", "persistentVolumeClaim", "configMap", "secret"]
        .into_iter()
        .find(|k| !volume[*k].is_null())
        .unwrap_or("other");
    (
        kind.to_string(),
        format!("{pod_name}/{}", str_of(&volume["name"], "volume name")),
    )
}

#[test]
fn the_kubernetes_manifests_match_the_image_and_each_other() {
    let image = deploy::image();
    check_image(&image);
    let socket = image.env["OPMON_SOCKET"].clone();
    let socket_dir = Path::new(&socket)
        .parent()
        .expect("socket dir")
        .to_str()
        .expect("utf-8")
        .to_string();
    let state_dir = image.env["OPMON_STATE_DIR"].clone();
    let storage_dir = image.env["OPMON_STORAGE_DIR"].clone();
    let (agent_uid, agent_gid) = image.uid_gid();

    // Containers of the user's Velero Deployment: the examples patch them, and answer
    // only for what the patch sets.
    let input = deploy::manifest(deploy::VELERO_INPUT);
    let velero_input: Vec<&Value> = deploy::pod_templates(&input)
        .into_iter()
        .flat_map(|(_, pod)| deploy::containers(pod))
        .collect();
    for (file, _) in deploy::EXAMPLES {
        let docs = deploy::rendered(file);
        let pods = deploy::pod_templates(&docs);
        let agents: Vec<(&String, &Value, &Value)> = pods
            .iter()
            .flat_map(|(name, pod)| {
                deploy::containers(pod)
                    .into_iter()
                    .filter(|c| is_agent(c))
                    .map(move |c| (name, *pod, c))
            })
            .collect();
        assert_eq!(agents.len(), 1, "{file}: one agent container expected");
        let (agent_pod_name, agent_pod, agent) = agents[0];
        let workload = docs
            .iter()
            .find(|d| {
                format!(
                    "{}/{}",
                    d["kind"].as_str().unwrap_or("?"),
                    d["metadata"]["name"].as_str().unwrap_or("?")
                ) == *agent_pod_name
            })
            .expect("the agent's workload");
        let name = &agent["name"];

        // The agent's environment: only settings, the image's paths.
        let vars = agent["env"].as_array().cloned().unwrap_or_default();
        opmon_agent::config::check_environment(vars.iter().map(|v| {
            (
                str_of(&v["name"], "env name").into(),
                v["value"].as_str().unwrap_or_default().into(),
            )
        }))
        .unwrap_or_else(|e| panic!("{file}: {e}"));
        for key in ["OPMON_SOCKET", "OPMON_STATE_DIR", "OPMON_STORAGE_DIR"] {
            if let Some(value) = deploy::env_of(agent, key) {
                assert_eq!(value, image.env[key], "{file}: {name} {key}");
            }
        }

        // Where the agent's things live: a sidecar's socket on an emptyDir and its
        // database on the manifest's PVC (one pod at a time); a DaemonSet's on the node.
        let (socket_kind, socket_volume) =
            volume_identity(agent_pod_name, agent_pod, agent, &socket_dir);
        let (state_kind, _) = volume_identity(agent_pod_name, agent_pod, agent, &state_dir);
        let (_, storage_volume) = volume_identity(agent_pod_name, agent_pod, agent, &storage_dir);
        match workload["kind"].as_str() {
            Some("DaemonSet") => {
                assert_eq!(socket_kind, "hostPath", "{file}");
                assert_eq!(state_kind, "hostPath", "{file}");
            }
            Some("Deployment") => {
                assert_eq!(socket_kind, "emptyDir", "{file}");
                if state_kind == "emptyDir" {
                    // Only with Litestream replicating it (litestream.rs checks how).
                    let (_, state_volume) =
                        volume_identity(agent_pod_name, agent_pod, agent, &state_dir);
                    assert!(
                        deploy::containers(agent_pod).into_iter().any(|c| {
                            c["name"] == "litestream"
                                && c["restartPolicy"] == "Always"
                                && volume_identity(agent_pod_name, agent_pod, c, &state_dir).1
                                    == state_volume
                        }),
                        "{file}: a database on an emptyDir with no Litestream sidecar"
                    );
                } else {
                    assert_eq!(state_kind, "persistentVolumeClaim", "{file}");
                    let claim = &deploy::volume_at(agent_pod, agent, &state_dir).expect("state")
                        ["persistentVolumeClaim"]["claimName"];
                    assert!(
                        docs.iter().any(|d| d["kind"] == "PersistentVolumeClaim"
                            && &d["metadata"]["name"] == claim),
                        "{file}: no PersistentVolumeClaim {claim}"
                    );
                }
                assert_eq!(workload["spec"]["replicas"], 1, "{file}");
                assert_eq!(workload["spec"]["strategy"]["type"], "Recreate", "{file}");
                // A native sidecar.
                let init = agent_pod["initContainers"]
                    .as_array()
                    .expect("initContainers");
                assert!(
                    init.iter().any(|c| c == agent),
                    "{file}: the sidecar is an init container"
                );
                assert_eq!(agent["restartPolicy"], "Always", "{file}: a native sidecar");
            }
            other => panic!("{file}: the agent runs in a {other:?}"),
        }

        // Probes run `opmon status`, the CLI of the image (OPMON_SOCKET finds the agent).
        for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
            let command: Vec<&str> = agent[probe]["exec"]["command"]
                .as_array()
                .unwrap_or_else(|| panic!("{file}: {name} has no exec {probe}"))
                .iter()
                .map(|c| str_of(c, probe))
                .collect();
            assert_eq!(
                command,
                ["/usr/local/bin/opmon", "status"],
                "{file}: {probe}"
            );
        }

        // The config file: snapshotters whose sockets are in a volume the agent and the
        // snapshotter's container share.
        let config = deploy::agent_config(&docs, agent_pod, agent);
        let allowed: Vec<u64> = config["allowed_uids"]
            .as_array()
            .map(|l| l.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        // The examples ship no snapshotter (yours owns your plugin's operations), but a
        // volume where the ones you add serve.
        assert!(
            deploy::volume_at(agent_pod, agent, "/run/opmon-snapshotters").is_some(),
            "{file}: the agent mounts no /run/opmon-snapshotters for snapshotters"
        );
        let snapshotters = config["snapshotter"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        for s in &snapshotters {
            let socket = Path::new(str_of(&s["socket"], "snapshotter socket"));
            let dir = socket.parent().expect("dir").to_str().expect("utf-8");
            let (_, theirs) = volume_identity(agent_pod_name, agent_pod, agent, dir);
            let served = deploy::containers(agent_pod).into_iter().any(|c| {
                !is_agent(c)
                    && deploy::volume_at(agent_pod, c, dir).is_some()
                    && volume_identity(agent_pod_name, agent_pod, c, dir).1 == theirs
            });
            assert!(served, "{file}: no container serves {}", socket.display());
        }

        // Backup servers: told OPMON_SOCKET, mount the agent's socket and storage
        // volumes at the same paths, run as an allowed uid with the agent's group.
        let mut servers = 0;
        for (pod_name, pod) in &pods {
            for c in deploy::containers(pod) {
                if is_agent(c) || deploy::env_of(c, "OPMON_SOCKET").is_none() {
                    continue;
                }
                servers += 1;
                let cname = &c["name"];
                assert_eq!(
                    deploy::env_of(c, "OPMON_SOCKET"),
                    Some(socket.as_str()),
                    "{file}: {cname}"
                );
                assert_eq!(
                    volume_identity(pod_name, pod, c, &socket_dir).1,
                    socket_volume,
                    "{file}: {cname} must mount the agent's socket volume at {socket_dir}"
                );
                assert_eq!(
                    volume_identity(pod_name, pod, c, &storage_dir).1,
                    storage_volume,
                    "{file}: {cname} must mount the agent's storage at {storage_dir}"
                );
                let uid = deploy::security(pod, c, "runAsUser")
                    .as_u64()
                    .unwrap_or_else(|| panic!("{file}: {cname} has no runAsUser"));
                assert!(
                    uid == u64::from(agent_uid) || uid == 0 || allowed.contains(&uid),
                    "{file}: {cname} runs as {uid}, which allowed_uids {allowed:?} does not let in"
                );
                let mut groups: Vec<u64> = pod["securityContext"]["supplementalGroups"]
                    .as_array()
                    .map(|l| l.iter().filter_map(Value::as_u64).collect())
                    .unwrap_or_default();
                groups.extend(pod["securityContext"]["fsGroup"].as_u64());
                groups.extend(deploy::security(pod, c, "runAsGroup").as_u64());
                assert!(
                    groups.contains(&u64::from(agent_gid)),
                    "{file}: {cname} is not in group {agent_gid}, which the socket needs"
                );
            }
        }
        assert!(servers > 0, "{file}: no backup server is told OPMON_SOCKET");

        // Non-root (but for the DaemonSet's chown step), read-only, least capabilities:
        // every container the examples add.
        for (_, pod) in &pods {
            for c in deploy::containers(pod) {
                let cname = &c["name"];
                if velero_input.iter().any(|v| v["name"] == *cname) {
                    continue;
                }
                let sc = &c["securityContext"];
                assert_eq!(sc["readOnlyRootFilesystem"], true, "{file}: {cname}");
                assert_eq!(sc["allowPrivilegeEscalation"], false, "{file}: {cname}");
                let drop = sc["capabilities"]["drop"]
                    .as_array()
                    .expect("capabilities.drop");
                assert!(drop.iter().any(|c| c == "ALL"), "{file}: {cname} drops ALL");
                if deploy::security(pod, c, "runAsUser") == 0 {
                    let added: Vec<&str> = sc["capabilities"]["add"]
                        .as_array()
                        .map(|l| l.iter().filter_map(Value::as_str).collect())
                        .unwrap_or_default();
                    assert_eq!(added, ["CHOWN", "FOWNER"], "{file}: {cname} runs as root");
                    assert!(
                        pod["containers"].as_array().is_none_or(|l| !l.contains(c)),
                        "{file}: only an init container may run as root"
                    );
                } else {
                    assert_eq!(
                        deploy::security(pod, c, "runAsNonRoot"),
                        true,
                        "{file}: {cname}"
                    );
                    assert!(sc["capabilities"]["add"].is_null(), "{file}: {cname}");
                }
            }
        }
        assert_eq!(
            deploy::security(agent_pod, agent, "runAsUser").as_u64(),
            Some(u64::from(agent_uid)),
            "{file}: the agent runs as the image's user"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Build and install lines, as printed

/// `cargo metadata --locked` of the workspace: it fails as `cargo build --locked` would
/// when `Cargo.lock` is out of date.
fn cargo_metadata() -> Value {
    cargo_metadata_in(&repo())
}

/// [`cargo_metadata`] of the workspace at `root`.
fn cargo_metadata_in(root: &Path) -> Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(&cargo)
        .args(["metadata", "--format-version", "1", "--locked"])
        .current_dir(root)
        .output()
        .unwrap_or_else(|e| panic!("running {cargo} metadata: {e}"));
    assert!(
        out.status.success(),
        "cargo metadata --locked failed (so would a --locked build):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("cargo metadata JSON")
}

/// The binaries a `cargo build …` line builds, resolved with `cargo metadata` (which
/// package provides which binary): running the release build itself would take minutes
/// of two shared cores for what the metadata answers exactly. `--locked` is honoured:
/// metadata fails as the build would when `Cargo.lock` is out of date.
fn binaries_built_by(line: &str) -> Vec<String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        words[..2],
        ["cargo", "build"],
        "not a cargo build line: {line}"
    );
    let mut packages: Vec<&str> = Vec::new();
    let mut bins: Vec<&str> = Vec::new();
    let mut all_bins = false;
    let mut release = false;
    let mut locked = false;
    let mut rest = words[2..].iter();
    while let Some(word) = rest.next() {
        match *word {
            "-p" | "--package" => packages.push(rest.next().expect("a package after -p")),
            "--bin" => bins.push(rest.next().expect("a binary after --bin")),
            "--bins" => all_bins = true,
            "--release" => release = true,
            "--locked" => locked = true,
            // Anything else could change what is built: the test must learn it first.
            other => panic!("{line}: the test does not know what {other:?} builds"),
        }
    }
    assert!(release, "{line}: the install lines take target/release/");
    assert!(locked, "{line}: builds what Cargo.lock pins");
    assert!(
        !packages.is_empty(),
        "{line}: name the packages (the workspace holds tests and benchmarks too)"
    );
    let metadata = cargo_metadata();
    let members: Vec<&Value> = metadata["workspace_members"]
        .as_array()
        .expect("workspace_members")
        .iter()
        .collect();
    let mut built = Vec::new();
    for package in packages {
        let found = metadata["packages"]
            .as_array()
            .expect("packages")
            .iter()
            .find(|p| p["name"] == package && members.contains(&&p["id"]))
            .unwrap_or_else(|| panic!("{line}: no workspace package {package}"));
        let targets: Vec<&Value> = found["targets"]
            .as_array()
            .expect("targets")
            .iter()
            .filter(|t| {
                t["kind"]
                    .as_array()
                    .is_some_and(|k| k.iter().any(|k| k == "bin"))
            })
            .collect();
        if all_bins {
            for t in &targets {
                // `--bins` skips a binary whose required features are off.
                if t["required-features"].as_array().is_none_or(Vec::is_empty) {
                    built.push(str_of(&t["name"], "binary name").to_string());
                }
            }
        }
        for bin in &bins {
            if targets.iter().any(|t| t["name"] == *bin) {
                built.push(bin.to_string());
            }
        }
    }
    for bin in bins {
        assert!(
            built.iter().any(|b| b == bin),
            "{line}: no package named builds {bin}"
        );
    }
    assert!(
        !all_bins || !built.is_empty(),
        "{line}: --bins builds nothing"
    );
    built
}

/// Shell lines with their continuations joined.
fn joined_lines(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut current = String::new();
    for raw in text.lines() {
        let line = raw.trim();
        if let Some(head) = line.strip_suffix('\\') {
            current.push_str(head);
            current.push(' ');
            continue;
        }
        current.push_str(line);
        lines.push(std::mem::take(&mut current));
    }
    lines
}

/// `(source, destination)` of every `install` of a file (not `install -d`) in `text`.
fn installs(text: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for line in joined_lines(text) {
        for command in line.split("&&") {
            let words: Vec<&str> = command
                .split_whitespace()
                .skip_while(|w| *w == "RUN" || w.starts_with("--mount"))
                .collect();
            if words.first() != Some(&"install") {
                continue;
            }
            let args = &words[1..];
            if args.iter().any(|w| *w == "-d" || w.starts_with("-d")) {
                continue;
            }
            let mut operands = Vec::new();
            let mut it = args.iter();
            while let Some(w) = it.next() {
                if *w == "-m" || *w == "-o" || *w == "-g" {
                    it.next();
                } else if w.starts_with('#') {
                    break;
                } else if !w.starts_with('-') {
                    operands.push(w.to_string());
                }
            }
            assert_eq!(operands.len(), 2, "install with one source: {command}");
            found.push((operands[0].clone(), operands[1].clone()));
        }
    }
    found
}

/// The `cargo build` line of `text`: exactly one.
fn cargo_build_line(text: &str, what: &str) -> String {
    let lines: Vec<String> = joined_lines(text)
        .into_iter()
        .flat_map(|l| {
            l.split("&&")
                .map(|c| c.trim().to_string())
                .collect::<Vec<_>>()
        })
        .filter_map(|c| c.find("cargo build").map(|at| c[at..].trim().to_string()))
        .collect();
    assert_eq!(
        lines.len(),
        1,
        "{what}: one cargo build line expected: {lines:?}"
    );
    lines[0].clone()
}

/// Every `target/release/NAME` an install line takes must be a binary the printed build
/// line builds.
fn check_installed_binaries(what: &str, build: &str, installs: &[(String, String)]) {
    let built = binaries_built_by(build);
    let mut checked = 0;
    for (source, destination) in installs {
        if let Some(name) = source.strip_prefix("target/release/") {
            assert!(
                built.iter().any(|b| b == name),
                "{what}: installs {source} to {destination}, but `{build}` builds only {built:?}"
            );
            checked += 1;
        }
    }
    assert!(checked > 0, "{what}: installs no binary");
}

/// The lines of the fenced code blocks of a Markdown text.
fn code_blocks(markdown: &str) -> String {
    let mut code = String::new();
    let mut inside = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            inside = !inside;
        } else if inside {
            code.push_str(line);
            code.push('\n');
        }
    }
    code
}

#[test]
fn the_systemd_install_lines_install_what_the_printed_build_builds() {
    let text = code_blocks(&read("systemd/README.md"));
    let build = cargo_build_line(&text, "systemd/README.md");
    let installed = installs(&text);
    check_installed_binaries("systemd/README.md", &build, &installed);
    // The binaries go where the units and the README's commands run them.
    for binary in ["/usr/bin/opmon-agent", "/usr/bin/opmon"] {
        assert!(
            installed.iter().any(|(_, d)| d == binary),
            "systemd/README.md installs nothing at {binary}"
        );
    }
    // Every repository file an install line takes exists.
    for (source, _) in &installed {
        if !source.starts_with("target/") {
            assert!(
                repo().join(source).is_file(),
                "systemd/README.md installs missing {source}"
            );
        }
    }

    // The check means something: the line as it was before opmon moved to opmon-cli.
    let old = build.replace("-p opmon-cli", "-p opmon-client");
    let refused = std::panic::catch_unwind(|| check_installed_binaries("old", &old, &installed));
    assert!(
        refused.is_err(),
        "`{old}` builds no opmon, yet the check passed"
    );
}

/// The builder stage of the Dockerfile builds every binary the runtime stage copies,
/// and the build context holds every workspace member `cargo build --locked` needs.
#[test]
fn the_dockerfile_builds_every_binary_it_copies() {
    let text = read("container/Dockerfile");
    let build = cargo_build_line(&text, "container/Dockerfile");
    // The stand-in runs in Velero's image: the image's is linked statically, as the one
    // CI runs in an empty root (tests/go/velero/layout) is.
    let static_link =
        "cargo rustc -p opmon-agent --bin opmon-velero-plugin -- -C target-feature=+crt-static";
    assert!(
        read(".ci/run").contains(static_link),
        ".ci/run links the stand-in statically: {static_link}"
    );
    assert!(
        joined_lines(&text)
            .iter()
            .any(|l| l
                .contains(&static_link.replace("cargo rustc ", "cargo rustc --release --locked "))),
        "container/Dockerfile links the stand-in it copies as CI does: {static_link}"
    );
    let installed = installs(&text);
    check_installed_binaries("container/Dockerfile", &build, &installed);

    // Directories the builder makes (`install -d`), and the files it installs.
    let mut made: Vec<String> = installed.iter().map(|(_, d)| d.clone()).collect();
    for line in joined_lines(&text) {
        for command in line.split("&&") {
            let words: Vec<&str> = command.split_whitespace().collect();
            if words.contains(&"install") && words.contains(&"-d") {
                made.extend(
                    words
                        .iter()
                        .filter(|w| w.starts_with('/'))
                        .map(|w| w.to_string()),
                );
            }
        }
    }
    let image = deploy::image();
    let mut copies_from_builder = 0;
    for line in joined_lines(&text) {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.first().map(|w| w.to_uppercase()) != Some("COPY".into()) {
            continue;
        }
        let operands: Vec<&str> = words[1..]
            .iter()
            .copied()
            .filter(|w| !w.starts_with("--"))
            .collect();
        let (sources, _) = operands.split_at(operands.len() - 1);
        if words.contains(&"--from=builder") {
            for source in sources {
                let dir = source.trim_end_matches('/');
                assert!(
                    made.iter()
                        .any(|m| m == dir || m.starts_with(&format!("{dir}/"))),
                    "COPY --from=builder {source}: the builder stage makes no such path ({made:?})"
                );
                copies_from_builder += 1;
            }
        } else {
            for source in sources {
                assert!(
                    repo().join(source).exists(),
                    "COPY {source}: not in the repository"
                );
            }
        }
    }
    assert!(
        copies_from_builder > 0,
        "the runtime stage copies nothing from the builder"
    );
    // What the runtime stage runs and the manifests exec is copied in, from the builder's
    // release binaries.
    for (source, destination) in &installed {
        if source.starts_with("target/release/") {
            let in_image = destination.trim_start_matches("/out");
            assert!(
                image.copied.iter().any(|c| c == in_image),
                "the runtime stage does not copy {in_image}"
            );
        }
    }

    // The context: .dockerignore must not drop a workspace member (cargo refuses a
    // workspace whose member is missing) or Cargo.lock.
    let ignore = read("container/Dockerfile.dockerignore");
    let patterns: Vec<&str> = ignore
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let ignored = |path: &str| {
        patterns.iter().any(|p| {
            assert!(
                !p.starts_with('!') && !p.trim_start_matches("**/").contains(['*', '?', '[']),
                "the test reads only `dir/` and `**/dir/` patterns, not {p:?}"
            );
            let dir = p.trim_start_matches("**/").trim_end_matches('/');
            let path = format!("{path}/");
            if p.starts_with("**/") {
                path.split('/').any(|component| component == dir)
            } else {
                path.starts_with(&format!("{dir}/"))
            }
        })
    };
    let metadata = cargo_metadata();
    let root = repo();
    let mut members = 0;
    for package in metadata["packages"].as_array().expect("packages") {
        let manifest = Path::new(str_of(&package["manifest_path"], "manifest_path"));
        let Ok(member) = manifest.parent().expect("package dir").strip_prefix(&root) else {
            continue; // a dependency
        };
        let member = member.to_str().expect("utf-8");
        assert!(
            !ignored(member),
            "the Dockerfile's context leaves out member {member}"
        );
        members += 1;
    }
    assert!(members >= 4, "the workspace's members were not found");
    // The context as Docker sends it (the repository less what is ignored) is a
    // workspace cargo loads, with the packages the build line names.
    let context = tempfile::tempdir().expect("context directory");
    let mut stack = vec![PathBuf::new()];
    while let Some(relative) = stack.pop() {
        for entry in std::fs::read_dir(root.join(&relative)).expect("read_dir") {
            let entry = entry.expect("entry");
            let path = relative.join(entry.file_name());
            let text = path.to_str().expect("utf-8");
            if ignored(text) {
                continue;
            }
            if entry.file_type().expect("file type").is_dir() {
                std::fs::create_dir(context.path().join(&path)).expect("mkdir");
                stack.push(path);
            } else if entry.file_type().expect("file type").is_file() {
                std::fs::copy(entry.path(), context.path().join(&path)).expect("copy");
            }
        }
    }
    let in_context = cargo_metadata_in(context.path());
    let words: Vec<&str> = build.split_whitespace().collect();
    for package in words.windows(2).filter(|w| w[0] == "-p").map(|w| w[1]) {
        assert!(
            in_context["packages"]
                .as_array()
                .expect("packages")
                .iter()
                .any(|p| p["name"] == package),
            "the build context has no {package}"
        );
    }
    assert!(!ignored("Cargo.lock"));
    assert!(
        ignored("target") && ignored("agent/target"),
        "target/ stays out of the context"
    );
}

// ---------------------------------------------------------------------------------------
// The Kubernetes examples as kustomize overlays

/// Whether `inner` is found in `outer`: every key of an object with a value found in
/// `outer`'s, every element of a list found in some element of `outer`'s.
fn found_in(inner: &Value, outer: &Value) -> bool {
    match (inner, outer) {
        (Value::Object(i), Value::Object(o)) => i
            .iter()
            .all(|(k, v)| o.get(k).is_some_and(|w| found_in(v, w))),
        (Value::Array(i), Value::Array(o)) => i.iter().all(|v| o.iter().any(|w| found_in(v, w))),
        _ => inner == outer,
    }
}

/// Every YAML file shipped under `container/kubernetes`, relative to the repository.
fn shipped_yaml() -> Vec<String> {
    let mut files = Vec::new();
    let root = repo().join("container/kubernetes");
    let mut dirs = vec![root];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("container/kubernetes") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                let relative = path.strip_prefix(repo()).expect("in the repository");
                files.push(relative.to_str().expect("utf-8").to_string());
            }
        }
    }
    files.sort();
    files
}

/// No example carries a Velero Deployment of its own (applying one would replace the
/// cluster's): what they ship for Velero is a strategic-merge patch, and what they render
/// over a Velero Deployment keeps all of it.
#[test]
fn the_examples_patch_an_existing_velero_and_ship_none() {
    for file in shipped_yaml() {
        for doc in deploy::manifest(&file) {
            if doc["kind"] == "Deployment" || doc["kind"] == "StatefulSet" {
                assert!(
                    doc["spec"]["selector"].is_null(),
                    "{file} holds a whole {} {} (it has a selector): ship a patch",
                    doc["kind"],
                    doc["metadata"]["name"]
                );
            }
        }
    }
    let input = deploy::manifest(deploy::VELERO_INPUT);
    let mut velero_input = input
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("the Velero input's Deployment")
        .clone();
    // The one thing the sidecar overlays replace: one agent per database.
    velero_input["spec"]
        .as_object_mut()
        .expect("spec")
        .remove("strategy");
    for (example, _) in deploy::EXAMPLES {
        let docs = deploy::rendered(example);
        let deployments: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "Deployment").collect();
        assert_eq!(deployments.len(), 1, "{example}: the one Velero Deployment");
        assert!(
            found_in(&velero_input, deployments[0]),
            "{example}: the rendered Velero Deployment lost some of the input's:\n{}",
            serde_json::to_string_pretty(deployments[0]).expect("JSON")
        );
        if deploy::pod_templates(&docs).iter().any(|(name, pod)| {
            name == "Deployment/velero" && deploy::containers(pod).into_iter().any(is_agent)
        }) {
            assert_eq!(
                deployments[0]["spec"]["strategy"]["type"], "Recreate",
                "{example}"
            );
            assert!(
                deployments[0]["spec"]["strategy"]["rollingUpdate"].is_null(),
                "{example}: Recreate takes no rollingUpdate"
            );
        }
    }
}

/// Velero 1.14 takes every restore through Finalizing: the agent must expect it.
#[test]
fn every_example_sets_restore_finalize_for_velero_1_14() {
    for (example, _) in deploy::EXAMPLES {
        let docs = deploy::rendered(example);
        let (_, pod) = deploy::pod_templates(&docs)
            .into_iter()
            .find(|(_, pod)| deploy::containers(pod).into_iter().any(is_agent))
            .expect("the agent's pod");
        let agent = deploy::containers(pod)
            .into_iter()
            .find(|c| is_agent(c))
            .expect("agent");
        let config = deploy::agent_config(&docs, pod, agent);
        assert_eq!(
            config["restore_finalize"], true,
            "{example}: agent.toml should set restore_finalize = true (Velero 1.14)"
        );
    }
    let input = deploy::manifest(deploy::VELERO_INPUT);
    let image = input
        .iter()
        .flat_map(|d| deploy::containers(&d["spec"]["template"]["spec"]))
        .find(|c| c["name"] == "velero")
        .and_then(|c| c["image"].as_str())
        .expect("the input's Velero image");
    // A Velero that takes restores through Finalizing: 1.14 or later.
    let minor: u32 = image
        .strip_prefix("velero/velero:v1.")
        .and_then(|v| v.split('.').next())
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("the input's Velero image {image}"));
    assert!(minor >= 14, "{image}");
}

/// The Litestream replica's settings are an input the example cannot render without,
/// named in the error; nothing shipped pretends to be a credential.
#[test]
fn the_litestream_replica_is_a_required_input() {
    let tree = deploy::kubernetes_tree(true);
    let (ok, _, err) = deploy::kustomize(&tree.path().join("sidecar-litestream"));
    assert!(!ok, "rendered with no replica.env");
    assert!(
        err.contains("replica.env"),
        "the error should name replica.env: {err}"
    );

    let docs = deploy::rendered("sidecar-litestream");
    let secret = docs
        .iter()
        .find(|d| d["kind"] == "Secret")
        .expect("the generated Secret");
    let name = str_of(&secret["metadata"]["name"], "secret name");
    for line in deploy::TEST_REPLICA_ENV.lines() {
        let (key, _) = line.split_once('=').expect("NAME=value");
        assert!(!secret["data"][key].is_null(), "the Secret lacks {key}");
    }
    let (_, pod) = deploy::pod_templates(&docs)
        .into_iter()
        .find(|(n, _)| n == "Deployment/velero")
        .expect("Velero's pod");
    for c in deploy::containers(pod) {
        for source in c["envFrom"].as_array().into_iter().flatten() {
            assert_eq!(source["secretRef"]["name"], name, "{}", c["name"]);
        }
    }
    for file in shipped_yaml() {
        let text = read(&file);
        for word in ["replace-me", "changeme", "my-velero-bucket"] {
            assert!(
                !text.contains(word),
                "{file} ships the placeholder {word:?}"
            );
        }
    }
}

/// Every image an example runs has its source here (the agent's, `container/Dockerfile`),
/// is a published upstream image, or is the user's own (their Velero Deployment's).
#[test]
fn no_example_references_an_image_without_source_in_the_repository() {
    const UPSTREAM: &[&str] = &["busybox:", "litestream/litestream:"];
    let input = deploy::manifest(deploy::VELERO_INPUT);
    let theirs: Vec<&str> = input
        .iter()
        .flat_map(|d| deploy::containers(&d["spec"]["template"]["spec"]))
        .filter_map(|c| c["image"].as_str())
        .collect();
    for (example, _) in deploy::EXAMPLES {
        for (_, pod) in deploy::pod_templates(&deploy::rendered(example)) {
            for c in deploy::containers(pod) {
                let image = str_of(&c["image"], "image");
                assert!(
                    image.starts_with(deploy::AGENT_IMAGE_PREFIX)
                        || UPSTREAM.iter().any(|u| image.starts_with(u))
                        || theirs.contains(&image),
                    "{example}: {} runs {image}, whose source is not in the repository",
                    c["name"]
                );
            }
        }
    }
}

/// The deployment pages' shell blocks: each parses (`bash -n`); every directory
/// `kubectl apply -k` takes is an example; every file they write into an example is an
/// input its kustomization reads; every Dockerfile they build exists. (Applying them
/// needs a cluster; the examples' rendering is checked above.)
#[test]
fn the_printed_deployment_commands_name_what_the_repository_holds() {
    let mut applied = Vec::new();
    for page in ["container/README.md", "systemd/README.md"] {
        let markdown = read(page);
        let mut blocks: Vec<String> = Vec::new();
        let mut current: Option<String> = None;
        for line in markdown.lines() {
            match (&mut current, line.trim_start()) {
                (None, "```sh") => current = Some(String::new()),
                (Some(block), "```") => {
                    blocks.push(std::mem::take(block));
                    current = None;
                }
                (Some(block), _) => {
                    block.push_str(line);
                    block.push('\n');
                }
                (None, _) => {}
            }
        }
        assert!(!blocks.is_empty(), "{page} has no sh blocks");
        for block in &blocks {
            let out = Command::new("bash")
                .args(["-n", "-c", block])
                .output()
                .expect("bash");
            assert!(
                out.status.success(),
                "{page}: a block does not parse:\n{block}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            for line in joined_lines(block) {
                let words: Vec<&str> = line.split_whitespace().collect();
                if let Some(at) = words.windows(2).position(|w| w == ["apply", "-k"]) {
                    let dir = words[at + 2];
                    assert!(
                        repo().join(dir).join("kustomization.yaml").is_file(),
                        "{page}: kubectl apply -k {dir}: no kustomization there"
                    );
                    applied.push(dir.to_string());
                }
                if let Some(at) = words.iter().position(|w| *w == "-f") {
                    if words.contains(&"build") {
                        assert!(repo().join(words[at + 1]).is_file(), "{page}: {line}");
                    }
                }
                for word in &words {
                    let Some(target) = word.strip_prefix('>') else {
                        continue;
                    };
                    if let Some(rest) = target.strip_prefix("container/kubernetes/") {
                        let (dir, file) = rest.split_once('/').expect("dir/file");
                        let kustomization =
                            read(&format!("container/kubernetes/{dir}/kustomization.yaml"));
                        assert!(
                            kustomization.contains(file),
                            "{page}: writes {target}, which {dir}/kustomization.yaml does not read"
                        );
                    }
                }
            }
        }
    }
    // Every example is shown being applied.
    for (example, dirs) in deploy::EXAMPLES {
        for dir in *dirs {
            let path = format!("container/kubernetes/{dir}");
            assert!(
                applied.contains(&path),
                "container/README.md never applies {path} (example {example})"
            );
        }
    }
}
