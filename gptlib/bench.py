"""Measurement: MFU, time split, ETA, Colab compute units, auto micro-batch, and the optimization ladder.

MFU (model FLOPs utilisation) = achieved training FLOP/s / the GPU's dense bf16 peak, with
GPT.flops_per_token() = 6N + 12*L*d*T FLOPs per token. Only GPUs in PEAK_TFLOPS get a number;
anything else (an unlisted GPU, a CPU) says "MFU unknown" rather than print a wrong one.

The ladder (`python -m gptlib bench ladder`) replays one user's path from 1.6 s/step to ~0.1 s/step:
memmap + per-sample Python loop -> RAM preload -> vectorised batches -> torch.compile -> bf16
autocast -> flash attention (SDPA). Each rung is the previous one plus one change, timed on the same
model and batch after a device sync.
"""

from __future__ import annotations

import contextlib
import gc
import math
import platform
import random
import re
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

# --- GPU peaks and MFU ------------------------------------------------------------------------

# Dense (no sparsity) tensor-core peak in TFLOP/s for the precision gptlib trains in on that GPU:
# bf16 where the GPU has it; fp16 on T4/V100, which train in fp16 + GradScaler. First match wins.
PEAK_TFLOPS: list[tuple[str, str, float]] = [
    (r"H200", "H200", 989.0),
    (r"H100.*PCIe", "H100 PCIe", 756.0),
    (r"H100.*NVL", "H100 NVL", 835.0),
    (r"H100", "H100 SXM", 989.0),
    (r"A100", "A100", 312.0),
    (r"\bL4\b", "L4", 121.0),
    (r"V100", "V100 (fp16)", 125.0),
    (r"\bT4\b", "T4 (fp16)", 65.0),
]

# Approximate Colab compute units consumed per hour of each GPU runtime (user reports, 2024-2025).
# Colab changes these; edit this table (or pass your own) to get your own estimate.
COLAB_UNITS_PER_HOUR: dict[str, float] = {
    "T4": 1.76,
    "L4": 4.82,
    "V100": 4.91,
    "A100": 11.77,
    "H100": 18.0,
}


@dataclass
class DevicePeak:
    name: str  # what the device calls itself
    family: str | None  # matched table row, e.g. "A100"; None if unknown
    peak_flops: float | None  # FLOP/s, None if unknown
    note: str  # why there is no MFU, or which peak is used


def lookup_peak(gpu_name: str) -> tuple[str | None, float | None]:
    """'NVIDIA A100-SXM4-40GB' -> ('A100', 312e12); an unlisted name -> (None, None)."""
    for pattern, family, tflops in PEAK_TFLOPS:
        if re.search(pattern, gpu_name, flags=re.IGNORECASE):
            return family, tflops * 1e12
    return None, None


def device_peak(device: str | torch.device) -> DevicePeak:
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        family, peak = lookup_peak(name)
        if peak is None:
            return DevicePeak(name, None, None, f"MFU unknown: {name!r} is not in gptlib.bench.PEAK_TFLOPS")
        return DevicePeak(name, family, peak, f"peak {peak / 1e12:.0f} TFLOP/s ({family}, dense)")
    return DevicePeak(f"{device.type}: {_cpu_name()}", None, None, f"MFU unknown on {device.type} (no peak table for it)")


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "CPU"


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float | None, n_devices: int = 1) -> float | None:
    """Fraction of the peak reached (0..1), or None when the peak is unknown."""
    if not peak_flops:
        return None
    return flops_per_token * tokens_per_s / (peak_flops * n_devices)


def fmt_mfu(value: float | None) -> str:
    return "unknown" if value is None else f"{100 * value:.1f}%"


def fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def eta_seconds(tokens_done: int, tokens_target: int, tokens_per_s: float) -> float:
    if tokens_per_s <= 0:
        return math.inf
    return max(0, tokens_target - tokens_done) / tokens_per_s


