"""SQL over a result store: ``rayeval query STORE "SQL"`` and :func:`query`.

DuckDB runs the SQL; the store's files reach it as a ``pyarrow.dataset`` (local or any
``pyarrow.fs`` filesystem: S3 through ``pyarrow.fs.S3FileSystem``, so DuckDB's own httpfs
extension, which it downloads at run time, is never needed). DuckDB pushes the query's
columns and filters into the dataset scan, so a query of a few columns reads only those
columns' bytes. The SQL sees three views:

- ``results``: every stored row, as written (a cell written twice: both writes);
- ``latest``: the newest row of every (sweep, checkpoint, evaluation, metric), as boards use;
- ``cells``: one row per cell file or part (``path``, ``kind``: ``cell`` or ``part``).

``results`` and ``latest`` also show the evaluation's name as ``dataset``, its column's name
in files written before 2026-12-02 (``layout.LEGACY``), so queries written then still run.
"""

from __future__ import annotations

import os
import sys

import pyarrow as pa
import pyarrow.dataset as pads

from rayeval.errors import StoreError
from rayeval.io import paths
from rayeval.io.store import layout
from rayeval.io.store.results import SCHEMA, ResultStore

# Every file's rows, the evaluation's name in ``evaluation`` whichever column a file holds it
# in, and again as ``dataset`` (its older name) for queries written before the rename.
RESULTS = """
    SELECT * REPLACE (coalesce(evaluation, dataset) AS evaluation,
                      coalesce(evaluation, dataset) AS dataset)
    FROM files
"""
LATEST = """
    SELECT * EXCLUDE (_rank) FROM (
        SELECT *, row_number() OVER (PARTITION BY sweep, checkpoint, evaluation, metric
                                     ORDER BY created_at DESC) AS _rank
        FROM results) WHERE _rank = 1
"""


def query(store: str | os.PathLike, sql: str, *, damaged: str = "refuse") -> pa.Table:
    """The result of ``sql`` over the store's rows, as an Arrow table. ``damaged``: a file
    that cannot be read is refused in one line that names it (``"refuse"``), or left out
    (``"skip"``, named on stderr)."""
    try:
        import duckdb
    except ImportError:
        raise StoreError("rayeval query needs DuckDB: pip install 'rayeval[query]'") from None
    if not sql.strip():
        raise StoreError("SQL: expected a query, e.g. \"SELECT evaluation, avg(value) FROM "
                         "latest GROUP BY evaluation\"")
    given = os.fspath(store)
    location = paths.resolve(given, os.getcwd())
    if not paths.is_uri(location) and not os.path.isdir(location):
        raise StoreError(f"STORE: no result store at {given!r}; give the output folder of a "
                         "sweep")
    opened = ResultStore(location)
    opened.check("STORE")
    names = layout.list_files(opened.fs, opened.root).all
    try:
        return _run(duckdb, opened, location, names, sql)
    except duckdb.Error as e:
        bad, gone = layout.unreadable(opened.fs, names)   # looked for only after a failure
        if gone and not bad:                 # moved into a part since listed: list again
            return _run(duckdb, opened, location, layout.list_files(opened.fs,
                                                                    opened.root).all, sql)
        if not bad:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StoreError(f"SQL: {first}") from None
    shown = [paths.to_location(opened.fs, b, location) for b in bad]
    if damaged != "skip":
        raise StoreError(f"damaged file in the result store: {shown[0]}; move it away, or "
                         "query the rest with --skip-damaged")
    for path in shown:
        print(f"warning: skipped a damaged file: {path}", file=sys.stderr, flush=True)
    try:
        return _run(duckdb, opened, location, [n for n in names if n not in bad], sql)
    except duckdb.Error as e:
        raise StoreError(f"SQL: {str(e).strip().splitlines()[0]}") from None


def _run(duckdb, opened: ResultStore, location: str, names: list[str], sql: str) -> pa.Table:
    schema = layout.read_schema(SCHEMA)
    results = pads.dataset(names, filesystem=opened.fs, format=layout.parquet_format(),
                           schema=schema) \
        if names else schema.empty_table()
    cells = pa.table({"path": [paths.to_location(opened.fs, n, location) for n in names],
                      "kind": ["part" if n.startswith(f"{opened.root}/parts/") else "cell"
                               for n in names]})
    con = duckdb.connect()
    try:
        con.register("files", results)
        con.register("cells", cells)
        con.execute(f"CREATE VIEW results AS {RESULTS}")
        con.execute(f"CREATE VIEW latest AS {LATEST}")
        relation = con.sql(sql)
        return pa.table({}) if relation is None else relation.to_arrow_table()
    finally:
        con.close()
