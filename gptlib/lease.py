"""One writer per run: a lease on the run directory and Drive mirror names its holder to a second process, which
refuses; a holder that is gone (dead pid here, heartbeat older than STALE_S) is taken over, --take-over takes any.
Each holder's lease carries a generation one above the one it found, and a release marks the lease released: the file
is never deleted, so a holder frozen for minutes (a hung Drive, a paused VM) that wakes reads that it was taken over.
Every rename, removal and append in the leased directories asks check() first (fsutil.check_writable): a lease that is
not this process's any more (taken over, released by the next holder, deleted) stops it with LeaseLost, one line,
before that write lands."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections import namedtuple
from contextlib import contextmanager, suppress
from functools import partial
from pathlib import Path

from gptlib.errors import LeaseLost, RunDirError, in_notebook
from gptlib.fsutil import (
    DRIVE_ADVICE,
    GUARDS,
    HungIOError,
    atomic_write_json,
    call_with_timeout,
    cannot_write,
    check_dir,
    read_bytes_with_timeout,
)
from gptlib.layout import CONFIG_FILE, LEASE_FILE, META_FILE, PREPARE_STATE_FILE, checkpoints_dir

# what a data directory (tokenize) or an export (export-hf, push --dry-run) holds and a run never does
NOT_A_RUN = (META_FILE, PREPARE_STATE_FILE, "model.safetensors")

HEARTBEAT_S = 30.0  # the holder rewrites its lease this often
STALE_S = 180.0  # a heartbeat older than this (by our clock) is a holder that is gone: its lease is taken over
IO_TIMEOUT_S = 30.0  # reading or writing a lease on a hung Drive gives up after this

# what a lease file says; released: when its holder ended (None: it holds the run)
Holder = namedtuple("Holder", "host pid session started heartbeat generation released")
# the sessions of this process's leases not released yet: its trainings still running
_LIVE: set[str] = set()


def _describe(found: Holder | str, now: float) -> str:
    if not isinstance(found, Holder):
        return f"a lease file that is {found}"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(found.started))
    age = now - (found.released or found.heartbeat)
    when = f"{age:.0f} s ago" if age >= 0 else f"{-age:.0f} s in the future"
    beat = f"released {when}" if found.released else f"last heartbeat {when}"
    return (
        f"host {found.host}, pid {found.pid}, lease generation {found.generation}, started {started}, {beat} by "
        f"this machine's clock" + (": its training ended" if found.released else "")
    )


def _read(path: Path, timeout: float | None) -> Holder | str | None:
    """-> the Holder, None (no lease), or what is wrong with its contents. A file that cannot be read raises its
    OSError (HungIOError on a hung Drive): Drive failing to answer says nothing of who holds the run (timeout None: a
    plain read, for a caller that runs under a watchdog of its own or on the local disk)."""
    try:
        raw = path.read_bytes() if timeout is None else read_bytes_with_timeout(path, timeout)
    except FileNotFoundError:
        return None
    try:
        d = json.loads(raw)
        return Holder(
            str(d["host"]),
            int(d["pid"]),
            str(d["session"]),
            float(d["started"]),
            float(d["heartbeat"]),
            int(d.get("generation", 0)),
            d.get("released") and float(d["released"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"malformed ({type(e).__name__}: {e})"


def _held_by_this_process(path: Path, found: Holder) -> RunDirError:
    started = time.strftime("%H:%M:%S", time.localtime(found.started))
    if in_notebook():
        return RunDirError(
            f"{path.parent} is in use by this notebook's own training, still running in this kernel (started "
            f"{started}): let it finish, or stop it, then run this cell again"
        )
    return RunDirError(
        f"{path.parent} is in use by a training still running in this process (started {started}): let it "
        f"finish, or stop it, first"
    )


def _held_by_another(
    path: Path, found: Holder | str, now: float, stale_in: float | None = None
) -> RunDirError:
    what = _describe(found, now)
    how = (
        "pass --take-over (train(..., options=StartOptions(take_over=True))) to take it anyway, or stop that "
        "process first"
    )
    if stale_in is None:
        return RunDirError(f"{path.parent} is in use by another training process ({what}); {how}")
    return RunDirError(
        f"{path.parent} is in use ({what}); if that VM is gone, re-run in {stale_in:.0f} s and the lease is taken "
        f"over, or {how}"
    )


class RunLease:
    def __init__(self, dirs: list[Path | None], take_over: bool = False, log=print):
        # absolute: fsutil.check_writable hands check() the directory so
        self.dirs = [Path(os.path.abspath(d)) for d in dirs if d is not None]
        self.take_over, self.log = take_over, log
        self.session = uuid.uuid4().hex[:12]
        self.host = socket.gethostname()
        self.started = time.time()
        self.generation = 0  # one above the highest found at acquire
        self.lost: str | None = None  # set when the lease stopped being this process's: why
        self._held: list[Path] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> "RunLease":
        """RunDirError naming the holder, before anything is written."""
        self.generation = 1 + max([self._check_free(d / LEASE_FILE) for d in self.dirs], default=0)
        try:
            for d in self.dirs:
                try:
                    d.mkdir(parents=True, exist_ok=True)
                    self._write(d / LEASE_FILE)
                except HungIOError:
                    raise
                except OSError as e:
                    # the first write to the run dir: say what is wrong with it, not a traceback
                    raise cannot_write(d, e) from None
                self._held.append(d)
                _LIVE.add(self.session)
            # two starters that wrote at the same moment: the last write wins, the other sees it
            time.sleep(0.05)
            for d in self._held:
                self._check_ours(d / LEASE_FILE, on_lost=RunDirError, timeout=IO_TIMEOUT_S)
        # a start that fails here (the mirror's lease write hung, say) holds nothing: what it wrote is released
        except BaseException:
            self.release()
            raise
        GUARDS.update({str(d): self.check for d in self._held})
        self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="gptlib-lease")
        self._thread.start()
        return self

    def _check_free(self, path: Path) -> int:
        """-> the generation found there (0: none); RunDirError if another process holds it."""
        try:
            found = _read(path, IO_TIMEOUT_S)
        except HungIOError:
            raise
        # judged by its age below, as a lease that cannot be parsed is
        except OSError as e:
            found = f"unreadable ({e})"
        generation = found.generation if isinstance(found, Holder) else 0
        if found is None or isinstance(found, Holder) and found.released:
            return generation
        now = time.time()
        here = isinstance(found, Holder) and found.host == self.host
        # a training of this very process: a notebook cell run while one trains (--take-over too: its writes and
        # this one's would pass the same check, gptlib.fsutil.GUARDS)
        if here and found.pid == os.getpid():
            if found.session in _LIVE:
                raise _held_by_this_process(path, found)
            self.log(
                f"lease: {path} was left by an earlier training of this process, which has ended; taking over"
            )
            return generation
        if self.take_over:
            self.log(f"lease: taking over {path} ({_describe(found, now)})")
            return generation
        if here:
            try:
                os.kill(found.pid, 0)
            except ProcessLookupError:
                self.log(
                    f"lease: the previous holder of {path} (pid {found.pid} on this machine) is gone; taking over"
                )
                return generation
            except PermissionError:  # alive, another user's
                pass
            raise _held_by_another(path, found, now)
        if isinstance(found, Holder):
            beat = found.heartbeat
        else:
            beat = call_with_timeout(
                lambda: path.stat().st_mtime, IO_TIMEOUT_S, what=f"reading {path}"
            )
        if (age := now - beat) < STALE_S:
            raise _held_by_another(path, found, now, stale_in=STALE_S - max(age, 0.0))
        self.log(
            f"lease: {path} is stale ({_describe(found, now)}; over {STALE_S:.0f} s old: its holder is gone); "
            f"taking it over"
        )
        return generation

    def _write(self, path: Path, released: bool = False) -> None:
        """Once acquired, fsutil asks check() just before the rename: never over another holder's lease."""
        body = {
            "host": self.host,
            "pid": os.getpid(),
            "session": self.session,
            "started": self.started,
            "heartbeat": time.time(),
            "generation": self.generation,
            "released": time.time() if released else None,
        }
        write = partial(atomic_write_json, path, body)
        call_with_timeout(write, IO_TIMEOUT_S, what=f"writing {path}")

    def _check_ours(self, path: Path, on_lost=LeaseLost, timeout: float | None = None) -> None:
        found = _read(path, timeout)
        if isinstance(found, Holder) and found.session == self.session and not found.released:
            return
        # a taker always leaves its own lease there (a newer generation): a missing one was deleted by hand
        self.lost = (
            f"{path} was deleted while this process held the run (by someone tidying Drive?), and no other process "
            f"took it over; this process stopped without writing to {path.parent}: re-run to resume"
            if found is None
            else f"{path.parent} was taken over by another process ({_describe(found, time.time())}); this "
            f"process stopped without writing to it"
        )
        raise on_lost(self.lost)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            for d in self._held:
                try:
                    self._write(d / LEASE_FILE)
                # self.lost says why: the loop and the writers stop at their next check, one line
                except LeaseLost:
                    return
                # a hung or failing Drive: skip this beat (the mirror reports Drive trouble)
                except OSError:
                    pass

    def check(self, directory: Path | None = None) -> None:
        """LeaseLost once the lease is not this process's: for `directory` its lease file read now, else the last
        heartbeat's verdict (a directory lost means all are: the process stops writing). The read has no watchdog
        thread of its own: writes into the run dir are local, and every write into the Drive mirror runs under the
        mirror's watchdog."""
        if self.lost is not None:
            raise LeaseLost(self.lost)
        if directory is not None and Path(directory) in self._held:
            self._check_ours(Path(directory) / LEASE_FILE)

    def release(self) -> None:
        """Mark the leases still ours released (never another holder's, nor any once one was lost); the file stays,
        for a holder frozen before this one took over to read."""
        self._stop.set()
        # a stop press while Drive is slow to answer: this process's training is over all the same (its lease left
        # unreleased is taken over by the next call here, not named as one still running in this kernel)
        try:
            if self._thread is not None and self._thread is not threading.current_thread():
                # a beat being written now must not follow the release (one abandoned on a hung Drive may still land:
                # that lease then goes stale in STALE_S)
                self._thread.join(IO_TIMEOUT_S)
            for d in self._held if self.lost is None else []:
                with suppress(OSError, LeaseLost):  # a hung Drive: the lease goes stale on its own
                    self._write(d / LEASE_FILE, released=True)
        finally:
            for d in self._held:
                GUARDS.pop(str(d), None)
            self._held = []
            _LIVE.discard(self.session)


