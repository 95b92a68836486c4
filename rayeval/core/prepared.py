"""A batch prepared on a Ray Data CPU stage: the transform's tensors, or a text task's
tokens, carried in the table.

A stage runs ``dataset.transform`` where the data is read, away from the evaluation worker,
and hands the worker a table whose ``INPUTS`` columns hold the model's inputs, each row's
bytes exactly as the transform made them (any dtype, bfloat16 too: no rounding on the way).
A batch the transform failed on becomes a table with an ``ERROR`` column and its row count,
so the worker fails that evaluation's cells as it would have failed them itself, and every
row is still accounted for. When the evaluation keeps per-item records, the stage also adds
the thumbnails of the rows' images (``THUMBNAILS``): only it still has the images.

A text task's stage tokenizes (prompts, choices, rolling windows) with the driver's tokenizer
and adds each row's tokens as a ``TEXT`` column, keyed by the tokenizer; the row's own columns
stay, so a worker whose checkpoint has another tokenizer tokenizes them itself. An image
task's stage does the same with the checkpoint's processor (``attach_arrays``): decoded images
and the processor's outputs as typed columns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
import pyarrow as pa

from rayeval.errors import DataError
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

INPUTS = "__rayeval_inputs"      # one column (a tensor) or INPUTS.<keyword> columns
ERROR = "__rayeval_error"
TEXT = "__rayeval_text"
THUMBNAILS = "__rayeval_thumbnails"   # per-item records: each row's images as PNG thumbnails
_META = b"rayeval.tensor"
_TOKENIZER = b"rayeval.tokenizer"


def attach(table: pa.Table, x, keep: list[str]) -> pa.Table:
    """The columns ``keep`` of ``table`` and the inputs ``x`` (a tensor or keyword tensors)."""
    cols = {c: table.column(c) for c in keep if c in table.column_names}
    fields = [table.schema.field(c) for c in cols]
    named = x.items() if isinstance(x, Mapping) else [(None, x)]
    arrays = list(cols.values())
    for name, t in named:
        array, field = _encode(t, INPUTS if name is None else f"{INPUTS}.{name}")
        arrays.append(array)
        fields.append(field)
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def attach_thumbnails(table: pa.Table, thumbnails: list[list[bytes]]) -> pa.Table:
    """``table`` with each row's image thumbnails (``core.samples.image_thumbnails``), made
    where the images were decoded: the worker gets the transform's tensors, not the images."""
    return table.append_column(THUMBNAILS, pa.array(thumbnails, pa.list_(pa.binary())))


def thumbnails(table) -> list[list[bytes]] | None:
    """The thumbnails a stage attached; None when it attached none."""
    return table.column(THUMBNAILS).to_pylist() if THUMBNAILS in table.schema.names else None


def failed(table: pa.Table, error: DataError) -> pa.Table:
    """The stand-in for a batch the transform failed on: its row count and the message."""
    return pa.table({ERROR: pa.array([error.message] * table.num_rows, pa.string())})


def attach_text(table: pa.Table, rows: list, extra: list, tokenizer_key: str) -> pa.Table:
    """``table`` with each row's tokens (and what scoring needs beside them) in ``TEXT``, as
    plain JSON: a data file that carries such a column is read as data, never run."""
    payload = pa.array([json.dumps(_plain([r, e]), separators=(",", ":"), allow_nan=True)
                        .encode() for r, e in zip(rows, extra)], pa.binary())
    field = pa.field(TEXT, pa.binary(), metadata={_TOKENIZER: tokenizer_key})
    return table.append_column(field, payload)


def text_rows(table, tokenizer_key: str) -> tuple[list, list, int] | None:
    """(rows, extra, bytes) a stage tokenized with this tokenizer; None when it did not
    (no stage, or another tokenizer)."""
    names = table.schema.names
    if TEXT not in names:
        return None
    meta = table.schema.field(TEXT).metadata or {}
    if meta.get(_TOKENIZER, b"").decode() != tokenizer_key:
        return None
    blobs = table.column(TEXT).to_pylist()
    try:
        pairs = [_unplain(json.loads(b)) for b in blobs]
    except (ValueError, TypeError, AttributeError) as e:   # not what a stage writes
        raise DataError(f"column {TEXT} holds something rayeval's stages do not write "
                        f"({type(e).__name__}); the name is reserved: rename that column in "
                        "the data set") from None
    return [p[0] for p in pairs], [p[1] for p in pairs], 8 * sum(len(b) for b in blobs)


# What a text task's rows hold (ints, floats, strings, None, lists, tuples, bytes, mappings),
# as JSON that keeps every type: a tuple stays a tuple (rows of (context, continuation) pairs),
# a float its exact value. A type outside these is a bug in the task, said at once.
def _plain(obj):
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return {"t": [_plain(v) for v in obj]}
    if isinstance(obj, bytes):
        return {"b": obj.decode("latin-1")}
    if isinstance(obj, Mapping):
        return {"m": [[_plain(k), _plain(v)] for k, v in obj.items()]}
    raise TypeError(f"a text row holds a {type(obj).__name__}, which the stage cannot carry")


def _unplain(obj):
    if isinstance(obj, list):
        return [_unplain(v) for v in obj]
    if isinstance(obj, dict):
        (tag, value), = obj.items()
        if tag == "t":
            return tuple(_unplain(v) for v in value)
        if tag == "b":
            return value.encode("latin-1")
        return {_unplain(k): _unplain(v) for k, v in value}
    return obj


