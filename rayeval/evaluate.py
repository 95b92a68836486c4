"""One checkpoint's pass over one worker's rows, and the metrics from merged states.

Plain torch, no Ray and no collectives: the worker calls this between its loads and its one
all-reduce, and the single-process reference path calls it over all rows.

States are kept per row bucket (see stats.py) as int64: counts as they are, float sums as
fixed-point limbs. Everything merges by addition, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from . import stats
from .errors import CheckpointError, DataError, ModelError
from .metrics import IGNORE, Indexed, Metric

ROWS = "_rows"   # the row count every cell keeps, checked against the data set before publishing


@dataclass(frozen=True)
class Bootstrap:
    replicates: int = 1000
    confidence: float = 0.95
    seed: int = 0
    buckets: int = 1024

    @property
    def enabled(self) -> bool:
        return self.replicates > 0

    @property
    def k(self) -> int:
        """Row buckets kept per state: 1 when the bootstrap is off."""
        return self.buckets if self.enabled else 1

    @property
    def key(self) -> str:
        """How replicates were drawn; cells pair when all but the confidence agree."""
        return (f"seed={self.seed};buckets={self.buckets};replicates={self.replicates};"
                f"confidence={self.confidence}")


OFF = Bootstrap(replicates=0)


def output_size(model: torch.nn.Module, task: str, input_shape: tuple[int, ...],
                device: torch.device) -> int:
    """Classes (classification), vocabulary size (language modeling) or 1 (regression), from
    one forward pass on zeros; a model whose output does not fit the task is a ModelError."""
    if task == "language_modeling":
        probe = torch.zeros((1, 2), dtype=torch.int64, device=device)
    else:
        probe = torch.zeros((1, *input_shape), device=device, dtype=_float_dtype(model))
    try:
        with torch.inference_mode():
            out = model(probe)
    except Exception as e:
        what = "token ids of shape (batch, positions)" if task == "language_modeling" else \
            f"inputs of shape (batch, {', '.join(map(str, input_shape))})"
        raise ModelError(f"model.factory: the model cannot take {what} from dataset.inputs: "
                         f"{type(e).__name__}: {e}") from None
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if task == "classification" and isinstance(out, torch.Tensor) and out.dim() == 2:
        return int(out.shape[1])
    if task == "regression" and isinstance(out, torch.Tensor) and out.numel() == 1:
        return 1
    if task == "language_modeling" and isinstance(out, torch.Tensor) and out.dim() == 3:
        return int(out.shape[2])
    need = {"classification": "logits of shape (batch, classes)",
            "regression": "one prediction per row, shape (batch,) or (batch, 1)",
            "language_modeling": "logits of shape (batch, positions, vocab)"}[task]
    raise ModelError(f"model.factory: the model returns {shape}; task {task} needs {need}")


def _float_dtype(model: torch.nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


class Accumulator:
    """Bucketed, exact metric states for one checkpoint on one worker."""

    def __init__(self, metrics: list[tuple[str, Metric]], size: int, buckets: int = 1,
                 device: torch.device = torch.device("cpu")):
        self.metrics = metrics
        self.size = size
        self.k = buckets
        self.device = device
        self.states: dict[str, torch.Tensor] = {ROWS: torch.zeros((), dtype=torch.int64,
                                                                  device=device)}
        self.floats: set[str] = set()
        self.templates: dict[str, torch.Tensor] = {}
        for key, m in metrics:
            kb = self.k if m.scalar else 1          # matrices are stored, not resampled
            for name, t in m.init_state(size).items():
                full = f"{key}/{name}"
                self.templates[full] = t
                extra = (stats.LIMBS,) if t.dtype.is_floating_point else ()
                if extra:
                    self.floats.add(full)
                self.states[full] = torch.zeros((kb, *t.shape, *extra), dtype=torch.int64,
                                                device=device)

    def add(self, outputs: torch.Tensor, targets: torch.Tensor, buckets: torch.Tensor) -> None:
        buckets = buckets.to(self.device)
        for key, m in self.metrics:
            rows_fn = getattr(m, "rows", None)
            contributions = rows_fn(outputs, targets) if rows_fn else None
            b = buckets if m.scalar else torch.zeros_like(buckets)
            if contributions is None:
                self._add_grouped(key, m, outputs, targets, b)
                continue
            for name, c in contributions.items():
                self._scatter(f"{key}/{name}", c, b)
        self.states[ROWS] += targets.shape[0]

    def _scatter(self, name: str, c, buckets: torch.Tensor) -> None:
        state = self.states[name]
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
            target = state.view(-1, stats.LIMBS) if is_float else state.view(-1)
        else:
            flat, value, target = buckets, c, state
        if is_float:
            target.index_add_(0, flat, stats.to_limbs(value))
            stats.normalize(state)
        else:
            target.index_add_(0, flat, value.to(torch.int64))

    def _add_grouped(self, key: str, m, outputs, targets, buckets) -> None:
        """Metrics with update() only: one update per bucket present in the batch."""
        for k in torch.unique(buckets).tolist():
            mask = buckets == k
            sub = {n: t.clone().to(self.device) for n, t in m.init_state(self.size).items()}
            m.update(sub, outputs[mask], targets[mask])
            for name, t in sub.items():
                full = f"{key}/{name}"
                if full in self.floats:
                    self.states[full][k] += stats.to_limbs(t)
                    stats.normalize(self.states[full])
                else:
                    self.states[full][k] += t.to(torch.int64)


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
    weights = None
    out = {}
    for key, m in metrics:
        templates = m.init_state(size)
        local = {n: states[f"{key}/{n}"].cpu() for n in templates}
        floats = {n for n, t in templates.items() if t.dtype.is_floating_point}
        total = {n: _value(t.sum(0), n in floats) for n, t in local.items()}
        value = m.compute(total)
        if not m.scalar:
            out[key] = MetricResult(float("nan"), matrix=torch.as_tensor(value).tolist())
            continue
        result = MetricResult(float(value))
        if bootstrap.enabled:
            if weights is None:
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
        out[key] = result
    return out


def _value(t: torch.Tensor, is_float: bool) -> torch.Tensor:
    if is_float:
        return stats.from_limbs(stats.normalize(t.clone()))
    return t


class Pass:
    """Adds batches into the states of one checkpoint on one worker."""

    def __init__(self, model: torch.nn.Module, metrics: list[tuple[str, Metric]], size: int,
                 device: torch.device, task: str = "classification", buckets: int = 1):
        self.model = model
        self.task = task
        self.size = size
        self.device = device
        self.dtype = _float_dtype(model)
        self.acc = Accumulator(metrics, size, buckets, device)

    @property
    def states(self) -> dict[str, torch.Tensor]:
        return self.acc.states

    @torch.inference_mode()
    def update(self, x: torch.Tensor, y: torch.Tensor, buckets: torch.Tensor | None = None
               ) -> None:
        if y.shape[0] == 0:
            return
        self._check_targets(y)
        if self.task == "language_modeling":
            x = x.to(self.device, non_blocking=True)
        else:
            x = x.to(self.device, self.dtype, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        if x.shape[0] == 1:
            # A one-row batch takes a matrix-vector kernel whose rounding differs from the
            # matrix-matrix one; run two copies so a row's outputs do not depend on where the
            # shard boundaries fell (and published numbers on the world size).
            out = self.model(torch.cat([x, x]))[:1]
        else:
            out = self.model(x)
        if not isinstance(out, torch.Tensor) or not bool(torch.isfinite(out).all()):
            raise CheckpointError("the model produced NaN or infinite outputs with this "
                                  "checkpoint")
        if self.task == "regression":
            out = out.reshape(-1)
        elif self.task == "language_modeling":
            out, y = out[:, :-1], y[:, 1:]     # position t predicts token t + 1
        if buckets is None:
            buckets = torch.zeros(x.shape[0], dtype=torch.int64)
        self.acc.add(out.float() if self.task != "regression" else out, y, buckets)

    def _check_targets(self, y: torch.Tensor) -> None:
        if self.task == "classification":
            lo, hi = int(y.min()), int(y.max())
            if lo < 0 or hi >= self.size:
                bad = lo if lo < 0 else hi
                raise DataError(f"dataset.target: class index {bad} is outside the model's "
                                f"{self.size} classes [0, {self.size}); fix the labels or the "
                                "model's output size")
        elif self.task == "regression":
            if not bool(torch.isfinite(y).all()):
                raise DataError("dataset.target: NaN or infinite target values; drop or fill "
                                "those rows")
        else:
            real = y[y != IGNORE]
            if real.numel() and (int(real.min()) < 0 or int(real.max()) >= self.size):
                bad = int(real.min()) if int(real.min()) < 0 else int(real.max())
                raise DataError(f"dataset: token id {bad} is outside the model's vocabulary of "
                                f"{self.size}; check the tokenizer or dataset.ignore_index")


def compute(metrics, states, size: int, bootstrap: Bootstrap = OFF) -> dict[str, float]:
    """Point values only (tests and the reference path)."""
    return {k: r.value for k, r in finalize(metrics, states, size, bootstrap).items()}


def evaluate(model: torch.nn.Module, batches: Iterable, metrics: list[tuple[str, Metric]],
             size: int, device: torch.device = torch.device("cpu"),
             task: str = "classification", buckets: int = 1) -> dict[str, torch.Tensor]:
    """All batches through one model: the states of one pass (no collectives). Batches are
    (inputs, targets) or (inputs, targets, row buckets)."""
    p = Pass(model, metrics, size, device, task, buckets)
    for batch in batches:
        p.update(*batch)
    return p.states
