"""``rayeval leaderboard --format json`` on columns: the same text as ``render.to_json`` over
``boards.aggregates``, for stores of any size.

Measured on a 100,000-cell store (300,000 rows, 1,000 replicates each; 2 cores, loaded): the
row-by-row path took 25 s and 2.8 GB — 9 s reading rows and headline replicates into dicts,
6 s combining replicates for the suite aggregate, 8 s writing JSON row by row. Here the
stored rows never become Python objects (each column is written as JSON text by Arrow, a
distinct string or timestamp formatted once), only the aggregate's headline rows do, and the
aggregate's intervals come from the suite files that parts keep (``core.suite``), replicates
being read only for the checkpoints those do not cover.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rayeval.config import names
from rayeval.io.store import ResultStore, replicate_arrays
from rayeval.reporting import boards
from rayeval.reporting.render import to_json

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


# --- the rows a board shows ------------------------------------------------------------------

def ranked_mask(table: pa.Table) -> pa.ChunkedArray:
    """Rows that hold a number (``boards.ranked_rows``): no confusion matrix."""
    return pc.equal(pc.fill_null(pc.list_value_length(table["matrix"]), 0), 0)


def group_members(table: pa.Table) -> set[str]:
    """``boards.group_members`` of a table."""
    datasets = set(pc.unique(table["dataset"]).to_pylist())
    return {d for d in datasets if names.group_of(d) in datasets}


def without_members(table: pa.Table) -> pa.Table:
    """``boards.without_members`` of a table: a group's members left out where the same
    checkpoint holds the group's aggregate."""
    datasets = pc.unique(table["dataset"]).to_pylist()
    if not any(names.group_of(d) in datasets for d in datasets):
        return table
    groups = pa.array([names.group_of(d) for d in table["dataset"].to_pylist()], pa.string())
    shown = set(zip(table["sweep"].to_pylist(), table["checkpoint"].to_pylist(),
                    table["dataset"].to_pylist()))
    keep = [g is None or (s, c, g) not in shown for s, c, g in
            zip(table["sweep"].to_pylist(), table["checkpoint"].to_pylist(),
                groups.to_pylist())]
    return table.filter(pa.array(keep))


def column_rows(table: pa.Table) -> list[dict]:
    """The first ranked row of each (evaluation, metric), as much of it as
    ``boards.columns_of`` reads: the board's columns without a dict per row."""
    ranked = table.filter(ranked_mask(table))
    if ranked.num_rows == 0:
        return []
    _, first = np.unique(_codes(ranked["dataset"], ranked["metric"]), return_index=True)
    return ranked.take(pa.array(first)).select(
        ["sweep", "checkpoint", "dataset", "metric", "higher_is_better", "matrix"]).to_pylist()


def _codes(*columns) -> np.ndarray:
    """Keys of the rows' values in these columns, numbered in order of first appearance."""
    joined = columns[0] if len(columns) == 1 else \
        pc.binary_join_element_wise(*columns, "\x1f")
    return pc.dictionary_encode(joined).combine_chunks().indices.to_numpy(
        zero_copy_only=False)


def first_metrics(table: pa.Table) -> dict[str, str]:
    """``boards.first_metrics`` of a table of ranked rows: each evaluation's headline metric,
    the metric most (sweep, checkpoint, evaluation) keys start with, ties to the first seen."""
    if table.num_rows == 0:
        return {}
    _, heads = np.unique(_codes(table["sweep"], table["checkpoint"], table["dataset"]),
                         return_index=True)        # key codes in appearance order: in order
    datasets = table["dataset"].take(pa.array(heads)).to_pylist()
    metrics = table["metric"].take(pa.array(heads)).to_pylist()
    votes: dict[str, dict[str, int]] = {}
    for d, m in zip(datasets, metrics):
        own = votes.setdefault(d, {})
        own[m] = own.get(m, 0) + 1
    return {d: max(own, key=own.get) for d, own in votes.items()}   # max: the first of ties


# --- the aggregate -------------------------------------------------------------------------

_PART_FIELDS = ["sweep", "checkpoint", "step", "dataset", "metric", "value", "num_samples",
                "created_at", "bootstrap", "higher_is_better", "cell"]


