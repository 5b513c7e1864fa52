"""Input files behind fsspec URLs (file://, memory://, s3://, hf://, ...), and the reading machinery
shared with local files: identity, open, retry.

- Resolution (`resolve_url`): a URL names a file, a directory (every file below it, sorted and with
  hidden files skipped exactly as a local directory is) or a glob. `hf://` URLs go through hub.py
  (token, the dataset's parquet files); everything else through `fsspec.core.url_to_fs`.
- Identity (`content_hash`): the same definition for a local path and a URL, so that the same bytes
  split their documents identically wherever they are read from: sha256 of the content up to
  FULL_HASH_LIMIT, beyond it sha256 of the size + three 4 MB blocks (head, middle, tail). Where the
  filesystem already knows the content's sha256 (the Hub lists it for its LFS files) nothing is read
  for a file up to FULL_HASH_LIMIT, and a bigger file's sampled hash (3 ranged reads) is computed only
  when the tokenizing pass reaches it (`Source.key`), so resolving a 1,000-file dataset reads nothing.
  Other remote files are read once to hash them (fully up to FULL_HASH_LIMIT).
- Reads (`open_input`): a file is opened with a BLOCK_SIZE read-ahead and wrapped so that any error
  raised while reading it is a `SourceIOError`, never mistaken for corrupt data. `retrying` runs a
  reader again after such an error, with backoff (RETRY_DELAYS), from the position after the last
  piece it produced: a parquet reader then re-opens the file and restarts at the row group holding
  that row, skipping the rows already done (the last completed row group is never read twice).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Callable, Iterator

from gptlib.colab import in_colab
from gptlib.errors import PrepareError

FULL_HASH_LIMIT = 256 << 20  # files above this get a sampled hash (head, middle, tail), not a full read
SAMPLE_BLOCK = 4 << 20
BLOCK_SIZE = 8 << 20  # read-ahead of a remote file (one HTTP range request per block)
READ_BUFFER = 1 << 20  # Python-side buffer over a remote file (fsspec's readline reads a whole block per line)
RETRY_DELAYS = (1, 2, 5, 10, 30, 60, 60, 60)  # seconds before each new attempt after a read error (~4 min)
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_GLOB_CHARS = "*?["


class SourceIOError(Exception):
    """Reading an input failed (a network drop, a timeout, a Drive I/O error): retried, then fatal.
    Not an OSError, so that no reader mistakes it for corrupt data."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause

    @property
    def fatal(self) -> bool:
        """Errors that another attempt cannot fix: a missing file, no permission, a refused token."""
        c = self.cause
        if isinstance(c, (FileNotFoundError, PermissionError, IsADirectoryError)):
            return True
        return _http_status(c) in (401, 403, 404)


def _http_status(e: BaseException) -> int | None:
    resp = getattr(e, "response", None)
    code = getattr(resp, "status_code", None) or getattr(e, "status_code", None)
    return int(code) if isinstance(code, int) else None


def is_url(s: str) -> bool:
    return bool(_URL.match(str(s)))


def has_glob(s: str) -> bool:
    return any(ch in s for ch in _GLOB_CHARS)


# --------------------------------------------------------------------------------------------
# Resolution


@dataclass
class Found:
    """One input file behind a URL."""

    url: str  # what meta.json records and messages name
    fs: Any  # the fsspec filesystem
    path: str  # the path within fs
    size: int
    sha256: str | None = None  # the content's sha256 where the filesystem lists it (Hub LFS files)


def listed_sha256(info: dict) -> str | None:
    """The content sha256 a listing gives for a file, if any (the Hub: `lfs.sha256` of LFS files)."""
    lfs = info.get("lfs")
    sha = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
    return sha if isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha) else None


