"""What train() sets up before its loop, in order: the data and its tokenizer; the resume point (local or Drive),
else the --init-from base; the config, decided once (training/resolve.py); the tokens, placed for it; the model,
optimizer, scaler and sampler with the checkpoint loaded into them, then compiled and DDP-wrapped; config.json
and tokenizer.json in the run dir. The lease comes first: nothing in the run dir changes before this process holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from gptlib.batches import BatchSampler, LossMask, head_ids, load_dataset, loss_masks
from gptlib.checkpoint.format import RNG, TrainState, load_weights_into
from gptlib.checkpoint.resume import DRIVE_ADVICE, Passed, Resume, check_same_data, find_resume, set_aside_damaged
from gptlib.checkpoint.rotation import clean_orphans
from gptlib.checkpoint.writer import CheckpointWriter, NullCheckpointWriter
from gptlib.config import RunConfig
from gptlib.data.conversations import ChatTemplate, first_prompts
from gptlib.data.shards import META_FILE, DatasetMeta, read_meta, read_spans
from gptlib.data.tokenizer import Tokenizer, check_identity, load_tokenizer
from gptlib.errors import ConfigError, DataFormatError, HungIOError
from gptlib.evaluation.hellaswag import HellaSwagProbe
from gptlib.fsutil import atomic_write_bytes, atomic_write_json, call_with_timeout, cannot_write, check_dir
from gptlib.inference.loading import load_run
from gptlib.layout import CONFIG_FILE, STATE_FILE, TOKENIZER_FILE, checkpoints_dir
from gptlib.lease import IO_TIMEOUT_S, NoLease, RunLease
from gptlib.model import GPT, model_size
from gptlib.runtime import (autocast_for, configure_matmul, dtype_name, resolve_device, resolve_dtype,
                            use_compile)
from gptlib.training import distributed
from gptlib.training.logs import restore_logs_from_checkpoint, truncate_logs
from gptlib.training.memory import train_reserve_bytes
from gptlib.training.optimizer import build_optimizer, check_optimizer_state, load_optimizer, slow_muon_note
from gptlib.training.resolve import resolve_config
from gptlib.training.throughput import run_flops


def build_model(cfg: RunConfig, device: torch.device, log) -> tuple[GPT, Any, Any, torch.dtype]:
    """The model (seeded init), its optimizer and the grad scaler (on only for fp16) -> (model, optimizer, scaler,
    dtype). Shared by training and the throughput benchmark."""
    tc, mc = cfg.train, cfg.model
    dtype = resolve_dtype(tc.dtype, device)
    torch.manual_seed(tc.seed)
    configure_matmul(device)
    model = GPT(mc).to(device)
    optimizer = build_optimizer(model, tc, device.type)
    if note := slow_muon_note(tc, device.type):
        log(note)
    scaler = torch.amp.GradScaler(device.type, enabled=(dtype == torch.float16))
    return model, optimizer, scaler, dtype


def wrap_for_training(model: GPT, cfg: RunConfig, device: torch.device, ddp: distributed.Dist) -> tuple[Any, bool]:
    """torch.compile (TrainConfig.compile; "auto": a CUDA run long enough to pay for compiling), then DDP
    outermost (for no_sync) -> (what the loop runs, compiled)."""
    compiled = use_compile(cfg.train.compile, device, run_flops(cfg))
    return ddp.wrap(torch.compile(model) if compiled else model, device), compiled


CHAT_SAMPLES = 2  # chat data: the val split's first questions sampled at each validation


def sample_prompts(cfg: RunConfig, meta: DatasetMeta, splits: dict, tokenizer: Tokenizer) -> tuple[list, list[int]]:
    """The fixed prompts sampled at each validation and the ids a sample stops at: the config's strings; on chat
    data the val split's first CHAT_SAMPLES questions as chat prompts (a plain string asks a chat model nothing),
    each answer ending at <|end|>."""
    tc = cfg.train
    if meta.format != "chat" or not tc.sample_prompts:
        return list(tc.sample_prompts), []
    spans = read_spans(meta, "val")
    if not len(spans):
        return list(tc.sample_prompts), []
    reach = int(spans[min(len(spans), 64) - 1][0])  # the first 64 answers: enough to find CHAT_SAMPLES conversations
    template = ChatTemplate(tokenizer)
    prompts = first_prompts(head_ids(splits["val"], reach), spans, template.eot_id, CHAT_SAMPLES,
                            cfg.model.block_size // 2)
    return [p.tolist() for p in prompts], [template.end_id, template.eot_id]


@dataclass
class RunData:
    """The data a run trains and validates on, and the prompts it samples at each validation."""

    splits: dict[str, Any]  # "train"/"val" -> SplitData (preloaded) or MemmapSplit (on disk)
    loss_masks: dict[str, LossMask]  # chat data: split -> the targets that carry the loss; {} = all of them
    tokenizer: Tokenizer
    sample_prompts: list  # strings, or token ids (chat data)
    sample_stop_ids: list[int]  # a sample ends at these (chat: <|end|>, <|endoftext|>)


@dataclass
class TrainingRun:
    """A training call as set up: its frozen config, the data, the model and what trains it, the progress, the
    lease; the loop (gptlib.training.loop) runs it."""

    cfg: RunConfig
    run_dir: Path
    mirror_dir: Path | None
    ddp: distributed.Dist
    device: torch.device
    dtype: torch.dtype
    data: RunData
    model: GPT  # the original module: state dicts, samples, validation
    train_model: Any  # compiled and/or DDP-wrapped: what the loop runs
    compiled: bool
    optimizer: Any
    scaler: Any
    sampler: Any
    state: TrainState
    resume: Resume | None
    lease: RunLease | NoLease  # this process's right to write the run dir and its mirror
    passed: Passed = field(default_factory=Passed)  # checkpoints passed over at resume (damaged, unreadable)
    hellaswag: HellaSwagProbe | None = None  # TrainConfig.hellaswag_every: scored at validations (rank 0)
    hellaswag_last: int = 0  # the step it last scored
    history: list[dict] = field(default_factory=list)  # metrics.jsonl rows up to the resumed step

    @property
    def autocast(self):
        return autocast_for(self.device, self.dtype)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.tokens_per_step * self.ddp.world_size

    @property
    def no_sync(self):
        """DDP: no_sync(last_micro_step) -> a context that skips the gradient all-reduce; None alone."""
        return (lambda last: self.ddp.no_sync(self.train_model, last)) if self.ddp.enabled else None

    @property
    def resumed_from(self) -> int | None:
        return self.resume.state.step if self.resume is not None else None

    def parts(self) -> dict[str, Any]:
        """The stateful parts a checkpoint holds (gptlib.checkpoint.format), each with state_dict/load_state_dict."""
        return {"model": self.model, "optimizer": self.optimizer, "scaler": self.scaler, "sampler": self.sampler,
                "rng": RNG(self.device), "progress": self.state}

    def state_dict(self, gather: bool = True) -> dict:
        """The checkpoint of now: each part's state_dict; under DDP every rank's sampler too (a collective:
        gather=False where the ranks may be anywhere)."""
        ckpt = {name: part.state_dict() for name, part in self.parts().items()}
        if gather and self.ddp.enabled:
            ckpt["sampler_ranks"] = self.ddp.sampler_states(ckpt["sampler"])
        return ckpt

    def snapshot(self, val_loss: float | None, elapsed_s: float, gather: bool = True) -> dict:
        self.state.val_loss, self.state.elapsed_s = val_loss, elapsed_s
        return self.state_dict(gather)

    def open_writer(self, log) -> CheckpointWriter | NullCheckpointWriter:
        """Rank 0's background writer (leftovers of a save killed mid-way removed first), or a null one."""
        if not self.ddp.is_main:
            return NullCheckpointWriter()
        set_aside_damaged(self.passed, self.resume, log)  # before a new checkpoint may take a damaged one's name
        clean_orphans(self.run_dir)  # the mirror is cleaned by its own thread
        tc = self.cfg.train
        writer = CheckpointWriter(self.run_dir, keep_last=tc.keep_last, keep_every=tc.keep_every, log=log,
                                  mirror_dir=self.mirror_dir, guard=self.lease.check,
                                  unreadable=set(self.passed.unreadable), mirror_listed=self.passed.mirror_step)
        if self.resume is not None and self.mirror_dir is not None and not self._resumed_from_mirror():
            writer.mirror_existing(self.resume.info.path, self.state.best_step)  # resumed locally: Drive gets it too
        # (resumed from Drive: the checkpoint was copied here, verified, and is already on Drive)
        return writer

    def _resumed_from_mirror(self) -> bool:
        return self.mirror_dir is not None and self.resume.origin.is_relative_to(self.mirror_dir)

    def load_state_dict(self, ckpt: dict, log) -> None:
        """Load a checkpoint dict into the run's parts (a run made by import-hf holds weights only: its training starts
        fresh) and continue its progress. The parts are taken out of the dict: held, they would be a second copy of
        the state in host RAM all run."""
        r, parts = self.resume, self.parts()
        load_weights_into(self.model, ckpt.pop("model"), r.info.path)
        if ckpt["optimizer"]:
            load_optimizer(parts["optimizer"], ckpt["optimizer"])  # its device flags are this device's
            if ckpt["scaler"]:  # {} when it was off
                parts["scaler"].load_state_dict(ckpt["scaler"])
            self.ddp.load_sampler_state(self.sampler, ckpt["sampler"], ckpt["sampler_ranks"], self.cfg.train.seed, log)
            parts["rng"].load_state_dict(ckpt["rng"])
        for name in ("optimizer", "scaler", "sampler", "rng", "sampler_ranks"):
            del ckpt[name]
        this_session = ("config", "data", "data_dir", "tokenizer", "milestone")
        self.state.load_state_dict({k: v for k, v in ckpt["progress"].items() if k not in this_session})
        if r.data_change:
            self.state.data_changes = [*self.state.data_changes, r.data_change]
        where = "Drive mirror" if self._resumed_from_mirror() else "local disk"
        log(f"resumed from step {self.state.step:,} (saved {r.info.saved_at}, {self.state.tokens_seen:,} tokens seen) "
            f"on the {where}: {r.origin}")


