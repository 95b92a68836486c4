"""The suite aggregate: per (sweep, checkpoint), the mean over a suite's evaluations of each
one's headline metric (``rules``), direction-adjusted, with its interval.

Which rows it averages is chosen once (``suite_parts``), on columns, for rows held as dicts
with their replicates (``aggregates``) and for a store's rows read as a table without them
(``stored_aggregates``: the intervals from the suite files kept beside the store's parts,
``ranking.suite``, else from the replicates of just the rows averaged). Both combine the
replicates with the same function (``stats.combined_intervals_by_shape``), so their numbers
are the same bits.

Measured on a 100,000-cell store (300,000 rows, 1,000 replicates each; 2 cores, loaded): the
row-by-row path took 25 s and 2.8 GB — 9 s reading rows and headline replicates into dicts,
6 s combining replicates for the suite aggregate; the table path reads no replicate a suite
file covers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rayeval.io.store import ResultStore, confidence_of, replicate_arrays
from rayeval.ranking.rules import codes, direction, members, stored_headlines

if TYPE_CHECKING:
    from rayeval.ranking.columns import Column

AGGREGATE = "aggregate"

# What of a part an aggregate row keeps (and the suite files' key reads)
_PART_FIELDS = ["sweep", "checkpoint", "step", "dataset", "metric", "value", "num_samples",
                "created_at", "bootstrap", "higher_is_better", "cell"]


def replicates_of(row: dict) -> list | object:
    """A row's replicates (a list, or a float64 array read from a store), [] when none."""
    reps = row.get("replicates")
    return [] if reps is None else reps


# --- which rows ----------------------------------------------------------------------------

def ranked(matrix_lengths) -> np.ndarray:
    """Which rows hold a number (a confusion matrix is shown, not ranked), from the length of
    each row's ``matrix`` (None or 0: a number)."""
    return np.array([not n for n in matrix_lengths], dtype=bool)


def ranked_of(table: pa.Table) -> np.ndarray:
    """``ranked`` of a table's rows, from the lengths of its ``matrix`` column."""
    return ranked(pc.fill_null(pc.list_value_length(table["matrix"]), 0).to_pylist())


def suite_parts(sweeps, checkpoints, evaluations, metrics, is_ranked: np.ndarray
                ) -> tuple[list[str], list[tuple[int, dict[str, int]]]]:
    """The suite aggregate's rows: the evaluations averaged (by name, a group's members left
    out; none when fewer than two), and for each (sweep, checkpoint) in order of appearance
    (its first ranked row's index, {evaluation: the index of its headline row}, every
    evaluation but a group's members that the checkpoint has)."""
    at = np.flatnonzero(is_ranked)
    take = pa.array(at, pa.int64())
    s, c, e, m = (pa.array(list(col), pa.string()).take(take) if not
                  isinstance(col, (pa.Array, pa.ChunkedArray)) else col.take(take)
                  for col in (sweeps, checkpoints, evaluations, metrics))
    found = pc.unique(e).to_pylist() if len(e) else []
    left_out = members(found)
    averaged = sorted(set(found) - left_out)
    if len(averaged) < 2:
        return [], []
    heads = stored_headlines(s, c, e, m)
    keys = codes(s, c)
    _, starts = np.unique(keys, return_index=True)
    parts: list[dict[str, int]] = [{} for _ in starts]
    for k, row, name, metric in zip(keys.tolist(), at.tolist(), e.to_pylist(), m.to_pylist()):
        if name not in left_out and heads[name] == metric:
            parts[k][name] = row
    return averaged, [(int(at[i]), own) for i, own in zip(starts, parts)]


def averaged(rows: list[dict]) -> dict[str, str]:
    """What the suite aggregate of these rows averages: each evaluation's headline metric
    (``rules``), a group's members left out; empty when there are fewer than two."""
    evaluations, found = suite_parts(
        [r["sweep"] for r in rows], [r["checkpoint"] for r in rows],
        [r["dataset"] for r in rows], [r["metric"] for r in rows],
        ranked(len(r.get("matrix") or ()) for r in rows))
    heads: dict[str, str] = {}
    for _, own in found:
        for e, i in own.items():
            heads.setdefault(e, rows[i]["metric"])
    return heads


