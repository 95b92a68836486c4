"""Per-item records: what a checkpoint did with each item of a text task.

A worker's pass keeps, for each item it scored, the item's id, the context the model saw, the
choices (multiple choice), the target, the response (the choice with the highest
log-likelihood, or the generated text; all of them as ``responses`` when sampled repeatedly), the log-likelihoods (each choice's, or the document's)
and the item's value of each metric that has one (``evaluate.item_values``). Each worker writes
its own items (``reporting.store.ResultStore.write_samples``); nothing is gathered.
"""

from __future__ import annotations

import pyarrow as pa

# The columns every record has, in order, and their types; metric values follow (float64).
# ``id`` keeps the id column's own type (a content id is int64).
COLUMNS = {
    "context": pa.string(),
    "images": pa.list_(pa.string()),         # image items: each image's path, or its size
    "choices": pa.list_(pa.string()),
    "target": pa.string(),
    "response": pa.string(),
    "responses": pa.list_(pa.string()),      # every generation, with generation.repeats > 1
    "loglikelihoods": pa.list_(pa.float64()),
    "tokens": pa.int64(),
}


def records_table(batches: list[dict[str, list]]) -> pa.Table:
    """One table from the records of a pass's scored batches (column lists per batch)."""
    names = list(dict.fromkeys(k for b in batches for k in b))
    columns = {k: [v for b in batches for v in b.get(k, [None] * _rows(b))] for k in names}
    arrays, fields = [], []
    if "id" in columns:
        arrays.append(pa.array(columns.pop("id")))
        fields.append(pa.field("id", arrays[-1].type))
    for name, typ in COLUMNS.items():
        if name in columns:
            values = columns.pop(name)
            if all(v is None for v in values):   # not the task's (a document's target)
                continue
            if name == "target":
                values = [None if v is None else str(v) for v in values]
            arrays.append(pa.array(values, typ))
            fields.append(pa.field(name, typ))
    for name, values in columns.items():          # the metrics', in the sweep's order
        arrays.append(pa.array(values, pa.float64()))
        fields.append(pa.field(name, pa.float64()))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _rows(batch: dict[str, list]) -> int:
    return len(next(iter(batch.values()))) if batch else 0
