"""The request table: what the result store keeps of a rendered lm-eval task, as plain data.

One row per document of the task:

    doc_id     the document's index in lm-eval's ``eval_docs`` (the bootstrap keys on it)
    context    the first request's context, as the model sees it (for the per-item record)
    target     ``doc_to_target`` as text (for the record)
    choices    a multiple-choice document's choices, as text (for the record)
    instances  the document's requests as JSON: the request type and, per request, its
               arguments, index and repeats (lm-eval's ``Instance`` less the document)

Nothing in it is a pickle: a table read back from a shared store is data, never code. A worker
rebuilds each ``Instance`` from the JSON and the document from the task object the driver sent
it through Ray (``task.lm_task``), and the driver checks the stored file's bytes against the
ones it rendered (``store.check_stored``) before a run reads it.

Also the layout of a task's metrics in the float rows a worker scores, which the driver needs
to plan the metrics and the worker to fill them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa

from rayeval.config import names
from rayeval.harness import corpus
from rayeval.harness.items import ITEMS


# What a rendered task is, below the modules that render (render), store (store) and group
# (groups) it: each of the three names it.
@dataclass
class Rendered:
    """One lm-eval task, rendered: the request table and what scoring it needs."""
    task: str                 # lm-eval's task name
    output_type: str
    table: pa.Table
    blob: bytes               # the task, pickled without its requests (sent through Ray)
    metrics: list             # [(key, metric name, first column, higher_is_better)]
    until: tuple[str, ...]
    max_gen_toks: int
    digest: str
    lm_keys: dict             # lm-eval's "metric,filter" -> the metric's key here
    sampling: tuple = (0.0, 1.0, 1)      # (temperature, top_p, repeats); 0: greedy
    lm: object = None         # the task itself, in the process that rendered it


COLUMNS = ("doc_id", "context", "target", "choices", "instances")
# lm-eval's aggregation function name -> (rayeval metric, columns per document): those that
# are functions of sums (and corpus BLEU, chrF, TER: ``corpus``, sums of their statistics).
# Any other aggregation is the task's own function over every item (``items``: the
# ``lm_items`` metric, its column unused).
AGGREGATIONS = {"mean": ("lm_mean", 1), "perplexity": ("lm_perplexity", 1),
                "weighted_perplexity": ("lm_weighted_perplexity", 2),
                "bits_per_byte": ("lm_bits_per_byte", 2)}
WIDTH = {**dict(AGGREGATIONS.values()), ITEMS: 1}


def width(kind: str) -> int:
    """The columns a document's row gives metric ``kind``."""
    return WIDTH[kind] if kind in WIDTH else corpus.width(kind)


def table_schema() -> pa.Schema:
    return pa.schema([("doc_id", pa.int64()), ("context", pa.string()), ("target", pa.string()),
                      ("choices", pa.list_(pa.string())), ("instances", pa.string())])


def encode(kind: str, instances: list) -> str:
    """A document's requests (lm-eval ``Instance`` objects) as JSON, without the document.
    A request whose arguments are not JSON (no text task of lm-eval has one) is a TypeError
    for the renderer to report."""
    return json.dumps({"type": kind, "requests": [
        {"args": list(inst.args), "idx": int(inst.idx), "repeats": inst.repeats}
        for inst in instances]}, sort_keys=True)


def kind_of(encoded: str) -> str:
    """The request type of an encoded document (lm-eval's ``OUTPUT_TYPE`` of its task)."""
    return json.loads(encoded)["type"]


def arguments(encoded: str) -> list[tuple]:
    """Each request's arguments, as lm-eval's ``Instance.args`` gives them (tuples)."""
    return [tuple(r["args"]) for r in json.loads(encoded)["requests"]]


def instances(encoded: str, doc, doc_id: int, task_name: str) -> list:
    """lm-eval ``Instance`` objects again, from the JSON and the document."""
    from lm_eval.api.instance import Instance

    found = json.loads(encoded)
    return [Instance(request_type=found["type"], doc=doc, arguments=tuple(r["args"]),
                     idx=int(r["idx"]), metadata=(task_name, int(doc_id), r["repeats"]))
            for r in found["requests"]]


def filter_names(task) -> list[str]:
    return [f.name for f in getattr(task, "_filters", None) or []] or [names.NO_FILTER]


def layout(task) -> list[tuple[str, str, int, bool]]:
    """(result key, rayeval metric, first column, higher is better) of each metric of an
    lm-eval task under each of its filters, in lm-eval's order (``metric_layout``)."""
    import lm_eval.api.metrics as lm_metrics

    return metric_layout(task, lm_metrics, AGGREGATIONS)


def metric_layout(task, metrics_module, aggregations: dict) -> list[tuple[str, str, int, bool]]:
    """(result key, rayeval metric, first column, higher is better) of each metric of a task
    of lm-eval or of its fork lmms-eval (``metrics_module``: that library's ``api.metrics``,
    whose functions the task's ``aggregation()`` names) under each of its filters, in the
    task's order; ``aggregations``: function name -> (rayeval metric, columns per document).
    Keys are lm-eval's metric names, with ``,filter`` where the task has more than one filter;
    an aggregation not in ``aggregations`` is the task's own (``items.ITEMS``)."""
    aggregations = corpus.with_corpus(metrics_module, aggregations)
    known = {getattr(metrics_module, fn): fn for fn in aggregations}
    filters = filter_names(task)
    higher = task.higher_is_better() or {}
    out, column = [], 0
    for filter_name in filters:
        for metric, agg in task.aggregation().items():
            fn = known.get(agg)
            kind, width = aggregations[fn] if fn is not None else (ITEMS, WIDTH[ITEMS])
            key = names.result_key(metric, filter_name, len(filters))
            out.append((key, kind, column, bool(higher.get(metric, True))))
            column += width
    return out


def aggregations(task, metrics_module, aggregations: dict) -> dict:
    """{result key: the task's aggregation function} of each metric ``metric_layout`` gives
    the task's own aggregation (``items.ITEMS``)."""
    known = {getattr(metrics_module, fn) for fn in corpus.with_corpus(metrics_module,
                                                                       aggregations)}
    filters = filter_names(task)
    return {names.result_key(metric, f, len(filters)): agg
            for f in filters for metric, agg in task.aggregation().items() if agg not in known}


def function_name(fn) -> str:
    """A task's aggregation by name, the same in every process (a ``functools.partial`` by its
    function's name, never an address)."""
    inner = getattr(fn, "func", None)
    name = getattr(fn, "__name__", None) or getattr(inner, "__name__", None)
    return name or str(fn)
