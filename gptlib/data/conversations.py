"""The chat template (version 1), shared by tokenize --format chat, fine-tuning and chat (docs/data.md):

    <|user|>\\nHi!<|end|>\\n<|assistant|>\\nHello.<|end|>\\n<|endoftext|>

the markers inserted by id, never matched in text. An assistant turn's loss span is its text and its <|end|>."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from gptlib.errors import ChatError

TEMPLATE_VERSION = 1
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END = "<|end|>"
CHAT_TOKENS = (*ROLE_TOKENS.values(), END)
_MESSAGES_ROLES = {r: r for r in ROLE_TOKENS}
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
EXAMPLES_KEPT = 5  # malformed conversations shown (and kept in meta.json)


@dataclass
class Malformed:  # a value, not an exception: the readers pass it along to be counted
    reason: str


def normalize(value: Any, require_assistant: bool = True) -> list[tuple[str, str]] | Malformed:
    """`messages` ({role, content}) or ShareGPT `conversations` ({from, value}) -> [(role, content)]."""
    if isinstance(value, Malformed):
        return value
    if not isinstance(value, (list, tuple)):
        return Malformed(f"a {type(value).__name__}, not a list of messages")
    if not value:
        return Malformed("no messages")
    turns = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return Malformed(f"message {i} is a {type(m).__name__}, not an object")
        if "role" in m or "content" in m:
            role, content, names, key = m.get("role"), m.get("content"), _MESSAGES_ROLES, "role"
        elif "from" in m or "value" in m:
            role, content, names, key = m.get("from"), m.get("value"), _SHAREGPT_ROLES, "from"
        else:
            keys = ", ".join(map(str, m))[:80]
            return Malformed(f"message {i} has neither role/content nor from/value (keys: {keys})")
        if not isinstance(role, str) or role.lower() not in names:
            return Malformed(f"message {i}: unknown {key} {role!r} (known: {', '.join(names)})")
        if not isinstance(content, str):
            return Malformed(f"message {i}: content is {type(content).__name__}, not a string")
        turns.append((names[role.lower()], content))
    if require_assistant and not any(r == "assistant" for r, _ in turns):
        return Malformed("no assistant turn")
    return turns


class ChatTemplate:
    def __init__(self, tok):
        self.tok, self.eot_id = tok, tok.eot_id
        # special (added) tokens of a BPE tokenizer
        self.ids = {t: tok.token_id(t) for t in CHAT_TOKENS}
        for t, i in self.ids.items():
            if i is None:
                raise ChatError(
                    f"the tokenizer has no {t} token: chat data needs a BPE tokenizer with the chat "
                    f"tokens (tokenize --format chat adds them)"
                )
        self.role_ids = {role: self.ids[t] for role, t in ROLE_TOKENS.items()}
        self.end_id = self.ids[END]
        self.nl_ids = list(tok.encode("\n"))

    def piece_ids(
        self, piece, content_ids: Sequence[int]
    ) -> tuple[list[int], tuple[int, int] | None]:
        """(ids: the marker, content, <|end|> and newline as its place in the turn requires; its loss span or None)."""
        head = [self.role_ids[piece.role]] if piece.turn_start else []
        tail = [self.end_id, *self.nl_ids] if piece.turn_end else []
        # the span ends after <|end|>
        end = len(head) + len(content_ids) + (1 if piece.turn_end else 0)
        span = (len(head), end) if piece.role == "assistant" and end > len(head) else None
        return [*head, *content_ids, *tail], span

    def render(
        self, messages: Any, *, require_assistant: bool = True, generation_prompt: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """(ids, assistant spans (N, 2)) as tokenize renders it (which encodes a turn over PIECE_CHARS characters in
        pieces); generation_prompt: end with <|assistant|>."""
        turns = normalize(messages, require_assistant=require_assistant)
        if isinstance(turns, Malformed):
            raise ChatError(f"cannot render this conversation: {turns.reason}")
        ids: list[int] = []
        spans = []
        for role, content in turns:
            start = len(ids) + 1
            ids += [self.role_ids[role], *self.tok.encode("\n" + content), self.end_id]
            if role == "assistant":
                spans.append((start, len(ids)))
            ids += self.nl_ids
        ids.append(self.role_ids["assistant"] if generation_prompt else self.eot_id)
        return np.array(ids, dtype=np.int64), np.array(spans, dtype=np.int64).reshape(-1, 2)

    def meta(self) -> dict[str, Any]:
        return {
            "template_version": TEMPLATE_VERSION,
            "tokens": {t: int(i) for t, i in self.ids.items()},
            "eot_id": int(self.eot_id),
            "newline_ids": [int(i) for i in self.nl_ids],
        }


def first_prompts(
    ids: np.ndarray, spans: np.ndarray, eot_id: int, k: int, max_len: int
) -> list[np.ndarray]:
    """The prompts of the first answers of the first k conversations (the samples shown while fine-tuning): from the
    conversation's start through the <|assistant|> before the answer, its last max_len tokens."""
    prompts: dict[int, np.ndarray] = {}  # conversation start -> the prompt of its first answer
    for start, _ in spans:
        # the answer's first token: the <|assistant|> marker is the one before it
        start = int(start)
        if len(prompts) == k or start > len(ids):
            break
        eots = np.flatnonzero(ids[:start] == eot_id)
        begin = int(eots[-1]) + 1 if len(eots) else 0
        prompts.setdefault(begin, ids[max(begin, start - max_len) : start])
    return list(prompts.values())
