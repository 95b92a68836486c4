"""Where a run stands, from the workers to the driver's screen.

One small ``Tracker`` actor, owned by the driver, outlives worker-group restarts. The workers
tell it how many rows they have done in the checkpoint in flight (throttled, fire-and-forget)
and rank 0 tells it each finished cell with its outcome. The driver reads it to draw progress,
and a restarted group reads it to go on from the first unfinished checkpoint.

The display is a rich progress bar on a terminal, plain periodic lines otherwise (CI, Ray Job
logs), or nothing (``--quiet``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rayeval.plan.cells import Plan


class Tracker:
    """Plain Python state; the driver runs it as a Ray actor with ``ray.remote``."""

    def __init__(self, cells: list[tuple[str, str, int]]):
        self.cells = list(cells)                  # (key, checkpoint location, rows), plan order
        self.outcomes: dict = {}                  # key -> CellOutcome of a finished cell
        self.errors: dict[str, tuple] = {}        # key -> the first rank's (error, traceback)
        self.loads: dict[tuple[int, str], int] = {}   # (rank, checkpoint) -> loads
        self.in_flight: dict[int, tuple[int, int]] = {}   # rank -> (cell index, rows done)
        self.attempts = 0
        self.stop_requested = False               # the driver was interrupted: wind down
        self.problems: list[str] = []             # what failed the earlier attempts
        self.fatal_error: Exception | None = None  # bad input: a restart would fail again
        self.nodes: dict[int, str] = {}           # rank -> node id, the latest attempt's
        self.times: dict[int, dict] = {}          # rank -> its loop's timing (--profile)
        self.queue: list = []                     # standing group: (index, Cell) to evaluate
        self.taken: list = []                     # handed to the group, maybe unfinished
        self.closed = False                       # standing group: no more cells will come
        self.phases: dict[int, str] = {}          # rank -> where it is, this attempt (a loss
                                                  # says it: ``recovery``)

    def start_attempt(self) -> int:
        self.attempts += 1
        self.in_flight.clear()      # the nodes are not cleared: another rank may have said hello
        self.phases.clear()
        # A standing group (watch) that restarts takes again the cells it had not finished.
        self.queue = [c for c in self.taken if c[1] not in self.outcomes] + self.queue
        self.taken = []
        return self.attempts

    # --- a standing worker group (``rayeval watch``): cells are fed while it runs ----------

    def add_cells(self, cells: list[tuple[str, str, int]], pending: list[bytes]) -> None:
        """More cells for the standing group: (key, location, rows) for progress, and the
        plan's ``Cell`` objects pickled (this actor never unpickles them: that would import
        the plan's modules, torch among them), queued in order."""
        for meta, blob in zip(cells, pending):
            self.queue.append((len(self.cells), meta[0], blob))
            self.cells.append(meta)

    def take(self):
        """The queued cells as (index, pickled Cell) pairs (rank 0 of the standing group
        asks), [] when none is queued, or None when the group is to stop (the feed closed, or
        a signal)."""
        if self.stop_requested or (self.closed and not self.queue):
            return None
        batch, self.queue = self.queue, []
        self.taken += batch
        return [(index, blob) for index, _, blob in batch]

    def close(self) -> None:
        """No more cells: the standing group ends once the queue is empty."""
        self.closed = True

    def finished(self, keys: list[str]) -> bool:
        return all(k in self.outcomes for k in keys)

    def hello(self, rank: int, node: str) -> None:
        self.nodes[rank] = node

    def node_count(self) -> int:
        return len(set(self.nodes.values()))

    def get_attempts(self) -> int:
        return self.attempts

    def done_keys(self) -> list[str]:
        return list(self.outcomes)

    def rows(self, rank: int, index: int, rows: int) -> bool:
        """Rows done by a rank in the cell in flight; answers whether to stop."""
        self.in_flight[rank] = (index, rows)
        return self.stop_requested

    def stop(self) -> None:
        self.stop_requested = True

    def stopping(self) -> bool:
        return self.stop_requested

    def phase(self, rank: int, where: str) -> None:
        self.phases[rank] = where

    def phase_of(self, rank: int) -> str | None:
        return self.phases.get(rank)

    def cell_error(self, key: str, message: str, detail: str | None = None) -> None:
        if key not in self.errors:
            self.errors[key] = (message, detail)

    def error_of(self, key: str) -> tuple[str, str | None] | None:
        """The first rank's (message, user traceback) for a cell, or None."""
        return self.errors.get(key)

    def loaded(self, rank: int, location: str) -> None:
        self.loads[(rank, location)] = self.loads.get((rank, location), 0) + 1

    def load_counts(self) -> dict[tuple[int, str], int]:
        return dict(self.loads)

    def finish(self, key: str, outcome) -> None:
        self.outcomes[key] = outcome
        for rank, (index, _) in list(self.in_flight.items()):
            if self.cells[index][0] == key:
                del self.in_flight[rank]

    def problem(self, message: str) -> None:
        if message not in self.problems:
            self.problems.append(message)

    def fatal(self, error: Exception) -> None:
        if self.fatal_error is None:
            self.fatal_error = error

    def get_fatal(self) -> Exception | None:
        return self.fatal_error

    def results(self) -> dict:
        return dict(self.outcomes)

    def timing(self, rank: int, entered: float, left: float, phases: dict) -> None:
        """A rank's wall-clock entry to and exit from its loop, and its phases (--profile)."""
        self.times[rank] = {"entered": entered, "left": left, "phases": phases}

    def timings(self) -> dict:
        return dict(self.times)

    def snapshot(self) -> dict:
        current = [i for i, _ in self.in_flight.values()
                   if self.cells[i][0] not in self.outcomes]
        return {
            "total": len(self.cells),
            "done": len(self.outcomes),
            "failed": sum(1 for o in self.outcomes.values() if not o.ok),
            "rows_done": sum(rows for key, _, rows in self.cells if key in self.outcomes),
            "rows_in_flight": sum(r for i, r in self.in_flight.values()
                                  if self.cells[i][0] not in self.outcomes),
            "rows_total": sum(rows for _, _, rows in self.cells),
            "current": self.cells[min(current)][1] if current else None,
            "attempts": self.attempts,
            "problems": list(self.problems),
        }


