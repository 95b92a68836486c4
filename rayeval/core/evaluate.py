"""One checkpoint's pass over one worker's rows, and the metrics from merged states.

Plain torch, no Ray and no collectives: the worker calls this between its loads and its one
all-reduce, and the single-process reference path calls it over all rows.

States are kept per row bucket (see stats.py) as int64: counts as they are, float sums as
fixed-point limbs. Everything merges by addition, exactly.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass
from typing import Iterable

from rayeval.core import backends, stats, tasks
from rayeval.core.backends import Backend, Context
from rayeval.core.backends.torch import call_model, float_dtype, move
from rayeval.config.schema import OFF, Bootstrap, DatasetSpec, EvalSpec, Generation
from rayeval.io.data import DatasetInfo
from rayeval import errors
from rayeval.errors import MetricError, ModelError, traceback_of
from rayeval.core.metrics import IGNORE, Indexed, Metric
from rayeval.io.model import import_callable
from rayeval.core.tasks import TOKENS
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

ROWS = "_rows"   # the row count every cell keeps, checked against the data set before publishing


class Decoder:
    """An evaluation's pyarrow batches as (inputs, targets, row buckets) tensors."""

    def __init__(self, evaluation: EvalSpec, info: DatasetInfo, base_dir: str):
        self.spec = evaluation.dataset
        self.task = tasks.get(evaluation.task)
        self.bootstrap = evaluation.bootstrap
        self.shapes = info.shapes
        self.transform = None
        self.text = None                 # the tokenizer's context: set per checkpoint (text tasks)
        self.generation = evaluation.generation
        self.samples = evaluation.samples      # keep what per-item records show
        if self.spec.transform:
            self.transform = import_callable(self.spec.transform, base_dir,
                                             what=f"{self.spec.key_path}.transform")

    def use(self, text) -> bool:
        """Decode with this tokenizer context from now on; whether that changes the decoded
        batches (a held shard decoded with another tokenizer must go)."""
        same = (self.text is None and text is None) or (
            self.text is not None and text is not None and self.text.key == text.key)
        self.text = text
        return not same

    def __call__(self, table) -> tuple[tasks.Inputs, torch.Tensor, torch.Tensor]:
        x, y = self.task.decode(table, self.spec, self.shapes, self.transform, self)
        if self.bootstrap.enabled:
            ids = self.task.row_ids(table, self.spec, x, y)
            buckets = stats.buckets_of(ids, self.bootstrap.seed, self.bootstrap.k)
        else:
            buckets = torch.zeros(table.num_rows, dtype=torch.int64)
        return x, y, buckets


def output_size(model: torch.nn.Module, task: tasks.Task, x: tasks.Inputs,
                device: torch.device | str = "cpu") -> int:
    """Classes (classification), vocabulary size (language modeling) or 1 (regression), from
    one forward pass of ``x``; a model that cannot take them, or whose output does not fit the
    task, is a ModelError."""
    x = task.probe_input(x)
    try:
        with torch.inference_mode():
            out = call_model(model, move(x, torch.device(device), float_dtype(model)))
    except Exception as e:
        raise errors.wrap(e, ModelError, f"model.factory: the model cannot take "
                          f"{describe_inputs(x)}", typed=True, detail=traceback_of(e),
                          key_path="model.factory") from None
    return task.output_size(out)


def describe_inputs(x: tasks.Inputs) -> str:
    if isinstance(x, dict):
        return "keyword inputs " + ", ".join(f"{k} of shape {tuple(v.shape)}"
                                              for k, v in x.items())
    return f"inputs of shape {tuple(x.shape)} ({str(x.dtype).replace('torch.', '')})"


