//! End-to-end: a finalize belongs to the owner it started for and runs alone (issue
//! 11.5), nothing it does blocks the agent (11.6): not a flood of finalizes of FIFOs,
//! not a rewrite that runs on, not at SIGTERM; and one peer's finalizes leave the CPU
//! to another's.
//!
//! A rewrite the test acts during is held: its input is on a FUSE file system whose
//! reads wait until the test releases them (`opmon_tests::held`), or, where no peer
//! must get ahead of it, a tarball holding GiBs of zeros (a few MB on disk).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use opmon_client::{codes, Client, Contents, FinalizeParams, FinalizeResult, OwnerPhase};
use opmon_tests::held::{CallerAs, HeldFiles};
use opmon_tests::raw::request;
use opmon_tests::tarballs::{temporaries, write_zeros_tarball};
use opmon_tests::{Agent, RawHttp};
use serde_json::json;

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

/// `count` inputs `slow/held-N.tar.gz` in `storage` whose reads wait until released.
fn held_inputs(storage: &Path, count: usize) -> HeldFiles {
    write_zeros_tarball(&storage.join("held.tar.gz"), 16);
    std::fs::create_dir_all(storage.join("slow")).unwrap();
    HeldFiles::mount(&storage.join("held.tar.gz"), count, &storage.join("slow"))
}

