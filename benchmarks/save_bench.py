"""How long a checkpoint save blocks the training loop, and how long the background work takes.

State: the `gpt2-small` preset's model + AdamW moments (exp_avg, exp_avg_sq) + sampler/RNG state,
about 1.5 GB. The loop calls CheckpointWriter.save(), which copies the tensors to host memory
(here: CPU -> CPU clone) and hands them to a thread; the thread writes + fsyncs + hashes (once) +
checks sizes locally, and a second thread copies to the mirror (a second local directory standing in
for Google Drive: temp name, hash while copying, fsync, sizes checked, rename, rotate; nothing read back).

    python benchmarks/save_bench.py [--saves 5] [--dir /tmp]

Prints the median over the saves of: blocking time (the loop waits), local background time
(save call -> local checkpoint verified), mirror time (local verified -> mirror verified), and how
fast the main thread can issue small torch ops while the background threads work, relative to
idle (the GIL cost a GPU training loop, which mostly launches kernels, would see); and the threads a save
starts besides the loop's (by name), with the most of them alive at once.
Target: blocking < 2 s. Note: the mirror here is the same local disk, so real Drive copies are slower
(tens of MB/s); training does not wait for them.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from gptlib.checkpoint.format import TrainState
from gptlib.checkpoint.writer import CheckpointWriter
from gptlib.config import get_preset
from gptlib.layout import checkpoint_name
from gptlib.model import GPT, model_size
from gptlib.training.step import build_optimizer


def machine_info(d: Path) -> str:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    mem = f"{int(line.split()[1]) / 1e6:.1f} GB RAM"
    except OSError:
        pass
    du = shutil.disk_usage(d)
    return (
        f"machine: {cpu}, {os.cpu_count()} CPUs, {mem}; python {platform.python_version()}, torch {torch.__version__}, "
        f"torch threads {torch.get_num_threads()}; disk at {d}: {du.free / 1e9:.0f} GB free; load avg "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )


def count_threads() -> list[tuple[str, int]]:
    """From now on, each thread started -> (its name, how many threads besides the main one are alive once it is)."""
    started, real_start = [], threading.Thread.start

    def start(thread: threading.Thread) -> None:
        real_start(thread)
        alive = [t for t in threading.enumerate() if t is not threading.main_thread()]
        started.append((thread.name, len(alive)))

    threading.Thread.start = start
    return started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument(
        "--dir", default=tempfile.gettempdir(), help="where the local and mirror run dirs go"
    )
    ap.add_argument("--preset", default="gpt2-small")
    args = ap.parse_args()

    print("$ python " + " ".join(sys.argv))
    print(time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    print(machine_info(Path(args.dir)))

    cfg = get_preset(args.preset)
    model = GPT(cfg.model)
    opt = build_optimizer(model, cfg.train, "cpu")
    for p in model.parameters():  # one step with small gradients: creates the AdamW moments
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(0)
    n_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    n_bytes += sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    print(
        f"state: {args.preset}, {model_size(model.config).params / 1e6:.1f}M parameters, weights + AdamW moments = "
        f"{n_bytes / 1e9:.2f} GB (fp32)"
    )

    probe = torch.zeros(64)

    def launch_rate(seconds: float | None = None, until=None) -> float:
        """Small in-place ops per second on the main thread (dispatch-bound, like kernel launches)."""
        n, t0 = 0, time.perf_counter()
        while until() if until else time.perf_counter() - t0 < seconds:
            for _ in range(100):
                probe.add_(1.0)
            n += 100
        return n / (time.perf_counter() - t0)

    idle_rate = launch_rate(2.0)
    print(f"main-thread small-op rate with no save running: {idle_rate:,.0f} ops/s")
    root = Path(tempfile.mkdtemp(prefix="gptlib_save_bench_", dir=args.dir))
    local, mirror = root / "local", root / "mirror"
    block, local_t, mirror_t, sizes, rates = [], [], [], [], []
    try:
        w = CheckpointWriter(local, keep_last=2, mirror_dir=mirror)
        threads = count_threads()
        for i in range(1, args.saves + 1):
            checkpoint = {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "sampler": {"rng_state": gen.get_state(), "batches_drawn": i},
                "rng": {"torch_cpu": torch.get_rng_state()},
                "progress": TrainState(step=i, config=cfg.to_dict()).state_dict(),
            }
            t0 = time.perf_counter()
            w.save(checkpoint)
            t1 = time.perf_counter()
            # The loop goes on meanwhile: here it issues small ops until the local write is done.
            rate = launch_rate(until=lambda: w._thread is not None and w._thread.is_alive())
            w.wait()
            t2 = time.perf_counter()
            w.close()  # waits for the mirror copy
            t3 = time.perf_counter()
            rates.append(rate / idle_rate)
            st = w.status()
            assert st["mirror_step"] == i and st["mirror_error"] is None, st
            size = sum(
                f.stat().st_size for f in (local / "checkpoints" / checkpoint_name(i)).iterdir()
            )
            block.append(t1 - t0)
            local_t.append(t2 - t0)
            mirror_t.append(t3 - t2)
            sizes.append(size)
            print(
                f"save {i}: blocking {t1 - t0:6.3f} s | local write+fsync+hash+rotate {t2 - t0:6.2f} s | "
                f"mirror copy+hash+fsync+rotate {t3 - t2:6.2f} s | {size / 1e9:.2f} GB on disk | "
                f"main-thread op rate during the write {rate / idle_rate:.0%} of idle"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    gb = statistics.median(sizes) / 1e9
    print(f"\nmedian over {args.saves} saves of {gb:.2f} GB checkpoints:")
    print(
        f"  blocking the training loop:  {statistics.median(block):.3f} s   (target < 2 s: "
        f"{'MET' if statistics.median(block) < 2 else 'NOT MET'})"
    )
    local, mirror = statistics.median(local_t), statistics.median(mirror_t)
    print(f"  local background save:       {local:.2f} s   ({gb / local:.2f} GB/s)")
    print(f"  mirror (Drive stand-in):     {mirror:.2f} s   ({gb / mirror:.2f} GB/s)")
    print(
        f"  main-thread op rate while the background write runs: {statistics.median(rates):.0%} of idle"
    )
    names = sorted({name for name, _ in threads})
    print(
        f"  threads besides the loop's: {len(threads) / args.saves:g} started per save ("
        + ", ".join(f"{n} x{sum(m == n for m, _ in threads) / args.saves:g}" for n in names)
        + f"), at most {max(n for _, n in threads)} alive at once"
    )


if __name__ == "__main__":
    main()
