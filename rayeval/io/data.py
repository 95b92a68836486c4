"""An evaluation's data set: found, opened, counted, and its columns turned into arrays.

What the columns must hold and how a batch becomes the model's inputs is the task's business
(``tasks``); how each format is read is ``sources``'. For parquet, row counts and schema come
from metadata, so inspecting it reads no row data beyond the first row of a variable-length
list column. ``RowRange`` is the direct read of local parquet (the fast path); every other
source reaches the workers through Ray Data (``execution/pipeline``).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from rayeval.config import constants
from rayeval.io import paths, sources
from rayeval import errors
from rayeval.errors import DataError
from rayeval.config.schema import DatasetSpec
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

PARQUET_SUFFIXES = sources.SUFFIXES["parquet"]


@dataclass(frozen=True)
class DatasetInfo:
    files: tuple[str, ...]            # locations of the data files, in reading order
    num_rows: int
    input_shapes: tuple[tuple[str, tuple[int, ...]], ...]   # column -> one row's shape
    fingerprint: str                  # changes when a file, its size or mtime, or the schema does
    file_rows: tuple[int, ...] = ()   # rows of each file, in ``files`` order
    format: str = "parquet"           # one of sources.FORMATS
    schema: pa.Schema | None = None   # the columns' types, as the driver read them
    root: str | None = None           # a folder of images: paths and labels are relative to it

    def via_ray_data(self, spec: DatasetSpec) -> bool:
        """Whether the workers get these rows from a Ray Data pipeline: every source but
        local parquet, which each worker reads straight from its files (``RowRange``) unless
        ``dataset.cpus`` asks for preprocessing on Ray Data's CPUs (or RAYEVAL_DATA_PLANE=ray
        sends everything through it)."""
        local_parquet = self.format == "parquet" and not any(paths.is_uri(f)
                                                              for f in self.files)
        # Image items always go through it: their decoding and processor run on its CPU
        # stage, never in the scoring process.
        return (not local_parquet or spec.cpus is not None or spec.images is not None
                or constants.data_plane() == "ray")

    def shard_rows(self, rank: int, world: int) -> tuple[int, int]:
        """The rows [start, stop) of worker ``rank`` of ``world``: an even split, disjoint,
        covering every row exactly once."""
        return self.num_rows * rank // world, self.num_rows * (rank + 1) // world

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.input_shapes)


def find_files(location: str, key: str = "dataset.path") -> list[str]:
    """The parquet files of a data set given as a file, a folder or a glob."""
    return sources.find_files(location, "parquet", key.removesuffix(".path"))


def open_dataset(files: list[str] | tuple[str, ...], key: str = "dataset.path") -> pads.Dataset:
    """Parquet files as one pyarrow dataset (no rows read)."""
    return sources.open_probe("parquet", files, key.removesuffix(".path"))


def probe_dataset(info: DatasetInfo, key: str) -> pads.Dataset:
    """Any source as a pyarrow dataset for the driver's checks (``sources.open_probe``)."""
    return sources.open_probe(info.format, info.files, key, info.root)


def inspect_dataset(spec: DatasetSpec, task) -> DatasetInfo:
    """Check the data set against the evaluation's columns and task (a ``tasks.Task``), and
    count its rows (from metadata)."""
    key = spec.key_path
    fmt = sources.detect(spec.path, spec.format, key)
    files = sources.find_files(spec.path, fmt, key)
    root = sources.root_of(spec.path, files) if fmt == "images" else None
    ds = sources.open_probe(fmt, files, key, root)
    schema = ds.schema
    names = schema.names
    named = [(f"{key}.inputs", c) for c in spec.inputs]
    named += [(f"{key}.{k}", getattr(spec, k)) for k in ("prompt", "choices", "text", "images",
                                                         "target", "id")]
    for where, column in named:
        if column is not None and column not in names:
            raise DataError(f"{where}: no column {column!r} in {spec.path!r}; its columns are: "
                            f"{', '.join(names)}")
    task.check_schema(spec, schema)
    file_rows = sources.count_rows(fmt, ds, files, key)
    num_rows = sum(file_rows)
    if num_rows == 0:
        raise DataError(f"{key}.path: the data set at {spec.path!r} has no rows; "
                        "evaluate on a non-empty data set")
    shapes = task.input_shapes(ds, spec)
    return DatasetInfo(files=tuple(files), num_rows=num_rows,
                       input_shapes=tuple(shapes.items()),
                       fingerprint=_fingerprint(files, schema), file_rows=file_rows,
                       format=fmt, schema=schema, root=root)


