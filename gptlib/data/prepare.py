"""A tokenize call: its options, the tokenizer (trained, reused or resumed), a previous run's state, meta.json."""

from __future__ import annotations

import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Sequence

from gptlib.data.conversations import CHAT_TOKENS, ChatTemplate
from gptlib.data.encode import Pass, check_output_dir, one_writer, our_files, replace_dataset
from gptlib.data.inputs import Source, scan_inputs
from gptlib.data.shards import (
    META_FILE,
    PREPARE_STATE_FILE,
    DatasetMeta,
    check_shard,
    dtype_for_vocab,
    read_meta,
    write_meta,
)
from gptlib.data.sources import train_texts
from gptlib.data.summary import print_tokenize_summary, report_skipped
from gptlib.data.tokenizer import (
    TOKENIZER_FILE,
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
)
from gptlib.errors import DataFormatError, PrepareError, in_notebook
from gptlib.fsutil import DRIVE_ADVICE, clean_temp_files, sha256_file
from gptlib.layout import OVERWRITE_DIR

TAIL_SPLIT_MAX_FILES = 100  # split="auto": fewer plain text files than this -> tail split
_NEEDS_BPE = (
    "needs a BPE tokenizer: the char tokenizer has no special tokens, so role markers could not be told "
    "apart from text a message contains; use "
)


def _needs_bpe(what: str = "") -> str:
    # where the user is: notebook 05 tokenizes with its base's tokenizer, notebook 01 with TOKENIZER's
    if in_notebook():
        return (
            f'{what and "chat data "}{_NEEDS_BPE}a BPE base (notebook 05: BASE = "OpenAI GPT-2 from the Hub", '
            'or BASE_RUN_NAME a BPE run), or TOKENIZER = "bpe" (notebook 01)'
        )
    return f"{what}{_NEEDS_BPE}--tokenizer bpe, or --tokenizer-from a BPE run"


def prepare(
    inputs: Sequence[str | Path] | str | Path,
    out_dir: str | Path,
    tokenizer: str | None = "bpe",
    *,
    vocab_size: int = 32768,
    tokenizer_from: str | Path | None = None,
    text_column: str | None = None,
    val_fraction: float = 0.1,
    split: str = "auto",
    shard_tokens: int = 100_000_000,
    train_max_bytes: int | None = 1_000_000_000,
    overwrite: bool = False,
    verbose: bool = True,
    format: str = "auto",
    max_tokens: int | None = None,
    hf_config: str | None = None,
    hf_split: str | None = None,
) -> DatasetMeta:
    """Tokenize a corpus into out_dir (token shards, tokenizer.json, meta.json); the options are the CLI's
    (docs/cli.md). A re-run with the same inputs and options returns the finished dataset or resumes an unfinished
    one; a different dataset in out_dir is refused unless overwrite=True, which also makes a finished one again (and
    starts again an unfinished one that fails its checks). format "auto": chat when the records have
    a messages/conversations field and no text field, else text; tokenizer None: bpe for chat, char for text."""
    fmt, t0, out_dir = format, time.time(), Path(out_dir)
    tok_file = _check_options(
        val_fraction, split, shard_tokens, fmt, max_tokens, tokenizer, tokenizer_from
    )
    check_output_dir(out_dir)
    with one_writer(out_dir):  # before anything in out_dir is read or changed
        sources, empty, pre_skipped, column, fmt, first = scan_inputs(
            inputs, out_dir, text_column, fmt, hf_config, hf_split
        )
        asked, tokenizer = tokenizer, tokenizer or ("bpe" if fmt == "chat" else "char")
        # what format "auto" found, in the first file of records it could read
        holds = f"{first} holds conversations ({column!r})"
        if fmt == "chat" and format == "auto" and tokenizer == "char" and tok_file is None:
            raise PrepareError(f"{holds}, read as chat, which {_needs_bpe()}")
        split = _choose_split(split, sources, fmt)
        tok_spec = _tokenizer_spec(tok_file, tokenizer, vocab_size, train_max_bytes)
        spec = _spec(
            sources, tok_spec, val_fraction, split, text_column, shard_tokens, fmt, max_tokens
        )
        finished, state = _previous_run(out_dir, spec, overwrite, verbose)
        if finished is not None:
            return finished
        # --overwrite of a finished dataset: the new one is made in OVERWRITE_DIR, the old one kept whole until then
        work = out_dir / OVERWRITE_DIR if (out_dir / META_FILE).is_file() else out_dir
        if fmt == "chat" and format == "auto" and verbose:
            print(f"format: chat, as {holds}")
        # as given, before the chat tokens are added
        reused = load_tokenizer(tok_file) if tok_file else None
        if verbose:
            _say_unused(spec, sources, text_column, tok_file, reused, asked)
        # made on a fresh start only: a resume loads the one it saved
        new_tokenizer = partial(_new_tokenizer, reused, spec, sources, column, pre_skipped, verbose)
        try:
            tok, progress = _start(work, state, pre_skipped, verbose, new_tokenizer)
        except PrepareError:
            # an unfinished run that fails its checks (a damaged shard): --overwrite starts it again; not a stopped
            # --overwrite's, resumed with --overwrite (a shard a new VM's Drive has not synced yet: hours lost)
            if not overwrite or state is None or work != out_dir:
                raise
            tok, progress = _start(work, None, pre_skipped, verbose, new_tokenizer)
        identity = dict(tok.identity(), file=TOKENIZER_FILE)
        encoding = Pass(work, spec, tok, identity, sources, progress)
        encoding.run(column, verbose)
        # split='tail' is a remedy only where it is allowed: plain text now split by document
        tail_ok = split == "document" and fmt == "text" and all(s.kind == "text" for s in sources)
        _check_result(work, progress, val_fraction, tail_ok)
        meta = _write_meta(encoding, reused, empty, column, t0)
        if work != out_dir:
            replace_dataset(out_dir)
            meta = read_meta(out_dir)
        if verbose:
            print_tokenize_summary(meta)
        else:
            report_skipped(meta.raw, sys.stderr)
        return meta


