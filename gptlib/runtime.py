"""The runtime under training, inference and benchmarks: device, precision, autocast, matmul precision, compile."""

from __future__ import annotations

import contextlib
import re

import torch
from torch.nn.parallel import DistributedDataParallel

from gptlib.errors import ConfigError, in_notebook, override

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# compile="auto" compiles a CUDA run only when the run's training FLOPs reach this. Compiling costs
# ~0.5-2 minutes once per session and speeds a step up by ~1.2-2x, so it pays after a few minutes of
# eager training: 1e16 FLOPs is ~2 minutes on an A100 at a third of its bf16 peak, ~10 minutes on a T4.
# phase1 (~7e12) stays eager; phase2 (~1e17), gpt2-small/-medium and finetune (~3e16) compile.
COMPILE_MIN_FLOPS = 1e16


def resolve_device(name: str) -> torch.device:
    """ "auto" -> cuda, else mps, else cpu; an explicit device must exist here, else a ConfigError naming it.
    cuda:N becomes the current CUDA device, so kernels, torch.compile and the caching allocator use that GPU."""
    mps = torch.backends.mps.is_available()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")
    m = re.fullmatch(r"(cpu|cuda|mps)(:\d+)?", str(name))
    if m is None:
        tpu = re.match(r"(tpu|xla)", name, re.I)
        hint = " (not on TPUs: on Colab, Runtime > Change runtime type > a GPU)" if tpu else ""
        raise ConfigError(f"device={name!r}: gptlib runs on auto, cpu, cuda, cuda:N or mps{hint}")
    kind, index = m.groups()
    if not {"cpu": True, "cuda": torch.cuda.is_available(), "mps": mps}[kind]:
        what = "CUDA" if kind == "cuda" else "MPS (Apple-silicon GPU)"
        # a notebook's DEVICE: on Colab, it is the runtime that lacks the GPU
        how = 'on Colab: Runtime > Change runtime type > a GPU; or set DEVICE = "cpu"'
        how = how if in_notebook() else "use --device cpu"
        raise ConfigError(f"device={name!r} but {what} is not available here ({how})")
    if kind == "cuda" and index is not None:
        if int(index[1:]) >= (count := torch.cuda.device_count()):
            raise ConfigError(
                f"device={name!r} but this machine has {count} GPU{'s' if count != 1 else ''} "
                f"(cuda:0 to cuda:{count - 1}); choose one of them, or cuda"
            )
        torch.cuda.set_device(torch.device(name))
    return torch.device(name)


def native_bf16(device: torch.device) -> bool:
    """Compute capability 8.0+ (A100, L4, H100). torch.cuda.is_bf16_supported() also says yes on a T4, which only
    emulates bf16: slow, inductor will not compile it, and SDPA falls back to the math kernel (T x T matrices)."""
    return torch.cuda.get_device_properties(device).major >= 8


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto": bf16 on GPUs that have it natively, fp16 (+ GradScaler) on older GPUs (the T4), fp32 elsewhere."""
    cuda = device.type == "cuda"
    if name == "auto":
        return (torch.bfloat16 if native_bf16(device) else torch.float16) if cuda else torch.float32
    if name == "bfloat16" and cuda and not native_bf16(device):
        p = torch.cuda.get_device_properties(device)
        raise ConfigError(
            f"dtype=bfloat16 but this GPU, {torch.cuda.get_device_name(device)} (compute capability "
            f"{p.major}.{p.minor}), has no bf16 hardware (it needs 8.0+: A100, L4, H100): use "
            f"{override('dtype=float16')} (trained with a GradScaler) or dtype=auto, which picks float16 here"
        )
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def autocast_for(device: torch.device, dtype: torch.dtype):
    """Mixed-precision autocast for a half dtype; a no-op context for float32. Reusable across `with` blocks."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def use_compile(setting: str, device: torch.device, run_flops: float | None = None) -> bool:
    """TrainConfig.compile "auto": on CUDA, for a run of at least COMPILE_MIN_FLOPS (None: unknown, compile)."""
    if setting != "auto":
        return setting == "on"
    return device.type == "cuda" and (run_flops is None or run_flops >= COMPILE_MIN_FLOPS)


def configure_matmul(device: torch.device) -> None:
    """fp32 matmuls on TF32 tensor cores on CUDA; the CPU keeps full fp32 ("highest"), its default."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "_orig_mod") or isinstance(model, DistributedDataParallel):
        model = model._orig_mod if hasattr(model, "_orig_mod") else model.module
    return model
