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

import hashlib
import json
import shutil
import tarfile

import pytest
import torch

from gptlib.checkpoint.format import find_latest_valid, load_model_weights
from gptlib.config import RunConfig, get_preset
from gptlib.errors import ConfigError
from gptlib.inference.loading import load_run
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


def _set_model_field(ckpt_dir, name, value):
    """Write a model field into a checkpoint's state.json as an older gptlib did, the manifest re-hashed to match."""
    state = json.loads((ckpt_dir / "state.json").read_text())
    state["config"]["model"][name] = value
    (ckpt_dir / "state.json").write_text(json.dumps(state))
    manifest = json.loads((ckpt_dir / "manifest.json").read_text())
    data = (ckpt_dir / "state.json").read_bytes()
    manifest["files"]["state.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt_dir / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_that_recorded_the_dropped_soft_cap_as_off_loads_and_resumes_exactly(char_data, tmp_path,
                                                                                         one_thread):
    """Every run made with the defaults before issue 27 recorded logit_softcap 0.0: it loads and resumes exactly."""
    alone = tmp_path / "alone"
    train(char_data, alone, "phase1", SETTINGS, max_steps=30, device="cpu", progress=False, log=lambda m: None)
    old = tmp_path / "old"
    shutil.copytree(alone, old)
    shutil.rmtree(old / "checkpoints" / "step_0000030")
    _set_model_field(old / "checkpoints" / "step_0000025", "logit_softcap", 0.0)
    assert load_run(old).step == 25
    r = train(char_data, old, "phase1", SETTINGS, max_steps=30, device="cpu", progress=False, log=lambda m: None)
    assert r.resumed_from == 25 and r.step == 30
    assert curve(old) == curve(alone)
    a = load_model_weights(find_latest_valid(old, log=lambda m: None).path)
    b = load_model_weights(find_latest_valid(alone, log=lambda m: None).path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name,value,loads", [("logit_softcap", 0, True), ("logit_softcap", 15.0, False),
                                              ("mlp", "relu2", False), ("mlp", "gelu", True)])
def test_a_run_that_used_a_dropped_option_is_refused_in_one_line(name, value, loads):
    """The ReLU² MLP and the logit soft cap are gone: a config that used one names its file, the field and the value."""
    cfg = get_preset("phase1").to_dict()
    cfg["model"][name] = value
    if loads:
        assert RunConfig.from_dict(cfg, "run/state.json") == get_preset("phase1")
        return
    with pytest.raises(ConfigError) as e:
        RunConfig.from_dict(cfg, "run/checkpoints/step_0000020/state.json")
    assert str(e.value).startswith(f"run/checkpoints/step_0000020/state.json: model.{name} is {value!r}, an option "
                                   f"gptlib no longer has") and "\n" not in str(e.value)


def test_loading_or_resuming_a_run_that_used_the_soft_cap_is_refused(char_data, tmp_path, capsys):
    from gptlib.__main__ import main

    run = tmp_path / "run"
    train(char_data, run, "phase1", SETTINGS, max_steps=5, device="cpu", progress=False, log=lambda m: None)
    ckpt = run / "checkpoints" / "step_0000005"
    _set_model_field(ckpt, "logit_softcap", 15.0)
    with pytest.raises(ConfigError, match=f"{ckpt / 'state.json'}: model.logit_softcap is 15.0"):
        load_run(run)
    with pytest.raises(ConfigError, match=f"{ckpt / 'state.json'}: model.logit_softcap is 15.0"):
        train(char_data, run, "phase1", SETTINGS, max_steps=10, device="cpu", progress=False, log=lambda m: None)
    assert main(["sample", "--run-dir", str(run), "--max-new-tokens", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.logit_softcap is 15.0" in err and "\n" not in err and "Traceback" not in err
