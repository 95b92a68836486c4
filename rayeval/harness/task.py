"""lm-evaluation-harness tasks: the worker's half (the driver's is ``render``).

A row is one document of an lm-eval task, rendered on the driver: its requests (plain JSON,
``requests.py``), the context and the target as text. The worker rebuilds lm-eval's
``Instance`` objects from them and the task object the driver sent it through Ray (never
from the store), tokenizes the requests as lm-eval's Hugging Face model does (the text tasks'
tokenizer conventions), scores them on rayeval's model path (any checkpoint layout, sharded
models) and hands the responses back to lm-eval's own code: the task's filters
(``apply_filters``' filter ensembles) and ``process_results(doc, responses)``, per filter.
Each document then contributes one float row of its metric values, in the columns
``requests.layout`` assigns, and the metrics below reduce those rows into exact sum states
(so they merge over workers and resample for the bootstrap like every other metric):

    lm_mean                 sum of the values / documents               lm-eval's ``mean``
    lm_perplexity           exp(-sum / documents)                       ``perplexity``
    lm_weighted_perplexity  exp(-sum(a) / sum(b)), two columns a, b    ``weighted_perplexity``
    lm_bits_per_byte        -sum(a) / sum(b) / ln 2                     ``bits_per_byte``
"""

from __future__ import annotations

import math
from typing import ClassVar

from rayeval.core import metrics as M
from rayeval.core.tasks.text import TextBatch, TextTask, rolling_windows
from rayeval.errors import DataError
from rayeval.config import names
from rayeval.harness import corpus, items, store
from rayeval.harness import requests as request_table    # (score's ``requests`` are its own)
from rayeval.harness.requests import COLUMNS, filter_names, layout
from rayeval.io import data
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)


def lm_task(data_location: str):
    """The lm-eval task a request table was rendered from: the driver's own, or the one it
    sent this worker with the plan (``store.receive``); never read from the store."""
    task = store.task_for(data_location)
    if task is None:
        raise DataError(f"{data_location}: the lm-eval task rendered for these requests did "
                        "not come with the plan; run the sweep again to render it")
    return task


def check_request_table(spec, schema, columns, tool: str) -> None:
    """A data set that an lm-eval or lmms-eval (``tool``) entry reads is a request table its
    renderer wrote: every one of ``columns`` there, else one line naming the first missing."""
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise DataError(f"{spec.key_path}: {spec.path} is not a request table rendered "
                        f"from an {tool} task (no column {missing[0]!r})")


def _docs(task):
    """The task's documents (lm-eval's ``eval_docs``, which ``doc_id`` indexes), once."""
    docs = getattr(task, "_rayeval_docs", None)
    if docs is None:
        docs = task._rayeval_docs = task.eval_docs
    return docs


def _instances(task, extra) -> list:
    """A document's lm-eval ``Instance`` objects, from its JSON requests and its document."""
    doc_id, encoded = extra
    name = getattr(task, "task_name", None) or task.get_config("task")
    return request_table.instances(encoded, _docs(task)[doc_id], doc_id, name)


