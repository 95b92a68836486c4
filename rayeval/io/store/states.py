"""A partial cell's summed states, so that a later run completes it instead of starting over.

A race (``execution.workers.race``) stops scoring a checkpoint after the rows of the bootstrap buckets
below some boundary; its cell is published partial. A cell in progress (``execution.workers.resume``)
is saved as it goes, every ``resume.every`` seconds, with the buckets scored so far. Either way
its states (integer sums, merged over the workers) are saved here, one file per partial cell,
and removed once the complete cell is published::

    {root}/states/{cell}.parquet    columns name (string), shape (list<int64>), values (list<int64>);
                                    schema metadata: scored_below (the bucket boundary),
                                    buckets (the evaluation's bucket count), samples (the
                                    tags of the per-item records of those rows, joined by
                                    "+"; absent: none were saved)

Plain parquet (no pickle): states are int64 arrays. A later run without ``select:`` scores the
buckets from the boundary on and adds these states before publishing the complete cell, which
equals a full run's (states add bucket by bucket). ``torch`` is imported by the callers only.
"""

from __future__ import annotations


import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from rayeval.errors import StoreError
from rayeval.io import paths
from rayeval.io.store import layout

FOLDER = "states"
# A judged evaluation's generations (docs/judges.md): the generation stage's merged states,
# complete, under the generation key, with the tag of the records that hold the responses
# (schema metadata ``samples``). The judge stage reads them, in this run or a later one.
GENERATIONS = "generations"


def write(store, cell: str, states: dict, scored_below: int, buckets: int,
          folder: str = FOLDER, meta: dict[str, str] | None = None) -> None:
    """Keep ``states`` (name -> integer array) of partial cell ``cell`` (its complete key);
    ``folder`` GENERATIONS: a judged evaluation's generations, ``meta`` their records' tag."""
    names = sorted(states)
    arrays = [np.asarray(states[n]) for n in names]
    table = pa.table({"name": names, "shape": [list(a.shape) for a in arrays],
                      "values": [a.astype(np.int64).reshape(-1) for a in arrays]},
                     schema=pa.schema([("name", pa.string()), ("shape", pa.list_(pa.int64())),
                                       ("values", pa.list_(pa.int64()))]))
    table = table.replace_schema_metadata({"scored_below": str(scored_below),
                                           "buckets": str(buckets), **(meta or {})})
    try:
        paths.put(store.fs, f"{store.root}/{folder}", f"{cell}.parquet",
                  layout.to_parquet(table))
    except OSError as e:
        raise StoreError(f"output: cannot write to result store: "
                         f"{paths.explain(e, store.location)}") from None


def saved(store, cells, folder: str = FOLDER) -> set[str]:
    """Which of ``cells`` (complete keys) have partial states saved: one listing."""
    try:
        infos = store.fs.get_file_info(pafs.FileSelector(f"{store.root}/{folder}",
                                                         allow_not_found=True))
    except OSError as e:
        raise StoreError(f"output: cannot read result store: "
                         f"{paths.explain(e, store.location)}") from None
    names = {i.base_name for i in infos}
    return {c for c in cells if f"{c}.parquet" in names}


def read(store, cell: str, folder: str = FOLDER, meta: dict | None = None
         ) -> tuple[dict, int, int]:
    """(states as name -> int64 numpy array, scored_below, buckets) of partial cell ``cell``;
    ``meta``: filled with the file's other metadata (a generations file's records tag)."""
    path = f"{store.root}/{folder}/{cell}.parquet"
    try:
        with store.fs.open_input_file(path) as f:
            table = layout.read_parquet(f)
    except (OSError, pa.ArrowInvalid) as e:
        raise StoreError(f"the saved states of partial cell {cell} cannot be read ({path}: "
                         f"{e}); evaluate it again with --force") from None
    found = table.schema.metadata or {}
    if meta is not None:
        meta.update({k.decode(): v.decode() for k, v in found.items()
                     if k not in (b"scored_below", b"buckets")})
    states = {name: np.asarray(values, dtype=np.int64).reshape(shape)
              for name, shape, values in zip(table["name"].to_pylist(),
                                             table["shape"].to_pylist(),
                                             table["values"].to_pylist())}
    return states, int(found[b"scored_below"]), int(found[b"buckets"])


def remove(store, cell: str, folder: str = FOLDER) -> None:
    """Forget the saved states of ``cell`` (its complete cell is published); none: nothing."""
    try:
        store.fs.delete_file(f"{store.root}/{folder}/{cell}.parquet")
    except FileNotFoundError:
        pass
    except OSError as e:
        raise StoreError(f"output: cannot write to result store: "
                         f"{paths.explain(e, store.location)}") from None