def aggregates(table: pa.Table, store: ResultStore, sweep: str | None = None) -> list[dict]:
    """``boards.aggregates`` of a table, with the intervals of the suite files where they
    cover a checkpoint and of its rows' replicates where they do not."""
    ranked = table.filter(ranked_mask(table))
    members = group_members(table)
    evaluations = [e for e in sorted(set(pc.unique(ranked["dataset"]).to_pylist()))
                   if e not in members]
    if len(evaluations) < 2:
        return []
    firsts = first_metrics(ranked)
    keys = _codes(ranked["sweep"], ranked["checkpoint"])
    order, starts = np.unique(keys, return_index=True)
    like = ranked.take(pa.array(starts)).select(_PART_FIELDS).to_pylist()
    wanted = pc.is_in(pc.binary_join_element_wise(ranked["dataset"], ranked["metric"], "\x1f"),
                      value_set=pa.array([f"{e}\x1f{m}" for e, m in firsts.items()]))
    heads = ranked.filter(wanted)
    parts: list[dict[str, dict]] = [{} for _ in order]
    head_keys = keys[wanted.to_numpy(zero_copy_only=False)]      # the filter's own rows
    for k, r in zip(head_keys, heads.select(_PART_FIELDS).to_pylist()):
        parts[k][r["dataset"]] = r
    rows = [boards.aggregate_row([own.get(e) for e in evaluations], evaluations, like[k])
            for k, own in enumerate(parts)]
    _intervals(rows, store, sweep)
    return rows


def _intervals(rows: list[dict], store: ResultStore, sweep: str | None) -> None:
    """Each complete aggregate's interval: from a suite file whose combination is of exactly
    its rows, else from its rows' replicates (``boards.fill_intervals``)."""
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
    deferred = []
    for row in missing:
        reps = [replicates.get((p["cell"], p["dataset"], p["metric"])) for p in row["parts"]]
        reps = [[] if r is None else r for r in reps]
        if len({len(r) for r in reps}) == 1 and len(reps[0]):       # as aggregate_row does
            signs = [1.0 if p["higher_is_better"] else -1.0 for p in row["parts"]]
            deferred.append((row, reps, signs))
    boards.fill_intervals(deferred)


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


# --- JSON text -----------------------------------------------------------------------------

def board_json(table: pa.Table, aggregate_rows: list[dict], chunk: int = 8192):
    """``render.to_json(rows, aggregates=aggregate_rows)`` of a table's rows (every column but
    the replicates), written column by column, as pieces of text ``chunk`` rows at a time (a
    100,000-cell board is ~180 MB of text: held whole, and copied to a Python string and
    its bytes, it took 1.4 GB)."""
    if table.num_rows == 0 or not pc.all(ranked_mask(table)).as_py():
        yield to_json(table.to_pylist(), aggregates=aggregate_rows)   # matrices: few rows
        return
    yield "[\n"
    for start in range(0, table.num_rows, chunk):
        part = table.slice(start, chunk)
        pieces: list = []
        for i, name in enumerate(part.column_names):
            lead = "  {\n    " if i == 0 else ",\n    "
            pieces += [f"{lead}{json.dumps(name)}: ", _json_values(part[name], name)]
        pieces += ["\n  }", ""]
        rows = pc.binary_join_element_wise(*pieces).combine_chunks()
        lists = pa.ListArray.from_arrays(pa.array([0, len(rows)], pa.int32()), rows)
        yield ("" if start == 0 else ",\n") + pc.binary_join(lists, ",\n")[0].as_py()
    if aggregate_rows:
        yield ",\n" + to_json([], aggregates=aggregate_rows)[2:-3]
    yield "\n]\n"


def _json_values(column: pa.ChunkedArray, name: str) -> pa.Array:
    """A column's values as JSON text, as ``json.dumps`` writes them after ``to_json``'s
    cleaning (a missing value, ci_low or ci_high: null)."""
    kind = column.type
    if pa.types.is_string(kind):
        return _distinct(column, json.dumps)
    if pa.types.is_integer(kind):
        return pc.fill_null(pc.cast(column, pa.string()), "null")
    if pa.types.is_boolean(kind):
        return pc.fill_null(pc.if_else(column, "true", "false"), "null")
    if pa.types.is_floating(kind):
        return _floats(column, "null" if name in ("value", "ci_low", "ci_high") else "NaN")
    if pa.types.is_timestamp(kind):
        micros = pc.cast(column.cast(pa.timestamp("us", tz=kind.tz)), pa.int64())
        return _distinct(micros, lambda us: json.dumps(
            (_EPOCH + timedelta(microseconds=us)).isoformat()))
    if column.null_count == len(column):
        return pa.array(["null"] * len(column), pa.string())
    raise TypeError(f"no JSON text for column {name!r} of type {kind}")


def _distinct(column, text) -> pa.Array:
    """``text`` of each distinct value once, then taken for every row; null: null."""
    encoded = pc.dictionary_encode(column).combine_chunks()
    values = pa.array([text(v) for v in encoded.dictionary.to_pylist()], pa.string())
    return pc.fill_null(values.take(encoded.indices), "null")


def _floats(column: pa.ChunkedArray, missing: str) -> pa.Array:
    """``json.dumps`` of each float (its ``repr``; infinities as JSON's ``Infinity``), null
    and NaN as ``missing``."""
    values = column.to_numpy(zero_copy_only=False).astype(np.float64)   # null: NaN
    text = np.array(list(map(float.__repr__, values.tolist())), dtype=object)
    odd = ~np.isfinite(values)
    text[odd] = [missing if np.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
                 for v in values[odd]]
    return pa.array(text, pa.string())
