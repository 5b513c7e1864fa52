"""Tokenizers behind one small interface, saved beside the data as `tokenizer.json`.

- `CharTokenizer`: one id per character of the training corpus (Phase 1).
- `BPETokenizer`: byte-level BPE from the Rust `tokenizers` library (Phase 2/3).

Every tokenizer has an identity `{"kind", "hash"}` (sha256 of its saved file) that is stored in
the data's metadata and in every checkpoint, so data, model and tokenizer cannot disagree.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .fsutil import atomic_write_bytes

TOKENIZER_FILE = "tokenizer.json"
EOT = "<|endoftext|>"


class TokenizerError(ValueError):
    """Bad tokenizer file, unknown character, or a tokenizer that does not match the data."""


class Tokenizer:
    """The interface: encode/decode, a vocabulary size, an end-of-text id, save, identity."""

    kind: str = "base"
    vocab_size: int
    eot_id: int | None = None  # document separator id, None if the tokenizer has none

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode_array(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def to_json_bytes(self) -> bytes:
        raise NotImplementedError

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        atomic_write_bytes(path, self.to_json_bytes())
        return path

    def identity(self) -> dict:
        return {"kind": self.kind, "hash": hashlib.sha256(self.to_json_bytes()).hexdigest(), "vocab_size": self.vocab_size}


class CharTokenizer(Tokenizer):
    """Characters of the corpus, sorted; unknown characters raise (default) or map to an <unk> id."""

    kind = "char"

    def __init__(self, chars: Sequence[str], unknown: str = "error"):
        if unknown not in ("error", "map"):
            raise TokenizerError(f"unknown-character policy {unknown!r}: choose 'error' or 'map'")
        if len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
            raise TokenizerError("char vocabulary must be distinct single characters")
        if not chars:
            raise TokenizerError("char vocabulary is empty: the corpus has no characters")
        self.chars = list(chars)
        self.unknown = unknown
        # With the 'map' policy the last id stands for every character not in the corpus.
        self.unk_id = len(self.chars) if unknown == "map" else None
        self.vocab_size = len(self.chars) + (1 if unknown == "map" else 0)
        self.eot_id = None
        codes = np.array([ord(c) for c in self.chars], dtype=np.int64)
        # Dense code-point -> id table: encoding is one vectorised lookup, not a Python loop.
        self._lut = np.full(int(codes.max()) + 1, -1, dtype=np.int32)
        self._lut[codes] = np.arange(len(codes), dtype=np.int32)

    @classmethod
    def from_text(cls, text: str, unknown: str = "error") -> "CharTokenizer":
        return cls(sorted(set(text)), unknown=unknown)

    @classmethod
    def from_chars(cls, chars: Iterable[str], unknown: str = "error") -> "CharTokenizer":
        return cls(sorted(set(chars)), unknown=unknown)

    def encode_array(self, text: str) -> np.ndarray:
        if not text:
            return np.zeros(0, dtype=np.int32)
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.int64)
        ids = np.full(cps.shape, -1, dtype=np.int32)
        in_range = cps < len(self._lut)
        ids[in_range] = self._lut[cps[in_range]]
        bad = np.flatnonzero(ids < 0)
        if bad.size:
            if self.unk_id is None:
                i = int(bad[0])
                ch = text[i]
                raise TokenizerError(
                    f"character {ch!r} (U+{ord(ch):04X}) at position {i} is not in the char vocabulary "
                    f"({len(self.chars)} characters from the training corpus); {bad.size} unknown in total. "
                    f"Rebuild the tokenizer on text that includes it, or use unknown='map'"
                )
            ids[bad] = self.unk_id
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        out = []
        n = len(self.chars)
        for i in ids:
            i = int(i)
            out.append(self.chars[i] if 0 <= i < n else "\ufffd")
        return "".join(out)

    def to_json_bytes(self) -> bytes:
        return json.dumps({"kind": "char", "chars": "".join(self.chars), "unknown": self.unknown},
                          ensure_ascii=False, sort_keys=True).encode()


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load `tokenizer.json` (or the one inside a data directory): char or byte-level BPE."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise TokenizerError(f"tokenizer file {path} does not exist")
    raw = path.read_bytes()
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"tokenizer file {path} is not valid JSON: {e}") from None
    if isinstance(obj, dict) and obj.get("kind") == "char":
        return CharTokenizer(list(obj["chars"]), unknown=obj.get("unknown", "error"))
    if isinstance(obj, dict) and "model" in obj:  # a Hugging Face tokenizers file
        from .bpe import BPETokenizer

        return BPETokenizer.from_json_bytes(raw)
    raise TokenizerError(f"tokenizer file {path}: neither a gptlib char tokenizer nor a tokenizers BPE file")


def check_identity(tok: Tokenizer, expected: dict, where: str) -> None:
    """Refuse a tokenizer whose identity differs from what data or checkpoint recorded."""
    got = tok.identity()
    for key in ("kind", "hash"):
        if expected.get(key) is not None and expected[key] != got[key]:
            raise TokenizerError(
                f"tokenizer mismatch in {where}: {key} recorded as {expected[key]!r} but the tokenizer "
                f"file gives {got[key]!r}; the data was made with a different tokenizer"
            )