def list_files(fs, path: str, url: str) -> list[Found]:
    """A file, a directory (recursively, hidden files skipped) or a glob on fs, sorted as local paths are."""
    try:
        if has_glob(path):
            found = {p: i for p, i in fs.glob(path, detail=True).items() if i.get("type") != "directory"}
            if not found:
                raise PrepareError(f"input pattern {url!r} matches no files")
            root = None
        elif fs.isdir(path):
            found = fs.find(path, detail=True)
            root = path.rstrip("/")
        else:
            found = {path: fs.info(path)}
            root = None
    except FileNotFoundError:
        raise PrepareError(f"input {url} does not exist") from None
    except PrepareError:
        raise
    except Exception as e:  # noqa: BLE001 - a remote listing can fail in many library-specific ways
        raise PrepareError(f"input {url} cannot be listed: {describe(e, url)}") from None
    out = []
    for p, info in found.items():
        rel = PurePosixPath(p[len(root):].lstrip("/")) if root is not None else PurePosixPath(p)
        if root is not None and any(part.startswith(".") for part in rel.parts):
            continue
        out.append((rel.parts if root is not None else PurePosixPath(p).parts, p, info))
    out.sort(key=lambda t: t[0])  # the order of sorted(Path(...)) for the same names
    return [Found(fs.unstrip_protocol(p), fs, p, int(info.get("size") or 0), listed_sha256(info))
            for _, p, info in out]


# --------------------------------------------------------------------------------------------
# Identity


def content_hash(open_file: Callable[[], Any], size: int) -> str:
    """sha256 of the whole content up to FULL_HASH_LIMIT; beyond, sha256 of the size and three
    SAMPLE_BLOCK samples (head, middle, tail): a full hash of a 10 GB corpus would cost minutes on
    every run, and the samples still change whenever a file is replaced, truncated or appended to."""
    with open_file() as f:
        if size <= FULL_HASH_LIMIT:
            h = hashlib.sha256()
            while True:
                b = f.read(4 << 20)
                if not b:
                    break
                h.update(b)
            return "sha256:" + h.hexdigest()
        h = hashlib.sha256(str(size).encode())
        for off in (0, size // 2, size - SAMPLE_BLOCK):
            f.seek(off)
            h.update(f.read(SAMPLE_BLOCK))
        return "sampled-sha256:" + h.hexdigest()


def remote_identity(found: Found) -> tuple[str, bool]:
    """(identity, canonical): the file's identity for meta.json and resume checks, and whether it is
    content_hash's definition (else its split key is computed when first needed: Source.key)."""
    if found.sha256 is not None:
        return "sha256:" + found.sha256, found.size <= FULL_HASH_LIMIT
    try:
        return content_hash(lambda: found.fs.open(found.path, "rb", block_size=BLOCK_SIZE), found.size), True
    except Exception as e:  # noqa: BLE001
        raise PrepareError(f"input {found.url} cannot be read: {describe(e, found.url)}") from None


# --------------------------------------------------------------------------------------------
# Reading


class _Watched(io.RawIOBase):
    """A file whose read errors become SourceIOError (so a network drop inside pyarrow is not taken
    for a corrupt row group)."""

    def __init__(self, f):
        super().__init__()
        self._f = f

    def readinto(self, b) -> int:
        try:
            if hasattr(self._f, "readinto"):
                return self._f.readinto(b)
            data = self._f.read(len(b))
            b[: len(data)] = data
            return len(data)
        except Exception as e:  # noqa: BLE001 - whatever the library raises is an I/O failure here
            raise SourceIOError(e) from e

    def seek(self, offset: int, whence: int = 0) -> int:
        try:
            return self._f.seek(offset, whence)
        except Exception as e:  # noqa: BLE001
            raise SourceIOError(e) from e

    def tell(self) -> int:
        return self._f.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        try:
            self._f.close()
        except Exception:  # noqa: BLE001 - closing a broken connection
            pass
        super().close()


def open_input(path, fs=None) -> io.BufferedReader:
    """A buffered binary reader over a local path (fs None) or a path on an fsspec filesystem."""
    try:
        raw = open(path, "rb", buffering=0) if fs is None else fs.open(path, "rb", block_size=BLOCK_SIZE)
    except Exception as e:  # noqa: BLE001
        raise SourceIOError(e) from e
    return io.BufferedReader(_Watched(raw), READ_BUFFER)


def retrying(read: Callable[[dict | None], Iterator[Any]], pos: dict | None, where: str,
             delays: tuple = None) -> Iterator[Any]:
    """The items of read(pos); after a SourceIOError, read(position after the last item) again,
    waiting delays[i] before the i-th new attempt (progress resets the count). Gives up with a
    PrepareError saying how to resume: the run stops at its last completed shard."""
    delays = RETRY_DELAYS if delays is None else delays
    attempt = 0
    while True:
        try:
            for item in read(pos):
                yield item
                pos = item.pos
                attempt = 0
            return
        except SourceIOError as e:
            if e.fatal or attempt >= len(delays):
                tries = "" if e.fatal else f" after {attempt + 1} attempts"
                raise PrepareError(f"reading {where} failed{tries}: {describe(e.cause, where)}. Everything up to the "
                                   f"last completed shard is kept: run the same command again to resume") from None
            print(f"warning: reading {where} failed ({describe(e.cause, where)}); retrying in {delays[attempt]}s "
                  f"(attempt {attempt + 2} of {len(delays) + 1})", file=sys.stderr)
            time.sleep(delays[attempt])
            attempt += 1


def describe(e: BaseException, url: str | None = None) -> str:
    """One line for an error from a filesystem library; Hub errors say what to do, naming the dataset of `url`."""
    repo = rev = None
    if url and url.startswith("hf://datasets/"):
        try:
            repo, rev, _ = parse_dataset_url(url)
        except PrepareError:
            pass
    hint = hub_error_hint(e, repo, rev)
    if hint:
        return hint
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}".rstrip(": ")


