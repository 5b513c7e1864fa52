"""The same prompts continued by several checkpoints of a run: how the model learned (notebook 04's table).

With a fixed seed and the same sampling settings, the columns differ only by the weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from gptlib.errors import GenerationError
from gptlib.inference.engine import Engine
from gptlib.inference.loading import checkpoint_label, checkpoint_table, resolve_checkpoint
from gptlib.inference.sampling import SamplingConfig


@dataclass
class Comparison:
    prompts: list[str]  # rows
    columns: list[str]  # one label per checkpoint, e.g. "step 1,000 · val 1.52 · best"
    steps: list[int]  # the checkpoint step of each column
    texts: list[list[str]]  # texts[i][j]: prompt i continued by checkpoint j


def compare_checkpoints(run_dir, prompts: Sequence[str], checkpoints: Sequence[str | int] | str = "all",
                        cfg: SamplingConfig | None = None, device: str = "cpu", log=None) -> Comparison:
    """Continue every prompt with every checkpoint, with the same settings and seed for all.

    checkpoints: "all" (every complete checkpoint, oldest first), or "latest" / "best" / steps, as a list
    or a comma-separated string ("1000, best, latest").
    With a fixed seed the columns differ only by the weights: how the model learned.
    """
    cfg = dataclasses.replace(cfg or SamplingConfig(max_new_tokens=100)).validate()
    if cfg.seed is None:
        cfg.seed = 1337  # a fixed seed, so the columns differ only by the weights
    if isinstance(checkpoints, str):  # "all" or "1000, best, latest"
        checkpoints = [c.strip() for c in checkpoints.split(",") if c.strip()]
    elif isinstance(checkpoints, int):
        checkpoints = [checkpoints]
    if [str(c).lower() for c in checkpoints] == ["all"]:
        steps = sorted(r["step"] for r in checkpoint_table(run_dir))
    else:
        steps = []
        for c in checkpoints:
            s = resolve_checkpoint(run_dir, c).step
            if s not in steps:
                steps.append(s)
    if not prompts:
        raise GenerationError("no prompts to compare")
    table = {r["step"]: r for r in checkpoint_table(run_dir)}
    columns, texts = [], [[] for _ in prompts]
    for s in steps:
        eng = Engine.from_run(run_dir, s, device=device)
        label = checkpoint_label(table.get(s, {"step": s}))
        columns.append(label)
        if log:
            log(f"generating with {label}")
        for i, c in enumerate(eng.generate(list(prompts), cfg)):
            texts[i].append(c.text)
        del eng
    return Comparison(prompts=list(prompts), columns=columns, steps=steps, texts=texts)
