"""The terminal display of a run: the plan line, then a rich progress bar on a terminal, plain
periodic lines otherwise (CI, Ray Job logs), or nothing (``--quiet``), fed by the run's
callbacks (``DisplayCallback``, ``PlanLine``) from the run ledger's snapshots.

Cheap to import (the CLI's start-up): rich is imported when a console is made.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from rayeval.config import constants
from rayeval.execution.callbacks import RunCallback

if TYPE_CHECKING:
    from rayeval.plan.cells import Plan


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
    doing: str | None = None  # what the workers are doing while no row moves, in words
    doing_s: float = 0.0      # and for how long


STILL_S = 3.0      # rows unmoved this long: the line says what the workers are doing instead
                   # of a rate (snapshots come every 0.5 s; a pass's batches, faster than this)


class Rate:
    """Rows per second over the last ``window_s`` of snapshots, else since the workers began;
    and, while no row moves, what the workers say they are doing."""

    def __init__(self, window_s: float = 20.0, still_s: float = STILL_S):
        self.window_s = window_s
        self.still_s = still_s
        self.samples: list[tuple[float, int]] = []
        self.began: float | None = None        # the first snapshot with the workers up
        self.moved: tuple[float, int] | None = None   # when the rows last moved, and to what

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
        doing, doing_s = self.doing(snap, processed, now)
        return Status(total=snap["total"], done=snap["done"], failed=snap["failed"],
                      current=snap["current"], rows_per_s=rate, eta_s=eta,
                      fraction=processed / total_rows if total_rows else 1.0,
                      attempts=snap["attempts"], problems=snap["problems"],
                      doing=doing, doing_s=doing_s)

    def doing(self, snap: dict, processed: int, now: float) -> tuple[str | None, float]:
        """The workers' activity (the tracker's longest) when no row has moved yet, or none
        for ``still_s``; else (None, 0)."""
        if self.moved is None or self.moved[1] != processed:
            self.moved = (now, processed)
        activity = snap.get("activity")
        if not activity or (processed and now - self.moved[0] < self.still_s):
            return None, 0.0
        return activity[0], activity[1]


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


def fmt_doing(s: Status) -> str | None:
    """What the workers are doing while no row moves ("starting the vLLM engine for 0:41"),
    or None while rows move."""
    return f"{s.doing} for {fmt_duration(s.doing_s)}" if s.doing else None


def short(location: str | None) -> str:
    return location.rstrip("/").rsplit("/", 1)[-1] if location else "-"


def line(s: Status, elapsed: float) -> str:
    """One plain progress line."""
    if s.attempts == 0:
        return f"[rayeval] starting the worker group, elapsed {fmt_duration(elapsed)}"
    parts = [f"[rayeval] {s.done}/{s.total} cells", f"{s.fraction:.0%} of rows",
             fmt_doing(s) or fmt_rate(s.rows_per_s), f"elapsed {fmt_duration(elapsed)}",
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
                        rate=fmt_doing(s) or fmt_rate(s.rows_per_s),
                        elapsed=fmt_duration(elapsed),
                        eta=fmt_duration(s.eta_s),
                        now=f"now {short(s.current)}" if s.current else "")


class NullDisplay(LineDisplay):
    def say(self, text: str) -> None:
        pass


def make_display(mode: str, console=None, interval_s: float | None = None):
    """``mode``: "auto" (rich on a terminal, lines otherwise), "lines", or "quiet";
    ``interval_s``: between plain lines (default RAYEVAL_PROGRESS_INTERVAL_S, else 10)."""
    if mode == "quiet":
        return NullDisplay()
    if mode == "auto" and console is not None and console.is_terminal:
        return RichDisplay(console)
    return LineDisplay(interval_s=constants.progress_interval_s() if interval_s is None
                       else interval_s)


# --- rayeval.run's progress argument (the Python API and Ray Train validation) -------------

def console_say(progress):
    """Where the trackers' summary lines go: nowhere without ``progress``."""
    if progress is False or progress is None:
        return None
    from rich.console import Console

    console = progress if isinstance(progress, Console) else \
        Console(stderr=True, highlight=False)
    return lambda text: console.print(text, markup=False, highlight=False, soft_wrap=True)


