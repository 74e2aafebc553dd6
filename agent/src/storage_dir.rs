//! The storage directory, in Velero's object-store layout: where the item-operation
//! files live, and how any result file is written: to a temporary file beside it,
//! fsynced, renamed into place, and the directory fsynced, so a reader sees the old
//! file or the new one, never a torn one, and a crash keeps whichever was last renamed.
//!
//! The file-name patterns here are the one source of the longest owner name the agent
//! accepts: every file it writes for an owner must fit the file system's limit on a
//! name ([`NAME_MAX`]). Temporary files are named `.opmon-*.tmp`; one left by a crash is
//! removed at the next start ([`remove_stale_temp_files`]).

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use flate2::write::GzEncoder;
use flate2::Compression;
use opmon_client::{ItemOperation, OwnerKind};

/// The longest file name (one path component) Linux file systems take, in bytes.
pub const NAME_MAX: usize = 255;
/// Temporary files of atomic writes are `TEMP_PREFIX…TEMP_SUFFIX`, beside their target.
pub const TEMP_PREFIX: &str = ".opmon-";
pub const TEMP_SUFFIX: &str = ".tmp";

/// The file in the storage directory that says an agent has run with it: its database
/// is then not to be found missing or empty (see [`StorageDir::check_database`]).
pub const RAN_MARKER: &str = ".opmon-agent-ran";

/// The directory of an owner's files, under the storage root, and their name there:
/// `backups/<b>` and `<b>-itemoperations.json.gz`, or `restores/<r>` and
/// `restore-<r>-itemoperations.json.gz`, as Velero names them.
fn item_operations_name(kind: OwnerKind, name: &str) -> (&'static str, String) {
    match kind {
        OwnerKind::Backup => ("backups", format!("{name}-itemoperations.json.gz")),
        OwnerKind::Restore => ("restores", format!("restore-{name}-itemoperations.json.gz")),
    }
}

/// The longest owner name of `kind` whose files fit [`NAME_MAX`].
pub fn max_owner_name_len(kind: OwnerKind) -> usize {
    NAME_MAX.saturating_sub(item_operations_name(kind, "").1.len())
}

/// The storage directory.
#[derive(Clone, Debug)]
pub struct StorageDir {
    root: PathBuf,
}

