"""Generation engine, checkpoint loading and the `sample` CLI."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from gptlib.checkpoint.format import CheckpointError
from gptlib.config import ModelConfig
from gptlib.data.tokenizer import CharTokenizer, TokenizerError
from gptlib.inference.engine import (
    Engine,
    GenerationError,
    SamplingConfig,
    process_logits,
    sample_next,
)
from gptlib.inference.loading import (
    checkpoint_table,
    load_run,
    read_state_and_tokenizer,
    resolve_checkpoint,
)
from gptlib.model import GPT

from .conftest import TINY
from .device_ops import DeviceOps


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    m = GPT(
        ModelConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32, vocab_multiple=64)
    )
    # Larger weights than the init so the greedy path is not a flat distribution with near-ties.
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(5.0)
    return m.eval()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, char_data):
    """A tiny trained char-level run with checkpoints at steps 5 and 10."""
    from gptlib.training.loop import train

    rd = tmp_path_factory.mktemp("gen") / "run"
    train(
        char_data,
        rd,
        overrides=TINY + ["eval_interval=5", "keep_last=5"],
        max_steps=10,
        progress=False,
        log=lambda s: None,
    )
    return rd


def naive_greedy(model: GPT, prompt: list[int], n: int) -> list[int]:
    """Reference: a full forward of the last block_size tokens for every new token (nanoGPT; the engine before its
    context shift)."""
    ids = list(prompt)
    bs = model.config.block_size
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([ids[-bs:]]))
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def shifted_greedy(model: GPT, prompt: list[int], n: int) -> list[int]:
    """Reference of the context shift, a full forward per token: the window starts where the last shift left it;
    a token that would see more than block_size tokens restarts it at the newest block_size // 2."""
    ids, bs = list(prompt), model.config.block_size
    start = max(0, len(ids) - bs)
    with torch.no_grad():
        for _ in range(n):
            if len(ids) - start > bs:
                start = len(ids) - bs // 2
            logits, _ = model(torch.tensor([ids[start:]]))
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def rope_model() -> GPT:
    """The modern recipe's positions (rotary) and norms, at the fixture's size."""
    torch.manual_seed(1)
    m = GPT(
        ModelConfig(
            vocab_size=50,
            block_size=16,
            n_layer=2,
            n_head=2,
            n_embd=32,
            vocab_multiple=64,
            positions="rope",
            norm="rmsnorm",
            qk_norm=True,
            mlp="swiglu",
        )
    )
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(5.0)
    return m.eval()


@pytest.mark.parametrize("recipe", ["gpt2", "modern"])
def test_greedy_cache_equals_a_full_forward_before_and_past_the_context(model, recipe):
    """Up to the context's end (block_size tokens of context) the engine's tokens are the full-window forward's;
    past it, the context shift's, three block_sizes long."""
    m = model if recipe == "gpt2" else rope_model()
    bs, eng = m.config.block_size, Engine(m)
    greedy = SamplingConfig(max_new_tokens=3 * bs, temperature=0)
    # a one-token prompt: the first block_size new tokens fit the context
    cached, reasons = eng.generate_ids([[1]], greedy)
    assert cached[0][:bs] == naive_greedy(m, [1], bs) and reasons == ["length"]
    shifted = shifted_greedy(m, [1], 3 * bs)
    assert cached[0] == shifted
    # the references tell the two windows apart: the test would see the old sliding one
    assert shifted != naive_greedy(m, [1], 3 * bs)
    prompt = [3, 1, 4, 1, 5]
    cached = eng.generate_ids([prompt], SamplingConfig(max_new_tokens=40, temperature=0))[0][0]
    assert cached == shifted_greedy(m, prompt, 40)
    assert cached[: bs + 1 - len(prompt)] == naive_greedy(m, prompt, bs + 1 - len(prompt))
    # A prompt longer than the context: its last block_size tokens, then shifts.
    long_prompt = list(range(1, 30))
    out = eng.generate_ids([long_prompt], SamplingConfig(max_new_tokens=12, temperature=0))[0][0]
    assert out == shifted_greedy(m, long_prompt, 12)
    assert out[0] == naive_greedy(m, long_prompt, 1)[0]


