"""The CUDA decisions of gptlib.runtime, memory and measure, tested on a CPU with torch.cuda's device queries faked.

A fake GPU answers what PyTorch's own functions would on that GPU (name, compute capability, memory, bf16
with and without emulation, device count); the gptlib code behind those answers runs for real.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import types

import pytest
import torch

import gptlib.runtime as rt
from gptlib.checkpoint.format import RNG
from gptlib.config import RunConfig, build_config, get_preset
from gptlib.errors import ConfigError, OutOfMemoryAdvice
from gptlib.training import memory, start
from gptlib.training import throughput as measure
from gptlib.training.run import Dist
from tests.conftest import REPO, TINY

GIB = 2**30
CUDA = torch.device("cuda", 0)


def quiet(_msg):
    pass


def fake_gpu(monkeypatch, name="Tesla T4", capability=(7, 5), count=1, total=15 * GIB):
    """torch.cuda as on a machine with `count` GPUs of this kind. Returns the list set_device() calls land in."""
    calls = []
    props = types.SimpleNamespace(
        name=name, major=capability[0], minor=capability[1], total_memory=total
    )

    # PyTorch's rule: sm80+, or anything that can emulate
    def is_bf16_supported(
        including_emulation=True,
    ):
        return capability[0] >= 8 or including_emulation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(torch.device(device)))
    return calls


# --- 1. dtype: a T4 trains in fp16 + GradScaler, never in emulated bf16 ----------------------------------------


@pytest.mark.parametrize(
    "name,cap,want",
    [
        ("Tesla T4", (7, 5), torch.float16),
        ("NVIDIA A100-SXM4-40GB", (8, 0), torch.bfloat16),
        ("NVIDIA H100 80GB HBM3", (9, 0), torch.bfloat16),
    ],
)
def test_auto_dtype_uses_native_bf16_only(monkeypatch, name, cap, want):
    from benchmarks.bench import half_dtype

    fake_gpu(monkeypatch, name, cap)
    assert rt.resolve_dtype("auto", CUDA) == want
    assert half_dtype(CUDA)[0] == want  # the benchmarks' half precision
    family, _ = measure.lookup_peak(name)  # MFU against the peak of the precision it trains in
    assert ("fp16" in family) == (want == torch.float16)


def test_fp16_training_gets_a_grad_scaler_and_bf16_does_not(char_data, tmp_path):
    """A run in fp16 scales its loss (the scaler's state is saved with it); in bf16 or fp32 it does not."""
    from gptlib.checkpoint.format import list_checkpoints, load_checkpoint
    from gptlib.training.loop import train

    for dtype, scaled in (("float16", True), ("bfloat16", False), ("float32", False)):
        run = tmp_path / dtype
        train(
            char_data,
            run,
            "phase1",
            TINY + [f"dtype={dtype}"],
            max_steps=1,
            device="cpu",
            progress=False,
            log=quiet,
        )
        saved = load_checkpoint(list_checkpoints(run)[0])
        assert (saved["state"].config["train"]["dtype"], bool(saved["scaler"])) == (
            dtype,
            scaled,
        ), dtype


# --- 2. bad input: bf16 without it, a GPU that is not there, a device gptlib does not run on -----------------


def test_bf16_asked_on_a_t4_names_the_gpu_and_the_alternative(monkeypatch):
    fake_gpu(monkeypatch, "Tesla T4", (7, 5))
    with pytest.raises(ConfigError) as e:
        rt.resolve_dtype("bfloat16", CUDA)
    msg = str(e.value)
    assert "Tesla T4" in msg and "dtype=float16" in msg and "auto" in msg, msg
    assert rt.resolve_dtype("float16", CUDA) == torch.float16  # what the message proposes works


def test_bf16_asked_on_a_t4_in_a_notebook_names_overrides(monkeypatch):
    """Notebook 03 on day 2's T4 with OVERRIDES = ["dtype=bfloat16"] kept from an A100: the refusal said `use --set
    dtype=float16`, a command-line flag the notebook does not have."""
    import IPython

    fake_gpu(monkeypatch, "Tesla T4", (7, 5))
    monkeypatch.setattr(IPython, "get_ipython", lambda: type("Kernel", (), {"kernel": 1})())
    with pytest.raises(
        ConfigError, match=r'use OVERRIDES = \["dtype=float16"\] \(trained with a GradScaler\)'
    ):
        rt.resolve_dtype("bfloat16", CUDA)


def test_a_cuda_index_past_the_gpus_is_refused_naming_the_count(monkeypatch):
    fake_gpu(monkeypatch, count=2)
    with pytest.raises(ConfigError, match=r"cuda:2.*2 GPUs.*cuda:0.*cuda:1"):
        rt.resolve_device("cuda:2")
    with pytest.raises(ConfigError, match="cuda:x"):
        rt.resolve_device("cuda:x")


@pytest.mark.parametrize("name", ["tpu", "xla", "garbage", "cuda0", ""])
def test_devices_gptlib_does_not_run_on_are_config_errors(name):
    with pytest.raises(ConfigError, match="auto, cpu, cuda, cuda:N or mps"):
        rt.resolve_device(name)


def test_mps_where_there_is_none_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="mps.*not available"):
        rt.resolve_device("mps")


