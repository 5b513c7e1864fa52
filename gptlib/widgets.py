"""Notebook views: a generation playground (ipywidgets) and a prompts x checkpoints comparison table.

    pg = Playground(run_dir)      # builds the widgets; nothing is loaded until Generate is pressed
    display(pg.widget)
    pg.generate()                 # what the Generate button does (usable headless, e.g. in tests)

    display(HTML(comparison_html(compare_checkpoints(run_dir, prompts, "all", cfg))))
"""

from __future__ import annotations

import html
import sys
import time
from collections import OrderedDict
from pathlib import Path

from .generate import Comparison, Completion, Engine, SamplingConfig


def enable_colab_widgets() -> bool:
    """On Colab, ipywidgets 8 needs the custom widget manager; elsewhere nothing to do."""
    if "google.colab" not in sys.modules:
        return False
    try:
        from google.colab import output  # type: ignore

        output.enable_custom_widget_manager()
        return True
    except (ImportError, AttributeError):
        return False


def parse_list(text: str, sep: str = "|") -> list[str]:
    r"""A Colab form string -> items: "ROMEO:|JULIET:|\n" -> ["ROMEO:", "JULIET:", "\n"] (\n means newline)."""
    return [s.replace("\\n", "\n") for s in text.split(sep) if s != ""]


