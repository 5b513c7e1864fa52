"""The inputs of tokenize: which files (local paths, directories, globs, URLs), what they are, and
their identity; the record-level parsing shared with the readers (sources.py).

- Resolution: local files, directories (recursively, sorted, hidden files skipped) and globs as
  given; fsspec URLs through remote.py (and hf:// through hub.py).
- Identity: a file's identity comes from its content, never its path (remote.content_hash), so a URL
  and a local path of the same bytes split their documents identically and give the same shards.
- Checks before any work (`scan_inputs`): compressed files, empty files, unreadable parquet files
  (skipped or an error), the text column / jsonl field (or the chat field) on the first record.
- Invalid UTF-8 is replaced by U+FFFD and counted (a codec error handler: free on clean text).
"""

from __future__ import annotations

import codecs
import glob
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from gptlib.data.hub import resolve_hf
from gptlib.data.remote import (Found, SourceIOError, content_hash, describe, is_url, list_files, open_input,
                                remote_identity)
from gptlib.errors import PrepareError

PARQUET_EXT = (".parquet", ".pq")
JSONL_EXT = (".jsonl", ".ndjson")
COMPRESSED_EXT = (".gz", ".bz2", ".xz", ".zst", ".zip", ".7z", ".tar")
DEFAULT_TEXT_COLUMN = "text"
CHAT_FIELDS = ("messages", "conversations")  # the chat field looked for when none is named
TRAIN_FILES = 64  # a tokenizer-training budget is spread over at most this many files (evenly spaced)
_ERRORS = "gptlib.count_replace"  # codec error handler: replace with U+FFFD and count

# --------------------------------------------------------------------------------------------
# Invalid UTF-8: replace and count (the handler is only called on errors, so clean text is free)


class _Counter:
    count = 0  # invalid UTF-8 sequences replaced so far in this process (prepare saves/restores it per run)


invalid_utf8 = _Counter()


def _count_replace(exc: UnicodeDecodeError):
    invalid_utf8.count += 1
    return "\ufffd", exc.end


def register_error_handler() -> None:
    try:
        codecs.lookup_error(_ERRORS)
    except LookupError:
        codecs.register_error(_ERRORS, _count_replace)


# --------------------------------------------------------------------------------------------
# Inputs

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
    _key: str | None = field(default=None, repr=False)

    def record(self) -> dict[str, Any]:
        return {"path": str(self.path), "kind": self.kind, "size": self.size, "hash": self.hash}

    @property
    def key(self) -> str:
        """Seeds the per-document split hash: content_hash's definition whatever the location, so a URL
        and a local path of the same bytes split alike. A big Hub file is identified by the sha256 the
        Hub lists; its sampled hash (3 ranged reads) is computed here, when the pass reaches it."""
        if self._key is None:
            h = self.hash if self.canonical else content_hash(self.open, self.size)
            self._key = h.split(":", 1)[1][:16]
        return self._key

    def open(self):
        """A buffered binary reader whose read errors are SourceIOError (retried by the caller)."""
        return open_input(self.path if self.fs is None else self.fspath, self.fs)


def source_kind(path: Path | str) -> str:
    name = str(path).lower()
    if name.endswith(PARQUET_EXT):
        return "parquet"
    if name.endswith(JSONL_EXT):
        return "jsonl"
    return "text"


def file_hash(path: Path, size: int) -> str:
    """Full sha256 for files up to FULL_HASH_LIMIT; beyond, sha256 of size + 3 x 4 MB samples
    (remote.content_hash: the same definition for URLs)."""
    return content_hash(lambda: open(path, "rb"), size)


def resolve_inputs(inputs: Sequence[str | Path], exclude: Path | None = None, hf_config: str | None = None,
                   hf_split: str | None = None) -> list[Path | Found]:
    """Files, directories (recursively, sorted, hidden files skipped) and globs -> existing files;
    URLs (remote.resolve_url) -> the files behind them."""
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
        elif any(ch in s for ch in "*?["):
            matched = sorted(Path(x) for x in glob.glob(s, recursive=True) if Path(x).is_file())
            if not matched:
                raise PrepareError(f"input pattern {s!r} matches no files")
            files.extend(matched)
        else:
            raise PrepareError(f"input file {p} does not exist")
    if exclude is not None:  # never read our own output (an --out inside an input directory)
        ex = exclude.resolve()
        files = [f for f in files if ex not in _local_path(f).resolve().parents]
    seen: set = set()
    unique = []
    for f in files:
        r = f.url if isinstance(f, Found) else f.resolve()
        if r not in seen:
            seen.add(r)
            unique.append(f)
    if not unique:
        raise PrepareError("no input files given")
    return unique


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
    if fmt == "chat":
        col = column or next((c for c in CHAT_FIELDS if c in names), None)
        if col not in names:
            raise PrepareError(f"parquet file {path} has no column {col or ' or '.join(map(repr, CHAT_FIELDS))} "
                               f"(columns: {', '.join(names)}); choose the one holding the messages with "
                               f"--text-column / text_column=")
        t = pf.schema_arrow.field(col).type
        if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
            raise PrepareError(f"parquet file {path}: column {col!r} has type {t}, not a list of messages "
                               f"(--format chat reads a list of {{role, content}} or {{from, value}} records)")
        return col
    col = column or DEFAULT_TEXT_COLUMN
    if col not in names:
        raise PrepareError(f"parquet file {path} has no column {col!r} (columns: {', '.join(names)}); "
                           f"choose one with --text-column / text_column=")
    t = pf.schema_arrow.field(col).type
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
            if fmt == "chat":
                obj = _jsonl_object(line, src.path, lineno, field or CHAT_FIELDS[0])
                found = field or next((c for c in CHAT_FIELDS if c in obj), None)
                if found not in obj:
                    raise PrepareError(f"{src.path}:{lineno}: field {found or ' or '.join(map(repr, CHAT_FIELDS))} "
                                       f"is missing (fields: {', '.join(map(str, obj))}); choose the one holding the "
                                       f"messages with --text-column / text_column=")
                return found
            _jsonl_text(line, src.path, lineno, field or DEFAULT_TEXT_COLUMN)
            return field or DEFAULT_TEXT_COLUMN
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
    names = [f.url if isinstance(f, Found) else str(f) for f in files]
    compressed = [n for n in names if n.lower().endswith(COMPRESSED_EXT)]
    if compressed:
        raise PrepareError(f"input file {compressed[0]} is compressed; decompress it first (tokenize reads .txt, "
                           f".jsonl and .parquet; parquet's own compression is fine)")
    sources = [_source(f) for f in files]
    if fmt == "chat":
        text = [s for s in sources if s.kind == "text"]
        if text:
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
        return column or (found if fmt == "chat" else None)
    if s.kind != "parquet":
        return column
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
    return column or (found if fmt == "chat" else None)


def resolve_url(url: str, *, hf_config: str | None = None, hf_split: str | None = None) -> list[Found]:
    """The files a URL names: a file, a directory (recursively) or a glob; hf:// through hub.py."""
    if url.startswith("hf://"):
        return resolve_hf(url, config=hf_config, split=hf_split)
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ValueError, ImportError) as e:  # unknown protocol, or its package is not installed
        raise PrepareError(f"input URL {url}: {e}") from None
    return list_files(fs, path, url)
