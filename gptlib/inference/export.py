"""Export a checkpoint as a Hugging Face `transformers` folder: GPT2LMHeadModel for the gpt2 recipe, Qwen3 or
Llama for the modern one (gptlib.inference.hf_llama), all loaded natively (no trust_remote_code).

    python -m gptlib export-hf --run-dir runs/shakespeare --out hf/shakespeare

    from transformers import GPT2LMHeadModel, AutoTokenizer
    model = GPT2LMHeadModel.from_pretrained("hf/shakespeare")
    tok = AutoTokenizer.from_pretrained("hf/shakespeare")

Our GPT is GPT-2's architecture: matmul weights are transposed (Linear (out, in), Conv1D (in, out)); bias=False
models get zero biases; our tanh GELU is "gelu_new". Only the first vocab_size rows of the padded embedding are
exported (the tied output layer then yields exactly our logits). The folder is plain JSON + safetensors: exporting
does not need transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from gptlib.data.shards import META_FILE, PREPARE_STATE_FILE
from gptlib.data.tokenizer import EOT, CharTokenizer, Tokenizer
from gptlib.errors import ExportError
from gptlib.inference.hf_llama import llama_config, llama_state_dict, native_arch
from gptlib.inference.loading import load_run
from gptlib.layout import CHECKPOINTS_DIR, LEASE_FILE, METRICS_FILE
from gptlib.model import GPT

# A block's matmuls: nn.Linear (out, in) in gptlib, Conv1D (in, out) in GPT-2; same names in both.
GPT2_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# The first line of every export's README.md: how a previous export is known.
EXPORT_TITLES = {"gpt2": "# gptlib GPT-2 export", "qwen3": "# gptlib Qwen3 export", "llama": "# gptlib Llama export"}
_RUN_OR_DATA_FILES = (CHECKPOINTS_DIR, METRICS_FILE, LEASE_FILE, META_FILE, PREPARE_STATE_FILE)


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights under GPT2LMHeadModel's (or Qwen3's / Llama's) names and layouts (fp32, contiguous)."""
    cfg = model.config
    sd = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    if native_arch(cfg) != "gpt2":
        return llama_state_dict(sd, cfg)
    C = cfg.n_embd
    out = {"transformer.wte.weight": sd["transformer.wte.weight"][: cfg.vocab_size],  # (V, C): padding rows dropped
           "transformer.wpe.weight": sd["transformer.wpe.weight"]}  # (block_size, C)
    sizes = {"ln_1": C, "ln_2": C, "attn.c_attn": 3 * C, "attn.c_proj": C, "mlp.c_fc": 4 * C, "mlp.c_proj": C}
    for i in range(cfg.n_layer):
        for part, n in sizes.items():
            p = f"transformer.h.{i}.{part}."
            out[p + "weight"] = sd[p + "weight"].t() if part in GPT2_LINEARS else sd[p + "weight"]
            out[p + "bias"] = sd.get(p + "bias", torch.zeros(n))
    out["transformer.ln_f.weight"] = sd["transformer.ln_f.weight"]
    out["transformer.ln_f.bias"] = sd.get("transformer.ln_f.bias", torch.zeros(C))
    return {k: v.contiguous().clone() for k, v in out.items()}


def hf_config(model: GPT, tokenizer: Tokenizer | None = None) -> dict:
    """GPT2Config (or Qwen3's / Llama's) as JSON (written by hand so exporting does not need transformers)."""
    cfg = model.config
    eot = getattr(tokenizer, "eot_id", None) if tokenizer is not None else None
    if native_arch(cfg) != "gpt2":
        return llama_config(cfg, native_arch(cfg), eot, eot)
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size, "n_ctx": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
        "n_head": cfg.n_head, "n_inner": None,  # 4 * n_embd
        "activation_function": "gelu_new",  # tanh-approximated GELU, as in our MLP
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": eot, "eos_token_id": eot, "torch_dtype": "float32", "dtype": "float32",
    }


def _char_tokenizer(tok: CharTokenizer) -> tuple[str, str | None]:
    """A `tokenizers` file mapping each character to our id (WordLevel over single characters), and the name of
    its unknown token (None without one)."""
    from tokenizers import Regex
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(tok.chars)}
    # WordLevel needs an unknown token name; it is not in the vocabulary, so an unknown character is an error in
    # transformers too, as in gptlib.
    hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character alone
    hf.decoder = decoders.Fuse()  # join tokens without spaces
    return hf.to_str(), None


