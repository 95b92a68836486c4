"""Leaderboards from stored results.

A sweep evaluates its checkpoints on one or more *evaluations* (the store's ``dataset`` column:
``val``, ``ood``, ...), each with its metrics. A board has one row per (sweep, checkpoint) and one
column per (evaluation, metric), named ``EVAL/METRIC`` — or just ``METRIC`` when the rows shown
hold a single evaluation — and, with two or more evaluations, an ``aggregate`` column first
(see :func:`aggregate_row`). Every column marks its best value ``*`` and the values not
distinguishable from it ``~``, from paired bootstrap replicates.

This module turns rows into boards and comparisons; :mod:`rayeval.reporting.render` prints them.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa

from rayeval.errors import StoreError
from rayeval.config import names as lm_names
from rayeval.io.store import bootstrap_params, confidence_of, latest_rows  # noqa: F401 - the row's format

AGGREGATE = "aggregate"


def group_members(rows: list[dict]) -> set[str]:
    """The evaluations that are an lm-eval group's tasks (``NAME/TASK``) whose group (``NAME``)
    the rows also hold: the suite's aggregate counts the group, not its tasks again."""
    datasets = {r["dataset"] for r in rows}
    return {d for d in datasets if lm_names.group_of(d) in datasets}


def without_members(rows: list[dict]) -> list[dict]:
    """The rows without an lm-eval group's members (``NAME/TASK``) where the group's aggregate
    (``NAME``) is stored for the same checkpoint: a board shows the group, its members on
    request."""
    shown = {(r["sweep"], r["checkpoint"], r["dataset"]) for r in rows}
    return [r for r in rows
            if (r["sweep"], r["checkpoint"], lm_names.group_of(r["dataset"])) not in shown]


def replicates_of(row: dict) -> list | object:
    """A row's replicates (a list, or a float64 array read from a store), [] when none."""
    reps = row.get("replicates")
    return [] if reps is None else reps


def value_of(row: dict | None) -> float | None:
    """A row's value, or None when it is missing or NaN."""
    v = None if row is None else row.get("value")
    return None if v is None or math.isnan(v) else v


# --- columns -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Column:
    name: str                  # "val/accuracy"; "accuracy" when one evaluation; "aggregate"
    evaluation: str            # the store's dataset; "*" for the aggregate
    metric: str
    higher_is_better: bool


AGGREGATE_COLUMN = Column(AGGREGATE, "*", AGGREGATE, True)


def ranked_rows(rows: list[dict]) -> list[dict]:
    """The rows that hold a number (confusion matrices are shown, not ranked)."""
    return [r for r in rows if not r.get("matrix")]


def evaluations_of(rows: list[dict]) -> list[str]:
    """The evaluations (data sets) of ranked rows, by name: the store's file order follows
    content keys, so it says nothing about the suite's order."""
    return sorted({r["dataset"] for r in ranked_rows(rows)})


def first_metrics(rows: list[dict]) -> dict[str, str]:
    """Each evaluation's headline metric, the one its aggregate averages. A cell stores its
    rows in the sweep's metric order, so a cell's first row is its first metric; the metric
    most cells start with wins (ties: the first seen), so one cell with a partial or older
    metric list does not change it."""
    heads: dict[tuple, str] = {}
    for r in ranked_rows(rows):
        heads.setdefault((r["sweep"], r["checkpoint"], r["dataset"]), r["metric"])
    votes: dict[str, Counter] = {}
    for (_, _, evaluation), metric in heads.items():
        votes.setdefault(evaluation, Counter())[metric] += 1
    return {e: count.most_common(1)[0][0] for e, count in votes.items()}


def columns_of(rows: list[dict]) -> list[Column]:
    """One column per (evaluation, metric): evaluations by name, each one's metrics in the
    order they are stored (a cell keeps the sweep's metric order); the aggregate first when
    there are several evaluations."""
    evaluations = evaluations_of(rows)
    qualified = len(evaluations) > 1
    found: dict[tuple[str, str], Column] = {}
    for r in ranked_rows(rows):
        key = (r["dataset"], r["metric"])
        if key not in found:
            name = f"{key[0]}/{key[1]}" if qualified else key[1]
            found[key] = Column(name, key[0], key[1], bool(r["higher_is_better"]))
    columns = sorted(found.values(), key=lambda c: evaluations.index(c.evaluation))
    return ([AGGREGATE_COLUMN] if qualified else []) + columns


