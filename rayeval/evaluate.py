"""One checkpoint's pass over one worker's rows: model outputs into metric states.

Plain torch, no Ray and no collectives: the worker calls this between its loads and its one
all-reduce, and the single-process reference calls it over all rows.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .errors import CheckpointError, DataError, ModelError
from .metrics import Metric

ROWS = "_rows"   # the row count every cell keeps, checked against the data set before publishing


def num_classes(model: torch.nn.Module, input_shape: tuple[int, ...],
                device: torch.device) -> int:
    """The number of classes the model predicts, from one forward pass on zeros."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    try:
        with torch.inference_mode():
            out = model(torch.zeros((1, *input_shape), device=device, dtype=dtype))
    except Exception as e:
        raise ModelError(f"model.factory: the model cannot take inputs of shape "
                         f"(batch, {', '.join(map(str, input_shape))}) from dataset.inputs: "
                         f"{type(e).__name__}: {e}") from None
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ModelError(f"model.factory: the model returns {shape}; classification needs "
                         "logits of shape (batch, classes)")
    return int(out.shape[1])


def new_states(metrics: Iterable[tuple[str, Metric]], classes: int,
               device: torch.device = torch.device("cpu")) -> dict[str, torch.Tensor]:
    """Zero states for every metric, namespaced ``key/state``, plus the row count."""
    states = {ROWS: torch.zeros((), dtype=torch.int64, device=device)}
    for key, metric in metrics:
        for name, t in metric.init_state(classes).items():
            states[f"{key}/{name}"] = t.to(device)
    return states


def _view(states: dict[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    prefix = key + "/"
    return {k[len(prefix):]: v for k, v in states.items() if k.startswith(prefix)}


class Pass:
    """Adds batches into the states of one checkpoint on one worker."""

    def __init__(self, model: torch.nn.Module, metrics: list[tuple[str, Metric]], classes: int,
                 device: torch.device):
        self.model = model
        self.metrics = metrics
        self.classes = classes
        self.device = device
        self.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                          torch.float32)
        self.states = new_states(metrics, classes, device)
        self.views = [(m, _view(self.states, key)) for key, m in metrics]

    @torch.inference_mode()
    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if y.numel() == 0:
            return
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= self.classes:
            bad = lo if lo < 0 else hi
            raise DataError(f"dataset.target: class index {bad} is outside the model's "
                            f"{self.classes} classes [0, {self.classes}); fix the labels or "
                            "the model's output size")
        x = x.to(self.device, self.dtype, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        out = self.model(x)
        if not bool(torch.isfinite(out).all()):
            raise CheckpointError("the model produced NaN or infinite outputs with this "
                                  "checkpoint")
        out = out.float()
        for metric, state in self.views:
            metric.update(state, out, y)
        self.states[ROWS] += y.numel()


def compute(metrics: list[tuple[str, Metric]], states: dict[str, torch.Tensor]
            ) -> dict[str, float]:
    """Metric values from merged states."""
    return {key: float(m.compute(_view(states, key))) for key, m in metrics}


def evaluate(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
             metrics: list[tuple[str, Metric]], classes: int,
             device: torch.device = torch.device("cpu")) -> dict[str, torch.Tensor]:
    """All batches through one model: the states of one pass (no collectives)."""
    p = Pass(model, metrics, classes, device)
    for x, y in batches:
        p.update(x, y)
    return p.states