class Playground:
    """Prompt box, sampling sliders, checkpoint dropdown, Generate button and streamed output."""

    def __init__(self, run_dir: str | Path, device: str = "cpu", prompt: str = "ROMEO:", max_loaded: int = 2,
                 compile: bool = False):
        import ipywidgets as W

        self.run_dir = Path(run_dir)
        self.device = device
        self.compile = compile  # Engine(compile=True): compiled decode step (GPU; the first Generate compiles)
        self.max_loaded = max_loaded  # engines kept in memory (switching back is then instant)
        self._engines: OrderedDict[int, Engine] = OrderedDict()
        wide = W.Layout(width="95%")
        style = {"description_width": "110px"}
        self.prompt = W.Textarea(value=prompt, description="Prompt", layout=W.Layout(width="95%", height="80px"),
                                 style=style)
        self.checkpoint = W.Dropdown(description="Checkpoint", style=style, layout=W.Layout(width="60%"))
        self.refresh_button = W.Button(description="↻", tooltip="re-scan the run directory for new checkpoints",
                                       layout=W.Layout(width="40px"))
        self.temperature = W.FloatSlider(value=0.8, min=0.0, max=2.0, step=0.05, description="Temperature",
                                         style=style, layout=wide)
        self.top_k = W.IntSlider(value=0, min=0, max=500, description="Top-k (0 = off)", style=style, layout=wide)
        self.top_p = W.FloatSlider(value=0.95, min=0.05, max=1.0, step=0.01, description="Top-p", style=style,
                                   layout=wide)
        self.repetition_penalty = W.FloatSlider(value=1.0, min=1.0, max=2.0, step=0.05, description="Rep. penalty",
                                                style=style, layout=wide)
        self.max_tokens = W.IntSlider(value=200, min=1, max=2000, description="Max tokens", style=style, layout=wide)
        self.seed = W.IntText(value=1337, description="Seed (-1 random)", style=style)
        self.stop = W.Text(value="", description="Stop at", placeholder=r"e.g. \n\n (| separates several)",
                           style=style)
        self.button = W.Button(description="Generate", button_style="primary", icon="play")
        self.status = W.HTML(value="")
        self.output = W.HTML(value="")
        self.button.on_click(lambda _: self.generate())
        self.refresh_button.on_click(lambda _: self.refresh())
        self.widget = W.VBox([
            self.prompt,
            W.HBox([self.checkpoint, self.refresh_button]),
            self.temperature, self.top_k, self.top_p, self.repetition_penalty, self.max_tokens,
            W.HBox([self.seed, self.stop]),
            W.HBox([self.button, self.status]),
            self.output,
        ])
        self.refresh()

    def refresh(self) -> None:
        """Fill the checkpoint dropdown from the run directory (training may have saved new ones)."""
        from .loading import checkpoint_label, checkpoint_table

        rows = checkpoint_table(self.run_dir)
        keep = self.checkpoint.value
        self.checkpoint.options = [(checkpoint_label(r), r["step"]) for r in rows]
        if rows:
            self.checkpoint.value = keep if keep in [r["step"] for r in rows] else rows[0]["step"]
        else:
            self._show_status(f"no complete checkpoint in {self.run_dir}", error=True)

    def sampling_config(self) -> SamplingConfig:
        return SamplingConfig(
            max_new_tokens=int(self.max_tokens.value), temperature=float(self.temperature.value),
            top_k=int(self.top_k.value) or None, top_p=float(self.top_p.value),
            repetition_penalty=float(self.repetition_penalty.value), stop=parse_list(self.stop.value),
            seed=int(self.seed.value) if int(self.seed.value) >= 0 else None,  # same seed -> same text
        ).validate()

    def engine(self, step: int) -> Engine:
        if step in self._engines:
            self._engines.move_to_end(step)
            return self._engines[step]
        while len(self._engines) >= self.max_loaded:
            self._engines.popitem(last=False)  # free the least recently used model first
        eng = Engine.from_run(self.run_dir, step, device=self.device, compile=self.compile)
        self._engines[step] = eng
        return eng

    def _show_status(self, msg: str, error: bool = False) -> None:
        color = "#b00020" if error else "#555"
        self.status.value = f'<span style="color:{color}">{html.escape(msg)}</span>'

    def _show_text(self, prompt: str, text: str) -> None:
        self.output.value = (
            '<pre style="white-space:pre-wrap;font-size:13px;line-height:1.35">'
            f"<b>{html.escape(prompt)}</b>{html.escape(text)}</pre>"
        )

    def generate(self) -> Completion | None:
        """What the Generate button does: stream the continuation into the output box."""
        if self.checkpoint.value is None:
            self.refresh()
            if self.checkpoint.value is None:
                return None
        self.button.disabled = True
        try:
            cfg = self.sampling_config()
            self._show_status("loading checkpoint…")
            eng = self.engine(self.checkpoint.value)
            prompt = self.prompt.value
            self._show_status("generating…")
            parts: list[str] = []
            last = [0.0]

            def on_piece(_: int, piece: str) -> None:
                parts.append(piece)
                now = time.perf_counter()
                if now - last[0] > 0.05:  # at most ~20 redraws per second
                    last[0] = now
                    self._show_text(prompt, "".join(parts))

            t0 = time.perf_counter()
            res = eng.generate(prompt, cfg, stream=on_piece)[0]
            dt = time.perf_counter() - t0
            self._show_text(prompt, res.text)
            self._show_status(f"step {eng.step:,}: {len(res.token_ids)} tokens in {dt:.1f} s "
                              f"({len(res.token_ids) / max(dt, 1e-9):.0f} tokens/s), stopped by {res.finish_reason}")
            return res
        except Exception as e:  # noqa: BLE001 - a button callback must show the problem, not swallow it in a log
            self._show_status(f"{type(e).__name__}: {e}", error=True)
            return None
        finally:
            self.button.disabled = False

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


def comparison_html(cmp: Comparison) -> str:
    """Prompts as rows, checkpoints as columns; each cell the prompt (bold) and its continuation."""
    cell = "border:1px solid #ccc;padding:6px;vertical-align:top;text-align:left"
    head = "".join(f'<th style="{cell};background:#f3f3f3">{html.escape(c)}</th>' for c in cmp.columns)
    rows = []
    for prompt, texts in zip(cmp.prompts, cmp.texts):
        tds = "".join(
            f'<td style="{cell}"><pre style="white-space:pre-wrap;margin:0;font-size:12px">'
            f"<b>{html.escape(prompt)}</b>{html.escape(t)}</pre></td>"
            for t in texts
        )
        rows.append(f'<tr><th style="{cell};background:#f3f3f3">{html.escape(repr(prompt))}</th>{tds}</tr>')
    return (f'<table class="gptlib-compare" style="border-collapse:collapse">'
            f'<tr><th style="{cell}">prompt</th>{head}</tr>{"".join(rows)}</table>')
