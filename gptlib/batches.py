"""Token shards -> training batches. A split that fits goes to the GPU or RAM, else it is read from the shards
memory-mapped on disk; either way a batch is B random windows, one gather. The sampler's RNG state is in every
checkpoint, so a resumed run draws exactly the batches the uninterrupted run would have."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import psutil
import torch

from gptlib.data.shards import DataFormatError, DatasetMeta, read_spans
from gptlib.errors import in_notebook, override

GiB = 1 << 30
# preload into RAM only if the data and RAM_RESERVE together fit in this share of available RAM
RAM_FRACTION = 0.75
RAM_RESERVE = 1 * GiB  # for Python, the model and the OS
GPU_FRACTION = 0.85  # preload onto the GPU only if data + the model's training memory fit in this share of free memory
_COPY_PIECE = 1 << 26  # tokens copied per piece while preloading (bounds temporary host memory)


def _as_signed_view(arr: np.ndarray) -> torch.Tensor:
    # torch supports few ops on unsigned types: uint16/uint32 viewed as int16/int32, no copy
    return torch.from_numpy(np.ascontiguousarray(arr).view(f"i{arr.dtype.itemsize}"))


def _to_ids(raw: torch.Tensor) -> torch.Tensor:
    return raw.long() & (0xFFFF if raw.dtype == torch.int16 else 0xFFFFFFFF)


@dataclass
class SplitData:
    tokens: torch.Tensor  # (N,) int16/int32 view of the unsigned ids
    name: str

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def gather_raw(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        """starts (B,) -> (B, length) in the storage dtype (16 or 32 bits): 4x or 2x less to copy than int64."""
        dev = self.tokens.device
        return self.tokens[_move(starts, dev).unsqueeze(1) + torch.arange(length, device=dev)]


class MemmapSplit:
    """A split left on disk, its shards read as one stream (a window may cross into the next shard). Every read checks
    the ids against the vocabulary: a shard damaged in place keeps its size, which is all meta.json's checks see."""

    device = torch.device("cpu")  # where its batches are gathered

    def __init__(self, meta: DatasetMeta, split: str):
        self.name, self.vocab_size, self.paths = split, meta.vocab_size, meta.shard_paths(split)
        self.dtype = np.dtype(meta.dtype).newbyteorder("<")
        self.maps = [np.memmap(p, dtype=self.dtype, mode="r") for p in self.paths]
        # shard i holds [bounds[i], bounds[i+1])
        self.bounds = np.cumsum([0] + [len(m) for m in self.maps])

    def __len__(self) -> int:
        return int(self.bounds[-1])

    def read(self, start: int, n: int) -> torch.Tensor:
        """Tokens [start, start + n) as a signed (n,) tensor in RAM: one sequential read per shard touched."""
        pieces = [
            m[max(0, start - lo) : max(0, start + n - lo)] for m, lo in zip(self.maps, self.bounds)
        ]
        # a split may have no shards
        out = np.concatenate(pieces) if pieces else np.empty(0, self.dtype)
        self._check_vocab(out, start)
        return _as_signed_view(out)

    def gather_raw(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        # (B, length) positions in the split's stream
        pos = starts.numpy()[:, None] + np.arange(length)
        shard = np.searchsorted(self.bounds, pos, side="right") - 1
        out = np.empty(pos.shape, dtype=self.dtype)
        for i in np.unique(shard):  # one fancy-indexed read per shard touched
            at = shard == i
            out[at] = self.maps[i][pos[at] - self.bounds[i]]
        self._check_vocab(out, pos)
        return _as_signed_view(out)

    def _check_vocab(self, tokens: np.ndarray, pos: np.ndarray | int) -> None:
        """DataFormatError for an id past the vocabulary; pos: each token's, or the first's."""
        if not tokens.size or int(tokens.max()) < self.vocab_size:
            return
        k = int(np.argmax(tokens.ravel() >= self.vocab_size))
        at = int(pos.ravel()[k]) if isinstance(pos, np.ndarray) else pos + k
        i = int(np.searchsorted(self.bounds, at, side="right")) - 1
        raise DataFormatError(
            f"shard {self.paths[i]}: token id {int(tokens.ravel()[k])} at position {at - int(self.bounds[i]):,} is "
            f"outside the vocabulary (vocab_size {self.vocab_size}); the file was damaged after tokenizing (its size "
            f"is right). Tokenize again (--overwrite) or restore the file"
        )


def _move(chunk: torch.Tensor, device: torch.device) -> torch.Tensor:
    # pinned + non_blocking to CUDA: the copy overlaps the previous step's kernels (pageable memory would block)
    if chunk.device == device:
        return chunk
    if device.type == "cuda" and chunk.device.type == "cpu":
        return chunk.pin_memory().to(device, non_blocking=True)
    return chunk.to(device)


class LossMask:
    """Chat data: the [start, end) spans of a split's stream that hold an assistant's answer (shards.read_spans), kept
    where the split's tokens are; targets outside them become -1."""

    def __init__(self, spans: np.ndarray, split_tokens: int, device: torch.device | str = "cpu"):
        spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
        self.starts = torch.from_numpy(np.ascontiguousarray(spans[:, 0])).to(device)
        self.ends = torch.from_numpy(np.ascontiguousarray(spans[:, 1])).to(device)
        # of the targets, supervised
        self.fraction = int((spans[:, 1] - spans[:, 0]).sum()) / max(1, split_tokens)

    def targets(self, starts: torch.Tensor, block_size: int) -> torch.Tensor:
        """starts (B,) -> (B, block_size) bool: target t of row b (the token at starts[b] + t + 1) is in a span."""
        dev = self.starts.device
        pos = _move(starts, dev).unsqueeze(1) + torch.arange(1, block_size + 1, device=dev)
        # the last span starting at or before pos
        k = torch.searchsorted(self.starts, pos, right=True) - 1
        return (k >= 0) & (pos < self.ends[k.clamp(min=0)])


def loss_masks(meta: DatasetMeta, splits: dict, chat_loss: str) -> dict[str, LossMask]:
    """{} unless chat data trains on the answers only (then every target counts)."""
    if meta.format != "chat" or chat_loss == "all":
        return {}
    return {
        name: LossMask(read_spans(meta, name), len(data), data.device)
        for name, data in splits.items()
    }


def head_ids(data: "SplitData | MemmapSplit", n: int) -> np.ndarray:
    n = min(n, len(data))
    raw = data.tokens[:n] if isinstance(data, SplitData) else data.read(0, n)
    return _to_ids(raw).cpu().numpy()


def _shorter_than_a_block(data: SplitData | MemmapSplit, block_size: int) -> DataFormatError:
    fix = f"use more text or a smaller block_size ({override('block_size=N')})"
    # a larger val_fraction helps the val split only (in a notebook, notebook 01's data)
    if data.name == "val":
        vf = "VAL_FRACTION (a dataset of notebook 01)" if in_notebook() else "val_fraction"
        fix = f"use more text, a smaller block_size ({override('block_size=N')}), or a larger {vf}"
    return DataFormatError(
        f"the {data.name} split has {len(data):,} tokens, fewer than one block of block_size + 1 = "
        f"{block_size + 1}; {fix}"
    )


class BatchSampler:
    """Random windows of a split, from a generator of its own: its state_dict() is where the batches stand. Under
    DDP each rank (of world_size) samples its own stream, seeded seed + rank."""

    def __init__(
        self,
        data: SplitData | MemmapSplit,
        batch_size: int,
        block_size: int,
        seed: int,
        device: str | torch.device,
        loss_mask: LossMask | None = None,
        rank: int = 0,
        world_size: int = 1,
    ):
        if len(data) < block_size + 1:
            raise _shorter_than_a_block(data, block_size)
        self.data, self.batch_size, self.block_size = data, batch_size, block_size
        self.device = torch.device(device)
        self.loss_mask = loss_mask  # chat data: targets outside the assistants' answers become -1
        self.seed, self.rank, self.world_size = seed + rank, rank, world_size
        self.generator = torch.Generator().manual_seed(self.seed)
        self.batches_drawn = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y of shape (B, T) int64 on the training device; y is x shifted by one token."""
        # exclusive: starts 0 .. N-T-1, so that start + T + 1 <= N
        high = len(self.data) - self.block_size
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        # once per batch: the gather and the loss mask share it
        starts = _move(starts, self.data.device)
        # (B, T+1)
        chunk = _to_ids(_move(self.data.gather_raw(starts, self.block_size + 1), self.device))
        self.batches_drawn += 1
        x, y = chunk[:, :-1], chunk[:, 1:]
        if self.loss_mask is not None:
            answers = _move(self.loss_mask.targets(starts, self.block_size), self.device)
            y = y.masked_fill(~answers, -1)
        return x, y

    def state_dict(self) -> dict:
        return {"rng_state": self.generator.get_state(), "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict, ranks: list[dict] | None = None) -> str | None:
        """Back where it was saved. `ranks`: every rank's state (a DDP run's checkpoint), `state`: rank 0's. Without
        this rank's own state (a one-process checkpoint, an interrupt's under DDP: saved without the gather) a rank
        other than 0, and with another number of processes' states every rank, goes on with a stream derived from its
        own seed and the batches drawn, not a replay -> a note when `ranks` are another number of processes'."""
        same = ranks is not None and len(ranks) == self.world_size
        state = ranks[self.rank] if same else state
        # an earlier gptlib's chunked-sampler fields (chunk_*) are ignored: its RNG stream goes on as before
        self.generator.set_state(state["rng_state"])
        self.batches_drawn = int(state["batches_drawn"])
        if same or (ranks is None and self.rank == 0):
            return None
        self.generator.manual_seed(self.seed + 1_000_003 * (self.batches_drawn + 1))
        # a one-process checkpoint: rank 0 goes on with its stream, the others derive theirs
        if ranks is None:
            return None
        return (
            f"resume: the checkpoint's sampler states are for {len(ranks)} process(es), now {self.world_size}: "
            f"each rank continues with a derived stream"
        )


