"""The result store: ``{output}/results/`` is a parquet dataset, one file per evaluated cell
(checkpoint x evaluation; the ``dataset`` column holds the evaluation's name), one row per
metric.

A cell's file is named by its content key, so a second run of the same cell replaces its file
instead of adding a duplicate, and a run can ask the store which cells it already holds. Local
files are written under a hidden temporary name and renamed into place (readers skip hidden
names); object-store writes are single PUTs, which are atomic.
"""

from __future__ import annotations

import io
import os
import uuid
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rayeval.io import paths
from rayeval.errors import StoreError

SCHEMA = pa.schema([
    pa.field("sweep", pa.string(), nullable=False),
    pa.field("checkpoint", pa.string(), nullable=False),
    pa.field("step", pa.int64()),
    pa.field("epoch", pa.int64()),                       # from the checkpoint's name
    pa.field("dataset", pa.string(), nullable=False),
    pa.field("metric", pa.string(), nullable=False),
    pa.field("value", pa.float64()),
    pa.field("ci_low", pa.float64()),
    pa.field("ci_high", pa.float64()),
    pa.field("num_samples", pa.int64(), nullable=False),
    pa.field("num_tokens", pa.int64()),                  # scored target tokens (language modeling)
    pa.field("world_size", pa.int64(), nullable=False),
    pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
    pa.field("higher_is_better", pa.bool_(), nullable=False),
    pa.field("cell", pa.string(), nullable=False),
    pa.field("bootstrap", pa.string()),                  # how replicates were drawn
    pa.field("samples", pa.string()),                    # the per-item records' file set
    pa.field("replicates", pa.list_(pa.float64())),      # the metric on each replicate
    pa.field("matrix", pa.list_(pa.list_(pa.int64()))),  # confusion matrices
])


def cell_rows(*, sweep: str, checkpoint: str, step: int | None, evaluation: str, results: dict,
              higher_is_better: dict[str, bool], num_samples: int, world_size: int,
              bootstrap_key: str, epoch: int | None = None, num_tokens: int | None = None,
              samples: str | None = None) -> list[dict]:
    """A cell's stored rows, one per metric in the sweep's order (the leaderboard takes an
    evaluation's first row as its headline metric). ``results``: metric key -> an object with
    value, ci_low, ci_high, replicates and matrix (``evaluate.MetricResult``). ``num_tokens``:
    the scored target tokens, for tasks that score tokens rather than rows (None otherwise).
    ``samples``: the tag of the cell's per-item record files (None: it kept none)."""
    return [{"sweep": sweep, "checkpoint": checkpoint, "step": step, "epoch": epoch,
             "dataset": evaluation, "metric": key, "value": r.value, "ci_low": r.ci_low,
             "ci_high": r.ci_high, "num_samples": num_samples, "num_tokens": num_tokens,
             "world_size": world_size,
             "higher_is_better": higher_is_better[key], "replicates": r.replicates,
             "matrix": r.matrix, "bootstrap": bootstrap_key if r.replicates is not None else None,
             "samples": samples}
            for key, r in results.items()]


