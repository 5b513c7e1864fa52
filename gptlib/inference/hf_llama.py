"""The modern recipe's model as a native Hugging Face architecture, both ways (export-hf, import-hf).

With QK-norm it is Qwen3 (Qwen3ForCausalLM), without it Llama (LlamaForCausalLM): rotary positions in the
rotate-half layout, RMSNorm (eps 1e-6) before attention and MLP, a SiLU-gated MLP, no biases, tied or untied
embeddings. transformers loads both without trust_remote_code. The mapping:

    transformer.wte / lm_head             model.embed_tokens / lm_head (padding rows dropped)
    h.i.ln_1, ln_2 / transformer.ln_f     layers.i.input_layernorm, post_attention_layernorm / model.norm
    h.i.attn.c_attn (3C, C)               layers.i.self_attn.q_proj, k_proj, v_proj (C, C) each
    h.i.attn.q_norm, k_norm, c_proj       layers.i.self_attn.q_norm, k_norm (Qwen3), o_proj
    h.i.mlp.c_fc (2H, C)                  layers.i.mlp.gate_proj, up_proj (H, C) each
    h.i.mlp.c_proj                        layers.i.mlp.down_proj

A part no native architecture has (ReLU², the logit soft cap, biases, learned positions with RMSNorm, ...) is
refused by name (`native_arch`).
"""

from __future__ import annotations

import torch

from gptlib.config import ModelConfig
from gptlib.errors import ExportError

GPT2_PARTS = dict(positions="learned", norm="layernorm", qk_norm=False, mlp="gelu", tie_embeddings=True)
LLAMA_PARTS = dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False)


def native_arch(cfg: ModelConfig) -> str:
    """"gpt2", "qwen3" or "llama": the transformers architecture that computes exactly this model; else ExportError
    naming the fields that keep it from the nearest one."""
    if all(getattr(cfg, k) == v for k, v in GPT2_PARTS.items()):
        return "gpt2"
    off = {k: getattr(cfg, k) for k, v in LLAMA_PARTS.items() if getattr(cfg, k) != v}
    if off:
        wanted = ", ".join(f"{k}={LLAMA_PARTS[k]!r}" for k in off)
        raise ExportError(f"this model has {', '.join(f'{k}={v!r}' for k, v in off.items())}, which no native Hugging "
                          f"Face architecture has (the nearest, Qwen3/Llama, needs {wanted}); train with those "
                          f"settings to export, or use the run with gptlib (sample, chat, eval)")
    return "qwen3" if cfg.qk_norm else "llama"


def llama_config(cfg: ModelConfig, arch: str, bos_id: int, eos_id: int) -> dict:
    """config.json of a Qwen3ForCausalLM / LlamaForCausalLM with this model's shape."""
    head = cfg.n_embd // cfg.n_head
    return {
        "architectures": ["Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM"], "model_type": arch,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd, "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_head,
        "head_dim": head, "hidden_act": "silu", "max_position_embeddings": cfg.block_size, "rms_norm_eps": 1e-6,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": "float32", "use_cache": True,
    }


