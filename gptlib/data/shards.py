"""The pre-tokenized data format: token shards plus `meta.json`, checked on every load.

A data directory holds:

    meta.json            written last; a directory without it is incomplete
    tokenizer.json       the tokenizer the tokens were made with
    train_000000.bin ... raw little-endian token ids, dtype from meta (uint16 or uint32)
    val_000000.bin   ...
    train_000000.spans.bin ...  chat data only: the assistant spans of the shard beside it

`meta.json` records the format version, dtype, vocab size, tokenizer identity, source files,
and per split the token count and each shard (file, tokens, sha256). `read_meta` refuses any
disagreement between the metadata and the files, naming the file, the field and both values.

Chat data (`"format": "chat"`, chat.py) also has, beside each token shard, its assistant spans: raw
little-endian int64 pairs [start, end) of token offsets local to that shard, sorted and disjoint,
every one within the shard (a turn that a shard boundary cuts is two spans, one in each shard). The
shard's record names the file: `"spans": {"file", "count", "sha256"}`. `read_spans(meta, split)`
gives them as offsets into the split's whole token stream (shards concatenated in order), a turn cut
by a shard boundary joined again: what a fine-tuning run puts its loss on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptlib.errors import DataFormatError
from gptlib.fsutil import atomic_write, atomic_write_json, sha256_file
from gptlib.layout import TOKENIZER_FILE

FORMAT_VERSION = 1
META_FILE = "meta.json"
PREPARE_STATE_FILE = "prepare_state.json"  # present only while a tokenize run is unfinished (encode.py)
SPLITS = ("train", "val")


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 holds ids 0..65535, so a vocab of up to 65,536 ids; beyond that uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def spans_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.spans.bin"


SPAN_DTYPE = np.dtype("<i8")


def _clip_spans(spans: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The parts of spans within [lo, hi), shifted to start at lo; empty ones dropped."""
    s = np.clip(spans, lo, hi) - lo
    return s[s[:, 1] > s[:, 0]]


def merge_spans(spans: np.ndarray) -> np.ndarray:
    """Sorted disjoint spans with touching ones joined ([a, b), [b, c) -> [a, c))."""
    if len(spans) < 2:
        return spans
    new = np.ones(len(spans), dtype=bool)
    new[1:] = spans[1:, 0] != spans[:-1, 1]
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:] - 1, len(spans) - 1)
    return np.stack([spans[starts, 0], spans[ends, 1]], axis=1)


def _write_atomic(path: Path, data: np.ndarray) -> None:
    """The final name only ever holds a complete file; an interrupted write (Ctrl-C) leaves no temp file."""
    atomic_write(path, data.tofile)


class ShardWriter:
    """Appends token arrays to `{split}_NNNNNN.bin` shards of exactly shard_tokens tokens (but the
    last); each shard is written atomically when full. Memory is one shard's buffer.

    For a resumed tokenize run: `shards` are the records of the shards already on disk (new ones are
    numbered after them), `skip` drops the first tokens written (those shards already hold them),
    and `on_full(writer)` is called after every full shard.

    with_spans (chat data): write(ids, spans) also takes the assistant spans of `ids` (offsets into
    it); each shard gets its spans file, cut exactly at the shard's boundaries (and at `skip`, which
    is always a shard boundary), touching spans joined.
    """

    def __init__(self, out_dir: str | Path, split: str, dtype: np.dtype, shard_tokens: int = 100_000_000,
                 shards: list[dict[str, Any]] | None = None, skip: int = 0, on_full=None, with_spans: bool = False):
        self.out_dir = Path(out_dir)
        self.split = split
        self.dtype = np.dtype(dtype).newbyteorder("<")  # the files are little-endian
        self.shard_tokens = int(shard_tokens)
        self.buffer = np.empty(self.shard_tokens, dtype=self.dtype)
        self.filled = 0
        self.shards: list[dict[str, Any]] = list(shards or [])  # records of completed shards
        self.skip = int(skip)
        self.on_full = on_full
        self.with_spans = with_spans
        self.spans: list[np.ndarray] = []  # spans of the buffered tokens (offsets into the buffer)

    def write(self, ids: np.ndarray, spans: np.ndarray | None = None) -> None:
        ids = np.asarray(ids)
        if not self.with_spans:
            spans = None
        elif spans is None:
            spans = np.zeros((0, 2), np.int64)
        else:
            spans = np.asarray(spans, np.int64).reshape(-1, 2)
        if ids.dtype != self.dtype and ids.size:  # an unsigned array of the shard's own dtype is in range by type
            if int(ids.max()) > np.iinfo(self.dtype).max or int(ids.min()) < 0:
                raise DataFormatError(f"token ids span {int(ids.min())}..{int(ids.max())}, outside the "
                                      f"{self.dtype.name} shards' range")
        if self.skip:
            k = min(self.skip, ids.size)
            ids = ids[k:]
            self.skip -= k
            if spans is not None:
                spans = _clip_spans(spans, k, k + ids.size)
        pos = 0
        while pos < ids.size:
            take = min(self.shard_tokens - self.filled, ids.size - pos)
            if spans is not None and len(spans):
                self.spans.append(_clip_spans(spans, pos, pos + take) + self.filled)
            self.buffer[self.filled : self.filled + take] = ids[pos : pos + take]
            self.filled += take
            pos += take
            if self.filled == self.shard_tokens:
                self.flush()
                if self.on_full is not None:
                    self.on_full(self)

    def flush(self) -> None:
        """Write the buffered tokens (if any) as the next shard."""
        if self.filled == 0:
            return
        name = shard_name(self.split, len(self.shards))
        data = self.buffer[: self.filled]
        record = {"file": name, "tokens": int(self.filled), "sha256": hashlib.sha256(data).hexdigest()}
        if self.with_spans:
            sp = merge_spans(np.concatenate(self.spans) if self.spans else np.zeros((0, 2), np.int64))
            sp = np.ascontiguousarray(sp, dtype=SPAN_DTYPE)
            sname = spans_name(self.split, len(self.shards))
            _write_atomic(self.out_dir / sname, sp)
            record["spans"] = {"file": sname, "count": int(len(sp)), "sha256": hashlib.sha256(sp).hexdigest()}
            self.spans = []
        _write_atomic(self.out_dir / name, data)  # the rename made durable too (fsutil.atomic_write)
        self.shards.append(record)
        self.filled = 0

    def close(self) -> list[dict[str, Any]]:
        self.flush()
        return self.shards


