"""A task's own aggregation: lm-eval's and lmms-eval's metrics that are not a function of sums.

A task whose aggregation is not a mean or a perplexity (``requests.AGGREGATIONS``: those merge
as exact sums) aggregates with a function over every document's value at once: lm-eval's
``f1``, ``matthews_corrcoef``, ``bleu``, ``chrf``, ``ter``, ``median``, a YAML's ``!function``,
lmms-eval's ``*_aggregate_results`` (MMMU's per-subject accuracies, MME's paired questions,
POPE's F1). rayeval runs that function itself, once per cell, as the tools' evaluators do:

- each worker keeps every document's value of such a metric (what the task's
  ``process_results`` gave it, any JSON value) in the cell's per-item records, column
  ``values`` (so the evaluation keeps records: ``samples`` is on for it);
- once the cell's records are all written, rank 0 reads them back, puts the values in document
  order (the order of one process of lm-eval or lmms-eval) and calls the task's function on
  them (``aggregate``): the figure is the tool's at any worker count;
- its bootstrap interval resamples the same documents as every other metric of the run: in
  replicate b, a document appears w times, w the Poisson weight of its row bucket
  (``core.stats``), and the function runs on each replicate's list (in document order). The
  resamples depend on document ids only: the same for every checkpoint (paired) and any
  number of workers. That is ``bootstrap.replicates`` calls of the function per metric and
  cell (a function that takes 10 ms on a cell: 10 s at the default 1,000 replicates; lower
  ``bootstrap.replicates`` where that is too slow).

A replicate whose function fails (an empty class in an F1) counts as missing (NaN), as the
percentile interval drops NaNs; the function failing on the whole set fails the cell, naming
the metric.
"""

from __future__ import annotations

import inspect
import json
import math

VALUES = "values"           # the per-item records' column: {metric key: value} as JSON
ITEMS = "lm_items"          # the metric of such a key (``task.LmItems``)
_TUPLE = "__tuple__"        # a tuple in a value (JSON has lists only): tagged, read back as one


def encode(values: dict) -> str:
    """One document's values of its own-aggregation metrics, as JSON (tuples tagged, numpy
    scalars and arrays as plain values). A value JSON cannot hold is a TypeError naming it."""
    return json.dumps(_plain(values), sort_keys=True, ensure_ascii=False, allow_nan=True)


def decode(text: str) -> dict:
    return json.loads(text, object_hook=_untag)


def _plain(value):
    if isinstance(value, tuple):
        return {_TUPLE: [_plain(v) for v in value]}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "tolist"):        # a numpy array or scalar, a tensor
        return _plain(value.tolist())
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"a {type(value).__name__}")


def _untag(obj: dict):
    if len(obj) == 1 and _TUPLE in obj:
        return tuple(obj[_TUPLE])
    return obj


def call(fn, items: list, args=None):
    """The aggregation ``fn`` on ``items`` as the tool's evaluator calls it: lmms-eval passes
    the run's arguments to a function that takes ``args``."""
    try:
        takes_args = "args" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_args = False
    return fn(items, args=args) if takes_args else fn(items)


def aggregate(fn, ids: list[int], values: list, bootstrap, args=None
              ) -> tuple[float, list[float] | None, float | None, float | None]:
    """(value, replicates, ci_low, ci_high) of aggregation ``fn`` over ``values`` (one per
    document, any order) of the documents ``ids``: the value from every document in id
    order, the replicates from the run's resamples (``bootstrap``: its ``Bootstrap``)."""
    import torch

    from rayeval.core import stats

    order = sorted(range(len(ids)), key=lambda i: ids[i])
    ids = [ids[i] for i in order]
    values = [values[i] for i in order]
    value = _float(call(fn, values, args))
    if not bootstrap.enabled or not values:
        return value, None, None, None
    buckets = stats.buckets_of(torch.tensor(ids, dtype=torch.int64), bootstrap.seed,
                               bootstrap.k)
    weights = stats.poisson_weights(bootstrap.seed, bootstrap.k, bootstrap.replicates)
    counts = weights[:, buckets].tolist()              # replicates x documents
    replicates = []
    for per_doc in counts:
        drawn = [v for v, c in zip(values, per_doc) for _ in range(c)]
        try:
            replicates.append(_float(call(fn, drawn, args)) if drawn else math.nan)
        except Exception:             # noqa: BLE001 - a resample the function cannot take
            replicates.append(math.nan)
    low, high = stats.percentile_interval(torch.tensor(replicates, dtype=torch.float64),
                                          bootstrap.confidence)
    return value, replicates, low, high


def _float(value) -> float:
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"the aggregation returned a {type(value).__name__}, not a "
                        "number") from None