class WorkerProgress:
    """A worker's side of the tracker; every call is a no-op without one."""

    INTERVAL_S = 0.5

    def __init__(self, tracker, rank: int):
        self.tracker = tracker
        self.rank = rank
        self._last = 0.0
        self._answer = None          # the tracker's reply to the last rows report
        self._stop = False

    def _get(self, ref, timeout: float = 30.0):
        import ray

        return ray.get(ref, timeout=timeout)

    def start(self) -> tuple[int, set[str], Exception | None]:
        """(this attempt's number, keys of cells already finished, an earlier attempt's fatal
        error). Rank 0 opens the attempt; the others only read."""
        if self.tracker is None:
            return 1, set(), None
        if self.rank == 0:
            attempt = self._get(self.tracker.start_attempt.remote())
        else:
            attempt = self._get(self.tracker.get_attempts.remote())
        import ray

        self._get(self.tracker.hello.remote(self.rank, ray.get_runtime_context().get_node_id()))
        return (attempt, set(self._get(self.tracker.done_keys.remote())),
                self._get(self.tracker.get_fatal.remote()))

    def rows(self, index: int, rows: int, force: bool = False) -> None:
        """Report rows done (throttled); the answer of the previous report says whether the
        driver asked the group to stop (read by ``stopping``)."""
        now = time.monotonic()
        if self.tracker is not None and (force or now - self._last >= self.INTERVAL_S):
            self._last = now
            if self._answer is not None:
                self._take_answer()
            self._answer = self.tracker.rows.remote(self.rank, index, rows)

    def _take_answer(self) -> None:
        import ray

        ready, _ = ray.wait([self._answer], timeout=0)
        if ready:
            self._stop = self._stop or bool(ray.get(ready[0]))
            self._answer = None

    def stopping(self) -> bool:
        """Whether the driver asked the group to stop (SIGINT/SIGTERM): never blocks."""
        if self.tracker is not None and self._answer is not None:
            self._take_answer()
        return self._stop

    def finish(self, key: str, outcome) -> None:
        if self.tracker is not None:
            self._get(self.tracker.finish.remote(key, outcome))

    def attempt(self) -> int:
        """The attempt the tracker has open now (1 without one)."""
        return self._get(self.tracker.get_attempts.remote()) if self.tracker is not None else 1

    def phase(self, where: str):
        """Where this rank is (``during the pass over ...``), for the error if it is lost:
        fire-and-forget; the reference is returned for the one caller that must wait."""
        if self.tracker is not None:
            return self.tracker.phase.remote(self.rank, where)
        return None

    def take(self):
        """Rank 0 of a standing group: the next cells (see ``Tracker.take``)."""
        return self._get(self.tracker.take.remote())

    def timing(self, entered: float, left: float, phases: dict) -> None:
        if self.tracker is not None:
            self._get(self.tracker.timing.remote(self.rank, entered, left, phases), 5.0)

    def loaded(self, location: str) -> None:
        if self.tracker is not None:
            self.tracker.loaded.remote(self.rank, location)

    def cell_error(self, key: str, message: str, detail: str | None = None) -> None:
        """This rank's error in a cell (and the user's traceback behind it, for --debug), for
        rank 0 to publish (before the cell's reduce)."""
        if self.tracker is not None:
            self._get(self.tracker.cell_error.remote(key, message, detail))

    def error_of(self, key: str) -> tuple[str, str | None]:
        """The (message, traceback) another rank recorded for a cell; (None, None) if none."""
        found = self._get(self.tracker.error_of.remote(key)) if self.tracker is not None \
            else None
        return found or (None, None)

    def problem(self, message: str) -> None:
        """Say why this attempt is failing, before the error takes the group down."""
        if self.tracker is not None:
            try:
                self._get(self.tracker.problem.remote(f"rank {self.rank}: {message}"), 5.0)
            except Exception:   # noqa: BLE001 - the original error matters more
                pass

    def fatal(self, error: Exception) -> None:
        if self.tracker is not None:
            try:
                self._get(self.tracker.fatal.remote(error), 5.0)
            except Exception:   # noqa: BLE001
                pass


