"""One writer per run (gptlib.lease), with real processes where the issue was found with them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from gptlib import lease as L
from gptlib.checkpoint.format import ORPHAN_MARKERS, list_checkpoints
from gptlib.errors import ConfigError
from gptlib.fsutil import sha256_file
from gptlib.layout import step_of
from gptlib.training import loop
from gptlib.training.loop import train
from gptlib.training.resume import StartOptions
from tests import faulty
from tests.conftest import REPO, TINY
from tests.test_resume import curve, one_thread  # noqa: F401 (fixture)

SLOW = TINY + ["dropout=0.1", "save_every_steps=5", "keep_last=2"]
LONG_STEPS = 120  # with the "slow" fault (50 ms a step): ~6 s of training, long enough to start a second process


def quiet(_msg):
    pass


def trainer(
    data, run_dir, mirror=None, steps=LONG_STEPS, fault="slow:mid_step", extra=()
) -> subprocess.Popen:
    """`python -m gptlib train` in its own process; fault: tests/faulty.py's SPEC (default: 50 ms a step)."""
    cmd = faulty.train_cmd(fault, data, run_dir, steps, *extra, settings=SLOW)
    if mirror is not None:
        cmd += ["--mirror-dir", str(mirror)]
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path, timeout=90):
    end = time.time() + timeout
    while not path.exists():
        assert time.time() < end, f"{path} never appeared"
        time.sleep(0.05)


def write_lease(path, host="other-vm", pid=4242, heartbeat_age=0.0, session="f" * 12):
    path.parent.mkdir(parents=True, exist_ok=True)
    now = time.time()
    tmp = path.with_name(f"{path.name}.test-{threading.get_ident()}")
    tmp.write_text(
        json.dumps(
            {
                "host": host,
                "pid": pid,
                "session": session,
                "started": now - 3600,
                "heartbeat": now - heartbeat_age,
                "beats": 7,
            }
        )
    )
    os.replace(tmp, path)  # atomic, as gptlib writes it: a reader never sees half a lease


def test_a_second_trainer_refuses_and_the_first_trains_as_if_alone(char_data, tmp_path):
    run = tmp_path / "run"
    first = trainer(char_data, run)
    wait_for(run / "lease.json")
    t0 = time.time()
    second = trainer(char_data, run, fault="")
    out, err = second.communicate(timeout=120)
    assert second.returncode == 2, out + err
    assert (
        "is in use by another training process" in err
        and f"pid {first.pid}" in err
        and "--take-over" in err
    )
    # refused within seconds of starting (most of it is importing torch)
    assert time.time() - t0 < 60
    out1, err1 = first.communicate(timeout=300)
    assert first.returncode == 0, out1 + err1
    alone = tmp_path / "alone"
    train(
        char_data,
        alone,
        "phase1",
        SLOW,
        max_steps=LONG_STEPS,
        device="cpu",
        progress=False,
        log=quiet,
    )
    assert curve(run) == curve(alone)  # the refused trainer changed nothing
    # released at the end: marked so, never deleted (a holder frozen before it took over reads there it was)
    lease = json.loads((run / "lease.json").read_text())
    assert lease["released"] and lease["pid"] == first.pid and lease["generation"] == 1


def test_two_runs_sharing_one_mirror(char_data, tmp_path):
    """Two Colab tabs with the same RUN_NAME: different local dirs, one Drive mirror."""
    mirror = tmp_path / "drive" / "run"
    first = trainer(char_data, tmp_path / "a", mirror=mirror)
    wait_for(mirror / "lease.json")
    second = trainer(char_data, tmp_path / "b", mirror=mirror, fault="")
    out, err = second.communicate(timeout=120)
    assert second.returncode == 2 and f"{mirror} is in use" in err, out + err
    assert first.communicate(timeout=300)[0] is not None and first.returncode == 0
    assert (
        not (tmp_path / "b" / "checkpoints").exists()
        and not (tmp_path / "b" / "config.json").exists()
    )
    steps = sorted(int(p.name[5:]) for p in (mirror / "checkpoints").iterdir())
    assert steps[-1] == LONG_STEPS  # only the first run's checkpoints


