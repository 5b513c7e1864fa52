"""Unit tests of gptlib.checkpoint.format: atomic writes, verification, discovery, rotation, mirror copy."""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import time
from pathlib import Path

import pytest
import torch

from gptlib.checkpoint import format as ck
from gptlib.checkpoint import mirror
from gptlib.checkpoint.format import (
    CheckpointError,
    TrainState,
    clean_orphans,
    list_checkpoints,
    load_checkpoint,
    load_weights_into,
    rotate,
    save_checkpoint,
    verify_checkpoint,
)
from gptlib.checkpoint.mirror import mirror_checkpoint
from gptlib.checkpoint.writer import CheckpointWriter
from gptlib.errors import UnreadableError
from gptlib.fsutil import HungIOError, call_with_timeout, sha256_file
from gptlib.training import resume as gresume
from gptlib.training.loop import GracefulStop
from gptlib.training.resume import find_resume
from tests import faulty


def ckpt(step: int, model: dict, optimizer: dict | None = None, best: int | None = None) -> dict:
    """What training hands the writer: the parts' state_dicts and the progress."""
    return {
        "model": model,
        "optimizer": optimizer or {},
        "progress": TrainState(step=step, best_step=best).state_dict(),
    }


def sd(v: float = 1.0) -> dict:
    return {"w": torch.full((4, 4), v), "b": torch.arange(3.0)}


def save(run_dir, step, v=1.0, extra=None):
    return save_checkpoint(
        run_dir / "checkpoints", ckpt(step, sd(v), {"opt": {"m": torch.ones(2) * v}}), extra
    )


def test_write_verify_load_roundtrip(tmp_path):
    p = save(tmp_path, 7, 2.0, extra={"metrics.jsonl": b'{"step": 1}\n'})
    assert p.name == "step_0000007"
    info = verify_checkpoint(p)
    assert info.step == 7 and set(info.manifest["files"]) == {
        "model.pt",
        "train_state.pt",
        "state.json",
        "metrics.jsonl",
    }
    c = load_checkpoint(p)
    assert torch.equal(c["model"]["w"], sd(2.0)["w"]) and torch.equal(
        c["optimizer"]["opt"]["m"], torch.ones(2) * 2
    )
    assert c["progress"]["step"] == 7 and c["logs"] == {"metrics.jsonl": b'{"step": 1}\n'}
    assert not [q for q in p.parent.iterdir() if q != p], "no temp or partial leftovers"


def test_same_step_resave_replaces_whole(tmp_path):
    save(tmp_path, 5, 1.0)
    p = save(tmp_path, 5, 3.0)
    assert torch.equal(load_checkpoint(p)["model"]["w"], sd(3.0)["w"])
    assert [q.name for q in p.parent.iterdir()] == ["step_0000005"]


def test_failed_write_removes_partial_and_keeps_previous(tmp_path, monkeypatch):
    save(tmp_path, 5)
    faulty.install("enospc:save_mid@10", monkeypatch.setattr)
    with pytest.raises(OSError) as ei:
        save(tmp_path, 10)
    assert ei.value.errno == errno.ENOSPC
    assert [q.name for q in (tmp_path / "checkpoints").iterdir()] == ["step_0000005"]
    verify_checkpoint(tmp_path / "checkpoints" / "step_0000005")


@pytest.mark.parametrize("damage", ["truncate", "flip", "bad_json", "old_format"])
def test_loading_detects_damage(tmp_path, damage):
    """Damage is bytes read and found wrong."""
    p = save(tmp_path, 3)
    f = p / "model.pt"
    if damage == "truncate":
        os.truncate(f, f.stat().st_size - 1)
    elif damage == "flip":
        b = bytearray(f.read_bytes())
        b[-10] ^= 0xFF
        f.write_bytes(bytes(b))
    elif damage == "bad_json":
        (p / "manifest.json").write_text("{not json")
    elif damage == "old_format":
        (p / "manifest.json").write_text('{"format_version": 0, "step": 3, "files": {}}')
    with pytest.raises(CheckpointError, match=str(p)):
        load_checkpoint(p)
    if damage != "flip":  # the cheap check (rotation, the writer) sees all but a changed byte
        with pytest.raises(CheckpointError, match=str(p)):
            verify_checkpoint(p)


