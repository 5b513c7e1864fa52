"""The Drive mirror: each local checkpoint copied to Google Drive in a background thread (its bytes checked against
its manifest as they are read), so the run survives the VM. Drive errors (Errno 107, Errno 5) are retried and reported
loudly, never raised into training; a call that hangs is given up by watch(), which the training loop calls at its log
steps (the thread is left in the mount, a new one retries). If copies fall behind, only the newest checkpoint is
copied, then every milestone."""

from __future__ import annotations

import errno
import os
import threading
import time
import uuid
from contextlib import suppress
from functools import partial
from pathlib import Path
from typing import Any, Callable, NamedTuple

from gptlib.checkpoint.format import (
    check_file,
    install,
    list_checkpoints,
    marked_milestone,
    read_manifest,
    remove_tree,
    rotate,
    verify_checkpoint,
)
from gptlib.errors import CheckpointError, HungIOError, LeaseLost, loud
from gptlib.fsutil import (
    Progress,
    atomic_write_bytes,
    call_with_timeout,
    check_writable,
    clean_temp_files,
    copy_hashing,
    copy_rows,
    fsync_dir,
)
from gptlib.layout import (
    EVAL_FILE,
    MANIFEST_FILE,
    MIRRORED_FILES,
    PARTIAL_MARKER,
    checkpoints_dir,
    step_of,
)
from gptlib.lease import IO_TIMEOUT_S

MIRROR_RETRY_DELAYS_S = (2.0, 5.0, 15.0, 30.0, 60.0)  # waits between attempts for one checkpoint
# an attempt with no progress for this long is a hung Drive: abandoned
MIRROR_STALL_TIMEOUT_S = 180.0
# at the end of training, wait at most this long for the last Drive copy
MIRROR_CLOSE_TIMEOUT_S = 600.0
# rotating the mirror and copying the run's logs there: give up after this
MIRROR_TIDY_TIMEOUT_S = 60.0
MIRROR_WAIT_REPORT_S = 30.0  # while waiting at the end, say how far the copy got this often
MIRROR_WATCH_S = 1.0  # while waiting at the end, look for a hung Drive call this often
NO_MIRROR_STATUS = dict(mirror_step=None, mirror_error=None, mirror_failures=0, mirror_missing=None)


def copy_file_verified(src: Path, dst: Path, size: int, sha256: str, progress: Progress) -> None:
    """CheckpointError if the bytes read are not the manifest's: src is damaged, not a Drive that failed to answer."""
    check_file(src, copy_hashing(src, dst, progress), size, sha256)


def mirror_checkpoint(
    src: Path, mirror_run_dir: Path, progress: Progress | None = None, reuse: bool = True
) -> Path:
    """Copied under a temp name, manifest last, then renamed; nothing is read back. reuse: keep a copy already there
    with the same manifest (not at resume: it may be a damaged one)."""
    progress = progress or Progress()
    # another process took the run over: copy nothing into its directory (under the caller's watchdog: a Drive read)
    check_writable(mirror_run_dir)
    manifest = read_manifest(src)
    dst_root = checkpoints_dir(mirror_run_dir)
    dst_root.mkdir(parents=True, exist_ok=True)
    final = dst_root / src.name
    if reuse and final.is_dir():
        with suppress(CheckpointError, OSError):  # a damaged copy: replaced below
            if verify_checkpoint(final).manifest.get("files") == manifest["files"]:
                return final  # already there (e.g. the checkpoint we resumed from)
    partial = dst_root / f"{src.name}{PARTIAL_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    partial.mkdir()
    try:
        for name, rec in manifest["files"].items():
            copy_file_verified(src / name, partial / name, rec["size"], rec["sha256"], progress)
        copy_hashing(src / MANIFEST_FILE, partial / MANIFEST_FILE, progress)
        fsync_dir(partial)
        verify_checkpoint(partial)  # sizes only: what the copy wrote was hashed as it was read
        progress.tick()
    except BaseException:
        # best effort (Drive may be gone); leftovers are removed by the next rotation
        with suppress(OSError):
            remove_tree(partial, truncate=True)
        raise
    install(partial, final, truncate=True)
    return final


