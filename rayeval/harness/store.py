"""Rendered lm-eval tasks in the result store, and on their way to the workers.

The request table (``requests.py``: plain columns only) is kept under the store's
``requests/{digest}/docs.parquet``, written once: a sweep that renders the same task finds it
there. What the store holds is not trusted: before a run reads a table, the driver compares the
stored file's bytes with the bytes it rendered itself (``check_stored``), and a stored table
that differs is a one-line ``StoreError`` naming the file (delete it, or run with --force to
write the driver's own over it). The lm-eval task object a worker scores with (its filters,
``process_results``, its documents) never goes through the store: the driver ships it with the
plan through Ray (``shipment``/``receive``). A ``task.pkl`` an older rayeval left beside the
table is never read.

An entry planned from a rendering cached by an earlier run (``render_cache``) has no table or
task in memory: its ``table_sha256`` is what the stored table is checked against, and its task is
rendered again (``render_cached``) only when the workers need it or the table must be written.
"""

from __future__ import annotations

import hashlib
import io
from typing import TYPE_CHECKING

import pyarrow.fs as pafs

from rayeval.errors import StoreError
from rayeval.io import paths

if TYPE_CHECKING:
    from rayeval.harness.requests import Rendered

REQUESTS_DIR = "requests"
DOCS_FILE = "docs.parquet"

# This process's renderings by their table's location: the driver's (filled by ``write``) and,
# on a worker, the tasks the driver sent (``receive``).
_RENDERED: dict[str, "Rendered"] = {}
_TASKS: dict[str, object] = {}
# docs-table location -> (result store, rendered task): rendered while a sweep file was read
# (lm-eval's tasks, ``harness.entries``, and lmms-eval's, ``lmms.entries``), not yet written.
UNWRITTEN: dict[str, tuple[str, object]] = {}


# A rendered task whose entry's ``limit:`` left documents out keeps the task's document count
# under this attribute (``render.limit_count`` sets it before the task is pickled, so the copy a
# worker scores with has it too): the cell is stored as num_samples of that many.
LIMITED_FROM = "_rayeval_limited_from"


def location(output: str, digest: str) -> str:
    """Where a rendered task's files live in the result store."""
    return f"{output.rstrip('/')}/{REQUESTS_DIR}/{digest}"


class RequestTables:
    """What an entry kind whose evaluations read request tables rendered on the driver does
    around a run (``config.entries``): the lm-eval and lmms-eval kinds."""

    def prepare(self, specs, force: bool = False) -> None:
        tables = [s.dataset.path for s in specs]
        for data in tables:
            waiting = UNWRITTEN.pop(data, None)
            if waiting is not None:
                write(*waiting)
        check_stored(tables, force)

    def shipment(self, specs) -> dict[str, bytes]:
        render_cached([s.dataset.path for s in specs])
        return shipment([s.dataset.path for s in specs])

    def receive(self, shipped: dict[str, bytes]) -> None:
        receive(shipped)


def write_requests(sweep) -> None:
    """Write the request tables of the sweep's lm-eval and lmms-eval evaluations that this
    process rendered and has not written yet (a table already in the store is kept): the
    parser writes nothing, the run writes them when it is planned."""
    for ev in sweep.evals:
        rendered = ev.lm_eval is not None or ev.lmms_eval is not None
        waiting = UNWRITTEN.pop(ev.dataset.path, None) if rendered else None
        if waiting is not None:
            write(*waiting)


def table_bytes(rendered: "Rendered") -> bytes:
    """The request table as the parquet file the store keeps (the same bytes for the same
    table and pyarrow version; the digest names both)."""
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(rendered.table, buf)
    return buf.getvalue()


def write(output: str, rendered: "Rendered") -> str:
    """The task's request table under the store, once (content-keyed: a file already there is
    checked by ``check_stored`` before a run reads it); returns the table's location."""
    folder = location(output, rendered.digest)
    fs, base = paths.filesystem(folder)
    if fs.get_file_info(f"{base}/{DOCS_FILE}").type != pafs.FileType.File:
        paths.put(fs, base, DOCS_FILE, table_bytes(rendered))
    data = f"{folder}/{DOCS_FILE}"
    _RENDERED[data] = rendered
    return data


