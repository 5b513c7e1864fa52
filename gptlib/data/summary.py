"""What a dataset holds, for people: the line tokenize ends with, notebook 01's statistics, what tokenize replaced or
skipped, and a decoded sample."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gptlib.data.shards import DatasetMeta, read_meta
from gptlib.data.tokenizer import TOKENIZER_FILE, load_tokenizer
from gptlib.errors import in_notebook


def print_tokenize_summary(meta: DatasetMeta) -> None:
    """The line tokenize ends with, then what it replaced or skipped."""
    m, n = meta.raw, meta.tokens("train") + meta.tokens("val")
    print(
        f"tokenized {len(m['sources'])} file(s), {m['documents']:,} documents, {m['characters']:,} "
        f"characters -> train {meta.tokens('train'):,} / val {meta.tokens('val'):,} tokens "
        f"({m['characters'] / max(1, n):.2f} chars/token, {meta.dtype.name}, vocab {meta.vocab_size:,}, "
        f"{len(meta.splits['train']['shards'])}+{len(meta.splits['val']['shards'])} shards) in "
        f"{m['elapsed_s']:.1f}s -> {meta.data_dir}"
    )
    if m.get("stop_reason") == "max_tokens":
        # stopped_at counts from 0; said from 1, as the documents above and a jsonl line number are
        print(
            f"stopped at {'MAX_TOKENS' if in_notebook() else '--max-tokens'} {m['max_tokens']:,}: after document "
            f"{m['stopped_at']['document'] + 1:,} of {m['stopped_at']['file']}, {n:,} tokens in all (a document is "
            f"never cut)"
        )
    report_problems(m)


def report_problems(m: dict) -> None:
    """What tokenize replaced or skipped (also recorded in meta.json)."""
    if replaced := m.get("replaced_invalid_utf8"):
        bad = m.get("invalid_utf8_files", [])  # an older gptlib's meta.json lists none
        where = f" in {len(bad)} file(s) (save them as UTF-8): {', '.join(bad[:5])}" if bad else ""
        print(f"warning: {replaced:,} invalid UTF-8 sequences were replaced by U+FFFD{where}")
    if empty := m.get("empty_files"):
        print(f"warning: {len(empty)} empty file(s) skipped: {', '.join(empty[:5])}")
    if m.get("empty_documents"):
        print(f"note: {m['empty_documents']:,} empty documents skipped")
    report_skipped(m)
    if malformed := m.get("malformed_conversations"):
        print(f"warning: {malformed:,} malformed conversations skipped; the first ones:")
        for ex in m.get("malformed_examples", []):
            print(f"  {ex['path']} record {ex['record']}: {ex['reason']}")


def report_skipped(m: dict, file=None) -> None:
    """The inputs (or parts) tokenize skipped: data lost, said even when quiet (on stderr then)."""
    for s in m.get("skipped_files", []):
        print(f"warning: skipped {s['path']}: {s['error']}", file=file)


def print_summary(data_dir: str | Path) -> None:
    """Notebook 01: the dataset's statistics, then what tokenize replaced or skipped."""
    meta = read_meta(data_dir)
    m, n, shards = meta.raw, meta.tokens("train") + meta.tokens("val"), meta.splits
    rows = {
        "data_dir": meta.data_dir,
        "source files": len(m["sources"]),
        "source MB": round(sum(s["size"] for s in m["sources"]) / 1e6, 3),
        "documents": m.get("documents"),
        "train tokens": meta.tokens("train"),
        "val tokens": meta.tokens("val"),
        "characters per token": round(m.get("characters", 0) / max(1, n), 3),
        "format": meta.format,
        "tokenizer": meta.tokenizer.get("kind"),
        "vocab size": meta.vocab_size,
        "dtype": meta.dtype.name,
        "shards (train + val)": f"{len(shards['train']['shards'])} + {len(shards['val']['shards'])}",
        "validation split": m.get("split"),
    }
    if meta.format == "chat":
        rows["assistant tokens (train)"] = m.get("assistant_tokens", {}).get("train", 0)
    if "max_tokens" in m:
        rows["stopped by max-tokens"] = "yes" if m.get("stop_reason") == "max_tokens" else "no"
    rows["seconds"] = m.get("elapsed_s")
    for key, value in rows.items():
        print(f"{key:>24}: {value:,}" if isinstance(value, int) else f"{key:>24}: {value}")
    report_problems(m)


def decoded_sample(data_dir: str | Path, n_tokens: int = 200) -> str:
    """The first n_tokens of the validation split, decoded: a quick look that the data is what it should be."""
    meta = read_meta(data_dir)
    tok = load_tokenizer(meta.data_dir / meta.tokenizer.get("file", TOKENIZER_FILE))
    return tok.decode(
        np.fromfile(meta.shard_paths("val")[0], dtype=meta.dtype.newbyteorder("<"), count=n_tokens)
    )
