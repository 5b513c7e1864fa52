"""Streaming pre-tokenization: every input format, the document split, bad inputs, resume after
a kill, uint32 shards, refusal of a different dataset, bounded memory on a 100 MB line."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import gptlib.data.encode as genc
import gptlib.data.inputs as inputs
import gptlib.data.sources as gsources
import gptlib.data.sources as sources
from gptlib.data.prepare import PrepareError, prepare, prepare_text
from gptlib.data.shards import PREPARE_STATE_FILE, DataFormatError, read_meta
from gptlib.data.tokenizer import EOT, BPETokenizer, load_tokenizer
from gptlib.errors import GptlibError
from tests.tokenize_kit import (
    SLOW_PRELUDE,
    Killed,
    kill_at_encode_call,
    sigkill_after_shards,
    split_tokens,
    verified_meta,
)

REPO = Path(__file__).resolve().parents[1]
# tiny vocab: trains in a fraction of a second
BPE = dict(tokenizer="bpe", vocab_size=300, verbose=False)


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    with open(path, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")
    return path


def write_parquet(
    path: Path, docs: list[str], column: str = "text", row_group_size: int = 200
) -> Path:
    pq.write_table(
        pa.table({column: docs, "n": list(range(len(docs)))}), path, row_group_size=row_group_size
    )
    return path


def decoded_documents(out: Path) -> dict[str, list[str]]:
    """Each split decoded and cut at the end-of-text ids: the documents it holds."""
    meta = verified_meta(out)
    tok = load_tokenizer(out)
    result = {}
    for split in ("train", "val"):
        ids = split_tokens(meta, split).astype(np.int64)
        ends = np.flatnonzero(ids == tok.eot_id)
        assert ends.size == 0 or ends[-1] == ids.size - 1, "a split ends with a whole document"
        result[split] = [tok.decode(part[:-1].tolist()) for part in np.split(ids, ends + 1)[:-1]]
    return result


def files_of(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


# ------------------------------------------------------------------------------------------ formats


def test_char_single_document_uses_the_tail_split(small_text, tmp_path):
    meta = prepare_text([small_text], tmp_path / "d", verbose=False)
    text = small_text.read_text()
    tok = load_tokenizer(tmp_path / "d")
    assert meta.raw["split"] == "tail" and meta.raw["documents"] == 1
    assert meta.tokens("train") == int(len(text) * 0.9)  # ASCII: bytes == characters
    assert tok.decode(split_tokens(meta, "train")) + tok.decode(split_tokens(meta, "val")) == text


def test_jsonl_documents_are_separated_by_eot_and_split_per_document(tmp_path, docs):
    src = write_jsonl(tmp_path / "a.jsonl", docs)
    meta = prepare([src], tmp_path / "out", **BPE)
    got = decoded_documents(tmp_path / "out")
    assert meta.raw["documents"] == len(docs) and meta.raw["split"] == "document"
    assert sorted(got["train"] + got["val"]) == sorted(docs)  # every document whole, exactly once
    assert 0.05 < len(got["val"]) / len(docs) < 0.15  # val_fraction=0.1 of the documents
    assert (
        meta.raw["sources"][0]["hash"].startswith("sha256:") and meta.raw["sources"][0]["size"] > 0
    )


def test_a_json_file_is_read_as_json_lines(tmp_path, docs, bpe_file):
    """The Hub's .json datasets are JSON lines: read as plain text, their keys and escapes were tokenized and
    --text-column ignored. An array is refused at its first line."""
    src = write_jsonl(tmp_path / "a.json", docs, field="story")
    prepare([src], tmp_path / "out", tokenizer_from=bpe_file, text_column="story", verbose=False)
    got = decoded_documents(tmp_path / "out")
    assert sorted(got["train"] + got["val"]) == sorted(docs)
    (tmp_path / "array.json").write_text(json.dumps([{"text": d} for d in docs[:3]]))
    with pytest.raises(PrepareError, match=r"array\.json:1"):
        prepare([tmp_path / "array.json"], tmp_path / "out2", **BPE)


def test_a_text_column_for_plain_text_files_is_said_to_be_unused(tmp_path, docs, capsys):
    """Plain text files are read whole: a text column given for them says it is not used (it was silently ignored)."""
    src = tmp_path / "a.txt"
    src.write_text("\n".join(docs))
    prepare([src], tmp_path / "out", tokenizer="char", text_column="story")
    assert (
        "note: text column 'story' is not used: plain text files are read whole"
        in capsys.readouterr().out
    )


def test_a_character_the_char_tokenizer_lacks_names_its_file_and_record(tmp_path):
    """A reused char tokenizer meeting a new character: the error names the input (and the jsonl line), not a
    position within one of the 64K-character pieces a file is encoded in."""
    (tmp_path / "a.txt").write_text("abc\n" * 100)
    prepare([tmp_path / "a.txt"], tmp_path / "chars", tokenizer="char", verbose=False)
    (tmp_path / "b.txt").write_text("abc\n" * 30_000 + "cab\u00e9\n")
    src = write_jsonl(tmp_path / "c.jsonl", ["abc", "cba", "ab\u00e9"])
    for path, where in [(tmp_path / "b.txt", "b.txt"), (src, "c.jsonl record 3")]:
        with pytest.raises(
            GptlibError, match=rf"'\u00e9' \(U\+00E9\) in \S*{where} is not in the char vocab"
        ):
            prepare([path], tmp_path / path.stem, tokenizer_from=tmp_path / "chars", verbose=False)


def test_a_tokenizer_kind_the_reused_tokenizer_is_not_says_so(tmp_path, capsys):
    """--tokenizer bpe with --tokenizer-from a char dataset: the reused one is used, and a note says the kind asked
    for is not (it was silently ignored)."""
    (tmp_path / "a.txt").write_text("abc\n" * 100)
    prepare([tmp_path / "a.txt"], tmp_path / "chars", tokenizer="char", verbose=False)
    meta = prepare(
        [tmp_path / "a.txt"], tmp_path / "d", tokenizer="bpe", tokenizer_from=tmp_path / "chars"
    )
    assert (
        meta.vocab_size == 4
        and "is a char tokenizer, reused as is: tokenizer='bpe' is not used"
        in (capsys.readouterr().out)
    )


def test_parquet_with_selected_column_many_row_groups(tmp_path, docs, bpe_file):
    src = write_parquet(tmp_path / "a.parquet", docs, column="code", row_group_size=97)
    meta = prepare(
        [src], tmp_path / "out", tokenizer_from=bpe_file, text_column="code", verbose=False
    )
    got = decoded_documents(tmp_path / "out")
    assert sorted(got["train"] + got["val"]) == sorted(docs)
    # reused as-is
    assert meta.tokenizer["hash"] == hashlib.sha256(bpe_file.read_bytes()).hexdigest()


def test_parquet_restart_deep_inside_a_big_row_group(tmp_path):
    # A resume position 2,500 rows into one 3,000-row group: the rows before it span several
    # read batches of 1,024 rows, and every one of them must be skipped.
    docs = [f"document number {i}" for i in range(3000)]
    src = write_parquet(tmp_path / "a.parquet", docs, row_group_size=3000)
    s = inputs.source(src)
    pieces = list(
        sources.iter_parquet_file(
            s, 0, {"file": 0, "doc": 2500, "byte": 0, "char": 0}, "text", "text", []
        )
    )
    assert [p.doc for p in pieces] == list(range(2500, 3000))
    assert [p.text for p in pieces] == docs[2500:]


def test_split_is_deterministic_and_by_document(tmp_path, docs, bpe_file):
    a = prepare(
        [write_jsonl(tmp_path / "a.jsonl", docs)],
        tmp_path / "o1",
        tokenizer_from=bpe_file,
        verbose=False,
    )
    b = prepare(
        [write_jsonl(tmp_path / "b.jsonl", docs)],
        tmp_path / "o2",
        tokenizer_from=bpe_file,
        verbose=False,
    )
    assert a.splits == b.splits  # same content -> same split, same shards (renamed file included)
    # a document at another position in the file is another document: the split is not the tail
    got = decoded_documents(tmp_path / "o1")
    val_positions = [docs.index(d) for d in got["val"]]
    assert min(val_positions) < len(docs) // 2


def test_an_empty_validation_split_names_only_remedies_that_work(tmp_path):
    """Three documents at val_fraction 0.01 leave the validation split empty. The message advised split='tail'
    also for jsonl, which split='tail' then refuses; it advises it only where it is allowed."""
    three = ["To be or not to be.", "All the world's a stage.", "Now is the winter."]
    src = write_jsonl(tmp_path / "a.jsonl", three)
    with pytest.raises(PrepareError, match="no document fell into the validation split") as e:
        prepare_text([src], tmp_path / "o1", val_fraction=0.01, verbose=False)
    assert "tail" not in str(e.value)
    with pytest.raises(PrepareError, match="plain text files only"):
        prepare_text([src], tmp_path / "o2", val_fraction=0.01, split="tail", verbose=False)
    txts = [tmp_path / f"{i}.txt" for i in range(3)]
    for f, d in zip(txts, three):
        f.write_text(d)
    with pytest.raises(PrepareError, match="or --split tail"):
        prepare_text(txts, tmp_path / "o3", val_fraction=0.01, split="document", verbose=False)
    meta = prepare_text(txts, tmp_path / "o4", val_fraction=0.01, split="tail", verbose=False)
    assert meta.tokens("val") > 0


def test_the_advice_of_an_empty_split_works_as_given(tmp_path, monkeypatch, bpe_file):
    """tokenize's empty validation split said 'a larger val_fraction, or split='tail'' (Python names) on the command
    line; following it in the same --out was refused as 'an unfinished tokenize run of different inputs or options;
    finish it with the ones it had', which can only fail again. The same for no training tokens and 'check ... the
    text column'. It names the flags (notebook 01's VAL_FRACTION in a notebook, which has no split setting), and a
    re-run with the remedy starts over."""
    from types import SimpleNamespace

    three = ["To be or not to be.", "All the world's a stage.", "Now is the winter."]
    txts = [tmp_path / f"{i}.txt" for i in range(3)]
    for f, d in zip(txts, three):
        f.write_text(d)
    out = tmp_path / "o"
    with pytest.raises(PrepareError) as e:
        prepare_text(txts, out, val_fraction=0.01, split="document", verbose=False)
    assert str(e.value) == (
        "no document fell into the validation split (3 documents, --val-fraction 0.01); use more documents or a "
        "larger --val-fraction, or --split tail"
    )
    assert (
        prepare_text(txts, out, val_fraction=0.5, split="document", verbose=False).tokens("val") > 0
    )
    with pytest.raises(PrepareError):
        prepare_text(txts, tmp_path / "o2", val_fraction=0.01, split="document", verbose=False)
    assert prepare_text(txts, tmp_path / "o2", split="tail", verbose=False).tokens("val") > 0
    # records whose text field is empty: no training tokens; the right column, in the same --out, is read
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": "", "body": d}) + "\n" for d in three * 20))
    with pytest.raises(PrepareError, match="produced no training tokens"):
        prepare([src], tmp_path / "o3", tokenizer_from=bpe_file, verbose=False)
    meta = prepare(
        [src], tmp_path / "o3", tokenizer_from=bpe_file, text_column="body", verbose=False
    )
    assert meta.tokens("train") > 0
    kernel = SimpleNamespace(get_ipython=lambda: SimpleNamespace(kernel=object()))
    monkeypatch.setitem(sys.modules, "IPython", kernel)
    with pytest.raises(PrepareError) as e:
        prepare(txts, tmp_path / "o4", "char", val_fraction=0.001, split="document", verbose=False)
    assert str(e.value).endswith(
        "(3 documents, VAL_FRACTION 0.001); use more documents or a larger VAL_FRACTION in notebook 01 (notebook "
        "05 has none: more documents)"
    )
    with pytest.raises(PrepareError, match="^VAL_FRACTION 0 must be between 0 and 1"):
        prepare_text(txts, tmp_path / "o5", val_fraction=0)


def test_a_missing_text_column_names_notebook_01s_setting(tmp_path, monkeypatch, docs):
    """Notebook 01 on records without the text field was told 'choose one with --text-column / text_column=', a flag
    and a keyword it has no place for: it names TEXT_COLUMN; the command line is as before (test_cli_...)."""
    from types import SimpleNamespace

    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"title": "t", "body": d}) + "\n" for d in docs[:5]))
    kernel = SimpleNamespace(get_ipython=lambda: SimpleNamespace(kernel=object()))
    monkeypatch.setitem(sys.modules, "IPython", kernel)
    with pytest.raises(PrepareError) as e:
        prepare([src], tmp_path / "o", "char", verbose=False)
    # notebook 05 has no TEXT_COLUMN: going to notebook 01 would tokenize 01's dataset, not 05's
    assert str(e.value).endswith(
        "(fields: title, body); choose one with TEXT_COLUMN in notebook 01 (notebook 05 has none: a 'text' field "
        "or conversations)"
    )


def test_txt_directory_glob_and_mixed_formats(tmp_path, docs, bpe_file):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    for i, doc in enumerate(docs[:150]):
        (d / "sub" / f"{i:04d}.txt").write_text(doc)
    (d / ".hidden.txt").write_text("never read")
    write_jsonl(tmp_path / "x.jsonl", docs[150:300])
    meta = prepare(
        [d, str(tmp_path / "*.jsonl")], tmp_path / "out", tokenizer_from=bpe_file, verbose=False
    )
    got = decoded_documents(tmp_path / "out")
    assert meta.raw["split"] == "document"  # 150 text files + jsonl: per document
    assert sorted(got["train"] + got["val"]) == sorted(docs[:300])
    assert len(meta.raw["sources"]) == 151


def test_literal_endoftext_stays_text(tmp_path, bpe_file):
    docs = [f"doc {i} says {EOT} twice {EOT}." for i in range(200)]
    prepare(
        [write_jsonl(tmp_path / "a.jsonl", docs)],
        tmp_path / "out",
        tokenizer_from=bpe_file,
        verbose=False,
    )
    got = decoded_documents(tmp_path / "out")
    assert sorted(got["train"] + got["val"]) == sorted(docs)  # 200 documents, not 600


def test_long_line_is_cut_into_pieces_and_round_trips(tmp_path, monkeypatch, bpe_file):
    monkeypatch.setattr(gsources, "PIECE_CHARS", 1000)
    monkeypatch.setattr(genc, "BATCH_CHARS", 5000)
    words = " ".join(f"w{i}é" for i in range(20000))  # one 130 kB line, non-ASCII, no newline
    line = tmp_path / "line.txt"
    line.write_text(words)
    meta = prepare([line], tmp_path / "out", tokenizer_from=bpe_file, verbose=False)
    tok = load_tokenizer(tmp_path / "out")
    text = tok.decode(
        np.concatenate([split_tokens(meta, "train"), split_tokens(meta, "val")]).tolist()
    )
    assert text == words + EOT and meta.raw["replaced_invalid_utf8"] == 0


def test_uint32_shards_when_the_vocab_exceeds_65536(tmp_path):
    chars = "".join(chr(0x20000 + i) for i in range(70_000))  # 70,000 distinct characters
    src = tmp_path / "wide.txt"
    src.write_text(chars + chars[::-1])
    meta = prepare_text([src], tmp_path / "out", verbose=False)
    assert meta.vocab_size == 70_000 and meta.dtype == np.uint32 and meta.raw["dtype"] == "uint32"
    ids = np.concatenate([split_tokens(meta, "train"), split_tokens(meta, "val")])
    assert ids.max() == 69_999 and (
        tmp_path / "out" / "train_000000.bin"
    ).stat().st_size == 4 * meta.tokens("train")
    assert load_tokenizer(tmp_path / "out").decode(ids) == chars + chars[::-1]


# --------------------------------------------------------------------------------------- bad input


def test_invalid_utf8_is_replaced_and_counted(tmp_path, bpe_file, capsys):
    src = tmp_path / "bad.txt"
    # 4 invalid sequences per line (\xff, \xfe, a lone lead byte, a truncated 3-byte sequence) and one
    # genuine U+FFFD (\xef\xbf\xbd), which is text and must not be counted.
    src.write_bytes(
        b"good text \xff\xfe more \xc3 text \xe2\x82 end \xef\xbf\xbd real replacement char\n" * 3
    )
    meta = prepare([src], tmp_path / "out", tokenizer_from=bpe_file, verbose=True)
    assert meta.raw["replaced_invalid_utf8"] == 4 * 3
    tok = load_tokenizer(tmp_path / "out")
    text = tok.decode(
        np.concatenate([split_tokens(meta, "train"), split_tokens(meta, "val")]).tolist()
    )
    assert text == src.read_bytes().decode("utf-8", "replace") + EOT
    assert "invalid UTF-8 sequences were replaced" in capsys.readouterr().out


def test_the_invalid_utf8_warning_names_the_files(tmp_path, shakespeare_path, monkeypatch, capsys):
    """Latin-1 / Windows-1252 files (each accented letter one invalid byte) among UTF-8 ones: the warning names them,
    the first five and how many, so that the user knows which to save as UTF-8 (it gave only the count)."""
    monkeypatch.setattr(genc, "BATCH_CHARS", 20_000)  # batches across the files
    corpus = tmp_path / "in"
    corpus.mkdir()
    good = shakespeare_path.read_text()[:50_000]
    (corpus / "a_good.txt").write_text(good)
    latin = [corpus / f"b_latin{i}.txt" for i in range(7)]
    for f in latin:
        f.write_bytes("Café crème brûlée, naïve.\n".encode("cp1252") + good[:30_000].encode())
    (corpus / "c_good.txt").write_text(good)
    meta = prepare([corpus], tmp_path / "out", tokenizer="char", verbose=True)
    assert meta.raw["invalid_utf8_files"] == [str(f) for f in latin]
    warning = [ln for ln in capsys.readouterr().out.splitlines() if "U+FFFD" in ln]
    assert warning == [
        f"warning: {5 * 7} invalid UTF-8 sequences were replaced by U+FFFD in 7 file(s) (save them as "
        f"UTF-8): {', '.join(map(str, latin[:5]))}"
    ]


def test_lone_surrogate_escapes_are_replaced_and_counted(tmp_path, capsys):
    """A cut emoji's "\\ud83d" in JSON is a lone surrogate, which UTF-8 cannot encode: replaced by U+FFFD and counted
    as invalid UTF-8 is (char, BPE and chat alike). An escaped pair is the emoji; an escaped backslash is text."""
    from gptlib.__main__ import main

    lines = ['{"text": "a\\ud83d b \\uDE00 c"}', '{"text": "\\ud83d\\ude00 \\\\ud83d"}']
    src = tmp_path / "sur.jsonl"
    src.write_text("\n".join(lines + ['{"text": "hello there friend"}'] * 30) + "\n")
    assert main(["tokenize", "--input", str(src), "--out", str(tmp_path / "char")]) == 0
    assert "2 invalid UTF-8 sequences were replaced" in capsys.readouterr().out
    meta = prepare([src], tmp_path / "bpe", **BPE)
    assert meta.raw["replaced_invalid_utf8"] == 2
    for out in ("char", "bpe"):
        meta, tok = read_meta(tmp_path / out), load_tokenizer(tmp_path / out)
        text = "".join(tok.decode(split_tokens(meta, s).tolist()) for s in ("train", "val"))
        assert "a\ufffd b \ufffd c" in text and "\U0001f600 \\ud83d" in text
    chat = tmp_path / "chat.jsonl"
    turn = (
        '{"messages": [{"role": "user", "content": "%s"}, {"role": "assistant", "content": "b"}]}'
    )
    chat.write_text("\n".join([turn % "hi \\udc00"] + [turn % "hello"] * 30) + "\n")
    assert prepare([chat], tmp_path / "c", **BPE).raw["replaced_invalid_utf8"] == 1


def test_a_utf8_bom_before_a_jsonl_file_is_dropped(tmp_path, docs, capsys):
    """Windows tools (Notepad, Excel) start a saved file with a UTF-8 BOM: its first line was refused as not JSON.
    The BOM is dropped as utf-8-sig drops it (format detection too): the tokenizer and the documents are those of
    the file without it, for text and chat records alike. (Which documents are held out is seeded by the file's
    bytes, BOM included, as for any other change to the file.)"""
    from gptlib.__main__ import main

    turn = (
        '{"messages": [{"role": "user", "content": "%s"}, {"role": "assistant", "content": "ok"}]}'
    )
    records = {
        "text": [json.dumps({"text": d}) for d in docs[:40]],
        "chat": [turn % d.replace("\n", " ").replace('"', "'") for d in docs[:40]],
    }
    for kind, lines in records.items():
        body = ("\n".join(lines) + "\n").encode()
        outs = []
        for name, data in ((f"{kind}.jsonl", body), (f"{kind}_bom.jsonl", b"\xef\xbb\xbf" + body)):
            (tmp_path / name).write_bytes(data)
            outs.append(tmp_path / f"out_{name}")
            argv = ["tokenize", "--input", str(tmp_path / name), "--out", str(outs[-1])]
            assert main(argv + ["--vocab-size", "300", "--quiet"]) == 0, capsys.readouterr().err
        assert read_meta(outs[1]).format == kind
        assert (outs[0] / "tokenizer.json").read_bytes() == (
            outs[1] / "tokenizer.json"
        ).read_bytes()
        plain, bom = (decoded_documents(out) for out in outs)
        assert sorted(bom["train"] + bom["val"]) == sorted(plain["train"] + plain["val"])
        assert "\ufeff" not in "".join(bom["train"] + bom["val"])


def test_utf16_or_binary_text_input_is_refused_naming_it(tmp_path, docs):
    """A .txt file saved as UTF-16 (Notepad's 'Unicode', Windows PowerShell's `>`, Excel's 'Unicode Text') or a
    binary file in an input folder (an image, a PDF) was tokenized as UTF-8 text: a NUL between every letter, or
    garbage, said only as a count of replaced bytes (a UTF-16 .jsonl: 'not valid JSON'). Now one line names the file
    and says why, and an existing dataset stays."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("\n".join(docs[:200]))
    out = tmp_path / "out"
    before = prepare([corpus], out, "char", verbose=False)
    shards = {p.name: p.read_bytes() for p in out.iterdir()}
    records = "".join(json.dumps({"text": d}) + "\n" for d in docs[200:400])
    bad = {  # -> where the message says it is
        "b.txt": ("\n".join(docs[200:400]).encode("utf-16"), "input file {} is"),
        "cover.png": (
            b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4,
            "input file {} is",
        ),
        "c.jsonl": (records.encode("utf-16"), "{}:1:"),
    }
    for name, (data, where) in bad.items():
        (corpus / name).write_bytes(data)
        for tok in ("char", "bpe"):
            said = where.format(corpus / name) + " not UTF-8 text: it holds NUL bytes (UTF-16"
            with pytest.raises(PrepareError, match=re.escape(said)):
                opts = BPE if tok == "bpe" else {"verbose": False}
                prepare([corpus], out, **{"tokenizer": tok, **opts, "overwrite": True})
        (corpus / name).unlink()
        assert {p.name: p.read_bytes() for p in out.iterdir()} == shards
    assert read_meta(out).raw["documents"] == before.raw["documents"]


def test_os_junk_files_in_an_input_folder_are_skipped(tmp_path, docs):
    """A Drive folder synced from a desktop holds Thumbs.db and desktop.ini (Windows) and .DS_Store (macOS): tokenize
    of the folder stopped at the first with the NUL-byte refusal, files the user never put there. A folder listing
    (local or a URL) skips them as it skips hidden files, and so does a wildcard (DIR/**), as Python's glob skips hidden
    files; one named on its own is still refused."""
    import fsspec

    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("\n".join(docs[:200]))
    junk = {
        "Thumbs.db": b"\xd0\xcf\x11\xe0\x00\x00",
        "sub/desktop.ini": "[.ShellClassInfo]".encode("utf-16"),
    }
    for name, data in {**junk, "sub/.DS_Store": b"\x00\x00\x00\x01Bud1"}.items():
        (corpus / name).write_bytes(data)
    mem = fsspec.filesystem("memory")
    for p in (p for p in corpus.rglob("*") if p.is_file()):
        mem.pipe("/junktest/" + p.relative_to(corpus).as_posix(), p.read_bytes())
    try:
        given_as = (corpus, "memory://junktest", f"{corpus}/**", "memory://junktest/**")
        for i, given in enumerate(given_as):
            meta = prepare([given], tmp_path / f"out{i}", "char", verbose=False)
            assert [Path(s["path"]).name for s in meta.raw["sources"]] == ["a.txt"]
    finally:
        mem.rm("/junktest", recursive=True)
    for name in junk:
        with pytest.raises(
            PrepareError, match=re.escape(f"input file {corpus / name} is not UTF-8 text")
        ):
            prepare([corpus / name], tmp_path / "one", "char", verbose=False)


def test_os_junk_files_in_a_dataset_folder_do_not_stop_a_re_run(tmp_path, docs):
    """A dataset on Drive opened in Finder or Explorer (Drive for desktop) gains .DS_Store, Thumbs.db or desktop.ini:
    notebook 01 re-run was refused, '--out ... holds files tokenize did not write (.DS_Store)'. They are not the
    user's files: the finished dataset is found, and made again with OVERWRITE; another file is still refused."""
    (tmp_path / "a.txt").write_text("\n".join(docs[:200]))
    out = tmp_path / "out"
    first = prepare([tmp_path / "a.txt"], out, "char", verbose=False)
    for name in (".DS_Store", "Thumbs.db", "desktop.ini"):
        (out / name).write_bytes(b"\x00\x00\x00\x01")
    assert prepare([tmp_path / "a.txt"], out, "char", verbose=False).raw == first.raw
    again = prepare([tmp_path / "a.txt"], out, "char", verbose=False, overwrite=True)
    assert again.splits == first.splits and (out / "Thumbs.db").is_file()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(PrepareError, match=re.escape("did not write (notes.txt)")):
        prepare([tmp_path / "a.txt"], out, "char", verbose=False)


def test_the_nul_byte_refusal_names_notebook_01s_input_in_a_notebook(tmp_path, monkeypatch):
    """In notebook 01 (or 05) the line said 'leave it out of --input', a flag a notebook does not have: it names the
    notebook's INPUT, for a .txt and a .jsonl file alike."""
    import IPython

    monkeypatch.setattr(IPython, "get_ipython", lambda: type("Kernel", (), {"kernel": 1})())
    for name, text in (("b.txt", "to be or not\n" * 3), ("c.jsonl", '{"text": "to be"}\n' * 3)):
        (tmp_path / name).write_bytes(text.encode("utf-16"))
        with pytest.raises(PrepareError) as e:
            prepare([tmp_path / name], tmp_path / "out", tokenizer="char", verbose=False)
        assert str(e.value).endswith(
            "save it as UTF-8, or leave it out of INPUT (e.g. a glob: DIR/*.txt)"
        )


def test_a_dataset_inside_an_input_folder_is_not_read_as_text(tmp_path, docs):
    """--out inside the corpus folder, then a second dataset of it (another vocab, a new --out beside the first):
    the first dataset's files were inputs, and tokenize failed on 'corpus/data/meta.json:1: not valid JSON', as if
    that dataset were damaged. A folder holding a tokenizer.json (a dataset or a run) inside an input folder is
    skipped, as --out itself is: the second dataset is made of the corpus alone."""
    corpus = tmp_path / "corpus"
    (corpus / "more").mkdir(parents=True)
    (corpus / "a.txt").write_text("\n".join(docs[:300]))
    write_jsonl(corpus / "more" / "b.jsonl", docs[300:600])
    first = prepare([corpus], corpus / "data", **BPE)
    second = prepare([corpus], corpus / "data_bpe", **{**BPE, "vocab_size": 320})
    for meta in (first, second):
        assert [s["path"] for s in meta.raw["sources"]] == [
            str(corpus / "a.txt"),
            str(corpus / "more" / "b.jsonl"),
        ]
    assert second.raw["documents"] == first.raw["documents"]
    # the same for a recursive glob and a file:// folder (they read the datasets' files: 'data/meta.json:1: not
    # valid JSON'); a dataset folder named on its own is read as asked
    for i, given in enumerate(
        [f"{corpus}/**", f"{corpus}/**/*.json*", f"file://{corpus}", f"file://{corpus}/**"]
    ):
        meta = prepare([given], tmp_path / f"other{i}", **BPE)
        assert [s["path"].removeprefix("file://") for s in meta.raw["sources"]] == [
            str(corpus / "a.txt"),
            str(corpus / "more" / "b.jsonl"),
        ][given.endswith("*.json*") :], given
    with pytest.raises(PrepareError, match="meta.json:1: not valid JSON"):
        prepare([corpus / "data" / "**"], tmp_path / "asked", **BPE)


def test_empty_files_are_skipped_and_reported(tmp_path, docs, bpe_file):
    (tmp_path / "empty.txt").write_text("")
    write_jsonl(tmp_path / "a.jsonl", docs[:300] + [""])
    with open(tmp_path / "a.jsonl", "a") as f:
        f.write("\n" + json.dumps({"text": None}) + "\n")
    meta = prepare(
        [tmp_path / "empty.txt", tmp_path / "a.jsonl"],
        tmp_path / "out",
        tokenizer_from=bpe_file,
        verbose=False,
    )
    assert meta.raw["empty_files"] == [str(tmp_path / "empty.txt")]
    assert meta.raw["documents"] == 300 and meta.raw["empty_documents"] == 3
    with pytest.raises(PrepareError, match="empty.txt is empty"):
        prepare([tmp_path / "empty.txt"], tmp_path / "out2", tokenizer_from=bpe_file, verbose=False)


def test_missing_column_or_field_is_a_clear_error(tmp_path, docs, bpe_file):
    pqf = write_parquet(tmp_path / "a.parquet", docs[:50], column="content")
    with pytest.raises(
        PrepareError, match=r"a.parquet has no column 'text' \(columns: content, n\)"
    ):
        prepare([pqf], tmp_path / "o1", tokenizer_from=bpe_file, verbose=False)
    with pytest.raises(PrepareError, match="column 'n' has type int64, not text"):
        prepare([pqf], tmp_path / "o1", tokenizer_from=bpe_file, text_column="n", verbose=False)
    js = write_jsonl(tmp_path / "a.jsonl", docs[:50], field="body")
    with pytest.raises(PrepareError, match=r"a.jsonl:1 has no field 'text' \(fields: id, body\)"):
        prepare([js], tmp_path / "o2", tokenizer_from=bpe_file, verbose=False)
    with open(js, "a") as f:
        f.write('{"id": 50}\n')
    with pytest.raises(PrepareError, match=r"a.jsonl:51 has no field 'body'"):
        prepare([js], tmp_path / "o3", tokenizer_from=bpe_file, text_column="body", verbose=False)
    assert not (tmp_path / "o3" / "meta.json").exists()
    with pytest.raises(DataFormatError, match="not a finished gptlib dataset"):
        read_meta(tmp_path / "o3")


def test_truncated_parquet_is_skipped_with_a_report(tmp_path, docs, bpe_file):
    good = write_parquet(tmp_path / "a.parquet", docs[:900])
    data = write_parquet(tmp_path / "b.parquet", docs[900:]).read_bytes()
    (tmp_path / "b.parquet").write_bytes(data[: len(data) // 2])  # cut in the middle: no footer
    meta = prepare(
        [good, tmp_path / "b.parquet"], tmp_path / "out", tokenizer_from=bpe_file, verbose=False
    )
    assert [s["path"] for s in meta.raw["skipped_files"]] == [str(tmp_path / "b.parquet")]
    assert meta.raw["documents"] == 900 and meta.raw["skipped_files"][0]["error"].startswith(
        "cannot be opened"
    )


def test_unopenable_inputs_are_named_and_said_even_when_quiet(tmp_path, docs, capsys):
    """Nothing but unopenable inputs: the error names each and why (it said the corpus had no text). A skipped input
    loses data: --quiet (no progress bar or summary) still says it, on stderr."""
    from gptlib.__main__ import main

    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet\n")
    assert main(["tokenize", "--input", str(fake), "--out", str(tmp_path / "o1")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {fake} cannot be opened: Parquet magic bytes not found")
    assert err.rstrip().endswith("; nothing else to tokenize") and len(err.splitlines()) == 1
    good = write_jsonl(tmp_path / "a.jsonl", docs[:300])
    args = ["tokenize", "--input", str(fake), str(good), "--out", str(tmp_path / "o2"), "--quiet"]
    assert main(args) == 0
    out = capsys.readouterr()
    [skipped] = read_meta(tmp_path / "o2").raw["skipped_files"]
    assert skipped["error"].startswith("cannot be opened: Parquet magic bytes not found")
    assert out.out == "" and out.err == f"warning: skipped {fake}: {skipped['error']}\n"


def test_corrupt_row_group_is_skipped_and_the_rest_kept(tmp_path, bpe_file):
    docs = [f"document number {i} " * 20 for i in range(2000)]
    src = write_parquet(tmp_path / "a.parquet", docs, row_group_size=500)
    off = pq.ParquetFile(src).metadata.row_group(2).column(0).data_page_offset
    data = bytearray(src.read_bytes())
    # garbage in the pages of row group 2; the footer is intact
    data[off + 20 : off + 400] = b"\xab" * 380
    src.write_bytes(bytes(data))
    meta = prepare([src], tmp_path / "out", tokenizer_from=bpe_file, verbose=False)
    assert meta.raw["documents"] == 1500
    [rec] = meta.raw["skipped_files"]
    assert rec["path"] == str(src) and rec["error"].startswith(
        "row group 2 (rows 1000-1499) is unreadable"
    )
    got = decoded_documents(tmp_path / "out")
    assert sorted(got["train"] + got["val"]) == sorted(docs[:1000] + docs[1500:])


def test_bad_options(tmp_path, small_text):
    with pytest.raises(PrepareError, match="^--val-fraction 0 must be between 0 and 1"):
        prepare_text([small_text], tmp_path / "o", val_fraction=0)
    with pytest.raises(PrepareError, match="input pattern .*nomatch.* matches no files"):
        prepare([str(tmp_path / "nomatch*.txt")], tmp_path / "o", **BPE)
    with pytest.raises(PrepareError, match="^--split tail works on plain text files only"):
        prepare([write_jsonl(tmp_path / "a.jsonl", ["x"])], tmp_path / "o", split="tail", **BPE)


# ------------------------------------------------------------------------------ refusal and resume


def test_a_refused_dataset_names_what_differs(tmp_path, docs, bpe_file):
    """Notebook 05 run again with another base (its tokenizer), or an input file edited in place: the refusal listed
    the same sources and 'tokenizer bpe' as the call gave, and did not say what was different. It names it; a BPE's
    own settings (notebook 01's VOCAB_SIZE) with both values."""
    from tests.tokenize_kit import small_bpe

    out, src = tmp_path / "out", write_jsonl(tmp_path / "a.jsonl", docs)
    prepare([src], out, tokenizer_from=bpe_file, verbose=False)
    other_base = small_bpe(docs[::-1][:300], tmp_path / "other")
    with pytest.raises(PrepareError, match=r"; it differs in: tokenizer\)"):
        prepare([src], out, tokenizer_from=other_base, verbose=False)
    write_jsonl(src, docs[:-1])  # edited, same path
    with pytest.raises(PrepareError, match=r"; it differs in: sources\)"):
        prepare([src], out, tokenizer_from=bpe_file, verbose=False)
    # notebook 01 run again with only VOCAB_SIZE changed: 'it differs in: tokenizer' named neither size
    prepare([src], tmp_path / "bpe", **BPE)
    with pytest.raises(PrepareError, match=r"; it differs in: vocab_size 300 -> 280\)"):
        prepare([src], tmp_path / "bpe", **{**BPE, "vocab_size": 280})


def test_different_dataset_is_refused_and_nothing_is_damaged(tmp_path, docs, bpe_file, capsys):
    out = tmp_path / "out"
    prepare([write_jsonl(tmp_path / "a.jsonl", docs)], out, tokenizer_from=bpe_file, verbose=False)
    before = files_of(out)
    for kwargs in (dict(tokenizer_from=bpe_file, val_fraction=0.2), dict(tokenizer="char")):
        with pytest.raises(PrepareError, match="already holds a different dataset"):
            prepare([tmp_path / "a.jsonl"], out, verbose=False, **kwargs)
        assert files_of(out) == before
    # same: reused
    again = prepare([tmp_path / "a.jsonl"], out, tokenizer_from=bpe_file, verbose=False)
    assert files_of(out) == before and again.tokens("train") > 0
    prepare([tmp_path / "a.jsonl"], out, tokenizer="char", overwrite=True)
    assert read_meta(out).tokenizer["kind"] == "char"
    assert not any(p.name.startswith("prepare_state") for p in out.iterdir())
    # the old dataset stays until the new one is complete: said as it starts
    said = capsys.readouterr().out
    assert f"overwrite: the dataset in {out} stays as it is until the new one is complete" in said


def test_overwrite_makes_a_damaged_dataset_again_and_a_refused_setting_deletes_nothing(
    tmp_path, docs, bpe_file, monkeypatch
):
    """'pass --overwrite to start again' (and staging's 'tokenize again with --overwrite to repair it') did nothing
    to a dataset of the same inputs and options: it was reused as it was, or its unfinished run refused again. And
    --overwrite with a setting the tokenizer refuses deleted the dataset before refusing."""
    from gptlib.data.tokenizer import TokenizerError

    src = write_jsonl(tmp_path / "a.jsonl", docs)
    opts = dict(tokenizer_from=bpe_file, shard_tokens=5000, verbose=False)
    monkeypatch.setattr(genc, "BATCH_CHARS", 20_000)  # several shards per split
    out = tmp_path / "out"
    clean = prepare([src], out, **opts)
    shard = out / clean.splits["train"]["shards"][0]["file"]
    shard.write_bytes(bytes(shard.stat().st_size))  # zeros in place: the same size, other tokens
    damaged = files_of(out)
    prepare([src], out, **opts)  # the same inputs and options: reused as it is
    assert files_of(out) == damaged
    prepare([src], out, overwrite=True, **opts)
    assert verified_meta(out).splits == clean.splits  # every shard's bytes hashed again
    made = files_of(out)
    with pytest.raises(TokenizerError, match="vocab_size=100 is too small"):
        prepare([src], out, tokenizer="bpe", vocab_size=100, overwrite=True, verbose=False)
    assert files_of(out) == made
    # an unfinished run whose shard was damaged since: refused, then started again with --overwrite
    real_encode = BPETokenizer.encode_batch_ids
    kill_at_encode_call(monkeypatch, 12)
    with pytest.raises(Killed):
        prepare([src], tmp_path / "half", **opts)
    monkeypatch.setattr(BPETokenizer, "encode_batch_ids", real_encode)
    state = json.loads((tmp_path / "half" / PREPARE_STATE_FILE).read_text())
    (tmp_path / "half" / state["shards"]["train"][0]["file"]).write_bytes(b"")
    with pytest.raises(PrepareError, match="missing or damaged, .*; else .* pass --overwrite"):
        prepare([src], tmp_path / "half", **opts)
    prepare([src], tmp_path / "half", overwrite=True, **opts)
    assert verified_meta(tmp_path / "half").splits == clean.splits


@pytest.mark.parametrize("kill_at", ["after_shard_before_state", "mid_batch"])
def test_resume_after_a_kill_gives_the_same_dataset(tmp_path, docs, bpe_file, monkeypatch, kill_at):
    src = write_jsonl(tmp_path / "a.jsonl", docs)
    opts = dict(tokenizer_from=bpe_file, shard_tokens=5000, verbose=False)
    monkeypatch.setattr(genc, "BATCH_CHARS", 20_000)  # many batches, several shards per split
    clean = prepare([src], tmp_path / "clean", **opts)
    assert len(clean.splits["train"]["shards"]) > 5

    out = tmp_path / "out"
    real_write_json, real_encode = genc.atomic_write_json, BPETokenizer.encode_batch_ids
    calls = {"n": 0}
    # the 4th shard is on disk, the state does not list it yet
    if kill_at == "after_shard_before_state":

        def write_json(path, obj):
            calls["n"] += 1
            if calls["n"] == 5:
                raise Killed()
            real_write_json(path, obj)

        monkeypatch.setattr(genc, "atomic_write_json", write_json)
    else:  # killed while encoding a batch, after a few shards
        kill_at_encode_call(monkeypatch, 12)
    with pytest.raises(Killed):
        prepare([src], out, **opts)
    monkeypatch.setattr(genc, "atomic_write_json", real_write_json)
    monkeypatch.setattr(BPETokenizer, "encode_batch_ids", real_encode)

    state = json.loads((out / PREPARE_STATE_FILE).read_text())
    assert len(state["shards"]["train"]) >= 2
    assert not (out / "meta.json").exists()
    with pytest.raises(DataFormatError, match="not a finished gptlib dataset"):
        read_meta(out)  # a half-written dataset never looks complete
    resumed = prepare([src], out, **opts)
    assert resumed.splits == clean.splits  # same shards, same hashes
    assert resumed.raw["documents"] == clean.raw["documents"]
    assert not (out / PREPARE_STATE_FILE).exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in (tmp_path / "clean").iterdir()
    )


_SLOW_CHILD = (
    SLOW_PRELUDE
    + """
from gptlib.data.prepare import prepare
prepare([sys.argv[1]], sys.argv[2], tokenizer_from=sys.argv[3], shard_tokens=5000, verbose=False)
"""
)


def test_resume_after_sigkill_of_a_real_process(tmp_path, docs, bpe_file, monkeypatch):
    src = write_jsonl(tmp_path / "a.jsonl", docs)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CHILD, str(src), str(out), str(bpe_file)], cwd=REPO
    )
    sigkill_after_shards(proc, out, 3)
    assert not (out / "meta.json").exists()
    assert (
        out / genc.LOCK_FILE
    ).exists()  # the killed one's lock file stays, its lock freed by the OS ...
    opts = dict(tokenizer_from=bpe_file, shard_tokens=5000, verbose=False)
    monkeypatch.setattr(genc, "BATCH_CHARS", 20_000)
    resumed = prepare([src], out, **opts)  # ... so the lock is taken at once
    clean = prepare([src], tmp_path / "clean", **opts)
    assert resumed.splits == clean.splits
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in (tmp_path / "clean").iterdir()
    )


def test_unfinished_run_of_other_inputs_is_refused(tmp_path, docs, bpe_file, monkeypatch):
    src = write_jsonl(tmp_path / "a.jsonl", docs)
    monkeypatch.setattr(genc, "BATCH_CHARS", 20_000)

    def encode(self, texts):
        raise Killed()

    real = BPETokenizer.encode_batch_ids
    monkeypatch.setattr(BPETokenizer, "encode_batch_ids", encode)
    with pytest.raises(Killed):
        prepare([src], tmp_path / "out", tokenizer_from=bpe_file, verbose=False)
    monkeypatch.setattr(BPETokenizer, "encode_batch_ids", real)
    before = files_of(tmp_path / "out")
    with pytest.raises(PrepareError, match="holds an unfinished tokenize run of different inputs"):
        prepare([src], tmp_path / "out", tokenizer_from=bpe_file, val_fraction=0.3, verbose=False)
    assert files_of(tmp_path / "out") == before


def test_a_different_dataset_in_a_notebook_names_the_notebooks_settings(
    tmp_path, docs, bpe_file, monkeypatch
):
    """Notebook 05 tokenizing into a DATASET_NAME that holds another dataset (another base, MAX_TOKENS or source)
    was told 'pass --overwrite / overwrite=True': it has no such setting. In a notebook: DATASET_NAME, notebook 01's
    OVERWRITE, or deleting the folder; an unfinished one's refusal too. Nothing in the folder changes."""
    from types import SimpleNamespace

    src, out = write_jsonl(tmp_path / "a.jsonl", docs), tmp_path / "chat"
    prepare([src], out, tokenizer_from=bpe_file, verbose=False)
    before = files_of(out)
    kernel = SimpleNamespace(get_ipython=lambda: SimpleNamespace(kernel=object()))
    monkeypatch.setitem(sys.modules, "IPython", kernel)
    with pytest.raises(PrepareError, match="already holds a different dataset") as e:
        prepare([src], out, tokenizer_from=bpe_file, val_fraction=0.2, verbose=False)
    said = str(e.value)
    assert "choose another DATASET_NAME" in said and "OVERWRITE = True" in said, said
    assert (
        "delete the folder" in said and "--overwrite" not in said and "overwrite=True" not in said
    )
    assert files_of(out) == before
    monkeypatch.setattr(genc, "BATCH_CHARS", 20_000)
    kill_at_encode_call(monkeypatch, 2)
    with pytest.raises(Killed):
        prepare([src], tmp_path / "half", tokenizer_from=bpe_file, verbose=False)
    with pytest.raises(PrepareError, match="holds an unfinished tokenize run") as e:
        prepare([src], tmp_path / "half", tokenizer_from=bpe_file, val_fraction=0.2, verbose=False)
    assert "choose another DATASET_NAME" in str(e.value) and "--overwrite" not in str(e.value)


def test_notebook_02s_data_cell_on_another_text_names_its_settings(tmp_path, monkeypatch):
    """Notebook 02 run again with TEXT_PATH on another text, same RUN_NAME: its data cell (prepare_text into the
    dataset RUN_NAME) was refused with notebook 01's words ('choose another DATASET_NAME ... OVERWRITE = True in
    notebook 01'), settings notebook 02 does not have. It names TEXT_PATH and RUN_NAME; the folder is unchanged; the
    command line as before."""
    from types import SimpleNamespace

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("to be or not to be\n" * 200)
    b.write_text("the quick brown fox\n" * 200)
    out = tmp_path / "data" / "phase1"
    prepare_text([a], out, verbose=False)
    before = files_of(out)
    with pytest.raises(PrepareError, match="--overwrite"):
        prepare_text([b], out, verbose=False)
    kernel = SimpleNamespace(get_ipython=lambda: SimpleNamespace(kernel=object()))
    monkeypatch.setitem(sys.modules, "IPython", kernel)
    with pytest.raises(PrepareError, match="already holds a different dataset") as e:
        prepare_text([b], out, verbose=False)
    said = str(e.value)
    assert "set TEXT_PATH back to the text it was made from" in said and "new RUN_NAME" in said, (
        said
    )
    assert "DATASET_NAME" not in said and "OVERWRITE" not in said and files_of(out) == before, said


def test_notebook_02_named_as_a_bpe_dataset_keeps_it(tmp_path, bpe_file, monkeypatch):
    """Notebook 02 tokenizes into the dataset RUN_NAME beside notebook 01's: a RUN_NAME that names a BPE dataset
    (notebook 01's demo Tiny Shakespeare as DATASET_NAME "shakespeare", then 02's run "shakespeare") was refused
    with 'set TEXT_PATH back to the text it was made from (or delete the folder)': TEXT_PATH is that text, and the
    folder is notebook 01's dataset. It says to choose a new RUN_NAME, naming whose folder it is; finished or not,
    the folder is unchanged."""
    from types import SimpleNamespace

    text, out = tmp_path / "a.txt", tmp_path / "data" / "shakespeare"
    text.write_text("to be or not to be\n" * 200)
    prepare([text], out, tokenizer_from=bpe_file, verbose=False)
    monkeypatch.setattr(genc, "BATCH_CHARS", 200)
    kill_at_encode_call(monkeypatch, 2)
    with pytest.raises(Killed):  # notebook 01 stopped mid-way on another dataset
        prepare([text], tmp_path / "data" / "half", tokenizer_from=bpe_file, verbose=False)
    kernel = SimpleNamespace(get_ipython=lambda: SimpleNamespace(kernel=object()))
    monkeypatch.setitem(sys.modules, "IPython", kernel)
    for folder in (out, tmp_path / "data" / "half"):
        before = files_of(folder)
        with pytest.raises(PrepareError) as e:
            prepare_text([text], folder, verbose=False)
        said = str(e.value)
        assert said.endswith(
            "choose a new RUN_NAME (this folder holds a BPE dataset: notebook 01's or 05's)"
        ), said
        assert "delete" not in said and "TEXT_PATH" not in said and files_of(folder) == before


# --------------------------------------------------------------------------------------- memory

# VmHWM: the peak RSS of the child's own address space (ru_maxrss would include pytest's at fork time).
_RSS_CHILD = """
import re, sys
from gptlib.data.prepare import prepare_text
prepare_text([sys.argv[1]], sys.argv[2], shard_tokens=2_000_000, verbose=False)
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) // 1024)
"""


def test_a_100_mb_single_line_is_tokenized_in_bounded_memory(tmp_path):
    line = tmp_path / "line.txt"
    block = ("abcdefghij klmnopqrst uvwxyz0123 " * 32_000).encode()  # ~1 MB, no newline
    with open(line, "wb") as f:
        for _ in range(100):
            f.write(block)
    r = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(line), str(tmp_path / "out")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    peak_mb = int(r.stdout.split()[-1])
    meta = read_meta(tmp_path / "out")
    assert meta.tokens("train") + meta.tokens("val") == line.stat().st_size
    # The file is 100 MB (400 MB as one UTF-32 array): reading it whole would show here.
    assert peak_mb < 250, f"peak RSS {peak_mb} MB"


# ------------------------------------------------------------------------------------------- CLI


def gptlib_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gptlib", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_tokenize_bpe_then_reuse_the_tokenizer_file(tmp_path, docs):
    src = write_parquet(tmp_path / "a.parquet", docs, column="code")
    r = gptlib_cli(
        "tokenize",
        "--input",
        src,
        "--tokenizer",
        "bpe",
        "--vocab-size",
        300,
        "--text-column",
        "code",
        "--out",
        tmp_path / "d1",
    )
    assert r.returncode == 0, r.stderr
    assert "documents" in r.stdout and "uint16, vocab 300" in r.stdout
    r = gptlib_cli(
        "tokenize",
        "--input",
        src,
        "--tokenizer-file",
        tmp_path / "d1" / "tokenizer.json",
        "--text-column",
        "code",
        "--out",
        tmp_path / "d2",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    assert read_meta(tmp_path / "d1").splits == read_meta(tmp_path / "d2").splits
    r = gptlib_cli(
        "tokenize",
        "--input",
        src,
        "--tokenizer",
        "bpe",
        "--vocab-size",
        300,
        "--out",
        tmp_path / "d3",
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: parquet file {src} has no column 'text' (columns: code, n); choose one with --text-column / "
        f"text_column="
    ]
    gz = tmp_path / "x.txt.gz"
    gz.write_bytes(b"\x1f\x8b")
    r = gptlib_cli("tokenize", "--input", gz, "--out", tmp_path / "d4")
    assert r.returncode == 2 and "is compressed; decompress it first" in r.stderr


def test_an_out_that_cannot_be_a_directory_is_one_line(tmp_path, small_text):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for out, why in [
        (tmp_path / "afile", "is a file, not a directory"),
        (tmp_path / "loop", "is a symbolic link loop"),
        (tmp_path / "afile" / "sub", "a part of its path is a file"),
    ]:
        r = gptlib_cli("tokenize", "--input", small_text, "--out", out, "--quiet")
        (line,) = r.stderr.strip().splitlines()
        assert r.returncode == 2 and line.startswith(f"error: --out {out}") and why in line, (
            r.stderr
        )
    assert (tmp_path / "afile").read_text() == "x"


def test_an_unfinished_runs_other_tokenizer_in_a_notebook_names_overwrite(
    tmp_path, docs, bpe_file, monkeypatch
):
    """Notebook 01 re-run on an unfinished tokenize whose tokenizer.json is another one (another tokenize's, copied
    in): the refusal said 'pass --overwrite to start again', a flag the notebook has not. It names OVERWRITE, and
    OVERWRITE = True does start again."""
    from types import SimpleNamespace

    from tests.tokenize_kit import small_bpe

    src, out = write_jsonl(tmp_path / "a.jsonl", docs), tmp_path / "out"
    opts = dict(tokenizer_from=bpe_file, shard_tokens=5000, verbose=False)
    monkeypatch.setattr(genc, "BATCH_CHARS", 20_000)
    real_encode = kill_at_encode_call(monkeypatch, 12)
    with pytest.raises(Killed):
        prepare([src], out, **opts)
    monkeypatch.setattr(BPETokenizer, "encode_batch_ids", real_encode)
    small_bpe(docs[:300], out)  # another tokenizer in its place
    kernel = SimpleNamespace(get_ipython=lambda: SimpleNamespace(kernel=object()))
    monkeypatch.setitem(sys.modules, "IPython", kernel)
    with pytest.raises(
        PrepareError, match="unfinished run in .*; .*OVERWRITE = True in notebook 01"
    ) as err:
        prepare([src], out, **opts)
    assert "--" not in str(err.value).replace(str(tmp_path), "")
    prepare([src], out, overwrite=True, **opts)
    assert verified_meta(out).splits == prepare([src], tmp_path / "clean", **opts).splits
