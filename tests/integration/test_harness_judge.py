"""An lm-eval generation task graded by a local judge (``judge:`` on an ``lm_eval:`` entry,
docs/judges.md), against lm-eval's own generations and a plain transformers judge loop.

The task is a local lm-eval YAML over the judged example's questions (tests/judge_support.py:
tiny random Llamas, and the hand-built judge whose verdict follows the prompt's last token).
lm-eval's ``simple_evaluate`` gives every document's context, generation and exact_match; the
reference judge renders the same template over them (jinja2), runs the judge with
transformers and reads the verdict with a regular expression. rayeval's ``judge``,
``judge_failed``, the task's ``exact_match`` and every item's judge text must be the same, on
1 and 2 workers, with identical intervals.
"""

import os

import pytest
import yaml

import rayeval

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

import judge_support  # noqa: E402
from harness import offline_env  # noqa: E402
from support import local_ray  # noqa: E402

from rayeval.io.store import ResultStore  # noqa: E402
from rayeval.ranking import latest_rows  # noqa: E402

for _k, _v in offline_env({}).items():
    os.environ.setdefault(_k, _v)

TASK = "judged_qa"
PROMPT = "Question: {{ context }}\nReference: {{ target }}\nAnswer: {{ response }}"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    paths = judge_support.build(str(tmp_path_factory.mktemp("harness_judge")))
    tasks = os.path.join(paths["folder"], "tasks")
    os.makedirs(tasks)
    with open(os.path.join(tasks, f"{TASK}.yaml"), "w") as f:
        yaml.safe_dump({
            "task": TASK, "dataset_path": "parquet",
            "dataset_kwargs": {"data_files": {"test": paths["data"]}}, "test_split": "test",
            "output_type": "generate_until", "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": 6, "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                             "higher_is_better": True}],
            "metadata": {"version": 1.0}}, f, sort_keys=False)
    paths["tasks"] = tasks
    return paths


def _sweep(paths, workers: int) -> str:
    raw = {"name": "judged-lm-eval", "checkpoints": paths["checkpoints"],
           "output": os.path.join(paths["folder"], f"out{workers}"), "workers": workers,
           "batch_size": 16, "bootstrap": {"replicates": 200},
           "evals": [{"name": "qa", "lm_eval": {"task": TASK, "include_path": paths["tasks"]},
                      "judge": {"model": paths["judge"], "prompt": PROMPT,
                                "max_new_tokens": 3, "verdict": {"yes": 1, "no": 0}}}]}
    path = os.path.join(paths["folder"], f"sweep{workers}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    return path


@pytest.fixture(scope="module")
def reference(built):
    """{checkpoint: {"exact_match": lm-eval's figure, "items": {doc_id: (response, judge
    text, score or None)}}}: lm-eval's generations, judged by the plain loop."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    judge = judge_support._Judge(built, max_new_tokens=3)
    template = judge_support._template(PROMPT)
    out = {}
    for ckpt in built["checkpoints"]:
        results = lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={ckpt},dtype=float32", tasks=[TASK],
            task_manager=TaskManager(include_path=built["tasks"], include_defaults=False),
            device="cpu", batch_size=8, log_samples=True, bootstrap_iters=0)
        items = {}
        for s in results["samples"][TASK]:
            response = s["filtered_resps"][0]
            said = judge(template.render(context=s["arguments"][0][0], target=s["target"],
                                         response=response))
            items[s["doc_id"]] = (response, said, judge_support.read_verdict(
                {"yes": 1, "no": 0}, said))
        out[ckpt] = {"exact_match": results["results"][TASK]["exact_match,none"],
                     "items": items}
    return out


@pytest.fixture(scope="module")
def stores(built, standing):
    found = {}
    with local_ray():
        for workers in (1, 2):
            report = rayeval.run(_sweep(built, workers), standing=standing)
            assert report.outcomes and not report.failures, report.failures
            found[workers] = os.path.join(built["folder"], f"out{workers}")
    return found


def test_the_reference_is_not_degenerate(reference):
    """Some verdicts are yes, some no, some unread, for the judge to have something to do."""
    scores = [score for ref in reference.values() for _, _, score in ref["items"].values()]
    assert {1.0, 0.0, None} <= set(scores)


@pytest.mark.ray
def test_a_judged_lm_eval_task_equals_lm_eval_and_the_plain_judge(built, reference, stores):
    runs = {}
    for workers, out in stores.items():
        rows = {(r["checkpoint"], r["metric"]): r for r in latest_rows(ResultStore(out).read())}
        assert {m for _, m in rows} == {"exact_match", "judge", "judge_failed"}
        for ckpt, ref in reference.items():
            scores = [score for _, _, score in ref["items"].values()]
            read = [s for s in scores if s is not None]
            assert rows[(ckpt, "exact_match")]["value"] == ref["exact_match"]
            assert rows[(ckpt, "judge")]["value"] == pytest.approx(sum(read) / len(read),
                                                                    rel=1e-12)
            assert rows[(ckpt, "judge_failed")]["value"] == scores.count(None)
            records = rayeval.samples(out, checkpoint=ckpt, evaluation="qa").to_pylist()
            assert sorted(r["id"] for r in records) == sorted(ref["items"])
            for r in records:
                response, said, score = ref["items"][r["id"]]
                assert (r["response"], r["judge_output"], r["judge"]) == (response, said, score)
        runs[workers] = {k: (r["value"], r["ci_low"], r["ci_high"]) for k, r in rows.items()}
    assert runs[1] == runs[2]
