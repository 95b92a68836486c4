"""Metrics as mergeable states.

A metric never averages on a worker. It declares tensor *states* that merge by addition (counts,
sums, a confusion matrix), adds each batch into them, and computes its value once, from the states
summed over every worker. Built-in and user metrics share this interface:

    class Metric:
        higher_is_better: bool
        def init_state(self, num_classes) -> dict[str, Tensor]   # zeros; merged by sum
        def update(self, state, outputs, targets) -> None        # add one batch, in place
        def compute(self, state) -> float                        # from the merged state

``outputs`` are the model's logits, shape (rows, classes); ``targets`` class indices, shape (rows,).
Integer states are kept as int64: their sums do not depend on order or world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .errors import SpecError

TASKS = ("classification",)


class Metric:
    """Base class: a named set of additive states and a compute from their sum."""

    name: ClassVar[str] = ""
    higher_is_better: ClassVar[bool] = True
    params: ClassVar[dict[str, tuple[type, Any]]] = {}   # name -> (type, default)

    def __init__(self, **params: Any):
        for key, value in params.items():
            setattr(self, key, value)

    def init_state(self, num_classes: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def update(self, state: dict[str, torch.Tensor], outputs: torch.Tensor,
               targets: torch.Tensor) -> None:
        raise NotImplementedError

    def compute(self, state: dict[str, torch.Tensor]) -> float:
        raise NotImplementedError


class Accuracy(Metric):
    name = "accuracy"

    def init_state(self, num_classes):
        return {"correct": torch.zeros((), dtype=torch.int64),
                "total": torch.zeros((), dtype=torch.int64)}

    def update(self, state, outputs, targets):
        state["correct"] += (outputs.argmax(dim=1) == targets).sum()
        state["total"] += targets.numel()

    def compute(self, state):
        total = int(state["total"])
        return float(int(state["correct"]) / total) if total else float("nan")


class MacroF1(Metric):
    """Unweighted mean of per-class F1 over the classes present in targets or predictions
    (scikit-learn's ``f1_score(average="macro")``)."""

    name = "macro_f1"

    def init_state(self, num_classes):
        return {"confusion": torch.zeros((num_classes, num_classes), dtype=torch.int64)}

    def update(self, state, outputs, targets):
        c = state["confusion"].shape[0]
        pred = outputs.argmax(dim=1)
        flat = targets.to(torch.int64) * c + pred.to(torch.int64)
        state["confusion"] += torch.bincount(flat, minlength=c * c).reshape(c, c).to(
            state["confusion"].device)

    def compute(self, state):
        cm = state["confusion"].to(torch.float64)
        tp = cm.diag()
        support = cm.sum(dim=1)       # true counts per class
        predicted = cm.sum(dim=0)
        present = (support + predicted) > 0
        if not bool(present.any()):
            return float("nan")
        f1 = 2 * tp / (support + predicted).clamp(min=1)
        return float(f1[present].mean())


class NLL(Metric):
    """Mean negative log-likelihood of the target class, from logits (log-softmax in float64)."""

    name = "nll"
    higher_is_better = False

    def init_state(self, num_classes):
        return {"sum": torch.zeros((), dtype=torch.float64),
                "total": torch.zeros((), dtype=torch.int64)}

    def update(self, state, outputs, targets):
        # float64: the per-row log-likelihoods are summed over millions of rows.
        logp = torch.log_softmax(outputs.to(torch.float64), dim=1)
        state["sum"] += -logp.gather(1, targets.view(-1, 1).to(torch.int64)).sum()
        state["total"] += targets.numel()

    def compute(self, state):
        total = int(state["total"])
        return float(state["sum"]) / total if total else float("nan")


REGISTRY: dict[str, dict[str, type[Metric]]] = {
    "classification": {m.name: m for m in (Accuracy, MacroF1, NLL)},
}


@dataclass(frozen=True)
class MetricSpec:
    """A metric as the sweep names it: registry name plus validated parameters."""

    name: str
    task: str
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def key(self) -> str:
        """The name results are stored under."""
        if not self.params:
            return self.name
        return self.name + "[" + ",".join(f"{k}={v}" for k, v in self.params) + "]"

    @property
    def higher_is_better(self) -> bool:
        return REGISTRY[self.task][self.name].higher_is_better

    def build(self) -> Metric:
        return REGISTRY[self.task][self.name](**dict(self.params))


def parse_metric(item: Any, task: str) -> MetricSpec:
    """A ``metrics:`` entry (a name, or ``{name: ..., param: ...}``) as a MetricSpec."""
    if isinstance(item, str):
        name, raw_params = item, {}
    elif isinstance(item, dict):
        if "name" not in item or not isinstance(item["name"], str):
            raise SpecError("expected a metric name or a mapping with a 'name' key, "
                            f"got {item!r}")
        name = item["name"]
        raw_params = {k: v for k, v in item.items() if k != "name"}
    else:
        raise SpecError(f"expected a metric name, got {item!r} ({type(item).__name__})")
    known = REGISTRY.get(task, {})
    if name not in known:
        other = [t for t, reg in REGISTRY.items() if name in reg]
        if other:
            raise SpecError(f"metric {name!r} is for task {other[0]!r}, not {task!r}")
        raise SpecError(f"unknown metric {name!r} for task {task!r}; "
                        f"choose from: {', '.join(sorted(known))}")
    cls = known[name]
    params = {}
    for key, value in raw_params.items():
        if key not in cls.params:
            allowed = ", ".join(sorted(cls.params)) or "none"
            raise SpecError(f"metric {name!r} has no parameter {key!r} (parameters: {allowed})")
        typ, _default = cls.params[key]
        if isinstance(value, bool) or not isinstance(value, typ):
            raise SpecError(f"metric {name!r}: parameter {key!r} must be {typ.__name__}, "
                            f"got {value!r}")
        params[key] = value
    return MetricSpec(name=name, task=task, params=tuple(sorted(params.items())))
