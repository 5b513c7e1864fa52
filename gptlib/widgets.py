"""Notebook views: a generation playground, a chat box (ipywidgets) and a prompts x checkpoints comparison table.

    pg = Playground(run_dir)      # builds the widgets; nothing is loaded until Generate is pressed
    display(pg.widget)
    pg.generate()                 # what the Generate button does (usable headless, e.g. in tests)
    pg.request_stop()             # what the Stop button does: the generation ends at its next token

    box = ChatBox(chat_run_dir)   # a chat-tuned run; loaded at the first message
    box.send("Hi!")               # what Send (or Enter) does (headless too); box.reset() is the Reset button
    display(box)                  # the widget; where widgets cannot be drawn, the conversation as text

    display(HTML(comparison_html(compare_checkpoints(run_dir, prompts, "all", cfg))))

Only widgets and calls present in both ipywidgets 7.7.1 (Colab) and 8 are used.
"""

from __future__ import annotations

import html
import sys
import threading
import time
import warnings
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from gptlib.inference.chat import ChatSession
from gptlib.inference.compare import Comparison
from gptlib.inference.engine import Completion, Engine, SamplingConfig
from gptlib.inference.loading import checkpoint_label, checkpoint_table


def enable_colab_widgets() -> bool:
    """On Colab, ipywidgets 8 needs the custom widget manager; elsewhere nothing to do. With Colab's own
    ipywidgets 7 Colab draws the widgets itself, and the custom manager (loaded from a CDN, taking over every
    later widget, tqdm bars included) is what broke Colab's tqdm bars in 2022: it is left off."""
    if "google.colab" not in sys.modules:
        return False
    try:
        import ipywidgets

        if int(ipywidgets.__version__.split(".")[0]) < 8:
            return False
        from google.colab import output  # type: ignore

        output.enable_custom_widget_manager()
        return True
    except (ImportError, AttributeError):
        return False


def parse_list(text: str, sep: str = "|") -> list[str]:
    r"""A Colab form string -> items: "ROMEO:|JULIET:|\n" -> ["ROMEO:", "JULIET:", "\n"] (\n means newline)."""
    return [s.replace("\\n", "\n") for s in text.split(sep) if s != ""]



def _in_kernel() -> bool:
    """Whether a Jupyter kernel runs us: a front end can then click a button while we work."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return getattr(get_ipython(), "kernel", None) is not None


class _Stopped(Exception):
    """Raised by the Playground's stream callback after Stop was pressed: ends the generation at that token."""


def playground_error(e: Exception) -> str:
    """The status line for a failed Generate. A char model cannot take a character its training text lacked (its
    vocabulary has no row for it, so no option can map it): here the fix is the prompt."""
    msg = f"{type(e).__name__}: {e}"
    if "is not in the char vocabulary" in msg:
        msg = msg.split("; ")[0] + ": this char model never saw it in training; remove or replace it in the prompt"
    return msg

