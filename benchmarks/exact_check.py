"""Exactness across a change: train phase1 for N steps and print a hash of every logged loss and of the final
weights. Run it on both sides of a change (the gptlib imported is the one on PYTHONPATH, else this repo's) on the
same machine: equal hashes mean the change trains bit for bit as before.

    PYTHONPATH=/path/to/other/tree python benchmarks/exact_check.py \
        --text ../shared/data/tinyshakespeare.txt --steps 200
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gptlib  # noqa: E402
from gptlib.checkpoint.format import list_checkpoints, load_model_weights  # noqa: E402
from gptlib.data.prepare import prepare_text  # noqa: E402
from gptlib.training.loop import train  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", required=True, help="Tiny Shakespeare")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data, run = Path(tmp) / "data", Path(tmp) / "run"
        prepare_text([args.text], data, tokenizer="char", verbose=False)
        train(
            data,
            run,
            "phase1",
            ["log_interval=10"],
            max_steps=args.steps,
            progress=False,
            log=lambda s: None,
        )
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses = [(row["step"], row.get("train_loss"), row.get("val_loss")) for row in rows]
        weights = load_model_weights(list_checkpoints(run)[0])
        h = hashlib.sha256()
        for name in sorted(weights):
            h.update(name.encode())
            h.update(weights[name].numpy().tobytes())
    print(f"gptlib at {Path(gptlib.__file__).parent}")
    print(
        f"{args.steps} steps: losses sha256 {hashlib.sha256(repr(losses).encode()).hexdigest()[:16]}, "
        f"weights sha256 {h.hexdigest()[:16]}; last rows {losses[-2:]}"
    )


if __name__ == "__main__":
    main()
