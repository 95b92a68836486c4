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
    if paths.has_glob(location):
        files = [f for f in paths.glob(location) if not paths.is_dir(f)]
    elif paths.is_dir(location):
        files = paths.list_files(location, PARQUET_SUFFIXES) or paths.list_files(location)
    else:
        files = paths.glob(location)
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


def inspect_dataset(spec: DatasetSpec) -> DatasetInfo:
    """Check the data set against the sweep's columns and count its rows (from metadata)."""
    files = find_files(spec.path)
    ds = open_dataset(files)
    schema = ds.schema
    names = schema.names
    for key, column in (("dataset.inputs", spec.inputs), ("dataset.target", spec.target),
                        ("dataset.id", spec.id)):
        if column is not None and column not in names:
            raise DataError(f"{key}: no column {column!r} in {spec.path!r}; its columns are: "
                            f"{', '.join(names)}")
    target_type = schema.field(spec.target).type
    if not pa.types.is_integer(target_type):
        raise DataError(f"dataset.target: column {spec.target!r} has type {target_type}; "
                        "expected integer class indices (cast it to int64)")
    try:
        num_rows = ds.count_rows()
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"dataset.path: cannot read {spec.path!r}: "
                        f"{str(e).splitlines()[0]}") from None
    if num_rows == 0:
        raise DataError(f"dataset.path: the data set at {spec.path!r} has no rows; "
                        "evaluate on a non-empty data set")
    shape = _input_shape(ds, spec.inputs, schema.field(spec.inputs).type)
    return DatasetInfo(files=tuple(files), num_rows=num_rows, input_shape=shape,
                       fingerprint=_fingerprint(files, schema))


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


def to_tensors(table: pa.Table | pa.RecordBatch, inputs: str, target: str,
               input_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch as (inputs float32 (rows, *input_shape), targets int64 (rows,))."""
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
    y = torch.from_numpy(np.array(tarr.to_numpy(zero_copy_only=False), dtype=np.int64, copy=True))
    return x, y


def _is_list(typ: pa.DataType) -> bool:
    if isinstance(typ, pa.ExtensionType):
        typ = typ.storage_type
    return pa.types.is_list(typ) or pa.types.is_large_list(typ) or \
        pa.types.is_fixed_size_list(typ)


def read_all(info: DatasetInfo, spec: DatasetSpec, batch_size: int):
    """Every row, in batches of tensors, in one process (the single-process reference path)."""
    ds = open_dataset(list(info.files))
    for batch in ds.to_batches(columns=[spec.inputs, spec.target], batch_size=batch_size):
        if batch.num_rows:
            yield to_tensors(batch, spec.inputs, spec.target, info.input_shape)

