"""The Ray Train worker: every pending cell of a plan, checkpoint by checkpoint.

A worker is built from parts, each with its own module:

    rank.RankContext              its place in the group, device, deadline, ledger, timer
    checkpoints.CheckpointLoop    each checkpoint loaded once and agreed on by every rank,
                                  served to the backend, the next one fetched meanwhile
    scorer.CellScorer             one cell's pass over this worker's shard, the one
                                  all-reduce of its states
    sinks                         what becomes of the merged states: Publish (rank 0 checks
                                  the row count and writes the cell), RaceRound (a race's),
                                  judging.Generations (a judged cell's generations, kept)
    judging.JudgeStage            after the checkpoints: the judge grades the judged cells'
                                  kept generations (docs/judges.md)

The sweep's backend (``model.backend``, ``core.backends``) is built once per worker and serves
each checkpoint in turn. A plain run publishes each cell as it is scored; a race
(``race.run_race``) scores rounds into a RaceRound sink, then publishes; a standing group
(``rayeval watch``) takes the cells the driver feeds through the ledger as they come.
"""

from __future__ import annotations

import dataclasses
import time

import ray.train

from rayeval import errors
from rayeval.config import entries
from rayeval.config.plugins import load_plugins
from rayeval.core import backends
from rayeval.errors import WorkerGroupError, RayevalError, RunError
from rayeval.execution import pipeline, user_code
from rayeval.execution.workers import dist
from rayeval.execution.workers.checkpoints import CheckpointLoop, Stop
from rayeval.core import judge_model
from rayeval.execution.workers.judging import Generations, JudgeStage
from rayeval.execution.ledger import SETTING_UP, WorkerLedger
from rayeval.execution.profile import Timer
from rayeval.execution.workers.race import run_race
from rayeval.execution.workers.rank import RankContext
from rayeval.execution.workers.resume import Resumable
from rayeval.execution.workers.scorer import CellScorer
from rayeval.execution.workers.sinks import Publish
from rayeval.plan.cells import Cell, CellOutcome, Plan, generated

STANDING_POLL_S = 2.0      # a standing group's rank 0 asks for cells this long before it says
                           # "none yet" to the others


def train_loop(config: dict) -> list[CellOutcome]:
    """The train_loop_per_worker of the evaluation TorchTrainer; rank 0 returns the outcomes.

    A restarted group (a worker died or stalled) asks the ledger which cells are finished and
    goes on from the first unfinished one; a cell's rows are counted only in the pass that
    publishes it, so nothing is counted twice."""
    entered = time.time()
    plan: Plan | None = config["plan"]      # None: a standing group (a service's, watch's)
    entries.receive(config.get("shipped"))     # what the driver's slices sent (lm-eval tasks)
    rank = ray.train.get_context().get_world_rank()
    ledger = WorkerLedger(config.get("ledger"), rank)
    attempt, done, fatal = ledger.start()
    if fatal is not None:
        return []          # an earlier attempt met bad input: a restart would meet it again
    try:
        load_plugins()         # this process resolves the plan's names too; a failure is fatal
        standing = plan is None      # a standing group: set up for each plan it is handed
        if standing:
            user_code.mark()   # what a later plan's worker keeps (``_set_up``)
        timer = Timer(on_doing=ledger.doing)
        if standing:
            ctx = RankContext.of_ray_train(ledger, attempt, timer, config["tensor"],
                                           config["timeout"])
            warm()
            outcomes = stand(ctx)
            ledger.timing(entered, time.time(), timer.as_dict())
            return outcomes
        with timer.span("setup", doing=SETTING_UP):
            worker = Worker(plan, ledger, attempt, timer,
                            dict.fromkeys(config.get("ray_data", ())))    # the fit's own
        if plan.sweep.select is not None:      # a race publishes only at its end
            outcomes = worker.run(list(plan.cells))
        else:
            outcomes = worker.run([c for c in plan.cells if c.key not in done])
        ledger.timing(entered, time.time(), timer.as_dict())
        return outcomes
    except WorkerGroupError as e:
        ledger.problem(e.message)
        raise
    except RayevalError as e:
        ledger.fatal(e)
        raise
    except Exception as e:
        ledger.problem(errors.reason(e, typed=True))
        raise


