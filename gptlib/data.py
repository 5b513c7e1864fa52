"""Token shards -> training batches: preloaded tokens and seeded, vectorised sampling.

Each batch is one `randint` for the B start offsets and one gather of B x (T+1) tokens: no
Python loop per sample, no small random file reads. The sampler's RNG is a private
`torch.Generator` whose state goes into every checkpoint, so a resumed run draws exactly the
batches the uninterrupted run would have drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .shards import DatasetMeta, DataFormatError, load_split, read_meta


def _as_signed_view(arr: np.ndarray) -> torch.Tensor:
    """uint16/uint32 tokens as a same-size signed torch tensor (torch indexes signed types best)."""
    signed = {np.dtype(np.uint16): np.int16, np.dtype(np.uint32): np.int32}[arr.dtype.newbyteorder("=")]
    return torch.from_numpy(np.ascontiguousarray(arr).view(signed))


def _unsigned_mask(t: torch.Tensor) -> int:
    return 0xFFFF if t.dtype == torch.int16 else 0xFFFFFFFF


@dataclass
class SplitData:
    """One split's tokens, preloaded in RAM (or on the GPU) as a flat signed tensor."""

    tokens: torch.Tensor  # (N,) int16/int32 view of the unsigned ids
    name: str

    def __len__(self) -> int:
        return self.tokens.numel()

    def gather(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        """starts (B,) -> (B, length) int64 token ids."""
        offsets = torch.arange(length, device=self.tokens.device)
        idx = starts.to(self.tokens.device).unsqueeze(1) + offsets  # (B, length)
        return self.tokens[idx].long() & _unsigned_mask(self.tokens)


class BatchSampler:
    """Random (x, y) batches from one split, reproducible from a seed and resumable from its state."""

    def __init__(self, data: SplitData, batch_size: int, block_size: int, seed: int, device: str | torch.device):
        if len(data) < block_size + 1:
            raise DataFormatError(
                f"the {data.name} split has {len(data):,} tokens, fewer than one block of block_size + 1 = "
                f"{block_size + 1}; use more text, a smaller block_size (--set block_size=N), or a larger val_fraction"
            )
        self.data = data
        self.batch_size = batch_size
        self.block_size = block_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)
        self.batches_drawn = 0
        self._pin = self.device.type == "cuda" and data.tokens.device.type == "cpu"

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> x, y of shape (B, T) int64 on the training device; y is x shifted by one token."""
        high = len(self.data) - self.block_size  # last valid start so that start + T + 1 <= N
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        chunk = self.data.gather(starts, self.block_size + 1)  # (B, T+1)
        if self._pin:
            chunk = chunk.pin_memory().to(self.device, non_blocking=True)
        elif chunk.device != self.device:
            chunk = chunk.to(self.device)
        self.batches_drawn += 1
        return chunk[:, :-1], chunk[:, 1:]

    def state_dict(self) -> dict:
        return {"rng_state": self.generator.get_state(), "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["rng_state"])
        self.batches_drawn = int(state["batches_drawn"])


def load_dataset(data_dir: str | Path, device: str | torch.device = "cpu",
                 verbose: bool = True) -> tuple[DatasetMeta, dict[str, SplitData]]:
    """Validate meta.json against the shards, then preload both splits into RAM (or onto the GPU)."""
    meta = read_meta(data_dir)
    device = torch.device(device)
    splits = {}
    for split in ("train", "val"):
        tokens = _as_signed_view(load_split(meta, split))
        if device.type == "cuda":
            tokens = _maybe_to_gpu(tokens, device)
        splits[split] = SplitData(tokens=tokens, name=split)
    if verbose:
        where = splits["train"].tokens.device
        mb = sum(s.tokens.numel() * s.tokens.element_size() for s in splits.values()) / 1e6
        print(f"data: {meta.data_dir} train {len(splits['train']):,} / val {len(splits['val']):,} tokens "
              f"({meta.dtype.name}, vocab {meta.vocab_size}, tokenizer {meta.tokenizer.get('kind')}) "
              f"preloaded in {'GPU' if where.type == 'cuda' else 'RAM'} ({mb:,.1f} MB)")
    return meta, splits


def _maybe_to_gpu(tokens: torch.Tensor, device: torch.device, margin: float = 0.5) -> torch.Tensor:
    """Put tokens on the GPU when they take under `margin` of its free memory (the rest is the model's)."""
    free, _ = torch.cuda.mem_get_info(device)
    if tokens.numel() * tokens.element_size() < margin * free:
        return tokens.to(device)
    return tokens.pin_memory()
