"""HellaSwag (validation, 10,042 items), zero-shot, completion style, as build-nanogpt and llm.c score it.

Each item is a context and 4 endings; an ending is scored as the context's tokens followed by those of " " + ending.
The model picks the ending with the highest summed log-likelihood of its own tokens (`acc`) or the highest mean per
token (`acc_norm`, the figure usually quoted). GPT-2 124M scores acc 0.2859, acc_norm 0.2955 this way; chance 0.25.

Data: the canonical file, downloaded once, checked against its sha256 and cached (on Colab on Drive when mounted);
or a local file in the same jsonl format (`ctx`, `endings`, `label` per line), parsed as strictly.
Windows: when context + ending exceed the window, the context is cut from the left (the item counts as
`truncated`). An ending longer than the window itself (char models) is scored in pieces of block_size // 2 tokens,
each reading the block_size tokens before its end, so every ending token sees at least half a window of context.
Items with characters a char model cannot encode are `skipped`; accuracies are over the scored items (`n`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from gptlib.colab import DRIVE_SUBDIR, drive_mountpoint, in_colab
from gptlib.data.download import default_cache_dir as local_cache
from gptlib.data.download import fetch_verified
from gptlib.data.tokenizer import Tokenizer, TokenizerError
from gptlib.errors import EvalError
from gptlib.evaluation.likelihood import score_rows, scoring
from gptlib.runtime import unwrap_model

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


def default_cache_dir() -> Path:
    """$GPTLIB_CACHE or ~/.cache/gptlib; on Colab with Drive mounted, the Drive root's cache/ (survives the VM)."""
    if in_colab() and "GPTLIB_CACHE" not in os.environ:
        try:
            mp = drive_mountpoint()
            if (mp / "MyDrive").is_dir():  # only if already mounted: evaluation never mounts Drive itself
                return Path(os.environ.get("GPTLIB_ROOT") or mp / DRIVE_SUBDIR) / "cache"
        except OSError:  # a dead Drive mount: fall back to the VM's disk
            pass
    return local_cache()


