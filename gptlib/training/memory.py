"""GPU memory: what training needs, the largest micro-batch that fits, what to try after an OOM. An OOM must leave
the notebook's runtime usable: every probe drops its tensors and the exception, then empties the CUDA cache."""

from __future__ import annotations

import dataclasses
import gc
from typing import Callable

import torch

from gptlib.errors import OutOfMemoryAdvice, in_notebook, override
from gptlib.model import GPT
from gptlib.runtime import autocast_for, resolve_dtype


def free_memory() -> None:
    gc.collect()  # first: reference cycles may hold tensors
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# cuBLAS creates its handle and workspace, and cuDNN (attention on an H100) its own, outside torch's caching allocator
# (autograd's backward thread makes its own): when the GPU is full that fails as a RuntimeError naming one of these
# statuses, not as torch.OutOfMemoryError.
LIBRARY_OOM = (
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
)


def is_oom(err: BaseException | None) -> bool:
    """An OOM anywhere in err's chain: torch.compile re-raises one as another exception (__cause__), and one may
    surface while another error is handled (__context__)."""
    seen = set()
    while err is not None and id(err) not in seen:  # a chain can loop back on itself
        seen.add(id(err))
        text = str(err)
        if isinstance(err, torch.OutOfMemoryError) or "out of memory" in text.lower():
            return True
        if any(status in text for status in LIBRARY_OOM):
            return True
        err = err.__cause__ or err.__context__
    return False