impl StorageDir {
    pub fn new(root: PathBuf) -> StorageDir {
        StorageDir { root }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Refuses to start on `db` if it is missing or empty while the storage directory
    /// says an agent has run with it: a lost or truncated database must not turn into a
    /// silent fresh start that forgets every backup and restore. `start_anew` is the
    /// operator saying that is what they want.
    pub fn check_database(&self, db: &Path, start_anew: bool) -> Result<(), String> {
        let state = match std::fs::metadata(db) {
            Ok(meta) if meta.len() == 0 => "empty",
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => "missing",
            Err(e) => return Err(format!("reading the database {}: {e}", db.display())),
        };
        let marker = self.root.join(RAN_MARKER);
        if !marker.exists() {
            return Ok(());
        }
        if start_anew {
            tracing::warn!(database = %db.display(), state,
                "starting anew (start_anew): the backups and restores of the last database are forgotten");
            return Ok(());
        }
        Err(format!(
            "the database {} is {state}, but an agent has run with the storage directory {} \
             before ({} exists): starting would forget its backups and restores. Restore the \
             database (`litestream restore -o {}` from its replica, or a copy), or set \
             start_anew = true (OPMON_START_ANEW=true) to start with an empty one",
            db.display(),
            self.root.display(),
            marker.display(),
            db.display()
        ))
    }

    /// Leaves [`RAN_MARKER`] in the storage directory, once a database is open.
    pub fn mark_ran(&self) -> io::Result<()> {
        let marker = self.root.join(RAN_MARKER);
        if marker.exists() {
            return Ok(());
        }
        write_atomically(&marker, |out| {
            out.write_all(b"An opmon agent has run with this storage directory: see start_anew.\n")
        })
    }

    /// `backups/<b>/<b>-itemoperations.json.gz` or
    /// `restores/<r>/restore-<r>-itemoperations.json.gz`, as Velero names them.
    pub fn item_operations_file(&self, kind: OwnerKind, name: &str) -> PathBuf {
        let (dir, file) = item_operations_name(kind, name);
        self.root.join(dir).join(name).join(file)
    }

    /// The owner whose item operations file `path` (absolute) is, whether or not the
    /// owner or the file exists: a file the agent writes, which nothing else may.
    pub fn item_operations_owner(&self, path: &Path) -> Option<(OwnerKind, String)> {
        let canonical = std::fs::canonicalize(&self.root).ok();
        let roots = std::iter::once(self.root.as_path()).chain(canonical.as_deref());
        for root in roots {
            let Ok(relative) = path.strip_prefix(root) else {
                continue;
            };
            let parts: Vec<&std::ffi::OsStr> = relative.iter().collect();
            let [dir, name, file] = parts[..] else {
                continue;
            };
            let name = name.to_str()?;
            for kind in OwnerKind::ALL {
                let (kind_dir, kind_file) = item_operations_name(kind, name);
                if dir == kind_dir && file == kind_file.as_str() {
                    return Some((kind, name.to_string()));
                }
            }
        }
        None
    }

    /// Writes the owner's records as a gzipped JSON array, atomically, with the bytes
    /// Velero's own encoder would write for them (see [`crate::gojson`]).
    pub fn write_item_operations(
        &self,
        kind: OwnerKind,
        name: &str,
        records: &[ItemOperation],
    ) -> io::Result<PathBuf> {
        let path = self.item_operations_file(kind, name);
        write_atomically(&path, |out| {
            // serde_json writes in small pieces; buffer them so the compressor gets
            // whole blocks rather than one call per fragment.
            let gz = GzEncoder::new(out, Compression::new(6));
            let mut json = BufWriter::with_capacity(64 * 1024, gz);
            crate::gojson::encode(&mut json, records)?;
            json.into_inner().map_err(|e| e.into_error())?.finish()?;
            Ok(())
        })?;
        Ok(path)
    }

    /// Removes the owner's item-operations file and then its directory, if nothing else
    /// is left in it (other files of the backup may live there). Either may already be
    /// gone (a removal repeated after a crash).
    pub fn remove_owner(&self, kind: OwnerKind, name: &str) -> io::Result<()> {
        let file = self.item_operations_file(kind, name);
        match std::fs::remove_file(&file) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(with_path(e, "removing", &file)),
        }
        if let Some(dir) = file.parent() {
            match std::fs::remove_dir(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) if e.raw_os_error() == Some(nix::libc::ENOTEMPTY) => {}
                Err(e) => return Err(with_path(e, "removing", dir)),
            }
        }
        Ok(())
    }
}

/// Whether `name` is a temporary file's name (`.opmon-*.tmp`): one the agent removes
/// when it starts, unless it is newer than the start.
pub fn is_temp_name(name: &str) -> bool {
    name.len() > TEMP_PREFIX.len() + TEMP_SUFFIX.len()
        && name.starts_with(TEMP_PREFIX)
        && name.ends_with(TEMP_SUFFIX)
}

