"""Metrics as mergeable states.

A metric never averages on a worker. It declares tensor *states* that merge by addition, and
computes its value once, from the states summed over every worker. Built-in and user metrics
share one interface:

    class Metric:
        higher_is_better = True
        def init_state(self, num_classes) -> dict[str, Tensor]   # zeros; int = counts, float = sums
        def update(self, state, outputs, targets) -> None        # add one batch, in place
        def compute(self, state) -> float                        # from the merged state

and may add ``rows(outputs, targets)``, each row's contribution to each state (a tensor of shape
``(rows, *state_shape)``, or an ``Indexed`` sparse form), which makes bootstrap replicates cheap
and float states exact. Built-ins implement ``rows`` and a ``compute`` that also takes states
with a leading replicate dimension.

Shapes by task: classification -- outputs (rows, classes) logits, targets (rows,) class indices;
regression -- outputs (rows,) predictions, targets (rows,) values; language modeling -- outputs
(rows, positions, vocab) logits, targets (rows, positions) next-token ids already aligned with
the outputs, ``IGNORE`` where masked.

    base                the Metric interface, Indexed contributions, VERSION, IGNORE
    classification      accuracy, per-class scores, calibration, AUROC/AUPRC, the confusion matrix
    regression          MSE, RMSE, MAE, R2, Pearson
    language_modeling   token NLL, perplexity, token accuracy
    text                the text tasks: multiple choice, text perplexity, generation

This module holds the registry, the built-ins' registration and the parsing of ``metrics:``
entries.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rayeval.config.schema import MetricSpec
from rayeval.config.reader import did_you_mean
from rayeval.config.registry import Registry
from rayeval import errors
from rayeval.errors import ModelError, RegistryError, SpecError
from rayeval.io.model import import_callable
from rayeval.core.metrics import classification, language_modeling, regression, text
# Re-exported: every built-in and the base under the names ``rayeval.core.metrics.X`` they had
# when this package was one module (tasks, the pass and the tests import them from here).
from rayeval.core.metrics.base import IGNORE, VERSION, Indexed, Metric, _Hits, _ratio
from rayeval.core.metrics.classification import (AUPRC, AUROC, ECE, NLL, Accuracy,
                                                 BalancedAccuracy, Brier, ConfusionMatrix,
                                                 TopKAccuracy)
from rayeval.core.metrics.language_modeling import Perplexity, TokenAccuracy, TokenNLL
from rayeval.core.metrics.regression import MAE, MSE, R2, RMSE, Pearson
from rayeval.core.metrics.text import (BitsPerByte, BytePerplexity, ChoiceAccuracy,
                                       ChoiceAccuracyNorm, ExactMatch, TokenPerplexity,
                                       WordPerplexity)

# task -> that task's built-in metrics by name. A task's module may register its own metrics
# (``@metrics.register`` on a Metric subclass naming the task); they are there once
# rayeval.core.tasks, which imports every task module, is imported (the loader, the planner and
# the worker import it). This package does not import the tasks: they import it.
REGISTRY: dict[str, Registry[type[Metric]]] = {}


def _registry(task: str) -> Registry[type[Metric]]:
    if task not in REGISTRY:
        REGISTRY[task] = Registry(f"metric for task {task!r}")
    return REGISTRY[task]


def register(cls: type[Metric]) -> type[Metric]:
    """Class decorator: a built-in metric, under its ``task`` and ``name``; a name its task
    already has is a RegistryError."""
    if not cls.task:
        raise RegistryError(f"metric {cls.__qualname__} names no task; set its task attribute",
                            kind="metric", name=cls.name)
    _registry(cls.task).add(cls.name, cls)
    return cls


def for_task(task: str) -> Registry[type[Metric]]:
    """The built-in metrics a task allows, by name (empty for a task without any)."""
    return REGISTRY.get(task) or Registry(f"metric for task {task!r}")


# The registry lives here, beside parse_metric and build, and not in base.py: every lookup then
# reads this module's REGISTRY, the one a test swaps for a copy to register a metric of its own.
for _cls in (*classification.BUILT_IN, *regression.BUILT_IN, *language_modeling.BUILT_IN,
             *text.BUILT_IN):
    register(_cls)
ALIASES = {"top5_accuracy": ("top_k_accuracy", {"k": 5}),
           "top1_accuracy": ("top_k_accuracy", {"k": 1})}


def build(spec: MetricSpec) -> Metric:
    """The Metric a MetricSpec names (a custom class is imported here, on the worker too)."""
    if spec.custom:
        cls = import_callable(spec.name, spec.base_dir, what="metrics")
        return CustomMetric(cls(**dict(spec.params)))
    return for_task(spec.task).get(spec.name)(**dict(spec.params))


def build_all(specs) -> list[tuple[str, Metric]]:
    return [(s.key, build(s)) for s in specs]


class CustomMetric(Metric):
    """A user's metric object behind the built-ins' interface: scalar, computed replicate by
    replicate; rows() used when the user wrote one."""

    def __init__(self, inner):
        self.inner = inner
        self.higher_is_better = bool(getattr(inner, "higher_is_better", True))
        if callable(getattr(inner, "rows", None)):
            self.rows = inner.rows

    @property
    def key(self) -> str:
        return str(getattr(self.inner, "name", "") or type(self.inner).__name__.lower())

    def init_state(self, num_classes):
        return self.inner.init_state(num_classes)

    def update(self, state, outputs, targets):
        return self.inner.update(state, outputs, targets)

    def compute(self, state):
        return float(self.inner.compute(state))


def parse_metric(item: Any, task: str, base_dir: str = "") -> MetricSpec:
    """A ``metrics:`` entry -- a name, ``{name: ..., param: ...}`` or a custom ``module:Class``
    -- as a MetricSpec, validated."""
    if isinstance(item, str):
        name, raw = item, {}
    elif isinstance(item, dict):
        if not isinstance(item.get("name"), str):
            raise SpecError(f"expected a metric name or a mapping with a 'name' key, got {item!r}")
        name, raw = item["name"], {k: v for k, v in item.items() if k != "name"}
    else:
        raise SpecError(f"expected a metric name, got {item!r} ({type(item).__name__})")
    if ":" in name:
        return _parse_custom(name, raw, task, base_dir)
    if name in ALIASES:
        name, preset = ALIASES[name]
        raw = {**preset, **raw}
    known = for_task(task)
    if name not in known:
        other = [t for t, reg in REGISTRY.items() if name in reg]
        if other:
            raise SpecError(f"metric {name!r} is for task {other[0]!r}, not {task!r}")
        names = sorted(list(known) + [a for a in ALIASES if task == "classification"])
        raise SpecError(f"unknown metric {name!r} for task {task!r}"
                        f"{did_you_mean(name, names)}; choose from: {', '.join(names)}"
                        " or a custom 'module:Class'")
    cls = known[name]
    params = {}
    for key, value in raw.items():
        if key not in cls.params:
            allowed = ", ".join(sorted(cls.params)) or "none"
            raise SpecError(f"metric {name!r} has no parameter {key!r}"
                            f"{did_you_mean(key, cls.params)} (parameters: {allowed})")
        typ, _default = cls.params[key]
        if isinstance(value, bool) or not isinstance(value, typ):
            raise SpecError(f"metric {name!r}: parameter {key!r} must be {typ.__name__}, "
                            f"got {value!r}")
        if typ is int and value < 1:
            raise SpecError(f"metric {name!r}: parameter {key!r} must be at least 1, got {value}")
        params[key] = value
    spec = MetricSpec(name=name, task=task, params=tuple(sorted(params.items())))
    return dataclasses.replace(spec, key=build(spec).key)


def _parse_custom(ref: str, raw: dict, task: str, base_dir: str) -> MetricSpec:
    try:
        cls = import_callable(ref, base_dir, what="metric")
    except ModelError as e:
        raise SpecError(e.message.split(": ", 1)[-1]) from None
    missing = [m for m in ("init_state", "compute") if not callable(getattr(cls, m, None))]
    if not (callable(getattr(cls, "update", None)) or callable(getattr(cls, "rows", None))):
        missing.append("update")
    if missing:
        raise SpecError(f"custom metric {ref!r} lacks {', '.join(missing)}; implement "
                        "init_state(num_classes), update(state, outputs, targets), compute(state)")
    try:
        metric = CustomMetric(cls(**raw))
    except TypeError as e:
        raise errors.wrap(e, SpecError, f"custom metric {ref!r}: bad parameters {raw}"
                          ) from None
    return MetricSpec(name=ref, task=task, params=tuple(sorted(raw.items())), base_dir=base_dir,
                      key=metric.key)
