"""Notebook 01's known sources: each dropdown choice gives prepare() the right files, column, format and budget;
the user's INPUT wins; counts parse."""

import pytest

from gptlib.data.catalog import DEMO, MY_FILES, SOURCES, parse_count, source_inputs


def test_every_known_source_names_its_files_and_options():
    assert {
        "TinyStories",
        "FineWeb-Edu sample-10BT",
        "OpenWebText",
        "github-code (as the original author used it)",
        "UltraChat-200k (chat)",
        MY_FILES,
    } <= set(SOURCES)
    logs = []
    fw = source_inputs("FineWeb-Edu sample-10BT", log=logs.append)
    assert fw == (
        ["hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT/*.parquet"],
        {"text_column": "text", "format": "text", "max_tokens": 2_800_000_000},
    )
    assert logs == [
        "source: FineWeb-Edu sample-10BT: educational web pages (build-nanogpt's corpus), ~10B tokens"
    ]
    code = source_inputs("github-code (as the original author used it)", log=logs.append)
    assert code == (
        ["hf://datasets/codeparrot/github-code/data/train-*.parquet"],
        {"text_column": "code", "format": "text", "max_tokens": 2_800_000_000},
    )
    chat = source_inputs("UltraChat-200k (chat)", log=logs.append)
    assert chat == (
        ["hf://datasets/HuggingFaceH4/ultrachat_200k/data/train_sft-*.parquet"],
        {"text_column": "messages", "format": "chat", "max_tokens": None},
    )
    # 0 = all
    assert source_inputs("TinyStories", max_tokens="0", log=logs.append)[1]["max_tokens"] is None
    assert (
        source_inputs("OpenWebText", max_tokens="500M", log=logs.append)[1]["max_tokens"]
        == 500_000_000
    )
    for label, src in SOURCES.items():  # a Hub source names files (a glob), never a bare dataset
        assert src.input is None or (
            src.input.startswith("hf://datasets/") and src.input.endswith("*.parquet")
        ), label


def test_the_demo_corpus_is_the_verified_tiny_shakespeare(tmp_path, monkeypatch, shakespeare_path):
    """Downloaded (here from a file URL), then found in the cache: each said as it happened."""
    from gptlib.data import download

    monkeypatch.setattr(download, "TINYSHAKESPEARE_URL", shakespeare_path.as_uri())
    monkeypatch.setenv("GPTLIB_CACHE", str(tmp_path))
    logs = []
    for how in ("downloaded and checksum-verified", "found in the cache, checksum-verified"):
        assert source_inputs(DEMO, log=logs.append) == (
            [tmp_path / "tinyshakespeare.txt"],
            {"text_column": None, "format": "text", "max_tokens": None},
        )
        assert logs.pop() == f"source: {DEMO}: 1.1 MB, {how} ({tmp_path / 'tinyshakespeare.txt'})"
    # a damaged cache is replaced: downloaded again
    (tmp_path / "tinyshakespeare.txt").write_text("corrupt")
    source_inputs(DEMO, log=logs.append)
    assert logs == [
        f"source: {DEMO}: 1.1 MB, downloaded and checksum-verified ({tmp_path / 'tinyshakespeare.txt'})"
    ]


def test_the_users_input_wins_and_gets_no_defaults():
    logs = []
    mine = source_inputs(
        "github-code (as the original author used it)",
        "/content/drive/MyDrive/a/*.parquet, b.jsonl",
        log=logs.append,
    )
    assert mine == (
        # format auto: conversations read as chat
        [
            "/content/drive/MyDrive/a/*.parquet",
            "b.jsonl",
        ],
        {"text_column": None, "format": "auto", "max_tokens": None},
    )
    assert logs == []
    assert source_inputs(MY_FILES, "x.jsonl", "body", "2.8B", "chat")[1] == {
        "text_column": "body",
        "format": "chat",
        "max_tokens": 2_800_000_000,
    }
    with pytest.raises(ValueError, match="put the files, folders or globs in INPUT"):
        source_inputs(MY_FILES)
    with pytest.raises(ValueError, match="unknown source 'Wikipedia'"):
        source_inputs("Wikipedia")


def test_counts():
    assert parse_count("2.8B") == parse_count("2.8e9") == parse_count(2.8e9) == 2_800_000_000
    assert parse_count("20K") == 20_000 and parse_count("") is None and parse_count("0") is None
    with pytest.raises(ValueError, match="'lots' is not a count"):
        parse_count("lots")
    # not finite: the same line (inf raised OverflowError from int(), nan "cannot convert float NaN to integer")
    for endless in ("inf", "1e400", "nan", "-nan"):
        with pytest.raises(ValueError, match=f"'{endless}' is not a count"):
            parse_count(endless)
    # a decimal comma is refused, not read as ten times the budget ("2,8B" was 28B); thousands separators stay
    assert parse_count("2,800,000,000") == parse_count("2,800M") == 2_800_000_000
    for decimal in ("2,8B", "0,5B", "1,5M", "12,34"):
        with pytest.raises(ValueError, match="write decimals with a dot"):
            parse_count(decimal)


def test_a_bad_notebook_source_or_budget_is_one_line():
    """Notebooks 01 and 05: 'my files on Drive' with INPUT left empty, or MAX_TOKENS '2,8B' (a decimal comma) or
    'lots', raised a plain ValueError: a traceback through gptlib/data/catalog.py in the cell. A ConfigError (a
    GptlibError, still a ValueError) shows as its one line, as every other bad input does."""
    from gptlib.errors import GptlibError

    calls = [(MY_FILES,), (MY_FILES, "x.txt", "", "2,8B"), (MY_FILES, "x.txt", "", "lots")]
    for args in calls + [("Wikipedia",)]:
        with pytest.raises(GptlibError) as ei:
            source_inputs(*args)
        assert isinstance(ei.value, ValueError)
        (line,) = ei.value._render_traceback_()
        assert line.startswith("ConfigError: ") and str(ei.value) in line
