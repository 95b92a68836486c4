"""``rayeval leaderboard --format json`` on columns: the same text as ``render.to_json``, for
stores of any size.

Measured on a 100,000-cell store (300,000 rows): writing JSON row by row took 8 s. Here the
stored rows never become Python objects: each column is written as JSON text by Arrow, a
distinct string or timestamp formatted once. What is written (the rows a board shows and its
aggregate rows) comes from ``ranking.board``.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rayeval.ranking.aggregate import ranked_of
from rayeval.reporting.render import to_json

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


# --- JSON text -----------------------------------------------------------------------------

def board_json(table: pa.Table, aggregate_rows: list[dict], chunk: int = 8192):
    """``render.to_json(rows, aggregates=aggregate_rows)`` of a table's rows (every column but
    the replicates), written column by column, as pieces of text ``chunk`` rows at a time (a
    100,000-cell board is ~180 MB of text: held whole, and copied to a Python string and
    its bytes, it took 1.4 GB)."""
    if table.num_rows == 0 or not ranked_of(table).all():
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