@dataclass
class Status:
    """What the display shows, derived from a tracker snapshot."""
    total: int
    done: int
    failed: int
    current: str | None
    rows_per_s: float | None
    eta_s: float | None
    fraction: float           # of all rows to evaluate in this run
    attempts: int
    problems: list[str]


class Rate:
    """Rows per second over the last ``window_s`` of snapshots, else since the workers began."""

    def __init__(self, window_s: float = 20.0):
        self.window_s = window_s
        self.samples: list[tuple[float, int]] = []
        self.began: float | None = None        # the first snapshot with the workers up

    def status(self, snap: dict, now: float) -> Status:
        total_rows = snap["rows_total"]
        processed = min(snap["rows_done"] + snap["rows_in_flight"], total_rows)
        if snap["attempts"] and self.began is None:
            self.began = now
        if processed:             # start-up time is not part of the rate
            self.samples.append((now, processed))
        while len(self.samples) > 2 and now - self.samples[1][0] > self.window_s:
            self.samples.pop(0)
        (t0, r0), (t1, r1) = (self.samples[0], self.samples[-1]) if self.samples else \
            ((now, 0), (now, 0))
        rate, measured = None, False
        if t1 > t0 and r1 > r0:
            rate, measured = (r1 - r0) / (t1 - t0), True
        elif self.began is not None and now > self.began and processed:
            rate = processed / (now - self.began)
        left = total_rows - processed
        # The time left only from a rate measured between two snapshots: the average since the
        # workers began still holds their start-up (the first read, the first load)
        # and once promised ~52 hours for a minute's work.
        eta = 0.0 if left == 0 else (left / rate if rate and measured else None)
        return Status(total=snap["total"], done=snap["done"], failed=snap["failed"],
                      current=snap["current"], rows_per_s=rate, eta_s=eta,
                      fraction=processed / total_rows if total_rows else 1.0,
                      attempts=snap["attempts"], problems=snap["problems"])


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def fmt_rate(rate: float | None) -> str:
    if rate is None:
        return "? rows/s"
    return f"{rate / 1000:,.1f}k rows/s" if rate >= 10_000 else f"{rate:,.0f} rows/s"


def short(location: str | None) -> str:
    return location.rstrip("/").rsplit("/", 1)[-1] if location else "-"


def line(s: Status, elapsed: float) -> str:
    """One plain progress line."""
    if s.attempts == 0:
        return f"[rayeval] starting the worker group, elapsed {fmt_duration(elapsed)}"
    parts = [f"[rayeval] {s.done}/{s.total} cells", f"{s.fraction:.0%} of rows",
             fmt_rate(s.rows_per_s), f"elapsed {fmt_duration(elapsed)}",
             f"left ~{fmt_duration(s.eta_s)}"]
    if s.failed:
        parts.insert(1, f"{s.failed} failed")
    if s.current:
        parts.append(f"now {short(s.current)}")
    return ", ".join(parts)


