"""SIGINT and SIGTERM end a run as one exception, in the main thread, wherever it is.

Ray's core worker installs a native SIGTERM handler when it starts (it prints a stack trace and
dies), so the handlers are installed again once Ray is up. Both signals raise ``Interrupted``
(a KeyboardInterrupt), which unwinds through the driver's ``finally`` blocks: the worker group
and Ray are shut down, temporary files of unfinished cells removed, and the CLI prints one line
and exits 128 + the signal number.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


class Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise(signum, frame):
    raise Interrupted(signum)


def install() -> None:
    """Route SIGINT and SIGTERM to ``Interrupted`` (only the main thread can)."""
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _raise)


@contextlib.contextmanager
def held():
    """SIGINT and SIGTERM wait until the block (a teardown) is done, then take effect."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    unwinding = sys.exc_info()[0] is not None    # already stopping: the first reason stands
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received and not unwinding:
        raise Interrupted(received[0])


@contextlib.contextmanager
def restored():
    """SIGINT's and SIGTERM's handlers as they were before the block (a run from the Python
    API installs rayeval's once Ray is up). A handler set outside Python cannot be put back."""
    saved = {} if threading.current_thread() is not threading.main_thread() else \
        {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:
                signal.signal(signum, handler)


def exit_code(error: KeyboardInterrupt) -> int:
    return getattr(error, "exit_code", 128 + signal.SIGINT)
