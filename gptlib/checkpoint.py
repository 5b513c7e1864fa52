"""Checkpoints: atomic, verified saves; a background copy to Drive; newest-valid discovery; rotation.

Layout inside a run directory (the same on the local disk and on the Drive mirror):

    checkpoints/step_0001000/
        model.pt        state_dict of the original (uncompiled, unwrapped) module
        train_state.pt  optimizer, grad scaler, torch RNGs, sampler state (tensors and numbers only)
        state.json      step, tokens seen, best val loss, config, data identity, python/numpy RNG
        metrics.jsonl   the run's metrics up to this step (so a fresh VM resumes the loss curve too)
        manifest.json   written last: format version, step, size and sha256 of each file above

A checkpoint is written into `step_XXXXXXX.partial-*`, every file fsynced, the manifest last,
then the directory is renamed. A directory without a manifest that verifies is ignored, so a kill
at any moment leaves the previous checkpoint as the newest valid one. Everything loads with
`torch.load(weights_only=True)`: a checkpoint cannot run code.

With a mirror directory (Google Drive), each checkpoint is first written to the fast local disk,
then copied by a background thread to the mirror under a temp name, verified (size and sha256),
and renamed. Drive errors (Errno 107 "Transport endpoint is not connected", Errno 5, hangs) are
retried with backoff and reported loudly on stderr and in `CheckpointWriter.status()`; they never
stop training, and local checkpoints keep being written meanwhile.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .fsutil import TMP_MARKER, atomic_write, atomic_write_json, clean_temp_files, fsync_dir, sha256_file

CKPT_FORMAT_VERSION = 1
CKPT_DIR = "checkpoints"
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"step_(\d{7,})")  # fullmatch: a finished checkpoint
PARTIAL_MARKER = ".partial-"  # a checkpoint being written (or copied to the mirror)
OLD_MARKER = ".old-"  # a same-step checkpoint being replaced
DELETING_MARKER = ".deleting-"  # a rotated-out checkpoint being deleted
_ORPHAN_MARKERS = (PARTIAL_MARKER, OLD_MARKER, DELETING_MARKER, TMP_MARKER)
_STRIP_PREFIXES = ("_orig_mod.", "module.")
# Run-level files copied next to the mirror's checkpoints, so the Drive copy is a complete run dir
# (sampling and export need tokenizer.json and config.json; people look at the loss plot).
RUN_FILES = ("config.json", "tokenizer.json", "metrics.jsonl", "samples.jsonl", "samples.md", "loss.png")

# Drive copy policy; module-level so tests (and impatient users) can shorten them.
MIRROR_RETRY_DELAYS_S = (2.0, 5.0, 15.0, 30.0, 60.0)  # waits between attempts for one checkpoint
MIRROR_STALL_TIMEOUT_S = 180.0  # an attempt with no progress for this long is a hung Drive: abandoned
MIRROR_LIST_TIMEOUT_S = 60.0  # listing the mirror at resume; a hung Drive falls back to local only
MIRROR_CLOSE_TIMEOUT_S = 600.0  # at the end of training, wait at most this long for the last Drive copy
_COPY_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not match the run's config."""


class MirrorStalled(OSError):
    """A Drive operation made no progress for MIRROR_STALL_TIMEOUT_S seconds."""


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    manifest: dict[str, Any]

    @property
    def saved_at(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.manifest.get("time", 0)))


def ckpt_name(step: int) -> str:
    return f"step_{step:07d}"


def _loud(msg: str) -> None:
    """Problems that must not scroll by unnoticed: stderr (red in notebooks), flushed at once."""
    print(msg, file=sys.stderr, flush=True)


# --- fault injection (tests) -------------------------------------------------------------------


