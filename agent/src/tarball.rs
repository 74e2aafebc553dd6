//! Rewriting a Velero backup tarball at finalize: every entry of an updated item is
//! replaced by the item's new content, items the tarball lacks are appended, and every
//! other byte of every other entry is copied as it was, in order.
//!
//! The archive is streamed (gzip → tar → tar → gzip), never held: memory stays bounded
//! whatever its size. Entries are read raw, so GNU long-name and PAX headers travel with
//! the entry they describe and are copied verbatim. Anything that could escape or
//! mislead an extractor (absolute paths, `..`, links, devices) fails the rewrite, as do
//! a truncated archive and a decompressed size past the configured limit.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Read, Write};

use flate2::read::MultiGzDecoder;
use flate2::write::GzEncoder;
use flate2::Compression;
use opmon_client::{ResourceIdentifier, UpdatedItem};
use tar::{EntryType, Header};

/// Largest GNU long-name or PAX header accepted, in bytes.
const MAX_EXTENSION: u64 = 1024 * 1024;

/// An item as the tarball's paths name it: `<resource>.<group>`, namespace (empty for
/// cluster-scoped items) and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ItemKey {
    pub group_resource: String,
    pub namespace: String,
    pub name: String,
}

impl ItemKey {
    pub fn of(r: &ResourceIdentifier) -> ItemKey {
        let group_resource = if r.group.is_empty() {
            r.resource.clone()
        } else {
            format!("{}.{}", r.resource, r.group)
        };
        ItemKey {
            group_resource,
            namespace: r.namespace.clone(),
            name: r.name.clone(),
        }
    }

    /// The item an entry path holds: `resources/<gr>/[<version dir>/]namespaces/<ns>/<name>.json`
    /// or `resources/<gr>/[<version dir>/]cluster/<name>.json`; a leading `./` is allowed.
    pub fn from_path(path: &str) -> Option<ItemKey> {
        let path = path.strip_prefix("./").unwrap_or(path);
        let parts: Vec<&str> = path.split('/').collect();
        let key = |gr: &str, ns: &str, file: &str| {
            let name = file.strip_suffix(".json")?;
            (!name.is_empty()).then(|| ItemKey {
                group_resource: gr.to_string(),
                namespace: ns.to_string(),
                name: name.to_string(),
            })
        };
        match parts.as_slice() {
            ["resources", gr, "namespaces", ns, file] => key(gr, ns, file),
            ["resources", gr, _, "namespaces", ns, file] => key(gr, ns, file),
            ["resources", gr, "cluster", file] => key(gr, "", file),
            ["resources", gr, _, "cluster", file] => key(gr, "", file),
            _ => None,
        }
    }

    /// The path of the item under `version_dir` (or the plain path without one).
    fn path(&self, version_dir: Option<&str>) -> String {
        let mut path = format!("resources/{}/", self.group_resource);
        if let Some(dir) = version_dir {
            path.push_str(dir);
            path.push('/');
        }
        if self.namespace.is_empty() {
            path.push_str("cluster/");
        } else {
            path.push_str("namespaces/");
            path.push_str(&self.namespace);
            path.push('/');
        }
        path.push_str(&self.name);
        path.push_str(".json");
        path
    }
}

/// The new content of each updated item.
pub struct Updates {
    items: BTreeMap<ItemKey, Update>,
}

struct Update {
    content: Vec<u8>,
    /// `v1` from `apiVersion: v1` or `snapshot.storage.k8s.io/v1`.
    version: String,
}

impl Updates {
    /// Checks and encodes the updated items; errors name the item's index and field.
    pub fn new(items: &[UpdatedItem]) -> Result<Updates, String> {
        let mut map = BTreeMap::new();
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
            let content = serde_json::to_vec(&item.object)
                .map_err(|e| format!("updatedItems[{i}].object: {e}"))?;
            let update = Update {
                content,
                version: version.to_string(),
            };
            if map.insert(ItemKey::of(&item.resource), update).is_some() {
                return Err(format!(
                    "updatedItems[{i}].resource: the same item is listed twice"
                ));
            }
        }
        Ok(Updates { items: map })
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// What a rewrite did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Entries whose content was replaced.
    pub replaced: u64,
    /// Entries appended for items the tarball lacked (two per item: plain and
    /// preferred-version path).
    pub added: u64,
}

