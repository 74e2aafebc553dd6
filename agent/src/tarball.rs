//! Rewriting a Velero backup tarball at finalize, as Velero's `buildFinalTarball` does:
//! an entry named exactly an updated item's plain or `<version>-preferredversion` path
//! gets the item's new content under the header Velero's Go `tar.Writer` writes; paths
//! the tarball lacks are appended; every other entry is copied byte for byte, header
//! extensions and padding included.
//!
//! The archive is streamed (gzip → tar → tar → gzp), never held. The tar crate reads it
//! in raw mode and each entry is named and sized as Velero's reader, Go's
//! `archive/tar`, reads it (a GNU long name over a PAX `path` over the header's name),
//! so Velero reads the output as the agent wrote it; a form the crate would read
//! otherwise than Go is refused, never misread. Refused too, to protect the agent and
//! Velero's restore: absolute paths, `..`, links, devices, FIFOs, a truncated archive,
//! a header extension past 1 MiB (or a run of them past 2 MiB, headers included), and a
//! decompressed size past the limit. Other extractors (GNU tar) may name an entry otherwise than Go where the
//! backup server's input was ambiguous; the agent checks the names Go reads.
//! Nothing after the first end-of-archive block is copied.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};

use flate2::read::MultiGzDecoder;
use flate2::Compression;
use gzp::deflate::Gzip;
use gzp::par::compress::{ParCompress, ParCompressBuilder};
use gzp::ZWriter;
use opmon_client::UpdatedItem;
use tar::{Archive, EntryType, Header, PaxExtensions};

/// Largest GNU long-name or PAX header accepted, in bytes (Go's reader has the same
/// limit for its "special files").
const MAX_EXTENSION: u64 = 1024 * 1024;
/// Bytes of extensions (headers, data, padding) held before one entry: room for a full
/// long name and a full PAX header, which the entry's copy needs verbatim.
const MAX_EXTENSIONS_HELD: u64 = 2 * MAX_EXTENSION + 4 * BLOCK as u64;
const BLOCK: usize = 512;
/// The gzip level of the output: `gzip -6`, Go's default, what Velero writes.
const LEVEL: u32 = 6;

/// The new content of each updated item, by the entry names Velero writes it under.
pub struct Updates {
    /// Entry name → index into `contents`, for the plain and the preferred-version path
    /// of every item, in the order they are appended when absent.
    paths: BTreeMap<String, usize>,
    contents: Vec<Vec<u8>>,
}

/// The group-resource directory of an item: `<resource>.<group>`, or `<resource>` for
/// the core group.
fn group_resource(r: &opmon_client::ResourceIdentifier) -> String {
    if r.group.is_empty() {
        r.resource.clone()
    } else {
        format!("{}.{}", r.resource, r.group)
    }
}

/// The entry name of an item under `version_dir` (or the plain path without one), as
/// Velero's `GetVersionedItemFilePath` builds it.
fn item_path(r: &opmon_client::ResourceIdentifier, version_dir: Option<&str>) -> String {
    let mut path = format!("resources/{}/", group_resource(r));
    if let Some(dir) = version_dir {
        path.push_str(dir);
        path.push('/');
    }
    if r.namespace.is_empty() {
        path.push_str("cluster/");
    } else {
        path.push_str("namespaces/");
        path.push_str(&r.namespace);
        path.push('/');
    }
    path.push_str(&r.name);
    path.push_str(".json");
    path
}

impl Updates {
    /// Checks and encodes the updated items; errors name the item's index and field.
    /// Each item is written at its plain path and under `<version>-preferredversion`,
    /// `<version>` taken from its `apiVersion` (`autoscaling/v2` → `v2`): the agent is
    /// handed the object in the version the backup server backs it up in, its preferred
    /// one, as Velero's finalize does.
    pub fn new(items: &[UpdatedItem]) -> Result<Updates, String> {
        let mut paths = BTreeMap::new();
        let mut contents = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            opmon_client::validate::resource(&item.resource)
                .map_err(|(field, e)| format!("updatedItems[{i}].resource.{field}: {e}"))?;
            let Some(object) = item.object.as_object() else {
                return Err(format!("updatedItems[{i}].object: must be a JSON object"));
            };
            let version = object
                .get("apiVersion")
                .and_then(|v| v.as_str())
                .and_then(|v| v.rsplit('/').next())
                .filter(|v| !v.is_empty())
                .ok_or_else(|| {
                    format!("updatedItems[{i}].object.apiVersion: must be set, e.g. \"v1\"")
                })?;
            // The version names a directory of the tarball (`v1-preferredversion`).
            opmon_client::validate::dns_label(version).map_err(|e| {
                format!("updatedItems[{i}].object.apiVersion: its version {version:?} {e}")
            })?;
            // As Velero writes items: Go's json.Marshal, HTML-safe.
            let content = crate::gojson::marshal(&item.object)
                .map_err(|e| format!("updatedItems[{i}].object: {e}"))?;
            let index = contents.len();
            contents.push(content);
            let preferred = format!("{version}-preferredversion");
            let plain = item_path(&item.resource, None);
            if paths.contains_key(&plain) {
                return Err(format!(
                    "updatedItems[{i}].resource: the same item is listed twice"
                ));
            }
            paths.insert(plain, index);
            paths.insert(item_path(&item.resource, Some(&preferred)), index);
        }
        Ok(Updates { paths, contents })
    }

    pub fn is_empty(&self) -> bool {
        self.paths.is_empty()
    }
}

/// What a rewrite did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Entries whose content was replaced.
    pub replaced: u64,
    /// Entries appended for paths of updated items the tarball lacked.
    pub added: u64,
}

/// Why a rewrite failed; the message names the entry when there is one.
#[derive(Debug, thiserror::Error)]
pub enum RewriteError {
    #[error("entry {entry}: {reason}")]
    Entry { entry: String, reason: String },
    #[error("{0}")]
    Archive(String),
    /// The caller's stop flag was raised (deadline, shutdown).
    #[error("the rewrite was stopped")]
    Stopped,
}

/// Counts decompressed bytes and fails past the limit: a gzip bomb stops here, not on
/// the disk.
struct Bounded<R> {
    inner: R,
    left: u64,
    limit: u64,
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n as u64 > self.left {
            return Err(io::Error::other(format!(
                "the decompressed archive exceeds the limit of {} bytes (max_decompressed_size)",
                self.limit
            )));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// The decompressed tar stream as the tar crate reads it. While `keeping` is set it
/// keeps a copy of what is read, so the padding the crate skips is copied as it was.
/// `ended` (the stream ran out) and `failed` (gzip, size limit) tell a truncated or
/// broken stream from a header the crate cannot read.
#[derive(Default)]
struct Tap {
    kept: RefCell<Vec<u8>>,
    keeping: Cell<bool>,
    ended: Cell<bool>,
    failed: Cell<bool>,
    /// Bytes read so far.
    offset: Cell<u64>,
}

struct Tapped<R> {
    inner: R,
    tap: Rc<Tap>,
}

impl<R: Read> Read for Tapped<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let tap = &self.tap;
        let n = self.inner.read(buf).inspect_err(|_| tap.failed.set(true))?;
        if n == 0 && !buf.is_empty() {
            tap.ended.set(true);
        }
        tap.offset.set(tap.offset.get() + n as u64);
        if tap.keeping.get() {
            tap.kept.borrow_mut().extend_from_slice(&buf[..n]);
        }
        Ok(n)
    }
}

fn reject(entry: &[u8], reason: impl Into<String>) -> RewriteError {
    RewriteError::Entry {
        entry: String::from_utf8_lossy(entry).into_owned(),
        reason: reason.into(),
    }
}

/// The bytes of a NUL-terminated header field, up to its first NUL (how every reader
/// takes them).
fn nts(field: &[u8]) -> &[u8] {
    match field.iter().position(|b| *b == 0) {
        Some(end) => &field[..end],
        None => field,
    }
}