class _Call(NamedTuple):
    """A Drive call in flight in the mirror's thread, for watch() to give up."""

    path: Path  # the checkpoint copied (or, attempt None, cleaned up after)
    progress: Progress  # ticked as the call goes; cancelled when given up
    limit: float  # given up after this many seconds without a tick
    attempt: int | None  # the copy's attempt (1, 2, ...); None: the clean-up after a copy


class _Abandoned(BaseException):
    """The mirror thread's Drive call was given up by watch(): the thread ends, changing nothing."""


class Mirror:
    def __init__(
        self,
        run_dir: Path,
        mirror_dir: str | Path,
        keep_last: int,
        keep_every: int,
        unreadable: set[Path] = frozenset(),
        listed_step: int | None = None,
    ):
        self.run_dir, self.mirror_dir = run_dir, Path(mirror_dir)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.unreadable = unreadable  # checkpoints that could not be read at resume: never deleted
        self.listed_step = listed_step  # the newest step listed on the mirror at resume
        self.last_step: int | None = None  # newest step copied
        self.error: str | None = None  # the last failure, until a copy succeeds
        self.failures = 0
        self.lost = False  # another process took the mirror over: this one copies nothing more, says nothing
        self._cv = threading.Condition()  # guards what follows
        # newest local checkpoint not yet copied (a newer one replaces it)
        self._pending: Path | None = None
        self._newest: int | None = None  # the newest step given to copy: Drive must end with it
        self._milestones: list[Path] = []  # not yet copied, oldest first, copied after _pending
        self._milestones_paused = False  # after a failed copy, until the next checkpoint
        self._best_step: int | None = None  # what mirror rotation must keep
        self._busy: Path | None = None
        self._closing = False
        # the copy attempt now: its checkpoint, progress and size in MB (None: none started yet)
        self._attempt: tuple[Path, Progress, float] | None = None
        self._call: _Call | None = None  # the Drive call in flight, watched by watch()
        self._next_attempt: dict[Path, int] = {}  # a checkpoint whose copy hung: its next attempt
        self._hung: _Call | None = None  # the call watch() gave up, for the thread that takes over
        self._thread: threading.Thread | None = None

    def submit(self, path: Path, best_step: int | None, milestone: bool) -> set[Path]:
        """A new local checkpoint -> the checkpoints rotation must not delete yet (pending, busy)."""
        with self._cv:
            self._best_step = best_step
            self._pending = path
            self._newest = max(step_of(path), self._newest or 0)
            self._milestones_paused = False
            if milestone:
                self._milestones.append(path)
            self._wake()
            return {p for p in (self._busy, self._pending) if p is not None}

    def queue_existing(self, path: Path, best_step: int | None) -> None:
        """A checkpoint resumed from locally, and the local milestones (those already on the mirror are kept)."""
        milestones = [p for p in reversed(list_checkpoints(self.run_dir)) if marked_milestone(p)]
        with self._cv:
            if self._best_step is None:
                self._best_step = best_step
            if self._pending is None or step_of(self._pending) < step_of(path):
                self._pending = path
            self._newest = max(step_of(path), self._newest or 0)
            self._milestones += [p for p in milestones if p not in self._milestones]
            self._wake()

    def _wake(self) -> None:  # holding _cv
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, daemon=True, name="gptlib-mirror")
            self._thread.start()
        self._cv.notify_all()

    def _has_work(self) -> bool:  # holding _cv
        return self._pending is not None or bool(self._milestones) and not self._milestones_paused

    def _loop(self) -> None:
        while True:
            with self._cv:
                hung, self._hung = self._hung, None
            if hung is not None and self._after_hang(hung) == "lost":
                return
            with self._cv:
                self._cv.wait_for(lambda: self._has_work() or self._closing)
                if self._pending is not None:  # the newest first, then the milestones
                    path, self._pending = self._pending, None
                elif self._has_work():
                    path = self._milestones[0]
                else:
                    return
                self._busy = path
            try:
                outcome = self._copy_with_retries(path)
            except _Abandoned:
                return  # watch() gave this thread up as hung and started another, which goes on
            if outcome == "lost":
                return
            self._done(path, outcome)

    def _done(self, path: Path, outcome: str) -> None:
        with self._cv:
            if outcome == "copied":
                self._milestones = [m for m in self._milestones if m != path]
            # Drive is failing: milestones wait for the next save, not a loop
            elif outcome == "failed":
                self._milestones_paused = True
            self._busy = None
            self._cv.notify_all()

    def _copy_with_retries(self, path: Path) -> str:
        """-> "copied", "failed" (gave up), "superseded" (a newer checkpoint arrived during a retry wait) or "lost"
        (the lease: another process owns the mirror now, never written over; training stops with LeaseLost). Raises
        _Abandoned once watch() has given a Drive call up as hung."""
        step = step_of(path)
        with self._cv:  # a retry after a hung attempt goes on counting
            first = self._next_attempt.pop(path, 1)
        for attempt in range(first, len(MIRROR_RETRY_DELAYS_S) + 2):
            try:
                total = sum(r["size"] for r in read_manifest(path)["files"].values()) / 1e6
                call = _Call(path, Progress(), MIRROR_STALL_TIMEOUT_S, attempt)
                self._attempt = (path, call.progress, total)
                self._watched(
                    partial(mirror_checkpoint, path, self.mirror_dir, call.progress), call
                )
                if self.error is not None:
                    loud(f"Drive copy OK again: {path.name} verified in {self.mirror_dir}")
                self.error = None
                self.last_step = max(step, self.last_step or 0)
                self._tidy(path)
                return "copied"
            except Exception as e:  # noqa: BLE001 - reported, retried, never raised into training
                # also a copy broken by the taker (its clean-up removed the partial copy)
                if isinstance(e, LeaseLost) or self._taken():
                    self.lost = True
                    return "lost"
                if not self._failed(path, attempt, e):
                    return "failed"
                # a newer checkpoint arriving meanwhile replaces this one: copy only the newest
                with self._cv:
                    if self._cv.wait_for(
                        lambda: self._pending is not None and step_of(self._pending) > step,
                        timeout=MIRROR_RETRY_DELAYS_S[attempt - 1],
                    ):
                        return "superseded"
        return "failed"

    def _failed(self, path: Path, attempt: int, e: BaseException, then: str = "") -> bool:
        """Count and report a failed attempt -> whether another follows (`then` says when; by default after its
        retry delay)."""
        attempts = len(MIRROR_RETRY_DELAYS_S) + 1
        self.failures += 1
        self.error = f"{type(e).__name__}: {e}"
        if attempt >= attempts:
            loud(
                f"!! DRIVE COPY FAILED for {path.name} after {attempts} attempts: {self.error}. "
                f"Training goes on and checkpoints keep being saved locally in {self.run_dir}; the newest on "
                f"Drive is {self._newest_on_drive()}. The next checkpoint will be tried again."
            )
            return False
        then = then or f"retrying in {MIRROR_RETRY_DELAYS_S[attempt - 1]:g} s"
        loud(
            f"!! Drive copy of {path.name} failed (attempt {attempt}/{attempts}): {self.error}; {then} (local "
            f"checkpoint is safe in {path.parent})"
        )
        return True

    def _watched(self, fn: Callable[[], Any], call: _Call) -> Any:
        """fn(), a Drive call, in this thread, with watch() as its watchdog (it reads call.progress)."""
        with self._cv:
            self._call = call
        try:
            return fn()
        finally:
            with self._cv:
                # watch() gave this call up (it may have ended just after): what it did is not counted
                if call.progress.cancel.is_set():
                    raise _Abandoned
                self._call = None

    def watch(self) -> None:
        """Give up the Drive call in flight once it has made no progress for its limit (a hung mount). A call into
        the mount cannot be interrupted: its thread is left behind (it stops at its next tick, should the call ever
        return) and a new thread takes over (_after_hang). Called by the training loop at its log steps and by
        close() as it waits, so that a save runs no watchdog thread of its own; it never waits on Drive itself."""
        with self._cv:
            call = self._call
            if call is None or time.monotonic() - call.progress.t < call.limit:
                return
            call.progress.cancel.set()
            self._call, self._thread, self._hung = None, None, call
            self._wake()

    def _after_hang(self, call: _Call) -> str:
        """In the thread that took over: what a call given up by watch() comes to, as _copy_with_retries would
        have it -> "lost" (another process took the mirror over) or "handled". A hung copy is reported and retried
        at once while it is the newest checkpoint (a milestone after the newest); a hung clean-up leaves its copy
        standing."""
        hung = HungIOError(
            errno.ETIMEDOUT, f"Drive made no progress for {call.limit:g} s (hung mount?)"
        )
        if call.attempt is None:
            self._tidy_failed(call.path, hung)
            self._done(call.path, "copied")
            return "lost" if self.lost else "handled"
        if self._taken():
            self.lost = True
            return "lost"
        # queued again in one look (a save may hand over a newer checkpoint meanwhile), then said
        with self._cv:
            newest = self._pending is None and step_of(call.path) >= (self._newest or 0)
            milestone = call.path in self._milestones
            retry = call.attempt <= len(MIRROR_RETRY_DELAYS_S)
            if retry and newest:
                self._pending = call.path
            if retry and (newest or milestone):
                self._next_attempt[call.path] = call.attempt + 1
        later = f"copying the newer checkpoint {'first' if milestone else 'instead'}"
        self._failed(call.path, call.attempt, hung, "retrying now" if newest else later)
        self._done(call.path, "retry" if retry else "failed")
        return "handled"

    def _taken(self) -> bool:
        try:
            # reads the lease on Drive: under a watchdog, as every Drive call here
            call_with_timeout(
                partial(check_writable, self.mirror_dir), IO_TIMEOUT_S, what="reading the lease"
            )
        except LeaseLost:
            return True
        except OSError:  # a hung Drive: a Drive failure
            pass
        return False

    def _newest_on_drive(self) -> str:
        if self.last_step is not None:
            return f"step {self.last_step:,}"
        if self.listed_step is None:
            return "none yet"
        return f"step {self.listed_step:,} (found there at start)"

    def _tidy(self, path: Path) -> None:
        """Rotate the mirror and copy the run-level files, under a time limit of their own (the copy stands)."""
        try:
            self._watched(
                self._rotate_and_copy_logs, _Call(path, Progress(), MIRROR_TIDY_TIMEOUT_S, None)
            )
        except LeaseLost:
            raise
        except Exception as e:  # noqa: BLE001 - the checkpoint is on Drive; this is housekeeping
            self._tidy_failed(path, e)

    def _tidy_failed(self, path: Path, e: BaseException) -> None:
        # broken by another process's take-over (its rotation, its lease): the loop's LeaseLost says it, once
        if self._taken():
            self.lost = True
            return
        loud(
            f"!! Drive clean-up after copying {path.name} failed ({type(e).__name__}: {e}); the checkpoint itself "
            f"is on Drive and verified; old checkpoints there may stay until the next copy"
        )

    def _rotate_and_copy_logs(self) -> None:
        # the newest best_step: a milestone copied late must not drop today's best
        rotate(
            self.mirror_dir,
            self.keep_last,
            self._best_step,
            # Drive's trash keeps deleted files: emptied first (rotate cleans the orphans too)
            truncate=True,
            keep_every=self.keep_every,
            protect=self.unreadable,
            newest=self.last_step,
        )
        # run-level ones too: this thread is the mirror's only writer
        clean_temp_files(self.mirror_dir)
        if any(step_of(p) > self.last_step for p in list_checkpoints(self.mirror_dir)):
            return  # the mirror holds newer checkpoints (unreadable at resume): its plot goes with them
        for name in MIRRORED_FILES:  # written atomically: a kill leaves a temp file
            # eval.jsonl: the rows notebook 04 appended on Drive (from another VM) stay
            if (self.run_dir / name).is_file() and name == EVAL_FILE:
                copy_rows(self.run_dir / name, self.mirror_dir / name)
            elif (self.run_dir / name).is_file():
                atomic_write_bytes(self.mirror_dir / name, (self.run_dir / name).read_bytes())

    def _copying(self) -> str:
        """The copy now: "step_N, X of Y MB copied"."""
        if self._attempt is None:
            return "starting"
        path, progress, total = self._attempt
        return f"{path.name}, {progress.bytes / 1e6:,.0f} of {total:,.0f} MB copied"

    def missing_step(self) -> int | None:
        """The newest checkpoint given to copy, while Drive does not have it (None: it has, or none was given)."""
        with self._cv:
            newest = self._newest
        behind = newest is not None and (self.last_step is None or self.last_step < newest)
        return newest if behind else None

    def status(self) -> dict:
        return {
            "mirror_step": self.last_step,
            "mirror_error": self.error,
            "mirror_failures": self.failures,
            "mirror_missing": self.missing_step(),
        }

    def status_line(self) -> str:
        if self.error:
            return f"DRIVE COPY FAILING (newest on Drive: {self._newest_on_drive()}): {self.error}"
        with self._cv:
            copying = self._busy is not None or self._has_work()
        return f"drive: {self._newest_on_drive()}" + (" (copying)" if copying else "")

    def _working(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float, given_up: threading.Event | None = None) -> None:
        """Wait up to `timeout` for the copies in flight (Ctrl-C stops waiting, as `given_up` set does: a second
        stop press); say loudly what is not on Drive."""
        if self._thread is None or self.lost:
            return
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        deadline, stopped_by = time.monotonic() + timeout, None
        report_at = time.monotonic() + MIRROR_WAIT_REPORT_S
        given_up = given_up or threading.Event()
        try:
            while self._working() and time.monotonic() < deadline and not given_up.is_set():
                poll = min(
                    MIRROR_WATCH_S, MIRROR_WAIT_REPORT_S, max(0.0, deadline - time.monotonic())
                )
                self._thread.join(poll)
                self.watch()  # a hung call is given up here, as at the training loop's log steps
                if self._working() and report_at <= time.monotonic() < deadline:
                    report_at += MIRROR_WAIT_REPORT_S
                    loud(
                        f"waiting for the Drive copy: {self._copying()}; {deadline - time.monotonic():.0f} s "
                        f"left (Ctrl-C stops waiting; the checkpoint is safe on the local disk, {self.run_dir})"
                    )
        except KeyboardInterrupt:
            # the copy goes on; is_alive() may say otherwise (CPython marks the thread of an interrupted join stopped)
            stopped_by = "at Ctrl-C"
        if given_up.is_set() and self._working():
            stopped_by = "at the second stop press"
        if self.lost:
            return
        if self._working():
            stopped_by = stopped_by or f"after {timeout:g} s"
        elif not stopped_by:
            self._thread = None
            with self._cv:
                self._closing = False
        if stopped_by:
            loud(
                f"!! stopped waiting for Drive {stopped_by}, while copying {self._copying()}; the copy goes on in the "
                f"background while this process lives; the checkpoints are safe in {self.run_dir}, and re-running "
                f"training copies them to Drive"
            )
        if (missing := self.missing_step()) is not None:
            loud(
                f"!! the newest checkpoint (step {missing}) is NOT on Drive ({self.mirror_dir}), only in "
                f"{self.run_dir} (lost if this VM goes away). Last Drive error: {self.error}. "
                f"Re-run training (it resumes from the local checkpoint and copies it) once Drive works."
            )
        with self._cv:
            left = [step_of(p) for p in self._milestones]
        if left:
            loud(
                f"!! milestone checkpoints {left} are NOT on Drive yet, only in {self.run_dir}; re-running "
                f"training copies them once Drive works"
            )