@dataclass
class DataPlan:
    where: str  # "gpu" | "ram" | "memmap"
    reason: str  # one line for the log: why this path


def _fmt(nbytes: float) -> str:
    return f"{nbytes / GiB:,.2f} GiB" if nbytes >= GiB / 10 else f"{nbytes / (1 << 20):,.1f} MiB"


def available_ram() -> int:
    return int(psutil.virtual_memory().available)


def plan_data(nbytes: int, device: str | torch.device, reserve_gpu_bytes: int = 0) -> DataPlan:
    note = ""
    if torch.device(device).type == "cuda":
        free = torch.cuda.mem_get_info(torch.device(device))[0]
        fits = nbytes + reserve_gpu_bytes <= GPU_FRACTION * free
        note = (
            f"data {_fmt(nbytes)} + model/training memory ~{_fmt(reserve_gpu_bytes)} "
            f"{'fit in' if fits else 'exceed'} {GPU_FRACTION:.0%} of {_fmt(free)} free GPU memory"
        )
        if fits:
            return DataPlan("gpu", note)
        note += "; "
    ram = available_ram()
    if nbytes <= RAM_FRACTION * ram - RAM_RESERVE:
        return DataPlan("ram", f"{note}data {_fmt(nbytes)} fits in RAM ({_fmt(ram)} available)")
    return DataPlan(
        "memmap",
        f"{note}data {_fmt(nbytes)} does not fit in RAM ({_fmt(ram)} available): batches are "
        f"read from the shards on disk",
    )