/// Why a rewrite failed; the message names the entry when there is one.
#[derive(Debug, thiserror::Error)]
pub enum RewriteError {
    #[error("entry {entry}: {reason}")]
    Entry { entry: String, reason: String },
    #[error("{0}")]
    Archive(String),
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
                "the decompressed archive exceeds the limit of {} bytes",
                self.limit
            )));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// Reads exactly `left` bytes of an entry, failing if the archive ends sooner (a header
/// whose size exceeds what follows).
struct Exact<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            return Ok(0);
        }
        let want = buf.len().min(self.left.min(usize::MAX as u64) as usize);
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "the archive ends {} bytes before the entry's declared size",
                    self.left
                ),
            ));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// A header extension (GNU long name or PAX) waiting for the entry it describes.
struct Extension {
    header: Header,
    data: Vec<u8>,
}

fn reject(entry: &str, reason: impl Into<String>) -> RewriteError {
    RewriteError::Entry {
        entry: entry.to_string(),
        reason: reason.into(),
    }
}

/// Describes an I/O failure while reading at `entry` (or before the first one).
fn read_error(entry: Option<&str>, e: io::Error) -> RewriteError {
    let reason = match e.kind() {
        io::ErrorKind::UnexpectedEof => format!("the archive is truncated ({e})"),
        _ => e.to_string(),
    };
    match entry {
        Some(entry) => reject(entry, reason),
        None => RewriteError::Archive(reason),
    }
}

/// The path an entry stands for: the extensions' long name or PAX path if any, else the
/// header's own.
fn entry_path(header: &Header, extensions: &[Extension]) -> String {
    for ext in extensions.iter().rev() {
        match ext.header.entry_type() {
            EntryType::GNULongName => {
                let name = ext.data.split(|b| *b == 0).next().unwrap_or_default();
                return String::from_utf8_lossy(name).into_owned();
            }
            EntryType::XHeader => {
                for record in tar::PaxExtensions::new(&ext.data).flatten() {
                    if record.key() == Ok("path") {
                        return String::from_utf8_lossy(record.value_bytes()).into_owned();
                    }
                }
            }
            _ => {}
        }
    }
    String::from_utf8_lossy(&header.path_bytes()).into_owned()
}

/// Refuses paths an extractor could be tricked by.
fn check_path(path: &str) -> Result<(), RewriteError> {
    if path.starts_with('/') {
        return Err(reject(path, "absolute paths are not allowed"));
    }
    if path.split('/').any(|part| part == "..") {
        return Err(reject(path, "paths with '..' are not allowed"));
    }
    Ok(())
}

/// Refuses entry types other than files and directories.
fn check_type(path: &str, kind: EntryType) -> Result<(), RewriteError> {
    let refused = match kind {
        EntryType::Regular | EntryType::Continuous | EntryType::Directory => return Ok(()),
        EntryType::Symlink => "symbolic links are not allowed",
        EntryType::Link => "hard links are not allowed",
        EntryType::Char => "character devices are not allowed",
        EntryType::Block => "block devices are not allowed",
        EntryType::Fifo => "FIFOs are not allowed",
        _ => "this entry type is not allowed",
    };
    Err(reject(path, refused))
}

