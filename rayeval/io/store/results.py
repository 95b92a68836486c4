"""The result store: parquet files of evaluated cells (checkpoint x evaluation), one row per
metric; ``store.layout`` says where.

A run writes each cell as one file named by its content key under ``results/`` (so a second run
of the same cell replaces its file instead of adding a duplicate, and a run can ask the store
which cells it already holds), then moves its cells into one part under ``parts/``
(``store.compact``). Local files are written under a hidden temporary name and renamed into
place (readers skip hidden names); object-store writes are single PUTs, which are atomic.
"""

from __future__ import annotations

import os
import uuid
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from rayeval.io import paths
from rayeval.errors import StoreError
from rayeval.io.store import layout, sweeps as store_sweeps
from rayeval.io.store.rows import latest_indices, replicate_arrays

SCHEMA = pa.schema([
    pa.field("sweep", pa.string(), nullable=False),
    pa.field("checkpoint", pa.string(), nullable=False),
    pa.field("step", pa.int64()),
    pa.field("epoch", pa.int64()),                       # from the checkpoint's name
    pa.field("evaluation", pa.string(), nullable=False),   # its name in the sweep
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
    # A raced checkpoint's partial cell (docs/racing.md): its data set's row count (null:
    # complete; num_samples then says how many were scored) and why it stopped.
    pa.field("items_total", pa.int64()),
    pa.field("stopped", pa.string()),
    # A cell scored on an lm-eval or lmms-eval entry's ``limit:``: the task's document count
    # (num_samples: the first ones scored; null: every document). Not ``items_total``: such a
    # cell is complete for what it asked, ranked, and never completed by a later run.
    pa.field("limited_from", pa.int64()),
])


