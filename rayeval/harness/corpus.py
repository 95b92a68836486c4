"""Corpus BLEU, chrF and TER as exact sum states: lm-eval's (and lmms-eval's) ``bleu``,
``chrf``, ``chrf++`` and ``ter`` aggregations.

Those aggregations call sacrebleu's corpus score on every document's (reference, prediction)
pair, and sacrebleu's corpus score is a function of sums: it extracts each segment's
statistics (BLEU: hypothesis and reference lengths, matched and total n-grams for n = 1..4;
chrF: character and word n-gram matches and totals; TER: edits and reference length), adds them
up and scores the sums. rayeval does the same with the sums kept as exact states: each worker
turns a document's pair into its statistics (``statistics``: sacrebleu's own extraction, on
the pair formatted by the library's own ``_sacreformat``), the states add them over documents,
buckets and workers, and the score is sacrebleu's on the total (``score``). The figure is the
library's at any worker count, and the bootstrap's replicates are weighted sums of the bucket
states like any metric's: 1,000 replicates cost 1,000 scorings of a short list of numbers,
not 1,000 corpus scores over every sentence (``harness.items``, the path any other own
aggregation takes).
"""

from __future__ import annotations

import functools

from rayeval import compat

# lm-eval's aggregation function name -> (rayeval metric, its sacrebleu scorer's arguments).
# corpus_bleu, corpus_chrf and corpus_ter with their defaults, as the aggregations call them
# (chrf++: word_order=2).
KINDS = {"bleu": ("lm_bleu", ("BLEU", {})),
         "chrf": ("lm_chrf", ("CHRF", {})),
         "chrfpp": ("lm_chrfpp", ("CHRF", {"word_order": 2})),
         "ter": ("lm_ter", ("TER", {}))}
METRICS = {metric: scorer for metric, scorer in KINDS.values()}


@functools.lru_cache(maxsize=None)
def scorer(metric: str):
    """sacrebleu's metric object for rayeval metric ``metric`` (``lm_bleu``, ...)."""
    import sacrebleu

    name, kwargs = METRICS[metric]
    return getattr(sacrebleu, name)(**kwargs)


@functools.lru_cache(maxsize=None)
def width(metric: str) -> int:
    """How many statistics a segment has: BLEU 10, chrF 18, chrF++ 24, TER 2."""
    return len(compat.sacrebleu_statistics(scorer(metric), ["a b"], [["a b"]])[0])


def statistics(metric: str, item, formatting) -> list[float]:
    """One document's statistics from its value (the (reference, prediction) pair the task's
    ``process_results`` gives), formatted by the library's ``_sacreformat`` as its
    aggregation formats the whole list."""
    refs, preds = formatting([item[0]], [item[1]])
    return [float(v) for v in compat.sacrebleu_statistics(scorer(metric), preds, refs)[0]]


def score(metric: str, sums) -> float:
    """sacrebleu's corpus score from summed statistics (integers where they are whole, as
    sacrebleu's own sums of counts are)."""
    return compat.sacrebleu_score(scorer(metric), [int(v) if float(v).is_integer() else float(v)
                                                   for v in sums])


def with_corpus(metrics_module, aggregations: dict) -> dict:
    """``aggregations`` (function name -> (rayeval metric, columns)) and the corpus scores
    the library's ``api.metrics`` (``metrics_module``) defines."""
    return {**aggregations, **{fn: (metric, width(metric)) for fn, (metric, _) in KINDS.items()
                               if hasattr(metrics_module, fn)}}