def mismatch(data: str, rendered: "Rendered") -> str | None:
    """Why the stored table at ``data`` is not the one rendered (one line), or None."""
    fs, path = paths.filesystem(data)
    try:
        with fs.open_input_stream(path) as f:
            stored = f.read()
    except (FileNotFoundError, OSError):
        return f"{data}: the request table rendered for this sweep is missing"
    # A rendering cached by an earlier run (``render_cache.CachedTask``) knows its table's sha256
    # without rendering it again.
    want = getattr(rendered, "table_sha256", None) or \
        hashlib.sha256(table_bytes(rendered)).hexdigest()
    got = hashlib.sha256(stored).hexdigest()
    if got == want:
        return None
    return (f"{data}: the stored request table is not the one this sweep rendered (sha256 "
            f"{got[:12]}, expected {want[:12]} for digest {rendered.digest}), so it is not "
            f"trusted; delete {data.rsplit('/', 1)[0]} or run with --force")


def check_stored(data_paths, force: bool = False) -> None:
    """Before a run reads them: every stored request table among ``data_paths`` that this
    process rendered holds exactly the rendered bytes; ``force`` writes those bytes over one
    that does not (or is missing), else it is a StoreError."""
    for data in data_paths:
        rendered = _RENDERED.get(data)
        if rendered is None:
            continue
        why = mismatch(data, rendered)
        if why is None:
            continue
        if not force:
            raise StoreError(why)
        folder, name = data.rsplit("/", 1)
        fs, base = paths.filesystem(folder)
        paths.put(fs, base, name, table_bytes(rendered))


def render_cached(data_paths) -> None:
    """The tasks of the request tables among ``data_paths`` that were planned from cached
    renderings (``render_cache.CachedTask``), rendered now (with lm-eval or lmms-eval) and checked
    against what was cached: the workers need the task objects. ``RequestTables.shipment``
    calls it as the driver makes the trainer; a planner that knows cells are pending may call
    it before Ray starts."""
    for data in data_paths:
        rendered = _RENDERED.get(data)
        if rendered is not None and getattr(rendered, "is_rendered", True) is False:
            rendered.rendered


def shipment(data_paths) -> dict[str, bytes]:
    """What the workers need of the driver's rendered tasks, to send with the plan through
    Ray: each task (pickled by the driver, with its ``!function`` code) by its table's
    location."""
    return {d: _RENDERED[d].blob for d in data_paths if d in _RENDERED}


def receive(shipped: dict[str, bytes] | None) -> None:
    """On a worker: keep the tasks the driver sent. They come from the driver through Ray
    (which unpickles the plan the same way), never from the store."""
    import pickle

    for data, blob in (shipped or {}).items():
        if data not in _TASKS:
            _TASKS[data] = pickle.loads(blob)     # the driver's bytes, sent through Ray


def task_for(data: str):
    """The lm-eval task a request table was rendered from: the driver's own, else the one it
    sent this worker."""
    if data in _TASKS:
        return _TASKS[data]
    rendered = _RENDERED.get(data)
    if rendered is not None and rendered.lm is not None:
        return rendered.lm
    if rendered is not None:
        receive({data: rendered.blob})
        return _TASKS[data]
    return None


def limited_from(data: str) -> int | None:
    """The document count of the task a request table was rendered from, where its entry's
    ``limit:`` kept only the first ones (the table's rows); None: every document, or no
    rendered task there."""
    rendered = _RENDERED.get(data)
    if data not in _TASKS and rendered is not None and hasattr(rendered, "limited_from"):
        return rendered.limited_from          # a cached rendering's (``render_cache.CachedTask``)
    task = task_for(data)
    return None if task is None else getattr(task, LIMITED_FROM, None)
