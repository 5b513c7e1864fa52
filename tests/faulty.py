"""Fault injection for the tests: gptlib broken at a named point, in this process or in a real subprocess.

    python tests/faulty.py SPEC -- ARGS...     patch gptlib for SPEC, then run `python -m gptlib ARGS...` in-process
    python tests/faulty.py SPEC -- SCRIPT.py ARGS...    the same, running that script (benchmarks/t4_emulate.py)

SPEC is "ITEM,ITEM,..." (empty: no fault). An item "ACTION:POINT[@STEP]" wraps the gptlib function of POINT so that
ACTION happens when execution reaches it (at checkpoint or training step STEP; without @STEP every time):

    ACTION  kill (SIGKILL this process), term (SIGTERM), sigint (SIGINT: the stop button), stop (SIGSTOP: frozen,
            every thread, until a SIGCONT: a VM paused or stuck on a hung Drive), interrupt (raise
            KeyboardInterrupt), enospc / eio / enotconn (raise that OSError), hang (block for an hour),
            slow (sleep 50 ms)
    POINT   mid_step      the step: training.loop.train_step has updated the model, the step counter has not
            save_mid      the write: checkpoint.format writes state.json (model.pt, train_state.pt written, no manifest)
            after_rename  the install: checkpoint.format.install renamed the checkpoint, rotation has not run
            rotate_mid    the deletion: the first file of a checkpoint being deleted (rotation) is gone
            mirror_mid    the copy: checkpoint.mirror.copy_file_verified copied the first file to Drive
            plot_mid      the plot: training.logs draws loss.png (its temp file open, not renamed yet)
            shard_mid     the shard: tokenize has written shard STEP's bytes (train_STEP.bin or val_STEP.bin, and
                          a chat shard's spans file) to its temp file, not yet fsynced or renamed

An item "MODULE.NAME=NUMBER" sets a module constant of gptlib first, e.g. "lease.HEARTBEAT_S=0.2"; "hostname=NAME"
makes this process's host NAME (the lease's: two "machines" on one); "backend=NAME" compiles with torch.compile's
backend NAME (tests/test_gpu.py on a CPU: aot_eager).
In a test: `install(spec, monkeypatch.setattr)`, or `undo = install(spec)` ... `undo()`.
"""

from __future__ import annotations

import errno
import functools
import importlib
import os
import pathlib
import runpy
import signal
import socket
import sys
import time
from typing import Callable

_ERRNO = {"enospc": errno.ENOSPC, "eio": errno.EIO, "enotconn": errno.ENOTCONN}
_SIGNAL = {
    "kill": signal.SIGKILL,
    "term": signal.SIGTERM,
    "sigint": signal.SIGINT,
    "stop": signal.SIGSTOP,
}
# kill: the signal arrives asynchronously; never run past it
_SLEEP_S = {
    "kill": 10,
    "hang": 3600,
    "slow": 0.05,
}
FAULTY = pathlib.Path(__file__).resolve()


def act(action: str, where: str) -> None:
    if action in _SIGNAL:
        os.kill(os.getpid(), _SIGNAL[action])
    if action == "interrupt":
        raise KeyboardInterrupt(f"fault {action}:{where}")
    if action in _ERRNO:
        raise OSError(_ERRNO[action], os.strerror(_ERRNO[action]))
    if action in _SLEEP_S:
        time.sleep(_SLEEP_S[action])
    elif action not in _SIGNAL:
        raise ValueError(
            f"fault action {action!r}: one of kill, term, sigint, stop, interrupt, enospc, eio, "
            f"enotconn, hang, slow"
        )


