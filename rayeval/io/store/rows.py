"""The stored row's format, read back: one place for what every reader needs of it (the newest
row of each key, replicates as arrays, a metric's direction, a row's bootstrap settings and
confidence level)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def latest_indices(table: pa.Table) -> pa.Array:
    """The index of the newest row for every (sweep, checkpoint, evaluation, metric), in store
    order (of each key's first row); the later row wins a tie. On columns: no row becomes a
    Python object (a 300,000-row store took ~3 s as dicts)."""
    n = table.num_rows
    if n == 0:
        return pa.array([], pa.int64())
    joined = pc.binary_join_element_wise(
        *(table[c] for c in ("sweep", "checkpoint", "evaluation", "metric")), "\x1f")
    # dictionary codes number the keys in order of first appearance: the store order
    codes = joined.combine_chunks().dictionary_encode().indices.to_numpy(zero_copy_only=False)
    stamps = table["created_at"].combine_chunks().cast(pa.int64()) \
        .fill_null(np.iinfo(np.int64).min).to_numpy(zero_copy_only=False)
    order = np.lexsort((np.arange(n), stamps, codes))
    grouped = codes[order]
    last = np.append(grouped[1:] != grouped[:-1], True)
    return pa.array(order[last], pa.int64())


def latest_rows(table: pa.Table) -> list[dict]:
    """The newest row for every (sweep, checkpoint, evaluation, metric), in store order."""
    return table.take(latest_indices(table)).to_pylist()


def replicate_arrays(column: pa.ChunkedArray) -> list[np.ndarray | None]:
    """A list<double> column as one float64 array per row (views of one buffer when every
    row has the same length), None for nulls."""
    out: list[np.ndarray | None] = []
    for chunk in column.chunks:
        values = chunk.values.to_numpy(zero_copy_only=False)     # offsets index these
        offsets = chunk.offsets.to_numpy(zero_copy_only=False)
        valid = chunk.is_valid().to_numpy(zero_copy_only=False)
        out += [values[offsets[i]:offsets[i + 1]] if valid[i] else None
                for i in range(len(chunk))]
    return out


def direction(higher_is_better: bool) -> float:
    """+1.0 for a metric where higher is better (a row's ``higher_is_better``), -1.0 where
    lower is: a lower-is-better metric enters an aggregate, a race and a ranking negated. The
    one place this sign is computed (``ranking.rules`` and ``core.racing`` use it)."""
    return 1.0 if higher_is_better else -1.0


def bootstrap_params(key: str | None) -> dict[str, str]:
    return dict(part.split("=", 1) for part in key.split(";")) if key else {}


def confidence_of(row: dict) -> float:
    if row.get("confidence") is not None:                 # an aggregate row
        return float(row["confidence"])
    return float(bootstrap_params(row.get("bootstrap")).get("confidence", 0.95))
