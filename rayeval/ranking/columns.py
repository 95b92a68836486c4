"""A board's columns: one per (evaluation, metric) of the ranked rows, and the aggregate's;
the column a user names (``--metric``); the interval a cell shows (``shown_interval``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rayeval.errors import StoreError
from rayeval.io.store import confidence_of
from rayeval.ranking.rules import AGGREGATE, members, shared_evaluations


def value_of(row: dict | None) -> float | None:
    """A row's value, or None when it is missing or NaN."""
    v = None if row is None else row.get("value")
    return None if v is None or math.isnan(v) else v


# --- the interval a cell shows -------------------------------------------------------------

def shown_interval(row: dict | None) -> tuple[float | None, float | None, str]:
    """(low, high, kind) of the interval every format shows for a row: kind "bootstrap", the
    stored interval as it is; "exact" where that interval is a point because every item
    scored the same 0 or 1 (value exactly 0 or 1, ci_low == ci_high == value, num_samples >
    0): resampling identical items cannot vary, so the bootstrap says "certain" of 40 items
    all wrong. There the Clopper-Pearson exact binomial interval of 0 (or n) successes in n =
    num_samples, at the row's confidence (``confidence_of``), says how far the rate may be
    from the 0 (or 1) observed. "" (None, None) when the row has no interval.

    An aggregate row is left as it is: its num_samples sums evaluations of different sizes,
    not n draws of one rate."""
    low, high = (None, None) if row is None else (row.get("ci_low"), row.get("ci_high"))
    if _missing(low) or _missing(high) or value_of(row) is None:
        return None, None, ""
    if _degenerate(row):
        return exact_binomial(row["value"], int(row["num_samples"]), confidence_of(row))
    return low, high, "bootstrap"


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _degenerate(row: dict) -> bool:
    """All n items scored the same 0 or 1: the stored interval is the value itself."""
    v = row["value"]
    return v in (0.0, 1.0) and row["ci_low"] == v == row["ci_high"] \
        and (row.get("num_samples") or 0) > 0 and row.get("parts") is None


def exact_binomial(value: float, n: int, confidence: float) -> tuple[float, float, str]:
    """The Clopper-Pearson interval of 0 successes in n (``value`` 0) or n in n (1), in
    closed form: with no success the upper bound solves (1 - p)^n = alpha / 2 (the same
    alpha / 2 as the two-sided interval's other tail, as scipy's ``binomtest`` does)."""
    edge = (0.5 * (1.0 - confidence)) ** (1.0 / n)
    return (0.0, 1.0 - edge, "exact") if value == 0.0 else (edge, 1.0, "exact")


# --- a count ---------------------------------------------------------------------------------

# Metrics stored as a count of items, without an interval (``core.judge.JudgeFailed``:
# items whose judge verdict could not be read).
COUNTS = ("judge_failed",)


def count_text(row: dict | None) -> str | None:
    """"3 of 40 (7.5%)" for a count's row (``COUNTS``, stored without an interval); None for
    any other row (an lmms-eval task's own ``judge_failed`` is a mean, with its interval)."""
    if row is None or row.get("metric") not in COUNTS or not _missing(row.get("ci_low")):
        return None
    v, n = value_of(row), row.get("num_samples") or 0
    if v is None or not n:
        return None
    return f"{int(v):,} of {n:,} ({100 * v / n:.1f}%)"


# --- a cell scored on a limit: -------------------------------------------------------------

LIMITED = "\u2020"        # "†": a cell scored on the first items of a task (``limit:``)


def limit_text(row: dict | None) -> str | None:
    """"limit: 30 of 2,376 items" for a row scored on an lm-eval or lmms-eval entry's
    ``limit:`` (the first ``num_samples`` of its task's ``limited_from`` documents); for an
    aggregate, which of its parts were; None for a row of the whole task."""
    if row is None:
        return None
    of = row.get("limited_from")
    if of is not None:
        return f"limit: {row['num_samples']:,} of {of:,} items"
    parts = [p for p in row.get("parts") or () if p is not None and
             p.get("limited_from") is not None]
    if not parts:
        return None
    return "averages " + ", ".join(f"{p['evaluation']} ({limit_text(p)})" for p in parts)


# --- columns -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Column:
    name: str                  # "val/accuracy"; "accuracy" when one evaluation; "aggregate"
    evaluation: str            # the store's evaluation column; "*" for the aggregate
    metric: str
    higher_is_better: bool


AGGREGATE_COLUMN = Column(AGGREGATE, "*", AGGREGATE, True)


def ranked_rows(rows: list[dict]) -> list[dict]:
    """The rows that hold a number (confusion matrices are shown, not ranked)."""
    return [r for r in rows if not r.get("matrix")]


def evaluations_of(rows: list[dict]) -> list[str]:
    """The evaluations (data sets) of ranked rows, by name: the store's file order follows
    content keys, so it says nothing about the suite's order."""
    return sorted({r["evaluation"] for r in ranked_rows(rows)})


def columns_of(rows: list[dict]) -> list[Column]:
    """One column per (evaluation, metric): evaluations by name, each one's metrics in the
    order they are stored (a cell keeps the sweep's metric order); the aggregate first when
    it combines several evaluations that every sweep of the rows holds (a group's members
    are not counted: one lm-eval group shown with its members, ``--members``, has no
    aggregate, not a column of '-'; nor have two sweeps that share fewer than two)."""
    evaluations = evaluations_of(rows)
    qualified = len(evaluations) > 1
    shared = shared_evaluations([r["sweep"] for r in rows], [r["evaluation"] for r in rows])
    combined = len(set(shared) - members(shared)) > 1     # what every sweep holds
    found: dict[tuple[str, str], Column] = {}
    for r in ranked_rows(rows):
        key = (r["evaluation"], r["metric"])
        if key not in found:
            name = f"{key[0]}/{key[1]}" if qualified else key[1]
            found[key] = Column(name, key[0], key[1], bool(r["higher_is_better"]))
    columns = sorted(found.values(), key=lambda c: evaluations.index(c.evaluation))
    return ([AGGREGATE_COLUMN] if combined else []) + columns


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
        shown = sorted({c.evaluation for c in columns})
        kept = [e for e in shown if e not in members(shown)]
        raise StoreError(f"{what}: aggregate needs results on two or more evaluations; the rows "
                         f"shown hold only {', '.join(kept)}"
                         + (" (and its group's members)" if len(kept) < len(shown) else ""))
    raise StoreError(f"{what}: no results for metric {name!r}; the store has: "
                     f"{', '.join(c.name for c in columns) or 'nothing'}")
