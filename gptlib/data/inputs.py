"""The inputs of tokenize: which files (local paths, directories, globs; URLs through hub.py), what they are, their
identity, how they are read, and the record-level parsing shared with the readers (sources.py).

Identity comes from the content, never the path (one definition for a local path and a URL: the same bytes split
their documents identically; docs/data.md). A read error is a `SourceIOError`, never mistaken for corrupt data.
`scan_inputs` checks before any work. Invalid UTF-8 is replaced by U+FFFD and counted (free on clean text).
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import io
import json
import types
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Sequence

from gptlib.data.hub import Found, describe, has_glob, is_url, resolve_url
from gptlib.errors import PrepareError

FULL_HASH_LIMIT = 256 << 20  # files above this get a sampled hash (head, middle, tail), not a full read
SAMPLE_BLOCK = 4 << 20
BLOCK_SIZE = 8 << 20  # read-ahead of a remote file (one HTTP range request per block)
READ_BUFFER = 1 << 20  # Python-side buffer over a remote file (fsspec's readline reads a whole block per line)
COMPRESSED_EXT = (".gz", ".bz2", ".xz", ".zst", ".zip", ".7z", ".tar")
DEFAULT_TEXT_COLUMN = "text"
CHAT_FIELDS = ("messages", "conversations")  # the chat field looked for when none is named
_ERRORS = "gptlib.count_replace"  # codec error handler: replace with U+FFFD and count
invalid_utf8 = types.SimpleNamespace(count=0)  # invalid UTF-8 sequences replaced so far (prepare saves it per run)


def _count_replace(exc: UnicodeDecodeError):
    invalid_utf8.count += 1
    return "\ufffd", exc.end


def register_error_handler() -> None:
    codecs.register_error(_ERRORS, _count_replace)


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
        status = getattr(getattr(c, "response", None), "status_code", None) or getattr(c, "status_code", None)
        return isinstance(c, (FileNotFoundError, PermissionError, IsADirectoryError)) or status in (401, 403, 404)


def content_hash(open_file: Callable[[], Any], size: int) -> str:
    """sha256 of the whole content up to FULL_HASH_LIMIT; beyond, sha256 of the size and three
    SAMPLE_BLOCK samples (head, middle, tail): a full hash of a 10 GB corpus would cost minutes on
    every run, and the samples still change whenever a file is replaced, truncated or appended to."""
    with open_file() as f:
        if size <= FULL_HASH_LIMIT:
            return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
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


class _Watched(io.RawIOBase):
    """A file whose read errors become SourceIOError (so a network drop inside pyarrow is not taken
    for a corrupt row group)."""

    def __init__(self, f):
        super().__init__()
        self._f = f

    def readinto(self, b) -> int:
        try:
            return self._f.readinto(b)
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


@dataclass
class Source:
    """One input file: what it is, and an identity that survives renames and URLs."""

    path: Path | str  # a local path, or the URL of a file behind fsspec
    kind: str  # "text" | "jsonl" | "parquet"
    size: int  # bytes
    hash: str  # "sha256:<hex>" of the file, or "sampled-sha256:<hex>" (size + head/middle/tail) for big files
    fs: Any = None  # the fsspec filesystem of a URL input; None for a local file
    fspath: str | None = None  # the file's path on fs
    canonical: bool = True  # hash follows content_hash's definition (else `key` computes that when first used)

    def record(self) -> dict[str, Any]:
        return {"path": str(self.path), "kind": self.kind, "size": self.size, "hash": self.hash}

    @cached_property
    def key(self) -> str:
        """Seeds the per-document split hash (content_hash's definition wherever the file is). A big Hub file is
        listed with its full sha256: its sampled hash (3 ranged reads) is computed here, when the pass reaches it."""
        return (self.hash if self.canonical else content_hash(self.open, self.size)).split(":", 1)[1][:16]

    def open(self):
        """A buffered binary reader whose read errors are SourceIOError (retried by the caller)."""
        return open_input(self.path if self.fs is None else self.fspath, self.fs)


def source_kind(path: Path | str) -> str:
    name = str(path).lower()
    return "parquet" if name.endswith((".parquet", ".pq")) else "jsonl" if name.endswith((".jsonl", ".ndjson")) \
        else "text"


def file_hash(path: Path, size: int) -> str:
    """content_hash of a local file."""
    return content_hash(lambda: open(path, "rb"), size)


def resolve_inputs(inputs: Sequence[str | Path], exclude: Path | None = None, hf_config: str | None = None,
                   hf_split: str | None = None) -> list[Path | Found]:
    """Files, directories (recursively, sorted, hidden files skipped) and globs -> existing files;
    URLs (resolve_url) -> the files behind them."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    files: list[Path | Found] = []
    for item in inputs:
        s = str(item)
        p = Path(s)
        if is_url(s):
            files.extend(resolve_url(s, hf_config=hf_config, hf_split=hf_split))
        elif p.is_dir():
            files.extend(sorted(x for x in p.rglob("*") if x.is_file()
                                and not any(part.startswith(".") for part in x.relative_to(p).parts)))
        elif p.is_file():
            files.append(p)
        elif has_glob(s):
            matched = sorted(Path(x) for x in glob.glob(s, recursive=True) if Path(x).is_file())
            if not matched:
                raise PrepareError(f"input pattern {s!r} matches no files")
            files.extend(matched)
        else:
            raise PrepareError(f"input file {p} does not exist")
    if exclude is not None:  # never read our own output (an --out inside an input directory)
        ex = exclude.resolve()
        files = [f for f in files if ex not in _local_path(f).resolve().parents]
    unique: dict = {}
    for f in files:
        unique.setdefault(f.url if isinstance(f, Found) else f.resolve(), f)
    if not unique:
        raise PrepareError("no input files given")
    return list(unique.values())


def _local_path(f: Path | Found) -> Path:
    if isinstance(f, Path):
        return f
    return Path(f.path) if getattr(f.fs, "protocol", None) in ("file", ("file", "local")) else Path("/nonexistent")


def _source(f: Path | Found) -> Source:
    if isinstance(f, Found):
        ident, canonical = remote_identity(f)
        return Source(f.url, source_kind(f.path), f.size, ident, fs=f.fs, fspath=f.path, canonical=canonical)
    size = f.stat().st_size
    return Source(f, source_kind(f), size, file_hash(f, size))


def _parquet_column(pf, path, column: str | None, fmt: str = "text") -> str:
    import pyarrow as pa

    names = pf.schema_arrow.names
    col = column or (next((c for c in CHAT_FIELDS if c in names), None) if fmt == "chat" else DEFAULT_TEXT_COLUMN)
    t = pf.schema_arrow.field(col).type if col in names else None
    if fmt == "chat":
        if t is None:
            raise PrepareError(f"parquet file {path} has no column {col or ' or '.join(map(repr, CHAT_FIELDS))} "
                               f"(columns: {', '.join(names)}); choose the one holding the messages with "
                               f"--text-column / text_column=")
        if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
            raise PrepareError(f"parquet file {path}: column {col!r} has type {t}, not a list of messages "
                               f"(--format chat reads a list of {{role, content}} or {{from, value}} records)")
        return col
    if t is None:
        raise PrepareError(f"parquet file {path} has no column {col!r} (columns: {', '.join(names)}); "
                           f"choose one with --text-column / text_column=")
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t)):
        raise PrepareError(f"parquet file {path}: column {col!r} has type {t}, not text")
    return col


