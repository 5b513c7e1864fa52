"""Where a run continues from: the newest checkpoint that loads, local or on the Drive mirror (copied here first).
Damaged ones (their bytes were read and are wrong) are set aside; newer ones that could not be read (a slow or hung
Drive, a file not there or not a regular file) are waited for, never given up silently or renamed. The data must be
the run's own unless asked otherwise."""

from __future__ import annotations

import itertools
import os
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from gptlib.checkpoint.format import (
    DRIVE_ADVICE,
    DRIVE_LIST_TIMEOUT_S,
    DRIVE_READ_STALL_S,
    CheckpointInfo,
    TrainState,
    list_checkpoints,
    load_checkpoint,
    remove_tree,
    set_aside,
)
from gptlib.checkpoint.mirror import mirror_checkpoint
from gptlib.data.shards import DatasetMeta
from gptlib.errors import CheckpointError, ConfigError, loud
from gptlib.fsutil import Progress, call_with_timeout, read_bytes_with_timeout
from gptlib.layout import MANIFEST_FILE, checkpoints_dir, step_of
from gptlib.training.optimizer import check_optimizer_fits

# Checkpoints that could not be read (Drive slow or hung) are looked for again this often, for this long; then
# training stops and says what to do.
DRIVE_RESUME_RETRY_S = 30.0
DRIVE_RESUME_WAIT_S = 300.0


@dataclass
class Resume:
    info: CheckpointInfo  # the checkpoint on the local disk (a Drive one is copied there first)
    origin: Path  # where it was found: the local run dir or the Drive mirror
    checkpoint: dict  # load_checkpoint's dict, for the run's parts to load
    # resumed on other tokens (--allow-data-change): what changed
    data_change: dict = field(default_factory=dict)

    @property
    def state(self) -> TrainState:
        return self.checkpoint["state"]

    @property
    def from_mirror(self) -> bool:  # then info.path is its local copy
        return self.origin != self.info.path


@dataclass
class Passed:  # what a resume passed over: the damaged checkpoints are set aside, the unreadable ones never touched
    # -> its manifest as read when judged
    damaged: dict[Path, bytes | None] = field(default_factory=dict)
    # checkpoint or unlistable location -> the error
    unreadable: dict[Path, str] = field(default_factory=dict)
    # the newest step listed on the mirror (for messages before a copy lands)
    mirror_step: int | None = None


def find_resume(
    run_dir: Path,
    mirror_dir: Path | None,
    log,
    skip_unreadable: bool = False,
) -> tuple[Resume | None, Passed]:
    """-> (None: a new run). The newest checkpoint that loads (its files' sizes and hashes right, its pickles safe)
    and whose optimizer state fits its own config's optimizer; a damaged one is passed over. A newer one that could
    not be read (on a fresh Colab VM, Drive holds the only copy) is waited for, DRIVE_RESUME_WAIT_S in all; then
    training stops with what to do, leaving no copy it made behind; skip_unreadable goes on without it, said loudly."""
    deadline, local_before = time.monotonic() + DRIVE_RESUME_WAIT_S, _entries(run_dir)
    for attempt in itertools.count(1):  # noqa: B007 - the stop message says how many looks it took
        resume, passed = _search(run_dir, mirror_dir, log, deadline)
        start = f"step {resume.state.step:,}" if resume is not None else "step 0 (from scratch)"
        unread = "; ".join(f"{p} ({e})" for p, e in passed.unreadable.items())
        # the local disk will not change
        on_drive = any(not p.is_relative_to(run_dir) for p in passed.unreadable)
        left = deadline - time.monotonic()
        if not unread or skip_unreadable or left <= 0 or not on_drive:
            break
        loud(
            f"!! could not read {unread}; not going on from {start} while a newer checkpoint may be there: trying "
            f"again in {min(DRIVE_RESUME_RETRY_S, left):.0f} s ({left:.0f} s left before training stops)"
        )
        time.sleep(min(DRIVE_RESUME_RETRY_S, left))
    if unread and not skip_unreadable:
        for name in _entries(run_dir) - local_before:  # the copies from the mirror this call made
            remove_tree(checkpoints_dir(run_dir) / name)
        tried, advice = (
            (f"tried {attempt} times over {DRIVE_RESUME_WAIT_S:g} s", DRIVE_ADVICE)
            if on_drive
            else (
                "on the local disk",
                f"Look at it, or move it out of {checkpoints_dir(run_dir)} if it is not needed",
            )
        )
        raise CheckpointError(
            f"could not read {unread} ({tried}): a newer checkpoint may be there, so training did not start and "
            f"nothing was changed. {advice}; to go on from {start} anyway, pass --skip-unreadable "
            f"(train(..., options=StartOptions(skip_unreadable=True))): those checkpoints are kept"
        )
    if unread:
        loud(
            f"!! could not read {unread}. --skip-unreadable: training goes on from {start}; those checkpoints are "
            f"left where they are (this run never deletes them)"
        )
    if resume is None and passed.damaged:
        log(f"no checkpoint could be loaded ({len(passed.damaged)} damaged): starting from scratch")
    return resume, passed


