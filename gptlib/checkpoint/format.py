"""Checkpoints on disk: atomic, verified saves; listing; safe loading.

A checkpoint is written into `step_XXXXXXX.partial-*`, every file fsynced, the manifest (format
version, step, size and sha256 of every file) last, then the directory is renamed. A directory
without a manifest that verifies is ignored, so a kill at any moment leaves the previous checkpoint
as the newest valid one. Everything loads with `torch.load(weights_only=True)`: a checkpoint cannot
run code.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gptlib.errors import CheckpointError
from gptlib.fsutil import (TMP_MARKER, atomic_write, atomic_write_bytes, atomic_write_json, fsync_dir,
                           read_bytes_with_timeout, sha256_file)
from gptlib.layout import (CHECKPOINT_FILES, DAMAGED_MARKER, DELETING_MARKER, MANIFEST_FILE, MODEL_FILE, OLD_MARKER,
                           PARTIAL_MARKER, STATE_FILE, TRAIN_STATE_FILE, checkpoint_name, checkpoints_dir,
                           is_checkpoint_name, step_of)

CKPT_FORMAT_VERSION = 1
MIN_KEEP_LAST = 2  # checkpoints rotation always keeps, so one survives a bad save (TrainConfig.keep_last's floor)
DRIVE_LIST_TIMEOUT_S = 60.0  # listing a mirror at resume; a hung Drive falls back to the other location(s)
DRIVE_READ_STALL_S = 60.0  # reading a checkpoint from Drive that makes no progress for this long is abandoned
ORPHAN_MARKERS = (PARTIAL_MARKER, OLD_MARKER, DELETING_MARKER, TMP_MARKER)
_STRIP_PREFIXES = ("_orig_mod.", "module.")


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    manifest: dict[str, Any]

    @property
    def saved_at(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.manifest.get("time", 0)))


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


def _torch_save_atomic(obj: Any, path: Path) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def write_checkpoint(ckpt_root: Path, step: int, model_sd: dict, train_state: dict, state: dict,
                     extra_files: dict[str, bytes] | None = None) -> Path:
    """Write one checkpoint directory atomically (see the module docstring); returns its final path. On any error
    the partial directory is removed (a full disk gets its space back); an existing one is untouched until then."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / checkpoint_name(step)
    partial = ckpt_root / f"{checkpoint_name(step)}{PARTIAL_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    partial.mkdir()
    try:
        _torch_save_atomic(model_sd, partial / MODEL_FILE)
        _torch_save_atomic(train_state, partial / TRAIN_STATE_FILE)
        atomic_write_json(partial / STATE_FILE, state)
        for name, data in (extra_files or {}).items():
            atomic_write_bytes(partial / name, data)
        files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
                 for p in sorted(partial.iterdir()) if p.is_file()}
        manifest = {"format_version": CKPT_FORMAT_VERSION, "step": step, "time": time.time(), "files": files}
        atomic_write_json(partial / MANIFEST_FILE, manifest)
        install(partial, final)
    except BaseException as e:
        full = _disk_nearly_full(ckpt_root)  # measured before the partial files are removed
        shutil.rmtree(partial, ignore_errors=True)
        if full and getattr(e, "errno", None) != errno.ENOSPC:
            # torch reports a full disk as "enforce fail ... unexpected pos": say what it is
            raise OSError(errno.ENOSPC, f"no space left on the device of {ckpt_root} ({type(e).__name__}: "
                                        f"{str(e).splitlines()[0][:120] if str(e) else ''})") from e
        raise
    return final


