"""File operations that survive crashes and hung mounts: writes by temp file, fsync and rename (a crash leaves at
most a `*.tmp-*` file); a failed write as one line naming the directory, the OS's reason and the fix; calls abandoned
when a FUSE mount (Google Drive) stops answering, which blocks the reader in the kernel forever. In a directory a
lease guards (gptlib/lease.py), every rename, removal and append asks the lease first (`check_writable`)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import tempfile
import threading
import time
from concurrent.futures import Future, wait
from contextlib import suppress
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from gptlib.errors import HungIOError, RunDirError

TMP_MARKER = ".tmp-"
# what to do when Google Drive does not answer
DRIVE_ADVICE = (
    "Wait a few minutes and re-run, or remount Drive (Colab: drive.mount('/content/drive', "
    "force_remount=True)) and re-run"
)
# absolute directory -> the check of the lease this process holds on it (gptlib/lease.py adds and removes it), which
# raises LeaseLost once the lease is not this process's any more
GUARDS: dict[str, Callable[[Path], None]] = {}


def check_writable(path: str | Path) -> None:
    """LeaseLost if `path` lies under a guarded directory whose lease another process took: asked just before a write
    is made visible (the rename), so a process frozen mid-write never lands a file in a run that is not its own."""
    p = os.path.abspath(path)
    for root, check in list(GUARDS.items()):
        if p == root or p.startswith(root + os.sep):
            check(Path(root))


def replace(src: str | Path, dst: str | Path) -> None:
    """os.replace, once the lease guarding dst (if any) says this process still holds it."""
    check_writable(dst)
    os.replace(src, dst)


def fsync_dir(path: Path) -> None:
    """Make a rename durable (a no-op where directories cannot be opened: Windows)."""
    with suppress(OSError):
        fd = os.open(str(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[IO[bytes]]:
    """A file written under a temp name, then fsynced and renamed into place when the block ends without error: a
    crash leaves at most a `*.tmp-*` file beside it, never a half-written `path`."""
    path = Path(path)
    check_writable(path)  # not even a temp file or a folder in a run another process took over
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + TMP_MARKER, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    with atomic_file(path) as f:
        write(f)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def copy_rows(src: str | Path | bytes, dst: str | Path) -> None:
    """dst's JSON lines, then src's (a file, or its bytes) that dst has not, written over dst: each copy may have gained
    rows of its own (eval rows appended on another VM), which a plain copy would lose."""
    have = Path(dst).read_bytes().splitlines() if Path(dst).is_file() else []
    src = src if isinstance(src, bytes) else Path(src).read_bytes()
    new = [line for line in src.splitlines() if line not in have]
    # none: dst left alone, not rewritten at each mirror copy (a row appended to it meanwhile went with the old file)
    if new:
        atomic_write_bytes(dst, b"".join(line + b"\n" for line in have + new))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


def read_jsonl(path: str | Path) -> list[dict]:
    return parse_jsonl(Path(path).read_text(errors="replace") if Path(path).is_file() else "")


def parse_jsonl(text: str) -> list[dict]:
    """The objects of JSON-lines text; a line that is not one (a write torn by a kill) is skipped."""
    rows = []
    for line in text.splitlines():
        with suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return [row for row in rows if isinstance(row, dict)]


def append_jsonl(path: str | Path, *rows: dict) -> None:
    """One write, appended: earlier rows are never rewritten, and a row torn by a kill stays alone on its own line,
    for parse_jsonl to skip."""
    line = "".join(json.dumps(row) + "\n" for row in rows).encode()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    check_writable(path)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":  # a torn last line: start a new one
            line = b"\n" + line
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(4 << 20):
            h.update(b)
    return h.hexdigest()


def clean_temp_files(directory: str | Path) -> list[Path]:
    check_writable(directory)  # another holder's temp files are its writes in progress
    removed = []
    for p in Path(directory).glob(f"*{TMP_MARKER}*"):
        with suppress(OSError):
            p.unlink()  # IsADirectoryError for a directory: left alone
            removed.append(p)
    return removed


_WRITE_FIXES = {
    errno.ENOSPC: "free space there (old runs or checkpoints) or choose a directory on another disk",
    errno.EACCES: "choose a directory you may write to",
    errno.EROFS: "choose a writable directory",
}
_WRITE_FIXES |= {errno.EDQUOT: _WRITE_FIXES[errno.ENOSPC], errno.EPERM: _WRITE_FIXES[errno.EACCES]}
# Google Drive's mount dropped (Errno 107), failed a write, or hung (HungIOError)
_WRITE_FIXES |= dict.fromkeys(
    (errno.ENOTCONN, errno.EIO, errno.ETIMEDOUT), f"is Google Drive answering? {DRIVE_ADVICE}"
)


def cannot_write(directory: str | Path, e: OSError, then: str = "") -> RunDirError:
    fix = _WRITE_FIXES.get(
        e.errno, "(read-only, full or not allowed?) choose a writable directory with free space"
    )
    return RunDirError(f"cannot write to {directory}: {e.strerror or e}; {fix}{then}")


def check_dir(path: str | Path, what: str) -> bool:
    """-> whether it exists; RunDirError naming a file, a link loop, a broken link or a path through a file there."""
    try:
        if stat.S_ISDIR(os.stat(path).st_mode):
            return True
        kind = "a file, not a directory"
    except FileNotFoundError:
        if not os.path.islink(path):
            return False
        kind = f"a broken symbolic link (to {os.readlink(path)})"
    except OSError as e:
        if e.errno == errno.ELOOP:
            kind = "a symbolic link loop"
        elif e.errno == errno.ENOTDIR:
            kind = "not a directory: a part of its path is a file"
        else:
            raise
    raise RunDirError(
        f"{what} {path} is {kind}; choose another path (or remove or move away what is there)"
    )


class Progress:  # shared by a long I/O call and its watchdog
    def __init__(self):
        self.t, self.cancel, self.bytes = time.monotonic(), threading.Event(), 0

    def tick(self, nbytes: int = 0) -> None:
        if self.cancel.is_set():
            raise TimeoutError("abandoned by its watchdog (no progress in time)")
        self.t = time.monotonic()
        self.bytes += nbytes


def copy_hashing(src: str | Path, dst: str | Path, progress: Progress) -> tuple[int, str]:
    """-> (size, sha256) of what was read: checking a copy costs no second read. Each chunk ticks `progress`."""
    h, n = hashlib.sha256(), 0
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        progress.tick()
        while b := fi.read(8 << 20):
            h.update(b)
            fo.write(b)
            n += len(b)
            progress.tick(len(b))
        fo.flush()
        os.fsync(fo.fileno())
    return n, h.hexdigest()


def read_bytes_with_timeout(path: str | Path, stall_s: float) -> bytes:
    progress = Progress()

    def read() -> bytes:
        parts = []
        with open(path, "rb") as f:
            while b := f.read(8 << 20):
                parts.append(b)
                progress.tick(len(b))
        return b"".join(parts)

    return call_with_timeout(read, stall_s, progress, what=f"reading {path}")


def call_with_timeout(
    fn: Callable[[], Any], timeout: float, progress: Progress | None = None, what: str = "Drive"
) -> Any:
    """fn() in a daemon thread; HungIOError once it has gone `timeout` seconds without returning or, given
    `progress`, without a tick (fn is then stopped at its next tick). A call stuck in a hung FUSE mount can only be
    abandoned (a daemon thread never holds up the interpreter's exit) and may finish late, so fn writes temp names,
    reads, or finishes what it was asked while it was still wanted (the mirror's rename of a complete copy, a rotation's
    deletions: a late clean-up can at worst fail a later copy, which is retried)."""
    progress = progress or Progress()
    result = in_background(fn)
    while not wait([result], max(0.0, progress.t + timeout - time.monotonic())).done:
        if time.monotonic() - progress.t >= timeout:
            progress.cancel.set()
            msg = f"{what} made no progress for {timeout:g} s (hung mount?)"
            raise HungIOError(errno.ETIMEDOUT, msg)
    return result.result()


def in_background(fn: Callable[[], Any]) -> Future:
    """fn() in a daemon thread -> its result to come: one stuck in a hung mount is abandoned, never joined."""
    result: Future = Future()

    def run():
        try:
            result.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            result.set_exception(e)

    threading.Thread(target=run, daemon=True, name="gptlib-io").start()
    return result
