"""Shared fixtures: the local Tiny Shakespeare copy, a small char dataset, tiny configs."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

# Under pytest-xdist (scripts/test.sh runs two workers) each worker and the processes it starts use one
# thread: two workers with torch's default thread pool each would fight over a 2-core machine.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = Path(
    os.environ.get("GPTLIB_SHAKESPEARE", REPO.parent / "shared" / "data" / "tinyshakespeare.txt")
)

# Tiny model/training settings for tests: seconds on 2 CPU cores.
TINY = [
    "block_size=32",
    "n_layer=2",
    "n_head=2",
    "n_embd=32",
    "batch_size=8",
    "eval_interval=10",
    "eval_batches=2",
    "log_interval=1",
    "sample_tokens=8",
    "warmup_steps=2",
    "save_every_minutes=0",
]


def skip_without_muon(recipe: str = "modern") -> None:
    """The modern recipe trains with torch.optim.Muon (torch >= 2.9): skipped at the torch floor (2.5)."""
    import torch

    if recipe == "modern" and not hasattr(torch.optim, "Muon"):
        pytest.skip(
            f"the modern recipe needs torch.optim.Muon (torch >= 2.9; this is {torch.__version__})"
        )


def newest_checkpoint(run_dir):
    """The newest checkpoint of a run directory that loads (sizes and sha256 checked), or None."""
    from gptlib.checkpoint.format import (
        CheckpointError,
        list_checkpoints,
        load_checkpoint,
        verify_checkpoint,
    )

    for path in list_checkpoints(run_dir):
        try:
            load_checkpoint(path)
            return verify_checkpoint(path)
        except CheckpointError:
            pass
    return None


def pytest_runtest_logreport(report):
    """Under the GPU check (benchmarks/gpu_check.sh sets these), a failure is written into the part's results file as
    it happens: a part cut off at its time limit never prints pytest's closing summary."""
    part, results = os.environ.get("GPTLIB_GPU_PART"), os.environ.get("GPTLIB_GPU_RESULTS")
    if report.failed and part and results:
        tag = os.environ.get("GPTLIB_GPU_TAG", "gpu")
        with open(Path(results) / f"gpu_{tag}_{part}.txt", "a") as f:
            f.write(
                f"=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n\n"
            )


@pytest.fixture(autouse=True)
def _python_sigint_handler():
    """Each test starts with Python's own Ctrl-C handler, as a terminal or a notebook kernel has: a notebook test
    left SIGINT ignored in its pytest-xdist worker (SIG_IGN, which every process started after it inherits), and
    the Ctrl-C tests that ran next in that worker sent interrupts that nothing received."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(scope="session")
def shakespeare_path() -> Path:
    """../shared's copy (or $GPTLIB_SHAKESPEARE), else the verified copy in gptlib's cache: a clone elsewhere has
    one once `bash scripts/phase1.sh` ran without a path (it downloads the file there)."""
    if SHAKESPEARE.is_file():
        return SHAKESPEARE
    from gptlib.data.download import cached_tinyshakespeare

    if (cached := cached_tinyshakespeare()) is not None:
        return cached
    pytest.fail(
        f"Tiny Shakespeare is neither at {SHAKESPEARE} nor in gptlib's cache: set GPTLIB_SHAKESPEARE to a copy, "
        f"or run `bash scripts/phase1.sh` once without a path (it downloads and caches it)"
    )


@pytest.fixture(scope="module")
def docs(shakespeare_path) -> list[str]:
    """~1,800 short documents: the speeches of Tiny Shakespeare's first 300,000 characters (a module may
    define its own `docs`; `bpe_file` is then trained on those)."""
    from tests.tokenize_kit import speeches

    return speeches(shakespeare_path, 300_000)


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory, docs) -> Path:
    """A 300-id byte-level BPE trained on `docs` -> its tokenizer.json."""
    from tests.tokenize_kit import small_bpe

    return small_bpe(docs, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def small_text(tmp_path_factory, shakespeare_path) -> Path:
    """The first 100k characters of Tiny Shakespeare as its own file."""
    p = tmp_path_factory.mktemp("text") / "small.txt"
    p.write_text(shakespeare_path.read_text()[:100_000])
    return p


@pytest.fixture(scope="session")
def char_data(tmp_path_factory, small_text) -> Path:
    """A char-level data directory built from small_text (shared, read-only for tests)."""
    from gptlib.data.prepare import prepare_text

    out = tmp_path_factory.mktemp("data") / "char"
    prepare_text([small_text], out, tokenizer="char", verbose=False)
    return out