@pytest.mark.parametrize("how", ["no_manifest", "manifest_fifo", "missing_file", "file_fifo"])
def test_what_cannot_be_read_now_is_not_damage(tmp_path, how):
    """A file not there or not a regular file (a Drive that does not answer, or is still syncing) is an OSError,
    UnreadableError: resume waits for it and never sets it aside, rotation keeps it. Was CheckpointError
    ("no manifest.json (the save did not finish)"), and a resume renamed valid checkpoints on Drive."""
    p = save(tmp_path, 3)
    name = "manifest.json" if "manifest" in how else "model.pt"
    (p / name).unlink()
    if how.endswith("fifo"):
        # opening it would block, as a read on a dead FUSE mount does: never opened here
        os.mkfifo(p / name)
    for check in (verify_checkpoint, load_checkpoint):
        with pytest.raises(UnreadableError, match=str(p / name)) as e:
            check(p)
        assert "now (a Drive that does not answer" in str(e.value) and "did not finish" not in str(
            e.value
        )
        assert isinstance(e.value, OSError) and not isinstance(e.value, CheckpointError)


def test_the_resume_search_falls_back_and_spans_dirs(tmp_path):
    """The newest checkpoint that verifies and loads, local or on Drive (copied to the local run dir first); damaged
    ones passed over and named; at equal steps the local one."""
    local, drive = tmp_path / "local", tmp_path / "drive"

    def put(run_dir, step, v):
        save_checkpoint(run_dir / "checkpoints", ckpt(step, sd(v)))

    put(local, 10, 1.0)
    put(drive, 20, 2.0)
    put(drive, 30, 3.0)
    os.truncate(drive / "checkpoints" / "step_0000030" / "model.pt", 5)
    logs = []
    resume, passed = find_resume(local, drive, logs.append)
    assert resume.state.step == 20 and resume.origin == drive / "checkpoints" / "step_0000020"
    assert resume.info.path == local / "checkpoints" / "step_0000020"  # the copy it loaded
    assert torch.equal(resume.checkpoint["model"]["w"], sd(2.0)["w"])
    assert (
        list(passed.damaged) == [drive / "checkpoints" / "step_0000030"]
        and passed.mirror_step == 30
    )
    assert len(logs) == 1 and "step_0000030" in logs[0] and "truncated" in logs[0]
    put(local, 40, 4.0)
    put(drive, 40, 5.0)  # the same step in both: the local one (fast) is taken
    resume, _ = find_resume(local, drive, logs.append)
    assert resume.origin == local / "checkpoints" / "step_0000040" and torch.equal(
        resume.checkpoint["model"]["w"], sd(4.0)["w"]
    )


def test_a_damaged_checkpoint_is_looked_at_again_before_it_is_set_aside(tmp_path, monkeypatch):
    """Set aside (renamed) only if its manifest is still the one read when it was judged damaged: one that changed
    since, or cannot be read now (a FIFO: Drive not answering), is left as it is. Was: renamed without a look."""
    monkeypatch.setattr(gresume, "DRIVE_LIST_TIMEOUT_S", 0.5)
    local, drive = tmp_path / "local", tmp_path / "drive"
    for step in (10, 20, 30):
        save(drive, step, float(step))
        os.truncate(drive / "checkpoints" / f"step_{step:07d}" / "model.pt", 5)  # all three damaged
    logs = []
    resume, passed = find_resume(local, drive, logs.append)
    assert resume is None and len(passed.damaged) == 3
    gone = drive / "checkpoints" / "step_0000020"
    save(drive, 30, 3.5)  # step 30 re-saved since (another look finds another manifest)
    (gone / "manifest.json").unlink()
    os.mkfifo(gone / "manifest.json")  # cannot be read now
    gresume.set_aside_damaged(passed, resume, logs.append)
    names = sorted(
        p.name.split(".damaged-")[0] + (".damaged" if ".damaged-" in p.name else "")
        for p in (drive / "checkpoints").iterdir()
    )
    assert names == ["step_0000010.damaged", "step_0000020", "step_0000030"]
    assert sum("looks different now: left as it is" in m for m in logs) == 2, logs


def test_malicious_pickle_refused(tmp_path):
    """(Resume passing over such a checkpoint to the previous one: test_faults.py.)"""
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    save(tmp_path, 1)
    p = save(tmp_path, 2)
    (p / "model.pt").write_bytes(pickle.dumps(Evil()))
    m = json.loads((p / "manifest.json").read_text())
    m["files"]["model.pt"] = {
        "size": (p / "model.pt").stat().st_size,
        "sha256": sha256_file(p / "model.pt"),
    }
    (p / "manifest.json").write_text(json.dumps(m))
    verify_checkpoint(p)  # consistent manifest: only weights_only loading stops it
    with pytest.raises(CheckpointError, match="cannot load safely"):
        load_checkpoint(p)
    assert not marker.exists()


def test_checked_load():
    m = torch.nn.Linear(3, 2)
    clean = {k: v.clone() for k, v in m.state_dict().items()}
    load_weights_into(m, clean, "x")
    bad = dict(clean, weight=torch.zeros(5, 3))
    with pytest.raises(
        CheckpointError, match=r"weight has shape \(5, 3\) in the checkpoint but \(2, 3\)"
    ):
        load_weights_into(m, bad, "ckpt")
    with pytest.raises(CheckpointError, match="missing"):
        load_weights_into(m, {"weight": clean["weight"]}, "ckpt")


