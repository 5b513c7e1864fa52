"""--max-tokens: stop at the first document end at or after N tokens (train + val), documents never
cut, recorded in meta.json, the same after a kill and resume; the progress bar shows tokens."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gptlib.data.encode as genc
from gptlib.__main__ import _count
from gptlib.data.prepare import PrepareError, prepare
from gptlib.data.shards import read_meta
from gptlib.data.tokenizer import BPETokenizer, load_tokenizer
from tests.tokenize_kit import Killed, kill_at_encode_call, split_tokens

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def src(tmp_path_factory, docs) -> Path:
    p = tmp_path_factory.mktemp("src") / "a.jsonl"
    with open(p, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return p


def test_stops_at_the_first_document_end_at_or_after_n(tmp_path, src, docs, bpe_file, capsys):
    n = 20_000
    meta = prepare([src], tmp_path / "d", tokenizer_from=bpe_file, max_tokens=n, shard_tokens=3000)
    tok = load_tokenizer(tmp_path / "d")
    total = meta.tokens("train") + meta.tokens("val")
    k = meta.raw["documents"]
    last = len(tok.encode(docs[k - 1])) + 1  # the last document and its end-of-text id
    assert total >= n and total - last < n
    assert meta.raw["max_tokens"] == n and meta.raw["stop_reason"] == "max_tokens"
    assert meta.raw["stopped_at"] == {"file": str(src), "document": k - 1}
    got = []
    for split in ("train", "val"):
        ids = split_tokens(meta, split).astype(np.int64)
        ends = np.flatnonzero(ids == tok.eot_id)
        assert ends[-1] == ids.size - 1  # whole documents only
        got += [tok.decode(p[:-1].tolist()) for p in np.split(ids, ends + 1)[:-1]]
    assert sorted(got) == sorted(docs[:k])  # the first k documents, each whole
    out = capsys.readouterr()
    assert (
        f"stopped at --max-tokens {n:,}: after document {k:,} of {src}, {total:,} tokens in all"
        in out.out
    )
    assert "note: max_tokens" not in out.out
    # the bar counts tokens towards max_tokens, with tqdm's percentage and ETA ([elapsed<remaining]), and ends
    # complete at the true count
    assert re.search(r"tokenize: +\d+%\|.*\| [\d.]+k?/20\.0k \[", out.err), out.err
    assert re.search(
        rf"tokenize: 100%\|.*\| {total / 1e3:.1f}k/{total / 1e3:.1f}k "
        r"\[\d\d:\d\d<\d\d:\d\d, +[\d.]+k?tok/s\]\n",
        out.err,
    ), out.err


def test_a_budget_beyond_the_corpus_reads_it_all(tmp_path, src, docs, bpe_file):
    meta = prepare([src], tmp_path / "d", tokenizer_from=bpe_file, max_tokens=10**12, verbose=False)
    assert meta.raw["documents"] == len(docs) and meta.raw["stop_reason"] == "end_of_input"
    assert "stopped_at" not in meta.raw
    with pytest.raises(PrepareError, match="max_tokens=0 must be >= 1"):
        prepare([src], tmp_path / "e", tokenizer_from=bpe_file, max_tokens=0, verbose=False)


def test_a_killed_budgeted_run_resumes_to_the_same_stop(tmp_path, src, bpe_file, monkeypatch):
    monkeypatch.setattr(genc, "BATCH_CHARS", 20_000)
    opts = dict(tokenizer_from=bpe_file, max_tokens=100_000, shard_tokens=5000, verbose=False)
    clean = prepare([src], tmp_path / "clean", **opts)
    real = kill_at_encode_call(monkeypatch, 5)
    with pytest.raises(Killed):
        prepare([src], tmp_path / "out", **opts)
    monkeypatch.setattr(BPETokenizer, "encode_batch_ids", real)
    resumed = prepare([src], tmp_path / "out", **opts)
    assert resumed.splits == clean.splits and resumed.raw["stopped_at"] == clean.raw["stopped_at"]
    # another budget is another dataset: refused, not mixed
    with pytest.raises(PrepareError, match="already holds a different dataset"):
        prepare([src], tmp_path / "out", **dict(opts, max_tokens=90_000))


def test_cli_max_tokens(tmp_path, src, bpe_file):
    assert (
        _count("2.8B") == _count("2.8e9") == _count("2,800,000,000") == 2_800_000_000
        and _count("20K") == 20_000
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gptlib",
            "tokenize",
            "--input",
            str(src),
            "--tokenizer-from",
            str(bpe_file),
            "--max-tokens",
            "10K",
            "--out",
            str(tmp_path / "d"),
            "--quiet",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    m = read_meta(tmp_path / "d")
    assert m.raw["max_tokens"] == 10_000 and 10_000 <= m.tokens("train") + m.tokens("val") < 11_000
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gptlib",
            "tokenize",
            "--input",
            str(src),
            "--max-tokens",
            "lots",
            "--out",
            str(tmp_path / "e"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        r.returncode == 2
        and "'lots' is not a count (e.g. 2800000000, 2.8e9, 2.8B, 500M)" in r.stderr
    )


def test_a_stop_keeps_nothing_of_the_batch_read_ahead(tmp_path, src, bpe_file, monkeypatch):
    """The next batch is read while one encodes: a stop must leave out what that read found (here invalid
    UTF-8), as one batch at a time never read it."""
    monkeypatch.setattr(genc, "BATCH_CHARS", 20_000)
    # fills the stopping batch, so the next files are read ahead
    filler = tmp_path / "in" / "b_filler.txt"
    filler.parent.mkdir()
    filler.write_text("the quick brown fox jumps over the lazy dog\n" * 600)  # 26 K characters
    bad = tmp_path / "in" / "c_bad.txt"
    bad.write_bytes(b"caf\xe9 au lait " * 100)
    whole = prepare(
        [src], tmp_path / "whole", tokenizer_from=bpe_file, shard_tokens=3000, verbose=False
    )
    n = whole.tokens("train") + whole.tokens("val") - 2  # stops at src's last document
    meta = prepare(
        [src, filler, bad],
        tmp_path / "d",
        tokenizer_from=bpe_file,
        max_tokens=n,
        shard_tokens=3000,
        verbose=False,
    )
    assert meta.raw["stop_reason"] == "max_tokens" and meta.raw["stopped_at"]["file"] == str(src)
    assert meta.raw["replaced_invalid_utf8"] == 0
    # without the stop it is read and counted
    meta = prepare(
        [src, filler, bad],
        tmp_path / "all",
        tokenizer_from=bpe_file,
        shard_tokens=3000,
        verbose=False,
    )
    assert meta.raw["replaced_invalid_utf8"] == 100


@pytest.mark.parametrize("budget", [None, 20_000, 10**12])
def test_a_notebooks_bar_ends_complete_whatever_ended_the_pass(
    tmp_path, src, bpe_file, monkeypatch, budget
):
    """Notebook 05's bar ended red at "0% | 13.5k/20.0M": its total was MAX_TOKENS, not the data, and a notebook bar
    that closes short of its total is drawn as a failure. Whether the data or the budget ended the pass, the bar
    ends at its true count, drawn as a success."""
    pytest.importorskip("ipywidgets")
    import tqdm.auto
    from tqdm.notebook import tqdm as notebook_tqdm

    bars = []

    class Recorded(notebook_tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorded)
    meta = prepare([src], tmp_path / "d", tokenizer_from=bpe_file, max_tokens=budget)
    (bar,) = [b for b in bars if b.desc == "tokenize"]
    counted = meta.tokens("train") + meta.tokens("val") if budget else src.stat().st_size
    assert bar.n == bar.total == counted
    assert bar.container.children[1].bar_style == "success"


def test_a_plain_text_file_is_one_document_and_says_so(tmp_path, docs, capsys):
    """A plain text file is read whole, whatever max_tokens says (documents are never cut): tokenize says so before it
    reads, and its last line gives the tokens it wrote (it said only "stopped at --max-tokens N")."""
    src = tmp_path / "a.txt"
    src.write_text("\n\n".join(docs[:200]))
    meta = prepare([src], tmp_path / "d", tokenizer="char", max_tokens=1000)
    total = meta.tokens("train") + meta.tokens("val")
    assert total > 10 * 1000
    out = capsys.readouterr().out
    assert (
        "note: max_tokens stops at the end of a document, and a plain text file is one document"
        in out
    )
    assert (
        f"stopped at --max-tokens 1,000: after document 1 of {src}, {total:,} tokens in all" in out
    )


def test_a_plain_text_files_bar_counts_bytes(tmp_path, docs, monkeypatch):
    """A plain text file is read whole whatever max_tokens says: a bar of tokens towards it stood at
    '100% | 1.00k/1.00k' from the first batch on while the rest of the file was read (minutes for a large file, a
    notebook's bar drawn finished). It counts the file's bytes, as without max_tokens."""
    import tqdm.auto

    states = []

    class Recorded(tqdm.auto.tqdm):
        def update(self, n=1):
            super().update(n)
            states.append((self.n, self.total))

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorded)
    monkeypatch.setattr(genc, "BATCH_CHARS", 1)  # a batch per piece (64K characters)
    src = tmp_path / "a.txt"
    src.write_text("\n\n".join(docs))
    prepare([src], tmp_path / "d", tokenizer="char", max_tokens=1000)
    assert len(states) > 2 and all(n < total for n, total in states[:-1]), states
    assert states[-1] == (src.stat().st_size, src.stat().st_size)
