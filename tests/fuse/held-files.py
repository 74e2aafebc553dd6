#!/usr/bin/python3
"""A FUSE file system of files whose reads wait until the test releases them: a disk
that is slow for exactly as long as the test wants.

Usage: held-files.py SOURCE COUNT MOUNTPOINT
Serves held-0.tar.gz .. held-(COUNT-1).tar.gz, each with SOURCE's bytes. Prints `mounted` once
mounted, then `held NAME` the first time a read of NAME waits. A line `release` on
stdin (or its end) lets every read through, then and after. Unmounting ends it.
"""
import errno
import os
import stat
import sys
import threading

import fuse

fuse.fuse_python_api = (0, 2)

source, count, mountpoint = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(source, "rb") as f:
    data = f.read()
names = {f"/held-{n}.tar.gz" for n in range(count)}
released = threading.Event()
reported = set()
lock = threading.Lock()
said = threading.Lock()


def say(line):
    # One line at a time: print writes the text and its newline apart, and reads of
    # several files come on threads of their own.
    with said:
        print(line, flush=True)


def wait_for_release():
    sys.stdin.readline()
    released.set()


class Stat(fuse.Stat):
    def __init__(self, mode, nlink, size):
        super().__init__()
        self.st_mode, self.st_nlink, self.st_size = mode, nlink, size


class HeldFiles(fuse.Fuse):
    def fsinit(self):
        threading.Thread(target=wait_for_release, daemon=True).start()
        say("mounted")

    def getattr(self, path):
        if path == "/":
            return Stat(stat.S_IFDIR | 0o755, 2, 0)
        if path in names:
            return Stat(stat.S_IFREG | 0o644, 1, len(data))
        return -errno.ENOENT

    def readdir(self, path, offset):
        for name in [".", ".."] + sorted(n[1:] for n in names):
            yield fuse.Direntry(name)

    def open(self, path, flags):
        if path not in names:
            return -errno.ENOENT
        if flags & (os.O_WRONLY | os.O_RDWR):
            return -errno.EACCES
        return 0

    def read(self, path, size, offset):
        if not released.is_set():
            with lock:
                first = path not in reported
                reported.add(path)
            if first:
                say(f"held {path[1:]}")
            released.wait()
        return data[offset:offset + size]


server = HeldFiles(usage=__doc__)
server.fuse_args.mountpoint = mountpoint
server.fuse_args.setmod("foreground")
server.main()
