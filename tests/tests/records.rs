//! End-to-end: what Velero keeps about each operation, as the agent keeps it. Two items
//! with one operation ID are two operations; snapshotters get the owner's object; an
//! operation is created when its plugin returned; names are taken by Kubernetes' and
//! Velero's rules.

use std::time::Duration;

use opmon_client::{
    codes, ApiVersion, ItemOperationSpec, OperationPhase, OwnerPhase, PluginKind,
    ResourceIdentifier, Snapshotter, StartParams, WaitUntil,
};
use opmon_tests::{operation, pvc, Fixture, PLUGIN};
use serde_json::{json, Value};
use time::OffsetDateTime;

const LONG: Duration = Duration::from_secs(120);

/// The journal lines of `verb` for operation `id`.
fn calls(journal: &[String], verb: &str, id: &str) -> Vec<String> {
    let prefix = format!("{verb} {id} ");
    journal
        .iter()
        .filter(|l| l.starts_with(&prefix))
        .cloned()
        .collect()
}

#[tokio::test]
async fn one_operation_id_on_two_items_is_two_operations_both_polled_and_both_re_backed_up() {
    // No periodic poll: the Progress calls counted are endInProgress's alone.
    let f = Fixture::polling_every("1h", &[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    backups.start("shared", "u").await.unwrap();
    let both = vec![
        operation(PLUGIN, "gate-x", "a", &["post-a"]),
        operation(PLUGIN, "gate-x", "b", &["post-b"]),
    ];
    let added = backups
        .add_operations("shared", both.clone())
        .await
        .unwrap();
    assert_eq!((added.added, added.already_known), (2, 0));
    // A retried call adds nothing, even with other post-operation items.
    let again = backups.add_operations("shared", both).await.unwrap();
    assert_eq!((again.added, again.already_known), (0, 2));
    let retried = backups
        .add_operations("shared", vec![operation(PLUGIN, "gate-x", "a", &["other"])])
        .await
        .unwrap();
    assert_eq!((retried.added, retried.already_known), (0, 1));

    let owner = backups.end_in_progress("shared").await.unwrap();
    assert_eq!(owner.phase, OwnerPhase::WaitingForPluginOperations);
    assert_eq!(owner.operations_attempted, 2);
    assert_eq!(
        calls(&f.journal(), "progress", "gate-x").len(),
        2,
        "each record is polled, as Velero polls each: {:?}",
        f.journal()
    );

    f.open_gate("gate-x");
    client.snapshotter_changed(PLUGIN).await.unwrap();
    let owner = backups
        .wait("shared", WaitUntil::ReadyToFinalize, LONG)
        .await
        .unwrap()
        .owner;
    assert_eq!(owner.phase, OwnerPhase::Finalizing);
    assert_eq!(owner.operations_completed, 2);
    assert_eq!(
        owner.post_operation_items,
        Some(vec![pvc("post-a"), pvc("post-b")])
    );
    let records = backups.item_operations("shared").await.unwrap();
    let items: Vec<(String, String)> = records
        .iter()
        .map(|r| match &r.spec {
            ItemOperationSpec::Backup(s) => {
                (s.operation_id.clone(), s.resource_identifier.name.clone())
            }
            ItemOperationSpec::Restore(_) => panic!("a backup's record"),
        })
        .collect();
    assert_eq!(
        items,
        [("gate-x".into(), "a".into()), ("gate-x".into(), "b".into())]
    );
}

#[tokio::test]
async fn snapshotters_get_the_owners_object_in_every_progress_and_cancel() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    let object = json!({
        "apiVersion": "velero.io/v1",
        "kind": "Backup",
        "metadata": {"name": "with-object", "namespace": "velero", "labels": {"a": "<&>"}},
        "spec": {"includedNamespaces": ["app"], "storageLocation": "default"}
    });
    backups
        .request::<opmon_client::methods::Start>(StartParams {
            name: "with-object".into(),
            uid: "u".into(),
            object: Some(object.clone()),
            ..StartParams::default()
        })
        .await
        .unwrap();
    backups
        .add_operations(
            "with-object",
            vec![
                operation(PLUGIN, "never-1", "a", &[]),
                operation(PLUGIN, "never-2", "b", &[]),
            ],
        )
        .await
        .unwrap();
    opmon_tests::start_and_end_in_progress(
        &backups,
        "plain",
        vec![operation(PLUGIN, "never-3", "c", &[])],
    )
    .await;
    backups.end_in_progress("with-object").await.unwrap();
    backups.delete("with-object").await.unwrap();
    backups.delete("plain").await.unwrap();

    let journal = f.journal();
    let text = object.to_string();
    for id in ["never-1", "never-2"] {
        assert_eq!(
            calls(&journal, "progress", id)[0],
            format!("progress {id} with-object {text}")
        );
        assert_eq!(
            calls(&journal, "cancel", id),
            [format!("cancel {id} with-object {text}")]
        );
    }
    assert_eq!(
        calls(&journal, "progress", "never-3")[0],
        "progress never-3 plain"
    );
    assert_eq!(
        calls(&journal, "cancel", "never-3"),
        ["cancel never-3 plain"]
    );
}

#[tokio::test]
async fn an_owner_object_must_be_a_json_object_of_at_most_64_kib() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let start = |object: Value| {
        let client = &client;
        async move {
            client
                .call::<_, Value>(
                    "restore.start",
                    json!({"name": "r", "uid": "u", "object": object}),
                )
                .await
                .unwrap_err()
        }
    };
    let e = start(json!(["a"])).await;
    assert_eq!(e.code(), Some(codes::INVALID_PARAMS));
    assert_eq!(
        e.to_string(),
        "object: must be a JSON object (the backup server's representation of the backup or \
         restore) (code -32602)"
    );
    let e = start(json!({"spec": "x".repeat(64 * 1024)})).await;
    assert_eq!(
        e.to_string(),
        "object: must be at most 65536 bytes serialized (got 65547) (code -32602)"
    );
    assert_eq!(
        client.restores().get("r").await.unwrap_err().code(),
        Some(codes::NOT_FOUND),
        "nothing was created"
    );
}

