"""The config a run trains with, decided once (decide_config), each change from what was asked for said: the recipe
(a model keeps its own), the data's vocabulary, an --init-from base's shape, a resumed run's seed; a resumed run's
model, optimizer, schedule and data checked against its checkpoint's; the micro-batch's memory estimated
(check_fits). The micro-batch is measured after, on the model itself (training/memory.py's fit_micro_batch), where
asked (auto_batch) or where the estimate is near the GPU's size."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import psutil
import torch

from gptlib.checkpoint.format import DRIVE_LIST_TIMEOUT_S
from gptlib.config import RunConfig, TrainConfig
from gptlib.data.tokenizer import load_tokenizer
from gptlib.errors import ConfigError, in_notebook, override
from gptlib.fsutil import call_with_timeout
from gptlib.layout import CONFIG_FILE, TOKENIZER_FILE
from gptlib.model import model_size
from gptlib.training import memory
from gptlib.training.resume import Start, check_same_data
from gptlib.training.step import lr_at
from gptlib.training.throughput import GPU_PRESETS, check_cpu_run


def decide_config(
    asked: RunConfig, config_for, recipe: str | None, start: Start, device: torch.device, log
) -> tuple[RunConfig, bool]:
    """asked: the config asked for; config_for(recipe=...): the same for another recipe; recipe: the one asked for
    explicitly (None: the run's own). -> (the config, whether the micro-batch is to be measured on the model)."""
    if (decided := decide_recipe(asked.recipe, recipe, start)) != asked.recipe:
        asked = config_for(recipe=decided)
    if decided != (recipe or "gpt2"):
        log(f"recipe: {decided} (the {start.whose}'s own)")
    held, model, train = start.held, {}, {}
    if start.meta.vocab_size != asked.model.vocab_size:
        log(
            f"vocab_size {asked.model.vocab_size} (preset) -> {start.meta.vocab_size} (from "
            f"{start.meta.data_dir}/meta.json)"
        )
        model["vocab_size"] = start.meta.vocab_size
    # the vocabulary stays the data's (a base's may grow); the shape is the base's weights' (an --init-from start, or a
    # resume of a run started so), and one asked for otherwise (the preset's, OVERRIDES') is said, not dropped silently
    from_base = start.options.init_from or start.resume is not None and start.resume.state.init_from
    if held is not None and from_base:
        base = {n: getattr(held.model, n) for n in SHAPE}
        wanted = {n: getattr(asked.model, n) for n in SHAPE}
        if other := [f"{n} {v} (not {wanted[n]})" for n, v in base.items() if v != wanted[n]]:
            log(
                f"init-from: the model keeps its base's shape, {', '.join(other)}: its weights fix it"
            )
        model.update(base)
    if start.resume is not None and held.train.seed != asked.train.seed:
        # the batches go on from the checkpoint's sampler state and the dropout RNG from its own: a seed would only
        # change the validation batches (the curve's val loss would jump), so the run keeps its own
        log(
            f"resume: seed stays {held.train.seed} (the run's own, not {asked.train.seed}): a resumed run draws its "
            f"batches on from the checkpoint, so a seed changes nothing after a resume; a new seed needs a new run"
        )
        train["seed"] = held.train.seed
    cfg = dataclasses.replace(
        asked,
        model=dataclasses.replace(asked.model, **model),
        train=dataclasses.replace(asked.train, **train),
    )
    step = start.resume.state.step if start.resume is not None else 0
    if start.resume is not None:
        # named where the checkpoint was found: a resume from the Drive mirror is that folder's run
        where = start.mirror_dir if start.resume.from_mirror else start.run_dir
        # the same data, or a change asked for (recorded in state.json); first, as the data's vocabulary is the
        # model's: another text is named as the user changed it, not as a vocab_size they never set
        options = start.options
        start.resume.data_change = check_same_data(
            start.resume, start.meta, options.allow_data_change, log
        )
        check_same_model(held, cfg, step, where, log)
    # from here on the run writes into its Drive mirror: it must hold this run, or nothing yet
    check_mirror_run(cfg, start)
    cfg.validate()
    tc = cfg.train
    # allowed (a smoke test of a few steps), but a short run's schedule is then not the one its preset means
    if tc.warmup_steps >= tc.max_steps:
        log(
            f"warmup_steps={tc.warmup_steps} is not below max_steps={tc.max_steps}: the learning rate never reaches "
            f"its peak ({tc.learning_rate:g}) nor decays; for a short run set it lower ({override('warmup_steps=N')})"
        )
    # a GPU preset on a CPU: its time is said, or it is refused when that would be days
    if device.type == "cpu" and cfg.preset in GPU_PRESETS:
        check_cpu_run(cfg, cfg.train.device, step, log)
    if tight := check_fits(cfg, device):
        log(f"auto micro-batch: {tight}")
    return cfg, bool(cfg.train.auto_batch or tight)


def decide_recipe(default: str, asked: str | None, start: Start) -> str:
    """A model keeps its recipe (its layers differ): a resumed run's or an --init-from base's own. Another one asked
    for is refused; a new run takes the one asked for (default: the preset's, gpt2)."""
    held = start.held
    if held is None or held.recipe == (asked or held.recipe):
        return held.recipe if held is not None else default
    raise _other_recipe(start, asked)


def _other_recipe(start: Start, asked: str) -> ConfigError:
    held = start.held.recipe
    # where the user is: notebooks 02 and 03 pass their RECIPE dropdown
    keep = f'set RECIPE = "{held}"' if in_notebook() else f"drop --recipe to go on with {held}"
    return ConfigError(
        f"{start.run_dir}: the {start.whose} was trained with recipe {held} but this call asks for {asked}; a "
        f"model keeps its recipe (its layers differ): {keep}, or use a new run directory"
    )


# The model's shape: a checkpoint only resumes into the same one (with the vocabulary and the optimizer). Other
# fields (dropout, every other training setting) may change between sessions; the change is said.
SHAPE = (
    "block_size",
    "n_layer",
    "n_head",
    "n_embd",
    "bias",
    "vocab_multiple",
    "positions",
    "norm",
    "qk_norm",
    "mlp",
    "tie_embeddings",
    "rope_theta",
)


def check_same_model(saved: RunConfig, asked: RunConfig, step: int, where: Path, log) -> None:
    """A checkpoint resumes into its own model and optimizer only; any other change is said."""
    if saved.gptlib_version != asked.gptlib_version:
        log(
            f"resume: trained by gptlib {saved.gptlib_version or '0.1.0 or earlier'} so far, by gptlib "
            f"{asked.gptlib_version} from step {step:,} on"
        )
    if changed := shape_change(saved, asked):
        raise _other_model(saved, asked, where, *changed)
    # auto_batch measures the micro-batch again (its line says the sizes): only other sequences are a change
    n = [
        (t.batch_size * t.grad_accum_steps, t.batch_size * t.eval_batches)
        for t in (saved.train, asked.train)
    ]
    quiet = SHAPE + SCHEDULE + (PROBED if asked.train.auto_batch and n[0] == n[1] else ())
    for old, new in ((saved.model, asked.model), (saved.train, asked.train)):
        for f in dataclasses.fields(old):
            if getattr(old, f.name) != getattr(new, f.name) and f.name not in quiet:
                log(
                    f"resume: {f.name} changed {getattr(old, f.name)!r} -> {getattr(new, f.name)!r}"
                )
    if note := schedule_change(saved.train, asked.train, step):
        log(f"resume: {note}")


def _other_model(saved: RunConfig, asked: RunConfig, where: Path, name: str, a, b) -> ConfigError:
    how = "drop the change to resume"
    # a shape field the user never set: another preset's (notebook 03's PRESET) is named, as what changed
    if saved.preset not in (None, asked.preset):
        keep = f'set PRESET = "{saved.preset}"' if in_notebook() else f"--preset {saved.preset}"
        how = f"it was made with preset {saved.preset}, this call asks for {asked.preset}: {keep} to resume it"
    return ConfigError(
        f"{where} holds a run with {name}={a!r} but this call asks for {name}={b!r}; {how}, or use a new run "
        f"directory"
    )


def shape_change(saved: RunConfig, asked: RunConfig) -> tuple[str, object, object] | None:
    """The first field of the model's make (shape, vocabulary, optimizer) that differs: (name, saved's, asked's)."""
    for section, name in [("model", n) for n in ("vocab_size", *SHAPE)] + [("train", "optimizer")]:
        a, b = getattr(getattr(saved, section), name), getattr(getattr(asked, section), name)
        if a != b:
            return name, a, b
    return None


def say_config_edits(start: Start, cfg: RunConfig, measured: bool, log) -> None:
    """Values in a resumed run's config.json that this run does not use (edited by hand, or written by a session that
    stopped before it saved) are said in one line: a resume takes its config from the call and the checkpoint."""
    # the config.json beside the checkpoint resumed (Drive may hang); none there (deleted by hand): nothing to say
    path = (start.mirror_dir if start.resume.from_mirror else start.run_dir) / CONFIG_FILE
    config = call_with_timeout(
        lambda: json.loads(path.read_bytes()) if path.is_file() else {},
        DRIVE_LIST_TIMEOUT_S,
        what=f"reading {path}",
    )
    held, ours = (vars(c.model) | vars(c.train) for c in (start.held, cfg))
    # the checkpoint's value is the run's record; a micro-batch to be measured is not known yet
    later = PROBED if measured else ()
    unused = [
        f"{n} {_value(v)} (this run: {_value(ours[n])})"
        for n, v in (config.get("model", {}) | config.get("train", {})).items()
        if n in ours and n not in later and v not in (held[n], ours[n])
    ]
    if unused:
        how = "its parameters and OVERRIDES" if in_notebook() else "its flags and --set FIELD=VALUE"
        log(
            f"{path} has {', '.join(unused)}, which this run does not use: a resume takes its config from the "
            f"call and the checkpoint, not {CONFIG_FILE}; ask for a value where the run is started ({how}); "
            f"a shape field needs a new run"
        )


def check_mirror_run(cfg: RunConfig, start: Start) -> None:
    """ConfigError if the Drive mirror holds another run: this one would write its config.json, tokenizer.json and
    logs over that run's, and keep_last would delete its checkpoints. Its config.json is compared as a resumed
    checkpoint's config is (shape_change), then its tokenizer.json (two runs may share a vocabulary size)."""
    if start.mirror_dir is None:
        return
    # Drive may hang
    saved, theirs = call_with_timeout(
        lambda: _mirror_run(start.mirror_dir),
        DRIVE_LIST_TIMEOUT_S,
        what=f"reading {start.mirror_dir}",
    )
    ours, another = start.tokenizer.identity(), f"--mirror-dir {start.mirror_dir} holds another run"
    if saved is not None and (changed := shape_change(saved, cfg)):
        name, a, b = changed
        found = f"its {CONFIG_FILE} has {name}={a!r}, this run's has {b!r}"
    elif theirs is not None and theirs["hash"] != ours["hash"]:
        found = f"its {TOKENIZER_FILE} is {_tokenizer(theirs)}, this run's is {_tokenizer(ours)}"
    else:
        return
    raise ConfigError(f"{another}: {found}; choose another folder for this run's copy")


def _mirror_run(mirror_dir: Path) -> tuple[RunConfig | None, dict | None]:
    """The run in the mirror: its config.json and its tokenizer's identity (None: not there yet)."""
    config, tokenizer = mirror_dir / CONFIG_FILE, mirror_dir / TOKENIZER_FILE
    saved = theirs = None
    if config.is_file():
        saved = RunConfig.from_dict(json.loads(config.read_text()), str(config))
    if tokenizer.is_file():
        theirs = load_tokenizer(tokenizer).identity()
    return saved, theirs


def _tokenizer(identity: dict) -> str:
    return f"{identity['kind']}, {identity['vocab_size']:,} tokens ({identity['hash'][:12]})"


# what fit_micro_batch sets, keeping the sequences of a step and of a validation
PROBED = ("batch_size", "grad_accum_steps", "eval_batches")
# lr_at's
SCHEDULE = (
    "learning_rate",
    "max_steps",
    "schedule",
    "cooldown_frac",
    "warmup_steps",
    "min_lr_ratio",
)


def schedule_change(old: TrainConfig, new: TrainConfig, step: int) -> str | None:
    """What a changed learning_rate, max_steps or schedule does to the LR at `step`, in one line; None if none
    changed."""
    changed = [k for k in SCHEDULE if getattr(old, k) != getattr(new, k)]
    if not changed:
        return None
    before, after = lr_at(step, old), lr_at(step, new)
    lr = (
        f"stays {after:.3g}: the run goes on unchanged"
        if math.isclose(before, after, rel_tol=1e-9)
        else f"goes {before:.3g} -> {after:.3g}"
    )
    what = ", ".join(f"{k} {_value(getattr(old, k))} -> {_value(getattr(new, k))}" for k in changed)
    return f"{what}: the LR at step {step:,} {lr}"


def _value(v) -> str:
    if isinstance(v, bool):  # an int too: not 1 or 0
        return str(v)
    return f"{v:,}" if isinstance(v, int) else f"{v:g}" if isinstance(v, float) else str(v)


# On a GPU, a micro-batch estimated above this share of its memory is measured (auto_batch's probe) instead of trusted:
# the estimate is rough, and an OOM found after minutes of compiling costs more than the probe's seconds.
# gpt2-small's 16 x 1024 on a 16 GB T4 is estimated at 13.4 GiB of its 14.7.
TIGHT_SHARE = 0.8


def check_fits(cfg, device: torch.device) -> str:
    """-> why the micro-batch must be measured although auto_batch is off ("": it need not be): on a GPU, one estimated
    above TIGHT_SHARE of its memory. ConfigError, before anything is written, for one that needs more than all of
    this machine's RAM (no GPU)."""
    micro = cfg.train.batch_size
    if device.type == "cuda":
        if cfg.train.auto_batch:  # measured anyway
            return ""
        need = estimate_train_bytes(cfg.model, micro)
        have = memory.device_memory(device)
        if need <= TIGHT_SHARE * have:
            return ""
        return (
            f"batch_size={micro:,} x block_size={cfg.model.block_size:,} is estimated at {need / 2**30:,.1f} GiB "
            f"of the GPU's {have / 2**30:,.1f} GiB: measuring the largest micro-batch that fits instead"
        )

    # no memory probe here (auto_batch or not); a CPU trains in fp32: activations of 4 bytes, not 2
    need = estimate_train_bytes(cfg.model, micro, activation_bytes=4)
    if need > (have := psutil.virtual_memory().total):
        raise ConfigError(
            f"batch_size={micro:,} x block_size={cfg.model.block_size:,} needs about {need / 2**30:,.1f} "
            f"GiB to train but this machine's RAM has {have / 2**30:,.1f} GiB; lower batch_size (raise "
            f"grad_accum_steps to keep the tokens per step)"
        )
    return ""


def estimate_train_bytes(model_cfg, micro_batch: int, activation_bytes: int = 2) -> int:
    """Rough memory of training: weights + grads + AdamW moments (16 B/param in fp32; an untied head is parameters
    too), activations (~17 values per token per layer per channel: 34 B in bf16, 68 in fp32) and the logits: eager
    cross-entropy holds 14 B per logit (bf16 logits 2, their fp32 copy 4, log-softmax 4, its gradient 4)."""
    c = model_cfg
    tokens = micro_batch * c.block_size
    return int(
        16 * model_size(c).params
        + 17 * activation_bytes * tokens * c.n_layer * c.n_embd
        + 14 * tokens * c.padded_vocab_size
    )
