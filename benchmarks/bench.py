"""Speed benchmarks on top of training: the optimization ladder, and the tokens/s and MFU of a preset.

    python benchmarks/bench.py ladder [--device cpu|cuda] [--preset P] [--steps N] [--rungs 0,2] [--data DATA_DIR]
    python benchmarks/bench.py train --preset gpt2-small [--recipe gpt2|modern] [--auto-batch] [--data DATA_DIR]

Both run train()'s step (gptlib.training.step.train_step), `train` with train()'s set-up too
(gptlib.training.run.build_run's order and wrap_for_training), so what they measure is what training does.

The ladder replays one user's path from 1.6 s/step to ~0.1 s/step: memmap + per-sample Python loop -> RAM
preload -> vectorised batches -> torch.compile -> bf16 autocast -> flash attention (SDPA). Each rung is the
previous one plus one change, timed on the same model and batch with a device sync at every phase
(SyncedTimer). `train` prints tokens/s, MFU, the time split and the ETA of the preset's whole run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import machine_info  # noqa: E402
from gptlib.batches import BatchSampler, MemmapSplit, SplitData, place_dataset  # noqa: E402
from gptlib.config import PRESETS, RECIPES, ModelConfig, TrainConfig, get_preset  # noqa: E402
from gptlib.data.shards import read_meta  # noqa: E402
from gptlib.errors import GptlibError  # noqa: E402
from gptlib.model import GPT, model_size  # noqa: E402
from gptlib.runtime import (  # noqa: E402
    autocast_for,
    configure_matmul,
    dtype_name,
    resolve_device,
    resolve_dtype,
)
from gptlib.training.memory import (  # noqa: E402
    fit_micro_batch,  # noqa: E402
    free_memory,
    is_oom,
)
from gptlib.training.run import Dist, wrap_for_training  # noqa: E402
from gptlib.training.step import (  # noqa: E402
    StepTimer,
    build_optimizer,
    train_step,
)
from gptlib.training.throughput import (
    device_peak,
    fmt_duration,
    fmt_mfu,
    fmt_split,  # noqa: E402
    mfu,
    perf_fields,
)


def preloaded(tokens: np.ndarray, device: torch.device) -> SplitData:
    """uint16/uint32 token ids as a preloaded split on `device` (the signed view gptlib keeps them in)."""
    signed = np.int16 if tokens.dtype == np.uint16 else np.int32
    return SplitData(
        tokens=torch.from_numpy(np.ascontiguousarray(tokens).view(signed)).to(device), name="train"
    )


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
    """The baseline's data path: one Python-level read per sample (from a memmap or an in-RAM array). `evict`:
    files dropped from the page cache before each batch, so the reads hit the disk."""

    def __init__(
        self,
        tokens,
        batch_size: int,
        block_size: int,
        seed: int,
        device: torch.device,
        evict: list[Path] | None = None,
    ):
        self.tokens, self.B, self.T, self.device = tokens, batch_size, block_size, device
        self.rng = random.Random(seed)
        self.evict = evict or []

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        for path in self.evict:
            drop_page_cache(path)
        xs, ys = [], []
        for _ in range(self.B):
            i = self.rng.randrange(0, len(self.tokens) - self.T - 1)
            # a MemmapSplit: one small read per sample, as the seed did
            if hasattr(self.tokens, "read"):
                w = torch.from_numpy(
                    self.tokens.read(i, self.T + 1).numpy().view(self.tokens.dtype).astype(np.int64)
                )
            else:
                w = torch.from_numpy(np.asarray(self.tokens[i : i + self.T + 1]).astype(np.int64))
            xs.append(w[:-1])
            ys.append(w[1:])
        return torch.stack(xs).to(self.device), torch.stack(ys).to(self.device)


def drop_page_cache(path: str | Path) -> bool:
    """Ask the OS to forget a file's cached pages (Linux posix_fadvise; no root needed). False if unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    finally:
        os.close(fd)


