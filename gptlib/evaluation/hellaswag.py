"""HellaSwag, zero-shot, completion style, as build-nanogpt and llm.c score it (`acc`: the highest summed
log-likelihood, `acc_norm`: per token), and the batched log-likelihoods under it and bits per byte."""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from gptlib.data.download import default_cache_dir, fetch_verified
from gptlib.data.tokenizer import Tokenizer, TokenizerError
from gptlib.errors import EvalError, override
from gptlib.runtime import autocast_for, resolve_dtype, unwrap_model

# sha256 and size as TensorFlow Datasets records them (tensorflow_datasets/url_checksums/hellaswag.txt)
HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_SHA256 = "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588"
HELLASWAG_BYTES = 12_246_618
HELLASWAG_ITEMS = 10_042
HELLASWAG_FILE = "hellaswag_val.jsonl"

GPT2_124M = {
    "acc": 0.2859,
    "acc_norm": 0.2955,
    "n": HELLASWAG_ITEMS,
    "source": "karpathy/build-nanogpt hellaswag.py (OpenAI GPT-2 124M weights, completion style)",
}


def fetch_hellaswag(file_option: str = "--data FILE") -> Path:
    """The canonical file (cached, verified); file_option: how the caller takes a local copy."""
    return fetch_verified(
        HELLASWAG_URL,
        default_cache_dir() / "hellaswag" / HELLASWAG_FILE,
        HELLASWAG_SHA256,
        EvalError,
        name="HellaSwag",
        local_hint=f"of {HELLASWAG_FILE} ({file_option})",
        canonical=f"the canonical HellaSwag validation file, {HELLASWAG_BYTES:,} bytes",
    )


def default_batch_tokens(device: torch.device) -> int:
    return 65536 if device.type == "cuda" else 8192  # a GPU's throughput; a CPU's caches (measured)


@contextlib.contextmanager
def scoring(model: torch.nn.Module, progress: bool, **bar):
    """(the unwrapped model in eval mode, a tqdm bar shown with progress); the model's mode is restored after."""
    from tqdm.auto import tqdm

    m = unwrap_model(model)
    was_training = m.training
    with tqdm(disable=not progress, dynamic_ncols=True, leave=False, **bar) as b:
        try:
            yield m.eval(), b
        finally:
            m.train(was_training)


