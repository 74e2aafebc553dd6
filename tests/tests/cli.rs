//! End-to-end: the `opmon` CLI against a real agent.

use std::process::{Command, Output};

use opmon_client::{FinalizeParams, NameParams, OwnerKind};
use opmon_tests::{workspace_binary, Fixture, PLUGIN};
use serde_json::{json, Value};

fn opmon(f: &Fixture, args: &[&str]) -> Output {
    Command::new(workspace_binary("opmon"))
        .env("TZ", "UTC")
        .arg("--socket")
        .arg(&f.agent.socket)
        .args(args)
        .output()
        .expect("running opmon")
}

fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success() || out.status.code() == Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

#[tokio::test]
async fn every_subcommand_prints_exactly_the_api_result_as_json() {
    // The CLI registers a command snapshotter, which the operator must allow.
    let f = Fixture::new(&["--allow-api-command-snapshotters", "true"]).await;
    let client = f.agent.client().await;
    let started = json_of(&opmon(
        &f,
        &["-o", "json", "backup", "start", "b1", "--uid", "u1"],
    ));
    assert_eq!(started["phase"], "InProgress");
    let added = json_of(&opmon(
        &f,
        &[
            "-o",
            "json",
            "backup",
            "add-operation",
            "b1",
            "--plugin",
            PLUGIN,
            "--item",
            "persistentvolumeclaims/app/data",
            "--operation-id",
            "gate-1",
            "--post-item",
            "volumesnapshotbackups.velero.io/app/vsb-1",
        ],
    ));
    assert_eq!(added, json!({"added": 1, "alreadyKnown": 0}));
    let ended = json_of(&opmon(
        &f,
        &["-o", "json", "backup", "end-in-progress", "b1"],
    ));
    assert_eq!(ended["phase"], "WaitingForPluginOperations");

    let name = || NameParams { name: "b1".into() };
    let api = |method: &'static str| {
        let client = &client;
        async move { client.call::<_, Value>(method, name()).await.unwrap() }
    };
    assert_eq!(
        json_of(&opmon(&f, &["-o", "json", "backup", "get", "b1"])),
        api("backup.get").await
    );
    assert_eq!(
        json_of(&opmon(&f, &["-o", "json", "backup", "operations", "b1"])),
        api("backup.operations").await
    );
    assert_eq!(
        json_of(&opmon(
            &f,
            &["-o", "json", "backup", "item-operations", "b1"]
        )),
        api("backup.itemOperations").await
    );
    let list = json_of(&opmon(
        &f,
        &[
            "-o",
            "json",
            "backup",
            "list",
            "--phase",
            "WaitingForPluginOperations",
        ],
    ));
    assert_eq!(
        list,
        client
            .call::<_, Value>(
                "backup.list",
                json!({"phases": ["WaitingForPluginOperations"]})
            )
            .await
            .unwrap()
    );
    assert_eq!(list["items"][0]["name"], "b1");
    let status = json_of(&opmon(&f, &["-o", "json", "status"]));
    assert_eq!(status["unfinishedOperations"], 1);
    let snapshotters = json_of(&opmon(&f, &["-o", "json", "snapshotter", "list"]));
    assert_eq!(
        snapshotters,
        client
            .call::<_, Value>("snapshotter.list", json!({}))
            .await
            .unwrap()
    );
    let described = json_of(&opmon(
        &f,
        &["-o", "json", "backup", "describe", "b1", "--details"],
    ));
    assert_eq!(described["owner"], api("backup.get").await);
    assert_eq!(described["operations"], api("backup.operations").await);

    f.open_gate("gate-1");
    let waited = json_of(&opmon(&f, &["-o", "json", "backup", "wait", "b1"]));
    assert_eq!(waited["timedOut"], false);
    assert_eq!(waited["owner"]["phase"], "Finalizing");
    let finalized = json_of(&opmon(&f, &["-o", "json", "backup", "finalize", "b1"]));
    assert_eq!(finalized["owner"]["phase"], "Completed");
    let again: Value = client
        .call(
            "backup.finalize",
            FinalizeParams {
                name: "b1".into(),
                contents: None,
                updated_items: vec![],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(finalized, again);

    let registered = json_of(&opmon(
        &f,
        &[
            "-o",
            "json",
            "snapshotter",
            "register",
            "example.io/script",
            "--",
            "/bin/true",
            "x",
        ],
    ));
    assert_eq!(
        registered,
        json!({"name": "example.io/script", "apiVersion": "v2", "command": ["/bin/true", "x"]})
    );
    let unregistered = json_of(&opmon(
        &f,
        &[
            "-o",
            "json",
            "snapshotter",
            "unregister",
            "example.io/script",
        ],
    ));
    assert_eq!(unregistered, registered);
    let deleted = json_of(&opmon(&f, &["-o", "json", "backup", "delete", "b1"]));
    assert_eq!(deleted, json!({"canceled": 0, "cancelled": 0}));
    assert_eq!(
        client
            .owners(OwnerKind::Backup)
            .get("b1")
            .await
            .unwrap_err()
            .code(),
        Some(1001)
    );
}

#[tokio::test]
async fn wait_exit_codes_follow_the_outcome() {
    let f = Fixture::new(&[]).await;
    let setup = |name: &str, op: &str| {
        let a = opmon(&f, &["backup", "start", name, "--uid", "u"]);
        assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
        let b = opmon(
            &f,
            &[
                "backup",
                "add-operation",
                name,
                "--plugin",
                PLUGIN,
                "--item",
                "pods/app/p",
                "--operation-id",
                op,
            ],
        );
        assert!(b.status.success(), "{}", String::from_utf8_lossy(&b.stderr));
    };
    setup("ok", "done-1");
    assert_eq!(
        opmon(&f, &["backup", "end-in-progress", "ok"])
            .status
            .code(),
        Some(0)
    );
    assert_eq!(opmon(&f, &["backup", "wait", "ok"]).status.code(), Some(0));

    setup("partial", "fail-1");
    assert_eq!(
        opmon(&f, &["backup", "end-in-progress", "partial"])
            .status
            .code(),
        Some(1)
    );
    assert_eq!(
        opmon(&f, &["backup", "wait", "partial"]).status.code(),
        Some(1)
    );

    setup("doomed", "never-1");
    assert_eq!(
        opmon(&f, &["backup", "end-in-progress", "doomed", "--failed"])
            .status
            .code(),
        Some(2)
    );
    assert_eq!(
        opmon(&f, &["backup", "wait", "doomed", "--until", "terminal"])
            .status
            .code(),
        Some(2)
    );

    setup("slow", "never-2");
    assert_eq!(
        opmon(&f, &["backup", "end-in-progress", "slow"])
            .status
            .code(),
        Some(0)
    );
    let timed_out = opmon(&f, &["backup", "wait", "slow", "--timeout", "300ms"]);
    assert_eq!(timed_out.status.code(), Some(3));
    assert!(
        String::from_utf8_lossy(&timed_out.stderr).contains("timed out waiting for backup slow")
    );

    let missing = opmon(&f, &["backup", "get", "nope"]);
    assert_eq!(missing.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&missing.stderr).trim(),
        "opmon: backup nope not found (code 1001)"
    );
    let bad_item = opmon(
        &f,
        &[
            "backup",
            "add-operation",
            "ok",
            "--plugin",
            PLUGIN,
            "--item",
            "pods",
            "--operation-id",
            "x",
        ],
    );
    assert_eq!(bad_item.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad_item.stderr)
        .contains("expected RESOURCE[.GROUP]/NAMESPACE/NAME"));
}

