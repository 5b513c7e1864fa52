"""Notebook 04 executed headless: playground widgets built, generation called, comparison table, export."""

from __future__ import annotations

import json

from tests.conftest import TINY
from tests.nbrun import outputs_text, run_notebook


def test_notebook_04_playground_compare_export(tmp_path, monkeypatch, char_data):
    from gptlib.train import train

    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    run = tmp_path / "root" / "runs" / "nb04"
    train(char_data, run, overrides=TINY + ["eval_interval=5"], max_steps=10, progress=False, log=lambda s: None)
    params = {"RUN_NAME": "nb04", "DEVICE": "cpu", "PROMPTS": "ROMEO:|KING", "CHECKPOINTS": "all",
              "MAX_NEW_TOKENS": 12, "EXPORT_DIR": str(tmp_path / "hf")}
    nb = run_notebook("04_generate.ipynb", params, cwd=tmp_path)
    text = outputs_text(nb)
    assert "step 10 · val" in text and "step 5 · val" in text  # the checkpoint list
    # The playground is displayed as a widget ...
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {})
               for c in nb.cells for o in c.get("outputs", []))
    # ... and generation ran through it (12 new characters after the prompt).
    gen_cell = next(c for c in nb.cells if c.cell_type == "code" and "pg.generate()" in c.source)
    printed = "".join(o.get("text", "") for o in gen_cell.outputs)
    assert printed.startswith("ROMEO:") and len(printed.rstrip("\n")) >= len("ROMEO:") + 1
    assert not any(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))
    # The comparison table: 2 prompts x 2 checkpoints.
    assert 'class="gptlib-compare"' in text and text.count("<td") >= 4
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["GPT2LMHeadModel"] and (tmp_path / "hf" / "tokenizer.json").is_file()


def test_playground_headless(tmp_path, char_data):
    """The widgets build without a browser; Generate streams into the output; errors show in the status."""
    from gptlib.train import train
    from gptlib.widgets import Playground, parse_list

    run = tmp_path / "run"
    train(char_data, run, overrides=TINY + ["eval_interval=5"], max_steps=10, progress=False, log=lambda s: None)
    pg = Playground(run, prompt="KING")
    assert [v for _, v in pg.checkpoint.options] == [10, 5]
    pg.checkpoint.value, pg.max_tokens.value, pg.temperature.value = 5, 15, 0.0
    res = pg.generate()
    assert res is not None and len(res.text) == 15 and "tokens/s" in pg.status.value
    assert "<b>KING</b>" in pg.output.value and not pg.button.disabled
    pg.button.click()  # the real button runs the same path
    assert "step 5" in pg.status.value
    pg.prompt.value = "\u2603"  # not in the char vocabulary: shown as an error, not raised
    assert pg.generate() is None and "not in the char vocabulary" in pg.status.value
    assert parse_list(r"ROMEO:|\n|") == ["ROMEO:", "\n"]
