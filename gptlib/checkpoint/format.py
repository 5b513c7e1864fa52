"""A checkpoint is one dict of parts, each a state_dict(): {"model", "optimizer", "scaler", "sampler", "rng",
"progress" (TrainState), "sampler_ranks" (DDP only)}, written by save_checkpoint and read by load_checkpoint.
On disk (checkpoints/step_0001000/): model.pt, train_state.pt (the other parts), state.json (the progress), the logs,
and manifest.json last, with each file's size and sha256. Written under a temporary name and renamed when complete: a
kill leaves the previous checkpoint the newest. Loaded with weights_only=True: a checkpoint cannot run code."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import os
import shutil
import stat
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gptlib import __version__
from gptlib.config import RunConfig
from gptlib.errors import CheckpointError, UnreadableError
from gptlib.fsutil import (
    TMP_MARKER,
    atomic_file,
    atomic_write_json,
    check_writable,
    clean_temp_files,
    fsync_dir,
    read_bytes_with_timeout,
    replace,
)
from gptlib.layout import (
    CHECKPOINT_FILES,
    DELETING_MARKER,
    MANIFEST_FILE,
    MODEL_FILE,
    OLD_MARKER,
    PARTIAL_MARKER,
    STATE_FILE,
    TRAIN_STATE_FILE,
    checkpoint_name,
    checkpoints_dir,
    is_checkpoint_name,
    step_of,
)

# train_state.pt's; {} in a weights-only checkpoint
TRAIN_PARTS = ("optimizer", "scaler", "sampler", "rng")
# rotation always keeps this many, so one survives a bad save (TrainConfig.keep_last's floor)
MIN_KEEP_LAST = 2
# one Drive listing or small read is given up after this (resume lists again until DRIVE_RESUME_WAIT_S)
DRIVE_LIST_TIMEOUT_S = 60.0
DRIVE_READ_STALL_S = 60.0  # a read from Drive that makes no progress for this long is abandoned
ORPHAN_MARKERS = (PARTIAL_MARKER, OLD_MARKER, DELETING_MARKER, TMP_MARKER)


@dataclass
class TrainState:  # the run's progress: a checkpoint's "progress" part (state.json)
    step: int = 0  # optimizer steps completed (the LR schedule's position)
    tokens_seen: int = 0  # training tokens consumed, over all sessions
    elapsed_s: float = 0.0  # training wall time, over all sessions
    # validation loss measured at `step`; None if this save did not validate
    val_loss: float | None = None
    best_val_loss: float | None = None
    best_step: int | None = None  # the step that reached it (rotation keeps that checkpoint)
    milestone: bool = False  # saved as a milestone (TrainConfig.keep_every): kept for good
    config: dict[str, Any] = field(default_factory=dict)  # the run's RunConfig.to_dict()
    # DatasetMeta.identity(): resuming on other data is refused
    data: dict[str, Any] = field(default_factory=dict)
    data_dir: str = ""  # where the data was (the tokenizer's fallback location)
    # tokenizer identity {kind, hash, vocab_size, file}
    tokenizer: dict[str, Any] = field(default_factory=dict)
    # the weights the run started from (--init-from, import-hf)
    init_from: dict[str, Any] = field(default_factory=dict)
    # resumes on other data (--allow-data-change)
    data_changes: list[dict[str, Any]] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, d: dict[str, Any]) -> None:
        # Fields this gptlib does not have (an earlier one's "rng" and "pending_losses") are ignored.
        for f in dataclasses.fields(self):
            if f.name in d:
                setattr(self, f.name, d[f.name])

    @classmethod
    def from_json(cls, d: Any, source: str) -> "TrainState":
        """A state.json's contents; CheckpointError if they are not a training checkpoint's."""
        required = ("step", "tokens_seen", "config")
        missing = [name for name in required if not isinstance(d, dict) or name not in d]
        if missing:
            raise CheckpointError(
                f"{source}: field {missing[0]!r} is missing (not a gptlib training checkpoint, or "
                f"damaged); resume from another checkpoint or start a new run directory"
            )
        state = cls()
        state.load_state_dict(d)
        return state

    def run_config(self, source: str) -> RunConfig:
        return RunConfig.from_dict(self.config, source=source)


class RNG:
    """The generators dropout draws from: torch's CPU one and the training GPU's (only that device's: a checkpoint made
    on N GPUs resumes on fewer)."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        state = {"torch_cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            # host-side seed/offset: no device sync
            state["torch_cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, d: dict[str, Any]) -> None:
        torch.set_rng_state(d["torch_cpu"])
        cuda = d.get("torch_cuda")
        if cuda is None or self.device.type != "cuda":
            return
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        # an earlier gptlib saved one state per GPU the process saw: ours, else GPU 0's
        if isinstance(cuda, (list, tuple)):
            cuda = cuda[index] if index < len(cuda) else cuda[0]
        torch.cuda.set_rng_state(cuda, torch.device("cuda", index))


def save_checkpoint(root: Path, ckpt: dict, logs: dict[str, bytes] | None = None) -> Path:
    """-> root/step_N, with `logs` ({file name: bytes}) beside the parts. On any error the partial directory is
    removed; one of the same step is untouched until the rename."""
    step = ckpt["progress"]["step"]
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    partial = root / f"{final.name}{PARTIAL_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    train = {k: ckpt.get(k) or {} for k in TRAIN_PARTS}
    if ckpt.get("sampler_ranks") is not None:
        train["sampler_ranks"] = ckpt["sampler_ranks"]
    progress = (json.dumps(ckpt["progress"], indent=2) + "\n").encode()
    parts = {
        MODEL_FILE: ckpt["model"],
        TRAIN_STATE_FILE: train,
        STATE_FILE: progress,
        **(logs or {}),
    }
    partial.mkdir()
    try:
        files = {name: write_hashed(partial / name, content) for name, content in parts.items()}
        # format_version: what gptlib 0.1.0 checks before reading; gptlib_version: the gptlib that wrote it
        manifest = dict(format_version=1, gptlib_version=__version__, step=step, time=time.time())
        atomic_write_json(partial / MANIFEST_FILE, {**manifest, "files": files})
        install(partial, final)
    except BaseException as e:
        full = _disk_nearly_full(root)  # measured before the partial files are removed
        shutil.rmtree(partial, ignore_errors=True)
        # torch says "enforce fail at inline_container.cc ... unexpected pos": nothing a user can act on (the
        # chained error keeps it for a debugger)
        if full and getattr(e, "errno", None) != errno.ENOSPC:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(root)) from e
        raise
    return final


