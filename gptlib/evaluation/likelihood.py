"""Batched log-likelihoods, the core of HellaSwag and bits per byte. A scoring row is a token sequence (at most
block_size + 1 tokens) whose last k tokens are scored. Rows are packed by length into batches padded on the right
(causal attention: padding never changes a real position), and only the scored positions go through the output layer.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from gptlib.runtime import autocast_for, resolve_dtype, unwrap_model


def default_batch_tokens(device: torch.device) -> int:
    return 65536 if device.type == "cuda" else 8192  # a GPU's throughput; a CPU's caches (measured)


@contextlib.contextmanager
def scoring(model: torch.nn.Module, progress: bool, **bar):
    """(the unwrapped model in eval mode, a tqdm bar shown with progress); the model's mode is restored after."""
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
    """Row indices in batches of at most batch_tokens padded tokens, longest rows first (little padding); a row
    longer than that gets a batch of its own."""
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
    batches, start = [], 0
    while start < len(order):
        rows = max(1, batch_tokens // int(lengths[order[start]]))  # the first (longest) row sets the padded length
        batches.append(order[start : start + rows])
        start += rows
    return batches


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


@torch.inference_mode()
def scored_nll(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """NLL (nats, float32) of the targets y.flatten()[positions], or of every target (B*T,). positions are flat
    indices made on the host: a boolean mask on the GPU would make the host wait there to count its Trues.
    dtype None: the autocast training's validation uses on this device (bf16 or fp16 on a GPU, none on the CPU)."""
    m = unwrap_model(model)
    with autocast_for(x.device, dtype or resolve_dtype("auto", x.device)):
        h, y = m.hidden_states(x).flatten(0, 1), y.flatten()  # (B*T, C), (B*T,)
        if positions is not None:
            h, y = h.index_select(0, positions), y.index_select(0, positions)  # (N, C), (N,)
        return F.cross_entropy(m.head(h).float(), y, reduction="none")


@torch.inference_mode()
def score_rows(model: torch.nn.Module, seqs: Sequence[Sequence[int]], ks: Sequence[int],
               device: torch.device | str, dtype: torch.dtype | None = None, batch_tokens: int | None = None,
               progress=None) -> np.ndarray:
    """Summed log-likelihood (nats, <= 0) of the last ks[i] tokens of each seqs[i] -> float64 (R,); progress(rows)
    after each batch. The sums stay on the device until the end: a GPU never waits for the host between batches."""
    device = torch.device(device)
    block = unwrap_model(model).config.block_size
    for i, s in enumerate(seqs):
        if not 1 <= ks[i] <= len(s) - 1 or len(s) - 1 > block:
            raise ValueError(f"scoring row {i}: {len(s)} tokens with k={ks[i]} does not fit block_size={block}")
    out = torch.zeros(len(seqs), dtype=torch.float64, device=device)
    for idx in pack_batches([len(s) - 1 for s in seqs], batch_tokens or default_batch_tokens(device)):
        toks = np.zeros((len(idx), max(len(seqs[i]) for i in idx)), dtype=np.int64)  # (B, L), padded on the right
        mask = np.zeros((len(idx), toks.shape[1] - 1), dtype=bool)  # (B, L-1): the scored targets
        for j, i in enumerate(idx):
            n = len(seqs[i])
            toks[j, :n] = seqs[i]
            mask[j, n - 1 - ks[i] : n - 1] = True  # the last k targets
        pos = np.flatnonzero(mask)  # the scored targets' flat positions, row-major
        toks = _to_device(toks, device)
        nll = scored_nll(model, toks[:, :-1], toks[:, 1:], _to_device(pos, device), dtype)
        out.index_add_(0, _to_device(idx[pos // mask.shape[1]], device), -nll.double())  # each target to its row
        if progress is not None:
            progress(len(idx))
    return out.cpu().numpy()
