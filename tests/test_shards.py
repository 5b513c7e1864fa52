import json
import re

import numpy as np
import pytest

from gptlib.data.prepare import PrepareError, prepare_text
from gptlib.data.shards import DataFormatError, ShardWriter, dtype_for_vocab, read_meta, write_meta
from gptlib.data.tokenizer import load_tokenizer
from tests.tokenize_kit import split_tokens, verified_meta


def test_dtype_from_vocab():
    assert dtype_for_vocab(65) == np.uint16
    assert dtype_for_vocab(65536) == np.uint16
    assert dtype_for_vocab(65537) == np.uint32


def test_char_dataset_round_trip(tmp_path, small_text):
    meta = prepare_text([small_text], tmp_path / "d", verbose=False)
    text = small_text.read_text()
    assert meta.vocab_size == len(set(text)) and meta.dtype == np.uint16
    assert meta.tokens("train") + meta.tokens("val") == len(text)
    assert meta.tokenizer["kind"] == "char" and len(meta.tokenizer["hash"]) == 64
    raw = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert raw["format_version"] == 1 and raw["sources"][0]["size"] == small_text.stat().st_size
    tok = load_tokenizer(tmp_path / "d")
    decoded = tok.decode(split_tokens(meta, "train")) + tok.decode(split_tokens(meta, "val"))
    assert decoded == text  # tail split: train is the first 90%, val the last 10%
    assert abs(meta.tokens("val") / len(text) - 0.1) < 0.001


def test_shard_writer_splits_into_fixed_size_shards(tmp_path):
    w = ShardWriter(tmp_path, "train", np.dtype(np.uint16), shard_tokens=1000)
    data = np.arange(2500) % 300
    w.write(data[:700])
    w.write(data[700:])
    shards = w.close()
    assert [s["tokens"] for s in shards] == [1000, 1000, 500]
    wv = ShardWriter(tmp_path, "val", np.dtype(np.uint16), shard_tokens=1000)
    wv.write(np.arange(10))
    (tmp_path / "tokenizer.json").write_text("{}")
    write_meta(
        tmp_path,
        vocab_size=300,
        tokenizer={"kind": "x", "hash": None, "file": "tokenizer.json"},
        splits={"train": shards, "val": wv.close()},
        sources=[],
    )
    meta = verified_meta(tmp_path)
    assert np.array_equal(split_tokens(meta, "train"), data)


@pytest.fixture()
def dataset(tmp_path, small_text):
    prepare_text([small_text], tmp_path / "d", verbose=False)
    return tmp_path / "d"


def _edit_meta(d, fn):
    p = d / "meta.json"
    m = json.loads(p.read_text())
    fn(m)
    p.write_text(json.dumps(m))


def test_missing_meta_means_incomplete(dataset):
    (dataset / "meta.json").unlink()
    with pytest.raises(
        DataFormatError, match="meta.json is missing.*not a finished gptlib dataset"
    ):
        read_meta(dataset)


def test_truncated_shard_names_file_and_both_sizes(dataset):
    shard = dataset / "train_000000.bin"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 2)
    with pytest.raises(
        DataFormatError,
        match=rf"train_000000.bin: file size is {size - 2} bytes but .* = {size} bytes",
    ):
        read_meta(dataset)


