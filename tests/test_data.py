"""Data loading: preloaded and memory-mapped splits, the sampler, its seeding and state, and the path choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gptlib import batches as D
from gptlib.data.shards import read_meta


def load_dataset(data_dir, device="cpu", log=print):
    """A data directory's meta.json and its splits placed as train() places them."""
    meta = read_meta(data_dir)
    return meta, D.place_dataset(meta, device, log=log)


def quiet(_msg):
    pass


def _all_tokens(char_data, split="train") -> np.ndarray:
    meta = read_meta(char_data)
    return np.concatenate(
        [np.fromfile(p, dtype=meta.dtype) for p in meta.shard_paths(split)]
    ).astype(np.int64)


def _is_window(x_row: np.ndarray, tokens: np.ndarray) -> bool:
    """x_row occurs somewhere in tokens (brute force on small data)."""
    from numpy.lib.stride_tricks import sliding_window_view

    win = sliding_window_view(tokens, len(x_row))
    return bool((win == x_row).all(axis=1).any())


@pytest.fixture()
def splits(char_data):
    _, s = load_dataset(char_data, "cpu", log=quiet)  # a small split: preloaded in RAM
    return s


def test_preloaded_matches_files(char_data, splits):
    assert isinstance(splits["train"], D.SplitData)
    assert np.array_equal(splits["train"].tokens.long().numpy() & 0xFFFF, _all_tokens(char_data))


def test_batch_shapes_and_shift(splits, char_data):
    s = D.BatchSampler(splits["train"], batch_size=4, block_size=16, seed=0, device="cpu")
    x, y = s.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    tokens = _all_tokens(char_data)
    for b in range(4):
        row = torch.cat([x[b], y[b, -1:]]).numpy()
        assert _is_window(row, tokens)


def test_seed_determinism_and_state_round_trip(splits):
    a = D.BatchSampler(splits["train"], 4, 16, seed=7, device="cpu")
    b = D.BatchSampler(splits["train"], 4, 16, seed=7, device="cpu")
    c = D.BatchSampler(splits["train"], 4, 16, seed=8, device="cpu")
    xa, xb, xc = a.next_batch()[0], b.next_batch()[0], c.next_batch()[0]
    assert torch.equal(xa, xb) and not torch.equal(xa, xc)
    state = a.state_dict()
    assert set(state) == {"rng_state", "batches_drawn"}  # the format resume tests rely on
    want = [a.next_batch()[0] for _ in range(3)]
    d = D.BatchSampler(splits["train"], 4, 16, seed=999, device="cpu")
    d.load_state_dict(state)
    assert all(torch.equal(w, d.next_batch()[0]) for w in want)
    assert d.batches_drawn == 4


def _memmap(char_data):
    return D.MemmapSplit(read_meta(char_data), "train")


def test_memmap_read_spans(char_data):
    mm = _memmap(char_data)
    tokens = _all_tokens(char_data)
    assert len(mm) == len(tokens)
    got = mm.read(100, 500).long().numpy() & 0xFFFF
    assert np.array_equal(got, tokens[100:600])


def _split_into_shards(tmp_path, char_data, n: int):
    """A copy of char_data whose train split is n shards (the same token stream) -> (data dir, the tokens, bounds)."""
    import json
    import shutil

    d = tmp_path / "multi"
    shutil.copytree(char_data, d)
    meta = json.loads((d / "meta.json").read_text())
    tokens = np.fromfile(d / meta["splits"]["train"]["shards"][0]["file"], dtype=np.uint16)
    (d / meta["splits"]["train"]["shards"][0]["file"]).unlink()
    parts = np.array_split(tokens, n)
    shards = []
    for i, p in enumerate(parts):
        name = f"train_{i:06d}.bin"
        p.tofile(d / name)
        shards.append({"file": name, "tokens": int(len(p))})
    meta["splits"]["train"] = {"tokens": int(len(tokens)), "shards": shards}
    (d / "meta.json").write_text(json.dumps(meta))
    return d, tokens, np.cumsum([0] + [len(p) for p in parts])


def test_memmap_read_across_shards(tmp_path, char_data):
    """A piece that spans shard boundaries is read as one contiguous piece."""
    d, tokens, bounds = _split_into_shards(tmp_path, char_data, 3)
    mm = D.MemmapSplit(read_meta(d), "train")
    start = int(bounds[1]) - 50
    n = int(bounds[2] - bounds[1]) + 100  # crosses two boundaries
    assert np.array_equal(mm.read(start, n).long().numpy() & 0xFFFF, tokens[start : start + n])
    _, s = load_dataset(d, "cpu", log=quiet)  # preloading concatenates shards in order
    assert np.array_equal(s["train"].tokens.long().numpy() & 0xFFFF, tokens)


def test_memmap_batches_are_the_preloaded_ones(tmp_path, char_data):
    """Batches gathered from shards on disk are those of the same split preloaded, seed for seed: the same windows of
    the same stream, also those that cross from one shard into the next (here 40 shards of ~2,250 tokens)."""
    d, tokens, bounds = _split_into_shards(tmp_path, char_data, 40)
    meta = read_meta(d)
    mm = D.MemmapSplit(meta, "train")
    _, s = load_dataset(d, "cpu", log=quiet)
    on_disk = D.BatchSampler(mm, 16, 64, seed=4, device="cpu")
    in_ram = D.BatchSampler(s["train"], 16, 64, seed=4, device="cpu")
    crossed = 0
    for _ in range(30):
        x, y = on_disk.next_batch()
        x0, y0 = in_ram.next_batch()
        assert torch.equal(x, x0) and torch.equal(y, y0) and torch.equal(x[:, 1:], y[:, :-1])
        for row in torch.cat([x, y[:, -1:]], dim=1).numpy():
            assert _is_window(row, tokens)
    g = torch.Generator().manual_seed(4)
    for _ in range(30):
        starts = torch.randint(0, len(mm) - 64, (16,), generator=g).numpy()
        crossed += int(
            (
                np.searchsorted(bounds, starts, "right")
                != np.searchsorted(bounds, starts + 64, "right")
            ).sum()
        )
    assert crossed > 5  # the comparison above did cover windows that cross a shard boundary