def test_rotate_keeps_last_and_best_and_truncates(tmp_path):
    for s in (1, 2, 3, 4, 5):
        save(tmp_path, s)
    root = tmp_path / "checkpoints"
    # A hard link outside: after a truncating delete it must be empty (Drive's trash keeps no bytes).
    os.link(root / "step_0000001" / "model.pt", tmp_path / "trash_model.pt")
    deleted = rotate(tmp_path, keep_last=1, best_step=2, truncate=True)  # keep_last < 2 means 2
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step_0000005",
        "step_0000004",
        "step_0000002",
    ]
    assert sorted(p.name for p in deleted) == ["step_0000001", "step_0000003"]
    assert (tmp_path / "trash_model.pt").stat().st_size == 0


def test_rotate_keeps_milestones(tmp_path):
    for s in (100, 200, 250, 300, 400, 450):
        save(tmp_path, s)
    deleted = rotate(tmp_path, keep_last=2, best_step=None, keep_every=200)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step_0000450",
        "step_0000400",
        "step_0000200",
    ]
    assert sorted(p.name for p in deleted) == ["step_0000100", "step_0000250", "step_0000300"]
    rotate(tmp_path, keep_last=2, best_step=None)  # keep_every=0: no milestones
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000450", "step_0000400"]


def test_rotate_skips_invalid_and_protected(tmp_path):
    for s in (1, 2, 3, 4):
        save(tmp_path, s)
    root = tmp_path / "checkpoints"
    # damaged: does not count as kept
    (root / "step_0000004" / "manifest.json").write_text("{not json")
    rotate(tmp_path, keep_last=2, best_step=None, protect={root / "step_0000001"})
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step_0000003",
        "step_0000002",
        "step_0000001",
    ]
    save(tmp_path, 5)
    (
        root / "step_0000005" / "manifest.json"
    ).unlink()  # cannot be read now (Drive): kept, not counted
    rotate(tmp_path, keep_last=2, best_step=None)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step_0000005",
        "step_0000003",
        "step_0000002",
    ]


def test_rotate_deletes_nothing_when_nothing_verifies(tmp_path):
    for s in (1, 2, 3):
        p = save(tmp_path, s)
        (p / "manifest.json").unlink()
    assert rotate(tmp_path, 2, None) == [] and len(list_checkpoints(tmp_path)) == 3


def test_clean_orphans(tmp_path):
    save(tmp_path, 1)
    root = tmp_path / "checkpoints"
    for name in ("step_0000002.partial-1-ab", "step_0000001.old-cd", "step_0000000.deleting-ef"):
        (root / name).mkdir()
        (root / name / "model.pt").write_bytes(b"x")
    (root / "step_0000001" / "model.pt.tmp-zz").write_bytes(b"x")
    (tmp_path / "metrics.jsonl.tmp-yy").write_bytes(b"x")
    removed = clean_orphans(tmp_path)
    assert len(removed) == 5
    assert [p.name for p in root.iterdir()] == ["step_0000001"]
    verify_checkpoint(root / "step_0000001")


def test_mirror_copy_verifies_and_refuses_changed_source(tmp_path):
    src = save(tmp_path / "local", 4)
    dst = mirror_checkpoint(src, tmp_path / "drive")
    assert verify_checkpoint(dst).step == 4
    assert mirror_checkpoint(src, tmp_path / "drive") == dst  # already there: no copy
    src2 = save(tmp_path / "local", 6)
    with open(
        src2 / "model.pt", "r+b"
    ) as f:  # the local file changed after its manifest was written
        f.seek(100)
        f.write(b"\x00\x01")
    with pytest.raises(CheckpointError, match="sha256 differs"):  # damaged, not a Drive that failed
        mirror_checkpoint(src2, tmp_path / "drive")
    assert [p.name for p in list_checkpoints(tmp_path / "drive")] == ["step_0000004"]
    assert not list((tmp_path / "drive" / "checkpoints").glob("*.partial-*"))


def test_writer_mirrors_in_background_and_rotates_both(tmp_path):
    w = CheckpointWriter(tmp_path / "local", keep_last=2, mirror_dir=tmp_path / "drive")
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "config.json").write_text("{}")
    for s in (1, 2, 3):
        w.save(ckpt(s, sd(s), {"x": torch.ones(1)}, best=1))
    st = w.close()
    assert st["local_step"] == 3 and st["mirror_step"] == 3 and st["mirror_error"] is None
    for d in ("local", "drive"):
        names = [p.name for p in list_checkpoints(tmp_path / d)]
        assert names[0] == "step_0000003" and "step_0000001" in names  # newest + best kept
    assert (tmp_path / "drive" / "config.json").read_text() == "{}"
    assert w.status_line() == "drive: step 3"


