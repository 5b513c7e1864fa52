"""A Drive that is slow at resume never costs the run (issue 18, part 1).

On a fresh Colab VM the local disk is empty and the Drive mirror is the only copy. Its checkpoints at steps 70
and 80 block on read here (their model.pt is a FIFO: open() waits in the kernel, as on a stalled Drive mount).
Before the fix, both were skipped after the read limit, training started again from step 0 without a word,
and once Drive answered, rotation deleted the valid step 70 and 80 checkpoints and the mirror's metrics went
from 80 rows to 30. Now resume tries again for a bounded time, then stops with what to do; --skip-unreadable
goes on knowingly; and rotation never deletes what is newer than the run's own checkpoints or unreadable.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gptlib.checkpoint.format import CheckpointError, list_checkpoints, verify_checkpoint
from gptlib.training import resume as gresume
from gptlib.training.logs import read_metrics
from gptlib.training.loop import train
from gptlib.training.resume import StartOptions
from tests import faulty
from tests.conftest import REPO, TINY
from tests.test_resume import one_thread  # noqa: F401 (fixture)

SETTINGS = TINY + ["keep_last=2"]  # a checkpoint at every validation (every 10 steps)


def quiet(_msg):
    pass


def mtimes(mirror):
    return {
        p.relative_to(mirror): p.stat().st_mtime_ns
        for p in mirror.rglob("*")
        if p.name != "lease.json"
    }


def steps(run_dir):
    return [int(p.name.split("_")[1]) for p in list_checkpoints(run_dir)]


@pytest.fixture(scope="module")
def drive_at_80(char_data, tmp_path_factory):
    """A mirror made by a run trained to step 80 (checkpoints 70 and 80 there, metrics 80 rows)."""
    root = tmp_path_factory.mktemp("drive80")
    train(
        char_data,
        root / "vm1",
        "phase1",
        SETTINGS,
        max_steps=80,
        progress=False,
        log=quiet,
        mirror_dir=root / "drive",
    )
    assert (
        steps(root / "drive") == [80, 70]
        and len(read_metrics(root / "drive" / "checkpoints" / "step_0000080")) == 80
    )
    return root / "drive"


class StalledDrive:
    """Each named checkpoint's model.pt on the mirror swapped for a FIFO; `recover()` puts the real files back.
    The readers a timed-out attempt abandoned stay blocked on the FIFOs until `release()` (hard links keep
    the FIFOs reachable after recover() replaced them)."""

    def __init__(self, mirror, stalled_steps, tmp_path):
        self.real, self.fifos = {}, []
        for step in stalled_steps:
            f = mirror / "checkpoints" / f"step_{step:07d}" / "model.pt"
            keep = tmp_path / f"model_{step}.pt"
            shutil.move(f, keep)
            os.mkfifo(f)
            os.link(f, tmp_path / f"fifo_{step}")
            self.real[f], self.fifos = keep, self.fifos + [tmp_path / f"fifo_{step}"]

    def recover(self):
        for f, keep in self.real.items():
            shutil.copy(keep, f.with_name("model.pt.back"))
            os.replace(f.with_name("model.pt.back"), f)

    def release(self):
        for fifo in self.fifos:
            # one writer open per blocked reader: each then reads end-of-file and gives up
            while True:
                try:
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:  # ENXIO: no reader is waiting any more
                    break
                time.sleep(0.05)


@pytest.fixture()
def drive(drive_at_80, tmp_path, monkeypatch):
    """A copy of the step-80 mirror whose steps 70 and 80 hang on read; short limits: a read is abandoned after
    0.5 s without progress, and resume looks again every 1 s for up to 4 s."""
    mirror = tmp_path / "drive"
    shutil.copytree(drive_at_80, mirror)
    monkeypatch.setattr(gresume, "DRIVE_READ_STALL_S", 0.5)
    monkeypatch.setattr(gresume, "DRIVE_RESUME_RETRY_S", 1.0)
    monkeypatch.setattr(gresume, "DRIVE_RESUME_WAIT_S", 4.0)
    stalled = StalledDrive(mirror, [70, 80], tmp_path)
    yield mirror, stalled
    stalled.release()


def test_a_drive_that_stays_unreadable_stops_training_and_changes_nothing(
    char_data, tmp_path, drive, capsys
):
    mirror, _ = drive
    before = mtimes(mirror)
    run = tmp_path / "vm2"
    t0 = time.time()
    with pytest.raises(CheckpointError) as e:
        train(
            char_data,
            run,
            "phase1",
            SETTINGS,
            max_steps=100,
            progress=False,
            log=quiet,
            mirror_dir=mirror,
        )
    msg = str(e.value)
    assert "step_0000080" in msg and "step_0000070" in msg and "could not read" in msg
    assert "training did not start and nothing was changed" in msg and "--skip-unreadable" in msg
    assert "force_remount=True" in msg and "\n" not in msg
    assert 4 <= time.time() - t0 < 60  # retried for the documented time, then stopped
    err = capsys.readouterr().err
    assert err.count("trying again in") >= 2  # it said what it found and that it waits
    assert (
        mtimes(mirror) == before
    )  # the mirror is untouched, but for its lease: taken, then marked released
    assert json.loads((mirror / "lease.json").read_text())["released"]
    assert not run.exists() or not list_checkpoints(run)


def test_a_drive_that_recovers_within_the_retry_time_resumes_from_step_80(
    char_data, tmp_path, drive, monkeypatch, capsys
):
    mirror, stalled = drive
    monkeypatch.setattr(gresume, "DRIVE_RESUME_WAIT_S", 30.0)
    threading.Timer(1.5, stalled.recover).start()  # Drive answers again during the retries
    logs = []
    r = train(
        char_data,
        tmp_path / "vm2",
        "phase1",
        SETTINGS,
        max_steps=90,
        progress=False,
        log=logs.append,
        mirror_dir=mirror,
    )
    assert r.resumed_from == 80 and r.step == 90, logs
    assert "trying again in" in capsys.readouterr().err
    assert [row["step"] for row in read_metrics(tmp_path / "vm2")] == list(range(1, 91))
    assert steps(mirror) == [90, 80]


def test_skip_unreadable_starts_over_knowingly_and_nothing_on_drive_is_lost(
    char_data, tmp_path, drive, capsys
):
    """The issue's loss, step by step: go on without the stalled checkpoints (asked for), Drive answers again
    mid-run, the new run copies steps 10-30 there. Steps 70 and 80 and the mirror's 80 metrics rows survive,
    and the next resume takes step 80."""
    mirror, stalled = drive
    run = tmp_path / "vm2"

    def drive_back_at_first_validation(row):
        stalled.recover()

    r = train(
        char_data,
        run,
        "phase1",
        SETTINGS,
        max_steps=30,
        progress=False,
        log=quiet,
        mirror_dir=mirror,
        options=StartOptions(skip_unreadable=True),
        on_log=drive_back_at_first_validation,
    )
    assert r.resumed_from is None and r.step == 30
    err = capsys.readouterr().err
    assert (
        "--skip-unreadable: training goes on from step 0 (from scratch)" in err
        and "step_0000080" in err
    )
    assert steps(mirror) == [80, 70, 30, 20]  # nothing newer than the run's own was deleted
    for step in (70, 80):
        verify_checkpoint(mirror / "checkpoints" / f"step_{step:07d}")
    # the logs stay with their checkpoint
    assert len(read_metrics(mirror / "checkpoints" / "step_0000080")) == 80
    r = train(
        char_data,
        tmp_path / "vm3",
        "phase1",
        SETTINGS,
        max_steps=85,
        progress=False,
        log=quiet,
        mirror_dir=mirror,
    )
    assert r.resumed_from == 80


def test_rotation_keeps_what_it_cannot_read(tmp_path):
    """A checkpoint whose files cannot be read now (an I/O error, not damage) is never deleted by rotation."""
    from gptlib.checkpoint.format import rotate, save_checkpoint

    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        save_checkpoint(root, {"model": {}, "progress": {"step": step}})
    blocked = root / "step_0000001" / "state.json"
    blocked.unlink()
    blocked.mkdir()  # reading it raises IsADirectoryError, an OSError: unreadable, not known to be damaged
    deleted = rotate(tmp_path, keep_last=2, best_step=None)
    assert [p.name for p in deleted] == ["step_0000002"]
    assert steps(tmp_path) == [4, 3, 1]


# --- a Drive that does not answer at resume, in real processes (issue 36, part 1) -------------------------------------
# Every file of the mirror's checkpoints unreadable: each a FIFO, or a FUSE mount whose reads hang. Before the fix a
# manifest.json that was not a regular file counted as "no manifest.json (the save did not finish)": both checkpoints
# were damage, renamed .damaged-* on Drive, and training started from step 0 with exit status 0.

SHORT_WAITS = (
    "training.resume.DRIVE_READ_STALL_S=0.5,training.resume.DRIVE_RESUME_RETRY_S=1,"
    "training.resume.DRIVE_RESUME_WAIT_S={wait}"
)


def train_process(char_data, run, mirror, wait_s):
    """`python -m gptlib train` to step 90, resume waiting `wait_s` for Drive (a read abandoned after 0.5 s)."""
    cmd = faulty.gptlib_cmd(
        SHORT_WAITS.format(wait=wait_s),
        "train",
        "--data",
        char_data,
        "--run-dir",
        run,
        "--mirror-dir",
        mirror,
        "--preset",
        "phase1",
        "--max-steps",
        90,
        "--device",
        "cpu",
        "--quiet",
    )
    for s in SETTINGS:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def listing(mirror):
    """Each name under the mirror's checkpoints with its kind (a FIFO stays a FIFO): what a rename would change."""
    return sorted(
        (str(p.relative_to(mirror)), stat.S_IFMT(p.lstat().st_mode))
        for p in (mirror / "checkpoints").rglob("*")
    )


