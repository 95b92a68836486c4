"""An lmms-eval task that samples (temperature 1, top_p 0.9, ``repeats: 3``, one filter taking
the first answer and one voting with lmms-eval's ``majority_vote``, as the self-consistency
tasks and MM-Vet's sampled judging do) on the Hugging Face backend: each document's repeat is
drawn with its own seed (``core.backends.base.Sampler``), so one process at batch size 1 and
a Ray run on 3 workers at batch size 16 give the same responses, figures and intervals.

lmms-eval's own run cannot be the reference draw for draw: its Hugging Face model samples from
one generator for the whole batch. The draws of one item alone are checked in
tests/models/test_vlm_backend.py; lmms-eval's filters and process_results run unchanged on
the three answers (``lmms.scoring``).
"""

import dataclasses
import os

import pytest
import yaml

pytest.importorskip("transformers")
pytest.importorskip("lmms_eval")
pytest.importorskip("easy_vqa")

from lmms_reference import OFFLINE_ENV, TASK, write_task  # noqa: E402
from support import single_process_passes  # noqa: E402
from vlm_support import easy_vqa_items  # noqa: E402

from rayeval.core.evaluate import finalize  # noqa: E402
from rayeval.io.data import read_batches  # noqa: E402
from rayeval.io.store import ResultStore  # noqa: E402
from rayeval.plan.loader import load_sweep  # noqa: E402
from rayeval.ranking import latest_rows  # noqa: E402

for _key, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_key, _value)

N = 8
REPEATS = 3
METRICS = ("exact_match", "answer_chars", "upper_chars")
FILTERS = ("none", "vote")


@pytest.fixture(scope="module")
def example(tmp_path_factory, tiny_vlm):
    root = tmp_path_factory.mktemp("lmms_sampling")
    path = write_task(str(root / "tasks"), easy_vqa_items("test", n=N, seed=0))
    text = open(path).read()
    sampled = text.replace("  temperature: 0\n  do_sample: false\n",
                           f"  temperature: 1.0\n  top_p: 0.9\n  do_sample: true\n"
                           f"repeats: {REPEATS}\n")
    sampled = sampled.replace("  - name: lower\n    filter:\n      - function: lowercase\n",
                              "  - name: vote\n    filter:\n      - function: majority_vote\n")
    assert sampled.count("repeats:") == 1 and "name: vote" in sampled
    open(path, "w").write(sampled)
    os.makedirs(root / "ckpts")
    os.symlink(tiny_vlm, root / "ckpts" / "checkpoint-1")
    (root / "sweep.yaml").write_text(yaml.safe_dump({
        "name": "sampled-vqa", "checkpoints": ["ckpts/checkpoint-*"], "output": "results",
        "workers": 3, "bootstrap": {"replicates": 200},
        "evals": [{"name": "vqa", "batch_size": 16,
                   "lmms_eval": {"task": TASK, "include_path": "tasks"}}]}))
    return root


def test_the_task_samples_its_repeats(example):
    (ev,) = load_sweep(str(example / "sweep.yaml")).evals
    g = ev.generation
    assert (g.temperature, g.top_p, g.repeats) == (1.0, 0.9, REPEATS)


@pytest.mark.ray
def test_one_process_at_batch_1_equals_3_workers_at_batch_16(example, standing, lmms_suite):
    from rayeval.execution.driver import run_sweep

    sweep = load_sweep(str(example / "sweep.yaml"))
    report = run_sweep(dataclasses.replace(sweep, output=str(example / "ray")), standing=standing)
    assert all(o.ok for o in report.outcomes), [o.error for o in report.outcomes]
    rows = {r["metric"]: r for r in latest_rows(ResultStore(str(example / "ray")).read())}
    assert sorted(rows) == sorted(f"{m},{f}" for m in METRICS for f in FILTERS)
    assert {r["world_size"] for r in rows.values()} == {3}
    for _, ev, _, decode, p, metrics in single_process_passes(sweep):
        for table in read_batches(ev.data, ev.spec.dataset, 1):
            p.update(*decode(table))
        p.finish()
        results = finalize(metrics, p.states, ev.output_size, ev.spec.bootstrap)
        assert sorted(results) == sorted(rows)
        for key, r in results.items():
            assert (float(r.value), float(r.ci_low), float(r.ci_high)) == \
                (rows[key]["value"], rows[key]["ci_low"], rows[key]["ci_high"]), key
    import rayeval

    records = rayeval.samples(str(example / "ray"), checkpoint="checkpoint-1",
                              evaluation="vqa").to_pylist()
    assert sorted(r["id"] for r in records) == list(range(N))
    # it sampled: the first answers are not lmms-eval's greedy ones (its own run of the same
    # task, model and items at temperature 0: tests/lmms_reference.py, "single")
    greedy = {s["doc_id"]: s["filtered_resps"]
              for s in lmms_suite["reference"]["single"]["samples"]["none"]}
    assert sorted(greedy) == list(range(N))
    assert sum(r["response"] != greedy[r["id"]] for r in records) > N // 2