class Harness(TextTask):
    name = "lm_eval"
    generates = True
    needs_target = False
    group_rows = 1024

    def spec_problem(self, spec):
        return None

    def row_positions(self, spec) -> bool:
        return False            # a record's id is lm-eval's doc_id: the document's position

    def only_generates(self, spec) -> bool:
        return lm_task(spec.dataset.path).OUTPUT_TYPE == "generate_until"

    def limited_from(self, spec) -> int | None:
        """The task's document count where the entry's ``limit:`` scored only the first ones
        (its cells are stored as num_samples of that many); None: every document."""
        return store.limited_from(spec.dataset.path)

    def check_schema(self, spec, schema):
        check_request_table(spec, schema, COLUMNS, "lm-eval")

    def check_values(self, ds, spec, size):
        pass

    def row_ids(self, table, spec, x, y):
        return data.id_values(table, "doc_id", f"{spec.key_path}.doc_id")

    def item_fields(self, table, spec):
        fields = {"id": data.column_array(table, "doc_id").to_pylist(),
                  "context": data.column_array(table, "context").to_pylist(),
                  "target": data.column_array(table, "target").to_pylist()}
        choices = data.column_array(table, "choices").to_pylist()
        if any(c is not None for c in choices):
            fields["choices"] = choices
        return fields

    def output_size(self, out):
        if isinstance(out, torch.Tensor) and out.dim() == 2:
            return int(out.shape[1])
        raise self.wrong_output(out)

    def tokenize(self, table, spec, tok, decoder):
        blobs = data.column_array(table, "instances").to_pylist()
        ids = data.column_array(table, "doc_id").to_pylist()
        rows, n = [], 0
        for doc_id, blob in zip(ids, blobs):
            kind, instances = request_table.kind_of(blob), request_table.arguments(blob)
            if kind in ("loglikelihood", "multiple_choice"):
                row = [tok.encode_pair(*args[:2]) for args in instances]
                _fits(row, tok.max_length, spec, doc_id)
            elif kind == "loglikelihood_rolling":
                row = [rolling_windows(tok.encode(args[0]), tok.prefix_id, tok.max_length)
                       for args in instances]
            else:
                budget = tok.max_length - decoder.generation.max_new_tokens
                if budget < 1:
                    raise DataError(f"{spec.key_path}: max_gen_toks "
                                    f"{decoder.generation.max_new_tokens} leaves no room for a "
                                    f"prompt in the model's context of {tok.max_length}")
                row = [tok.encode(args[0])[-budget:] for args in instances]
            n += 8 * sum(len(_flat(r)) for r in row) + len(blob)
            rows.append(row)
        return TextBatch(rows, list(zip(ids, blobs)), n, ids=ids)

    def first_tokens(self, x):
        first = x.rows[0][0]
        if first and isinstance(first[0], tuple):          # rolling windows
            first = first[0]
        if isinstance(first, tuple):
            return list(first[0]) + list(first[1])
        return list(first) or [0]

    def score(self, backend, x, y, ctx):
        task = lm_task(ctx.spec.path)
        kind = task.OUTPUT_TYPE
        docs = [_instances(task, e) for e in x.extra]
        flat = [inst for instances in docs for inst in instances]
        requests = [r for row in x.rows for r in row]
        if kind in ("loglikelihood", "multiple_choice"):
            resps = backend.loglikelihood(requests, ctx)
        elif kind == "loglikelihood_rolling":
            resps = backend.loglikelihood_rolling(requests, ctx)
        else:
            ids = None if x.ids is None else [i for i, row in zip(x.ids, x.rows) for _ in row]
            resps = backend.generate(requests, ids, ctx)
        for inst, resp in zip(flat, resps):
            if kind == "generate_until" and len(resp) > 1:     # sampled repeats
                inst.resps = list(resp)
            else:
                inst.resps = [resp[0] if kind == "generate_until" else resp] * max(
                    1, inst.repeats or 1)
            inst.filtered_resps = {}
        for ensemble in getattr(task, "_filters", None) or []:
            ensemble.apply(flat)
        columns = layout(task)
        filters = filter_names(task)
        width = max(col + request_table.width(kind_) for _, kind_, col, _ in columns)
        out = torch.zeros((len(docs), width), dtype=torch.float64)
        x.responses, x.lls, x.repeats = [], [], None
        own = [key for key, kind_, _, _ in columns if kind_ == items.ITEMS]
        x.values = [] if own else None
        for i, instances in enumerate(docs):
            doc = instances[0].doc
            values = {}
            for name in filters:
                got = [inst.filtered_resps.get(name, inst.resps[0]) for inst in instances]
                for metric, value in task.process_results(doc, got).items():
                    values[names.result_key(metric, name, len(filters))] = value
            for key, kind_, col, _ in columns:
                if key not in values:
                    raise DataError(f"{ctx.spec.key_path}: lm-eval's process_results gave no "
                                    f"{names.metric_of(key)!r} for document {instances[0].doc_id}")
                value = values[key]
                if kind_ == items.ITEMS:            # kept whole in the records (``items``)
                    continue
                if kind_ in corpus.METRICS:         # the pair's sacrebleu statistics
                    stats = corpus_statistics(kind_, value, "lm_eval")
                    out[i, col:col + len(stats)] = torch.tensor(stats, dtype=torch.float64)
                elif isinstance(value, (tuple, list)):
                    out[i, col], out[i, col + 1] = float(value[0]), float(value[1])
                else:
                    out[i, col] = float(value)
            if own:
                x.values.append(own_values(values, own, ctx.spec.key_path,
                                           instances[0].doc_id, "lm-eval"))
            x.responses.append(_response(kind, instances, task))
            if ctx.generation.repeats > 1 and kind == "generate_until":
                x.repeats = (x.repeats or []) + [[str(r) for r in instances[0].resps]]
            x.lls.append([float(r[0]) if isinstance(r, tuple) else float(r)
                          for r in (inst.resps[0] for inst in instances)]
                         if kind != "generate_until" else None)
        return out, y

    def item_records(self, x, out):
        records = dict(x.items)
        records["response"] = list(x.responses)
        records["loglikelihoods"] = list(x.lls)
        if x.repeats is not None:
            records["responses"] = list(x.repeats)
        if getattr(x, "values", None) is not None:
            records[items.VALUES] = list(x.values)
        return records

    def own_aggregations(self, spec, keys, records, bootstrap):
        import lm_eval.api.metrics as lm_metrics

        return own_results(lm_task(spec.dataset.path), keys, records, bootstrap, lm_metrics,
                           request_table.AGGREGATIONS, spec.key_path)


