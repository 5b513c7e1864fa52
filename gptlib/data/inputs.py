"""The inputs of tokenize: which files, their identity and how they are read. Identity comes from the content, never
the path, so the same bytes through a local path or a URL split their documents identically (docs/data.md)."""

from __future__ import annotations

import codecs
import glob
import hashlib
import io
import json
import re
import types
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Sequence

from gptlib.data.hub import Found, describe, has_glob, is_url, resolve_url, unlisted
from gptlib.errors import PrepareError, in_notebook
from gptlib.layout import TOKENIZER_FILE

# files above this get a sampled hash (head, middle, tail), not a full read
FULL_HASH_LIMIT = 256 << 20
SAMPLE_BLOCK = 4 << 20
BLOCK_SIZE = 8 << 20  # read-ahead of a remote file (one HTTP range request per block)
# Python-side buffer over a remote file (fsspec's readline reads a whole block per line)
READ_BUFFER = 1 << 20
COMPRESSED_EXT = (".gz", ".bz2", ".xz", ".zst", ".zip", ".7z", ".tar")
DEFAULT_TEXT_COLUMN = "text"
CHAT_FIELDS = ("messages", "conversations")  # the chat field looked for when none is named
# codec error handler: invalid UTF-8 replaced by U+FFFD and counted
_ERRORS = "gptlib.count_replace"
invalid_utf8 = types.SimpleNamespace(count=0)  # replaced so far (the pass saves it with each batch)
# the JSON escape of a surrogate ("\\ud83d": half of an emoji), and a surrogate left without its pair
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def not_text() -> str:
    """Why a file with NUL bytes is refused, naming where the user lists inputs (notebooks 01 and 05: INPUT)."""
    return (
        "not UTF-8 text: it holds NUL bytes (UTF-16, as Notepad's 'Unicode' or Windows PowerShell saves text, or a "
        "binary file: an image, a PDF); save it as UTF-8, or leave it out of "
        f"{'INPUT' if in_notebook() else '--input'} (e.g. a glob: DIR/*.txt)"
    )


def _count_replace(exc: UnicodeDecodeError):
    invalid_utf8.count += 1
    return "\ufffd", exc.end


codecs.register_error(_ERRORS, _count_replace)


