"""A corpus as a stream of text pieces, each carrying the position after it: a resumed run, or a read retried after
a network drop, restarts exactly there. A .txt file is one document; a .jsonl line or a parquet row is one."""

from __future__ import annotations

import sys
import time
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Callable, Iterator

from gptlib.data.conversations import Malformed, normalize
from gptlib.data.hub import describe, http_status
from gptlib.data.inputs import (
    _ERRORS,
    Source,
    _jsonl_object,
    _jsonl_text,
    _open_parquet,
    _parquet_column,
    corrupt,
    not_text,
)
from gptlib.errors import PrepareError, again

PIECE_CHARS = 1 << 16  # longest text handed to the encoder as one item (long documents are cut)
ROW_BATCH_BYTES = 2 << 20  # parquet rows are read about this much column data at a time
# seconds before each new attempt after a read error (~4 min)
RETRY_DELAYS = (1, 2, 5, 10, 30, 60, 60, 60)
# a tokenizer-training budget is spread over at most this many files (evenly spaced)
TRAIN_FILES = 64
_CONTINUATION = bytes(range(0x80, 0xC0))  # UTF-8 continuation bytes


@dataclass
class Piece:  # at most PIECE_CHARS characters of one document (or turn)
    text: str
    doc: int  # document index within its file (line number for jsonl, row for parquet, 0 for text)
    doc_end: bool  # the document ends with this piece (an end-of-text id follows)
    split: str | None  # forced split (tail mode), else None = decided per document
    pos: dict  # where the stream continues after this piece: {"file", "doc", "byte", "char"[, "turn"]}
    nbytes: float  # input bytes this piece accounts for (progress)
    # chat: the role of the turn this piece is text of ("system" | "user" | "assistant")
    role: str | None = None
    turn_start: bool = False  # chat: the first piece of its turn (the role marker goes before it)
    # chat: the last piece of its turn (the end-of-turn marker goes after it)
    turn_end: bool = False
    # chat: a skipped conversation, and why (an empty piece that is only counted)
    malformed: str | None = None


def split_text(text: str, start: int = 0) -> Iterator[tuple[str, int]]:
    """(piece, end), cut before a newline or a space where possible. Memoryless: the pieces from `start` on do not
    depend on earlier ones, so a resumed run cuts exactly alike."""
    i, n = start, len(text)
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


def _cut_bytes(block: bytes, at_eof: bool) -> int:
    """Where to cut: before the last newline, else space, else a UTF-8 boundary."""
    if at_eof:
        return len(block)
    k = block.rfind(b"\n")
    if k <= 0:
        k = block.rfind(b" ")
    if k > 0:
        return k
    k = len(block.rstrip(_CONTINUATION))  # back off continuation bytes
    if k > 0 and block[k - 1] >= 0xC0:  # and the lead byte of the cut character
        k -= 1
    return k if k > 0 else len(block)


def _at(pos: dict | None, *keys: str) -> list[int]:
    """Where a (resumed) read starts; None: the file's start."""
    return [int((pos or {}).get(k, 0)) for k in keys]


def iter_text_file(src: Source, fi: int, pos: dict | None, tail_cut: int | None) -> Iterator[Piece]:
    (off,) = _at(pos, "byte")
    with src.open() as f:
        if tail_cut is not None:  # move the cut off UTF-8 continuation bytes
            f.seek(tail_cut)
            b = f.read(4)
            tail_cut += len(b) - len(b.lstrip(_CONTINUATION))
        f.seek(off)
        while off < src.size:
            split = None if tail_cut is None else "train" if off < tail_cut else "val"
            block = f.read(min(PIECE_CHARS, tail_cut - off) if split == "train" else PIECE_CHARS)
            if not block:
                break  # the file shrank while reading
            # UTF-16 (Notepad's 'Unicode', Windows PowerShell's >) or a binary file, as git tells one: a NUL early on
            if off == 0 and b"\0" in block[:8000]:
                raise PrepareError(f"input file {src.path} is {not_text()}")
            end = off + len(block)
            k = _cut_bytes(block, end >= src.size or end == tail_cut)
            if k < len(block):
                f.seek(off + k)
            off += k
            text = block[:k].decode("utf-8", _ERRORS)
            yield Piece(
                text, 0, off >= src.size, split, {"file": fi, "doc": 0, "byte": off, "char": 0}, k
            )


