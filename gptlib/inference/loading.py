"""A checkpoint and the tokenizer it records, for inference. Every read has a time limit: a read on a hung Drive
blocks in the kernel for good, and is abandoned with HungIOError (an OSError)."""

from __future__ import annotations

import contextlib
import json
import re
import time
from concurrent.futures import wait
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from gptlib.checkpoint.format import (
    DRIVE_LIST_TIMEOUT_S,
    DRIVE_READ_STALL_S,
    CheckpointInfo,
    TrainState,
    list_checkpoints,
    load_model_weights,
    load_weights_into,
    verify_checkpoint,
)
from gptlib.config import RunConfig
from gptlib.data.tokenizer import Tokenizer, check_identity, load_tokenizer
from gptlib.errors import CheckpointError, TokenizerError, in_notebook, loud
from gptlib.fsutil import call_with_timeout, check_dir, in_background, read_jsonl
from gptlib.layout import CONFIG_FILE, METRICS_FILE, MODEL_FILE, STATE_FILE, TOKENIZER_FILE, step_of
from gptlib.model import GPT
from gptlib.runtime import resolve_device, resolve_dtype


@dataclass
class LoadedModel:
    model: GPT  # in eval mode, on the requested device
    tokenizer: Tokenizer  # verified against the checkpoint's recorded identity
    config: RunConfig
    step: int
    path: Path  # the checkpoint directory
    state: TrainState  # its state.json (val_loss, best_step, tokens_seen, ...)


def checkpoint_table(run_dir: str | Path, skipped: list[str] | None = None) -> list[dict]:
    """The complete checkpoints (manifest and sizes, no hashing), newest first; the others go to `skipped`, each with
    why. Each checkpoint is read in a thread of its own, all within DRIVE_LIST_TIMEOUT_S: one a hung Drive holds is
    named, and left behind."""
    skipped, end = [] if skipped is None else skipped, time.monotonic() + DRIVE_LIST_TIMEOUT_S

    def row(p: Path) -> dict:
        info, state = verify_checkpoint(p), json.loads((p / STATE_FILE).read_text())
        train = state.get("config", {}).get("train", {})
        # auto_batch changes batch_size and eval_batches together, keeping the validation's sequences
        n = train.get("eval_batches", 0) * train.get("batch_size", 0)
        fields = {"step": info.step, "val_sequences": n, "info": info}
        return fields | {"val_loss": state.get("val_loss"), "best_step": state.get("best_step")}

    paths = call_with_timeout(
        lambda: list_checkpoints(run_dir), DRIVE_LIST_TIMEOUT_S, what=f"listing {run_dir}"
    )
    reads = {p: in_background(lambda p=p: row(p)) for p in paths}
    wait(reads.values(), max(0.0, end - time.monotonic()))
    rows = []
    for p, read in reads.items():
        if not read.done():
            skipped.append(f"{p.name}: no answer in {DRIVE_LIST_TIMEOUT_S:g} s (a hung Drive?)")
        elif isinstance(e := read.exception(), (CheckpointError, OSError, json.JSONDecodeError)):
            skipped.append(f"{p.name}: {e}")
        else:
            rows.append(read.result())
    for r in rows:
        r["is_best"] = r["step"] == rows[0]["best_step"]
    return rows


def checkpoint_label(row: dict) -> str:
    """A checkpoint_table row as "step 1000 · val 1.523 (training's validation: 640 sequences) · best": the loss
    training measured, on its own fixed batches, not on the windows `eval` scores (the two differ a little)."""
    sequences = f": {row['val_sequences']:,} sequences" if row.get("val_sequences") else ""
    # no thousands separator: the step as CHECKPOINTS takes it, where a comma separates steps
    label = f"step {row['step']}"
    if row.get("val_loss") is not None:
        label += f" · val {row['val_loss']:.3f} (training's validation{sequences})"
    return label + (" · best" if row.get("is_best") else "")


