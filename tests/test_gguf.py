"""export-gguf's file, read back with gguf's own GGUFReader: llama.cpp's architecture, hyperparameters, tokenizer and
tensors for both recipes and every dtype, and the refusals (a char run, a part no llama.cpp architecture has, no
checkpoint, an existing file, a bad dtype), each one line that changes nothing. That llama.cpp runs the file as
gptlib does is tests/test_llama_cpp.py's (a real client, in its own CI step)."""

from __future__ import annotations

import numpy as np
import pytest

from gptlib.data.conversations import CHAT_TOKENS, END
from gptlib.data.tokenizer import BPETokenizer
from gptlib.errors import CheckpointError, ExportError
from gptlib.inference.export import CHAT_TEMPLATE, export_gguf, write_gguf
from gptlib.inference.loading import load_run
from tests.conftest import TINY
from tests.gguf_kit import bpe_data, bpe_run, tree_digest

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_text):
    root = tmp_path_factory.mktemp("gguf")
    data = bpe_data(small_text, root / "data")
    return {
        "gpt2": bpe_run(data, root / "gpt2"),
        "modern": bpe_run(data, root / "modern", "modern"),
        "llama": bpe_run(
            data, root / "llama", "modern", extra=["qk_norm=false", "tie_embeddings=true"]
        ),
        "data": data,
    }


def fields(path) -> dict:
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}


def tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def expected_names(arch: str, n_layer: int, tied: bool) -> set[str]:
    if arch == "gpt2":  # llama.cpp's gpt2 requires every bias: zeros where the model has none
        per_block = [
            f"{t}.{w}"
            for t in ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")
            for w in ("weight", "bias")
        ]
        top = [
            "token_embd.weight",
            "position_embd.weight",
            "output_norm.weight",
            "output_norm.bias",
        ]
    else:
        per_block = [
            f"{t}.weight"
            for t in (
                "attn_norm",
                "attn_q",
                "attn_k",
                "attn_v",
                "attn_output",
                "ffn_norm",
                "ffn_gate",
                "ffn_up",
                "ffn_down",
            )
        ]
        per_block += ["attn_q_norm.weight", "attn_k_norm.weight"] if arch == "qwen3" else []
        top = ["token_embd.weight", "output_norm.weight"] + ([] if tied else ["output.weight"])
    return set(top) | {f"blk.{i}.{n}" for i in range(n_layer) for n in per_block}


