import os
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
    # `gptlib sample ... | head -1`: the reader is gone before the output is written; a quiet end, as SIGPIPE's
    cmd = [sys.executable, "-m", "gptlib", "sample", "--run-dir", str(run), "--num-samples", "3"]
    env = {
        k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"
    }  # buffered, as by default
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=300) == 141 and "Broken pipe" not in err and "Traceback" not in err, err


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
        # an OSError no check explains: one line all the same
        (
            ["train", "--data", "{data}", "--run-dir", "{tmp}/" + "a" * 300],
            "a: File name too long$",
        ),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, char_data, args, message):
    import re

    args = [a.format(tmp=tmp_path, data=char_data) for a in args]
    r = gptlib(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert re.search(message, r.stderr), r.stderr


def test_a_dropped_drive_met_anywhere_is_one_line_saying_what_to_do(
    tmp_path, char_data, monkeypatch, capsys
):
    """Google Drive's mount dropped (Errno 107) where no check explains it: the path, the error and what to do, one
    line and exit status 2, not a traceback."""
    import errno
    import os

    from gptlib.__main__ import main
    from gptlib.data import shards

    def dropped(path, what):
        raise OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN), str(path))

    # the data directory's first look (read_meta, from find_start)
    monkeypatch.setattr(shards, "check_dir", dropped)
    rc = main(["train", "--data", str(char_data), "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    said = (
        f"error: {char_data}: Transport endpoint is not connected; is Google Drive answering? Wait"
    )
    assert rc == 2 and err.startswith(said) and err.count("\n") == 1, err


def test_the_installed_script_runs_a_reader_detached_as_python_m_does(tmp_path, monkeypatch):
    """The `gptlib` console script (pyproject's gptlib.__main__:main) ran sample, eval and the exports in its own
    process, without the child that lets `python -m gptlib` exit when a Drive read hangs."""
    from gptlib import __main__, cli

    children = []
    monkeypatch.setattr(cli, "detached", lambda command: children.append(command) or 0)
    monkeypatch.setattr(sys, "argv", ["gptlib", "sample", "--run-dir", str(tmp_path)])
    assert __main__.main() == 0 and len(children) == 1
    # main([...]) (tests, a caller of its own) runs in its process: one line, no child
    assert (
        __main__.main(["sample", "--run-dir", str(tmp_path / "none")]) == 2 and len(children) == 1
    )


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


def test_input_given_twice_reads_both(tmp_path, capsys):
    """`--input a --input b` (as --set and --prompt repeat): both files (only the last was read, silently)."""
    import json

    from gptlib.__main__ import main

    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text(f"text of file {name}\n" * 200)
    args = ["tokenize", "--tokenizer", "char", "--out", str(tmp_path / "d"), "--quiet"]
    args += ["--input", str(tmp_path / "a.txt"), "--input", str(tmp_path / "b.txt")]
    assert main(args) == 0, capsys.readouterr().err
    sources = json.loads((tmp_path / "d" / "meta.json").read_text())["sources"]
    assert [s["path"] for s in sources] == [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]


def test_a_closed_stderr_pipe_keeps_what_stdout_wrote_to_a_file(tmp_path):
    """stdout to a file, stderr to a reader that has gone: the command's output stays in the file and it ends as
    a pipe's would (141); only the broken stream's buffered output goes nowhere."""
    code = (
        "import sys, types\n"
        "from gptlib.cli import _run\n"
        "def f(args):\n"
        "    print('the result, redirected to a file')\n"
        "    print('a notice', file=sys.stderr, flush=True)\n"
        "sys.exit(_run(types.SimpleNamespace(func=f)))\n"
    )
    out = tmp_path / "out.txt"
    # stdout buffered, as a file's is by default
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with open(out, "w") as f:
        p = subprocess.Popen(
            [sys.executable, "-c", code], stdout=f, stderr=subprocess.PIPE, env=env
        )
        p.stderr.close()
        status = p.wait(timeout=120)
    assert status == 141 and out.read_text() == "the result, redirected to a file\n"