def content_hash(open_file: Callable[[], Any], size: int) -> str:
    """Beyond FULL_HASH_LIMIT, sha256 of the size and three samples (head, middle, tail): a full hash of a 10 GB
    corpus would cost minutes on every run, and the samples still change when a file is replaced or appended to."""
    with open_file() as f:
        if size <= FULL_HASH_LIMIT:
            return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
        h = hashlib.sha256(str(size).encode())
        for off in (0, size // 2, size - SAMPLE_BLOCK):
            f.seek(off)
            h.update(f.read(SAMPLE_BLOCK))
        return "sampled-sha256:" + h.hexdigest()


@dataclass
class Source:
    path: Path | str  # a local path, or the URL of a file behind fsspec
    kind: str  # "text" | "jsonl" | "parquet"
    size: int  # bytes
    hash: str  # "sha256:<hex>", or "sampled-sha256:<hex>" (size + head/middle/tail) for big files
    fs: Any = None  # the fsspec filesystem of a URL input; None for a local file
    fspath: str | None = None  # the file's path on fs
    canonical: bool = True  # hash is content_hash's (else `key` computes that when first used)

    def record(self) -> dict[str, Any]:
        return {"path": str(self.path), "kind": self.kind, "size": self.size, "hash": self.hash}

    @cached_property
    def key(self) -> str:
        """Seeds the per-document split hash. A big Hub file is listed with its full sha256: its sampled hash (as
        for the same file on disk: 3 ranged reads) is computed here, when the pass reaches it."""
        full = self.hash if self.canonical else content_hash(self.open, self.size)
        return full.split(":", 1)[1][:16]

    def open(self) -> io.BufferedReader:
        if self.fs is None:
            raw = open(self.path, "rb", buffering=0)
        else:
            raw = self.fs.open(self.fspath, "rb", block_size=BLOCK_SIZE)
        return io.BufferedReader(raw, READ_BUFFER)


def source(f: Path | Found) -> Source:
    """A file with its identity: a local one hashed; a Hub file by the sha256 its listing gives, nothing read."""
    name = str(f.path if isinstance(f, Found) else f).lower()
    kind = "text"
    if name.endswith((".parquet", ".pq")):
        kind = "parquet"
    # .json too: the Hub's .json datasets are JSON lines (an array or one object is refused at its first line)
    elif name.endswith((".jsonl", ".ndjson", ".json")):
        kind = "jsonl"
    if isinstance(f, Found) and f.sha256 is not None:
        sha = "sha256:" + f.sha256
        return Source(f.url, kind, f.size, sha, f.fs, f.path, canonical=f.size <= FULL_HASH_LIMIT)
    if isinstance(f, Path):
        src = Source(f, kind, f.stat().st_size, "")
    else:
        src = Source(f.url, kind, f.size, "", f.fs, f.path)
    try:
        src.hash = content_hash(src.open, src.size)
    except Exception as e:  # noqa: BLE001
        why = describe(e, str(src.path))
        raise PrepareError(f"input {src.path} cannot be read: {why}") from None
    return src


def resolve_inputs(
    inputs: Sequence[str | Path] | str | Path,
    exclude: Path,
    hf_config: str | None,
    hf_split: str | None,
) -> list[Path | Found]:
    """Files, directories (recursively, sorted, unlisted files skipped), globs and URLs -> the files."""
    files: list[Path | Found] = []
    for item in [inputs] if isinstance(inputs, (str, Path)) else inputs:
        s, p = str(item), Path(item)
        if is_url(s):
            got = resolve_url(s, hf_config, hf_split)
        elif p.is_dir():
            found = sorted(x for x in p.rglob("*") if x.is_file())
            got = [x for x in found if not any(map(unlisted, x.relative_to(p).parts))]
        elif p.is_file():
            got = [p]
        elif has_glob(s):
            # a wildcard leaves unlisted files out, as Python's glob leaves out hidden ones
            got = sorted(Path(x) for x in glob.glob(s, recursive=True) if _wanted(Path(x)))
            if not got:
                raise PrepareError(f"input pattern {s!r} matches no files")
        else:
            raise PrepareError(f"input file {p} does not exist")
        files.extend(_outside_datasets(got, s))
    unique: dict = {}
    ex = exclude.resolve()  # never read our own output (an --out inside an input directory)
    for f in files:
        local = _local(f)
        if local is None or ex not in local.resolve().parents:
            unique.setdefault(f.url if isinstance(f, Found) else f.resolve(), f)
    if not unique:
        raise PrepareError("no input files given")
    return list(unique.values())


def _wanted(p: Path) -> bool:
    return p.is_file() and not unlisted(p.name)


def _local(f: Path | Found) -> Path | None:
    """Where a file is on this machine's disk (a file:// URL's too); None: remote."""
    if isinstance(f, Found):
        return Path(f.path) if f.fs.protocol in ("file", ("file", "local")) else None
    return f


def _outside_datasets(got: list[Path | Found], item: str) -> list[Path | Found]:
    """got less the files in a folder below the one listed (item up to its first glob) that holds a tokenizer.json:
    a dataset or run there (an earlier --out) is not text. Remote files are kept."""
    root = Path(item.removeprefix("file://"))
    while has_glob(str(root)):
        root = root.parent
    local = [_local(f) for f in got]
    below = {d for x in local if x is not None for d in x.parents if root in d.parents}
    made = {d for d in below if (d / TOKENIZER_FILE).is_file()}
    return [f for f, x in zip(got, local) if x is None or made.isdisjoint(x.parents)]


def _pick_column(column: str | None, names, fmt: str) -> str | None:
    """The column asked for, else for chat the first of CHAT_FIELDS present, else 'text'."""
    return column or (
        next((c for c in CHAT_FIELDS if c in names), None) if fmt == "chat" else DEFAULT_TEXT_COLUMN
    )


def _detect(column: str | None, names, fmt: str) -> str:
    """format "auto": chat when the first record has a chat field (CHAT_FIELDS) but not the text field read (the
    named one, else 'text'), which as text it would fail on; text otherwise. Any other format stays as asked."""
    if fmt != "auto":
        return fmt
    chat = (column or DEFAULT_TEXT_COLUMN) not in names and any(c in names for c in CHAT_FIELDS)
    return "chat" if chat else "text"


def _missing(word: str, col: str | None, names) -> str:
    want = repr(col) if col else " or ".join(map(repr, CHAT_FIELDS))
    # notebook 05 has no TEXT_COLUMN: notebook 01 would tokenize its own dataset, not 05's
    how = "TEXT_COLUMN in notebook 01 (notebook 05 has none: a 'text' field or conversations)"
    how = how if in_notebook() else "--text-column / text_column="
    return f"has no {word} {want} ({word}s: {', '.join(map(str, names))}); choose one with {how}"


def _parquet_column(pf, path, column: str | None, fmt: str) -> str:
    import pyarrow as pa

    names = pf.schema_arrow.names
    col = _pick_column(column, names, fmt)
    if col not in names:
        raise PrepareError(f"parquet file {path} {_missing('column', col, names)}")
    t = pf.schema_arrow.field(col).type
    if fmt == "chat" and not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        raise PrepareError(
            f"parquet file {path}: column {col!r} has type {t}, not a list of messages"
        )
    if fmt != "chat" and t not in (pa.string(), pa.large_string(), pa.binary(), pa.large_binary()):
        raise PrepareError(f"parquet file {path}: column {col!r} has type {t}, not text")
    return col


def corrupt(e: Exception) -> bool:
    """pyarrow's own error (a damaged file: skipped), not a read error of the file object under it (retried), which
    reaches us as it was raised: Drive's EIO carries an errno, a network drop is a subclass of OSError or none."""
    import pyarrow as pa

    return isinstance(e, pa.ArrowException) or (type(e) is OSError and e.errno is None)


def _open_parquet(f):
    import pyarrow.parquet as pq

    # pages streamed, not whole row groups
    return pq.ParquetFile(f, buffer_size=1 << 20, pre_buffer=False)


def _check_column(src: Source, column: str | None, fmt: str) -> tuple[str, str]:
    """(The column to read, the format), checked on src's first record: failing now, not after an hour of tokenizer
    training (the pass checks every file). fmt "auto" is decided here (_detect)."""
    with src.open() as f:
        if src.kind == "parquet":
            pf = _open_parquet(f)
            fmt = _detect(column, pf.schema_arrow.names, fmt)
            return _parquet_column(pf, src.path, column, fmt), fmt
        lineno, line = next(((i, x) for i, x in enumerate(f, 1) if x.strip()), (0, None))
    if line is None:  # blank lines only
        fmt = _detect(column, (), fmt)
        return _pick_column(column, (), fmt) or CHAT_FIELDS[0], fmt
    obj = _jsonl_object(line, src.path, lineno, column or DEFAULT_TEXT_COLUMN)
    fmt = _detect(column, obj, fmt)
    col = _pick_column(column, obj, fmt)
    if col not in obj:
        raise PrepareError(f"{src.path}:{lineno} {_missing('field', col, obj)}")
    return col, fmt


def _jsonl_object(line: bytes, path, lineno: int, field: str) -> dict:
    # a file saved by a Windows tool (Notepad, Excel) starts with a UTF-8 BOM: dropped, as utf-8-sig drops it
    if lineno == 1:
        line = line.removeprefix(codecs.BOM_UTF8)
    try:
        obj = json.loads(line.decode("utf-8", _ERRORS))
    except json.JSONDecodeError as e:
        why = not_text() if b"\0" in line else f"not valid JSON ({e.msg} at column {e.colno})"
        raise PrepareError(f"{path}:{lineno}: {why}") from None
    # a surrogate without its pair (a cut emoji) cannot be encoded as UTF-8: replaced and counted as invalid UTF-8
    # is. Only a line with a surrogate escape (a whole pair is one character by now) is written out again to look.
    if _SURROGATE_ESCAPE.search(line):
        fixed, n = _SURROGATE.subn("\ufffd", json.dumps(obj, ensure_ascii=False))
        if n:
            invalid_utf8.count += n
            obj = json.loads(fixed)
    if not isinstance(obj, dict):
        raise PrepareError(
            f"{path}:{lineno}: a JSON {type(obj).__name__}, expected an object with a {field!r} field"
        )
    return obj


def _jsonl_text(line: bytes, path, lineno: int, field: str) -> str | None:
    obj = _jsonl_object(line, path, lineno, field)
    if field not in obj:
        raise PrepareError(f"{path}:{lineno} {_missing('field', field, obj)}")
    v = obj[field]
    if v is None or isinstance(v, str):
        return v
    raise PrepareError(f"{path}:{lineno}: field {field!r} is a {type(v).__name__}, not a string")


def scan_inputs(
    inputs,
    out_dir: Path,
    text_column: str | None,
    fmt: str,
    hf_config: str | None,
    hf_split: str | None,
) -> tuple[list[Source], list[str], list[dict], str, str, Path | str]:
    """(Sources, empty files, unopenable parquet files (skipped), the column to read (for chat: the field found), the
    format: fmt, or for "auto" what the first record says (plain text files are text), the file of that record ("":
    none))."""
    files = resolve_inputs(inputs, out_dir, hf_config, hf_split)
    names = [f.url if isinstance(f, Found) else str(f) for f in files]
    compressed = [n for n in names if n.lower().endswith(COMPRESSED_EXT)]
    if compressed:
        raise PrepareError(
            f"input file {compressed[0]} is compressed; decompress it first (tokenize reads .txt, "
            f".jsonl and .parquet; parquet's own compression is fine)"
        )
    sources = [source(f) for f in files]
    text = [s for s in sources if s.kind == "text"]
    # plain text has no records to tell by, and conversations cannot be read from it
    if fmt == "auto" and text:
        fmt = "text"
    if fmt == "chat" and text:
        raise PrepareError(
            f"--format chat reads conversations from .jsonl or parquet records; {text[0].path} is a "
            f"plain text file"
        )
    empty = [str(s.path) for s in sources if s.size == 0]
    if len(empty) == len(sources):
        more = f" (and so are the other {len(empty) - 1})" if len(empty) > 1 else ""
        raise PrepareError(f"nothing to tokenize: input file {empty[0]} is empty{more}")
    skipped: list[dict] = []
    for s in (s for s in sources if s.size and s.kind != "text"):
        try:
            return sources, empty, skipped, *_check_column(s, text_column, fmt), s.path
        except PrepareError:
            raise
        except Exception as e:  # noqa: BLE001 - a filesystem library's error
            if not corrupt(e):
                why = describe(e, str(s.path))
                raise PrepareError(f"input {s.path} cannot be read: {why}") from None
            # no footer: the next file
            skipped.append({"path": str(s.path), "error": f"cannot be opened: {e}"})
    # no input left: name the skipped ones, not the empty corpus that follows
    if skipped and not any(s.size and s.kind == "text" for s in sources):
        named = "; ".join(f"{s['path']} {s['error'].rstrip('.')}" for s in skipped)
        raise PrepareError(f"{named}; nothing else to tokenize")
    fmt = _detect(text_column, (), fmt)
    return sources, empty, skipped, _pick_column(text_column, (), fmt) or CHAT_FIELDS[0], fmt, ""
