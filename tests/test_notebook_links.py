"""The notebooks point into the code (issue 37, item 7): 02 and 03 end with "Under the hood", 04 says how a token is
chosen, each sentence a link to the file and function to read at the release the notebook installs. A pointer that
went stale (a file moved, a function renamed, the version raised) fails here, checked against this checkout's files
(no network).

A pointer is a markdown link to https://github.com/gptlib/gptlib/blob/vVERSION/PATH#L<n> whose text names, in
backticks, what to read there: `function`, `Class` or `Class.method` (defined in PATH, found with ast; the anchor on
the line of its `def` or `class`), and in plain words the file, as a tail of PATH
(`[`train_step` in training/step.py](.../gptlib/training/step.py#L41)`)."""

from __future__ import annotations

import ast
import re
from functools import cache

import nbformat
import pytest

import gptlib
from scripts.notebook_anchors import definition_line
from tests.conftest import REPO
from tests.nbrun import NOTEBOOKS

BLOB = "https://github.com/gptlib/gptlib/blob/"
LINK = re.compile(r"\[([^\]]+)\]\((" + re.escape(BLOB) + r"[^)\s]*)\)")
NAME = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?)`")
FILE = re.compile(r"(?<![\w/.])((?:[\w.-]+/)*[\w.-]+\.(?:py|md))\b")

# notebook -> (the section's heading, the names it must point at)
SECTIONS = {
    "02_phase1_shakespeare.ipynb": (
        "## Under the hood",
        {"train_step", "TrainingRun.state_dict", "save_checkpoint", "find_resume", "GracefulStop"},
    ),
    "03_phase3_train.ipynb": (
        "## Under the hood",
        {
            "train_step",
            "TrainingRun.state_dict",
            "save_checkpoint",
            "find_resume",
            "use_compile",
            "autocast_for",
            "build_optimizer",
        },
    ),
    "04_generate.ipynb": (
        "### Under the hood",
        {"Engine.generate_ids", "KVCache", "Engine._next_logits", "process_logits", "sample_next"},
    ),
}


def pointers(source: str) -> list[tuple[str, str, str, list[str]]]:
    """-> (the link's text, its tag, its path, the names in its text), each link to the repository's files."""
    found = []
    for text, url in LINK.findall(source):
        tag, _, path = url[len(BLOB) :].partition("/")
        found.append((text, tag, path, NAME.findall(text)))
    return found


@cache
def defined(path: str) -> frozenset[str]:
    """The names a module defines: its functions, classes and assignments, and Class.member for each class's."""
    tree = ast.parse((REPO / path).read_text(), filename=path)

    def names(body) -> set[str]:
        out = set()
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.Assign):
                out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out.add(node.target.id)
        return out

    out = names(tree.body)
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            out |= {f"{node.name}.{member}" for member in names(node.body)}
    return frozenset(out)


def stale(source: str) -> list[str]:
    """What is wrong with the pointers in a cell's text (empty: all of them hold)."""
    problems = []
    if source.count(BLOB) != len(LINK.findall(source)):
        problems.append(
            f"a link to {BLOB} that is not a markdown link [text](url) with no spaces in the url"
        )
    for text, tag, path, names in pointers(source):
        where = f"[{text}]({BLOB}{tag}/{path})"
        if tag != f"v{gptlib.__version__}":
            problems.append(
                f"{where}: the tag is {tag}, the release the notebooks install is v{gptlib.__version__}"
            )
        path, _, anchor = path.partition("#")
        if not (REPO / path).is_file():
            problems.append(f"{where}: no file {path} in this repository")
            continue
        for file in FILE.findall(text):
            if not ("/" + path).endswith("/" + file):
                problems.append(f"{where}: its text names {file}, the link is to {path}")
        if path.endswith(".py"):
            problems += [f"{where}: {path} defines no {n}" for n in names if n not in defined(path)]
            problems += wrong_anchor(where, path, anchor, names)
        elif names:
            problems.append(f"{where}: names {names} in a file that is not Python")
    return problems


def wrong_anchor(where: str, path: str, anchor: str, names: list[str]) -> list[str]:
    """A link naming a definition opens at its line: #L<n> on the line of the first name's `def` or `class`."""
    if not names or names[0] not in defined(path):
        return []
    line = definition_line(path, names[0])
    if anchor != f"L{line}":
        return [
            f"{where}: {names[0]} starts at line {line} of {path}, the link's anchor is "
            f"{'#' + anchor if anchor else 'missing'} (python scripts/notebook_anchors.py sets them)"
        ]
    return []


def cells(name: str) -> list:
    return nbformat.read(NOTEBOOKS / name, as_version=4).cells


@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_every_link_into_the_code_holds(name):
    problems = [p for c in cells(name) for p in stale(c.source)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_the_notebooks_say_what_the_code_does(name):
    """02 and 03 end with "Under the hood"; 04 has one in its Playground, before the checkpoints are compared."""
    heading, must = SECTIONS[name]
    nb = cells(name)
    at = [i for i, c in enumerate(nb) if c.cell_type == "markdown" and c.source.startswith(heading)]
    assert len(at) == 1, f"{name}: one markdown cell starting with {heading!r}"
    section = nb[at[0]].source
    if name.startswith("04"):  # under the Playground's heading, where the text is generated
        above = [
            c.source
            for c in nb[: at[0]]
            if c.cell_type == "markdown" and c.source.startswith("## ")
        ]
        assert above[-1].startswith("## Playground"), (
            f"{name}: {heading!r} is not in the Playground"
        )
    else:
        assert at[0] == len(nb) - 1, f"{name}: {heading!r} is not the last cell"
    named = {n for *_, names in pointers(section) for n in names}
    assert must <= named, f"{name}: {heading!r} points at none of {sorted(must - named)}"
    # every paragraph and bullet after the intro points into the code
    blocks = [b for b in re.split(r"\n\s*\n|\n\s*(?=[-*] )", section) if b.strip()][2:]
    assert blocks and all(pointers(b) for b in blocks), [b for b in blocks if not pointers(b)]


def test_a_stale_pointer_is_found():
    """The check itself: a moved file, a renamed function, an old tag, a file named that the link is not to."""
    line = definition_line("gptlib/training/step.py", "train_step")
    ok = f"[`train_step` in training/step.py]({BLOB}v{gptlib.__version__}/gptlib/training/step.py#L{line})"
    assert stale(ok) == [] and pointers(ok)[0][3] == ["train_step"]
    assert stale(ok.replace("`train_step`", "`TrainingRun.state_dict`"))  # not in step.py
    assert stale(ok.replace("/step.py#", "/steps.py#"))  # no such file
    assert stale(ok.replace(f"v{gptlib.__version__}", "v0.0.1"))
    assert stale(ok.replace("in training/step.py", "in training/loop.py"))
    assert stale(ok.replace(f"#L{line})", f"#L{line + 1})"))  # the anchor off the def
    assert stale(ok.replace(f"#L{line})", ")"))  # no anchor
    assert stale(
        f"see {BLOB}v{gptlib.__version__}/gptlib/training/step.py"
    )  # a bare url: not checked
    line = definition_line("gptlib/training/run.py", "TrainingRun.load_state_dict")
    method = f"[`TrainingRun.load_state_dict`]({BLOB}v{gptlib.__version__}/gptlib/training/run.py#L{line})"
    assert stale(method) == [] and stale(method.replace(".load_state_dict", ".load"))
