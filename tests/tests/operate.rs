//! End-to-end: running the agent the way operators do — systemd socket activation and
//! notifications, peer-credential access control, layered configuration, metrics and
//! JSON logs.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use opmon_client::Client;
use opmon_tests::{agent_command, without_opmon_env, workspace_binary, Agent};

const LONG: Duration = Duration::from_secs(60);

fn curl(socket: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "--unix-socket"]).arg(socket).args(args);
    cmd
}

fn status_request(socket: &Path) -> Command {
    curl(
        socket,
        &[
            "http://localhost/",
            "-H",
            "content-type: application/json",
            "-d",
            r#"{"jsonrpc":"2.0","id":1,"method":"agent.status"}"#,
        ],
    )
}

#[test]
fn readiness_and_watchdog_reach_the_notify_socket() {
    let dir = tempfile::tempdir().unwrap();
    let notify = dir.path().join("notify.sock");
    let receiver = UnixDatagram::bind(&notify).unwrap();
    receiver.set_read_timeout(Some(LONG)).unwrap();
    // systemd names the watched process in WATCHDOG_PID; `exec` keeps the shell's pid.
    let mut agent = without_opmon_env(&mut Command::new("sh"))
        .arg("-c")
        .arg(r#"WATCHDOG_PID=$$ exec "$0" "$@""#)
        .arg(workspace_binary("opmon-agent"))
        .arg("--socket")
        .arg(dir.path().join("agent.sock"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env("OPMON_CONFIG", "/dev/null")
        .env("NOTIFY_SOCKET", &notify)
        .env("WATCHDOG_USEC", "200000")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let start = Instant::now();
    while !(seen.iter().any(|m: &String| m.contains("READY=1"))
        && seen.iter().filter(|m| m.contains("WATCHDOG=1")).count() >= 2)
    {
        assert!(
            start.elapsed() < LONG,
            "no READY=1 and WATCHDOG=1 pings: {seen:?}"
        );
        let n = receiver
            .recv(&mut buf)
            .expect("a notification before the timeout");
        seen.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    let status = seen
        .iter()
        .find(|m| m.contains("STATUS="))
        .expect("a STATUS line");
    assert!(status.contains("0 unfinished operations"), "{status}");
    // Ready means ready: the socket answers now.
    assert!(std::os::unix::net::UnixStream::connect(dir.path().join("agent.sock")).is_ok());
    let _ = agent.kill();
    let _ = agent.wait();
}

#[test]
fn the_agent_serves_on_a_socket_passed_by_systemd() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("activated.sock");
    let log = std::fs::File::create(dir.path().join("activate.log")).unwrap();
    let mut activator = without_opmon_env(&mut Command::new("systemd-socket-activate"))
        .arg("-l")
        .arg(&socket)
        .arg(workspace_binary("opmon-agent"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        // A socket path that is never bound: the passed socket must be used instead.
        .arg("--socket")
        .arg(dir.path().join("unused.sock"))
        .env("OPMON_CONFIG", "/dev/null")
        .stderr(log)
        .spawn()
        .expect("systemd-socket-activate (Debian package systemd)");
    let start = Instant::now();
    while !socket.exists() {
        assert!(
            start.elapsed() < LONG,
            "systemd-socket-activate never listened"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = status_request(&socket).output().unwrap();
    let _ = activator.kill();
    let _ = activator.wait();
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(answer["result"]["unfinishedOperations"], 0);
    assert!(!dir.path().join("unused.sock").exists());
    let text = std::fs::read_to_string(dir.path().join("activate.log")).unwrap();
    assert!(
        text.contains("serving on the socket passed by systemd"),
        "{text}"
    );
}

/// Runs curl as the unprivileged `nobody` (uid 65534) against `socket`.
fn status_as_nobody(socket: &Path) -> std::process::Output {
    let mut cmd = status_request(socket);
    cmd.uid(65534).gid(65534);
    cmd.output().unwrap()
}

#[tokio::test]
async fn peers_are_admitted_or_refused_by_their_credentials() {
    if !opmon_tests::root_or_skip("to run a client as another uid") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Let `nobody` reach the socket file: the credential check is what must stop it.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::create_dir(dir.path().join("run")).unwrap();
    std::fs::set_permissions(
        dir.path().join("run"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    let mut agent = Agent::start(dir.path(), &["--socket-mode", "0666"]);
    let refused = status_as_nobody(&agent.socket);
    // Refused with an answer the client can act on, not a reset.
    assert_eq!(
        String::from_utf8_lossy(&refused.stdout),
        r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32003,"message":"uid 65534 is not in allowed_uids or allowed_gids"}}"#,
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let log = agent.log_text();
    assert!(
        log.contains("refused a connection") && log.contains("uid=65534"),
        "the refusal is logged with the peer's uid: {log}"
    );
    // Root (the agent's own uid here) is allowed by default.
    assert!(agent.client().await.status().await.is_ok());

    agent.kill9();
    let mut allowed = Agent::unstarted(&dir.path().join("run"), &agent.socket, &agent.state_dir);
    std::fs::create_dir_all(allowed.dir.clone()).unwrap();
    drop(agent);
    allowed = restart_with(
        allowed,
        &["--socket-mode", "0666", "--allowed-uids", "65534"],
    );
    let admitted = status_as_nobody(&allowed.socket);
    let answer: serde_json::Value = serde_json::from_slice(&admitted.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&admitted.stderr)));
    assert_eq!(answer["result"]["snapshotters"], 0);
}

/// Starts `agent` with `args`.
fn restart_with(agent: Agent, args: &[&str]) -> Agent {
    let started = Agent::start_at(&agent.dir, &agent.socket, &agent.state_dir, args);
    drop(agent);
    started
}

#[test]
fn print_config_shows_each_value_and_where_it_came_from() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("agent.toml");
    std::fs::write(
        &file,
        "# operator settings\nbatch_size = 64\nretention = \"48h\"\n",
    )
    .unwrap();
    let out = agent_command()
        .arg("--config")
        .arg(&file)
        .args(["--print-config", "--retention", "72h"])
        .env("OPMON_POLL_INTERVAL", "2s")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let line = |key: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("{key} = ")))
            .unwrap_or_else(|| panic!("no {key} in {text}"))
            .to_string()
    };
    assert!(
        line("batch_size").ends_with(&format!("# {} line 2", file.display())),
        "{text}"
    );
    assert!(line("retention").contains("\"72h0m0s\""), "{text}");
    assert!(line("retention").ends_with("# flag --retention"), "{text}");
    assert!(
        line("poll_interval").ends_with("# environment OPMON_POLL_INTERVAL"),
        "{text}"
    );
    assert!(line("call_deadline").ends_with("# default"), "{text}");
    // Unknown keys name the key and line, and nothing starts.
    std::fs::write(&file, "batch_size = 64\nbatchsize = 3\n").unwrap();
    let out = agent_command().arg("--config").arg(&file).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "config file {} line 2: unknown field `batchsize`",
            file.display()
        )),
        "{stderr}"
    );
}

