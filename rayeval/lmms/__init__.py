"""lmms-eval task definitions as evaluations: one vertical slice beside ``harness``.

    requests  the request table: plain columns (the chat as JSON, the images as PNG bytes), and
              the layout of a task's metrics in the rows a worker scores
    render    the driver's half: lmms-eval tasks rendered into request tables while planning
    scoring   generated texts -> lmms-eval's filters and ``process_results`` -> per-document
              float rows (the worker's half of the numbers)
    task      the worker's half: the ``lmms_eval`` task, generating through the backend's
              ``generate_images`` (a ``multiple_choice`` task: each choice's loss through
              ``choice_losses``, as lmms-eval's ``llava_hf`` scores it)
    entries   the sweep file's ``lmms_eval:`` entries rendered into evaluations (an entry kind)

Why its own package and not inside ``harness``: lmms-eval is a fork of lm-eval whose task API
differs where it matters here (chat messages instead of contexts, ``doc_to_visual``, images,
choices scored by a model's loss, its own module tree ``lmms_eval.*``); what the two share is taken from
``harness`` rather than written twice: the naming grammar (``config.names``), the request
tables in the store and the task objects sent through Ray (``harness.store``), and the
task pickling and config digest helpers (``harness.render``). It stands on harness's floor.

The slice registers itself as a plugin registers (``register``, named in the package root's
table of built-in slices, ``config.plugins.builtin``): its task, its metric and its entry kind
by reference, so no floor below this one names the package. Importing this package imports
neither lmms-eval nor torch.
"""

from rayeval.config.entries import ENTRIES

def register() -> None:
    """The ``lmms_eval`` task, its ``lm_mean`` (lm-eval's, over lmms-eval's rows) and the
    ``lmms_eval:`` entry kind, registered by reference (the task registry's import calls this,
    through ``config.plugins``)."""
    from rayeval.core import metrics
    from rayeval.core.tasks import TASKS

    TASKS.add_lazy("lmms_eval", "rayeval.lmms.task:LmmsEval", instance=True)
    # lm-eval's metric classes, allowed for this task too: a registry is a task's list of the
    # metrics it takes, whatever task a class was first written for (its ``task`` attribute
    # only says where ``@metrics.register`` files it)
    for name, cls in (("lm_mean", "LmMean"), ("lm_items", "LmItems"), ("lm_bleu", "LmBleu"),
                      ("lm_chrf", "LmChrf"), ("lm_ter", "LmTer")):
        metrics._registry("lmms_eval").add_lazy(name, f"rayeval.harness.task:{cls}")
    ENTRIES.add_lazy("lmms_eval", "rayeval.lmms.entries:LmmsEvalEntry", instance=True)