def resolve_metric(name: str, columns: list[Column], what: str = "--metric") -> Column:
    """The column a user named: ``EVAL/METRIC``, a bare ``METRIC`` stored for one evaluation
    only, or ``aggregate``."""
    for c in columns:
        if name in (c.name, f"{c.evaluation}/{c.metric}"):
            return c
    bare = [c for c in columns if c.metric == name]
    if len(bare) == 1:
        return bare[0]
    if bare:
        raise StoreError(f"{what}: {name!r} is stored for several evaluations; choose one of: "
                         f"{', '.join(c.name for c in bare + [AGGREGATE_COLUMN])}")
    if name == AGGREGATE:
        raise StoreError(f"{what}: aggregate needs results on two or more evaluations; the rows "
                         f"shown hold only {', '.join(sorted({c.evaluation for c in columns}))}")
    raise StoreError(f"{what}: no results for metric {name!r}; the store has: "
                     f"{', '.join(c.name for c in columns) or 'nothing'}")


# --- the aggregate over evaluations ------------------------------------------------------------

def aggregate_row(parts: list[dict | None], evaluations: list[str],
                  like: dict | None = None, deferred: list | None = None) -> dict:
    """The aggregate of one (sweep, checkpoint) over a suite: the mean over ``evaluations`` of
    each evaluation's first metric, direction-adjusted (a lower-is-better metric enters
    negated, so the aggregate is higher-is-better). ``parts[i]`` is the stored row of
    ``evaluations[i]``'s first metric, None when the checkpoint lacks it; ``like``, any row
    of the checkpoint, names it when every part is missing.

    The interval averages replicate b across the evaluations and takes the percentile interval
    of those means. This is sound because replicate b of an evaluation is a bootstrap resample
    of that evaluation's own rows, and the evaluations are different rows: when their row ids
    hash to unrelated buckets, replicate b of each is an independent draw, so the mean of
    replicate b is a draw from the bootstrap distribution of the mean; when the ids coincide
    (same seed and id column), the same weights resample (row of val, row of ood) units
    jointly, a bootstrap over exchangeable units, equally valid. And replicate b is the same
    resample for every checkpoint of an evaluation, so the averaged replicates of two
    checkpoints pair exactly like a stored metric's do (``paired``).

    Missing (value NaN, no interval) when a part is missing; no interval (value kept) when a
    part has no replicates or the parts' replicate counts differ. ``deferred``: the interval
    is left for ``fill_intervals`` (many rows at once), with what it needs appended here.
    """
    present = [p for p in parts if p is not None]
    first = present[0] if present else like
    row = {"sweep": first["sweep"], "checkpoint": first["checkpoint"], "step": first["step"],
           "dataset": "*", "metric": AGGREGATE, "higher_is_better": True,
           "value": math.nan, "ci_low": None, "ci_high": None, "replicates": None,
           "evaluations": list(evaluations),
           "metrics": [None if p is None else p["metric"] for p in parts],
           "num_samples": sum(p["num_samples"] for p in present),
           "created_at": max((p["created_at"] for p in present if p.get("created_at")),
                             default=None),
           "bootstrap": first.get("bootstrap")
           if len({p.get("bootstrap") for p in present}) == 1 else None,
           "confidence": confidence_of(first), "parts": parts}
    if len(present) < len(parts):
        return row
    signs = [1.0 if p["higher_is_better"] else -1.0 for p in parts]
    values = [math.nan if p["value"] is None else p["value"] for p in parts]
    reps = [replicates_of(p) for p in parts]
    row["value"] = sum(s * v for s, v in zip(signs, values)) / len(parts)
    if len({len(r) for r in reps}) > 1:      # some without replicates, or other counts:
        return row                           # the value stands, without an interval
    if len(reps[0]) and deferred is not None:
        deferred.append((row, reps, signs))
    elif len(reps[0]):
        from rayeval.core.stats import combined_interval   # torch: only with intervals

        row["replicates"], row["ci_low"], row["ci_high"] = combined_interval(
            reps, signs, len(parts), row["confidence"])
    return row