@pytest.mark.parametrize(
    "recipe, arch", [("gpt2", "gpt2"), ("modern", "qwen3"), ("llama", "llama")]
)
def test_the_file_has_llama_cpps_architecture_tokenizer_and_weights(runs, tmp_path, recipe, arch):
    ld = load_run(runs[recipe])
    cfg, tok = ld.model.config, ld.tokenizer
    out = export_gguf(runs[recipe], tmp_path / "m.gguf", dtype="f32")
    f = fields(out)
    assert f["general.architecture"] == arch
    assert (
        f[f"{arch}.context_length"],
        f[f"{arch}.block_count"],
        f[f"{arch}.embedding_length"],
        f[f"{arch}.attention.head_count"],
        f[f"{arch}.feed_forward_length"],
    ) == (cfg.block_size, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.mlp_hidden)
    assert (f["tokenizer.ggml.model"], f["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    assert f["tokenizer.ggml.eos_token_id"] == f["tokenizer.ggml.bos_token_id"] == tok.eot_id
    assert f["tokenizer.ggml.add_bos_token"] is False and "tokenizer.chat_template" not in f
    vocab = {i: t for t, i in tok._tk.get_vocab(with_added_tokens=True).items()}
    assert f["tokenizer.ggml.tokens"] == [vocab[i] for i in range(cfg.vocab_size)]
    assert f["tokenizer.ggml.token_type"][tok.eot_id] == gguf.TokenType.CONTROL
    # the byte alphabet and <|endoftext|>
    assert len(f["tokenizer.ggml.merges"]) == cfg.vocab_size - 256 - 1
    t = tensors(out)
    assert set(t) == expected_names(arch, cfg.n_layer, cfg.tie_embeddings)
    sd = ld.model.state_dict()
    emb = t["token_embd.weight"]
    np.testing.assert_array_equal(emb.data, sd["transformer.wte.weight"][: cfg.vocab_size].numpy())
    C = cfg.n_embd
    if arch == "gpt2":  # Linear layout (out, in), as llama.cpp keeps it; zero biases
        np.testing.assert_array_equal(
            t["blk.1.attn_qkv.weight"].data, sd["transformer.h.1.attn.c_attn.weight"]
        )
        assert not t["blk.0.ffn_up.bias"].data.any() and t["blk.0.ffn_up.bias"].data.shape == (
            4 * C,
        )
    elif arch == "qwen3":  # q, k, v and gate, up as separate tensors, rotate-half rows as they are
        np.testing.assert_array_equal(
            t["blk.1.attn_k.weight"].data, sd["transformer.h.1.attn.c_attn.weight"][C : 2 * C]
        )
        np.testing.assert_array_equal(
            t["blk.0.ffn_gate.weight"].data, sd["transformer.h.0.mlp.c_fc.weight"][: cfg.mlp_hidden]
        )
    else:  # llama rotates adjacent pairs: each head's rows interleaved from its two halves
        q, D = sd["transformer.h.0.attn.c_attn.weight"][:C], C // cfg.n_head
        np.testing.assert_array_equal(t["blk.0.attn_q.weight"].data[1], q[D // 2])
        np.testing.assert_array_equal(t["blk.0.attn_q.weight"].data[D + 2], q[D + 1])


@pytest.mark.parametrize("dtype, matrix, ftype", [("f16", "F16", 1), ("q8_0", "Q8_0", 7)])
def test_dtypes_store_the_matrices_so_and_the_rest_in_f32(runs, tmp_path, dtype, matrix, ftype):
    """As llama.cpp's converter: norms, biases and GPT-2's position table stay f32."""
    for recipe in ("gpt2", "modern"):
        out = export_gguf(runs[recipe], tmp_path / f"{recipe}.gguf", dtype=dtype)
        kinds = {n: t.tensor_type.name for n, t in tensors(out).items()}
        assert fields(out)["general.file_type"] == ftype
        for n, k in kinds.items():
            small = n.endswith(("norm.weight", ".bias")) or n == "position_embd.weight"
            assert k == ("F32" if small else matrix), (n, k)
        ours = load_run(runs[recipe]).model.state_dict()["transformer.wte.weight"].numpy()
        emb = tensors(out)["token_embd.weight"]
        back = gguf.quants.dequantize(emb.data, emb.tensor_type)
        np.testing.assert_allclose(
            back, ours[: back.shape[0]], atol=2e-3 if dtype == "q8_0" else 1e-3
        )


def test_a_chat_tokenizer_carries_its_template_and_end_of_turn(tmp_path, small_text):
    from gptlib.config import ModelConfig
    from gptlib.model import GPT

    tok = BPETokenizer.train([small_text.read_text()], vocab_size=300, extra_special=CHAT_TOKENS)
    model = GPT(
        ModelConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=32)
    ).eval()
    f = fields(write_gguf(model, tok, tmp_path / "chat.gguf", "f32"))
    assert f["tokenizer.chat_template"] == CHAT_TEMPLATE and f[
        "tokenizer.ggml.eot_token_id"
    ] == tok.token_id(END)
    assert all(
        f["tokenizer.ggml.token_type"][tok.token_id(t)] == gguf.TokenType.CONTROL
        for t in CHAT_TOKENS
    )
    jinja2 = pytest.importorskip("jinja2")
    text = jinja2.Template(CHAT_TEMPLATE).render(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
    )
    assert text == "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"


def test_refusals_are_one_line_and_change_nothing(runs, tmp_path, char_data):
    from gptlib.training.loop import train

    char_run = tmp_path / "char"
    train(char_data, char_run, overrides=TINY, max_steps=2, progress=False, log=lambda s: None)
    bias_run = bpe_run(runs["data"], tmp_path / "bias", "modern", steps=2, extra=["bias=true"])
    before = {r: tree_digest(r) for r in (char_run, bias_run, runs["gpt2"])}
    with pytest.raises(
        ExportError, match="char tokenizer; llama.cpp's tokenizers are subword ones"
    ):
        export_gguf(char_run, tmp_path / "c.gguf")
    with pytest.raises(
        ExportError, match=r"bias=True, which no llama.cpp architecture has \(the nearest"
    ):
        export_gguf(bias_run, tmp_path / "b.gguf")
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        export_gguf(tmp_path / "empty", tmp_path / "e.gguf")
    with pytest.raises(ExportError, match="--dtype 'q4': choose one of f32, f16, q8_0"):
        export_gguf(runs["gpt2"], tmp_path / "q.gguf", dtype="q4")
    with pytest.raises(ExportError, match="is a folder"):
        export_gguf(runs["gpt2"], tmp_path)
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*"))
    out = tmp_path / "mine.gguf"
    out.write_bytes(b"someone's file")
    with pytest.raises(ExportError, match="exists; choose another --out or pass --overwrite"):
        export_gguf(runs["gpt2"], out)
    assert out.read_bytes() == b"someone's file"
    # --overwrite replaces a previous GGUF only: a run's model.pt or a dataset's meta.json were written over
    for theirs in (out, next((runs["gpt2"] / "checkpoints").iterdir()) / "model.pt"):
        with pytest.raises(
            ExportError, match="is not a GGUF file; --overwrite replaces only a previous export"
        ):
            export_gguf(runs["gpt2"], theirs, overwrite=True)
    assert out.read_bytes() == b"someone's file"
    out.unlink()
    export_gguf(runs["gpt2"], out)
    export_gguf(runs["gpt2"], out, dtype="f32", overwrite=True)
    assert fields(out)["general.architecture"] == "gpt2"
    assert {r: tree_digest(r) for r in before} == before


def test_a_failed_write_leaves_no_file_and_keeps_the_old_one(runs, tmp_path, monkeypatch):
    out = export_gguf(runs["modern"], tmp_path / "m.gguf")
    old = out.read_bytes()

    def full_disk(self, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        export_gguf(runs["modern"], out, dtype="f32", overwrite=True)
    assert out.read_bytes() == old and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_what_a_killed_gguf_export_left_is_removed_by_the_next(runs, tmp_path):
    (tmp_path / ".m.gguf.partial-4242").write_bytes(b"x" * 1000)  # a kill -9 mid-write
    export_gguf(runs["gpt2"], tmp_path / "m.gguf")
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_cli_export_gguf(runs, tmp_path, capsys):
    from gptlib.__main__ import main

    rc = main(
        [
            "export-gguf",
            "--run-dir",
            str(runs["gpt2"]),
            "--out",
            str(tmp_path / "m.gguf"),
            "--dtype",
            "q8_0",
            "--checkpoint",
            "best",
        ]
    )
    assert (
        rc == 0
        and "exported to" in capsys.readouterr().out
        and fields(tmp_path / "m.gguf")["general.file_type"] == 7
    )
    rc = main(["export-gguf", "--run-dir", str(runs["gpt2"]), "--out", str(tmp_path / "m.gguf")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--overwrite" in err, err
    rc = main(
        ["export-gguf", "--run-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "x.gguf")]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error:") and "does not exist" in err, err
