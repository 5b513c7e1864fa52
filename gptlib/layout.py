"""Every file name of a run directory, the same locally and on the Drive mirror (docs/drive.md draws the tree)."""

from __future__ import annotations

import re
from pathlib import Path

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"  # also the tokenizer's name inside a data directory
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
SAMPLES_TABLE = "samples.md"
LOSS_PLOT = "loss.png"
EVAL_FILE = "eval.jsonl"  # rows appended by `python -m gptlib eval` (and the end-of-run HellaSwag)
# A data directory's (gptlib/data/shards.py): a run directory never holds them (gptlib.lease refuses one that does)
META_FILE = "meta.json"
# present only while a tokenize run is unfinished (encode.py)
PREPARE_STATE_FILE = "prepare_state.json"
# tokenize --overwrite makes the new dataset in this folder of the old one's, which stays whole until then
OVERWRITE_DIR = ".overwrite"
# who trains this run now (gptlib.lease): one writer per run, local and on Drive
LEASE_FILE = "lease.json"
CHECKPOINTS_DIR = "checkpoints"

# Inside a checkpoint directory.
MODEL_FILE = "model.pt"
TRAIN_STATE_FILE = "train_state.pt"
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
# in a damaged checkpoint set aside: when it was (pruning keeps the newest)
SET_ASIDE_FILE = "set_aside.json"
CHECKPOINT_FILES = (MODEL_FILE, TRAIN_STATE_FILE, STATE_FILE)  # what every checkpoint must hold

# in each checkpoint: a resumed run continues them from its step
LOG_FILES = (METRICS_FILE, SAMPLES_FILE)
# Copied beside the checkpoints on the Drive mirror, for its readers (sampling, export, notebook 04 on a fresh VM).
MIRRORED_FILES = (CONFIG_FILE, TOKENIZER_FILE, SAMPLES_TABLE, LOSS_PLOT, EVAL_FILE)

# Checkpoint directory names: step_0001000 when complete; the markers name work in progress.
PARTIAL_MARKER = ".partial-"  # a checkpoint being written (or copied to the mirror)
OLD_MARKER = ".old-"  # a same-step checkpoint being replaced
DELETING_MARKER = ".deleting-"  # a rotated-out checkpoint being deleted
# found damaged at resume, set aside for its owner to look at (the newest is kept)
DAMAGED_MARKER = ".damaged-"
_STEP_RE = re.compile(r"step_(\d{7,})")


def checkpoint_name(step: int) -> str:
    return f"step_{step:07d}"


def is_checkpoint_name(name: str) -> bool:  # a finished checkpoint's (not .partial and friends)
    return _STEP_RE.fullmatch(name) is not None


def step_of(path: Path) -> int | None:
    """The step in a checkpoint directory's name, also for `step_0000020.partial-...` and friends."""
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR
