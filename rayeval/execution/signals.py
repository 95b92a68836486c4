"""SIGINT and SIGTERM end a run as one exception, in the main thread, wherever it is.

Ray's core worker installs a native SIGTERM handler when it starts (it prints a stack trace and
dies), and Ray Train v2 installs its own SIGINT handler for a fit run in the main thread and
never takes it away (``compat.trainer_class``), so the handlers are installed again once Ray is
up and at the start of every fit (``lifecycle.RayLifecycle.following``), and the fit's progress
loop puts them back if anything replaced them (``ensure``). Both signals raise ``Interrupted``
(a KeyboardInterrupt), which unwinds through the driver's ``finally`` blocks: the worker group
and Ray are shut down, temporary files of unfinished cells removed, and the CLI prints one line
and exits 128 + the signal number.

One rule, whatever the phase (docs/cluster.md): a signal is never ignored. Until rayeval has
written its output it ends the command with 128 + the signal number and the one line; what
was published before it stays, whole; what is being written when it lands is finished first
(``held``: a teardown, the end-of-run steps, the board) or not begun.
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


_last: list[int] = []            # the signal ``_raise`` took last (see ``interrupted``)


def _raise(signum, frame):
    _last[:] = [signum]
    raise Interrupted(signum)


def install() -> None:
    """Route SIGINT and SIGTERM to ``Interrupted`` (only the main thread can)."""
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _raise)


def ensure() -> None:
    """``install`` again if anything replaced rayeval's handlers (called while a fit is
    followed: a tracker's or a library's handler set on the main thread mid-run would
    otherwise take the signals)."""
    if threading.current_thread() is threading.main_thread() and any(
            signal.getsignal(s) is not _raise for s in (signal.SIGINT, signal.SIGTERM)):
        install()


def interrupted(error: KeyboardInterrupt) -> Interrupted:
    """The ``Interrupted`` a KeyboardInterrupt stands for. A signal that lands while the main
    thread waits inside Ray's client (``ray.get``) runs ``_raise`` there, but Ray catches the
    exception and raises a bare ``KeyboardInterrupt()`` in its place (ray 2.60, _raylet.pyx:
    ``check_signals`` turns it into ``CRayStatus.Interrupted``, ``check_status`` raises
    ``KeyboardInterrupt()``): the signal is then the one ``_raise`` took last, so a SIGTERM
    still exits 143."""
    if isinstance(error, Interrupted):
        return error
    return Interrupted(_last[0] if _last else signal.SIGINT)


@contextlib.contextmanager
def held():
    """SIGINT and SIGTERM wait until the block (a teardown) is done, then take effect."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    unwinding = sys.exc_info()[0] is not None    # already stopping: the first reason stands
    received: list[int] = []

    def note(signum, frame):
        received.append(signum)
        _last[:] = [signum]

    previous = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
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
    return interrupted(error).exit_code


def name(error: KeyboardInterrupt) -> str:
    """"SIGINT" or "SIGTERM": the signal behind ``error`` (see ``interrupted``)."""
    return interrupted(error).name
