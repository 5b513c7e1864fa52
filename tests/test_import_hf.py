"""import-hf: a GPT2LMHeadModel folder becomes a gptlib run; every tool works on it; train --init-from it."""

from __future__ import annotations

import json

import pytest
import torch

from gptlib.data.tokenizer import BPETokenizer
from gptlib.errors import ConfigError, ExportError
from gptlib.inference.engine import Engine
from gptlib.inference.hf_import import import_hf
from gptlib.inference.loading import load_run
from gptlib.training.resume import StartOptions
from tests.conftest import TINY
from tests.test_export import assert_same_model

transformers = pytest.importorskip("transformers")  # a test-only dependency


def quiet(_msg):
    pass


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, small_text):
    """A GPT2LMHeadModel folder as transformers writes it: random weights, a byte-level BPE tokenizer."""
    folder = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    text = small_text.read_text()
    tok = BPETokenizer.train(
        [text[i : i + 2000] for i in range(0, len(text), 2000)], vocab_size=300
    )
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=tok.vocab_size,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        activation_function="gelu_new",
        bos_token_id=tok.eot_id,
        eos_token_id=tok.eot_id,
    )
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes(tok.to_json_bytes())
    return folder


def test_import_gives_transformers_logits_and_greedy_tokens(hf_folder, tmp_path):
    run = import_hf(hf_folder, tmp_path / "run", log=quiet)
    ld = load_run(run)
    assert ld.step == 0 and ld.config.model.vocab_size == 300 and ld.tokenizer.kind == "bpe"
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_folder, dtype=torch.float32).eval()
    ids = ld.tokenizer.encode("First Citizen:\nBefore we proceed")[:12]
    # the same logits, and the same greedy tokens to the end of the window
    assert_same_model(ld.model, hf, ids)


def test_export_import_export_round_trip(hf_folder, tmp_path):
    from gptlib.inference.export import export_hf

    a = import_hf(hf_folder, tmp_path / "a", log=quiet)
    export_hf(a, tmp_path / "exported")
    b = import_hf(tmp_path / "exported", tmp_path / "b", log=quiet)
    export_hf(b, tmp_path / "exported2")
    x = torch.randint(0, 300, (2, 20))
    la = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "exported").eval()(x).logits
    lb = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "exported2").eval()(x).logits
    assert torch.equal(la, lb)


