"""The Ray Train worker: every pending checkpoint of a plan, evaluated over this worker's shard.

For each checkpoint: load it (any failure is that cell's, agreed on by all ranks), one pass over
the shard adding into metric states (no collective per batch), ONE all-reduce of the states,
then rank 0 checks the row count against the data set and publishes the cell. After the first
pass each worker keeps its decoded shard in memory (when every worker's fits) so later
checkpoints skip Ray Data entirely; otherwise every checkpoint streams the shard again.
"""

from __future__ import annotations

import os
import tempfile
import time

import ray.train
import ray.train.torch
import torch
from ray.train import DataConfig

from . import dist
from .checkpoints import fetch
from .loading import DTYPES, LeanLoader
from . import stats
from .data import batch_tensors, row_ids
from .errors import CheckpointError, GroupError, RayevalError, RunError
from .evaluate import ROWS, Pass, finalize, output_size
from .model import import_callable
from .plan import Plan
from .progress import WorkerProgress
from .store import ResultStore

DATASET = "eval"
_FAILED = "_failed"            # extra entries in the reduced vector: any rank failed the cell,
_CACHE_OVERFLOW = "_overflow"  # any rank's shard was too big to keep


class ExactlyOnceSplit(DataConfig):
    """Ray Train's default split (``equal=True``) drops rows to even out shards. Evaluation must
    see every row exactly once, so shards are split with ``equal=False`` (uneven, nothing
    dropped); the one all-reduce per checkpoint does not care how uneven they are."""

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        out = [{} for _ in range(world_size)]
        for name, ds in datasets.items():
            ds = ds.copy(ds)
            ds.context.execution_options = self._resolve_execution_options(name)
            hints = worker_node_ids if self._enable_shard_locality else None
            for i, split in enumerate(ds.streaming_split(world_size, equal=False,
                                                         locality_hints=hints)):
                out[i][name] = split
        return out


def cache_budget_bytes() -> int:
    """How much decoded shard a worker may keep: RAYEVAL_SHARD_CACHE_BYTES, else a quarter of
    this node's available memory shared by the workers on it."""
    if "RAYEVAL_SHARD_CACHE_BYTES" in os.environ:
        return int(os.environ["RAYEVAL_SHARD_CACHE_BYTES"])
    import psutil

    local = max(1, ray.train.get_context().get_local_world_size())
    return int(psutil.virtual_memory().available / 4 / local)


class Shard:
    """This worker's rows as tensor batches (inputs, targets, row buckets): streamed on the
    first pass, kept if small."""

    def __init__(self, iterator, plan: Plan):
        self.iterator = iterator
        self.spec = plan.sweep.dataset
        self.task = plan.sweep.task
        self.bootstrap = plan.sweep.bootstrap
        self.shape = plan.dataset.input_shape
        self.batch_size = plan.sweep.batch_size
        self.budget = cache_budget_bytes()
        self.passes = 0
        self.cache: list | None = []
        self.cached_bytes = 0
        self.use_cache = False

    def __iter__(self):
        if self.use_cache:
            yield from self.cache
            return
        first = self.passes == 0
        self.passes += 1
        for table in self.iterator.iter_batches(batch_size=self.batch_size,
                                                batch_format="pyarrow", prefetch_batches=2):
            if table.num_rows == 0:
                continue
            x, y = batch_tensors(table, self.spec, self.task, self.shape)
            if self.bootstrap.enabled:
                ids = row_ids(table, self.spec, x, y, self.task)
                buckets = stats.buckets_of(ids, self.bootstrap.seed, self.bootstrap.k)
            else:
                buckets = torch.zeros(x.shape[0], dtype=torch.int64)
            if first and self.cache is not None:
                self.cached_bytes += x.nbytes + y.nbytes + buckets.nbytes
                if self.cached_bytes <= self.budget:
                    self.cache.append((x, y, buckets))
                else:
                    self.cache = None
            yield x, y, buckets

    @property
    def overflowed(self) -> bool:
        return self.cache is None

    def agree(self, any_overflow: bool) -> None:
        """After the first pass: keep the cache only if every worker could keep its own."""
        if self.passes == 1 and not any_overflow and self.cache is not None:
            self.use_cache = True
        elif not self.use_cache:
            self.cache = None


