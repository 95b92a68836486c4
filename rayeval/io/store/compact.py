"""Moving one-cell files into parts: at the end of a run (its own cells) and by
``rayeval store compact STORE`` (every cell file, and small parts merged).

Safe beside running writers: a part is published whole (a local temporary renamed into place,
one PUT on object storage) before any file it holds is removed, so a reader at any moment
finds every cell (for a moment possibly twice: readers keep one copy); and a cell file is
removed only if it is still the one that was read (a run that wrote the cell again since keeps
its newer file). Two movers at once could both copy a file into their parts: a lock file lets
one mover work at a time (locally an exclusive create; on object storage a written-then-read
token, which narrows but cannot close that window: a duplicate there is kept once by readers
and removed by the next compaction).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rayeval.io import paths
from rayeval.io.store import layout

LOCK = ".lock"               # in parts/: hidden, so no reader lists it
STALE_LOCK_S = 6 * 3600      # a lock older than this is a crashed mover's
BATCH_CELLS = 4096           # cell files read at once: ~140 MB of a 34 KB-per-cell store
PART_ROWS = 100_000          # rows per part at most (~800 MB of 1,000 replicates: 1 part per
                             # ~33,000 three-metric cells)


@dataclass
class Moved:
    cells: int = 0                       # cell files moved into parts
    parts_written: int = 0
    parts_merged: int = 0                # small parts merged into bigger ones
    damaged: list[str] = field(default_factory=list)   # left where they are
    kept: list[str] = field(default_factory=list)      # written again meanwhile: kept
    locked: bool = False                 # another mover held the lock: nothing done


class Lock:
    def __init__(self, fs: pafs.FileSystem, root: str):
        self.fs, self.folder = fs, f"{root}/parts"
        self.path = f"{self.folder}/{LOCK}"
        self.token = f"{socket.gethostname()} {os.getpid()} {uuid.uuid4().hex}"
        self.held = False

    def acquire(self) -> bool:
        self.fs.create_dir(self.folder, recursive=True)
        body = json.dumps({"token": self.token, "since": time.time()}).encode()
        if isinstance(self.fs, pafs.LocalFileSystem):
            for _ in range(2):
                try:
                    fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    if not self._break_stale():
                        return False
                    continue
                with os.fdopen(fd, "wb") as f:
                    f.write(body)
                self.held = True
                return True
            return False
        if self.fs.get_file_info(self.path).type == pafs.FileType.File \
                and not self._break_stale():
            return False
        with self.fs.open_output_stream(self.path) as f:
            f.write(body)
        self.held = self._holder() == self.token     # a second writer's PUT won: back off
        return self.held

    def _holder(self) -> str | None:
        try:
            with self.fs.open_input_stream(self.path) as f:
                return json.loads(f.read())["token"]
        except (OSError, ValueError, KeyError):
            return None

    def _break_stale(self) -> bool:
        try:
            with self.fs.open_input_stream(self.path) as f:
                since = float(json.loads(f.read())["since"])
        except (OSError, ValueError, KeyError):
            since = 0.0                                  # unreadable: a crash mid-write
        if time.time() - since < STALE_LOCK_S:
            return False
        try:
            self.fs.delete_file(self.path)
        except FileNotFoundError:
            pass
        return True

    def release(self) -> None:
        if self.held and self._holder() == self.token:
            self.fs.delete_file(self.path)
        self.held = False


Summarize = Callable[[pa.Table], "pa.Table | None"]


def move_cells(fs: pafs.FileSystem, root: str, location: str, schema: pa.Schema,
               cells: list[str] | None = None, merge: bool = False,
               wait_s: float = 0.0, summarize: Summarize | None = None) -> Moved:
    """Move cell files into parts (``cells``: only these keys; None: every one), and with
    ``merge`` merge each sweep's small parts. Returns what was done; ``locked`` when another
    mover held the lock for ``wait_s`` seconds. ``summarize``: a part's rows to the table
    kept beside it (``ranking.suite.summaries``: this layer cannot compute it)."""
    lock = Lock(fs, root)
    deadline = time.monotonic() + wait_s
    while not lock.acquire():
        if time.monotonic() >= deadline:
            return Moved(locked=True)
        time.sleep(0.2)
    try:
        layout.mark_format(fs, root)
        moved = Moved()
        if cells is None:
            infos = layout.list_cells(fs, root)
        else:                       # one stat per cell: never a listing of a big results/
            found = fs.get_file_info([f"{root}/results/{c}.parquet"
                                      for c in dict.fromkeys(cells)])
            infos = [i for i in found if i.type == pafs.FileType.File]
        for start in range(0, len(infos), BATCH_CELLS):
            _move_batch(fs, root, location, schema, infos[start:start + BATCH_CELLS], moved,
                        summarize)
        if merge:
            for sweep_dir in _sweep_dirs(fs, root):
                _merge_small(fs, root, location, schema, sweep_dir, moved, summarize)
        return moved
    finally:
        lock.release()


def _move_batch(fs, root, location, schema, infos: list[pafs.FileInfo], moved: Moved,
                summarize: Summarize | None) -> None:
    damaged = _publish_rows_of(fs, root, location, schema, infos, moved, summarize)
    for info in infos:
        if info.path in damaged:
            continue
        if _remove_if_unchanged(fs, info):
            moved.cells += 1
        else:
            moved.kept.append(info.path)


def _publish_rows_of(fs, root, location, schema, infos: list[pafs.FileInfo],
                     moved: Moved, summarize: Summarize | None) -> list[str]:
    """Read ``infos`` (cell files or parts; a damaged one left out and counted) and publish
    their rows, each cell's newest write once, as one part per sweep; the damaged paths."""
    table, damaged = layout.read_files(fs, [i.path for i in infos], schema, location,
                                       schema.names + [layout.ORDINAL], skip_damaged=True)
    moved.damaged += damaged
    for sweep, rows in _by_sweep(_with_ordinals(layout.newest_writes(table))):
        _publish(fs, root, sweep, rows, summarize)
        moved.parts_written += 1
    return damaged


