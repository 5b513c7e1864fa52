"""export-hf and export-gguf: a checkpoint as a folder transformers loads natively (plain JSON and safetensors, no
transformers), or as one GGUF file for llama.cpp, Ollama, LM Studio (tensors named as llama.cpp's converter does)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from gptlib.colab import mount_for
from gptlib.config import ModelConfig
from gptlib.data.conversations import END, ROLE_TOKENS, ChatTemplate
from gptlib.data.shards import META_FILE, PREPARE_STATE_FILE
from gptlib.data.tokenizer import EOT, BPETokenizer, CharTokenizer, Tokenizer
from gptlib.errors import ChatError, ExportError
from gptlib.inference.loading import load_run
from gptlib.layout import CHECKPOINTS_DIR, LEASE_FILE, METRICS_FILE
from gptlib.model import GPT, RMS_EPS

# Linear (out, in) here, Conv1D (in, out) there
GPT2_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
GPT2_PARTS = dict(
    positions="learned", norm="layernorm", qk_norm=False, mlp="gelu", tie_embeddings=True
)
LLAMA_PARTS = dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False)
CLASSES = {"gpt2": "GPT2LMHeadModel", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
NAMES = {"gpt2": "GPT-2", "qwen3": "Qwen3", "llama": "Llama"}


def native_arch(cfg: ModelConfig, target: str = "native Hugging Face") -> str:
    """The architecture that computes exactly this model, else ExportError naming the fields that differ."""
    if all(getattr(cfg, k) == v for k, v in GPT2_PARTS.items()):
        return "gpt2"
    if off := {k: getattr(cfg, k) for k, v in LLAMA_PARTS.items() if getattr(cfg, k) != v}:
        wanted = ", ".join(f"{k}={LLAMA_PARTS[k]!r}" for k in off)
        raise ExportError(
            f"this model has {', '.join(f'{k}={v!r}' for k, v in off.items())}, which no {target} "
            f"architecture has (the nearest, Qwen3/Llama, needs {wanted}); train with those "
            f"settings to export, or use the run with gptlib (sample, chat, eval)"
        )
    return "qwen3" if cfg.qk_norm else "llama"


def weight_map(cfg: ModelConfig) -> list[tuple[str, tuple[str, ...]]]:
    """(our weight, the transformers weights it stacks along dim 0); import-hf reads it the other way."""
    if native_arch(cfg) == "gpt2":
        names = ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"] + [
            f"h.{i}.{part}.{w}"
            for i in range(cfg.n_layer)
            for part in ("ln_1", "ln_2", *GPT2_LINEARS)
            for w in ("weight", "bias")
        ]
        return [("transformer." + n, ("transformer." + n,)) for n in names]
    pairs = [
        ("transformer.wte.weight", "model.embed_tokens"),
        ("transformer.ln_f.weight", "model.norm"),
    ]
    pairs += [] if cfg.tie_embeddings else [("lm_head.weight", "lm_head")]
    for i in range(cfg.n_layer):
        p, q = f"transformer.h.{i}.", f"model.layers.{i}."
        pairs += [
            (p + "ln_1.weight", q + "input_layernorm"),
            (p + "ln_2.weight", q + "post_attention_layernorm"),
            (p + "attn.c_attn.weight", tuple(q + f"self_attn.{n}_proj" for n in "qkv")),
            (p + "attn.c_proj.weight", q + "self_attn.o_proj"),
            (p + "mlp.c_fc.weight", (q + "mlp.gate_proj", q + "mlp.up_proj")),
            (p + "mlp.c_proj.weight", q + "mlp.down_proj"),
        ]
        if cfg.qk_norm:
            pairs += [(p + f"attn.{n}_norm.weight", q + f"self_attn.{n}_norm") for n in "qk"]
    return [
        (ours, tuple(t + ".weight" for t in ((theirs,) if isinstance(theirs, str) else theirs)))
        for ours, theirs in pairs
    ]


def is_conv1d(cfg: ModelConfig, name: str) -> bool:
    linear = name.endswith(".weight") and any(f".{n}." in name for n in GPT2_LINEARS)
    return native_arch(cfg) == "gpt2" and linear


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights under transformers' names and layouts (fp32, contiguous); GPT-2 gets zero biases for bias=False."""
    cfg, out = model.config, {}
    sd = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    for ours, theirs in weight_map(cfg):
        # a bias that bias=False left out: zeros, one per row of its weight
        w = sd[ours] if ours in sd else torch.zeros(len(sd[ours.removesuffix("bias") + "weight"]))
        if ours in ("transformer.wte.weight", "lm_head.weight"):
            w = w[: cfg.vocab_size]  # the padding rows never produce a token
        w = w.t() if is_conv1d(cfg, ours) else w
        out.update(zip(theirs, w.split(w.shape[0] // len(theirs))))
    return {k: v.contiguous().clone() for k, v in out.items()}


def hf_config(cfg: ModelConfig, eot: int | None) -> dict:
    arch = native_arch(cfg)
    common = {
        "architectures": [CLASSES[arch]],
        "model_type": arch,
        "vocab_size": cfg.vocab_size,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch != "gpt2":
        return {
            **common,
            "hidden_size": cfg.n_embd,
            "intermediate_size": cfg.mlp_hidden,
            "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_head,
            "head_dim": cfg.n_embd // cfg.n_head,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.block_size,
            "rms_norm_eps": RMS_EPS,
            "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": cfg.tie_embeddings,
        }
    return {
        **common,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,  # 4 * n_embd
        "activation_function": "gelu_new",  # tanh-approximated GELU, as in our MLP
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "dtype": "float32",
    }


def write_tokenizer_files(tok: Tokenizer, out: Path, block_size: int) -> None:
    if isinstance(tok, CharTokenizer):
        # "<unk>" is not in the vocabulary: an unknown character is an error in transformers too, as in gptlib.
        hf = HFTokenizer(
            models.WordLevel(vocab={c: i for i, c in enumerate(tok.chars)}, unk_token="<unk>")
        )
        # every character alone
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        hf.decoder = decoders.Fuse()  # join tokens without spaces
        (out / "tokenizer.json").write_text(hf.to_str(), encoding="utf-8")
    else:  # byte-level BPE: our tokenizer.json already is a `tokenizers` file
        (out / "tokenizer.json").write_bytes(tok.to_json_bytes())
    has_eot = tok.eot_id is not None
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT} if has_eot else {}
    # split_special_tokens: a literal "<|endoftext|>" in text stays text, as in gptlib (documents cannot forge a
    # boundary); the special token is only added by id. clean_up_...: decode gives back exactly the characters.
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": block_size,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": bool(special),
        **special,
    }
    # a chat model: apply_chat_template renders the role markers as text, which must become their ids
    if chat_end_id(tok) is not None:
        tcfg.update(chat_template=CHAT_TEMPLATE, split_special_tokens=False)
    text = json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(text)


def export_model(
    model: GPT,
    out_dir: str | Path,
    tokenizer: Tokenizer | None = None,
    overwrite: bool = False,
    info: dict | None = None,
) -> Path:
    """Written into a temporary sibling folder renamed at the end: a failed export leaves no half folder."""
    out = Path(out_dir)
    check_export_target(out, overwrite)
    # a part no native architecture has: refused before anything is written
    arch = native_arch(model.config)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        config = hf_config(model.config, getattr(tokenizer, "eot_id", None))
        if tokenizer is not None and (end := chat_end_id(tokenizer)) is not None:
            # generate() stops at the end of the turn
            config["eos_token_id"] = [end, tokenizer.eot_id]
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(hf_state_dict(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # transformers takes the special tokens from here, generation's from config.json
        if tokenizer is not None:
            write_tokenizer_files(tokenizer, tmp, model.config.block_size)
        (tmp / "README.md").write_text(_model_card(model.config, arch, info or {}))
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        # a previous export (check_export_target): replaced only once the new one is complete; what the user keeps
        # beside it (a GGUF file, a Modelfile) comes along, copied, so that a kill before the swap leaves it in place
        if out.exists():
            for kept in [p for p in out.iterdir() if not (tmp / p.name).exists()]:
                (shutil.copytree if kept.is_dir() else shutil.copy2)(kept, tmp / kept.name)
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def remove_leftovers(out: Path) -> None:
    """What an export, a GGUF or a push's staging left beside `out` when cut off (kill -9, a Colab disconnect): removed
    before the next one, as each is a full-size copy (on Drive, one more on the quota)."""
    names = tuple(f".{out.name}.{kind}-" for kind in ("export", "old", "partial", "staging"))
    for left in out.parent.iterdir() if out.parent.is_dir() else ():
        if left.name.startswith(names):
            if left.is_dir():
                shutil.rmtree(left, ignore_errors=True)
            else:
                left.unlink(missing_ok=True)


def check_export_target(out: Path, overwrite: bool | None, run_dir: Path | None = None) -> None:
    """Refuse the run itself, a run or data directory, or a non-empty folder that overwrite may not replace (None: the
    command has no --overwrite)."""
    # an --out on Drive with GPTLIB_ROOT off it (Drive not mounted yet): written to Drive, not under the mount point
    mount_for(out)
    # an export cut off between its two renames (export_model): the previous one, with what the user kept in it, back
    if not out.exists() and (old := next(out.parent.glob(f".{out.name}.old-*"), None)):
        os.replace(old, out)
    target, run = out.resolve(), run_dir and run_dir.resolve()
    if run and (target == run or run in target.parents or target in run.parents):
        raise ExportError(
            f"--out {out} is the run directory {run_dir}, inside it, or holds it: the export would "
            f"replace the run; choose a folder outside the run (e.g. {run.parent / (run.name + '-hf')})"
        )
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"--out {out} is a file; choose a folder")
    markers = (CHECKPOINTS_DIR, METRICS_FILE, LEASE_FILE, META_FILE, PREPARE_STATE_FILE)
    if found := [n for n in markers if (out / n).exists()]:
        raise ExportError(
            f"--out {out} is a gptlib run or data directory (it holds {', '.join(found)}); "
            f"choose another folder for the export"
        )
    if not any(out.iterdir()):
        return
    if overwrite is None:
        raise ExportError(f"--out {out} is not empty; choose an empty or new folder")
    readme = out / "README.md"  # its first line is the model card's title in a previous export
    first = readme.read_text(errors="replace").partition("\n")[0] if readme.is_file() else ""
    if first not in [f"# gptlib {name} export" for name in NAMES.values()]:
        raise ExportError(
            f"--out {out} is not empty and is not a previous gptlib export; choose an empty or new "
            f"folder (--overwrite replaces only a previous export)"
        )
    if not overwrite:
        raise ExportError(
            f"{out} holds a previous export; choose another --out or pass --overwrite to replace it"
        )


def export_hf(
    run_dir: str | Path,
    out_dir: str | Path,
    checkpoint: str | int = "latest",
    overwrite: bool = False,
) -> Path:
    # before reading gigabytes of weights
    check_export_target(Path(out_dir), overwrite, Path(run_dir))
    ld = load_run(run_dir, checkpoint)
    info = {
        "run_dir": str(run_dir),
        "step": ld.step,
        "val_loss": ld.state.val_loss,
        "tokenizer": ld.tokenizer.kind,
    }
    return export_model(ld.model, out_dir, ld.tokenizer, overwrite=overwrite, info=info)


def _model_card(c: ModelConfig, arch: str, info: dict) -> str:
    return "\n".join(
        [
            f"# gptlib {NAMES[arch]} export",
            "",
            f"A {NAMES[arch]} architecture model trained from scratch with gptlib: {c.n_layer} layers, "
            f"{c.n_head} heads, {c.n_embd} wide, context {c.block_size}, vocabulary {c.vocab_size}.",
            "",
            *([f"- {k}: {v}" for k, v in info.items()] + [""] if info else []),
            "```python",
            f"from transformers import AutoTokenizer, {CLASSES[arch]}",
            "tok = AutoTokenizer.from_pretrained(PATH)",
            f"model = {CLASSES[arch]}.from_pretrained(PATH)",
            'ids = tok("ROMEO:", return_tensors="pt").input_ids',
            "print(tok.decode(model.generate(ids, max_new_tokens=100, do_sample=True)[0]))",
            "```",
            "",
        ]
    )


# GGUF (export-gguf): one file for llama.cpp, Ollama, LM Studio.
FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
# conversations.py's template (version 1) in Jinja, as llama.cpp, LM Studio and Ollama render a chat: each turn is
# its role token, a newline and the text, <|end|> and a newline. The generation prompt ends with the newline every
# answer starts with (always a token of its own after a role token: GPT-2's split regex), so the reply has none.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '"
    + END
    + "\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '"
    + ROLE_TOKENS["assistant"]
    + "\\n' }}{% else %}{{ '"
    + EOT
    + "' }}{% endif %}"
)


def gguf_tensors(model: GPT, arch: str, dtype: str):
    """(llama.cpp's name, data, ggml type): norms, biases, positions in f32, the rest in dtype (q8_0 rows not of
    a multiple of 32: f16), as llama.cpp's converter does."""
    cfg, t = model.config, gguf.GGMLQuantizationType
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.n_layer)
    for name, w in hf_state_dict(model).items():
        if is_conv1d(cfg, name):
            # llama.cpp keeps a Linear's (out, in), which transformers' GPT-2 turned around
            w = w.t()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            # llama.cpp's llama rotates adjacent pairs, ours (Qwen3's) the two halves: each head's rows reordered,
            # as convert_hf_to_gguf.py does
            w = w.reshape(cfg.n_head, 2, -1, w.shape[1]).transpose(1, 2).reshape(w.shape)
        name, w = names.get_name(name, try_suffixes=(".weight", ".bias")), w.contiguous().numpy()
        full_precision = name.endswith("_norm.weight") or name.startswith("position_embd")
        if dtype == "f32" or w.ndim == 1 or full_precision:
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
    # llama.cpp's name for GPT-2's split regex: ByteLevel's with use_regex
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([by_id.get(i, f"[PAD{i}]") for i in range(n)])
    w.add_token_types([int(kinds.get(i, gguf.TokenType.UNUSED)) for i in range(n)])
    merges = [m if isinstance(m, str) else " ".join(m) for m in obj["model"].get("merges", [])]
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.eot_id)
    w.add_eos_token_id(tok.eot_id)
    w.add_add_bos_token(False)  # gptlib never puts <|endoftext|> before a prompt
    if (end := chat_end_id(tok)) is not None:
        w.add_eot_token_id(end)
        w.add_chat_template(CHAT_TEMPLATE)