def resolve_checkpoint(
    run_dir: str | Path, which: str | int = "latest", log=loud
) -> CheckpointInfo:
    """ "latest", "best" or a step number; newer incomplete checkpoints passed over are named through `log`."""
    run_dir, skipped = Path(run_dir), []
    table = checkpoint_table(run_dir, skipped)
    if not table:  # the listing answered, so a stat will too; a file, a link loop or a broken link is said as such
        if skipped:  # checkpoints were listed, so the run directory is one
            why = f": {'; '.join(skipped)}"
        elif not check_dir(run_dir, "the run directory"):
            why = ": the run directory does not exist"
        # a folder export-hf made (or one from the Hub) holds weights, no checkpoints: import-hf makes it a run
        elif (run_dir / "model.safetensors").is_file():
            how = (
                f'import_hf("{run_dir}", "RUN_DIR")'
                if in_notebook()
                else f"python -m gptlib import-hf --model {run_dir} --out RUN_DIR"
            )
            why = (
                f": it holds a Hugging Face model (model.safetensors), not a gptlib run; make it a run with "
                f"{how}, then use RUN_DIR"
            )
        # a checkpoint's folder, or the checkpoints folder, copied from a file browser
        elif run := next(
            (d for d in (run_dir.parent, run_dir.parent.parent) if list_checkpoints(d)), None
        ):
            why = f": it is inside the run directory {run}; give that instead"
        else:
            why = "/checkpoints (has training saved one yet?)"
        raise CheckpointError(f"no valid checkpoint in {run_dir}{why}")
    if newer := [s for s in skipped if step_of(Path(s.split(":")[0])) > table[0]["step"]]:
        log(f"newer checkpoints in {run_dir} were passed over: {'; '.join(newer)}")
    steps = [r["step"] for r in table]
    which_s = str(which).strip().lower()
    if which_s == "latest":
        return table[0]["info"]
    if which_s == "best":
        step = table[0]["best_step"]
        if step is None:
            raise CheckpointError(
                f"{run_dir}: no best checkpoint recorded yet (no validation has run); "
                f"use 'latest' or a step from {steps}"
            )
    elif m := re.fullmatch(r"(?:step_)?0*(\d+)", which_s):
        step = int(m.group(1))
    else:
        raise CheckpointError(
            f"checkpoint {which!r}: use 'latest', 'best' or a step number (one of {steps})"
        )
    if step not in steps:
        raise CheckpointError(
            f"{run_dir}: no complete checkpoint for step {step}"
            f"{' (the best)' if which_s == 'best' else ''}; available steps: {steps}"
        )
    return table[steps.index(step)]["info"]


def select_steps(
    run_dir: str | Path, which: str | int | Sequence[str | int] = "latest"
) -> list[int]:
    """Steps of checkpoints, each once: "all" (oldest first), or latest/best/STEP, a list or "1000, best"."""
    joined = ",".join(map(str, [which] if isinstance(which, (str, int)) else which))
    specs = [s.strip() for s in joined.split(",") if s.strip()] or ["latest"]
    if [s.lower() for s in specs] == ["all"]:
        steps = sorted(r["step"] for r in checkpoint_table(run_dir))
        # none: resolve_checkpoint raises its message
        return steps or [resolve_checkpoint(run_dir).step]
    return list(dict.fromkeys(resolve_checkpoint(run_dir, s).step for s in specs))


def load_run(
    run_dir: str | Path,
    which: str | int = "latest",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    log=loud,
) -> LoadedModel:
    """The model (eval mode) and its verified tokenizer. dtype None keeps the saved fp32 (training from it, evaluation
    under autocast, export); "auto" is the device's own (resolve_dtype: bf16, a T4's fp16, CPU fp32)."""
    info = resolve_checkpoint(run_dir, which, log)
    weights = load_model_weights(info.path, info.manifest["files"][MODEL_FILE])
    state, cfg, tok = read_state_and_tokenizer(run_dir, info.path)
    model = GPT(cfg.model)
    load_weights_into(model, weights, info.path / MODEL_FILE)
    # "auto", or an error naming a missing one
    device = resolve_device(device) if isinstance(device, str) else device
    dtype = resolve_dtype("auto", device) if dtype == "auto" else dtype
    model.to(device=device, dtype=dtype).eval()
    return LoadedModel(
        model=model, tokenizer=tok, config=cfg, step=info.step, path=info.path, state=state
    )


def read_state_and_tokenizer(
    run_dir: str | Path, path: Path
) -> tuple[TrainState, RunConfig, Tokenizer]:
    """state.json, its config, and the run's (else the data dir's) tokenizer, checked against the recorded one."""

    def read() -> tuple[TrainState, RunConfig, Tokenizer]:
        source = str(path / STATE_FILE)
        try:
            state = TrainState.from_json(json.loads((path / STATE_FILE).read_text()), source)
        except (OSError, ValueError) as e:  # ValueError: bad JSON or UTF-8
            raise CheckpointError(f"{source}: unreadable ({e})") from None
        candidates = [Path(d) / TOKENIZER_FILE for d in (Path(run_dir), state.data_dir) if d]
        if not (found := [c for c in candidates if c.is_file()]):
            raise TokenizerError(
                f"no tokenizer for {path}: looked for {' and '.join(map(str, candidates))}; copy "
                f"the data directory's {TOKENIZER_FILE} into the run directory"
            )
        if not state.tokenizer.get("hash"):
            raise TokenizerError(
                f"{path}: the checkpoint records no tokenizer identity, so {found[0]} cannot be "
                f"checked against it"
            )
        tok = load_tokenizer(found[0])
        check_identity(tok, state.tokenizer, f"{path} (tokenizer {found[0]})")
        return state, state.run_config(source), tok

    return call_with_timeout(
        read, DRIVE_READ_STALL_S, what=f"reading {path / STATE_FILE} and the run's {TOKENIZER_FILE}"
    )


