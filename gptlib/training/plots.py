"""loss.png, a notebook's live plot, HellaSwag acc_norm beside the loss or against tokens seen. Bare matplotlib Figures
(no pyplot state): training in a thread or a headless process never touches a GUI backend."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from gptlib.evaluation.hellaswag import GPT2_124M
from gptlib.fsutil import atomic_write
from gptlib.training.logs import read_metrics
from gptlib.training.throughput import speed_text


def _axes(figsize, dpi: int, xlabel: str, ylabel: str, title: str):
    from matplotlib.figure import Figure

    ax = Figure(figsize=figsize, dpi=dpi).add_subplot(1, 1, 1)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    return ax


def _references(ax, color: str, lw: float) -> None:
    ax.axhline(GPT2_124M["acc_norm"], color=color, ls="--", lw=lw, alpha=0.7, label="GPT-2 124M (OpenAI): 0.2955")
    ax.axhline(0.25, color="gray", ls=":", lw=lw, alpha=0.7, label="chance: 0.25")


def loss_figure(rows: list[dict], title: str = "", figsize=(7, 4), dpi: int = 100):
    ax = _axes(figsize, dpi, "step", "loss (nats/token)", title)
    for key, style, lw in (("train_loss", "-", 1), ("val_loss", "o-", 1.5)):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), style, label=key.removesuffix("_loss"), lw=lw, ms=3)
    if add_hellaswag_axis(ax, rows) is None and ax.lines:
        ax.legend()
    ax.figure.tight_layout()
    return ax.figure


def plot_losses(rows: list[dict], path: Path, title: str = "") -> None:
    atomic_write(path, lambda f: loss_figure(rows, title).savefig(f, format="png"))


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
                self.handle = display({"text/plain": self.PLACEHOLDER, "text/markdown": f"*{self.PLACEHOLDER}*"},
                                      raw=True, display_id=True)

    def figure(self, last: dict | None = None):
        rows = read_metrics(self.run_dir)
        last = last or (rows[-1] if rows else {})
        parts = [self.title,
                 last.get("val_loss") is not None and f"step {last['step']:,}: val {last['val_loss']:.4f}",
                 speed_text(last, split=True)]
        return loss_figure(rows, " · ".join(p for p in parts if p), figsize=(8, 3.6), dpi=90)

    def update(self, row: dict | None = None) -> None:
        fig = self.figure(row)
        if self.handle is not None:  # in a notebook: a PNG shows the same in Jupyter, Colab and saved notebooks
            from IPython.display import Image

            buf = io.BytesIO()
            fig.savefig(buf, format="png")
            self.handle.update(Image(data=buf.getvalue(), format="png"))


def add_hellaswag_axis(ax, rows: list[dict]):
    """HellaSwag acc_norm of metrics.jsonl rows (a subset, all items at the end: hellaswag_n says which) on a second
    y axis of the loss plot, with one legend for both axes; None when no row has one."""
    pts = [(r["step"], r["hellaswag_acc_norm"]) for r in rows if r.get("hellaswag_acc_norm") is not None]
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
    pts = sorted((r["tokens_seen"], r["acc_norm"]) for r in rows
                 if r.get("task") == "hellaswag" and r.get("tokens_seen") is not None)
    if pts:
        ax.plot(*zip(*pts), "o-", label="this run")
    _references(ax, "tab:red", 1)
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax.figure
