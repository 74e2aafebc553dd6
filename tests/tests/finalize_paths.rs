//! End-to-end: where `finalize` may read and write (issue 11.1). A client names the
//! input and output; the agent refuses, with 1005 naming the path and the rule, every
//! path outside the storage directory and `finalize_dirs`, inside its state directory,
//! onto its socket, or onto something other than a regular file, however the path gets
//! there (`..`, a planted symbolic link). Afterwards the database still opens.

use std::path::{Path, PathBuf};
use std::process::Command;

use opmon_client::{codes, Client, Contents, FinalizeParams, OwnerPhase};
use opmon_tests::Agent;

/// A valid backup tarball (by the system tar) at `path`.
fn tarball(path: &Path, scratch: &Path) {
    let tree = scratch.join("tree");
    std::fs::create_dir_all(tree.join("resources/configmaps/namespaces/app")).unwrap();
    std::fs::write(
        tree.join("resources/configmaps/namespaces/app/cm.json"),
        b"{}",
    )
    .unwrap();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let status = Command::new("tar")
        .arg("-czf")
        .arg(path)
        .arg("-C")
        .arg(&tree)
        .arg("resources")
        .status()
        .unwrap();
    assert!(status.success());
}

fn mkfifo(path: &Path) {
    nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
}

async fn finalize(client: &Client, input: &Path, output: &Path) -> Result<(), String> {
    client
        .backups()
        .request::<opmon_client::methods::Finalize>(FinalizeParams {
            name: "b".into(),
            contents: Some(Contents {
                input: input.to_path_buf(),
                output: output.to_path_buf(),
            }),
            updated_items: vec![],
            ..Default::default()
        })
        .await
        .map(|_| ())
        .map_err(|e| {
            assert_eq!(e.code(), Some(codes::FINALIZE_FAILED), "{e}");
            e.to_string()
        })
}

struct Places {
    root: PathBuf,
    state: PathBuf,
    storage: PathBuf,
    run: PathBuf,
    extra: PathBuf,
}

