"""What a piece of code would make a GPU wait for, seen without a GPU.

`DeviceOps` is a TorchDispatchMode: every aten op that runs inside it is recorded, and two kinds are picked out:

- host_to_device: copies from a CPU tensor to another device. Tests put the "device" data on the meta device,
  the one non-host device every torch build has: the code takes its real device path (shapes, dtypes, every op)
  and each host -> device copy shows as an aten op with a CPU source and a meta destination.
- syncs: ops whose CUDA implementation reads a device value back to the host before it returns, so the host
  waits for every kernel queued before it: `.item()`/`bool()` (_local_scalar_dense), nonzero, masked_select,
  indexing with a boolean mask (it runs nonzero to size its output), and multinomial (it checks the
  probabilities with `.item()` inside its kernel). CPU tensors run the same ops, so this shows on the CPU.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.multinomial"}
BOOL_INDEX_OPS = {"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"}


def _tensors(xs) -> list[torch.Tensor]:
    out = []
    for x in xs:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(_tensors(x))
    return out


class DeviceOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.syncs: list[str] = []
        self.host_to_device: list[tuple[str, tuple]] = []  # (op, shape of what was copied)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        self.ops.append(name)
        if name in SYNC_OPS or (
            name in BOOL_INDEX_OPS and any(t.dtype == torch.bool for t in _tensors(args[1:2]))
        ):
            self.syncs.append(name)
        if name in ("aten._to_copy", "aten.copy_"):
            src = args[1] if name == "aten.copy_" else args[0]
            dst = args[0] if name == "aten.copy_" else out
            if src.device.type == "cpu" and dst.device.type != "cpu":
                self.host_to_device.append((name, tuple(src.shape)))
        return out
