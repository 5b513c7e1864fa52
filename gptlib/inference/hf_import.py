"""Import a Hugging Face GPT2LMHeadModel (OpenAI's gpt2 or gpt2-medium from the Hub, or any local folder), or a
Qwen3 / Llama folder of the modern recipe's shape (gptlib.inference.hf_llama), as a gptlib run directory:

    python -m gptlib import-hf --model gpt2 --out runs/gpt2

The inverse of gptlib.inference.export: Conv1D weights (in, out) are transposed to Linear's (out, in); the
embedding is padded to a multiple of 64 rows (logits are cut back to vocab_size) and tied to the output layer. The
folder's tokenizer becomes the run's tokenizer.json (byte-level BPE with <|endoftext|>, or a char tokenizer that
gptlib exported). The run holds one checkpoint, step 0, without optimizer state: `sample`, `eval` and `export-hf`
work on it, and `train --init-from RUN_DIR` starts from its weights. A model that is not GPT-2 shaped (another
activation, attention scaling or architecture) is refused, naming what differs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gptlib.checkpoint.format import write_checkpoint
from gptlib.checkpoint.state import Checkpoint, TrainState
from gptlib.config import ModelConfig, RunConfig, get_preset
from gptlib.data.tokenizer import EOT, BPETokenizer, CharTokenizer, Tokenizer
from gptlib.errors import ExportError, HFImportError
from gptlib.fsutil import atomic_write_bytes, atomic_write_json
from gptlib.inference.export import GPT2_LINEARS, check_export_target
from gptlib.inference.hf_llama import model_config_from_llama, state_dict_from_llama
from gptlib.layout import CONFIG_FILE, TOKENIZER_FILE, checkpoints_dir
from gptlib.model import GPT, model_size

# What gptlib's GPT computes; a config saying otherwise describes another model.
GPT2_SHAPE = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "scale_attn_weights": (True,),
              "scale_attn_by_inverse_layer_idx": (False,), "reorder_and_upcast_attn": (False,),
              "layer_norm_epsilon": (1e-5,), "tie_word_embeddings": (True,)}
_HUB_FILES = ["config.json", "*.safetensors", "tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json",
              "special_tokens_map.json", "generation_config.json"]


def model_dir(name_or_dir: str | Path) -> Path:
    """A local folder as it is; otherwise a Hub model id, downloaded once into the Hugging Face cache."""
    p = Path(name_or_dir)
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=str(name_or_dir), allow_patterns=_HUB_FILES))
    except Exception as e:  # noqa: BLE001 - offline, unknown id, gated: one message either way
        raise HFImportError(f"--model {name_or_dir}: not a local folder, and not downloadable from the Hugging Face "
                            f"Hub ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); give a "
                            f"folder holding config.json and model.safetensors") from None


def model_config(folder: Path) -> ModelConfig:
    """gptlib's ModelConfig for a GPT2LMHeadModel config.json; HFImportError naming what is not GPT-2."""
    path = folder / "config.json"
    try:
        c = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HFImportError(f"{path}: cannot be read ({e})") from None
    kind = c.get("model_type")
    if kind in ("qwen3", "llama"):
        try:
            return model_config_from_llama(c, str(path))
        except ExportError as e:
            raise HFImportError(str(e)) from None
    if kind != "gpt2":
        raise HFImportError(f"{path}: model_type is {kind!r} (architectures {c.get('architectures')}), not 'gpt2', "
                            f"'qwen3' or 'llama': gptlib's GPT is GPT-2's architecture or the modern recipe's")
    for key, allowed in GPT2_SHAPE.items():
        got = c.get(key, allowed[0])
        if got not in allowed:
            raise HFImportError(f"{path}: {key} is {got!r}, gptlib's GPT-2 has {allowed[0]!r}")
    n_inner = c.get("n_inner")
    if n_inner not in (None, 4 * c["n_embd"]):
        raise HFImportError(f"{path}: n_inner is {n_inner}, gptlib's MLP is 4 x n_embd = {4 * c['n_embd']}")
    return ModelConfig(vocab_size=c["vocab_size"], block_size=c.get("n_positions", c.get("n_ctx", 1024)),
                       n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"], dropout=0.0, bias=True)


def hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's weights (model.safetensors, else pytorch_model.bin loaded safely), fp32, prefix-free."""
    st, pt = folder / "model.safetensors", folder / "pytorch_model.bin"
    if st.is_file():
        from safetensors.torch import load_file

        sd = load_file(str(st))
    elif pt.is_file():
        sd = torch.load(pt, map_location="cpu", weights_only=True)
    else:
        raise HFImportError(f"{folder}: no model.safetensors or pytorch_model.bin")
    return {k.removeprefix("transformer."): v.float() for k, v in sd.items()}


def gptlib_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig, where: str) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's weights under gptlib's names and layouts (the inverse of export.hf_state_dict)."""
    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise HFImportError(f"{where}: weight {name!r} is missing (not a GPT2LMHeadModel checkpoint?)")
        return hf[name]

    wte = take("wte.weight")
    padded = torch.zeros(cfg.padded_vocab_size, cfg.n_embd)
    padded[: cfg.vocab_size] = wte[: cfg.vocab_size]
    names = ["wpe.weight", "ln_f.weight", "ln_f.bias"] + [f"h.{i}.{part}.{w}" for i in range(cfg.n_layer)
                                                          for part in ("ln_1", "ln_2", *GPT2_LINEARS)
                                                          for w in ("weight", "bias")]
    sd = {"transformer." + k: take(k) for k in names}
    for i in range(cfg.n_layer):
        for lin in GPT2_LINEARS:
            k = f"transformer.h.{i}.{lin}.weight"
            sd[k] = sd[k].t().contiguous()  # Conv1D (in, out) -> (out, in)
    if "lm_head.weight" in hf and not torch.equal(hf["lm_head.weight"][: cfg.vocab_size], wte[: cfg.vocab_size]):
        raise HFImportError(f"{where}: lm_head.weight differs from wte.weight; gptlib ties them (GPT-2 does)")
    return {**sd, "transformer.wte.weight": padded, "lm_head.weight": padded}


def hf_tokenizer(folder: Path) -> Tokenizer:
    """tokenizer.json as a gptlib tokenizer (a gptlib char export comes back as a CharTokenizer); GPT-2's
    vocab.json + merges.txt when there is no tokenizer.json."""
    tj = folder / "tokenizer.json"
    if tj.is_file():
        raw = tj.read_bytes()
        model = json.loads(raw).get("model", {})
        if model.get("type") == "WordLevel" and all(len(t) == 1 for t in model.get("vocab", {})):
            chars = [c for c, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
            return CharTokenizer(chars)
        return BPETokenizer.from_json_bytes(raw, where=str(tj))
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        raise HFImportError(f"{folder}: no tokenizer.json, nor vocab.json + merges.txt")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    tk = HFTokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([EOT])
    return BPETokenizer(tk)


def import_hf(name_or_dir: str | Path, out: str | Path, log=print) -> Path:
    """Write a gptlib run directory (config, tokenizer, a step-0 checkpoint) for a GPT2LMHeadModel."""
    out = Path(out)
    try:
        check_export_target(out, overwrite=False)  # the same rule: never into a run, data or other folder
    except ExportError as e:
        raise HFImportError(str(e).replace("--out", "--out (import-hf)")) from None
    folder = model_dir(name_or_dir)
    cfg = model_config(folder)
    tok = hf_tokenizer(folder)
    if tok.vocab_size != cfg.vocab_size:
        raise HFImportError(f"{folder}: the tokenizer has {tok.vocab_size} tokens but config.json says vocab_size="
                            f"{cfg.vocab_size}")
    model = GPT(cfg)
    recipe = "gpt2" if cfg.positions == "learned" else "modern"
    try:
        weights = (gptlib_state_dict if recipe == "gpt2" else state_dict_from_llama)(hf_weights(folder), cfg, str(folder))
    except ExportError as e:
        raise HFImportError(str(e)) from None
    model.load_state_dict(weights)  # checks every shape
    run_cfg = RunConfig(model=cfg, train=get_preset("finetune", recipe).train, preset="imported", recipe=recipe)
    identity = dict(tok.identity(), file=TOKENIZER_FILE)
    state = TrainState(config=run_cfg.to_dict(), tokenizer=identity, init_from={"model": str(name_or_dir)})
    weights_only = Checkpoint(model=model.state_dict(), progress=state)  # no training state: resumes start fresh
    write_checkpoint(checkpoints_dir(out), 0, *weights_only.files())
    atomic_write_json(out / CONFIG_FILE, run_cfg.to_dict())
    atomic_write_bytes(out / TOKENIZER_FILE, tok.to_json_bytes())
    log(f"imported {name_or_dir} ({model_size(cfg).params / 1e6:.1f}M parameters, {cfg.n_layer} layers, {cfg.n_embd} "
        f"wide, context {cfg.block_size}, vocab {cfg.vocab_size}, {tok.kind} tokenizer) -> {out}")
    return out


def import_hf_once(model: str, roots=None) -> Path:
    """Notebook 05: the run import-hf makes of `model` in gptlib's persistent runs folder (Drive on Colab),
    imported the first time and reused after."""
    from gptlib import colab

    roots = roots or colab.setup()
    run_dir = roots.persistent / "runs" / ("hf-" + Path(model).name)
    if not checkpoints_dir(run_dir).is_dir():
        import_hf(model, run_dir)
    return run_dir
