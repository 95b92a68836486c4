"""The suite aggregate: per (sweep, checkpoint), one figure over a suite's evaluations from
each one's headline metric (``rules``), with its interval. How it combines them is the sweep's
``aggregate:`` (``config.run_schema.Aggregate``; ``rayeval leaderboard --aggregate``):

    win_rate  (default) per evaluation, the share of the board's *other* checkpoints this one
              beats on the headline, direction-aware, ties counting half; the mean of those
              shares over the evaluations (HELM's mean win rate). No metric's scale can
              dominate it: a perplexity of 3-13 beside accuracies of 0-1 counts as one
              evaluation like the others (``mean`` on configs/lm ranked by perplexity alone).
              It is relative: it says how a checkpoint stands among the ones on the board,
              and changes when checkpoints join it. With one checkpoint on the board nothing
              is beaten: the aggregate is then the plain mean, and the board says so.
    mean      the mean of the headlines, lower-is-better ones negated (higher is better).
    weights   their weighted mean, ``{EVALUATION: weight}``.

Which rows it combines is chosen once (``suite_parts``), on columns, for rows held as dicts
with their replicates (``aggregates``) and for a store's rows read as a table without them
(``stored_aggregates``: a mean's intervals from the suite files kept beside the store's parts,
``ranking.suite``, else from the replicates of just the rows combined). Both combine the
replicates with the same function (``stats.combined_intervals_by_shape``), so their numbers
are the same bits.

The win rate (``ranking.win_rate``) starts from the mean's rows and turns them into win rates.
Its interval: replicate b of an evaluation is the same resample for every checkpoint (paired),
so the win rates computed on replicate b of every checkpoint's headline are a draw from the
bootstrap distribution of the win rates; their mean over the evaluations is combined and its
percentile interval taken as a mean's is. It needs every checkpoint of an evaluation to hold
replicates of the same resamples (``replicates.same_resamples``); else the value stands
without an interval.

Measured on a 100,000-cell store (300,000 rows, 1,000 replicates each; 2 cores, loaded): the
row-by-row path took 25 s and 2.8 GB — 9 s reading rows and headline replicates into dicts,
6 s combining replicates for the suite aggregate; the table path reads no replicate a suite
file covers.
"""

from __future__ import annotations

import difflib
import math
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rayeval.config.run_schema import MEAN, WEIGHTS, WIN_RATE, Aggregate
from rayeval.errors import SpecError, StoreError
from rayeval.io.store import ResultStore, confidence_of, replicate_arrays
from rayeval.ranking.replicates import replicates_of
from rayeval.ranking.rules import (AGGREGATE, codes, direction, members, shared_evaluations,
                                   stored_headlines)
from rayeval.ranking.win_rate import win_rates

if TYPE_CHECKING:
    from rayeval.ranking.columns import Column

DEFAULT = Aggregate()                 # win_rate


def aggregate_spec(how: Aggregate | str | None, what: str = "--aggregate") -> Aggregate:
    """An ``Aggregate`` from the sweep's (as it is), None (the default: win_rate) or text as
    ``--aggregate`` takes it: ``win_rate``, ``mean``, or ``EVAL=W,EVAL=W`` (weights)."""
    if how is None:
        return DEFAULT
    if isinstance(how, Aggregate):
        return how
    text = how.strip()
    if text in (WIN_RATE, MEAN):
        return Aggregate(how=text)
    if "=" not in text:
        hint = difflib.get_close_matches(text, [WIN_RATE, MEAN], n=1, cutoff=0.6)
        raise SpecError(f"{what}: unknown aggregate {how!r}"
                        + (f"; did you mean {hint[0]!r}?" if hint else "")
                        + "; choose win_rate, mean or weights as EVAL=W,EVAL=W (e.g. "
                          "val=2,ood=1)")
    weights = []
    for item in text.split(","):
        name, _, number = item.partition("=")
        try:
            w = float(number)
        except ValueError:
            w = -1.0
        if not name.strip() or not w >= 0:
            raise SpecError(f"{what}: {item.strip()!r}: expected EVAL=WEIGHT with a weight of 0 "
                            "or more (e.g. val=2,ood=1)")
        weights.append((name.strip(), w))
    return Aggregate(how=WEIGHTS, weights=tuple(sorted(weights)))


