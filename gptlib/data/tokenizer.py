"""Char and byte-level BPE tokenizers, saved beside the data as tokenizer.json. A tokenizer's identity (kind, sha256 of
that file, vocab size) is in the data's meta.json and every checkpoint: data, model and tokenizer cannot disagree."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from gptlib.errors import TokenizerError
from gptlib.fsutil import atomic_write_bytes
from gptlib.layout import TOKENIZER_FILE

EOT = "<|endoftext|>"


class Tokenizer:
    kind: str = "base"
    vocab_size: int
    eot_id: int | None = None  # document separator id, None if the tokenizer has none

    def token_id(self, token: str) -> int | None:  # a special token's id (a chat role marker)
        return None

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        atomic_write_bytes(path, self.to_json_bytes())
        return path

    def identity(self) -> dict:
        return {
            "kind": self.kind,
            "hash": hashlib.sha256(self.to_json_bytes()).hexdigest(),
            "vocab_size": self.vocab_size,
        }


class CharTokenizer(Tokenizer):
    kind = "char"

    def __init__(self, chars: Sequence[str]):
        if not chars or len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
            raise TokenizerError(
                f"char vocabulary must be distinct single characters, at least one (got {len(chars)})"
            )
        self.chars = list(chars)
        self.vocab_size = len(self.chars)
        # An id (or -1) for every code point (4.4 MB): encoding is one vectorised lookup, not a Python loop.
        self._lut = np.full(0x110000, -1, dtype=np.int32)
        self._lut[[ord(c) for c in self.chars]] = np.arange(self.vocab_size, dtype=np.int32)

    @classmethod
    def from_text(cls, text: Iterable[str]) -> "CharTokenizer":
        return cls(sorted(set(text)))

    def encode_array(self, text: str, where: str = "") -> np.ndarray:
        """-> the ids; an unknown character is an error that says `where` the text is from (else its position)."""
        ids = self._lut[np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)]
        bad = np.flatnonzero(ids < 0)
        if bad.size:
            i = int(bad[0])
            # a count within the text given: a file is encoded in pieces, so not for a file
            more = f"; {bad.size} unknown in total" if not where else ""
            raise TokenizerError(
                f"character {text[i]!r} (U+{ord(text[i]):04X}) {where or f'at position {i}'} is not in the char "
                f"vocabulary ({len(self.chars)} characters from the training corpus){more}: remove or replace it, "
                f"or build the tokenizer from text that has it"
            )
        return ids

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids: Iterable[int]) -> str:
        n = len(self.chars)
        return "".join(self.chars[i] if 0 <= i < n else "\ufffd" for i in map(int, ids))

    def to_json_bytes(self) -> bytes:
        # "unknown": "error" stays (the only policy now): the identity hashes these bytes
        obj = {"kind": "char", "chars": "".join(self.chars), "unknown": "error"}
        return json.dumps(obj, ensure_ascii=False, sort_keys=True).encode()


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style) from the Rust `tokenizers` library. `<|endoftext|>` and the chat markers are
    special tokens that only the pipeline inserts, by id: in text they are ordinary text
    (`encode_special_tokens = True`), so a document can never forge a document boundary or a turn."""

    kind = "bpe"

    def __init__(self, tk, json_bytes: bytes | None = None):
        self._tk = tk
        self._tk.encode_special_tokens = True
        # the exact bytes saved beside the data: a reloaded tokenizer has the identity of the one that made the data
        self._json = json_bytes if json_bytes is not None else tk.to_str().encode()
        self.vocab_size = int(tk.get_vocab_size(with_added_tokens=True))
        self.eot_id = tk.token_to_id(EOT)
        if self.eot_id is None:
            raise TokenizerError(f"BPE tokenizer has no {EOT!r} special token")

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int = 32768, extra_special: Sequence[str] = ()
    ) -> "BPETokenizer":
        """Bounded memory: the trainer keeps word counts, not text. Ids: <|endoftext|> (0), extra_special (1, 2, ...),
        the 256 byte symbols, then merges up to vocab_size (a small corpus may stop short of it)."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        specials = [EOT, *extra_special]
        if vocab_size < 257 + len(specials):
            raise TokenizerError(
                f"vocab_size={vocab_size} is too small for byte-level BPE (>= {257 + len(specials)}: "
                f"256 bytes, {len(specials)} special token(s), and at least one merge)"
            )
        tk = HFTokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=int(vocab_size),
            min_frequency=2,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tk.train_from_iterator(texts, trainer=trainer)
        return cls(tk)

    @classmethod
    def from_json_bytes(cls, raw: bytes, where: str = TOKENIZER_FILE) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tk = HFTokenizer.from_str(raw.decode())
        except Exception as e:  # the library raises plain Exception on a bad file
            raise TokenizerError(
                f"tokenizer file {where} is not a valid tokenizers file: {e}"
            ) from None
        return cls(tk, json_bytes=raw)

    def with_special_tokens(self, tokens: Sequence[str]) -> "BPETokenizer":
        """`tokens` added as special tokens where missing, with ids after the vocabulary (every existing id stays). A
        token that is an ordinary vocabulary entry is refused: text could then produce its id."""
        from tokenizers import AddedToken

        missing = [t for t in tokens if self.token_id(t) is None]
        for t in missing:
            if (ordinary := self._tk.token_to_id(t)) is not None:
                raise TokenizerError(
                    f"token {t!r} is an ordinary entry of this tokenizer's vocabulary "
                    f"(id {ordinary}), not a special token: it cannot mark turns"
                )
        if not missing:
            return self
        tk = type(self._tk).from_str(self._json.decode())
        # appended: new ids
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        return BPETokenizer(tk)

    def token_id(self, token: str) -> int | None:
        for i, t in self._tk.get_added_tokens_decoder().items():
            if t.content == token and t.special:
                return int(i)
        return None

    def encode(self, text: str) -> list[int]:
        try:
            return self._tk.encode(text, add_special_tokens=False).ids
        # the library refuses a lone surrogate: bytes that were not UTF-8, as Python decodes them from argv or stdin
        except TypeError:
            # the first lone surrogate; anything else (not a str) stays the library's TypeError
            if not isinstance(text, str) or not (lone := re.search("[\ud800-\udfff]", text)):
                raise
            i = lone.start()
            raise TokenizerError(
                f"character {text[i]!r} (U+{ord(text[i]):04X}) at position {i} is not valid Unicode (a byte "
                f"that is not UTF-8, as a Latin-1 'é' is): give the text as UTF-8"
            ) from None

    def encode_batch_ids(self, texts: Sequence[str]) -> list[list[int]]:  # on all cores
        return [e.ids for e in self._tk.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json_bytes(self) -> bytes:
        return self._json


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer.json, or the one in a data or run directory: char or byte-level BPE."""
    path = Path(path) / TOKENIZER_FILE if Path(path).is_dir() else Path(path)
    if not path.is_file():
        raise TokenizerError(f"tokenizer file {path} does not exist")
    raw = path.read_bytes()
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"tokenizer file {path} is not valid JSON: {e}") from None
    if isinstance(obj, dict) and obj.get("kind") == "char":
        try:  # "chars" missing or not a string: an empty vocabulary, refused
            return CharTokenizer(list(obj["chars"]) if isinstance(obj.get("chars"), str) else [])
        except TokenizerError as e:
            raise TokenizerError(f"tokenizer file {path}: {e}") from None
    if isinstance(obj, dict) and "model" in obj:  # a Hugging Face tokenizers file
        return BPETokenizer.from_json_bytes(raw, where=str(path))
    raise TokenizerError(
        f"tokenizer file {path}: neither a gptlib char tokenizer nor a tokenizers BPE file"
    )


def check_identity(tok: Tokenizer, expected: dict, where: str) -> None:
    got = tok.identity()
    for key in ("kind", "hash"):
        if expected.get(key) is not None and expected[key] != got[key]:
            raise TokenizerError(
                f"tokenizer mismatch in {where}: {key} recorded as {expected[key]!r} but the "
                f"tokenizer file gives {got[key]!r}; the data was made with a different tokenizer"
            )