#[tokio::test]
async fn created_is_when_the_plugin_returned_and_the_timeout_counts_from_it() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    let backups = client.backups();
    backups
        .start("late", "u")
        .item_operation_timeout(Duration::from_secs(600))
        .await
        .unwrap();
    let now = OffsetDateTime::now_utc();
    let long_ago = now - time::Duration::minutes(11) - time::Duration::milliseconds(250);
    let mut old = operation(PLUGIN, "never-old", "a", &[]);
    old.created = Some(long_ago);
    let fresh = operation(PLUGIN, "never-fresh", "b", &[]);
    backups
        .add_operations("late", vec![old, fresh])
        .await
        .unwrap();
    let ops = backups.operations("late").await.unwrap();
    let ms = |t: OffsetDateTime| t.unix_timestamp_nanos() / 1_000_000;
    assert_eq!(ms(ops[0].created), ms(long_ago));
    assert!(ops[1].created >= now - time::Duration::seconds(1));

    // The immediate poll finds the old one past its 10 minutes, the other not.
    let owner = backups.end_in_progress("late").await.unwrap();
    assert_eq!(
        owner.phase,
        OwnerPhase::WaitingForPluginOperationsPartiallyFailed
    );
    let ops = backups.operations("late").await.unwrap();
    assert_eq!(
        (ops[0].phase, ops[0].error.as_deref().unwrap_or("")),
        (OperationPhase::Failed, "Asynchronous action timed out")
    );
    assert_eq!(ops[1].phase, OperationPhase::InProgress);
    assert_eq!(
        calls(&f.journal(), "cancel", "never-old"),
        ["cancel never-old late"]
    );

    // A time well ahead of the agent's clock is refused, naming the operation.
    backups.start("ahead", "u").await.unwrap();
    let mut ahead = operation(PLUGIN, "never-1", "a", &[]);
    ahead.created = Some(now + time::Duration::minutes(6));
    let e = backups
        .add_operations("ahead", vec![operation(PLUGIN, "never-0", "z", &[]), ahead])
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "operations[1].created: must not be more than 5m0s ahead of the agent's clock \
         (code -32602)"
    );
    assert!(backups.operations("ahead").await.unwrap().is_empty());
}

#[tokio::test]
async fn rbac_item_names_and_legacy_plugin_names_are_taken_as_velero_takes_them() {
    let f = Fixture::new(&[]).await;
    let client = f.agent.client().await;
    // A legacy, un-namespaced name is velero.io/<name>, at registration as in operations.
    let registered = client
        .register_snapshotter(Snapshotter {
            name: "legacy-copier".into(),
            api_version: ApiVersion::V2,
            socket: Some(f.snapshotter.socket.clone()),
            command: None,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(registered.name, "velero.io/legacy-copier");

    let backups = client.backups();
    let role = ResourceIdentifier {
        group: "rbac.authorization.k8s.io".into(),
        resource: "clusterroles".into(),
        namespace: String::new(),
        name: "system:aggregate-to-admin".into(),
    };
    let mut op = operation("legacy-copier", "done-role", "unused", &[]);
    op.resource = role.clone();
    op.post_operation_items = vec![ResourceIdentifier {
        name: "system:controller:attachdetach-controller".into(),
        ..role.clone()
    }];
    let owner = opmon_tests::start_and_end_in_progress(&backups, "rbac", vec![op]).await;
    assert_eq!(
        owner.phase,
        OwnerPhase::Finalizing,
        "polled through the legacy name"
    );
    let ops = backups.operations("rbac").await.unwrap();
    assert_eq!(ops[0].plugin.name, "velero.io/legacy-copier");
    assert_eq!(ops[0].resource, role);

    let bad = |plugin: &str, name: &str| {
        let mut op = operation(plugin, "done-1", "x", &[]);
        op.resource.name = name.into();
        op.plugin.kind = PluginKind::BackupItemAction;
        op
    };
    backups.start("refused", "u").await.unwrap();
    for (op, message) in [
        (
            bad("example.io/a/b", "x"),
            "operations[0].plugin.name: must have exactly two parts separated by '/' \
             (<DNS subdomain>/<non-empty name>)",
        ),
        (
            bad("Example.io/a", "x"),
            "operations[0].plugin.name: the first part \"Example.io\" must be a DNS subdomain \
             (lowercase letters, digits, '-' and '.', starting and ending with a letter or \
             digit, at most 253 characters)",
        ),
        (
            bad(PLUGIN, ".."),
            "operations[0].resource.name: must not be \"..\"",
        ),
        (
            bad(PLUGIN, "50%"),
            "operations[0].resource.name: must not contain '%' (a Kubernetes name is a path \
             segment: no '/', '%' or control characters)",
        ),
    ] {
        let e = backups
            .add_operations("refused", vec![op])
            .await
            .unwrap_err();
        assert_eq!(e.to_string(), format!("{message} (code -32602)"));
    }

    let removed = client
        .unregister_snapshotter("legacy-copier")
        .await
        .unwrap();
    assert_eq!(removed.name, "velero.io/legacy-copier");
    assert!(client
        .snapshotters()
        .await
        .unwrap()
        .iter()
        .all(|s| s.name != "velero.io/legacy-copier"));
}