def weights_for(how: Aggregate, evaluations: list[str], what: str = "--aggregate"
                ) -> list[float] | None:
    """The weight of each evaluation the aggregate combines (None: all equal); a StoreError
    when ``how``'s weights name an evaluation the rows lack or leave one out."""
    if how.how != WEIGHTS or not evaluations:
        return None
    given = dict(how.weights)
    for name in given:
        if name not in evaluations:
            hint = difflib.get_close_matches(name, evaluations, n=1, cutoff=0.6)
            raise StoreError(f"{what}: weights: no evaluation {name!r} on the board"
                             + (f"; did you mean {hint[0]!r}?" if hint else "")
                             + f" (the aggregate combines: {', '.join(evaluations)})")
    missing = [e for e in evaluations if e not in given]
    if missing:
        raise StoreError(f"{what}: weights: no weight for {', '.join(missing)}; give every "
                         "evaluation of the aggregate one (0 leaves it out)")
    if not sum(given.values()) > 0:
        raise StoreError(f"{what}: weights: they sum to 0; give some evaluation a weight above 0")
    return [given[e] for e in evaluations]


def _weighted(evaluations: list[str], weights: list[float] | None
              ) -> tuple[list[str], list[float] | None]:
    """The evaluations a weighted aggregate combines (weight above 0) and their weights."""
    if weights is None:
        return evaluations, None
    kept = [(e, w) for e, w in zip(evaluations, weights) if w > 0]
    return [e for e, _ in kept], [w for _, w in kept]

# What of a part an aggregate row keeps (and the suite files' key reads)
_PART_FIELDS = ["sweep", "checkpoint", "step", "evaluation", "metric", "value", "num_samples",
                "created_at", "bootstrap", "higher_is_better", "cell"]


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
    """The suite aggregate's rows: the evaluations averaged (by name: those every sweep of the
    rows holds, a group's members left out; none when fewer than two), and for each (sweep,
    checkpoint) in order of appearance (its first ranked row's index, {evaluation: the index
    of its headline row}, every evaluation but a group's members that the checkpoint has).

    Every sweep, not every checkpoint: a checkpoint that lacks an evaluation its sweep holds
    (a failed or raced cell) has no aggregate, as before, while a store of two sweeps with
    different suites averages what they share (issue 56: every aggregate cell of such a
    board was '-', each checkpoint lacking the other sweep's evaluations)."""
    at = np.flatnonzero(is_ranked)
    take = pa.array(at, pa.int64())
    s, c, e, m = (pa.array(list(col), pa.string()).take(take) if not
                  isinstance(col, (pa.Array, pa.ChunkedArray)) else col.take(take)
                  for col in (sweeps, checkpoints, evaluations, metrics))
    found = shared_evaluations(s, e)
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
        [r["evaluation"] for r in rows], [r["metric"] for r in rows],
        ranked(len(r.get("matrix") or ()) for r in rows))
    heads: dict[str, str] = {}
    shared = set(evaluations)
    for _, own in found:
        for e, i in own.items():
            if e in shared:
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
            f"widest decides the ranking; {_INSTEAD}")


_INSTEAD = ("aggregate: win_rate (the default) counts each alike; or rank by one metric with "
            "--metric")


def mean_note(averaged: list[Column], rows: list[dict]) -> str | None:
    """One warning line for a board whose aggregate is a plain mean of metrics that do not
    belong in one: on different scales (``scales_note``), else of both directions (a
    lower-is-better metric enters negated: an error rate of 0.2 counts as -0.2 beside an
    accuracy of 0.8). None when they do."""
    note = scales_note(averaged, rows)
    lower = [c.name for c in averaged if not c.higher_is_better]
    if note is not None or not lower or len(lower) == len(averaged):
        return note
    return ("warning: the aggregate is a plain mean of higher-is-better metrics and "
            f"lower-is-better ones negated ({', '.join('-' + n for n in lower)}), so it is on "
            f"no metric's scale; {_INSTEAD}")