def test_past_the_context_the_cache_is_refilled_once_per_half_window(model, monkeypatch):
    """Each forward's width for 3 x block_size new tokens: one-token steps and a refill of block_size // 2 tokens
    each time the cache is full again (the engine before refilled all block_size at every token past it)."""
    bs, widths = model.config.block_size, []
    eng = Engine(model)
    forward = model.hidden_states
    monkeypatch.setattr(
        model,
        "hidden_states",
        lambda idx, cache=None: widths.append(idx.shape[1]) or forward(idx, cache),
    )
    eng.generate_ids([[1]], SamplingConfig(max_new_tokens=3 * bs, temperature=0))
    # shifts at the 17th, 26th, 35th and 44th token of 48 (bs 16: every bs - bs // 2 + 1)
    assert sorted(set(widths)) == [1, bs // 2] and widths.count(bs // 2) == 4, widths
    assert len(widths) == 3 * bs  # the prompt's forward, then one per new token but the last


def test_batch_of_prompts_of_different_lengths_equals_one_by_one(model):
    eng = Engine(model)
    # the first longer than the context (16): beside a short one it was read token by token through the shifting
    # cache, and its first new token saw 3 of its tokens, where alone it saw its last 16
    prompts = [[(7 * i) % 50 for i in range(40)], [1, 2, 3, 4, 5, 6, 7], [9], [4, 4, 4]]
    greedy = SamplingConfig(max_new_tokens=20, temperature=0, repetition_penalty=1.3)
    batch, _ = eng.generate_ids(prompts, greedy)
    for p, out in zip(prompts, batch):
        assert len(out) == 20
        assert out == eng.generate_ids([p], greedy)[0][0]


def test_seeded_sampling_is_reproducible(model):
    eng = Engine(model)
    cfg = SamplingConfig(max_new_tokens=30, temperature=1.0, top_k=20, top_p=0.95, seed=123)
    a = eng.generate_ids([[1, 2], [3]], cfg)[0]
    b = eng.generate_ids([[1, 2], [3]], cfg)[0]
    assert a == b
    cfg.seed = 124
    assert eng.generate_ids([[1, 2], [3]], cfg)[0] != a
    # top_k=1 is greedy whatever the temperature
    one = eng.generate_ids(
        [[1, 2]], SamplingConfig(max_new_tokens=10, temperature=1.5, top_k=1, seed=5)
    )[0][0]
    assert one == eng.generate_ids([[1, 2]], SamplingConfig(max_new_tokens=10, temperature=0))[0][0]


def test_logits_processing():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seen = torch.tensor([[True, True, False, False]])
    # Repetition penalty: positive logits divided, negative ones multiplied (both become less likely).
    out = process_logits(logits, SamplingConfig(temperature=0, repetition_penalty=2.0), seen)
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    out = process_logits(logits, SamplingConfig(temperature=2.0, top_k=2))
    assert torch.isinf(out).tolist() == [[False, True, False, True]]
    assert out[0, 0].item() == 1.0  # divided by the temperature
    probs = torch.tensor([[0.5, 0.3, 0.2]]).log()

    def keep(p):
        return (
            ~torch.isinf(process_logits(probs, SamplingConfig(temperature=1.0, top_p=p)))
        ).tolist()[0]

    assert keep(0.7) == [True, True, False]
    assert keep(0.5) == [True, False, False]
    assert keep(0.81) == [True, True, True]
    assert keep(1.0) == [True, True, True]
    g = torch.Generator().manual_seed(0)
    draws = sample_next(
        process_logits(probs.expand(2000, 3), SamplingConfig(temperature=1.0)),
        SamplingConfig(temperature=1.0),
        g,
    )
    freq = torch.bincount(draws, minlength=3).float() / 2000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.05)


P6 = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03], dtype=torch.float64)


