"""``rayeval serve``'s guard: the Ray that a service starts goes down with it, however it ends.

A service that exits (Ctrl-C, SIGTERM, ``--stop``) shuts its Ray down itself. One killed
outright (SIGKILL, the OOM killer) cannot, and Ray's dashboard agent and runtime-env agent then
lived on for about a minute after it (61.5 s measured; everything else of Ray went in a few
seconds). So the service starts this process first, its standard input a pipe that only the
service holds. While the service lives, the guard notes the service's descendants (Ray's
daemons, its workers, what they start) every second. When the pipe closes, the service is
gone, whatever ended it: every process noted (the same process: its start time is checked,
not a reused id), and every descendant of those, is sent SIGTERM, then SIGKILL a few seconds
later, and the guard exits. Standard library only: ~10 MB and a few milliseconds a second.

    python -m rayeval.ui.service_guard          # started by the service, its stdin the pipe
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

GRACE_S = 5.0            # after SIGTERM, before SIGKILL
NOTE_S = 1.0             # how often the service's descendants are noted


def processes() -> dict[int, tuple[int, str]]:
    """Every live process: pid -> (parent pid, start time), from /proc (Linux)."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":                       # exited, not reaped: nothing to stop
            found[int(name)] = (int(fields[1]), fields[19])
    return found


def descendants(roots: set[int], table: dict[int, tuple[int, str]]) -> set[int]:
    """The processes of ``table`` below any of ``roots`` (the roots not included)."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    out, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out and child != os.getpid():
                out.add(child)
                todo.append(child)
    return out


def sweep(noted: dict[int, str]) -> None:
    """SIGTERM to the noted processes still running (same start time) and everything below
    them, then SIGKILL to those left after ``GRACE_S``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        table = processes()
        alive = {pid for pid, start in noted.items() if table.get(pid, (0, None))[1] == start}
        left = alive | descendants(alive, table)
        for pid in left:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        noted = {pid: table[pid][1] for pid in left if pid in table}
        deadline = time.monotonic() + GRACE_S
        while noted and time.monotonic() < deadline:
            time.sleep(0.1)
            table = processes()
            noted = {pid: s for pid, s in noted.items() if table.get(pid, (0, None))[1] == s}
        if not noted:
            return


def main() -> None:
    # Ctrl-C in the service's terminal reaches this process too: the service stops its Ray
    # itself then, and this one waits for it to be gone before looking.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    service = os.getppid()
    noted: dict[int, str] = {}
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], NOTE_S)
        if ready and not os.read(sys.stdin.fileno(), 65536):
            break                                  # EOF: the service is gone
        table = processes()
        noted.update({pid: table[pid][1] for pid in descendants({service}, table)})
        noted = {pid: s for pid, s in noted.items() if table.get(pid, (0, None))[1] == s}
    sweep(noted)


if __name__ == "__main__":
    main()
