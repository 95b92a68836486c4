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
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable

from rayeval.config.schema import MlflowTracker, Sweep, Trackers, WandbTracker
from rayeval.errors import RayevalError, SpecError
from rayeval.execution.callbacks import RunCallback

EXPERIMENT = "rayeval"            # MLflow experiment of a sweep's own run, unless one is named
SWEEP_TAG = "rayeval.sweep"       # MLflow tag that finds a sweep's own run again
TABLE = "rayeval/leaderboard"     # the leaderboard's artifact (MLflow) / table key (W&B)
STEP_METRIC = "eval/step"         # W&B: the x-axis of every eval/* metric
# The store columns a tracker needs (not the wide replicates and matrices).
COLUMNS = ["sweep", "checkpoint", "step", "dataset", "metric", "value", "ci_low", "ci_high",
           "created_at"]

Say = Callable[[str], None]


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def require(trackers: Trackers) -> None:
    """A tracker the sweep asks for whose package is missing: one SpecError, before any work.
    (Not an import: ``mlflow`` takes a second or two to import, and is imported when used.)"""
    for spec, package in ((trackers.mlflow, "mlflow"), (trackers.wandb, "wandb")):
        if spec is not None and importlib.util.find_spec(package) is None:
            raise SpecError(f"{spec.key_path}: the {package} package is not installed; "
                            f"pip install 'rayeval[{package}]'")


# --- what is logged ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Point:
    key: str
    value: float
    step: int
    timestamp_ms: int
    bound: bool = False                  # an interval's end, not a metric's value


_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]")


def metric_name(evaluation: str, metric: str) -> str:
    """``eval/<evaluation>/<metric>``; characters MLflow refuses in a name become ``_``."""
    return f"eval/{_UNSAFE.sub('_', evaluation)}/{_UNSAFE.sub('_', metric)}"


def points(rows: list[dict]) -> tuple[list[Point], int]:
    """The values of stored rows as (name, value, step) points, and how many rows were left out
    for having no training step (a checkpoint whose name has none): a chart needs a step.
    Rows without a number (a confusion matrix) are not metrics to chart."""
    out, unstepped = [], 0
    for r in rows:
        if not _finite(r.get("value")):
            continue
        if r.get("step") is None:
            unstepped += 1
            continue
        base = metric_name(r["dataset"], r["metric"])
        created = r.get("created_at")
        ms = int(created.timestamp() * 1000) if created is not None else 0
        for suffix, column in (("", "value"), ("_ci_low", "ci_low"), ("_ci_high", "ci_high")):
            if _finite(r.get(column)):
                out.append(Point(base + suffix, float(r[column]), int(r["step"]), ms,
                                 bound=bool(suffix)))
    return out, unstepped


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def board_table(rows: list[dict]) -> tuple[list[str], list[list]] | None:
    """The leaderboard of ``rows`` as (columns, data): rank, sweep, checkpoint, step, then each
    column's value and interval; None when nothing there is ranked."""
    from rayeval.reporting.boards import build_board

    try:
        board = build_board(rows)
    except RayevalError:
        return None
    columns = ["rank", "best", "sweep", "checkpoint", "step"]
    for c in board.metrics:
        columns += [c, f"{c}_ci_low", f"{c}_ci_high"]
    data = []
    for e in board.entries:
        line = [e.rank, e.best, e.sweep, e.checkpoint, e.step]
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
            self.cells += len({(r["checkpoint"], r["dataset"]) for r in rows
                               if r.get("step") is not None})

    def table(self, rows: list[dict]) -> None:
        """The leaderboard of stored rows, as a table."""
        self.guard(f"logging the leaderboard to run {self.run_id}", self._board, rows)

    def _board(self, rows: list[dict]) -> None:
        got = board_table(rows)
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