def _preload(src: MemmapSplit, device: torch.device) -> torch.Tensor:
    """All of a split in one signed tensor; to the GPU piece by piece, so that host memory holds one piece."""
    n = len(src)
    if device.type != "cuda":
        return src.read(0, n)
    dtype = torch.int16 if src.dtype.itemsize == 2 else torch.int32
    out = torch.empty(n, dtype=dtype, device=device)
    for pos in range(0, n, _COPY_PIECE):
        piece = src.read(pos, min(_COPY_PIECE, n - pos))
        # once per run: a plain blocking copy, no temporary on the GPU
        out[pos : pos + piece.numel()].copy_(piece)
    return out


def place_dataset(
    meta: DatasetMeta,
    device: str | torch.device = "cpu",
    *,
    reserve_gpu_bytes: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, SplitData | MemmapSplit]:
    """Each split where it fits: on the GPU beside what training needs there, else in RAM, else memory-mapped."""
    device = torch.device(device)
    splits: dict[str, SplitData | MemmapSplit] = {}
    for split in ("train", "val"):
        src = MemmapSplit(meta, split)
        # free memory re-read per split
        plan = plan_data(len(src) * src.dtype.itemsize, device, reserve_gpu_bytes)
        if plan.where == "memmap":
            splits[split] = src
        else:
            target = device if plan.where == "gpu" else torch.device("cpu")
            splits[split] = SplitData(_preload(src, target), split)
        log(f"data: {split} {len(src):,} tokens -> {plan.where.upper()}: {plan.reason}")
    kind = meta.tokenizer.get("kind")
    log(f"data: {meta.data_dir} ({meta.dtype.name}, vocab {meta.vocab_size}, tokenizer {kind})")
    return splits
