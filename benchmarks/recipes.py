"""The gpt2 and modern recipes side by side: same data, seed and token budget (issue 20's measurement).

    python benchmarks/recipes.py phase1 --text ../shared/data/tinyshakespeare.txt   # both recipes, 1,500 steps
    python benchmarks/recipes.py ablation --text ../shared/data/tinyshakespeare.txt # modern, one part switched back
    python benchmarks/recipes.py step                                               # gpt2-small: one step's parts
    python benchmarks/recipes.py step --preset phase1 --batch 32 --repeats 30       # phase1: the same parts
    python benchmarks/recipes.py bpe --data DATA_DIR --steps 600 --png curves.png   # BPE proxy on a code corpus

phase1 and ablation train the phase1 preset from scratch, exactly as `python -m gptlib train` does, and report the
loop's validation loss and the loss over the whole validation split; compare them by steps, not seconds. step
times, for gpt2-small (or phase1) on this CPU, one micro-batch's forward + backward (eager, or --compile) and one
optimizer step of each recipe (Muon's matrices each timed alone, times their count, and once more with the
Newton-Schulz in fp32), gives the time of a whole step at the preset's tokens per step from them, and counts Muon's
Newton-Schulz FLOPs against the step's forward and backward at phase1 and gpt2-small. bpe trains a few-million
parameter model on a BPE-tokenized code corpus (benchmarks/code_corpus.py, then `python -m gptlib tokenize
--tokenizer bpe`) and reports how many tokens each recipe needs to reach the gpt2 recipe's final validation loss.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from phase1_quality import cpu_name, full_val_loss  # noqa: E402

from gptlib.config import get_preset  # noqa: E402
from gptlib.data.prepare import prepare_text  # noqa: E402
from gptlib.model import GPT, model_size  # noqa: E402
from gptlib.training.loop import train  # noqa: E402
from gptlib.training.step import build_optimizer  # noqa: E402

# The modern recipe with one part switched back to GPT-2's. (The ReLU² MLP and soft-capped logits were measured
# here too, then removed for no gain: docs/benchmarks.md.)
ABLATIONS = [
    "positions=learned",
    "norm=layernorm",
    "qk_norm=false",
    "mlp=gelu",
    "tie_embeddings=true",
    "zero_init=false",
    "optimizer=adamw",
    "schedule=cosine",
]


def header() -> None:
    print(f"# {' '.join(sys.argv)}")
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, CPU: {cpu_name()}, "
        f"python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M:%S')}",
        flush=True,
    )


def phase1_run(data: Path, run: Path, recipe: str, overrides: list[str]) -> dict:
    r = train(data, run, "phase1", overrides, recipe=recipe, progress=False, log=lambda s: None)
    curve = {row["step"]: row["val_loss"] for row in r.history if row.get("val_loss") is not None}
    return {
        "val": r.val_loss,
        "full": full_val_loss(run, data),
        "steady_tps": r.steady_tokens_per_s,
        "wall_s": r.elapsed_s,
        "curve": curve,
        "steps": r.step,
    }


def cmd_phase1(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        prepare_text([args.text], data, tokenizer="char", verbose=False)
        rows: dict[str, list[dict]] = {"gpt2": [], "modern": []}
        for i in range(args.repeats):
            # alternate: drift cancels
            for recipe in ("gpt2", "modern") if i % 2 == 0 else ("modern", "gpt2"):
                row = phase1_run(data, Path(tmp) / f"{recipe}{i}", recipe, args.set)
                rows[recipe].append(row)
                print(
                    f"{recipe:7s} repeat {i}: val {row['val']:.4f} (loop), {row['full']:.4f} (whole val split); "
                    f"val by step {', '.join(f'{s}: {v:.3f}' for s, v in row['curve'].items())}; "
                    f"{row['steady_tps']:,.0f} tokens/s while stepping, {row['wall_s']:.1f} s",
                    flush=True,
                )
    med = {
        r: {k: statistics.median(x[k] for x in rows[r]) for k in ("val", "full", "steady_tps")}
        for r in rows
    }
    ratio = med["gpt2"]["steady_tps"] / med["modern"]["steady_tps"]
    print(
        f"median over {args.repeats}: gpt2 val {med['gpt2']['val']:.4f} / {med['gpt2']['full']:.4f}, modern val "
        f"{med['modern']['val']:.4f} / {med['modern']['full']:.4f} (loop / whole split); time per step modern / "
        f"gpt2 = {ratio:.3f}; targets: modern <= 1.60: {'MET' if med['modern']['val'] <= 1.60 else 'NOT MET'}, "
        f"<= 1.10x time per step: {'MET' if ratio <= 1.10 else 'NOT MET'}"
    )


def cmd_ablation(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        prepare_text([args.text], data, tokenizer="char", verbose=False)
        base = None if args.no_base else phase1_run(data, Path(tmp) / "modern", "modern", args.set)
        if base:
            print(
                f"{'modern':24s} val {base['val']:.4f} (loop) {base['full']:.4f} (whole val split)",
                flush=True,
            )
        for i, change in enumerate(args.only or ABLATIONS):
            row = phase1_run(data, Path(tmp) / f"ab{i}", "modern", [*args.set, change])
            print(
                f"{change:24s} val {row['val']:.4f} (loop) {row['full']:.4f} (whole val split)"
                + (f"; {row['full'] - base['full']:+.4f} against modern" if base else ""),
                flush=True,
            )


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ns_flops(shape) -> int:
    """FLOPs of torch.optim.Muon's Newton-Schulz on one matrix (m <= n): 5 iterations of X X^T, A A and B X."""
    m, n = sorted(shape)
    return 5 * (4 * m * m * n + 2 * m**3)


