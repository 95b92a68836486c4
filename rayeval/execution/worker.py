"""The Ray Train worker: every pending cell of a plan, checkpoint by checkpoint.

Each checkpoint is loaded ONCE per worker and evaluated on every evaluation that still needs it
before the next load. Its steps:

    load and agree    any rank's load failure fails all of the checkpoint's cells, on every rank
    pass              per evaluation, one pass over this worker's shard adding into metric states
    reduce            ONE all-reduce of the states per cell (no collective per batch)
    publish           rank 0 checks the row count against the data set and writes the cell

Each worker reads its own rows of every evaluation's data set: local parquet straight from
its files (``data.RowRange``: rank r of W takes rows [n*r/W, n*(r+1)/W), so every row is read
exactly once), any other source from its split of a Ray Data pipeline (``pipeline``). After a first pass a worker keeps its decoded shard of an evaluation in memory when every
worker's fits (one memory budget shared by the evaluations); otherwise it streams it again.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping
from typing import NamedTuple

import ray.train
import ray.train.torch
import torch

from rayeval import errors
from rayeval.config import constants
from rayeval.config.plugins import load_plugins
from rayeval.execution import dist, recovery
from rayeval.execution.pipeline import SplitRows
from rayeval.io import layouts
from rayeval.core import tasks
from rayeval.harness import store as lm_eval_store
from rayeval.harness.task import lm_task
from rayeval.io.checkpoints import fetch
from rayeval.io.engine import Engine
from rayeval.io.data import RowRange
from rayeval.errors import (CheckpointError, DataError, GroupError, ModelError, RayevalError,
                            RunError, SpecError, traceback_of)
from rayeval.core.evaluate import ROWS, Decoder, Pass, finalize, float_dtype
from rayeval.core.metrics import build_all
from rayeval.io.model import ModelSource
from rayeval.plan.cells import Cell, CellOutcome, Evaluation, Plan
from rayeval.execution.profile import Timer
from rayeval.execution.coordinator import WorkerProgress
from rayeval.io.store import ResultStore, cell_rows

_FAILED = "_failed"            # extra entries in the reduced vector: any rank failed the cell,
_CACHE_OVERFLOW = "_overflow"  # any rank's shard was too big to keep,
_STOP = "_stop"                # any rank was told to stop (the driver got SIGINT or SIGTERM)


STANDING_POLL_S = 2.0      # a standing group's rank 0 asks for cells this long before it says
                           # "none yet" to the others


class Stop(Exception):
    """Every rank agreed to stop: the run was interrupted; finished cells are published."""


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
        self.kept = 0
        self.use_cache = False
        self.slabs: dict | None = None

    def _keep(self, batch):
        """A decoded batch as views of the shard's slabs (made at its first batch)."""
        x, y, buckets = batch
        if self.decode.task.uses_text:
            return (tasks.pin(x), y.pin_memory(), buckets.pin_memory()) if self.pin else batch
        if self.slabs is None:
            rows = self.rows.num_rows
            self.slabs = {"y": Slab(rows, self.pin), "buckets": Slab(rows, self.pin),
                          "x": ({k: Slab(rows, self.pin) for k in x} if isinstance(x, Mapping)
                                else Slab(rows, self.pin))}
        slabs = self.slabs
        x = ({k: slabs["x"][k].keep(v) for k, v in x.items()} if isinstance(x, Mapping)
             else slabs["x"].keep(x))
        return x, slabs["y"].keep(y), slabs["buckets"].keep(buckets)

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
                    self.kept += size
                    batch = self._keep(batch)
                    self.cache.append(batch)
                else:
                    self._drop()
            yield batch

    def reset(self) -> None:
        """Forget the kept shard: the next pass streams and decodes again."""
        self._drop()
        self.cache, self.passes, self.use_cache = [], 0, False

    def _drop(self) -> None:
        if self.cache is not None:
            self.budget.give(self.kept)
        self.kept = 0
        self.cache = None
        self.slabs = None

    @property
    def overflowed(self) -> bool:
        return self.cache is None

    def agree(self, any_overflow: bool) -> None:
        """After the first pass: keep the cache only if every worker could keep its own."""
        if self.passes == 1 and not any_overflow and self.cache is not None:
            self.use_cache = True
        elif not self.use_cache and self.cache is not None:
            self._drop()


