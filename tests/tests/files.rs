//! End-to-end: result files are never lost and never orphaned. A file write that failed
//! (or was cut off by SIGKILL) is finished after the restart; temporary files of a
//! crashed write are removed at start; an expiry killed halfway leaves no directory
//! behind; an old removal never takes a re-created owner's file; a large expiry does not
//! hold up polls or `agent.status`.
//!
//! The expiry tests plant their expired owners in the database directly (one
//! transaction) and their files with plain writes, as an earlier run of the agent would
//! have left them: making 20,000 owners through the API would take minutes here.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use opmon_agent::storage_dir::StorageDir;
use opmon_client::{OwnerKind, OwnerPhase, WaitUntil};
use opmon_tests::{operation, restore_operation, Agent, Fixture, PLUGIN};

const LONG: Duration = Duration::from_secs(120);

/// Waits, bounded, until `done()` holds.
async fn until(what: &str, done: impl FnMut() -> bool) {
    opmon_tests::eventually_async(what, LONG, done).await
}

/// Opens the agent's database read-only (the agent may be running: WAL lets it).
fn database(state_dir: &Path) -> rusqlite::Connection {
    rusqlite::Connection::open_with_flags(
        state_dir.join("agent.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .expect("opening the database read-only")
}

fn count(conn: &rusqlite::Connection, sql: &str) -> i64 {
    conn.query_row(sql, [], |r| r.get(0)).expect(sql)
}

/// The decoded records of an item-operations file.
fn records(file: &Path) -> Vec<serde_json::Value> {
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(file).expect("opening the file"))
        .read_to_string(&mut text)
        .expect("a gzip file");
    serde_json::from_str(&text).expect("a JSON array")
}

#[tokio::test]
async fn a_result_file_cut_off_by_sigkill_is_written_after_the_restart() {
    let mut f = Fixture::new(&[]).await;
    let storage = f.agent.state_dir.join("storage");
    std::fs::create_dir_all(&storage).unwrap();
    // A file where the restores directory belongs: no user, root included, can create
    // the owner's directory, so the write after the commit fails.
    std::fs::write(storage.join("restores"), b"in the way").unwrap();
    {
        let client = f.agent.client().await;
        let owner = opmon_tests::start_and_end_in_progress(
            &client.restores(),
            "r",
            vec![operation(PLUGIN, "done-1", "a", &[])],
        )
        .await;
        assert_eq!(owner.phase, OwnerPhase::Completed, "the commit stands");
    }
    assert!(f
        .agent
        .log_text()
        .contains("writing the item-operations file failed; will retry"));
    // Killed before any retry could succeed: only the database knows the file is due.
    f.agent.kill9();
    std::fs::remove_file(storage.join("restores")).unwrap();
    f.agent.restart();
    let file = storage.join("restores/r/restore-r-itemoperations.json.gz");
    until("the file is written after the restart", || file.exists()).await;
    let written = records(&file);
    assert_eq!(written.len(), 1);
    assert_eq!(written[0]["spec"]["restoreName"], "r");
    assert_eq!(written[0]["status"]["phase"], "Completed");

    // Once durably written, the mark is cleared (at the latest at a clean stop).
    let status = f.agent.terminate();
    assert!(status.success());
    let db = database(&f.agent.state_dir);
    assert_eq!(count(&db, "SELECT COUNT(*) FROM records_due"), 0);
}

#[tokio::test]
async fn temporary_files_of_a_crashed_write_are_removed_at_start_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let owner_dir = dir.path().join("state/storage/backups/b");
    std::fs::create_dir_all(&owner_dir).unwrap();
    let deep = dir.path().join("state/storage/out/x/y");
    std::fs::create_dir_all(&deep).unwrap();
    // A finalize output's temporary file lies beside its final name, in any
    // finalize_dirs entry too (one nested in another is walked once).
    let outputs = dir.path().join("velero/outputs");
    let nested = outputs.join("nested");
    std::fs::create_dir_all(&nested).unwrap();
    let stale = [
        owner_dir.join(".opmon-Ab12Cd.tmp"),
        deep.join(".opmon-XyZ987.tmp"),
        outputs.join(".opmon-4242-0.tmp"),
        nested.join(".opmon-4242-1.tmp"),
    ];
    let kept = [
        owner_dir.join("b-itemoperations.json.gz"),
        owner_dir.join("b.tar.gz"),
        owner_dir.join("notes.tmp"),
        owner_dir.join(".opmon-settings"),
        outputs.join("b.tar.gz"),
        dir.path().join("velero/.opmon-4242-2.tmp"),
    ];
    for file in stale.iter().chain(&kept) {
        std::fs::write(file, b"x").unwrap();
    }
    let dirs = format!("--finalize-dirs={},{}", outputs.display(), nested.display());
    let agent = Agent::start(dir.path(), &[&dirs]);
    until("the start-up walk is done", || {
        agent
            .log_text()
            .contains("looked for temporary files left by an earlier run")
    })
    .await;
    assert!(
        agent.log_text().contains("removed=4"),
        "{}",
        agent.log_text()
    );
    for file in &stale {
        assert!(!file.exists(), "{} is left", file.display());
    }
    for file in &kept {
        assert!(file.exists(), "{} was removed", file.display());
    }
}

