"""export-gguf: a checkpoint as one GGUF file (llama.cpp, Ollama, LM Studio), named as llama.cpp's converter does."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np

from gptlib.data.conversations import END, ROLE_TOKENS, ChatTemplate
from gptlib.data.tokenizer import EOT, BPETokenizer, Tokenizer
from gptlib.errors import ChatError, ExportError
from gptlib.inference.export import hf_state_dict, is_conv1d, native_arch
from gptlib.inference.loading import load_run
from gptlib.model import RMS_EPS, GPT

FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
# conversations.py's template (version 1) in Jinja, as llama.cpp, LM Studio and Ollama render a chat: each turn is
# its role token, a newline and the text, <|end|> and a newline. The generation prompt ends with the newline every
# answer starts with (always a token of its own after a role token: GPT-2's split regex), so the reply has none.
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '"
                 + END + "\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '" + ROLE_TOKENS["assistant"]
                 + "\\n' }}{% else %}{{ '" + EOT + "' }}{% endif %}")


def gguf_tensors(model: GPT, arch: str, dtype: str):
    """(llama.cpp's name, data, ggml type): norms, biases, positions in f32, the rest in dtype (q8_0 rows not of
    a multiple of 32: f16), as llama.cpp's converter does."""
    cfg, t = model.config, gguf.GGMLQuantizationType
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.n_layer)
    for name, w in hf_state_dict(model).items():
        if is_conv1d(cfg, name):
            w = w.t()  # llama.cpp keeps a Linear's (out, in), which transformers' GPT-2 turned around
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            # llama.cpp's llama rotates adjacent pairs, ours (Qwen3's) the two halves: each head's rows reordered,
            # as convert_hf_to_gguf.py does
            w = w.reshape(cfg.n_head, 2, -1, w.shape[1]).transpose(1, 2).reshape(w.shape)
        name, w = names.get_name(name, try_suffixes=(".weight", ".bias")), w.contiguous().numpy()
        if dtype == "f32" or w.ndim == 1 or name.endswith("_norm.weight") or name.startswith("position_embd"):
            yield name, w, t.F32
        elif dtype == "q8_0" and gguf.quants.Q8_0.can_quantize(w):
            yield name, gguf.quants.quantize(w, t.Q8_0), t.Q8_0
        else:
            yield name, w.astype(np.float16), t.F16


def _add_tokenizer(w, tok: BPETokenizer, n: int) -> None:
    # the n tokens by id (unused ones named as llama.cpp's converter names them), their types and the merges
    obj = json.loads(tok.to_json_bytes())
    by_id = {i: t for t, i in obj["model"]["vocab"].items()}
    kinds = {i: gguf.TokenType.NORMAL for i in by_id}
    for t in obj.get("added_tokens", []):
        by_id[t["id"]] = t["content"]
        kinds[t["id"]] = gguf.TokenType.CONTROL if t.get("special") else gguf.TokenType.USER_DEFINED
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # llama.cpp's name for GPT-2's split regex: ByteLevel's with use_regex
    w.add_token_list([by_id.get(i, f"[PAD{i}]") for i in range(n)])
    w.add_token_types([int(kinds.get(i, gguf.TokenType.UNUSED)) for i in range(n)])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in obj["model"].get("merges", [])])
    w.add_bos_token_id(tok.eot_id)
    w.add_eos_token_id(tok.eot_id)
    w.add_add_bos_token(False)  # gptlib never puts <|endoftext|> before a prompt
    try:
        ChatTemplate(tok)
    except ChatError:
        return  # not a chat tokenizer
    w.add_eot_token_id(tok.token_id(END))
    w.add_chat_template(CHAT_TEMPLATE)


def write_gguf(model: GPT, tokenizer: Tokenizer, out: str | Path, dtype: str = "f16", name: str = "gptlib",
               overwrite: bool = False) -> Path:
    """Written beside `out` and renamed at the end: a failed export leaves nothing, an existing file stays."""
    out = Path(out)
    check_gguf_target(out, overwrite, dtype)
    arch = gguf_arch(model.config, tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        w, cfg = gguf.GGUFWriter(tmp, arch), model.config
        w.add_name(name)
        w.add_block_count(cfg.n_layer)
        w.add_context_length(cfg.block_size)
        w.add_embedding_length(cfg.n_embd)
        w.add_feed_forward_length(cfg.mlp_hidden)
        w.add_head_count(cfg.n_head)
        w.add_head_count_kv(cfg.n_head)
        if arch == "gpt2":
            w.add_layer_norm_eps(1e-5)  # nn.LayerNorm's default, as hf_config says
        else:
            w.add_layer_norm_rms_eps(RMS_EPS)
            w.add_rope_freq_base(cfg.rope_theta)
        w.add_file_type(FILE_TYPES[dtype])
        _add_tokenizer(w, tokenizer, cfg.vocab_size)
        for tname, data, qtype in gguf_tensors(model, arch, dtype):
            w.add_tensor(tname, data, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def gguf_arch(cfg, tokenizer: Tokenizer) -> str:
    if not isinstance(tokenizer, BPETokenizer):
        raise ExportError(f"this run has a {tokenizer.kind} tokenizer; llama.cpp's tokenizers are subword ones: "
                          f"export a byte-level BPE run (tokenize --tokenizer bpe), or use export-hf for this one")
    return native_arch(cfg, target="llama.cpp")


def check_gguf_target(out: Path, overwrite: bool, dtype: str) -> None:
    if dtype not in FILE_TYPES:
        raise ExportError(f"--dtype {dtype!r}: choose one of {', '.join(FILE_TYPES)}")
    if out.is_dir():
        raise ExportError(f"--out {out} is a folder; give a file name, e.g. {out / 'model.gguf'}")
    if out.exists() and not overwrite:
        raise ExportError(f"{out} exists; choose another --out or pass --overwrite to replace it")


def export_gguf(run_dir: str | Path, out: str | Path, checkpoint: str | int = "latest", dtype: str = "f16",
                overwrite: bool = False) -> Path:
    check_gguf_target(Path(out), overwrite, dtype)  # before reading gigabytes of weights
    ld = load_run(run_dir, checkpoint)
    return write_gguf(ld.model, ld.tokenizer, out, dtype, name=f"{Path(run_dir).name} (step {ld.step})",
                      overwrite=overwrite)