fn show(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Refuses a size field the tar crate reads otherwise than Go: octal text
/// other than digits between leading spaces and trailing NULs or spaces (the crate
/// also takes `+`, tabs, or digits cut off by a NUL), or base-256 beyond the eight
/// bytes the crate reads (or negative).
fn check_size_field(field: &[u8; 12]) -> Result<(), String> {
    if field[0] & 0x80 != 0 {
        return match field[..4] {
            [0x80, 0, 0, 0] => Ok(()),
            _ => Err("a base-256 number readers take differently".into()),
        };
    }
    let mut rest = field
        .iter()
        .skip_while(|b| **b == b' ')
        .skip_while(|b| matches!(b, b'0'..=b'7'));
    if rest.all(|b| matches!(b, 0 | b' ')) {
        Ok(())
    } else {
        Err(format!("{:?} is not an octal number", show(field)))
    }
}

/// Refuses a header whose other numeric fields Go's reader (Velero's) cannot parse:
/// octal digits between spaces and NULs, or base-256 (not for the checksum, which the
/// tar crate also takes with a `+` or tabs). Go also parses a star header's times, and
/// takes a GNU header's times that are not numbers for a ustar prefix of the name.
fn check_numbers(h: &Header) -> Result<(), String> {
    let b = h.as_bytes();
    let mut fields = vec![
        ("checksum", &b[148..156]),
        ("mode", &b[100..108]),
        ("uid", &b[108..116]),
        ("gid", &b[116..124]),
        ("mtime", &b[136..148]),
        ("devmajor", &b[329..337]),
        ("devminor", &b[337..345]),
    ];
    match &b[257..265] {
        b"ustar  \0" => fields.extend(
            [("atime", &b[345..357]), ("ctime", &b[357..369])]
                .into_iter()
                .filter(|(_, field)| field[0] != 0),
        ),
        [b'u', b's', b't', b'a', b'r', 0, ..] if &b[508..] == b"tar\0" => {
            fields.extend([("atime", &b[476..488]), ("ctime", &b[488..500])])
        }
        _ => {}
    }
    for (what, field) in fields {
        if matches!(field[0], 0x80 | 0xff) && !matches!(what, "checksum" | "atime" | "ctime") {
            continue;
        }
        let ends = |c: &u8| matches!(c, 0 | b' ');
        let start = field.iter().position(|c| !ends(c)).unwrap_or(field.len());
        let end = field
            .iter()
            .rposition(|c| !ends(c))
            .map_or(start, |i| i + 1);
        if !field[start..end].iter().all(|c| matches!(c, b'0'..=b'7')) {
            return Err(format!("{what}: {:?} is not an octal number", show(field)));
        }
    }
    Ok(())
}

/// What a PAX extended header says about the entry after it.
#[derive(Default)]
struct Pax {
    path: Option<Vec<u8>>,
    size: Option<u64>,
}

/// Reads PAX records with the tar crate, refusing what Go reads otherwise: text that is
/// not whole records, one a line, each starting with its length (the crate splits at
/// newlines and stops at an empty line; Go goes by the lengths and refuses the rest);
/// what Go refuses (an empty key, a NUL in a key or a path). A repeated key counts
/// once, the last, as in Go; an empty value leaves the header's own.
fn parse_pax(data: &[u8]) -> Result<Pax, String> {
    let whole_lines = data.is_empty()
        || data.strip_suffix(b"\n").is_some_and(|lines| {
            (lines.split(|b| *b == b'\n')).all(|l| l.first().is_some_and(u8::is_ascii_digit))
        });
    if !whole_lines {
        return Err(
            "a newline inside a PAX record, or text that is no record (readers split them \
             differently)"
                .into(),
        );
    }
    let mut pax = Pax::default();
    for record in PaxExtensions::new(data) {
        let record = record.map_err(|_| {
            "a PAX record whose length does not match its text (or with a newline in it)"
                .to_string()
        })?;
        let (key, value) = (record.key_bytes(), record.value_bytes());
        if key.is_empty() || key.contains(&0) {
            return Err("a PAX record with an invalid key".into());
        }
        let key = show(key);
        if key.starts_with("GNU.") {
            return Err(format!(
                "PAX record {key} is not allowed (Go renames and resizes GNU sparse \
                 entries by it)"
            ));
        }
        match key.as_str() {
            // Go keeps the header's own value for an empty one (`mergePAX`).
            "path" | "size" if value.is_empty() => {
                pax.path = pax.path.filter(|_| key != "path");
                pax.size = pax.size.filter(|_| key != "size");
            }
            "path" => {
                if value.contains(&0) {
                    return Err("a NUL byte in the PAX path".into());
                }
                pax.path = Some(value.to_vec());
            }
            "size" => {
                let size = std::str::from_utf8(value)
                    .ok()
                    .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()))
                    .and_then(|t| t.parse::<u64>().ok())
                    .ok_or_else(|| format!("an unreadable PAX size {:?}", show(value)))?;
                pax.size = Some(size);
            }
            _ => {}
        }
    }
    Ok(pax)
}

/// Extension headers read since the last entry, waiting for the entry they describe.
#[derive(Default)]
struct Pending {
    /// Verbatim bytes (headers, data, padding) of every extension since the last
    /// entry, in order: copied with an entry that is copied.
    all: Vec<u8>,
    /// Those of global PAX headers alone: written before an entry that is replaced
    /// (the local ones described the old entry and go with it).
    global: Vec<u8>,
    /// Bytes held in `all` (headers, data and padding), to bound them together.
    held: u64,
    long_name: Option<Vec<u8>>,
    pax: Option<Pax>,
    /// Why the PAX header is refused, told when its entry comes.
    pax_error: Option<String>,
}

/// The name Go's reader takes from a header: the name field, after the ustar prefix
/// when the magic says ustar (131 bytes of it in star archives). (Go also takes a GNU
/// header's times for a prefix when they are not numbers: [`check_numbers`] refuses
/// those.)
fn go_name(h: &Header) -> Vec<u8> {
    let (b, name) = (h.as_bytes(), nts(&h.as_old().name));
    let prefix = match &b[257..263] {
        b"ustar\0" if &b[508..] == b"tar\0" => nts(&b[345..476]),
        b"ustar\0" => nts(&b[345..500]),
        _ => b"",
    };
    if prefix.is_empty() {
        return name.to_vec();
    }
    [prefix, b"/", name].concat()
}

/// Refuses a name an extractor could be tricked by: absolute, or with `..`.
fn check_name(name: &[u8]) -> Result<(), RewriteError> {
    if name.starts_with(b"/") {
        Err(reject(name, "absolute paths are not allowed"))
    } else if name.split(|b| *b == b'/').any(|part| part == b"..") {
        Err(reject(name, "paths with '..' are not allowed"))
    } else {
        Ok(())
    }
}

/// Refuses entry types other than files and directories.
fn check_type(entry: &[u8], kind: u8) -> Result<(), RewriteError> {
    let refused = match kind {
        b'0' | 0 | b'7' | b'5' => return Ok(()),
        b'2' => "symbolic links are not allowed",
        b'1' => "hard links are not allowed",
        b'3' => "character devices are not allowed",
        b'4' => "block devices are not allowed",
        b'6' => "FIFOs are not allowed",
        _ => "this entry type is not allowed",
    };
    Err(reject(entry, refused))
}

/// Describes a read failure at `entry` (or between entries); `ended` says the input
/// ran out.
fn read_error(entry: Option<&[u8]>, e: io::Error, ended: bool) -> RewriteError {
    let reason = if ended || e.kind() == io::ErrorKind::UnexpectedEof {
        format!("the archive is truncated ({e})")
    } else {
        e.to_string()
    };
    match entry {
        Some(entry) => reject(entry, reason),
        None => RewriteError::Archive(reason),
    }
}

/// Reads `left` bytes of entry `name`'s data from `data` (through `buf`), handing each
/// piece to `sink`; stops early once the job is stopped.
fn pass(
    data: &mut impl Read,
    mut left: u64,
    buf: &mut [u8],
    stop: &AtomicBool,
    name: &[u8],
    ended: &Cell<bool>,
    mut sink: impl FnMut(&[u8]) -> Result<(), RewriteError>,
) -> Result<(), RewriteError> {
    while left > 0 {
        if stop.load(Ordering::Relaxed) {
            return Err(RewriteError::Stopped);
        }
        let n = left.min(buf.len() as u64) as usize;
        let piece = &mut buf[..n];
        let n = match data.read(piece) {
            Ok(0) => {
                let e = io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("{left} bytes of its data are missing"),
                );
                return Err(read_error(Some(name), e, true));
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(read_error(Some(name), e, ended.get())),
        };
        sink(&piece[..n])?;
        left -= n as u64;
    }
    Ok(())
}

/// Go's checksum field (six octal digits, a NUL, a space; the tar crate writes seven
/// digits and a NUL) set in `h`, whose bytes are returned.
fn go_checksum(mut h: Header) -> [u8; BLOCK] {
    h.as_old_mut().cksum = [b' '; 8];
    let sum: u32 = h.as_bytes().iter().map(|b| u32::from(*b)).sum();
    h.as_old_mut()
        .cksum
        .copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    *h.as_bytes()
}