def _disk_nearly_full(path: Path) -> bool:
    """Less than 64 MB or 0.5% of the disk left: a write that failed there most likely ran out of space."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return False
    return usage.free < max(64 << 20, usage.total // 200)


def install(partial: Path, final: Path, truncate: bool = False) -> None:
    """Rename a complete partial dir to its final name; a same-step one is replaced whole."""
    if final.exists():  # e.g. re-saved after resume, or a corrupt copy being replaced
        old = final.with_name(f"{final.name}{OLD_MARKER}{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
        os.replace(partial, final)
        remove_tree(old, truncate)
    else:
        os.replace(partial, final)
    fsync_dir(final.parent)


def read_manifest(path: Path) -> dict:
    """A checkpoint's manifest.json, of this format version; CheckpointError if it is not (OSError if it cannot
    be read: a missing or hung file is not a damaged checkpoint)."""
    mpath = path / MANIFEST_FILE
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != CKPT_FORMAT_VERSION:
        got = manifest.get("format_version") if isinstance(manifest, dict) else manifest
        raise CheckpointError(f"{mpath}: format_version {got!r} is not {CKPT_FORMAT_VERSION}")
    return manifest


def verify_checkpoint(path: Path, deep: bool = True) -> CheckpointInfo:
    """Check the manifest and every file's size (and sha256 if deep); raise CheckpointError if bad."""
    mpath = path / MANIFEST_FILE
    if not mpath.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST_FILE} (the save did not finish)")
    manifest = read_manifest(path)
    try:
        files, step = manifest["files"], manifest["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0 or step_of(path) not in (None, step):
            raise CheckpointError(f"{mpath}: step {step!r} is not the directory's ({path.name}): damaged or mixed up")
        for required in CHECKPOINT_FILES:
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
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if p.is_dir() and is_checkpoint_name(p.name)]
    return [p for _, p in sorted(found, reverse=True)]


def _safe_load(f: Path | io.BytesIO, map_location, where: Path | None = None) -> Any:
    """torch.load with weights_only=True: a pickle that would run code is refused (CheckpointError)."""
    try:
        return torch.load(f, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means an unusable file
        first = (str(e).splitlines() or [""])[0][:200]
        raise CheckpointError(f"{where or f}: cannot load safely ({type(e).__name__}: {first})") from None


def load_checkpoint(path: Path, map_location="cpu") -> tuple[dict, dict, dict]:
    """-> (model state_dict, train_state, state). Safe: weights_only=True refuses pickled code."""
    model_sd = _safe_load(path / MODEL_FILE, map_location)
    train_state = _safe_load(path / TRAIN_STATE_FILE, map_location)
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:  # ValueError: bad JSON or UTF-8
        raise CheckpointError(f"{path / STATE_FILE}: unreadable ({e})") from None
    if not isinstance(model_sd, dict) or not isinstance(train_state, dict) or not isinstance(state, dict):
        raise CheckpointError(f"{path}: model.pt / train_state.pt / state.json do not hold dicts")
    return clean_state_dict(model_sd), train_state, state


def load_model_weights(path: Path, map_location="cpu", sha256: str | None = None) -> dict[str, torch.Tensor]:
    """Only the weights (for generation and export); accepts a checkpoint dir or a .pt file. The file is
    read once, with a watchdog (a hung Drive read is abandoned after DRIVE_READ_STALL_S), checked against
    `sha256` if given, and unpickled safely."""
    f = path / MODEL_FILE if path.is_dir() else path
    data = read_bytes_with_timeout(f, DRIVE_READ_STALL_S)
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointError(f"{f}: sha256 differs from the manifest (corrupted)")
    return clean_state_dict(_safe_load(io.BytesIO(data), map_location, where=f))


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to step_N.damaged-TIME: kept for its owner to look at, ignored by resume,
    rotation and clean-up, and a new checkpoint of the same step is never taken for it. -> the new path."""
    target = path.with_name(f"{path.name}{DAMAGED_MARKER}{time.strftime('%Y%m%d-%H%M%S')}")
    os.rename(path, target)
    fsync_dir(path.parent)
    return target


def remove_tree(path: Path, truncate: bool = False) -> None:
    """Delete a checkpoint dir: rename it away first (atomic: it stops looking like a checkpoint),
    then (on Drive) truncate each file to 0 bytes before unlinking it, because Drive keeps deleted
    files in its trash for 30 days and they count against the quota; an empty file costs nothing."""
    if not path.exists():
        return
    if DELETING_MARKER not in path.name:
        target = path.with_name(f"{path.name}{DELETING_MARKER}{uuid.uuid4().hex[:8]}")
        with suppress(OSError):
            os.replace(path, target)
            path = target
    for f in sorted(path.rglob("*"), key=lambda q: q.name != MANIFEST_FILE):
        if f.is_file():
            with suppress(OSError):
                if truncate:
                    os.truncate(f, 0)
                f.unlink()
    shutil.rmtree(path, ignore_errors=True)