def _open_parquet(f):
    import pyarrow.parquet as pq

    # buffer_size / no pre-buffering: pages are streamed, not a whole row group read up front.
    return pq.ParquetFile(f, buffer_size=1 << 20, pre_buffer=False)


def _first_record_field(src: Source, field: str | None, fmt: str) -> str:
    """The jsonl field to read, checked on the first record: fail fast instead of after hours of
    tokenizing. For chat without a field named: the first of CHAT_FIELDS the record has."""
    with src.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if fmt != "chat":
                _jsonl_text(line, src.path, lineno, field or DEFAULT_TEXT_COLUMN)
                return field or DEFAULT_TEXT_COLUMN
            obj = _jsonl_object(line, src.path, lineno, field or CHAT_FIELDS[0])
            found = field or next((c for c in CHAT_FIELDS if c in obj), None)
            if found not in obj:
                raise PrepareError(f"{src.path}:{lineno}: field {found or ' or '.join(map(repr, CHAT_FIELDS))} "
                                   f"is missing (fields: {', '.join(map(str, obj))}); choose the one holding the "
                                   f"messages with --text-column / text_column=")
            return found
    return field or (CHAT_FIELDS[0] if fmt == "chat" else DEFAULT_TEXT_COLUMN)


def _jsonl_object(line: bytes, path, lineno: int, field: str) -> dict:
    try:
        obj = json.loads(line.decode("utf-8", _ERRORS))
    except json.JSONDecodeError as e:
        raise PrepareError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise PrepareError(f"{path}:{lineno}: a JSON {type(obj).__name__}, expected an object with a {field!r} field")
    return obj