def pack_batches(lengths: Sequence[int], batch_tokens: int) -> list[np.ndarray]:
    """Row indices in batches of <= batch_tokens padded tokens, longest first; a longer row is a batch alone."""
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
    batches, start = [], 0
    while start < len(order):
        # the first (longest) row sets the padded length
        rows = max(1, batch_tokens // int(lengths[order[start]]))
        batches.append(order[start : start + rows])
        start += rows
    return batches


@torch.inference_mode()
def scored_nll(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    positions: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """NLL (nats, float32) of y.flatten()[positions], or of every target. positions are flat indices made on the
    host: a boolean mask on the GPU would make the host wait there to count its Trues. dtype None: training's."""
    m = unwrap_model(model)
    with autocast_for(x.device, dtype or resolve_dtype("auto", x.device)):
        h, y = m.hidden_states(x).flatten(0, 1), y.flatten()  # (B*T, C), (B*T,)
        if positions is not None:
            h, y = h.index_select(0, positions), y.index_select(0, positions)  # (N, C), (N,)
        return F.cross_entropy(m.head(h).float(), y, reduction="none")


@torch.inference_mode()
def score_rows(
    model: torch.nn.Module,
    seqs: Sequence[Sequence[int]],
    ks: Sequence[int],
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    batch_tokens: int | None = None,
    progress=None,
) -> np.ndarray:
    """Summed log-likelihood (nats, <= 0) of the last ks[i] tokens of each seqs[i] -> float64 (R,); progress(rows)
    after each batch. The sums stay on the device until the end (one read back); each batch's tokens are a blocking
    copy from pageable memory, so on a GPU the host waits for the previous batch there once per batch."""
    device = torch.device(device)
    out = torch.zeros(len(seqs), dtype=torch.float64, device=device)
    lengths = [len(s) - 1 for s in seqs]
    for idx in pack_batches(lengths, batch_tokens or default_batch_tokens(device)):
        # (B, L), padded on the right
        toks = np.zeros((len(idx), max(len(seqs[i]) for i in idx)), dtype=np.int64)
        mask = np.zeros((len(idx), toks.shape[1] - 1), dtype=bool)  # (B, L-1): the scored targets
        for j, i in enumerate(idx):
            n = len(seqs[i])
            toks[j, :n] = seqs[i]
            mask[j, n - 1 - ks[i] : n - 1] = True  # the last k targets
        pos = np.flatnonzero(mask)  # the scored targets' flat positions, row-major
        toks = torch.from_numpy(toks).to(device)
        nll = scored_nll(model, toks[:, :-1], toks[:, 1:], torch.from_numpy(pos).to(device), dtype)
        rows = torch.from_numpy(idx[pos // mask.shape[1]]).to(device)  # each scored target's row
        out.index_add_(0, rows, -nll.double())
        if progress is not None:
            progress(len(idx))
    return out.cpu().numpy()


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
        at = f"{where}: line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise EvalError(f"{at} is not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise EvalError(
                f"{at} is a JSON {type(obj).__name__}, expected an object with ctx, endings, label"
            )
        if missing := [key for key in ("ctx", "endings", "label") if key not in obj]:
            raise EvalError(f"{at}: field {missing[0]!r} is missing")
        ctx, endings, label = obj["ctx"], obj["endings"], obj["label"]
        if isinstance(label, str) and label.strip().isdigit():  # some copies store the label as "3"
            label = int(label)
        if not isinstance(ctx, str) or not ctx:
            raise EvalError(f"{at}: field 'ctx' is {ctx!r}, expected a non-empty string")
        four = isinstance(endings, list) and len(endings) == 4
        if not four or not all(isinstance(e, str) for e in endings):
            raise EvalError(
                f"{at}: field 'endings' is {str(endings)[:80]}, expected a list of 4 strings"
            )
        if type(label) is not int or not 0 <= label <= 3:  # not a bool, not 1.0
            raise EvalError(f"{at}: field 'label' is {label!r}, expected 0, 1, 2 or 3")
        # an escape "\\ud83d" without its pair (a cut emoji) is no text: refused as invalid UTF-8 is (load_items)
        for key, value in (("ctx", ctx), ("endings", "".join(endings))):
            try:
                value.encode()
            except UnicodeEncodeError as e:
                half = value[e.start]
                raise EvalError(
                    f"{at}: field {key!r} holds {half!r}, half of a surrogate pair (a cut emoji?), which "
                    f"is not text: remove it from the line"
                ) from None
        items.append(Item(ctx=ctx, endings=endings, label=label))
    if not items:
        raise EvalError(f"{where}: no items (an empty file?)")
    return items


def load_items(
    source: str | Path | None = None, file_option: str = "--data FILE"
) -> tuple[list[Item], dict]:
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
    file = {"path": str(path), "sha256": sha, "canonical": sha == HELLASWAG_SHA256}
    return parse_items(text, str(path)), file


def select(n: int, limit: int | None) -> list[int]:
    """`limit` of n items, evenly spaced: the file is ordered by source (the first N would all be ActivityNet), and
    every checkpoint and run gets the same subset."""
    if not limit or limit >= n:
        return list(range(n))
    return [i * n // limit for i in range(limit)]


def ending_rows(
    ctx: Sequence[int], end: Sequence[int], block: int
) -> tuple[list[list[int]], list[int], bool]:
    """Scoring rows (seq, k) for one ending, and whether the context was cut. An ending longer than the window (char
    models) is scored in pieces of block // 2 tokens, each reading the block tokens before its end."""
    toks = list(ctx) + list(end)
    if len(end) <= block:  # the usual case: one row, the context cut from the left if need be
        start = max(0, len(toks) - block - 1)
        return [toks[start:]], [len(end)], start > 0
    step = max(1, block // 2)
    # [a, b): scored tokens
    pieces = [(a, min(len(toks), a + step)) for a in range(len(ctx), len(toks), step)]
    return [toks[max(0, b - block - 1) : b] for _, b in pieces], [b - a for a, b in pieces], True


@dataclass
class Rendered:  # items as scoring rows: row r belongs to ending ending_of[r] (item * 4 + ending)
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


def render(items: Sequence[Item], tok: Tokenizer, block_size: int) -> Rendered:
    # as build-nanogpt
    texts = [t for it in items for t in (it.ctx, *(" " + e for e in it.endings))]
    if hasattr(tok, "encode_batch_ids"):
        ids = tok.encode_batch_ids(texts)
    else:
        ids = []
        for t in texts:
            try:
                ids.append(tok.encode(t))
            except TokenizerError:  # a character the char vocabulary lacks
                ids.append(None)
    r = Rendered()
    for i, it in enumerate(items):
        ctx, ends = ids[5 * i], ids[5 * i + 1 : 5 * i + 5]
        if not ctx or None in ends:  # None: a character the char vocabulary lacks
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
        raise EvalError(
            f"no HellaSwag item can be scored: all {r.skipped} have characters outside the {tok.kind} "
            f"tokenizer's vocabulary"
        )
    return r


def evaluate_rendered(
    model,
    r: Rendered,
    device,
    dtype=None,
    batch_tokens: int | None = None,
    progress: bool = False,
    desc: str = "hellaswag",
) -> dict:
    """-> {acc, acc_norm, their standard errors acc_se, acc_norm_se, n, truncated, skipped, sums: (n, 4)
    log-likelihoods of the endings}. An item is right or wrong: the binomial standard error sqrt(p(1 - p) / n)."""
    with scoring(model, progress, total=len(r.seqs), desc=desc, unit="row") as (m, bar):
        row_ll = score_rows(m, r.seqs, r.ks, device, dtype, batch_tokens, bar.update)
    # an ending's rows summed
    sums = np.bincount(r.ending_of, weights=row_ll, minlength=4 * r.n).reshape(r.n, 4)
    means = sums / np.asarray(r.counts).reshape(r.n, 4)  # every ending has a token: " " + ending
    # argmax: ties go to the first ending, as torch's argmax in build-nanogpt
    labels, out = np.asarray(r.labels), {}
    for name, scores in (("acc", sums), ("acc_norm", means)):
        p = float((scores.argmax(1) == labels).mean())
        out.update({name: p, f"{name}_se": (p * (1 - p) / r.n) ** 0.5})
    return {**out, "n": r.n, "truncated": r.truncated, "skipped": r.skipped, "sums": sums}


def row_fields(res: dict, file: dict) -> dict:
    return {
        **{k: v for k, v in res.items() if k != "sums"},
        "data": file["path"],
        "data_sha256": file["sha256"],
        "canonical": file["canonical"],
    }


class HellaSwagProbe:
    """HellaSwag during training: `limit` items tokenized once, scored at chosen steps (full: all, at the end).
    Without the file the probe logs one line and stays off (score() is None): training never stops for it."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        block_size: int,
        source: str | Path | None = None,
        limit: int | None = 1000,
        log=print,
    ):
        self.tokenizer, self.block_size, self.log = tokenizer, block_size, log
        self.reason: str | None = None  # why the probe is off
        self._full: Rendered | None = None
        try:
            self.items, self.file = load_items(source, file_option=override("hellaswag_file=FILE"))
            self._subset = render(
                [self.items[i] for i in select(len(self.items), limit)], tokenizer, block_size
            )
        except (EvalError, OSError) as e:
            self.reason = str(e)
            log(f"hellaswag: off for this run ({e})")

    def score(
        self, model, device, dtype: torch.dtype | None = None, full: bool = False
    ) -> dict | None:
        if self.reason is not None:
            return None
        if full and self._full is None:
            self._full = render(self.items, self.tokenizer, self.block_size)
        try:
            # beside training's memory: gpt2-small ~2 GB of logits, not ~8 GB at 64K
            rendered = self._full if full else self._subset
            res = evaluate_rendered(model, rendered, torch.device(device), dtype, 16384)
        except torch.OutOfMemoryError as e:  # never let the probe end a long run
            self.reason = f"out of memory while scoring ({e})"
            self.log(f"hellaswag: off from now on: {self.reason}")
            return None
        return row_fields(res, self.file)


def metrics_fields(res: dict | None) -> dict:
    if res is None:
        return {}
    return {
        "hellaswag_acc": round(res["acc"], 6),
        "hellaswag_acc_norm": round(res["acc_norm"], 6),
        "hellaswag_n": res["n"],
    }
