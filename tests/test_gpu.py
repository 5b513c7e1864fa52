"""The GPU acceptance suite: tests marked `gpu`, run by `bash benchmarks/gpu_check.sh` on a lent GPU in parts that each
fit one call (`--list` names them; part 1 is what a Colab user meets first). One pytest process per part: a part's tests
share its data and compiled runs.

The same tests run on a CPU in CI, at a size of seconds (DEVICE and the sizes below), so that every line but the CUDA
calls has run before a GPU's few minutes are spent on it; scripts/gpu_sim.sh also runs part 1 from a copy of the tree as
the GPU machine gets it. What only a GPU can give (MFU, GPU memory, NCCL) is asserted where CUDA is.

The data is made here, from this Python's standard library sources (every machine has them; ../shared does not
travel to the GPU machine). Each test records what it measured (printed, and appended to the part's results file,
RESULTS/gpu_<device>_<part>.txt); each subprocess's output goes, as it comes, to the part's .children.log beside it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

from gptlib.checkpoint.format import TrainState, load_checkpoint
from gptlib.errors import OutOfMemoryAdvice
from gptlib.training import memory, start
from gptlib.training.logs import read_metrics
from gptlib.training.loop import train
from gptlib.training.memory import free_memory
from gptlib.training.resume import StartOptions
from tests import faulty
from tests.conftest import REPO, TINY, newest_checkpoint
from tests.test_runtime import GIB, FakeGpuMemory

gpu = pytest.mark.gpu

# Where the tests run: the GPU at full size, else the CPU at a size of seconds. On a CPU, torch.compile uses the
# aot_eager backend: dynamo and AOT autograd trace gptlib's model as on a GPU (graph breaks and recompiles show), but
# inductor's C++ build for a CPU, ~40 s a graph on 2 cores, is not what a GPU runs (Triton).
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
CPU_COMPILE_BACKEND = "aot_eager"
# gpt2-small's shape and tokens per step on a CPU, and an LR that moves such a model in 20 steps (overrides of the
# preset; none on a GPU)
SMALL = [] if CUDA else ["block_size=64", "n_layer=2", "n_head=2", "n_embd=64"]
SMALL += [] if CUDA else ["batch_size=4", "grad_accum_steps=2", "learning_rate=1e-2"]
# of Python sources: on a GPU ~4.5M tokens in a 32K BPE, ~3 epochs' worth for part 1's 20 gpt2-small steps
GPU_TEXT_MB = 16 if CUDA else 0.4
GPT2_VOCAB = 32768 if CUDA else 1024
BPE_VOCAB = 4096 if CUDA else 512
BPE_TEXT_CHARS = 2_000_000 if CUDA else 300_000
BPE_STEPS = 30
# A small model of gpt2-small's family (pre-LN, no bias, padded vocab, the preset's optimizer settings) on
# byte-level BPE: compiles in well under a minute. Overrides of the gpt2-small preset.
GPT2ISH = [
    "block_size=256",
    "n_layer=4",
    "n_head=4",
    "n_embd=256",
    "batch_size=16",
    "grad_accum_steps=2",
    "learning_rate=1e-3",
    "warmup_steps=5",
    "eval_interval=15",
    "eval_batches=4",
    "log_interval=1",
    "sample_tokens=16",
    "save_every_minutes=0",
    "keep_every=0",
    "hellaswag_every=0",
] + SMALL
# compiled vs eager: the first 15 losses within 2% (bf16 keeps ~3 digits)
COMPARE_STEPS, BF16_RTOL = 15, 0.02
# Resume: saves at 5, 10, 15; the kill at 17 lands after the step-15 save (or while it is still written).
RESUME_STEPS, KILL_AT = 30, 17
RESUME = GPT2ISH + [
    "dropout=0.1",
    "save_every_steps=5",
    "eval_interval=10",
    "eval_batches=2",
    "sample_tokens=0",
    "dtype=bfloat16",
    "compile=off",
]
# a resume that loses state (batches, moments) jumps by ~0.1-1 nats
NOISE_FACTOR, NOISE_FLOOR = 10.0, 0.05
# sequences per step for the auto micro-batch probe: 2048 x 512 tokens does not fit 80 GB at once
AUTO_SEQS, AUTO_BLOCK = (2048, 512) if CUDA else (8, 32)
DECODE_TOKENS = 80  # past the 32-token context of the TINY model
PROMPTS = ["def ", "class Reader:\n    "]  # the char data is Python source
# notebook 02's preset on the GPU; on a CPU the tests of tests/test_notebook_02.py train it
PHASE1_STEPS = 1500 if CUDA else 100
# the KV-cache test's training: enough for tokens that are not all one character
KV_STEPS = 150 if CUDA else 30

# Part 1: gpt2-small at full size as a Colab user first trains it, 20 steps (a save at 10), the LR warmed up in 5.
FIRST_STEPS, FIRST_SAVE = 20, 10
FIRST = [
    "warmup_steps=5",
    "eval_interval=10",
    "eval_batches=4",
    "save_every_steps=10",
    "sample_tokens=32",
    "hellaswag_every=0",
    "keep_every=0",
    "log_interval=1",
    "save_every_minutes=0",
    "auto_batch=true",
    "dtype=bfloat16",
] + SMALL
# A resumed run's losses against the uninterrupted run's, per step: equal where the kernels are deterministic; flash
# attention's and the embedding's backward add with atomics, so a few 1e-3 nats are run-to-run noise, while a resume
# that lost state (moments, batches, RNG) is off by 0.1-1 nats.
RESUME_TOL = 0.02


# --- helpers (also checked on CPU below) -------------------------------------------------------------------


def results_dir() -> Path:
    """GPTLIB_GPU_RESULTS (gpu_check.sh sets it), else a temporary folder: a test run never writes into the
    repository's benchmarks/results/."""
    global _RESULTS
    if os.environ.get("GPTLIB_GPU_RESULTS"):
        return Path(os.environ["GPTLIB_GPU_RESULTS"])
    if _RESULTS is None:
        _RESULTS = Path(tempfile.mkdtemp(prefix="gptlib-gpu-results-"))
    return _RESULTS


_RESULTS: Path | None = None


def device_tag() -> str:
    """The GPU's name for file names: 'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3' (gpu_check.sh's tag)."""
    name = os.environ.get("GPTLIB_GPU_TAG") or (
        torch.cuda.get_device_name(0) if CUDA else "no CUDA GPU"
    )
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


def part_file(suffix: str) -> Path:
    """RESULTS/gpu_<device>_<part><suffix>: the part's files (GPTLIB_GPU_PART, set by gpu_check.sh)."""
    part = os.environ.get("GPTLIB_GPU_PART") or "tests"
    results_dir().mkdir(parents=True, exist_ok=True)
    return results_dir() / f"gpu_{device_tag()}_{part}{suffix}"


def record(what: str, lines: list[str]) -> Path:
    """A measurement: printed (gpu_check.sh keeps pytest's output) and appended, as it is made, to the part's results
    file under a header naming it, the test, the device, the torch version and the date: a part cut off at its time
    limit keeps what it measured."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    header = [
        f"=== {what}: {test}",
        f"device: {torch.cuda.get_device_name(0) if CUDA else 'no CUDA device'}, "
        f"torch {torch.__version__}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC",
    ]
    text = "\n".join(header + lines) + "\n\n"
    print(text)
    path = part_file(".txt")
    with open(path, "a") as f:
        f.write(text)
    return path


def attention_kernel(
    dtype: torch.dtype, heads: int = 12, head_dim: int = 64, seq: int = 1024
) -> str:
    """The kernel torch's SDPA picks on this device for the model's attention (causal, no mask) at this shape, under
    the current settings: what the runs of a part train with (the GPU check writes it into the part's .txt)."""
    from torch.nn.attention import SDPBackend

    q = torch.empty(1, heads, seq, head_dim, device=DEVICE, dtype=dtype)
    return SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)).name.lower()


def loss_curve(run_dir) -> dict[int, float]:
    """step -> train loss from metrics.jsonl; a step logged twice is an error (a resume re-logged it)."""
    rows = read_metrics(run_dir)
    steps = [r["step"] for r in rows]
    twice = sorted({s for s in steps if steps.count(s) > 1})
    assert not twice, f"{run_dir}/metrics.jsonl logs steps {twice} twice"
    return {r["step"]: r["train_loss"] for r in rows}


def step_diffs(a: dict[int, float], b: dict[int, float], steps) -> dict[int, float]:
    """|a - b| at each of `steps`; a step missing from either curve is an error naming it."""
    steps = list(steps)
    missing = [s for s in steps if s not in a or s not in b]
    assert not missing, f"steps missing from a loss curve: {missing[:10]}"
    return {s: abs(a[s] - b[s]) for s in steps}


def max_rel_diff(a: dict[int, float], b: dict[int, float], steps) -> tuple[float, int]:
    """The largest |a - b| / |b| over `steps`, and the step where it is."""
    d = {s: v / max(abs(b[s]), 1e-12) for s, v in step_diffs(a, b, steps).items()}
    worst = max(d, key=d.get)
    return d[worst], worst


