"""The damage an adversarial run found (issue 15), each reproduced and shown fixed.

Real processes where the issue was found with them (SIGKILL, SIGINT); in-process with fakes only for
what cannot be had here (a hung Google Drive: a FIFO, whose open() blocks in the kernel as a dead
FUSE mount does).
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from gptlib.checkpoint import format as ck
from gptlib.checkpoint import mirror as gmirror
from gptlib.checkpoint.format import (
    CheckpointError,
    TrainState,
    list_checkpoints,
    load_checkpoint,
    verify_checkpoint,
)
from gptlib.fsutil import sha256_file
from gptlib.layout import step_of
from gptlib.training import loop as gtrain
from gptlib.training import resume as gresume
from gptlib.training import run as gsession
from gptlib.training.logs import read_jsonl
from gptlib.training.loop import train
from gptlib.training.resume import StartOptions
from tests import faulty
from tests.conftest import REPO, TINY
from tests.test_resume import curve, one_thread  # noqa: F401 (fixture)


def quiet(_msg):
    pass


def ckpt(run, step):
    return run / "checkpoints" / f"step_{step:07d}"


def cli(data, run_dir, settings, steps, fault=None, extra=()):
    cmd = faulty.train_cmd(fault, data, run_dir, steps, *extra, settings=settings)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


# --- the logs ------------------------------------------------------------------------------------------

LOG4 = TINY + ["log_interval=4", "save_every_steps=5", "dropout=0.1"]


def test_metrics_hold_each_step_once_after_a_kill(char_data, tmp_path):
    """The save step (15) is not a multiple of log_interval (4): rows 13-15 are written before the checkpoint
    (it falls on a log boundary). SIGKILL at 18, resume: each step once, as alone."""
    alone = tmp_path / "alone"
    train(char_data, alone, "phase1", LOG4, max_steps=20, device="cpu", progress=False, log=quiet)
    run = tmp_path / "run"
    p = cli(char_data, run, LOG4, 20, fault="kill:mid_step@18")
    assert p.returncode == -signal.SIGKILL, p.stderr
    train(char_data, run, "phase1", LOG4, max_steps=20, device="cpu", progress=False, log=quiet)
    assert curve(run) == curve(alone)  # curve() also asserts that no step is logged twice


def test_a_second_stop_during_validation_keeps_the_steps_loss(char_data, tmp_path, monkeypatch):
    settings = TINY + ["dropout=0.1"]
    alone = tmp_path / "alone"
    train(
        char_data, alone, "phase1", settings, max_steps=30, device="cpu", progress=False, log=quiet
    )
    real = gtrain.validation_loss

    def interrupted_at_20(model, sampler, n, autocast):
        if gtrain_state["step"] == 20:
            raise KeyboardInterrupt  # a second press of stop, while the step-20 validation runs
        return real(model, sampler, n, autocast)

    gtrain_state = {}
    monkeypatch.setattr(gtrain, "validation_loss", interrupted_at_20)
    monkeypatch.setattr(gtrain, "log_samples", lambda *a, **k: gtrain_state.update(step=a[6]) or [])
    real_validate = gtrain._validate

    def validate(s, *rest):
        gtrain_state["step"] = s.state.step
        return real_validate(s, *rest)

    monkeypatch.setattr(gtrain, "_validate", validate)
    run = tmp_path / "run"
    r = train(
        char_data, run, "phase1", settings, max_steps=30, device="cpu", progress=False, log=quiet
    )
    assert r.stopped_by == "interrupt" and r.step == 20
    # not passed off as 20's
    assert r.val_step == 10 and "val loss" in r.summary() and "(at step 10)" in r.summary()
    monkeypatch.undo()
    train(char_data, run, "phase1", settings, max_steps=30, device="cpu", progress=False, log=quiet)
    a, b = curve(alone), curve(run)
    assert sorted(b) == list(range(1, 31))
    # every train loss, step 20's included, logged once and equal
    assert all(a[s][0] == b[s][0] for s in a)


def test_a_second_stop_inside_the_update_neither_repeats_nor_skips_a_batch(
    char_data, tmp_path, monkeypatch
):
    """Two SIGINTs during step 13: the step completes, then the loop stops and saves step 13; the resumed run
    matches a lone one exactly (a save of the pre-step sampler with post-step weights would repeat batch 13)."""
    settings = TINY + ["dropout=0.1", "eval_interval=100"]
    alone = tmp_path / "alone"
    train(
        char_data, alone, "phase1", settings, max_steps=20, device="cpu", progress=False, log=quiet
    )
    real = gtrain.train_step
    calls = {"n": 0}

    def two_stops_during_the_step(*a, **k):
        calls["n"] += 1
        if calls["n"] == 13:
            os.kill(os.getpid(), signal.SIGINT)  # the first press asks to stop after this step ...
            time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGINT)  # ... the second arrives in the middle of the step
            time.sleep(0.01)
        return real(*a, **k)

    monkeypatch.setattr(gtrain, "train_step", two_stops_during_the_step)
    run = tmp_path / "run"
    r = train(
        char_data, run, "phase1", settings, max_steps=20, device="cpu", progress=False, log=quiet
    )
    assert r.stopped_by == "interrupt" and r.step == 13
    monkeypatch.undo()
    train(char_data, run, "phase1", settings, max_steps=20, device="cpu", progress=False, log=quiet)
    assert curve(run) == curve(alone)
    wa, wb = (ck.load_model_weights(list_checkpoints(d)[0]) for d in (alone, run))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# `python -m gptlib` with each checkpoint's manifest written 2 s late: a save in flight that a test can see
# (its checkpoints/step_N.partial-* directory) and signal during.
SLOW_SAVE = """
import sys, time
from gptlib.__main__ import main
from gptlib.checkpoint import format as fmt
real = fmt.atomic_write_json
def late(path, obj):
    if path.name == "manifest.json":
        time.sleep(2)
    real(path, obj)