class Accumulator:
    """Bucketed, exact metric states for one checkpoint on one worker.

    Float contributions are held back (state index and value) and turned into fixed-point
    limbs ``FLUSH_VALUES`` values at a time: converting and carrying each batch's values took
    about 40 small kernels and two device syncs per batch, which on a GPU cost more than a
    small model's forward pass. ``flush`` (``Pass.finish``) adds what is held."""

    FLUSH_VALUES = 1 << 20     # 16 MiB held at most (a float64 value and an int64 index)

    def __init__(self, metrics: list[tuple[str, Metric]], size: int, buckets: int = 1,
                 device: torch.device | None = None, count_tokens: bool = False):
        device = torch.device("cpu") if device is None else device
        self.metrics = metrics
        self.size = size
        self.k = buckets
        self.device = device
        self._states: dict[str, torch.Tensor] = {ROWS: torch.zeros((), dtype=torch.int64,
                                                                  device=device)}
        if count_tokens:    # in states, so the one all-reduce of a cell sums it with the rest
            self._states[TOKENS] = torch.zeros((), dtype=torch.int64, device=device)
        self.floats: set[str] = set()
        self.held: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.held_values = 0
        self.templates: dict[str, torch.Tensor] = {}
        for key, m in metrics:
            kb = self.k if m.scalar else 1          # matrices are stored, not resampled
            for name, t in m.init_state(size).items():
                full = f"{key}/{name}"
                self.templates[full] = t
                extra = (stats.LIMBS,) if t.dtype.is_floating_point else ()
                if extra:
                    self.floats.add(full)
                self._states[full] = torch.zeros((kb, *t.shape, *extra), dtype=torch.int64,
                                                device=device)

    def add(self, outputs: torch.Tensor, targets: torch.Tensor, buckets: torch.Tensor,
            tokens: torch.Tensor | int | None = None) -> None:
        buckets = buckets.to(self.device)
        for key, m in self.metrics:
            with metric_errors(key, "on a batch"):
                rows_fn = getattr(m, "rows", None)
                contributions = rows_fn(outputs, targets) if rows_fn else None
                b = buckets if m.scalar else torch.zeros_like(buckets)
                if contributions is None:
                    self._add_grouped(key, m, outputs, targets, b)
                    continue
                for name, c in contributions.items():
                    self._scatter(f"{key}/{name}", c, b)
        self._states[ROWS] += targets.shape[0]
        if self.held_values >= self.FLUSH_VALUES:
            self.flush()
        if TOKENS in self._states:
            self._states[TOKENS] += tokens if tokens is not None else (targets != IGNORE).sum()

    def _scatter(self, name: str, c, buckets: torch.Tensor) -> None:
        state = self._states[name]
        shape = self.templates[name].shape
        size = max(1, int(torch.Size(shape).numel()))
        is_float = name in self.floats
        if isinstance(c, Indexed):
            index = c.index.reshape(c.index.shape[0], -1)
            flat = (buckets.view(-1, 1) * size + index).reshape(-1)
            if c.value is None:
                value = torch.ones(flat.shape, dtype=torch.int64, device=flat.device)
            else:
                value = c.value.reshape(-1)
        elif size == 1:
            flat, value = buckets, c.reshape(-1)
        else:                  # a value per row for each of the state's elements
            cells = torch.arange(size, device=buckets.device)
            flat = (buckets.view(-1, 1) * size + cells).reshape(-1)
            value = c.reshape(-1)
        if is_float:
            # a copy: a view would keep the batch's whole output alive until the flush
            self.held.setdefault(name, []).append((flat, value.to(torch.float64, copy=True)))
            self.held_values += flat.numel()
        else:
            state.view(-1).index_add_(0, flat, value.to(torch.int64))

    @property
    def states(self) -> dict[str, torch.Tensor]:
        """The states of every row added so far."""
        self.flush()
        return self._states

    def flush(self) -> None:
        """Add the held float contributions to their states, each metric's errors named."""
        held, self.held, self.held_values = self.held, {}, 0
        for name, parts in held.items():
            with metric_errors(name.rsplit("/", 1)[0], "on a batch"):
                flat = torch.cat([f for f, _ in parts])
                limbs = stats.to_limbs(torch.cat([v for _, v in parts]))
                state = self._states[name]
                state.view(-1, stats.LIMBS).index_add_(0, flat, limbs)
                stats.normalize(state)

    def abandon(self) -> dict[str, torch.Tensor]:
        """The states without what is held (the cell failed, maybe on what is held: its
        states are only reduced, never read)."""
        self.held, self.held_values = {}, 0
        return self._states

    def _add_grouped(self, key: str, m, outputs, targets, buckets) -> None:
        """Metrics with update() only: one update per bucket present in the batch."""
        for k in torch.unique(buckets).tolist():
            mask = buckets == k
            sub = {n: t.clone().to(self.device) for n, t in m.init_state(self.size).items()}
            m.update(sub, outputs[mask], targets[mask])
            for name, t in sub.items():
                full = f"{key}/{name}"
                if full in self.floats:
                    self._states[full][k] += stats.to_limbs(t)
                    stats.normalize(self._states[full])
                else:
                    self._states[full][k] += t.to(torch.int64)


@dataclass
class MetricResult:
    value: float
    ci_low: float | None = None
    ci_high: float | None = None
    replicates: list[float] | None = None
    matrix: list[list[int]] | None = None


