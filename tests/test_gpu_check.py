"""benchmarks/gpu_check.sh on a CPU (issue 35): the plan of each part holds before a GPU session spends its 15
device-minutes on it. Its parts are listed with budgets that fit one 10-minute call; each part's tests collect and its
benchmarks parse their arguments; the wheels the lent image lacks resolve for its Python 3.12; a part run here (its
tests skip) writes its log and its row, and --next then goes on to the next part at this code."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests.conftest import REPO

PART_MAX_S = 360  # one call has 10 minutes; the machine's start and a re-run need the rest


def check(*args, results=None, timeout=300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPTLIB_GPU_RESULTS")}
    cmd = ["bash", "benchmarks/gpu_check.sh", *args] + (
        ["--results", str(results)] if results else []
    )
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_list_gives_each_part_its_budget_then_its_steps():
    p = check("--list")
    assert p.returncode == 0, p.stderr
    parts = re.findall(r"^part (\d+) +(\d+) s  (.+)$", p.stdout, re.M)
    assert [int(n) for n, _, _ in parts] == list(range(1, len(parts) + 1)) and len(parts) >= 5, (
        p.stdout
    )
    assert "first contact" in parts[0][2] and "T4" in parts[0][2]
    for block in re.split(r"^(?=part \d+ )", p.stdout, flags=re.M)[1:]:
        head, *steps = block.strip().splitlines()
        budget = int(re.match(r"part \d+ +(\d+) s", head).group(1))
        step_budgets = [int(re.match(r" +\S+ +(\d+) s  ", s).group(1)) for s in steps]
        assert step_budgets and sum(step_budgets) == budget <= PART_MAX_S, block
        # every part installs what it needs first (a fresh machine)
        assert re.match(r" +setup ", steps[0]), block


def test_the_dry_run_collects_every_part_and_resolves_the_wheels():
    p = check("--dry", timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    n_parts = len(re.findall(r"^part \d+ ", check("--list").stdout, re.M))
    collected = re.findall(r"^part (\d+) \((\d+) s\): tests collects (\d+) tests$", p.stdout, re.M)
    assert {int(n) for n, _, _ in collected} >= {1, 2, 3}
    assert all(int(b) <= PART_MAX_S and int(t) > 0 for _, b, t in collected), collected
    assert {int(n) for n in re.findall(r"^part (\d+) ", p.stdout, re.M)} == set(
        range(1, n_parts + 1)
    )
    wheels = re.search(r"^wheels the GPU image lacks \((\d+)\): (.+)$", p.stdout, re.M)
    assert wheels, p.stdout
    names = {w.split("==")[0].lower().replace("_", "-") for w in wheels.group(2).split()}
    assert {"ipywidgets", "nbclient", "nbformat", "ipykernel", "gguf"} <= names
    # the image's own are never carried
    assert not names & {"torch", "numpy", "transformers", "tokenizers"}, names


def test_a_part_writes_its_log_and_row_and_next_goes_on(tmp_path):
    """Part 1 run on this CPU: its tests skip (no GPU), so it is not a pass, but its log and its summary row are
    written, with this code's hash; --next (here --which, which says what --next would run) then picks part 2."""
    assert check("--which", results=tmp_path).stdout.startswith("part 1:")
    p = check("--part", "1", results=tmp_path)
    assert p.returncode == 1, p.stdout[-3000:]  # skipped tests are not a pass
    [log] = tmp_path.glob("gpu_*_part1.log")
    text = log.read_text()
    assert "GPU check part 1: first contact" in text and "--- tests: SKIPPED" in text
    rows = (tmp_path / "gpu_summary.txt").read_text().splitlines()
    assert rows[0].split()[:5] == ["part", "status", "seconds", "budget", "code"]
    code = re.search(r"^code (\w+),", text, re.M).group(1)
    assert rows[-1].split()[:2] == ["1", "tests:SKIPPED"] and rows[-1].split()[4] == code, rows
    assert check("--which", results=tmp_path).stdout.startswith(
        f"part 2: the first without a row at code {code}"
    )


def test_the_committed_summary_is_where_next_starts(tmp_path):
    """A lent machine's results folder starts empty: the rows come from benchmarks/results/gpu_summary.txt."""
    shutil.copy(REPO / "benchmarks" / "results" / "gpu_summary.txt", tmp_path / "committed.txt")
    p = check("--which", results=tmp_path / "out")
    assert p.returncode == 0 and re.match(r"part \d+: ", p.stdout), p.stdout + p.stderr
    assert (tmp_path / "out" / "gpu_summary.txt").read_text() == (
        tmp_path / "committed.txt"
    ).read_text()


@pytest.mark.parametrize("args", [[], ["--part", "0"], ["--bogus"]])
def test_a_bad_call_says_what_to_do(args):
    p = check(*args)
    assert (
        p.returncode == 2 and p.stderr.startswith("gpu_check: ") and len(p.stderr.splitlines()) == 1
    ), p.stderr
