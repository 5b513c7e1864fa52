"""Notebook 02 executed headless, top to bottom, in a smoke setting; then re-run to check it resumes."""

import json

from tests.conftest import TINY
from tests.nbrun import outputs_text, run_notebook


def test_notebook_02_runs_and_resumes(tmp_path, monkeypatch, small_text):
    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    params = {"RUN_NAME": "nb-smoke", "TEXT_PATH": str(small_text), "MAX_STEPS": 20, "OVERRIDES": TINY}
    nb = run_notebook("02_phase1_shakespeare.ipynb", params, cwd=tmp_path)
    text = outputs_text(nb)
    run = tmp_path / "root" / "runs" / "nb-smoke"
    assert (run / "loss.png").is_file() and (run / "samples.md").is_file()
    assert "step 20, val loss" in text
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells for o in c.get("outputs", []))  # the loss plot is shown
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 20

    # "Colab disconnected": run every cell again with a larger budget; training continues from step 20.
    params["MAX_STEPS"] = 30
    nb = run_notebook("02_phase1_shakespeare.ipynb", params, cwd=tmp_path)
    assert "resumed from" in outputs_text(nb)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