def test_a_save_hashes_each_file_once_and_never_reads_drive_back(tmp_path, monkeypatch):
    """Hash once: each file is hashed as it is written, and by the Drive copy as it reads it (against the manifest);
    nothing is read again to be hashed. The logs reach Drive inside the checkpoint; beside it go the files readers
    and people use there."""
    import builtins
    import hashlib

    made, real = [], hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda *a: made.append(1) or real(*a))
    local, drive = tmp_path / "local", tmp_path / "drive"
    reads, real_open = [], builtins.open
    monkeypatch.setattr(
        builtins,
        "open",
        lambda f, mode="r", *a, **k: (
            (
                reads.append(Path(f).name)
                if "r" in mode and Path(str(f)).parent.parent == local / "checkpoints"
                else None
            )
            or real_open(f, mode, *a, **k)
        ),
    )
    w = CheckpointWriter(local, mirror_dir=drive)
    local.mkdir()
    for name in (
        "config.json",
        "tokenizer.json",
        "metrics.jsonl",
        "samples.jsonl",
        "samples.md",
        "loss.png",
    ):
        (local / name).write_text(f"{name}\n")
    w.save(ckpt(1, sd(), {"x": torch.ones(1)}))
    assert w.close()["mirror_step"] == 1
    files = sorted(
        p.name
        for p in (local / "checkpoints" / "step_0000001").iterdir()
        if p.name != "manifest.json"
    )
    assert files == ["metrics.jsonl", "model.pt", "samples.jsonl", "state.json", "train_state.pt"]
    assert len(made) == 2 * len(files) + 1  # written, copied (and the manifest copied)
    assert sorted(reads) == sorted(files + ["manifest.json"])  # read once each: by the Drive copy
    assert verify_checkpoint(drive / "checkpoints" / "step_0000001").step == 1
    assert (
        drive / "checkpoints" / "step_0000001" / "metrics.jsonl"
    ).read_text() == "metrics.jsonl\n"
    assert sorted(p.name for p in drive.iterdir() if p.is_file()) == [
        "config.json",
        "loss.png",
        "samples.md",
        "tokenizer.json",
    ]


def test_writer_copies_every_milestone_to_the_mirror(tmp_path, monkeypatch):
    """Only the newest checkpoint is copied while Drive is slow, but milestones are all copied after it."""
    real, calls = mirror.mirror_checkpoint, []

    def slow_first_copy(src, dst, progress=None):
        calls.append(src.name)
        if len(calls) == 1:
            time.sleep(1.0)  # a slow Drive: steps 2..6 are saved meanwhile
        return real(src, dst, progress)

    monkeypatch.setattr(mirror, "mirror_checkpoint", slow_first_copy)
    w = CheckpointWriter(
        tmp_path / "local", keep_last=2, mirror_dir=tmp_path / "drive", keep_every=2
    )
    for s in range(1, 7):
        w.save(ckpt(s, sd(s), {"x": torch.ones(1)}, best=None))
        w.wait()
    st = w.close()
    assert st["mirror_step"] == 6 and st["mirror_error"] is None
    # the newest first: it is what a resume needs
    assert calls[:2] == [
        "step_0000001",
        "step_0000006",
    ]
    assert "step_0000003" not in calls  # superseded while Drive was busy, and not a milestone
    assert [p.name for p in list_checkpoints(tmp_path / "drive")] == [
        "step_0000006",
        "step_0000004",
        "step_0000002",
    ]
    # step 1 was protected while being copied
    local = [p.name for p in list_checkpoints(tmp_path / "local")]
    assert local[:4] == ["step_0000006", "step_0000005", "step_0000004", "step_0000002"]


def _gated_mirror(monkeypatch, fail_once=()):
    """mirror_checkpoint that copies only when the test releases it (and fails once for fail_once names)."""
    import threading

    real, calls, gate, failed = mirror.mirror_checkpoint, [], threading.Semaphore(0), set()

    def copy(src, dst, progress=None):
        calls.append(src.name)
        if src.name in fail_once and src.name not in failed:
            failed.add(src.name)
            raise OSError(errno.EIO, "Input/output error")
        gate.acquire()
        return real(src, dst, progress)

    monkeypatch.setattr(mirror, "mirror_checkpoint", copy)
    return calls, gate


def _wait_for(calls, n):
    end = time.time() + 10
    while len(calls) < n and time.time() < end:
        time.sleep(0.01)
    assert len(calls) >= n, calls


def _drive(tmp_path):
    return [p.name for p in list_checkpoints(tmp_path / "drive")]


