"""The driver: validate everything cheap first, plan the cells, then ONE TorchTrainer.fit()
evaluates every pending cell (checkpoint x evaluation) of the sweep.

Public entry points, used by the CLI, `watch` and the tests: ``prepare`` (checks and plan, no
Ray), ``evaluate`` (one fit over a plan, on the Ray this process is connected to) and
``run_sweep`` (both, inside the one Ray lifecycle of ``lifecycle.RayLifecycle``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterable

from rayeval.io import paths, vision
from rayeval.execution import recovery
from rayeval.plan import groups
from rayeval.execution.callbacks import Callbacks, RunCallback
from rayeval.execution.ledger import DriverLedger
# follow, quick_health_checks and trainer: evaluate()'s and Standing's, from the one lifecycle
from rayeval.execution.lifecycle import RayLifecycle, follow, quick_health_checks, trainer
from rayeval.core import tasks
from rayeval.results import suite
from rayeval.config.plugins import load_plugins
from rayeval.config.schema import EvalSpec, Sweep
from rayeval.io.data import inspect_dataset, probe_dataset
from rayeval.io.checkpoints import expand_checkpoints
from rayeval.errors import DataError, RayevalError, RunError, SpecError, StoreError, reason
from rayeval.core.evaluate import Decoder, output_size
from rayeval.io.loading import fit_error
from rayeval.io.model import ModelSource
from rayeval.plan.cells import CellOutcome, Evaluation, Plan, make_plan
from rayeval.plan.lm_eval_entries import write_requests
from rayeval.execution.profile import Timer
from rayeval.execution.race import PARTIAL
from rayeval.harness import store as lm_eval_store
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
        return {c.key for c in self.plan.cells + self.plan.cached} | \
            {o.key for o in self.plan.failed} | \
            {o.key + PARTIAL for o in self.outcomes if o.partial}


@dataclass
class Evaluated:
    """What one TorchTrainer.fit() over a plan's cells came to."""
    outcomes: list[CellOutcome]
    nodes: int
    loads: dict
    worker_times: dict = field(default_factory=dict)   # rank -> {phase: (seconds, count)}


def inspect_evaluations(sweep: Sweep) -> tuple[Evaluation, ...]:
    """Every evaluation's data set checked and counted, and the model probed on a few of its
    real rows: on the meta device (no memory), else once on the CPU. Bad columns, inputs the
    model cannot take, outputs that do not fit the task, labels outside the model's classes
    and a missing tokenizer all fail here, in seconds, before any cluster starts."""
    source = ModelSource(sweep.model, sweep.base_dir)
    text = any(tasks.get(e.task).uses_text for e in sweep.evals)
    first = _first_folder(sweep) if sweep.model.hugging_face else None
    if sweep.model.backend == "vllm" and first is not None:
        from rayeval.io import engine

        why = engine.serves_folder(first)       # the engine starts from the first's config
        if why:
            raise SpecError(f"{sweep.source}: model.backend: {why}")
    meta = source.meta(first)              # imports and calls the factory, or reads config.json
    if sweep.parallelism.sharded:
        from rayeval.execution.sharding import units

        units(meta, sweep.parallelism.wrap)    # parallelism.wrap must name classes it has
    tokenizer = source.tokenizer(first, meta) if text else None
    out = []
    for spec in sweep.evals:
        task = tasks.get(spec.task)
        if spec.dataset.images is not None:
            vision.check_image_model(tokenizer, meta, first, spec.dataset.key_path)
        info = inspect_dataset(spec.dataset, task)
        size = _probe_output_size(sweep, spec, info, source, meta, tokenizer)
        task.check_values(probe_dataset(info, spec.dataset.key_path), spec.dataset, size)
        out.append(Evaluation(spec=spec, data=info, output_size=size,
                              tokenizer=tokenizer if task.uses_text else None))
    return tuple(out)


