"""The worker's cell scorer: one cell's pass over this worker's shard through the sweep's
backend, and the one all-reduce of its states. What becomes of the merged states is a sink's
(``sinks``: publish the cell, add a race's round, ...).

Each worker reads its own rows of every evaluation's data set: local parquet straight from
its files (``data.RowRange``: rank r of W takes rows [n*r/W, n*(r+1)/W), so every row is read
exactly once), any other source from its split of a Ray Data pipeline (``pipeline``). After a
first pass a worker keeps its decoded shard of an evaluation in memory when every worker's fits
(one memory budget shared by the evaluations, ``shards``); otherwise it streams it again. The
pass itself is ``core.evaluate.Pass``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rayeval import errors
from rayeval.core import tasks
from rayeval.core.backends.torch import float_dtype, move
from rayeval.core.evaluate import Decoder, Pass
from rayeval.core.judge import judged_metrics
from rayeval.core.metrics import build_all
from rayeval.errors import CheckpointError, RayevalError, traceback_of
from rayeval.execution.workers import dist
from rayeval.execution.workers.checkpoints import Stop
from rayeval.execution.pipeline import SplitRows
from rayeval.execution.workers.rank import RankContext
from rayeval.execution.workers.shards import BadBatch, Budget, Shard, cache_budget_bytes
from rayeval.io.data import RowRange
from rayeval.io.store import ResultStore
from rayeval.plan.cells import Cell, CellOutcome, Evaluation, Plan

_FAILED = "_failed"            # extra entries in the reduced vector: any rank failed the cell,
_CACHE_OVERFLOW = "_overflow"  # any rank's shard was too big to keep,
_STOP = "_stop"                # any rank was told to stop (the driver got SIGINT or SIGTERM),
_WALL = "_wall_us"             # the ranks' seconds in the pass, and in scoring (microseconds,
_BUSY = "_busy_us"             # summed): what a segment of a cell costs (``resume.Schedule``)
_FLAGS = (_FAILED, _CACHE_OVERFLOW, _STOP, _WALL, _BUSY)


@dataclass(frozen=True)
class Cost:
    """What the last pass cost, the same on every rank (from the reduced sums): seconds of a
    rank's pass and of its scoring (means over the ranks), the rows this rank scored, and
    whether the pass read the shard from its source while the next one reads the copy kept
    in memory (then what a pass costs beyond its rows is not known yet)."""
    wall: float = 0.0
    busy: float = 0.0
    rows: int = 0
    first_read: bool = False


class CellScorer:
    """Scores cells on one rank: its shard and metrics of each evaluation, the backend that
    answers the tasks' requests, the tokenizer of the checkpoint loaded, and where per-item
    records go."""

    def __init__(self, ctx: RankContext, plan: Plan, backend, lockstep=None,
                 ray_data: dict | None = None):
        self.ctx, self.plan, self.backend = ctx, plan, backend
        self.lockstep = lockstep       # a sharded model's replica: peers drained in step
        budget = Budget(cache_budget_bytes())
        replica, replicas = ctx.replica
        self.shards: dict[str, Shard] = {}
        self.metrics: dict[str, list] = {}
        for ev in plan.evaluations:
            if ev.name in (ray_data or {}):       # name -> this rank's split, or None
                rows = SplitRows(ev.name, ev.data, ctx.rank, ctx.world, ray_data[ev.name])
            else:
                start, stop = ev.data.shard_rows(replica, replicas)
                rows = RowRange(ev.data, ev.spec.dataset.columns, start, stop,
                                f"{ev.spec.dataset.key_path}.path",
                                positions=ev.row_positions)
            self.shards[ev.name] = Shard(rows, Decoder(ev.spec, ev.data, plan.sweep.base_dir),
                                         ev.spec.batch_size, budget,
                                         pin=ctx.device.type == "cuda")
            # a judged evaluation's pass generates: the judge's metric is the judge stage's
            self.metrics[ev.name] = build_all(judged_metrics(ev.spec.metrics)[0])
        self.uses_text = any(tasks.get(ev.spec.task).uses_text for ev in plan.evaluations)
        self.tokenizer = None
        # Per-item records: every rank writes its own items (never gathered), under the run's
        # tag, which the published cell names. A restarted group writes a cell's files again
        # under the same names (the world size does not change), and a cell is published only
        # after every rank has written: the set a reader takes is complete and the newest.
        self.samples_store = ResultStore(plan.sweep.output) if any(
            ev.spec.samples for ev in plan.evaluations) else None
        self.samples_tag = plan.run_id
        self.cost = Cost()             # of the last pass (``score``)

    def start(self, evaluations) -> None:
        """Start the pipelines of these evaluations (while the first checkpoint loads)."""
        for name in evaluations:
            rows = self.shards[name].rows
            if isinstance(rows, SplitRows):
                rows.start(self.plan.evaluation(name).spec.batch_size)

    def close(self) -> None:
        for shard in self.shards.values():
            if isinstance(shard.rows, SplitRows):
                shard.rows.close()

    def use_tokenizer(self, tokenizer) -> None:
        """Decode the text evaluations with this checkpoint's tokenizer; a shard kept from
        another tokenizer is decoded again (checkpoints that share one share the shard)."""
        self.tokenizer = tokenizer
        for ev in self.plan.evaluations:
            if tasks.get(ev.spec.task).uses_text:
                shard = self.shards[ev.name]
                if shard.decode.use(tokenizer):
                    shard.reset()

    def score(self, model, cell: Cell, step, index: int, within, records: str | None = None,
              done: int = 0) -> tuple[dict | None, CellOutcome | None]:
        """Pass and reduce one cell on every rank: (its merged states, None), or (None, its
        failed outcome on rank 0 / None on the others). ``index``: the cell's place in the
        ledger's progress; ``within``: only the rows of these bootstrap buckets [lo, hi)
        (a race's round, a segment of a cell, the rest of a partial cell), None: every row;
        ``records``: the tag this pass's per-item records are written under (None: none are
        kept); ``done``: the rows this rank counted before the pass, for the progress. What
        the pass cost is ``self.cost`` afterwards."""
        ctx = self.ctx
        ev = self.plan.evaluation(cell.evaluation)
        shard = self.shards[ev.name]
        streamed = not shard.use_cache        # read and decoded (not from the held shard)
        began = time.perf_counter()
        ctx.mark("pass", f"during the pass over {cell.checkpoint.location} on {ev.name}")
        with ctx.timer.span("pass", doing=first_rows(ev)):
            states, error, stopped, samples, busy, rows = self.one_pass(
                model, cell, ev, index, within, records is not None, done)
        wall = time.perf_counter() - began
        if streamed:
            ctx.timer.add("streamed", wall)
        if samples is not None and not error and not stopped:
            # before the reduce: once rank 0 publishes, every rank's records are in place
            with ctx.timer.span("publish"):
                error = self.write_samples(cell, ev, samples, records)
        if error:
            # before the reduce: rank 0 reads it
            ctx.ledger.cell_error(cell.key, error, ctx.details.get(cell.key))
        states[_FAILED] = torch.tensor(1 if error else 0, dtype=torch.int64)
        states[_CACHE_OVERFLOW] = torch.tensor(int(shard.overflowed), dtype=torch.int64)
        states[_STOP] = torch.tensor(int(stopped or ctx.ledger.stopping()), dtype=torch.int64)
        states[_WALL] = torch.tensor(int(wall * 1e6), dtype=torch.int64)
        states[_BUSY] = torch.tensor(int(busy * 1e6), dtype=torch.int64)
        where = f"the end of the pass over {cell.checkpoint.location} on {ev.name}"
        ctx.mark("reduce", f"during the all-reduce of the states of "
                           f"{cell.checkpoint.location} on {ev.name}")
        with ctx.timer.span("reduce", doing=f"waiting for every worker to finish {ev.name}"):
            dist.sync(where, ctx.timeout)
            merged = dist.all_reduce_states(states, where, ctx.timeout)   # the one reduce
        if merged[_STOP]:
            raise Stop
        shard.agree(bool(merged[_CACHE_OVERFLOW]))
        self.cost = Cost(wall=int(merged[_WALL]) / 1e6 / ctx.world,
                         busy=int(merged[_BUSY]) / 1e6 / ctx.world, rows=rows,
                         first_read=streamed and shard.use_cache)
        if not merged[_FAILED]:
            return {k: v for k, v in merged.items() if k not in _FLAGS}, None
        if ctx.rank != 0:
            return None, None
        if not error:      # another rank's: its message, and its traceback for --debug
            error, detail = ctx.ledger.error_of(cell.key)
            if detail and cell.key not in ctx.details:
                ctx.details[cell.key] = detail
        return None, ctx.failure(cell, step, error or (
            f"{cell.checkpoint.location}: evaluating {ev.name} failed on another worker; "
            "see the worker logs"))

    def one_pass(self, model, cell: Cell, ev: Evaluation, index: int, within,
                 records: bool = False, done: int = 0):
        """This worker's states for one cell, the error that stopped it (the pass still drains
        the shard: every rank must finish every pass over its split), whether the driver
        asked to stop (then the pass ends at once: the group is winding down), its per-item
        records (``records``), its seconds in scoring and the rows it scored. What the task
        runs beside the model for the pass (``Task.pass_service``) is started before it (a
        failure fails the cell) and closed after it."""
        service = tasks.get(ev.spec.task).pass_service(ev.spec, self.ctx.device,
                                                       self.backend.setup.model)
        if service is None:
            return self._pass(model, cell, ev, index, within, records, done)
        try:
            return self._pass(model, cell, ev, index, within, records, done,
                              self.scored(service.start, (), cell, ev))
        finally:
            service.close()

    def _pass(self, model, cell: Cell, ev: Evaluation, index: int, within, records: bool,
              done: int, error: str | None = None):
        ctx = self.ctx
        skipped = 0                 # rows of batches that could not be decoded
        busy = 0.0                  # seconds in scoring steps
        model_spec = self.backend.setup.model           # the sweep's model section
        p = Pass(self.backend, self.metrics[ev.name], ev.output_size, ctx.device,
                 ev.spec.task, ev.spec.bootstrap.k, ev.spec.dataset, text=self.tokenizer,
                 generation=ev.spec.generation, batch=ev.spec.batch_size,
                 samples=ev.spec.samples and ctx.rank % ctx.tensor == 0 and records,
                 share=model_spec.share_prefixes, tokens=model_spec.batch_tokens,
                 # progress counts rows as they are scored, not as they are read
                 on_rows=lambda n: ctx.ledger.rows(index, ctx.counted(done + skipped + n)))
        rows, stopped = 0, False
        task = tasks.get(ev.spec.task)
        shard = self.shards[ev.name]
        # A segment's or a round's rows: from the held shard's index by bucket where it has
        # one (only those rows, in full batches), else filtered from each batch and those of
        # several batches scored together, full batches as without ``within`` (a task that
        # holds rows, a text task, does so itself).
        indexed = None if within is None else shard.within(*within)
        gather = Gather(task, ev.spec.batch_size) if within is not None and \
            indexed is None and not task.held_rows(ev.spec.dataset) else None
        for batch in self.waited(shard, ev, indexed):
            if ctx.ledger.stopping():
                stopped = True
                break
            if isinstance(batch, BadBatch):
                if not error:
                    error = f"{ev.name}: {batch.error.message}"
                    ctx.details[cell.key] = batch.error.detail
                rows += batch.rows
                skipped += batch.rows
                continue
            x, y, buckets = batch
            if error:
                continue
            rows += len(buckets)
            if within is not None and indexed is None:    # a round's, a segment's rows
                x, y, buckets = _within(x, y, buckets, *within)
                if not len(buckets):
                    continue
            for part in (gather.add(x, y, buckets) if gather else ((x, y, buckets),)):
                began = time.perf_counter()
                error = error or self.scored(p.update, part, cell, ev)
                busy += time.perf_counter() - began
        if not error and not stopped:
            began = time.perf_counter()
            for part in (gather.rest() if gather else ()):
                error = error or self.scored(p.update, part, cell, ev)
            error = error or self.scored(p.finish, (), cell, ev)
            busy += time.perf_counter() - began
        if within is not None:              # the rows of its buckets, not every row read
            rows = skipped + p.scored_rows
        ctx.ledger.rows(index, ctx.counted(done + rows), force=True)
        if self.lockstep is not None:        # peers of this replica may still have rows
            idle = tasks.get(ev.spec.task).idle_input(ev.spec.dataset, ev.data.shapes)
            self.lockstep.drain(model, None if idle is None else
                                move(idle, ctx.device, float_dtype(model)))
        samples = None if error or stopped else p.sample_table()
        states = dict(p.abandon() if error else p.states)
        if ctx.rank % ctx.tensor:         # its engine's first rank counts these rows
            states = {k: torch.zeros_like(v) for k, v in states.items()}
        return states, error, stopped, samples, busy, rows

    def waited(self, shard, ev: Evaluation, batches=None):
        """The shard's batches (or ``batches`` taken from it), timing how long each took to
        arrive: the first batch apart (a pipeline's start, the first decoding), then every
        later one ("later batches": data that was not ready when the scorer asked, the
        decoding or reading not hidden behind scoring)."""
        batches, phase = iter(shard if batches is None else batches), "first batch"
        while True:
            began = time.perf_counter()
            batch = next(batches, _END)
            if batch is _END:
                return
            waited = time.perf_counter() - began
            self.ctx.timer.add(phase, waited)
            if phase == "first batch":
                self.ctx.timer.doing(f"scoring {ev.name}")
                if isinstance(shard.rows, SplitRows):
                    self.ctx.timer.add("ray data", waited)
                phase = "later batches"
            yield batch

    def write_samples(self, cell: Cell, ev: Evaluation, table, tag: str) -> str | None:
        """This rank's per-item records of a cell (of a pass: a segment's under its own
        tag); the message that fails the cell when they cannot be written."""
        try:
            # one file per replica: an engine's ranks share their items (its first writes)
            self.samples_store.write_samples(cell.key, tag, *self.ctx.replica, table)
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
            self.ctx.details[cell.key] = e.detail
            return f"{ev.name}: {e.message}"
        except Exception as e:               # noqa: BLE001 - the user's model on these rows
            self.ctx.details[cell.key] = traceback_of(e)
            return (f"{cell.checkpoint.location}: {ev.name}: the model failed on a batch: "
                    f"{errors.reason(e, typed=True)}")
        return None

_END = object()


class Gather:
    """Rows taken from several batches, given back as batches of ``size`` rows (or as they
    came, for inputs that neither ``tasks.concat`` nor the task can join)."""

    def __init__(self, task, size: int):
        self.task, self.size = task, size
        self.parts: list = []
        self.rows = 0

    def add(self, x, y, buckets) -> list:
        self.parts.append((x, y, buckets))
        self.rows += len(buckets)
        return self.rest() if self.rows >= self.size else []

    def rest(self) -> list:
        parts, self.parts, self.rows = self.parts, [], 0
        if len(parts) <= 1:
            return parts
        xs = [p[0] for p in parts]
        x = tasks.concat(xs)
        if x is None:
            try:
                x = self.task.join(xs)
            except NotImplementedError:
                return parts
        return [(x, torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts]))]


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
