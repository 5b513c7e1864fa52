import subprocess
import sys

import pytest

from tests.conftest import TINY


def gptlib(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "gptlib", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


@pytest.mark.parametrize(
    "cmd",
    [
        [],
        ["tokenize"],
        ["train"],
        ["sample"],
        ["fetch-shakespeare"],
        ["eval"],
        ["export-gguf"],
        ["push"],
    ],
)
def test_help(cmd):
    r = gptlib(*cmd, "--help")
    assert r.returncode == 0 and "usage:" in r.stdout


def test_tokenize_train_sample_end_to_end(tmp_path, small_text):
    data, run = tmp_path / "data", tmp_path / "run"
    r = gptlib("tokenize", "--input", small_text, "--tokenizer", "char", "--out", data)
    assert r.returncode == 0, r.stderr
    sets = [a for s in TINY for a in ("--set", s)]
    r = gptlib(
        "train",
        "--data",
        data,
        "--preset",
        "phase1",
        "--run-dir",
        run,
        "--max-steps",
        12,
        "--seed",
        3,
        "--device",
        "cpu",
        "--no-compile",
        "--quiet",
        *sets,
    )
    assert r.returncode == 0, r.stderr
    assert "done: step 12" in r.stdout
    r = gptlib(
        "sample", "--run-dir", run, "--prompt", "ROMEO:", "--max-new-tokens", 20, "--temperature", 0
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:") and len(r.stdout.rstrip("\n")) >= 20
    again = gptlib(
        "sample", "--run-dir", run, "--prompt", "ROMEO:", "--max-new-tokens", 20, "--temperature", 0
    )
    assert again.stdout == r.stdout  # greedy is deterministic


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["tokenize", "--input", "/nonexistent/x.txt", "--out", "{tmp}/d"],
            "input file /nonexistent/x.txt does not exist",
        ),
        (
            ["train", "--data", "{tmp}/nodata", "--run-dir", "{tmp}/r"],
            "data directory .*nodata does not exist",
        ),
        (
            ["train", "--data", "{data}", "--run-dir", "{tmp}/r", "--set", "n_layerz=2"],
            "unknown config field 'n_layerz'",
        ),
        (
            ["train", "--data", "{data}", "--run-dir", "{tmp}/r", "--set", "n_layer=0"],
            "n_layer=0 must be a positive",
        ),
        (
            ["train", "--data", "{data}", "--run-dir", "{tmp}/r", "--set", "n_head=5"],
            "n_head=5 does not divide n_embd",
        ),
        (
            ["train", "--data", "{data}", "--run-dir", "{tmp}/r", "--set", "learning_rate=-1"],
            "learning_rate=-1.0 must be",
        ),
        (["sample", "--run-dir", "{tmp}/empty"], "no valid checkpoint in"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, char_data, args, message):
    import re

    args = [a.format(tmp=tmp_path, data=char_data) for a in args]
    r = gptlib(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert re.search(message, r.stderr), r.stderr


def test_unknown_preset_is_rejected_by_argparse(tmp_path, char_data):
    r = gptlib("train", "--data", char_data, "--run-dir", tmp_path / "r", "--preset", "huge")
    assert r.returncode == 2 and "invalid choice: 'huge'" in r.stderr


def test_a_run_directory_given_as_data_is_named_with_the_data_to_pass(tmp_path, char_data):
    """--data pointing at a training run (or one of its checkpoints) says what it is and names the data directory
    the checkpoint records, in one line, and leaves the run as it was; it used to suggest an interrupted tokenize."""
    import hashlib

    from gptlib.training.loop import train

    run = tmp_path / "run"
    train(char_data, run, overrides=TINY, max_steps=4, progress=False, log=lambda s: None)
    (ckpt,) = sorted((run / "checkpoints").iterdir())
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in run.rglob("*") if p.is_file()}
    for given in (run, ckpt):
        what = f"{given} is a training run or a checkpoint of one, not a dataset"
        r = gptlib("train", "--data", given, "--run-dir", tmp_path / "other", "--device", "cpu")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        line = r.stderr.strip()
        assert (
            "\n" not in line
            and what in line
            and f"the data directory it was trained on, {char_data}" in line
        )
        assert "interrupted" not in line
    assert {
        p: hashlib.sha256(p.read_bytes()).hexdigest() for p in run.rglob("*") if p.is_file()
    } == before
