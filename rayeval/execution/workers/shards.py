"""A worker's rows of one evaluation, decoded: streamed on the first pass, kept in memory
for later passes when every worker's shard fits one budget shared by the evaluations.

    Budget     bytes of decoded shards a worker may still keep
    Shard      an evaluation's decoded batches (or a BadBatch for one that cannot be decoded)
    Slab       one block per tensor that a held shard's batches are views of
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import ray.train
import torch

from rayeval.config import constants
from rayeval.core import tasks
from rayeval.core.evaluate import Decoder
from rayeval.errors import DataError, RayevalError, traceback_of
from rayeval.execution.pipeline import SplitRows
from rayeval.io.data import RowRange


def cache_budget_bytes() -> int:
    """How much decoded shard a worker may keep, over all evaluations:
    RAYEVAL_SHARD_CACHE_BYTES, else a quarter of this node's available memory shared by the
    workers on it."""
    given = constants.shard_cache_bytes()
    if given is not None:
        return given
    import psutil

    local = max(1, ray.train.get_context().get_local_world_size())
    return int(psutil.virtual_memory().available / 4 / local)


class Budget:
    """Bytes of decoded shards this worker may still keep."""

    def __init__(self, total: int):
        self.left = total

    def take(self, n: int) -> bool:
        if n > self.left:
            return False
        self.left -= n
        return True

    def give(self, n: int) -> None:
        self.left += n


class BadBatch(NamedTuple):
    """A batch that could not be decoded (bad data in this evaluation): the pass records the
    error and goes on draining its split, so only this evaluation's cells fail."""
    error: RayevalError
    rows: int


class Slab:
    """The kept rows of one tensor of a shard, copied into one block allocated up front (in
    page-locked memory with ``pin``).

    Kept batches allocated one by one sit among a pass's temporaries: the allocator then put
    every batch's temporaries on fresh pages above the newest kept batch and gave them back
    after it, so the first pass paid a page fault per page of every temporary (on the bench
    sweep's MLP, its ReLUs ran 10x slower and the pass took 2.2 s against 0.45 s later). A
    tensor whose later batches differ in shape or type (text padded per batch) is kept as
    it comes (``Shard`` keeps text tasks' batches as they come: their lengths vary)."""

    def __init__(self, rows: int, pin: bool):
        self.rows = rows
        self.pin = pin
        self.block: torch.Tensor | None = None
        self.at = 0

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        if self.block is None:
            self.block = torch.empty((self.rows, *t.shape[1:]), dtype=t.dtype,
                                     pin_memory=self.pin)
        n = t.shape[0]
        if t.shape[1:] != self.block.shape[1:] or t.dtype != self.block.dtype \
                or self.at + n > self.rows:
            return t.pin_memory() if self.pin else t
        view = self.block[self.at:self.at + n]
        view.copy_(t)
        self.at += n
        return view