class Playground:
    """Prompt box, sampling sliders, checkpoint dropdown, Generate and Stop buttons and streamed output.

    Stop sets a flag that the stream callback checks after each token. In a kernel, a widget callback runs on the
    kernel's main thread and holds back every other message (the Stop click too) until it returns, so there the
    Generate button hands the work to a thread of the Playground's own (as ipywidgets' documentation updates widgets
    in the background) and returns at once; a kernel interrupt cannot reach that thread: Stop is the way.
    `generate()` called from code runs where it is called, and an interrupt there ends it too.
    """

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
        # "initial": the label takes the width it needs (a fixed 110px cut "Seed (-1 random)"); works in 7.7.1 and 8
        self.seed = W.IntText(value=1337, description="Seed (-1 random)", style={"description_width": "initial"},
                              layout=W.Layout(width="260px"))
        self.stop = W.Text(value="", description="Stop at", placeholder=r"\n\n  (| separates)", style=style,
                           layout=W.Layout(width="60%"))
        # never squeezed by a long status message beside it (it read "Gene…")
        self.button = W.Button(description="Generate", button_style="primary", icon="play",
                               layout=W.Layout(min_width="120px", flex="0 0 auto"))
        self.stop_button = W.Button(description="Stop", icon="stop", disabled=True, tooltip="end it at the next token",
                                    layout=W.Layout(min_width="90px", flex="0 0 auto"))
        self.status = W.HTML(value="")
        self.output = W.HTML(value="")
        self._stop = threading.Event()  # set by Stop, read by the stream callback (another thread in a kernel)
        self._busy = threading.Lock()  # one generation at a time (the button's thread, or a cell's call)
        self._worker: ThreadPoolExecutor | None = None  # one thread for every click: compiled CUDA graphs live there
        self._job: Future | None = None  # the button's last generation
        self.button.on_click(lambda _: self._generate_clicked())
        self.stop_button.on_click(lambda _: self.request_stop())
        self.refresh_button.on_click(lambda _: self.refresh())
        self.widget = W.VBox([
            self.prompt,
            W.HBox([self.checkpoint, self.refresh_button]),
            self.temperature, self.top_k, self.top_p, self.repetition_penalty, self.max_tokens,
            W.HBox([self.seed, self.stop]),
            W.HBox([self.button, self.stop_button]),
            self.status,  # its own row: an error message has the width it needs
            self.output,
        ])
        self.refresh()

    def refresh(self) -> None:
        """Fill the checkpoint dropdown from the run directory (training may have saved new ones)."""
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

    def _generate_clicked(self) -> None:
        """The Generate button: in a kernel on the Playground's thread (see the class docstring), else right here."""
        if not _in_kernel():
            self.generate()
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gptlib-playground")
        self._job = self._worker.submit(self.generate)

    def request_stop(self) -> None:
        """What the Stop button does: the generation ends at its next token; its text so far stays shown."""
        self._stop.set()

    def generate(self) -> Completion | None:
        """What the Generate button does: stream the continuation into the output box, until it is done or Stop."""
        if self.checkpoint.value is None:
            self.refresh()
            if self.checkpoint.value is None:
                return None
        if not self._busy.acquire(blocking=False):
            self._show_status("already generating: press Stop first", error=True)
            return None
        self._stop.clear()  # a click of an earlier generation does not stop this one
        self.button.disabled, self.stop_button.disabled = True, False
        prompt, parts = self.prompt.value, []
        try:
            return self._generate(prompt, parts)
        except KeyboardInterrupt:  # the kernel's interrupt: the text so far stays, and the caller stops as it should
            self._show_text(prompt, "".join(parts))
            self._show_status(f"interrupted after {len(''.join(parts)):,} characters")
            raise
        except Exception as e:  # noqa: BLE001 - a button callback must show the problem, not swallow it in a log
            self.output.value = ""  # the previous text must not look like this prompt's result
            self._show_status(playground_error(e), error=True)
            return None
        finally:
            self.button.disabled, self.stop_button.disabled = False, True
            self._busy.release()

    def _generate(self, prompt: str, parts: list[str]) -> Completion:
        """Load, generate and show; the stream callback collects the text in `parts` and ends it after Stop."""
        cfg = self.sampling_config()
        self._show_status("loading checkpoint…")
        eng = self.engine(self.checkpoint.value)
        self._show_status("generating… (Stop ends it)")
        last = [0.0]

        def on_piece(_: int, piece: str) -> None:
            parts.append(piece)
            now = time.perf_counter()
            if now - last[0] > 0.05:  # at most ~20 redraws per second
                last[0] = now
                self._show_text(prompt, "".join(parts))
            if self._stop.is_set():
                raise _Stopped

        t0 = time.perf_counter()
        try:
            res = eng.generate(prompt, cfg, stream=on_piece)[0]
        except _Stopped:
            text = "".join(parts)  # what was shown; its tokens are what the model generated (re-encoded)
            res = Completion(prompt=prompt, text=text, token_ids=eng.tokenizer.encode(text), finish_reason="user")
        dt = time.perf_counter() - t0
        n, speed = len(res.token_ids), f"{dt:.1f} s ({len(res.token_ids) / max(dt, 1e-9):.0f} tokens/s)"
        self._show_text(prompt, res.text)
        self._show_status(f"step {eng.step:,}: " + (f"stopped after {n} tokens in {speed}: Stop pressed"
                                                    if res.finish_reason == "user" else
                                                    f"{n} tokens in {speed}, stopped by {res.finish_reason}"))
        return res

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


