"""The result store: evaluated cells (checkpoint x evaluation) as parquet rows, one per metric,
on a local folder or object storage (docs/result-store.md).

    results   ``ResultStore``: writing a cell, reading rows (filtered in the files' scan),
              stored keys, samples, replicates; ``newest``, the newest row of every key
    rows      the stored row's format read back: the newest rows, replicates as arrays, a
              metric's direction, a row's bootstrap settings and confidence
    layout    where files go (``results/``, ``parts/``, sidecars), reading and writing them
              with page checksums
    compact   moving cells into parts (a run's end, ``rayeval store compact``)
    sweeps    the sweep files kept beside a store
    states    a cell's kept states (mid-cell resume)
    query     ``rayeval query``: rows by SQL-like filters

Everything a reader needs is named here: ``from rayeval.io.store import ResultStore``.
"""

from rayeval.io.store.results import SCHEMA, ResultStore, cell_rows, newest, sample_file
from rayeval.io.store.rows import (bootstrap_params, confidence_of, direction, latest_indices,
                                   latest_rows, replicate_arrays)

__all__ = ["SCHEMA", "ResultStore", "bootstrap_params", "cell_rows", "confidence_of",
           "direction", "latest_indices", "latest_rows", "newest", "replicate_arrays",
           "sample_file"]