def _say_unused(spec: dict, sources: list[Source], text_column, tok_file, reused, asked) -> None:
    """A note for each option this dataset cannot use as asked (each was silently ignored)."""
    if text_column and all(s.kind == "text" for s in sources):
        print(f"note: text column {text_column!r} is not used: plain text files are read whole")
    if spec.get("max_tokens") is not None and spec["split"] == "tail":
        print(
            "note: max_tokens stops at the end of a document, and a plain text file is one document: each file "
            "is read whole (split a large file into smaller ones to stop sooner)"
        )
    if reused is not None and asked not in (None, reused.kind):
        print(
            f"note: {tok_file} is a {reused.kind} tokenizer, reused as is: tokenizer={asked!r} is not used"
        )


def prepare_text(
    inputs: Sequence[str | Path], out_dir: str | Path, tokenizer: str = "char", **options
) -> DatasetMeta:
    try:
        return prepare(inputs, out_dir, tokenizer, **options)
    except PrepareError as e:
        # notebook 02's data cell: RUN_NAME's folder, made from TEXT_PATH (no DATASET_NAME, no OVERWRITE there)
        nb02 = "set TEXT_PATH back to the text it was made from (or delete the folder), or choose a new RUN_NAME"
        # a BPE dataset named as the run (notebook 01's or 05's, finished or not): never to delete for notebook 02
        tok = Path(out_dir) / TOKENIZER_FILE
        if tok.is_file() and (_json(tok) or {}).get("kind") != "char":
            nb02 = "choose a new RUN_NAME (this folder holds a BPE dataset: notebook 01's or 05's)"
        raise PrepareError(str(e).replace(_elsewhere(), nb02)) if in_notebook() else e from None


def _check_options(
    val_fraction: float,
    split: str,
    shard_tokens: int,
    fmt: str,
    max_tokens: int | None,
    tokenizer: str,
    tokenizer_from,
) -> Path | None:
    """-> the tokenizer file to reuse, if any."""
    vf = "VAL_FRACTION" if in_notebook() else "--val-fraction"
    if not 0.0 < val_fraction < 1.0:
        raise PrepareError(f"{vf} {val_fraction} must be between 0 and 1 (exclusive)")
    if split not in ("auto", "document", "tail"):
        raise PrepareError(f"split={split!r}: choose 'auto', 'document' or 'tail'")
    if int(shard_tokens) < 1:
        raise PrepareError(f"shard_tokens={shard_tokens} must be >= 1")
    if fmt not in ("auto", "text", "chat"):
        raise PrepareError(f"format={fmt!r}: choose 'auto', 'text' or 'chat'")
    if max_tokens is not None and int(max_tokens) < 1:
        raise PrepareError(f"max_tokens={max_tokens} must be >= 1")
    if tokenizer not in ("char", "bpe", None):
        raise PrepareError(
            f"tokenizer {tokenizer!r}: choose 'char' or 'bpe', or pass tokenizer_from"
        )
    if fmt == "chat" and tokenizer == "char" and tokenizer_from is None:
        raise PrepareError(_needs_bpe("--format chat "))
    if tokenizer_from is None:
        return None
    p = Path(tokenizer_from)
    if p.is_dir():
        p = p / TOKENIZER_FILE
    if not p.is_file():
        # in a notebook, notebook 01's TOKENIZER_FILE (notebook 05's base run holds one: training writes it)
        flag = "TOKENIZER_FILE (notebook 01)" if in_notebook() else "--tokenizer-from"
        raise PrepareError(
            f"tokenizer file {p} does not exist ({flag} takes a run directory, a data directory, or a "
            f"tokenizer.json)"
        )
    return p