class Shard:
    """This worker's rows of one evaluation as tensor batches (inputs, targets, row buckets):
    streamed on the first pass, kept if they fit the budget and every worker's fit (in
    ``Slab``s; in page-locked memory with ``pin``: a GPU worker's). A batch that cannot be
    decoded comes as a BadBatch (and the shard is not kept)."""

    def __init__(self, rows: RowRange | SplitRows, decoder: Decoder, batch_size: int, budget: Budget,
                 pin: bool = False):
        self.rows = rows
        self.pin = pin
        self.decode = decoder
        self.batch_size = batch_size
        self.budget = budget
        self.passes = 0
        self.cache: list | None = []
        self.held_bytes = 0
        self.use_cache = False
        self.slabs: dict | None = None
        self.by_bucket = None          # (whole batch, row order by bucket, sorted buckets)

    def _keep(self, batch):
        """A decoded batch as views of the shard's slabs (made at its first batch); its
        per-item records' items (``tasks.Recorded``) as they came."""
        x, y, buckets = batch
        if self.decode.task.uses_text:
            return (tasks.pin(x), y.pin_memory(), buckets.pin_memory()) if self.pin else batch
        if self.slabs is None:
            rows, inputs = self.rows.num_rows, tasks.inputs_of(x)
            self.slabs = {"y": Slab(rows, self.pin), "buckets": Slab(rows, self.pin),
                          "x": ({k: Slab(rows, self.pin) for k in inputs}
                                if isinstance(inputs, Mapping) else Slab(rows, self.pin))}
        slabs = self.slabs

        def keep(inputs):
            return ({k: slabs["x"][k].keep(v) for k, v in inputs.items()}
                    if isinstance(inputs, Mapping) else slabs["x"].keep(inputs))
        return tasks.map_inputs(x, keep), slabs["y"].keep(y), slabs["buckets"].keep(buckets)

    def __iter__(self):
        if self.use_cache:
            yield from self.cache
            return
        first = self.passes == 0
        self.passes += 1
        for table in self.rows.iter_batches(self.batch_size):
            if table.num_rows == 0:
                continue
            try:
                batch = self.decode(table)
            except RayevalError as e:
                self._drop()
                yield BadBatch(e, table.num_rows)
                continue
            except Exception as e:      # noqa: BLE001 - pyarrow or torch on the user's data
                self._drop()
                yield BadBatch(DataError(f"{self.decode.spec.key_path}: a batch could not be "
                                         f"read: {type(e).__name__}: {e}", traceback_of(e)),
                               table.num_rows)
                continue
            if first and self.cache is not None:
                size = tasks.nbytes(batch[0]) + batch[1].nbytes + batch[2].nbytes
                whole = size * self.rows.num_rows // max(1, len(batch[1]))
                if not self.cache and not self.decode.task.uses_text \
                        and whole > self.budget.left:
                    self._drop()                # the shard would not fit: keep none of it
                elif self.budget.take(size):
                    self.held_bytes += size
                    batch = self._keep(batch)
                    self.cache.append(batch)
                else:
                    self._drop()
            yield batch

    def within(self, lo: int, hi: int):
        """The held shard's rows of bootstrap buckets [lo, hi) as batches of ``batch_size``
        rows, in the shard's order, made as they are asked for, from an index of the kept
        rows by bucket made at the first call: a segment of a cell (``resume``), a race's
        round, costs its own rows, not a pass over the whole shard. None where the shard is
        not kept whole in its slabs (text tasks keep their batches as they come): the caller
        filters each batch.

        Before, each segment of a 359,401-row cell went over all of its ~1,400 kept batches,
        and that fixed cost, which grows with the machine's load, sized the segments to at
        least 49 times it (a kill then lost up to half the cell: issue 56)."""
        whole = self._by_bucket()
        if whole is None:
            return None
        x, y, buckets, order, ordered = whole
        start, stop = torch.searchsorted(ordered, torch.tensor([lo, hi],
                                                               dtype=ordered.dtype)).tolist()
        index = order[start:stop].sort().values
        rows = len(buckets)
        # one batch at a time: a range's rows are copies, never all at once
        return ((tasks.take(x, part, rows), y[part], buckets[part])
                for part in (index.split(self.batch_size) if len(index) else ()))

    def _by_bucket(self):
        if self.by_bucket is not None or not self.use_cache or not self.slabs or \
                not self.cache:
            return self.by_bucket
        rows = sum(len(b[1]) for b in self.cache)
        slabs = [self.slabs["y"], self.slabs["buckets"], *(
            self.slabs["x"].values() if isinstance(self.slabs["x"], Mapping)
            else [self.slabs["x"]])]
        if any(s.block is None or s.at != rows for s in slabs):
            return None                 # some batch kept as it came: not one block
        first = self.cache[0][0]

        def whole(inputs):
            return ({k: s.block[:rows] for k, s in self.slabs["x"].items()}
                    if isinstance(inputs, Mapping) else self.slabs["x"].block[:rows])
        x = tasks.map_inputs(first, whole)
        if isinstance(first, tasks.Recorded):
            x.items = {k: [v for b in self.cache for v in b[0].items[k]] for k in first.items}
        buckets = self.slabs["buckets"].block[:rows]
        order = torch.argsort(buckets, stable=True)
        self.by_bucket = (x, self.slabs["y"].block[:rows], buckets, order, buckets[order])
        return self.by_bucket

    def reset(self) -> None:
        """Forget the held shard: the next pass streams and decodes again."""
        self._drop()
        self.cache, self.passes, self.use_cache = [], 0, False

    def _drop(self) -> None:
        if self.cache is not None:
            self.budget.give(self.held_bytes)
        self.held_bytes = 0
        self.cache = None
        self.slabs = None
        self.by_bucket = None

    @property
    def overflowed(self) -> bool:
        return self.cache is None

    def agree(self, any_overflow: bool) -> None:
        """After the first pass: keep the cache only if every worker could keep its own."""
        if self.passes == 1 and not any_overflow and self.cache is not None:
            self.use_cache = True
        elif not self.use_cache and self.cache is not None:
            self._drop()
