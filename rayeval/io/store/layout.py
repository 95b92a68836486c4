"""Where a result store keeps its rows, and reading them back by column.

Two kinds of files, both with the rows of ``store.SCHEMA``::

    {root}/store.json                                   {"format": 2}: the layout's version
    {root}/results/{cell}.parquet                       one cell (format 1, and a run's cells
                                                        while it runs)
    {root}/parts/sweep-{digest}/part-{time}-{id}.parquet  many cells of one sweep (format 2)

A run writes each cell as it finishes into ``results/`` (so a restarted worker group and a
concurrent run see it at once), then moves its cells into one part (``store.compact``). A part
holds an extra column, ``ordinal`` (a row's place in its cell: the cell's first row is its
headline metric), and its rows are sorted by (metric, evaluation, cell, ordinal) in row groups, so
that reading one metric's replicates reads only the row groups that hold it. A board reads the
figures (every column but ``replicates``): parquet keeps each column apart, so the replicates'
bytes (most of a cell: 1,000 float64 per metric row) are not read at all.

Old stores (``results/`` only, no ``store.json``) read as they are; a store whose
``store.json`` names a newer format is refused in one line. Files written before 2026-12-02
hold the evaluation's name in a column named ``dataset`` (a word the sweep file uses for the
data an evaluation reads): every read takes it from there where ``evaluation`` is missing
(``LEGACY``), so a store mixes both kinds of file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rayeval.errors import StoreError
from rayeval.io import paths

FORMAT = 2
MARKER = "store.json"
ORDINAL = "ordinal"
FIGURES = ".figures.parquet"
SUITE = ".suite.parquet"
REPLICATES = "replicates"
# Rows per row group of a part: a 1,000-replicate row is 8 KB, so a group is ~16 MB of
# replicates and a few hundred KB of figures.
ROW_GROUP = 2048
# The evaluation's name: its column, and the column files written before 2026-12-02 hold it in.
EVALUATION = "evaluation"
LEGACY = "dataset"


# --- every file written with a checksum per data page, checked by every read -----------------
# Compression does not catch damage: 200 zeroed bytes at 27 places in a part of random floats
# read back as other numbers 25 times without a page CRC, and failed all 27 times with one
# (pyarrow 26, snappy). Files written before carry none and read as they did.

def to_parquet(table: pa.Table, **kwargs) -> bytes:
    """``table`` as parquet bytes, a CRC32 in every data page's header. The replicates are
    written plain: bootstrap replicates hardly repeat (893 distinct of 1,000 in a digits
    cell's accuracy), so a dictionary and snappy saved 0.05% of their bytes, and reading a
    part's replicates without them took a third of the time (0.068 s against 0.2 s for
    10,000 rows of 1,000), which a win-rate board of a big store spends in full."""
    import io

    names = table.column_names
    if REPLICATES in names:
        others = [c for c in names if c != REPLICATES]
        kwargs = {"use_dictionary": others,
                  "compression": {**{c: "snappy" for c in others}, REPLICATES: "none"},
                  **kwargs}
    buf = io.BytesIO()
    pq.write_table(table, buf, write_page_checksum=True, **kwargs)
    return buf.getvalue()


def read_parquet(f, **kwargs) -> pa.Table:
    """A whole parquet file, its pages' checksums verified (an OSError where one differs)."""
    return pq.read_table(f, page_checksum_verification=True, **kwargs)


def parquet_format() -> pads.ParquetFileFormat:
    """The dataset format of a store's reads: pages' checksums verified."""
    return pads.ParquetFileFormat(default_fragment_scan_options=pads.ParquetFragmentScanOptions(
        page_checksum_verification=True))


def after_moving(path: str) -> str:
    """What moving a damaged file of the store away does, in words, by its kind."""
    name = path.rpartition("/")[2]
    if name.endswith(FIGURES):
        return "a copy of its part's figures: the part is read instead, nothing is evaluated again"
    if "/parts/" in path:
        return "its cells are evaluated again on the next run"
    return "its cell is evaluated again on the next run"


