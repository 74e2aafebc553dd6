//! End-to-end: what operators watch the agent with (issue 36 items 2 to 4, issue 33's
//! metrics listener). A real Prometheus (Debian's `prometheus`) scrapes the agent and
//! its metadata API says each metric's type; `promtool` checks the page, the alert rules
//! and their unit tests; the shipped dashboard and rules name only metrics a live scrape
//! has; a flood of idle TCP connections leaves the agent's descriptors bounded and its
//! socket answering; failed, canceled and stalled operations each leave one WARN line,
//! with their priority when the log is the journal.
//!
//! Under `CI`, a missing `prometheus` or `promtool` fails the test; elsewhere it is
//! skipped with a note.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use opmon_client::{ApiVersion, GoDuration, OperationSelector, Snapshotter, WaitUntil};
use opmon_tests::{agent_command, deploy::repo, operation, Agent, Fixture, PLUGIN};

const LONG: Duration = Duration::from_secs(120);

/// `name` on PATH; `None` (skip, with a note) outside CI, a failure in CI.
fn tool(name: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none_or(|v| v.is_empty()),
            "{name} is not installed (.ci/run installs it)"
        );
        eprintln!("skipped: {name} is not installed");
    }
    found
}

/// A loopback port free now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// `GET path` on `port` over HTTP/1.0 with `accept`: (head, body), or `None` if the
/// server could not be reached or answered nothing.
fn get(port: u16, path: &str, accept: Option<&str>) -> Option<(String, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .ok()?;
    let accept = accept
        .map(|a| format!("Accept: {a}\r\n"))
        .unwrap_or_default();
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: localhost\r\n{accept}\r\n"
    )
    .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let (head, body) = answer.split_once("\r\n\r\n")?;
    Some((head.to_string(), body.to_string()))
}

/// Families on a classic-format page, by the name a query uses, with their types.
fn families(page: &str) -> BTreeMap<String, String> {
    page.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| (name.to_string(), kind.to_string()))
        .collect()
}

/// Every series name a query may use against `page`: gauges and counters by their
/// name, histograms by their `_bucket`, `_sum` and `_count`.
fn queryable(page: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (name, kind) in families(page) {
        if kind == "histogram" {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        } else {
            names.insert(name);
        }
    }
    names
}

/// The `opmon_…` names in a PromQL expression.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find("opmon_") {
        let before = rest[..at].chars().next_back();
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            names.insert(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    names
}

fn monitoring_file(name: &str) -> PathBuf {
    repo().join("docs/monitoring").join(name)
}

/// An agent serving metrics on a loopback port, and that port.
fn agent_with_metrics(dir: &Path) -> (Agent, u16) {
    let port = free_port();
    let address = format!("127.0.0.1:{port}");
    let agent = Agent::start(dir, &["--metrics-listen", &address]);
    (agent, port)
}

/// An agent serving metrics on a loopback port, with a snapshotter it has polled, an
/// operation ended, one still running and one canceled, so that every family has
/// samples; and that port.
async fn busy_agent() -> (Fixture, u16) {
    let port = free_port();
    let address = format!("127.0.0.1:{port}");
    let f = Fixture::new(&["--metrics-listen", &address]).await;
    f.backup("busy")
        .operations([
            operation(PLUGIN, "done-1", "a", &[]),
            operation(PLUGIN, "gate-1", "b", &[]),
            operation(PLUGIN, "gate-2", "c", &[]),
        ])
        .end_in_progress()
        .await;
    f.client
        .backups()
        .cancel("busy")
        .operations(selector("gate-2"))
        .await
        .unwrap();
    opmon_tests::eventually_async("done-1 completes", LONG, || {
        get(port, "/metrics", None).is_some_and(|(_, page)| {
            page.contains("outcome=\"completed\"") && page.contains("opmon_snapshotter_up{")
        })
    })
    .await;
    (f, port)
}

