"""The sweep file's ``lmms_eval:`` entries: each rendered by lmms-eval (``render``) into a
request table that the evaluation reads as its data set, with an image column; the entry kind
this slice registers (``config.entries``), which the loader calls without naming lmms-eval.

As for ``lm_eval:`` entries (``harness.entries``): rendering happens while the sweep file is
read, writing the table into the result store when the run is planned
(``harness.store.RequestTables.prepare``, which writes every table rendered and not yet written); a
group is evaluated as its tasks (``NAME/TASK``) and its aggregate (``NAME``; a subgroup's
``NAME/SUB``) is computed from their stored rows by the plan's group cells (``plan.groups``),
averaging what lmms-eval's own run of the group averages.

An entry's ``judge: {model: FOLDER}`` is served to the tasks that ask lmms-eval's judge
(``judge_server``, docs/lmms-judges.md); it is on their evaluations (in their cells' keys).
"""

from __future__ import annotations

from rayeval.config import names
from rayeval.config.entries import EntryContext
from rayeval.config.schema import (Bootstrap, DatasetSpec, EvalSpec, Generation, JudgeSpec,
                                   LmmsEvalSpec, MetricSpec)
from rayeval.harness import store as lm_store
from rayeval.harness.entries import with_own_records
from rayeval.harness.groups import group_specs


class LmmsEvalEntry(lm_store.RequestTables):
    """The ``lmms_eval:`` entry kind: an lmms-eval task, group or tag, by name."""
    library = "lmms-eval"
    title = "lmms-eval"

    def evaluations(self, context: EntryContext, m: dict, path: str, batch_size: int,
                    bootstrap: Bootstrap, samples: bool) -> list[EvalSpec]:
        """Entry ``m`` (at ``path``): one evaluation for an lmms-eval task; for a group (or a
        tag), one per task (``NAME/TASK``), the group's aggregates in ``context.groups``."""
        from rayeval.harness import render_cache
        from rayeval.lmms import render as lmms_render     # pyarrow: only with lmms_eval entries

        r, output = context.r, context.output
        spec = r.build(LmmsEvalSpec, m["lmms_eval"], f"{path}.lmms_eval")
        judge = _judge(r, m.get("judge"), f"{path}.judge")
        where = f"{r.source}: {path}.lmms_eval"
        tasks, found = render_cache.rendering(
            "lmms-eval", spec, where,
            lambda: lmms_render.render(spec, where, judge=judge is not None), PLAIN,
            lambda: {"judge": judge is not None})      # it decides whether a judged task renders
        if judge is not None and not any(t.judged for t in tasks):
            r.fail(f"{path}.judge", f"lmms-eval task {spec.task!r} asks no judge (nothing in "
                                    "it calls lmms_eval.llm_judge or an API client); remove "
                                    "judge:")
        common = dict(batch_size=batch_size, bootstrap=bootstrap, samples=samples,
                      lmms_eval=spec, key_path=path)
        name = m["name"]
        if len(tasks) == 1 and tasks[0].task == spec.task:   # one task: the evaluation NAME
            return [_one(output, tasks[0], name, path, common, judge)]
        context.groups.extend(group_specs(name, found, tasks, path, top=spec.task))
        return [_one(output, t, names.member(name, t.task), path, common, judge)
                for t in tasks]

    def coverage(self, include_path: str | None, pattern: str | None = None) -> list:
        """Every leaf task of lmms-eval's registry (and ``include_path``'s YAMLs), built for a
        chat model as a run builds it, judged by the rules a run applies (``rules.refusal``)
        for an entry with a ``judge:``; an accepted task that asks the judge says so. A list
        of ``harness.coverage.Verdict`` (``pattern``: only the names it matches)."""
        from lmms_eval.api.task import ConfigurableTask, Task
        from lmms_eval.tasks import TaskManager

        from rayeval.harness import coverage
        from rayeval.lmms import judge_server
        from rayeval.lmms import render as lmms_render
        from rayeval.lmms import rules as lmms_rules

        def note(task, name: str) -> str:
            found = lmms_rules.judge_route(task)
            return "" if found is None else \
                f"judged ({found}): give the entry judge: {{model: FOLDER}}"

        with lmms_render._silent():
            manager = TaskManager("ERROR", include_path=include_path)
        with coverage.without_data([ConfigurableTask]), lmms_render._silent(), \
                judge_server.rendering():
            return coverage.check(
                coverage.matching(manager.all_subtasks, pattern),
                lambda name: manager.load_task_or_group([name], task_type="chat"), Task,
                lambda task, name: lmms_rules.refusal(task, name, judge=True), note,
                library="lmms-eval")


# What planning reads of a rendered task, cached by content (``harness.render_cache``): a
# re-run of an entry rendered before imports no lmms-eval.
PLAIN = ("task", "metrics", "max_new_tokens", "digest", "lm_keys", "output_type", "judged",
         "decoding")


def _judge(r, raw, path: str) -> JudgeSpec | None:
    """The entry's ``judge:`` (docs/lmms-judges.md): a model served to the task, whose own
    prompts and parsing grade; a prompt, a verdict or a baseline here would be ignored, so
    is refused; the model must be a Hugging Face folder."""
    if raw is None:
        return None
    from rayeval.io import hf

    js = r.build(JudgeSpec, raw, path, key_path=path)
    for key in ("prompt", "verdict", "baseline"):
        if getattr(js, key, None) is not None:
            r.fail(f"{path}.{key}", "an lmms_eval entry's judge is prompted and read by the "
                                    "task's own code; remove the key (docs/lmms-judges.md)")
    if not hf.is_folder(js.model):
        r.fail(f"{path}.model", f"{js.model} is not a Hugging Face folder (no config.json); "
                                "give the folder of a causal language model saved with "
                                "save_pretrained, with its tokenizer")
    return js


def _one(output: str, task, name: str, path: str, common: dict,
         judge: JudgeSpec | None = None) -> EvalSpec:
    data = f"{lm_store.location(output, task.digest)}/{lm_store.DOCS_FILE}"
    lm_store.UNWRITTEN[data] = (output, task)
    # The request table: the chat as JSON (the prompt column, templated by the checkpoint's
    # processor on the CPU stage), the images as PNG bytes, lmms-eval's doc_id as the row id.
    # A multiple_choice task's continuations too (the context is the chat's text).
    choices = "choices" if task.output_type == "multiple_choice" else None   # requests.CHOICES
    dataset = DatasetSpec(path=data, prompt="messages", images="images", target="target",
                          id="doc_id", choices=choices, key_path=f"{path}.lmms_eval")
    metrics = tuple(MetricSpec(name=kind, task="lmms_eval", key=key,
                               params=(("column", column), ("higher", higher)))
                    for key, kind, column, higher in task.metrics)
    # lmms-eval's huggingface model stops at the end-of-sequence token or max_new_tokens
    # (it does not apply a task's ``until``): so does this evaluation.
    # The judge only on the tasks that ask one: the others' keys do not change with it.
    return EvalSpec(name=name, task="lmms_eval", dataset=dataset, metrics=metrics,
                    generation=Generation(until=(), max_new_tokens=max(1, task.max_new_tokens),
                                          **task.decoding),
                    judge=judge if task.judged else None,
                    **with_own_records(common, task.metrics))