def part_schema(schema: pa.Schema) -> pa.Schema:
    return schema.append(pa.field(ORDINAL, pa.int32()))


def read_schema(schema: pa.Schema) -> pa.Schema:
    """What a read asks of every file: a part's columns, the evaluation's name nullable (an
    old file has none there) and the old files' column for it (``LEGACY``: a new file has
    none there)."""
    full = part_schema(schema)
    if EVALUATION not in full.names:
        return full
    at = full.get_field_index(EVALUATION)
    return full.set(at, full.field(at).with_nullable(True)).append(pa.field(LEGACY, pa.string()))


def evaluation_in(names) -> pads.Expression:
    """A filter on the evaluation's name that old files pass too (``LEGACY``): pushed down to
    either column's row-group statistics."""
    names = sorted(names)
    return pc.field(EVALUATION).isin(names) | pc.field(LEGACY).isin(names)


def renamed(table: pa.Table) -> pa.Table:
    """A table read from the store with the evaluation's name in ``evaluation``, whatever the
    file called it: the legacy column's values where the new one is missing or null, and the
    legacy column dropped."""
    names = table.column_names
    if LEGACY not in names:
        return table
    if EVALUATION not in names:
        return table.rename_columns([EVALUATION if n == LEGACY else n for n in names])
    at = names.index(EVALUATION)
    merged = pc.coalesce(table[EVALUATION], table[LEGACY])
    table = table.set_column(at, EVALUATION, merged).drop_columns([LEGACY])
    if merged.null_count:                 # every writer names it: no file leaves it empty
        return table
    return table.cast(table.schema.set(at, table.schema.field(at).with_nullable(False)))


def figures(schema: pa.Schema) -> list[str]:
    """The columns a board shows: all but the replicates."""
    return [n for n in schema.names if n != REPLICATES]


def sweep_folder(sweep: str) -> str:
    """A sweep's folder of parts: named by a digest (sweep names may hold any character)."""
    return "sweep-" + hashlib.sha256(sweep.encode("utf-8")).hexdigest()[:16]


# --- the format marker ---------------------------------------------------------------------

def check_format(fs: pafs.FileSystem, root: str, location: str) -> int:
    """The store's layout version (1 when unmarked); a newer one than this rayeval reads, or a
    marker that cannot be read, is one line."""
    path = f"{root}/{MARKER}"
    try:
        with fs.open_input_stream(path) as f:
            text = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return 1
    except OSError as e:
        if fs.get_file_info(path).type == pafs.FileType.NotFound:
            return 1
        raise StoreError(f"cannot read {paths.to_location(fs, path, location)}: "
                         f"{paths.explain(e, location)}") from None
    try:
        found = int(json.loads(text)["format"])
    except (ValueError, KeyError, TypeError):
        raise StoreError(f"{paths.to_location(fs, path, location)} is damaged (expected "
                         f'{{"format": {FORMAT}}}); restore it, or remove it if the store holds '
                         "no parts/ folder") from None
    if found > FORMAT:
        raise StoreError(f"{location} was written by a newer rayeval (store format {found}; "
                         f"this one reads up to {FORMAT}); upgrade rayeval to read it")
    return found


def mark_format(fs: pafs.FileSystem, root: str) -> None:
    """Say that the store holds format-2 parts (before the first part is published)."""
    path = f"{root}/{MARKER}"
    if fs.get_file_info(path).type == pafs.FileType.File:
        return
    paths.put(fs, root, MARKER, json.dumps({"format": FORMAT}).encode() + b"\n")


# --- the files -----------------------------------------------------------------------------

@dataclass
class Files:
    cells: list[pafs.FileInfo]      # results/{cell}.parquet, by name
    parts: list[pafs.FileInfo]      # parts/sweep-*/part-*.parquet, by path

    @property
    def all(self) -> list[str]:
        return [i.path for i in self.cells + self.parts]


