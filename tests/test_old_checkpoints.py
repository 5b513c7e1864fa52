"""Checkpoints written by an earlier gptlib still resume, exactly (issue 19: the checkpoint's state is defined
once now, and the on-disk format stays readable).

tests/fixtures/run_ce01044.tar.gz is a run directory made by commit ce01044 (the main branch before the
redesign): `train(<the first 100,000 characters of Tiny Shakespeare as char data>, run, "phase1",
TINY + ["dropout=0.1", "save_every_steps=5", "keep_last=2", "keep_every=20"], max_steps=30, device="cpu")` with
one torch thread, keeping only its step-20 checkpoint, config.json, tokenizer.json and the logs (338 KB). Resuming
it to step 30 with today's code must give what today's code gives uninterrupted: the same losses, learning rates
and weights.
"""

from __future__ import annotations

import tarfile

import torch

from gptlib.checkpoint.format import find_latest_valid, load_model_weights
from gptlib.training.logs import read_metrics
from gptlib.training.loop import train
from tests.conftest import REPO, TINY
from tests.test_resume import one_thread  # noqa: F401 (fixture)

FIXTURE = REPO / "tests" / "fixtures" / "run_ce01044.tar.gz"
SETTINGS = TINY + ["dropout=0.1", "save_every_steps=5", "keep_last=2"]


def curve(run_dir):
    return [(r["step"], r["train_loss"], r.get("val_loss"), r["lr"]) for r in read_metrics(run_dir)]


def test_a_checkpoint_of_the_previous_format_resumes_exactly(char_data, tmp_path):
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    old = tmp_path / "run"
    r = train(char_data, old, "phase1", SETTINGS, max_steps=30, device="cpu", progress=False, log=lambda m: None)
    assert r.resumed_from == 20 and r.step == 30
    alone = tmp_path / "alone"
    train(char_data, alone, "phase1", SETTINGS, max_steps=30, device="cpu", progress=False, log=lambda m: None)
    assert curve(old) == curve(alone)
    a = load_model_weights(find_latest_valid(old, log=lambda m: None).path)
    b = load_model_weights(find_latest_valid(alone, log=lambda m: None).path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
