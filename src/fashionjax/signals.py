"""SIGINT and SIGTERM: stop at once while nothing is at stake, at a safe point while training.

Imports nothing heavy, so the CLI can install the handlers before it imports JAX: a Ctrl-C during
start-up then ends the command cleanly (exit 130/143), never with a traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """A signal stopped the command; `step` is the checkpointed step when training had begun. `agreed`:
    every process of a multi-process run stops here too (they agreed on it at a chunk end)."""

    def __init__(self, signum: int, step: int | None = None, agreed: bool = False):
        super().__init__(signum, step)
        self.signum = signum
        self.step = step
        self.agreed = agreed
        self.outcome: str | None = None  # what the interrupt left behind, said by whoever knows

    def __str__(self) -> str:
        where = "" if self.step is None else f" at step {self.step}"
        outcome = f"; {self.outcome}" if self.outcome else ""
        return f"interrupted by {signal.Signals(self.signum).name}{where}{outcome}"


def interruption(err: BaseException) -> Interrupted | None:
    """The Interrupted that `err` is or was raised from, if any. A signal raises it wherever the
    command happens to be, and some places wrap what they catch: Python 3.11 turns an exception in
    a class's __set_name__ (matplotlib's classes, while being imported) into a RuntimeError."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, Interrupted):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


class StopRequests:
    """Handlers for SIGINT/SIGTERM, installed for the life of a command.

    Immediate mode (the default) raises Interrupted from the handler. Inside `deferred()` (training
    chunks and checkpoint writes) the first signal only records a request, which the trainer honours
    at the next chunk end after checkpointing. Any later signal is reported and ignored: a second
    Ctrl-C never tears a checkpoint write in half.
    """

    def __init__(self, note: Callable[[str], None] = lambda message: None):
        self.signum: int | None = None
        self.note = note
        self._deferred = 0
        self._previous: dict[int, object] = {}
        self._previous_hook = None

    def install(self) -> StopRequests:
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may set handlers; the caller's own stay in charge
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self._previous_hook is not None:
            sys.unraisablehook = self._previous_hook
            self._previous_hook = None

    def _unraisable(self, unraisable) -> None:
        """A signal that landed in a garbage-collection callback or a __del__ cannot stop the command
        from there (Python would print it and go on): deliver it again a moment later instead."""
        if isinstance(unraisable.exc_value, Interrupted):
            self.signum = None
            threading.Timer(0.01, os.kill, (os.getpid(), unraisable.exc_value.signum)).start()
            return
        self._previous_hook(unraisable)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            self.note("already stopping: finishing the checkpoint first (kill -9 would lose the work since the last one)")
            return
        self.signum = signum
        if self._deferred:
            self.note(f"{signal.Signals(signum).name}: stopping at the next chunk end (with a checkpoint once training has begun)")
        else:
            raise Interrupted(signum)

    @contextlib.contextmanager
    def deferred(self):
        """Signals inside this block only request a stop; see `pending`."""
        self._deferred += 1
        try:
            yield self
        finally:
            self._deferred -= 1

    def pending(self) -> int | None:
        """The signal that asked for a stop, if any (the trainer polls this at chunk ends)."""
        return self.signum

    def raise_pending(self, step: int | None = None) -> None:
        """Leave now if a deferred signal arrived (called where stopping is safe again)."""
        if self.signum is not None:
            raise Interrupted(self.signum, step)