/// Removes the temporary files (`.opmon-*.tmp`) under `root` last modified before
/// `before`: those of writes a crash interrupted (a write of this run is newer). Symbolic
/// links are not followed. The walk ends early once `stop()` says so. Returns how many
/// were removed; failures are logged.
pub fn remove_stale_temp_files(
    root: &Path,
    before: std::time::SystemTime,
    stop: &dyn Fn() -> bool,
) -> usize {
    /// Deeper than any layout the agent or a backup server makes; bounds the walk.
    const MAX_DEPTH: usize = 16;
    let mut removed = 0;
    let mut dirs = vec![(root.to_path_buf(), 0)];
    while let Some((dir, depth)) = dirs.pop() {
        if stop() {
            break;
        }
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e,
                    "looking for stale temporary files failed");
                continue;
            }
        };
        for entry in entries.flatten() {
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            let path = entry.path();
            if kind.is_dir() {
                if depth < MAX_DEPTH {
                    dirs.push((path, depth + 1));
                }
                continue;
            }
            let name = entry.file_name();
            let temporary = kind.is_file() && is_temp_name(&name.to_string_lossy());
            let stale = entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|modified| modified < before);
            if temporary && stale {
                match std::fs::remove_file(&path) {
                    Ok(()) => removed += 1,
                    Err(e) => tracing::warn!(file = %path.display(), error = %e,
                        "removing a stale temporary file failed"),
                }
            }
        }
    }
    removed
}

fn with_path(e: io::Error, what: &str, path: &Path) -> io::Error {
    io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))
}

/// Writes `path` atomically with `write`, creating its directory if needed, and returns
/// what `write` returned once the file is durably in place. On any error nothing is
/// left at `path` that was not there before.
pub fn write_atomically<T>(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<&mut File>) -> io::Result<T>,
) -> io::Result<T> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::other(format!("{} has no directory", path.display())))?;
    std::fs::create_dir_all(dir).map_err(|e| with_path(e, "creating", dir))?;
    let mut temp = tempfile::Builder::new()
        .prefix(TEMP_PREFIX)
        .suffix(TEMP_SUFFIX)
        .tempfile_in(dir)
        .map_err(|e| with_path(e, "creating a temporary file in", dir))?;
    let written = {
        let mut out = BufWriter::with_capacity(256 * 1024, temp.as_file_mut());
        let written = write(&mut out).map_err(|e| with_path(e, "writing", path))?;
        out.flush().map_err(|e| with_path(e, "writing", path))?;
        written
    };
    // Result files are for the backup server to read: group-readable, like the socket.
    std::fs::set_permissions(
        temp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o640),
    )
    .map_err(|e| with_path(e, "setting the mode of", temp.path()))?;
    temp.as_file()
        .sync_all()
        .map_err(|e| with_path(e, "syncing", path))?;
    temp.persist(path)
        .map_err(|e| with_path(e.error, "renaming into", path))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| with_path(e, "syncing directory", dir))?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_names_accepted_make_file_names_of_exactly_name_max() {
        let storage = StorageDir::new(PathBuf::from("/s"));
        for kind in OwnerKind::ALL {
            let longest = "a".repeat(max_owner_name_len(kind));
            let file = storage.item_operations_file(kind, &longest);
            let name = file.file_name().unwrap().len();
            assert_eq!(name, NAME_MAX, "{kind}");
        }
        assert_eq!(max_owner_name_len(OwnerKind::Backup), 232);
        assert_eq!(max_owner_name_len(OwnerKind::Restore), 224);
    }

    #[test]
    fn only_stale_temporary_files_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let owner = dir.path().join("backups/b");
        std::fs::create_dir_all(&owner).unwrap();
        for name in [
            ".opmon-abc123.tmp",
            "b-itemoperations.json.gz",
            "x.tmp",
            ".opmon-notes",
        ] {
            std::fs::write(owner.join(name), b"x").unwrap();
        }
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(60);
        // Files newer than `before` belong to writes of this run: kept.
        let go_on = || false;
        assert_eq!(
            remove_stale_temp_files(dir.path(), std::time::UNIX_EPOCH, &go_on),
            0
        );
        assert_eq!(remove_stale_temp_files(dir.path(), later, &|| true), 0);
        assert_eq!(remove_stale_temp_files(dir.path(), later, &go_on), 1);
        let mut left: Vec<String> = std::fs::read_dir(&owner)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, [".opmon-notes", "b-itemoperations.json.gz", "x.tmp"]);
    }
}
