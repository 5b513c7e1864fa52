"""DDP on CPU: 2 processes with gloo under torchrun train a few steps through the same train() entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY

WORKER = r'''
import hashlib, json, os, sys
import torch
from gptlib import data as D
from gptlib.train import train

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
r = train(sys.argv[1], sys.argv[2], "phase1", overrides=json.loads(sys.argv[4]), device="cpu", progress=False)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"step": r.step, "resumed_from": r.resumed_from, "tokens_seen": r.tokens_seen,
               "train_loss": r.train_loss, "batches": seen, "world": int(os.environ["WORLD_SIZE"])}, f)
'''


def _torchrun(tmp_path: Path, data: Path, run_dir: Path, overrides: list[str], tag: str) -> dict:
    out = tmp_path / tag
    out.mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker),
           str(data), str(run_dir), str(out), json.dumps(overrides)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)} | {"stdout": p.stdout}


def test_ddp_two_ranks_gloo_then_resume(tmp_path, char_data):
    run_dir = tmp_path / "run"
    ov = TINY + ["batch_size=4", "grad_accum_steps=2", "eval_interval=4", "log_interval=2", "sample_prompts=[\"\\n\"]"]
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
    # The logged loss is the mean over ranks, identical on both.
    assert r0["train_loss"] == pytest.approx(r1["train_loss"])

    # Rank 0 alone writes: one metrics row per step (no duplicates), one sample row per validation.
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["val_loss"] is not None and rows[-1]["mfu"] is None and "time_split" in rows[-1]
    samples = (run_dir / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 1
    import torch

    from gptlib.checkpoint import find_latest_valid, load_checkpoint

    ck = find_latest_valid(run_dir, log=lambda m: None)
    assert ck is not None and ck.step == 4
    _, train_state, state = load_checkpoint(ck.path)
    ranks = train_state["sampler_ranks"]
    assert len(ranks) == 2 and not torch.equal(ranks[0]["rng_state"], ranks[1]["rng_state"])
    assert ranks[0]["batches_drawn"] == ranks[1]["batches_drawn"] == 8

    # A valid, resumable run: torchrun again continues from step 4 with each rank's own stream.
    res2 = _torchrun(tmp_path, char_data, run_dir, ov + ["max_steps=6"], "second")
    assert res2[0]["resumed_from"] == res2[1]["resumed_from"] == 4 and res2[0]["step"] == 6
    after0 = [b for s, b in res2[0]["batches"] if s == 1337]
    after1 = [b for s, b in res2[1]["batches"] if s == 1338]
    assert after0 and after1 and after0 != after1
    assert not set(map(tuple, after0)) & set(map(tuple, train0))  # continued, not replayed
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]

    # ... and a single process can take the run over.
    from gptlib.train import train

    r = train(char_data, run_dir, "phase1", overrides=ov + ["max_steps=7"], device="cpu", progress=False,
              log=lambda m: None)
    assert r.resumed_from == 6 and r.step == 7
