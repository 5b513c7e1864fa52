"""Chat with a chat-tuned run (gptlib/inference/chat.py): history kept within the context (oldest pairs first, the
newest message cut to its tail), the prompt is the template's rendering of what is kept, replies end at <|end|>,
`chat --message` prints only the reply, the interactive loop (/reset, EOF), the refusal of runs without chat
tokens, and the notebook ChatBox driven headless."""

from __future__ import annotations

import html
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gptlib.inference.engine as generate_mod
from gptlib.checkpoint.format import TrainState, save_checkpoint
from gptlib.config import ModelConfig, RunConfig
from gptlib.data.conversations import CHAT_TOKENS, END, ChatTemplate
from gptlib.data.tokenizer import BPETokenizer, load_tokenizer
from gptlib.errors import ChatError
from gptlib.fsutil import atomic_write_bytes, atomic_write_json
from gptlib.inference.chat import ChatSession
from gptlib.inference.engine import SamplingConfig
from gptlib.layout import CONFIG_FILE, TOKENIZER_FILE, checkpoints_dir
from gptlib.model import GPT
from tests.conftest import REPO

BLOCK = 64
SYSTEM = "Be brief."
# what the CLI tests pass on the command line
GREEDY = SamplingConfig(max_new_tokens=12, temperature=0, seed=1337)


def write_run(out: Path, tok, block_size: int = BLOCK, bias: bool = False, edit=None) -> Path:
    """A run directory with a random-weight model, written as import-hf writes one: a step-0 checkpoint
    (save_checkpoint), config.json and the tokenizer. edit(model) may set weights first."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=32, bias=bias
    )
    model = GPT(cfg)
    if edit is not None:
        edit(model)
    run_cfg = RunConfig(model=cfg)
    state = TrainState(
        config=run_cfg.to_dict(), tokenizer=dict(tok.identity(), file=TOKENIZER_FILE)
    )
    save_checkpoint(
        checkpoints_dir(out), {"model": model.state_dict(), "progress": state.state_dict()}
    )
    atomic_write_json(out / CONFIG_FILE, run_cfg.to_dict())
    atomic_write_bytes(out / TOKENIZER_FILE, tok.to_json_bytes())
    return out


@pytest.fixture(scope="module")
def chat_tok(small_text) -> BPETokenizer:
    """A BPE trained for chat data: the chat tokens are special tokens (as tokenize --format chat makes it)."""
    text = small_text.read_text()
    return BPETokenizer.train(
        [text[i : i + 2000] for i in range(0, len(text), 2000)],
        vocab_size=300,
        extra_special=CHAT_TOKENS,
    )


def louder(model) -> None:
    """Weights 10x their initial size: at init (std 0.02, tied embeddings) greedy decoding only repeats the last
    prompt token (here <|assistant|>, which ends the reply at once); louder weights say something that depends
    on the whole prompt."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(10)


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, chat_tok) -> Path:
    return write_run(tmp_path_factory.mktemp("chat") / "run", chat_tok, edit=louder)


@pytest.fixture(scope="module")
def expected_reply(chat_run) -> str:
    """What a fresh session answers to "Hi there" with SYSTEM, greedy, 12 tokens: the CLI and ChatBox must agree."""
    reply = ChatSession.from_run(chat_run, system=SYSTEM, log=lambda _: None).reply(
        "Hi there", GREEDY
    )
    assert reply.strip(), (
        "the random model should say something (else the comparisons below prove little)"
    )
    return reply


