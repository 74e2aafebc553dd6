//! Rewriting a Velero backup tarball at finalize, as Velero's `buildFinalTarball` does:
//! an entry whose name is exactly an updated item's plain path
//! (`resources/<resource.group>/namespaces/<ns>/<name>.json`, or `cluster/<name>.json`)
//! or its `<version>-preferredversion` path is replaced by the item's new content under
//! a fresh header (the header Velero's Go `tar.Writer` writes: USTAR, mode 0755, uid and
//! gid 0, mtime now); paths of updated items the tarball lacks are appended, each on its
//! own; every other entry is copied byte for byte, header extensions included, in order.
//! Other version directories (`v1/` when the item is `v2`) are left as they were.
//!
//! The archive is streamed (gzip → tar → tar → parallel gzip), never held: memory stays
//! bounded whatever its size. The tar stream is parsed here, block by block, so that the
//! checks see what extractors see: GNU tar, Go's `archive/tar` and Python's `tarfile`
//! all honour a PAX `size` record, so does this reader (otherwise an entry's "data"
//! could hide headers they read); every name any of them could use for an entry (header
//! name, ustar prefix read either way, GNU long name, PAX `path`) is checked; and forms
//! they read differently (a GNU long name with a PAX path, two long names, a PAX size
//! that contradicts the header, GNU sparse records, a global header that renames, a
//! directory with data) are refused. Refused too: absolute paths, `..`, links, devices,
//! FIFOs, a truncated archive, and a decompressed size past the configured limit.
//! Reading stops at the first end-of-archive block: nothing after it is copied.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};

use flate2::read::MultiGzDecoder;
use gzp::deflate::Gzip;
use gzp::par::compress::ParCompressBuilder;
use gzp::ZWriter;
use opmon_client::UpdatedItem;

/// Largest GNU long-name or PAX header accepted, in bytes (Go's reader has the same
/// limit for its "special files").
const MAX_EXTENSION: u64 = 1024 * 1024;
const BLOCK: usize = 512;
/// The gzip level of the output: `gzip -6`, Go's default, what Velero writes.
const LEVEL: u32 = 6;
/// The largest size a 12-byte header field holds in octal (11 digits): beyond it a
/// PAX `size` record is the only way to state the size, and the header's own field
/// may hold anything.
const OCTAL_SIZE_LIMIT: u64 = 8u64.pow(11);

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

/// The header's checksum matches, computed over unsigned bytes. (GNU tar, Go and
/// Python also accept the sum over signed bytes some old tars wrote; the tar crate does
/// not, so such a header is refused rather than read one way.)
fn checksum_ok(h: &[u8; BLOCK]) -> bool {
    let Ok(stored) = parse_octal(&h[148..156]) else {
        return false;
    };
    let sum: u64 = h
        .iter()
        .enumerate()
        .map(|(i, b)| {
            if (148..156).contains(&i) {
                u64::from(b' ')
            } else {
                u64::from(*b)
            }
        })
        .sum();
    stored == sum
}

/// An octal numeric field in the one form every reader agrees on: optional leading
/// spaces, octal digits, then only NULs and spaces. (Python's `int()` would also take
/// `+` and `_`, Go's parser neither; such a field is refused, not guessed at.)
fn parse_octal(field: &[u8]) -> Result<u64, String> {
    let text = field.iter().skip_while(|b| **b == b' ');
    let mut value: u64 = 0;
    let mut digits = true;
    for b in text {
        match b {
            b'0'..=b'7' if digits => {
                value = value
                    .checked_mul(8)
                    .and_then(|v| v.checked_add(u64::from(b - b'0')))
                    .ok_or("the number overflows")?;
            }
            0 | b' ' => digits = false,
            _ => return Err(format!("{:?} is not an octal number", show(field))),
        }
    }
    Ok(value)
}