#[tokio::test]
async fn metrics_are_served_on_the_socket_and_on_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let address = format!("127.0.0.1:{port}");
    let agent = Agent::start(dir.path(), &["--metrics-listen", &address]);
    let client = Client::connect(&agent.socket).await.unwrap();
    client.backups().start("m1", "u").await.unwrap();
    client.backups().start("m2", "u").await.unwrap();
    let _ = client.backups().get("missing").await;

    let out = curl(&agent.socket, &["http://localhost/metrics"])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("opmon_owners{phase=\"InProgress\"} 2\n"),
        "{text}"
    );
    assert!(
        text.contains("opmon_owners{phase=\"Completed\"} 0\n"),
        "{text}"
    );
    assert!(text.contains("opmon_unfinished_operations 0\n"), "{text}");
    assert!(
        text.contains("opmon_rpc_requests_total{method=\"backup.start\",code=\"0\"} 2\n"),
        "{text}"
    );
    assert!(
        text.contains("opmon_rpc_requests_total{method=\"backup.get\",code=\"1001\"} 1\n"),
        "{text}"
    );
    assert!(text.contains("opmon_commit_batch_size_count "), "{text}");

    let out = Command::new("curl")
        .args(["-sS", &format!("http://{address}/metrics")])
        .output()
        .unwrap();
    let tcp = String::from_utf8(out.stdout).unwrap();
    assert!(
        tcp.contains("opmon_owners{phase=\"InProgress\"} 2\n"),
        "{tcp}"
    );

    // Both say what they are: Prometheus 3 refuses a scrape without a Content-Type.
    let content_type = |cmd: &mut Command| {
        let out = cmd
            .args(["-o", "/dev/null", "-w", "%{content_type}"])
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap()
    };
    let prometheus_text = "text/plain; version=0.0.4; charset=utf-8";
    assert_eq!(
        content_type(&mut curl(&agent.socket, &["http://localhost/metrics"])),
        prometheus_text
    );
    assert_eq!(
        content_type(Command::new("curl").args(["-sS", &format!("http://{address}/metrics")])),
        prometheus_text
    );
}