def _document_pieces(
    text: str | None, fi: int, doc: int, char: int, byte: int, byte_after: int, nbytes: float
) -> Iterator[Piece]:
    """A resume inside the document restarts at (byte, char), after it at byte_after. An empty document (a blank line,
    null or "") is one empty piece, to be counted."""
    after = {"file": fi, "doc": doc + 1, "byte": byte_after, "char": 0}
    if not text:
        yield Piece("", doc, True, None, after, nbytes)
        return
    for piece, end in split_text(text, char):
        done = end >= len(text)
        nxt = after if done else {"file": fi, "doc": doc, "byte": byte, "char": end}
        yield Piece(piece, doc, done, None, nxt, nbytes * len(piece) / len(text))


def conversation_pieces(
    value: Any, fi: int, doc: int, turn: int, char: int, byte: int, byte_after: int, nbytes: float
) -> Iterator[Piece]:
    """Pieces of "\\n" + content of each turn from (turn, char) on; a malformed conversation: one empty piece."""
    after = {"file": fi, "doc": doc + 1, "byte": byte_after, "char": 0, "turn": 0}
    turns = normalize(value)
    if isinstance(turns, Malformed):
        yield Piece("", doc, False, None, after, nbytes, malformed=turns.reason)
        return
    texts = ["\n" + content for _, content in turns]
    total = sum(map(len, texts))
    for t in range(turn, len(turns)):
        for piece, end in split_text(texts[t], char if t == turn else 0):
            turn_end = end >= len(texts[t])
            last = turn_end and t == len(turns) - 1
            # the next piece: this turn's rest, the next turn, or (after the last) the next document
            nxt = {"file": fi, "doc": doc, "byte": byte, "char": end, "turn": t}
            if turn_end:
                nxt = after if last else {**nxt, "char": 0, "turn": t + 1}
            yield Piece(
                piece,
                doc,
                last,
                None,
                nxt,
                nbytes * len(piece) / total,
                role=turns[t][0],
                turn_start=end == len(piece),
                turn_end=turn_end,
            )


def iter_jsonl_file(
    src: Source, fi: int, pos: dict | None, field: str, fmt: str
) -> Iterator[Piece]:
    doc, byte, char, turn = _at(pos, "doc", "byte", "char", "turn")
    with src.open() as f:
        f.seek(byte)
        for line in f:
            start = byte
            byte += len(line)
            if fmt == "chat" and line.strip():
                obj = _jsonl_object(line, src.path, doc + 1, field)
                value = obj.get(field)
                if field not in obj:
                    fields = ", ".join(map(str, obj))[:200]
                    value = Malformed(f"field {field!r} is missing (fields: {fields})")
                yield from conversation_pieces(value, fi, doc, turn, char, start, byte, len(line))
            else:
                text = _jsonl_text(line, src.path, doc + 1, field) if line.strip() else None
                yield from _document_pieces(text, fi, doc, char, start, byte, len(line))
            doc += 1
            char = turn = 0


def iter_parquet_file(
    src: Source, fi: int, pos: dict | None, column: str, fmt: str, skipped: list
) -> Iterator[Piece]:
    """A file that cannot be opened, or a corrupt row group, is recorded in `skipped` and passed over; the rows around
    it are kept. A read error is not corruption (inputs.corrupt): it goes up to the retries."""
    with src.open() as f:
        try:
            pf = _open_parquet(f)
        except Exception as e:  # noqa: BLE001
            if not corrupt(e):
                raise
            skipped.append({"path": str(src.path), "error": f"cannot be opened: {e}"})
            return
        col = _parquet_column(pf, src.path, column, fmt)
        meta = pf.metadata
        per_row = src.size / max(1, meta.num_rows)
        row, char, turn = _at(pos, "doc", "char", "turn")
        ends = list(accumulate(meta.row_group(g).num_rows for g in range(meta.num_row_groups)))
        # a restart begins at the row group holding `row`, skipping rows before it
        first = bisect_right(ends, row)
        skip = row - (ends[first - 1] if first else 0)
        for g in range(first, meta.num_row_groups):
            try:
                for v in _row_values(pf, g, col, skip if g == first else 0):
                    if fmt == "chat":
                        yield from conversation_pieces(v, fi, row, turn, char, 0, 0, per_row)
                    else:
                        v = v.decode("utf-8", _ERRORS) if isinstance(v, bytes) else v
                        yield from _document_pieces(v, fi, row, char, 0, 0, per_row)
                    row += 1
                    char = turn = 0
            except Exception as e:  # noqa: BLE001
                if not corrupt(e):
                    raise
                msg = f"row group {g} (rows {row}-{ends[g] - 1}) is unreadable: {e}"
                msg = msg.replace("\n", " ").strip()
                skipped.append({"path": str(src.path), "error": msg, "partial": True})
                row, char, turn = ends[g], 0, 0


