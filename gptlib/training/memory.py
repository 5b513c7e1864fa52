"""GPU memory: how much training needs, the largest micro-batch that fits, and what to try after an OOM. An OOM must
leave the notebook's runtime usable: every probe drops its tensors and the exception, then empties the CUDA cache."""

from __future__ import annotations

import gc
from typing import Callable

import torch

from gptlib.errors import ConfigError, OutOfMemoryAdvice
from gptlib.model import model_size
from gptlib.runtime import autocast_for


def free_memory() -> None:
    gc.collect()  # first: reference cycles may hold tensors
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_oom(err: BaseException | None) -> bool:
    """An OOM anywhere in err's chain: torch.compile re-raises one as another exception (__cause__), and one may
    surface while another error is handled (__context__)."""
    seen = set()
    while err is not None and id(err) not in seen:  # a chain can loop back on itself
        seen.add(id(err))
        if isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower():
            return True
        err = err.__cause__ or err.__context__
    return False


def oom_advice(micro_batch: int, grad_accum: int, block_size: int, world_size: int = 1) -> str:
    """The next setting to try after an out-of-memory error, keeping tokens per step the same."""
    tokens = micro_batch * grad_accum * block_size * world_size
    if micro_batch > 1:
        b, a = max(1, micro_batch // 2), grad_accum * (micro_batch // max(1, micro_batch // 2))
        return (f"out of GPU memory at micro-batch {micro_batch} x {block_size} tokens. Next setting to try: "
                f"--set batch_size={b} --set grad_accum_steps={a} (same {tokens:,} tokens per step), or "
                f"--set auto_batch=true to find the largest micro-batch that fits. The last checkpoint is intact: "
                f"re-run to resume.")
    return (f"out of GPU memory even at micro-batch 1 x {block_size} tokens: use a smaller model or context "
            f"(a new run dir with --set block_size={max(1, block_size // 2)}), bf16 on a GPU that has it "
            f"(--set dtype=bfloat16), compile (--compile), or a GPU with more memory.")


def check_fits(cfg, device: torch.device) -> None:
    """ConfigError, before anything is written, for a micro-batch that needs more than all the device's memory (a
    size near the limit is left to the OOM advice; auto_batch finds what fits itself)."""
    if cfg.train.auto_batch:
        return
    need = estimate_train_bytes(cfg.model, cfg.train.batch_size)
    if device.type == "cuda":
        have, where = torch.cuda.get_device_properties(device).total_memory, f"the GPU ({device})"
    else:
        import psutil

        have, where = psutil.virtual_memory().total, "this machine's RAM"
    if need > have:
        raise ConfigError(f"batch_size={cfg.train.batch_size:,} x block_size={cfg.model.block_size:,} needs about "
                          f"{need / 2**30:,.1f} GiB to train but {where} has {have / 2**30:,.1f} GiB; lower batch_size "
                          f"(raise grad_accum_steps to keep the tokens per step), or --set auto_batch=true on a GPU")


def estimate_train_bytes(model_cfg, micro_batch: int) -> int:
    """Rough GPU memory of training: weights + grads + AdamW moments (16 B/param in fp32; an untied head is
    parameters too), bf16 activations (~34 B per token per layer per channel) and the logits: eager cross-entropy
    holds 14 B per logit (bf16 logits 2, their fp32 copy 4, log-softmax 4, its gradient 4)."""
    c = model_cfg
    tokens = micro_batch * c.block_size
    return int(16 * model_size(c).params + 34 * tokens * c.n_layer * c.n_embd + 14 * tokens * c.padded_vocab_size)


def train_reserve_bytes(model_cfg, micro_batch: int, measured_peak: int = 0) -> int:
    """The GPU memory to keep free for training beside the data: the probe's measured peak, or the estimate if more."""
    return max(measured_peak, estimate_train_bytes(model_cfg, micro_batch))


# The probe runs the model eagerly (a compile per candidate size would cost too much), an upper bound: inductor
# recomputes cheap pointwise results in the backward instead of saving them. The rest of the GPU is room for
# fragmentation and what runs beside the step (cuBLAS workspaces, compile's kernel benchmarking).
PROBE_HEADROOM = 0.92


class CudaMemoryProbe:

    def __init__(self, device: torch.device):
        self.device, self.total = device, torch.cuda.get_device_properties(device).total_memory

    def reset(self, batch: int) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


MEMORY_PROBES = {"cuda": CudaMemoryProbe}  # device type -> its memory probe; elsewhere only an OOM says it does not fit


def auto_micro_batch(make_model: Callable[[], torch.nn.Module], cfg, device, dtype,
                     log=print) -> tuple[int, int, int]:
    """auto_batch: probe on CUDA; elsewhere keep the configured sizes (no OOM to find there; no model is built)."""
    tc = cfg.train
    if torch.device(device).type != "cuda":
        log(f"auto micro-batch: no memory probe on {torch.device(device).type}; keeping batch_size={tc.batch_size}, "
            f"grad_accum_steps={tc.grad_accum_steps}")
        return tc.batch_size, tc.grad_accum_steps, 0
    return probe_micro_batch(make_model(), cfg.model.block_size, tc.batch_size * tc.grad_accum_steps, device, dtype,
                             log=log)


def probe_micro_batch(model: torch.nn.Module, block_size: int, sequences_per_step: int, device: str | torch.device,
                      dtype: torch.dtype = torch.float32, log: Callable[[str], None] = print) -> tuple[int, int, int]:
    """The largest divisor of sequences_per_step whose forward + backward fits -> (micro_batch, grad_accum_steps, its
    peak bytes; 0 without a memory probe). Fits: no OOM and a peak within PROBE_HEADROOM of the GPU."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    make_probe = MEMORY_PROBES.get(device.type)
    memory_probe = make_probe(device) if make_probe is not None else None
    n_params = sum(p.numel() for p in model.parameters())
    reserve = torch.empty(2 * n_params, device=device) if cuda else None  # stand-in for exp_avg + exp_avg_sq
    was_training = model.training
    model.train()
    chosen, peak = None, 0
    try:
        for b in (b for b in range(sequences_per_step, 0, -1) if sequences_per_step % b == 0):
            why, peak = _try_micro_batch(model, b, block_size, device, dtype, memory_probe)
            if not why:
                chosen = b
                break
            log(f"auto micro-batch: {b} x {block_size} does not fit ({why})")
    finally:
        del reserve  # the stand-in for the optimizer moments goes first
        model.zero_grad(set_to_none=True)
        model.train(was_training)
        free_memory()
    if chosen is None:
        raise OutOfMemoryAdvice(oom_advice(1, sequences_per_step, block_size))
    accum = sequences_per_step // chosen
    log(f"auto micro-batch: {chosen} x {block_size} tokens fits (eager peak within {PROBE_HEADROOM:.0%} of the GPU); "
        f"grad_accum_steps={accum} keeps {sequences_per_step * block_size:,} tokens per step")
    return chosen, accum, peak


def _try_micro_batch(model, b: int, block_size: int, device: torch.device, dtype: torch.dtype,
                     memory_probe) -> tuple[str, int]:
    """One forward + backward of b sequences -> (why it does not fit, "" if it fits; its peak bytes, 0 unmeasured)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", 2)
    why, peak = "", 0
    if memory_probe is not None:
        memory_probe.reset(b)
    x = torch.randint(0, vocab, (b, block_size), device=device)
    try:
        with autocast_for(device, dtype):
            _, loss = model(x, x)
        loss.backward()
        if memory_probe is not None:
            peak = memory_probe.peak()
            if peak > PROBE_HEADROOM * memory_probe.total:
                why = f"peak {peak / 2**30:.1f} GiB > {PROBE_HEADROOM:.0%} of {memory_probe.total / 2**30:.1f} GiB"
    except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError
        if not is_oom(e):
            raise
        why = "out of memory"
    loss = x = None  # drop the graph and activations before trying a smaller size
    model.zero_grad(set_to_none=True)
    free_memory()
    return why, peak
