//! Property tests of the finalize tarball rewrite (`opmon_agent::tarball::rewrite`)
//! against hostile input: random tar structures (Velero-layout paths, every entry type,
//! GNU long names, PAX and ustar-prefix names, extension headers without an entry, and
//! the archives of issue 11.4: a PAX size hiding a header, a GNU long name with a PAX
//! path, `GNU.sparse.name`, a global `path`, a directory with data), gzip-compressed in
//! one or more members, then often corrupted (bytes flipped, cut short, garbage
//! appended), with random updated items.
//!
//! The oracle is independent of the code under test: archives are read by the `tar`
//! crate's high-level reader (which applies GNU long names, PAX paths and PAX sizes the
//! way extractors do), not by a copy of the rewrite's parser. A refusal of an archive
//! the `tar` crate reads as harmless is accepted only when its reason is a form that
//! extractors read differently and the input is checked to contain that form.
//!
//! Properties, for every case:
//! - `rewrite` returns (no panic) within a bound, and allocates at most a bounded amount
//!   beyond the output it produces (a counting global allocator measures the peak,
//!   compressor threads included);
//! - an archive the oracle reads to its end with harmless entries only (relative, no
//!   `..`, files and directories) is rewritten, unless it holds an ambiguous form;
//!   one with a hostile entry or a broken structure is refused, naming the entry;
//! - on success the output is a single-member `.tar.gz` whose entries all read as
//!   harmless; they are the input's, in order, copied byte for byte (header extensions
//!   included) except entries named exactly like an updated item's plain or
//!   `<version>-preferredversion` path, which carry the new content with mode 0755;
//!   then the absent paths in path order; the outcome counts them.
//!
//! `OPMON_FUZZ_TARBALL_CASES` (default 100000) sets the number of cases,
//! every run uses the same fixed seeds unless `PROPTEST_RNG_SEED` sets another
//! (the seed is printed at the start).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::sync::atomic::{AtomicIsize, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flate2::read::{GzDecoder, MultiGzDecoder};
use flate2::Compression;
use opmon_agent::tarball::{rewrite, Updates};
use opmon_client::{ResourceIdentifier, UpdatedItem};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};
use serde_json::{json, Value};
use tar::{EntryType, Header};

// ---------------------------------------------------------------------------------
// Memory: a global allocator that keeps the live bytes of the whole process and their
// peak. A rewrite runs on the calling thread and the compressor's threads, so what it
// allocates is measured process-wide, one rewrite at a time ([`MEASURED`]).

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);
/// Held while a rewrite is measured, so the two fuzz runs do not mix their figures.
static MEASURED: Mutex<()> = Mutex::new(());

fn account(delta: isize) {
    let now = LIVE.fetch_add(delta, Ordering::Relaxed) + delta;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged; the bookkeeping
// only touches atomics (no allocation).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            account(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            account(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        account(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            account(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f`, returning its result and the most bytes allocated at once meanwhile,
/// beyond what was live before.
fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let _one = MEASURED.lock().unwrap_or_else(|p| p.into_inner());
    let start = LIVE.load(Ordering::SeqCst);
    PEAK.store(start, Ordering::SeqCst);
    let result = f();
    let peak = PEAK.load(Ordering::SeqCst);
    (result, (peak - start).max(0) as usize)
}

/// Memory a rewrite may use besides its output: two 256 KiB read buffers, the gzip
/// state both ways (the compressor's on each of its threads, with the blocks queued to
/// them), one pending header extension of up to 1 MiB, and slack (what the other fuzz
/// run allocates meanwhile, small cases, counts too).
const MEMORY_ALLOWANCE: usize = 12 * 1024 * 1024;

// ---------------------------------------------------------------------------------
// Hangs: a watchdog thread per run aborts the process, naming the case, if one rewrite
// runs too long. Each run (test function) has its own thread, watch and tally.

const HANG: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Watch {
    case: AtomicU64,
    /// When the current rewrite started, in ms since the epoch; 0 between rewrites.
    started_ms: AtomicU64,
}

thread_local! {
    static WATCH: std::cell::RefCell<Option<Arc<Watch>>> = const { std::cell::RefCell::new(None) };
    /// How often each kind of outcome was seen (error messages with paths left out),
    /// to show what the cases exercised.
    static OUTCOMES: std::cell::RefCell<BTreeMap<String, u64>> = const { std::cell::RefCell::new(BTreeMap::new()) };
    /// The most a single rewrite allocated at once.
    static MAX_PEAK: Cell<usize> = const { Cell::new(0) };
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Marks the start (`true`) or end of a rewrite for the watchdog.
fn watch(running: bool) {
    WATCH.with(|w| {
        if let Some(w) = w.borrow().as_ref() {
            w.started_ms
                .store(if running { now_ms() } else { 0 }, Ordering::SeqCst);
        }
    });
}

fn start_watchdog(seed: u64) -> Arc<Watch> {
    let w = Arc::new(Watch::default());
    let watched = w.clone();
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_secs(1));
        let started = watched.started_ms.load(Ordering::SeqCst);
        if started != 0 && now_ms().saturating_sub(started) > HANG.as_millis() as u64 {
            eprintln!(
                "rewrite of case {} (PROPTEST_RNG_SEED={seed}) ran for more than {HANG:?}",
                watched.case.load(Ordering::SeqCst)
            );
            std::process::abort();
        }
    });
    w
}

fn tally(what: String) {
    OUTCOMES.with(|o| *o.borrow_mut().entry(what).or_default() += 1);
}