def muon_shapes(preset: str) -> tuple[Counter, int, int]:
    """The modern recipe's Muon matrices at a preset (shape -> count), its Newton-Schulz FLOPs per step and the
    step's forward + backward FLOPs (model_size's FLOPs per token x tokens per step), from a model on the meta
    device."""
    cfg = get_preset(preset, "modern").validate()
    with torch.device("meta"):
        model = GPT(cfg.model)
    shapes = Counter(
        tuple(p.shape)
        for p in build_optimizer(model, cfg.train, "cpu").muon.param_groups[0]["params"]
    )
    step_flops = model_size(cfg.model).flops_per_token * cfg.tokens_per_step
    return shapes, sum(ns_flops(s) * k for s, k in shapes.items()), step_flops


def newton_schulz_fp32(g: torch.Tensor, muon: torch.optim.Muon) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz (torch/optim/_muon.py, with `muon`'s coefficients and steps) in fp32 instead
    of bf16: what the update would cost on a device whose bf16 matmuls run at fp32's speed. For timing only."""
    (ca, cb, cc), steps = muon.defaults["ns_coefficients"], muon.defaults["ns_steps"]
    x = g.T if g.size(0) > g.size(1) else g
    x = x / x.norm().clamp(min=muon.defaults["eps"])
    for _ in range(steps):
        a = x @ x.T
        b = torch.addmm(a, a, a, beta=cb, alpha=cc)
        x = torch.addmm(x, b, x, beta=ca)
    return x


def cmd_step(args) -> None:
    out = {}
    for recipe in ("gpt2", "modern"):
        cfg = get_preset(args.preset, recipe).validate()
        torch.manual_seed(0)
        model = GPT(cfg.model)
        opt = build_optimizer(model, cfg.train, "cpu")
        x = torch.randint(0, cfg.model.vocab_size, (args.batch, cfg.model.block_size))
        # compiled: the norms' and rotary's ops fused
        forward = torch.compile(model) if args.compile else model

        def fwd_bwd(forward=forward, x=x):
            forward(x, x)[1].backward()

        fwd_bwd()
        fb = median_s(fwd_bwd, args.repeats)
        if recipe == "gpt2":
            opt.step()  # the optimizer's state exists from here on
            step, parts = median_s(opt.step, args.repeats), "AdamW, every weight"
        else:  # AdamW's part as it is; Muon's matrices each timed alone, x their count (the whole takes ~20 min here)
            opt.adamw.step()
            adamw = median_s(opt.adamw.step, args.repeats)
            muon, fp32, times = 0.0, 0.0, []
            for shape, count in muon_shapes(args.preset)[0].items():
                p = torch.nn.Parameter(torch.randn(shape))
                p.grad = torch.randn(shape)
                one = torch.optim.Muon(
                    [p], **{k: opt.muon.defaults[k] for k in ("lr", "momentum", "nesterov")}
                )
                one.step()
                t = median_s(one.step, args.repeats)
                t32 = median_s(lambda p=p, one=one: newton_schulz_fp32(p.grad, one), args.repeats)
                muon, fp32 = muon + t * count, fp32 + t32 * count
                times.append(f"{count} x {shape} {t * 1e3:,.1f} ms")
            step = adamw + muon
            parts = (
                f"AdamW {adamw * 1e3:,.1f} ms + Muon {muon * 1e3:,.1f} ms ({', '.join(times)}); its "
                f"Newton-Schulz in fp32 instead of bf16 {fp32 * 1e3:,.1f} ms"
            )
            out["fp32"] = adamw + fp32
        # forward+backward calls per step
        micro = cfg.train.batch_size * cfg.train.grad_accum_steps // args.batch
        out[recipe] = (fb, step, micro * fb + step)
        what = f"{args.batch} x {cfg.model.block_size} tokens" + " (compiled)" * args.compile
        print(
            f"{recipe:7s} forward+backward of {what} {fb * 1e3:,.1f} ms, optimizer step {step * 1e3:,.1f} ms "
            f"[{parts}]; a step of {micro} x {args.batch} sequences: {micro * fb + step:,.2f} s (the optimizer "
            f"{step / (micro * fb + step):.2%} of it)",
            flush=True,
        )
    (gfb, _, gtotal), (mfb, _, mtotal) = out["gpt2"], out["modern"]
    print(
        f"time per {args.preset} step modern / gpt2 = {mtotal / gtotal:.3f} (target <= 1.10); forward+backward "
        f"alone {mfb / gfb:.3f}; with Muon's Newton-Schulz in fp32 {(mfb * micro + out['fp32']) / gtotal:.3f}"
    )
    for preset in ("phase1", "gpt2-small"):  # the work itself, whatever the device's bf16 speed
        _, ns, fb = muon_shapes(preset)
        print(
            f"{preset}: Muon's Newton-Schulz {ns / 1e12:,.3f} TFLOP per step = {ns / fb:.2%} of the step's "
            f"forward + backward ({fb / 1e12:,.2f} TFLOP)"
        )


def bpe_overrides(steps: int) -> list[str]:
    return [
        "block_size=256",
        "n_layer=4",
        "n_head=4",
        "n_embd=192",
        "batch_size=16",
        f"max_steps={steps}",
        f"warmup_steps={max(1, steps // 30)}",
        f"eval_interval={max(1, steps // 20)}",
        "eval_batches=20",
        "sample_prompts=[]",
        "keep_every=0",
        "save_every_minutes=0",
        "vocab_multiple=64",
    ]


def cmd_bpe(args) -> None:
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for recipe, extra in (("gpt2", [f"learning_rate={args.gpt2_lr}"]), ("modern", [])):
            r = train(
                args.data,
                Path(tmp) / recipe,
                "phase1",
                bpe_overrides(args.steps) + extra + args.set,
                recipe=recipe,
                progress=False,
                log=lambda s: None,
            )
            tokens_per_step = r.tokens_seen / r.step
            curve = [
                (row["step"] * tokens_per_step, row["val_loss"])
                for row in r.history
                if row.get("val_loss") is not None
            ]
            runs[recipe] = curve
            print(
                f"{recipe:7s} {r.step} steps, {r.tokens_seen:,} tokens: val "
                f"{', '.join(f'{t / 1e6:.2f}M: {v:.3f}' for t, v in curve)}; {r.steady_tokens_per_s:,.0f} tokens/s",
                flush=True,
            )
    target = runs["gpt2"][-1][1]
    reach = {}
    for recipe, curve in runs.items():
        prev = (0.0, float("inf"))
        for t, v in curve:
            if v <= target:  # linear between the two validations around the crossing
                t0, v0 = prev
                reach[recipe] = (
                    t if v0 == float("inf") else t0 + (t - t0) * (v0 - target) / (v0 - v)
                )
                break
            prev = (t, v)
    ratio = reach["modern"] / reach["gpt2"] if "modern" in reach else None
    print(
        f"tokens to the gpt2 recipe's final val loss {target:.4f}: gpt2 {reach['gpt2'] / 1e6:.2f}M, modern "
        + (
            f"{reach['modern'] / 1e6:.2f}M ({ratio:.2f} of gpt2's; target <= 0.33: "
            f"{'MET' if ratio <= 1 / 3 else 'NOT MET'})"
            if ratio
            else "not reached"
        )
    )
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for recipe, curve in runs.items():
            ax.plot(
                [t / 1e6 for t, _ in curve], [v for _, v in curve], marker="o", ms=3, label=recipe
            )
        ax.axhline(target, color="gray", lw=0.8, ls="--")
        ax.set(
            xlabel="training tokens (M)",
            ylabel="validation loss",
            title="BPE proxy on Python sources",
        )
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"curves: {args.png}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="what", required=True)
    for name in ("phase1", "ablation"):
        p = sub.add_parser(name)
        p.add_argument("--text", required=True, help="Tiny Shakespeare text file")
        p.add_argument("--repeats", type=int, default=1)
        p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
        p.add_argument(
            "--only",
            action="append",
            help="ablation: these changes only (any FIELD=VALUE, e.g. an LR)",
        )
        p.add_argument(
            "--no-base", action="store_true", help="ablation: without the modern run itself (known)"
        )
    p = sub.add_parser("step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--preset", default="gpt2-small", choices=["phase1", "gpt2-small"])
    p.add_argument(
        "--batch", type=int, default=1, help="sequences per timed forward+backward (phase1: its 32)"
    )
    p.add_argument(
        "--compile", action="store_true", help="forward+backward under torch.compile, as a GPU run"
    )
    p = sub.add_parser("bpe")
    p.add_argument("--data", required=True, type=Path, help="a BPE data directory")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument(
        "--gpt2-lr", type=float, default=3e-3, help="the gpt2 recipe's peak LR at this size"
    )
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--png", type=Path)
    args = ap.parse_args()
    header()
    {"phase1": cmd_phase1, "ablation": cmd_ablation, "step": cmd_step, "bpe": cmd_bpe}[args.what](
        args
    )


if __name__ == "__main__":
    main()
