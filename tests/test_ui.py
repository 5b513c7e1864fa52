"""What a user sees in the browser (issue 18): the Playground's Stop button and a kernel interrupt, the ChatBox
(Enter sends, each message shown once, Reset clears it all, the max-tokens cap shown), driven headless."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from gptlib.widgets import status_html
from tests.conftest import REPO
from tests.test_dialogue import SYSTEM, chat_run, chat_tok, louder, write_run  # noqa: F401 - fixtures

pytest.importorskip("ipywidgets")


@pytest.fixture(scope="module")
def char_run(tmp_path_factory, char_data) -> Path:
    """A random-weight char model (step 0): fast to generate 2,000 tokens from on a CPU."""
    from gptlib.data.tokenizer import load_tokenizer

    return write_run(tmp_path_factory.mktemp("pg") / "run", load_tokenizer(char_data))


def playground(run):
    from gptlib.widgets import Playground

    pg = Playground(run, prompt="KING")
    pg.max_tokens.value, pg.temperature.value = 500, 0.0
    return pg


def once(action):
    """A traitlets observer that runs `action` at the first change only."""
    done = []

    def observer(_change):
        if not done:
            done.append(1)
            action()

    return observer


# --------------------------------------------------------------------------------------------- the Playground


def test_stop_ends_generation_at_the_next_token_and_keeps_the_text(char_run):
    """Generate pressed (outside a kernel the button's callback runs right here), then Stop while it streams."""
    pg = playground(char_run)
    assert pg.stop_button.disabled  # nothing to stop yet
    seen = []

    def stop_click():  # a click arriving mid-generation: at the first redraw of the streamed text
        seen.append((pg.stop_button.disabled, pg.status.value))
        pg.stop_button.click()

    pg.output.observe(once(stop_click), names="value")
    pg.button.click()
    assert seen == [(False, status_html("generating… (Stop ends it)"))]  # offered while it runs
    stopped = re.search(r"stopped after (\d+) tokens? in .*: Stop pressed", pg.status.value)
    assert stopped and 0 < int(stopped.group(1)) < 5, pg.status.value  # not the 500 asked for
    # the text so far stays
    assert "<b>KING</b>" in pg.output.value and "<b>KING</b></pre>" not in pg.output.value
    assert not pg.button.disabled and pg.stop_button.disabled
    res = pg.generate()  # the next Generate starts afresh: the old click does not stop it
    assert len(res.token_ids) == 500 and "stopped by length" in pg.status.value


def test_a_re_run_cell_frees_the_earlier_playgrounds_and_chat_boxes_model(char_run, chat_run):  # noqa: F811
    """ipywidgets keeps every widget (and through its callbacks the object) until the kernel ends: each re-run of
    notebook 04's Playground cell or 05's chat cell kept one more model, on the GPU in Colab."""
    import gc
    import weakref

    first = playground(char_run)
    first.generate()
    model = weakref.ref(first._engine.model)
    second = playground(char_run)
    gc.collect()
    assert model() is None and first._engine is None
    # used again all the same, it loads its model again
    assert first.generate().text and second.generate().text
    box = chatbox(chat_run)
    box.max_tokens.value = 4
    box.send("Hi")
    model = weakref.ref(box._session.engine.model)
    chatbox(chat_run)
    gc.collect()
    assert model() is None
    # used again, it loads its model again, and the model sees the conversation the box shows (it saw none)
    box.send("And then?")
    assert box._session.history[:2] == box.turns[:2] and len(box.turns) == 4


def test_generate_from_a_cell_does_not_offer_stop(char_run):
    """A cell that calls generate() holds the kernel: a Stop click could not arrive before it ends, so Stop is not
    offered, and the status says what ends it."""
    pg = playground(char_run)
    seen = []
    pg.output.observe(
        once(lambda: seen.append((pg.stop_button.disabled, pg.status.value))), names="value"
    )
    res = pg.generate()
    assert res is not None and len(res.token_ids) == 500
    assert seen == [(True, status_html("generating… (from code: interrupt the cell to end it)"))]
    assert not pg.button.disabled and pg.stop_button.disabled


def test_a_kernel_interrupt_keeps_the_text_and_says_interrupted(char_run):
    pg = playground(char_run)

    def interrupt():
        raise KeyboardInterrupt

    pg.output.observe(once(interrupt), names="value")
    with pytest.raises(KeyboardInterrupt):  # still ends the cell or script that called generate()
        pg.generate()
    assert "interrupted" in pg.status.value and "generating" not in pg.status.value
    # the text so far stays
    assert "<b>KING</b>" in pg.output.value and "<b>KING</b></pre>" not in pg.output.value
    assert not pg.button.disabled and pg.stop_button.disabled


def test_an_interrupt_from_a_cell_ends_in_one_line_that_counts_tokens(chat_run, capsys):  # noqa: F811
    """Notebook 04's cell `pg.generate()`, interrupted as its comment advises: IPython shows one line, not a traceback
    through the model, and the status counts tokens as everything else does (a BPE run: tokens are not characters)."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    pg = playground(chat_run)
    redraws = []

    def interrupt_at_the_third_redraw(_change):
        redraws.append(1)
        if len(redraws) == 3:
            raise KeyboardInterrupt

    pg.output.observe(interrupt_at_the_third_redraw, names="value")
    config = Config()
    config.HistoryManager.enabled = False
    shell = InteractiveShell.instance(config=config)
    try:
        shell.user_ns["pg"] = pg
        result = shell.run_cell("res = pg.generate()")
    finally:
        InteractiveShell.clear_instance()
    # the cell (and a run of all cells) still stops
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    shown = html.unescape(re.sub(r"<[^>]+>", "", pg.output.value)).removeprefix("KING")
    n = len(pg._engine.tokenizer.encode(shown))
    # so what follows proves a count of tokens (counted as Stop counts), not characters
    assert 0 < n != len(shown)
    assert pg.status.value == status_html(f"interrupted after {n} tokens")
    assert [line for line in capsys.readouterr().out.splitlines() if line.strip()] == [
        f"GenerationInterrupted: after {n} tokens; the text so far stays in the playground above"
    ]


def test_in_a_kernel_generate_runs_off_the_main_thread_so_a_stop_click_can_arrive(
    char_run, monkeypatch
):
    """A widget callback on the kernel's main thread blocks every other message (the Stop click too) until it
    returns: in a kernel the Generate button hands the work to a thread and returns at once."""
    import gptlib.widgets as widgets

    monkeypatch.setattr(widgets, "in_notebook", lambda: True)
    pg = playground(char_run)
    pg.max_tokens.value = 2000
    pg.button.click()
    deadline = time.time() + 60
    while pg.stop_button.disabled and not pg._job.done() and time.time() < deadline:
        time.sleep(0.002)
    pg.stop_button.click()  # from this (the "kernel's") thread, while the worker generates
    res = pg._job.result(timeout=60)
    assert res is not None and len(res.token_ids) < 2000 and "stopped after" in pg.status.value
    assert not pg.button.disabled and pg.stop_button.disabled


# ---------------------------------------------------------------------------------------------- the ChatBox


def chatbox(run):
    from gptlib.widgets import ChatBox

    box = ChatBox(run, system=SYSTEM)
    box.temperature.value = 0.0
    return box


def front_end(*steps) -> dict:
    """gptlib/message_box.js, the chat's message line, run by Node.js (tests/message_box_dom.mjs: a fake DOM and
    anywidget model): what it sent to the kernel, and what its box shows and where the focus is after `steps`."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("no Node.js here: the message box's JavaScript is not run")
    args = [node, REPO / "tests" / "message_box_dom.mjs", REPO / "gptlib" / "message_box.js"]
    done = subprocess.run(
        [*map(str, args), json.dumps(steps)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def arrive(box, content: dict) -> None:
    """A message from the message line's front end, as the kernel hands it to the widget."""
    data = {"method": "custom", "content": content}
    box.message._handle_msg({"content": {"data": data}, "buffers": []})


def put_backs(monkeypatch, box) -> list[str]:
    """What the kernel sends to the message line's front end: the only thing it may send is a message to put back."""
    sent = []
    monkeypatch.setattr(box.message, "send", lambda content, buffers=None: sent.append(content))
    return sent


def test_the_browser_takes_the_text_at_enter_so_no_key_is_lost_or_glued(chat_run, monkeypatch):  # noqa: F811
    """Issue 42: with ipywidgets' Text the kernel emptied the box the browser was still typing into: "hello there",
    Enter and "type" ~20 ms later went out as "hello therety"; a message sent before the reply merged into the one
    before; a click on Send took the focus, and the keys typed then were lost. The browser now takes the text and
    empties the box in Enter's own handler: whatever the kernel does meanwhile, each message goes out whole and
    alone, and the kernel makes each its own turn, in order."""
    shown = front_end(
        ["type", "hello there"],
        ["key", "Enter"],
        ["type", "type"],  # right after Enter: before the kernel could answer anything
        ["key", "Enter"],
        ["type", "first msg"],
        ["key", "Enter"],
        ["type", "burst sent whole"],
        ["key", "Enter"],
        ["type", "by the button"],
        ["click"],
        ["type", "after the click"],
        ["key", "Enter"],
        ["key", "Enter"],  # on the empty box
    )
    messages = [m["text"] for m in shown["sent"]]
    assert messages == [
        "hello there",
        "type",
        "first msg",
        "burst sent whole",
        "by the button",
        "after the click",
        "",
    ]
    assert shown["box"] == "" and shown["focus"] == "box" and shown["keys_to_notebook"] == 0
    # One line: Enter sends (Shift+Enter too, never a newline in the message).
    assert shown["type"] == "text" and "one line" in chatbox(chat_run).message.placeholder

    # The kernel takes one message at a time: those sent while a reply is being made wait in its queue.
    box = chatbox(chat_run)
    box.max_tokens.value = 4
    to_front_end, queue = put_backs(monkeypatch, box), [{"text": t} for t in messages[:3]]
    redraws = []

    def while_replying(_change):
        redraws.append(1)
        if len(redraws) == 2:  # mid-reply to "first msg"
            queue.append({"text": messages[3]})

    box.transcript.observe(while_replying, names="value")
    while queue:
        arrive(box, queue.pop(0))
    queue.extend({"text": t} for t in messages[4:])
    while queue:
        arrive(box, queue.pop(0))
    assert (
        user_turns(box) == messages[:-1] and [r for r, _ in box.turns] == ["user", "assistant"] * 6
    )
    assert "type a message first" in box.status.value  # the empty one: not a turn
    assert to_front_end == []  # the kernel never wrote into the box


def user_turns(box) -> list[str]:
    return [t for r, t in box.turns if r == "user"]


def test_a_message_that_failed_goes_back_into_an_empty_box(chat_run, tmp_path, monkeypatch):  # noqa: F811
    """An error or an interrupt leaves the conversation as it was, and the message goes back to the box to be sent
    again, unless something has been typed there since (never mixed with it)."""
    from gptlib.widgets import ChatBox

    box = chatbox(chat_run)
    to_front_end = put_backs(monkeypatch, box)
    box.session().reply = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    arrive(box, {"text": "Hi there"})
    assert "RuntimeError: boom" in box.status.value and box.turns == []
    assert to_front_end == [{"put_back": "Hi there"}]

    def interrupt(*a, **k):
        raise KeyboardInterrupt  # the notebook's stop button

    box.session().reply = interrupt
    with pytest.raises(KeyboardInterrupt):
        arrive(box, {"text": "Hi again"})
    assert to_front_end[-1] == {"put_back": "Hi again"} and "interrupted" in box.status.value
    box = ChatBox(tmp_path / "no-run")  # an error before any reply: the checkpoint cannot be loaded
    to_front_end = put_backs(monkeypatch, box)
    assert box.send("Hello") is None and "CheckpointError" in box.status.value
    assert to_front_end == [{"put_back": "Hello"}]
    # the front end: back into the empty box; kept out of one typed into since
    assert front_end(["type", "x"], ["key", "Enter"], ["put_back", "x"])["box"] == "x"
    assert (
        front_end(["type", "x"], ["key", "Enter"], ["type", "y"], ["put_back", "x"])["box"] == "y"
    )


def test_colab_draws_the_chat_with_its_custom_widget_manager_and_only_the_chat(monkeypatch):
    """Colab draws an anywidget only through its custom widget manager, which gptlib leaves off for the notebook
    (it broke Colab's tqdm bars) and anywidget turns on for good at its first widget. The chat's own output asks for
    it in its display metadata; the manager is left as it was. The fake is colabtools' own logic (its _widgets)."""
    from IPython.core.formatters import DisplayFormatter

    from gptlib.widgets import ChatBox

    url = "https://example.invalid/manager.min.js"
    state = types.SimpleNamespace(_installed_url=None)
    output = types.ModuleType("google.colab.output")
    output._widgets = state
    output.enable_custom_widget_manager = lambda: setattr(state, "_installed_url", url)
    output.disable_custom_widget_manager = lambda: setattr(state, "_installed_url", None)
    monkeypatch.setitem(sys.modules, "google.colab.output", output)
    for enabled_before in (
        None,
        url,
    ):  # off (ipywidgets 7), or on (enable_colab_widgets under ipywidgets 8)
        state._installed_url = enabled_before
        box = ChatBox("no-run")
        assert state._installed_url == enabled_before  # the notebook's other outputs as they were
        _, metadata = DisplayFormatter().format(box)
        view = metadata["application/vnd.jupyter.widget-view+json"]
        assert view == {"colab": {"custom_widget_manager": {"url": url}}}
    monkeypatch.delitem(sys.modules, "google.colab.output")
    assert DisplayFormatter().format(ChatBox("no-run"))[1] == {}  # outside Colab: no metadata


def test_each_message_is_shown_once_and_reset_clears_everything(chat_run):  # noqa: F811
    """display(box) is the widget, or where a front end cannot draw widgets its text: never both, so a first
    message sent before the box is shown needs no printing of its own."""
    from IPython.core.formatters import DisplayFormatter

    box = chatbox(chat_run)
    box.max_tokens.value = 12
    reply = box.send("Hi there")
    data, _ = DisplayFormatter().format(box)
    assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == box.widget.model_id
    assert (
        data["text/plain"].count("Hi there") == 1 and data["text/plain"].count(reply.strip()) == 1
    )
    assert "you: Hi there" in data["text/plain"] and "model: " in data["text/plain"]
    box.reset_button.click()
    data, _ = DisplayFormatter().format(box)
    assert "Hi there" not in data["text/plain"] and box.transcript.value == "" and box.turns == []
    assert box.status.value.endswith("history cleared</span>")


def test_max_new_tokens_is_capped_where_the_user_sees_it(chat_run):  # noqa: F811
    box = chatbox(chat_run)
    assert box.max_tokens.value == 200
    box.send("Hi there")
    cap = 64 // 2  # half of the chat_run's 64-token context
    # the slider cannot ask for more
    assert box.max_tokens.max == cap and box.max_tokens.value == cap
    assert f"capped at {cap}" in box.status.value and "64-token context" in box.status.value
    box.send("And then?")
    assert box.session().reply_tokens <= cap and box.max_tokens.max == cap


# ------------------------------------------------------------------------ what a reply and its status say (issue 42)


def shown_seconds(status: str) -> float:
    """The duration a status gives ("12 ms" or "1.5 s"), in seconds."""
    found = re.search(r" in ([\d.]+) (ms|s)\b", status)
    assert found, status
    return float(found.group(1)) / (1000 if found.group(2) == "ms" else 1)


def test_a_fast_reply_says_how_long_it_took(chat_run, char_run):  # noqa: F811
    """A 1-token reply takes milliseconds: "1 tokens in 0.0 s" said nothing true; the figure is above zero and no
    more than the time the call took, in the chat and in the Playground."""
    box = chatbox(chat_run)
    box.max_tokens.value = 1
    box.send("Hi there")  # loads the checkpoint: the second reply is the fast one
    t0 = time.perf_counter()
    box.send("And then?")
    wall = time.perf_counter() - t0
    assert re.search(r"\b1 token in ", box.status.value), box.status.value
    assert 0 < shown_seconds(box.status.value) <= wall + 0.0005, (box.status.value, wall)
    pg = playground(char_run)
    pg.max_tokens.value = 1
    pg.generate()
    t0 = time.perf_counter()
    pg.generate()
    wall = time.perf_counter() - t0
    seconds = shown_seconds(pg.status.value)
    assert 0 < seconds <= wall + 0.0005, (pg.status.value, wall)
    rate = int(re.search(r"\((\d+) tokens/s\)", pg.status.value).group(1))
    assert abs(rate - 1 / seconds) <= 0.1 * rate + 1, pg.status.value  # the two figures agree


def spy_replies(monkeypatch, engine) -> list[tuple[int | None, str]]:
    """(the seed, the raw text) of each reply `engine` makes: the real engine, watched."""
    seen, generate_text = [], engine.generate_text

    def watched(prompts, cfg, *args, **kwargs):
        texts, out, reasons = generate_text(prompts, cfg, *args, **kwargs)
        seen.append((cfg.seed, texts[0]))
        return texts, out, reasons

    monkeypatch.setattr(engine, "generate_text", watched)
    return seen


def test_a_reply_never_starts_with_a_space(chat_run, monkeypatch):  # noqa: F811
    """A model may answer "\\n Hello" to the template's "<|assistant|>": the reply, streamed and kept, is "Hello"."""
    from gptlib.inference.chat import ChatSession
    from gptlib.inference.engine import SamplingConfig

    session = ChatSession.from_run(chat_run, system=SYSTEM, log=lambda _: None)
    seen = spy_replies(monkeypatch, session.engine)
    for seed in range(30):
        session.reset()
        pieces = []
        cfg = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=seed)
        reply = session.reply("Hi there", cfg, stream=pieces.append)
        assert reply == "".join(pieces) == seen[-1][1].lstrip() == session.history[-1][1]
    # else this test proves nothing
    assert any(raw.removeprefix("\n")[:1].isspace() for _, raw in seen)


def markov(model) -> None:
    """louder() weights, and no positions nor attention: each next token depends on the last one only, not on the
    message. With the same random draws every reply is then the same, whatever the message."""
    louder(model)
    with torch.no_grad():
        model.transformer.wpe.weight.zero_()
        for block in model.transformer.h:
            block.attn.c_proj.weight.zero_()


def test_the_default_seed_gives_each_message_its_own_reply(tmp_path, chat_tok, monkeypatch):  # noqa: F811
    """Seed 1337 seeded every reply alike: the same first words whatever the message. Each turn's seed now comes
    from the seed and the conversation: the same conversation and seed still give the same reply."""
    from gptlib.widgets import ChatBox

    run = write_run(tmp_path / "markov", chat_tok, edit=markov)
    messages = ["Hi there", "What is the hour?", "Tell me of Rome", "Who are you?", "Farewell"]

    def replies(seed: int) -> list[str]:
        box = ChatBox(run, system=SYSTEM)
        box.temperature.value, box.max_tokens.value, box.seed.value = 1.0, 8, seed
        out = []
        for message in messages:
            box.reset()  # each a conversation's first message
            out.append(box.send(message))
        return out

    default = replies(1337)
    assert len(set(default)) == len(messages), default
    assert replies(1337) == default  # reproducible
    assert replies(1338) != default
    box = ChatBox(run, system=SYSTEM)
    box.temperature.value, box.max_tokens.value, box.seed.value = 1.0, 8, -1
    seen = spy_replies(monkeypatch, box.session().engine)
    box.send("Hi there")
    assert seen[0][0] is None  # -1 is random: left so


def test_refresh_finds_the_first_checkpoint_and_clears_the_error(char_run, tmp_path):
    """The Playground opened on a run with no checkpoint yet says so in red; once training saved one, ↻ lists it and
    the red "no complete checkpoint" goes (it stayed beside the filled dropdown)."""
    import shutil

    run = tmp_path / "later"
    run.mkdir()
    pg = playground(run)
    assert "no complete checkpoint" in pg.status.value and "#b00020" in pg.status.value
    shutil.rmtree(run)
    shutil.copytree(char_run, run)  # training saved its first checkpoint
    pg.refresh_button.click()
    assert [v for _, v in pg.checkpoint.options] == [0]
    assert "1 checkpoint found" in pg.status.value and "#b00020" not in pg.status.value


def test_a_gptlib_error_in_a_notebook_cell_is_one_line(tmp_path, capsys):
    """A user's mistake met in a notebook (here notebook 03's TRAIN cell given a data folder that holds no dataset)
    shows the one line the command line prints, not a traceback through gptlib; the cell still fails."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    from gptlib.errors import DataFormatError

    config = Config()
    config.HistoryManager.enabled = False
    shell = InteractiveShell.instance(config=config)
    try:
        shell.user_ns["data"] = str(tmp_path / "no-dataset")
        shell.user_ns["run"] = str(tmp_path / "run")
        result = shell.run_cell("from gptlib import train\ntrain(data, run, 'phase1')")
    finally:
        InteractiveShell.clear_instance()
    assert isinstance(result.error_in_exec, DataFormatError)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines == [f"DataFormatError: {result.error_in_exec}"], lines
    assert str(tmp_path / "no-dataset") in lines[0]
