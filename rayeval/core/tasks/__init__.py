"""Tasks as types: what a kind of evaluation needs from its data and its model.

A task owns everything that used to be tested by string across the code base: the columns it
needs and their checks, turning a pyarrow batch into model inputs, row ids for the bootstrap,
scoring a batch through a backend (``core.backends``: a task never touches the model), the
model's output size, the metrics it allows, its fields in
the content key, and what its data set needs in the sweep file.

Adding a task is adding one module here: a Task subclass registered with
``@TASKS.register(instance=True)``, and the metrics it allows, registered with
``@metrics.register`` (a Metric subclass whose ``task`` is the task's name). Every module of this
package whose name does not start with ``_`` is imported below, in name order, so the module is
the whole change (with the README's task list and its tests).

    base   the Task base class and the tensor tasks: classification, regression, language
           modeling over token ids
    rows   what the tasks call on a batch's rows and a data set's columns: counting, taking,
           pinning, a transform's output checked, NaN or infinite inputs named
    text   the text tasks of language models, scored as lm-evaluation-harness scores them:
           multiple_choice, text_perplexity, generation
    vision generation and multiple_choice with images (``dataset.images``): image+text items
           of vision-language models; these two tasks are registered here, with both paths

lm_eval, an lm-evaluation-harness task's rendered requests, lives in its own package above this
one (``rayeval.harness``), and lmms_eval, an lmms-eval task's, in ``rayeval.lmms``; each
registers itself by reference when this package is imported (``config.plugins.load_builtins``),
so that core never imports nor names them.
"""

import importlib
import pkgutil

from rayeval.config import plugins as _plugins

from rayeval.core.tasks.base import (TASKS, TOKENS, Classification, Inputs, LanguageModeling,
                                     Recorded, Regression, Task, check_finite_inputs,
                                     inputs_of, map_inputs, nbytes, pin, rows_of, take,
                                     concat)
# The plain torch helpers a task used to call itself now live with the backends; named here
# too for the callers that move a batch or probe a model (the driver, a sharded replica).
from rayeval.core.backends.torch import call_model, logits_of, move, repeat
from rayeval.core.tasks.text import Generation, MultipleChoice, TextPerplexity

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")

# The slices above core (lm-eval's ``lm_eval``, lmms-eval's ``lmms_eval``, with their metrics)
# register themselves by reference, as a plugin does: the package root names them
# (``config.plugins.builtin``) and this registry's import has them registered, after the tasks
# above, so that every process that can look a task up finds them; core names none of them.
_plugins.load_builtins()


def get(name: str) -> Task:
    """The task called ``name``; a RegistryError listing the tasks if there is none."""
    return TASKS.get(name)


__all__ = ["TASKS", "TOKENS", "Inputs", "Recorded", "Task", "get", "call_model",
           "check_finite_inputs", "inputs_of", "logits_of", "map_inputs", "move", "nbytes",
           "pin", "repeat", "rows_of"]