def corpus_statistics(kind: str, value, library: str) -> list[float]:
    """A document's statistics for corpus metric ``kind`` (``corpus``), its (reference,
    prediction) pair formatted by ``library``'s own ``_sacreformat`` (lm_eval, lmms_eval)."""
    import importlib

    formatting = importlib.import_module(f"{library}.api.metrics")._sacreformat
    return corpus.statistics(kind, value, formatting)


def own_values(values: dict, keys: list[str], where: str, doc_id, tool: str) -> str:
    """A document's values of its own-aggregation metrics ``keys``, as the records keep them
    (``items.encode``); a value JSON cannot hold is one line naming the metric."""
    try:
        return items.encode({k: values[k] for k in keys})
    except TypeError as e:
        raise DataError(f"{where}: {tool}'s process_results gave document {doc_id} a value "
                        f"of {e} for one of {keys}; rayeval keeps a task's own-aggregation "
                        "values as JSON (text, numbers, lists, dicts)") from None


def own_results(task, keys: list[str], records, bootstrap, metrics_module, aggregations: dict,
                where: str) -> dict:
    """``Task.own_aggregations`` of an lm-eval or lmms-eval ``task`` (its library's
    ``api.metrics`` and the aggregations that merge as sums: ``requests.aggregations``)."""
    from rayeval.core.evaluate import MetricResult, metric_errors

    if items.VALUES not in records.column_names:
        raise DataError(f"{where}: the cell's per-item records hold no {items.VALUES!r} "
                        "column for its own-aggregation metrics; evaluate it again with --force")
    fns = request_table.aggregations(task, metrics_module, aggregations)
    ids = records.column("id").to_pylist()
    values = [items.decode(v) for v in records.column(items.VALUES).to_pylist()]
    out = {}
    for key in keys:
        with metric_errors(key, "aggregating its items with the task's own function"):
            value, reps, low, high = items.aggregate(fns[key], ids, [v[key] for v in values],
                                                     bootstrap, getattr(task, "args", None))
        out[key] = MetricResult(value, low, high, reps)
    return out


def _fits(pairs, max_length: int, spec, doc_id) -> None:
    """A continuation longer than the model's context cannot be scored (lm-eval's window
    keeps the last L + 1 tokens): one line naming the task, the document and both lengths."""
    for _, cont in pairs:
        if len(cont) > max_length:
            task = lm_task(spec.path)
            name = getattr(task, "task_name", None) or task.get_config("task")
            raise DataError(f"{spec.key_path}: lm-eval task {name}, document {doc_id}: a "
                            f"continuation of {len(cont)} tokens is longer than the model's "
                            f"context of {max_length} tokens; use a model with a longer "
                            "context (model.max_length) or leave the task out")