def fetch_hellaswag(cache_dir: str | Path | None = None, url: str = HELLASWAG_URL, timeout: float = 60.0,
                    file_option: str = "--data FILE") -> Path:
    """Path of a verified canonical HellaSwag validation file: the cached copy, else downloaded into the cache.
    file_option: where the caller takes a local copy instead, for the message when the download fails."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return fetch_verified(url, cache / "hellaswag" / HELLASWAG_FILE, HELLASWAG_SHA256, EvalError, name="HellaSwag",
                          canonical=f"the canonical HellaSwag validation file, {HELLASWAG_BYTES:,} bytes",
                          local_hint=f"of {HELLASWAG_FILE} ({file_option})", timeout=timeout)


@dataclass
class Item:
    ctx: str
    endings: list[str]
    label: int
    line: int  # 1-based line in the file, for messages


def parse_items(text: str, where: str) -> list[Item]:
    """Items of a HellaSwag jsonl text; a malformed line raises naming the line, the field and the value."""
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
        items.append(Item(ctx=ctx, endings=list(endings), label=label, line=n))
    if not items:
        raise EvalError(f"{where}: no items (an empty file?)")
    return items


def load_items(source: str | Path | None = None, cache_dir: str | Path | None = None, url: str = HELLASWAG_URL,
               file_option: str = "--data FILE") -> tuple[list[Item], dict]:
    """Items and a description {path, sha256, canonical} of the file: a local path, or the canonical one
    (file_option: fetch_hellaswag's)."""
    path = Path(source) if source else fetch_hellaswag(cache_dir, url, file_option=file_option)
    if not path.is_file():
        raise EvalError(f"HellaSwag file {path} does not exist")
    data = path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise EvalError(f"{path}: line {line} is not UTF-8 text (byte {e.start})") from None
    items = parse_items(text, str(path))
    return items, {"path": str(path), "sha256": sha, "canonical": sha == HELLASWAG_SHA256}


def select(n: int, limit: int | None) -> list[int]:
    """A fixed subset of `limit` of n items, evenly spaced over the file (it is ordered by source, so
    the first N would all be ActivityNet); the same for every checkpoint and every run."""
    if not limit or limit >= n:
        return list(range(n))
    return [i * n // limit for i in range(limit)]


def ending_rows(ctx: Sequence[int], end: Sequence[int], block: int) -> tuple[list[list[int]], list[int], bool]:
    """Scoring rows (seq, k) for one ending after its context; True if the context had to be cut."""
    toks = list(ctx) + list(end)
    if len(end) <= block:  # the usual case: one row, the context cut from the left if need be
        start = max(0, len(toks) - block - 1)
        return [toks[start:]], [len(end)], start > 0
    step = max(1, block // 2)  # an ending longer than the window: pieces, each with >= block - step context
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


def _encode_all(tok: Tokenizer, texts: list[str]) -> list[list[int] | None]:
    """Token ids per text (BPE in parallel inside the library); None where a char vocabulary lacks a character."""
    if hasattr(tok, "encode_batch_ids"):
        return tok.encode_batch_ids(texts)
    out = []
    for t in texts:
        try:
            out.append(tok.encode(t))
        except TokenizerError:
            out.append(None)
    return out


def render(items: Sequence[Item], tok: Tokenizer, block_size: int) -> Rendered:
    """Tokenize items (context, then " " + each ending, as build-nanogpt) into scoring rows."""
    texts = [t for it in items for t in (it.ctx, *(" " + e for e in it.endings))]
    ids = _encode_all(tok, texts)
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
    return r


def evaluate_rendered(model, r: Rendered, device, dtype=None, batch_tokens: int | None = None,
                      progress: bool = False, desc: str = "hellaswag") -> dict:
    """Score rendered items -> {acc, acc_norm, n, truncated, skipped, sums (n, 4), preds, preds_norm}."""
    if r.n == 0:
        raise EvalError(f"no HellaSwag item could be scored: all {r.skipped} items have characters outside the "
                        f"model's vocabulary")
    with scoring(model, progress, total=len(r.seqs), desc=desc, unit="row") as (m, bar):
        row_ll = score_rows(m, r.seqs, r.ks, device, dtype, batch_tokens, bar.update)
    sums = np.zeros(4 * r.n)
    np.add.at(sums, np.asarray(r.ending_of), row_ll)
    sums = sums.reshape(r.n, 4)
    means = sums / np.maximum(np.asarray(r.counts, dtype=np.float64).reshape(r.n, 4), 1)
    labels = np.asarray(r.labels)
    preds, preds_norm = sums.argmax(1), means.argmax(1)  # ties go to the first ending, as torch's argmin
    return {"acc": float((preds == labels).mean()), "acc_norm": float((preds_norm == labels).mean()), "n": r.n,
            "truncated": r.truncated, "skipped": r.skipped, "sums": sums, "preds": preds, "preds_norm": preds_norm}


def evaluate_hellaswag(model, tok: Tokenizer, items: Sequence[Item], device, dtype=None,
                       batch_tokens: int | None = None, progress: bool = False) -> dict:
    """HellaSwag accuracy of a GPT on items (see the module docstring for the scoring)."""
    return evaluate_rendered(model, render(items, tok, unwrap_model(model).config.block_size), device, dtype,
                             batch_tokens, progress)


class HellaSwagProbe:
    """HellaSwag during training: the file read and the subset of `limit` items tokenized once, at start-up;
    `metrics(model, device, dtype)` scores it at chosen steps (full=True: every item, at the end of a run).
    If the file cannot be had (no network, a bad file) the probe logs one line and stays off: `metrics` returns {}
    and training goes on. Call it on rank 0 (wrappers are looked through); the model is scored in eval mode.
    """

    def __init__(self, tokenizer: Tokenizer, block_size: int, source: str | Path | Sequence[Item] | None = None,
                 limit: int | None = 1000, *, cache_dir: str | Path | None = None, batch_tokens: int = 16384,
                 log=print):
        self.tokenizer, self.block_size, self.limit, self.log = tokenizer, block_size, limit, log
        # Smaller batches than a standalone evaluation: the probe runs beside the training's own memory
        # (gpt2-small: ~2 GB of logits at 16K tokens instead of ~8 GB at 64K; the speed cost is not measured).
        self.batch_tokens = batch_tokens
        self.items: list[Item] = []
        self.file: dict = {"path": None, "sha256": None, "canonical": False}  # given items: no file
        self.reason: str | None = None  # why the probe is off
        self._full: Rendered | None = None
        try:
            if isinstance(source, (list, tuple)):
                self.items = list(source)
            else:
                self.items, self.file = load_items(source, cache_dir, file_option="hellaswag_file=FILE")
            self._subset = render([self.items[i] for i in select(len(self.items), limit)], tokenizer, block_size)
            if self._subset.n == 0:
                raise EvalError(f"none of the {self._subset.skipped} HellaSwag items can be encoded by this "
                                f"{tokenizer.kind} tokenizer")
        except (EvalError, OSError) as e:
            self.reason = str(e)
            log(f"hellaswag: off for this run ({e})")

    @property
    def available(self) -> bool:
        return self.reason is None

    def score(self, model, device, dtype: torch.dtype | None = None, full: bool = False) -> dict | None:
        """{acc, acc_norm, n, truncated, skipped, data, data_sha256, canonical} on the subset (or all items),
        or None when off."""
        if not self.available:
            return None
        if full and self._full is None:
            self._full = render(self.items, self.tokenizer, self.block_size)
        try:
            res = evaluate_rendered(model, self._full if full else self._subset, torch.device(device), dtype,
                                    self.batch_tokens)
        except torch.OutOfMemoryError as e:  # never let the probe end a long run
            self.reason = f"out of memory while scoring ({e})"
            self.log(f"hellaswag: off from now on: {self.reason}")
            return None
        return {**{k: res[k] for k in ("acc", "acc_norm", "n", "truncated", "skipped")},
                "data": self.file["path"], "data_sha256": self.file["sha256"], "canonical": self.file["canonical"]}

    def metrics(self, model, device, dtype: torch.dtype | None = None, full: bool = False) -> dict:
        """The score as metrics.jsonl fields: hellaswag_acc, hellaswag_acc_norm, hellaswag_n; {} when off."""
        return metrics_fields(self.score(model, device, dtype, full))


def metrics_fields(res: dict | None) -> dict:
    """A HellaSwagProbe.score() result as metrics.jsonl fields ({} for None: the probe is off)."""
    if res is None:
        return {}
    return {"hellaswag_acc": round(res["acc"], 6), "hellaswag_acc_norm": round(res["acc_norm"], 6),
            "hellaswag_n": res["n"]}
