"""A live loss plot for notebooks: pass `LivePlot(run_dir).update` as train()'s on_log callback.

Each call re-reads the run's metrics.jsonl (every logged step, including those from earlier
sessions of a resumed run), redraws train/val loss, and shows tokens/s, MFU and ETA in the title.
It updates one display in place (IPython display handle); outside IPython it just draws the figure.
"""

from __future__ import annotations

from pathlib import Path


class LivePlot:
    def __init__(self, run_dir: str | Path, title: str = ""):
        self.run_dir = Path(run_dir)
        self.title = title
        self.handle = None  # IPython DisplayHandle, created on the first update
        self.updates = 0

    def figure(self, last: dict | None = None):
        from .bench import fmt_duration, fmt_mfu
        from .train import loss_figure, read_metrics

        rows = read_metrics(self.run_dir)
        last = last or (rows[-1] if rows else {})
        parts = [self.title] if self.title else []
        if last.get("tokens_per_s"):
            parts.append(f"{last['tokens_per_s']:,.0f} tok/s")
        if "mfu" in last:
            parts.append(f"MFU {fmt_mfu(last['mfu'])}")
        if last.get("eta_s") is not None:
            parts.append(f"ETA {fmt_duration(last['eta_s'])}")
        return loss_figure(rows, " · ".join(parts), figsize=(8, 3.6), dpi=90)

    def update(self, row: dict | None = None) -> None:
        """on_log callback: redraw with everything logged so far."""
        import io

        fig = self.figure(row)
        self.updates += 1
        try:
            from IPython.display import Image, display
        except ImportError:
            return
        buf = io.BytesIO()
        fig.savefig(buf, format="png")  # a PNG shows the same in Jupyter, Colab and saved notebooks
        img = Image(data=buf.getvalue(), format="png")
        if self.handle is None:
            self.handle = display(img, display_id=True)
        else:
            self.handle.update(img)
