"""Checkpoints: atomic, verified saves; newest-valid discovery; rotation; safe loading.

Layout inside a run directory:

    checkpoints/step_0001000/
        model.pt        state_dict of the original (uncompiled, unwrapped) module
        train_state.pt  optimizer, grad scaler, torch RNGs, sampler state (tensors and numbers only)
        state.json      step, tokens seen, best val loss, config, data identity, python/numpy RNG
        manifest.json   written last: format version, step, size and sha256 of each file above

A checkpoint is written into `step_XXXXXXX.partial-*`, every file fsynced, the manifest last,
then the directory is renamed. A directory without a manifest that verifies is ignored, so a kill
at any moment leaves the previous checkpoint as the newest valid one. Everything loads with
`torch.load(weights_only=True)`: a checkpoint cannot run code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .fsutil import atomic_write, atomic_write_json, fsync_dir, sha256_file

CKPT_FORMAT_VERSION = 1
CKPT_DIR = "checkpoints"
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d{7,})$")
PARTIAL_MARKER = ".partial-"
_STRIP_PREFIXES = ("_orig_mod.", "module.")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not match the run's config."""


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
        changed = True
        while changed:
            changed = False
            for p in _STRIP_PREFIXES:
                if k.startswith(p):
                    k = k[len(p):]
                    changed = True
        out[k] = v
    return out


def _to_cpu(obj: Any) -> Any:
    """Deep copy of tensors to host memory, so training can go on while they are written."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _torch_save_atomic(obj: Any, path: Path) -> None:
    atomic_write(path, lambda f: torch.save(obj, f))


def write_checkpoint(ckpt_root: Path, step: int, model_sd: dict, train_state: dict, state: dict) -> Path:
    """Write one checkpoint directory atomically (see the module docstring); returns its final path."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / ckpt_name(step)
    partial = ckpt_root / f"{ckpt_name(step)}{PARTIAL_MARKER}{os.getpid()}-{threading.get_ident()}"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    _torch_save_atomic(model_sd, partial / "model.pt")
    _torch_save_atomic(train_state, partial / "train_state.pt")
    atomic_write_json(partial / "state.json", state)
    files = {}
    for name in ("model.pt", "train_state.pt", "state.json"):
        p = partial / name
        files[name] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    manifest = {"format_version": CKPT_FORMAT_VERSION, "step": step, "time": time.time(), "files": files}
    atomic_write_json(partial / MANIFEST, manifest)
    if final.exists():  # a same-step checkpoint (e.g. re-saved after resume) is replaced whole
        old = ckpt_root / f"{ckpt_name(step)}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, final)
    fsync_dir(ckpt_root)
    return final


def verify_checkpoint(path: Path, deep: bool = True) -> CheckpointInfo:
    """Check the manifest and every file's size (and sha256 if deep); raise CheckpointError if bad."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (the save did not finish)")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from None
    if manifest.get("format_version") != CKPT_FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: format_version {manifest.get('format_version')} is not "
                              f"{CKPT_FORMAT_VERSION}")
    for name, rec in manifest.get("files", {}).items():
        p = path / name
        if not p.is_file():
            raise CheckpointError(f"{p}: listed in the manifest but missing")
        size = p.stat().st_size
        if size != rec["size"]:
            raise CheckpointError(f"{p}: size {size} bytes, manifest says {rec['size']} (truncated or incomplete)")
        if deep and sha256_file(p) != rec["sha256"]:
            raise CheckpointError(f"{p}: sha256 differs from the manifest (corrupted)")
    return CheckpointInfo(path=path, step=int(manifest["step"]), manifest=manifest)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Finished-looking checkpoint directories (not .partial), newest step first."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def find_latest_valid(run_dirs: list[str | Path] | str | Path, log=print) -> CheckpointInfo | None:
    """The newest checkpoint that verifies, across one or more run directories (e.g. Drive and local).

    Corrupt or incomplete ones are reported and skipped, so a bad newest falls back to the previous.
    """
    if isinstance(run_dirs, (str, Path)):
        run_dirs = [run_dirs]
    candidates = []
    for d in run_dirs:
        for p in list_checkpoints(d):
            candidates.append((int(_STEP_RE.match(p.name).group(1)), p))
    for _, p in sorted(candidates, key=lambda x: x[0], reverse=True):
        try:
            return verify_checkpoint(p)
        except CheckpointError as e:
            log(f"skipping checkpoint: {e}")
    return None


def load_checkpoint(path: Path, map_location="cpu") -> tuple[dict, dict, dict]:
    """-> (model state_dict, train_state, state). Safe: weights_only=True refuses pickled code."""
    try:
        model_sd = torch.load(path / "model.pt", map_location=map_location, weights_only=True)
        train_state = torch.load(path / "train_state.pt", map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means an unusable file
        raise CheckpointError(f"{path}: cannot load safely ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    state = json.loads((path / "state.json").read_text())
    return clean_state_dict(model_sd), train_state, state


def load_model_weights(path: Path, map_location="cpu") -> dict[str, torch.Tensor]:
    """Only the weights (for generation and export); accepts a checkpoint dir or a .pt file."""
    f = path / "model.pt" if path.is_dir() else path
    try:
        sd = torch.load(f, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{f}: cannot load safely ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    return clean_state_dict(sd)


def rotate(run_dir: str | Path, keep_last: int, best_step: int | None) -> list[Path]:
    """Delete all but the newest `keep_last` valid checkpoints and the best one; returns what was deleted.

    Called only after the newest checkpoint verified, so at least one good checkpoint always remains.
    """
    keep_last = max(2, keep_last)
    ckpts = list_checkpoints(run_dir)
    keep = set(ckpts[:keep_last])
    if best_step is not None:
        keep.add(Path(run_dir) / CKPT_DIR / ckpt_name(best_step))
    deleted = []
    for p in ckpts[keep_last:]:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)
            deleted.append(p)
    # Leftovers of interrupted saves.
    root = Path(run_dir) / CKPT_DIR
    for p in root.iterdir() if root.is_dir() else []:
        if PARTIAL_MARKER in p.name or ".old-" in p.name:
            shutil.rmtree(p, ignore_errors=True)
    return deleted


class CheckpointWriter:
    """Saves in a background thread: the loop only waits for the host copy of the state.

    One save is in flight at a time; `save` waits for the previous one first. Errors from the
    background are kept and raised at the next `save` or `wait`, never swallowed.
    """

    def __init__(self, run_dir: str | Path, keep_last: int = 2, background: bool = True, log=print):
        self.run_dir = Path(run_dir)
        self.keep_last = keep_last
        self.background = background
        self.log = log
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_saved: Path | None = None

    def save(self, step: int, model_sd: dict, train_state: dict, state: dict, best_step: int | None) -> None:
        self.wait()
        snapshot = (_to_cpu(model_sd), _to_cpu(train_state), json.loads(json.dumps(state)))
        if self.background:
            self._thread = threading.Thread(target=self._write, args=(step, *snapshot, best_step), daemon=True)
            self._thread.start()
        else:
            self._write(step, *snapshot, best_step)
            self._raise_pending()

    def _write(self, step, model_sd, train_state, state, best_step) -> None:
        try:
            path = write_checkpoint(self.run_dir / CKPT_DIR, step, model_sd, train_state, state)
            verify_checkpoint(path)
            rotate(self.run_dir, self.keep_last, best_step)
            self.last_saved = path
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread
            self._error = e

    def _raise_pending(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise CheckpointError(f"saving a checkpoint in {self.run_dir} failed: {e}") from e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_pending()