/// An error message with the entry path replaced, to count kinds of errors.
fn shape(message: &str) -> String {
    let message = match message.strip_prefix("entry ") {
        Some(rest) => match rest.rfind(": ") {
            Some(i) => format!("entry …: {}", &rest[i + 2..]),
            None => "entry …".to_string(),
        },
        None => message.to_string(),
    };
    message
        .split(|c: char| c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("#")
}

// ---------------------------------------------------------------------------------
// Generation. proptest generates and shrinks small choices and seeds ([`Knobs`]); a
// case is derived from them with a small deterministic generator. Cheap to generate
// in a debug build, and every case is replayable from the printed knobs.

/// A splitmix64 generator.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo)
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    /// An index into `weights`, each chosen in proportion to its weight.
    fn weighted(&mut self, weights: &[u32]) -> usize {
        let total: u32 = weights.iter().sum();
        let mut x = (self.next() % u64::from(total)) as u32;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        weights.len() - 1
    }

    fn chars(&mut self, alphabet: &[u8], len: usize) -> String {
        (0..len).map(|_| self.pick(alphabet) as char).collect()
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
}

/// What proptest generates: the number and kind of pieces, and seeds.
#[derive(Clone, Debug)]
struct Knobs {
    pieces: Vec<(u8, u64)>,
    end_blocks: u8,
    members: u8,
    level: u8,
    mutation: (u8, u64),
    updates: Vec<u64>,
    limit: (u8, u64),
}

fn knobs() -> impl Strategy<Value = Knobs> {
    (
        prop::collection::vec((any::<u8>(), any::<u64>()), 0..6),
        0u8..5,
        0u8..5,
        0u8..4,
        (any::<u8>(), any::<u64>()),
        prop::collection::vec(any::<u64>(), 0..4),
        (any::<u8>(), any::<u64>()),
    )
        .prop_map(
            |(pieces, end_blocks, members, level, mutation, updates, limit)| Knobs {
                pieces,
                end_blocks,
                members,
                level,
                mutation,
                updates,
                limit,
            },
        )
}

/// How an entry's path is stored.
#[derive(Clone, Copy, Debug)]
enum NameForm {
    /// In the header's 100-byte name field (cut there if longer).
    Plain,
    /// A GNU long-name (`L`) entry before it.
    GnuLong,
    /// A PAX (`x`) entry with a `path` record before it.
    Pax,
    /// Split between the ustar prefix and name fields when it fits.
    UstarPrefix,
}

#[derive(Clone, Copy, Debug)]
enum Format {
    Gnu,
    Ustar,
    Old,
}

#[derive(Clone, Debug)]
struct EntrySpec {
    path: Vec<u8>,
    form: NameForm,
    format: Format,
    kind: u8,
    link: Vec<u8>,
    data: Vec<u8>,
    mode: u32,
    mtime: u64,
}

#[derive(Clone, Debug)]
enum Piece {
    Entry(EntrySpec),
    /// A PAX global header (`g`) with some records.
    Global(Vec<u8>),
    /// A run of extension headers (`L` if true, else `x`) of the given sizes, then an
    /// entry.
    ExtensionRun(Vec<(bool, usize)>, EntrySpec),
    /// An extension header with no entry after it (when last).
    Stray(u8, Vec<u8>),
    /// One of the archives of issue 11.4 around an entry (see [`push_trick`]).
    Trick(u8, EntrySpec),
}

#[derive(Clone, Debug)]
enum Mutation {
    None,
    /// Set bytes of the uncompressed tar (offsets modulo its length).
    FlipTar(Vec<(u64, u8)>),
    /// Cut the uncompressed tar.
    CutTar(u64),
    /// Set bytes of the compressed stream.
    FlipGz(Vec<(u64, u8)>),
    /// Cut the compressed stream.
    CutGz(u64),
    /// Append bytes after the compressed stream.
    AppendGz(Vec<u8>),
}

#[derive(Clone, Debug)]
struct Case {
    pieces: Vec<Piece>,
    /// 0, 1 or 2 zero blocks at the end.
    end_blocks: usize,
    /// Split into this many gzip members (at block boundaries).
    members: usize,
    /// Gzip level of the members (0: stored blocks).
    level: u32,
    mutation: Mutation,
    updates: Vec<UpdateSpec>,
    /// The decompressed-size limit as a fraction of the decompressed size, or none.
    limit: Option<f64>,
}

#[derive(Clone, Debug)]
struct UpdateSpec {
    resource: ResourceIdentifier,
    api_version: Option<Value>,
    payload: String,
}

/// Group-resources with their (group, resource), as Velero names the directories.
const GROUP_RESOURCES: &[(&str, &str, &str)] = &[
    ("persistentvolumeclaims", "", "persistentvolumeclaims"),
    ("pods", "", "pods"),
    (
        "volumesnapshots.snapshot.storage.k8s.io",
        "snapshot.storage.k8s.io",
        "volumesnapshots",
    ),
    ("widgets.example.com", "example.com", "widgets"),
    ("persistentvolumes", "", "persistentvolumes"),
];
const NAMESPACES: &[&str] = &[
    "ns",
    "app",
    "",
    "nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn",
];
const VERSION_DIRS: &[Option<&str>] = &[
    None,
    Some("v1-preferredversion"),
    Some("v1"),
    Some("v2beta1"),
    Some("v1beta1-preferredversion"),
];
const OTHER_PATHS: &[&str] = &[
    "metadata/version",
    "resources/",
    "resources/pods/",
    "resources/pods/namespaces/ns/",
    "resources/pods/namespaces/ns/.json",
    "/etc/passwd",
    "../escape",
    "resources/../../x.json",
    "resources/pods/namespaces/ns/..",
    "..",
    ".",
    "./",
    "a//b",
    "resources/pods/namespaces/ns/../p.json",
    "/",
    "",
];
const LOWER: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";

fn item_name(g: &mut Gen) -> String {
    match g.weighted(&[4, 1, 1]) {
        0 => g.pick(&["data", "a", "vm-1-disk", "x.y"]).to_string(),
        1 => "l".repeat(200),
        _ => {
            let len = g.range(1, 20);
            g.chars(LOWER, len)
        }
    }
}

/// `resources/<gr>/[<version>/](namespaces/<ns>|cluster)/<name>.json`, sometimes with
/// `./` in front or another extension.
fn velero_path(g: &mut Gen) -> String {
    let mut path = String::new();
    if g.below(10) == 0 {
        path.push_str("./");
    }
    path.push_str("resources/");
    path.push_str(g.pick(GROUP_RESOURCES).0);
    path.push('/');
    if let Some(v) = g.pick(VERSION_DIRS) {
        path.push_str(v);
        path.push('/');
    }
    let ns = g.pick(NAMESPACES);
    if ns.is_empty() {
        path.push_str("cluster/");
    } else {
        path.push_str("namespaces/");
        path.push_str(ns);
        path.push('/');
    }
    path.push_str(&item_name(g));
    path.push_str(g.pick(&[".json", ".json", ".json", ".yaml", ""]));
    path
}

fn other_path(g: &mut Gen) -> Vec<u8> {
    match g.weighted(&[3, 3, 1, 1]) {
        0 => g.pick(OTHER_PATHS).as_bytes().to_vec(),
        1 => {
            let len = g.below(41);
            g.chars(b"abcdefghijklmnopqrstuvwxyz./_-", len).into_bytes()
        }
        2 => {
            let first = g.range(1, 12);
            let mut p = g.chars(LOWER, first);
            for _ in 0..g.range(2, 6) {
                p.push('/');
                let len = g.range(1, 70);
                p.push_str(&g.chars(b"abcdefghijklmnopqrstuvwxyz0123456789.", len));
            }
            p.into_bytes()
        }
        _ => {
            let len = g.range(1, 130);
            (0..len).map(|_| (g.next() as u8).max(1)).collect()
        }
    }
}

fn entry_kind(g: &mut Gen) -> u8 {
    match g.weighted(&[12, 2, 3, 1, 1, 1]) {
        0 => b'0',
        1 => b'\0',
        2 => b'5',
        3 => b'7',
        4 => g.pick(b"1234 6SVMND"),
        _ => g.next() as u8,
    }
}

fn content(g: &mut Gen) -> Vec<u8> {
    match g.weighted(&[5, 2, 1, 2]) {
        0 => format!("{{\"{}\":{}}}", g.chars(LOWER, 5), g.below(1_000_000)).into_bytes(),
        1 => {
            let len = g.below(200);
            g.bytes(len)
        }
        2 => vec![g.next() as u8; g.below(1200)],
        _ => Vec::new(),
    }
}

fn entry(g: &mut Gen) -> EntrySpec {
    let path = if g.weighted(&[3, 2]) == 0 {
        velero_path(g).into_bytes()
    } else {
        other_path(g)
    };
    let form = [
        NameForm::Plain,
        NameForm::GnuLong,
        NameForm::Pax,
        NameForm::UstarPrefix,
    ][g.weighted(&[6, 2, 2, 1])];
    EntrySpec {
        path,
        form,
        format: g.pick(&[Format::Gnu, Format::Ustar, Format::Old]),
        kind: entry_kind(g),
        link: g
            .pick(&["", "metadata/version", "/etc/shadow", "../x"])
            .as_bytes()
            .to_vec(),
        data: content(g),
        mode: g.pick(&[0o644, 0o755, 0o4777, 0]),
        mtime: g.pick(&[0, 1_700_000_000, 0o77777777777]),
    }
}

fn piece(choice: u8, seed: u64) -> Piece {
    let g = &mut Gen(seed);
    match choice % 28 {
        23..=27 => Piece::Trick(choice % 28 - 23, entry(g)),
        0..=19 => Piece::Entry(entry(g)),
        20 => Piece::Global(pax_record("comment", g.chars(LOWER, 8).as_bytes())),
        21 => {
            let run = (0..g.range(1, 4))
                .map(|_| (g.below(2) == 0, g.range(1, 700)))
                .collect();
            Piece::ExtensionRun(run, entry(g))
        }
        _ => {
            let kind = g.pick(b"LxK");
            let len = g.range(1, 150);
            let path = g.chars(b"abcdefghijklmnopqrstuvwxyz/", len);
            Piece::Stray(
                kind,
                match kind {
                    b'x' => pax_record("path", path.as_bytes()),
                    _ => nul_terminated(path.as_bytes()),
                },
            )
        }
    }
}

fn mutation((choice, seed): (u8, u64)) -> Mutation {
    let g = &mut Gen(seed);
    let flips = |g: &mut Gen| {
        (0..g.range(1, 4))
            .map(|_| (g.next(), g.next() as u8))
            .collect()
    };
    match choice % 20 {
        0..=9 => Mutation::None,
        10..=12 => Mutation::FlipTar(flips(g)),
        13 | 14 => Mutation::CutTar(g.next()),
        15 | 16 => Mutation::FlipGz(flips(g)),
        17 | 18 => Mutation::CutGz(g.next()),
        _ => {
            let len = g.range(1, 40);
            Mutation::AppendGz(g.bytes(len))
        }
    }
}

fn update(seed: u64) -> UpdateSpec {
    let g = &mut Gen(seed);
    let (_, group, resource) = g.pick(GROUP_RESOURCES);
    let namespace = g.pick(NAMESPACES).to_string();
    let name = if g.below(40) == 0 {
        "Not_A_Name".to_string()
    } else {
        item_name(g)
    };
    let api_version = match g.weighted(&[57, 1, 1, 1]) {
        0 => Some(json!(g.pick(&[
            "v1",
            "snapshot.storage.k8s.io/v1",
            "example.com/v2beta1",
            "v1beta1",
        ]))),
        1 => Some(json!(g.pick(&["", "apps/"]))),
        2 => Some(json!(7)),
        _ => None,
    };
    let len = g.below(60);
    UpdateSpec {
        resource: ResourceIdentifier {
            group: group.to_string(),
            resource: resource.to_string(),
            namespace,
            name,
        },
        api_version,
        payload: g.chars(b" !#$%&()*+,-./0123456789:;<=>?@ABCXYZ[]^_`abcxyz{|}~", len),
    }
}

impl Case {
    fn of(k: &Knobs) -> Case {
        let pieces: Vec<Piece> = k.pieces.iter().map(|(c, s)| piece(*c, *s)).collect();
        // Half of the updated items are items the archive holds, so entries get replaced.
        let held: Vec<ResourceIdentifier> = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Entry(e) | Piece::ExtensionRun(_, e) | Piece::Trick(_, e) => {
                    std::str::from_utf8(&e.path).ok()
                }
                _ => None,
            })
            .filter_map(item_of_path)
            .filter_map(|(gr, namespace, name)| {
                let (_, group, resource) = GROUP_RESOURCES.iter().find(|g| g.0 == gr)?;
                Some(ResourceIdentifier {
                    group: group.to_string(),
                    resource: resource.to_string(),
                    namespace,
                    name,
                })
            })
            .collect();
        let updates = k
            .updates
            .iter()
            .map(|seed| {
                let mut u = update(*seed);
                if !held.is_empty() && seed % 2 == 0 {
                    u.resource = held[(seed >> 8) as usize % held.len()].clone();
                }
                u
            })
            .collect();
        Case {
            pieces,
            end_blocks: [2, 2, 2, 1, 0][usize::from(k.end_blocks) % 5],
            members: [1, 1, 1, 2, 3][usize::from(k.members) % 5],
            level: [0, 0, 0, 1][usize::from(k.level) % 4],
            mutation: mutation(k.mutation),
            updates,
            limit: (k.limit.0 % 7 == 6).then(|| (k.limit.1 % 1300) as f64 / 1000.0),
        }
    }
}

