"""What the tokenize tests share (test_prepare, test_chat, test_max_tokens, test_remote, test_hub): a small
corpus and its BPE, a dataset's tokens and its shards checked against meta.json, a kill at the n-th encode call, and
a child process slowed, then killed or stopped mid-run."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np

from gptlib.data.shards import PREPARE_STATE_FILE, DatasetMeta, read_meta
from gptlib.data.tokenizer import BPETokenizer


def speeches(shakespeare_path: Path, chars: int) -> list[str]:
    """The speeches (paragraphs) of Tiny Shakespeare's first `chars` characters: short documents."""
    return [d for d in shakespeare_path.read_text()[:chars].split("\n\n") if d.strip()]


def small_bpe(docs: list[str], directory: Path) -> Path:
    """A 300-id byte-level BPE trained on docs, saved in directory -> its tokenizer.json."""
    return BPETokenizer.train(iter(docs), vocab_size=300).save(directory)


def split_tokens(meta: DatasetMeta, split: str) -> np.ndarray:
    """All tokens of a split, its shards in order."""
    return np.concatenate(
        [np.fromfile(p, dtype=meta.dtype.newbyteorder("<")) for p in meta.shard_paths(split)]
    )


def verified_meta(data_dir: Path) -> DatasetMeta:
    """read_meta, and every shard's and spans file's sha256 as meta.json records it."""
    meta = read_meta(data_dir)
    for rec in meta.splits["train"]["shards"] + meta.splits["val"]["shards"]:
        for r in (rec, rec.get("spans")):
            if r is not None:
                got = hashlib.sha256((meta.data_dir / r["file"]).read_bytes()).hexdigest()
                assert got == r["sha256"], (
                    f"{r['file']}: sha256 {got} differs from meta.json's {r['sha256']}"
                )
    return meta


class Killed(BaseException):
    """Stands for a kill: not an Exception, so nothing in the pipeline can catch it."""


def kill_at_encode_call(monkeypatch, n: int):
    """BPE encoding raises Killed at its n-th call from now -> the real method, to put back."""
    real = BPETokenizer.encode_batch_ids
    calls = {"n": 0}

    def encode(self, texts):
        calls["n"] += 1
        if calls["n"] == n:
            raise Killed()
        return real(self, texts)

    monkeypatch.setattr(BPETokenizer, "encode_batch_ids", encode)
    return real


# A child's prelude: batches of 20,000 characters and 0.15 s after each shard, so that a test can kill it
# after a few shards. `python -c SLOW_TOKENIZE ARGS...` is `python -m gptlib ARGS...` so slowed.
SLOW_PRELUDE = """
import sys, time
import gptlib.data.encode as genc
genc.BATCH_CHARS = 20_000
flush = genc.ShardWriter.flush
def slow_flush(self):
    flush(self)
    time.sleep(0.15)
genc.ShardWriter.flush = slow_flush
"""
SLOW_TOKENIZE = (
    SLOW_PRELUDE
    + """
from gptlib.__main__ import main
sys.exit(main(sys.argv[1:]))
"""
)


# Added to a child's prelude: every fsync takes 0.2 s more, so a shard's temp file stays on disk long enough for a
# test to see it (and to stop the child while it is there).
SLOW_FSYNC = """
import os, time
_fsync = os.fsync
def slow_fsync(fd):
    time.sleep(0.2)
    _fsync(fd)
os.fsync = slow_fsync
"""


def wait_for_shards(
    proc: subprocess.Popen, out: Path, n: int, timeout: float = 60, split: str = "train"
) -> None:
    """Return once the tokenize state in `out` lists n shards of split (proc still running)."""
    state = out / PREPARE_STATE_FILE
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if len(json.loads(state.read_text())["shards"][split]) >= n:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        assert proc.poll() is None, "the child finished before it listed the shards"
        time.sleep(0.02)
    raise AssertionError(f"{state} did not list {n} {split} shards within {timeout} s")


def sigkill_after_shards(proc: subprocess.Popen, out: Path, n: int, timeout: float = 60) -> None:
    """SIGKILL proc once the tokenize state in `out` lists n train shards."""
    wait_for_shards(proc, out, n, timeout)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
