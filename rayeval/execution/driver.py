"""The driver: the run of a plan, written once, and ONE TorchTrainer.fit() that evaluates every
pending cell (checkpoint x evaluation) of it.

    plan = preflight.prepare(sweep)                  # rayeval.plan: the checks and the plan, no Ray
    with RayLifecycle(sweep, callbacks=...) as life:
        RunSequence(life, fit)(plan)                 # Ray up, the fit, group aggregates published,
                                                     # the run's cells consolidated

Public entry points: ``run_sweep`` (``rayeval run``, and the Ray Train validation through the
API), ``RunSequence`` (``run_sweep``'s plan and each ``rayeval watch`` poll's; a service's and
watch's on the standing group that ``StandingGroups`` holds) and ``run_plan`` (one fit over a
plan, on the Ray this process is connected to).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable

from rayeval.execution import recovery, signals, user_code
from rayeval.plan import groups
from rayeval.execution.callbacks import Callbacks, RunCallback
from rayeval.execution.ledger import DriverLedger
# controller_env, follow and trainer: run_plan()'s and Standing's, from the one lifecycle
from rayeval.execution.lifecycle import RayLifecycle, controller_env, follow, trainer
from rayeval.ranking import suite
from rayeval.config import entries
from rayeval.config.run_schema import Parallelism, Recovery
from rayeval.config.schema import Sweep
from rayeval.errors import RayevalError, RunError, StoreError, reason
from rayeval.plan.cells import PARTIAL, CellOutcome, Plan, run_keys
from rayeval.plan.preflight import prepare
from rayeval.execution.profile import Timer
from rayeval.io.store import ResultStore


@dataclass
class RunReport:
    plan: Plan
    outcomes: list[CellOutcome] = field(default_factory=list)   # pending cells, plan order
    seconds: float = 0.0
    nodes: int = 0                # Ray nodes the workers ran on (of the last attempt)
    loads: dict = field(default_factory=dict)   # (rank, checkpoint) -> loads, all attempts
    timer: Timer = field(default_factory=Timer)  # the driver's phases (``profile``)
    worker_times: dict = field(default_factory=dict)   # rank -> {phase: (seconds, count)}

    @property
    def raced(self) -> tuple[int, int] | None:
        """A race's (item evaluations scored, item evaluations a full run would score) over
        its published cells; None without a race."""
        if self.plan.sweep.select is None:
            return None
        done = [o for o in self.outcomes if o.ok]
        full = sum(self.plan.evaluation(o.evaluation).data.num_rows for o in done)
        return sum(o.rows - o.resumed for o in done), full

    @property
    def failures(self) -> list[CellOutcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def cell_keys(self) -> set[str]:
        return run_keys(self.plan, self.outcomes)

    def board(self, stored: list[dict] | None = None):
        """The run's board (``ranking.run_board``): its cells' rows and its sweep's group
        aggregates, ranked by the sweep's ``aggregate:`` — what ``rayeval run`` prints and
        the trackers log; None when the store holds none of them. ``stored``: the store's
        newest rows, where the caller has read them."""
        from rayeval.ranking import run_board

        return run_board(self.plan.sweep, self.cell_keys, stored)


@dataclass
class Evaluated:
    """What one TorchTrainer.fit() over a plan's cells came to."""
    outcomes: list[CellOutcome]
    nodes: int
    loads: dict
    worker_times: dict = field(default_factory=dict)   # rank -> {phase: (seconds, count)}