def _choose_split(split: str, sources: list[Source], fmt: str = "text") -> str:
    plain_text = fmt == "text" and all(s.kind == "text" for s in sources)
    if split == "auto":
        split = "tail" if plain_text and len(sources) < TAIL_SPLIT_MAX_FILES else "document"
    if split == "tail" and not plain_text:
        raise PrepareError(
            "--split tail works on plain text files only; jsonl/parquet documents and conversations "
            "are split per document (--split document)"
        )
    return split


def _spec(
    sources: list[Source],
    tokenizer_spec: dict,
    val_fraction: float,
    split: str,
    text_column: str | None,
    shard_tokens: int,
    fmt: str,
    max_tokens: int | None,
) -> dict:
    """What makes a dataset this dataset: a re-run with an equal spec reuses or resumes it, any other is refused."""
    return {
        "sources": [[s.size, s.hash] for s in sources],
        "tokenizer": tokenizer_spec,
        "val_fraction": val_fraction,
        # on_bad_file (the only policy now), and the keys below only where not the default: older datasets' specs
        "split": split,
        "text_column": text_column,
        "shard_tokens": int(shard_tokens),
        "on_bad_file": "skip",
        **({"format": fmt} if fmt != "text" else {}),
        **({"max_tokens": int(max_tokens)} if max_tokens is not None else {}),
    }


def _tokenizer_spec(
    tok_file: Path | None, tokenizer: str, vocab_size: int, train_max_bytes: int | None
) -> dict:
    """The spec's tokenizer: a reused file by its hash, else the kind to build (a BPE with its training settings)."""
    if tok_file:
        return {"file_sha256": sha256_file(tok_file)}
    if tokenizer == "char":
        return {"kind": "char"}
    return {"kind": "bpe", "vocab_size": int(vocab_size), "train_max_bytes": train_max_bytes}


def _new_tokenizer(
    reused: Tokenizer | None,
    spec: dict,
    sources: list[Source],
    text_column: str | None,
    skipped: list,
    verbose: bool,
) -> Tokenizer:
    """The tokenizer spec["tokenizer"] asks for: the reused one (with the chat tokens, for chat), a char vocabulary
    of the corpus, or a BPE trained on it."""
    fmt, tokenizer = spec.get("format", "text"), spec["tokenizer"]
    if reused is not None:
        if fmt != "chat":
            return reused
        if not isinstance(reused, BPETokenizer):
            raise PrepareError(_needs_bpe("--format chat "))
        try:
            return reused.with_special_tokens(CHAT_TOKENS)
        except TokenizerError as e:
            raise PrepareError(f"this tokenizer cannot hold chat data: {e}") from None
    if tokenizer["kind"] == "char":
        chars: set[str] = set()
        for text in train_texts(sources, text_column, None, skipped):
            chars.update(text)
        if not chars:
            raise PrepareError("the corpus has no text to build a char vocabulary from")
        return CharTokenizer.from_text(chars)
    vocab_size, train_max_bytes = tokenizer["vocab_size"], tokenizer["train_max_bytes"]
    t_tok = time.time()
    if verbose:
        lim = "all of it" if train_max_bytes is None else f"up to {train_max_bytes / 1e6:,.0f} MB"
        print(f"training a {vocab_size:,}-id byte-level BPE on {lim} ...")
    tok = BPETokenizer.train(
        train_texts(sources, text_column, train_max_bytes, skipped, fmt),
        vocab_size=vocab_size,
        extra_special=CHAT_TOKENS if fmt == "chat" else (),
    )
    if verbose:
        took = time.time() - t_tok
        print(f"tokenizer: {tok.kind}, vocab {tok.vocab_size:,}, trained in {took:.1f}s")
    return tok


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return None