#[tokio::test]
async fn prometheus_stores_every_metric_with_the_type_the_agent_gives() {
    let (Some(prometheus), Some(promtool)) = (tool("prometheus"), tool("promtool")) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (agent, metrics_port) = busy_agent().await;
    let (head, classic) = get(metrics_port, "/metrics", None).expect("the agent's page");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    // promtool lints the classic format: help text and counter names.
    let mut check = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    check
        .stdin
        .take()
        .unwrap()
        .write_all(classic.as_bytes())
        .unwrap();
    let checked = check.wait_with_output().unwrap();
    assert!(
        checked.status.success() && checked.stdout.is_empty() && checked.stderr.is_empty(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    let (head, open) = get(
        metrics_port,
        "/metrics",
        Some("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"),
    )
    .expect("the agent's OpenMetrics page");
    assert!(
        head.contains("application/openmetrics-text; version=1.0.0"),
        "{head}"
    );
    assert!(open.ends_with("# EOF\n"), "{open}");
    // What the agent says each family is, by the family name Prometheus keeps.
    let wanted: BTreeMap<String, String> = open
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| (name.to_string(), kind.to_string()))
        .collect();
    assert!(wanted.values().any(|k| k == "counter"), "{wanted:?}");

    let web = free_port();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: opmon\n    \
             static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n"
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
    let mut server = Command::new(prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("tsdb").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{web}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("starting prometheus");
    // Until Prometheus has scraped the agent once: then its metadata holds every family.
    let metadata = opmon_tests::try_eventually(LONG, || {
        let (_, body) = get(web, "/api/v1/metadata", None)?;
        let value: serde_json::Value = serde_json::from_str(&body).ok()?;
        let data = value.get("data")?.as_object()?;
        wanted
            .keys()
            .all(|name| data.contains_key(name))
            .then(|| data.clone())
    });
    let _ = server.kill();
    let _ = server.wait();
    let log = std::fs::read_to_string(dir.path().join("prometheus.log")).unwrap_or_default();
    let metadata = metadata.unwrap_or_else(|| panic!("no scrape of every family landed:\n{log}"));
    for (name, kind) in &wanted {
        let stored = metadata[name][0]["type"].as_str().unwrap_or("");
        assert_eq!(stored, kind, "{name}: {:?}", metadata[name]);
    }
    drop(agent);
}

#[tokio::test]
async fn the_dashboard_and_the_alert_rules_name_only_metrics_the_agent_exports() {
    let (agent, port) = busy_agent().await;
    let (_, page) = get(port, "/metrics", None).expect("the agent's page");
    let exported = queryable(&page);
    drop(agent);

    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(monitoring_file("opmon-dashboard.json")).unwrap(),
    )
    .unwrap();
    let mut expressions = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            expressions.push(target["expr"].as_str().expect("expr").to_string());
        }
    }
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(q) = variable["definition"].as_str() {
            expressions.push(q.to_string());
        }
    }
    let rules = std::fs::read_to_string(monitoring_file("opmon-alerts.yml")).unwrap();
    expressions.extend(
        rules
            .split("expr:")
            .skip(1)
            .map(|tail| tail.split("labels:").next().unwrap_or("").to_string()),
    );
    assert!(expressions.len() > 10, "{expressions:?}");
    let mut named = 0;
    for expr in &expressions {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "no opmon metric in {expr}");
        for name in names {
            named += 1;
            assert!(
                exported.contains(&name),
                "{name} (in {expr}) is not exported; the agent has {exported:?}"
            );
        }
    }
    assert!(named >= expressions.len());
}