def visible(info: pafs.FileInfo) -> bool:
    return info.type == pafs.FileType.File and info.base_name.endswith(".parquet") \
        and not info.base_name.startswith((".", "_"))


def list_cells(fs: pafs.FileSystem, root: str) -> list[pafs.FileInfo]:
    found = fs.get_file_info(pafs.FileSelector(f"{root}/results", allow_not_found=True))
    return sorted((i for i in found if visible(i)), key=lambda i: i.base_name)


def suite_of(part: str) -> str:
    """A part's suite file (``ranking.suite``): hidden from a part listing (and from a rayeval
    that predates it) by its leading underscore."""
    folder, sep, name = part.rpartition("/")
    return f"{folder}{sep}_{name[:-len('.parquet')]}{SUITE}"


def figures_of(part: str) -> str:
    """A part's figures file: the same rows without the replicates (~2% of its bytes)."""
    return part[:-len(".parquet")] + FIGURES


def list_parts(fs: pafs.FileSystem, root: str, sweep: str | None = None,
               figures: bool = False) -> list[pafs.FileInfo]:
    """The parts of one sweep (one folder listed), or of every sweep; with ``figures``, each
    part's figures file where it has one. Measured on moto's S3 server, whose ranged GET of an
    object costs as much as reading it whole (10 reads of 1 KB: 0.37 s from a 1 MB object,
    4.7 s from a 100 MB one): a board's figures from a 234 MB part cost 83 s, from its
    figures file a few."""
    folder = f"{root}/parts" + (f"/{sweep_folder(sweep)}" if sweep is not None else "")
    found = fs.get_file_info(pafs.FileSelector(folder, recursive=sweep is None,
                                               allow_not_found=True))
    found = [i for i in found if visible(i)]
    parts = sorted((i for i in found if not i.base_name.endswith(FIGURES)),
                   key=lambda i: i.path)
    if not figures:
        return parts
    small = {i.path: i for i in found if i.base_name.endswith(FIGURES)}
    return [small.get(figures_of(i.path), i) for i in parts]


def list_suites(fs: pafs.FileSystem, root: str, sweep: str | None = None) -> list[str]:
    """The suite files of the parts of one sweep, or of every sweep (a crashed writer's
    suite file without its part is left out)."""
    folder = f"{root}/parts" + (f"/{sweep_folder(sweep)}" if sweep is not None else "")
    found = fs.get_file_info(pafs.FileSelector(folder, recursive=sweep is None,
                                               allow_not_found=True))
    files = {i.path for i in found if i.type == pafs.FileType.File}
    return sorted(suite_of(p) for p in files if visible_part(p) and suite_of(p) in files)


def visible_part(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".parquet") and not name.startswith((".", "_")) \
        and not name.endswith(FIGURES)


def list_files(fs: pafs.FileSystem, root: str, sweep: str | None = None,
               figures: bool = False) -> Files:
    return Files(list_cells(fs, root), list_parts(fs, root, sweep, figures))


# --- reading -------------------------------------------------------------------------------