@dataclass
class ResumeVerdict:
    ok: bool
    limit: float  # what the resumed run's difference may reach: NOISE_FACTOR x the noise, at least NOISE_FLOOR
    resumed_max: float
    resumed_mean: float
    noise_max: float
    noise_mean: float
    worst_step: int

    def line(self) -> str:
        return (
            f"resumed vs uninterrupted: max {self.resumed_max:.2e} (step {self.worst_step}), mean "
            f"{self.resumed_mean:.2e}; two uninterrupted runs: max {self.noise_max:.2e}, mean {self.noise_mean:.2e}; "
            f"limit {self.limit:.2e} = max({NOISE_FACTOR:g} x noise, {NOISE_FLOOR:g}) -> "
            f"{'ok' if self.ok else 'TOO FAR'}"
        )


def resume_verdict(
    resumed: dict[int, float],
    noise: dict[int, float],
    factor: float = NOISE_FACTOR,
    floor: float = NOISE_FLOOR,
) -> ResumeVerdict:
    """Per-step differences after the resume point (resumed vs uninterrupted) against the run-to-run noise
    (two uninterrupted runs, same steps): within `factor` x the noise's maximum, or `floor`, whichever is larger."""
    limit = max(factor * max(noise.values()), floor)
    worst = max(resumed, key=resumed.get)
    return ResumeVerdict(
        ok=resumed[worst] <= limit,
        limit=limit,
        resumed_max=resumed[worst],
        resumed_mean=statistics.fmean(resumed.values()),
        noise_max=max(noise.values()),
        noise_mean=statistics.fmean(noise.values()),
        worst_step=worst,
    )


def step_seconds(rows: list[dict]) -> tuple[float, float]:
    """(the first step's seconds, the median of the others'), from metrics.jsonl rows logged every step: the first
    step of a compiled run holds the compile."""
    elapsed = {r["step"]: r["elapsed_s"] for r in rows if "elapsed_s" in r}
    steps = sorted(elapsed)
    per_step = [elapsed[b] - elapsed[a] for a, b in zip(steps, steps[1:]) if b == a + 1]
    return elapsed[steps[0]], statistics.median(per_step)


def code_text(path: Path, megabytes: float) -> Path:
    """`megabytes` of this Python's standard library sources (sorted, files under 1 MB) as one text file."""
    parts, size = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = f.read_text(encoding="utf-8") if f.stat().st_size < 1 << 20 else ""
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        size += len(text.encode())
        if size >= megabytes * 1e6:
            break
    path.write_text("\n".join(parts))
    return path


