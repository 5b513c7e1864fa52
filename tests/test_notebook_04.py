"""Notebook 04 executed headless: playground widgets built, generation called, checkpoints compared, export."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

from tests.conftest import TINY
from tests.nbrun import outputs_text, run_notebook


def test_notebook_04_playground_compare_export(tmp_path, monkeypatch, char_data):
    from gptlib.training.loop import train

    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    run = tmp_path / "root" / "runs" / "nb04"
    train(
        char_data,
        run,
        overrides=TINY + ["eval_interval=5"],
        max_steps=10,
        progress=False,
        log=lambda s: None,
    )
    # a run to compare with
    train(
        char_data,
        run.with_name("nb04-small-batch"),
        overrides=TINY + ["eval_interval=5", "batch_size=4"],
        max_steps=10,
        progress=False,
        log=lambda s: None,
    )
    # HellaSwag-shaped items the char vocabulary can encode
    hs_file = tmp_path / "hellaswag_small.jsonl"
    hs_file.write_text(
        "".join(
            json.dumps(
                {
                    "ctx": "KING RICHARD",
                    "label": i % 4,
                    "endings": ["my lord", "the crown", "a horse", "to bed"],
                }
            )
            + "\n"
            for i in range(6)
        )
    )
    params = {
        "RUN_NAME": "nb04",
        "DEVICE": "cpu",
        "PROMPTS": "ROMEO:|KING",
        "CHECKPOINTS": "all",
        "MAX_NEW_TOKENS": 12,
        "EXPORT_DIR": str(tmp_path / "hf"),
        "EVAL_TASKS": "bpb, hellaswag",
        "HELLASWAG_FILE": str(hs_file),
        "BPB_WINDOWS": 20,
    }
    nb = run_notebook("04_generate.ipynb", params, cwd=tmp_path)
    text = outputs_text(nb)
    # the checkpoint list: its "val" is training's validation (batch_size 8 x eval_batches 2), not eval's windows
    assert re.search(
        r"step 10 · val \d\.\d{3} \(training's validation: 16 sequences\) · best\n", text
    ), text
    assert re.search(r"step 5 · val \d\.\d{3} \(training's validation: 16 sequences\)\n", text), (
        text
    )
    # The playground is displayed as a widget ...
    assert any(
        "application/vnd.jupyter.widget-view+json" in o.get("data", {})
        for c in nb.cells
        for o in c.get("outputs", [])
    )
    # ... and generation ran through it (12 new characters after the prompt).
    gen_cell = next(c for c in nb.cells if c.cell_type == "code" and "pg.generate()" in c.source)
    printed = "".join(o.get("text", "") for o in gen_cell.outputs)
    assert printed.startswith("ROMEO:") and len(printed.rstrip("\n")) >= len("ROMEO:") + 1
    assert not any(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))
    # The comparison: a table, a row per checkpoint (oldest first), a column per prompt, each cell top-left.
    cmp_cell = next(c for c in nb.cells if c.cell_type == "code" and "Engine.from_run(" in c.source)
    shown = [o["data"]["text/html"] for o in cmp_cell.outputs if "text/html" in o.get("data", {})]
    assert len(shown) == 1 and not any(o.get("text") for o in cmp_cell.outputs), cmp_cell.outputs
    table = ET.fromstring("".join(shown[0]))
    grid = [["".join(c.itertext()) for c in tr] for tr in table.iter("tr")]
    assert grid[0] == ["checkpoint", "'ROMEO:'", "'KING'"] and len(grid) == 3, grid
    assert grid[1][0].startswith("step 5 · val") and grid[2][0].startswith("step 10 · val"), grid
    assert all(
        r[1].startswith("ROMEO:") and r[2].startswith("KING") and len(r[1]) > len("ROMEO:")
        for r in grid[1:]
    )
    assert all("vertical-align:top" in c.get("style") for tr in table.iter("tr") for c in tr)
    # Evaluate: both checkpoints x {bpb, HellaSwag}, the GPT-2 reference row, the acc_norm plot, eval.jsonl.
    eval_cell = next(c for c in nb.cells if c.cell_type == "code" and "format_table(" in c.source)
    table = "".join(o.get("text", "") for o in eval_cell.outputs)
    assert (
        "step 5" in table
        and "step 10" in table
        and "GPT-2 124M (OpenAI)" in table
        and "0.2955" in table
    )
    assert re.search(r"nats/token +windows +tokens", table)
    # BPB_WINDOWS 20 of 32 tokens; bits per byte and the accuracies ± their standard errors
    assert re.search(r"step 5 +1,280 +\d\.\d{4} ± \d\.\d{4} +[\d.]+ +20 +640 ", table), table
    assert re.search(r" 1,280 .* \d\.\d{4} ± \d\.\d{4} +\d\.\d{4} ± \d\.\d{4} +6 ", table), table
    # the two checkpoints compared: within noise, or which is better
    for figure in ("val bpb", "HellaSwag acc_norm"):
        assert re.search(
            rf"^{figure}, step 10 - step 5: [+-]\d\.\d{{4}}; 2 x combined standard error \d\.\d{{4}}: "
            r"(within noise|step (5|10) is better)$",
            table,
            re.M,
        ), table
    assert (
        "nats/token: on the windows column's windows" in table
        and "is training's validation" in table
    )
    eval_rows = [json.loads(ln) for ln in (run / "eval.jsonl").read_text().splitlines()]
    assert sorted((r["task"], r["step"]) for r in eval_rows) == [
        ("bpb", 5),
        ("bpb", 10),
        ("hellaswag", 5),
        ("hellaswag", 10),
    ]
    assert all(r["n"] == 6 for r in eval_rows if r["task"] == "hellaswag")
    plot_cell = next(
        c for c in nb.cells if c.cell_type == "code" and "hellaswag_figure(" in c.source
    )
    assert any("image/png" in o.get("data", {}) for o in plot_cell.outputs)
    # both runs' val loss
    runs_cell = next(c for c in nb.cells if c.cell_type == "code" and "runs_figure(" in c.source)
    assert [o["output_type"] for o in runs_cell.outputs] == ["display_data"], runs_cell.outputs
    assert "image/png" in runs_cell.outputs[0]["data"]
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (
        cfg["architectures"] == ["GPT2LMHeadModel"]
        and (tmp_path / "hf" / "tokenizer.json").is_file()
    )
    # Run all again (Colab, after a disconnect): each score eval.jsonl records is reused, none scored or appended
    recorded = (run / "eval.jsonl").read_bytes()
    nb = run_notebook("04_generate.ipynb", params, cwd=tmp_path)
    eval_cell = next(c for c in nb.cells if c.cell_type == "code" and "format_table(" in c.source)
    again = "".join(o.get("text", "") for o in eval_cell.outputs)
    assert (run / "eval.jsonl").read_bytes() == recorded and again.endswith(table), again
    for task in ("bpb", "hellaswag"):
        assert f"{task}: reused the rows {run / 'eval.jsonl'} records for steps 5, 10 " in again


def test_playground_headless(tmp_path, char_data):
    """The widgets build without a browser; Generate streams into the output; errors show in the status."""
    from gptlib.training.loop import train
    from gptlib.widgets import Playground, parse_list

    run = tmp_path / "run"
    train(
        char_data,
        run,
        overrides=TINY + ["eval_interval=5"],
        max_steps=10,
        progress=False,
        log=lambda s: None,
    )
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
    # what the notebook's cell prints: the words, not the markup (it printed <span style=...>...&#x27;)
    assert pg.status_text.startswith("GenerationError: prompt 0 ('\u2603')"), pg.status_text
    # advice the Playground can follow
    assert "unknown='map'" not in pg.status.value and "prompt" in pg.status.value
    # the previous text does not stay below the error looking like its result
    assert pg.output.value == ""
    assert pg.status not in [
        w for box in pg.widget.children if hasattr(box, "children") for w in box.children
    ]
    assert pg.seed.style.description_width == "initial"  # "Seed (-1 random)" is not cut off
    assert parse_list(r"ROMEO:|\n|") == ["ROMEO:", "\n"]


def test_export_cell_without_export_dir_says_what_export_is(tmp_path, monkeypatch, capsys):
    """With EXPORT_DIR empty (a Voila dashboard user cannot see the parameters cell) the cell says what export is
    and where the files would go; nothing is written."""
    import nbformat

    from tests.nbrun import NOTEBOOKS

    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    nb = nbformat.read(NOTEBOOKS / "04_generate.ipynb", as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "export_hf(" in c.source)
    run_dir = tmp_path / "root" / "runs" / "r"
    exec(cell.source, {"EXPORT_DIR": "", "EXPORT_CHECKPOINT": "best", "run_dir": run_dir})
    out = capsys.readouterr().out
    where = tmp_path / "root" / "exports" / "r"
    assert "set EXPORT_DIR to export" not in out and "Not exported" in out
    assert (
        "Hugging Face" in out
        and "model.safetensors" in out
        and str(where) in out
        and "export-hf" in out
    ), out
    assert not where.exists()


def test_notebook_04_gguf_and_share_cells_on_a_bpe_run(tmp_path, monkeypatch, small_text):
    """The GGUF cell writes a file llama.cpp's reader takes; the Share cell's dry run writes the commit's files
    (transformers folder, GGUF, loss curve, a model card the Hub parses) and changes nothing in the run."""
    import gguf
    from huggingface_hub import ModelCard

    from tests.gguf_kit import bpe_data, bpe_run, tree_digest

    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    run = bpe_run(bpe_data(small_text, tmp_path / "data"), tmp_path / "root" / "runs" / "nb04")
    before = tree_digest(run)
    params = {
        "RUN_NAME": "nb04",
        "DEVICE": "cpu",
        "PROMPTS": "ROMEO:",
        "CHECKPOINTS": "latest",
        "MAX_NEW_TOKENS": 4,
        "EVAL_TASKS": "bpb",
        "BPB_WINDOWS": 4,
        "GGUF_FILE": str(tmp_path / "m.gguf"),
        "GGUF_DTYPE": "q8_0",
        "HUB_REPO": "alice/nb04-gpt",
        "HUB_HARDWARE": "a test CPU",
        "HUB_DRY_RUN": str(tmp_path / "push"),
    }
    nb = run_notebook("04_generate.ipynb", params, cwd=tmp_path)
    assert not any(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))
    text = outputs_text(nb)
    assert (
        f"exported to {tmp_path / 'm.gguf'}" in text
        and f"wrote the commit's files to {tmp_path / 'push'}" in text
    )
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    assert (
        fields["general.architecture"].contents() == "gpt2"
        and fields["general.file_type"].contents() == 7
    )
    assert {
        "README.md",
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "loss.png",
        "nb04-gpt-F16.gguf",
    } <= {p.name for p in (tmp_path / "push").iterdir()}
    card = ModelCard.load(tmp_path / "push" / "README.md")
    assert card.data.pipeline_tag == "text-generation" and "a test CPU" in card.text
    # the bpb the notebook just ran
    assert "bits per byte" in {r.metric_name for r in card.data.eval_results}
    assert {k: v for k, v in tree_digest(run).items() if k != "eval.jsonl"} == before


def test_compare_cell_with_seed_minus_one_samples_at_random(tmp_path, char_data, monkeypatch):
    """SEED = -1, which the playground above takes as random ('Seed (-1 random)'), failed the compare cell with
    'seed=-1 must be in [0, 2**63) (or None for random)', a None its integer form cannot hold: now one random seed
    serves every checkpoint, as the playground does."""
    import IPython.display
    import nbformat

    from gptlib import checkpoint_label, checkpoint_table
    from gptlib.training.loop import train
    from tests.nbrun import NOTEBOOKS

    run = tmp_path / "run"
    train(
        char_data,
        run,
        overrides=TINY + ["eval_interval=5"],
        max_steps=10,
        progress=False,
        log=print,
    )
    shown = []
    handle = type("Handle", (), {"update": lambda self, h: shown.append(h.data)})()
    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: handle)
    nb = nbformat.read(NOTEBOOKS / "04_generate.ipynb", as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "Engine.from_run(" in c.source)
    params = {"MAX_NEW_TOKENS": 8, "TEMPERATURE": 0.8, "TOP_K": 0, "TOP_P": 0.95, "SEED": -1}
    scope = {**params, "PROMPTS": "ROMEO:", "run_dir": run, "device": "cpu"}
    scope |= {
        "checkpoint_table": checkpoint_table,
        "checkpoint_label": checkpoint_label,
    }  # notebook's cell 3
    exec(cell.source, scope)
    assert len(scope["rows"]) == 2 and all(len(s[0]) > len("ROMEO:") for _, s in scope["rows"]), (
        shown
    )


def test_compare_cell_passes_over_a_checkpoint_training_deleted(
    tmp_path, char_data, monkeypatch, capsys
):
    """The compare cell on a run still training: keep_last deleting the oldest checkpoint between the cell's listing
    and its load stopped the cell with 'no complete checkpoint for step 5'. It is passed over in one line; the
    others are drawn. The line said 'deleted by training', also of one deleted by hand: it says that it is gone."""
    import IPython.display
    import nbformat

    from gptlib import checkpoint_label, checkpoint_table
    from gptlib.checkpoint.format import remove_tree
    from gptlib.training.loop import train
    from tests.nbrun import NOTEBOOKS

    run = tmp_path / "run"
    train(char_data, run, overrides=TINY + ["eval_interval=5"], max_steps=10, progress=False)
    capsys.readouterr()

    def listed_then_rotated(run_dir):
        rows = checkpoint_table(run_dir)
        remove_tree(rows[-1]["info"].path)  # the oldest, as keep_last's rotation deletes it
        return rows

    handle = type("Handle", (), {"update": lambda self, h: None})()
    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: handle)
    nb = nbformat.read(NOTEBOOKS / "04_generate.ipynb", as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "Engine.from_run(" in c.source)
    params = {"MAX_NEW_TOKENS": 8, "TEMPERATURE": 0.8, "TOP_K": 0, "TOP_P": 0.95, "SEED": 1}
    scope = {**params, "PROMPTS": "ROMEO:", "run_dir": run, "device": "cpu"}
    scope |= {"checkpoint_table": listed_then_rotated, "checkpoint_label": checkpoint_label}
    exec(cell.source, scope)
    assert [label.split(" ·")[0] for label, _ in scope["rows"]] == ["step 10"], scope["rows"]
    assert len(scope["rows"][0][1][0]) > len("ROMEO:")
    said = capsys.readouterr().out.splitlines()
    assert said == ["step 5: gone since it was listed (training rotates old ones); passed over"], (
        said
    )


def test_playground_cell_takes_the_parameters_as_given(tmp_path, char_data, monkeypatch):
    """MAX_NEW_TOKENS = 3000 (or TOP_K 600, TEMPERATURE 2.5) went into the compare cell as given but the playground's
    sliders clamped them to their ranges (2,000, 500, 2.0) without a word: the ranges now hold the values given."""
    import IPython.display
    import nbformat

    from gptlib.training.loop import train
    from gptlib.widgets import sampling_config
    from tests.nbrun import NOTEBOOKS

    run = tmp_path / "run"
    train(char_data, run, overrides=TINY, max_steps=2, progress=False, log=lambda s: None)
    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: None)
    nb = nbformat.read(NOTEBOOKS / "04_generate.ipynb", as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "Playground(" in c.source)
    params = {"MAX_NEW_TOKENS": 3000, "TEMPERATURE": 2.5, "TOP_K": 600, "TOP_P": 0.01, "SEED": 7}
    scope = {**params, "run_dir": run, "device": "cpu"}
    exec(cell.source, scope)
    cfg = sampling_config(scope["pg"], top_p=scope["pg"].top_p.value)
    got = (cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed)
    assert got == (3000, 2.5, 600, 0.01, 7), got


def test_evaluate_cell_passes_over_a_checkpoint_training_deleted(
    tmp_path, char_data, monkeypatch, capsys
):
    """Evaluate with CHECKPOINTS = "all" on a run still training: keep_last deleting the oldest checkpoint between the
    listing and its evaluation failed the whole task ('bpb: not evaluated: ... no complete checkpoint for step 5').
    It is passed over in one line; the others are scored. The line said 'deleted by training', also of a checkpoint
    its user deleted by hand: it says what is known, that it is gone."""
    import nbformat
    import torch

    import gptlib.evaluation.evaluate as ev
    from gptlib.checkpoint.format import remove_tree
    from gptlib.inference.loading import checkpoint_table, select_steps
    from gptlib.training.loop import train
    from tests.nbrun import NOTEBOOKS

    run = tmp_path / "run"
    train(char_data, run, overrides=TINY + ["eval_interval=5"], max_steps=10, progress=False)
    capsys.readouterr()

    def listed_then_rotated(run_dir, which):
        steps = select_steps(run_dir, which)
        remove_tree(
            checkpoint_table(run_dir)[-1]["info"].path
        )  # the oldest, as keep_last's rotation deletes it
        return steps

    monkeypatch.setattr(ev, "select_steps", listed_then_rotated)
    nb = nbformat.read(NOTEBOOKS / "04_generate.ipynb", as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "evaluate_run(" in c.source)
    params = {"EVAL_TASKS": "bpb", "CHECKPOINTS": "all", "BPB_WINDOWS": 20, "EVAL_LIMIT": -1}
    scope = {**params, "HELLASWAG_FILE": "", "run_dir": run, "device": torch.device("cpu")}
    exec(cell.source, scope)
    assert [r["step"] for r in scope["eval_rows"]] == [10], capsys.readouterr()
    said = [
        line for line in capsys.readouterr().err.splitlines() if "step" in line
    ]  # not bpb's progress bar
    assert said == ["step 5: gone since it was listed (training rotates old ones); passed over"], (
        said
    )


def test_evaluates_rows_reach_drive_and_outlive_the_vm_and_training_going_on(
    tmp_path, monkeypatch, small_text
):
    """The journey through the notebooks on Colab, each on its own VM: notebook 02 trains (mirrored to Drive, its
    end-of-run HellaSwag row in eval.jsonl); notebook 04 on another VM evaluates the run's Drive copy, bits per byte
    too (notebook 02 tokenized onto its own VM's disk: 'bpb: not evaluated: ... which is gone'); that VM resets, and
    notebook 04 on a new one reuses every row (scores nothing) and its table and model card show them; notebook 02
    trains on: notebook 04's rows stay on Drive."""
    import os
    import shutil

    from tests.fakes import colab_vm

    monkeypatch.delenv("GPTLIB_ROOT", raising=False)
    drive, mirror = tmp_path / "drive", tmp_path / "drive" / "MyDrive" / "gptlib" / "runs" / "tiny"
    rows_file = mirror / "eval.jsonl"
    hs_file = tmp_path / "hs.jsonl"
    ending = {"ctx": "KING RICHARD", "endings": ["my lord", "the crown", "a horse", "to bed"]}
    hs_file.write_text("".join(json.dumps({**ending, "label": i % 4}) + "\n" for i in range(6)))

    def on_vm(nb, vm, **params):
        return run_notebook(nb, params, cwd=tmp_path, code=colab_vm(drive, tmp_path / vm))

    def evaluate_cell(nb) -> str:
        cell = next(c for c in nb.cells if c.cell_type == "code" and "format_table(" in c.source)
        return "".join(o.get("text", "") for o in cell.outputs)

    hs = ["eval_interval=5", "hellaswag_every=5", f"hellaswag_file={hs_file}"]
    p02 = dict(RUN_NAME="tiny", TEXT_PATH=str(small_text), MAX_STEPS=10, OVERRIDES=TINY + hs)
    on_vm("02_phase1_shakespeare.ipynb", "vm_a", **p02)
    assert [
        (r["step"], r["source"]) for r in map(json.loads, rows_file.read_text().splitlines())
    ] == [(10, "training")]
    os.rename(tmp_path / "vm_a", tmp_path / "vm_a.away")  # another VM: VM A's disk is not there
    p04 = dict(RUN_NAME="tiny", DEVICE="cpu", PROMPTS="ROMEO:", MAX_NEW_TOKENS=4)
    p04 |= dict(EVAL_TASKS="bpb, hellaswag", BPB_WINDOWS=20, HELLASWAG_FILE=str(hs_file))
    p04 |= dict(EXPORT_CHECKPOINT="5", HUB_GGUF=False)
    first = evaluate_cell(on_vm("04_generate.ipynb", "vm_b", **p04))
    assert "not evaluated" not in first, first
    assert (
        f"reused the rows {rows_file} records for step 10 (the same checkpoint and settings); 1 scored"
        in first
    )
    recorded = rows_file.read_bytes()
    tasks = [(json.loads(r)["task"], json.loads(r)["step"]) for r in recorded.splitlines()]
    assert tasks == [("hellaswag", 10), ("bpb", 5), ("bpb", 10), ("hellaswag", 5)], tasks
    shutil.rmtree(tmp_path / "vm_b")  # VM B reset: notebook 04 on a new VM
    push = tmp_path / "push"
    nb = on_vm("04_generate.ipynb", "vm_c", **p04, HUB_REPO="alice/tiny", HUB_DRY_RUN=str(push))
    again = evaluate_cell(nb)
    for task in ("bpb", "hellaswag"):
        assert (
            f"{task}: reused the rows {rows_file} records for steps 5, 10 (the same checkpoint and "
            f"settings); 0 scored now" in again
        ), again
    assert rows_file.read_bytes() == recorded and again.endswith(first.split("\n", 1)[1]), again
    scored = {(r["task"], r["step"]): r for r in map(json.loads, recorded.splitlines())}
    hs5, bpb5 = scored["hellaswag", 5], scored["bpb", 5]
    card = (push / "README.md").read_text()
    assert f"HellaSwag acc_norm: {hs5['acc_norm']:.4f} ± {hs5['acc_norm_se']:.4f}" in card, card
    assert (
        f"bits per byte: {bpb5['bpb']:.4f} ± {bpb5['bpb_se']:.4f} (standard error) over 20" in card
    )
    # notebook 02 trains on, on VM A: its mirror adds its rows to Drive's, notebook 04's stay
    os.rename(tmp_path / "vm_a.away", tmp_path / "vm_a")
    on_vm("02_phase1_shakespeare.ipynb", "vm_a", **{**p02, "MAX_STEPS": 20})
    after = rows_file.read_bytes()
    assert after.startswith(recorded) and len(after.splitlines()) == 5
    assert json.loads(after.splitlines()[-1])["step"] == 20