def oom_advice(cfg, world_size: int = 1) -> str:
    """The next setting to try after an out-of-memory error, keeping the tokens per step."""
    micro, accum, block = cfg.train.batch_size, cfg.train.grad_accum_steps, cfg.model.block_size
    if micro == 1:
        # fp32 alone is bigger than dtype=auto's bf16 (a T4's fp16: the same); the probe is eager, compiled or not
        amp = f"half precision ({override('dtype=auto')}), " if cfg.train.dtype == "float32" else ""
        return (
            f"out of GPU memory even at micro-batch 1 x {block} tokens: use a smaller model or context (a new "
            f"{'RUN_NAME' if in_notebook() else 'run dir'} with {override(f'block_size={max(1, block // 2)}')}), "
            f"{amp}or a GPU with more memory."
        )
    # the largest divisor of micro up to its half: the tokens per step and per validation stay exactly the same
    half = max(d for d in range(1, micro // 2 + 1) if micro % d == 0)
    k, evals = micro // half, cfg.train.eval_batches
    # else the probe takes the largest size it measures as fitting again
    off = ["auto_batch=false"] if cfg.train.auto_batch else []
    smaller = override(
        *off, f"batch_size={half}", f"grad_accum_steps={accum * k}", f"eval_batches={evals * k}"
    )
    # notebook 03's AUTO_BATCH checkbox sets it after OVERRIDES (02 and 05 have none: it is one of their OVERRIDES)
    if off and in_notebook():
        smaller += " (in notebook 03: AUTO_BATCH = False too)"
    auto = f", or {override('auto_batch=true')} to find the largest that fits"
    auto = "" if cfg.train.auto_batch else auto
    return (
        f"out of GPU memory at micro-batch {micro} x {block} tokens. Next setting to try: {smaller} (same "
        f"{cfg.tokens_per_step * world_size:,} tokens per step){auto}. The last checkpoint is intact: re-run to "
        f"resume."
    )


def device_memory(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).total_memory


# The probe runs the model eagerly (a compile per candidate size would cost too much), an upper bound: inductor
# recomputes cheap pointwise results in the backward instead of saving them. The rest of the GPU is room for
# fragmentation and what runs beside the step (cuBLAS workspaces, compile's kernel benchmarking).
PROBE_HEADROOM = 0.92


class CudaMemoryProbe:
    def __init__(self, device: torch.device):
        self.device, self.total = device, device_memory(device)

    def reset(self, batch: int) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


# device type -> its memory probe; elsewhere only an OOM says it does not fit
MEMORY_PROBES = {"cuda": CudaMemoryProbe}


def fit_micro_batch(cfg, model: GPT, device: torch.device, ddp, log) -> tuple[object, int]:
    """auto_batch (or check_fits' tight estimate): the largest micro-batch that fits, measured on the run's own model
    before its optimizer exists (under DDP every rank's smallest), the sequences per step kept; without a memory probe
    (no GPU) the sizes are kept. The probe's dropout draws are undone: training draws what it would without it.
    -> (the config, the probe's measured peak bytes)."""
    tc = cfg.train
    if device.type not in MEMORY_PROBES:
        log(
            f"auto micro-batch: no memory probe on {device.type}; keeping batch_size={tc.batch_size}, "
            f"grad_accum_steps={tc.grad_accum_steps}"
        )
        return cfg, 0
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    micro, _, peak = probe_micro_batch(model, cfg, device, resolve_dtype(tc.dtype, device), log)
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state(cuda_rng, device)
    micro = ddp.min_int(micro)
    accum = tc.batch_size * tc.grad_accum_steps // micro
    # the validation's sequences kept too (rounded up): a session on another GPU validates on the same ones
    evals = -(-tc.eval_batches * tc.batch_size // micro)
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(tc, batch_size=micro, grad_accum_steps=accum, eval_batches=evals),
    ), peak


def probe_micro_batch(
    model: torch.nn.Module,
    cfg,
    device: str | torch.device,
    dtype: torch.dtype = torch.float32,
    log: Callable[[str], None] = print,
) -> tuple[int, int, int]:
    """The largest divisor of the config's sequences per step whose forward + backward fits: no OOM and a peak within
    PROBE_HEADROOM of the GPU. -> (micro_batch, grad_accum_steps, its peak bytes; 0 without a memory probe)."""
    device, block = torch.device(device), cfg.model.block_size
    per_step = cfg.train.batch_size * cfg.train.grad_accum_steps
    # auto_batch off (check_fits' tight estimate): none above the size asked, which an OOM's advice may have lowered
    top = per_step if cfg.train.auto_batch else cfg.train.batch_size
    memory = MEMORY_PROBES[device.type](device) if device.type in MEMORY_PROBES else None
    n_params = sum(p.numel() for p in model.parameters())
    # AdamW's two moments
    reserve = torch.empty(2 * n_params, device=device) if device.type == "cuda" else None
    was_training = model.training
    model.train()
    try:
        for b in (b for b in range(top, 0, -1) if per_step % b == 0):
            why, peak = _try_micro_batch(model, b, block, device, dtype, memory)
            if not why:
                log(
                    f"auto micro-batch: {b} x {block} tokens fits (eager peak within {PROBE_HEADROOM:.0%} of the "
                    f"GPU); grad_accum_steps={per_step // b} keeps {per_step * block:,} tokens per step"
                )
                return b, per_step // b, peak
            log(f"auto micro-batch: {b} x {block} does not fit ({why})")
    finally:
        del reserve  # the stand-in for the optimizer moments goes first
        model.train(was_training)
        free_memory()
    nothing_fits = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=1))
    raise OutOfMemoryAdvice(oom_advice(nothing_fits))


def _try_micro_batch(
    model, b: int, block_size: int, device: torch.device, dtype: torch.dtype, memory
) -> tuple[str, int]:
    """One forward + backward of b sequences -> (why it does not fit, "" if it fits; its peak bytes, 0 unmeasured)."""
    why, peak = "", 0
    x = torch.randint(0, model.config.vocab_size, (b, block_size), device=device)
    if memory is not None:
        memory.reset(b)
    try:
        with autocast_for(device, dtype):
            model(x, x)[1].backward()
        if memory is not None:
            peak = memory.peak()
            if peak > PROBE_HEADROOM * memory.total:
                why = f"peak {peak / 2**30:.1f} GiB > {PROBE_HEADROOM:.0%} of {memory.total / 2**30:.1f} GiB"
    except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError
        if not is_oom(e):
            raise
        why = "out of memory"
    x = None  # drop the graph and activations before trying a smaller size
    model.zero_grad(set_to_none=True)
    free_memory()
    return why, peak