def colab_units(seconds: float, gpu_family: str | None, rates: dict[str, float] | None = None) -> float | None:
    """Estimated Colab compute units for `seconds` on that GPU (None if the GPU has no rate)."""
    rates = COLAB_UNITS_PER_HOUR if rates is None else rates
    if gpu_family is None or not math.isfinite(seconds):
        return None
    key = next((k for k in rates if gpu_family.upper().startswith(k.upper())), None)
    return None if key is None else rates[key] * seconds / 3600


def perf_fields(split: dict[str, float], flops_per_token: float, tokens_per_s: float, peak: DevicePeak,
                n_devices: int, tokens_seen: int, tokens_target: int) -> dict:
    """What train() adds to a metrics row: MFU (None if unknown), ETA, Colab units, the time split (fractions)."""
    total = sum(split.values())
    eta = eta_seconds(tokens_seen, tokens_target, tokens_per_s)
    m = mfu(flops_per_token, tokens_per_s, peak.peak_flops, n_devices)
    units = colab_units(eta, peak.family)
    return {"mfu": None if m is None else round(m, 4), "eta_s": round(eta, 1) if math.isfinite(eta) else None,
            "colab_units_left": None if units is None else round(units * n_devices, 2),
            "time_split": {k: round(v / total, 3) for k, v in split.items()} if total > 0 else {}}


def postfix_fields(perf: dict) -> dict[str, str]:
    """Short progress-bar fields from perf_fields(): only what is known."""
    out = {}
    if perf.get("mfu") is not None:
        out["mfu"] = f"{100 * perf['mfu']:.1f}%"
    if perf.get("eta_s") is not None:
        out["eta"] = fmt_duration(perf["eta_s"])
    if perf.get("time_split"):
        out["split"] = "/".join(f"{k[0]}{100 * v:.0f}" for k, v in perf["time_split"].items())  # d3/f90/o7 (%)
    return out


def steps_for_tokens(cfg, tokens: float, world_size: int = 1) -> int:
    """Optimizer steps that train on `tokens` tokens with this config's tokens per step (at least 1)."""
    per_step = cfg.train.batch_size * cfg.train.grad_accum_steps * cfg.model.block_size * world_size
    return max(1, math.ceil(tokens / per_step))


# --- time split -------------------------------------------------------------------------------


class StepTimer:
    """Time per phase (data, fwd_bwd, optim) with no host sync in the hot loop.

    On CUDA it records events and reads them only in `split()` (call it where the loop syncs
    anyway, at log time); the GPU timeline then shows where time goes, including the GPU waiting
    for the host's data. On CPU it uses perf_counter.
    """

    def __init__(self, device: str | torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, object, object]] = []
        self._last = None

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self) -> None:
        self._last = self._now()

    def mark(self, phase: str) -> None:
        """The time since the previous start/mark belongs to `phase`."""
        if self._last is None:
            self.start()
            return
        now = self._now()
        if self.cuda:
            self._events.append((phase, self._last, now))
        else:
            self.totals[phase] += now - self._last
        self._last = now

    def split(self, reset: bool = True) -> dict[str, float]:
        """-> {phase: seconds} since the last reset."""
        if self.cuda and self._events:
            self._events[-1][2].synchronize()
            for phase, a, b in self._events:
                self.totals[phase] += a.elapsed_time(b) / 1000.0
            self._events.clear()
        out = dict(self.totals)
        if reset:
            self.totals.clear()
        return out


def fmt_split(split: dict[str, float]) -> str:
    total = sum(split.values())
    if total <= 0:
        return ""
    return " ".join(f"{k} {100 * v / total:.0f}%" for k, v in split.items())


# --- memory: OOM-safe probing -----------------------------------------------------------------


