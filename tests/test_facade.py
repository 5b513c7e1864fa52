"""The package's one surface: notebooks and the README's Python examples import only names from `gptlib` itself,
and every name there loads (issue 19)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import pytest

import gptlib
from tests.conftest import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def _code_of(path) -> list[tuple[str, str]]:
    """(where, code) of each notebook code cell, or of each ```python block of a markdown file."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return [
            (f"{path.name} cell {i}", "".join(c["source"]))
            for i, c in enumerate(cells)
            if c["cell_type"] == "code"
        ]
    return [
        (f"{path.name} block {i}", b)
        for i, b in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S))
    ]


def deep_imports(code: str) -> list[str]:
    """Imports that reach past the facade: `from gptlib.x import`, `import gptlib.x`, or a name gptlib lacks."""
    bad = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gptlib"):
            if node.module != "gptlib":
                bad.append(f"from {node.module} import ...")
            bad += [f"gptlib has no {a.name!r}" for a in node.names if not hasattr(gptlib, a.name)]
        elif isinstance(node, ast.Import):
            bad += [f"import {a.name}" for a in node.names if a.name.startswith("gptlib.")]
    return bad


@pytest.mark.parametrize("path", NOTEBOOKS + [REPO / "README.md"], ids=lambda p: p.name)
def test_notebooks_and_readme_examples_import_only_from_gptlib(path):
    found = {where: bad for where, code in _code_of(path) if (bad := deep_imports(code))}
    assert not found, f"{path.name} imports past the facade: {found}"


def test_the_check_sees_a_deep_import():
    assert deep_imports(
        "from gptlib.training.loop import train\nimport gptlib.colab\nfrom gptlib import nothing"
    )
    assert not deep_imports("import gptlib\nfrom gptlib import train, colab")


def test_every_facade_name_loads():
    missing = [n for n in gptlib._WHERE if getattr(gptlib, n, None) is None]
    assert not missing and {"train", "prepare", "load_run", "Engine", "Playground", "colab"} <= set(
        dir(gptlib)
    )


def test_importing_gptlib_loads_no_torch():
    code = "import sys, gptlib; gptlib.ModelConfig; gptlib.prepare; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_an_editor_finds_each_facade_name_where_it_is_defined():
    """`from gptlib import train` then go-to-definition (jedi, as editors and notebooks use it) lands in the module
    that defines the name: the lazy table alone gave an editor nothing (issue 43). The static imports for editors
    and the table that loads the names name the same modules."""
    jedi = pytest.importorskip("jedi")
    tree = ast.parse((REPO / "gptlib" / "__init__.py").read_text())
    static = {
        a.asname or a.name: node.module if node.module != "gptlib" else f"gptlib.{a.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for a in node.names
        if (node.module or "").startswith("gptlib")
    }
    assert static == gptlib._WHERE
    project = jedi.Project(REPO)
    for name, module in gptlib._WHERE.items():
        script = jedi.Script(
            f"from gptlib import {name}\n{name}", path=REPO / "x.py", project=project
        )
        found = script.goto(2, 0, follow_imports=True)
        want = REPO.joinpath(*module.split(".")).with_suffix(".py")
        assert found and found[0].module_path in (want, want.with_name("__init__.py")), (
            name,
            found,
        )