#[tokio::test]
async fn finalize_paths_outside_the_allowed_directories_or_onto_the_agent_s_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    // Canonical, so the messages' resolved paths are predictable.
    let root = std::fs::canonicalize(dir.path()).unwrap();
    let p = Places {
        state: root.join("state"),
        storage: root.join("state/storage"),
        run: root.join("run"),
        extra: root.join("extra"),
        root: root.clone(),
    };
    std::fs::create_dir_all(&p.extra).unwrap();
    // `run` (the socket's directory) is allowed too, so the socket rule is what refuses
    // an output onto the socket, not the directory rule.
    let dirs = format!("{},{}", p.extra.display(), p.run.display());
    let mut agent = Agent::start_at(
        &root,
        &p.run.join("agent.sock"),
        &p.state,
        &["--finalize-dirs", &dirs],
    );
    let client = agent.client().await;
    client.backups().start("b", "u").await.unwrap();
    let owner = client.backups().end_in_progress("b").await.unwrap();
    assert_eq!(owner.phase, OwnerPhase::Finalizing);

    let input = p.storage.join("backups/b/b.tar.gz");
    tarball(&input, &p.root);
    let db = p.state.join("agent.db");
    let state = p.state.display();
    let storage = p.storage.display();
    let socket = p.run.join("agent.sock");
    mkfifo(&p.storage.join("fifo"));
    std::os::unix::fs::symlink(&p.state, p.storage.join("to-state")).unwrap();
    std::os::unix::fs::symlink("/etc", p.storage.join("to-etc")).unwrap();
    std::fs::create_dir_all(p.storage.join("a-directory.tar.gz")).unwrap();
    std::fs::write(p.root.join("elsewhere.tar.gz"), b"").unwrap();

    let out = |rel: &str| p.storage.join(rel);
    let cases: Vec<(PathBuf, PathBuf, String)> = vec![
        (
            input.clone(),
            db.clone(),
            format!("contents.output {}: inside the agent's state directory {state}", db.display()),
        ),
        (
            input.clone(),
            p.state.join("agent.db.lock"),
            format!(
                "contents.output {state}/agent.db.lock: inside the agent's state directory {state}"
            ),
        ),
        (
            input.clone(),
            socket.clone(),
            format!("contents.output {}: is the agent's API socket", socket.display()),
        ),
        (
            input.clone(),
            out("fifo"),
            format!("contents.output {storage}/fifo: is a FIFO, not a regular file"),
        ),
        (
            out("fifo"),
            out("out.tar.gz"),
            format!("contents.input {storage}/fifo: is a FIFO, not a regular file"),
        ),
        (
            out("a-directory.tar.gz"),
            out("out.tar.gz"),
            format!("contents.input {storage}/a-directory.tar.gz: is a directory, not a regular file"),
        ),
        (
            input.clone(),
            out("a-directory.tar.gz"),
            format!("contents.output {storage}/a-directory.tar.gz: is a directory, not a regular file"),
        ),
        // Through a symbolic link planted in the storage directory.
        (
            input.clone(),
            out("to-state/agent.db"),
            format!(
                "contents.output {storage}/to-state/agent.db (it resolves to {state}/agent.db): \
                 inside the agent's state directory {state}"
            ),
        ),
        (
            out("to-etc/passwd"),
            out("out.tar.gz"),
            format!(
                "contents.input {storage}/to-etc/passwd (it resolves to /etc/passwd): outside \
                 the storage directory {storage} and every finalize_dirs entry"
            ),
        ),
        // `..`, relative (to the storage directory) and absolute.
        (
            input.clone(),
            PathBuf::from("../agent.db"),
            format!(
                "contents.output ../agent.db (it resolves to {state}/agent.db): inside the \
                 agent's state directory {state}"
            ),
        ),
        (
            input.clone(),
            PathBuf::from("../../elsewhere.tar.gz"),
            format!(
                "contents.output ../../elsewhere.tar.gz (it resolves to {}/elsewhere.tar.gz): \
                 outside the storage directory {storage} and every finalize_dirs entry",
                p.root.display()
            ),
        ),
        (
            p.storage.join("../../elsewhere.tar.gz"),
            out("out.tar.gz"),
            format!(
                "contents.input {storage}/../../elsewhere.tar.gz (it resolves to {}/elsewhere.tar.gz): \
                 outside the storage directory {storage} and every finalize_dirs entry",
                p.root.display()
            ),
        ),
        (
            input.clone(),
            PathBuf::from("/tmp/opmon-finalize-out.tar.gz"),
            format!(
                "contents.output /tmp/opmon-finalize-out.tar.gz: outside the storage directory \
                 {storage} and every finalize_dirs entry"
            ),
        ),
        // JSON can carry a NUL (`\u0000`); no file name can.
        (
            input.clone(),
            PathBuf::from("out\0.tar.gz"),
            "contents.output \"out\\0.tar.gz\": contains a NUL character, which no file name \
             can"
                .to_string(),
        ),
    ];
    for (input, output, message) in &cases {
        let got = finalize(&client, input, output).await.unwrap_err();
        assert_eq!(got, format!("finalize failed: {message} (code 1005)"));
    }
    assert!(!Path::new("/tmp/opmon-finalize-out.tar.gz").exists());
    assert!(socket.exists(), "the socket is still there");
    assert_eq!(
        opmon_tests::tarballs::temporaries(&p.storage),
        Vec::<String>::new(),
        "no temporary files left"
    );

    // The database still opens: the agent restarts on it, and the backup waits on.
    drop(client);
    agent.terminate();
    agent.restart();
    let client = agent.client().await;
    assert_eq!(
        client.backups().get("b").await.unwrap().phase,
        OwnerPhase::Finalizing
    );
    // An allowed directory works, relative paths are under the storage directory.
    finalize(
        &client,
        Path::new("backups/b/b.tar.gz"),
        &p.extra.join("b.tar.gz"),
    )
    .await
    .unwrap();
    assert!(p.extra.join("b.tar.gz").exists());
    assert_eq!(
        client.backups().get("b").await.unwrap().phase,
        OwnerPhase::Completed
    );
}
