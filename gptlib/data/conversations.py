"""Conversations: the chat template (version 1), shared by tokenize --format chat, fine-tuning and chat.

A conversation is a list of messages, in either layout:

    {"role": "system" | "user" | "assistant", "content": "..."}        the common `messages` layout
    {"from": "system" | "human" | "user" | "gpt" | "assistant", "value": "..."}   ShareGPT `conversations`

It is rendered to token ids as, for each turn in order,

    ROLE  text("\\n" + content)  END  text("\\n")

where ROLE is one of the special tokens <|system|>, <|user|>, <|assistant|>, END is the special token
<|end|>, and text(s) is the BPE encoding of the string s (a content longer than pieces.PIECE_CHARS
characters is encoded in pieces cut before a newline or a space, exactly as documents are). The
conversation is followed by <|endoftext|>, as every document is. For example

    <|user|>\\nHi!<|end|>\\n<|assistant|>\\nHello.<|end|>\\n<|endoftext|>

The loss span of an assistant turn is [first token of text("\\n" + content), the token after its
END): its content and the END that teaches the model to stop; never the role marker, the "\\n" after
END, a user's or a system turn. To generate, a prompt is rendered the same way and ends with
<|assistant|>; the model writes "\\n" + its answer and stops at <|end|>.

The special tokens are inserted by id, never found by matching text: the BPE tokenizer encodes every
string with `encode_special_tokens=True`, so a message that contains the characters "<|user|>" or
"<|end|>" is ordinary text and can never forge a turn.

Malformed conversations are skipped and counted, with the first few reported: not a list, an empty
list, a message that is not an object, an unknown role (anything but the names above), a content that
is not a string, or no assistant turn at all.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from gptlib.data.pieces import Piece, split_text
from gptlib.errors import ChatError

TEMPLATE_VERSION = 1
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END = "<|end|>"
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
_MESSAGES_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
EXAMPLES_KEPT = 5  # malformed conversations shown (and kept in meta.json)


class Malformed:
    """Why a conversation is skipped (a value, not an exception: readers pass it along)."""

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return f"Malformed({self.reason!r})"


def normalize(value: Any, require_assistant: bool = True) -> list[tuple[str, str]] | Malformed:
    """A conversation in either layout -> [(role, content)], or Malformed(reason)."""
    if isinstance(value, Malformed):
        return value
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list):
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
            return Malformed(f"message {i} has neither role/content nor from/value (keys: {', '.join(map(str, m))[:80]})")
        if not isinstance(role, str) or role.lower() not in names:
            return Malformed(f"message {i}: unknown {key} {role!r} (known: {', '.join(names)})")
        if not isinstance(content, str):
            return Malformed(f"message {i}: content is {type(content).__name__}, not a string")
        turns.append((names[role.lower()], content))
    if require_assistant and not any(r == "assistant" for r, _ in turns):
        return Malformed("no assistant turn")
    return turns


def conversation_pieces(value: Any, fi: int, doc: int, turn: int, char: int, byte: int, byte_after: int,
                        nbytes: float, require_assistant: bool = True) -> Iterator:
    """One conversation (a jsonl record's field, a parquet row) as pieces from (turn, char) on: the text
    "\\n" + content of each turn, cut at PIECE_CHARS; each piece knows its role and whether it starts or
    ends its turn. A malformed conversation is one empty piece carrying the reason."""
    after = {"file": fi, "doc": doc + 1, "byte": byte_after, "char": 0, "turn": 0}
    turns = normalize(value, require_assistant)
    if isinstance(turns, Malformed):
        yield Piece("", doc, False, None, after, nbytes, malformed=turns.reason)
        return
    texts = ["\n" + content for _, content in turns]
    total = sum(map(len, texts))
    for t in range(turn, len(turns)):
        role, text = turns[t][0], texts[t]
        for piece, end in split_text(text, char if t == turn else 0):
            turn_end = end >= len(text)
            last = turn_end and t == len(turns) - 1
            nxt = after if last else ({"file": fi, "doc": doc, "byte": byte, "char": 0, "turn": t + 1} if turn_end
                                      else {"file": fi, "doc": doc, "byte": byte, "char": end, "turn": t})
            yield Piece(piece, doc, last, None, nxt, nbytes * len(piece) / total, role=role,
                        turn_start=end == len(piece), turn_end=turn_end)


class ChatTemplate:
    """The ids of the chat tokens in a tokenizer, and the rendering of pieces to ids + loss spans."""

    def __init__(self, tok):
        ids = chat_token_ids(tok)
        self.tok = tok
        self.role_ids = {role: ids[t] for role, t in ROLE_TOKENS.items()}
        self.end_id = ids[END]
        self.eot_id = tok.eot_id
        self.nl_ids = list(tok.encode("\n"))

    def piece_ids(self, piece, content_ids: Sequence[int]) -> tuple[list[int], tuple[int, int] | None]:
        """The ids of one piece (role marker, content, end marker and newline as its place in the turn
        requires) and its loss span (start, end) within them, for an assistant piece."""
        out: list[int] = [self.role_ids[piece.role]] if piece.turn_start else []
        start = len(out)
        out.extend(content_ids)
        if piece.turn_end:
            out.append(self.end_id)
        end = len(out)
        if piece.turn_end:
            out.extend(self.nl_ids)
        return out, ((start, end) if piece.role == "assistant" and end > start else None)

    def render(self, messages: Any, *, add_eot: bool = True, require_assistant: bool = True,
               generation_prompt: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """A conversation -> (ids int64, assistant spans (N, 2) int64), exactly as tokenize renders it.
        generation_prompt: end with <|assistant|> (no <|endoftext|>), for a model to answer."""
        turns = normalize(messages, require_assistant=require_assistant)
        if isinstance(turns, Malformed):
            raise ChatError(f"cannot render this conversation: {turns.reason}")
        value = [{"role": r, "content": c} for r, c in turns]
        pieces = list(conversation_pieces(value, 0, 0, 0, 0, 0, 0, 1.0, require_assistant=False))
        encoded = self.tok.encode_batch_ids([p.text for p in pieces]) if pieces else []
        ids: list[int] = []
        spans = []
        for p, x in zip(pieces, encoded):
            seq, span = self.piece_ids(p, x)
            if span is not None:
                s, e = len(ids) + span[0], len(ids) + span[1]
                if spans and spans[-1][1] == s:
                    spans[-1][1] = e  # one span per turn, however its content was cut
                else:
                    spans.append([s, e])
            ids.extend(seq)
        if generation_prompt:
            ids.append(self.role_ids["assistant"])
        elif add_eot:
            ids.append(self.eot_id)
        return np.array(ids, dtype=np.int64), np.array(spans, dtype=np.int64).reshape(-1, 2)

    def meta(self) -> dict[str, Any]:
        """What meta.json records of the template."""
        return {"template_version": TEMPLATE_VERSION, "tokens": {t: int(self.tok.token_id(t)) for t in CHAT_TOKENS},
                "eot_id": int(self.eot_id), "newline_ids": [int(i) for i in self.nl_ids]}


def first_prompts(ids: np.ndarray, spans: np.ndarray, eot_id: int, k: int, max_len: int) -> list[np.ndarray]:
    """The prompts of the first answers of the first k conversations in a tokenized chat stream (for the samples
    shown while fine-tuning): each from its conversation's start (after the previous <|endoftext|>) through the
    <|assistant|> marker before the answer, its last max_len tokens when longer. ids must reach the k-th span."""
    out, begins = [], set()
    for start, _ in spans:
        start = int(start)  # the answer's first token: the <|assistant|> marker is the one before it
        if len(out) == k or start > len(ids):
            break
        eots = np.flatnonzero(ids[:start] == eot_id)
        begin = int(eots[-1]) + 1 if len(eots) else 0
        if begin not in begins:  # a conversation's first answer only
            begins.add(begin)
            out.append(ids[max(begin, start - max_len):start])
    return out


def chat_token_ids(tok) -> dict[str, int]:
    """The ids of the 4 chat tokens, which must be special (added) tokens of a BPE tokenizer."""
    ids = {}
    for t in CHAT_TOKENS:
        i = tok.token_id(t) if hasattr(tok, "token_id") else None
        if i is None:
            raise ChatError(f"the tokenizer has no {t} token: chat data needs a BPE tokenizer with the chat tokens "
                            f"(tokenize --format chat adds them)")
        ids[t] = i
    return ids