class Worker:
    """One rank's parts for a run (see the module's docstring) and the outcomes rank 0
    returns."""

    def __init__(self, plan: Plan, ledger: WorkerLedger, attempt: int,
                 timer: Timer | None = None, ray_data: dict | None = None, backend=None):
        """``ray_data``: the evaluations Ray Data feeds, each with this rank's split (None:
        the fit's own data set, ``get_dataset_shard``)."""
        sweep = plan.sweep
        self.plan = plan
        tensor = sweep.parallelism.tensor
        self.ctx = ctx = RankContext.of_ray_train(ledger, attempt, timer or Timer(), tensor,
                                                  sweep.recovery.stall_timeout_s)
        # The loader first: a sharded model's mesh is made before an engine starts.
        self.checkpoints = CheckpointLoop(ctx, plan)
        # model.backend: one for the whole sweep, serving each checkpoint in turn (vllm: one
        # engine; ``tensor`` consecutive ranks serve one engine, see the same rows, and only
        # the first of them counts them).
        self.backend = self.checkpoints.backend = backend or backends.create(
            sweep.model.backend, backends.Setup(
                model=sweep.model, device=ctx.device, tensor=tensor,
                ident=f"{plan.run_id}-{attempt}",
                ranks={"RANK": ctx.rank, "LOCAL_RANK": ctx.local_rank,
                       "WORLD_SIZE": ctx.world, "LOCAL_WORLD_SIZE": ctx.local_world}))
        self.splits = ray_data or {}
        self.scorer = CellScorer(ctx, plan, self.backend, self.checkpoints.lockstep,
                                 self.splits)
        if self.scorer.uses_text:
            self.checkpoints.on_tokenizer = self.scorer.use_tokenizer
        self.publisher = Publish(ctx, plan, self.scorer.metrics, self.scorer.samples_tag,
                                 loaded_rss=lambda: self.checkpoints.loaded_rss)
        # A plain run's cells are scored in segments and kept as they go (``resume``).
        self.resumable = Resumable(ctx, self.scorer, self.publisher, sweep.resume.every)
        # Judged evaluations (docs/judges.md): their generations kept, then a judge stage.
        self.generations = Generations(ctx, plan, self.scorer.samples_tag)
        self.index_of = {c.key: i for i, c in enumerate(plan.cells)}
        self.outcomes: list[CellOutcome] = []

    @property
    def rank(self) -> int:
        return self.ctx.rank

    def run(self, cells: list[Cell]) -> list[CellOutcome]:
        ctx = self.ctx
        most, neg_least = dist.all_reduce_max([len(cells), -len(cells)], "the start",
                                              ctx.timeout)
        if most != -neg_least:
            raise RunError(f"workers disagree on the cells left ({int(-neg_least)} to "
                           f"{int(most)}); please report this bug")
        todo = {c.key for c in cells}
        self.scorer.start({c.evaluation for c in cells})   # while the first checkpoint loads
        try:
            if self.plan.sweep.select is not None:
                self.race(self.plan)        # every pending cell: a restart races again
            else:
                self.evaluate(self.saved_so_far(self.plan, todo), todo)
        except Stop:
            pass
        finally:
            self.close()
        return self.outcomes

    def saved_so_far(self, plan: Plan, todo: set[str]) -> Plan:
        """The plan with what the store has saved of its cells in progress now (``resume``): a
        restarted group goes on from where the earlier attempt saved them. Rank 0 reads the
        store (one listing) and tells the others: only rank 0 knows the attempt. The first
        attempt takes the plan's (none under --force)."""
        from rayeval.io.store import ResultStore
        from rayeval.plan.cells import resumed

        found = None
        if self.ctx.rank == 0 and self.ctx.attempt > 1:   # the first: the plan knows (--force)
            left = [c for c in plan.cells if c.key in todo and not c.generation]
            found = {c.key: (c.resume, c.saved_rows) for c in resumed(
                ResultStore(plan.sweep.output), left, plan.evaluations) if c.resume}
        found = dist.broadcast(found, "the look-up of saved states", self.ctx.timeout)
        if not found:
            return plan
        return dataclasses.replace(plan, cells=tuple(
            dataclasses.replace(c, resume=found[c.key][0], saved_rows=found[c.key][1])
            if c.key in found else c for c in plan.cells))

    def evaluate(self, plan: Plan, todo: set[str]) -> None:
        """The cells of ``plan`` in ``todo``: each checkpoint's (a judged cell: its
        generations, unless the store keeps them), then the judge stage over the judged
        cells' generations, on the same workers once the evaluated model is let go."""
        judged = [c for c in plan.cells if c.key in todo and c.generation]
        if judged:         # a restarted group finds what its earlier attempt generated
            judged = dist.broadcast(_generated(plan, judged) if self.ctx.rank == 0 else None,
                                    "the look-up of kept generations", self.ctx.timeout)
        kept = {c.key for c in judged if c.generated}
        self.run_checkpoints(plan, todo - kept, self.publisher)
        ready = [c for c in judged if c.generated or c.key in self.generations.done]
        if ready:
            judge_model.release(self.backend)      # the evaluated model, before the judge
            JudgeStage(self.ctx, plan, self.publisher, self.scorer.samples_tag,
                       self.index_of).run(ready, self.generations.done, self.finish)

    def run_checkpoints(self, plan: Plan, todo: set[str], sink) -> None:
        """Each pending checkpoint of ``plan`` loaded once, each of its cells in ``todo``
        scored and given to ``sink`` (a judged cell's generations to ``Generations``)."""
        def score(model, cell: Cell, step, layout, start: float) -> CellOutcome | None:
            ev = plan.evaluation(cell.evaluation)
            index = self.index_of[cell.key]
            if sink is self.publisher and not cell.generation:
                return self.resumable.score(model, cell, ev, step, layout, start, index)
            within = sink.within(cell, ev)
            merged, failed = self.scorer.score(
                model, cell.generating(), step, index, within,
                self.scorer.samples_tag if within is None and ev.spec.samples else None)
            if merged is None:
                return failed and dataclasses.replace(failed, key=cell.key)
            if cell.generation:
                return self.generations.keep(cell, ev, merged, step, layout)
            return sink.take(cell, ev, merged, step, layout, start)

        self.checkpoints.run(plan, todo, self.index_of, score, self.finish, keep=sink.keeps)

    def race(self, plan: Plan) -> None:
        run_race(plan, self.run_checkpoints, self.checkpoints.forget, self.publisher,
                 self.finish, self.outcomes)

    def finish(self, outcome: CellOutcome) -> None:
        self.outcomes.append(outcome)
        if self.ctx.rank == 0:
            self.ctx.ledger.finish(outcome.key, outcome)

    def close(self) -> None:
        """Let go of the checkpoints and the scorer's readers (the end of a run, or of a
        standing group's plan: ``stand``)."""
        try:
            self.checkpoints.close()
        finally:
            self.scorer.close()
            self.release_splits()

    def release_splits(self) -> bool:
        """A standing group's splits of the plan's data sets ended, once its cells are done
        (rank 0 owns their coordinators: ``pipeline.standing_splits``); whether there were
        any. A fit's own data sets are Ray Train's to end."""
        made = [it for it in self.splits.values() if it is not None]
        if made:
            self.scorer.close()
            if self.ctx.rank == 0:
                pipeline.release(made)
            self.splits = {}
        return bool(made)

    def _stand(self, cells: list[tuple[int, Cell]]) -> bool:
        """One batch of a standing group's cells, on this worker's plan; True when the
        group is to stop."""
        base = self.plan
        plan = dataclasses.replace(base, cells=tuple(c for _, c in cells))
        self.index_of = {c.key: i for i, c in cells}
        select = base.sweep.select       # a poll's new checkpoints race among themselves
        try:
            if select is not None and len(plan.by_checkpoint()) > select.top:
                self.race(plan)
            else:
                self.evaluate(plan, {c.key for _, c in cells})
        except Stop:
            return True
        return False


