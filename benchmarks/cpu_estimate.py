"""How close the estimate a GPU preset gets on a CPU (throughput.estimate_cpu_seconds) is to the run it estimates.

Trains small models in GPU presets on this CPU (char data from Tiny Shakespeare), each as train() runs it (its
validations, samples and checkpoints included), and prints the estimate made just before against the training time
the run reports (TrainResult.elapsed_s), best of --repeats: the figures behind CPU_MATMUL_SHARE and CPU_LAYER_PASS_S.

    python benchmarks/cpu_estimate.py --text ../shared/data/tinyshakespeare.txt [--repeats 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import machine_info  # noqa: E402
from gptlib.config import build_config  # noqa: E402
from gptlib.data.prepare import prepare_text  # noqa: E402
from gptlib.model import model_size  # noqa: E402
from gptlib.training.loop import train  # noqa: E402
from gptlib.training.throughput import cpu_train_flops, estimate_cpu_seconds  # noqa: E402

# (preset, --set overrides, what it stands for)
RUNS = [
    (
        "finetune",
        ["n_layer=2", "n_embd=32", "n_head=2", "block_size=64", "max_steps=60"],
        "notebook 05 on a tiny GPT-2 base (issue 26: 'about 0m02s' for a 27 s run)",
    ),
    (
        "finetune",
        ["n_layer=4", "n_embd=128", "n_head=4", "block_size=128", "max_steps=30"],
        "a small fine-tune",
    ),
    (
        "phase2",
        [
            "n_layer=2",
            "n_embd=128",
            "n_head=4",
            "block_size=128",
            "batch_size=8",
            "grad_accum_steps=1",
            "max_steps=100",
        ],
        "phase2, shrunk",
    ),
    (
        "gpt2-small",
        [
            "n_layer=4",
            "n_embd=256",
            "n_head=4",
            "block_size=256",
            "batch_size=4",
            "grad_accum_steps=2",
            "max_steps=20",
            "hellaswag_every=0",
            "eval_interval=10",
        ],
        "gpt2-small, shrunk",
    ),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", required=True, help="Tiny Shakespeare (or any text file)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    print(f"command: python {' '.join(sys.argv)}")
    print(machine_info())
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "data"
        prepare_text([args.text], data, tokenizer="char", verbose=False)
        for i, (preset, overrides, what) in enumerate(RUNS):
            best = None
            for k in range(args.repeats):
                cfg = build_config(preset, overrides + ["vocab_size=65"])
                rate = cpu_train_flops()
                est = estimate_cpu_seconds(cfg, 0, rate)
                r = train(
                    data,
                    Path(d) / f"run{i}-{k}",
                    preset,
                    overrides,
                    device="cpu",
                    progress=False,
                    log=lambda m: None,
                )
                if best is None or r.elapsed_s < best[1]:
                    best = (est, r.elapsed_s, rate)
            est, took, rate = best
            print(
                f"{preset} {' '.join(overrides)} ({what}): {model_size(cfg.model).params / 1e6:.2f}M parameters; "
                f"estimate {est:.1f} s at {rate / 1e9:.0f} GFLOP/s, run {took:.1f} s (run / estimate {took / est:.2f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
