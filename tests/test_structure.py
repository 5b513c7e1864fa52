"""The package's structure: folders along the data's path as layers no import runs up, no import cycles, light
commands, and the size yardsticks."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

PKG = REPO / "gptlib"
# The layers, bottom first: a module imports only from its own layer or those below it (a newcomer who changes
# resume, the sampler or the Drive copy opens one folder, and nothing below depends on it). Entries are module
# names relative to gptlib/ ("config") or folders ("data/": every module in it).
LAYERS = [
    {"config", "errors", "runtime", "layout", "fsutil", "colab", "lease"},  # the bottom
    {"data/"},  # text to token shards: never imports torch
    {"model", "batches"},  # the network and the batches it trains on
    {"checkpoint/"},  # the format, the writer, the Drive mirror, resume
    {"inference/"},  # loading a run, the engine, chat, export and import
    {"evaluation/"},  # log-likelihoods, HellaSwag, bits per byte
    {"training/"},  # set-up, the step, the loop, its logs and measurements
    # the notebooks' views, the Hub push, the CLI (its commands and how they run), the facade
    {
        "widgets",
        "share",
        "__main__",
        "cli",
        "__init__",
    },
]


def module_name(path, pkg=PKG) -> str:
    """gptlib/data/prepare.py -> "data.prepare"; a folder's __init__.py -> "data"; gptlib/__init__.py -> "__init__"."""
    parts = list(path.relative_to(pkg).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        if module in layer or f"{module.split('.')[0]}/" in layer:
            return i
    raise AssertionError(
        f"gptlib/{module.replace('.', '/')}.py is in no layer of tests/test_structure.py's LAYERS"
    )


def _imported(node: ast.AST, mods: set[str]) -> set[str]:
    """The gptlib modules one import statement names (absolute: `from gptlib.x.y import`, `from gptlib.x import y`,
    `import gptlib.x.y`); relative imports are refused by test_imports_are_absolute."""
    if isinstance(node, ast.Import):
        names = [a.name.partition(".")[2] for a in node.names if a.name.startswith("gptlib.")]
    elif (
        isinstance(node, ast.ImportFrom)
        and node.level == 0
        and node.module is not None
        and (node.module == "gptlib" or node.module.startswith("gptlib."))
    ):
        base = node.module.partition(".")[2]
        names = [f"{base}.{a.name}" if base else a.name for a in node.names]
        # `from gptlib.x import name`: the module x
        names = [n if n in mods else base for n in names]
    else:
        return set()
    return {n for n in names if n in mods}


def gptlib_imports(pkg=PKG) -> dict[str, set[str]]:
    """module -> the gptlib modules it imports, at module level or inside functions."""
    paths = {module_name(p, pkg): p for p in pkg.rglob("*.py")}
    graph = {}
    for m, p in paths.items():
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            deps |= _imported(node, set(paths))
        graph[m] = deps - {m}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (a -> b -> a), or None."""
    state = {}  # 1: on the stack, 2: done

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return path + [d]
            if d not in state:
                found = visit(d, path + [d])
                if found:
                    return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_no_import_cycles():
    cycle = find_cycle(gptlib_imports())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_cycle_check_sees_every_import_form(tmp_path):
    """The check itself: a cycle written with any absolute import form, across folders, is found."""
    pkg = tmp_path / "gptlib"
    (pkg / "x").mkdir(parents=True)
    (pkg / "x" / "__init__.py").write_text("")
    for body in (
        {"a": "from gptlib.x.b import f\n", "x/b": "import gptlib.a\n"},
        {"a": "from gptlib.x import b\n", "x/b": "def f():\n    from gptlib.a import g\n"},
        {"a": "import gptlib.x.b as bb\n", "x/b": "from gptlib.a import x\n"},
    ):
        for name, text in body.items():
            (pkg / f"{name}.py").write_text(text)
        assert find_cycle(gptlib_imports(pkg)) in (["a", "x.b", "a"], ["x.b", "a", "x.b"]), body
    (pkg / "x" / "b.py").write_text("import os\nimport gptlibx.a\n")  # not gptlib: no edge
    assert find_cycle(gptlib_imports(pkg)) is None


def test_imports_are_absolute():
    """One import style across the package (`from gptlib.data.shards import read_meta`): a moved module is
    found by one search, and the layer check reads every import."""
    relative = [
        f"{p.relative_to(PKG)}:{node.lineno}"
        for p in sorted(PKG.rglob("*.py"))
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert not relative, f"relative imports: {relative}"


def test_no_import_runs_upward():
    graph = gptlib_imports()
    upward = sorted(
        f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
        for m, deps in graph.items()
        for d in deps
        if layer_of(d) > layer_of(m)
    )
    assert not upward, "imports that run upward: " + "; ".join(upward)


def test_the_layer_check_sees_an_upward_import(tmp_path):
    pkg = tmp_path / "gptlib"
    (pkg / "data").mkdir(parents=True)
    (pkg / "data" / "__init__.py").write_text("")
    (pkg / "data" / "shards.py").write_text("def f():\n    from gptlib.model import GPT\n")
    (pkg / "model.py").write_text("")
    graph = gptlib_imports(pkg)
    assert graph["data.shards"] == {"model"} and layer_of("model") > layer_of("data.shards")


def test_data_never_imports_torch():
    """Statically, at module level and inside functions: tokenizing needs no torch (a Colab CPU runtime, and the
    memory a tokenizer process takes)."""
    found = [
        f"{p.relative_to(PKG)}:{node.lineno}"
        for p in sorted((PKG / "data").rglob("*.py"))
        for node in ast.walk(ast.parse(p.read_text()))
        if (
            isinstance(node, ast.Import)
            and any(a.name.split(".")[0] == "torch" for a in node.names)
        )
        or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch")
    ]
    assert not found, f"data/ imports torch: {found}"


def test_tokenize_never_imports_torch(tmp_path, small_text):
    code = (
        "import sys; from gptlib.__main__ import main; "
        f"main(['tokenize', '--input', {str(small_text)!r}, '--out', {str(tmp_path / 'd')!r}, '--quiet']); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_module_names_never_overlap():
    """One name, one module, wherever it lives (nanochat's habit): a name in a message or a search finds it."""
    names = [p.name for p in PKG.rglob("*.py") if p.name != "__init__.py"]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})


