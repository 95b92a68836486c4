"""One cell on one worker: a pass over the worker's shard through the sweep's backend, the
one all-reduce of its states, and (rank 0) the check of its row count and its publication.

``CellPasses`` is the per-cell half of ``worker.Worker`` (which loads the checkpoints, holds
the shards and the backend, and mixes this in); the pass itself is ``core.evaluate.Pass``.
"""

from __future__ import annotations

import time

import ray.train
import torch

from rayeval import errors
from rayeval.core import tasks
from rayeval.core.backends.torch import float_dtype, move
from rayeval.core.evaluate import ROWS, Pass, finalize
from rayeval.errors import CheckpointError, RayevalError, traceback_of
from rayeval.execution import dist, recovery
from rayeval.execution.pipeline import SplitRows
from rayeval.execution.race import PARTIAL
from rayeval.execution.shards import BadBatch
from rayeval.io import store_states
from rayeval.io.store import cell_rows
from rayeval.plan.cells import Cell, CellOutcome, Evaluation

_FAILED = "_failed"            # extra entries in the reduced vector: any rank failed the cell,
_CACHE_OVERFLOW = "_overflow"  # any rank's shard was too big to keep,
_STOP = "_stop"                # any rank was told to stop (the driver got SIGINT or SIGTERM)


class Stop(Exception):
    """Every rank agreed to stop: the run was interrupted; finished cells are published."""


