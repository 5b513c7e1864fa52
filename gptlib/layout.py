"""The run directory's layout: every file name in one place.

A run directory (the same on the local disk and on the Drive mirror):

    config.json         the run's full config (RunConfig), as the checkpoints record it
    tokenizer.json      the tokenizer the run trains with (sampling and export use this copy)
    metrics.jsonl       one row per step: train loss, lr, tokens seen; validation rows add val loss, tokens/s, MFU, ETA
    samples.jsonl       the fixed prompts sampled at every validation
    samples.md          the same as a table, "sample vs step"
    loss.png            the loss curve
    lease.json          while a training process writes here: its host, pid, session and heartbeat
    checkpoints/step_0001000/
        model.pt        state_dict of the original (uncompiled, unwrapped) module
        train_state.pt  optimizer, grad scaler, torch RNGs, sampler state (tensors and numbers only)
        state.json      the TrainState: step, tokens seen, best val loss, config, data identity, python/numpy RNG
        metrics.jsonl   the run's logs up to this step (LOG_FILES), so a fresh VM resumes the loss curve too
        samples.jsonl
        manifest.json   written last: format version, step, size and sha256 of each file above

Everything the Drive mirror copies, and everything a checkpoint carries, derives from the tuples below. The logs
reach Drive one way: inside each checkpoint (LOG_FILES), which is what a fresh VM's resume restores them from.
"""

from __future__ import annotations

import re
from pathlib import Path

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"  # also the tokenizer's name inside a data directory
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
SAMPLES_TABLE = "samples.md"
LOSS_PLOT = "loss.png"
EVAL_FILE = "eval.jsonl"  # rows appended by `python -m gptlib eval` (and the end-of-run HellaSwag); not mirrored
LEASE_FILE = "lease.json"  # who trains this run now (gptlib.lease): one writer per run, local and on Drive
CHECKPOINTS_DIR = "checkpoints"

# Inside a checkpoint directory.
MODEL_FILE = "model.pt"
TRAIN_STATE_FILE = "train_state.pt"
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
CHECKPOINT_FILES = (MODEL_FILE, TRAIN_STATE_FILE, STATE_FILE)  # what every checkpoint must hold

# The logs each checkpoint carries a copy of (a resumed run continues them from the checkpoint's step).
LOG_FILES = (METRICS_FILE, SAMPLES_FILE)
# The run-level files copied beside the checkpoints on the Drive mirror: what readers of the mirror use (sampling,
# export and notebook 04 on a fresh VM read the tokenizer; the config names the run) and what people open on Drive
# (the loss plot, the samples table).
MIRRORED_FILES = (CONFIG_FILE, TOKENIZER_FILE, SAMPLES_TABLE, LOSS_PLOT)

# Checkpoint directory names: step_0001000 when complete; the markers name work in progress.
PARTIAL_MARKER = ".partial-"  # a checkpoint being written (or copied to the mirror)
OLD_MARKER = ".old-"  # a same-step checkpoint being replaced
DELETING_MARKER = ".deleting-"  # a rotated-out checkpoint being deleted
DAMAGED_MARKER = ".damaged-"  # found damaged at resume, set aside for its owner to look at (never deleted)
_STEP_RE = re.compile(r"step_(\d{7,})")


def checkpoint_name(step: int) -> str:
    return f"step_{step:07d}"


def is_checkpoint_name(name: str) -> bool:
    """A finished checkpoint's name (not .partial and friends)."""
    return _STEP_RE.fullmatch(name) is not None


def step_of(path: Path) -> int | None:
    """The step in a checkpoint directory's name, also for `step_0000020.partial-...` and friends."""
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR
