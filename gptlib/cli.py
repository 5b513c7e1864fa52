"""How `python -m gptlib` declares and runs its commands (gptlib/__main__.py holds them): @command registers
cmd_X with its arguments, run() parses the command line and runs the command asked for; a flag of an earlier release
is answered with its replacement, and an error the user can fix is one line with exit status 2."""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import traceback
from contextlib import suppress

from gptlib import __version__
from gptlib.errors import GptlibError
from gptlib.fsutil import DRIVE_ADVICE

# name -> (help, function, arguments), in the order --help lists them; a second import of __main__ (as a script
# and as gptlib.__main__) registers each command again in its place
COMMANDS: dict[str, tuple] = {}


def arg(*flags: str, **kw) -> tuple:
    """arg("--out", required=True): add_argument("--out", required=True)."""
    return flags, kw


def command(name: str, help: str, *args: tuple, checkpoint: str | None = None):
    """Registers cmd_X(args) as subcommand `name`; checkpoint: the default of --checkpoint (with --run-dir)."""
    if checkpoint:
        args = (
            arg("--run-dir", required=True, metavar="RUN_DIR"),
            arg(
                "--checkpoint",
                default=checkpoint,
                metavar="latest|best|STEP",
                help=f"the newest, the best validation loss, or a step number (default {checkpoint})",
            ),
            *args,
        )

    def register(func):
        COMMANDS[name] = (help, func, args)
        return func

    return register


# What to do about an OSError met outside the places that explain it (none: the error alone, still one line).
OS_FIXES = {
    **dict.fromkeys(
        (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT),
        "free space or choose a writable directory",
    ),
    # Google Drive's mount dropped (Errno 107) or failed a read
    **dict.fromkeys((errno.ENOTCONN, errno.EIO), f"is Google Drive answering? {DRIVE_ADVICE}"),
}

# Flags and commands of earlier releases (CHANGELOG.md): their replacement, not argparse's "unrecognized arguments".
REMOVED = {
    "--save-every-steps": "--set save_every_steps=N",
    "--save-every-minutes": "--set save_every_minutes=M",
    "--keep-last": "--set keep_last=N",
    "bench": "python benchmarks/bench.py (from a clone of the repository)",
}


def run(argv: list[str], detach: bool = False) -> int:
    """The command argv asks for -> its exit status (a command that returns nothing succeeded). detach (`python -m
    gptlib`): a reader of a run's checkpoints (sample, eval, export-hf, ...) runs in a child process (`detached`)."""
    named = [a.split("=")[0] for a in argv[:1] + [a for a in argv if a.startswith("--")]]
    if gone := next((a for a in named if a in REMOVED), None):
        msg = f"error: {gone} is not in gptlib {__version__}: use {REMOVED[gone]} (CHANGELOG.md)"
        print(msg, file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(
        prog="python -m gptlib", description="Train GPT-style models from scratch."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help, func, arguments) in COMMANDS.items():
        p = sub.add_parser(name, help=help, description=f"{help}. {func.__doc__ or ''}")
        p.set_defaults(func=func)
        for flags, kw in arguments:
            p.add_argument(*flags, **kw)
    args = parser.parse_args(argv)
    if detach and hasattr(args, "checkpoint") and hasattr(os, "fork"):
        return detached(lambda: _run(args))
    return _run(args)


def _run(args) -> int:
    try:
        status = args.func(args) or 0
        sys.stdout.flush()  # a reader of the output that has gone is met here, not at the interpreter's exit
        return status
    # Ctrl-C (tokenize said what it keeps): the status of a process stopped by SIGINT
    except KeyboardInterrupt:
        return 130
    # the reader of the output has gone (`... | head -1`): a quiet end, with the status SIGPIPE's would give
    except BrokenPipeError:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            # what is still buffered for the reader that has gone goes nowhere: the last flush must not fail again
            except OSError:
                # (a stream with no file behind it, as a notebook's, is left as it is)
                with suppress(OSError, ValueError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        return 128 + signal.SIGPIPE
    except GptlibError as e:  # the user's to fix (gptlib.errors): one line, exit status 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    # the disk or Drive (full, read-only, a name too long, a dropped mount): one line too
    except OSError as e:
        where, fix = f"{e.filename}: " if e.filename else "", OS_FIXES.get(e.errno)
        print(f"error: {where}{e.strerror or e}" + (f"; {fix}" if fix else ""), file=sys.stderr)
        return 2


def detached(command) -> int:
    """command() in a child process that hands its exit status over before it exits. A read stuck in a hung FUSE mount
    (Google Drive) holds its whole process in the kernel until the mount answers, a daemon thread's too: a reader that
    gave up on it at its deadline could not exit. The child is left to end when the mount answers."""
    status_r, status_w = os.pipe()
    if pid := os.fork():
        os.close(status_w)
        # Ctrl-C reaches the child too (one process group): it answers for both
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if status := os.read(status_r, 1):
            return status[0]
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])  # killed: the shell's 128 + signal
        return code if code >= 0 else 128 - code
    status = 1
    try:
        status = command()
    except BaseException:  # noqa: BLE001 - as Python itself would say it
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with suppress(OSError, ValueError):  # a reader of the output gone (head -1)
                stream.flush()
        os.write(status_w, bytes([status % 256]))
        # the caller's pipes end now, not when a thread stuck in the kernel does
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os._exit(status % 256)
