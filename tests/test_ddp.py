"""DDP on CPU: 2 processes with gloo under torchrun train a few steps through the same train() entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY

WORKER = r"""
import hashlib, json, os, sys
import torch
from gptlib import batches as D
from gptlib.training.loop import train

out = sys.argv[3]
rank = int(os.environ["RANK"])
seen = []
orig = D.BatchSampler.next_batch

def recording(self):
    x, y = orig(self)
    if self.batch_size == 4:  # tagged by seed: training samplers use seed + rank, eval ones seed + 10000
        seen.append([int(self.generator.initial_seed()), x[0, :8].tolist()])
    return x, y

D.BatchSampler.next_batch = recording
from gptlib.training import run as S
optimizers = []
orig_opt = S.build_optimizer

def capture(*a, **k):
    optimizers.append(orig_opt(*a, **k))
    return optimizers[-1]

S.build_optimizer = capture
r = train(sys.argv[1], sys.argv[2], "phase1", overrides=json.loads(sys.argv[4]), device="cpu", progress=False)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"step": r.step, "resumed_from": r.resumed_from, "tokens_seen": r.tokens_seen,
               "train_loss": r.train_loss, "batches": seen, "world": int(os.environ["WORLD_SIZE"]),
               "weights": [p.detach().double().sum().item() for g in optimizers[-1].param_groups for p in g["params"]]},
              f)
"""


def _torchrun(tmp_path: Path, data: Path, run_dir: Path, overrides: list[str], tag: str) -> dict:
    out = tmp_path / tag
    out.mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(worker),
        str(data),
        str(run_dir),
        str(out),
        json.dumps(overrides),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)} | {
        "stdout": p.stdout
    }


def test_ddp_two_ranks_gloo_then_resume(tmp_path, char_data):
    run_dir = tmp_path / "run"
    ov = TINY + [
        "batch_size=4",
        "grad_accum_steps=2",
        "eval_interval=4",
        "log_interval=2",
        'sample_prompts=["\\n"]',
    ]
    res = _torchrun(tmp_path, char_data, run_dir, ov + ["max_steps=4"], "first")
    r0, r1 = res[0], res[1]
    assert r0["step"] == r1["step"] == 4
    # Each optimizer step consumes 2 micro-batches of 4 sequences x 32 tokens on each of 2 ranks.
    assert r0["tokens_seen"] == 4 * 2 * 4 * 32 * 2
    # Different batches per rank: seeds differ (seed + rank) and so do the token windows.
    train0 = [b for s, b in r0["batches"] if s == 1337]
    train1 = [b for s, b in r1["batches"] if s == 1338]
    assert len(train0) == len(train1) == 8
    assert train0 != train1
    # Gradients are all-reduced (on the last micro-step of each accumulation): both ranks hold the same weights.
    assert r0["weights"] == r1["weights"]
    # The logged loss is the mean over ranks, identical on both.
    assert r0["train_loss"] == pytest.approx(r1["train_loss"])

    # Rank 0 alone writes: one metrics row per step (no duplicates), one sample row per validation.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["val_loss"] is not None and rows[-1]["mfu"] is None and "time_split" in rows[-1]
    samples = (run_dir / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 1
    import torch

    from gptlib.checkpoint.format import load_checkpoint
    from tests.conftest import newest_checkpoint

    ck = newest_checkpoint(run_dir)
    assert ck is not None and ck.step == 4
    ranks = load_checkpoint(ck.path)["sampler_ranks"]
    assert len(ranks) == 2 and not torch.equal(ranks[0]["rng_state"], ranks[1]["rng_state"])
    assert ranks[0]["batches_drawn"] == ranks[1]["batches_drawn"] == 8

    # A valid, resumable run: torchrun again continues from step 4 with each rank's own stream.
    res2 = _torchrun(tmp_path, char_data, run_dir, ov + ["max_steps=6"], "second")
    assert res2[0]["resumed_from"] == res2[1]["resumed_from"] == 4 and res2[0]["step"] == 6
    after0 = [b for s, b in res2[0]["batches"] if s == 1337]
    after1 = [b for s, b in res2[1]["batches"] if s == 1338]
    assert after0 and after1 and after0 != after1
    assert not set(map(tuple, after0)) & set(map(tuple, train0))  # continued, not replayed
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]

    # ... and a single process can take the run over.
    from gptlib.training.loop import train

    r = train(
        char_data,
        run_dir,
        "phase1",
        overrides=ov + ["max_steps=7"],
        device="cpu",
        progress=False,
        log=lambda m: None,
    )
    assert r.resumed_from == 6 and r.step == 7


def test_dist_single_process_is_a_no_op():
    import torch

    from gptlib.training.run import setup_ddp

    d = setup_ddp("cpu")  # no WORLD_SIZE in the environment
    assert not d.enabled and d.is_main and d.rank == 0
    m = torch.nn.Linear(2, 2)
    assert d.wrap(m, torch.device("cpu")) is m
    assert d.agree(3, 10, True, False) == (True, False)  # decided every step when alone
    t = torch.tensor([1.0, 3.0])
    assert d.mean(t) is t and d.min_int(5) == 5 and d.gathered({"x": 1}) is None


def test_train_step_all_reduces_once_per_optimizer_step(tmp_path):
    """Under DDP (a real gloo group of one) the micro-batches before the last skip the all-reduce (no_sync)."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gptlib.training.step import StepTimer, train_step

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, y):
            return None, ((self.lin(x) - y) ** 2).mean()

    class Batches:
        def next_batch(self):
            return torch.randn(2, 4), torch.randn(2, 4)

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        model, skipped = DistributedDataParallel(Tiny()), []
        real_no_sync = model.no_sync
        model.no_sync = lambda: skipped.append(1) or real_no_sync()
        train_step(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            torch.amp.GradScaler("cpu", enabled=False),
            Batches(),
            accum=4,
            grad_clip=1.0,
            autocast=contextlib.nullcontext(),
            timer=StepTimer("cpu"),
        )
        # the all-reduce happens once per optimizer step, on the last micro-batch
        assert len(skipped) == 3
    finally:
        dist.destroy_process_group()
