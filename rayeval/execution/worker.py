"""The Ray Train worker: every pending cell of a plan, checkpoint by checkpoint.

Each checkpoint is loaded ONCE per worker and evaluated on every evaluation that still needs it
before the next load. Its steps:

    load and agree    any rank's load failure fails all of the checkpoint's cells, on every rank
    pass              per evaluation, one pass over this worker's shard adding into metric states
    reduce            ONE all-reduce of the states per cell (no collective per batch)
    publish           rank 0 checks the row count against the data set and writes the cell

Each worker reads its own rows of every evaluation's data set: local parquet straight from
its files (``data.RowRange``: rank r of W takes rows [n*r/W, n*(r+1)/W), so every row is read
exactly once), any other source from its split of a Ray Data pipeline (``pipeline``). After a
first pass a worker keeps its decoded shard of an evaluation in memory when every worker's fits
(one memory budget shared by the evaluations, ``shards``); otherwise it streams it again.

The sweep's backend (``model.backend``, ``core.backends``) is built once per worker and serves
each checkpoint in turn; the per-cell pass, reduce and publish are ``passes.CellPasses``.
"""

from __future__ import annotations

import os
import tempfile
import time

import ray.train
import ray.train.torch
import torch

from rayeval import errors
from rayeval.config import constants
from rayeval.config.plugins import load_plugins
from rayeval.core import backends, tasks
from rayeval.core.evaluate import Decoder
from rayeval.core.metrics import build_all
from rayeval.harness import store as lm_eval_store
from rayeval.harness.task import lm_task
from rayeval.errors import (CheckpointError, GroupError, ModelError, RayevalError, RunError,
                            SpecError)
from rayeval.execution import dist
from rayeval.execution.ledger import SETTING_UP, WorkerLedger
from rayeval.execution.passes import CellPasses, Stop, peak_rss
from rayeval.execution.pipeline import SplitRows
from rayeval.execution.prefetch import Prefetch
from rayeval.execution.race import run_race
from rayeval.execution.profile import Timer
from rayeval.execution.shards import Budget, Shard, cache_budget_bytes
from rayeval.io import layouts
from rayeval.io.checkpoints import fetch
from rayeval.io.data import RowRange
from rayeval.io.model import ModelSource
from rayeval.io.store import ResultStore
from rayeval.plan.cells import Cell, CellOutcome, Plan

STANDING_POLL_S = 2.0      # a standing group's rank 0 asks for cells this long before it says
                           # "none yet" to the others


def train_loop(config: dict) -> list[CellOutcome]:
    """The train_loop_per_worker of the evaluation TorchTrainer; rank 0 returns the outcomes.

    A restarted group (a worker died or stalled) asks the ledger which cells are finished and
    goes on from the first unfinished one; a cell's rows are counted only in the pass that
    publishes it, so nothing is counted twice."""
    entered = time.time()
    plan: Plan = config["plan"]
    lm_eval_store.receive(config.get("lm_eval"))     # the driver's lm-eval tasks, through Ray
    rank = ray.train.get_context().get_world_rank()
    ledger = WorkerLedger(config.get("ledger"), rank)
    attempt, done, fatal = ledger.start()
    if fatal is not None:
        return []          # an earlier attempt met bad input: a restart would meet it again
    try:
        load_plugins()         # this process resolves the plan's names too; a failure is fatal
        timer = Timer(on_doing=ledger.doing)
        with timer.span("setup", doing=SETTING_UP):
            worker = Worker(plan, ledger, attempt, timer, config.get("ray_data", ()))
        if config.get("standing"):
            outcomes = worker.stand()
        elif plan.sweep.select is not None:      # a race publishes only at its end
            outcomes = worker.run(list(plan.cells))
        else:
            outcomes = worker.run([c for c in plan.cells if c.key not in done])
        ledger.timing(entered, time.time(), timer.as_dict())
        return outcomes
    except GroupError as e:
        ledger.problem(e.message)
        raise
    except RayevalError as e:
        ledger.fatal(e)
        raise
    except Exception as e:
        ledger.problem(errors.reason(e, typed=True))
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


class Worker(CellPasses):
    """One rank's state for a run: the model loader, the backend that answers the tasks'
    requests, the shards, the store (rank 0). Each cell's pass is ``CellPasses``'."""

    def __init__(self, plan: Plan, ledger: WorkerLedger, attempt: int,
                 timer: Timer | None = None, ray_data=()):
        sweep = plan.sweep
        self.timer = timer or Timer()
        ctx = ray.train.get_context()
        self.plan = plan
        self.ledger = ledger
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
        # model.backend: one for the whole sweep, serving each checkpoint in turn (vllm: one
        # engine; ``tensor`` consecutive ranks serve one engine, see the same rows, and only
        # the first of them counts them).
        self.backend = backends.create(sweep.model.backend, backends.Setup(
            model=sweep.model, device=self.device, tensor=sweep.parallelism.tensor,
            ident=f"{plan.run_id}-{attempt}",
            ranks={"RANK": self.rank, "LOCAL_RANK": ctx.get_local_rank(),
                   "WORLD_SIZE": self.world, "LOCAL_WORLD_SIZE": ctx.get_local_world_size()}))
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
        self.racing = None             # execution.race.Rounds while a race runs
        self.kept, self.kept_bytes, self.folders = {}, {}, {}   # a race's loaded checkpoints
        self.keep_budget = cache_budget_bytes() // 2
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
            if self.plan.sweep.select is not None:
                run_race(self)          # every pending cell: a restart races again
            else:
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
        the ledger as they come, until it closes the feed or asks to stop. Rank 0 takes
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
                    batch = self.ledger.take()
                    if batch is None or batch or time.monotonic() >= deadline:
                        break
                    time.sleep(0.1)
            batch = dist.broadcast(batch, "the wait for checkpoints", self.timeout)
            if batch is None:
                return self.outcomes
            if not batch:
                self.timer.doing("waiting for new checkpoints")
                continue
            cells = [(i, pickle.loads(blob)) for i, blob in batch]
            self.plan = dataclasses.replace(base, cells=tuple(c for _, c in cells))
            self.index_of = {c.key: i for i, c in cells}
            select = base.sweep.select       # a poll's new checkpoints race among themselves
            try:
                if select is not None and len(self.plan.by_checkpoint()) > select.top:
                    run_race(self)
                else:
                    self.run_checkpoints({c.key for _, c in cells})
            except Stop:
                return self.outcomes

    def run_checkpoints(self, todo: set[str]) -> None:
        pending = [(ref, fingerprint, [c for c in group if c.key in todo])
                   for ref, fingerprint, group in self.plan.by_checkpoint()]
        pending = [p for p in pending if p[2]]
        for i, (ref, fingerprint, group) in enumerate(pending):
            start = time.perf_counter()
            self.ledger.rows(self.index_of[group[0].key], 0, force=True)
            self.mark("load", f"while loading {ref.location}")
            with self.timer.span("load", doing=f"loading {_name(ref.location)}"):
                model, raw, error = self.load_and_agree(ref, fingerprint)
            if i + 1 < len(pending) and pending[i + 1][0].location not in self.kept:
                # the next one comes in while this one runs
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
            self.backend.release()
            self.keep(ref.location, model, raw)
            del model            # freed before the next load

    def keep(self, location: str, model, raw) -> None:
        """In a race, keep a CPU worker's loaded checkpoint for its next round while the
        kept ones fit a share of the memory budget: a round otherwise loads every survivor
        again (the language-model example's race: 93 loads, 8.9 s of its 14.5 s on the
        workers). Each rank decides for itself: its load step joins the others' agreement
        whether it loaded or kept (``load_and_agree``)."""
        if self.racing is None or self.lockstep is not None or self.device.type != "cpu" \
                or self.backend.collective_serve or location in self.kept:
            return
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        if size + sum(self.kept_bytes.values()) <= self.keep_budget:
            self.kept[location] = ((model, raw), self.folders[location])
            self.kept_bytes[location] = size

    def forget(self, locations: set[str]) -> None:
        """Let go of the kept checkpoints that left the race."""
        for location in set(self.kept) & locations:
            del self.kept[location]
            del self.kept_bytes[location]

    def load_and_agree(self, ref, fingerprint: str):
        """(model, raw, None) on every rank, or (None, None, why) on every rank when any
        rank failed to load the checkpoint. A sharded model is loaded in two steps, agreed on
        after each: its fit checked from the checkpoint's headers, then its rows read (DCP's
        load is collective: no rank may enter it alone)."""
        where = f"the load of {ref.location}"
        loaded = folder = None

        def stage():
            nonlocal loaded, folder
            if ref.location in self.kept:          # a race's earlier round loaded it here
                loaded, folder = self.kept[ref.location]
                if self.uses_text:
                    self.use_tokenizer(self.source.tokenizer(folder, loaded[0]))
                return
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
        serve = (lambda: self.backend.serve(loaded[0], folder, self.source.spec.tokenizer,
                                            ref.location, self.timer))
        if why is None and self.backend.collective_serve:
            # after every rank has loaded: an engine's start is collective
            name = self.backend.title or self.backend.name
            why = self.agree(ref.location, serve, f"the {name} load of {ref.location}")
        elif why is None:
            serve()
        if why is not None:
            return None, None, why
        self.ledger.loaded(ref.location)
        self.loaded_rss = peak_rss()
        self.folders[ref.location] = folder
        return loaded[0], loaded[1], None

    def agree(self, location: str, step, where: str) -> str | None:
        """Run one loading step on every rank; why it failed (on any rank), or None."""
        error = None
        try:
            step()
        except (CheckpointError, SpecError, ModelError) as e:
            error = e.message
            self.ledger.cell_error(location, error)   # before the reduce: rank 0 reads it
        dist.sync(where, self.timeout)
        any_failed, stop = dist.all_reduce_max([1.0 if error else 0.0,
                                                1.0 if self.ledger.stopping() else 0.0],
                                               where, self.timeout)
        if stop:
            raise Stop
        if any_failed:
            return error or self.ledger.error_of(location)[0] or (
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


def _name(location: str) -> str:
    """A checkpoint's last path part, as the progress line names it."""
    return location.rstrip("/").rsplit("/", 1)[-1]
