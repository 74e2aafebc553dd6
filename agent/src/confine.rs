//! Where `finalize` may read and write: the paths a client names in `contents` are
//! resolved here, and opened only beneath a directory the operator allows (the storage
//! directory and each `finalize_dirs` entry), never onto the agent's own files.
//!
//! Invariants, for every path that passes:
//! - after symbolic links, `..` and aliases it lies beneath an allowed directory, and
//!   the final open goes through `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`
//!   relative to a descriptor of that directory, so a symbolic link planted or swapped
//!   in between the check and the open cannot lead out of it;
//! - it is not inside the state directory (the database, its WAL and lock), unless
//!   beneath an allowed directory that itself lies inside it (the default storage
//!   directory does), and it is not the API socket;
//! - the input is an existing regular file, opened `O_NOFOLLOW | O_NONBLOCK` (a FIFO
//!   cannot hold the open) and checked with `fstat` on the descriptor that is read;
//! - the output, if it exists, is a regular file; it is written as a temporary file
//!   created in the resolved directory's descriptor and renamed into place there.
//!
//! A relative path is relative to the storage directory. Every refusal is a
//! [`Error::Finalize`] naming the field, the path and the rule.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::errno::Errno;
use nix::fcntl::{openat2, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{fstat, fstatat, FileStat, Mode, SFlag};

use crate::error::Error;

/// The directories finalize may use, and the agent's own places it must not.
#[derive(Clone, Debug)]
pub struct Confinement {
    /// The storage directory first, then `finalize_dirs`.
    allowed: Vec<PathBuf>,
    state_dir: Option<PathBuf>,
    socket: Option<PathBuf>,
}

/// How a client's path resolved: the allowed directory it lies beneath and the path
/// relative to it.
struct Resolved {
    base: PathBuf,
    relative: PathBuf,
}

impl Resolved {
    fn full(&self) -> PathBuf {
        self.base.join(&self.relative)
    }
}

fn what_kind(stat: &FileStat) -> &'static str {
    match SFlag::from_bits_truncate(stat.st_mode & SFlag::S_IFMT.bits()) {
        SFlag::S_IFIFO => "a FIFO",
        SFlag::S_IFCHR => "a character device",
        SFlag::S_IFBLK => "a block device",
        SFlag::S_IFDIR => "a directory",
        SFlag::S_IFSOCK => "a socket",
        SFlag::S_IFLNK => "a symbolic link",
        _ => "not a regular file",
    }
}

fn is_regular(stat: &FileStat) -> bool {
    stat.st_mode & SFlag::S_IFMT.bits() == SFlag::S_IFREG.bits()
}

fn beneath() -> ResolveFlag {
    ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS
}

/// The path the kernel has for an open descriptor.
fn path_of(fd: &impl AsRawFd) -> io::Result<PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// The canonical form of `path`'s longest existing ancestor, with the rest appended
/// (which must then be plain names); `None` when a `..` follows a name that does not
/// exist (the kernel cannot resolve it either).
fn canonical_prefix(path: &Path) -> Option<PathBuf> {
    let mut tail: Vec<OsString> = Vec::new();
    let mut probe = path.to_path_buf();
    loop {
        if let Ok(found) = std::fs::canonicalize(&probe) {
            let mut full = found;
            for part in tail.iter().rev() {
                full.push(part);
            }
            return Some(full);
        }
        match probe.components().next_back() {
            Some(Component::Normal(name)) => tail.push(name.to_os_string()),
            _ => return None,
        }
        probe.pop();
    }
}

fn io_error(field: &str, path: &Path, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Finalize(format!("{field} {}: {what}: {e}", path.display()))
}

impl Confinement {
    /// `storage` and `extra` (absolute directories) are where finalize may read and
    /// write; `state_dir` and `socket` are the agent's own.
    pub fn new(
        storage: &Path,
        extra: &[PathBuf],
        state_dir: Option<&Path>,
        socket: Option<&Path>,
    ) -> Confinement {
        let mut allowed = vec![storage.to_path_buf()];
        allowed.extend(extra.iter().cloned());
        Confinement {
            allowed,
            state_dir: state_dir.map(Path::to_path_buf),
            socket: socket.map(Path::to_path_buf),
        }
    }

