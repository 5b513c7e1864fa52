"""The training loop: one `train()` for notebooks, the CLI and torchrun.

Re-running the same call on the same run directory resumes from its newest valid checkpoint:
model, optimizer, scaler, step (so the LR schedule), tokens seen, every RNG, the sampler, best
validation loss and the metrics history all continue where they stopped.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .checkpoint import (CheckpointWriter, GracefulStop, clean_orphans, fault_point, is_milestone, load_latest,
                         load_weights_into, unwrap_model)
from .config import ConfigError, RunConfig, get_preset
from . import distributed
from .bench import (MicroBatchOOM, StepTimer, auto_micro_batch, device_peak, estimate_train_bytes, free_memory,
                    oom_advice, perf_fields, postfix_fields)
from .data import load_dataset, make_sampler
from .fsutil import atomic_write_bytes, atomic_write_json
from .generate import generate_ids
from .model import GPT
from .tokenizer import TOKENIZER_FILE, check_identity, load_tokenizer

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
CONFIG_FILE = "config.json"
PLOT_FILE = "loss.png"


@dataclass
class TrainResult:
    run_dir: Path
    step: int  # optimizer steps completed
    tokens_seen: int
    train_loss: float | None  # last logged training loss
    val_loss: float | None  # last validation loss
    best_val_loss: float | None
    elapsed_s: float  # training wall time of this call (excluding start-up)
    tokens_per_s: float
    resumed_from: int | None  # step of the checkpoint this call resumed from
    stopped_by: str  # "max_steps" | "max_minutes" | "interrupt" | "sigterm"
    history: list[dict] = field(default_factory=list)  # metrics.jsonl rows


# --- device, precision, schedule ------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but CUDA is not available here (use --device cpu)")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """bf16 on GPUs that support it, fp16 (+ GradScaler) on older GPUs, fp32 on CPU."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def autocast_for(device: torch.device, dtype: torch.dtype):
    """Mixed-precision autocast for a half dtype; a no-op context for float32. Reusable across `with` blocks."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def lr_at(step: int, cfg) -> float:
    """Linear warmup to the peak, then cosine decay to min_lr_ratio * peak at max_steps."""
    peak = cfg.learning_rate
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    min_lr = peak * cfg.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - min_lr)


def optimizer_step(model, optimizer, scaler, grad_clip: float) -> None:
    """One optimizer step after backward: clip (fp16 grads unscaled first), step, update the loss scale, drop grads."""
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


# --- RNG state ------------------------------------------------------------------------------


def capture_rng() -> tuple[dict, dict]:
    """-> (tensors for train_state.pt, JSON-able python/numpy state for state.json)."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.cuda.get_rng_state_all()
    py = random.getstate()
    np_state = np.random.get_state()
    plain = {"python": [py[0], list(py[1]), py[2]],
             "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    return tensors, plain


def restore_rng(tensors: dict, plain: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["torch_cuda"])
    v, state, gauss = plain["python"]
    random.setstate((v, tuple(state), gauss))
    n = plain["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))


# --- run directory ---------------------------------------------------------------------------


def build_config(preset: str | RunConfig, overrides: dict | list | None = None, **explicit) -> RunConfig:
    """Preset (or a RunConfig) + `--set` overrides + explicit keyword values (None = not given)."""
    cfg = get_preset(preset) if isinstance(preset, str) else RunConfig.from_dict(preset.to_dict())
    cfg.apply_overrides(overrides)
    for k, v in explicit.items():
        if v is not None:
            cfg.set(k, v)
    return cfg.validate()


MODEL_FIELDS_THAT_MUST_MATCH = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "bias", "vocab_multiple")


def reconcile_resume_config(saved: RunConfig, asked: RunConfig, where: Path, log) -> RunConfig:
    """On resume the model must be the same; training fields asked for now win, and are reported."""
    for name in MODEL_FIELDS_THAT_MUST_MATCH:
        a, b = getattr(saved.model, name), getattr(asked.model, name)
        if a != b:
            raise ConfigError(
                f"{where} holds a run with {name}={a!r} but this call asks for {name}={b!r}; "
                f"use a new run directory, or drop the change to resume"
            )
    changeable = [(saved.model, asked.model, n) for n in saved.model.__dataclass_fields__
                  if n not in MODEL_FIELDS_THAT_MUST_MATCH]  # dropout: same weights, different regularisation
    changeable += [(saved.train, asked.train, n) for n in saved.train.__dataclass_fields__]
    for old_section, new_section, name in changeable:
        a, b = getattr(old_section, name), getattr(new_section, name)
        if a != b:
            log(f"resume: {name} changed {a!r} -> {b!r}")
    return asked


def _read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines log (metrics, samples); reading stops at a torn last line from a kill mid-write."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            if not isinstance(row, dict):
                break
            rows.append(row)
    return rows


def read_metrics(run_dir: str | Path) -> list[dict]:
    return _read_jsonl(Path(run_dir) / METRICS_FILE)


def read_samples(run_dir: str | Path) -> list[dict]:
    return _read_jsonl(Path(run_dir) / SAMPLES_FILE)


def _truncate_logs(run_dir: Path, upto_step: int) -> list[dict]:
    """Keep metrics and samples rows up to the resumed step (later rows are re-logged by the resumed run);
    -> the metrics rows kept."""
    for name in (METRICS_FILE, SAMPLES_FILE):
        p = run_dir / name
        if p.exists():
            keep = [r for r in _read_jsonl(p) if r.get("step", 0) <= upto_step]
            atomic_write_bytes(p, "".join(json.dumps(r) + "\n" for r in keep).encode())
    return read_metrics(run_dir)


def _restore_logs_from_checkpoint(run_dir: Path, ckpt_dir: Path, step: int) -> None:
    """A fresh VM has no local logs: take the checkpoint's snapshot when it has more rows up to `step`."""
    def rows(p: Path) -> int:
        return sum(1 for r in _read_jsonl(p) if r.get("step", 0) <= step)

    for name in (METRICS_FILE, SAMPLES_FILE):
        src, dst = ckpt_dir / name, run_dir / name
        if src.is_file() and rows(src) > rows(dst):
            atomic_write_bytes(dst, src.read_bytes())


def write_samples_table(run_dir: Path) -> None:
    """samples.md: one row per validation step, one column per fixed prompt ("sample vs step")."""
    rows = read_samples(run_dir)
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))
    steps = sorted({r["step"] for r in rows})
    cell = {(r["step"], r["prompt"]): r["text"] for r in rows}

    def esc(t: str) -> str:
        return t.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| step | " + " | ".join(esc(repr(p)) for p in prompts) + " |",
             "|---:|" + "---|" * len(prompts)]
    for st in steps:
        lines.append(f"| {st} | " + " | ".join(esc(cell.get((st, p), "")) for p in prompts) + " |")
    atomic_write_bytes(run_dir / "samples.md", ("\n".join(lines) + "\n").encode())


