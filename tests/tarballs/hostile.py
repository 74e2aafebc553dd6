#!/usr/bin/env python3
"""Writes backup tarballs that look harmless to a checker reading them one way and are
hostile to an extractor reading them another (issue 11.4), into the directory given.

Each is a gzipped tar holding a harmless `metadata/version` and Velero-layout entry, plus
the trick. Python's tarfile writes what it can (PAX records, global headers, GNU long
names); the rest is spliced by hand from tarfile's own blocks. For every archive, the
file `<name>.expect` holds the name the hostile entry has for Python's tarfile, which an
unfiltered `extractall` would write outside its target.

Usage: hostile.py OUTDIR  (prints the archive names, one a line)
"""
import io
import gzip
import sys
import tarfile

BLOCK = 512


def member(name, data=b"", **kw):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = 1_700_000_000
    for k, v in kw.items():
        setattr(info, k, v)
    return info, data


def tar_bytes(members, fmt=tarfile.PAX_FORMAT, pax_headers=None, end=True):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, pax_headers=pax_headers or {}) as t:
        for info, data in members:
            t.addfile(info, io.BytesIO(data) if data else None)
    raw = buf.getvalue()
    if not end:
        raw = strip_end(raw)
    return raw


def strip_end(raw):
    """The archive without its end-of-archive zero blocks (and record padding)."""
    end = len(raw)
    while end >= BLOCK and raw[end - BLOCK:end] == bytes(BLOCK):
        end -= BLOCK
    return raw[:end]


def rechecksum(block):
    b = bytearray(block)
    b[148:156] = b" " * 8
    b[148:156] = b"%06o\0 " % sum(b)
    return bytes(b)


def set_size(block, size):
    b = bytearray(block)
    b[124:136] = b"%011o\0" % size
    return rechecksum(b)


HARMLESS = [member("metadata/version", b"1.1.0\n")]
SHADOW_LINK = member("resources/shadow.json", type=tarfile.SYMTYPE, linkname="/etc/shadow")
ESCAPE = "../../escape.json"


def pax_size_hides_headers():
    # The x header says size=0; the ustar header (what a checker skipping by the header
    # size reads) says the data holds 2 blocks more: an extractor honouring PAX size
    # reads a symbolic link and a `..` file from inside that "data".
    hidden = tar_bytes([SHADOW_LINK, member(ESCAPE, b"{}")], end=False)
    cover = member("resources/configmaps/namespaces/app/cover.json", hidden,
                   pax_headers={"size": "0"})
    return tar_bytes(HARMLESS + [cover]), ESCAPE


def gnu_long_name_then_pax_path():
    # An `L` long name (read by Go and Python) followed by an `x` path (read by a
    # checker taking the last extension, and by GNU tar).
    long_name = "../../" + "d" * 100 + "/escape.json"
    gnu = strip_end(tar_bytes([member(long_name, b"{}")], fmt=tarfile.GNU_FORMAT))
    pax = strip_end(tar_bytes(
        [member("resources/configmaps/namespaces/app/ok.json", b"{}",
                pax_headers={"path": "resources/configmaps/namespaces/app/ok.json"})]))
    l_blocks = gnu[:BLOCK * (1 + (len(long_name) + 1 + BLOCK - 1) // BLOCK)]
    x_blocks = pax[:BLOCK * 2]
    body = l_blocks + x_blocks + pax[BLOCK * 2:]
    return strip_end(tar_bytes(HARMLESS)) + body + bytes(2 * BLOCK), long_name


def pax_gnu_sparse_name():
    # Python's tarfile takes GNU.sparse.name as the entry's name whatever the entry;
    # Go only for sparse files; a checker reading `path` sees the header's name.
    m = member("resources/configmaps/namespaces/app/ok.json", b"{}",
               pax_headers={"GNU.sparse.name": ESCAPE})
    return tar_bytes(HARMLESS + [m]), ESCAPE


def global_pax_path():
    # A global header's path: Python applies it to every later member that has a PAX
    # header of its own, GNU tar to every later member, Go to none.
    m = member("resources/configmaps/namespaces/app/ok.json", b"{}",
               pax_headers={"comment": "mine"})
    return tar_bytes(HARMLESS + [m], pax_headers={"path": ESCAPE}), ESCAPE


def directory_with_data():
    # A directory entry whose size says one block of data follows: Go and Python read
    # directories as having none, so that "data" is their next header.
    hidden = tar_bytes([member(ESCAPE, b"{}")], fmt=tarfile.USTAR_FORMAT, end=False)
    d = tar_bytes([member("resources/", type=tarfile.DIRTYPE)], fmt=tarfile.USTAR_FORMAT,
                  end=False)
    d = set_size(d[:BLOCK], len(hidden))
    return strip_end(tar_bytes(HARMLESS)) + d + hidden + bytes(2 * BLOCK), ESCAPE


ARCHIVES = {
    "pax-size-hides-headers": pax_size_hides_headers,
    "gnu-long-name-then-pax-path": gnu_long_name_then_pax_path,
    "pax-gnu-sparse-name": pax_gnu_sparse_name,
    "global-pax-path": global_pax_path,
    "directory-with-data": directory_with_data,
}


def main():
    out = sys.argv[1]
    for name, build in ARCHIVES.items():
        raw, expect = build()
        with open(f"{out}/{name}.tar.gz", "wb") as f:
            f.write(gzip.compress(raw, mtime=0))
        with open(f"{out}/{name}.expect", "w") as f:
            f.write(expect)
        # Python itself must see the hostile name, or the archive proves nothing.
        with tarfile.open(f"{out}/{name}.tar.gz") as t:
            names = t.getnames()
        assert expect in names, (name, names)
        print(name)


if __name__ == "__main__":
    main()
