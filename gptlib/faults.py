"""Fault injection for tests: kill, stop or break the process at named points of training and saving.

Unset in normal use (one environment lookup per call). The resume and fault tests set
GPTLIB_FAULT="ACTION:POINT[@STEP],..." to act when execution reaches POINT (at STEP):

ACTION: kill (SIGKILL this process), term (SIGTERM), interrupt (raise KeyboardInterrupt),
enospc / eio / enotconn (raise that OSError), hang (block for an hour), slow (sleep 50 ms, every time).
POINT: mid_step (train loop, between backward and the optimizer step), save_mid (model.pt written,
no manifest yet), after_rename (checkpoint renamed, rotation not yet run), rotate_mid (one file of
an old checkpoint deleted; STEP is the deleted checkpoint's), mirror_mid (Drive copy half done).
"""

from __future__ import annotations

import errno
import os
import signal
import time

_ERRNO = {"enospc": errno.ENOSPC, "eio": errno.EIO, "enotconn": errno.ENOTCONN}
_SIGNAL = {"kill": signal.SIGKILL, "term": signal.SIGTERM}
_SLEEP_S = {"kill": 10, "hang": 3600, "slow": 0.05}  # kill: the signal arrives asynchronously; never run past it


def fault_point(name: str, step: int | None = None) -> None:
    """Act on GPTLIB_FAULT if it names this point (and step); a no-op otherwise."""
    spec = os.environ.get("GPTLIB_FAULT")
    if not spec:
        return
    for item in spec.split(","):
        action, _, rest = item.strip().partition(":")
        point, _, at = rest.partition("@")
        if point != name or (at and step is not None and int(at) != step):
            continue
        if action in _SIGNAL:
            os.kill(os.getpid(), _SIGNAL[action])
        if action == "interrupt":
            raise KeyboardInterrupt(f"GPTLIB_FAULT {item}")
        if action in _ERRNO:
            raise OSError(_ERRNO[action], os.strerror(_ERRNO[action]))
        if action in _SLEEP_S:
            time.sleep(_SLEEP_S[action])