    /// The directories finalize writes into, outermost only (a `finalize_dirs`
    /// entry inside another is covered by it): where a crashed write's temporary
    /// file can be.
    pub fn write_roots(&self) -> Vec<PathBuf> {
        let all = self.allowed();
        all.iter()
            .filter(|dir| {
                !all.iter()
                    .any(|other| other != *dir && dir.starts_with(other))
            })
            .cloned()
            .collect()
    }

    /// The allowed directories, canonical (the storage directory is created if it is
    /// missing; other missing ones are skipped).
    fn allowed(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for (i, dir) in self.allowed.iter().enumerate() {
            if i == 0 && !dir.exists() {
                let _ = std::fs::create_dir_all(dir);
            }
            if let Ok(c) = std::fs::canonicalize(dir) {
                out.push(c);
            }
        }
        out
    }

    fn storage(&self) -> &Path {
        &self.allowed[0]
    }

    /// "outside the storage directory … and every finalize_dirs entry".
    fn outside(&self, field: &str, given: &Path, resolved: Option<&Path>) -> Error {
        let via = match resolved {
            Some(r) if r != given => format!(" (it resolves to {})", r.display()),
            _ => String::new(),
        };
        let others = if self.allowed.len() > 1 {
            " and every finalize_dirs entry"
        } else {
            " (finalize_dirs names no other directory)"
        };
        Error::Finalize(format!(
            "{field} {}{via}: outside the storage directory {}{others}",
            given.display(),
            self.storage().display()
        ))
    }

    /// Resolves `given` (relative: under the storage directory) to the allowed
    /// directory it lies beneath. With `parent_only`, only its directory must exist.
    fn resolve(&self, field: &str, given: &Path) -> Result<Resolved, Error> {
        if given.as_os_str().as_bytes().contains(&0) {
            return Err(Error::Finalize(format!(
                "{field} {:?}: contains a NUL character, which no file name can",
                given.display().to_string()
            )));
        }
        let absolute = if given.is_absolute() {
            given.to_path_buf()
        } else {
            self.storage().join(given)
        };
        match absolute.components().next_back() {
            Some(Component::Normal(_)) => {}
            _ => {
                return Err(Error::Finalize(format!(
                    "{field} {}: must name a file",
                    given.display()
                )))
            }
        }
        let canonical = canonical_prefix(&absolute).ok_or_else(|| {
            Error::Finalize(format!(
                "{field} {}: a `..` in it follows a directory that does not exist, so it \
                 cannot be resolved",
                given.display()
            ))
        })?;
        let allowed = self.allowed();
        // The agent's own places first: the most specific rule is the one to name.
        if let Some(state) = self.state_dir_holding(&canonical, &allowed) {
            let via = if canonical != absolute {
                format!(" (it resolves to {})", canonical.display())
            } else {
                String::new()
            };
            return Err(self.in_state_dir(field, given, &via, &state));
        }
        if let Some(socket) = self.socket.as_ref().and_then(|s| canonical_prefix(s)) {
            if canonical == socket {
                return Err(Error::Finalize(format!(
                    "{field} {}: is the agent's API socket",
                    given.display()
                )));
            }
        }
        // The innermost allowed directory holding it (finalize_dirs may nest).
        let base = allowed
            .iter()
            .filter(|dir| canonical.starts_with(dir))
            .max_by_key(|dir| dir.components().count())
            .ok_or_else(|| self.outside(field, given, Some(&canonical)))?;
        let relative = canonical
            .strip_prefix(base)
            .map(Path::to_path_buf)
            .map_err(|_| self.outside(field, given, Some(&canonical)))?;
        Ok(Resolved {
            base: base.clone(),
            relative,
        })
    }

    /// Opens an allowed directory itself.
    fn open_base(&self, field: &str, given: &Path, base: &Path) -> Result<OwnedFd, Error> {
        nix::fcntl::open(
            base,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_error(field, given, &format!("opening {}", base.display()), e))
    }

