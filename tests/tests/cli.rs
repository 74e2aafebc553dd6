//! End-to-end: the `opmon` CLI against a real agent.

use std::process::{Command, Output};

use opmon_client::{FinalizeParams, NameParams, OwnerKind};
use opmon_tests::{workspace_binary, Fixture, PLUGIN};
use serde_json::{json, Value};

fn opmon(f: &Fixture, args: &[&str]) -> Output {
    Command::new(workspace_binary("opmon"))
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
    let f = Fixture::new(&[]).await;
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
    assert_eq!(deleted, json!({"cancelled": 0}));
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
        lines.contains(&"  gate-a InProgress 30/100 byte (30%)"),
        "{rest}"
    );
    assert!(
        lines.contains(&"  done-b Completed 100/100 byte (100%)"),
        "{rest}"
    );
    assert!(
        lines.contains(&"backup lines: Finalizing (2/2 operations completed, 0 failed)"),
        "{rest}"
    );
    assert!(
        lines.contains(&"  gate-a Completed 100/100 byte (100%)"),
        "{rest}"
    );
    assert_eq!(lines.last(), Some(&"backup lines is Finalizing"));
    let describe = opmon(&f, &["backup", "describe", "lines", "--details"]);
    let text = String::from_utf8_lossy(&describe.stdout);
    assert!(text.contains("Operation for pods app/a:"), "{text}");
    assert!(
        text.contains("  Backup Item Action Plugin:  example.io/copier"),
        "{text}"
    );
    assert!(
        text.contains("  Progress:                   100/100 byte (100%)"),
        "{text}"
    );
}
