"""A FUSE mount whose checkpoint reads hang, as Google Drive's do when it stops answering (tests only).

    python tests/hangfs.py SOURCE MOUNTPOINT STALL_FLAG [WRITE_BYTES_PER_S]

SOURCE is served at MOUNTPOINT (a loopback through the kernel's FUSE, with mfusepy). While the file STALL_FLAG
exists, opening a file under checkpoints/ for reading blocks in the kernel, as on a dead Drive mount: the reader
waits until the flag is removed, then reads the real bytes (until then its process cannot even exit, as on Drive).
Everything else (listing, writes, the lease file) answers; given WRITE_BYTES_PER_S, writes go at that rate (a slow
Drive that keeps going). Unmount with `fusermount -u -z MOUNTPOINT`.
"""

from __future__ import annotations

import os
import sys
import time

from mfusepy import FUSE, Operations  # over libfuse 3 or 2


class StallingLoopback(Operations):
    use_ns = True  # utimens gets nanoseconds

    def __init__(self, root: str, flag: str, write_bps: float = 0.0):
        self.root, self.flag, self.write_bps = os.path.realpath(root), flag, write_bps

    def real(self, path: str) -> str:  # a path in the mount -> the same path under SOURCE
        return self.root + path

    def getattr(self, path, fh=None):
        st = os.fstat(fh) if fh is not None else os.lstat(self.real(path))
        return {
            k: getattr(st, k) for k in ("st_gid", "st_mode", "st_nlink", "st_size", "st_uid")
        } | {k: getattr(st, f"{k}_ns") for k in ("st_atime", "st_ctime", "st_mtime")}

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self.real(path))]

    def open(self, path, flags):
        if flags & os.O_ACCMODE == os.O_RDONLY:
            # Drive does not answer
            while os.path.exists(self.flag) and path.startswith("/checkpoints/"):
                time.sleep(0.05)
        return os.open(self.real(path), flags)

    def create(self, path, mode, fi=None):
        return os.open(self.real(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        if self.write_bps:
            time.sleep(len(data) / self.write_bps)
        return os.pwrite(fh, data, offset)

    def truncate(self, path, length, fh=None):
        os.truncate(fh if fh is not None else self.real(path), length)

    def fsync(self, path, datasync, fh):
        os.fsync(fh)

    def flush(self, path, fh):
        return 0

    def release(self, path, fh):
        os.close(fh)

    def rename(self, old, new):
        os.rename(self.real(old), self.real(new))

    def mkdir(self, path, mode):
        os.mkdir(self.real(path), mode)

    def rmdir(self, path):
        os.rmdir(self.real(path))

    def unlink(self, path):
        os.unlink(self.real(path))

    def chmod(self, path, mode):
        os.chmod(self.real(path), mode)

    def utimens(self, path, times=None):
        os.utime(self.real(path), ns=times)

    def statfs(self, path):
        st = os.statvfs(self.real(path))
        return {
            k: getattr(st, k)
            for k in (
                "f_bavail",
                "f_bfree",
                "f_blocks",
                "f_bsize",
                "f_favail",
                "f_ffree",
                "f_files",
                "f_flag",
                "f_frsize",
                "f_namemax",
            )
        }


if __name__ == "__main__":
    source, mountpoint, flag, *write_bps = sys.argv[1:]
    loopback = StallingLoopback(source, flag, float(write_bps[0]) if write_bps else 0.0)
    FUSE(loopback, mountpoint, foreground=True, nothreads=False)