def fault_point(name: str, step: int | None = None) -> None:
    """Test hook. GPTLIB_FAULT="ACTION:POINT[@STEP],..." acts when execution reaches POINT (at STEP).

    ACTION: kill (SIGKILL this process), term (SIGTERM), interrupt (raise KeyboardInterrupt),
    enospc / eio / enotconn (raise that OSError), hang (block for an hour). Points: mid_step (train
    loop, between backward and optimizer step), save_mid (model.pt written, no manifest yet),
    after_rename (checkpoint renamed, rotation not yet run), rotate_mid (one file of an old
    checkpoint deleted; STEP is the deleted checkpoint's), mirror_mid (Drive copy half done). Unset in normal use: costs one lookup.
    """
    spec = os.environ.get("GPTLIB_FAULT")
    if not spec:
        return
    for item in spec.split(","):
        action, _, rest = item.strip().partition(":")
        point, _, at = rest.partition("@")
        if point != name or (at and step is not None and int(at) != step):
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10)  # the signal arrives asynchronously; never run past the fault point
        elif action == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif action == "interrupt":
            raise KeyboardInterrupt(f"GPTLIB_FAULT {item}")
        elif action in ("enospc", "eio", "enotconn"):
            code = {"enospc": errno.ENOSPC, "eio": errno.EIO, "enotconn": errno.ENOTCONN}[action]
            raise OSError(code, os.strerror(code))
        elif action == "hang":
            time.sleep(3600)


# --- state dict helpers ------------------------------------------------------------------------


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The original module under torch.compile and DDP wrappers: its state_dict has clean keys."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def clean_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accept weights saved by other tools from compiled or DDP-wrapped models."""
    out = {}
    for k, v in sd.items():
        while k.startswith(_STRIP_PREFIXES):  # nested wrappers: "module._orig_mod.x"
            k = k.partition(".")[2]
        out[k] = v
    return out


def load_weights_into(model: torch.nn.Module, sd: dict[str, torch.Tensor], source: str | Path) -> None:
    """load_state_dict with an error that names the tensor and both shapes instead of a torch dump."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    if missing or unexpected:
        raise CheckpointError(f"{source}: weights do not fit this model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]} (a different architecture?)")
    for k, v in own.items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{source}: {k} has shape {tuple(sd[k].shape)} in the checkpoint but "
                                  f"{tuple(v.shape)} in this model (different block_size/vocab_size/n_embd?)")
    model.load_state_dict(sd)


# --- writing, verifying, finding, loading ---------------------------------------------------------


def _torch_save_atomic(obj: Any, path: Path) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def _manifest_entry(p: Path) -> dict:
    return {"size": p.stat().st_size, "sha256": sha256_file(p)}


def write_checkpoint(ckpt_root: Path, step: int, model_sd: dict, train_state: dict, state: dict,
                     extra_files: dict[str, bytes] | None = None) -> Path:
    """Write one checkpoint directory atomically (see the module docstring); returns its final path.

    On any error the partial directory is removed (a full disk gets its space back) and the error
    is raised; an existing checkpoint is never touched until the new one is complete.
    """
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / ckpt_name(step)
    partial = ckpt_root / f"{ckpt_name(step)}{PARTIAL_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    partial.mkdir()
    try:
        _torch_save_atomic(model_sd, partial / "model.pt")
        fault_point("save_mid", step)
        _torch_save_atomic(train_state, partial / "train_state.pt")
        atomic_write_json(partial / "state.json", state)
        for name, data in (extra_files or {}).items():
            atomic_write(partial / name, lambda f, d=data: f.write(d))
        files = {p.name: _manifest_entry(p) for p in sorted(partial.iterdir()) if p.is_file()}
        manifest = {"format_version": CKPT_FORMAT_VERSION, "step": step, "time": time.time(), "files": files}
        atomic_write_json(partial / MANIFEST, manifest)
        _install(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return final


def _install(partial: Path, final: Path, truncate: bool = False) -> None:
    """Rename a complete partial dir to its final name; a same-step one is replaced whole."""
    if final.exists():  # e.g. re-saved after resume, or a corrupt copy being replaced
        old = final.with_name(f"{final.name}{OLD_MARKER}{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
        os.replace(partial, final)
        _remove_tree(old, truncate)
    else:
        os.replace(partial, final)
    fsync_dir(final.parent)


def verify_checkpoint(path: Path, deep: bool = True) -> CheckpointInfo:
    """Check the manifest and every file's size (and sha256 if deep); raise CheckpointError if bad."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (the save did not finish)")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != CKPT_FORMAT_VERSION:
        got = manifest.get("format_version") if isinstance(manifest, dict) else manifest
        raise CheckpointError(f"{mpath}: format_version {got!r} is not {CKPT_FORMAT_VERSION}")
    try:
        files = manifest["files"]
        step = int(manifest["step"])
        for required in ("model.pt", "train_state.pt", "state.json"):
            if required not in files:
                raise CheckpointError(f"{mpath}: does not list {required}")
        for name in files:  # before touching any file: a crafted manifest must not reach outside
            if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
                raise CheckpointError(f"{mpath}: file name {name!r} is not a plain name inside the checkpoint")
        for name, rec in files.items():
            p = path / name
            if not p.is_file():
                raise CheckpointError(f"{p}: listed in the manifest but missing")
            size = p.stat().st_size
            if size != rec["size"]:
                raise CheckpointError(f"{p}: size {size:,} bytes, manifest says {rec['size']:,} (truncated or incomplete)")
            if deep and sha256_file(p) != rec["sha256"]:
                raise CheckpointError(f"{p}: sha256 differs from the manifest (corrupted)")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{mpath}: malformed manifest ({type(e).__name__}: {e})") from None
    return CheckpointInfo(path=path, step=step, manifest=manifest)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Finished-looking checkpoint directories (not .partial), newest step first."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.fullmatch(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def _step_of(p: Path) -> int | None:
    """Step in a checkpoint's name, also for `step_0000020.partial-...` and friends."""
    m = _STEP_RE.match(p.name)
    return int(m.group(1)) if m else None


