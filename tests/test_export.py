"""Export to Hugging Face: transformers loads the folder as GPT2LMHeadModel with our logits and tokens."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from gptlib.config import ModelConfig
from gptlib.data.tokenizer import BPETokenizer, CharTokenizer
from gptlib.inference.engine import Engine, SamplingConfig
from gptlib.inference.export import ExportError, export_hf, export_model
from gptlib.model import GPT

from .conftest import TINY

transformers = pytest.importorskip("transformers")  # a test-only dependency (the `test` extra)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, char_data):
    from gptlib.training.loop import train

    rd = tmp_path_factory.mktemp("export") / "run"
    train(
        char_data,
        rd,
        overrides=TINY + ["eval_interval=5"],
        max_steps=10,
        progress=False,
        log=lambda s: None,
    )
    return rd


def load_hf(path):
    m = transformers.GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32).eval()
    return m, transformers.AutoTokenizer.from_pretrained(path)


def assert_same_model(ours: GPT, hf, ids: list[int]) -> None:
    x = torch.tensor([ids])
    with torch.no_grad():
        theirs = hf(x).logits
        mine, _ = ours(x)
    assert theirs.shape == mine.shape  # (1, T, vocab_size): the padding rows were not exported
    torch.testing.assert_close(theirs, mine, rtol=1e-4, atol=1e-5)
    n = ours.config.block_size - len(ids)  # transformers cannot go past its n_positions
    with torch.no_grad():
        out = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    mine_ids, _ = Engine(ours).generate_ids(
        [ids], SamplingConfig(max_new_tokens=n, temperature=0, stop_at_eot=False)
    )
    assert out[0, len(ids) :].tolist() == mine_ids[0]


def test_export_char_run_loads_in_transformers(run_dir, tmp_path):
    out = export_hf(run_dir, tmp_path / "hf", checkpoint="latest")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        f.name for f in out.iterdir()
    }
    hf, hf_tok = load_hf(out)
    eng = Engine.from_run(run_dir)
    text = "ROMEO:\nWhat, art thou mad?"
    ids = hf_tok(text).input_ids
    assert ids == eng.tokenizer.encode(text)
    assert hf_tok.decode(ids) == text
    assert_same_model(eng.model, hf, ids[:10])


def test_export_with_biases_and_padding(tmp_path):
    torch.manual_seed(1)
    m = GPT(
        ModelConfig(
            vocab_size=70,
            block_size=24,
            n_layer=2,
            n_head=4,
            n_embd=32,
            bias=True,
            vocab_multiple=64,
        )
    )
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # non-zero biases must land in the right place too
    m.eval()
    tok = CharTokenizer([chr(40 + i) for i in range(70)])
    out = export_model(m, tmp_path / "hf", tok)
    hf, hf_tok = load_hf(out)
    assert_same_model(m, hf, [1, 5, 9, 69, 2])
    assert hf_tok("()m").input_ids == tok.encode("()m") == [0, 1, 69]


def test_export_bpe_tokenizer(tmp_path, small_text):
    tok = BPETokenizer.train([small_text.read_text()], vocab_size=300)
    torch.manual_seed(2)
    m = GPT(
        ModelConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=32)
    ).eval()
    out = export_model(m, tmp_path / "hf", tok)
    hf, hf_tok = load_hf(out)
    text = "First Citizen:\nBefore we proceed any further, hear me speak."
    assert hf_tok(text).input_ids == tok.encode(text)
    assert hf_tok.decode(tok.encode(text)) == text
    literal = "a <|endoftext|> inside the text stays text"
    assert hf_tok(literal).input_ids == tok.encode(literal) and tok.eot_id not in tok.encode(
        literal
    )
    assert (
        hf_tok.eos_token == "<|endoftext|>"
        and hf_tok.eos_token_id == tok.eot_id == hf.config.eos_token_id
    )
    assert_same_model(m, hf, tok.encode("First Citizen:")[:8])


def test_export_never_overwrites_by_accident(run_dir, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty.*--overwrite"):
        export_hf(run_dir, out)
    assert (out / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folder left behind
    # --overwrite replaces exports only
    with pytest.raises(ExportError, match="not a previous gptlib export"):
        export_hf(run_dir, out, checkpoint=5, overwrite=True)
    assert (out / "keep.txt").read_text() == "mine"
    prev = tmp_path / "prev"
    export_hf(run_dir, prev, checkpoint=10)
    export_hf(run_dir, prev, checkpoint=5, overwrite=True)  # a previous export is replaced
    assert (
        "- step: 5" in (prev / "README.md").read_text() and (prev / "model.safetensors").is_file()
    )


def test_overwrite_keeps_what_the_user_put_beside_a_previous_export(run_dir, tmp_path):
    """FILE.gguf and a Modelfile (docs/cli.md's Ollama steps), or a folder, kept in the export folder: re-running
    export-hf --overwrite (notebook 04's export cell always overwrites) deleted them with the previous export. Now
    the export's own files are replaced and the rest stays."""
    out = tmp_path / "hf"
    export_hf(run_dir, out, checkpoint=10)
    (out / "model.gguf").write_bytes(b"GGUF mine")
    (out / "Modelfile").write_text("FROM ./model.gguf\n")
    (out / "notes").mkdir()
    (out / "notes" / "a.txt").write_text("mine")
    export_hf(run_dir, out, checkpoint=5, overwrite=True)
    assert "- step: 5" in (out / "README.md").read_text()
    assert (out / "model.gguf").read_bytes() == b"GGUF mine"
    assert (out / "Modelfile").read_text() == "FROM ./model.gguf\n"
    assert (out / "notes" / "a.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"], "no leftovers beside it"
    # cut off between its two renames (the previous export moved aside, the new one not yet in place): the next
    # export removed both leftovers, and what the user kept with them
    os.replace(out, tmp_path / ".hf.old-123")
    shutil.copytree(tmp_path / ".hf.old-123", tmp_path / ".hf.export-abc")
    export_hf(run_dir, out, checkpoint=10, overwrite=True)
    assert (out / "model.gguf").read_bytes() == b"GGUF mine" and "- step: 10" in (
        out / "README.md"
    ).read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"], "no leftovers beside it"


@pytest.mark.parametrize("where", ["run", "run/checkpoints", "parent"])
def test_export_refuses_the_run_itself_as_output(run_dir, tmp_path, where):
    """export-hf --out R --overwrite once replaced the whole run with the export."""
    import shutil

    from gptlib.fsutil import sha256_file

    run = tmp_path / "copy" / "run"
    shutil.copytree(run_dir, run)
    out = {"run": run, "run/checkpoints": run / "checkpoints", "parent": tmp_path / "copy"}[where]
    before = {p: sha256_file(p) for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ExportError, match="run directory|run or data directory"):
        export_hf(run, out, overwrite=True)
    assert {p: sha256_file(p) for p in run.rglob("*") if p.is_file()} == before


def test_export_refuses_a_data_directory(run_dir, char_data, tmp_path):
    with pytest.raises(ExportError, match="run or data directory .*meta.json"):
        export_hf(run_dir, char_data, overwrite=True)


def test_cli_export_hf(run_dir, tmp_path, capsys):
    from gptlib.__main__ import main

    rc = main(
        [
            "export-hf",
            "--run-dir",
            str(run_dir),
            "--out",
            str(tmp_path / "hf"),
            "--checkpoint",
            "best",
        ]
    )
    assert rc == 0 and "model.safetensors" in capsys.readouterr().out
    hf, _ = load_hf(tmp_path / "hf")
    assert hf.config.n_positions == 32 and hf.config.activation_function == "gelu_new"
    rc = main(["export-hf", "--run-dir", str(run_dir), "--out", str(tmp_path / "hf")])
    assert rc == 2 and "--overwrite" in capsys.readouterr().err
    rc = main(["export-hf", "--run-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "x")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_what_a_killed_export_left_is_removed_by_the_next(run_dir, tmp_path):
    """kill -9 (a Colab disconnect) mid-export leaves a hidden full-size copy beside the target; the next export, under
    another temporary name, left it there, one more copy per disconnect on Drive. Now the next one removes it, and
    nothing else (tests/test_gguf.py: the same for a GGUF file)."""
    (tmp_path / ".hf.export-k1ll3d").mkdir()
    (tmp_path / ".hf.export-k1ll3d" / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / ".hf.old-123").mkdir()
    (tmp_path / ".hfx.export-other").mkdir()  # another target's: not this one's to remove
    export_hf(run_dir, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hfx.export-other", "hf"]


def test_a_chat_models_export_chats_in_transformers(tmp_path, small_text):
    """A chat fine-tune's export (what push uploads): transformers' apply_chat_template gives gptlib's ids for the same
    conversation, and generate() stops at <|end|>. It had no chat template (apply_chat_template raised), split the role
    markers into ordinary tokens, and stopped only at <|endoftext|>."""
    import json

    from transformers import AutoTokenizer

    from gptlib.data.conversations import CHAT_TOKENS, END, ChatTemplate

    tok = BPETokenizer.train([small_text.read_text()], vocab_size=300, extra_special=CHAT_TOKENS)
    model = GPT(
        ModelConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=32)
    ).eval()
    out = export_model(model, tmp_path / "hf", tok)
    hf_tok = AutoTokenizer.from_pretrained(out)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ours = ChatTemplate(tok).render(chat, require_assistant=False, generation_prompt=True)[0]
    theirs = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    # the template (llama.cpp's too) also writes the newline that follows every role marker, which gptlib's prompt
    # leaves to the model
    assert list(theirs) == ours.tolist() + tok.encode("\n")
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == [tok.token_id(END), tok.eot_id]
    # a plain BPE model keeps literal special tokens as text, and one end
    plain = BPETokenizer.train([small_text.read_text()], vocab_size=300)
    out = export_model(model.__class__(model.config), tmp_path / "plain", plain)
    assert AutoTokenizer.from_pretrained(out).chat_template is None
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == plain.eot_id


def test_train_init_from_an_export_says_to_import_it_first(run_dir, char_data, tmp_path, capsys):
    """train --init-from a folder export-hf made (model.safetensors, no checkpoints) said only 'no valid checkpoint
    in HF/checkpoints (has training saved one yet?)'. Now it names the folder as a Hugging Face model and the
    import-hf command that makes it a run; nothing is left behind."""
    from gptlib.__main__ import main

    hf, new = tmp_path / "hf", tmp_path / "new"
    assert main(["export-hf", "--run-dir", str(run_dir), "--out", str(hf)]) == 0
    capsys.readouterr()
    rc = main(["train", "--data", str(char_data), "--run-dir", str(new), "--init-from", str(hf)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err == (
        f"error: no valid checkpoint in {hf}: it holds a Hugging Face model (model.safetensors), not a gptlib run; "
        f"make it a run with python -m gptlib import-hf --model {hf} --out RUN_DIR, then use RUN_DIR\n"
    )
    assert not new.exists()
