//! End-to-end: a finalize belongs to the owner it started for and runs alone (issue
//! 11.5), and nothing it does blocks the agent (11.6): not a flood of finalizes of
//! FIFOs, not a rewrite that runs on, not at SIGTERM.
//!
//! A rewrite that is "still running" is one of a tarball holding hundreds of MiB to
//! GiBs of zeros (a few MB on disk): the test waits until its temporary output exists,
//! then acts; what it does takes a few local calls, the rewrite seconds to minutes.

use std::path::{Path, PathBuf};

use opmon_client::{codes, Client, Contents, FinalizeParams, FinalizeResult, OwnerPhase};
use opmon_tests::tarballs::{temporaries, write_zeros_tarball};
use opmon_tests::Agent;

fn params(name: &str, input: &str, output: &str) -> FinalizeParams {
    FinalizeParams {
        name: name.into(),
        contents: Some(Contents {
            input: input.into(),
            output: output.into(),
        }),
        updated_items: vec![],
        ..Default::default()
    }
}

async fn finalizing(client: &Client, name: &str, uid: &str) {
    client.backups().start(name, uid).await.unwrap();
    let owner = client.backups().end_in_progress(name).await.unwrap();
    assert_eq!(owner.phase, OwnerPhase::Finalizing);
}

/// Waits until a rewrite has created its temporary file in `dir` (it is running).
async fn wait_for_temporary(dir: &Path, agent: &Agent) {
    let started =
        opmon_tests::try_eventually_async(opmon_tests::LONG, || !temporaries(dir).is_empty()).await;
    assert!(
        started.is_some(),
        "no rewrite started in {}:\n{}",
        dir.display(),
        agent.log_text()
    );
}

/// The agent goes before its directory (fields drop in order): the harness reads the
/// agent's log when it drops it.
struct Setup {
    agent: Agent,
    storage: PathBuf,
    _dir: tempfile::TempDir,
}

fn setup(extra: &[&str]) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), extra);
    let storage = agent.state_dir.join("storage");
    std::fs::create_dir_all(storage.join("out")).unwrap();
    Setup {
        agent,
        storage,
        _dir: dir,
    }
}

#[tokio::test]
async fn a_finalize_does_not_complete_a_backup_deleted_and_started_again_under_another_uid() {
    let s = setup(&[]);
    write_zeros_tarball(&s.storage.join("big.tar.gz"), 512);
    let client = s.agent.client().await;
    finalizing(&client, "b", "uid-1").await;
    let first = {
        let client = s.agent.client().await;
        tokio::spawn(async move {
            client
                .backups()
                .request::<opmon_client::methods::Finalize>(params(
                    "b",
                    "big.tar.gz",
                    "out/b.tar.gz",
                ))
                .await
        })
    };
    wait_for_temporary(&s.storage.join("out"), &s.agent).await;
    client.backups().delete("b").await.unwrap();
    finalizing(&client, "b", "uid-2").await;

    let err = first.await.unwrap().unwrap_err();
    assert_eq!(err.code(), Some(codes::FINALIZE_FAILED));
    assert_eq!(
        err.to_string(),
        "finalize failed: backup b was deleted and started again (uid uid-2) during this \
         finalize of uid uid-1; nothing of it was kept (code 1005)"
    );
    let now = client.backups().get("b").await.unwrap();
    assert_eq!(
        (now.uid.as_str(), now.phase),
        ("uid-2", OwnerPhase::Finalizing)
    );
    assert!(
        !s.storage.join("out/b.tar.gz").exists(),
        "the old output never appeared"
    );
    assert_eq!(temporaries(&s.storage.join("out")), Vec::<String>::new());
    // The failure was the old backup's: the new one's history has none of it.
    let events = client
        .backups()
        .request::<opmon_client::methods::Events>(opmon_client::EventsParams {
            name: "b".into(),
            after: None,
            limit: Some(1000),
        })
        .await
        .unwrap();
    let reasons: Vec<&str> = events.items.iter().map(|e| e.reason.as_str()).collect();
    assert!(!reasons.contains(&"FinalizeFailed"), "{reasons:?}");
}

