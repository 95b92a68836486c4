"""A tracker's common part: the points and the table logged, and the ``_Sink`` every tracker
(``tracker_mlflow``, ``tracker_wandb``) builds on, whose every call is guarded so that a failing
tracker is one warning line and never fails the evaluation (see ``trackers`` for the whole)."""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Callable

from rayeval.errors import RayevalError

EXPERIMENT = "rayeval"            # MLflow experiment of a sweep's own run, unless one is named
SWEEP_TAG = "rayeval.sweep"       # MLflow tag that finds a sweep's own run again
TABLE = "rayeval/leaderboard"     # the leaderboard's artifact (MLflow) / table key (W&B)
STEP_METRIC = "eval/step"         # W&B: the x-axis of every eval/* metric

Say = Callable[[str], None]


# --- what is logged ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Point:
    key: str
    value: float
    step: int
    timestamp_ms: int
    bound: bool = False                  # an interval's end, not a metric's value
    count: bool = False                  # a limit:'s item count, not a metric's value

    @property
    def figure(self) -> bool:
        """A metric's value (what a summary counts)."""
        return not (self.bound or self.count)


_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]")
LIMIT_TAG = "rayeval.limit"       # + "/<evaluation>": a run's evaluations scored on a limit:


def metric_name(evaluation: str, metric: str) -> str:
    """``eval/<evaluation>/<metric>``; characters MLflow refuses in a name become ``_``."""
    return f"eval/{_UNSAFE.sub('_', evaluation)}/{_UNSAFE.sub('_', metric)}"


def limit_names(evaluation: str) -> tuple[str, str]:
    """The points of a cell scored on an entry's ``limit:``: ``eval/<evaluation>/limit_n``
    (the items scored) and ``eval/<evaluation>/limit_total`` (the task's items)."""
    return metric_name(evaluation, "limit_n"), metric_name(evaluation, "limit_total")


def points(rows: list[dict]) -> tuple[list[Point], int]:
    """The values of stored rows as (name, value, step) points, and how many rows were left out
    for having no training step (a checkpoint whose name has none): a chart needs a step.
    Rows without a number (a confusion matrix) are not metrics to chart. A cell scored on a
    ``limit:`` adds its item counts at its step (``limit_names``), once per cell, so that
    its values are not taken for the whole task's."""
    out, unstepped, counted = [], 0, set()
    for r in rows:
        if not _finite(r.get("value")):
            continue
        if r.get("step") is None:
            unstepped += 1
            continue
        base = metric_name(r["evaluation"], r["metric"])
        created = r.get("created_at")
        ms = int(created.timestamp() * 1000) if created is not None else 0
        for suffix, column in (("", "value"), ("_ci_low", "ci_low"), ("_ci_high", "ci_high")):
            if _finite(r.get(column)):
                out.append(Point(base + suffix, float(r[column]), int(r["step"]), ms,
                                 bound=bool(suffix)))
        of = r.get("limited_from")
        if of is not None and (r["checkpoint"], r["evaluation"], r["step"]) not in counted:
            counted.add((r["checkpoint"], r["evaluation"], r["step"]))
            n_key, of_key = limit_names(r["evaluation"])
            out += [Point(n_key, float(r["num_samples"]), int(r["step"]), ms, count=True),
                    Point(of_key, float(of), int(r["step"]), ms, count=True)]
    return out, unstepped


def limits(rows: list[dict]) -> dict[str, str]:
    """{evaluation: "limit: 30 of 2,376 items"} of the rows scored on an entry's ``limit:``
    (the newest such row's, for an evaluation several sizes were tried on): what a tracker
    tags its run with."""
    from rayeval.ranking.columns import limit_text

    found: dict[str, tuple] = {}
    for r in rows:
        if r.get("limited_from") is not None:
            stamp = r.get("created_at")
            key = (stamp is not None, stamp or 0)
            if r["evaluation"] not in found or key >= found[r["evaluation"]][0]:
                found[r["evaluation"]] = (key, limit_text(r))
    return {name: text for name, (_, text) in sorted(found.items())}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def board_table(board) -> tuple[list[str], list[list]] | None:
    """A ``ranking.Board`` as (columns, data): rank, sweep, checkpoint, step, then each
    column's value and interval; None without a board (nothing ranked)."""
    if board is None:
        return None
    columns = ["rank", "best", "sweep", "checkpoint", "step", "stopped", "limited"]
    for c in board.metrics:
        columns += [c, f"{c}_ci_low", f"{c}_ci_high"]
    data = []
    for e in board.entries:           # stopped: a race's partial cells, why (else None)
        limited = "; ".join(f"{c}: {text}" for c, text in e.limited.items()) or None
        line = [e.rank, e.best, e.sweep, e.checkpoint, e.step, e.stopped, limited]
        for c in board.metrics:
            got = e.rows.get(c) or {}
            line += [got.get(k) if _finite(got.get(k)) else None
                     for k in ("value", "ci_low", "ci_high")]
        data.append(line)
    return columns, data


