"""``lmms_eval:`` entries read while the sweep file is read, before Ray: lmms-eval (its task
layer, installed without its dependency list) renders a local YAML task over easy-vqa items
into a request table of plain columns (the chat as JSON with image placeholders, the images as
PNG bytes), and every input rayeval cannot evaluate as lmms-eval would is one line naming it.
"""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

pytest.importorskip("lmms_eval")
pytest.importorskip("easy_vqa")

from lmms_reference import OFFLINE_ENV, write_task  # noqa: E402
from vlm_support import easy_vqa_items  # noqa: E402

from rayeval.errors import SpecError  # noqa: E402
from rayeval.plan.loader import load_sweep  # noqa: E402

for _key, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_key, _value)


def _sweep(folder, entry: dict, name="s.yaml") -> str:
    os.makedirs(folder / "ckpts" / "checkpoint-1", exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump({"name": "vqa", "checkpoints": ["ckpts/checkpoint-*"],
                                    "output": "results", "evals": [entry]}))
    return str(path)


def _task(folder, items, edit=None, name="rayeval_easyvqa"):
    """The reference task YAML, optionally edited (a dict merged into it) or with other utils."""
    path = write_task(str(folder / "tasks"), items, name=name)
    if edit:
        text = open(path).read()
        for old, new in edit.items():
            assert old in text
            text = text.replace(old, new)
        open(path, "w").write(text)
    return path


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lmms")
    items = easy_vqa_items(n=5, seed=1)
    _task(folder, items)
    sweep = load_sweep(_sweep(folder, {"name": "vqa", "lmms_eval": {
        "task": "rayeval_easyvqa", "include_path": "tasks",
        "gen_kwargs": {"max_new_tokens": 3}}}))
    from rayeval.plan.lm_eval_entries import UNWRITTEN

    ev = sweep.evals[0]
    return items, ev, UNWRITTEN[ev.dataset.path][1]


def test_entry_becomes_an_evaluation_with_lmms_eval_metrics(rendered):
    _, ev, task = rendered
    assert ev.task == "lmms_eval" and ev.name == "vqa"
    assert [m.key for m in ev.metrics] == [
        f"{m},{f}" for f in ("none", "lower")
        for m in ("exact_match", "answer_chars", "upper_chars")]
    assert {m.name for m in ev.metrics} == {"lm_mean"}
    assert [dict(m.params)["higher"] for m in ev.metrics][:3] == [True, False, False]
    assert ev.generation.max_new_tokens == 3 and ev.generation.until == ()
    assert ev.dataset.images == "images" and ev.dataset.id == "doc_id"
    assert ev.dataset.path.endswith(f"/requests/{task.digest}/docs.parquet")