/// The header Velero's finalize writes for an item: what Go's `tar.Writer` makes of
/// `tar.Header{Name, Size, Typeflag: TypeReg, Mode: 0755, ModTime: time.Now()}` (with
/// the mtime rounded to the second, as Go does for a header of unset format): USTAR
/// when the name fits the name field or splits into prefix and name, else a PAX header
/// with a `path` record before a USTAR one. Byte for byte, checksum format included.
pub fn velero_header(name: &str, size: u64, mtime: u64) -> io::Result<Vec<u8>> {
    let regular = || -> io::Result<Header> {
        let mut h = Header::new_ustar();
        h.set_entry_type(EntryType::Regular);
        h.set_mode(0o755);
        h.set_uid(0);
        h.set_gid(0);
        h.set_size(size);
        h.set_mtime(mtime);
        h.set_device_major(0)?;
        h.set_device_minor(0)?;
        Ok(h)
    };
    // The crate splits a long path between the prefix and name fields where Go's
    // `splitUSTARPath` does for paths of plain components (an item's path has no `.`,
    // `..` or empty one); Go writes a non-ASCII name in PAX only.
    let mut h = regular()?;
    if name.is_ascii() && h.set_path(name).is_ok() {
        return Ok(go_checksum(h).to_vec());
    }
    // Go's PAX form: the `path` record (formatted by the crate as Go formats it) under
    // an extension header named `<dir>/PaxHeaders.0/<file>`, mode, owner and mtime 0
    // and no device numbers; then the header with the name cut to its field, in ASCII.
    let mut records = tar::Builder::new(Vec::new());
    records.append_pax_extensions([("path", name.as_bytes())])?;
    let mut out = records.into_inner()?;
    out.truncate(out.len() - 2 * BLOCK);
    let (dir, file) = name.rsplit_once('/').unwrap_or(("", name));
    let mut extension_name: Vec<u8> = format!("{dir}/PaxHeaders.0/{file}")
        .trim_start_matches('/')
        .bytes()
        .filter(u8::is_ascii)
        .take(100)
        .collect();
    while extension_name.last() == Some(&b'/') {
        extension_name.pop();
    }
    let mut x = Header::from_byte_slice(&out[..BLOCK]).clone();
    x.as_old_mut().name[..extension_name.len()].copy_from_slice(&extension_name);
    x.set_mode(0);
    x.set_uid(0);
    x.set_gid(0);
    out[..BLOCK].copy_from_slice(&go_checksum(x));
    let mut h = regular()?;
    let ascii: Vec<u8> = name.bytes().filter(u8::is_ascii).collect();
    let field = &mut h.as_old_mut().name;
    let n = ascii.len().min(field.len());
    field[..n].copy_from_slice(&ascii[..n]);
    // Go ends a cut name before the slashes it would end with.
    if ascii.len() > field.len() && field[n - 1] == b'/' {
        let kept = field[..n - 1]
            .iter()
            .rposition(|b| *b != b'/')
            .map_or(0, |i| i + 1);
        field[kept] = 0;
    }
    out.extend_from_slice(&go_checksum(h));
    Ok(out)
}

/// Threads compressing the output at once: both cores of a small node, at most four.
fn compress_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 4)
}

/// Rewrites the gzipped tarball `input` into `output` (one gzip member, level 6,
/// compressed on several threads). `output` gets nothing useful on error; the caller
/// discards it.
pub fn rewrite<R: Read, W: Write + Send>(
    input: R,
    output: W,
    updates: &Updates,
    max_decompressed: u64,
) -> Result<Outcome, RewriteError> {
    rewrite_until(
        input,
        output,
        updates,
        max_decompressed,
        &AtomicBool::new(false),
    )
}

/// [`rewrite`], giving up with [`RewriteError::Stopped`] soon after `stop` is raised.
pub fn rewrite_until<R: Read, W: Write + Send>(
    input: R,
    output: W,
    updates: &Updates,
    max_decompressed: u64,
    stop: &AtomicBool,
) -> Result<Outcome, RewriteError> {
    let result = std::thread::scope(|scope| {
        // gzp writes one gzip member of 128 KiB blocks compressed apart, as `pigz -i`
        // does (its priming with the previous block needs C zlib); Go's reader and gzip
        // read it as any other.
        let mut gz: ParCompress<Gzip, W> = ParCompressBuilder::new()
            .compression_level(Compression::new(LEVEL))
            .num_threads(compress_threads())
            .map_err(|e| RewriteError::Archive(format!("starting the compressor: {e}")))?
            .from_borrowed_writer(output, scope);
        let copied = copy(input, &mut gz, updates, max_decompressed, stop);
        // Finished on failure too, its result ignored: a compressor dropped unfinished
        // finishes itself and panics on a write error.
        let finished = gz.finish();
        let outcome = copied?;
        finished.map_err(|e| RewriteError::Archive(format!("writing the output: {e}")))?;
        Ok(outcome)
    });
    match result {
        // What failed once the job was stopped failed because of it.
        Err(_) if stop.load(Ordering::Relaxed) => Err(RewriteError::Stopped),
        result => result,
    }
}

/// Where the padding after a record's data goes, once the crate has read it.
#[derive(Clone, Copy)]
enum Padding {
    Out,
    Pending { global: bool },
    Dropped,
}