def aggregate_notes(how: Aggregate, found: list[dict], averaged: list[Column],
                    rows: list[dict]) -> list[str]:
    """The lines a board shows about its aggregate (``found``: its aggregate rows): a plain
    mean that mixes scales or directions (``mean_note``); a win rate of a board of one
    checkpoint, shown as the plain mean."""
    if not averaged or not found:
        return []
    if how.how == MEAN:
        note = mean_note(averaged, rows)
        return [note] if note else []
    if how.how == WIN_RATE and all(r.get("aggregate") == MEAN for r in found):
        return ["aggregate: one checkpoint on the board, so no win rate (nothing to beat): "
                "the plain mean of the headlines, lower-is-better ones negated"]
    return []


def legend(how: Aggregate, averaged: list[Column], found: list[dict]) -> str:
    """What the aggregate column is, in one line (every format's legend)."""
    if not averaged:
        return ""
    terms = [c.name if c.higher_is_better else f"-{c.name}" for c in averaged]
    if how.how == WEIGHTS:
        given = dict(how.weights)
        return "aggregate: weighted mean of " + ", ".join(
            f"{t} ({given.get(c.evaluation, 0):g})" for t, c in zip(terms, averaged))
    if how.how == WIN_RATE and not all(r.get("aggregate") == MEAN for r in found):
        return ("aggregate: mean win rate on " + ", ".join(terms) + " (per evaluation, the "
                "share of the other checkpoints beaten, ties half)")
    return f"aggregate: mean of {', '.join(terms)}"


def _spans(averaged: list[Column], rows: list[dict]) -> dict[str, tuple[float, float]]:
    """(lowest, highest) value of each averaged column that has one, in column order."""
    names = {(c.evaluation, c.metric): c.name for c in averaged}
    found: dict[str, list[float]] = {c.name: [] for c in averaged}
    for r in rows:
        name = names.get((r["evaluation"], r["metric"]))
        v = r.get("value")
        if name is not None and v is not None and not math.isnan(v):
            found[name].append(v)
    return {name: (min(vs), max(vs)) for name, vs in found.items() if vs}


# --- the aggregate row ---------------------------------------------------------------------

