"""What a checkpoint holds, defined once: the `state_dict()`s of a training run's parts (`Checkpoint`): the
model, optimizer, grad scaler, batch sampler, every RNG (`RNG`) and the run's progress (`TrainState`).
`Checkpoint.files` / `from_files` alone know how the parts lie in the files of every gptlib checkpoint so far:

    model.pt         the model's state_dict
    train_state.pt   {"optimizer", "scaler", "sampler", "rng": torch's generators, "sampler_ranks" under DDP}
    state.json       TrainState's fields and "rng": Python's and numpy's generators

`from_json` / `from_files` name the field that is missing or wrong: a damaged file is one clear error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from gptlib.config import RunConfig
from gptlib.errors import CheckpointError
from gptlib.layout import STATE_FILE, TRAIN_STATE_FILE
from gptlib.runtime import capture_rng, restore_cuda_rng, restore_rng


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed (the LR schedule's position)
    tokens_seen: int = 0  # training tokens consumed, over all sessions
    elapsed_s: float = 0.0  # training wall time, over all sessions
    val_loss: float | None = None  # validation loss measured at `step`; None if this save did not validate
    best_val_loss: float | None = None  # lowest validation loss so far
    best_step: int | None = None  # the step that reached it (rotation keeps that checkpoint)
    milestone: bool = False  # saved as a milestone (TrainConfig.keep_every): kept for good
    config: dict[str, Any] = field(default_factory=dict)  # the run's RunConfig.to_dict()
    data: dict[str, Any] = field(default_factory=dict)  # DatasetMeta.identity(): resuming on other data is refused
    data_dir: str = ""  # where the data was (the tokenizer's fallback location)
    tokenizer: dict[str, Any] = field(default_factory=dict)  # tokenizer identity {kind, hash, vocab_size, file}
    init_from: dict[str, Any] = field(default_factory=dict)  # the weights the run started from (--init-from, import-hf)
    data_changes: list[dict[str, Any]] = field(default_factory=list)  # resumes on other data (--allow-data-change)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, d: dict[str, Any]) -> None:
        # Fields it does not have are ignored. A checkpoint of gptlib before issue 27 may hold "pending_losses", the
        # losses of steps it had not logged yet: they are not logged again (a checkpoint falls on a log boundary
        # now); the rows the saving run wrote for those steps before it stopped are kept.
        for f in dataclasses.fields(self):
            if f.name in d:
                setattr(self, f.name, d[f.name])

    @classmethod
    def from_json(cls, d: Any, source: str, step: int | None = None) -> "TrainState":
        """A state.json's contents, checked: the fields resuming relies on, with the right types, and its step the
        checkpoint's (`step`), so a hand-edited or mixed-up one is a damaged checkpoint. Unknown fields are ignored."""
        if not isinstance(d, dict):
            raise CheckpointError(f"{source}: holds a JSON {type(d).__name__}, not an object")
        for name, types in (("step", int), ("tokens_seen", int), ("config", dict)):
            if name not in d:
                raise CheckpointError(f"{source}: field {name!r} is missing (not a gptlib training checkpoint, or "
                                      f"damaged); resume from another checkpoint or start a new run directory")
            if not isinstance(d[name], types) or isinstance(d[name], bool):
                raise CheckpointError(f"{source}: field {name!r} is {d[name]!r}, expected {types.__name__}")
        if d["step"] < 0 or d["tokens_seen"] < 0:
            raise CheckpointError(f"{source}: step {d['step']} / tokens_seen {d['tokens_seen']} cannot be negative "
                                  f"(damaged or hand-edited); resume from another checkpoint")
        if step is not None and d["step"] != step:
            raise CheckpointError(f"{source}: step {d['step']:,} but its checkpoint is step {step:,} (manifest and "
                                  f"directory name); damaged or mixed up, so it is passed over")
        for name in ("data", "tokenizer"):
            if name in d and not isinstance(d[name], dict):
                raise CheckpointError(f"{source}: field {name!r} is {d[name]!r}, expected an object")
        state = cls()
        state.load_state_dict(d)
        return state

    def run_config(self, source: str) -> RunConfig:
        return RunConfig.from_dict(self.config, source=source)

    def continue_from(self, saved: "TrainState") -> None:
        """A resume: the run's progress is its checkpoint's, but for the fields describing this session."""
        for f in dataclasses.fields(self):
            if f.name not in _THIS_SESSION:
                setattr(self, f.name, getattr(saved, f.name))


_THIS_SESSION = ("val_loss", "milestone", "config", "data", "data_dir", "tokenizer")


class RNG:
    """Every random generator training draws from, as one stateful part: torch's CPU one, the training GPU's
    (only that device's: a checkpoint made on N GPUs resumes on fewer), Python's and numpy's."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        tensors, plain = capture_rng(self.device)
        return {**tensors, **plain}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        restore_rng(d, d)
        restore_cuda_rng(d, self.device)


@dataclass
class Checkpoint:
    """One checkpoint: each training part's state_dict() by name (see the module docstring)."""

    model: dict[str, Any]
    progress: TrainState
    optimizer: dict[str, Any] = field(default_factory=dict)  # {} in a run made by import-hf: weights only
    scaler: dict[str, Any] = field(default_factory=dict)  # {} when the scaler is off (bf16, fp32)
    sampler: dict[str, Any] = field(default_factory=dict)  # this process's (rank 0's) batch position
    rng: dict[str, Any] = field(default_factory=dict)  # RNG.state_dict()
    sampler_ranks: list[dict[str, Any]] | None = None  # under DDP: every rank's batch position

    @property
    def step(self) -> int:
        return self.progress.step

    def files(self) -> tuple[dict, dict, dict]:
        """-> the contents of (model.pt, train_state.pt, state.json)."""
        torch_rng = {k: v for k, v in self.rng.items() if k.startswith("torch_")}
        train = {"optimizer": self.optimizer, "scaler": self.scaler, "sampler": self.sampler, "rng": torch_rng}
        if self.sampler_ranks is not None:
            train["sampler_ranks"] = self.sampler_ranks
        plain_rng = {k: v for k, v in self.rng.items() if not k.startswith("torch_")}
        return self.model, train, {**self.progress.state_dict(), "rng": plain_rng}

    @classmethod
    def from_files(cls, model: dict, train: dict, state: Any, where: str, step: int) -> "Checkpoint":
        """The parts back from the files' contents, checked (`where`: the checkpoint dir; `step`: its manifest's)."""
        missing = [k for k in ("optimizer", "sampler", "rng") if k not in train]
        if missing:
            raise CheckpointError(f"{where}/{TRAIN_STATE_FILE}: {missing} missing (not a gptlib training checkpoint, "
                                  f"or damaged)")
        progress = TrainState.from_json(state, f"{where}/{STATE_FILE}", step=step)
        plain_rng = state.get("rng", {})
        if not isinstance(plain_rng, dict):
            raise CheckpointError(f"{where}/{STATE_FILE}: field 'rng' is {plain_rng!r}, expected an object")
        return cls(model=model, progress=progress, optimizer=train["optimizer"], scaler=train.get("scaler") or {},
                   sampler=train["sampler"], rng={**train["rng"], **plain_rng}, sampler_ranks=train.get("sampler_ranks"))