class _Hashing:
    """A file that hashes what is written to it."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.size += (n := self.f.write(b))
        return n

    def flush(self) -> None:
        self.f.flush()


def write_hashed(path: Path, content: bytes | dict) -> dict:
    """content (bytes, or the tensors torch.save writes) into path, hashed on its way to the disk: the manifest's
    record of the file (size, sha256) costs no second read."""
    with atomic_file(path) as f:
        hashing = _Hashing(f)
        if isinstance(content, bytes):
            hashing.write(content)
        else:
            torch.save(content, hashing)
    return {"size": hashing.size, "sha256": hashing.sha.hexdigest()}


def _disk_nearly_full(path: Path) -> bool:
    """Less than 64 MB or 0.5% of the disk left: a write that failed there most likely ran out of space."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return False
    return usage.free < max(64 << 20, usage.total // 200)


def install(partial: Path, final: Path, truncate: bool = False) -> None:
    """Rename a complete partial dir to its final name; a same-step one is replaced whole, never half."""
    if final.exists():  # re-saved after a resume, or a damaged copy being replaced
        old = final.with_name(f"{final.name}{OLD_MARKER}{uuid.uuid4().hex[:8]}")
        replace(final, old)
        replace(partial, final)
        remove_tree(old, truncate)
    else:
        replace(partial, final)
    fsync_dir(final.parent)


def load_checkpoint(path: Path) -> dict:
    """The dict of parts, with "logs" ({name: bytes}), "info" (CheckpointInfo) and "state" (the progress as a
    TrainState). Each file is read once and checked against the manifest: CheckpointError if it is damaged, OSError
    if it cannot be read (a hung Drive)."""
    info = verify_checkpoint(path)
    data = {}
    for name, rec in info.manifest["files"].items():
        f = path / name
        data[name] = blob = read_bytes_with_timeout(f, DRIVE_READ_STALL_S)
        check_file(f, (len(blob), hashlib.sha256(blob).hexdigest()), rec["size"], rec["sha256"])
    model = _safe_load(data.pop(MODEL_FILE), path / MODEL_FILE)
    train = _safe_load(data.pop(TRAIN_STATE_FILE), path / TRAIN_STATE_FILE)
    try:
        state = json.loads(data.pop(STATE_FILE))
    except ValueError as e:  # bad JSON or UTF-8
        raise CheckpointError(f"{path / STATE_FILE}: unreadable ({e})") from None
    progress = TrainState.from_json(state, str(path / STATE_FILE))
    # state.json edited and its hash with it: the manifest's step is the directory's
    if progress.step != info.step:
        raise CheckpointError(
            f"{path / STATE_FILE}: step {progress.step!r} but its checkpoint is step {info.step:,} "
            f"(manifest and directory name); damaged or mixed up, so it is passed over"
        )
    return {
        "model": model,
        **{k: train.get(k) or {} for k in TRAIN_PARTS},
        "progress": progress.state_dict(),
        "sampler_ranks": train.get("sampler_ranks"),
        "logs": data,  # the run's logs up to this step: {file name: bytes}
        "info": info,  # its path, step and manifest
        "state": progress,  # the progress as a TrainState
    }


def check_file(f: Path, got: tuple[int, str], size: int, sha256: str) -> None:
    if got[0] != size:
        raise CheckpointError(
            f"{f}: {got[0]:,} bytes, manifest says {size:,} (truncated or incomplete)"
        )
    if got[1] != sha256:
        raise CheckpointError(f"{f}: sha256 differs from the manifest (corrupted)")


def _safe_load(data: bytes, where: Path) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means an unusable file
        first = (str(e).splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"{where}: cannot load safely ({type(e).__name__}: {first})"
        ) from None


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    manifest: dict[str, Any]

    @property
    def saved_at(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.manifest.get("time", 0)))


