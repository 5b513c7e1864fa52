"""What training reports about speed and cost: MFU, ETA, Colab compute units, the step's time split, the CPU-run
estimate and notebook 03's plan of a run. A device not in PEAK_TFLOPS says "MFU unknown", never a wrong number."""

from __future__ import annotations

import contextlib
import math
import platform
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from gptlib.colab import in_colab
from gptlib.errors import ConfigError, in_notebook, loud
from gptlib.model import model_size
from gptlib.training.step import lr_at

# Dense tensor-core peak in TFLOP/s for the precision gptlib trains in: bf16, fp16 on the T4. First match wins. No
# V100 (Colab's torch has no kernels for it); no RTX PRO 6000 until NVIDIA's dense bf16 figure can be cited.
PEAK_TFLOPS = [
    (r"H200", "H200", 989.0),
    (r"H100.*PCIe", "H100 PCIe", 756.0),
    (r"H100.*NVL", "H100 NVL", 835.0),
    (r"H100", "H100 SXM", 989.0),
    (r"A100", "A100", 312.0),
    (r"\bL4\b", "L4", 121.0),
    (r"\bT4\b", "T4 (fp16)", 65.0),
]

# Colab compute units per hour of each GPU runtime (March 2026, source in docs/gpu.md; G4 is the RTX PRO 6000),
# and the runtime a GPU's name says (an A100 with over 60 GiB is the 80GB one). Colab changes its prices:
# TrainConfig.colab_units_per_hour replaces this table's rate.
COLAB_UNITS_PER_HOUR = {"T4": 1.19, "L4": 1.71, "A100 40GB": 5.40, "A100 80GB": 7.52, "G4": 8.71}
COLAB_RUNTIMES = (
    (r"\bT4\b", "T4"),
    (r"\bL4\b", "L4"),
    (r"RTX PRO 6000", "G4"),
    (r"A100", "A100 40GB"),
)


@dataclass
class DevicePeak:
    name: str
    peak_flops: float | None  # FLOP/s, None if unknown
    note: str  # why there is no MFU, or which peak is used
    # Colab compute units per hour of this runtime; None if unknown
    units_per_hour: float | None = None


def lookup_peak(gpu_name: str) -> tuple[str | None, float | None]:
    """'NVIDIA A100-SXM4-40GB' -> ('A100', 312e12 FLOP/s); an unlisted name -> (None, None)."""
    for pattern, family, tflops in PEAK_TFLOPS:
        if re.search(pattern, gpu_name, flags=re.IGNORECASE):
            return family, tflops * 1e12
    return None, None


def device_peak(device: str | torch.device, units_per_hour: float | None = None) -> DevicePeak:
    """units_per_hour (TrainConfig.colab_units_per_hour), when set, replaces the table's rate."""
    device = torch.device(device)
    if device.type != "cuda":
        note = f"MFU unknown on {device.type} (no peak table for it)"
        return DevicePeak(f"{device.type}: {cpu_name()}", None, note, units_per_hour or None)
    name = torch.cuda.get_device_name(device)
    family, peak = lookup_peak(name)
    memory = torch.cuda.get_device_properties(device).total_memory
    runtime = next(
        (r for pattern, r in COLAB_RUNTIMES if re.search(pattern, name, flags=re.IGNORECASE)), None
    )
    if runtime == "A100 40GB" and memory > 60 * 2**30:
        runtime = "A100 80GB"
    note = (
        f"peak {peak / 1e12:.0f} TFLOP/s ({family}, dense)"
        if peak
        else f"MFU unknown: {name!r} is not in gptlib.training.throughput.PEAK_TFLOPS"
    )
    return DevicePeak(name, peak, note, units_per_hour or COLAB_UNITS_PER_HOUR.get(runtime))


def cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "CPU"


def mfu(
    flops_per_token: float, tokens_per_s: float, peak_flops: float | None, n_devices: int = 1
) -> float | None:
    return flops_per_token * tokens_per_s / (peak_flops * n_devices) if peak_flops else None


def fmt_mfu(value: float | None) -> str:
    return "unknown" if value is None else f"{100 * value:.1f}%"


def fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(round(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


def fmt_split(split: dict[str, float]) -> str:
    total = sum(split.values())
    return " ".join(f"{k} {100 * v / total:.0f}%" for k, v in split.items()) if total > 0 else ""


def fmt_tokens(n: float) -> str:
    """A token count in the unit that fits, 3 significant digits: 5.12K, 268M, 2.8B (never "0.000B")."""
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= 0.9995 * div:  # 999,600 is "1M", not "1e+03K"
            v = n / div
            return f"{v:,.0f}{unit}" if v >= 999.5 else f"{v:.3g}{unit}"
    return f"{n:,.0f}"


def colab_units(seconds: float, units_per_hour: float | None) -> float | None:
    return units_per_hour * seconds / 3600 if units_per_hour and math.isfinite(seconds) else None


def perf_fields(
    split: dict[str, float],
    flops_per_token: float,
    tokens_per_s: float,
    peak: DevicePeak,
    n_devices: int,
    tokens_seen: int,
    tokens_target: int,
    eta_tokens_per_s: float | None = None,
) -> dict:
    """A metrics row's MFU, ETA, Colab units left and time split (fractions). eta_tokens_per_s: the rate the ETA
    assumes, when it differs (validations cost wall time, not MFU)."""
    total, rate = sum(split.values()), eta_tokens_per_s or tokens_per_s
    eta = max(0, tokens_target - tokens_seen) / rate if rate > 0 else math.inf
    m = mfu(flops_per_token, tokens_per_s, peak.peak_flops, n_devices)
    units = colab_units(eta, peak.units_per_hour)
    return {
        "mfu": None if m is None else round(m, 4),
        "eta_s": round(eta, 1) if math.isfinite(eta) else None,
        "colab_units_left": None if units is None else round(units * n_devices, 2),
        "time_split": {k: round(v / total, 3) for k, v in split.items()} if total > 0 else {},
    }


def speed_text(row: dict, split: bool = False) -> str:
    """A metrics row's speed, as the bar, the progress lines and the live plot show it: "1.23M tok/s, MFU 45.7%,
    ETA 12h34m", and with split where a step's time goes ("time data 3% fwd_bwd 90% optim 7%")."""
    parts = [
        row.get("tokens_per_s") and f"{fmt_tokens(row['tokens_per_s'])} tok/s",
        row.get("mfu") is not None and f"MFU {fmt_mfu(row['mfu'])}",
        row.get("eta_s") is not None and f"ETA {fmt_duration(row['eta_s'])}",
        split and row.get("time_split") and f"time {fmt_split(row['time_split'])}",
    ]
    return ", ".join(p for p in parts if p)


# No "<remaining" from tqdm: the postfix carries the ETA computed from tokens/s after warm-up. The postfix (loss,
# tok/s, MFU, ETA) stays under 50 characters, to leave the bar a fair share of a 100-column line.
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"


def plain_progress(stream) -> bool:
    """Plain progress lines instead of a bar: the bar's stream is a file or a pipe (there a bar's carriage-return
    redraws make one endless line), and tqdm.auto would not draw a notebook widget."""
    from tqdm.auto import tqdm
    from tqdm.notebook import tqdm as notebook_tqdm  # never fails: tqdm guards its IPython imports

    return not issubclass(tqdm, notebook_tqdm) and not getattr(stream, "isatty", lambda: False)()


class RunProgress:
    """What a training call shows while it runs: the progress bar, a line with the details every TEXT_EVERY_S (all
    there is where stderr is a file or a notebook has no widgets), the lines it says, the on_log callback; and the
    clocks behind its figures. One tokens/s figure everywhere: this session's tokens over its time spent stepping,
    leaving out its first step (compile, kernel tuning) and the `paused` blocks (validations, samples, saves), which the
    ETA counts."""

    TEXT_EVERY_S = 60.0

    def __init__(self, run, timer, progress: bool, log: Callable[[str], None], on_log):
        self.run, self.tc, self.timer, self.progress = run, run.cfg.train, timer, progress
        self.log, self.on_log = log, on_log
        self.peak = device_peak(run.device, self.tc.colab_units_per_hour)
        self.flops_per_token = model_size(run.cfg.model).flops_per_token
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=self.tc.max_steps,
            initial=run.state.step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            bar_format=BAR_FORMAT,
            disable=not progress or plain_progress(sys.stderr),
        )
        self.elapsed_before = run.state.elapsed_s  # training time of earlier sessions
        self.t_start = self.t_last = self.t_text = time.time()
        self.tokens_last = run.state.tokens_seen
        # the measured intervals; the paused blocks
        self.steady_tokens, self.steady_s, self.paused_s = 0, 0.0, 0.0
        self.split: Counter[str] = Counter()  # the measured intervals' time split
        self.perf = {}
        self.warm = False  # the session's first step is behind us

    def started(self) -> None:
        """Said once the loop starts: compiling; on a resume, the run so far to a live plot (not at the next
        validation, minutes away on a big model)."""
        if self.run.compiled:
            self.say(
                "compiling the model: the first step takes a minute or two; throughput is measured after it"
            )
        if self.run.history and self.on_log is not None:
            self.on_log({"step": self.run.state.step, "samples": []})

    def warmed_up(self, loss: torch.Tensor) -> None:
        """The session's first step: wait for it (one host sync, once), then start the clock."""
        loss.item()
        self.warm, self.t_last, self.tokens_last = True, time.time(), self.run.state.tokens_seen
        if self.run.compiled:
            self.say(f"compiled and warmed up in {self.t_last - self.t_start:.0f} s")
        self.timer.split()  # the time split leaves the first step out too

    def measure(self) -> dict:
        """At a log step: the interval since the last one measured -> the speed fields of its metrics row."""
        tokens, now = self.run.state.tokens_seen, time.time()
        # else only the warm-up step ran since the clock started
        if tokens > self.tokens_last:
            self.steady_tokens += tokens - self.tokens_last
            self.steady_s += now - self.t_last
            self.t_last, self.tokens_last = now, tokens
            self.split.update(self.timer.split())
            # validations included: for the ETA
            wall_rate = self.steady_tokens / (self.steady_s + self.paused_s)
            # the steps left at this session's tokens per step (an earlier session's batch may have differed)
            target = tokens + (self.tc.max_steps - self.run.state.step) * self.run.tokens_per_step
            devices, tps = self.run.ddp.world_size, self.steady_tokens_per_s()
            self.perf = perf_fields(
                self.split, self.flops_per_token, tps, self.peak, devices, tokens, target, wall_rate
            )
        return self.speed(now)

    def speed(self, now: float | None = None) -> dict:
        """A metrics row's speed fields: tokens/s (once measured), elapsed time, MFU, ETA, the time split."""
        tps = self.steady_tokens_per_s()
        return {
            **({"tokens_per_s": round(tps, 1)} if tps is not None else {}),
            "elapsed_s": round(self.elapsed(now), 3),
            **self.perf,
        }

    def show(self, train_loss: float | None, line: bool = True) -> None:
        """The bar's postfix: the last loss and the speed; with `line`, every TEXT_EVERY_S a line of the details."""
        speed = {"tokens_per_s": self.steady_tokens_per_s(), **self.perf}
        loss = train_loss is not None and f"loss {train_loss:.4f}"
        self.bar.set_postfix_str(", ".join(filter(None, [loss, speed_text(speed)])))
        now, st = time.time(), self.run.state
        if line and self.progress and now - self.t_text >= self.TEXT_EVERY_S:
            self.t_text = now
            lr = lr_at(st.step - 1, self.tc)
            self.say(
                f"step {st.step:,}/{self.tc.max_steps:,}: loss {train_loss:.4f}, lr {lr:.2e}, "
                + speed_text(speed, split=True)
            )

    def report_validation(self, row: dict, samples: list[dict], status: str) -> None:
        msg = f"step {row['step']:,}: train {row['train_loss']:.4f}, val {row['val_loss']:.4f}"
        if row.get("hellaswag_acc_norm") is not None:
            msg += f", HellaSwag acc_norm {row['hellaswag_acc_norm']:.4f} ({row['hellaswag_n']:,} items)"
        self.say(msg + (f" | {status}" if status else ""))
        if self.on_log is not None:
            self.on_log({**row, "samples": samples})

    @contextlib.contextmanager
    def paused(self):
        """Validations, samples and saves: their time counts in the ETA, not in tokens/s or MFU."""
        t0 = time.time()
        try:
            yield
        finally:
            if self.warm:
                spent = time.time() - t0
                self.t_last += spent
                self.paused_s += spent

    def steady_tokens_per_s(self) -> float | None:
        """This session's tokens/s while stepping: the figure shown everywhere (None until measured)."""
        return self.steady_tokens / self.steady_s if self.steady_s > 0 else None

    def say(self, msg: str) -> None:
        """A line for the user that does not break the progress bar."""
        (self.log if self.bar.disable else self.bar.write)(msg)

    def close(self, train_loss: float | None) -> None:
        # training has stopped: the bar it leaves keeps no ETA (after a stop, "ETA 0m08s" stayed)
        self.perf.pop("eta_s", None)
        self.show(train_loss, line=False)
        self.bar.close()

    def elapsed(self, now: float | None = None) -> float:
        """Training wall time over all sessions (the checkpoint's)."""
        return self.elapsed_before + (now or time.time()) - self.t_start

    def session_s(self) -> float:
        return time.time() - self.t_start


def run_tokens(cfg, start_step: int = 0) -> int:
    return max(0, cfg.train.max_steps - start_step) * cfg.tokens_per_step


def run_flops(cfg, start_step: int = 0) -> float:
    """Training FLOPs of the run from start_step (compile=auto's measure of whether compiling pays)."""
    return float(model_size(cfg.model).flops_per_token) * run_tokens(cfg, start_step)


# A GPU preset on a CPU (a Colab notebook opened without a GPU runtime, docs/gpu.md): a run estimated over
# CPU_ADVISE_S (about what a notebook cell is worth waiting for) gets the advice to switch runtime; over CPU_REFUSE_S
# with device=auto it is refused before anything is written.
GPU_PRESETS = ("phase2", "gpt2-small", "gpt2-medium", "finetune")
CPU_ADVISE_S, CPU_REFUSE_S = 600.0, 3600.0

# Training on a CPU runs its matmuls at about CPU_MATMUL_SHARE of one big matmul's rate (cpu_train_flops), plus a
# fixed cost per op, whatever its size (all of a tiny model's time): CPU_LAYER_PASS_S per layer per micro-batch.
# Measured by benchmarks/cpu_estimate.py (benchmarks/results/cpu_estimate_cpu.txt).
CPU_MATMUL_SHARE = 0.7
CPU_LAYER_PASS_S = 2e-3


def cpu_train_flops(seconds: float = 0.2) -> float:
    """FLOP/s of a 1024 x 1024 fp32 matmul on this CPU, measured now for ~`seconds`."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b  # the first call pays thread start-up
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds or n < 2:
        a @ b
        n += 1
    return 2 * 1024**3 * n / elapsed


def estimate_cpu_seconds(cfg, start_step: int = 0, flops_per_s: float | None = None) -> float:
    """Rough seconds the rest of the run takes on this CPU, validations included (a forward alone, or a sampled
    token, costs a third of a training micro-batch)."""
    tc, mc = cfg.train, cfg.model
    steps = max(0, tc.max_steps - start_step)
    validations = steps // tc.eval_interval + 1  # every eval_interval steps, and at the end
    eval_batches = validations * tc.eval_batches
    sampled = validations * len(tc.sample_prompts) * tc.sample_tokens
    tokens = run_tokens(cfg, start_step) + eval_batches * tc.batch_size * mc.block_size / 3
    passes = steps * (tc.grad_accum_steps + 1) + (eval_batches + sampled) / 3
    overhead = passes * (mc.n_layer + 1) * CPU_LAYER_PASS_S
    flops = model_size(mc).flops_per_token * tokens
    return flops / ((flops_per_s or cpu_train_flops()) * CPU_MATMUL_SHARE) + overhead


def check_cpu_run(cfg, requested: str, start_step: int, log) -> None:
    """A GPU preset on a CPU: nobody should start a 3,000-hour run unknowingly (see GPU_PRESETS); asked for
    explicitly (device=cpu), a long run is a warning."""
    tokens = run_tokens(cfg, start_step)
    if tokens == 0:
        return
    rate = cpu_train_flops()
    secs = estimate_cpu_seconds(cfg, start_step, rate)
    took = f"{secs / 3600:,.0f} hours" if secs >= 3600 else fmt_duration(secs)
    steps = cfg.train.max_steps - start_step
    where = f"this CPU ({cpu_name()}, ~{rate / 1e9:.0f} GFLOP/s measured)"
    # a short run (a tiny base, a few steps): its estimate, no talk of GPUs
    if secs <= CPU_ADVISE_S:
        log(f"on {where}: about {took} for the {steps:,} steps to go")
        return
    msg = (
        f"preset {cfg.preset} is meant for a GPU: its {steps:,} steps to go ({tokens / 1e6:,.1f}M tokens) would "
        f"take about {took} on {where}"
    )
    advice = "On Colab: Runtime > Change runtime type > A100 GPU, then run the notebook again"
    # in notebooks 03 and 05 (the GPU presets'), their settings: 03's length is TOKEN_BUDGET_M, through its plan
    nb = in_notebook()
    # a session time-boxed by max_minutes ends then, however long the run is in all: not refused
    if budget := 60 * cfg.train.max_minutes:
        msg += f"; this session stops after {fmt_duration(budget)} ({'TIME_BUDGET_MIN' if nb else 'max_minutes'})"
    if secs <= CPU_REFUSE_S or 0 < budget <= CPU_REFUSE_S:
        log(f"{msg}. {advice}")
    elif requested == "auto":
        cpu = 'set DEVICE = "cpu"' if nb else "ask for it with --device cpu (device='cpu')"
        setting = "MAX_STEPS" if cfg.preset == "finetune" else "TOKEN_BUDGET_M"
        length = f"a smaller {setting}" if nb else "--set max_steps=N"
        # a run whose one step is over the limit (gpt2-small's) cannot be shortened enough
        shorten = f", or shorten the run ({length})" if secs / steps <= CPU_REFUSE_S else ""
        raise ConfigError(f"{msg}. {advice}; to train on this CPU anyway, {cpu}{shorten}")
    else:
        loud(f"warning: {msg}. {advice}")


@dataclass
class RunPlan:
    max_steps: int  # from the token budget, else the preset's
    summary: str  # tokens/step x steps, the device's peak, each recipe's cost


def plan_run(
    preset: str,
    overrides: list | None = None,
    tokens: float = 0,
    device: str = "auto",
    recipe: str = "gpt2",
) -> RunPlan:
    """Notebook 03: the run's length in steps from a token budget (0: the preset's max_steps)."""
    from gptlib.config import build_config
    from gptlib.runtime import resolve_device

    cfg = build_config(preset, overrides, recipe=recipe)
    per_step = cfg.tokens_per_step
    max_steps = max(1, math.ceil(tokens / per_step)) if tokens > 0 else cfg.train.max_steps
    peak = device_peak(resolve_device(device), cfg.train.colab_units_per_hour)
    if peak.units_per_hour is not None:
        whose = "yours" if cfg.train.colab_units_per_hour else "gptlib table of March 2026"
        rate = f"; {peak.units_per_hour:g} Colab units per hour ({whose})"
    else:  # units mean something on Colab only
        unknown = "; Colab units per hour unknown for it (set COLAB_UNITS_PER_HOUR)"
        rate = unknown if in_colab() else ""
    summary = (
        f"{preset} ({recipe} recipe): {per_step:,} tokens/step x {max_steps:,} steps = "
        f"{fmt_tokens(per_step * max_steps)} tokens\ndevice: {peak.note}{rate}\n"
        f"{recipe_estimate(build_config(preset, overrides), per_step * max_steps, peak)}"
    )
    return RunPlan(max_steps, summary)


# The modern recipe's tokens to the gpt2 recipe's loss, as a fraction of the gpt2 recipe's: the NanoGPT speedrun's
# ~3x at GPT-2 Small's scale, the more conservative figure than the 0.15 a small BPE proxy measured here
# (docs/benchmarks.md). An estimate, not a promise.
MODERN_TOKEN_FRACTION = 0.33
BENCHMARKS_PAGE = "https://github.com/gptlib/gptlib/blob/main/docs/benchmarks.md"  # where a Colab user can read it
# for hours and units: what compile + bf16 reach on an A100 at gpt2-small's shape (nanoGPT)
ASSUMED_MFU = 0.4


def recipe_estimate(gpt2_cfg, tokens: int, peak: DevicePeak) -> str:
    """The tokens (and on a GPU with a known peak, hours and Colab units) each recipe needs to reach the loss the gpt2
    recipe reaches with `tokens`."""
    costs = []
    flops_per_token = model_size(gpt2_cfg.model).flops_per_token
    for recipe, n in (("gpt2", tokens), ("modern", tokens * MODERN_TOKEN_FRACTION)):
        costs.append(f"{recipe} ~{fmt_tokens(n)} tokens")
        if peak.peak_flops is not None:
            seconds = n * flops_per_token / (peak.peak_flops * ASSUMED_MFU)
            units = colab_units(seconds, peak.units_per_hour)
            in_units = "" if units is None else f", ~{units:,.0f} Colab units"
            costs[-1] += f" (~{fmt_duration(seconds)}{in_units})"
    hours = f", hours at an assumed {ASSUMED_MFU:.0%} MFU" if peak.peak_flops is not None else ""
    return (
        f"recipes: to the loss the gpt2 recipe reaches with {fmt_tokens(tokens)} tokens: {', '.join(costs)} (the "
        f"modern recipe's {MODERN_TOKEN_FRACTION:.2f} of the tokens: the NanoGPT speedrun's records; 0.15 measured "
        f"on a small BPE proxy, {BENCHMARKS_PAGE}{hours})"
    )