/// An earlier run's expired restores: `count` owners Completed an hour ago (owner `i`
/// a millisecond after owner `i - 1`, so expiry takes them in order), each with its
/// item-operations file. Returns their names.
fn plant_expired_restores(state_dir: &Path, count: usize) -> Vec<String> {
    let storage = StorageDir::new(state_dir.join("storage"));
    let mut conn = rusqlite::Connection::open(state_dir.join("agent.db")).unwrap();
    let tx = conn.transaction().unwrap();
    let hour_ago = (time::OffsetDateTime::now_utc().unix_timestamp() - 3600) * 1000;
    let mut names = Vec::with_capacity(count);
    {
        let mut insert = tx
            .prepare(
                "INSERT INTO owners (kind, name, uid, phase, item_operation_timeout_ms, \
                 created_ms, updated_ms, completed_ms) \
                 VALUES ('restore', ?1, 'u', 'Completed', 60000, ?2, ?2, ?2)",
            )
            .unwrap();
        for i in 0..count {
            let name = format!("old-{i:05}");
            insert
                .execute(rusqlite::params![name, hour_ago + i as i64])
                .unwrap();
            let file = storage.item_operations_file(OwnerKind::Restore, &name);
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            std::fs::write(&file, b"[]").unwrap();
            names.push(name);
        }
    }
    tx.commit().unwrap();
    names
}

/// The owner directories under `storage/restores`.
fn restore_dirs(state_dir: &Path) -> BTreeSet<String> {
    match std::fs::read_dir(state_dir.join("storage/restores")) {
        Ok(entries) => entries
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => BTreeSet::new(),
    }
}

