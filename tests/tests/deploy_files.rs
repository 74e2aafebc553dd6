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
use serde_json::Value;

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

    for file in deploy::MANIFESTS {
        let docs = deploy::manifest(file);
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
                assert_eq!(state_kind, "persistentVolumeClaim", "{file}");
                let claim = &deploy::volume_at(agent_pod, agent, &state_dir).expect("state")
                    ["persistentVolumeClaim"]["claimName"];
                assert!(
                    docs.iter()
                        .any(|d| d["kind"] == "PersistentVolumeClaim"
                            && &d["metadata"]["name"] == claim),
                    "{file}: no PersistentVolumeClaim {claim}"
                );
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
        let snapshotters = config["snapshotter"]
            .as_array()
            .expect("[[snapshotter]] tables");
        assert!(!snapshotters.is_empty(), "{file}: no [[snapshotter]]");
        for s in snapshotters {
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

        // Non-root (but for the DaemonSet's chown step), read-only, least capabilities.
        for (_, pod) in &pods {
            for c in deploy::containers(pod) {
                let cname = &c["name"];
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
