"""The notebooks' views: the generation Playground and notebook 05's chat box (box.send("Hi!") does what Send does,
headless), with widgets and calls that ipywidgets 7.7.1 (Colab's) and 8 both have."""

from __future__ import annotations

import html
import re
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import anywidget
import traitlets

from gptlib.errors import in_notebook
from gptlib.inference.chat import ChatSession
from gptlib.inference.engine import Completion, Engine, SamplingConfig
from gptlib.inference.loading import checkpoint_label, checkpoint_table

LABELS = {"description_width": "110px"}  # every view's labels: one column
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def enable_colab_widgets() -> bool:
    """On Colab, ipywidgets 8 needs the custom widget manager. Colab draws ipywidgets 7 itself, and the custom manager
    (from a CDN, taking over every later widget) broke Colab's tqdm bars in 2022: left off there."""
    if "google.colab" not in sys.modules:
        return False
    import ipywidgets

    if int(ipywidgets.__version__.split(".")[0]) < 8:
        return False
    try:  # a Colab build without it: the widgets still draw, only ipywidgets 8's own manager is missing
        from google.colab import output  # type: ignore

        output.enable_custom_widget_manager()
    except (ImportError, AttributeError):
        return False
    return True


def parse_list(text: str) -> list[str]:
    r"""A Colab form string -> items: "ROMEO:|JULIET:|\n" -> ["ROMEO:", "JULIET:", "\n"] (\n means newline)."""
    return [s.replace("\\n", "\n") for s in text.split("|") if s != ""]


def status_html(msg: str, error: bool = False) -> str:
    return f'<span style="color:{"#b00020" if error else "#555"}">{html.escape(msg)}</span>'


def tokens_in(n: int, dt: float) -> str:
    """ "12 tokens in 41.3 ms": a fast reply's "in 0.0 s" said nothing true."""
    took = f"{dt:.1f} s" if dt >= 1 else f"{dt * 1000:.1f} ms"
    return f"{n:,} token{'' if n == 1 else 's'} in {took}"


def throttled(draw: Callable[[str], None]) -> tuple[list[str], Callable[[str], None]]:
    """(pieces, a stream callback adding to them): redrawn <= 20 times a second, not per token (a flood)."""
    parts, last = [], [0.0]

    def add(piece: str) -> None:
        parts.append(piece)
        if time.perf_counter() - last[0] > 0.05:
            last[0] = time.perf_counter()
            draw("".join(parts))

    return parts, add


def sampling_widgets(view, max_label: str) -> None:
    """The sliders every view has: view.temperature, view.top_k, view.max_tokens, view.seed."""
    import ipywidgets as W

    wide = {"style": LABELS, "layout": W.Layout(width="95%")}
    view.temperature = W.FloatSlider(
        value=0.8, min=0.0, max=2.0, step=0.05, description="Temperature", **wide
    )
    view.top_k = W.IntSlider(value=0, min=0, max=500, description="Top-k (0 = off)", **wide)
    view.max_tokens = W.IntSlider(value=200, min=1, max=2000, description=max_label, **wide)
    # "initial": the label takes the width it needs (a fixed 110px cut "Seed (-1 random)"); works in 7.7.1 and 8
    view.seed = W.IntText(
        value=1337,
        description="Seed (-1 random)",
        style={"description_width": "initial"},
        layout=W.Layout(width="260px"),
    )


def sampling_config(view, **more) -> SamplingConfig:  # seed -1 is random
    seed = int(view.seed.value)
    return SamplingConfig(
        max_new_tokens=int(view.max_tokens.value),
        temperature=float(view.temperature.value),
        top_k=int(view.top_k.value) or None,
        seed=seed if seed >= 0 else None,
        **more,
    ).validate()


class _Stopped(Exception):
    """Raised by the Playground's stream callback after Stop: ends the generation there."""


