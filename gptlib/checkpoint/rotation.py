"""Which checkpoints stay: the newest `keep_last` that verify, the best one and the milestones. What rotation cannot
judge is kept: checkpoints newer than the run's own newest (a Drive slow at resume) and ones it cannot read now."""

from __future__ import annotations

import json
from contextlib import suppress
from pathlib import Path

from gptlib.checkpoint.format import (
    MIN_KEEP_LAST,
    ORPHAN_MARKERS,
    CheckpointError,
    list_checkpoints,
    remove_tree,
    set_aside_time,
    verify_checkpoint,
)
from gptlib.fsutil import check_writable, clean_temp_files
from gptlib.layout import DAMAGED_MARKER, STATE_FILE, checkpoint_name, checkpoints_dir, step_of


def clean_orphans(
    run_dir: str | Path, truncate: bool = False, run_level: bool = True
) -> list[Path]:
    """Remove leftovers of interrupted saves, copies and deletions -> what was removed. run_level: also temp files in
    run_dir (only at start-up: during training the loop writes such files itself)."""
    removed = []
    root = checkpoints_dir(run_dir)
    check_writable(root)  # another holder's leftovers may be its writes in progress
    for p in list(root.iterdir()) if root.is_dir() else []:
        if any(m in p.name for m in ORPHAN_MARKERS):
            if p.is_dir():
                remove_tree(p, truncate)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
        # temp files inside a finished checkpoint (a kill during a same-step re-save)
        elif p.is_dir():
            removed += clean_temp_files(p)
    if run_level:
        removed += clean_temp_files(run_dir)
    return removed


def prune_damaged(
    run_dir: str | Path, truncate: bool = False, since: float | None = None
) -> tuple[list[Path], list[tuple[Path, int]]]:
    """Of the checkpoints set aside as damaged (step_N.damaged-TIME), the newest by the time recorded in it is kept for
    its owner to look at, and those set aside since `since` (this start began; None: every one is kept); the others
    are removed (a gpt2-small checkpoint is 1.3 GB, Drive's free tier 15 GB). -> (the ones kept, the removed ones
    with their sizes in bytes)."""
    root = checkpoints_dir(run_dir)
    aside = []
    if root.is_dir():
        aside = [p for p in root.iterdir() if DAMAGED_MARKER in p.name and p.is_dir()]
    aside.sort(key=lambda p: (set_aside_time(p), p.name))
    kept, removed = [], []
    for p in aside:
        if p == aside[-1] or since is None or set_aside_time(p) >= since:
            kept.append(p)
            continue
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        remove_tree(p, truncate)
        removed.append((p, size))
    return kept, removed


def is_milestone(step: int | None, keep_every: int) -> bool:
    return bool(keep_every) and step is not None and step > 0 and step % keep_every == 0


def marked_milestone(path: Path) -> bool:
    """state.json says milestone: kept even if keep_every changed since. OSError (a hung Drive): the caller keeps it."""
    try:
        return json.loads((path / STATE_FILE).read_text()).get("milestone") is True
    except (FileNotFoundError, ValueError, AttributeError):
        return False  # no state.json, or not JSON: not a marked milestone


def rotate(
    run_dir: str | Path,
    keep_last: int,
    best_step: int | None,
    protect: set[Path] = frozenset(),
    truncate: bool = False,
    keep_every: int = 0,
    newest: int | None = None,
) -> list[Path]:
    """-> what was deleted. One that does not verify does not count towards `keep_last`: a damaged newest never costs a
    good one. Never deleted: `protect` (in use, or unreadable at resume) and steps after `newest`."""
    ckpts = [p for p in list_checkpoints(run_dir) if newest is None or step_of(p) <= newest]
    keep = {Path(p) for p in protect} | {p for p in ckpts if is_milestone(step_of(p), keep_every)}
    if best_step is not None:
        keep.add(checkpoints_dir(run_dir) / checkpoint_name(best_step))
    n_valid = 0
    for p in ckpts:
        if n_valid >= max(MIN_KEEP_LAST, keep_last):
            break
        try:
            verify_checkpoint(p)
            n_valid += 1
        except CheckpointError:
            continue
        except OSError:
            pass  # unreadable now, not known to be damaged: kept
        keep.add(p)
    if n_valid == 0:
        return []  # nothing verified: delete nothing
    deleted = []
    for p in ckpts:
        with suppress(OSError):  # state.json unreadable now (a hung Drive): kept
            # read only for deletion candidates (Drive is slow)
            if p not in keep and not marked_milestone(p):
                remove_tree(p, truncate)
                deleted.append(p)
    clean_orphans(run_dir, truncate, run_level=False)
    return deleted