def rendered(tok, system: str | None, turns) -> list[int]:
    """The template's own rendering of a system prompt and turns, as a generation prompt."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": r, "content": c} for r, c in turns
    ]
    return (
        ChatTemplate(tok).render(msgs, require_assistant=False, generation_prompt=True)[0].tolist()
    )


def gptlib_cli(*args, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """The CLI in a subprocess; bytes out, so a "\\r" in a random reply is not turned into "\\n"."""
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run(
        [sys.executable, "-m", "gptlib", *map(str, args)],
        input=stdin,
        capture_output=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )


# --------------------------------------------------------------------------------------- the context


def test_the_oldest_pairs_are_dropped_first_and_the_prompt_is_the_template_rendering(
    chat_run, chat_tok
):
    notes = []
    s = ChatSession.from_run(chat_run, system=SYSTEM, log=notes.append)
    full = []
    for i in range(12):
        full += [("user", f"Q{i}?"), ("assistant", f"A{i}.")]
    full.append(("user", "And?"))
    s.history = list(full)
    max_new = 16
    ids = s.prompt_ids(max_new)
    kept = s.history
    dropped = len(full) - len(kept)
    assert len(ids) + max_new <= BLOCK
    assert ids == rendered(chat_tok, SYSTEM, kept)  # the system prompt is kept
    # whole pairs, from the front
    assert kept == full[dropped:] and dropped % 2 == 0 and kept[0][0] == "user"
    assert 0 < dropped < len(full) - 1
    assert notes == [f"the {dropped} oldest turns were dropped to fit the {BLOCK}-token context"]
    # no more was dropped than needed
    assert len(rendered(chat_tok, SYSTEM, full[dropped - 2 :])) + max_new > BLOCK


def test_a_conversation_never_outgrows_the_context(chat_run, chat_tok, monkeypatch):
    notes = []
    s = ChatSession.from_run(chat_run, system=SYSTEM, log=notes.append)
    prompts = []
    real = s.engine.generate_ids

    def recording(ids, cfg, **kw):
        # the history as it stands when generating
        assert ids[0] == rendered(chat_tok, SYSTEM, s.history)
        prompts.append((list(ids[0]), cfg.max_new_tokens))
        return real(ids, cfg, **kw)

    monkeypatch.setattr(s.engine, "generate_ids", recording)
    for i in range(8):
        s.reply(f"Tell me more, part {i}.", SamplingConfig(max_new_tokens=12, temperature=0))
        assert [r for r, _ in s.history] == ["user", "assistant"] * (len(s.history) // 2)
    assert all(len(p) + n <= BLOCK for p, n in prompts), [len(p) for p, _ in prompts]
    assert any("oldest turns were dropped" in n for n in notes) and len(prompts) == 8


def test_a_message_too_long_for_the_context_keeps_its_tail_and_says_so(
    chat_run, chat_tok, small_text
):
    notes = []
    s = ChatSession.from_run(chat_run, system=SYSTEM, log=notes.append)
    msg = small_text.read_text()[:3000]
    s.history = [("user", "Hi"), ("assistant", "Hello"), ("user", msg)]
    ids = s.prompt_ids(16)
    assert len(ids) + 16 <= BLOCK and s.history == [("user", msg)]  # the older pair went first
    assert (
        len(notes) == 2
        and "2 oldest turns were dropped" in notes[0]
        and "only its last" in notes[1]
    )
    n = int(notes[1].split("only its last ")[1].split(" of")[0].replace(",", ""))
    assert 0 < n < len(msg)
    assert ids == rendered(chat_tok, SYSTEM, [("user", msg[-n:])])
    # the longest tail that fits
    assert len(rendered(chat_tok, SYSTEM, [("user", msg[-n - 1 :])])) + 16 > BLOCK
    s.system = "Be very brief. " * 40
    with pytest.raises(ChatError, match="the system prompt leaves no room"):
        s.prompt_ids(16)
    s.system = SYSTEM
    s.reset()
    # 100 + the prompt would not fit
    s.reply("Hi", SamplingConfig(max_new_tokens=100, temperature=0))
    assert s.reply_tokens <= BLOCK // 2 and "replies are cut at 32 tokens" in notes[-1]


# --------------------------------------------------------------------------------------- replies


def test_a_reply_ends_at_the_end_token(chat_run, chat_tok, monkeypatch):
    s = ChatSession.from_run(chat_run, log=lambda _: None)
    end = chat_tok.token_id(END)
    said = chat_tok.encode("\nHello there")
    script = said + [end] + chat_tok.encode(" and GARBAGE after the end")
    calls = []

    def scripted(logits, cfg, generator):  # the model "writes" the script, one token per step
        calls.append(1)
        return torch.full(
            (logits.size(0),),
            script[min(len(calls) - 1, len(script) - 1)],
            dtype=torch.long,
            device=logits.device,
        )

    monkeypatch.setattr(generate_mod, "sample_next", scripted)
    pieces = []
    reply = s.reply("Hi", SamplingConfig(max_new_tokens=30, temperature=0), stream=pieces.append)
    # the template's "\n" is not part of it
    assert reply == "Hello there" and "".join(pieces) == reply
    assert s.history == [("user", "Hi"), ("assistant", "Hello there")]
    # sampling stopped there
    assert s.finish_reason == "eot" and s.reply_tokens == len(said) + 1 == len(calls)


def test_a_failed_reply_leaves_the_conversation_as_it_was(chat_run):
    s = ChatSession.from_run(chat_run, log=lambda _: None)
    s.history = [
        ("user", f"Q{i}?") if j == 0 else ("assistant", f"A{i}.") for i in range(20) for j in (0, 1)
    ]
    before = list(s.history)

    def broken(piece):
        raise RuntimeError("the stream broke")

    with pytest.raises(RuntimeError, match="the stream broke"):
        s.reply("Hi", SamplingConfig(max_new_tokens=12, temperature=0), stream=broken)
    assert s.history == before  # not even the pairs dropped to fit are lost


def test_a_model_that_always_writes_end_gives_an_empty_reply_at_once(tmp_path, chat_tok):
    end = chat_tok.token_id(END)

    # logits = wte @ ln_f.bias whatever the input: <|end|>'s row points along it
    def always_end(
        model,
    ):
        with torch.no_grad():
            model.transformer.ln_f.weight.zero_()
            model.transformer.ln_f.bias.zero_()
            model.transformer.ln_f.bias[0] = 1.0
            model.transformer.wte.weight[end, 0] = 10.0

    run = write_run(tmp_path / "run", chat_tok, bias=True, edit=always_end)
    s = ChatSession.from_run(run, log=lambda _: None)
    assert s.reply("Hi", SamplingConfig(max_new_tokens=20, temperature=0)) == ""
    assert s.reply_tokens == 1 and s.finish_reason == "eot"


# --------------------------------------------------------------------------------------- the command line


def test_chat_message_prints_only_the_reply(chat_run, expected_reply):
    r = gptlib_cli(
        "chat",
        "--run-dir",
        chat_run,
        "--message",
        "Hi there",
        "--system",
        SYSTEM,
        "--temperature",
        0,
        "--max-new-tokens",
        12,
    )
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode() == expected_reply + "\n"


def test_the_interactive_chat_reads_stdin_resets_and_ends_at_eof(chat_run):
    def fresh():
        return ChatSession.from_run(chat_run, log=lambda _: None)

    cfg = SamplingConfig(max_new_tokens=12, temperature=0, seed=1337)
    s = fresh()
    r1 = s.reply("hi", cfg)
    without_reset = s.reply("hello", cfg)
    r2 = fresh().reply("hello", cfg)
    assert r2 != without_reset  # so the output below shows whether /reset cleared the history
    r = gptlib_cli(
        "chat",
        "--run-dir",
        chat_run,
        "--temperature",
        0,
        "--max-new-tokens",
        12,
        stdin=b"hi\n/reset\nhello\n",
    )
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode() == f"you> assistant> {r1}\nyou> you> assistant> {r2}\nyou> \n"
    assert "history cleared" in r.stderr.decode()


@pytest.mark.parametrize("command", ["sample --prompt", "chat --message", "chat (stdin)"])
def test_text_that_is_not_utf8_is_one_line(chat_run, command):
    """A prompt or message with bytes that are not UTF-8 (a Latin-1 terminal's é) was a tokenizers TypeError
    traceback on a BPE run (a UnicodeDecodeError at the chat's prompt); now one line, and the chat asks again."""
    latin1 = "caf\udce9"  # how Python holds argv's byte 0xe9; the subprocess gets the byte back
    if command == "chat (stdin)":
        r = gptlib_cli("chat", "--run-dir", chat_run, "--max-new-tokens", 2, stdin=b"caf\xe9\nhi\n")
    else:
        name, flag = command.split()
        r = gptlib_cli(name, "--run-dir", chat_run, flag, latin1, "--max-new-tokens", 2)
    err = r.stderr.decode()
    assert "Traceback" not in err and "(U+DCE9) at position 3 is not valid Unicode" in err, err
    if command == "chat (stdin)":  # the error, then the next message is answered
        assert r.returncode == 0 and r.stdout.decode().count("you> assistant> ") == 2, r.stdout
    else:
        assert r.returncode == 2 and err.strip().splitlines()[-1].startswith("error: "), err


@pytest.mark.parametrize("kind", ["char", "bpe without chat tokens"])
def test_a_run_without_chat_tokens_is_one_clear_line(tmp_path, char_data, kind, small_text):
    if kind == "char":
        tok = load_tokenizer(char_data)
    else:  # a pretrained base (or an imported GPT-2) never fine-tuned on conversations
        tok = BPETokenizer.train([small_text.read_text()[:20000]], vocab_size=280)
    run = write_run(tmp_path / "run", tok)
    r = gptlib_cli("chat", "--run-dir", run, "--message", "hi")
    err = r.stderr.decode()
    assert r.returncode == 2 and r.stdout == b"" and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("error: ") and "has no chat tokens" in err
    if (
        kind == "char"
    ):  # the advice for a BPE run cannot work (tokenize --format chat refuses a char tokenizer)
        assert "a char-level model cannot learn to chat" in err and "--format chat" not in err
    else:
        assert "--format chat" in err and "--init-from" in err


# --------------------------------------------------------------------------------------- the notebook widget


def test_chatbox_sends_streams_and_resets_headless(chat_run, char_data, tmp_path, expected_reply):
    pytest.importorskip("ipywidgets")
    from gptlib.widgets import ChatBox

    box = ChatBox(chat_run, system=SYSTEM)
    box.temperature.value, box.max_tokens.value = 0.0, 12
    drawn = []
    box.transcript.observe(lambda ch: drawn.append(ch["new"]), names="value")
    assert box.send("Hi there") == expected_reply  # the same reply as the command line's
    assert (
        html.escape(expected_reply) in box.transcript.value and "Hi there" in box.transcript.value
    )
    # redrawn while streaming
    assert any("▌" in d for d in drawn) and "tokens in" in box.status.value
    box.send("And then?")
    s = box.session()
    # the transcript keeps all
    assert len(box.turns) == 4 and s.history == box.turns[len(box.turns) - len(s.history) :]
    assert "2 oldest turns were dropped" in box.status.value  # the random reply is long
    box.reset_button.click()  # the real button runs the same path
    assert box.session().history == [] and box.turns == [] and box.transcript.value == ""

    bad = ChatBox(write_run(tmp_path / "char", load_tokenizer(char_data)))
    assert bad.send("hi") is None  # shown in the widget, not raised
    assert "ChatError" in bad.status.value and "no chat tokens" in bad.status.value
    assert bad.turns == []


@pytest.mark.parametrize("version, enabled", [("7.7.1", False), ("8.1.9", True)])
def test_colabs_custom_widget_manager_only_for_ipywidgets_8(monkeypatch, version, enabled):
    """Colab draws ipywidgets 7 itself; its custom manager is for 8 only (it broke tqdm bars under 7)."""
    import types

    import ipywidgets

    from gptlib.widgets import enable_colab_widgets

    calls = []
    colab = types.ModuleType("google.colab")
    colab.output = types.SimpleNamespace(enable_custom_widget_manager=lambda: calls.append(1))
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setattr(ipywidgets, "__version__", version)
    assert enable_colab_widgets() is enabled and len(calls) == int(enabled)


def test_a_notebook_bar_is_recognised_so_no_plain_lines_replace_it(monkeypatch):
    import io

    import tqdm.auto
    from tqdm.notebook import tqdm as notebook_tqdm

    from gptlib.training.throughput import plain_progress

    # what tqdm.auto gives in a notebook: a subclass in module tqdm.auto
    class AutoBar(notebook_tqdm):
        pass

    AutoBar.__module__ = "tqdm.auto"
    assert plain_progress(io.StringIO())  # a file, no notebook: plain lines
    monkeypatch.setattr(tqdm.auto, "tqdm", AutoBar)
    # stderr is not a terminal in a notebook either: the widget bar
    assert not plain_progress(io.StringIO())