class ChatBox:
    """A chat with a chat-tuned run: transcript, message box, Send and Reset, sampling settings, system prompt.

    Only widgets and calls present in both ipywidgets 7.7.1 (Colab) and 8 are used. The transcript shows every
    turn; the model sees those that fit its context (gptlib.inference.chat drops the oldest, and says so here). Enter
    sends (a one-line box). `display(box)` shows the widget, or where a front end cannot draw widgets the
    conversation as text: a message sent before the box is shown needs no printing of its own (it would then
    show twice, and stay after Reset).
    """

    def __init__(self, run_dir: str | Path | None = None, checkpoint: str | int = "latest", device: str = "cpu",
                 system: str = "", compile: bool = False, session: ChatSession | None = None):
        import ipywidgets as W

        if run_dir is None and session is None:
            raise ValueError("ChatBox needs a run_dir (or a ChatSession)")
        self.run_dir, self.checkpoint, self.device, self.compile = run_dir, checkpoint, device, compile
        self._session = session
        self.turns: list[tuple[str, str]] = []  # the whole transcript, as shown
        self._notices: list[str] = []  # the session's notices during the last send (context cut, ...)
        wide, style = W.Layout(width="95%"), {"description_width": "110px"}
        self.transcript = W.HTML(value="")
        self.message = W.Text(value="", placeholder="your message (Enter sends)", description="You", style=style,
                              layout=W.Layout(width="95%"))
        self.send_button = W.Button(description="Send", button_style="primary", icon="paper-plane")
        self.reset_button = W.Button(description="Reset", tooltip="forget the conversation (the system prompt stays)")
        self.system = W.Textarea(value=system, description="System prompt", placeholder="optional", style=style,
                                 layout=W.Layout(width="95%", height="40px"))
        self.temperature = W.FloatSlider(value=0.8, min=0.0, max=2.0, step=0.05, description="Temperature",
                                         style=style, layout=wide)
        self.top_k = W.IntSlider(value=0, min=0, max=500, description="Top-k (0 = off)", style=style, layout=wide)
        self.max_tokens = W.IntSlider(value=200, min=1, max=2000, description="Max new tokens", style=style,
                                      layout=wide)
        self.seed = W.IntText(value=1337, description="Seed (-1 random)", style=style)
        self.status = W.HTML(value="")
        self.send_button.on_click(lambda _: self.send())
        with warnings.catch_warnings():  # ipywidgets 8 deprecates on_submit but keeps it; its replacement (observe
            warnings.simplefilter("ignore", DeprecationWarning)  # with continuous_update=False) also fires on blur
            self.message.on_submit(lambda _: self.send())
        self.reset_button.on_click(lambda _: self.reset())
        settings = W.VBox([self.system, self.temperature, self.top_k, self.max_tokens, self.seed])
        self.widget = W.VBox([self.transcript, self.message, W.HBox([self.send_button, self.reset_button, self.status]),
                              settings])

    def session(self) -> ChatSession:
        """The chat session, loading the checkpoint at the first call (a ChatError for a model without chat tokens)."""
        if self._session is None:
            self._session = ChatSession.from_run(self.run_dir, self.checkpoint, device=self.device,
                                                 compile=self.compile, log=self._notices.append)
        else:
            self._session.log = self._notices.append
        self._fit_max_tokens(self._session)
        return self._session

    def _fit_max_tokens(self, session: ChatSession) -> None:
        """The Max new tokens slider ends at the session's cap (half the context): asking for more would silently
        give less. ipywidgets (7.7.1 and 8) lowers a larger value to the new max; the status says so once."""
        cap = session.reply_cap
        if self.max_tokens.max <= cap:
            return
        asked = int(self.max_tokens.value)
        self.max_tokens.max = cap
        if asked > cap:
            self._notices.append(f"Max new tokens capped at {cap}: replies get at most half of the model's "
                                 f"{session.block_size}-token context")

    def sampling_config(self) -> SamplingConfig:
        return SamplingConfig(
            max_new_tokens=int(self.max_tokens.value), temperature=float(self.temperature.value),
            top_k=int(self.top_k.value) or None,
            seed=int(self.seed.value) if int(self.seed.value) >= 0 else None,  # same seed -> same reply
        ).validate()

    def send(self, text: str | None = None) -> str | None:
        """What Send does: the message (the box's, or `text`) and the streamed reply; the reply, None on an error."""
        text = self.message.value if text is None else text
        if not text.strip():
            self._show_status("type a message first", error=True)
            return None
        self.send_button.disabled = True
        self._notices.clear()
        self.turns.append(("user", text))
        try:
            self._show_status("loading checkpoint…" if self._session is None else "")
            session = self.session()  # first: it caps the Max new tokens slider that sampling_config reads
            cfg = self.sampling_config()
            session.system = self.system.value.strip() or None
            self.message.value = ""
            self._show_transcript(pending="")
            self._show_status("generating…")
            t0 = time.perf_counter()
            reply = session.reply(text, cfg, stream=self._streamer())
            dt = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - a button callback must show the problem, not a traceback in a log
            self.turns.pop()  # as the session does: a failed or interrupted reply leaves the conversation as it was
            self.message.value = text  # not lost: fix the settings and send again
            self._show_transcript()
            self._show_status(f"{type(e).__name__}: {e}" if isinstance(e, Exception) else "interrupted", error=True)
            if not isinstance(e, Exception):
                raise  # KeyboardInterrupt (the notebook's stop button) still stops the cell
            return None
        finally:
            self.send_button.disabled = False
        self.turns.append(("assistant", reply))
        self._show_transcript()
        ended = {"eot": "the end of its turn", "length": "max new tokens", "stop": "a stop string"}
        self._show_status(" · ".join([f"{session.reply_tokens} tokens in {dt:.1f} s, ended by "
                                      f"{ended.get(session.finish_reason, session.finish_reason)}", *self._notices]))
        return reply

    def _streamer(self):
        """A stream callback that redraws the transcript with the reply so far, at most ~20 times a second."""
        parts: list[str] = []
        last = [0.0]

        def on_piece(piece: str) -> None:
            parts.append(piece)
            now = time.perf_counter()
            if now - last[0] > 0.05:
                last[0] = now
                self._show_transcript(pending="".join(parts))

        return on_piece

    def reset(self) -> None:
        """What Reset does: forget the conversation (the model's history and everything shown of it)."""
        if self._session is not None:
            self._session.reset()
        self.turns = []
        self._show_transcript()
        self._show_status("history cleared")

    def _show_transcript(self, pending: str | None = None) -> None:
        turns = self.turns + ([("assistant", pending + "▌")] if pending is not None else [])
        colors = {"user": "#1a5fb4", "assistant": "#26a269"}
        pre = '<pre style="white-space:pre-wrap;margin:0;font-size:13px;line-height:1.35">'
        rows = [f'<div style="margin:4px 0"><b style="color:{colors.get(r, "#555")}">{r}</b>'
                f'{pre}{html.escape(c)}</pre></div>' for r, c in turns]
        self.transcript.value = "".join(rows)

    def _show_status(self, msg: str, error: bool = False) -> None:
        color = "#b00020" if error else "#555"
        self.status.value = f'<span style="color:{color}">{html.escape(msg)}</span>'

    def _repr_mimebundle_(self, **kwargs) -> dict:
        """display(box): the widget (the bundle ipywidgets 7.7.1 and 8 give a widget), and for a front end that
        cannot draw widgets the conversation as text in its place."""
        names = {"user": "you", "assistant": "model"}
        text = "\n".join(f"{names.get(r, r)}: {c}" for r, c in self.turns) or "(chat: no messages yet)"
        return {"text/plain": text, "application/vnd.jupyter.widget-view+json": {
            "version_major": 2, "version_minor": 0, "model_id": self.widget.model_id}}


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
