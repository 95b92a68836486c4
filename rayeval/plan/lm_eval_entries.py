"""A sweep's ``lm_eval:`` entries: each rendered by lm-eval (``harness.render``) into a request
table that the evaluation reads as its data set.

Rendering happens while the sweep file is read (it decides the evaluations, their metrics and
groups); writing the tables into the result store does not: the parser writes nothing, and
``write_requests`` writes them when the run is planned (``execution.driver.check_inputs``).
Until then the rendered tables wait here, by the location their evaluation reads.
"""

from __future__ import annotations

from rayeval.config.reader import Reader
from rayeval.config.schema import (Bootstrap, DatasetSpec, EvalSpec, Generation, GroupMetric,
                                   GroupSpec, LmEvalSpec, MetricSpec, ModelSpec, Sweep)
from rayeval.config import names
from rayeval.harness import groups as lm_groups, store as lm_store
from rayeval.io import paths
from rayeval.plan import validation

# docs-table location -> (result store, rendered task): rendered, not yet written (lm-eval's
# tasks and lmms-eval's, ``plan.lmms_eval_entries``).
UNWRITTEN: dict[str, tuple[str, object]] = {}


def write_requests(sweep: Sweep) -> None:
    """Write the request tables of the sweep's lm-eval and lmms-eval evaluations that this
    process rendered and has not written yet (a table already in the store is kept)."""
    for ev in sweep.evals:
        rendered = ev.lm_eval is not None or ev.lmms_eval is not None
        waiting = UNWRITTEN.pop(ev.dataset.path, None) if rendered else None
        if waiting is not None:
            lm_store.write(*waiting)


def group_specs(name: str, groups: list, tasks: list, path: str,
                top: str | None = None) -> list[GroupSpec]:
    """The aggregates of entry ``name``'s groups (``harness.groups.Group``, the one the entry
    names first) over its rendered tasks (lm-eval's or lmms-eval's), whose evaluations are
    ``NAME/TASK``: the aggregate of the group the entry names (``top``; when None, the first
    group) is ``NAME``, a subgroup's ``NAME/SUB``; a group that aggregates nothing has none."""
    by_task = {t.task: t for t in tasks}
    out = []
    for i, group in enumerate(groups):
        metrics = tuple(GroupMetric(key, tuple((names.member(name, t), k) for t, k in parts),
                                    weight, higher)
                        for key, parts, weight, higher in lm_groups.group_metrics(group, by_task))
        if metrics:
            out.append(GroupSpec(
                name=name if (group.name == top if top is not None else i == 0)
                else names.member(name, group.name),
                members=tuple(names.member(name, t) for t in group.leaves if t in by_task),
                metrics=metrics, key_path=path))
    return out


class LmEvalEntries:
    """Renders the ``lm_eval:`` entries of one sweep file; collects their groups."""

    def __init__(self, r: Reader, top: dict, model: ModelSpec):
        self.r, self.top, self.model = r, top, model
        self.groups: list[GroupSpec] = []
        self._tokenizer = None

    @property
    def output(self) -> str:
        """The result store, which keeps the rendered requests (read when first needed, as
        a sweep without lm-eval entries reads it: after its evaluations)."""
        return self.r.field(Sweep, "output", self.top, "output")

    @property
    def checkpoints(self) -> tuple[str, ...]:
        return self.r.field(Sweep, "checkpoints", self.top, "checkpoints")

    def tokenizer(self):
        """The tokenizer a chat template comes from: model.tokenizer, else the first
        checkpoint folder's."""
        if self._tokenizer is None:
            from rayeval.io.hf import load_tokenizer

            folder = self.model.tokenizer
            if folder is None:
                found = [p for pattern in self.checkpoints for p in paths.glob(pattern)]
                if not found:
                    self.r.fail("checkpoints", "no checkpoint matches, so there is no "
                                               "tokenizer for the chat template")
                folder = sorted(found)[0]
            what = "model.tokenizer" if self.model.tokenizer else "checkpoints"
            self._tokenizer = load_tokenizer(folder, what=what).tokenizer
        return self._tokenizer

    def evaluation(self, m: dict, path: str, batch_size: int, bootstrap: Bootstrap,
                   samples: bool) -> list[EvalSpec]:
        """Entry ``m`` (at ``path``): one evaluation for a task; for a group, one per task
        (``NAME/TASK``) and the group's aggregates (``self.groups``)."""
        from rayeval.harness import render as lm_render      # pyarrow: only with lm_eval entries

        validation.lm_eval_entry(self.r, m, path, "lm_eval")
        spec = self.r.build(LmEvalSpec, m["lm_eval"], f"{path}.lm_eval")
        where = f"{self.r.source}: {path}.lm_eval"
        tasks, groups = lm_render.render(spec, where, self.tokenizer()
                                         if spec.apply_chat_template else None)
        common = dict(batch_size=batch_size, bootstrap=bootstrap, samples=samples,
                      lm_eval=spec, key_path=path)
        name = m["name"]
        if not groups:                                     # one task: the evaluation NAME
            return [self._one(tasks[0], name, path, common)]
        # A group: its tasks as NAME/TASK, its aggregate as NAME, a subgroup's as NAME/SUB.
        self.groups.extend(group_specs(name, groups, tasks, path))
        return [self._one(t, names.member(name, t.task), path, common) for t in tasks]

    def _one(self, task, name: str, path: str, common: dict) -> EvalSpec:
        data = f"{lm_store.location(self.output, task.digest)}/{lm_store.DOCS_FILE}"
        UNWRITTEN[data] = (self.output, task)
        # The request table's columns, read as they are (the task tokenizes them).
        dataset = DatasetSpec(path=data, inputs=("context", "target", "choices", "instances"),
                              id="doc_id", key_path=f"{path}.lm_eval")
        metrics = tuple(MetricSpec(name=kind, task="lm_eval", key=key,
                                   params=(("column", column), ("higher", higher)))
                        for key, kind, column, higher in task.metrics)
        return EvalSpec(
            name=name, task="lm_eval", dataset=dataset, metrics=metrics,
            generation=Generation(until=task.until, max_new_tokens=max(1, task.max_gen_toks),
                                  temperature=task.sampling[0], top_p=task.sampling[1],
                                  repeats=task.sampling[2]),
            **common)