def test_a_milestone_copied_late_keeps_the_current_best_on_the_mirror(tmp_path, monkeypatch):
    calls, gate = _gated_mirror(monkeypatch)
    w = CheckpointWriter(
        tmp_path / "local", keep_last=2, mirror_dir=tmp_path / "drive", keep_every=5
    )

    def save(s, best):
        w.save(ckpt(s, sd(s), {"x": torch.ones(1)}, best=best))
        w.wait()

    save(1, None)
    _wait_for(calls, 1)
    save(5, None)  # a milestone saved before step 6 became the best
    save(6, 6)
    for n, s in ((2, 7), (3, 8)):
        gate.release()
        _wait_for(calls, n)
        save(s, 6)
    for _ in range(4):
        gate.release()
    w.close(timeout=10)
    assert calls == ["step_0000001", "step_0000006", "step_0000007", "step_0000008", "step_0000005"]
    assert _drive(tmp_path) == ["step_0000008", "step_0000007", "step_0000006", "step_0000005"]


def test_a_superseded_retry_does_not_strand_milestones(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mirror, "MIRROR_RETRY_DELAYS_S", (5.0,))
    calls, gate = _gated_mirror(monkeypatch, fail_once={"step_0000011"})
    w = CheckpointWriter(
        tmp_path / "local", keep_last=2, mirror_dir=tmp_path / "drive", keep_every=10
    )

    def save(s):
        w.save(ckpt(s, sd(s), {"x": torch.ones(1)}, best=None))
        w.wait()

    save(1)
    _wait_for(calls, 1)
    save(10)
    save(11)
    gate.release()
    _wait_for(calls, 2)  # 11 failed once and waits 5 s to retry
    time.sleep(0.2)
    save(12)  # replaces 11 during the wait
    for _ in range(5):
        gate.release()
    st = w.close(timeout=10)
    assert st["mirror_step"] == 12 and "step_0000010" in _drive(tmp_path), (calls, _drive(tmp_path))
    assert "NOT on Drive" not in capsys.readouterr().err


def test_milestones_survive_a_change_of_keep_every(tmp_path):
    w = CheckpointWriter(tmp_path, keep_last=2, keep_every=2)
    for s in range(1, 6):
        w.save(ckpt(s, sd(s), {}, best=None))
        w.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step_0000005",
        "step_0000004",
        "step_0000002",
    ]
    w = CheckpointWriter(tmp_path, keep_last=2, keep_every=0)  # resumed with keep_every=0
    for s in range(6, 9):
        w.save(ckpt(s, sd(s), {}, best=None))
        w.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step_0000008",
        "step_0000007",
        "step_0000004",
        "step_0000002",
    ]


def test_resuming_locally_copies_the_local_milestones(tmp_path):
    w = CheckpointWriter(tmp_path / "local", keep_last=2, keep_every=2)  # Drive was away
    for s in range(1, 6):
        w.save(ckpt(s, sd(s), {}, best=None))
        w.wait()
    w = CheckpointWriter(
        tmp_path / "local", keep_last=2, mirror_dir=tmp_path / "drive", keep_every=2
    )
    # what train() does on a local resume
    w.mirror_existing(tmp_path / "local" / "checkpoints" / "step_0000005")
    w.close(timeout=10)
    assert _drive(tmp_path) == ["step_0000005", "step_0000004", "step_0000002"]


def test_writer_mirror_failure_is_loud_not_fatal(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mirror, "MIRROR_RETRY_DELAYS_S", (0.01,))

    def broken(*a, **k):
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    monkeypatch.setattr(mirror, "copy_file_verified", broken)
    w = CheckpointWriter(tmp_path / "local", mirror_dir=tmp_path / "drive")
    w.save(ckpt(1, sd(), {}, best=None))
    st = w.close()  # does not raise
    assert st["local_step"] == 1 and st["mirror_step"] is None and "Errno 107" in st["mirror_error"]
    assert st["mirror_failures"] == 2 and w.status_line().startswith("DRIVE COPY FAILING")
    err = capsys.readouterr().err
    assert "attempt 1/2" in err and "DRIVE COPY FAILED" in err and "NOT on Drive" in err


def test_writer_local_error_raises_at_next_save(tmp_path, monkeypatch):
    w = CheckpointWriter(tmp_path)
    w.save(ckpt(1, sd(), {}, best=None))
    w.wait()
    faulty.install("eio:save_mid@2", monkeypatch.setattr)
    w.save(ckpt(2, sd(), {}, best=None))
    with pytest.raises(CheckpointError, match=r"Errno 5.*newest intact checkpoint is step 1"):
        w.save(ckpt(3, sd(), {}, best=None))


