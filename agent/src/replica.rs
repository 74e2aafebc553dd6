//! Cooperation with an external replicator of the database (Litestream).
//!
//! - **Checkpoints.** With `checkpoint = "external"` the writer never checkpoints
//!   (`wal_autocheckpoint = 0`), so no frame is checkpointed before Litestream has copied
//!   it.
//! - **Restored files.** A restore or a copy makes the database files under the umask
//!   (0644); at start the agent sets them back to its 0600, logging each, since a restore
//!   leaves no marker to go by.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::store::{StorageFailure, Store};

/// Who checkpoints the WAL into the database file.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Checkpoint {
    // The doc lines are `--help`'s text, so they name store::CHECKPOINT_PAGES by value.
    /// SQLite, automatically, whenever the WAL passes 4,000 pages.
    Sqlite,
    /// Someone else (Litestream): the agent never checkpoints while it runs.
    External,
}

/// The mode the agent gives its database files.
const PRIVATE: u32 = 0o600;

/// The database file and the files SQLite and the agent keep next to it.
fn database_files(db: &Path) -> Vec<PathBuf> {
    ["", "-wal", "-shm", ".lock"]
        .iter()
        .map(|suffix| {
            let mut name = db.as_os_str().to_owned();
            name.push(suffix);
            PathBuf::from(name)
        })
        .collect()
}

/// One file whose mode was repaired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Repaired {
    pub path: PathBuf,
    pub was: u32,
}

/// Sets every existing database file of `db` that group or others may use to 0600, and
/// logs each change. Files that do not exist are skipped (a fresh start has none); a
/// symlink is followed, as SQLite follows it.
/// Fails naming the file when one cannot be read or changed (another owner, say):
/// starting on a database others can read would break the promise of its mode.
pub fn repair_modes(db: &Path) -> Result<Vec<Repaired>, String> {
    let mut repaired = Vec::new();
    for path in database_files(db) {
        let meta = match std::fs::metadata(&path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(format!("checking the mode of {}: {e}", path.display())),
        };
        if !meta.file_type().is_file() {
            return Err(format!(
                "{} is not a regular file; the agent keeps its database there",
                path.display()
            ));
        }
        let was = meta.permissions().mode() & 0o7777;
        if was == PRIVATE {
            continue;
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(PRIVATE)).map_err(|e| {
            format!(
                "{} has mode {was:04o} (restored or copied?) and setting it to 0600 failed: {e}; restore it as the agent's user, or chown it to that user",
                path.display()
            )
        })?;
        tracing::warn!(
            file = %path.display(),
            was = %format!("{was:04o}"),
            "database file had mode {was:04o}, not the agent's 0600 (a restore or a copy made it); set it to 0600"
        );
        repaired.push(Repaired { path, was });
    }
    Ok(repaired)
}

/// Applies `checkpoint` to the writer's connection, the only one that commits (readers
/// are `query_only` and never checkpoint).
pub async fn apply(store: &Store, checkpoint: Checkpoint) -> Result<(), StorageFailure> {
    if checkpoint == Checkpoint::Sqlite {
        return Ok(());
    }
    store
        .write(|conn| {
            // The pragma's setting belongs to the connection, not the transaction, so
            // the group transaction it runs in does not undo it.
            let pages: i64 = conn.query_row("PRAGMA wal_autocheckpoint = 0", [], |r| r.get(0))?;
            if pages != 0 {
                return Err(StorageFailure {
                    message: format!("disabling automatic checkpoints left them at {pages} pages"),
                    disk_full: false,
                });
            }
            Ok(())
        })
        .await?;
    tracing::info!(
        "checkpoint = \"external\": the agent does not checkpoint the WAL; the replicator (Litestream) does"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn restored_files_are_made_private_and_reported() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("agent.db");
        std::fs::write(&db, b"").unwrap();
        std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o644)).unwrap();
        let wal = dir.path().join("agent.db-wal");
        std::fs::write(&wal, b"").unwrap();
        std::fs::set_permissions(&wal, std::fs::Permissions::from_mode(0o600)).unwrap();
        let repaired = repair_modes(&db).unwrap();
        assert_eq!(
            repaired,
            vec![Repaired {
                path: db.clone(),
                was: 0o644
            }]
        );
        assert_eq!(mode(&db), 0o600);
        assert_eq!(mode(&wal), 0o600);
        assert!(repair_modes(&db).unwrap().is_empty(), "nothing left to do");
    }

    #[test]
    fn a_symlinked_database_is_followed_as_sqlite_follows_it() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("elsewhere.db");
        std::fs::write(&real, b"").unwrap();
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o640)).unwrap();
        let db = dir.path().join("agent.db");
        std::os::unix::fs::symlink(&real, &db).unwrap();
        let repaired = repair_modes(&db).unwrap();
        assert_eq!(repaired.len(), 1);
        assert_eq!(repaired[0].was, 0o640);
        assert_eq!(mode(&real), 0o600);
    }

    #[test]
    fn a_directory_in_place_of_the_database_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("agent.db");
        std::fs::create_dir(dir.path().join("agent.db-shm")).unwrap();
        let e = repair_modes(&db).unwrap_err();
        assert_eq!(
            e,
            format!(
                "{}-shm is not a regular file; the agent keeps its database there",
                db.display()
            )
        );
    }

    #[tokio::test]
    async fn external_checkpoint_turns_automatic_checkpoints_off() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("agent.db");
        let store = Store::open(&db, |_, _| {}).unwrap();
        apply(&store, Checkpoint::External).await.unwrap();
        let pages: i64 = store
            .write(|conn| {
                conn.query_row("PRAGMA wal_autocheckpoint", [], |r| r.get(0))
                    .map_err(StorageFailure::from)
            })
            .await
            .unwrap();
        assert_eq!(pages, 0);
        store.close();
    }
}
