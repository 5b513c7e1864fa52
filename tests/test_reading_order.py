"""docs/architecture.md's reading order is the trace: notebook 03's train() call is run here through a step, a save
and a resume with every gptlib function it enters recorded, and the doc must list, file by file, exactly those
functions (with their line count), or name the file as one a first read skips."""

from __future__ import annotations

import ast
import re
import shutil
import sys
import threading

import pytest

from tests.conftest import REPO

PKG = REPO / "gptlib"
DOC = REPO / "docs" / "architecture.md"
ANONYMOUS = ("<lambda>", "<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>", "<module>")


def _functions(path) -> dict[str, int]:
    """A module's functions and methods: qualname -> lines (its decorators included), as trace_path counts them."""
    out = {}

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                out[prefix + child.name] = child.end_lineno - start + 1
                walk(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")

    walk(ast.parse(path.read_text()), "")
    return out


def _reading_order() -> tuple[list[tuple[str, int, list[str]]], list[str]]:
    """-> ([(file, lines said, functions named)], files a first read skips)."""
    text = DOC.read_text()
    section = text[text.index("## Reading order") : text.index("## Modules")]
    head, _, skipped = section.partition("Skip on a first read")
    items = re.findall(
        r"^\d+\. `(gptlib/[\w/]+\.py)` \(([\d,]+) lines\):(.*?)(?=^\d+\. |\Z)", head, re.M | re.S
    )
    order = [
        (path, int(n.replace(",", "")), re.findall(r"`([\w.<>]+)`", body))
        for path, n, body in items
    ]
    return order, re.findall(r"`(gptlib/[\w/]+\.py)`", skipped)


def test_the_reading_order_counts_the_lines_of_the_functions_it_names():
    order, skipped = _reading_order()
    assert order and skipped, (
        "docs/architecture.md: no numbered reading order or no 'Skip on a first read' list"
    )
    wrong = {}
    for path, said, names in order:
        functions = _functions(REPO / path)
        unknown = [n for n in names if n not in functions]
        assert not unknown, f"docs/architecture.md names {unknown} in {path}: not functions of it"
        if said != (counted := sum(functions[n] for n in names)):
            wrong[path] = (said, counted)
    assert not wrong, f"docs/architecture.md's reading order: (said, counted) lines differ: {wrong}"
    total = re.search(r"([\d,]+) lines of functions", DOC.read_text())
    assert total and int(total.group(1).replace(",", "")) == sum(n for _, n, _ in order), total
    assert all((REPO / p).is_file() for p in skipped) and not set(skipped) & {
        p for p, _, _ in order
    }, skipped


def _trace(char_data, tmp_path) -> dict[str, set[str]]:
    """Notebook 03's call as ../shared/tools/trace_path.py makes it: phase1 on the CPU with a Drive mirror,
    validating and saving every 20 steps, to step 40; then a new VM (the local run dir gone) resumes from the mirror
    for two steps. -> {file: the qualnames of the gptlib functions entered, on every thread but the lease's
    heartbeat (a clock, not the path)}."""
    from gptlib import train

    src, entered = str(PKG) + "/", {}

    def profile(frame, event, arg):
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(src) or code.co_name in ANONYMOUS:
            return
        if "lease" not in threading.current_thread().name:
            entered.setdefault("gptlib/" + code.co_filename[len(src) :], set()).add(
                code.co_qualname
            )

    overrides = ["eval_interval=20", "save_every_steps=20", "save_every_minutes=0"]
    kwargs = dict(device="cpu", mirror_dir=tmp_path / "drive", progress=False, log=lambda s: None)
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        train(char_data, tmp_path / "local", "phase1", overrides, max_steps=40, **kwargs)
        shutil.rmtree(tmp_path / "local")
        result = train(char_data, tmp_path / "local", "phase1", overrides, max_steps=42, **kwargs)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert result.resumed_from == 40, result
    return entered


@pytest.mark.skipif(sys.version_info < (3, 11), reason="co_qualname is Python 3.11's")
def test_the_reading_order_is_the_trace_of_a_step_a_save_and_a_resume(char_data, tmp_path):
    """Each file of the reading order names exactly the functions the call enters in it; every other file entered
    is one a first read skips."""
    entered = _trace(char_data, tmp_path)
    order, skipped = _reading_order()
    wrong = {
        path: {
            "named, not entered": sorted(set(names) - got),
            "entered, not named": sorted(got - set(names)),
        }
        for path, _, names in order
        if set(names) != (got := entered.get(path, set()))
    }
    assert not wrong, f"docs/architecture.md's reading order is not the trace: {wrong}"
    unnamed = sorted(set(entered) - {p for p, _, _ in order} - set(skipped))
    assert not unnamed, (
        f"files the call enters that docs/architecture.md's reading order does not name: {unnamed}"
    )
