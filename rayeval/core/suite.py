"""The suite aggregate's replicates, worked out when a part is written.

A board's aggregate over a suite (``reporting.boards.aggregate_row``) averages, per
checkpoint, replicate b of each evaluation's headline metric: to print it, a board would read
every headline row's replicates — a third of a store's bytes (a 100,000-cell store: ~800 MB,
~2 s to read and ~2 s to combine on a 2-core machine). A part holds whole runs of a sweep, so
when it is written the combination of each checkpoint's headline rows in it is computed once
and kept beside the part (``store_layout.suite_of``); a board takes it where the checkpoint's
headline rows on the board are exactly those (same evaluations, metrics, cells and writes),
and combines the replicates itself otherwise. The same function (``stats.
combined_intervals_by_shape``) computes both, so the numbers are the same bits.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from rayeval.config import names
from rayeval.core.stats import combined_intervals_by_shape
from rayeval.io.store import confidence_of, replicate_arrays

SCHEMA = pa.schema([
    pa.field("sweep", pa.string()),
    pa.field("checkpoint", pa.string()),
    pa.field("evaluations", pa.list_(pa.string())),      # by name, a group's members left out
    pa.field("metrics", pa.list_(pa.string())),          # each evaluation's headline metric
    pa.field("cells", pa.list_(pa.string())),            # the rows combined: their cells
    pa.field("stamps", pa.list_(pa.timestamp("us", tz="UTC"))),   # and their writes
    pa.field("confidence", pa.float64()),
    pa.field("replicates", pa.list_(pa.float64())),      # null: the parts' replicates differ
    pa.field("ci_low", pa.float64()),
    pa.field("ci_high", pa.float64()),
])

_COLUMNS = ("sweep", "checkpoint", "dataset", "metric", "cell", "ordinal", "created_at",
            "higher_is_better", "bootstrap")


def summaries(rows: pa.Table) -> pa.Table | None:
    """One row per (sweep, checkpoint) of a part's rows (``store.SCHEMA`` plus ``ordinal``)
    whose suite aggregate these rows determine: two or more evaluations, each with one row of
    its headline metric. None when no checkpoint qualifies."""
    cols = {c: rows[c].to_pylist() for c in _COLUMNS}
    ranked = pc.equal(pc.fill_null(pc.list_value_length(rows["matrix"]), 0), 0).to_pylist()
    by_checkpoint: dict[tuple, list[int]] = {}
    for i, (sweep, checkpoint) in enumerate(zip(cols["sweep"], cols["checkpoint"])):
        if ranked[i]:
            by_checkpoint.setdefault((sweep, checkpoint), []).append(i)
    found = [(key, parts) for key, idx in by_checkpoint.items()
             if (parts := _headline(cols, idx)) is not None]
    if not found:
        return None
    reps = replicate_arrays(rows["replicates"])
    out, pending = [], []
    for (sweep, checkpoint), parts in found:
        row = {"sweep": sweep, "checkpoint": checkpoint,
               "evaluations": [cols["dataset"][i] for i in parts],
               "metrics": [cols["metric"][i] for i in parts],
               "cells": [cols["cell"][i] for i in parts],
               "stamps": [cols["created_at"][i] for i in parts],
               "confidence": confidence_of({"bootstrap": cols["bootstrap"][parts[0]]}), "replicates": None,
               "ci_low": None, "ci_high": None}
        own = [reps[i] if reps[i] is not None else [] for i in parts]
        if len({len(r) for r in own}) == 1 and len(own[0]):     # as aggregate_row decides
            signs = [1.0 if cols["higher_is_better"][i] else -1.0 for i in parts]
            pending.append((row, (own, signs, row["confidence"])))
        out.append(row)
    for (row, _), (c, lo, hi) in zip(pending, combined_intervals_by_shape(
            [item for _, item in pending])):
        row["replicates"], row["ci_low"], row["ci_high"] = c.tolist(), lo, hi
    return pa.Table.from_pylist(out, schema=SCHEMA)


def _headline(cols: dict, idx: list[int]) -> list[int] | None:
    """The rows a board's aggregate of one checkpoint averages, in evaluation order, when
    these rows settle them: each evaluation's first ranked row (by cell, then place in the
    cell) names its headline metric, and exactly one row has it; None otherwise."""
    heads: dict[str, tuple] = {}
    for i in idx:
        key = (cols["cell"][i], cols["ordinal"][i])
        d = cols["dataset"][i]
        if d not in heads or key < heads[d][0]:
            heads[d] = (key, cols["metric"][i])
    datasets = set(heads)
    evaluations = sorted(d for d in datasets if names.group_of(d) not in datasets)
    if len(evaluations) < 2:
        return None
    chosen: dict[str, list[int]] = {}
    for i in idx:
        d = cols["dataset"][i]
        if d in heads and cols["metric"][i] == heads[d][1]:
            chosen.setdefault(d, []).append(i)
    if any(len(chosen[e]) != 1 for e in evaluations):
        return None
    return [chosen[e][0] for e in evaluations]
