"""A training run: its parts and their round trip through a checkpoint.

The parts are the model, the optimizer, the fp16 loss scaler, the batch sampler, the random generators (dropout)
and the progress (step, tokens seen, best loss: TrainState). Each has state_dict() and load_state_dict().
TrainingRun.state_dict() is the checkpoint of now, each part's state dict under its name; load_state_dict() puts a
loaded checkpoint back into the same parts. Saved and loaded so, a resumed run takes the very batches, dropout masks
and updates the uninterrupted run would have (tests/test_resume.py checks it bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gptlib.batches import BatchSampler, LossMask
from gptlib.checkpoint.format import RNG, TrainState, load_weights_into
from gptlib.checkpoint.writer import CheckpointWriter
from gptlib.config import RunConfig
from gptlib.data.tokenizer import Tokenizer
from gptlib.evaluation.hellaswag import HellaSwagProbe
from gptlib.lease import RunLease
from gptlib.model import GPT
from gptlib.runtime import autocast_for
from gptlib.training import distributed

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
    ddp: distributed.Dist
    device: torch.device
    # the autocast type (float32: none), resolved once: the loop reads it every step
    dtype: torch.dtype
    data: RunData
    model: GPT  # the module itself: state dicts, samples, validation
    train_model: Any  # compiled and/or DDP-wrapped: what the loop runs
    optimizer: Any  # training/optimizer.py: AdamW, or MuonAdamW (the modern recipe)
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
            ckpt["sampler_ranks"] = self.ddp.sampler_states(ckpt["sampler"])
        return ckpt

    def load_state_dict(self, ckpt: dict, log) -> None:
        """A loaded checkpoint (load_checkpoint's dict) back into the parts. A run made by import-hf holds weights
        only, its optimizer state {}: the rest of its parts start fresh."""
        load_weights_into(
            self.model, ckpt["model"], ckpt["info"].path
        )  # a shape that differs is named
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