// ---------------------------------------------------------------------------------
// Building archives by hand, so hostile names and types get in as an attacker writes
// them (the tar crate's own API refuses them).

fn nul_terminated(bytes: &[u8]) -> Vec<u8> {
    let mut v = bytes.to_vec();
    v.push(0);
    v
}

/// One PAX record, `"<len> <key>=<value>\n"`, its length counting itself.
fn pax_record(key: &str, value: &[u8]) -> Vec<u8> {
    let body = key.len() + value.len() + 3; // ' ', '=', '\n'
    let mut len = body + 1;
    while len != body + len.to_string().len() {
        len = body + len.to_string().len();
    }
    let mut v = format!("{len} {key}=").into_bytes();
    v.extend_from_slice(value);
    v.push(b'\n');
    assert_eq!(v.len(), len);
    v
}

fn new_header(format: Format) -> Header {
    match format {
        Format::Gnu => Header::new_gnu(),
        Format::Ustar => Header::new_ustar(),
        Format::Old => Header::new_old(),
    }
}

fn put(slot: &mut [u8], bytes: &[u8]) {
    slot.fill(0);
    let n = bytes.len().min(slot.len());
    slot[..n].copy_from_slice(&bytes[..n]);
}

fn push_entry(tar: &mut Vec<u8>, header: &Header, data: &[u8]) {
    tar.extend_from_slice(header.as_bytes());
    tar.extend_from_slice(data);
    let pad = (512 - data.len() % 512) % 512;
    tar.extend(std::iter::repeat_n(0u8, pad));
}

fn push_extension(tar: &mut Vec<u8>, kind: u8, data: &[u8]) {
    let mut h = if kind == b'L' || kind == b'K' {
        let mut h = Header::new_gnu();
        put(&mut h.as_old_mut().name, b"././@LongLink");
        h
    } else {
        let mut h = Header::new_ustar();
        put(&mut h.as_old_mut().name, b"PaxHeaders.0/entry");
        h
    };
    h.set_entry_type(EntryType::new(kind));
    h.set_mode(0o644);
    h.set_size(data.len() as u64);
    h.set_cksum();
    push_entry(tar, &h, data);
}

