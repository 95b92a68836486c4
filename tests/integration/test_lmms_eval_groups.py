"""An lmms-eval group as rayeval evaluations, against lmms-eval's own run of the group.

Two tasks of the kind ``tests/lmms_reference.py`` writes (easy-vqa items, two filters, three
mean metrics), of different sizes (4 and 6 items), and a group YAML over them that aggregates
``answer_chars`` weighted by size and ``upper_chars`` not (``exact_match`` is not aggregated).
The entry ``vqa`` naming the group becomes the evaluations ``vqa/TASK`` and the group's
aggregate ``vqa``, computed from the members' stored rows. lmms-eval aggregates a group its own
way (``consolidate_group_results``: every filter of a metric whose name contains an
aggregate_metric_list entry's metric; ``lmms.render._aggregates``). The model is the tiny
untrained Idefics3 of ``tests/vlm_support.py``; the reference is ``python -m lmms_eval --model
huggingface --tasks GROUP`` at batch size 1, float32. rayeval runs on one real local Ray with 2
workers: every member's figures and the group's equal lmms-eval's.
"""

import dataclasses
import os

import pytest
import yaml

pytest.importorskip("transformers")
pytest.importorskip("lmms_eval")
pytest.importorskip("easy_vqa")

from lmms_reference import (FILTERS, GROUP, GROUP_AGGREGATED, GROUP_TASKS,  # noqa: E402
                            OFFLINE_ENV)

from rayeval.io.store import ResultStore  # noqa: E402
from rayeval.plan.loader import load_sweep  # noqa: E402
from rayeval.ranking import latest_rows  # noqa: E402

for _key, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_key, _value)

TASKS = GROUP_TASKS                   # task -> its items (easy-vqa test items, seeds 1, 2)
NAME = "vqa"
METRICS = ("exact_match", "answer_chars", "upper_chars")
AGGREGATED = GROUP_AGGREGATED         # metric -> weight_by_size


@pytest.fixture(scope="module")
def example(tmp_path_factory, lmms_suite):
    """The sweep over the model and the group's include folder of the run's lmms-eval
    references (``lmms_suite``: made once, with test_lmms_eval_tasks' task); its store goes
    here."""
    root = tmp_path_factory.mktemp("lmms_group")
    ckpts = os.path.join(os.path.dirname(lmms_suite["model"]), "checkpoint-*")
    (root / "sweep.yaml").write_text(yaml.safe_dump({
        "name": "vqa", "checkpoints": [ckpts], "output": "results",
        "workers": 2, "evals": [{"name": NAME, "batch_size": 4,
                                 "lmms_eval": {"task": GROUP,
                                               "include_path": lmms_suite["tasks"]["group"]}}]}))
    return root


@pytest.fixture(scope="module")
def reference(lmms_suite):
    """lmms-eval's own run of the group at batch size 1 (``python -m lmms_eval --tasks
    GROUP``, tests/lmms_reference.py)."""
    return lmms_suite["reference"]["group"]


def _keys(metrics) -> list[str]:
    return sorted(f"{m},{f}" for m in metrics for f in FILTERS)


def test_the_plan_holds_each_task_and_the_group(example):
    """Planning alone (no Ray): the evaluations NAME/TASK and the group NAME over them."""
    sweep = load_sweep(str(example / "sweep.yaml"))
    assert [e.name for e in sweep.evals] == [f"{NAME}/{t}" for t in TASKS]
    assert all(sorted(m.key for m in e.metrics) == _keys(METRICS) for e in sweep.evals)
    (group,) = sweep.groups
    assert group.name == NAME and group.members == tuple(f"{NAME}/{t}" for t in TASKS)
    assert sorted(gm.key for gm in group.metrics) == _keys(AGGREGATED)
    for gm in group.metrics:
        assert gm.parts == tuple((f"{NAME}/{t}", gm.key) for t in TASKS)
        assert gm.weight_by_size == AGGREGATED[gm.key.split(",")[0]]
        assert gm.higher_is_better is False


def test_the_reference_is_not_degenerate(reference):
    """The members' answer lengths differ (so weighting by size changes the group's figure),
    and lmms-eval's group holds the aggregated metrics alone."""
    a, b = (reference["members"][t]["results"]["answer_chars,none"] for t in TASKS)
    assert a != b
    assert [reference["members"][t]["n"] for t in TASKS] == list(TASKS.values())
    assert reference["subtasks"] == list(TASKS)
    group = reference["results"]
    assert sorted(k for k in group if "," in k and "_stderr" not in k) == _keys(AGGREGATED)


@pytest.fixture(scope="module")
def ray_store(example, standing):
    from rayeval.execution.driver import run_sweep

    sweep = load_sweep(str(example / "sweep.yaml"))
    out = example / "store2"
    report = run_sweep(dataclasses.replace(sweep, workers=2, output=str(out)),
                       standing=standing)
    assert all(o.ok for o in report.outcomes), report.outcomes
    return out


@pytest.mark.ray
def test_ray_run_of_the_group_equals_lmms_eval(reference, ray_store):
    rows = latest_rows(ResultStore(str(ray_store)).read())
    by_eval: dict[str, dict] = {}
    for r in rows:
        by_eval.setdefault(r["evaluation"], {})[r["metric"]] = r
    assert sorted(by_eval) == sorted([NAME, *(f"{NAME}/{t}" for t in TASKS)])
    for task, n in TASKS.items():                       # every member's figures
        theirs = reference["members"][task]["results"]
        mine = by_eval[f"{NAME}/{task}"]
        assert sorted(mine) == _keys(METRICS)
        for key, r in mine.items():
            assert r["world_size"] == 2 and r["num_samples"] == n
            assert r["value"] == pytest.approx(theirs[key], abs=1e-12), (task, key)
    theirs = reference["results"]                       # the group's aggregate
    mine = by_eval[NAME]
    assert sorted(mine) == _keys(AGGREGATED)
    for key, r in mine.items():
        assert r["num_samples"] == sum(TASKS.values())
        assert r["value"] == pytest.approx(theirs[key], abs=1e-12), key
        assert r["ci_low"] <= r["value"] <= r["ci_high"]