/// Rewrites the gzipped tarball `input` into `output` (gzip level 6). `output` gets
/// nothing useful on error; the caller discards it.
pub fn rewrite<R: Read, W: Write>(
    input: R,
    output: W,
    updates: &Updates,
    max_decompressed: u64,
) -> Result<Outcome, RewriteError> {
    let source = Bounded {
        inner: MultiGzDecoder::new(io::BufReader::with_capacity(256 * 1024, input)),
        left: max_decompressed,
        limit: max_decompressed,
    };
    let mut archive = tar::Archive::new(io::BufReader::with_capacity(256 * 1024, source));
    let mut builder = tar::Builder::new(GzEncoder::new(output, Compression::new(6)));
    let write_error = |e: io::Error| RewriteError::Archive(format!("writing the output: {e}"));

    let mut outcome = Outcome::default();
    let mut present = BTreeSet::new();
    let mut extensions: Vec<Extension> = Vec::new();
    let mut last: Option<String> = None;
    let entries = archive
        .entries()
        .map_err(|e| read_error(None, e))?
        .raw(true);
    for entry in entries {
        let mut entry = entry.map_err(|e| match &last {
            Some(path) => read_error(Some(&format!("after {path}")), e),
            None => read_error(None, e),
        })?;
        let header = entry.header().clone();
        let kind = header.entry_type();
        if matches!(
            kind,
            EntryType::GNULongName
                | EntryType::GNULongLink
                | EntryType::XHeader
                | EntryType::XGlobalHeader
        ) {
            let size = header.entry_size().unwrap_or(u64::MAX);
            if size > MAX_EXTENSION {
                return Err(RewriteError::Archive(format!(
                    "a {kind:?} header of {size} bytes is larger than the {MAX_EXTENSION} allowed"
                )));
            }
            // Bound them together too: a run of extensions before one entry is held
            // in memory until that entry comes.
            let pending: u64 = extensions.iter().map(|e| e.data.len() as u64).sum();
            if pending + size > MAX_EXTENSION {
                return Err(RewriteError::Archive(format!(
                    "the header extensions before one entry exceed the {MAX_EXTENSION} bytes allowed"
                )));
            }
            let mut data = Vec::with_capacity(size as usize);
            Exact {
                inner: &mut entry,
                left: size,
            }
            .read_to_end(&mut data)
            .map_err(|e| read_error(Some("(header extension)"), e))?;
            extensions.push(Extension { header, data });
            continue;
        }
        let path = entry_path(&header, &extensions);
        check_path(&path)?;
        check_type(&path, kind)?;
        let size = header
            .entry_size()
            .map_err(|e| reject(&path, format!("unreadable size: {e}")))?;
        let key = (kind != EntryType::Directory)
            .then(|| ItemKey::from_path(&path))
            .flatten()
            .filter(|k| updates.items.contains_key(k));
        match key {
            Some(key) => {
                let update = &updates.items[&key];
                // Consume the old content so a truncated archive is still noticed.
                io::copy(
                    &mut Exact {
                        inner: &mut entry,
                        left: size,
                    },
                    &mut io::sink(),
                )
                .map_err(|e| read_error(Some(&path), e))?;
                let mut new_header = header.clone();
                new_header.set_size(update.content.len() as u64);
                builder
                    .append_data(&mut new_header, &path, update.content.as_slice())
                    .map_err(write_error)?;
                present.insert(key);
                outcome.replaced += 1;
            }
            None => {
                for ext in extensions.iter() {
                    builder
                        .append(&ext.header, ext.data.as_slice())
                        .map_err(write_error)?;
                }
                let mut data = Exact {
                    inner: &mut entry,
                    left: size,
                };
                builder.append(&header, &mut data).map_err(|e| {
                    if e.kind() == io::ErrorKind::UnexpectedEof || data.left > 0 {
                        read_error(Some(&path), e)
                    } else {
                        write_error(e)
                    }
                })?;
            }
        }
        extensions.clear();
        last = Some(path);
    }
    let now = time::OffsetDateTime::now_utc().unix_timestamp().max(0) as u64;
    for (key, update) in &updates.items {
        if present.contains(key) {
            continue;
        }
        let preferred = format!("{}-preferredversion", update.version);
        for path in [key.path(None), key.path(Some(&preferred))] {
            let mut header = Header::new_gnu();
            header.set_entry_type(EntryType::Regular);
            header.set_mode(0o755);
            header.set_mtime(now);
            header.set_size(update.content.len() as u64);
            builder
                .append_data(&mut header, &path, update.content.as_slice())
                .map_err(write_error)?;
            outcome.added += 1;
        }
    }
    let encoder = builder.into_inner().map_err(write_error)?;
    encoder.finish().map_err(write_error)?;
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::read::GzDecoder;
    use serde_json::json;

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

    /// A tar with one entry whose raw name and type are set by hand, as an attacker
    /// would write it (the tar crate refuses such names through its normal API).
    fn hostile_tar(name: &str, kind: EntryType, link: &str) -> Vec<u8> {
        let mut h = Header::new_old();
        h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        h.set_entry_type(kind);
        h.set_mode(0o644);
        h.set_size(0);
        h.set_cksum();
        let mut b = tar::Builder::new(Vec::new());
        b.append(&h, io::empty()).unwrap();
        b.into_inner().unwrap()
    }

    /// `(path, content)` of every entry, read back.
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

    fn pvc_update(name: &str, object: serde_json::Value) -> UpdatedItem {
        UpdatedItem {
            resource: ResourceIdentifier {
                group: String::new(),
                resource: "persistentvolumeclaims".into(),
                namespace: "ns".into(),
                name: name.into(),
            },
            object,
        }
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

    #[test]
    fn item_paths_are_recognised_in_every_version_directory() {
        let key = |gr: &str, ns: &str, name: &str| ItemKey {
            group_resource: gr.into(),
            namespace: ns.into(),
            name: name.into(),
        };
        let cases = [
            (
                "resources/pods/namespaces/ns/p.json",
                Some(key("pods", "ns", "p")),
            ),
            (
                "./resources/pods/v1-preferredversion/namespaces/ns/p.json",
                Some(key("pods", "ns", "p")),
            ),
            (
                "resources/pods/v2beta1/namespaces/ns/p.json",
                Some(key("pods", "ns", "p")),
            ),
            (
                "resources/persistentvolumes/cluster/pv.json",
                Some(key("persistentvolumes", "", "pv")),
            ),
            (
                "resources/persistentvolumes/v1-preferredversion/cluster/pv.json",
                Some(key("persistentvolumes", "", "pv")),
            ),
            ("resources/pods/namespaces/ns/p.yaml", None),
            ("metadata/version", None),
            ("resources/pods/namespaces/ns/", None),
        ];
        for (path, want) in cases {
            assert_eq!(ItemKey::from_path(path), want, "{path}");
        }
        let vsb = ResourceIdentifier {
            group: "velero.io".into(),
            resource: "volumesnapshotbackups".into(),
            namespace: "app".into(),
            name: "vsb-1".into(),
        };
        assert_eq!(
            ItemKey::of(&vsb).path(Some("v1-preferredversion")),
            "resources/volumesnapshotbackups.velero.io/v1-preferredversion/namespaces/app/vsb-1.json"
        );
    }

    #[test]
    fn updated_items_replace_every_version_and_absent_ones_are_appended() {
        let input = gz(&tar_of(&[
            ("metadata/version", b"1"),
            (
                "resources/persistentvolumeclaims/namespaces/ns/data.json",
                b"{\"old\":1}",
            ),
            (
                "resources/configmaps/namespaces/ns/cm.json",
                b"{\"keep\":true}",
            ),
            (
                "resources/persistentvolumeclaims/v1-preferredversion/namespaces/ns/data.json",
                b"{\"old\":2}",
            ),
        ]));
        let new = json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "status": {"phase": "Bound"}});
        let extra = json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "new"}});
        let (outcome, out) = run(
            &input,
            &[
                pvc_update("data", new.clone()),
                pvc_update("new", extra.clone()),
            ],
            u64::MAX,
        )
        .unwrap();
        assert_eq!(
            outcome,
            Outcome {
                replaced: 2,
                added: 2
            }
        );
        let got = entries(&out);
        let paths: Vec<&str> = got.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(
            paths,
            [
                "metadata/version",
                "resources/persistentvolumeclaims/namespaces/ns/data.json",
                "resources/configmaps/namespaces/ns/cm.json",
                "resources/persistentvolumeclaims/v1-preferredversion/namespaces/ns/data.json",
                "resources/persistentvolumeclaims/namespaces/ns/new.json",
                "resources/persistentvolumeclaims/v1-preferredversion/namespaces/ns/new.json",
            ]
        );
        let new_bytes = serde_json::to_vec(&new).unwrap();
        assert_eq!(got[1].1, new_bytes);
        assert_eq!(got[3].1, new_bytes);
        assert_eq!(got[2].1, b"{\"keep\":true}");
        assert_eq!(got[4].1, serde_json::to_vec(&extra).unwrap());
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
        assert_eq!(outcome.replaced, 1);
        let rewritten = gunzip(&out);
        // Everything before the replaced entry, long-name header included, is identical.
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
    fn pax_path_records_name_the_entry() {
        // A PAX header carrying the path, as Go's archive/tar writes long names.
        let path = format!(
            "resources/persistentvolumeclaims/namespaces/{}/data.json",
            "p".repeat(90)
        );
        let record_body = format!(" path={path}\n");
        let mut len = record_body.len() + 3;
        if format!("{len}{record_body}").len() != len {
            len += 1;
        }
        let record = format!("{len}{record_body}");
        assert_eq!(record.len(), len);
        let mut pax = Header::new_ustar();
        pax.set_entry_type(EntryType::XHeader);
        pax.set_path("PaxHeaders/data.json").unwrap();
        pax.set_size(record.len() as u64);
        pax.set_cksum();
        let mut file = Header::new_ustar();
        file.set_path("truncated-name.json").unwrap();
        file.set_size(2);
        file.set_mode(0o644);
        file.set_cksum();
        let mut b = tar::Builder::new(Vec::new());
        b.append(&pax, record.as_bytes()).unwrap();
        b.append(&file, &b"{}"[..]).unwrap();
        let input = gz(&b.into_inner().unwrap());
        // The namespace in the path is 90 characters, longer than a DNS label, so the
        // update is keyed directly rather than through validation.
        let key = ItemKey::from_path(&path).unwrap();
        let updates = Updates {
            items: BTreeMap::from([(
                key,
                Update {
                    content: b"{\"x\":1}".to_vec(),
                    version: "v1".into(),
                },
            )]),
        };
        let mut out = Vec::new();
        let outcome = rewrite(&input[..], &mut out, &updates, u64::MAX).unwrap();
        assert_eq!(
            outcome,
            Outcome {
                replaced: 1,
                added: 0
            }
        );
        let got = entries(&out);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0], (path, b"{\"x\":1}".to_vec()));
    }

    #[test]
    fn hostile_entries_are_refused_naming_the_entry_and_the_reason() {
        let cases = [
            (
                hostile_tar("/etc/passwd", EntryType::Regular, ""),
                "entry /etc/passwd: absolute paths are not allowed",
            ),
            (
                hostile_tar("resources/../../x.json", EntryType::Regular, ""),
                "entry resources/../../x.json: paths with '..' are not allowed",
            ),
            (
                hostile_tar("resources/link", EntryType::Symlink, "/etc/shadow"),
                "entry resources/link: symbolic links are not allowed",
            ),
            (
                hostile_tar("resources/hard", EntryType::Link, "metadata/version"),
                "entry resources/hard: hard links are not allowed",
            ),
            (
                hostile_tar("dev/tty", EntryType::Char, ""),
                "entry dev/tty: character devices are not allowed",
            ),
            (
                hostile_tar("dev/sda", EntryType::Block, ""),
                "entry dev/sda: block devices are not allowed",
            ),
            (
                hostile_tar("pipe", EntryType::Fifo, ""),
                "entry pipe: FIFOs are not allowed",
            ),
        ];
        for (tar, message) in cases {
            let err = run(&gz(&tar), &[], u64::MAX).unwrap_err();
            assert_eq!(err.to_string(), message);
        }
    }

    #[test]
    fn an_entry_larger_than_what_follows_is_refused() {
        let mut tar = tar_of(&[
            ("metadata/version", b"1"),
            ("resources/pods/namespaces/ns/big.json", &[b'x'; 5000]),
        ]);
        tar.truncate(512 * 2 + 512 + 1024); // header of big.json, then 1 KiB of its 5000 bytes
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
    }
}