/// The size field: octal, or GNU base-256 (first byte 0x80).
fn parse_size(field: &[u8]) -> Result<u64, String> {
    match field.first() {
        Some(0x80) => field[1..].iter().try_fold(0u64, |v, b| {
            v.checked_mul(256)
                .map(|v| v | u64::from(*b))
                .ok_or_else(|| "the size overflows".to_string())
        }),
        Some(b) if b & 0x80 != 0 => Err("a negative size".into()),
        _ => parse_octal(field),
    }
}

/// What a PAX extended header says about the entry after it.
#[derive(Default)]
struct Pax {
    path: Option<Vec<u8>>,
    size: Option<u64>,
}

/// Parses PAX records strictly (`"<len> <key>=<value>\n"`, lengths exact, nothing
/// after the last one), as Go's reader requires; `global` refuses the records GNU tar
/// would apply to every later entry and Go ignores. `what` names the header in errors.
fn parse_pax(data: &[u8], global: bool) -> Result<Pax, String> {
    let mut pax = Pax::default();
    let mut rest = data;
    while !rest.is_empty() {
        let space = rest
            .iter()
            .position(|b| *b == b' ')
            .ok_or("a PAX record without a length")?;
        let len: usize = std::str::from_utf8(&rest[..space])
            .ok()
            .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|t| t.parse().ok())
            .ok_or("a PAX record with an unreadable length")?;
        if len <= space + 1 || len > rest.len() || rest[len - 1] != b'\n' {
            return Err("a PAX record whose length does not match its text".into());
        }
        let record = &rest[space + 1..len - 1];
        rest = &rest[len..];
        let eq = record
            .iter()
            .position(|b| *b == b'=')
            .ok_or("a PAX record without '='")?;
        let (key, value) = (&record[..eq], &record[eq + 1..]);
        if key.is_empty() || key.contains(&0) {
            return Err("a PAX record with an invalid key".into());
        }
        let key = show(key);
        if key.starts_with("GNU.") {
            return Err(format!(
                "PAX record {key} is not allowed (GNU sparse and multi-volume entries are \
                 read differently by GNU tar, Go and Python)"
            ));
        }
        match key.as_str() {
            "path" | "size" | "linkpath" if global => {
                return Err(format!(
                    "a global PAX header may not set {key} (GNU tar applies it to every \
                     later entry, Go ignores it)"
                ));
            }
            "path" => {
                if value.is_empty() {
                    return Err("an empty PAX path (Go keeps the header's name, Python \
                                uses the empty one)"
                        .into());
                }
                if value.contains(&0) {
                    return Err("a NUL byte in the PAX path".into());
                }
                if value.contains(&b'\n') {
                    // Readers that split records at newlines (the tar crate, for one)
                    // would read another path than those that go by the length.
                    return Err("a newline in the PAX path".into());
                }
                if pax.path.replace(value.to_vec()).is_some() {
                    return Err("the PAX header repeats path".into());
                }
            }
            "size" => {
                let size = std::str::from_utf8(value)
                    .ok()
                    .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()))
                    .and_then(|t| t.parse::<u64>().ok())
                    .ok_or_else(|| format!("an unreadable PAX size {:?}", show(value)))?;
                if pax.size.replace(size).is_some() {
                    return Err("the PAX header repeats size".into());
                }
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
    /// Data bytes held, to bound them together.
    held: u64,
    long_name: Option<Vec<u8>>,
    long_names: u32,
    long_links: u32,
    pax: Option<Pax>,
    pax_headers: u32,
    /// Why the PAX header is refused, told when its entry comes.
    pax_error: Option<String>,
}

/// The names an entry's header gives it, read the ways extractors read them.
struct HeaderNames {
    /// The 100-byte name field alone.
    raw: Vec<u8>,
    /// Go and GNU tar: with the ustar prefix when the magic says ustar (131 bytes of it
    /// in star archives).
    go: Vec<u8>,
    /// Python's tarfile: with bytes 345..500 as a prefix whenever they are not empty,
    /// whatever the magic.
    python: Vec<u8>,
}

fn join_prefix(prefix: &[u8], name: &[u8]) -> Vec<u8> {
    if prefix.is_empty() {
        return name.to_vec();
    }
    let mut v = prefix.to_vec();
    v.push(b'/');
    v.extend_from_slice(name);
    v
}

