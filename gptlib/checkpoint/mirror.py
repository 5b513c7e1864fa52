"""The Drive mirror: every verified local checkpoint copied to a second directory (Google Drive) in a
background thread, so the run survives the VM.

A copy goes to a temp name, every file hashed while it is read (the local files must still match
their manifest) and fsynced, the manifest last; the copy is read back and verified (size and
sha256), then renamed; then the mirror is rotated and the run-level files (layout.MIRRORED_FILES)
are copied beside the checkpoints, so the mirror is a complete run directory.

Drive errors (Errno 107 "Transport endpoint is not connected", Errno 5, hangs) are retried with
backoff and reported loudly on stderr and in `status()`; they never stop training, and local
checkpoints keep being written meanwhile. If copies fall behind, only the newest checkpoint is
copied, except milestones, which are all copied after it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

from gptlib.checkpoint.format import install, list_checkpoints, remove_tree, verify_checkpoint
from gptlib.checkpoint.rotation import marked_milestone, rotate
from gptlib.errors import CheckpointError, loud
from gptlib.faults import fault_point
from gptlib.fsutil import Progress, atomic_write, call_with_timeout, clean_temp_files, fsync_dir
from gptlib.layout import MANIFEST_FILE, MIRRORED_FILES, PARTIAL_MARKER, checkpoint_name, checkpoints_dir, step_of
from gptlib.lease import LeaseLost

# The copy policy; module-level so tests (and impatient users) can shorten them.
MIRROR_RETRY_DELAYS_S = (2.0, 5.0, 15.0, 30.0, 60.0)  # waits between attempts for one checkpoint
MIRROR_STALL_TIMEOUT_S = 180.0  # an attempt with no progress for this long is a hung Drive: abandoned
MIRROR_CLOSE_TIMEOUT_S = 600.0  # at the end of training, wait at most this long for the last Drive copy
MIRROR_TIDY_TIMEOUT_S = 60.0  # rotating the mirror and copying the run's logs there: give up after this
MIRROR_WAIT_REPORT_S = 30.0  # while waiting at the end, say how far the copy got this often
_COPY_CHUNK = 8 << 20


# --- copying -------------------------------------------------------------------------------------


def copy_file_verified(src: Path, dst: Path, size: int | None = None, sha256: str | None = None,
                       progress: Progress | None = None) -> None:
    """Copy src to dst (fsynced) hashing as it goes; OSError if the bytes read are not what the
    manifest says (the local copy changed) — the destination is then left for cleanup."""
    progress = progress or Progress()
    h = hashlib.sha256()
    n = 0
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while True:
            progress.tick()
            b = fi.read(_COPY_CHUNK)
            if not b:
                break
            h.update(b)
            fo.write(b)
            n += len(b)
            progress.tick(len(b))
        fo.flush()
        os.fsync(fo.fileno())
    progress.tick()
    if size is not None and n != size:
        raise OSError(errno.EIO, f"{src}: read {n:,} bytes, manifest says {size:,}")
    if sha256 is not None and h.hexdigest() != sha256:
        raise OSError(errno.EIO, f"{src}: sha256 differs from the manifest while copying")


def mirror_checkpoint(src: Path, mirror_run_dir: Path, progress: Progress | None = None) -> Path:
    """Copy a verified local checkpoint dir into mirror_run_dir/checkpoints: temp name, every file
    hashed while read and fsynced, manifest last, read back and verified (size + sha256), renamed."""
    progress = progress or Progress()
    manifest = json.loads((src / MANIFEST_FILE).read_text())
    dst_root = checkpoints_dir(mirror_run_dir)
    dst_root.mkdir(parents=True, exist_ok=True)
    final = dst_root / src.name
    if final.is_dir():
        try:
            have = verify_checkpoint(final, deep=False)
            if have.manifest.get("files") == manifest["files"]:
                return final  # already there (e.g. the checkpoint we resumed from)
        except (CheckpointError, OSError):
            pass  # a corrupt copy: replaced below
    partial = dst_root / f"{src.name}{PARTIAL_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    partial.mkdir()
    try:
        for i, (name, rec) in enumerate(manifest["files"].items()):
            copy_file_verified(src / name, partial / name, rec["size"], rec["sha256"], progress)
            if i == 0:
                fault_point("mirror_mid", manifest["step"])
        copy_file_verified(src / MANIFEST_FILE, partial / MANIFEST_FILE, progress=progress)
        fsync_dir(partial)
        verify_checkpoint(partial, deep=True)  # read back from the mirror: catches truncated writes
        progress.tick()
    except BaseException:
        try:  # best effort (Drive may be gone); leftovers are removed by the next rotation
            remove_tree(partial, truncate=True)
        except OSError:
            pass
        raise
    install(partial, final, truncate=True)
    verify_checkpoint(final, deep=False)
    return final


def copy_run_file(src: Path, dst_dir: Path, nbytes: int | None, progress: Progress) -> None:
    """The first `nbytes` (None: all) of a run-level file to the mirror, atomically (fsutil's temp
    marker, so a copy killed mid-way is cleaned up as an orphan)."""
    if not src.is_file():
        return
    with open(src, "rb") as f:
        data = f.read(nbytes)
    atomic_write(dst_dir / src.name, lambda f: f.write(data))
    progress.tick()


# --- the mirror thread ---------------------------------------------------------------------------


class Mirror:
    """Copies a run's newest verified checkpoint, and every milestone, to `mirror_dir` in one thread."""

    def __init__(self, run_dir: Path, mirror_dir: Path, keep_last: int, keep_every: int,
                 guard: Callable[[Path], None], bad: set[Path] = frozenset(), unreadable: set[Path] = frozenset(),
                 listed_step: int | None = None):
        self.run_dir, self.mirror_dir = Path(run_dir), Path(mirror_dir)
        self.bad = bad  # checkpoints found damaged at resume: not counted as kept by rotation
        self.unreadable = unreadable  # checkpoints that could not be read at resume: never deleted
        self.listed_step = listed_step  # the newest step listed on the mirror at resume (before any copy)
        self.guard = guard  # raises when this process may no longer write to the mirror (its lease was taken)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.last_step: int | None = None  # newest step verified on the mirror
        self.error: str | None = None  # last failure; None once a copy succeeds
        self.failures = 0  # failed attempts so far
        # Guarded by _cv:
        self._cv = threading.Condition()
        self._pending: Path | None = None  # newest local checkpoint not yet copied
        # Milestones not yet on the mirror, oldest first. A newer checkpoint replaces _pending (only the
        # newest matters for resuming) but not these: they are copied after it.
        self._milestones: list[Path] = []
        self._milestones_paused = False  # after a failed copy, until the next checkpoint
        self._best_step: int | None = None  # the newest best step: what mirror rotation must keep
        self._busy: Path | None = None  # being copied now
        self._closing = False
        self._run_file_sizes: dict[str, int] = {}  # prefix of each log file that matches the newest checkpoint
        self._copying: tuple[Path, int, Progress] | None = None  # (checkpoint, its bytes, progress) of the copy now
        self._thread: threading.Thread | None = None

    def submit(self, path: Path, best_step: int | None, milestone: bool, run_file_sizes: dict[str, int]) -> set[Path]:
        """A new verified local checkpoint -> the checkpoints rotation must not delete yet (pending, busy)."""
        with self._cv:
            self._run_file_sizes = dict(run_file_sizes)
            self._best_step = best_step
            self._pending = path
            self._milestones_paused = False
            if milestone:
                self._milestones.append(path)
            self._ensure_thread()
            self._cv.notify_all()
            return {p for p in (self._busy, self._pending) if p is not None}

    def queue_existing(self, path: Path, best_step: int | None) -> None:
        """Queue an existing local checkpoint (resumed locally, newer than Drive) and the local milestones
        (those already on the mirror are recognised and not copied again)."""
        milestones = [p for p in reversed(list_checkpoints(self.run_dir)) if marked_milestone(p)]
        with self._cv:
            if self._best_step is None:
                self._best_step = best_step
            if self._pending is None or step_of(self._pending) < step_of(path):
                self._pending = path
            self._milestones += [p for p in milestones if p not in self._milestones]
            self._ensure_thread()
            self._cv.notify_all()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, daemon=True, name="gptlib-mirror")
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cv:
                milestones_due = lambda: bool(self._milestones) and not self._milestones_paused  # noqa: E731
                while self._pending is None and not milestones_due() and not self._closing:
                    self._cv.wait()
                if self._pending is not None:
                    path, self._pending = self._pending, None
                elif milestones_due():
                    path = self._milestones[0]
                else:
                    return
                self._busy = path
            try:
                outcome = self._copy_with_retries(path)
                with self._cv:
                    if outcome == "copied":
                        self._milestones = [m for m in self._milestones if m != path]
                    elif outcome == "failed":  # Drive is failing: milestones wait for the next save, not a loop
                        self._milestones_paused = True
            finally:
                with self._cv:
                    self._busy = None
                    self._cv.notify_all()

    def _copy_with_retries(self, path: Path) -> str:
        """Copy one checkpoint, retrying -> "copied", "failed" (gave up) or "superseded" (a newer
        checkpoint arrived during a retry wait: that one is copied instead)."""
        step = step_of(path)
        attempts = len(MIRROR_RETRY_DELAYS_S) + 1
        for attempt in range(1, attempts + 1):
            try:
                self._attempt(path)
                if self.error is not None:
                    loud(f"Drive copy OK again: {checkpoint_name(step)} verified in {self.mirror_dir}")
                self.error = None
                self.last_step = max(step, self.last_step or 0)
                self._tidy(path)
                return "copied"
            except LeaseLost as e:  # another process owns the mirror now: never write over it
                self.error = str(e)
                loud(f"!! Drive copy of {checkpoint_name(step)} not made: {e}")
                return "failed"
            except Exception as e:  # noqa: BLE001 - reported, retried, never raised into training
                self.failures += 1
                self.error = f"{type(e).__name__}: {e}"
                if attempt == attempts:
                    loud(f"!! DRIVE COPY FAILED for {checkpoint_name(step)} after {attempts} attempts: {self.error}. "
                         f"Training goes on and checkpoints keep being saved locally in {self.run_dir}; the newest on "
                         f"Drive is {self._newest_on_drive()}. The next checkpoint will be tried again.")
                    return "failed"
                delay = MIRROR_RETRY_DELAYS_S[attempt - 1]
                loud(f"!! Drive copy of {checkpoint_name(step)} failed (attempt {attempt}/{attempts}): {self.error}; "
                     f"retrying in {delay:g} s (local checkpoint is safe in {path.parent})")
                with self._cv:  # a newer checkpoint arriving meanwhile replaces this one: copy only the newest
                    if self._cv.wait_for(lambda: self._pending is not None and step_of(self._pending) > step,
                                         timeout=delay):
                        return "superseded"

    def _newest_on_drive(self) -> str:
        """ "step N" for messages: the newest this run verified there, else the newest listed there at resume."""
        if self.last_step is not None:
            return f"step {self.last_step:,}"
        if self.listed_step is not None:
            return f"step {self.listed_step:,} (found there at start)"
        return "none yet"

    def _attempt(self, path: Path) -> None:
        progress = Progress()
        total = sum(r["size"] for r in json.loads((path / MANIFEST_FILE).read_text())["files"].values())
        self._copying = (path, total, progress)

        def copy():
            self.guard(self.mirror_dir)
            mirror_checkpoint(path, self.mirror_dir, progress)

        call_with_timeout(copy, MIRROR_STALL_TIMEOUT_S, progress)

    def _tidy(self, path: Path) -> None:
        """After a copy: rotate the mirror, remove temp files, copy the run-level files. Its own time limit:
        an old file that hangs on Drive is reported, and the copy it follows stands."""
        with self._cv:
            sizes = dict(self._run_file_sizes)
            best_step = self._best_step  # the newest: a milestone copied late must not drop today's best

        def tidy():
            rotate(self.mirror_dir, self.keep_last, best_step, truncate=True,  # also cleans checkpoint orphans
                   keep_every=self.keep_every, bad=self.bad, protect=self.unreadable, newest=self.last_step)
            clean_temp_files(self.mirror_dir)  # run-level ones too: this thread is the mirror's only writer
            ahead = [p for p in list_checkpoints(self.mirror_dir) if step_of(p) > self.last_step]
            if ahead:  # the mirror holds newer checkpoints (unreadable at resume): its logs go with them
                return
            for name in MIRRORED_FILES:
                copy_run_file(self.run_dir / name, self.mirror_dir, sizes.get(name), Progress())

        try:
            call_with_timeout(tidy, MIRROR_TIDY_TIMEOUT_S, what=f"Drive clean-up in {self.mirror_dir}")
        except Exception as e:  # noqa: BLE001 - the checkpoint is on Drive; this is housekeeping
            loud(f"!! Drive clean-up after copying {path.name} failed ({type(e).__name__}: {e}); the checkpoint "
                 f"itself is on Drive and verified; old checkpoints there may stay until the next copy")

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        try:
            while self._thread.is_alive() and time.monotonic() < deadline:
                self._thread.join(min(MIRROR_WAIT_REPORT_S, max(0.0, deadline - time.monotonic())))
                if self._thread.is_alive() and time.monotonic() < deadline:
                    loud(f"waiting for the Drive copy: {self._progress_text()}; {deadline - time.monotonic():.0f} s "
                         f"left (Ctrl-C stops waiting; the checkpoint is safe on the local disk, {self.run_dir})")
        except KeyboardInterrupt:
            loud(f"stopped waiting for Drive ({self._progress_text()}); the checkpoints are safe in {self.run_dir}, "
                 f"and re-running training copies them to Drive")

    def _progress_text(self) -> str:
        copying = self._copying
        if copying is None:
            return "starting"
        path, total, progress = copying
        return f"{path.name}, {progress.bytes / 1e6:,.0f} of {total / 1e6:,.0f} MB copied"

    def status(self) -> dict:
        with self._cv:
            copying = (self._pending is not None or self._busy is not None
                       or bool(self._milestones) and not self._milestones_paused)
        return {"mirror_dir": str(self.mirror_dir), "mirror_step": self.last_step, "mirror_copying": copying,
                "mirror_error": self.error, "mirror_failures": self.failures}

    def status_line(self) -> str:
        """'drive: step N' when fine; a loud line when the last copy failed."""
        s = self.status()
        if s["mirror_error"]:
            return f"DRIVE COPY FAILING (newest on Drive: {self._newest_on_drive()}): {s['mirror_error']}"
        return f"drive: {self._newest_on_drive()}" + (" (copying)" if s["mirror_copying"] else "")

    def close(self, timeout: float, local_step: int | None) -> None:
        """Wait up to `timeout` for the copies in flight, saying how far they got every MIRROR_WAIT_REPORT_S
        (Ctrl-C stops waiting); then say loudly what is not on Drive."""
        if self._thread is None:
            return
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._wait(timeout)
        if self._thread.is_alive():
            loud(f"!! Drive copy still running after {timeout:g} s; it goes on in the background while this "
                 f"process lives, but the newest checkpoint or milestones may exist only in {self.run_dir}")
        else:
            self._thread = None
            with self._cv:
                self._closing = False
        if local_step is not None and self.last_step != local_step:
            loud(f"!! the newest checkpoint (step {local_step}) is NOT on Drive ({self.mirror_dir}), only in "
                 f"{self.run_dir} (lost if this VM goes away). Last Drive error: {self.error}. "
                 f"Re-run training (it resumes from the local checkpoint and copies it) once Drive works.")
        with self._cv:
            left = [step_of(p) for p in self._milestones]
        if left:
            loud(f"!! milestone checkpoints {left} are NOT on Drive yet, only in {self.run_dir}; re-running "
                 f"training copies them once Drive works")


class NoMirror:
    """The null mirror of a run without one (not on Colab, or no Drive): nothing to copy, nothing to report."""

    def submit(self, path: Path, best_step: int | None, milestone: bool, run_file_sizes: dict[str, int]) -> set[Path]:
        return set()

    def queue_existing(self, path: Path, best_step: int | None) -> None:
        pass

    def status(self) -> dict:
        return {"mirror_dir": None, "mirror_step": None, "mirror_copying": False, "mirror_error": None,
                "mirror_failures": 0}

    def status_line(self) -> str:
        return ""

    def close(self, timeout: float, local_step: int | None) -> None:
        pass