# --- the Hub: its dataset URLs, its token, and what its errors mean (messages here, resolution in hub.py)

TOKEN_HELP = ("pass a token: set the environment variable HF_TOKEN=hf_... (a read token from "
              "https://huggingface.co/settings/tokens), or on Colab add a secret named HF_TOKEN in the key-icon "
              "panel and allow this notebook to use it")


def hf_token() -> str | None:
    """HF_TOKEN from the environment, else Colab's HF_TOKEN secret, else None (huggingface_hub then
    uses a saved `hf auth login`, if any)."""
    tok = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if tok:
        return tok
    if in_colab():
        try:
            from google.colab import userdata  # noqa: PLC0415 - only exists on Colab

            return userdata.get("HF_TOKEN") or None
        except Exception:  # noqa: BLE001 - no such secret, or the notebook was not given access
            return None
    return None


def parse_dataset_url(url: str) -> tuple[str, str | None, str]:
    """hf://datasets/OWNER/NAME[@REV][/path] -> (OWNER/NAME, REV or None, path)."""
    m = re.fullmatch(r"hf://datasets/([^/@]+/[^/@]+)(?:@(refs/(?:convert/[\w.-]+|pr/\d+)|[^/]+))?(?:/(.*))?", url)
    if not m:
        raise PrepareError(f"input {url}: a Hub dataset URL is hf://datasets/OWNER/NAME[@REVISION][/path/or/glob]")
    return m.group(1), m.group(2), (m.group(3) or "").strip("/")


def error_names(e: BaseException | None) -> set[str]:
    """Class names (with bases) of an error and of its causes."""
    names: set[str] = set()
    seen = 0
    while e is not None and seen < 8:
        names.update(c.__name__ for c in type(e).__mro__)
        e = e.__cause__ or e.__context__
        seen += 1
    return names


def hub_error_hint(e: BaseException, repo: str | None = None, rev: str | None = None) -> str | None:
    """What a Hub error means for the user and what to do, or None for other errors."""
    names = error_names(e)
    what = f"dataset {repo}" if repo else "the dataset"
    if "GatedRepoError" in names:
        where = f"https://huggingface.co/datasets/{repo}" if repo else "its page on huggingface.co"
        return f"{what} is gated: accept its conditions at {where} (logged in), then {TOKEN_HELP}"
    if "RevisionNotFoundError" in names:
        return f"revision {rev!r} of {what} does not exist" if rev else f"a revision of {what} does not exist"
    if "DisabledRepoError" in names:
        return f"{what} has been disabled on the Hub"
    if "RepositoryNotFoundError" in names:
        token = "the token in use has no access to it, or it does not exist" if hf_token() else \
            "it does not exist, or it is private and needs a login"
        return f"{what} was not found on the Hub ({token}); check the name (OWNER/NAME) or {TOKEN_HELP}"
    if "OfflineModeIsEnabled" in names:
        return "huggingface_hub is in offline mode (HF_HUB_OFFLINE=1): the Hub cannot be reached"
    status = getattr(getattr(e, "response", None), "status_code", None)
    if status in (401, 403):
        return f"the Hub refused access to {what} (HTTP {status}); {TOKEN_HELP}"
    return None