def free_memory() -> None:
    """Return cached blocks after dropping references: gc first (cycles may hold tensors), then the CUDA cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


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
            f"(a new run dir with --set block_size={max(1, block_size // 2)}), bf16 (--set dtype=bfloat16) or "
            f"compile (--compile), or a GPU with more memory.")


def estimate_train_bytes(model_cfg, micro_batch: int) -> int:
    """Rough GPU memory of training: weights + grads + AdamW moments (16 B/param in fp32) + bf16 activations
    (~34 B per token per layer per channel) + fp32 logits/grad. Used to decide whether the data fits beside it."""
    c = model_cfg
    n_params = 12 * c.n_layer * c.n_embd ** 2 + (c.padded_vocab_size + c.block_size) * c.n_embd
    tokens = micro_batch * c.block_size
    return int(16 * n_params + 34 * tokens * c.n_layer * c.n_embd + 10 * tokens * c.padded_vocab_size)


def auto_micro_batch(model, cfg, device, dtype, log=print) -> tuple[int, int]:
    """train()'s auto_batch: probe on CUDA; elsewhere keep the configured sizes (no OOM to find there)."""
    tc = cfg.train
    if torch.device(device).type != "cuda":
        log(f"auto micro-batch: no memory probe on {torch.device(device).type}; keeping batch_size={tc.batch_size}, "
            f"grad_accum_steps={tc.grad_accum_steps}")
        return tc.batch_size, tc.grad_accum_steps
    return probe_micro_batch(model, cfg.model.block_size, tc.batch_size * tc.grad_accum_steps, device, dtype, log=log)


class MicroBatchOOM(RuntimeError):
    """Out of memory in training; the message names the next setting to try."""


