"""Streaming pre-tokenization: .txt / .jsonl / parquet -> token shards + meta.json (see shards.py).

The pipeline, in one pass over the corpus and with bounded memory whatever its size:

    sources --read in pieces of <= PIECE_CHARS--> batches of ~BATCH_CHARS text
            --tokenizer.encode_batch (parallel, inside the Rust library)--> token ids
            --> train/val shard buffers --> shards written atomically --> meta.json last

- Documents: a .txt file is one document, a .jsonl line is one (its `text_column` field), a
  parquet row is one (its `text_column` column). Documents are separated by the tokenizer's
  end-of-text id (the char tokenizer has none: documents are simply concatenated).
- Validation split: per document by a deterministic hash of (file hash, document index), so
  the same document always lands in the same split. A corpus of a few plain text files (e.g.
  Tiny Shakespeare, one document) uses the tail of each file instead (split="tail").
- Memory: text is read in pieces (a 100 MB line is never one string unless it is one JSON
  value), token ids go straight into one fixed-size buffer per split; peak RSS is about one
  train shard buffer + one encode batch.
- Resume: a `prepare_state.json` is written (atomically) after every completed shard; it holds
  the completed shards and the input position of the batch that completed them. A killed run
  restarts from there, drops the few tokens that the completed shards already hold, and goes
  on. `meta.json` is written last, so a half-written dataset never looks complete.
- Bad input: invalid UTF-8 is replaced by U+FFFD and counted; empty files and empty documents
  are skipped and counted; an unreadable parquet file (or row group) is skipped with a report
  (on_bad_file="skip") or is an error (on_bad_file="error"); a missing column/field is an error
  naming the file and the available names.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from .fsutil import TMP_MARKER, atomic_write_json, clean_temp_files, sha256_file
from .shards import META_FILE, DatasetMeta, ShardWriter, dtype_for_vocab, read_meta, write_meta
from .tokenizer import TOKENIZER_FILE, BPETokenizer, CharTokenizer, Tokenizer, load_tokenizer

STATE_FILE = "prepare_state.json"  # present only while a tokenize run is unfinished
PIECE_CHARS = 1 << 16  # longest text handed to the encoder as one item (long documents are cut)
BATCH_CHARS = 4 << 20  # text per encode_batch call: big enough for all cores, small in memory
FULL_HASH_LIMIT = 256 << 20  # files above this get a sampled hash (head, middle, tail), not a full read
TAIL_SPLIT_MAX_FILES = 100  # split="auto": fewer plain text files than this -> tail split
PARQUET_EXT = (".parquet", ".pq")
JSONL_EXT = (".jsonl", ".ndjson")
COMPRESSED_EXT = (".gz", ".bz2", ".xz", ".zst", ".zip", ".7z", ".tar")
DEFAULT_TEXT_COLUMN = "text"
_ERRORS = "gptlib.count_replace"  # codec error handler: replace with U+FFFD and count


class PrepareError(ValueError):
    """Bad input for tokenize: missing/empty file, missing column, refused output directory, bad options."""


# --------------------------------------------------------------------------------------------
# Invalid UTF-8: replace and count (the handler is only called on errors, so clean text is free)

_replaced = [0]


def _count_replace(exc: UnicodeDecodeError):
    _replaced[0] += 1
    return "\ufffd", exc.end


def _register_error_handler() -> None:
    try:
        codecs.lookup_error(_ERRORS)
    except LookupError:
        codecs.register_error(_ERRORS, _count_replace)


# --------------------------------------------------------------------------------------------
# Inputs

@dataclass
class Source:
    """One input file: what it is, and an identity that survives renames."""

    path: Path
    kind: str  # "text" | "jsonl" | "parquet"
    size: int  # bytes
    hash: str  # "sha256:<hex>" of the file, or "sampled-sha256:<hex>" (size + head/middle/tail) for big files

    def record(self) -> dict[str, Any]:
        return {"path": str(self.path), "kind": self.kind, "size": self.size, "hash": self.hash}

    @property
    def key(self) -> str:  # seeds the per-document split hash
        return self.hash.split(":", 1)[1][:16]


def source_kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(PARQUET_EXT):
        return "parquet"
    if name.endswith(JSONL_EXT):
        return "jsonl"
    return "text"


def file_hash(path: Path, size: int) -> str:
    """Full sha256 for files up to FULL_HASH_LIMIT; beyond, sha256 of size + 3 x 4 MB samples.

    A full hash of a 10 GB corpus on Drive would cost minutes on every run; the sample still
    changes whenever the file is replaced, truncated or appended to.
    """
    if size <= FULL_HASH_LIMIT:
        return "sha256:" + sha256_file(path)
    h = hashlib.sha256(str(size).encode())
    block = 4 << 20
    with open(path, "rb") as f:
        for off in (0, size // 2, size - block):
            f.seek(off)
            h.update(f.read(block))
    return "sampled-sha256:" + h.hexdigest()


def resolve_inputs(inputs: Sequence[str | Path], exclude: Path | None = None) -> list[Path]:
    """Files, directories (recursively, sorted, hidden files skipped) and globs -> existing files."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    files: list[Path] = []
    for item in inputs:
        s = str(item)
        p = Path(s)
        if p.is_dir():
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
        files = [f for f in files if ex not in f.resolve().parents]
    seen: set[Path] = set()
    unique = []
    for f in files:
        r = f.resolve()
        if r not in seen:
            seen.add(r)
            unique.append(f)
    if not unique:
        raise PrepareError("no input files given")
    return unique