def cell_rows(*, sweep: str, checkpoint: str, step: int | None, evaluation: str, results: dict,
              higher_is_better: dict[str, bool], num_samples: int, world_size: int,
              bootstrap_key: str, epoch: int | None = None, num_tokens: int | None = None,
              samples: str | None = None, items_total: int | None = None,
              stopped: str | None = None, limited_from: int | None = None) -> list[dict]:
    """A cell's stored rows, one per metric in the sweep's order (the leaderboard takes an
    evaluation's first row as its headline metric). ``results``: metric key -> an object with
    value, ci_low, ci_high, replicates and matrix (``evaluate.MetricResult``). ``num_tokens``:
    the scored target tokens, for tasks that score tokens rather than rows (None otherwise).
    ``samples``: the tag of the cell's per-item record files (None: it stored none).
    ``items_total``, ``stopped``: a race's partial cell; ``limited_from``: the task's document
    count where a ``limit:`` scored only the first ``num_samples`` of them."""
    return [{"sweep": sweep, "checkpoint": checkpoint, "step": step, "epoch": epoch,
             "evaluation": evaluation, "metric": key, "value": r.value, "ci_low": r.ci_low,
             "ci_high": r.ci_high, "num_samples": num_samples, "num_tokens": num_tokens,
             "world_size": world_size,
             "higher_is_better": higher_is_better[key], "replicates": r.replicates,
             "matrix": r.matrix, "bootstrap": bootstrap_key if r.replicates is not None else None,
             "samples": samples, "items_total": items_total, "stopped": stopped,
             "limited_from": limited_from}
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
        self.check_format()
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

    def check_format(self) -> int:
        """The store's layout version; a store of a newer rayeval is one line."""
        try:
            return layout.check_format(self.fs, self.root, self.location)
        except OSError as e:
            raise StoreError(f"cannot read result store: {paths.explain(e, self.location)}") \
                from None

    def _file(self, cell: str) -> str:
        return f"{self.dir}/{cell}.parquet"

    def has(self, cell: str, sweep: str | None = None) -> bool:
        return cell in self.stored([cell], sweep)

    def stored(self, cells, sweep: str | None = None) -> set[str]:
        """Which of ``cells`` the store holds: their own files (one stat each), then the
        ``cell`` column of the parts of ``sweep`` (every sweep's when None) for the rest,
        filtered to those keys: never the whole store's keys."""
        cells = list(dict.fromkeys(cells))
        if not cells:
            return set()
        try:
            found = self._own_files(cells)
            rest = [c for c in cells if c not in found]
            parts = layout.list_parts(self.fs, self.root, sweep, figures=True) if rest else []
        except OSError as e:
            raise StoreError(f"output: cannot read result store: "
                             f"{paths.explain(e, self.location)}") from None
        if parts:
            table, _ = layout.read_files(
                self.fs, [i.path for i in parts], SCHEMA, self.location, columns=["cell"],
                where=pc.field("cell").isin(rest),
                relist=lambda: [i.path for i in layout.list_parts(self.fs, self.root, sweep,
                                                                  figures=True)])
            found |= set(table["cell"].to_pylist())
        return found

    def write_cell(self, cell: str, rows: list[dict]) -> str:
        """Publish one cell's rows atomically; returns the file's path."""
        now = datetime.now(timezone.utc)
        table = pa.Table.from_pylist(
            [{**r, "cell": cell, "created_at": r.get("created_at", now)} for r in rows],
            schema=SCHEMA)
        return self._put(self.dir, f"{cell}.parquet", table)

    # --- the sweep files: {root}/sweeps/sweep-{digest}/{text digest}.yaml (store.sweeps) ----

    def keep_sweep(self, sweep: str, text: str) -> str | None:
        """Keep a sweep file's text as the newest of ``sweep`` (before a run writes cells);
        the path written, or None when it already is the newest."""
        try:
            return store_sweeps.keep(self.fs, self.root, sweep, text)
        except OSError as e:
            raise StoreError(f"output: cannot write to result store: "
                             f"{paths.explain(e, self.location)}") from None

    def sweep_files(self, sweep: str | None = None) -> dict[str, list[tuple[str, str]]]:
        """Every kept text of the sweep files of ``sweep`` (every sweep's when None): per
        sweep name, (when kept, ISO 8601 UTC; the text as written), newest first."""
        try:
            return store_sweeps.read(self.fs, self.root, sweep)
        except OSError as e:
            raise StoreError(f"cannot read result store: {paths.explain(e, self.location)}") \
                from None

    def sweep_texts(self, sweep: str | None = None) -> dict[str, str]:
        """The newest sweep file's text of ``sweep`` (of every sweep when None), per sweep
        name; a sweep run from a Python object, or before rayeval stored them, has none."""
        return {name: texts[0].text for name, texts in self.sweep_files(sweep).items()}

    # --- per-item records: {root}/samples/{cell}/{tag}-{rank}-of-{world}.parquet ----------

    def samples_dir(self, cell: str) -> str:
        return f"{self.root}/samples/{cell}"

    def write_samples(self, cell: str, tag: str, rank: int, world: int, table: pa.Table) -> str:
        """One worker's per-item records of a cell (its own items), before the cell is
        published; the cell's rows then name ``tag``, so only a complete set is read."""
        return self._put(self.samples_dir(cell), sample_file(tag, rank, world), table)

    def read_samples(self, cell: str, tag: str) -> pa.Table:
        """The per-item records of a published cell: every worker's file of its set; a cell
        scored in segments (``execution.workers.resume``) names one set per segment, joined by "+"."""
        if "+" in tag:
            parts = [self.read_samples(cell, t) for t in tag.split("+")]
            return pa.concat_tables([t for t in parts if t.num_columns] or parts[:1],
                                    promote_options="default")
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
                    try:
                        tables.append(layout.read_parquet(f))
                    except (pa.ArrowInvalid, OSError) as e:     # the file named, not '<Buffer>'
                        why = str(e).splitlines()[0].rpartition("': ")[2][:160]
                        raise StoreError(
                            f"cannot read per-item records: {folder}/{name} is damaged ({why}); "
                            "the cell's results are whole, and `rayeval run --force` writes "
                            "them and their records again") from None
        except (pa.ArrowInvalid, OSError) as e:
            raise StoreError(f"cannot read per-item records: "
                             f"{paths.explain(e, self.location)}") from None
        # a worker that was given no rows wrote a table without columns
        return pa.concat_tables([t for t in tables if t.num_columns] or tables[:1])

    def _put(self, folder: str, name: str, table: pa.Table) -> str:
        """Write a parquet file atomically (local: a hidden temporary renamed into place;
        object storage: one PUT)."""
        try:
            return paths.put(self.fs, folder, name, layout.to_parquet(table))
        except OSError as e:
            raise StoreError(f"output: cannot write to result store: "
                             f"{paths.explain(e, self.location)}; check the path and its "
                             "permissions") from None

    def _own_files(self, cells: list[str]) -> set[str]:
        """Which of ``cells`` have their own file: one stat each locally; on object storage
        one listing of ``results/`` (a request per 1,000 names, where a stat is a request
        per cell: 100 HEADs took 5 s on a loaded machine's S3 server)."""
        if isinstance(self.fs, pafs.LocalFileSystem):
            infos = self.fs.get_file_info([self._file(c) for c in cells])
            return {c for c, i in zip(cells, infos) if i.type == pafs.FileType.File}
        names = {i.base_name for i in layout.list_cells(self.fs, self.root)}
        return {c for c in cells if f"{c}.parquet" in names}

    def read_cell(self, cell: str, columns: list[str] | None = None,
                  sweep: str | None = None) -> list[dict]:
        """One published cell's rows (``columns`` only: leave out the wide replicates)."""
        return self.read_cells([cell], columns, sweep).to_pylist()

    def read_cells(self, cells, columns: list[str] | None = None,
                   sweep: str | None = None) -> pa.Table:
        """The rows of published cells, from their own files or the parts of ``sweep``
        (every sweep's when None), each cell once (its newest write)."""
        cells = list(dict.fromkeys(cells))
        small = columns is not None and "replicates" not in columns

        def files() -> list[str]:
            own = [self._file(c) for c in self._own_files(cells)]
            parts = [i.path for i in layout.list_parts(self.fs, self.root, sweep, small)] \
                if len(own) < len(cells) else []
            return own + parts

        try:
            found = files()
        except OSError as e:
            raise StoreError(f"cannot read result store: {paths.explain(e, self.location)}") \
                from None
        if not found:
            return SCHEMA.empty_table().select(columns or SCHEMA.names)
        wanted = list(columns or SCHEMA.names)
        extra = [c for c in ("cell", "created_at") if c not in wanted]
        table, _ = layout.read_files(self.fs, found, SCHEMA, self.location,
                                     columns=wanted + extra, where=pc.field("cell").isin(cells),
                                     relist=files)
        return layout.newest_writes(table).select(wanted)

    def consolidate(self, cells, wait_s: float = 10.0, summarize=None):
        """Move these cells' own files into one part per sweep (the end of a run); nothing
        when another mover holds the lock for ``wait_s`` (the next compaction moves them).
        ``summarize``: what to keep beside each part (``store.compact.move_cells``)."""
        from rayeval.io.store.compact import move_cells

        try:
            return move_cells(self.fs, self.root, self.location, SCHEMA, list(cells),
                              wait_s=wait_s, summarize=summarize)
        except OSError as e:
            raise StoreError(f"cannot write to result store: "
                             f"{paths.explain(e, self.location)}") from None

    def compact(self, wait_s: float = 0.0, summarize=None):
        """Every cell file into parts, and each sweep's small parts merged
        (``rayeval store compact``); refused in one line while another mover works."""
        from rayeval.io.store.compact import LOCK, move_cells

        self.check("STORE")
        try:
            moved = move_cells(self.fs, self.root, self.location, SCHEMA, None, merge=True,
                               wait_s=wait_s, summarize=summarize)
        except OSError as e:
            raise StoreError(f"cannot compact result store: "
                             f"{paths.explain(e, self.location)}") from None
        if moved.locked:
            lock = paths.to_location(self.fs, f"{self.root}/parts/{LOCK}", self.location)
            raise StoreError(f"STORE: another run or compaction is moving cells ({lock} is "
                             "held); try again when it ends (a lock older than 6 hours is "
                             "taken over)")
        return moved

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

    def read(self, columns: list[str] | None = None, *, sweep: str | None = None,
             evaluation: str | None = None, metric: str | None = None,
             checkpoint: str | None = None) -> pa.Table:
        """Every stored row (``columns`` only; of one sweep, evaluation or metric: filters
        pushed down to the files), by cell; an empty table when the store holds nothing yet.
        Files written before a nullable column was added (``epoch``, ``num_tokens``) read with
        nulls there: the files are read with SCHEMA, and pyarrow fills the columns a file
        lacks."""
        self.check_format()
        try:
            small = columns is not None and "replicates" not in columns
            files = layout.list_files(self.fs, self.root, sweep, figures=small).all
        except OSError as e:
            raise StoreError(f"cannot read result store: {paths.explain(e, self.location)}") \
                from None
        if not files:
            return SCHEMA.empty_table().select(columns or SCHEMA.names)
        where = None
        for column, value in (("sweep", sweep), ("evaluation", evaluation), ("metric", metric)):
            if value is not None:
                term = layout.evaluation_in([value]) if column == "evaluation" else \
                    pc.field(column) == value
                where = term if where is None else where & term
        if checkpoint is not None:            # a regular expression on the location
            term = pc.match_substring_regex(pc.field("checkpoint"), pattern=checkpoint)
            where = term if where is None else where & term
        wanted = list(columns or SCHEMA.names)
        keys = [c for c in ("cell", "created_at", "metric", "evaluation") if c not in wanted]
        table = layout.read_files(
            self.fs, files, SCHEMA, self.location, wanted + keys, where,
            relist=lambda: layout.list_files(self.fs, self.root, sweep, figures=small).all)[0]
        # a cell evaluated again (--force) or read both from its file and the part it moved
        # into while listed: its newest write once
        return layout.newest_writes(table).select(wanted)

    def suites(self, sweep: str | None = None) -> pa.Table:
        """The rows of the parts' suite files (``ranking.suite``: the suite aggregate's
        replicates per checkpoint), of one sweep or every sweep; a damaged one is left out
        (a board then combines those replicates itself)."""
        try:
            files = layout.list_suites(self.fs, self.root, sweep)
        except OSError as e:
            raise StoreError(f"cannot read result store: {paths.explain(e, self.location)}") \
                from None
        tables = []
        for path in files:
            try:
                with self.fs.open_input_file(path) as f:
                    tables.append(layout.read_parquet(f))
            except (pa.ArrowInvalid, OSError):
                continue
        return pa.concat_tables(tables) if tables else None

    def replicates(self, wanted: set[tuple[str, str, str]], sweep: str | None = None
                   ) -> dict[tuple[str, str, str], np.ndarray]:
        """The replicates of the rows ``(cell, evaluation, metric)``, as float64 arrays: read
        from only the row groups of those evaluations and metrics."""
        if not wanted:
            return {}
        where = layout.evaluation_in({d for _, d, _ in wanted}) & \
            pc.field("metric").isin(sorted({m for _, _, m in wanted}))
        cells = {c for c, _, _ in wanted}
        if len(cells) <= 10_000:                  # few cells: only their rows are kept
            where = where & pc.field("cell").isin(sorted(cells))
        files = [f for f in layout.list_files(self.fs, self.root, sweep).all]
        if not files:
            return {}
        table, _ = layout.read_files(
            self.fs, files, SCHEMA, self.location, ["cell", "evaluation", "metric", "replicates"],
            where, ordered=False, relist=lambda: layout.list_files(self.fs, self.root, sweep).all)
        out = {}
        keys = zip(*(table[c].to_pylist() for c in ("cell", "evaluation", "metric")))
        for key, reps in zip(keys, replicate_arrays(table["replicates"])):
            if key in wanted and reps is not None:
                out[key] = reps
        return out


def sample_file(tag: str, rank: int, world: int) -> str:
    return f"{tag}-{rank:05d}-of-{world:05d}.parquet"


def newest(store: str | os.PathLike, *, sweep: str | None = None,
           evaluation: str | None = None, what: str = "store",
           columns: list[str] | None = None, metric: str | None = None,
           checkpoint: str | None = None) -> pa.Table:
    """The newest stored row of every (sweep, checkpoint, evaluation, metric), as
    ``rayeval.results`` documents; ``what`` names the store in errors (the command line's
    ``STORE``, a sweep's ``output``). ``metric``, ``checkpoint`` (a regular expression on the
    location): only those rows. ``columns``: only these (``store.layout.figures``: all
    but the replicates, a small part of the bytes)."""
    given = os.fspath(store)
    location = paths.resolve(given, os.getcwd())
    opened = ResultStore(location)
    if paths.is_uri(location):
        opened.check(what)
    elif not os.path.isdir(location):
        raise StoreError(f"{what}: no result store at {given!r}; give the output folder of "
                         "a sweep")
    wanted = None if columns is None else list(columns)
    extra = [] if wanted is None else \
        [c for c in ("sweep", "checkpoint", "evaluation", "metric", "created_at")
         if c not in wanted]
    table = opened.read(None if wanted is None else wanted + extra, sweep=sweep,
                        evaluation=evaluation, metric=metric, checkpoint=checkpoint)
    table = table.take(latest_indices(table))
    return table if wanted is None else table.select(wanted)