def aggregates(rows: list[dict]) -> list[dict]:
    """One aggregate row per (sweep, checkpoint), over every evaluation the rows hold and each
    one's first metric; none when the rows hold fewer than two evaluations."""
    members = group_members(rows)
    evaluations = [e for e in evaluations_of(rows) if e not in members]
    if len(evaluations) < 2:
        return []
    firsts = first_metrics(rows)
    parts: dict[tuple, dict[str, dict]] = {}
    some_row: dict[tuple, dict] = {}
    for r in ranked_rows(rows):
        key = (r["sweep"], r["checkpoint"])
        own = parts.setdefault(key, {})
        some_row.setdefault(key, r)
        if firsts[r["dataset"]] == r["metric"]:
            own[r["dataset"]] = r
    deferred: list = []
    rows = [aggregate_row([own.get(e) for e in evaluations], evaluations, some_row[key],
                          deferred)
            for key, own in parts.items()]
    fill_intervals(deferred)
    return rows


def fill_intervals(deferred: list) -> None:
    """The intervals ``aggregate_row`` deferred, computed many rows at a time
    (``stats.combined_intervals_by_shape``)."""
    if not deferred:
        return
    from rayeval.core.stats import combined_intervals_by_shape   # torch: only with intervals

    found = combined_intervals_by_shape([(reps, signs, row["confidence"])
                                         for row, reps, signs in deferred])
    for (row, _, _), (c, lo, hi) in zip(deferred, found):
        row["replicates"], row["ci_low"], row["ci_high"] = c.tolist(), lo, hi


# --- paired differences --------------------------------------------------------------------

@dataclass
class Paired:
    """A - B on the same bootstrap replicates."""
    difference: float
    ci_low: float
    ci_high: float
    a_better: float          # share of replicates in which A is better (ties count half)


def pairable(a: dict, b: dict) -> bool:
    """Whether two rows hold replicates of the same resamples: same data, seed, buckets and
    replicate count (an aggregate: every part pairable)."""
    if not len(replicates_of(a)) or not len(replicates_of(b)) or \
            len(a["replicates"]) != len(b["replicates"]):
        return False
    if "parts" in a or "parts" in b:     # an aggregate's replicates: its parts' count, each
        pa_, pb_ = a.get("parts") or [], b.get("parts") or []
        return len(pa_) == len(pb_) and all(x is not None and y is not None and
                                            same_resamples(x, y) for x, y in zip(pa_, pb_))
    return same_resamples(a, b)


def same_resamples(a: dict, b: dict) -> bool:
    """Whether two stored rows' replicate b resample the same rows: same data, seed and
    buckets (their replicates need not be read to know)."""
    ka, kb = bootstrap_params(a.get("bootstrap")), bootstrap_params(b.get("bootstrap"))
    ka.pop("confidence", None)
    kb.pop("confidence", None)
    return ka == kb and a["dataset"] == b["dataset"] and a["num_samples"] == b["num_samples"]


def paired(a: dict, b: dict, confidence: float = 0.95) -> Paired | None:
    """The paired bootstrap difference of two rows of one metric (or two aggregates), or None
    when they do not share replicates (bootstrap off, other data, other seed or bucket count)."""
    if not pairable(a, b):
        return None
    import torch

    from rayeval.core.stats import percentile_interval

    d = torch.tensor(a["replicates"], dtype=torch.float64) - \
        torch.tensor(b["replicates"], dtype=torch.float64)
    lo, hi = percentile_interval(d, confidence)
    d = d[~torch.isnan(d)]
    sign = 1.0 if a["higher_is_better"] else -1.0
    better = float(((sign * d > 0).double() + 0.5 * (d == 0).double()).mean()) if d.numel() \
        else float("nan")
    return Paired(a["value"] - b["value"], lo, hi, better)


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

    def value(self, column: str) -> float | None:
        return value_of(self.rows.get(column))


@dataclass
class Board:
    columns: list[Column]         # the aggregate (several evaluations), then EVAL/METRIC
    rank_by: str                  # a column name
    higher_is_better: bool        # of rank_by
    entries: list[Entry]          # in rank order
    evaluations: list[str]        # by name
    averaged: list[Column] = field(default_factory=list)   # what the aggregate averages
    notes: list[str] = field(default_factory=list)          # warnings shown with the board
    marked: set[str] = field(default_factory=set)           # columns whose marks are set

    @property
    def metrics(self) -> list[str]:
        return [c.name for c in self.columns]

    def column(self, name: str) -> Column:
        return resolve_metric(name, self.columns)


