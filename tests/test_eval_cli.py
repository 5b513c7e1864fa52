"""`python -m gptlib eval` on a trained run: rows in eval.jsonl, one-line errors that leave the run
directory alone, and HellaSwag choices that transformers reproduces on the exported model."""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from gptlib.__main__ import main
from gptlib.evaluation import hellaswag as hs
from gptlib.evaluation.evaluate import evaluate_run
from gptlib.fsutil import read_jsonl
from gptlib.layout import EVAL_FILE

from .conftest import TINY


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, char_data):
    from gptlib.training.loop import train

    rd = tmp_path_factory.mktemp("eval") / "run"
    train(
        char_data,
        rd,
        overrides=TINY + ["eval_interval=5"],
        max_steps=10,
        progress=False,
        log=lambda s: None,
    )
    return rd


def short_items(text: str, n: int, seed: int = 0) -> list[dict]:
    """HellaSwag-shaped items from Shakespeare: long contexts (cut from the left) and short endings."""
    lines = [ln for ln in text.split("\n") if len(ln.split()) >= 4]
    rng = random.Random(seed)

    def ending():
        return " ".join(rng.choice(lines).split()[: rng.randint(1, 4)])

    def context():  # a few words (fits the window) or whole lines before them (cut from the left)
        return " ".join(
            [rng.choice(lines) for _ in range(rng.randint(0, 2))]
            + rng.choice(lines).split()[: rng.randint(1, 3)]
        )

    return [
        {
            "ctx": context(),
            "endings": [ending() for _ in range(4)],
            "label": rng.randrange(4),
            "ind": i,
        }
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def hs_file(tmp_path_factory, small_text):
    p = tmp_path_factory.mktemp("hs") / "hellaswag_small.jsonl"
    items = short_items(small_text.read_text(), 30)
    items.append(
        {
            "ctx": "[title] How to build a snowman \u2603",
            "endings": ["a", "b", "c", "d"],
            "label": 0,
        }
    )
    p.write_text("".join(json.dumps(it) + "\n" for it in items))
    return p


def snapshot(run_dir):
    """Every file of the run directory but eval.jsonl: path -> (size, mtime, sha256)."""
    return {
        str(p.relative_to(run_dir)): (
            p.stat().st_size,
            p.stat().st_mtime_ns,
            hashlib.sha256(p.read_bytes()).hexdigest(),
        )
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != EVAL_FILE
    }


def test_cli_eval_hellaswag_and_bpb(run_dir, hs_file, capsys):
    before = snapshot(run_dir)
    rc = main(
        [
            "eval",
            "--run-dir",
            str(run_dir),
            "--task",
            "hellaswag",
            "--data",
            str(hs_file),
            "--checkpoint",
            "all",
            "--device",
            "cpu",
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "acc_norm" in out and "truncated" in out
    rows = [r for r in read_jsonl(run_dir / EVAL_FILE) if r["task"] == "hellaswag"]
    assert [r["step"] for r in rows] == [5, 10]  # all = every complete checkpoint, oldest first
    # each accuracy ± its binomial standard error, in the table and the rows; the two checkpoints compared
    for r in rows:
        for k in ("acc", "acc_norm"):
            assert r[f"{k}_se"] == pytest.approx(np.sqrt(r[k] * (1 - r[k]) / 30))
            assert f"{r[k]:.4f} ± {r[f'{k}_se']:.4f}" in out
    assert re.search(
        r"^HellaSwag acc_norm, step 10 - step 5: [+-]\d\.\d{4}; 2 x combined standard error \d\.\d{4}: "
        r"(within noise|step (5|10) is better)$",
        out,
        re.M,
    ), out
    for r in rows:
        assert (
            r["n"] == 30
            and r["skipped"] == 1
            and 0 < r["truncated"] < 30
            and r["tokens_seen"] == r["step"] * 256
        )
        assert 0 <= r["acc"] <= 1 and 0 <= r["acc_norm"] <= 1 and r["canonical"] is False
        assert {"time", "checkpoint", "data", "data_sha256", "seconds"} <= set(r)
    rc = main(
        [
            "eval",
            "--run-dir",
            str(run_dir),
            "--task",
            "bpb",
            "--checkpoint",
            "best",
            "--limit",
            "50",
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "val bpb" in out
    (b,) = [r for r in read_jsonl(run_dir / EVAL_FILE) if r["task"] == "bpb"]
    assert 0 < b["bpb_se"] < 0.1 * b["bpb"] and f"{b['bpb']:.4f} ± {b['bpb_se']:.4f}" in out
    from gptlib.inference.loading import checkpoint_table

    assert (
        b["step"] == checkpoint_table(run_dir)[0]["best_step"]
        and b["n"] == b["windows"] == 50
        and b["tokens"] == 50 * 32
    )
    # a char corpus of ASCII: one byte per token
    assert b["bpb"] == pytest.approx(b["loss"] / np.log(2))
    assert snapshot(run_dir) == before  # only eval.jsonl was written
    lines = (run_dir / EVAL_FILE).read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(ln) for ln in lines)


def _error(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_cli_eval_bad_input_one_line_and_run_dir_untouched(
    run_dir, hs_file, tmp_path, capsys, monkeypatch, small_text
):
    from gptlib.data.prepare import prepare_text

    before = snapshot(run_dir)
    log_before = (run_dir / EVAL_FILE).read_bytes() if (run_dir / EVAL_FILE).exists() else None
    base = ["eval", "--run-dir", str(run_dir), "--quiet"]
    err = _error(capsys, base + ["--task", "mmlu"])
    assert "unknown task 'mmlu'" in err and "hellaswag, bpb" in err
    err = _error(capsys, base + ["--task", "hellaswag", "--data", str(tmp_path / "nope.jsonl")])
    assert "nope.jsonl does not exist" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(hs_file.read_text().replace('"label": 2', '"label": 9', 1))
    err = _error(capsys, base + ["--task", "hellaswag", "--data", str(bad)])
    line = next(i for i, ln in enumerate(bad.read_text().splitlines(), 1) if '"label": 9' in ln)
    assert f"line {line}: field 'label' is 9" in err and str(bad) in err
    err = _error(
        capsys, base + ["--task", "hellaswag", "--data", str(hs_file), "--checkpoint", "7"]
    )
    assert "no complete checkpoint for step 7" in err and "[10, 5]" in err
    err = _error(
        capsys,
        base + ["--task", "bpb", "--checkpoint", "latest", "--device", "cuda"]
        if not torch.cuda.is_available()
        else base + ["--task", "bpb", "--limit", "-1"],
    )
    assert "CUDA is not available" in err or "--limit -1" in err
    other = tmp_path / "other_data"  # a data dir made with a different char vocabulary
    other_text = tmp_path / "other.txt"
    other_text.write_text(small_text.read_text()[:20_000] + "0123456789")
    prepare_text([other_text], other, tokenizer="char", verbose=False)
    err = _error(capsys, base + ["--task", "bpb", "--data", str(other)])
    assert str(other) in err and "tokenizer" in err
    err = _error(capsys, base + ["--task", "bpb", "--data", str(tmp_path / "missing")])
    assert "missing does not exist" in err

    class Fake(io.BytesIO):  # the canonical download, corrupted in transit
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    monkeypatch.setenv("GPTLIB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: Fake(b'{"ctx": "x"}\n'))
    err = _error(capsys, base + ["--task", "hellaswag"])
    assert (
        f"expected {hs.HELLASWAG_SHA256}" in err
        and hashlib.sha256(b'{"ctx": "x"}\n').hexdigest() in err
    )
    assert snapshot(run_dir) == before
    assert (
        (run_dir / EVAL_FILE).read_bytes() if (run_dir / EVAL_FILE).exists() else None
    ) == log_before
    assert not (tmp_path / "cache" / "hellaswag" / hs.HELLASWAG_FILE).exists()


def test_notebook_04s_hellaswag_messages_name_its_field_and_the_cli_its_flag(
    run_dir, tmp_path, monkeypatch, capsys
):
    """Notebook 04 takes the file as HELLASWAG_FILE (its eval cell), the CLI as --data FILE: each message names
    where its reader can pass one."""
    import torch

    def no_network(*a, **k):
        raise urllib.error.URLError("no network (test)")

    monkeypatch.setenv("GPTLIB_CACHE", str(tmp_path / "cache"))  # no cached canonical file
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    logs = []
    for file in ["", str(tmp_path)]:
        assert (
            eval_cell(
                capsys,
                run_dir=run_dir,
                EVAL_TASKS="hellaswag",
                HELLASWAG_FILE=file,
                device=torch.device("cpu"),
            )
            == []
        )
        logs += capsys.readouterr().out.splitlines()[:1]
    assert len(logs) == 2 and all("--data" not in m for m in logs), logs
    assert logs[0].startswith("hellaswag: not evaluated: could not download HellaSwag") and logs[
        0
    ].endswith(f"pass a local copy of {hs.HELLASWAG_FILE} (HELLASWAG_FILE)")
    assert logs[1] == (
        f"hellaswag: not evaluated: {tmp_path} is a directory; for hellaswag give the jsonl file "
        f"(HELLASWAG_FILE)"
    )
    err = _error(capsys, ["eval", "--run-dir", str(run_dir), "--quiet", "--task", "hellaswag"])
    assert err.rstrip().endswith(f"pass a local copy of {hs.HELLASWAG_FILE} (--data FILE)"), err


# --- transformers agrees on the exported model --------------------------------------------------


def hf_choices(hf, hf_tok, items: list[dict], block: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-ending summed log-likelihoods computed independently: transformers' tokenizer and model, one
    ending at a time, the context cut from the left to n_positions + 1 tokens."""
    sums, counts = np.zeros((len(items), 4)), np.zeros((len(items), 4))
    for i, it in enumerate(items):
        ctx = hf_tok(it["ctx"]).input_ids
        for e, ending in enumerate(it["endings"]):
            end = hf_tok(" " + ending).input_ids
            toks = (ctx + end)[-(block + 1) :]
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([toks[:-1]])).logits[0].double(), -1)
            tgt = torch.tensor(toks[1:])
            sums[i, e] = float(logp[torch.arange(len(tgt)), tgt][-len(end) :].sum())
            counts[i, e] = len(end)
    return sums, counts


def assert_same_choices(res: dict, sums: np.ndarray, counts: np.ndarray, items: list[dict]) -> None:
    np.testing.assert_allclose(res["sums"], sums, rtol=1e-4, atol=1e-4)
    labels = np.array([it["label"] for it in items])
    assert res["acc"] == pytest.approx(float((sums.argmax(1) == labels).mean()))
    assert res["acc_norm"] == pytest.approx(float(((sums / counts).argmax(1) == labels).mean()))


def test_transformers_reproduces_char_run_choices(run_dir, hs_file, tmp_path):
    transformers = pytest.importorskip("transformers")  # a test-only dependency
    from gptlib.inference.export import export_hf
    from gptlib.inference.loading import load_run

    out = export_hf(run_dir, tmp_path / "hf", checkpoint="latest")
    hf = transformers.GPT2LMHeadModel.from_pretrained(out, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    items = [json.loads(ln) for ln in hs_file.read_text().splitlines()][:30]  # the encodable ones
    lm = load_run(run_dir, "latest")
    items_ = [hs.Item(**{k: it[k] for k in ("ctx", "endings", "label")}) for it in items]
    block = lm.config.model.block_size
    res = hs.evaluate_rendered(
        lm.model, hs.render(items_, lm.tokenizer, block), "cpu", batch_tokens=256
    )
    assert res["truncated"] > 0  # the left cut is exercised too
    assert_same_choices(res, *hf_choices(hf, hf_tok, items, lm.config.model.block_size), items)


def test_transformers_reproduces_bpe_choices(tmp_path, small_text):
    transformers = pytest.importorskip("transformers")
    from gptlib.config import ModelConfig
    from gptlib.data.tokenizer import BPETokenizer
    from gptlib.inference.export import export_model
    from gptlib.model import GPT

    tok = BPETokenizer.train([small_text.read_text()], vocab_size=400)
    torch.manual_seed(7)
    m = GPT(
        ModelConfig(
            vocab_size=tok.vocab_size, block_size=24, n_layer=2, n_head=2, n_embd=32, bias=True
        )
    ).eval()
    with torch.no_grad():  # a sharper random model, so the four endings' scores are far apart
        m.lm_head.weight.mul_(20)
    out = export_model(m, tmp_path / "hf", tok)
    hf = transformers.GPT2LMHeadModel.from_pretrained(out, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    items = short_items(small_text.read_text(), 25, seed=4)
    items_ = [hs.Item(**{k: it[k] for k in ("ctx", "endings", "label")}) for it in items]
    res = hs.evaluate_rendered(m, hs.render(items_, tok, 24), "cpu")
    assert res["truncated"] > 0 and res["skipped"] == 0
    assert_same_choices(res, *hf_choices(hf, hf_tok, items, 24), items)


def test_evaluate_run_api(run_dir, hs_file, tmp_path):
    rows = evaluate_run(
        run_dir,
        "hellaswag",
        "5, latest",
        data=hs_file,
        limit=10,
        device="cpu",
        progress=False,
        out=tmp_path / "scores.jsonl",
    )
    assert [r["step"] for r in rows] == [5, 10] and all(r["n"] <= 10 for r in rows)
    assert read_jsonl(tmp_path / "scores.jsonl") == rows


def test_cli_eval_on_a_read_only_run_dir_prints_the_score_then_says_where_to_save_it(
    run_dir, tmp_path, monkeypatch
):
    """The score is shown, then one warning line (exit 0: the user has the score); --out saves the rows elsewhere.
    chmod does not stop root from writing (these tests may run as root): there the read-only disk is simulated,
    an os.open for writing in the run directory failing with EROFS."""
    import errno
    import os
    import sys

    before = snapshot(run_dir)
    log_before = (run_dir / EVAL_FILE).read_bytes() if (run_dir / EVAL_FILE).exists() else None
    real_open = os.open

    def read_only_open(path, flags, *args, **kwargs):
        if Path(path).parent == run_dir and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)
    mode = run_dir.stat().st_mode
    run_dir.chmod(0o555)
    try:
        shown = io.StringIO()  # stdout and stderr together, in the order they were written
        monkeypatch.setattr(sys, "stdout", shown)
        monkeypatch.setattr(sys, "stderr", shown)
        argv = ["eval", "--run-dir", str(run_dir), "--task", "bpb", "--limit", "20", "--quiet"]
        assert main(argv) == 0
        table, warning = shown.getvalue().rstrip("\n").rsplit("\n", 1)
        assert "val bpb" in table and "Traceback" not in shown.getvalue()
        assert warning == (
            f"warning: 1 row not saved: cannot append to {run_dir / EVAL_FILE}: Read-only file "
            f"system; add --out FILE (evaluate_run(..., out=FILE)) to append the rows to another "
            f"file"
        ), warning
        out = tmp_path / "scores" / "eval.jsonl"
        shown.seek(0)
        shown.truncate()
        assert main(argv + ["--out", str(tmp_path)]) == 2  # refused before any model runs
        assert (
            shown.getvalue()
            == f"error: --out {tmp_path} is a directory; give a file to append the rows to, "
            f"e.g. {tmp_path / EVAL_FILE}\n"
        )
        shown.seek(0)
        shown.truncate()
        assert main(argv + ["--out", str(out)]) == 0
        assert shown.getvalue().rstrip("\n").endswith(f"appended 1 row(s) to {out}")
    finally:
        run_dir.chmod(mode)
    (row,) = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert row["task"] == "bpb" and f"{row['bpb']:.4f}" in table  # the same score, now saved
    assert snapshot(run_dir) == before
    assert (
        (run_dir / EVAL_FILE).read_bytes() if (run_dir / EVAL_FILE).exists() else None
    ) == log_before
    # the same from Python: the row saved there is reused, not scored and appended again
    rows = evaluate_run(run_dir, "bpb", limit=20, device="cpu", progress=False, out=out)
    assert rows == [row] and len(out.read_text().splitlines()) == 1


def eval_cell(capsys, **params) -> list[dict]:
    """Notebook 04's eval cell run with `params` (and the defaults of its parameters cell): its rows."""
    import nbformat

    from tests.nbrun import NOTEBOOKS

    cell = next(
        c
        for c in nbformat.read(NOTEBOOKS / "04_generate.ipynb", as_version=4).cells
        if c.cell_type == "code" and "evaluate_run(" in c.source
    )
    scope = {
        "CHECKPOINTS": "latest",
        "EVAL_LIMIT": -1,
        "BPB_WINDOWS": 1000,
        "HELLASWAG_FILE": "",
        **params,
    }
    exec(cell.source, scope)
    return scope["eval_rows"]


def test_bpb_of_a_run_trained_with_a_relative_data_dir_from_another_folder(
    tmp_path, char_data, monkeypatch, capsys
):
    """`train --data data` (relative, as the docs' examples) then `eval --task bpb` from another folder: the run
    records the data's absolute path (it recorded "data", and eval said the directory did not exist). An older run's
    relative record says so and asks for --data."""
    import shutil

    from gptlib.training.loop import train

    shutil.copytree(char_data, tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    train("data", "run", overrides=TINY, max_steps=3, progress=False, log=lambda s: None)
    monkeypatch.chdir(tmp_path.parent)
    args = ["eval", "--run-dir", str(tmp_path / "run"), "--task", "bpb", "--limit", "2", "--quiet"]
    assert main(args) == 0, capsys.readouterr().err
    [ck] = (tmp_path / "run" / "checkpoints").iterdir()
    state = json.loads((ck / "state.json").read_text())
    assert state["data_dir"] == str(tmp_path / "data")
    # an older run's record, re-hashed in its manifest
    data = json.dumps({**state, "data_dir": "data"}).encode()
    (ck / "state.json").write_bytes(data)
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"]["state.json"] = {
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    (ck / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(args) == 2
    assert "records its data directory as 'data', relative to where training ran; pass --data" in (
        capsys.readouterr().err
    )


def test_bpb_when_the_recorded_data_is_gone(tmp_path, char_data, capsys, monkeypatch):
    """A data directory on a VM's disk (notebook 02's before 0.3.0); on a fresh VM notebook 04 evaluates the Drive
    mirror, whose checkpoints record that data directory, gone. bpb said `data directory ... does not exist (run
    python -m gptlib tokenize first)`: not which checkpoint recorded it, nor --data. Now the line says both."""
    import shutil

    from gptlib.training.loop import train

    shutil.copytree(char_data, tmp_path / "vm-data")
    train(tmp_path / "vm-data", tmp_path / "run", overrides=TINY, max_steps=3, progress=False)
    shutil.rmtree(tmp_path / "vm-data")
    args = ["eval", "--run-dir", str(tmp_path / "run"), "--task", "bpb", "--limit", "2", "--quiet"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "step_0000003 records its data directory as" in err, err
    assert "vm-data', which is gone" in err and "pass --data DATA_DIR" in err, err
    assert main([*args, "--data", str(char_data)]) == 0
    # notebook 04's evaluate cell, which has no data setting: it said 'or pass --data DATA_DIR' there too
    import IPython

    from gptlib.errors import EvalError

    monkeypatch.setattr(IPython, "get_ipython", lambda: type("Kernel", (), {"kernel": 1})())
    with pytest.raises(EvalError) as e:
        evaluate_run(tmp_path / "run", "bpb", limit=2, progress=False)
    assert str(e.value).endswith("vm-data', which is gone: tokenize it there again"), e.value


def test_bpb_of_a_notebook_02_run_from_before_0_3_0_names_what_brings_its_data_back(
    tmp_path, small_text, monkeypatch
):
    """Notebook 02 before 0.3.0 tokenized into its run's folder (on Colab the VM's disk): notebook 04 on another VM
    said 'which is gone: tokenize it there again', which no notebook does (02 makes the dataset RUN_NAME now). It
    names what does: notebook 02 training the run on; done so, bpb is scored, on the newest checkpoint's data."""
    import shutil

    import IPython

    from gptlib.data.prepare import prepare_text
    from gptlib.errors import EvalError
    from gptlib.training.loop import train

    run, quiet = tmp_path / "runs" / "tiny", dict(progress=False, log=lambda s: None)
    prepare_text([small_text], run / "data", tokenizer="char", verbose=False)
    train(run / "data", run, overrides=TINY, max_steps=3, **quiet)
    shutil.rmtree(run / "data")  # the VM's disk
    with monkeypatch.context() as m:  # notebook 04's Evaluate cell
        m.setattr(IPython, "get_ipython", lambda: type("Kernel", (), {"kernel": 1})())
        with pytest.raises(EvalError) as e:
            evaluate_run(run, "bpb", limit=2, progress=False)
    assert str(e.value).endswith(
        "data', which is gone (notebook 02 before gptlib 0.3.0 kept it in the run, on Colab on the VM's disk): "
        "train the run on in notebook 02 (a larger MAX_STEPS), which keeps its data on Drive now, then evaluate again"
    ), e.value
    # as said: notebook 02 now (its text as the dataset RUN_NAME), a larger MAX_STEPS
    prepare_text([small_text], tmp_path / "data" / "tiny", tokenizer="char", verbose=False)
    train(tmp_path / "data" / "tiny", run, overrides=TINY, max_steps=6, **quiet)
    rows = evaluate_run(run, "bpb", "all", device="cpu", limit=2, progress=False)
    assert [r["step"] for r in rows] == [3, 6]


def test_out_appends_to_eval_rows_only(run_dir, char_data, tmp_path, capsys):
    """--out naming a dataset's meta.json (or a corpus, or metrics.jsonl): refused, unchanged (the row was appended
    and the dataset no longer loaded); a file of eval rows, or a new one, takes the rows."""
    meta = tmp_path / "meta.json"
    meta.write_bytes((char_data / "meta.json").read_bytes())
    before = meta.read_bytes()
    args = ["eval", "--run-dir", str(run_dir), "--task", "bpb", "--limit", "2", "--quiet", "--out"]
    assert main(args + [str(meta)]) == 2
    assert (
        "holds something else than eval rows" in capsys.readouterr().err
        and meta.read_bytes() == before
    )
    rows = tmp_path / "rows.jsonl"
    assert main(args + [str(rows)]) == 0 and main(args + [str(rows), "--checkpoint", "5"]) == 0
    assert len(read_jsonl(rows)) == 2


def test_a_rerun_reuses_what_eval_jsonl_records_for_the_same_checkpoint_and_settings(
    run_dir, hs_file, tmp_path, char_data, capsys
):
    """Notebook 04's Run all (after each disconnect) scored every checkpoint again, minutes of a paid GPU each for
    HellaSwag, and appended duplicate rows: a row recorded for the same checkpoint (its model.pt's sha256) and
    settings is now reused, said in one line; other settings, or another checkpoint at the same step, are scored."""
    import shutil

    from gptlib.layout import checkpoint_name, checkpoints_dir
    from gptlib.training.loop import train

    rd = tmp_path / "run"
    shutil.copytree(run_dir, rd, ignore=shutil.ignore_patterns(EVAL_FILE))
    said = []
    kw = dict(device="cpu", progress=False, warn=said.append)
    first = evaluate_run(rd, "hellaswag", "all", data=hs_file, limit=20, **kw)
    first += evaluate_run(rd, "bpb", "all", limit=20, **kw)
    recorded = (rd / EVAL_FILE).read_text()
    assert len(recorded.splitlines()) == 4 and not said
    again = evaluate_run(rd, "hellaswag", "all", data=hs_file, limit=20, **kw)
    again += evaluate_run(rd, "bpb", "all", limit=20, **kw)
    assert again == first and (rd / EVAL_FILE).read_text() == recorded
    assert said == [
        f"{t}: reused the rows {rd / EVAL_FILE} records for steps 5, 10 (the same checkpoint and settings); "
        f"0 scored now; delete a row to score it again"
        for t in ("hellaswag", "bpb")
    ]
    # other settings (more items, more windows): scored afresh
    (h,) = evaluate_run(rd, "hellaswag", "10", data=hs_file, limit=25, **kw)
    (b,) = evaluate_run(rd, "bpb", "10", limit=30, **kw)
    assert h["n"] == 25 - h["skipped"] and b["windows"] == 30
    assert len((rd / EVAL_FILE).read_text().splitlines()) == 6
    # step 10 trained again from scratch (another seed): the same step, other weights: scored; step 5 reused
    other = tmp_path / "other"
    train(
        char_data,
        other,
        overrides=TINY + ["eval_interval=5", "seed=7"],
        max_steps=10,
        progress=False,
        log=print,
    )
    shutil.rmtree(checkpoints_dir(rd) / checkpoint_name(10))
    shutil.copytree(
        checkpoints_dir(other) / checkpoint_name(10), checkpoints_dir(rd) / checkpoint_name(10)
    )
    capsys.readouterr()
    argv = [
        "eval",
        "--run-dir",
        str(rd),
        "--task",
        "hellaswag",
        "--data",
        str(hs_file),
        "--limit",
        "20",
    ]
    assert main(argv + ["--checkpoint", "all", "--device", "cpu", "--quiet"]) == 0
    rows = read_jsonl(rd / EVAL_FILE)
    assert (
        len(rows) == 7
        and rows[-1]["step"] == 10
        and rows[-1]["model_sha256"] != first[1]["model_sha256"]
    )
    assert capsys.readouterr().err == (
        f"hellaswag: reused the rows {rd / EVAL_FILE} records for step 5 (the same checkpoint and settings); "
        f"1 scored now; delete a row to score it again\n"
    )


def test_bpb_on_a_data_dir_tokenized_again_is_scored_not_reused(run_dir, small_text, tmp_path):
    """The same data folder tokenized again with other text (notebook 01 re-run into one DATASET_NAME, the same
    tokenizer): eval reused the row of the old tokens (the same folder, the same number of windows: BPB_WINDOWS), so
    one table mixed bpb over two validation sets; the data's tokens are part of the settings a row is reused for."""
    import shutil

    from gptlib.data.prepare import prepare_text

    data, other, out = tmp_path / "data", tmp_path / "other.txt", tmp_path / "rows.jsonl"
    prepare_text([small_text], data, tokenizer="char", verbose=False)
    kw = dict(device="cpu", progress=False, out=out, data=data, limit=20, warn=lambda m: None)
    (first,) = evaluate_run(run_dir, "bpb", "10", **kw)
    shutil.rmtree(data)
    other.write_text("\n".join(reversed(small_text.read_text().splitlines())))
    prepare_text([other], data, tokenizer="char", verbose=False)
    (again,) = evaluate_run(run_dir, "bpb", "10", **kw)
    assert again["bpb"] != first["bpb"] and len(read_jsonl(out)) == 2
    assert evaluate_run(run_dir, "bpb", "10", **kw) == [again]  # and reused for those tokens


def test_a_bpb_row_is_reused_for_the_same_tokens_at_another_path(run_dir, char_data, tmp_path):
    """A bpb row was reused only for the data folder's path it recorded: the same tokens at another path (Drive's
    dataset and the VM's copy of it, a run's data on another VM or machine, a folder moved) were scored again, rows
    added. The row is reused for the same tokens (tokens_sha256) wherever they are; a row recording another path,
    as every row did, is reused so too."""
    import shutil

    copy, out, said = tmp_path / "moved", tmp_path / "rows.jsonl", []
    shutil.copytree(char_data, copy)
    kw = dict(device="cpu", progress=False, out=out, limit=20, warn=said.append)
    (first,) = evaluate_run(run_dir, "bpb", "10", data=char_data, **kw)
    assert first["data"] == str(char_data)
    assert evaluate_run(run_dir, "bpb", "10", data=copy, **kw) == [first]
    assert len(read_jsonl(out)) == 1 and said == [
        f"bpb: reused the rows {out} records for step 10 (the same checkpoint and settings); 0 scored now; "
        f"delete a row to score it again"
    ]


def test_bpb_on_a_hung_drive_says_so_instead_of_hanging(run_dir, monkeypatch):
    """bpb reads the run's dataset, on Drive for the notebooks' runs: its meta.json and tokenizer, then each batch's
    windows, were read with no time limit (the checkpoint's read has one), so a Drive hung since held notebook 04's
    Evaluate cell for good. Each read is under DRIVE_READ_STALL_S, as the checkpoint's: a hung mount ends the task in
    one line."""
    import threading
    import time

    from gptlib.batches import MemmapSplit
    from gptlib.errors import HungIOError
    from gptlib.evaluation import evaluate

    released, read_meta, gather = threading.Event(), evaluate.read_meta, MemmapSplit.gather_raw
    monkeypatch.setattr(evaluate, "DRIVE_READ_STALL_S", 0.5)
    kw = dict(device="cpu", progress=False, limit=2, out=run_dir.parent / "hung.jsonl")
    try:
        for name, real in [("read_meta", read_meta), ("gather_raw", gather)]:

            def hung(*args, real=real):  # Drive answers only long after
                released.wait(20)
                return real(*args)

            with monkeypatch.context() as m:
                m.setattr(evaluate if name == "read_meta" else MemmapSplit, name, hung)
                t0 = time.monotonic()
                with pytest.raises(
                    HungIOError, match=r"made no progress for 0\.5 s \(hung mount\?\)"
                ):
                    evaluate_run(run_dir, "bpb", "10", **kw)
                assert time.monotonic() - t0 < 5, name
    finally:
        released.set()


def test_trainings_end_of_run_hellaswag_row_is_reused(tmp_path, char_data):
    """Training's end-of-run HellaSwag row (every item) named no checkpoint: it was written before its checkpoint, so
    it had no model_sha256, and notebook 04's Evaluate scored the final checkpoint again. The row is written once the
    checkpoint is, with its model.pt's sha256 and the dtype: Evaluate reuses it."""
    from gptlib.checkpoint.format import read_manifest
    from gptlib.layout import checkpoint_name, checkpoints_dir
    from gptlib.training.loop import train

    items = [
        {"ctx": "ROMEO:", "endings": [" a", " b", " c", " d"], "label": i % 4} for i in range(8)
    ]
    hs_file = tmp_path / "hs.jsonl"
    hs_file.write_text("".join(json.dumps(it) + "\n" for it in items))
    run, hs = (
        tmp_path / "run",
        ["hellaswag_every=10", "hellaswag_items=4", f"hellaswag_file={hs_file}"],
    )
    train(char_data, run, "phase1", TINY + hs, max_steps=10, progress=False, log=lambda s: None)
    said = []
    kw = dict(data=hs_file, limit=0, device="cpu", progress=False, warn=said.append)
    (row,) = evaluate_run(run, "hellaswag", "latest", **kw)
    manifest = read_manifest(checkpoints_dir(run) / checkpoint_name(10))
    assert row["source"] == "training" and row["n"] == 8
    assert row["model_sha256"] == manifest["files"]["model.pt"]["sha256"]
    assert said == [
        f"hellaswag: reused the rows {run / EVAL_FILE} records for step 10 (the same checkpoint and settings); "
        f"0 scored now; delete a row to score it again"
    ]
    assert read_jsonl(run / EVAL_FILE) == [row]


def test_an_end_of_run_row_that_cannot_be_written_does_not_stop_the_checkpoints_drive_copy(
    tmp_path, char_data, monkeypatch, capsys
):
    """Training's end-of-run HellaSwag row is appended once the final checkpoint is saved: when that failed (the disk
    full just after the save), the checkpoint was neither copied to Drive nor rotated, and training stopped with
    'saving a checkpoint ... failed', the checkpoint saved. The row's failure is said in one line; the rest goes on."""
    import errno

    from gptlib.checkpoint import writer
    from gptlib.checkpoint.format import list_checkpoints, verify_checkpoint
    from gptlib.layout import checkpoints_dir, step_of
    from gptlib.training.loop import train

    items = [
        {"ctx": "ROMEO:", "endings": [" a", " b", " c", " d"], "label": i % 4} for i in range(8)
    ]
    hs_file = tmp_path / "hs.jsonl"
    hs_file.write_text("".join(json.dumps(it) + "\n" for it in items))
    hs = ["hellaswag_every=10", "hellaswag_items=4", f"hellaswag_file={hs_file}"]

    def disk_full(path, *rows):  # a full disk cannot be made here (os.write's error names no file)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "append_jsonl", disk_full)
    run, drive = tmp_path / "run", tmp_path / "drive"
    settings = TINY + hs + ["save_every_steps=3"]
    kw = dict(max_steps=10, progress=False, log=lambda s: None, mirror_dir=drive)
    assert train(char_data, run, "phase1", settings, **kw).step == 10
    assert verify_checkpoint(checkpoints_dir(drive) / "step_0000010").step == 10
    assert [step_of(p) for p in list_checkpoints(run)] == [10, 9]  # rotated: keep_last 2
    said = [line for line in capsys.readouterr().err.splitlines() if "eval.jsonl" in line]
    assert said == [
        "!! step 10's HellaSwag row not written to eval.jsonl: [Errno 28] No space left on device"
    ]