fn restore_names(db: &rusqlite::Connection) -> BTreeSet<String> {
    let mut stmt = db
        .prepare("SELECT name FROM owners WHERE kind = 'restore'")
        .unwrap();
    let names = stmt
        .query_map([], |r| r.get::<_, String>(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    names
}

#[tokio::test]
async fn an_expiry_killed_halfway_leaves_no_orphaned_directory_after_the_restart() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("run/agent.sock");
    let state_dir = dir.path().join("state");
    let keep = ["--retention", "720h"];
    let mut agent = Agent::start(dir.path(), &keep);
    agent.terminate();
    let names = plant_expired_restores(&state_dir, 20_000);
    let first = StorageDir::new(state_dir.join("storage"))
        .item_operations_file(OwnerKind::Restore, &names[0])
        .parent()
        .unwrap()
        .to_path_buf();

    // Expire everything; kill as soon as the first directory is gone: its batch is
    // committed, its files are being removed, later batches are not done.
    let mut agent = Agent::start_at(dir.path(), &socket, &state_dir, &["--retention", "1m"]);
    until("expiry begins", || !first.exists()).await;
    agent.kill9();
    let (owners_left, dirs_left) = {
        let db = database(&state_dir);
        (restore_names(&db), restore_dirs(&state_dir))
    };
    let orphans = dirs_left.difference(&owners_left).count();
    println!(
        "at the kill: {} of 20000 owners left, {} directories, {orphans} of them orphaned",
        owners_left.len(),
        dirs_left.len()
    );
    assert!(owners_left.len() < 20_000, "the first batch was committed");

    // Restarted with a retention that expires nothing more: only the recorded
    // removals can take the orphaned directories.
    let _agent = Agent::start_at(dir.path(), &socket, &state_dir, &keep);
    let db = database(&state_dir);
    until("no removal left recorded", || {
        count(&db, "SELECT COUNT(*) FROM removals") == 0
    })
    .await;
    assert_eq!(
        restore_dirs(&state_dir),
        restore_names(&db),
        "every directory has its owner and every owner its directory"
    );
    assert_eq!(
        restore_names(&db),
        owners_left,
        "no more owners expired after the restart"
    );
}

#[tokio::test]
async fn an_old_removal_never_takes_the_file_of_a_re_created_owner() {
    let mut f = Fixture::new(&["--retention", "720h"]).await;
    let storage = f.agent.state_dir.join("storage");
    let file = storage.join("restores/r/restore-r-itemoperations.json.gz");
    let client = f.agent.client().await;
    let restores = client.restores();
    opmon_tests::start_and_end_in_progress(
        &restores,
        "r",
        vec![operation(PLUGIN, "done-1", "a", &[])],
    )
    .await;
    assert!(file.exists());
    // A directory where the file is: its removal fails and stays recorded.
    std::fs::remove_file(&file).unwrap();
    std::fs::create_dir(&file).unwrap();
    std::fs::write(file.join("x"), b"x").unwrap();
    restores.delete("r").await.unwrap();
    assert_eq!(
        count(
            &database(&f.agent.state_dir),
            "SELECT COUNT(*) FROM removals"
        ),
        1
    );
    assert!(f
        .agent
        .log_text()
        .contains("removing its files failed; will retry"));

    // A new restore of the same name writes its file before the old removal is retried.
    std::fs::remove_dir_all(&file).unwrap();
    restores.start("r", "new-uid").await.unwrap();
    restores
        .add_operations("r", vec![restore_operation(PLUGIN, "done-2", "b")])
        .await
        .unwrap();
    restores.end_in_progress("r").await.unwrap();
    assert!(file.exists());
    drop(client);

    // The restart retries the recorded removal.
    assert!(f.agent.terminate().success());
    f.agent.restart();
    let db = database(&f.agent.state_dir);
    until("the old removal is finished", || {
        count(&db, "SELECT COUNT(*) FROM removals") == 0
    })
    .await;
    assert!(file.exists(), "the new owner's file is kept");
    let written = records(&file);
    assert_eq!(written[0]["spec"]["restoreUID"], "new-uid");
}

#[tokio::test]
async fn a_large_expiry_holds_up_neither_polls_nor_agent_status() {
    let mut f = Fixture::new(&[]).await;
    {
        let client = f.agent.client().await;
        let owner = opmon_tests::start_and_end_in_progress(
            &client.backups(),
            "waiting",
            vec![operation(PLUGIN, "gate-1", "a", &[])],
        )
        .await;
        assert_eq!(owner.phase, OwnerPhase::WaitingForPluginOperations);
    }
    assert!(f.agent.terminate().success());
    const EXPIRED: u64 = 10_000;
    let planting = Instant::now();
    plant_expired_restores(&f.agent.state_dir, EXPIRED as usize);
    println!(
        "planted {EXPIRED} expired owners in {:?}",
        planting.elapsed()
    );
    f.open_gate("gate-1");
    // The agent starts with 10,000 owners to expire and one backup to poll.
    let socket: PathBuf = f.agent.socket.clone();
    let logs = f.dir.path().join("expiring");
    std::fs::create_dir_all(&logs).unwrap();
    let _agent = Agent::start_at(&logs, &socket, &f.agent.state_dir, &["--retention", "1m"]);
    let client = opmon_client::Client::connect(&socket).await.unwrap();
    let owner = client
        .backups()
        .wait("waiting", WaitUntil::ReadyToFinalize, LONG)
        .await
        .unwrap()
        .owner;
    assert_eq!(owner.phase, OwnerPhase::Finalizing);
    let completed =
        |s: &opmon_client::AgentStatus| s.owners.get(&OwnerPhase::Completed).copied().unwrap_or(0);
    let at_poll = completed(&client.status().await.unwrap());
    println!("when the poll finished, {at_poll} of {EXPIRED} expired owners were still there");
    assert!(
        at_poll > 0,
        "the poll waited for the whole expiry to finish"
    );
    // agent.status answers between the batches: it sees the count go down in steps.
    let mut seen = BTreeSet::new();
    let start = Instant::now();
    loop {
        let left = completed(&client.status().await.unwrap());
        seen.insert(left);
        if left == 0 {
            break;
        }
        assert!(start.elapsed() < LONG, "expiry did not finish");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let steps = seen.iter().filter(|&&n| n > 0 && n < EXPIRED).count();
    println!(
        "agent.status saw {steps} intermediate counts during the expiry, done {:?} after the poll",
        start.elapsed()
    );
    assert!(steps >= 1, "no answer between batches: {seen:?}");
}
