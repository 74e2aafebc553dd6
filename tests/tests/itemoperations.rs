//! The `-itemoperations.json.gz` files are byte for byte what Velero's own encoder writes
//! for the same records. The judge is Go: `tests/go/itemoperations` decodes each file the
//! agent wrote with Velero's types (transcribed, unknown fields refused) and encodes it
//! again as Velero does; the bytes must be the file's, decompressed. Records cover
//! backups and restores, with and without post-operation items, errors, HTML
//! characters, line separators, non-ASCII text, a start at the Unix epoch, sub-second
//! times, unfinished, finished and canceled operations, and an owner without operations.
//!
//! Needs a Go toolchain (`apt-get install golang-go`; `.ci/run` installs it).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use opmon_client::{OwnerKind, OwnerPhase, PluginKind, ResourceIdentifier, StartParams, WaitUntil};
use opmon_tests::{operation, Fixture, PLUGIN};
use serde_json::Value;

const LONG: Duration = Duration::from_secs(120);

/// `go`'s version as (major, minor), failing with how to install it.
fn go_version() -> (u32, u32) {
    let out = Command::new("go")
        .args(["env", "GOVERSION"])
        .output()
        .unwrap_or_else(|e| {
            panic!("running go: {e}; install a Go toolchain: apt-get install golang-go")
        });
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text.trim().trim_start_matches("go");
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// Builds the Go program once into `dir`; returns the executable.
fn build_judge(dir: &Path) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("go/itemoperations/main.go");
    let exe = dir.join("itemoperations");
    let out = Command::new("go")
        .arg("build")
        .arg("-o")
        .arg(&exe)
        .arg(&source)
        // Standard library only: nothing to download, whatever the environment says.
        .env("GOPROXY", "off")
        .env("GOFLAGS", "")
        .env("GOTOOLCHAIN", "local")
        .env("GOCACHE", dir.join("gocache"))
        .output()
        .expect("running go build");
    assert!(
        out.status.success(),
        "go build {}: {}",
        source.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// What Velero's encoder writes for the records Velero's decoder reads from `file`.
fn velero_reencoded(judge: &Path, kind: OwnerKind, file: &Path) -> Vec<u8> {
    let out = Command::new(judge)
        .arg(kind.as_str())
        .arg(file)
        .output()
        .expect("running the Go judge");
    assert!(
        out.status.success(),
        "Velero's types refuse {}: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn gunzip(file: &Path) -> Vec<u8> {
    let out = Command::new("gzip")
        .arg("-dc")
        .arg(file)
        .output()
        .expect("running gzip");
    assert!(out.status.success(), "gzip -dc {}", file.display());
    out.stdout
}

/// The file's text, after checking that Go writes it again byte for byte.
fn check_file(judge: &Path, kind: OwnerKind, file: &Path) -> String {
    let agent = gunzip(file);
    let velero = velero_reencoded(judge, kind, file);
    let (a, v) = (
        String::from_utf8_lossy(&agent),
        String::from_utf8_lossy(&velero),
    );
    if agent != velero {
        let at = agent
            .iter()
            .zip(&velero)
            .position(|(x, y)| x != y)
            .unwrap_or(agent.len().min(velero.len()));
        panic!(
            "{} differs from Velero's encoding at byte {at}:\nagent:  {a:?}\nvelero: {v:?}",
            file.display()
        );
    }
    a.into_owned()
}

fn restore_op(id: &str, item: &str, post: &[&str]) -> opmon_client::NewOperation {
    let mut op = operation(PLUGIN, id, item, post);
    op.plugin.kind = PluginKind::RestoreItemAction;
    op
}

#[tokio::test]
async fn item_operation_files_are_byte_for_byte_what_veleros_encoder_writes() {
    let (major, minor) = go_version();
    let go_writes_short_escapes = (major, minor) >= (1, 22);
    let f = Fixture::new(&[]).await;
    let judge = build_judge(f.dir.path());
    let storage = f.agent.state_dir.join("storage");
    let client = f.agent.client().await;

    // A backup with every kind of record, the server's object given to the snapshotter.
    let backups = client.backups();
    backups
        .request::<opmon_client::methods::Start>(StartParams {
            name: "b-1".into(),
            uid: "3f5c<&>-uid".into(),
            object: Some(serde_json::json!({"metadata": {"namespace": "velero"}})),
            ..StartParams::default()
        })
        .await
        .unwrap();
    let role = ResourceIdentifier {
        group: "rbac.authorization.k8s.io".into(),
        resource: "clusterroles".into(),
        namespace: String::new(),
        name: "system:aggregate-to-admin".into(),
    };
    let mut failing = operation(PLUGIN, "fail-1", "unused", &[]);
    failing.resource = role.clone();
    let mut odd = operation(PLUGIN, "odd-1 <&>", "dätä-<&>-\u{2028}", &["a<b>&c"]);
    // When the plugin returned, an hour ago: Velero writes it to the second, cut off.
    let created = (time::OffsetDateTime::now_utc() - time::Duration::HOUR)
        .replace_nanosecond(999_999_999)
        .unwrap();
    odd.created = Some(created);
    let created_text = format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        created.year(),
        u8::from(created.month()),
        created.day(),
        created.hour(),
        created.minute(),
        created.second()
    );
    let mut ops = vec![
        operation(PLUGIN, "done-1", "data", &["vsb-1", "shared"]),
        failing,
        odd,
        operation(PLUGIN, "gate-1", "slow", &[]),
        operation(PLUGIN, "never-c", "stuck", &[]),
    ];
    if go_writes_short_escapes {
        ops.push(operation(PLUGIN, "ctl-1", "ctl", &[]));
    }
    backups.add_operations("b-1", ops).await.unwrap();
    let owner = backups.end_in_progress("b-1").await.unwrap();
    assert_eq!(
        owner.phase,
        OwnerPhase::WaitingForPluginOperationsPartiallyFailed
    );
    let backup_file = storage.join("backups/b-1/b-1-itemoperations.json.gz");
    let text = check_file(&judge, OwnerKind::Backup, &backup_file);
    assert!(text.ends_with("]\n"), "{text}");
    // Facts Go's round trip cannot see (it writes back whatever it read for these):
    // no post-operation items is Velero's nil slice, `null`.
    assert!(
        text.contains(r#""operationID":"fail-1","postOperationItems":null}"#),
        "{text}"
    );
    assert!(
        text.contains(r#""Name":"a\u003cb\u003e\u0026c"}]"#),
        "{text}"
    );
    assert!(
        text.contains(r#""description":"\u003cb\u003efast\u003c/b\u003e \u0026 ☃""#),
        "{text}"
    );
    // The plugin's own times: a start at the Unix epoch is a start, and `updated` is
    // the one it reported (09:57:45.678), not when the agent saw it.
    assert!(
        text.contains(&format!(
            r#""created":"{created_text}","started":"1970-01-01T00:00:00Z","updated":"2026-11-22T09:57:45Z"}}"#
        )),
        "{text}"
    );
    assert!(!text.contains(r#""error":"""#), "{text}");
    if go_writes_short_escapes {
        assert!(
            text.contains(r#""error":"bell\u0007 back\b feed\f del"#),
            "{text}"
        );
    }
    // `itemOperations` answers the same records.
    let via_api = serde_json::to_value(backups.item_operations("b-1").await.unwrap()).unwrap();
    assert_eq!(via_api, serde_json::from_str::<Value>(&text).unwrap());

    // A canceled operation: Velero has no Canceled, so the file says Failed, with the
    // reason in the error.
    let canceled = backups
        .request::<opmon_client::methods::Cancel>(opmon_client::CancelParams {
            name: "b-1".into(),
            operations: Some(vec![opmon_client::OperationSelector::Id("never-c".into())]),
            reason: Some("<&> stop".into()),
        })
        .await
        .unwrap();
    assert_eq!(canceled.canceled, 1);
    let text = check_file(&judge, OwnerKind::Backup, &backup_file);
    assert!(
        text.contains(
            r#""operationID":"never-c","postOperationItems":null},"status":{"phase":"Failed","error":"canceled: \u003c\u0026\u003e stop""#
        ),
        "{text}"
    );

    // Rewritten once everything finished: still Velero's bytes.
    f.open_gate("gate-1");
    let owner = backups
        .wait("b-1", WaitUntil::ReadyToFinalize, LONG)
        .await
        .unwrap()
        .owner;
    assert_eq!(owner.phase, OwnerPhase::FinalizingPartiallyFailed);
    let text = check_file(&judge, OwnerKind::Backup, &backup_file);
    assert!(text.contains(r#""operationID":"gate-1","postOperationItems":null},"status":{"phase":"Completed","nCompleted":100"#), "{text}");

    // A restore: its records have no post-operation items (addOperations refuses them).
    let restores = client.restores();
    let owner = opmon_tests::start_and_end_in_progress(
        &restores,
        "r-1",
        vec![
            restore_op("done-r", "data", &[]),
            restore_op("odd-r", "ü", &[]),
            restore_op("fail-r", "gone", &[]),
        ],
    )
    .await;
    assert_eq!(owner.phase, OwnerPhase::PartiallyFailed);
    let restore_file = storage.join("restores/r-1/restore-r-1-itemoperations.json.gz");
    let text = check_file(&judge, OwnerKind::Restore, &restore_file);
    assert!(!text.contains("postOperationItems"), "{text}");
    assert!(
        text.contains(r#""restoreItemAction":"example.io/copier""#),
        "{text}"
    );
    let via_api = serde_json::to_value(restores.item_operations("r-1").await.unwrap()).unwrap();
    assert_eq!(via_api, serde_json::from_str::<Value>(&text).unwrap());

    // An owner without operations: an empty list, as Velero's request initialises it.
    let owner = opmon_tests::start_and_end_in_progress(&backups, "empty", vec![]).await;
    assert_eq!(owner.phase, OwnerPhase::Finalizing);
    let text = check_file(
        &judge,
        OwnerKind::Backup,
        &storage.join("backups/empty/empty-itemoperations.json.gz"),
    );
    assert_eq!(text, "[]\n");
}