def _first_valid(run_dirs, log, load: Callable[[Path], Any]) -> Any:
    """load(p) of the newest checkpoint p across run_dirs for which it succeeds; None if none does.

    Newest step first; at equal steps the earlier-listed dir (local, fast) first. Checkpoints that
    fail (CheckpointError, OSError) are reported with `log` and skipped. Listing a mirror (every dir
    after the first) gives up after MIRROR_LIST_TIMEOUT_S: a hung Drive falls back to local only.
    """
    if isinstance(run_dirs, (str, Path)):
        run_dirs = [run_dirs]
    found = []
    for i, d in enumerate(run_dirs):
        if d is None:
            continue
        try:
            paths = call_with_timeout(lambda d=d: list_checkpoints(d), MIRROR_LIST_TIMEOUT_S) if i else list_checkpoints(d)
        except OSError as e:
            _loud(f"!! cannot list checkpoints in {d}: {e}; resuming from the other location(s) only")
            continue
        found += [(_step_of(p), i, p) for p in paths]
    for _, _, p in sorted(found, key=lambda x: (-x[0], x[1])):
        try:
            return load(p)
        except (CheckpointError, OSError) as e:
            log(f"skipping checkpoint: {e}")
    return None


def find_latest_valid(run_dirs: list[str | Path] | str | Path, log=print) -> CheckpointInfo | None:
    """The newest checkpoint that verifies, across one or more run directories (e.g. local and Drive).

    Corrupt or incomplete ones are reported and skipped, so a bad newest falls back to the previous.
    """
    return _first_valid(run_dirs, log, verify_checkpoint)