#[tokio::test]
async fn wait_without_a_terminal_prints_a_line_per_change() {
    let f = Fixture::new(&[]).await;
    for args in [
        &["backup", "start", "lines", "--uid", "u"][..],
        &[
            "backup",
            "add-operation",
            "lines",
            "--plugin",
            PLUGIN,
            "--item",
            "pods/app/a",
            "--operation-id",
            "gate-a",
        ],
        &[
            "backup",
            "add-operation",
            "lines",
            "--plugin",
            PLUGIN,
            "--item",
            "pods/app/b",
            "--operation-id",
            "done-b",
        ],
        &["backup", "end-in-progress", "lines"],
    ] {
        let out = opmon(&f, args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Start waiting (stdout is a pipe here), then let the operation finish.
    let mut child = Command::new(workspace_binary("opmon"))
        .arg("--socket")
        .arg(&f.agent.socket)
        .args(["backup", "wait", "lines"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut first).unwrap();
    assert_eq!(
        first,
        "backup lines: WaitingForPluginOperations (1/2 operations completed, 0 failed)\n"
    );
    f.open_gate("gate-a");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    assert!(child.wait().unwrap().success());
    let lines: Vec<&str> = rest.lines().collect();
    assert!(
        lines.contains(&"  pods app/a gate-a InProgress 30/100 byte (30%)"),
        "{rest}"
    );
    assert!(
        lines.contains(&"  pods app/b done-b Completed 100/100 byte (100%)"),
        "{rest}"
    );
    assert!(
        lines.contains(&"backup lines: Finalizing (2/2 operations completed, 0 failed)"),
        "{rest}"
    );
    assert!(
        lines.contains(&"  pods app/a gate-a Completed 100/100 byte (100%)"),
        "{rest}"
    );
    assert_eq!(lines.last(), Some(&"backup lines is Finalizing"));
    let describe = opmon(&f, &["backup", "describe", "lines", "--details"]);
    let text = String::from_utf8_lossy(&describe.stdout);
    // The operations as Velero's `backup describe --details` prints them (times as
    // Go's Time.String() of a second-precision local time, here TZ=UTC), then the
    // agent's rate.
    let client = f.agent.client().await;
    let ops = client.backups().operations("lines").await.unwrap();
    let go_time = |t: time::OffsetDateTime| {
        let t = t.to_offset(time::UtcOffset::UTC);
        format!(
            "{:04}-{:02}-{:02} {:02}:{:02}:{:02} +0000 UTC",
            t.year(),
            t.month() as u8,
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        )
    };
    let a = &ops[0];
    assert_eq!(a.operation_id, "gate-a");
    let mut expected = format!(
        "\nBackup Item Operations:\n\
         \x20 Operation for pods app/a:\n\
         \x20   Backup Item Action Plugin:  example.io/copier\n\
         \x20   Operation ID:               gate-a\n\
         \x20   Phase:                      Completed\n\
         \x20   Progress:                   100 of 100 complete (byte)\n\
         \x20   Progress description:       done\n\
         \x20   Created:                    {}\n\
         \x20   Started:                    {}\n",
        go_time(a.created),
        go_time(a.started.unwrap()),
    );
    // Velero prints the plugin's own Updated, not the agent's change time.
    if let Some(updated) = a.plugin_updated {
        expected.push_str(&format!(
            "    Updated:                    {}\n",
            go_time(updated)
        ));
    }
    assert!(text.contains(&expected), "{text}\nwanted:\n{expected}");
    assert!(
        text.contains("\n  Operation for pods app/b:\n    Backup Item Action Plugin:  example.io/copier\n    Operation ID:               done-b\n"),
        "{text}"
    );
    // Without --details: Velero's summary line, then the events.
    let summary = opmon(&f, &["backup", "describe", "lines"]);
    let summary = String::from_utf8_lossy(&summary.stdout);
    assert!(
        summary.contains(
            "\nBackup Item Operations:  2 of 2 completed successfully, 0 failed (specify --details for more information)\n\nEvents:\n"
        ),
        "{summary}"
    );
}

/// Runs `opmon` with `args` in `cwd`, its standard output a pipe whose read end is
/// already closed. Both ends close on exec: a process that another test's thread
/// starts meanwhile must not inherit the read end, or the pipe would have a reader
/// (`opmon` then wrote into it and exited 0, once in a CI run).
fn opmon_into_closed_pipe(socket: &std::path::Path, args: &[&str]) -> Output {
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
    drop(read);
    Command::new(workspace_binary("opmon"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .stdout(std::process::Stdio::from(write))
        .stderr(std::process::Stdio::piped())
        .output()
        .expect("running opmon")
}

#[tokio::test]
async fn output_into_a_closed_pipe_ends_as_by_sigpipe_without_a_word() {
    use std::os::unix::process::ExitStatusExt;
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    for i in 0..50 {
        client.backups().start(&format!("b{i}"), "u").await.unwrap();
    }
    for args in [
        &["backup", "list"][..],
        &["-o", "json", "backup", "list"],
        &["status"],
        &["completions", "bash"],
    ] {
        let out = opmon_into_closed_pipe(&f.agent.socket, args);
        assert_eq!(
            out.status.signal(),
            Some(nix::sys::signal::Signal::SIGPIPE as i32),
            "{args:?}: {:?}",
            out.status
        );
        assert_eq!(String::from_utf8_lossy(&out.stderr), "", "{args:?}");
    }
}

#[tokio::test]
async fn relative_paths_are_resolved_where_the_user_typed_them() {
    let f = Fixture::new(&[]).await;
    let work = f.agent.state_dir.join("storage/work");
    std::fs::create_dir_all(&work).unwrap();
    // A snapshotter socket given relative to the CLI's directory.
    let registered = Command::new(workspace_binary("opmon"))
        .current_dir(f.dir.path())
        .arg("--socket")
        .arg(&f.agent.socket)
        .args([
            "-o",
            "json",
            "snapshotter",
            "register",
            "example.io/relative",
            "--snapshotter-socket",
            "./copier.sock",
        ])
        .output()
        .unwrap();
    assert_eq!(
        json_of(&registered)["socket"],
        json!(f.dir.path().join("copier.sock"))
    );
    // A tarball named relative to the CLI's directory, not the agent's storage dir.
    let tarball = Command::new("tar")
        .current_dir(&work)
        .args(["czf", "in.tar.gz", "--files-from", "/dev/null"])
        .status()
        .unwrap();
    assert!(tarball.success());
    let client = f.agent.client().await;
    let owner = opmon_tests::start_and_end_in_progress(&client.backups(), "rel", vec![]).await;
    assert_eq!(owner.phase, opmon_client::OwnerPhase::Finalizing);
    let finalized = Command::new(workspace_binary("opmon"))
        .current_dir(&work)
        .arg("--socket")
        .arg(&f.agent.socket)
        .args([
            "-o",
            "json",
            "backup",
            "finalize",
            "rel",
            "--contents-input",
            "in.tar.gz",
            "--contents-output",
            "./out.tar.gz",
        ])
        .output()
        .unwrap();
    let result = json_of(&finalized);
    assert_eq!(result["contentsFile"], json!(work.join("out.tar.gz")));
    assert!(work.join("out.tar.gz").is_file());
}

#[tokio::test]
async fn an_agent_with_relative_directories_hands_out_absolute_paths() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
    let mut agent = Command::new(workspace_binary("opmon-agent"))
        .current_dir(dir.path())
        .arg("--socket")
        .arg(&socket)
        .args(["--state-dir", "state", "--storage-dir", "./results"])
        .env("OPMON_CONFIG", "/dev/null")
        .stderr(log)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the agent did not start"
        );
        assert!(agent.try_wait().unwrap().is_none(), "the agent exited");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let client = opmon_client::Client::connect(&socket).await.unwrap();
    let backups = client.backups();
    opmon_tests::start_and_end_in_progress(&backups, "b", vec![]).await;
    let result = backups
        .request::<opmon_client::methods::Finalize>(FinalizeParams {
            name: "b".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        result.item_operations_file,
        dir.path()
            .join("results/backups/b/b-itemoperations.json.gz")
    );
    assert!(result.item_operations_file.is_file());
    let _ = agent.kill();
    let _ = agent.wait();
}

#[tokio::test]
async fn snapshotter_text_reaches_the_terminal_and_the_log_escaped() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    opmon_tests::start_and_end_in_progress(
        &backups,
        "evil",
        vec![opmon_tests::operation(PLUGIN, "evil-1", "a", &[])],
    )
    .await;
    f.open_gate("evil-1");
    let waited = opmon(&f, &["backup", "wait", "evil"]);
    assert_eq!(waited.status.code(), Some(1));
    for (what, out) in [
        ("wait", waited),
        ("operations", opmon(&f, &["backup", "operations", "evil"])),
        (
            "describe",
            opmon(&f, &["backup", "describe", "evil", "--details"]),
        ),
        (
            "item-operations",
            opmon(&f, &["backup", "item-operations", "evil"]),
        ),
    ] {
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            !text.chars().any(|c| c.is_control() && c != '\n'),
            "{what}: {text:?}"
        );
        assert!(
            !text.lines().any(|l| l.starts_with("2026-01-01T00:00:00Z")),
            "{what}: a forged line: {text}"
        );
        if what != "item-operations" {
            assert!(
                text.contains(
                    "boom\\n2026-01-01T00:00:00Z  INFO opmon_agent: forged\\r\\x1b]0;pwned\\x07"
                ),
                "{what}: {text}"
            );
        }
    }
    let described = opmon(&f, &["backup", "describe", "evil", "--details"]);
    assert!(String::from_utf8_lossy(&described.stdout)
        .contains("    Progress description:       copying\\x1b[2J\\x1b[31m\\rDONE\\x07\n"));
    // -o json is JSON: the text as the agent has it.
    let json = json_of(&opmon(&f, &["-o", "json", "backup", "operations", "evil"]));
    assert_eq!(
        json[0]["description"],
        "copying\u{1b}[2J\u{1b}[31m\rDONE\u{7}"
    );

    // The agent's log: a failed Cancel logs the snapshotter's error.
    opmon_tests::start_and_end_in_progress(
        &backups,
        "evil-cancel",
        vec![opmon_tests::operation(PLUGIN, "evil-2", "a", &[])],
    )
    .await;
    // Deleting it cancels the unfinished operation; that Cancel fails.
    backups.delete("evil-cancel").await.unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !f.agent.log_text().contains("pwned") {
        assert!(
            std::time::Instant::now() < deadline,
            "{}",
            f.agent.log_text()
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let log = f.agent.log_text();
    assert!(!log.chars().any(|c| c.is_control() && c != '\n'), "{log:?}");
    assert!(
        !log.lines().any(|l| l.starts_with("2026-01-01T00:00:00Z")),
        "a forged line: {log}"
    );
    assert!(
        log.lines().any(|l| l.contains("evil-2")
            && l.contains(
                "boom\\n2026-01-01T00:00:00Z  INFO opmon_agent: forged\\r\\x1b]0;pwned\\x07"
            )),
        "{log}"
    );
}

#[tokio::test]
async fn get_and_describe_exit_with_the_code_of_the_owners_phase() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    for (name, op) in [("fine", "done-1"), ("partial", "fail-1")] {
        opmon_tests::start_and_end_in_progress(
            &backups,
            name,
            vec![opmon_tests::operation(PLUGIN, op, "a", &[])],
        )
        .await;
        backups
            .wait(
                name,
                opmon_client::WaitUntil::ReadyToFinalize,
                std::time::Duration::from_secs(60),
            )
            .await
            .unwrap();
    }
    backups.start("doomed", "u").await.unwrap();
    backups.end_in_progress("doomed").failed().await.unwrap();
    for (name, code) in [("fine", 0), ("partial", 1), ("doomed", 2)] {
        for args in [
            vec!["backup", "get", name],
            vec!["-o", "json", "backup", "get", name],
            vec!["backup", "describe", name],
            vec!["backup", "describe", name, "--details"],
        ] {
            let out = opmon(&f, &args);
            assert_eq!(out.status.code(), Some(code), "{args:?}");
            assert!(!out.stdout.is_empty(), "{args:?} printed nothing");
        }
    }
}

#[tokio::test]
async fn server_started_fails_what_the_earlier_instance_started() {
    let f = Fixture::new(&[]).await;
    let dir = tempfile::tempdir().unwrap();
    let object = dir.path().join("backup.json");
    std::fs::write(&object, r#"{"metadata": {"name": "b1"}}"#).unwrap();
    let out = opmon(
        &f,
        &[
            "backup",
            "start",
            "b1",
            "--uid",
            "u1",
            "--server",
            "velero",
            "--instance",
            "pod-a",
            "--object",
        ]
        .into_iter()
        .chain([object.to_str().unwrap()])
        .collect::<Vec<_>>(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The object from standard input.
    let mut child = Command::new(workspace_binary("opmon"))
        .arg("--socket")
        .arg(&f.agent.socket)
        .args([
            "restore",
            "start",
            "r1",
            "--uid",
            "u2",
            "--server",
            "velero",
            "--instance",
            "pod-a",
            "--object",
            "-",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(
        &mut child.stdin.take().unwrap(),
        br#"{"metadata": {"name": "r1"}}"#,
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = opmon(&f, &["backup", "start", "other", "--uid", "u3"]);
    assert!(out.status.success());

    let out = opmon(&f, &["server", "started", "velero", "--instance", "pod-b"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "server velero runs as pod-b: 2 backups and restores failed\n\
         backup b1 (uid u1) failed\n\
         restore r1 (uid u2) failed\n"
    );
    assert_eq!(opmon(&f, &["backup", "get", "b1"]).status.code(), Some(2));
    assert_eq!(opmon(&f, &["restore", "get", "r1"]).status.code(), Some(2));
    assert_eq!(
        opmon(&f, &["backup", "get", "other"]).status.code(),
        Some(0)
    );
    // Again: nothing more fails, and -o json is the API's result.
    let again = json_of(&opmon(
        &f,
        &[
            "-o",
            "json",
            "server",
            "started",
            "velero",
            "--instance",
            "pod-b",
        ],
    ));
    assert_eq!(again, json!({"failed": []}));
}

#[tokio::test]
async fn new_start_and_add_operation_flags_are_checked_and_sent() {
    let f = Fixture::new(&[]).await;
    let dir = tempfile::tempdir().unwrap();
    let not_object = dir.path().join("list.json");
    std::fs::write(&not_object, "[1, 2]").unwrap();
    let out = opmon(
        &f,
        &[
            "backup",
            "start",
            "b1",
            "--uid",
            "u",
            "--object",
            not_object.to_str().unwrap(),
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "opmon: --object: must be a JSON object (the backup server's representation of the \
         backup or restore) (code -32602)"
    );
    let missing = dir.path().join("absent.json");
    let out = opmon(
        &f,
        &[
            "backup",
            "start",
            "b1",
            "--uid",
            "u",
            "--object",
            missing.to_str().unwrap(),
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        format!(
            "opmon: reading {}: No such file or directory (os error 2)",
            missing.display()
        )
    );
    let mut child = Command::new(workspace_binary("opmon"))
        .arg("--socket")
        .arg(&f.agent.socket)
        .args(["backup", "start", "b1", "--uid", "u", "--object", "-"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), b"not json").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "opmon: --object -: standard input: expected ident at line 1 column 2"
    );
    let out = opmon(
        &f,
        &["backup", "start", "b1", "--uid", "u", "--server", "velero"],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--instance <INSTANCE>"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    assert!(opmon(&f, &["backup", "start", "b1", "--uid", "u"])
        .status
        .success());
    let add = |created: &str| {
        opmon(
            &f,
            &[
                "backup",
                "add-operation",
                "b1",
                "--plugin",
                PLUGIN,
                "--item",
                "pods/app/p",
                "--operation-id",
                "never-1",
                "--created",
                created,
            ],
        )
    };
    let out = add("yesterday");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(
            "invalid value 'yesterday' for '--created <CREATED>': not an RFC 3339 time such as \
             2026-01-02T15:04:05Z"
        ),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = add("2020-01-02T03:04:05Z");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ops = json_of(&opmon(&f, &["-o", "json", "backup", "operations", "b1"]));
    assert_eq!(ops[0]["created"], "2020-01-02T03:04:05Z");
}

#[tokio::test]
async fn wait_follows_the_owner_across_a_killed_and_restarted_agent() {
    let mut f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    // Two items' operations with one ID: each keeps a line of its own.
    opmon_tests::start_and_end_in_progress(
        &client.backups(),
        "kept",
        vec![
            opmon_tests::operation(PLUGIN, "gate-k", "a", &[]),
            opmon_tests::operation(PLUGIN, "gate-k", "b", &[]),
        ],
    )
    .await;
    let mut child = Command::new(workspace_binary("opmon"))
        .arg("--socket")
        .arg(&f.agent.socket)
        .args(["backup", "wait", "kept"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    // The first update has arrived once its owner line is printed.
    let mut first = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut first).unwrap();
    assert!(
        first.starts_with("backup kept: WaitingForPluginOperations"),
        "{first}"
    );

    f.agent.kill9();
    // While the agent is gone, wait says so (it looks after a quiet while).
    let mut gone = String::new();
    while !gone.ends_with("agent restarting, reconnecting…\n") {
        let mut line = String::new();
        let n = std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
        assert!(
            n > 0,
            "wait ended without a word of the agent: {first}{gone}"
        );
        gone.push_str(&line);
    }
    f.agent.restart();
    f.open_gate("gate-k");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{first}{rest}");
    let lines: Vec<&str> = rest.lines().collect();
    for item in [
        "persistentvolumeclaims app/a",
        "persistentvolumeclaims app/b",
    ] {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("  {item} gate-k Completed"))),
            "{item}: {rest}"
        );
    }
    assert_eq!(lines.last(), Some(&"backup kept is Finalizing"), "{rest}");
    assert_eq!(lines.first(), Some(&"agent back"), "{rest}");
}

/// `opmon` against `f`'s agent, with `env` set (and `OPMON_SOCKET` taken away unless
/// `env` sets it).
fn opmon_env(f: &Fixture, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut command = Command::new(workspace_binary("opmon"));
    command.env_remove("OPMON_SOCKET");
    for (name, value) in env {
        command.env(name, value);
    }
    command
        .arg("--socket")
        .arg(&f.agent.socket)
        .args(args)
        .output()
        .expect("running opmon")
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn help_offers_finalize_to_restores_only_and_explains_every_argument() {
    let help = |kind: &str| {
        let out = Command::new(workspace_binary("opmon"))
            .args([kind, "start", "--help"])
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let backup = help("backup");
    assert!(!backup.contains("--finalize"), "{backup}");
    assert!(help("restore").contains("--finalize"));
    // The name and the uid say what they are; the socket is not required.
    assert!(backup.contains("Its name, a DNS subdomain"), "{backup}");
    assert!(backup.contains("metadata.uid"), "{backup}");
    assert!(
        backup.contains("Usage: opmon backup start [OPTIONS] --uid <UID> <NAME>"),
        "{backup}"
    );
    // Given anyway, --finalize is refused with the reason.
    let f = Fixture::new(&[]).await;
    let out = opmon(&f, &["backup", "start", "b", "--uid", "u", "--finalize"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out).1.contains("--finalize is for restores"),
        "{:?}",
        text(&out)
    );
}

#[tokio::test]
async fn an_empty_opmon_socket_means_unset() {
    let f = Fixture::new(&[]).await;
    // The CLI: the flag's socket, as if the variable were not there.
    let out = opmon_env(&f, &[("OPMON_SOCKET", "")], &["status"]);
    assert!(out.status.success(), "{:?}", text(&out));
    // The agent: its default socket.
    let out = opmon_tests::agent_command()
        .env("OPMON_SOCKET", "")
        .env("OPMON_POLL_INTERVAL", "")
        .arg("--print-config")
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("poll_interval = \"10s\""), "{stdout}");
    assert!(!stdout.contains("socket = \"\""), "{stdout}");
}

#[test]
fn the_environments_values_are_named_as_variables_not_as_flags_typed() {
    let opmon = |env: &[(&str, &str)], args: &[&str]| {
        let mut command = Command::new(workspace_binary("opmon"));
        command
            .env_remove("OPMON_SOCKET")
            .env_remove("OPMON_AGENT_UID");
        text(
            &command
                .envs(env.iter().copied())
                .args(args)
                .output()
                .unwrap(),
        )
    };
    // A bad user in the variable is named as the variable's.
    let (_, stderr) = opmon(&[("OPMON_AGENT_UID", "nosuchuser")], &["status"]);
    assert!(
        stderr.contains("error: OPMON_AGENT_UID: no user named \"nosuchuser\""),
        "{stderr}"
    );
    let (_, stderr) = opmon(&[], &["--agent-uid", "nosuchuser", "status"]);
    assert!(stderr.contains("for '--agent-uid <AGENT_UID>'"), "{stderr}");
    // The usage line shows what was typed, not the variable's socket as if required.
    let (_, stderr) = opmon(&[("OPMON_SOCKET", "/run/x.sock")], &["backup", "get"]);
    assert!(
        stderr.contains("Usage: opmon backup get <NAME>\n"),
        "{stderr}"
    );
}

#[tokio::test]
async fn an_agent_socket_named_without_a_directory_is_in_the_working_directory() {
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("agent.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut agent = opmon_tests::agent_command()
        .current_dir(dir.path())
        .args(["--socket", "s.sock", "--state-dir", "state"])
        .env("OPMON_CONFIG", "/dev/null")
        .stderr(log)
        .spawn()
        .unwrap();
    let socket = dir.path().join("s.sock");
    opmon_tests::wait_for_socket(&socket, &mut agent, &log_path);
    let out = Command::new(workspace_binary("opmon"))
        .current_dir(dir.path())
        .env("OPMON_SOCKET", "s.sock")
        .arg("status")
        .output()
        .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let _ = agent.kill();
    let _ = agent.wait();
}

#[tokio::test]
async fn errors_name_the_flags_typed_not_the_apis_fields() {
    let f = Fixture::new(&[]).await;
    let out = opmon(&f, &["snapshotter", "register", "example.io/none"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out).1,
        "opmon: a v2 snapshotter needs --snapshotter-socket PATH, --velero-plugin PATH or a command \
         after --\n"
    );
    let out = opmon(&f, &["backup", "start", "b", "--uid", ""]);
    let stderr = text(&out).1;
    assert!(stderr.starts_with("opmon: --uid: "), "{stderr}");
    let out = opmon(&f, &["backup", "start", "Not_A_Name", "--uid", "u"]);
    let stderr = text(&out).1;
    assert!(stderr.starts_with("opmon: NAME: "), "{stderr}");
    let out = opmon(&f, &["backup", "start", "b", "--uid", "u"]);
    assert!(out.status.success());
    let out = opmon(
        &f,
        &[
            "backup",
            "add-operation",
            "b",
            "--plugin",
            PLUGIN,
            "--item",
            "pods/app/a",
            "--operation-id",
            &"x".repeat(1025),
        ],
    );
    let stderr = text(&out).1;
    assert!(stderr.starts_with("opmon: --operation-id: "), "{stderr}");
}

#[tokio::test]
async fn adding_an_operation_no_snapshotter_owns_warns_at_once() {
    let f = Fixture::new(&[]).await;
    assert!(opmon(&f, &["backup", "start", "b", "--uid", "u"])
        .status
        .success());
    let add = |plugin: &str, id: &str| {
        opmon(
            &f,
            &[
                "backup",
                "add-operation",
                "b",
                "--plugin",
                plugin,
                "--item",
                "pods/app/a",
                "--operation-id",
                id,
            ],
        )
    };
    let out = add("foo", "op-1");
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(stdout, "1 added, 0 already known\n");
    assert!(
        stderr.contains("no snapshotter is registered for plugin velero.io/foo"),
        "{stderr}"
    );
    // A plugin a snapshotter owns: not a word.
    let out = add(PLUGIN, "op-2");
    assert_eq!(text(&out).1, "");
}

#[tokio::test]
async fn list_shows_age_and_status_counts_in_words() {
    let f = Fixture::new(&[]).await;
    assert!(opmon(&f, &["backup", "start", "b", "--uid", "u"])
        .status
        .success());
    let (stdout, _) = text(&opmon(&f, &["backup", "list"]));
    let mut lines = stdout.lines();
    let head = lines.next().unwrap_or_default();
    assert!(head.ends_with(" AGE"), "{stdout}");
    let row = lines.next().unwrap_or_default();
    let age = row.split_whitespace().last().unwrap_or_default();
    assert!(
        age.ends_with('s') && age.trim_end_matches('s').parse::<u64>().is_ok(),
        "{stdout}"
    );
    let (status, _) = text(&opmon(&f, &["status"]));
    assert!(
        status.contains("0 unfinished operations, 1 snapshotter\n"),
        "{status}"
    );
}

#[tokio::test]
async fn names_complete_from_the_running_agent() {
    let f = Fixture::new(&[]).await;
    for args in [
        ["backup", "start", "nightly-1", "--uid", "u1"],
        ["backup", "start", "nightly-2", "--uid", "u2"],
        ["restore", "start", "nightly-r", "--uid", "u3"],
    ] {
        assert!(opmon(&f, &args).status.success());
    }
    let socket = f.agent.socket.display().to_string();
    // What the script `opmon completions` prints makes the shell run at each tab.
    let complete_with = |variable: &str, words: &[&str]| {
        let out = Command::new(workspace_binary("opmon"))
            .env("COMPLETE", "fish")
            .env("OPMON_SOCKET", variable)
            .arg("--")
            .arg("opmon")
            .args(words)
            .output()
            .unwrap();
        assert!(out.status.success(), "{:?}", text(&out));
        let (stdout, _) = text(&out);
        // Names, not the flags offered beside them.
        stdout
            .lines()
            .map(|l| l.split('\t').next().unwrap_or("").to_string())
            .filter(|w| !w.starts_with('-'))
            .collect::<Vec<_>>()
    };
    let complete = |words: &[&str]| complete_with(&socket, words);
    assert_eq!(
        complete(&["backup", "describe", "night"]),
        ["nightly-1", "nightly-2"]
    );
    assert_eq!(complete(&["restore", "wait", ""]), ["nightly-r"]);
    assert_eq!(complete(&["snapshotter", "unregister", ""]), [PLUGIN]);
    // A --socket on the line being completed, before or after the subcommand, wins over
    // the variable, as it does when the command runs.
    let nowhere = "/nonexistent/opmon.sock";
    assert_eq!(
        complete_with(nowhere, &["--socket", &socket, "restore", "wait", ""]),
        ["nightly-r"]
    );
    assert_eq!(
        complete_with(nowhere, &["backup", "get", "--socket", &socket, "nightly-"]),
        ["nightly-1", "nightly-2"]
    );
    assert!(complete_with(nowhere, &["backup", "get", ""]).is_empty());
    let script = Command::new(workspace_binary("opmon"))
        .args(["completions", "bash"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&script.stdout).contains("COMPLETE=\"bash\""));
}

#[tokio::test]
async fn wait_on_a_narrow_terminal_keeps_every_line_within_its_width() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    // An item far wider than the terminal; its gate stays closed, so it goes on.
    let long = "x".repeat(120);
    opmon_tests::start_and_end_in_progress(
        &client.backups(),
        "wide",
        vec![opmon_tests::operation(PLUGIN, "gate-wide", &long, &[])],
    )
    .await;
    // A terminal of 60 columns (`script` gives the CLI a pty); wait gives up after 2 s.
    let command = format!(
        "stty cols 60 rows 24; {} --socket {} backup wait wide --timeout 2s",
        workspace_binary("opmon").display(),
        f.agent.socket.display()
    );
    let out = Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .output()
        .expect("script (util-linux) runs the CLI on a pty");
    let screen = String::from_utf8_lossy(&out.stdout);
    // Each drawn line is what stands between two cursor movements or line ends.
    let mut lines = Vec::new();
    let mut line = String::new();
    let mut chars = screen.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\u{1b}' => {
                // CSI: ESC [ parameters final-byte. A colour leaves the line going on.
                let mut seq = String::new();
                for c in chars.by_ref() {
                    seq.push(c);
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
                if !seq.ends_with('m') {
                    lines.push(std::mem::take(&mut line));
                }
            }
            '\r' | '\n' => lines.push(std::mem::take(&mut line)),
            c => line.push(c),
        }
    }
    lines.push(line);
    // A line exactly as wide as the terminal ends without a line break (the terminal
    // wraps): each bar's line is what runs from its start to the next one's.
    let mut drawn: Vec<String> = Vec::new();
    for segment in lines.iter().filter(|l| l.contains('[')) {
        let starts: Vec<usize> = segment
            .match_indices("backup wide ")
            .chain(segment.match_indices("  persistentvo"))
            .map(|(i, _)| i)
            .collect();
        let mut starts = starts;
        starts.sort_unstable();
        starts.push(segment.len());
        for pair in starts.windows(2) {
            drawn.push(segment[pair[0]..pair[1]].to_string());
        }
    }
    assert!(
        drawn.iter().any(|l| l.starts_with("backup wide "))
            && drawn.iter().any(|l| l.starts_with("  persistentvo")),
        "not every bar drawn: {screen:?}"
    );
    for l in &drawn {
        assert!(
            l.chars().count() <= 80,
            "{} columns: {l:?}",
            l.chars().count()
        );
    }
    // The owner's bar counts the bytes of its operation.
    assert!(
        drawn
            .iter()
            .any(|l| l.starts_with("backup wide ") && l.contains(" B/100 B")),
        "{drawn:#?}"
    );
}

#[tokio::test]
async fn describe_prints_times_in_the_local_zone_as_velero_does() {
    let f = Fixture::new(&[]).await;
    let owner = f.client.backups().start("b", "u").await.unwrap();
    let described = |tz: &str| {
        let out = Command::new(workspace_binary("opmon"))
            .env("TZ", tz)
            .arg("--socket")
            .arg(&f.agent.socket)
            .args(["backup", "describe", "b"])
            .output()
            .expect("running opmon");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let local = |offset: time::UtcOffset, zone: &str| {
        let t = owner.created.to_offset(offset);
        let (h, m) = (offset.whole_hours(), offset.minutes_past_hour());
        format!(
            "{:04}-{:02}-{:02} {:02}:{:02}:{:02} {}{:02}{:02} {zone}",
            t.year(),
            t.month() as u8,
            t.day(),
            t.hour(),
            t.minute(),
            t.second(),
            if offset.is_negative() { '-' } else { '+' },
            h.abs(),
            m.abs()
        )
    };
    // POSIX zones: no time zone database needed.
    for (tz, offset, zone) in [
        (
            "IST-5:30",
            time::UtcOffset::from_hms(5, 30, 0).unwrap(),
            "IST",
        ),
        ("XST8", time::UtcOffset::from_hms(-8, 0, 0).unwrap(), "XST"),
        ("UTC", time::UtcOffset::UTC, "UTC"),
    ] {
        let text = described(tz);
        let want = local(offset, zone);
        assert!(text.contains(&want), "TZ={tz}: no {want:?} in\n{text}");
    }
}

/// `opmon status` against `socket`, and what it printed on stderr.
fn status_at(socket: &std::path::Path, uid: Option<u32>) -> (Option<i32>, String) {
    use std::os::unix::process::CommandExt;
    let mut command = Command::new(workspace_binary("opmon"));
    command
        .env_remove("OPMON_SOCKET")
        .arg("--socket")
        .arg(socket);
    if let Some(uid) = uid {
        command.uid(uid).gid(uid);
    }
    let out = command.arg("status").output().expect("running opmon");
    (out.status.code(), text(&out).1)
}

#[test]
fn an_unreachable_agent_is_explained_by_its_cause() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("agent.sock");
    let (code, stderr) = status_at(&missing, None);
    assert_eq!(code, Some(2));
    assert_eq!(
        stderr,
        format!(
            "opmon: cannot connect to the opmon agent at {}: No such file or directory (os error 2). \
             Is the agent running? Start opmon-agent, or give its socket with --socket or OPMON_SOCKET.\n",
            missing.display()
        )
    );
    // A directory typed for the socket.
    let (_, stderr) = status_at(dir.path(), None);
    assert!(
        stderr.ends_with(
            "It is not a socket: --socket and OPMON_SOCKET name the agent's socket file.\n"
        ),
        "{stderr}"
    );
    // The socket file a killed agent leaves behind.
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let (_, stderr) = status_at(&stale, None);
    assert!(
        stderr.ends_with(
            "Connection refused (os error 111). Nothing listens on it: the agent has stopped.\n"
        ),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_user_the_socket_keeps_out_is_told_which_settings_let_users_in() {
    if !opmon_tests::root_or_skip("to run the CLI as another uid") {
        return;
    }
    let f = Fixture::new(&[]).await;
    let (code, stderr) = status_at(&f.agent.socket, Some(65534));
    assert_eq!(code, Some(2));
    assert!(
        stderr.ends_with(
            "Permission denied (os error 13). This user may not open the socket or its \
             directory: the agent's socket_mode and socket_group say who may \
             (docs/operations.md, \"Access and trust\").\n"
        ),
        "{stderr}"
    );
}

/// `--help` of `program` and of each of its subcommands, recursively: (the command
/// line, its text).
fn every_help(program: &str, words: &mut Vec<String>, found: &mut Vec<(String, String)>) {
    let out = Command::new(workspace_binary(program))
        .env_remove("OPMON_SOCKET")
        .args(words.iter())
        .arg("--help")
        .output()
        .expect("running --help");
    let (help, stderr) = text(&out);
    assert!(out.status.success(), "{program} {words:?} --help: {stderr}");
    let subcommands: Vec<String> = help
        .split("\nCommands:\n")
        .nth(1)
        .map(|rest| {
            rest.lines()
                .take_while(|line| line.starts_with("  "))
                .filter_map(|line| line.split_whitespace().next())
                .filter(|name| *name != "help")
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    found.push((format!("{program} {}", words.join(" ")), help));
    for name in subcommands {
        words.push(name);
        every_help(program, words, found);
        words.pop();
    }
}

#[test]
fn help_is_plain_text_without_rustdoc_markup() {
    let mut helps = Vec::new();
    every_help("opmon", &mut Vec::new(), &mut helps);
    every_help("opmon-agent", &mut Vec::new(), &mut helps);
    assert!(helps.len() > 20, "{} help texts", helps.len());
    for (command, help) in helps {
        // Doc comments become --help: an intra-doc link shows as its markup.
        assert!(
            !help.contains("](crate::") && !help.contains("[`"),
            "{command} --help:\n{help}"
        );
    }
}

#[test]
fn the_agents_bad_variables_are_named_as_variables_not_as_flags() {
    let agent = |env: &[(&str, &str)], args: &[&str]| {
        let out = opmon_tests::agent_command()
            .envs(env.iter().copied())
            .args(args)
            .arg("--print-config")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
        text(&out).1
    };
    let stderr = agent(&[("OPMON_POLL_INTERVAL", "fast")], &[]);
    assert!(
        stderr.starts_with(
            "error: OPMON_POLL_INTERVAL: invalid duration \"fast\": expected a number\n"
        ),
        "{stderr}"
    );
    let stderr = agent(&[("OPMON_LOG_FORMAT", "xml")], &[]);
    assert!(
        stderr.starts_with("error: OPMON_LOG_FORMAT: \"xml\" is not one of human, json\n"),
        "{stderr}"
    );
    // Typed, the flag is named, whatever the variable says.
    let stderr = agent(
        &[("OPMON_POLL_INTERVAL", "fast")],
        &["--poll-interval=slow"],
    );
    assert!(
        stderr.starts_with("error: invalid value 'slow' for '--poll-interval <POLL_INTERVAL>'"),
        "{stderr}"
    );
}

#[test]
fn each_commands_own_options_come_before_the_global_ones() {
    let mut helps = Vec::new();
    every_help("opmon", &mut Vec::new(), &mut helps);
    for (command, help) in helps {
        let (own, global) = help
            .split_once("\nGlobal options:\n")
            .unwrap_or_else(|| panic!("{command} --help has no global options:\n{help}"));
        assert!(
            !own.contains("--socket <") && global.contains("--socket <SOCKET>"),
            "{command} --help:\n{help}"
        );
    }
}

/// An operation waiting for a snapshotter that cannot be reached looks as if it were
/// running, but for its last error: `operations` and `wait` show it.
#[tokio::test]
async fn operations_and_wait_show_why_an_operation_waits() {
    let f = Fixture::new(&[]).await;
    let gone = f.dir.path().join("gone.sock");
    let gone = gone.to_str().expect("utf-8");
    for args in [
        &[
            "snapshotter",
            "register",
            "example.io/gone",
            "--snapshotter-socket",
            gone,
        ][..],
        &["backup", "start", "waits", "--uid", "u"],
        &[
            "backup",
            "add-operation",
            "waits",
            "--plugin",
            "example.io/gone",
            "--item",
            "pods/app/a",
            "--operation-id",
            "copy-1",
        ],
        &["backup", "end-in-progress", "waits"],
    ] {
        let out = opmon(&f, args);
        assert!(out.status.success(), "{args:?}: {}", text(&out).1);
    }
    // The agent polls it and records why it could not reach the snapshotter.
    let last_error = opmon_tests::eventually(
        "the operation's last error",
        std::time::Duration::from_secs(60),
        || {
            let ops = json_of(&opmon(&f, &["-o", "json", "backup", "operations", "waits"]));
            ops[0]["lastError"].as_str().map(str::to_string)
        },
    );
    assert!(last_error.contains("gone.sock"), "{last_error}");

    let (table, _) = text(&opmon(&f, &["backup", "operations", "waits"]));
    let mut lines = table.lines();
    assert!(
        lines
            .next()
            .unwrap_or_default()
            .ends_with("ERROR  LAST ERROR"),
        "{table}"
    );
    assert!(
        lines.next().unwrap_or_default().ends_with(&last_error),
        "{table}"
    );

    let out = opmon(&f, &["backup", "wait", "waits", "--timeout", "1s"]);
    let (stdout, _) = text(&out);
    assert!(
        stdout.contains(&format!(
            "  pods app/a copy-1 New 0 (last error: {last_error})\n"
        )),
        "{stdout}"
    );
}

/// A negative Go duration reaches the duration's parser, which names the flag, in the
/// CLI and the agent alike; clap would otherwise take `-1s` for a flag of its own.
#[test]
fn a_negative_duration_is_refused_naming_its_flag() {
    let out = Command::new(workspace_binary("opmon"))
        .args([
            "backup",
            "start",
            "b",
            "--uid",
            "u",
            "--item-operation-timeout",
            "-1s",
        ])
        .output()
        .expect("running opmon");
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out).1,
        "error: invalid value '-1s' for '--item-operation-timeout <ITEM_OPERATION_TIMEOUT>': \
         invalid duration \"-1s\": must not be negative\n\nFor more information, try '--help'.\n"
    );
    let out = Command::new(workspace_binary("opmon-agent"))
        .args(["--poll-interval", "-1s"])
        .output()
        .expect("running opmon-agent");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out)
            .1
            .starts_with("error: invalid value '-1s' for '--poll-interval <POLL_INTERVAL>': "),
        "{}",
        text(&out).1
    );
}
