"""lm-evaluation-harness as one vertical slice, between ``core`` and ``plan``.

    names     the naming grammar of lm-eval results (``metric,filter``, ``NAME/TASK``), once
    requests  the request table: plain columns, the JSON of each document's requests, and the
              layout of a task's metrics in the rows a worker scores
    render    the driver's half: lm-eval tasks rendered into request tables while planning
    render_cache
              renderings cached by content (``content_key``): a re-run plans without lm-eval
    groups    which members' metrics an lm-eval group's aggregate averages
    store     request tables in the result store, checked against the driver's bytes before a
              run reads them, and the task objects sent to the workers through Ray
    task      the worker's half: the ``lm_eval`` task, its sum-state metrics (means,
              perplexities, corpus scores) and the metric of a task's own aggregation
    corpus    corpus BLEU, chrF and TER as sums of sacrebleu's per-segment statistics
    items     a task's own aggregation: every document's value kept in the records, the
              task's function run over them in document order, its bootstrap resamples
    entries   the sweep file's ``lm_eval:`` entries rendered into evaluations (an entry kind)

The slice registers itself as a plugin registers (``register``, named in the package root's
table of built-in slices, ``config.plugins.builtin``, and called once per process when the task
registry is first imported): its task, metrics and entry kind by reference, imported in
whichever process first asks for them; no floor below this one names the package. Importing this
package imports neither lm-eval nor torch.
"""

from rayeval.config.entries import ENTRIES

# The worker's half, by name: imported (with torch and lm-eval) when a process first asks.
METRICS = (("lm_mean", "LmMean"), ("lm_perplexity", "LmPerplexity"),
           ("lm_weighted_perplexity", "LmWeightedPerplexity"),
           ("lm_bits_per_byte", "LmBitsPerByte"), ("lm_items", "LmItems"),
           ("lm_bleu", "LmBleu"), ("lm_chrf", "LmChrf"), ("lm_chrfpp", "LmChrfpp"),
           ("lm_ter", "LmTer"))


def register() -> None:
    """The ``lm_eval`` task, its metrics and the ``lm_eval:`` entry kind, registered by
    reference (the task registry's import calls this, through ``config.plugins``)."""
    from rayeval.core import metrics
    from rayeval.core.tasks import TASKS

    TASKS.add_lazy("lm_eval", "rayeval.harness.task:Harness", instance=True)
    for name, cls in METRICS:
        metrics._registry("lm_eval").add_lazy(name, f"rayeval.harness.task:{cls}")
    ENTRIES.add_lazy("lm_eval", "rayeval.harness.entries:LmEvalEntry", instance=True)