def freqs(draws: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(draws, minlength=V).double() / draws.numel()


def test_sampling_draws_each_token_with_its_probability():
    """200,000 seeded draws from one distribution (one call, one row per draw): each token's frequency is within
    5 standard errors of its probability (SE = sqrt(p(1-p)/N) <= 0.0011: a correct sampler misses this with
    probability < 1e-5), and within 5 SE of a difference of torch.multinomial's frequencies. The check has the
    power to see a 5% temperature error: p^(1/1.05), renormalised, is 10 SE away for the top token."""
    n, cfg = 200_000, SamplingConfig(temperature=1.0)
    draws = sample_next(
        process_logits(P6.log().float().expand(n, 6), cfg), cfg, torch.Generator().manual_seed(0)
    )
    freq, se = freqs(draws, 6), (P6 * (1 - P6) / n).sqrt()
    assert ((freq - P6).abs() < 5 * se).all(), (freq, P6)
    multi = torch.multinomial(
        P6.float().expand(n, 6), 1, generator=torch.Generator().manual_seed(1)
    ).squeeze(-1)
    assert ((freq - freqs(multi, 6)).abs() < 5 * 2**0.5 * se).all()
    hotter = P6 ** (1 / 1.05) / (P6 ** (1 / 1.05)).sum()
    assert not (
        (freq - hotter).abs() < 5 * se
    ).all()  # negative control: the tolerance tells them apart


def test_top_k_top_p_and_the_penalty_shape_what_is_drawn():
    """Filtered tokens are never drawn and every kept token is (20,000 draws); the repetition penalty's
    distribution is the softmax of the penalised logits (5 SE, as above)."""
    n = 20_000
    # probabilities .46 .28 .17 .06 .02 .01
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.0, -1.0]]).expand(n, 6)
    g = torch.Generator().manual_seed(0)

    def draw(cfg, seen=None):
        return sample_next(process_logits(logits, cfg, seen), cfg, g)

    assert set(draw(SamplingConfig(temperature=1.0, top_k=2)).tolist()) == {0, 1}
    # .46 + .28 < .8 <= + .17
    assert set(draw(SamplingConfig(temperature=1.0, top_p=0.8)).tolist()) == {
        0,
        1,
        2,
    }
    # at T=.5: .66 .24 .09
    assert set(draw(SamplingConfig(temperature=0.5, top_k=3, top_p=0.6)).tolist()) == {0}
    seen = torch.zeros(n, 6, dtype=torch.bool)
    seen[:, 0] = seen[:, 5] = True  # 3.0 -> 1.5, -1.0 -> -2.0
    want = torch.softmax(torch.tensor([1.5, 2.5, 2.0, 1.0, 0.0, -2.0], dtype=torch.float64), -1)
    freq = freqs(draw(SamplingConfig(temperature=1.0, repetition_penalty=2.0), seen), 6)
    assert ((freq - want).abs() < 5 * (want * (1 - want) / n).sqrt()).all(), (freq, want)


def test_sampled_generation_never_waits_for_the_device(model):
    """Decoding at temperature > 0 with top-k, top-p and the penalty, past the window, with neither a stream nor
    stops: no op that makes the host wait for a GPU (tests/device_ops.py) runs before the result is read. A
    multinomial per token did (its kernel checks the probabilities with .item())."""
    eng = Engine(model)
    cfg = SamplingConfig(
        max_new_tokens=30, temperature=0.9, top_k=10, top_p=0.9, repetition_penalty=1.2, seed=1
    )
    with DeviceOps() as ops:
        out, _ = eng.generate_ids([[1, 2, 3], [4]], cfg)
    assert ops.syncs == []
    assert [len(o) for o in out] == [30, 30]
    assert out == eng.generate_ids([[1, 2, 3], [4]], cfg)[0]  # the seed still fixes the draws


def test_bad_settings_are_clear_errors(model):
    eng = Engine(model)
    for kw, name in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"stop": [""]}, "stop"),
    ]:
        with pytest.raises(GenerationError, match=name):
            eng.generate_ids([[1]], SamplingConfig(**kw))
    with pytest.raises(GenerationError, match="prompt 1 is empty"):
        eng.generate_ids([[1], []], SamplingConfig())
    with pytest.raises(GenerationError, match="no tokenizer"):
        eng.generate("hi")


