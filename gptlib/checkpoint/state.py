"""The training state a checkpoint holds, typed: `TrainState` (state.json) and `TrainTensors` (train_state.pt).

One definition, used by training (save, resume), loading and export (which checkpoint, which config and
tokenizer), and DDP (every rank's sampler). Like torchtitan's train state, the counters live in one
object with `state_dict` / `load_state_dict`; `from_json` checks what a file holds and names the field
that is missing or wrong, so a damaged or hand-edited state.json is one clear error, not a KeyError.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from gptlib.config import RunConfig
from gptlib.errors import CheckpointError


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed (the LR schedule's position)
    tokens_seen: int = 0  # training tokens consumed, over all sessions
    elapsed_s: float = 0.0  # training wall time, over all sessions
    val_loss: float | None = None  # validation loss measured at `step`; None if this save did not validate
    best_val_loss: float | None = None  # lowest validation loss so far
    best_step: int | None = None  # the step that reached it (rotation keeps that checkpoint)
    pending_losses: list[float] = field(default_factory=list)  # losses of steps not yet logged: a resumed run logs them
    milestone: bool = False  # saved as a milestone (TrainConfig.keep_every): kept for good
    config: dict[str, Any] = field(default_factory=dict)  # the run's RunConfig.to_dict()
    data: dict[str, Any] = field(default_factory=dict)  # DatasetMeta.identity(): resuming on other data is refused
    data_dir: str = ""  # where the data was (the tokenizer's fallback location)
    tokenizer: dict[str, Any] = field(default_factory=dict)  # tokenizer identity {kind, hash, vocab_size, file}
    rng: dict[str, Any] = field(default_factory=dict)  # Python and numpy RNG states (torch's are in TrainTensors)
    init_from: dict[str, Any] = field(default_factory=dict)  # the weights the run started from (--init-from, import-hf)
    data_changes: list[dict[str, Any]] = field(default_factory=list)  # resumes on other data (--allow-data-change)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, d: dict[str, Any]) -> None:
        for f in dataclasses.fields(self):
            if f.name in d:
                setattr(self, f.name, d[f.name])

    @classmethod
    def from_json(cls, d: Any, source: str, step: int | None = None) -> "TrainState":
        """A state.json's contents, checked: the fields resuming and loading rely on must be there, with
        the right types, and its step must be the checkpoint's (`step`: its manifest's and directory name's),
        so a hand-edited or mixed-up state.json is a damaged checkpoint, never a negative or huge step.
        Unknown fields are ignored (a newer gptlib may add some)."""
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
        for name in ("data", "tokenizer", "rng"):
            if name in d and not isinstance(d[name], dict):
                raise CheckpointError(f"{source}: field {name!r} is {d[name]!r}, expected an object")
        state = cls()
        state.load_state_dict(d)
        return state

    def run_config(self, source: str) -> RunConfig:
        return RunConfig.from_dict(self.config, source=source)


@dataclass
class TrainTensors:
    optimizer: dict[str, Any]  # optimizer.state_dict()
    scaler: dict[str, Any]  # GradScaler.state_dict(), {} when the scaler is off (bf16, fp32)
    sampler: dict[str, Any]  # this process's (rank 0's) batch sampler position
    rng: dict[str, Any]  # {"torch_cpu": ByteTensor, "torch_cuda": the training GPU's ByteTensor (older: a list, one per GPU)}
    sampler_ranks: list[dict[str, Any]] | None = None  # under DDP: every rank's sampler position

    def to_dict(self) -> dict[str, Any]:
        d = {"optimizer": self.optimizer, "scaler": self.scaler, "sampler": self.sampler, "rng": self.rng}
        if self.sampler_ranks is not None:
            d["sampler_ranks"] = self.sampler_ranks
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str) -> "TrainTensors":
        missing = [k for k in ("optimizer", "sampler", "rng") if k not in d]
        if missing:
            raise CheckpointError(f"{source}: {missing} missing (not a gptlib training checkpoint, or damaged)")
        return cls(optimizer=d["optimizer"], scaler=d.get("scaler") or {}, sampler=d["sampler"], rng=d["rng"],
                   sampler_ranks=d.get("sampler_ranks"))