    /// Refuses what `fd` turned out to be, checked on the descriptor itself.
    fn check_opened(&self, field: &str, given: &Path, fd: &impl AsRawFd) -> Result<(), Error> {
        let actual = path_of(fd).map_err(|e| io_error(field, given, "locating it", e))?;
        let allowed = self.allowed();
        if !allowed.iter().any(|dir| actual.starts_with(dir)) {
            return Err(self.outside(field, given, Some(&actual)));
        }
        if let Some(state) = self.state_dir_holding(&actual, &allowed) {
            return Err(self.in_state_dir(field, given, "", &state));
        }
        Ok(())
    }

    /// The agent's state directory if `path` (canonical) lies inside it and inside no
    /// allowed directory that is itself within the state directory.
    fn state_dir_holding(&self, path: &Path, allowed: &[PathBuf]) -> Option<PathBuf> {
        let state = std::fs::canonicalize(self.state_dir.as_ref()?).ok()?;
        let sheltered = allowed
            .iter()
            .any(|dir| path.starts_with(dir) && dir.starts_with(&state) && dir != &state);
        (path.starts_with(&state) && !sheltered).then_some(state)
    }

    fn in_state_dir(&self, field: &str, given: &Path, via: &str, state: &Path) -> Error {
        Error::Finalize(format!(
            "{field} {}{via}: inside the agent's state directory {}",
            given.display(),
            state.display()
        ))
    }

    /// The `openat2` failure described: the kernel refuses a path that leads out of
    /// the directory with EXDEV, a magic link with ELOOP.
    fn open_failed(&self, field: &str, given: &Path, base: &Path, e: Errno) -> Error {
        match e {
            Errno::EXDEV | Errno::ELOOP => Error::Finalize(format!(
                "{field} {}: leads outside {} (through a symbolic link or '..')",
                given.display(),
                base.display()
            )),
            Errno::ENOENT => Error::Finalize(format!("{field} {}: no such file", given.display())),
            e => io_error(field, given, "opening it", e),
        }
    }

    /// Opens the tarball to read: an existing regular file, confined.
    pub fn open_input(&self, field: &str, given: &Path) -> Result<(File, FileStat), Error> {
        let r = self.resolve(field, given)?;
        let base = self.open_base(field, given, &r.base)?;
        let how = OpenHow::new()
            .flags(OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)
            .resolve(beneath());
        let fd = openat2(&base, &r.relative, how).map_err(|e| match e {
            // O_NOFOLLOW on a symbolic link: one swapped in after the check.
            Errno::ELOOP => {
                Error::Finalize(format!("{field} {}: is a symbolic link", given.display()))
            }
            e => self.open_failed(field, given, &r.base, e),
        })?;
        let stat = fstat(&fd).map_err(|e| io_error(field, given, "reading its status", e))?;
        if !is_regular(&stat) {
            return Err(Error::Finalize(format!(
                "{field} {}: is {}, not a regular file",
                given.display(),
                what_kind(&stat)
            )));
        }
        self.check_opened(field, given, &fd)?;
        // Blocking reads from here on (O_NONBLOCK only guarded the open).
        nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_SETFL(OFlag::empty()))
            .map_err(|e| io_error(field, given, "opening it", e))?;
        Ok((File::from(fd), stat))
    }

    /// Resolves where the output goes: its directory (created if missing, confined)
    /// and name. An existing file there must be a regular file; it may be the input
    /// itself, as Velero replaces `<backup>.tar.gz` at its key: the output is written
    /// beside it and renamed over it, and the input stays open until the rewrite ends.
    pub fn output(&self, field: &str, given: &Path) -> Result<OutputTarget, Error> {
        let r = self.resolve(field, given)?;
        let base = self.open_base(field, given, &r.base)?;
        let name = r
            .relative
            .file_name()
            .map(OsStr::to_os_string)
            .ok_or_else(|| {
                Error::Finalize(format!("{field} {}: must name a file", given.display()))
            })?;
        // Walk the directories from the base, creating what is missing, each step
        // confined beneath the base (`base` stays open for the lookups, `dir` moves).
        let mut dir = self.open_base(field, given, &r.base)?;
        let mut so_far = PathBuf::new();
        if let Some(parent) = r.relative.parent() {
            for part in parent.components() {
                let Component::Normal(part) = part else {
                    return Err(self.outside(field, given, Some(&r.full())));
                };
                so_far.push(part);
                let how = || {
                    OpenHow::new()
                        .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC)
                        .resolve(beneath())
                };
                let next = match openat2(&base, &so_far, how()) {
                    Err(Errno::ENOENT) => {
                        match nix::sys::stat::mkdirat(&dir, part, Mode::from_bits_truncate(0o750)) {
                            Ok(()) | Err(Errno::EEXIST) => {}
                            Err(e) => {
                                return Err(io_error(
                                    field,
                                    given,
                                    &format!("creating {}", r.base.join(&so_far).display()),
                                    e,
                                ))
                            }
                        }
                        openat2(&base, &so_far, how())
                    }
                    other => other,
                }
                .map_err(|e| self.open_failed(field, given, &r.base, e))?;
                dir = next;
            }
        }
        self.check_opened(field, given, &dir)?;
        match fstatat(
            &dir,
            name.as_os_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        ) {
            Ok(existing) => {
                if !is_regular(&existing) {
                    return Err(Error::Finalize(format!(
                        "{field} {}: is {}, not a regular file",
                        given.display(),
                        what_kind(&existing)
                    )));
                }
            }
            Err(Errno::ENOENT) => {}
            Err(e) => return Err(io_error(field, given, "reading its status", e)),
        }
        let path = path_of(&dir)
            .map(|d| d.join(&name))
            .unwrap_or_else(|_| r.full());
        Ok(OutputTarget { dir, name, path })
    }
}