def _safe_load(f: Path, map_location) -> Any:
    """torch.load with weights_only=True: a pickle that would run code is refused (CheckpointError)."""
    try:
        return torch.load(f, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means an unusable file
        first = (str(e).splitlines() or [""])[0][:200]
        raise CheckpointError(f"{f}: cannot load safely ({type(e).__name__}: {first})") from None


def load_checkpoint(path: Path, map_location="cpu") -> tuple[dict, dict, dict]:
    """-> (model state_dict, train_state, state). Safe: weights_only=True refuses pickled code."""
    model_sd = _safe_load(path / "model.pt", map_location)
    train_state = _safe_load(path / "train_state.pt", map_location)
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as e:  # ValueError: bad JSON or UTF-8
        raise CheckpointError(f"{path / 'state.json'}: unreadable ({e})") from None
    if not isinstance(model_sd, dict) or not isinstance(train_state, dict) or not isinstance(state, dict):
        raise CheckpointError(f"{path}: model.pt / train_state.pt / state.json do not hold dicts")
    return clean_state_dict(model_sd), train_state, state


def load_latest(run_dirs, log=print, map_location="cpu") -> tuple[CheckpointInfo, dict, dict, dict] | None:
    """Newest checkpoint that verifies AND loads safely, falling back past bad ones; None if none.

    A checkpoint whose manifest matches but whose content is refused (e.g. a pickle that would run
    code) is skipped like a corrupt one, with the reason printed.
    """
    return _first_valid(run_dirs, log, lambda p: (verify_checkpoint(p), *load_checkpoint(p, map_location)))


def load_model_weights(path: Path, map_location="cpu") -> dict[str, torch.Tensor]:
    """Only the weights (for generation and export); accepts a checkpoint dir or a .pt file."""
    return clean_state_dict(_safe_load(path / "model.pt" if path.is_dir() else path, map_location))


# --- deleting, rotating, cleaning ------------------------------------------------------------------


def _remove_tree(path: Path, truncate: bool = False) -> None:
    """Delete a checkpoint dir: rename it away first (atomic: it stops looking like a checkpoint),
    then (on Drive) truncate each file to 0 bytes before unlinking it, because Drive keeps deleted
    files in its trash for 30 days and they count against the quota; an empty file costs nothing."""
    if not path.exists():
        return
    if DELETING_MARKER not in path.name:
        target = path.with_name(f"{path.name}{DELETING_MARKER}{uuid.uuid4().hex[:8]}")
        try:
            os.replace(path, target)
            path = target
        except OSError:
            pass
    for i, f in enumerate(sorted(path.rglob("*"), key=lambda q: q.name != MANIFEST)):
        if f.is_file():
            try:
                if truncate:
                    os.truncate(f, 0)
                f.unlink()
            except OSError:
                pass
            if i == 0:
                fault_point("rotate_mid", _step_of(path))
    shutil.rmtree(path, ignore_errors=True)


def clean_orphans(run_dir: str | Path, truncate: bool = False, run_level: bool = True) -> list[Path]:
    """Remove leftovers of interrupted saves, copies and deletions (`*.partial-*`, `*.tmp-*`, ...).

    run_level: also `*.tmp-*` files directly in run_dir. Only at start-up: during training the loop
    itself writes such temp files (loss.png, samples.md) and they must not vanish under it.
    """
    removed = []
    root = Path(run_dir) / CKPT_DIR
    for p in list(root.iterdir()) if root.is_dir() else []:
        if any(m in p.name for m in _ORPHAN_MARKERS):
            if p.is_dir():
                _remove_tree(p, truncate)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
        elif p.is_dir():  # temp files inside a finished checkpoint (a kill during a same-step re-save)
            removed += clean_temp_files(p)
    if run_level:
        removed += clean_temp_files(run_dir)
    return removed


def is_milestone(step: int | None, keep_every: int) -> bool:
    """A checkpoint kept for good (TrainConfig.keep_every), for comparing the model across training."""
    return bool(keep_every) and step is not None and step > 0 and step % keep_every == 0


def _marked_milestone(path: Path) -> bool:
    """Saved as a milestone (state.json says so): kept even if keep_every changed since."""
    try:
        return json.loads((path / "state.json").read_text()).get("milestone") is True
    except (OSError, ValueError, AttributeError):
        return False


def rotate(run_dir: str | Path, keep_last: int, best_step: int | None, protect: set[Path] = frozenset(),
           truncate: bool = False, keep_every: int = 0) -> list[Path]:
    """Delete all but the newest `keep_last` valid checkpoints, the best one and the milestones
    (steps that are multiples of `keep_every`, or saved as milestones); returns what was deleted.

    Called only after the newest checkpoint verified, so at least one good checkpoint always remains.
    Checkpoints that do not verify (cheap size check) do not count towards `keep_last`. `protect`
    holds paths still in use (e.g. being copied to Drive). `truncate` empties files before deleting
    them (Drive: see _remove_tree).
    """
    keep_last = max(2, keep_last)
    ckpts = list_checkpoints(run_dir)
    keep = {Path(p) for p in protect} | {p for p in ckpts if is_milestone(_step_of(p), keep_every)}
    if best_step is not None:
        keep.add(Path(run_dir) / CKPT_DIR / ckpt_name(best_step))
    n_valid = 0
    for p in ckpts:
        if n_valid >= keep_last:
            break
        try:
            verify_checkpoint(p, deep=False)
            keep.add(p)
            n_valid += 1
        except (CheckpointError, OSError):
            pass
    deleted = []
    if n_valid == 0:
        return deleted  # nothing verified: delete nothing
    for p in ckpts:
        if p not in keep and not _marked_milestone(p):  # read only for deletion candidates (Drive is slow)
            _remove_tree(p, truncate)
            deleted.append(p)
    clean_orphans(run_dir, truncate, run_level=False)
    return deleted


# --- copying to the mirror (Drive) ----------------------------------------------------------------


class _Cancelled(Exception):
    pass


class _Progress:
    """Shared between a copy attempt and its watchdog: last progress time and a cancel flag."""

    def __init__(self):
        self.t = time.monotonic()
        self.cancel = threading.Event()

    def tick(self) -> None:
        if self.cancel.is_set():
            raise _Cancelled()
        self.t = time.monotonic()


def call_with_timeout(fn: Callable[[], Any], timeout: float, progress: _Progress | None = None) -> Any:
    """Run fn in a daemon thread; MirrorStalled once it has gone `timeout` seconds without returning
    (or, given `progress`, without a progress.tick(); fn is then asked to stop at its next tick).

    A call stuck in a hung FUSE mount cannot be cancelled, only abandoned: it is left to finish
    (or not) on its own, and only ever touches temp names.
    """
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    progress = progress or _Progress()
    t = threading.Thread(target=run, daemon=True, name="gptlib-drive-io")
    t.start()
    while True:
        t.join(max(0.0, progress.t + timeout - time.monotonic()))
        if not t.is_alive():
            break
        if time.monotonic() - progress.t >= timeout:
            progress.cancel.set()
            raise MirrorStalled(errno.ETIMEDOUT, f"Drive made no progress for {timeout:g} s (hung mount?)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def copy_file_verified(src: Path, dst: Path, size: int | None = None, sha256: str | None = None,
                       progress: _Progress | None = None) -> None:
    """Copy src to dst (fsynced) hashing as it goes; OSError if the bytes read are not what the
    manifest says (the local copy changed) — the destination is then left for cleanup."""
    progress = progress or _Progress()
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
        fo.flush()
        os.fsync(fo.fileno())
    progress.tick()
    if size is not None and n != size:
        raise OSError(errno.EIO, f"{src}: read {n:,} bytes, manifest says {size:,}")
    if sha256 is not None and h.hexdigest() != sha256:
        raise OSError(errno.EIO, f"{src}: sha256 differs from the manifest while copying")


def mirror_checkpoint(src: Path, mirror_run_dir: Path, progress: _Progress | None = None) -> Path:
    """Copy a verified local checkpoint dir into mirror_run_dir/checkpoints: temp name, every file
    hashed while read and fsynced, manifest last, read back and verified (size + sha256), renamed."""
    progress = progress or _Progress()
    manifest = json.loads((src / MANIFEST).read_text())
    dst_root = mirror_run_dir / CKPT_DIR
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
        copy_file_verified(src / MANIFEST, partial / MANIFEST, progress=progress)
        fsync_dir(partial)
        verify_checkpoint(partial, deep=True)  # read back from the mirror: catches truncated writes
        progress.tick()
    except BaseException:
        try:  # best effort (Drive may be gone); leftovers are removed by the next rotation
            _remove_tree(partial, truncate=True)
        except OSError:
            pass
        raise
    _install(partial, final, truncate=True)
    verify_checkpoint(final, deep=False)
    return final


def _copy_run_file(src: Path, dst_dir: Path, nbytes: int | None, progress: _Progress) -> None:
    """The first `nbytes` (None: all) of a run-level file to the mirror, atomically (fsutil's temp
    marker, so a copy killed mid-way is cleaned up as an orphan)."""
    if not src.is_file():
        return
    with open(src, "rb") as f:
        data = f.read(nbytes)
    atomic_write(dst_dir / src.name, lambda f: f.write(data))
    progress.tick()


# --- the writer ----------------------------------------------------------------------------------


class CheckpointWriter:
    """Saves in background threads: the training loop only waits for the host copy of the state.

    Local: one save in flight at a time; `save` waits for the previous one first. Local errors
    (e.g. a full disk) are kept and raised at the next `save` or `wait` as CheckpointError: a run
    that cannot save must not go on as if it could.

    Mirror (optional, e.g. Drive): a second thread copies the newest verified local checkpoint,
    then rotates the mirror. If copies fall behind, only the newest is copied. Failures are retried
    with backoff (MIRROR_RETRY_DELAYS_S), a copy making no progress for MIRROR_STALL_TIMEOUT_S is
    abandoned as hung, and every failure is printed to stderr and kept in `status()`. They never
    raise into the training loop.
    """

    def __init__(self, run_dir: str | Path, keep_last: int = 2, background: bool = True, log=print,
                 mirror_dir: str | Path | None = None, snapshot_files: tuple[str, ...] = (), keep_every: int = 0):
        self.run_dir = Path(run_dir)
        self.mirror_dir = Path(mirror_dir) if mirror_dir is not None else None
        self.keep_last = max(2, keep_last)
        self.keep_every = keep_every  # milestones: kept by rotation, and each one copied to the mirror
        self.background = background
        self.log = log
        self.snapshot_files = snapshot_files  # run-dir files (metrics.jsonl) snapshotted into each checkpoint
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_saved: Path | None = None
        # mirror state, guarded by _cv
        self._cv = threading.Condition()
        self._pending: Path | None = None  # newest local checkpoint not yet copied
        # Milestones not yet on the mirror, oldest first. A newer checkpoint replaces _pending (only the
        # newest matters for resuming) but not these: they are copied after it.
        self._milestones: list[Path] = []
        self._milestones_paused = False  # after a failed copy, until the next save
        self._best_step: int | None = None  # the newest best step: what mirror rotation must keep
        self._busy: Path | None = None  # being copied now
        self._closing = False
        self._mirror_thread: threading.Thread | None = None
        self.mirror_last_step: int | None = None  # newest step verified on the mirror
        self.mirror_error: str | None = None  # last failure; None once a copy succeeds
        self.mirror_failures = 0  # failed attempts so far
        self._run_file_sizes: dict[str, int] = {}
        self._buffers: dict[tuple, torch.Tensor] = {}  # host copies, reused by every save (see _snapshot)

    def _snapshot(self, obj: Any, key: tuple = (), memo: dict | None = None) -> Any:
        """Copy the state to host memory, into buffers kept from the previous save.

        Reusing buffers avoids allocating (and page-faulting) ~1.5 GB per save, which is most of the
        cost on CPU; CUDA tensors go to pinned buffers with one sync at the end. Tensors that share
        storage (tied embedding and output weights) share one buffer, so they are saved once. Safe
        because `save` waits for the previous background write before overwriting the buffers.
        """
        top = memo is None
        memo = {} if top else memo
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            ident = (str(t.device), t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            if ident in memo:
                return memo[ident]
            buf = self._buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
                self._buffers[key] = buf
            buf.copy_(t, non_blocking=t.is_cuda)
            memo[ident] = buf
            out = buf
        elif isinstance(obj, dict):
            out = {k: self._snapshot(v, key + (k,), memo) for k, v in obj.items()}
        elif isinstance(obj, (list, tuple)):
            out = type(obj)(self._snapshot(v, key + (i,), memo) for i, v in enumerate(obj))
        else:
            out = obj
        if top and any(d.startswith("cuda") for d, *_ in memo):
            torch.cuda.synchronize()  # the non_blocking copies must land before the thread reads them
        return out

    # -- local --

    def save(self, step: int, model_sd: dict, train_state: dict, state: dict, best_step: int | None) -> None:
        self.wait()  # also frees the host buffers for reuse
        n_threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a memory copy: as fast on one thread, and ~10x faster on a busy CPU
        try:
            model_cpu, train_cpu = self._snapshot((model_sd, train_state))
        finally:
            torch.set_num_threads(n_threads)
        snapshot = (model_cpu, train_cpu, json.loads(json.dumps(state)))
        # Byte counts now (the loop flushed its logs): the background copies exactly this prefix.
        sizes = {}
        for name in self.snapshot_files:
            p = self.run_dir / name
            sizes[name] = p.stat().st_size if p.is_file() else None
        if self.background:
            self._thread = threading.Thread(target=self._write, args=(step, *snapshot, best_step, sizes),
                                            daemon=True, name="gptlib-checkpoint")
            self._thread.start()
        else:
            self._write(step, *snapshot, best_step, sizes)
            self._raise_pending()

    def _write(self, step, model_sd, train_state, state, best_step, sizes) -> None:
        try:
            extra = {}
            for name, n in sizes.items():
                if n is not None:
                    with open(self.run_dir / name, "rb") as f:
                        extra[name] = f.read(n)
            milestone = is_milestone(step, self.keep_every)
            if milestone:
                state["milestone"] = True  # kept for good, even if keep_every changes later
            path = write_checkpoint(self.run_dir / CKPT_DIR, step, model_sd, train_state, state, extra)
            verify_checkpoint(path)
            fault_point("after_rename", step)
            self.last_saved = path
            self._run_file_sizes = {k: v for k, v in sizes.items() if v is not None}
            with self._cv:
                self._best_step = best_step
                if self.mirror_dir is not None:
                    self._pending = path
                    self._milestones_paused = False
                    if milestone:
                        self._milestones.append(path)
                    self._ensure_mirror_thread()
                    self._cv.notify_all()
                protect = {p for p in (self._busy, self._pending) if p is not None}
            rotate(self.run_dir, self.keep_last, best_step, protect=protect, keep_every=self.keep_every)
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread
            self._error = e

    def _raise_pending(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            prev = _first_valid(self.run_dir, lambda m: None, lambda p: verify_checkpoint(p, deep=False))
            where = f"; the newest intact checkpoint is step {prev.step:,}" if prev is not None else ""
            hint = " (disk full: free space or lower --keep-last)" if getattr(e, "errno", None) == errno.ENOSPC else ""
            raise CheckpointError(f"saving a checkpoint in {self.run_dir} failed: {e}{hint}{where}") from e

    def wait(self) -> None:
        """Wait for the local save in flight (not for the mirror); raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_pending()

    # -- mirror --

    def mirror_existing(self, path: Path, best_step: int | None = None) -> None:
        """Queue an existing local checkpoint for the mirror (e.g. resumed locally, newer than Drive),
        and the local milestones (those already on the mirror are recognised and not copied again)."""
        if self.mirror_dir is None:
            return
        milestones = [p for p in reversed(list_checkpoints(self.run_dir)) if _marked_milestone(p)]
        with self._cv:
            if self._best_step is None:
                self._best_step = best_step
            if self._pending is None or _step_of(self._pending) < _step_of(path):
                self._pending = path
            self._milestones += [p for p in milestones if p not in self._milestones]
            self._ensure_mirror_thread()
            self._cv.notify_all()

    def _ensure_mirror_thread(self) -> None:
        if self._mirror_thread is None or not self._mirror_thread.is_alive():
            self._mirror_thread = threading.Thread(target=self._mirror_loop, daemon=True, name="gptlib-mirror")
            self._mirror_thread.start()

    def _mirror_loop(self) -> None:
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
                outcome = self._mirror_with_retries(path)
                with self._cv:
                    if outcome == "copied":
                        self._milestones = [m for m in self._milestones if m != path]
                    elif outcome == "failed":  # Drive is failing: milestones wait for the next save, not a loop
                        self._milestones_paused = True
            finally:
                with self._cv:
                    self._busy = None
                    self._cv.notify_all()

    def _mirror_with_retries(self, path: Path) -> str:
        """Copy one checkpoint to the mirror, retrying -> "copied", "failed" (gave up) or "superseded"
        (a newer checkpoint arrived during a retry wait: that one is copied instead)."""
        step = _step_of(path)
        attempts = len(MIRROR_RETRY_DELAYS_S) + 1
        for attempt in range(1, attempts + 1):
            try:
                self._mirror_attempt(path)
                if self.mirror_error is not None:
                    _loud(f"Drive copy OK again: {ckpt_name(step)} verified in {self.mirror_dir}")
                self.mirror_error = None
                self.mirror_last_step = max(step, self.mirror_last_step or 0)
                return "copied"
            except Exception as e:  # noqa: BLE001 - reported, retried, never raised into training
                self.mirror_failures += 1
                self.mirror_error = f"{type(e).__name__}: {e}"
                if attempt == attempts:
                    _loud(f"!! DRIVE COPY FAILED for {ckpt_name(step)} after {attempts} attempts: {self.mirror_error}. "
                          f"Training goes on and checkpoints keep being saved locally in {self.run_dir}; the newest on "
                          f"Drive is step {self.mirror_last_step}. The next checkpoint will be tried again.")
                    return "failed"
                delay = MIRROR_RETRY_DELAYS_S[attempt - 1]
                _loud(f"!! Drive copy of {ckpt_name(step)} failed (attempt {attempt}/{attempts}): {self.mirror_error}; "
                      f"retrying in {delay:g} s (local checkpoint is safe in {path.parent})")
                with self._cv:  # a newer checkpoint arriving meanwhile replaces this one: copy only the newest
                    if self._cv.wait_for(lambda: self._pending is not None and _step_of(self._pending) > step,
                                         timeout=delay):
                        return "superseded"

    def _mirror_attempt(self, path: Path) -> None:
        progress = _Progress()
        sizes = dict(self._run_file_sizes)

        def attempt():
            mirror_checkpoint(path, self.mirror_dir, progress)
            with self._cv:
                best_step = self._best_step  # the newest: a milestone copied late must not drop today's best
            rotate(self.mirror_dir, self.keep_last, best_step, truncate=True,  # also cleans checkpoint orphans
                   keep_every=self.keep_every)
            clean_temp_files(self.mirror_dir)  # run-level ones too: this thread is the mirror's only writer
            for name in RUN_FILES:
                _copy_run_file(self.run_dir / name, self.mirror_dir, sizes.get(name), progress)

        call_with_timeout(attempt, MIRROR_STALL_TIMEOUT_S, progress)

    def status(self) -> dict:
        """For the loop to show: newest local and mirror steps, and the last mirror error (None if fine)."""
        with self._cv:
            lagging = (self._pending is not None or self._busy is not None
                       or bool(self._milestones) and not self._milestones_paused)
        return {"local_step": _step_of(self.last_saved) if self.last_saved else None,
                "mirror_dir": str(self.mirror_dir) if self.mirror_dir else None,
                "mirror_step": self.mirror_last_step, "mirror_copying": lagging,
                "mirror_error": self.mirror_error, "mirror_failures": self.mirror_failures}

    def status_line(self) -> str:
        """'' without a mirror; 'drive: step N' when fine; a loud line when the last copy failed."""
        if self.mirror_dir is None:
            return ""
        s = self.status()
        if s["mirror_error"]:
            return f"DRIVE COPY FAILING (newest on Drive: step {s['mirror_step']}): {s['mirror_error']}"
        return f"drive: step {s['mirror_step']}" + (" (copying)" if s["mirror_copying"] else "")

    def close(self, timeout: float | None = None) -> dict:
        """Wait for the local save (raising its error), then up to `timeout` (MIRROR_CLOSE_TIMEOUT_S)
        for the mirror to copy the newest checkpoint (never raises for the mirror). Returns status()."""
        self.wait()
        timeout = MIRROR_CLOSE_TIMEOUT_S if timeout is None else timeout
        if self._mirror_thread is not None:
            with self._cv:
                self._closing = True
                self._cv.notify_all()
            self._mirror_thread.join(timeout)
            if self._mirror_thread.is_alive():
                _loud(f"!! Drive copy still running after {timeout:g} s; it goes on in the background while this "
                      f"process lives, but the newest checkpoint or milestones may exist only in {self.run_dir}")
            else:
                self._mirror_thread = None
                with self._cv:
                    self._closing = False
            local = self.status()["local_step"]
            if local is not None and self.mirror_last_step != local:
                _loud(f"!! the newest checkpoint (step {local}) is NOT on Drive ({self.mirror_dir}), only in "
                      f"{self.run_dir} (lost if this VM goes away). Last Drive error: {self.mirror_error}. "
                      f"Re-run training (it resumes from the local checkpoint and copies it) once Drive works.")
            with self._cv:
                left = [_step_of(p) for p in self._milestones]
            if left:
                _loud(f"!! milestone checkpoints {left} are NOT on Drive yet, only in {self.run_dir}; re-running "
                      f"training copies them once Drive works")
        return self.status()


# --- stopping cleanly -------------------------------------------------------------------------


class GracefulStop:
    """SIGINT (Colab's stop button, Ctrl-C) and SIGTERM (runtime shutdown) ask the loop to stop.

    The first signal only sets `reason`; the loop finishes the current optimizer step, saves a
    checkpoint and returns, so the saved state is exactly a step boundary. A second SIGINT raises
    KeyboardInterrupt at once (for a loop stuck elsewhere). Handlers can only be installed from the
    main thread; elsewhere this does nothing and KeyboardInterrupt behaves as usual.
    """

    def __init__(self):
        self.reason: str | None = None  # "interrupt" | "sigterm" once asked to stop
        self._old: dict[int, Any] = {}

    def install(self) -> "GracefulStop":
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except (ValueError, OSError):
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.reason is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.reason = "sigterm" if signum == signal.SIGTERM else "interrupt"
        _loud(f"{signal.Signals(signum).name}: finishing this step, saving a checkpoint, then stopping"
              + (" (press stop again to abort without saving)" if signum == signal.SIGINT else ""))

    def restore(self) -> None:
        for sig, old in self._old.items():
            if old is not None:
                try:
                    signal.signal(sig, old)
                except (ValueError, OSError):
                    pass
        self._old.clear()