impl HeaderNames {
    fn of(h: &[u8; BLOCK]) -> HeaderNames {
        let raw = nts(&h[..100]).to_vec();
        let ustar = &h[257..263] == b"ustar\0" && &h[263..265] == b"00";
        let star = &h[508..512] == b"tar\0";
        let go = if ustar {
            let prefix = if star { &h[345..476] } else { &h[345..500] };
            join_prefix(nts(prefix), &raw)
        } else {
            raw.clone()
        };
        let python = join_prefix(nts(&h[345..500]), &raw);
        HeaderNames { raw, go, python }
    }
}

/// Refuses a name an extractor could be tricked by: absolute, or with `..`. `which`
/// says which name it is when it is not the entry's own.
fn check_name(entry: &[u8], name: &[u8], which: Option<&str>) -> Result<(), RewriteError> {
    let refused = if name.starts_with(b"/") {
        "absolute paths are not allowed"
    } else if name.split(|b| *b == b'/').any(|part| part == b"..") {
        "paths with '..' are not allowed"
    } else {
        return Ok(());
    };
    Err(match which {
        None => reject(entry, refused),
        Some(which) => reject(entry, format!("its {which} is {}: {refused}", show(name))),
    })
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

/// Reads the decompressed tar stream in blocks, counting where it is.
struct Blocks<R> {
    inner: R,
    offset: u64,
}

impl<R: Read> Blocks<R> {
    /// Fills `buf`; `Ok(false)` at a clean end of the stream before any byte.
    fn fill(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        let mut got = 0;
        while got < buf.len() {
            match self.inner.read(&mut buf[got..]) {
                Ok(0) if got == 0 => return Ok(false),
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("the archive ends {} bytes short", buf.len() - got),
                    ))
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.offset += got as u64;
        Ok(true)
    }

    /// Reads what follows the end of the archive to the end of the input, copying
    /// nothing: a gzip member's CRC and length are in its trailer, checked only once it
    /// is read, and a corrupt input must not come out as a valid output with a fresh
    /// CRC. The decompressed bound still holds; stops early once `stop` is set.
    fn verify_rest(&mut self, buf: &mut [u8], stop: &AtomicBool) -> Result<(), RewriteError> {
        loop {
            if stop.load(Ordering::Relaxed) {
                return Err(RewriteError::Stopped);
            }
            match self.inner.read(buf) {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let reason = match e.kind() {
                        io::ErrorKind::UnexpectedEof => format!(
                            "the gzip stream ends early: it is truncated, or followed by \
                             bytes that are not gzip ({e})"
                        ),
                        _ => e.to_string(),
                    };
                    return Err(RewriteError::Archive(format!(
                        "after the end of the archive: {reason}"
                    )));
                }
            }
        }
    }

    /// Reads `left` bytes of entry `name`'s data (through `buf`), handing each piece
    /// to `sink`; stops early once `stop` is set.
    fn pass(
        &mut self,
        mut left: u64,
        buf: &mut [u8],
        stop: &AtomicBool,
        name: &[u8],
        mut sink: impl FnMut(&[u8]) -> Result<(), RewriteError>,
    ) -> Result<(), RewriteError> {
        while left > 0 {
            if stop.load(Ordering::Relaxed) {
                return Err(RewriteError::Stopped);
            }
            let n = left.min(buf.len() as u64) as usize;
            let piece = &mut buf[..n];
            self.fill(piece)
                .and_then(|got| {
                    got.then_some(())
                        .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "no data"))
                })
                .map_err(|e| read_error(Some(name), e))?;
            sink(piece)?;
            left -= n as u64;
        }
        Ok(())
    }
}

/// Describes an I/O failure while reading at `entry` (or between entries).
fn read_error(entry: Option<&[u8]>, e: io::Error) -> RewriteError {
    let reason = match e.kind() {
        io::ErrorKind::UnexpectedEof => format!("the archive is truncated ({e})"),
        _ => e.to_string(),
    };
    match entry {
        Some(entry) => reject(entry, reason),
        None => RewriteError::Archive(reason),
    }
}

