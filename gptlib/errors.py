"""The errors a user can fix: the message names the file or field, the values and the fix; the command line prints
it as one line (exit status 2). No torch import here, so `tokenize` never loads torch."""

from __future__ import annotations

import sys


def loud(msg: str) -> None:
    """A problem reported, not raised (a failing Drive copy): stderr, red in notebooks, flushed at once."""
    print(msg, file=sys.stderr, flush=True)


def in_notebook() -> bool:
    """Whether a Jupyter or Colab kernel runs this process: a message then names the notebook's parameter, elsewhere
    the command's flag."""
    # a kernel has it loaded; importing it here would cost every command
    ipython = sys.modules.get("IPython")
    return ipython is not None and getattr(ipython.get_ipython(), "kernel", None) is not None


def override(*settings: str) -> str:
    """How to set config fields where the user is: override("keep_last=3") -> 'OVERRIDES = ["keep_last=3"]' in a
    notebook (02, 03 and 05 pass their OVERRIDES to train), '--set keep_last=3' on the command line."""
    if in_notebook():
        return "OVERRIDES = [" + ", ".join(f'"{s}"' for s in settings) + "]"
    return " ".join(f"--set {s}" for s in settings)


def again() -> str:
    """How to go on where the user is: a notebook's stop button or error ends a cell, not a command."""
    return "run this cell again" if in_notebook() else "run the same command again"


class GptlibError(Exception):
    """A problem the user can fix; the message says what and how."""

    # IPython's hook for an exception that renders itself: a notebook shows the one line the command line prints,
    # not a traceback through gptlib that says nothing more
    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


# One class per kind of problem, for a caller to catch the kind it handles; each says which modules raise it.


class ConfigError(GptlibError, ValueError):
    """config, colab: a configuration value or key, a run or dataset name."""


class DataFormatError(GptlibError, ValueError):
    """data: a data directory's metadata and files disagree, or a file is missing."""


class TokenizerError(GptlibError, ValueError):
    """tokenizer: a bad tokenizer file, an unknown character, a tokenizer that does not match the data."""


class PrepareError(GptlibError, ValueError):
    """prepare, download: bad input for tokenize (a missing file or column, a refused directory), a bad download."""


class ChatError(GptlibError, ValueError):
    """chat: a tokenizer without the chat tokens, or a conversation that cannot be rendered."""


class CheckpointError(GptlibError, RuntimeError):
    """checkpoint: missing, incomplete, corrupt, or not of this run."""


class RunDirError(GptlibError):
    """lease, fsutil: a run or data directory that cannot be written (read-only, full), or another process holds."""


class LeaseLost(GptlibError):
    """lease: another process took this run over while it trained; this one stopped without saving."""


class UnreadableError(GptlibError, OSError):
    """checkpoint, fsutil: a file that cannot be read now (not there, not a regular file): not known to be damaged, so
    never set aside or deleted on its account; callers treat it as any OSError."""


class HungIOError(UnreadableError):
    """fsutil: an I/O call (a hung Drive) made no progress in its time limit; callers treat it as any OSError."""


class OutOfMemoryAdvice(GptlibError, RuntimeError):
    """training: out of GPU memory; the message names the next setting to try."""


class EvalError(GptlibError, ValueError):
    """evaluation: a bad file, task or option."""


class GenerationError(GptlibError, ValueError):
    """generate: bad sampling settings or prompts."""


class ExportError(GptlibError, ValueError):
    """export, import-hf, push: an unusable target or model, or a repository id, token or upload the Hub refused."""