def test_request_table_is_lmms_evals_chat_with_png_images(rendered):
    from PIL import Image

    items, _, task = rendered
    rows = task.table.to_pylist()
    assert [r["doc_id"] for r in rows] == list(range(len(items)))
    for row, item in zip(rows, items):
        question = f"{item['question']} Answer in one word."       # post_prompt applied
        assert json.loads(row["messages"]) == [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": question}]}]
        assert row["context"] == question and row["target"] == item["answer"]
        (png,) = row["images"]
        assert png.startswith(b"\x89PNG")
        got = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
        want = np.asarray(Image.open(item["image"]).convert("RGB"))
        assert np.array_equal(got, want)


def test_a_limit_keeps_the_tasks_document_count_for_the_stored_cell(tmp_path):
    """limit: 2 of 5 documents: the table holds 2, and the task a worker receives (the
    driver's pickle) still says the task has 5, which the cell is stored as n of
    (``limited_from``); a limit that leaves nothing out is no limit."""
    from rayeval.core import tasks
    from rayeval.harness import store
    from rayeval.plan.lm_eval_entries import UNWRITTEN

    items = easy_vqa_items(n=5, seed=1)
    _task(tmp_path, items)
    found = {}
    for limit in (2, 0.5, 5):
        sweep = load_sweep(_sweep(tmp_path, {"name": "vqa", "lmms_eval": {
            "task": "rayeval_easyvqa", "include_path": "tasks", "limit": limit,
            "gen_kwargs": {"max_new_tokens": 3}}}, name=f"s{limit}.yaml"))
        ev = sweep.evals[0]
        rendered = UNWRITTEN[ev.dataset.path][1]
        store.receive({ev.dataset.path: rendered.blob})            # as a worker gets it
        try:
            found[limit] = (rendered.table.num_rows, tasks.get("lmms_eval").limited_from(ev))
        finally:
            store._TASKS.pop(ev.dataset.path, None)
    assert found == {2: (2, 5), 0.5: (3, 5), 5: (5, None)}


def test_model_name_picks_the_tasks_specific_prompts(tmp_path):
    items = easy_vqa_items(n=2, seed=1)
    _task(tmp_path, items, edit={"lmms_eval_specific_kwargs:\n  default:\n":
                                 "lmms_eval_specific_kwargs:\n  mine:\n    pre_prompt: "
                                 "\"Q: \"\n    post_prompt: \"\"\n  default:\n"})
    sweep = load_sweep(_sweep(tmp_path, {"name": "vqa", "lmms_eval": {
        "task": "rayeval_easyvqa", "include_path": "tasks", "model_name": "mine"}}))
    from rayeval.plan.lm_eval_entries import UNWRITTEN

    table = UNWRITTEN[sweep.evals[0].dataset.path][1].table
    assert table.column("context").to_pylist() == [f"Q: {it['question']}" for it in items]


BAD = {
    "unknown task": ({"task": "rayeval_easyvq", "include_path": "tasks"}, None,
                     "lmms-eval knows no task 'rayeval_easyvq' (did you mean "
                     "'rayeval_easyvqa'?)"),
    "video": ({"task": "rayeval_easyvqa", "include_path": "tasks"},
              {'return [Image.open(doc["image"]).convert("RGB")]': 'return ["clip.mp4"]'},
              "gives its model video (doc_to_visual reads '.mp4'); rayeval evaluates images "
              "and text (video and audio are not supported)"),
    "api judge": ({"task": "rayeval_easyvqa", "include_path": "tasks"},
                  {"from PIL import Image\n": "from PIL import Image\n\n\ndef judge(doc):\n"
                                              "    from lmms_eval.llm_judge import get_server"
                                              "\n    return get_server\n"},
                  "is judged by an API model (process_results in utils.py uses "
                  "lmms_eval.llm_judge); rayeval does not call API judges"),
    "beam search": ({"task": "rayeval_easyvqa", "include_path": "tasks",
                     "gen_kwargs": {"num_beams": 3}}, None,
                    "searches 3 beams (num_beams), which rayeval does not run"),
    "loglikelihood": ({"task": "rayeval_easyvqa", "include_path": "tasks"},
                      {"output_type: generate_until": "output_type: loglikelihood",
                       "generation_kwargs:\n  max_new_tokens: 6\n  temperature: 0\n  "
                       "do_sample: false\n": ""},
                      "has output_type 'loglikelihood'; rayeval evaluates generate_until and "
                      "multiple_choice tasks"),
    # a multiple_choice task that asks each choice's likelihood without its context
    "mutual information": ({"task": "rayeval_easyvqa", "include_path": "tasks"},
                           {"output_type: generate_until": "output_type: multiple_choice\n"
                                                           "doc_to_choice: [\"yes\", \"no\"]",
                            "generation_kwargs:\n  max_new_tokens: 6\n  temperature: 0\n  "
                            "do_sample: false\n": "",
                            "metric: exact_match,": "metric: acc_mutual_info,"},
                           "lmms-eval task 'rayeval_easyvqa' asks acc_mutual_info (each "
                           "choice's likelihood without its context); rayeval scores choices "
                           "after their context only"),
    "beside task": ({"task": "rayeval_easyvqa", "include_path": "tasks"}, None,
                    "evals[0].task: an lmms_eval entry takes its data, metrics and decoding "
                    "from lmms-eval; remove the key"),
    "no folder": ({"task": "rayeval_easyvqa", "include_path": "nowhere"}, None,
                  "evals[0].lmms_eval.include_path: no folder at"),
    # lmms-eval retries its data load: the file under tenacity's RetryError, and where a
    # relative data_files path is read from (issue 56)
    "missing data": ({"task": "rayeval_easyvqa", "include_path": "tasks"},
                     {"  data_files: {test: ": "  data_files: {test: \"elsewhere/items.jsonl\"}"
                                               "\n#"},
                     "lmms-eval could not build 'rayeval_easyvqa': FileNotFoundError: "),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_before_ray(tmp_path, case):
    entry, edit, message = BAD[case]
    items = easy_vqa_items(n=2, seed=1)
    path = _task(tmp_path, items)
    if edit:
        utils = os.path.join(os.path.dirname(path), "utils.py")
        for target in (path, utils):
            text = open(target).read()
            for old, new in edit.items():
                text = text.replace(old, new)
            open(target, "w").write(text)
    raw = {"name": "vqa", "lmms_eval": entry}
    if case == "beside task":
        raw["task"] = "generation"
    with pytest.raises(SpecError) as error:
        load_sweep(_sweep(tmp_path, raw))
    assert message in str(error.value)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "results").exists()          # nothing written
    if case == "missing data":
        assert "elsewhere/items.jsonl" in str(error.value), str(error.value)
        assert "RetryError" not in str(error.value)
        assert str(error.value).endswith("; a relative path in the task's data_files is taken "
                                         f"from the folder rayeval runs in ({os.getcwd()})")


def test_lmms_eval_missing_is_one_line_naming_the_install(tmp_path):
    """In a process where lmms-eval cannot be imported (a None entry in sys.modules is how
    Python marks a module absent), the entry is one line naming the extra."""
    items = easy_vqa_items(n=2, seed=1)
    _task(tmp_path, items)
    sweep = _sweep(tmp_path, {"name": "vqa", "lmms_eval": {"task": "rayeval_easyvqa",
                                                          "include_path": "tasks"}})
    code = ("import sys; sys.modules['lmms_eval'] = None\n"
            "from rayeval.errors import SpecError\n"
            "from rayeval.plan.loader import load_sweep\n"
            f"try:\n    load_sweep({sweep!r})\n"
            "except SpecError as e:\n    print('ERR', e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **OFFLINE_ENV})
    line = done.stdout.strip()
    assert line.startswith("ERR ") and "\n" not in line, done.stderr[-2000:]
    assert "lmms-eval is not installed" in line
    assert "pip install 'rayeval[lmms-eval]' && pip install --no-deps lmms-eval==0.7.3" in line


def test_scoring_equals_lmms_evals_evaluator_on_the_same_texts(rendered):
    """Generated texts -> rayeval's scoring (filters, reasoning blocks stripped, process_results)
    against lmms-eval's own evaluator functions on the same texts: each document's value of
    each metric under each filter, and the response its log shows."""
    from lmms_eval.api.instance import Instance
    from lmms_eval.api.reasoning import parse_reasoning_tags_config
    from lmms_eval.evaluator import _process_document_results

    from rayeval.lmms.scoring import CLI_REASONING_TAGS, score_documents

    items, ev, rendered_task = rendered
    task = rendered_task.lm
    texts = ["<think>a Circle?</think> Circle", "  Blue ", "no", "<analysis>x</analysis>YES",
             "Rectangle\n"][:len(items)]
    ids = list(range(len(texts)))
    rows, responses, _ = score_documents(task, ids, [[t] for t in texts], "evals[0]")

    theirs = [Instance(request_type="generate_until", arguments=("", None, {}, i, task.task_name,
                                                                 "test"), idx=0,
                       metadata={"task": task.task_name, "doc_id": i, "repeats": 1})
              for i in ids]
    for inst, text in zip(theirs, texts):
        inst.resps = [text]
    task._instances = theirs
    task.apply_filters()
    tags = parse_reasoning_tags_config(cli_value=CLI_REASONING_TAGS)
    columns = {m.key: dict(m.params)["column"] for m in ev.metrics}
    for name in ("none", "lower"):
        for i in ids:
            done = _process_document_results((i, task.eval_docs[i], [theirs[i]]), task=task,
                                             filter_key=name, reasoning_tags=tags,
                                             log_samples=True)
            for metric, value in done.metrics.items():
                assert rows[i, columns[f"{metric},{name}"]].item() == value, (i, metric, name)
            if name == "none":
                assert responses[i] == done.logged_sample["filtered_resps"][0]
    assert responses[0] == "Circle" and rows[:, columns["upper_chars,lower"]].sum() == 0
    task._instances = None