# An image task's stage output: per row, a few named lists of arrays of any shape and dtype
# (the decoded images, the processor's outputs), each name as two typed columns: the raw
# bytes (list<binary>) and the shapes (list<list<int64>>), the dtype in the field's metadata.
# Plain bytes, never pickles; float32 pixel values travel bit for bit.
VISION = "__rayeval_vision"
_DTYPE = b"rayeval.dtype"


def attach_arrays(table: pa.Table, rows: list[dict[str, list]], texts: dict[str, list],
                  key: str) -> pa.Table:
    """``table`` with each row's named arrays (``rows[i][name]``: a list of numpy arrays or
    tensors of one dtype per name) and named strings (``texts[name][i]``), keyed by the
    processor that made them."""
    names = list(rows[0]) if rows else []
    for name in names:
        arrays = [[_numpy(a) for a in row[name]] for row in rows]
        dtypes = {str(a.dtype) for row in arrays for a in row}
        if len(dtypes) > 1:
            raise TypeError(f"{name}: arrays of several dtypes {sorted(dtypes)} in one column")
        meta = {_DTYPE: (dtypes.pop() if dtypes else "uint8").encode(), _TOKENIZER: key.encode()}
        data = pa.array([[a.tobytes() for a in row] for row in arrays], pa.list_(pa.binary()))
        shapes = pa.array([[list(a.shape) for a in row] for row in arrays],
                          pa.list_(pa.list_(pa.int64())))
        table = table.append_column(pa.field(f"{VISION}.{name}", data.type, metadata=meta),
                                    data)
        table = table.append_column(f"{VISION}.{name}.shape", shapes)
    for name, values in texts.items():
        table = table.append_column(pa.field(f"{VISION}:{name}", pa.string(),
                                             metadata={_TOKENIZER: key.encode()}),
                                    pa.array(values, pa.string()))
    return table


def array_rows(table, key: str) -> tuple[list[dict[str, list]], dict[str, list]] | None:
    """(rows of named arrays, named strings) a stage attached with this processor; None when
    no stage did (or one with another processor)."""
    names = table.schema.names
    mine = [n for n in names if n.startswith(VISION) and not n.endswith(".shape")]
    if not mine:
        return None
    fields = [table.schema.field(n) for n in mine]
    if any((f.metadata or {}).get(_TOKENIZER, b"").decode() != key for f in fields):
        return None
    rows: list[dict[str, list]] = [{} for _ in range(table.num_rows)]
    texts: dict[str, list] = {}
    for f in fields:
        if f.name.startswith(VISION + ":"):
            texts[f.name[len(VISION) + 1:]] = table.column(f.name).to_pylist()
            continue
        name = f.name[len(VISION) + 1:]
        dtype = np.dtype(f.metadata[_DTYPE].decode())
        data = table.column(f.name).to_pylist()
        shapes = table.column(f.name + ".shape").to_pylist()
        for i, (blobs, dims) in enumerate(zip(data, shapes)):
            rows[i][name] = [np.frombuffer(b, dtype=dtype).reshape(d).copy()
                             for b, d in zip(blobs, dims)]
    return rows, texts


def _numpy(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().contiguous().numpy()
    return np.ascontiguousarray(a)


def is_prepared(table) -> bool:
    names = table.column_names if isinstance(table, pa.Table) else table.schema.names
    return any(n == ERROR or n == INPUTS or n.startswith(INPUTS + ".") for n in names)


def inputs(table):
    """The inputs a stage attached; the stage's DataError for a failed batch."""
    names = table.schema.names
    if ERROR in names:
        raise DataError(table.column(ERROR)[0].as_py())
    if INPUTS in names:
        return _decode(table, INPUTS)
    return {n[len(INPUTS) + 1:]: _decode(table, n) for n in names if n.startswith(INPUTS + ".")}


def _encode(t: torch.Tensor, name: str) -> tuple[pa.Array, pa.Field]:
    t = t.detach().cpu().contiguous()
    n = t.shape[0]
    raw = t.reshape(n, -1).view(torch.uint8) if t.numel() else t.new_empty((n, 0)).view(
        torch.uint8)
    width = raw.shape[1]
    data = raw.reshape(-1).numpy()
    array = pa.Array.from_buffers(pa.binary(width), n, [None, pa.py_buffer(data)]) \
        if width else pa.array([b""] * n, pa.binary(0))
    meta = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape[1:])}
    return array, pa.field(name, pa.binary(width), metadata={_META: json.dumps(meta)})


def _decode(table, name: str) -> torch.Tensor:
    field = table.schema.field(name)
    meta = json.loads(field.metadata[_META])
    col = table.column(name)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    width = field.type.byte_width
    n = len(col)
    dtype = getattr(torch, meta["dtype"])
    if width == 0:
        return torch.empty((n, *meta["shape"]), dtype=dtype)
    buf = col.buffers()[1]
    data = np.frombuffer(buf, dtype=np.uint8, count=n * width, offset=col.offset * width)
    # A copy: the batch may live in read-only Ray object-store memory that a cache must not pin.
    return torch.from_numpy(data.copy()).view(dtype).reshape(n, *meta["shape"])