def test_stop_token_ends_a_row(model):
    eng = Engine(model)
    greedy = SamplingConfig(max_new_tokens=20, temperature=0)
    full = eng.generate_ids([[2, 3]], greedy)[0][0]
    stop_tok = full[6]
    first = full.index(stop_tok)
    out, reasons = eng.generate_ids([[2, 3], [2, 3]], greedy, stop_ids=[stop_tok])
    assert out[0] == full[: first + 1] and reasons[0] == "eot"


def test_greedy_ids_are_the_reference_and_a_seed_repeats_a_sample(model):
    """What training's samples use (Engine.generate_ids on one prompt; the module-level generate_ids beside it
    was merged into it): greedy = the reference (past the context, the shifted one), and the same seed gives the
    same sample."""
    eng = Engine(model)
    greedy = SamplingConfig(max_new_tokens=20, temperature=0, stop_at_eot=False)
    assert eng.generate_ids([[5, 6]], greedy)[0][0] == shifted_greedy(model, [5, 6], 20)
    seeded = SamplingConfig(max_new_tokens=12, temperature=0.8, top_k=10, stop_at_eot=False)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert (
        eng.generate_ids([[5, 6]], seeded, generator=g1)[0]
        == eng.generate_ids([[5, 6]], seeded, generator=g2)[0]
    )


# --- text level: stop strings and streaming, on a trained char model ---------------------------


def test_stop_strings_and_streaming(run_dir):
    eng = Engine.from_run(run_dir)
    greedy = SamplingConfig(max_new_tokens=60, temperature=0)
    full = eng.generate("ROMEO:", greedy)[0].text
    assert len(full) == 60
    stop = full[20:22]
    cut = full.index(stop)
    pieces = []
    res = eng.generate(
        "ROMEO:",
        SamplingConfig(max_new_tokens=60, temperature=0, stop=[stop, "\x00never"]),
        stream=lambda i, p: pieces.append((i, p)),
    )[0]
    assert res.text == full[:cut]
    assert res.finish_reason == "stop"
    assert "".join(p for _, p in pieces) == res.text  # the stop string never reaches the stream
    assert len(res.token_ids) == cut + len(stop)  # the char model: one token per character

    # A batch streams each row separately, and the streamed text equals the returned text.
    streamed = {0: [], 1: []}
    cfg = SamplingConfig(max_new_tokens=25, temperature=0.9, top_p=0.9, seed=7)
    outs = eng.generate(["ROMEO:", "KING"], cfg, stream=lambda i, p: streamed[i].append(p))
    for i, c in enumerate(outs):
        assert "".join(streamed[i]) == c.text and len(c.text) == 25 and c.finish_reason == "length"
    assert [c.text for c in eng.generate(["ROMEO:", "KING"], cfg)] == [c.text for c in outs]


def test_an_engine_loads_the_gpus_half_type_and_fp32_on_the_cpu(run_dir, monkeypatch):
    """Engine.from_run loads the weights in resolve_dtype("auto", device)'s type (bf16 on an A100 or L4, fp16 on a
    T4, fp32 on a CPU: tests/test_runtime.py): each decoded token reads every weight, so half the bytes on a GPU.
    On the CPU it is the fp32 engine, token for token; with a GPU's choice faked, the same path loads the
    weights and the KV cache in bf16 and decodes (the CPU runs bf16). load_run alone keeps the saved fp32."""
    import gptlib.inference.loading as loading

    cfg = SamplingConfig(max_new_tokens=30, temperature=0.9, top_k=20, seed=3)
    ld = load_run(run_dir)
    eng, fp32 = Engine.from_run(run_dir), Engine(ld.model, ld.tokenizer)
    assert {p.dtype for p in eng.model.parameters()} == {torch.float32}
    assert eng.generate("ROMEO:", cfg)[0].token_ids == fp32.generate("ROMEO:", cfg)[0].token_ids
    asked = []
    monkeypatch.setattr(
        loading,
        "resolve_dtype",
        lambda name, device: asked.append((name, device)) or torch.bfloat16,
    )
    half = Engine.from_run(run_dir)
    assert asked == [("auto", torch.device("cpu"))]
    assert {p.dtype for p in half.model.parameters()} == {
        torch.bfloat16
    } and half.dtype == torch.bfloat16
    assert len(half.generate("ROMEO:", cfg)[0].token_ids) == 30
    assert {p.dtype for p in load_run(run_dir).model.parameters()} == {torch.float32} and len(
        asked
    ) == 1