/// Returns once `count` finalizes are reading their held inputs.
async fn readers(held: HeldFiles, count: usize) -> HeldFiles {
    tokio::task::spawn_blocking(move || {
        let mut held = held;
        held.wait_for_readers(count);
        held
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn a_finalize_does_not_complete_a_backup_deleted_and_started_again_under_another_uid() {
    if !opmon_tests::root_or_skip("to mount a FUSE file system") {
        return;
    }
    let s = setup(&[]);
    let held = held_inputs(&s.storage, 1);
    let client = s.agent.client().await;
    finalizing(&client, "b", "uid-1").await;
    let first = {
        let client = s.agent.client().await;
        tokio::spawn(async move {
            client
                .backups()
                .request::<opmon_client::methods::Finalize>(params(
                    "b",
                    "slow/held-0.tar.gz",
                    "out/b.tar.gz",
                ))
                .await
        })
    };
    let mut held = readers(held, 1).await;
    client.backups().delete("b").await.unwrap();
    finalizing(&client, "b", "uid-2").await;
    held.release();

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
            uid: None,
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
    let over_quota =
        "finalizes the agent holds at once for all its peers are held; try again later";
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
            // Past the cap, finalizes are refused at once.
            assert_eq!(
                err.code(),
                Some(codes::REFUSED),
                "{err} (storage {storage})"
            );
            assert!(text.contains(over_quota), "{text}");
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

/// A finalize running at SIGTERM is given up, not failed: its call is not answered (as
/// if the agent had died), no failure is recorded, its temporary file goes, and the
/// client's repeat once the agent is back completes the backup.
#[tokio::test]
async fn a_finalize_running_at_sigterm_is_repeated_by_its_client_and_completes_after_the_restart() {
    if !opmon_tests::root_or_skip("to mount a FUSE file system") {
        return;
    }
    let mut s = setup(&[]);
    let held = held_inputs(&s.storage, 1);
    let client = s.agent.client().await;
    finalizing(&client, "b", "u").await;
    let running = {
        let client = client.clone();
        tokio::spawn(async move {
            client
                .backups()
                .request::<opmon_client::methods::Finalize>(params(
                    "b",
                    "slow/held-0.tar.gz",
                    "out/b.tar.gz",
                ))
                .await
        })
    };
    let mut held = readers(held, 1).await;
    wait_for_temporary(&s.storage.join("out"), &s.agent).await;

    let status = s.agent.terminate();
    assert!(status.success(), "{status}:\n{}", s.agent.log_text());
    assert_eq!(temporaries(&s.storage.join("out")), Vec::<String>::new());
    assert!(
        !running.is_finished(),
        "the client got an answer: {:?}",
        running.await
    );
    // Given up at once: the stop does not wait for it as for a call still running.
    for unexpected in ["finalize failed", "still running after"] {
        assert!(
            !s.agent.log_text().contains(unexpected),
            "{}",
            s.agent.log_text()
        );
    }

    s.agent.restart();
    held.release();
    let finalized = tokio::time::timeout(opmon_tests::LONG, running)
        .await
        .expect("the repeated finalize did not complete")
        .unwrap();
    assert!(finalized.is_ok(), "{finalized:?}");
    let client = s.agent.client().await;
    assert_eq!(
        client.backups().get("b").await.unwrap().phase,
        OwnerPhase::Completed
    );
    assert!(s.storage.join("out/b.tar.gz").exists());
    let events = client.backups().events("b").await.unwrap();
    assert!(
        events
            .items
            .iter()
            .all(|e| e.reason != opmon_client::EventReason::FinalizeFailed),
        "{events:?}"
    );
}

#[tokio::test]
async fn a_small_finalize_is_not_held_up_by_other_owners_large_ones() {
    if !opmon_tests::root_or_skip("to mount a FUSE file system") {
        return;
    }
    let s = setup(&[]);
    // Two rewrites that go on until the test lets them: their disk does not answer.
    let held = held_inputs(&s.storage, 2);
    write_zeros_tarball(&s.storage.join("small.tar.gz"), 16);
    let client = s.agent.client().await;
    for name in ["big-1", "big-2", "small"] {
        finalizing(&client, name, "u").await;
    }
    let bombs: Vec<_> = ["big-1", "big-2"]
        .into_iter()
        .enumerate()
        .map(|(n, name)| {
            let client = client.clone();
            tokio::spawn(async move {
                client
                    .backups()
                    .request::<opmon_client::methods::Finalize>(params(
                        name,
                        &format!("slow/held-{n}.tar.gz"),
                        &format!("big/{name}.tar.gz"),
                    ))
                    .await
            })
        })
        .collect();
    let mut held = readers(held, 2).await;
    let small = client
        .backups()
        .request::<opmon_client::methods::Finalize>(params(
            "small",
            "small.tar.gz",
            "small/out.tar.gz",
        ));
    let small = tokio::time::timeout(opmon_tests::LONG, small)
        .await
        .expect("the small finalize was held up")
        .unwrap();
    assert_eq!(small.owner.phase, OwnerPhase::Completed);
    // The large ones were still being written when the small one was done.
    assert!(bombs.iter().all(|b| !b.is_finished()));
    assert_eq!(temporaries(&s.storage.join("big")).len(), 2);
    held.release();
    for bomb in bombs {
        assert_eq!(
            bomb.await.unwrap().unwrap().owner.phase,
            OwnerPhase::Completed
        );
    }
}

/// Finalizes stuck mid-rewrite hold only their own threads: one peer's, whose disk stops
/// answering, leave the CPU to another uid's finalize and root's, which run to their end
/// while it waits.
#[test]
fn one_peer_s_finalizes_mid_rewrite_leave_the_cpu_to_another_uid_s_and_root_s() {
    if !opmon_tests::root_or_skip("to run clients as other uids and mount a FUSE file system") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for sub in [dir.path(), &dir.path().join("run")] {
        std::fs::create_dir_all(sub).unwrap();
        std::fs::set_permissions(sub, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let agent = Agent::start(
        dir.path(),
        &["--allowed-uids", "64001,64002", "--socket-mode", "0666"],
    );
    let storage = agent.state_dir.join("storage");
    std::fs::create_dir_all(storage.join("out")).unwrap();
    let mut held = held_inputs(&storage, 8);
    write_zeros_tarball(&storage.join("small.tar.gz"), 64);
    let mut http = RawHttp::connect(&agent.socket);
    let finalize = |name: &str, input: &str| {
        request(
            "backup.finalize",
            json!({"name": name, "contents": {"input": input, "output": format!("out/{name}.tar.gz")}}),
        )
    };
    let names: Vec<String> = (0..8).map(|n| format!("a{n}")).collect();
    for name in names.iter().map(String::as_str).chain(["b", "root"]) {
        http.call(&request("backup.start", json!({"name": name, "uid": name})));
        let ended = http.call(&request("backup.endInProgress", json!({"name": name})));
        assert_eq!(ended["result"]["phase"], json!("Finalizing"), "{ended}");
    }
    let mut first = CallerAs::start(64001, &agent.socket);
    for (n, name) in names.iter().enumerate() {
        first.send(name, &finalize(name, &format!("slow/held-{n}.tar.gz")));
    }
    held.wait_for_readers(8);

    let mut second = CallerAs::start(64002, &agent.socket);
    second.send("b", &finalize("b", "small.tar.gz"));
    let (_, done) = second.answer();
    assert_eq!(
        done["result"]["owner"]["phase"],
        json!("Completed"),
        "{done}"
    );
    let done = http.call(&finalize("root", "small.tar.gz"));
    assert_eq!(
        done["result"]["owner"]["phase"],
        json!("Completed"),
        "{done}"
    );
    // The peer's eight were still being written meanwhile.
    assert_eq!(first.pending(), Vec::<String>::new());
    assert_eq!(temporaries(&storage.join("out")).len(), 8);

    held.release();
    for _ in &names {
        let (tag, answer) = first.answer();
        assert_eq!(
            answer["result"]["owner"]["phase"],
            json!("Completed"),
            "{tag}: {answer}"
        );
    }
}
