"""From a sweep to the cells a run must evaluate: checkpoints x the data set, each with a
content key, minus those the result store already holds.

Plain Python (no Ray): the driver builds a Plan, the workers receive it pickled.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import pyarrow.fs as pafs

from . import paths
from .checkpoints import CheckpointRef, expand_checkpoints
from .data import DatasetInfo
from .spec import Sweep
from .store import ResultStore


@dataclass(frozen=True)
class Cell:
    checkpoint: CheckpointRef
    key: str                     # content key: the store's file name for this cell
    fingerprint: str = ""        # the checkpoint's: a changed file is a new cell


@dataclass(frozen=True)
class Plan:
    sweep: Sweep
    dataset: DatasetInfo
    cells: tuple[Cell, ...]      # pending: to evaluate in this run
    cached: tuple[Cell, ...]     # already in the store


def checkpoint_fingerprint(location: str) -> str:
    """Cheap identity of a checkpoint's bytes: sizes and modification times, not contents."""
    fs, path = paths.filesystem(location)
    info = fs.get_file_info(path)
    parts = [f"{info.size}:{info.mtime_ns}"]
    if info.type == pafs.FileType.Directory:
        for sub in sorted(fs.get_file_info(pafs.FileSelector(path, recursive=True)),
                          key=lambda i: i.path):
            parts.append(f"{sub.path[len(path):]}:{sub.size}:{sub.mtime_ns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def cell_key(sweep: Sweep, dataset: DatasetInfo, checkpoint: CheckpointRef,
             fingerprint: str | None = None) -> str:
    """Everything a cell's numbers depend on: the checkpoint's bytes (by fingerprint), the data
    set's, and how they are read and scored. Not the batch size or the worker count, which do
    not change the numbers. The sweep name and the checkpoint's path are in it because the
    stored rows carry them."""
    ds = sweep.dataset
    ident = {
        "sweep": sweep.name,
        "checkpoint": checkpoint.location,
        "checkpoint_fingerprint": fingerprint or checkpoint_fingerprint(checkpoint.location),
        "checkpoint_options": [sweep.checkpoint.key, sweep.checkpoint.strip_prefix],
        "dataset": ds.name,
        "dataset_fingerprint": dataset.fingerprint,
        "columns": [ds.inputs, ds.target],
        "tokens": [ds.ignore_index, ds.pad_id] if sweep.task == "language_modeling" else None,
        "model": [sweep.model.factory, sweep.model.kwargs, sweep.model.dtype],
        "task": sweep.task,
        "metrics": [m.key for m in sweep.metrics],
        "metric_params": [[m.name, m.params] for m in sweep.metrics],
        "bootstrap": sweep.bootstrap.key if sweep.bootstrap.enabled else None,
        "confidence": sweep.bootstrap.confidence,
        "id": sweep.dataset.id,
    }
    blob = json.dumps(ident, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def make_plan(sweep: Sweep, dataset: DatasetInfo, store: ResultStore | None,
              force: bool = False) -> Plan:
    refs = expand_checkpoints(sweep.checkpoints)
    pending, cached = [], []
    for ref in refs:
        fingerprint = checkpoint_fingerprint(ref.location)
        cell = Cell(ref, cell_key(sweep, dataset, ref, fingerprint), fingerprint)
        if not force and store is not None and store.has(cell.key):
            cached.append(cell)
        else:
            pending.append(cell)
    return Plan(sweep=sweep, dataset=dataset, cells=tuple(pending), cached=tuple(cached))
