"""Streaming pre-tokenization: .txt / .jsonl / parquet, local or behind URLs -> token shards + meta.json.

The pipeline (one pass, bounded memory, resumable) is described in gptlib/data/__init__.py; this module runs
a tokenize call: its options, the tokenizer (trained, reused or resumed), a previous run's state, meta.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from gptlib.data.conversations import CHAT_TOKENS, ChatError, ChatTemplate
from gptlib.data.encode import (BATCH_CHARS, STATE_FILE,  # noqa: F401 - BATCH_CHARS: tests shrink it here
                                check_output_dir, encode_corpus, one_writer, our_files)
from gptlib.data.inputs import Source, register_error_handler, scan_inputs
from gptlib.data.shards import META_FILE, DatasetMeta, ShardWriter, dtype_for_vocab, read_meta, write_meta  # noqa: F401
from gptlib.data.sources import train_texts
from gptlib.data.summary import print_tokenize_summary
from gptlib.data.tokenizer import TOKENIZER_FILE, BPETokenizer, CharTokenizer, Tokenizer, TokenizerError, load_tokenizer
from gptlib.errors import PrepareError
from gptlib.fsutil import atomic_write_json, clean_temp_files, sha256_file

TAIL_SPLIT_MAX_FILES = 100  # split="auto": fewer plain text files than this -> tail split
FORMATS = ("text", "chat")


# --------------------------------------------------------------------------------------------
# The tokenizer: trained, reused from a file (--tokenizer-from), or resumed


def tokenizer_path(path: str | Path) -> Path:
    """A tokenizer.json, or the one in a run directory (train) or a data directory (tokenize)."""
    p = Path(path)
    if p.is_dir():
        p = p / TOKENIZER_FILE
    if not p.is_file():
        raise PrepareError(f"tokenizer file {p} does not exist (--tokenizer-from takes a run directory, a data "
                           f"directory, or a tokenizer.json)")
    return p


def _tokenizer_spec(tokenizer, tokenizer_file, vocab_size, train_max_bytes) -> dict:
    if tokenizer_file is not None:
        return {"file_sha256": sha256_file(tokenizer_path(tokenizer_file))}
    if isinstance(tokenizer, Tokenizer):
        return {"hash": tokenizer.identity()["hash"]}
    if tokenizer == "char":
        return {"kind": "char"}
    if tokenizer == "bpe":
        return {"kind": "bpe", "vocab_size": int(vocab_size), "train_max_bytes": train_max_bytes}
    raise PrepareError(f"tokenizer {tokenizer!r}: choose 'char' or 'bpe', or pass a tokenizer file")


def _for_chat(tok: Tokenizer, fmt: str) -> Tokenizer:
    """The tokenizer with the chat tokens (appended where missing) for chat data; as it is for text."""
    if fmt != "chat":
        return tok
    if not isinstance(tok, BPETokenizer):
        raise PrepareError(_CHAR_CHAT)
    try:
        return tok.with_special_tokens(CHAT_TOKENS)
    except TokenizerError as e:
        raise PrepareError(f"this tokenizer cannot hold chat data: {e}") from None


_CHAR_CHAT = ("--format chat needs a BPE tokenizer: the char tokenizer has no special tokens, so role markers could "
              "not be told apart from text a message contains; use --tokenizer bpe, or --tokenizer-from a BPE run")


def _new_tokenizer(tokenizer, tokenizer_file, vocab_size: int, train_max_bytes: int | None, sources: list[Source],
                   text_column: str | None, skipped: list, verbose: bool, fmt: str) -> Tokenizer:
    if tokenizer_file is not None:
        return _for_chat(load_tokenizer(tokenizer_path(tokenizer_file)), fmt)
    if isinstance(tokenizer, Tokenizer):
        return _for_chat(tokenizer, fmt)
    if tokenizer == "char":
        chars: set[str] = set()
        for text in train_texts(sources, text_column, None, skipped):
            chars.update(text)
        if not chars:
            raise PrepareError("the corpus has no text to build a char vocabulary from")
        return CharTokenizer.from_chars(chars)
    t_tok = time.time()
    if verbose:
        lim = "all of it" if train_max_bytes is None else f"up to {train_max_bytes / 1e6:,.0f} MB"
        print(f"training a {vocab_size:,}-id byte-level BPE on {lim} ...")
    tok = BPETokenizer.train(train_texts(sources, text_column, train_max_bytes, skipped, fmt),
                             vocab_size=vocab_size, show_progress=False,
                             extra_special=CHAT_TOKENS if fmt == "chat" else ())
    if verbose:
        print(f"tokenizer: {tok.kind}, vocab {tok.vocab_size:,}, trained in {time.time() - t_tok:.1f}s")
    return tok


def _tokenizer_base(tokenizer, tokenizer_file) -> dict | None:
    """What a reused tokenizer was before the chat tokens were added: a fine-tuning run checks that its
    model's vocabulary is a prefix of the data's."""
    if tokenizer_file is not None:
        tokenizer = load_tokenizer(tokenizer_path(tokenizer_file))
    if not isinstance(tokenizer, Tokenizer):
        return None
    ident = tokenizer.identity()
    return {"hash": ident["hash"], "vocab_size": int(ident["vocab_size"])}


# --------------------------------------------------------------------------------------------
# The pipeline


def prepare(inputs: Sequence[str | Path] | str | Path, out_dir: str | Path, tokenizer: str | Tokenizer = "bpe", *,
            vocab_size: int = 32768, tokenizer_file: str | Path | None = None,
            tokenizer_from: str | Path | None = None, text_column: str | None = None, val_fraction: float = 0.1,
            split: str = "auto", shard_tokens: int = 100_000_000, train_max_bytes: int | None = 1_000_000_000,
            on_bad_file: str = "skip", overwrite: bool = False, verbose: bool = True, format: str = "text",
            max_tokens: int | None = None, hf_config: str | None = None, hf_split: str | None = None,
            take_over: bool = False) -> DatasetMeta:
    """Tokenize a corpus into `out_dir` (token shards + tokenizer.json + meta.json); returns its meta.

    inputs: files, directories, globs and fsspec URLs (hf://datasets/OWNER/NAME[/glob] with `hf_config`/`hf_split`)
        of .txt (a document per file), .jsonl (per line) and .parquet (per row), field/column `text_column` ("text").
    tokenizer: "bpe" (train a byte-level BPE of `vocab_size` ids on up to `train_max_bytes` of the
        corpus; None = all of it), "char", or a Tokenizer object; `tokenizer_from` (alias
        `tokenizer_file`) reuses a saved tokenizer.json, or the one of a run or data directory.
    format: "text", or "chat": conversations (the `messages` or `conversations` field, or `text_column`)
        rendered with chat.py's template; the chat tokens are added to a reused BPE tokenizer where
        missing, and the assistant spans are stored beside the shards (shards.read_spans).
    max_tokens: stop after the document that reaches this many tokens (train + val).
    split: "document" (per-document hash), "tail" (last val_fraction of each plain text file),
        "auto" (tail for fewer than 100 plain text files, else document).
    shard_tokens: tokens per train shard (a val shard is cut with it: a resume redoes at most one encode batch).
    Re-running with the same inputs and options returns the finished dataset, or resumes an unfinished one;
    `out_dir` holding a different dataset is refused unless overwrite=True (which deletes only tokenize's files).
    One tokenize writes `out_dir` at a time (its lease; take_over=True takes it); Ctrl-C says what is kept.
    """
    fmt = format
    tokenizer_file = _check_options(val_fraction, split, on_bad_file, shard_tokens, fmt, max_tokens, tokenizer,
                                    tokenizer_file, tokenizer_from)
    register_error_handler()
    t0 = time.time()
    out_dir = Path(out_dir)
    check_output_dir(out_dir)
    with one_writer(out_dir, take_over, verbose) as lease:  # before anything in out_dir is read or changed
        sources, empty, pre_skipped, column = scan_inputs(inputs, out_dir, text_column, on_bad_file, fmt, hf_config,
                                                          hf_split)
        split = _choose_split(split, sources, fmt)
        spec = _spec(sources, _tokenizer_spec(tokenizer, tokenizer_file, vocab_size, train_max_bytes), val_fraction,
                     split, text_column, shard_tokens, on_bad_file, fmt, max_tokens)
        finished, state = _previous_run(out_dir, spec, overwrite, verbose)
        if finished is not None:
            return finished
        tok, progress = _start(out_dir, state, pre_skipped, verbose, lambda: _new_tokenizer(
            tokenizer, tokenizer_file, vocab_size, train_max_bytes, sources, column, pre_skipped, verbose, fmt))
        identity = dict(tok.identity(), file=TOKENIZER_FILE)
        writers, stopped = encode_corpus(out_dir, spec, tok, identity, sources, progress, split, val_fraction, column,
                                         on_bad_file, shard_tokens, verbose, fmt, max_tokens, batch_chars=BATCH_CHARS,
                                         write_json=atomic_write_json, lease=lease)
        _check_result(progress, val_fraction)
        lease.check(out_dir)  # taken over meanwhile: the last shards and meta.json are the other tokenize's to write
        for w in writers.values():
            w.flush()
        stats = progress["stats"]
        extra = {"format": fmt, **{k: stats[k] for k in ("documents", "characters", "empty_documents",
                                                        "replaced_invalid_utf8", "skipped_files")},
                 "empty_files": empty, "split": split, "val_fraction": val_fraction,
                 "text_column": column if fmt == "chat" else text_column, "eot_id": tok.eot_id,
                 "shard_tokens": int(shard_tokens), **_extra_meta(tok, tokenizer, tokenizer_file, fmt, stats,
                                                                   max_tokens, stopped),
                 "prepare_spec": spec, "elapsed_s": round(time.time() - t0, 3)}
        return _finish(out_dir, tok, identity, writers, sources, extra, verbose)


def _spec(sources: list[Source], tokenizer_spec: dict, val_fraction: float, split: str, text_column: str | None,
          shard_tokens: int, on_bad_file: str, fmt: str, max_tokens: int | None) -> dict:
    """What makes a dataset this dataset: a re-run with an equal spec reuses or resumes it, any other is refused."""
    return {"sources": [[s.size, s.hash] for s in sources], "tokenizer": tokenizer_spec, "val_fraction": val_fraction,
            "split": split, "text_column": text_column, "shard_tokens": int(shard_tokens), "on_bad_file": on_bad_file,
            # keys only where not the default: datasets made before them keep their spec
            **({"format": fmt} if fmt != "text" else {}),
            **({"max_tokens": int(max_tokens)} if max_tokens is not None else {})}


def _start(out_dir: Path, state: dict | None, pre_skipped: list, verbose: bool, new_tokenizer) -> tuple[Tokenizer, dict]:
    """The tokenizer and the position to encode from: an unfinished run's (state), or a fresh start, which clears
    an older dataset's files and saves the new tokenizer into out_dir before any shard (a resume reuses it)."""
    if state is None or not (out_dir / TOKENIZER_FILE).is_file():
        state = None
        _delete_our_files(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_temp_files(out_dir)
    if state is not None:
        tok = _resumed_tokenizer(out_dir, state)
        return tok, _resumed_progress(out_dir, state, dtype_for_vocab(tok.vocab_size), verbose)
    tok = new_tokenizer()
    tok.save(out_dir)
    return tok, _fresh_progress(pre_skipped)


def _finish(out_dir: Path, tok: Tokenizer, identity: dict, writers: dict, sources: list[Source], extra: dict,
            verbose: bool) -> DatasetMeta:
    """meta.json last (a half-written dataset never looks complete), then the resume state goes."""
    write_meta(out_dir, vocab_size=tok.vocab_size, tokenizer=identity,
               splits={s: w.shards for s, w in writers.items()}, sources=[s.record() for s in sources], extra=extra)
    (out_dir / STATE_FILE).unlink()
    meta = read_meta(out_dir)
    if verbose:
        print_tokenize_summary(meta, len(sources), extra, extra["elapsed_s"], out_dir)  # extra holds the counts
    return meta


def _fresh_progress(pre_skipped: list) -> dict:
    """Where a new tokenize run starts: the first byte of the first input, nothing written."""
    return {"resume": {"file": 0, "doc": 0, "byte": 0, "char": 0}, "emitted": {"train": 0, "val": 0},
            "stats": {"documents": 0, "characters": 0, "bytes": 0.0, "empty_documents": 0,
                      "replaced_invalid_utf8": 0, "skipped_files": list(pre_skipped)},
            "shards": {"train": [], "val": []}}


def _extra_meta(tok: Tokenizer, tokenizer, tokenizer_file, fmt: str, stats: dict, max_tokens: int | None,
                stopped: dict | None) -> dict:
    """meta.json fields of chat data, a reused tokenizer and a token budget."""
    extra: dict[str, Any] = {}
    base = _tokenizer_base(tokenizer, tokenizer_file)
    if base is not None:
        extra["tokenizer_base"] = base
    if fmt == "chat":
        try:
            extra["chat"] = ChatTemplate(tok).meta()
        except ChatError as e:
            raise PrepareError(str(e)) from None
        extra["malformed_conversations"] = stats.get("malformed_conversations", 0)
        extra["malformed_examples"] = stats.get("malformed_examples", [])
        extra["assistant_tokens"] = stats.get("assistant_tokens", {"train": 0, "val": 0})
    if max_tokens is not None:
        extra["max_tokens"] = int(max_tokens)
        extra["stop_reason"] = "max_tokens" if stopped else "end_of_input"
        if stopped:
            extra["stopped_at"] = stopped
    return extra


def _check_result(progress: dict, val_fraction: float) -> None:
    stats, emitted, skipped = progress["stats"], progress["emitted"], progress["stats"]["skipped_files"]
    if emitted["train"] == 0:
        why = "".join(f"; skipped {s['path']}: {s['error']}" for s in skipped[:3])
        bad = stats.get("malformed_conversations", 0)
        if bad:
            why += f"; {bad:,} malformed conversations skipped, e.g. {stats['malformed_examples'][0]['reason']}"
        raise PrepareError(f"the corpus produced no training tokens ({stats['documents']} documents); "
                           f"check the inputs and the text column{why}")
    if emitted["val"] == 0:
        raise PrepareError(
            f"no document fell into the validation split ({stats['documents']:,} documents, "
            f"val_fraction={val_fraction}); use more documents, a larger val_fraction, or split='tail'")


def _check_options(val_fraction: float, split: str, on_bad_file: str, shard_tokens: int, fmt: str,
                   max_tokens: int | None, tokenizer, tokenizer_file, tokenizer_from) -> str | Path | None:
    """prepare()'s options, each refused in one line naming it; -> the tokenizer file to reuse, if any."""
    if tokenizer_from is not None and tokenizer_file is not None and Path(tokenizer_from) != Path(tokenizer_file):
        raise PrepareError("give the tokenizer to reuse once: tokenizer_from (--tokenizer-from) or tokenizer_file")
    tokenizer_file = tokenizer_from if tokenizer_from is not None else tokenizer_file
    if not 0.0 < val_fraction < 1.0:
        raise PrepareError(f"val_fraction={val_fraction} must be between 0 and 1 (exclusive)")
    if split not in ("auto", "document", "tail"):
        raise PrepareError(f"split={split!r}: choose 'auto', 'document' or 'tail'")
    if on_bad_file not in ("skip", "error"):
        raise PrepareError(f"on_bad_file={on_bad_file!r}: choose 'skip' or 'error'")
    if int(shard_tokens) < 1:
        raise PrepareError(f"shard_tokens={shard_tokens} must be >= 1")
    if fmt not in FORMATS:
        raise PrepareError(f"format={fmt!r}: choose 'text' or 'chat'")
    if max_tokens is not None and int(max_tokens) < 1:
        raise PrepareError(f"max_tokens={max_tokens} must be >= 1")
    if fmt == "chat" and tokenizer == "char" and tokenizer_file is None:
        raise PrepareError(_CHAR_CHAT)
    return tokenizer_file


def _choose_split(split: str, sources: list[Source], fmt: str = "text") -> str:
    if split == "auto":
        split = "tail" if (fmt == "text" and all(s.kind == "text" for s in sources)
                           and len(sources) < TAIL_SPLIT_MAX_FILES) else "document"
    if split == "tail" and (fmt == "chat" or any(s.kind != "text" for s in sources)):
        raise PrepareError("split='tail' works on plain text files only; jsonl/parquet documents and conversations "
                           "are split per document (split='document')")
    return split


def _previous_run(out_dir: Path, spec: dict, overwrite: bool, verbose: bool) -> tuple[DatasetMeta | None, dict | None]:
    """What out_dir already holds: (the finished dataset of this spec, None), (None, the state of an
    unfinished run of this spec), or (None, None) for nothing of ours / another dataset with overwrite."""
    meta_path, state_path = out_dir / META_FILE, out_dir / STATE_FILE
    if meta_path.is_file():
        try:
            old = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            old = {}
        if old.get("prepare_spec") == spec:
            if state_path.is_file():  # killed between meta.json and removing the state file
                state_path.unlink()
            elif verbose:
                print(f"{out_dir} already holds this dataset; reusing it")
            return read_meta(out_dir), None
        if not overwrite:
            raise PrepareError(
                f"{out_dir} already holds a different dataset (sources "
                f"{[s.get('path') for s in old.get('sources', [])][:5]}, tokenizer "
                f"{old.get('tokenizer', {}).get('kind')}, vocab {old.get('vocab_size')}); "
                f"choose another output directory or pass --overwrite / overwrite=True")
        return None, None
    if not state_path.is_file():
        return None, None
    try:
        state = json.loads(state_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None, None  # a state file is written atomically; an unreadable one is not ours to trust
    if state.get("spec") != spec:
        if not overwrite:
            raise PrepareError(
                f"{out_dir} holds an unfinished tokenize run of different inputs or options; run the same "
                f"command as before to finish it, choose another output directory, or pass --overwrite")
        return None, None
    return None, state


def _delete_our_files(out_dir: Path) -> None:
    """An older dataset (overwrite) or leftovers of a run that never began. meta.json goes first:
    a kill half-way through never leaves a meta.json naming deleted shards."""
    for p in sorted(our_files(out_dir), key=lambda p: p.name != META_FILE):
        p.unlink()


def _resumed_tokenizer(out_dir: Path, state: dict) -> Tokenizer:
    tok_path = out_dir / TOKENIZER_FILE
    tok = load_tokenizer(tok_path)
    if tok.identity()["hash"] != state["tokenizer"]["hash"]:
        raise PrepareError(f"{tok_path} differs from the tokenizer of the unfinished run in {out_dir}; "
                           f"pass --overwrite to start again")
    return tok


def _resumed_progress(out_dir: Path, state: dict, dtype: np.dtype, verbose: bool) -> dict:
    """The unfinished run's position, counts and completed shards, after checking the shards on disk.
    Shards (and spans files) written after the last state save are redone (identically): they are deleted."""
    shards = state["shards"]
    listed = {s["file"] for v in shards.values() for s in v} | {
        s["spans"]["file"] for v in shards.values() for s in v if "spans" in s}
    for p in our_files(out_dir):
        if p.suffix == ".bin" and p.name not in listed:
            p.unlink()
    for v in shards.values():
        for s in v:
            p = out_dir / s["file"]
            damaged = not p.is_file() or p.stat().st_size != s["tokens"] * dtype.itemsize
            if "spans" in s:
                sp = out_dir / s["spans"]["file"]
                damaged = damaged or not sp.is_file() or sp.stat().st_size != 16 * s["spans"]["count"]
            if damaged:
                raise PrepareError(f"shard {p} of the unfinished run is missing or damaged; pass --overwrite "
                                   f"to start again")
    if verbose:
        print(f"resuming the unfinished run in {out_dir}: {len(shards['train'])} train / "
              f"{len(shards['val'])} val shards done")
    return {k: state[k] for k in ("resume", "emitted", "stats", "shards")}


def prepare_text(inputs: Sequence[str | Path], out_dir: str | Path, tokenizer: str | Tokenizer = "char",
                 val_fraction: float = 0.1, shard_tokens: int = 100_000_000, overwrite: bool = False,
                 verbose: bool = True) -> DatasetMeta:
    """Phase 1 entry point: `prepare` with the char tokenizer by default (same pipeline)."""
    return prepare(inputs, out_dir, tokenizer=tokenizer, val_fraction=val_fraction, shard_tokens=shard_tokens,
                   overwrite=overwrite, verbose=verbose)
