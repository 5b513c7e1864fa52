"""The errors a user can fix; each message names the file or field, the values and the fix. The command line prints
a GptlibError as one line (exit status 2). No gptlib or torch import here, so `tokenize` never loads torch."""

from __future__ import annotations

import sys


def loud(msg: str) -> None:
    """Problems reported but not raised (a failing Drive copy): stderr, red in notebooks, flushed at once."""
    print(msg, file=sys.stderr, flush=True)


class GptlibError(Exception):
    """A problem the user can fix; the message says what and how."""


class ConfigError(GptlibError, ValueError):
    """config: a configuration value or key is invalid; the message names the field and the value."""


class DataFormatError(GptlibError, ValueError):
    """shards/data: the data directory's metadata and files disagree, or a file is missing."""


class TokenizerError(GptlibError, ValueError):
    """tokenizer: a bad tokenizer file, an unknown character, or a tokenizer that does not match the data."""


class PrepareError(GptlibError, ValueError):
    """sources/prepare: bad input for tokenize (missing/empty file, missing column, refused output directory)."""


class ChatError(GptlibError, ValueError):
    """chat: a tokenizer without the chat tokens, or a conversation that cannot be rendered."""


class DownloadError(GptlibError, RuntimeError):
    """download: a file could not be downloaded, or its checksum is not the expected one."""


class CheckpointError(GptlibError, RuntimeError):
    """checkpoint/loading: a checkpoint is missing, incomplete, corrupt, or does not match the run."""


class RunBusyError(GptlibError):
    """lease: another process holds this run directory or mirror; the message names it and how to take over."""


class RunDirError(GptlibError):
    """lease: the run directory (or mirror) cannot be written: read-only, full, or not allowed."""


class LeaseLost(GptlibError):
    """lease: another process took over this run while it trained; this one stopped without saving."""


class HungIOError(GptlibError, OSError):
    """fsutil: an I/O call made no progress for its time limit (a hung Drive mount) and was abandoned. An
    OSError, so callers that fall back on I/O errors fall back on this too."""


class OutOfMemoryAdvice(GptlibError, RuntimeError):
    """memory/train: out of GPU memory; the message names the next setting to try."""


class EvalError(GptlibError, ValueError):
    """scoring/hellaswag/evaluate: bad evaluation input (file, task, option), naming the file, line or field."""


class HFImportError(GptlibError, ValueError):
    """hf_import/session: a model that cannot be imported or started from (not GPT-2 shaped, no weights,
    a vocabulary that does not fit the data); the message names what differs."""


class GenerationError(GptlibError, ValueError):
    """generate: bad sampling settings or prompts; the message names the setting and the value."""


class ExportError(GptlibError, ValueError):
    """export: the export target is unusable (e.g. a non-empty folder without overwrite)."""


class PushError(GptlibError, RuntimeError):
    """share: a repository id, token or upload the Hugging Face Hub refused; the message says what to do."""


class ColabError(GptlibError, RuntimeError):
    """colab: Drive could not be mounted or used; the message says what to do."""