def leaf_type(typ: pa.DataType) -> tuple[pa.DataType, int]:
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


def input_shape(ds: pads.Dataset, column: str, key: str) -> tuple[int, ...]:
    """One row's shape of a numeric column: (1,) for numbers, list lengths for (nested) lists;
    a variable-length list is measured on its first row."""
    typ = ds.schema.field(column).type
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
        raise DataError(f"{key}: column {column!r} holds {typ}; expected numbers or "
                        "fixed-size lists of numbers (or decode it with a dataset.transform)")
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


def number_tensor(table: pa.Table | pa.RecordBatch, column: str, shape: tuple[int, ...],
                  key: str) -> torch.Tensor:
    """A numeric column as float32 (rows, *shape); lists must have the shape's lengths."""
    n = table.num_rows
    arr = column_array(table, column)
    levels = shape if _is_list(arr.type) else ()    # a number column has shape (1,)
    for depth, size in enumerate(levels):
        arr = _storage(arr)
        if arr.null_count:
            raise DataError(f"{key}: column {column!r} has null values; fill or drop those rows")
        if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
            lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
            if len(lengths) and (lengths != size).any():
                bad = int(lengths[lengths != size][0])
                raise DataError(f"{key}: column {column!r} has lists of different lengths "
                                f"({bad} vs {size}); every row needs the same shape")
        elif not pa.types.is_fixed_size_list(arr.type):
            raise DataError(f"{key}: column {column!r} is not nested {depth + 1} levels deep "
                            "in every file; use one schema for the data set")
        arr = arr.flatten()
    if arr.null_count:
        raise DataError(f"{key}: column {column!r} has null values; fill or drop those rows")
    x = arr.to_numpy(zero_copy_only=False)
    # A copy: batches may live in read-only Ray object-store memory that a cache must not pin.
    return torch.from_numpy(np.array(x, dtype=np.float32, copy=True)).reshape(n, *shape)


def target_tensor(table: pa.Table | pa.RecordBatch, column: str, key: str,
                  dtype=np.int64) -> torch.Tensor:
    arr = column_array(table, column)
    if arr.null_count:
        raise DataError(f"{key}: column {column!r} has null values; fill or drop those rows")
    return torch.from_numpy(np.array(arr.to_numpy(zero_copy_only=False), dtype=dtype, copy=True))


def id_values(table: pa.Table | pa.RecordBatch, column: str, key: str) -> torch.Tensor:
    """An id column as int64: integers as they are, anything else hashed from its text."""
    arr = column_array(table, column)
    if arr.null_count:
        raise DataError(f"{key}: column {column!r} has null values; every row needs an id")
    if pa.types.is_integer(arr.type):
        return torch.from_numpy(arr.to_numpy(zero_copy_only=False).astype(np.int64))
    values = arr.to_pylist()
    return torch.tensor([int.from_bytes(hashlib.blake2b(str(v).encode(), digest_size=8).digest(),
                                        "little", signed=True) for v in values],
                        dtype=torch.int64)


def _is_list(typ: pa.DataType) -> bool:
    if isinstance(typ, pa.ExtensionType):
        typ = typ.storage_type
    return pa.types.is_list(typ) or pa.types.is_large_list(typ) or \
        pa.types.is_fixed_size_list(typ)


def read_batches(info: DatasetInfo, spec: DatasetSpec, batch_size: int, columns=None):
    """Every row as pyarrow tables of ``batch_size`` rows, in one process, in file order (the
    driver's probe and the single-process reference path), from any source."""
    columns = columns if columns is not None else spec.columns
    tables = (t for f in info.files
              for t in sources.read_file(info.format, f, schema=info.schema, columns=columns,
                                         root=info.root, chunk_rows=batch_size,
                                         key=spec.key_path))
    yield from rebatch(tables, batch_size)


def rebatch(tables, batch_size: int):
    """Tables of any sizes as tables of ``batch_size`` rows (the last may be shorter)."""
    held: list[pa.Table] = []
    count = 0
    for table in tables:
        if not table.num_rows:
            continue
        held.append(table)
        count += table.num_rows
        while count >= batch_size:
            joined = pa.concat_tables(held) if len(held) > 1 else held[0]
            yield joined.slice(0, batch_size)
            rest = joined.slice(batch_size)
            held, count = ([rest], rest.num_rows) if rest.num_rows else ([], 0)
    if count:
        yield pa.concat_tables(held) if len(held) > 1 else held[0]