def llama_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our weights (fp32 state dict) under Qwen3's / Llama's names (see the module docstring)."""
    C, V, H = cfg.n_embd, cfg.vocab_size, cfg.mlp_hidden
    out = {"model.embed_tokens.weight": sd["transformer.wte.weight"][:V],
           "model.norm.weight": sd["transformer.ln_f.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"][:V]
    for i in range(cfg.n_layer):
        p, q = f"transformer.h.{i}.", f"model.layers.{i}."
        out[q + "input_layernorm.weight"] = sd[p + "ln_1.weight"]
        out[q + "post_attention_layernorm.weight"] = sd[p + "ln_2.weight"]
        for name, w in zip(("q_proj", "k_proj", "v_proj"), sd[p + "attn.c_attn.weight"].split(C)):
            out[q + f"self_attn.{name}.weight"] = w
        out[q + "self_attn.o_proj.weight"] = sd[p + "attn.c_proj.weight"]
        if cfg.qk_norm:
            out[q + "self_attn.q_norm.weight"] = sd[p + "attn.q_norm.weight"]
            out[q + "self_attn.k_norm.weight"] = sd[p + "attn.k_norm.weight"]
        out[q + "mlp.gate_proj.weight"], out[q + "mlp.up_proj.weight"] = sd[p + "mlp.c_fc.weight"].split(H)
        out[q + "mlp.down_proj.weight"] = sd[p + "mlp.c_proj.weight"]
    return {k: v.contiguous().clone() for k, v in out.items()}


def model_config_from_llama(c: dict, where: str) -> ModelConfig:
    """A Qwen3 / Llama config.json as the modern recipe's ModelConfig; what gptlib's model cannot compute is refused
    by name (grouped-query attention, rope scaling, biases, another activation or head size)."""
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(c.get(key), int):
            raise ExportError(f"{where}: {key} is missing or not a number ({c.get(key)!r})")
    heads = c["num_attention_heads"]
    checks = {"num_key_value_heads": (c.get("num_key_value_heads", heads), heads),
              "head_dim": (c.get("head_dim", c["hidden_size"] // heads), c["hidden_size"] // heads),
              "hidden_act": (c.get("hidden_act", "silu"), "silu"),
              "attention_bias": (c.get("attention_bias", False), False),
              "mlp_bias": (c.get("mlp_bias", False), False), "rope_scaling": (c.get("rope_scaling"), None)}
    rope = c.get("rope_parameters") or {}
    checks["rope_type"] = (rope.get("rope_type", "default"), "default")
    for key, (got, want) in checks.items():
        if got != want:
            raise ExportError(f"{where}: {key} is {got!r}; gptlib's model needs {want!r}")
    cfg = ModelConfig(vocab_size=c["vocab_size"], block_size=c.get("max_position_embeddings", 2048),
                      n_layer=c["num_hidden_layers"], n_head=heads, n_embd=c["hidden_size"], dropout=0.0,
                      positions="rope", norm="rmsnorm", qk_norm=c.get("model_type") == "qwen3", mlp="swiglu",
                      tie_embeddings=bool(c.get("tie_word_embeddings", False)), bias=False,
                      rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))))
    if cfg.mlp_hidden != c["intermediate_size"]:
        raise ExportError(f"{where}: intermediate_size is {c['intermediate_size']}; gptlib's SwiGLU MLP of width "
                          f"{cfg.n_embd} has {cfg.mlp_hidden}")
    return cfg


def state_dict_from_llama(hf: dict[str, torch.Tensor], cfg: ModelConfig, where: str) -> dict[str, torch.Tensor]:
    """Qwen3's / Llama's weights under gptlib's names (the inverse of llama_state_dict), embeddings padded."""
    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ExportError(f"{where}: weight {name!r} is missing")
        return hf[name].float()

    def padded(w: torch.Tensor) -> torch.Tensor:
        rows = torch.zeros(cfg.padded_vocab_size, cfg.n_embd)
        rows[: cfg.vocab_size] = w[: cfg.vocab_size]
        return rows

    wte = padded(take("model.embed_tokens.weight"))
    sd = {"transformer.wte.weight": wte, "transformer.ln_f.weight": take("model.norm.weight"),
          "lm_head.weight": wte if cfg.tie_embeddings else padded(take("lm_head.weight"))}
    for i in range(cfg.n_layer):
        p, q = f"transformer.h.{i}.", f"model.layers.{i}."
        sd[p + "ln_1.weight"] = take(q + "input_layernorm.weight")
        sd[p + "ln_2.weight"] = take(q + "post_attention_layernorm.weight")
        qkv = [take(q + f"self_attn.{n}.weight") for n in ("q_proj", "k_proj", "v_proj")]
        sd[p + "attn.c_attn.weight"] = torch.cat(qkv)
        sd[p + "attn.c_proj.weight"] = take(q + "self_attn.o_proj.weight")
        if cfg.qk_norm:
            sd[p + "attn.q_norm.weight"] = take(q + "self_attn.q_norm.weight")
            sd[p + "attn.k_norm.weight"] = take(q + "self_attn.k_norm.weight")
        sd[p + "mlp.c_fc.weight"] = torch.cat([take(q + "mlp.gate_proj.weight"), take(q + "mlp.up_proj.weight")])
        sd[p + "mlp.c_proj.weight"] = take(q + "mlp.down_proj.weight")
    return sd
