"""The pre-tokenized data format: token shards plus `meta.json`, checked on every load.

A data directory holds:

    meta.json            written last; a directory without it is incomplete
    tokenizer.json       the tokenizer the tokens were made with
    train_000000.bin ... raw little-endian token ids, dtype from meta (uint16 or uint32)
    val_000000.bin   ...

`meta.json` records the format version, dtype, vocab size, tokenizer identity, source files,
and per split the token count and each shard (file, tokens, sha256). `read_meta` refuses any
disagreement between the metadata and the files, naming the file, the field and both values.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .fsutil import TMP_MARKER, atomic_write_json, fsync_dir, sha256_file

FORMAT_VERSION = 1
META_FILE = "meta.json"
SPLITS = ("train", "val")


class DataFormatError(ValueError):
    """The data directory's metadata and files disagree, or a file is missing."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 holds ids 0..65535, so a vocab of up to 65,536 ids; beyond that uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


class ShardWriter:
    """Appends token arrays to `{split}_NNNNNN.bin` shards of exactly shard_tokens tokens (but the
    last); each shard is written atomically when full. Memory is one shard's buffer.

    For a resumed tokenize run: `shards` are the records of the shards already on disk (new ones are
    numbered after them), `skip` drops the first tokens written (those shards already hold them),
    and `on_full(writer)` is called after every full shard.
    """

    def __init__(self, out_dir: str | Path, split: str, dtype: np.dtype, shard_tokens: int = 100_000_000,
                 shards: list[dict[str, Any]] | None = None, skip: int = 0, on_full=None):
        self.out_dir = Path(out_dir)
        self.split = split
        self.dtype = np.dtype(dtype).newbyteorder("<")  # the files are little-endian
        self.shard_tokens = int(shard_tokens)
        self.buffer = np.empty(self.shard_tokens, dtype=self.dtype)
        self.filled = 0
        self.shards: list[dict[str, Any]] = list(shards or [])  # records of completed shards
        self.skip = int(skip)
        self.on_full = on_full

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        if ids.dtype != self.dtype and ids.size:  # an unsigned array of the shard's own dtype is in range by type
            if int(ids.max()) > np.iinfo(self.dtype).max or int(ids.min()) < 0:
                raise DataFormatError(f"token ids span {int(ids.min())}..{int(ids.max())}, outside the "
                                      f"{self.dtype.name} shards' range")
        if self.skip:
            k = min(self.skip, ids.size)
            ids = ids[k:]
            self.skip -= k
        pos = 0
        while pos < ids.size:
            take = min(self.shard_tokens - self.filled, ids.size - pos)
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
        path = self.out_dir / name
        data = self.buffer[: self.filled]
        tmp = path.with_name(name + TMP_MARKER + str(os.getpid()))
        with open(tmp, "wb") as f:
            data.tofile(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # the final name only ever holds a complete shard
        fsync_dir(self.out_dir)
        self.shards.append({"file": name, "tokens": int(self.filled), "sha256": hashlib.sha256(data).hexdigest()})
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

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records about its data, to refuse resuming on different data."""
        return {"tokenizer_kind": self.tokenizer.get("kind"), "tokenizer_hash": self.tokenizer.get("hash"),
                "vocab_size": self.vocab_size, "dtype": self.dtype.name}


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


def _read_meta(data_dir: Path, verify_hashes: bool) -> DatasetMeta:
    data_dir = Path(data_dir)
    meta_path = data_dir / META_FILE
    if not data_dir.is_dir():
        raise DataFormatError(f"data directory {data_dir} does not exist (run `python -m gptlib tokenize` first)")
    if not meta_path.is_file():
        raise DataFormatError(
            f"{meta_path} is missing: {data_dir} is not a finished gptlib dataset "
            f"(an interrupted tokenize run leaves no meta.json; run it again to finish)"
        )
    try:
        m = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataFormatError(f"{meta_path} is not valid JSON: {e}") from None

    def need(key: str):
        if key not in m:
            raise DataFormatError(f"{meta_path}: required field {key!r} is missing")
        return m[key]

    version = need("format_version")
    if version != FORMAT_VERSION:
        raise DataFormatError(f"{meta_path}: format_version is {version}, this gptlib reads {FORMAT_VERSION}")
    vocab_size = int(need("vocab_size"))
    dtype_name = need("dtype")
    expected_dtype = dtype_for_vocab(vocab_size)
    if dtype_name != expected_dtype.name:
        raise DataFormatError(
            f"{meta_path}: dtype is {dtype_name!r} but vocab_size={vocab_size} needs {expected_dtype.name!r}"
        )
    tokenizer = need("tokenizer")
    if tokenizer.get("vocab_size") is not None and int(tokenizer["vocab_size"]) != vocab_size:
        raise DataFormatError(f"{meta_path}: vocab_size is {vocab_size} but tokenizer.vocab_size is "
                              f"{tokenizer['vocab_size']}")
    splits = need("splits")
    itemsize = expected_dtype.itemsize
    for split in SPLITS:
        if split not in splits:
            raise DataFormatError(f"{meta_path}: split {split!r} is missing")
        info = splits[split]
        counted = sum(int(s["tokens"]) for s in info["shards"])
        if counted != int(info["tokens"]):
            raise DataFormatError(f"{meta_path}: {split} tokens is {info['tokens']} but its shards hold {counted}")
        for s in info["shards"]:
            p = data_dir / s["file"]
            if not p.is_file():
                raise DataFormatError(f"shard {p} listed in {meta_path} does not exist")
            size = p.stat().st_size
            if size != int(s["tokens"]) * itemsize:
                raise DataFormatError(
                    f"shard {p}: file size is {size} bytes but meta.json says {s['tokens']} tokens x "
                    f"{itemsize} bytes ({expected_dtype.name}) = {int(s['tokens']) * itemsize} bytes"
                )
            if verify_hashes and s.get("sha256") and sha256_file(p) != s["sha256"]:
                raise DataFormatError(f"shard {p}: sha256 differs from meta.json (the file was modified or corrupted)")
    tok_file = data_dir / tokenizer.get("file", "tokenizer.json")
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


def load_split(meta: DatasetMeta, split: str) -> np.ndarray:
    """All tokens of a split as one in-RAM array (for small data and tests; training reads shards itself)."""
    paths = meta.shard_paths(split)
    if len(paths) == 1:
        return np.fromfile(paths[0], dtype=meta.dtype.newbyteorder("<"))
    return np.concatenate([np.fromfile(p, dtype=meta.dtype.newbyteorder("<")) for p in paths])
