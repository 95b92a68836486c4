"""Tasks as types: what a kind of evaluation needs from its data and its model.

A task owns everything that used to be tested by string across the code base: the columns it
needs and their checks, turning a pyarrow batch into model inputs, row ids for the bootstrap,
scoring a batch with the model, the model's output size, the metrics it allows, its fields in
the content key, and what its data set needs in the sweep file. Adding a task is adding one
class (listed in ``TASKS`` below), with metric classes that name it as their ``task``.

    base   the Task base class and the tensor tasks: classification, regression, language
           modeling over token ids
    text   the text tasks of language models, scored as lm-evaluation-harness scores them:
           multiple_choice, text_perplexity, generation
"""

from rayeval.core.tasks.base import (TOKENS, Classification, Inputs, LanguageModeling,
                                     Regression, Task, call_model, check_finite_inputs,
                                     logits_of, move, nbytes, pin, repeat, rows_of)
from rayeval.core.tasks.text import Generation, MultipleChoice, TextPerplexity

TASKS: dict[str, Task] = {t.name: t for t in (
    Classification(), Regression(), LanguageModeling(), MultipleChoice(), TextPerplexity(),
    Generation())}


def get(name: str) -> Task:
    return TASKS[name]


__all__ = ["TASKS", "TOKENS", "Inputs", "Task", "get", "call_model", "check_finite_inputs",
           "logits_of", "move", "nbytes", "pin", "repeat", "rows_of"]