def _first_folder(sweep: Sweep) -> str:
    """A local folder with the first checkpoint's config (and tokenizer): without a factory,
    the model is built from it."""
    from rayeval.io import hf

    hf.require()
    refs = expand_checkpoints(sweep.checkpoints)
    location = refs[0].location
    if not hf.is_folder(location):
        raise SpecError(f"checkpoints: {location} is not a Hugging Face folder (no config.json)"
                        "; set model.factory to evaluate other checkpoints")
    return hf.small_files(location, os.path.join(tempfile.gettempdir(), "rayeval-checkpoints"))


def _probe_output_size(sweep: Sweep, spec: EvalSpec, info, source: ModelSource, meta,
                       tokenizer) -> int:
    decoder = Decoder(spec, info, sweep.base_dir)
    decoder.use(tokenizer)
    head = probe_dataset(info, spec.dataset.key_path).head(4, columns=spec.dataset.columns)
    x, _, _ = decoder(head)
    task = tasks.get(spec.task)
    try:
        size = output_size(meta, task, x, "meta")
    except RayevalError:
        real = source.real()          # some models cannot run on the meta device
        if real is not None:
            size = output_size(real, task, x, "cpu")
        else:                         # a Hugging Face model: its output layer says
            size = int(meta.get_output_embeddings().weight.shape[0])
    if tokenizer is not None:
        top = max(task.probe_input(x).reshape(-1).tolist())
        if top >= size:
            raise DataError(f"{spec.key_path}: the tokenizer gives token id {top}, outside the "
                            f"model's vocabulary of {size}; the tokenizer does not match the "
                            "model (see model.tokenizer)")
    return size


def check_inputs(sweep: Sweep, force: bool = False) -> tuple[tuple[Evaluation, ...],
                                                             ResultStore]:
    """The evaluations, inspected and probed, and the store, probe-written: what `run` and
    `watch` check before any cluster starts. A request table of lm-eval the store holds must
    be the one the driver rendered (``force``: written again), before anything reads it."""
    load_plugins()                # a sweep built in Python may name a plugin's task or metric
    write_requests(sweep)         # the lm-eval request tables the evaluations read, rendered
    lm_eval_store.check_stored(_lm_eval_tables(sweep.evals), force)
    evaluations = inspect_evaluations(sweep)
    if sweep.parallelism.tensor > 1:
        for e in evaluations:
            if e.data.via_ray_data(e.spec.dataset):
                raise SpecError(
                    f"{sweep.source}: parallelism.tensor: an engine's {sweep.parallelism.tensor}"
                    f" workers must see the same rows, which {e.spec.dataset.key_path} on Ray "
                    "Data cannot give: use local parquet read directly (no dataset.cpus), or "
                    "parallelism.tensor: 1")
    store = ResultStore(sweep.output)
    store.check(write=True)
    return evaluations, store


def _lm_eval_tables(specs) -> list[str]:
    """The request tables of the lm-eval and lmms-eval evaluations among ``specs``."""
    return [s.dataset.path for s in specs if s.lm_eval is not None or s.lmms_eval is not None]


def prepare(sweep: Sweep, force: bool = False, ready=None) -> Plan:
    """Everything that can fail on bad input, before any cluster starts, and the plan.
    ``ready``: (CheckpointRef, fingerprint) pairs to plan instead of the sweep's globs."""
    evaluations, store = check_inputs(sweep, force)
    return plan_cells(sweep, evaluations, store, force=force, ready=ready)


def plan_cells(sweep: Sweep, evaluations, store: ResultStore, *, force: bool = False,
               ready=None, skip: set[str] = frozenset(), strict: bool = True) -> Plan:
    """The plan, with the cells of local checkpoints that do not fit the model (keys and
    shapes read from their headers, against the model on the meta device) failed here, before
    any worker would load them. ``strict``: ``select.top`` at or above the checkpoints is an
    error (`run`); else (a `watch` poll) they are evaluated whole."""
    plan = make_plan(sweep, evaluations, store, force=force, ready=ready, skip=skip)
    if not plan.cells:
        return plan
    source = ModelSource(sweep.model, sweep.base_dir)
    text = any(tasks.get(e.spec.task).uses_text for e in evaluations)
    failed, pending = [], []
    for ref, _, cells in plan.by_checkpoint():
        why = None if paths.is_uri(ref.location) else _local_problem(
            ref.location, source, sweep, text)
        if why is None:
            pending += cells
        else:
            failed += [CellOutcome(key=c.key, checkpoint=ref.location, evaluation=c.evaluation,
                                   step=ref.step, error=why) for c in cells]
    return _raced(dataclasses.replace(plan, cells=tuple(pending), failed=tuple(failed)),
                  strict)


