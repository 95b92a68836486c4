"""Tier 1: an ``lm_eval:`` entry's rendering is cached by the content of what decides it
(``harness.render_cache``): reading the sweep again plans from the cached rendering without
rendering (the same evaluations, groups and cell-key inputs, lm-eval not imported), and an
edit of anything the rendering depends on (a task YAML, its ``utils.py``, a data file, the
entry's settings) renders again, with a new request table (so new cells) where the numbers would
change."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

pytest.importorskip("lm_eval")

from rayeval.config.schema import numbers_of  # noqa: E402
from rayeval.errors import RunError, StoreError  # noqa: E402
from rayeval.harness import render, render_cache, store  # noqa: E402
from rayeval.plan.lm_eval_entries import write_requests  # noqa: E402
from rayeval.plan.loader import load_sweep  # noqa: E402

UTILS = ("def add_question(dataset):\n"
         "    return dataset.map(lambda d: {'question': 'Q: ' + d['prompt']})\n")


def _mc(name, data, body=""):
    return (f"task: {name}\ndataset_path: parquet\n"
            f"dataset_kwargs: {{data_files: {{test: {data}, train: {data}}}}}\n"
            "test_split: test\nfewshot_split: train\noutput_type: multiple_choice\n"
            "doc_to_text: '{{question}} A:'\ndoc_to_choice: choices\ndoc_to_target: answer\n"
            "metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]\n"
            "process_docs: !function utils.add_question\n" + body)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """Two multiple-choice tasks (process_docs from utils.py) over a parquet outside the task
    folder, a group of both, and a sweep of a task, the group and a limited task; the cached
    renderings in the test's own folder."""
    monkeypatch.setenv(render_cache.ENV, str(tmp_path / "cache"))
    data = tmp_path / "data" / "mc.parquet"
    data.parent.mkdir()
    _write_data(data, ["one", "two", "three", "four"])
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "utils.py").write_text(UTILS)
    (tasks / "tiny_mc.yaml").write_text(_mc("tiny_mc", data))
    (tasks / "tiny_two.yaml").write_text(_mc("tiny_two", data, "num_fewshot: 1\n"))
    (tasks / "tiny_group.yaml").write_text(yaml.safe_dump({
        "group": "tiny_group", "task": ["tiny_mc", "tiny_two"],
        "aggregate_metric_list": [{"metric": "acc", "aggregation": "mean",
                                   "weight_by_size": True}]}))
    (tmp_path / "hf" / "checkpoint-1").mkdir(parents=True)
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({
        "name": "t", "checkpoints": ["hf/*"], "output": "out",
        "evals": [{"name": "mc", "lm_eval": {"task": "tiny_mc", "include_path": "tasks"}},
                  {"name": "grp", "lm_eval": {"task": "tiny_group", "include_path": "tasks",
                                              "num_fewshot": 1}},
                  {"name": "lim", "lm_eval": {"task": "tiny_mc", "include_path": "tasks",
                                              "limit": 0.5}}]}))
    return tmp_path


def _write_data(path, prompts):
    pq.write_table(pa.table({"prompt": prompts, "choices": [["a", "b"]] * len(prompts),
                             "answer": pa.array([i % 2 for i in range(len(prompts))],
                                                pa.int64())}), path)


@pytest.fixture
def renders(monkeypatch):
    """How many times lm-eval rendered an entry."""
    calls = []
    real = render.render

    def counted(*args, **kwargs):
        calls.append(args[0].task)
        return real(*args, **kwargs)

    monkeypatch.setattr(render, "render", counted)
    return calls


def _plan(folder):
    """What a cell's key reads of each evaluation: the walked fields, as the key's JSON has
    them, and the request table's location (its digest; the key's data set fingerprint
    names it)."""
    sweep = load_sweep(str(folder / "sweep.yaml"))
    return sweep, {e.name: (json.dumps(numbers_of(e, True), sort_keys=True, default=str),
                            e.dataset.path) for e in sweep.evals}, sweep.groups


