"""A training run: its parts built (build_run), and their round trip through a checkpoint.

build_run makes the parts in nanoGPT's order: the model (its micro-batch measured on it where asked), the data placed
beside it, the optimizer and the fp16 loss scaler, the batch sampler; a checkpoint or an --init-from base is loaded into
them; then compile and the DDP wrap (Dist, below: DistributedDataParallel under torchrun). The parts are the model, the
optimizer, the scaler, the sampler, the random generators (dropout) and the progress (step, tokens seen, best loss:
TrainState). Each has state_dict() and load_state_dict(). TrainingRun.state_dict() is the checkpoint of now, each
part's state dict under its name; load_state_dict() puts a loaded checkpoint back into the same parts. Saved and
loaded so, a resumed run takes the very batches, dropout masks and updates the uninterrupted run would have
(tests/test_resume.py checks it bit for bit).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gptlib.batches import BatchSampler, LossMask, head_ids, loss_masks, place_dataset
from gptlib.checkpoint.format import RNG, TrainState, clean_orphans, load_weights_into
from gptlib.checkpoint.writer import CheckpointWriter
from gptlib.config import RunConfig
from gptlib.data.conversations import ChatTemplate, first_prompts
from gptlib.data.shards import DatasetMeta, read_spans
from gptlib.data.tokenizer import Tokenizer
from gptlib.errors import override
from gptlib.evaluation.hellaswag import HellaSwagProbe
from gptlib.fsutil import atomic_write_bytes, atomic_write_json, call_with_timeout, cannot_write
from gptlib.layout import CONFIG_FILE, TOKENIZER_FILE
from gptlib.lease import IO_TIMEOUT_S, RunLease
from gptlib.model import GPT, model_size
from gptlib.runtime import autocast_for, configure_matmul, dtype_name, resolve_dtype, use_compile
from gptlib.training.logs import logs_up_to
from gptlib.training.memory import fit_micro_batch
from gptlib.training.resume import (
    Start,
    names_this_run,
    prune_damaged,
    set_aside_damaged,
    start_from_base,
)
from gptlib.training.start import estimate_train_bytes
from gptlib.training.step import build_optimizer, slow_muon_note
from gptlib.training.throughput import run_flops

# What a checkpoint's progress says of the session that saved it, not of the run: the resuming call has its own.
SESSION_FIELDS = ("config", "data", "data_dir", "tokenizer", "milestone")


@dataclass
class RunData:
    splits: dict[str, Any]  # "train"/"val" -> SplitData (preloaded) or MemmapSplit (on disk)
    loss_masks: dict[str, LossMask]  # chat data: split -> the targets that carry the loss; {}: all
    tokenizer: Tokenizer
    sample_prompts: list  # strings, or token ids (chat data)
    sample_stop_ids: list[int]  # a sample ends at these (chat: <|end|>, <|endoftext|>)
    hellaswag: HellaSwagProbe | None  # TrainConfig.hellaswag_every: scored at validations (rank 0)


@dataclass
class TrainingRun:
    cfg: RunConfig  # frozen: config.json and every checkpoint record it
    run_dir: Path
    ddp: Dist
    device: torch.device
    # the autocast type (float32: none), resolved once here: the step, validation and HellaSwag read it
    dtype: torch.dtype
    data: RunData
    model: GPT  # the module itself: state dicts, samples, validation
    train_model: Any  # compiled and/or DDP-wrapped: what the loop runs
    optimizer: Any  # training/step.py: AdamW, or MuonAdamW (the modern recipe)
    scaler: torch.amp.GradScaler  # fp16 alone scales the loss; disabled otherwise
    sampler: BatchSampler
    state: TrainState  # the progress
    # Rank 0 alone writes the run directory. On the other DDP ranks its writers are the same classes on no
    # directory (RunLease([]), CheckpointWriter(None), metrics.jsonl as os.devnull: training/logs.py), so the loop
    # calls them alike on every rank.
    lease: RunLease  # this process's right to write the run dir and its mirror
    writer: CheckpointWriter = field(default_factory=lambda: CheckpointWriter(None))
    resumed_from: int | None = None  # the step of the checkpoint this call resumed
    history: list[dict] = field(default_factory=list)  # metrics.jsonl rows up to the resumed step
    compiled: bool = False  # train_model is torch.compile's

    @property
    def autocast(self):
        return autocast_for(self.device, self.dtype)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.tokens_per_step * self.ddp.world_size

    def parts(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scaler": self.scaler,
            "sampler": self.sampler,
            "rng": RNG(self.device),
            "progress": self.state,
        }

    def state_dict(self, gather: bool = True) -> dict:
        """The checkpoint of now (gptlib/checkpoint/format.py writes it). Under DDP every rank's sampler state is
        gathered too: a collective, so gather=False where the ranks may be anywhere (an interrupt)."""
        ckpt = {name: part.state_dict() for name, part in self.parts().items()}
        if gather and self.ddp.enabled:
            ckpt["sampler_ranks"] = self.ddp.gathered(ckpt["sampler"])
        return ckpt

    def load_state_dict(self, ckpt: dict, log) -> None:
        """A loaded checkpoint (load_checkpoint's dict) back into the parts. A run made by import-hf holds weights
        only (its optimizer state {}): its progress is loaded, its optimizer, scaler, sampler and generators start
        fresh."""
        # a shape that differs is named, with the checkpoint's path
        load_weights_into(self.model, ckpt["model"], ckpt["info"].path)
        if ckpt["optimizer"]:
            # the config's settings, the saved state
            self.optimizer.load_state_dict(ckpt["optimizer"])
            if ckpt["scaler"]:  # {}: saved with the scaler off (bf16, fp32)
                self.scaler.load_state_dict(ckpt["scaler"])
            note = self.sampler.load_state_dict(ckpt["sampler"], ckpt.get("sampler_ranks"))
            if note and self.ddp.is_main:
                log(note)
            RNG(self.device).load_state_dict(ckpt["rng"])
        self.state.load_state_dict(
            {k: v for k, v in ckpt["progress"].items() if k not in SESSION_FIELDS}
        )


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    # setup_ddp() called init_process_group, so teardown() destroys it
    initialized_here: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, dev: torch.device) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.enabled and dev.type == "cuda" else dev

    def wrap(self, model: torch.nn.Module, dev: torch.device) -> torch.nn.Module:
        if not self.enabled:
            return model
        return DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return t
        t = t.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t / self.world_size

    def agree(self, step: int, every: int, *flags: bool) -> tuple[bool, ...]:
        """Decisions on time and stop requests made identical on every rank (any rank's True -> all), at log steps
        only."""
        if not self.enabled:
            return flags
        if step % every != 0:
            return (False,) * len(flags)
        dev = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        t = torch.tensor([int(f) for f in flags], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return tuple(bool(v) for v in t.tolist())

    def min_int(self, value: int) -> int:
        return min(self.gathered(int(value))) if self.enabled else value

    def gathered(self, value):
        """Every rank's `value` (a sampler state, a micro-batch size), in rank order (None when not distributed)."""
        if not self.enabled:
            return None
        out = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def teardown(self) -> None:
        if self.initialized_here and dist.is_initialized():
            # Every rank waits here first: a rank that destroys the group and exits while another is still
            # finishing (rank 0 writes the last checkpoint) makes gloo abort the other process.
            # a rank already failed: no one to wait for
            with contextlib.suppress(RuntimeError, dist.DistBackendError):
                dist.barrier()
            dist.destroy_process_group()
            self.initialized_here = False


def setup_ddp(device: str = "auto") -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
    here = not dist.is_initialized()
    if here:
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Dist(rank=rank, local_rank=local_rank, world_size=world, initialized_here=here)


def build_run(
    cfg: RunConfig,
    measure: bool,
    start: Start,
    ddp: Dist,
    device: torch.device,
    lease,
    *,
    verbose: bool,
    log,
    say,
) -> TrainingRun:
    """The run's parts for `cfg` (training/start.py's decide_config), where `start` (training/resume.py's find_start)
    says it starts from. say: the set-up's lines (silent for a run already finished: its summary says all); log: what
    changes on disk (damaged checkpoints set aside) is said whatever."""
    dtype = resolve_dtype(cfg.train.dtype, device)
    configure_matmul(device)
    # the model, seeded: a new run starts from the same weights on every rank
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(device)
    # the largest micro-batch that fits, measured on this model where asked (the sequences per step kept)
    cfg, probe_peak = fit_micro_batch(cfg, model, device, ddp, say) if measure else (cfg, 0)
    tc = cfg.train
    data = load_run_data(start, cfg, device, ddp, probe_peak, verbose, say)
    optimizer = build_optimizer(model, tc, device.type)
    if note := slow_muon_note(tc, device.type):
        say(note)
    # fp16 alone needs loss scaling
    scaler = torch.amp.GradScaler(device.type, enabled=(dtype == torch.float16))
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
    parts = dict(
        model=model, train_model=model, optimizer=optimizer, scaler=scaler, sampler=sampler
    )
    run = TrainingRun(
        cfg,
        start.run_dir,
        ddp,
        device,
        dtype,
        data,
        **parts,
        state=new_state(cfg, start),
        lease=lease,
    )
    # the checkpoint (or base) goes into the model before compile and DDP wrap it
    if start.base is not None:
        start_from_base(model, start.base)
    if start.resume is not None:
        resume_into(run, start, say)
    # then compile, and DDP outermost (its no_sync must be reachable)
    run.train_model, run.compiled = wrap_for_training(model, cfg, device, ddp, run.state.step)
    if ddp.is_main:
        write_run_files(run, start, log)
    mc = cfg.model
    say(
        f"model: {model_size(mc).params / 1e6:.2f}M parameters ({mc.n_layer} layers, {mc.n_embd} wide, context "
        f"{mc.block_size}, vocab {mc.vocab_size}); device {device}, {dtype_name(dtype)}, "
        f"compile {'on' if run.compiled else 'off'}; {run.tokens_per_step:,} tokens/step"
    )
    return run


def new_state(cfg: RunConfig, start: Start) -> TrainState:
    """This session's progress before a checkpoint's is loaded: the config, the data and tokenizer it trains on, the
    weights it started from."""
    meta, base = start.meta, start.base
    state = TrainState(
        config=cfg.to_dict(),
        data=meta.identity(),
        data_dir=str(meta.data_dir),
        tokenizer=meta.tokenizer,
    )
    if base is not None:
        state.init_from = {
            "run": start.options.init_from,
            "path": str(base.path),
            "step": base.step,
        }
    return state


def wrap_for_training(
    model: GPT, cfg: RunConfig, device: torch.device, ddp: Dist, start_step: int = 0
) -> tuple[Any, bool]:
    """-> (what the loop runs, compiled). compile=auto weighs the steps left from start_step: a resume with a few
    steps to go does not pay a compile."""
    compiled = use_compile(cfg.train.compile, device, run_flops(cfg, start_step))
    return ddp.wrap(torch.compile(model) if compiled else model, device), compiled


def load_run_data(
    start: Start,
    cfg: RunConfig,
    device: torch.device,
    ddp: Dist,
    probe_peak: int,
    verbose: bool,
    log,
) -> RunData:
    """The tokens placed for this config (on the GPU only with room left to train beside them), the chat loss
    masks, the sample prompts and the HellaSwag probe (fetched, or found off, and tokenized once)."""
    tc, mc = cfg.train, cfg.model
    splits = place_dataset(
        start.meta,
        device=device,
        log=log if verbose else lambda line: None,
        reserve_gpu_bytes=max(probe_peak, estimate_train_bytes(mc, tc.batch_size)),
    )
    masks = loss_masks(start.meta, splits, tc.chat_loss)
    if masks and verbose:
        log(
            f"loss: on the assistants' answers only ({masks['train'].fraction:.1%} of the train tokens; "
            f"{override('chat_loss=all')} puts it on every token)"
        )
    hellaswag = None
    if tc.hellaswag_every and ddp.is_main:
        limit = tc.hellaswag_items or None
        hellaswag = HellaSwagProbe(
            start.tokenizer, mc.block_size, source=tc.hellaswag_file or None, limit=limit, log=log
        )
    prompts, stop_ids = sample_prompts(cfg, start.meta, splits, start.tokenizer)
    return RunData(splits, masks, start.tokenizer, prompts, stop_ids, hellaswag)


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


def resume_into(run: TrainingRun, start: Start, log) -> None:
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
    elif base:  # a resumed run keeps its weights; on a new VM, from the Drive mirror's checkpoints
        held = start.mirror_dir if resume.from_mirror else run.run_dir
        log(
            f"init-from: {held} already has checkpoints; resuming it ({base} only starts a new run)"
        )
    log(
        f"resumed from step {run.state.step:,} (saved {resume.info.saved_at}, {run.state.tokens_seen:,} tokens seen) "
        f"on the {'Drive mirror' if resume.from_mirror else 'local disk'}: {resume.origin}"
    )


def write_run_files(run: TrainingRun, start: Start, log) -> None:
    """Rank 0's: config.json as the checkpoints record it (after auto_batch), a tokenizer of the run's own, the
    metrics so far and the checkpoint writer."""
    try:
        atomic_write_json(run.run_dir / CONFIG_FILE, run.cfg.to_dict())
        atomic_write_bytes(run.run_dir / TOKENIZER_FILE, run.data.tokenizer.to_json_bytes())
    except OSError as e:  # a disk that filled up (or turned read-only) since the lease: one line, not a traceback
        raise cannot_write(run.run_dir, e) from None
    saved_logs = start.resume.checkpoint["logs"] if start.resume else {}
    run.history = logs_up_to(run.run_dir, run.state.step, saved_logs)
    run.writer = open_writer(run, start, log)


def open_writer(run: TrainingRun, start: Start, log) -> CheckpointWriter:
    """Rank 0's writer, after what earlier sessions left: damaged checkpoints set aside (a new one must never take
    a damaged one's name), a save killed mid-way removed. A checkpoint resumed from the local disk goes to Drive too."""
    since = time.time()
    if start.passed.damaged:
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
        mirror_dir=start.mirror_dir,
        unreadable=set(passed.unreadable),
        mirror_listed=passed.mirror_step,
    )
    if start.resume is not None and start.mirror_dir is not None and not start.resume.from_mirror:
        writer.mirror_existing(start.resume.info.path, run.state.best_step)
    return writer


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
