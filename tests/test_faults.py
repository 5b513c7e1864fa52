"""Fault injection: each fault ends with the previous checkpoint intact and the newest valid one
resumed with a clear message.

SIGKILL during a step / mid-save / between rename and rotation / during rotation / during the Drive
copy, and SIGTERM, run as real subprocess kills in test_resume.py (which also checks exactness).
Here: corrupted checkpoints, a full disk, Drive errors and hangs, config mismatches, a malicious
pickle and KeyboardInterrupt, mostly in-process with the tiny config.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading

import pytest

from gptlib.__main__ import main as cli_main
from gptlib.checkpoint import mirror as gmirror
from gptlib.checkpoint.format import CheckpointError, list_checkpoints, verify_checkpoint
from gptlib.config import ConfigError
from gptlib.fsutil import sha256_file
from gptlib.training.resume import StartOptions
from tests import faulty
from tests.conftest import newest_checkpoint
from tests.test_resume import MAX_STEPS, SETTINGS, curve, one_thread, run_inproc  # noqa: F401 (fixture)

CKPT = "checkpoints"


def ckpt_dir(run_dir, step):
    return run_dir / CKPT / f"step_{step:07d}"


def tree_hashes(d):
    return {str(p.relative_to(d)): sha256_file(p) for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(char_data, tmp_path_factory):
    """A finished 20-step run: checkpoints at 15 and 20 (keep_last=2; 20 is also the best)."""
    import torch

    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("trained") / "run"
    run_inproc(char_data, d, log=lambda m: None)
    assert [p.name for p in list_checkpoints(d)] == ["step_0000020", "step_0000015"]
    return d


@pytest.fixture
def run(trained, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(trained, d)
    return d


def resume(char_data, run_dir, capsys, mirror_dir=None):
    capsys.readouterr()
    r = run_inproc(char_data, run_dir, mirror_dir=mirror_dir)
    cap = capsys.readouterr()
    return r, cap.out, cap.err


def assert_fell_back(char_data, run, capsys, reason):
    """The damaged step 20 is skipped with `reason`; step 15 (intact) is resumed; the run re-saves 20."""
    prev = tree_hashes(ckpt_dir(run, 15))
    r, out, _ = resume(char_data, run, capsys)
    assert "skipping checkpoint" in out and reason in out, out
    assert r.resumed_from == 15 and "resumed from step 15" in out, out
    assert r.step == MAX_STEPS
    assert verify_checkpoint(ckpt_dir(run, 20)).step == 20  # replaced by a good one
    assert sorted(curve(run)) == list(range(1, MAX_STEPS + 1))
    # step 15 was never written to (it may have been rotated out afterwards, but not damaged before)
    if ckpt_dir(run, 15).exists():
        assert tree_hashes(ckpt_dir(run, 15)) == prev


@pytest.mark.parametrize("fraction", [0.0, 0.5, 0.99])
def test_truncated_checkpoint_falls_back(char_data, run, capsys, fraction):
    f = ckpt_dir(run, 20) / "model.pt"
    size = f.stat().st_size
    os.truncate(f, int(size * fraction))
    assert_fell_back(char_data, run, capsys, "truncated or incomplete")


def test_one_flipped_byte_falls_back(char_data, run, capsys):
    f = ckpt_dir(run, 20) / "train_state.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    assert_fell_back(char_data, run, capsys, "sha256 differs")


def test_a_missing_manifest_is_not_damage_training_stops_at_once(char_data, run, capsys):
    """A checkpoint without its manifest cannot be judged (a save never leaves one so; on Drive it is one not synced
    yet): not set aside, not passed over silently. On the local disk nothing will change, so no waiting; the line
    names --skip-unreadable, which goes on from step 15 and keeps it. (Was: "no manifest.json (the save did not
    finish)", set aside as damaged.)"""
    (ckpt_dir(run, 20) / "manifest.json").unlink()
    before = tree_hashes(run / CKPT)
    with pytest.raises(CheckpointError) as e:
        run_inproc(char_data, run)
    msg = str(e.value)
    assert (
        "manifest.json is not there now" in msg
        and "(on the local disk)" in msg
        and "--skip-unreadable" in msg
    )
    assert "trying again" not in capsys.readouterr().err  # the local disk is not waited for
    assert tree_hashes(run / CKPT) == before and not list((run / CKPT).glob("*.damaged-*"))
    r = run_inproc(char_data, run, options=StartOptions(skip_unreadable=True))
    assert r.resumed_from == 15
    assert not list((run / CKPT).glob("*.damaged-*"))


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['GPTLIB_EVIL_MARKER']}",))