def test_unknown_character_in_prompt_is_a_clear_error(run_dir):
    eng = Engine.from_run(run_dir)
    with pytest.raises(GenerationError, match="prompt 0 .*not in the char vocabulary"):
        eng.generate("\u2603 snowman")


# --- loading -----------------------------------------------------------------------------------


def test_load_latest_best_and_step(run_dir):
    table = checkpoint_table(run_dir)
    assert [r["step"] for r in table] == [10, 5]
    assert resolve_checkpoint(run_dir, "latest").step == 10
    best = table[0]["best_step"]
    assert resolve_checkpoint(run_dir, "best").step == best
    assert resolve_checkpoint(run_dir, 5).step == 5
    assert resolve_checkpoint(run_dir, "step_0000005").step == 5
    ld = load_run(run_dir, "5")
    assert ld.step == 5 and not ld.model.training and ld.tokenizer.kind == "char"
    with pytest.raises(
        CheckpointError, match=r"no complete checkpoint for step 7; available steps: \[10, 5\]"
    ):
        resolve_checkpoint(run_dir, 7)
    with pytest.raises(CheckpointError, match="use 'latest', 'best' or a step"):
        resolve_checkpoint(run_dir, "newest")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(run_dir / "nope")


def test_missing_or_mismatched_tokenizer(run_dir, tmp_path):
    rd = tmp_path / "run"
    shutil.copytree(run_dir, rd)
    state = json.loads((rd / "checkpoints" / "step_0000010" / "state.json").read_text())
    # Missing: neither the run's copy nor the recorded data directory's.
    (rd / "tokenizer.json").unlink()
    state_file = rd / "checkpoints" / "step_0000010" / "state.json"
    saved = state_file.read_text()
    state_file.write_text(json.dumps({**state, "data_dir": str(tmp_path / "gone")}))
    with pytest.raises(TokenizerError, match="no tokenizer for .*tokenizer.json"):
        read_state_and_tokenizer(rd, state_file.parent)
    state_file.write_text(saved)
    # Falls back to the data directory recorded in the checkpoint (it still exists here).
    assert load_run(rd).tokenizer.identity()["hash"] == state["tokenizer"]["hash"]
    # Mismatched: a different vocabulary in the run's tokenizer.json.
    CharTokenizer.from_text("abc\n ").save(rd)
    with pytest.raises(TokenizerError, match="tokenizer mismatch"):
        load_run(rd)


def test_corrupt_weights_are_refused(run_dir, tmp_path):
    rd = tmp_path / "run"
    shutil.copytree(run_dir, rd)
    f = rd / "checkpoints" / "step_0000010" / "model.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        load_run(rd, "latest")
    assert load_run(rd, 5).step == 5  # the other checkpoint is untouched


# --- CLI ---------------------------------------------------------------------------------------


def test_milestones_let_notebook_04_compare_early_and_late_checkpoints(char_data, tmp_path):
    """keep_every: checkpoints at its multiples are saved and survive rotation (keep_last=2)."""
    from gptlib.training.loop import train

    rd = tmp_path / "run"
    r = train(
        char_data,
        rd,
        overrides=TINY + ["keep_last=2", "keep_every=6", "eval_interval=10"],
        max_steps=20,
        progress=False,
        log=lambda s: None,
    )
    vals = {row["step"]: row["val_loss"] for row in r.history if "val_loss" in row}
    best = min(vals, key=vals.get)
    steps = sorted(row["step"] for row in checkpoint_table(rd))
    # saves at 6, 10 (validation), 12, 18, 20; kept: milestones 6, 12, 18, the newest two, the best
    assert set(steps) == {6, 12, 18, 20, best}, (steps, vals)
    texts = [
        Engine.from_run(rd, s).generate("ROMEO:", SamplingConfig(max_new_tokens=10, seed=3))[0].text
        for s in (6, 12, 20)
    ]
    assert len(set(texts)) > 1  # same seed and settings, different weights


