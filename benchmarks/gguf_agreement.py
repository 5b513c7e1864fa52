"""How closely llama.cpp follows gptlib on export-gguf's files (f32, f16, q8_0): the figures behind
tests/test_llama_cpp.py's tolerances. Trains small BPE runs of both recipes on Tiny Shakespeare (the test's shape),
then for each dtype and each of 20 prompts (lines of the text): llama.cpp's logits on gptlib's greedy continuation
(top-1 agreement, largest logit difference) and the two free-running greedy continuations (where they first part).

    PYTHONPATH=.llama-site python benchmarks/gguf_agreement.py --text ../shared/data/tinyshakespeare.txt
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gptlib.inference.engine import Engine  # noqa: E402
from gptlib.inference.export import export_gguf  # noqa: E402
from tests.gguf_kit import bpe_data, bpe_run  # noqa: E402
from tests.test_llama_cpp import F32_CACHE, compare_logits, greedy_ours, greedy_theirs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--text", required=True, help="tinyshakespeare.txt")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    import llama_cpp

    print(f"command: python {' '.join(sys.argv)}\nllama-cpp-python {llama_cpp.__version__}")
    text = Path(args.text).read_text()
    prompts = [line for line in text[300_000:].split("\n") if len(line) > 8][:40:2]
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "small.txt").write_text(text[:200_000])
        data = bpe_data(root / "small.txt", root / "data")
        for recipe, arch in (("gpt2", "gpt2"), ("modern", "qwen3")):
            t = time.time()
            run = bpe_run(data, root / arch, recipe, args.steps)
            print(f"{arch}: trained {args.steps} steps in {time.time() - t:.0f} s", flush=True)
            eng = Engine.from_run(run)
            for dtype in ("f32", "f16", "q8_0"):
                kw = dict(type_k=F32_CACHE, type_v=F32_CACHE) if dtype == "f32" else {}
                path = export_gguf(run, root / f"{arch}-{dtype}.gguf", dtype=dtype)
                llm = llama_cpp.Llama(
                    model_path=str(path), n_ctx=64, verbose=False, logits_all=True, **kw
                )
                agree = total = same16 = 0
                dmax, first = 0.0, []
                for p in prompts:
                    ids = eng.tokenizer.encode(p)[:20]
                    n = 64 - len(ids)
                    a, t, diff = compare_logits(eng, llm, ids, n)
                    agree, total, dmax = agree + a, total + t, max(dmax, diff)
                    ours, theirs = greedy_ours(eng, ids, n), greedy_theirs(llm, ids, n)
                    same16 += ours[:16] == theirs[:16]
                    first.append(
                        next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), n)
                    )
                print(
                    f"{arch} steps={args.steps} {dtype}: top1 agree {agree}/{total} = {agree / total:.4f}, max "
                    f"|dlogit| {dmax:.2e}, first16 equal {same16}/{len(prompts)}, first divergence min "
                    f"{min(first)} median {sorted(first)[len(first) // 2]}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
