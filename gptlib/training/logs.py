"""What a run reports: metrics.jsonl (a row per step), samples.jsonl and samples.md (the fixed prompts sampled at each
validation), the progress bar or lines, the notebook's on_log callback, and their plots: loss.png, a notebook's live
plot, HellaSwag acc_norm beside the loss or against tokens seen. Bare matplotlib Figures (no pyplot state): training in
a thread or a headless process never touches a GUI backend."""

from __future__ import annotations

import contextlib
import html
import io
import json
import os
from pathlib import Path
from typing import Callable, Sequence

import torch

from gptlib.checkpoint.format import DRIVE_READ_STALL_S
from gptlib.evaluation.hellaswag import GPT2_124M
from gptlib.fsutil import (
    append_jsonl,
    atomic_write,
    atomic_write_bytes,
    call_with_timeout,
    check_writable,
    parse_jsonl,
    read_bytes_with_timeout,
    read_jsonl,
)
from gptlib.inference.engine import Engine, SamplingConfig
from gptlib.inference.loading import run_history, run_log
from gptlib.layout import LOSS_PLOT, METRICS_FILE, SAMPLES_FILE, SAMPLES_TABLE
from gptlib.training.step import lr_at
from gptlib.training.throughput import fmt_tokens, speed_text


def read_metrics(run_dir: str | Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / METRICS_FILE)


def logs_up_to(run_dir: Path, step: int, saved: dict[str, bytes]) -> list[dict]:
    """The metrics and samples rows up to the resumed step (the resumed run logs the rest again), from the
    checkpoint's copy `saved` where it has more of them (a fresh VM has no local logs); -> the metrics rows."""
    kept = {}
    for name in (METRICS_FILE, SAMPLES_FILE):
        rows = [r for r in read_jsonl(run_dir / name) if r.get("step", 0) <= step]
        saved_rows = parse_jsonl(saved.get(name, b"").decode(errors="replace"))
        copy = [r for r in saved_rows if r.get("step", 0) <= step]
        kept[name] = max(rows, copy, key=len)
        if len(copy) > len(rows) or (run_dir / name).exists():
            text = "".join(json.dumps(r) + "\n" for r in kept[name])
            atomic_write_bytes(run_dir / name, text.encode())
    return kept[METRICS_FILE]


def _samples_grid(samples: Path) -> tuple[list[str], list[int], dict[tuple[int, str], str]]:
    rows = read_jsonl(samples)
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))
    steps = sorted({r["step"] for r in rows})
    return prompts, steps, {(r["step"], r["prompt"]): r["text"] for r in rows}


def write_samples_table(run_dir: Path) -> None:
    """samples.md: a row per validation step, a column per fixed prompt."""
    prompts, steps, cell = _samples_grid(run_dir / SAMPLES_FILE)

    def esc(t: str) -> str:
        return t.replace("|", "\\|").replace("\n", "<br>")

    header = "| step | " + " | ".join(esc(repr(p)) for p in prompts) + " |"
    # Every column left-aligned, explicitly: without it the classic notebook right-aligns the text.
    lines = [header, "|:---|" + ":---|" * len(prompts)]
    for st in steps:
        lines.append(f"| {st} | " + " | ".join(esc(cell.get((st, p), "")) for p in prompts) + " |")
    atomic_write_bytes(run_dir / SAMPLES_TABLE, ("\n".join(lines) + "\n").encode())


def samples_html(run_dir: str | Path) -> str:
    """samples.md as an HTML table: a row per validation step, a column per fixed prompt (a Drive mirror's: from its
    newest checkpoint), read within Drive's time limit: a hung Drive raises HungIOError."""
    run_dir = Path(run_dir)

    def grid():
        return _samples_grid(run_log(run_dir, SAMPLES_FILE) or Path(os.devnull))

    what = f"reading {run_dir / SAMPLES_FILE}"
    prompts, steps, cell = call_with_timeout(grid, DRIVE_READ_STALL_S, what=what)
    if not steps:
        return "<p>no samples yet: the fixed prompts are sampled at each validation</p>"
    return html_table(
        "step",
        [repr(p) for p in prompts],
        [(f"{st:,}", [cell.get((st, p), "") for p in prompts]) for st in steps],
    )


