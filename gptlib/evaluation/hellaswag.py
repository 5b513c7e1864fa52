"""HellaSwag (validation, 10,042 items), zero-shot, completion style, as build-nanogpt and llm.c score it: the context's
tokens then those of " " + ending; the model picks the ending with the highest summed log-likelihood of its own tokens
(`acc`) or mean per token (`acc_norm`, the figure usually quoted)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from gptlib.data.download import default_cache_dir, fetch_verified
from gptlib.data.tokenizer import Tokenizer, TokenizerError
from gptlib.errors import EvalError
from gptlib.evaluation.likelihood import score_rows, scoring

# The canonical validation file; sha256 and size as TensorFlow Datasets records them for this URL
# (tensorflow_datasets/url_checksums/hellaswag.txt).
HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_SHA256 = "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588"
HELLASWAG_BYTES = 12_246_618
HELLASWAG_ITEMS = 10_042
HELLASWAG_FILE = "hellaswag_val.jsonl"

# OpenAI's GPT-2 124M scored the same way: build-nanogpt hellaswag.py (and llm.c dev/data/hellaswag.py),
# "gpt2 (124M) ... this script: 10042 acc: 0.2859 acc_norm: 0.2955 (completion style)".
GPT2_124M = {"acc": 0.2859, "acc_norm": 0.2955, "n": HELLASWAG_ITEMS,
             "source": "karpathy/build-nanogpt hellaswag.py (OpenAI GPT-2 124M weights, completion style)"}


def fetch_hellaswag(file_option: str = "--data FILE") -> Path:
    """The canonical file, sha256-checked, downloaded once into the cache. file_option: how the caller takes a local
    copy instead, for the message when the download fails."""
    return fetch_verified(HELLASWAG_URL, default_cache_dir() / "hellaswag" / HELLASWAG_FILE, HELLASWAG_SHA256,
                          EvalError, name="HellaSwag", local_hint=f"of {HELLASWAG_FILE} ({file_option})",
                          canonical=f"the canonical HellaSwag validation file, {HELLASWAG_BYTES:,} bytes", timeout=60)


@dataclass
class Item:
    ctx: str
    endings: list[str]
    label: int


def parse_items(text: str, where: str) -> list[Item]:
    """Input data, not a log: a bad line is an error naming the line, the field and the value (fsutil.read_jsonl
    would skip it, and the accuracy would be over other items than the user gave)."""
    items = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise EvalError(f"{where}: line {n} is not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise EvalError(f"{where}: line {n} is a JSON {type(obj).__name__}, expected an object with "
                            f"ctx, endings, label")
        for key in ("ctx", "endings", "label"):
            if key not in obj:
                raise EvalError(f"{where}: line {n}: field {key!r} is missing")
        ctx, endings, label = obj["ctx"], obj["endings"], obj["label"]
        if not isinstance(ctx, str) or not ctx:
            raise EvalError(f"{where}: line {n}: field 'ctx' is {ctx!r}, expected a non-empty string")
        if not isinstance(endings, list) or len(endings) != 4 or not all(isinstance(e, str) for e in endings):
            raise EvalError(f"{where}: line {n}: field 'endings' is {str(endings)[:80]}, expected a list of 4 strings")
        if isinstance(label, str) and label.strip().isdigit():  # some copies store the label as "3"
            label = int(label)
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label <= 3:
            raise EvalError(f"{where}: line {n}: field 'label' is {label!r}, expected 0, 1, 2 or 3")
        items.append(Item(ctx=ctx, endings=list(endings), label=label))
    if not items:
        raise EvalError(f"{where}: no items (an empty file?)")
    return items


def load_items(source: str | Path | None = None, file_option: str = "--data FILE") -> tuple[list[Item], dict]:
    """The items of a local file, or of the canonical one (None), and the file {path, sha256, canonical}."""
    path = Path(source) if source else fetch_hellaswag(file_option)
    if not path.is_file():
        raise EvalError(f"HellaSwag file {path} does not exist")
    data = path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise EvalError(f"{path}: line {line} is not UTF-8 text (byte {e.start})") from None
    return parse_items(text, str(path)), {"path": str(path), "sha256": sha, "canonical": sha == HELLASWAG_SHA256}


def select(n: int, limit: int | None) -> list[int]:
    """`limit` of n items, evenly spaced: the file is ordered by source (the first N would all be ActivityNet), and
    every checkpoint and run gets the same subset."""
    if not limit or limit >= n:
        return list(range(n))
    return [i * n // limit for i in range(limit)]


def ending_rows(ctx: Sequence[int], end: Sequence[int], block: int) -> tuple[list[list[int]], list[int], bool]:
    """Scoring rows (seq, k) for one ending after its context; True if the context had to be cut. An ending longer
    than the window (char models) is scored in pieces of block // 2 tokens, each reading the block tokens before
    its end."""
    toks = list(ctx) + list(end)
    if len(end) <= block:  # the usual case: one row, the context cut from the left if need be
        start = max(0, len(toks) - block - 1)
        return [toks[start:]], [len(end)], start > 0
    step = max(1, block // 2)
    seqs, ks = [], []
    for a in range(len(ctx), len(toks), step):
        b = min(len(toks), a + step)
        seqs.append(toks[max(0, b - block - 1): b])
        ks.append(b - a)
    return seqs, ks, True


@dataclass
class Rendered:
    """Items as scoring rows: row r belongs to ending ending_of[r] (item * 4 + ending)."""

    seqs: list[list[int]] = field(default_factory=list)
    ks: list[int] = field(default_factory=list)
    ending_of: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # tokens per ending, 4 per item
    labels: list[int] = field(default_factory=list)
    truncated: int = 0  # items whose context was cut
    skipped: int = 0  # items the tokenizer cannot encode (char vocabularies)

    @property
    def n(self) -> int:
        return len(self.labels)


def _encode(tok: Tokenizer, text: str) -> list[int] | None:
    try:
        return tok.encode(text)
    except TokenizerError:  # a character the char vocabulary lacks
        return None


def render(items: Sequence[Item], tok: Tokenizer, block_size: int) -> Rendered:
    """Tokenize items (context, then " " + each ending, as build-nanogpt) into scoring rows."""
    texts = [t for it in items for t in (it.ctx, *(" " + e for e in it.endings))]
    ids = tok.encode_batch_ids(texts) if hasattr(tok, "encode_batch_ids") else [_encode(tok, t) for t in texts]
    r = Rendered()
    for i, it in enumerate(items):
        ctx, ends = ids[5 * i], ids[5 * i + 1: 5 * i + 5]
        if ctx is None or any(e is None for e in ends) or not ctx:
            r.skipped += 1
            continue
        cut = False
        for e_idx, end in enumerate(ends):
            seqs, ks, c = ending_rows(ctx, end, block_size)
            cut |= c
            r.seqs += seqs
            r.ks += ks
            r.ending_of += [4 * r.n + e_idx] * len(seqs)
            r.counts.append(len(end))
        r.labels.append(it.label)
        r.truncated += cut
    if r.n == 0:
        raise EvalError(f"no HellaSwag item can be scored: all {r.skipped} have characters outside the {tok.kind} "
                        f"tokenizer's vocabulary")
    return r


def evaluate_rendered(model, r: Rendered, device, dtype=None, batch_tokens: int | None = None,
                      progress: bool = False, desc: str = "hellaswag") -> dict:
    """-> {acc, acc_norm, n, truncated, skipped, sums: (n, 4) log-likelihoods of the endings}."""
    with scoring(model, progress, total=len(r.seqs), desc=desc, unit="row") as (m, bar):
        row_ll = score_rows(m, r.seqs, r.ks, device, dtype, batch_tokens, bar.update)
    sums = np.zeros(4 * r.n)
    np.add.at(sums, np.asarray(r.ending_of), row_ll)
    sums = sums.reshape(r.n, 4)
    means = sums / np.maximum(np.asarray(r.counts, dtype=np.float64).reshape(r.n, 4), 1)
    labels = np.asarray(r.labels)
    # argmax: ties go to the first ending, as torch's argmax in build-nanogpt
    return {"acc": float((sums.argmax(1) == labels).mean()), "acc_norm": float((means.argmax(1) == labels).mean()),
            "n": r.n, "truncated": r.truncated, "skipped": r.skipped, "sums": sums}


def row_fields(res: dict, file: dict) -> dict:
    return {**{k: res[k] for k in ("n", "acc", "acc_norm", "truncated", "skipped")}, "data": file["path"],
            "data_sha256": file["sha256"], "canonical": file["canonical"]}


class HellaSwagProbe:
    """HellaSwag during training: a subset of `limit` items tokenized once, at start-up, scored at chosen steps
    (full: every item, at the end of a run). Without the file (no network, a bad file) the probe logs one line and
    stays off (score() is None): training never stops for it."""

    def __init__(self, tokenizer: Tokenizer, block_size: int, source: str | Path | None = None,
                 limit: int | None = 1000, log=print):
        self.tokenizer, self.block_size, self.log = tokenizer, block_size, log
        self.reason: str | None = None  # why the probe is off
        self._full: Rendered | None = None
        try:
            self.items, self.file = load_items(source, file_option="hellaswag_file=FILE")
            self._subset = render([self.items[i] for i in select(len(self.items), limit)], tokenizer, block_size)
        except (EvalError, OSError) as e:
            self.reason = str(e)
            log(f"hellaswag: off for this run ({e})")

    def score(self, model, device, dtype: torch.dtype | None = None, full: bool = False) -> dict | None:
        if self.reason is not None:
            return None
        if full and self._full is None:
            self._full = render(self.items, self.tokenizer, self.block_size)
        try:
            res = evaluate_rendered(model, self._full if full else self._subset, torch.device(device), dtype,
                                    16384)  # beside training's memory: gpt2-small ~2 GB of logits, not ~8 GB at 64K
        except torch.OutOfMemoryError as e:  # never let the probe end a long run
            self.reason = f"out of memory while scoring ({e})"
            self.log(f"hellaswag: off from now on: {self.reason}")
            return None
        return row_fields(res, self.file)


def metrics_fields(res: dict | None) -> dict:
    if res is None:
        return {}
    return {"hellaswag_acc": round(res["acc"], 6), "hellaswag_acc_norm": round(res["acc_norm"], 6),
            "hellaswag_n": res["n"]}