def _env() -> dict[str, str]:
    """Subprocess environment: this checkout first on PYTHONPATH, whatever gpu_check.sh added kept after it."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }


def gptlib_cmd(*args, fault: str | None = None) -> list[str]:
    """`python -m gptlib ARGS` (`python SCRIPT ARGS` where the first is a .py file) as a user runs it, through
    tests/faulty.py for a fault, and on a CPU with its compile backend (CPU_COMPILE_BACKEND). GPTLIB_TEST_FAULT adds a
    fault to every one (tests/test_gpu_check.py hangs a step with it)."""
    backend = None if CUDA else f"backend={CPU_COMPILE_BACKEND}"
    spec = [fault, backend, os.environ.get("GPTLIB_TEST_FAULT")]
    return faulty.gptlib_cmd(",".join(filter(None, spec)), *args)


def _run(cmd: list, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """A subprocess under a time limit that fails the test with its output, never hangs it. Its stdout and stderr go,
    as they come, to the part's .children.log, so what it printed survives the GPU check's kill of a hung step (a stack
    dump: gpu_check.sh sets PYTHONFAULTHANDLER). -> its return code, and that output as stdout."""
    log = part_file(".children.log")
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    with open(log, "ab") as f:
        f.write(f"\n=== {test}: {' '.join(map(str, cmd))}\n".encode())
        f.flush()
        start = f.tell()
        proc = subprocess.Popen(
            [str(c) for c in cmd],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
        # A blocking wait, killed by a timer, not Popen.wait(timeout): that one polls, and a thread running Python code
        # at the GPU check's SIGABRT can crash the stack dump of this process (faulthandler reads every thread's
        # frames unlocked), losing the stacks the dump is for. Seen in CI, 1 in ~35 tries here with a poll loop.
        killed = []
        killer = threading.Timer(timeout, lambda: (killed.append(True), proc.kill()))
        killer.daemon = True
        killer.start()
        rc = proc.wait()
        killer.cancel()
        timed_out = bool(killed)
    with open(log, "rb") as f:
        f.seek(start)
        out = f.read().decode(errors="replace")
    if timed_out:
        pytest.fail(
            f"{' '.join(map(str, cmd))[:300]} did not finish in {timeout} s; its output:\n{out[-8000:]}"
        )
    return subprocess.CompletedProcess(cmd, rc, out, "")


def _tail(p: subprocess.CompletedProcess) -> str:
    return f"rc={p.returncode}\n{p.stdout[-8000:]}"


def _train(data, run_dir, preset, overrides, **kw):
    """train() on this device, quietly; -> (TrainResult, the lines it logged)."""
    logs: list[str] = []
    r = train(
        data, run_dir, preset, overrides, device=DEVICE, progress=False, log=logs.append, **kw
    )
    return r, logs


def _model_line(logs: list[str]) -> str:
    return next((m for m in logs if m.startswith("model:")), f"no 'model:' line in {logs[:5]}")


def _on_device(line: str, dtype: str | None = None) -> bool:
    """The 'model:' line names this device (and the dtype)."""
    return re.search(rf"device {DEVICE}(:\d+)?, {dtype or ''}", line) is not None


def _graphs() -> int:
    """Graphs torch.compile produced in this process (dynamo's counter): proves a run did compile."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _host_ram() -> str:
    import psutil

    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return (
        f"host RAM of this process: {rss / 2**30:.1f} GiB now, {peak / 2**30:.1f} GiB at its peak"
    )


def _gpu_memory(what: str, nbytes) -> str:
    """A line of GPU memory figures, or what a CPU run has instead."""
    return f"{what} {nbytes() / 2**30:.1f} GiB" if CUDA else f"{what}: no GPU (a CPU run)"


@contextlib.contextmanager
def memory_probe_on_cpu(total: int, fixed: int, per_seq: int):
    """On a CPU, the auto micro-batch probe measures a fake GPU of `total` bytes (tests/test_runtime.py's
    FakeGpuMemory: `fixed` + `per_seq` per sequence): the probe's own code runs, its sizes and its log; on a GPU the
    GPU's own memory is measured."""
    with pytest.MonkeyPatch.context() as mp:
        if not CUDA:
            mp.setitem(
                memory.MEMORY_PROBES, "cpu", lambda device: FakeGpuMemory(total, fixed, per_seq)
            )
        yield


@pytest.fixture(scope="module", autouse=True)
def _compile_backend():
    """On a CPU, in-process runs compile with CPU_COMPILE_BACKEND (subprocesses: gptlib_cmd)."""
    with pytest.MonkeyPatch.context() as mp:
        if not CUDA:
            compile_ = functools.partial(torch.compile, backend=CPU_COMPILE_BACKEND)
            mp.setattr(torch, "compile", compile_)
        yield


@pytest.fixture(scope="module", autouse=True)
def _attention_kernels():
    """Which attention kernel this part's runs get, written first into its .txt (a T4's: benchmarks/t4_emulate.py's
    own line)."""
    lines = [
        f"{name}: {attention_kernel(getattr(torch, name))}" for name in ("bfloat16", "float16")
    ]
    if CUDA:
        cap = torch.cuda.get_device_capability()
        lines.append(
            f"compute capability {cap[0]}.{cap[1]}, cuDNN {torch.backends.cudnn.version()}"
        )
    record("attention kernel at gpt2-small's shape (12 heads x 64, 1,024 tokens, causal)", lines)
    yield


@pytest.fixture(autouse=True)
def _fresh_compile_state(request):
    """Each GPU test starts as a new process would: no compiled graphs left (dynamo's recompile limit would
    otherwise turn later compiles into silent eager runs), and its GPU memory is returned after it."""
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    torch._dynamo.reset()
    yield
    free_memory()


# --- data: made here, from this Python's own sources ------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_text(tmp_path_factory) -> Path:
    return code_text(tmp_path_factory.mktemp("gpu_text") / "code.txt", GPU_TEXT_MB)


@pytest.fixture(scope="module")
def gpu_small_text(gpu_text, tmp_path_factory) -> Path:
    """The first 200,000 characters (the char-level tests' and notebook 02's text)."""
    p = tmp_path_factory.mktemp("gpu_small") / "small.txt"
    p.write_text(gpu_text.read_text()[:200_000])
    return p


@pytest.fixture(scope="module")
def gpu_char_data(gpu_small_text, tmp_path_factory) -> Path:
    from gptlib.data.prepare import prepare_text

    out = tmp_path_factory.mktemp("gpu_char") / "data"
    prepare_text([gpu_small_text], out, tokenizer="char", verbose=False)
    return out


@pytest.fixture(scope="module")
def bpe_data(gpu_text, tmp_path_factory):
    """BPE_TEXT_CHARS of the sources in a BPE_VOCAB-id byte-level BPE trained on them (on a GPU ~0.6M tokens)."""
    from gptlib.data.prepare import prepare

    small = tmp_path_factory.mktemp("gpu_bpe_text") / "code.txt"
    small.write_text(gpu_text.read_text()[:BPE_TEXT_CHARS])
    out = tmp_path_factory.mktemp("gpu_bpe") / "data"
    prepare([small], out, tokenizer="bpe", vocab_size=BPE_VOCAB, verbose=False)
    return out


@pytest.fixture(scope="module")
def gpt2_data(gpu_text, tmp_path_factory):
    """All of gpu_text in a GPT2_VOCAB-id byte-level BPE (on a GPU 32,768, as notebook 01 makes gpt2-small's data)."""
    from gptlib.data.prepare import prepare

    out = tmp_path_factory.mktemp("gpt2_data") / "data"
    t0 = time.perf_counter()
    meta = prepare([gpu_text], out, tokenizer="bpe", vocab_size=GPT2_VOCAB, verbose=False)
    tokens = meta.tokens("train") + meta.tokens("val")
    record(
        "data",
        [
            f"{GPU_TEXT_MB} MB of Python sources -> {tokens:,} tokens of a {GPT2_VOCAB:,}-id BPE in "
            f"{time.perf_counter() - t0:.1f} s (tokenizer trained and shards written)"
        ],
    )
    return out


# === part 1: first contact: gpt2-small as a Colab user first trains it ==================================


@pytest.fixture(scope="module")
def first_run(gpt2_data, tmp_path_factory):
    """gpt2-small at full size (12 x 768, context 1024, 32K vocab, 524,288 tokens per step), bf16 autocast, compiled,
    the auto micro-batch: 20 steps, saving at 10 -> (result, logs, peak GPU bytes, wall seconds). On a CPU the probe
    measures a fake 100 GiB GPU on which 8 sequences need 95% and 4 fit (the preset's micro-batch there)."""
    torch._dynamo.reset()
    free_memory()
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with memory_probe_on_cpu(100 * GIB, 15 * GIB, 10 * GIB):
        r, logs = _train(
            gpt2_data,
            tmp_path_factory.mktemp("first") / "run",
            "gpt2-small",
            FIRST,
            max_steps=FIRST_STEPS,
            compile="on",
        )
    peak = torch.cuda.max_memory_allocated() if CUDA else 0
    return r, logs, peak, time.perf_counter() - t0


@gpu
def test_gpt2_small_trains_compiled_in_bf16(first_run):
    r, logs, peak, wall = first_run
    line, rows = _model_line(logs), read_metrics(r.run_dir)
    first_s, step_s = step_seconds(rows)
    mfu = next((row["mfu"] for row in reversed(rows) if row.get("mfu") is not None), None)
    curve = loss_curve(r.run_dir)
    losses = [curve[s] for s in sorted(curve)]
    record(
        "gpt2_small_bf16_compiled",
        [
            line,
            *[m for m in logs if m.startswith("auto micro-batch")],
            r.summary(),
            f"first step {first_s:.1f} s (the compile in it), then {step_s:.2f} s per step"
            f" (median); steady {r.steady_tokens_per_s:,.0f} tokens/s, MFU {mfu}",
            f"{_gpu_memory('peak GPU memory allocated', lambda: peak)}; {wall:.0f} s in all",
            "losses: " + ", ".join(f"{x:.3f}" for x in losses),
            _host_ram(),
        ],
    )
    assert r.step == FIRST_STEPS and r.stopped_by == "max_steps", r.summary()
    assert _on_device(line, "bfloat16") and "compile on" in line, line
    assert any(m.startswith("auto micro-batch") and "fits" in m for m in logs), logs[:20]
    assert all(math.isfinite(x) for x in losses), losses
    assert statistics.fmean(losses[-3:]) < statistics.fmean(losses[:3]) - 0.5, losses
    if CUDA:
        assert mfu is not None and 0 < mfu < 1, rows[-1]


@gpu
def test_gpt2_small_resumes_in_a_fresh_process(first_run, gpt2_data, tmp_path):
    """The step-10 checkpoint resumed by `python -m gptlib train` in a new process (compiled again, the probe again):
    its steps 11-20 against the uninterrupted run's, per step."""
    r, *_ = first_run
    run = tmp_path / "run"
    shutil.copytree(r.run_dir, run)
    # as if the VM went away after step 10's save
    shutil.rmtree(run / "checkpoints" / f"step_{FIRST_STEPS:07d}")
    cmd = gptlib_cmd(
        "train",
        "--data",
        gpt2_data,
        "--run-dir",
        run,
        "--preset",
        "gpt2-small",
        "--max-steps",
        FIRST_STEPS,
        "--device",
        DEVICE,
        "--compile",
        "--quiet",
        *[a for s in FIRST for a in ("--set", s)],
    )
    t0 = time.perf_counter()
    p = _run(cmd, _env(), 300)
    assert p.returncode == 0 and f"resumed from step {FIRST_SAVE}" in p.stdout, _tail(p)
    a, b = loss_curve(r.run_dir), loss_curve(run)
    after = range(FIRST_SAVE + 1, FIRST_STEPS + 1)
    diffs = step_diffs(b, a, after)
    exact = all(a[s] == b[s] for s in after)
    record(
        "gpt2_small_resume",
        [
            f"resumed from step {FIRST_SAVE} in a new process in {time.perf_counter() - t0:.0f} s",
            "step  uninterrupted  resumed  |diff|",
        ]
        + [f"{s:4d}  {a[s]:.6f}  {b[s]:.6f}  {diffs[s]:.2e}" for s in after]
        + [
            f"{'bitwise equal' if exact else 'not bitwise equal'}: max |diff| {max(diffs.values()):.2e} "
            f"(tolerance {RESUME_TOL})"
        ],
    )
    assert sorted(b) == list(range(1, FIRST_STEPS + 1)), sorted(b)
    assert max(diffs.values()) <= RESUME_TOL, diffs


@gpu
def test_gpt2_small_from_the_cli_on_an_emulated_t4(gpt2_data, tmp_path):
    """`python -m gptlib train --preset gpt2-small --compile` with the defaults a Colab T4 user gets, on this GPU made
    to look like a T4 (benchmarks/t4_emulate.py: 15.8 GB of memory, the rest held back outside torch; no bf16, so fp16 +
    GradScaler; neither flash nor cuDNN attention): it compiles, as a 20,000-step T4 run does, and trains without
    running out of memory after the compile (was: batch 16 let through at 13.4 GiB estimated, then an OOM). On a CPU the
    emulation's CUDA calls are skipped and fp16 is asked for (a CPU's auto dtype is fp32)."""
    on_cpu = [] if CUDA else ["dtype=float16"]
    cmd = gptlib_cmd(
        REPO / "benchmarks" / "t4_emulate.py",
        "train",
        "--data",
        gpt2_data,
        "--run-dir",
        tmp_path / "t4",
        "--preset",
        "gpt2-small",
        "--max-steps",
        3,
        "--compile",
        "--quiet",
        *[a for s in ["hellaswag_every=0", *SMALL, *on_cpu] for a in ("--set", s)],
    )
    t0 = time.perf_counter()
    p = _run(cmd, _env(), 360)
    out = p.stdout
    record(
        "t4_emulated_cli",
        [
            f"{' '.join(map(str, cmd[1:]))} -> exit {p.returncode} in {time.perf_counter() - t0:.0f} s"
        ]
        + [
            line
            for line in out.splitlines()
            if re.match(r"(model:|auto micro-batch|done:|error:|peak |t4:)", line)
        ],
    )
    assert "out of GPU memory" not in out, _tail(p)
    assert p.returncode == 0 and "done: step 3" in out, _tail(p)
    assert re.search(rf"device {DEVICE}(:\d+)?, float16\b", out) and "compile on" in out, _tail(p)
    # neither flash nor cuDNN attention: what a T4 (compute capability 7.5) has
    assert re.search(r"^t4: attention (efficient_attention|math)$", out, re.M), _tail(p)


# The third day: a run begun on a bf16 GPU (an A100 or H100: bf16 autocast, compiled, the auto micro-batch), resumed on
# a T4 days later by the same command in the same run directory. A small model at gpt2-small's context and 32K
# vocabulary, 64 sequences per step: its eager logits need ~30 GiB for all 64 (one micro-batch on an H100), ~7.7 for
# 16 (a T4's 15.8 GB). On a CPU the first run's probe measures a fake GPU on which all 8 sequences fit, and the resume
# has no probe (the asked 4 x 2): the micro-batch changes there too. A constant LR after the warmup: day 1 may stop at
# step 10 as a disconnect stops it, and day 3 asks for more steps without changing the schedule.
THIRD_DAY_STEPS, THIRD_DAY_MORE = 10, 5
THIRD_DAY = [
    "n_layer=4",
    "n_head=4",
    "n_embd=256",
    "batch_size=64",
    "grad_accum_steps=1",
    "auto_batch=true",
    "learning_rate=1e-3",
    "warmup_steps=5",
    "min_lr_ratio=1.0",
    "eval_interval=5",
    "eval_batches=2",
    "save_every_steps=5",
    "sample_tokens=0",
    "hellaswag_every=0",
    "keep_every=0",
    "log_interval=1",
    "save_every_minutes=0",
] + SMALL


def _session(ck) -> dict:
    """What a checkpoint says of the session that wrote it: its micro-batch, accumulation, validation batches and
    sequences, and its GradScaler's state ({} when it trained without one)."""
    saved = load_checkpoint(ck.path)
    tc = saved["state"].config["train"]
    return {
        "step": ck.step,
        "dtype": tc["dtype"],
        "micro": tc["batch_size"],
        "accum": tc["grad_accum_steps"],
        "eval_batches": tc["eval_batches"],
        "val_seqs": tc["batch_size"] * tc["eval_batches"],
        "scaler": saved.get("scaler") or {},
    }


@gpu
def test_a_bf16_run_resumes_on_an_emulated_t4_the_third_day(gpt2_data, tmp_path):
    """The third day on another GPU: a run trained here in bf16, compiled, with the auto micro-batch (the GPU's own
    dtype: none asked), resumed in a new process by the same settings under benchmarks/t4_emulate.py (fp16 +
    GradScaler, a T4's 15.8 GB). It says it resumed; no grad_scale error, no OOM; the T4 trains in float16 with a
    fresh GradScaler (a bf16 checkpoint has no scaler state: scale <= 65,536); its probe's smaller micro-batch
    validates on as many sequences as the first day (eval_batches x the asked batch_size); its first loss is near the
    last one before. On a CPU bf16 then fp16 are asked (a CPU's auto dtype is fp32)."""
    day1 = [] if CUDA else ["dtype=bfloat16"]
    day3 = [] if CUDA else ["dtype=float16"]
    run = tmp_path / "run"
    t0 = time.perf_counter()
    with memory_probe_on_cpu(100 * GIB, GIB, 10 * GIB):
        r, logs = _train(
            gpt2_data,
            run,
            "gpt2-small",
            THIRD_DAY + day1,
            max_steps=THIRD_DAY_STEPS,
            compile="on",
        )
    first_s = time.perf_counter() - t0
    line = _model_line(logs)
    assert r.step == THIRD_DAY_STEPS and r.stopped_by == "max_steps", r.summary()
    assert _on_device(line, "bfloat16") and "compile on" in line, line
    before = _session(newest_checkpoint(run))
    del r
    # what this process holds of the GPU goes back before the "T4" takes its share (dynamo's caches hold the model)
    torch._dynamo.reset()
    free_memory()
    held = _gpu_memory(
        "GPU memory reserved by the test's process before the resume", torch.cuda.memory_reserved
    )
    cmd = gptlib_cmd(
        REPO / "benchmarks" / "t4_emulate.py",
        "train",
        "--data",
        gpt2_data,
        "--run-dir",
        run,
        "--preset",
        "gpt2-small",
        "--max-steps",
        THIRD_DAY_STEPS + THIRD_DAY_MORE,
        "--device",
        DEVICE,
        "--compile",
        "--quiet",
        *[a for s in THIRD_DAY + day3 for a in ("--set", s)],
    )
    t1 = time.perf_counter()
    p = _run(cmd, _env(), 300)
    resume_s, out = time.perf_counter() - t1, p.stdout
    after = _session(newest_checkpoint(run))
    curve = loss_curve(run)
    rows = read_metrics(run)
    val = {row["step"]: row["val_loss"] for row in rows if row.get("val_loss") is not None}
    last, first_new = curve.get(THIRD_DAY_STEPS), curve.get(THIRD_DAY_STEPS + 1)
    # a resumed run's first loss is the saved weights' on the next batch: within a few of the first run's own last
    # steps' changes (a model that lost its weights is back at ln(vocab), NaN is an fp16 overflow let through)
    tail = [curve[s] for s in range(THIRD_DAY_STEPS - 3, THIRD_DAY_STEPS + 1) if s in curve]
    limit = max(3 * max((abs(b - a) for a, b in zip(tail, tail[1:])), default=0.0), 0.25)
    record(
        "third_day_bf16_then_t4",
        [
            f"day 1: {line}; {first_s:.0f} s",
            *[m for m in logs if m.startswith("auto micro-batch") and "fits" in m],
            f"day 1's checkpoint: {before}",
            held,
            f"day 3: {' '.join(map(str, cmd[1:]))} -> exit {p.returncode} in {resume_s:.0f} s",
            *[
                m
                for m in out.splitlines()
                if re.match(
                    r"(model:|auto micro-batch|resum|done:|error:|t4:|.*out of GPU memory)", m
                )
            ],
            f"day 3's checkpoint: {after}",
            "losses: " + ", ".join(f"{s}: {curve[s]:.4f}" for s in sorted(curve)),
            "val losses: " + ", ".join(f"{s}: {v:.4f}" for s, v in sorted(val.items())),
            f"first resumed loss {first_new} against the last before {last}: limit {limit:.3f}; "
            f"a fresh model's loss {curve.get(1)}",
        ],
    )
    assert "Expected grad_scale" not in out and "out of GPU memory" not in out, _tail(p)
    assert p.returncode == 0 and f"resumed from step {THIRD_DAY_STEPS}" in out, _tail(p)
    assert re.search(rf"device {DEVICE}(:\d+)?, float16\b", out) and "compile on" in out, _tail(p)
    assert after["step"] == THIRD_DAY_STEPS + THIRD_DAY_MORE, after
    # bf16 trains without a scaler; the T4's starts fresh at 65,536 (and only halves on an overflow in 5 steps)
    assert before["scaler"] == {} and 0 < after["scaler"].get("scale", 0) <= 65536.0, (
        before,
        after,
    )
    # the same validation sequences, whatever micro-batch each day's probe took
    assert before["val_seqs"] == after["val_seqs"] == 2 * (64 if CUDA else 4), (before, after)
    assert before["micro"] > after["micro"], (before, after)
    assert any(THIRD_DAY_STEPS < s <= THIRD_DAY_STEPS + THIRD_DAY_MORE for s in val), val
    assert sorted(curve) == list(range(1, THIRD_DAY_STEPS + THIRD_DAY_MORE + 1)), sorted(curve)
    assert all(math.isfinite(v) for v in curve.values()), curve
    assert abs(first_new - last) <= limit, (first_new, last, limit)


@gpu
def test_sampling_and_a_hellaswag_batch_on_the_gpu(first_run, tmp_path):
    """The first run's checkpoint sampled at temperature 0.8 (the same seed the same text, another seed other text),
    and one HellaSwag batch (HellaSwag-shaped items the BPE encodes) scored on this device."""
    from gptlib.evaluation.hellaswag import HellaSwagProbe
    from gptlib.inference.engine import Engine, SamplingConfig

    r, *_ = first_run
    eng = Engine.from_run(r.run_dir, device=DEVICE)
    cfg = dict(max_new_tokens=64, temperature=0.8)
    t0 = time.perf_counter()
    a = eng.generate(PROMPTS, SamplingConfig(**cfg, seed=1))
    dt = time.perf_counter() - t0
    b, c = (eng.generate(PROMPTS, SamplingConfig(**cfg, seed=s)) for s in (1, 2))
    items = tmp_path / "hellaswag.jsonl"
    items.write_text(
        "".join(
            json.dumps(
                {
                    "ctx": f"def f{i}(x):\n    return",
                    "label": i % 4,
                    "endings": [" x + 1", " None", " [x]", " x * x"],
                }
            )
            + "\n"
            for i in range(64)
        )
    )
    probe = HellaSwagProbe(
        eng.tokenizer, eng.model.config.block_size, source=items, limit=None, log=print
    )
    t1 = time.perf_counter()
    res = probe.score(eng.model, DEVICE, full=True)
    record(
        "sampling_and_hellaswag",
        [
            f"2 x 64 tokens at temperature 0.8 in {dt:.2f} s: {a[0].text!r}",
            f"HellaSwag, 64 items in one batch: {res} in {time.perf_counter() - t1:.2f} s",
        ],
    )
    assert [x.text for x in a] == [x.text for x in b], "the same seed gave other text"
    assert [x.text for x in a] != [x.text for x in c], "two seeds gave the same text"
    assert res is not None and res["n"] == 64 and 0 <= res["acc"] <= 1, res


# === part 2: both recipes, a run begun on a CPU, memory ===================================================


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("recipe", ["gpt2", "modern"])
def test_a_cpu_made_checkpoint_resumes_on_the_gpu(bpe_data, tmp_path, recipe, dtype):
    """A run begun on a CPU runtime and continued on a GPU after a disconnect: the optimizer takes this device's
    fused/foreach flags, not the checkpoint's (fused=False from the CPU), so fp16's GradScaler steps (with the CPU's
    flags it raises "Expected grad_scale and found_inf to be None" on the first step) and bf16 takes the fused path.
    On a CPU: the same resume in a half dtype on the CPU."""
    run_dir = tmp_path / "run"
    over = GPT2ISH + ["save_every_steps=5", "eval_interval=10", "sample_tokens=0"]
    cpu = train(
        bpe_data,
        run_dir,
        "gpt2-small",
        over + ["dtype=float32"],
        device="cpu",
        progress=False,
        log=lambda m: None,
        max_steps=5,
        compile="off",
        recipe=recipe,
    )
    assert cpu.step == 5, cpu.summary()
    r, logs = _train(
        bpe_data, run_dir, "gpt2-small", over + [f"dtype={dtype}"], max_steps=10, compile="off"
    )
    assert r.resumed_from == 5 and r.step == 10, r.summary()
    assert _on_device(_model_line(logs), dtype), _model_line(logs)
    curve = loss_curve(run_dir)
    record(
        f"cpu_checkpoint_on_gpu_{recipe}_{dtype}",
        [
            _model_line(logs),
            r.summary(),
            "losses: " + ", ".join(f"{s}: {curve[s]:.4f}" for s in sorted(curve)),
        ],
    )
    assert all(math.isfinite(curve[s]) for s in range(6, 11)), curve


@gpu
def test_the_modern_recipe_at_full_size_compiled_in_bf16(gpt2_data, tmp_path):
    """gpt2-small --recipe modern (rotary, RMSNorm, QK-norm, SwiGLU, Muon + AdamW) at full size, bf16, compiled, the
    auto micro-batch: 10 steps, its tokens/s and MFU (Muon's Newton-Schulz is in each step)."""
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    with memory_probe_on_cpu(100 * GIB, 15 * GIB, 10 * GIB):
        r, logs = _train(
            gpt2_data,
            tmp_path / "run",
            "gpt2-small",
            FIRST + ["eval_interval=10"],
            max_steps=10,
            compile="on",
            recipe="modern",
        )
    rows = read_metrics(r.run_dir)
    first_s, step_s = step_seconds(rows)
    mfu = next((row["mfu"] for row in reversed(rows) if row.get("mfu") is not None), None)
    record(
        "gpt2_small_modern_bf16_compiled",
        [
            _model_line(logs),
            r.summary(),
            f"first step {first_s:.1f} s, then {step_s:.2f} s per step; MFU {mfu}; "
            + _gpu_memory("peak GPU memory", torch.cuda.max_memory_allocated),
        ],
    )
    assert r.step == 10 and "compile on" in _model_line(logs), r.summary()
    assert all(math.isfinite(row["train_loss"]) for row in rows)
    if CUDA:
        assert mfu is not None and 0 < mfu < 1, rows[-1]


@gpu
def test_the_modern_recipe_trains_compiled_in_fp16(bpe_data, tmp_path):
    """What a T4 runs: the modern recipe (Muon + AdamW, RMSNorm, rotary) compiled, fp16 autocast + GradScaler."""
    before = _graphs()
    r, logs = _train(
        bpe_data,
        tmp_path / "run",
        "gpt2-small",
        GPT2ISH + ["dtype=float16"],
        max_steps=BPE_STEPS,
        compile="on",
        recipe="modern",
    )
    line = _model_line(logs)
    assert r.step == BPE_STEPS, r.summary()
    assert "compile on" in line and _graphs() > before, line
    curve = loss_curve(r.run_dir)
    losses = [curve[s] for s in sorted(curve)]
    record(
        "train_bpe_modern_float16_compiled",
        [line, r.summary(), f"losses: first {losses[0]:.4f}, last {losses[-1]:.4f}"],
    )
    assert all(math.isfinite(x) for x in losses), losses
    assert statistics.fmean(losses[-3:]) < statistics.fmean(losses[:3]) - 0.5, losses


@gpu
def test_auto_micro_batch_picks_a_size_that_trains(bpe_data, tmp_path):
    """auto_batch with 2,048 sequences of 512 tokens per step (compiled, bf16): the probe's size trains. On a CPU, 8 of
    32 on a fake 40 GiB GPU where 8 sequences need 42 GiB and 4 fit."""
    settings = GPT2ISH + [
        f"block_size={AUTO_BLOCK}",
        "n_head=8" if CUDA else "n_head=2",
        "n_embd=512" if CUDA else "n_embd=64",
        f"batch_size={AUTO_SEQS}",
        "grad_accum_steps=1",
        "auto_batch=true",
        "dtype=bfloat16",
        "eval_batches=1",
        "eval_interval=3",
        "sample_tokens=0",
    ]
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    with memory_probe_on_cpu(40 * GIB, 10 * GIB, 4 * GIB):
        r, logs = _train(
            bpe_data, tmp_path / "run", "gpt2-small", settings, max_steps=3, compile="on"
        )
    probe = [m for m in logs if m.startswith("auto micro-batch")]
    tc = json.loads((r.run_dir / "config.json").read_text())["train"]
    total = torch.cuda.get_device_properties(0).total_memory if CUDA else 0
    record(
        "auto_batch",
        probe
        + [
            _model_line(logs),
            r.summary(),
            _gpu_memory("peak allocated", torch.cuda.max_memory_allocated)
            + (f" of {total / 2**30:.1f} GiB" if CUDA else ""),
        ],
    )
    assert r.step == 3 and r.stopped_by == "max_steps", r.summary()
    assert tc["batch_size"] * tc["grad_accum_steps"] == AUTO_SEQS, tc
    assert tc["batch_size"] < AUTO_SEQS, tc
    assert any(f"{tc['batch_size']} x {AUTO_BLOCK} tokens fits" in m for m in probe), probe


@gpu
@pytest.mark.parametrize("compile", ["off", "on"])
def test_forced_oom_gives_advice_and_the_process_goes_on(bpe_data, tmp_path, compile, monkeypatch):
    """65,536 x 256 tokens in one micro-batch (logits alone > 100 GB), the estimate trusted (a tight one would be
    measured by the probe instead, which finds a size that fits): OutOfMemoryAdvice names the next setting; the GPU
    memory comes back, and the same process trains again in the same run directory. A CPU has no GPU to exhaust: there
    the first step of 64 x 32 tokens raises the OOM torch raises on a GPU, and the rest is the same."""
    from gptlib.training import loop

    small = GPT2ISH + [
        "n_layer=2",
        "n_head=2",
        "n_embd=128",
        "eval_batches=1",
        "sample_tokens=0",
        "dtype=bfloat16",
    ]
    too_big = (
        ["batch_size=65536", "grad_accum_steps=1"]
        if CUDA
        else ["batch_size=64", "grad_accum_steps=1"]
    )
    monkeypatch.setattr(start, "TIGHT_SHARE", 1e9)
    if not CUDA:
        real_step, calls = loop.train_step, []

        def train_step(*a, **kw):
            calls.append(a)
            if len(calls) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 100.00 GiB")
            return real_step(*a, **kw)

        monkeypatch.setattr(loop, "train_step", train_step)
    free_memory()
    allocated = torch.cuda.memory_allocated if CUDA else lambda: 0
    base = allocated()
    with pytest.raises(OutOfMemoryAdvice) as err:
        _train(
            bpe_data, tmp_path / "run", "gpt2-small", small + too_big, max_steps=2, compile=compile
        )
    msg = str(err.value)
    del err  # its traceback holds train()'s frames
    free_memory()
    after = allocated()
    r, _ = _train(
        bpe_data,
        tmp_path / "run",
        "gpt2-small",
        small + ["batch_size=8"],
        max_steps=3,
        compile=compile,
    )
    record(
        f"oom_compile_{compile}",
        [
            msg,
            f"GPU memory allocated: {base / 2**20:.0f} MiB before, "
            f"{after / 2**20:.0f} MiB after the OOM",
            f"then: {r.summary()}",
        ],
    )
    assert "out of GPU memory" in msg and "batch_size=" in msg, msg
    assert r.step == 3 and r.stopped_by == "max_steps", r.summary()
    assert after - base < 512 * 2**20, (
        f"{(after - base) / 2**20:.0f} MiB still allocated after the OOM"
    )


# === part 3: the notebooks on the GPU ==================================================================


def _notebook_setup(
    name: str, tmp_path: Path, small_text: Path, char_data: Path
) -> tuple[str, dict, str]:
    """-> (notebook file, smoke parameters with this DEVICE, the run name)."""
    if name == "02":
        return (
            "02_phase1_shakespeare.ipynb",
            {
                "RUN_NAME": "nb02",
                "TEXT_PATH": str(small_text),
                "MAX_STEPS": 50,
                "DEVICE": DEVICE,
                "OVERRIDES": TINY,
            },
            "nb02",
        )
    if name == "03":
        # where notebook 01 would put it
        shutil.copytree(char_data, tmp_path / "root" / "data" / "chars")
        # 256 tokens/step x 50 steps
        return (
            "03_phase3_train.ipynb",
            {
                "DATASET_NAME": "chars",
                "RUN_NAME": "nb03",
                "PRESET": "phase1",
                "TOKEN_BUDGET_M": 0.0128,
                "DEVICE": DEVICE,
                "AUTO_BATCH": True,
                "OVERRIDES": TINY,
            },
            "nb03",
        )
    _train(
        char_data,
        tmp_path / "root" / "runs" / "nb04",
        "phase1",
        TINY + ["eval_interval=5"],
        max_steps=10,
        compile="off",
    )
    hs = tmp_path / "hellaswag_small.jsonl"  # HellaSwag-shaped items the char vocabulary can encode
    hs.write_text(
        "".join(
            json.dumps(
                {"ctx": "def read", "label": i % 4, "endings": ["(self)", "_all()", "er()", "line"]}
            )
            + "\n"
            for i in range(6)
        )
    )
    return (
        "04_generate.ipynb",
        {
            "RUN_NAME": "nb04",
            "DEVICE": DEVICE,
            "PROMPTS": "|".join(PROMPTS),
            "CHECKPOINTS": "all",
            "MAX_NEW_TOKENS": 40,
            "EXPORT_DIR": str(tmp_path / "hf"),
            "EVAL_TASKS": "bpb, hellaswag",
            "HELLASWAG_FILE": str(hs),
            "BPB_WINDOWS": 20,
        },
        "nb04",
    )


def _notebook_modules() -> None:
    for module in ("nbclient", "nbformat", "ipykernel", "ipywidgets"):
        pytest.importorskip(
            module, reason=f"{module} is not installed (gpu_check.sh's setup installs it)"
        )


@gpu
@pytest.mark.parametrize("name", ["02", "03", "04"])
def test_notebook_on_the_gpu(name, tmp_path, monkeypatch, gpu_small_text, gpu_char_data):
    """Notebooks 02-04 top to bottom on this DEVICE, smoke sizes (as tests/test_notebook_0*.py do on CPU)."""
    _notebook_modules()
    from tests.nbrun import outputs_text, run_notebook

    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    notebook, params, run_name = _notebook_setup(name, tmp_path, gpu_small_text, gpu_char_data)
    nb = run_notebook(notebook, params, cwd=tmp_path, timeout=240)
    text = outputs_text(nb)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    rows = read_metrics(tmp_path / "root" / "runs" / run_name)
    record(f"notebook_{name}", [line for line in text.splitlines() if line.strip()][-40:])
    assert not errors, errors
    if name in ("02", "03"):
        assert f"device {DEVICE}" in text and rows and rows[-1]["step"] == 50, text[-3000:]
    else:
        assert f"on {DEVICE}" in text and PROMPTS[0] in text and "GPT-2 124M" in text, text[-3000:]
        assert (tmp_path / "hf" / "config.json").is_file()


@gpu
def test_notebook_05_imports_gpt2_and_finetunes_a_chat_on_the_gpu(
    tmp_path, monkeypatch, gpu_small_text
):
    """Notebook 05 on this DEVICE: a GPT2LMHeadModel folder written by this machine's transformers (5.x) imported
    as the base, a chat jsonl fine-tuned, a first message answered."""
    _notebook_modules()
    transformers = pytest.importorskip("transformers")
    from gptlib.data.tokenizer import BPETokenizer
    from tests.nbrun import outputs_text, run_notebook
    from tests.test_finetune import NAMES, WORDS, conversation

    folder = tmp_path / "tiny-gpt2"
    text = gpu_small_text.read_text()
    tok = BPETokenizer.train(
        [text[i : i + 2000] for i in range(0, len(text), 2000)], vocab_size=300
    )
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=tok.vocab_size,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=tok.eot_id,
        eos_token_id=tok.eot_id,
    )
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes(tok.to_json_bytes())
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(conversation(n, w)) + "\n" for n in NAMES for w in WORDS))
    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    params = {
        "BASE": "OpenAI GPT-2 from the Hub",
        "HF_MODEL": str(folder),
        "SOURCE": "my files on Drive",
        "INPUT": str(chats),
        "FORMAT": "chat",
        "MAX_TOKENS": "0",
        "DATASET_NAME": "qa",
        "RUN_NAME": "ft",
        "MAX_STEPS": 12,
        "DEVICE": DEVICE,
        "FIRST_MESSAGE": "anna asks: what is the opposite of apple?",
        "OVERRIDES": [
            "eval_interval=6",
            "batch_size=8",
            "eval_batches=2",
            "sample_tokens=0",
            "log_interval=1",
            "save_every_minutes=0",
            "warmup_steps=2",
        ],
    }
    nb = run_notebook("05_finetune_chat.ipynb", params, cwd=tmp_path, timeout=240)
    out = outputs_text(nb)
    record(
        "notebook_05",
        [f"transformers {transformers.__version__}"]
        + [line for line in out.splitlines() if line.strip()][-30:],
    )
    assert "imported" in out and "done: step 12" in out and f"device {DEVICE}" in out, out[-3000:]
    assert "you: anna asks" in out and "model: " in out, out[-3000:]