def html_table(
    corner: str, columns: Sequence[str], rows: Sequence[tuple[str, Sequence[str]]]
) -> str:
    """Texts side by side: a header row (`corner`, then `columns`), then each row's label and a text per column, as
    written (line breaks kept). Each cell aligns top-left: a notebook's own table style centres a cell vertically (two
    texts of a row start at different heights) and right-aligns its text."""
    td = "border:1px solid #ccc;padding:4px 6px;vertical-align:top;text-align:left"
    pre = '<pre style="white-space:pre-wrap;margin:0;font-size:12px">'
    head = "".join(f'<th style="{td}">{html.escape(c)}</th>' for c in [corner, *columns])
    body = "".join(
        f'<tr><th style="{td}">{html.escape(label)}</th>'
        + "".join(f'<td style="{td}">{pre}{html.escape(text)}</pre></td>' for text in texts)
        + "</tr>"
        for label, texts in rows
    )
    return f'<table class="gptlib-samples" style="border-collapse:collapse"><tr>{head}</tr>{body}</table>'


def log_samples(
    model,
    tokenizer,
    prompts: list[str | list[int]],
    n_tokens: int,
    seed: int,
    autocast,
    step: int,
    run_dir: Path,
    log: Callable[[str], None],
    stop_ids: Sequence[int] = (),
) -> list[dict]:
    """Continue each fixed prompt (a string, or token ids: a chat prompt) with a fixed seed per prompt, so that
    samples differ only by the weights; cut at the first of stop_ids; append to samples.jsonl, redraw samples.md."""
    rows = []
    gen = torch.Generator(device="cpu")
    engine = Engine(model)
    cfg = SamplingConfig(max_new_tokens=n_tokens, temperature=0.8, stop_at_eot=False)
    was_training = model.training
    model.eval()
    for i, prompt in enumerate(prompts):
        gen.manual_seed(seed + i)
        if isinstance(prompt, str):
            try:
                prompt_ids = tokenizer.encode(prompt)
            except ValueError as e:
                log(f"sample prompt {prompt!r} skipped: {e}")
                continue
        else:
            prompt_ids, prompt = list(prompt), tokenizer.decode(prompt)
        with autocast:  # an empty prompt starts from token 0
            out = engine.generate_ids([prompt_ids or [0]], cfg, generator=gen)[0][0]
        cut = next((k for k, t in enumerate(out) if t in stop_ids), len(out))
        rows.append({"step": step, "prompt": prompt, "text": prompt + tokenizer.decode(out[:cut])})
    model.train(was_training)
    append_jsonl(run_dir / SAMPLES_FILE, *rows)
    write_samples_table(run_dir)
    return rows


class MetricsLog:
    """metrics.jsonl and the rows of this run so far (`history`): the record of its losses. Losses stay on the device
    until `flush` (a log step, and every checkpoint, so a resumed run writes the rows the uninterrupted run would): one
    host sync per log_interval. DDP ranks other than 0 write to os.devnull, but `flush` still averages over ranks.
    What shows them (the bar, the lines, MFU, ETA) is RunProgress (training/throughput.py)."""

    def __init__(self, run):
        self.run, self.tc, self.history = run, run.cfg.train, run.history
        self.pending: list[torch.Tensor] = []  # the losses of steps not logged yet, on the device
        # the last logged
        self.train_loss = self.history[-1].get("train_loss") if self.history else None
        self.val_loss = self.val_step = None  # this call's last validation
        self.file = open(run.run_dir / METRICS_FILE if run.ddp.is_main else os.devnull, "a")

    def add(self, loss: torch.Tensor) -> None:
        self.pending.append(loss)

    def flush(self, validating: bool, speed: dict) -> None:
        """Read the pending losses back (the loop's host sync) and write a row per step, the last with `speed`
        (RunProgress.measure). A validation step's row is written by `validation_row`, with its val loss; until then
        its loss stays pending."""
        if not self.pending:
            return
        losses = self.run.ddp.mean(torch.stack(self.pending)).tolist()
        self.pending = self.pending[-1:] if validating else []
        self.train_loss = losses[-1]
        first = self.run.state.step - len(losses) + 1
        rows = [self._row(step, loss) for step, loss in enumerate(losses[:-1], first)]
        # the last step's row carries the speed; a validation step's is written with its val loss
        if not validating:
            rows.append(self._row(self.run.state.step, losses[-1], speed))
        self._write(*rows)

    def validation_row(self, val_loss: float, speed: dict, extra: dict | None = None) -> dict:
        """This step's row, with its val loss (after `flush`), `speed` and `extra` (HellaSwag fields)."""
        self.val_loss, self.val_step, self.pending = val_loss, self.run.state.step, []
        extra = {"val_loss": round(val_loss, 6), **(extra or {})}
        row = self._row(self.val_step, self.train_loss, speed, **extra)
        self._write(row)
        return row

    def _row(self, step: int, loss: float, speed: dict | None = None, **extra) -> dict:
        """A step's row; the last of a log step carries `speed` (tokens/s once measured, elapsed time, MFU, ETA)."""
        st = self.run.state
        return {
            "step": step,
            "train_loss": round(loss, 6),
            **extra,
            # the rate step `step` trained with
            "lr": lr_at(step - 1, self.tc),
            "tokens_seen": st.tokens_seen - (st.step - step) * self.run.tokens_per_step,
            **(speed or {}),
        }

    def _write(self, *rows: dict) -> None:
        check_writable(self.file.name)  # the run is still this process's (gptlib/lease.py)
        self.file.write("".join(json.dumps(row) + "\n" for row in rows))
        self.file.flush()
        self.history += rows

    def close(self) -> None:
        self.file.close()