def test_cuda_asked_on_a_cpu_runtime_in_a_notebook_names_the_runtime_and_device(monkeypatch):
    """DEVICE = "cuda" in notebook 02, 03 or 05 on a Colab runtime without a GPU: the refusal said '(use --device
    cpu)', a flag the notebook has not, and not that the runtime is what lacks the GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    kernel = types.SimpleNamespace(get_ipython=lambda: types.SimpleNamespace(kernel=object()))
    monkeypatch.setitem(sys.modules, "IPython", kernel)
    with pytest.raises(ConfigError) as err:
        rt.resolve_device("cuda")
    msg = str(err.value)
    assert "Runtime > Change runtime type" in msg and 'DEVICE = "cpu"' in msg and "--" not in msg, (
        msg
    )
    assert rt.resolve_device("cpu").type == "cpu"  # what it proposes works
    monkeypatch.delitem(sys.modules, "IPython")
    with pytest.raises(ConfigError, match=r"not available here \(use --device cpu\)$"):
        rt.resolve_device("cuda")


def test_cli_device_tpu_is_one_line_and_exit_2(tmp_path, char_data):
    run_dir = tmp_path / "run"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gptlib",
            "train",
            "--data",
            str(char_data),
            "--run-dir",
            str(run_dir),
            "--device",
            "tpu",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: device='tpu'"), p.stderr
    assert not run_dir.exists()  # refused before the run directory was touched


# --- 3. cuda:N becomes the current device ---------------------------------------------------------------------


def test_cuda_n_becomes_the_current_device(monkeypatch):
    calls = fake_gpu(monkeypatch, count=2)
    assert rt.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert calls == [torch.device("cuda", 1)]


# --- 4. RNG: the training device's CUDA state; a checkpoint from N GPUs resumes on 1 ---------------------------


def fake_cuda_rng(monkeypatch, count=1):
    """Per-device CUDA generator states; setting one on a GPU that is not there fails as CUDA does."""
    states = {i: torch.tensor([i], dtype=torch.uint8) for i in range(count)}

    def index(device):
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        return 0 if device.index is None else device.index

    def get_rng_state(device="cuda"):
        return states[index(device)].clone()

    def set_rng_state(state, device="cuda"):
        i = index(device)
        if i >= count:
            raise RuntimeError("CUDA error: invalid device ordinal")
        states[i] = state.clone()

    def get_rng_state_all():
        raise AssertionError(
            "every GPU's state was read: only the training device's belongs in a checkpoint"
        )

    # set_rng_state_all calls torch.cuda.random.set_rng_state
    for mod in (
        torch.cuda,
        torch.cuda.random,
    ):
        monkeypatch.setattr(mod, "get_rng_state", get_rng_state)
        monkeypatch.setattr(mod, "set_rng_state", set_rng_state)
        monkeypatch.setattr(mod, "get_rng_state_all", get_rng_state_all)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return states


def test_a_checkpoint_saves_only_the_training_devices_cuda_rng(monkeypatch):
    states = fake_cuda_rng(monkeypatch, count=2)
    assert torch.equal(RNG(torch.device("cuda", 1)).state_dict()["torch_cuda"], states[1])
    assert "torch_cuda" not in RNG(torch.device("cpu")).state_dict()  # a CPU run holds no GPU state


def test_a_torchrun_checkpoint_from_4_gpus_resumes_on_1(monkeypatch):
    saved_cpu = torch.get_rng_state()
    states = fake_cuda_rng(monkeypatch, count=1)
    # get_rng_state_all() of 4 GPUs
    old = [torch.tensor([10 + i], dtype=torch.uint8) for i in range(4)]
    RNG(torch.device("cuda", 0)).load_state_dict({"torch_cpu": saved_cpu, "torch_cuda": old})
    assert torch.equal(states[0], old[0])
    assert torch.equal(torch.get_rng_state(), saved_cpu)
    # this device's entry where the list has one; entry 0 past its end; never a GPU that is not there
    fake_cuda_rng(monkeypatch, count=3)
    RNG(torch.device("cuda", 2)).load_state_dict({"torch_cpu": saved_cpu, "torch_cuda": old[:2]})
    assert torch.equal(torch.cuda.get_rng_state(2), old[0])
    RNG(torch.device("cuda", 1)).load_state_dict({"torch_cpu": saved_cpu, "torch_cuda": old})
    assert torch.equal(torch.cuda.get_rng_state(1), old[1])
    new = torch.tensor([99], dtype=torch.uint8)  # today's form: one tensor, the training device's
    RNG(torch.device("cuda", 2)).load_state_dict({"torch_cpu": saved_cpu, "torch_cuda": new})
    assert torch.equal(torch.cuda.get_rng_state(2), new)
    # on a CPU: nothing to set
    RNG(torch.device("cpu")).load_state_dict({"torch_cpu": saved_cpu, "torch_cuda": new})


# --- 5. OOM: wrapped by the compiler, compiled state reset, the probe's margin --------------------------------


def wrapped_oom() -> Exception:
    """What torch.compile raises when the GPU runs out of memory inside a compiled graph: another
    exception whose cause is the OOM."""
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except torch.OutOfMemoryError as oom:
            raise RuntimeError("backend='inductor' raised an error while compiling") from oom
    except RuntimeError as e:
        return e


def test_is_oom_walks_the_cause_chain():
    assert memory.is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    assert memory.is_oom(wrapped_oom())
    try:
        try:
            raise torch.OutOfMemoryError("x")
        except torch.OutOfMemoryError:
            raise ValueError("while handling it")  # noqa: B904 - the implicit context is what is tested
    except ValueError as e:
        assert memory.is_oom(e)
    assert not memory.is_oom(RuntimeError("shape mismatch"))
    loop = RuntimeError("a")
    loop.__context__ = RuntimeError("b")
    loop.__context__.__context__ = loop
    assert not memory.is_oom(loop)  # a cycle ends the walk


def test_a_compiler_wrapped_oom_in_training_gives_the_advice(tmp_path, char_data, monkeypatch):
    import gptlib.training.loop as gtrain

    real = gtrain.train_step
    calls, order = [0], []

    def train_step(*a, **kw):
        calls[0] += 1
        if calls[0] == 3:
            raise wrapped_oom()
        return real(*a, **kw)

    monkeypatch.setattr(gtrain, "train_step", train_step)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: order.append("dynamo reset"))
    monkeypatch.setattr(gtrain, "free_memory", lambda: order.append("free"))
    with pytest.raises(OutOfMemoryAdvice, match="batch_size=4 --set grad_accum_steps=2"):
        gtrain.train(
            char_data, tmp_path / "run", "phase1", TINY, max_steps=5, progress=False, log=quiet
        )
    assert order[:2] == ["dynamo reset", "free"]


class FakeGpuMemory:
    """Peak memory of a try: a fixed part plus a part per sequence, on a GPU of `total` bytes."""

    def __init__(self, total, fixed, per_seq):
        self.total, self.fixed, self.per_seq, self.batch = total, fixed, per_seq, 0

    def reset(self, batch):
        self.batch = batch

    def peak(self):
        return self.fixed + self.per_seq * self.batch


def test_the_probe_keeps_a_margin_for_compiled_training(char_data, monkeypatch):
    from gptlib.model import GPT

    cfg = build_config("phase1", TINY + ["grad_accum_steps=1"])
    model = GPT(cfg.model)
    # 8 sequences: 0.95 of the GPU; 4: 0.55 -> 4 is the largest that leaves the margin
    mem = FakeGpuMemory(total=100 * GIB, fixed=15 * GIB, per_seq=10 * GIB)
    # the model runs here; the memory is a fake
    monkeypatch.setitem(memory.MEMORY_PROBES, "cpu", lambda device: mem)
    logs = []
    got = memory.probe_micro_batch(model, cfg, "cpu", log=logs.append)
    assert got == (4, 2, 55 * GIB) and any(
        "8 x 32 does not fit" in m and "92%" in m for m in logs
    ), logs
    assert memory.PROBE_HEADROOM == 0.92


def test_oom_advice_under_auto_batch_names_a_size_the_probe_keeps(monkeypatch):
    """An OOM in training with auto_batch on (notebook 03's AUTO_BATCH, say on day 2's T4): the advice named
    batch_size=4 alone, which the probe overruled at the next start (it starts from the largest size that it measures
    as fitting): the same size again, the same OOM at every re-run. The advice turns the probe off; in notebook 03,
    where the AUTO_BATCH checkbox sets it after OVERRIDES, by naming the checkbox too. Notebooks 02 and 05 have no
    AUTO_BATCH (auto_batch=true is one of their OVERRIDES): the advice named it alone there, a setting that does not
    exist; auto_batch=false inside OVERRIDES turns it off."""
    import IPython

    from gptlib.model import GPT

    cfg = build_config("phase1", TINY + ["auto_batch=true", "batch_size=8", "grad_accum_steps=2"])
    advised = cfg.updated(re.findall(r"--set (\S+)", memory.oom_advice(cfg)))
    # the probe measures 8 sequences as fitting, as it did before the OOM
    mem = FakeGpuMemory(total=100 * GIB, fixed=GIB, per_seq=GIB)
    monkeypatch.setitem(memory.MEMORY_PROBES, "cpu", lambda device: mem)
    if advised.train.auto_batch:
        cpu = torch.device("cpu")
        advised, _ = memory.fit_micro_batch(advised, GPT(advised.model), cpu, Dist(), quiet)
    assert (advised.train.batch_size, advised.train.grad_accum_steps) == (4, 4)
    monkeypatch.setattr(IPython, "get_ipython", lambda: type("Kernel", (), {"kernel": 1})())
    assert (
        'OVERRIDES = ["auto_batch=false", "batch_size=4", "grad_accum_steps=4", "eval_batches=4"] (in notebook '
        "03: AUTO_BATCH = False too)" in memory.oom_advice(cfg)
    )


def test_following_the_oom_advice_keeps_the_validations_sequences():
    """The OOM advice halves the micro-batch and doubles the accumulation: the same tokens per step. It left
    eval_batches alone, so the run validated on half the sequences from then on (the curve and the best checkpoint
    compared over other ones), which the probe avoids (tests/test_resume.py)."""
    for extra in ([], ["auto_batch=true"]):
        cfg = build_config("phase1", TINY + ["batch_size=8", "grad_accum_steps=2", *extra])
        advised = cfg.updated(re.findall(r"--set (\S+)", memory.oom_advice(cfg))).train
        assert (advised.batch_size, advised.batch_size * advised.eval_batches) == (4, 8 * 2)


def test_data_that_fits_only_by_the_estimate_stays_in_ram(tmp_path, char_data, monkeypatch):
    """What auto_batch measured is kept free beside the data, not only the estimate (issue 26: gpt2-small's estimate
    said 21.2 GiB where the probe had measured an eager peak of 26.6 GiB, and data filled the difference)."""
    from gptlib import batches
    from gptlib.batches import plan_data
    from gptlib.training import run as setup
    from gptlib.training.loop import train

    # 4 sequences: an 18 GiB peak
    mem = FakeGpuMemory(total=40 * GIB, fixed=10 * GIB, per_seq=2 * GIB)
    # the real probe; only the memory is a fake
    monkeypatch.setitem(memory.MEMORY_PROBES, "cpu", lambda device: mem)
    reserved, real_load = [], setup.place_dataset
    monkeypatch.setattr(
        setup,
        "place_dataset",
        lambda *a, **kw: reserved.append(kw["reserve_gpu_bytes"]) or real_load(*a, **kw),
    )
    settings = TINY + ["auto_batch=true", "batch_size=4", "grad_accum_steps=1"]
    train(
        char_data,
        tmp_path / "run",
        "phase1",
        settings,
        max_steps=1,
        device="cpu",
        progress=False,
        log=quiet,
    )
    cfg = RunConfig.from_dict(json.loads((tmp_path / "run" / "config.json").read_text()))
    assert cfg.train.batch_size == 4  # the probe's choice
    estimate = start.estimate_train_bytes(cfg.model, 4)
    # the measured peak, far above this tiny model's estimate
    assert reserved == [18 * GIB] and estimate < GIB
    # 10 GiB of tokens fit 85% of 20 GiB free beside the estimate, not beside the peak
    data = 10 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * GIB, 40 * GIB))
    monkeypatch.setattr(batches, "available_ram", lambda: 64 * GIB)
    assert plan_data(data, "cuda", reserve_gpu_bytes=estimate).where == "gpu"
    assert plan_data(data, "cuda", reserve_gpu_bytes=reserved[0]).where == "ram"


@pytest.mark.parametrize(
    "gpu,total,tight",
    [
        ("Tesla T4", 15_828_320_256, True),
        ("NVIDIA L4", 23_580_639_232, False),
        ("NVIDIA A100-SXM4-40GB", 42_298_834_944, False),
    ],
)
def test_gpt2_small_near_a_gpus_memory_is_measured_not_trusted(monkeypatch, gpu, total, tight):
    """gpt2-small's defaults (16 x 1024 per micro-batch, auto_batch off) on a 16 GB T4: estimated at 13.4 GiB of its
    14.7, which check_fits let through, then minutes of compiling, then an OOM. Now an estimate over 80% of the GPU
    is measured by auto_batch's probe; on an L4 or A100 the preset's micro-batch stays."""
    fake_gpu(
        monkeypatch, gpu, (8, 9) if "L4" in gpu else (7, 5) if "T4" in gpu else (8, 0), total=total
    )
    why = start.check_fits(get_preset("gpt2-small"), CUDA)
    assert bool(why) == tight, why
    if tight:
        assert why == (
            "batch_size=16 x block_size=1,024 is estimated at 13.4 GiB of the GPU's 14.7 GiB: measuring "
            "the largest micro-batch that fits instead"
        )
    assert start.check_fits(get_preset("gpt2-small").updated({"auto_batch": True}), CUDA) == ""


def test_a_tight_estimate_runs_the_probe_in_training(tmp_path, char_data, monkeypatch):
    from gptlib.training import start as setup
    from gptlib.training.loop import train

    # 4 sequences: 42 GiB; 2: 26 GiB
    mem = FakeGpuMemory(total=40 * GIB, fixed=10 * GIB, per_seq=8 * GIB)
    # the real probe; only the memory is a fake
    monkeypatch.setitem(memory.MEMORY_PROBES, "cpu", lambda device: mem)
    monkeypatch.setattr(setup, "check_fits", lambda cfg, device: "estimated near the GPU's memory")
    logs = []
    train(
        char_data,
        tmp_path / "run",
        "phase1",
        TINY + ["batch_size=4", "grad_accum_steps=1"],
        max_steps=1,
        device="cpu",
        progress=False,
        log=logs.append,
    )
    tc = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert (tc["batch_size"], tc["grad_accum_steps"], tc["auto_batch"]) == (2, 2, False)
    assert "auto micro-batch: estimated near the GPU's memory" in logs, logs


@pytest.mark.parametrize("auto", [[], ["auto_batch=true"]])
def test_after_an_oom_a_tight_estimates_probe_keeps_the_advised_size(
    tmp_path, char_data, monkeypatch, auto
):
    """A model near the GPU's size (its estimate over 80% of the GPU at any micro-batch: check_fits measures it):
    the probe took 4 of the step's 8 sequences (an eager peak within 92%) and training ran out of memory at 4
    (compile's own memory). The advice said batch_size=2, grad_accum_steps=4 (and auto_batch=false); the re-run's
    probe started again from 8 and took 4: the same OOM at every re-run. A probe with auto_batch off tries no
    micro-batch above the one asked for."""
    from gptlib.training.loop import train

    advice = memory.oom_advice(
        build_config("phase1", TINY + auto + ["batch_size=4", "grad_accum_steps=2"])
    )
    # 8 sequences: 74 GiB; 4: 42 GiB, within 92% of the GPU, as the probe measured before the OOM
    mem = FakeGpuMemory(total=50 * GIB, fixed=10 * GIB, per_seq=8 * GIB)
    # the real probe; only the memory is a fake
    monkeypatch.setitem(memory.MEMORY_PROBES, "cpu", lambda device: mem)
    monkeypatch.setattr(start, "check_fits", lambda cfg, device: "estimated near the GPU's memory")
    # the setting to try, not the alternative after it (auto_batch=true)
    settings = TINY + auto + re.findall(r"--set (\S+)", advice.split("(same")[0])
    train(
        char_data,
        tmp_path / "run",
        "phase1",
        settings,
        max_steps=1,
        device="cpu",
        progress=False,
        log=quiet,
    )
    tc = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert (tc["batch_size"], tc["grad_accum_steps"], tc["auto_batch"]) == (2, 4, False)


def test_the_estimate_counts_an_untied_head_and_eager_cross_entropy():
    """An untied head is weights, grads and two AdamW moments more (16 B per parameter); eager cross-entropy holds
    14 B per logit: the bf16 logits (2), their fp32 copy (4), log-softmax (4) and its gradient (4)."""
    tied = get_preset("gpt2-small").model
    untied = dataclasses.replace(tied, tie_embeddings=False)
    V, C, T, L = tied.padded_vocab_size, tied.n_embd, tied.block_size, tied.n_layer
    assert start.estimate_train_bytes(untied, 1) - start.estimate_train_bytes(tied, 1) == 16 * V * C
    assert start.estimate_train_bytes(tied, 2) - start.estimate_train_bytes(tied, 1) == T * (
        34 * L * C + 14 * V
    )


# --- 6. compile=auto only where compiling pays -------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset,device,setting,want",
    [
        ("phase1", CUDA, "auto", False),
        ("gpt2-small", CUDA, "auto", True),
        ("phase2", CUDA, "auto", True),
        ("gpt2-small", torch.device("cpu"), "auto", False),
        ("phase1", CUDA, "on", True),
        ("gpt2-small", CUDA, "off", False),
    ],
)
def test_compile_auto_pays_for_itself(monkeypatch, preset, device, setting, want):
    from gptlib.training.run import wrap_for_training

    fake_gpu(monkeypatch, "NVIDIA A100-SXM4-40GB", (8, 0))
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda m, **kw: compiled.append(m) or m)
    cfg = get_preset(preset).updated({"compile": setting})
    _, on = wrap_for_training(torch.nn.Linear(2, 2), cfg, device, Dist())
    assert on == want and len(compiled) == int(want)


def test_compile_auto_weighs_the_steps_left_not_the_whole_run(monkeypatch):
    """A resume of gpt2-small with 5 steps to go (a few seconds on an A100) does not pay a 1-5 minute compile; one
    with most of the run ahead does. Was: decided on the whole run, so every resume compiled."""
    from gptlib.training.run import wrap_for_training

    fake_gpu(monkeypatch, "NVIDIA A100-SXM4-40GB", (8, 0))
    monkeypatch.setattr(torch, "compile", lambda m, **kw: m)
    cfg = get_preset("gpt2-small")
    steps = cfg.train.max_steps
    assert [
        wrap_for_training(torch.nn.Linear(2, 2), cfg, CUDA, Dist(), start)[1]
        for start in (0, steps // 2, steps - 5)
    ] == [True, True, False]


# --- 7. matmul precision -----------------------------------------------------------------------------------------


def test_cuda_fp32_matmuls_use_the_precision_api(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA A100-SXM4-40GB", (8, 0))
    calls = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", calls.append)
    rt.configure_matmul(CUDA)
    assert calls == ["high"]
    rt.configure_matmul(torch.device("cpu"))
    assert calls == ["high"]  # the CPU keeps full fp32


# --- 9. a GPU preset on a CPU -------------------------------------------------------------------------------------


def test_a_gpu_preset_on_a_cpu_runtime_is_refused_with_the_estimate(
    tmp_path, char_data, monkeypatch
):
    from gptlib.training.loop import train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as e:
        # device auto -> this CPU
        train(char_data, tmp_path / "run", "phase2", progress=False, log=quiet)
    msg = str(e.value)
    assert (
        "phase2" in msg and "hours" in msg and "Runtime > Change runtime type > A100 GPU" in msg
    ), msg
    assert "--device cpu" in msg  # the way to run it here anyway
    assert (
        not (tmp_path / "run" / "checkpoints").exists()
        and not (tmp_path / "run" / "config.json").exists()
    )


def test_a_short_gpu_preset_run_on_cpu_gets_no_gpu_advice(tmp_path, char_data):
    """Notebook 05 on a tiny base (issue 26): 'would take about 0m02s ... change runtime type to A100' for a run of
    27 s. A run estimated under CPU_ADVISE_S trains with a note of its estimate, no advice to switch, and no 'meant
    for a GPU' beside a 15-second estimate."""
    from gptlib.training.loop import train

    logs = []
    r = train(
        char_data,
        tmp_path / "run",
        "finetune",
        TINY + ["grad_accum_steps=1"],
        max_steps=4,
        device="cpu",
        progress=False,
        log=logs.append,
    )
    assert r.step == 4
    note = [m for m in logs if m.startswith("on this CPU (")]
    assert len(note) == 1 and re.search(
        r"GFLOP/s measured\): about 0m\d\ds for the 4 steps to go$", note[0]
    ), logs
    assert not any("Change runtime type" in m or "meant for a GPU" in m for m in logs), logs


def test_a_long_gpu_preset_run_on_cpu_still_gets_the_advice(monkeypatch):
    """Between CPU_ADVISE_S and CPU_REFUSE_S: the advice in the log, whether device was auto or cpu."""
    cfg = get_preset("finetune").updated(["n_layer=2", "n_embd=64", "n_head=2", "block_size=64"])
    secs = measure.estimate_cpu_seconds(cfg, 0, 1e11)
    # the estimate, whatever this CPU
    monkeypatch.setattr(measure, "cpu_train_flops", lambda seconds=0.2: 1e11)
    monkeypatch.setattr(measure, "CPU_ADVISE_S", secs / 2)
    for requested in ("auto", "cpu"):
        logs = []
        measure.check_cpu_run(cfg, requested, 0, logs.append)
        assert len(logs) == 1 and "Runtime > Change runtime type > A100 GPU" in logs[0], logs
    monkeypatch.setattr(measure, "CPU_ADVISE_S", secs * 2)
    logs = []
    measure.check_cpu_run(cfg, "auto", 0, logs.append)
    assert len(logs) == 1 and "Change runtime type" not in logs[0], logs


def test_a_session_time_boxed_by_max_minutes_is_not_refused():
    """phase2 for 2 minutes on a CPU (max_minutes): the session ends then, so it is not refused as a 200-hour run;
    the log says both (it was refused with "shorten the run (--set max_steps=N)")."""
    cfg = get_preset("phase2").updated({"max_minutes": 2.0})
    logs = []
    measure.check_cpu_run(cfg, "auto", 0, logs.append)
    assert (
        len(logs) == 1
        and "hours" in logs[0]
        and "this session stops after 2m00s (max_minutes)" in logs[0]
    ), logs
    with pytest.raises(
        ConfigError
    ):  # a budget that is itself longer than an hour: refused as before
        measure.check_cpu_run(cfg.updated({"max_minutes": 120.0}), "auto", 0, print)


def test_a_gpu_preset_refused_on_a_cpu_in_a_notebook_names_its_settings(monkeypatch):
    """Notebook 03 opened on a CPU runtime: the refusal said 'ask for it with --device cpu (device='cpu'), or shorten
    the run (--set max_steps=N)', flags a notebook has none of (03's length is TOKEN_BUDGET_M, through its plan);
    and for gpt2-small, whose one step takes hours here, no length is short enough. In a notebook it names DEVICE and
    03's TOKEN_BUDGET_M (05's MAX_STEPS), shortening only where a step fits; following it, the run is not refused."""
    monkeypatch.setattr(measure, "cpu_train_flops", lambda seconds=0.2: 1e11)
    kernel = types.SimpleNamespace(get_ipython=lambda: types.SimpleNamespace(kernel=object()))
    monkeypatch.setitem(sys.modules, "IPython", kernel)
    for preset, length in (
        ("gpt2-small", None),
        ("phase2", "TOKEN_BUDGET_M"),
        ("finetune", "MAX_STEPS"),
    ):
        with pytest.raises(ConfigError) as err:
            measure.check_cpu_run(get_preset(preset), "auto", 0, print)
        msg = str(err.value)
        assert 'set DEVICE = "cpu"' in msg and "--" not in msg and "max_steps" not in msg, msg
        assert (
            (f"shorten the run (a smaller {length})" in msg) if length else ("shorten" not in msg)
        ), msg
    # notebook 03's plan for a TOKEN_BUDGET_M of one phase2 step: trained here, with the estimate said
    plan = measure.plan_run("phase2", tokens=0.06e6, device="cpu")
    logs = []
    measure.check_cpu_run(
        get_preset("phase2").updated({"max_steps": plan.max_steps}), "auto", 0, logs.append
    )
    assert plan.max_steps == 1 and len(logs) == 1 and "Change runtime type" in logs[0], logs
    # a session time-boxed in the notebook says its setting
    with pytest.raises(ConfigError, match=r"this session stops after 2h00m \(TIME_BUDGET_MIN\)"):
        measure.check_cpu_run(
            get_preset("phase2").updated({"max_minutes": 120.0}), "auto", 0, print
        )
    monkeypatch.delitem(sys.modules, "IPython")
    with pytest.raises(ConfigError, match=r"--device cpu \(device='cpu'\)\.?$"):
        measure.check_cpu_run(get_preset("gpt2-small"), "auto", 0, print)
    with pytest.raises(ConfigError, match=r"shorten the run \(--set max_steps=N\)$"):
        measure.check_cpu_run(get_preset("phase2"), "auto", 0, print)


def test_explicit_cpu_runs_a_long_gpu_preset_with_a_warning(capsys):
    cfg = get_preset("phase2")
    logs = []
    # asked for: a warning, not an error
    measure.check_cpu_run(cfg, "cpu", 0, logs.append)
    err = capsys.readouterr().err
    assert "phase2" in err and "hours" in err and "Change runtime type" in err, err


def test_the_cpu_estimate_counts_what_the_run_does():
    """Training FLOPs below the matmul rate, a fixed cost per layer pass (all a tiny model's time), and each
    validation's batches and samples (benchmarks/cpu_estimate.py compares it with real runs)."""
    from gptlib.model import model_size

    # notebook 05's tiny base: 60 steps of 4 micro-batches, validations at 50 and 60 (20 batches, 100 sampled tokens)
    cfg = get_preset("finetune").updated(
        ["n_layer=2", "n_embd=32", "n_head=2", "block_size=64", "vocab_size=304", "max_steps=60"]
    )
    secs = measure.estimate_cpu_seconds(cfg, 0, flops_per_s=1e11)
    # the estimate before
    flops_only = measure.run_tokens(cfg) * model_size(cfg.model).flops_per_token / 1e11
    assert secs > 5 * flops_only  # the layer passes: 0.3 s of FLOPs, 2.7 s measured
    more = {"eval_batches": 40, "sample_tokens": 200, "eval_interval": 10, "max_steps": 120}
    for name, value in more.items():
        assert (
            measure.estimate_cpu_seconds(cfg.updated({name: value}), 0, flops_per_s=1e11) > secs
        ), name
    # resumed: only the steps to go
    assert measure.estimate_cpu_seconds(cfg, 30, flops_per_s=1e11) < secs
    rate = measure.cpu_train_flops()
    assert 1e8 < rate < 1e14  # a real CPU, measured now


# --- 10. the torch floor -----------------------------------------------------------------------------------------


def test_the_declared_torch_floor_has_torch_out_of_memory_error():
    text = (REPO / "pyproject.toml").read_text()
    # torch.OutOfMemoryError (caught by train and the probe) arrived in 2.5
    assert '"torch>=2.5"' in text


# --- 11. Colab compute units: the runtime from the GPU's name and memory, and the user's own rate ----------------


@pytest.mark.parametrize(
    "name,memory,rate",
    [  # the runtimes: A100 40GB and 80GB, T4, L4, G4, none
        ("NVIDIA A100-SXM4-40GB", int(39.4 * GIB), 5.40),
        ("NVIDIA A100-SXM4-80GB", int(79.2 * GIB), 7.52),
        ("NVIDIA A100-PCIE", int(79.2 * GIB), 7.52),
        ("NVIDIA A100-PCIE", int(39.4 * GIB), 5.40),
        ("Tesla T4", 15 * GIB, 1.19),
        ("NVIDIA L4", 22 * GIB, 1.71),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 95 * GIB, 8.71),
        ("NVIDIA H100 80GB HBM3", 80 * GIB, None),
    ],
)
def test_colab_units_per_hour_from_the_gpus_name_and_memory(monkeypatch, name, memory, rate):
    """The memory tells an 80 GB A100 from a 40 GB one (the name need not say); a GPU without a rate has none."""
    fake_gpu(monkeypatch, name, (8, 0), total=memory)
    assert measure.device_peak(CUDA).units_per_hour == rate
    # the user's rate wins
    assert measure.device_peak(CUDA, units_per_hour=3.0).units_per_hour == 3.0