@dataclass
class Base:
    """The weights a new run starts from (--init-from RUN_DIR[:latest|best|STEP])."""

    spec: str
    model_sd: dict[str, torch.Tensor]
    config: RunConfig  # the base's: its shape and recipe carry over
    step: int
    path: Path
    vocab_size: int  # the base's vocabulary: the data's may add tokens after it (chat markers)


def load_base(spec: str, meta: DatasetMeta, log) -> Base:
    """Load a base checkpoint and check that the data's tokenizer is the base's, or the base's with tokens
    appended (tokenize --tokenizer-from BASE_RUN --format chat adds the chat markers)."""
    run_dir, which = spec, "latest"
    if not Path(spec).is_dir() and ":" in spec:
        run_dir, which = spec.rsplit(":", 1)
    ld = load_run(run_dir, which, log=log)
    base, data = ld.tokenizer.identity(), meta.tokenizer
    grows = (meta.raw.get("tokenizer_base") or {}).get("hash") == base["hash"] and meta.vocab_size > base["vocab_size"]
    if data.get("hash") != base["hash"] and not grows:
        raise ConfigError(f"--init-from {spec}: its vocabulary ({base['kind']}, {base['vocab_size']:,} tokens, tokenizer "
                          f"{base['hash'][:12]}) is not the data's ({meta.data_dir}: {data.get('kind')}, "
                          f"{meta.vocab_size:,} tokens, tokenizer {str(data.get('hash'))[:12]}); tokenize the data with "
                          f"--tokenizer-from {run_dir}")
    log(f"init-from: the weights of {ld.path} (step {ld.step:,}); {ld.config.model.n_layer} layers x "
        f"{ld.config.model.n_embd}, context {ld.config.model.block_size}"
        + (f"; vocabulary {base['vocab_size']:,} -> {meta.vocab_size:,} (rows added for the new tokens)" if grows else ""))
    return Base(spec, ld.model.state_dict(), ld.config, ld.step, ld.path, base["vocab_size"])