def _flat(row) -> list:
    if isinstance(row, tuple):
        return list(row[0]) + list(row[1])
    if row and isinstance(row[0], tuple):
        return [t for w in row for t in _flat(w)]
    return list(row)


def _response(kind, instances, task) -> str:
    """What the record shows as the model's answer: the first filter's response (a
    generation), or the choice with the highest log-likelihood."""
    first = filter_names(task)[0]
    if kind == "generate_until":
        got = instances[0].filtered_resps.get(first, instances[0].resps[0])
        return got if isinstance(got, str) else str(got)
    if kind == "multiple_choice":
        lls = [inst.resps[0][0] for inst in instances]
        best = max(range(len(lls)), key=lambda j: (lls[j], -j))
        return instances[best].args[1]
    return None


# --- metrics ----------------------------------------------------------------------------------

BOUNDED = ("acc", "acc_norm", "exact_match")      # lm-eval metrics racing may bound (0/1)


class _Columns(M.Metric):
    """Sums of a document's value columns, and the document count."""
    task = "lm_eval"
    params = {"column": (int, 0), "higher": (bool, True)}
    batched_compute = True
    width: ClassVar[int] = 1

    def __init__(self, **params):
        super().__init__(**params)
        self.higher_is_better = self.higher

    def init_state(self, c):
        return {"a": torch.zeros((), dtype=torch.float64),
                "b": torch.zeros((), dtype=torch.float64),
                "total": torch.zeros((), dtype=torch.int64)}

    def rows(self, outputs, targets):
        a = outputs[:, self.column].to(torch.float64)
        b = outputs[:, self.column + 1].to(torch.float64) if self.width == 2 else \
            torch.zeros_like(a)
        return {"a": a, "b": b, "total": torch.ones(outputs.shape[0], dtype=torch.int64)}


class LmMean(_Columns):
    name = "lm_mean"

    def race_bounds(self, key):
        """lm-eval's metrics whose per-document values are 0 or 1 (a mean over repeats
        stays in [0, 1]); other means (f1, bleu, a task's own) are not known to be bounded."""
        return (0.0, 1.0) if names.split_key(key)[0] in BOUNDED else None

    def compute(self, s):
        return M._ratio(s["a"], s["total"])


class LmPerplexity(_Columns):
    name = "lm_perplexity"

    def compute(self, s):
        return torch.exp(-M._ratio(s["a"], s["total"]))


class LmWeightedPerplexity(_Columns):
    name = "lm_weighted_perplexity"
    width = 2

    def compute(self, s):
        return torch.exp(-M._ratio(s["a"], s["b"]))


class LmItems(_Columns):
    """A metric the task aggregates with its own function over every document's value
    (``harness.items``): its states only count the documents; the figure is computed from
    the cell's per-item records once they are all written (``Task.own_aggregations``)."""
    name = items.ITEMS
    batched_compute = False          # no per-item value of its own in the records
    from_items = True

    def compute(self, s):
        return float("nan")


class LmCorpus(M.Metric):
    """A corpus BLEU, chrF or TER (``corpus``): the sums of its documents' sacrebleu
    statistics (the row's columns from ``column`` on), scored by sacrebleu."""
    task = "lm_eval"
    params = {"column": (int, 0), "higher": (bool, True)}

    def __init__(self, **params):
        super().__init__(**params)
        self.higher_is_better = self.higher

    def init_state(self, c):
        return {"stats": torch.zeros(corpus.width(self.name), dtype=torch.float64)}

    def rows(self, outputs, targets):
        w = corpus.width(self.name)
        return {"stats": outputs[:, self.column:self.column + w].to(torch.float64)}

    def compute(self, s):
        return corpus.score(self.name, s["stats"].tolist())


class LmBleu(LmCorpus):
    name = "lm_bleu"


class LmChrf(LmCorpus):
    name = "lm_chrf"


class LmChrfpp(LmCorpus):
    name = "lm_chrfpp"


class LmTer(LmCorpus):
    name = "lm_ter"


class LmBitsPerByte(_Columns):
    name = "lm_bits_per_byte"
    width = 2

    def compute(self, s):
        return -M._ratio(s["a"], s["b"]) / math.log(2)