# The plots: bare matplotlib Figures (matplotlib imported here only: `import gptlib.training.logs` stays light).
def _axes(figsize, dpi: int, xlabel: str, ylabel: str, title: str):
    """Constrained layout makes room for a title of several lines, which wrap=True breaks to the figure's width
    (a long run name or speed line was cut off at both edges)."""
    from matplotlib.figure import Figure

    ax = Figure(figsize=figsize, dpi=dpi, layout="constrained").add_subplot(1, 1, 1)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=10, wrap=True)
    ax.grid(alpha=0.3)
    return ax


def _references(ax, color: str, lw: float) -> None:
    gpt2 = GPT2_124M["acc_norm"]
    ax.axhline(gpt2, color=color, ls="--", lw=lw, alpha=0.7, label=f"GPT-2 124M (OpenAI): {gpt2}")
    ax.axhline(0.25, color="gray", ls=":", lw=lw, alpha=0.7, label="chance: 0.25")


def loss_figure(rows: list[dict], title: str = "", figsize=(7, 4), dpi: int = 100):
    ax = _axes(figsize, dpi, "step", "loss (nats/token)", title)
    for key, style, lw in (("train_loss", "-", 1), ("val_loss", "o-", 1.5)):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), style, label=key.removesuffix("_loss"), lw=lw, ms=3)
    if add_hellaswag_axis(ax, rows) is None and ax.lines:
        ax.legend()
    return ax.figure


def plot_losses(rows: list[dict], path: Path, title: str = "") -> None:
    atomic_write(path, lambda f: loss_figure(rows, title).savefig(f, format="png"))


def loss_png(run_dir: str | Path) -> bytes:
    """The run's loss.png (notebook 02 shows a Drive mirror's on a fresh VM), read within Drive's time limit: a hung
    Drive raises HungIOError."""
    return read_bytes_with_timeout(Path(run_dir) / LOSS_PLOT, DRIVE_READ_STALL_S)


def run_title(preset: str, run_name: str, sep: str = ": ") -> str:
    """The preset and the run ("phase1: my-run"), named once when the run is named as its preset."""
    return preset if not run_name or run_name == preset else f"{preset}{sep}{run_name}"


