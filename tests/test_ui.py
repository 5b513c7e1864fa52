"""What a user sees in the browser (issue 18): the Playground's Stop button and a kernel interrupt, the ChatBox
(Enter sends, each message shown once, Reset clears it all, the max-tokens cap shown), driven headless."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from gptlib.widgets import status_html
from tests.test_dialogue import SYSTEM, chat_run, chat_tok, write_run  # noqa: F401 - fixtures

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
    assert "<b>KING</b>" in pg.output.value and "<b>KING</b></pre>" not in pg.output.value  # the text so far stays
    assert not pg.button.disabled and pg.stop_button.disabled
    res = pg.generate()  # the next Generate starts afresh: the old click does not stop it
    assert len(res.token_ids) == 500 and "stopped by length" in pg.status.value


def test_generate_from_a_cell_does_not_offer_stop(char_run):
    """A cell that calls generate() holds the kernel: a Stop click could not arrive before it ends, so Stop is not
    offered, and the status says what ends it."""
    pg = playground(char_run)
    seen = []
    pg.output.observe(once(lambda: seen.append((pg.stop_button.disabled, pg.status.value))), names="value")
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
    assert "<b>KING</b>" in pg.output.value and "<b>KING</b></pre>" not in pg.output.value  # the text so far stays
    assert not pg.button.disabled and pg.stop_button.disabled


def test_in_a_kernel_generate_runs_off_the_main_thread_so_a_stop_click_can_arrive(char_run, monkeypatch):
    """A widget callback on the kernel's main thread blocks every other message (the Stop click too) until it
    returns: in a kernel the Generate button hands the work to a thread and returns at once."""
    import gptlib.widgets as widgets

    monkeypatch.setattr(widgets, "_in_kernel", lambda: True)
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


def test_enter_sends_the_message(chat_run):  # noqa: F811
    box = chatbox(chat_run)
    box.max_tokens.value = 12
    box.message.value = "Hi there"
    box.message._handle_custom_msg({"event": "submit"}, [])  # what the front end sends when Enter is pressed
    assert [r for r, _ in box.turns] == ["user", "assistant"] and box.message.value == ""
    assert box.send_button.description == "Send"  # the button still works too


def test_the_message_box_takes_no_typing_while_a_reply_streams(chat_run):  # noqa: F811
    """While a reply streams the send callback holds the kernel, and a browser delivers a second Enter before the
    keystrokes it holds back (the message arrived as its first letter): the box is cleared and disabled from the
    Enter on, until the reply ends; what was typed is what is sent."""
    box = chatbox(chat_run)
    box.max_tokens.value = 12
    during = []
    box.transcript.observe(lambda _: during.append((box.message.disabled, box.message.value, box.send_button.disabled)),
                           names="value")
    for text in ["first message", "second message"]:
        during.clear()
        box.message.value = text  # what the front end syncs as it is typed
        box.message._handle_custom_msg({"event": "submit"}, [])  # Enter
        assert during and all(d == (True, "", True) for d in during[:-1]), during  # streaming: no typing, no Send
        assert not box.message.disabled and not box.send_button.disabled  # typing again once the reply is there
        assert box.turns[-2] == ("user", text) and box.turns[-1][0] == "assistant"
    assert [t for r, t in box.turns if r == "user"] == ["first message", "second message"]


def test_the_message_box_comes_back_after_an_error_or_an_interrupt(chat_run, tmp_path):  # noqa: F811
    from gptlib.widgets import ChatBox

    box = chatbox(chat_run)
    box.message.value = "Hi there"
    box.session().reply = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    box.message._handle_custom_msg({"event": "submit"}, [])
    assert "RuntimeError: boom" in box.status.value and box.turns == []
    assert not box.message.disabled and box.message.value == "Hi there"  # not lost, and it can be edited

    def interrupt(*a, **k):
        raise KeyboardInterrupt  # the notebook's stop button

    box.session().reply = interrupt
    with pytest.raises(KeyboardInterrupt):
        box.message._handle_custom_msg({"event": "submit"}, [])
    assert not box.message.disabled and box.message.value == "Hi there" and "interrupted" in box.status.value
    box = ChatBox(tmp_path / "no-run")  # an error before any reply: the checkpoint cannot be loaded
    box.message.value = "Hello"
    box.send_button.click()
    assert "CheckpointError" in box.status.value and not box.message.disabled and box.message.value == "Hello"


def test_the_message_box_says_messages_are_one_line(chat_run):  # noqa: F811
    """ipywidgets' Text sends on Enter with or without Shift (7.7.1 and 8 check only the key), and a Textarea has no
    submit event: the box is one line, and says so."""
    import ipywidgets as W

    box = chatbox(chat_run)
    assert type(box.message) is W.Text and "one line" in box.message.placeholder


def test_each_message_is_shown_once_and_reset_clears_everything(chat_run):  # noqa: F811
    """display(box) is the widget, or where a front end cannot draw widgets its text: never both, so a first
    message sent before the box is shown needs no printing of its own."""
    from IPython.core.formatters import DisplayFormatter

    box = chatbox(chat_run)
    box.max_tokens.value = 12
    reply = box.send("Hi there")
    data, _ = DisplayFormatter().format(box)
    assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == box.widget.model_id
    assert data["text/plain"].count("Hi there") == 1 and data["text/plain"].count(reply.strip()) == 1
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
    assert box.max_tokens.max == cap and box.max_tokens.value == cap  # the slider cannot ask for more
    assert f"capped at {cap}" in box.status.value and "64-token context" in box.status.value
    box.send("And then?")
    assert box.session().reply_tokens <= cap and box.max_tokens.max == cap
