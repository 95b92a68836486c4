"""Experiment trackers: every finished cell's metrics sent to MLflow and/or Weights & Biases at
its checkpoint's training step, and the sweep's leaderboard as a table.

Metric names are ``eval/<evaluation>/<metric>``, with ``eval/<evaluation>/<metric>_ci_low`` and
``..._ci_high`` for the interval (the names the Ray Train backend reports). Each value is logged
at the step the store's row holds, so evaluations land on a training run's charts at the right
step even when training has gone further: MLflow takes any step, and W&B plots them against
``eval/step`` (its own step only grows). Without a ``run_id`` a sweep gets a run of its own, found
again by every later command (MLflow: the tag ``rayeval.sweep``; W&B: a run id made from the
sweep's name), so a re-run or a watch poll adds to it instead of starting another.

A tracker is a copy, never the record: the result store has every result before a tracker sees
it. A tracker that cannot be reached, refuses a call or is misconfigured prints ONE warning line
naming it and the cause and gets nothing more in that command; the evaluation, the store and
the exit status do not change. Only a missing package is an error, before any work starts (the
sweep asked for that tracker). ``mlflow`` and ``wandb`` are imported when a tracker opens, never
when this module is.

This module: ``require``, the ``Publisher`` of ``run`` and ``watch`` and its callback, ``push``
for ``leaderboard``. The trackers: ``tracker_sinks`` (the points, the table, the guarded base),
``tracker_mlflow`` and ``tracker_wandb``.
"""

from __future__ import annotations

import importlib.util
import sys

from rayeval.config.schema import Sweep, Trackers
from rayeval.errors import RayevalError, SpecError
from rayeval.execution.callbacks import RunCallback
# The trackers themselves, in the modules beside this one; their names are re-exported here,
# where the commands and the tests have always found them.
from rayeval.reporting.tracker_mlflow import MlflowSink
from rayeval.reporting.tracker_sinks import (EXPERIMENT, STEP_METRIC, SWEEP_TAG, TABLE, Point,
                                             Say, _Sink, board_table, cause, limit_names,
                                             limits, metric_name, points)
from rayeval.reporting.tracker_wandb import WandbSink, wandb_run_id

# The store columns a tracker needs (not the wide replicates and matrices).
COLUMNS = ["sweep", "checkpoint", "step", "evaluation", "metric", "value", "ci_low", "ci_high",
           "created_at", "num_samples", "limited_from"]


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def require(trackers: Trackers) -> None:
    """A tracker the sweep asks for whose package is missing: one SpecError, before any work.
    (Not an import: ``mlflow`` takes a second or two to import, and is imported when used.)"""
    for spec, package in ((trackers.mlflow, "mlflow"), (trackers.wandb, "wandb")):
        if spec is not None and importlib.util.find_spec(package) is None:
            raise SpecError(f"{spec.key_path}: the {package} package is not installed; "
                            f"pip install 'rayeval[{package}]'")


def open_sinks(trackers: Trackers, sweep: str, warn: Say) -> list[_Sink]:
    sinks: list[_Sink] = []
    if trackers.mlflow is not None:
        sinks.append(MlflowSink(trackers.mlflow, sweep, warn))
    if trackers.wandb is not None:
        sinks.append(WandbSink(trackers.wandb, sweep, warn))
    for s in sinks:
        s.open()
    return sinks


# --- `rayeval run` / `watch`: each cell as it finishes ----------------------------------------