def _previous_run(
    out_dir: Path, spec: dict, overwrite: bool, verbose: bool
) -> tuple[DatasetMeta | None, dict | None]:
    """(this spec's finished dataset, None), (None, the state of its unfinished run), or (None, None) to start."""
    if (out_dir / OVERWRITE_DIR / META_FILE).is_file():
        # an --overwrite stopped as its new dataset took the old one's place: ended now (with --overwrite or not:
        # the old one is part gone), and run again, done
        overwrite = replace_dataset(out_dir).get("prepare_spec") != spec and overwrite
    meta_path, state_path = out_dir / META_FILE, out_dir / PREPARE_STATE_FILE
    if meta_path.is_file():
        old = _json(meta_path) or {}
        # the same dataset is reused; --overwrite makes it again (one damaged since, say)
        if old.get("prepare_spec") == spec and not overwrite:
            if state_path.is_file():  # killed between meta.json and removing the state file
                state_path.unlink()
            elif verbose:
                print(f"{out_dir} already holds this dataset; reusing it")
            return read_meta(out_dir), None
        if not overwrite:
            # the same paths with other bytes (an edited file), another base's tokenizer: named, as they look the same
            was = old.get("prepare_spec") or {}
            differ = ", ".join(k for k in {**was, **spec} if was.get(k) != spec.get(k))
            a, b = was.get("tokenizer") or {}, spec["tokenizer"]
            # two BPEs (notebook 01's VOCAB_SIZE or TRAIN_MB changed): their settings with both values
            if a.get("kind") == b.get("kind") == "bpe":
                bpe = (f"{k} {a.get(k)} -> {v}" for k, v in b.items() if a.get(k) != v)
                differ = differ.replace("tokenizer", ", ".join(bpe))
            raise PrepareError(
                f"{out_dir} already holds a different dataset (sources "
                f"{[s.get('path') for s in old.get('sources', [])][:5]}, tokenizer "
                f"{old.get('tokenizer', {}).get('kind')}, vocab {old.get('vocab_size')}; it differs in: {differ}); "
                f"{_elsewhere()}"
            )
        state_path = out_dir / OVERWRITE_DIR / PREPARE_STATE_FILE  # an --overwrite's unfinished run
    # a state file is written atomically; an unreadable one is not ours to trust
    state = _json(state_path) if state_path.is_file() else None
    if state is None or state.get("spec") == spec:
        return None, state
    if not overwrite:
        raise PrepareError(
            f"{out_dir} holds an unfinished tokenize run of different inputs or options; finish it "
            f"with the ones it had, or {_elsewhere()}"
        )
    return None, None


def _elsewhere() -> str:
    # notebook 05 has no OVERWRITE (01 has): both name the folder by DATASET_NAME
    if in_notebook():
        return "choose another DATASET_NAME, or replace it: OVERWRITE = True in notebook 01, or delete the folder"
    return "choose another output directory or pass --overwrite / overwrite=True"


def _start(
    out_dir: Path, state: dict | None, pre_skipped: list, verbose: bool, new_tokenizer
) -> tuple[Tokenizer, dict]:
    """A resume checks the tokenizer and the completed shards; shards written after the last state save are redone."""
    clean_temp_files(out_dir)
    if state is None or not (out_dir / TOKENIZER_FILE).is_file():
        # first: a setting it refuses (a vocab_size too small) leaves nothing made (no OVERWRITE_DIR)
        tok = new_tokenizer()
        out_dir.mkdir(exist_ok=True)
        if verbose and out_dir.name == OVERWRITE_DIR:
            print(
                f"overwrite: the dataset in {out_dir.parent} stays as it is until the new one is complete"
            )
        for p in our_files(out_dir):  # an earlier run's, unfinished
            p.unlink()
        tok.save(out_dir)
        return tok, {
            "resume": {"file": 0, "doc": 0, "byte": 0, "char": 0},
            "emitted": {"train": 0, "val": 0},
            "stats": {
                "documents": 0,
                "characters": 0,
                "bytes": 0.0,
                "empty_documents": 0,
                "replaced_invalid_utf8": 0,
                "skipped_files": list(pre_skipped),
            },
            "shards": {"train": [], "val": []},
        }
    tok = load_tokenizer(out_dir / TOKENIZER_FILE)
    fix = f"delete {out_dir} to start it over" if out_dir.name == OVERWRITE_DIR else _elsewhere()
    if tok.identity()["hash"] != state["tokenizer"]["hash"]:
        raise PrepareError(
            f"{out_dir / TOKENIZER_FILE} differs from the tokenizer of the unfinished run in {out_dir}; {fix}"
        )
    shards = state["shards"]
    done = shards["train"] + shards["val"]
    listed = {s["file"] for s in done} | {s["spans"]["file"] for s in done if "spans" in s}
    for p in our_files(out_dir):
        if p.suffix == ".bin" and p.name not in listed:
            p.unlink()
    for s in done:
        try:
            check_shard(out_dir, s, dtype_for_vocab(tok.vocab_size))
        except DataFormatError:
            # a new VM's Drive may show a shard before its bytes: starting again would lose hours for nothing
            raise PrepareError(
                f"shard {out_dir / s['file']} of the unfinished run is missing or damaged, or on Google Drive may "
                f"not be synced yet: {DRIVE_ADVICE}; else {fix}"
            ) from None
    if verbose:
        print(
            f"resuming the unfinished run in {out_dir}: {len(shards['train'])} train / "
            f"{len(shards['val'])} val shards done"
        )
    return tok, {k: state[k] for k in ("resume", "emitted", "stats", "shards")}


