"""Notebook 03 executed headless in a smoke setting (tiny model, char data); re-run after a 'disconnect' resumes."""

import json
import shutil

from tests.conftest import TINY
from tests.nbrun import outputs_text, run_notebook


def test_notebook_03_runs_and_resumes(tmp_path, monkeypatch, char_data):
    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    shutil.copytree(char_data, tmp_path / "root" / "data" / "chars")  # where notebook 01 would have put it
    # 8 sequences x 32 tokens = 256 tokens/step: a 5,120-token budget is 20 steps.
    params = {"DATASET_NAME": "chars", "RUN_NAME": "nb3", "PRESET": "phase1", "TOKEN_BUDGET_M": 0.00512,
              "DEVICE": "cpu", "AUTO_BATCH": True, "OVERRIDES": TINY}
    nb = run_notebook("03_phase3_train.ipynb", params, cwd=tmp_path)
    text = outputs_text(nb)
    run = tmp_path / "root" / "runs" / "nb3"
    assert "256 tokens/step x 20 steps" in text
    assert "MFU unknown on cpu" in text  # no made-up MFU on a CPU
    assert "-> RAM:" in text and "fits in RAM" in text  # the data path and why
    assert "auto micro-batch: no memory probe on cpu" in text
    assert "step 20/20" in text and "time split" in text
    pngs = [o for c in nb.cells for o in c.get("outputs", [])
            if o.get("output_type") in ("display_data", "update_display_data") and "image/png" in o.get("data", {})]
    assert pngs  # the live loss plot
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert rows[-1]["mfu"] is None and rows[-1]["eta_s"] == 0 and set(rows[-1]["time_split"]) == {"data", "fwd_bwd", "optim"}

    # "Colab disconnected": run every cell again with a bigger budget; training continues from step 20.
    params["TOKEN_BUDGET_M"] = 0.00768
    nb = run_notebook("03_phase3_train.ipynb", params, cwd=tmp_path)
    text = outputs_text(nb)
    assert "resumed from step 20" in text and "step 30/30" in text
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