def start_from_base(model: GPT, base: Base) -> None:
    """Copy the base's weights into a new model of the same shape; the embedding rows of tokens the base does
    not have (appended after its vocabulary) start at the mean of its rows, every other weight unchanged."""
    sd = dict(base.model_sd)
    key = "transformer.wte.weight"
    old, new = sd[key], model.state_dict()[key]
    if old.shape != new.shape:
        grown = torch.zeros_like(new)
        grown[: base.vocab_size] = old[: base.vocab_size]
        grown[base.vocab_size: model.config.vocab_size] = old[: base.vocab_size].mean(dim=0)
        sd[key] = grown
        if model.config.tie_embeddings:
            sd["lm_head.weight"] = grown
        else:  # the output rows of the new tokens start at the mean of the base's output rows
            head = torch.zeros_like(new)
            head[: base.vocab_size] = sd["lm_head.weight"][: base.vocab_size]
            head[base.vocab_size: model.config.vocab_size] = head[: base.vocab_size].mean(dim=0)
            sd["lm_head.weight"] = head
    load_weights_into(model, sd, base.path)


def check_optimizer_fits(ck: dict, where: Path) -> None:
    """CheckpointError if the checkpoint's optimizer state does not fit the model and optimizer of its own config
    (built on the meta device: shapes only): resume then passes it over as damaged, before anything is set up."""
    if not ck["optimizer"]:  # a run made by import-hf: weights only
        return
    cfg = TrainState(**ck["progress"]).run_config(str(where / STATE_FILE))
    with torch.device("meta"):
        model = GPT(cfg.model)
    check_optimizer_state(build_optimizer(model, cfg.train, "meta"), ck["optimizer"], str(where))