@dataclass
class DatasetMeta:
    """The parsed `meta.json` of a data directory (see the module docstring)."""

    data_dir: Path
    vocab_size: int
    dtype: np.dtype
    tokenizer: dict[str, Any]  # {"kind", "hash", "vocab_size", "file"}
    splits: dict[str, dict[str, Any]]  # split -> {"tokens": int, "shards": [{"file", "tokens", "sha256"}]}
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    def tokens(self, split: str) -> int:
        return int(self.splits[split]["tokens"])

    def shard_paths(self, split: str) -> list[Path]:
        return [self.data_dir / s["file"] for s in self.splits[split]["shards"]]

    @property
    def format(self) -> str:
        """"text" (documents) or "chat" (conversations, with assistant spans)."""
        return str(self.raw.get("format", "text"))

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records about its data, to refuse resuming on different data: the tokenizer, and the
        tokens themselves (each split's count and a fingerprint of its shards' sha256, so other text or another
        split under the same tokenizer is seen; the directory's path is not part of it, a moved copy resumes)."""
        shards = {split: [s.get("sha256") for s in rec.get("shards", [])] for split, rec in sorted(self.splits.items())}
        fingerprint = hashlib.sha256(json.dumps(shards, sort_keys=True).encode()).hexdigest()[:16]
        return {"tokenizer_kind": self.tokenizer.get("kind"), "tokenizer_hash": self.tokenizer.get("hash"),
                "vocab_size": self.vocab_size, "dtype": self.dtype.name, "train_tokens": self.tokens("train"),
                "val_tokens": self.tokens("val"), "tokens_sha256": fingerprint}


def write_meta(out_dir: str | Path, *, vocab_size: int, tokenizer: dict[str, Any],
               splits: dict[str, list[dict[str, Any]]], sources: list[dict[str, Any]],
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write meta.json atomically, last, after every shard is on disk."""
    meta = {
        "format_version": FORMAT_VERSION,
        "dtype": dtype_for_vocab(vocab_size).name,
        "vocab_size": int(vocab_size),
        "tokenizer": tokenizer,
        "splits": {s: {"tokens": int(sum(x["tokens"] for x in shards)), "shards": shards}
                   for s, shards in splits.items()},
        "sources": sources,
    }
    if extra:
        meta.update(extra)
    atomic_write_json(Path(out_dir) / META_FILE, meta)
    return meta


def read_meta(data_dir: str | Path, verify_hashes: bool = False) -> DatasetMeta:
    """Parse and check meta.json against the files; raise DataFormatError naming any mismatch."""
    try:
        return _read_meta(Path(data_dir), verify_hashes)
    except (KeyError, TypeError, AttributeError) as e:  # a hand-edited meta.json with a field of the wrong shape
        raise DataFormatError(f"{Path(data_dir) / META_FILE}: malformed metadata ({type(e).__name__}: {e})") from None


def _check_shard(data_dir: Path, meta_path: Path, s: dict, dtype: np.dtype, verify_hashes: bool, chat: bool) -> None:
    """One shard of meta.json: there, of the size its token count says (and sha256), its spans file if chat data."""
    p, itemsize = data_dir / s["file"], dtype.itemsize
    if not p.is_file():
        raise DataFormatError(f"shard {p} listed in {meta_path} does not exist")
    size = p.stat().st_size
    if size != int(s["tokens"]) * itemsize:
        raise DataFormatError(f"shard {p}: file size is {size} bytes but meta.json says {s['tokens']} tokens x "
                              f"{itemsize} bytes ({dtype.name}) = {int(s['tokens']) * itemsize} bytes")
    if verify_hashes and s.get("sha256") and sha256_file(p) != s["sha256"]:
        raise DataFormatError(f"shard {p}: sha256 differs from meta.json (the file was modified or corrupted)")
    if chat or "spans" in s:
        _check_spans(data_dir, meta_path, s, verify_hashes)


def _meta_json(data_dir: Path) -> tuple[Path, dict]:
    """(meta.json's path, its contents); one line for a missing directory, an unfinished dataset, bad JSON."""
    meta_path = data_dir / META_FILE
    if not data_dir.is_dir():
        raise DataFormatError(f"data directory {data_dir} does not exist (run `python -m gptlib tokenize` first)")
    if not meta_path.is_file():
        raise DataFormatError(f"{meta_path} is missing: {data_dir} is not a finished gptlib dataset "
                              f"(an interrupted tokenize run leaves no meta.json; run it again to finish)")
    try:
        return meta_path, json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataFormatError(f"{meta_path} is not valid JSON: {e}") from None


def _read_meta(data_dir: Path, verify_hashes: bool) -> DatasetMeta:
    data_dir = Path(data_dir)
    meta_path, m = _meta_json(data_dir)

    def need(key: str):
        if key not in m:
            raise DataFormatError(f"{meta_path}: required field {key!r} is missing")
        return m[key]

    def count(value, field: str) -> int:
        """A count field: a whole number >= 0 (a hand edit may leave "32k" or 3.5)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
            raise DataFormatError(f"{meta_path}: {field} is {value!r}, expected a whole number >= 0")
        return int(value)

    version = need("format_version")
    if version != FORMAT_VERSION:
        raise DataFormatError(f"{meta_path}: format_version is {version}, this gptlib reads {FORMAT_VERSION}")
    vocab_size = count(need("vocab_size"), "vocab_size")
    dtype_name = need("dtype")
    expected_dtype = dtype_for_vocab(vocab_size)
    if dtype_name != expected_dtype.name:
        raise DataFormatError(
            f"{meta_path}: dtype is {dtype_name!r} but vocab_size={vocab_size} needs {expected_dtype.name!r}"
        )
    tokenizer = need("tokenizer")
    if tokenizer.get("vocab_size") is not None and count(tokenizer["vocab_size"], "tokenizer.vocab_size") != vocab_size:
        raise DataFormatError(f"{meta_path}: vocab_size is {vocab_size} but tokenizer.vocab_size is "
                              f"{tokenizer['vocab_size']}")
    splits = need("splits")
    for split in SPLITS:
        if split not in splits:
            raise DataFormatError(f"{meta_path}: split {split!r} is missing")
        info = splits[split]
        counted = sum(count(s["tokens"], f"{split} shard {s.get('file')!r} tokens") for s in info["shards"])
        if counted != count(info["tokens"], f"{split}.tokens"):
            raise DataFormatError(f"{meta_path}: {split} tokens is {info['tokens']} but its shards hold {counted}")
        for s in info["shards"]:
            _check_shard(data_dir, meta_path, s, expected_dtype, verify_hashes, m.get("format") == "chat")
    tok_file = data_dir / tokenizer.get("file", TOKENIZER_FILE)
    if not tok_file.is_file():
        raise DataFormatError(f"tokenizer file {tok_file} named in {meta_path} does not exist")
    if tokenizer.get("hash"):
        got = sha256_file(tok_file)
        if got != tokenizer["hash"]:
            raise DataFormatError(
                f"{tok_file}: sha256 {got[:16]}... differs from meta.json tokenizer.hash "
                f"{tokenizer['hash'][:16]}...: the tokenizer was replaced after tokenizing"
            )
    return DatasetMeta(data_dir=data_dir, vocab_size=vocab_size, dtype=expected_dtype, tokenizer=tokenizer,
                       splits=splits, raw=m)


def _load_shard_spans(data_dir: Path, meta_path: Path, shard: dict) -> tuple[Path, np.ndarray]:
    rec = shard.get("spans")
    if not isinstance(rec, dict) or "file" not in rec or "count" not in rec:
        raise DataFormatError(f"{meta_path}: shard {shard['file']} of chat data has no spans record "
                              f"(expected \"spans\": {{\"file\", \"count\", \"sha256\"}})")
    p = data_dir / rec["file"]
    if not p.is_file():
        raise DataFormatError(f"spans file {p} listed in {meta_path} does not exist")
    size = p.stat().st_size
    if size != int(rec["count"]) * 16:
        raise DataFormatError(f"spans file {p}: file size is {size} bytes but meta.json says {rec['count']} spans x "
                              f"16 bytes = {int(rec['count']) * 16} bytes")
    return p, np.fromfile(p, dtype=SPAN_DTYPE).reshape(-1, 2)


def _check_spans(data_dir: Path, meta_path: Path, shard: dict, verify_hashes: bool) -> None:
    """A shard's spans: the file's size, sorted and disjoint, non-empty, within the shard."""
    p, sp = _load_shard_spans(data_dir, meta_path, shard)
    n = int(shard["tokens"])
    if len(sp):
        bad = np.flatnonzero((sp[:, 0] < 0) | (sp[:, 1] <= sp[:, 0]) | (sp[:, 1] > n))
        if bad.size:
            i = int(bad[0])
            raise DataFormatError(f"spans file {p}: span {i} is [{sp[i, 0]}, {sp[i, 1]}), not a non-empty range "
                                  f"within the shard's {n} tokens")
        back = np.flatnonzero(sp[1:, 0] < sp[:-1, 1])
        if back.size:
            i = int(back[0]) + 1
            raise DataFormatError(f"spans file {p}: span {i} starts at {sp[i, 0]}, before span {i - 1} ends "
                                  f"({sp[i - 1, 1]}): spans must be sorted and disjoint")
    sha = shard["spans"].get("sha256")
    if verify_hashes and sha and hashlib.sha256(sp.tobytes()).hexdigest() != sha:
        raise DataFormatError(f"spans file {p}: sha256 differs from meta.json (the file was modified or corrupted)")


def read_spans(meta: DatasetMeta, split: str) -> np.ndarray:
    """The assistant spans of a chat dataset's split: an (N, 2) int64 array of [start, end) offsets into
    the split's token stream (its shards concatenated in order), sorted and disjoint; a turn that a
    shard boundary cut is one span again. The tokens at [start, end) are an assistant's content and
    its <|end|> (chat.py): the positions a fine-tuning loss is computed on."""
    if meta.format != "chat":
        raise DataFormatError(f"{meta.data_dir} holds {meta.format!r} data, which has no assistant spans; "
                              f"tokenize conversations with --format chat")
    meta_path = meta.data_dir / META_FILE
    parts = []
    offset = 0
    for shard in meta.splits[split]["shards"]:
        _, sp = _load_shard_spans(meta.data_dir, meta_path, shard)
        parts.append(sp + offset)
        offset += int(shard["tokens"])
    spans = np.concatenate(parts) if parts else np.zeros((0, 2), np.int64)
    return merge_spans(spans.astype(np.int64, copy=False))


def load_split(meta: DatasetMeta, split: str) -> np.ndarray:
    """All tokens of a split as one in-RAM array (for small data and tests; training reads shards itself)."""
    paths = meta.shard_paths(split)
    if len(paths) == 1:
        return np.fromfile(paths[0], dtype=meta.dtype.newbyteorder("<"))
    return np.concatenate([np.fromfile(p, dtype=meta.dtype.newbyteorder("<")) for p in paths])


def find_dataset(name: str = "", data_dir: str | Path = "", roots=None) -> Path:
    """Notebooks 03 and 05: DATA_DIR if given, else gptlib's data folder for NAME (on Drive on Colab, see
    colab.data_dir). A folder without a finished dataset is one error naming the datasets that are there."""
    from gptlib import colab

    d = Path(data_dir) if str(data_dir).strip() else colab.data_dir(name, roots)
    if not (d / META_FILE).is_file():
        found = sorted(p.parent.name for p in d.parent.glob(f"*/{META_FILE}"))
        raise DataFormatError(f"no tokenized dataset at {d} (run notebook 01 first); datasets in {d.parent}: "
                              f"{', '.join(found) or 'none'}")
    return d