# --- the yardsticks: module and function size ----------------------------------------

# lines as ruff lays them out (100 columns: scripts/test.sh checks the layout)
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80  # the AST span: decorators, signature, docstring and body
# Modules and functions still over those, each with why it is allowed for now. Remove an entry once it is
# shortened; a new long one belongs in named pieces, not on these lists.
LONG_MODULES: dict[str, str] = {}
LONG_FUNCTIONS: dict[str, str] = {}


def _functions():
    for p in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                yield f"{p.relative_to(PKG)}:{node.name}", node.end_lineno - start + 1


def test_no_module_over_500_lines():
    sizes = {str(p.relative_to(PKG)): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    over = {k: n for k, n in sizes.items() if n > MAX_MODULE_LINES and k not in LONG_MODULES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {over}"
    fine = [k for k in LONG_MODULES if sizes.get(k, 0) <= MAX_MODULE_LINES]
    assert not fine, f"LONG_MODULES names modules that are short now (or gone): {fine}"


def test_no_function_over_80_lines():
    spans = dict(_functions())
    over = {k: n for k, n in spans.items() if n > MAX_FUNCTION_LINES and k not in LONG_FUNCTIONS}
    assert not over, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them into named pieces): {over}"
    )
    fine = [k for k in LONG_FUNCTIONS if spans.get(k, 0) <= MAX_FUNCTION_LINES]
    assert not fine, f"LONG_FUNCTIONS names functions that are short now (or gone): {fine}"