def test_call_with_timeout():
    assert call_with_timeout(lambda: 5, 1.0) == 5
    t = time.monotonic()
    with pytest.raises(HungIOError):
        call_with_timeout(lambda: time.sleep(2), 0.2)
    assert time.monotonic() - t < 1.5


def test_graceful_stop_handles_sigterm_and_restores():
    old = signal.getsignal(signal.SIGTERM)
    stop = GracefulStop().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.reason == "sigterm"
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == old


def test_importing_gptlib_checkpoint_and_colab_has_no_side_effects(tmp_path):
    import subprocess
    import sys

    code = (
        "import gptlib.checkpoint.format, gptlib.colab, sys; "
        "print(sorted(m for m in sys.modules if m.startswith('google')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]" and not list(tmp_path.iterdir())


def test_writer_close_is_bounded_when_drive_hangs(tmp_path, monkeypatch, capsys):
    import threading

    release = threading.Event()
    # one attempt, so the thread ends after release
    monkeypatch.setattr(mirror, "MIRROR_RETRY_DELAYS_S", ())
    monkeypatch.setattr(mirror, "copy_file_verified", lambda *a, **k: release.wait(10))
    w = CheckpointWriter(tmp_path / "local", mirror_dir=tmp_path / "drive")
    w.save(ckpt(1, sd(), {}, best=None))
    t = time.monotonic()
    st = w.close(timeout=0.5)  # stall timeout (180 s) not reached: close gives up waiting instead
    release.set()
    assert time.monotonic() - t < 3 and st["local_step"] == 1 and st["mirror_step"] is None
    w.mirror._thread.join(5)
    err = capsys.readouterr().err
    assert "stopped waiting for Drive after 0.5 s" in err and "NOT on Drive" in err


def test_load_model_weights_refuses_an_empty_file_clearly(tmp_path):
    f = tmp_path / "model.pt"
    f.write_bytes(b"")  # torch raises EOFError with an empty message here
    with pytest.raises(CheckpointError, match=f"{f}: cannot load safely \\(EOFError"):
        ck.load_model_weights(f)


def test_mirror_backoff_is_not_cut_short_by_a_same_step_resave(tmp_path, monkeypatch):
    """Only a newer checkpoint ends a retry wait; a re-save of the same step once made the retries go at once."""
    monkeypatch.setattr(mirror, "MIRROR_RETRY_DELAYS_S", (0.2, 0.2))
    times = []

    def broken(*a, **k):
        times.append(time.monotonic())
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(mirror, "copy_file_verified", broken)
    w = CheckpointWriter(tmp_path / "local", mirror_dir=tmp_path / "drive")
    w.save(ckpt(5, sd(), {}, best=None))
    deadline = time.monotonic() + 5
    while not times and time.monotonic() < deadline:
        time.sleep(0.01)
    # the same step again (e.g. resumed, then stopped at once)
    w.save(ckpt(5, sd(2.0), {}, best=None))
    w.close()
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(times) == 6 and gaps[0] >= 0.15 and gaps[1] >= 0.15, gaps


def test_manifest_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    import json

    from gptlib.checkpoint.format import CheckpointError, verify_checkpoint

    ck = tmp_path / "checkpoints" / "step_0000001"
    ck.mkdir(parents=True)
    (tmp_path / "secret").write_text("x")
    files = {n: {"size": 1, "sha256": "0"} for n in ("model.pt", "train_state.pt", "state.json")}
    files["../../secret"] = {"size": 1, "sha256": "0"}
    (ck / "manifest.json").write_text(json.dumps({"format_version": 1, "step": 1, "files": files}))
    with pytest.raises(CheckpointError, match="is not a plain name inside the checkpoint"):
        verify_checkpoint(ck)


def test_the_host_copy_is_reused_across_saves_and_saves_each_tensor_once(tmp_path):
    """A host tensor per state tensor, kept from save to save of the same layout (on a GPU too, tests/test_gpu.py);
    a tied tensor is copied once and stored once; the next save writes the new values, the first keeps its own."""
    w = CheckpointWriter(tmp_path)
    a, b = torch.randn(3, 5), torch.arange(7)
    opt = {"m": torch.ones(9, dtype=torch.bfloat16), "step": torch.tensor(3.0)}
    w.save(ckpt(1, {"a": a, "tied": a, "b": b}, {"opt": opt}))
    w.wait()
    host = list(w._host)
    assert [tuple(t.shape) for t in host] == [(3, 5), (7,), (9,), ()]  # the tied tensor once
    assert (
        tmp_path / "checkpoints" / "step_0000001" / "model.pt"
    ).stat().st_size < 2000  # a and b once each
    a0 = a.clone()
    a.add_(1.0)
    opt["m"].mul_(3)
    w.save(ckpt(2, {"a": a, "tied": a, "b": b}, {"opt": opt}))
    w.wait()
    assert all(x is y for x, y in zip(w._host, host))  # reused
    c = load_checkpoint(tmp_path / "checkpoints" / "step_0000002")
    m = c["model"]
    assert torch.equal(m["a"], a) and torch.equal(m["tied"], a) and torch.equal(m["b"], b)
    assert (
        torch.equal(c["optimizer"]["opt"]["m"], opt["m"]) and c["optimizer"]["opt"]["step"] == 3.0
    )
    # the first save kept its own values
    assert torch.equal(load_checkpoint(tmp_path / "checkpoints" / "step_0000001")["model"]["a"], a0)
    w.close()
    assert w._host == []  # not held after training


def test_a_save_runs_two_threads_besides_the_loops(tmp_path, monkeypatch):
    """The writer's thread and the mirror's; the mirror's Drive calls run in its own thread, watched by the loop
    (Mirror.watch), not in a watchdog thread each."""
    import threading

    started, real_start = [], threading.Thread.start

    def start(thread):
        real_start(thread)
        alive = [
            t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()
        ]
        started.append((thread.name, len(alive)))

    monkeypatch.setattr(threading.Thread, "start", start)
    before = {t.name for t in threading.enumerate()}
    w = CheckpointWriter(tmp_path / "local", mirror_dir=tmp_path / "drive")
    for step in (1, 2, 3):
        w.save(ckpt(step, sd(step), {}, best=None))
    st = w.close(timeout=20)
    assert st["mirror_step"] == 3 and verify_checkpoint(
        tmp_path / "drive" / "checkpoints" / "step_0000003"
    )
    names = {n for n, _ in started}
    assert names == {"gptlib-checkpoint", "gptlib-mirror"}, started
    assert max(n for _, n in started) <= 2 + len(before - {threading.main_thread().name}), started


def test_a_hung_drive_copy_is_given_up_by_watch_and_retried_in_a_new_thread(
    tmp_path, monkeypatch, capsys
):
    import threading

    monkeypatch.setattr(mirror, "MIRROR_STALL_TIMEOUT_S", 0.3)
    release, real, calls = threading.Event(), mirror.copy_file_verified, []

    def hangs_once(*a, **k):
        calls.append(threading.current_thread())
        if len(calls) == 1:
            release.wait(20)  # a FUSE call that does not come back
        return real(*a, **k)

    monkeypatch.setattr(mirror, "copy_file_verified", hangs_once)
    w = CheckpointWriter(tmp_path / "local", mirror_dir=tmp_path / "drive")
    w.save(ckpt(7, sd(), {}, best=None))
    w.wait()
    deadline = time.monotonic() + 10
    while w.mirror.last_step is None and time.monotonic() < deadline:
        time.sleep(0.05)
        w.watch()  # as the training loop does at its log steps
    hung_thread = calls[0]
    st = w.close(timeout=20)
    release.set()
    err = capsys.readouterr().err
    assert st["mirror_step"] == 7 and st["mirror_missing"] is None, (st, err)
    assert (
        "(attempt 1/6)" in err and "made no progress for 0.3 s" in err and "retrying now" in err
    ), err
    assert calls[1] is not hung_thread  # the retry ran in a new thread
    hung_thread.join(5)
    # the abandoned thread, released late, changed nothing: one copy there, no partial folder
    assert [p.name for p in (tmp_path / "drive" / "checkpoints").iterdir()] == ["step_0000007"]


def _hang_the_first_copy_of(step_name: str, monkeypatch, also=None):
    """copy_file_verified hangs on the first copy of step_name (until the returned Event is set); `also(src)` first."""
    import threading

    release, real, seen = threading.Event(), mirror.copy_file_verified, []
    monkeypatch.setattr(mirror, "MIRROR_STALL_TIMEOUT_S", 0.3)

    def copy(src, dst, *a, **k):
        if also is not None:
            also(src)
        if src.parent.name == step_name and step_name not in seen:
            seen.append(step_name)
            release.wait(30)
        return real(src, dst, *a, **k)

    monkeypatch.setattr(mirror, "copy_file_verified", copy)
    return release


def _given_up(w: CheckpointWriter) -> None:
    """The loop's watch() at its log steps, until the hung call is given up."""
    deadline = time.monotonic() + 10
    while w.mirror._call is None and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.4)  # past MIRROR_STALL_TIMEOUT_S
    w.watch()


