"""Chat fine-tuning batches: packed windows with a loss mask (what gptlib trains with) vs one conversation
per row, padded, with a mask: tokens/s and answer tokens/s of the same train step, side by side.

    python benchmarks/sft_bench.py [--conversations 2000] [--block-size 256] [--batch-size 16] [--steps 20]

Conversations are synthetic, of chat-dataset-like lengths (1-3 exchanges; questions of 5-60 words,
answers of 15-150 words, from Tiny Shakespeare's words), tokenized with tokenize --format chat. Both
layouts run the same model and `gptlib.training.step.train_step`; only the batches differ:

    packed  random windows of block_size over the stream of conversations (gptlib.batches.BatchSampler with
            a LossMask): every position is a real token; targets outside the answers are -1.
    padded  each row is one conversation from its start, cut at block_size, padded with <|endoftext|>;
            targets outside the answers and on the padding are -1.

Printed: median seconds per step, positions/s (B x T per step), answer tokens/s (targets that carry the
loss), and the share of each batch that is padding.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gptlib.batches import BatchSampler, LossMask, MemmapSplit, SplitData, _as_signed_view  # noqa: E402
from gptlib.config import ModelConfig, TrainConfig  # noqa: E402
from gptlib.data.prepare import prepare  # noqa: E402
from gptlib.data.shards import read_meta, read_spans  # noqa: E402
from gptlib.data.tokenizer import load_tokenizer  # noqa: E402
from gptlib.model import GPT  # noqa: E402
from gptlib.training.step import (  # noqa: E402
    StepTimer,  # noqa: E402
    build_optimizer,
    train_step,
)


def synthetic_conversations(text: str, n: int, seed: int = 0) -> list[dict]:
    words = text.split()
    rng = random.Random(seed)

    def span(lo: int, hi: int) -> str:
        k = rng.randint(lo, hi)
        i = rng.randrange(len(words) - k)
        return " ".join(words[i : i + k])

    out = []
    for _ in range(n):
        msgs = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            msgs += [
                {"role": "user", "content": span(5, 60)},
                {"role": "assistant", "content": span(15, 150)},
            ]
        out.append({"messages": msgs})
    return out


class PaddedSampler:
    """One conversation per row from its first token, cut at block_size, padded with end-of-text."""

    def __init__(
        self,
        stream: np.ndarray,
        in_answer: np.ndarray,
        eot: int,
        batch_size: int,
        block_size: int,
        seed: int,
    ):
        ends = np.flatnonzero(stream == eot)  # each conversation ends with <|endoftext|>
        self.starts = np.concatenate([[0], ends[:-1] + 1])
        self.ends = ends + 1
        self.stream, self.in_answer, self.eot = stream, in_answer, eot
        self.B, self.T = batch_size, block_size
        self.rng = np.random.default_rng(seed)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x = np.full((self.B, self.T), self.eot, dtype=np.int64)
        y = np.full((self.B, self.T), -1, dtype=np.int64)
        for row, c in enumerate(self.rng.integers(0, len(self.starts), self.B)):
            s, e = int(self.starts[c]), min(int(self.ends[c]), int(self.starts[c]) + self.T + 1)
            n = e - s - 1
            x[row, :n] = self.stream[s : e - 1]
            tgt = self.stream[s + 1 : e]
            y[row, :n] = np.where(self.in_answer[s + 1 : e], tgt, -1)
        return torch.from_numpy(x), torch.from_numpy(y)


def time_steps(model, optimizer, sampler, steps: int) -> tuple[list[float], float, float]:
    """-> (seconds per step, answer targets per step, padding share per step), after 2 warm-up steps."""
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    timer = StepTimer(torch.device("cpu"))
    times, answers, pads = [], [], []
    batches = []

    class Recorder:
        def next_batch(self):
            x, y = sampler.next_batch()
            batches.append((x, y))
            return x, y

    for i in range(steps + 2):
        t = time.perf_counter()
        train_step(
            model,
            optimizer,
            scaler,
            Recorder(),
            accum=1,
            autocast=torch.autocast("cpu", enabled=False),
            grad_clip=1.0,
            timer=timer,
        )
        if i >= 2:
            times.append(time.perf_counter() - t)
            x, y = batches[-1]
            answers.append(int((y != -1).sum()))
            pads.append(
                float((x == sampler.eot).float().mean())
                if isinstance(sampler, PaddedSampler)
                else 0.0
            )
    return times, statistics.mean(answers), statistics.mean(pads)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--text", default=str(REPO.parent / "shared" / "data" / "tinyshakespeare.txt"))
    ap.add_argument("--conversations", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="sft_bench_"))
    with open(work / "chats.jsonl", "w") as f:
        for c in synthetic_conversations(Path(a.text).read_text(), a.conversations):
            f.write(json.dumps(c) + "\n")
    prepare(
        [work / "chats.jsonl"],
        work / "data",
        vocab_size=2048,
        format="chat",
        verbose=False,
        split="document",
    )
    meta = read_meta(work / "data")
    mm = MemmapSplit(meta, "train")
    stream = mm.read(0, len(mm)).numpy().view(mm.dtype).astype(np.int64)
    spans = read_spans(meta, "train")
    in_answer = np.zeros(len(stream), dtype=bool)
    for s, e in spans:
        in_answer[s:e] = True
    eot = load_tokenizer(work / "data").eot_id
    data = SplitData(_as_signed_view(stream.astype(mm.dtype)), "train")
    conv_lens = np.diff(np.concatenate([[0], np.flatnonzero(stream == eot) + 1]))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(conv_lens):,} conversations, "
        f"{len(stream):,} tokens, median {int(np.median(conv_lens))} tokens per conversation "
        f"(p90 {int(np.percentile(conv_lens, 90))}), answers {in_answer.mean():.1%} of the tokens"
    )
    cfg = ModelConfig(
        vocab_size=meta.vocab_size,
        block_size=a.block_size,
        n_layer=a.layers,
        n_head=a.layers,
        n_embd=a.width,
        dropout=0.0,
    )
    print(
        f"model {a.layers} layers x {a.width}, context {a.block_size}, batch {a.batch_size}, {a.steps} timed steps, "
        f"median of {a.repeats} repeats (the two layouts alternate)"
    )
    results: dict[str, list] = {"packed": [], "padded": []}
    for rep in range(a.repeats):
        for name in ("packed", "padded"):
            torch.manual_seed(0)
            model = GPT(cfg)
            opt = build_optimizer(model, TrainConfig(learning_rate=1e-4), "cpu")
            sampler = (
                BatchSampler(
                    data, a.batch_size, a.block_size, rep, "cpu", LossMask(spans, len(stream))
                )
                if name == "packed"
                else PaddedSampler(stream, in_answer, eot, a.batch_size, a.block_size, rep)
            )
            times, answers, pad = time_steps(model, opt, sampler, a.steps)
            results[name].append((statistics.median(times), answers, pad))
    positions = a.batch_size * a.block_size
    print(f"{'layout':<8} {'s/step':>8} {'positions/s':>12} {'answer tokens/s':>16} {'padding':>8}")
    row = {}
    for name, rs in results.items():
        sec = statistics.median(r[0] for r in rs)
        ans = statistics.median(r[1] for r in rs)
        pad = statistics.median(r[2] for r in rs)
        row[name] = ans / sec
        print(f"{name:<8} {sec:>8.3f} {positions / sec:>12,.0f} {ans / sec:>16,.0f} {pad:>8.1%}")
    print(f"packed / padded, answer tokens/s: {row['packed'] / row['padded']:.2f}x")


if __name__ == "__main__":
    main()