def _patches(point: str, fire: Callable[[int | None], None]) -> list[tuple[object, str, object]]:
    """(owner, attribute, wrapper) that make execution reaching POINT call fire(step)."""
    from gptlib.checkpoint import format as ck
    from gptlib.checkpoint import mirror
    from gptlib.data import shards
    from gptlib.layout import DELETING_MARKER, STATE_FILE, step_of
    from gptlib.training import logs, loop

    if point == "mid_step":
        runs = []  # the TrainingRun being trained: its state says which step the loop is making

        def build_run(*a, real=loop.build_run, **k):
            runs.append(real(*a, **k))
            return runs[-1]

        def train_step(*a, real=loop.train_step, **k):
            loss = real(*a, **k)
            fire(runs[-1].state.step + 1)
            return loss

        return [(loop, "build_run", build_run), (loop, "train_step", train_step)]
    if point == "save_mid":

        def write_hashed(path, content, real=ck.write_hashed):
            if pathlib.Path(path).name == STATE_FILE:
                fire(step_of(pathlib.Path(path).parent))
            return real(path, content)

        return [(ck, "write_hashed", write_hashed)]
    if point == "after_rename":

        def install(partial, final, *a, real=ck.install, **k):
            real(partial, final, *a, **k)
            fire(step_of(final))

        return [(ck, "install", install)]
    if point == "rotate_mid":

        def unlink(self, *a, real=pathlib.Path.unlink, **k):
            real(self, *a, **k)
            if DELETING_MARKER in self.parent.name:
                fire(step_of(self.parent))

        return [(pathlib.Path, "unlink", unlink)]
    if point == "mirror_mid":

        def copy_file_verified(src, dst, *a, real=mirror.copy_file_verified, **k):
            real(src, dst, *a, **k)
            fire(step_of(pathlib.Path(dst).parent))

        return [(mirror, "copy_file_verified", copy_file_verified)]
    if point == "plot_mid":

        def loss_figure(rows, *a, real=logs.loss_figure, **k):
            fire(rows[-1]["step"] if rows else None)
            return real(rows, *a, **k)

        return [(logs, "loss_figure", loss_figure)]
    if point == "shard_mid":

        def atomic_write(path, write, real=shards.atomic_write):
            def then_fire(f):
                write(f)
                f.flush()
                fire(int(pathlib.Path(path).name.split("_")[1][:6]))  # train_000003.bin: 3

            return real(path, then_fire)

        return [(shards, "atomic_write", atomic_write)]
    raise ValueError(
        f"fault point {point!r}: one of mid_step, save_mid, after_rename, rotate_mid, mirror_mid, plot_mid, "
        f"shard_mid"
    )


def install(
    spec: str, setattr_: Callable[[object, str, object], None] | None = None
) -> Callable[[], None]:
    """Patch gptlib for SPEC (see the module docstring) with setattr_ (e.g. pytest's monkeypatch.setattr, which undoes
    it itself), else with setattr; -> a function that undoes what it patched."""
    done: list[tuple[object, str, object]] = []

    def patch(owner, name, value):
        if setattr_ is not None:
            setattr_(owner, name, value)
        else:
            done.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

    for item in filter(None, (i.strip() for i in spec.split(","))):
        if item.startswith("hostname="):
            name = item.partition("=")[2]
            patch(socket, "gethostname", lambda name=name: name)
            continue
        if item.startswith("backend="):
            import torch

            compile_ = functools.partial(torch.compile, backend=item.partition("=")[2])
            patch(torch, "compile", compile_)
            continue
        if "=" in item:
            target, _, value = item.partition("=")
            module, _, name = target.rpartition(".")
            patch(importlib.import_module(f"gptlib.{module}"), name, float(value))
            continue
        action, _, rest = item.partition(":")
        point, _, at = rest.partition("@")

        def fire(step, action=action, at=at, item=item):
            if not at or step == int(at):
                act(action, item)

        for owner, name, wrapper in _patches(point, fire):
            patch(owner, name, wrapper)

    def undo():
        for owner, name, old in reversed(done):
            setattr(owner, name, old)
        done.clear()

    return undo


def gptlib_cmd(fault: str | None, *args: str) -> list[str]:
    """The command line of `python -m gptlib ARGS...` (of `python SCRIPT.py ARGS...` where the first is a script),
    through this launcher when there is a fault."""
    args = [str(a) for a in args]
    if fault:
        return [sys.executable, str(FAULTY), fault, "--", *args]
    if args and args[0].endswith(".py"):
        return [sys.executable, *args]
    return [sys.executable, "-m", "gptlib", *args]


def train_cmd(fault: str | None, data, run_dir, steps: int, *extra, settings=()) -> list[str]:
    """`python -m gptlib train` of phase1 on the CPU, quiet, for `steps` steps: the kill and resume tests' run."""
    cmd = gptlib_cmd(
        fault,
        "train",
        "--data",
        data,
        "--run-dir",
        run_dir,
        "--preset",
        "phase1",
        "--max-steps",
        steps,
        "--device",
        "cpu",
        "--quiet",
        *extra,
    )
    for s in settings:
        cmd += ["--set", s]
    return cmd


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        sys.exit("usage: python tests/faulty.py SPEC -- ARGS...  (see its docstring)")
    install(sys.argv[1])
    if sys.argv[3:4] and sys.argv[3].endswith(".py"):
        sys.argv = sys.argv[3:]
        runpy.run_path(sys.argv[0], run_name="__main__")
        sys.exit(0)
    from gptlib.__main__ import run

    sys.exit(run(sys.argv[3:], detach=True))
