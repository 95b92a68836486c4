"""Two checkpoints side by side: paired bootstrap differences of one metric (or of two
aggregates) on the same replicates, and finding the checkpoint a user named.

Replicate b of an evaluation is the same resample for every checkpoint (the Poisson weights
come from a hash of the seed, the row id and b), so A - B on replicate b is a draw from the
bootstrap distribution of the difference: no item-level data is read to pair two rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from rayeval.errors import StoreError
from rayeval.config.run_schema import WIN_RATE, Aggregate
from rayeval.io.store import confidence_of
from rayeval.ranking.aggregate import AGGREGATE, aggregate_row, aggregate_spec, weights_for
from rayeval.ranking.replicates import percentiles, replicates_of, same_resamples
from rayeval.ranking.win_rate import win_rates
from rayeval.ranking.columns import (AGGREGATE_COLUMN, columns_of, evaluations_of, ranked_rows,
                                     resolve_metric)
from rayeval.ranking.rules import direction, stored_headlines


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


def paired(a: dict, b: dict, confidence: float = 0.95) -> Paired | None:
    """The paired bootstrap difference of two rows of one metric (or two aggregates), or None
    when they do not share replicates (bootstrap off, other data, other seed or bucket count)."""
    return paired_rows([a], b, confidence)[0]


def paired_rows(rows: list[dict], b: dict, confidence: float = 0.95) -> list[Paired | None]:
    """``paired(a, b)`` of each row ``a`` against one ``b``, on one matrix of differences (rows
    x replicates): a column's marks and a report's differences to a reference make no call per
    pair (a 1,000-checkpoint report spent most of its 67 s on one torch call each). The
    interval is ``aggregate.percentiles``'; the share of replicates where A is better counts
    wins plus half the ties over the non-NaN differences, as a mean of 1, 0.5 and 0 does."""
    found: list[Paired | None] = [None] * len(rows)
    at = [i for i, a in enumerate(rows) if pairable(a, b)]
    if not at:
        return found
    d = np.stack([np.asarray(rows[i]["replicates"], dtype=np.float64) for i in at]) - \
        np.asarray(b["replicates"], dtype=np.float64)
    lo, hi = percentiles(d, confidence)
    sign = np.array([direction(rows[i]["higher_is_better"]) for i in at])[:, None]
    counted = (~np.isnan(d)).sum(axis=1)
    wins = (sign * d > 0).sum(axis=1) + 0.5 * (d == 0).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        better = wins / counted
    for k, i in enumerate(at):
        found[i] = Paired(rows[i]["value"] - b["value"], float(lo[k]), float(hi[k]),
                          float(better[k]))
    return found


# --- comparing two checkpoints -------------------------------------------------------------

@dataclass
class Comparison:
    name: str                     # a column name: METRIC, EVAL/METRIC or aggregate
    a: dict
    b: dict
    paired: Paired | None         # None: no shared replicates


def compare(a_rows: list[dict], b_rows: list[dict], metric: str | None = None,
            aggregate: Aggregate | str | None = None) -> list[Comparison]:
    """A - B for every (evaluation, metric) both checkpoints hold, plus the aggregate when they
    share several evaluations; ``metric`` restricts to one column (``resolve_metric``).
    The aggregate is a board's of A and B alone (``ranking.aggregate``, ``aggregate`` says
    how; default the mean win rate: A's is the share of the evaluations on which A beats B,
    ties half, and B's the rest)."""
    how = aggregate_spec(aggregate)
    a_rows, b_rows = ranked_rows(a_rows), ranked_rows(b_rows)
    common = [e for e in evaluations_of(a_rows) if e in set(evaluations_of(b_rows))]
    if not common:
        raise StoreError("A and B were not evaluated on a common data set; `rayeval "
                         "leaderboard STORE --format csv` lists what each holds")
    a_rows = [r for r in a_rows if r["evaluation"] in common]
    a_by = {(r["evaluation"], r["metric"]): r for r in a_rows}
    b_by = {(r["evaluation"], r["metric"]): r for r in b_rows if r["evaluation"] in common}
    columns = [c for c in columns_of(a_rows) if (c.evaluation, c.metric) in b_by]
    firsts = stored_headlines(*([r[k] for r in a_rows] for k in
                                ("sweep", "checkpoint", "evaluation", "metric")))
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
        if c.name == AGGREGATE:
            a, b = _aggregates(how, headline, a_by, b_by)
        else:
            a, b = a_by[(c.evaluation, c.metric)], b_by[(c.evaluation, c.metric)]
        found.append(Comparison(c.name, a, b, paired(a, b, confidence_of(a))))
    return found


def _aggregates(how: Aggregate, headline: list[tuple[str, str]], a_by: dict, b_by: dict
                ) -> tuple[dict, dict]:
    """The aggregate rows of A and B over the evaluations both hold (``headline``)."""
    common = [e for e, _ in headline]
    weights = weights_for(how, common)
    if weights is not None:
        headline = [k for k, w in zip(headline, weights) if w > 0]
        weights = [w for w in weights if w > 0]
    evaluations = [e for e, _ in headline]
    a = aggregate_row([a_by[k] for k in headline], evaluations, weights=weights)
    b = aggregate_row([b_by[k] for k in headline], evaluations, weights=weights)
    if how.how == WIN_RATE:
        win_rates([a, b])
    return a, b


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
