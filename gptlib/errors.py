"""The errors a user can fix: the message names the file or field, the values and the fix; the command line prints
it as one line (exit status 2). No torch import here, so `tokenize` never loads torch."""

from __future__ import annotations

import sys


def loud(msg: str) -> None:
    """A problem reported, not raised (a failing Drive copy): stderr, red in notebooks, flushed at once."""
    print(msg, file=sys.stderr, flush=True)


class GptlibError(Exception):
    """A problem the user can fix; the message says what and how."""


# One class per kind of problem, for a caller to catch the kind it handles; each says which modules raise it.

class ConfigError(GptlibError, ValueError):
    """config: a configuration value or key."""

class DataFormatError(GptlibError, ValueError):
    """data: a data directory's metadata and files disagree, or a file is missing."""

class TokenizerError(GptlibError, ValueError):
    """tokenizer: a bad tokenizer file, an unknown character, a tokenizer that does not match the data."""

class PrepareError(GptlibError, ValueError):
    """prepare: bad input for tokenize (missing or empty file, missing column, refused output directory)."""

class ChatError(GptlibError, ValueError):
    """chat: a tokenizer without the chat tokens, or a conversation that cannot be rendered."""

class DownloadError(GptlibError, RuntimeError):
    """download: a failed download, or a wrong checksum."""

class CheckpointError(GptlibError, RuntimeError):
    """checkpoint: missing, incomplete, corrupt, or not of this run."""

class RunBusyError(GptlibError):
    """lease: another process holds this run directory or its mirror."""

class RunDirError(GptlibError):
    """lease: the run directory or its mirror cannot be written (read-only, full, not allowed)."""

class LeaseLost(GptlibError):
    """lease: another process took this run over while it trained; this one stopped without saving."""

class HungIOError(GptlibError, OSError):
    """fsutil: an I/O call (a hung Drive) made no progress in its time limit; callers treat it as any OSError."""

class OutOfMemoryAdvice(GptlibError, RuntimeError):
    """training: out of GPU memory; the message names the next setting to try."""

class EvalError(GptlibError, ValueError):
    """evaluation: a bad file, task or option."""

class HFImportError(GptlibError, ValueError):
    """hf_import: a model that is not GPT-2 shaped, has no weights, or a vocabulary that does not fit the data."""

class GenerationError(GptlibError, ValueError):
    """generate: bad sampling settings or prompts."""

class ExportError(GptlibError, ValueError):
    """export: an unusable target (e.g. a non-empty folder without overwrite)."""

class PushError(GptlibError, RuntimeError):
    """share: a repository id, token or upload the Hugging Face Hub refused."""
