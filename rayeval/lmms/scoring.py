"""Generated texts (or choices' losses) -> lmms-eval's own filters and ``process_results`` ->
per-document float rows.

What lmms-eval's evaluator does after its model answered, for the documents one worker
scored: each request's answer (a generated text; a ``multiple_choice`` task has a request per
choice, answered (loss, is_greedy)) becomes an ``Instance``'s ``resps``; each of the task's
filter ensembles (``filter_list``: ``take_first``, regexes, ``lowercase``, a task's own)
writes its ``filtered_resps``; the task's ``process_results(doc, [filtered responses])`` gives
the document's metric values, per filter. The values land in the columns
``requests.layout`` assigns; the ``lm_mean`` metric sums them and counts the documents (exact
states: any split of the documents over workers merges to the same sums). A metric the task
aggregates with its own function (``*_aggregate_results``) keeps its values whole, as JSON, in
the per-item records instead (``harness.items``).

Then, as lmms-eval's evaluator does before ``process_results``, each filtered response loses its
reasoning blocks and surrounding whitespace (``strip_reasoning_tags``): with the task's
``reasoning_tags``, else the pairs lmms-eval's command line uses by default
(``<think>``/``</think>``, ``<analysis>``/``</analysis>``); ``reasoning_tags: none`` keeps the
text as it is. The record's response is the first filter's, after that step (what lmms-eval
logs as ``filtered_resps``).

``process_results`` is called without the retry lmms-eval wraps it in (tenacity: 5 attempts,
2 s apart, up to 20 minutes): a failing document is one error naming it, at once.
"""

from __future__ import annotations

from rayeval.errors import DataError, reason
from rayeval.config import names
from rayeval.harness import corpus, items
from rayeval.harness.requests import width
from rayeval.harness.task import corpus_statistics, own_values
from rayeval.lmms.requests import filter_names, layout
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)


def documents(task):
    """The task's evaluation documents, which ``doc_id`` indexes (lmms-eval's
    ``eval_docs``), once per task object."""
    docs = getattr(task, "_rayeval_docs", None)
    if docs is None:
        docs = task._rayeval_docs = task.eval_docs
    return docs


def repeats_of(task) -> int:
    """The answers lmms-eval asks per document (the task's ``repeats``): sampled, each its own
    draw; greedy, one answer that many times."""
    return int(getattr(task.config, "repeats", None) or 1)


def instances(task, doc_ids: list[int], answers: list[list]) -> list[list]:
    """Per document, one lmms-eval ``Instance`` per request (a generation: one; a
    ``multiple_choice`` task: one per choice, in order), its responses the model's answer to
    it (a generated text, or a list of them: the task's ``repeats``; a choice's (loss,
    greedy))."""
    from lmms_eval.api.instance import Instance

    name = task.task_name
    kind = "loglikelihood" if task.OUTPUT_TYPE == "multiple_choice" else "generate_until"
    out = []
    for doc_id, given in zip(doc_ids, answers):
        doc = documents(task)[int(doc_id)]
        mine = []
        for idx, answer in enumerate(given):
            resps = answer if isinstance(answer, list) else [answer]
            inst = Instance(request_type=kind, arguments=("", None, {}, int(doc_id), name, None),
                            idx=idx, metadata={"task": name, "doc_id": int(doc_id),
                                               "repeats": len(resps)})
            inst.doc = doc
            inst.resps = resps
            mine.append(inst)
        out.append(mine)
    return out


# lmms-eval's command line default for --reasoning_tags (0.7.3, lmms_eval/__main__.py).
CLI_REASONING_TAGS = '[["<think>", "</think>"], ["<analysis>", "</analysis>"]]'


def reasoning_tags(task):
    """The tag pairs lmms-eval's run strips from each response of ``task`` (None: none)."""
    from lmms_eval.api.reasoning import parse_reasoning_tags_config

    return parse_reasoning_tags_config(cli_value=CLI_REASONING_TAGS,
                                       task_value=task.get_config("reasoning_tags"))


def without_reasoning(response, tags):
    """A filtered response (text, or a list of texts) as lmms-eval hands it to
    process_results."""
    from lmms_eval.api.reasoning import strip_reasoning_tags

    if tags is None:
        return response
    if isinstance(response, str):
        return strip_reasoning_tags(response, tags)
    if isinstance(response, list):
        return [strip_reasoning_tags(r, tags) if isinstance(r, str) else r for r in response]
    return response


def process_results(task, doc, results: list) -> dict:
    """The task's ``process_results``, without tenacity's retry around it."""
    fn = type(task).process_results
    fn = getattr(fn, "__wrapped__", fn)
    return fn(task, doc, results)


def score_documents(task, doc_ids: list[int], answers: list[list], where: str
                    ) -> tuple[torch.Tensor, list[str], list[str] | None]:
    """(one float64 row per document of its metric values in ``layout``'s columns, the first
    filter's response per document, for the records; the values of the task's own-aggregation
    metrics per document, as the records keep them, None where it has none). ``answers``:
    per document, the model's answer to each of its requests (``instances``)."""
    by_doc = instances(task, doc_ids, answers)
    every = [inst for mine in by_doc for inst in mine]
    for ensemble in getattr(task, "_filters", None) or []:
        ensemble.apply(every, task.task_docs)
    columns = layout(task)
    filters = filter_names(task)
    tags = reasoning_tags(task)
    out = torch.zeros((len(by_doc), max((col + width(kind) for _, kind, col, _ in columns),
                                       default=0)), dtype=torch.float64)
    responses = []
    own = [key for key, kind, _, _ in columns if kind == items.ITEMS]
    kept = [] if own else None
    for i, mine in enumerate(by_doc):
        inst = mine[0]
        values, first = {}, None
        for name in filters:
            got = [without_reasoning(one.filtered_resps.get(name, one.resps[0]), tags)
                   for one in mine]
            first = got[0] if first is None else first
            try:
                result = process_results(task, inst.doc, got)
            except Exception as error:
                raise DataError(f"{where}: lmms-eval's process_results failed on document "
                                f"{inst.doc_id}: {reason(error, typed=True)}") from None
            for metric, value in result.items():
                values[names.result_key(metric, name, len(filters))] = value
        for key, kind, col, _ in columns:
            if key not in values:
                raise DataError(f"{where}: lmms-eval's process_results gave no "
                                f"{names.metric_of(key)!r} for document {inst.doc_id}")
            if kind in corpus.METRICS:           # the pair's sacrebleu statistics
                stats = corpus_statistics(kind, values[key], "lmms_eval")
                out[i, col:col + len(stats)] = torch.tensor(stats, dtype=torch.float64)
            elif kind != items.ITEMS:            # kept whole in the records (``items``)
                out[i, col] = _number(values[key], key, inst.doc_id, where)
        if own:
            kept.append(own_values(values, own, where, inst.doc_id, "lmms-eval"))
        responses.append(first if isinstance(first, str) else str(first))
    return out, responses, kept


def _number(value, key: str, doc_id, where: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise DataError(f"{where}: lmms-eval's process_results gave {key!r} of document "
                        f"{doc_id} as {type(value).__name__}, not a number; a mean of "
                        "numbers is what rayeval merges") from None