#[test]
fn promtool_checks_the_alert_rules_and_their_unit_tests() {
    let Some(promtool) = tool("promtool") else {
        return;
    };
    for args in [
        vec!["check", "rules", "opmon-alerts.yml"],
        vec!["test", "rules", "opmon-alerts.test.yml"],
        vec!["check", "config", "prometheus.yml"],
    ] {
        let out = Command::new(&promtool)
            .args(&args)
            .current_dir(repo().join("docs/monitoring"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The Kubernetes scrape configuration (docs/monitoring/prometheus-kubernetes.yml) as
/// Prometheus reads it. Debian's Prometheus has no Kubernetes discovery, so its
/// `kubernetes_sd_configs` are replaced by static targets carrying the labels a pod's
/// container ports get from it: promtool checks the rest of the file, and a real
/// Prometheus applies its relabelling, which must keep the port named `metrics` of the
/// container named `opmon` (named by its node) and drop Velero's own `metrics` port.
#[test]
fn the_kubernetes_scrape_config_keeps_the_agents_metrics_port_only() {
    let (Some(prometheus), Some(promtool)) = (tool("prometheus"), tool("promtool")) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(monitoring_file("prometheus-kubernetes.yml")).unwrap();
    let discovery = "    kubernetes_sd_configs:\n      - role: pod\n";
    assert_eq!(text.matches(discovery).count(), 1, "{text}");
    let (agent, other, velero) = (free_port(), free_port(), free_port());
    let target = |port: u16, container: &str, port_name: &str| {
        format!(
            "      - targets: ['127.0.0.1:{port}']\n        labels: {{\
             __meta_kubernetes_pod_container_name: {container}, \
             __meta_kubernetes_pod_container_port_name: {port_name}, \
             __meta_kubernetes_pod_node_name: node-a}}\n"
        )
    };
    let targets = [
        target(agent, "opmon", "metrics"),
        target(other, "opmon", "http"),
        target(velero, "velero", "metrics"),
    ];
    let config = dir.path().join("prometheus.yml");
    let replaced = format!("    static_configs:\n{}", targets.concat());
    std::fs::write(&config, text.replace(discovery, &replaced)).unwrap();
    std::fs::copy(
        monitoring_file("opmon-alerts.yml"),
        dir.path().join("opmon-alerts.yml"),
    )
    .unwrap();
    let out = Command::new(&promtool)
        .args(["check", "config", "prometheus.yml"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool check config: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let web = free_port();
    let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
    let mut server = Command::new(prometheus)
        .arg("--config.file=prometheus.yml")
        .arg("--storage.tsdb.path=tsdb")
        .arg(format!("--web.listen-address=127.0.0.1:{web}"))
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("starting prometheus");
    // Until discovery has handed the three targets to the scrape pool.
    let targets = opmon_tests::try_eventually(LONG, || {
        let (_, body) = get(web, "/api/v1/targets?state=any", None)?;
        let value: serde_json::Value = serde_json::from_str(&body).ok()?;
        let data = value.get("data")?.clone();
        let seen =
            data["activeTargets"].as_array()?.len() + data["droppedTargets"].as_array()?.len();
        (seen == 3).then_some(data)
    });
    let _ = server.kill();
    let _ = server.wait();
    let log = std::fs::read_to_string(dir.path().join("prometheus.log")).unwrap_or_default();
    let targets = targets.unwrap_or_else(|| panic!("the targets were not discovered:\n{log}"));
    let active = targets["activeTargets"].as_array().unwrap();
    assert_eq!(active.len(), 1, "{targets:#}");
    assert_eq!(
        active[0]["scrapeUrl"],
        format!("http://127.0.0.1:{agent}/metrics"),
        "{targets:#}"
    );
    assert_eq!(active[0]["labels"]["instance"], "node-a", "{targets:#}");
}

/// Issue 33: 1,100 connections that never send a byte took every descriptor the agent
/// had (1,024). Now it holds a bounded few, closes those that stay silent, and keeps answering
/// on its socket and to a scraper once the flood has gone.
#[tokio::test]
async fn a_flood_of_silent_tcp_connections_leaves_descriptors_bounded_and_the_socket_answering() {
    let dir = tempfile::tempdir().unwrap();
    let (agent, port) = agent_with_metrics(dir.path());
    let descriptors =
        || std::fs::read_dir(format!("/proc/{}/fd", agent.pid())).map_or(0, |d| d.count());
    let client = agent.client().await;
    client.status().await.unwrap();
    let before = descriptors();
    // This process needs its own 1,100 descriptors.
    let (_, hard) =
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).unwrap();
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard, hard).unwrap();
    // 1,100 attempts: past the listen queue's length the kernel holds the rest back
    // (their connects wait), so the flood stops at the first of those.
    let mut flood: Vec<TcpStream> = Vec::new();
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    for _ in 0..1100 {
        match TcpStream::connect_timeout(&address, Duration::from_millis(500)) {
            Ok(stream) => flood.push(stream),
            Err(_) => break,
        }
    }
    assert!(flood.len() > 100, "only {} connections made", flood.len());
    // The agent takes what it takes of them at once; its count then holds.
    let mut most = 0;
    for _ in 0..20 {
        client
            .status()
            .await
            .expect("agent.status during the flood");
        most = most.max(descriptors());
    }
    assert!(
        most <= before + opmon_agent::edge::metrics_listener::CONNECTIONS + 4,
        "{most} descriptors during the flood, {before} before"
    );
    // The silent connections are closed by the agent, not left for the peer to close.
    let mut first = flood[0].try_clone().unwrap();
    first.set_read_timeout(Some(LONG)).unwrap();
    let mut byte = [0u8; 1];
    assert_eq!(first.read(&mut byte).unwrap_or(0), 0, "closed by the agent");
    drop(first);
    drop(flood);
    let page = opmon_tests::try_eventually(LONG, || get(port, "/metrics", None));
    assert!(page.is_some_and(|(_, body)| body.contains("opmon_unfinished_operations")));
    client.status().await.unwrap();
}

fn selector(id: &str) -> Vec<OperationSelector> {
    vec![OperationSelector::Id(id.to_string())]
}

/// The log lines at WARN that mention `operation=ID`.
fn warnings_about(log: &str, id: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains(" WARN ") && l.contains(&format!("operation={id}")))
        .map(str::to_string)
        .collect()
}

#[tokio::test]
async fn failed_canceled_and_stalled_operations_each_leave_one_warn_line() {
    let f = Fixture::new(&[]).await;
    f.client
        .register_snapshotter(Snapshotter {
            name: PLUGIN.into(),
            api_version: ApiVersion::V2,
            socket: Some(f.snapshotter.socket.clone()),
            stall_timeout: Some(GoDuration::from_millis(700)),
            ..Default::default()
        })
        .await
        .unwrap();
    f.backup("b")
        .operations([
            operation(PLUGIN, "fail-1", "a", &[]),
            operation(PLUGIN, "never-1", "b", &[]),
            operation(PLUGIN, "gate-1", "c", &[]),
        ])
        .end_in_progress()
        .await;
    f.client
        .backups()
        .cancel("b")
        .operations(selector("gate-1"))
        .reason("the operator asked")
        .await
        .unwrap();
    f.backup("b").wait(WaitUntil::ReadyToFinalize).await;
    let log = f.agent.log_text();
    for (id, says, reason) in [
        ("fail-1", "operation failed", "copy failed"),
        ("never-1", "operation stalled", "no progress"),
        ("gate-1", "operation canceled", "the operator asked"),
    ] {
        let lines = warnings_about(&log, id);
        assert_eq!(lines.len(), 1, "{id}: {lines:#?}");
        let line = &lines[0];
        assert!(line.contains(says), "{line}");
        assert!(line.contains("owner=b"), "{line}");
        assert!(line.contains(&format!("plugin={PLUGIN}")), "{line}");
        assert!(line.contains(reason), "{line}");
    }
}

/// Under systemd the log is the journal: each line starts with its priority
/// (sd-daemon(3)), so `journalctl -p warning` selects the warnings. A start-up error is
/// one line.
#[test]
fn lines_to_the_journal_carry_their_priority_and_a_start_up_error_is_one_line() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("journal.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let meta = log.metadata().unwrap();
    // The database path is a directory: the agent cannot start.
    std::fs::create_dir_all(dir.path().join("state/agent.db")).unwrap();
    let status = agent_command()
        .arg("--socket")
        .arg(dir.path().join("agent.sock"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env("OPMON_CONFIG", "/dev/null")
        .env("OPMON_LOG_LEVEL", "info")
        .env("JOURNAL_STREAM", format!("{}:{}", meta.dev(), meta.ino()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .status()
        .unwrap();
    assert!(!status.success());
    let text = std::fs::read_to_string(&log_path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert!(!lines.is_empty());
    for line in &lines {
        assert!(
            ["<3>", "<4>", "<6>", "<7>"]
                .iter()
                .any(|p| line.starts_with(p)),
            "{line}"
        );
    }
    let errors: Vec<&&str> = lines.iter().filter(|l| l.contains("agent.db")).collect();
    assert_eq!(errors.len(), 1, "{text}");
    assert!(errors[0].starts_with("<3>"), "{text}");
}
