"""Notebook 03 executed headless in a smoke setting (tiny model, char data); re-run after a 'disconnect' resumes."""

import json
import re
import shutil

import nbformat

from gptlib.training.logs import run_title
from gptlib.training.throughput import fmt_tokens, speed_text
from tests.conftest import REPO, TINY
from tests.nbrun import NOTEBOOKS, outputs_text, run_notebook


def test_notebook_03_runs_and_resumes(tmp_path, monkeypatch, char_data):
    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    # where notebook 01 would have put it
    shutil.copytree(char_data, tmp_path / "root" / "data" / "chars")
    # 8 sequences x 32 tokens = 256 tokens/step: a 5,120-token budget is 20 steps.
    params = {
        "DATASET_NAME": "chars",
        "RUN_NAME": "nb3",
        "PRESET": "phase1",
        "TOKEN_BUDGET_M": 0.00512,
        "DEVICE": "cpu",
        "AUTO_BATCH": True,
        "OVERRIDES": TINY,
    }
    nb = run_notebook("03_phase3_train.ipynb", params, cwd=tmp_path)
    text = outputs_text(nb)
    run = tmp_path / "root" / "runs" / "nb3"
    assert "256 tokens/step x 20 steps = 5.12K tokens" in text  # not "= 0.000B tokens"
    assert "MFU unknown on cpu" in text  # no made-up MFU on a CPU
    # not on Colab; a file Colab has not
    assert "Colab units" not in text and "benchmarks/results" not in text
    assert "-> RAM:" in text and "fits in RAM" in text  # the data path and why
    assert "auto micro-batch: no memory probe on cpu" in text
    assert "done: step 20, val loss" in text and re.search(
        r"[\d,]+ tokens/s while stepping; [\d.]+ s this session", text
    )
    train_cell = next(
        c for c in nb.cells if c.cell_type == "code" and "result = train(" in c.source
    )
    kinds = [
        ("png" if "image/png" in o.get("data", {}) else o.get("output_type"), o.get("text", ""))
        for o in train_cell.outputs
    ]
    png = [i for i, (k, _) in enumerate(kinds) if k == "png"]
    assert len(png) == 1  # the live loss plot, one display updated in place
    steps = [
        i
        for i, (k, t) in enumerate(kinds)
        if k == "stream" and ("step 10: train" in t or "step 20: train" in t)
    ]
    assert steps and min(steps) > png[0], kinds  # every "step N" line below the plot, none above it
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert (
        rows[-1]["mfu"] is None
        and rows[-1]["eta_s"] == 0
        and set(rows[-1]["time_split"]) == {"data", "fwd_bwd", "optim"}
    )

    # "Colab disconnected": run every cell again with a bigger budget; training continues from step 20.
    params["TOKEN_BUDGET_M"] = 0.00768
    nb = run_notebook("03_phase3_train.ipynb", params, cwd=tmp_path)
    text = outputs_text(nb)
    assert "resumed from step 20" in text and "done: step 30," in text
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))

    # run all again: finished, and the way on is the notebook's own setting (it said max_steps)
    text = outputs_text(run_notebook("03_phase3_train.ipynb", params, cwd=tmp_path))
    assert (
        "already finished at step 30" in text and "(raise TOKEN_BUDGET_M to train further)" in text
    )