fn push_spec(tar: &mut Vec<u8>, e: &EntrySpec) {
    let mut h = new_header(e.format);
    match e.form {
        NameForm::Plain => put(&mut h.as_old_mut().name, &e.path),
        NameForm::GnuLong => {
            push_extension(tar, b'L', &nul_terminated(&e.path));
            put(&mut h.as_old_mut().name, &e.path);
        }
        NameForm::Pax => {
            push_extension(tar, b'x', &pax_record("path", &e.path));
            put(&mut h.as_old_mut().name, &e.path);
        }
        NameForm::UstarPrefix => {
            let split = (e.path.len() > 100)
                .then(|| {
                    e.path
                        .iter()
                        .enumerate()
                        .filter(|(i, b)| **b == b'/' && *i <= 155 && e.path.len() - i - 1 <= 100)
                        .map(|(i, _)| i)
                        .next()
                })
                .flatten();
            match (split, h.as_ustar_mut()) {
                (Some(i), Some(ustar)) => {
                    put(&mut ustar.prefix, &e.path[..i]);
                    put(&mut ustar.name, &e.path[i + 1..]);
                }
                _ => put(&mut h.as_old_mut().name, &e.path),
            }
        }
    }
    put(&mut h.as_old_mut().linkname, &e.link);
    h.set_entry_type(EntryType::new(e.kind));
    h.set_mode(e.mode);
    h.set_mtime(e.mtime);
    h.set_size(e.data.len() as u64);
    h.set_cksum();
    push_entry(tar, &h, &e.data);
}

/// A symbolic link's header block, hidden where a checker that misreads sizes would
/// take it for data.
fn hidden_link() -> Vec<u8> {
    let mut h = Header::new_ustar();
    put(&mut h.as_old_mut().name, b"resources/shadow.json");
    put(&mut h.as_old_mut().linkname, b"/etc/shadow");
    h.set_entry_type(EntryType::Symlink);
    h.set_size(0);
    h.set_cksum();
    h.as_bytes().to_vec()
}

/// The archives of issue 11.4, each of which passed the old check while Python's
/// `extractall` of the output wrote outside its target: 0, a PAX `size` that hides a
/// header in the entry's data; 1, a GNU long name then a PAX path; 2, a PAX
/// `GNU.sparse.name`; 3, a global PAX header with `path` (the name Go gives it); 4, a
/// directory with data.
fn push_trick(tar: &mut Vec<u8>, trick: u8, e: &EntrySpec) {
    let escape = b"../../escape.json";
    let plain = EntrySpec {
        form: NameForm::Plain,
        format: Format::Ustar,
        kind: b'0',
        ..e.clone()
    };
    match trick {
        0 => {
            push_extension(tar, b'x', &pax_record("size", b"0"));
            push_spec(
                tar,
                &EntrySpec {
                    data: hidden_link(),
                    ..plain
                },
            );
        }
        1 => {
            push_extension(tar, b'L', &nul_terminated(escape));
            push_extension(tar, b'x', &pax_record("path", &plain.path));
            push_spec(tar, &plain);
        }
        2 => {
            push_extension(tar, b'x', &pax_record("GNU.sparse.name", escape));
            push_spec(tar, &plain);
        }
        3 => {
            push_extension(tar, b'g', &pax_record("path", escape));
            push_spec(tar, &plain);
        }
        _ => push_spec(
            tar,
            &EntrySpec {
                kind: b'5',
                data: hidden_link(),
                ..plain
            },
        ),
    }
}

fn build_tar(case: &Case) -> Vec<u8> {
    let mut tar = Vec::new();
    for piece in &case.pieces {
        match piece {
            Piece::Entry(e) => push_spec(&mut tar, e),
            Piece::Global(records) => push_extension(&mut tar, b'g', records),
            Piece::ExtensionRun(run, e) => {
                for (gnu, size) in run {
                    if *gnu {
                        let mut name = vec![b'n'; *size];
                        name.push(0);
                        push_extension(&mut tar, b'L', &name);
                    } else {
                        let filler = pax_record("comment", &vec![b'c'; size.saturating_sub(16)]);
                        push_extension(&mut tar, b'x', &filler);
                    }
                }
                push_spec(&mut tar, e);
            }
            Piece::Stray(kind, data) => push_extension(&mut tar, *kind, data),
            Piece::Trick(trick, e) => push_trick(&mut tar, *trick, e),
        }
    }
    tar.extend(std::iter::repeat_n(0u8, 512 * case.end_blocks));
    tar
}

// Gzip framing done here rather than by flate2's gz types: in a debug build their
// CRC-32 dominates the run time, a table-driven one is several times faster.

const CRC_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xedb8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