class AllFifos:
    """Every file of the mirror's checkpoints, manifest.json included, swapped for a FIFO; back() puts them back."""

    def __init__(self, mirror, keep):
        self.mirror, self.real = mirror, {}
        for f in sorted(p for p in (mirror / "checkpoints").rglob("*") if p.is_file()):
            self.real[f] = keep / "_".join(f.relative_to(mirror).parts)
            shutil.move(f, self.real[f])
            os.mkfifo(f)

    def back(self):
        for f, kept in self.real.items():
            shutil.copy(kept, f.with_name(f.name + ".back"))
            os.replace(f.with_name(f.name + ".back"), f)


class HangingMount:
    """The mirror served through a FUSE mount (tests/hangfs.py) whose checkpoint reads block until back()."""

    def __init__(self, source, tmp_path, write_bps=0.0):
        try:
            import mfusepy  # noqa: F401 (needs libfuse 3 or 2)
        except (ImportError, OSError) as e:
            pytest.skip(f"no FUSE here (mfusepy, libfuse: {e})")
        if not os.path.exists("/dev/fuse") or shutil.which("fusermount") is None:
            pytest.skip("no FUSE here (/dev/fuse and fusermount)")
        self.mirror, self.flag = tmp_path / "mnt", tmp_path / "stalled"
        self.mirror.mkdir()
        self.flag.touch()
        self.server = subprocess.Popen(
            [
                sys.executable,
                str(Path(faulty.__file__).with_name("hangfs.py")),
                str(source),
                str(self.mirror),
                str(self.flag),
                str(write_bps),
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 10
        while not os.path.ismount(self.mirror):
            if self.server.poll() is not None or time.monotonic() > deadline:
                self.close()
                pytest.skip(f"FUSE cannot mount here: {self.server.stderr.read()[-300:]}")
            time.sleep(0.05)

    def back(self):
        self.flag.unlink(missing_ok=True)

    def close(self):
        self.back()
        subprocess.run(["fusermount", "-u", "-z", str(self.mirror)], capture_output=True)
        self.server.terminate()
        self.server.wait(10)


@pytest.fixture(params=["fifos", "fuse"])
def dead_drive(request, drive_at_80, tmp_path):
    """-> (the mirror as training sees it, a function that makes Drive answer again)."""
    source = tmp_path / "drive"
    shutil.copytree(drive_at_80, source)
    if request.param == "fifos":
        (tmp_path / "real").mkdir()
        yield source, AllFifos(source, tmp_path / "real").back
        return
    mount = HangingMount(source, tmp_path)
    yield mount.mirror, mount.back
    mount.close()


def read_until(stream, text):
    """The lines read up to and including the first that holds `text` (AssertionError at end of file)."""
    lines = []
    while text not in (lines[-1] if lines else ""):
        lines.append(stream.readline())
        assert lines[-1], "".join(lines)
    return "".join(lines)


def test_a_drive_that_never_answers_at_resume_stops_and_renames_nothing(
    char_data, tmp_path, dead_drive
):
    mirror, back = dead_drive
    before, run = listing(mirror), tmp_path / "vm2"
    p = train_process(char_data, run, mirror, wait_s=5)
    err = read_until(p.stderr, "error:")
    assert listing(mirror) == before  # nothing renamed or written while Drive was dead
    # The process cannot exit yet on the hanging mount: the kernel holds a thread blocked in a FUSE read (a dead
    # Drive does the same) until the read is answered. Drive answering again lets it go.
    back()
    out, rest = p.communicate(timeout=120)
    err += rest
    assert p.returncode == 2, err[-2000:]
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert "could not read" in line and "step_0000080" in line and "step_0000070" in line, line
    assert "training did not start and nothing was changed" in line and "--skip-unreadable" in line
    assert err.count("trying again in") >= 2, err  # it waited for Drive, saying so
    assert "starting from scratch" not in out + err and "did not finish" not in out + err
    assert [name for name, _ in listing(mirror)] == [name for name, _ in before]
    assert not run.exists() or not list_checkpoints(run)


def test_a_drive_that_answers_again_mid_wait_resumes_from_the_newest(
    char_data, tmp_path, dead_drive
):
    mirror, back = dead_drive
    run = tmp_path / "vm2"
    p = train_process(char_data, run, mirror, wait_s=60)
    read_until(p.stderr, "trying again in")  # resume is waiting for Drive now
    back()
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    assert "resumed from step 80" in out and "on the Drive mirror" in out, out
    assert [row["step"] for row in read_metrics(run)] == list(range(1, 91))
    assert steps(mirror) == [90, 80] and not list((mirror / "checkpoints").glob("*.damaged-*"))


def test_readers_on_a_drive_that_does_not_answer_say_so(char_data, drive_at_80, tmp_path):
    """sample (as eval and export-hf, through the same resolve_checkpoint) on the mirror of the first test: one line
    that says the files cannot be read now (was: "incomplete", "no manifest.json (the save did not finish)")."""
    mirror = tmp_path / "drive"
    shutil.copytree(drive_at_80, mirror)
    (tmp_path / "real").mkdir()
    AllFifos(mirror, tmp_path / "real")
    p = subprocess.run(
        faulty.gptlib_cmd(
            None, "sample", "--run-dir", mirror, "--prompt", "A", "--max-new-tokens", 4
        ),
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    [line] = p.stderr.strip().splitlines()
    assert (
        "step_0000080" in line
        and "manifest.json is not a regular file now (a Drive that does not answer?)" in line
    )
    assert "did not finish" not in line and "incomplete" not in line


# --- readers and the resume's wait on a mount whose reads hang (issue 44, part 4) -----------------------------------


@pytest.fixture()
def hung_mount(drive_at_80, tmp_path):
    """The step-80 mirror behind a FUSE mount whose checkpoint reads hang until the test ends."""
    source = tmp_path / "drive"
    shutil.copytree(drive_at_80, source)
    mount = HangingMount(source, tmp_path)
    yield mount.mirror
    mount.close()


@pytest.mark.parametrize(
    "command",
    [
        ["sample", "--prompt", "A", "--max-new-tokens", "4"],
        ["eval", "--task", "bpb", "--checkpoint", "all"],
        ["export-hf", "--out", "{tmp}/hf"],
    ],
)
def test_readers_on_a_hung_mount_name_each_checkpoint_and_exit_by_their_deadline(
    hung_mount, tmp_path, command
):
    """Each checkpoint is read in a thread of its own, within the reader's deadline (2 s here, 60 by default): the
    line names both, and the process exits while the mount still hangs (its reads are left to a child process the
    kernel holds until the mount answers). Was: after the one 60 s watchdog over the whole listing, "listing ... made
    no progress", naming none, and the process could not exit until the mount answered."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in command] + ["--run-dir", hung_mount]
    t0 = time.monotonic()
    p = subprocess.run(
        faulty.gptlib_cmd("inference.loading.DRIVE_LIST_TIMEOUT_S=2", *argv),
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert (
        time.monotonic() - t0 < 40
    )  # the mount hangs on: before, only its answer let the process end
    [line] = p.stderr.strip().splitlines()
    for step in (80, 70):
        assert f"step_00000{step}: no answer in 2 s (a hung Drive?)" in line, line


def test_the_resume_wait_on_a_hung_mount_keeps_its_deadline(
    char_data, tmp_path, hung_mount, monkeypatch
):
    """The wait for unreadable checkpoints is DRIVE_RESUME_WAIT_S in all: each read gets what is left of it. Was: each
    look spent a full read limit on each hung checkpoint, past the wait (a "300 s" wait took 421 s); here 4 s and two
    hung checkpoints of 4 s each took 8 s."""
    monkeypatch.setattr(gresume, "DRIVE_READ_STALL_S", 4.0)
    monkeypatch.setattr(gresume, "DRIVE_RESUME_RETRY_S", 1.0)
    monkeypatch.setattr(gresume, "DRIVE_RESUME_WAIT_S", 4.0)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="could not read .*step_0000080.*step_0000070"):
        train(
            char_data,
            tmp_path / "vm2",
            "phase1",
            SETTINGS,
            max_steps=90,
            progress=False,
            log=quiet,
            mirror_dir=hung_mount,
        )
    assert time.monotonic() - t0 < 6.5  # 4 s, then 1 s at least for the second checkpoint's read