/// Where an output goes: a directory descriptor and a name in it.
pub struct OutputTarget {
    dir: OwnedFd,
    name: OsString,
    /// For messages and the stored result.
    pub path: PathBuf,
}

/// Temporary names are unique within the process; the pid keeps two processes apart.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl OutputTarget {
    /// Creates the temporary file the output is written to, beside its final name.
    pub fn create_temp(self) -> io::Result<TempOutput> {
        let temp = OsString::from(format!(
            ".opmon-{}-{}.tmp",
            std::process::id(),
            TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let fd = nix::fcntl::openat(
            &self.dir,
            temp.as_os_str(),
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o640),
        )
        .map_err(io::Error::from)?;
        let file = File::from(fd);
        // Result files are for the backup server to read: group-readable, whatever the
        // umask.
        nix::sys::stat::fchmod(&file, Mode::from_bits_truncate(0o640)).map_err(io::Error::from)?;
        Ok(TempOutput {
            file: Some(file),
            temp,
            target: self,
            persisted: false,
        })
    }
}

/// The output being written; removed when dropped unless [`TempOutput::persist`]ed.
pub struct TempOutput {
    file: Option<File>,
    temp: OsString,
    target: OutputTarget,
    persisted: bool,
}

impl TempOutput {
    pub fn file(&mut self) -> io::Result<&mut File> {
        self.file
            .as_mut()
            .ok_or_else(|| io::Error::other("the temporary output is closed"))
    }

    pub fn path(&self) -> &Path {
        &self.target.path
    }

    /// Syncs it, renames it into place and syncs the directory: a crash keeps the old
    /// file or the new one, whole.
    pub fn persist(mut self) -> io::Result<PathBuf> {
        if let Some(file) = self.file.take() {
            file.sync_all()?;
        }
        let dir = &self.target.dir;
        nix::fcntl::renameat(
            dir,
            self.temp.as_os_str(),
            dir,
            self.target.name.as_os_str(),
        )
        .map_err(io::Error::from)?;
        self.persisted = true;
        nix::unistd::fsync(self.target.dir.as_fd()).map_err(io::Error::from)?;
        Ok(self.target.path.clone())
    }

    /// The directory and temporary name, to remove it from elsewhere (shutdown).
    pub fn leftover(&self) -> io::Result<(OwnedFd, OsString)> {
        Ok((self.target.dir.try_clone()?, self.temp.clone()))
    }
}

/// Removes `name` from `dir`, ignoring a missing one.
pub fn remove_leftover(dir: &OwnedFd, name: &OsStr) {
    let _ = nix::unistd::unlinkat(dir, name, nix::unistd::UnlinkatFlags::NoRemoveDir);
}

impl Drop for TempOutput {
    fn drop(&mut self) {
        if !self.persisted {
            self.file.take();
            remove_leftover(&self.target.dir, &self.temp);
        }
    }
}
