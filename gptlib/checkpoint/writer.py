"""Saving a run while it trains: when (the save policy), how (a background writer), and the null writer
that DDP ranks other than 0 use. The loop waits only for the host copy of the state; writing, hashing,
verification, rotation and the copy to Drive (gptlib.checkpoint.mirror) happen in background threads.
"""

from __future__ import annotations

import contextlib
import errno
import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

from gptlib.checkpoint.format import MIN_KEEP_LAST, list_checkpoints, verify_checkpoint, write_checkpoint
from gptlib.checkpoint.mirror import MIRROR_CLOSE_TIMEOUT_S, NO_MIRROR_STATUS, Mirror
from gptlib.checkpoint.rotation import is_milestone, rotate
from gptlib.checkpoint.state import Checkpoint
from gptlib.config import TrainConfig
from gptlib.errors import CheckpointError, GptlibError
from gptlib.layout import checkpoints_dir, step_of


def _storage_key(t: torch.Tensor) -> tuple:
    return str(t.device), t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def _map_tensors(o: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """The structure o (nested dicts, lists, tuples) with fn(tensor.detach()) in place of each tensor."""
    if isinstance(o, torch.Tensor):
        return fn(o.detach())
    if isinstance(o, dict):
        return {k: _map_tensors(v, fn) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return type(o)(_map_tensors(v, fn) for v in o)
    return o


class CheckpointWriter:
    """Saves in a background thread, one save in flight at a time. Its errors (e.g. a full disk) are raised at
    the next `save` or `wait` as CheckpointError: a run that cannot save must not go on as if it could. With a
    mirror_dir (Google Drive), each verified checkpoint is then copied there by a Mirror, which never raises here.
    """

    def __init__(self, run_dir: str | Path, keep_last: int = 2, background: bool = True, log=print,
                 mirror_dir: str | Path | None = None, snapshot_files: tuple[str, ...] = (), keep_every: int = 0,
                 guard: Callable[[Path], None] | None = None, unreadable: set[Path] = frozenset(),
                 mirror_listed: int | None = None):
        self.run_dir = Path(run_dir)
        self.keep_last = keep_last  # rotate() keeps at least checkpoint.MIN_KEEP_LAST whatever this says
        self.keep_every = keep_every  # milestones: kept by rotation, and each one copied to the mirror
        self.background = background
        self.log = log
        self.snapshot_files = snapshot_files  # run-dir logs (layout.LOG_FILES) copied into each checkpoint
        # guard(directory) raises (gptlib.lease.LeaseLost) when this process may no longer write there
        self.guard = guard or (lambda directory: None)
        self.unreadable = set(unreadable)  # checkpoints that could not be read at resume: never deleted
        self.mirror = (Mirror(self.run_dir, Path(mirror_dir), keep_last, keep_every, self.guard, self.unreadable,
                              mirror_listed) if mirror_dir is not None else None)
        self.last_saved: Path | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._host: list[torch.Tensor] = []  # the host copy of the state, reused by every save (see _snapshot)
        self._layout: tuple | None = None

    def _snapshot(self, obj: Any) -> Any:
        """The state (nested dicts/lists of tensors) copied to host tensors kept from the previous save: reusing them
        avoids allocating and page-faulting ~1.5 GB per save (most of its cost on CPU). On a GPU they are pinned, so
        the copies run asynchronously. Tensors sharing storage (tied weights) are copied once. Safe because `save`
        waits for the previous write first."""
        unique: dict[tuple, torch.Tensor] = {}
        _map_tensors(obj, lambda t: unique.setdefault(_storage_key(t), t))
        sources = list(unique.values())
        layout = tuple((t.dtype, tuple(t.shape), t.is_cuda) for t in sources)
        if layout != self._layout:  # new host tensors only when the layout changed
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in sources]
            self._layout = layout
        views = dict(zip(unique, self._host))
        for src, dst in zip(sources, views.values()):
            dst.copy_(src, non_blocking=src.is_cuda)
        for device in {t.device for t in sources if t.is_cuda}:
            torch.cuda.synchronize(device)  # each device copied from: the thread reads the buffer next
        return _map_tensors(obj, lambda t: views[_storage_key(t)])

    def save(self, checkpoint: Checkpoint) -> None:
        """Copy the checkpoint's tensors to host memory (all the caller waits for), then write it in the background."""
        self.wait()  # also frees the host buffers for reuse
        model_sd, train_state, state = checkpoint.files()
        n_threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a memory copy: as fast on one thread, and ~10x faster on a busy CPU
        try:
            model_cpu, train_cpu = self._snapshot((model_sd, train_state))
        finally:
            torch.set_num_threads(n_threads)
        step, best_step = checkpoint.step, checkpoint.progress.best_step
        snapshot = (model_cpu, train_cpu, json.loads(json.dumps(state)))
        # Byte counts now (the loop flushed its logs): the background copies exactly this prefix.
        sizes = {n: (self.run_dir / n).stat().st_size for n in self.snapshot_files if (self.run_dir / n).is_file()}
        self._thread = threading.Thread(target=self._write, args=(step, *snapshot, best_step, sizes), daemon=True,
                                        name="gptlib-checkpoint")
        self._thread.start()
        if not self.background:
            self.wait()

    def _write(self, step, model_sd, train_state, state, best_step, sizes) -> None:
        try:
            self.guard(self.run_dir)  # another process took the run over: write nothing
            extra = {}
            for name, n in sizes.items():
                with open(self.run_dir / name, "rb") as f:
                    extra[name] = f.read(n)
            milestone = is_milestone(step, self.keep_every)
            if milestone:
                state["milestone"] = True  # kept for good, even if keep_every changes later
            path = write_checkpoint(checkpoints_dir(self.run_dir), step, model_sd, train_state, state, extra)
            verify_checkpoint(path, deep=False)  # the manifest's hashes are of what was written: sizes are enough
            self.last_saved = path
            protect = self.mirror.submit(path, best_step, milestone) if self.mirror else set()
            rotate(self.run_dir, self.keep_last, best_step, protect=protect | self.unreadable,
                   keep_every=self.keep_every, newest=step)
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread
            self._error = e

    def _raise_pending(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, GptlibError):  # e.g. the lease was lost: its own message says it all
                raise e
            where = ""
            for path in list_checkpoints(self.run_dir):
                with contextlib.suppress(CheckpointError, OSError):
                    where = f"; the newest intact checkpoint is step {verify_checkpoint(path, deep=False).step:,}"
                    break
            fewer = f" or lower --keep-last (now {self.keep_last})" if self.keep_last > MIN_KEEP_LAST else ""
            hint = f" (disk full: free space{fewer})" if getattr(e, "errno", None) == errno.ENOSPC else ""
            raise CheckpointError(f"saving a checkpoint in {self.run_dir} failed: {e}{hint}{where}") from e

    def wait(self) -> None:
        """Wait for the local save in flight (not for the mirror); raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_pending()

    def mirror_existing(self, path: Path, best_step: int | None = None) -> None:
        """Resumed from a local checkpoint: make sure the mirror gets it, and the local milestones."""
        if self.mirror:
            self.mirror.queue_existing(path, best_step)

    def status(self) -> dict:
        """Newest local and mirror steps, and the last mirror error (None if fine)."""
        return {"local_step": step_of(self.last_saved) if self.last_saved else None,
                **(self.mirror.status() if self.mirror else NO_MIRROR_STATUS)}

    def status_line(self) -> str:
        """'' without a mirror; 'drive: step N' when fine; a loud line when the last copy failed."""
        return self.mirror.status_line() if self.mirror else ""

    def close(self, timeout: float | None = None, saving: ContextManager = contextlib.nullcontext()) -> dict:
        """Wait for the local save (raising its error; `saving`: the context that wait runs in), then up to `timeout`
        (MIRROR_CLOSE_TIMEOUT_S) for the mirror to copy the newest checkpoint (never raises for the mirror).
        Returns status()."""
        try:
            with saving:
                self.wait()
        finally:
            pinned = self._layout is not None and any(on_gpu for *_, on_gpu in self._layout)
            self._host, self._layout = [], None  # the host copy's memory is not held after training
            if pinned and hasattr(torch._C, "_host_emptyCache"):
                # torch's caching host allocator keeps freed pinned blocks (each rounded up to a power of two:
                # ~1.9 GiB for gpt2-small's 1.24 GiB state) for reuse and never returns them to the OS; the notebook's
                # session lives on in the same process, with the data in RAM
                torch._C._host_emptyCache()
        if self.mirror:
            self.mirror.close(MIRROR_CLOSE_TIMEOUT_S if timeout is None else timeout, self.status()["local_step"])
        return self.status()


class NullCheckpointWriter(CheckpointWriter):
    """The writer of DDP ranks other than 0: rank 0 alone writes checkpoints, the others save nothing."""

    def __init__(self):
        super().__init__(".", background=False)

    def save(self, checkpoint: Checkpoint) -> None:
        pass


class Checkpointer:
    """Saves a training run: when (this policy), what (the snapshot the loop builds), where (the writer).

    Due at each validation, every `save_every_steps` steps (0: eval_interval), after `save_every_minutes`, at
    milestones and before stopping. The caller asks `time_due()` so that under DDP every rank agrees first
    (the snapshot gathers every rank's sampler: a collective).
    """

    def __init__(self, writer: CheckpointWriter | NullCheckpointWriter, tc: TrainConfig):
        self.writer = writer
        self.every_steps = tc.save_every_steps or tc.eval_interval
        self.every_minutes = tc.save_every_minutes
        self.keep_every = tc.keep_every
        self.last_save = time.time()

    def time_due(self) -> bool:
        return self.every_minutes > 0 and time.time() - self.last_save >= 60 * self.every_minutes

    def due(self, step: int, *, validated: bool, time_due: bool, stopping: bool) -> bool:
        return (stopping or validated or step % self.every_steps == 0 or time_due
                or is_milestone(step, self.keep_every))

    def save(self, checkpoint: Checkpoint) -> None:
        self.writer.save(checkpoint)
        self.last_save = time.time()

    def status_line(self) -> str:
        return self.writer.status_line()

    def close(self, saving: ContextManager = contextlib.nullcontext()) -> dict:
        """Wait for the save in flight (its error raises; `saving`: the context of that wait) and, for a while, the
        Drive copy."""
        return self.writer.close(saving=saving)