class RunSequence:
    """The run of a plan, written once: ``run_sweep``'s plan (``preflight.prepare``) and each
    ``rayeval watch`` poll's (``preflight.plan_cells``) go through it, inside their one
    ``RayLifecycle``. The sweep file kept in the store (``keep_sweep``, at the first plan
    with cells to evaluate, once Ray is up);
    ``on_plan``; when the plan has cells, Ray up (``life.ensure_ray``) and ``fit(plan)`` while
    ``life.following`` them; then the lm-eval group aggregates whose members are all stored
    published (``groups.publish``), the run's cells consolidated into one part
    (``consolidate``) and ``on_outcomes``, so that whatever hears of the outcomes finds them in
    the store with their groups.

    ``fit(plan)``: the pending cells' outcomes in plan order (``run_sweep``: one
    ``TorchTrainer.fit``, ``run_plan``; ``watch``: the standing group, ``Standing.run``), or
    None when the fit failed and the caller has dealt with it (``watch`` tries again at the
    next poll): the sequence ends there, nothing published. An error from the fit propagates.
    ``discard_now``: the cells' temporary store files are removed as the fit ends (``watch``,
    whose Ray stays up), not at the end of the lifecycle."""

    def __init__(self, life: RayLifecycle, fit: Callable[[Plan], list[CellOutcome] | None],
                 *, discard_now: bool = False):
        self.life = life
        self.fit = fit
        self.discard_now = discard_now
        self.sweep_stored = False   # the sweep file is in the store (a watch's first poll)

    def __call__(self, plan: Plan) -> list[CellOutcome] | None:
        """The outcomes of the plan's pending cells (none without cells), or None (see the
        class docstring)."""
        run = self.life.callbacks
        run.on_plan(plan)
        outcomes: list[CellOutcome] | None = []
        if plan.cells:
            self.life.ensure_ray()
            if not self.sweep_stored:   # nothing to evaluate, or no Ray to do it: nothing written
                keep_sweep(plan.sweep)
                self.sweep_stored = True
            with self.life.following((c.key for c in plan.cells), discard_now=self.discard_now):
                outcomes = self.fit(plan)
            if outcomes is None:
                return None
        written: list[str] = []
        with signals.held():          # a signal lets these finish whole, then stops the run
            groups.publish(plan, written_keys=written)   # lm-eval groups, members all stored
            consolidate(plan, written)                   # the run's cells into one part
        run.on_outcomes(outcomes)
        return outcomes


def run_sweep(sweep: Sweep, *, address: str | None = None, force: bool = False,
              verbose: bool = False, callbacks: RunCallback | Iterable[RunCallback] = (),
              ready=None, standing: StandingGroups | None = None) -> RunReport:
    """Evaluate every cell of the sweep the store does not hold yet. ``callbacks``: what
    watches the run (``callbacks.RunCallback``: the plan line and progress display of
    ``rayeval.reporting.display``, the trackers' publisher that ``rayeval.api`` attaches, ...);
    none by default.
    ``ready``: the checkpoints to evaluate, as (CheckpointRef, fingerprint) pairs with their
    step, instead of the sweep's globs (``ray_train``'s validation of one checkpoint).
    Every check is ``preflight.prepare``'s, before Ray starts; the run is ``RunSequence``'s
    with one ``TorchTrainer.fit`` (``run_plan``) for the pending cells."""
    start = time.perf_counter()
    timer = Timer()
    with timer.span("inputs"):
        plan = prepare(sweep, force=force, ready=ready)
    report = RunReport(plan, outcomes=list(plan.failed), timer=timer)
    run = Callbacks.of(callbacks)

    def fit(plan: Plan) -> list[CellOutcome]:
        run.on_group_start()
        done = run_plan(plan, run, timer=timer)   # ``display``: the run's callbacks
        report.nodes, report.loads = done.nodes, done.loads
        report.worker_times = done.worker_times
        return done.outcomes

    def on_standing(plan: Plan) -> list[CellOutcome]:
        group = standing.group_for(plan, run)
        with timer.span("workers"):
            outcomes = standing.run(group, plan, run)
        report.nodes = group.ledger.node_count()
        return outcomes

    with RayLifecycle(sweep, address=address, verbose=verbose, callbacks=run,
                      timer=timer) as life:
        report.outcomes += RunSequence(life, fit if standing is None else on_standing)(plan)
    report.outcomes = plan.in_order(report.outcomes)
    report.seconds = time.perf_counter() - start
    return report