class GenerationInterrupted(KeyboardInterrupt):
    """The kernel's interrupt ended Playground.generate(). Still a KeyboardInterrupt, so the cell and a run of all
    cells stop there, but IPython shows it as its one line: a traceback through the model would say nothing more."""

    # IPython's hook for an exception that renders itself
    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class Playground:
    """Stop sets a flag the stream callback checks per token. A widget callback holds back every other message (the
    Stop click too) until it returns, so in a kernel Generate runs on a thread; generate() from a cell cannot stop."""

    # the one made last: an earlier one (its cell re-run) frees its model
    latest: Playground | None = None

    def __init__(self, run_dir: str | Path, device: str = "cpu", prompt: str = "ROMEO:"):
        import ipywidgets as W

        # ipywidgets keeps every widget, and through its callbacks the object, until the kernel ends: a cell re-run
        # would keep one more model (on the GPU) each time. The earlier one loads its model again if used.
        if Playground.latest is not None:
            Playground.latest._engine = None
        Playground.latest = self
        self.run_dir, self.device = Path(run_dir), device
        self._engine: Engine | None = None  # the last checkpoint loaded
        self.prompt = W.Textarea(
            value=prompt,
            description="Prompt",
            layout=W.Layout(width="95%", height="80px"),
            style=LABELS,
        )
        self.checkpoint = W.Dropdown(
            description="Checkpoint", style=LABELS, layout=W.Layout(width="60%")
        )
        self.refresh_button = W.Button(
            description="↻",
            tooltip="re-scan the run directory for new checkpoints",
            layout=W.Layout(width="40px"),
        )
        sampling_widgets(self, "Max tokens")
        wide = {"style": LABELS, "layout": W.Layout(width="95%")}
        self.top_p = W.FloatSlider(
            value=0.95, min=0.05, max=1.0, step=0.01, description="Top-p", **wide
        )
        self.repetition_penalty = W.FloatSlider(
            value=1.0, min=1.0, max=2.0, step=0.05, description="Rep. penalty", **wide
        )
        self.stop = W.Text(
            value="",
            description="Stop at",
            placeholder=r"\n\n  (| separates)",
            style=LABELS,
            layout=W.Layout(width="60%"),
        )
        # never squeezed by a long status (it read "Gene…")
        fixed = W.Layout(min_width="120px", flex="0 0 auto")
        self.button = W.Button(
            description="Generate", button_style="primary", icon="play", layout=fixed
        )
        self.stop_button = W.Button(
            description="Stop",
            icon="stop",
            disabled=True,
            tooltip="end it at the next token",
            layout=fixed,
        )
        self.status, self.output = W.HTML(value=""), W.HTML(value="")
        # set by Stop, read by the stream callback (another thread in a kernel)
        self._stop = threading.Event()
        # one generation at a time (the button's thread, or a cell's call)
        self._busy = threading.Lock()
        # starts on submit
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gptlib-playground")
        self._job: Future | None = None  # the button's last generation
        self.button.on_click(lambda _: self._generate_clicked())
        self.stop_button.on_click(lambda _: self._stop.set())
        self.refresh_button.on_click(lambda _: self.refresh())
        # status: full width
        self.widget = W.VBox(
            [
                self.prompt,
                W.HBox([self.checkpoint, self.refresh_button]),
                self.temperature,
                self.top_k,
                self.top_p,
                self.repetition_penalty,
                self.max_tokens,
                W.HBox([self.seed, self.stop]),
                W.HBox([self.button, self.stop_button]),
                self.status,
                self.output,
            ]
        )
        self.refresh()

    def refresh(self) -> None:  # training may have saved new checkpoints
        skipped: list[str] = []  # the checkpoints passed over, and why (a hung Drive, say)
        rows, keep = checkpoint_table(self.run_dir, skipped), self.checkpoint.value
        self.checkpoint.options = [(checkpoint_label(r), r["step"]) for r in rows]
        if rows:
            self.checkpoint.value = keep if keep in [r["step"] for r in rows] else rows[0]["step"]
            self.status.value = status_html(f"{len(rows)} checkpoint{'s' * (len(rows) > 1)} found")
        else:
            why = f" ({'; '.join(skipped)})" if skipped else ""
            msg = f"no complete checkpoint in {self.run_dir}{why}"
            self.status.value = status_html(msg, error=True)

    def _show_text(self, prompt: str, text: str) -> None:
        self.output.value = (
            '<pre style="white-space:pre-wrap;font-size:13px;line-height:1.35">'
            f"<b>{html.escape(prompt)}</b>{html.escape(text)}</pre>"
        )

    # in a kernel on the Playground's thread (see the class docstring), so a Stop click can arrive
    def _generate_clicked(self) -> None:
        if in_notebook():
            self._job = self._worker.submit(self._run, stoppable=True)
        else:
            self._run(stoppable=True)

    def generate(self) -> Completion | None:
        """One sample with the current settings, from code; None on an error (status_text says it)."""
        return self._run(stoppable=False)

    @property
    def status_text(self) -> str:
        """The status line without its markup: what a cell prints."""
        return html.unescape(re.sub(r"<[^>]+>", "", self.status.value))

    # stoppable: by the button, so a Stop click can arrive
    def _run(self, stoppable: bool) -> Completion | None:
        if self.checkpoint.value is None:
            self.refresh()
            if self.checkpoint.value is None:
                return None
        if not self._busy.acquire(blocking=False):
            self.status.value = status_html("already generating: press Stop first", error=True)
            return None
        self._stop.clear()  # a click of an earlier generation does not stop this one
        self.button.disabled, self.stop_button.disabled = True, not stoppable
        prompt = self.prompt.value
        parts, add = throttled(lambda text: self._show_text(prompt, text))

        def on_piece(_: int, piece: str) -> None:
            add(piece)
            if self._stop.is_set():
                raise _Stopped

        try:
            cfg = sampling_config(
                self,
                top_p=float(self.top_p.value),
                stop=parse_list(self.stop.value),
                repetition_penalty=float(self.repetition_penalty.value),
            )
            eng = self._engine_for(self.checkpoint.value)
            ending = "(Stop ends it)" if stoppable else "(from code: interrupt the cell to end it)"
            self.status.value = status_html(f"generating… {ending}")
            t0 = time.perf_counter()
            try:
                res = eng.generate(prompt, cfg, stream=on_piece)[0]
            except _Stopped:
                # what was shown; its tokens are what the model generated (re-encoded)
                text = "".join(parts)
                ids = eng.tokenizer.encode(text)
                res = Completion(prompt=prompt, text=text, token_ids=ids, finish_reason="user")
            dt = time.perf_counter() - t0
        except KeyboardInterrupt:
            raise self._interrupted(prompt, "".join(parts)) from None
        except Exception as e:  # noqa: BLE001 - a button callback must show the problem, not swallow it in a log
            self.output.value = ""  # the previous text must not look like this prompt's result
            self.status.value = status_html(f"{type(e).__name__}: {e}", error=True)
            return None
        finally:
            self.button.disabled, self.stop_button.disabled = False, True
            self._busy.release()
        self._show_text(prompt, res.text)
        n = len(res.token_ids)
        speed = f"{tokens_in(n, dt)} ({n / max(dt, 1e-9):.0f} tokens/s)"
        if res.finish_reason == "user":
            how = f"stopped after {speed}: Stop pressed"
        else:
            how = f"{speed}, stopped by {res.finish_reason}"
        self.status.value = status_html(f"step {eng.step:,}: {how}")
        return res

    def _engine_for(self, step: int) -> Engine:
        """The engine of the chosen checkpoint, loaded when the choice changed."""
        if self._engine is None or self._engine.step != step:
            self.status.value = status_html("loading checkpoint…")
            self._engine = None  # freed before the next one loads
            self._engine = Engine.from_run(self.run_dir, step, device=self.device)
        return self._engine

    def _interrupted(self, prompt: str, text: str) -> GenerationInterrupted:
        """The kernel's interrupt: the text so far stays, and the caller stops as it should."""
        self._show_text(prompt, text)
        # counted as Stop counts: re-encoded
        n = len(self._engine.tokenizer.encode(text)) if text else 0
        self.status.value = status_html(f"interrupted after {n:,} tokens")
        msg = f"after {n:,} tokens; the text so far stays in the playground above"
        return GenerationInterrupted(msg)


