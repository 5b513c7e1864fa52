"""Crash-safe file writes: temp file in the same directory, flush + fsync, rename.

A reader never sees a half-written file under the final name; a crash leaves at most a
`*.tmp-*` file, which `clean_temp_files` removes on the next run.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, IO

TMP_MARKER = ".tmp-"


def fsync_dir(path: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call write(f) on a temp file beside `path`, fsync it, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + TMP_MARKER, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def clean_temp_files(directory: str | Path) -> list[Path]:
    """Remove temp files left by an interrupted atomic write; returns what was removed."""
    directory = Path(directory)
    removed = []
    if directory.is_dir():
        for p in directory.iterdir():
            if TMP_MARKER in p.name and p.is_file():
                try:
                    p.unlink()
                    removed.append(p)
                except OSError:
                    pass
    return removed