class ResultStore:
    def __init__(self, location: str):
        self.location = location
        try:
            self.fs, root = paths.filesystem(location)
        except (pa.ArrowInvalid, OSError) as e:
            raise StoreError(f"output: cannot open result store {location!r}: {e}") from None
        self.root = root.rstrip("/")
        self.dir = self.root + "/results"

    def check(self, what: str = "output", write: bool = False) -> None:
        """Fail early, with one line, on a store that cannot be reached (a missing bucket,
        denied access) or, with ``write``, written: a hidden probe file is written and removed,
        so a store that is a file or on a read-only filesystem fails before any evaluation."""
        why = paths.missing_bucket(self.location)
        if why:
            raise StoreError(f"{what}: {why}")
        try:
            self.fs.get_file_info(self.dir)
        except OSError as e:
            raise StoreError(f"{what}: {paths.explain(e, self.location)}") from None
        if not write:
            return
        probe = f"{self.dir}/.probe-{uuid.uuid4().hex}"
        created = self._missing_folders()
        try:
            self.fs.create_dir(self.dir, recursive=True)
            with self.fs.open_output_stream(probe) as f:
                f.write(b"rayeval")
            self.fs.delete_file(probe)
            for folder in created:          # leave nothing behind if a later check fails
                self.fs.delete_dir(folder)
        except (OSError, pa.ArrowInvalid) as e:
            raise StoreError(f"{what}: cannot write to the result store {self.location!r}: "
                             f"{paths.explain(e, self.location)}; choose a folder (or bucket) "
                             "you can write to") from None

    def _missing_folders(self) -> list[str]:
        """The local folders of the store that do not exist yet, deepest first."""
        if not isinstance(self.fs, pafs.LocalFileSystem):
            return []
        out, folder = [], self.dir
        while folder and not os.path.exists(folder):
            out.append(folder)
            parent = os.path.dirname(folder)
            if parent == folder:
                break
            folder = parent
        return out

    def _file(self, cell: str) -> str:
        return f"{self.dir}/{cell}.parquet"

    def has(self, cell: str) -> bool:
        try:
            return self.fs.get_file_info(self._file(cell)).type == pafs.FileType.File
        except OSError as e:
            raise StoreError(f"output: cannot read result store: "
                             f"{paths.explain(e, self.location)}") from None

    def write_cell(self, cell: str, rows: list[dict]) -> str:
        """Publish one cell's rows atomically; returns the file's path."""
        now = datetime.now(timezone.utc)
        table = pa.Table.from_pylist(
            [{**r, "cell": cell, "created_at": r.get("created_at", now)} for r in rows],
            schema=SCHEMA)
        return self._put(self.dir, f"{cell}.parquet", table)

    # --- per-item records: {root}/samples/{cell}/{tag}-{rank}-of-{world}.parquet ----------

    def samples_dir(self, cell: str) -> str:
        return f"{self.root}/samples/{cell}"

    def write_samples(self, cell: str, tag: str, rank: int, world: int, table: pa.Table) -> str:
        """One worker's per-item records of a cell (its own items), before the cell is
        published; the cell's rows then name ``tag``, so only a complete set is read."""
        return self._put(self.samples_dir(cell), sample_file(tag, rank, world), table)

    def read_samples(self, cell: str, tag: str) -> pa.Table:
        """The per-item records of a published cell: every worker's file of its set."""
        folder = self.samples_dir(cell)
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
            names = sorted(i.base_name for i in infos if i.base_name.startswith(f"{tag}-"))
            world = int(names[0].rsplit("-of-", 1)[1].split(".")[0]) if names else 0
            if not names or len(names) != world:
                raise StoreError(f"the per-item records of cell {cell} are incomplete "
                                 f"({len(names)} of {world or '?'} worker files under "
                                 f"{folder}); evaluate it again with --force")
            tables = []
            for name in names:
                with self.fs.open_input_file(f"{folder}/{name}") as f:
                    tables.append(pq.read_table(f))
        except (pa.ArrowInvalid, OSError) as e:
            raise StoreError(f"cannot read per-item records: "
                             f"{paths.explain(e, self.location)}") from None
        return pa.concat_tables(tables)

    def _put(self, folder: str, name: str, table: pa.Table) -> str:
        """Write a parquet file atomically (local: a hidden temporary renamed into place;
        object storage: one PUT)."""
        buf = io.BytesIO()
        pq.write_table(table, buf)
        try:
            return paths.put(self.fs, folder, name, buf.getvalue())
        except OSError as e:
            raise StoreError(f"output: cannot write to result store: "
                             f"{paths.explain(e, self.location)}; check the path and its "
                             "permissions") from None

    def read_cell(self, cell: str, columns: list[str] | None = None) -> list[dict]:
        """One published cell's rows (``columns`` only: leave out the wide replicates)."""
        try:
            with self.fs.open_input_file(self._file(cell)) as f:
                return pq.read_table(f, columns=columns).to_pylist()
        except (pa.ArrowInvalid, OSError) as e:
            raise StoreError(f"cannot read result store: {paths.explain(e, self.location)}") \
                from None

    def discard_partial(self, cells) -> int:
        """Remove the temporary files of these cells that an interrupted writer left behind
        (local stores only: an object store shows an object only once it is complete)."""
        if not isinstance(self.fs, pafs.LocalFileSystem) or not os.path.isdir(self.dir):
            return 0
        removed = 0
        ends = tuple(f"-{c}.parquet" for c in cells)
        for name in os.listdir(self.dir):
            if name.startswith(".tmp-") and name.endswith(ends):
                try:
                    os.unlink(os.path.join(self.dir, name))
                    removed += 1
                except FileNotFoundError:
                    pass
        return removed

    def read(self) -> pa.Table:
        """Every stored row; an empty table when the store holds nothing yet. Files written
        before a nullable column was added (``epoch``, ``num_tokens``) read with nulls there:
        the dataset is read with SCHEMA, and pyarrow fills the columns a file lacks."""
        try:
            info = self.fs.get_file_info(self.dir)
            if info.type == pafs.FileType.NotFound:
                return SCHEMA.empty_table()
            ds = pads.dataset(self.dir, filesystem=self.fs, format="parquet", schema=SCHEMA)
            return ds.to_table()
        except (pa.ArrowInvalid, OSError) as e:
            raise StoreError(f"cannot read result store: {paths.explain(e, self.location)}") \
                from None


