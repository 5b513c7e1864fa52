"""One writer per run: a lease on the run directory and Drive mirror names its holder to a second process, which
refuses; a holder that is gone (dead pid here, heartbeat older than STALE_S) is taken over, --take-over takes any. A
holder whose lease was taken stops without writing: check() runs before every checkpoint write."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections import namedtuple
from contextlib import suppress
from pathlib import Path

from gptlib.errors import LeaseLost, RunDirError, in_notebook, loud
from gptlib.fsutil import (
    HungIOError,
    atomic_write_json,
    call_with_timeout,
    cannot_write,
    read_bytes_with_timeout,
)
from gptlib.layout import LEASE_FILE

HEARTBEAT_S = 30.0  # the holder rewrites its lease this often
STALE_S = 180.0  # a heartbeat older than this (by our clock) is a holder that is gone: its lease is taken over
IO_TIMEOUT_S = 30.0  # reading or writing a lease on a hung Drive gives up after this

Holder = namedtuple("Holder", "host pid session started heartbeat")  # what a lease file says
# the sessions of this process's leases not released yet: its trainings still running
_LIVE: set[str] = set()


def _describe(found: Holder | str, now: float) -> str:
    if not isinstance(found, Holder):
        return f"a lease file that is {found}"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(found.started))
    age = now - found.heartbeat
    when = f"{age:.0f} s ago" if age >= 0 else f"{-age:.0f} s in the future"
    return f"host {found.host}, pid {found.pid}, started {started}, last heartbeat {when} by this machine's clock"


def _read(path: Path) -> Holder | str | None:
    """-> the Holder, None (no lease), or why it cannot be read; HungIOError on a hung Drive."""
    try:
        d = json.loads(read_bytes_with_timeout(path, IO_TIMEOUT_S))
        return Holder(
            str(d["host"]),
            int(d["pid"]),
            str(d["session"]),
            float(d["started"]),
            float(d["heartbeat"]),
        )
    except FileNotFoundError:
        return None
    except HungIOError:
        raise
    except (OSError, UnicodeDecodeError) as e:
        return f"unreadable ({e})"
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"malformed ({type(e).__name__}: {e})"


class RunLease:
    def __init__(self, dirs: list[Path | None], take_over: bool = False, log=print):
        self.dirs = [Path(d) for d in dirs if d is not None]
        self.take_over, self.log = take_over, log
        self.session = uuid.uuid4().hex[:12]
        self.host = socket.gethostname()
        self.started = time.time()
        self.lost: str | None = None  # set when another session took over: why
        self._held: list[Path] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> "RunLease":
        """RunDirError naming the holder, before anything is written."""
        for d in self.dirs:
            self._check_free(d / LEASE_FILE)
        for d in self.dirs:
            try:
                d.mkdir(parents=True, exist_ok=True)
                self._write(d / LEASE_FILE)
            except HungIOError:
                raise
            except OSError as e:
                # the first write to the run dir: say what is wrong with it, not a traceback
                self.release()
                raise cannot_write(d, e) from None
            self._held.append(d)
            _LIVE.add(self.session)
        # two starters that wrote at the same moment: the last write wins, the other sees it
        time.sleep(0.05)
        for d in self._held:
            self._check_ours(d / LEASE_FILE, on_lost=RunDirError)
        self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="gptlib-lease")
        self._thread.start()
        return self

    def _check_free(self, path: Path) -> None:
        found = _read(path)
        if found is None:
            return
        now = time.time()
        what = _describe(found, now)
        if self.take_over:
            self.log(f"lease: taking over {path} ({what})")
            return
        how = (
            "pass --take-over (train(..., options=StartOptions(take_over=True))) to take it anyway, or stop that "
            "process first"
        )
        if isinstance(found, Holder) and found.host == self.host and found.pid == os.getpid():
            started = time.strftime("%H:%M:%S", time.localtime(found.started))
            # a training of this very process: a notebook cell run while one trains
            if found.session in _LIVE:
                raise RunDirError(
                    f"{path.parent} is in use by this notebook's own training, still running in this kernel "
                    f"(started {started}): let it finish, or stop it, then run this cell again"
                    if in_notebook()
                    else f"{path.parent} is in use by a training still running in this process (started {started}): "
                    f"let it finish, or stop it, first"
                )
            self.log(
                f"lease: {path} was left by an earlier training of this process, which has ended; taking over"
            )
            return
        if isinstance(found, Holder) and found.host == self.host:
            try:
                os.kill(found.pid, 0)
            except ProcessLookupError:
                self.log(
                    f"lease: the previous holder of {path} (pid {found.pid} on this machine) is gone; taking over"
                )
                return
            except PermissionError:  # alive, another user's
                pass
            raise RunDirError(
                f"{path.parent} is in use by another training process ({what}); {how}"
            )
        age = now - (
            found.heartbeat
            if isinstance(found, Holder)
            else call_with_timeout(
                lambda: path.stat().st_mtime, IO_TIMEOUT_S, what=f"reading {path}"
            )
        )
        if age < STALE_S:
            raise RunDirError(
                f"{path.parent} is in use ({what}); if that VM is gone, re-run in "
                f"{STALE_S - max(age, 0.0):.0f} s and the lease is taken over, or {how}"
            )
        self.log(
            f"lease: {path} is stale ({what}; over {STALE_S:.0f} s old: its holder is gone); taking it over"
        )

    def _write(self, path: Path) -> None:
        body = {
            "host": self.host,
            "pid": os.getpid(),
            "session": self.session,
            "started": self.started,
            "heartbeat": time.time(),
        }
        call_with_timeout(
            lambda: atomic_write_json(path, body), IO_TIMEOUT_S, what=f"writing {path}"
        )

    def _check_ours(self, path: Path, on_lost=LeaseLost) -> None:
        found = _read(path)
        if isinstance(found, Holder) and found.session == self.session:
            return
        # deleted (someone tidying Drive): a taker would have written one
        if found is None and on_lost is LeaseLost:
            loud(f"lease: {path} was deleted while this process holds the run; writing it again")
            self._write(path)
            return
        self.lost = (
            f"{path.parent} was taken over by another process ({_describe(found, time.time())})"
        )
        raise on_lost(self.lost + "; this process stopped without writing to it")

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            for d in self._held:
                try:
                    self._check_ours(d / LEASE_FILE)
                    self._write(d / LEASE_FILE)
                except LeaseLost:
                    loud(f"!! {self.lost}: training stops without saving")
                    return
                # a hung or failing Drive: skip this beat (the mirror reports Drive trouble)
                except OSError:
                    pass

    def check(self, directory: Path | None = None) -> None:
        """LeaseLost if the lease was taken over: re-read now for `directory`, else the last heartbeat's verdict."""
        if self.lost is not None:
            raise LeaseLost(self.lost + "; this process stopped without writing to it")
        if directory is not None and Path(directory) in self._held:
            self._check_ours(Path(directory) / LEASE_FILE)

    def release(self) -> None:
        """Remove the lease files that are still ours (never another holder's)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            # a beat being written now must not re-create a file removed below
            self._thread.join(IO_TIMEOUT_S)
        for d in self._held:
            with suppress(OSError):  # a hung Drive: the lease goes stale on its own
                found = _read(d / LEASE_FILE)
                if isinstance(found, Holder) and found.session == self.session:
                    (d / LEASE_FILE).unlink(missing_ok=True)
        self._held = []
        _LIVE.discard(self.session)
