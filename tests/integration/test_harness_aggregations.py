"""lm-eval tasks whose aggregation is not a mean, against lm-eval's own run.

Two local tasks over the tiny GPT-2 example's data (nothing downloaded):
- ``pick_two``: a two-way multiple choice (the right answer or another one, sides alternating
  with the id) scored with lm-eval's ``f1`` and ``matthews_corrcoef`` aggregations, and an
  ``acc`` that aggregates with a YAML ``!function`` which reads the items' order (the mean of
  the first half of the documents: a figure that moves if the order does);
- ``sum_gen``: greedy generation of the rest of a prompt from its first two words ("the cat"
  -> "sat on the mat.", "3 +" -> "4 = 7.") with corpus ``bleu``, ``chrf``, ``chrf++`` and
  ``ter``.

rayeval runs the first task's aggregations itself over every document's value, in document
order (``rayeval.harness.items``), and keeps the corpus scores as exact sums of sacrebleu's
per-segment statistics (``rayeval.harness.corpus``). The figures must equal lm-eval's ``simple_evaluate`` on the same
Hugging Face folders, and every figure and interval must be the same on 1 and 3 workers and at
batch sizes 1 and 16.
"""

import os

import pytest
import yaml

import rayeval

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
pytest.importorskip("sacrebleu")
pytest.importorskip("sklearn")

from harness import offline_env  # noqa: E402
from support import local_ray  # noqa: E402

from rayeval.ranking import latest_rows  # noqa: E402
from rayeval.io.store import ResultStore  # noqa: E402

for _k, _v in offline_env({}).items():
    os.environ.setdefault(_k, _v)

TASKS = ("pick_two", "sum_gen")
# rayeval's metric of each key: the task's own function, or sums of sacrebleu's statistics
KINDS = {"acc": "lm_items", "f1": "lm_items", "mcc": "lm_items", "bleu": "lm_bleu",
         "chrf": "lm_chrf", "chrf++": "lm_chrfpp", "ter": "lm_ter"}
SUM_GEN = ("bleu", "chrf", "chrf++", "ter")
RUNS = ((1, 1), (1, 16), (3, 1), (3, 16))          # (workers, batch size)

UTILS = '''
def pair(doc):
    right = doc["choices"][doc["label"]]
    other = doc["choices"][(doc["label"] + 1) % len(doc["choices"])]
    return [right, other] if doc["id"] % 2 == 0 else [other, right]


def side(doc):
    return 0 if doc["id"] % 2 == 0 else 1


def first_half_mean(items):
    half = list(items)[:max(1, len(items) // 2)]
    return sum(half) / len(half)
'''

PICK_TWO = '''task: pick_two
dataset_path: parquet
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: !function utils.pair
doc_to_target: !function utils.side
metric_list:
  - metric: acc
    aggregation: !function utils.first_half_mean
    higher_is_better: true
  - metric: f1
    aggregation: f1
    higher_is_better: true
  - metric: mcc
    aggregation: matthews_corrcoef
    higher_is_better: true
metadata: {{version: 1.0}}
'''


def write_tasks(folder, data):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "utils.py").write_text(UTILS)
    (folder / "pick_two.yaml").write_text(PICK_TWO.format(data=data / "mc.parquet"))
    (folder / "sum_gen.yaml").write_text(yaml.safe_dump({
        "task": "sum_gen", "dataset_path": "parquet",
        "dataset_kwargs": {"data_files": {"test": str(data / "mc.parquet")}},
        "test_split": "test", "output_type": "generate_until",
        "doc_to_text": "{{prompt.split(' ')[:2] | join(' ')}}",
        "doc_to_target": "{{prompt.split(' ')[2:] | join(' ')}} {{choices[label]}}.",
        # num_beams 1 and max_new_tokens equal to max_gen_toks: what lm-eval's HF model hands
        # transformers' generate, honoured as greedy decoding with that budget
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False,
                              "num_beams": 1, "max_new_tokens": 8},
        "metric_list": [{"metric": "bleu", "aggregation": "bleu", "higher_is_better": True},
                        {"metric": "chrf", "aggregation": "chrf", "higher_is_better": True},
                        {"metric": "chrf++", "aggregation": "chrf++", "higher_is_better": True},
                        {"metric": "ter", "aggregation": "ter", "higher_is_better": False}],
        "metadata": {"version": 1.0}}, sort_keys=False))


