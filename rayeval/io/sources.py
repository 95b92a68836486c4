"""Where an evaluation's rows come from: parquet, JSON lines, CSV, a Hugging Face
``save_to_disk`` folder, or a folder of images, locally or on object storage.

Each format is read by one function of this module, ``read_file``, in the driver (to check
columns and probe the model before any cluster starts) and in Ray Data's read tasks alike, so
the rows a worker scores have exactly the types the driver checked. The driver's checks see a
format as a ``pyarrow.dataset.Dataset`` (``probe``); counting rows costs a metadata read for
parquet and Hugging Face folders, a file listing for images, and one streamed scan for JSON
lines and CSV (the count is what every result is checked against).

A folder of images gives three columns: ``image`` (the file's bytes: decode them in a
``dataset.transform``), ``path`` (relative to the folder) and, when every image sits in a
subfolder, ``label``: the subfolder's name as an integer when every name is one, else the
name's index among the sorted names (torchvision's ImageFolder convention), with the name in
``class_name``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.dataset as pads

from rayeval import errors
from rayeval.errors import DataError
from rayeval.io import paths

FORMATS = ("parquet", "json", "csv", "hf", "images")
SUFFIXES = {
    "parquet": (".parquet", ".pq", ".parq"),
    "json": (".jsonl", ".json", ".ndjson"),
    "csv": (".csv",),
    "hf": (".arrow",),
    "images": (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"),
}
HF_MARKERS = ("dataset_info.json", "state.json")
PROBE_IMAGES = 16            # images the driver reads to check columns and probe the model


def detect(location: str, given: str | None, key: str) -> str:
    """The format of a data set: ``given`` (``dataset.format``), else from the location:
    a Hugging Face folder by its ``state.json``, a folder by the files in it, a file or glob by
    its suffix."""
    if given is not None:
        return given
    try:
        if not paths.has_glob(location) and paths.is_dir(location):
            if _hf_folder(location):
                return "hf"
            names = paths.list_files(location)
            for fmt in ("parquet", "json", "csv", "images"):
                if any(n.lower().endswith(SUFFIXES[fmt]) for n in names):
                    return fmt
            return "parquet"
    except OSError as e:
        raise DataError(f"{key}.path: {paths.explain(e, location)}") from None
    lower = location.lower()
    for fmt in ("parquet", "json", "csv", "images"):
        if lower.endswith(SUFFIXES[fmt]):
            return fmt
    return "parquet"


def _hf_folder(location: str) -> bool:
    fs, path = paths.filesystem(location)
    found = fs.get_file_info([f"{path}/{m}" for m in (*HF_MARKERS, "dataset_dict.json")])
    return any(i.type == pa.fs.FileType.File for i in found)


def find_files(location: str, fmt: str, key: str) -> list[str]:
    """The files of a data set given as a file, a folder or a glob, in a stable order."""
    where = f"{key}.path"
    try:
        if fmt == "hf" and not paths.has_glob(location):
            return _hf_files(location, where)
        if paths.has_glob(location):
            files = [f for f in paths.glob(location) if not paths.is_dir(f)]
        elif paths.is_dir(location):
            files = paths.list_files(location, SUFFIXES[fmt])
            if not files and fmt == "parquet":
                files = paths.list_files(location)
        else:
            files = paths.glob(location)
    except OSError as e:
        raise DataError(f"{where}: {paths.explain(e, location)}") from None
    if not files and (why := paths.missing_bucket(location)):
        raise DataError(f"{where}: {why}")
    if not files:
        kind = "image" if fmt == "images" else fmt if fmt != "hf" else "arrow"
        raise DataError(f"{where}: no {kind} file found at {location!r}; check the path "
                        "(relative paths start at the sweep file's folder) or set "
                        f"{key}.format")
    return files


def _hf_files(location: str, where: str) -> list[str]:
    """The arrow files of a ``save_to_disk`` folder, in its own order (``state.json``)."""
    fs, path = paths.filesystem(location)
    if fs.get_file_info(f"{path}/dataset_dict.json").type == pa.fs.FileType.File:
        splits = sorted(i.base_name for i in fs.get_file_info(pa.fs.FileSelector(path))
                        if i.type == pa.fs.FileType.Directory)
        raise DataError(f"{where}: {location!r} holds several splits ({', '.join(splits)}); "
                        f"point it at one of them, e.g. {location.rstrip('/')}/{splits[0]}"
                        if splits else f"{where}: {location!r} holds no split")
    state = f"{path}/state.json"
    if fs.get_file_info(state).type == pa.fs.FileType.File:
        with fs.open_input_stream(state) as f:
            names = [d["filename"] for d in json.loads(f.read()).get("_data_files", [])]
        if names:
            return [f"{location.rstrip('/')}/{n}" for n in names]
    return paths.list_files(location, SUFFIXES["hf"])


# --- reading: one function for the driver and Ray Data's read tasks -------------------------

def read_file(fmt: str, location: str, *, schema: pa.Schema | None = None,
              columns: list[str] | None = None, root: str | None = None,
              chunk_rows: int = 65536, key: str = "dataset") -> Iterator[pa.Table]:
    """One file's rows as tables of at most ``chunk_rows`` rows. ``schema``: the types the
    driver saw (JSON lines and CSV are parsed with them, so every file and block agrees);
    ``root``: the images folder (for ``path`` and ``label``)."""
    try:
        if fmt == "images":
            yield read_images([location], root or os.path.dirname(location), schema)
            return
        table_iter = _READERS[fmt](location, schema, chunk_rows)
        for table in table_iter:
            if columns is not None:
                table = table.select(columns)
            yield from _chunks(table, chunk_rows)
    except DataError:
        raise
    except (pa.ArrowInvalid, OSError, ValueError, KeyError) as e:
        raise _unreadable(e, fmt, location, key) from None


def _chunks(table: pa.Table, rows: int) -> Iterator[pa.Table]:
    for start in range(0, table.num_rows, rows):
        yield table.slice(start, rows)


def _parquet(location: str, schema, chunk_rows: int) -> Iterator[pa.Table]:
    import pyarrow.parquet as pq

    fs, path = paths.filesystem(location)
    with fs.open_input_file(path) as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=chunk_rows):
            yield pa.Table.from_batches([batch])


def _json(location: str, schema, chunk_rows: int) -> Iterator[pa.Table]:
    import pyarrow.json as pajson

    fs, path = paths.filesystem(location)
    parse = pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore") \
        if schema is not None else None
    with fs.open_input_stream(path) as f:
        yield pajson.read_json(f, parse_options=parse)


def _csv(location: str, schema, chunk_rows: int) -> Iterator[pa.Table]:
    import pyarrow.csv as pacsv

    fs, path = paths.filesystem(location)
    convert = pacsv.ConvertOptions(column_types=schema) if schema is not None else None
    with fs.open_input_stream(path) as f:
        reader = pacsv.open_csv(f, convert_options=convert)
        for batch in reader:
            yield pa.Table.from_batches([batch])


def _arrow_stream(location: str, schema, chunk_rows: int) -> Iterator[pa.Table]:
    fs, path = paths.filesystem(location)
    if not paths.is_uri(location):
        source = pa.memory_map(path)          # zero-copy: the batches point into the map
    else:
        source = fs.open_input_stream(path)
    with source:
        for batch in pa.ipc.open_stream(source):
            yield pa.Table.from_batches([batch])


_READERS = {"parquet": _parquet, "json": _json, "csv": _csv, "hf": _arrow_stream}


def read_images(files: list[str], root: str, schema: pa.Schema | None) -> pa.Table:
    rels = [_relative(f, root) for f in files]
    data = []
    for f in files:
        fs, path = paths.filesystem(f)
        with fs.open_input_stream(path) as stream:
            data.append(stream.read())
    cols = {"image": pa.array(data, pa.binary()), "path": pa.array(rels, pa.string())}
    if schema is not None and "label" in schema.names:
        classes = json.loads(schema.metadata[b"rayeval.classes"])
        names = [r.split("/", 1)[0] for r in rels]
        cols["label"] = pa.array([classes[n] for n in names], pa.int64())
        cols["class_name"] = pa.array(names, pa.string())
    return pa.table(cols)


def _relative(location: str, root: str) -> str:
    return location[len(root):].lstrip("/") if location.startswith(root) else \
        os.path.basename(location)


def image_schema(files: list[str], root: str) -> pa.Schema:
    """The columns of a folder of images; with ``label`` when every image sits in a
    subfolder (the class map in the schema's metadata, so every reader labels alike)."""
    fields = [pa.field("image", pa.binary()), pa.field("path", pa.string())]
    names = [_relative(f, root).split("/") for f in files]
    if names and all(len(n) > 1 for n in names):
        classes = sorted({n[0] for n in names})
        if all(c.lstrip("-").isdigit() for c in classes):
            index = {c: int(c) for c in classes}
        else:
            index = {c: i for i, c in enumerate(classes)}
        fields += [pa.field("label", pa.int64()), pa.field("class_name", pa.string())]
        return pa.schema(fields, metadata={"rayeval.classes": json.dumps(index)})
    return pa.schema(fields)


# --- what the driver checks ------------------------------------------------------------------

def open_probe(fmt: str, files: list[str] | tuple[str, ...], key: str,
               root: str | None = None) -> pads.Dataset:
    """The data set as a pyarrow dataset for the driver's checks (columns, shapes, finite
    values, the model's probe), without reading its rows. For images, only the first few:
    their columns are the same for any image."""
    files = list(files)
    try:
        if fmt in ("parquet", "json", "csv"):
            fs, _ = paths.filesystem(files[0])
            return pads.dataset([paths.filesystem(f)[1] for f in files], filesystem=fs,
                                format=fmt)
        if fmt == "hf":
            tables = [t for f in files for t in _arrow_stream(f, None, 0)]
            return pads.dataset(pa.concat_tables(tables) if tables else pa.table({}))
        schema = image_schema(files, root)
        table = read_images(files[:PROBE_IMAGES], root, schema)
        return pads.dataset(table.replace_schema_metadata(schema.metadata))
    except DataError:
        raise
    except (pa.ArrowInvalid, OSError, ValueError) as e:
        raise _unreadable(e, fmt, files[0], key) from None


def count_rows(fmt: str, ds: pads.Dataset, files: list[str] | tuple[str, ...], key: str
               ) -> tuple[int, ...]:
    """Each file's rows: parquet's footers, a Hugging Face folder's (memory-mapped) batches,
    one per image, one streamed scan of each JSON lines or CSV file."""
    try:
        if fmt == "images":
            return (1,) * len(files)
        if fmt == "hf":
            return tuple(sum(t.num_rows for t in _arrow_stream(f, None, 0)) for f in files)
        return tuple(f.count_rows() for f in ds.get_fragments())
    except (pa.ArrowInvalid, OSError, ValueError) as e:
        raise _unreadable(e, fmt, files[0], key) from None


def _unreadable(e: Exception, fmt: str, location: str, key: str) -> DataError:
    where = f"{key}.path"
    what = {"json": "JSON lines (one object per line)", "hf": "Hugging Face arrow files",
            "csv": "CSV", "parquet": "parquet", "images": "images"}[fmt]
    return errors.wrap(e, DataError, f"{where}: cannot read {location!r} as {what}",
                       key_path=where, location=location)


def root_of(location: str, files: list[str]) -> str:
    """The folder that image paths (and labels) are taken relative to."""
    if not paths.has_glob(location) and paths.is_dir(location):
        return location.rstrip("/")
    common = os.path.commonpath([f.split("://", 1)[-1] for f in files]) if files else ""
    if len(files) == 1:
        common = os.path.dirname(common)
    prefix = location.split("://", 1)[0] + "://" if paths.is_uri(location) else ""
    return prefix + common