fmt.atomic_write_json = late
sys.exit(main(sys.argv[1:]))
"""


def stop_twice_during_the_last_save(script: str, char_data, run, *args: str, timeout: float = 120):
    """`script train` on a tiny run (the stop's save its only one), Ctrl-C once training runs, again while that save is
    in flight -> (the process, stdout, stderr, seconds from the second press to its end)."""
    cmd = [
        sys.executable,
        "-c",
        script,
        "train",
        "--data",
        str(char_data),
        "--run-dir",
        str(run),
        *args,
    ]
    cmd += ["--max-steps", "100000", "--device", "cpu", "--quiet"]
    for setting in TINY + ["eval_interval=100000", "save_every_steps=100000"]:
        cmd += ["--set", setting]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.time() + 120
        while len(read_jsonl(run / "metrics.jsonl")) < 3:
            assert time.time() < deadline and child.poll() is None, "training did not start"
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        while not any(".partial-" in p.name for p in (run / "checkpoints").glob("*")):
            assert time.time() < deadline and child.poll() is None, "no save seen"
            time.sleep(0.01)
        child.send_signal(signal.SIGINT)  # the save is in flight (its manifest 2 s away)
        pressed = time.time()
        out, err = child.communicate(timeout=timeout)
    finally:
        child.kill()
    return child, out, err, time.time() - pressed


def test_a_second_ctrl_c_during_the_last_save_waits_for_it_and_exits_130(char_data, tmp_path):
    """Ctrl-C, then Ctrl-C again while the stop's checkpoint is being written: the process died in the wait for the
    save (a KeyboardInterrupt traceback, exit -2, or torch's abort, -6, as its thread was killed mid-write). Now the
    save finishes, `done` is printed, and the exit status is 130 (the shell's for Ctrl-C), as after one press."""
    run = tmp_path / "run"
    child, out, err, _ = stop_twice_during_the_last_save(SLOW_SAVE, char_data, run)
    assert child.returncode == 130 and "Traceback" not in err, (child.returncode, err)
    assert "done: step" in out and "(interrupt)" in out, out
    [ck] = list_checkpoints(run)
    assert f"stopped (interrupt) at step {verify_checkpoint(ck).step}" in out, out
    assert [p.name for p in (run / "checkpoints").iterdir()] == [ck.name]  # no partial left
    # the presses said on stdout, as the rest of the run; how to go on once, in the last line
    assert (
        "interrupted: finishing this step" in out
        and "interrupted again: stopping when" in out
        and "interrupted" not in err
    ), err
    assert out.count("to continue") == 1
    assert out.endswith(f"(interrupt) -> {run}; re-run the same command to continue\n"), out


SLOW_SAVE_AND_DRIVE = SLOW_SAVE.replace(
    "fmt.atomic_write_json = late\n",
    """fmt.atomic_write_json = late
import gptlib.checkpoint.mirror as mirror
real_copy = mirror.mirror_checkpoint
def slow_copy(*a, **k):
    time.sleep(60)
    return real_copy(*a, **k)
mirror.mirror_checkpoint = slow_copy
""",
)


def test_a_second_stop_press_during_the_last_save_does_not_wait_for_drive(char_data, tmp_path):
    """The second press said "stopping when the save in progress ends", then the wait for Drive (up to 600 s) went on
    after the save. Now the save ends, the wait for Drive is skipped and says so, and training returns."""
    run, drive = tmp_path / "run", tmp_path / "drive"
    # the Drive copy takes 60 s: not waited for
    child, out, err, took = stop_twice_during_the_last_save(
        SLOW_SAVE_AND_DRIVE, char_data, run, "--mirror-dir", str(drive), timeout=40
    )
    assert child.returncode == 130 and "Traceback" not in err, (child.returncode, err)
    assert took < 30, took
    # the press may land inside the last save's wait or just before it (the bar and logs closing, on a busy CPU): the
    # wait for Drive is skipped either way, and the checkpoint is whole
    assert "stopped waiting for Drive at the second stop press" in out + err, out + err
    [ck] = list_checkpoints(run)
    verify_checkpoint(ck)


def test_rerunning_a_finished_run_says_so(char_data, tmp_path, capsys):
    from gptlib.__main__ import main

    run = tmp_path / "run"
    train(char_data, run, "phase1", TINY, max_steps=10, progress=False, log=quiet)
    args = ["train", "--data", str(char_data), "--run-dir", str(run), "--max-steps", "10"]
    for s in TINY:
        args += ["--set", s]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert (
        "already finished at step 10 (val " in out
        and "nothing to do (raise --max-steps to train further)" in out
        and "0 tokens/s" not in out
    )
    # that alone: no set-up lines before it
    assert len(out.splitlines()) == 1 and err == "", (
        out,
        err,
    )


# --- checkpoints -------------------------------------------------------------------------------------------


def test_rotation_never_deletes_the_newest_checkpoint_that_loads(char_data, tmp_path, capsys):
    """The newest checkpoint is damaged in place (same size): resume skips it and sets it aside, whole
    (step_0000020.damaged-TIME), so rotation never counts it among the kept ones (it would delete the good older
    one), and the new step 20 the run writes later is never taken for it (issue 26)."""
    run = tmp_path / "run"
    settings = TINY + ["save_every_steps=5", "keep_last=2"]
    train(char_data, run, "phase1", settings, max_steps=20, progress=False, log=quiet)
    f = ckpt(run, 20) / "model.pt"
    data = bytearray(f.read_bytes())
    data[-64:] = bytes(64)  # same size, other bytes: the cheap size check still passes
    f.write_bytes(bytes(data))
    verify_checkpoint(ckpt(run, 20))
    logs = []
    train(
        char_data,
        run,
        "phase1",
        settings + ["save_every_steps=1"],
        max_steps=17,
        progress=False,
        log=logs.append,
    )
    assert any("skipping checkpoint" in m and "step_0000020" in m for m in logs)
    assert [p.name for p in list_checkpoints(run)] == ["step_0000017", "step_0000016"]
    [aside] = (run / "checkpoints").glob("step_0000020.damaged-*")
    # kept as it was, for the user to look at
    assert (aside / "model.pt").read_bytes() == bytes(data)
    for p in list_checkpoints(run):
        verify_checkpoint(p)  # the good ones are kept whole
        load_checkpoint(p)
    train(
        char_data,
        run,
        "phase1",
        settings + ["save_every_steps=1"],
        max_steps=22,
        progress=False,
        log=logs.append,
    )
    for p in list_checkpoints(run):
        verify_checkpoint(p)  # every kept checkpoint is whole
        load_checkpoint(p)
    assert [p.name for p in list_checkpoints(run)] == ["step_0000022", "step_0000021"]
    assert aside.is_dir()


def test_a_full_disk_during_torch_save_says_so(char_data, tmp_path, monkeypatch, capsys):
    """torch reports a full disk as "enforce fail at inline_container.cc ... unexpected pos": one line says the disk
    is full, where, and what to do, in none of torch's words, from train() and the command line alike."""
    from gptlib.__main__ import main

    real = ck.write_hashed
    calls = {"n": 0}

    def save(path, write):
        calls["n"] += path.name == "model.pt"
        if calls["n"] == 2 and path.name == "model.pt":  # the second checkpoint's
            raise RuntimeError(
                "[enforce fail at inline_container.cc:626] . unexpected pos 5248 vs 5142"
            )
        return real(path, write)

    monkeypatch.setattr(ck, "write_hashed", save)
    monkeypatch.setattr(ck, "_disk_nearly_full", lambda path: True)
    run = tmp_path / "run"
    said = (
        f"saving a checkpoint in {run} failed: the disk is full (no space left on its device); free space there "
        f"(old runs or checkpoints), then re-run; the newest intact checkpoint is step 5"
    )
    with pytest.raises(CheckpointError) as e:
        train(
            char_data,
            run,
            "phase1",
            TINY + ["save_every_steps=5"],
            max_steps=20,
            progress=False,
            log=quiet,
        )
    assert str(e.value) == said
    shutil.rmtree(run)
    calls["n"] = 0
    args = [
        "train",
        "--data",
        str(char_data),
        "--run-dir",
        str(run),
        "--max-steps",
        "20",
        "--quiet",
    ]
    for s in TINY + ["save_every_steps=5"]:
        args += ["--set", s]
    capsys.readouterr()
    assert main(args) == 2
    # one line, no "enforce fail at inline_container.cc"
    assert capsys.readouterr().err == f"error: {said}\n"


def _disk_full(path, *rest):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("where", ["lease.json", "config.json", "tokenizer.json"])
def test_a_full_run_dir_at_set_up_is_one_clear_line(
    char_data, tmp_path, monkeypatch, capsys, where
):
    """A 100%-full disk (ENOSPC) at training's first writes: one line naming the run dir, the OS's reason and the fix,
    from train() (a notebook) and the command line alike; nothing left holding the run."""
    from gptlib import lease as glease
    from gptlib.__main__ import main
    from gptlib.errors import RunDirError

    module, name = {
        "lease.json": (glease, "atomic_write_json"),
        "config.json": (gsession, "atomic_write_json"),
        "tokenizer.json": (gsession, "atomic_write_bytes"),
    }[where]
    monkeypatch.setattr(module, name, _disk_full)
    run = tmp_path / "run"
    with pytest.raises(RunDirError) as e:
        train(char_data, run, "phase1", TINY, max_steps=2, progress=False, log=quiet)
    assert str(e.value).startswith(
        f"cannot write to {run}: No space left on device; free space there"
    ), e.value
    assert not (
        run / "lease.json"
    ).exists()  # released: a re-run after freeing space is not refused
    capsys.readouterr()
    rc = main(
        ["train", "--data", str(char_data), "--run-dir", str(run), "--max-steps", "2", "--quiet"]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(
        f"error: cannot write to {run}: No space left on device; free space"
    ), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize(
    "keep_last,fix", [(2, ""), (3, " or lower keep_last \\(now 3: --set keep_last=N\\)")]
)
def test_a_full_disk_during_a_save_is_one_clear_line(
    char_data, tmp_path, monkeypatch, keep_last, fix
):
    """ENOSPC from the write itself (not torch's 'unexpected pos'): the message says disk full and the fix (a lower
    keep_last only where it can go lower than its minimum, 2), names the newest intact checkpoint, and the partial
    checkpoint is gone (its space given back)."""
    real = ck.write_hashed
    calls = {"n": 0}

    def save(path, write):
        calls["n"] += path.name == "model.pt"
        if calls["n"] == 2 and path.name == "model.pt":  # the second checkpoint's model.pt
            _disk_full(path)
        return real(path, write)

    monkeypatch.setattr(ck, "write_hashed", save)
    run = tmp_path / "run"
    with pytest.raises(
        CheckpointError,
        match=r"^saving a checkpoint in .*run failed: the disk is full \(no space "
        r"left on its device\); free space there \(old runs or checkpoints\)"
        rf"{fix}, then re-run; the newest intact checkpoint is step 5$",
    ):
        train(
            char_data,
            run,
            "phase1",
            TINY + ["save_every_steps=5", f"keep_last={keep_last}"],
            max_steps=20,
            progress=False,
            log=quiet,
        )
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_0000005"]


def test_a_state_json_without_config_is_skipped_with_its_reason(char_data, tmp_path, capsys):
    run = tmp_path / "run"
    train(
        char_data,
        run,
        "phase1",
        TINY + ["save_every_steps=5"],
        max_steps=10,
        progress=False,
        log=quiet,
    )
    p = ckpt(run, 10)
    state = json.loads((p / "state.json").read_text())
    del state["config"]
    (p / "state.json").write_text(json.dumps(state))
    m = json.loads((p / "manifest.json").read_text())
    m["files"]["state.json"] = {
        "size": (p / "state.json").stat().st_size,
        "sha256": sha256_file(p / "state.json"),
    }
    (p / "manifest.json").write_text(json.dumps(m))
    from gptlib.inference.loading import load_run

    with pytest.raises(CheckpointError, match="field 'config' is missing"):
        load_run(run, 10)
    logs = []
    r = train(
        char_data,
        run,
        "phase1",
        TINY + ["save_every_steps=5"],
        max_steps=12,
        progress=False,
        log=logs.append,
    )
    assert r.resumed_from == 5 and any("field 'config' is missing" in m for m in logs), logs


def test_sample_says_why_it_passed_over_the_newest(char_data, tmp_path, capsys):
    from gptlib.__main__ import main

    run = tmp_path / "run"
    train(
        char_data,
        run,
        "phase1",
        TINY + ["save_every_steps=5"],
        max_steps=10,
        progress=False,
        log=quiet,
    )
    os.truncate(ckpt(run, 10) / "model.pt", 100)
    assert main(["sample", "--run-dir", str(run), "--max-new-tokens", "5"]) == 0
    err = capsys.readouterr().err
    assert (
        "passed over" in err and "step_0000010" in err and "truncated" in err and "(step 5)" in err
    ), err


def test_a_malicious_pickle_is_named_as_such_when_sampling(char_data, tmp_path):
    import pickle

    from gptlib.inference.loading import load_run

    run = tmp_path / "run"
    train(char_data, run, "phase1", TINY, max_steps=10, progress=False, log=quiet)
    p = ckpt(run, 10)
    (p / "model.pt").write_bytes(pickle.dumps({"w": _Evil()}))
    m = json.loads((p / "manifest.json").read_text())
    m["files"]["model.pt"] = {
        "size": (p / "model.pt").stat().st_size,
        "sha256": sha256_file(p / "model.pt"),
    }
    (p / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="cannot load safely"):
        load_run(run)


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


# --- data ---------------------------------------------------------------------------------------------------


def test_a_damaged_shard_of_the_right_size_is_named(char_data, tmp_path):
    from gptlib.data.shards import DataFormatError

    data = tmp_path / "data"
    shutil.copytree(char_data, data)
    shard = data / "train_000000.bin"
    b = bytearray(shard.read_bytes())
    b[1000:1002] = (65000).to_bytes(2, "little")  # an id far outside the 65-character vocabulary
    shard.write_bytes(bytes(b))
    with pytest.raises(
        DataFormatError, match=r"train_000000.bin: token id 65000 at position 500 is outside"
    ):
        train(data, tmp_path / "run", "phase1", TINY, max_steps=2, progress=False, log=quiet)


# --- a hung Drive ---------------------------------------------------------------------------------------------


def test_resume_skips_a_drive_checkpoint_that_hangs_mid_read(
    char_data, tmp_path, monkeypatch, capsys
):
    """The mirror's newest checkpoint blocks on read (a FIFO: open() waits in the kernel, as on a dead FUSE
    mount): resume gives up on it within the limit. Since issue 18 it does not go on from the older local
    checkpoint unasked (tests/test_drive_resume.py); with --skip-unreadable it does, and keeps the hung one."""
    run, mirror = tmp_path / "local", tmp_path / "drive"
    settings = TINY + ["save_every_steps=5"]
    train(
        char_data,
        run,
        "phase1",
        settings,
        max_steps=20,
        progress=False,
        log=quiet,
        mirror_dir=mirror,
    )
    hung = ckpt(mirror, 30)
    shutil.copytree(ckpt(mirror, 20), hung)
    (hung / "model.pt").unlink()
    os.mkfifo(hung / "model.pt")
    monkeypatch.setattr(gresume, "DRIVE_READ_STALL_S", 1.0)
    t0 = time.time()
    logs = []
    try:
        r = train(
            char_data,
            run,
            "phase1",
            settings,
            max_steps=24,
            progress=False,
            log=logs.append,
            mirror_dir=mirror,
            options=StartOptions(skip_unreadable=True),
        )
    finally:
        threading.Thread(target=_release_fifo, args=(hung / "model.pt",), daemon=True).start()
    assert r.resumed_from == 20 and r.step == 24
    assert any("skipping checkpoint" in m and "made no progress" in m for m in logs), logs
    assert time.time() - t0 < 60
    assert hung.is_dir()  # not this run's to delete


def _release_fifo(path):
    """Open the FIFO for writing, so the abandoned reader blocked on it wakes up (if it is still there)."""
    try:
        open(path, "wb").close()
    except OSError:
        pass  # rotation already deleted the damaged checkpoint


class HungMount:
    """Reads under `root` block in the kernel until the mount comes back (release()), as on a Google Drive
    mount that stopped answering. A FIFO cannot stand in here: loading checks that every file is a regular
    file (is_file) before it reads one, so a FIFO is passed over as missing before any read blocks.
    stat=True: stat and listing block too (the whole mount is gone); else only opening a file whose name
    is in `names` (the mount still answers metadata from its cache)."""

    def __init__(self, monkeypatch, root, names=None, stat=False):
        self.root, self.names, self.back = os.fspath(root), names, threading.Event()
        real_open, real_stat, real_listdir = io.open, os.stat, os.listdir

        def blocks(path, is_open):
            if isinstance(path, int) or not os.fspath(path).startswith(self.root):
                return False
            return stat or (
                is_open and (self.names is None or os.path.basename(os.fspath(path)) in self.names)
            )

        def hung_open(file, *a, **k):
            if blocks(file, True):
                self.back.wait()
            return real_open(file, *a, **k)

        def hung_stat(path, *a, **k):
            if blocks(path, False):
                self.back.wait()
            return real_stat(path, *a, **k)

        def hung_listdir(path="."):
            if blocks(path, False):
                self.back.wait()
            return real_listdir(path)

        for module, name, fn in (
            (io, "open", hung_open),
            (builtins, "open", hung_open),
            (os, "stat", hung_stat),
            (os, "listdir", hung_listdir),
        ):
            monkeypatch.setattr(module, name, fn)

    def release(self):
        self.back.set()


def within(seconds, fn):
    """fn() in a daemon thread: (its value, its exception); a test failure if it still runs after `seconds`."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still blocked after {seconds} s: a read without a time limit"
    return box.get("value"), box.get("error")


@pytest.fixture()
def short_drive_limits(monkeypatch):
    from gptlib.inference import loading as gloading

    for module, name in (
        (gloading, "DRIVE_LIST_TIMEOUT_S"),
        (gloading, "DRIVE_READ_STALL_S"),
        (ck, "DRIVE_READ_STALL_S"),
    ):
        monkeypatch.setattr(module, name, 0.5)


@pytest.mark.parametrize("hang", ["whole mount", "tokenizer.json"])
def test_loading_from_a_hung_drive_is_one_clear_error_within_the_limit(
    char_data, tmp_path, monkeypatch, capsys, short_drive_limits, hang
):
    """sample / export / eval / notebook 04 read a run on Drive (load_run): a hung read there is
    abandoned after the limit with one line naming it, not waited on forever."""
    from gptlib.__main__ import main
    from gptlib.errors import HungIOError
    from gptlib.evaluation.evaluate import evaluate_run
    from gptlib.inference.loading import load_run

    run = tmp_path / "drive" / "run"
    train(char_data, run, "phase1", TINY, max_steps=5, progress=False, log=quiet)
    mount = HungMount(
        monkeypatch,
        tmp_path / "drive",
        **({"stat": True} if hang == "whole mount" else {"names": {"tokenizer.json"}}),
    )
    try:
        t0 = time.time()
        _, error = within(20, lambda: load_run(run))
        assert isinstance(error, HungIOError) and "made no progress for 0.5 s" in str(error), error
        assert str(run) in str(error) and time.time() - t0 < 10
        if hang == "tokenizer.json":
            assert "state.json and the run's tokenizer.json" in str(error)
        # eval reads it first
        _, error = within(20, lambda: evaluate_run(run, "bpb", progress=False))
        assert isinstance(error, HungIOError), error
        rc, _ = within(20, lambda: main(["sample", "--run-dir", str(run), "--max-new-tokens", "5"]))
    finally:
        mount.release()
    err = capsys.readouterr().err
    assert (
        rc == 2
        and err.startswith("error: ")
        and "made no progress" in err
        and "Traceback" not in err
    ), err
    assert len(err.strip().splitlines()) == 1, err


def test_pick_run_dir_uses_the_local_copy_when_drive_hangs(
    char_data, tmp_path, monkeypatch, short_drive_limits
):
    """Notebook 04: the Drive copy is newer, but its mount hangs: pick_run_dir passes it over within the
    limit (said so), and the local copy loads."""
    from gptlib.inference.engine import Engine
    from gptlib.inference.loading import pick_run_dir

    local, drive = tmp_path / "local", tmp_path / "drive" / "run"
    train(
        char_data,
        local,
        "phase1",
        TINY + ["save_every_steps=5"],
        max_steps=10,
        progress=False,
        log=quiet,
        mirror_dir=drive,
    )
    shutil.rmtree(ckpt(local, 10))  # the local disk holds step 5, Drive step 10
    logs = []
    mount = HungMount(monkeypatch, tmp_path / "drive", stat=True)
    try:
        picked, error = within(20, lambda: pick_run_dir([local, drive], log=logs.append))
        assert error is None and picked == local, error
        engine, error = within(20, lambda: Engine.from_run(picked))
    finally:
        mount.release()
    assert error is None and engine.step == 5, error
    assert any(
        str(drive) in m and "cannot be read" in m and "made no progress" in m for m in logs
    ), logs


def test_the_end_of_run_drive_wait_reports_and_training_time_excludes_it(
    char_data, tmp_path, monkeypatch, capsys
):
    release = threading.Event()
    real = gmirror.copy_file_verified

    def slow_drive(src, dst, size=None, sha256=None, progress=None):
        if src.name == "model.pt" and "step_0000010" in str(src):
            release.wait(3)  # Drive crawls on the last checkpoint
        return real(src, dst, size, sha256, progress)

    monkeypatch.setattr(gmirror, "copy_file_verified", slow_drive)
    monkeypatch.setattr(gmirror, "MIRROR_WAIT_REPORT_S", 0.3)
    t0 = time.time()
    r = train(
        char_data,
        tmp_path / "run",
        "phase1",
        TINY,
        max_steps=10,
        progress=False,
        log=quiet,
        mirror_dir=tmp_path / "drive",
    )
    wall = time.time() - t0
    err = capsys.readouterr().err
    assert "waiting for the Drive copy: step_0000010" in err and "Ctrl-C stops waiting" in err, err
    assert r.elapsed_s < wall - 2  # the wait is not training time ...
    assert r.tokens_per_s == pytest.approx(r.tokens_seen / r.elapsed_s)  # ... nor in tokens/s
    assert verify_checkpoint(ckpt(tmp_path / "drive", 10)).step == 10


def test_ctrl_c_stops_the_drive_wait(tmp_path, monkeypatch, capsys):
    from gptlib.checkpoint.writer import CheckpointWriter

    block = threading.Event()
    monkeypatch.setattr(gmirror, "copy_file_verified", lambda *a, **k: block.wait(30))
    # Ctrl-C as a notebook's kernel gets it: Python's own handler (a test run earlier in this process, e.g. under
    # pytest-xdist, may have left another one installed)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    w = CheckpointWriter(tmp_path / "local", mirror_dir=tmp_path / "drive")
    w.save({"model": {"w": torch.ones(2)}, "progress": TrainState(step=1).state_dict()})
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    t0 = time.time()
    try:
        w.close(timeout=20)
    finally:
        block.set()
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert time.time() - t0 < 10 and "stopped waiting for Drive" in err and "safe in" in err, err


def test_an_old_file_that_hangs_on_the_mirror_does_not_hold_the_copy(tmp_path, monkeypatch, capsys):
    """Rotation on the mirror reads an old checkpoint's state.json that hangs: the new checkpoint still
    counts as on Drive, and closing does not wait the full timeout."""
    from gptlib.checkpoint.writer import CheckpointWriter

    monkeypatch.setattr(gmirror, "MIRROR_TIDY_TIMEOUT_S", 0.5)
    release = threading.Event()
    monkeypatch.setattr(gmirror, "rotate", lambda *a, **k: release.wait(30))
    w = CheckpointWriter(tmp_path / "local", mirror_dir=tmp_path / "drive")
    w.save({"model": {"w": torch.ones(2)}, "progress": TrainState(step=1).state_dict()})
    t0 = time.time()
    st = w.close(timeout=20)
    release.set()
    err = capsys.readouterr().err
    assert st["mirror_step"] == 1 and time.time() - t0 < 10, (st, err)
    assert "clean-up after copying step_0000001 failed" in err and "NOT on Drive" not in err


# --- tokenize and meta.json ---------------------------------------------------------------------------------


def test_tokenize_refuses_a_run_dir_or_a_folder_holding_something_else(
    char_data, small_text, tmp_path, capsys
):
    from gptlib.__main__ import main

    run = tmp_path / "run"
    train(char_data, run, "phase1", TINY, max_steps=2, progress=False, log=quiet)
    before = {p: sha256_file(p) for p in run.rglob("*") if p.is_file()}
    for overwrite in ([], ["--overwrite"]):
        assert (
            main(["tokenize", "--input", str(small_text), "--out", str(run), "--quiet", *overwrite])
            == 2
        )
        assert "is a training run directory" in capsys.readouterr().err
    assert {
        p: sha256_file(p) for p in run.rglob("*") if p.is_file()
    } == before  # tokenizer.json untouched
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert (
        main(["tokenize", "--input", str(small_text), "--out", str(mine), "--quiet", "--overwrite"])
        == 2
    )
    assert "holds files tokenize did not write (notes.txt)" in capsys.readouterr().err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize(
    "field,value", [("vocab_size", "65k"), ("vocab_size", 64.5), ("train_tokens", "lots")]
)
def test_a_meta_json_field_of_the_wrong_kind_is_one_clear_error(char_data, tmp_path, field, value):
    from gptlib.data.shards import DataFormatError, read_meta

    data = tmp_path / "data"
    shutil.copytree(char_data, data)
    meta = json.loads((data / "meta.json").read_text())
    if field == "train_tokens":
        meta["splits"]["train"]["tokens"] = value
        expect = "train.tokens is 'lots', expected a whole number"
    else:
        meta[field] = value
        expect = f"vocab_size is {value!r}, expected a whole number"
    (data / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataFormatError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        read_meta(data)


def test_a_vocabulary_smaller_than_the_tokenizers_is_named(char_data, tmp_path):
    from gptlib.data.shards import DataFormatError

    data = tmp_path / "data"
    shutil.copytree(char_data, data)
    meta = json.loads((data / "meta.json").read_text())
    meta["vocab_size"] = meta["tokenizer"]["vocab_size"] = (
        40  # edited by hand; the tokenizer has 61 characters
    )
    (data / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataFormatError, match="vocab_size is 40 but the tokenizer has 61 tokens"):
        train(data, tmp_path / "run", "phase1", TINY, max_steps=2, progress=False, log=quiet)


def test_damaged_checkpoints_do_not_pile_up_on_drive(char_data, tmp_path):
    """Three disconnects, each finding the mirror's newest checkpoint damaged (a byte flipped): each resume sets it
    aside and goes on from the one before. Was: every set-aside copy kept for good (6 damaged of 8 directories on a
    mirror; 1.3 GB each for gpt2-small on a 15 GB Drive). Now the newest damaged one stays, the older are removed,
    each said with its size. Real processes, a fresh local directory each time, as on a new Colab VM."""
    mirror, settings = tmp_path / "drive", TINY + ["keep_last=2"]
    p = cli(char_data, tmp_path / "vm0", settings, 20, extra=("--mirror-dir", mirror))
    assert p.returncode == 0, p.stderr
    for vm, steps in enumerate((30, 40, 50), start=1):
        newest = list_checkpoints(mirror)[0]
        data = bytearray((newest / "model.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (newest / "model.pt").write_bytes(bytes(data))
        p = cli(char_data, tmp_path / f"vm{vm}", settings, steps, extra=("--mirror-dir", mirror))
        assert p.returncode == 0 and f"resumed from step {steps - 20}" in p.stdout, (
            p.stdout + p.stderr
        )
        aside = sorted((mirror / "checkpoints").glob("*.damaged-*"))
        # the newest damaged one only
        assert [a.name.split(".")[0] for a in aside] == [newest.name], aside
        if vm > 1:
            assert re.search(
                r"removed step_\d+\.damaged-[\d-]+ \([\d.,]+ MB\), an older damaged checkpoint: only the "
                rf"newest, {newest.name}\.damaged-[\d-]+, is kept in {mirror / 'checkpoints'}",
                p.stdout,
            ), p.stdout
    assert [step_of(c) for c in list_checkpoints(mirror)] == [50, 40]


# --- damaged checkpoints set aside: kept by the time recorded, all of them when nothing loads (issue 44 item 3) ---


def flip_a_byte(path):
    data = bytearray((path / "model.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "model.pt").write_bytes(bytes(data))


def hand_made_aside(run):
    """A folder someone named like a set-aside one, without its record: sorted by name it outranked every time."""
    d = run / "checkpoints" / "step_0000900.damaged-x"
    d.mkdir()
    (d / "model.pt").write_bytes(b"kept by its owner")
    return d


def test_when_nothing_loads_every_damaged_checkpoint_is_kept_and_named(char_data, tmp_path):
    """Every checkpoint damaged: the start goes on from scratch and keeps all it set aside (and what was set aside
    before), naming them. Was: pruned to one, chosen by the text after .damaged-, so step_0000900.damaged-x stayed
    and both checkpoints set aside by this very start were deleted."""
    run = tmp_path / "run"
    train(char_data, run, "phase1", TINY, max_steps=20, progress=False, log=quiet)
    assert [step_of(p) for p in list_checkpoints(run)] == [20, 10]
    for p in list_checkpoints(run):
        flip_a_byte(p)
    hand_made = hand_made_aside(run)
    logs = []
    r = train(char_data, run, "phase1", TINY, max_steps=5, progress=False, log=logs.append)
    assert (
        r.resumed_from is None
        and "no checkpoint could be loaded (2 damaged): starting from scratch" in logs
    )
    aside = sorted(p.name for p in (run / "checkpoints").glob("*.damaged-*"))
    assert len(aside) == 3 and hand_made.name in aside, aside
    assert (
        f"none could be loaded, so every damaged checkpoint set aside is kept in {run / 'checkpoints'}: "
        in ("\n".join(logs))
    ), logs
    [line] = [m for m in logs if m.startswith("none could be loaded")]
    assert all(name in line for name in aside), line
    assert not any(m.startswith("removed ") for m in logs), logs


def test_set_aside_checkpoints_are_pruned_by_the_time_recorded_never_this_starts(
    char_data, tmp_path
):
    """Steps 20 and 30 damaged: resume from 10 sets both aside, and both stay (this start's), while the hand-made
    one, which has no record of when, goes. At the next start the newest by the time recorded stays, even when its
    name says otherwise."""
    run = tmp_path / "run"
    settings = TINY + ["keep_last=3"]
    train(char_data, run, "phase1", settings, max_steps=30, progress=False, log=quiet)
    flip_a_byte(ckpt(run, 20))
    flip_a_byte(ckpt(run, 30))
    hand_made = hand_made_aside(run)
    logs = []
    r = train(char_data, run, "phase1", settings, max_steps=35, progress=False, log=logs.append)
    assert r.resumed_from == 10, logs
    aside = sorted((run / "checkpoints").glob("*.damaged-*"))
    assert [step_of(p) for p in aside] == [20, 30] and not hand_made.exists(), aside
    assert any(m.startswith(f"removed {hand_made.name} ") for m in logs), logs
    # the older of the two renamed to sort last by name: the time recorded decides, not the name
    newest = max(aside, key=lambda p: json.loads((p / "set_aside.json").read_text())["set_aside"])
    older = next(p for p in aside if p != newest)
    renamed = older.rename(older.with_name(older.name.split(".damaged-")[0] + ".damaged-zzz"))
    logs = []
    r = train(char_data, run, "phase1", settings, max_steps=40, progress=False, log=logs.append)
    assert r.resumed_from == 35, logs
    assert [p.name for p in (run / "checkpoints").glob("*.damaged-*")] == [newest.name], logs
    assert any(m.startswith(f"removed {renamed.name} ") for m in logs), logs


def test_a_second_press_before_the_last_saves_wait_gives_up_drive_too():
    """The second press can land after the stop's save began but before its wait (the bar and logs closing): it stops
    at once, and the wait for Drive that the closing run does is skipped as well (a CI run waited out a 60 s copy)."""
    from gptlib.training.loop import GracefulStop

    stop = GracefulStop(log=lambda m: None)
    stop._handle(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)
    assert stop.pressed_again.is_set()


def test_a_second_press_after_the_stops_save_was_handed_over_waits_for_it():
    """Once the stop's checkpoint is with the writer, a second press, wherever it lands before the wait (the bar and
    logs closing), waits for that save and gives up the wait for Drive: the run still ends with its summary (a
    press landing there used to end the process with 130 and no `done:` line)."""
    from gptlib.training.loop import GracefulStop

    said = []
    stop = GracefulStop(log=said.append)
    stop._handle(signal.SIGINT, None)
    stop.saving_last = True  # as _after_step sets it before the stop's save
    stop._handle(signal.SIGINT, None)  # not raised
    assert not stop.pressed_again.is_set() and "interrupted again" in said[-1], said
    with stop.last_save():
        pass  # the wait for the local save
    assert stop.pressed_again.is_set()  # the Drive wait that follows is given up


def test_a_stop_pressed_in_the_last_validation_then_again_while_closing_ends_with_the_summary(
    char_data, tmp_path, monkeypatch
):
    """The first press lands during the last step's validation, the second as the bar closes: the run still ends
    with its summary, its last step saved once (the second press escaped train() as a KeyboardInterrupt: no `done:`
    line, exit 130; a review found it)."""
    from gptlib.training.throughput import RunProgress

    saves, pressed, real_save, real_close = [], [], gtrain._save, RunProgress.close

    def save(run, *a, **k):
        saves.append(run.state.step)
        real_save(run, *a, **k)

    def close(self, *a, **k):
        if pressed and len(pressed) == 1:
            pressed.append(2)
            os.kill(os.getpid(), signal.SIGINT)  # the second press, as the bar closes
        return real_close(self, *a, **k)

    def on_log(row):
        if row.get("step") == 20 and not pressed:
            pressed.append(1)
            os.kill(os.getpid(), signal.SIGINT)  # the first press, during the last validation

    monkeypatch.setattr(gtrain, "_save", save)
    monkeypatch.setattr(RunProgress, "close", close)
    settings = TINY + ["eval_interval=10", "log_interval=1", "save_every_minutes=0"]
    r = train(
        char_data,
        tmp_path / "run",
        "phase1",
        settings,
        max_steps=20,
        device="cpu",
        compile="off",
        progress=False,
        log=lambda s: None,
        on_log=on_log,
    )
    assert pressed == [1, 2] and r.step == 20 and saves == [10, 20], (pressed, saves)
