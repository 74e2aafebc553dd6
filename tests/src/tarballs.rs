//! Tarballs for the finalize tests, built here byte by byte where the shape matters.

use std::io::Write;
use std::path::Path;

use flate2::write::GzEncoder;
use flate2::Compression;

/// A ustar header block for a regular file `name` of `size` bytes.
pub fn file_header(name: &str, size: u64) -> [u8; 512] {
    let mut h = tar::Header::new_ustar();
    h.set_path(name).expect("a short relative name");
    h.set_size(size);
    h.set_mode(0o644);
    h.set_mtime(1_700_000_000);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_cksum();
    *h.as_bytes()
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = GzEncoder::new(Vec::new(), Compression::new(6));
    e.write_all(data).expect("in memory");
    e.finish().expect("in memory")
}

/// Writes a `.tar.gz` holding `metadata/version` and one entry of `mib` MiB of zeros
/// (a multiple of 16): about 1/1000 of that on disk (gzip members of 16 MiB of zeros
/// each, written again and again), seconds to minutes of work to rewrite. Finalize
/// tests use it to have a rewrite that is still running while they act.
pub fn write_zeros_tarball(path: &Path, mib: u64) {
    const CHUNK: u64 = 16 << 20;
    let size = mib << 20;
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).expect("creating"));
    let mut head = file_header("metadata/version", 6).to_vec();
    head.extend_from_slice(b"1.1.0\n");
    head.resize(1024, 0);
    head.extend_from_slice(&file_header(
        "resources/configmaps/namespaces/app/big.json",
        size,
    ));
    out.write_all(&gzip(&head)).expect("writing");
    let zeros = gzip(&vec![0u8; CHUNK as usize]);
    for _ in 0..size / CHUNK {
        out.write_all(&zeros).expect("writing");
    }
    out.write_all(&gzip(&[0u8; 1024])).expect("writing");
    out.flush().expect("writing");
}

/// Temporary files a finalize leaves while it writes, in `dir`.
pub fn temporaries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(".opmon-") && n.ends_with(".tmp"))
                .collect()
        })
        .unwrap_or_default()
}
