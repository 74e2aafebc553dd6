//! End-to-end: item-operation files in the storage directory and the finalize step,
//! with real tarballs built and read by the system `tar` and `gzip`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use opmon_client::{
    codes, Contents, FinalizeParams, OwnerPhase, ResourceIdentifier, StartParams, UpdatedItem,
    WaitUntil,
};
use opmon_tests::{operation, pvc, restore_operation, Fixture, PLUGIN};
use serde_json::{json, Value};

const LONG: Duration = Duration::from_secs(120);

fn run(cmd: &mut Command) -> Vec<u8> {
    let out = cmd.output().expect("running a system tool");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Writes a backup's resources in Velero's layout under `tree`; returns every file
/// with its content.
fn velero_tree(tree: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    files.insert("metadata/version".to_string(), b"1\n".to_vec());
    for dir in ["", "v1-preferredversion/"] {
        files.insert(
            format!("resources/persistentvolumeclaims/{dir}namespaces/app/data.json"),
            br#"{"apiVersion":"v1","kind":"PersistentVolumeClaim","status":{"phase":"Pending"}}"#
                .to_vec(),
        );
        files.insert(
            format!("resources/persistentvolumes/{dir}cluster/pv-data.json"),
            br#"{"apiVersion":"v1","kind":"PersistentVolume"}"#.to_vec(),
        );
        for i in 0..150 {
            files.insert(
                format!("resources/configmaps/{dir}namespaces/app/cm-{i}.json"),
                format!(r#"{{"apiVersion":"v1","kind":"ConfigMap","data":{{"n":"{i}"}}}}"#)
                    .into_bytes(),
            );
        }
    }
    for (path, content) in &files {
        let full = tree.join(path);
        std::fs::create_dir_all(full.parent().unwrap()).unwrap();
        std::fs::write(full, content).unwrap();
    }
    files
}

/// `tree`'s metadata and resources, gzipped by GNU tar into `tarball`.
fn tar_gz(tree: &Path, tarball: &Path) {
    run(Command::new("tar")
        .arg("-czf")
        .arg(tarball)
        .arg("-C")
        .arg(tree)
        .args(["metadata", "resources"]));
}

fn listing(tarball: &Path) -> Vec<String> {
    String::from_utf8(run(Command::new("tar").arg("-tzf").arg(tarball)))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

fn gunzip_json(path: &Path) -> Value {
    serde_json::from_slice(&run(Command::new("gzip").arg("-dc").arg(path))).unwrap()
}

fn keys(v: &Value) -> Vec<&str> {
    let mut k: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    k.sort();
    k
}

#[tokio::test]
async fn a_backup_is_finalized_with_its_tarball_rewritten_and_its_files_on_disk() {
    let f = Fixture::new(&[]).await;
    let storage = f.agent.state_dir.join("storage");
    let tree = f.dir.path().join("tree");
    let files = velero_tree(&tree);
    let backup_dir = storage.join("backups/nightly");
    std::fs::create_dir_all(&backup_dir).unwrap();
    let input = backup_dir.join("nightly.tar.gz");
    tar_gz(&tree, &input);

    let nightly =
        f.backup("nightly")
            .uid("uid-7")
            .operation(operation(PLUGIN, "gate-1", "data", &["data"]));
    nightly.end_in_progress().await;

    // Leaving InProgress wrote the file already, with the operation still running.
    let records_file = backup_dir.join("nightly-itemoperations.json.gz");
    let early = gunzip_json(&records_file);
    assert_eq!(early[0]["status"]["phase"], "InProgress");

    f.open_gate("gate-1");
    let owner = nightly.wait(WaitUntil::ReadyToFinalize).await;
    assert_eq!(owner.phase, OwnerPhase::Finalizing);
    let backups = f.client.backups();

    let pvc_now =
        json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "status": {"phase": "Bound"}});
    let pv_now = json!({"apiVersion": "v1", "kind": "PersistentVolume", "spec": {"csi": {"volumeHandle": "h"}}});
    let vsb = json!({"apiVersion": "velero.io/v1", "kind": "VolumeSnapshotBackup", "status": {"phase": "Completed"}});
    let params = FinalizeParams {
        name: "nightly".into(),
        contents: Some(Contents {
            input: "backups/nightly/nightly.tar.gz".into(),
            output: "backups/nightly/nightly-finalized.tar.gz".into(),
        }),
        updated_items: vec![
            UpdatedItem {
                resource: pvc("data"),
                object: pvc_now.clone(),
            },
            UpdatedItem {
                resource: ResourceIdentifier {
                    group: String::new(),
                    resource: "persistentvolumes".into(),
                    namespace: String::new(),
                    name: "pv-data".into(),
                },
                object: pv_now.clone(),
            },
            UpdatedItem {
                resource: ResourceIdentifier {
                    group: "velero.io".into(),
                    resource: "volumesnapshotbackups".into(),
                    namespace: "app".into(),
                    name: "vsb-1".into(),
                },
                object: vsb.clone(),
            },
        ],
        ..Default::default()
    };
    let result = backups
        .request::<opmon_client::methods::Finalize>(params.clone())
        .await
        .unwrap();
    assert_eq!(result.owner.phase, OwnerPhase::Completed);
    assert_eq!((result.replaced, result.added), (4, 2));
    let output = backup_dir.join("nightly-finalized.tar.gz");
    assert_eq!(result.contents_file.as_deref(), Some(output.as_path()));
    assert_eq!(result.item_operations_file, records_file);

    // The listing is the input's, in order, with the two appended entries at the end.
    let mut expected = listing(&input);
    expected.push("resources/volumesnapshotbackups.velero.io/namespaces/app/vsb-1.json".into());
    expected.push(
        "resources/volumesnapshotbackups.velero.io/v1-preferredversion/namespaces/app/vsb-1.json"
            .into(),
    );
    assert_eq!(listing(&output), expected);
    let verbose = String::from_utf8(run(Command::new("tar").arg("-tzvf").arg(&output))).unwrap();
    assert_eq!(verbose.lines().count(), expected.len());

    // Extracted, every file is the original except the updated items.
    let out_tree = f.dir.path().join("extracted");
    std::fs::create_dir_all(&out_tree).unwrap();
    run(Command::new("tar")
        .arg("-xzf")
        .arg(&output)
        .arg("-C")
        .arg(&out_tree));
    let replaced: BTreeMap<&str, &Value> = [
        (
            "resources/persistentvolumeclaims/namespaces/app/data.json",
            &pvc_now,
        ),
        (
            "resources/persistentvolumeclaims/v1-preferredversion/namespaces/app/data.json",
            &pvc_now,
        ),
        ("resources/persistentvolumes/cluster/pv-data.json", &pv_now),
        (
            "resources/persistentvolumes/v1-preferredversion/cluster/pv-data.json",
            &pv_now,
        ),
    ]
    .into();
    for (path, original) in &files {
        let got = std::fs::read(out_tree.join(path)).unwrap();
        match replaced.get(path.as_str()) {
            Some(object) => assert_eq!(
                serde_json::from_slice::<Value>(&got).unwrap(),
                **object,
                "{path}"
            ),
            None => assert_eq!(&got, original, "{path} changed"),
        }
    }
    for path in &expected[expected.len() - 2..] {
        let got: Value =
            serde_json::from_slice(&std::fs::read(out_tree.join(path)).unwrap()).unwrap();
        assert_eq!(got, vsb);
    }

    // The item-operations file, decoded by plain gzip, has Velero's field names.
    let records = gunzip_json(&records_file);
    let record = &records[0];
    assert_eq!(records.as_array().unwrap().len(), 1);
    assert_eq!(keys(record), ["spec", "status"]);
    let spec = &record["spec"];
    assert_eq!(
        keys(spec),
        [
            "backupItemAction",
            "backupName",
            "backupUID",
            "operationID",
            "postOperationItems",
            "resourceIdentifier"
        ]
    );
    assert_eq!(spec["backupName"], "nightly");
    assert_eq!(spec["backupUID"], "uid-7");
    assert_eq!(spec["backupItemAction"], PLUGIN);
    assert_eq!(spec["operationID"], "gate-1");
    let data = json!({"Group": "", "Resource": "persistentvolumeclaims", "Namespace": "app", "Name": "data"});
    assert_eq!(spec["resourceIdentifier"], data);
    assert_eq!(spec["postOperationItems"], json!([data]));
    let status = &record["status"];
    // Velero's status fields are `omitempty`: no error, and no `updated` since the
    // snapshotter reported none (tests/tests/itemoperations.rs checks every byte).
    assert_eq!(
        keys(status),
        [
            "created",
            "description",
            "nCompleted",
            "nTotal",
            "operationUnits",
            "phase",
            "started"
        ]
    );
    assert_eq!(status["phase"], "Completed");
    assert_eq!(
        (status["nCompleted"].as_i64(), status["nTotal"].as_i64()),
        (Some(100), Some(100))
    );
    assert_eq!(status["operationUnits"], "byte");
    assert_eq!(status["description"], "done");
    for time in ["created", "started"] {
        let text = status[time]
            .as_str()
            .unwrap_or_else(|| panic!("{time} is not a string"));
        time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
            .unwrap_or_else(|e| panic!("{time} {text:?}: {e}"));
        assert!(text.ends_with('Z'), "{time} is UTC: {text}");
    }
    // itemOperations returns the same records.
    let via_api = serde_json::to_value(backups.item_operations("nightly").await.unwrap()).unwrap();
    assert_eq!(via_api, records);

    // Finalizing again returns the same result, and rewrites nothing.
    let before = std::fs::metadata(&output).unwrap().modified().unwrap();
    let again = backups
        .request::<opmon_client::methods::Finalize>(params)
        .await
        .unwrap();
    assert_eq!(again, result);
    assert_eq!(
        std::fs::metadata(&output).unwrap().modified().unwrap(),
        before
    );
}

/// A gzipped tarball with one symbolic link, written by the system tar.
/// Backups `names`, each with one operation done, ready to finalize; returns the
/// storage directory, holding `in.tar.gz` (a Velero tree).
async fn ready_to_finalize(f: &Fixture, names: &[&str]) -> PathBuf {
    let backups = f.client.backups();
    for name in names {
        let gate = format!("gate-{name}");
        opmon_tests::start_and_end_in_progress(
            &backups,
            name,
            vec![operation(PLUGIN, &gate, "a", &[])],
        )
        .await;
        f.open_gate(&gate);
        backups
            .wait(name, WaitUntil::ReadyToFinalize, LONG)
            .await
            .unwrap();
    }
    let storage = f.agent.state_dir.join("storage");
    let tree = f.dir.path().join("tree");
    velero_tree(&tree);
    tar_gz(&tree, &storage.join("in.tar.gz"));
    storage
}

#[tokio::test]
async fn finalize_keeps_off_the_agents_files_other_outputs_and_corrupt_gzip() {
    let f = Fixture::new(&[]).await;
    let backups = f.client.backups();
    let storage = ready_to_finalize(&f, &["first", "second"]).await;
    let input = storage.join("in.tar.gz");
    let finalize = |name: &str, input: &str, output: &str| FinalizeParams {
        name: name.into(),
        contents: Some(Contents {
            input: input.into(),
            output: output.into(),
        }),
        ..Default::default()
    };
    let first = backups
        .request::<opmon_client::methods::Finalize>(finalize(
            "first",
            "in.tar.gz",
            "out/first.tar.gz",
        ))
        .await
        .unwrap();
    assert_eq!(first.owner.phase, OwnerPhase::Completed);
    let first_output = std::fs::read(storage.join("out/first.tar.gz")).unwrap();
    let first_records = std::fs::read(&first.item_operations_file).unwrap();

    // A gzip trailer that does not match the data: GNU gzip says so, and so does the
    // agent, rather than writing the damage out under a fresh CRC.
    let mut corrupt = std::fs::read(&input).unwrap();
    let n = corrupt.len();
    corrupt[n - 8] ^= 0xff;
    std::fs::write(storage.join("corrupt.tar.gz"), &corrupt).unwrap();
    let gzip_t = Command::new("gzip")
        .arg("-t")
        .arg(storage.join("corrupt.tar.gz"))
        .output()
        .unwrap();
    assert!(!gzip_t.status.success(), "gzip -t finds the corruption");

    let refusals = [
        (
            finalize("second", "corrupt.tar.gz", "out/second.tar.gz"),
            "after the end of the archive: ",
        ),
        (
            finalize(
                "second",
                "in.tar.gz",
                "backups/first/first-itemoperations.json.gz",
            ),
            "backups/first/first-itemoperations.json.gz: the item operations file of backup \
             first, which the agent writes; choose another path",
        ),
        (
            finalize(
                "second",
                "in.tar.gz",
                "backups/second/second-itemoperations.json.gz",
            ),
            "the item operations file of backup second, which the agent writes",
        ),
        (
            // Refused before the input is read: its corruption is never reached.
            finalize("second", "corrupt.tar.gz", "out/first.tar.gz"),
            "out/first.tar.gz: the finalized output of backup first; choose another path",
        ),
        (
            finalize("second", "in.tar.gz", "out/.opmon-final.tmp"),
            "contents.output out/.opmon-final.tmp: named like the agent's temporary files \
             (.opmon-*.tmp), which it removes when it starts; choose another name",
        ),
        (
            finalize("second", "in.tar.gz", "missing/../out/second.tar.gz"),
            "contents.output missing/../out/second.tar.gz: a `..` in it follows a directory \
             that does not exist, so it cannot be resolved",
        ),
    ];
    for (params, expected) in refusals {
        let output = params.contents.as_ref().map(|c| c.output.clone());
        let err = backups
            .request::<opmon_client::methods::Finalize>(params)
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            Some(codes::FINALIZE_FAILED),
            "{output:?}: {err}"
        );
        assert!(err.to_string().contains(expected), "{output:?}: {err}");
        assert_eq!(
            backups.get("second").await.unwrap().phase,
            OwnerPhase::Finalizing
        );
    }
    assert!(!storage.join("out/second.tar.gz").exists());
    assert_eq!(
        std::fs::read(storage.join("out/first.tar.gz")).unwrap(),
        first_output
    );
    assert_eq!(
        std::fs::read(&first.item_operations_file).unwrap(),
        first_records
    );

    // A path of its own is fine.
    let second = backups
        .request::<opmon_client::methods::Finalize>(finalize(
            "second",
            "in.tar.gz",
            "out/second.tar.gz",
        ))
        .await
        .unwrap();
    assert_eq!(second.owner.phase, OwnerPhase::Completed);
    assert!(listing(&storage.join("out/second.tar.gz")).contains(&"metadata/version".to_string()));
}

