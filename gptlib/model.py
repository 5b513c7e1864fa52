"""The GPT: GPT-2's architecture, or the modern recipe's parts, with SDPA attention and an optional KV cache.

Each part of the modern recipe is a ModelConfig field of its own (config.RECIPES): rotary positions, RMSNorm,
QK-norm, a ReLU² or SwiGLU MLP, untied embeddings, zero-initialised output projections, soft-capped logits. The
gpt2 recipe's defaults build exactly the GPT-2 model of every earlier gptlib run: same modules, same init order.

Shapes: B batch, T time (tokens), C n_embd, H n_head, D head size (C // H), V padded vocab.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlib.config import ModelConfig

# Matrix-vector products on the CPU: MKL runs x @ W.T for a handful of rows (decoding: one token
# per sequence) on a single thread at about half the memory bandwidth, and decoding is bound by
# reading the weights. Cut W's rows into one block per thread and let bmm run the blocks in
# parallel: same fp32 arithmetic (each output is the same dot product), ~1.9x tokens/s on 2 cores.
# Measured up to 64 rows, i.e. batched decoding of up to 64 streams (benchmarks/linear_rows_bench.py,
# raw output in benchmarks/results/linear_rows_cpu.txt); longer prefills stay on MKL's gemm.
SPLIT_ROWS_MAX = 64


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocks: int) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as `blocks` independent row blocks of weight.

    x (..., K), weight (N, K) with N divisible by blocks -> (..., N).
    """
    N, K = weight.shape
    x2 = x.reshape(-1, K)  # (R, K), R rows
    R = x2.size(0)
    w = weight.view(blocks, N // blocks, K).transpose(1, 2)  # (blocks, K, N/blocks), a view
    xb = x2.expand(blocks, R, K)  # the same rows for every block, no copy
    if bias is None:
        y = torch.bmm(xb, w)  # (blocks, R, N/blocks)
    else:
        y = torch.baddbmm(bias.view(blocks, 1, N // blocks), xb, w)
    return y.transpose(0, 1).reshape(*x.shape[:-1], N)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) with a faster path for a few rows on the CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        few_rows_on_cpu = x.device.type == "cpu" and x.numel() <= SPLIT_ROWS_MAX * self.in_features
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if few_rows_on_cpu and not needs_grad and not torch.compiler.is_compiling():
            blocks = _row_blocks(self.out_features)
            if blocks > 1:
                return split_linear(x, self.weight, self.bias, blocks)
        return F.linear(x, self.weight, self.bias)


def _row_blocks(n_rows: int) -> int:
    """One block per thread (fewer if n_rows does not divide evenly)."""
    blocks = torch.get_num_threads()
    while n_rows % blocks:
        blocks -= 1
    return blocks


class KVCache:
    """Preallocated keys/values for incremental decoding: prefill once, then one token per step.

    static=True is the form a compiled decode step (torch.compile, CUDA graphs) needs: every step
    has the same shapes. The new tokens' positions come in as a tensor, keys are written at those
    positions, and attention spans the whole cache under a mask (keys after a query's position are
    empty or stale). It reads the whole cache every step, so the eager default is dynamic.
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, device, dtype: torch.dtype, max_len: int | None = None,
                 static: bool = False):
        self.max_len = max_len or cfg.block_size
        self.static = static
        head = cfg.n_embd // cfg.n_head
        shape = (batch_size, cfg.n_head, self.max_len, head)  # (B, H, Tmax, D)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.key_pos = torch.arange(self.max_len, device=device)  # (Tmax,) the position of each cache slot
        if static:
            # Fixed addresses: CUDA graphs may then update the cache in place instead of skipping the graph.
            for t in (*self.k, *self.v, self.key_pos):
                torch._dynamo.mark_static_address(t)
        self.pos = 0  # tokens already cached (the position of the next token); kept by the caller if static

    def reset(self) -> None:
        self.pos = 0


RMS_EPS = 1e-6  # Llama's and Qwen3's RMSNorm eps: an export computes the same


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (the same weight, the same state dict) that runs in its input's dtype on every torch version.

    Under autocast a bf16 activation (the QK-norm's queries and keys) met the fp32 weight: before torch 2.12 that
    misses the fused kernel for a ~8-kernel fallback (pytorch#167308); from 2.12 CUDA autocast runs rms_norm in fp32
    whatever the dtypes, so the norm hands on fp32 (pytorch#188955). The weight cast to the input's dtype, outside
    autocast, takes the fused kernel (it accumulates in fp32 itself) and returns the input's dtype. In fp32 this
    is exactly nn.RMSNorm's own call.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type  # CPU and CUDA autocast exist on every torch gptlib runs on (MPS's not before 2.5)
        with torch.autocast(kind, enabled=False) if kind in ("cpu", "cuda") else contextlib.nullcontext():
            return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


def norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """LayerNorm (GPT-2) or RMSNorm (no mean, no bias)."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, eps=RMS_EPS)
    return nn.LayerNorm(dim, bias=cfg.bias)


def rotary_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (block_size, D) of rotary embeddings in the rotate-half layout that Llama/Qwen3 use."""
    D = cfg.n_embd // cfg.n_head
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))  # (D/2,)
    angles = torch.outer(torch.arange(cfg.block_size, dtype=torch.float32), inv_freq)  # (block_size, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (block_size, D)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D) rotated by its positions' angles: cos, sin (T, D)."""
    half = x.size(-1) // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated_half * sin).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.dropout = cfg.dropout
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        if cfg.qk_norm:  # each head's queries and keys RMS-normalised (Qwen3): attention logits stay bounded
            self.q_norm = RMSNorm(cfg.n_embd // cfg.n_head, eps=RMS_EPS)
            self.k_norm = RMSNorm(cfg.n_embd // cfg.n_head, eps=RMS_EPS)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
                pos: torch.Tensor | None = None, rope: tuple | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # rope: cos, sin (T, D) at the new tokens' positions
            q, k = rotate(q, *rope), rotate(k, *rope)
        if cache is None:
            # SDPA picks flash / memory-efficient kernels on GPU; is_causal avoids materialising a mask.
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        elif cache.static:
            cache.k[layer].index_copy_(2, pos, k)  # pos (T,): where the new tokens go
            cache.v[layer].index_copy_(2, pos, v)
            visible = pos[:, None] >= cache.key_pos[None, :]  # (T, Tmax): causal, and hides unwritten slots
            y = F.scaled_dot_product_attention(q, cache.k[layer], cache.v[layer], attn_mask=visible)
        else:
            start = cache.pos
            cache.k[layer][:B, :, start : start + T] = k
            cache.v[layer][:B, :, start : start + T] = v
            k_all = cache.k[layer][:B, :, : start + T]  # (B, H, start+T, D)
            v_all = cache.v[layer][:B, :, : start + T]
            if T == 1:
                y = F.scaled_dot_product_attention(q, k_all, v_all)  # one new token sees everything cached
            elif start == 0:
                y = F.scaled_dot_product_attention(q, k_all, v_all, is_causal=True)
            else:
                # A chunk after cached tokens: query i may see cached keys and chunk keys up to i.
                mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
                y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """gelu (GPT-2, hidden 4C), relu2 (ReLU squared, 4C) or swiglu (SiLU-gated as Llama/Qwen3: c_fc holds the gate
    and the up projection, hidden ModelConfig.mlp_hidden, about 8C/3 so the parameters match 4C)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.mlp
        hidden = cfg.mlp_hidden
        self.c_fc = Linear(cfg.n_embd, 2 * hidden if cfg.mlp == "swiglu" else hidden, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU, so exported weights match transformers
        self.c_proj = Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.kind == "relu2":
            h = F.relu(h).square()
        else:
            h = self.gelu(h)
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = norm(cfg, cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = norm(cfg, cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
                pos: torch.Tensor | None = None, rope: tuple | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer, pos, rope)
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass(frozen=True)
class ModelSize:
    params: int  # every parameter, as model.parameters() counts them (a tied embedding once)
    matmul_params: int  # the weights that multiply activations: every Linear's, the output head's tied or not
    flops_per_token: int  # training FLOPs per token of the matmuls and attention (forward + backward)


def model_size(cfg: ModelConfig) -> ModelSize:
    """The GPT that cfg builds, counted from the config alone (no model made): parameters and training FLOPs per
    token, the one count MFU, compile=auto, the memory estimate and the benchmarks use.

    FLOPs are those of the matmuls, as PaLM's appendix B counts them: 6 per matmul weight per token (2 forward, 4
    backward), the input embedding being a lookup and the position embedding an addition (not counted; the output
    head is a matmul, tied or not), plus attention's 12 * n_layer * n_embd * T with T = block_size: the full
    context, as PaLM and nanoGPT count it, so MFU compares with theirs (a causal kernel skips the masked half of
    that work, so the figure is a little high on the attention's share, at gpt2-small 15% of the total).
    """
    C, L, V, T = cfg.n_embd, cfg.n_layer, cfg.padded_vocab_size, cfg.block_size
    b = int(cfg.bias)
    fc_out = 2 * cfg.mlp_hidden if cfg.mlp == "swiglu" else cfg.mlp_hidden  # swiglu: c_fc holds gate and up
    block_matmuls = C * 3 * C + C * C + C * fc_out + cfg.mlp_hidden * C  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    block_biases = b * (3 * C + C + fc_out + C)
    norm_params = C * (1 if cfg.norm == "rmsnorm" else 1 + b)  # a gain; LayerNorm's bias with bias=True
    qk_norms = 2 * (C // cfg.n_head) if cfg.qk_norm else 0
    matmul = L * block_matmuls + V * C  # the head: wte's weight when tied
    embeddings = (0 if cfg.tie_embeddings else V * C) + (T * C if cfg.positions == "learned" else 0)
    params = matmul + embeddings + L * (block_biases + 2 * norm_params + qk_norms) + norm_params  # + ln_f
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
        self.lm_head = Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight  # tied input/output embeddings
        if cfg.positions == "rope":  # not parameters, not saved: derived from the config
            cos, sin = rotary_tables(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer) so the residual stream's
        # variance does not grow with depth (two residual additions per block).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if cfg.zero_init:  # each block starts as the identity, the untied head predicts uniformly (modded-nanogpt)
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight") or (name == "lm_head.weight" and not cfg.tie_embeddings):
                    nn.init.zeros_(p)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def hidden_states(self, idx: torch.Tensor, cache: KVCache | None = None,
                      pos: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) token ids -> the last block's output (B, T, C), before ln_f.

        With a cache, idx holds only the new tokens; their positions continue from cache.pos, which advances by T.
        With a static cache the positions are given instead, as pos (T,) long (and cache.pos is left alone):
        reading a Python int would make a compiled step specialise on it and recompile every token.
        """
        B, T = idx.shape
        if cache is not None and cache.static:
            if pos is None or pos.shape != (T,):
                raise ValueError(f"a static KVCache needs the positions of the {T} new tokens as pos (T,), got {pos!r}")
        else:
            start = cache.pos if cache is not None else 0
            if start + T > self.config.block_size:
                raise ValueError(
                    f"sequence of {start + T} tokens exceeds block_size={self.config.block_size}; "
                    f"crop the context (generation slides the window for you)"
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
            x = block(x, cache, i, pos, rope)
        if cache is not None and not cache.static:
            cache.pos += T
        return x

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) token ids -> logits (B, T, vocab_size) and the mean cross-entropy if targets given.

        With a cache, idx holds only the new tokens; their positions continue from cache.pos.
        """
        logits = self.head(self.hidden_states(idx, cache), cut=False)  # (B, T, V padded)
        loss = None
        if targets is not None:
            # The mean over the targets that count (-1 = ignored: chat data's non-assistant tokens). Summed and
            # divided here, not reduction="mean", so a window with no answer in it gives 0, not 0/0 = NaN.
            targets = targets.reshape(-1)
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)).float()[:, : self.config.vocab_size],
                targets,
                ignore_index=-1,
                reduction="sum",
            ) / (targets != -1).sum().clamp(min=1)
        if logits.size(-1) != self.config.vocab_size:
            logits = logits[..., : self.config.vocab_size]  # padding rows never produce a token
        return logits, loss

    def head(self, h: torch.Tensor, cut: bool = True) -> torch.Tensor:
        """The last block's output (..., C) -> logits (..., V): ln_f, the output layer, the soft cap; cut: without the
        padding rows (they never produce a token)."""
        logits = self.lm_head(self.transformer.ln_f(h))
        cap = self.config.logit_softcap
        if cap:  # cap * tanh(logits / cap): smooth, bounded logits (Gemma 2, modded-nanogpt)
            logits = cap * torch.tanh(logits.float() / cap)
        return logits[..., : self.config.vocab_size] if cut else logits

    def configure_optimizer(
        self, weight_decay: float, learning_rate: float, betas: tuple[float, float], device_type: str
    ) -> torch.optim.AdamW:
        """AdamW with decay on 2-D weights only (matmuls, embeddings), fused on CUDA."""
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        fused = device_type == "cuda"
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)