def _parquet_column(pf, path: Path, text_column: str | None) -> str:
    import pyarrow as pa

    names = pf.schema_arrow.names
    col = text_column or DEFAULT_TEXT_COLUMN
    if col not in names:
        raise PrepareError(f"parquet file {path} has no column {col!r} (columns: {', '.join(names)}); "
                           f"choose one with --text-column / text_column=")
    t = pf.schema_arrow.field(col).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t)):
        raise PrepareError(f"parquet file {path}: column {col!r} has type {t}, not text")
    return col


def _open_parquet(path: Path):
    import pyarrow.parquet as pq

    # buffer_size / no pre-buffering: pages are streamed, not a whole row group read up front.
    return pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)


def _check_jsonl_field(path: Path, field: str) -> None:
    """Fail fast on the first record instead of after hours of tokenizing."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                _jsonl_text(line, path, lineno, field)
                return


def _jsonl_text(line: bytes, path: Path, lineno: int, field: str) -> str | None:
    try:
        obj = json.loads(line.decode("utf-8", _ERRORS))
    except json.JSONDecodeError as e:
        raise PrepareError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise PrepareError(f"{path}:{lineno}: a JSON {type(obj).__name__}, expected an object with a {field!r} field")
    if field not in obj:
        raise PrepareError(f"{path}:{lineno}: field {field!r} is missing (fields: {', '.join(map(str, obj))}); "
                           f"choose one with --text-column / text_column=")
    v = obj[field]
    if v is None or isinstance(v, str):
        return v
    raise PrepareError(f"{path}:{lineno}: field {field!r} is a {type(v).__name__}, not a string")


# --------------------------------------------------------------------------------------------
# Reading: every source becomes a stream of pieces; a position restarts the stream exactly there

@dataclass
class Piece:
    text: str
    doc: int  # document index within its file (line number for jsonl, row for parquet, 0 for text)
    doc_end: bool  # the document ends with this piece (an end-of-text id follows)
    split: str | None  # forced split (tail mode), else None = decided per document
    pos: dict  # where the stream continues after this piece: {"file", "doc", "byte", "char"}
    nbytes: float  # input bytes this piece accounts for (progress)


def split_text(text: str, start: int = 0) -> Iterator[tuple[str, int]]:
    """Cut a long string into <= PIECE_CHARS pieces, before a newline or a space where possible,
    so a word is not cut in two. Memoryless: the pieces from `start` on do not depend on
    earlier ones, so a resumed run cuts exactly as the first one did."""
    n = len(text)
    i = start
    while i < n:
        j = min(n, i + PIECE_CHARS)
        if j < n:
            k = text.rfind("\n", i + 1, j)
            if k <= i:
                k = text.rfind(" ", i + 1, j)
            if k > i:
                j = k
        yield text[i:j], j
        i = j


def _cut_bytes(block: bytes, at_eof: bool) -> int:
    """Where to end a piece read from a text file: after the block if at EOF, else before its
    last newline, else its last space, else at a UTF-8 character boundary."""
    if at_eof:
        return len(block)
    k = block.rfind(b"\n")
    if k <= 0:
        k = block.rfind(b" ")
    if k > 0:
        return k
    k = len(block)
    while k > 0 and (block[k - 1] & 0xC0) == 0x80:  # back off continuation bytes
        k -= 1
    if k > 0 and block[k - 1] >= 0xC0:  # and the lead byte of the cut character
        k -= 1
    return k if k > 0 else len(block)


def iter_text_file(src: Source, fi: int, pos: dict | None, tail_cut: int | None) -> Iterator[Piece]:
    """A text file is one document, read PIECE_CHARS bytes at a time from a byte offset."""
    off = int(pos["byte"]) if pos else 0
    with open(src.path, "rb", buffering=1 << 20) as f:
        if tail_cut is not None:  # move the cut off a UTF-8 continuation byte
            f.seek(tail_cut)
            b = f.read(4)
            i = 0
            while i < len(b) and (b[i] & 0xC0) == 0x80:
                i += 1
            tail_cut += i
        f.seek(off)
        while off < src.size:
            limit = PIECE_CHARS
            split = None
            if tail_cut is not None:
                split = "train" if off < tail_cut else "val"
                if off < tail_cut:
                    limit = min(limit, tail_cut - off)
            block = f.read(limit)
            if not block:
                break  # the file shrank while reading
            at_end = off + len(block) >= src.size or (tail_cut is not None and off + len(block) == tail_cut)
            k = _cut_bytes(block, at_end)
            if k < len(block):
                f.seek(off + k)
            off += k
            text = block[:k].decode("utf-8", _ERRORS)
            yield Piece(text, 0, off >= src.size, split, {"file": fi, "doc": 0, "byte": off, "char": 0}, k)


def _document_pieces(text: str | None, fi: int, doc: int, char: int, byte: int, byte_after: int,
                     nbytes: float) -> Iterator[Piece]:
    """One document of a jsonl/parquet file (a line, a row) as pieces from character `char` on.
    A resume inside it restarts at (byte, char), after it at byte_after; nbytes is its input size.
    An empty document (blank line, null or "") is one empty piece, so that it is counted."""
    if not text:
        yield Piece("", doc, True, None, {"file": fi, "doc": doc + 1, "byte": byte_after, "char": 0}, nbytes)
        return
    for piece, end in split_text(text, char):
        done = end >= len(text)
        nxt = ({"file": fi, "doc": doc + 1, "byte": byte_after, "char": 0} if done
               else {"file": fi, "doc": doc, "byte": byte, "char": end})
        yield Piece(piece, doc, done, None, nxt, nbytes * len(piece) / len(text))


def iter_jsonl_file(src: Source, fi: int, pos: dict | None, field: str) -> Iterator[Piece]:
    doc = int(pos["doc"]) if pos else 0
    byte = int(pos["byte"]) if pos else 0
    char = int(pos["char"]) if pos else 0
    with open(src.path, "rb", buffering=1 << 20) as f:
        f.seek(byte)
        for line in f:
            start = byte
            byte += len(line)
            text = _jsonl_text(line, src.path, doc + 1, field) if line.strip() else None
            yield from _document_pieces(text, fi, doc, char, start, byte, len(line))
            doc += 1
            char = 0


class _BadParquet(Exception):
    pass


def iter_parquet_file(src: Source, fi: int, pos: dict | None, column: str | None,
                      on_bad_row_group=None) -> Iterator[Piece]:
    """One document per row, read row group by row group: a corrupt row group is reported through
    on_bad_row_group(message) (which may raise) and skipped; the rows around it are kept."""
    import pyarrow as pa

    try:
        pf = _open_parquet(src.path)
    except (OSError, pa.ArrowException) as e:
        raise _BadParquet(f"cannot be opened: {e}") from None
    col = _parquet_column(pf, src.path, column)
    meta = pf.metadata
    rows = meta.num_rows
    per_row = src.size / max(1, rows)
    row = int(pos["doc"]) if pos else 0
    char = int(pos["char"]) if pos else 0
    # Restart inside the file: begin at the row group holding `row`, skip rows before it.
    first = 0
    g = 0
    while g < meta.num_row_groups and first + meta.row_group(g).num_rows <= row:
        first += meta.row_group(g).num_rows
        g += 1
    if g >= meta.num_row_groups:
        return
    skip = row - first
    for g in range(g, meta.num_row_groups):
        end_row = first + meta.row_group(g).num_rows
        try:
            for batch in pf.iter_batches(batch_size=1024, row_groups=[g], columns=[col], use_threads=False):
                if skip >= batch.num_rows:  # rows a resumed run has done already may span several batches
                    skip -= batch.num_rows
                    continue
                values = batch.column(0).to_pylist()[skip:]
                skip = 0
                for v in values:
                    if isinstance(v, bytes):
                        v = v.decode("utf-8", _ERRORS)
                    yield from _document_pieces(v, fi, row, char, 0, 0, per_row)
                    row += 1
                    char = 0
        except (OSError, pa.ArrowException) as e:
            if on_bad_row_group is not None:
                on_bad_row_group(f"row group {g} (rows {row}-{end_row - 1}) is unreadable: {e}".replace("\n", " ").strip())
            row, char, skip = end_row, 0, 0
        first = end_row


# --------------------------------------------------------------------------------------------
# Writing (shards.ShardWriter): token arrays of the shard dtype; the files tokenize owns


def _to_array(parts: list, dtype: np.dtype) -> np.ndarray:
    """Token id lists (BPE) or arrays (char) -> one array of the shard dtype."""
    if not parts:
        return np.zeros(0, dtype=dtype)
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts).astype(dtype, copy=False)
    n = sum(len(p) for p in parts)
    out = np.empty(n, dtype=dtype)
    i = 0
    for p in parts:  # np.array per list is C-speed; one Python step per piece, not per token
        out[i:i + len(p)] = p
        i += len(p)
    return out


def _our_files(out_dir: Path) -> list[Path]:
    """Files this module writes (the only ones it ever deletes)."""
    if not out_dir.is_dir():
        return []
    names = {META_FILE, STATE_FILE, TOKENIZER_FILE}
    return [p for p in out_dir.iterdir() if p.is_file() and (
        p.name in names or (p.suffix == ".bin" and p.name.split("_")[0] in ("train", "val")) or TMP_MARKER in p.name)]


# --------------------------------------------------------------------------------------------
# The pipeline


def _tokenizer_spec(tokenizer, tokenizer_file, vocab_size, train_max_bytes) -> dict:
    if tokenizer_file is not None:
        p = Path(tokenizer_file)
        if p.is_dir():
            p = p / TOKENIZER_FILE
        if not p.is_file():
            raise PrepareError(f"tokenizer file {p} does not exist")
        return {"file_sha256": sha256_file(p)}
    if isinstance(tokenizer, Tokenizer):
        return {"hash": tokenizer.identity()["hash"]}
    if tokenizer == "char":
        return {"kind": "char"}
    if tokenizer == "bpe":
        return {"kind": "bpe", "vocab_size": int(vocab_size), "train_max_bytes": train_max_bytes}
    raise PrepareError(f"tokenizer {tokenizer!r}: choose 'char' or 'bpe', or pass a tokenizer file")


def _iter_source(src: Source, fi: int, pos: dict | None, split_mode: str, val_fraction: float,
                 text_column: str | None, on_bad_row_group=None) -> Iterator[Piece]:
    if src.kind == "text":
        cut = int(src.size * (1.0 - val_fraction)) if split_mode == "tail" else None
        return iter_text_file(src, fi, pos, cut)
    if src.kind == "jsonl":
        return iter_jsonl_file(src, fi, pos, text_column or DEFAULT_TEXT_COLUMN)
    return iter_parquet_file(src, fi, pos, text_column, on_bad_row_group)


def _iter_corpus(sources: list[Source], start: dict, skipped: list, split_mode: str, val_fraction: float,
                 text_column: str | None, on_bad_file: str) -> Iterator[Piece]:
    """All pieces of all sources from `start` on; unreadable parquet files and row groups are
    skipped and recorded in `skipped`, or fatal (on_bad_file="error")."""
    for fi in range(int(start["file"]), len(sources)):
        src = sources[fi]
        pos = start if fi == int(start["file"]) else None
        if src.size == 0 or _whole_file_skipped(src, skipped):
            continue

        def bad_row_group(msg: str, src: Source = src) -> None:
            if on_bad_file == "error":
                raise PrepareError(f"parquet file {src.path}: {msg}")
            skipped.append({"path": str(src.path), "error": msg, "partial": True})

        try:
            yield from _iter_source(src, fi, pos, split_mode, val_fraction, text_column, bad_row_group)
        except _BadParquet as e:
            if on_bad_file == "error":
                raise PrepareError(f"parquet file {src.path} {e}") from None
            skipped.append({"path": str(src.path), "error": str(e)})


def _whole_file_skipped(src: Source, skipped: list) -> bool:
    return any(s["path"] == str(src.path) and not s.get("partial") for s in skipped)


def _train_texts(sources: list[Source], text_column: str | None, max_bytes: int | None,
                 skipped: list) -> Iterator[str]:
    """The tokenizer's training stream: the whole corpus, or about max_bytes spread over all files
    in proportion to their size (each file from its start)."""
    total = sum(s.size for s in sources) or 1
    for fi, src in enumerate(sources):
        if src.size == 0 or _whole_file_skipped(src, skipped):
            continue
        budget = None if max_bytes is None else max(PIECE_CHARS, int(max_bytes * src.size / total))
        used = 0
        try:
            for p in _iter_source(src, fi, None, "document", 0.0, text_column):
                if p.text:
                    yield p.text
                used += p.nbytes
                if budget is not None and used >= budget:
                    break
        except _BadParquet:
            pass  # reported by the tokenizing pass


def prepare(inputs: Sequence[str | Path] | str | Path, out_dir: str | Path, tokenizer: str | Tokenizer = "bpe", *,
            vocab_size: int = 32768, tokenizer_file: str | Path | None = None, text_column: str | None = None,
            val_fraction: float = 0.1, split: str = "auto", shard_tokens: int = 100_000_000,
            train_max_bytes: int | None = 1_000_000_000, on_bad_file: str = "skip", overwrite: bool = False,
            verbose: bool = True) -> DatasetMeta:
    """Tokenize a corpus into `out_dir` (token shards + tokenizer.json + meta.json); returns its meta.

    inputs: files, directories and globs of .txt (one document per file), .jsonl (one per line,
        field `text_column`) and .parquet (one per row, column `text_column`); default column "text".
    tokenizer: "bpe" (train a byte-level BPE of `vocab_size` ids on up to `train_max_bytes` of the
        corpus; None = all of it), "char", or a Tokenizer object; `tokenizer_file` reuses a saved
        tokenizer.json instead (char or BPE).
    split: "document" (per-document hash), "tail" (last val_fraction of each plain text file),
        "auto" (tail for fewer than 100 plain text files, else document).
    shard_tokens: tokens per train shard. A val shard is cut whenever a train shard is, so a resumed
        run restarts at most one encode batch before the last completed shard.
    Re-running with the same inputs and options returns the finished dataset, or resumes an
    unfinished one; `out_dir` holding a different dataset is refused unless overwrite=True (which
    deletes only the files tokenize writes there).
    """
    _check_options(val_fraction, split, on_bad_file, shard_tokens)
    _register_error_handler()
    t0 = time.time()
    out_dir = Path(out_dir)
    sources, empty, pre_skipped = _scan_inputs(inputs, out_dir, text_column, on_bad_file)
    split = _choose_split(split, sources)
    spec = {"sources": [[s.size, s.hash] for s in sources], "tokenizer": _tokenizer_spec(
        tokenizer, tokenizer_file, vocab_size, train_max_bytes), "val_fraction": val_fraction, "split": split,
        "text_column": text_column, "shard_tokens": int(shard_tokens), "on_bad_file": on_bad_file}

    finished, state = _previous_run(out_dir, spec, overwrite, verbose)
    if finished is not None:
        return finished
    if state is None or not (out_dir / TOKENIZER_FILE).is_file():
        state = None
        _delete_our_files(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_temp_files(out_dir)

    # The tokenizer is saved into out_dir before any shard, and reused on resume.
    if state is not None:
        tok = _resumed_tokenizer(out_dir, state)
        progress = _resumed_progress(out_dir, state, dtype_for_vocab(tok.vocab_size), verbose)
    else:
        tok = _new_tokenizer(tokenizer, tokenizer_file, vocab_size, train_max_bytes, sources, text_column,
                             pre_skipped, verbose)
        tok.save(out_dir)
        progress = {"resume": {"file": 0, "doc": 0, "byte": 0, "char": 0}, "emitted": {"train": 0, "val": 0},
                    "stats": {"documents": 0, "characters": 0, "bytes": 0.0, "empty_documents": 0,
                              "replaced_invalid_utf8": 0, "skipped_files": list(pre_skipped)},
                    "shards": {"train": [], "val": []}}
    identity = dict(tok.identity(), file=TOKENIZER_FILE)
    writers = _encode_corpus(out_dir, spec, tok, identity, sources, progress, split, val_fraction, text_column,
                             on_bad_file, shard_tokens, verbose)

    stats, emitted, skipped = progress["stats"], progress["emitted"], progress["stats"]["skipped_files"]
    if emitted["train"] == 0:
        why = "".join(f"; skipped {s['path']}: {s['error']}" for s in skipped[:3])
        raise PrepareError(f"the corpus produced no training tokens ({stats['documents']} documents); "
                           f"check the inputs and the text column{why}")
    if emitted["val"] == 0:
        raise PrepareError(
            f"no document fell into the validation split ({stats['documents']:,} documents, "
            f"val_fraction={val_fraction}); use more documents, a larger val_fraction, or split='tail'")
    for w in writers.values():
        w.flush()
    elapsed = time.time() - t0
    write_meta(out_dir, vocab_size=tok.vocab_size, tokenizer=identity,
               splits={s: w.shards for s, w in writers.items()}, sources=[s.record() for s in sources],
               extra={"documents": stats["documents"], "characters": stats["characters"],
                      "empty_documents": stats["empty_documents"], "empty_files": empty,
                      "replaced_invalid_utf8": stats["replaced_invalid_utf8"], "skipped_files": skipped,
                      "split": split, "val_fraction": val_fraction, "text_column": text_column,
                      "eot_id": tok.eot_id, "shard_tokens": int(shard_tokens), "prepare_spec": spec,
                      "elapsed_s": round(elapsed, 3)})
    (out_dir / STATE_FILE).unlink()
    meta = read_meta(out_dir)
    if verbose:
        n = meta.tokens("train") + meta.tokens("val")
        print(f"tokenized {len(sources)} file(s), {stats['documents']:,} documents, {stats['characters']:,} "
              f"characters -> train {meta.tokens('train'):,} / val {meta.tokens('val'):,} tokens "
              f"({stats['characters'] / max(1, n):.2f} chars/token, {meta.dtype.name}, vocab {meta.vocab_size:,}, "
              f"{len(meta.splits['train']['shards'])}+{len(meta.splits['val']['shards'])} shards) in "
              f"{elapsed:.1f}s -> {out_dir}")
        report_problems(meta.raw)
    return meta


def _check_options(val_fraction: float, split: str, on_bad_file: str, shard_tokens: int) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise PrepareError(f"val_fraction={val_fraction} must be between 0 and 1 (exclusive)")
    if split not in ("auto", "document", "tail"):
        raise PrepareError(f"split={split!r}: choose 'auto', 'document' or 'tail'")
    if on_bad_file not in ("skip", "error"):
        raise PrepareError(f"on_bad_file={on_bad_file!r}: choose 'skip' or 'error'")
    if int(shard_tokens) < 1:
        raise PrepareError(f"shard_tokens={shard_tokens} must be >= 1")


def _scan_inputs(inputs, out_dir: Path, text_column: str | None,
                 on_bad_file: str) -> tuple[list[Source], list[str], list[dict]]:
    """The input files as Sources (hashed), the empty ones, and the unopenable parquet files (skipped).
    Fails fast on a missing column/field, before training a tokenizer for an hour."""
    files = resolve_inputs(inputs, exclude=out_dir)
    compressed = [f for f in files if f.name.lower().endswith(COMPRESSED_EXT)]
    if compressed:
        raise PrepareError(f"input file {compressed[0]} is compressed; decompress it first (tokenize reads .txt, "
                           f".jsonl and .parquet; parquet's own compression is fine)")
    sources = []
    for f in files:
        size = f.stat().st_size
        sources.append(Source(f, source_kind(f), size, file_hash(f, size)))
    empty = [str(s.path) for s in sources if s.size == 0]
    if len(empty) == len(sources):
        more = f" (and so are the other {len(empty) - 1})" if len(empty) > 1 else ""
        raise PrepareError(f"nothing to tokenize: input file {empty[0]} is empty{more}")
    skipped: list[dict] = []
    for s in sources:
        if s.kind == "jsonl" and s.size:
            _check_jsonl_field(s.path, text_column or DEFAULT_TEXT_COLUMN)
        elif s.kind == "parquet" and s.size:
            try:
                pf = _open_parquet(s.path)
            except Exception as e:  # truncated/corrupt: no footer
                if on_bad_file == "error":
                    raise PrepareError(f"parquet file {s.path} cannot be opened: {e}") from None
                skipped.append({"path": str(s.path), "error": f"cannot be opened: {e}"})
                continue
            _parquet_column(pf, s.path, text_column)
    return sources, empty, skipped


def _choose_split(split: str, sources: list[Source]) -> str:
    if split == "auto":
        split = "tail" if all(s.kind == "text" for s in sources) and len(sources) < TAIL_SPLIT_MAX_FILES else "document"
    if split == "tail" and any(s.kind != "text" for s in sources):
        raise PrepareError("split='tail' works on plain text files only; jsonl/parquet documents are split "
                           "per document (split='document')")
    return split


def _previous_run(out_dir: Path, spec: dict, overwrite: bool, verbose: bool) -> tuple[DatasetMeta | None, dict | None]:
    """What out_dir already holds: (the finished dataset of this spec, None), (None, the state of an
    unfinished run of this spec), or (None, None) for nothing of ours / another dataset with overwrite."""
    meta_path, state_path = out_dir / META_FILE, out_dir / STATE_FILE
    if meta_path.is_file():
        try:
            old = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            old = {}
        if old.get("prepare_spec") == spec:
            if state_path.is_file():  # killed between meta.json and removing the state file
                state_path.unlink()
            elif verbose:
                print(f"{out_dir} already holds this dataset; reusing it")
            return read_meta(out_dir), None
        if not overwrite:
            raise PrepareError(
                f"{out_dir} already holds a different dataset (sources "
                f"{[s.get('path') for s in old.get('sources', [])][:5]}, tokenizer "
                f"{old.get('tokenizer', {}).get('kind')}, vocab {old.get('vocab_size')}); "
                f"choose another output directory or pass --overwrite / overwrite=True")
        return None, None
    if not state_path.is_file():
        return None, None
    try:
        state = json.loads(state_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None, None  # a state file is written atomically; an unreadable one is not ours to trust
    if state.get("spec") != spec:
        if not overwrite:
            raise PrepareError(
                f"{out_dir} holds an unfinished tokenize run of different inputs or options; run the same "
                f"command as before to finish it, choose another output directory, or pass --overwrite")
        return None, None
    return None, state


def _delete_our_files(out_dir: Path) -> None:
    """An older dataset (overwrite) or leftovers of a run that never began. meta.json goes first:
    a kill half-way through never leaves a meta.json naming deleted shards."""
    for p in sorted(_our_files(out_dir), key=lambda p: p.name != META_FILE):
        p.unlink()


def _resumed_tokenizer(out_dir: Path, state: dict) -> Tokenizer:
    tok_path = out_dir / TOKENIZER_FILE
    tok = load_tokenizer(tok_path)
    if tok.identity()["hash"] != state["tokenizer"]["hash"]:
        raise PrepareError(f"{tok_path} differs from the tokenizer of the unfinished run in {out_dir}; "
                           f"pass --overwrite to start again")
    return tok


def _new_tokenizer(tokenizer, tokenizer_file, vocab_size: int, train_max_bytes: int | None, sources: list[Source],
                   text_column: str | None, skipped: list, verbose: bool) -> Tokenizer:
    if tokenizer_file is not None:
        return load_tokenizer(tokenizer_file)
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if tokenizer == "char":
        chars: set[str] = set()
        for text in _train_texts(sources, text_column, None, skipped):
            chars.update(text)
        if not chars:
            raise PrepareError("the corpus has no text to build a char vocabulary from")
        return CharTokenizer.from_chars(chars)
    t_tok = time.time()
    if verbose:
        lim = "all of it" if train_max_bytes is None else f"up to {train_max_bytes / 1e6:,.0f} MB"
        print(f"training a {vocab_size:,}-id byte-level BPE on {lim} ...")
    tok = BPETokenizer.train(_train_texts(sources, text_column, train_max_bytes, skipped),
                             vocab_size=vocab_size, show_progress=False)
    if verbose:
        print(f"tokenizer: {tok.kind}, vocab {tok.vocab_size:,}, trained in {time.time() - t_tok:.1f}s")
    return tok


def _resumed_progress(out_dir: Path, state: dict, dtype: np.dtype, verbose: bool) -> dict:
    """The unfinished run's position, counts and completed shards, after checking the shards on disk.
    Shards written after the last state save are redone (identically): they are deleted."""
    shards = state["shards"]
    listed = {s["file"] for v in shards.values() for s in v}
    for p in _our_files(out_dir):
        if p.suffix == ".bin" and p.name not in listed:
            p.unlink()
    for v in shards.values():
        for s in v:
            p = out_dir / s["file"]
            if not p.is_file() or p.stat().st_size != s["tokens"] * dtype.itemsize:
                raise PrepareError(f"shard {p} of the unfinished run is missing or damaged; pass --overwrite "
                                   f"to start again")
    if verbose:
        print(f"resuming the unfinished run in {out_dir}: {len(shards['train'])} train / "
              f"{len(shards['val'])} val shards done")
    return {k: state[k] for k in ("resume", "emitted", "stats", "shards")}


def _encode_corpus(out_dir: Path, spec: dict, tok: Tokenizer, identity: dict, sources: list[Source],
                   progress: dict, split_mode: str, val_fraction: float, text_column: str | None,
                   on_bad_file: str, shard_tokens: int, verbose: bool) -> dict[str, ShardWriter]:
    """The pass over the corpus from progress["resume"] on: pieces -> encode batches -> split writers,
    with the state saved at every full shard. Updates progress["emitted"] and progress["stats"];
    returns the writers (their last shards not yet flushed)."""
    from tqdm.auto import tqdm

    emitted, stats, shards = progress["emitted"], progress["stats"], progress["shards"]
    state_path = out_dir / STATE_FILE
    dtype = dtype_for_vocab(tok.vocab_size)
    _replaced[0] = int(stats["replaced_invalid_utf8"])
    batch_start = {"pos": dict(progress["resume"]), "emitted": dict(emitted), "stats": json.loads(json.dumps(stats))}

    def save_state() -> None:
        atomic_write_json(state_path, {"spec": spec, "tokenizer": identity, "resume": batch_start["pos"],
                                       "emitted": batch_start["emitted"], "stats": batch_start["stats"],
                                       "shards": {s: w.shards for s, w in writers.items()}})

    def on_full(w: ShardWriter) -> None:
        # Cut the other split too, so that everything before this batch is in completed shards
        # and a resume restarts here (at most one batch of work is redone).
        for other in writers.values():
            if other is not w:
                other.flush()
        save_state()

    # skip: tokens between the resume position and the end of the last completed shard.
    writers = {s: ShardWriter(out_dir, s, dtype, shard_tokens, shards[s], on_full=on_full,
                              skip=sum(x["tokens"] for x in shards[s]) - emitted[s]) for s in ("train", "val")}
    save_state()  # marks out_dir as this run's, before the first shard

    eot = tok.eot_id
    is_bpe = isinstance(tok, BPETokenizer)
    threshold = int(val_fraction * 2**64)
    last_doc: list = [None, "train"]  # (file, doc) -> split of the last document: a long one comes in many pieces

    def doc_split(fi: int, doc: int) -> str:
        if last_doc[0] != (fi, doc):
            h = hashlib.blake2b(f"{sources[fi].key}:{doc}".encode(), digest_size=8).digest()
            last_doc[:] = [(fi, doc), "val" if int.from_bytes(h, "little") < threshold else "train"]
        return last_doc[1]

    bar = tqdm(total=sum(s.size for s in sources), initial=int(stats["bytes"]), unit="B", unit_scale=True,
               unit_divisor=1000, desc="tokenize", disable=not verbose, mininterval=0.5, smoothing=0.1)
    t_run = time.time()
    tokens_run = 0

    def run_batch(pieces: list[Piece]) -> None:
        nonlocal tokens_run
        texts = [p.text for p in pieces]
        ids = tok.encode_batch_ids(texts) if is_bpe else tok.encode_batch(texts)
        parts: dict[str, list] = {"train": [], "val": []}
        nbytes = 0.0
        for p, x in zip(pieces, ids):
            s = p.split or doc_split(p.pos["file"], p.doc)  # pos["file"] is the piece's own file
            if len(x):
                parts[s].append(x)
            if p.doc_end:
                if p.text:
                    stats["documents"] += 1
                    if eot is not None:
                        parts[s].append([eot] if is_bpe else np.array([eot], dtype=np.int64))
                else:  # a blank line, null or "" value
                    stats["empty_documents"] += 1
            stats["characters"] += len(p.text)
            nbytes += p.nbytes
        for s in ("train", "val"):
            arr = _to_array(parts[s], dtype)
            emitted[s] += int(arr.size)
            tokens_run += int(arr.size)
            writers[s].write(arr)
        stats["bytes"] += nbytes
        stats["replaced_invalid_utf8"] = _replaced[0]
        bar.update(max(0.0, min(nbytes, bar.total - bar.n)))  # float per-row shares may overshoot by a hair
        bar.set_postfix_str(f"{tokens_run / max(1e-9, time.time() - t_run):,.0f} tok/s", refresh=False)
        # The next batch starts after the last piece of this one.
        batch_start["pos"] = dict(pieces[-1].pos)
        batch_start["emitted"] = dict(emitted)
        batch_start["stats"] = json.loads(json.dumps(stats))

    # A parquet file skipped mid-way is appended to stats["skipped_files"]; its earlier rows stay
    # (deterministic on resume).
    pieces: list[Piece] = []
    n_chars = 0
    for piece in _iter_corpus(sources, progress["resume"], stats["skipped_files"], split_mode, val_fraction,
                              text_column, on_bad_file):
        pieces.append(piece)
        n_chars += len(piece.text)
        if n_chars >= BATCH_CHARS:
            run_batch(pieces)
            pieces, n_chars = [], 0
    if pieces:
        run_batch(pieces)
    bar.close()
    return writers


def report_problems(m: dict) -> None:
    """Print what tokenize replaced or skipped (also recorded in meta.json)."""
    if m.get("replaced_invalid_utf8"):
        print(f"warning: {m['replaced_invalid_utf8']:,} invalid UTF-8 sequences were replaced by U+FFFD")
    if m.get("empty_files"):
        print(f"warning: {len(m['empty_files'])} empty file(s) skipped: {', '.join(m['empty_files'][:5])}")
    if m.get("empty_documents"):
        print(f"note: {m['empty_documents']:,} empty documents skipped")
    for s in m.get("skipped_files", []):
        print(f"warning: skipped {s['path']}: {s['error']}")


def prepare_text(inputs: Sequence[str | Path], out_dir: str | Path, tokenizer: str | Tokenizer = "char",
                 val_fraction: float = 0.1, shard_tokens: int = 100_000_000, overwrite: bool = False,
                 verbose: bool = True) -> DatasetMeta:
    """Phase 1 entry point: `prepare` with the char tokenizer by default (same pipeline)."""
    return prepare(inputs, out_dir, tokenizer=tokenizer, val_fraction=val_fraction, shard_tokens=shard_tokens,
                   overwrite=overwrite, verbose=verbose)


def summarize(data_dir: str | Path) -> dict[str, Any]:
    """The statistics of a finished dataset, for notebooks and logs."""
    meta = read_meta(data_dir)
    m = meta.raw
    tokens = meta.tokens("train") + meta.tokens("val")
    return {
        "data_dir": str(meta.data_dir),
        "source files": len(m.get("sources", [])),
        "source MB": round(sum(s.get("size", 0) for s in m.get("sources", [])) / 1e6, 3),
        "documents": m.get("documents"),
        "train tokens": meta.tokens("train"),
        "val tokens": meta.tokens("val"),
        "characters per token": round(m.get("characters", 0) / max(1, tokens), 3),
        "tokenizer": meta.tokenizer.get("kind"),
        "vocab size": meta.vocab_size,
        "dtype": meta.dtype.name,
        "shards (train + val)": f"{len(meta.splits['train']['shards'])} + {len(meta.splits['val']['shards'])}",
        "validation split": m.get("split"),
        "invalid UTF-8 replaced": m.get("replaced_invalid_utf8", 0),
        "skipped files/row groups": len(m.get("skipped_files", [])),
        "seconds": m.get("elapsed_s"),
    }


def decoded_sample(data_dir: str | Path, n_tokens: int = 200, split: str = "val") -> str:
    """The first n_tokens of a split, decoded: a quick look that the data is what it should be."""
    meta = read_meta(data_dir)
    tok = load_tokenizer(meta.data_dir / meta.tokenizer.get("file", TOKENIZER_FILE))
    first = meta.shard_paths(split)[0]
    ids = np.fromfile(first, dtype=meta.dtype.newbyteorder("<"), count=n_tokens)
    return tok.decode(ids.tolist())
