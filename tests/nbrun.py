"""Run a notebook headless, top to bottom, with smoke-test parameters injected.

The parameters cell is the first code cell containing `# @param`; `params` are appended to it as
plain assignments, so the notebook runs exactly as a user would run it, only smaller.
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def run_notebook(
    name: str,
    params: dict,
    cwd: Path,
    timeout: int = 600,
    code: str = "",
    allow_errors: bool = False,
) -> nbformat.NotebookNode:
    """code: run after the parameters (e.g. tests.faulty.install(...): a fault in the kernel's gptlib).
    allow_errors: a cell that raises (the stop button's KeyboardInterrupt) is kept with its output, the rest run."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and "# @param" in cell.source:
            assignments = "".join(f"{k} = {v!r}\n" for k, v in params.items())
            cell.source += "\n# --- test overrides ---\n" + assignments + code
            break
    else:
        raise AssertionError(f"{name}: no parameters cell (a code cell with '# @param')")
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(cwd)}},
        allow_errors=allow_errors,
    )
    # Run on Colab itself (the GPU check), the kernel would see Colab's COLAB_RELEASE_TAG and mount Drive, putting
    # the runs under /content: a test's kernel runs as on a machine of its own.
    env = {k: v for k, v in os.environ.items() if k != "COLAB_RELEASE_TAG"}
    # the kernel imports this checkout's gptlib (a worktree's), not the one the venv was installed from
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(NOTEBOOKS.parent), env.get("PYTHONPATH")])
    )
    client.execute(env=env)
    return nb


def outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if "text" in out:
                parts.append(out["text"])
            for key in ("text/plain", "text/html", "text/markdown"):
                if key in out.get("data", {}):
                    parts.append(out["data"][key])
    return "\n".join(parts)
