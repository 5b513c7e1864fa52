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
import re
import shutil
import subprocess
import sys
import tarfile

import pytest
import torch

from gptlib.checkpoint import mirror as gmirror
from gptlib.checkpoint.format import list_checkpoints, verify_checkpoint
from gptlib.data.prepare import prepare
from gptlib.errors import CheckpointError, ConfigError, LeaseLost, RunDirError
from gptlib.training import resume as gresume
from gptlib.training.logs import read_metrics
from gptlib.training.loop import train
from gptlib.training.resume import StartOptions
from tests.conftest import REPO, TINY
from tests.test_drive_resume import StalledDrive
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
    manifest["files"]["state.json"] = {
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    if manifest_step is not None:
        manifest["step"] = manifest_step
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "edit",
    [
        {"state_step": -5},
        {"state_step": 10**18},
        {"manifest_step": 25},
        {"state_step": 10**18, "manifest_step": 10**18},
    ],
)
def test_a_checkpoint_whose_steps_disagree_is_skipped_and_resume_falls_back(char_data, run, edit):
    edit_checkpoint(ckpt(run, 30), **edit)
    logs = []
    r = train(char_data, run, "phase1", SETTINGS, max_steps=32, progress=False, log=logs.append)
    assert r.resumed_from == 20 and r.step == 32, logs
    assert any(m.startswith("skipping checkpoint") and "step_0000030" in m for m in logs), logs
    assert [row["step"] for row in read_metrics(run)] == list(range(1, 33))


def test_a_deleted_lease_file_stops_its_holder_saying_so(char_data, tmp_path):
    """A user tidying Drive deletes lease.json mid-run. Was: the holder wrote it again and trained on, as it did when
    the lease was gone because another process had taken the run over and finished (issue 44). Now it stops before
    its next write, saying the lease was deleted (no taker's lease is there), and never writes the lease again."""
    run, mirror = tmp_path / "run", tmp_path / "drive"

    def tidy_drive(row):
        if row["step"] == 10:
            (mirror / "lease.json").unlink()
            (run / "lease.json").unlink()

    with pytest.raises(
        LeaseLost, match=r"lease.json was deleted while this process held the run \(by "
    ):
        train(
            char_data,
            run,
            "phase1",
            SETTINGS,
            max_steps=30,
            progress=False,
            log=quiet,
            mirror_dir=mirror,
            on_log=tidy_drive,
        )
    assert not (run / "lease.json").exists() and not (mirror / "lease.json").exists()
    # the step-10 save (the first, after the validation) was not written, nor anything later
    assert list_checkpoints(run) == list_checkpoints(mirror) == []
    assert read_metrics(run)[-1]["step"] == 10


@pytest.fixture(scope="module")
def other_split(char_data, small_text, tmp_path_factory):
    """The same text and tokenizer as char_data, another validation split: other tokens."""
    out = tmp_path_factory.mktemp("other") / "char20"
    prepare([small_text], out, tokenizer_from=char_data, val_fraction=0.2, verbose=False)
    return out


def test_resume_on_other_data_is_refused_naming_the_change(char_data, other_split, run):
    before = sorted(p.name for p in list_checkpoints(run))
    with pytest.raises(
        ConfigError,
        match=r"was trained on other data than .*char20 \(train_tokens \d+ -> \d+, "
        r"val_tokens \d+ -> \d+, tokens_sha256 .*--allow-data-change",
    ) as e:
        train(other_split, run, "phase1", SETTINGS, max_steps=35, progress=False, log=quiet)
    assert "train_tokens" in str(e.value) and "--allow-data-change" in str(e.value)
    assert sorted(p.name for p in list_checkpoints(run)) == before  # nothing written


def test_resume_on_other_data_goes_on_when_asked_and_is_recorded(char_data, other_split, run):
    logs = []
    r = train(
        other_split,
        run,
        "phase1",
        SETTINGS,
        max_steps=35,
        progress=False,
        log=logs.append,
        options=StartOptions(allow_data_change=True),
    )
    assert r.resumed_from == 30 and r.step == 35
    assert any("resume: data changed" in m for m in logs)
    state = json.loads((ckpt(run, 35) / "state.json").read_text())
    [change] = state["data_changes"]
    assert change["step"] == 30 and change["was"]["train_tokens"] != change["now"]["train_tokens"]


