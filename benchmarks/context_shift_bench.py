"""Generation past the context: tokens/s up to the context's end and past it, the engine's context shift (a full cache
keeps its newest half, refilled once) against the engine before it (every token past the context re-ran the newest
block_size tokens: a subclass here restores its _next_logits).

Greedy, batch 1, a one-token prompt, so the first block_size new tokens fit the context and must be the same tokens
in both (checked: both equal a full forward there, tests/test_generate.py). Each token's time comes from the engine's
on_step callback. The old engine costs a block_size prefill per token past the context, the same for each: it is timed
over --old-past tokens past it (3 x block_size would take ~20 minutes on 2 cores). Runs alternate new/old.

    python benchmarks/context_shift_bench.py                              # gpt2-small, 3 x 1024 new tokens
    python benchmarks/context_shift_bench.py --preset phase1 --repeats 1  # quick check (context 64)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.machine import machine_info  # noqa: E402
from gptlib.config import get_preset  # noqa: E402
from gptlib.inference.engine import Engine, SamplingConfig  # noqa: E402
from gptlib.model import GPT, KVCache, model_size  # noqa: E402


class SlidingEngine(Engine):
    """The engine before the context shift (gptlib 0.2.0's _next_logits, verbatim)."""

    def _next_logits(self, buf: torch.Tensor, cur: int, cache: KVCache) -> torch.Tensor:
        bs = self.model.config.block_size
        if cache.pos < bs:
            return self._logits(buf[:, cur : cur + 1], cache)
        cache.pos = 0  # the window slides: the newest block_size tokens are prefilled again
        return self._logits(buf[:, cur + 1 - bs : cur + 1], cache)


def timed(engine: Engine, n: int) -> tuple[list[float], list[int]]:
    """-> (seconds from the start to each new token, the tokens)."""
    stamps: list[float] = []
    t0 = time.perf_counter()
    out, _ = engine.generate_ids(
        [[1]],
        SamplingConfig(max_new_tokens=n, temperature=0, stop_at_eot=False),
        on_step=lambda rows, toks: stamps.append(time.perf_counter() - t0),
    )
    return stamps, out[0]


def rates(stamps: list[float], bs: int) -> tuple[float, float, float]:
    """-> (tokens/s up to the context's end, tokens/s past it, the slowest step past it in s)."""
    past = [b - a for a, b in zip(stamps[bs - 1 :], stamps[bs:])]
    return bs / stamps[bs - 1], len(past) / sum(past), max(past)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--times", type=int, default=3, help="new tokens = TIMES x block_size")
    ap.add_argument("--old-past", type=int, default=32, help="tokens past the context, old engine")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each engine")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    print(f"command: python {' '.join(sys.argv)}")
    print(machine_info())
    print(f"load average (1, 5, 15 min) at start: {load()}", flush=True)
    torch.manual_seed(args.seed)
    mcfg = get_preset(args.preset).model
    # random weights: the speed does not depend on training
    model = GPT(mcfg).eval()
    bs, n = mcfg.block_size, args.times * mcfg.block_size
    print(
        f"model: preset {args.preset}, {model_size(mcfg).params / 1e6:.1f}M parameters, context {bs}, "
        f"fp32, CPU, {torch.get_num_threads()} threads; greedy, one-token prompt; new: {n} new tokens "
        f"({args.times} x block_size), old: {bs} + {args.old_past}"
    )
    new, old = Engine(model), SlidingEngine(model)
    # warm-up: the engine measures its matmul split here, and the old one uses the same
    timed(new, 8)
    old.split_matmuls = new.split_matmuls
    runs: dict[str, list[tuple[float, float, float]]] = {"new (shift)": [], "old (slide)": []}
    first: dict[str, list[int]] = {}
    for r in range(args.repeats):
        order = [("new (shift)", new, n), ("old (slide)", old, bs + args.old_past)]
        for name, eng, count in order[:: -1 if r % 2 else 1]:
            stamps, toks = timed(eng, count)
            first.setdefault(name, toks)
            within, past, slowest = rates(stamps, bs)
            runs[name].append((within, past, slowest))
            print(
                f"  {name}: {count} new tokens in {stamps[-1]:.1f} s; up to the context's end "
                f"{within:.1f} tokens/s, past it {past:.2f} tokens/s (slowest step {slowest:.3f} s)",
                flush=True,
            )
    same = first["new (shift)"][:bs] == first["old (slide)"][:bs]
    print(f"\nfirst {bs} new tokens identical, new vs old: {same}")
    agree = sum(a == b for a, b in zip(first["new (shift)"][bs:], first["old (slide)"][bs:]))
    print(f"past the context (different windows by design): {agree} of {args.old_past} equal")
    med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in runs.items()}
    print(f"\nmedian of {args.repeats} (tokens/s):")
    print(f"  {'engine':<12} {'up to the end':>14} {'past it':>9} {'past / up to':>13}")
    for k, (within, past, _) in med.items():
        print(f"  {k:<12} {within:>14.1f} {past:>9.2f} {past / within:>12.1%}")
    speedup = med["new (shift)"][1] / med["old (slide)"][1]
    print(f"  past the context, new / old: {speedup:.1f}x")
    print(f"load average (1, 5, 15 min) at end: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