/// The tar-to-tar copy under [`rewrite_until`].
fn copy<R: Read>(
    input: R,
    out: &mut impl Write,
    updates: &Updates,
    max_decompressed: u64,
    stop: &AtomicBool,
) -> Result<Outcome, RewriteError> {
    let source = Bounded {
        inner: MultiGzDecoder::new(io::BufReader::with_capacity(256 * 1024, input)),
        left: max_decompressed,
        limit: max_decompressed,
    };
    let tap = Rc::new(Tap::default());
    let mut archive = Archive::new(Tapped {
        inner: io::BufReader::with_capacity(256 * 1024, source),
        tap: tap.clone(),
    });
    let write_error = |e: io::Error| RewriteError::Archive(format!("writing the output: {e}"));
    let mut outcome = Outcome::default();
    let mut present = vec![false; updates.paths.len()];
    let path_index: BTreeMap<&str, usize> = updates
        .paths
        .keys()
        .enumerate()
        .map(|(i, p)| (p.as_str(), i))
        .collect();
    let mut pending = Pending::default();
    let mut last: Option<Vec<u8>> = None;
    let mut buf = vec![0u8; 64 * 1024];
    // The padding still to come after the last record's data, and where it goes.
    let mut padding = (0usize, Padding::Dropped);
    let mut entries = archive
        .entries()
        .map_err(|e| RewriteError::Archive(e.to_string()))?
        .raw(true);
    loop {
        if stop.load(Ordering::Relaxed) {
            return Err(RewriteError::Stopped);
        }
        let at = tap.offset.get() + padding.0 as u64;
        tap.keeping.set(true);
        let next = entries.next();
        tap.keeping.set(false);
        // What the crate read: the last record's padding, then a header.
        let read = std::mem::take(&mut *tap.kept.borrow_mut());
        let tail = &read[..padding.0.min(read.len())];
        match padding.1 {
            Padding::Out => out.write_all(tail).map_err(write_error)?,
            Padding::Pending { global } => {
                pending.all.extend_from_slice(tail);
                if global {
                    pending.global.extend_from_slice(tail);
                }
            }
            Padding::Dropped => {}
        }
        let Some(entry) = next else {
            // The end of the archive (GNU tar and Python stop at the first zero block,
            // Go wants a second; anything after it is not copied), or of the input.
            break;
        };
        let mut entry = entry.map_err(|e| {
            if tap.ended.get() || tap.failed.get() {
                let after = last.as_ref().map(|p| [b"after ".as_slice(), p].concat());
                read_error(after.as_deref(), e, tap.ended.get())
            } else {
                RewriteError::Archive(format!(
                    "the header at byte {at} is not valid: {e} (not a tar archive, or corrupt)"
                ))
            }
        })?;
        let header = entry.header().clone();
        // The typeflag byte itself: the crate reads NUL as `0`.
        let kind = header.as_bytes()[156];
        let raw_name = nts(&header.as_old().name).to_vec();
        let go_name = go_name(&header);
        let size = check_size_field(&header.as_old().size)
            .map(|()| entry.size())
            .map_err(|e| reject(&raw_name, format!("size: {e}")));
        check_numbers(&header).map_err(|e| reject(&raw_name, e))?;
        padding.0 = (BLOCK - (entry.size() % BLOCK as u64) as usize) % BLOCK;

        if matches!(kind, b'L' | b'K' | b'x' | b'g') {
            if header.as_ustar().is_none() && header.as_gnu().is_none() {
                // Go takes it as an extension whatever the magic, the tar crate and
                // pre-POSIX readers as an entry of an unknown type.
                let pax_path = pending.pax.as_ref().and_then(|p| p.path.as_deref());
                return Err(reject(
                    (pending.long_name.as_deref())
                        .or(pax_path)
                        .unwrap_or(&go_name),
                    format!(
                        "a header extension ({}) in a header without the ustar or GNU magic \
                         (readers disagree on whether it is one)",
                        kind as char
                    ),
                ));
            }
            let size = size?;
            if size > MAX_EXTENSION {
                return Err(RewriteError::Archive(format!(
                    "a header extension ({}) of {size} bytes is larger than the {MAX_EXTENSION} allowed",
                    kind as char
                )));
            }
            // Bound them together too, headers and padding included: a run of
            // extensions before one entry (empty ones too) is held until that entry comes.
            let held = BLOCK as u64 + size.div_ceil(BLOCK as u64) * BLOCK as u64;
            if pending.held + held > MAX_EXTENSIONS_HELD {
                return Err(RewriteError::Archive(format!(
                    "the header extensions before one entry exceed the {MAX_EXTENSIONS_HELD} bytes allowed"
                )));
            }
            if kind == b'g' && pending.all.len() > pending.global.len() {
                return Err(reject(
                    &raw_name,
                    "a global PAX header between an entry's header extensions and the entry \
                     (Go drops those extensions there)",
                ));
            }
            pending.held += held;
            let mut data = Vec::with_capacity(size as usize);
            let name = b"(header extension)";
            pass(
                &mut entry,
                size,
                &mut buf,
                stop,
                name,
                &tap.ended,
                |piece| {
                    data.extend_from_slice(piece);
                    Ok(())
                },
            )?;
            pending.all.extend_from_slice(header.as_bytes());
            pending.all.extend_from_slice(&data);
            if kind == b'g' {
                pending.global.extend_from_slice(header.as_bytes());
                pending.global.extend_from_slice(&data);
            }
            padding.1 = Padding::Pending {
                global: kind == b'g',
            };
            match kind {
                b'L' => pending.long_name = Some(nts(&data).to_vec()),
                b'K' => {}
                // A refusal waits for the entry, so it can name it.
                b'x' => match parse_pax(&data) {
                    Ok(pax) => pending.pax = Some(pax),
                    Err(e) => pending.pax_error = Some(e),
                },
                // Go returns a global header as an entry, named by its `path`, which
                // Velero's restore checks as it checks every name.
                _ => {
                    let pax = parse_pax(&data).map_err(|e| reject(&raw_name, e))?;
                    check_name(pax.path.as_deref().unwrap_or(&go_name))?;
                }
            }
            continue;
        }

        // An entry, named as Go names it: a GNU long name over a PAX path over the
        // header's name.
        let taken = std::mem::take(&mut pending);
        if let Some(e) = &taken.pax_error {
            let name = taken.long_name.as_deref().unwrap_or(&go_name);
            return Err(reject(name, format!("its PAX header: {e}")));
        }
        let pax = taken.pax.unwrap_or_default();
        let name: Vec<u8> = taken
            .long_name
            .clone()
            .or_else(|| pax.path.clone())
            .unwrap_or(go_name);
        if name.is_empty() {
            return Err(RewriteError::Archive(format!(
                "the entry at byte {} has no name",
                entry.raw_header_position()
            )));
        }
        check_name(&name)?;
        check_type(&name, kind)?;
        let size = size?;
        if let Some(pax_size) = pax.size.filter(|s| *s != size) {
            return Err(reject(
                &name,
                format!("its PAX size {pax_size} differs from its header's size {size}"),
            ));
        }
        // Go reads an old-style regular entry (type NUL) whose name ends in '/' as a
        // directory; a directory with data is refused (readers disagree on where the
        // next header starts).
        let directory = kind == b'5' || (kind == 0 && name.ends_with(b"/"));
        if directory && size > 0 {
            return Err(reject(
                &name,
                format!(
                    "a directory with {size} bytes of data (Go reads none, and the next \
                     header where the data starts)"
                ),
            ));
        }

        let replacement = std::str::from_utf8(&name)
            .ok()
            .filter(|_| !directory)
            .and_then(|n| path_index.get(n).map(|i| (n, *i)));
        match replacement {
            Some((path, i)) => {
                let content = &updates.contents[updates.paths[path]];
                let now = time::OffsetDateTime::now_utc().unix_timestamp().max(0) as u64;
                out.write_all(&taken.global).map_err(write_error)?;
                write_item(out, path, content, now).map_err(write_error)?;
                present[i] = true;
                outcome.replaced += 1;
                // The old content is read (not copied) so a truncated archive is
                // still noticed.
                pass(&mut entry, size, &mut buf, stop, &name, &tap.ended, |_| {
                    Ok(())
                })?;
                padding.1 = Padding::Dropped;
            }
            None => {
                out.write_all(&taken.all).map_err(write_error)?;
                out.write_all(header.as_bytes()).map_err(write_error)?;
                pass(
                    &mut entry,
                    size,
                    &mut buf,
                    stop,
                    &name,
                    &tap.ended,
                    |data| out.write_all(data).map_err(write_error),
                )?;
                padding.1 = Padding::Out;
            }
        }
        last = Some(name);
    }
    // Extensions with no entry after them are refused: readers differ on them.
    if !pending.all.is_empty() {
        return Err(RewriteError::Archive(
            "the archive ends with a header extension and no entry after it".into(),
        ));
    }
    // What follows the end of the archive is read, copying nothing, so the gzip
    // trailer's CRC is checked: a corrupt input must not come out with a fresh one.
    let mut rest = archive.into_inner();
    loop {
        if stop.load(Ordering::Relaxed) {
            return Err(RewriteError::Stopped);
        }
        match rest.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                let reason = match e.kind() {
                    io::ErrorKind::UnexpectedEof => format!(
                        "the gzip stream ends early: it is truncated, or followed by bytes \
                         that are not gzip ({e})"
                    ),
                    _ => e.to_string(),
                };
                return Err(RewriteError::Archive(format!(
                    "after the end of the archive: {reason}"
                )));
            }
        }
    }
    let now = time::OffsetDateTime::now_utc().unix_timestamp().max(0) as u64;
    for (i, (path, index)) in updates.paths.iter().enumerate() {
        if !present[i] {
            write_item(out, path, &updates.contents[*index], now).map_err(write_error)?;
            outcome.added += 1;
        }
    }
    out.write_all(&[0u8; 2 * BLOCK]).map_err(write_error)?;
    Ok(outcome)
}

