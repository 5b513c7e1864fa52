"""The config a run trains with, decided once.

The preset and the overrides make the config asked for (config.build_config). Everything else that decides a
field happens here, in this order, each change said with its reason:

1. the data's vocabulary (its meta.json);
2. a new run from --init-from: the base's shape;
3. a resumed run: its model must be the one asked for (a run started from --init-from keeps its own shape, so
   the same command resumes it); training settings asked for now win, and each change is said;
4. validation; a GPU preset on a CPU, and a micro-batch larger than the device's memory, refused before
   anything is written;
5. auto_batch: the largest micro-batch that fits this GPU, with the tokens per step kept.

The result is a frozen RunConfig: nothing changes it afterwards, and it is what config.json and every
checkpoint record.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from gptlib.checkpoint.resume import Resume
from gptlib.checkpoint.state import TrainState
from gptlib.config import ModelConfig, RunConfig
from gptlib.data.shards import DatasetMeta
from gptlib.errors import ConfigError
from gptlib.layout import STATE_FILE
from gptlib.model import GPT
from gptlib.runtime import resolve_dtype, seed_everything
from gptlib.training.distributed import Dist
from gptlib.training.memory import auto_micro_batch, check_fits, free_memory
from gptlib.training.throughput import check_cpu_run

# The model's shape: a checkpoint only resumes into the same one (with the vocabulary). Other fields (dropout,
# every training setting) may change between sessions; the change is reported.
SHAPE = ("block_size", "n_layer", "n_head", "n_embd", "bias", "vocab_multiple")


def resolve_config(asked: RunConfig, meta: DatasetMeta, resume: Resume | None, base_model: ModelConfig | None,
                   shape_from_run: bool, device: torch.device, ddp: Dist, where: Path, log) -> RunConfig:
    """The run's config (see the module docstring). base_model: a new --init-from run's base; shape_from_run: the
    call passes --init-from, so a resumed run's shape is its own, not the preset's."""
    model = {}
    if meta.vocab_size != asked.model.vocab_size:
        log(f"vocab_size {asked.model.vocab_size} (preset) -> {meta.vocab_size} (from {meta.data_dir}/meta.json)")
        model["vocab_size"] = meta.vocab_size
    if base_model is not None:  # the vocabulary stays the data's: the base's, or the base's plus appended tokens
        model.update({n: getattr(base_model, n) for n in SHAPE})
    if resume is not None and shape_from_run:
        saved = resume.state.run_config(str(resume.info.path / STATE_FILE))
        model.update({n: getattr(saved.model, n) for n in SHAPE})
    cfg = dataclasses.replace(asked, model=dataclasses.replace(asked.model, **model))
    if resume is not None:
        check_same_model(resume.state, cfg, where, log)
    cfg.validate()
    check_cpu_run(cfg, device, cfg.train.device, resume.state.step if resume else 0, log)
    check_fits(cfg, device)
    return fit_micro_batch(cfg, device, ddp, log) if cfg.train.auto_batch else cfg


def check_same_model(state: TrainState, asked: RunConfig, where: Path, log) -> None:
    """On resume the model must be the checkpoint's (ConfigError naming the field and both values); a training
    setting (or dropout) that changed is said."""
    saved = state.run_config(str(where / STATE_FILE))
    for name in ("vocab_size", *SHAPE):
        a, b = getattr(saved.model, name), getattr(asked.model, name)
        if a != b:
            raise ConfigError(f"{where} holds a run with {name}={a!r} but this call asks for {name}={b!r}; "
                              f"use a new run directory, or drop the change to resume")
    for old, new in ((saved.model, asked.model), (saved.train, asked.train)):
        for f in dataclasses.fields(old):
            a, b = getattr(old, f.name), getattr(new, f.name)
            if a != b and f.name not in SHAPE:
                log(f"resume: {f.name} changed {a!r} -> {b!r}")


def fit_micro_batch(cfg: RunConfig, device: torch.device, ddp: Dist, log) -> RunConfig:
    """auto_batch: the largest micro-batch whose step fits this GPU (probed on a model of its own, seeded as
    training's, dropped after), grad_accum_steps raised to keep batch_size * grad_accum_steps sequences per step;
    under DDP every rank takes the smallest. Elsewhere the sizes are kept (no OOM to find), and said."""
    tc = cfg.train
    per_step = tc.batch_size * tc.grad_accum_steps

    def probe_model() -> GPT:
        seed_everything(tc.seed)
        return GPT(cfg.model).to(device)

    micro = ddp.min_int(auto_micro_batch(probe_model, cfg, device, resolve_dtype(tc.dtype, device), log=log)[0])
    free_memory()
    return dataclasses.replace(cfg, train=dataclasses.replace(tc, batch_size=micro, grad_accum_steps=per_step // micro))
