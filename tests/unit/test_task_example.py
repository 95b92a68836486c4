"""The worked task of docs/tasks-and-metrics.md ("Writing a task"), run as the page shows it:
its requests go to a backend, its responses become outputs, its metric's states give the
accuracy, and a row counted on another shard merges by addition."""

import os
import re

import pytest
import torch

from rayeval.core import backends
from rayeval.core.backends import Backend
from rayeval.core.evaluate import Pass, compute
from rayeval.core.metrics import REGISTRY
from rayeval.core.tasks import TASKS
from rayeval.core.tasks.text import TextBatch

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "tasks-and-metrics.md")


def example_source() -> str:
    text = open(DOC, encoding="utf-8").read()
    return re.search(r"<!-- example: yes_no -->\n```python\n(.*?)```", text, re.S).group(1)


class Scripted(Backend):
    """Log-likelihoods from a table, keyed by the continuation's tokens: yes=[1], no=[2]."""
    name = "test_scripted"

    def __init__(self, table):
        super().__init__(backends.Setup())
        self.table, self.asked = table, []

    def loglikelihood(self, requests, ctx):
        self.asked += requests
        return [(self.table[(tuple(c), tuple(a))], False) for c, a in requests]


@pytest.fixture
def example():
    saved_tasks, saved_metrics = dict(TASKS._items), REGISTRY.get("yes_no")
    exec(compile(example_source(), DOC, "exec"), {"__name__": "yes_no_example"})
    yield TASKS.get("yes_no")
    TASKS._items = saved_tasks
    if saved_metrics is None:
        REGISTRY.pop("yes_no", None)


def _merge(parts):
    """What the all-reduce does: states summed, key by key."""
    if isinstance(parts[0], dict):
        return {k: _merge([p[k] for p in parts]) for k in parts[0]}
    return sum(parts[1:], parts[0])


def test_the_documented_task_scores_through_a_backend(example):
    # three questions (contexts [7], [8], [9]); the model prefers yes, no, yes
    table = {((7,), (1,)): -0.2, ((7,), (2,)): -1.5, ((8,), (1,)): -2.0, ((8,), (2,)): -0.3,
             ((9,), (1,)): -0.1, ((9,), (2,)): -0.4}
    rows = [[([c], [1]), ([c], [2])] for c in (7, 8, 9)]
    answers = torch.tensor([1, 0, 0])                 # yes, no, no
    metric = [("accuracy", REGISTRY["yes_no"]["accuracy"]())]
    states = []
    for shard in (slice(0, 1), slice(1, 3)):          # two workers' rows, merged by addition
        backend = Scripted(table)
        p = Pass(backend, metric, 0, torch.device("cpu"), "yes_no")
        p.update(TextBatch(rows[shard], [None] * len(rows[shard])), answers[shard])
        p.finish()
        assert backend.asked == [pair for pairs in rows[shard] for pair in pairs]
        states.append(p.states)
    merged = {name: _merge([s[name] for s in states]) for name in states[0]}
    # right, right, wrong (a task that swapped yes and no would give 1/3)
    assert compute(metric, merged, 0)["accuracy"] == pytest.approx(2 / 3)
    assert example.first_tokens(TextBatch(rows, [None] * 3)) == [7, 1]
