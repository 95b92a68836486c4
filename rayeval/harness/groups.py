"""lm-eval groups: which members' metrics a group's aggregate averages.

lm-eval's ``Group.aggregate`` decides, for each metric a group aggregates, the filters and the
leaf tasks that take part; this module says the same of rendered tasks, as the pairs the plan's
group cells (``plan.groups``) average from the members' stored rows. lmms-eval's groups use it
too: ``lmms.render`` states what lmms-eval aggregates as a ``Group``'s aggregates, and its
rendered tasks have the attributes read here (``lm_keys``, ``metrics``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rayeval.config import names
from rayeval.config.schema import GroupMetric, GroupSpec

if TYPE_CHECKING:
    from rayeval.harness.requests import Rendered    # or lmms.render's: the same attributes


@dataclass
class Group:
    """An lm-eval group: its leaf tasks and what its aggregate averages."""
    name: str
    leaves: list[str]
    aggregates: list          # [(metric, filter_list or None, weight_by_size)]


def _filters(group: Group, members: dict[str, "Rendered"], metric: str) -> list[str]:
    """Every filter a leaf task has ``metric`` under, in the leaves' order."""
    return list(dict.fromkeys(
        f for t in group.leaves if t in members
        for m, f in map(names.split_key, members[t].lm_keys) if m == metric))


def group_metrics(group: Group, members: dict[str, "Rendered"]) -> list[tuple]:
    """What a group's aggregate holds, as lm-eval's ``Group.aggregate`` computes it: for each
    aggregated metric and each filter (its filter_list, else every filter a leaf task has it
    under), the leaves that have it. [(key, [(task, member key)], weight_by_size, higher)]"""
    out = []
    for metric, filter_list, weight in group.aggregates:
        filters = filter_list if filter_list is not None else _filters(group, members, metric)
        for f in filters:
            lm_key = names.metric_key(metric, f)
            parts = [(t, members[t].lm_keys[lm_key]) for t in group.leaves
                     if t in members and lm_key in members[t].lm_keys]
            if not parts:
                continue
            higher = {h for t, _ in parts for k, _, _, h in members[t].metrics
                      if k == members[t].lm_keys[lm_key]}
            key = metric if len(filters) == 1 and f == names.NO_FILTER else lm_key
            out.append((key, parts, weight, higher != {False}))
    return out


def group_specs(name: str, groups: list[Group], tasks: list, path: str,
                top: str | None = None) -> list[GroupSpec]:
    """The aggregates of entry ``name``'s groups (the one the entry names first) over its
    rendered tasks (lm-eval's or lmms-eval's), whose evaluations are ``NAME/TASK``: the
    aggregate of the group the entry names (``top``; when None, the first group) is ``NAME``, a
    subgroup's ``NAME/SUB``; a group that aggregates nothing has none."""
    by_task = {t.task: t for t in tasks}
    out = []
    for i, group in enumerate(groups):
        metrics = tuple(GroupMetric(key, tuple((names.member(name, t), k) for t, k in parts),
                                    weight, higher)
                        for key, parts, weight, higher in group_metrics(group, by_task))
        if metrics:
            out.append(GroupSpec(
                name=name if (group.name == top if top is not None else i == 0)
                else names.member(name, group.name),
                members=tuple(names.member(name, t) for t in group.leaves if t in by_task),
                metrics=metrics, key_path=path))
    return out
