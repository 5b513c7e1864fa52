"""Point the notebooks' links into the code at this checkout: each link to a .py file that names a definition in
backticks gets the tag of gptlib's version and a line anchor (#L<n>) at that definition's `def` or `class` line.
tests/test_notebook_links.py fails with the advice to run this when code moved.

    python scripts/notebook_anchors.py          # rewrite the notebooks in place
    python scripts/notebook_anchors.py --check  # only say which links are off (exit 1)
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOB = "https://github.com/gptlib/gptlib/blob/"
LINK = re.compile(r"\[([^\]]+)\]\(" + re.escape(BLOB) + r"([^/)\s]+)/([^)#\s]+)(#L\d+)?\)")
NAME = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?)`")


def version() -> str:
    text = (REPO / "gptlib" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


def definition_line(path: str, name: str) -> int | None:
    """The line of `def name` / `class name` (a method: `Class.name`) in path, or None."""
    body = ast.parse((REPO / path).read_text()).body
    node = None
    for part in name.split("."):
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        node = next((n for n in body if isinstance(n, kinds) and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return node.lineno


def anchored(source: str, tag: str) -> str:
    """The cell's text with each link to a named definition in a .py file anchored at its line, at `tag`."""

    def fix(m: re.Match) -> str:
        text, _, path, _ = m.groups()
        names = NAME.findall(text)
        line = definition_line(path, names[0]) if path.endswith(".py") and names else None
        anchor = f"#L{line}" if line else ""
        return f"[{text}]({BLOB}{tag}/{path}{anchor})"

    return LINK.sub(fix, source)


def main() -> int:
    tag, off = f"v{version()}", []
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        data = json.loads(nb.read_text())
        for cell in data["cells"]:
            if cell["cell_type"] != "markdown":
                continue
            source = "".join(cell["source"])
            if (new := anchored(source, tag)) != source:
                off.append(nb.name)
                cell["source"] = new.splitlines(keepends=True)
        if off and off[-1] == nb.name and "--check" not in sys.argv:
            nb.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    for name in sorted(set(off)):
        print(f"{name}: links {'off' if '--check' in sys.argv else 'anchored'} at {tag}")
    return 1 if off and "--check" in sys.argv else 0


if __name__ == "__main__":
    sys.exit(main())