def test_malicious_pickle_is_refused_and_previous_resumed(
    char_data, run, capsys, tmp_path, monkeypatch
):
    """A newer checkpoint whose manifest is consistent but whose model.pt would run code on load."""
    marker = tmp_path / "pwned"
    monkeypatch.setenv("GPTLIB_EVIL_MARKER", str(marker))
    evil = ckpt_dir(run, 25)
    shutil.copytree(ckpt_dir(run, 20), evil)
    (evil / "model.pt").write_bytes(pickle.dumps({"w": _Evil()}))
    m = json.loads((evil / "manifest.json").read_text())
    m["step"] = 25
    m["files"]["model.pt"] = {
        "size": (evil / "model.pt").stat().st_size,
        "sha256": sha256_file(evil / "model.pt"),
    }
    (evil / "manifest.json").write_text(json.dumps(m))
    verify_checkpoint(evil)  # it passes the integrity check: only safe loading stops it
    r, out, _ = resume(char_data, run, capsys)
    assert not marker.exists(), "the pickle ran code"
    assert "cannot load safely" in out and "step_0000025" in out, out
    assert r.resumed_from == 20 and r.summary().startswith("already finished at step 20")


def test_enospc_during_save_is_loud_and_keeps_previous(char_data, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    undo = faulty.install("enospc:save_mid@15")
    try:
        with pytest.raises(CheckpointError) as ei:
            run_inproc(char_data, run, log=lambda m: None)
    finally:
        undo()
    msg = str(ei.value)
    assert "the disk is full" in msg and "newest intact checkpoint is step 10" in msg, msg
    assert sorted(p.name for p in (run / CKPT).iterdir()) == ["step_0000005", "step_0000010"]
    verify_checkpoint(ckpt_dir(run, 10))  # previous intact; the partial step-15 dir was removed
    r, out, _ = resume(char_data, run, capsys)
    assert r.resumed_from == 10 and "resumed from step 10" in out and r.step == MAX_STEPS


def test_keyboard_interrupt_mid_step_saves_nothing(char_data, tmp_path, capsys, monkeypatch):
    """An interrupt that cuts a step in two (no signal handlers: not the main thread) leaves its half-made state
    unsaved, says so in one line, and the last checkpoint stands."""
    run = tmp_path / "run"
    said = []
    undo = faulty.install("interrupt:mid_step@13")
    try:
        r = run_inproc(char_data, run, log=said.append)
    finally:
        undo()
    assert r.stopped_by == "interrupt" and r.step == 12
    assert sorted(p.name for p in (run / CKPT).iterdir()) == ["step_0000005", "step_0000010"]
    assert any("interrupted during step 13" in m and "nothing saved" in m for m in said), said
    r, out, _ = resume(char_data, run, capsys)
    assert r.resumed_from == 10 and "resumed from step 10" in out


# --- config mismatch -----------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [("n_layer", 3), ("block_size", 64), ("n_embd", 48)])
def test_config_mismatch_names_field_and_both_values(char_data, run, field, value, capsys):
    before = tree_hashes(run / CKPT)
    old = {"n_layer": 2, "block_size": 32, "n_embd": 32}[field]
    with pytest.raises(ConfigError) as ei:
        ck_train(char_data, run, SETTINGS + [f"{field}={value}"])
    msg = str(ei.value)
    assert f"{field}={old}" in msg and f"{field}={value}" in msg, msg
    assert tree_hashes(run / CKPT) == before  # nothing touched
    # The CLI says the same in one line, without a traceback.
    args = [
        "train",
        "--data",
        str(char_data),
        "--run-dir",
        str(run),
        "--preset",
        "phase1",
        "--max-steps",
        str(MAX_STEPS),
        "--device",
        "cpu",
        "--quiet",
    ]
    for s in SETTINGS + [f"{field}={value}"]:
        args += ["--set", s]
    capsys.readouterr()
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"{field}={old}" in err and "Traceback" not in err
    # the original config resumes fine (the finished run: said so)
    r, out, _ = resume(char_data, run, capsys)
    assert r.resumed_from == 20 and r.stopped_by == "finished" and "error" not in out


def ck_train(data, run_dir, settings):
    from gptlib.training.loop import train

    return train(
        data,
        run_dir,
        "phase1",
        settings,
        max_steps=MAX_STEPS,
        device="cpu",
        progress=False,
        log=lambda m: None,
    )


def test_tokenizer_mismatch_names_field(run, tmp_path, small_text):
    """Resuming on data with a different tokenizer (here: a different character set)."""
    from gptlib.data.prepare import prepare_text

    other_text = tmp_path / "upper.txt"
    other_text.write_text(small_text.read_text()[:50_000].upper())
    other = tmp_path / "other_data"
    prepare_text([other_text], other, tokenizer="char", verbose=False)
    with pytest.raises(ConfigError) as ei:
        ck_train(other, run, SETTINGS)
    msg = str(ei.value)
    # the data is checked first (its vocabulary is the model's): the field named with both values
    assert "trained on other data" in msg and re.search(r"vocab_size 61 -> \d+", msg), msg


# --- Drive (mirror) failures ------------------------------------------------------------------------


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(gmirror, "MIRROR_RETRY_DELAYS_S", (0.05, 0.05))
    monkeypatch.setattr(gmirror, "MIRROR_STALL_TIMEOUT_S", 0.5)


@pytest.mark.parametrize("code", [errno.ENOTCONN, errno.EIO])
def test_drive_copy_errors_never_stop_training(
    char_data, tmp_path, capsys, monkeypatch, fast_retries, code
):
    run, mirror = tmp_path / "local" / "run", tmp_path / "drive" / "run"

    def broken(*a, **k):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(gmirror, "copy_file_verified", broken)
    r, out, err = resume(char_data, run, capsys, mirror_dir=mirror)
    assert r.step == MAX_STEPS and r.stopped_by == "max_steps"  # training went on
    assert f"[Errno {code}]" in err and "DRIVE COPY FAILED" in err, err
    assert "is NOT on Drive" in err  # the end-of-run summary says where the newest checkpoint is
    assert r.not_on_drive == 20 and r.summary().endswith(
        "; !! step 20 is NOT on Drive, only on this disk: its copy "
        "failed (see above); re-run once Drive works"
    )
    assert "DRIVE COPY FAILING" in out  # shown in the loop's validation line too
    assert verify_checkpoint(ckpt_dir(run, 20)).step == 20  # local saving never stopped
    assert newest_checkpoint(mirror) is None
    assert not list((mirror / CKPT).glob("*.partial-*")), "failed copies left partial dirs"
    # Drive is back: re-running resumes from the local newest and copies it to Drive.
    monkeypatch.undo()
    r, out, err = resume(char_data, run, capsys, mirror_dir=mirror)
    assert r.resumed_from == 20 and r.stopped_by == "finished" and r.not_on_drive is None, (
        out,
        err,
    )
    assert verify_checkpoint(ckpt_dir(mirror, 20)).step == 20


# `python -m gptlib` with a Drive whose every copy fails at once (retried twice, 50 ms apart)
BROKEN_DRIVE = """
import errno, os, sys
from gptlib.__main__ import main
from gptlib.checkpoint import mirror
def broken(*a, **k):
    raise OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN))
mirror.copy_file_verified, mirror.MIRROR_RETRY_DELAYS_S = broken, (0.05, 0.05)
sys.exit(main(sys.argv[1:]))
"""


def test_a_cli_run_whose_checkpoint_missed_drive_exits_nonzero(char_data, tmp_path):
    """--mirror-dir given and the final checkpoint not copied there: exit status 1, the last line saying why, also
    when the run was finished already; once Drive works, the same command copies it and exits 0."""
    run, mirror = tmp_path / "local" / "run", tmp_path / "drive" / "run"
    args = [
        "train",
        "--data",
        str(char_data),
        "--run-dir",
        str(run),
        "--mirror-dir",
        str(mirror),
        "--max-steps",
        str(MAX_STEPS),
        "--device",
        "cpu",
        "--quiet",
    ]
    for s in SETTINGS:
        args += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(faulty.FAULTY.parents[1])}
    p = subprocess.run(
        [sys.executable, "-c", BROKEN_DRIVE, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr, (p.returncode, p.stderr)
    last = p.stdout.splitlines()[-1]
    why = "; !! step 20 is NOT on Drive, only on this disk: its copy failed (see above)"
    assert last.startswith("done: step 20,") and last.endswith(f"{why}; re-run once Drive works"), (
        last
    )
    assert "DRIVE COPY FAILED" in p.stderr and newest_checkpoint(mirror) is None
    # finished: only its copy to Drive to make, and that fails again
    p = subprocess.run(
        [sys.executable, "-c", BROKEN_DRIVE, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1 and p.stdout.startswith("already finished at step 20")
    assert p.stdout.endswith(f"{why}; re-run once Drive works\n"), p.stdout
    assert "the newest checkpoint (step 20) is NOT on Drive" in p.stderr, p.stderr
    p = subprocess.run(
        faulty.gptlib_cmd(None, *args), env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0 and p.stdout.startswith("already finished at step 20"), (
        p.stdout,
        p.stderr,
    )
    assert verify_checkpoint(ckpt_dir(mirror, 20)).step == 20


def test_drive_copy_transient_error_is_retried(
    char_data, tmp_path, capsys, monkeypatch, fast_retries
):
    run, mirror = tmp_path / "local" / "run", tmp_path / "drive" / "run"
    real, calls = gmirror.copy_file_verified, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN))
        return real(*a, **k)

    monkeypatch.setattr(gmirror, "copy_file_verified", flaky)
    r, out, err = resume(char_data, run, capsys, mirror_dir=mirror)
    assert "attempt 1/3" in err and "retrying" in err, err
    assert verify_checkpoint(ckpt_dir(mirror, 20)).step == 20
    assert "NOT on Drive" not in err


def test_drive_copy_hang_is_abandoned(char_data, tmp_path, capsys, monkeypatch, fast_retries):
    run, mirror = tmp_path / "local" / "run", tmp_path / "drive" / "run"
    released = threading.Event()

    def hang(*a, **k):
        released.wait(5)  # a FUSE call that does not come back (released at the end of the test)
        raise OSError(errno.EIO, "released")

    monkeypatch.setattr(gmirror, "copy_file_verified", hang)
    try:
        r, out, err = resume(char_data, run, capsys, mirror_dir=mirror)
    finally:
        released.set()
    assert r.step == MAX_STEPS
    assert "made no progress" in err and "hung" in err, err
    assert verify_checkpoint(ckpt_dir(run, 20)).step == 20