def sample_file(tag: str, rank: int, world: int) -> str:
    return f"{tag}-{rank:05d}-of-{world:05d}.parquet"


def newest(store: str | os.PathLike, *, sweep: str | None = None,
           evaluation: str | None = None, what: str = "store") -> pa.Table:
    """The newest stored row of every (sweep, checkpoint, evaluation, metric), as
    ``rayeval.results`` documents; ``what`` names the store in errors (the command line's
    ``STORE``, a sweep's ``output``)."""
    import pyarrow.compute as pc

    given = os.fspath(store)
    location = paths.resolve(given, os.getcwd())
    opened = ResultStore(location)
    if paths.is_uri(location):
        opened.check(what)
    elif not os.path.isdir(location):
        raise StoreError(f"{what}: no result store at {given!r}; give the output folder of "
                         "a sweep")
    table = opened.read()
    for column, value in (("sweep", sweep), ("dataset", evaluation)):
        if value is not None:
            table = table.filter(pc.equal(table[column], value))
    # The newest row per key, chosen by latest_rows itself, on the key columns alone: the
    # wide columns (replicates, matrices) are taken by index, never converted to Python.
    keys = table.select(["sweep", "checkpoint", "dataset", "metric", "created_at"])
    keys = keys.append_column("_index", pa.array(range(table.num_rows), pa.int64()))
    return table.take(pa.array([r["_index"] for r in latest_rows(keys)], pa.int64()))


# The stored row's format, read back: one place for what every reader needs of it.

def latest_rows(table: pa.Table) -> list[dict]:
    """The newest row for every (sweep, checkpoint, dataset, metric), in store order."""
    newest: dict[tuple, dict] = {}
    for row in table.to_pylist():
        key = (row["sweep"], row["checkpoint"], row["dataset"], row["metric"])
        if key not in newest or row["created_at"] >= newest[key]["created_at"]:
            newest[key] = row
    return list(newest.values())


def bootstrap_params(key: str | None) -> dict[str, str]:
    return dict(part.split("=", 1) for part in key.split(";")) if key else {}


def confidence_of(row: dict) -> float:
    if row.get("confidence") is not None:                 # an aggregate row
        return float(row["confidence"])
    return float(bootstrap_params(row.get("bootstrap")).get("confidence", 0.95))
