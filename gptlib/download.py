"""Fetch Tiny Shakespeare (or use a local copy) with checksum verification and a local cache."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .fsutil import atomic_write_bytes

TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TINYSHAKESPEARE_CHARS = 1_115_394


class DownloadError(RuntimeError):
    pass


def default_cache_dir() -> Path:
    return Path(os.environ.get("GPTLIB_CACHE", Path.home() / ".cache" / "gptlib"))


def fetch_tinyshakespeare(cache_dir: str | Path | None = None, url: str = TINYSHAKESPEARE_URL,
                          local_path: str | Path | None = None, timeout: float = 60.0) -> Path:
    """Return the path of a verified Tiny Shakespeare file.

    Order: `local_path` if given (verified, used in place); the cache if it holds a verified
    copy; otherwise download `url` into the cache. A checksum mismatch is an error, never a
    silently different corpus.
    """
    if local_path is not None:
        p = Path(local_path)
        if not p.is_file():
            raise DownloadError(f"local Tiny Shakespeare file {p} does not exist")
        _verify(p.read_bytes(), str(p))
        return p
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / "tinyshakespeare.txt"
    if target.is_file():
        data = target.read_bytes()
        if hashlib.sha256(data).hexdigest() == TINYSHAKESPEARE_SHA256:
            return target
        target.unlink()  # a corrupt cached copy is replaced, not trusted
    import urllib.request  # here, not at module level: ~70 ms of http/email/ssl imports few callers need

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            data = r.read()
    except (OSError, ValueError) as e:  # URLError is an OSError; a malformed URL is a ValueError
        raise DownloadError(
            f"could not download Tiny Shakespeare from {url}: {e}. Without a network, pass a local copy "
            f"(--input PATH / local_path=PATH)"
        ) from None
    _verify(data, url)
    atomic_write_bytes(target, data)
    return target


def _verify(data: bytes, where: str) -> None:
    got = hashlib.sha256(data).hexdigest()
    if got != TINYSHAKESPEARE_SHA256:
        raise DownloadError(
            f"{where}: sha256 is {got}, expected {TINYSHAKESPEARE_SHA256} (the canonical Tiny Shakespeare, "
            f"{TINYSHAKESPEARE_CHARS:,} characters); got {len(data):,} bytes"
        )