def train_loop(config: dict) -> list[CellOutcome]:
    """The train_loop_per_worker of the evaluation TorchTrainer; rank 0 returns the outcomes.

    A restarted group (a worker died or stalled) asks the tracker which cells are finished and
    goes on from the first unfinished one; a cell's rows are counted only in the pass that
    publishes it, so nothing is counted twice."""
    entered = time.time()
    plan: Plan = config["plan"]
    lm_eval_store.receive(config.get("lm_eval"))     # the driver's lm-eval tasks, through Ray
    rank = ray.train.get_context().get_world_rank()
    progress = WorkerProgress(config.get("tracker"), rank)
    attempt, done, fatal = progress.start()
    if fatal is not None:
        return []          # an earlier attempt met bad input: a restart would meet it again
    try:
        load_plugins()         # this process resolves the plan's names too; a failure is fatal
        timer = Timer()
        with timer.span("setup"):
            worker = Worker(plan, progress, attempt, timer, config.get("ray_data", ()))
        if config.get("standing"):
            outcomes = worker.stand()
        else:
            outcomes = worker.run([c for c in plan.cells if c.key not in done])
        progress.timing(entered, time.time(), timer.as_dict())
        return outcomes
    except GroupError as e:
        progress.problem(e.message)
        raise
    except RayevalError as e:
        progress.fatal(e)
        raise
    except Exception as e:
        progress.problem(errors.reason(e, typed=True))
        raise


def generation_only(plan: Plan) -> bool:
    """Whether every evaluation of the plan only generates (nothing runs the model's own
    forward): native generation tasks and lm-eval generate_until tasks."""
    for ev in plan.evaluations:
        if ev.spec.lm_eval is not None:
            if lm_task(ev.spec.dataset.path).OUTPUT_TYPE != "generate_until":
                return False
        elif not tasks.get(ev.spec.task).generates:
            return False
    return True


