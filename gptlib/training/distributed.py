"""DistributedDataParallel under `torchrun`, one process per GPU: rank 0 writes, each rank samples its own stream,
time-based decisions are agreed at log steps (the hot loop has no extra syncs). Without torchrun: no-ops."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    initialized_here: bool = False  # setup() called init_process_group, so teardown() destroys it

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, dev: torch.device) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.enabled and dev.type == "cuda" else dev

    def wrap(self, model: torch.nn.Module, dev: torch.device) -> torch.nn.Module:
        if not self.enabled:
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return t
        t = t.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t / self.world_size

    def agree(self, step: int, every: int, *flags: bool) -> tuple[bool, ...]:
        """Time-based decisions made identical on every rank (any rank's True -> all), at log steps only."""
        if not self.enabled:
            return flags
        if step % every != 0:
            return (False,) * len(flags)
        dev = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        t = torch.tensor([int(f) for f in flags], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return tuple(bool(v) for v in t.tolist())

    def min_int(self, value: int) -> int:
        return min(self.sampler_states(int(value))) if self.enabled else value

    def sampler_states(self, state):
        """Every rank's `state`, gathered (None when not distributed)."""
        if not self.enabled:
            return None
        out = [None] * self.world_size
        dist.all_gather_object(out, state)
        return out

    def teardown(self) -> None:
        if self.initialized_here and dist.is_initialized():
            # Every rank waits here first: a rank that destroys the group and exits while another is still
            # finishing (rank 0 writes the last checkpoint) makes gloo abort the other process.
            # a rank already failed: no one to wait for
            with contextlib.suppress(RuntimeError, dist.DistBackendError):
                dist.barrier()
            dist.destroy_process_group()
            self.initialized_here = False


def setup(device: str = "auto") -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
    here = not dist.is_initialized()
    if here:
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Dist(rank=rank, local_rank=local_rank, world_size=world, initialized_here=here)