@pytest.fixture(scope="module")
def example(tmp_path_factory, lm_example):
    out = tmp_path_factory.mktemp("lm_aggregations")
    lm_example(out)           # the run's one training of the tiny GPT-2 (tests/conftest.py)
    write_tasks(out / "tasks", out / "data")
    for batch in sorted({b for _, b in RUNS}):
        sweep = {"name": "own-aggregations", "checkpoints": ["ckpts/checkpoint-*"],
                 "output": "results", "bootstrap": {"replicates": 200}, "batch_size": batch,
                 "samples": False,     # kept all the same where the task's own function runs
                 "evals": [{"name": t, "lm_eval": {"task": t, "include_path": "tasks"}}
                           for t in TASKS]}
        (out / f"sweep-b{batch}.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    return out


@pytest.fixture(scope="module")
def checkpoints(example):
    return sorted(str(p) for p in (example / "ckpts").iterdir())


@pytest.fixture(scope="module")
def reference(example, checkpoints):
    """lm-eval's own figures: {checkpoint: {(task, "metric"): value}}."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = {}
    for c in checkpoints:
        results = lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={c},dtype=float32", tasks=list(TASKS),
            task_manager=TaskManager(include_path=str(example / "tasks"),
                                     include_defaults=False),
            device="cpu", batch_size=8, bootstrap_iters=0)
        out[c] = {(task, k.split(",")[0]): v for task, res in results["results"].items()
                  for k, v in res.items() if k.endswith(",none") and "_stderr" not in k}
    return out


@pytest.fixture(scope="module")
def stores(example, tmp_path_factory, standing):
    root = tmp_path_factory.mktemp("aggregation_stores")
    found = {}
    with local_ray():
        for workers, batch in RUNS:
            out = root / f"w{workers}-b{batch}"
            report = rayeval.run(str(example / f"sweep-b{batch}.yaml"), workers=workers,
                                 output=str(out), standing=standing)
            assert report.outcomes and not report.failures, report.failures
            found[(workers, batch)] = out
    return found


def test_the_reference_is_not_degenerate(reference, checkpoints):
    """The figures lm-eval gives are informative: the last checkpoint picks the right side
    more often than not, and its generations share characters with the answers."""
    last = reference[checkpoints[-1]]
    assert set(last) == {(t, m) for t in TASKS for m in
                         (("acc", "f1", "mcc") if t == "pick_two" else SUM_GEN)}
    assert last[("pick_two", "f1")] > 0.5 and last[("pick_two", "mcc")] > 0
    assert 0 < last[("sum_gen", "bleu")] < 100 and last[("sum_gen", "chrf")] > 0


@pytest.mark.ray
def test_own_aggregations_equal_lm_eval_on_any_workers_and_batch(example, checkpoints,
                                                                 reference, stores):
    from rayeval.plan.loader import load_sweep

    sweep = load_sweep(str(example / "sweep-b1.yaml"))
    assert {m.key: m.name for ev in sweep.evals for m in ev.metrics} == KINDS
    # records are kept where the task's own function runs over them, though samples: false
    assert [ev.samples for ev in sweep.evals] == [True, False]
    seen = {}
    for run, out in stores.items():
        rows = latest_rows(ResultStore(str(out)).read())
        assert len(rows) == len(checkpoints) * len(KINDS)
        for r in rows:
            theirs = reference[r["checkpoint"]][(r["evaluation"], r["metric"])]
            assert r["value"] == pytest.approx(theirs, rel=1e-12, abs=1e-12), (run, r["metric"])
            assert r["ci_low"] <= r["value"] <= r["ci_high"], (run, r["metric"])
            assert r["world_size"] == run[0]
            seen.setdefault((r["checkpoint"], r["evaluation"], r["metric"]), {})[run] = \
                (r["value"], r["ci_low"], r["ci_high"], list(r["replicates"]))
    for key, by_run in seen.items():
        assert len(by_run) == len(RUNS), key
        assert len(set(map(repr, by_run.values()))) == 1, (key, by_run)


@pytest.mark.ray
def test_the_custom_aggregation_sees_the_documents_in_order(example, checkpoints, stores):
    """``first_half_mean`` over the records' per-item accuracies in id order is the stored
    figure, and differs from the mean over every document (so the order mattered)."""
    records = rayeval.samples(stores[(3, 16)], checkpoint=checkpoints[-1],
                              evaluation="pick_two").to_pylist()
    from rayeval.harness import items

    by_id = sorted((r["id"], items.decode(r["values"])["acc"]) for r in records)
    half = [v for _, v in by_id][:len(by_id) // 2]
    stored = [r for r in latest_rows(ResultStore(str(stores[(3, 16)])).read())
              if r["checkpoint"] == checkpoints[-1] and r["metric"] == "acc"][0]
    assert stored["value"] == sum(half) / len(half)
    assert stored["value"] != sum(v for _, v in by_id) / len(by_id)


def test_a_race_over_an_own_aggregation_is_one_line_before_ray(example):
    """A race's rounds keep no per-item records, which the task's own function runs over."""
    from support import ray_starts, rayeval_main

    sweep = yaml.safe_load((example / "sweep-b1.yaml").read_text())
    sweep["select"] = {"metric": "pick_two", "top": 1}
    (example / "race.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    with ray_starts() as started:
        done = rayeval_main("run", "race.yaml", cwd=str(example))
    assert done.returncode == 2 and not started
    assert done.stderr.strip().endswith(
        "select: pick_two/acc aggregates with its task's own function over every item's "
        "value, which a race's rounds do not keep; remove select: or race a sweep without "
        "that evaluation"), done.stderr
