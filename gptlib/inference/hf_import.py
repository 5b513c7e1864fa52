"""import-hf: a transformers GPT-2, Qwen3 or Llama that gptlib's GPT computes exactly, as a run directory with one
weights-only checkpoint (step 0); any other model is refused, naming what differs."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from gptlib.checkpoint.format import TrainState, load_weights_into, remove_tree, save_checkpoint
from gptlib.config import ModelConfig, RunConfig, get_preset
from gptlib.data.tokenizer import BPETokenizer, CharTokenizer
from gptlib.errors import ExportError
from gptlib.fsutil import atomic_write_bytes, atomic_write_json, replace
from gptlib.inference.export import check_export_target, is_conv1d, weight_map
from gptlib.layout import CONFIG_FILE, PARTIAL_MARKER, TOKENIZER_FILE, checkpoints_dir
from gptlib.model import GPT, model_size

# What gptlib's GPT-2 computes (the usual value first); a config saying otherwise describes another model.
GPT2_SHAPE = {
    "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
    "scale_attn_weights": (True,),
    "scale_attn_by_inverse_layer_idx": (False,),
    "reorder_and_upcast_attn": (False,),
    "layer_norm_epsilon": (1e-5,),
    "tie_word_embeddings": (True,),
}


def model_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    try:
        c = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}: cannot be read ({e})") from None
    if not isinstance(c, dict):
        raise ExportError(f"{path}: not a JSON object (a model's config.json is one)")
    kind = c.get("model_type")
    if kind in ("qwen3", "llama"):
        return _llama_config(c, str(path))
    if kind != "gpt2":
        raise ExportError(
            f"{path}: model_type is {kind!r} (architectures {c.get('architectures')}), not 'gpt2', "
            f"'qwen3' or 'llama': gptlib's GPT is GPT-2's architecture or the modern recipe's"
        )
    _numbers(c, str(path), "vocab_size", "n_layer", "n_head", "n_embd")
    shape = {k: (c.get(k, allowed[0]), *allowed) for k, allowed in GPT2_SHAPE.items()}
    _refuse_unless(path, {"n_inner": (c.get("n_inner"), 4 * c["n_embd"], None), **shape})
    return ModelConfig(
        vocab_size=c["vocab_size"],
        block_size=c.get("n_positions", c.get("n_ctx", 1024)),
        n_layer=c["n_layer"],
        n_head=c["n_head"],
        n_embd=c["n_embd"],
        dropout=0.0,
        bias=True,
    )


def _numbers(c: dict, where: str, *keys: str) -> None:
    for key in keys:
        if not isinstance(c.get(key), int):
            raise ExportError(f"{where}: {key} is missing or not a number ({c.get(key)!r})")


def _llama_config(c: dict, where: str) -> ModelConfig:
    """Refused by name: grouped-query attention, rope scaling, biases, another activation or head size."""
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    _numbers(c, where, *sizes, "num_attention_heads")
    heads, rope = c["num_attention_heads"], c.get("rope_parameters") or {}
    _refuse_unless(
        where,
        {
            "num_key_value_heads": (c.get("num_key_value_heads", heads), heads),
            "head_dim": (c.get("head_dim", c["hidden_size"] // heads), c["hidden_size"] // heads),
            "hidden_act": (c.get("hidden_act", "silu"), "silu"),
            "attention_bias": (c.get("attention_bias", False), False),
            "mlp_bias": (c.get("mlp_bias", False), False),
            "rope_scaling": (c.get("rope_scaling"), None),
            "rope_type": (rope.get("rope_type", "default"), "default"),
        },
    )
    cfg = ModelConfig(
        vocab_size=c["vocab_size"],
        block_size=c.get("max_position_embeddings", 2048),
        n_layer=c["num_hidden_layers"],
        n_head=heads,
        n_embd=c["hidden_size"],
        dropout=0.0,
        positions="rope",
        norm="rmsnorm",
        qk_norm=c.get("model_type") == "qwen3",
        mlp="swiglu",
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        bias=False,
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
    )
    if cfg.mlp_hidden != c["intermediate_size"]:
        raise ExportError(
            f"{where}: intermediate_size is {c['intermediate_size']}; gptlib's SwiGLU MLP of width "
            f"{cfg.n_embd} has {cfg.mlp_hidden}"
        )
    return cfg


def _refuse_unless(where, checks: dict[str, tuple]) -> None:
    """checks: key -> (the config's value, *what gptlib computes)."""
    for key, (got, *allowed) in checks.items():
        if got not in allowed:
            raise ExportError(f"{where}: {key} is {got!r}; gptlib's model needs {allowed[0]!r}")


def gptlib_state_dict(
    hf: dict[str, torch.Tensor], cfg: ModelConfig, where: str
) -> dict[str, torch.Tensor]:
    """export.weight_map the other way, the embeddings padded."""
    V, sd = cfg.vocab_size, {}
    # a config.json with fewer layers than the weights hold (hand-edited) would leave the rest out unseen
    layer_of = {
        k: int(m[1]) for k in hf if (m := re.match(r"(?:transformer\.h|model\.layers)\.(\d+)\.", k))
    }
    if unused := [k for k, i in layer_of.items() if i >= cfg.n_layer]:
        key = "n_layer" if cfg.positions == "learned" else "num_hidden_layers"
        raise ExportError(
            f"{where}: weight {unused[0]!r} and {len(unused) - 1} more are unused: config.json says "
            f"{key}={cfg.n_layer}, the weights hold {max(layer_of.values()) + 1} layers"
        )
    for ours, theirs in weight_map(cfg):
        if missing := [t for t in theirs if t not in hf]:
            raise ExportError(f"{where}: weight {missing[0]!r} is missing")
        w = torch.cat([hf[t] for t in theirs])
        if is_conv1d(cfg, ours):
            w = w.t().contiguous()  # Conv1D (in, out) -> (out, in)
        if ours in ("transformer.wte.weight", "lm_head.weight"):
            w = torch.cat([w[:V], w.new_zeros(cfg.padded_vocab_size - V, w.shape[1])])
        sd[ours] = w
    if cfg.tie_embeddings:
        wte = sd["lm_head.weight"] = sd["transformer.wte.weight"]
        if "lm_head.weight" in hf and not torch.equal(hf["lm_head.weight"][:V], wte[:V]):
            raise ExportError(
                f"{where}: lm_head.weight differs from the input embedding; gptlib ties them"
            )
    return sd


def import_hf(name_or_dir: str | Path, out: str | Path, log=print) -> Path:
    out = Path(out)
    # the same rule: never into a run, data or other folder
    check_export_target(out, overwrite=None)
    folder = Path(name_or_dir)
    if not folder.is_dir():  # a Hub id, downloaded once into the Hugging Face cache
        try:
            from huggingface_hub import snapshot_download

            wanted = ["config.json", "model.safetensors", "tokenizer.json"]
            folder = Path(snapshot_download(repo_id=str(name_or_dir), allow_patterns=wanted))
        except Exception as e:  # noqa: BLE001 - offline, unknown id, gated: one message either way
            raise ExportError(
                f"--model {name_or_dir}: not a local folder, and not downloadable from the Hugging "
                f"Face Hub ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); give "
                f"a folder holding config.json and model.safetensors"
            ) from None
    cfg, tj = model_config(folder), folder / "tokenizer.json"
    if not tj.is_file():
        raise ExportError(
            f"{folder}: no tokenizer.json (save a fast tokenizer with transformers' save_pretrained)"
        )
    raw = tj.read_bytes()
    # a gptlib char export's comes back as a CharTokenizer; a file that is not JSON is from_json_bytes' to refuse
    try:
        spec = json.loads(raw)["model"]
        chars = spec["type"] == "WordLevel" and all(len(t) == 1 for t in spec["vocab"])
    except (ValueError, KeyError, TypeError):
        chars = False
    if chars:
        tok = CharTokenizer([c for c, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1])])
    else:
        tok = BPETokenizer.from_json_bytes(raw, where=str(tj))
    if tok.vocab_size != cfg.vocab_size:
        raise ExportError(
            f"{folder}: the tokenizer has {tok.vocab_size} tokens but config.json says vocab_size="
            f"{cfg.vocab_size}"
        )
    model, weights = GPT(cfg), folder / "model.safetensors"
    if not weights.is_file():
        raise ExportError(
            f"{folder}: no model.safetensors (save the model with transformers' save_pretrained)"
        )
    # a file cut off (a download or Drive copy), empty or not safetensors: the library's reason, in one line
    try:
        loaded = load_file(str(weights))
    except SafetensorError as e:
        raise ExportError(
            f"{weights} is not a readable safetensors file ({e}): copy or download it again"
        ) from None
    # fp32; GPT2Model's files (as OpenAI's on the Hub) lack GPT2LMHeadModel's "transformer." prefix: it is added
    own = ("transformer.", "model.", "lm_head.")
    hf = {(k if k.startswith(own) else "transformer." + k): v.float() for k, v in loaded.items()}
    load_weights_into(model, gptlib_state_dict(hf, cfg, str(folder)), folder)
    recipe = "gpt2" if cfg.positions == "learned" else "modern"
    run_cfg = RunConfig(
        model=cfg, train=get_preset("finetune", recipe).train, preset="imported", recipe=recipe
    )
    identity = dict(tok.identity(), file=TOKENIZER_FILE)
    state = TrainState(
        config=run_cfg.to_dict(), tokenizer=identity, init_from={"model": str(name_or_dir)}
    )
    # built beside `out`, renamed into place when whole: an import cut off (a Colab disconnect) leaves no half-made
    # run that a re-run would take for an imported one; what an earlier cut-off import left goes first (Drive: emptied)
    for left in out.parent.glob(f"{out.name}{PARTIAL_MARKER}*"):
        remove_tree(left, truncate=True)
    work = out.with_name(f"{out.name}{PARTIAL_MARKER}{uuid.uuid4().hex[:8]}")
    work.mkdir(parents=True)
    # weights only: a run started from it (--init-from) trains with a fresh optimizer
    save_checkpoint(
        checkpoints_dir(work), {"model": model.state_dict(), "progress": state.state_dict()}
    )
    atomic_write_json(work / CONFIG_FILE, run_cfg.to_dict())
    atomic_write_bytes(work / TOKENIZER_FILE, tok.to_json_bytes())
    replace(work, out)  # onto nothing, or an empty folder (check_export_target)
    log(
        f"imported {name_or_dir} ({model_size(cfg).params / 1e6:.1f}M parameters, {cfg.n_layer} layers, {cfg.n_embd} "
        f"wide, context {cfg.block_size}, vocab {cfg.vocab_size}, {tok.kind} tokenizer) -> {out}"
    )
    return out