def test_a_taken_over_writer_stops_without_writing(char_data, tmp_path):
    run = tmp_path / "run"
    proc = trainer(char_data, run, steps=100_000, fault="slow:mid_step,lease.HEARTBEAT_S=0.2")
    wait_for(run / "checkpoints")  # it trains and saves
    # Another process takes the run over and keeps its claim, as a holder's heartbeat does. A single write
    # can land between the trainer's heartbeat check and its rewrite (files have no compare-and-swap); the
    # trainer then keeps the lease and a real taker is the one that stops (at its 50 ms re-check or first
    # beat), so at most one process writes either way. Re-claiming tests the trainer's side of it.
    stop = threading.Event()

    def claim():
        while not stop.is_set():
            write_lease(run / "lease.json", session="b" * 12)
            stop.wait(0.1)

    t = threading.Thread(target=claim)
    t0 = time.time()
    t.start()
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        stop.set()
        t.join()
    assert proc.returncode == 2 and "taken over by another process" in err and "other-vm" in err, (
        out + err
    )
    assert time.time() - t0 < 30
    # the new holder's lease stands
    assert json.loads((run / "lease.json").read_text())["session"] == "b" * 12


def test_a_lease_deleted_under_its_holder_is_told_apart_from_a_take_over(
    char_data, tmp_path, machines
):
    """Someone tidying Drive deletes lease.json: no other process's lease is there, so nobody took the run over, and
    the line says so. Was: the holder wrote it again and went on, as it did when a take-over's holder had finished
    and removed its own (issue 44). Now a holder whose lease is gone stops, and never writes it again."""
    run = tmp_path / "run"
    proc = trainer(char_data, run, steps=100_000, fault="slow:mid_step,lease.HEARTBEAT_S=0.2")
    machines.append(proc)
    wait_for(run / "checkpoints")
    (run / "lease.json").unlink()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, out + err
    assert len(err.strip().splitlines()) == 1, err
    [line] = err.strip().splitlines()
    assert line == (
        f"error: {run / 'lease.json'} was deleted while this process held the run (by someone tidying Drive?), "
        f"and no other process took it over; this process stopped without writing to {run}: re-run to resume"
    )
    assert not (run / "lease.json").exists()


