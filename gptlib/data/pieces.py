"""What the corpus readers hand the encoder: at most PIECE_CHARS characters of one document (or turn), with the
position where the stream goes on after it (a resume restarts there)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

PIECE_CHARS = 1 << 16  # longest text handed to the encoder as one item (long documents are cut)


@dataclass
class Piece:
    text: str
    doc: int  # document index within its file (line number for jsonl, row for parquet, 0 for text)
    doc_end: bool  # the document ends with this piece (an end-of-text id follows)
    split: str | None  # forced split (tail mode), else None = decided per document
    pos: dict  # where the stream continues after this piece: {"file", "doc", "byte", "char"[, "turn"]}
    nbytes: float  # input bytes this piece accounts for (progress)
    role: str | None = None  # chat: the role of the turn this piece is text of ("system" | "user" | "assistant")
    turn_start: bool = False  # chat: the first piece of its turn (the role marker goes before it)
    turn_end: bool = False  # chat: the last piece of its turn (the end-of-turn marker goes after it)
    malformed: str | None = None  # chat: a skipped conversation, and why (an empty piece that is only counted)


def split_text(text: str, start: int = 0) -> Iterator[tuple[str, int]]:
    """(piece, end), cut before a newline or a space where possible. Memoryless: the pieces from `start` on do not
    depend on earlier ones, so a resumed run cuts exactly alike."""
    n = len(text)
    i = start
    while i < n:
        j = min(n, i + PIECE_CHARS)
        if j < n:
            k = text.rfind("\n", i + 1, j)
            if k <= i:
                k = text.rfind(" ", i + 1, j)
            if k > i:
                j = k
        yield text[i:j], j
        i = j
