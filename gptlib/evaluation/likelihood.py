"""Batched log-likelihood scoring: the shared core of HellaSwag and bits-per-byte evaluation.

A *scoring row* is a token sequence `seq` (at most block_size + 1 tokens) whose last `k` tokens are scored: the
model reads seq[:-1] and the log-probabilities of seq[-k:] are summed. Rows are sorted by length and packed into
padded batches of about `batch_tokens` tokens, one forward each. Padding goes on the right, so under causal
attention it never changes a real position. Only the scored positions go through ln_f and the output layer (for
HellaSwag about a third of the tokens), which saves most of the vocab-sized matmul and keeps the logits small.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from gptlib.runtime import autocast_for, resolve_dtype, unwrap_model


def default_batch_tokens(device: torch.device) -> int:
    """Tokens per forward: large on a GPU (throughput), moderate on a CPU (cache-friendly, measured)."""
    return 65536 if device.type == "cuda" else 8192


def eval_autocast(device: torch.device, dtype: torch.dtype | None):
    """Autocast for scoring: bf16 on GPUs that have it, fp16 on older GPUs, none (fp32) on the CPU."""
    if dtype is None:
        dtype = resolve_dtype("auto", device)
    return autocast_for(device, dtype), dtype


@contextlib.contextmanager
def scoring(model: torch.nn.Module, progress: bool, **bar):
    """(the unwrapped model in eval mode, a tqdm bar shown only with progress); the model's mode is restored after."""
    from tqdm.auto import tqdm

    m = unwrap_model(model)
    was_training = m.training
    m.eval()
    with tqdm(disable=not progress, dynamic_ncols=True, leave=False, **bar) as b:
        try:
            yield m, b
        finally:
            m.train(was_training)


def pack_batches(lengths: Sequence[int], batch_tokens: int) -> list[np.ndarray]:
    """Row indices grouped into batches, longest rows first, each batch at most batch_tokens padded
    tokens (a row longer than that gets a batch to itself). Sorting keeps the padding small."""
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
    batches, cur, cur_len = [], [], 0
    for i in order:
        n = int(lengths[i])
        if cur and (len(cur) + 1) * cur_len > batch_tokens:
            batches.append(np.array(cur))
            cur = []
        if not cur:
            cur_len = n  # the first (longest) row sets the padded length
        cur.append(int(i))
    if cur:
        batches.append(np.array(cur))
    return batches


def _collate(seqs: Sequence[Sequence[int]], ks: Sequence[int], idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows idx -> their tokens padded on the right (B, L), and the mask of the scored targets (B, L-1), numpy."""
    toks = np.zeros((len(idx), max(len(seqs[i]) for i in idx)), dtype=np.int64)
    mask = np.zeros((toks.shape[0], toks.shape[1] - 1), dtype=bool)
    for j, i in enumerate(idx):
        n = len(seqs[i])
        toks[j, :n] = seqs[i]
        mask[j, n - 1 - ks[i] : n - 1] = True  # the last k targets
    return toks, mask


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def scored_nll(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """Negative log-likelihood (nats, float32) of the targets y.flatten()[positions], or of every target. The blocks
    run on every position (causality needs them), ln_f and the output layer only on the scored ones; logits are
    cut to vocab_size (the embedding's padding rows never count). positions are flat indices made on the host:
    a boolean mask on the GPU would make the host wait there to count its Trues before the gather."""
    m = unwrap_model(model)
    h, y = m.hidden_states(x).flatten(0, 1), y.flatten()  # (B*T, C), (B*T,)
    if positions is not None:
        h, y = h.index_select(0, positions), y.index_select(0, positions)  # (N, C), (N,): only the scored positions
    return F.cross_entropy(m.head(h).float(), y, reduction="none")


@torch.inference_mode()
def score_rows(model: torch.nn.Module, seqs: Sequence[Sequence[int]], ks: Sequence[int],
               device: torch.device | str, dtype: torch.dtype | None = None, batch_tokens: int | None = None,
               progress=None) -> np.ndarray:
    """Summed log-likelihood (nats, <= 0) of the last ks[i] tokens of each seqs[i] -> float64 (R,); progress(rows)
    after each batch. Results stay on the device until the end: a GPU never waits for the host between batches."""
    device = torch.device(device)
    block = unwrap_model(model).config.block_size
    for i, s in enumerate(seqs):
        if not 1 <= ks[i] <= len(s) - 1 or len(s) - 1 > block:
            raise ValueError(f"scoring row {i}: {len(s)} tokens with k={ks[i]} does not fit block_size={block}")
    ctx, _ = eval_autocast(device, dtype)
    out = torch.zeros(len(seqs), dtype=torch.float64, device=device)
    bt = batch_tokens or default_batch_tokens(device)
    for idx in pack_batches([len(s) - 1 for s in seqs], bt):
        toks, mask = _collate(seqs, ks, idx)
        pos = np.flatnonzero(mask)  # the scored targets' flat positions in (B, L-1), row-major
        row_of = idx[pos // mask.shape[1]]  # the row each scored target belongs to
        toks = _to_device(toks, device)
        with ctx:
            nll = scored_nll(model, toks[:, :-1], toks[:, 1:], _to_device(pos, device))
        out.index_add_(0, _to_device(row_of, device), -nll.double())
        if progress is not None:
            progress(len(idx))
    return out.cpu().numpy()


@torch.inference_mode()
def window_nll(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None = None
               ) -> torch.Tensor:
    """Per-token NLL (nats, float32) of full windows: x, y (B, T) -> (B, T). For bits per byte."""
    ctx, _ = eval_autocast(x.device, dtype)
    with ctx:
        return scored_nll(model, x, y).view(x.shape)
