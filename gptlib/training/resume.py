"""Where a run starts from, found before anything in the run directory changes: the run's lease (claimed), then the
newest checkpoint that loads, local or on the Drive mirror (copied here first), or an --init-from base (find_start).
The resume point comes in three pieces: the search (search_checkpoints: what is on disk now), the waiting policy
(_waiting_for_drive: a newer checkpoint Drive could not give now is looked for again), and what it comes to
(_say_resume_point). Damaged checkpoints (their bytes were read and are wrong) are set aside once the run writes; ones
that could not be read (a slow or hung Drive, a file not there or not a regular file) are never given up silently or
renamed. The data must be the run's own unless asked otherwise."""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gptlib.checkpoint.format import (
    DRIVE_LIST_TIMEOUT_S,
    DRIVE_READ_STALL_S,
    CheckpointInfo,
    TrainState,
    list_checkpoints,
    load_checkpoint,
    load_weights_into,
    remove_tree,
)
from gptlib.checkpoint.mirror import mirror_checkpoint
from gptlib.config import RunConfig
from gptlib.data.shards import META_FILE, DatasetMeta, read_meta
from gptlib.data.tokenizer import Tokenizer, check_identity, load_tokenizer
from gptlib.errors import CheckpointError, ConfigError, DataFormatError, in_notebook, loud
from gptlib.fsutil import (
    DRIVE_ADVICE,
    Progress,
    atomic_write_bytes,
    atomic_write_json,
    call_with_timeout,
    copy_rows,
    fsync_dir,
    read_bytes_with_timeout,
    replace,
)
from gptlib.inference.loading import LoadedModel, load_run
from gptlib.layout import (
    CONFIG_FILE,
    DAMAGED_MARKER,
    EVAL_FILE,
    MANIFEST_FILE,
    SET_ASIDE_FILE,
    STATE_FILE,
    TOKENIZER_FILE,
    checkpoints_dir,
    step_of,
)
from gptlib.model import GPT
from gptlib.training.step import check_optimizer_fits

# Checkpoints that could not be read (Drive slow or hung) are looked for again this often, for this long; then
# training stops and says what to do.
DRIVE_RESUME_RETRY_S = 30.0
DRIVE_RESUME_WAIT_S = 300.0


@dataclass(frozen=True)
class StartOptions:
    """How a call starts or resumes a run (its config says what it trains)."""

    # "RUN_DIR[:latest|best|STEP]": a new run from those weights, fresh optimizer
    init_from: str | None = None
    take_over: bool = False  # take the run's lease from another process (gptlib/lease.py)
    # go on without newer checkpoints Drive cannot read now (they are kept)
    skip_unreadable: bool = False
    # resume on other tokens of the same tokenizer (recorded in state.json)
    allow_data_change: bool = False


@dataclass
class Start:
    run_dir: Path
    mirror_dir: Path | None
    options: StartOptions
    meta: DatasetMeta
    tokenizer: Tokenizer
    resume: Resume | None
    passed: Passed
    base: LoadedModel | None  # --init-from's
    held: RunConfig | None  # the config the model already has (its shape and recipe stay)

    @property
    def whose(self) -> str:  # the held config's
        return "resumed run" if self.resume is not None else "--init-from base"


def find_start(
    data_dir: Path, run_dir: Path, mirror_dir: Path | None, options: StartOptions, log
) -> Start:
    """The data (meta.json read once here, its tokenizer checked), then the newest checkpoint that loads, else an
    --init-from base, else nothing; held: the config the model already has."""
    meta = read_meta(data_dir)
    tokenizer = load_tokenizer(meta.data_dir / meta.tokenizer.get("file", TOKENIZER_FILE))
    check_identity(tokenizer, meta.tokenizer, str(meta.data_dir))
    # the model's embedding would be too small for its ids
    if tokenizer.vocab_size > meta.vocab_size:
        raise DataFormatError(
            f"{meta.data_dir / META_FILE}: vocab_size is {meta.vocab_size:,} but the tokenizer has "
            f"{tokenizer.vocab_size:,} tokens; tokenize again (--overwrite)"
        )
    resume, passed = find_resume(run_dir, mirror_dir, log, options.skip_unreadable)
    init_from = options.init_from
    if resume is None and init_from and names_this_run(init_from, run_dir, mirror_dir):
        raise _init_from_itself(init_from)
    base = load_base(init_from, meta, log) if init_from and resume is None else None
    held = base and base.config
    if resume is not None:
        held = resume.state.run_config(str(resume.info.path / STATE_FILE))
    return Start(run_dir, mirror_dir, options, meta, tokenizer, resume, passed, base, held)


