"""A batch's rows as the tasks hold them, and the checks on their values: counting, taking,
measuring and pinning decoded inputs (a tensor, a mapping of tensors, a batch object of
per-row lists, or either of the first two with per-item records' items: ``Recorded``), a
transform's output checked, and NaN or infinite inputs named by row and column
(per batch on the workers; on the driver, the input columns scanned before Ray starts).

Split from ``base`` (which re-exports every name here): ``base`` keeps the ``Task`` base class
and the tensor tasks, this module what they call on rows and columns. Plain torch and pyarrow.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from rayeval import errors
from rayeval.config.schema import DatasetSpec
from rayeval.core import stats
from rayeval.core.backends.base import Inputs
from rayeval.errors import DataError, traceback_of
from rayeval.io import data
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)


@dataclasses.dataclass
class Recorded:
    """A tensor task's decoded batch with what each row's per-item record shows of it
    (``items``: a list per record column, one value per row), made only when the evaluation
    keeps records. The model sees ``inputs`` alone (``inputs_of``); the functions here carry
    ``items`` along with the rows they describe (a held shard, a race's round)."""
    inputs: Inputs
    items: dict[str, list]


def inputs_of(x) -> Inputs:
    """What the model takes of a decoded batch."""
    return x.inputs if isinstance(x, Recorded) else x


def map_inputs(x, fn):
    """``fn`` applied to a decoded batch's model inputs, its records' items kept."""
    return Recorded(fn(x.inputs), x.items) if isinstance(x, Recorded) else fn(x)


def rows_of(x: Inputs) -> int:
    x = inputs_of(x)
    return int(next(iter(x.values())).shape[0]) if isinstance(x, Mapping) else int(x.shape[0])


def take(x: Inputs, index: torch.Tensor, rows: int) -> Inputs:
    """The rows ``index`` of a decoded batch of ``rows`` rows (a race's round scores some of
    them): tensors and mappings of tensors are indexed; a batch object (text, image items) has
    each of its per-row lists (and its ``items`` mapping's) taken, its byte count scaled."""
    if isinstance(x, torch.Tensor):
        return x[index]
    if isinstance(x, Mapping):
        return {k: v[index] for k, v in x.items()}
    keep = index.tolist()
    if isinstance(x, Recorded):
        return Recorded(take(x.inputs, index, rows),
                        {k: [v[i] for i in keep] for k, v in x.items.items()})

    def part(v):
        if isinstance(v, list) and len(v) == rows:
            return [v[i] for i in keep]
        if isinstance(v, dict) and all(isinstance(w, list) and len(w) == rows
                                       for w in v.values()):
            return {k: [w[i] for i in keep] for k, w in v.items()}
        return v
    changes = {f.name: part(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if "nbytes" in changes:
        changes["nbytes"] = x.nbytes * len(keep) // max(rows, 1)
    return dataclasses.replace(x, **changes)


def concat(xs: list) -> Inputs | None:
    """Several decoded batches' rows as one: tensors, mappings of tensors, and either with
    records' items (the rows a segment or a race's round takes of several batches, scored
    together); None for a batch object (its task's ``join`` does it)."""
    first = xs[0]
    if len(xs) == 1:
        return first
    if isinstance(first, Recorded):
        inputs = concat([x.inputs for x in xs])
        return None if inputs is None else Recorded(
            inputs, {k: [v for x in xs for v in x.items[k]] for k in first.items})
    if isinstance(first, torch.Tensor):
        return torch.cat(xs) if _same_rows(xs) else None
    if isinstance(first, Mapping):
        if not all(_same_rows([x[k] for x in xs]) for k in first):
            return None            # padded to each batch's own length
        return {k: torch.cat([x[k] for x in xs]) for k in first}
    return None


def _same_rows(ts: list) -> bool:
    return all(isinstance(t, torch.Tensor) and t.shape[1:] == ts[0].shape[1:] for t in ts)


def nbytes(x: Inputs) -> int:
    if isinstance(x, Recorded):
        return nbytes(x.inputs) + _items_nbytes(x.items)
    return sum(int(t.nbytes) for t in x.values()) if isinstance(x, Mapping) else int(x.nbytes)


def _items_nbytes(items: dict[str, list]) -> int:
    """About what records' items hold: each thumbnail's bytes, 8 for any other value (an id,
    a class): what a held shard counts against its budget."""
    return sum(sum(len(t) for t in v) if isinstance(v, list) else 8
               for column in items.values() for v in column)


def pin(x: Inputs) -> Inputs:
    """In page-locked memory, so copies to a GPU are asynchronous and twice as fast."""
    if isinstance(x, Recorded):
        return map_inputs(x, pin)
    if isinstance(x, Mapping):
        return {k: v.pin_memory() for k, v in x.items()}
    return x.pin_memory()


def _words(x: Inputs) -> torch.Tensor:
    """All of a row's input values as int64 words, for content ids."""
    if isinstance(x, Mapping):
        n = rows_of(x)
        return torch.cat([stats.as_int64_words(x[k].reshape(n, -1)) for k in sorted(x)], dim=1)
    return x


def _check_finite(x: Inputs, table, spec: DatasetSpec) -> None:
    """NaN or infinite inputs are the data's fault, not the checkpoint's: name the row and the
    column (or the transform's output) before the model sees them."""
    named = x.items() if isinstance(x, Mapping) else [(None, x)]
    for name, t in named:
        if not t.is_floating_point():
            continue
        if spec.transform:
            what = f"{spec.key_path}.transform: {spec.transform} returned"
            what += f" {name!r} with" if name else ""
        else:
            what = f"{spec.key_path}.inputs: column {name or spec.inputs[0]!r} has"
        _raise_if_not_finite(t, table, spec, what)


def _raise_if_not_finite(t: torch.Tensor, table, spec: DatasetSpec, what: str) -> None:
    """One DataError naming the first row (by its id) whose values are NaN or infinite."""
    if stats.all_finite(t):
        return
    bad = ~torch.isfinite(t.reshape(t.shape[0], -1)).all(dim=1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        row_id = None
        if spec.id is not None:
            row_id = data.column_array(table, spec.id)[i].as_py()
            row = f"the row with {spec.id} = {row_id!r}"
        else:
            row = f"a row (set {spec.key_path}.id to name it)"
        raise DataError(f"{what} NaN or infinite values in {row}; drop or fill such rows",
                        key_path=spec.key_path, row_id=row_id)


def transformed(transform, table, spec: DatasetSpec) -> Inputs:
    """The transform's output for a batch, checked: tensors whose first dimension is the
    batch; a DataError naming the key otherwise."""
    key = f"{spec.key_path}.transform"
    given = table if isinstance(table, pa.Table) else pa.Table.from_batches([table])
    if data.ROW in given.column_names:          # rayeval's own column, not the user's data
        given = given.drop_columns([data.ROW])
    try:
        out = transform(given)
    except DataError:
        raise
    except Exception as e:
        raise errors.wrap(e, DataError, f"{key}: {spec.transform} raised", typed=True, sep=" ",
                          detail=traceback_of(e), key_path=key) from None
    n = table.num_rows

    def tensor(name, value):
        try:
            t = torch.as_tensor(value)
        except Exception:
            raise DataError(f"{key}: {spec.transform} returned {type(value).__name__}"
                            f"{' for ' + repr(name) if name else ''}; return a tensor or a "
                            "mapping of keyword name to tensor") from None
        if t.dim() == 0 or t.shape[0] != n:
            raise DataError(f"{key}: {spec.transform} returned shape {tuple(t.shape)}"
                            f"{' for ' + repr(name) if name else ''} for a batch of {n} rows; "
                            "the first dimension must be the batch")
        return t

    if isinstance(out, Mapping):
        if not out or not all(isinstance(k, str) for k in out):
            raise DataError(f"{key}: {spec.transform} returned an empty mapping or non-string "
                            "keys; return keyword name -> tensor")
        return {k: tensor(k, v) for k, v in out.items()}
    return tensor(None, out)


SCAN_LIMIT_BYTES = 512 << 20     # input columns up to this size are scanned on the driver


def check_finite_inputs(ds: pads.Dataset, spec: DatasetSpec) -> None:
    """NaN or infinite values in float input columns, named by row and column before Ray
    starts. Skipped for a transform's inputs (it decides what they mean) and for columns too
    large to scan in seconds: the workers still check every batch."""
    if spec.transform or not spec.inputs:
        return
    floats = [c for c in spec.inputs
              if pa.types.is_floating(data.leaf_type(ds.schema.field(c).type)[0])]
    if not floats or _column_bytes(ds, floats) > SCAN_LIMIT_BYTES:
        return
    columns = floats + ([spec.id] if spec.id else [])
    for batch in ds.to_batches(columns=columns, batch_size=65536):
        for c in floats:
            arr = data.column_array(batch, c)
            values = arr
            while not pa.types.is_floating(values.type):
                values = values.flatten()
            if pc.all(pc.is_finite(values)).as_py() is not False:
                continue
            t = torch.from_numpy(np.array(values.to_numpy(zero_copy_only=False),
                                          copy=True)).reshape(batch.num_rows, -1)
            _raise_if_not_finite(t, batch, spec, f"{spec.key_path}.inputs: column {c!r} has")


def _column_bytes(ds: pads.Dataset, columns: list[str]) -> int:
    """The uncompressed size of some columns, from the parquet metadata (no data read)."""
    total = 0
    try:
        for fragment in ds.get_fragments():
            meta = fragment.metadata
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                for i in range(group.num_columns):
                    col = group.column(i)
                    if col.path_in_schema.split(".")[0] in columns:
                        total += col.total_uncompressed_size
    except (AttributeError, pa.ArrowInvalid, OSError):
        return SCAN_LIMIT_BYTES + 1          # unknown: do not scan
    return total


def _min_max(ds: pads.Dataset, column: str) -> tuple[int | None, int | None]:
    """A column's min and max: from the parquet statistics when every row group has them,
    else from one scan of that column."""
    lo = hi = None
    try:
        for fragment in ds.get_fragments():
            meta = fragment.metadata
            leaves = [meta.schema.column(i).path for i in range(meta.num_columns)]
            index = leaves.index(column)             # ValueError: not a flat column
            for g in range(meta.num_row_groups):
                st = meta.row_group(g).column(index).statistics
                if st is None or not st.has_min_max:
                    raise LookupError
                lo = st.min if lo is None else min(lo, st.min)
                hi = st.max if hi is None else max(hi, st.max)
        return lo, hi
    except (LookupError, ValueError, AttributeError, pa.ArrowInvalid, OSError):
        pass
    found = pc.min_max(ds.to_table(columns=[column]).column(column))
    return found["min"].as_py(), found["max"].as_py()
