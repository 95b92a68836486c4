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
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, NamedTuple

import torch

from rayeval.config.schema import MetricSpec
from rayeval.config.registry import Registry
from rayeval import errors
from rayeval.errors import ModelError, RegistryError, SpecError
from rayeval.io.model import import_callable

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

    def __init__(self, **params: Any):
        for key, (_typ, default) in self.params.items():
            setattr(self, key, params.get(key, default))

    @property
    def key(self) -> str:
        return self.name

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


# task -> that task's built-in metrics by name. A task's module may register its own metrics
# (``@metrics.register`` on a Metric subclass naming the task); they are there once
# rayeval.core.tasks, which imports every task module, is imported (the loader, the planner and
# the worker import it). This module does not import the tasks: they import it.
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


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    num, den = num.to(torch.float64), den.to(torch.float64)
    return torch.where(den > 0, num / den.clamp(min=1e-300), torch.full_like(num, float("nan")))


# --- classification --------------------------------------------------------------------------

class _Hits(Metric):
    """The share of rows that are right: ``hits(outputs, targets)`` says which, per row."""
    batched_compute = True

    def init_state(self, c):
        return {"correct": torch.zeros((), dtype=torch.int64),
                "total": torch.zeros((), dtype=torch.int64)}

    def rows(self, outputs, targets):
        return {"correct": self.hits(outputs, targets).to(torch.int64),
                "total": torch.ones_like(targets, dtype=torch.int64)}

    def compute(self, s):
        return _ratio(s["correct"], s["total"])


class _Classification(Metric):
    task = "classification"
    batched_compute = True


@register
class Accuracy(_Hits, _Classification):
    name = "accuracy"

    @staticmethod
    def hits(outputs, targets):
        return outputs.argmax(dim=1) == targets


@register
class TopKAccuracy(Accuracy):
    name = "top_k_accuracy"
    params = {"k": (int, 5)}

    @property
    def key(self):
        return f"top{self.k}_accuracy"

    def hits(self, outputs, targets):
        k = min(self.k, outputs.shape[1])
        return (outputs.topk(k, dim=1).indices == targets.view(-1, 1)).any(dim=1)


class _RowMean(_Classification):
    """The mean over rows of one float value per row (``per_row``)."""
    higher_is_better = False

    def init_state(self, c):
        return {"sum": torch.zeros((), dtype=torch.float64),
                "total": torch.zeros((), dtype=torch.int64)}

    def rows(self, outputs, targets):
        return {"sum": self.per_row(outputs, targets),
                "total": torch.ones_like(targets, dtype=torch.int64)}

    def compute(self, s):
        return _ratio(s["sum"], s["total"])


@register
class NLL(_RowMean):
    """Mean negative log-likelihood of the target class (log-softmax of logits, float64)."""
    name = "nll"

    @staticmethod
    def per_row(outputs, targets):
        logp = torch.log_softmax(outputs.to(torch.float64), dim=1)
        return -logp.gather(1, targets.view(-1, 1)).squeeze(1)


class _PerClass(_Classification):
    """Per-class true positives, predictions and support: enough for precision, recall, F1 and
    balanced accuracy under every averaging."""
    average = "macro"
    score = "f1"

    def init_state(self, c):
        return {k: torch.zeros(c, dtype=torch.int64) for k in ("tp", "pred", "support")}

    def rows(self, outputs, targets):
        pred = outputs.argmax(dim=1)
        return {"tp": Indexed(targets, (pred == targets).to(torch.int64)),
                "pred": Indexed(pred), "support": Indexed(targets)}

    def compute(self, s):
        tp, pred, sup = (s[k].to(torch.float64) for k in ("tp", "pred", "support"))
        if self.average == "micro":
            tp, pred, sup = tp.sum(-1), pred.sum(-1), sup.sum(-1)
        zero = torch.zeros_like(tp)
        precision = torch.where(pred > 0, tp / pred.clamp(min=1), zero)
        recall = torch.where(sup > 0, tp / sup.clamp(min=1), zero)
        f1 = torch.where(pred + sup > 0, 2 * tp / (pred + sup).clamp(min=1), zero)
        value = {"precision": precision, "recall": recall, "f1": f1}[self.score]
        if self.average == "micro":
            return torch.where(sup > 0, value, torch.full_like(value, float("nan")))
        if self.average == "weighted":
            return _ratio((value * sup).sum(-1), sup.sum(-1))
        present = ((pred + sup) > 0).to(torch.float64)        # scikit-learn's label set
        return _ratio((value * present).sum(-1), present.sum(-1))