def _check_result(out_dir: Path, progress: dict, val_fraction: float, tail_ok: bool) -> None:
    stats, emitted = progress["stats"], progress["emitted"]
    if emitted["train"] and emitted["val"]:
        return
    # nothing to resume: a re-run with the remedy (other inputs or options) starts over, not refused as another run's
    (out_dir / PREPARE_STATE_FILE).unlink(missing_ok=True)
    if emitted["train"] == 0:
        why = "".join(f"; skipped {s['path']}: {s['error']}" for s in stats["skipped_files"][:3])
        bad = stats.get("malformed_conversations", 0)
        if bad:
            why += f"; {bad:,} malformed conversations skipped, e.g. {stats['malformed_examples'][0]['reason']}"
        raise PrepareError(
            f"the corpus produced no training tokens ({stats['documents']} documents); "
            f"check the inputs and the text column{why}"
        )
    if emitted["val"] == 0:
        vf, more = "--val-fraction", ", or --split tail" if tail_ok else ""
        # notebook 01 has no split setting (auto: tail for under 100 plain text files), notebook 05 no VAL_FRACTION
        if in_notebook():
            vf, more = "VAL_FRACTION", " in notebook 01 (notebook 05 has none: more documents)"
        raise PrepareError(
            f"no document fell into the validation split ({stats['documents']:,} documents, "
            f"{vf} {val_fraction}); use more documents or a larger {vf}{more}"
        )


def _write_meta(p: Pass, reused: Tokenizer | None, empty: list, column: str | None, t0: float):
    """meta.json last (a half-written dataset never looks complete), then the resume state goes. tokenizer_base: a
    reused tokenizer before the chat tokens were added (fine-tuning checks that its model's vocabulary is a prefix of
    the data's)."""
    spec, stats, fmt = p.spec, p.stats, p.spec.get("format", "text")
    kept = ("documents", "characters", "empty_documents", "replaced_invalid_utf8", "skipped_files")
    extra: dict[str, Any] = {
        "format": fmt,
        **{k: stats[k] for k in kept},
        "empty_files": empty,
        "invalid_utf8_files": stats.get("invalid_utf8_files", []),
        "split": spec["split"],
        "val_fraction": spec["val_fraction"],
        "text_column": column if fmt == "chat" else spec["text_column"],
        "eot_id": p.tok.eot_id,
        "shard_tokens": spec["shard_tokens"],
        "prepare_spec": spec,
    }
    if reused is not None:
        extra["tokenizer_base"] = {
            "hash": reused.identity()["hash"],
            "vocab_size": int(reused.vocab_size),
        }
    if fmt == "chat":  # the pass checked that tok has the chat tokens
        extra.update(
            chat=ChatTemplate(p.tok).meta(),
            malformed_conversations=stats.get("malformed_conversations", 0),
            malformed_examples=stats.get("malformed_examples", []),
            assistant_tokens=stats.get("assistant_tokens", {"train": 0, "val": 0}),
        )
    if "max_tokens" in spec:
        extra.update(
            max_tokens=spec["max_tokens"],
            stop_reason="max_tokens" if p.stopped else "end_of_input",
            **({"stopped_at": p.stopped} if p.stopped else {}),
        )
    extra["elapsed_s"] = round(time.time() - t0, 3)
    write_meta(
        p.out_dir,
        vocab_size=p.tok.vocab_size,
        tokenizer=p.identity,
        splits={s: w.close() for s, w in p.writers.items()},
        sources=[s.record() for s in p.sources],
        extra=extra,
    )
    (p.out_dir / PREPARE_STATE_FILE).unlink()
    return read_meta(p.out_dir)