def test_the_lease_of_a_dead_local_process_is_taken_over_at_once(char_data, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "run"
    write_lease(run / "lease.json", host=socket.gethostname(), pid=dead.pid)
    logs = []
    r = train(char_data, run, "phase1", TINY, max_steps=2, progress=False, log=logs.append)
    assert r.step == 2 and any(
        f"pid {dead.pid} on this machine) is gone; taking over" in m for m in logs
    )


def test_a_training_still_running_in_this_process_is_named_as_such(
    char_data, tmp_path, monkeypatch
):
    """A notebook cell run while this kernel still trains the run (a thread, a queued cell): refused in one line
    naming this notebook's own training, not 'another training process'. A lease an earlier call of this process
    left behind (its training over) is taken over."""
    run = tmp_path / "run"
    running = L.RunLease([run]).acquire()  # this process's training, still going
    here = r"run is in use by a training still running in this process \(started \d\d:\d\d:\d\d\): let it finish, "
    kernel = r"run is in use by this notebook's own training, still running in this kernel \(started [\d:]+\): "
    try:
        with pytest.raises(L.RunDirError, match=here + r"or stop it, first$"):
            train(char_data, run, "phase1", TINY, max_steps=2, progress=False, log=quiet)
        # --take-over too: both trainings' writes would pass the same check (fsutil.GUARDS is per directory)
        with pytest.raises(L.RunDirError, match=here + r"or stop it, first$"):
            options = StartOptions(take_over=True)
            train(char_data, run, "phase1", TINY, max_steps=2, progress=False, options=options)
        monkeypatch.setattr(L, "in_notebook", lambda: True)
        with pytest.raises(
            L.RunDirError, match=kernel + r"let it finish, or stop it, then run this cell again$"
        ):
            train(char_data, run, "phase1", TINY, max_steps=2, progress=False, log=quiet)
    finally:
        running.release()
    # left by an earlier call, now over
    write_lease(run / "lease.json", host=socket.gethostname(), pid=os.getpid())
    logs = []
    r = train(char_data, run, "phase1", TINY, max_steps=2, progress=False, log=logs.append)
    left = f"lease: {run / 'lease.json'} was left by an earlier training of this process, which has ended; taking over"
    assert r.step == 2 and left in logs, logs


def test_another_machines_lease(char_data, tmp_path):
    run = tmp_path / "run"
    write_lease(run / "lease.json", heartbeat_age=10)  # fresh: that VM is probably alive
    with pytest.raises(
        L.RunDirError, match=r"in use \(host other-vm, pid 4242.*re-run in \d+ s.*--take-over"
    ):
        train(char_data, run, "phase1", TINY, max_steps=2, progress=False, log=quiet)
    assert sorted(p.name for p in run.iterdir()) == ["lease.json"]  # nothing written
    # stale by this machine's clock: that VM is gone; taken over at once, and said so
    write_lease(run / "lease.json", heartbeat_age=L.STALE_S + 5)
    logs = []
    r = train(char_data, run, "phase1", TINY, max_steps=2, progress=False, log=logs.append)
    assert r.step == 2 and any(
        "is stale (host other-vm" in m and "taking it over" in m for m in logs
    ), logs


def test_a_heartbeat_ahead_of_this_clock_is_fresh(tmp_path):
    """The machines' clocks are assumed to agree within a minute or so (docs/drive.md): a heartbeat ahead of this
    machine's clock is a live holder's, refused at once and named, never written over."""
    run = tmp_path / "run"
    for ahead in (10, 3600):
        write_lease(run / "lease.json", heartbeat_age=-ahead)
        t0 = time.monotonic()
        with pytest.raises(
            L.RunDirError, match=rf"host other-vm.*{ahead} s in the future.*re-run in 180 s"
        ):
            L.RunLease([run], log=quiet).acquire()
        assert time.monotonic() - t0 < 0.5
        assert json.loads((run / "lease.json").read_text())["host"] == "other-vm"


@pytest.mark.parametrize("content", ["{not json", json.dumps({"host": "x"})])
def test_an_unreadable_lease_is_free_only_when_old(char_data, tmp_path, content):
    run = tmp_path / "run"
    run.mkdir()
    (run / "lease.json").write_text(content)
    with pytest.raises(L.RunDirError, match="a lease file that is malformed"):
        train(char_data, run, "phase1", TINY, max_steps=2, progress=False, log=quiet)
    old = time.time() - 1000
    os.utime(run / "lease.json", (old, old))  # as old as a vanished VM's: taken over
    assert train(char_data, run, "phase1", TINY, max_steps=2, progress=False, log=quiet).step == 2


def test_take_over_takes_a_live_lease(char_data, tmp_path):
    run = tmp_path / "run"
    write_lease(run / "lease.json", heartbeat_age=5)
    logs = []
    r = train(
        char_data,
        run,
        "phase1",
        TINY,
        max_steps=2,
        progress=False,
        log=logs.append,
        options=StartOptions(take_over=True),
    )
    assert r.step == 2 and any("lease: taking over" in m and "other-vm" in m for m in logs)
    # a generation above the one taken (none recorded: 0), released at the end, not deleted
    lease = json.loads((run / "lease.json").read_text())
    assert lease["released"] and lease["generation"] == 1 and lease["session"] != "f" * 12


def test_readers_need_no_lease(char_data, tmp_path):
    from gptlib.inference.engine import Engine

    run = tmp_path / "run"
    train(char_data, run, "phase1", TINY, max_steps=10, progress=False, log=quiet)
    write_lease(run / "lease.json", heartbeat_age=1)  # a trainer is at work
    assert Engine.from_run(run).step == 10


def test_a_run_dir_that_cannot_be_written_is_one_clear_error(
    char_data, tmp_path, monkeypatch, capsys
):
    import errno

    from gptlib.__main__ import main

    def read_only(path, obj):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(L, "atomic_write_json", read_only)
    rc = main(
        [
            "train",
            "--data",
            str(char_data),
            "--run-dir",
            str(tmp_path / "run"),
            "--max-steps",
            "2",
            "--quiet",
        ]
    )
    err = capsys.readouterr().err
    assert (
        rc == 2 and err.startswith("error: cannot write to") and "Read-only file system" in err
    ), err
    assert "Traceback" not in err


def test_drive_failing_to_give_the_lease_is_a_drive_failure_not_a_take_over(
    char_data, tmp_path, monkeypatch
):
    """Drive failing to answer (Errno 107) when the mirror's lease is read before a copy was taken for a take-over:
    training stopped with LeaseLost ('taken over by another process (a lease file that is unreadable ...)') at the
    first Drive hiccup. It is a Drive failure: the copy is retried, training goes on, Drive ends with the last
    checkpoint."""
    import errno
    from pathlib import Path

    from gptlib.checkpoint import mirror as M

    lease_on_drive, read_bytes, failed = tmp_path / "drive" / "lease.json", Path.read_bytes, []

    def flaky(path):
        # the checks during training (acquire reads with a time limit, in its own way): the first three fail
        if path == lease_on_drive and len(failed) < 3:
            failed.append(path)
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected", str(path))
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", flaky)
    monkeypatch.setattr(M, "MIRROR_RETRY_DELAYS_S", (0.01,) * 5)
    settings = TINY + ["save_every_steps=5"]
    r = train(
        char_data,
        tmp_path / "run",
        "phase1",
        settings,
        max_steps=10,
        progress=False,
        log=quiet,
        mirror_dir=lease_on_drive.parent,
    )
    assert len(failed) == 3 and r.step == 10 and r.not_on_drive is None
    assert step_of(list_checkpoints(lease_on_drive.parent)[0]) == 10


def test_a_start_whose_mirror_lease_write_hangs_holds_nothing(char_data, tmp_path, monkeypatch):
    """A resume: the run dir's lease written, the mirror's hung. The start stops with one line and holds nothing;
    it kept the run dir's lease (this process's, not released), so the next call in the same kernel was refused ('in
    use by a training still running in this process') until a restart."""
    from gptlib.errors import HungIOError

    drive, write = tmp_path / "drive", L.atomic_write_json
    args = dict(progress=False, log=quiet, mirror_dir=drive)
    train(char_data, tmp_path / "run", "phase1", TINY, max_steps=2, **args)

    def hangs_on_drive(path, body):
        if path.parent == drive:
            raise HungIOError(110, "writing the lease made no progress for 30 s (hung mount?)")
        write(path, body)

    monkeypatch.setattr(L, "atomic_write_json", hangs_on_drive)
    with pytest.raises(HungIOError, match="training did not start and nothing was changed"):
        train(char_data, tmp_path / "run", "phase1", TINY, max_steps=4, **args)
    assert json.loads((tmp_path / "run" / "lease.json").read_text())["released"]
    monkeypatch.setattr(L, "atomic_write_json", write)
    assert train(char_data, tmp_path / "run", "phase1", TINY, max_steps=4, **args).step == 4


def test_a_stop_press_while_the_lease_is_released_leaves_the_kernel_able_to_train(
    char_data, tmp_path, monkeypatch
):
    """The stop button pressed while a finished training marks its Drive lease released (a slow Drive: the cell
    has not ended yet). The next run of the cell in the same kernel resumed nothing: every call said 'in use by this
    notebook's own training, still running in this kernel' until a restart (the interrupted release kept the
    lease among this process's live ones)."""
    drive, write = tmp_path / "drive", L.atomic_write_json
    args = dict(progress=False, log=quiet, mirror_dir=drive)

    def pressed_on_drive(path, body):
        if path.parent == drive and body["released"]:
            raise KeyboardInterrupt  # the press, arriving while the cell waits for Drive's answer
        write(path, body)

    monkeypatch.setattr(L, "atomic_write_json", pressed_on_drive)
    with pytest.raises(KeyboardInterrupt):
        train(char_data, tmp_path / "run", "phase1", TINY, max_steps=2, **args)
    monkeypatch.setattr(L, "atomic_write_json", write)
    logs = []
    r = train(
        char_data, tmp_path / "run", "phase1", TINY, max_steps=4, **{**args, "log": logs.append}
    )
    assert r.resumed_from == 2 and r.step == 4
    assert any(
        "was left by an earlier training of this process, which has ended" in m for m in logs
    ), logs


# --- a holder frozen (SIGSTOP: a paused VM, a process stuck on a hung Drive) while another host takes its run over
# (issue 44). Two "machines" by the hostname knob; a lease stale after 2 s. Before the fix the woken holder wrote the
# lease again ("was deleted ... writing it again") and its checkpoints, config, plot and samples over the new
# holder's run (exit 0), or died on os.replace(loss.png.tmp, loss.png) with a traceback. Seconds each: the
# freezes are faults (tests/faulty.py's stop), not timed.

FROZEN_KNOBS = "lease.HEARTBEAT_S=0.2,lease.STALE_S=1"
FROZEN = TINY + ["save_every_steps=5", "keep_last=2"]


def machine(host, data, run_dir, steps, fault, mirror=None):
    """`python -m gptlib train` as host `host`; fault: where it stops itself (SIGSTOP)."""
    spec = f"hostname={host},{FROZEN_KNOBS},{fault}"
    extra = ("--mirror-dir", mirror) if mirror else ()
    cmd = faulty.train_cmd(spec, data, run_dir, steps, *extra, settings=FROZEN)
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_stopped(proc, timeout=120):
    """Until `proc` has stopped itself (its fault: SIGSTOP)."""
    end = time.time() + timeout
    while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        assert proc.poll() is None, proc.communicate()
        assert time.time() < end, "it never stopped"
        time.sleep(0.05)


@pytest.fixture
def machines():
    """The test's processes, each killed at its end if still there (SIGKILL ends a frozen one too)."""
    started = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.communicate()


def contents(d, visible=False):
    """Every file under d with its sha256, every folder by name: what a write would change. visible: those under
    their final names only (not a writer's work in progress: *.partial-*, *.tmp-*, ...)."""
    return {
        str(p.relative_to(d)): sha256_file(p) if p.is_file() else "dir"
        for p in d.rglob("*")
        if not (visible and any(m in str(p.relative_to(d)) for m in ORPHAN_MARKERS))
    }


@pytest.mark.parametrize(
    "freeze, shared, released",
    [
        ("mid_step@12", "mirror", False),  # frozen between steps; the new holder holds the mirror
        ("save_mid@10", "run dir", False),  # frozen in a save (model.pt written, state.json next)
        ("plot_mid@10", "run dir", False),  # frozen drawing loss.png (its temp file open)
        ("mid_step@12", "mirror", True),  # the repro: the new holder finished and released
    ],
)
def test_a_holder_frozen_through_a_take_over_writes_nothing_when_it_wakes(
    char_data, tmp_path, machines, freeze, shared, released
):
    """vmA freezes; once its lease is stale vmB (another host) takes the run over, resumes and trains on: either it
    stops itself still holding the run, or it finishes and releases it. Then vmA is continued: it must exit 2 with
    one line naming the take-over, and leave every file of the run as vmB left it."""
    mirror = tmp_path / "drive" if shared == "mirror" else None
    a_dir, b_dir = (tmp_path / "a", tmp_path / "b") if mirror else (tmp_path / "run",) * 2
    watched = mirror or a_dir
    vm_a = machine("vmA", char_data, a_dir, 30, f"stop:{freeze}", mirror)
    machines.append(vm_a)
    wait_stopped(vm_a)
    time.sleep(1.2)  # vmA's lease goes stale
    vm_b = machine(
        "vmB",
        char_data,
        b_dir,
        20 if released else 30,
        "" if released else "stop:mid_step@17",
        mirror,
    )
    machines.append(vm_b)
    if released:
        out_b, err_b = vm_b.communicate(timeout=180)
        assert vm_b.returncode == 0, out_b + err_b
    else:
        wait_stopped(vm_b)
    # vmB frozen mid-copy, vmA's work in progress may be left where vmB will clean it up: its visible files
    # are what may not change; once vmB finished and released, every file
    before = contents(watched, visible=not released)
    os.kill(vm_a.pid, signal.SIGCONT)
    out, err = vm_a.communicate(timeout=120)
    assert contents(watched, visible=not released) == before
    assert vm_a.returncode == 2, out + err
    assert "Traceback" not in err and "No such file" not in err
    # one line; a failure shows all that the woken holder said
    assert len(err.strip().splitlines()) == 1, err
    [line] = err.strip().splitlines()
    assert line.startswith(f"error: {watched} was taken over by another process (host vmB"), line
    assert line.endswith("this process stopped without writing to it"), line
    assert ("released" in line) == released, line
    lease = json.loads((watched / "lease.json").read_text())
    assert lease["host"] == "vmB" and lease["generation"] == 2
    if not released:  # vmB goes on as if alone
        os.kill(vm_b.pid, signal.SIGCONT)
        out_b, err_b = vm_b.communicate(timeout=180)
        assert vm_b.returncode == 0, out_b + err_b
    assert step_of(list_checkpoints(watched)[0]) == (20 if released else 30)


@pytest.mark.parametrize("when", ["together", "stale", "set-up"])
def test_a_refused_start_leaves_another_processs_lease(char_data, tmp_path, monkeypatch, when):
    """Two Colab tabs with one RUN_NAME: vmA's lease on the shared mirror lands just after this start wrote its own
    (both started a new run at once; vmA's heartbeat, stale on a slow Drive, landing as this start took over), or
    vmA takes the run over (--take-over) during this start's set-up, which is then refused (a micro-batch bigger than
    RAM). The refused start deleted vmA's lease in a folder both created: vmA stopped at its next beat ('was deleted
    ... by someone tidying Drive?'), and a third start took the run over without a word. (stale: a folder this start
    did not create; its lease was left in place already, never marked released by this start.)"""
    drive, write, real_find_start = tmp_path / "drive", L.atomic_write_json, loop.find_start
    settings = TINY + (["batch_size=100000000"] if when == "set-up" else [])
    if when == "stale":
        write_lease(drive / "lease.json", host="vmA", heartbeat_age=L.STALE_S + 5, session="a" * 12)

    def vm_a_lands_next(path, body):
        write(path, body)
        if path.parent == drive and not body["released"] and when != "set-up":
            write_lease(path, host="vmA", session="a" * 12)

    def vm_a_takes_over(*a, **k):
        write_lease(drive / "lease.json", host="vmA", session="a" * 12)
        return real_find_start(*a, **k)

    monkeypatch.setattr(L, "atomic_write_json", vm_a_lands_next)
    if when == "set-up":
        monkeypatch.setattr(loop, "find_start", vm_a_takes_over)
    args = dict(progress=False, log=quiet, mirror_dir=drive)
    refused = "needs about .* GiB to train" if when == "set-up" else r"taken over .* \(host vmA"
    with pytest.raises(ConfigError if when == "set-up" else L.RunDirError, match=refused):
        train(char_data, tmp_path / "run", "phase1", settings, max_steps=2, device="cpu", **args)
    monkeypatch.undo()
    lease = json.loads((drive / "lease.json").read_text())
    assert lease["session"] == "a" * 12 and not lease.get("released"), lease
    with pytest.raises(L.RunDirError, match=r"in use \(host vmA"):
        train(char_data, tmp_path / "c", "phase1", TINY, max_steps=2, **args)


def test_a_start_refused_by_a_lease_that_appeared_after_it_looked_leaves_it(
    char_data, tmp_path, monkeypatch
):
    """Two tabs start a new run with one RUN_NAME: vmA creates the mirror folder and writes its lease after this
    start looked (no folder yet) and before it read the lease there. This start is refused ('in use'), and its
    clean-up of 'its' new folder deleted vmA's live lease: vmA then stopped ('was deleted ...'), a third start
    took the run over without a word."""
    drive, real = tmp_path / "drive", L._looked_at

    def vm_a_lands_after_the_look(d, what):
        found = real(d, what)
        if d == drive:
            write_lease(drive / "lease.json", host="vmA", session="a" * 12)
        return found

    monkeypatch.setattr(L, "_looked_at", vm_a_lands_after_the_look)
    args = dict(progress=False, log=quiet, mirror_dir=drive)
    with pytest.raises(L.RunDirError, match=r"in use \(host vmA"):
        train(char_data, tmp_path / "run", "phase1", TINY, max_steps=2, device="cpu", **args)
    monkeypatch.undo()
    assert (drive / "lease.json").is_file(), "vmA's live lease was deleted"
    assert json.loads((drive / "lease.json").read_text())["session"] == "a" * 12
    with pytest.raises(L.RunDirError, match=r"in use \(host vmA"):
        train(char_data, tmp_path / "c", "phase1", TINY, max_steps=2, **args)