def _raced(plan: Plan, strict: bool = True) -> Plan:
    """A race needs more checkpoints than it keeps: ``select.top`` at or above the sweep's
    checkpoints fails here; a plan whose pending checkpoints are no more than ``top`` (the
    others cached) has nothing to race and evaluates them whole."""
    select = plan.sweep.select
    if select is None:
        return plan
    every = {c.checkpoint.location for c in plan.cells + plan.cached} | \
        {o.checkpoint for o in plan.failed}
    if select.top >= len(every) and strict:
        raise SpecError(f"{plan.sweep.source}: select.top: {select.top} keeps every one of the "
                        f"{len(every)} checkpoints; race more checkpoints or lower top")
    if len(plan.by_checkpoint()) <= select.top:
        return dataclasses.replace(plan, sweep=plan.sweep.replace(select=None))
    return plan


def _local_problem(location: str, source: ModelSource, sweep: Sweep, text: bool) -> str | None:
    """Why a local checkpoint cannot be evaluated, from its headers and small files."""
    from rayeval.io import hf

    try:
        meta = source.meta(location)
    except RayevalError as e:
        return e.message if e.message.startswith(location) else f"{location}: {e.message}"
    if text and sweep.model.tokenizer is None and not hf.has_tokenizer(location):
        return (f"{location}: no tokenizer files beside the model; save the tokenizer with the "
                "checkpoint or set model.tokenizer")
    return fit_error(location, meta, sweep.checkpoint)


def run_sweep(sweep: Sweep, *, address: str | None = None, force: bool = False,
              verbose: bool = False, callbacks: RunCallback | Iterable[RunCallback] = (),
              ready=None) -> RunReport:
    """Evaluate every cell of the sweep the store does not hold yet. ``callbacks``: what
    watches the run (``callbacks.RunCallback``: the plan line and progress display of
    ``rayeval.reporting.display``, the trackers' publisher that ``rayeval.api`` attaches, ...);
    none by default.
    ``ready``: the checkpoints to evaluate, as (CheckpointRef, fingerprint) pairs with their
    step, instead of the sweep's globs (``ray_train``'s validation of one checkpoint)."""
    start = time.perf_counter()
    timer = Timer()
    with timer.span("inputs"):
        plan = prepare(sweep, force=force, ready=ready)
    run = Callbacks.of(callbacks)
    run.on_plan(plan)
    report = RunReport(plan, outcomes=list(plan.failed), timer=timer)
    with RayLifecycle(sweep, address=address, verbose=verbose, callbacks=run,
                      timer=timer) as life:
        if not plan.cells:
            run.on_outcomes([])
        else:
            life.ensure_ray()
            with life.following(c.key for c in plan.cells):
                run.on_group_start()
                done = evaluate(plan, run, timer=timer)   # ``display``: the run's callbacks
                report.outcomes += done.outcomes
                report.nodes, report.loads = done.nodes, done.loads
                report.worker_times = done.worker_times
                run.on_outcomes(done.outcomes)
    report.outcomes = plan.in_order(report.outcomes)
    written: list[str] = []
    groups.publish(plan, written_keys=written)   # lm-eval groups whose members are all stored
    consolidate(plan, written)
    report.seconds = time.perf_counter() - start
    return report


