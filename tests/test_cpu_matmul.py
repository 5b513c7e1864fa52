"""Decoding's few-row matmuls on a CPU (gptlib/inference/engine.py): split into row blocks only inside the engine,
only for a few rows, and only where this CPU measured the split faster (an Intel Xeon ran it at 0.72-0.89x)."""

from __future__ import annotations

import pytest
import torch

from gptlib.config import ModelConfig
from gptlib.inference import engine
from gptlib.inference.engine import Engine, SamplingConfig, SplitFewRows, row_blocks, split_linear
from gptlib.model import GPT, KVCache


def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)).eval()


@pytest.mark.parametrize("rows_shape", [(1, 1), (3, 1), (2, 5), (16,)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("blocks", [2, 3, 8])
def test_split_linear_equals_linear(rows_shape, bias, blocks):
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 96, bias=bias)
    x = torch.randn(*rows_shape, 48)
    got = split_linear(x, lin.weight, lin.bias, blocks)
    assert got.shape == (*rows_shape, 96)
    torch.testing.assert_close(got, lin(x), rtol=1e-5, atol=1e-6)


def test_row_blocks_divide_the_output_size():
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert row_blocks(96) == 3
        assert row_blocks(32768) == 2  # 3 does not divide it: fewer blocks, never an uneven split
        assert row_blocks(7) == 1  # prime: the plain matmul
    finally:
        torch.set_num_threads(old)


def test_the_split_runs_for_a_decoding_step_only_and_gives_its_logits(monkeypatch):
    calls = []
    monkeypatch.setattr(
        engine, "split_linear", lambda *a: calls.append(a[0].shape) or split_linear(*a)
    )
    # a 2-thread machine, whatever this one is
    monkeypatch.setattr(engine, "row_blocks", lambda n: 2)
    model = tiny()
    cache = KVCache(model.config, 1, "cpu", torch.float32)
    x = torch.randint(0, 64, (1, 9))
    with torch.inference_mode():
        full, _ = model(x)
        assert calls == []  # outside the mode: never split
        with SplitFewRows():
            # a prefill of 128 rows (over FEW_ROWS): the plain matmul
            model(torch.randint(0, 64, (4, 32)))
            assert calls == []
            model(x[:, :8], cache=cache)
            step, _ = model(x[:, 8:9], cache=cache)  # one token: every matmul split
    layer_matmuls = 4 * model.config.n_layer + 1  # q/k/v, attention out, MLP in and out; the head
    assert len(calls) >= layer_matmuls and all(shape[-2] == 1 for shape in calls[-layer_matmuls:])
    torch.testing.assert_close(step[0, -1], full[0, -1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("faster", [True, False])
def test_the_engine_splits_only_where_this_cpu_measured_it_faster(monkeypatch, faster):
    calls, measured = [], []
    monkeypatch.setattr(engine, "split_linear", lambda *a: calls.append(1) or split_linear(*a))
    monkeypatch.setattr(engine, "row_blocks", lambda n: 2)
    monkeypatch.setattr(engine, "split_is_faster", lambda model: measured.append(model) or faster)
    eng = Engine(tiny())
    got, _ = eng.generate_ids([[1, 2, 3]], SamplingConfig(max_new_tokens=12, temperature=0.0))
    eng.generate_ids([[4]], SamplingConfig(max_new_tokens=3, temperature=0.0))
    assert len(measured) == 1 and eng.split_matmuls is faster  # measured once per engine
    assert bool(calls) is faster
    plain, _ = Engine(tiny()).generate_ids(
        [[1, 2, 3]], SamplingConfig(max_new_tokens=12, temperature=0.0)
    )
    assert got == plain or not faster  # the same greedy tokens either way


def test_the_measurement_times_the_models_own_weights(monkeypatch):
    model = tiny()
    assert isinstance(engine.split_is_faster(model), bool)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert engine.split_is_faster(model) is False  # one thread: nothing to run in parallel