def read_manifest(path: Path) -> dict:
    """CheckpointError if its bytes are wrong; UnreadableError (an OSError) if it is not there or not a regular file:
    on a Drive that does not answer (or is still syncing) neither means damage, and opening a FIFO would block."""
    mpath = path / MANIFEST_FILE
    try:
        regular = stat.S_ISREG(mpath.stat().st_mode)
    except FileNotFoundError:
        raise UnreadableError(
            f"{mpath} is not there now (a Drive that does not answer or is still syncing; a save "
            f"never leaves a checkpoint without it)"
        ) from None
    if not regular:
        raise UnreadableError(f"{mpath} is not a regular file now (a Drive that does not answer?)")
    try:
        return json.loads(mpath.read_text())
    except ValueError as e:  # bad JSON or UTF-8
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from None


def model_sha256(path: Path) -> str:
    """The weights' identity: the sha256 the manifest records for model.pt (eval.jsonl's model_sha256)."""
    return read_manifest(path)["files"][MODEL_FILE]["sha256"]


def verify_checkpoint(path: Path) -> CheckpointInfo:
    """The cheap check (after every save, by rotation): the manifest and every file's size; CheckpointError if not."""
    manifest, mpath = read_manifest(path), path / MANIFEST_FILE
    try:
        files, step = manifest["files"], manifest["step"]
        if step_of(path) not in (None, step):
            raise CheckpointError(
                f"{mpath}: step {step!r} is not the directory's ({path.name}): damaged or mixed up"
            )
        if missing := [name for name in CHECKPOINT_FILES if name not in files]:
            raise CheckpointError(f"{mpath}: does not list {missing[0]}")
        for name in files:  # before touching any file: a crafted manifest must not reach outside
            if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
                raise CheckpointError(
                    f"{mpath}: file name {name!r} is not a plain name inside the checkpoint"
                )
        for name, rec in files.items():
            # not there, or not a regular file: not known to be damaged
            if not (path / name).is_file():
                raise UnreadableError(
                    f"{path / name}: listed in the manifest but not a file there now (a Drive "
                    f"that does not answer or is still syncing?)"
                )
            if (size := (path / name).stat().st_size) != rec["size"]:
                raise CheckpointError(
                    f"{path / name}: size {size:,} bytes, manifest says {rec['size']:,} "
                    f"(truncated or incomplete)"
                )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{mpath}: malformed manifest ({type(e).__name__}: {e})") from None
    return CheckpointInfo(path=path, step=step, manifest=manifest)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's checkpoints, newest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_checkpoint_name(p.name)]
    return sorted(found, key=step_of, reverse=True)


def load_model_weights(path: Path, rec: dict | None = None) -> dict[str, torch.Tensor]:
    """The weights alone; checked against rec, the file's manifest record (size, sha256), when given."""
    f = path / MODEL_FILE if path.is_dir() else path
    data = read_bytes_with_timeout(f, DRIVE_READ_STALL_S)
    if rec is not None:
        check_file(f, (len(data), hashlib.sha256(data).hexdigest()), rec["size"], rec["sha256"])
    return _safe_load(data, f)


def load_weights_into(
    model: torch.nn.Module, sd: dict[str, torch.Tensor], source: str | Path
) -> None:
    """load_state_dict, with an error naming the tensor and both shapes instead of torch's dump."""
    own = model.state_dict()
    missing, unexpected = [k for k in own if k not in sd], [k for k in sd if k not in own]
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: weights do not fit this model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]} (a different architecture?)"
        )
    for k, v in own.items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise CheckpointError(
                f"{source}: {k} has shape {tuple(sd[k].shape)} in the checkpoint but "
                f"{tuple(v.shape)} in this model (different block_size/vocab_size/n_embd?)"
            )
    model.load_state_dict(sd)


def remove_tree(path: Path, truncate: bool = False) -> None:
    """Renamed away first (it stops looking like a checkpoint at once); truncate (Drive): files emptied before unlink,
    as Drive's trash keeps deleted files for 30 days and they count against the quota."""
    if not path.exists():
        return
    if DELETING_MARKER not in path.name:
        target = path.with_name(f"{path.name}{DELETING_MARKER}{uuid.uuid4().hex[:8]}")
        with suppress(OSError):
            replace(path, target)
            path = target
    for f in sorted(path.rglob("*"), key=lambda q: q.name != MANIFEST_FILE):
        if f.is_file():
            with suppress(OSError):
                if truncate:
                    os.truncate(f, 0)
                f.unlink()
    shutil.rmtree(path, ignore_errors=True)


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
