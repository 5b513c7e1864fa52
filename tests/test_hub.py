"""Hub datasets as tokenize inputs, offline: a fake Hub (tests/fakes.py) stands for huggingface.co.

Which files a Hub URL names (a path or glob of the repository's files; without a path, a config/split of the Hub's
parquet conversion), identity without reading, byte-identical shards vs the same files on disk, the errors (missing
or private dataset, gated dataset, missing revision, config, split or column), the token (HF_TOKEN, Colab's secret),
and the CLI's --hf-dataset.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import gptlib.data.hub as hub
import gptlib.data.inputs as inputs
from gptlib.data.prepare import PrepareError, prepare
from gptlib.data.shards import read_meta
from tests.fakes import add_repo_file, fake_hub_child, install_fake_hub
from tests.tokenize_kit import speeches

REPO = Path(__file__).resolve().parents[1]
PLAIN = "hf://datasets/o/plain/data/train-*.parquet"


def parquet_bytes(docs: list[str], column: str = "text", row_group_size: int = 50) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(
        pa.table({column: docs, "n": list(range(len(docs)))}), sink, row_group_size=row_group_size
    )
    return sink.getvalue().to_pybytes()


@pytest.fixture(scope="module")
def docs(shakespeare_path) -> list[str]:  # fewer than conftest's; its bpe_file is trained on these
    return speeches(shakespeare_path, 200_000)


@pytest.fixture()
def hub_root(tmp_path, docs) -> Path:
    """o/plain: parquet files named by split, no conversion; o/script: only the Hub's conversion (one config
    partial); o/gated: gated."""
    root = tmp_path / "hub"
    for i in range(2):
        add_repo_file(
            root,
            "o/plain",
            f"data/train-{i:05d}-of-00002.parquet",
            parquet_bytes(docs[i * 300 : (i + 1) * 300]),
        )
    add_repo_file(root, "o/plain", "data/test-00000-of-00001.parquet", parquet_bytes(docs[600:700]))
    add_repo_file(root, "o/plain", "README.md", b"# no configs here\n")
    add_repo_file(root, "o/script", "script.py", b"# a loading script\n")
    add_repo_file(root, "o/script", "data/train.jsonl.gz", b"\x1f\x8b")
    conv = "refs/convert/parquet"
    add_repo_file(
        root, "o/script", "default/train/0000.parquet", parquet_bytes(docs[:300]), rev=conv
    )
    add_repo_file(
        root, "o/script", "default/test/0000.parquet", parquet_bytes(docs[300:350]), rev=conv
    )
    add_repo_file(
        root, "o/script", "huge/partial-train/0000.parquet", parquet_bytes(docs[:250]), rev=conv
    )
    add_repo_file(root, "o/gated", "data/train-0.parquet", parquet_bytes(docs[:100]))
    (root / "o" / "gated" / ".gated").write_text("")
    return root


def names(found) -> list[str]:
    return [f.url for f in found]


# ------------------------------------------------------------------------------------------ which files


def test_a_path_or_glob_names_exactly_those_files(hub_root, monkeypatch):
    install_fake_hub(monkeypatch, hub_root)
    train = [
        "hf://datasets/o/plain/data/train-00000-of-00002.parquet",
        "hf://datasets/o/plain/data/train-00001-of-00002.parquet",
    ]
    assert names(hub.resolve_url(PLAIN)) == train
    assert names(hub.resolve_url("hf://datasets/o/plain/data/test-*.parquet")) == [
        "hf://datasets/o/plain/data/test-00000-of-00001.parquet"
    ]
    assert names(
        hub.resolve_url("hf://datasets/o/plain/data")
    ) == [  # a directory: all of it, sorted
        "hf://datasets/o/plain/data/test-00000-of-00001.parquet",
        *train,
    ]
    with pytest.raises(
        PrepareError, match=r"input pattern 'hf://datasets/o/plain/data/dev-\*.parquet' matches no"
    ):
        hub.resolve_url("hf://datasets/o/plain/data/dev-*.parquet")


def test_without_a_path_the_hubs_parquet_conversion(hub_root, monkeypatch, capsys):
    install_fake_hub(monkeypatch, hub_root)
    assert names(hub.resolve_url("hf://datasets/o/script")) == [
        "hf://datasets/o/script@refs/convert/parquet/default/train/0000.parquet"
    ]
    assert names(hub.resolve_url("hf://datasets/o/script", hf_split="test"))[0].endswith(
        "default/test/0000.parquet"
    )
    assert names(hub.resolve_url("hf://datasets/o/script", "huge"))[0].endswith(
        "huge/partial-train/0000.parquet"
    )
    assert (
        "conversion of o/script huge/train is partial (its first ~5 GB)" in capsys.readouterr().err
    )
    with pytest.raises(PrepareError, match=r"has no config 'nope' \(configs: default, huge\)"):
        hub.resolve_url("hf://datasets/o/script", "nope")
    with pytest.raises(
        PrepareError,
        match=r"config 'default' of dataset o/script has no split 'dev' \(splits: test, "
        r"train\)",
    ):
        hub.resolve_url("hf://datasets/o/script", hf_split="dev")
    with pytest.raises(
        PrepareError,
        match=r"dataset o/plain: the Hub has no parquet conversion of it .*name its files "
        r"instead: hf://datasets/o/plain/path/\*.parquet",
    ):
        hub.resolve_url("hf://datasets/o/plain")


def test_config_or_split_with_a_path_and_a_revision_without_one_are_refused(hub_root, monkeypatch):
    install_fake_hub(monkeypatch, hub_root)
    with pytest.raises(
        PrepareError,
        match=r"input hf://datasets/o/plain/data/train-\*.parquet names its files: "
        r"--hf-config / --hf-split",
    ):
        hub.resolve_url(PLAIN, hf_split="train")
    add_repo_file(hub_root, "o/plain", "data/train-0.parquet", b"", rev="v1")
    with pytest.raises(
        PrepareError,
        match=r"the Hub's parquet conversion is of the main branch; name the files of "
        r"revision 'v1' instead: hf://datasets/o/plain@v1/path/\*.parquet",
    ):
        hub.resolve_url("hf://datasets/o/plain@v1")


# ------------------------------------------------------------------------------ identity and shards


def test_hub_files_are_identified_without_reading_and_match_local_shards(
    hub_root, monkeypatch, tmp_path, bpe_file
):
    made = install_fake_hub(monkeypatch, hub_root)
    found = hub.resolve_url(PLAIN)
    assert made["fs"].opened == []  # the listing has sizes
    local = [hub_root / "o/plain/main" / f.url.split("o/plain/", 1)[1] for f in found]
    assert [(s.hash, s.canonical) for s in map(inputs.source, found)] == [
        ("sha256:" + hashlib.sha256(p.read_bytes()).hexdigest(), True) for p in local
    ]
    assert made["fs"].opened == []  # ... and sha256s
    opts = dict(tokenizer_from=bpe_file, shard_tokens=4000, verbose=False)
    via_hub = prepare([PLAIN], tmp_path / "via_hub", **opts)
    on_disk = prepare(local, tmp_path / "disk", **opts)
    assert via_hub.splits == on_disk.splits and len(via_hub.splits["train"]["shards"]) > 2
    for s in via_hub.shard_paths("train") + via_hub.shard_paths("val"):
        assert s.read_bytes() == (tmp_path / "disk" / s.name).read_bytes()
    assert [s["path"] for s in via_hub.raw["sources"]] == names(found)


def test_a_big_hub_file_is_sampled_only_when_the_pass_reaches_it(
    hub_root, monkeypatch, tmp_path, bpe_file
):
    # Above FULL_HASH_LIMIT a local file's identity is a sampled hash; the Hub lists the full sha256.
    # The shards must still be the same: the split key is the sampled hash, read when needed.
    monkeypatch.setattr(inputs, "FULL_HASH_LIMIT", 5000)
    monkeypatch.setattr(inputs, "SAMPLE_BLOCK", 1000)
    install_fake_hub(monkeypatch, hub_root)
    url = "hf://datasets/o/plain/data/train-00000-of-00002.parquet"
    [f] = hub.resolve_url(url)
    s = inputs.source(f)
    assert s.hash.startswith("sha256:") and not s.canonical
    local = hub_root / "o/plain/main/data/train-00000-of-00002.parquet"
    opts = dict(tokenizer_from=bpe_file, verbose=False)
    a = prepare([url], tmp_path / "via_hub", **opts)
    b = prepare([local], tmp_path / "disk", **opts)
    assert b.raw["sources"][0]["hash"].startswith("sampled-sha256:")
    assert a.splits == b.splits


def test_a_missing_column_names_the_url_and_the_columns(hub_root, monkeypatch, tmp_path, bpe_file):
    install_fake_hub(monkeypatch, hub_root)
    with pytest.raises(
        PrepareError,
        match=r"parquet file hf://datasets/o/plain/data/train-00000-of-00002.parquet has "
        r"no column 'code' \(columns: text, n\)",
    ):
        prepare([PLAIN], tmp_path / "o", tokenizer_from=bpe_file, text_column="code", verbose=False)
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------- errors


def test_missing_gated_and_revision_errors_say_what_to_do(
    hub_root, monkeypatch, tmp_path, bpe_file
):
    install_fake_hub(monkeypatch, hub_root)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(PrepareError) as e:
        hub.resolve_url("hf://datasets/o/nope/data/*.parquet")
    msg = str(e.value)
    assert (
        msg.startswith(
            "input hf://datasets/o/nope/data/*.parquet: dataset o/nope was not found on the Hub (it does not exist, or "
            "it is private and needs a login)"
        )
        and "HF_TOKEN" in msg
        and "Colab" in msg
    )
    with pytest.raises(PrepareError, match=r"revision 'v9' of dataset o/plain does not exist"):
        hub.resolve_url("hf://datasets/o/plain@v9/data/*.parquet")
    # A gated dataset lists, but its files refuse to be read: the first read says so, naming it.
    with pytest.raises(PrepareError) as e:
        prepare(
            ["hf://datasets/o/gated/data/*.parquet"],
            tmp_path / "g",
            tokenizer_from=bpe_file,
            verbose=False,
        )
    msg = str(e.value)
    assert msg.startswith(
        "input hf://datasets/o/gated/data/train-0.parquet cannot be read: dataset o/gated is gated: "
        "accept its conditions at https://huggingface.co/datasets/o/gated"
    )
    assert "HF_TOKEN" in msg and "\n" not in msg


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_hf_dataset_with_split_and_errors(hub_root, tmp_path, bpe_file):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-c", fake_hub_child(hub_root), "tokenize", *map(str, args)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            env=_env_without_token(),
        )

    r = run(
        "--hf-dataset",
        "o/script",
        "--hf-split",
        "test",
        "--tokenizer-from",
        bpe_file,
        "--out",
        tmp_path / "d",
    )
    assert r.returncode == 0, r.stderr
    meta = read_meta(tmp_path / "d")
    assert [s["path"] for s in meta.raw["sources"]] == [
        "hf://datasets/o/script@refs/convert/parquet/default/test/0000.parquet"
    ]
    r = run("--hf-dataset", "o/nope", "--tokenizer-from", bpe_file, "--out", tmp_path / "e")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "dataset o/nope was not found on the Hub" in r.stderr and "HF_TOKEN" in r.stderr
    r = run("--input", tmp_path / "x.jsonl", "--hf-split", "train", "--out", tmp_path / "f")
    assert (
        r.returncode == 2
        and "--hf-config / --hf-split choose among a Hub dataset's files" in r.stderr
    )
    r = run(
        "--input",
        PLAIN,
        "--hf-split",
        "train",
        "--tokenizer-from",
        bpe_file,
        "--out",
        tmp_path / "g",
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: input {PLAIN} names its files: --hf-config / --hf-split choose within the Hub's parquet conversion of "
        f"a dataset named without a path (hf://datasets/o/plain)"
    ]


def _env_without_token() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