#[tokio::test]
async fn json_logs_carry_the_owner_on_lines_about_it() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), &["--log-format", "json"]);
    let client = Client::connect(&agent.socket).await.unwrap();
    client.backups().start("logged", "u").await.unwrap();
    client.backups().end_in_progress("logged").await.unwrap();
    let log = agent.log_text();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let about = lines
        .iter()
        .find(|l| l["fields"]["message"] == "left InProgress")
        .expect("a line about leaving InProgress");
    assert_eq!(about["fields"]["owner"], "logged");
    assert_eq!(about["fields"]["phase"], "Finalizing");
}

#[test]
fn settings_that_cannot_work_are_refused_and_risky_ones_warned_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("agent.toml");
    let state = dir.path().join("state");
    for (toml, said) in [
        (
            "finalize_dirs = [\"/\"]\n",
            "finalize_dirs (from FILE line 1): / would let finalize read and write any file the agent may",
        ),
        (
            "storage_dir = \"/proc\"\n",
            "storage_dir (from FILE line 1): /proc is in /proc, a kernel file system, which cannot hold its files",
        ),
        (
            "socket_mode = \"0000\"\n",
            "socket_mode (from FILE line 1): \"0000\" does not let the owner write the socket, which connecting needs",
        ),
        (
            "[[snapshotter]]\nname = \"example.io/a\"\napi_version = \"v2\"\ncommand = [\"/bin/true\"]\n\
             [[snapshotter]]\nname = \"example.io/a\"\napi_version = \"v2\"\ncommand = [\"/bin/false\"]\n",
            "config snapshotter example.io/a: two [[snapshotter]] tables have this name",
        ),
    ] {
        std::fs::write(&file, toml).unwrap();
        let out = agent_command()
            .arg("--config")
            .arg(&file)
            .arg("--state-dir")
            .arg(&state)
            .arg("--print-config")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let expected = said.replace("FILE", &file.display().to_string());
        assert!(!out.status.success(), "{toml} was accepted");
        assert!(stderr.contains(&expected), "{toml}: {stderr}");
    }
    // Others may connect with 0666: it works, and the log says what it means.
    let mut agent = Agent::start(dir.path(), &["--socket-mode", "0666"]);
    assert!(agent.terminate().success());
    let log = agent.log_text();
    assert!(
        log.contains("socket_mode (from flag --socket-mode): 0666 lets every local user connect"),
        "{log}"
    );
}