class Worker:
    """One rank's state for a run: the model loader, the shards, the store (rank 0)."""

    def __init__(self, plan: Plan, progress: WorkerProgress, attempt: int,
                 timer: Timer | None = None, ray_data=()):
        sweep = plan.sweep
        self.timer = timer or Timer()
        ctx = ray.train.get_context()
        self.plan = plan
        self.progress = progress
        self.attempt = attempt
        self.rank = ctx.get_world_rank()
        self.world = ctx.get_world_size()
        self.timeout = sweep.recovery.stall_timeout_s
        self.device = ray.train.torch.get_device()
        self.baseline = peak_rss()
        self.loaded_rss = 0
        self.source = ModelSource(sweep.model, sweep.base_dir)
        # Backend vllm with generation only: the engine holds the weights on the GPU, so
        # rayeval's copy of each checkpoint (what the engine is given) stays on the CPU.
        staged = torch.device("cpu") if sweep.model.backend == "vllm" and \
            self.device.type != "cpu" and generation_only(plan) else self.device
        self.loader = self.source.loader(staged, sweep.checkpoint)
        self.lockstep = None           # a sharded model's replica runs its forwards in step
        if sweep.parallelism.sharded:
            from rayeval.execution.sharding import Lockstep, ShardedLoader, give_back_gathered_memory

            give_back_gathered_memory()
            mesh = dist.replica_mesh(sweep.parallelism.shard)
            self.loader = ShardedLoader(self.loader, mesh, sweep.parallelism)
            self.lockstep = Lockstep(mesh, self.timeout)
        # Backend vllm: one engine for the whole sweep; ``tensor`` consecutive ranks serve
        # one engine, see the same rows, and only the first of them counts them.
        self.engine = Engine(sweep.model, sweep.parallelism.tensor, self.device,
                             f"{plan.run_id}-{attempt}",
                             {"RANK": self.rank, "LOCAL_RANK": ctx.get_local_rank(),
                              "WORLD_SIZE": self.world,
                              "LOCAL_WORLD_SIZE": ctx.get_local_world_size()}) \
            if sweep.model.backend == "vllm" else None
        self.tensor = sweep.parallelism.tensor
        replica, replicas = self.rank // self.tensor, self.world // self.tensor
        self.uses_text = any(tasks.get(ev.spec.task).uses_text for ev in plan.evaluations)
        budget = Budget(cache_budget_bytes())
        self.shards = {}
        self.metrics = {}
        for ev in plan.evaluations:
            if ev.name in ray_data:
                rows = SplitRows(ev.name, ev.data, self.rank, self.world)
            else:
                start, stop = ev.data.shard_rows(replica, replicas)
                rows = RowRange(ev.data, ev.spec.dataset.columns, start, stop,
                                f"{ev.spec.dataset.key_path}.path")
            self.shards[ev.name] = Shard(rows, Decoder(ev.spec, ev.data, sweep.base_dir),
                                         ev.spec.batch_size, budget,
                                         pin=self.device.type == "cuda")
            self.metrics[ev.name] = build_all(ev.spec.metrics)
        self.store = ResultStore(sweep.output) if self.rank == 0 else None
        # Per-item records: every rank writes its own items (never gathered), under the run's
        # tag, which the published cell names. A restarted group writes a cell's files again
        # under the same names (the world size does not change), and a cell is published only
        # after every rank has written: the set a reader takes is complete and the newest.
        self.samples_store = ResultStore(sweep.output) if any(
            ev.spec.samples for ev in plan.evaluations) else None
        self.samples_tag = plan.run_id
        self.cache_dir = os.path.join(tempfile.gettempdir(), "rayeval-checkpoints")
        # A sharded model reads its slices when it loads (collectively): only fetch ahead.
        self.ahead = Prefetch(self.cache_dir, None if self.lockstep else (
            lambda path: layouts.read(path, sweep.checkpoint.trust_pickle)),
            cache_budget_bytes(), enabled=constants.prefetch_enabled())
        self.index_of = {c.key: i for i, c in enumerate(plan.cells)}
        self.tokenizer = None
        self.outcomes: list[CellOutcome] = []
        self.details: dict[str, str | None] = {}     # cell key -> this rank's user traceback

    def run(self, cells: list[Cell]) -> list[CellOutcome]:
        most, neg_least = dist.all_reduce_max([len(cells), -len(cells)], "the start",
                                              self.timeout)
        if most != -neg_least:
            raise RunError(f"workers disagree on the cells left ({int(-neg_least)} to "
                           f"{int(most)}); please report this bug")
        todo = {c.key for c in cells}
        for name in {c.evaluation for c in cells}:     # pipelines start while the first
            rows = self.shards[name].rows              # checkpoint loads
            if isinstance(rows, SplitRows):
                rows.start(self.plan.evaluation(name).spec.batch_size)
        try:
            self.run_checkpoints(todo)
        except Stop:
            pass
        finally:
            self.ahead.close()
            for shard in self.shards.values():
                if isinstance(shard.rows, SplitRows):
                    shard.rows.close()
        return self.outcomes

    def stand(self) -> list[CellOutcome]:
        """A standing group (``rayeval watch``): evaluate the cells the driver feeds through
        the tracker as they come, until it closes the feed or asks to stop. Rank 0 takes
        them and every rank gets the same batch; while none comes, rank 0 says so every few
        seconds, so a long wait is never taken for a stall."""
        try:
            return self._stand()
        finally:
            self.ahead.close()

    def _stand(self) -> list[CellOutcome]:
        import dataclasses
        import pickle

        base = self.plan
        wait = min(STANDING_POLL_S, self.timeout / 4)
        while True:
            batch = []
            if self.rank == 0:
                deadline = time.monotonic() + wait
                while True:
                    batch = self.progress.take()
                    if batch is None or batch or time.monotonic() >= deadline:
                        break
                    time.sleep(0.1)
            batch = dist.broadcast(batch, "the wait for checkpoints", self.timeout)
            if batch is None:
                return self.outcomes
            if not batch:
                continue
            cells = [(i, pickle.loads(blob)) for i, blob in batch]
            self.plan = dataclasses.replace(base, cells=tuple(c for _, c in cells))
            self.index_of = {c.key: i for i, c in cells}
            try:
                self.run_checkpoints({c.key for _, c in cells})
            except Stop:
                return self.outcomes

    def run_checkpoints(self, todo: set[str]) -> None:
        pending = [(ref, fingerprint, [c for c in group if c.key in todo])
                   for ref, fingerprint, group in self.plan.by_checkpoint()]
        pending = [p for p in pending if p[2]]
        for i, (ref, fingerprint, group) in enumerate(pending):
            start = time.perf_counter()
            self.progress.rows(self.index_of[group[0].key], 0, force=True)
            self.mark("load", f"while loading {ref.location}")
            with self.timer.span("load"):
                model, raw, error = self.load_and_agree(ref, fingerprint)
            if i + 1 < len(pending):      # the next one comes in while this one runs
                self.ahead.start(pending[i + 1][0].location, pending[i + 1][1])
            if model is None:
                for cell in group:
                    self.finish(self.failure(cell, ref.step, error))
                continue
            step = raw.step if raw.step is not None else ref.step   # Lightning's global_step
            for cell in group:
                outcome = self.evaluate_cell(model, cell, step, raw.layout, start)
                if outcome is not None:
                    self.finish(outcome)
                start = time.perf_counter()
            del model            # freed before the next load

    def load_and_agree(self, ref, fingerprint: str):
        """(model, raw, None) on every rank, or (None, None, why) on every rank when any
        rank failed to load the checkpoint. A sharded model is loaded in two steps, agreed on
        after each: its fit checked from the checkpoint's headers, then its rows read (DCP's
        load is collective: no rank may enter it alone)."""
        where = f"the load of {ref.location}"
        loaded = folder = None

        def stage():
            nonlocal loaded, folder
            local, raw = self.ahead.take(ref.location)
            if local is None:
                local = fetch(ref.location, self.cache_dir, fingerprint)
            folder = local
            loaded = self.loader.stage(local) if self.lockstep else \
                self.loader.load(local, raw)
            if self.uses_text:
                model = loaded.model if self.lockstep else loaded[0]
                self.use_tokenizer(self.source.tokenizer(local, model))

        why = self.agree(ref.location, stage, where)
        if why is None and self.lockstep is not None:
            staged = loaded

            def shard():
                nonlocal loaded
                loaded = self.loader.load(staged)
                self.lockstep.attach(loaded[0])

            why = self.agree(ref.location, shard, f"the sharded load of {ref.location}")
        if why is None and self.engine is not None:
            # after every rank has loaded: the engine's start is collective
            why = self.agree(ref.location, lambda: self.engine.serve(
                loaded[0], folder, self.source.spec.tokenizer, ref.location, self.timer),
                f"the vLLM load of {ref.location}")
        if why is not None:
            return None, None, why
        self.progress.loaded(ref.location)
        self.loaded_rss = peak_rss()
        return loaded[0], loaded[1], None

    def mark(self, phase: str, where: str) -> None:
        """Tell the tracker where this rank is (an error after its loss says it), then the
        test hook's fault point (``recovery.fault_point``), which waits for that word."""
        said = self.progress.phase(where)
        recovery.fault_point(phase, self.rank, self.progress.attempt,
                             before=lambda: said is not None and ray.get(said, timeout=10))

    def agree(self, location: str, step, where: str) -> str | None:
        """Run one loading step on every rank; why it failed (on any rank), or None."""
        error = None
        try:
            step()
        except (CheckpointError, SpecError, ModelError) as e:
            error = e.message
            self.progress.cell_error(location, error)   # before the reduce: rank 0 reads it
        dist.sync(where, self.timeout)
        any_failed, stop = dist.all_reduce_max([1.0 if error else 0.0,
                                                1.0 if self.progress.stopping() else 0.0],
                                               where, self.timeout)
        if stop:
            raise Stop
        if any_failed:
            return error or self.progress.error_of(location)[0] or (
                f"{location}: could not be loaded on another worker; see the worker logs")
        return None

    def use_tokenizer(self, tokenizer) -> None:
        """Decode the text evaluations with this checkpoint's tokenizer; a shard kept from
        another tokenizer is decoded again (checkpoints that share one share the shard)."""
        self.tokenizer = tokenizer
        for ev in self.plan.evaluations:
            if tasks.get(ev.spec.task).uses_text:
                shard = self.shards[ev.name]
                if shard.decode.use(tokenizer):
                    shard.reset()

    def evaluate_cell(self, model, cell: Cell, step, layout, start: float
                      ) -> CellOutcome | None:
        """Pass, reduce and publish one cell; rank 0 returns its outcome."""
        ev = self.plan.evaluation(cell.evaluation)
        shard = self.shards[ev.name]
        streamed = not shard.use_cache        # read and decoded (not from the kept shard)
        began = time.perf_counter()
        self.mark("pass", f"during the pass over {cell.checkpoint.location} on {ev.name}")
        with self.timer.span("pass"):
            states, error, stopped, samples = self.one_pass(model, cell, ev)
        if streamed:
            self.timer.add("streamed", time.perf_counter() - began)
        if samples is not None and not error and not stopped:
            # before the reduce: once rank 0 publishes, every rank's records are in place
            with self.timer.span("publish"):
                error = self.write_samples(cell, ev, samples)
        if error:
            # before the reduce: rank 0 reads it
            self.progress.cell_error(cell.key, error, self.details.get(cell.key))
        states[_FAILED] = torch.tensor(1 if error else 0, dtype=torch.int64)
        states[_CACHE_OVERFLOW] = torch.tensor(int(shard.overflowed), dtype=torch.int64)
        states[_STOP] = torch.tensor(int(stopped or self.progress.stopping()), dtype=torch.int64)
        where = f"the end of the pass over {cell.checkpoint.location} on {ev.name}"
        self.mark("reduce", f"during the all-reduce of the states of "
                            f"{cell.checkpoint.location} on {ev.name}")
        with self.timer.span("reduce"):
            dist.sync(where, self.timeout)
            merged = dist.all_reduce_states(states, where, self.timeout)   # the one reduce
        if merged[_STOP]:
            raise Stop
        shard.agree(bool(merged[_CACHE_OVERFLOW]))
        if merged[_FAILED]:
            if self.rank != 0:
                return None
            if not error:      # another rank's: its message, and its traceback for --debug
                error, detail = self.progress.error_of(cell.key)
                if detail and cell.key not in self.details:
                    self.details[cell.key] = detail
            return self.failure(cell, step, error or (
                f"{cell.checkpoint.location}: evaluating {ev.name} failed on another worker; "
                "see the worker logs"))
        if self.rank != 0:
            return None
        self.mark("publish", f"while publishing {cell.checkpoint.location} on {ev.name}")
        with self.timer.span("publish"):
            return self.publish(cell, ev, merged, step, layout, start)

    def one_pass(self, model, cell: Cell, ev: Evaluation):
        """This worker's states for one cell, the error that stopped it (the pass still drains
        the shard: every rank must finish every pass over its split), and whether the driver
        asked to stop (then the pass ends at once: the group is winding down)."""
        index = self.index_of[cell.key]
        skipped = 0                 # rows of batches that could not be decoded
        p = Pass(model, self.metrics[ev.name], ev.output_size, self.device,
                 ev.spec.task, ev.spec.bootstrap.k, ev.spec.dataset, text=self.tokenizer,
                 generation=ev.spec.generation, batch=ev.spec.batch_size,
                 samples=ev.spec.samples and self.rank % self.tensor == 0, engine=self.engine,
                 # progress counts rows as they are scored, not as they are read
                 on_rows=lambda n: self.progress.rows(index, self.counted(skipped + n)))
        rows, error, stopped = 0, None, False
        waited = time.perf_counter()
        for batch in self.shards[ev.name]:
            if waited is not None:
                self.timer.add("first batch", time.perf_counter() - waited)
                if isinstance(self.shards[ev.name].rows, SplitRows):
                    self.timer.add("ray data", time.perf_counter() - waited)
                waited = None
            if self.progress.stopping():
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
            error = self.scored(p.update, (x, y, buckets), cell, ev)
            rows += len(buckets)
        if not error and not stopped:
            error = self.scored(p.finish, (), cell, ev)
        self.progress.rows(index, self.counted(rows), force=True)
        if self.lockstep is not None:        # peers of this replica may still have rows
            idle = tasks.get(ev.spec.task).idle_input(ev.spec.dataset, ev.data.shapes)
            self.lockstep.drain(model, None if idle is None else
                                tasks.move(idle, self.device, float_dtype(model)))
        samples = None if error or stopped else p.sample_table()
        states = dict(p.abandon() if error else p.states)
        if self.rank % self.tensor:       # its engine's first rank counts these rows
            states = {k: torch.zeros_like(v) for k, v in states.items()}
        return states, error, stopped, samples

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

    def publish(self, cell: Cell, ev: Evaluation, merged, step, layout, start) -> CellOutcome:
        counted = int(merged[ROWS])
        if counted != ev.data.num_rows:
            return self.failure(cell, step, f"{cell.checkpoint.location}: {ev.name}: counted "
                                            f"{counted} rows but the data set has "
                                            f"{ev.data.num_rows}; not published (a sharding "
                                            "bug: please report it)")
        metrics = self.metrics[ev.name]
        try:
            results = finalize(metrics, merged, ev.output_size, ev.spec.bootstrap)
        except RayevalError as e:          # a custom metric's compute: this cell only
            self.details[cell.key] = e.detail
            return self.failure(cell, step, f"{ev.name}: {e.message}")
        self.store.write_cell(cell.key, cell_rows(
            sweep=self.plan.sweep.name, checkpoint=cell.checkpoint.location, step=step,
            epoch=cell.checkpoint.epoch, evaluation=ev.name, results=results,
            higher_is_better={k: bool(getattr(m, "higher_is_better", True)) for k, m in metrics},
            num_samples=counted, num_tokens=tasks.get(ev.spec.task).scored_units(merged),
            world_size=self.world, bootstrap_key=ev.spec.bootstrap.key,
            samples=self.samples_tag if ev.spec.samples else None))
        return CellOutcome(
            key=cell.key, checkpoint=cell.checkpoint.location, evaluation=ev.name, step=step,
            values=tuple((k, r.value) for k, r in results.items()), rows=counted,
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
            self.progress.finish(outcome.key, outcome)


class Prefetch:
    """The next checkpoint fetched (object storage to this node's cache) and read
    (deserialised) on a thread while the current one is evaluated, so loading hides behind
    the passes. At most one checkpoint ahead, and only fetched, not read, when its files are
    over ``budget`` bytes (it would not fit beside the current one). A failure is kept and
    raised where the checkpoint is loaded, so it fails its own cells as usual."""

    def __init__(self, cache_dir: str, read, budget: int, enabled: bool = True):
        import concurrent.futures

        self.cache_dir = cache_dir
        self.read = read
        self.budget = budget
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rayeval-ahead")
        self.enabled = enabled          # RAYEVAL_PREFETCH=0 turns it off (benchmarks)
        self.location: str | None = None
        self.future = None

    def start(self, location: str, fingerprint: str) -> None:
        if not self.enabled:
            return
        self.location = location
        self.future = self.pool.submit(self._get, location, fingerprint)

    def _get(self, location: str, fingerprint: str):
        local = fetch(location, self.cache_dir, fingerprint)
        if self.read is None or _size(local) > self.budget:
            return local, None
        return local, self.read(local)

    def take(self, location: str):
        """(local path, read checkpoint or None) of ``location`` if it was fetched ahead (the
        fetch's error is raised here), else (None, None)."""
        if self.future is None or self.location != location:
            return None, None
        future, self.future, self.location = self.future, None, None
        return future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _size(path: str) -> int:
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path)
               for f in files)


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