def keep_sweep(sweep: Sweep) -> None:
    """The sweep file's text into the store before any cell (``io.store.sweeps``): the sweep
    a report shows behind the rows. After the plan, only when it has cells to evaluate and
    Ray is up, so a sweep that fails its pre-flight, whose every checkpoint fails before Ray,
    or whose cluster does not answer leaves nothing; a sweep built in Python has no text and
    keeps none."""
    if sweep.text:
        ResultStore(sweep.output).keep_sweep(sweep.name, sweep.text)


def consolidate(plan: Plan, groups_written: list[str]) -> None:
    """The run's cells, each its own file while it ran, into one part (``store.compact``):
    a store that a board reads in a few files. A failure leaves the cells where they are
    (complete: the next ``rayeval store compact`` moves them), with one line."""
    keys = [c.key for c in plan.cells] + groups_written
    if plan.sweep.select is not None:       # a race's partial cells (execution.workers.race)
        keys += [c.key + PARTIAL for c in plan.cells]
    if not keys:
        return
    try:
        ResultStore(plan.sweep.output).consolidate(keys, summarize=suite.summaries)
    except StoreError as e:
        print(f"[rayeval] warning: the run's cells stay one file each: {e.message}",
              file=sys.stderr, flush=True)


def run_plan(plan: Plan, display=None, on_cell=None, timer: Timer | None = None) -> Evaluated:
    """One TorchTrainer.fit() over the plan's cells, on the Ray this process is connected to,
    in a thread while this one shows progress. Outcomes come in plan order. Raises RunError
    when the run fails as a whole (restart budget spent) and the worker's own error for bad
    input. ``on_cell`` gets each cell's outcome once, soon after it finishes (its rows are
    in the store by then), also when the run fails later."""
    sweep = plan.sweep
    with controller_env():
        fit_began = time.time()        # --profile's "group start" counts the trainer's making
        ledger = DriverLedger.start(DriverLedger.cells_of(plan))
        try:
            fit = Fit(recovery.Restarting(lambda: _trainer(plan, ledger.handle), ledger,
                                          sweep.recovery.max_restarts), "rayeval-fit")
            follow(ledger, fit, display, on_cell)
            _raise_failure(fit.error, ledger, sweep)
            finished = ledger.results()
            times = ledger.timings()
            if timer is not None and times:
                entered = min(t["entered"] for t in times.values())
                left = max(t["left"] for t in times.values())
                timer.add("group start", entered - fit_began)
                timer.add("workers", left - entered)
                timer.add("fit end", fit.ended - left)
            return Evaluated(
                outcomes=[finished[c.key] for c in plan.cells if c.key in finished],
                nodes=ledger.node_count(),
                loads=ledger.load_counts(),
                worker_times={r: t["phases"] for r, t in times.items()})
        finally:
            try:
                ledger.kill()         # also after a failure: `watch` keeps Ray up between polls
            except Exception:         # noqa: BLE001 - Ray may be going down (a signal)
                pass


class Fit:
    """``trainer.fit()`` on a thread, so that the main thread shows progress and takes the
    signals; its error and the time it ended are kept for the caller."""

    def __init__(self, trainer, name: str):
        import threading

        self.error: BaseException | None = None
        self.ended: float | None = None
        self.thread = threading.Thread(target=self._fit, args=(trainer,), name=name,
                                       daemon=True)
        self.thread.start()

    def _fit(self, trainer) -> None:
        try:
            trainer.fit()
        except BaseException as e:     # noqa: BLE001 - handed to the main thread
            self.error = e
        finally:
            self.ended = time.time()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()


@dataclass(frozen=True)
class Shape:
    """What a worker group is made of: a service's plan runs on a standing group of its
    shape (``StandingGroups``)."""
    workers: int
    use_gpu: bool = False
    resources: tuple = ()
    parallelism: Parallelism = Parallelism()
    recovery: Recovery = Recovery()

    @classmethod
    def of(cls, sweep: Sweep) -> Shape:
        resources = tuple(sorted(dict(sweep.resources_per_worker).items()))
        return cls(sweep.workers, sweep.use_gpu, resources, sweep.parallelism, sweep.recovery)