class MessageBox(anywidget.AnyWidget):
    """The chat's message line, drawn by message_box.js in the browser; it sends {"text": ...} at Enter or Send.

    With ipywidgets' Text the kernel took the text and emptied the box, a box the browser was still typing into: a key
    typed ~20 ms after Enter was lost or glued to the message before, and a click on Send took the focus. Only code in
    the browser can take the text and empty the box in one step. anywidget runs a plain ES module there: Colab ships
    it, and classic Notebook, JupyterLab and VS Code load it. A DOMWidget of our own would need its JavaScript
    registered with each front end's loader, and Colab loads a widget's JavaScript only from npm (through a CDN)."""

    _esm = (Path(__file__).parent / "message_box.js").read_text()
    placeholder = traitlets.Unicode("").tag(sync=True)


def colab_drawn(make: Callable[[], MessageBox]) -> tuple[MessageBox, dict]:
    """make()'s widget, and the display metadata that has Colab draw an output with its custom widget manager.

    Colab draws ipywidgets' own widgets itself and an anywidget only through that manager (a CDN's). gptlib leaves
    it off (enable_colab_widgets), and anywidget turns it on for every later output at its first widget: the
    manager is left as it was, and only the output showing the chat asks for it, in its own metadata."""
    output = sys.modules.get("google.colab.output")
    # colabtools' record of the manager (anywidget reads it too)
    state = getattr(output, "_widgets", None)
    if state is None:
        return make(), {}
    was = state._installed_url
    output.enable_custom_widget_manager()
    try:
        widget, url = make(), state._installed_url
    finally:
        if was is None:
            output.disable_custom_widget_manager()
    return widget, {WIDGET_VIEW: {"colab": {"custom_widget_manager": {"url": url}}}}


