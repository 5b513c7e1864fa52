"""The same prompts continued by several checkpoints of a run: how the model learned (notebook 04's table).

With a fixed seed and the same sampling settings, the columns differ only by the weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from gptlib.errors import GenerationError
from gptlib.inference.engine import Engine
from gptlib.inference.loading import checkpoint_label, checkpoint_table, select_steps
from gptlib.inference.sampling import SamplingConfig


@dataclass
class Comparison:
    prompts: list[str]  # rows
    columns: list[str]  # one label per checkpoint, e.g. "step 1,000 · val 1.52 · best"
    steps: list[int]  # the checkpoint step of each column
    texts: list[list[str]]  # texts[i][j]: prompt i continued by checkpoint j


def compare_checkpoints(run_dir, prompts: Sequence[str], checkpoints: Sequence[str | int] | str = "all",
                        cfg: SamplingConfig | None = None, device: str = "cpu", log=None) -> Comparison:
    """Continue every prompt with every checkpoint, with the same settings and seed for all. checkpoints: "all"
    (oldest first), or "latest" / "best" / steps, as a list or a comma-separated string ("1000, best, latest")."""
    cfg = dataclasses.replace(cfg or SamplingConfig(max_new_tokens=100)).validate()
    if cfg.seed is None:
        cfg.seed = 1337  # a fixed seed, so the columns differ only by the weights
    steps = select_steps(run_dir, checkpoints)
    if not prompts:
        raise GenerationError("no prompts to compare")
    table = {r["step"]: r for r in checkpoint_table(run_dir)}
    columns, texts = [], [[] for _ in prompts]
    for s in steps:
        columns.append(checkpoint_label(table.get(s, {"step": s})))
        if log:
            log(f"generating with {columns[-1]}")
        for i, c in enumerate(Engine.from_run(run_dir, s, device=device).generate(list(prompts), cfg)):
            texts[i].append(c.text)
    return Comparison(prompts=list(prompts), columns=columns, steps=steps, texts=texts)