def _trainer(plan: Plan | None, ledger, shape: Shape | None = None):
    """The evaluation TorchTrainer: the sweep's workers running ``worker.train_loop``
    (``plan`` None: a standing group of ``shape``, a service's or watch's, set up for each
    plan it is handed)."""
    import ray.train
    from ray.train.torch import TorchConfig

    from rayeval.execution import pipeline
    from rayeval.execution.workers.worker import train_loop

    shape = shape or Shape.of(plan.sweep)
    data = pipeline.datasets(plan) if plan is not None else {}  # what Ray Data feeds
    return trainer(
        train_loop_per_worker=train_loop,
        train_loop_config={"plan": plan, "ledger": ledger,
                           "tensor": shape.parallelism.tensor,
                           "timeout": shape.recovery.stall_timeout_s,
                           "ray_data": sorted(data),
                           # what rendered entries' slices send the workers (lm-eval tasks)
                           "shipped": entries.shipments(e.spec for e in plan.evaluations)
                           if plan is not None else {}},
        datasets=data or None,
        dataset_config=pipeline.exact_split(data, shape.workers) if data else None,
        torch_config=TorchConfig(timeout_s=shape.recovery.stall_timeout_s),
        scaling_config=ray.train.ScalingConfig(
            num_workers=shape.workers, use_gpu=shape.use_gpu,
            resources_per_worker=dict(shape.resources) or None),
        run_config=ray.train.RunConfig(
            name=f"rayeval-{plan.sweep.name if plan is not None else 'serve'}-"
                 f"{uuid.uuid4().hex[:8]}",
            failure_config=recovery.failure_config(),      # restarts: recovery.Restarting
            worker_runtime_env=recovery.worker_env()),
    )


def _raise_failure(error, ledger: DriverLedger, sweep: Sweep) -> None:
    """Raise what ended a fit badly: bad input a worker met, the worker group's failure
    (restarts spent: ``recovery.Restarting`` says what was lost and when), or any other
    error; nothing when it ended well."""
    import ray.train

    fatal = ledger.get_fatal()
    if fatal is not None:
        raise fatal
    if isinstance(error, ray.train.WorkerGroupError):
        raise _worker_error(error, sweep.recovery.max_restarts) from None
    if isinstance(error, ray.train.ControllerError):      # its own first line is a header
        raise RunError(f"the evaluation run failed in Ray Train's controller: "
                       f"{reason(error.controller_failure, typed=True)}") from None
    if isinstance(error, ray.train.TrainingFailedError):
        raise RunError(f"the evaluation run failed: {reason(error, typed=True)}") from None
    if error is not None:
        raise error