#[tokio::test]
async fn concurrent_finalizes_of_one_backup_run_one_after_the_other_and_write_once() {
    let s = setup(&[]);
    write_zeros_tarball(&s.storage.join("big.tar.gz"), 256);
    let client = s.agent.client().await;
    finalizing(&client, "b", "u").await;
    async fn spawn(
        agent: &Agent,
        output: &'static str,
    ) -> tokio::task::JoinHandle<Result<FinalizeResult, opmon_client::Error>> {
        let client = agent.client().await;
        tokio::spawn(async move {
            client
                .backups()
                .request::<opmon_client::methods::Finalize>(params("b", "big.tar.gz", output))
                .await
        })
    }
    let first = spawn(&s.agent, "out/first.tar.gz").await;
    wait_for_temporary(&s.storage.join("out"), &s.agent).await;
    let second = spawn(&s.agent, "out/second.tar.gz").await;
    let first: FinalizeResult = first.await.unwrap().unwrap();
    let second: FinalizeResult = second.await.unwrap().unwrap();
    // The second waited for the first, then found it done: one result, one output.
    assert_eq!(second, first);
    assert_eq!(first.owner.phase, OwnerPhase::Completed);
    assert_eq!(
        first.contents_file.as_deref(),
        Some(
            std::fs::canonicalize(s.storage.join("out"))
                .unwrap()
                .join("first.tar.gz")
                .as_path()
        )
    );
    assert!(!s.storage.join("out/second.tar.gz").exists());
    assert_eq!(temporaries(&s.storage.join("out")), Vec::<String>::new());
}

#[tokio::test]
async fn hundreds_of_finalizes_of_fifos_are_refused_and_reads_keep_being_answered() {
    let s = setup(&[]);
    let client = s.agent.client().await;
    let n = 600;
    for i in 0..n {
        finalizing(&client, &format!("b{i}"), "u").await;
        let fifo = s.storage.join(format!("fifo-{i}"));
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    }
    // Today's bug: each would hold a blocking thread forever, and with 512 of them held
    // every database read waits. Now each is refused at its open.
    let mut clients = Vec::new();
    for _ in 0..6 {
        clients.push(std::sync::Arc::new(s.agent.client().await));
    }
    let mut calls = Vec::new();
    for i in 0..n {
        let client = clients[i % clients.len()].clone();
        calls.push(tokio::spawn(async move {
            client
                .backups()
                .request::<opmon_client::methods::Finalize>(params(
                    &format!("b{i}"),
                    &format!("fifo-{i}"),
                    &format!("out/{i}.tar.gz"),
                ))
                .await
        }));
    }
    // Reads while they are in flight.
    client.status().await.unwrap();
    assert_eq!(
        client.backups().get("b7").await.unwrap().phase,
        OwnerPhase::Finalizing
    );
    let storage = s.storage.display().to_string();
    let over_quota = format!(
        "uid {} already holds 8 finalizes, the most max_finalizes_per_uid allows",
        nix::unistd::geteuid()
    );
    let (mut refused_fifo, mut refused_quota) = (0, 0);
    for (i, call) in calls.into_iter().enumerate() {
        let err = call.await.unwrap().unwrap_err();
        let text = err.to_string();
        if text
            == format!(
            "finalize failed: contents.input fifo-{i}: is a FIFO, not a regular file (code 1005)"
        ) {
            refused_fifo += 1;
        } else {
            // Past its quota, the one peer's finalizes are refused at once.
            assert_eq!(
                err.code(),
                Some(codes::REFUSED),
                "{err} (storage {storage})"
            );
            assert!(text.contains(&over_quota), "{text}");
            refused_quota += 1;
        }
    }
    assert!(refused_fifo > 0 && refused_fifo + refused_quota == n);
    client.status().await.unwrap();
    assert_eq!(
        client.backups().get("b0").await.unwrap().phase,
        OwnerPhase::Finalizing
    );
}