def aggregate_row(parts: list[dict | None], evaluations: list[str],
                  like: dict | None = None, deferred: list | None = None,
                  weights: list[float] | None = None) -> dict:
    """The mean aggregate of one (sweep, checkpoint) over a suite: the mean over
    ``evaluations`` of each evaluation's headline metric, direction-adjusted (a lower-is-better
    metric enters negated, so the aggregate is higher-is-better); with ``weights`` (one per
    evaluation), their weighted mean. ``parts[i]`` is the stored row of ``evaluations[i]``'s
    headline metric, None when the checkpoint lacks it; ``like``, any row of the checkpoint,
    names it when every part is missing. (The win rate starts from these rows: ``win_rates``.)

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
           "evaluation": "*", "metric": AGGREGATE, "higher_is_better": True,
           "value": math.nan, "ci_low": None, "ci_high": None, "replicates": None,
           "aggregate": MEAN if weights is None else WEIGHTS,
           "evaluations": list(evaluations),
           "metrics": [None if p is None else p["metric"] for p in parts],
           "num_samples": sum(p["num_samples"] for p in present),
           "created_at": max((p["created_at"] for p in present if p.get("created_at")),
                             default=None),
           "bootstrap": first.get("bootstrap")
           if len({p.get("bootstrap") for p in present}) == 1 else None,
           "confidence": confidence_of(first), "parts": parts}
    if weights is not None:
        row["weights"] = list(weights)
    if len(present) < len(parts):
        return row
    signs = _factors(row)
    values = [math.nan if p["value"] is None else p["value"] for p in parts]
    row["value"] = sum(s * v for s, v in zip(signs, values)) / len(parts)
    _defer(row, [replicates_of(p) for p in parts], deferred)
    return row


def _factors(row: dict) -> list[float]:
    """What each part's value (and replicate) is multiplied by before the sum is divided by
    the number of parts: its direction, times its weight's share (weights w: n * w / sum(w),
    so that the division by n gives the weighted mean; 1 for a plain mean, the same bits)."""
    signs = [direction(p["higher_is_better"]) for p in row["parts"]]
    weights = row.get("weights")
    if weights is None:
        return signs
    n, total = len(weights), sum(weights)
    return [s * n * w / total for s, w in zip(signs, weights)]


def _defer(row: dict, reps: list, deferred: list | None) -> None:
    """The interval of a complete aggregate row from its parts' replicates ``reps``: none when
    some part has none or their counts differ; now, or left in ``deferred``."""
    if len({len(r) for r in reps}) > 1 or not len(reps[0]):
        return                               # the value stands, without an interval
    if deferred is not None:
        deferred.append((row, reps, _factors(row)))
    else:
        fill_intervals([(row, reps, _factors(row))])


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

def aggregates(rows: list[dict], how: Aggregate | str | None = None) -> list[dict]:
    """One aggregate row per (sweep, checkpoint) of rows held as dicts with their own
    replicates, combined as ``how`` says (default: the mean win rate over the rows'
    checkpoints); none when the rows hold fewer than two evaluations."""
    how = aggregate_spec(how)
    evaluations, found = suite_parts(
        [r["sweep"] for r in rows], [r["checkpoint"] for r in rows],
        [r["evaluation"] for r in rows], [r["metric"] for r in rows],
        ranked(len(r.get("matrix") or ()) for r in rows))
    evaluations, weights = _weighted(evaluations, weights_for(how, evaluations))
    deferred: list = []
    out = [aggregate_row([None if e not in own else rows[own[e]] for e in evaluations],
                         evaluations, rows[first], deferred, weights) for first, own in found]
    if how.how == WIN_RATE and len(out) > 1:
        win_rates(out)
    else:
        fill_intervals(deferred)
    return out


def stored_aggregates(table: pa.Table, store: ResultStore, sweep: str | None = None,
                      how: Aggregate | str | None = None) -> list[dict]:
    """``aggregates`` of a store's rows read as a table without their replicates: a mean's
    interval from a suite file whose combination is of exactly its rows, else (and for the
    other aggregates) from its rows' replicates, read alone."""
    how = aggregate_spec(how)
    if table.num_rows == 0:
        return []
    evaluations, found = suite_parts(
        table["sweep"], table["checkpoint"], table["evaluation"], table["metric"],
        ranked_of(table))
    if not found:
        return []
    evaluations, weights = _weighted(evaluations, weights_for(how, evaluations))
    wanted = sorted({i for first, own in found for i in (first, *own.values())})
    fields = dict(zip(wanted, table.take(pa.array(wanted, pa.int64()))
                      .select(_PART_FIELDS).to_pylist()))
    rows = [aggregate_row([None if e not in own else fields[own[e]] for e in evaluations],
                          evaluations, fields[first], weights=weights) for first, own in found]
    if how.how == WIN_RATE and len(rows) > 1:
        need = {_part_key(p) for r in rows for p in r["parts"] if p is not None}
        replicates = store.replicates(need, sweep)
        win_rates(rows, lambda p: replicates.get(_part_key(p)))
    else:
        _stored_intervals(rows, store, sweep, suite_files=weights is None)
    return rows


def _part_key(p: dict) -> tuple:
    return p["cell"], p["evaluation"], p["metric"]


def _stored_intervals(rows: list[dict], store: ResultStore, sweep: str | None,
                      suite_files: bool = True) -> None:
    complete = [r for r in rows if all(p is not None for p in r["parts"])]
    if not complete:
        return
    kept = _suites(store, sweep) if suite_files else {}     # suite files hold plain means
    missing = []
    for row in complete:
        found = kept.get(_suite_key(row))
        if found is None:
            missing.append(row)
        elif found[0] is not None:
            row["replicates"], row["ci_low"], row["ci_high"] = found
    if not missing:
        return
    need = {_part_key(p) for r in missing for p in r["parts"]}
    replicates = store.replicates(need, sweep)
    deferred: list = []
    for row in missing:
        reps = [replicates.get(_part_key(p)) for p in row["parts"]]
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
