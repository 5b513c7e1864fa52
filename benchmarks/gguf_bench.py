"""Decode speed of the gpt2-small shape in llama.cpp (export-gguf's f16 and q8_0 files, through llama-cpp-python)
beside gptlib's own KV-cached engine (fp32), on this CPU, in one process, runs alternated so each sees the same
machine load. Random-init weights: decode speed does not depend on what the weights learned (the GGUF carries a
small BPE tokenizer padded to the model's vocabulary, as export-gguf pads unused ids). Greedy, batch 1, a one-token
prompt, no early stop; both use every core. Prints every run, then medians.

    python benchmarks/gguf_bench.py                              # 256 new tokens, 3 repeats
    python benchmarks/gguf_bench.py --new-tokens 64 --repeats 1  # quick check

Needs llama-cpp-python (bash scripts/llama_env.sh installs it from its cached wheel into .llama-site:
PYTHONPATH=.llama-site python benchmarks/gguf_bench.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from gptlib.config import get_preset  # noqa: E402
from gptlib.data.tokenizer import BPETokenizer  # noqa: E402
from gptlib.inference.engine import Engine, SamplingConfig  # noqa: E402
from gptlib.inference.export import write_gguf  # noqa: E402
from gptlib.model import GPT, model_size  # noqa: E402


def cpu_name() -> str:
    for line in (
        Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    ):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument(
        "--repeats", type=int, default=3, help="timed runs per engine (median reported)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import llama_cpp

    threads = os.cpu_count() or 1
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"cpu: {cpu_name()}; {threads} logical cores; torch threads {torch.get_num_threads()}, llama.cpp threads "
        f"{threads}\npython {platform.python_version()}, torch {torch.__version__}, llama-cpp-python "
        f"{llama_cpp.__version__}, load average at start {os.getloadavg()}"
    )
    torch.manual_seed(args.seed)
    mcfg = get_preset(args.preset).model
    model = GPT(mcfg).eval()  # random init: speed does not depend on training
    text = Path(__file__).read_text() * 4
    tok = BPETokenizer.train([text], vocab_size=512)
    print(
        f"model: preset {args.preset}, {model_size(mcfg).params / 1e6:.1f}M parameters, context {mcfg.block_size}, "
        f"vocab {mcfg.vocab_size}; gptlib fp32, llama.cpp f16 and q8_0 (its default f16 KV cache)"
    )
    eng, prompt, n = Engine(model), [1], args.new_tokens

    def ours(n: int = n) -> list[int]:
        return eng.generate_ids(
            [prompt], SamplingConfig(max_new_tokens=n, temperature=0, stop_at_eot=False)
        )[0][0]

    def llama(llm):
        def run(n: int = n) -> list[int]:
            out = []
            for t in llm.generate(prompt, temp=0, top_k=1, reset=True):
                out.append(t)
                if len(out) == n:
                    return out

        return run

    with tempfile.TemporaryDirectory() as d:
        engines = {"gptlib fp32": ours}
        for dtype in ("f16", "q8_0"):
            path = write_gguf(model, tok, Path(d) / f"{dtype}.gguf", dtype)
            print(f"  {dtype}.gguf: {path.stat().st_size / 1e6:,.0f} MB")
            engines[f"llama.cpp {dtype}"] = llama(
                llama_cpp.Llama(
                    model_path=str(path),
                    n_ctx=mcfg.block_size,
                    n_threads=threads,
                    n_threads_batch=threads,
                    verbose=False,
                )
            )
        for fn in engines.values():
            fn(8)  # warm-up: page in the weights, allocator, kernels
        times: dict[str, list[float]] = {k: [] for k in engines}
        first = {}
        for r in range(args.repeats):
            # rotate who goes first
            names = list(engines)[r % len(engines) :] + list(engines)[: r % len(engines)]
            for name in names:
                t = time.perf_counter()
                toks = engines[name]()
                dt = time.perf_counter() - t
                times[name].append(dt)
                first.setdefault(name, toks)
                print(
                    f"  {name:<16} {n:>5} new tokens: {dt:8.2f} s  {n / dt:7.1f} tokens/s",
                    flush=True,
                )
    same = {k: sum(a == b for a, b in zip(v, first["gptlib fp32"])) for k, v in first.items()}
    print(
        f"greedy tokens equal to gptlib's (of {n}; random weights, so near-ties are many): {same}"
    )
    print(
        f"\ntokens/s (gpt2-small shape, batch 1, greedy, {n} new tokens after a one-token prompt); the median, and the "
        f"best run (other work on a shared machine only ever slows a run down):"
    )
    base, best = (n / f(times["gptlib fp32"]) for f in (statistics.median, min))
    for name, ts in times.items():
        tps, top = n / statistics.median(ts), n / min(ts)
        print(
            f"  {name:<16} median {tps:6.1f} ({tps / base:4.2f}x gptlib)   best {top:6.1f} ({top / best:4.2f}x gptlib)"
        )
    print(f"load average at end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