def _jsonl_text(line: bytes, path, lineno: int, field: str) -> str | None:
    obj = _jsonl_object(line, path, lineno, field)
    if field not in obj:
        raise PrepareError(f"{path}:{lineno}: field {field!r} is missing (fields: {', '.join(map(str, obj))}); "
                           f"choose one with --text-column / text_column=")
    v = obj[field]
    if v is None or isinstance(v, str):
        return v
    raise PrepareError(f"{path}:{lineno}: field {field!r} is a {type(v).__name__}, not a string")


def scan_inputs(inputs, out_dir: Path, text_column: str | None, on_bad_file: str, fmt: str = "text",
                hf_config: str | None = None, hf_split: str | None = None
                ) -> tuple[list[Source], list[str], list[dict], str | None]:
    """The input files as Sources (hashed), the empty ones, the unopenable parquet files (skipped), and
    the column to read (for chat: the messages field found). Fails fast on a missing column/field,
    before training a tokenizer for an hour: every local file is checked, and the first remote file
    of each kind (a 1,000-file Hub dataset is not opened 1,000 times; the pass checks the others)."""
    files = resolve_inputs(inputs, exclude=out_dir, hf_config=hf_config, hf_split=hf_split)
    compressed = [n for n in (f.url if isinstance(f, Found) else str(f) for f in files)
                  if n.lower().endswith(COMPRESSED_EXT)]
    if compressed:
        raise PrepareError(f"input file {compressed[0]} is compressed; decompress it first (tokenize reads .txt, "
                           f".jsonl and .parquet; parquet's own compression is fine)")
    sources = [_source(f) for f in files]
    text = [s for s in sources if s.kind == "text"]
    if fmt == "chat" and text:
        raise PrepareError(f"--format chat reads conversations from .jsonl or parquet records; {text[0].path} is a "
                           f"plain text file")
    empty = [str(s.path) for s in sources if s.size == 0]
    if len(empty) == len(sources):
        more = f" (and so are the other {len(empty) - 1})" if len(empty) > 1 else ""
        raise PrepareError(f"nothing to tokenize: input file {empty[0]} is empty{more}")
    skipped: list[dict] = []
    column = text_column
    checked: set[str] = set()
    for s in sources:
        if not s.size or (s.fs is not None and s.kind in checked):
            continue
        try:
            column = _check_source(s, column, fmt, on_bad_file, skipped)
        except SourceIOError as e:
            raise PrepareError(f"input {s.path} cannot be read: {describe(e.cause, str(s.path))}") from None
        if s.fs is not None:
            checked.add(s.kind)
    return sources, empty, skipped, (column if fmt == "chat" else text_column)


def _check_source(s: Source, column: str | None, fmt: str, on_bad_file: str, skipped: list) -> str | None:
    """Check one file's field/column (see scan_inputs); returns the column, found if it was None."""
    if s.kind == "jsonl":
        found = _first_record_field(s, column, fmt)
    elif s.kind == "parquet":
        with s.open() as f:
            try:
                pf = _open_parquet(f)
            except SourceIOError:
                raise
            except Exception as e:  # noqa: BLE001 - truncated/corrupt: no footer
                if on_bad_file == "error":
                    raise PrepareError(f"parquet file {s.path} cannot be opened: {e}") from None
                skipped.append({"path": str(s.path), "error": f"cannot be opened: {e}"})
                return column
            found = _parquet_column(pf, s.path, column, fmt)
    else:
        return column
    return column or (found if fmt == "chat" else None)
