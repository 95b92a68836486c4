"""The sweep file's ``lm_eval:`` entries: each rendered by lm-eval (``render``) into a request
table that the evaluation reads as its data set; the entry kind this slice registers
(``config.entries``), which the loader calls without naming lm-eval.

Rendering happens while the sweep file is read (it decides the evaluations, their metrics and
groups); writing the tables into the result store does not: the parser writes nothing, and
``store.RequestTables.prepare`` writes them when the run is planned. Until then the rendered tables
wait in ``store.UNWRITTEN``, by the location their evaluation reads.
"""

from __future__ import annotations

from rayeval.config import names
from rayeval.config.entries import EntryContext
from rayeval.config.schema import (Bootstrap, DatasetSpec, EvalSpec, Generation, JudgeSpec,
                                   LmEvalSpec, MetricSpec)
from rayeval.harness import store as lm_store
from rayeval.harness.groups import group_specs
from rayeval.io import paths


class LmEvalEntry(lm_store.RequestTables):
    """The ``lm_eval:`` entry kind: an lm-eval task or group, by name."""
    library = "lm-eval"
    title = "lm-evaluation-harness"

    def evaluations(self, context: EntryContext, m: dict, path: str, batch_size: int,
                    bootstrap: Bootstrap, samples: bool) -> list[EvalSpec]:
        """Entry ``m`` (at ``path``): one evaluation for a task; for a group, one per task
        (``NAME/TASK``) and the group's aggregates (``context.groups``)."""
        from rayeval.harness import render_cache
        from rayeval.harness import render as lm_render      # pyarrow: only with lm_eval entries

        r = context.r
        spec = r.build(LmEvalSpec, m["lm_eval"], f"{path}.lm_eval")
        # a judge grades the task's generations as a generation evaluation's (docs/judges.md);
        # the loader checks it as it checks theirs
        judge = None if m.get("judge") is None else \
            r.build(JudgeSpec, m["judge"], f"{path}.judge", key_path=f"{path}.judge")
        where = f"{r.source}: {path}.lm_eval"

        def render():
            return lm_render.render(spec, where, tokenizer(context)
                                    if spec.apply_chat_template else None)

        tasks, groups = render_cache.rendering("lm-eval", spec, where, render, PLAIN,
                                       (lambda: chat_tokenizer(context))
                                       if spec.apply_chat_template else None)
        if judge is not None:
            graded = [t for t in tasks if t.output_type != "generate_until"]
            if graded:
                r.fail(f"{path}.judge", f"lm-eval task {graded[0].task!r} is "
                                        f"{graded[0].output_type}, not generate_until: a judge "
                                        "grades generated answers; remove judge:")
        common = dict(batch_size=batch_size, bootstrap=bootstrap, samples=samples,
                      lm_eval=spec, key_path=path)
        name = m["name"]
        if not groups:                                     # one task: the evaluation NAME
            return [_one(context.output, tasks[0], name, path, common, judge)]
        # A group: its tasks as NAME/TASK, its aggregate as NAME, a subgroup's as NAME/SUB.
        context.groups.extend(group_specs(name, groups, tasks, path))
        return [_one(context.output, t, names.member(name, t.task), path, common, judge)
                for t in tasks]

    def coverage(self, include_path: str | None, pattern: str | None = None) -> list:
        """Every leaf task of lm-eval's registry (and ``include_path``'s YAMLs) judged by the
        rules a run applies (``render.refusal``): a list of
        ``coverage.Verdict`` (``pattern``: only the names it matches)."""
        from lm_eval.api.task import ConfigurableTask, Task
        from lm_eval.tasks import TaskManager

        from rayeval.harness import coverage
        from rayeval.harness import render as lm_render

        with lm_render.quiet():
            manager = TaskManager(include_path=include_path)
        with coverage.without_data([ConfigurableTask]), lm_render.quiet():
            return coverage.check(coverage.matching(manager.all_subtasks, pattern),
                                  lambda name: manager.load([name]), Task,
                                  lm_render.refusal)


def tokenizer(context: EntryContext):
    """The tokenizer a chat template comes from: model.tokenizer, else the first checkpoint
    folder's; loaded once per sweep file."""
    if "tokenizer" not in context.cache:
        from rayeval.io.hf import load_tokenizer

        folder = context.model.tokenizer
        if folder is None:
            found = [p for pattern in context.checkpoints for p in paths.glob(pattern)]
            if not found:
                context.r.fail("checkpoints", "no checkpoint matches, so there is no "
                                              "tokenizer for the chat template")
            folder = sorted(found)[0]
        what = "model.tokenizer" if context.model.tokenizer else "checkpoints"
        context.cache["tokenizer"] = load_tokenizer(folder, what=what).tokenizer
    return context.cache["tokenizer"]


# What planning reads of a rendered task, cached by content (``render_cache``): a re-run of an entry
# rendered before imports no lm-eval.
PLAIN = ("task", "output_type", "metrics", "until", "max_gen_toks", "digest", "lm_keys",
         "sampling")


def chat_tokenizer(context: EntryContext) -> dict:
    """What a chat template's rendering depends on of the tokenizer
    (``content_key.tokenizer_files``), from its folder, without loading it."""
    from rayeval.harness.content_key import NotKeyed, tokenizer_files

    folder = context.model.tokenizer
    if folder is None:
        found = [p for pattern in context.checkpoints for p in paths.glob(pattern)]
        if not found:
            raise NotKeyed("no checkpoint")
        folder = sorted(found)[0]
    return tokenizer_files(folder)


def with_own_records(common: dict, metrics) -> dict:
    """An evaluation's settings with per-item records kept where a metric of the task is its
    own aggregation (``items.ITEMS``: the records hold the values it runs over)."""
    from rayeval.harness.items import ITEMS

    own = any(kind == ITEMS for _, kind, _, _ in metrics)
    return {**common, "samples": common["samples"] or own}


def _one(output: str, task, name: str, path: str, common: dict,
         judge: JudgeSpec | None = None) -> EvalSpec:
    data = f"{lm_store.location(output, task.digest)}/{lm_store.DOCS_FILE}"
    lm_store.UNWRITTEN[data] = (output, task)
    # The request table's columns, read as they are (the task tokenizes them).
    dataset = DatasetSpec(path=data, inputs=("context", "target", "choices", "instances"),
                          id="doc_id", key_path=f"{path}.lm_eval")
    metrics = tuple(MetricSpec(name=kind, task="lm_eval", key=key,
                               params=(("column", column), ("higher", higher)))
                    for key, kind, column, higher in task.metrics)
    if judge is not None:          # the judge stage's metric, after the task's own
        from rayeval.core.judge import JUDGE

        metrics += (MetricSpec(name=JUDGE, task="generation", key=JUDGE),)
        common = {**common, "samples": True, "judge": judge}   # it reads the generations
    return EvalSpec(
        name=name, task="lm_eval", dataset=dataset, metrics=metrics,
        generation=Generation(until=task.until, max_new_tokens=max(1, task.max_gen_toks),
                              temperature=task.sampling[0], top_p=task.sampling[1],
                              repeats=task.sampling[2]),
        **with_own_records(common, task.metrics))
