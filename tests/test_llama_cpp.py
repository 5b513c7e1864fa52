"""export-gguf proven by a real client: llama-cpp-python (llama.cpp built from its PyPI source) loads the file, its
greedy tokens are gptlib's, its tokenizer splits text as gptlib's does, and a chat run answers through
create_chat_completion with the template it was trained on.

Tolerances, measured on this project's machine (2-core AMD EPYC, llama-cpp-python 0.3.36) by
benchmarks/gguf_agreement.py (raw output: benchmarks/results/gguf_agreement_cpu.txt): 100-step runs of both recipes,
20 Tiny Shakespeare lines as prompts, llama.cpp's logits against gptlib's on gptlib's greedy continuation (907
positions per model):
- f32 (f32 KV cache): top-1 907/907 for both; largest logit difference 2.0e-4 (gpt2: ggml's GELU reads an fp16
  table), 8.3e-6 (qwen3); every greedy continuation equal to the end.
- f16: top-1 907/907 for both; largest logit difference 1.7e-3 (gpt2), 6.2e-3 (qwen3); every greedy continuation
  equal to the end.
- q8_0: top-1 906/907 (gpt2) and 899/907 (qwen3); largest logit difference 0.029 and 0.12; free-running greedy text
  parts from gptlib's after a near-tie (the first 16 tokens equal for 19 and 16 of the 20 prompts).
So: f32 all tokens; f16 the first 16 tokens of each prompt, top-1 agreement >= 99% and logits within 0.05 (8x the
largest measured); q8_0 agreement >= 95% and logits within 0.5 (4x).

Run in CI by scripts/llama_env.sh (it builds and caches the wheel); skipped where llama_cpp is not installed.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from gptlib.inference.chat import ChatSession
from gptlib.inference.engine import Engine, SamplingConfig
from gptlib.inference.export import export_gguf
from tests.gguf_kit import SHAPE, bpe_data, bpe_run

llama_cpp = pytest.importorskip("llama_cpp")

F32_CACHE = 0  # GGML_TYPE_F32 for the KV cache (llama.cpp's default is f16)
PROMPTS = [
    "ROMEO:",
    "First Citizen:\nBefore we proceed",
    "KING HENRY",
    "\n",
    "What say you, my lord?",
]
TEXTS = [
    "Hello world",
    "  two  spaces   three   ",
    "\n\n\nnewlines\n \n\t tab\r\n",
    "12345 67890 3.14159 1,000,000",
    "def f(x):\n    return x**2  # comment\n\tif a != b: print('ok')",
    "naïve café — 東京 😀 Ω ≈ ∑",
    "don't I'll we've 'S",
    "a <|endoftext|> in the text stays text",
    "<|endoftext|><|end|>",
    " ",
    "x" * 300,
]


def client(path, **kw):
    return llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False, **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_text):
    """Runs trained long enough (100 steps) that their greedy choices are not coin flips."""
    root = tmp_path_factory.mktemp("llama")
    data = bpe_data(small_text, root / "data")
    return {
        "gpt2": bpe_run(data, root / "gpt2", steps=100),
        "qwen3": bpe_run(data, root / "qwen3", "modern", 100),
        "llama": bpe_run(
            data, root / "llama", "modern", 100, ["qk_norm=false", "tie_embeddings=true"]
        ),
    }


def greedy_ours(eng: Engine, ids: list[int], n: int) -> list[int]:
    return eng.generate_ids(
        [ids], SamplingConfig(max_new_tokens=n, temperature=0, stop_at_eot=False)
    )[0][0]


def greedy_theirs(llm, ids: list[int], n: int) -> list[int]:
    out = []
    for t in llm.generate(ids, temp=0, top_k=1, reset=True):
        out.append(t)
        if len(out) == n:
            return out


def compare_logits(eng: Engine, llm, ids: list[int], n: int) -> tuple[int, int, float]:
    """On gptlib's greedy continuation: (positions where llama.cpp's top token is gptlib's, positions, the largest
    logit difference)."""
    ours = greedy_ours(eng, ids, n)
    seq = ids + ours
    llm.reset()
    llm.eval(seq[:-1])
    theirs = np.array(llm.scores[len(ids) - 1 : len(seq) - 1])
    with torch.no_grad():
        mine = eng.model(torch.tensor([seq[:-1]]))[0][0, len(ids) - 1 :].numpy()
    return (
        int((theirs.argmax(-1) == np.array(ours)).sum()),
        len(ours),
        float(np.abs(theirs - mine).max()),
    )


@pytest.mark.parametrize("arch", ["gpt2", "qwen3", "llama"])
def test_f32_greedy_tokens_are_gptlibs(runs, tmp_path, arch):
    eng = Engine.from_run(runs[arch])
    llm = client(
        export_gguf(runs[arch], tmp_path / "m.gguf", dtype="f32"),
        type_k=F32_CACHE,
        type_v=F32_CACHE,
    )
    for p in PROMPTS:
        ids = eng.tokenizer.encode(p)
        n = 64 - len(ids)  # to the end of the context
        assert greedy_theirs(llm, ids, n) == greedy_ours(eng, ids, n), p


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_f16_and_q8_0_within_the_measured_tolerance(runs, tmp_path, arch):
    eng = Engine.from_run(runs[arch])
    prompts = [eng.tokenizer.encode(p) for p in PROMPTS]
    f16 = client(export_gguf(runs[arch], tmp_path / "f16.gguf", dtype="f16"), logits_all=True)
    for ids in prompts:
        assert greedy_theirs(f16, ids, 16) == greedy_ours(eng, ids, 16)
    for llm, least, most in (
        (f16, 0.99, 0.05),
        (
            client(export_gguf(runs[arch], tmp_path / "q8.gguf", dtype="q8_0"), logits_all=True),
            0.95,
            0.5,
        ),
    ):
        agree, total, diff = zip(*[compare_logits(eng, llm, ids, 64 - len(ids)) for ids in prompts])
        assert sum(agree) / sum(total) >= least and max(diff) <= most, (agree, total, diff)


def test_llama_cpp_tokenizes_as_gptlib(runs, tmp_path):
    tok = Engine.from_run(runs["gpt2"]).tokenizer
    llm = client(export_gguf(runs["gpt2"], tmp_path / "m.gguf"), vocab_only=True)
    for text in TEXTS:
        ids = llm.tokenize(text.encode(), add_bos=False, special=False)
        assert ids == tok.encode(text), text
        assert llm.detokenize(ids).decode() == text
    assert tok.eot_id not in llm.tokenize(TEXTS[-4].encode(), add_bos=False, special=False)


WORDS = "apple river stone cloud tiger lamp green seven music ocean paper silver candle forest window honey".split()
OPPOSITE = {**dict(zip(WORDS[:8], WORDS[8:])), **dict(zip(WORDS[8:], WORDS[:8]))}
SYSTEM = "Be brief."


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A chat-format BPE run (tokenize --format chat) trained on a templated Q&A set."""
    from gptlib.data.prepare import prepare
    from gptlib.training.loop import train

    root, rng = tmp_path_factory.mktemp("chat"), random.Random(0)
    with open(root / "chat.jsonl", "w") as f:
        for _ in range(1500):
            w = rng.choice(WORDS)
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "system", "content": SYSTEM},
                            {"role": "user", "content": f"What is the opposite of {w}?"},
                            {"role": "assistant", "content": f"The opposite is {OPPOSITE[w]}."},
                        ]
                    }
                )
                + "\n"
            )
    prepare([root / "chat.jsonl"], root / "data", format="chat", vocab_size=400, verbose=False)
    train(
        root / "data",
        root / "run",
        overrides=SHAPE + ["eval_interval=100"],
        max_steps=100,
        device="cpu",
        progress=False,
        log=lambda s: None,
    )
    return root / "run"