def test_a_batch_that_cannot_fit_is_refused_before_anything_is_written(char_data, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(
        ConfigError,
        match=r"batch_size=100,000,000 x block_size=32 needs about [\d,.]+ GiB to train "
        r"but this machine's RAM has [\d,.]+ GiB; lower batch_size",
    ):
        train(
            char_data,
            run,
            "phase1",
            TINY + ["batch_size=100000000"],
            max_steps=2,
            progress=False,
            log=quiet,
        )
    assert not run.exists()  # a refused start leaves no (empty) run dir behind


def _loop(p):
    os.symlink(p.with_name(p.name + "-b"), p)
    os.symlink(p, p.with_name(p.name + "-b"))


@pytest.mark.parametrize(
    "where,kind",
    [
        ("run", "file"),
        ("run", "loop"),
        ("mirror", "file"),
        ("mirror", "loop"),
        ("run/checkpoints", "file"),
        ("run/checkpoints", "loop"),
        ("data", "loop"),
    ],
)
def test_a_run_dir_mirror_or_data_dir_that_is_a_file_or_a_symlink_loop_is_one_line_at_start(
    char_data, tmp_path, where, kind
):
    data = tmp_path / "data"
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    if where == "run/checkpoints":
        run.mkdir()
    target = {"run": run, "mirror": mirror, "run/checkpoints": run / "checkpoints", "data": data}[
        where
    ]
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


@pytest.mark.parametrize("kind", ["loop", "file", "missing"])
def test_sample_on_a_run_dir_that_is_a_symlink_loop_or_a_file_says_which(tmp_path, kind):
    """`sample` (any reader of a run) names a symbolic link loop or a file for what it is, not 'does not exist'."""
    run = tmp_path / "run"
    if kind == "loop":
        _loop(run)
    elif kind == "file":
        run.write_text("not a directory")
    p = subprocess.run(
        [sys.executable, "-m", "gptlib", "sample", "--run-dir", str(run)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = {
        "loop": f"the run directory {run} is a symbolic link loop; choose another path",
        "file": f"the run directory {run} is a file, not a directory; choose another path",
        "missing": f"no valid checkpoint in {run}: the run directory does not exist",
    }[kind]
    assert (
        p.returncode == 2
        and p.stderr.startswith(f"error: {said}")
        and len(p.stderr.splitlines()) == 1
    ), p.stderr


def test_a_failing_drive_copy_names_the_step_already_on_drive(
    char_data, tmp_path, monkeypatch, capsys
):
    run, mirror = tmp_path / "run", tmp_path / "drive"
    train(
        char_data,
        run,
        "phase1",
        SETTINGS,
        max_steps=10,
        progress=False,
        log=quiet,
        mirror_dir=mirror,
    )
    monkeypatch.setattr(gmirror, "MIRROR_RETRY_DELAYS_S", (0.01,))

    def drive_gone(*a, **k):
        raise OSError(107, "Transport endpoint is not connected")

    monkeypatch.setattr(gmirror, "mirror_checkpoint", drive_gone)
    train(
        char_data,
        run,
        "phase1",
        SETTINGS,
        max_steps=20,
        progress=False,
        log=quiet,
        mirror_dir=mirror,
    )
    err = capsys.readouterr().err
    assert "the newest on Drive is step 10 (found there at start)" in err, err
    assert "step None" not in err


# --- issue 26: damaged checkpoints are set aside; damage on Drive is damage; optimizer states that do not fit ------


def truncate(path):
    f = path / "model.pt"
    os.truncate(f, f.stat().st_size // 2)


def set_aside(run):
    return sorted(
        p.name.split(".damaged-")[0] for p in (run / "checkpoints").glob("step_*.damaged-*")
    )


def test_a_new_checkpoint_where_a_damaged_one_was_is_kept(char_data, run):
    """Step 30 truncated: resume from 20 writes a new, intact step 30; the step-40 save's rotation kept 40, 20 and 10
    and deleted that new 30 (the damage was remembered by path). Now the damaged one is set aside, kept as it was."""
    truncate(ckpt(run, 30))
    size = (ckpt(run, 30) / "model.pt").stat().st_size
    logs = []
    r = train(char_data, run, "phase1", SETTINGS, max_steps=40, progress=False, log=logs.append)
    assert r.resumed_from == 20 and r.step == 40, logs
    assert [p.name for p in list_checkpoints(run)] == [
        "step_0000040",
        "step_0000030",
        "step_0000020",
    ]
    for p in list_checkpoints(run):
        verify_checkpoint(p)
    assert set_aside(run) == ["step_0000030"]
    [aside] = (run / "checkpoints").glob("step_0000030.damaged-*")
    assert (aside / "model.pt").stat().st_size == size
    assert any("is set aside as step_0000030.damaged-" in m for m in logs), logs
    r = train(char_data, run, "phase1", SETTINGS, max_steps=45, progress=False, log=quiet)
    # never deleted, never resumed from
    assert r.resumed_from == 40 and set_aside(run) == ["step_0000030"]


def test_a_run_whose_every_checkpoint_is_damaged_starts_over_and_keeps_its_new_ones(char_data, run):
    """Every local checkpoint truncated: a from-scratch run said only "skipping ...", then its step-40 save's rotation
    deleted its new 30, 20 and 10 (they had the damaged ones' paths)."""
    for step in (10, 20, 30):
        truncate(ckpt(run, step))
    logs = []
    r = train(char_data, run, "phase1", SETTINGS, max_steps=40, progress=False, log=logs.append)
    assert r.resumed_from is None and r.step == 40
    assert [p.name for p in list_checkpoints(run)] == [
        "step_0000040",
        "step_0000030",
        "step_0000020",
    ]
    for p in list_checkpoints(run):
        verify_checkpoint(p)
    # none loaded: every damaged one is kept, named (issue 44: was pruned to the newest), none removed
    assert set_aside(run) == ["step_0000010", "step_0000020", "step_0000030"]
    assert not any(m.startswith("removed step_") for m in logs), logs
    [kept] = [m for m in logs if m.startswith("none could be loaded")]
    assert kept.count(".damaged-") == 3, kept
    [line] = [m for m in logs if "starting from scratch" in m]
    assert line == "no checkpoint could be loaded (3 damaged): starting from scratch"


@pytest.fixture(scope="module")
def drive_at_30(char_data, tmp_path_factory):
    """A Drive mirror holding steps 10, 20 and 30 (its VM gone)."""
    root = tmp_path_factory.mktemp("drive30")
    train(
        char_data,
        root / "vm1",
        "phase1",
        SETTINGS,
        max_steps=30,
        progress=False,
        log=quiet,
        mirror_dir=root / "drive",
    )
    return root / "drive"


def test_a_corrupt_checkpoint_on_drive_is_skipped_at_once(
    char_data, drive_at_30, tmp_path, monkeypatch, capsys
):
    """One flipped byte in Drive's newest checkpoint, an empty local disk: the copy's hash check raised EIO, filed
    as "could not read", so resume waited (300 s), then refused to start. A hash mismatch is damage: skipped at
    once, resume from step 20, and the corrupt one is set aside on Drive, kept as it was."""
    mirror = tmp_path / "drive"
    shutil.copytree(drive_at_30, mirror)
    f = ckpt(mirror, 30) / "train_state.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    monkeypatch.setattr(gresume, "DRIVE_RESUME_RETRY_S", 0.5)
    monkeypatch.setattr(gresume, "DRIVE_RESUME_WAIT_S", 2.0)  # before the fix: a refusal after 2 s
    logs = []
    r = train(
        char_data,
        tmp_path / "vm2",
        "phase1",
        SETTINGS,
        max_steps=35,
        progress=False,
        log=logs.append,
        mirror_dir=mirror,
    )
    assert r.resumed_from == 20 and r.step == 35, logs
    assert "trying again" not in capsys.readouterr().err
    [line] = [m for m in logs if m.startswith("skipping checkpoint")]
    assert "step_0000030" in line and "sha256 differs from the manifest (corrupted)" in line, line
    assert set_aside(mirror) == ["step_0000030"]
    [aside] = (mirror / "checkpoints").glob("step_0000030.damaged-*")
    assert (aside / "train_state.pt").read_bytes() == bytes(data)
    assert [p.name for p in list_checkpoints(mirror)][:2] == ["step_0000035", "step_0000030"]
    verify_checkpoint(ckpt(mirror, 30))  # the new one


def test_a_refused_start_leaves_no_copy_from_drive(char_data, drive_at_30, tmp_path, monkeypatch):
    """Drive's step 30 hangs, step 20 is fine: resume copies 20 to the empty local disk, waits for 30, then refuses
    saying "nothing was changed"; the copy of 20 stayed in the local run dir."""
    mirror = tmp_path / "drive"
    shutil.copytree(drive_at_30, mirror)
    monkeypatch.setattr(gresume, "DRIVE_READ_STALL_S", 0.5)
    monkeypatch.setattr(gresume, "DRIVE_RESUME_RETRY_S", 0.5)
    monkeypatch.setattr(gresume, "DRIVE_RESUME_WAIT_S", 1.5)
    stalled = StalledDrive(mirror, [30], tmp_path)
    run = tmp_path / "vm2"
    try:
        with pytest.raises(CheckpointError, match="training did not start and nothing was changed"):
            train(
                char_data,
                run,
                "phase1",
                SETTINGS,
                max_steps=35,
                progress=False,
                log=quiet,
                mirror_dir=mirror,
            )
    finally:
        stalled.release()
    assert not run.exists(), sorted(p.name for p in run.rglob("*"))


def rewrite_train_state(path, edit):
    """train_state.pt rewritten by edit(state), the manifest re-hashed as a careful (or buggy) writer would."""
    f = path / "train_state.pt"
    state = torch.load(f, weights_only=True)
    edit(state)
    torch.save(state, f)
    manifest = json.loads((path / "manifest.json").read_text())
    data = f.read_bytes()
    manifest["files"]["train_state.pt"] = {
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("recipe,moment", [("gpt2", "exp_avg"), ("modern", "momentum_buffer")])
def test_an_optimizer_state_of_the_wrong_shape_is_skipped_as_damaged(
    char_data, tmp_path, recipe, moment
):
    """A train_state.pt that verifies but whose AdamW moment (Muon momentum) has another shape than its parameter:
    a traceback at the first step after "resumed from step 20". Now it is damaged: skipped, the run resumes from 10."""
    run = tmp_path / "run"
    train(
        char_data, run, "phase1", SETTINGS, max_steps=20, progress=False, log=quiet, recipe=recipe
    )

    def wrong_shape(state):
        opt = state["optimizer"]["muon"] if recipe == "modern" else state["optimizer"]
        part = opt["state"][0]
        part[moment] = torch.zeros(part[moment].shape[0] + 1, *part[moment].shape[1:])

    rewrite_train_state(ckpt(run, 20), wrong_shape)
    verify_checkpoint(ckpt(run, 20))
    logs = []
    r = train(
        char_data,
        run,
        "phase1",
        SETTINGS,
        max_steps=22,
        progress=False,
        log=logs.append,
        recipe=recipe,
    )
    assert r.resumed_from == 10 and r.step == 22, logs
    [line] = [m for m in logs if m.startswith("skipping checkpoint")]
    assert "step_0000020" in line and f"{moment} of parameter 0 has shape" in line, line
    assert set_aside(run) == ["step_0000020"]


def test_the_ram_check_counts_fp32_activations_and_runs_with_auto_batch(
    char_data, tmp_path, monkeypatch
):
    """On a CPU (fp32, no memory probe): a batch whose bf16-sized estimate fits this RAM but whose fp32 training does
    not is refused, with auto_batch on too (it was passed, then swapped or OOM-killed; auto_batch skipped the check)."""
    import psutil

    from gptlib.config import build_config
    from gptlib.training import start

    cfg = build_config("phase1", TINY + ["batch_size=4096", "auto_batch=true"])
    bf16 = start.estimate_train_bytes(cfg.model, 4096)
    fp32 = start.estimate_train_bytes(cfg.model, 4096, activation_bytes=4)
    ram = type("RAM", (), {"total": (bf16 + fp32) // 2})
    monkeypatch.setattr(psutil, "virtual_memory", lambda: ram)
    with pytest.raises(ConfigError, match="batch_size=4,096 x block_size=32 needs about"):
        start.check_fits(cfg, torch.device("cpu"))


@pytest.mark.parametrize("into", ["run_dir", "mirror_dir"])
def test_a_dataset_is_never_taken_for_a_run_directory(char_data, tmp_path, into):
    """train --run-dir (or --mirror-dir) naming a dataset: refused, the dataset unchanged (the run wrote its
    config.json and tokenizer.json over the dataset's, and the dataset then failed its tokenizer check)."""
    import hashlib
    import shutil

    from gptlib.data.shards import read_meta

    data = tmp_path / "data"
    shutil.copytree(char_data, data)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in data.iterdir()}
    dirs = {"run_dir": tmp_path / "run", "mirror_dir": None, into: data}
    what = {"run_dir": "run directory", "mirror_dir": "mirror directory"}
    with pytest.raises(RunDirError, match=rf"{what[into]} {data} holds meta.json: it is a gptlib"):
        train(
            char_data,
            dirs["run_dir"],
            "phase1",
            TINY,
            max_steps=2,
            progress=False,
            log=quiet,
            mirror_dir=dirs["mirror_dir"],
        )
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in data.iterdir()} == before
    read_meta(data)


@pytest.mark.parametrize("other", ["fewer characters", "other characters"])
def test_a_mirror_holding_another_run_is_refused_and_left_as_it_was(
    run, char_data, small_text, tmp_path, other
):
    """train --mirror-dir naming another run's folder (another dataset, its Drive copy): refused with both values,
    whether this run or that folder is ahead; that run left as it was (this run wrote its config.json, tokenizer.json
    and logs over that run's, and keep_last deleted its checkpoints). Same vocabulary size, other characters: its
    tokenizer tells it apart."""
    text = small_text.read_text()
    text = text.lower() if other == "fewer characters" else text.replace("z", "#")
    (tmp_path / "other.txt").write_text(text)
    prepare([tmp_path / "other.txt"], tmp_path / "other_data", tokenizer="char", verbose=False)
    theirs = tmp_path / "drive" / "other"
    args = dict(progress=False, log=quiet, mirror_dir=theirs)
    train(
        tmp_path / "other_data", theirs, "phase1", SETTINGS, max_steps=10, progress=False, log=quiet
    )
    before = {
        p: p.read_bytes() for p in theirs.rglob("*") if p.is_file() and p.name != "lease.json"
    }
    # this run ahead (step 30): it would write and rotate there
    with pytest.raises(ConfigError) as e:
        train(char_data, run, "phase1", SETTINGS, max_steps=32, **args)
    field = (
        r"its config\.json has vocab_size=37, this run's has 61"
        if other == "fewer characters"
        else r"its tokenizer\.json is char, 61 tokens \(\w{12}\), this run's is char, 61 tokens \(\w{12}\)"
    )
    assert re.fullmatch(
        rf"--mirror-dir {theirs} holds another run: {field}; choose another folder.*", str(e.value)
    ), e.value
    assert list_checkpoints(run)[0].name == "step_0000030"
    # that run ahead (a new local folder): a resume from it, refused naming that folder, not the new one, and the
    # data (another vocabulary size too: not a vocab_size the user never set)
    new = tmp_path / "new"
    with pytest.raises(ConfigError, match=rf"^{theirs}\S* was trained on other data"):
        train(char_data, new, "phase1", SETTINGS, max_steps=12, **args)
    assert {
        p: p.read_bytes() for p in theirs.rglob("*") if p.is_file() and p.name != "lease.json"
    } == before


@pytest.mark.parametrize("into", ["--run-dir", "--mirror-dir"])
def test_a_folder_holding_a_config_json_of_the_users_is_never_taken_for_a_run(
    char_data, tmp_path, capsys, into
):
    """train --run-dir (or --mirror-dir) naming a folder with a config.json that is not a run's: refused in one line
    naming it, nothing written there (training wrote its own config.json over it). Other files of the user's are
    not refused, nor a config.json of an older gptlib (model and train sections, no gptlib_version)."""
    from gptlib.__main__ import main

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    dirs = {"--run-dir": tmp_path / "run", into: mine}
    argv = ["train", "--data", str(char_data), "--device", "cpu", "--quiet", "--max-steps", "2"]
    argv += [str(a) for d in dirs.items() for a in d] + [a for s in TINY for a in ("--set", s)]
    what = {"--run-dir": "run directory", "--mirror-dir": "mirror directory"}[into]
    for mine_json in ('{"my": "settings"}', "[1, 2]", "my settings"):
        (mine / "config.json").write_text(mine_json)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == (
            f"error: {what} {mine} holds config.json, which is not a gptlib run's (no model and train "
            f"sections): training would write its own over it; move it, or choose another folder\n"
        ), err
        assert (mine / "config.json").read_text() == mine_json
        assert sorted(p.name for p in mine.iterdir()) == ["config.json", "notes.txt"]
    # the config.json of a run made by gptlib ce01044 (tests/test_old_checkpoints.py), on this data
    with tarfile.open(REPO / "tests" / "fixtures" / "run_ce01044.tar.gz") as tar:
        old = json.load(tar.extractfile("run/config.json"))
    assert "gptlib_version" not in old
    (mine / "config.json").write_text(json.dumps(old))
    assert main(argv) == 0
    assert json.loads((mine / "config.json").read_text())["gptlib_version"]
