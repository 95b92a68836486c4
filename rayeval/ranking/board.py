"""Leaderboards from stored results.

A sweep evaluates its checkpoints on one or more *evaluations* (the store's ``evaluation`` column:
``val``, ``ood``, ...), each with its metrics. A board has one row per (sweep, checkpoint) and one
column per (evaluation, metric), named ``EVAL/METRIC`` — or just ``METRIC`` when the rows shown
hold a single evaluation — and, with two or more evaluations, an ``aggregate`` column first
(``ranking.aggregate``). Every column marks its best value ``*`` and the values not
distinguishable from it ``~``, from paired bootstrap replicates (``ranking.compare``).

``board(store, ...)`` is the one way a board is made from a store, for the API and every
format of ``rayeval leaderboard``; ``build_board`` makes one of rows already in hand.
:mod:`rayeval.reporting.render` prints boards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rayeval.errors import StoreError
from rayeval.io.store import confidence_of, latest_rows  # noqa: F401 - the row's format
from rayeval.config.run_schema import Aggregate
from rayeval.ranking.aggregate import (AGGREGATE, aggregate_notes, aggregate_spec, aggregates,
                                       averaged, legend, ranked_of, weights_for)
from rayeval.ranking.columns import (AGGREGATE_COLUMN, LIMITED, Column,  # noqa: F401
                                     columns_of, evaluations_of, limit_text, ranked_rows,
                                     resolve_metric, value_of)
from rayeval.ranking.compare import paired_rows
from rayeval.ranking.rules import codes, direction, members, shown

if TYPE_CHECKING:
    from rayeval.config.schema import Sweep


def without_members(rows: list[dict]) -> list[dict]:
    """The rows without an lm-eval group's members (``NAME/TASK``) where the group's aggregate
    (``NAME``) is stored for the same checkpoint (``rules.shown``): a board shows the group,
    its members on request."""
    keep = shown([r["sweep"] for r in rows], [r["checkpoint"] for r in rows],
                 [r["evaluation"] for r in rows])
    return [r for r, k in zip(rows, keep) if k]


# --- the board -----------------------------------------------------------------------------

@dataclass
class Entry:
    sweep: str
    checkpoint: str
    step: int | None
    rows: dict[str, dict] = field(default_factory=dict)   # column name -> stored/aggregate row
    rank: int = 0
    best: bool = False
    marks: dict[str, str] = field(default_factory=dict)   # column name -> "*" best, "~" tied
    stopped: str | None = None    # a raced checkpoint's partial cells: why it stopped
    # Column name -> "limit: 30 of 2,376 items": a cell scored on the first items of its task
    # (an entry's ``limit:``, the row's ``limited_from``), marked LIMITED; the aggregate's
    # when it averages one. Ranked like any other.
    limited: dict[str, str] = field(default_factory=dict)

    def value(self, column: str) -> float | None:
        return value_of(self.rows.get(column))


@dataclass
class Board:
    columns: list[Column]         # the aggregate (several evaluations), then EVAL/METRIC
    rank_by: str                  # a column name
    higher_is_better: bool        # of rank_by
    entries: list[Entry]          # in rank order
    evaluations: list[str]        # by name
    averaged: list[Column] = field(default_factory=list)   # what the aggregate combines
    notes: list[str] = field(default_factory=list)          # warnings shown with the board
    marked: set[str] = field(default_factory=set)           # columns whose marks are set
    # Made by ``board``: the rows shown as read (every column but the replicates, confusion
    # matrices included), the aggregate rows, and how to read rows' replicates for marks.
    table: object = None
    aggregate_rows: list[dict] = field(default_factory=list)
    read_replicates: object = None
    aggregate: Aggregate = field(default_factory=Aggregate)  # how it combines them
    legend: str = ""                                          # that, in one line


    @property
    def metrics(self) -> list[str]:
        return [c.name for c in self.columns]

    def column(self, name: str) -> Column:
        return resolve_metric(name, self.columns)


def run_board(sweep: Sweep, keys: set[str], stored: list[dict] | None = None) -> Board | None:
    """A run's board, the one rule for it: the rows of the run's own cells (``keys``: those it
    evaluated, found in the store, or failed; a race's partial cells) and the sweep's group
    aggregates, ranked by the sweep's ``aggregate:``. What ``rayeval run`` prints, what
    ``RunReport.board`` gives, and what the experiment trackers log. ``stored``: the store's
    newest rows when the caller has read them (``latest_rows``); None when none are the run's."""
    from rayeval.io.store import ResultStore

    if stored is None:
        stored = latest_rows(ResultStore(sweep.output).read())
    groups = {g.name for g in sweep.groups}
    rows = without_members([r for r in stored
                            if r["cell"] in keys or (r["sweep"] == sweep.name
                                                     and r["evaluation"] in groups)])
    return build_board(rows, aggregate=sweep.aggregate) if rows else None


def build_board(rows: list[dict], metric: str | None = None,
                aggregate_rows: list[dict] | None = None, marked: bool = True,
                aggregate: Aggregate | str | None = None) -> Board:
    """Rank one row per (sweep, checkpoint) by ``metric`` (a column name, see
    ``resolve_metric``); default: the aggregate when some checkpoint has one, else the first
    metric. ``aggregate``: how the aggregate combines the evaluations (the sweep's
    ``aggregate:``, ``--aggregate``'s text; default: the mean win rate, ``ranking.aggregate``).
    ``aggregate_rows``: the aggregates, worked out already that way (default: from ``rows``).
    ``marked``: each column's marks (from its rows' replicates) now; else ``mark`` sets
    them for the columns shown."""
    how = aggregate_spec(aggregate)
    if not rows:
        raise StoreError("the result store holds no results yet; run a sweep first")
    rows = ranked_rows(rows)
    if not rows:
        raise StoreError("the result store holds no ranked metrics yet; run a sweep first")
    columns = columns_of(rows)
    names = {(c.evaluation, c.metric): c.name for c in columns}
    entries: dict[tuple, Entry] = {}
    for r in rows:
        e = entries.setdefault((r["sweep"], r["checkpoint"]),
                               Entry(r["sweep"], r["checkpoint"], r["step"]))
        e.rows[names[(r["evaluation"], r["metric"])]] = r
        if r.get("limited_from") is not None:
            e.limited[names[(r["evaluation"], r["metric"])]] = limit_text(r)
        if r.get("items_total") is not None and e.stopped is None:
            e.stopped = r.get("stopped") or f"partial: {r['num_samples']} of " \
                                             f"{r['items_total']} items"
    found = aggregates(rows, how) if aggregate_rows is None else aggregate_rows
    for a in found:
        entries[(a["sweep"], a["checkpoint"])].rows[AGGREGATE] = a
    rank_by = resolve_metric(metric, columns) if metric else _default_rank(columns, entries)
    ranked = _rank(list(entries.values()), rank_by)
    heads = averaged(rows)
    weights = weights_for(how, sorted(heads))
    heads = {e: m for i, (e, m) in enumerate(sorted(heads.items()))
             if weights is None or weights[i] > 0}
    mean_of = [c for c in columns if heads.get(c.evaluation) == c.metric]
    _limited_aggregates(ranked, mean_of)
    board = Board(columns=columns, rank_by=rank_by.name,
                  higher_is_better=rank_by.higher_is_better, entries=ranked,
                  evaluations=evaluations_of(rows), averaged=mean_of,
                  notes=small_data_notes(rows) + aggregate_notes(how, found, mean_of, rows)
                  + shared_notes(rows, mean_of) + token_notes(rows) + stopped_notes(ranked)
                  + limit_notes(rows, ranked),
                  aggregate=how, legend=legend(how, mean_of, found))
    if marked:
        mark(board, columns)
    return board


def board(store, *, metric: str | None = None, sweep: str | None = None,
          evaluation: str | None = None, checkpoint: str | None = None, members: bool = False,
          marks: bool = True, rank: bool = True, what: str = "store",
          aggregate: Aggregate | str | None = None) -> Board:
    """The board of a store's newest rows: the one way every format of ``rayeval leaderboard``
    and ``rayeval.leaderboard`` make one. The rows are read without their replicates; the
    aggregate's intervals come from the suite files beside the store's parts where they cover
    a checkpoint, else from the replicates of the rows averaged (``aggregate.
    stored_aggregates``); a column's marks read its rows' replicates, for every column now
    (``marks``) or for the columns shown when ``mark`` is called (a table of a big store).

    Filters: ``sweep``, ``evaluation``, ``checkpoint`` (a glob on the location); ``members``:
    also an lm-eval group's members. ``rank``: False gives the rows and columns only (no
    entries, nothing ranked, no row as a dict: JSON of a store of any size). ``aggregate``:
    how the aggregate combines the evaluations (``build_board``; default: the mean win rate
    over the checkpoints these filters leave)."""
    how = aggregate_spec(aggregate)
    from rayeval.io import paths
    from rayeval.io.store import SCHEMA, ResultStore, newest
    from rayeval.io.store.layout import figures
    from rayeval.ranking.aggregate import stored_aggregates
    from rayeval.ranking.stored import checkpoint_pattern, with_replicates

    table = newest(store, sweep=sweep, evaluation=evaluation, what=what, columns=figures(SCHEMA),
                   checkpoint=checkpoint_pattern(checkpoint))
    if not members:
        table = without_members_table(table)
    opened = ResultStore(paths.resolve(os.fspath(store), os.getcwd()))
    found = stored_aggregates(table, opened, sweep, how)
    if not rank:
        return Board(columns=columns_of(_column_rows(table)), rank_by="", higher_is_better=True,
                     entries=[], evaluations=[], table=table, aggregate_rows=found,
                     aggregate=how)
    made = build_board(table.to_pylist(), metric, found, marked=False, aggregate=how)
    made.table, made.aggregate_rows = table, found
    made.read_replicates = lambda wanted: with_replicates(store, wanted, sweep)
    if marks:
        mark(made, made.columns)
    return made


def _column_rows(table) -> list[dict]:
    """The first ranked row of each (sweep, evaluation, metric), as much of it as
    ``columns_of`` reads: a board's columns without a dict per row."""
    import numpy as np
    import pyarrow as pa

    table = table.filter(pa.array(ranked_of(table)))
    if table.num_rows == 0:
        return []
    _, first = np.unique(codes(table["sweep"], table["evaluation"], table["metric"]),
                         return_index=True)
    return table.take(pa.array(first)).select(
        ["sweep", "checkpoint", "evaluation", "metric", "higher_is_better", "matrix"]).to_pylist()


def without_members_table(table):
    """``without_members`` of a table."""
    import pyarrow as pa

    keep = shown(table["sweep"], table["checkpoint"], table["evaluation"])
    return table if all(keep) else table.filter(pa.array(keep))


def with_replicates(board: Board, columns: list[Column]) -> None:
    """Read the replicates of these columns' rows where the board was made without them (for
    marks, or paired differences; the aggregate's rows carry theirs)."""
    if board.read_replicates is None:
        return
    wanted = [e.rows[c.name] for c in columns if c.name != AGGREGATE
              for e in board.entries if c.name in e.rows and "replicates" not in e.rows[c.name]]
    if wanted:
        board.read_replicates(wanted)


def mark(board: Board, columns: list[Column]) -> None:
    """Set the marks of these columns, reading their rows' replicates first where the board
    was made without them."""
    columns = [c for c in columns if c.name not in board.marked]
    with_replicates(board, columns)
    for c in columns:
        if c.name not in board.marked:
            _mark(board.entries, c.name, c.higher_is_better)
            board.marked.add(c.name)


SMALL_DATA_ROWS = 30


def token_notes(rows: list[dict]) -> list[str]:
    """For language modeling and text perplexity, what was scored: rows (sequences or
    documents) and tokens."""
    seen: dict[str, tuple[int, int]] = {}
    for r in rows:
        if r.get("num_tokens") is not None:
            seen.setdefault(r["evaluation"], (r["num_samples"], r["num_tokens"]))
    return [f"{name}: {n:,} row(s), {t:,} scored token(s)"
            for name, (n, t) in sorted(seen.items())]


def small_data_notes(rows: list[dict]) -> list[str]:
    """A warning per evaluation with fewer than SMALL_DATA_ROWS rows: its intervals (and any
    ranking on it) say little."""
    sizes: dict[str, int] = {}
    for r in rows:
        sizes[r["evaluation"]] = min(sizes.get(r["evaluation"], r["num_samples"]), r["num_samples"])
    return [f"warning: {name} has only {n} row(s); with fewer than {SMALL_DATA_ROWS} the "
            "intervals and the ranking on it mean little" for name, n in sorted(sizes.items())
            if n < SMALL_DATA_ROWS]


def shared_notes(rows: list[dict], averaged: list[Column]) -> list[str]:
    """A line when the board's sweeps hold different evaluations: the aggregate averages
    only those every sweep holds (``rules.shared_evaluations``), naming the others and their
    sweeps; or there is no aggregate, when they share fewer than two."""
    held: dict[str, set[str]] = {}
    for r in rows:
        held.setdefault(r["evaluation"], set()).add(r["sweep"])
    sweeps = {r["sweep"] for r in rows}
    names = set(held) - members(list(held))
    apart = sorted(e for e in names if held[e] != sweeps)
    if len(sweeps) < 2 or not apart:
        return []
    where = "; ".join(f"{e} ({', '.join(sorted(held[e]))})" for e in apart)
    if len(averaged) >= 2:
        return [f"aggregate: averages what every sweep on the board holds "
                f"({', '.join(c.evaluation for c in averaged)}); not in every sweep: {where}"]
    if len(names) >= 2:
        return [f"no aggregate: the sweeps on the board share fewer than two evaluations "
                f"(not in every sweep: {where}); rank one sweep with --sweep NAME"]
    return []


def stopped_notes(entries: list[Entry]) -> list[str]:
    """A line per raced checkpoint that left the race (its cells partial: figures from the
    items it scored, below every complete one whatever their values)."""
    return [f"{os.path.basename(e.checkpoint.rstrip('/'))}: {e.stopped} (partial: its figures "
            "are estimates from the items scored)" for e in entries if e.stopped]


def limit_notes(rows: list[dict], entries: list[Entry]) -> list[str]:
    """A warning per evaluation with cells scored on an entry's ``limit:`` (marked LIMITED):
    how many of the task's items they scored, and that they rank beside whole-task cells
    where the column has both; one for the aggregate when it averages such cells."""
    counts: dict[str, set[tuple[int, int]]] = {}
    whole: set[str] = set()
    for r in rows:
        if r.get("limited_from") is None:
            whole.add(r["evaluation"])
        else:
            counts.setdefault(r["evaluation"], set()).add((r["num_samples"], r["limited_from"]))
    notes = [f"warning: {LIMITED} {name}: limit: "
             + ", ".join(f"{n:,} of {of:,}" for n, of in sorted(found))
             + " items scored, not the whole task (an entry's limit: is for trying a task; "
             "its figures are not the task's)"
             + ("; ranked here beside cells of the whole task" if name in whole else "")
             for name, found in sorted(counts.items())]
    if any(AGGREGATE in e.limited for e in entries):
        notes.append(f"warning: {LIMITED} {AGGREGATE}: it averages evaluations scored on a "
                     "limit: where marked")
    return notes


def _limited_aggregates(entries: list[Entry], averaged: list[Column]) -> None:
    """Mark an entry's aggregate when a column it averages is scored on a ``limit:``."""
    for e in entries:
        parts = [c.name for c in averaged if c.name in e.limited]
        if parts and AGGREGATE in e.rows:
            e.limited[AGGREGATE] = "averages " + ", ".join(f"{name} ({e.limited[name]})"
                                                           for name in parts)


def _default_rank(columns: list[Column], entries: dict[tuple, Entry]) -> Column:
    if columns[0] is AGGREGATE_COLUMN and \
            not any(e.value(AGGREGATE) is not None for e in entries.values()):
        return columns[1]             # no checkpoint has every evaluation
    return columns[0]


def _rank(entries: list[Entry], column: Column) -> list[Entry]:
    sign = -direction(column.higher_is_better)

    def order(e: Entry):
        v = e.value(column.name)
        return (e.stopped is not None, v is None, 0.0 if v is None else sign * v, e.step or 0,
                e.checkpoint, e.sweep)

    ranked = sorted(entries, key=order)
    top = ranked[0].value(column.name) if ranked and not ranked[0].stopped else None
    tied = sum(1 for e in ranked if top is not None and e.value(column.name) == top
               and not e.stopped)
    for i, e in enumerate(ranked, 1):
        e.rank = i
        e.best = i == 1 and top is not None and tied == 1    # a tie crowns nobody
    return ranked


def _mark(entries: list[Entry], column: str, higher: bool) -> None:
    """'*' on the best value of a column, on every checkpoint that has it exactly (a tie at
    the top is the best twice, issue 56: it showed '~' on both and '*' on none); '~' on those
    whose paired interval of the difference to the best contains zero (not distinguishable
    from it)."""
    group = [e for e in entries if e.value(column) is not None and not e.stopped]
    if not group:
        return
    best = max(group, key=lambda e: direction(higher) * e.value(column))
    ties = [e for e in group if e.value(column) == best.value(column)]
    for e in ties:
        e.marks[column] = "*"
    others = [e for e in group if e not in ties]
    found = paired_rows([e.rows[column] for e in others], best.rows[column],
                        confidence_of(best.rows[column]))
    for e, p in zip(others, found):
        if p is not None and p.ci_low <= 0 <= p.ci_high:
            e.marks[column] = "~"


