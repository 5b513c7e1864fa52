"""benchmarks/bench.py (the ladder's rungs on CPU, bench train), the MFU table, ETA/units, the OOM-safe micro-batch
probe."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import bench
from gptlib.config import ModelConfig, RunConfig, TrainConfig
from gptlib.errors import OutOfMemoryAdvice
from gptlib.model import GPT
from gptlib.training import memory
from gptlib.training import throughput as measure

LADDER_CFG = dict(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32)


def test_every_ladder_rung_runs_on_cpu():
    lines = []
    rows = bench.run_ladder(
        ModelConfig(**LADDER_CFG),
        batch_size=4,
        device="cpu",
        steps=1,
        warmup=1,
        compile_backend="eager",
        log=lines.append,
    )
    assert [r.name for r in rows] == [r[0] for r in bench.RUNGS]
    for r in rows:
        assert r.step_s > 0 and math.isfinite(r.step_s) and r.tokens_per_s > 0
        assert r.mfu is None  # CPU: no peak, no made-up MFU
    text = "\n".join(lines)
    assert (
        "MFU unknown" in text and "speedup" in text and "ladder speedup, first -> last rung" in text
    )
    bf16_row = next(line for line in lines if line.startswith("+ bf16 autocast"))
    assert "bf16" in bf16_row.split("unknown", 1)[1]  # the row says what bf16 means on this CPU


def test_ladder_on_a_data_dir_subset(char_data):
    lines = []
    rows = bench.run_ladder(
        ModelConfig(**LADDER_CFG),
        batch_size=2,
        device="cpu",
        steps=1,
        warmup=0,
        data_dir=char_data,
        rungs=[0, 2],
        accum=3,
        log=lines.append,
    )
    assert [r.name for r in rows] == [bench.RUNGS[0][0], bench.RUNGS[2][0]]
    assert "x 3 accumulation (192 tokens/step)" in lines[0]
    assert rows[1].tokens_per_s == pytest.approx(192 / rows[1].step_s)


def test_per_sample_loader_matches_shift():
    import numpy as np

    toks = np.arange(1000, dtype=np.uint16)
    x, y = bench.PerSampleLoader(toks, 3, 8, 0, torch.device("cpu")).next_batch()
    assert x.shape == (3, 8) and torch.equal(y, x + 1)


@pytest.mark.parametrize(
    "name,family,tflops",
    [
        ("NVIDIA A100-SXM4-40GB", "A100", 312),
        ("NVIDIA A100 80GB PCIe", "A100", 312),
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756),
        ("NVIDIA H200", "H200", 989),
        ("NVIDIA L4", "L4", 121),
        ("Tesla T4", "T4 (fp16)", 65),
    ],
)
def test_peak_table(name, family, tflops):
    f, peak = measure.lookup_peak(name)
    assert f == family and peak == tflops * 1e12


# Colab's G4: no cited peak yet
@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA L40S",
        "NVIDIA GeForce RTX 4090",
        "Tesla P100-PCIE-16GB",
        "",
        "Tesla V100-SXM2-16GB",  # Colab's torch (2.11, CUDA 12.8) has no kernels for it
        "NVIDIA RTX PRO 6000 Blackwell Server Edition",
    ],
)
def test_unknown_gpu_has_no_mfu(name):
    assert measure.lookup_peak(name) == (None, None)
    assert measure.mfu(1e9, 1e5, None) is None and measure.fmt_mfu(None) == "unknown"


def test_cpu_peak_is_unknown():
    p = measure.device_peak("cpu")
    assert p.peak_flops is None and "MFU unknown" in p.note


def test_mfu_eta_units():
    assert measure.mfu(6e8, 1e5, 312e12) == pytest.approx(6e13 / 312e12)
    assert measure.mfu(6e8, 1e5, 312e12, n_devices=2) == pytest.approx(6e13 / 624e12)
    peak = measure.DevicePeak("cpu", None, "")
    assert measure.perf_fields({}, 1.0, 10.0, peak, 1, 100, 1100)["eta_s"] == 100.0
    assert measure.perf_fields({}, 1.0, 0.0, peak, 1, 0, 10)["eta_s"] is None  # no rate yet: no ETA
    assert measure.colab_units(3600, measure.COLAB_UNITS_PER_HOUR["A100 40GB"]) == pytest.approx(
        5.40
    )
    assert measure.colab_units(1800, 2.0) == pytest.approx(1.0)
    assert measure.colab_units(3600, None) is None and measure.colab_units(math.inf, 2.0) is None
    assert measure.fmt_duration(3725) == "1h02m" and measure.fmt_duration(65) == "1m05s"


def test_step_timer_cpu():
    from gptlib.training.step import StepTimer

    t = StepTimer("cpu")
    t.start()
    sum(range(10000))
    t.mark("data")
    sum(range(100000))
    t.mark("fwd_bwd")
    split = t.split()
    assert set(split) == {"data", "fwd_bwd"} and split["fwd_bwd"] > 0
    assert "data" in measure.fmt_split(split) and t.split() == {}


def _per_step(sequences):  # a config asking for `sequences` per step, in one micro-batch
    return RunConfig(
        model=ModelConfig(**LADDER_CFG), train=TrainConfig(batch_size=sequences, grad_accum_steps=1)
    )


def _tiny_model():
    torch.manual_seed(0)
    return GPT(ModelConfig(**LADDER_CFG))


def test_probe_picks_largest_fitting_micro_batch(monkeypatch):
    model = _tiny_model()
    real_forward = model.forward
    tried, freed = [], []

    def fake_forward(idx, targets=None, cache=None):
        tried.append(idx.shape[0])
        if idx.shape[0] > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_forward(idx, targets, cache)

    monkeypatch.setattr(model, "forward", fake_forward)
    monkeypatch.setattr(memory, "free_memory", lambda: freed.append(1))
    logs = []
    micro, accum, peak = memory.probe_micro_batch(model, _per_step(48), "cpu", log=logs.append)
    assert (micro, accum, peak) == (
        8,
        6,
        0,
    ) and micro * accum == 48  # tokens per step kept; no memory probe: no peak
    assert tried == [48, 24, 16, 12, 8]  # divisors of 48, largest first
    assert len(freed) >= len(tried)  # memory released after every try
    assert all(p.grad is None for p in model.parameters())  # nothing left behind
    assert any("does not fit (out of memory)" in line for line in logs)


def test_probe_reraises_other_errors(monkeypatch):
    model = _tiny_model()
    # no OOM: all of it
    assert memory.probe_micro_batch(model, _per_step(16), "cpu", log=lambda s: None) == (
        16,
        1,
        0,
    )

    def broken(idx, targets=None, cache=None):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(model, "forward", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        memory.probe_micro_batch(model, _per_step(4), "cpu", log=lambda s: None)


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    ],
)
def test_probe_takes_a_library_failing_to_allocate_as_out_of_memory(monkeypatch, message):
    """On a full GPU cuBLAS fails to create its handle, and cuDNN (its attention on an H100) its workspace, outside
    torch's allocator (autograd's backward thread makes its own): a RuntimeError naming the library's status. Was
    re-raised by the search (cuDNN's until issue 41); now a smaller size is tried."""
    model = _tiny_model()
    real_forward = model.forward

    def library_full(idx, targets=None, cache=None):
        if idx.shape[0] > 4:
            raise RuntimeError(message)
        return real_forward(idx, targets, cache)

    monkeypatch.setattr(model, "forward", library_full)
    assert memory.probe_micro_batch(model, _per_step(16), "cpu", log=lambda s: None)[:2] == (4, 4)


def test_the_ladders_flash_rung_runs_flash_alone():
    """sdpa_kernel([FLASH, EFFICIENT, CUDNN]) is a set of allowed kernels, not an order: on an H100 torch picked cuDNN
    attention in the "+ flash" rung. The rung allows flash alone, as an A100 runs it; the rung before, math alone."""
    b = torch.backends.cuda
    with bench._attention_ctx(True):
        assert (
            b.flash_sdp_enabled()
            and not b.cudnn_sdp_enabled()
            and not b.mem_efficient_sdp_enabled()
        )
    with bench._attention_ctx(False):
        assert b.math_sdp_enabled() and not b.flash_sdp_enabled() and not b.cudnn_sdp_enabled()


def test_probe_nothing_fits_gives_advice(monkeypatch):
    model = _tiny_model()

    def oom(idx, targets=None, cache=None):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(model, "forward", oom)
    with pytest.raises(OutOfMemoryAdvice, match="even at micro-batch 1"):
        memory.probe_micro_batch(model, _per_step(4), "cpu", log=lambda s: None)


def test_oom_advice_keeps_tokens_per_step():
    cfg = RunConfig(
        model=ModelConfig(block_size=1024), train=TrainConfig(batch_size=16, grad_accum_steps=32)
    )
    msg = memory.oom_advice(cfg)
    assert (
        "batch_size=8" in msg and "grad_accum_steps=64" in msg and "524,288 tokens per step" in msg
    )
    # an odd micro-batch: the largest divisor up to its half, so the tokens per step are the same indeed
    odd = RunConfig(
        model=ModelConfig(block_size=64), train=TrainConfig(batch_size=15, grad_accum_steps=2)
    )
    msg = memory.oom_advice(odd)
    assert (
        "--set batch_size=5 --set grad_accum_steps=6 --set eval_batches=60 (same 1,920 tokens"
        in msg
    ), msg
    # auto_batch already on: not suggested again (turned off: tests/test_runtime.py)
    assert "auto_batch=true" not in memory.oom_advice(odd.updated({"auto_batch": True})), msg


def test_bench_train_cpu():
    logs = []
    r = bench.bench_train(
        "phase1",
        [
            "n_layer=1",
            "n_embd=32",
            "n_head=2",
            "block_size=32",
            "batch_size=4",
            "grad_accum_steps=2",
        ],
        device="cpu",
        steps=2,
        warmup=1,
        log=logs.append,
    )
    assert r["tokens_per_s"] > 0 and r["mfu"] is None and r["micro_batch"] == 4
    assert set(r["split"]) == {"data", "fwd_bwd", "optim"}
    assert any(line.startswith("ETA for the preset") for line in logs)


def test_oom_in_training_gives_next_setting_and_frees_the_model(char_data, tmp_path, monkeypatch):
    """An OOM mid-run: a clear message with the next setting, no GPT left referenced, the run resumes."""
    import gc

    from gptlib.model import GPT as Model
    from gptlib.training.loop import train
    from tests.conftest import TINY

    real_forward = Model.forward
    calls = {"n": 0}

    def flaky_forward(self, idx, targets=None, cache=None):
        if self.training and targets is not None:
            calls["n"] += 1
            if calls["n"] == 14:  # step 14: after the step-10 checkpoint
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real_forward(self, idx, targets, cache)

    monkeypatch.setattr(Model, "forward", flaky_forward)
    run_dir = tmp_path / "run"
    gc.collect()
    # other tests' (a Playground keeps its model)
    alive = {id(o) for o in gc.get_objects() if isinstance(o, Model)}
    with pytest.raises(OutOfMemoryAdvice) as info:
        train(
            char_data,
            run_dir,
            "phase1",
            overrides=TINY + ["max_steps=20"],
            device="cpu",
            progress=False,
            log=lambda m: None,
        )
    msg = str(info.value)
    assert "micro-batch 8 x 32" in msg and "--set batch_size=4 --set grad_accum_steps=2" in msg
    assert (
        "2,048 tokens per step" not in msg
        and "256 tokens per step" in msg
        and "re-run to resume" in msg
    )
    # not chained to the OOM (whose frames would pin GPU memory)
    assert info.value.__context__ is None
    gc.collect()
    # none pinned by the error
    assert not [o for o in gc.get_objects() if isinstance(o, Model) and id(o) not in alive]

    monkeypatch.setattr(Model, "forward", real_forward)
    r = train(
        char_data,
        run_dir,
        "phase1",
        overrides=TINY + ["max_steps=20", "batch_size=4", "grad_accum_steps=2"],
        device="cpu",
        progress=False,
        log=lambda m: None,
    )
    assert r.resumed_from == 10 and r.step == 20


def test_bench_script_ladder_and_train(capsys):
    """`python benchmarks/bench.py ladder|train`: its command line, as gpu_check.sh and the README run it."""
    main = bench.main
    assert (
        main(
            [
                "ladder",
                "--device",
                "cpu",
                "--preset",
                "phase1",
                "--set",
                "n_layer=1",
                "--set",
                "block_size=32",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--rungs",
                "1,2",
                "--batch-size",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("torch ") and "RAM preload" in out and "vectorised batches" in out
    assert "memmap + per-sample loop" not in out.split("----")[-1]  # only the rungs asked for
    assert (
        main(
            [
                "train",
                "--preset",
                "phase1",
                "--device",
                "cpu",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--set",
                "n_layer=1",
                "--set",
                "block_size=32",
                "--set",
                "batch_size=2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "MFU unknown" in out and "time split: data" in out and "ETA for the preset" in out
    assert "recipe gpt2" in out
    modern = [
        "train",
        "--preset",
        "phase1",
        "--recipe",
        "modern",
        "--device",
        "cpu",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--set",
        "n_layer=1",
        "--set",
        "block_size=32",
        "--set",
        "batch_size=2",
    ]
    if hasattr(torch.optim, "Muon"):
        assert main(modern) == 0 and "recipe modern" in capsys.readouterr().out
    else:  # the oldest torch CI tests: one line naming the version Muon needs
        assert (
            main(modern) == 2
            and "needs torch.optim.Muon, in torch >= 2.9" in capsys.readouterr().err
        )


def test_bench_script_runs_from_a_shell_and_gptlib_has_no_bench_command(tmp_path, capsys):
    """The script as gpu_check.sh runs it (its own process, from the repository root); gptlib's CLI has no bench."""
    from gptlib.__main__ import main as gptlib_main
    from tests.conftest import REPO

    p = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench.py",
            "train",
            "--preset",
            "phase1",
            "--device",
            "cpu",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--set",
            "n_layer=1",
            "--set",
            "block_size=32",
            "--set",
            "batch_size=2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0 and "ETA for the preset" in p.stdout, p.stdout + p.stderr
    # the command of an earlier release: its replacement named
    assert gptlib_main(["bench", "train"]) == 2
    assert "error: bench is not in gptlib" in capsys.readouterr().err


def test_save_bench_runs_and_counts_a_saves_threads(tmp_path):
    """benchmarks/save_bench.py at phase1's size: the stall and the threads a save starts (one writer, one mirror,
    the mirror's watchdogged Drive calls), as its closing figures print them."""
    from tests.conftest import REPO

    p = subprocess.run(
        [
            sys.executable,
            "benchmarks/save_bench.py",
            "--preset",
            "phase1",
            "--saves",
            "2",
            "--dir",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert p.returncode == 0 and "blocking the training loop" in p.stdout, p.stdout + p.stderr
    threads = next(line for line in p.stdout.splitlines() if "threads besides the loop's" in line)
    assert "gptlib-checkpoint x1," in threads and "gptlib-mirror x1)" in threads, threads
    assert list(tmp_path.iterdir()) == []  # its run dirs removed


def test_nothing_fits_in_notebook_03_names_its_settings_and_only_advice_that_helps(monkeypatch):
    """Notebook 03, nothing fits even at micro-batch 1: the advice said '--set block_size=...', '--compile' and
    'bf16 (--set dtype=bfloat16)', flags a notebook has none of; bf16 takes no less memory than a T4's fp16 (what
    dtype=auto picks), and the probe that found nothing fitting runs eagerly, compiled or not. In a notebook it
    names RUN_NAME and OVERRIDES, and half precision only for a run in fp32."""
    from types import SimpleNamespace

    model = _tiny_model()

    def oom(idx, targets=None, cache=None):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(model, "forward", oom)
    kernel = SimpleNamespace(get_ipython=lambda: SimpleNamespace(kernel=object()))
    monkeypatch.setitem(sys.modules, "IPython", kernel)
    for dtype, half in (("auto", None), ("float32", 'OVERRIDES = ["dtype=auto"]')):
        cfg = _per_step(4).updated({"dtype": dtype})
        with pytest.raises(OutOfMemoryAdvice) as err:
            memory.probe_micro_batch(model, cfg, "cpu", log=lambda s: None)
        msg = str(err.value)
        assert 'a new RUN_NAME with OVERRIDES = ["block_size=16"]' in msg, msg
        assert (
            "--" not in msg and "bf16" not in msg and "bfloat16" not in msg and "compile" not in msg
        ), msg
        assert (half in msg) if half else ("dtype" not in msg), msg
    monkeypatch.delitem(sys.modules, "IPython")
    assert "--set dtype=auto" in memory.oom_advice(cfg.updated({"batch_size": 1}))
