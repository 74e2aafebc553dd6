//! The storage directory, in Velero's object-store layout: where the item-operation
//! files live, and how any result file is written: to a temporary file beside it,
//! fsynced, renamed into place, and the directory fsynced, so a reader sees the old
//! file or the new one, never a torn one, and a crash keeps whichever was last renamed.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use flate2::write::GzEncoder;
use flate2::Compression;
use opmon_client::{ItemOperation, OwnerKind};

/// The storage directory.
#[derive(Clone, Debug)]
pub struct Storage {
    root: PathBuf,
}

impl Storage {
    pub fn new(root: PathBuf) -> Storage {
        Storage { root }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `backups/<b>/<b>-itemoperations.json.gz` or
    /// `restores/<r>/restore-<r>-itemoperations.json.gz`, as Velero names them.
    pub fn item_operations_file(&self, kind: OwnerKind, name: &str) -> PathBuf {
        match kind {
            OwnerKind::Backup => self
                .root
                .join("backups")
                .join(name)
                .join(format!("{name}-itemoperations.json.gz")),
            OwnerKind::Restore => self
                .root
                .join("restores")
                .join(name)
                .join(format!("restore-{name}-itemoperations.json.gz")),
        }
    }

    /// A path given by a client: absolute as is, relative under the storage directory
    /// (without `..`, so it cannot climb out).
    pub fn resolve(&self, path: &Path) -> Result<PathBuf, String> {
        if path.is_absolute() {
            return Ok(path.to_path_buf());
        }
        if path
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err("a relative path must not contain '..' or '.'".into());
        }
        Ok(self.root.join(path))
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

    /// Removes the owner's directory of files (on delete and expiry).
    pub fn remove_owner(&self, kind: OwnerKind, name: &str) -> io::Result<()> {
        let file = self.item_operations_file(kind, name);
        match std::fs::remove_file(&file) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(with_path(e, "removing", &file)),
        }
        if let Some(dir) = file.parent() {
            // Only if empty: other files of the backup may live there.
            let _ = std::fs::remove_dir(dir);
        }
        Ok(())
    }
}

fn with_path(e: io::Error, what: &str, path: &Path) -> io::Error {
    io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))
}

/// Writes `path` atomically with `write`, creating its directory if needed. On any
/// error nothing is left at `path` that was not there before.
pub fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<&mut File>) -> io::Result<()>,
) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::other(format!("{} has no directory", path.display())))?;
    std::fs::create_dir_all(dir).map_err(|e| with_path(e, "creating", dir))?;
    let mut temp = tempfile::Builder::new()
        .prefix(".opmon-")
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(|e| with_path(e, "creating a temporary file in", dir))?;
    {
        let mut out = BufWriter::with_capacity(256 * 1024, temp.as_file_mut());
        write(&mut out).map_err(|e| with_path(e, "writing", path))?;
        out.flush().map_err(|e| with_path(e, "writing", path))?;
    }
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
    Ok(())
}