/// Two backups naming one output at once: the check that no other owner's result names
/// it and the storing of the result are one step per output path, so one finalizes and
/// the others are refused, and the output is the winner's (before, each could pass the
/// check before any stored its result, and the last rename won under every result).
#[tokio::test]
async fn concurrent_finalizes_of_backups_naming_one_output_finalize_one() {
    let f = Fixture::new(&[]).await;
    let backups = f.client.backups();
    let names = ["b0", "b1", "b2", "b3"];
    let storage = ready_to_finalize(&f, &names).await;
    let finalize = |name: &str, output: &str| FinalizeParams {
        name: name.into(),
        contents: Some(Contents {
            input: "in.tar.gz".into(),
            output: output.into(),
        }),
        ..Default::default()
    };
    // One file, spelt four ways (`out/..` needs `out` to exist).
    std::fs::create_dir_all(storage.join("out")).unwrap();
    let absolute = storage.join("out/shared.tar.gz");
    let spellings = [
        "out/shared.tar.gz",
        "out/./shared.tar.gz",
        "out/../out/shared.tar.gz",
        absolute.to_str().unwrap(),
    ];
    let answers = futures::future::join_all(names.iter().zip(spellings).map(|(name, output)| {
        std::future::IntoFuture::into_future(
            backups.request::<opmon_client::methods::Finalize>(finalize(name, output)),
        )
    }))
    .await;
    let winners: Vec<_> = answers.iter().filter_map(|a| a.as_ref().ok()).collect();
    assert_eq!(winners.len(), 1, "{answers:?}");
    let winner = &winners[0].owner.name;
    assert_eq!(winners[0].owner.phase, OwnerPhase::Completed);
    for (name, answer) in names.iter().zip(&answers) {
        let Err(err) = answer else { continue };
        assert_eq!(err.code(), Some(codes::FINALIZE_FAILED), "{name}: {err}");
        assert!(
            err.to_string().contains(&format!(
                "shared.tar.gz: the finalized output of backup {winner}; choose another path"
            )),
            "{name}: {err}"
        );
        assert_eq!(
            backups.get(name).await.unwrap().phase,
            OwnerPhase::Finalizing
        );
        // Its own path is fine afterwards.
        let own = backups
            .request::<opmon_client::methods::Finalize>(finalize(
                name,
                &format!("out/{name}.tar.gz"),
            ))
            .await
            .unwrap();
        assert_eq!(own.owner.phase, OwnerPhase::Completed);
    }
    assert!(listing(&storage.join("out/shared.tar.gz")).contains(&"metadata/version".to_string()));
    let leftovers: Vec<_> = std::fs::read_dir(storage.join("out"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.ends_with(".tar.gz"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
}

fn tarball_with_symlink(dir: &Path) -> PathBuf {
    let tree = dir.join("evil-tree");
    std::fs::create_dir_all(tree.join("resources")).unwrap();
    std::fs::write(tree.join("resources/ok.json"), b"{}").unwrap();
    std::os::unix::fs::symlink("/etc/shadow", tree.join("resources/link.json")).unwrap();
    let tarball = dir.join("evil.tar.gz");
    run(Command::new("tar")
        .arg("-czf")
        .arg(&tarball)
        .arg("-C")
        .arg(&tree)
        .arg("resources"));
    tarball
}

#[tokio::test]
async fn finalize_refuses_the_wrong_phase_and_a_hostile_tarball_leaving_nothing_behind() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    opmon_tests::start_and_end_in_progress(
        &backups,
        "b",
        vec![operation(PLUGIN, "gate-1", "a", &[])],
    )
    .await;
    let early = backups
        .request::<opmon_client::methods::Finalize>(FinalizeParams {
            name: "b".into(),
            contents: None,
            updated_items: vec![],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(early.code(), Some(codes::WRONG_PHASE));
    assert_eq!(
        early.to_string(),
        "backup b is WaitingForPluginOperations; finalize needs Finalizing or FinalizingPartiallyFailed (code 1003)"
    );
    f.open_gate("gate-1");
    backups
        .wait("b", WaitUntil::ReadyToFinalize, LONG)
        .await
        .unwrap();

    let storage = f.agent.state_dir.join("storage");
    std::fs::create_dir_all(&storage).unwrap();
    let input = storage.join("evil.tar.gz");
    std::fs::rename(tarball_with_symlink(f.dir.path()), &input).unwrap();
    let output = storage.join("out/b.tar.gz");
    let err = backups
        .request::<opmon_client::methods::Finalize>(FinalizeParams {
            name: "b".into(),
            contents: Some(Contents {
                input: input.clone(),
                output: output.clone(),
            }),
            updated_items: vec![],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(codes::FINALIZE_FAILED));
    assert!(
        err.to_string()
            .contains("entry resources/link.json: symbolic links are not allowed"),
        "{err}"
    );
    assert!(!output.exists(), "no partial output");
    let leftovers: Vec<_> = std::fs::read_dir(output.parent().unwrap())
        .unwrap()
        .collect();
    assert!(
        leftovers.is_empty(),
        "no temporary files left: {leftovers:?}"
    );
    assert_eq!(
        backups.get("b").await.unwrap().phase,
        OwnerPhase::Finalizing
    );

    // Without contents it only moves the phase and writes the file.
    let done = backups
        .request::<opmon_client::methods::Finalize>(FinalizeParams {
            name: "b".into(),
            contents: None,
            updated_items: vec![],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(done.owner.phase, OwnerPhase::Completed);
    assert_eq!(done.contents_file, None);
    assert!(done.item_operations_file.exists());
}

#[tokio::test]
async fn an_opted_in_restore_is_finalized_and_restore_files_use_velero_names() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let restores = client.restores();
    restores
        .request::<opmon_client::methods::Start>(StartParams {
            name: "r".into(),
            uid: "ru".into(),
            finalize: Some(true),
            ..Default::default()
        })
        .await
        .unwrap();
    restores
        .add_operations("r", vec![restore_operation(PLUGIN, "fail-1", "a")])
        .await
        .unwrap();
    let owner = restores.end_in_progress("r").await.unwrap();
    assert_eq!(owner.phase, OwnerPhase::FinalizingPartiallyFailed);
    let result = restores
        .request::<opmon_client::methods::Finalize>(FinalizeParams {
            name: "r".into(),
            contents: None,
            updated_items: vec![],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(result.owner.phase, OwnerPhase::PartiallyFailed);
    let file = f
        .agent
        .state_dir
        .join("storage/restores/r/restore-r-itemoperations.json.gz");
    assert_eq!(result.item_operations_file, file);
    let records = gunzip_json(&file);
    assert_eq!(
        keys(&records[0]["spec"]),
        // Velero's RestoreOperationSpec has no postOperationItems.
        [
            "operationID",
            "resourceIdentifier",
            "restoreItemAction",
            "restoreName",
            "restoreUID"
        ]
    );
    assert_eq!(records[0]["status"]["error"], "copy failed");

    // A plain restore never finalizes.
    restores.start("plain", "u").await.unwrap();
    restores.end_in_progress("plain").await.unwrap();
    let err = restores
        .request::<opmon_client::methods::Finalize>(FinalizeParams {
            name: "plain".into(),
            contents: None,
            updated_items: vec![],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(codes::WRONG_PHASE));
    // Deleting removes the files.
    restores.delete("r").await.unwrap();
    assert!(!file.exists());
}

/// Builds `tests/go/velero-tar` (Go's standard library only) into `dir`.
fn velero_tar(dir: &Path) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("go/velero-tar/main.go");
    let binary = dir.join("velero-tar");
    run(Command::new("go")
        .arg("build")
        .arg("-o")
        .arg(&binary)
        .arg(&source)
        .env("GOCACHE", dir.join("gocache"))
        .env("GOPATH", dir.join("gopath"))
        .env("GO111MODULE", "off")
        .current_dir(dir));
    binary
}

/// What Go's archive/tar reads: one JSON object per entry, and the gzip member count.
fn go_listing(binary: &Path, tarball: &Path) -> (Vec<Value>, String) {
    let text = String::from_utf8(run(Command::new(binary).arg("list").arg(tarball))).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    let members = lines.pop().unwrap().to_string();
    let entries = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (entries, members)
}

/// What Python's tarfile reads: `[name, mode, uid, uname, mtime, size]` per member.
fn python_listing(tarball: &Path) -> Vec<Value> {
    let script = "import json, sys, tarfile\n\
        with tarfile.open(sys.argv[1]) as t:\n\
        \x20   print(json.dumps([[m.name, m.mode, m.uid, m.uname, m.mtime, m.size] for m in t]))\n";
    serde_json::from_slice(&run(Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(tarball)))
    .unwrap()
}

#[tokio::test]
async fn a_velero_layout_hpa_is_finalized_as_velero_does_and_read_by_gnu_tar_python_and_go() {
    let f = Fixture::new(&[]).await;
    let storage = f.agent.state_dir.join("storage");
    let tree = f.dir.path().join("hpa-tree");
    let hpa = "resources/horizontalpodautoscalers.autoscaling";
    let cm = "resources/configmaps/namespaces/app/settings.json";
    let old_v2 = br#"{"apiVersion":"autoscaling/v2","kind":"HorizontalPodAutoscaler","spec":{"maxReplicas":3}}"#;
    let old_v1 = br#"{"apiVersion":"autoscaling/v1","kind":"HorizontalPodAutoscaler","spec":{"maxReplicas":3}}"#;
    let files: Vec<(String, &[u8])> = vec![
        ("metadata/version".into(), b"1.1.0\n"),
        (format!("{hpa}/namespaces/app/web.json"), old_v2),
        (format!("{hpa}/v1/namespaces/app/web.json"), old_v1),
        (
            format!("{hpa}/v2-preferredversion/namespaces/app/web.json"),
            old_v2,
        ),
        // Only at the plain path, as some older backups have it.
        (cm.into(), br#"{"apiVersion":"v1","kind":"ConfigMap"}"#),
    ];
    for (path, content) in &files {
        std::fs::create_dir_all(tree.join(path).parent().unwrap()).unwrap();
        std::fs::write(tree.join(path), content).unwrap();
    }
    let input = storage.join("backups/web/web.tar.gz");
    std::fs::create_dir_all(input.parent().unwrap()).unwrap();
    tar_gz(&tree, &input);

    let client = f.agent.client().await;
    let backups = client.backups();
    backups.start("web", "uid-web").await.unwrap();
    assert_eq!(
        backups.end_in_progress("web").await.unwrap().phase,
        OwnerPhase::Finalizing
    );
    let hpa_new = json!({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "web", "namespace": "app"}, "status": {"currentReplicas": 2}});
    let cm_new = json!({"apiVersion": "v1", "kind": "ConfigMap", "data": {"k": "v"}});
    // Absent from the tarball, with names that take the ustar prefix and a PAX header.
    let widget_name = "w".repeat(80);
    let widget = json!({"apiVersion": "example.com/v1alpha1", "kind": "Widget"});
    let crd_name = format!("{}.example.com", "c".repeat(180));
    let crd = json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition"});
    let resource = |group: &str, resource: &str, namespace: &str, name: &str| ResourceIdentifier {
        group: group.into(),
        resource: resource.into(),
        namespace: namespace.into(),
        name: name.into(),
    };
    let before = time::OffsetDateTime::now_utc().unix_timestamp();
    let result = backups
        .request::<opmon_client::methods::Finalize>(FinalizeParams {
            name: "web".into(),
            contents: Some(Contents {
                input: "backups/web/web.tar.gz".into(),
                output: "backups/web/web-final.tar.gz".into(),
            }),
            updated_items: vec![
                UpdatedItem {
                    resource: resource("autoscaling", "horizontalpodautoscalers", "app", "web"),
                    object: hpa_new.clone(),
                },
                UpdatedItem {
                    resource: resource("", "configmaps", "app", "settings"),
                    object: cm_new.clone(),
                },
                UpdatedItem {
                    resource: resource("example.com", "widgets", "app", &widget_name),
                    object: widget.clone(),
                },
                UpdatedItem {
                    resource: resource(
                        "apiextensions.k8s.io",
                        "customresourcedefinitions",
                        "",
                        &crd_name,
                    ),
                    object: crd.clone(),
                },
            ],
            ..Default::default()
        })
        .await
        .unwrap();
    let after = time::OffsetDateTime::now_utc().unix_timestamp();
    assert_eq!((result.replaced, result.added), (3, 5));
    let output = storage.join("backups/web/web-final.tar.gz");
    run(Command::new("gzip").arg("-t").arg(&output));

    let crds = "resources/customresourcedefinitions.apiextensions.k8s.io";
    let widgets = format!("resources/widgets.example.com/namespaces/app/{widget_name}.json");
    let widgets_pref = format!(
        "resources/widgets.example.com/v1alpha1-preferredversion/namespaces/app/{widget_name}.json"
    );
    let fresh: Vec<(String, &Value)> = vec![
        (format!("{hpa}/namespaces/app/web.json"), &hpa_new),
        (
            format!("{hpa}/v2-preferredversion/namespaces/app/web.json"),
            &hpa_new,
        ),
        (cm.into(), &cm_new),
        // Appended, in path order.
        (format!("{crds}/cluster/{crd_name}.json"), &crd),
        (
            format!("{crds}/v1-preferredversion/cluster/{crd_name}.json"),
            &crd,
        ),
        (
            "resources/configmaps/v1-preferredversion/namespaces/app/settings.json".into(),
            &cm_new,
        ),
        (widgets.clone(), &widget),
        (widgets_pref.clone(), &widget),
    ];
    let fresh_names: Vec<&str> = fresh.iter().map(|(n, _)| n.as_str()).collect();

    // GNU tar: the input's entries in order (the v1 HPA untouched), then the appended.
    let mut appended: Vec<String> = fresh_names[3..].iter().map(|s| s.to_string()).collect();
    appended.sort();
    let mut expected = listing(&input);
    expected.extend(appended);
    assert_eq!(listing(&output), expected);
    let extracted = f.dir.path().join("hpa-extracted");
    std::fs::create_dir_all(&extracted).unwrap();
    run(Command::new("tar")
        .arg("-xzf")
        .arg(&output)
        .arg("-C")
        .arg(&extracted));
    assert_eq!(
        std::fs::read(extracted.join(format!("{hpa}/v1/namespaces/app/web.json"))).unwrap(),
        old_v1,
        "the v1 directory is left as it was"
    );
    for (name, object) in &fresh {
        let got: Value =
            serde_json::from_slice(&std::fs::read(extracted.join(name)).unwrap()).unwrap();
        assert_eq!(&got, *object, "{name}");
    }

    // Python's tarfile: the same names; fresh entries with Velero's header.
    let python = python_listing(&output);
    let names: Vec<&str> = python.iter().map(|m| m[0].as_str().unwrap()).collect();
    assert_eq!(
        names,
        expected
            .iter()
            .map(|s| s.trim_end_matches('/'))
            .collect::<Vec<_>>()
    );
    for m in &python {
        let name = m[0].as_str().unwrap();
        if fresh_names.contains(&name) {
            assert_eq!(
                (m[1].as_i64(), m[2].as_i64(), m[3].as_str()),
                (Some(0o755), Some(0), Some("")),
                "{name}"
            );
            let mtime = m[4].as_f64().unwrap() as i64;
            assert!((before..=after).contains(&mtime), "{name}: mtime {mtime}");
        }
    }

    // Go's compress/gzip and archive/tar, as Velero reads it: one gzip member, and
    // every fresh header byte for byte what Velero's tar.Writer writes.
    let go = velero_tar(f.dir.path());
    let (entries, members) = go_listing(&go, &output);
    assert_eq!(members, "members 1");
    let go_names: Vec<&str> = entries
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        go_names,
        expected.iter().map(String::as_str).collect::<Vec<_>>()
    );
    let tar = run(Command::new("gzip").arg("-dc").arg(&output));
    for e in entries
        .iter()
        .filter(|e| fresh_names.contains(&e["name"].as_str().unwrap()))
    {
        let name = e["name"].as_str().unwrap();
        assert_eq!(
            (e["mode"].as_i64(), e["typeflag"].as_str()),
            (Some(0o755), Some("0")),
            "{name}"
        );
        // Too long for the ustar prefix and name fields: Go adds a PAX header.
        let expected_format = if name.contains(&crd_name) {
            "PAX"
        } else {
            "USTAR"
        };
        assert_eq!(e["format"], expected_format, "{name}");
        let velero = run(Command::new(&go)
            .arg("header")
            .arg(name)
            .arg(e["size"].as_i64().unwrap().to_string())
            .arg(e["mtime"].as_i64().unwrap().to_string()));
        let found = tar
            .chunks(512)
            .enumerate()
            .any(|(i, _)| tar[i * 512..].starts_with(&velero));
        assert!(found, "{name}: the agent's header is not Velero's");
    }
}

/// The archives of issue 11.4, written by `tests/tarballs/hostile.py` (Python's tarfile,
/// spliced by hand where it will not write the trick): each looked harmless to the
/// agent's old check, and Python's unfiltered `extractall` of the old output wrote
/// outside its target. Each is refused, naming the entry as Go's reader (Velero's)
/// names it, and nothing is written.
#[tokio::test]
async fn archives_that_extractors_read_differently_from_a_checker_are_refused() {
    let f = Fixture::new(&[]).await;
    let storage = f.agent.state_dir.join("storage");
    let hostile = storage.join("hostile");
    std::fs::create_dir_all(&hostile).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tarballs/hostile.py");
    let names = String::from_utf8(run(Command::new("python3").arg(&script).arg(&hostile))).unwrap();
    let expected: BTreeMap<&str, String> = [
        (
            "pax-size-hides-headers",
            "entry resources/configmaps/namespaces/app/cover.json: its PAX size 0 differs from \
             its header's size 1536"
                .to_string(),
        ),
        (
            "gnu-long-name-then-pax-path",
            format!(
                "entry ../../{}/escape.json: paths with '..' are not allowed",
                "d".repeat(100)
            ),
        ),
        (
            "pax-gnu-sparse-name",
            "entry resources/configmaps/namespaces/app/ok.json: its PAX header: PAX record \
             GNU.sparse.name is not allowed (Go renames and resizes GNU sparse entries by it)"
                .to_string(),
        ),
        (
            "global-pax-path",
            // Go returns the global header as an entry of that name, which Velero's
            // restore refuses to extract.
            "entry ../../escape.json: paths with '..' are not allowed".to_string(),
        ),
        (
            "directory-with-data",
            "entry resources/: a directory with 1024 bytes of data (Go reads none, and the \
             next header where the data starts)"
                .to_string(),
        ),
    ]
    .into();
    let mut listed: Vec<&str> = names.lines().collect();
    listed.sort();
    assert_eq!(listed, expected.keys().copied().collect::<Vec<_>>());
    let client = f.agent.client().await;
    let backups = client.backups();
    for name in names.lines() {
        backups.start(name, "u").await.unwrap();
        backups.end_in_progress(name).await.unwrap();
        let input = format!("hostile/{name}.tar.gz");
        let err = backups
            .request::<opmon_client::methods::Finalize>(FinalizeParams {
                name: name.into(),
                contents: Some(Contents {
                    input: input.clone().into(),
                    output: format!("hostile/{name}-out.tar.gz").into(),
                }),
                updated_items: vec![],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(codes::FINALIZE_FAILED), "{name}");
        assert_eq!(
            err.to_string(),
            format!("finalize failed: {input}: {} (code 1005)", expected[name]),
            "{name}"
        );
        assert!(!hostile.join(format!("{name}-out.tar.gz")).exists());
        assert_eq!(
            backups.get(name).await.unwrap().phase,
            OwnerPhase::Finalizing
        );
    }
}

#[tokio::test]
async fn a_tarball_is_finalized_in_place_with_items_written_as_gos_json_marshal_writes_them() {
    let f = Fixture::new(&[]).await;
    let storage = ready_to_finalize(&f, &["b"]).await;
    let tarball = storage.join("in.tar.gz");
    let before = listing(&tarball);
    let object = json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"annotations": {"note": "<a&b>"}}});
    let result = f
        .client
        .backups()
        .request::<opmon_client::methods::Finalize>(FinalizeParams {
            name: "b".into(),
            // Velero replaces <backup>.tar.gz at its own key: input and output are one.
            contents: Some(Contents {
                input: "in.tar.gz".into(),
                output: "in.tar.gz".into(),
            }),
            updated_items: vec![UpdatedItem {
                resource: pvc("data"),
                object,
            }],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(result.owner.phase, OwnerPhase::Completed);
    assert_eq!(result.contents_file.as_deref(), Some(tarball.as_path()));
    assert_eq!(listing(&tarball), before, "one entry replaced, in place");
    let item = run(Command::new("tar")
        .arg("-xzOf")
        .arg(&tarball)
        .arg("resources/persistentvolumeclaims/namespaces/app/data.json"));
    assert_eq!(
        String::from_utf8(item).unwrap(),
        r#"{"apiVersion":"v1","kind":"PersistentVolumeClaim","metadata":{"annotations":{"note":"\u003ca\u0026b\u003e"}}}"#
    );
    assert!(opmon_tests::tarballs::temporaries(&storage).is_empty());
}
