"""Decoding's few-row matmuls on a CPU, split into one block of the weight's rows per thread where that is faster.

Decoding reads every weight once per token. On some CPUs MKL runs x @ W.T for a few rows on one thread at about half
the memory bandwidth; bmm over row blocks runs the blocks in parallel: ~1.9x at one row on a 2-core AMD EPYC
(benchmarks/linear_rows_bench.py). On others the plain call is the faster one (an Intel Xeon with AVX-512: 0.72-0.89x).
So the engine times both on this CPU, once per model, and splits only where it measured the split faster.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

FEW_ROWS = 64  # up to this many rows (a decoding step's batch); a prefill's longer inputs stay on MKL's gemm
FASTER = 0.9  # the split is used where it takes at most this share of the plain call's time


def split_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocks: int
) -> torch.Tensor:
    """F.linear(x, weight, bias) as `blocks` row blocks of weight: x (..., K), weight (N, K) -> (..., N)."""
    N, K = weight.shape
    x2 = x.reshape(-1, K)  # (R, K)
    w = weight.view(blocks, N // blocks, K).transpose(1, 2)  # (blocks, K, N/blocks), a view
    xb = x2.expand(blocks, *x2.shape)  # (blocks, R, K): the same rows for every block, no copy
    if bias is None:
        y = torch.bmm(xb, w)
    else:
        y = torch.baddbmm(bias.view(blocks, 1, N // blocks), xb, w)
    return y.transpose(0, 1).reshape(*x.shape[:-1], N)  # (blocks, R, N/blocks) -> (..., N)


def row_blocks(n_rows: int) -> int:
    """One block per thread, fewer where n_rows does not divide evenly."""
    blocks = torch.get_num_threads()
    while n_rows % blocks:
        blocks -= 1
    return blocks


class SplitFewRows(TorchFunctionMode):
    """Inside `with SplitFewRows():`, every F.linear of a few rows on the CPU (nn.Linear calls it) runs split."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.device.type == "cpu" and x.numel() <= FEW_ROWS * weight.shape[1]:
                if (blocks := row_blocks(weight.shape[0])) > 1:
                    return split_linear(x, weight, bias, blocks)
        return func(*args, **kwargs)


@torch.inference_mode()
def split_is_faster(model: torch.nn.Module, repeats: int = 3) -> bool:
    """Both ways on the model's own weights, one row each, best of `repeats` (~0.2 s for gpt2-small)."""
    weights = [p for p in model.parameters() if p.dim() == 2 and p.device.type == "cpu"]
    if torch.get_num_threads() < 2 or not weights:
        return False
    xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights}

    def best(linear) -> float:
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            for w in weights:
                linear(xs[w.shape[1]], w)
            times.append(time.perf_counter() - t0)
        return min(times[1:])

    plain = best(F.linear)
    split = best(lambda x, w: split_linear(x, w, None, row_blocks(w.shape[0])))
    return split <= FASTER * plain