@contextmanager
def claimed(run_dir: Path, mirror_dir: Path | None, is_main: bool, take_over: bool, log):
    """The run's lease, taken before anything in run_dir or the mirror changes. A set-up refused inside the block
    releases it and removes the directories it created (if still empty); otherwise the loop releases it."""
    # a lease on no directory (never acquired) checks and releases nothing: the other DDP ranks'
    created, lease = [], RunLease([])
    try:
        if is_main:  # the other DDP ranks write nothing
            try:
                for d, what in ((run_dir, "run directory"), (mirror_dir, "mirror directory")):
                    # Drive may hang
                    if d is not None and not call_with_timeout(
                        partial(_looked_at, d, what), IO_TIMEOUT_S, what=f"looking at {d}"
                    ):
                        created.append(d)
                lease = RunLease([run_dir, mirror_dir], take_over, log)
                lease.acquire()
            except HungIOError as e:  # Drive did not answer: its lease may be another process's
                raise HungIOError(
                    e.errno,
                    f"{e.strerror}: training did not start and nothing was changed; {DRIVE_ADVICE}",
                ) from None
        yield lease
    except BaseException:
        lease.release()
        # only this call's own lease goes: another's may be there (it made the folder too, after the look or at
        # once, or took over)
        for d in created:
            with suppress(OSError):
                if getattr(_read(d / LEASE_FILE, IO_TIMEOUT_S), "session", None) == lease.session:
                    (d / LEASE_FILE).unlink()
            for empty in (checkpoints_dir(d), d):
                with suppress(OSError):
                    empty.rmdir()
        raise


