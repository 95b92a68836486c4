"""The naming grammar of lm-eval results, written once.

Two compound names, each with one separator:

    metric,filter   a metric of an lm-eval task under one of its filters (lm-eval's own result
                    keys: ``exact_match,strict-match``); the key drops ``,filter`` where the
                    task has a single filter (``acc``)
    NAME/TASK       a member of the group evaluated as ``NAME``: its leaf task (``mmlu/
                    mmlu_anatomy``) or subgroup; ``NAME`` alone is the group's aggregate

Plain strings, no imports: every layer that reads stored rows may parse them.
"""

from __future__ import annotations

FILTER_SEP = ","
MEMBER_SEP = "/"
NO_FILTER = "none"          # lm-eval's name for a task without filters


def metric_key(metric: str, filter_name: str) -> str:
    """lm-eval's key of a metric under a filter: ``metric,filter``."""
    return f"{metric}{FILTER_SEP}{filter_name}"


def result_key(metric: str, filter_name: str, filters: int) -> str:
    """The key a stored row carries: the metric alone when its task has one filter."""
    return metric if filters == 1 else metric_key(metric, filter_name)


def split_key(key: str) -> tuple[str, str | None]:
    """(metric, filter) of ``metric,filter``; (metric, None) of a key without a filter."""
    metric, sep, filter_name = key.partition(FILTER_SEP)
    return metric, (filter_name if sep else None)


def metric_of(key: str) -> str:
    """The metric's own name in a result key (``exact_match`` of ``exact_match,strict``)."""
    return split_key(key)[0]


def member(group: str, name: str) -> str:
    """The evaluation name of a group's member: ``NAME/TASK``."""
    return f"{group}{MEMBER_SEP}{name}"


def split_member(evaluation: str) -> tuple[str, str | None]:
    """(NAME, TASK) of ``NAME/TASK``; (NAME, None) of a name that is no group member."""
    group, sep, name = evaluation.partition(MEMBER_SEP)
    return group, (name if sep else None)


def group_of(evaluation: str) -> str | None:
    """The group (``NAME``) of a member's evaluation name (``NAME/TASK``), else None."""
    return split_member(evaluation)[0] if MEMBER_SEP in evaluation else None


def members(evaluations) -> set[str]:
    """The group-member rule, written once: the evaluations that are a member (``NAME/TASK``)
    of a group whose own name (``NAME``, where the group's aggregate is stored) is among
    ``evaluations`` too. A suite's aggregate counts the group, not its members again; a board
    shows the group, its members on request."""
    found = set(evaluations)
    return {e for e in found if group_of(e) in found}


def is_member(evaluation: str, group: str) -> bool:
    """Whether ``evaluation`` is a member of the group evaluated as ``group``."""
    return evaluation.startswith(group + MEMBER_SEP)