def test_cli_sample(run_dir, capsys):
    from gptlib.__main__ import main

    rc = main(
        [
            "sample",
            "--run-dir",
            str(run_dir),
            "--checkpoint",
            "best",
            "--prompt",
            "ROMEO:",
            "--prompt",
            "KING",
            "--num-samples",
            "2",
            "--max-new-tokens",
            "12",
            "--top-p",
            "0.9",
            "--top-k",
            "20",
            "--repetition-penalty",
            "1.2",
            "--seed",
            "3",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and out.count("--- sample") == 4 and out.count("ROMEO:") == 2
    rc = main(
        [
            "sample",
            "--run-dir",
            str(run_dir),
            "--prompt",
            "ROMEO:",
            "--temperature",
            "0",
            "--stream",
            "--max-new-tokens",
            "15",
        ]
    )
    streamed = capsys.readouterr().out
    eng = Engine.from_run(run_dir)
    assert streamed.strip("\n") == (
        "ROMEO:" + eng.generate("ROMEO:", SamplingConfig(15, temperature=0))[0].text
    ).strip("\n")
    rc = main(["sample", "--run-dir", str(run_dir), "--top-p", "1.5"])
    assert rc == 2 and "top_p=1.5" in capsys.readouterr().err
    rc = main(["sample", "--run-dir", str(run_dir), "--checkpoint", "999"])
    assert rc == 2 and "available steps" in capsys.readouterr().err


def test_a_seed_out_of_range_is_one_line(run_dir, capsys):
    """sample --seed 2**64 was torch's 'Overflow when unpacking long long' traceback from manual_seed; now one line
    naming the seed and the range train's seed takes."""
    from gptlib.__main__ import main

    rc = main(["sample", "--run-dir", str(run_dir), "--seed", str(2**64), "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "Traceback" not in "\n".join(err), err
    assert err[-1] == f"error: seed={2**64} must be in [0, 2**63) (or None for random)", err


def test_more_new_tokens_than_memory_holds_is_one_line(run_dir, capsys):
    """sample --max-new-tokens 10**10 was the allocator's RuntimeError traceback for the token buffer; now one line
    naming max_new_tokens (10**15: more than any machine's address space, so it fails everywhere)."""
    from gptlib.__main__ import main

    rc = main(["sample", "--run-dir", str(run_dir), "--max-new-tokens", str(10**15)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "Traceback" not in "\n".join(err), err
    assert err[-1].startswith(f"error: max_new_tokens={10**15}: ") and "fewer" in err[-1], err


def test_text_stream_waits_for_whole_utf8_characters():
    """Byte-level tokens can split a character: the stream holds bytes until they decode cleanly."""
    from gptlib.inference.engine import _TextStream

    class ByteTok:  # one token per byte, like the 256 base symbols of byte-level BPE
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    text = "héllo ☃ wörld\n\nnext"
    st = _TextStream(ByteTok(), stop=["\n\n"])
    pieces = [st.push(b) for b in text.encode()]
    pieces.append(st.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == st.text == "héllo ☃ wörld" and st.stopped


def test_text_stream_finds_a_stop_string_in_the_tokens_held_at_the_end():
    """Generation ending while a token with a split character is held back: the stop string that token completes
    still ends the text (the end used to be appended unsearched)."""
    from gptlib.inference.engine import _TextStream

    class ChunkTok:
        chunks = {0: b"ab\n", 1: b"\n\xe2", 2: b"cd"}

        def decode(self, ids):
            return b"".join(self.chunks[i] for i in ids).decode("utf-8", errors="replace")

    st = _TextStream(ChunkTok(), stop=["\n\n"])
    shown = [st.push(0), st.push(1), st.flush()]
    assert "".join(shown) == st.text == "ab" and st.stopped, shown
    # without a stop string in it, the end is shown as it decodes
    st = _TextStream(ChunkTok(), stop=["\n\n"])
    shown = [st.push(2), st.push(1), st.flush()]
    assert "".join(shown) == st.text == "cd\n\ufffd" and not st.stopped, shown


def test_bpe_text_generation_with_end_of_text(small_text):
    from gptlib.data.tokenizer import BPETokenizer

    tok = BPETokenizer.train([small_text.read_text()], vocab_size=300)
    torch.manual_seed(0)
    m = GPT(
        ModelConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=32)
    ).eval()
    eng = Engine(m, tok)
    greedy = SamplingConfig(max_new_tokens=20, temperature=0)
    pieces = []
    # empty prompt: starts at <|endoftext|>
    res = eng.generate("", greedy, stream=lambda i, p: pieces.append(p))[0]
    assert "".join(pieces) == res.text and len(res.token_ids) == 20
    # The end-of-text token ends a sequence and is not part of the text.
    full = eng.generate("First", greedy)[0]
    tok.eot_id = full.token_ids[5]
    cut = full.token_ids.index(tok.eot_id)
    res = eng.generate("First", greedy)[0]
    assert res.finish_reason == "eot" and res.token_ids == full.token_ids[: cut + 1]
    assert res.text == tok.decode(full.token_ids[:cut])


def test_unknown_character_advice_names_what_the_user_can_do(run_dir):
    """The advice once named unknown='map', which neither `gptlib sample` nor the Playground offers (and a model
    trained without an <unk> row could not use): it names what works wherever the prompt came from."""
    eng = Engine.from_run(run_dir)
    with pytest.raises(GenerationError) as e:
        eng.generate("KING \u2603")
    msg = str(e.value)
    assert (
        "'\u2603' (U+2603) at position 5" in msg
        and "remove or replace it" in msg
        and "unknown=" not in msg
    )


def test_a_checkpoint_label_gives_the_step_as_checkpoints_takes_it():
    """Notebook 04 lists checkpoints with checkpoint_label; a step copied from there into CHECKPOINTS (comma-separated)
    read "12,000" as steps 12 and 0."""
    from gptlib.inference.loading import checkpoint_label

    label = checkpoint_label(
        {"step": 12000, "val_loss": 1.5, "val_sequences": 1000, "is_best": True}
    )
    assert label == "step 12000 · val 1.500 (training's validation: 1,000 sequences) · best", label


def test_a_checkpoint_label_counts_the_validation_in_sequences(run_dir):
    """Notebook 04 labelled a checkpoint 'training's validation: 20 batches', the config's eval_batches; auto_batch
    changes the micro-batch and eval_batches with it (same sequences), so the same validation read as another number
    of batches from one session to the next. It counts sequences: batch_size x eval_batches of the checkpoint."""
    from gptlib.inference.loading import checkpoint_label, checkpoint_table

    train = json.loads((run_dir / "config.json").read_text())["train"]
    n = train["batch_size"] * train["eval_batches"]
    assert train["batch_size"] > 1 and train["eval_batches"] > 1
    labels = [checkpoint_label(r) for r in checkpoint_table(run_dir)]
    assert [re.sub(r"val \d\.\d{3}", "val X", x) for x in labels] == [
        f"step 10 · val X (training's validation: {n} sequences) · best",
        f"step 5 · val X (training's validation: {n} sequences)",
    ], labels


def test_a_checkpoint_folder_given_as_the_run_dir_names_the_run_to_give(run_dir, capsys):
    """A checkpoint's folder (or the checkpoints folder) given as the run, as a file browser shows it (notebook 04's
    RUN_DIR, --run-dir, --init-from) said 'no valid checkpoint in RUN/checkpoints/step_0000010/checkpoints (has
    training saved one yet?)', and notebook 04 'no complete checkpoint in ...; train first': it names the run."""
    from gptlib.__main__ import main
    from gptlib.inference.loading import find_run

    for inside in (run_dir / "checkpoints" / "step_0000010", run_dir / "checkpoints"):
        said = f"no valid checkpoint in {inside}: it is inside the run directory {run_dir}; give that instead"
        with pytest.raises(CheckpointError) as e:
            find_run(run_dir=str(inside))
        assert str(e.value) == said
        assert main(["sample", "--run-dir", str(inside)]) == 2
        assert capsys.readouterr().err == f"error: {said}\n"
