"""What an adversarial run of training found (issue 18, part 2): each case one clear line, nothing damaged.

Each test failed on the code before the fix: a hand-edited checkpoint step resumed (or "finished"), a deleted
lease file read as a take-over, other data resumed silently, an impossible batch size a traceback after
config.json was written, a run dir that is a file or a symlink loop a traceback, a refused start an empty run
dir left behind, and "newest on Drive is step None" while step 10 was there.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from gptlib.checkpoint import mirror as gmirror
from gptlib.checkpoint.format import list_checkpoints
from gptlib.data.prepare import prepare
from gptlib.errors import ConfigError, RunDirError
from gptlib.training.logs import read_metrics
from gptlib.training.loop import train
from tests.conftest import TINY
from tests.test_resume import one_thread  # noqa: F401 (fixture)

SETTINGS = TINY + ["keep_last=3"]


def quiet(_msg):
    pass


def ckpt(run, step):
    return run / "checkpoints" / f"step_{step:07d}"


@pytest.fixture(scope="module")
def run_at_30(char_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("r30") / "run"
    train(char_data, run, "phase1", SETTINGS, max_steps=30, progress=False, log=quiet)
    return run


@pytest.fixture()
def run(run_at_30, tmp_path):
    import shutil

    shutil.copytree(run_at_30, tmp_path / "run")
    return tmp_path / "run"


def edit_checkpoint(path, state_step=None, manifest_step=None):
    """Rewrite state.json's step and/or the manifest's step, re-hashing the manifest as a careful editor would."""
    state = json.loads((path / "state.json").read_text())
    if state_step is not None:
        state["step"] = state_step
        (path / "state.json").write_text(json.dumps(state))
    manifest = json.loads((path / "manifest.json").read_text())
    data = (path / "state.json").read_bytes()
    manifest["files"]["state.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if manifest_step is not None:
        manifest["step"] = manifest_step
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("edit", [{"state_step": -5}, {"state_step": 10**18}, {"manifest_step": 25},
                                  {"state_step": 10**18, "manifest_step": 10**18}])
def test_a_checkpoint_whose_steps_disagree_is_skipped_and_resume_falls_back(char_data, run, edit):
    edit_checkpoint(ckpt(run, 30), **edit)
    logs = []
    r = train(char_data, run, "phase1", SETTINGS, max_steps=32, progress=False, log=logs.append)
    assert r.resumed_from == 20 and r.step == 32, logs
    assert any(m.startswith("skipping checkpoint") and "step_0000030" in m for m in logs), logs
    assert [row["step"] for row in read_metrics(run)] == list(range(1, 33))


def test_a_deleted_lease_file_is_written_again_by_its_live_holder(char_data, tmp_path, capsys):
    """A user tidying Drive deletes lease.json mid-run: the holder writes it again and trains on."""
    run, mirror = tmp_path / "run", tmp_path / "drive"

    def tidy_drive(row):
        if row["step"] == 10:
            (mirror / "lease.json").unlink()
            (run / "lease.json").unlink()

    r = train(char_data, run, "phase1", SETTINGS, max_steps=30, progress=False, log=quiet, mirror_dir=mirror,
              on_log=tidy_drive)
    assert r.step == 30 and r.stopped_by == "max_steps"
    assert "was deleted while this process holds the run; writing it again" in capsys.readouterr().err
    assert [p.name for p in list_checkpoints(mirror)][0] == "step_0000030"


@pytest.fixture(scope="module")
def other_split(char_data, small_text, tmp_path_factory):
    """The same text and tokenizer as char_data, another validation split: other tokens."""
    out = tmp_path_factory.mktemp("other") / "char20"
    prepare([small_text], out, tokenizer_from=char_data, val_fraction=0.2, verbose=False)
    return out


def test_resume_on_other_data_is_refused_naming_the_change(char_data, other_split, run):
    before = sorted(p.name for p in list_checkpoints(run))
    with pytest.raises(ConfigError, match=r"was trained on other data than .*char20 \(train_tokens \d+ -> \d+, "
                                          r"val_tokens \d+ -> \d+, tokens_sha256 .*--allow-data-change") as e:
        train(other_split, run, "phase1", SETTINGS, max_steps=35, progress=False, log=quiet)
    assert "train_tokens" in str(e.value) and "--allow-data-change" in str(e.value)
    assert sorted(p.name for p in list_checkpoints(run)) == before  # nothing written


def test_resume_on_other_data_goes_on_when_asked_and_is_recorded(char_data, other_split, run):
    logs = []
    r = train(other_split, run, "phase1", SETTINGS, max_steps=35, progress=False, log=logs.append,
              allow_data_change=True)
    assert r.resumed_from == 30 and r.step == 35
    assert any("resume: data changed" in m for m in logs)
    state = json.loads((ckpt(run, 35) / "state.json").read_text())
    [change] = state["data_changes"]
    assert change["step"] == 30 and change["was"]["train_tokens"] != change["now"]["train_tokens"]


def test_a_batch_that_cannot_fit_is_refused_before_anything_is_written(char_data, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"batch_size=100,000,000 x block_size=32 needs about [\d,.]+ GiB to train "
                                          r"but this machine's RAM has [\d,.]+ GiB; lower batch_size"):
        train(char_data, run, "phase1", TINY + ["batch_size=100000000"], max_steps=2, progress=False, log=quiet)
    assert not run.exists()  # a refused start leaves no (empty) run dir behind


def _loop(p):
    os.symlink(p.with_name(p.name + "-b"), p)
    os.symlink(p, p.with_name(p.name + "-b"))


@pytest.mark.parametrize("where,kind", [("run", "file"), ("run", "loop"), ("mirror", "file"), ("mirror", "loop"),
                                        ("run/checkpoints", "file"), ("run/checkpoints", "loop"), ("data", "loop")])
def test_a_run_dir_mirror_or_data_dir_that_is_a_file_or_a_symlink_loop_is_one_line_at_start(
        char_data, tmp_path, where, kind):
    import shutil

    data = tmp_path / "data"
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    if where == "run/checkpoints":
        run.mkdir()
    target = {"run": run, "mirror": mirror, "run/checkpoints": run / "checkpoints", "data": data}[where]
    if where != "data":
        shutil.copytree(char_data, data)
    if kind == "file":
        target.write_text("not a directory")
    else:
        _loop(target)
    what = {"file": "is a file, not a directory", "loop": "is a symbolic link loop"}[kind]
    with pytest.raises(RunDirError, match=what):
        train(data, run, "phase1", TINY, max_steps=2, progress=False, log=quiet, mirror_dir=mirror)
    assert not (run / "config.json").exists()


def test_a_failing_drive_copy_names_the_step_already_on_drive(char_data, tmp_path, monkeypatch, capsys):
    run, mirror = tmp_path / "run", tmp_path / "drive"
    train(char_data, run, "phase1", SETTINGS, max_steps=10, progress=False, log=quiet, mirror_dir=mirror)
    monkeypatch.setattr(gmirror, "MIRROR_RETRY_DELAYS_S", (0.01,))

    def drive_gone(*a, **k):
        raise OSError(107, "Transport endpoint is not connected")

    monkeypatch.setattr(gmirror, "mirror_checkpoint", drive_gone)
    train(char_data, run, "phase1", SETTINGS, max_steps=20, progress=False, log=quiet, mirror_dir=mirror)
    err = capsys.readouterr().err
    assert "the newest on Drive is step 10 (found there at start)" in err, err
    assert "step None" not in err