def half_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """The half precision gptlib would train in here, and a note when it is not a fast path."""
    if device.type == "cuda":
        dtype = resolve_dtype("auto", device)
        return (
            dtype,
            "" if dtype == torch.bfloat16 else "no bf16 on this GPU: fp16 autocast + GradScaler",
        )
    if device.type == "cpu":
        fast = False
        with contextlib.suppress(Exception):
            fast = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return torch.bfloat16, (
            "CPU bf16 via oneDNN (avx512_bf16/AMX): not a GPU tensor-core path"
            if fast
            else "not applicable: this CPU has no fast bf16, autocast runs emulated (slower)"
        )
    return torch.bfloat16, ""


def _attention_ctx(flash: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not flash:
        # materialises the T x T attention matrix, as hand-written attention does
        return sdpa_kernel([SDPBackend.MATH])
    # flash alone: what an A100 runs (on an H100 with a recent cuDNN torch would pick cuDNN attention, and a list of
    # kernels given here is a set, not an order); on a CPU PyTorch's own flash kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


class SyncedTimer(StepTimer):
    """A StepTimer that waits for the device at every mark, so host work such as a Python data loader counts in
    full (train()'s timer never syncs in the step)."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.device, self.events = torch.device(device), False

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def _time_steps(
    one_step: Callable[[], object], timer: StepTimer, dev: torch.device, warmup: int, steps: int
) -> tuple[float, float, float, dict[str, float]]:
    """-> (warmup seconds, compile included; median seconds of the timed steps, each synced before and after;
    median seconds of their data phase; the timer's split of the timed steps)."""

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    t0 = time.perf_counter()
    for _ in range(warmup):
        one_step()
    sync()
    warm_s = time.perf_counter() - t0
    timer.split()  # the split leaves the warmup out
    step_s, data_s, split = [], [], collections.Counter()
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        one_step()
        sync()
        step_s.append(time.perf_counter() - t)
        phases = timer.split()
        data_s.append(phases.get("data", 0.0))
        split.update(phases)
    return warm_s, statistics.median(step_s), statistics.median(data_s), dict(split)


@dataclass
class RungResult:
    name: str
    step_s: float  # median seconds per optimizer step (after warmup, synced)
    data_s: float  # median seconds of that spent producing the batch
    tokens_per_s: float
    mfu: float | None
    note: str


def _ladder_data(
    model_cfg: ModelConfig,
    data_dir,
    B: int,
    T: int,
    seed: int,
    dev: torch.device,
    stack: contextlib.ExitStack,
) -> tuple[Callable[[str], tuple], str]:
    """-> (a rung's data kind -> (a fresh loader, a note), where the tokens come from)."""
    if data_dir is None:  # synthetic tokens in a raw file: the memmap rung reads a real file
        path = (
            Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gptlib-ladder-")))
            / "train.bin"
        )
        n_tokens = max(4 * B * (T + 1), 1 << 22)
        np.random.default_rng(seed).integers(
            0, model_cfg.vocab_size, n_tokens, dtype=np.uint16
        ).tofile(path)
        disk, files = np.memmap(path, dtype=np.uint16, mode="r"), [path]
        source, ram = f"synthetic {n_tokens:,} random tokens in {path.name}", np.array(disk)
    else:
        # the baseline reads each sample from the shards on disk
        disk = MemmapSplit(read_meta(data_dir), "train")
        files = [Path(m.filename) for m in disk.maps]
        source, ram = f"{data_dir} train split", disk.read(0, len(disk)).numpy().view(disk.dtype)
    preloaded_split = preloaded(ram, dev)  # on a GPU: gathered there

    def loader(kind: str) -> tuple:
        if kind == "ram-loop":
            return PerSampleLoader(ram, B, T, seed, dev), ""
        if kind != "memmap-loop":
            return BatchSampler(preloaded_split, B, T, seed, dev), ""
        if drop_page_cache(files[0]):
            return (
                PerSampleLoader(disk, B, T, seed, dev, evict=files),
                "page cache dropped before each batch: reads hit this disk (Drive is slower)",
            )
        return PerSampleLoader(
            disk, B, T, seed, dev
        ), "file may be in the page cache: disk latency not included"

    return loader, source


def _run_rung(
    rung: tuple,
    model_cfg: ModelConfig,
    loader_for: Callable[[str], tuple],
    A: int,
    dev: torch.device,
    steps: int,
    warmup: int,
    seed: int,
    compile_backend: str,
) -> tuple[float, float, list[str]]:
    """One rung on a fresh model -> (step seconds, data seconds, notes); nan on OOM."""
    name, data_kind, use_compile, half, flash = rung
    torch.manual_seed(seed)
    if dev.type == "cuda":
        # fp32 rungs: true fp32, as the seed
        torch.set_float32_matmul_precision("high" if half else "highest")
    model = GPT(model_cfg).to(dev)
    optimizer = build_optimizer(model, TrainConfig(learning_rate=1e-4), dev.type)
    dtype, half_note = half_dtype(dev) if half else (torch.float32, "")
    scaler = torch.amp.GradScaler(dev.type, enabled=(dtype == torch.float16))
    loader, data_note = loader_for(data_kind)
    fwd = model
    if use_compile:
        torch._dynamo.reset()  # a fresh graph per rung, traced under this rung's precision and attention kernel
        fwd = torch.compile(model, backend=compile_backend)
    notes = [n for n in (half_note, data_note) if n]
    if use_compile and compile_backend != "inductor":
        notes.append(f"compile backend {compile_backend}")
    if flash and dev.type == "cpu":
        notes.append("CPU flash SDPA kernel")
    # synced: a Python loader counts in full
    timer, autocast = (
        SyncedTimer(dev),
        autocast_for(dev, dtype),
    )
    try:
        with _attention_ctx(flash):
            _, step_s, data_s, _ = _time_steps(
                lambda: train_step(
                    fwd,
                    optimizer,
                    scaler,
                    loader,
                    accum=A,
                    autocast=autocast,
                    grad_clip=1.0,
                    timer=timer,
                ),
                timer,
                dev,
                warmup,
                steps,
            )
    except RuntimeError as e:
        if not is_oom(e):
            raise
        step_s = data_s = math.nan
        notes.append("out of memory")
    finally:
        fwd = model = optimizer = loader = None
        free_memory()
    return step_s, data_s, notes


def run_ladder(
    model_cfg=None,
    batch_size: int | None = None,
    device: str = "auto",
    steps: int = 10,
    warmup: int = 3,
    data_dir: str | Path | None = None,
    compile_backend: str = "inductor",
    rungs: list[int] | None = None,
    seed: int = 1337,
    accum: int | None = None,
    log: Callable[[str], None] = print,
) -> list[RungResult]:
    """Run the ladder rung by rung; prints a table and returns its rows. Default: gpt2-small at the seed's
    64 x 512 tokens/step on a GPU (16 x 4 micro-batches, so the fp32 rungs fit too); on a CPU a small model,
    so the ladder runs in minutes."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        dflt_cfg, dflt_b, dflt_a = (
            dataclasses.replace(get_preset("gpt2-small").model, block_size=512),
            16,
            4,
        )
    else:
        dflt_cfg, dflt_b, dflt_a = (
            ModelConfig(vocab_size=512, block_size=256, n_layer=4, n_head=4, n_embd=128),
            8,
            1,
        )
    model_cfg = model_cfg or dflt_cfg
    if data_dir is not None:  # the model's vocabulary is the data's
        model_cfg = dataclasses.replace(model_cfg, vocab_size=read_meta(data_dir).vocab_size)
    B, T = batch_size or dflt_b, model_cfg.block_size
    A = accum or (dflt_a if batch_size is None else 1)  # micro-batches per optimizer step
    peak = device_peak(dev)
    results: list[RungResult] = []
    with contextlib.ExitStack() as stack:
        loader_for, source = _ladder_data(model_cfg, data_dir, B, T, seed, dev, stack)
        log(
            f"ladder on {peak.name} ({peak.note}); torch {torch.__version__}; model {model_cfg.n_layer}L "
            f"{model_cfg.n_embd}d {model_cfg.n_head}h, vocab {model_cfg.vocab_size}, context {T}, micro-batch {B} "
            f"x {A} accumulation ({A * B * T:,} tokens/step); data: {source}; {steps} timed steps after "
            f"{warmup} warmup"
        )
        header = f"{'rung':<28} {'step ms':>9} {'data ms':>8} {'speedup':>8} {'tokens/s':>10} {'MFU':>8}  note"
        log(header)
        log("-" * len(header))
        # Process-wide one-time costs (kernel selection, allocator growth) must not land on the first rung.
        _run_rung(RUNGS[2], model_cfg, loader_for, 1, dev, 1, 1, seed, compile_backend)
        base, fpt = None, model_size(model_cfg).flops_per_token
        for i, rung in enumerate(RUNGS):
            if rungs is not None and i not in rungs:
                continue
            step_s, data_s, notes = _run_rung(
                rung, model_cfg, loader_for, A, dev, steps, warmup, seed, compile_backend
            )
            if base is None and math.isfinite(step_s):
                base = step_s
            tps = A * B * T / step_s if step_s > 0 else math.nan
            r = RungResult(
                rung[0],
                step_s,
                data_s,
                tps,
                mfu(fpt, tps, peak.peak_flops) if math.isfinite(tps) else None,
                "; ".join(notes),
            )
            results.append(r)
            speed = base / step_s if base and math.isfinite(step_s) else math.nan
            log(
                f"{r.name:<28} {1000 * step_s:9.1f} {1000 * data_s:8.2f} {speed:7.2f}x {tps:10,.0f} "
                f"{fmt_mfu(r.mfu):>8}  {r.note}"
            )
        if len(results) > 1 and base and math.isfinite(results[-1].step_s):
            log(f"ladder speedup, first -> last rung: {base / results[-1].step_s:.2f}x")
    return results


def bench_train(
    preset: str = "gpt2-small",
    overrides: list[str] | None = None,
    device: str = "auto",
    steps: int = 20,
    warmup: int = 5,
    compile: str = "auto",
    auto_batch: bool = False,
    data_dir: str | Path | None = None,
    recipe: str = "gpt2",
    log: Callable[[str], None] = print,
) -> dict:
    """Time optimizer steps of a preset and recipe as train() runs them (same set-up, same train step) and report
    tokens/s, MFU, the time split and the ETA of the preset's whole run."""
    cfg = get_preset(preset, recipe).updated(
        (overrides or []) + [f"compile={compile}", f"auto_batch={auto_batch}"]
    )
    dev = resolve_device(device if device != "auto" else cfg.train.device)
    if data_dir is not None:
        meta = read_meta(data_dir)
        splits = place_dataset(meta, dev, log=log)
        cfg = cfg.updated({"vocab_size": meta.vocab_size})
    cfg.validate()
    # the parts as train() builds them (gptlib/training/run.py: build_run)
    dtype = resolve_dtype(cfg.train.dtype, dev)
    configure_matmul(dev)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(dev)
    if cfg.train.auto_batch:
        cfg, _ = fit_micro_batch(cfg, model, dev, Dist(), log)
    optimizer = build_optimizer(model, cfg.train, dev.type)
    scaler = torch.amp.GradScaler(dev.type, enabled=(dtype == torch.float16))
    fwd, compiled = wrap_for_training(model, cfg, dev, Dist())
    mc, tc = cfg.model, cfg.train
    micro, accum = tc.batch_size, tc.grad_accum_steps
    if data_dir is None:
        n = max(8 * micro * (mc.block_size + 1), 1 << 22)
        dtype_ids = np.uint16 if mc.vocab_size <= 65536 else np.uint32
        toks = np.random.default_rng(0).integers(0, mc.vocab_size, n, dtype=dtype_ids)
        data = preloaded(toks, dev)
    else:
        data = splits["train"]
    sampler = BatchSampler(data, micro, mc.block_size, tc.seed, dev)
    autocast, timer, peak = (
        autocast_for(dev, dtype),
        StepTimer(dev),
        device_peak(dev, tc.colab_units_per_hour),
    )
    per_step = cfg.tokens_per_step
    log(
        f"bench train: preset {preset}, recipe {recipe}, {model_size(mc).params / 1e6:.1f}M params, {dev} "
        f"({peak.name}), {dtype_name(dtype)}, compile {'on' if compiled else 'off'}, micro-batch {micro} x "
        f"{mc.block_size} x accum {accum} = {per_step:,} tokens/step"
    )
    warm_s, step_s, _, split = _time_steps(
        lambda: train_step(
            fwd,
            optimizer,
            scaler,
            sampler,
            accum=accum,
            autocast=autocast,
            grad_clip=tc.grad_clip,
            timer=timer,
        ),
        timer,
        dev,
        warmup,
        steps,
    )
    tps, fpt, target = per_step / step_s, model_size(mc).flops_per_token, tc.max_steps * per_step
    # MFU, ETA and Colab units as train() logs them
    perf = perf_fields(split, fpt, tps, peak, 1, 0, target)
    m, eta, units = perf["mfu"], perf["eta_s"], perf["colab_units_left"]
    log(
        f"step {1000 * step_s:.1f} ms (median of {steps}, synced), {tps:,.0f} tokens/s, "
        f"{fpt * tps / 1e12:.1f} TFLOP/s, MFU {fmt_mfu(m)} ({peak.note}); warmup+compile {warm_s:.1f}s"
    )
    log(f"time split: {fmt_split(split)}")
    log(
        f"ETA for the preset's {tc.max_steps:,} steps ({target / 1e9:.2f}B tokens): {fmt_duration(eta)}"
        + (f", ~{units:.0f} Colab compute units" if units is not None else "")
    )
    fwd = model = optimizer = None
    free_memory()
    return {
        "step_s": step_s,
        "tokens_per_s": tps,
        "mfu": m,
        "split": split,
        "eta_s": eta,
        "colab_units": units,
        "micro_batch": micro,
        "grad_accum_steps": accum,
        "device": peak.name,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/bench.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("what", choices=["ladder", "train"])
    p.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=None,
        help="model preset (ladder default: gpt2-small at 64 x 512 on CUDA, a small model on CPU; "
        "train default: gpt2-small)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--steps", type=int, default=None, help="timed steps (ladder 10, train 20)")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed warmup steps, compile included (ladder 3, train 5)",
    )
    p.add_argument("--batch-size", type=int, default=None, help="ladder: sequences per micro-batch")
    p.add_argument(
        "--accum",
        type=int,
        default=None,
        help="ladder: micro-batches per step (default 4 on CUDA, 1 on CPU)",
    )
    p.add_argument(
        "--data",
        metavar="DATA_DIR",
        default=None,
        help="real token shards instead of synthetic tokens",
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="ladder: torch.compile backend (default inductor)",
    )
    p.add_argument(
        "--rungs", default=None, help="ladder: comma-separated rung numbers to run (default all)"
    )
    p.add_argument(
        "--compile", choices=["auto", "on", "off"], default="auto", help="train: torch.compile"
    )
    p.add_argument(
        "--auto-batch", action="store_true", help="train: probe the largest micro-batch that fits"
    )
    p.add_argument(
        "--recipe", choices=list(RECIPES), default="gpt2", help="train: the recipe (default gpt2)"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="override config fields"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(machine_info())
    try:
        if args.what == "ladder":
            model_cfg = None
            if args.preset or args.set:
                model_cfg = (
                    get_preset(args.preset or "gpt2-small").updated(args.set).validate().model
                )
            rungs = [int(r) for r in args.rungs.split(",")] if args.rungs else None
            run_ladder(
                model_cfg,
                batch_size=args.batch_size,
                device=args.device,
                steps=args.steps or 10,
                warmup=3 if args.warmup is None else args.warmup,
                data_dir=args.data,
                compile_backend=args.compile_backend,
                rungs=rungs,
                accum=args.accum,
            )
        else:
            bench_train(
                args.preset or "gpt2-small",
                args.set,
                device=args.device,
                steps=args.steps or 20,
                warmup=5 if args.warmup is None else args.warmup,
                compile=args.compile,
                auto_batch=args.auto_batch,
                data_dir=args.data,
                recipe=args.recipe,
            )
    except GptlibError as e:  # a setting the user can fix: one line, as the gptlib CLI says it
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
