"""Streaming pre-tokenization: text files -> token shards + meta.json (see shards.py).

Text is read in bounded chunks, never whole, and token ids go straight into a fixed-size shard
buffer, so memory stays bounded whatever the corpus size.
"""

from __future__ import annotations

import codecs
import glob
import json
import time
from pathlib import Path
from typing import Iterator, Sequence

from .fsutil import clean_temp_files, sha256_file
from .shards import META_FILE, DatasetMeta, ShardWriter, dtype_for_vocab, read_meta, write_meta
from .tokenizer import TOKENIZER_FILE, CharTokenizer, Tokenizer

READ_CHUNK_BYTES = 8 << 20  # text is decoded and encoded 8 MB at a time


class PrepareError(ValueError):
    """Bad input for tokenize: missing/empty file, refused output directory, bad options."""


def resolve_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    """Files, directories (recursively, sorted) and globs -> a sorted list of existing files."""
    files: list[Path] = []
    for item in inputs:
        s = str(item)
        p = Path(s)
        if p.is_dir():
            files.extend(sorted(x for x in p.rglob("*") if x.is_file() and not x.name.startswith(".")))
        elif p.is_file():
            files.append(p)
        elif any(ch in s for ch in "*?["):
            matched = sorted(Path(x) for x in glob.glob(s, recursive=True) if Path(x).is_file())
            if not matched:
                raise PrepareError(f"input pattern {s!r} matches no files")
            files.extend(matched)
        else:
            raise PrepareError(f"input file {p} does not exist")
    if not files:
        raise PrepareError("no input files given")
    for f in files:
        if f.stat().st_size == 0:
            raise PrepareError(f"input file {f} is empty")
    return files


def iter_text_chunks(path: Path, chunk_bytes: int = READ_CHUNK_BYTES) -> Iterator[str]:
    """Decode a UTF-8 file in chunks; invalid bytes become U+FFFD (counted by the caller)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk_bytes)
            if not b:
                tail = decoder.decode(b"", final=True)
                if tail:
                    yield tail
                return
            text = decoder.decode(b)
            if text:
                yield text


def source_records(files: list[Path]) -> list[dict]:
    return [{"path": str(f), "size": f.stat().st_size, "sha256": sha256_file(f)} for f in files]


def build_char_tokenizer(files: list[Path], unknown: str = "error") -> CharTokenizer:
    chars: set[str] = set()
    for f in files:
        for chunk in iter_text_chunks(f):
            chars.update(chunk)
    return CharTokenizer.from_chars(chars, unknown=unknown)


def prepare_text(inputs: Sequence[str | Path], out_dir: str | Path, tokenizer: str | Tokenizer = "char",
                 val_fraction: float = 0.1, shard_tokens: int = 100_000_000, overwrite: bool = False,
                 verbose: bool = True) -> DatasetMeta:
    """Tokenize text files into `out_dir`. Each file is one document, split train/val by its tail.

    Re-running with the same inputs and tokenizer is a no-op that returns the existing dataset;
    an `out_dir` holding a different dataset is refused unless overwrite=True.
    """
    if not 0.0 < val_fraction < 1.0:
        raise PrepareError(f"val_fraction={val_fraction} must be between 0 and 1 (exclusive)")
    files = resolve_inputs(inputs)
    out_dir = Path(out_dir)
    sources = source_records(files)
    spec = {"inputs": [s["sha256"] for s in sources], "val_fraction": val_fraction,
            "tokenizer": tokenizer if isinstance(tokenizer, str) else tokenizer.identity()["hash"]}
    existing = out_dir / META_FILE
    if existing.is_file():
        old = json.loads(existing.read_text())
        if old.get("prepare_spec") == spec:
            if verbose:
                print(f"{out_dir} already holds this dataset; reusing it")
            return read_meta(out_dir)
        if not overwrite:
            raise PrepareError(
                f"{out_dir} already holds a different dataset (sources {[s['path'] for s in old.get('sources', [])]}); "
                f"choose another --out or pass --overwrite"
            )
        existing.unlink()  # from here on the directory is incomplete until the new meta.json lands
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_temp_files(out_dir)

    t0 = time.time()
    if tokenizer == "char":
        tok: Tokenizer = build_char_tokenizer(files)
    elif isinstance(tokenizer, Tokenizer):
        tok = tokenizer
    else:
        raise PrepareError(f"tokenizer {tokenizer!r}: prepare_text takes 'char' or a Tokenizer object")

    dtype = dtype_for_vocab(tok.vocab_size)
    writers = {s: ShardWriter(out_dir, s, dtype, shard_tokens) for s in ("train", "val")}
    chars = 0
    replaced = 0
    for f in files:
        n_chars = sum(len(c) for c in iter_text_chunks(f))
        cut = int(n_chars * (1.0 - val_fraction))  # the file's last val_fraction of characters is validation
        seen = 0
        for chunk in iter_text_chunks(f):
            replaced += chunk.count("\ufffd")
            ids = tok.encode_array(chunk)
            if tok.kind == "char":  # one id per character: the cut falls exactly on the boundary
                k = max(0, min(len(chunk), cut - seen))
                writers["train"].write(ids[:k])
                writers["val"].write(ids[k:])
            else:
                writers["train" if seen < cut else "val"].write(ids)
            seen += len(chunk)
        chars += n_chars
    shards = {s: w.close() for s, w in writers.items()}
    tok_path = tok.save(out_dir)
    identity = dict(tok.identity(), file=tok_path.name)
    write_meta(out_dir, vocab_size=tok.vocab_size, tokenizer=identity, splits=shards, sources=sources,
               extra={"documents": len(files), "characters": chars, "replaced_invalid_utf8": replaced,
                      "prepare_spec": spec})
    meta = read_meta(out_dir)
    if verbose:
        print(f"tokenized {len(files)} file(s), {chars:,} characters -> train {meta.tokens('train'):,} / "
              f"val {meta.tokens('val'):,} tokens ({meta.dtype.name}, vocab {meta.vocab_size}) in "
              f"{time.time() - t0:.1f}s -> {out_dir}")
        if replaced:
            print(f"warning: {replaced:,} invalid UTF-8 sequences were replaced by U+FFFD")
    return meta