def _looked_at(d: Path, what: str) -> bool:
    """Whether d exists; a file or a symlink loop there is one line now, not a traceback at the first save; a dataset
    or an export there is refused, and a config.json that is not a run's (training would write its config.json and
    tokenizer.json over theirs)."""
    exists = check_dir(d, what)
    if exists:
        check_dir(checkpoints_dir(d), f"{what}'s checkpoints folder")
        if held := [n for n in NOT_A_RUN if (d / n).exists()]:
            raise RunDirError(
                f"{what} {d} holds {held[0]}: it is a gptlib dataset or exported model, not a run; choose another "
                f"folder for the run"
            )
        if not _a_run_config(d / CONFIG_FILE):
            raise RunDirError(
                f"{what} {d} holds {CONFIG_FILE}, which is not a gptlib run's (no model and train sections): "
                f"training would write its own over it; move it, or choose another folder"
            )
    return exists


def _a_run_config(path: Path) -> bool:
    """Whether a run may write its config.json there: none yet, or a run's (RunConfig.to_dict: a JSON object with model
    and train sections in every gptlib version; which fields they hold changed)."""
    try:
        config = json.loads(path.read_bytes())
    except FileNotFoundError:
        return True
    except ValueError:  # not JSON (UnicodeDecodeError is a ValueError too)
        return False
    return isinstance(config, dict) and all(
        isinstance(config.get(k), dict) for k in ("model", "train")
    )
