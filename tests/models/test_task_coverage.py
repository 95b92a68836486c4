"""``rayeval tasks --check``: every leaf task of lm-eval's and lmms-eval's registries (and a
user's own YAMLs) built without its documents and judged by the rules a run applies. The
verdicts are checked against the libraries' own registries (one row per leaf task their
TaskManager lists), against what is known of their flagship tasks, and against the run itself:
a task the check refuses is refused by ``load_sweep`` with the same words."""

import csv
import io
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

pytest.importorskip("lm_eval")

from rayeval.errors import SpecError  # noqa: E402
from rayeval.plan.loader import load_sweep  # noqa: E402


def rayeval(*args, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rayeval", *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **env})


LM_TASK = """task: {name}
dataset_path: parquet
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: ["yes", "no"]
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: {aggregation}
    higher_is_better: true
{extra}"""


def _sweep(folder, entry: dict) -> str:
    os.makedirs(folder / "ckpts" / "checkpoint-1", exist_ok=True)
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "checkpoints": ["ckpts/checkpoint-*"],
                                    "output": "results", "evals": [entry]}))
    return str(path)


@pytest.fixture(scope="module")
def lm_tasks(tmp_path_factory):
    """A folder of three own lm-eval tasks over 4 local rows: one averaged and one with the
    median of its items (both accepted: the median is the task's own aggregation), one marked
    ``unsafe_code`` (refused), and the check of lm-eval's registry with it."""
    folder = tmp_path_factory.mktemp("lm")
    data = folder / "data.parquet"
    pq.write_table(pa.table({"question": ["a?", "b?", "c?", "d?"], "label": [0, 1, 0, 1]}),
                   data)
    (folder / "tasks").mkdir()
    for name, aggregation, extra in (("rayeval_mine_mean", "mean", ""),
                                     ("rayeval_mine_median", "median", ""),
                                     ("rayeval_mine_unsafe", "mean", "unsafe_code: true\n")):
        (folder / "tasks" / f"{name}.yaml").write_text(
            LM_TASK.format(name=name, data=data, aggregation=aggregation, extra=extra))
    done = rayeval("tasks", "--check", "lm_eval", "--include-path", str(folder / "tasks"),
                   "--format", "csv")
    assert done.returncode == 0, done.stderr[-3000:]
    return folder, list(csv.reader(io.StringIO(done.stdout)))


def test_every_lm_eval_task_has_one_row_with_the_runs_verdict(lm_tasks):
    from lm_eval.tasks import TaskManager

    folder, rows = lm_tasks
    assert rows[0] == ["task", "status", "reason"]
    verdicts = {task: (status, reason) for task, status, reason in rows[1:]}
    assert len(verdicts) == len(rows) - 1                 # one row per task
    leaves = TaskManager(include_path=str(folder / "tasks")).all_subtasks
    assert sorted(verdicts) == sorted(leaves)
    assert {s for s, _ in verdicts.values()} == {"accepted", "refused"}
    assert all(r for s, r in verdicts.values() if s == "refused")
    accepted = sum(s == "accepted" for s, _ in verdicts.values())
    assert 0.5 < accepted / len(verdicts) < 1.0, accepted
    # what is known of lm-eval's flagship tasks, in the run's own words
    for task in ("arc_easy", "hellaswag", "mmlu_abstract_algebra", "gsm8k", "piqa"):
        assert verdicts[task] == ("accepted", ""), (task, verdicts[task])
    assert "runs code or needs images" in verdicts["cruxeval_input"][1]        # unsafe_code
    assert "runs code or needs images" in verdicts["chartqa"][1]               # images
    # humaneval's metric is Hugging Face's code_eval script, which lm-eval fetches from the Hub
    assert verdicts["humaneval"][1].startswith("lm-eval cannot build it here: ")
    # their own aggregations (matthews_corrcoef, corpus BLEU) run over every item
    assert verdicts["cola"] == ("accepted", "") and verdicts["wmt16-de-en"] == ("accepted", "")
    # a task that samples runs on every backend, each document's repeats seeded by its id
    assert verdicts["gsm8k_cot_self_consistency"] == ("accepted", "")
    # num_beams: 1 with max_new_tokens equal to max_gen_toks is greedy decoding; 10 beams is not
    assert verdicts["ask_gec_p0"] == ("accepted", "")
    assert "searches 10 beams (num_beams)" in verdicts["code2text_python"][1]
    assert verdicts["rayeval_mine_mean"] == verdicts["rayeval_mine_median"] == ("accepted", "")
    assert verdicts["rayeval_mine_unsafe"][0] == "refused"


def test_a_task_the_check_refuses_is_refused_by_the_run_in_the_same_words(lm_tasks, tmp_path):
    folder, rows = lm_tasks
    reason = {task: reason for task, _, reason in rows[1:]}["rayeval_mine_unsafe"]
    assert reason == ("lm-eval task 'rayeval_mine_unsafe' runs code or needs images; rayeval "
                      "scores text requests only")
    with pytest.raises(SpecError) as error:
        load_sweep(_sweep(tmp_path, {"name": "m", "lm_eval": {
            "task": "rayeval_mine_unsafe", "include_path": str(folder / "tasks")}}))
    assert str(error.value).endswith(f"evals[0].lm_eval.task: {reason}")


def test_task_picks_tasks_by_a_pattern():
    """``--task`` picks tasks by a pattern (here gsm8k's, with its sampled self-consistency
    variant accepted as the others)."""
    done = rayeval("tasks", "--check", "lm_eval", "--task", "gsm8k*", "--format", "json")
    assert done.returncode == 0, done.stderr[-3000:]
    verdicts = {v["task"]: v for v in json.loads(done.stdout)}
    assert set(next(iter(verdicts.values()))) == {"task", "status", "reason"}
    assert "gsm8k" in verdicts and all(t.startswith("gsm8k") for t in verdicts)
    assert verdicts["gsm8k_cot_self_consistency"]["status"] == "accepted"
    assert not any("samples (do_sample" in v["reason"] for v in verdicts.values())