class LineDisplay:
    """Periodic plain lines, for logs."""

    def __init__(self, stream=None, interval_s: float = 10.0):
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.last = -float("inf")
        self.attempts_seen = 1
        self.problems_seen = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def say(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def update(self, s: Status, elapsed: float, final: bool = False) -> None:
        for p in s.problems[self.problems_seen:]:
            self.say(f"[rayeval] worker failure: {p}")
        self.problems_seen = len(s.problems)
        if s.attempts > self.attempts_seen:
            self.attempts_seen = s.attempts
            self.say(f"[rayeval] worker group restarted (attempt {s.attempts}); going on from "
                     f"the first unfinished checkpoint")
        finished = s.total > 0 and s.done == s.total
        if final or (elapsed - self.last >= self.interval_s and not finished):
            self.last = elapsed            # (the final line reports a finished run, once)
            self.say(line(s, elapsed))


class RichDisplay(LineDisplay):
    """A live progress bar on a terminal; restarts and failures print above it."""

    def __init__(self, console):
        super().__init__()
        from rich.progress import BarColumn, Progress, TextColumn

        self.console = console
        self.bar = Progress(TextColumn("[bold]{task.fields[cells]}"), BarColumn(),
                            TextColumn("{task.percentage:>3.0f}%  {task.fields[rate]}  "
                                       "elapsed {task.fields[elapsed]}  left ~{task.fields[eta]}"
                                       "  {task.fields[now]}"),
                            console=console, transient=False)
        self.task = self.bar.add_task("eval", total=1.0, cells="", rate="", elapsed="",
                                      eta="", now="")

    def __enter__(self):
        self.bar.start()
        return self

    def __exit__(self, *exc):
        self.bar.stop()
        return False

    def say(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    def update(self, s: Status, elapsed: float, final: bool = False) -> None:
        self.last = elapsed     # the bar is always current: no periodic lines
        super().update(s, elapsed, final=False)
        failed = f" ({s.failed} failed)" if s.failed else ""
        self.bar.update(self.task, completed=s.fraction,
                        cells=f"{s.done}/{s.total} cells{failed}",
                        rate=fmt_rate(s.rows_per_s), elapsed=fmt_duration(elapsed),
                        eta=fmt_duration(s.eta_s),
                        now=f"now {short(s.current)}" if s.current else "")


class NullDisplay(LineDisplay):
    def say(self, text: str) -> None:
        pass


def make_display(mode: str, console=None, interval_s: float = 10.0):
    """``mode``: "auto" (rich on a terminal, lines otherwise), "lines", or "quiet"."""
    if mode == "quiet":
        return NullDisplay()
    if mode == "auto" and console is not None and console.is_terminal:
        return RichDisplay(console)
    return LineDisplay(interval_s=interval_s)


# --- rayeval.run's progress argument (the Python API and Ray Train validation) -------------

def console_say(progress):
    """Where the trackers' summary lines go: nowhere without ``progress``."""
    if progress is False or progress is None:
        return None
    from rich.console import Console

    console = progress if isinstance(progress, Console) else \
        Console(stderr=True, highlight=False)
    return lambda text: console.print(text, markup=False, highlight=False, soft_wrap=True)


def console_display(progress):
    """The display and the plan callback for ``run``'s ``progress`` argument."""
    if progress is False or progress is None:
        return None, None
    from rich.console import Console

    if progress is not True and not isinstance(progress, Console):
        raise TypeError(f"progress: expected a bool or a rich Console, got "
                        f"{type(progress).__name__}")
    console = progress if isinstance(progress, Console) else \
        Console(stderr=True, highlight=False)

    def say(plan: Plan) -> None:
        console.print(plan_line(plan), markup=False, highlight=False, soft_wrap=True)

    return make_display("auto", console), say


def plan_line(plan: Plan) -> str:
    """The line that says what a run will do, before it starts: checkpoints, evaluations,
    cells, how many the store holds and how many are left."""
    checkpoints = len({c.checkpoint.location for c in plan.cells + plan.cached}
                      | {o.checkpoint for o in plan.failed})
    evals = ", ".join(f"{e.name} ({e.data.num_rows} rows)" for e in plan.evaluations)
    total = len(plan.cells) + len(plan.cached) + len(plan.failed)
    failed = f", {len(plan.failed)} failed before any worker" if plan.failed else ""
    return (f"[rayeval] {plan.sweep.name}: {checkpoints} checkpoint(s) x "
            f"{len(plan.evaluations)} evaluation(s) [{evals}]: {total} cell(s), "
            f"{len(plan.cached)} already in the store{failed}, {len(plan.cells)} to evaluate")