@gpu
def test_a_chat_fine_tune_with_its_data_on_the_gpu(tmp_path):
    """Notebook 05's path in-process: a chat dataset (its loss-mask starts moved to the GPU once per batch),
    fine-tuned from a base run; the loss falls."""
    from gptlib.data.prepare import prepare

    words = "red blue green sun moon star tree river stone fire".split()
    (tmp_path / "base.txt").write_text(
        "\n".join(" ".join(words[(i * 7 + j) % 10] for j in range(12)) for i in range(3000))
    )
    prepare([tmp_path / "base.txt"], tmp_path / "base_data", vocab_size=300, verbose=False)
    base, _ = _train(
        tmp_path / "base_data",
        tmp_path / "base",
        "phase1",
        TINY + ["block_size=64"],
        max_steps=30,
        compile="off",
    )
    with open(tmp_path / "chat.jsonl", "w") as f:
        for i in range(400):
            q, a = words[i % 10], words[(i + 3) % 10]
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"after {q}?"},
                            {"role": "assistant", "content": a},
                        ]
                    }
                )
                + "\n"
            )
    prepare(
        [tmp_path / "chat.jsonl"],
        tmp_path / "chat_data",
        tokenizer_from=base.run_dir,
        format="chat",
        verbose=False,
    )
    r, logs = _train(
        tmp_path / "chat_data",
        tmp_path / "sft",
        "finetune",
        TINY + ["block_size=64", "batch_size=16"],
        max_steps=40,
        compile="off",
        options=StartOptions(init_from=str(base.run_dir)),
    )
    curve = loss_curve(r.run_dir)
    losses = [curve[s] for s in sorted(curve)]
    record(
        "chat_finetune",
        [_model_line(logs), r.summary(), f"losses: first {losses[0]:.4f}, last {losses[-1]:.4f}"],
    )
    assert r.step == 40 and all(math.isfinite(x) for x in losses), r.summary()
    assert _on_device(_model_line(logs))
    assert statistics.fmean(losses[-5:]) < statistics.fmean(losses[:5]), losses