def _per_class(score: str, average: str) -> type[_PerClass]:
    return type(f"{average.title()}{score.title()}", (_PerClass,),
                {"name": f"{average}_{score}", "average": average, "score": score})


@register
class BalancedAccuracy(_PerClass):
    """Mean recall over the classes that occur in the targets."""
    name = "balanced_accuracy"

    def compute(self, s):
        tp, sup = s["tp"].to(torch.float64), s["support"].to(torch.float64)
        present = (sup > 0).to(torch.float64)
        recall = torch.where(sup > 0, tp / sup.clamp(min=1), torch.zeros_like(tp))
        return _ratio((recall * present).sum(-1), present.sum(-1))


@register
class ConfusionMatrix(_Classification):
    """Counts[target, prediction]; stored with the results, shown by ``rayeval confusion``."""
    name = "confusion_matrix"
    scalar = False

    def init_state(self, c):
        return {"counts": torch.zeros((c, c), dtype=torch.int64)}

    def rows(self, outputs, targets):
        c = outputs.shape[1]
        return {"counts": Indexed(targets * c + outputs.argmax(dim=1))}

    def compute(self, s):
        return s["counts"]


@register
class ECE(_Classification):
    """Expected calibration error of the top-class confidence over equal-width bins."""
    name = "ece"
    higher_is_better = False
    params = {"bins": (int, 15)}

    def init_state(self, c):
        return {"count": torch.zeros(self.bins, dtype=torch.int64),
                "correct": torch.zeros(self.bins, dtype=torch.int64),
                "confidence": torch.zeros(self.bins, dtype=torch.float64)}

    def rows(self, outputs, targets):
        prob = torch.softmax(outputs.to(torch.float64), dim=1)
        conf, pred = prob.max(dim=1)
        b = (conf * self.bins).floor().clamp(max=self.bins - 1).to(torch.int64)
        return {"count": Indexed(b), "correct": Indexed(b, (pred == targets).to(torch.int64)),
                "confidence": Indexed(b, conf)}

    def compute(self, s):
        n = s["count"].to(torch.float64)
        gap = (s["correct"].to(torch.float64) - s["confidence"]).abs()
        return _ratio(gap.sum(-1), n.sum(-1))


@register
class Brier(_RowMean):
    """Mean over rows of sum over classes of (probability - one-hot target)**2."""
    name = "brier"

    @staticmethod
    def per_row(outputs, targets):
        prob = torch.softmax(outputs.to(torch.float64), dim=1)
        onehot = torch.nn.functional.one_hot(targets, prob.shape[1]).to(torch.float64)
        return ((prob - onehot) ** 2).sum(dim=1)


class _Binned(_Classification):
    """Histograms of each class's predicted probability, for positives and negatives: binned
    AUROC and AUPRC. Two classes: the positive class is 1. More: one-vs-rest, macro-averaged
    over the classes that have both positives and negatives."""
    params = {"bins": (int, 100)}

    def init_state(self, c):
        return {"pos": torch.zeros((c, self.bins), dtype=torch.int64),
                "neg": torch.zeros((c, self.bins), dtype=torch.int64)}

    def rows(self, outputs, targets):
        prob = torch.softmax(outputs.to(torch.float64), dim=1)
        c = prob.shape[1]
        b = (prob * self.bins).floor().clamp(max=self.bins - 1).to(torch.int64)
        index = torch.arange(c, device=b.device).view(1, -1) * self.bins + b
        positive = torch.nn.functional.one_hot(targets, c).to(torch.int64)
        return {"pos": Indexed(index, positive), "neg": Indexed(index, 1 - positive)}

    def compute(self, s):
        pos, neg = s["pos"].to(torch.float64), s["neg"].to(torch.float64)
        if pos.shape[-2] == 2:
            pos, neg = pos[..., 1:, :], neg[..., 1:, :]
        per_class = self._score(pos.flip(-1), neg.flip(-1))   # bins from high score to low
        valid = (pos.sum(-1) > 0) & (neg.sum(-1) > 0)
        per_class = torch.where(valid, per_class, torch.zeros_like(per_class))
        return _ratio(per_class.sum(-1), valid.to(torch.float64).sum(-1))