def finalize(metrics: list[tuple[str, Metric]], states: dict[str, torch.Tensor], size: int,
             bootstrap: Bootstrap = OFF) -> dict[str, MetricResult]:
    """Metric values (and bootstrap intervals) from merged states."""
    out = {}
    for key, m in metrics:
        with metric_errors(key, "computing its value"):
            out[key] = _finalize_one(key, m, states, size, bootstrap)
    return out


@contextlib.contextmanager
def metric_errors(key: str, when: str):
    """A metric's own code failing is the metric's fault: a MetricError naming it (with the
    traceback for --debug), not the model's and not a crash of the worker group."""
    try:
        yield
    except Exception as e:
        raise errors.wrap(e, MetricError, f"metric {key!r} failed {when}", typed=True,
                          detail=traceback_of(e)) from None


def _finalize_one(key: str, m: Metric, states, size: int, bootstrap: Bootstrap) -> MetricResult:
    templates = m.init_state(size)
    local = {n: states[f"{key}/{n}"].cpu() for n in templates}
    floats = {n for n, t in templates.items() if t.dtype.is_floating_point}
    total = {n: _value(t.sum(0), n in floats) for n, t in local.items()}
    value = m.compute(total)
    if not m.scalar:
        return MetricResult(float("nan"), matrix=torch.as_tensor(value).tolist())
    result = MetricResult(float(value))
    if bootstrap.enabled and m.resampled:
        weights = stats.poisson_weights(bootstrap.seed, bootstrap.k, bootstrap.replicates)
        rep = {n: _value(stats.weighted_sum(weights, t), n in floats)
               for n, t in local.items()}
        if getattr(m, "batched_compute", False):
            values = torch.as_tensor(m.compute(rep), dtype=torch.float64).reshape(-1)
        else:
            values = torch.tensor([float(m.compute({n: t[b] for n, t in rep.items()}))
                                   for b in range(bootstrap.replicates)],
                                  dtype=torch.float64)
        result.ci_low, result.ci_high = stats.percentile_interval(values,
                                                                  bootstrap.confidence)
        result.replicates = values.tolist()
    return result


def _value(t: torch.Tensor, is_float: bool) -> torch.Tensor:
    if is_float:
        return stats.from_limbs(stats.normalize(t.clone()))
    return t


