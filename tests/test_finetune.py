"""Chat fine-tuning (SFT): the loss is on the assistants' answers only, a tiny model learns a templated
Q&A set and answers held-out questions of the same template, an SFT run resumes exactly after SIGKILL,
and the base run is never modified.

The base is a tiny BPE model trained briefly on the words of the task; the chat data is tokenized with
`tokenizer_from=base` (which appends the chat tokens), and fine-tuning starts from the base with
`init_from` and the `finetune` preset, as notebook 05 and the CLI do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gptlib.batches import BatchSampler, LossMask, MemmapSplit, SplitData, _as_signed_view
from gptlib.checkpoint.format import load_model_weights
from gptlib.data.conversations import ChatTemplate
from gptlib.data.prepare import prepare
from gptlib.data.shards import read_meta, read_spans
from gptlib.inference.loading import load_run
from gptlib.model import GPT
from gptlib.training.logs import read_metrics
from gptlib.training.loop import train
from gptlib.training.resume import StartOptions
from tests import faulty
from tests.conftest import REPO, newest_checkpoint
from tests.device_ops import DeviceOps
from tests.tokenize_kit import split_tokens

WORDS = "apple river stone cloud tiger lamp green seven music ocean paper silver candle forest window honey".split()
# an arbitrary fixed pairing
OPPOSITE = {
    **dict(zip(WORDS[:8], WORDS[8:])),
    **dict(zip(WORDS[8:], WORDS[:8])),
}
NAMES = "anna ben carl dora emil fay gus hana ivan jude kim lou max nina otto pia".split()
SMALL = {"n_layer": 2, "n_head": 4, "n_embd": 64, "dropout": 0.0}


def question(name: str, word: str) -> str:
    return f"{name} asks: what is the opposite of {word}?"


def conversation(name: str, word: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": question(name, word)},
            {"role": "assistant", "content": OPPOSITE[word]},
        ]
    }


def quiet(_msg: str) -> None:
    pass


def tree_digest(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(autouse=True)
def one_thread():
    """The same thread count in-process as in the subprocesses (OMP_NUM_THREADS=1): the same float sums."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def qa(tmp_path_factory) -> dict:
    """A base run (BPE, trained a little on the task's words), the Q&A conversations tokenized with its
    tokenizer (train: every (name, word) pair but the held-out ones), and the held-out pairs."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("qa")
    rng = random.Random(0)
    vocab = WORDS + NAMES + "asks: what is the opposite of".split()
    (root / "base.txt").write_text(
        "\n".join(" ".join(rng.choice(vocab) for _ in range(12)) for _ in range(3000))
    )
    prepare([root / "base.txt"], root / "base_data", vocab_size=300, verbose=False)
    train(
        root / "base_data",
        root / "base",
        "phase1",
        {
            **SMALL,
            "block_size": 64,
            "max_steps": 30,
            "eval_interval": 30,
            "batch_size": 16,
            "sample_tokens": 0,
            "learning_rate": 3e-3,
        },
        device="cpu",
        progress=False,
        log=quiet,
    )
    pairs = [(n, w) for n in NAMES for w in WORDS]
    rng.shuffle(pairs)
    held_out, seen = pairs[:24], pairs[24:]
    with open(root / "chat.jsonl", "w") as f:
        for n, w in seen:
            f.write(json.dumps(conversation(n, w)) + "\n")
    prepare(
        [root / "chat.jsonl"],
        root / "chat_data",
        tokenizer_from=root / "base",
        format="chat",
        verbose=False,
    )
    return {"root": root, "base": root / "base", "data": root / "chat_data", "held_out": held_out}


def finetune(qa: dict, run_dir: Path, steps: int, **overrides):
    settings = {
        **SMALL,
        "max_steps": steps,
        "eval_interval": steps,
        "batch_size": 16,
        "grad_accum_steps": 1,
        "learning_rate": 1e-2,
        "warmup_steps": 10,
        "eval_batches": 4,
        "sample_tokens": 0,
        "save_every_minutes": 0,
        **overrides,
    }
    return train(
        qa["data"],
        run_dir,
        "finetune",
        settings,
        device="cpu",
        compile="off",
        progress=False,
        log=quiet,
        options=StartOptions(init_from=str(qa["base"])),
    )


# ------------------------------------------------------------------------------------------ masking


def stream_and_spans(data_dir: Path, split: str = "train") -> tuple[np.ndarray, set[int]]:
    meta = read_meta(data_dir)
    in_span = set()
    for s, e in read_spans(meta, split):
        in_span.update(range(int(s), int(e)))
    return split_tokens(meta, split).astype(np.int64), in_span


@pytest.mark.parametrize("where", ["ram", "memmap"])
def test_the_sampler_keeps_exactly_the_assistant_targets(qa, where):
    meta = read_meta(qa["data"])
    stream, in_span = stream_and_spans(qa["data"])
    data = MemmapSplit(meta, "train")
    if where == "ram":
        data = SplitData(_as_signed_view(data.read(0, len(data)).numpy().view(data.dtype)), "train")
    mask = LossMask(read_spans(meta, "train"), len(data))
    sampler = BatchSampler(data, 8, 64, seed=3, device="cpu", loss_mask=mask)
    plain = BatchSampler(data, 8, 64, seed=3, device="cpu")
    for _ in range(6):
        x, y = sampler.next_batch()
        x0, y0 = plain.next_batch()
        assert torch.equal(x, x0)  # the mask changes no token and no draw of the RNG
        # each row's window: find it in the stream, then every target is kept iff its position is in a span
        for row in range(x.shape[0]):
            start = int(
                np.flatnonzero(
                    np.all(
                        np.lib.stride_tricks.sliding_window_view(stream, 65)
                        == np.concatenate([x0[row].numpy(), y0[row, -1:].numpy()]),
                        axis=1,
                    )
                )[0]
            )
            want = [
                int(stream[start + 1 + t]) if start + 1 + t in in_span else -1 for t in range(64)
            ]
            assert y[row].tolist() == want
    # the answers are a minority of the tokens; the questions are context
    assert 0 < mask.fraction < 0.5


def test_only_the_answers_carry_the_loss_and_gradient(qa):
    """The loss is the mean over assistant targets of -log p (brute force); the logits at the user's
    positions get exactly zero gradient, so whatever the user's tokens are as targets, the loss is the
    same. With chat_loss=all (no mask) the same batch's loss differs (negative control)."""
    meta = read_meta(qa["data"])
    data = MemmapSplit(meta, "train")
    sampler = BatchSampler(data, 4, 64, 0, "cpu", LossMask(read_spans(meta, "train"), len(data)))
    plain = BatchSampler(data, 4, 64, 0, "cpu")
    x, y = sampler.next_batch()
    _, y_all = plain.next_batch()
    ld = load_run(qa["base"], log=quiet)
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(ld.config.model, vocab_size=meta.vocab_size))
    logits, loss = model(x, y)
    logp = torch.log_softmax(logits.float(), -1)
    keep = y != -1
    brute = -logp[keep].gather(1, y[keep].unsqueeze(1)).mean()
    assert torch.allclose(loss, brute, atol=1e-5), (float(loss), float(brute))
    grads = torch.autograd.grad(loss, logits)[0]
    assert grads[~keep].abs().max() == 0 and grads[keep].abs().max() > 0
    # other user tokens as targets ...
    y_other = torch.where(keep, y, torch.randint_like(y, meta.vocab_size))
    _, loss_other = model(x, torch.where(keep, y_other, -1))  # ... masked as training masks them
    assert torch.equal(loss_other, loss)
    _, loss_all = model(x, y_all)
    assert not torch.allclose(loss_all, loss)


