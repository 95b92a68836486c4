"""The sweep file's ``lmms_eval:`` entries: each rendered by lmms-eval (``render``) into a
request table that the evaluation reads as its data set, with an image column; the entry kind
this slice registers (``config.entries``), which the loader calls without naming lmms-eval.

As for ``lm_eval:`` entries (``harness.entries``): rendering happens while the sweep file is
read, writing the table into the result store when the run is planned
(``harness.store.RequestTables.prepare``, which writes every table rendered and not yet written); a
group is evaluated as its tasks (``NAME/TASK``) and its aggregate (``NAME``; a subgroup's
``NAME/SUB``) is computed from their stored rows by the plan's group cells (``plan.groups``),
averaging what lmms-eval's own run of the group averages.
"""

from __future__ import annotations

from rayeval.config import names
from rayeval.config.entries import EntryContext
from rayeval.config.schema import (Bootstrap, DatasetSpec, EvalSpec, Generation, LmmsEvalSpec,
                                   MetricSpec)
from rayeval.harness import store as lm_store
from rayeval.harness.groups import group_specs


class LmmsEvalEntry(lm_store.RequestTables):
    """The ``lmms_eval:`` entry kind: an lmms-eval task, group or tag, by name."""
    library = "lmms-eval"
    title = "lmms-eval"

    def evaluations(self, context: EntryContext, m: dict, path: str, batch_size: int,
                    bootstrap: Bootstrap, samples: bool) -> list[EvalSpec]:
        """Entry ``m`` (at ``path``): one evaluation for an lmms-eval task; for a group (or a
        tag), one per task (``NAME/TASK``), the group's aggregates in ``context.groups``."""
        from rayeval.lmms import render as lmms_render     # pyarrow: only with lmms_eval entries

        r, output = context.r, context.output
        spec = r.build(LmmsEvalSpec, m["lmms_eval"], f"{path}.lmms_eval")
        tasks, found = lmms_render.render(spec, f"{r.source}: {path}.lmms_eval")
        common = dict(batch_size=batch_size, bootstrap=bootstrap, samples=samples,
                      lmms_eval=spec, key_path=path)
        name = m["name"]
        if len(tasks) == 1 and tasks[0].task == spec.task:   # one task: the evaluation NAME
            return [_one(output, tasks[0], name, path, common)]
        context.groups.extend(group_specs(name, found, tasks, path, top=spec.task))
        return [_one(output, t, names.member(name, t.task), path, common) for t in tasks]

    def sampling_problem(self, ev: EvalSpec) -> None:
        return None           # lmms-eval entries never sample (refused when rendered)


def _one(output: str, task, name: str, path: str, common: dict) -> EvalSpec:
    data = f"{lm_store.location(output, task.digest)}/{lm_store.DOCS_FILE}"
    lm_store.UNWRITTEN[data] = (output, task)
    # The request table: the chat as JSON (the prompt column, templated by the checkpoint's
    # processor on the CPU stage), the images as PNG bytes, lmms-eval's doc_id as the row id.
    dataset = DatasetSpec(path=data, prompt="messages", images="images", target="target",
                          id="doc_id", key_path=f"{path}.lmms_eval")
    metrics = tuple(MetricSpec(name=kind, task="lmms_eval", key=key,
                               params=(("column", column), ("higher", higher)))
                    for key, kind, column, higher in task.metrics)
    # lmms-eval's huggingface model stops at the end-of-sequence token or max_new_tokens
    # (it does not apply a task's ``until``): so does this evaluation.
    return EvalSpec(name=name, task="lmms_eval", dataset=dataset, metrics=metrics,
                    generation=Generation(until=(), max_new_tokens=max(1, task.max_new_tokens)),
                    **common)