@register
class AUROC(_Binned):
    name = "auroc"

    @staticmethod
    def _score(pos, neg):
        # Ties within a bin count one half: the Mann-Whitney statistic on binned scores.
        neg_below = neg.sum(-1, keepdim=True) - neg.cumsum(-1)
        pairs = (pos * (neg_below + 0.5 * neg)).sum(-1)
        return pairs / (pos.sum(-1) * neg.sum(-1)).clamp(min=1)


@register
class AUPRC(_Binned):
    """Average precision (scikit-learn's step-wise definition) on binned scores."""
    name = "auprc"

    @staticmethod
    def _score(pos, neg):
        tp, fp = pos.cumsum(-1), neg.cumsum(-1)
        precision = tp / (tp + fp).clamp(min=1)
        return (pos * precision).sum(-1) / pos.sum(-1).clamp(min=1)


# --- regression ------------------------------------------------------------------------------

class _Regression(Metric):
    task = "regression"
    batched_compute = True
    higher_is_better = False
    sums = ("n", "se", "ae", "y", "yy", "p", "pp", "yp")

    def init_state(self, c):
        return {k: torch.zeros((), dtype=torch.int64 if k == "n" else torch.float64)
                for k in self.sums}

    def rows(self, outputs, targets):
        p, y = outputs.to(torch.float64), targets.to(torch.float64)
        e = p - y
        every = {"n": lambda: torch.ones_like(y, dtype=torch.int64), "se": lambda: e * e,
                 "ae": lambda: e.abs(), "y": lambda: y, "yy": lambda: y * y, "p": lambda: p,
                 "pp": lambda: p * p, "yp": lambda: y * p}
        return {k: every[k]() for k in self.sums}


@register
class MSE(_Regression):
    name = "mse"
    sums = ("n", "se")

    def compute(self, s):
        return _ratio(s["se"], s["n"])


@register
class RMSE(MSE):
    name = "rmse"

    def compute(self, s):
        return _ratio(s["se"], s["n"]).sqrt()


@register
class MAE(_Regression):
    name = "mae"
    sums = ("n", "ae")

    def compute(self, s):
        return _ratio(s["ae"], s["n"])


@register
class R2(_Regression):
    name = "r2"
    higher_is_better = True
    sums = ("n", "se", "y", "yy")

    def compute(self, s):
        n = s["n"].to(torch.float64)
        total = s["yy"] - s["y"] ** 2 / n.clamp(min=1)
        return torch.where(total > 0, 1 - s["se"] / total.clamp(min=1e-300),
                           torch.full_like(total, float("nan")))


@register
class Pearson(_Regression):
    name = "pearson"
    higher_is_better = True
    sums = ("n", "y", "yy", "p", "pp", "yp")

    def compute(self, s):
        n = s["n"].to(torch.float64)
        cov = n * s["yp"] - s["y"] * s["p"]
        var = (n * s["yy"] - s["y"] ** 2) * (n * s["pp"] - s["p"] ** 2)
        return torch.where(var > 0, cov / var.clamp(min=1e-300).sqrt(),
                           torch.full_like(cov, float("nan")))


# --- language modeling -----------------------------------------------------------------------

class _LanguageModel(Metric):
    task = "language_modeling"
    batched_compute = True

    def init_state(self, vocab):
        return {"nll": torch.zeros((), dtype=torch.float64),
                "tokens": torch.zeros((), dtype=torch.int64),
                "correct": torch.zeros((), dtype=torch.int64)}

    def rows(self, outputs, targets):
        mask = targets != IGNORE
        safe = torch.where(mask, targets, torch.zeros_like(targets))
        logp = torch.log_softmax(outputs.to(torch.float32), dim=-1)
        token_nll = -logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1).to(torch.float64)
        hit = (outputs.argmax(dim=-1) == targets) & mask
        return {"nll": (token_nll * mask).sum(dim=1), "tokens": mask.sum(dim=1),
                "correct": hit.sum(dim=1)}