# === part 6: exactness: compile vs eager, a kill and resume, the checkpoint snapshot, decoding, torchrun ==


@pytest.fixture(scope="module")
def bpe_compiled(bpe_data, tmp_path_factory):
    """dtype -> (TrainResult, logs, graphs compiled): the small gpt2-shaped model compiled, each trained once."""
    runs = {}

    def get(dtype: str):
        if dtype not in runs:
            torch._dynamo.reset()
            before = _graphs()
            run_dir = tmp_path_factory.mktemp(f"bpe_{dtype}") / "run"
            r, logs = _train(
                bpe_data,
                run_dir,
                "gpt2-small",
                GPT2ISH + [f"dtype={dtype}"],
                max_steps=BPE_STEPS,
                compile="on",
            )
            runs[dtype] = (r, logs, _graphs() - before)
        return runs[dtype]

    return get


@gpu
def test_compiled_and_eager_losses_agree_in_bf16(bpe_compiled, bpe_data, tmp_path):
    """Same seed, same batches, same schedule: the compiled run's first losses are the eager run's within bf16."""
    compiled, _, _ = bpe_compiled("bfloat16")
    eager, logs = _train(
        bpe_data,
        tmp_path / "eager",
        "gpt2-small",
        GPT2ISH + ["dtype=bfloat16"],
        max_steps=BPE_STEPS,
        compile="off",
    )
    assert "compile off" in _model_line(logs), _model_line(logs)
    a, b = loss_curve(compiled.run_dir), loss_curve(eager.run_dir)
    steps = range(1, COMPARE_STEPS + 1)
    worst, at = max_rel_diff(a, b, steps)
    first, _ = max_rel_diff(a, b, [1])
    record(
        "compile_vs_eager_bf16",
        ["step  compiled  eager  rel.diff"]
        + [f"{s:4d}  {a[s]:.5f}  {b[s]:.5f}  {abs(a[s] - b[s]) / b[s]:.2e}" for s in steps]
        + [
            f"largest relative difference {worst:.2e} at step {at} (limit {BF16_RTOL}); step 1: {first:.2e}"
        ],
    )
    assert first <= BF16_RTOL / 2, f"step 1 (same weights, same batch) differs by {first:.2e}"
    assert worst <= BF16_RTOL, f"compiled vs eager: {worst:.2e} at step {at} > {BF16_RTOL}"