/// The header Velero's finalize writes for an item: what Go's `tar.Writer` makes of
/// `tar.Header{Name, Size, Typeflag: TypeReg, Mode: 0755, ModTime: time.Now()}` (with
/// the mtime rounded to the second, as Go does for a header of unset format): USTAR
/// when the name fits the name field or splits into prefix and name, else a PAX header
/// with a `path` record before a USTAR one. Byte for byte, checksum format included.
pub fn velero_header(name: &str, size: u64, mtime: u64) -> Vec<u8> {
    let ascii = name.bytes().all(|b| b != 0 && b < 0x80);
    let mut out = Vec::with_capacity(2 * BLOCK);
    if ascii && name.len() <= 100 {
        out.extend_from_slice(&ustar_block(b'0', name.as_bytes(), b"", 0o755, size, mtime));
    } else if let Some((prefix, rest)) = split_ustar(name).filter(|_| ascii) {
        out.extend_from_slice(&ustar_block(
            b'0',
            rest.as_bytes(),
            prefix.as_bytes(),
            0o755,
            size,
            mtime,
        ));
    } else {
        let record = pax_record("path", name.as_bytes());
        let (dir, file) = match name.rfind('/') {
            Some(i) => (&name[..=i], &name[i + 1..]),
            None => ("", name),
        };
        // Go: path.Join(dir, "PaxHeaders.0", file), ASCII only, cut to the field.
        let mut pax_name: Vec<u8> = format!("{dir}PaxHeaders.0/{file}")
            .chars()
            .filter(|c| c.is_ascii() && *c != '\0')
            .map(|c| c as u8)
            .collect();
        pax_name.truncate(100);
        while pax_name.last() == Some(&b'/') {
            pax_name.pop();
        }
        let mut h = ustar_block(b'x', &pax_name, b"", 0, record.len() as u64, 0);
        // Go's raw extension header leaves the owner names and device numbers empty.
        h[329..345].fill(0);
        set_checksum(&mut h);
        out.extend_from_slice(&h);
        out.extend_from_slice(&record);
        pad(&mut out, record.len());
        let ascii_name: Vec<u8> = name
            .chars()
            .filter(|c| c.is_ascii() && *c != '\0')
            .map(|c| c as u8)
            .collect();
        out.extend_from_slice(&ustar_block(b'0', &ascii_name, b"", 0o755, size, mtime));
    }
    out
}

/// Go's `splitUSTARPath`: a prefix of at most 155 bytes and a name of at most 100,
/// split at a slash.
fn split_ustar(name: &str) -> Option<(&str, &str)> {
    let mut length = name.len();
    if length <= 100 {
        return None;
    }
    if length > 156 {
        length = 156;
    } else if name.as_bytes()[length - 1] == b'/' {
        length -= 1;
    }
    let i = name[..length].rfind('/')?;
    let (nlen, plen) = (name.len() - i - 1, i);
    if i == 0 || nlen > 100 || nlen == 0 || plen > 155 {
        return None;
    }
    Some((&name[..i], &name[i + 1..]))
}

/// One PAX record, its length counting itself.
fn pax_record(key: &str, value: &[u8]) -> Vec<u8> {
    let body = key.len() + value.len() + 3;
    let mut len = body + body.to_string().len();
    if (len).to_string().len() + body != len {
        len = body + len.to_string().len();
    }
    let mut v = format!("{len} {key}=").into_bytes();
    v.extend_from_slice(value);
    v.push(b'\n');
    v
}

/// Go's `formatOctal`: zero-padded digits and a NUL.
fn octal(field: &mut [u8], value: u64) {
    let text = format!("{value:o}");
    let width = field.len() - 1;
    let text = format!("{text:0>width$}");
    field[..width].copy_from_slice(&text.as_bytes()[text.len() - width..]);
    field[width] = 0;
}