def test_a_window_without_an_answer_gives_zero_loss_not_nan():
    from gptlib.config import ModelConfig

    model = GPT(ModelConfig(vocab_size=50, block_size=8, n_layer=1, n_head=1, n_embd=8))
    x = torch.randint(0, 50, (2, 8))
    _, loss = model(x, torch.full((2, 8), -1))
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_a_chat_batch_on_the_device_copies_its_starts_there_once():
    """Data on the device (the meta device stands in for a GPU: tests/device_ops.py): each chat batch makes one
    host -> device copy, its B window starts, which the gather and the loss mask share. A second copy for the
    mask, from pageable memory, made the host wait for the GPU on every micro-batch of notebook 05."""
    dev = torch.device("meta")
    data = SplitData(torch.randint(0, 100, (5000,), dtype=torch.int16).to(dev), "train")
    mask = LossMask(np.array([[10, 50], [300, 900], [2000, 2100]]), len(data), dev)
    sampler = BatchSampler(data, 8, 64, seed=0, device=dev, loss_mask=mask)
    for _ in range(3):
        with DeviceOps() as ops:
            x, y = sampler.next_batch()
        assert ops.host_to_device == [("aten._to_copy", (8,))], ops.host_to_device
        assert ops.syncs == []
        assert x.shape == y.shape == (8, 64) and y.device == dev and y.dtype == torch.int64
    assert "aten.searchsorted" in ops.ops  # the mask was built, on the device


# ------------------------------------------------------------------------------------ learning, chat


def greedy_answer(ld, template: ChatTemplate, name: str, word: str) -> str:
    ids, _ = template.render(
        [{"role": "user", "content": question(name, word)}],
        require_assistant=False,
        generation_prompt=True,
    )
    x = torch.tensor(ids).unsqueeze(0)
    out = []
    with torch.no_grad():
        for _ in range(6):
            logits, _ = ld.model(x)
            nxt = int(logits[0, -1].argmax())
            if nxt == template.end_id:
                break
            out.append(nxt)
            x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    return ld.tokenizer.decode(out).strip()


