"""The evaluation data set: found, checked against the sweep, and turned into tensors.

Row counts and schema come from parquet metadata, so inspecting a data set reads no row data
beyond the first row of a variable-length list column.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import torch

from . import paths
from .errors import DataError
from .spec import DatasetSpec

PARQUET_SUFFIXES = (".parquet", ".pq", ".parq")


@dataclass(frozen=True)
class DatasetInfo:
    files: tuple[str, ...]            # locations of the parquet files, sorted
    num_rows: int
    input_shape: tuple[int, ...]      # the shape of one row's inputs
    fingerprint: str                  # changes when a file, its size or mtime, or the schema does


def find_files(location: str) -> list[str]:
    """The parquet files of a data set given as a file, a folder or a glob."""
    try:
        if paths.has_glob(location):
            files = [f for f in paths.glob(location) if not paths.is_dir(f)]
        elif paths.is_dir(location):
            files = paths.list_files(location, PARQUET_SUFFIXES) or paths.list_files(location)
        else:
            files = paths.glob(location)
    except OSError as e:
        raise DataError(f"dataset.path: {paths.explain(e, location)}") from None
    if not files and (why := paths.missing_bucket(location)):
        raise DataError(f"dataset.path: {why}")
    if not files:
        raise DataError(f"dataset.path: no parquet file found at {location!r}; check the path "
                        "(relative paths start at the sweep file's folder)")
    return files


def open_dataset(files: list[str]) -> pads.Dataset:
    fs, _ = paths.filesystem(files[0])
    try:
        return pads.dataset([paths.filesystem(f)[1] for f in files], filesystem=fs,
                            format="parquet")
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"dataset.path: cannot read {files[0]!r} as parquet: "
                        f"{str(e).splitlines()[0]}") from None


def inspect_dataset(spec: DatasetSpec, task: str = "classification") -> DatasetInfo:
    """Check the data set against the sweep's columns and task, and count its rows (from
    metadata)."""
    files = find_files(spec.path)
    ds = open_dataset(files)
    schema = ds.schema
    names = schema.names
    for key, column in (("dataset.inputs", spec.inputs), ("dataset.target", spec.target),
                        ("dataset.id", spec.id)):
        if column is not None and column not in names:
            raise DataError(f"{key}: no column {column!r} in {spec.path!r}; its columns are: "
                            f"{', '.join(names)}")
    _check_types(spec, task, schema)
    try:
        num_rows = ds.count_rows()
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"dataset.path: cannot read {spec.path!r}: "
                        f"{str(e).splitlines()[0]}") from None
    if num_rows == 0:
        raise DataError(f"dataset.path: the data set at {spec.path!r} has no rows; "
                        "evaluate on a non-empty data set")
    if task == "language_modeling":
        shape: tuple[int, ...] = ()
    else:
        shape = _input_shape(ds, spec.inputs, schema.field(spec.inputs).type)
    return DatasetInfo(files=tuple(files), num_rows=num_rows, input_shape=shape,
                       fingerprint=_fingerprint(files, schema))


def _leaf(typ: pa.DataType) -> tuple[pa.DataType, int]:
    """The value type under any lists, and the list depth."""
    depth = 0
    while True:
        if isinstance(typ, pa.ExtensionType):
            typ = typ.storage_type
        if pa.types.is_list(typ) or pa.types.is_large_list(typ) or \
                pa.types.is_fixed_size_list(typ):
            typ, depth = typ.value_type, depth + 1
        else:
            return typ, depth


def _check_types(spec: DatasetSpec, task: str, schema: pa.Schema) -> None:
    if task == "language_modeling":
        for key, column in (("dataset.inputs", spec.inputs), ("dataset.target", spec.target)):
            if column is None:
                continue
            leaf, depth = _leaf(schema.field(column).type)
            if depth != 1 or not pa.types.is_integer(leaf):
                raise DataError(f"{key}: column {column!r} has type {schema.field(column).type};"
                                " language modeling needs lists of integer token ids")
        return
    target_type = schema.field(spec.target).type
    if task == "classification" and not pa.types.is_integer(target_type):
        raise DataError(f"dataset.target: column {spec.target!r} has type {target_type}; "
                        "expected integer class indices (cast it to int64)")
    if task == "regression" and not (pa.types.is_integer(target_type)
                                     or pa.types.is_floating(target_type)):
        raise DataError(f"dataset.target: column {spec.target!r} has type {target_type}; "
                        "regression needs a numeric target")


def _input_shape(ds: pads.Dataset, column: str, typ: pa.DataType) -> tuple[int, ...]:
    shape: list[int] = []
    probe = None      # the first row, unwrapped level by level, for variable-length lists
    while True:
        if isinstance(typ, pa.ExtensionType):
            typ = typ.storage_type
        if pa.types.is_fixed_size_list(typ):
            shape.append(typ.list_size)
        elif pa.types.is_list(typ) or pa.types.is_large_list(typ):
            if probe is None:
                probe = ds.head(1, columns=[column]).column(column).combine_chunks()
            shape.append(int(pc.list_value_length(_storage(probe))[0].as_py() or 0))
        else:
            break
        if probe is not None:
            probe = _storage(probe).flatten()
        typ = typ.value_type
    if not (pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_boolean(typ)):
        raise DataError(f"dataset.inputs: column {column!r} holds {typ}; expected numbers or "
                        "fixed-size lists of numbers")
    return tuple(shape) if shape else (1,)


def _fingerprint(files: list[str], schema: pa.Schema) -> str:
    h = hashlib.sha256(schema.to_string(show_schema_metadata=False).encode())
    for f in files:
        fs, path = paths.filesystem(f)
        info = fs.get_file_info(path)
        h.update(f"{f}\0{info.size}\0{info.mtime_ns}\0".encode())
    return h.hexdigest()[:16]


def _storage(arr: pa.Array) -> pa.Array:
    return arr.storage if isinstance(arr, pa.ExtensionArray) else arr


def column_array(table: pa.Table | pa.RecordBatch, name: str) -> pa.Array:
    col = table.column(name)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return _storage(col)


def batch_tensors(table: pa.Table | pa.RecordBatch, spec: DatasetSpec, task: str,
                  input_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch as the tensors the task needs: (inputs, targets)."""
    if task == "language_modeling":
        return token_tensors(table, spec)
    x, y = to_tensors(table, spec.inputs, spec.target, input_shape,
                      float_target=task == "regression")
    return x, y