class Standing:
    """One worker group kept up across runs (``StandingGroups``: a service's sweeps, ``rayeval
    watch``'s polls): each run's cells are fed to it through the run ledger
    (``worker.Worker.stand``), with the plan itself the first time the group meets it, so a
    run costs its loads and passes, not a new worker group. After a failure the holder
    starts another."""

    def __init__(self, shape: Shape):
        self.sent: set[str] = set()      # the plans (tokens) the ledger holds
        self.ledger = DriverLedger.start([])
        self.env = contextlib.ExitStack()                 # until close: see run_plan()
        self.env.enter_context(controller_env())
        handle = self.ledger.handle
        self.fit = Fit(recovery.Restarting(
            lambda: _trainer(None, handle, shape=shape), self.ledger,
            shape.recovery.max_restarts), "rayeval-standing")

    @property
    def alive(self) -> bool:
        return self.fit.alive

    def run(self, plan: Plan, callbacks: RunCallback | None = None,
            own_progress: bool = True) -> list[CellOutcome]:
        """Evaluate the plan's cells on the standing group; their outcomes in plan order.
        Raises as ``run_plan`` does when the group fails (then it is gone). ``own_progress``:
        the progress counts this run's cells (a service's run), else every cell the group was
        handed (``watch``'s progress spans its polls)."""
        keys = [c.key for c in plan.cells]
        first = self.ledger.add_cells(plan, self._base(plan))
        follow(self.ledger, self.fit, callbacks, keys=set(keys),
               done=lambda: self.ledger.finished(keys), since=first if own_progress else 0)
        finished = self.ledger.results()
        if not all(k in finished for k in keys):
            _raise_failure(self.fit.error, self.ledger, plan.sweep)
            raise RunError("the worker group ended before evaluating every cell")
        return [finished[k] for k in keys]

    def _base(self, plan: Plan) -> tuple[str, bytes | None]:
        """(token, pickled plan without cells and what its entries ship; None once the
        ledger holds it). The token is the pickle's digest and the sweep's own source files'
        (``user_code``): an edited ``my_models.py`` is a new plan for the workers too."""
        import hashlib
        import pickle

        base = {"plan": dataclasses.replace(plan, cells=(), cached=(), failed=()),
                "shipped": entries.shipments(e.spec for e in plan.evaluations)}
        blob = pickle.dumps(base)
        token = hashlib.sha256(blob + user_code.stamp().encode()).hexdigest()[:16]
        if token in self.sent:
            return token, None
        self.sent.add(token)
        return token, blob

    def close(self, timeout_s: float = 60.0) -> None:
        """No more cells: the group ends (bounded wait), and its ledger with it."""
        try:
            self.ledger.close(timeout=5)
            self.fit.thread.join(timeout_s)
            self.ledger.kill()
        except Exception:         # noqa: BLE001 - Ray may be going down (a signal)
            pass
        finally:
            self.env.close()

    def abandon(self) -> None:
        """The group did not stop after a signal (or a second one came): its ledger ended
        at once, with no wait for the fit."""
        try:
            self.ledger.kill()
        except Exception:         # noqa: BLE001 - Ray may be going down
            pass
        finally:
            self.env.close()


def _worker_error(e, restarts: int) -> RayevalError:
    """The most telling error from a failed worker group (``recovery.worker_group_error``)."""
    return recovery.worker_group_error(e, restarts)


class StandingGroups:
    """The one holder of a standing worker group (``rayeval serve``'s, kept from one sweep to
    the next, and ``rayeval watch``'s, kept across polls): a plan whose workers are alike
    (count, resources, GPUs, parallelism, recovery: ``Shape``) runs on the group that is up;
    another shape closes it and starts its own. A group that fails is dropped: the next plan
    starts another. ``own_progress``: each run's progress counts its own cells (a service),
    else every cell the group was handed (``watch``)."""

    def __init__(self, own_progress: bool = True):
        self.group: Standing | None = None
        self.shape: Shape | None = None
        self.own_progress = own_progress

    def start(self, shape: Shape) -> Standing:
        """A group of ``shape`` up now (the service's, before any sweep), this one closed."""
        self.close()
        self.group, self.shape = Standing(shape), shape
        return self.group

    def group_for(self, plan: Plan, run: RunCallback) -> Standing:
        """The standing group for ``plan``, started if need be (a plan that Ray Data feeds
        too: its ranks split the data sets when they take it, ``pipeline.standing_splits``)."""
        shape = Shape.of(plan.sweep)
        if self.group is not None and self.shape == shape and self.group.alive:
            return self.group
        run.on_group_start()
        return self.start(shape)

    def run(self, group: Standing, plan: Plan, run: RunCallback) -> list[CellOutcome]:
        """The plan's cells on ``group``; a group that fails (or a signal) is dropped: closed,
        or abandoned where a signal's wind-down (``lifecycle.follow``) could not stop it."""
        try:
            return group.run(plan, run, own_progress=self.own_progress)
        except KeyboardInterrupt as e:
            if getattr(e, "group_stopped", False):
                self.close(timeout_s=5)        # its fit has returned: nothing to wait for
            else:
                group.abandon()
                self.group = self.shape = None
            raise
        except BaseException:
            self.close(timeout_s=5)
            raise

    def close(self, timeout_s: float = 60.0) -> None:
        if self.group is not None:
            self.group.close(timeout_s=timeout_s)
        self.group = self.shape = None