#[tokio::test]
async fn a_rewrite_past_the_finalize_deadline_fails_and_leaves_nothing() {
    let s = setup(&["--finalize-deadline", "1s"]);
    write_zeros_tarball(&s.storage.join("big.tar.gz"), 4096);
    let client = s.agent.client().await;
    finalizing(&client, "b", "u").await;
    let err = client
        .backups()
        .request::<opmon_client::methods::Finalize>(params("b", "big.tar.gz", "out/b.tar.gz"))
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "finalize failed: the rewrite of big.tar.gz did not finish within the finalize \
         deadline (1s) (code 1005)"
    );
    assert_eq!(
        client.backups().get("b").await.unwrap().phase,
        OwnerPhase::Finalizing
    );
    assert!(!s.storage.join("out/b.tar.gz").exists());
    assert_eq!(temporaries(&s.storage.join("out")), Vec::<String>::new());
}

#[tokio::test]
async fn sigterm_ends_the_agent_while_a_rewrite_runs_and_removes_its_temporary_file() {
    let mut s = setup(&[]);
    write_zeros_tarball(&s.storage.join("big.tar.gz"), 4096);
    let client = s.agent.client().await;
    finalizing(&client, "b", "u").await;
    let running = {
        let client = s.agent.client().await;
        tokio::spawn(async move {
            client
                .backups()
                .request::<opmon_client::methods::Finalize>(params(
                    "b",
                    "big.tar.gz",
                    "out/b.tar.gz",
                ))
                .await
        })
    };
    wait_for_temporary(&s.storage.join("out"), &s.agent).await;
    // Reads are answered meanwhile.
    client.status().await.unwrap();
    assert_eq!(
        client.backups().get("b").await.unwrap().phase,
        OwnerPhase::Finalizing
    );

    let status = s.agent.terminate();
    assert!(status.success(), "{status}:\n{}", s.agent.log_text());
    assert!(
        running.await.unwrap().is_err(),
        "the finalize did not complete"
    );
    assert_eq!(temporaries(&s.storage.join("out")), Vec::<String>::new());
    s.agent.restart();
    let client = s.agent.client().await;
    assert_eq!(
        client.backups().get("b").await.unwrap().phase,
        OwnerPhase::Finalizing
    );
    assert!(!s.storage.join("out/b.tar.gz").exists());
}

#[tokio::test]
async fn a_small_finalize_is_not_held_up_by_other_owners_large_ones() {
    // Two zero-bombs of 64 GiB (64 MB on disk): tens of seconds of rewriting each, far
    // more than the small one needs however loaded the machine is.
    let s = setup(&["--max-decompressed-size", "100000000000"]);
    write_zeros_tarball(&s.storage.join("big.tar.gz"), 65536);
    write_zeros_tarball(&s.storage.join("small.tar.gz"), 16);
    let client = s.agent.client().await;
    for name in ["big-1", "big-2", "small"] {
        finalizing(&client, name, "u").await;
    }
    let bombs: Vec<_> = ["big-1", "big-2"]
        .into_iter()
        .map(|name| {
            let client = client.clone();
            tokio::spawn(async move {
                client
                    .backups()
                    .request::<opmon_client::methods::Finalize>(params(
                        name,
                        "big.tar.gz",
                        &format!("big/{name}.tar.gz"),
                    ))
                    .await
            })
        })
        .collect();
    let both = opmon_tests::try_eventually_async(opmon_tests::LONG, || {
        temporaries(&s.storage.join("big")).len() == 2
    })
    .await;
    assert!(
        both.is_some(),
        "the two rewrites did not start:\n{}",
        s.agent.log_text()
    );
    let small = client
        .backups()
        .request::<opmon_client::methods::Finalize>(params(
            "small",
            "small.tar.gz",
            "small/out.tar.gz",
        ))
        .await
        .unwrap();
    assert_eq!(small.owner.phase, OwnerPhase::Completed);
    // The large ones were still being written when the small one was done.
    assert!(bombs.iter().all(|b| !b.is_finished()));
    assert_eq!(temporaries(&s.storage.join("big")).len(), 2);
    for bomb in bombs {
        bomb.abort();
    }
}