def test_lmms_eval_tasks_have_the_runs_verdicts(tmp_path):
    pytest.importorskip("lmms_eval")
    pytest.importorskip("easy_vqa")
    from lmms_reference import OFFLINE_ENV, write_task
    from lmms_eval.tasks import TaskManager
    from vlm_support import easy_vqa_items

    path = write_task(str(tmp_path / "tasks"), easy_vqa_items(n=2, seed=1),
                      name="rayeval_median")
    text = open(path).read()
    assert "metric: answer_chars, aggregation: mean" in text
    open(path, "w").write(text.replace("metric: answer_chars, aggregation: mean",
                                       "metric: answer_chars, aggregation: median"))
    # a generation kwarg lmms-eval's chat models ignore is ignored; beam search is refused
    aspect = write_task(str(tmp_path / "tasks" / "aspect"), easy_vqa_items(n=2, seed=1),
                        name="rayeval_aspect")
    text = open(aspect).read()
    assert "  do_sample: false\n" in text
    open(aspect, "w").write(text.replace("  do_sample: false\n",
                                         "  do_sample: false\n  image_aspect_ratio: pad\n"))
    beams = write_task(str(tmp_path / "tasks" / "beams"), easy_vqa_items(n=2, seed=1),
                       name="rayeval_beams")
    text = open(beams).read()
    assert "  temperature: 0\n" in text
    open(beams, "w").write(text.replace("  temperature: 0\n",
                                        "  temperature: 0\n  num_beams: 4\n"))
    done = rayeval("tasks", "--check", "lmms_eval", "--include-path", str(tmp_path / "tasks"),
                   "--format", "json", **OFFLINE_ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    verdicts = {v["task"]: (v["status"], v["reason"]) for v in json.loads(done.stdout)}
    with pytest.MonkeyPatch.context() as env:
        for key, value in OFFLINE_ENV.items():
            env.setenv(key, value)
        leaves = TaskManager("ERROR", include_path=str(tmp_path / "tasks")).all_subtasks
    assert sorted(verdicts) == sorted(leaves)
    assert verdicts["ai2d"] == ("accepted", "")
    # their own aggregations run over every item (MMMU's grader is a judge: lmms_eval.verifiers)
    assert verdicts["mme"] == verdicts["pope"] == verdicts["ocrbench"] == ("accepted", "")
    assert verdicts["mmmu_val"][0] == "accepted"
    # image_aspect_ratio: a generation kwarg lmms-eval's chat models ignore
    assert verdicts["seedbench"] == ("accepted", "")
    assert verdicts["llava_in_the_wild"][0] == "accepted"
    assert verdicts["mmmu_val"][1].startswith("judged (")
    # MMBench and HallusionBench call an API client of their own: the served judge answers it
    assert verdicts["mmbench_en_dev"][0] == verdicts["hallusion_bench_image"][0] == "accepted"
    assert verdicts["mmbench_en_dev"][1].startswith("judged (process_results in en_utils.py")
    # MM-Vet samples (temperature 0.2): rayeval's seeded draws; its judge is served
    assert verdicts["mmvet"][0] == "accepted"
    assert "gives its model video (dataset_kwargs.video)" in verdicts["videomme"][1]
    assert "gives its model audio" in verdicts["voxpopuli_en"][1]
    # multiple_choice, scored as lmms-eval's llava_hf scores it: text and image tasks; a video
    # one is refused for its video
    assert verdicts["mmlu_anatomy"] == verdicts["seedbench_ppl"] == ("accepted", "")
    assert "gives its model video" in verdicts["egoschema_mcppl"][1]
    judged = [t for t, (s, r) in verdicts.items() if s == "accepted" and r]
    assert judged and all(verdicts[t][1].startswith("judged (") for t in judged)
    assert verdicts["rayeval_median"] == verdicts["rayeval_aspect"] == ("accepted", "")
    # the run refuses a task the check refuses, in the check's words
    status, reason = verdicts["rayeval_beams"]
    assert status == "refused" and "searches 4 beams" in reason
    os.makedirs(tmp_path / "ckpts" / "checkpoint-1")
    sweep = tmp_path / "s.yaml"
    sweep.write_text(yaml.safe_dump({"name": "v", "checkpoints": ["ckpts/checkpoint-*"],
                                     "output": "results", "evals": [{"name": "m", "lmms_eval": {
                                         "task": "rayeval_beams", "include_path": "tasks"}}]}))
    with pytest.MonkeyPatch.context() as env:
        for key, value in OFFLINE_ENV.items():
            env.setenv(key, value)
        with pytest.raises(SpecError) as error:
            load_sweep(str(sweep))
    assert str(error.value).endswith(f"evals[0].lmms_eval.gen_kwargs: {reason}")


@pytest.mark.parametrize("args, line", [
    (["--check", "lm_evl"], "--check: no entry kind 'lm_evl'; choose one of: lm_eval, "
                            "lmms_eval"),
    (["--check", "lm_eval", "--include-path", "/nonexistent/tasks"],
     "--include-path: no folder at /nonexistent/tasks; give a folder of task YAMLs"),
    (["--check", "lm_eval", "--task", "no_such_task*"],
     "--task: no task of lm-eval matches 'no_such_task*'"),
])
def test_bad_input_is_one_line(args, line):
    done = rayeval("tasks", *args)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {line}", done.stderr
    assert done.stdout == ""