def test_a_hung_newest_milestone_is_retried_before_older_milestones(tmp_path, monkeypatch):
    """keep_every=2: step 2 (a milestone) cannot be copied; step 4, the newest and a milestone too, hangs once. It is
    retried first and reaches Drive (a review found it left behind the failing step 2, then never retried)."""

    def drive_fails_step_2(src):
        if src.parent.name == "step_0000002":
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(mirror, "MIRROR_RETRY_DELAYS_S", (0.01,) * 5)
    release = _hang_the_first_copy_of("step_0000004", monkeypatch, also=drive_fails_step_2)
    w = CheckpointWriter(tmp_path / "local", mirror_dir=tmp_path / "drive", keep_every=2)
    w.save(ckpt(2, sd(), {}, best=None))
    deadline = time.monotonic() + 10
    while not w.mirror._milestones_paused and time.monotonic() < deadline:
        time.sleep(0.01)
    w.save(ckpt(4, sd(4.0), {}, best=None))
    _given_up(w)
    st = w.close(timeout=20)
    release.set()
    assert st["mirror_step"] == 4 and st["mirror_missing"] is None, st


def test_a_save_landing_while_a_hung_copy_is_reported_is_the_one_copied(
    tmp_path, monkeypatch, capsys
):
    """The thread taking over from a hung copy of step 1 reports it; the save of step 2 lands meanwhile: step 2 is
    copied, step 1 is not copied again after it (a review found step 1 re-queued over step 2)."""
    release = _hang_the_first_copy_of("step_0000001", monkeypatch)
    w = CheckpointWriter(tmp_path / "local", mirror_dir=tmp_path / "drive")
    real_loud = mirror.loud

    def loud(msg):
        real_loud(msg)
        if "step_0000001 failed" in msg:  # the save of step 2 lands while the hang is reported
            w.save(ckpt(2, sd(2.0), {}, best=None))
            w.wait()

    monkeypatch.setattr(mirror, "loud", loud)
    w.save(ckpt(1, sd(), {}, best=None))
    _given_up(w)
    st = w.close(timeout=20)
    release.set()
    assert st["mirror_step"] == 2 and st["mirror_missing"] is None, (st, capsys.readouterr().err)
    on_drive = sorted(p.name for p in (tmp_path / "drive" / "checkpoints").iterdir())
    assert on_drive == ["step_0000002"], on_drive


