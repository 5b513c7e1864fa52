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
import hashlib
import json
import shutil
import tarfile

import pytest
import torch

from gptlib.checkpoint.format import load_model_weights, save_checkpoint
from gptlib.config import RunConfig, get_preset
from gptlib.errors import ConfigError
from gptlib.inference.loading import load_run
from gptlib.layout import LOG_FILES, checkpoints_dir
from gptlib.training import loop as gloop
from gptlib.training.logs import read_metrics
from gptlib.training.loop import train
from tests import faulty
from tests.conftest import REPO, TINY, newest_checkpoint
from tests.test_resume import one_thread  # noqa: F401 (fixture)

FIXTURE = REPO / "tests" / "fixtures" / "run_ce01044.tar.gz"
SETTINGS = TINY + ["dropout=0.1", "save_every_steps=5", "keep_last=2"]
# state.json's fields that describe the session that resumes, not the state it resumes (TrainingRun.load_state_dict);
# pending_losses, which a checkpoint no longer holds (it falls on a log boundary; the fixture's is empty); and rng,
# Python's and numpy's generators, which nothing in training draws from
SESSION_FIELDS = (
    "val_loss",
    "milestone",
    "config",
    "data",
    "data_dir",
    "tokenizer",
    "pending_losses",
    "rng",
)


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
    files = (
        torch.load(ck / "model.pt", weights_only=True),
        torch.load(ck / "train_state.pt", weights_only=True),
        json.loads((ck / "state.json").read_text()),
    )
    restored, real_loop = [], gloop._loop

    # the run's state as restored, before its first step (copied: training changes it)
    def loop(s, *a, **k):
        restored.append(copy.deepcopy(s.state_dict()))
        return real_loop(s, *a, **k)

    monkeypatch.setattr(gloop, "_loop", loop)
    r = train(
        char_data,
        old,
        "phase1",
        SETTINGS,
        max_steps=30,
        device="cpu",
        progress=False,
        log=lambda m: None,
    )
    monkeypatch.undo()
    assert r.resumed_from == 20 and r.step == 30
    [state] = restored
    assert_holds(state["model"], files[0], "model.pt")
    assert_holds(
        {k: state[k] for k in ("optimizer", "scaler", "sampler", "rng")}, files[1], "train_state.pt"
    )
    assert files[2]["pending_losses"] == []  # log_interval=1: every step was logged before the save
    assert_holds(
        state["progress"],
        {k: v for k, v in files[2].items() if k not in SESSION_FIELDS},
        "state.json",
    )

    # the same state as a checkpoint of today's format, resumed to step 30 here too: the same run, bit for bit
    shutil.rmtree(checkpoints_dir(now) / "step_0000020")
    save_checkpoint(
        checkpoints_dir(now), state, {name: (ck / name).read_bytes() for name in LOG_FILES}
    )
    r = train(
        char_data,
        now,
        "phase1",
        SETTINGS,
        max_steps=30,
        device="cpu",
        progress=False,
        log=lambda m: None,
    )
    assert r.resumed_from == 20 and r.step == 30
    assert curve(old) == curve(now) and len(curve(now)) == 30
    a = load_model_weights(newest_checkpoint(old).path)
    b = load_model_weights(newest_checkpoint(now).path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _set_model_field(ckpt_dir, name, value):
    """Write a model field into a checkpoint's state.json as an older gptlib did, the manifest re-hashed to match."""
    state = json.loads((ckpt_dir / "state.json").read_text())
    state["config"]["model"][name] = value
    (ckpt_dir / "state.json").write_text(json.dumps(state))
    manifest = json.loads((ckpt_dir / "manifest.json").read_text())
    data = (ckpt_dir / "state.json").read_bytes()
    manifest["files"]["state.json"] = {
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    (ckpt_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.usefixtures("one_thread")
def test_a_checkpoint_that_recorded_the_dropped_soft_cap_as_off_loads_and_resumes_exactly(
    char_data, tmp_path
):
    """Every run made with the defaults before issue 27 recorded logit_softcap 0.0: it loads and resumes exactly."""
    alone = tmp_path / "alone"
    train(
        char_data,
        alone,
        "phase1",
        SETTINGS,
        max_steps=30,
        device="cpu",
        progress=False,
        log=lambda m: None,
    )
    old = tmp_path / "old"
    shutil.copytree(alone, old)
    shutil.rmtree(old / "checkpoints" / "step_0000030")
    _set_model_field(old / "checkpoints" / "step_0000025", "logit_softcap", 0.0)
    assert load_run(old).step == 25
    r = train(
        char_data,
        old,
        "phase1",
        SETTINGS,
        max_steps=30,
        device="cpu",
        progress=False,
        log=lambda m: None,
    )
    assert r.resumed_from == 25 and r.step == 30
    assert curve(old) == curve(alone)
    a = load_model_weights(newest_checkpoint(old).path)
    b = load_model_weights(newest_checkpoint(alone).path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "name,value,loads",
    [
        ("logit_softcap", 0, True),
        ("logit_softcap", 15.0, False),
        ("mlp", "relu2", False),
        ("mlp", "gelu", True),
    ],
)
def test_a_run_that_used_a_dropped_option_is_refused_in_one_line(name, value, loads):
    """The ReLU² MLP and the logit soft cap are gone: a config that used one names its file, the field and the value."""
    cfg = get_preset("phase1").to_dict()
    cfg["model"][name] = value
    if loads:
        assert RunConfig.from_dict(cfg, "run/state.json") == get_preset("phase1")
        return
    with pytest.raises(ConfigError) as e:
        RunConfig.from_dict(cfg, "run/checkpoints/step_0000020/state.json")
    assert str(e.value).startswith(
        f"run/checkpoints/step_0000020/state.json: model.{name} is {value!r}, an option "
        f"gptlib no longer has"
    ) and "\n" not in str(e.value)


def test_loading_or_resuming_a_run_that_used_the_soft_cap_is_refused(char_data, tmp_path, capsys):
    from gptlib.__main__ import main

    run = tmp_path / "run"
    train(
        char_data,
        run,
        "phase1",
        SETTINGS,
        max_steps=5,
        device="cpu",
        progress=False,
        log=lambda m: None,
    )
    ckpt = run / "checkpoints" / "step_0000005"
    _set_model_field(ckpt, "logit_softcap", 15.0)
    with pytest.raises(ConfigError, match=f"{ckpt / 'state.json'}: model.logit_softcap is 15.0"):
        load_run(run)
    with pytest.raises(ConfigError, match=f"{ckpt / 'state.json'}: model.logit_softcap is 15.0"):
        train(
            char_data,
            run,
            "phase1",
            SETTINGS,
            max_steps=10,
            device="cpu",
            progress=False,
            log=lambda m: None,
        )
    assert main(["sample", "--run-dir", str(run), "--max-new-tokens", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.logit_softcap is 15.0" in err and "\n" not in err and "Traceback" not in err


def test_a_checkpoint_holding_pending_losses_resumes_without_logging_them_again(
    char_data, tmp_path
):
    """A checkpoint of a gptlib that replayed not-yet-logged losses across a resume (state.json's pending_losses,
    here made up) resumes; those losses are not logged again: the rows the run wrote for its steps stay, once each."""
    settings = TINY + ["dropout=0.1", "save_every_steps=5", "keep_last=4"]
    alone, run = tmp_path / "alone", tmp_path / "run"
    train(
        char_data,
        alone,
        "phase1",
        settings,
        max_steps=20,
        device="cpu",
        progress=False,
        log=lambda m: None,
    )
    # a run of the same schedule that stopped at step 10
    undo = faulty.install("interrupt:mid_step@11")
    try:
        train(
            char_data,
            run,
            "phase1",
            settings,
            max_steps=20,
            device="cpu",
            progress=False,
            log=lambda m: None,
        )
    finally:
        undo()
    ck = checkpoints_dir(run) / "step_0000010"
    model, train_state = (
        torch.load(ck / name, weights_only=True) for name in ("model.pt", "train_state.pt")
    )
    # steps 9 and 10's
    state = {
        **json.loads((ck / "state.json").read_text()),
        "pending_losses": [9.5, 9.25],
    }
    save_checkpoint(
        checkpoints_dir(run),
        {"model": model, **train_state, "progress": state},
        {name: (ck / name).read_bytes() for name in LOG_FILES},
    )
    r = train(
        char_data,
        run,
        "phase1",
        settings,
        max_steps=20,
        device="cpu",
        progress=False,
        log=lambda m: None,
    )
    assert r.resumed_from == 10 and r.step == 20
    rows = curve(run)
    assert [row[0] for row in rows] == list(range(1, 21)) and 9.5 not in [row[1] for row in rows]
    assert rows == curve(alone)
