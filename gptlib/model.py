"""The GPT: GPT-2's architecture, or the modern recipe's parts (config.RECIPES), with SDPA attention and a KV cache.

Shapes: B batch, T time (tokens), C n_embd, H n_head, D head size (C // H), V the padded vocabulary.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlib.config import ModelConfig


class KVCache:  # every layer's keys and values so far, preallocated: a prompt is read once, then a token a step
    def __init__(self, cfg: ModelConfig, batch_size: int, device, dtype: torch.dtype):
        # (B, H, block_size, D)
        shape = (batch_size, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.pos = 0  # tokens cached: the position of the next one


RMS_EPS = 1e-6  # Llama's and Qwen3's RMSNorm eps: an export computes the same


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm that runs in its input's dtype on every torch version: under autocast a bf16 input met the fp32
    weight and missed the fused kernel (before torch 2.12, pytorch#167308) or came out fp32 (2.12, pytorch#188955).
    The weight cast to the input's dtype outside autocast takes the fused kernel; in fp32 this is nn.RMSNorm exactly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # CPU and CUDA autocast exist on every torch gptlib runs on (MPS's not before 2.5)
        kind = x.device.type
        with (
            torch.autocast(kind, enabled=False)
            if kind in ("cpu", "cuda")
            else contextlib.nullcontext()
        ):
            return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


def norm(cfg: ModelConfig, dim: int) -> nn.Module:
    return RMSNorm(dim, eps=RMS_EPS) if cfg.norm == "rmsnorm" else nn.LayerNorm(dim, bias=cfg.bias)


# Llama's and Qwen3's rotate-half layout
def rotary_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    D = cfg.n_embd // cfg.n_head
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))  # (D/2,)
    # (block_size, D/2)
    angles = torch.outer(torch.arange(cfg.block_size, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)  # (block_size, D)
    return angles.cos(), angles.sin()


# x (B, H, T, D), cos/sin (T, D)
def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated_half * sin).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.qk_norm = cfg.qk_norm
        # each head's queries and keys RMS-normalised (Qwen3): the attention logits stay bounded
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.n_embd // cfg.n_head, eps=RMS_EPS)
            self.k_norm = RMSNorm(cfg.n_embd // cfg.n_head, eps=RMS_EPS)

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        # (B, H, T, D)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # cos, sin (T, D) at the new tokens' positions
            q, k = rotate(q, *rope), rotate(k, *rope)
        if cache is None:  # is_causal lets SDPA pick a flash kernel without building a mask
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        else:  # T new tokens after `start` cached ones: query i sees the cache and the new keys up to itself
            start = cache.pos
            cache.k[layer][:, :, start : start + T] = k
            cache.v[layer][:, :, start : start + T] = v
            # (T, start+T)
            mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
            y = F.scaled_dot_product_attention(
                q,
                cache.k[layer][:, :, : start + T],
                cache.v[layer][:, :, : start + T],
                attn_mask=mask,
            )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, H, T, D) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))


# GELU over 4C (GPT-2), or SwiGLU (Llama, Qwen3): gate and up each ~8C/3 wide, as many params
class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        self.c_fc = nn.Linear(cfg.n_embd, (2 if self.swiglu else 1) * cfg.mlp_hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.mlp_hidden, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)  # (B, T, hidden), SwiGLU (B, T, 2 * hidden)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            # GPT-2's GELU, so an export computes what transformers does
            h = F.gelu(h, approximate="tanh")
        return self.dropout(self.c_proj(h))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = norm(cfg, cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = norm(cfg, cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0, rope=None
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer, rope)
        return x + self.mlp(self.ln_2(x))


@dataclass(frozen=True)
class ModelSize:
    params: int  # every parameter, as model.parameters() counts them (a tied embedding once)
    # the weights that multiply activations: every Linear's, the output head's tied or not
    matmul_params: int
    # training FLOPs per token of the matmuls and attention (forward + backward)
    flops_per_token: int


def model_size(cfg: ModelConfig) -> ModelSize:
    """The GPT that cfg builds, counted without building it (MFU, the memory estimate, the plans). FLOPs as PaLM's
    appendix B and nanoGPT count them, so MFU compares with theirs: 6 per matmul weight per token, plus attention's
    12 * n_layer * n_embd * block_size (a causal kernel skips half of that: the count is about 8% high at
    gpt2-small)."""
    C, L, V, T = cfg.n_embd, cfg.n_layer, cfg.padded_vocab_size, cfg.block_size
    b = int(cfg.bias)
    # swiglu: c_fc holds gate and up
    fc_out = 2 * cfg.mlp_hidden if cfg.mlp == "swiglu" else cfg.mlp_hidden
    # c_attn, attn.c_proj, c_fc, mlp.c_proj
    block_matmuls = C * 3 * C + C * C + C * fc_out + cfg.mlp_hidden * C
    block_biases = b * (3 * C + C + fc_out + C)
    # a gain; LayerNorm's bias with bias=True
    norm_params = C * (1 if cfg.norm == "rmsnorm" else 1 + b)
    qk_norms = 2 * (C // cfg.n_head) if cfg.qk_norm else 0
    matmul = L * block_matmuls + V * C  # the head: wte's weight when tied
    embeddings = (0 if cfg.tie_embeddings else V * C) + (T * C if cfg.positions == "learned" else 0)
    # + ln_f
    params = matmul + embeddings + L * (block_biases + 2 * norm_params + qk_norms) + norm_params
    return ModelSize(params, matmul, 6 * matmul + 12 * L * C * T)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        parts = dict(wte=nn.Embedding(cfg.padded_vocab_size, cfg.n_embd))
        if cfg.positions == "learned":
            parts["wpe"] = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.transformer = nn.ModuleDict(
            dict(
                **parts,
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=norm(cfg, cfg.n_embd),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight  # tied input/output embeddings
        if cfg.positions == "rope":  # derived from the config: not parameters, not saved
            cos, sin = rotary_tables(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            residual = name.endswith("c_proj.weight")
            if residual:  # GPT-2: two residual additions per block, scaled so the stream's variance does not grow
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
            if cfg.zero_init and (
                residual or (name == "lm_head.weight" and not cfg.tie_embeddings)
            ):
                # each block starts as the identity, the untied head uniform (modded-nanogpt)
                nn.init.zeros_(p)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def hidden_states(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T = idx.shape  # with a cache, only the new tokens
        start = cache.pos if cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(
                f"sequence of {start + T} tokens exceeds block_size={self.config.block_size}; "
                f"crop the context (generation shifts the window for you)"
            )
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.wte(idx)  # (B, T, C)
        rope = None
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(pos)
        else:
            rope = (self.rope_cos[pos], self.rope_sin[pos])  # 2 x (T, D)
        x = self.transformer.drop(x)
        for i, block in enumerate(self.transformer.h):
            x = block(x, cache, i, rope)
        if cache is not None:
            cache.pos += T
        return x  # (B, T, C): the last block's output

    def head(self, h: torch.Tensor) -> torch.Tensor:
        # (..., C) -> (..., vocab_size): the padding rows are never a token
        return self.lm_head(self.transformer.ln_f(h))[..., : self.config.vocab_size]

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.head(self.hidden_states(idx, cache))  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            # Target -1 is ignored (chat data's non-assistant tokens). Summed and divided here, not
            # reduction="mean", so a window with no answer in it gives 0, not 0/0 = NaN.
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1, reduction="sum"
            ) / (targets != -1).sum().clamp(min=1)
        return logits, loss
