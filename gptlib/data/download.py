"""Tiny Shakespeare, and the verified download HellaSwag uses too."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from gptlib.errors import PrepareError
from gptlib.fsutil import atomic_write_bytes, sha256_file

TINYSHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def default_cache_dir() -> Path:  # $GPTLIB_CACHE: the user's choice of cache (also HellaSwag's)
    return Path(os.environ.get("GPTLIB_CACHE", Path.home() / ".cache" / "gptlib"))


def cached_tinyshakespeare(cache_dir: str | Path | None = None) -> Path | None:
    """The cache's copy if it is the verified file (then fetch_tinyshakespeare downloads nothing), else None."""
    target = Path(cache_dir or default_cache_dir()) / "tinyshakespeare.txt"
    if target.is_file() and sha256_file(target) == TINYSHAKESPEARE_SHA256:
        return target
    return None


def fetch_tinyshakespeare(
    cache_dir: str | Path | None = None, local_path: str | Path | None = None
) -> Path:
    """`local_path` (verified, used in place), else the cache's verified copy, else the download into the cache.
    A checksum mismatch is an error, never another corpus."""
    if local_path is not None:
        url, target = None, Path(local_path)
        if not target.is_file():
            what = "is a folder, not the file" if target.is_dir() else "does not exist"
            raise PrepareError(f"local Tiny Shakespeare file {local_path} {what}")
    else:
        url = TINYSHAKESPEARE_URL
        target = Path(cache_dir or default_cache_dir()) / "tinyshakespeare.txt"
    return fetch_verified(
        url,
        target,
        TINYSHAKESPEARE_SHA256,
        PrepareError,
        name="Tiny Shakespeare",
        canonical="the canonical Tiny Shakespeare, 1,115,394 characters",
        local_hint="(fetch-shakespeare --local PATH or tokenize --input PATH; notebook 02: TEXT_PATH)",
    )


def fetch_verified(
    url: str | None,
    target: Path,
    sha256: str,
    error_cls: type[Exception],
    *,
    name: str,
    canonical: str,
    local_hint: str,
) -> Path:
    """`target` if it holds the file with this sha256, else `url` downloaded, checked and written there atomically
    (url None: target is the user's own copy, only checked)."""
    data = target.read_bytes() if target.is_file() else b""
    if hashlib.sha256(data).hexdigest() == sha256:
        return target
    if url is not None:
        # a corrupt cached copy goes, even if the download fails (never the user's)
        target.unlink(missing_ok=True)
        import urllib.request  # here, not at module level: ~70 ms of http/email/ssl imports few callers need

        try:
            with urllib.request.urlopen(url, timeout=60) as r:
                data = r.read()
        except (OSError, ValueError) as e:  # URLError is an OSError; a malformed URL a ValueError
            raise error_cls(
                f"could not download {name} from {url}: {e}. Without a network, pass a local copy "
                f"{local_hint}"
            ) from None
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise error_cls(
            f"{url or target}: sha256 is {got}, expected {sha256} ({canonical}); got {len(data):,} bytes"
        )
    atomic_write_bytes(target, data)
    return target