# --- does the mean mean anything ---------------------------------------------------------

SCALE_RATIO = 10     # magnitudes further apart than this are different scales


def scales_note(averaged: list[Column], rows: list[dict]) -> str | None:
    """A warning when the aggregate averages metrics on different scales, else None.

    The rule, on each averaged column's values in ``rows`` (its evaluation's headline metric,
    every checkpoint; missing ones skipped): a column whose values all lie in [0, 1] is on the
    unit scale (accuracies, rates); the others are on their own, of magnitude max |value|.
    The scales differ when the unit scale meets another (accuracy beside a perplexity of
    3-13, or an nll of 1.4-2.5), or when two other columns' magnitudes are more than
    SCALE_RATIO apart (a perplexity of 13 beside bits per byte of 1.1). Then the mean moves
    with the widest column and the others hardly count. Two unit-scale columns never differ,
    whatever their spreads: a saturated accuracy beside a varying one is one scale."""
    spans = _spans(averaged, rows)
    unit = [name for name, (lo, hi) in spans.items() if 0.0 <= lo and hi <= 1.0]
    other = {name: span for name, span in spans.items() if name not in unit}
    sizes = [max(abs(lo), abs(hi)) for lo, hi in other.values()]
    if not other or (not unit and max(sizes) <= SCALE_RATIO * min(sizes)):
        return None
    shown = ", ".join(f"{name} {lo:.3g}\u2013{hi:.3g}" for name, (lo, hi) in other.items())
    if unit:
        shown += ", the others within 0\u20131" if len(unit) > 1 else \
            f", {unit[0]} within 0\u20131"
    return (f"warning: the aggregate averages metrics on different scales ({shown}), so the "
            "widest decides the ranking; rank by one metric with --metric")


def _spans(averaged: list[Column], rows: list[dict]) -> dict[str, tuple[float, float]]:
    """(lowest, highest) value of each averaged column that has one, in column order."""
    names = {(c.evaluation, c.metric): c.name for c in averaged}
    found: dict[str, list[float]] = {c.name: [] for c in averaged}
    for r in rows:
        name = names.get((r["dataset"], r["metric"]))
        v = r.get("value")
        if name is not None and v is not None and not math.isnan(v):
            found[name].append(v)
    return {name: (min(vs), max(vs)) for name, vs in found.items() if vs}


# --- the aggregate row ---------------------------------------------------------------------

