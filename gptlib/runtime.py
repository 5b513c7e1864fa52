"""The runtime under training, inference and benchmarks: device, precision, autocast, matmul precision,
attention kernel, compile, seeding and RNG state.

At the bottom of the import tree (it imports torch, numpy and gptlib.errors only), so every module
that trains, loads or measures a model takes these decisions from one place.
"""

from __future__ import annotations

import contextlib
import random
import re

import numpy as np
import torch

from gptlib.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# compile="auto" compiles a CUDA run only when the run's training FLOPs reach this. Compiling costs
# ~0.5-2 minutes once per session and speeds a step up by ~1.2-2x, so it pays after a few minutes of
# eager training: 1e16 FLOPs is ~2 minutes on an A100 at a third of its bf16 peak, ~10 minutes on a T4.
# phase1 (~7e12) stays eager; phase2 (~1e17), gpt2-small/-medium and finetune (~3e16) compile.
COMPILE_MIN_FLOPS = 1e16

_DEVICE = re.compile(r"(cpu|cuda|mps)(:\d+)?")


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda, else mps, else cpu; an explicit device must exist here, else a ConfigError naming it.
    cuda:N becomes the current CUDA device, so kernels, torch.compile, CUDA graphs and the caching
    allocator all use that GPU, not GPU 0."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    name = str(name)
    m = _DEVICE.fullmatch(name)
    if m is None:
        raise ConfigError(f"device={name!r}: gptlib runs on auto, cpu, cuda, cuda:N or mps"
                          + (" (not on TPUs: on Colab, Runtime > Change runtime type > a GPU)"
                             if re.match(r"(tpu|xla)", name, re.I) else ""))
    kind, index = m.group(1), m.group(2)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={name!r} but CUDA is not available here (use --device cpu)")
        count = torch.cuda.device_count()
        if index is not None and int(index[1:]) >= count:
            gpus = ", ".join(f"cuda:{i}" for i in range(min(count, 8))) + (", ..." if count > 8 else "")
            raise ConfigError(f"device={name!r} but this machine has {count} GPU{'s' if count != 1 else ''} "
                              f"({gpus}); choose one of them, or cuda")
        device = torch.device(name)
        if index is not None:
            torch.cuda.set_device(device)
        return device
    if kind == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError(f"device={name!r} but MPS (Apple-silicon GPU) is not available here (use --device cpu)")
    return torch.device(name)


def native_bf16(device: torch.device) -> bool:
    """Whether this GPU computes bf16 in hardware (compute capability 8.0+: A100, L4, H100). What
    torch.cuda.is_bf16_supported(including_emulation=False) checks, for `device` rather than the
    current GPU. Without the flag that function also says yes on a T4, which only emulates bf16:
    slow, inductor will not compile it, and SDPA falls back to the math kernel (T x T matrices)."""
    if torch.version.hip:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.cuda.get_device_properties(device).major >= 8


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bf16 on GPUs that have it natively, fp16 (+ GradScaler) on older GPUs (the T4), fp32
    elsewhere. bfloat16 asked for on a GPU without it is a ConfigError naming the GPU and the choices."""
    cuda = device.type == "cuda"
    if name == "auto":
        if cuda:
            return torch.bfloat16 if native_bf16(device) else torch.float16
        return torch.float32
    dtype = DTYPES[name]
    if dtype == torch.bfloat16 and cuda and not native_bf16(device):
        p = torch.cuda.get_device_properties(device)
        raise ConfigError(f"dtype=bfloat16 but this GPU, {torch.cuda.get_device_name(device)} (compute capability "
                          f"{p.major}.{p.minor}), has no bf16 hardware (it needs 8.0+: A100, L4, H100): use "
                          f"--set dtype=float16 (trained with a GradScaler) or dtype=auto, which picks float16 here")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def autocast_for(device: torch.device, dtype: torch.dtype):
    """Mixed-precision autocast for a half dtype; a no-op context for float32. Reusable across `with` blocks."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def use_compile(setting: str, device: torch.device, run_flops: float | None = None) -> bool:
    """TrainConfig.compile ("auto" | "on" | "off") -> whether to torch.compile. "auto": on CUDA, for a run of at
    least COMPILE_MIN_FLOPS training FLOPs (measure.run_flops; None = unknown, compile)."""
    if setting != "auto":
        return setting == "on"
    return device.type == "cuda" and (run_flops is None or run_flops >= COMPILE_MIN_FLOPS)


def configure_matmul(device: torch.device) -> None:
    """fp32 matmuls on TF32 tensor cores on CUDA (Ampere and newer), through the precision API that replaced
    the allow_tf32 flags. The CPU keeps full fp32 ("highest"), its default."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")


# --- seeding and RNG state ----------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    """torch (CPU and CUDA), Python's random and numpy's global RNG."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (2**32))


def capture_rng(device: torch.device | None = None) -> tuple[dict, dict]:
    """-> (tensors for train_state.pt, JSON-able python/numpy state for state.json). `device`: the training
    device, whose CUDA state is saved (none for a CPU run)."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if device is not None and device.type == "cuda":  # only the training device's: N GPUs resume on fewer
        tensors["torch_cuda"] = torch.cuda.get_rng_state(device)  # host-side seed/offset: no device sync
    py = random.getstate()
    np_state = np.random.get_state()
    plain = {"python": [py[0], list(py[1]), py[2]],
             "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    return tensors, plain


def restore_rng(tensors: dict, plain: dict) -> None:
    """The host's generators: torch's CPU one, Python's and numpy's (the CUDA one: restore_cuda_rng)."""
    torch.set_rng_state(tensors["torch_cpu"])
    v, state, gauss = plain["python"]
    random.setstate((v, tuple(state), gauss))
    n = plain["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))


def restore_cuda_rng(tensors: dict, device: torch.device) -> None:
    """The saved CUDA generator state into the training device's generator only. Checkpoints made before
    this held a list, one state per GPU the saving process saw (get_rng_state_all, torchrun on N GPUs):
    this device's entry is taken, or entry 0 when the list is shorter; no other GPU is touched, so a
    checkpoint from 8 GPUs resumes on 1."""
    state = tensors.get("torch_cuda")
    if state is None or device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if isinstance(state, (list, tuple)):
        if not state:
            return
        state = state[index] if index < len(state) else state[0]
    torch.cuda.set_rng_state(state, torch.device("cuda", index))


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The original module under torch.compile and DDP wrappers: its state_dict has clean keys."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model