class ChatBox:
    """The transcript shows every turn; the model sees those that fit its context (the status says so)."""

    # the one made last: an earlier one frees its model (as Playground's)
    latest: ChatBox | None = None

    def __init__(
        self,
        run_dir: str | Path,
        checkpoint: str | int = "latest",
        device: str = "cpu",
        system: str = "",
    ):
        import ipywidgets as W

        if ChatBox.latest is not None:
            ChatBox.latest._session = None
        ChatBox.latest = self
        self.run_dir, self.checkpoint, self.device = run_dir, checkpoint, device
        self._session: ChatSession | None = None
        self.turns: list[tuple[str, str]] = []  # the whole transcript, as shown
        # the session's notices during the last send (context cut, ...)
        self._notices: list[str] = []
        self.transcript, self.status = W.HTML(value=""), W.HTML(value="")
        # One line, never disabled (a disabled box loses the keyboard to the notebook's shortcuts)
        self.message, self._metadata = colab_drawn(
            lambda: MessageBox(
                placeholder="your message, one line (Enter sends)", layout=W.Layout(width="95%")
            )
        )
        self.message.on_msg(lambda _, content, __: self._received(content))
        self.reset_button = W.Button(
            description="Reset", tooltip="forget the conversation (the system prompt stays)"
        )
        self.system = W.Textarea(
            value=system,
            description="System prompt",
            placeholder="optional",
            style=LABELS,
            layout=W.Layout(width="95%", height="40px"),
        )
        sampling_widgets(self, "Max new tokens")
        self.reset_button.on_click(lambda _: self.reset())
        self.widget = W.VBox(
            [
                self.transcript,
                self.message,
                W.HBox([self.reset_button, self.status]),
                self.system,
                self.temperature,
                self.top_k,
                self.max_tokens,
                self.seed,
            ]
        )

    def session(self) -> ChatSession:
        """Loaded at the first call. The Max new tokens slider then ends at the reply cap (half the context): asking
        for more would silently give less; ipywidgets lowers a larger value to the new max, and the status says so."""
        if self._session is None:
            # the list send() clears, not a copy
            self._session = ChatSession.from_run(
                self.run_dir, self.checkpoint, device=self.device, log=self._notices.append
            )
            # loaded again (a newer ChatBox freed the model): the model sees the exchanges shown, not a blank history
            # (user and assistant alternate; a message being sent is not one yet)
            self._session.history = self.turns[: len(self.turns) // 2 * 2]
        cap = self._session.reply_cap
        if self.max_tokens.value > cap:
            size = self._session.block_size
            msg = f"Max new tokens capped at {cap}: replies get at most half of the model's {size}-token context"
            self._notices.append(msg)
        self.max_tokens.max = min(self.max_tokens.max, cap)
        return self._session

    def _received(self, content: dict) -> None:
        if isinstance(content.get("text"), str):
            self.send(content["text"])

    def send(self, text: str) -> str | None:
        """What Send does with a message: the reply, None on an error. While the reply is made, this holds the
        kernel: a message sent meanwhile waits in the kernel's queue and is the next turn."""
        if not text.strip():
            self.status.value = status_html("type a message first", error=True)
            return None
        self._notices.clear()
        self.turns.append(("user", text))
        try:
            self.status.value = status_html("loading checkpoint…" if self._session is None else "")
            # first: it caps the Max new tokens slider that sampling_config reads
            session = self.session()
            cfg = sampling_config(self)
            session.system = self.system.value.strip() or None
            self._show_transcript(pending="")
            self.status.value = status_html("generating…")
            _, stream = throttled(lambda t: self._show_transcript(pending=t))
            t0 = time.perf_counter()
            reply = session.reply(text, cfg, stream=stream)
            dt = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - a button callback must show the problem, not a traceback in a log
            self.turns.pop()  # as the session does: a failed or interrupted reply leaves the conversation as it was
            # not lost: back in the box (if it is empty), to send again once the settings are fixed
            self.message.send({"put_back": text})
            self._show_transcript()
            if not isinstance(e, Exception):
                self.status.value = status_html("interrupted", error=True)
                raise  # KeyboardInterrupt (the notebook's stop button) still stops the cell
            self.status.value = status_html(f"{type(e).__name__}: {e}", error=True)
            return None
        self.turns.append(("assistant", reply))
        self._show_transcript()
        ended = {"eot": "the end of its turn", "length": "max new tokens", "stop": "a stop string"}
        why = ended.get(session.finish_reason, session.finish_reason)
        summary = f"{tokens_in(session.reply_tokens, dt)}, ended by {why}"
        self.status.value = status_html(" · ".join([summary, *self._notices]))
        return reply

    def reset(self) -> None:  # what Reset does
        if self._session is not None:
            self._session.reset()
        self.turns = []
        self._show_transcript()
        self.status.value = status_html("history cleared")

    def _show_transcript(self, pending: str | None = None) -> None:
        turns = self.turns + ([("assistant", pending + "▌")] if pending is not None else [])
        colors = {"user": "#1a5fb4", "assistant": "#26a269"}
        pre = '<pre style="white-space:pre-wrap;margin:0;font-size:13px;line-height:1.35">'
        self.transcript.value = "".join(
            f'<div style="margin:4px 0"><b style="color:{colors.get(r, "#555")}">{r}</b>'
            f"{pre}{html.escape(c)}</pre></div>"
            for r, c in turns
        )

    # the widget, or where a front end cannot draw one, the text
    def _repr_mimebundle_(self, **kwargs) -> tuple[dict, dict]:
        names = {"user": "you", "assistant": "model"}
        text = "\n".join(f"{names.get(r, r)}: {c}" for r, c in self.turns)
        view = {"version_major": 2, "version_minor": 0, "model_id": self.widget.model_id}
        return {"text/plain": text or "(chat: no messages yet)", WIDGET_VIEW: view}, self._metadata