def aggregate_row(parts: list[dict | None], evaluations: list[str],
                  like: dict | None = None, deferred: list | None = None) -> dict:
    """The aggregate of one (sweep, checkpoint) over a suite: the mean over ``evaluations`` of
    each evaluation's headline metric, direction-adjusted (a lower-is-better metric enters
    negated, so the aggregate is higher-is-better). ``parts[i]`` is the stored row of
    ``evaluations[i]``'s headline metric, None when the checkpoint lacks it; ``like``, any row
    of the checkpoint, names it when every part is missing.

    The interval averages replicate b across the evaluations and takes the percentile interval
    of those means. This is sound because replicate b of an evaluation is a bootstrap resample
    of that evaluation's own rows, and the evaluations are different rows: when their row ids
    hash to unrelated buckets, replicate b of each is an independent draw, so the mean of
    replicate b is a draw from the bootstrap distribution of the mean; when the ids coincide
    (same seed and id column), the same weights resample (row of val, row of ood) units
    jointly, a bootstrap over exchangeable units, equally valid. And replicate b is the same
    resample for every checkpoint of an evaluation, so the averaged replicates of two
    checkpoints pair exactly like a stored metric's do (``compare.paired``).

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
    signs = [direction(p["higher_is_better"]) for p in parts]
    values = [math.nan if p["value"] is None else p["value"] for p in parts]
    row["value"] = sum(s * v for s, v in zip(signs, values)) / len(parts)
    _defer(row, [replicates_of(p) for p in parts], deferred)
    return row


def _defer(row: dict, reps: list, deferred: list | None) -> None:
    """The interval of a complete aggregate row from its parts' replicates ``reps``: none when
    some part has none or their counts differ; now, or left in ``deferred``."""
    if len({len(r) for r in reps}) > 1 or not len(reps[0]):
        return                               # the value stands, without an interval
    signs = [direction(p["higher_is_better"]) for p in row["parts"]]
    if deferred is not None:
        deferred.append((row, reps, signs))
    else:
        fill_intervals([(row, reps, signs)])


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


# --- two sources of replicates -------------------------------------------------------------

def aggregates(rows: list[dict]) -> list[dict]:
    """One aggregate row per (sweep, checkpoint) of rows held as dicts with their own
    replicates; none when the rows hold fewer than two evaluations."""
    evaluations, found = suite_parts(
        [r["sweep"] for r in rows], [r["checkpoint"] for r in rows],
        [r["dataset"] for r in rows], [r["metric"] for r in rows],
        ranked(len(r.get("matrix") or ()) for r in rows))
    deferred: list = []
    out = [aggregate_row([None if e not in own else rows[own[e]] for e in evaluations],
                         evaluations, rows[first], deferred) for first, own in found]
    fill_intervals(deferred)
    return out


def stored_aggregates(table: pa.Table, store: ResultStore, sweep: str | None = None
                      ) -> list[dict]:
    """``aggregates`` of a store's rows read as a table without their replicates: each
    complete aggregate's interval from a suite file whose combination is of exactly its rows,
    else from its rows' replicates, read alone."""
    if table.num_rows == 0:
        return []
    evaluations, found = suite_parts(
        table["sweep"], table["checkpoint"], table["dataset"], table["metric"],
        ranked_of(table))
    if not found:
        return []
    wanted = sorted({i for first, own in found for i in (first, *own.values())})
    fields = dict(zip(wanted, table.take(pa.array(wanted, pa.int64()))
                      .select(_PART_FIELDS).to_pylist()))
    rows = [aggregate_row([None if e not in own else fields[own[e]] for e in evaluations],
                          evaluations, fields[first]) for first, own in found]
    _stored_intervals(rows, store, sweep)
    return rows


def _stored_intervals(rows: list[dict], store: ResultStore, sweep: str | None) -> None:
    complete = [r for r in rows if all(p is not None for p in r["parts"])]
    if not complete:
        return
    kept = _suites(store, sweep)
    missing = []
    for row in complete:
        found = kept.get(_suite_key(row))
        if found is None:
            missing.append(row)
        elif found[0] is not None:
            row["replicates"], row["ci_low"], row["ci_high"] = found
    if not missing:
        return
    need = {(p["cell"], p["dataset"], p["metric"]) for r in missing for p in r["parts"]}
    replicates = store.replicates(need, sweep)
    deferred: list = []
    for row in missing:
        reps = [replicates.get((p["cell"], p["dataset"], p["metric"])) for p in row["parts"]]
        _defer(row, [[] if r is None else r for r in reps], deferred)
    fill_intervals(deferred)


def _suite_key(row: dict) -> tuple:
    """What a suite file's row must have combined to stand for this aggregate."""
    parts = row["parts"]
    return (row["sweep"], row["checkpoint"], tuple(row["evaluations"]),
            tuple(p["metric"] for p in parts), tuple(p["cell"] for p in parts),
            tuple(p["created_at"] for p in parts), row["confidence"])


def _suites(store: ResultStore, sweep: str | None) -> dict[tuple, tuple]:
    """The suite files' rows by ``_suite_key``: (replicates, low, high)."""
    table = store.suites(sweep)
    out: dict[tuple, tuple] = {}
    if table is None:
        return out
    keys = zip(*(table[c].to_pylist() for c in ("sweep", "checkpoint", "evaluations",
                                                 "metrics", "cells", "stamps", "confidence")))
    found = zip(replicate_arrays(table["replicates"]), table["ci_low"].to_pylist(),
                table["ci_high"].to_pylist())
    for (s, c, e, m, cells, stamps, confidence), value in zip(keys, found):
        out[(s, c, tuple(e), tuple(m), tuple(cells), tuple(stamps), confidence)] = value
    return out