def consolidate(plan: Plan, groups_written: list[str]) -> None:
    """The run's cells, each its own file while it ran, into one part (``store_compact``):
    a store that a board reads in a few files. A failure leaves the cells where they are
    (complete: the next ``rayeval store compact`` moves them), with one line."""
    keys = [c.key for c in plan.cells] + groups_written
    if plan.sweep.select is not None:       # a race's partial cells (execution.race)
        keys += [c.key + PARTIAL for c in plan.cells]
    if not keys:
        return
    try:
        ResultStore(plan.sweep.output).consolidate(keys, summarize=suite.summaries)
    except StoreError as e:
        print(f"[rayeval] warning: the run's cells stay one file each: {e.message}",
              file=sys.stderr, flush=True)


def evaluate(plan: Plan, display=None, on_cell=None, timer: Timer | None = None) -> Evaluated:
    """One TorchTrainer.fit() over the plan's cells, on the Ray this process is connected to,
    in a thread while this one shows progress. Outcomes come in plan order. Raises RunError
    when the run fails as a whole (restart budget spent) and the worker's own error for bad
    input. ``on_cell`` gets each cell's outcome once, soon after it finishes (its rows are
    in the store by then), also when the run fails later."""
    sweep = plan.sweep
    with quick_health_checks():
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


def _trainer(plan: Plan, ledger, standing: bool = False):
    """The evaluation TorchTrainer: the sweep's workers running ``worker.train_loop``."""
    import ray.train
    from ray.train.torch import TorchConfig

    from rayeval.execution import pipeline
    from rayeval.execution.worker import train_loop

    sweep = plan.sweep
    data = pipeline.datasets(plan)          # the evaluations that Ray Data feeds
    return trainer(
        train_loop_per_worker=train_loop,
        train_loop_config={"plan": plan, "ledger": ledger, "standing": standing,
                           "ray_data": sorted(data), "lm_eval": lm_eval_store.shipment(
                               _lm_eval_tables(e.spec for e in plan.evaluations))},
        datasets=data or None,
        dataset_config=pipeline.exact_split(data, sweep.workers) if data else None,
        torch_config=TorchConfig(timeout_s=sweep.recovery.stall_timeout_s),
        scaling_config=ray.train.ScalingConfig(
            num_workers=sweep.workers, use_gpu=sweep.use_gpu,
            resources_per_worker=dict(sweep.resources_per_worker) or None),
        run_config=ray.train.RunConfig(
            name=f"rayeval-{sweep.name}-{uuid.uuid4().hex[:8]}",
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
    """One worker group kept up across ``rayeval watch``'s polls: each poll's cells are fed to
    it through the run ledger (``worker.Worker.stand``), so a new checkpoint costs its
    load and passes, not a new worker group. After a failure the caller starts another
    (``lifecycle.RayLifecycle.standing_group``)."""

    def __init__(self, sweep: Sweep, evaluations):
        self.sweep = sweep
        self.ledger = DriverLedger.start([])
        plan = Plan(sweep=sweep, evaluations=tuple(evaluations), cells=(), cached=(),
                    failed=())
        self.env = contextlib.ExitStack()                 # until close: see evaluate()
        self.env.enter_context(quick_health_checks())
        handle = self.ledger.handle
        self.fit = Fit(recovery.Restarting(lambda: _trainer(plan, handle, standing=True),
                                           self.ledger, sweep.recovery.max_restarts),
                       "rayeval-standing")

    @property
    def alive(self) -> bool:
        return self.fit.alive

    def run(self, plan: Plan, callbacks: RunCallback | None = None) -> list[CellOutcome]:
        """Evaluate the plan's cells on the standing group; their outcomes in plan order.
        Raises as ``evaluate`` does when the group fails (then it is gone)."""
        keys = [c.key for c in plan.cells]
        self.ledger.add_cells(plan)
        follow(self.ledger, self.fit, callbacks, keys=set(keys),
               done=lambda: self.ledger.finished(keys))
        finished = self.ledger.results()
        if not all(k in finished for k in keys):
            _raise_failure(self.fit.error, self.ledger, self.sweep)
            raise RunError("the worker group ended before evaluating every cell")
        return [finished[k] for k in keys]

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


def _worker_error(e, restarts: int) -> RayevalError:
    """The most telling error from a failed worker group (``recovery.worker_group_error``)."""
    return recovery.worker_group_error(e, restarts)