def test_the_plan_takes_the_users_colab_rate(monkeypatch):
    import re

    fake_gpu(monkeypatch, "NVIDIA A100-SXM4-40GB", (8, 0), total=int(39.4 * GIB))
    table = measure.plan_run("gpt2-small", tokens=1e11, device="cuda")
    mine = measure.plan_run("gpt2-small", ["colab_units_per_hour=2.7"], tokens=1e11, device="cuda")
    assert "5.4 Colab units per hour (gptlib table" in table.summary, table.summary
    assert "2.7 Colab units per hour (yours)" in mine.summary

    def units(plan):  # the gpt2 and the modern recipe's estimates
        return [int(u.replace(",", "")) for u in re.findall(r"~([\d,]+) Colab units", plan.summary)]

    assert len(units(table)) == 2 and all(
        t / m == pytest.approx(2.0, rel=0.01) for t, m in zip(units(table), units(mine))
    )


def test_the_plan_speaks_of_colab_units_only_on_colab(monkeypatch):
    """Notebook 03 on a CPU away from Colab: nothing about units; on Colab, a device without a rate asks for one."""
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    plan = measure.plan_run("gpt2-small", tokens=1e9, device="cpu")
    assert (
        "Colab" not in plan.summary
        and "device: MFU unknown on cpu (no peak table for it)\n" in plan.summary
    )
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_20260301")
    plan = measure.plan_run("gpt2-small", tokens=1e9, device="cpu")
    assert "; Colab units per hour unknown for it (set COLAB_UNITS_PER_HOUR)\n" in plan.summary, (
        plan.summary
    )


def test_the_metrics_take_the_users_colab_rate(tmp_path, char_data):
    """--set colab_units_per_hour: the rate colab_units_left uses, on any device (here the CPU, which has none)."""
    from gptlib.training.logs import read_metrics
    from gptlib.training.loop import train

    for rate in (0.0, 3.6):
        run = tmp_path / f"run{rate}"
        train(
            char_data,
            run,
            "phase1",
            TINY + [f"colab_units_per_hour={rate}", "eval_interval=10000000"],
            max_steps=10_000_000,
            max_minutes=0.05,
            device="cpu",
            progress=False,
            log=quiet,
        )
        rows = [r for r in read_metrics(run) if r.get("eta_s")]
        assert rows, read_metrics(run)
        if rate:
            assert all(
                r["colab_units_left"] == pytest.approx(rate * r["eta_s"] / 3600, abs=0.01)
                for r in rows
            )
            assert rows[-1]["colab_units_left"] > 0.1
        else:  # gptlib's table has no rate for a CPU
            assert all(r["colab_units_left"] is None for r in rows)