def _search(
    run_dir: Path, mirror_dir: Path | None, log, deadline: float
) -> tuple[Resume | None, Passed]:
    """One look (at equal steps the local one wins); each read gets what is left before `deadline` (1 s at least)."""
    passed, found = Passed(), []

    def limit(most: float) -> float:
        return min(most, max(1.0, deadline - time.monotonic()))

    for i, d in enumerate([run_dir] if mirror_dir is None else [run_dir, mirror_dir]):
        try:  # under a watchdog: a hung Drive must not hang the start
            paths = call_with_timeout(lambda d=d: list_checkpoints(d), limit(DRIVE_LIST_TIMEOUT_S))
        except OSError as e:
            log(f"cannot list the checkpoints in {d}: {e}")
            passed.unreadable[d] = str(e)
            continue
        found += [(-step_of(p), i, p) for p in paths]
        if i and paths:
            passed.mirror_step = step_of(paths[0])
    for *_, path in sorted(found):
        try:
            return _load(path, run_dir, limit(DRIVE_READ_STALL_S)), passed
        except CheckpointError as e:  # its bytes were read and are wrong
            log(f"skipping checkpoint: {e}")
            passed.damaged[path] = _manifest_bytes(path)
        except OSError as e:
            log(f"skipping checkpoint: {e}")
            passed.unreadable[path] = str(e)
    return None, passed


def _load(path: Path, run_dir: Path, stall_s: float) -> Resume:
    """CheckpointError (damaged) or OSError (could not be read) unless it loads and its optimizer state fits. One on
    the mirror is copied here first; a copy that turns out damaged is removed (the mirror's is the one to set aside).
    """
    local = path
    if not path.is_relative_to(run_dir):
        progress = Progress()
        local = call_with_timeout(
            lambda: mirror_checkpoint(path, run_dir, progress, reuse=False),
            stall_s,
            progress,
            what=f"reading {path}",
        )
    try:
        checkpoint = load_checkpoint(local)
        # torch would load moments of another shape, and fail mid-run
        check_optimizer_fits(checkpoint, local)
    except CheckpointError:
        if local != path:
            remove_tree(local)
        raise
    return Resume(checkpoint["info"], path, checkpoint)


def _entries(run_dir: Path) -> set[str]:
    root = checkpoints_dir(run_dir)
    return set(os.listdir(root)) if root.is_dir() else set()


def _manifest_bytes(path: Path) -> bytes | None:
    """What a damaged checkpoint is known by until it is set aside (None: not readable now)."""
    with suppress(OSError):
        return read_bytes_with_timeout(path / MANIFEST_FILE, DRIVE_LIST_TIMEOUT_S)
    return None


def set_aside_damaged(passed: Passed, resume: Resume | None, log) -> None:
    """Called by the run's one writer before it writes. One that a good copy from the mirror replaced is that copy
    now: left alone. The others are looked at again: one whose manifest changed since or cannot be read now is left
    as it is (Drive answers differently now)."""
    for p, seen in passed.damaged.items():
        if resume is not None and p == resume.info.path:
            continue
        try:
            if not call_with_timeout(p.is_dir, DRIVE_LIST_TIMEOUT_S, what=f"looking at {p}"):
                continue
            if seen is None or _manifest_bytes(p) != seen:
                log(f"{p} was found damaged at resume but looks different now: left as it is")
                continue
            aside = call_with_timeout(
                lambda p=p: set_aside(p), DRIVE_LIST_TIMEOUT_S, what=f"renaming {p}"
            )
            log(f"the damaged {p} is set aside as {aside.name} (kept for you to look at or delete)")
        except OSError as e:
            loud(f"!! could not set aside the damaged {p} ({e}); move or delete it yourself")


# Only these may change under --allow-data-change (other text, same tokenizer): a tokenizer, vocabulary or dtype
# change never can, as the model's ids would mean other things.
TOKEN_FIELDS = ("train_tokens", "val_tokens", "tokens_sha256")


def check_same_data(resume: Resume, meta: DatasetMeta, allow_change: bool, log) -> dict:
    """ConfigError naming what changed; with allow_change (tokens only) -> the change for state.json ({}: none).
    Fields an older checkpoint did not record are not compared."""
    was = resume.state.data
    changed = {
        k: (was[k], now) for k, now in meta.identity().items() if was.get(k) not in (None, now)
    }
    if not changed:
        return {}
    what = ", ".join(f"{k} {old!r} -> {now!r}" for k, (old, now) in changed.items())
    where = f"{resume.info.path} was trained on other data than {meta.data_dir} ({what})"
    if any(k not in TOKEN_FIELDS for k in changed):
        raise ConfigError(f"{where}; resume with the same data or use a new run directory")
    if not allow_change:
        raise ConfigError(
            f"{where}; resume with the same data, use a new run directory, or pass --allow-data-change "
            f"(train(..., options=StartOptions(allow_data_change=True))) to go on with this data (recorded in "
            f"the run's state)"
        )
    log(
        f"resume: data changed ({what}); going on with {meta.data_dir} as asked (--allow-data-change, recorded in "
        f"state.json's data_changes)"
    )
    return {
        "step": resume.state.step,
        "data_dir": str(meta.data_dir),
        "was": was,
        "now": meta.identity(),
    }