def test_a_char_run_comes_back_with_its_char_tokenizer(char_data, tmp_path):
    from gptlib.inference.export import export_hf
    from gptlib.training.loop import train

    train(char_data, tmp_path / "run", "phase1", TINY, max_steps=4, progress=False, log=quiet)
    export_hf(tmp_path / "run", tmp_path / "hf")
    back = import_hf(tmp_path / "hf", tmp_path / "back", log=quiet)
    a, b = Engine.from_run(tmp_path / "run"), Engine.from_run(back)
    assert b.tokenizer.kind == "char" and b.tokenizer.encode("ROMEO:") == a.tokenizer.encode(
        "ROMEO:"
    )
    x = torch.tensor([a.tokenizer.encode("ROMEO: what")])
    torch.testing.assert_close(a.model(x)[0], b.model(x)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "key,value,message",
    [
        (
            "activation_function",
            "relu",
            "activation_function is 'relu'; gptlib's model needs 'gelu_new'",
        ),
        # llama and qwen3 import (the modern recipe)
        (
            "model_type",
            "mistral",
            "model_type is 'mistral'",
        ),
        ("model_type", "llama", "config.json: hidden_size is missing"),
        ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx is True"),
    ],
)
def test_a_model_that_is_not_gpt2_shaped_is_refused(
    hf_folder, tmp_path, key, value, message, capsys
):
    import shutil

    from gptlib.__main__ import main

    folder = tmp_path / "other"
    shutil.copytree(hf_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    assert main(["import-hf", "--model", str(folder), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_an_import_cut_off_leaves_no_run_behind_and_the_next_one_completes(
    hf_folder, tmp_path, monkeypatch
):
    """Notebook 05 imports GPT-2 into a run on Drive once, and skips the import when the run has checkpoints/. An
    import cut off (a disconnect) after its checkpoint, before its tokenizer, left checkpoints/: the re-run skipped
    it and failed at the next cell ('tokenizer.json does not exist'), and import_hf refused the folder ('holds
    checkpoints'). The run appears whole or not at all; the next import removes what the cut-off one left."""
    from gptlib.inference import hf_import

    out, write = tmp_path / "runs" / "hf-gpt2", hf_import.atomic_write_bytes

    def killed(path, data):
        raise KeyboardInterrupt  # the VM went away: nothing after this line ran

    monkeypatch.setattr(hf_import, "atomic_write_bytes", killed)
    with pytest.raises(KeyboardInterrupt):
        import_hf(hf_folder, out, log=quiet)
    assert not out.exists() and [p.name[:15] for p in out.parent.iterdir()] == ["hf-gpt2.partial"]
    monkeypatch.setattr(hf_import, "atomic_write_bytes", write)
    assert import_hf(hf_folder, out, log=quiet) == out
    assert [p.name for p in out.parent.iterdir()] == ["hf-gpt2"]
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_0000000"]


def test_import_never_writes_into_a_folder_holding_something(hf_folder, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        import_hf(hf_folder, out, log=quiet)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    # a previous export there: import has no --overwrite to offer (it said "pass --overwrite")
    (out / "notes.txt").unlink()
    (out / "README.md").write_text("# gptlib GPT-2 export\n")
    with pytest.raises(ExportError) as e:
        import_hf(hf_folder, out, log=quiet)
    assert "overwrite" not in str(e.value) and "choose an empty or new folder" in str(e.value), (
        e.value
    )


def test_train_init_from_starts_a_new_run_from_the_weights(hf_folder, tmp_path, small_text):
    from gptlib.data.prepare import prepare
    from gptlib.training.loop import train

    base = import_hf(hf_folder, tmp_path / "base", log=quiet)
    data = tmp_path / "data"
    prepare([small_text], data, tokenizer_from=base / "tokenizer.json", verbose=False)
    before = {p: p.stat().st_mtime_ns for p in base.rglob("*")}
    settings = [
        "batch_size=4",
        "block_size=32",
        "eval_interval=2",
        "eval_batches=1",
        "sample_tokens=4",
        "learning_rate=1e-12",
        "warmup_steps=0",
        "save_every_minutes=0",
    ]
    logs = []
    r = train(
        data,
        tmp_path / "ft",
        "finetune",
        settings,
        max_steps=2,
        progress=False,
        log=logs.append,
        options=StartOptions(init_from=f"{base}:latest"),
    )
    assert r.step == 2 and any("init-from: the weights of" in m for m in logs)
    # the block_size asked for is not silently dropped: the line names the base's and the one asked
    [kept] = [m for m in logs if m.startswith("init-from: the model keeps its base's shape")]
    assert "block_size 64 (not 32)" in kept and "n_layer 2 (not 12)" in kept, kept
    tuned = load_run(tmp_path / "ft")
    # the base's shape, not the preset's
    assert tuned.config.model.n_layer == 2 and tuned.config.model.n_embd == 32
    assert tuned.config.model.block_size == 64 and tuned.state.init_from["step"] == 0
    w0 = load_run(base).model.state_dict()
    # lr ~0: the base
    assert all(torch.allclose(w0[k], v, atol=1e-6) for k, v in tuned.model.state_dict().items())
    assert {
        p: p.stat().st_mtime_ns for p in base.rglob("*")
    } == before  # the base run is never modified


def test_init_from_with_another_vocabulary_names_both_sides(hf_folder, tmp_path, char_data):
    from gptlib.training.loop import train

    base = import_hf(hf_folder, tmp_path / "base", log=quiet)
    with pytest.raises(
        ConfigError,
        match=r"its vocabulary \(bpe, 300 tokens.*is not the data's .*char, 61 tokens"
        r".*--tokenizer-from",
    ):
        train(
            char_data,
            tmp_path / "ft",
            "finetune",
            TINY,
            max_steps=2,
            progress=False,
            log=quiet,
            options=StartOptions(init_from=str(base)),
        )


def test_weights_that_do_not_fit_the_config_are_one_line(hf_folder, tmp_path, capsys):
    """A folder whose config.json does not describe its weights (hand-edited, or mixed up with another model's):
    one line naming the weight and both shapes, no traceback, no run directory."""
    import shutil

    from gptlib.__main__ import main

    folder = tmp_path / "edited"
    shutil.copytree(hf_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    # the weights are 32 wide
    (folder / "config.json").write_text(json.dumps({**cfg, "n_embd": 64}))
    assert main(["import-hf", "--model", str(folder), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert str(folder) in err and "shape (" in err and "64" in err and "32" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "file, edit, message",
    [
        (
            "config.json",
            lambda c: {k: v for k, v in c.items() if k != "n_embd"},
            "n_embd is missing",
        ),
        ("config.json", lambda c: [c], "not a JSON object"),
        ("tokenizer.json", None, "is not a valid tokenizers file"),
    ],
)
def test_a_broken_config_or_tokenizer_is_one_line(hf_folder, tmp_path, capsys, file, edit, message):
    """config.json without a GPT-2 size field or not an object, a tokenizer.json that is not JSON: each was a bare
    KeyError, AttributeError or JSONDecodeError traceback; now one line naming the file and what is wrong."""
    import shutil

    from gptlib.__main__ import main

    folder = tmp_path / "broken"
    shutil.copytree(hf_folder, folder)
    if edit is None:
        (folder / file).write_text('{"model": {"type": "BPE", ')  # cut off mid-write
    else:
        (folder / file).write_text(json.dumps(edit(json.loads((folder / file).read_text()))))
    assert main(["import-hf", "--model", str(folder), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert str(folder / file) in err and message in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[:1000],  # a copy or download cut off
        lambda data: b"",
        lambda data: b"weights go here\n",
    ],
)
def test_a_damaged_safetensors_file_is_one_line(hf_folder, tmp_path, capsys, damage):
    """A model.safetensors cut off, empty or not safetensors at all was a SafetensorError traceback ('invalid header
    length'); now one line naming the file and the fix, and no run directory."""
    import shutil

    from gptlib.__main__ import main

    folder = tmp_path / "damaged"
    shutil.copytree(hf_folder, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    assert main(["import-hf", "--model", str(folder), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert f"{weights} is not a readable safetensors file" in err and "download it again" in err, (
        err
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged"]


def test_weights_of_more_layers_than_config_json_says_are_refused(hf_folder, tmp_path, capsys):
    """config.json saying n_layer=1 over two layers' weights imported a 1-layer model and dropped layer 1 unseen
    (exit 0); now one line naming an unused weight and config.json's n_layer, as fewer weights than layers is."""
    import shutil

    from gptlib.__main__ import main

    folder = tmp_path / "edited"
    shutil.copytree(hf_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "n_layer": 1}))
    assert main(["import-hf", "--model", str(folder), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "'transformer.h.1." in err and "n_layer=1" in err and "2 layers" in err, err
    assert not (tmp_path / "run").exists()