class MlflowSink(_Sink):
    name = "mlflow"

    def __init__(self, spec: MlflowTracker, sweep: str, warn: Say):
        super().__init__(sweep, warn)
        self.spec = spec
        self.uri = spec.uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.client = None
        self.own = spec.run_id is None       # the sweep's own run: this command finishes it
        self.history: dict[str, set[tuple[int, float]]] = {}

    def where(self) -> str:
        return f"({self.uri})" if self.spec.run_id else \
            f"({self.uri}, experiment {self.spec.experiment or EXPERIMENT})"

    def quiet(self):
        return _bounded_mlflow()

    def open(self) -> bool:
        if not self.uri:
            self.dead = True
            self.warn(f"[rayeval] warning: mlflow: no tracking URI: set {self.spec.key_path}"
                      ".uri (or MLFLOW_TRACKING_URI); nothing is sent to mlflow in this "
                      "command (the result store has every result)")
            return False
        return self.guard(f"cannot use {self.uri}", self._open)

    def _open(self) -> None:
        _probe(self.uri)
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        if self.spec.run_id:
            run = _get_run(self.client, self.spec.run_id)
            self.run_id = run.info.run_id
            return
        name = self.spec.experiment or EXPERIMENT
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            experiment_id = self.client.create_experiment(name)
        elif experiment.lifecycle_stage != "active":
            raise _Problem(f"experiment {name!r} is deleted; restore it or name another "
                           "experiment")
        else:
            experiment_id = experiment.experiment_id
        quote = '"' if "'" in self.sweep else "'"
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{SWEEP_TAG}` = {quote}{self.sweep}{quote}",
            max_results=1, order_by=["attributes.start_time DESC"])
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=self.sweep,
                                                 tags={SWEEP_TAG: self.sweep}).info.run_id

    def _log(self, pts: list[Point]) -> None:
        from mlflow.entities import Metric

        fresh = []
        for p in pts:        # a point the run already holds (a second push) is not doubled
            if p.key not in self.history:
                self.history[p.key] = {(m.step, m.value) for m in
                                       self.client.get_metric_history(self.run_id, p.key)}
            if (p.step, p.value) not in self.history[p.key]:
                fresh.append(p)
        for i in range(0, len(fresh), 1000):              # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=[
                Metric(p.key, p.value, p.timestamp_ms, p.step) for p in fresh[i:i + 1000]])
        for p in fresh:
            self.history[p.key].add((p.step, p.value))
        self.values += sum(not p.bound for p in fresh)

    def _table(self, columns: list[str], data: list[list]) -> None:
        import csv
        import io

        text = io.StringIO()
        w = csv.writer(text)
        w.writerow(columns)
        w.writerows([["" if v is None else v for v in line] for line in data])
        self.client.log_text(self.run_id, text.getvalue(), f"{TABLE}.csv")
        if importlib.util.find_spec("pandas") is not None:   # MLflow's table view needs it
            import warnings

            with warnings.catch_warnings():      # pandas' deprecation notes on MLflow's code
                warnings.simplefilter("ignore")
                self.client.log_table(self.run_id, {c: [line[i] for line in data]
                                                    for i, c in enumerate(columns)},
                                      f"{TABLE}.json")

    def _close(self) -> None:
        if self.own and self.run_id:             # never the status of a training run
            self.client.set_terminated(self.run_id, "FINISHED")


class WandbSink(_Sink):
    name = "wandb"

    def __init__(self, spec: WandbTracker, sweep: str, warn: Say):
        super().__init__(sweep, warn)
        self.spec = spec
        self.run = None
        self.mode = spec.mode

    def where(self) -> str:
        return f"(project {self.spec.project}, {self.mode or 'online'})"

    def open(self) -> bool:
        return self.guard(f"cannot open a run in project {self.spec.project}", self._open)

    def _open(self) -> None:
        import wandb

        self.run_id = self.spec.run_id or wandb_run_id(self.sweep)
        settings = wandb.Settings(console="off", silent=True, disable_git=True,
                                  save_code=False, x_disable_stats=True,
                                  x_disable_machine_info=True, init_timeout=60)
        self.run = wandb.init(
            project=self.spec.project, entity=self.spec.entity, id=self.run_id,
            resume="allow", mode=self.mode, reinit="create_new", settings=settings,
            # a training run keeps its own name; the sweep's run is named after the sweep
            **({} if self.spec.run_id else {"name": self.sweep, "job_type": "eval",
                                             "config": {SWEEP_TAG: self.sweep}}))
        self.mode = getattr(self.run.settings, "mode", None) or self.mode   # as W&B resolved it
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("eval/*", step_metric=STEP_METRIC)

    def _log(self, pts: list[Point]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for p in pts:
            by_step.setdefault(p.step, {})[p.key] = p.value
        for step in sorted(by_step):
            self.run.log({STEP_METRIC: step, **by_step[step]})
        self.values += sum(not p.bound for p in pts)

    def _table(self, columns: list[str], data: list[list]) -> None:
        import wandb

        self.run.log({TABLE: wandb.Table(columns=columns, data=data)})

    def _close(self) -> None:
        self.run.finish()
        self.run = None

    def _release(self) -> None:
        if self.run is not None:         # after a failure: let go of the run, quietly
            try:
                self.run.finish(exit_code=1)
            except Exception:            # noqa: BLE001 - it failed already once
                pass
            self.run = None


def wandb_run_id(sweep: str) -> str:
    """A sweep's own W&B run id: the same for every command, so each adds to the same run."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", sweep).strip("-")[:40] or "sweep"
    return f"rayeval-{slug}-{hashlib.sha256(sweep.encode()).hexdigest()[:8]}"


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
        self.sinks = open_sinks(sweep.trackers, sweep.name, self.warn) \
            if sweep.trackers.any else []

    @property
    def live(self) -> bool:
        return any(not s.dead for s in self.sinks)

    def cell(self, outcome) -> None:
        """A finished cell (a ``CellOutcome``): its stored rows go to every live tracker. A cell
        that failed has nothing to log."""
        if not outcome.ok or not self.live:
            return
        try:
            rows = self.store.read_cell(outcome.key, COLUMNS)
        except RayevalError as e:
            self.warn(f"[rayeval] warning: trackers: cannot read cell {outcome.key} back from "
                      f"the store: {e.message}; it is not logged")
            return
        for s in self.sinks:
            s.log(rows)

    def board(self) -> None:
        """The sweep's leaderboard, every stored cell of it, as a table in every tracker."""
        if not self.live:
            return
        from rayeval.io.store import newest

        try:
            rows = newest(self.sweep.output, sweep=self.sweep.name, what="output").to_pylist()
        except RayevalError as e:
            self.warn(f"[rayeval] warning: trackers: cannot read the store for the "
                      f"leaderboard: {e.message}")
            return
        for s in self.sinks:
            s.table(rows)

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
        for s in open_sinks(trackers, name, warn):
            s.log(own)
            s.table(own)
            s.close()
            ok = ok and not s.dead
            line = s.summary()
            if line:
                say(line)
    return ok


# --- MLflow's manners ------------------------------------------------------------------------

class _Problem(Exception):
    """A tracker problem whose message is already the one line to show."""


def cause(e: BaseException) -> str:
    """One line: what went wrong, without MLflow's or W&B's multi-line payloads."""
    if isinstance(e, _Problem):
        return str(e)
    text = str(getattr(e, "message", None) or e).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
    return line.rstrip(".") if len(line) <= 300 else line[:297] + "..."


def _probe(uri: str, timeout: float = 5.0) -> None:
    """Nothing listening at an http(s) tracking URI is found at once, with a plain message,
    instead of after MLflow's retries."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    u = urlsplit(uri)
    if u.scheme not in ("http", "https") or not u.hostname:
        return
    if urllib.request.getproxies().get(u.scheme) and not urllib.request.proxy_bypass(u.hostname):
        return                          # reached through a proxy: MLflow's requests will say
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        with socket.create_connection((u.hostname, port), timeout=timeout):
            pass
    except OSError as e:
        raise _Problem(f"nothing answers at {uri} ({e.strerror or e}); start the tracking "
                       "server or fix the URI") from None


def _get_run(client, run_id: str):
    try:
        run = client.get_run(run_id)
    except Exception as e:                # noqa: BLE001 - MLflow's exception types vary
        if "RESOURCE_DOES_NOT_EXIST" in str(getattr(e, "error_code", "")) or \
                "not found" in str(e).lower():
            raise _Problem(f"no run {run_id!r} there; check the run id") from None
        raise
    if run.info.lifecycle_stage != "active":
        raise _Problem(f"run {run_id!r} is deleted; restore it or check the run id")
    return run


# MLflow retries a failed request 7 times with a backoff factor of 2 (minutes) before a call
# fails; a tracker must not hold an evaluation that long. Used unless the user set them.
# It also prints "View run ... at" on stdout when a run ends, into `leaderboard --format json`'s
# output: rayeval says where the run is on stderr itself.
_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "20", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}


@contextlib.contextmanager
def _bounded_mlflow():
    """Bounded retries, and MLflow's and urllib3's own log lines held back (the one warning
    line says what failed)."""
    added = [k for k in _RETRIES if k not in os.environ]
    for k in added:
        os.environ[k] = _RETRIES[k]
    loggers = [logging.getLogger(n) for n in ("mlflow", "urllib3")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        for k in added:
            os.environ.pop(k, None)


class PublishToTrackers(RunCallback):
    """The sweep's experiment trackers (``trackers.Publisher``): each finished cell as it
    finishes, the leaderboard after each fit (``watch``: only after a poll that added to it)
    or when there is nothing to run, the trackers closed at the end."""

    def __init__(self, publisher: Publisher, only_when_added: bool = False):
        self.publisher = publisher
        self.only_when_added = only_when_added

    @property
    def wants_cells(self) -> bool:
        return self.publisher.live

    def on_cell(self, outcome) -> None:
        self.publisher.cell(outcome)

    def on_outcomes(self, outcomes) -> None:
        if not self.only_when_added or any(o.ok for o in outcomes):
            self.publisher.board()

    def on_end(self, error) -> None:
        self.publisher.close()