/// Go's `formatString`: the bytes, NUL-terminated when shorter than the field; a name
/// cut at the field's end loses a trailing slash there.
fn string_field(field: &mut [u8], value: &[u8]) {
    let n = value.len().min(field.len());
    field[..n].copy_from_slice(&value[..n]);
    if value.len() < field.len() {
        field[value.len()] = 0;
    }
    if value.len() > field.len() && field[field.len() - 1] == b'/' {
        let kept = value[..field.len()]
            .iter()
            .rposition(|b| *b != b'/')
            .map_or(0, |i| i + 1);
        field[kept] = 0;
    }
}

fn ustar_block(
    kind: u8,
    name: &[u8],
    prefix: &[u8],
    mode: u64,
    size: u64,
    mtime: u64,
) -> [u8; BLOCK] {
    let mut h = [0u8; BLOCK];
    string_field(&mut h[..100], name);
    octal(&mut h[100..108], mode);
    octal(&mut h[108..116], 0);
    octal(&mut h[116..124], 0);
    octal(&mut h[124..136], size);
    octal(&mut h[136..148], mtime);
    h[156] = kind;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    octal(&mut h[329..337], 0);
    octal(&mut h[337..345], 0);
    string_field(&mut h[345..500], prefix);
    set_checksum(&mut h);
    h
}

/// Go's checksum field: six octal digits, a NUL, a space.
fn set_checksum(h: &mut [u8; BLOCK]) {
    h[148..156].fill(b' ');
    let sum: u64 = h.iter().map(|b| u64::from(*b)).sum();
    octal(&mut h[148..155], sum);
    h[155] = b' ';
}

fn pad(out: &mut Vec<u8>, len: usize) {
    out.resize(out.len() + (BLOCK - len % BLOCK) % BLOCK, 0);
}

