"""Notebook 05's chat box over gptlib.inference.chat; box.send("Hi!") does what Send does, headless."""

from __future__ import annotations

import html
import time
import warnings
from pathlib import Path

from gptlib.inference.chat import ChatSession
from gptlib.widgets import sampling_config, sampling_widgets, status_html, throttled


class ChatBox:
    """The transcript shows every turn; the model sees those that fit its context (the status says so)."""

    def __init__(self, run_dir: str | Path, checkpoint: str | int = "latest", device: str = "cpu", system: str = ""):
        import ipywidgets as W

        self.run_dir, self.checkpoint, self.device = run_dir, checkpoint, device
        self._session: ChatSession | None = None
        self.turns: list[tuple[str, str]] = []  # the whole transcript, as shown
        self._notices: list[str] = []  # the session's notices during the last send (context cut, ...)
        style = {"description_width": "110px"}
        self.transcript, self.status = W.HTML(value=""), W.HTML(value="")
        # One line: ipywidgets' Text sends on Enter with or without Shift (7.7.1 and 8 check only the key), and a
        # Textarea, where Enter adds a line, has no submit event; telling them apart would need our own JavaScript.
        self.message = W.Text(value="", placeholder="your message, one line (Enter sends)", description="You",
                              style=style, layout=W.Layout(width="95%"))
        self.send_button = W.Button(description="Send", button_style="primary", icon="paper-plane")
        self.reset_button = W.Button(description="Reset", tooltip="forget the conversation (the system prompt stays)")
        self.system = W.Textarea(value=system, description="System prompt", placeholder="optional", style=style,
                                 layout=W.Layout(width="95%", height="40px"))
        sampling_widgets(self, "Max new tokens")
        self.send_button.on_click(lambda _: self.send())
        with warnings.catch_warnings():  # ipywidgets 8 deprecates on_submit but keeps it; its replacement (observe
            warnings.simplefilter("ignore", DeprecationWarning)  # with continuous_update=False) also fires on blur
            self.message.on_submit(lambda _: self.send())
        self.reset_button.on_click(lambda _: self.reset())
        self.widget = W.VBox([self.transcript, self.message, W.HBox([self.send_button, self.reset_button, self.status]),
                              self.system, self.temperature, self.top_k, self.max_tokens, self.seed])

    def session(self) -> ChatSession:
        """Loaded at the first call. The Max new tokens slider then ends at the reply cap (half the context): asking
        for more would silently give less; ipywidgets lowers a larger value to the new max, and the status says so."""
        if self._session is None:
            self._session = ChatSession.from_run(self.run_dir, self.checkpoint, device=self.device,
                                                 log=self._notices.append)  # the list send() clears, not a copy
        cap = self._session.reply_cap
        if self.max_tokens.value > cap:
            self._notices.append(f"Max new tokens capped at {cap}: replies get at most half of the model's "
                                 f"{self._session.block_size}-token context")
        self.max_tokens.max = min(self.max_tokens.max, cap)
        return self._session

    def send(self, text: str | None = None) -> str | None:
        """What Send does with the box's message (or `text`): the reply, None on an error."""
        text = self.message.value if text is None else text
        if not text.strip():
            self.status.value = status_html("type a message first", error=True)
            return None
        # While the reply streams this callback holds the kernel, and the front end would deliver a second Enter
        # before the keystrokes it holds back (a message sent as its first letter): nothing can be typed until it ends.
        self.send_button.disabled = self.message.disabled = True
        self.message.value = ""
        self._notices.clear()
        self.turns.append(("user", text))
        try:
            self.status.value = status_html("loading checkpoint…" if self._session is None else "")
            session = self.session()  # first: it caps the Max new tokens slider that sampling_config reads
            cfg = sampling_config(self)
            session.system = self.system.value.strip() or None
            self._show_transcript(pending="")
            self.status.value = status_html("generating…")
            t0 = time.perf_counter()
            reply = session.reply(text, cfg, stream=throttled(lambda t: self._show_transcript(pending=t))[1])
            dt = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - a button callback must show the problem, not a traceback in a log
            self.turns.pop()  # as the session does: a failed or interrupted reply leaves the conversation as it was
            self.message.value = text  # not lost: fix the settings and send again
            self._show_transcript()
            self.status.value = status_html(f"{type(e).__name__}: {e}" if isinstance(e, Exception) else "interrupted",
                                            error=True)
            if not isinstance(e, Exception):
                raise  # KeyboardInterrupt (the notebook's stop button) still stops the cell
            return None
        finally:
            self.send_button.disabled = self.message.disabled = False
        self.turns.append(("assistant", reply))
        self._show_transcript()
        ended = {"eot": "the end of its turn", "length": "max new tokens", "stop": "a stop string"}
        why = ended.get(session.finish_reason, session.finish_reason)
        self.status.value = status_html(" · ".join([f"{session.reply_tokens} tokens in {dt:.1f} s, ended by {why}",
                                                    *self._notices]))
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
        self.transcript.value = "".join(f'<div style="margin:4px 0"><b style="color:{colors.get(r, "#555")}">{r}</b>'
                                        f'{pre}{html.escape(c)}</pre></div>' for r, c in turns)

    def _repr_mimebundle_(self, **kwargs) -> dict:  # the widget, or where a front end cannot draw one, the text
        names = {"user": "you", "assistant": "model"}
        text = "\n".join(f"{names.get(r, r)}: {c}" for r, c in self.turns) or "(chat: no messages yet)"
        return {"text/plain": text, "application/vnd.jupyter.widget-view+json": {
            "version_major": 2, "version_minor": 0, "model_id": self.widget.model_id}}