def _to_cpu(o):
    if isinstance(o, torch.Tensor):
        return o.detach().cpu().clone()
    if isinstance(o, dict):
        return {k: _to_cpu(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return type(o)(_to_cpu(v) for v in o)
    return o


def _assert_same(got, want, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), (
            f"{where}: saved value differs from the live one"
        )
    elif isinstance(want, dict):
        assert set(got) == set(want), (
            f"{where}: keys {sorted(map(str, got))} != {sorted(map(str, want))}"
        )
        for k in want:
            _assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@gpu
def test_checkpoint_snapshot_equals_live_weights_on_consecutive_saves(tmp_path):
    """The host buffer, reused by the second save: each checkpoint holds the weights and AdamW moments as
    they were when save() returned, although the GPU changes them all right after (while the writer writes)."""
    from gptlib.checkpoint.writer import CheckpointWriter
    from gptlib.config import ModelConfig, TrainConfig
    from gptlib.model import GPT
    from gptlib.training.step import build_optimizer

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=8192, block_size=128, n_layer=4, n_head=8, n_embd=512)).to(
        DEVICE
    )
    opt = build_optimizer(model, TrainConfig(weight_decay=0.1, learning_rate=1e-3), DEVICE)
    writer = CheckpointWriter(tmp_path, keep_last=2)
    expected, hosts = {}, []
    try:
        for step in (1, 2):
            x = torch.randint(0, 8192, (8, 128), device=DEVICE)
            model(x, x)[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            expected[step] = (_to_cpu(model.state_dict()), _to_cpu(opt.state_dict()))
            writer.save(
                {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "progress": TrainState(step=step).state_dict(),
                }
            )
            hosts.append(list(writer._host))
            # queued on the GPU at once, while the writer thread reads the host copy (on a CPU: done at once)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-3.0).add_(1.0)
                for st in opt.state.values():
                    for t in st.values():
                        if torch.is_tensor(t) and t.device.type == DEVICE and t.is_floating_point():
                            t.add_(5.0)
        writer.wait()
    finally:
        writer.close()
    assert all(a is b for a, b in zip(*hosts)), "the second save of the same layout allocated anew"
    for step in (1, 2):
        saved = load_checkpoint(tmp_path / "checkpoints" / f"step_{step:07d}")
        _assert_same(saved["model"], expected[step][0], f"step {step} model")
        _assert_same(saved["optimizer"], expected[step][1], f"step {step} optimizer")


def _cli_train(
    data, run_dir, steps: int, fault: str | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    cmd = gptlib_cmd(
        "train",
        "--data",
        data,
        "--run-dir",
        run_dir,
        "--preset",
        "gpt2-small",
        "--max-steps",
        steps,
        "--device",
        DEVICE,
        "--quiet",
        fault=fault,
    )
    for s in RESUME:
        cmd += ["--set", s]
    return _run(cmd, _env(), timeout)


@gpu
def test_sigkill_then_resume_stays_within_run_to_run_noise(bpe_data, tmp_path):
    """Two uninterrupted runs (A, B) and one SIGKILLed mid-step then resumed (K), each its own process, bf16:
    after the resume point |K - A| per step stays within the run-to-run noise |B - A| (README: 'what holds on a
    GPU')."""
    for name in ("a", "b"):
        p = _cli_train(bpe_data, tmp_path / name, RESUME_STEPS)
        assert p.returncode == 0, _tail(p)
    p = _cli_train(bpe_data, tmp_path / "k", RESUME_STEPS, fault=f"kill:mid_step@{KILL_AT}")
    assert p.returncode == -signal.SIGKILL, _tail(p)
    ck = newest_checkpoint(tmp_path / "k")
    assert ck is not None and ck.step in (10, 15), ck
    p = _cli_train(bpe_data, tmp_path / "k", RESUME_STEPS)
    assert p.returncode == 0 and f"resumed from step {ck.step}" in p.stdout, _tail(p)
    A, B, K = (loss_curve(tmp_path / n) for n in "abk")
    assert sorted(K) == list(range(1, RESUME_STEPS + 1)), sorted(K)
    after = range(ck.step + 1, RESUME_STEPS + 1)
    resumed, noise = step_diffs(K, A, after), step_diffs(B, A, after)
    v = resume_verdict(resumed, noise)
    # the killed process before its kill: a third run
    before = step_diffs(K, A, range(1, ck.step + 1))
    record(
        "resume_noise",
        [
            f"bf16, compile off, dropout 0.1; killed at step {KILL_AT}, resumed from step {ck.step}",
            "step  A  B  K  |B-A|  |K-A|",
        ]
        + [
            f"{s:4d}  {A[s]:.5f}  {B[s]:.5f}  {K[s]:.5f}  {abs(B[s] - A[s]):.2e}  {abs(K[s] - A[s]):.2e}"
            for s in range(1, RESUME_STEPS + 1)
        ]
        + [f"before the kill: max |K-A| {max(before.values()):.2e}", v.line()],
    )
    assert v.ok, v.line()


@gpu
@pytest.mark.parametrize("recipe", ["gpt2", "modern"])
def test_kv_cached_decoding_on_the_gpu_gives_the_full_forwards_tokens(
    gpu_char_data, tmp_path, recipe
):
    """The engine's two attention paths on CUDA's SDPA kernels (a causal prefill, then the new tokens against the
    cache under a mask): greedy tokens, batch 1 and 2 (prompts of different lengths), past the 32-token window,
    equal to a full forward of the window per token. The modern recipe's rotary positions are taken at each step."""
    from gptlib.inference.engine import Engine, SamplingConfig
    from gptlib.inference.loading import load_run

    r, _ = _train(
        gpu_char_data,
        tmp_path / "run",
        "phase1",
        TINY,
        max_steps=KV_STEPS,
        compile="off",
        recipe=recipe,
    )
    precision = torch.get_float32_matmul_precision()
    # fp32 as a fresh process decodes (training turned TF32 on)
    torch.set_float32_matmul_precision("highest")
    try:
        # the saved fp32, not from_run's half type: exact fp32
        ld = load_run(r.run_dir, device=DEVICE)
        eng = Engine(ld.model, ld.tokenizer)
        bs = eng.model.config.block_size
        for prompts in (PROMPTS[:1], PROMPTS):
            ids = [eng.tokenizer.encode(p) for p in prompts]
            t0 = time.perf_counter()
            got, _ = eng.generate_ids(
                ids, SamplingConfig(max_new_tokens=DECODE_TOKENS, temperature=0.0)
            )
            dt = time.perf_counter() - t0
            record(
                f"kv_decoding_{recipe}_batch{len(ids)}",
                [f"{DECODE_TOKENS} new tokens in {dt:.2f} s"],
            )
            for row, (prompt, g) in enumerate(zip(ids, got)):
                want = list(prompt)
                with torch.no_grad():
                    for _ in range(DECODE_TOKENS):
                        want.append(
                            int(
                                eng.model(torch.tensor([want[-bs:]], device=DEVICE))[0][
                                    0, -1
                                ].argmax()
                            )
                        )
                assert g == want[len(prompt) :], (
                    f"batch {len(ids)}, row {row}: {eng.tokenizer.decode(g)!r} vs the "
                    f"full forward's {eng.tokenizer.decode(want[len(prompt) :])!r}"
                )
    finally:
        torch.set_float32_matmul_precision(precision)


@gpu
def test_torchrun_one_process(gpu_char_data, tmp_path):
    """torchrun with one GPU: the usual launch (WORLD_SIZE=1 trains without DDP), and the DDP code paths
    (wrap, no_sync, all_reduce, all_gather_object, barrier) forced on over a real NCCL group of one (on a CPU: gloo)."""
    worker = tmp_path / "worker.py"
    worker.write_text(DDP_WORKER)
    ov = TINY + ["compile=off", "eval_interval=4", "log_interval=2"]
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    p = _run(
        run
        + [
            worker,
            gpu_char_data,
            tmp_path / "ddp",
            tmp_path / "out.json",
            json.dumps(ov + ["max_steps=8"]),
            DEVICE,
        ],
        _env(),
        300,
    )
    assert p.returncode == 0, _tail(p)
    out = json.loads((tmp_path / "out.json").read_text())
    backend = "nccl" if CUDA else "gloo"
    assert out == {"step": 8, "backend": backend, "wrapped": "DistributedDataParallel"}, out
    assert sorted(loss_curve(tmp_path / "ddp")) == list(range(1, 9))
    # gathered over NCCL (gloo)
    assert len(load_checkpoint(newest_checkpoint(tmp_path / "ddp").path)["sampler_ranks"]) == 1
    plain = run + [
        "-m",
        "gptlib",
        "train",
        "--data",
        gpu_char_data,
        "--run-dir",
        tmp_path / "plain",
        "--preset",
        "phase1",
        "--device",
        DEVICE,
        "--max-steps",
        "4",
        "--quiet",
    ]
    p = _run(plain + [a for s in ov for a in ("--set", s)], _env(), 300)
    assert p.returncode == 0, _tail(p)
    assert sorted(loss_curve(tmp_path / "plain")) == [1, 2, 3, 4]


DDP_WORKER = r'''
import json, os, sys
import torch
import torch.distributed as dist
from gptlib.training.run import Dist
from gptlib.training import loop
from gptlib.training.loop import train

seen = {}


class OneRankDDP(Dist):
    """gptlib skips DDP when WORLD_SIZE is 1: this Dist takes its DDP paths anyway."""

    @property
    def enabled(self):
        return True

    def wrap(self, model, dev):
        wrapped = super().wrap(model, dev)
        seen["wrapped"] = type(wrapped).__name__
        return wrapped


def setup(device="auto"):
    local = int(os.environ["LOCAL_RANK"])
    if sys.argv[5] == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group(backend="nccl" if sys.argv[5] == "cuda" else "gloo")
    seen["backend"] = dist.get_backend()
    return OneRankDDP(rank=0, local_rank=local, world_size=1, initialized_here=True)


loop.setup_ddp = setup
r = train(sys.argv[1], sys.argv[2], "phase1", overrides=json.loads(sys.argv[4]), device=sys.argv[5], progress=False)
with open(sys.argv[3], "w") as f:
    json.dump({"step": r.step, **seen}, f)
'''


# === part 7: the phase1 preset as notebook 02 runs it, the small gpt2 compiled in bf16 and fp16 ==========


@gpu
def test_phase1_trains_on_the_gpu(gpu_text, tmp_path):
    """The phase1 preset as notebook 02 runs it: 1,500 steps on 1 MB of text, char-level, the preset's own compile."""
    from gptlib.data.prepare import prepare_text

    text = tmp_path / "text.txt"
    text.write_text(gpu_text.read_text()[:1_000_000])
    prepare_text([text], tmp_path / "data", tokenizer="char", verbose=False)
    r, logs = _train(tmp_path / "data", tmp_path / "run", "phase1", [], max_steps=PHASE1_STEPS)
    vocab = json.loads((tmp_path / "data" / "meta.json").read_text())["vocab_size"]
    assert r.step == PHASE1_STEPS and r.stopped_by == "max_steps", r.summary()
    assert _on_device(_model_line(logs)), _model_line(logs)
    record(
        "phase1",
        [
            _model_line(logs),
            r.summary(),
            f"best val loss {r.best_val_loss:.4f} (chance: "
            f"{math.log(vocab):.2f} for {vocab} characters)",
        ],
    )
    assert r.val_loss is not None and r.val_loss < 0.5 * math.log(vocab), r.summary()


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_small_gpt2_bpe_trains_compiled(bpe_compiled, dtype):
    """compile on, bf16 autocast or fp16 autocast + GradScaler (its scale saved in the checkpoint)."""
    r, logs, graphs = bpe_compiled(dtype)
    line = _model_line(logs)
    assert r.step == BPE_STEPS and r.stopped_by == "max_steps", r.summary()
    assert _on_device(line, dtype) and "compile on" in line, line
    assert graphs > 0, "torch.compile produced no graph: this run was not compiled"
    curve = loss_curve(r.run_dir)
    losses = [curve[s] for s in sorted(curve)]
    assert len(losses) == BPE_STEPS and all(math.isfinite(x) for x in losses), losses
    ck = newest_checkpoint(r.run_dir)
    scaler = load_checkpoint(ck.path).get("scaler") or {}
    record(
        f"train_bpe_{dtype}",
        [
            line,
            r.summary(),
            f"losses: first {losses[0]:.4f}, last {losses[-1]:.4f}",
            f"grad scaler state: {scaler or 'off'}",
        ],
    )
    assert statistics.fmean(losses[-3:]) < statistics.fmean(losses[:3]) - 0.5, losses
    if dtype == "float16":
        assert "scale" in scaler, (
            f"fp16 trains with a GradScaler, whose state the checkpoint keeps: {scaler}"
        )
    else:
        assert not scaler, scaler


# --- the helpers, on CPU ------------------------------------------------------------------------------


def test_step_diffs_and_the_verdict_against_run_to_run_noise():
    steps = range(11, 21)
    a = {s: 3.0 - 0.01 * s for s in range(1, 21)}
    b = {s: v + 1e-3 for s, v in a.items()}  # the noise
    assert step_diffs(b, a, steps) == pytest.approx({s: 1e-3 for s in steps})
    noise = step_diffs(b, a, steps)
    close = {s: v + 2e-3 for s, v in a.items()}  # resumed: within 10 x the noise
    v = resume_verdict(step_diffs(close, a, steps), noise)
    assert (
        v.ok
        and v.limit == NOISE_FLOOR
        and v.resumed_max == pytest.approx(2e-3)
        and "-> ok" in v.line()
    )
    jump = dict(a)
    jump[11] += 0.3  # a resume that lost its state: the first step after it jumps
    v = resume_verdict(step_diffs(jump, a, steps), noise)
    assert not v.ok and v.worst_step == 11 and "TOO FAR" in v.line()
    loud = {s: v + 0.04 for s, v in a.items()}  # noisier runs allow more: 10 x 0.04
    assert resume_verdict(step_diffs(jump, a, steps), step_diffs(loud, a, steps)).ok
    with pytest.raises(AssertionError, match=r"missing from a loss curve: \[21\]"):
        step_diffs(a, b, range(19, 22))
    assert max_rel_diff({1: 2.0, 2: 3.3}, {1: 2.0, 2: 3.0}, [1, 2]) == (pytest.approx(0.1), 2)


def test_loss_curves_and_step_times_of_real_runs(char_data, tmp_path):
    """Two CPU runs with the same seed give the same curve (no run-to-run noise on CPU), another seed does not; the
    first step's seconds and the median of the others' come from the rows."""
    args = dict(
        preset="phase1",
        overrides=TINY,
        max_steps=4,
        device="cpu",
        progress=False,
        log=lambda m: None,
    )
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        train(char_data, tmp_path / name, seed=seed, **args)
    a, b, c = (loss_curve(tmp_path / n) for n in "abc")
    assert sorted(a) == [1, 2, 3, 4]
    assert max(step_diffs(a, b, a).values()) == 0.0 and max_rel_diff(a, b, a)[0] == 0.0
    assert max_rel_diff(c, a, a)[0] > 0
    first, median = step_seconds(read_metrics(tmp_path / "a"))
    assert first > 0 and median > 0
    assert step_seconds(
        [
            {"step": 1, "elapsed_s": 9.0},
            {"step": 2, "elapsed_s": 10.0},
            {"step": 3, "elapsed_s": 12.0},
            {"step": 4, "elapsed_s": 13.0},
        ]
    ) == (9.0, 1.0)
    (tmp_path / "a" / "metrics.jsonl").write_text(
        (tmp_path / "a" / "metrics.jsonl").read_text() * 2
    )
    with pytest.raises(AssertionError, match=r"logs steps \[1, 2, 3, 4\] twice"):
        loss_curve(tmp_path / "a")


def test_record_appends_each_measurement_to_the_parts_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPTLIB_GPU_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("GPTLIB_GPU_TAG", "NVIDIA H100 80GB HBM3")
    monkeypatch.setenv("GPTLIB_GPU_PART", "part1")
    path = record("resume_noise", ["max 1.0e-03"])
    assert record("auto_batch", ["16 x 1024 fits"]) == path
    assert path == tmp_path / "results" / "gpu_NVIDIA_H100_80GB_HBM3_part1.txt"
    lines = path.read_text().splitlines()
    assert (
        lines[0]
        == "=== resume_noise: tests/test_gpu.py::test_record_appends_each_measurement_to_the_parts_file"
    )
    assert lines[1].startswith("device: ") and f"torch {torch.__version__}" in lines[1]
    assert (
        lines[2] == "max 1.0e-03"
        and lines[4].startswith("=== auto_batch")
        and lines[6] == "16 x 1024 fits"
    )
    assert "max 1.0e-03" in capsys.readouterr().out


def test_code_text_is_this_pythons_sources(tmp_path):
    p = code_text(tmp_path / "code.txt", 0.2)
    text = p.read_text()
    assert len(text.encode()) >= 200_000 and "def " in text and "import " in text
    # the same files in the same order
    assert code_text(tmp_path / "again.txt", 0.2).read_text() == text


def test_a_test_run_writes_nothing_into_the_repository(monkeypatch):
    """Without GPTLIB_GPU_RESULTS (gpu_check.sh sets it), what the tests record goes to a temporary folder: a CPU run in
    CI wrote gpu_nogpu_tests.txt into benchmarks/results/."""
    monkeypatch.delenv("GPTLIB_GPU_RESULTS", raising=False)
    path = record("where", ["a line"])
    assert REPO not in path.parents and path.read_text().endswith("a line\n\n"), path


def test_a_subprocess_output_is_in_the_parts_children_log_as_it_comes(tmp_path, monkeypatch):
    """_run streams a child's stdout and stderr into the part's .children.log (what a killed step keeps) and returns
    them; a child past its time limit fails the test with what it printed."""
    monkeypatch.setenv("GPTLIB_GPU_RESULTS", str(tmp_path))
    monkeypatch.setenv("GPTLIB_GPU_PART", "part9")
    code = "import sys, time; print('out', flush=True); print('err', file=sys.stderr, flush=True); time.sleep(%s)"
    p = _run([sys.executable, "-c", code % 0], _env(), 60)
    assert p.returncode == 0 and p.stdout.splitlines() == ["out", "err"], p.stdout
    with pytest.raises(
        pytest.fail.Exception, match=r"did not finish in 3 s; its output:\nout\nerr"
    ):
        _run([sys.executable, "-c", code % 60], _env(), 3)
    [log] = tmp_path.glob("gpu_*_part9.children.log")
    assert log.read_text().count("out\nerr\n") == 2, log.read_text()


def test_attention_kernel_names_what_sdpa_picks_here():
    """On a CPU PyTorch's flash kernel, or math where flash is turned off (the T4's kernels are checked on a GPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not CUDA:
        assert attention_kernel(torch.bfloat16) == "flash_attention"
    with sdpa_kernel([SDPBackend.MATH]):
        assert attention_kernel(torch.float16) == "math"
