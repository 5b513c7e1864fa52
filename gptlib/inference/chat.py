"""Talking to a chat-tuned run: the conversation's history, rendered with the chat template, answered by the Engine.

    chat = ChatSession.from_run("runs/chat", system="Be brief.")
    print(chat.reply("Hi!", SamplingConfig(temperature=0, max_new_tokens=100)))
    chat.reply("And then?", cfg, stream=lambda piece: print(piece, end="", flush=True))
    chat.reset()                                  # forget the conversation (the system prompt stays)

One reply: the user's message is appended to the history; the system prompt and the history are rendered by
`ChatTemplate.render(..., generation_prompt=True)` (gptlib/data/conversations.py), so the prompt ends with <|assistant|>; the
model generates until it writes <|end|>. It also stops at <|endoftext|> or another role token (<|user|>,
<|system|>, <|assistant|>): none of them can be part of a reply, and a model that writes one has ended its turn
without saying so. max_new_tokens and stop strings end a reply too (it is then kept as cut). The "\\n" that the
template puts before every content is removed; the rest is the reply, appended to the history as the
assistant's turn and returned.

The context window (truncation policy). The prompt and the reply must fit in the model's block_size tokens
(past it the model would silently lose the start of the conversation, the system prompt first), so before
each reply:

1. max_new_tokens is capped at block_size // 2 (said once per session): a longer reply would leave too little
   room for the conversation it answers.
2. The oldest exchanges are dropped first, a whole (user, assistant) pair at a time, until the rendered prompt
   plus max_new_tokens fits in block_size, and a notice says how many. The system prompt is always kept.
   Dropped turns leave the history for good (`dropped_turns` counts them), so a forgotten turn never comes
   back when later turns are short.
3. If the newest user message alone (after the system prompt) still does not fit, only its end is given to
   the model: the longest tail of its text that fits (a question usually comes last), and a notice says how
   many characters were cut. The history keeps the whole message.
4. If the system prompt alone leaves no room for a message, that is a ChatError (shorten the system prompt or
   max_new_tokens).

Notices go through `log` (stderr on the command line, the status line in the widget). A run whose tokenizer
has no chat tokens (a char model, a base model never fine-tuned on conversations) is a ChatError saying how to
fine-tune it. `chat_loop` is the terminal chat of `python -m gptlib chat`.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable

from gptlib.data.conversations import CHAT_TOKENS, ChatTemplate
from gptlib.errors import ChatError, GptlibError, loud
from gptlib.inference.engine import Engine, _TextStream
from gptlib.inference.sampling import SamplingConfig

FINETUNE_HINT = ("fine-tune it on conversations first: python -m gptlib tokenize --input chats.jsonl --format chat "
                 "--tokenizer-from RUN_DIR --out DATA_DIR, then python -m gptlib train --data DATA_DIR --init-from "
                 "RUN_DIR --preset finetune --run-dir CHAT_RUN_DIR")


class ChatSession:
    """A conversation with one model: system prompt, history [(role, content)], replies within the context."""

    def __init__(self, engine: Engine, system: str | None = None, log: Callable[[str], None] = loud):
        tok = engine.tokenizer
        where = engine.source or "this model"
        if tok is None:
            raise ChatError(f"{where}: the engine has no tokenizer; load it with Engine.from_run or "
                            f"ChatSession.from_run")
        try:
            self.template = ChatTemplate(tok)
        except ChatError:
            raise ChatError(f"{where}: its {getattr(tok, 'kind', '')} tokenizer has no chat tokens "
                            f"({', '.join(CHAT_TOKENS)}), so it was never fine-tuned on conversations; "
                            f"{FINETUNE_HINT}") from None
        vocab = engine.model.config.vocab_size
        if max(self.template.role_ids.values()) >= vocab or self.template.end_id >= vocab:
            raise ChatError(f"{where}: the tokenizer's chat tokens lie beyond the model's vocabulary ({vocab}); "
                            f"{FINETUNE_HINT}")
        self.engine = engine
        self.system = system or None
        self.log = log
        self.block_size = engine.model.config.block_size
        # Every chat token and end-of-text ends a reply (see the module docstring).
        self.stop_ids = sorted({self.template.end_id, self.template.eot_id, *self.template.role_ids.values()})
        self.history: list[tuple[str, str]] = []
        self.dropped_turns = 0  # turns dropped from the front of the history to fit the context
        self.finish_reason = ""  # of the last reply: "eot" (a chat token), "length" or "stop" (a stop string)
        self.reply_tokens = 0  # tokens the model generated for the last reply (the final chat token included)
        self._capped_said = False

    @classmethod
    def from_run(cls, run_dir, checkpoint: str | int = "latest", device: str = "cpu", system: str | None = None,
                 compile: bool = False, log: Callable[[str], None] = loud) -> "ChatSession":
        """A session with a checkpoint of a run directory ("latest", "best" or a step; see gptlib.inference.loading)."""
        return cls(Engine.from_run(run_dir, checkpoint, device=device, compile=compile), system=system, log=log)

    def reset(self) -> None:
        """Forget the conversation; the system prompt stays."""
        self.history = []
        self.dropped_turns = 0

    def reply(self, text: str, sampling: SamplingConfig | None = None,
              stream: Callable[[str], None] | None = None) -> str:
        """Answer one user message; stream(piece) receives the reply's text as it is generated."""
        if not isinstance(text, str):
            raise ChatError(f"a message must be a string, not a {type(text).__name__}")
        cfg = dataclasses.replace(sampling or SamplingConfig()).validate()  # a copy: the cap must not leak out
        cfg.max_new_tokens = self.reply_budget(cfg.max_new_tokens)
        self.finish_reason = ""
        before = (list(self.history), self.dropped_turns)
        self.history.append(("user", text))
        try:
            ids = self.prompt_ids(cfg.max_new_tokens)
            answer = self._generate(ids, cfg, stream)
        except BaseException:
            self.history, self.dropped_turns = before  # a failed or interrupted reply leaves the conversation as it was
            raise
        self.history.append(("assistant", answer))
        return answer

    @property
    def reply_cap(self) -> int:
        """The most tokens a reply may have: half the context (rule 1)."""
        return max(1, self.block_size // 2)

    def reply_budget(self, max_new_tokens: int) -> int:
        """max_new_tokens, capped at half the context (rule 1)."""
        cap = self.reply_cap
        if max_new_tokens > cap:
            if not self._capped_said:
                self.log(f"max_new_tokens={max_new_tokens} would leave too little of the {self.block_size}-token "
                         f"context for the conversation: replies are cut at {cap} tokens")
                self._capped_said = True
            return cap
        return max_new_tokens

    def messages(self, turns: list[tuple[str, str]]) -> list[dict]:
        """The system prompt (if any) and `turns`, as the template's messages."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": r, "content": c} for r, c in turns]

    def render(self, turns: list[tuple[str, str]]) -> list[int]:
        """The generation prompt for the system prompt and `turns`: ChatTemplate.render, ending with <|assistant|>."""
        ids, _ = self.template.render(self.messages(turns), require_assistant=False, generation_prompt=True)
        return ids.tolist()

    def prompt_ids(self, max_new_tokens: int) -> list[int]:
        """The prompt for the next reply (the history ends with the user's message), within the context:
        drops the oldest pairs from the history (rule 2), or cuts the newest message (rule 3)."""
        room = self.block_size - max_new_tokens
        dropped = 0
        while True:
            ids = self.render(self.history)
            if len(ids) <= room or len(self.history) <= 1:
                break
            # One render per dropped pair: fine for a history that fits in a context window plus one message.
            del self.history[:2]
            dropped += 2
        if dropped:
            self.dropped_turns += dropped
            self.log(f"the {dropped} oldest turns were dropped to fit the {self.block_size}-token context")
        if len(ids) <= room:
            return ids
        return self._cut_message(self.history[-1][1], room)

    def _cut_message(self, text: str, room: int) -> list[int]:
        """The prompt with only the longest tail of `text` (the newest message) that fits in `room` tokens."""
        def fits(n: int) -> list[int] | None:
            ids = self.render([("user", text[len(text) - n:])])
            return ids if len(ids) <= room else None

        best = fits(0)
        if best is None:
            raise ChatError(f"the system prompt leaves no room for a message: it and max_new_tokens do not fit in "
                            f"the model's {self.block_size}-token context; shorten the system prompt or "
                            f"max_new_tokens")
        lo, hi = 0, len(text)  # fits(lo) holds, fits(hi) does not (we are here because the whole text did not fit)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            got = fits(mid)
            if got is None:
                hi = mid
            else:
                lo, best = mid, got
        self.log(f"the message is too long for the {self.block_size}-token context: only its last {lo:,} of "
                 f"{len(text):,} characters were given to the model")
        return best

    def _generate(self, ids: list[int], cfg: SamplingConfig, stream: Callable[[str], None] | None) -> str:
        """Generate after the prompt until a chat token; the reply's text without the template's leading newline."""
        st = _TextStream(self.engine.tokenizer, cfg.stop)
        shown = _LeadingNewlineDropped(stream)
        stop_ids = set(self.stop_ids)

        def on_step(rows: list[int], toks: list[int]) -> list[int]:
            final = toks[0] in stop_ids  # the engine ends the row there; its text is not part of the reply
            shown(st.push(toks[0], final=final))
            return [0] if st.stopped and not final else []

        out, reasons = self.engine.generate_ids([ids], cfg, stop_ids=self.stop_ids, on_step=on_step)
        shown(st.flush())
        self.finish_reason, self.reply_tokens = reasons[0], len(out[0])
        return st.text[1:] if st.text.startswith("\n") else st.text


class _LeadingNewlineDropped:
    """Passes text pieces on to a stream callback, without the first character if it is the template's "\\n"."""

    def __init__(self, stream: Callable[[str], None] | None):
        self.stream = stream
        self.started = False

    def __call__(self, piece: str) -> None:
        if not piece or self.stream is None:
            return
        if not self.started:
            self.started = True
            piece = piece[1:] if piece.startswith("\n") else piece
            if not piece:
                return
        self.stream(piece)


HELP = "/reset clears the history, /quit (or Ctrl-D, Ctrl-C) ends"


def chat_loop(session: ChatSession, cfg: SamplingConfig, read: Callable[[str], str] = input,
              out=None, err=None) -> int:
    """The terminal chat: read a message after "you> ", stream the reply, until /quit, end of input or Ctrl-C.
    A GptlibError in a reply is shown and the chat goes on; returns the exit status (0)."""
    out, err = out or sys.stdout, err or sys.stderr
    if read is input and sys.stdin.isatty():
        try:
            import readline  # noqa: F401 - line editing and history for input() at a terminal
        except ImportError:  # not on every platform (Windows)
            pass
    print(f"# chatting with {session.engine.source} (step {session.engine.step}); {HELP}", file=err, flush=True)
    try:
        while True:
            try:
                line = read("you> ")
            except EOFError:
                print(file=out)
                return 0
            cmd = line.strip()
            if not cmd:
                continue
            if cmd in ("/quit", "/exit"):
                return 0
            if cmd == "/reset":
                session.reset()
                print("# history cleared", file=err, flush=True)
                continue
            if cmd == "/help":
                print(f"# {HELP}", file=err, flush=True)
                continue
            print("assistant> ", end="", file=out, flush=True)
            try:
                session.reply(line, cfg, stream=lambda piece: print(piece, end="", file=out, flush=True))
            except GptlibError as e:
                print(f"\nerror: {e}", file=err, flush=True)
            print(file=out, flush=True)
            if session.finish_reason == "length":
                print("# (the reply reached max_new_tokens and was cut)", file=err, flush=True)
    except KeyboardInterrupt:
        print(file=out)
        return 0