def test_a_shard_that_is_a_folder_is_said_to_be_one(dataset, tmp_path, capsys):
    """A folder at a shard's name (a copy gone wrong): said to be a folder, where it said the shard does not exist."""
    from gptlib.__main__ import main

    shard = dataset / "train_000000.bin"
    shard.unlink()
    shard.mkdir()
    said = f"shard {shard} listed in {dataset / 'meta.json'} is a folder, not a file"
    with pytest.raises(DataFormatError, match=f"^{re.escape(said)}"):
        read_meta(dataset)
    assert main(["train", "--data", str(dataset), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and said in err


def test_dtype_that_disagrees_with_vocab(dataset):
    _edit_meta(dataset, lambda m: m.update(dtype="uint32"))
    with pytest.raises(DataFormatError, match="dtype is 'uint32' but vocab_size=.* needs 'uint16'"):
        read_meta(dataset)


def test_token_count_mismatch(dataset):
    _edit_meta(dataset, lambda m: m["splits"]["val"].update(tokens=5))
    with pytest.raises(DataFormatError, match="val tokens is 5 but its shards hold"):
        read_meta(dataset)


def test_replaced_tokenizer_is_refused(dataset):
    (dataset / "tokenizer.json").write_text(
        json.dumps({"kind": "char", "chars": "abc", "unknown": "error"})
    )
    with pytest.raises(DataFormatError, match="tokenizer was replaced"):
        read_meta(dataset)


def test_unsupported_format_version(dataset):
    _edit_meta(dataset, lambda m: m.update(format_version=99))
    with pytest.raises(DataFormatError, match="format_version is 99"):
        read_meta(dataset)


def test_missing_and_empty_inputs(tmp_path):
    with pytest.raises(PrepareError, match="input file .*nope.txt does not exist"):
        prepare_text([tmp_path / "nope.txt"], tmp_path / "d", verbose=False)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(PrepareError, match="empty.txt is empty"):
        prepare_text([empty], tmp_path / "d", verbose=False)
    assert not (tmp_path / "d" / "meta.json").exists()


def test_rerun_is_a_noop_and_a_different_dataset_is_refused(tmp_path, small_text, dataset):
    before = {p.name: p.read_bytes() for p in dataset.iterdir()}
    prepare_text([small_text], dataset, verbose=False)  # same inputs: reused
    other = tmp_path / "other.txt"
    other.write_text("something else entirely\n" * 100)
    with pytest.raises(PrepareError, match="already holds a different dataset"):
        prepare_text([other], dataset, verbose=False)
    assert {p.name: p.read_bytes() for p in dataset.iterdir()} == before


def _first_train_shard(m) -> dict:
    return m["splits"]["train"]["shards"][0]


@pytest.mark.parametrize(
    "edit, said",
    [
        (lambda m: m.update(tokenizer="char"), "tokenizer is 'char', expected an object"),
        (lambda m: m["tokenizer"].update(file=3), "tokenizer.file is 3, expected a string"),
        (lambda m: m.update(splits="x"), "splits is 'x', expected an object"),
        (lambda m: m["splits"].update(val=[]), r"splits.val is \[\], expected an object"),
        (
            lambda m: m["splits"]["train"].update(shards="x"),
            "splits.train.shards is 'x', expected a list",
        ),
        (
            lambda m: m["splits"]["val"].update(shards=[5]),
            r"splits.val.shards\[0\] is 5, expected an object",
        ),
        (
            lambda m: _first_train_shard(m).update(file=7),
            r"splits.train.shards\[0\].file is 7, expected a string",
        ),
        (lambda m: m["tokenizer"].update(hash=5), "tokenizer.hash is 5, expected a string"),
        (lambda m: m.update(vocab_size="abc"), "vocab_size is 'abc', expected a whole number"),
    ],
)
def test_meta_with_a_field_of_the_wrong_shape_names_it(dataset, tmp_path, capsys, edit, said):
    """A hand-edited meta.json with a field of the wrong shape: one line naming the field and what it holds (it was
    'malformed metadata (TypeError: string indices must be integers ...)', naming nothing)."""
    from gptlib.__main__ import main

    _edit_meta(dataset, edit)
    with pytest.raises(DataFormatError, match=f"^{re.escape(str(dataset / 'meta.json'))}: {said}"):
        read_meta(dataset)
    assert main(["train", "--data", str(dataset), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(said, err)


def test_find_dataset_names_the_datasets_that_are_there(char_data, tmp_path, monkeypatch):
    """Notebook 03's data cell: a name that is not tokenized yet is one error listing what is there."""
    import shutil

    from gptlib.data.shards import find_dataset
    from gptlib.errors import DataFormatError

    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path))
    shutil.copytree(char_data, tmp_path / "data" / "shakespeare")
    (tmp_path / "data" / "half").mkdir()
    assert find_dataset("shakespeare") == tmp_path / "data" / "shakespeare"
    assert find_dataset(data_dir=char_data) == char_data
    with pytest.raises(
        DataFormatError,
        match=r"no tokenized dataset at .*data/half \(run notebook 01 first\); "
        r"datasets in .*data: shakespeare$",
    ):
        find_dataset("half")


def test_a_data_dir_that_is_a_file_says_so(tmp_path):
    from gptlib.errors import RunDirError

    (tmp_path / "meta.json").write_text("{}")
    with pytest.raises(RunDirError, match=r"data directory .*meta.json is a file, not a directory"):
        read_meta(tmp_path / "meta.json")
    with pytest.raises(DataFormatError, match=r"data directory .*nope does not exist"):
        read_meta(tmp_path / "nope")


def test_find_dataset_says_a_tokenize_that_did_not_finish(tmp_path, monkeypatch, docs, bpe_file):
    """Notebook 03 opened while notebook 01 still tokenizes (or after a disconnect stopped it): 'run notebook 01
    first' told a user who had; the line says the dataset is unfinished and that notebook 01 run again finishes it."""
    from gptlib.data.prepare import prepare
    from gptlib.data.shards import PREPARE_STATE_FILE, find_dataset
    from tests.tokenize_kit import Killed, kill_at_encode_call

    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path))
    src = tmp_path / "corpus.txt"
    src.write_text("\n\n".join(docs))
    out = tmp_path / "data" / "web"
    kill_at_encode_call(monkeypatch, 1)
    with pytest.raises(Killed):
        prepare([src], out, tokenizer_from=bpe_file, verbose=False)
    assert (out / PREPARE_STATE_FILE).is_file() and not (out / "meta.json").exists()
    with pytest.raises(DataFormatError) as e:
        find_dataset("web")
    assert "(unfinished: run notebook 01 again)" in str(e.value), e.value
    assert "run notebook 01 first" not in str(e.value)


def test_a_slow_shard_write_that_makes_progress_is_waited_for(tmp_path, monkeypatch):
    """A large shard (--shard-tokens) written to a slow Drive takes longer than WRITE_TIMEOUT_S while its bytes keep
    going out: it was given up as hung ('made no progress for 300 s') on every re-run, so tokenize never finished.
    Here a 6 MB shard goes out through a FUSE mount writing ~3 MB/s (tests/hangfs.py), with a limit of 1 s."""
    import time

    from gptlib.data import shards
    from tests.test_drive_resume import HangingMount

    (tmp_path / "drive").mkdir()
    mount = HangingMount(tmp_path / "drive", tmp_path, write_bps=3e6)
    try:
        mount.back()  # no stalled reads: only slow writes
        monkeypatch.setattr(shards, "WRITE_TIMEOUT_S", 1.0)
        ids = np.random.default_rng(0).integers(0, 50_000, 3_000_000).astype(np.uint16)
        w = ShardWriter(mount.mirror / "d", "train", np.dtype(np.uint16), shard_tokens=3_000_000)
        t0 = time.monotonic()
        w.write(ids)
        assert time.monotonic() - t0 > 1.5  # slower than the limit, all the way
    finally:
        mount.close()
    assert (tmp_path / "drive" / "d" / "train_000000.bin").read_bytes() == ids.tobytes()