def test_a_mirror_taken_over_during_a_hung_copy_says_nothing_more(tmp_path, monkeypatch, capsys):
    """Another process takes the mirror while a copy hangs: the copy given up is not reported as a Drive failure
    and not retried (as when the taker's clean-up breaks a copy)."""
    from gptlib.errors import LeaseLost

    taken = []
    real_check = mirror.check_writable

    def check_writable(p):
        if taken:
            raise LeaseLost("another process holds the run")
        return real_check(p)

    monkeypatch.setattr(mirror, "check_writable", check_writable)
    release = _hang_the_first_copy_of("step_0000001", monkeypatch, also=lambda src: taken.append(1))
    w = CheckpointWriter(tmp_path / "local", mirror_dir=tmp_path / "drive")
    w.save(ckpt(1, sd(), {}, best=None))
    _given_up(w)
    deadline = time.monotonic() + 10
    while not w.mirror.lost and time.monotonic() < deadline:
        time.sleep(0.02)
    release.set()
    err = capsys.readouterr().err
    assert w.mirror.lost and w.mirror.failures == 0 and "failed" not in err, err


@pytest.mark.parametrize("how", ["fails", "hangs"])
def test_a_mirror_clean_up_broken_by_a_take_over_says_nothing(tmp_path, monkeypatch, capsys, how):
    """Another VM takes the mirror over while this one rotates it (frozen, then woken): the clean-up fails or is given
    up as hung. The take-over is said once, by the loop's LeaseLost; a "Drive clean-up failed" line beside it was a
    second, wrong, line (a copy broken the same way already said nothing)."""
    import threading

    from gptlib.lease import RunLease
    from tests.test_lease import write_lease

    local, drive = tmp_path / "local", tmp_path / "drive"
    lease = RunLease([local, drive], log=lambda m: None).acquire()
    release, real_rotate = threading.Event(), mirror.rotate
    monkeypatch.setattr(mirror, "MIRROR_TIDY_TIMEOUT_S", 0.3)

    def rotate(*a, **k):
        write_lease(drive / "lease.json", host="vmB", session="b" * 12)
        if how == "hangs":
            release.wait(20)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(mirror, "rotate", rotate)
    w = CheckpointWriter(local, mirror_dir=drive)
    try:
        w.save(ckpt(1, sd(), {}, best=None))
        w.wait()
        if how == "hangs":
            _given_up(w)
        deadline = time.monotonic() + 10
        while not w.mirror.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        w.close(timeout=20)
    finally:
        release.set()
        monkeypatch.setattr(mirror, "rotate", real_rotate)
        lease.release()
    err = capsys.readouterr().err
    assert w.mirror.lost and "clean-up" not in err, err