@register
class TokenNLL(_LanguageModel):
    """Mean next-token negative log-likelihood over every unmasked token of the corpus."""
    name = "nll"
    higher_is_better = False

    def compute(self, s):
        return _ratio(s["nll"], s["tokens"])


@register
class Perplexity(_LanguageModel):
    """Corpus perplexity: exp(total nll / total tokens), not a mean of per-sequence values."""
    name = "perplexity"
    higher_is_better = False

    def compute(self, s):
        return _ratio(s["nll"], s["tokens"]).exp()


@register
class TokenAccuracy(_LanguageModel):
    name = "token_accuracy"

    def compute(self, s):
        return _ratio(s["correct"], s["tokens"])


# --- the text tasks of language models (see tasks/text.py for the outputs' layout) -----------

class _MultipleChoice(_Hits):
    """Outputs (rows, choices, 2): each choice's summed log-likelihood and its length in
    characters (padding choices: -inf); targets: the right choice's index."""
    task = "multiple_choice"

    def hits(self, outputs, targets):
        # argmax takes the first of equal values, as numpy's does in the harness
        return self.scores(outputs).argmax(dim=1) == targets


@register
class ChoiceAccuracy(_MultipleChoice):
    """The choice with the highest log-likelihood is the right one."""
    name = "acc"

    @staticmethod
    def scores(outputs):
        return outputs[..., 0]


@register
class ChoiceAccuracyNorm(_MultipleChoice):
    """The choice with the highest log-likelihood per character is the right one."""
    name = "acc_norm"

    @staticmethod
    def scores(outputs):
        return outputs[..., 0] / outputs[..., 1]


class _TextPerplexity(Metric):
    """Outputs (rows, 4): a document's log-likelihood, scored tokens, words and UTF-8 bytes.
    Corpus-level: total log-likelihood over total units, as the harness aggregates."""
    task = "text_perplexity"
    batched_compute = True
    higher_is_better = False
    unit = 0                       # the column of outputs counted

    def init_state(self, c):
        return {"ll": torch.zeros((), dtype=torch.float64),
                "units": torch.zeros((), dtype=torch.int64)}

    def rows(self, outputs, targets):
        return {"ll": outputs[:, 0], "units": outputs[:, self.unit].round().to(torch.int64)}

    def compute(self, s):
        return (-_ratio(s["ll"], s["units"])).exp()


@register
class TokenPerplexity(_TextPerplexity):
    name = "token_perplexity"
    unit = 1


@register
class WordPerplexity(_TextPerplexity):
    name = "word_perplexity"
    unit = 2


@register
class BytePerplexity(_TextPerplexity):
    name = "byte_perplexity"
    unit = 3


@register
class BitsPerByte(_TextPerplexity):
    name = "bits_per_byte"
    unit = 3

    def compute(self, s):
        return -_ratio(s["ll"], s["units"]) / math.log(2)


@register
class ExactMatch(_Hits):
    """Outputs (rows,): 1 where the generation, cut at the first stop string and stripped,
    equals the stripped target."""
    name = "exact_match"
    task = "generation"

    @staticmethod
    def hits(outputs, targets):
        return outputs.round() == 1


for _score in ("precision", "recall", "f1"):
    for _average in ("macro", "micro", "weighted"):
        register(_per_class(_score, _average))
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
        raise SpecError(f"unknown metric {name!r} for task {task!r}; choose from: "
                        f"{', '.join(sorted(list(known) + [a for a in ALIASES if task == 'classification']))}"
                        " or a custom 'module:Class'")
    cls = known[name]
    params = {}
    for key, value in raw.items():
        if key not in cls.params:
            allowed = ", ".join(sorted(cls.params)) or "none"
            raise SpecError(f"metric {name!r} has no parameter {key!r} (parameters: {allowed})")
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
