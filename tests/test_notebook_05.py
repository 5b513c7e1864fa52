"""Notebook 05 executed headless in a smoke setting: GPT-2 (a tiny GPT2LMHeadModel folder standing in for
the Hub's) imported as the base, a chat jsonl tokenized with its tokenizer, fine-tuned, a first message
answered; re-run after a 'disconnect' reuses the import and the data and resumes the fine-tune; run once more,
finished, it draws the loss plot."""

import json

import pytest

from gptlib.errors import override
from tests.nbrun import outputs_text, run_notebook
from tests.test_finetune import NAMES, WORDS, conversation
from tests.test_import_hf import hf_folder  # noqa: F401 - the fixture

pytest.importorskip("transformers")


def test_notebook_05_finetunes_a_gpt2_base_chats_and_resumes(tmp_path, monkeypatch, hf_folder):  # noqa: F811
    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(conversation(n, w)) + "\n" for n in NAMES for w in WORDS))
    params = {
        "BASE": "OpenAI GPT-2 from the Hub",
        "HF_MODEL": str(hf_folder),
        "SOURCE": "my files on Drive",
        "INPUT": str(chats),
        "FORMAT": "",
        "MAX_TOKENS": "0",
        "DATASET_NAME": "qa",
        "RUN_NAME": "ft",
        "MAX_STEPS": 12,
        "DEVICE": "cpu",
        "FIRST_MESSAGE": "anna asks: what is the opposite of apple?",
        "OVERRIDES": [
            "eval_interval=6",
            "batch_size=8",
            "eval_batches=2",
            "sample_tokens=0",
            "log_interval=1",
            "save_every_minutes=0",
            "warmup_steps=2",
        ],
    }
    nb = run_notebook("05_finetune_chat.ipynb", params, cwd=tmp_path)
    text = outputs_text(nb)
    root = tmp_path / "root"
    assert "imported" in text and (root / "runs" / "hf-tiny-gpt2" / "checkpoints").is_dir()
    # FORMAT "": the records tell
    assert f"format: chat, as {chats} holds conversations ('messages')" in text
    # the chat markers added to GPT-2's tokenizer, rows to its embedding
    assert "vocabulary 300 -> 304" in text
    assert "loss: on the assistants' answers only" in text
    # the notebook's own parameter, not the command line's flag; a short run's estimate, no talk of GPUs
    assert (
        'tokens; OVERRIDES = ["chat_loss=all"] puts it on every token)' in text
        and "--set" not in text
    )
    # outside a notebook (this process): the CLI's flag
    assert override("chat_loss=all") == "--set chat_loss=all"
    assert "on this CPU (" in text and "meant for a GPU" not in text
    assert "done: step 12" in text
    assert "you: anna asks" in text and "model: " in text
    meta = json.loads((root / "data" / "qa" / "meta.json").read_text())
    assert meta["format"] == "chat"

    # "Colab disconnected": run every cell again with more steps; the import and the data are reused.
    params["MAX_STEPS"] = 18
    nb = run_notebook("05_finetune_chat.ipynb", params, cwd=tmp_path)
    text = outputs_text(nb)
    assert "imported" not in text
    assert "resumed from step 12" in text and "done: step 18" in text
    rows = [
        json.loads(x) for x in (root / "runs" / "ft" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == list(range(1, 19))

    # Run all again on the finished fine-tune: it says so, and its loss plot is drawn (not "drawn here at the first
    # validation", which never comes).
    nb = run_notebook("05_finetune_chat.ipynb", params, cwd=tmp_path)
    train_cell = next(
        c for c in nb.cells if c.cell_type == "code" and "result = train(" in c.source
    )
    finished = "".join(o.get("text", "") for o in train_cell.outputs)
    assert "already finished at step 18" in finished
    assert "(raise MAX_STEPS to train further)" in finished, finished
    shown = [o["data"] for o in train_cell.outputs if o.get("output_type") == "display_data"]
    assert len(shown) == 1 and "image/png" in shown[0], shown


def test_notebook_05s_plot_names_the_run_once(tmp_path):
    """05's plot title read "finetune · finetune" with the default RUN_NAME: its own plot line, run with its default
    and with another name."""
    import re
    from types import SimpleNamespace

    import nbformat

    from tests.nbrun import NOTEBOOKS

    nb = nbformat.read(NOTEBOOKS / "05_finetune_chat.ipynb", as_version=4)
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    default = re.search(r'^RUN_NAME = "([^"]*)"', source, re.M).group(1)
    cell = next(c.source for c in nb.cells if "plot = LivePlot(" in c.source).splitlines()
    code = "\n".join(ln for ln in cell if ln.startswith(("from gptlib import", "plot = LivePlot(")))
    titles = []
    for name in (default, "ft"):
        ns = {"RUN_NAME": name, "paths": SimpleNamespace(run_dir=tmp_path)}
        exec(code, ns)
        titles.append(ns["plot"].title)
    assert titles == ["finetune", "finetune · ft"], titles