/// Threads compressing the output: both cores of a small node, at most four.
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
    std::thread::scope(|scope| {
        let mut gz = ParCompressBuilder::<Gzip>::new()
            .num_threads(compress_threads())
            .map_err(|e| RewriteError::Archive(format!("starting the compressor: {e}")))?
            .compression_level(gzp::Compression::new(LEVEL))
            .from_borrowed_writer(output, scope);
        let result = copy(input, &mut gz, updates, max_decompressed, stop);
        // Finished in every case: dropping the compressor unfinished would panic on a
        // write error.
        let finished = gz.finish();
        let outcome = result?;
        finished.map_err(|e| RewriteError::Archive(format!("writing the output: {e}")))?;
        Ok(outcome)
    })
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
    let mut blocks = Blocks {
        inner: io::BufReader::with_capacity(256 * 1024, source),
        offset: 0,
    };
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
    let mut header = [0u8; BLOCK];
    loop {
        if stop.load(Ordering::Relaxed) {
            return Err(RewriteError::Stopped);
        }
        let at = blocks.offset;
        let after = last.as_ref().map(|p| {
            let mut v = b"after ".to_vec();
            v.extend_from_slice(p);
            v
        });
        if !blocks
            .fill(&mut header)
            .map_err(|e| read_error(after.as_deref(), e))?
        {
            break;
        }
        if header.iter().all(|b| *b == 0) {
            // The end of the archive. GNU tar and Python stop at the first zero block,
            // Go wants a second; anything after it is not copied.
            blocks.verify_rest(&mut buf, stop)?;
            break;
        }
        if !checksum_ok(&header) {
            return Err(RewriteError::Archive(format!(
                "the header at byte {at} has a bad checksum (not a tar archive, or corrupt)"
            )));
        }
        let kind = header[156];
        let names = HeaderNames::of(&header);
        let header_size =
            parse_size(&header[124..136]).map_err(|e| reject(&names.raw, format!("size: {e}")));

        if matches!(kind, b'L' | b'K' | b'x' | b'g') {
            let magic = &header[257..265];
            if magic != b"ustar\x0000" && magic != b"ustar  \0" {
                // Python takes it as an extension whatever the magic, the tar crate
                // as an entry of an unknown type.
                return Err(reject(
                    &names.raw,
                    format!(
                        "a header extension ({}) in a header without the ustar or GNU magic \
                         (readers disagree on whether it is one)",
                        kind as char
                    ),
                ));
            }
            let size = header_size?;
            if size > MAX_EXTENSION {
                return Err(RewriteError::Archive(format!(
                    "a header extension ({}) of {size} bytes is larger than the {MAX_EXTENSION} allowed",
                    kind as char
                )));
            }
            // Bound them together too: a run of extensions before one entry is held
            // in memory until that entry comes.
            if pending.held + size > MAX_EXTENSION {
                return Err(RewriteError::Archive(format!(
                    "the header extensions before one entry exceed the {MAX_EXTENSION} bytes allowed"
                )));
            }
            if kind == b'g' && pending.all.len() > pending.global.len() {
                return Err(reject(
                    &names.raw,
                    "a global PAX header between an entry's header extensions and the entry \
                     (Go drops those extensions there, Python keeps them)",
                ));
            }
            pending.held += size;
            let padded = (size as usize).div_ceil(BLOCK) * BLOCK;
            let mut data = vec![0u8; padded];
            let got = blocks
                .fill(&mut data)
                .map_err(|e| read_error(Some(b"(header extension)"), e))?;
            if !got && padded > 0 {
                return Err(read_error(
                    Some(b"(header extension)"),
                    io::Error::new(io::ErrorKind::UnexpectedEof, "no data after its header"),
                ));
            }
            let body = &data[..size as usize];
            pending.all.extend_from_slice(&header);
            pending.all.extend_from_slice(&data);
            if kind == b'g' {
                pending.global.extend_from_slice(&header);
                pending.global.extend_from_slice(&data);
            }
            match kind {
                b'L' => {
                    pending.long_names += 1;
                    pending.long_name = Some(nts(body).to_vec());
                }
                b'K' => pending.long_links += 1,
                b'x' => {
                    pending.pax_headers += 1;
                    // A refusal waits for the entry, so it can name it.
                    match parse_pax(body, false) {
                        Ok(pax) => pending.pax = Some(pax),
                        Err(e) => pending.pax_error = Some(e),
                    }
                }
                _ => {
                    parse_pax(body, true).map_err(|e| reject(&names.raw, e))?;
                }
            }
            continue;
        }

        // An entry: the name every extractor could give it, checked, then the one
        // they agree on.
        let taken = std::mem::take(&mut pending);
        if let Some(e) = &taken.pax_error {
            let name = taken.long_name.as_deref().unwrap_or(&names.go);
            return Err(reject(name, format!("its PAX header: {e}")));
        }
        let pax = taken.pax.unwrap_or_default();
        let name: Vec<u8> = taken
            .long_name
            .clone()
            .or_else(|| pax.path.clone())
            .unwrap_or_else(|| names.go.clone());
        if name.is_empty() {
            return Err(RewriteError::Archive(format!(
                "the entry at byte {at} has no name"
            )));
        }
        check_name(&name, &name, None)?;
        check_name(&name, &names.raw, Some("header name"))?;
        check_name(&name, &names.go, Some("name with the ustar prefix"))?;
        check_name(
            &name,
            &names.python,
            Some("name as Python reads the prefix field"),
        )?;
        if let Some(long) = &taken.long_name {
            check_name(&name, long, Some("GNU long name"))?;
        }
        if let Some(path) = &pax.path {
            check_name(&name, path, Some("PAX path"))?;
        }
        if taken.long_names > 1 {
            return Err(reject(
                &name,
                "two GNU long names precede it (Go uses the last, Python the first)",
            ));
        }
        if taken.pax_headers > 1 {
            return Err(reject(
                &name,
                "two PAX headers precede it (Go uses the last, Python the first)",
            ));
        }
        if taken.long_links > 1 {
            return Err(reject(&name, "two GNU long link names precede it"));
        }
        if let (Some(long), Some(path)) = (&taken.long_name, &pax.path) {
            if long != path {
                return Err(reject(
                    &name,
                    format!(
                        "both a GNU long name and a PAX path ({}) name it (Go and Python use \
                         the long name, GNU tar the PAX path)",
                        show(path)
                    ),
                ));
            }
        }
        if names.go != names.python {
            return Err(reject(
                &name,
                format!(
                    "its header's prefix field is read differently by extractors (Go and GNU \
                     tar: {}, Python: {})",
                    show(&names.go),
                    show(&names.python)
                ),
            ));
        }
        check_type(&name, kind)?;
        let header_size = header_size?;
        let size = match pax.size {
            Some(pax_size) if pax_size != header_size && pax_size < OCTAL_SIZE_LIMIT => {
                return Err(reject(
                    &name,
                    format!("its PAX size {pax_size} differs from its header's size {header_size}"),
                ));
            }
            Some(pax_size) => pax_size,
            None => header_size,
        };
        // Go and Python read an old-style regular entry whose name ends in '/' as a
        // directory, and directories as having no data.
        let directory = kind == b'5'
            || [&name, &names.raw, &names.go, &names.python]
                .iter()
                .any(|n| n.ends_with(b"/"));
        if directory && size > 0 {
            return Err(reject(
                &name,
                format!(
                    "a directory with {size} bytes of data (extractors disagree on where the \
                     next header starts)"
                ),
            ));
        }

        let replacement = std::str::from_utf8(&name)
            .ok()
            .filter(|_| !directory)
            .and_then(|n| path_index.get(n).map(|i| (n, *i)));
        let left = size.div_ceil(BLOCK as u64) * BLOCK as u64;
        match replacement {
            Some((path, i)) => {
                let content = &updates.contents[updates.paths[path]];
                let now = time::OffsetDateTime::now_utc().unix_timestamp().max(0) as u64;
                out.write_all(&taken.global).map_err(write_error)?;
                out.write_all(&velero_header(path, content.len() as u64, now))
                    .map_err(write_error)?;
                out.write_all(content).map_err(write_error)?;
                out.write_all(&vec![0u8; (BLOCK - content.len() % BLOCK) % BLOCK])
                    .map_err(write_error)?;
                present[i] = true;
                outcome.replaced += 1;
                // The old content is read (not copied) so a truncated archive is
                // still noticed.
                blocks.pass(left, &mut buf, stop, &name, |_| Ok(()))?;
            }
            None => {
                out.write_all(&taken.all).map_err(write_error)?;
                out.write_all(&header).map_err(write_error)?;
                blocks.pass(left, &mut buf, stop, &name, |data| {
                    out.write_all(data).map_err(write_error)
                })?;
            }
        }
        last = Some(name);
    }
    // Extensions with no entry after them: extractors differ (Go returns the global
    // header as an entry, the tar crate errors), so they are refused, not guessed at.
    if !pending.all.is_empty() {
        return Err(RewriteError::Archive(
            "the archive ends with a header extension and no entry after it".into(),
        ));
    }
    let now = time::OffsetDateTime::now_utc().unix_timestamp().max(0) as u64;
    for (i, (path, index)) in updates.paths.iter().enumerate() {
        if present[i] {
            continue;
        }
        let content = &updates.contents[*index];
        out.write_all(&velero_header(path, content.len() as u64, now))
            .map_err(write_error)?;
        out.write_all(content).map_err(write_error)?;
        out.write_all(&vec![0u8; (BLOCK - content.len() % BLOCK) % BLOCK])
            .map_err(write_error)?;
        outcome.added += 1;
    }
    out.write_all(&[0u8; 2 * BLOCK]).map_err(write_error)?;
    Ok(outcome)
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
        let short = velero_header("resources/a/namespaces/n/x.json", 2, 1_700_000_000);
        assert_eq!(short.len(), BLOCK);
        let long = format!("resources/{}/namespaces/app/x.json", "r".repeat(120));
        let split = velero_header(&long, 2, 1_700_000_000);
        assert_eq!(split.len(), BLOCK);
        let h = Header::from_byte_slice(&split);
        assert_eq!(h.path_bytes(), long.as_bytes());
        let longer = format!(
            "resources/{}/namespaces/app/{}.json",
            "r".repeat(120),
            "n".repeat(120)
        );
        let pax = velero_header(&longer, 2, 1_700_000_000);
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
        // Several 128 KiB compression blocks, each primed with the one before.
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

    #[test]
    fn a_gnu_long_name_with_a_pax_path_is_refused_as_ambiguous() {
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
        assert_eq!(
            refusal(tar),
            format!(
                "entry {benign}: both a GNU long name and a PAX path (resources/other.json) \
                 name it (Go and Python use the long name, GNU tar the PAX path)"
            )
        );
    }

    #[test]
    fn every_name_an_extractor_could_use_is_checked() {
        // A PAX path over a hostile header name: GNU tar, Go and Python use the PAX
        // path, an older reader the header's.
        let mut tar = pax(&[("path", "resources/ok.json")]);
        tar.extend(raw(b"/etc/cron.d/job", b'0', "", b"{}"));
        assert_eq!(
            refusal(tar),
            "entry resources/ok.json: its header name is /etc/cron.d/job: absolute paths are not allowed"
        );
        // GNU-format header with bytes in the ustar prefix area: Python prepends them.
        let mut h = Header::new_gnu();
        h.as_old_mut().name[..9].copy_from_slice(b"escape.js");
        h.as_gnu_mut()
            .unwrap()
            .atime
            .copy_from_slice(b"../../../..\0");
        h.set_size(0);
        h.set_entry_type(EntryType::Regular);
        h.set_cksum();
        assert_eq!(
            refusal(h.as_bytes().to_vec()),
            "entry escape.js: its name as Python reads the prefix field is ../../../../escape.js: \
             paths with '..' are not allowed"
        );
    }

    #[test]
    fn gnu_sparse_and_global_renames_are_refused() {
        let mut tar = pax(&[("GNU.sparse.name", "../../escape.json")]);
        tar.extend(raw(b"resources/ok.json", b'0', "", b"{}"));
        assert_eq!(
            refusal(tar),
            "entry resources/ok.json: its PAX header: PAX record GNU.sparse.name is not \
             allowed (GNU sparse and multi-volume entries are read differently by GNU tar, Go \
             and Python)"
        );
        let mut tar = raw(
            b"pax_global_header",
            b'g',
            "",
            &pax_record("path", b"../../escape.json"),
        );
        tar.extend(raw(b"resources/ok.json", b'0', "", b"{}"));
        assert_eq!(
            refusal(tar),
            "entry pax_global_header: a global PAX header may not set path (GNU tar applies \
             it to every later entry, Go ignores it)"
        );
        // A harmless global header travels with the entries.
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
    fn directories_with_data_and_repeated_extensions_are_refused() {
        let hidden = raw(b"../escape.json", b'0', "", b"{}");
        assert_eq!(
            refusal(raw_sized(b"resources/", b'5', &hidden, hidden.len() as u64)),
            "entry resources/: a directory with 1024 bytes of data (extractors disagree on \
             where the next header starts)"
        );
        assert_eq!(
            refusal(raw_sized(b"resources/", 0, &hidden, hidden.len() as u64)),
            "entry resources/: a directory with 1024 bytes of data (extractors disagree on \
             where the next header starts)"
        );
        let mut tar = raw(b"././@LongLink", b'L', "", b"resources/a.json\0");
        tar.extend(raw(b"././@LongLink", b'L', "", b"resources/b.json\0"));
        tar.extend(raw(b"resources/c.json", b'0', "", b""));
        assert_eq!(
            refusal(tar),
            "entry resources/b.json: two GNU long names precede it (Go uses the last, Python the first)"
        );
        let mut tar = pax(&[("path", "resources/a.json")]);
        tar.extend(pax(&[("mtime", "1")]));
        tar.extend(raw(b"resources/c.json", b'0', "", b""));
        assert_eq!(
            refusal(tar),
            "entry resources/c.json: two PAX headers precede it (Go uses the last, Python the first)"
        );
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
}
