"""Sampling from a GPT: KV-cached decoding with temperature and top-k.

`generate_ids` is the engine used by training-time samples and the `sample` CLI.
"""

from __future__ import annotations

import torch

from .model import GPT, KVCache


@torch.no_grad()
def generate_ids(model: GPT, prompt_ids: list[int], max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> list[int]:
    """Continue one prompt; temperature 0 is greedy. Past block_size the window slides (re-prefill)."""
    cfg = model.config
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    ids = list(prompt_ids) or [0]
    cache = KVCache(cfg, 1, device, dtype)
    window = ids[-cfg.block_size:]
    logits, _ = model(torch.tensor([window], device=device), cache=cache)
    out = []
    for _ in range(max_new_tokens):
        next_logits = logits[0, -1].float()  # (V,)
        if temperature == 0:
            nxt = int(next_logits.argmax())
        else:
            next_logits = next_logits / temperature
            if top_k is not None and 0 < top_k < next_logits.numel():
                kth = torch.topk(next_logits, top_k).values[-1]
                next_logits = next_logits.masked_fill(next_logits < kth, float("-inf"))
            probs = torch.softmax(next_logits, dim=-1)
            nxt = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        out.append(nxt)
        ids.append(nxt)
        if cache.pos >= cfg.block_size:  # window full: re-prefill the last block_size - 1 tokens
            cache.reset()
            logits, _ = model(torch.tensor([ids[-(cfg.block_size - 1):]], device=device), cache=cache)
        else:
            logits, _ = model(torch.tensor([[nxt]], device=device), cache=cache)
    return out
