"""The metric interface: additive states, their per-row contributions, the compute from their sum.

Every metric, built-in or a task module's, is a ``Metric`` subclass; the package's ``__init__``
holds the registry and the parsing of ``metrics:`` entries.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

# Part of every cell's content key: raise it whenever a built-in metric's numbers change, so a
# fixed metric never serves a stale cached value.
VERSION = 2
IGNORE = -100           # the target value of masked (padding / ignored) language-model positions


class Indexed(NamedTuple):
    """Sparse per-row contributions: row i adds ``value[i, j]`` (1 when value is None) at flat
    position ``index[i, j]`` of the state."""
    index: torch.Tensor                  # (rows,) or (rows, m) int64
    value: torch.Tensor | None = None    # same shape, or None for ones


class Metric:
    """Base class: a named set of additive states and a compute from their sum."""

    name: ClassVar[str] = ""
    task: ClassVar[str] = ""
    higher_is_better: ClassVar[bool] = True
    params: ClassVar[dict[str, tuple[type, Any]]] = {}   # name -> (type, default)
    scalar: ClassVar[bool] = True          # False: a matrix, stored but not ranked or resampled
    batched_compute: ClassVar[bool] = False  # compute() accepts a leading replicate dimension
    resampled: ClassVar[bool] = True       # False: a count, stored without an interval
    # Racing (``select:``, core/racing.py) bounds a mean of per-item values in this range
    # (the states' ``total`` counts the items); None: cannot race.
    race_range: ClassVar[tuple[float, float] | None] = None

    def __init__(self, **params: Any):
        for key, (_typ, default) in self.params.items():
            setattr(self, key, params.get(key, default))

    @property
    def key(self) -> str:
        return self.name

    def race_bounds(self, key: str) -> tuple[float, float] | None:
        """The range of this metric's per-item values when stored under ``key``, if it is
        their mean (racing bounds it: core/racing.py); None: it cannot be raced."""
        return self.race_range

    def init_state(self, num_classes: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def rows(self, outputs: torch.Tensor, targets: torch.Tensor):
        return None

    def update(self, state, outputs, targets) -> None:
        contributions = self.rows(outputs, targets)
        if contributions is None:
            raise NotImplementedError(f"{type(self).__name__} implements neither update nor rows")
        for name, c in contributions.items():
            s = state[name]
            if isinstance(c, Indexed):
                value = torch.ones_like(c.index, dtype=s.dtype) if c.value is None else c.value
                s.view(-1).index_add_(0, c.index.reshape(-1), value.reshape(-1).to(s.dtype))
            else:
                s += c.sum(dim=0).to(s.dtype)

    def compute(self, state: dict[str, torch.Tensor]) -> float:
        raise NotImplementedError


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    num, den = num.to(torch.float64), den.to(torch.float64)
    return torch.where(den > 0, num / den.clamp(min=1e-300), torch.full_like(num, float("nan")))


class _Hits(Metric):
    """The share of rows that are right: ``hits(outputs, targets)`` says which, per row."""
    batched_compute = True
    race_range = (0.0, 1.0)

    def init_state(self, c):
        return {"correct": torch.zeros((), dtype=torch.int64),
                "total": torch.zeros((), dtype=torch.int64)}

    def rows(self, outputs, targets):
        return {"correct": self.hits(outputs, targets).to(torch.int64),
                "total": torch.ones_like(targets, dtype=torch.int64)}

    def compute(self, s):
        return _ratio(s["correct"], s["total"])