def probe_micro_batch(model: torch.nn.Module, block_size: int, sequences_per_step: int, device: str | torch.device,
                      dtype: torch.dtype = torch.float32, max_micro: int | None = None,
                      reserve_optimizer: bool = True, headroom: float = 0.92, log: Callable[[str], None] = print,
                      ) -> tuple[int, int]:
    """Largest micro-batch whose forward + backward fits, and the accumulation that keeps tokens per step.

    Candidates are the divisors of `sequences_per_step` (so micro * accum is exact), largest first.
    Each try runs one forward/backward on random tokens; an OOM frees everything (no reference to
    the exception or its frames survives the except block, then gc + empty_cache) and tries the
    next. On CUDA a try also fails when its peak memory exceeds `headroom` of the GPU (room for
    fragmentation). AdamW's two fp32 moments are held in memory during the probe (reserve_optimizer).
    -> (micro_batch, grad_accum_steps)
    """
    from .train import autocast_for

    device = torch.device(device)
    cap = sequences_per_step if max_micro is None else min(max_micro, sequences_per_step)
    candidates = [b for b in range(cap, 0, -1) if sequences_per_step % b == 0]
    vocab = getattr(getattr(model, "config", None), "vocab_size", 2)
    cuda = device.type == "cuda"
    autocast = autocast_for(device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    reserve = (torch.empty(2 * n_params, dtype=torch.float32, device=device)
               if reserve_optimizer and cuda else None)  # stand-in for exp_avg + exp_avg_sq
    was_training = model.training
    model.train()
    chosen = None
    try:
        for b in candidates:
            fits, why = True, ""
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            x = torch.randint(0, vocab, (b, block_size), device=device)
            try:
                with autocast:
                    _, loss = model(x, x)
                loss.backward()
                if cuda:
                    torch.cuda.synchronize(device)
                    peak, total = torch.cuda.max_memory_allocated(device), torch.cuda.get_device_properties(device).total_memory
                    if peak > headroom * total:
                        fits, why = False, f"peak {peak / 2**30:.1f} GiB > {headroom:.0%} of {total / 2**30:.1f} GiB"
            except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError
                if not is_oom(e):
                    raise
                fits, why = False, "out of memory"
            loss = x = None  # drop the graph and activations before trying a smaller size
            model.zero_grad(set_to_none=True)
            free_memory()
            if fits:
                chosen = b
                break
            log(f"auto micro-batch: {b} x {block_size} does not fit ({why})")
    finally:
        reserve = None
        model.zero_grad(set_to_none=True)
        model.train(was_training)
        free_memory()
    if chosen is None:
        raise MicroBatchOOM(oom_advice(1, sequences_per_step, block_size))
    accum = sequences_per_step // chosen
    log(f"auto micro-batch: {chosen} x {block_size} tokens fits; grad_accum_steps={accum} keeps "
        f"{sequences_per_step * block_size:,} tokens per step")
    return chosen, accum


# --- the optimization ladder --------------------------------------------------------------------

RUNGS = [
    # (name, data, compile, half precision, flash attention)
    ("memmap + per-sample loop", "memmap-loop", False, False, False),
    ("RAM preload", "ram-loop", False, False, False),
    ("vectorised batches", "vectorised", False, False, False),
    ("+ torch.compile", "vectorised", True, False, False),
    ("+ bf16 autocast", "vectorised", True, True, False),
    ("+ flash attention (SDPA)", "vectorised", True, True, True),
]


class PerSampleLoader:
    """The baseline's data path: one Python-level read per sample (from a memmap or an in-RAM array)."""

    def __init__(self, tokens, batch_size: int, block_size: int, seed: int, device: torch.device,
                 evict: list[Path] | None = None):
        self.tokens, self.B, self.T, self.device = tokens, batch_size, block_size, device
        self.rng = random.Random(seed)
        self.evict = evict or []  # files dropped from the page cache before each batch: reads hit the disk

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        for path in self.evict:
            drop_page_cache(path)
        from .data import _to_ids

        xs, ys = [], []
        for _ in range(self.B):
            i = self.rng.randrange(0, len(self.tokens) - self.T - 1)
            if hasattr(self.tokens, "read"):  # a MemmapSplit: one small read per sample, as the seed did
                w = _to_ids(self.tokens.read(i, self.T + 1))
                xs.append(w[:-1])
                ys.append(w[1:])
                continue
            xs.append(torch.from_numpy(np.asarray(self.tokens[i: i + self.T]).astype(np.int64)))
            ys.append(torch.from_numpy(np.asarray(self.tokens[i + 1: i + 1 + self.T]).astype(np.int64)))
        x, y = torch.stack(xs), torch.stack(ys)
        return x.to(self.device), y.to(self.device)


def drop_page_cache(path: str | Path) -> bool:
    """Ask the OS to forget a file's cached pages (Linux posix_fadvise; no root needed). False if unsupported."""
    import os

    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    finally:
        os.close(fd)


def half_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """The half precision gptlib would use here and a note when it is not a fast path."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, ""
        return torch.float16, "no bf16 on this GPU: fp16 autocast + GradScaler"
    if device.type == "cpu":
        fast = False
        with contextlib.suppress(Exception):
            fast = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return torch.bfloat16, ("CPU bf16 via oneDNN (avx512_bf16/AMX): not a GPU tensor-core path" if fast else
                                "not applicable: this CPU has no fast bf16, autocast runs emulated (slower)")
    return torch.bfloat16, ""


def _attention_ctx(flash: bool, device: torch.device):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not flash:
        return sdpa_kernel([SDPBackend.MATH])  # materialises the T x T attention matrix, as hand-written attention does
    if device.type == "cuda":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION])
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])  # PyTorch's CPU flash kernel


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class RungResult:
    name: str
    step_s: float  # median seconds per optimizer step (after warmup, synced)
    data_s: float  # median seconds of that spent producing the batch
    tokens_per_s: float
    mfu: float | None
    note: str


def _time_steps(model, optimizer, scaler, loader, device, dtype, steps: int, warmup: int, attention_ctx,
                accum: int = 1) -> tuple[float, float]:
    """-> (median step seconds, median data seconds) over `steps` optimizer steps after `warmup` untimed ones.

    A step is `accum` micro-batches; the data time is measured with a sync around each batch fetch.
    """
    from .train import autocast_for

    autocast = autocast_for(device, dtype)
    step_times, data_times = [], []
    with attention_ctx:
        for i in range(warmup + steps):
            _sync(device)
            t0 = time.perf_counter()
            data_s = 0.0
            for _ in range(accum):
                d0 = time.perf_counter()
                x, y = loader.next_batch()
                _sync(device)
                data_s += time.perf_counter() - d0
                with autocast:
                    _, loss = model(x, y)
                scaler.scale(loss / accum).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            t2 = time.perf_counter()
            if i >= warmup:
                step_times.append(t2 - t0)
                data_times.append(data_s)
    return statistics.median(step_times), statistics.median(data_times)


def default_ladder_config(device: torch.device):
    """-> (model config, micro-batch, accumulation). gpt2-small at the seed's 64 x 512 tokens/step on a GPU
    (16 x 4 micro-batches, so the fp32 rungs fit too); a small model on CPU so the ladder runs in minutes."""
    from .config import ModelConfig, get_preset

    if device.type == "cuda":
        m = get_preset("gpt2-small").model
        m.block_size = 512
        return m, 16, 4
    return ModelConfig(vocab_size=512, block_size=256, n_layer=4, n_head=4, n_embd=128, vocab_multiple=64), 8, 1


def run_ladder(model_cfg=None, batch_size: int | None = None, device: str = "auto", steps: int = 10, warmup: int = 3,
               data_dir: str | Path | None = None, compile_backend: str = "inductor", rungs: list[int] | None = None,
               seed: int = 1337, accum: int | None = None, log: Callable[[str], None] = print) -> list[RungResult]:
    """Run the ladder rung by rung; prints a table and returns its rows."""
    from .model import GPT
    from .train import resolve_device

    dev = resolve_device(device)
    dflt_cfg, dflt_b, dflt_a = default_ladder_config(dev)
    model_cfg = model_cfg or dflt_cfg
    B, T = batch_size or dflt_b, model_cfg.block_size
    A = accum or (dflt_a if batch_size is None else 1)  # micro-batches per optimizer step
    peak = device_peak(dev)
    hdt, hnote = half_dtype(dev)

    with contextlib.ExitStack() as stack:
        if data_dir is None:  # synthetic tokens in a raw file: the memmap rung reads a real file
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gptlib-ladder-")))
            n_tokens = max(4 * B * (T + 1), 1 << 22)
            path = tmp / "train.bin"
            np.random.default_rng(seed).integers(0, model_cfg.vocab_size, n_tokens, dtype=np.uint16).tofile(path)
            mm = np.memmap(path, dtype=np.uint16, mode="r")
            source = f"synthetic {n_tokens:,} random tokens in {path.name}"
        else:
            from .data import MemmapSplit
            from .shards import read_meta

            meta = read_meta(data_dir)
            model_cfg.vocab_size = meta.vocab_size
            mm = MemmapSplit(meta, "train")  # the baseline reads each sample from the shards on disk
            source = f"{data_dir} train split"
        ram = np.array(mm) if isinstance(mm, np.ndarray) else mm.read(0, len(mm)).numpy().view(mm.dtype)  # the RAM-preloaded copy
        from .data import BatchSampler, SplitData, _as_signed_view

        preloaded = SplitData(tokens=_as_signed_view(ram), name="train")
        if dev.type == "cuda":
            preloaded.tokens = preloaded.tokens.to(dev)  # data fits next to the model: gather on the GPU

        fpt = None
        log(f"ladder on {peak.name} ({peak.note}); torch {torch.__version__}; model {model_cfg.n_layer}L "
            f"{model_cfg.n_embd}d {model_cfg.n_head}h, vocab {model_cfg.vocab_size}, context {T}, micro-batch {B} "
            f"x {A} accumulation ({A * B * T:,} tokens/step); data: {source}; {steps} timed steps after {warmup} warmup")
        header = f"{'rung':<28} {'step ms':>9} {'data ms':>8} {'speedup':>8} {'tokens/s':>10} {'MFU':>8}  note"
        log(header)
        log("-" * len(header))
        # Process-wide one-time costs (kernel selection, allocator growth) must not land on the first rung.
        warm = GPT(model_cfg).to(dev)
        _time_steps(warm, warm.configure_optimizer(0.1, 1e-4, (0.9, 0.95), dev.type),
                    torch.amp.GradScaler(dev.type, enabled=False), BatchSampler(preloaded, B, T, seed, dev), dev,
                    torch.float32, 1, 1, _attention_ctx(False, dev))
        warm = None
        free_memory()
        results: list[RungResult] = []
        base = None
        for i, (name, data_kind, use_compile, half, flash) in enumerate(RUNGS):
            if rungs is not None and i not in rungs:
                continue
            notes = []
            torch.manual_seed(seed)
            if dev.type == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = half  # fp32 rungs run true fp32, as the seed did
                torch.backends.cudnn.allow_tf32 = half
            model = GPT(model_cfg).to(dev)
            fpt = model.flops_per_token()
            optimizer = model.configure_optimizer(0.1, 1e-4, (0.9, 0.95), dev.type)
            dtype = hdt if half else torch.float32
            if half and hnote:
                notes.append(hnote)
            scaler = torch.amp.GradScaler(dev.type, enabled=(dtype == torch.float16))
            if data_kind == "memmap-loop":
                files = [Path(m.filename) for m in (mm.maps if hasattr(mm, "maps") else [mm])]
                cold = drop_page_cache(files[0])
                loader = PerSampleLoader(mm, B, T, seed, dev, evict=files if cold else None)
                notes.append("page cache dropped before each batch: reads hit this disk (Drive is slower)" if cold
                             else "file may be in the page cache: disk latency not included")
            elif data_kind == "ram-loop":
                loader = PerSampleLoader(ram, B, T, seed, dev)
            else:
                loader = BatchSampler(preloaded, B, T, seed, dev)
            fwd = model
            if use_compile:
                torch._dynamo.reset()  # a fresh graph per rung, traced under this rung's precision and attention kernel
                fwd = torch.compile(model, backend=compile_backend)
                if compile_backend != "inductor":
                    notes.append(f"compile backend {compile_backend}")
            if flash and dev.type == "cpu":
                notes.append("CPU flash SDPA kernel")
            try:
                step_s, data_s = _time_steps(fwd, optimizer, scaler, loader, dev, dtype, steps, warmup,
                                             _attention_ctx(flash, dev), accum=A)
            except RuntimeError as e:
                if not is_oom(e):
                    raise
                step_s, data_s = math.nan, math.nan
                notes.append("out of memory")
            finally:
                fwd = model = optimizer = loader = None
                free_memory()
            if base is None and math.isfinite(step_s):
                base = step_s
            tps = A * B * T / step_s if step_s > 0 else math.nan
            r = RungResult(name, step_s, data_s, tps, mfu(fpt, tps, peak.peak_flops) if math.isfinite(tps) else None,
                           "; ".join(notes))
            results.append(r)
            speed = base / step_s if base and math.isfinite(step_s) else math.nan
            log(f"{name:<28} {1000 * step_s:9.1f} {1000 * data_s:8.2f} {speed:7.2f}x {tps:10,.0f} "
                f"{fmt_mfu(r.mfu):>8}  {r.note}")
        if len(results) > 1 and base and math.isfinite(results[-1].step_s):
            log(f"ladder speedup, first -> last rung: {base / results[-1].step_s:.2f}x")
    return results


# --- throughput run of a preset -------------------------------------------------------------


def bench_train(preset: str = "gpt2-small", overrides: list[str] | None = None, device: str = "auto",
                steps: int = 20, warmup: int = 5, compile: str = "auto", auto_batch: bool = False,
                data_dir: str | Path | None = None, log: Callable[[str], None] = print) -> dict:
    """Time optimizer steps of a preset on the fast path (as train() runs it) and report tokens/s, MFU, split, ETA."""
    from .checkpoint import unwrap_model
    from .config import get_preset
    from .data import SplitData, _as_signed_view, load_dataset, make_sampler
    from .model import GPT
    from .train import autocast_for, optimizer_step, resolve_device, resolve_dtype

    cfg = get_preset(preset).apply_overrides(overrides or [])
    dev = resolve_device(device if device != "auto" else cfg.train.device)
    if data_dir is not None:
        meta, splits = load_dataset(data_dir, dev, log=log)
        cfg.model.vocab_size = meta.vocab_size
    cfg.validate()
    mc, tc = cfg.model, cfg.train
    dtype = resolve_dtype(tc.dtype, dev)
    use_compile = compile == "on" or (compile == "auto" and dev.type == "cuda")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(tc.seed)
    model = GPT(mc).to(dev)
    micro, accum = tc.batch_size, tc.grad_accum_steps
    if auto_batch:
        micro, accum = probe_micro_batch(model, mc.block_size, micro * accum, dev, dtype, log=log)
    if data_dir is None:
        n = max(8 * micro * (mc.block_size + 1), 1 << 22)
        toks = np.random.default_rng(0).integers(0, mc.vocab_size, n, dtype=np.uint16 if mc.vocab_size <= 65536 else np.uint32)
        data = SplitData(tokens=_as_signed_view(toks).to(dev), name="train")
    else:
        data = splits["train"]
    sampler = make_sampler(data, micro, mc.block_size, tc.seed, dev)
    optimizer = model.configure_optimizer(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2), dev.type)
    scaler = torch.amp.GradScaler(dev.type, enabled=(dtype == torch.float16))
    fwd = torch.compile(model) if use_compile else model
    autocast = autocast_for(dev, dtype)
    timer = StepTimer(dev)
    peak = device_peak(dev)
    tokens_per_step = micro * accum * mc.block_size
    log(f"bench train: preset {preset}, {unwrap_model(model).num_params() / 1e6:.1f}M params, {dev} "
        f"({peak.name}), {str(dtype).replace('torch.', '')}, compile {'on' if use_compile else 'off'}, "
        f"micro-batch {micro} x {mc.block_size} x accum {accum} = {tokens_per_step:,} tokens/step")

    def one_step():
        timer.start()
        for _ in range(accum):
            x, y = sampler.next_batch()
            timer.mark("data")
            with autocast:
                _, loss = fwd(x, y)
            scaler.scale(loss / accum).backward()
            timer.mark("fwd_bwd")
        optimizer_step(model, optimizer, scaler, tc.grad_clip)  # as train() does
        timer.mark("optim")

    t0 = time.perf_counter()
    for _ in range(warmup):
        one_step()
    _sync(dev)
    warm_s = time.perf_counter() - t0
    timer.split()  # discard warmup
    times = []
    for _ in range(steps):
        _sync(dev)
        t = time.perf_counter()
        one_step()
        _sync(dev)
        times.append(time.perf_counter() - t)
    split = timer.split()
    step_s = statistics.median(times)
    tps = tokens_per_step / step_s
    fpt = unwrap_model(model).flops_per_token()
    m = mfu(fpt, tps, peak.peak_flops)
    target = tc.max_steps * tokens_per_step
    eta = eta_seconds(0, target, tps)
    units = colab_units(eta, peak.family)
    log(f"step {1000 * step_s:.1f} ms (median of {steps}, synced), {tps:,.0f} tokens/s, "
        f"{fpt * tps / 1e12:.1f} TFLOP/s, MFU {fmt_mfu(m)} ({peak.note}); warmup+compile {warm_s:.1f}s")
    log(f"time split: {fmt_split(split)}")
    log(f"ETA for the preset's {tc.max_steps:,} steps ({target / 1e9:.2f}B tokens): {fmt_duration(eta)}"
        + (f", ~{units:.0f} Colab compute units" if units is not None else ""))
    result = {"step_s": step_s, "tokens_per_s": tps, "mfu": m, "split": split, "eta_s": eta, "colab_units": units,
              "micro_batch": micro, "grad_accum_steps": accum, "device": peak.name}
    fwd = model = optimizer = None
    free_memory()
    return result


def machine_info() -> str:
    """One line for benchmark files: torch, CPU/GPU, cores."""
    import os

    cpu = _cpu_name()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (f"torch {torch.__version__}; python {platform.python_version()}; CPU {cpu} ({os.cpu_count()} cores); "
            f"GPU {gpu}")
