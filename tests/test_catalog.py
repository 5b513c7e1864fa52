"""Notebook 01's known sources: each dropdown choice gives prepare() the right input, column, format,
budget and split; the user's INPUT wins; counts parse."""

import pytest

from gptlib.data.catalog import DEMO, MY_FILES, SOURCES, parse_count, source_options


def test_every_known_source_gives_prepare_its_options():
    assert {"TinyStories", "FineWeb-Edu sample-10BT", "OpenWebText", "github-code (as the original author used it)",
            "UltraChat-200k (chat)", MY_FILES} <= set(SOURCES)
    fw = source_options("FineWeb-Edu sample-10BT")
    assert fw == {"inputs": ["hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT/*.parquet"], "text_column": "text",
                  "format": "text", "max_tokens": 2_800_000_000, "hf_split": None}
    code = source_options("github-code (as the original author used it)")
    assert code["text_column"] == "code" and code["max_tokens"] == 2_800_000_000
    chat = source_options("UltraChat-200k (chat)")
    assert chat["format"] == "chat" and chat["hf_split"] == "train_sft" and chat["text_column"] == "messages"
    assert source_options("TinyStories", max_tokens="0")["max_tokens"] is None  # 0 = all
    assert source_options("OpenWebText", max_tokens="500M")["max_tokens"] == 500_000_000
    assert source_options(DEMO)["inputs"] is None  # the notebook downloads the demo corpus
    for label, src in SOURCES.items():
        assert src.input is None or src.input.startswith("hf://datasets/"), label


def test_the_users_input_wins_and_gets_no_defaults():
    mine = source_options("github-code (as the original author used it)", "/content/drive/MyDrive/a/*.parquet, b.jsonl")
    assert mine == {"inputs": ["/content/drive/MyDrive/a/*.parquet", "b.jsonl"], "text_column": None,
                    "format": "text", "max_tokens": None, "hf_split": None}
    assert source_options(MY_FILES, "x.jsonl", "body", "2.8B", "chat")["max_tokens"] == 2_800_000_000
    with pytest.raises(ValueError, match="put the files, folders or globs in INPUT"):
        source_options(MY_FILES)
    with pytest.raises(ValueError, match="unknown source 'Wikipedia'"):
        source_options("Wikipedia")


def test_counts():
    assert parse_count("2.8B") == parse_count("2.8e9") == parse_count(2.8e9) == 2_800_000_000
    assert parse_count("20K") == 20_000 and parse_count("") is None and parse_count("0") is None
    with pytest.raises(ValueError, match="'lots' is not a count"):
        parse_count("lots")
