"""Notebook 02 executed headless, top to bottom, in a smoke setting; then re-run to check it resumes, and once
more on the finished run."""

import json
import re

import nbformat

from gptlib.config import build_config
from gptlib.model import model_size
from tests.conftest import TINY, skip_without_muon
from tests.nbrun import NOTEBOOKS, outputs_text, run_notebook

NB = "02_phase1_shakespeare.ipynb"


def cell_text(nb, marker: str) -> str:
    cell = next(c for c in nb.cells if c.cell_type == "code" and marker in c.source)
    return "".join(o.get("text", "") for o in cell.outputs)


def test_notebook_02_runs_and_resumes(tmp_path, monkeypatch, small_text):
    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    # as when the suite runs on Colab itself (the GPU check): the kernel must not take itself for Colab's and mount
    # Drive (tests/nbrun.py)
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab-test")
    params = {
        "RUN_NAME": "nb-smoke",
        "TEXT_PATH": str(small_text),
        "MAX_STEPS": 20,
        "OVERRIDES": TINY,
    }
    nb = run_notebook(NB, params, cwd=tmp_path)
    text = outputs_text(nb)
    run = tmp_path / "root" / "runs" / "nb-smoke"
    assert (run / "loss.png").is_file() and (run / "samples.md").is_file()
    # the summary line: val loss rounded, one tokens/s figure, the session's time (TrainResult.summary)
    assert re.search(
        r"done: step 20, val loss \d+\.\d{4}, [\d,]+ tokens/s while stepping; [\d.]+ s this session, its first",
        text,
    ), text
    # the loss plot is shown
    assert any(
        o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
        for c in nb.cells
        for o in c.get("outputs", [])
    )
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 20
    # the samples table: HTML whose cells align top (a notebook centres table cells vertically)
    samples = next(
        c for c in nb.cells if c.cell_type == "code" and "samples_html(" in c.source
    ).outputs
    assert len(samples) == 1 and "vertical-align:top" in samples[0]["data"]["text/html"], samples
    # the generated text starts with its prompt, not mid-line
    assert cell_text(nb, "engine.generate(").startswith("ROMEO:")

    # a session cut short by MAX_MINUTES: how to go on said once, in the notebook's words, in its last line
    nb = run_notebook(NB, {**params, "MAX_STEPS": 30, "MAX_MINUTES": 1e-6}, cwd=tmp_path)
    train_out = cell_text(nb, "result = train(")
    assert re.search(r"max_minutes=1e-06 reached at step 2\d; checkpoint saved\n", train_out), (
        train_out
    )
    assert train_out.count("to continue") == 1 and train_out.endswith(
        " -> run all cells again to continue\n"
    )

    # "Colab disconnected": run every cell again with a larger budget; training continues to step 30.
    params["MAX_STEPS"] = 30
    nb = run_notebook(NB, params, cwd=tmp_path)
    assert "resumed from" in outputs_text(nb)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))

    # run all again on the finished run: it says so, with its val loss (not "val loss None, 0 tokens/s")
    nb = run_notebook(NB, params, cwd=tmp_path)
    train_out = cell_text(nb, "result = train(")
    assert re.search(r"already finished at step 30 \(val \d+\.\d{4}\); nothing to do", train_out), (
        train_out
    )
    # in the notebook's own terms (it said max_steps, a name the notebook does not have)
    assert "(raise MAX_STEPS to train further)" in train_out, train_out
    # train() and print(result.summary()): said once
    assert train_out.count("already finished") == 1, train_out
    # and nothing else: no data, RAM or "resumed from" lines
    assert len(train_out.splitlines()) == 1, train_out
    assert "None" not in train_out and " 0 tokens/s" not in train_out


def test_notebook_02_states_the_models_size():
    """The intro's "~0.34M-parameter GPT" is the phase1 preset's model (Tiny Shakespeare has the preset's 65 chars)."""
    nb = nbformat.read(NOTEBOOKS / NB, as_version=4)
    m = re.search(r"~([\d.]+)M-parameter", nb.cells[0].source)
    assert m, nb.cells[0].source
    assert float(m.group(1)) == round(model_size(build_config("phase1").model).params / 1e6, 2)


def test_the_modern_recipes_slow_muon_note_names_the_notebooks_way(
    tmp_path, monkeypatch, small_text
):
    """On a CPU that emulates bf16 (AVX2, no AVX-512: forced in the kernel) the modern recipe's note named
    `--set optimizer=adamw`, a command-line flag, to a notebook user: it names the notebook's OVERRIDES."""
    skip_without_muon()
    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    params = {
        "RUN_NAME": "muon",
        "TEXT_PATH": str(small_text),
        "MAX_STEPS": 2,
        "RECIPE": "modern",
        "OVERRIDES": TINY + ["sample_tokens=0"],
    }
    avx2 = "import torch\ntorch.backends.cpu.get_cpu_capability = lambda: 'AVX2'\n"
    nb = run_notebook(NB, params, cwd=tmp_path, code=avx2)
    notes = [ln for ln in cell_text(nb, "result = train(").splitlines() if "torch.optim.Muon" in ln]
    assert len(notes) == 1 and 'OVERRIDES = ["optimizer=adamw"] is faster' in notes[0], notes
    assert "--set" not in notes[0]
