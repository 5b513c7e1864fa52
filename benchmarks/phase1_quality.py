"""Phase 1 quality/speed benchmark: does the `phase1` recipe reach val loss <= 1.70 in 90 s on this CPU?

    python benchmarks/phase1_quality.py --text ../shared/data/tinyshakespeare.txt [--repeats 3] [--set FIELD=VALUE ...]

Repeat i trains with seed i (1, 2, 3: a median over seeds, not one seed's run repeated; the loss's spread between
seeds is larger than between CPUs), from scratch in a fresh run directory, exactly as
`python -m gptlib train --preset phase1` does (evaluations, samples, checkpoints included in the
wall time), then reports the loss over the *whole* validation split (every non-overlapping
block) besides the loop's sampled validation loss. Prints medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gptlib.batches import place_dataset  # noqa: E402
from gptlib.checkpoint.format import list_checkpoints, load_model_weights  # noqa: E402
from gptlib.config import RunConfig  # noqa: E402
from gptlib.data.prepare import prepare_text  # noqa: E402
from gptlib.data.shards import read_meta  # noqa: E402
from gptlib.model import GPT  # noqa: E402
from gptlib.training.loop import train  # noqa: E402


@torch.no_grad()
def full_val_loss(run_dir: Path, data_dir: Path) -> float:
    """Mean loss over every non-overlapping block of the val split (each token predicted once)."""
    # the run's last save, just written: the weights after its final step
    ck = list_checkpoints(run_dir)[0]
    cfg = RunConfig.from_dict(json.loads((ck / "state.json").read_text())["config"])
    model = GPT(cfg.model)
    model.load_state_dict(load_model_weights(ck))
    model.eval()
    splits = place_dataset(read_meta(data_dir), log=lambda _: None)
    val = splits["val"].tokens.long() & 0xFFFF
    T = cfg.model.block_size
    n = (val.numel() - 1) // T
    x = val[: n * T].view(n, T)
    y = val[1 : n * T + 1].view(n, T)
    total = 0.0
    for i in range(0, n, 64):
        _, loss = model(x[i : i + 64], y[i : i + 64])
        total += loss.item() * x[i : i + 64].shape[0]
    return total / n


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--text", required=True, help="Tiny Shakespeare text file")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--preset", default="phase1")
    args = ap.parse_args()

    print(f"# {' '.join(sys.argv)}")
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, CPU: {cpu_name()}, "
        f"python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M:%S')}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        prepare_text([args.text], data, tokenizer="char", verbose=False)
        rows = []
        for i in range(args.repeats):
            run = Path(tmp) / f"run{i}"
            seed = i + 1
            r = train(
                data,
                run,
                args.preset,
                list(args.set),
                seed=seed,
                progress=False,
                log=lambda s: None,
            )
            full = full_val_loss(run, data)
            rows.append(
                {
                    "wall_s": r.elapsed_s,
                    "val_loss_sampled": r.val_loss,
                    "val_loss_full": full,
                    "steps": r.step,
                    "tokens_per_s": r.tokens_per_s,
                    "seed": seed,
                }
            )
            print(
                f"seed {seed}: {r.step} steps in {r.elapsed_s:.1f}s wall, {r.tokens_per_s:,.0f} tokens/s, "
                f"val loss {r.val_loss:.4f} (sampled), {full:.4f} (full val split)",
                flush=True,
            )
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(
        f"median over seeds 1-{len(rows)}: wall {med['wall_s']:.1f}s, {med['tokens_per_s']:,.0f} tokens/s, "
        f"val loss {med['val_loss_sampled']:.4f} (sampled) / {med['val_loss_full']:.4f} (full val split); "
        f"target <= 1.70 within 90 s: {'MET' if med['val_loss_full'] <= 1.70 and med['wall_s'] <= 90 else 'NOT MET'}"
    )


if __name__ == "__main__":
    main()
