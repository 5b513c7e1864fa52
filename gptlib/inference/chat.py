"""Chat with a chat-tuned run. Prompt and reply must fit in block_size tokens (past it the model would silently lose
the system prompt first), so before each reply, said through `log`: (1) max_new_tokens is capped at block_size // 2;
(2) the oldest (user, assistant) pairs are dropped; (3) a newest message too long alone is cut to its tail."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import hashlib
import sys
from typing import Callable

from gptlib.data.conversations import CHAT_TOKENS, ChatTemplate
from gptlib.errors import ChatError, GptlibError, loud
from gptlib.inference.engine import Engine, SamplingConfig


class ChatSession:
    def __init__(
        self, engine: Engine, system: str | None = None, log: Callable[[str], None] = loud
    ):
        tok, where = engine.tokenizer, engine.source or "this model"
        try:
            self.template = ChatTemplate(tok)
        except ChatError:
            kind = getattr(tok, "kind", "")
            never = f"{where}: its {kind} tokenizer has no chat tokens ({', '.join(CHAT_TOKENS)}), so it was never "
            # no chat tokens can be added to it (tokenize --format chat refuses it)
            if kind == "char":
                fix = "a char-level model cannot learn to chat: fine-tune a BPE run or GPT-2 (notebook 05)"
            else:
                fix = (
                    "fine-tune it on conversations first (notebook 05, or: python -m gptlib tokenize --input "
                    "chats.jsonl --format chat --tokenizer-from RUN_DIR --out DATA_DIR, then python -m gptlib train "
                    "--data DATA_DIR --init-from RUN_DIR --preset finetune --run-dir CHAT_RUN_DIR)"
                )
            raise ChatError(f"{never}fine-tuned on conversations; {fix}") from None
        template = self.template
        self.stop_ids = sorted({template.end_id, template.eot_id, *template.role_ids.values()})
        self.engine, self.system, self.log = engine, system or None, log
        self.block_size = engine.model.config.block_size
        self.reply_cap = max(1, self.block_size // 2)  # rule (1)
        self.history: list[tuple[str, str]] = []
        # of the last reply: "eot" (a chat token), "length" or "stop" (a stop string)
        self.finish_reason = ""
        # tokens the model generated for the last reply (the final chat token included)
        self.reply_tokens = 0
        self._capped_said = False

    @classmethod
    def from_run(
        cls,
        run_dir,
        checkpoint: str | int = "latest",
        device: str = "cpu",
        system: str | None = None,
        log: Callable[[str], None] = loud,
    ) -> "ChatSession":
        return cls(Engine.from_run(run_dir, checkpoint, device=device), system=system, log=log)

    def reset(self) -> None:  # the system prompt stays
        self.history = []

    def reply(
        self,
        text: str,
        sampling: SamplingConfig | None = None,
        stream: Callable[[str], None] | None = None,
    ) -> str:
        """stream(piece) receives the reply's text as it is generated."""
        if not isinstance(text, str):
            raise ChatError(f"a message must be a string, not a {type(text).__name__}")
        # text that is not valid Unicode: the tokenizer's error at a position in the message, not in the template
        self.engine.tokenizer.encode(text)
        # a copy: the cap must not leak out
        cfg = dataclasses.replace(sampling or SamplingConfig()).validate()
        if cfg.max_new_tokens > self.reply_cap and not self._capped_said:
            self.log(
                f"max_new_tokens={cfg.max_new_tokens} would leave too little of the {self.block_size}-token "
                f"context for the conversation: replies are cut at {self.reply_cap} tokens"
            )
            self._capped_said = True
        cfg.max_new_tokens = min(cfg.max_new_tokens, self.reply_cap)
        self.finish_reason, before = "", list(self.history)
        self.history.append(("user", text))
        # the template's newline and a model's space before the answer are not part of it
        started = False

        def shown(_: int, piece: str) -> None:
            nonlocal started
            if not started:
                piece = piece.lstrip()
                started = bool(piece)
            if piece and stream is not None:
                stream(piece)

        try:
            prompt = self.prompt_ids(cfg.max_new_tokens)
            if cfg.seed is not None:
                # One seed for every reply gave each the same random draws: from a small model, the same first
                # words whatever the message. The same conversation and seed still give the same reply.
                digest = hashlib.sha256(f"{cfg.seed} {prompt}".encode()).digest()
                cfg.seed = int.from_bytes(digest[:8], "big") >> 1
            texts, out, reasons = self.engine.generate_text([prompt], cfg, self.stop_ids, shown)
        except BaseException:
            self.history = before  # a failed or interrupted reply leaves the conversation as it was
            raise
        self.finish_reason, self.reply_tokens = reasons[0], len(out[0])
        self.history.append(("assistant", texts[0].lstrip()))
        return self.history[-1][1]

    def render(self, turns: list[tuple[str, str]]) -> list[int]:
        head = [("system", self.system)] if self.system else []
        messages = [{"role": r, "content": c} for r, c in head + turns]
        ids = self.template.render(messages, require_assistant=False, generation_prompt=True)[0]
        return ids.tolist()

    def prompt_ids(self, max_new_tokens: int) -> list[int]:
        """The prompt for the next reply (the history ends with the user's message): rules (2) and (3)."""
        room, dropped = self.block_size - max_new_tokens, 0
        # One render per dropped pair: fine for a history that fits in a context window plus one message.
        while len(ids := self.render(self.history)) > room and len(self.history) > 1:
            del self.history[:2]
            dropped += 2
        if dropped:
            self.log(
                f"the {dropped} oldest turns were dropped to fit the {self.block_size}-token context"
            )
        if len(ids) <= room:
            return ids
        # rule (3): the longest tail of the newest message that fits (binary search)
        text = self.history[-1][1]
        lengths = range(len(text) + 1)
        n = bisect.bisect_left(lengths, True, key=lambda n: len(self._tail(text, n)) > room) - 1
        if n < 0:
            raise ChatError(
                f"the system prompt leaves no room for a message: it and max_new_tokens do not fit in "
                f"the model's {self.block_size}-token context; shorten the system prompt or "
                f"max_new_tokens"
            )
        self.log(
            f"the message is too long for the {self.block_size}-token context: only its last {n:,} of "
            f"{len(text):,} characters were given to the model"
        )
        return self._tail(text, n)

    def _tail(self, text: str, n: int) -> list[int]:
        return self.render([("user", text[len(text) - n :])])