def _read_data(data_dir) -> tuple[DatasetMeta, Tokenizer]:
    """The dataset's meta.json and tokenizer, checked against each other before any shard is read: a vocabulary
    smaller than the tokenizer's is named as such."""
    meta = read_meta(data_dir)
    tokenizer = load_tokenizer(meta.data_dir / meta.tokenizer.get("file", TOKENIZER_FILE))
    check_identity(tokenizer, meta.tokenizer, str(meta.data_dir))
    if tokenizer.vocab_size > meta.vocab_size:  # the model's embedding would be too small for its ids
        raise DataFormatError(f"{meta.data_dir / META_FILE}: vocab_size is {meta.vocab_size:,} but the tokenizer has "
                              f"{tokenizer.vocab_size:,} tokens; tokenize again (--overwrite)")
    return meta, tokenizer


def open_run(data_dir: str | Path, run_dir: str | Path, cfg: RunConfig, ddp: distributed.Dist,
                 mirror_dir: str | Path | None, verbose: bool, log: Callable[[str], None],
                 take_over: bool = False, init_from: str | None = None, *, skip_unreadable: bool = False,
                 allow_data_change: bool = False, ask=None) -> TrainingRun:
    """Set up a training call (see the module docstring). The lease comes first: nothing in run_dir or
    the mirror changes before this process holds it, and the data and resume point fit the config. A call
    refused during set-up leaves no directory it created behind."""
    run_dir = Path(run_dir)
    mirror_dir = Path(mirror_dir) if mirror_dir is not None else None
    device = ddp.device(resolve_device(cfg.train.device))
    resolve_dtype(cfg.train.dtype, device)  # bf16 asked for on a GPU without it: refused before anything is touched
    created = _check_dirs(run_dir, mirror_dir) if ddp.is_main else []
    try:
        try:
            lease = RunLease([run_dir, mirror_dir], take_over, log).acquire() if ddp.is_main else NoLease()
        except HungIOError as e:  # Drive did not answer: its lease may be another process's
            raise HungIOError(e.errno, f"{e.strerror}: training did not start and nothing was changed; {DRIVE_ADVICE}") from None
        try:
            return _open(data_dir, run_dir, cfg, ddp, mirror_dir, device, lease, verbose, log, init_from,
                         skip_unreadable, allow_data_change, ask)
        except BaseException:
            lease.release()
            raise
    except BaseException:
        for d in created:  # only if still empty (the lease file is gone by now)
            for empty in (checkpoints_dir(d), d):
                try:
                    empty.rmdir()
                except OSError:
                    pass
        raise


def _check_dirs(run_dir: Path, mirror_dir: Path | None) -> list[Path]:
    """The run dir, the mirror and their checkpoints/ folders must be directories or creatable: a file or a symlink
    loop there is one line now, not a traceback at the first save (the mirror looked at with a time limit: Drive).
    -> those that do not exist yet."""
    new = []
    for d, what in ((run_dir, "run directory"), (mirror_dir, "mirror directory")):
        if d is None:
            continue
        def look(d=d, what=what) -> bool:
            if not check_dir(d, what):
                return False
            check_dir(checkpoints_dir(d), f"{what}'s checkpoints folder")
            return True

        try:
            if not call_with_timeout(look, IO_TIMEOUT_S, what=f"looking at {d}"):
                new.append(d)
        except HungIOError as e:
            raise HungIOError(e.errno, f"{e.strerror}: training did not start and nothing was changed; {DRIVE_ADVICE}") from None
    return new