def read_files(fs: pafs.FileSystem, files: list[str], schema: pa.Schema, location: str,
               columns: list[str] | None = None, where: pads.Expression | None = None,
               skip_damaged: bool = False, ordered: bool = True,
               relist: Callable[[], list[str]] | None = None) -> tuple[pa.Table, list[str]]:
    """The rows of ``files`` (cells and parts), ``columns`` only, filtered by ``where`` (pushed
    down: row groups whose statistics rule it out are not read), in the files' order, rows of a
    cell in their place in it. A damaged file is refused in one line that names it, or, with
    ``skip_damaged``, left out and returned in the second item. A file gone since it was
    listed (a mover published its rows in a part, then removed it) makes ``relist`` list the
    files again, a few times at most (a reader polling a store that `watch` consolidated
    failed on such a file). ``ordered=False``: in the scan's order (a sort and a copy less:
    2.6 s of a 10,000-cell board's replicates on a loaded machine)."""
    full = read_schema(schema)
    wanted = list(columns or schema.names)
    if ORDINAL not in wanted:
        wanted.append(ORDINAL)
    if "cell" not in wanted:
        wanted.append("cell")
    if EVALUATION in wanted and LEGACY in full.names:
        wanted.append(LEGACY)
    damaged: list[str] = []
    relists = 3 if relist is not None else 0
    while True:
        try:
            ds = pads.dataset(files, filesystem=fs, format=parquet_format(), schema=full)
            table = ds.to_table(columns=wanted, filter=where)
            break
        except (pa.ArrowInvalid, OSError) as e:
            bad, gone = unreadable(fs, [f for f in files if f not in damaged], whole=True)
            if gone and relists:
                relists -= 1
                files = [f for f in relist() if f not in damaged]
                continue
            if not bad and not (gone and skip_damaged):
                raise StoreError(f"cannot read result store: "
                                 f"{paths.explain(e, location)}") from None
            if bad and not skip_damaged:
                raise StoreError(
                    f"damaged file in the result store: {paths.to_location(fs, bad[0], location)}"
                    f" ({paths.explain(e, location).split(': ', 1)[-1][:160]}); move it away "
                    f"({after_moving(bad[0])})") from None
            damaged += bad
            files = [f for f in files if f not in bad and f not in gone]
    table = renamed(_in_cell_order(table) if ordered else table)    # unordered: keyed reads
    return table.select([c for c in wanted if c in (columns or schema.names)]), \
        damaged


def _in_cell_order(table: pa.Table) -> pa.Table:
    """Rows by cell, a cell's rows in its own order (a one-cell file's order; a part's
    ordinal), ties in the files' order: the order a store of one-cell files always read in."""
    if table.num_rows == 0:
        return table
    order = pc.sort_indices(table, sort_keys=[("cell", "ascending"),
                                              (ORDINAL, "ascending", "at_end")])
    return table.take(order)


def unreadable(fs: pafs.FileSystem, files: list[str], whole: bool = False
               ) -> tuple[list[str], list[str]]:
    """(damaged, gone): the files whose parquet footer cannot be read, and those no longer
    there (only looked for after a read failed). ``whole``: where every footer reads, the
    files read whole, their pages' checksums verified, for the one a read failed on."""
    bad, gone = [], []
    for path in files:
        try:
            with fs.open_input_file(path) as f:
                pq.read_metadata(f)
        except (pa.ArrowInvalid, OSError):
            missing = fs.get_file_info(path).type == pafs.FileType.NotFound
            (gone if missing else bad).append(path)
    if whole and not bad:
        for path in files:
            if path in gone:
                continue
            try:
                with fs.open_input_file(path) as f:
                    read_parquet(f)
            except (pa.ArrowInvalid, OSError):
                bad.append(path)
    return bad, gone


def newest_writes(table: pa.Table) -> pa.Table:
    """Each cell's rows of its newest write (a cell moved into a part while a reader listed
    both its file and the part reads twice; a cell written again reads its newest rows)."""
    if table.num_rows == 0:
        return table
    cells = table["cell"].combine_chunks().dictionary_encode().indices.to_numpy(
        zero_copy_only=False)
    stamps = table["created_at"].combine_chunks().cast(pa.int64()).to_numpy(
        zero_copy_only=False)
    newest = np.full(cells.max() + 1, np.iinfo(np.int64).min)
    np.maximum.at(newest, cells, stamps)
    keep = stamps == newest[cells]
    # the same write twice (file and part): keep the first copy of each (cell, metric)
    frame = table.filter(pa.array(keep))
    seen = pc.binary_join_element_wise(frame["cell"], frame["metric"], frame[EVALUATION],
                                       "\x1f")
    first = np.unique(seen.combine_chunks().dictionary_encode().indices.to_numpy(
        zero_copy_only=False), return_index=True)[1]
    return frame.take(pa.array(np.sort(first), pa.int64()))