def test_memmap_sampler_state_round_trip(char_data):
    mm = _memmap(char_data)
    a = D.BatchSampler(mm, 4, 16, seed=5, device="cpu")
    for _ in range(6):
        a.next_batch()
    state = a.state_dict()
    want = [a.next_batch()[0] for _ in range(7)]
    c = D.BatchSampler(mm, 4, 16, seed=123, device="cpu")
    c.load_state_dict(state)
    assert all(torch.equal(w, c.next_batch()[0]) for w in want)
    assert c.batches_drawn == a.batches_drawn == 13


def test_an_old_chunked_sampler_state_resumes(char_data, splits):
    """A checkpoint of the chunked memmap sampler gptlib had before (its state also held the current chunk) resumes
    into the one sampler: its RNG stream goes on from where it was saved."""
    pre = D.BatchSampler(splits["train"], 4, 16, seed=2, device="cpu")
    pre.next_batch()
    old = {
        **pre.state_dict(),
        "chunk_start": 12_345,
        "chunk_batches": 3,
        "chunk_tokens": 16_777_216,
        "batches_per_chunk": 64,
    }
    c = D.BatchSampler(_memmap(char_data), 4, 16, seed=0, device="cpu")
    c.load_state_dict(old)
    assert torch.equal(c.next_batch()[0], pre.next_batch()[0]) and c.batches_drawn == 2


@pytest.mark.parametrize("how", ["read", "batch"])
def test_a_shard_damaged_in_place_is_named(tmp_path, char_data, how):
    """Ids outside the vocabulary in a shard of the right size (meta.json's checks cannot see it): every read from disk
    says which shard, which position."""
    d, tokens, bounds = _split_into_shards(tmp_path, char_data, 3)
    shard = d / "train_000001.bin"
    damaged = np.fromfile(shard, dtype=np.uint16)
    damaged[:] = 60_000
    damaged.tofile(shard)
    mm = D.MemmapSplit(read_meta(d), "train")
    # a read from the shard's start; a batch: its first window there
    at = "0" if how == "read" else r"[\d,]+"
    with pytest.raises(
        D.DataFormatError,
        match=rf"train_000001\.bin: token id 60000 at position {at} is outside the "
        r"vocabulary \(vocab_size \d+\)",
    ):
        if how == "read":
            mm.read(int(bounds[1]) - 3, 10)
        else:
            D.BatchSampler(
                mm, 64, 16, seed=0, device="cpu"
            ).next_batch()  # 64 windows: some land in shard 1


def test_plan_data_paths_and_messages(monkeypatch):
    GiB = D.GiB
    # the machine's free RAM and GPU memory: faked
    monkeypatch.setattr(D, "available_ram", lambda: 16 * GiB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * GiB, 80 * GiB))
    p = D.plan_data(1 * GiB, "cpu")
    assert p.where == "ram" and "fits in RAM" in p.reason and "16.00 GiB available" in p.reason
    p = D.plan_data(20 * GiB, "cpu")
    assert (
        p.where == "memmap"
        and "does not fit in RAM" in p.reason
        and "from the shards on disk" in p.reason
    )
    p = D.plan_data(1 * GiB, "cuda", reserve_gpu_bytes=4 * GiB)
    assert p.where == "gpu" and "free GPU memory" in p.reason
    p = D.plan_data(10 * GiB, "cuda", reserve_gpu_bytes=30 * GiB)
    # too big for the GPU next to the model, fits in RAM
    assert p.where == "ram" and "exceed" in p.reason
    p = D.plan_data(20 * GiB, "cuda", reserve_gpu_bytes=30 * GiB)
    assert p.where == "memmap" and "exceed" in p.reason and "does not fit in RAM" in p.reason


def test_load_dataset_prints_choice(char_data, monkeypatch):
    lines = []
    _, s = load_dataset(char_data, "cpu", log=lines.append)
    assert isinstance(s["train"], D.SplitData)
    assert any(
        line.startswith("data: train") and "-> RAM" in line and "fits in RAM" in line
        for line in lines
    ), lines
    # pretend the machine is nearly out of memory
    monkeypatch.setattr(D, "available_ram", lambda: 1000)
    lines.clear()
    _, s = load_dataset(char_data, "cpu", log=lines.append)
    assert isinstance(s["train"], D.MemmapSplit) and isinstance(s["val"], D.MemmapSplit)
    assert any("-> MEMMAP" in line and "does not fit in RAM" in line for line in lines), lines
    assert D.BatchSampler(s["train"], 4, 16, 0, "cpu").next_batch()[0].shape == (4, 16)


def test_too_small_split_is_a_clear_error(char_data, splits):
    with pytest.raises(Exception, match="fewer than one block"):
        D.BatchSampler(splits["val"], 2, len(splits["val"]) + 5, 0, "cpu")
    with pytest.raises(Exception, match="fewer than one block"):
        D.BatchSampler(D.MemmapSplit(read_meta(char_data), "val"), 2, 10**7, 0, "cpu")
