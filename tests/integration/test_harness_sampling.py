"""An lm-eval task that samples (``do_sample``, ``temperature`` 1, ``repeats: 4`` voted by
lm-eval's ``majority_vote`` filter, as gsm8k's self-consistency variants do) on the Hugging
Face backend: each document's repeat drawn with its own seed (``core.backends.base.Sampler``),
so a run on 1 worker at batch size 1 and one on 3 workers at batch size 16 give the same
generations, figures and intervals; each record's voted response is what lm-eval's own
``majority_vote`` filter picks from its repeats.

lm-eval's own run cannot be the reference here: its Hugging Face model samples from one
generator for the whole batch, so its draws change with the batch. The sampler's draws are
checked against the softmax itself in tests/unit/test_sampling.py.
"""

import os

import pytest
import yaml

import rayeval

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from harness import offline_env  # noqa: E402
from support import local_ray  # noqa: E402

from rayeval.io.store import ResultStore  # noqa: E402
from rayeval.ranking import latest_rows  # noqa: E402

for _k, _v in offline_env({}).items():
    os.environ.setdefault(_k, _v)

TASK = "rest_sampled"
RUNS = ((1, 1), (3, 16))            # (workers, batch size)
REPEATS = 4


@pytest.fixture(scope="module")
def example(tmp_path_factory, lm_example):
    out = tmp_path_factory.mktemp("lm_sampling")
    lm_example(out)           # the run's one training of the tiny GPT-2 (tests/conftest.py)
    (out / "tasks").mkdir()
    (out / "tasks" / f"{TASK}.yaml").write_text(yaml.safe_dump({
        "task": TASK, "dataset_path": "parquet",
        "dataset_kwargs": {"data_files": {"test": str(out / "data" / "mc.parquet")}},
        "test_split": "test", "output_type": "generate_until",
        "doc_to_text": "{{prompt.split(' ')[:2] | join(' ')}}",
        "doc_to_target": "{{prompt.split(' ')[2:] | join(' ')}} {{choices[label]}}.",
        "repeats": REPEATS,
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": True,
                              "temperature": 1.0},
        "filter_list": [{"name": "maj", "filter": [{"function": "majority_vote"},
                                                   {"function": "take_first"}]}],
        "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                         "higher_is_better": True, "regexes_to_ignore": ["^ "]}],
        "metadata": {"version": 1.0}}, sort_keys=False))
    for batch in sorted({b for _, b in RUNS}):
        (out / f"sweep-b{batch}.yaml").write_text(yaml.safe_dump({
            "name": "sampled", "checkpoints": ["ckpts/checkpoint-*"], "output": "results",
            "bootstrap": {"replicates": 200}, "batch_size": batch,
            "evals": [{"name": "rest", "lm_eval": {"task": TASK, "include_path": "tasks"}}]},
            sort_keys=False))
    return out


@pytest.fixture(scope="module")
def stores(example, tmp_path_factory, standing):
    root = tmp_path_factory.mktemp("sampling_stores")
    found = {}
    with local_ray():
        for workers, batch in RUNS:
            out = root / f"w{workers}-b{batch}"
            report = rayeval.run(str(example / f"sweep-b{batch}.yaml"), workers=workers,
                                 output=str(out), standing=standing)
            assert report.outcomes and not report.failures, report.failures
            found[(workers, batch)] = out
    return found


@pytest.mark.ray
def test_sampled_generations_are_the_same_on_any_workers_and_batch(example, stores):
    from lm_eval.filters.selection import MajorityVoteFilter

    from rayeval.plan.loader import load_sweep

    (ev,) = load_sweep(str(example / "sweep-b1.yaml")).evals
    assert (ev.generation.temperature, ev.generation.repeats) == (1.0, REPEATS)
    figures, records = {}, {}
    for run, out in stores.items():
        rows = latest_rows(ResultStore(str(out)).read())
        figures[run] = sorted((r["checkpoint"], r["metric"], r["value"], r["ci_low"],
                               r["ci_high"]) for r in rows)
        records[run] = {}
        for ckpt in {r["checkpoint"] for r in rows}:
            for r in rayeval.samples(str(out), checkpoint=ckpt, evaluation="rest").to_pylist():
                assert len(r["responses"]) == REPEATS
                # the voted response is lm-eval's own filter's pick among the repeats
                (voted,) = next(iter(MajorityVoteFilter().apply([r["responses"]], None)))
                assert r["response"] == voted
                records[run][(ckpt, r["id"])] = (r["responses"], r["exact_match"])
    assert figures[RUNS[0]] == figures[RUNS[1]]
    assert records[RUNS[0]] == records[RUNS[1]]
    # it sampled: repeats of one document differ, and the last checkpoint gets some right
    assert sum(len(set(responses)) > 1 for responses, _ in records[RUNS[0]].values()) > 10
    assert any(value > 0 for _, metric, value, _, _ in figures[RUNS[0]])
