"""The Colab stop button (SIGINT), Ctrl-C and SIGTERM (runtime shutdown) ask the loop to finish its step and save."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any

from gptlib.errors import loud


class GracefulStop:
    """The first signal only sets `reason`: the loop finishes its step, saves and returns. A second SIGINT raises
    KeyboardInterrupt at once (a loop stuck in validation, say), except inside deferred(), which it waits for, so no
    half update is saved. Handlers install from the main thread only; elsewhere KeyboardInterrupt is as usual.
    What a press does is said through `log` (the user's own press: the normal output); a SIGTERM, loudly."""

    def __init__(self, log=print):
        self.log = log
        self.reason: str | None = None  # "interrupt" | "sigterm" once asked to stop
        self._old: dict[int, Any] = {}
        self.cut = False  # an interrupt cut a deferred() block in two (deferred says when)
        # _interrupted: a second press arrived inside deferred(), raised when it ends
        self._deferring = self._interrupted = False

    def install(self) -> "GracefulStop":
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError, OSError):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.reason is not None:
            if signum == signal.SIGINT and self._deferring:
                self._interrupted = True
                self.log("interrupted again: stopping when the update or save in progress ends")
            elif signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.reason = "sigterm" if signum == signal.SIGTERM else "interrupt"
        if signum == signal.SIGINT:
            self.log(
                "interrupted: finishing this step, saving a checkpoint, then stopping (press stop again to stop at "
                "once: the last complete step is saved)"
            )
        else:
            loud("SIGTERM: finishing this step, saving a checkpoint, then stopping")

    @contextlib.contextmanager
    def deferred(self):
        """A block a second stop press must not cut in two: the press takes effect when it ends. An interrupt that
        cuts it all the same (the handlers could not be installed: training outside the main thread) marks the stop
        `cut`: what the block changed is half done, not to be saved."""
        self._deferring = True
        try:
            yield
        except KeyboardInterrupt:
            self.cut = True
            raise
        finally:
            self._deferring = False
        if self._interrupted:
            self._interrupted = False
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def last_save(self):
        """The run's last save: a stop press waits for it (its thread cannot be stopped mid-write). Then the handlers
        are put back, so that Ctrl-C ends the wait for Drive that follows."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = self._interrupted = False
            self.restore()

    def restore(self) -> None:
        for sig, old in self._old.items():
            if old is not None:
                with contextlib.suppress(ValueError, OSError):
                    signal.signal(sig, old)
        self._old.clear()