def test_a_chat_run_answers_through_llama_cpps_chat_api_with_its_template(chat_run, tmp_path):
    from gptlib.data.conversations import ChatTemplate

    llm = client(
        export_gguf(chat_run, tmp_path / "chat.gguf", dtype="f32"),
        type_k=F32_CACHE,
        type_v=F32_CACHE,
    )
    session = ChatSession.from_run(chat_run, system=SYSTEM, log=lambda s: None)
    template = ChatTemplate(session.engine.tokenizer)
    for w in WORDS[:3]:
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is the opposite of {w}?"},
        ]
        # the same prompt tokens: gptlib's rendering, and the newline every answer starts with
        text = llama_cpp.llama_chat_format.Jinja2ChatFormatter(
            llm.metadata["tokenizer.chat_template"], eos_token="", bos_token=""
        )(messages=messages).prompt
        ids = template.render(messages, require_assistant=False, generation_prompt=True)[0].tolist()
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids + template.nl_ids
        session.reset()
        ours = session.reply(
            messages[1]["content"], SamplingConfig(max_new_tokens=25, temperature=0)
        )
        got = llm.create_chat_completion(messages=messages, temperature=0, max_tokens=24)[
            "choices"
        ][0]
        # both ended the turn at <|end|>
        assert session.finish_reason == "eot" and got["finish_reason"] == "stop"
        assert got["message"]["content"] == ours and ours.startswith("The opposite is")