def find_run(name: str = "", run_dir: str | Path = "", roots=None) -> Path:
    """Notebooks 04 and 05: RUN_DIR if given, else run NAME's copy with the newest complete checkpoint."""
    from gptlib import colab

    # a name or folder pasted into a notebook's form brings spaces or a newline along
    if run_dir := str(run_dir).strip():
        # a RUN_DIR on Drive, on a fresh VM: mounted before it is looked at, not "no checkpoint there"
        colab.mount_for(run_dir)
        # none there: why, as `sample` says it (no such folder, a folder inside a run, an export); a newer damaged
        # checkpoint is said where the run is loaded
        resolve_checkpoint(run_dir, log=lambda line: None)
        return Path(run_dir)
    paths = colab.run_paths(name, roots)
    return pick_run_dir([paths.run_dir, paths.mirror_dir])


def find_runs(
    names: str = "", current: str | Path | None = None, roots=None, log=print
) -> list[Path]:
    """Notebook 04's runs to compare: `current`, then NAMES (comma-separated run names or directories, each found as
    find_run finds it), or without names every other run under the runs folders (VM disk, Drive) with a checkpoint
    and `current`'s vocabulary size: a char run's loss per character does not compare with a BPE run's per token.
    The runs left out, and why, are said in one line through `log`, as is a comparison of this run alone."""
    from gptlib import colab

    # config.json is beside the checkpoints on the Drive mirror too
    def vocab(run_dir: Path) -> int | None:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return json.loads((run_dir / CONFIG_FILE).read_text())["model"]["vocab_size"]
        return None

    roots, found = roots or colab.setup(), [Path(current)] if current else []
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        found.append(find_run("" if "/" in name else name, name if "/" in name else "", roots))
    if names.strip() or not found:
        found = list(dict.fromkeys(found))  # this run named again: drawn once
        # drawn as named, but a loss per character is not one per token
        for d in [d for d in found[1:] if vocab(d) != vocab(found[0])]:
            log(
                f"compare: {d.name} has vocabulary {vocab(d)}, not {found[0].name}'s {vocab(found[0])}: losses do "
                f"not compare"
            )
        return found

    folders = list(dict.fromkeys([roots.local / "runs", roots.persistent / "runs"]))

    def others() -> dict[str, int]:
        """{each other run's name (a folder with a config.json): its vocabulary size}."""
        copies = [d for f in folders if f.is_dir() for d in sorted(f.iterdir())]
        return {d.name: v for d in copies if d.name != found[0].name and (v := vocab(d))}

    try:
        vocabs = call_with_timeout(others, DRIVE_LIST_TIMEOUT_S, what="listing the runs folders")
    except OSError as e:  # a hung Drive: this run alone
        loud(f"!! the other runs were not looked for: {e}")
        return found
    want, left = vocab(found[0]), []
    for name, v in sorted(vocabs.items()):
        if v != want:
            left.append(f"{name} (vocabulary {v}, not this run's {want}: losses do not compare)")
            continue
        try:
            found.append(find_run(name, roots=roots))
        except CheckpointError:  # no checkpoint yet: nothing to compare
            left.append(f"{name} (no checkpoint yet)")
    drawn = "only this run" if len(found) == 1 else f"{len(found)} runs"
    alone = "no other run in " + " or ".join(map(str, folders))
    if left or len(found) == 1:
        log(f"compare: {drawn}; " + (f"left out {', '.join(left)}" if left else alone))
    return found


def run_log(run_dir: Path, name: str) -> Path | None:
    """A run's log (metrics.jsonl, samples.jsonl): its own, or on the Drive mirror, which keeps the logs in each
    checkpoint, the newest checkpoint's."""
    if (run_dir / name).is_file():
        return run_dir / name
    return next((c / name for c in list_checkpoints(run_dir) if (c / name).is_file()), None)


def run_history(run_dir: str | Path) -> tuple[list[dict], dict]:
    """A run's metrics rows and config.json, local or on the Drive mirror (which keeps the rows in each checkpoint:
    the newest's are read), within a time limit: a hung Drive raises HungIOError, an OSError."""
    run_dir = Path(run_dir)

    def read() -> tuple[list[dict], dict]:
        metrics, config = run_log(run_dir, METRICS_FILE), run_dir / CONFIG_FILE
        rows = read_jsonl(metrics) if metrics else []
        return rows, json.loads(config.read_text()) if config.is_file() else {}

    return call_with_timeout(read, DRIVE_READ_STALL_S, what=f"reading {run_dir / METRICS_FILE}")


def pick_run_dir(candidates, log=loud) -> Path:
    """The run's copy (VM disk, Drive mirror) with the newest complete checkpoint; a hung copy is passed over."""
    best, best_step, looked = None, -1, [str(c) for c in candidates if c is not None]
    for c in looked:
        try:
            table = checkpoint_table(c)
        except OSError as e:
            log(f"!! {c} cannot be read ({e}); using the other copies of the run")
            continue
        if table and table[0]["step"] > best_step:
            best, best_step = Path(c), table[0]["step"]
    if best is None:
        raise CheckpointError(
            f"no complete checkpoint in {' or '.join(looked) or 'no directory'}; train first, or check the "
            f"run's name or folder"
        )
    return best