def build_board(rows: list[dict], metric: str | None = None,
                aggregate_rows: list[dict] | None = None, marked: bool = True) -> Board:
    """Rank one row per (sweep, checkpoint) by ``metric`` (a column name, see
    ``resolve_metric``); default: the aggregate when some checkpoint has one, else the first
    metric. ``aggregate_rows``: the aggregates, worked out already (default: from ``rows``).
    ``marked``: each column's marks (from its rows' replicates) now; else ``mark`` sets
    them for the columns shown."""
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
        e.rows[names[(r["dataset"], r["metric"])]] = r
        if r.get("items_total") is not None and e.stopped is None:
            e.stopped = r.get("stopped") or f"partial: {r['num_samples']} of " \
                                             f"{r['items_total']} items"
    for a in aggregates(rows) if aggregate_rows is None else aggregate_rows:
        entries[(a["sweep"], a["checkpoint"])].rows[AGGREGATE] = a
    rank_by = resolve_metric(metric, columns) if metric else _default_rank(columns, entries)
    ranked = _rank(list(entries.values()), rank_by)
    evaluations = evaluations_of(rows)
    members = group_members(rows)
    firsts = first_metrics(rows)
    averaged = [c for c in columns if len(set(evaluations) - members) > 1
                and c.evaluation not in members and firsts.get(c.evaluation) == c.metric]
    board = Board(columns=columns, rank_by=rank_by.name,
                  higher_is_better=rank_by.higher_is_better, entries=ranked,
                  evaluations=evaluations, averaged=averaged,
                  notes=small_data_notes(rows) + token_notes(rows) + stopped_notes(ranked))
    if marked:
        mark(board, columns)
    return board


def mark(board: Board, columns: list[Column]) -> None:
    """Set the marks of these columns (their rows hold their replicates by now)."""
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
            seen.setdefault(r["dataset"], (r["num_samples"], r["num_tokens"]))
    return [f"{name}: {n:,} row(s), {t:,} scored token(s)"
            for name, (n, t) in sorted(seen.items())]


def small_data_notes(rows: list[dict]) -> list[str]:
    """A warning per evaluation with fewer than SMALL_DATA_ROWS rows: its intervals (and any
    ranking on it) say little."""
    sizes: dict[str, int] = {}
    for r in rows:
        sizes[r["dataset"]] = min(sizes.get(r["dataset"], r["num_samples"]), r["num_samples"])
    return [f"warning: {name} has only {n} row(s); with fewer than {SMALL_DATA_ROWS} the "
            "intervals and the ranking on it mean little" for name, n in sorted(sizes.items())
            if n < SMALL_DATA_ROWS]


def stopped_notes(entries: list[Entry]) -> list[str]:
    """A line per raced checkpoint that left the race (its cells partial: figures from the
    items it scored, below every complete one whatever their values)."""
    return [f"{os.path.basename(e.checkpoint.rstrip('/'))}: {e.stopped} (partial: its figures "
            "are estimates from the items scored)" for e in entries if e.stopped]


def _default_rank(columns: list[Column], entries: dict[tuple, Entry]) -> Column:
    if columns[0] is AGGREGATE_COLUMN and \
            not any(e.value(AGGREGATE) is not None for e in entries.values()):
        return columns[1]             # no checkpoint has every evaluation
    return columns[0]


def _rank(entries: list[Entry], column: Column) -> list[Entry]:
    sign = -1.0 if column.higher_is_better else 1.0

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
    """'*' on the best value of a column, '~' on those whose paired interval of the difference
    to the best contains zero (not distinguishable from it). When several share the best value
    exactly, none is marked best: all are '~'."""
    group = [e for e in entries if e.value(column) is not None and not e.stopped]
    if not group:
        return
    best = max(group, key=lambda e: e.value(column) if higher else -e.value(column))
    ties = [e for e in group if e.value(column) == best.value(column)]
    if len(ties) > 1:             # equal values: none is the best, none is distinguishable
        for e in ties:
            e.marks[column] = "~"
    else:
        best.marks[column] = "*"
    for e in group:
        if e in ties:
            continue
        p = paired(best.rows[column], e.rows[column], confidence_of(best.rows[column]))
        if p is not None and p.ci_low <= 0 <= p.ci_high:
            e.marks[column] = "~"


