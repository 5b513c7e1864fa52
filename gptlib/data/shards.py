"""The data format: `meta.json` (written last: a directory without it is incomplete), `tokenizer.json`, the shards
`train_000000.bin`, `val_000000.bin` ... (little-endian token ids, uint16 or uint32) and, for chat data, beside each
shard its assistant spans `train_000000.spans.bin` (int64 [start, end) pairs local to that shard, sorted, disjoint)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptlib.errors import DataFormatError
from gptlib.fsutil import (
    Progress,
    atomic_write,
    atomic_write_json,
    call_with_timeout,
    check_dir,
    sha256_file,
)

# META_FILE and PREPARE_STATE_FILE: imported from here by the data pipeline
from gptlib.layout import (  # noqa: F401
    CONFIG_FILE,
    META_FILE,
    PREPARE_STATE_FILE,
    STATE_FILE,
    TOKENIZER_FILE,
    checkpoints_dir,
)

FORMAT_VERSION = 1
SPAN_DTYPE = np.dtype("<i8")
# a shard write with no MB written for this long: hung (a shard of 100M tokens is 200 or 400 MB)
WRITE_TIMEOUT_S = 300.0


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def _clip_spans(spans: np.ndarray, lo: int, hi: int) -> np.ndarray:
    s = np.clip(spans, lo, hi) - lo
    return s[s[:, 1] > s[:, 0]]


def merge_spans(spans: np.ndarray) -> np.ndarray:
    """[a, b), [b, c) -> [a, c) in sorted disjoint spans."""
    if len(spans) < 2:
        return spans
    first = np.r_[True, spans[1:, 0] != spans[:-1, 1]]  # each merged span's first and last parts
    return np.stack([spans[first, 0], spans[np.r_[first[1:], True], 1]], axis=1)


def write_timed(path: Path, data: np.ndarray) -> None:
    # a hung Drive: given up (HungIOError) and said, where the progress bar stood still for good. A MB at a time, so
    # that a slow Drive (a large shard) is waited for while it moves, and a write given up stops at its next MB
    progress, raw = Progress(), data.reshape(-1).view(np.uint8)

    def write(f):
        for i in range(0, len(raw), 1 << 20):
            progress.tick(f.write(raw[i : i + (1 << 20)]))

    call_with_timeout(
        lambda: atomic_write(path, write), WRITE_TIMEOUT_S, progress, f"writing {path}"
    )


class ShardWriter:
    """Shards of at most shard_tokens tokens, each written atomically when full or cut early (the other split's
    shard filled: tokenize's resume point is then between shards of both); memory is one shard.
    A resumed run passes `shards`, the records of those on disk, and `skip`, the tokens they already hold. Chat data
    (with_spans): write(ids, spans) takes the assistant spans of `ids` too."""

    def __init__(
        self,
        out_dir: str | Path,
        split: str,
        dtype: np.dtype,
        shard_tokens: int = 100_000_000,
        shards: list[dict[str, Any]] | None = None,
        skip: int = 0,
        on_full=None,
        with_spans: bool = False,
    ):
        self.out_dir, self.split = Path(out_dir), split
        self.on_full, self.with_spans = on_full, with_spans
        self.dtype = np.dtype(dtype).newbyteorder("<")  # the files are little-endian
        self.shard_tokens, self.skip, self.filled = int(shard_tokens), int(skip), 0
        self.buffer = np.empty(self.shard_tokens, dtype=self.dtype)
        self.shards: list[dict[str, Any]] = list(shards or [])  # records of completed shards
        self.spans: list[np.ndarray] = []  # spans of the buffered tokens (offsets into the buffer)

    def write(self, ids: np.ndarray, spans: np.ndarray | None = None) -> None:
        if spans is None:
            spans = np.zeros((0, 2), np.int64)
        spans = np.asarray(spans, np.int64).reshape(-1, 2)
        if self.skip:
            k = min(self.skip, ids.size)
            ids, spans, self.skip = ids[k:], _clip_spans(spans, k, ids.size), self.skip - k
        pos = 0
        while pos < ids.size:
            take = min(self.shard_tokens - self.filled, ids.size - pos)
            if len(spans):
                self.spans.append(_clip_spans(spans, pos, pos + take) + self.filled)
            self.buffer[self.filled : self.filled + take] = ids[pos : pos + take]
            self.filled += take
            pos += take
            if self.filled == self.shard_tokens:
                self.flush()
                if self.on_full is not None:
                    self.on_full(self)

    def flush(self) -> None:
        if self.filled == 0:
            return
        name = f"{self.split}_{len(self.shards):06d}.bin"
        data = self.buffer[: self.filled]
        record = {
            "file": name,
            "tokens": int(self.filled),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        if self.with_spans:
            sp = merge_spans(np.concatenate([np.zeros((0, 2), np.int64), *self.spans]))
            sp = np.ascontiguousarray(sp, dtype=SPAN_DTYPE)
            sname = f"{self.split}_{len(self.shards):06d}.spans.bin"
            write_timed(self.out_dir / sname, sp)
            record["spans"] = {
                "file": sname,
                "count": int(len(sp)),
                "sha256": hashlib.sha256(sp).hexdigest(),
            }
            self.spans = []
        write_timed(self.out_dir / name, data)  # the rename made durable too
        self.shards.append(record)
        self.filled = 0

    def close(self) -> list[dict[str, Any]]:
        self.flush()
        return self.shards


@dataclass
class DatasetMeta:
    data_dir: Path
    vocab_size: int
    dtype: np.dtype
    tokenizer: dict[str, Any]  # {"kind", "hash", "vocab_size", "file"}
    # split -> {"tokens": int, "shards": [{"file", "tokens", "sha256"}]}
    splits: dict[str, dict[str, Any]]
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    def tokens(self, split: str) -> int:
        return int(self.splits[split]["tokens"])

    def shard_paths(self, split: str) -> list[Path]:
        return [self.data_dir / s["file"] for s in self.splits[split]["shards"]]

    @property
    def format(self) -> str:  # "text" or "chat"
        return str(self.raw.get("format", "text"))

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records of its data, to refuse resuming on other data (not the path: a copy resumes)."""
        shards = {
            split: [s.get("sha256") for s in rec.get("shards", [])]
            for split, rec in sorted(self.splits.items())
        }
        fingerprint = hashlib.sha256(json.dumps(shards, sort_keys=True).encode()).hexdigest()[:16]
        return {
            "tokenizer_kind": self.tokenizer.get("kind"),
            "tokenizer_hash": self.tokenizer.get("hash"),
            "vocab_size": self.vocab_size,
            "dtype": self.dtype.name,
            "train_tokens": self.tokens("train"),
            "val_tokens": self.tokens("val"),
            "tokens_sha256": fingerprint,
        }


def write_meta(
    out_dir: str | Path,
    *,
    vocab_size: int,
    tokenizer: dict[str, Any],
    splits: dict[str, list[dict[str, Any]]],
    sources: list[dict],
    extra: dict | None = None,
) -> None:
    atomic_write_json(
        Path(out_dir) / META_FILE,
        {
            "format_version": FORMAT_VERSION,
            "dtype": dtype_for_vocab(vocab_size).name,
            "vocab_size": int(vocab_size),
            "tokenizer": tokenizer,
            "splits": {
                s: {"tokens": int(sum(x["tokens"] for x in v)), "shards": v}
                for s, v in splits.items()
            },
            "sources": sources,
            **(extra or {}),
        },
    )


def read_meta(data_dir: str | Path) -> DatasetMeta:
    """meta.json checked against the files (sizes, counts, the tokenizer's sha256): DataFormatError names a mismatch."""
    data_dir = Path(data_dir)
    meta_path = data_dir / META_FILE
    # a file or a symlink loop is its own one-line error
    if not check_dir(data_dir, "data directory"):
        msg = f"data directory {data_dir} does not exist (run `python -m gptlib tokenize` first)"
        raise DataFormatError(msg)
    if not meta_path.is_file():
        raise DataFormatError(
            _run_dir_message(data_dir)
            or f"{meta_path} is missing: {data_dir} is not a finished gptlib dataset "
            f"(an interrupted tokenize run leaves no meta.json; run it again to finish)"
        )
    try:
        m = json.loads(meta_path.read_text())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise DataFormatError(f"{meta_path} is not valid JSON: {e}") from None
    try:
        return _checked_meta(data_dir, meta_path, m)
    except KeyError as e:  # a hand edit
        raise DataFormatError(f"{meta_path}: required field {e.args[0]!r} is missing") from None
    except (TypeError, AttributeError) as e:  # a field of the wrong shape
        msg = f"{meta_path}: malformed metadata ({type(e).__name__}: {e})"
        raise DataFormatError(msg) from None


def _run_dir_message(data_dir: Path) -> str | None:
    """What to pass instead, where a training run, or one of its checkpoints, is given as data."""
    states = [
        *data_dir.glob(STATE_FILE),
        *sorted(checkpoints_dir(data_dir).glob(f"step_*/{STATE_FILE}")),
    ]
    if not states and not (data_dir / CONFIG_FILE).is_file():
        return None
    try:
        instead = f"the data directory it was trained on, {json.loads(states[-1].read_text())['data_dir']}"
    except (IndexError, OSError, ValueError, KeyError, TypeError):
        instead = f"a data directory (what `python -m gptlib tokenize` wrote, with its {META_FILE})"
    return f"{data_dir} is a training run or a checkpoint of one, not a dataset: pass {instead}"


def _checked_meta(data_dir: Path, meta_path: Path, m: dict) -> DatasetMeta:
    def count(value, field: str) -> int:  # a hand edit may leave "32k" or 3.5
        if type(value) is not int or value < 0:
            msg = f"{meta_path}: {field} is {value!r}, expected a whole number >= 0"
            raise DataFormatError(msg)
        return value

    def shaped(value, kind: type, field: str):  # a hand edit may leave a string where a list goes
        if not isinstance(value, kind):
            expected = {dict: "an object", list: "a list", str: "a string"}[kind]
            raise DataFormatError(f"{meta_path}: {field} is {value!r:.80}, expected {expected}")
        return value

    if m["format_version"] != FORMAT_VERSION:
        raise DataFormatError(
            f"{meta_path}: format_version is {m['format_version']}, this gptlib reads {FORMAT_VERSION}"
        )
    vocab_size = count(m["vocab_size"], "vocab_size")
    dtype = dtype_for_vocab(vocab_size)
    tokenizer = shaped(m["tokenizer"], dict, "tokenizer")
    splits = shaped(m["splits"], dict, "splits")
    if m["dtype"] != dtype.name:
        raise DataFormatError(
            f"{meta_path}: dtype is {m['dtype']!r} but vocab_size={vocab_size} needs {dtype.name!r}"
        )
    for split in ("train", "val"):
        info, where = shaped(splits[split], dict, f"splits.{split}"), f"splits.{split}.shards"
        for i, s in enumerate(shaped(info["shards"], list, where)):
            shaped(s, dict, f"{where}[{i}]")
            shaped(s["file"], str, f"{where}[{i}].file")
        counted = sum(
            count(s["tokens"], f"{split} shard {s['file']!r} tokens") for s in info["shards"]
        )
        if counted != count(info["tokens"], f"{split}.tokens"):
            msg = f"{meta_path}: {split} tokens is {info['tokens']} but its shards hold {counted}"
            raise DataFormatError(msg)
        for s in info["shards"]:
            check_shard(data_dir, s, dtype, m.get("format") == "chat")
    tok_file = data_dir / shaped(tokenizer.get("file", TOKENIZER_FILE), str, "tokenizer.file")
    if not tok_file.is_file():
        raise DataFormatError(f"tokenizer file {tok_file} named in {meta_path} does not exist")
    want = shaped(tokenizer.get("hash") or "", str, "tokenizer.hash")
    if want and (got := sha256_file(tok_file)) != want:
        raise DataFormatError(
            f"{tok_file}: sha256 {got[:16]}... differs from meta.json tokenizer.hash "
            f"{want[:16]}...: the tokenizer was replaced after tokenizing"
        )
    return DatasetMeta(data_dir, vocab_size, dtype, tokenizer, splits, raw=m)


def _check_size(data_dir: Path, file: str, n: int, itemsize: int, what: str) -> Path:
    p = data_dir / file
    if not p.is_file():
        # a folder at the name (a copy gone wrong) is not a missing file
        found = "is a folder, not a file" if p.is_dir() else "does not exist"
        raise DataFormatError(f"{what} {p} listed in {data_dir / META_FILE} {found}")
    size, expected = p.stat().st_size, int(n) * itemsize
    if size != expected:
        raise DataFormatError(
            f"{what} {p}: file size is {size} bytes but meta.json says {n} x {itemsize} bytes = "
            f"{expected} bytes"
        )
    return p


def check_shard(data_dir: Path, s: dict, dtype: np.dtype, chat: bool = False) -> None:
    _check_size(data_dir, s["file"], s["tokens"], dtype.itemsize, "shard")
    if chat or "spans" in s:
        sp, n = _load_spans(data_dir, s), int(s["tokens"])
        bad = (sp[:, 0] < 0) | (sp[:, 1] <= sp[:, 0]) | (sp[:, 1] > n)
        if bad.any() or (sp[1:, 0] < sp[:-1, 1]).any():
            raise DataFormatError(
                f"spans file {data_dir / s['spans']['file']}: the spans are not sorted, disjoint, "
                f"non-empty ranges within the shard's {n} tokens"
            )


def _load_spans(data_dir: Path, shard: dict) -> np.ndarray:
    rec = shard.get("spans")
    if not isinstance(rec, dict) or "file" not in rec or "count" not in rec:
        raise DataFormatError(
            f"{data_dir / META_FILE}: shard {shard['file']} of chat data has no spans record "
            f'(expected "spans": {{"file", "count", "sha256"}})'
        )
    p = _check_size(data_dir, rec["file"], rec["count"], 2 * SPAN_DTYPE.itemsize, "spans file")
    return np.fromfile(p, dtype=SPAN_DTYPE).reshape(-1, 2)


def read_spans(meta: DatasetMeta, split: str) -> np.ndarray:
    """(N, 2) [start, end) offsets into the split's token stream, a turn cut by a shard boundary joined again."""
    if meta.format != "chat":
        raise DataFormatError(
            f"{meta.data_dir} holds {meta.format!r} data, which has no assistant spans; "
            f"tokenize conversations with --format chat"
        )
    shards = meta.splits[split]["shards"]
    offsets = np.cumsum([0] + [int(s["tokens"]) for s in shards])
    spans = [_load_spans(meta.data_dir, s).astype(np.int64) + o for s, o in zip(shards, offsets)]
    return merge_spans(np.concatenate([np.zeros((0, 2), np.int64), *spans]))


def find_dataset(name: str = "", data_dir: str | Path = "", roots=None) -> Path:
    """Notebooks 03 and 05: DATA_DIR, else gptlib's data folder for NAME (on Drive on Colab)."""
    from gptlib import colab

    roots = roots or colab.setup()
    d = Path(str(data_dir).strip()) if str(data_dir).strip() else colab.data_dir(name, roots)
    # a DATA_DIR on Drive, mounted before it is looked at (a fresh VM, or a GPTLIB_ROOT off Drive: not yet)
    colab.mount_for(d)
    if not (d / META_FILE).is_file():
        found = sorted(p.parent.name for p in d.parent.glob(f"*/{META_FILE}"))
        # notebook 01 stopped (a disconnect) or still running in another tab: it resumes
        unfinished = (d / PREPARE_STATE_FILE).is_file()
        why = "unfinished: run notebook 01 again" if unfinished else "run notebook 01 first"
        raise DataFormatError(
            f"no tokenized dataset at {d} ({why}); datasets in {d.parent}: {', '.join(found) or 'none'}"
        )
    return d