class CellPasses:
    """Pass, reduce and publish one cell (mixed into ``worker.Worker``: it reads the worker's
    plan, shards, metrics, backend, ledger, store and timer)."""

    def mark(self, phase: str, where: str) -> None:
        """Tell the ledger where this rank is (an error after its loss says it), then the
        test hook's fault point (``recovery.fault_point``), which waits for that word."""
        said = self.ledger.phase(where)
        recovery.fault_point(phase, self.rank, self.ledger.attempt,
                             before=lambda: said is not None and ray.get(said, timeout=10))

    def evaluate_cell(self, model, cell: Cell, step, layout, start: float
                      ) -> CellOutcome | None:
        """Pass, reduce and publish one cell; rank 0 returns its outcome."""
        ev = self.plan.evaluation(cell.evaluation)
        shard = self.shards[ev.name]
        streamed = not shard.use_cache        # read and decoded (not from the kept shard)
        began = time.perf_counter()
        self.mark("pass", f"during the pass over {cell.checkpoint.location} on {ev.name}")
        with self.timer.span("pass", doing=first_rows(ev)):
            states, error, stopped, samples = self.one_pass(model, cell, ev)
        if streamed:
            self.timer.add("streamed", time.perf_counter() - began)
        if samples is not None and not error and not stopped:
            # before the reduce: once rank 0 publishes, every rank's records are in place
            with self.timer.span("publish"):
                error = self.write_samples(cell, ev, samples)
        if error:
            # before the reduce: rank 0 reads it
            self.ledger.cell_error(cell.key, error, self.details.get(cell.key))
        states[_FAILED] = torch.tensor(1 if error else 0, dtype=torch.int64)
        states[_CACHE_OVERFLOW] = torch.tensor(int(shard.overflowed), dtype=torch.int64)
        states[_STOP] = torch.tensor(int(stopped or self.ledger.stopping()), dtype=torch.int64)
        where = f"the end of the pass over {cell.checkpoint.location} on {ev.name}"
        self.mark("reduce", f"during the all-reduce of the states of "
                            f"{cell.checkpoint.location} on {ev.name}")
        with self.timer.span("reduce", doing=f"waiting for every worker to finish {ev.name}"):
            dist.sync(where, self.timeout)
            merged = dist.all_reduce_states(states, where, self.timeout)   # the one reduce
        if merged[_STOP]:
            raise Stop
        shard.agree(bool(merged[_CACHE_OVERFLOW]))
        if merged[_FAILED]:
            if self.rank != 0:
                return None
            if not error:      # another rank's: its message, and its traceback for --debug
                error, detail = self.ledger.error_of(cell.key)
                if detail and cell.key not in self.details:
                    self.details[cell.key] = detail
            return self.failure(cell, step, error or (
                f"{cell.checkpoint.location}: evaluating {ev.name} failed on another worker; "
                "see the worker logs"))
        if self.racing is not None:       # every rank adds the round's states (execution.race)
            self.racing.add(cell, {k: v for k, v in merged.items()
                                   if k not in (_FAILED, _CACHE_OVERFLOW, _STOP)},
                            step, layout, time.perf_counter() - start)
            return None
        if self.rank != 0:
            return None
        self.mark("publish", f"while publishing {cell.checkpoint.location} on {ev.name}")
        with self.timer.span("publish", doing=f"publishing {ev.name}"):
            return self.publish(cell, ev, merged, step, layout, start)

    def one_pass(self, model, cell: Cell, ev: Evaluation):
        """This worker's states for one cell, the error that stopped it (the pass still drains
        the shard: every rank must finish every pass over its split), and whether the driver
        asked to stop (then the pass ends at once: the group is winding down)."""
        index = self.index_of[cell.key]
        skipped = 0                 # rows of batches that could not be decoded
        model_spec = self.backend.setup.model           # the sweep's model section
        within = self.racing.buckets(ev.name) if self.racing is not None else \
            (cell.resume, ev.spec.bootstrap.k) if cell.resume else None
        p = Pass(self.backend, self.metrics[ev.name], ev.output_size, self.device,
                 ev.spec.task, ev.spec.bootstrap.k, ev.spec.dataset, text=self.tokenizer,
                 generation=ev.spec.generation, batch=ev.spec.batch_size,
                 samples=ev.spec.samples and self.rank % self.tensor == 0 and within is None,
                 share=model_spec.share_prefixes, tokens=model_spec.batch_tokens,
                 # progress counts rows as they are scored, not as they are read
                 on_rows=lambda n: self.ledger.rows(index, self.counted(skipped + n)))
        rows, error, stopped = 0, None, False
        for batch in self.waited(self.shards[ev.name], ev):
            if self.ledger.stopping():
                stopped = True
                break
            if isinstance(batch, BadBatch):
                if not error:
                    error = f"{ev.name}: {batch.error.message}"
                    self.details[cell.key] = batch.error.detail
                rows += batch.rows
                skipped += batch.rows
                continue
            x, y, buckets = batch
            if error:
                continue
            rows += len(buckets)
            if within is not None:        # a race's round: the rows of its buckets only
                x, y, buckets = _within(x, y, buckets, *within)
                if not len(buckets):
                    continue
            error = self.scored(p.update, (x, y, buckets), cell, ev)
        if not error and not stopped:
            error = self.scored(p.finish, (), cell, ev)
        self.ledger.rows(index, self.counted(rows), force=True)
        if self.lockstep is not None:        # peers of this replica may still have rows
            idle = tasks.get(ev.spec.task).idle_input(ev.spec.dataset, ev.data.shapes)
            self.lockstep.drain(model, None if idle is None else
                                move(idle, self.device, float_dtype(model)))
        samples = None if error or stopped else p.sample_table()
        states = dict(p.abandon() if error else p.states)
        if self.rank % self.tensor:       # its engine's first rank counts these rows
            states = {k: torch.zeros_like(v) for k, v in states.items()}
        return states, error, stopped, samples

    def waited(self, shard, ev: Evaluation):
        """The shard's batches, timing how long each took to arrive: the first batch apart
        (a pipeline's start, the first decoding), then every later one ("later batches": data
        that was not ready when the scorer asked, the decoding or reading not hidden behind
        scoring)."""
        batches, phase = iter(shard), "first batch"
        while True:
            began = time.perf_counter()
            batch = next(batches, _END)
            if batch is _END:
                return
            waited = time.perf_counter() - began
            self.timer.add(phase, waited)
            if phase == "first batch":
                self.timer.doing(f"scoring {ev.name}")
                if isinstance(shard.rows, SplitRows):
                    self.timer.add("ray data", waited)
                phase = "later batches"
            yield batch

    def counted(self, rows: int) -> int:
        """Rows this rank reports: an engine's other ranks see its first rank's rows."""
        return 0 if self.rank % self.tensor else rows

    def write_samples(self, cell: Cell, ev: Evaluation, table) -> str | None:
        """This rank's per-item records of a cell; the message that fails the cell when
        they cannot be written."""
        try:
            # one file per replica: an engine's ranks share their items (its first writes)
            self.samples_store.write_samples(cell.key, self.samples_tag,
                                             self.rank // self.tensor,
                                             self.world // self.tensor, table)
        except RayevalError as e:
            return f"{ev.name}: per-item records: {e.message}"
        return None

    def scored(self, step, args, cell: Cell, ev: Evaluation) -> str | None:
        """Run one scoring step of a pass; the message of the error that fails the cell (with
        the user's traceback kept for --debug), or None."""
        try:
            step(*args)
        except CheckpointError as e:
            return f"{cell.checkpoint.location}: {ev.name}: {e.message}"
        except RayevalError as e:            # bad data in this evaluation: its cells only
            self.details[cell.key] = e.detail
            return f"{ev.name}: {e.message}"
        except Exception as e:               # noqa: BLE001 - the user's model on these rows
            self.details[cell.key] = traceback_of(e)
            return (f"{cell.checkpoint.location}: {ev.name}: the model failed on a batch: "
                    f"{errors.reason(e, typed=True)}")
        return None

    def publish(self, cell: Cell, ev: Evaluation, merged, step, layout, start,
                partial=None) -> CellOutcome:
        """Write a cell's rows; ``partial`` (``race.Stopped``): a raced checkpoint's cell
        with some of its items, under its own key."""
        resumed = 0
        if cell.resume and self.racing is None:      # a partial cell's rows, kept
            stored, _, _ = store_states.read(self.store, cell.key)
            merged = {k: v + torch.from_numpy(stored[k]).to(v.dtype) if k in stored else v
                      for k, v in merged.items()}
            resumed = int(stored[ROWS])
        counted = int(merged[ROWS])
        expected = ev.data.num_rows if partial is None else partial.items
        if counted != expected:
            return self.failure(cell, step, f"{cell.checkpoint.location}: {ev.name}: counted "
                                            f"{counted} rows but the data set has "
                                            f"{expected}; not published (a sharding "
                                            "bug: please report it)")
        metrics = self.metrics[ev.name]
        try:
            results = finalize(metrics, merged, ev.output_size, ev.spec.bootstrap)
        except RayevalError as e:          # a custom metric's compute: this cell only
            self.details[cell.key] = e.detail
            return self.failure(cell, step, f"{ev.name}: {e.message}")
        key = cell.key if partial is None else cell.key + PARTIAL
        if partial is not None:           # so that a later run completes it (io.store_states)
            store_states.write(self.store, cell.key,
                               {k: v.numpy() for k, v in merged.items()}, partial.below,
                               ev.spec.bootstrap.k)
        self.store.write_cell(key, cell_rows(
            sweep=self.plan.sweep.name, checkpoint=cell.checkpoint.location, step=step,
            epoch=cell.checkpoint.epoch, evaluation=ev.name, results=results,
            higher_is_better={k: bool(getattr(m, "higher_is_better", True)) for k, m in metrics},
            num_samples=counted, num_tokens=tasks.get(ev.spec.task).scored_units(merged),
            world_size=self.world, bootstrap_key=ev.spec.bootstrap.key,
            samples=self.samples_tag if ev.spec.samples and self.racing is None
            and not cell.resume else None,
            items_total=None if partial is None else partial.total,
            stopped=None if partial is None else str(partial)))
        return CellOutcome(
            key=cell.key, checkpoint=cell.checkpoint.location, evaluation=ev.name, step=step,
            values=tuple((k, r.value) for k, r in results.items()), rows=counted,
            items_total=None if partial is None else partial.total,
            stopped=None if partial is None else str(partial), resumed=resumed,
            seconds=time.perf_counter() - start, layout=layout, attempt=self.attempt,
            peak_rss_bytes=peak_rss(), baseline_rss_bytes=self.baseline,
            loaded_rss_bytes=self.loaded_rss)

    def failure(self, cell: Cell, step, message: str) -> CellOutcome:
        return CellOutcome(key=cell.key, checkpoint=cell.checkpoint.location,
                           evaluation=cell.evaluation, step=step, error=message,
                           detail=self.details.get(cell.key), attempt=self.attempt)

    def finish(self, outcome: CellOutcome) -> None:
        self.outcomes.append(outcome)
        if self.rank == 0:
            self.ledger.finish(outcome.key, outcome)


_END = object()


def _within(x, y, buckets, lo: int, hi: int):
    """The rows of a batch whose bootstrap bucket lies in [lo, hi)."""
    index = ((buckets >= lo) & (buckets < hi)).nonzero().view(-1)
    if len(index) == len(buckets):
        return x, y, buckets
    return tasks.take(x, index, len(buckets)), y[index], buckets[index]


def first_rows(ev: Evaluation) -> str:
    """What a pass waits on before its first batch, in words: its rows read and decoded
    (images decoded on a CPU stage, for an evaluation with an ``images`` column)."""
    if getattr(ev.spec.dataset, "images", None):
        return f"decoding the images of {ev.name}"
    return f"reading the rows of {ev.name}"


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