def _init_from_itself(spec: str) -> ConfigError:
    return ConfigError(
        f"--init-from {spec} is this run's own directory, which has no checkpoint yet: --init-from starts a new run "
        f"from another run's weights; drop it to train this one from scratch"
    )


def split_init_from(spec: str) -> tuple[str, str]:
    """--init-from RUN_DIR[:latest|best|STEP] -> (RUN_DIR, which)."""
    return (
        tuple(spec.rsplit(":", 1)) if ":" in spec and not Path(spec).is_dir() else (spec, "latest")
    )


def names_this_run(spec: str, run_dir: Path, mirror_dir: Path | None) -> bool:
    """Whether --init-from names the run itself (its directory or its Drive mirror, with or without :which); paths
    only, no disk access (a Drive that hangs must not hang this: split_init_from looks at the disk)."""
    named = {os.path.abspath(spec), os.path.abspath(spec.rsplit(":", 1)[0])}
    return any(d is not None and os.path.abspath(d) in named for d in (run_dir, mirror_dir))


def load_base(spec: str, meta: DatasetMeta, log) -> LoadedModel:
    """The weights a new run starts from (--init-from RUN_DIR[:latest|best|STEP]). The data's tokenizer must be the
    base's, or the base's with tokens appended (tokenize --tokenizer-from BASE_RUN --format chat adds chat markers)."""
    run_dir, which = split_init_from(spec)
    ld = load_run(run_dir, which, log=log)
    base, data = ld.tokenizer.identity(), meta.tokenizer
    # the data's tokenizer is the base's with tokens appended (chat markers)
    appended = (meta.raw.get("tokenizer_base") or {}).get("hash") == base["hash"]
    grows = appended and meta.vocab_size > base["vocab_size"]
    if data.get("hash") != base["hash"] and not grows:
        raise ConfigError(
            f"--init-from {spec}: its vocabulary ({base['kind']}, {base['vocab_size']:,} tokens, "
            f"tokenizer {base['hash'][:12]}) is not the data's ({meta.data_dir}: {data.get('kind')}, "
            f"{meta.vocab_size:,} tokens, tokenizer {str(data.get('hash'))[:12]}); tokenize the data "
            f"with --tokenizer-from {run_dir}"
        )
    mc = ld.config.model
    added = (
        f"; vocabulary {base['vocab_size']:,} -> {meta.vocab_size:,} (new rows added)"
        if grows
        else ""
    )
    log(
        f"init-from: the weights of {ld.path} (step {ld.step:,}); {mc.n_layer} layers x {mc.n_embd}, context "
        f"{mc.block_size}{added}"
    )
    return ld


