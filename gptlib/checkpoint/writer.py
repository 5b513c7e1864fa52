"""The loop waits only for a host copy of the state; writing, rotation and the copy to Drive run in threads."""

from __future__ import annotations

import contextlib
import errno
import threading
import time
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

from gptlib.checkpoint.format import (
    MIN_KEEP_LAST,
    is_milestone,
    list_checkpoints,
    model_sha256,
    rotate,
    save_checkpoint,
    verify_checkpoint,
)
from gptlib.checkpoint.mirror import MIRROR_CLOSE_TIMEOUT_S, NO_MIRROR_STATUS, Mirror
from gptlib.errors import CheckpointError, GptlibError, loud, override
from gptlib.fsutil import append_jsonl, check_writable
from gptlib.layout import EVAL_FILE, LOG_FILES, checkpoints_dir, step_of


def _storage_key(t: torch.Tensor) -> tuple:
    return str(t.device), t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def _map_tensors(o: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(o, torch.Tensor):
        return fn(o.detach())
    if isinstance(o, dict):
        return {k: _map_tensors(v, fn) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return type(o)(_map_tensors(v, fn) for v in o)
    return o


class CheckpointWriter:
    """Saves in a background thread, one save in flight. Its errors (a full disk) are raised at the next `save` or
    `wait`: a run that cannot save must not go on as if it could. Mirror errors are never raised here. A writer on no
    directory (run_dir None: the DDP ranks other than 0, rank 0 alone writes) only keeps the time of each save."""

    def __init__(
        self,
        run_dir: str | Path | None,
        keep_last: int = 2,
        keep_every: int = 0,
        mirror_dir: str | Path | None = None,
        unreadable: set[Path] = frozenset(),
        mirror_listed: int | None = None,
    ):
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.keep_last, self.keep_every = keep_last, keep_every
        # checkpoints that could not be read at resume: never deleted
        self.unreadable = set(unreadable)
        self.mirror = None
        if mirror_dir is not None:
            self.mirror = Mirror(
                self.run_dir, mirror_dir, keep_last, keep_every, self.unreadable, mirror_listed
            )
        self.last_saved: Path | None = None
        self.last_save = time.time()  # for save_every_minutes
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # the host copy of the state, reused by every save (see _snapshot)
        self._host: list[torch.Tensor] = []
        # training's end-of-run HellaSwag row: appended to eval.jsonl once its weights are saved, with their sha256
        self.eval_row: dict | None = None

    def _snapshot(self, obj: Any) -> Any:
        """Tensors copied into the host buffers of the previous save (allocating and page-faulting ~1.3 GB is most of a
        save's cost on CPU), tied weights once. Pageable: a copy from a GPU is synchronous (a few tenths of a second
        for gpt2-small's 1.3 GB; not measured on a GPU)."""
        unique: dict[tuple, torch.Tensor] = {}
        _map_tensors(obj, lambda t: unique.setdefault(_storage_key(t), t))
        shapes = [(t.dtype, t.shape) for t in unique.values()]
        if [(h.dtype, h.shape) for h in self._host] != shapes:
            self._host = [torch.empty(t.shape, dtype=t.dtype) for t in unique.values()]
        views = {key: host.copy_(src) for (key, src), host in zip(unique.items(), self._host)}
        return _map_tensors(obj, lambda t: views[_storage_key(t)])

    def save(self, ckpt: dict) -> None:
        self.wait()  # also frees the host buffers for reuse
        self.last_save = time.time()
        if self.run_dir is None:
            return
        n_threads = torch.get_num_threads()
        # a memory copy: as fast on one thread, and ~10x faster on a busy CPU
        torch.set_num_threads(1)
        try:
            host = self._snapshot(ckpt)
        finally:
            torch.set_num_threads(n_threads)
        # the logs' byte counts now (the loop flushed them): the thread copies exactly this prefix
        logs = [self.run_dir / name for name in LOG_FILES]
        sizes = {f.name: f.stat().st_size for f in logs if f.is_file()}
        row, self.eval_row = self.eval_row, None
        self._thread = threading.Thread(
            target=self._write, args=(host, sizes, row), daemon=True, name="gptlib-checkpoint"
        )
        self._thread.start()

    def _write(self, ckpt: dict, sizes: dict[str, int], eval_row: dict | None) -> None:
        try:
            check_writable(self.run_dir)  # another process took the run over: write nothing
            logs = {name: (self.run_dir / name).read_bytes()[:n] for name, n in sizes.items()}
            step, best_step = ckpt["progress"]["step"], ckpt["progress"]["best_step"]
            if milestone := is_milestone(step, self.keep_every):
                # kept for good, even if keep_every changes later
                ckpt["progress"]["milestone"] = True
            self.last_saved = save_checkpoint(checkpoints_dir(self.run_dir), ckpt, logs)
            if eval_row:  # before the mirror's copy, which copies eval.jsonl after it
                row = {**eval_row, "model_sha256": model_sha256(self.last_saved)}
                # a row lost costs notebook 04 a scoring, not the checkpoint its Drive copy and rotation
                try:
                    append_jsonl(self.run_dir / EVAL_FILE, row)
                except OSError as e:
                    loud(f"!! step {step}'s HellaSwag row not written to {EVAL_FILE}: {e}")
            protect = (
                self.mirror.submit(self.last_saved, best_step, milestone) if self.mirror else set()
            )
            rotate(
                self.run_dir,
                self.keep_last,
                best_step,
                protect=protect | self.unreadable,
                keep_every=self.keep_every,
                newest=step,
            )
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread
            self._error = e

    def wait(self) -> None:
        """Wait for the local save in flight (not the mirror's copy); raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            e, self._error = self._error, None
            self._raise_save_error(e)

    def _raise_save_error(self, e: BaseException) -> None:
        if isinstance(e, GptlibError):  # e.g. the lease was lost: its own message says it all
            raise e
        # a save broken by another process taking the run over (its start removed the partial files) is that
        check_writable(self.run_dir)
        where = ""
        for path in list_checkpoints(self.run_dir):
            with contextlib.suppress(CheckpointError, OSError):
                where = f"; the newest intact checkpoint is step {verify_checkpoint(path).step:,}"
                break
        failed = f"saving a checkpoint in {self.run_dir} failed"
        if getattr(e, "errno", None) != errno.ENOSPC:
            raise CheckpointError(f"{failed}: {e}{where}") from e
        fewer = f" or lower keep_last (now {self.keep_last}: {override('keep_last=N')})"
        fewer = fewer if self.keep_last > MIN_KEEP_LAST else ""
        fix = f"free space there (old runs or checkpoints){fewer}, then re-run{where}"
        raise CheckpointError(
            f"{failed}: the disk is full (no space left on its device); {fix}"
        ) from e

    def watch(self) -> None:
        """Give up a Drive copy that hangs (Mirror.watch): the training loop calls this at its log steps."""
        if self.mirror:
            self.mirror.watch()

    def mirror_existing(self, path: Path, best_step: int | None = None) -> None:
        if self.mirror:
            self.mirror.queue_existing(path, best_step)

    def status(self) -> dict:
        return {
            "local_step": step_of(self.last_saved) if self.last_saved else None,
            **(self.mirror.status() if self.mirror else NO_MIRROR_STATUS),
        }

    def status_line(self) -> str:
        return self.mirror.status_line() if self.mirror else ""

    def close(
        self,
        timeout: float | None = None,
        saving: ContextManager | None = None,
        given_up: threading.Event | None = None,
    ) -> dict:
        """Wait for the local save (raising its error; `saving`: the context to wait in), then up to `timeout` for
        the mirror's copy (not once `given_up` is set) -> status()."""
        try:
            with saving or contextlib.nullcontext():
                self.wait()
        finally:
            self._host = []  # ~1.3 GB (gpt2-small) not held after training
        if self.mirror:
            self.mirror.close(MIRROR_CLOSE_TIMEOUT_S if timeout is None else timeout, given_up)
        return self.status()