def test_a_cached_rendering_plans_as_the_rendering_did(folder, renders):
    first, keys, groups = _plan(folder)
    assert sorted(renders) == ["tiny_group", "tiny_mc", "tiny_mc"]
    assert len(os.listdir(folder / "cache")) == 3
    write_requests(first)
    again, keys_again, groups_again = _plan(folder)
    assert sorted(renders) == ["tiny_group", "tiny_mc", "tiny_mc"], "planned without rendering"
    assert keys_again == keys and again.evals == first.evals and groups_again == groups
    assert {e.name for e in again.evals} == {"mc", "grp/tiny_mc", "grp/tiny_two", "lim"}
    # what the store checks and the sinks read, from the cached rendering
    data = {e.name: e.dataset.path for e in again.evals}
    store.RequestTables().prepare(again.evals)
    assert store.limited_from(data["lim"]) == 4 and store.limited_from(data["mc"]) is None
    assert not any(store._RENDERED[d].is_rendered for d in data.values())
    # the workers' task objects: rendered when asked for, checked against the cached digest
    shipped = store.RequestTables().shipment(again.evals)
    assert set(shipped) == set(data.values()) and len(renders) == 6


def test_planning_from_cached_renderings_imports_no_lm_eval(folder):
    _plan(folder)
    code = ("import sys; from rayeval.plan.loader import load_sweep; "
            f"load_sweep({str(folder / 'sweep.yaml')!r}); "
            "print(sorted(m for m in ('lm_eval', 'datasets', 'transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ}, cwd=str(folder), check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


EDITS = {
    # what is edited: (file, old, new, whether the request table (the numbers) changes)
    "a task YAML": ("tasks/tiny_mc.yaml", "A:'", "Answer:'", True),
    "its utils.py": ("tasks/utils.py", "'Q: '", "'Question: '", True),
    "a comment in a YAML": ("tasks/tiny_mc.yaml", "test_split", "# note\ntest_split", False),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edit_renders_again(folder, renders, edit):
    file, old, new, changes = EDITS[edit]
    _, keys, _ = _plan(folder)
    path = folder / file
    path.write_text(path.read_text().replace(old, new))
    _, keys_after, _ = _plan(folder)
    assert renders.count("tiny_mc") == 4, "rendered again"
    assert (keys_after["mc"] != keys["mc"]) == changes
    if file.endswith("utils.py"):             # the group's tasks use it too
        assert renders.count("tiny_group") == 2
    before = len(renders)
    _, keys_cached, _ = _plan(folder)
    assert len(renders) == before and keys_cached == keys_after, "the new rendering is cached"


def test_a_data_file_edit_renders_again(folder, renders):
    _, keys, _ = _plan(folder)
    data = folder / "data" / "mc.parquet"
    _write_data(data, ["one", "two", "three", "five"])
    _, keys_after, _ = _plan(folder)
    assert len(renders) == 6, "rendered again"
    # limit: 0.5 scores the first two documents, which did not change: nor does its table
    assert {k for k in keys if keys_after[k] != keys[k]} == set(keys) - {"lim"}


def test_an_entry_setting_is_its_own_rendering(folder, renders):
    _plan(folder)
    sweep = yaml.safe_load((folder / "sweep.yaml").read_text())
    sweep["evals"][0]["lm_eval"]["num_fewshot"] = 1
    (folder / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    _plan(folder)
    assert renders.count("tiny_mc") == 3


def test_what_cannot_be_keyed_renders_every_time(folder):
    from rayeval.config.schema import LmEvalSpec

    with pytest.raises(render_cache.NotKeyed, match="Hub task"):
        render_cache.key("lm-eval", LmEvalSpec(task="arc_easy"))
    with pytest.raises(render_cache.NotKeyed, match="not defined"):
        render_cache.key("lm-eval",
                         LmEvalSpec(task="arc_easy", include_path=str(folder / "tasks")))
    # a name only listed among a group's tasks: lm-eval's registry would have it
    (folder / "tasks" / "mixed.yaml").write_text("group: mixed\ntask: [tiny_mc, arc_easy]\n")
    with pytest.raises(render_cache.NotKeyed, match="not defined"):
        render_cache.key("lm-eval",
                         LmEvalSpec(task="arc_easy", include_path=str(folder / "tasks")))
    (folder / "tasks" / "url.yaml").write_text(
        "task: url_mc\ndataset_path: json\n"
        "dataset_kwargs: {data_files: {test: 'https://example.org/mc.json'}}\n")
    with pytest.raises(render_cache.NotKeyed, match="URL"):
        render_cache.key("lm-eval",
                         LmEvalSpec(task="tiny_mc", include_path=str(folder / "tasks")))
    (folder / "tasks" / "url.yaml").unlink()
    (folder / "tasks" / "hub.yaml").write_text("task: hub_mc\ndataset_path: allenai/ai2_arc\n")
    with pytest.raises(render_cache.NotKeyed, match="Hub data set"):
        render_cache.key("lm-eval",
                         LmEvalSpec(task="tiny_mc", include_path=str(folder / "tasks")))


def test_a_file_read_while_rendering_is_checked(folder, renders):
    """A file the rendering opened that no key covers (here: one utils.py reads by path)."""
    extra = folder / "prefix.txt"
    extra.write_text("Q: ")
    utils = folder / "tasks" / "utils.py"
    utils.write_text(f"PREFIX = open({str(extra)!r}).read()\n" + UTILS.replace("'Q: '", "PREFIX"))
    _plan(folder)
    _plan(folder)
    assert renders.count("tiny_mc") == 2
    extra.write_text("Question: ")
    _plan(folder)
    assert renders.count("tiny_mc") == 4


def test_a_stale_cached_rendering_is_never_served(folder):
    _plan(folder)
    for name in os.listdir(folder / "cache"):                # as if a dependency went unseen
        path = folder / "cache" / name
        body = json.loads(path.read_text())
        for t in body["tasks"]:
            t["digest"] = "0" * 24
        path.write_text(json.dumps(body))
    sweep, _, _ = _plan(folder)
    with pytest.raises(RunError, match="is not what lm-eval renders now"):
        store.RequestTables().prepare(sweep.evals[:1])      # the table must be written
    assert len(os.listdir(folder / "cache")) == 2, "dropped"


def test_the_stored_table_is_checked_against_the_cached_sha256(folder):
    first, _, _ = _plan(folder)
    write_requests(first)
    sweep, _, _ = _plan(folder)
    path = sweep.evals[0].dataset.path
    pq.write_table(pa.table({"doc_id": [0]}), path)
    with pytest.raises(StoreError, match="is not the one this sweep rendered"):
        store.RequestTables().prepare(sweep.evals[:1])
    assert not store._RENDERED[path].is_rendered


def test_an_lmms_eval_entry_is_cached_and_an_image_it_reads_is_checked(tmp_path, monkeypatch):
    """lmms-eval's entries are cached the same way; an image a document names by path (outside
    the task folder, in no YAML) was read while rendering, so editing it renders again."""
    pytest.importorskip("lmms_eval")
    from PIL import Image

    from lmms_reference import write_task
    from rayeval.lmms import render as lmms_render

    monkeypatch.setenv(render_cache.ENV, str(tmp_path / "cache"))
    (tmp_path / "images").mkdir()
    items = []
    for i, color in enumerate(("red", "blue")):
        path = tmp_path / "images" / f"{i}.png"
        Image.new("RGB", (8, 8), color).save(path)
        items.append({"id": i, "image": str(path), "question": "Which color?", "answer": color})
    write_task(str(tmp_path / "tasks"), items, name="tiny_vqa")
    (tmp_path / "ckpts" / "checkpoint-1").mkdir(parents=True)
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({
        "name": "vqa", "checkpoints": ["ckpts/checkpoint-*"], "output": "results",
        "evals": [{"name": "vqa", "lmms_eval": {"task": "tiny_vqa", "include_path": "tasks"}}]}))
    calls = []
    real = lmms_render.render
    monkeypatch.setattr(lmms_render, "render",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    first, keys, _ = _plan(tmp_path)
    again, keys_again, _ = _plan(tmp_path)
    assert len(calls) == 1 and keys_again == keys and again.evals == first.evals
    # rendered again for the workers: the same digest (lmms-eval's dump_config names its
    # functions by address, which differs per rendering: the digest no longer reads it)
    store.RequestTables().prepare(again.evals)          # the store has no table: written
    assert set(store.RequestTables().shipment(again.evals)) == {again.evals[0].dataset.path}
    assert len(calls) == 2
    Image.new("RGB", (8, 8), "green").save(tmp_path / "images" / "0.png")
    _, keys_after, _ = _plan(tmp_path)
    assert len(calls) == 3 and keys_after["vqa"][1] != keys["vqa"][1]
