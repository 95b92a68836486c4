"""A board's columns: one per (evaluation, metric) of the ranked rows, and the aggregate's;
the column a user names (``--metric``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rayeval.errors import StoreError
from rayeval.ranking.aggregate import AGGREGATE


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