HELP = "/reset clears the history, /quit (or Ctrl-D, Ctrl-C) ends"


def chat_loop(session: ChatSession, cfg: SamplingConfig) -> int:
    """The terminal chat until /quit, end of input or Ctrl-C; an error in a reply is shown and the chat goes on."""
    note = functools.partial(print, file=sys.stderr, flush=True)
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):  # not on every platform (Windows)
            import readline  # noqa: F401 - line editing and history for input() at a terminal
    # bytes that are not UTF-8 reach the tokenizer's one-line error and the next prompt, not a decode error's exit
    with contextlib.suppress(AttributeError):  # a stdin replaced by one without reconfigure
        sys.stdin.reconfigure(errors="surrogateescape")
    note(f"# chatting with {session.engine.source} (step {session.engine.step}); {HELP}")
    try:
        while True:
            line = input("you> ")
            cmd = line.strip()
            if cmd in ("/quit", "/exit"):
                return 0
            if cmd == "/reset":
                session.reset()
                note("# history cleared")
            elif cmd == "/help":
                note(f"# {HELP}")
            elif cmd:
                print("assistant> ", end="", flush=True)
                try:
                    session.reply(line, cfg, stream=lambda piece: print(piece, end="", flush=True))
                except GptlibError as e:
                    note(f"\nerror: {e}")
                print(flush=True)
                if session.finish_reason == "length":
                    note("# (the reply reached max_new_tokens and was cut)")
    except (EOFError, KeyboardInterrupt):  # end of input, Ctrl-D, Ctrl-C
        print()
        return 0