# --- comparing two checkpoints -------------------------------------------------------------

@dataclass
class Comparison:
    name: str                     # a column name: METRIC, EVAL/METRIC or aggregate
    a: dict
    b: dict
    paired: Paired | None         # None: no shared replicates


def compare(a_rows: list[dict], b_rows: list[dict], metric: str | None = None
            ) -> list[Comparison]:
    """A - B for every (evaluation, metric) both checkpoints hold, plus the aggregate when they
    share several evaluations; ``metric`` restricts to one column (``resolve_metric``)."""
    a_rows, b_rows = ranked_rows(a_rows), ranked_rows(b_rows)
    common = [e for e in evaluations_of(a_rows) if e in set(evaluations_of(b_rows))]
    if not common:
        raise StoreError("A and B were not evaluated on a common data set; `rayeval "
                         "leaderboard STORE --format csv` lists what each holds")
    a_rows = [r for r in a_rows if r["dataset"] in common]
    a_by = {(r["dataset"], r["metric"]): r for r in a_rows}
    b_by = {(r["dataset"], r["metric"]): r for r in b_rows if r["dataset"] in common}
    columns = [c for c in columns_of(a_rows) if (c.evaluation, c.metric) in b_by]
    firsts = first_metrics(a_rows)
    headline = [(e, firsts[e]) for e in common]       # what the aggregate averages
    lacking = [f"{e}/{m}" for e, m in headline if (e, m) not in b_by]
    if len(common) > 1 and not lacking:
        columns.append(AGGREGATE_COLUMN)              # a summary, after the metrics
    elif len(common) > 1 and metric == AGGREGATE:
        raise StoreError(f"--metric: no aggregate to compare: B lacks {', '.join(lacking)}")
    if metric:
        columns = [resolve_metric(metric, columns)]
    found = []
    for c in columns:
        if c is AGGREGATE_COLUMN:
            a = aggregate_row([a_by[k] for k in headline], common)
            b = aggregate_row([b_by[k] for k in headline], common)
        else:
            a, b = a_by[(c.evaluation, c.metric)], b_by[(c.evaluation, c.metric)]
        found.append(Comparison(c.name, a, b, paired(a, b, confidence_of(a))))
    return found


def find_checkpoint(rows: list[dict], name: str, what: str) -> list[dict]:
    """The rows of the one checkpoint a user named: its location, path, file name, a unique
    path suffix, its file stem (``step_000600`` for ``.../step_000600.pt``) or its step
    (``600``); tried in that order. The same checkpoint in two sweeps is two checkpoints."""
    steps = {(r["sweep"], r["checkpoint"]): r["step"] for r in rows}
    found: list[tuple[str, str]] = []
    for matches in _checkpoint_matchers(name):
        found = [k for k, step in steps.items() if matches(k[1], step)]
        if found:
            break
    if not found:
        raise StoreError(f"{what}: no checkpoint {name!r} in the store; `rayeval leaderboard "
                         "STORE` lists them")
    if len(found) > 1:
        several_sweeps = len({s for s, _ in found}) > 1
        shown = [f"{c} (sweep {s})" if several_sweeps else c for s, c in found[:6]]
        more = f" and {len(found) - 6} more" if len(found) > 6 else ""
        raise StoreError(f"{what}: {name!r} matches {len(found)} checkpoints: "
                         f"{', '.join(shown)}{more}; give more of the path"
                         + (" or pick a sweep with --sweep" if several_sweeps else ""))
    return [r for r in rows if (r["sweep"], r["checkpoint"]) == found[0]]


def _checkpoint_matchers(name: str):
    """Ways a name can match a (location, step), most specific first."""
    full, tail = os.path.abspath(name), name.strip("/")

    def base(loc: str) -> str:
        return loc.rstrip("/").rsplit("/", 1)[-1]

    yield lambda loc, step: loc in (name, full)
    yield lambda loc, step: loc.rstrip("/").endswith("/" + tail) or base(loc) == tail
    yield lambda loc, step: os.path.splitext(base(loc))[0] == tail
    if name.isdigit():
        yield lambda loc, step: step == int(name)