def _open(data_dir, run_dir: Path, asked: RunConfig, ddp: distributed.Dist, mirror_dir: Path | None,
          device: torch.device, lease, verbose: bool, log, init_from: str | None, skip_unreadable: bool,
          allow_data_change: bool, ask) -> TrainingRun:
    # the data's description; the resume point, else a base to start from (--init-from)
    meta, tokenizer = _read_data(data_dir)
    resume, passed = find_resume(run_dir, mirror_dir, log, skip_unreadable, check=check_optimizer_fits)
    base = load_base(init_from, meta, log) if init_from and resume is None else None
    if init_from and resume is not None:
        log(f"init-from: {run_dir} already has checkpoints; resuming it ({init_from} only starts a new run)")
    # the config, decided once (frozen from here on); then the tokens, placed for it
    cfg, probe_peak = resolve_config(asked, meta, resume, base.config if base else None, bool(init_from), device,
                                     ddp, run_dir, log, ask)
    if resume is not None:  # the same model; now the same data (or a change asked for, recorded)
        resume.data_change = check_same_data(resume, meta, allow_data_change, log)
    meta, splits = load_dataset(data_dir, device=device, log=log,
                                reserve_gpu_bytes=train_reserve_bytes(cfg.model, cfg.train.batch_size, probe_peak))
    # the model and what trains it; the checkpoint's state restored before compile/DDP wrap the model
    model, optimizer, scaler, dtype = build_model(cfg, device, log)
    if base is not None:
        start_from_base(model, base)
    tc, mc = cfg.train, cfg.model
    masks = loss_masks(meta, splits, tc.chat_loss)
    if masks and verbose:
        log(f"loss: on the assistants' answers only ({masks['train'].fraction:.1%} of the train tokens; "
            f"--set chat_loss=all puts it on every token)")
    sampler = BatchSampler(splits["train"], tc.batch_size, mc.block_size, tc.seed + ddp.rank, device, masks.get("train"))
    state = TrainState(config=cfg.to_dict(), data=meta.identity(), data_dir=str(meta.data_dir),
                       tokenizer=meta.tokenizer,
                       init_from={"run": base.spec, "path": str(base.path), "step": base.step} if base else {})
    data = RunData(splits, masks, tokenizer, *sample_prompts(cfg, meta, splits, tokenizer))
    s = TrainingRun(cfg=cfg, run_dir=run_dir, mirror_dir=mirror_dir, ddp=ddp, device=device, dtype=dtype, data=data,
                    model=model, train_model=model, compiled=False, optimizer=optimizer, scaler=scaler, sampler=sampler,
                    state=state, resume=resume, lease=lease, passed=passed)
    if resume is not None:
        s.load_state_dict(resume.checkpoint, log)
    model.train()  # the loop trains; validation and samples switch to eval and back themselves
    s.train_model, s.compiled = wrap_for_training(model, cfg, device, ddp)
    if tc.hellaswag_every and ddp.is_main:  # the file fetched (or found off) and the subset tokenized, once
        s.hellaswag = HellaSwagProbe(tokenizer, mc.block_size, source=tc.hellaswag_file or None,
                                     limit=tc.hellaswag_items or None, log=log)
        s.hellaswag_last = s.state.step
    # the run directory: the config the checkpoints record (after auto_batch), and the run's own tokenizer
    # copy, so sampling and export never depend on the data directory staying put
    if ddp.is_main:
        try:
            atomic_write_json(run_dir / CONFIG_FILE, cfg.to_dict())
            atomic_write_bytes(run_dir / TOKENIZER_FILE, tokenizer.to_json_bytes())
        except OSError as e:  # a disk that filled up (or turned read-only) since the lease: one line, not a traceback
            raise cannot_write(run_dir, e) from None
        if resume is not None:
            restore_logs_from_checkpoint(run_dir, resume.checkpoint.pop("logs"), s.state.step)
        s.history = truncate_logs(run_dir, s.state.step)  # rows logged after the checkpoint go: this run logs them
    log(f"model: {model_size(mc).params / 1e6:.2f}M parameters ({mc.n_layer} layers, {mc.n_embd} wide, context "
        f"{mc.block_size}, vocab {mc.vocab_size}); device {device}, {dtype_name(dtype)}, "
        f"compile {'on' if s.compiled else 'off'}; {s.tokens_per_step:,} tokens/step")
    return s