class LivePlot:
    """`LivePlot(run_dir).update` as train()'s on_log callback redraws the run's whole metrics.jsonl in one display,
    made with the LivePlot, before training prints anything, so that the plot stays above the log lines."""

    PLACEHOLDER = "loss plot: drawn here at the first validation"

    def __init__(self, run_dir: str | Path, title: str = ""):
        self.run_dir, self.title = Path(run_dir), title
        self.handle = None  # the notebook display the plot is drawn in
        with contextlib.suppress(ImportError):
            from IPython import get_ipython
            from IPython.display import display

            if get_ipython() is not None:
                bundle = {"text/plain": self.PLACEHOLDER, "text/markdown": f"*{self.PLACEHOLDER}*"}
                self.handle = display(bundle, raw=True, display_id=True)

    def figure(self, row: dict | None = None):
        """The run's metrics.jsonl. The title: the run and its last validation; below, the speed of `row` (train's
        on_log: training runs), else the last row's without its ETA (training has stopped: the ETA is stale)."""
        rows = read_metrics(self.run_dir)
        val = next((r for r in reversed(rows) if r.get("val_loss") is not None), None)
        if row is None:
            row = {k: v for k, v in (rows[-1] if rows else {}).items() if k != "eta_s"}
        last_val = val and f"step {val['step']:,}: val {val['val_loss']:.4f}"
        head = " · ".join(filter(None, [self.title, last_val]))
        title = "\n".join(filter(None, [head, speed_text(row, split=True)]))
        return loss_figure(rows, title, figsize=(8, 3.6), dpi=90)

    def update(self, row: dict | None = None) -> None:
        fig = self.figure(row)
        # in a notebook: a PNG shows the same in Jupyter, Colab and saved notebooks
        if self.handle is not None:
            from IPython.display import Image

            buf = io.BytesIO()
            fig.savefig(buf, format="png")
            self.handle.update(Image(data=buf.getvalue(), format="png"))


def runs_figure(
    run_dirs: Sequence[str | Path],
    title: str = "validation loss against tokens seen",
    figsize=(8, 4),
    dpi: int = 90,
):
    """Each run's validation loss (local or on Drive) against the tokens it has seen, a line per run, the legend
    naming it with its preset and recipe: runs of other batch sizes or recipes compare at equal tokens."""
    ax = _axes(figsize, dpi, "tokens seen", "validation loss (nats/token)", title)
    for run_dir in map(Path, run_dirs):
        try:
            rows, cfg = run_history(run_dir)
        # a hung Drive, a damaged config.json: the other runs are drawn
        except (OSError, ValueError) as e:
            ax.plot([], [], " ", label=f"{run_dir.name}: not read ({type(e).__name__})")
            continue
        points = [(r["tokens_seen"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        what = ", ".join(str(cfg[k]) for k in ("preset", "recipe") if k in cfg) or "no config.json"
        label = f"{run_dir.name} ({what})" + ("" if points else ": no validation yet")
        ax.plot(*(zip(*points) if points else ([], [])), "o-", lw=1.5, ms=3, label=label)
    ax.xaxis.set_major_formatter(lambda x, _: fmt_tokens(x))  # 500M, 1B, 1.5B
    ax.legend(fontsize=8)
    return ax.figure


def add_hellaswag_axis(ax, rows: list[dict]):
    """HellaSwag acc_norm of metrics.jsonl rows (a subset, all items at the end: hellaswag_n says which) on a second
    y axis of the loss plot, with one legend for both axes; None when no row has one."""
    pts = [(r["step"], a) for r in rows if (a := r.get("hellaswag_acc_norm")) is not None]
    if not pts:
        return None
    ax2 = ax.twinx()
    ax2.plot(*zip(*pts), "s-", color="tab:green", lw=1.2, ms=3, label="HellaSwag acc_norm")
    _references(ax2, "tab:green", 0.8)
    ax2.set_ylabel("HellaSwag acc_norm", color="tab:green")
    (h1, l1), (h2, l2) = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    ax2.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper right")
    return ax2


def hellaswag_figure(rows: list[dict], title: str = "", figsize=(7, 4), dpi: int = 100):
    """acc_norm of eval.jsonl rows against tokens seen, with GPT-2 124M's figure."""
    ax = _axes(figsize, dpi, "tokens seen", "HellaSwag acc_norm", title)
    scored = [r for r in rows if r.get("task") == "hellaswag" and r.get("tokens_seen") is not None]
    pts = sorted((r["tokens_seen"], r["acc_norm"]) for r in scored)
    if pts:
        ax.plot(*zip(*pts), "o-", label="this run")
    _references(ax, "tab:red", 1)
    ax.legend(fontsize=8)
    return ax.figure