/// An item as Velero writes it: its header, its content, zeros to the block's end.
fn write_item(out: &mut impl Write, path: &str, content: &[u8], now: u64) -> io::Result<()> {
    out.write_all(&velero_header(path, content.len() as u64, now)?)?;
    out.write_all(content)?;
    out.write_all(&[0u8; BLOCK][..(BLOCK - content.len() % BLOCK) % BLOCK])
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::read::GzDecoder;
    use flate2::write::GzEncoder;
    use flate2::Compression;
    use opmon_client::ResourceIdentifier;
    use serde_json::json;
    use tar::{EntryType, Header};

    #[test]
    fn an_empty_pax_path_or_size_leaves_the_headers_own_as_in_go() {
        let pax = parse_pax(b"12 path=a/b\n8 path=\n").unwrap();
        assert_eq!(pax.path, None);
        let pax = parse_pax(b"8 size=\n").unwrap();
        assert_eq!(pax.size, None);
        let pax = parse_pax(b"8 path=\n12 path=a/b\n").unwrap();
        assert_eq!(pax.path.as_deref(), Some(&b"a/b"[..]));
    }

    fn gz(tar: &[u8]) -> Vec<u8> {
        let mut e = GzEncoder::new(Vec::new(), Compression::fast());
        e.write_all(tar).unwrap();
        e.finish().unwrap()
    }

    fn gunzip(data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        GzDecoder::new(data).read_to_end(&mut out).unwrap();
        out
    }

    /// A tar with regular files `(path, content)`, built by the tar crate (GNU format).
    fn tar_of(files: &[(&str, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, content) in files {
            let mut h = Header::new_gnu();
            h.set_mode(0o644);
            h.set_mtime(1_700_000_000);
            h.set_size(content.len() as u64);
            b.append_data(&mut h, path, *content).unwrap();
        }
        b.into_inner().unwrap()
    }

    /// One raw record: a header whose name and type are set by hand, as an attacker
    /// writes it (the tar crate refuses such names through its normal API), and data.
    fn raw(name: &[u8], kind: u8, link: &str, data: &[u8]) -> Vec<u8> {
        let mut h = Header::new_ustar();
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        h.set_entry_type(EntryType::new(kind));
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        h.set_cksum();
        let mut v = h.as_bytes().to_vec();
        v.extend_from_slice(data);
        v.resize(v.len().div_ceil(BLOCK) * BLOCK, 0);
        v
    }

    /// The same with the header's size field saying `size` whatever the data.
    fn raw_sized(name: &[u8], kind: u8, data: &[u8], size: u64) -> Vec<u8> {
        let mut v = raw(name, kind, "", data);
        let mut h = Header::from_byte_slice(&v[..BLOCK]).clone();
        h.set_size(size);
        h.set_cksum();
        v[..BLOCK].copy_from_slice(h.as_bytes());
        v
    }

    /// One PAX record, as the tar crate formats it.
    fn pax_record(key: &str, value: &[u8]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        b.append_pax_extensions([(key, value)]).unwrap();
        let v = b.into_inner().unwrap();
        let size = Header::from_byte_slice(&v[..BLOCK]).size().unwrap() as usize;
        v[BLOCK..BLOCK + size].to_vec()
    }

    fn pax(records: &[(&str, &str)]) -> Vec<u8> {
        let data: Vec<u8> = records
            .iter()
            .flat_map(|(k, v)| pax_record(k, v.as_bytes()))
            .collect();
        raw(b"PaxHeaders.0/x", b'x', "", &data)
    }

    fn finish(mut tar: Vec<u8>) -> Vec<u8> {
        tar.extend_from_slice(&[0u8; 1024]);
        tar
    }

    /// `(path, content)` of every entry, read back by the tar crate.
    fn entries(tar_gz: &[u8]) -> Vec<(String, Vec<u8>)> {
        let mut archive = tar::Archive::new(GzDecoder::new(tar_gz));
        archive
            .entries()
            .unwrap()
            .map(|e| {
                let mut e = e.unwrap();
                let path = e.path().unwrap().to_string_lossy().into_owned();
                let mut data = Vec::new();
                e.read_to_end(&mut data).unwrap();
                (path, data)
            })
            .collect()
    }

    fn item(
        group: &str,
        resource: &str,
        ns: &str,
        name: &str,
        object: serde_json::Value,
    ) -> UpdatedItem {
        UpdatedItem {
            resource: ResourceIdentifier {
                group: group.into(),
                resource: resource.into(),
                namespace: ns.into(),
                name: name.into(),
            },
            object,
        }
    }

    fn pvc_update(name: &str, object: serde_json::Value) -> UpdatedItem {
        item("", "persistentvolumeclaims", "ns", name, object)
    }

    fn run(
        input: &[u8],
        updates: &[UpdatedItem],
        limit: u64,
    ) -> Result<(Outcome, Vec<u8>), RewriteError> {
        let updates = Updates::new(updates).unwrap();
        let mut out = Vec::new();
        rewrite(input, &mut out, &updates, limit).map(|o| (o, out))
    }

    fn refusal(tar: Vec<u8>) -> String {
        run(&gz(&finish(tar)), &[], u64::MAX)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn a_gzip_trailer_that_does_not_match_the_data_is_refused() {
        let tar = finish(tar_of(&[("resources/a.json", b"{}"), ("b", b"x")]));
        let good = gz(&tar);
        assert!(run(&good, &[], u64::MAX).is_ok());
        // The trailer: CRC-32 of the data, then its length mod 2^32.
        let n = good.len();
        let mut crc = good.clone();
        crc[n - 8] ^= 0xff;
        let mut size = good.clone();
        size[n - 1] ^= 0x01;
        let cut = good[..n - 8].to_vec();
        let mut garbage = good.clone();
        garbage.extend_from_slice(b"not gzip");
        for (what, input) in [
            ("crc", crc),
            ("size", size),
            ("cut", cut),
            ("garbage", garbage),
        ] {
            let e = run(&input, &[], u64::MAX)
                .map(|_| ())
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with("after the end of the archive: "),
                "{what}: {e}"
            );
            if what == "garbage" {
                // Too short for a gzip header: said as what it may be, not as a cut.
                assert!(e.contains("followed by bytes that are not gzip"), "{e}");
            }
        }
        // Two members (as pigz or `cat a.gz b.gz` make) are one stream: both checked.
        let (head, tail) = tar.split_at(BLOCK);
        let mut two = gz(head);
        two.extend_from_slice(&gz(tail));
        assert!(run(&two, &[], u64::MAX).is_ok());
        let last = two.len() - 8;
        two[last] ^= 0xff;
        assert!(run(&two, &[], u64::MAX).is_err());
    }

    #[test]
    fn only_the_plain_and_preferred_version_paths_are_replaced_as_velero_does() {
        let hpa = "horizontalpodautoscalers.autoscaling";
        let mut tar = tar_of(&[
            ("metadata/version", b"1"),
            (
                &format!("resources/{hpa}/namespaces/app/hpa.json"),
                b"{\"old\":0}",
            ),
            (
                &format!("resources/{hpa}/v1/namespaces/app/hpa.json"),
                b"{\"old\":1}",
            ),
            (
                &format!("resources/{hpa}/v2-preferredversion/namespaces/app/hpa.json"),
                b"{\"old\":2}",
            ),
        ]);
        tar.truncate(tar.len() - 1024);
        // Not Velero's exact name: left alone, and the real one is appended. (Raw:
        // the tar crate's builder would drop the "./".)
        tar.extend(raw(
            b"./resources/persistentvolumeclaims/namespaces/ns/data.json",
            b'0',
            "",
            b"{\"old\":3}",
        ));
        // Only the plain path: its preferred-version path is appended.
        tar.extend(raw(
            b"resources/persistentvolumes/cluster/pv.json",
            b'0',
            "",
            b"{\"old\":4}",
        ));
        let input = gz(&finish(tar));
        let hpa_new = json!({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler"});
        let pvc_new = json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim"});
        let pv_new = json!({"apiVersion": "v1", "kind": "PersistentVolume"});
        let (outcome, out) = run(
            &input,
            &[
                item(
                    "autoscaling",
                    "horizontalpodautoscalers",
                    "app",
                    "hpa",
                    hpa_new.clone(),
                ),
                pvc_update("data", pvc_new.clone()),
                item("", "persistentvolumes", "", "pv", pv_new.clone()),
            ],
            u64::MAX,
        )
        .unwrap();
        assert_eq!(
            outcome,
            Outcome {
                replaced: 3,
                added: 3
            }
        );
        let got = entries(&out);
        let bytes = |v: &serde_json::Value| serde_json::to_vec(v).unwrap();
        let want: Vec<(String, Vec<u8>)> = vec![
            ("metadata/version".into(), b"1".to_vec()),
            (
                format!("resources/{hpa}/namespaces/app/hpa.json"),
                bytes(&hpa_new),
            ),
            (
                format!("resources/{hpa}/v1/namespaces/app/hpa.json"),
                b"{\"old\":1}".to_vec(),
            ),
            (
                format!("resources/{hpa}/v2-preferredversion/namespaces/app/hpa.json"),
                bytes(&hpa_new),
            ),
            (
                "./resources/persistentvolumeclaims/namespaces/ns/data.json".into(),
                b"{\"old\":3}".to_vec(),
            ),
            (
                "resources/persistentvolumes/cluster/pv.json".into(),
                bytes(&pv_new),
            ),
            (
                "resources/persistentvolumeclaims/namespaces/ns/data.json".into(),
                bytes(&pvc_new),
            ),
            (
                "resources/persistentvolumeclaims/v1-preferredversion/namespaces/ns/data.json"
                    .into(),
                bytes(&pvc_new),
            ),
            (
                "resources/persistentvolumes/v1-preferredversion/cluster/pv.json".into(),
                bytes(&pv_new),
            ),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn replaced_and_appended_entries_get_velero_s_fresh_header() {
        let path = "resources/persistentvolumeclaims/namespaces/ns/data.json";
        let input = gz(&tar_of(&[(path, b"{}")]));
        let before = time::OffsetDateTime::now_utc().unix_timestamp() as u64;
        let (_, out) = run(
            &input,
            &[pvc_update("data", json!({"apiVersion": "v1"}))],
            u64::MAX,
        )
        .unwrap();
        let after = time::OffsetDateTime::now_utc().unix_timestamp() as u64;
        let tar = gunzip(&out);
        let mut archive = tar::Archive::new(&tar[..]);
        for entry in archive.entries().unwrap() {
            let entry = entry.unwrap();
            let h = entry.header();
            assert!(h.as_ustar().is_some(), "USTAR, as Go writes it");
            assert_eq!(h.mode().unwrap(), 0o755);
            assert_eq!(h.entry_type(), EntryType::Regular);
            assert_eq!((h.uid().unwrap(), h.gid().unwrap()), (0, 0));
            assert_eq!(h.username().unwrap(), Some(""));
            let mtime = h.mtime().unwrap();
            assert!((before..=after).contains(&mtime), "{mtime}");
            // Go's checksum field: six digits, NUL, space.
            assert_eq!(h.as_bytes()[154..156], [0, b' ']);
        }
    }

    #[test]
    fn velero_header_splits_long_names_into_the_prefix_and_uses_pax_past_it() {
        let short = velero_header("resources/a/namespaces/n/x.json", 2, 1_700_000_000).unwrap();
        assert_eq!(short.len(), BLOCK);
        let long = format!("resources/{}/namespaces/app/x.json", "r".repeat(120));
        let split = velero_header(&long, 2, 1_700_000_000).unwrap();
        assert_eq!(split.len(), BLOCK);
        let h = Header::from_byte_slice(&split);
        assert_eq!(h.path_bytes(), long.as_bytes());
        let longer = format!(
            "resources/{}/namespaces/app/{}.json",
            "r".repeat(120),
            "n".repeat(120)
        );
        let pax = velero_header(&longer, 2, 1_700_000_000).unwrap();
        assert_eq!(pax.len(), 3 * BLOCK);
        assert_eq!(pax[156], b'x');
        let whole = [pax.clone(), vec![0; 2 + 510 + 1024]].concat();
        let mut archive = tar::Archive::new(&whole[..]);
        let entry = archive.entries().unwrap().next().unwrap().unwrap();
        assert_eq!(entry.path_bytes().as_ref(), longer.as_bytes());
    }

    #[test]
    fn untouched_entries_are_copied_byte_for_byte_with_their_long_name_headers() {
        let long_ns = "n".repeat(60);
        let long = format!(
            "resources/widgets.example.com/v1-preferredversion/namespaces/{long_ns}/w.json"
        );
        let original = tar_of(&[
            ("resources/pods/namespaces/ns/p.json", b"{\"pod\":1}"),
            (long.as_str(), b"{\"widget\":1}"),
            (
                "resources/persistentvolumeclaims/namespaces/ns/data.json",
                b"{}",
            ),
        ]);
        let (outcome, out) = run(
            &gz(&original),
            &[pvc_update("data", json!({"apiVersion": "v1"}))],
            u64::MAX,
        )
        .unwrap();
        assert_eq!(
            outcome,
            Outcome {
                replaced: 1,
                added: 1
            }
        );
        let rewritten = gunzip(&out);
        let replaced_at = original
            .windows(b"resources/persistentvolumeclaims".len())
            .position(|w| w == b"resources/persistentvolumeclaims")
            .unwrap()
            / 512
            * 512;
        assert!(
            replaced_at > 1024,
            "the fixture has entries before the replaced one"
        );
        assert_eq!(rewritten[..replaced_at], original[..replaced_at]);
        assert_eq!(entries(&out)[1].0, long);
    }

    #[test]
    fn the_output_is_one_gzip_member_larger_than_a_compression_block() {
        // Several 128 KiB compression blocks in the one member.
        let text: Vec<u8> = (0..400_000u32)
            .flat_map(|i| format!("{{\"n\":{}}}\n", i % 977).into_bytes())
            .collect();
        let input = gz(&tar_of(&[("resources/pods/namespaces/ns/p.json", &text)]));
        let (_, out) = run(&input, &[], u64::MAX).unwrap();
        let mut one = flate2::read::GzDecoder::new(&out[..]);
        let mut tar = Vec::new();
        one.read_to_end(&mut tar).unwrap();
        assert_eq!(entries(&out)[0].1, text);
        // Nothing after the first member: a single gzip stream.
        let mut first_member = Vec::new();
        flate2::bufread::GzDecoder::new(&out[..])
            .read_to_end(&mut first_member)
            .unwrap();
        assert_eq!(first_member.len(), tar.len());
        let single = gz(&gunzip(&input));
        assert!(
            out.len() < single.len() * 11 / 10,
            "{} vs {}",
            out.len(),
            single.len()
        );
    }

    #[test]
    fn pax_path_records_name_the_entry() {
        let path = format!(
            "resources/persistentvolumeclaims/namespaces/{}/data.json",
            "p".repeat(90)
        );
        let mut tar = pax(&[("path", &path)]);
        tar.extend(raw(b"truncated-name.json", b'0', "", b"{}"));
        let key = Updates {
            paths: BTreeMap::from([(path.clone(), 0)]),
            contents: vec![b"{\"x\":1}".to_vec()],
        };
        let mut out = Vec::new();
        let outcome = rewrite(&gz(&finish(tar))[..], &mut out, &key, u64::MAX).unwrap();
        assert_eq!(
            outcome,
            Outcome {
                replaced: 1,
                added: 0
            }
        );
        assert_eq!(entries(&out), vec![(path, b"{\"x\":1}".to_vec())]);
    }

    #[test]
    fn hostile_entries_are_refused_naming_the_entry_and_the_reason() {
        let cases = [
            (
                raw(b"/etc/passwd", b'0', "", b""),
                "entry /etc/passwd: absolute paths are not allowed",
            ),
            (
                raw(b"resources/../../x.json", b'0', "", b""),
                "entry resources/../../x.json: paths with '..' are not allowed",
            ),
            (
                raw(b"resources/link", b'2', "/etc/shadow", b""),
                "entry resources/link: symbolic links are not allowed",
            ),
            (
                raw(b"resources/hard", b'1', "metadata/version", b""),
                "entry resources/hard: hard links are not allowed",
            ),
            (
                raw(b"dev/tty", b'3', "", b""),
                "entry dev/tty: character devices are not allowed",
            ),
            (
                raw(b"dev/sda", b'4', "", b""),
                "entry dev/sda: block devices are not allowed",
            ),
            (
                raw(b"pipe", b'6', "", b""),
                "entry pipe: FIFOs are not allowed",
            ),
        ];
        for (tar, message) in cases {
            assert_eq!(refusal(tar), message);
        }
    }

    #[test]
    fn a_pax_size_that_hides_headers_in_an_entry_s_data_is_refused() {
        // The x header says 0 bytes; the ustar header says the data holds a symbolic
        // link's header, which every extractor would read as the next entry.
        let hidden = raw(b"resources/shadow.json", b'2', "/etc/shadow", b"");
        let mut tar = raw(b"metadata/version", b'0', "", b"1");
        tar.extend(pax(&[("size", "0")]));
        tar.extend(raw(b"resources/cover.json", b'0', "", &hidden));
        assert_eq!(
            refusal(tar),
            "entry resources/cover.json: its PAX size 0 differs from its header's size 512"
        );
        // Honoured when they agree: the data is the PAX size.
        let mut tar = pax(&[("size", "2")]);
        tar.extend(raw(b"resources/ok.json", b'0', "", b"{}"));
        let (_, out) = run(&gz(&finish(tar)), &[], u64::MAX).unwrap();
        assert_eq!(
            entries(&out),
            vec![("resources/ok.json".into(), b"{}".to_vec())]
        );
    }

    /// The entry named `name`, gzipped, and whether a rewrite replaced the config map
    /// `app/long` in it (it reads the name as `resources/configmaps/namespaces/app/long.json`).
    fn replaces_long(tar: Vec<u8>) -> bool {
        let update = item(
            "",
            "configmaps",
            "app",
            "long",
            json!({"apiVersion": "v1", "kind": "ConfigMap"}),
        );
        let (outcome, _) = run(&gz(&finish(tar)), &[update], u64::MAX).unwrap();
        outcome.replaced == 1
    }

    #[test]
    fn a_gnu_long_name_names_the_entry_over_a_pax_path_as_in_go() {
        let long = format!("../../{}/escape.json", "d".repeat(100));
        let mut tar = raw(b"././@LongLink", b'L', "", format!("{long}\0").as_bytes());
        tar.extend(pax(&[("path", "resources/ok.json")]));
        tar.extend(raw(b"resources/ok.json", b'0', "", b"{}"));
        assert_eq!(
            refusal(tar),
            format!("entry {long}: paths with '..' are not allowed")
        );
        let benign = "resources/configmaps/namespaces/app/long.json";
        let mut tar = raw(b"././@LongLink", b'L', "", format!("{benign}\0").as_bytes());
        tar.extend(pax(&[("path", "resources/other.json")]));
        tar.extend(raw(b"resources/ok.json", b'0', "", b"{}"));
        assert!(replaces_long(tar));
    }

    #[test]
    fn the_name_go_reads_is_checked() {
        let mut tar = pax(&[("path", "/etc/cron.d/job")]);
        tar.extend(raw(b"resources/ok.json", b'0', "", b"{}"));
        assert_eq!(
            refusal(tar),
            "entry /etc/cron.d/job: absolute paths are not allowed"
        );
        let mut h = Header::new_ustar();
        h.as_old_mut().name[..9].copy_from_slice(b"escape.js");
        h.as_ustar_mut().unwrap().prefix[..5].copy_from_slice(b"../..");
        h.set_size(0);
        h.set_entry_type(EntryType::Regular);
        h.set_cksum();
        assert_eq!(
            refusal(h.as_bytes().to_vec()),
            "entry ../../escape.js: paths with '..' are not allowed"
        );
    }

    /// `record` with its header's magic and version cleared: a pre-POSIX header.
    fn old_format(mut record: Vec<u8>) -> Vec<u8> {
        let mut h = Header::from_byte_slice(&record[..BLOCK]).clone();
        h.as_mut_bytes()[257..265].fill(0);
        h.set_cksum();
        record[..BLOCK].copy_from_slice(h.as_bytes());
        record
    }

    #[test]
    fn an_old_format_long_name_or_link_is_refused_not_taken_for_an_entry() {
        // Go takes it as an extension, the tar crate and pre-POSIX readers as an entry.
        for kind in [b'L', b'K'] {
            let mut tar = old_format(raw(b"././@LongLink", kind, "", b"resources/a.json\0"));
            tar.extend(raw(b"resources/b.json", b'0', "", b"{}"));
            assert_eq!(
                refusal(tar),
                format!(
                    "entry ././@LongLink: a header extension ({}) in a header without the ustar \
                     or GNU magic (readers disagree on whether it is one)",
                    kind as char
                )
            );
        }
    }

    #[test]
    fn a_gnu_long_link_before_a_file_is_copied_with_it() {
        let mut tar = raw(b"././@LongLink", b'K', "", b"resources/target.json\0");
        tar.extend(raw(b"resources/a.json", b'0', "", b"{}"));
        let (outcome, out) = run(&gz(&finish(tar.clone())), &[], u64::MAX).unwrap();
        assert_eq!(outcome, Outcome::default());
        assert_eq!(gunzip(&out), finish(tar));
    }

    #[test]
    fn gnu_times_go_would_read_as_a_name_prefix_are_refused() {
        // Go reads GNU times that are not numbers as a ustar prefix: ../../../../escape.js.
        let mut h = Header::new_gnu();
        h.as_old_mut().name[..9].copy_from_slice(b"escape.js");
        h.as_gnu_mut()
            .unwrap()
            .atime
            .copy_from_slice(b"../../../..\0");
        h.set_size(0);
        h.set_entry_type(EntryType::Regular);
        h.set_cksum();
        let refused = refusal(h.as_bytes().to_vec());
        assert!(refused.starts_with("entry escape.js: "), "{refused}");
        assert!(refused.contains("../../../.."), "{refused}");
    }

    #[test]
    fn gnu_sparse_records_and_hostile_global_names_are_refused() {
        let mut tar = pax(&[("GNU.sparse.name", "../../escape.json")]);
        tar.extend(raw(b"resources/ok.json", b'0', "", b"{}"));
        assert_eq!(
            refusal(tar),
            "entry resources/ok.json: its PAX header: PAX record GNU.sparse.name is not \
             allowed (Go renames and resizes GNU sparse entries by it)"
        );
        // Go names a global header by its path, and Velero's restore fails on a name
        // that leaves its directory.
        let mut tar = raw(
            b"pax_global_header",
            b'g',
            "",
            &pax_record("path", b"../../escape.json"),
        );
        tar.extend(raw(b"resources/ok.json", b'0', "", b"{}"));
        assert_eq!(
            refusal(tar),
            "entry ../../escape.json: paths with '..' are not allowed"
        );
        // Go applies no global header to the entries after it: it travels with them.
        let mut tar = raw(
            b"pax_global_header",
            b'g',
            "",
            &pax_record("comment", b"git"),
        );
        tar.extend(raw(b"resources/ok.json", b'0', "", b"{}"));
        let (_, out) = run(&gz(&finish(tar.clone())), &[], u64::MAX).unwrap();
        assert_eq!(gunzip(&out)[..tar.len()], tar[..]);
    }

    #[test]
    fn directories_with_data_are_refused_and_the_last_extension_counts() {
        let hidden = raw(b"../escape.json", b'0', "", b"{}");
        let refused = "entry resources/: a directory with 1024 bytes of data (Go reads none, \
                       and the next header where the data starts)";
        assert_eq!(
            refusal(raw_sized(b"resources/", b'5', &hidden, hidden.len() as u64)),
            refused
        );
        // An old-style regular entry (typeflag NUL) named like a directory is one.
        let mut old = raw_sized(b"resources/", b'0', &hidden, hidden.len() as u64);
        let mut h = Header::from_byte_slice(&old[..BLOCK]).clone();
        h.as_old_mut().linkflag = [0];
        h.set_cksum();
        old[..BLOCK].copy_from_slice(h.as_bytes());
        assert_eq!(refusal(old), refused);
        // Go uses the last GNU long name, and the last PAX header alone.
        let benign = b"resources/configmaps/namespaces/app/long.json\0";
        let mut tar = raw(b"././@LongLink", b'L', "", b"resources/a.json\0");
        tar.extend(raw(b"././@LongLink", b'L', "", benign));
        tar.extend(raw(b"resources/c.json", b'0', "", b""));
        assert!(replaces_long(tar));
        let mut tar = pax(&[("path", "resources/a.json")]);
        tar.extend(pax(&[("mtime", "1")]));
        tar.extend(raw(
            b"resources/configmaps/namespaces/app/long.json",
            b'0',
            "",
            b"",
        ));
        assert!(replaces_long(tar));
    }

    #[test]
    fn numeric_fields_only_some_readers_accept_are_refused() {
        let mut v = raw(b"resources/ok.json", b'0', "", b"{}");
        v[124..136].copy_from_slice(b"+0000000002\0");
        let mut h = Header::from_byte_slice(&v[..BLOCK]).clone();
        h.set_cksum();
        v[..BLOCK].copy_from_slice(h.as_bytes());
        assert_eq!(
            refusal(v),
            "entry resources/ok.json: size: \"+0000000002\\0\" is not an octal number"
        );
    }

    #[test]
    fn a_checksum_go_cannot_parse_is_refused() {
        // The crate reads these as the right sum; Go's reader fails the archive.
        for field in [*b"+012345\0", *b"\t012345\0"] {
            let mut v = raw(b"resources/ok.json", b'0', "", b"{}");
            let h = Header::from_byte_slice(&v[..BLOCK]).clone();
            let sum = format!("{:06o}", h.cksum().unwrap());
            let mut field = field;
            field[1..7].copy_from_slice(sum.as_bytes());
            v[148..156].copy_from_slice(&field);
            assert_eq!(
                refusal(v),
                format!(
                    "entry resources/ok.json: checksum: {:?} is not an octal number",
                    show(&field)
                )
            );
        }
    }

    #[test]
    fn numeric_fields_go_cannot_parse_are_refused() {
        for (at, what) in [
            (100, "mode"),
            (108, "uid"),
            (136, "mtime"),
            (329, "devmajor"),
        ] {
            let mut v = raw(b"resources/ok.json", b'0', "", b"{}");
            v[at..at + 7].copy_from_slice(b"zzzzzzz");
            let mut h = Header::from_byte_slice(&v[..BLOCK]).clone();
            h.set_cksum();
            v[..BLOCK].copy_from_slice(h.as_bytes());
            let refused = refusal(v);
            assert!(
                refused.starts_with(&format!("entry resources/ok.json: {what}: \"zzzzzzz"))
                    && refused.ends_with("is not an octal number"),
                "{refused}"
            );
        }
    }

    /// GNU tar's default format cuts a long name into the header's name field, whose
    /// 100th byte may be a '/': the entry is still a file to every reader.
    #[test]
    fn a_long_name_cut_at_a_slash_in_the_header_is_a_file() {
        let name = format!(
            "resources/deployments.apps/namespaces/{}/web.json",
            "n".repeat(61)
        );
        assert_eq!(name.as_bytes()[99], b'/');
        let tar = finish(tar_of(&[(name.as_str(), b"{\"kind\":1}")]));
        assert_eq!(
            &tar[BLOCK * 2 + 99..BLOCK * 2 + 100],
            b"/",
            "the header name is cut there"
        );
        let out = run(&gz(&tar), &[], u64::MAX).unwrap().1;
        assert_eq!(entries(&out), vec![(name, b"{\"kind\":1}".to_vec())]);
    }

    #[test]
    fn nothing_after_the_end_of_the_archive_is_copied() {
        let mut tar = finish(raw(b"resources/ok.json", b'0', "", b"{}"));
        tar.extend(raw(b"/etc/passwd", b'0', "", b"x"));
        let (_, out) = run(&gz(&tar), &[], u64::MAX).unwrap();
        assert_eq!(
            entries(&out),
            vec![("resources/ok.json".into(), b"{}".to_vec())]
        );
        assert_eq!(gunzip(&out).len(), 4 * BLOCK);
    }

    #[test]
    fn an_entry_larger_than_what_follows_is_refused() {
        let mut tar = tar_of(&[
            ("metadata/version", b"1"),
            ("resources/pods/namespaces/ns/big.json", &[b'x'; 5000]),
        ]);
        tar.truncate(512 * 2 + 512 + 1024);
        let err = run(&gz(&tar), &[], u64::MAX).unwrap_err().to_string();
        assert!(
            err.starts_with(
                "entry resources/pods/namespaces/ns/big.json: the archive is truncated"
            ),
            "{err}"
        );
    }

    #[test]
    fn a_truncated_gzip_stream_is_refused() {
        let mut input = gz(&tar_of(&[(
            "resources/pods/namespaces/ns/p.json",
            &[b'y'; 20_000],
        )]));
        input.truncate(input.len() / 2);
        let err = run(&input, &[], u64::MAX).unwrap_err().to_string();
        assert!(
            err.contains("truncated") || err.contains("unexpected end"),
            "{err}"
        );
    }

    #[test]
    fn a_gzip_bomb_stops_at_the_decompressed_size_limit() {
        let zeros = vec![0u8; 4 * 1024 * 1024];
        let tar = tar_of(&[("resources/pods/namespaces/ns/bomb.json", &zeros)]);
        let input = gz(&tar);
        assert!(input.len() < 64 * 1024, "the fixture compresses well");
        let err = run(&input, &[], 1024 * 1024).unwrap_err().to_string();
        assert!(
            err.contains("the decompressed archive exceeds the limit of 1048576 bytes"),
            "{err}"
        );
    }

    #[test]
    fn a_raised_stop_flag_ends_the_rewrite() {
        let input = gz(&tar_of(&[("resources/pods/namespaces/ns/p.json", b"{}")]));
        let stop = AtomicBool::new(true);
        let updates = Updates::new(&[]).unwrap();
        let err = rewrite_until(&input[..], Vec::new(), &updates, u64::MAX, &stop).unwrap_err();
        assert!(matches!(err, RewriteError::Stopped), "{err}");
    }

    #[test]
    fn updated_items_need_an_api_version() {
        let err = Updates::new(&[pvc_update("a", json!({"kind": "PersistentVolumeClaim"}))])
            .err()
            .unwrap();
        assert_eq!(
            err,
            "updatedItems[0].object.apiVersion: must be set, e.g. \"v1\""
        );
        let err = Updates::new(&[pvc_update("a", json!([1]))]).err().unwrap();
        assert_eq!(err, "updatedItems[0].object: must be a JSON object");
        let twice = [
            pvc_update("a", json!({"apiVersion": "v1"})),
            pvc_update("a", json!({"apiVersion": "v1"})),
        ];
        assert_eq!(
            Updates::new(&twice).err().unwrap(),
            "updatedItems[1].resource: the same item is listed twice"
        );
    }

    #[test]
    fn a_pax_size_past_the_header_s_octal_field_is_refused_not_misread() {
        // Extractors honour the PAX size (8 GiB here, Go writes 0 in the header); the
        // tar crate's raw mode would take the header's, so it is refused.
        let mut tar = pax(&[("size", "8589934592")]);
        tar.extend(raw(b"resources/huge.json", b'0', "", b""));
        assert_eq!(
            refusal(tar),
            "entry resources/huge.json: its PAX size 8589934592 differs from its header's size 0"
        );
    }

    #[test]
    fn size_fields_are_read_only_in_forms_every_reader_agrees_on() {
        // Base-256 (GNU) within 64 bits: read, and the entry copied as it was.
        let mut v = raw(b"resources/ok.json", b'0', "", b"{}");
        v[124..136].copy_from_slice(&[0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
        let mut h = Header::from_byte_slice(&v[..BLOCK]).clone();
        h.set_cksum();
        v[..BLOCK].copy_from_slice(h.as_bytes());
        let (_, out) = run(&gz(&finish(v.clone())), &[], u64::MAX).unwrap();
        assert_eq!(gunzip(&out)[..v.len()], v[..]);
        // Negative: Go and Python read it so, the crate its last eight bytes alone.
        v[124..136].copy_from_slice(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 2]);
        let mut h = Header::from_byte_slice(&v[..BLOCK]).clone();
        h.set_cksum();
        v[..BLOCK].copy_from_slice(h.as_bytes());
        assert_eq!(
            refusal(v.clone()),
            "entry resources/ok.json: size: a base-256 number readers take differently"
        );
        // An empty field: Go and Python read 0, the crate cannot read it.
        v[124..136].fill(0);
        let mut h = Header::from_byte_slice(&v[..BLOCK]).clone();
        h.set_cksum();
        v[..BLOCK].copy_from_slice(h.as_bytes());
        let e = refusal(v);
        assert!(
            e.starts_with("the header at byte 0 is not valid: ") && e.contains("resources/ok.json"),
            "{e}"
        );
    }

    #[test]
    fn pax_records_are_refused_unless_every_reader_splits_them_alike() {
        // A newline inside a value: Go and Python go by the record's length, the tar
        // crate splits at the newline.
        let record = b"21 comment=two\nlines\n";
        assert_eq!(record.len(), 21);
        let mut tar = raw(b"PaxHeaders.0/x", b'x', "", record);
        tar.extend(raw(b"resources/ok.json", b'0', "", b"{}"));
        assert!(
            refusal(tar).starts_with("entry resources/ok.json: its PAX header: "),
            "refused, naming the entry"
        );
        // Text after the last record.
        let mut data = pax_record("mtime", b"1");
        data.extend_from_slice(b"\n");
        let mut tar = raw(b"PaxHeaders.0/x", b'x', "", &data);
        tar.extend(raw(b"resources/ok.json", b'0', "", b"{}"));
        assert_eq!(
            refusal(tar),
            "entry resources/ok.json: its PAX header: a newline inside a PAX record, or text \
             that is no record (readers split them differently)"
        );
    }

    #[test]
    fn padding_is_copied_as_it_was() {
        let mut entry = raw(b"resources/a.json", b'0', "", b"{}");
        entry[BLOCK + 2..].fill(b'p');
        let mut tar = raw(b"././@LongLink", b'L', "", b"resources/b.json\0");
        tar[BLOCK + 17..].fill(b'q');
        tar.extend(raw(b"resources/b.json", b'0', "", b"{}"));
        tar.splice(0..0, entry);
        let (_, out) = run(&gz(&finish(tar.clone())), &[], u64::MAX).unwrap();
        assert_eq!(gunzip(&out)[..tar.len()], tar[..]);
    }

    #[test]
    fn a_header_that_is_not_one_is_refused_saying_where() {
        let mut tar = raw(b"resources/a.json", b'0', "", b"{}");
        tar.extend(raw(b"resources/b.json", b'0', "", b"{}"));
        tar[2 * BLOCK] ^= 1;
        assert_eq!(
            refusal(tar),
            "the header at byte 1024 is not valid: archive header checksum mismatch (not a \
             tar archive, or corrupt)"
        );
    }

    #[test]
    fn an_updated_item_s_resource_may_not_be_a_relative_directory() {
        for dots in [".", ".."] {
            let mut item = pvc_update("a", json!({"apiVersion": "v1"}));
            item.resource.resource = dots.into();
            assert_eq!(
                Updates::new(&[item]).err().unwrap(),
                "updatedItems[0].resource.resource: must be a resource name (letters, digits, \
                 '-' and '.')"
            );
        }
    }

    #[test]
    fn an_updated_item_s_version_must_be_one_kubernetes_could_name() {
        for version in ["v1\n", "..", "V1 beta"] {
            let item = pvc_update("a", json!({"apiVersion": format!("apps/{version}")}));
            let refused = Updates::new(&[item]).err().unwrap();
            assert!(
                refused.starts_with(&format!(
                    "updatedItems[0].object.apiVersion: its version {version:?} must be a DNS \
                     label"
                )),
                "{refused}"
            );
        }
    }
}
