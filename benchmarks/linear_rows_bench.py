"""Why the engine may split few-row matmuls on the CPU (gptlib/inference/engine.py): F.linear vs split_linear.

All 2-D weights of gpt2-small (440 MB fp32, far larger than the caches, as in decoding) multiplied
by R rows, the plain way (one MKL call per weight) and as one row block per thread (bmm). Prints the
median time of the whole set per row count and the ratio; run on a quiet machine.

    python benchmarks/linear_rows_bench.py
    python benchmarks/linear_rows_bench.py --rows 1 8 64 --repeats 5
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
import torch.nn.functional as F  # noqa: E402

from gptlib.config import get_preset  # noqa: E402
from gptlib.inference.engine import row_blocks, split_linear  # noqa: E402
from gptlib.model import GPT  # noqa: E402


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} logical cores, "
        f"load average at start {os.getloadavg()}"
    )
    torch.manual_seed(0)
    model = GPT(get_preset(args.preset).model).eval()
    weights = [p.detach() for n, p in model.named_parameters() if p.dim() == 2 and "wpe" not in n]
    total = sum(w.numel() * w.element_size() for w in weights)
    print(
        f"{len(weights)} weights of preset {args.preset}, {total / 1e6:.0f} MB; "
        f"blocks per weight: {sorted({row_blocks(w.shape[0]) for w in weights})}"
    )
    print(f"{'rows':>5} {'F.linear ms':>12} {'split ms':>9} {'ratio':>6} {'split GB/s':>11}")
    with torch.inference_mode():
        for rows in args.rows:
            xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
            plain = median_time(
                lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights], args.repeats
            )
            split = median_time(
                lambda xs=xs: [
                    split_linear(xs[w.shape[1]], w, None, row_blocks(w.shape[0])) for w in weights
                ],
                args.repeats,
            )
            print(
                f"{rows:>5} {plain * 1e3:>12.1f} {split * 1e3:>9.1f} {plain / split:>5.2f}x "
                f"{total / split / 1e9:>11.1f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
