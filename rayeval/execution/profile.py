"""Where a run's wall time goes: ``rayeval run --profile``.

The driver times its own phases (inputs checked, Ray started, the worker group and process
group started, the fit, Ray shut down); each worker times its own (set-up, checkpoint loads,
passes, the wait for a pass's first batch, reduces, publishes) and hands them to the run
ledger when it is done. ``render`` lays both out, rank 0's figures beside the slowest rank's.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Timer:
    """Named wall-time totals, with how many times each was added to; ``on_doing`` (a
    worker's ledger, ``WorkerLedger.doing``) is told what a span is doing, in words, as
    it begins, so that the driver's progress line can say it while no row moves."""
    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    on_doing: Callable[[str], None] | None = field(default=None, repr=False, compare=False)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + 1

    def doing(self, what: str) -> None:
        """Say what this process is doing now ("starting the vLLM engine")."""
        if self.on_doing is not None:
            self.on_doing(what)

    @contextlib.contextmanager
    def span(self, name: str, doing: str | None = None):
        if doing:
            self.doing(doing)
        began = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - began)

    def as_dict(self) -> dict[str, tuple[float, int]]:
        return {k: (v, self.counts[k]) for k, v in self.seconds.items()}


_COMMAND_START: list[float] = []      # time.monotonic() when the command being run began


def command_started(whole_process: bool) -> None:
    """Mark the start of the command being run: the process's own start where the process
    was started for it (the console script: its interpreter start and imports are the user's
    wait too), else now (a service's run, a command called from Python)."""
    _COMMAND_START[:] = [time.monotonic() - (since_process_start() if whole_process else 0.0)]


def since_command_start() -> float | None:
    """Seconds since the command being run began (``command_started``); None if unmarked."""
    return time.monotonic() - _COMMAND_START[0] if _COMMAND_START else None


def since_process_start() -> float:
    """Seconds since this process started: what imports and start-up took before ``main``.
    On Linux from the process's start and the uptime, both counted from the boot (10 ms
    ticks): psutil's start time adds the boot time, which Linux gives in whole seconds, so
    its age of a process was up to a second off (a run that took 2.50 s said 2.6 s)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])     # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:      # noqa: BLE001 - no psutil, or no access: unknown
        return 0.0


DRIVER_PHASES = (
    ("imports", "python start and imports, to the run (rayeval, pyarrow; torch: later)"),
    ("inputs", "data sets inspected, model probed, store checked, cells planned"),
    ("ray start", "ray.init (a local Ray, or the connection to a cluster)"),
    ("group start", "trainer made, worker and process groups started, to the first loop"),
    ("workers", "the workers' loop, first start to last end"),
    ("fit end", "from the last worker's end to fit() returning"),
    ("ray shutdown", "ray.shutdown"),
)

WORKER_PHASES = (
    ("setup", "worker set-up: model loader, data readers, device mesh"),
    ("load", "checkpoint fetched, loaded and agreed on"),
    ("engine start", "  of which starting the vLLM engine (model.backend: vllm)"),
    ("engine load", "  of which loading the weights into the running engine"),
    ("pass", "passes over the worker's rows (scoring)"),
    ("prefixes", "  of which forward passes over shared prefixes (share_prefixes)"),
    ("suffixes", "  of which forward passes from them over the rest of each request"),
    ("first batch", "  of which waiting for a pass's first batch"),
    ("ray data", "    of which from a Ray Data pipeline (read, preprocessed, split)"),
    ("later batches", "  of which waiting for later batches (reading/decoding not hidden)"),
    ("streamed", "  of which passes that read and decoded their rows (not kept)"),
    ("reduce", "sync and all-reduce of the states"),
    ("publish", "rank 0 writes the cell to the store"),
)


def render(driver: Timer, workers: dict[int, dict[str, tuple[float, int]]],
           total: float) -> list[str]:
    """The profile as lines of text."""
    lines = [f"profile: {total:.1f} s from python start to the end of the run"]
    for name, what in DRIVER_PHASES:
        if name in driver.seconds:
            lines.append(f"  {driver.seconds[name]:7.2f} s  {name:13s} {what}")
        if name == "workers" and workers:
            first = workers.get(0, next(iter(workers.values())))
            lines.append(f"             on the workers ({len(workers)}): rank 0 | slowest rank")
            for phase, label in WORKER_PHASES:
                if not any(phase in w for w in workers.values()):
                    continue
                mine = first.get(phase, (0.0, 0))      # a rank may have had no such work
                slowest = max(w.get(phase, (0.0, 0))[0] for w in workers.values())
                lines.append(f"    {mine[0]:7.2f} s | {slowest:7.2f} s  {phase:11s} x{mine[1]:<4d} "
                             f"{label}")
    return lines