# --- the trackers ----------------------------------------------------------------------------

class _Sink:
    """One tracker. Every call goes through ``guard``: the first failure is one warning line and
    the sink is dead for the rest of the command."""
    name = ""

    def __init__(self, sweep: str, warn: Say):
        self.sweep = sweep
        self.warn = warn
        self.dead = False
        self.run_id: str | None = None
        self.cells = 0
        self.values = 0
        self.unstepped = 0
        self.tabled = False
        self.limited: dict[str, str] = {}     # evaluation -> its limit: as tagged on the run

    def guard(self, what: str, fn, *args) -> bool:
        if self.dead:
            return False
        try:
            with self.quiet():
                fn(*args)
            return True
        except KeyboardInterrupt:
            raise
        except Exception as e:         # noqa: BLE001 - a tracker never fails the evaluation
            self.dead = True
            self.warn(f"[rayeval] warning: {self.name}: {what}: {cause(e)}; nothing more is "
                      f"sent to {self.name} in this command (the result store has every result)")
            return False

    def quiet(self):
        return contextlib.nullcontext()

    def log(self, rows: list[dict]) -> None:
        """Stored rows (one cell's, or a store's) as points at their steps."""
        self.guard(f"logging to run {self.run_id}", self._log_rows, rows)

    def _log_rows(self, rows: list[dict]) -> None:
        pts, unstepped = points(rows)
        self.unstepped += unstepped
        if pts:
            self._log(pts)
            self.cells += len({(r["checkpoint"], r["evaluation"]) for r in rows
                               if r.get("step") is not None})
        found = {k: v for k, v in limits(rows).items() if self.limited.get(k) != v}
        if found:
            self._tag_limits(found)
            self.limited.update(found)

    def _tag_limits(self, found: dict[str, str]) -> None:
        """Say on the run which evaluations were scored on a ``limit:`` ({evaluation:
        "limit: 30 of 2,376 items"}): a tag (MLflow), a config entry (W&B)."""

    def table(self, board) -> None:
        """The leaderboard (a ``ranking.Board``, or None: nothing ranked), as a table."""
        self.guard(f"logging the leaderboard to run {self.run_id}", self._board, board)

    def _board(self, board) -> None:
        got = board_table(board)
        if got is not None:
            self._table(*got)
            self.tabled = True

    def close(self) -> None:
        if not self.dead:
            self.guard(f"closing run {self.run_id}", self._close)
        self._release()

    def summary(self) -> str | None:
        """What went where, in one line; None when nothing did (or after the warning)."""
        parts = []
        if self.cells or self.unstepped:
            parts.append(f"{self.values} metric value(s) of {self.cells} cell(s) (with their "
                         "intervals)")
        if self.tabled:
            parts.append("the leaderboard")
        if self.dead or self.run_id is None or not parts:
            return None
        left = (f"; {self.unstepped} metric value(s) of checkpoints without a training step "
                "left out (a chart needs a step; the leaderboard table has them)"
                if self.unstepped else "")
        return (f"[rayeval] {self.name}: {' and '.join(parts)} logged to run {self.run_id} "
                f"{self.where()}{left}")

    def _release(self) -> None:
        pass


# --- a tracker's failure, in one line --------------------------------------------------------

class _Problem(Exception):
    """A tracker problem whose message is already the one line to show."""


def cause(e: BaseException) -> str:
    """One line: what went wrong, without MLflow's or W&B's multi-line payloads."""
    if isinstance(e, _Problem):
        return str(e)
    text = str(getattr(e, "message", None) or e).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
    return line.rstrip(".") if len(line) <= 300 else line[:297] + "..."
