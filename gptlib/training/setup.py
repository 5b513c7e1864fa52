"""train()'s set-up (start_run), in order: where the run starts from (training/start.py: the lease, the resume point
or --init-from base, the recipe), the config decided once (decide_config), and the run's parts (open_run). Skip on a
first read: training/run.py says what a run is made of."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch

from gptlib.batches import BatchSampler, head_ids, load_dataset, loss_masks
from gptlib.checkpoint.format import TrainState
from gptlib.checkpoint.rotation import clean_orphans, prune_damaged
from gptlib.checkpoint.writer import CheckpointWriter
from gptlib.config import RunConfig, TrainConfig
from gptlib.data.conversations import ChatTemplate, first_prompts
from gptlib.data.shards import DatasetMeta, read_spans
from gptlib.data.staging import stage_for_training
from gptlib.data.tokenizer import Tokenizer
from gptlib.errors import ConfigError, override
from gptlib.evaluation.hellaswag import HellaSwagProbe
from gptlib.fsutil import (
    atomic_write_bytes,
    atomic_write_json,
    call_with_timeout,
    cannot_write,
)
from gptlib.layout import CONFIG_FILE, TOKENIZER_FILE
from gptlib.lease import IO_TIMEOUT_S
from gptlib.model import GPT, model_size
from gptlib.runtime import configure_matmul, dtype_name, resolve_device, resolve_dtype, use_compile
from gptlib.training import distributed
from gptlib.training.logs import logs_up_to
from gptlib.training.memory import check_fits, estimate_train_bytes, fit_micro_batch
from gptlib.training.optimizer import build_optimizer, slow_muon_note
from gptlib.training.resume import check_same_data, set_aside_damaged
from gptlib.training.run import RunData, TrainingRun
from gptlib.training.start import (
    Start,
    StartOptions,
    claimed,
    decide_recipe,
    find_start,
    names_this_run,
    start_from_base,
)
from gptlib.training.step import lr_at
from gptlib.training.throughput import check_cpu_run, run_flops


def build_model(cfg: RunConfig, device: torch.device, log) -> tuple[GPT, Any, Any, torch.dtype]:
    tc = cfg.train
    dtype = resolve_dtype(tc.dtype, device)
    torch.manual_seed(tc.seed)
    configure_matmul(device)
    model = GPT(cfg.model).to(device)
    optimizer = build_optimizer(model, tc, device.type)
    if note := slow_muon_note(tc, device.type):
        log(note)
    # fp16 alone needs loss scaling
    scaler = torch.amp.GradScaler(device.type, enabled=(dtype == torch.float16))
    return model, optimizer, scaler, dtype


def wrap_for_training(
    model: GPT, cfg: RunConfig, device: torch.device, ddp: distributed.Dist, start_step: int = 0
) -> tuple[Any, bool]:
    """-> (what the loop runs, compiled). compile=auto weighs the steps left from start_step (a resume with a few
    steps to go does not pay a compile). DDP goes outermost: its no_sync must be reachable."""
    compiled = use_compile(cfg.train.compile, device, run_flops(cfg, start_step))
    return ddp.wrap(torch.compile(model) if compiled else model, device), compiled


def sample_prompts(
    cfg: RunConfig, meta: DatasetMeta, splits: dict, tokenizer: Tokenizer
) -> tuple[list, list[int]]:
    """-> (prompts, the ids a sample stops at). On chat data a plain string asks the model nothing: the val split's
    first two questions are asked instead, each answer ending at <|end|>."""
    tc = cfg.train
    spans = read_spans(meta, "val") if meta.format == "chat" and tc.sample_prompts else []
    if not len(spans):
        return list(tc.sample_prompts), []
    # the first 64 answers: enough to find two conversations
    reach = int(spans[min(len(spans), 64) - 1][0])
    template = ChatTemplate(tokenizer)
    prompts = first_prompts(
        head_ids(splits["val"], reach), spans, template.eot_id, 2, cfg.model.block_size // 2
    )
    return [p.tolist() for p in prompts], [template.end_id, template.eot_id]


def start_run(
    data_dir: str | Path,
    run_dir: str | Path,
    mirror_dir: str | Path | None,
    asked: RunConfig,
    config_for,
    recipe: str | None,
    options: StartOptions,
    ddp: distributed.Dist,
    *,
    stage_data: bool,
    verbose: bool,
    log,
) -> TrainingRun:
    """Everything before the first step. asked: the config asked for; config_for(recipe=...): the same for another
    recipe; recipe: the one asked for explicitly (None: the run's own)."""
    device = ddp.device(resolve_device(asked.train.device))  # no recipe changes the device or dtype
    # bf16 on a GPU without it: refused before anything changes
    resolve_dtype(asked.train.dtype, device)
    staged = stage_for_training(data_dir, stage_data, log)
    run_dir, mirror_dir = Path(run_dir), Path(mirror_dir) if mirror_dir is not None else None
    # refused inside: no lease, no new directory left behind
    with claimed(run_dir, mirror_dir, ddp, options.take_over, log) as lease:
        start = find_start(staged, run_dir, mirror_dir, options, log)
        if (decided := decide_recipe(asked.recipe, recipe, start)) != asked.recipe:
            asked = config_for(recipe=decided)
        # a run already at max_steps says only that (its summary): set-up lines would read as if it trained again
        finished = start.resume is not None and start.resume.state.step >= asked.train.max_steps
        if decided != (recipe or "gpt2") and not finished:
            log(f"recipe: {decided} (the {start.whose}'s own)")
        run = open_run(start, asked, ddp, device, lease, verbose=verbose, log=log, quiet=finished)
    # checkpoints name the data's lasting place, not the VM's copy
    run.state.data_dir = str(Path(data_dir))
    return run


# The model's shape: a checkpoint only resumes into the same one (with the vocabulary). Other fields (dropout,
# every training setting) may change between sessions; the change is said.
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


def decide_config(
    asked: RunConfig, start: Start, device: torch.device, ddp: distributed.Dist, log
) -> tuple[RunConfig, int]:
    """The config the run trains with (its recipe decided: decide_recipe): the data's vocabulary, the base's shape
    (and, with --init-from, a resumed run's), the micro-batch that fits; each change said. -> (config, the auto_batch
    probe's peak bytes, 0: none)."""
    held = start.held
    model = {}
    if start.meta.vocab_size != asked.model.vocab_size:
        log(
            f"vocab_size {asked.model.vocab_size} (preset) -> {start.meta.vocab_size} (from "
            f"{start.meta.data_dir}/meta.json)"
        )
        model["vocab_size"] = start.meta.vocab_size
    # the vocabulary stays the data's (a base's may grow)
    if held is not None and start.options.init_from:
        model.update({n: getattr(held.model, n) for n in SHAPE})
    train = {}
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
    if start.resume is not None:
        check_same_model(held, cfg, start.resume.state.step, start.run_dir, log)
    cfg.validate()
    check_cpu_run(
        cfg, device, cfg.train.device, start.resume.state.step if start.resume else 0, log
    )
    if tight := check_fits(cfg, device):
        log(f"auto micro-batch: {tight}")
    return fit_micro_batch(cfg, device, ddp, log) if cfg.train.auto_batch or tight else (cfg, 0)


def check_same_model(saved: RunConfig, asked: RunConfig, step: int, where: Path, log) -> None:
    """A checkpoint resumes into its own model and optimizer only; any other change is said."""
    if saved.gptlib_version != asked.gptlib_version:
        log(
            f"resume: trained by gptlib {saved.gptlib_version or '0.1.0 or earlier'} so far, by gptlib "
            f"{asked.gptlib_version} from step {step:,} on"
        )
    for section, name in [("model", n) for n in ("vocab_size", *SHAPE)] + [("train", "optimizer")]:
        a, b = getattr(getattr(saved, section), name), getattr(getattr(asked, section), name)
        if a != b:
            raise ConfigError(
                f"{where} holds a run with {name}={a!r} but this call asks for {name}={b!r}; "
                f"use a new run directory, or drop the change to resume"
            )
    for old, new in ((saved.model, asked.model), (saved.train, asked.train)):
        for f in dataclasses.fields(old):
            if getattr(old, f.name) != getattr(new, f.name) and f.name not in SHAPE + SCHEDULE:
                log(
                    f"resume: {f.name} changed {getattr(old, f.name)!r} -> {getattr(new, f.name)!r}"
                )
    if note := schedule_change(saved.train, asked.train, step):
        log(f"resume: {note}")


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
    return f"{v:,}" if isinstance(v, int) else f"{v:g}" if isinstance(v, float) else str(v)


def open_run(
    start: Start,
    asked: RunConfig,
    ddp: distributed.Dist,
    device: torch.device,
    lease,
    *,
    verbose: bool,
    log,
    quiet: bool = False,
) -> TrainingRun:
    """The checkpoint (or base) is loaded before compile and DDP wrap the model. quiet (a finished run, whose summary
    says all): the set-up's lines go unsaid, but for what it changes on disk (damaged checkpoints set aside)."""
    say = (lambda msg: None) if quiet else log
    cfg, probe_peak = decide_config(asked, start, device, ddp, say)
    # the same model; now the same data (or a change asked for, recorded)
    if start.resume is not None:
        start.resume.data_change = check_same_data(
            start.resume, start.meta, start.options.allow_data_change, say
        )
    meta, data = load_run_data(start, cfg, device, ddp, probe_peak, verbose and not quiet, say)
    # the model and what trains it, from the checkpoint or the base
    model, optimizer, scaler, dtype = build_model(cfg, device, say)
    tc, base = cfg.train, start.base
    sampler = BatchSampler(
        data.splits["train"],
        tc.batch_size,
        cfg.model.block_size,
        tc.seed,
        device,
        data.loss_masks.get("train"),
        rank=ddp.rank,
        world_size=ddp.world_size,
    )
    state = TrainState(
        config=cfg.to_dict(),
        data=meta.identity(),
        data_dir=str(meta.data_dir),
        tokenizer=meta.tokenizer,
        init_from={"run": start.options.init_from, "path": str(base.path), "step": base.step}
        if base
        else {},
    )
    run = TrainingRun(
        cfg=cfg,
        run_dir=start.run_dir,
        ddp=ddp,
        device=device,
        dtype=dtype,
        data=data,
        model=model,
        train_model=model,  # compiled and wrapped below, after the checkpoint is loaded into model
        optimizer=optimizer,
        scaler=scaler,
        sampler=sampler,
        state=state,
        lease=lease,
    )
    if base is not None:
        start_from_base(model, base)
    if start.resume is not None:
        _resume(run, start, say)
    run.train_model, run.compiled = wrap_for_training(model, cfg, device, ddp, run.state.step)
    if ddp.is_main:
        _write_run_files(run, start, log)
    mc = cfg.model
    say(
        f"model: {model_size(mc).params / 1e6:.2f}M parameters ({mc.n_layer} layers, {mc.n_embd} wide, context "
        f"{mc.block_size}, vocab {mc.vocab_size}); device {device}, {dtype_name(run.dtype)}, "
        f"compile {'on' if run.compiled else 'off'}; {run.tokens_per_step:,} tokens/step"
    )
    return run


def load_run_data(
    start: Start,
    cfg: RunConfig,
    device: torch.device,
    ddp: distributed.Dist,
    probe_peak: int,
    verbose: bool,
    log,
) -> tuple[DatasetMeta, RunData]:
    """The tokens placed for this config (on the GPU only with room left to train beside them), the chat loss
    masks, the sample prompts and the HellaSwag probe (fetched, or found off, and tokenized once)."""
    tc, mc = cfg.train, cfg.model
    meta, splits = load_dataset(
        start.meta.data_dir,
        device=device,
        log=log if verbose else lambda line: None,
        reserve_gpu_bytes=max(probe_peak, estimate_train_bytes(mc, tc.batch_size)),
    )
    masks = loss_masks(meta, splits, tc.chat_loss)
    if masks and verbose:
        log(
            f"loss: on the assistants' answers only ({masks['train'].fraction:.1%} of the train tokens; "
            f"{override('chat_loss=all')} puts it on every token)"
        )
    tokenizer = start.tokenizer
    hellaswag = (
        HellaSwagProbe(
            tokenizer,
            mc.block_size,
            source=tc.hellaswag_file or None,
            limit=tc.hellaswag_items or None,
            log=log,
        )
        if tc.hellaswag_every and ddp.is_main
        else None
    )
    prompts, stop_ids = sample_prompts(cfg, meta, splits, tokenizer)
    return meta, RunData(splits, masks, tokenizer, prompts, stop_ids, hellaswag)


def _write_run_files(run: TrainingRun, start: Start, log) -> None:
    """Rank 0's: config.json as the checkpoints record it (after auto_batch), a tokenizer of the run's own, the
    metrics so far and the checkpoint writer."""
    try:
        atomic_write_json(run.run_dir / CONFIG_FILE, run.cfg.to_dict())
        atomic_write_bytes(run.run_dir / TOKENIZER_FILE, run.data.tokenizer.to_json_bytes())
    except OSError as e:  # a disk that filled up (or turned read-only) since the lease: one line, not a traceback
        raise cannot_write(run.run_dir, e) from None
    saved_logs = start.resume.checkpoint["logs"] if start.resume else {}
    run.history = logs_up_to(run.run_dir, run.state.step, saved_logs)
    run.writer = _open_writer(run, start, log)


def _resume(run: TrainingRun, start: Start, log) -> None:
    """The checkpoint back into the run's parts, then what this session adds to its progress."""
    resume = start.resume
    run.load_state_dict(resume.checkpoint, log)
    if resume.data_change:
        run.state.data_changes = [*run.state.data_changes, resume.data_change]
    run.resumed_from = run.state.step
    base = start.options.init_from
    if base and names_this_run(base, run.run_dir, start.mirror_dir):
        log(
            f"init-from: {base} is this run's own directory: resuming it (--init-from only starts a new run, "
            f"from another run's weights)"
        )
    elif base:  # a resumed run keeps its weights
        log(
            f"init-from: {run.run_dir} already has checkpoints; resuming it ({base} only starts a new run)"
        )
    log(
        f"resumed from step {run.state.step:,} (saved {resume.info.saved_at}, {run.state.tokens_seen:,} tokens seen) "
        f"on the {'Drive mirror' if resume.from_mirror else 'local disk'}: {resume.origin}"
    )


def _prune_damaged(run_dir: Path, truncate: bool, since: float | None, log) -> None:
    """In each place only the newest damaged checkpoint is kept and those set aside since `since` (this start); every
    one when no checkpoint could be loaded (since None: a damaged model is mostly good weights). Each one removed is
    said, with its size."""
    try:
        kept, removed = call_with_timeout(
            lambda: prune_damaged(run_dir, truncate, since),
            IO_TIMEOUT_S,
            what=f"removing older damaged checkpoints in {run_dir}",
        )
    except OSError as e:  # Drive: housekeeping, tried again at the next start
        log(
            f"could not remove the older damaged checkpoints in {run_dir} ({e}); tried again next time"
        )
        return
    names = ", ".join(p.name for p in kept)
    for path, size in removed:
        log(
            f"removed {path.name} ({size / 1e6:,.1f} MB), an older damaged checkpoint: only the newest, {names}, "
            f"{'is' if len(kept) == 1 else 'are'} kept in {path.parent}"
        )
    if since is None and kept:
        log(
            f"none could be loaded, so every damaged checkpoint set aside is kept in {kept[0].parent}: {names}"
        )


def _open_writer(run: TrainingRun, start: Start, log) -> CheckpointWriter:
    """Rank 0's writer, after what earlier sessions left: damaged checkpoints set aside (a new one must never take
    a damaged one's name), a save killed mid-way removed. A checkpoint resumed from the local disk goes to Drive too."""
    since = time.time()
    set_aside_damaged(start.passed, start.resume, log)
    for where in (start.run_dir, start.mirror_dir):
        if where is not None:
            _prune_damaged(where, where == start.mirror_dir, since if start.resume else None, log)
    clean_orphans(start.run_dir)  # the mirror is cleaned by its own thread
    tc, passed = run.cfg.train, start.passed
    writer = CheckpointWriter(
        start.run_dir,
        keep_last=tc.keep_last,
        keep_every=tc.keep_every,
        log=log,
        mirror_dir=start.mirror_dir,
        unreadable=set(passed.unreadable),
        mirror_listed=passed.mirror_step,
    )
    if start.resume is not None and start.mirror_dir is not None and not start.resume.from_mirror:
        writer.mirror_existing(start.resume.info.path, run.state.best_step)
    return writer