def _row_values(pf, g: int, col: str, skip: int) -> Iterator:
    """Read about ROW_BATCH_BYTES of the column's data at a time: a row group of books a few MB at a time."""
    rg = pf.metadata.row_group(g)
    chunks = [rg.column(i) for i in range(rg.num_columns)]
    size = sum(c.total_uncompressed_size for c in chunks if c.path_in_schema.split(".")[0] == col)
    rows = int(max(1, min(1024, ROW_BATCH_BYTES // max(1.0, size / max(1, rg.num_rows)))))
    for batch in pf.iter_batches(batch_size=rows, row_groups=[g], columns=[col], use_threads=False):
        if skip < batch.num_rows:
            yield from batch.column(0).to_pylist()[skip:]
        skip = max(0, skip - batch.num_rows)


def iter_source(
    src: Source,
    fi: int,
    pos: dict | None,
    tail_fraction: float | None,
    column: str,
    fmt: str,
    skipped: list,
) -> Iterator[Piece]:
    if src.kind == "text":
        tail_cut = None if tail_fraction is None else int(src.size * (1.0 - tail_fraction))
        return iter_text_file(src, fi, pos, tail_cut)
    if src.kind == "jsonl":
        return iter_jsonl_file(src, fi, pos, column, fmt)
    return iter_parquet_file(src, fi, pos, column, fmt, skipped)


def iter_corpus(
    sources: list[Source],
    start: dict,
    skipped: list,
    split_mode: str,
    val_fraction: float,
    column: str,
    fmt: str,
) -> Iterator[Piece]:
    for fi in range(int(start["file"]), len(sources)):
        src = sources[fi]
        if src.size == 0 or _whole_file_skipped(src, skipped):
            continue

        def read(pos: dict | None, src: Source = src, fi: int = fi) -> Iterator[Piece]:
            if split_mode == "document":
                src.key  # noqa: B018 - a big remote file's sampled hash: read here, inside the retries
            return iter_source(
                src, fi, pos, val_fraction if split_mode == "tail" else None, column, fmt, skipped
            )

        yield from retrying(read, start if fi == int(start["file"]) else None, str(src.path))


def _whole_file_skipped(src: Source, skipped: list) -> bool:
    return any(s["path"] == str(src.path) and not s.get("partial") for s in skipped)


def train_texts(
    sources: list[Source], column: str, max_bytes: int | None, skipped: list, fmt: str = "text"
) -> Iterator[str]:
    """The tokenizer's training text: all of it, or about max_bytes spread over the files in proportion to their size
    (each from its start; at most TRAIN_FILES files, so that a 1,000-file Hub dataset is not opened 1,000 times)."""
    usable = [
        (fi, s) for fi, s in enumerate(sources) if s.size and not _whole_file_skipped(s, skipped)
    ]
    if max_bytes is not None and len(usable) > TRAIN_FILES:
        usable = [
            usable[round(i * (len(usable) - 1) / (TRAIN_FILES - 1))] for i in range(TRAIN_FILES)
        ]
    total = sum(s.size for _, s in usable) or 1
    for fi, src in usable:
        budget = None if max_bytes is None else max(PIECE_CHARS, int(max_bytes * src.size / total))
        used = 0
        # unreadable parts are passed over here ([]): the tokenizing pass reports them
        for p in retrying(
            lambda pos, src=src, fi=fi: iter_source(src, fi, pos, None, column, fmt, []),
            None,
            str(src.path),
        ):
            if p.text:
                yield p.text
            used += p.nbytes
            if budget is not None and used >= budget:
                break


def retrying(
    read: Callable[[dict | None], Iterator[Any]], pos: dict | None, where: str
) -> Iterator[Any]:
    """The items of read(pos); after a read error, read(the position after the last item) again, waiting
    RETRY_DELAYS[i] before the i-th new attempt (progress resets the count)."""
    attempt = 0
    while True:
        try:
            for item in read(pos):
                yield item
                pos, attempt = item.pos, 0
            return
        except PrepareError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the filesystem library raises
            fatal = isinstance(e, (FileNotFoundError, PermissionError))
            fatal = fatal or http_status(e) in (401, 403, 404)
            if fatal or attempt == len(RETRY_DELAYS):
                tries = "" if fatal else f" after {attempt + 1} attempts"
                raise PrepareError(
                    f"reading {where} failed{tries}: {describe(e, where)}. Everything up to the last "
                    f"completed shard is kept: {again()} to resume"
                ) from None
            print(
                f"warning: reading {where} failed ({describe(e, where)}); retrying in {RETRY_DELAYS[attempt]}s",
                file=sys.stderr,
            )
            time.sleep(RETRY_DELAYS[attempt])
            attempt += 1
