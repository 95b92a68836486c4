"""rayeval's public Python API: what ``rayeval run`` and ``rayeval leaderboard`` do, as calls.

    import rayeval

    report = rayeval.run("configs/digits/sweep.yaml", workers=2)   # -> RunReport
    table = rayeval.results(report.plan.sweep.output)               # -> pyarrow.Table
    board = rayeval.leaderboard(report.plan.sweep.output)           # -> Board

Bad input raises a :class:`rayeval.RayevalError` subclass (``SpecError``, ``DataError``,
``ModelError``, ``StoreError``, ...; the tree is drawn in ``rayeval.errors``) and prints nothing;
the command line prints the same error as its one ``error:`` line.

This module is imported by ``import rayeval``: it imports neither torch nor Ray (nor pyarrow) at
import time; each function imports what it needs when called.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rayeval.config.plugins import load_plugins
from rayeval.config.schema import Sweep, Trackers

if TYPE_CHECKING:                               # types only: importing these pulls in torch
    import pyarrow as pa
    from rich.console import Console

    from rayeval.execution.driver import RunReport
    from rayeval.ranking.board import Board

__all__ = ["run", "load_sweep", "results", "query", "leaderboard"]


def load_sweep(path: str | os.PathLike, *, output: str | os.PathLike | None = None) -> Sweep:
    """Read and validate a sweep file (YAML).

    Returns the frozen, typed :class:`rayeval.Sweep`; relative paths in the file are resolved
    from the file's own folder. ``output``: the result store in place of the file's
    ``output:``, which the file may then leave out (a relative folder is taken from the current
    one, as ``--output`` is). Raises :class:`rayeval.SpecError` naming the file and the key
    path at fault (a missing file, invalid YAML, an unknown, missing or mistyped key, a bad
    value). Nothing is evaluated, no data is read and no Ray is started.
    """
    from rayeval.plan.loader import load_sweep as _load

    load_plugins()                       # the sweep may name a plugin's task or metric
    return _load(os.fspath(path), output=None if output is None else os.fspath(output))


def run(sweep: Sweep | str | os.PathLike, *, workers: int | None = None,
        output: str | os.PathLike | None = None, address: str | None = None,
        force: bool = False, verbose: bool = False,
        progress: bool | Console = False, trackers: Trackers | dict | None = None,
        standing=None) -> RunReport:
    """Evaluate every cell (checkpoint x evaluation) of a sweep that its result store does not
    hold yet, in one Ray Train run: what ``rayeval run`` does, without printing the board.

    ``sweep``: a :class:`rayeval.Sweep` or the path of a sweep file (read with
    :func:`load_sweep`). ``workers`` and ``output`` override the sweep's (a relative ``output``
    is taken from the current folder, as ``--output`` is). ``address``: a running Ray cluster
    (``"auto"``, ``"HOST:6379"``); without it, Ray is started in this process with more logical
    CPUs than workers and shut down when the run ends. If this process is already connected to
    Ray (``ray.init()`` was called), that Ray is used and left running. ``force``: evaluate
    again the cells the store already holds. ``verbose``: show Ray's and the workers' logs.
    ``progress``: False (default) shows nothing; True shows, on stderr, the plan line and the
    progress display of ``rayeval run`` (a live bar on a terminal, a line every 10 s
    otherwise); a ``rich.console.Console`` takes the plan line, and the bar when it is a
    terminal (otherwise the progress lines go to stderr), and the trackers' summary lines.
    ``trackers``: experiment trackers for this run, over the sweep's ``trackers:``: a
    ``rayeval.config.schema.Trackers``, or a mapping as in the sweep file
    (``{"mlflow": {"uri": ..., "run_id": ...}}``) where each tracker named replaces the
    sweep's and ``None`` removes it. Each cell is logged to them as it finishes and the
    leaderboard at the end; a tracker that fails prints one warning line on stderr and never
    fails the run (a missing ``mlflow`` / ``wandb`` package is a SpecError, before Ray).

    Returns a ``RunReport``: ``outcomes`` (one ``CellOutcome`` per cell evaluated or failed in
    this run, in checkpoint order: ``.ok``, ``.checkpoint``, ``.evaluation``, ``.step``,
    ``.values``, ``.error``), ``failures`` (the outcomes that failed), ``seconds``, ``nodes``
    (Ray nodes the workers ran on) and ``plan`` (``.sweep`` as run, ``.cells`` evaluated,
    ``.cached`` already in the store). Read the numbers with :func:`results` or
    :func:`leaderboard` on ``report.plan.sweep.output``.

    A checkpoint that cannot be loaded is not an exception: its cells fail on their own and are
    listed in ``report.failures``; the other cells are evaluated and stored.

    Raises (never prints, but for a tracker's warning): :class:`rayeval.SpecError` for a bad
    sweep file or override, ``DataError``, ``ModelError``, ``MetricError``, ``StoreError`` for
    data, a model factory, a metric or a result store that cannot be used (all found before
    Ray starts), and ``RunError`` when the run fails as a whole (Ray cannot be reached, the
    worker group's restarts are spent); all are :class:`rayeval.RayevalError`. ``TypeError``
    when ``sweep`` is neither a Sweep nor a path. ``standing``: the standing worker groups of a
    ``rayeval serve`` this process is (``driver.StandingGroups``); None: a group for this run. SIGINT (Ctrl-C) or SIGTERM during the run
    stops the workers at their next sync point, shuts down the Ray this call started and
    raises ``KeyboardInterrupt``; every cell already stored is complete. The process's SIGINT
    and SIGTERM handlers are restored when the call returns.
    """
    from rayeval.plan.loader import with_overrides
    from rayeval.reporting.display import console_callbacks, console_say

    if isinstance(sweep, (str, os.PathLike)):
        sweep = load_sweep(sweep, output=output)
    elif not isinstance(sweep, Sweep):
        raise TypeError(f"sweep: expected a rayeval.Sweep or the path of a sweep file, got "
                        f"{type(sweep).__name__}")
    sweep = with_overrides(sweep, workers=workers,
                           output=None if output is None else os.fspath(output))
    if trackers is not None:
        sweep = sweep.replace(trackers=_trackers(trackers, sweep.trackers))
    # The run's lifecycle puts the process's signal handlers back when it ends.
    return run_sweep(sweep, address=address, force=force, verbose=verbose,
                     callbacks=console_callbacks(progress), say=console_say(progress),
                     standing=standing)


def run_sweep(sweep: Sweep, *, callbacks=(), say=None, **options) -> RunReport:
    """``execution.driver.run_sweep`` with the sweep's experiment trackers attached: each cell
    as it finishes and the leaderboard at the end; ``say`` takes their summary lines. A missing
    tracker package fails here, before anything starts. ``options``: the driver's."""
    from rayeval.execution.callbacks import Callbacks
    from rayeval.execution.driver import run_sweep as run_on_ray
    from rayeval.reporting import trackers as tracking

    tracking.require(sweep.trackers)
    watchers = Callbacks.of(callbacks).callbacks
    publish = tracking.PublishToTrackers(tracking.Publisher(sweep, say=say))
    return run_on_ray(sweep, callbacks=Callbacks([*watchers, publish]), **options)


def results(store: str | os.PathLike, *, sweep: str | None = None,
            evaluation: str | None = None) -> pa.Table:
    """The newest stored row of every (sweep, checkpoint, evaluation, metric) in a result store.

    ``store``: a sweep's ``output``, a local folder (relative to the current folder) or an
    ``s3://bucket/prefix``-style URI. ``sweep`` and ``evaluation`` keep only that sweep's rows
    and only that evaluation's (the store's ``evaluation`` column).

    Returns a ``pyarrow.Table`` with the store's schema (``rayeval.io.store.SCHEMA``; its columns
    are listed in docs/result-store.md), in store order, with no rows when nothing
    matches; ``.to_pandas()`` gives a DataFrame when pandas is installed, ``.to_pylist()``
    dicts. When a metric of a checkpoint was stored by several cells (the checkpoint rewritten
    in place, a newer version of rayeval's metric code), only the newest row is kept.

    Raises :class:`rayeval.StoreError` when there is no store there (a local folder that does
    not exist, a missing bucket, denied access) or it cannot be read.
    """
    from rayeval.io.store import newest

    return newest(store, sweep=sweep, evaluation=evaluation, what="store")


def query(store: str | os.PathLike, sql: str, *, skip_damaged: bool = False) -> pa.Table:
    """The answer to ``sql`` over a result store, as a ``pyarrow.Table`` (DuckDB: the
    ``query`` extra). The SQL sees the views ``results`` (every stored row), ``latest`` (the
    newest row of every sweep, checkpoint, evaluation and metric, as :func:`results` gives)
    and ``cells`` (the store's files); see docs/result-store.md.

    Raises :class:`rayeval.StoreError` when the store cannot be read, a file in it is damaged
    (unless ``skip_damaged``: then it is left out, and named on stderr) or the SQL fails.
    """
    from rayeval.io.store.query import query as run_query

    return run_query(store, sql, damaged="skip" if skip_damaged else "refuse")


def leaderboard(store: str | os.PathLike, *, metric: str | None = None,
                sweep: str | None = None, evaluation: str | None = None,
                checkpoint: str | None = None, members: bool = False, marks: bool = True,
                rank: bool = True, aggregate=None, _what: str = "store") -> Board:
    """The board ``rayeval leaderboard`` shows, as data: one entry per (sweep, checkpoint),
    ranked, from the newest stored rows (:func:`results`, with the same ``store``, ``sweep``
    and ``evaluation`` filters).

    ``metric``: the column to rank by: ``EVAL/METRIC``, a bare ``METRIC`` stored for one
    evaluation only, or ``aggregate``; default: the aggregate with several evaluations, else
    the first metric. ``aggregate``: how the aggregate combines each evaluation's first metric:
    ``"win_rate"`` (default: per evaluation, the share of the board's other checkpoints beaten,
    ties half, averaged), ``"mean"`` (lower-is-better ones negated), ``"EVAL=W,EVAL=W"``
    (weighted mean), or a sweep's ``aggregate`` (``rayeval.ranking.aggregate``).

    Returns a ``Board`` (``rayeval.ranking.board.Board``): ``entries`` in rank order, each with
    ``rank``, ``sweep``, ``checkpoint``, ``step``, ``best``, ``value(column)``, ``rows[column]``
    (the stored row, or the aggregate's, with ``value``, ``ci_low``, ``ci_high``) and
    ``marks[column]`` (``"*"`` the best, ``"~"`` not distinguishable from it); ``columns``
    (``.name``, ``.evaluation``, ``.metric``, ``.higher_is_better``; ``metrics``, their names),
    ``rank_by``, ``higher_is_better``, ``evaluations``, ``averaged`` (the columns the aggregate
    averages) and ``notes`` (the warnings shown under the table). ``rayeval.reporting.render``
    turns it into the command's outputs (``to_csv``, ``to_markdown``, ``render_rich``;
    ``reporting.board_html.to_html``).

    ``checkpoint``: only checkpoints whose location matches this glob (``*/run-3/*``).
    ``members``: also show each lm-eval group's tasks (``NAME/TASK``); by default a group whose
    aggregate is stored shows as that aggregate (``NAME``) alone. ``marks``: False leaves the
    marks to be set column by column (``rayeval.ranking.board.mark(board, columns)``, which
    reads just those columns' replicates: a table showing a few columns of a big store).
    ``rank``: False gives only ``columns``, ``table`` (the rows shown, without replicates) and
    ``aggregate_rows``, nothing ranked (what ``--format json`` writes, for a store of any size).

    Every format of ``rayeval leaderboard`` is this board (``rayeval.ranking.board.board``).

    Raises :class:`rayeval.StoreError` as :func:`results` does, when the rows hold nothing to
    rank, and when ``metric`` names no column (the message lists the choices).
    """
    from rayeval.ranking.board import board

    return board(store, metric=metric, sweep=sweep, evaluation=evaluation,
                 checkpoint=checkpoint, members=members, marks=marks, rank=rank, what=_what,
                 aggregate=aggregate)


def samples(store: str | os.PathLike, *, checkpoint: str, evaluation: str | None = None,
            sweep: str | None = None) -> pa.Table:
    """Each item's record of one checkpoint on one evaluation of a text task: what
    ``rayeval samples`` shows.

    ``checkpoint``: as the command line takes it (its location, file name, a unique path
    suffix, file stem or step); ``evaluation``: the evaluation's name (may be left out when the
    checkpoint has records for one evaluation only); ``sweep``: only that sweep's rows.

    Returns a ``pyarrow.Table``, one row per item, sorted by id: ``id`` (the data set's id
    column, else the content id), ``context`` (the prompt or document), ``choices`` (multiple
    choice), ``target`` (the right choice's text, the answer), ``response`` (the choice with the
    highest log-likelihood, the generated text), ``loglikelihoods`` (each choice's, or the
    document's), ``tokens`` (perplexity) and one float column per metric that has a value per
    item (``acc``, ``acc_norm``, ``exact_match`` 1 or 0; a document's perplexities).

    Raises :class:`rayeval.StoreError` when the store, the checkpoint or the evaluation is not
    there, or the cell stored no records (``samples: false``, or stored before records existed).
    """
    from rayeval.reporting.samples import checkpoint_rows, read_cell_samples

    rows = checkpoint_rows(store, checkpoint, sweep, what="checkpoint")
    return read_cell_samples(store, rows, evaluation, what="evaluation")[1]


# --- helpers ---------------------------------------------------------------------------------

def _trackers(given, base: Trackers) -> Trackers:
    """``run``'s ``trackers=``: a Trackers as it is, a mapping over the sweep's."""
    if isinstance(given, Trackers):
        return given
    from rayeval.plan.loader import trackers_spec

    return trackers_spec(given, source="rayeval.run(trackers=...)", base=base, removable=True)
