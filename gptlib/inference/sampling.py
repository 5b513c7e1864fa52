"""How the next token is drawn from a batch of logits, on the device: the settings, and what a generation returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gptlib.errors import GenerationError


@dataclass
class SamplingConfig:
    max_new_tokens: int = 200  # tokens generated per prompt (a stop string or end-of-text may end it earlier)
    temperature: float = 0.8  # divides the logits; 0 = greedy (argmax), higher = more random
    top_k: int | None = None  # sample only among the k most likely tokens; None or 0 = no limit
    top_p: float | None = None  # nucleus: the fewest tokens whose probability sums to >= top_p; None or 1 = off
    repetition_penalty: float = 1.0  # > 1 makes tokens already in the context less likely (CTRL); 1 = off
    stop: list[str] = field(default_factory=list)  # a sequence ends when its text contains one of these (cut off)
    stop_at_eot: bool = True  # end a sequence at the tokenizer's end-of-text token (BPE), if it has one
    seed: int | None = None  # fixes the sampling RNG: same seed, weights and settings -> same text; None = random

    def validate(self) -> "SamplingConfig":
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 0")
        if not self.temperature >= 0:
            raise GenerationError(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise GenerationError(f"top_k={self.top_k!r} must be a positive integer (or None/0 for no limit)")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise GenerationError(f"top_p={self.top_p!r} must be in (0, 1] (or None for off)")
        if not self.repetition_penalty > 0:
            raise GenerationError(f"repetition_penalty={self.repetition_penalty!r} must be > 0 (1 = off)")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise GenerationError(f"stop={self.stop!r}: stop strings must be non-empty strings")
        return self


@dataclass
class Completion:
    prompt: str  # the prompt text ("" when generating from ids)
    text: str  # the generated text, without the prompt and without the stop string
    token_ids: list[int]  # the generated tokens (up to and including the one that completed a stop)
    finish_reason: str  # "length" (max_new_tokens), "stop" (a stop string) or "eot" (end-of-text token)


def process_logits(logits: torch.Tensor, cfg: SamplingConfig, seen: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) logits -> float logits to sample from; seen (B, V): the tokens in each row's context."""
    logits = logits.float()
    p = cfg.repetition_penalty
    if seen is not None and p != 1.0:
        # Dividing a negative logit would make it *more* likely, so negative ones are multiplied (CTRL / HF).
        penalised = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(seen, penalised, logits)
    if cfg.temperature == 0:
        return logits
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.size(-1):
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the most likely token always stays.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """(B, V) -> (B,): argmax(p / q), q ~ Exp(1), wins with probability p_i; torch.multinomial's .item() check would
    make the host wait for the GPU at every token."""
    if cfg.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits, dim=-1)
    gen_device = probs.device if generator is None else generator.device  # training's samples pass a CPU one
    q = torch.empty(probs.shape, device=gen_device).exponential_(1, generator=generator).to(probs.device)
    q.clamp_(min=torch.finfo(q.dtype).tiny)  # the CPU kernel can return exactly 0, and 0 / 0 = NaN would win argmax
    return (probs / q).argmax(dim=-1)