def start_from_base(model: GPT, base: LoadedModel) -> None:
    """The embedding and output rows of the tokens appended after the base's vocabulary start at the mean of the
    base's rows; every other weight is the base's."""
    sd, n = base.model.state_dict(), base.tokenizer.vocab_size
    for key, new in model.state_dict().items():
        # wte and lm_head (one tensor when tied): the vocabulary grew
        if key in sd and sd[key].shape != new.shape:
            grown = torch.zeros_like(new)
            grown[:n] = sd[key][:n]
            grown[n : model.config.vocab_size] = sd[key][:n].mean(dim=0)
            sd[key] = grown
    load_weights_into(model, sd, base.path)


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
    run_dir: Path, mirror_dir: Path | None, log, skip_unreadable: bool = False
) -> tuple[Resume | None, Passed]:
    """-> (None: a new run). The newest checkpoint that loads (its files' sizes and hashes right, its pickles safe)
    and whose optimizer state fits its own config's optimizer; a damaged one is passed over. A newer one that could
    not be read (on a fresh Colab VM, Drive holds the only copy) is waited for, DRIVE_RESUME_WAIT_S in all; then
    training stops with what to do, leaving no copy it made behind; skip_unreadable goes on without it, said loudly."""
    deadline, local_before, looks = time.monotonic() + DRIVE_RESUME_WAIT_S, _entries(run_dir), 1
    resume, passed = search_checkpoints(run_dir, mirror_dir, log, deadline)
    while _waiting_for_drive(passed, run_dir, skip_unreadable, deadline):
        # never below 0: the deadline may pass between the check above and this line
        left = max(0.0, deadline - time.monotonic())
        loud(
            f"!! could not read {_unread(passed)}; not going on from {_step(resume)} while a newer checkpoint may be "
            f"there: trying again in {min(DRIVE_RESUME_RETRY_S, left):.0f} s ({left:.0f} s left before training stops)"
        )
        time.sleep(min(DRIVE_RESUME_RETRY_S, left))
        resume, passed = search_checkpoints(run_dir, mirror_dir, log, deadline)
        looks += 1
    # what the search passed over: a newer checkpoint unreadable, or damaged ones before starting from scratch
    if passed.unreadable or (resume is None and passed.damaged):
        _say_resume_point(resume, passed, run_dir, skip_unreadable, looks, local_before, log)
    # the run's own beside a copy from Drive: a start refused after (another TEXT_PATH) leaves it, and notebook 04,
    # which prefers it, read the data's tokenizer (a mismatch); none there or Drive slow: write_run_files's at a start.
    # eval.jsonl: Drive's rows added to this one's, which may hold rows that never reached Drive (Drive failing)
    for name in (CONFIG_FILE, TOKENIZER_FILE, EVAL_FILE) if resume and resume.from_mirror else ():
        with contextlib.suppress(OSError):
            copy = read_bytes_with_timeout(mirror_dir / name, DRIVE_LIST_TIMEOUT_S)
            if name == EVAL_FILE:
                copy_rows(copy, run_dir / name)
            else:
                atomic_write_bytes(run_dir / name, copy)
    return resume, passed


def _waiting_for_drive(
    passed: Passed, run_dir: Path, skip_unreadable: bool, deadline: float
) -> bool:
    """The waiting policy: a checkpoint Drive could not give now is looked for again until the deadline; one on the
    local disk will not change, and --skip-unreadable does not wait."""
    on_drive = any(not p.is_relative_to(run_dir) for p in passed.unreadable)
    return on_drive and not skip_unreadable and time.monotonic() < deadline


def _say_resume_point(
    resume: Resume | None,
    passed: Passed,
    run_dir: Path,
    skip_unreadable: bool,
    looks: int,
    local_before: set[str],
    log,
) -> None:
    """What the search came to: a newer checkpoint still unreadable stops training (the copies this call made are
    removed) unless --skip-unreadable goes on without it, loudly; a start from scratch past damaged ones is said."""
    unread, start = _unread(passed), _step(resume)
    if unread and not skip_unreadable:
        for name in _entries(run_dir) - local_before:  # the copies from the mirror this call made
            remove_tree(checkpoints_dir(run_dir) / name)
        on_drive = any(not p.is_relative_to(run_dir) for p in passed.unreadable)
        tried = (
            f"tried {looks} times over {DRIVE_RESUME_WAIT_S:g} s"
            if on_drive
            else "on the local disk"
        )
        advice = f"Look at it, or move it out of {checkpoints_dir(run_dir)} if it is not needed"
        raise CheckpointError(
            f"could not read {unread} ({tried}): a newer checkpoint may be there, so training did not start and "
            f"nothing was changed. {DRIVE_ADVICE if on_drive else advice}; to go on from {start} anyway, pass "
            f"--skip-unreadable (train(..., options=StartOptions(skip_unreadable=True))): those checkpoints are kept"
        )
    if unread:
        loud(
            f"!! could not read {unread}. --skip-unreadable: training goes on from {start}; those checkpoints are "
            f"left where they are (this run never deletes them)"
        )
    if resume is None and passed.damaged:
        log(f"no checkpoint could be loaded ({len(passed.damaged)} damaged): starting from scratch")


def _unread(passed: Passed) -> str:
    return "; ".join(f"{p} ({e})" for p, e in passed.unreadable.items())


def _step(resume: Resume | None) -> str:
    return f"step {resume.state.step:,}" if resume is not None else "step 0 (from scratch)"


def _time_left(deadline: float, most: float) -> float:
    """A read's time limit: what is left before the deadline (1 s at least), at most `most`."""
    return min(most, max(1.0, deadline - time.monotonic()))


