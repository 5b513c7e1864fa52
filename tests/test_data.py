"""Data loading: preloaded and chunked-memmap samplers, their seeding and state, and the path choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gptlib import batches as D
from gptlib.data.shards import read_meta


def _all_tokens(char_data, split="train") -> np.ndarray:
    meta = read_meta(char_data)
    return np.concatenate([np.fromfile(p, dtype=meta.dtype) for p in meta.shard_paths(split)]).astype(np.int64)


def _is_window(x_row: np.ndarray, tokens: np.ndarray) -> bool:
    """x_row occurs somewhere in tokens (brute force on small data)."""
    from numpy.lib.stride_tricks import sliding_window_view

    win = sliding_window_view(tokens, len(x_row))
    return bool((win == x_row).all(axis=1).any())


@pytest.fixture()
def splits(char_data):
    _, s = D.load_dataset(char_data, "cpu", verbose=False, mode="ram")
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


def test_memmap_read_spans_and_bounds(char_data):
    mm = _memmap(char_data)
    tokens = _all_tokens(char_data)
    assert len(mm) == len(tokens)
    got = mm.read(100, 500).long().numpy() & 0xFFFF
    assert np.array_equal(got, tokens[100:600])
    with pytest.raises(IndexError):
        mm.read(len(mm) - 10, 20)


def test_memmap_read_across_shards(tmp_path, char_data):
    """A chunk that spans shard boundaries is read as one contiguous piece."""
    import json
    import shutil

    d = tmp_path / "multi"
    shutil.copytree(char_data, d)
    meta = json.loads((d / "meta.json").read_text())
    tokens = np.fromfile(d / meta["splits"]["train"]["shards"][0]["file"], dtype=np.uint16)
    (d / meta["splits"]["train"]["shards"][0]["file"]).unlink()
    parts = np.array_split(tokens, 3)
    shards = []
    for i, p in enumerate(parts):
        name = f"train_{i:06d}.bin"
        p.tofile(d / name)
        shards.append({"file": name, "tokens": int(len(p))})
    meta["splits"]["train"] = {"tokens": int(len(tokens)), "shards": shards}
    (d / "meta.json").write_text(json.dumps(meta))
    mm = D.MemmapSplit(read_meta(d), "train")
    start = len(parts[0]) - 50
    n = len(parts[1]) + 100  # crosses two boundaries
    assert np.array_equal(mm.read(start, n).long().numpy() & 0xFFFF, tokens[start:start + n])
    _, s = D.load_dataset(d, "cpu", verbose=False, mode="ram")  # preloading concatenates shards in order
    assert np.array_equal(s["train"].tokens.long().numpy() & 0xFFFF, tokens)


def test_chunked_sampler_bounds_shift_and_chunks(char_data):
    mm = _memmap(char_data)
    tokens = _all_tokens(char_data)
    s = D.ChunkedSampler(mm, batch_size=4, block_size=16, seed=3, device="cpu", chunk_tokens=2000,
                         batches_per_chunk=5)
    starts_seen = set()
    for i in range(12):
        x, y = s.next_batch()
        assert x.shape == y.shape == (4, 16)
        assert torch.equal(x[:, 1:], y[:, :-1])
        lo = s.chunk_start
        starts_seen.add(lo)
        window = tokens[lo: lo + 2000]  # every sample comes from the current chunk
        for b in range(4):
            assert _is_window(torch.cat([x[b], y[b, -1:]]).numpy(), window)
    assert len(starts_seen) == 3  # 12 batches, 5 per chunk -> 3 chunks read
    assert s._chunk.tokens.numel() == 2000  # bounded memory: one chunk


def test_chunked_sampler_covers_the_data(char_data):
    """Distribution: over many chunks the samples reach the whole split, not one region."""
    mm = _memmap(char_data)
    s = D.ChunkedSampler(mm, batch_size=8, block_size=16, seed=1, device="cpu", chunk_tokens=4000,
                         batches_per_chunk=2)
    starts = []
    for _ in range(60):
        s.next_batch()
        starts.append(s.chunk_start)
    n = len(mm)
    hist = np.histogram(starts, bins=4, range=(0, n - 4000))[0]
    assert (hist > 0).all(), hist


def test_chunked_sampler_determinism_and_round_trip(char_data):
    mm = _memmap(char_data)
    kw = dict(batch_size=4, block_size=16, device="cpu", chunk_tokens=3000, batches_per_chunk=4)
    a = D.ChunkedSampler(mm, seed=5, **kw)
    b = D.ChunkedSampler(mm, seed=5, **kw)
    for _ in range(6):  # mid-chunk
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    state = a.state_dict()
    want = [a.next_batch()[0] for _ in range(7)]  # crosses into new chunks
    c = D.ChunkedSampler(mm, seed=123, **kw)
    c.load_state_dict(state)
    got = [c.next_batch()[0] for _ in range(7)]
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    assert c.batches_drawn == a.batches_drawn == 13


def test_chunked_accepts_preloaded_state(char_data, splits):
    """A run that switches from RAM to memmap (less RAM after a reconnect) continues from the saved RNG."""
    pre = D.BatchSampler(splits["train"], 4, 16, seed=2, device="cpu")
    pre.next_batch()
    c = D.ChunkedSampler(_memmap(char_data), 4, 16, seed=0, device="cpu", chunk_tokens=3000)
    c.load_state_dict(pre.state_dict())
    x, y = c.next_batch()
    assert x.shape == (4, 16) and c.batches_drawn == 2


def test_plan_data_paths_and_messages():
    GiB = D.GiB
    p = D.plan_data(1 * GiB, "cpu", ram_available=16 * GiB)
    assert p.where == "ram" and "fits in RAM" in p.reason and "16.00 GiB available" in p.reason
    p = D.plan_data(20 * GiB, "cpu", ram_available=16 * GiB)
    assert p.where == "memmap" and "does not fit in RAM" in p.reason
    p = D.plan_data(1 * GiB, "cuda", reserve_gpu_bytes=4 * GiB, gpu_free=40 * GiB, ram_available=16 * GiB)
    assert p.where == "gpu" and "free GPU memory" in p.reason
    p = D.plan_data(10 * GiB, "cuda", reserve_gpu_bytes=30 * GiB, gpu_free=40 * GiB, ram_available=64 * GiB)
    assert p.where == "ram" and "exceed" in p.reason  # too big for the GPU next to the model, fits in RAM
    p = D.plan_data(1 * GiB, "cpu", mode="memmap")
    assert p.where == "memmap" and "requested" in p.reason
    with pytest.raises(MemoryError, match="does not fit in RAM"):
        D.plan_data(20 * GiB, "cpu", mode="ram", ram_available=16 * GiB)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        D.plan_data(1, "cpu", mode="gpu")
    with pytest.raises(ValueError, match="choose one of"):
        D.plan_data(1, "cpu", mode="disk")


def test_load_dataset_prints_choice(char_data, monkeypatch):
    lines = []
    _, s = D.load_dataset(char_data, "cpu", mode="auto", log=lines.append)
    assert isinstance(s["train"], D.SplitData)
    assert any(l.startswith("data: train") and "-> RAM" in l and "fits in RAM" in l for l in lines), lines
    monkeypatch.setattr(D, "available_ram", lambda: 1000)  # pretend the machine is nearly out of memory
    lines.clear()
    _, s = D.load_dataset(char_data, "cpu", mode="auto", log=lines.append)
    assert isinstance(s["train"], D.MemmapSplit) and isinstance(s["val"], D.MemmapSplit)
    assert any("-> MEMMAP" in l and "does not fit in RAM" in l for l in lines), lines
    sampler = D.make_sampler(s["train"], 4, 16, 0, "cpu")
    assert isinstance(sampler, D.ChunkedSampler)
    assert sampler.next_batch()[0].shape == (4, 16)


def test_too_small_split_is_a_clear_error(char_data, splits):
    with pytest.raises(Exception, match="fewer than one block"):
        D.BatchSampler(splits["val"], 2, len(splits["val"]) + 5, 0, "cpu")
    with pytest.raises(Exception, match="fewer than one block"):
        D.ChunkedSampler(D.MemmapSplit(read_meta(char_data), "val"), 2, 10**7, 0, "cpu")