def test_a_tiny_model_learns_the_qa_set_and_answers_held_out_questions(qa, tmp_path):
    run_dir = tmp_path / "sft"
    base_before = tree_digest(qa["base"])
    r = finetune(qa, run_dir, steps=300, sample_tokens=8)
    # near zero: only the answers count
    assert r.val_loss is not None and r.val_loss < 0.15, r.summary()
    # the samples at validation: the val split's first 2 questions as chat prompts, each answer cut at <|end|>
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [300, 300]
    for s in samples:
        asked = re.fullmatch(
            r"<\|user\|>\n(\w+) asks: what is the opposite of (\w+)\?<\|end\|>\n<\|assistant\|>",
            s["prompt"],
        )
        assert asked, s["prompt"]
        assert s["text"] == s["prompt"] + "\n" + OPPOSITE[asked[2]], s
    assert tree_digest(qa["base"]) == base_before  # the base run is never modified
    ld = load_run(run_dir, log=quiet)
    template = ChatTemplate(ld.tokenizer)
    answers = {(n, w): greedy_answer(ld, template, n, w) for n, w in qa["held_out"]}
    wrong = {k: v for k, v in answers.items() if v != OPPOSITE[k[1]]}
    assert not wrong, f"held-out questions answered wrongly: {wrong}"
    # the same through the CLI a user types: only the reply on stdout
    for n, w in qa["held_out"][:2]:
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "gptlib",
                "chat",
                "--run-dir",
                str(run_dir),
                "--message",
                question(n, w),
                "--temperature",
                "0",
                "--max-new-tokens",
                "6",
                "--device",
                "cpu",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert p.returncode == 0 and p.stdout.strip() == OPPOSITE[w], (p.stdout, p.stderr)
    state = json.loads((newest_checkpoint(run_dir).path / "state.json").read_text())
    assert state["init_from"]["path"].startswith(str(qa["base"]))


# --------------------------------------------------------------------------------------- exact resume


def run_cli(
    qa: dict, run_dir: Path, steps: int, fault: str | None, init_from: bool = True
) -> subprocess.CompletedProcess:
    cmd = faulty.gptlib_cmd(
        fault,
        "train",
        "--data",
        qa["data"],
        "--run-dir",
        run_dir,
        "--preset",
        "finetune",
        *(("--init-from", qa["base"]) if init_from else ()),
        "--max-steps",
        steps,
        "--device",
        "cpu",
        "--quiet",
    )
    for k, v in {
        **SMALL,
        "eval_interval": 10,
        "batch_size": 8,
        "learning_rate": 1e-2,
        "warmup_steps": 2,
        "eval_batches": 2,
        "sample_tokens": 0,
        "save_every_minutes": 0,
        "save_every_steps": 5,
        "log_interval": 1,
        "dropout": 0.1,
        "compile": "off",
    }.items():
        cmd += ["--set", f"{k}={v}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


def test_an_sft_run_killed_mid_step_resumes_exactly(qa, tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    p = run_cli(qa, ref, 20, None)
    assert p.returncode == 0, p.stderr
    p = run_cli(qa, run, 20, "kill:mid_step@13")
    assert p.returncode == -signal.SIGKILL, p.stderr
    p = run_cli(qa, run, 20, None)
    assert p.returncode == 0 and "resuming it" in p.stdout + p.stderr, p.stdout + p.stderr
    a = {r["step"]: (r["train_loss"], r.get("val_loss")) for r in read_metrics(ref)}
    b = {r["step"]: (r["train_loss"], r.get("val_loss")) for r in read_metrics(run)}
    assert sorted(b) == list(range(1, 21)) and a == b
    wa = load_model_weights(newest_checkpoint(ref).path)
    wb = load_model_weights(newest_checkpoint(run).path)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # resumed again without --init-from (the base is in its checkpoint): it was refused, the preset's shape compared
    # with the base's ("holds a run with block_size=... but this call asks for ...")
    p = run_cli(qa, run, 25, None, init_from=False)
    assert p.returncode == 0 and "resumed from step 20" in p.stdout + p.stderr, p.stdout + p.stderr
    assert read_metrics(run)[-1]["step"] == 25


def test_chat_loss_all_trains_on_every_token(qa, tmp_path):
    r = finetune(qa, tmp_path / "all", steps=10, chat_loss="all")
    masked = finetune(qa, tmp_path / "masked", steps=10)
    # the questions are most of the tokens and are far less predictable than the answers' template
    assert r.history[0]["train_loss"] != masked.history[0]["train_loss"]
    cfg = json.loads((tmp_path / "all" / "config.json").read_text())
    assert cfg["train"]["chat_loss"] == "all"