def token_tensors(table, spec: DatasetSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id sequences, right-padded with pad_id: (inputs (rows, T) int64, targets (rows, T)
    int64 with IGNORE at padding and at dataset.ignore_index). Without a target column the
    targets are the inputs themselves (the model predicts the next token)."""
    from .metrics import IGNORE

    tokens = column_array(table, spec.inputs)
    labels = column_array(table, spec.target) if spec.target else tokens
    for name, arr in ((spec.inputs, tokens), (spec.target, labels)):
        if arr.null_count or _storage(arr).flatten().null_count:
            raise DataError(f"dataset: column {name!r} has null values; fill or drop those rows")
    lengths = pc.list_value_length(tokens).to_numpy(zero_copy_only=False).astype(np.int64)
    if spec.target:
        other = pc.list_value_length(labels).to_numpy(zero_copy_only=False)
        if (other != lengths).any():
            raise DataError(f"dataset.target: {spec.target!r} sequences differ in length from "
                            f"{spec.inputs!r}; give one label per input token")
    n, t = len(lengths), int(lengths.max()) if len(lengths) else 0
    positions = np.arange(t).reshape(1, -1) < lengths.reshape(-1, 1)
    flat_x = _storage(tokens).flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    flat_y = _storage(labels).flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    x = np.full((n, t), spec.pad_id, dtype=np.int64)
    y = np.full((n, t), IGNORE, dtype=np.int64)
    x[positions] = flat_x
    y[positions] = flat_y
    y[y == spec.ignore_index] = IGNORE
    return torch.from_numpy(x), torch.from_numpy(y)


def row_ids(table, spec: DatasetSpec, x: torch.Tensor, y: torch.Tensor,
            task: str = "classification") -> torch.Tensor:
    """Each row's id for the bootstrap: the id column, else a hash of the row's content (for
    token sequences, of the tokens only, so padding does not change it)."""
    from . import stats

    if spec.id is None:
        if task == "language_modeling":
            lengths = pc.list_value_length(column_array(table, spec.inputs))
            lengths = torch.from_numpy(lengths.to_numpy(zero_copy_only=False).astype(np.int64))
            return stats.content_ids(x, lengths.view(-1, 1), valid=lengths)
        return stats.content_ids(x, y)
    arr = column_array(table, spec.id)
    if arr.null_count:
        raise DataError(f"dataset.id: column {spec.id!r} has null values; every row needs an id")
    if pa.types.is_integer(arr.type):
        return torch.from_numpy(arr.to_numpy(zero_copy_only=False).astype(np.int64))
    values = arr.to_pylist()
    return torch.tensor([int.from_bytes(hashlib.blake2b(str(v).encode(), digest_size=8).digest(),
                                        "little", signed=True) for v in values],
                        dtype=torch.int64)


def to_tensors(table: pa.Table | pa.RecordBatch, inputs: str, target: str,
               input_shape: tuple[int, ...], float_target: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch as (inputs float32 (rows, *input_shape), targets (rows,): int64 class indices,
    or float64 values when ``float_target``)."""
    n = table.num_rows
    arr = column_array(table, inputs)
    levels = input_shape if _is_list(arr.type) else ()    # a number column has shape (1,)
    for depth, size in enumerate(levels):
        arr = _storage(arr)
        if arr.null_count:
            raise DataError(f"dataset.inputs: column {inputs!r} has null values; fill or drop "
                            "those rows")
        if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
            lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
            if len(lengths) and (lengths != size).any():
                bad = int(lengths[lengths != size][0])
                raise DataError(f"dataset.inputs: column {inputs!r} has lists of different "
                                f"lengths ({bad} vs {size}); every row needs the same shape")
        elif not pa.types.is_fixed_size_list(arr.type):
            raise DataError(f"dataset.inputs: column {inputs!r} is not nested {depth + 1} "
                            "levels deep in every file; use one schema for the data set")
        arr = arr.flatten()
    if arr.null_count:
        raise DataError(f"dataset.inputs: column {inputs!r} has null values; fill or drop "
                        "those rows")
    x = arr.to_numpy(zero_copy_only=False)
    # A copy: batches may live in read-only Ray object-store memory that a cache must not pin.
    x = torch.from_numpy(np.array(x, dtype=np.float32, copy=True)).reshape(n, *input_shape)
    tarr = column_array(table, target)
    if tarr.null_count:
        raise DataError(f"dataset.target: column {target!r} has null values; fill or drop "
                        "those rows")
    dtype = np.float64 if float_target else np.int64
    y = torch.from_numpy(np.array(tarr.to_numpy(zero_copy_only=False), dtype=dtype, copy=True))
    return x, y


def _is_list(typ: pa.DataType) -> bool:
    if isinstance(typ, pa.ExtensionType):
        typ = typ.storage_type
    return pa.types.is_list(typ) or pa.types.is_large_list(typ) or \
        pa.types.is_fixed_size_list(typ)


def columns(spec: DatasetSpec) -> list[str]:
    return list(dict.fromkeys(c for c in (spec.inputs, spec.target, spec.id) if c))


def read_all(info: DatasetInfo, spec: DatasetSpec, batch_size: int,
             task: str = "classification", bootstrap=None):
    """Every row, in batches of tensors, in one process (the single-process reference path):
    (inputs, targets) or, with a bootstrap, (inputs, targets, row buckets)."""
    from . import stats

    ds = open_dataset(list(info.files))
    for batch in ds.to_batches(columns=columns(spec), batch_size=batch_size):
        if batch.num_rows:
            x, y = batch_tensors(batch, spec, task, info.input_shape)
            if bootstrap is None:
                yield x, y
            else:
                ids = row_ids(batch, spec, x, y, task)
                yield x, y, stats.buckets_of(ids, bootstrap.seed, bootstrap.k)