class ReadAhead:
    """An iterable's items produced on a thread, up to ``prefetch`` ahead of the consumer
    (pyarrow and Ray Data release the GIL while they read). The thread starts at once, so
    the reading begins before the first item is asked for; ``close`` lets it go (it stops at
    its next item)."""

    _DONE = object()

    def __init__(self, items, prefetch: int = 2):
        import queue
        import threading

        self.ahead: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._produce, args=(items,),
                                       name="rayeval-read", daemon=True)
        self.thread.start()

    def _produce(self, items) -> None:
        import queue

        try:
            for item in items:
                while not self.stop.is_set():
                    try:
                        self.ahead.put(item, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if self.stop.is_set():
                    return
            self.ahead.put(self._DONE)
        except BaseException as e:          # noqa: BLE001 - handed to the consumer
            self.ahead.put(e)

    def __iter__(self):
        while True:
            item = self.ahead.get()
            if item is self._DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self.stop.set()


# A row's position in its data set (its files in order, each file's rows in order), from 0:
# a column the readers add (``positions``) where per-item records name an item by its row, as
# a data set without an id column has nothing else a user can find it by (its id is a 64-bit
# hash of its content, for the bootstrap).
ROW = "__rayeval_row__"


def positions(table) -> dict[str, list]:
    """A record's ``row`` field (each row's position), where the table has ``ROW``."""
    return {"row": table.column(ROW).to_pylist()} if ROW in table.column_names else {}


def with_positions(table: pa.Table, first: int) -> pa.Table:
    """``table`` with the ``ROW`` column: positions ``first``, ``first + 1``, ..."""
    return table.append_column(ROW, pa.array(range(first, first + table.num_rows), pa.int64()))


class RowRange:
    """Rows [start, stop) of a data set, read straight from its parquet files: one worker's
    shard. Only the row groups that hold them are read; batches are read ahead on a thread
    (pyarrow releases the GIL) while the model runs. ``positions``: each row's position in
    the data set comes with it (``ROW``)."""

    def __init__(self, info: DatasetInfo, columns, start: int, stop: int, key: str,
                 positions: bool = False):
        self.info = info
        self.columns = columns
        self.start, self.stop = start, stop
        self.key = key
        self.positions = positions

    @property
    def num_rows(self) -> int:
        return self.stop - self.start

    def iter_batches(self, batch_size: int, prefetch: int = 2):
        """pyarrow Tables of ``batch_size`` rows (the last may be shorter), in row order."""
        if self.num_rows <= 0:
            return
        ahead = ReadAhead(self._batches(batch_size), prefetch)
        try:
            yield from ahead
        finally:
            ahead.close()

    def _batches(self, batch_size: int):
        return rebatch(self._pieces(batch_size), batch_size)

    def _pieces(self, batch_size: int):
        """The range's rows as tables, file by file, from the row groups that hold them
        (streamed: a large row group is not held whole)."""
        import pyarrow.parquet as pq

        offset = 0
        for location, n in zip(self.info.files, self._file_rows()):
            lo, hi = max(self.start, offset) - offset, min(self.stop, offset + n) - offset
            first, offset = offset, offset + n
            if lo >= hi:
                continue
            fs, path = paths.filesystem(location)
            try:
                with fs.open_input_file(path) as f:
                    reader = pq.ParquetFile(f)
                    sizes = [reader.metadata.row_group(g).num_rows
                             for g in range(reader.num_row_groups)]
                    starts = list(itertools.accumulate(sizes, initial=0))
                    groups = [g for g in range(len(sizes))
                              if starts[g] < hi and starts[g] + sizes[g] > lo]
                    at = starts[groups[0]]
                    for batch in reader.iter_batches(batch_size=max(batch_size, 4096),
                                                     row_groups=groups, columns=self.columns):
                        a, b = max(lo, at), min(hi, at + batch.num_rows)
                        if a < b:
                            table = pa.Table.from_batches([batch.slice(a - at, b - a)])
                            yield with_positions(table, first + a) if self.positions else table
                        at += batch.num_rows
                        if at >= hi:
                            break
            except (pa.ArrowInvalid, OSError) as e:
                raise errors.wrap(e, DataError, f"{self.key}: cannot read {location!r}",
                                  key_path=self.key, location=location) from None

    def _file_rows(self) -> tuple[int, ...]:
        if self.info.file_rows:
            return self.info.file_rows
        return tuple(f.count_rows() for f in open_dataset(self.info.files, self.key)
                     .get_fragments())