def loss_figure(rows: list[dict], title: str = "", figsize=(7, 4), dpi: int = 100):
    """Train and val loss vs step as a matplotlib Figure, without touching pyplot's global state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    tr = [(r["step"], r["train_loss"]) for r in rows if r.get("train_loss") is not None]
    va = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if tr:
        ax.plot(*zip(*tr), label="train", lw=1)
    if va:
        ax.plot(*zip(*va), "o-", label="val", lw=1.5, ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if tr or va:
        ax.legend()
    fig.tight_layout()
    return fig


def plot_losses(rows: list[dict], path: Path, title: str = "") -> None:
    """loss.png in the run dir, replaced atomically so a viewer never reads half a file."""
    fig = loss_figure(rows, title)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    os.replace(tmp, path)


# --- the loop ---------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, split_data, cfg: RunConfig, device, autocast_ctx, seed: int) -> float:
    """Mean loss over eval_batches fixed batches (same batches at every evaluation)."""
    sampler = make_sampler(split_data, cfg.train.batch_size, cfg.model.block_size, seed, device)
    was_training = model.training
    model.eval()
    losses = torch.zeros(cfg.train.eval_batches, device=device)
    for i in range(cfg.train.eval_batches):
        x, y = sampler.next_batch()
        with autocast_ctx:
            _, loss = model(x, y)
        losses[i] = loss.float()
    model.train(was_training)
    return float(losses.mean())


def train(
    data_dir: str | Path,
    run_dir: str | Path,
    preset: str | RunConfig = "phase1",
    overrides: dict | list | None = None,
    *,
    max_steps: int | None = None,
    max_minutes: float | None = None,
    seed: int | None = None,
    device: str | None = None,
    compile: bool | str | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    on_log: Callable[[dict], None] | None = None,
    mirror_dir: str | Path | None = None,
) -> TrainResult:
    """Train (or resume) a GPT on a pre-tokenized data directory; everything lands in run_dir."""
    run_dir = Path(run_dir)
    if isinstance(compile, bool):
        compile = "on" if compile else "off"
    cfg = build_config(preset, overrides, max_steps=max_steps, max_minutes=max_minutes, seed=seed,
                       device=device, compile=compile)

    ddp = distributed.setup(cfg.train.device)  # under torchrun: join the process group; otherwise a no-op
    if not ddp.is_main:  # rank 0 alone logs, shows progress and writes files
        progress, log, on_log = False, (lambda *a, **k: None), None
    dev = ddp.device(resolve_device(cfg.train.device))
    meta, splits = load_dataset(data_dir, device=dev, verbose=progress, log=log,
                                reserve_gpu_bytes=estimate_train_bytes(cfg.model, cfg.train.batch_size))
    if meta.vocab_size != cfg.model.vocab_size:
        log(f"vocab_size {cfg.model.vocab_size} (preset) -> {meta.vocab_size} (from {meta.data_dir}/meta.json)")
        cfg.model.vocab_size = meta.vocab_size
    tokenizer = load_tokenizer(meta.data_dir / meta.tokenizer.get("file", "tokenizer.json"))
    check_identity(tokenizer, meta.tokenizer, str(meta.data_dir))

    # Resume: the newest checkpoint that verifies and loads safely, in run_dir or on the mirror (Drive),
    # decides the model config; corrupt or refused ones are reported and skipped.
    mirror_dir = Path(mirror_dir) if mirror_dir is not None else None
    found = load_latest([run_dir, mirror_dir], log=log)
    ckpt = found[0] if found else None
    resume_state = None
    if ckpt is not None:
        model_sd, train_state, state = found[1:]
        saved_cfg = RunConfig.from_dict(state["config"], source=str(ckpt.path / "state.json"))
        cfg = reconcile_resume_config(saved_cfg, cfg, run_dir, log)
        saved_data = state.get("data", {})
        for key, now in meta.identity().items():
            if saved_data.get(key) is not None and saved_data[key] != now:
                raise ConfigError(
                    f"{ckpt.path} was trained on data with {key}={saved_data[key]!r}, but {meta.data_dir} has "
                    f"{key}={now!r}; resume with the same data or use a new run directory"
                )
        resume_state = (model_sd, train_state, state)
    cfg.validate()
    run_dir.mkdir(parents=True, exist_ok=True)
    if ddp.is_main:
        atomic_write_json(run_dir / CONFIG_FILE, cfg.to_dict())
        # The run carries its own tokenizer copy, so sampling/export never depends on the data dir staying put.
        atomic_write_bytes(run_dir / TOKENIZER_FILE, tokenizer.to_json_bytes())

    tc, mc = cfg.train, cfg.model
    dtype = resolve_dtype(tc.dtype, dev)
    use_compile = tc.compile == "on" or (tc.compile == "auto" and dev.type == "cuda")
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    np.random.seed(tc.seed % (2**32))
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    model = GPT(mc).to(dev)
    if tc.auto_batch:  # the largest micro-batch that fits; batch_size * grad_accum_steps sequences per step kept
        per_step = tc.batch_size * tc.grad_accum_steps
        tc.batch_size = ddp.min_int(auto_micro_batch(model, cfg, dev, dtype, log=log)[0])
        tc.grad_accum_steps = per_step // tc.batch_size
    optimizer = unwrap_model(model).configure_optimizer(tc.weight_decay, tc.learning_rate, (tc.beta1, tc.beta2), dev.type)
    scaler = torch.amp.GradScaler(dev.type, enabled=(dtype == torch.float16))
    sampler = make_sampler(splits["train"], tc.batch_size, mc.block_size, tc.seed + ddp.rank, dev)
    autocast_ctx = autocast_for(dev, dtype)

    step, tokens_seen, best_val, best_step, elapsed_before = 0, 0, None, None, 0.0
    resumed_from = None
    history: list[dict] = []
    if resume_state is not None:
        model_sd, train_state, state = resume_state
        load_weights_into(model, model_sd, ckpt.path)
        optimizer.load_state_dict(train_state["optimizer"])
        if train_state.get("scaler"):
            scaler.load_state_dict(train_state["scaler"])
        ddp.load_sampler_state(sampler, train_state, tc.seed, log)  # = sampler.load_state_dict(...) on one process
        restore_rng(train_state["rng"], state["rng"])
        step, tokens_seen = int(state["step"]), int(state["tokens_seen"])
        best_val, best_step = state.get("best_val_loss"), state.get("best_step")
        elapsed_before = float(state.get("elapsed_s", 0.0))
        resumed_from = step
        if ddp.is_main:
            _restore_logs_from_checkpoint(run_dir, ckpt.path, step)
        history = _truncate_logs(run_dir, step) if ddp.is_main else []
        where = "Drive mirror" if mirror_dir is not None and ckpt.path.is_relative_to(mirror_dir) else "local disk"
        log(f"resumed from step {step:,} (saved {ckpt.saved_at}, {tokens_seen:,} tokens seen) on the {where}: {ckpt.path}")
    else:
        history = _truncate_logs(run_dir, 0) if ddp.is_main else []

    n_params = unwrap_model(model).num_params()
    train_model = ddp.wrap(torch.compile(model) if use_compile else model, dev)  # DDP outermost, for no_sync()
    tokens_per_step = tc.batch_size * mc.block_size * tc.grad_accum_steps * ddp.world_size
    timer, peak, flops_per_token = StepTimer(dev), device_peak(dev), unwrap_model(model).flops_per_token()
    log(f"model: {n_params / 1e6:.2f}M parameters ({mc.n_layer} layers, {mc.n_embd} wide, context "
        f"{mc.block_size}, vocab {mc.vocab_size}); device {dev}, {str(dtype).replace('torch.', '')}, "
        f"compile {'on' if use_compile else 'off'}; {tokens_per_step:,} tokens/step")

    if ddp.is_main:
        clean_orphans(run_dir)  # leftovers of a save killed mid-way (the mirror is cleaned by its own thread)
    writer = (CheckpointWriter(run_dir, keep_last=tc.keep_last, background=True, log=log, mirror_dir=mirror_dir,
                               snapshot_files=(METRICS_FILE, SAMPLES_FILE), keep_every=tc.keep_every)
              if ddp.is_main else distributed.NullWriter())  # rank 0 alone writes checkpoints
    if ckpt is not None and mirror_dir is not None and not ckpt.path.is_relative_to(mirror_dir):
        writer.mirror_existing(ckpt.path, best_step)  # resumed locally: make sure Drive has it too
    save_every = tc.save_every_steps or tc.eval_interval
    sample_gen = torch.Generator(device="cpu")

    def checkpoint_now(s: int, val: float | None, step_begin: tuple | None = None,
                       gather: bool = True) -> None:
        rng_tensors, rng_plain = capture_rng()
        sampler_state = sampler.state_dict()
        if step_begin is not None:  # interrupted mid-step: save the state from before the unfinished step
            sampler_state, rng_tensors["torch_cpu"], cuda_rng = step_begin
            if cuda_rng is not None:
                rng_tensors["torch_cuda"] = cuda_rng
        train_state = {"optimizer": optimizer.state_dict(), "scaler": scaler.state_dict() if scaler.is_enabled() else {},
                       "sampler": sampler_state, "rng": rng_tensors,
                       **(ddp.sampler_states(sampler_state) if gather else {})}  # DDP: every rank's (a collective)
        state = {"step": s, "tokens_seen": tokens_seen, "best_val_loss": best_val, "best_step": best_step,
                 "val_loss": val, "elapsed_s": elapsed_before + (time.time() - t_start), "config": cfg.to_dict(),
                 "data": meta.identity(), "data_dir": str(meta.data_dir), "tokenizer": meta.tokenizer,
                 "rng": rng_plain,
                 # losses of steps not yet logged: the resumed run logs them as the uninterrupted one would
                 "pending_losses": torch.stack(pending_losses).tolist() if pending_losses else []}
        writer.save(s, unwrap_model(model).state_dict(), train_state, state, best_step)

    def log_samples(s: int) -> list[dict]:
        rows = []
        base = unwrap_model(model)
        base.eval()
        for i, prompt in enumerate(tc.sample_prompts):
            sample_gen.manual_seed(tc.seed + i)  # fixed per prompt: samples differ only by the weights
            try:
                prompt_ids = tokenizer.encode(prompt)
            except ValueError as e:
                log(f"sample prompt {prompt!r} skipped: {e}")
                continue
            with autocast_ctx:
                out = generate_ids(base, prompt_ids, tc.sample_tokens, temperature=0.8, top_k=None,
                                   generator=sample_gen)
            rows.append({"step": s, "prompt": prompt, "text": prompt + tokenizer.decode(out)})
        base.train()
        with open(run_dir / SAMPLES_FILE, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        write_samples_table(run_dir)
        return rows

    pbar = None
    if progress:
        from tqdm.auto import tqdm

        pbar = tqdm(total=tc.max_steps, initial=step, desc="train", unit="step", dynamic_ncols=True)

    model.train()
    t_start = time.time()
    tokens_at_start = tokens_seen  # tokens/s of this call: tokens_per_step may differ from the resumed run's
    t_last_log, tokens_at_last_log = t_start, tokens_seen
    last_save_time = t_start
    pending_losses: list[torch.Tensor] = [torch.tensor(v, device=dev) for v in
                                          (resume_state[2].get("pending_losses", []) if resume_state else [])]
    train_loss = history[-1].get("train_loss") if history else None
    val_loss = None
    stopped_by = "max_steps"
    metrics_f = open(run_dir / METRICS_FILE if ddp.is_main else os.devnull, "a")
    step_begin = None
    oom_hint = None  # set when the loop runs out of GPU memory
    stop = GracefulStop().install()  # stop button / SIGTERM: finish the step, save, return
    try:
        while step < tc.max_steps:
            # CUDA's RNG state is host-side seed/offset: reading it does not sync the device.
            step_begin = (sampler.state_dict(), torch.get_rng_state(),
                          torch.cuda.get_rng_state_all() if dev.type == "cuda" else None)
            lr = lr_at(step, tc)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_accum = torch.zeros((), device=dev)
            timer.start()
            for micro in range(tc.grad_accum_steps):
                x, y = sampler.next_batch()
                timer.mark("data")
                with ddp.no_sync(train_model, last_micro_step=micro == tc.grad_accum_steps - 1):
                    with autocast_ctx:
                        _, loss = train_model(x, y)
                    loss = loss / tc.grad_accum_steps
                    loss_accum += loss.detach()
                    scaler.scale(loss).backward()
                timer.mark("fwd_bwd")
            fault_point("mid_step", step + 1)  # tests only (GPTLIB_FAULT); a no-op otherwise
            optimizer_step(model, optimizer, scaler, tc.grad_clip)
            timer.mark("optim")
            step += 1
            step_begin = None  # the step finished: an interrupt from here on saves the current state
            tokens_seen += tokens_per_step
            pending_losses.append(loss_accum)

            is_last = step == tc.max_steps
            over_time = tc.max_minutes > 0 and (time.time() - t_start) / 60.0 >= tc.max_minutes
            time_to_save = tc.save_every_minutes > 0 and time.time() - last_save_time >= 60 * tc.save_every_minutes
            over_time, time_to_save, stop_now = ddp.agree(step, tc.log_interval, over_time, time_to_save,
                                                          bool(stop.reason))  # the same on every rank under DDP
            do_eval = step % tc.eval_interval == 0 or is_last or over_time
            if step % tc.log_interval == 0 or do_eval:
                losses = ddp.mean(torch.stack(pending_losses)).tolist()  # the only host sync: once per log_interval
                pending_losses.clear()
                now = time.time()
                tps = (tokens_seen - tokens_at_last_log) / max(1e-9, now - t_last_log)
                t_last_log, tokens_at_last_log = now, tokens_seen
                perf = perf_fields(timer.split(), flops_per_token, tps, peak, ddp.world_size, tokens_seen,
                                   tc.max_steps * tokens_per_step)  # MFU (None = unknown), ETA, time split
                train_loss = losses[-1]
                for k, l in enumerate(losses):
                    s_k = step - len(losses) + 1 + k
                    row = {"step": s_k, "train_loss": round(l, 6), "lr": lr_at(s_k - 1, tc),
                           "tokens_seen": tokens_seen - (len(losses) - 1 - k) * tokens_per_step}
                    if s_k == step:
                        row.update(tokens_per_s=round(tps, 1), elapsed_s=round(elapsed_before + now - t_start, 3), **perf)
                    if s_k == step and do_eval:
                        continue  # written below with the val loss
                    metrics_f.write(json.dumps(row) + "\n")
                    history.append(row)
                metrics_f.flush()
                if pbar is not None:
                    pbar.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{tps:,.0f}", lr=f"{lr:.2e}", **postfix_fields(perf))
            if do_eval:
                val_loss = evaluate(model, splits["val"], cfg, dev, autocast_ctx, seed=tc.seed + 10_000)
                if best_val is None or val_loss < best_val:
                    best_val, best_step = val_loss, step
                row = {"step": step, "train_loss": round(train_loss, 6), "val_loss": round(val_loss, 6),
                       "lr": lr_at(step - 1, tc), "tokens_seen": tokens_seen, "tokens_per_s": round(tps, 1),
                       "elapsed_s": round(elapsed_before + time.time() - t_start, 3), **perf}
                metrics_f.write(json.dumps(row) + "\n")
                metrics_f.flush()
                history.append(row)
                samples = log_samples(step) if tc.sample_prompts and tc.sample_tokens and ddp.is_main else []
                if ddp.is_main:
                    plot_losses(history, run_dir / PLOT_FILE, title=f"{cfg.preset}: {run_dir.name}")
                msg = f"step {step:,}: train {train_loss:.4f}, val {val_loss:.4f}"
                if writer.status_line():
                    msg += f" | {writer.status_line()}"
                if pbar is not None:
                    pbar.write(msg)
                else:
                    log(msg)
                if on_log is not None:
                    on_log({**row, "samples": samples})
            if stop_now or do_eval or step % save_every == 0 or time_to_save or is_milestone(step, tc.keep_every):
                checkpoint_now(step, val_loss if do_eval else None)
                last_save_time = time.time()
            if pbar is not None:
                pbar.update(1)
            if over_time and not is_last:
                stopped_by = "max_minutes"
                log(f"max_minutes={tc.max_minutes} reached at step {step:,}; checkpoint saved, re-run to continue")
                break
            if stop_now and not is_last:
                stopped_by = stop.reason or "stop"  # under DDP another rank may have received the signal
                log(f"stopped ({stopped_by}) at step {step:,}; checkpoint saved, re-run to continue")
                break
    except torch.OutOfMemoryError:
        oom_hint = oom_advice(tc.batch_size, tc.grad_accum_steps, mc.block_size, ddp.world_size)
    except KeyboardInterrupt:
        stopped_by = "interrupt"
        log(f"interrupted at step {step:,}; saving a checkpoint")
        optimizer.zero_grad(set_to_none=True)
        checkpoint_now(step, None, step_begin, gather=False)  # ranks may be anywhere: no collective
    finally:
        metrics_f.close()
        if pbar is not None:
            pbar.close()
        stop.restore()
        writer.close()  # local save errors raise; Drive problems are reported, never raised
        ddp.teardown()
    if oom_hint is not None:  # drop this frame's GPU tensors first, so the notebook's runtime stays usable
        model = train_model = optimizer = scaler = sampler = splits = x = y = loss = loss_accum = None
        pending_losses.clear()
        free_memory()
        raise MicroBatchOOM(oom_hint)
    elapsed = time.time() - t_start
    return TrainResult(run_dir=run_dir, step=step, tokens_seen=tokens_seen, train_loss=train_loss, val_loss=val_loss,
                       best_val_loss=best_val, elapsed_s=elapsed,
                       tokens_per_s=(tokens_seen - tokens_at_start) / max(elapsed, 1e-9),
                       resumed_from=resumed_from, stopped_by=stopped_by, history=history)