fn crc32(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for b in data {
        c = CRC_TABLE[((c ^ u32::from(*b)) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// One gzip member of `data`: level 0 as stored blocks, others deflated by flate2.
fn gzip_at(data: &[u8], level: u32) -> Vec<u8> {
    let mut out = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 255];
    if level == 0 {
        let mut chunks = data.chunks(65535).peekable();
        if chunks.peek().is_none() {
            out.extend([1, 0, 0, 0xff, 0xff]);
        }
        while let Some(chunk) = chunks.next() {
            let last = chunks.peek().is_none();
            let len = chunk.len() as u16;
            out.push(u8::from(last));
            out.extend(len.to_le_bytes());
            out.extend((!len).to_le_bytes());
            out.extend_from_slice(chunk);
        }
    } else {
        let mut e = flate2::write::DeflateEncoder::new(out, Compression::new(level));
        e.write_all(data).unwrap();
        out = e.finish().unwrap();
    }
    out.extend(crc32(data).to_le_bytes());
    out.extend((data.len() as u32).to_le_bytes());
    out
}

fn gzip(data: &[u8]) -> Vec<u8> {
    gzip_at(data, 1)
}

/// Decodes a single-member gzip stream, checking its CRC and length.
fn gunzip_one(data: &[u8]) -> Result<Vec<u8>, String> {
    if data.len() < 18 || data[..3] != [0x1f, 0x8b, 8] {
        return Err("no gzip header".into());
    }
    if data[3] != 0 {
        // Optional header fields: let flate2 read them.
        let mut out = Vec::new();
        return GzDecoder::new(data)
            .read_to_end(&mut out)
            .map(|_| out)
            .map_err(|e| e.to_string());
    }
    let mut deflate = flate2::read::DeflateDecoder::new(&data[10..]);
    let mut out = Vec::new();
    deflate.read_to_end(&mut out).map_err(|e| e.to_string())?;
    let rest = &data[10 + deflate.total_in() as usize..];
    if rest.len() != 8 {
        return Err(format!("{} bytes follow the deflate stream", rest.len()));
    }
    if rest[..4] != crc32(&out).to_le_bytes() || rest[4..] != (out.len() as u32).to_le_bytes() {
        return Err("gzip trailer mismatch".into());
    }
    Ok(out)
}

fn pick(at: u64, len: usize) -> usize {
    (at % len.max(1) as u64) as usize
}

/// The input `.tar.gz` of a case, and the tar inside it unless the compressed stream
/// was tampered with.
fn build_input(case: &Case) -> (Vec<u8>, Option<Vec<u8>>) {
    let mut tar = build_tar(case);
    match &case.mutation {
        Mutation::FlipTar(flips) => {
            for (at, byte) in flips {
                let i = pick(*at, tar.len());
                if let Some(b) = tar.get_mut(i) {
                    *b = *byte;
                }
            }
        }
        Mutation::CutTar(at) => {
            let i = pick(*at, tar.len());
            tar.truncate(i);
        }
        _ => {}
    }
    // Members split at block boundaries.
    let blocks = tar.len().div_ceil(512).max(1);
    let per = blocks.div_ceil(case.members).max(1) * 512;
    let mut gz = Vec::new();
    for chunk in tar.chunks(per) {
        gz.extend(gzip_at(chunk, case.level));
    }
    if tar.is_empty() {
        gz.extend(gzip_at(&[], case.level));
    }
    match &case.mutation {
        Mutation::FlipGz(flips) => {
            for (at, byte) in flips {
                let i = pick(*at, gz.len());
                if let Some(b) = gz.get_mut(i) {
                    *b = *byte;
                }
            }
        }
        Mutation::CutGz(at) => {
            let i = pick(*at, gz.len());
            gz.truncate(i);
        }
        Mutation::AppendGz(extra) => gz.extend_from_slice(extra),
        _ => return (gz, Some(tar)),
    }
    (gz, None)
}

fn updated_items(case: &Case) -> Vec<UpdatedItem> {
    case.updates
        .iter()
        .map(|u| {
            let mut object = json!({
                "kind": "Thing",
                "metadata": {"name": u.resource.name, "namespace": u.resource.namespace},
                "spec": {"payload": u.payload},
            });
            if let Some(v) = &u.api_version {
                object["apiVersion"] = v.clone();
            }
            UpdatedItem {
                resource: u.resource.clone(),
                object,
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------
// The model: what a correct rewrite does with an input, derived from the
// specification (docs/results.md, docs/architecture.md "Files"), not from the code
// under test. Archives are read by the `tar` crate's high-level reader, which applies
// GNU long names, PAX paths and PAX sizes as Go does; a sample is also read by Go's
// archive/tar (`go_reads_what_the_rewrite_accepted_as_the_input_s_entries_on_a_fixed_sample`).

/// One entry as the tar crate's reader sees it, with the bytes it spans in the archive
/// (header extensions before it included).
#[derive(Clone, Debug)]
struct Seen {
    path: Vec<u8>,
    kind: EntryType,
    mode: u32,
    data: Vec<u8>,
    span: std::ops::Range<usize>,
}

/// How reading an archive ended.
#[derive(Debug)]
enum Reading {
    /// Every entry read, up to the end of the archive.
    Complete(Vec<Seen>),
    /// The first problem: `Some(path)` if it is an entry the rewrite must refuse (its
    /// message then names that path), `None` if the archive itself is broken there.
    Refused(Option<String>),
    /// Two GNU long names or two PAX headers before one entry: the crate's reader
    /// refuses them, Go's (the rewrite's reference) uses the last.
    Unmodelled,
}

fn show(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn unsafe_name(path: &[u8]) -> bool {
    path.starts_with(b"/") || path.split(|b| *b == b'/').any(|p| p == b"..")
}

/// Reads a whole (uncompressed) tar the way the specification describes.
fn read_tar(tar: &[u8]) -> Reading {
    let mut archive = tar::Archive::new(tar);
    let Ok(entries) = archive.entries() else {
        return Reading::Refused(None);
    };
    let mut out = Vec::new();
    let mut start = 0usize;
    for entry in entries {
        let mut entry = match entry {
            Ok(entry) => entry,
            Err(e) if e.to_string().contains("describing the same member") => {
                return Reading::Unmodelled
            }
            Err(_) => return Reading::Refused(None),
        };
        let kind = entry.header().entry_type();
        let path = entry.path_bytes().into_owned();
        let mut data = Vec::new();
        // The archive ending inside the data is a broken archive, whatever the entry.
        if entry.read_to_end(&mut data).is_err() || (data.len() as u64) < entry.size() {
            return Reading::Refused(None);
        }
        let end = entry.raw_file_position() as usize + data.len().div_ceil(512) * 512;
        if kind == EntryType::XGlobalHeader {
            // Go applies a global header to no entry, and names it by its path (which
            // Velero checks); GNU sparse records are refused.
            let mut name = path.clone();
            for record in tar::PaxExtensions::new(&data) {
                let Ok(record) = record else {
                    return Reading::Refused(None);
                };
                let key = record.key().unwrap_or("");
                if key.starts_with("GNU.") {
                    let name = entry.header().as_old().name;
                    let name = name.split(|b| *b == 0).next().unwrap_or_default();
                    return Reading::Refused(Some(show(name)));
                }
                if key == "path" {
                    name = record.value_bytes().to_vec();
                }
            }
            if unsafe_name(&name) {
                return Reading::Refused(Some(show(&name)));
            }
            // Travels with the next entry.
            continue;
        }
        let hostile = unsafe_name(&path)
            || !matches!(
                kind,
                EntryType::Regular | EntryType::Continuous | EntryType::Directory
            );
        if hostile {
            return Reading::Refused(Some(show(&path)));
        }
        out.push(Seen {
            path,
            kind,
            mode: entry.header().mode().unwrap_or(0),
            data,
            span: start..end,
        });
        start = end;
    }
    Reading::Complete(out)
}

/// `(group-resource, namespace, name)` of a Velero item path, for generating updates
/// that hit entries the archive holds.
fn item_of_path(path: &str) -> Option<(String, String, String)> {
    let parts: Vec<&str> = path.split('/').collect();
    let (gr, ns, file) = match parts.as_slice() {
        ["resources", gr, "namespaces", ns, file] => (*gr, *ns, *file),
        ["resources", gr, _, "namespaces", ns, file] => (*gr, *ns, *file),
        ["resources", gr, "cluster", file] => (*gr, "", *file),
        ["resources", gr, _, "cluster", file] => (*gr, "", *file),
        _ => return None,
    };
    let name = file.strip_suffix(".json").filter(|n| !n.is_empty())?;
    Some((gr.to_string(), ns.to_string(), name.to_string()))
}

fn item_of_resource(r: &ResourceIdentifier) -> (String, String, String) {
    let gr = if r.group.is_empty() {
        r.resource.clone()
    } else {
        format!("{}.{}", r.resource, r.group)
    };
    (gr, r.namespace.clone(), r.name.clone())
}

/// Entry name → new content: each updated item at its plain path and under
/// `<version>-preferredversion`, the version from its `apiVersion`, as Velero writes it.
fn expected_updates(items: &[UpdatedItem]) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let mut paths = BTreeMap::new();
    for item in items {
        let version = item.object["apiVersion"]
            .as_str()
            .unwrap()
            .rsplit('/')
            .next()
            .unwrap()
            .to_string();
        // Go's json.Marshal escapes HTML characters and line separators; outside strings
        // JSON has none of them, so replacing them in serde_json's output is Go's bytes.
        let content = serde_json::to_string(&item.object)
            .unwrap()
            .replace('<', "\\u003c")
            .replace('>', "\\u003e")
            .replace('&', "\\u0026")
            .replace('\u{2028}', "\\u2028")
            .replace('\u{2029}', "\\u2029")
            .into_bytes();
        let key = item_of_resource(&item.resource);
        for dir in [None, Some(format!("{version}-preferredversion"))] {
            paths.insert(
                plain_path(&key, dir.as_deref()).into_bytes(),
                content.clone(),
            );
        }
    }
    paths
}

fn plain_path((gr, ns, name): &(String, String, String), version_dir: Option<&str>) -> String {
    let mut p = format!("resources/{gr}/");
    if let Some(v) = version_dir {
        p.push_str(v);
        p.push('/');
    }
    if ns.is_empty() {
        p.push_str("cluster/");
    } else {
        p.push_str(&format!("namespaces/{ns}/"));
    }
    p.push_str(name);
    p.push_str(".json");
    p
}

fn gunzip_all(data: &[u8]) -> Result<Vec<u8>, std::io::Error> {
    let mut out = Vec::new();
    MultiGzDecoder::new(data).read_to_end(&mut out).map(|_| out)
}

/// The 512-byte blocks of `tar` that look like headers (their checksum is right).
fn header_blocks(tar: &[u8]) -> Vec<&[u8]> {
    tar.chunks_exact(512)
        .filter(|b| {
            let h = Header::from_byte_slice(b);
            let sum: u32 = b
                .iter()
                .enumerate()
                .map(|(i, b)| {
                    if (148..156).contains(&i) {
                        32
                    } else {
                        u32::from(*b)
                    }
                })
                .sum();
            h.cksum().ok() == Some(sum)
        })
        .collect()
}

/// Typeflags of the header-like blocks.
fn header_kinds(tar: &[u8]) -> BTreeSet<u8> {
    header_blocks(tar).iter().map(|b| b[156]).collect()
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// The refusals the rewrite may make of an archive every entry of which the model
/// reads as harmless: forms that extractors read differently (so the model's one
/// reading is not the only one), each claim checked against the input.
fn ambiguity_is_real(message: &str, tar: &[u8], seen: &[Seen]) -> bool {
    let kinds = header_kinds(tar);
    if message.contains("differs from its header's size") {
        return kinds.contains(&b'x') && contains(tar, b" size=");
    }
    if message.contains("its PAX header:") {
        return kinds.contains(&b'x');
    }
    if message.contains("a directory with") {
        // A directory, or a name (header field, long name, PAX path) ending in '/'.
        return kinds.contains(&b'5')
            || contains(tar, b"/\0")
            || contains(tar, b"/\n")
            || header_blocks(tar).iter().any(|b| {
                let field = b[..100].split(|c| *c == 0).next().unwrap_or_default();
                field.ends_with(b"/")
            });
    }
    if message.contains("is not an octal number") || message.contains("size:") {
        return true;
    }
    if message.contains("has no name") {
        return seen.iter().any(|s| s.path.is_empty())
            || header_blocks(tar).iter().any(|b| b[0] == 0);
    }
    if message.contains("allowed") && message.contains("1048576") {
        return tar.len() > 1024 * 1024;
    }
    if message.contains("a global PAX header between") {
        return kinds.contains(&b'g');
    }
    if message.contains("ends with a header extension") {
        return kinds.iter().any(|k| b"xgLK".contains(k));
    }
    false
}

/// Checks one case; `Err` describes the property that failed.
fn check(case: &Case) -> Result<(), TestCaseError> {
    let (input, tar) = build_input(case);
    let items = updated_items(case);
    let updates = match Updates::new(&items) {
        Ok(u) => u,
        Err(message) => {
            // Invalid updated items are refused by index and field before any reading.
            prop_assert!(message.starts_with("updatedItems["), "{message}");
            let i: usize = message["updatedItems[".len()..]
                .split(']')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(usize::MAX);
            prop_assert!(i < items.len(), "{message}");
            tally(format!("updates refused: {}", shape(&message)));
            return Ok(());
        }
    };
    let expected_items = expected_updates(&items);
    let decompressed = match tar {
        Some(tar) => Ok(tar),
        None => gunzip_all(&input),
    };
    let limit = match (case.limit, &decompressed) {
        (Some(f), Ok(d)) => (d.len() as f64 * f) as u64,
        (Some(f), Err(_)) => (input.len() as f64 * f * 4.0) as u64,
        (None, _) => u64::MAX,
    };

    let mut output = Vec::new();
    let started = Instant::now();
    watch(true);
    let (result, peak) = peak_of(|| rewrite(&input[..], &mut output, &updates, limit));
    watch(false);
    MAX_PEAK.with(|m| m.set(m.get().max(peak)));
    let took = started.elapsed();
    prop_assert!(
        took < Duration::from_secs(20),
        "rewrite took {took:?} for {} input bytes",
        input.len()
    );
    prop_assert!(
        peak <= MEMORY_ALLOWANCE + 3 * output.capacity().max(output.len()),
        "rewrite allocated {peak} bytes at its peak for an output of {} bytes",
        output.len()
    );

    // What the model says, when the compressed stream decodes cleanly. (When it does
    // not, how far the rewrite reads before noticing depends on its buffering; only
    // the general properties are checked then.)
    let model = decompressed
        .as_ref()
        .ok()
        .map(|d| (read_tar(d), d.len() as u64, d));
    match &result {
        Err(e) => {
            let message = e.to_string();
            tally(shape(&message));
            prop_assert!(!message.trim().is_empty(), "an empty error message");
            let Some((reading, total, tar)) = &model else {
                return Ok(());
            };
            let limited = message.contains("exceeds the limit of") && *total > limit;
            match reading {
                Reading::Complete(seen) => {
                    prop_assert!(
                        limited || ambiguity_is_real(&message, tar, seen),
                        "a valid archive ({total} decompressed bytes, limit {limit}) was refused: {message}"
                    );
                }
                Reading::Refused(Some(path)) => {
                    // Cut inside the padding after an extension's data: the model
                    // read the data, the rewrite (like Python) wants whole blocks.
                    let cut = message.contains("truncated") && tar.len() % 512 != 0;
                    let named = cut || message.starts_with(&format!("entry {path}: "));
                    prop_assert!(
                        named || limited || ambiguity_is_real(&message, tar, &[]),
                        "the refusal does not name entry {path:?}: {message}"
                    );
                }
                Reading::Unmodelled => {}
                Reading::Refused(None) => {
                    prop_assert!(
                        message.starts_with("entry ")
                            || [
                                "truncated",
                                "archive",
                                "header",
                                "limit",
                                "checksum",
                                "invalid",
                                "numeric",
                                "corrupt",
                                "end",
                                "block",
                                "EOF",
                                "allowed",
                                "no name"
                            ]
                            .iter()
                            .any(|w| message.contains(w)),
                        "the error says nothing about the archive: {message}"
                    );
                }
            }
        }
        Ok(outcome) => {
            tally(format!(
                "ok (replaced {}, added {})",
                outcome.replaced.min(1),
                outcome.added.min(1)
            ));
            // The output is a complete .tar.gz in one gzip member, every entry harmless.
            let out_tar = gunzip_one(&output)
                .map_err(|e| TestCaseError::fail(format!("the output is not gzip: {e}")))?;
            let written = match read_tar(&out_tar) {
                Reading::Complete(entries) => entries,
                // Copied as they were, the extensions the crate cannot read.
                Reading::Unmodelled => return Ok(()),
                other => {
                    return Err(TestCaseError::fail(format!(
                        "the output is not a clean, harmless tar: {other:?}"
                    )))
                }
            };
            let Some((reading, total, tar)) = &model else {
                return Ok(());
            };
            let seen = match reading {
                Reading::Complete(seen) => seen,
                Reading::Unmodelled => return Ok(()),
                Reading::Refused(why) => {
                    return Err(TestCaseError::fail(format!(
                        "an archive that must be refused ({why:?}) was rewritten"
                    )))
                }
            };
            // What had to be read: the entries and one end-of-archive block.
            let needed = seen
                .last()
                .map_or(0, |s| s.span.end)
                .saturating_add(512)
                .min(*total as usize);
            prop_assert!(
                needed as u64 <= limit,
                "needed {needed} bytes past the limit {limit}"
            );
            let mut present = BTreeSet::new();
            let mut replaced = 0u64;
            let mut out = written.iter();
            for input_entry in seen {
                let got = out.next().ok_or_else(|| {
                    TestCaseError::fail(format!(
                        "entry {} is missing from the output",
                        show(&input_entry.path)
                    ))
                })?;
                let replace = input_entry.kind != EntryType::Directory
                    && !input_entry.path.ends_with(b"/")
                    && expected_items.contains_key(&input_entry.path);
                if replace {
                    prop_assert_eq!(&got.path, &input_entry.path);
                    prop_assert_eq!(&got.data, &expected_items[&input_entry.path]);
                    prop_assert_eq!(got.kind, EntryType::Regular);
                    prop_assert_eq!(got.mode, 0o755, "Velero's mode");
                    present.insert(input_entry.path.clone());
                    replaced += 1;
                } else {
                    prop_assert!(
                        out_tar[got.span.clone()] == tar[input_entry.span.clone()],
                        "entry {} was not copied byte for byte (header extensions included)",
                        show(&input_entry.path)
                    );
                }
            }
            let appended: Vec<(Vec<u8>, Vec<u8>, u32)> = out
                .map(|l| (l.path.clone(), l.data.clone(), l.mode))
                .collect();
            let want: Vec<(Vec<u8>, Vec<u8>, u32)> = expected_items
                .iter()
                .filter(|(k, _)| !present.contains(*k))
                .map(|(k, v)| (k.clone(), v.clone(), 0o755))
                .collect();
            prop_assert_eq!(&appended, &want, "appended entries, in path order");
            prop_assert_eq!(outcome.replaced, replaced);
            prop_assert_eq!(outcome.added, want.len() as u64);
        }
    }
    Ok(())
}

/// Runs `cases` cases from `seed`, printing what they exercised.
fn fuzz(run: &str, cases: u32, seed: u64) {
    println!("fuzz_tarball {run}: {cases} cases, PROPTEST_RNG_SEED={seed}");
    let watched = start_watchdog(seed);
    WATCH.with(|w| *w.borrow_mut() = Some(watched.clone()));
    let config = Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 2000,
        rng_seed: RngSeed::Fixed(seed),
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let started = Instant::now();
    let result = runner.run(&knobs(), |knobs| {
        watched.case.fetch_add(1, Ordering::SeqCst);
        let case = Case::of(&knobs);
        check(&case).map_err(|e| match e {
            TestCaseError::Fail(why) => {
                let mut shown = format!("{case:?}");
                if let Some((cut, _)) = shown.char_indices().nth(8000) {
                    shown.truncate(cut);
                }
                TestCaseError::fail(format!("{why}\nthe case: {shown}"))
            }
            other => other,
        })
    });
    println!(
        "fuzz_tarball {run}: {} cases (shrinking included) in {:?}; peak allocation of one rewrite {} KiB",
        watched.case.load(Ordering::SeqCst),
        started.elapsed(),
        MAX_PEAK.with(Cell::get) / 1024
    );
    let mut seen: Vec<(String, u64)> = OUTCOMES.with(|o| o.borrow().clone()).into_iter().collect();
    seen.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    for (what, n) in seen.iter().take(40) {
        println!("{n:>8}  {what:?}");
    }
    if let Err(e) = result {
        panic!("{e}\n(replay with PROPTEST_RNG_SEED={seed} cargo test -p opmon-agent --test fuzz_tarball {run})");
    }
}

// The cases are split between two tests so they run on two threads.

#[test]
fn rewrite_is_total_bounded_and_faithful_on_random_and_corrupted_archives_1() {
    let cases = common::cases("OPMON_FUZZ_TARBALL_CASES");
    fuzz("_1", cases / 2, common::seed(0));
}

#[test]
fn rewrite_is_total_bounded_and_faithful_on_random_and_corrupted_archives_2() {
    let cases = common::cases("OPMON_FUZZ_TARBALL_CASES");
    fuzz("_2", cases - cases / 2, common::seed(0x5eed_5eed));
}

/// A header extension of exactly the largest size is accepted and copied; one byte
/// more is refused, and the error says what was too large.
#[test]
fn a_header_extension_may_have_1_mib_and_not_a_byte_more() {
    for (size, accepted) in [(1024 * 1024, true), (1024 * 1024 + 1, false)] {
        let mut tar = Vec::new();
        let record = pax_record("comment", &vec![b'c'; size - 16]);
        let record = pax_record("comment", &vec![b'c'; size - 16 - (record.len() - size)]);
        assert_eq!(record.len(), size);
        push_extension(&mut tar, b'x', &record);
        end_with_one_entry(&mut tar);
        let input = gzip(&tar);
        let updates = Updates::new(&[]).unwrap();
        let mut output = Vec::new();
        let result = rewrite(&input[..], &mut output, &updates, u64::MAX);
        if accepted {
            result.unwrap_or_else(|e| panic!("an extension of {size} bytes was refused: {e}"));
            let out = gunzip_one(&output).unwrap();
            assert_eq!(
                out[..512 + size],
                tar[..512 + size],
                "the extension is copied as it was"
            );
        } else {
            let message = result
                .expect_err("an oversized extension was accepted")
                .to_string();
            assert!(
                message.contains(&size.to_string()) && message.contains("larger than"),
                "{message}"
            );
        }
    }
}

/// Ends `tar` with one small Velero entry (`metadata/version`) and the end-of-archive.
fn end_with_one_entry(tar: &mut Vec<u8>) {
    let mut h = Header::new_ustar();
    put(&mut h.as_old_mut().name, b"metadata/version");
    h.set_size(1);
    h.set_mode(0o644);
    h.set_cksum();
    push_entry(tar, &h, b"1");
    tar.extend([0u8; 1024]);
}

/// Many header extensions before one entry, each within the 1 MiB a single one may
/// have: what they may hold in memory together is bounded too, not only each one.
#[test]
fn a_run_of_header_extensions_does_not_accumulate_in_memory() {
    let mut tar = Vec::new();
    for _ in 0..12 {
        let filler = pax_record("comment", &vec![b'c'; 1_000_000]);
        push_extension(&mut tar, b'x', &filler);
    }
    end_with_one_entry(&mut tar);
    let input = gzip(&tar);
    assert!(input.len() < 1024 * 1024, "the input compresses well");
    let updates = Updates::new(&[]).unwrap();
    let mut output = Vec::new();
    let (result, peak) = peak_of(|| rewrite(&input[..], &mut output, &updates, u64::MAX));
    let bound = MEMORY_ALLOWANCE + 3 * output.capacity();
    assert!(
        peak <= bound,
        "{} input bytes ({} decompressed) made the rewrite allocate {peak} bytes (bound {bound}); result {:?}",
        input.len(),
        tar.len(),
        result.map_err(|e| e.to_string())
    );
}

/// Empty extensions cost their headers: 100,000 zero-size GNU long-link headers before
/// one entry (51 MB of tar, a few hundred KB gzipped) are refused, not held.
#[test]
fn a_run_of_empty_header_extensions_is_bounded_by_its_headers() {
    let mut tar = Vec::new();
    for _ in 0..100_000 {
        push_extension(&mut tar, b'K', b"");
    }
    end_with_one_entry(&mut tar);
    let input = gzip(&tar);
    let updates = Updates::new(&[]).unwrap();
    let mut output = Vec::new();
    let (result, peak) = peak_of(|| rewrite(&input[..], &mut output, &updates, u64::MAX));
    let error = result.map(|_| ()).map_err(|e| e.to_string());
    assert_eq!(
        error,
        Err("the header extensions before one entry exceed the 2099200 bytes allowed".to_string())
    );
    let bound = MEMORY_ALLOWANCE + 3 * output.capacity();
    assert!(
        peak <= bound,
        "the rewrite allocated {peak} bytes (bound {bound})"
    );
}

/// The seeds of issue 11.4, one by one around a harmless Velero entry: each is refused
/// (the property check agrees with the model), and none is refused for a reason the
/// model does not see.
#[test]
fn the_hostile_archives_of_issue_11_4_are_refused() {
    let entry = EntrySpec {
        path: b"resources/configmaps/namespaces/app/cm.json".to_vec(),
        form: NameForm::Plain,
        format: Format::Ustar,
        kind: b'0',
        link: Vec::new(),
        data: b"{}".to_vec(),
        mode: 0o644,
        mtime: 1_700_000_000,
    };
    for trick in 0..5 {
        let case = Case {
            pieces: vec![Piece::Trick(trick, entry.clone())],
            end_blocks: 2,
            members: 1,
            level: 1,
            mutation: Mutation::None,
            updates: Vec::new(),
            limit: None,
        };
        check(&case).unwrap_or_else(|e| panic!("trick {trick}: {e}"));
        let (input, _) = build_input(&case);
        let updates = Updates::new(&[]).unwrap();
        let err = rewrite(&input[..], Vec::new(), &updates, u64::MAX)
            .map(|_| ())
            .expect_err("a hostile archive was rewritten");
        assert!(
            err.to_string().starts_with("entry "),
            "trick {trick}: {err}"
        );
    }
}

/// Builds `tests/go/velero-tar` (Go's standard library only: what Velero reads
/// tarballs with) into `dir`.
fn velero_tar(dir: &std::path::Path) -> std::path::PathBuf {
    let source =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/go/velero-tar/main.go");
    let binary = dir.join("velero-tar");
    let built = std::process::Command::new("go")
        .arg("build")
        .arg("-o")
        .arg(&binary)
        .arg(&source)
        .env("GO111MODULE", "off")
        .env("GOTOOLCHAIN", "local")
        .current_dir(dir)
        .output()
        .expect("running go (Go's reader is this test's oracle)");
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    binary
}

/// The names and typeflags Go's `archive/tar` reads in a `.tar.gz` of one member, or
/// its error.
fn go_reads(
    binary: &std::path::Path,
    tar_gz: &std::path::Path,
) -> Result<Vec<(String, String)>, String> {
    let listed = std::process::Command::new(binary)
        .arg("list")
        .arg(tar_gz)
        .output()
        .expect("running velero-tar");
    if !listed.status.success() {
        return Err(String::from_utf8_lossy(&listed.stderr).into_owned());
    }
    let text = String::from_utf8(listed.stdout).map_err(|e| e.to_string())?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            let field = |k: &str| v[k].as_str().unwrap().to_string();
            (field("name"), field("typeflag"))
        })
        .collect())
}

/// A second, different oracle on a fixed sample: Go's `archive/tar`, as Velero reads a
/// finalized tarball, reads each input the rewrite accepted and its output. The output
/// must read in Go as harmless entries only (files, directories, global headers),
/// and as the input's entries, by name and in order, then the appended items: the
/// agent named each entry as Velero will.
#[test]
fn go_reads_what_the_rewrite_accepted_as_the_input_s_entries_on_a_fixed_sample() {
    let dir = tempfile::tempdir().unwrap();
    let go = velero_tar(dir.path());
    let g = &mut Gen(0x7079_7468_6f6e);
    let mut accepted = 0;
    for i in 0..400 {
        let knobs = Knobs {
            pieces: (0..g.below(6))
                .map(|_| (g.next() as u8, g.next()))
                .collect(),
            end_blocks: g.next() as u8,
            members: g.next() as u8,
            level: g.next() as u8,
            // No corruption of the gzip stream: Go reads the decompressed tar.
            mutation: ((g.next() % 15) as u8, g.next()),
            updates: (0..g.below(4)).map(|_| g.next()).collect(),
            limit: (0, 0),
        };
        let case = Case::of(&knobs);
        let (input, tar) = build_input(&case);
        let Some(tar) = tar else { continue };
        let Ok(updates) = Updates::new(&updated_items(&case)) else {
            continue;
        };
        let mut output = Vec::new();
        let Ok(outcome) = rewrite(&input[..], &mut output, &updates, u64::MAX) else {
            continue;
        };
        accepted += 1;
        let (inp, out) = (
            dir.path().join(format!("{i}.in.tar.gz")),
            dir.path().join(format!("{i}.out.tar.gz")),
        );
        std::fs::write(&inp, gzip(&tar)).unwrap();
        std::fs::write(&out, &output).unwrap();
        let written = go_reads(&go, &out)
            .unwrap_or_else(|e| panic!("case {i}: Go cannot read the output: {e}"));
        for (name, kind) in &written {
            assert!(
                !unsafe_name(name.as_bytes()) && matches!(kind.as_str(), "0" | "5" | "7" | "g"),
                "case {i}: Go reads the output as holding {name:?} of type {kind:?}"
            );
        }
        // An input Go fails on past its end of archive (the rewrite stops there).
        let Ok(read) = go_reads(&go, &inp) else {
            continue;
        };
        let added = outcome.added as usize;
        assert_eq!(
            written.len(),
            read.len() + added,
            "case {i}: Go reads {read:?} in and {written:?} out"
        );
        assert_eq!(written[..read.len()], read[..], "case {i}");
    }
    assert!(accepted > 50, "only {accepted} of the sample were accepted");
}
