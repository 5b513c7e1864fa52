"""Notebook 01's known corpora: where each one's files are on the Hub, its text column and a token budget. GPT-2 Small
on a Colab A100 sees about 1B tokens an hour: 2.8B tokens (what the original author trained on, about 10 GB of
github-code) is an afternoon."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from gptlib.errors import ConfigError


@dataclass(frozen=True)
class KnownSource:
    input: str | None  # the files; None: the user's INPUT, or the demo corpus
    text_column: str | None = None
    format: str = "text"
    max_tokens: int | None = None  # None = all of it
    note: str = ""


# Each names the repository's own parquet files: the Hub's parquet conversion of a split over ~5 GB holds only its
# first ~5 GB (docs/data.md says where these layouts were checked).
DEMO = "Tiny Shakespeare (demo)"
MY_FILES = "my files on Drive"
SOURCES: dict[str, KnownSource] = {
    # then how it was got: downloaded, or found in the cache
    DEMO: KnownSource(None, note="1.1 MB"),
    "TinyStories": KnownSource(
        "hf://datasets/roneneldan/TinyStories/data/train-*.parquet",
        "text",
        note="~2.1M short stories, ~0.5B tokens: all of it",
    ),
    "FineWeb-Edu sample-10BT": KnownSource(
        "hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT/*.parquet",
        "text",
        max_tokens=2_800_000_000,
        note="educational web pages (build-nanogpt's corpus), ~10B tokens",
    ),
    "OpenWebText": KnownSource(
        "hf://datasets/Skylion007/openwebtext/plain_text/train-*.parquet",
        "text",
        max_tokens=2_800_000_000,
        note="nanoGPT's GPT-2 reproduction corpus, ~9B tokens",
    ),
    "github-code (as the original author used it)": KnownSource(
        "hf://datasets/codeparrot/github-code/data/train-*.parquet",
        "code",
        max_tokens=2_800_000_000,
        note="source files in 30 languages, column `code`: 2.8B tokens is about 10 GB of its parquet",
    ),
    "UltraChat-200k (chat)": KnownSource(
        "hf://datasets/HuggingFaceH4/ultrachat_200k/data/train_sft-*.parquet",
        "messages",
        format="chat",
        note="200k multi-turn conversations (train_sft), for fine-tuning",
    ),
    MY_FILES: KnownSource(None, note="files, folders or globs in INPUT (any fsspec URL works too)"),
}


def parse_count(s: str | int | float | None) -> int | None:
    """2800000000, 2.8e9, "2.8B", "500M", "20K"; None, "" or 0 mean no limit."""
    t = str(s if s is not None else "").strip().upper().replace("_", "")
    if not t:
        return None
    # commas only between groups of thousands (2,800,000,000): "2,8B" is a decimal comma, read as 28B before
    if "," in t and not re.fullmatch(r"\d{1,3}(,\d{3})+", t.rstrip("KMBGT")):
        raise ConfigError(
            f"{s!r}: a comma only separates thousands here; write decimals with a dot (2.8B)"
        )
    t = t.replace(",", "")
    mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:], 1)
    try:
        n = float(t[:-1] if mult != 1 else t) * mult
    except ValueError:
        raise ConfigError(f"{s!r} is not a count (e.g. 2800000000, 2.8e9, 2.8B, 500M)") from None
    if n < 0:
        raise ConfigError(f"{s!r} must not be negative")
    if not math.isfinite(n):  # inf, nan, 1e400
        raise ConfigError(f"{s!r} is not a count (e.g. 2800000000, 2.8e9, 2.8B, 500M)")
    return int(round(n)) or None


def source_inputs(
    label: str,
    user_input: str = "",
    text_column: str = "",
    max_tokens: str = "",
    fmt: str = "",
    log=print,
) -> tuple[list, dict]:
    """Notebooks 01 and 05: (inputs, prepare()'s other options) for a dropdown choice. Files in INPUT
    (comma-separated) are the user's own and get no defaults; TEXT_COLUMN, MAX_TOKENS ("0" = all) and FORMAT win."""
    from gptlib.data.download import cached_tinyshakespeare, fetch_tinyshakespeare

    if label not in SOURCES:
        raise ConfigError(f"unknown source {label!r}; choose one of: {', '.join(SOURCES)}")
    inputs = [s.strip() for s in user_input.split(",") if s.strip()]
    if not inputs and label == MY_FILES:
        raise ConfigError(
            f"source {MY_FILES!r}: put the files, folders or globs in INPUT (comma-separated)"
        )
    # auto: conversations read as chat
    base = KnownSource(None, format="auto") if inputs else SOURCES[label]
    if not inputs and base.input:
        inputs = [base.input]
        log(f"source: {label}: {base.note}")
    elif not inputs:  # the demo corpus
        cached = cached_tinyshakespeare()
        inputs = [cached or fetch_tinyshakespeare()]
        how = "found in the cache, checksum-verified"
        if not cached:
            how = "downloaded and checksum-verified"
        log(f"source: {label}: {base.note}, {how} ({inputs[0]})")
    return inputs, {
        "text_column": text_column or base.text_column,
        "format": fmt or base.format,
        "max_tokens": parse_count(max_tokens) if str(max_tokens).strip() else base.max_tokens,
    }
