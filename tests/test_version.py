"""gptlib's version (issue 36, part 3): set in one place, installed by each notebook as the release it was written for,
recorded in every run, named when a run cannot be read; the command lines of earlier releases say what replaced them."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tarfile

import nbformat
import pytest

import gptlib
from gptlib.checkpoint.format import list_checkpoints
from gptlib.errors import GptlibError
from gptlib.fsutil import sha256_file
from gptlib.inference.loading import load_run
from gptlib.training.loop import train
from tests.conftest import REPO, TINY
from tests.nbrun import NOTEBOOKS

VERSION = gptlib.__version__


def quiet(_msg):
    pass


def test_the_version_is_set_once_and_is_semantic():
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)
    # pyproject.toml reads gptlib.__version__
    assert importlib.metadata.version("gptlib") == VERSION
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    # read from gptlib.__version__
    assert "version" not in project and "version" in project["dynamic"]


@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_each_notebook_installs_the_release_it_was_written_for(name):
    """A notebook saved in Drive last week installed `main` and broke when main changed; now it installs its tag."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    installs = re.findall(
        r"git\+https://github\.com/gptlib/gptlib[^\"']*", "\n".join(c.source for c in nb.cells)
    )
    assert installs == [f"git+https://github.com/gptlib/gptlib@v{VERSION}"], installs


def test_the_changelog_opens_with_this_release():
    text = (REPO / "CHANGELOG.md").read_text()
    assert re.findall(r"^## (\S+) ", text, re.M)[0] == VERSION


def test_a_run_records_the_version_that_trained_it(char_data, tmp_path):
    run = tmp_path / "run"
    train(char_data, run, "phase1", TINY, max_steps=2, progress=False, log=quiet)
    ck = list_checkpoints(run)[0]
    assert json.loads((run / "config.json").read_text())["gptlib_version"] == VERSION
    assert json.loads((ck / "manifest.json").read_text())["gptlib_version"] == VERSION
    assert json.loads((ck / "state.json").read_text())["config"]["gptlib_version"] == VERSION


def test_a_run_of_a_newer_gptlib_is_named_with_both_versions(char_data, tmp_path):
    """A config field this version does not know: the one line says which gptlib wrote it and which reads it."""
    run = tmp_path / "run"
    train(char_data, run, "phase1", TINY, max_steps=2, progress=False, log=quiet)
    ck = list_checkpoints(run)[0]
    state = json.loads((ck / "state.json").read_text())
    state["config"]["gptlib_version"] = "9.9.0"
    state["config"]["train"]["a_future_field"] = 1
    (ck / "state.json").write_text(json.dumps(state))
    # as that gptlib wrote it: consistent, not damaged
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"]["state.json"] = {
        "size": (ck / "state.json").stat().st_size,
        "sha256": sha256_file(ck / "state.json"),
    }
    (ck / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GptlibError) as e:
        load_run(run)
    msg = str(e.value)
    assert (
        "a_future_field" in msg and f"written by gptlib 9.9.0, read by gptlib {VERSION}" in msg
    ), msg


def test_a_run_of_0_1_0_resumes_and_says_so(char_data, tmp_path):
    """tests/fixtures/run_ce01044.tar.gz: a run made before versions were recorded (tests/test_old_checkpoints.py)."""
    with tarfile.open(REPO / "tests" / "fixtures" / "run_ce01044.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    logs = []
    r = train(
        char_data,
        tmp_path / "run",
        "phase1",
        TINY + ["dropout=0.1", "save_every_steps=5", "keep_last=2"],
        max_steps=22,
        progress=False,
        log=logs.append,
    )
    assert r.resumed_from == 20
    assert (
        f"resume: trained by gptlib 0.1.0 or earlier so far, by gptlib {VERSION} from step 20 on"
        in logs
    ), logs
    assert json.loads((tmp_path / "run" / "config.json").read_text())["gptlib_version"] == VERSION


@pytest.mark.parametrize(
    "args,replacement",
    [
        (["train", "--data", "d", "--run-dir", "r", "--keep-last", "3"], "--set keep_last=N"),
        (
            ["train", "--data", "d", "--run-dir", "r", "--save-every-steps=100"],
            "--set save_every_steps=N",
        ),
        (["bench", "ladder"], "python benchmarks/bench.py"),
    ],
)
def test_last_weeks_command_lines_say_what_replaced_them(args, replacement, tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "gptlib", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    gone = (
        args[0]
        if args[0] == "bench"
        else args[-2]
        if "=" not in args[-1]
        else args[-1].split("=")[0]
    )
    assert p.returncode == 2 and p.stderr == (
        f"error: {gone} is not in gptlib {VERSION}: use {replacement}"
        f"{' (from a clone of the repository)' if gone == 'bench' else ''} "
        f"(CHANGELOG.md)\n"
    ), p.stderr
    assert not (tmp_path / "r").exists()


def test_the_readme_says_how_to_update():
    text = (REPO / "README.md").read_text()
    assert "## Versions and updating" in text and f"@v{VERSION}" in text and "CHANGELOG.md" in text
