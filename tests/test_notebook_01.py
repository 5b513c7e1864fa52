"""Notebook 01 executed headless in a smoke setting (demo corpus, tiny vocab); a re-run reuses the dataset."""

import shutil

from tests.conftest import REPO
from tests.nbrun import outputs_text, run_notebook
from tests.tokenize_kit import verified_meta


def test_notebook_01_tokenizes_the_demo_corpus_and_reruns(tmp_path, monkeypatch, shakespeare_path):
    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    cache = tmp_path / "cache"
    cache.mkdir()
    # the demo corpus, without a network
    shutil.copy(shakespeare_path, cache / "tinyshakespeare.txt")
    monkeypatch.setenv("GPTLIB_CACHE", str(cache))
    params = {"VOCAB_SIZE": 512, "TRAIN_MB": 0}
    nb = run_notebook("01_tokenize.ipynb", params, cwd=tmp_path)
    text = outputs_text(nb)
    assert "source: Tiny Shakespeare (demo): 1.1 MB, found in the cache, checksum-verified" in text
    assert "downloaded" not in text  # it was not
    data = tmp_path / "root" / "data" / "bpe"  # where notebook 03 looks for DATASET_NAME="bpe"
    meta = verified_meta(data)
    assert (
        meta.tokenizer["kind"] == "bpe" and meta.vocab_size == 512 and meta.dtype.name == "uint16"
    )
    for label in (
        "documents",
        "train tokens",
        "characters per token",
        "dtype",
        "shards (train + val)",
        "seconds",
    ):
        assert label in text
    source = shakespeare_path.read_text()
    # a one-document corpus: validation is its tail
    val_start = source[int(len(source) * 0.9) :][:300]
    assert val_start in text  # the decoded sample is the text, back
    before = {p.name: p.stat().st_mtime_ns for p in data.iterdir()}

    # "Colab disconnected": run it all again
    nb = run_notebook("01_tokenize.ipynb", params, cwd=tmp_path)
    assert "already holds this dataset; reusing it" in outputs_text(nb)
    assert {p.name: p.stat().st_mtime_ns for p in data.iterdir()} == before


def test_notebook_01_reads_a_url_source_with_a_budget(tmp_path, monkeypatch, shakespeare_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    docs = [d for d in shakespeare_path.read_text()[:200_000].split("\n\n") if d.strip()]
    src = tmp_path / "corpus" / "train-00000-of-00001.parquet"
    src.parent.mkdir()
    pq.write_table(pa.table({"code": docs}), src, row_group_size=100)
    params = {
        "SOURCE": "my files on Drive",
        "INPUT": src.as_uri(),
        "TEXT_COLUMN": "code",
        "MAX_TOKENS": "20K",
        "VOCAB_SIZE": 512,
        "TRAIN_MB": 0,
        "DATASET_NAME": "url",
    }
    nb = run_notebook("01_tokenize.ipynb", params, cwd=tmp_path)
    meta = verified_meta(tmp_path / "root" / "data" / "url")
    assert [s["path"] for s in meta.raw["sources"]] == [src.as_uri()]
    assert (
        meta.raw["stop_reason"] == "max_tokens"
        and 20_000 <= meta.tokens("train") + meta.tokens("val") < 21_000
    )
    # the line named the command line's --max-tokens, a flag notebook 01 has not
    assert "stopped at MAX_TOKENS 20,000: after document" in outputs_text(nb)


def test_a_tokenizer_file_that_is_not_there_names_the_notebooks_setting(
    tmp_path, monkeypatch, shakespeare_path
):
    """Notebook 01 with TOKENIZER_FILE a run's name (not its directory) was told '--tokenizer-from takes a run
    directory, ...', a flag the notebook has no cell for; it names TOKENIZER_FILE. Nothing is written."""
    import pytest
    from nbclient.exceptions import CellExecutionError

    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(shakespeare_path, cache / "tinyshakespeare.txt")
    monkeypatch.setenv("GPTLIB_CACHE", str(cache))
    params = {"VOCAB_SIZE": 512, "TRAIN_MB": 0, "TOKENIZER_FILE": "gpt2-small"}
    with pytest.raises(CellExecutionError) as e:
        run_notebook("01_tokenize.ipynb", params, cwd=tmp_path)
    said = next(line for line in str(e.value).splitlines() if "PrepareError: " in line)
    assert said.endswith(
        "tokenizer file gpt2-small does not exist (TOKENIZER_FILE (notebook 01) takes a run "
        "directory, a data directory, or a tokenizer.json)"
    ), said
    assert not (tmp_path / "root" / "data" / "bpe").exists()


def test_notebook_01_stopped_mid_tokenize_says_to_run_the_cell_again(
    tmp_path, monkeypatch, shakespeare_path
):
    """The stop button during the tokenize cell: its line said "run the same command again", a command a notebook
    user never typed; it says to run the cell again, which resumes."""
    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(shakespeare_path, cache / "tinyshakespeare.txt")
    monkeypatch.setenv("GPTLIB_CACHE", str(cache))
    params = {"VOCAB_SIZE": 512, "TRAIN_MB": 0}
    # the stop button (SIGINT to the kernel) once the corpus is being encoded
    stop = (
        "import os, signal, time\nfrom gptlib.data.tokenizer import BPETokenizer\n"
        "def _stop(self, texts):\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(5)\n"
        "BPETokenizer.encode_batch_ids = _stop\n"
    )
    nb = run_notebook("01_tokenize.ipynb", params, cwd=tmp_path, code=stop, allow_errors=True)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "meta = prepare(" in c.source)
    said = "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stderr")
    assert "tokenize stopped" in said and "run this cell again" in said, said
    assert "command" not in said, said
    # and so it does: the dataset is finished
    nb = run_notebook("01_tokenize.ipynb", params, cwd=tmp_path)
    assert "resuming the unfinished run" in outputs_text(nb)
    verified_meta(tmp_path / "root" / "data" / "bpe")


def test_notebook_01_a_network_that_stays_down_says_to_run_the_cell_again(
    tmp_path, monkeypatch, shakespeare_path, bpe_file
):
    """INPUT read over a network that stays down: the cell's one line said "run the same command again to resume"."""
    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    src = tmp_path / "corpus.txt"
    src.write_text(shakespeare_path.read_text()[:50_000])
    params = {"INPUT": f"faulty://{src}", "TOKENIZER_FILE": str(bpe_file), "DATASET_NAME": "net"}
    # from the 4th 8 KB read on, every read fails (tests/fakes.py's "faulty" filesystem), retried without the real
    # backoff
    down = (
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\nfrom tests.fakes import FAULTS\n"
        "FAULTS.reset(all_from=4)\nfrom gptlib.data import inputs, sources\n"
        "inputs.READ_BUFFER, sources.RETRY_DELAYS = 8192, (0.0,) * 8\n"
    )
    nb = run_notebook("01_tokenize.ipynb", params, cwd=tmp_path, code=down, allow_errors=True)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "meta = prepare(" in c.source)
    [error] = [o for o in cell.outputs if o.get("output_type") == "error"]
    assert error["evalue"].endswith("run this cell again to resume"), error["evalue"]
