"""The config a run trains with, decided once: the recipe (a model keeps its own), the data's vocabulary, the
base's or the resumed run's shape, validation, the micro-batch that fits. Each change is said with its reason; the
result is frozen: config.json and every checkpoint record it.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable

import torch

from gptlib.checkpoint.resume import Resume
from gptlib.checkpoint.format import TrainState
from gptlib.config import RunConfig, TrainConfig
from gptlib.data.shards import DatasetMeta
from gptlib.errors import ConfigError
from gptlib.layout import STATE_FILE
from gptlib.model import GPT
from gptlib.runtime import resolve_dtype
from gptlib.training.distributed import Dist
from gptlib.training.memory import auto_micro_batch, check_fits, free_memory
from gptlib.training.step import lr_at
from gptlib.training.throughput import check_cpu_run

# The model's shape: a checkpoint only resumes into the same one (with the vocabulary). Other fields (dropout,
# every training setting) may change between sessions; the change is reported.
SHAPE = ("block_size", "n_layer", "n_head", "n_embd", "bias", "vocab_multiple",
         "positions", "norm", "qk_norm", "mlp", "tie_embeddings", "rope_theta")


def resolve_config(asked: RunConfig, meta: DatasetMeta, resume: Resume | None, base: RunConfig | None,
                   shape_from_run: bool, device: torch.device, ddp: Dist, where: Path, log,
                   ask: Callable[[str], RunConfig] | None = None) -> tuple[RunConfig, int]:
    """The run's config (see the module docstring) and the auto_batch probe's measured peak bytes (0: no probe).
    base: a new --init-from run's base config; shape_from_run: the call passes --init-from, so a resumed run's shape
    is its own, not the preset's; ask(recipe): the config asked for, made with that recipe (None: the call named its
    recipe)."""
    saved = resume.state.run_config(str(resume.info.path / STATE_FILE)) if resume is not None else None
    asked = same_recipe(asked, saved or base, "resumed run" if saved else "--init-from base", where, ask, log)
    base_model = base.model if base is not None else None
    model = {}
    if meta.vocab_size != asked.model.vocab_size:
        log(f"vocab_size {asked.model.vocab_size} (preset) -> {meta.vocab_size} (from {meta.data_dir}/meta.json)")
        model["vocab_size"] = meta.vocab_size
    if base_model is not None:  # the vocabulary stays the data's: the base's, or the base's plus appended tokens
        model.update({n: getattr(base_model, n) for n in SHAPE})
    if resume is not None and shape_from_run:
        model.update({n: getattr(saved.model, n) for n in SHAPE})
    cfg = dataclasses.replace(asked, model=dataclasses.replace(asked.model, **model))
    if resume is not None:
        check_same_model(resume.state, cfg, where, log)
    cfg.validate()
    check_cpu_run(cfg, device, cfg.train.device, resume.state.step if resume else 0, log)
    check_fits(cfg, device)
    return fit_micro_batch(cfg, device, ddp, log) if cfg.train.auto_batch else (cfg, 0)


def same_recipe(asked: RunConfig, source: RunConfig | None, what: str, where: Path,
                ask: Callable[[str], RunConfig] | None, log) -> RunConfig:
    """A model keeps its recipe: with none asked for, the resumed run's (or the base's) is taken; another one asked
    for is refused, naming both."""
    if source is None or source.recipe == asked.recipe:
        return asked
    if ask is None:
        raise ConfigError(f"{where}: the {what} was trained with --recipe {source.recipe} but this call asks for "
                          f"--recipe {asked.recipe}; a model keeps its recipe (its layers differ): drop --recipe to "
                          f"go on with {source.recipe}, or use a new run directory")
    log(f"recipe: {source.recipe} (the {what}'s own)")
    return ask(source.recipe)


def check_same_model(state: TrainState, asked: RunConfig, where: Path, log) -> None:
    """On resume the model and its optimizer must be the checkpoint's (ConfigError naming the field and both
    values); a training setting (or dropout) that changed is said, and what a changed schedule does."""
    saved = state.run_config(str(where / STATE_FILE))
    for section, name in [("model", n) for n in ("vocab_size", *SHAPE)] + [("train", "optimizer")]:
        a, b = getattr(getattr(saved, section), name), getattr(getattr(asked, section), name)
        if a != b:
            raise ConfigError(f"{where} holds a run with {name}={a!r} but this call asks for {name}={b!r}; "
                              f"use a new run directory, or drop the change to resume")
    for old, new in ((saved.model, asked.model), (saved.train, asked.train)):
        for f in dataclasses.fields(old):
            a, b = getattr(old, f.name), getattr(new, f.name)
            if a != b and f.name not in SHAPE:
                log(f"resume: {f.name} changed {a!r} -> {b!r}")
    note = schedule_change(saved.train, asked.train, state.step)
    if note:
        log(f"resume: {note}")


def schedule_change(old: TrainConfig, new: TrainConfig, step: int) -> str | None:
    """What a changed max_steps (or schedule) does to the LR from `step` on, in one line; None if nothing."""
    keys = ("max_steps", "schedule", "cooldown_frac", "warmup_steps", "min_lr_ratio")
    if all(getattr(old, k) == getattr(new, k) for k in keys):
        return None
    before, after = lr_at(step, old), lr_at(step, new)
    plan = f"max_steps {old.max_steps:,} -> {new.max_steps:,}"
    if new.schedule == old.schedule == "wsd" and old.warmup_steps == new.warmup_steps:
        start_old = round(old.max_steps * (1 - old.cooldown_frac))
        start_new = round(new.max_steps * (1 - new.cooldown_frac))
        if step <= min(start_old, start_new):
            return (f"{plan}: step {step:,} is in the wsd schedule's stable phase, so the run goes on exactly as a "
                    f"{new.max_steps:,}-step run (cooldown from step {start_new:,})")
        return (f"{plan}: step {step:,} is past the stable phase (the cooldown began at step {start_old:,}); the LR "
                f"goes {before:.3g} -> {after:.3g}, where a {new.max_steps:,}-step run would have held the peak until "
                f"step {start_new:,}")
    if math.isclose(before, after, rel_tol=1e-9):
        return None
    return (f"{plan} ({old.schedule} -> {new.schedule} schedule): the LR at step {step:,} jumps {before:.3g} -> "
            f"{after:.3g} and the steps so far followed the old plan, so the curve bends (it is not the run a "
            f"{new.max_steps:,}-step plan makes); the wsd schedule (the modern recipe's) extends exactly from its "
            f"stable phase")


def fit_micro_batch(cfg: RunConfig, device: torch.device, ddp: Dist, log) -> tuple[RunConfig, int]:
    """auto_batch: the largest micro-batch whose step fits this GPU (probed on a model of its own, seeded as
    training's, dropped after), grad_accum_steps raised to keep batch_size * grad_accum_steps sequences per step;
    under DDP every rank takes the smallest. Elsewhere the sizes are kept (no OOM to find), and said. -> the config
    and the probe's measured peak bytes (0 without a probe; under DDP this rank's, for a micro-batch at least as
    large as the one taken)."""
    tc = cfg.train
    per_step = tc.batch_size * tc.grad_accum_steps

    def probe_model() -> GPT:
        torch.manual_seed(tc.seed)
        return GPT(cfg.model).to(device)

    micro, _, peak = auto_micro_batch(probe_model, cfg, device, resolve_dtype(tc.dtype, device), log=log)
    micro = ddp.min_int(micro)
    free_memory()
    return dataclasses.replace(cfg, train=dataclasses.replace(tc, batch_size=micro,
                                                              grad_accum_steps=per_step // micro)), peak