def _with_ordinals(table: pa.Table) -> pa.Table:
    """Each row's place in its cell (rows come by cell, a cell's rows in its order)."""
    n = table.num_rows
    cells = table["cell"].combine_chunks().dictionary_encode().indices.to_numpy(
        zero_copy_only=False)
    starts = np.flatnonzero(np.append(True, cells[1:] != cells[:-1])) if n else np.array([])
    first = np.repeat(starts, np.diff(np.append(starts, n))) if n else np.array([], np.int64)
    ordinal = pa.array((np.arange(n) - first).astype(np.int32), pa.int32())
    return table.set_column(table.schema.get_field_index(layout.ORDINAL), layout.ORDINAL,
                            ordinal)


def _by_sweep(table: pa.Table):
    for sweep in pc.unique(table["sweep"]).to_pylist():
        rows = table.filter(pc.equal(table["sweep"], sweep))
        for start in range(0, rows.num_rows, PART_ROWS):
            yield sweep, rows.slice(start, PART_ROWS)


def _publish(fs, root: str, sweep: str, rows: pa.Table,
             summarize: Summarize | None = None) -> str:
    """One part, rows by (metric, evaluation, cell, ordinal): a metric's rows sit together, so a
    read of one metric skips the others' row groups by their statistics. Its suite file
    (``summarize``) and figures file go first: a part is read once it is there."""
    rows = rows.sort_by([("metric", "ascending"), ("evaluation", "ascending"),
                         ("cell", "ascending"), (layout.ORDINAL, "ascending")])
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    name = f"part-{stamp}-{uuid.uuid4().hex[:8]}.parquet"
    folder = f"{root}/parts/{layout.sweep_folder(sweep)}"
    suite = summarize(rows) if summarize is not None else None
    if suite is not None:
        paths.put(fs, folder, layout.suite_of(name), _parquet(suite))
    small = rows.drop_columns([layout.REPLICATES])
    paths.put(fs, folder, layout.figures_of(name), _parquet(small))
    return paths.put(fs, folder, name, _parquet(rows))


def _parquet(table: pa.Table) -> bytes:
    return layout.to_parquet(table, row_group_size=layout.ROW_GROUP)


def _remove_if_unchanged(fs, info: pafs.FileInfo) -> bool:
    """Remove a file moved into a part, unless a writer replaced it since it was listed.
    Locally the file is first renamed aside (atomic), so the check sees what is removed; a
    newer file found there is put back unless an even newer one took its place."""
    if isinstance(fs, pafs.LocalFileSystem):
        aside = f"{os.path.dirname(info.path)}/.moved-{uuid.uuid4().hex}-{info.base_name}"
        try:
            os.rename(info.path, aside)
        except FileNotFoundError:
            return True                                     # removed by a mover before
        st = os.stat(aside)
        if st.st_size == info.size and st.st_mtime_ns == info.mtime_ns:
            os.unlink(aside)
            return True
        try:
            os.link(aside, info.path)                       # fails if a newer one is there
        except FileExistsError:
            pass
        os.unlink(aside)
        return False
    now = fs.get_file_info(info.path)
    if now.type == pafs.FileType.NotFound:
        return True
    if now.size != info.size or now.mtime != info.mtime:
        return False
    fs.delete_file(info.path)
    return True


def _sweep_dirs(fs, root: str) -> list[str]:
    found = fs.get_file_info(pafs.FileSelector(f"{root}/parts", allow_not_found=True))
    return sorted(i.path for i in found if i.type == pafs.FileType.Directory)


def _merge_small(fs, root, location, schema, sweep_dir: str, moved: Moved,
                 summarize: Summarize | None) -> None:
    """Merge the parts of a sweep holding under half of PART_ROWS rows (a `watch` writes one
    part per checkpoint), up to PART_ROWS rows a part."""
    small, rows = [], 0
    found = fs.get_file_info(pafs.FileSelector(sweep_dir, allow_not_found=True))
    for info in sorted((i for i in found if layout.visible(i)
                        and not i.base_name.endswith(layout.FIGURES)), key=lambda i: i.path):
        with fs.open_input_file(info.path) as f:
            n = pq.read_metadata(f).num_rows
        if n < PART_ROWS // 2:
            small.append((info, n))
    groups, current = [], []
    for info, n in small:
        if current and rows + n > PART_ROWS:
            groups.append(current)
            current, rows = [], 0
        current.append(info)
        rows += n
    if len(current) > 1 or groups:
        groups.append(current)
    for group in groups:
        if len(group) < 2:
            continue
        damaged = _publish_rows_of(fs, root, location, schema, group, moved, summarize)
        for info in group:
            if info.path not in damaged:
                fs.delete_file(info.path)          # the part, then its figures and suite
                for beside in (layout.figures_of(info.path), layout.suite_of(info.path)):
                    try:
                        fs.delete_file(beside)
                    except FileNotFoundError:
                        pass
                moved.parts_merged += 1