def test_no_history_comments_in_the_package():
    """What the code is and why, not how it came to be: the git log holds issue numbers and "before X"."""
    found = [
        f"{p.relative_to(REPO)}:{n}"
        for p in sorted(PKG.rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bissues? \d+", line)
    ]
    assert not found, f"history in comments or strings: {found}"


# files of other projects the package names
ELSEWHERE = {"tensorflow_datasets/url_checksums/hellaswag.txt"}


def test_the_files_the_package_names_exist():
    """A comment pointing a reader at a file must point at one: the redesign merged optimizer.py into step.py, and
    run.py's comment on TrainingRun.optimizer still sent the reader to training/optimizer.py. A path with a folder
    (training/step.py, benchmarks/cpu_estimate.py) is looked for under gptlib/ and the repository's root."""
    named = re.compile(r"(?<![\w/.-])((?:[\w-]+/)+[\w-]+\.(?:py|sh|md|js|txt))\b")
    missing = [
        f"{p.relative_to(REPO)}:{n}: {path}"
        for p in sorted(PKG.rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        for path in named.findall(line)
        if not (PKG / path).exists() and not (REPO / path).exists() and path not in ELSEWHERE
    ]
    assert not missing, f"files named in the package that do not exist: {missing}"


# --- one definition of every file name ---------------------------------------------------------

# Run-dir names (gptlib/layout.py) and data-dir names (gptlib/data/shards.py), as string literals anywhere else.
# config.json and tokenizer.json are left out: they are also Hugging Face's names (export, import-hf).
_OWNED_NAMES = {
    "layout.py": (
        "checkpoints",
        "metrics.jsonl",
        "samples.jsonl",
        "samples.md",
        "loss.png",
        "eval.jsonl",
        "lease.json",
        "model.pt",
        "train_state.pt",
        "state.json",
        "manifest.json",
        # a data directory's: named here so that the lease can refuse one as a run directory
        "meta.json",
        "prepare_state.json",
    ),
}


def test_file_names_are_defined_once():
    found = []
    for p in sorted(PKG.rglob("*.py")):
        rel = str(p.relative_to(PKG))
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                owner = next((o for o, names in _OWNED_NAMES.items() if node.value in names), None)
                if owner is not None and owner != rel:
                    found.append(
                        f"{rel}:{node.lineno} {node.value!r} (import it from gptlib/{owner})"
                    )
    assert not found, "file-name literals outside their module: " + "; ".join(found)


def _section(path, heading: str) -> str:
    text = path.read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_the_architecture_doc_names_every_module_once():
    """A new reader finds where a change goes from docs/architecture.md: every module of gptlib/ is named there
    exactly once (a new module gets its line; a folder's __init__.py needs none)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.replace(_section(REPO / "docs" / "architecture.md", "## Reading order"), "")
    counts = {
        p.name: len(re.findall(rf"(?<![\w.]){re.escape(p.name)}\b", section))
        for p in PKG.rglob("*.py")
        if p.parent == PKG or p.name != "__init__.py"
    }
    wrong = {name: n for name, n in counts.items() if n != 1}
    assert not wrong, f"docs/architecture.md names these modules not exactly once: {wrong}"


def test_the_readme_architecture_has_a_line_per_folder():
    section = _section(REPO / "README.md", "## Architecture")
    folders = sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    wrong = {f: n for f in folders if (n := section.count(f"gptlib/{f}/")) != 1}
    assert folders and not wrong, (
        f"README.md's architecture names these folders not exactly once: {wrong}"
    )


def test_every_folder_of_the_package_is_installed():
    """pip install (a notebook's first cell) packs what setuptools finds: a folder without __init__.py would import
    here (a namespace package, from the clone) and be missing on Colab."""
    from setuptools import find_packages

    folders = {
        ".".join(p.relative_to(REPO).parts)
        for p in PKG.rglob("*")
        if p.is_dir() and any(p.glob("*.py"))
    }
    assert set(find_packages(str(REPO), include=["gptlib*"])) == folders | {"gptlib"}


def test_every_file_the_package_reads_is_installed():
    """A file of gptlib/ that is not Python (the chat box's JavaScript) is installed only where pyproject.toml's
    package-data names it: else it is read here, from the clone, and missing on Colab."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = data.get("package-data", {}).get("gptlib", [])
    files = [
        p.relative_to(PKG).as_posix()
        for p in PKG.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    ]
    assert files and all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files), (files, globs)