def console_callbacks(progress) -> list[RunCallback]:
    """The plan line and the progress display for ``run``'s ``progress`` argument."""
    if progress is False or progress is None:
        return []
    from rich.console import Console

    if progress is not True and not isinstance(progress, Console):
        raise TypeError(f"progress: expected a bool or a rich Console, got "
                        f"{type(progress).__name__}")
    console = progress if isinstance(progress, Console) else \
        Console(stderr=True, highlight=False)
    say = lambda text: console.print(text, markup=False, highlight=False,  # noqa: E731
                                     soft_wrap=True)
    display = make_display("auto", console)
    return [PlanLine(say), DisplayCallback(lambda: display)]


def plan_line(plan: Plan) -> str:
    """The line that says what a run will do, before it starts: checkpoints, evaluations,
    cells, how many the store holds and how many are left."""
    checkpoints = len({c.checkpoint.location for c in plan.cells + plan.cached}
                      | {o.checkpoint for o in plan.failed})
    evals = ", ".join(f"{e.name} ({e.data.num_rows} rows{_source(e)})"
                      for e in plan.evaluations)
    total = len(plan.cells) + len(plan.cached) + len(plan.failed)
    failed = f", {len(plan.failed)} failed before any worker" if plan.failed else ""
    return (f"[rayeval] {plan.sweep.name}: {checkpoints} checkpoint(s) x "
            f"{len(plan.evaluations)} evaluation(s) [{evals}]: {total} cell(s), "
            f"{len(plan.cached)} already in the store{failed}, {len(plan.cells)} to evaluate"
            + reused_generations(plan) + resumed_cells(plan))


def resumed_cells(plan: Plan) -> str:
    """Cells in progress that an earlier run saved (``resume``): they score only the rest."""
    resumed = [c for c in plan.cells if c.resume]
    if not resumed:
        return ""
    rows = {e.name: e.data.num_rows for e in plan.evaluations}
    share = sum(c.saved_rows for c in resumed) / max(1, sum(rows[c.evaluation] for c in resumed))
    cells = f"{len(resumed)} cell" + ("s" if len(resumed) != 1 else "")
    return f"; {cells} resumed from {share:.0%} of their rows (--force starts them over)"


def reused_generations(plan: Plan) -> str:
    """Judged cells whose generations the store keeps (only their judge runs), in words."""
    judged = [c for c in plan.cells if c.generation]
    reused = sum(1 for c in judged if c.generated)
    if not judged:
        return ""
    return (f" ({reused} of {len(judged)} judged cell(s) reuse stored generations: only "
            "their judge runs)" if reused else "")


def _source(e) -> str:
    """How an evaluation's rows reach the workers, when not straight from local parquet."""
    if not e.data.via_ray_data(e.spec.dataset):
        return ""
    return f", {e.data.format} through Ray Data"


# --- the display as callbacks of a run ------------------------------------------------------

class PlanLine(RunCallback):
    """The plan line, once the plan is made."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say

    def on_plan(self, plan: Plan) -> None:
        self.say(plan_line(plan))


class DisplayCallback(RunCallback):
    """A display (``make_display``) shown while a fit is followed: ``make()`` gives the one
    for each fit (None: nothing shown), drawn from the run ledger's snapshots."""

    def __init__(self, make: Callable[[], object]):
        self.make = make
        self.display = None
        self.rate: Rate | None = None

    def on_fit_start(self) -> None:
        self.display = self.make() or NullDisplay()
        self.rate = Rate()
        self.display.__enter__()

    def on_progress(self, snapshot: dict, elapsed: float, final: bool) -> None:
        self.display.update(self.rate.status(snapshot, time.monotonic()), elapsed, final=final)

    def on_fit_end(self) -> None:
        display, self.display = self.display, None
        if display is not None:
            display.__exit__(None, None, None)