def search_checkpoints(
    run_dir: Path, mirror_dir: Path | None, log, deadline: float
) -> tuple[Resume | None, Passed]:
    """One look at what is on disk now (at equal steps the local one wins); each read gets what is left before
    `deadline`."""
    passed, found = Passed(), []
    for i, d in enumerate([run_dir] if mirror_dir is None else [run_dir, mirror_dir]):
        try:  # under a watchdog: a hung Drive must not hang the start
            paths = call_with_timeout(
                lambda d=d: list_checkpoints(d), _time_left(deadline, DRIVE_LIST_TIMEOUT_S)
            )
        except OSError as e:
            log(f"cannot list the checkpoints in {d}: {e}")
            passed.unreadable[d] = str(e)
            continue
        found += [(-step_of(p), i, p) for p in paths]
        if i and paths:
            passed.mirror_step = step_of(paths[0])
    for *_, path in sorted(found):
        try:
            return _load(path, run_dir, _time_left(deadline, DRIVE_READ_STALL_S)), passed
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
    with contextlib.suppress(OSError):
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


def set_aside(path: Path) -> Path:
    """-> step_N.damaged-TIME: kept for its owner, ignored by resume and rotation, never taken for a new save; when, in
    SET_ASIDE_FILE (prune_damaged goes by it)."""
    target = path.with_name(f"{path.name}{DAMAGED_MARKER}{time.strftime('%Y%m%d-%H%M%S')}")
    atomic_write_json(path / SET_ASIDE_FILE, {"set_aside": time.time()})
    replace(path, target)
    fsync_dir(path.parent)
    return target


def set_aside_time(path: Path) -> float:
    """When `path` was set aside, as recorded in it (0: no record: an older gptlib's, or a folder a person named)."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        return float(json.loads((path / SET_ASIDE_FILE).read_text())["set_aside"])
    return 0.0


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


# Only these may change under --allow-data-change (other text, same tokenizer): a tokenizer, vocabulary or dtype
# change never can, as the model's ids would mean other things.
TOKEN_FIELDS = ("train_tokens", "val_tokens", "tokens_sha256")


def check_same_data(resume: Resume, meta: DatasetMeta, allow_change: bool, log) -> dict:
    """ConfigError naming what changed; with allow_change (tokens only) -> the change for state.json ({}: none).
    Fields an older checkpoint did not record are not compared."""
    was, now = resume.state.data, meta.identity()
    changed = {k: (was[k], v) for k, v in now.items() if was.get(k) not in (None, v)}
    if not changed:
        return {}
    what = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
    tokens_only = all(k in TOKEN_FIELDS for k in changed)
    if not (tokens_only and allow_change):
        raise _trained_on_other_data(resume, meta, what, tokens_only)
    log(
        f"resume: data changed ({what}); going on with {meta.data_dir} as asked (--allow-data-change, recorded in "
        f"state.json's data_changes)"
    )
    return {"step": resume.state.step, "data_dir": str(meta.data_dir), "was": was, "now": now}


def _trained_on_other_data(
    resume: Resume, meta: DatasetMeta, what: str, tokens_only: bool
) -> ConfigError:
    """The refusal, with how to go on where the user is; tokens_only (the same tokenizer): --allow-data-change."""
    where = f"{resume.origin} was trained on other data than {meta.data_dir} ({what})"
    how = "resume with the same data, or use a new run directory"
    # where the user is: notebook 02 makes its char data from TEXT_PATH into the dataset named as its run, 03 and 05
    # name a dataset (05, a fine-tune of a base, has no DATA_DIR)
    if in_notebook():
        run, kind = resume.info.path.parents[1], meta.tokenizer.get("kind")
        nb02 = meta.data_dir.name == run.name and kind == "char"
        back = f"TEXT_PATH back to the text it was trained on (and delete {meta.data_dir})"
        named = "DATASET_NAME" if resume.state.init_from else "DATASET_NAME or DATA_DIR"
        how = f"set {back if nb02 else named + ' back to its data'}, or choose a new RUN_NAME"
    if not tokens_only:
        return ConfigError(f"{where}; {how}")
    return ConfigError(
        f"{where}; {how}, or pass --allow-data-change (train(..., options=StartOptions(allow_data_change=True))) "
        f"to go on with this data (recorded in the run's state)"
    )