def chat_end_id(tok: Tokenizer) -> int | None:
    """A chat tokenizer's end-of-turn id (<|end|>); None for another tokenizer."""
    try:
        return ChatTemplate(tok).end_id
    except ChatError:
        return None


def write_gguf(
    model: GPT,
    tokenizer: Tokenizer,
    out: str | Path,
    dtype: str = "f16",
    name: str = "gptlib",
    overwrite: bool = False,
) -> Path:
    """Written beside `out` and renamed at the end: a failed export leaves nothing, an existing file stays."""
    out = Path(out)
    check_gguf_target(out, overwrite, dtype)
    arch = gguf_arch(model.config, tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out)
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


def gguf_arch(cfg, tokenizer: Tokenizer, instead: str = "") -> str:
    if not isinstance(tokenizer, BPETokenizer):
        raise ExportError(
            f"this run has a {tokenizer.kind} tokenizer; llama.cpp's tokenizers are subword ones: "
            f"{instead or 'export a byte-level BPE run (tokenize --tokenizer bpe), or use export-hf for this one'}"
        )
    return native_arch(cfg, target="llama.cpp")


def check_gguf_target(out: Path, overwrite: bool, dtype: str) -> None:
    if dtype not in FILE_TYPES:
        raise ExportError(f"--dtype {dtype!r}: choose one of {', '.join(FILE_TYPES)}")
    mount_for(out)  # as check_export_target
    if out.is_dir():
        raise ExportError(f"--out {out} is a folder; give a file name, e.g. {out / 'model.gguf'}")
    if not out.exists():
        return
    if not overwrite:
        raise ExportError(f"{out} exists; choose another --out or pass --overwrite to replace it")
    # as export-hf's folders: --overwrite replaces a previous export only (not a checkpoint's model.pt, a meta.json)
    with out.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ExportError(f"{out} is not a GGUF file; --overwrite replaces only a previous export")


def export_gguf(
    run_dir: str | Path,
    out: str | Path,
    checkpoint: str | int = "latest",
    dtype: str = "f16",
    overwrite: bool = False,
) -> Path:
    check_gguf_target(Path(out), overwrite, dtype)  # before reading gigabytes of weights
    ld = load_run(run_dir, checkpoint)
    name = f"{Path(run_dir).name} (step {ld.step})"
    return write_gguf(ld.model, ld.tokenizer, out, dtype, name=name, overwrite=overwrite)
