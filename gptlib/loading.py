"""Load a trained model for inference: a run directory's "latest", "best" or chosen checkpoint.

The tokenizer comes from the run (its `tokenizer.json`, copied there by training; else the data
directory recorded in the checkpoint) and must match the identity {kind, hash} the checkpoint
recorded, so a model is never paired with the wrong vocabulary.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import CheckpointError, CheckpointInfo, list_checkpoints, load_model_weights, verify_checkpoint
from .config import RunConfig
from .fsutil import sha256_file
from .model import GPT
from .tokenizer import TOKENIZER_FILE, Tokenizer, TokenizerError, check_identity, load_tokenizer


@dataclass
class LoadedModel:
    model: GPT  # in eval mode, on the requested device
    tokenizer: Tokenizer  # verified against the checkpoint's recorded identity
    config: RunConfig  # the run's config as saved in the checkpoint
    step: int  # training step of the checkpoint
    path: Path  # the checkpoint directory
    state: dict  # the checkpoint's state.json (val_loss, best_step, tokens_seen, ...)


def checkpoint_table(run_dir: str | Path) -> list[dict]:
    """The run's complete checkpoints, newest first: {step, val_loss, tokens_seen, path, is_best}.

    A cheap check (manifest and file sizes, no hashing), for menus; incomplete ones are left out.
    """
    rows = []
    for p in list_checkpoints(run_dir):
        try:
            info = verify_checkpoint(p, deep=False)
            state = json.loads((p / "state.json").read_text())
        except (CheckpointError, OSError, json.JSONDecodeError):
            continue
        rows.append({"step": info.step, "val_loss": state.get("val_loss"), "tokens_seen": state.get("tokens_seen"),
                     "best_step": state.get("best_step"), "path": p})
    best = rows[0]["best_step"] if rows else None
    for r in rows:
        r["is_best"] = r["step"] == best
    return rows


def checkpoint_label(row: dict) -> str:
    """A checkpoint_table row for menus and table headers: "step 1,000 · val 1.523 · best"."""
    label = f"step {row['step']:,}"
    if row.get("val_loss") is not None:
        label += f" · val {row['val_loss']:.3f}"
    if row.get("is_best"):
        label += " · best"
    return label


def resolve_checkpoint(run_dir: str | Path, which: str | int = "latest") -> CheckpointInfo:
    """"latest" (newest complete), "best" (lowest validation loss, as recorded) or a step number."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"no valid checkpoint in {run_dir}: the run directory does not exist")
    table = checkpoint_table(run_dir)
    if not table:
        raise CheckpointError(f"no valid checkpoint in {run_dir}/checkpoints (has training saved one yet?)")
    steps = [r["step"] for r in table]
    which_s = str(which).strip().lower()
    if which_s == "latest":
        row = table[0]
    elif which_s == "best":
        best = table[0]["best_step"]
        if best is None:
            raise CheckpointError(f"{run_dir}: no best checkpoint recorded yet (no validation has run); "
                                  f"use 'latest' or a step from {steps}")
        match = [r for r in table if r["step"] == best]
        if not match:
            raise CheckpointError(f"{run_dir}: the best checkpoint (step {best}) is not on disk; available steps: {steps}")
        row = match[0]
    else:
        m = re.fullmatch(r"(?:step_)?0*(\d+)", which_s)
        if not m:
            raise CheckpointError(f"checkpoint {which!r}: use 'latest', 'best' or a step number (one of {steps})")
        step = int(m.group(1))
        match = [r for r in table if r["step"] == step]
        if not match:
            raise CheckpointError(f"{run_dir}: no complete checkpoint for step {step}; available steps: {steps}")
        row = match[0]
    return verify_checkpoint(row["path"], deep=False)


def load_run_tokenizer(run_dir: str | Path, state: dict, where: str) -> Tokenizer:
    """The tokenizer a checkpoint was trained with: the run's copy, else the recorded data dir's."""
    expected = state.get("tokenizer") or {}
    candidates = [Path(run_dir) / TOKENIZER_FILE]
    if state.get("data_dir"):
        candidates.append(Path(state["data_dir"]) / TOKENIZER_FILE)
    found = [c for c in candidates if c.is_file()]
    if not found:
        raise TokenizerError(
            f"no tokenizer for {where}: looked for {' and '.join(map(str, candidates))}; copy the data "
            f"directory's {TOKENIZER_FILE} into the run directory"
        )
    tok = load_tokenizer(found[0])
    if not expected.get("hash"):
        raise TokenizerError(f"{where}: the checkpoint records no tokenizer identity, so {found[0]} cannot be "
                             f"checked against it")
    check_identity(tok, expected, f"{where} (tokenizer {found[0]})")
    return tok


def load_for_inference(run_dir: str | Path, which: str | int = "latest", device: str | torch.device = "cpu",
                       dtype: torch.dtype | None = None) -> LoadedModel:
    """Model (eval mode) + verified tokenizer for one checkpoint of a run directory."""
    info = resolve_checkpoint(run_dir, which)
    path = info.path
    rec = info.manifest.get("files", {}).get("model.pt", {})
    if rec.get("sha256") and sha256_file(path / "model.pt") != rec["sha256"]:
        raise CheckpointError(f"{path / 'model.pt'}: sha256 differs from the manifest (corrupted)")
    state = json.loads((path / "state.json").read_text())
    cfg = RunConfig.from_dict(state["config"], source=str(path / "state.json"))
    tok = load_run_tokenizer(run_dir, state, str(path))
    if tok.vocab_size != cfg.model.vocab_size:
        raise TokenizerError(f"{path}: the model has vocab_size={cfg.model.vocab_size} but the tokenizer has "
                             f"{tok.vocab_size} tokens")
    model = GPT(cfg.model)
    try:
        model.load_state_dict(load_model_weights(path))
    except RuntimeError as e:
        raise CheckpointError(f"{path / 'model.pt'}: weights do not fit the saved config ({str(e)[:300]})") from None
    if isinstance(device, str):  # "auto", or a clear error for a device this machine lacks
        from .train import resolve_device

        device = resolve_device(device)
    model.to(device=device, dtype=dtype).eval()
    return LoadedModel(model=model, tokenizer=tok, config=cfg, step=info.step, path=path, state=state)


def pick_run_dir(candidates) -> Path:
    """Of several copies of one run (local disk, Drive mirror), the one with the newest complete checkpoint.

    On Colab a fresh session's local disk is empty while Drive holds the checkpoints; after a long
    session the local copy may be newer than the mirror.
    """
    best, best_step = None, -1
    looked = []
    for c in candidates:
        if c is None:
            continue
        looked.append(str(c))
        table = checkpoint_table(c) if Path(c).is_dir() else []
        if table and table[0]["step"] > best_step:
            best, best_step = Path(c), table[0]["step"]
    if best is None:
        raise CheckpointError(f"no complete checkpoint in {' or '.join(looked) or 'no directory'}; train first "
                              f"(notebook 02 or 03) or point RUN_DIR at a run directory")
    return best