def warm() -> None:
    """Import what a first checkpoint's load would (the layouts' readers), for a process that
    waits for its first plan: a service's workers and its driver."""
    import importlib

    for name in ("safetensors.torch", "torch.distributed.checkpoint", "rayeval.io.layouts",
                 "pyarrow.parquet"):
        try:
            importlib.import_module(name)
        except ImportError:          # an optional layout's library: imported when used
            pass


def stand(ctx: RankContext) -> list[CellOutcome]:
    """A standing group (``rayeval watch``, ``rayeval serve``: ``driver.StandingGroups``):
    evaluate the cells the driver feeds through the ledger as they come, until it closes the
    feed or asks to stop. Rank 0 takes them and every rank gets the same batch; while none
    comes, rank 0 says so every few seconds, so a long wait is never taken for a stall. Each
    cell comes with its plan's token: a worker is set up for the plan when the group meets it
    (a service's next sweep, watch's first poll), in the same process and process group
    (``_set_up``)."""
    import pickle

    outcomes = []
    worker: Worker | None = None
    token: str | None = None        # the plan ``worker`` is set up for
    wait = min(STANDING_POLL_S, ctx.timeout / 4)
    try:
        while True:
            batch, bases = [], {}
            if ctx.rank == 0:
                deadline = time.monotonic() + wait
                while True:
                    batch = ctx.ledger.take()
                    if batch is None or batch or time.monotonic() >= deadline:
                        break
                    time.sleep(0.1)
                bases = {t: ctx.ledger.base(t) for t in {t for *_, t in batch or ()}
                         if t != token}
            batch, bases = dist.broadcast((batch, bases), "the wait for checkpoints",
                                          ctx.timeout)
            if batch is None:
                break
            if not batch:
                ctx.timer.doing("waiting for the next cells")
                continue
            for tok in dict.fromkeys(t for *_, t in batch):     # queued in order
                if tok != token:
                    if worker is not None:
                        outcomes += worker.outcomes
                        worker.close()
                    worker, token = _set_up(ctx, pickle.loads(bases[tok]), worker), tok
                cells = [(i, pickle.loads(blob)) for i, blob, t in batch if t == tok]
                if worker._stand(cells):
                    return outcomes + worker.outcomes
                if worker.release_splits():      # set up again if the plan comes again
                    token = None
    finally:
        if worker is not None:
            worker.close()
    return outcomes + (worker.outcomes if worker is not None else [])


def _set_up(ctx: RankContext, base: dict, before: Worker | None) -> Worker:
    """This rank's worker for a plan a standing group is handed (``base``: the plan without
    cells and what its entries ship). The sweep's own modules imported so far are forgotten
    first (``user_code.forget``): the next plan's may be other files of the same names, or the
    same files edited. The backend of the worker ``before`` it serves this plan too when the
    model section is the same (a vLLM engine is not started again for the next run)."""
    user_code.forget()
    entries.receive(base["shipped"])
    plan = base["plan"]
    kept = before.backend if before is not None and before.plan.sweep.model == \
        plan.sweep.model else None
    with ctx.timer.span("setup", doing=SETTING_UP):
        splits = {}
        if pipeline.fed(plan):        # its data sets split now: the group's fit has none
            splits = pipeline.standing_splits(
                plan, ctx.rank, ctx.world, ctx.ledger.nodes(),
                lambda made: dist.broadcast(made, "the split of the plan's data", ctx.timeout))
        return Worker(plan, ctx.ledger, ctx.attempt, ctx.timer, splits, backend=kept)


def _generated(plan: Plan, cells: list[Cell]) -> list[Cell]:
    from rayeval.io.store import ResultStore

    return generated(ResultStore(plan.sweep.output), cells)