def test_notebook_03_stopped_says_so_once_in_its_output(tmp_path, monkeypatch, char_data):
    """The stop button (SIGINT) at step 5: the note on the normal output, in words, not in stderr's red box; the bar
    left without an ETA; one tokens/s figure; and how to go on said once, in the cell's last line."""
    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    shutil.copytree(char_data, tmp_path / "root" / "data" / "chars")
    params = {
        "DATASET_NAME": "chars",
        "RUN_NAME": "nb3",
        "PRESET": "phase1",
        "TOKEN_BUDGET_M": 0.00512,
        "DEVICE": "cpu",
        "OVERRIDES": TINY,
    }
    nb = run_notebook(
        "03_phase3_train.ipynb",
        params,
        cwd=tmp_path,
        code=f"import sys\nsys.path.insert(0, {str(REPO)!r})\nimport tests.faulty\n"
        "tests.faulty.install('sigint:mid_step@5')\n",
    )
    train_cell = next(
        c for c in nb.cells if c.cell_type == "code" and "result = train(" in c.source
    )
    out = "".join(o.get("text", "") for o in train_cell.outputs if o.get("name") == "stdout")
    err = "".join(o.get("text", "") for o in train_cell.outputs if o.get("name") == "stderr")
    assert (
        "interrupted: finishing this step, saving a checkpoint, then stopping" in out
        and "SIGINT" not in out + err
    ), err
    # the bar left on the page: no ETA for a run that has stopped (it kept "ETA 0m08s")
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    texts = [m["state"].get("value") for m in state.values()]
    bar = [
        t.replace("\u2007", " ") for t in texts if isinstance(t, str) and "\u20075/20\u2007[" in t
    ]
    assert len(bar) == 1 and "tok/s" in bar[0] and "ETA" not in bar[0], texts
    # one tokens/s figure in the closing line (it gave two, 15,166 and 15,104)
    done = next(ln for ln in out.splitlines() if ln.startswith("done: step 5,"))
    assert len(re.findall(r"[\d,]+ tokens/s", done)) == 1 and " over the" not in done, done
    assert "stopped (interrupt) at step 5; checkpoint saved\n" in out
    assert outputs_text(nb).count("to continue") == 1
    assert out.rstrip().endswith("; 15 of 20 steps to go: run all cells again to continue"), out


def test_notebook_03_asks_colab_for_an_a100():
    """Without a GPU type Colab opens a notebook on a T4; and it is committed without outputs."""
    nb = nbformat.read(NOTEBOOKS / "03_phase3_train.ipynb", as_version=4)
    assert nb.metadata["accelerator"] == "GPU" and nb.metadata["colab"]["gpuType"] == "A100"
    for name in sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")):
        cells = nbformat.read(NOTEBOOKS / name, as_version=4).cells
        assert all(
            not c.get("outputs") and c.get("execution_count") is None
            for c in cells
            if c.cell_type == "code"
        ), name


def test_what_notebook_03_shows():
    """Token counts in a unit that fits, the bar's time split in words, a title naming the run once."""
    assert [fmt_tokens(n) for n in (5120, 999_600, 268_435_456, 2.8e9, 7)] == [
        "5.12K",
        "1M",
        "268M",
        "2.8B",
        "7",
    ]
    text = speed_text(
        {
            "mfu": None,
            "eta_s": 65.0,
            "time_split": {"data": 0.004, "fwd_bwd": 0.958, "optim": 0.038},
        },
        True,
    )
    assert text == "ETA 1m05s, time data 0% fwd_bwd 96% optim 4%"
    assert (
        run_title("phase1", "phase1") == "phase1"
        and run_title("gpt2-small", "run2", " · ") == "gpt2-small · run2"
    )


def test_notebook_03_with_another_preset_on_a_run_names_the_preset(
    tmp_path, monkeypatch, char_data
):
    """A run trained with one PRESET, the notebook run again with another and the same RUN_NAME: the refusal named
    vocab_multiple, a field the user never set ('drop the change to resume'); it names the presets and PRESET."""
    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    shutil.copytree(char_data, tmp_path / "root" / "data" / "chars")
    params = {
        "DATASET_NAME": "chars",
        "RUN_NAME": "nb3",
        "PRESET": "phase1",
        "TOKEN_BUDGET_M": 0.00256,
        "DEVICE": "cpu",
        "OVERRIDES": TINY,
    }
    run_notebook("03_phase3_train.ipynb", params, cwd=tmp_path)
    nb = run_notebook(
        "03_phase3_train.ipynb", {**params, "PRESET": "phase2"}, cwd=tmp_path, allow_errors=True
    )
    train_cell = next(
        c for c in nb.cells if c.cell_type == "code" and "result = train(" in c.source
    )
    [error] = [o for o in train_cell.outputs if o.get("output_type") == "error"]
    assert (
        "was made with preset phase1, this call asks for phase2: "
        'set PRESET = "phase1" to resume it' in error["evalue"]
    ), error["evalue"]
