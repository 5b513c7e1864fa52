"""Checkpoints written by an earlier gptlib still resume, exactly (issue 19: the checkpoint's state is defined
once now, and the on-disk format stays readable).

tests/fixtures/run_ce01044.tar.gz is a run directory made by commit ce01044 (the main branch before the
redesign): `train(<the first 100,000 characters of Tiny Shakespeare as char data>, run, "phase1",
TINY + ["dropout=0.1", "save_every_steps=5", "keep_last=2", "keep_every=20"], max_steps=30, device="cpu")` with
one torch thread, keeping only its step-20 checkpoint, config.json, tokenizer.json and the logs (338 KB).

The fixture is an input only: its losses were computed on another CPU, whose float kernels may differ from this
one's (issue 26: an AVX512-BF16 CPU differed in the sixth digit from step 8 on), so nothing here is compared with
them. What is compared is made here: every value in the old files is in the state the resumed run holds, and that
run goes on exactly as one resumed from a current-format checkpoint of the same state.
"""

from __future__ import annotations

import copy
import json
import shutil
import tarfile

import torch

from gptlib.checkpoint.format import load_model_weights, write_checkpoint
from gptlib.layout import LOG_FILES, checkpoints_dir
from gptlib.training import loop as gloop
from gptlib.training.logs import read_metrics
from gptlib.training.loop import train
from tests import faulty
from tests.conftest import REPO, TINY, newest_checkpoint
from tests.test_resume import one_thread  # noqa: F401 (fixture)

FIXTURE = REPO / "tests" / "fixtures" / "run_ce01044.tar.gz"
SETTINGS = TINY + ["dropout=0.1", "save_every_steps=5", "keep_last=2"]
# state.json's fields that describe the session that resumes, not the state it resumes (TrainState.continue_from),
# and pending_losses, which a checkpoint no longer holds (it falls on a log boundary; the fixture's is empty)
SESSION_FIELDS = ("val_loss", "milestone", "config", "data", "data_dir", "tokenizer", "pending_losses")


def curve(run_dir):
    return [(r["step"], r["train_loss"], r.get("val_loss"), r["lr"]) for r in read_metrics(run_dir)]


def assert_holds(new, old, where="") -> None:
    """Every value of `old` (nested dicts, lists, tensors) is in `new`, equal (tensors: torch.equal)."""
    if isinstance(old, dict):
        assert isinstance(new, dict), where
        for k, v in old.items():
            assert k in new, f"{where}.{k} is not in the restored state"
            assert_holds(new[k], v, f"{where}.{k}")
    elif isinstance(old, (list, tuple)):
        assert isinstance(new, (list, tuple)) and len(new) == len(old), where
        for i, (a, b) in enumerate(zip(new, old)):
            assert_holds(a, b, f"{where}[{i}]")
    elif isinstance(old, torch.Tensor):
        assert isinstance(new, torch.Tensor) and torch.equal(new, old), where
    else:
        assert new == old, f"{where}: {new!r} != {old!r}"


def test_a_checkpoint_of_the_previous_format_resumes_exactly(char_data, tmp_path, monkeypatch):
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    old, now = tmp_path / "run", tmp_path / "now"
    shutil.copytree(old, now)
    ck = checkpoints_dir(old) / "step_0000020"
    files = (torch.load(ck / "model.pt", weights_only=True), torch.load(ck / "train_state.pt", weights_only=True),
             json.loads((ck / "state.json").read_text()))
    restored, real_loop = [], gloop._loop

    def loop(s, *a, **k):  # the run's state as restored, before its first step (copied: training changes it)
        restored.append(copy.deepcopy(s.snapshot(s.resume.state.val_loss, s.state.elapsed_s)))
        return real_loop(s, *a, **k)

    monkeypatch.setattr(gloop, "_loop", loop)
    r = train(char_data, old, "phase1", SETTINGS, max_steps=30, device="cpu", progress=False, log=lambda m: None)
    monkeypatch.undo()
    assert r.resumed_from == 20 and r.step == 30
    [state] = restored
    model, train_state, progress = state.files()
    assert_holds(model, files[0], "model.pt")
    assert_holds(train_state, files[1], "train_state.pt")
    assert files[2]["pending_losses"] == []  # log_interval=1: every step was logged before the save
    assert_holds(progress, {k: v for k, v in files[2].items() if k not in SESSION_FIELDS}, "state.json")

    # the same state as a checkpoint of today's format, resumed to step 30 here too: the same run, bit for bit
    shutil.rmtree(checkpoints_dir(now) / "step_0000020")
    write_checkpoint(checkpoints_dir(now), 20, model, train_state, progress,
                     {name: (ck / name).read_bytes() for name in LOG_FILES})
    r = train(char_data, now, "phase1", SETTINGS, max_steps=30, device="cpu", progress=False, log=lambda m: None)
    assert r.resumed_from == 20 and r.step == 30
    assert curve(old) == curve(now) and len(curve(now)) == 30
    a = load_model_weights(newest_checkpoint(old).path)
    b = load_model_weights(newest_checkpoint(now).path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_holding_pending_losses_resumes_without_logging_them_again(char_data, tmp_path):
    """A checkpoint of a gptlib that replayed not-yet-logged losses across a resume (state.json's pending_losses,
    here made up) resumes; those losses are not logged again: the rows the run wrote for its steps stay, once each."""
    settings = TINY + ["dropout=0.1", "save_every_steps=5", "keep_last=4"]
    alone, run = tmp_path / "alone", tmp_path / "run"
    train(char_data, alone, "phase1", settings, max_steps=20, device="cpu", progress=False, log=lambda m: None)
    undo = faulty.install("interrupt:mid_step@11")  # a run of the same schedule that stopped at step 10
    try:
        train(char_data, run, "phase1", settings, max_steps=20, device="cpu", progress=False, log=lambda m: None)
    finally:
        undo()
    ck = checkpoints_dir(run) / "step_0000010"
    model, train_state = (torch.load(ck / name, weights_only=True) for name in ("model.pt", "train_state.pt"))
    state = {**json.loads((ck / "state.json").read_text()), "pending_losses": [9.5, 9.25]}  # steps 9 and 10's
    write_checkpoint(checkpoints_dir(run), 10, model, train_state, state,
                     {name: (ck / name).read_bytes() for name in LOG_FILES})
    r = train(char_data, run, "phase1", settings, max_steps=20, device="cpu", progress=False, log=lambda m: None)
    assert r.resumed_from == 10 and r.step == 20
    rows = curve(run)
    assert [row[0] for row in rows] == list(range(1, 21)) and 9.5 not in [row[1] for row in rows]
    assert rows == curve(alone)