def evaluate_plan(config: dict) -> list[dict]:
    """The train_loop_per_worker of the evaluation TorchTrainer; rank 0 returns the outcomes.

    A restarted group (a worker died or stalled) asks the tracker which cells are finished and
    goes on from the first unfinished one; a cell's rows are counted only in the pass that
    publishes it, so nothing is counted twice."""
    plan: Plan = config["plan"]
    rank = ray.train.get_context().get_world_rank()
    progress = WorkerProgress(config.get("tracker"), rank)
    attempt, done, fatal = progress.start()
    if fatal is not None:
        return []          # an earlier attempt met bad input: a restart would meet it again
    try:
        return _evaluate_cells(plan, [c for c in plan.cells if c.key not in done], progress,
                               attempt)
    except GroupError as e:
        progress.problem(e.message)
        raise
    except RayevalError as e:
        progress.fatal(e)
        raise
    except Exception as e:
        progress.problem(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise


def _evaluate_cells(plan: Plan, cells: list, progress: WorkerProgress,
                    attempt: int) -> list[dict]:
    sweep = plan.sweep
    timeout = sweep.recovery.stall_timeout_s
    rank = ray.train.get_context().get_world_rank()
    world = ray.train.get_context().get_world_size()
    most, neg_least = dist.all_reduce_max([len(cells), -len(cells)], "the start", timeout)
    if most != -neg_least:
        raise RunError(f"workers disagree on the cells left ({int(-neg_least)} to {int(most)}); "
                       "please report this bug")
    device = ray.train.torch.get_device()
    baseline = _peak_rss()
    factory = import_callable(sweep.model.factory, sweep.base_dir)
    loader = LeanLoader(lambda: factory(**sweep.model.kwargs).eval(), device,
                        DTYPES.get(sweep.model.dtype), sweep.checkpoint)
    metrics = [(m.key, m.build()) for m in sweep.metrics]
    shard = Shard(ray.train.get_dataset_shard(DATASET), plan)
    store = ResultStore(sweep.output) if rank == 0 else None
    cache_dir = os.path.join(tempfile.gettempdir(), "rayeval-checkpoints")
    index_of = {c.key: i for i, c in enumerate(plan.cells)}
    size = None
    outcomes = []

    def finish(cell, outcome):
        outcomes.append(outcome)
        if rank == 0:
            progress.finish(cell.key, outcome)

    for cell in cells:
        start = time.perf_counter()
        ref = cell.checkpoint
        index = index_of[cell.key]
        error = None
        model = None          # the previous checkpoint's weights are freed before the next load
        progress.rows(index, 0, force=True)
        try:
            model, raw = loader.load(fetch(ref.location, cache_dir, cell.fingerprint))
        except CheckpointError as e:
            error = e.message
        dist.sync(f"the load of {ref.location}", timeout)
        (any_failed,) = dist.all_reduce_max([1.0 if error else 0.0], f"the load of {ref.location}",
                                            timeout)
        if any_failed:
            finish(cell, _failure(ref, error or f"{ref.location}: could not be loaded on "
                                                "another worker; see the worker logs"))
            continue

        step = raw.step if raw.step is not None else ref.step   # Lightning's global_step
        if size is None:   # the same on every rank: same model, same zeros input
            size = output_size(model, sweep.task, plan.dataset.input_shape, device)
        p = Pass(model, metrics, size, device, sweep.task, sweep.bootstrap.k)
        rows = 0
        for x, y, buckets in shard:
            if error:
                continue          # finish the pass: every rank must drain its split
            try:
                p.update(x, y, buckets)
            except CheckpointError as e:
                error = f"{ref.location}: {e.message}"
            rows += len(buckets)
            progress.rows(index, rows)
        progress.rows(index, rows, force=True)
        states = dict(p.states)
        states[_FAILED] = torch.tensor(1 if error else 0, dtype=torch.int64)
        states[_CACHE_OVERFLOW] = torch.tensor(int(shard.overflowed), dtype=torch.int64)
        where = f"the end of the pass over {ref.location}"
        dist.sync(where, timeout)
        merged = dist.all_reduce_states(states, where, timeout)   # the one state all-reduce
        shard.agree(bool(merged[_CACHE_OVERFLOW]))
        if merged[_FAILED]:
            finish(cell, _failure(ref, error or f"{ref.location}: failed on another worker; "
                                                "see the worker logs"))
            continue
        if rank != 0:
            continue
        counted = int(merged[ROWS])
        if counted != plan.dataset.num_rows:
            finish(cell, _failure(ref, f"{ref.location}: counted {counted} rows but the data "
                                       f"set has {plan.dataset.num_rows}; not published "
                                       "(a sharding bug: please report it)"))
            continue
        results = finalize(metrics, merged, size, sweep.bootstrap)
        higher = {key: bool(getattr(m, "higher_is_better", True)) for key, m in metrics}
        store.write_cell(cell.key, [
            {"sweep": sweep.name, "checkpoint": ref.location, "step": step,
             "dataset": sweep.dataset.name, "metric": key, "value": r.value,
             "ci_low": r.ci_low, "ci_high": r.ci_high, "num_samples": counted,
             "world_size": world, "higher_is_better": higher[key],
             "replicates": r.replicates, "matrix": r.matrix,
             "bootstrap": sweep.bootstrap.key if r.replicates is not None else None}
            for key, r in results.items()])
        finish(cell, {"checkpoint": ref.location, "step": step, "ok": True,
                      "values": {k: r.value for k, r in results.items()}, "rows": counted,
                      "seconds": time.perf_counter() - start, "layout": raw.layout,
                      "peak_rss_bytes": _peak_rss(), "baseline_rss_bytes": baseline,
                      "attempt": attempt})
    return outcomes


def _peak_rss() -> int:
    """This process's peak resident memory so far, in bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _failure(ref, message: str) -> dict:
    return {"checkpoint": ref.location, "step": ref.step, "ok": False, "error": message}
