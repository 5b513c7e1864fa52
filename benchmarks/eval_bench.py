"""HellaSwag scoring speed: items/s of gptlib.evaluation.hellaswag on synthetic items of realistic lengths.

Random weights (speed does not depend on them) in a preset's shape; items are random token ids
with HellaSwag-like lengths, rendered by the same rule as the real evaluation (context cut from
the left, long endings in pieces), then scored by `evaluate_rendered`: the whole path but the
tokenizer (BPE-encoding the 50,210 texts of the real file takes well under a second). Lengths, in
GPT-2-sized tokens: context uniform in [20, 100] (mean 60), each ending uniform in [10, 60] (mean 35);
for a char model 4.5 characters per token. Each setting is warmed up once, then timed `--repeats`
times; medians are printed.

    python benchmarks/eval_bench.py                                   # CPU: phase1, then gpt2-small (a few items)
    python benchmarks/eval_bench.py --device cuda --preset gpt2-small --items 10042   # the H100 target: < 60 s
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.machine import machine_info  # noqa: E402
from gptlib.config import get_preset  # noqa: E402
from gptlib.evaluation import hellaswag as hs  # noqa: E402
from gptlib.model import GPT, model_size  # noqa: E402

CTX_TOKENS = (20, 100)
END_TOKENS = (10, 60)
CHARS_PER_TOKEN = 4.5


def synthetic(n_items: int, vocab: int, block: int, char: bool, seed: int = 0) -> hs.Rendered:
    """Rendered items of random token ids with the lengths above (in characters for a char model)."""
    rng = np.random.default_rng(seed)
    scale = CHARS_PER_TOKEN if char else 1.0
    r = hs.Rendered()
    for _ in range(n_items):
        ctx = rng.integers(0, vocab, int(rng.integers(*CTX_TOKENS, endpoint=True) * scale)).tolist()
        cut = False
        for e in range(4):
            end = rng.integers(
                0, vocab, int(rng.integers(*END_TOKENS, endpoint=True) * scale)
            ).tolist()
            seqs, ks, c = hs.ending_rows(ctx, end, block)
            cut |= c
            r.seqs += seqs
            r.ks += ks
            r.ending_of += [4 * r.n + e] * len(seqs)
            r.counts.append(len(end))
        r.labels.append(int(rng.integers(0, 4)))
        r.truncated += cut
    return r


def bench(
    preset: str,
    device: torch.device,
    items: int,
    repeats: int,
    batch_tokens: int | None,
    dtype: torch.dtype | None,
) -> None:
    cfg = get_preset(preset).model
    char = preset == "phase1"
    torch.manual_seed(0)
    model = GPT(cfg).to(device).eval()
    r = synthetic(items, cfg.vocab_size, cfg.block_size, char)
    tokens = sum(len(s) - 1 for s in r.seqs)
    print(
        f"{preset}: {model_size(cfg).params / 1e6:.2f}M parameters, block {cfg.block_size}, vocab {cfg.vocab_size}; "
        f"{items:,} items -> {len(r.seqs):,} rows, {tokens:,} input tokens ({tokens / items:,.0f}/item), "
        f"{r.truncated:,} truncated; batch_tokens {batch_tokens or 'default'}",
        flush=True,
    )
    # warm-up: allocator, kernels
    hs.evaluate_rendered(
        model,
        synthetic(min(items, 50), cfg.vocab_size, cfg.block_size, char, seed=1),
        device,
        dtype,
        batch_tokens,
    )
    times = []
    for i in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        # ends with a device -> host copy
        hs.evaluate_rendered(model, r, device, dtype, batch_tokens)
        times.append(time.perf_counter() - t0)
        print(
            f"  run {i + 1}: {times[-1]:8.2f} s  {items / times[-1]:10,.1f} items/s  "
            f"{tokens / times[-1]:12,.0f} tokens/s",
            flush=True,
        )
    t = statistics.median(times)
    line = f"  median: {t:.2f} s for {items:,} items = {items / t:,.1f} items/s, {tokens / t:,.0f} tokens/s"
    if items < hs.HELLASWAG_ITEMS:
        line += f"; the full {hs.HELLASWAG_ITEMS:,} items would take ~{hs.HELLASWAG_ITEMS * t / items:,.0f} s"
    print(line, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", nargs="+", default=None, help="default: phase1 gpt2-small")
    ap.add_argument(
        "--items",
        type=int,
        nargs="+",
        default=None,
        help="items per preset (default CPU: 2000 for phase1, 20 for gpt2-small; CUDA: 10042)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--batch-tokens", type=int, nargs="+", default=[0], help="0 = the device default"
    )
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    args = ap.parse_args()
    device = torch.device(args.device)
    presets = args.preset or ["phase1", "gpt2-small"]
    defaults = {"phase1": 2000, "gpt2-small": 20} if device.type == "cpu" else {}
    items = args.items or [defaults.get(p, hs.HELLASWAG_ITEMS) for p in presets]
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    print(machine_info())
    print(
        f"device {device}, dtype {args.dtype} (auto: fp32 on CPU, bf16 on GPUs that have it), "
        f"torch threads {torch.get_num_threads()}"
    )
    for p, n in zip(presets, items if len(items) == len(presets) else items * len(presets)):
        for bt in args.batch_tokens:
            bench(p, device, n, args.repeats, bt or None, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
