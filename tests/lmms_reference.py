"""The reference for rayeval's ``lmms_eval:`` entries: lmms-eval 0.7.3's own command line
(``python -m lmms_eval --model huggingface``) run on the same Hugging Face folder and the same
items, greedy, in float32, so rayeval can be compared metric by metric and item by item.

    from lmms_reference import write_task, run_lmms_eval
    write_task(task_dir, items)                      # easy-vqa items -> a local YAML task
    ref = run_lmms_eval(model_dir, task_dir, batch_size=1)
    ref["results"]["exact_match,none"], ref["samples"]["none"][0]["filtered_resps"]

The task (``TASK``) is what an lmms-eval user writes for local data: ``dataset_path: json``
over a JSON-lines file of items with image paths, ``doc_to_visual`` opening the image,
``doc_to_text`` with ``lmms_eval_specific_kwargs`` (pre/post prompts), a filter list with two
filters (``none``: take the first response; ``lower``: lower-cased), a ``process_results``
giving two mean-aggregated metrics.

lmms-eval's generic ``huggingface`` chat model has two bugs under transformers 5 and loads
bfloat16 (DESIGN.md): it picks the model class by comparing ``model_type`` with config classes
(so it loads ``AutoModel``, which has no ``generate``) and passes ``videos=[]``/``audios=[]``
to the processor, which Idefics3's rejects. ``_patch_reference_model`` fixes both for this
reference run only (and loads float32); rayeval never runs lmms-eval's models.

Nothing is downloaded: the hub and datasets libraries are offline, the JSON file loads through
the datasets library's packaged "json" builder into a cache inside the task folder.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

from support import OFFLINE_ENV, go_offline, offline_env  # noqa: F401 - re-exported

TASK = "rayeval_easyvqa"
FILTERS = ("none", "lower")          # the task's filter_list, in order
MAX_NEW_TOKENS = 6

UTILS = '''\
from PIL import Image


def doc_to_visual(doc):
    return [Image.open(doc["image"]).convert("RGB")]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    kwargs = lmms_eval_specific_kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{doc['question']}{kwargs.get('post_prompt', '')}"


def process_results(doc, results):
    answer = results[0].strip()
    return {"exact_match": float(answer == doc["answer"]),
            "answer_chars": float(len(answer)),
            "upper_chars": float(sum(c.isupper() for c in answer))}
'''


def _write_items(task_dir: str, items: list[dict], data_name: str, utils_name: str,
                 utils: str) -> tuple[str, str]:
    """``items`` as a JSON-lines file and a utils module in ``task_dir`` (made): (the folder's
    absolute path, the data file's)."""
    os.makedirs(task_dir, exist_ok=True)
    task_dir = os.path.abspath(task_dir)
    data = os.path.join(task_dir, data_name)
    with open(data, "w", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps(it) + "\n")
    with open(os.path.join(task_dir, utils_name), "w", encoding="utf-8") as f:
        f.write(utils)
    return task_dir, data


def write_task(task_dir: str, items: list[dict], *, max_new_tokens: int = MAX_NEW_TOKENS,
               name: str = TASK) -> str:
    """Write ``items`` (easy-vqa's: id, image, question, answer) as a JSON-lines file and a
    local lmms-eval task over it into ``task_dir``; return the YAML's path."""
    task_dir, data = _write_items(task_dir, items, "items.jsonl", "utils.py", UTILS)
    yaml_text = (
        f"task: {name}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files: {{test: {json.dumps(data)}}}\n"
        f"  cache_dir: {json.dumps(os.path.join(task_dir, 'datasets_cache'))}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        "doc_to_visual: !function utils.doc_to_visual\n"
        "doc_to_text: !function utils.doc_to_text\n"
        "doc_to_target: answer\n"
        "process_results: !function utils.process_results\n"
        "generation_kwargs:\n"
        f"  max_new_tokens: {max_new_tokens}\n"
        "  temperature: 0\n"
        "  do_sample: false\n"
        "filter_list:\n"
        "  - name: none\n"
        "    filter:\n"
        "      - function: take_first\n"
        "  - name: lower\n"
        "    filter:\n"
        "      - function: lowercase\n"
        "      - function: take_first\n"
        "metric_list:\n"
        "  - {metric: exact_match, aggregation: mean, higher_is_better: true}\n"
        "  - {metric: answer_chars, aggregation: mean, higher_is_better: false}\n"
        "  - {metric: upper_chars, aggregation: mean, higher_is_better: false}\n"
        "lmms_eval_specific_kwargs:\n"
        "  default:\n"
        "    pre_prompt: \"\"\n"
        "    post_prompt: \" Answer in one word.\"\n")
    path = os.path.join(task_dir, f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(yaml_text)
    return path


# multiple_choice tasks (lmms-eval's llava_hf scores their requests' losses): each document's
# choices are four easy-vqa answers, the right one among them at a place that differs by item;
# an image task, and the same items without their images (a text task: no doc_to_visual).
CHOICE_TASK = "rayeval_vqa_choice"
TEXT_CHOICE_TASK = "rayeval_vqa_text_choice"
CHOICE_METRICS = ("acc", "acc_norm")

CHOICE_UTILS = UTILS + '''

ANSWERS = ANSWER_LIST


def doc_to_choice(doc):
    others = [a for a in ANSWERS if a != doc["answer"]]
    picked = [others[(doc["id"] * 7 + k * 5) % len(others)] for k in range(3)]
    picked = list(dict.fromkeys(picked))
    while len(picked) < 3:
        picked.append(next(a for a in others if a not in picked))
    at = doc["id"] % 4
    return picked[:at] + [doc["answer"]] + picked[at:]


def doc_to_target(doc):
    return doc["id"] % 4


def question(doc):
    return doc["question"] + " Answer:"
'''


def write_choice_tasks(task_dir: str, items: list[dict]) -> None:
    """``items`` as a JSON-lines file and two ``multiple_choice`` tasks over it in
    ``task_dir``: CHOICE_TASK with each item's image, TEXT_CHOICE_TASK without."""
    from vlm_support import easy_vqa_answers

    task_dir, data = _write_items(task_dir, items, "choice_items.jsonl", "choice_utils.py",
                                  CHOICE_UTILS.replace("ANSWER_LIST", repr(easy_vqa_answers())))
    for name, visual in ((CHOICE_TASK, "doc_to_visual: !function choice_utils.doc_to_visual\n"),
                         (TEXT_CHOICE_TASK, "")):
        with open(os.path.join(task_dir, f"{name}.yaml"), "w", encoding="utf-8") as f:
            f.write(f"task: {name}\n"
                    "dataset_path: json\n"
                    "dataset_kwargs:\n"
                    f"  data_files: {{test: {json.dumps(data)}}}\n"
                    f"  cache_dir: {json.dumps(os.path.join(task_dir, 'datasets_cache'))}\n"
                    "test_split: test\n"
                    "output_type: multiple_choice\n"
                    + visual +
                    "doc_to_text: !function choice_utils.question\n"
                    "doc_to_choice: !function choice_utils.doc_to_choice\n"
                    "doc_to_target: !function choice_utils.doc_to_target\n"
                    "metric_list:\n"
                    "  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
                    "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n")


def run_lmms_eval(model_dir: str, task_dir: str, *, task: str = TASK, batch_size: int = 1,
                  output: str | None = None, limit: int | None = None,
                  timeout: float = 600, members: tuple[str, ...] = (),
                  model: str = "huggingface") -> dict:
    """lmms-eval's own run (a subprocess: its command line, the reference model patched as the
    module says); {"results": {metric,filter: value}, "samples": {filter: [logged samples by
    doc_id]}, "n": documents}. For a group (``task``) of the tasks ``members``: {"results":
    the group's, "subtasks": its tasks, "members": {task: what read_output gives of that task}}
    (``read_group``)."""
    output = output or os.path.join(task_dir, f"out-b{batch_size}")
    run_cli(model_dir, task_dir, [task], output, batch_size=batch_size, limit=limit,
            timeout=timeout, model=model)
    if members:
        return read_group(output, task, members)
    return read_output(output, task)


def run_cli(model_dir: str, task_dir: str, tasks: list[str], output: str, *,
            batch_size: int = 1, limit: int | None = None, timeout: float = 600,
            model: str = "huggingface", simple: bool = False) -> None:
    """lmms-eval's command line on ``tasks`` (tasks or groups found under ``task_dir``, one
    run: one results file, one samples file per task) into ``output``. ``model``: its generic
    ``huggingface`` chat model, or ``llava_hf`` (LLaVA's own, in float32); ``simple``: its
    simple form (``--force_simple``: what scores ``multiple_choice`` tasks)."""
    model_args = f"pretrained={model_dir},device_map=cpu"
    if model == "llava_hf":
        model_args += ",dtype=float32"
    args = [sys.executable, os.path.abspath(__file__), "--model", model,
            "--model_args", model_args,
            "--tasks", ",".join(tasks), "--include_path", os.path.abspath(task_dir),
            "--batch_size", str(batch_size), "--device", "cpu", "--log_samples",
            "--output_path", output, "--verbosity", "WARNING"]
    if limit is not None:
        args += ["--limit", str(limit)]
    if simple:
        args.append("--force_simple")
    done = subprocess.run(args, env=offline_env(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"lmms-eval failed ({done.returncode}):\n{done.stderr[-3000:]}")


# The references of tests/integration/test_lmms_eval_tasks.py ("single": TASK over SINGLE_ITEMS
# easy-vqa test items), test_lmms_eval_groups.py ("group": GROUP over GROUP_TASKS, of
# different sizes, aggregating GROUP_AGGREGATED), test_vllm_images.py ("images":
# IMAGES_TASK over the items of IMAGES_ITEMS) and test_lmms_eval_tasks.py again ("own":
# OWN_TASK, the task's own aggregations), made by one lmms-eval run on one tiny Idefics3
# (the ``lmms_suite`` fixture of tests/conftest.py): one lmms-eval start instead of four.
# Each is what a run of its own would give: lmms-eval evaluates each task on its own.
SINGLE_ITEMS = 8
GROUP = "rayeval_vqa_group"
GROUP_TASKS = {"rayeval_vqa_a": 4, "rayeval_vqa_b": 6}        # task -> its items
GROUP_AGGREGATED = {"answer_chars": True, "upper_chars": False}  # metric -> weight_by_size
IMAGES_TASK = "rayeval_vqa_images"
IMAGES_ITEMS = {"split": "test", "n": 6, "seed": 5}           # easy_vqa_items' arguments
OWN_TASK = "rayeval_vqa_own"          # TASK's items, aggregated by the task's own functions
OWN_METRICS = ("pairs", "subjects")

# Aggregations of the two kinds lmms-eval's benchmarks write: MME's (questions asked in pairs
# about one image: "acc" over questions plus "acc+", the pairs answered right both times, as a
# score out of 200) and MMMU's (an accuracy per subject, then their mean). The answer is
# "right" when its length is even: the untrained model is never right otherwise, and the
# lengths differ document by document.
OWN_UTILS = UTILS + '''

def process_results_own(doc, results):
    answer = results[0].strip()
    right = float(len(answer) % 2 == 0)
    return {"pairs": {"question_id": doc["id"] // 2, "score": right},
            "subjects": {"subject": doc["answer"], "right": right}}


def pairs_aggregate_results(results):
    by_pair = {}
    for r in results:
        by_pair.setdefault(r["question_id"], []).append(r["score"])
    acc = sum(sum(v) for v in by_pair.values()) / sum(len(v) for v in by_pair.values())
    acc_plus = sum(all(v) for v in by_pair.values()) / len(by_pair)
    return (acc + acc_plus) * 100


def subjects_aggregate_results(results):
    by_subject = {}
    for r in results:
        by_subject.setdefault(r["subject"], []).append(r["right"])
    return sum(sum(v) / len(v) for v in by_subject.values()) / len(by_subject)
'''


def write_own_task(task_dir: str, items: list[dict]) -> str:
    """TASK's YAML over ``items`` as OWN_TASK: one filter, and OWN_METRICS aggregated by the
    functions of OWN_UTILS."""
    path = write_task(task_dir, items, name=OWN_TASK)
    with open(os.path.join(task_dir, "utils.py"), "w", encoding="utf-8") as f:
        f.write(OWN_UTILS)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, _, rest = text.partition("filter_list:\n")
    _, _, tail = rest.partition("lmms_eval_specific_kwargs:\n")
    head = head.replace("process_results: !function utils.process_results",
                        "process_results: !function utils.process_results_own")
    metrics = "".join(f"  - metric: {m}\n    aggregation: !function utils.{m}_aggregate_results"
                      f"\n    higher_is_better: true\n" for m in OWN_METRICS)
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + "metric_list:\n" + metrics + "lmms_eval_specific_kwargs:\n" + tail)
    return path


def write_suite(root: str) -> dict[str, str]:
    """The references' task folders under ``root`` (one include path for lmms-eval):
    {"single", "group", "images", "own": its folder}. The group's tasks hold easy-vqa test items of
    seeds 1, 2..., the single task's those of seed 0."""
    import yaml

    from vlm_support import easy_vqa_items

    folders = {k: os.path.join(root, k) for k in ("single", "group", "images", "own")}
    write_task(folders["single"], easy_vqa_items(n=SINGLE_ITEMS, seed=0))
    write_own_task(folders["own"], easy_vqa_items(n=SINGLE_ITEMS, seed=0))
    write_task(folders["images"], easy_vqa_items(**IMAGES_ITEMS), name=IMAGES_TASK)
    for seed, (task, n) in enumerate(GROUP_TASKS.items(), start=1):   # one include folder
        write_task(os.path.join(folders["group"], task), easy_vqa_items(n=n, seed=seed),
                   name=task)
    with open(os.path.join(folders["group"], f"{GROUP}.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump({"group": GROUP, "task": list(GROUP_TASKS),
                        "aggregate_metric_list": [
                            {"metric": m, "aggregation": "mean", "weight_by_size": w}
                            for m, w in GROUP_AGGREGATED.items()]}, f)
    return folders


def run_suite(model_dir: str, root: str) -> dict:
    """lmms-eval's run of the references (``write_suite``'s folders under ``root``) at batch
    size 1: {"single": as run_lmms_eval gives for TASK, "group": as it gives for GROUP,
    "images": as it gives for IMAGES_TASK, "own": for OWN_TASK}."""
    output = os.path.join(root, "out-b1")
    run_cli(model_dir, root, [TASK, GROUP, IMAGES_TASK, OWN_TASK], output)
    return {"single": read_output(output, TASK),
            "group": read_group(output, GROUP, tuple(GROUP_TASKS)),
            "images": read_output(output, IMAGES_TASK),
            "own": read_output(output, OWN_TASK, filters=("none",))}


def read_group(output: str, group: str, members: tuple[str, ...], filters=FILTERS) -> dict:
    """lmms-eval's results of a group under ``output``: the group's own figures (its
    aggregates), the tasks it lists (``subtasks``), and each member task's as ``read_output``
    reads them (its samples are a file of its own)."""
    results = sorted(glob.glob(os.path.join(output, "**", "*_results.json"), recursive=True))
    if not results:
        raise RuntimeError(f"lmms-eval wrote no results under {output}")
    with open(results[-1], encoding="utf-8") as f:
        found = json.load(f)
    return {"results": found["results"][group], "subtasks": found["group_subtasks"][group],
            "members": {t: read_output(output, t, filters) for t in members}}


def read_output(output: str, task: str = TASK, filters=FILTERS) -> dict:
    """lmms-eval's results and logged samples under ``output``. Its samples file holds each
    filter's documents in turn (the filter is not named in a line): split in ``filters``'
    order."""
    results = sorted(glob.glob(os.path.join(output, "**", "*_results.json"), recursive=True))
    samples = sorted(glob.glob(os.path.join(output, "**", f"*_samples_{task}.jsonl"),
                               recursive=True))
    if not results or not samples:
        raise RuntimeError(f"lmms-eval wrote no results or samples under {output}")
    with open(results[-1], encoding="utf-8") as f:
        found = json.load(f)
    with open(samples[-1], encoding="utf-8") as f:
        logged = [json.loads(line) for line in f if line.strip()]
    n = len(logged) // len(filters)
    by_filter = {name: sorted(logged[k * n:(k + 1) * n], key=lambda s: s["doc_id"])
                 for k, name in enumerate(filters)}
    return {"results": found["results"][task], "samples": by_filter, "n": n}


def _patch_reference_model() -> None:
    """The two transformers-5 fixes and float32, on lmms-eval's ``huggingface`` model, in
    this process only (the reference run)."""
    import torch
    import transformers
    from lmms_eval.models.chat import huggingface as hf_chat

    class _ImageTextToText:
        @staticmethod
        def from_pretrained(path, **kwargs):
            kwargs["torch_dtype"] = torch.float32
            return transformers.AutoModelForImageTextToText.from_pretrained(path, **kwargs)

    def fix(kw):
        for key in ("videos", "audios"):
            if not kw.get(key):
                kw.pop(key, None)

    hf_chat.AutoModel = _ImageTextToText                 # the class its lookup falls back to
    hf_chat.AutoProcessor = _processor_loader(fix)


def _processor_loader(fix):
    """An ``AutoProcessor`` stand-in whose processors call ``fix(kwargs)`` before each call."""
    import transformers

    class _Processor:
        @staticmethod
        def from_pretrained(path, **kwargs):
            processor = transformers.AutoProcessor.from_pretrained(path, **kwargs)
            base = type(processor)

            def call(self, *args, **kw):
                fix(kw)
                return base.__call__(self, *args, **kw)

            processor.__class__ = type(f"Reference{base.__name__}", (base,),
                                       {"__call__": call})
            return processor

    return _Processor


def _patch_choice_scoring() -> None:
    """Two fixes for lmms-eval 0.7.3's ``multiple_choice`` path, in this process only (the
    reference run):
    - its evaluator keeps a model's answer to a request through ``unwrap_generation_output``,
      which turns a log-likelihood answer, ``(loss, is_greedy)``, into its ``str``; the task's
      ``process_results`` then fails on every document (``lls, is_greedy = zip(*results)``:
      too many values). Such a tuple is kept as the model gave it;
    - ``llava_hf`` scores a document without images (a text task) by handing its processor
      ``images=[]``, whose empty pixel values the model cannot take, and calls a task's
      missing ``doc_to_visual``: such a document goes to the processor with no images, as
      rayeval scores it (the prompt otherwise as llava_hf renders it)."""
    from lmms_eval import evaluator
    from lmms_eval.api import task as lmms_task
    from lmms_eval.models.simple import llava_hf

    unwrap = evaluator.unwrap_generation_output

    def unwrap_answers(output):
        if isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], float) \
                and isinstance(output[1], bool):
            return output, None
        return unwrap(output)

    evaluator.unwrap_generation_output = unwrap_answers

    def fix(kw):
        if "images" in kw and not kw["images"]:
            kw["images"] = None

    llava_hf.AutoProcessor = _processor_loader(fix)
    visual = lmms_task.ConfigurableTask.doc_to_visual

    def doc_to_visual(self, doc):
        found = visual(self, doc)
        return [] if found is None else found

    lmms_task.ConfigurableTask.doc_to_visual = doc_to_visual


def _without_decord() -> None:
    """lmms-eval's ``llava_hf`` imports the video decoder decord at its module's import (not
    installed here); image tasks never call it. In the reference's process only: a stand-in
    that fails if a video is ever read."""
    import importlib.util
    import types

    if importlib.util.find_spec("decord") is not None:
        return
    stand_in = types.ModuleType("decord")

    def unavailable(*args, **kwargs):
        raise RuntimeError("decord is not installed: no video in these reference runs")

    stand_in.VideoReader = stand_in.cpu = unavailable
    sys.modules["decord"] = stand_in


if __name__ == "__main__":
    go_offline()
    _patch_reference_model()
    _without_decord()
    _patch_choice_scoring()
    from lmms_eval.__main__ import cli_evaluate

    cli_evaluate()