def write_tokenizer_files(tok: Tokenizer, out: Path, block_size: int) -> list[str]:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json for PreTrainedTokenizerFast."""
    special, unk = {}, None
    if isinstance(tok, CharTokenizer):
        text, unk = _char_tokenizer(tok)
        (out / "tokenizer.json").write_text(text, encoding="utf-8")
    else:  # byte-level BPE: our tokenizer.json already is a `tokenizers` file
        (out / "tokenizer.json").write_bytes(tok.to_json_bytes())
    eot = getattr(tok, "eot_id", None)
    if eot is not None:
        name = next((t["content"] for t in json.loads(tok.to_json_bytes()).get("added_tokens", [])
                     if t.get("id") == eot), EOT)
        special = {"bos_token": name, "eos_token": name, "unk_token": name}
    if unk is not None:
        special["unk_token"] = unk
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": block_size,
            "clean_up_tokenization_spaces": False,  # decode must give back exactly the characters
            "add_prefix_space": False, **special}
    if eot is not None:
        # gptlib encodes a literal "<|endoftext|>" in text as text (documents cannot forge a boundary);
        # this makes transformers do the same (the special token is then only added by id).
        tcfg["split_special_tokens"] = True
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n")
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def export_model(model: GPT, out_dir: str | Path, tokenizer: Tokenizer | None = None, overwrite: bool = False,
                 info: dict | None = None) -> Path:
    """Write config.json, model.safetensors and (with a tokenizer) tokenizer files into out_dir, through a
    temporary sibling folder renamed at the end (a failed export leaves no half folder); check_export_target."""
    out = Path(out_dir)
    check_export_target(out, overwrite)
    native_arch(model.config)  # a part no native architecture has: refused before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        config = hf_config(model, tokenizer)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(hf_state_dict(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            write_tokenizer_files(tokenizer, tmp, model.config.block_size)
        (tmp / "generation_config.json").write_text(json.dumps(
            {k: config[k] for k in ("bos_token_id", "eos_token_id")}, indent=2) + "\n")
        (tmp / "README.md").write_text(_model_card(model, info or {}))
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_export_target(out: Path, overwrite: bool, run_dir: Path | None = None) -> None:
    """Refuse an output folder that is (or is inside, or holds) the run being exported, a run or data
    directory, or a non-empty folder that is not a previous gptlib export; overwrite replaces only the latter."""
    target = out.resolve()
    if run_dir is not None:
        run = Path(run_dir).resolve()
        if target == run or run in target.parents or target in run.parents:
            raise ExportError(f"--out {out} is the run directory {run_dir}, inside it, or holds it: the export would "
                              f"replace the run; choose a folder outside the run (e.g. "
                              f"{run.parent / (run.name + '-hf')})")
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"--out {out} is a file; choose a folder")
    found = [n for n in _RUN_OR_DATA_FILES if (out / n).exists()]
    if found:
        raise ExportError(f"--out {out} is a gptlib run or data directory (it holds {', '.join(found)}); "
                          f"choose another folder for the export")
    if not any(out.iterdir()):
        return
    readme = out / "README.md"
    first = readme.read_text(errors="replace").partition("\n")[0] if readme.is_file() else ""
    if first not in EXPORT_TITLES.values():
        raise ExportError(f"--out {out} is not empty and is not a previous gptlib export; choose an empty or new "
                          f"folder (--overwrite replaces only a previous export)")
    if not overwrite:
        raise ExportError(f"{out} holds a previous export; choose another --out or pass --overwrite to replace it")


def export_hf(run_dir: str | Path, out_dir: str | Path, checkpoint: str | int = "latest",
              overwrite: bool = False) -> Path:
    """Export one checkpoint of a run ("latest", "best" or a step) with its verified tokenizer."""
    check_export_target(Path(out_dir), overwrite, Path(run_dir))  # before reading gigabytes of weights
    ld = load_run(run_dir, checkpoint)
    info = {"run_dir": str(run_dir), "step": ld.step, "val_loss": ld.state.val_loss,
            "tokenizer": ld.tokenizer.kind}
    return export_model(ld.model, out_dir, ld.tokenizer, overwrite=overwrite, info=info)


def _model_card(model: GPT, info: dict) -> str:
    c, arch = model.config, native_arch(model.config)
    style, cls = {"gpt2": ("A GPT-2 style model", "GPT2LMHeadModel"), "qwen3": ("A Qwen3 architecture model",
                  "Qwen3ForCausalLM"), "llama": ("A Llama architecture model", "LlamaForCausalLM")}[arch]
    return "\n".join([
        EXPORT_TITLES[arch], "",
        f"{style} trained from scratch with gptlib: {c.n_layer} layers, {c.n_head} heads, "
        f"{c.n_embd} wide, context {c.block_size}, vocabulary {c.vocab_size}.", "",
        *([f"- {k}: {v}" for k, v in info.items()] + [""] if info else []),
        "```python",
        f"from transformers import AutoTokenizer, {cls}",
        "tok = AutoTokenizer.from_pretrained(PATH)",
        f"model = {cls}.from_pretrained(PATH)",
        "ids = tok(\"ROMEO:\", return_tensors=\"pt\").input_ids",
        "print(tok.decode(model.generate(ids, max_new_tokens=100, do_sample=True)[0]))",
        "```", "",
    ])


def export_hint(run_dir: str | Path, checkpoint: str = "best") -> str:
    """Notebook 04 without an export folder: what export is and where it would write (a dashboard user sees only
    this line)."""
    from gptlib import colab

    where = colab.setup().persistent / "exports" / Path(run_dir).name  # on Colab: on Drive, where it outlives the VM
    return (f"Not exported: no export folder is set. Export saves the {checkpoint!r} checkpoint as a Hugging Face "
            f"model folder (config.json, model.safetensors, tokenizer files) that transformers loads with "
            f"AutoModelForCausalLM.from_pretrained(folder). To export, set EXPORT_DIR in the notebook's parameters to a "
            f"folder, e.g. {where}, and run this cell again; or run: python -m gptlib export-hf --run-dir {run_dir} "
            f"--checkpoint {checkpoint} --out {where}")
