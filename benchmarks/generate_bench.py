"""Single-stream generation speed: gptlib's KV-cached engine (and decoding without a cache) vs transformers'.

Same weights (our model exported with gptlib.inference.export and loaded as GPT2LMHeadModel), same machine,
same process, runs interleaved so both see the same machine load. On a CPU also the engine with its few-row matmuls
never split ("gptlib plain"; the engine splits them where it measured that faster: gptlib/inference/engine.py).
Greedy decoding, a one-token
prompt (so 1,024 new tokens fit GPT-2's 1,024 positions, which transformers cannot exceed), no
early stop. Prints every run, then medians and ratios.

    python benchmarks/generate_bench.py                      # gpt2-small, 256 and 1024 new tokens
    python benchmarks/generate_bench.py --preset phase1 --new-tokens 64 --repeats 2   # quick check
    python benchmarks/generate_bench.py --device cuda             # on a GPU

Needs `pip install transformers` (a test-only dependency).
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
from gptlib.inference.engine import Engine, SamplingConfig  # noqa: E402
from gptlib.inference.export import export_model  # noqa: E402
from gptlib.model import GPT, model_size  # noqa: E402


def machine_info() -> str:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (
        f"cpu: {cpu}; {os.cpu_count()} logical cores; torch threads {torch.get_num_threads()}; gpu: {dev}\n"
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"load average at start {os.getloadavg() if hasattr(os, 'getloadavg') else '?'}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[256, 1024])
    ap.add_argument(
        "--repeats", type=int, default=3, help="timed runs per cached setting (median reported)"
    )
    ap.add_argument(
        "--nocache-repeats",
        type=int,
        default=1,
        help="timed runs without cache (slow: a full forward of the context per token)",
    )
    ap.add_argument(
        "--nocache-tokens",
        type=int,
        nargs="*",
        default=None,
        help="new-token counts measured without cache (default: all of --new-tokens)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers import GPT2LMHeadModel

    print(f"command: python {' '.join(sys.argv)}")
    print(machine_info())
    torch.manual_seed(args.seed)
    mcfg = get_preset(args.preset).model
    # random init weights: speed does not depend on training
    model = GPT(mcfg).to(args.device).eval()
    print(
        f"model: preset {args.preset}, {model_size(mcfg).params / 1e6:.1f}M parameters, context {mcfg.block_size}, "
        f"vocab {mcfg.vocab_size}, fp32, device {args.device}"
    )
    with tempfile.TemporaryDirectory() as d:
        export_model(model, Path(d) / "hf")
        hf = (
            GPT2LMHeadModel.from_pretrained(Path(d) / "hf", dtype=torch.float32)
            .to(args.device)
            .eval()
        )
    eng, plain = Engine(model), Engine(model)
    plain.split_matmuls = False  # F.linear always
    prompt = [1]
    x = torch.tensor([prompt], device=args.device)
    with torch.no_grad():
        diff = (hf(x[:, :1]).logits[0, -1] - model(x[:, :1])[0][0, -1]).abs().max().item()
    print(f"same weights: max |logit difference| = {diff:.2e}")

    def ours(n: int, use_cache: bool, engine: Engine = eng) -> tuple[float, list[int]]:
        t = time.perf_counter()
        if use_cache:
            out = engine.generate_ids([prompt], SamplingConfig(max_new_tokens=n, temperature=0))[0][
                0
            ]
            # generate_ids returns host lists: the device is synchronised
            return (
                time.perf_counter() - t,
                out,
            )
        # without a cache: a forward of the whole context per token, the last position projected
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(n):
                h = model.hidden_states(torch.tensor([ids[-mcfg.block_size :]], device=args.device))
                ids.append(int(model.head(h[:, -1]).argmax()))
        return time.perf_counter() - t, ids[len(prompt) :]

    def theirs(n: int) -> tuple[float, list[int]]:
        t = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return time.perf_counter() - t, out[0, len(prompt) :].tolist()

    for n in args.new_tokens:  # positions must fit the model (transformers cannot slide a window)
        if len(prompt) + n > mcfg.block_size + 1:
            raise SystemExit(
                f"--new-tokens {n}: one-token prompt + {n} exceeds block_size {mcfg.block_size}"
            )
    # warm-up (allocator, kernels, lazy imports)
    (
        ours(8, True),
        ours(8, False),
        theirs(8),
        ours(8, True, plain),
    )
    if args.device == "cpu":
        print(
            f"the engine measured its few-row matmuls {'faster' if eng.split_matmuls else 'not faster'} split on "
            f"this CPU: {'split' if eng.split_matmuls else 'plain F.linear'}"
        )

    results: dict[tuple[str, int], list[float]] = {}
    for n in args.new_tokens:
        for r in range(args.repeats):
            # Alternate the order so neither side always runs first after the other.
            order = [
                ("gptlib cache", lambda n=n: ours(n, True)),
                ("transformers", lambda n=n: theirs(n)),
            ]
            if args.device == "cpu":
                order.insert(1, ("gptlib plain", lambda n=n: ours(n, True, plain)))
            if r % 2:
                order.reverse()
            toks = {}
            for name, fn in order:
                dt, toks[name] = fn()
                results.setdefault((name, n), []).append(dt)
                print(
                    f"  {name:<16} {n:>5} new tokens: {dt:8.2f} s  {n / dt:7.1f} tokens/s",
                    flush=True,
                )
            if r == 0:
                print(
                    f"  greedy tokens identical (gptlib vs transformers, {n}): "
                    f"{toks['gptlib cache'] == toks['transformers']}",
                    flush=True,
                )
        for _ in range(
            args.nocache_repeats if args.nocache_tokens is None or n in args.nocache_tokens else 0
        ):
            dt, _ = ours(n, False)
            results.setdefault(("gptlib no cache", n), []).append(dt)
            print(
                f"  {'gptlib no cache':<16} {n:>5} new tokens: {dt:8.2f} s  {n / dt:7.1f} tokens/s",
                flush=True,
            )

    print("\nmedian tokens/s (single stream, greedy, batch 1):")
    print(
        f"  {'new tokens':>10} {'gptlib cache':>14} {'gptlib plain':>13} {'gptlib no cache':>16} "
        f"{'transformers':>14} {'cache/transformers':>19} {'plain/transformers':>19} {'cache/no cache':>15}"
    )
    nan = float("nan")
    for n in args.new_tokens:
        tps = {
            k: n / statistics.median(results[(k, n)])
            for k in ("gptlib cache", "gptlib plain", "gptlib no cache", "transformers")
            if (k, n) in results
        }
        nc, pl, hf_tps = tps.get("gptlib no cache"), tps.get("gptlib plain"), tps["transformers"]
        print(
            f"  {n:>10} {tps['gptlib cache']:>14.1f} {pl or nan:>13.1f} {nc or nan:>16.1f} {hf_tps:>14.1f} "
            f"{tps['gptlib cache'] / hf_tps:>18.2f}x {(pl or nan) / hf_tps:>18.2f}x "
            f"{(tps['gptlib cache'] / nc) if nc else nan:>14.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
