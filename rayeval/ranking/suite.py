"""The suite aggregate's replicates, worked out when a part is written.

A board's aggregate over a suite (``ranking.aggregate``) averages, per
checkpoint, replicate b of each evaluation's headline metric: to print it, a board would read
every headline row's replicates — a third of a store's bytes (a 100,000-cell store: ~800 MB,
~2 s to read and ~2 s to combine on a 2-core machine). A part holds whole runs of a sweep, so
when it is written the combination of each checkpoint's headline rows in it is computed once
and kept beside the part (``store.layout.suite_of``); a board takes it where the checkpoint's
headline rows on the board are exactly those (same evaluations, metrics, cells and writes),
and combines the replicates itself otherwise. The same function (``stats.
combined_intervals_by_shape``) computes both, so the numbers are the same bits.
"""

from __future__ import annotations

from collections import Counter

import pyarrow as pa

from rayeval.io.store import confidence_of, replicate_arrays
from rayeval.ranking.aggregate import ranked_of, suite_parts
from rayeval.ranking.rules import direction

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

_COLUMNS = ("sweep", "checkpoint", "evaluation", "metric", "cell", "created_at",
            "higher_is_better", "bootstrap")


def summaries(rows: pa.Table) -> pa.Table | None:
    """One row per (sweep, checkpoint) of a part's rows (``store.SCHEMA`` plus ``ordinal``)
    whose suite aggregate these rows determine: two or more evaluations (a group's members
    left out), each with exactly one row of its headline metric (``aggregate.suite_parts``,
    the board's own choice). None when no checkpoint qualifies."""
    rows = rows.sort_by([("cell", "ascending"), ("ordinal", "ascending")])   # as a board reads
    _, found = suite_parts(
        rows["sweep"], rows["checkpoint"], rows["evaluation"], rows["metric"],
        ranked_of(rows))
    counts = Counter(zip(rows["sweep"].to_pylist(), rows["checkpoint"].to_pylist(),
                         rows["evaluation"].to_pylist(), rows["metric"].to_pylist()))
    cols = {c: rows[c].to_pylist() for c in _COLUMNS}
    settled = [[own[e] for e in sorted(own)] for _, own in found if len(own) >= 2 and all(
        counts[tuple(cols[c][i] for c in ("sweep", "checkpoint", "evaluation", "metric"))] == 1
        for i in own.values())]
    if not settled:
        return None
    reps = replicate_arrays(rows["replicates"])
    from rayeval.core.stats import combined_intervals_by_shape   # torch: when a part is written

    out, pending = [], []
    for parts in settled:
        first = parts[0]
        row = {"sweep": cols["sweep"][first], "checkpoint": cols["checkpoint"][first],
               "evaluations": [cols["evaluation"][i] for i in parts],
               "metrics": [cols["metric"][i] for i in parts],
               "cells": [cols["cell"][i] for i in parts],
               "stamps": [cols["created_at"][i] for i in parts],
               "confidence": confidence_of({"bootstrap": cols["bootstrap"][first]}),
               "replicates": None, "ci_low": None, "ci_high": None}
        own = [reps[i] if reps[i] is not None else [] for i in parts]
        if len({len(r) for r in own}) == 1 and len(own[0]):     # as aggregate_row decides
            signs = [direction(cols["higher_is_better"][i]) for i in parts]
            pending.append((row, (own, signs, row["confidence"])))
        out.append(row)
    for (row, _), (c, lo, hi) in zip(pending, combined_intervals_by_shape(
            [item for _, item in pending])):
        row["replicates"], row["ci_low"], row["ci_high"] = c.tolist(), lo, hi
    return pa.Table.from_pylist(out, schema=SCHEMA)