class Pass:
    """Adds batches into the states of one checkpoint on one worker, for one evaluation.

    ``model``: the backend that answers the task's requests (``core.backends``), or a torch
    module, which the default backend (hf) serves. The task gets the backend and a frozen
    ``Context`` of what it reads (spec, output size, tokenizer, generation, batch, device),
    never the pass."""

    def __init__(self, model: torch.nn.Module | Backend, metrics: list[tuple[str, Metric]],
                 size: int, device: torch.device, task: tasks.Task | str = "classification",
                 buckets: int = 1, spec=None, text=None, generation: Generation = Generation(),
                 batch: int = 256, samples: bool = False, on_rows=None,
                 share: bool = True, tokens: int = 8192):
        self.backend = model if isinstance(model, Backend) else backends.of_model(model, device)
        self.metrics = metrics
        self.task = tasks.get(task) if isinstance(task, str) else task
        self.text = text                   # the hf.Tokenizer (text tasks)
        self.context = Context(spec=spec or DatasetSpec(path=""), task=self.task.name,
                               needs=self.task.needs, size=size, text=text,
                               generation=generation, batch=batch, tokens=tokens,
                               share=share, device=device,
                               progress=self.partly)
        self.acc = Accumulator(metrics, size, buckets, device, self.task.counts_tokens)
        self.pending: list = []            # batches a task that batches by length holds back
        self.pending_rows = 0
        self.held = self.task.held_rows(self.context.spec)
        self.scored_rows = 0               # rows scored and added (not only read)
        self.on_rows = on_rows             # called with the rows scored so far
        self.scoring = 0                   # rows in the scoring under way
        self.records = [] if samples else None     # per-item records (Task.keeps_records)

    @property
    def states(self) -> dict[str, torch.Tensor]:
        """The states of the rows scored so far (``finish`` scores and adds any held back)."""
        return self.acc.states

    def abandon(self) -> dict[str, torch.Tensor]:
        """The states as they stand, of a pass that failed: nothing held back is scored or
        added (it may be what failed); every rank still reduces states of the same shapes."""
        self.pending, self.pending_rows = [], 0
        return self.acc.abandon()

    def update(self, x: tasks.Inputs, y: torch.Tensor, buckets: torch.Tensor | None = None
               ) -> None:
        if y.shape[0] == 0:
            return
        if buckets is None:
            buckets = torch.zeros(y.shape[0], dtype=torch.int64)
        if self.held:
            # Text tasks score many batches' requests together, sorted by length: fewer
            # forward passes padded to a common length.
            self.pending.append((x, y, buckets))
            self.pending_rows += y.shape[0]
            if self.pending_rows >= self.held:
                self.finish()
            return
        self._score(x, y, buckets)

    def finish(self) -> None:
        """Score every batch held back and add every contribution held; call it once the pass
        has seen its last batch."""
        if self.pending:
            held, self.pending, self.pending_rows = self.pending, [], 0
            self._score(self.task.join([h[0] for h in held]), torch.cat([h[1] for h in held]),
                        torch.cat([h[2] for h in held]))
        self.acc.flush()

    def partly(self, done: int, total: int) -> None:
        """A task's scoring reports its requests done: the rows scored so far, counting the
        batch under way in proportion (a text task scores up to ``group_rows`` at once)."""
        if self.on_rows is not None and total:
            self.on_rows(self.scored_rows + self.scoring * done // total)

    def score(self, x: tasks.Inputs, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch's (outputs, targets) as the task scores them, added to nothing."""
        return self.task.score(self.backend, x, y, self.context)

    def _score(self, x, y, buckets) -> None:
        with torch.inference_mode():
            self.scoring = int(y.shape[0])
            out, y = self.score(x, y)
            tokens = self.task.scored_tokens(out, y) if self.task.counts_tokens else None
            self.acc.add(out, y, buckets, tokens)
            if self.records is not None:
                batch = self.task.item_records(x, out)
                batch.update(item_values(self.metrics, out, y))
                self.records.append(batch)
            self.scored_rows += int(y.shape[0])
            self.scoring = 0
            if self.on_rows is not None:
                self.on_rows(self.scored_rows)

    def sample_table(self):
        """The per-item records of every row scored so far, one row per item (a pyarrow
        Table), or None when the pass keeps none."""
        if self.records is None:
            return None
        from rayeval.core.samples import records_table

        return records_table(self.records)


def item_values(metrics: list[tuple[str, Metric]], outputs, targets) -> dict[str, list]:
    """Each item's value of each metric that has one: the metric's own ``rows`` and
    ``compute`` on the item alone (accuracy 1 or 0, a document's perplexity). Metrics over
    the whole set only (F1, a confusion matrix, a custom metric) have none."""
    out: dict[str, list] = {}
    n = int(targets.shape[0])
    for key, m in metrics:
        rows_fn = getattr(m, "rows", None)
        if not (m.scalar and rows_fn and getattr(m, "batched_compute", False)):
            continue
        with metric_errors(key, "on an item"):
            parts = rows_fn(outputs, targets)
            if not all(isinstance(c, torch.Tensor) and tuple(c.shape) == (n,)
                       for c in parts.values()):
                continue
            values = torch.as_tensor(m.compute(parts), dtype=torch.float64).reshape(-1)
        if values.shape[0] == n:
            out[key] = values.tolist()
    return out


def compute(metrics, states, size: int, bootstrap: Bootstrap = OFF) -> dict[str, float]:
    """Point values only (tests and the reference path)."""
    return {k: r.value for k, r in finalize(metrics, states, size, bootstrap).items()}


def evaluate(model: torch.nn.Module, batches: Iterable, metrics: list[tuple[str, Metric]],
             size: int, device: torch.device | None = None,
             task: tasks.Task | str = "classification", buckets: int = 1
             ) -> dict[str, torch.Tensor]:
    """All batches through one model: the states of one pass (no collectives). Batches are
    (inputs, targets) or (inputs, targets, row buckets)."""
    p = Pass(model, metrics, size, torch.device("cpu") if device is None else device, task,
             buckets)
    for batch in batches:
        p.update(*batch)
    p.finish()
    return p.states


def decoded_batches(evaluation: EvalSpec, info: DatasetInfo, base_dir: str = "",
                    batch_size: int | None = None):
    """Every row of an evaluation as (inputs, targets, row buckets) batches, in one process:
    the single-process reference path."""
    from rayeval.io.data import read_batches

    decode = Decoder(evaluation, info, base_dir)
    for batch in read_batches(info, evaluation.dataset, batch_size or evaluation.batch_size):
        yield decode(batch)