class Publisher:
    """What `run` and `watch` hand each finished cell to (``cell``), then the sweep's
    leaderboard (``board``) and ``close``. Without trackers it does nothing. ``say``: the
    summary lines (None: silent); ``warn``: the warning lines (stderr by default)."""

    def __init__(self, sweep: Sweep, *, say: Say | None = None, warn: Say | None = None):
        from rayeval.io.store import ResultStore

        self.sweep = sweep
        self.say = say
        self.warn = warn or _stderr
        self.store = ResultStore(sweep.output)
        self.keys: set[str] = set()     # the run's cells (every poll's, for watch): its board
        self.sinks = open_sinks(sweep.trackers, sweep.name, self.warn) \
            if sweep.trackers.any else []

    @property
    def live(self) -> bool:
        return any(not s.dead for s in self.sinks)

    def cell(self, outcome) -> None:
        """A finished cell (a ``CellOutcome``): its stored rows go to every live tracker. A cell
        that failed has nothing to log, nor a race's partial cell (an estimate over the
        items scored, not the checkpoint's figure: the board's table shows it, marked)."""
        if not outcome.ok or getattr(outcome, "partial", False) or not self.live:
            return
        try:
            rows = self.store.read_cell(outcome.key, COLUMNS, sweep=self.sweep.name)
        except RayevalError as e:
            self.warn(f"[rayeval] warning: trackers: cannot read cell {outcome.key} back from "
                      f"the store: {e.message}; it is not logged")
            return
        for s in self.sinks:
            s.log(rows)

    def board(self) -> None:
        """The run's board (``ranking.run_board`` of the cells of ``keys``: the one
        ``rayeval run`` prints), as a table in every tracker."""
        if not self.live:
            return
        from rayeval.ranking import run_board

        try:
            board = run_board(self.sweep, self.keys)
        except RayevalError as e:
            self.warn(f"[rayeval] warning: trackers: cannot read the store for the "
                      f"leaderboard: {e.message}")
            return
        for s in self.sinks:
            s.table(board)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
            line = s.summary()
            if line and self.say is not None:
                self.say(line)
        self.sinks = []


# --- `rayeval leaderboard --to-mlflow / --to-wandb`: a whole store ----------------------------

def push(rows: list[dict], trackers: Trackers, *, say: Say = _stderr,
         warn: Say | None = None) -> bool:
    """Every row (a store's newest, as ``rayeval.results`` gives them) to the trackers: each
    sweep into its own run, or all into ``run_id`` when the rows hold one sweep. Returns
    whether every tracker took everything. Bad flags raise SpecError before anything is sent."""
    require(trackers)
    warn = warn or _stderr
    sweeps = sorted({r["sweep"] for r in rows})
    if not sweeps:
        raise SpecError("the rows to push are empty; nothing to send (check --sweep / "
                        "--dataset and the store)")
    for spec in (trackers.mlflow, trackers.wandb):
        if spec is not None and spec.run_id and len(sweeps) > 1:
            raise SpecError(f"--run-id: the store holds {len(sweeps)} sweeps "
                            f"({', '.join(sweeps)}); one run takes one sweep's results: "
                            "choose it with --sweep")
    ok = True
    for name in sweeps:
        own = [r for r in rows if r["sweep"] == name]
        board = _board_of(own)
        for s in open_sinks(trackers, name, warn):
            s.log(own)
            s.table(board)
            s.close()
            ok = ok and not s.dead
            line = s.summary()
            if line:
                say(line)
    return ok


def _board_of(rows: list[dict]):
    """The board of a store's rows (``rayeval leaderboard``'s default ranking), or None when
    nothing there is ranked."""
    from rayeval.ranking import build_board

    try:
        return build_board(rows)
    except RayevalError:
        return None


class PublishToTrackers(RunCallback):
    """The sweep's experiment trackers (``trackers.Publisher``): each finished cell as it
    finishes, the leaderboard after each fit (``watch``: only after a poll that added to it)
    or when there is nothing to run, the trackers closed at the end."""

    def __init__(self, publisher: Publisher, only_when_added: bool = False):
        self.publisher = publisher
        self.only_when_added = only_when_added
        self.plan = None               # the plan of the run (watch: of its poll)

    @property
    def wants_cells(self) -> bool:
        return self.publisher.live

    def on_plan(self, plan) -> None:
        self.plan = plan

    def on_cell(self, outcome) -> None:
        self.publisher.cell(outcome)

    def on_outcomes(self, outcomes) -> None:
        from rayeval.plan.cells import run_keys

        self.publisher.keys |= run_keys(self.plan, outcomes)    # watch: every poll's
        if not self.only_when_added or any(o.ok for o in outcomes):
            self.publisher.board()

    def on_end(self, error) -> None:
        self.publisher.close()
