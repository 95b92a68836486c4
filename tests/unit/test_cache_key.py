"""Tier 1: a cell's cache key is walked from the schema. Changing any field declared to change
a cell's numbers re-evaluates the cell; changing any other field serves it from the store.
Checked with the real planner (``make_plan``) over a real ``ResultStore`` holding the first
plan's cells, on sweeps parsed from small mappings over tiny local data."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayeval.config import schema
from rayeval.plan.lm_eval_entries import write_requests
from rayeval.plan.loader import parse_sweep
from rayeval.core import tasks
from rayeval.io.data import inspect_dataset
from rayeval.plan.cells import Evaluation, make_plan
from rayeval.io.store import ResultStore
from support import FEATURES, MODEL_MODULE

MODELS = "cachekey_models"          # module names of their own: sys.modules caches by name
DECODE = "cachekey_decode"
DECODE_MODULE = ("import torch\n\ndef to_inputs(table):\n"
                 "    return torch.tensor(table.column('x').to_pylist())\n")

TENSOR = {
    "name": "t",
    "model": {"factory": f"{MODELS}:build", "kwargs": {"hidden": 16}},
    "checkpoints": ["ckpts/*"],
    "evals": [{"name": "clean", "task": "classification", "metrics": [
        "accuracy", {"name": "top_k_accuracy", "k": 2}],
        "dataset": {"path": "tensor.parquet", "inputs": "x", "target": "y"}}],
    "bootstrap": {"replicates": 10},
    "output": "out",
}
NO_BOOTSTRAP = {**TENSOR, "bootstrap": {"replicates": 0}}
LM = {**TENSOR, "evals": [{"name": "lm", "task": "language_modeling", "metrics": ["perplexity"],
                           "dataset": {"path": "lm.parquet", "inputs": "tokens"}}]}
TEXT_BASE = {"name": "t", "checkpoints": ["hf/*"], "output": "out",
             "bootstrap": {"replicates": 10}}
MC = {**TEXT_BASE, "evals": [{"name": "mc", "task": "multiple_choice", "metrics": ["acc"],
                              "dataset": {"path": "text.parquet", "prompt": "prompt",
                                          "choices": "choices", "target": "answer"}}]}
TP = {**TEXT_BASE, "evals": [{"name": "tp", "task": "text_perplexity",
                              "metrics": ["word_perplexity"],
                              "dataset": {"path": "text.parquet", "text": "text"}}]}
GEN = {**TEXT_BASE, "evals": [{"name": "gen", "task": "generation", "metrics": ["exact_match"],
                               "dataset": {"path": "text.parquet", "prompt": "prompt",
                                           "target": "answer_text"},
                               "generation": {"until": ["\n"], "max_new_tokens": 8}}]}
# A judged generation (docs/judges.md); the judge's folder is written by the ``home`` fixture.
JUDGED = {**GEN, "evals": [{**GEN["evals"][0], "metrics": ["exact_match", "judge"],
                            "judge": {"model": "judge", "prompt": "{{ response }}",
                                      "verdict": {"yes": 1, "no": 0}}}]}
PAIRWISE = {**JUDGED, "evals": [{**JUDGED["evals"][0], "judge": {
    **JUDGED["evals"][0]["judge"], "baseline": "hf/checkpoint-1",
    "prompt": "{{ response_a }} {{ response_b }}"}}]}
# An lm-eval task over the same text (YAMLs written by the ``home`` fixture).
LME = {**TEXT_BASE, "evals": [{"name": "lme", "lm_eval": {"task": "tiny_mc",
                                                          "include_path": "lmtasks"}}]}
# An lmms-eval task over images (YAMLs and PNGs written by the ``home`` fixture).
LMME = {**TEXT_BASE, "evals": [{"name": "lmme", "lmms_eval": {"task": "tiny_vqa",
                                                            "include_path": "lmmstasks"}}]}
BASES = {"tensor": TENSOR, "no_bootstrap": NO_BOOTSTRAP, "lm": LM, "mc": MC, "tp": TP,
         "gen": GEN, "lme": LME, "lmme": LMME, "judged": JUDGED, "pairwise": PAIRWISE}


def _lm_eval0(**changes):
    """A change of the parsed sweep's lm-eval entry (what needs a chat tokenizer to render)."""
    return lambda s: _eval0(s, lm_eval=dataclasses.replace(s.evals[0].lm_eval, **changes))


def _eval0(s, **changes):
    return s.replace(evals=(dataclasses.replace(s.evals[0], **changes),) + s.evals[1:])


def _metric1(s, **changes):
    ev = s.evals[0]
    metrics = (ev.metrics[0], dataclasses.replace(ev.metrics[1], **changes))
    return _eval0(s, metrics=metrics)


def _second_eval(raw):
    raw["evals"].append({**raw["evals"][0], "name": "other"})
    return raw


# (the field it changes, the sweep it starts from, the change: a (dotted path, value) in the
# mapping, a function of the mapping, or a function of the parsed Sweep for what the sweep file
# cannot change alone). Dotted paths index lists with numbers.
RE_EVALUATED = [
    ("Sweep.name", "tensor", ("name", "t2")),
    ("ModelSpec.factory", "tensor", ("model.factory", f"{MODELS}:build_relu")),
    ("ModelSpec.kwargs", "tensor", ("model.kwargs", {"hidden": 8})),
    ("ModelSpec.dtype", "tensor", ("model.dtype", "float64")),
    ("ModelSpec.tokenizer", "mc", ("model.tokenizer", "tok_a")),
    ("ModelSpec.max_length", "tp", ("model.max_length", 64)),
    ("CheckpointSpec.key", "tensor", ("checkpoint.key", "ema")),
    ("CheckpointSpec.strip_prefix", "tensor", ("checkpoint.strip_prefix", "module.")),
    ("EvalSpec.name", "tensor", ("evals.0.name", "clean2")),
    ("EvalSpec.task", "tensor", lambda s: _eval0(s, task="regression")),
    ("DatasetSpec.inputs", "tensor", ("evals.0.dataset.inputs", "x2")),
    ("DatasetSpec.target", "tensor", ("evals.0.dataset.target", "y2")),
    ("DatasetSpec.id", "tensor", ("evals.0.dataset.id", "row")),
    ("DatasetSpec.transform", "tensor", ("evals.0.dataset.transform", f"{DECODE}:to_inputs")),
    ("DatasetSpec.ignore_index", "lm", ("evals.0.dataset.ignore_index", -1)),
    ("DatasetSpec.pad_id", "lm", ("evals.0.dataset.pad_id", 1)),
    ("DatasetSpec.prompt", "mc", ("evals.0.dataset.prompt", "prompt2")),
    ("DatasetSpec.prompt", "gen", ("evals.0.dataset.prompt", "prompt2")),
    ("DatasetSpec.choices", "mc", ("evals.0.dataset.choices", "choices2")),
    ("DatasetSpec.delimiter", "mc", ("evals.0.dataset.delimiter", "::")),
    ("DatasetSpec.text", "tp", ("evals.0.dataset.text", "text2")),
    # a string column passes as image paths here (only the schema is read while planning)
    ("DatasetSpec.images", "gen", ("evals.0.dataset.images", "prompt")),
    ("DatasetSpec.target", "gen", ("evals.0.dataset.target", "answer_text2")),
    ("MetricSpec.name", "tensor", ("evals.0.metrics.0", "nll")),
    ("MetricSpec.params", "tensor", lambda s: _metric1(s, params=(("k", 3),))),
    ("MetricSpec.key", "tensor", lambda s: _metric1(s, key="top2")),
    ("MetricSpec.task", "tensor", lambda s: _metric1(s, task="regression")),
    ("Bootstrap.replicates", "tensor", ("bootstrap.replicates", 20)),
    ("Bootstrap.replicates", "tensor", ("evals.0.bootstrap", {"replicates": 20})),
    ("Bootstrap.confidence", "tensor", ("bootstrap.confidence", 0.9)),
    ("Bootstrap.seed", "tensor", ("bootstrap.seed", 1)),
    ("Bootstrap.buckets", "tensor", ("bootstrap.buckets", 64)),
    ("Generation.until", "gen", ("evals.0.generation.until", ["\n\n"])),
    ("Generation.max_new_tokens", "gen", ("evals.0.generation.max_new_tokens", 16)),
    # backend vllm's settings, on the parsed sweep: the file would need vLLM installed
    ("ModelSpec.backend", "gen", lambda s: s.replace(
        model=dataclasses.replace(s.model, backend="vllm"))),
    ("ModelSpec.vllm", "gen", lambda s: s.replace(
        model=dataclasses.replace(s.model, vllm={"max_model_len": 64}))),
    ("Generation.temperature", "gen", lambda s: _eval0(s, generation=dataclasses.replace(
        s.evals[0].generation, temperature=0.5))),
    ("Generation.repeats", "gen", lambda s: _eval0(s, generation=dataclasses.replace(
        s.evals[0].generation, repeats=3))),
    ("Generation.top_p", "gen", ("evals.0.generation.top_p", 0.9)),
    ("Generation.seed", "gen", ("evals.0.generation.seed", 3)),
    ("JudgeSpec.prompt", "judged", ("evals.0.judge.prompt", "{{ target }} {{ response }}")),
    ("JudgeSpec.verdict", "judged", ("evals.0.judge.verdict", {"yes": 1, "no": -1})),
    ("JudgeSpec.max_new_tokens", "judged", ("evals.0.judge.max_new_tokens", 4)),
    ("JudgeSpec.backend", "judged", ("evals.0.judge.backend", "hf")),
    ("JudgeSpec.dtype", "judged", ("evals.0.judge.dtype", "bfloat16")),
    ("LmEvalSpec.task", "lme", ("evals.0.lm_eval.task", "tiny_mc2")),
    ("LmEvalSpec.include_path", "lme", ("evals.0.lm_eval.include_path", "lmtasks2")),
    ("LmEvalSpec.num_fewshot", "lme", ("evals.0.lm_eval.num_fewshot", 1)),
    ("LmEvalSpec.apply_chat_template", "lme", _lm_eval0(apply_chat_template=True)),
    ("LmEvalSpec.fewshot_as_multiturn", "lme", _lm_eval0(fewshot_as_multiturn=True)),
    ("LmEvalSpec.system_instruction", "lme", ("evals.0.lm_eval.system_instruction", "Be.")),
    ("LmEvalSpec.gen_kwargs", "lme", ("evals.0.lm_eval.gen_kwargs", {"max_gen_toks": 4})),
    ("LmEvalSpec.limit", "lme", ("evals.0.lm_eval.limit", 1)),
    ("LmEvalSpec.fewshot_seed", "lme", ("evals.0.lm_eval.fewshot_seed", 7)),
    ("LmmsEvalSpec.task", "lmme", ("evals.0.lmms_eval.task", "tiny_vqa2")),
    ("LmmsEvalSpec.include_path", "lmme", ("evals.0.lmms_eval.include_path", "lmmstasks2")),
    ("LmmsEvalSpec.model_name", "lmme", ("evals.0.lmms_eval.model_name", "other")),
    ("LmmsEvalSpec.gen_kwargs", "lmme", ("evals.0.lmms_eval.gen_kwargs",
                                         {"max_new_tokens": 4})),
    ("LmmsEvalSpec.limit", "lmme", ("evals.0.lmms_eval.limit", 1)),
]

CACHED = [
    ("DatasetSpec.format", "tensor", ("evals.0.dataset.format", "parquet")),
    ("DatasetSpec.cpus", "tensor", ("evals.0.dataset.cpus", 2)),
    ("DatasetSpec.concurrency", "tensor", ("evals.0.dataset.concurrency", 3)),
    ("Sweep.checkpoints", "tensor", ("checkpoints", ["ckpts/step_*.pt"])),
    ("Sweep.evals", "tensor", _second_eval),
    ("Sweep.workers", "tensor", ("workers", 2)),
    ("Sweep.use_gpu", "tensor", ("use_gpu", True)),
    ("Sweep.output", "tensor", ("output", "elsewhere")),
    ("Sweep.resources_per_worker", "tensor", ("resources_per_worker", {"CPU": 2})),
    ("Sweep.source", "tensor", lambda s: s.replace(source="other.yaml")),
    ("EvalSpec.batch_size", "tensor", ("batch_size", 7)),
    ("EvalSpec.batch_size", "mc", ("evals.0.batch_size", 7)),
    ("EvalSpec.samples", "mc", ("evals.0.samples", False)),
    ("EvalSpec.key_path", "tensor", lambda s: _eval0(s, key_path="elsewhere")),
    ("DatasetSpec.path", "tensor", ("evals.0.dataset.path", "tens*.parquet")),
    ("DatasetSpec.key_path", "tensor", lambda s: _eval0(s, dataset=dataclasses.replace(
        s.evals[0].dataset, key_path="elsewhere"))),
    # the judge's files are in the key by fingerprint, not by how the path is spelled
    ("JudgeSpec.model", "judged", ("evals.0.judge.model", "./judge/")),
    ("JudgeSpec.batch_size", "judged", ("evals.0.judge.batch_size", 2)),
    # the baseline's generations' key is in the key, not how its path is spelled
    ("JudgeSpec.baseline", "pairwise", ("evals.0.judge.baseline", "./hf/checkpoint-1/")),
    ("CheckpointSpec.trust_pickle", "tensor", ("checkpoint.trust_pickle", True)),
    ("ModelSpec.tokenizer", "tensor", ("model.tokenizer", "tok_a")),      # text tasks only
    ("ModelSpec.max_length", "tensor", ("model.max_length", 64)),
    # how log-likelihoods are computed, equal within float tolerance (like batch_size)
    ("ModelSpec.share_prefixes", "mc", ("model.share_prefixes", True)),
    ("ModelSpec.batch_tokens", "mc", ("model.batch_tokens", 512)),
    ("Bootstrap.seed", "no_bootstrap", ("bootstrap.seed", 1)),         # no replicates drawn
    ("Bootstrap.confidence", "no_bootstrap", ("bootstrap.confidence", 0.5)),
    ("Bootstrap.buckets", "no_bootstrap", ("bootstrap.buckets", 8)),
    ("Recovery.max_restarts", "tensor", ("recovery.max_restarts", 0)),
    ("Recovery.stall_timeout_s", "tensor", ("recovery.stall_timeout_s", 5)),
    ("Resume.every", "tensor", ("resume.every", 5)),
    ("Parallelism.shard", "tensor", lambda raw: {**raw, "workers": 2,
                                                  "parallelism": {"shard": 2}}),
    ("Parallelism.wrap", "tensor", ("parallelism.wrap", ["Linear"])),
    ("Parallelism.tensor", "gen", lambda s: s.replace(
        workers=2, parallelism=dataclasses.replace(s.parallelism, tensor=2))),
    # racing changes which cells are complete, not a complete cell's numbers
    ("Select.metric", "tensor", lambda s: s.replace(select=schema.Select(s.evals[0].name))),
    ("Select.top", "tensor", lambda s: s.replace(select=schema.Select(s.evals[0].name, top=2))),
    ("Select.confidence", "tensor", lambda s: s.replace(
        select=schema.Select(s.evals[0].name, confidence=0.9))),
    ("Select.min_items", "tensor", lambda s: s.replace(
        select=schema.Select(s.evals[0].name, min_items=100))),
    # how the board's aggregate combines evaluations: reading, not scoring
    ("Aggregate.weights", "tensor", lambda s: s.replace(aggregate=schema.Aggregate(
        how="weights", weights=((s.evals[0].name, 2.0),)))),
    ("WatchSpec.ready", "tensor", ("watch.ready", "COMPLETE")),
    ("WatchSpec.order", "tensor", ("watch.order", "newest")),
    ("Trackers.mlflow", "tensor", ("trackers.mlflow", {})),
    ("MlflowTracker.uri", "tensor", ("trackers.mlflow.uri", "file:/tmp/mlruns")),
    ("MlflowTracker.experiment", "tensor", ("trackers.mlflow.experiment", "e")),
    ("MlflowTracker.run_id", "tensor", ("trackers.mlflow.run_id", "abc")),
    ("Trackers.wandb", "tensor", ("trackers.wandb.project", "p")),
    ("WandbTracker.project", "tensor", ("trackers.wandb.project", "q")),
    ("WandbTracker.entity", "tensor", ("trackers.wandb", {"project": "p", "entity": "me"})),
    ("WandbTracker.run_id", "tensor", ("trackers.wandb", {"project": "p", "run_id": "r"})),
    ("WandbTracker.mode", "tensor", ("trackers.wandb", {"project": "p", "mode": "offline"})),
]


def _schema_classes():
    """Every schema dataclass a Sweep holds, directly or inside another."""
    seen, todo = [], [schema.Sweep]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo += [held[0] for f in dataclasses.fields(cls)
                     if (held := schema.section(cls, f))]
    return seen


def _leaves(which):
    """'Class.field' of every leaf field (not a section) whose declaration ``which`` takes."""
    return {f"{cls.__name__}.{f.name}" for cls in _schema_classes()
            for f in dataclasses.fields(cls) if not schema.section(cls, f) and which(f)}


def test_every_field_has_a_doc_and_declares_whether_it_changes_numbers():
    classes = _schema_classes()
    assert {c.__name__ for c in classes} >= {"Sweep", "EvalSpec", "DatasetSpec", "ModelSpec",
                                             "MetricSpec", "Bootstrap", "Generation",
                                             "CheckpointSpec", "WandbTracker"}
    for cls in classes:
        for f in dataclasses.fields(cls):
            where = f"{cls.__name__}.{f.name}"
            assert f.metadata.get("numbers") in (True, False, schema.TEXT), where
            assert len(f.metadata.get("doc", "").split()) >= 3, where
    internal = {f"{c.__name__}.{f.name}" for c in classes for f in dataclasses.fields(c)
                if schema.yaml_key(f) is None}
    assert {"Sweep.base_dir", "Sweep.source", "DatasetSpec.key_path",
            "EvalSpec.key_path"} <= internal


def test_every_field_is_covered_by_a_case_below():
    """A field added to the schema fails here until a case changes it."""
    changes_numbers = _leaves(lambda f: f.metadata["numbers"])
    assert {c for c, _, _ in RE_EVALUATED} == changes_numbers
    others = _leaves(lambda f: not f.metadata["numbers"] and schema.yaml_key(f) is not None)
    assert others <= {c for c, _, _ in CACHED}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """Tiny data (tensor, token and text columns), model and transform modules, a torch
    checkpoint, a Hugging Face-like folder and two tokenizer folders."""
    d = tmp_path_factory.mktemp("cachekey")
    (d / f"{MODELS}.py").write_text(MODEL_MODULE)
    (d / f"{DECODE}.py").write_text(DECODE_MODULE)
    rng = np.random.default_rng(0)
    vec = pa.list_(pa.float32(), FEATURES)
    pq.write_table(pa.table({
        "row": pa.array(np.arange(6), pa.int64()),
        "x": pa.array(rng.normal(size=(6, FEATURES)).astype(np.float32).tolist(), vec),
        "x2": pa.array(rng.normal(size=(6, FEATURES)).astype(np.float32).tolist(), vec),
        "y": pa.array([0, 1, 2, 3, 0, 1], pa.int64()),
        "y2": pa.array([1, 1, 2, 2, 0, 0], pa.int64())}), d / "tensor.parquet")
    pq.write_table(pa.table({"tokens": pa.array([[1, 2, 3], [4, 5]], pa.list_(pa.int64()))}),
                   d / "lm.parquet")
    pq.write_table(pa.table({
        "prompt": ["Q: one", "Q: two"], "prompt2": ["one?", "two?"],
        "choices": [["a", "b"], ["c", "d"]], "choices2": [["x", "y"], ["z", "w"]],
        "answer": pa.array([0, 1], pa.int64()), "answer_text": ["a", "d"],
        "answer_text2": ["b", "c"], "text": ["some words", "more words"],
        "text2": ["other words", "yet more"]}), d / "text.parquet")
    (d / "ckpts").mkdir()
    (d / "ckpts" / "step_1.pt").write_bytes(b"weights")
    (d / "hf" / "checkpoint-1").mkdir(parents=True)
    (d / "hf" / "checkpoint-1" / "config.json").write_text("{}")
    (d / "judge").mkdir()
    (d / "judge" / "config.json").write_text("{}")
    for name, body in (("tok_a", "{}"), ("tok_b", "{\"b\": 1}")):
        (d / name).mkdir()
        (d / name / "tokenizer.json").write_text(body)
    for folder in ("lmtasks", "lmtasks2"):          # the same lm-eval tasks in two places
        (d / folder).mkdir()
        for task, prompt in (("tiny_mc", "prompt"), ("tiny_mc2", "prompt2")):
            (d / folder / f"{task}.yaml").write_text(
                f"task: {task}\ndataset_path: parquet\n"
                f"dataset_kwargs: {{data_files: {{test: {d / 'text.parquet'}}}}}\n"
                "test_split: test\noutput_type: multiple_choice\n"
                f"doc_to_text: '{{{{{prompt}}}}}'\ndoc_to_choice: choices\n"
                "doc_to_target: answer\nmetric_list: [{metric: acc}]\n")
    if importlib.util.find_spec("lmms_eval") is not None:
        _lmms_tasks(d)
    return d


def _lmms_tasks(d):
    """Two lmms-eval tasks over two tiny PNGs, in two folders."""
    from PIL import Image

    items = d / "vqa.jsonl"
    with open(items, "w") as f:
        for i, (colour, answer) in enumerate((("red", "yes"), ("blue", "no"))):
            Image.new("RGB", (8, 8), colour).save(d / f"img{i}.png")
            f.write(json.dumps({"image": str(d / f"img{i}.png"), "question": "Red?",
                                "question2": "Is it red?", "answer": answer}) + "\n")
    for folder in ("lmmstasks", "lmmstasks2"):
        (d / folder).mkdir()
        for task, question in (("tiny_vqa", "question"), ("tiny_vqa2", "question2")):
            (d / folder / f"{task}.yaml").write_text(
                f"task: {task}\ndataset_path: json\n"
                f"dataset_kwargs: {{data_files: {{test: {items}}}}}\n"
                "test_split: test\noutput_type: generate_until\ndoc_to_visual: image\n"
                f"doc_to_text: {question}\ndoc_to_target: answer\n"
                "generation_kwargs: {max_new_tokens: 2}\n"
                "metric_list: [{metric: exact_match, aggregation: mean, "
                "higher_is_better: true}]\n")


def plan(raw, home, store, edit=None):
    sweep = parse_sweep(copy.deepcopy(raw), base_dir=str(home), source="sweep.yaml")
    if edit is not None:
        sweep = edit(sweep)
    write_requests(sweep)          # the planning step writes the lm-eval request tables
    evaluations = tuple(Evaluation(spec, inspect_dataset(spec.dataset, tasks.get(spec.task)), 4)
                        for spec in sweep.evals)
    return make_plan(sweep, evaluations, store)


def stored(home, base, where):
    """A store (in the folder ``where``) holding the base sweep's cells, and their count."""
    store = ResultStore(str(where / "store"))
    first = plan(BASES[base], home, store)
    assert first.cells and not first.cached
    for cell in first.cells:
        if not store.has(cell.key):
            store.write_cell(cell.key, [{
                "sweep": "t", "checkpoint": cell.checkpoint.location, "step": 1,
                "evaluation": cell.evaluation, "metric": "m", "value": 0.5, "ci_low": None,
                "ci_high": None, "num_samples": 1, "world_size": 1,
                "higher_is_better": True}])
    again = plan(BASES[base], home, store)
    assert not again.cells and len(again.cached) == len(first.cells), "unchanged: all cached"
    return store, len(first.cells)


def changed_plan(home, store, base, change):
    raw, edit = copy.deepcopy(BASES[base]), None
    if isinstance(change, tuple):
        path, value = change
        keys = [int(k) if k.isdigit() else k for k in path.split(".")]
        node = raw
        for k in keys[:-1]:
            node = node[k] if isinstance(k, int) else node.setdefault(k, {})
        node[keys[-1]] = value
    elif change.__code__.co_varnames[:1] == ("raw",):
        raw = change(raw)
    else:
        edit = change
    return plan(raw, home, store, edit)


@pytest.mark.parametrize("field,base,change", RE_EVALUATED,
                         ids=[f"{c}-{b}" for c, b, _ in RE_EVALUATED])
def test_a_number_changing_field_re_evaluates_the_cell(home, tmp_path, field, base, change):
    if base == "lmme" and importlib.util.find_spec("lmms_eval") is None:
        pytest.skip("lmms-eval is not installed (pip install --no-deps lmms-eval==0.7.3)")
    store, n = stored(home, base, tmp_path)
    p = changed_plan(home, store, base, change)
    assert len(p.cells) == n and not p.cached, f"{field}: a changed value served old numbers"


@pytest.mark.parametrize("field,base,change", CACHED, ids=[f"{c}-{b}" for c, b, _ in CACHED])
def test_any_other_field_keeps_the_cell_cached(home, tmp_path, field, base, change):
    store, n = stored(home, base, tmp_path)
    p = changed_plan(home, store, base, change)
    assert len(p.cached) == n, f"{field}: re-evaluated though the numbers cannot change"


def test_the_tokenizers_files_are_in_a_text_cells_key(home, tmp_path):
    """Rewriting the tokenizer folder at the same place is a new cell too."""
    raw = {**MC, "model": {"tokenizer": "tok_b"}}
    store = ResultStore(str(tmp_path / "store"))
    first = plan(raw, home, store)
    store.write_cell(first.cells[0].key, [{
        "sweep": "t", "checkpoint": "c", "step": 1, "evaluation": "mc", "metric": "acc",
        "value": 0.5, "ci_low": None, "ci_high": None, "num_samples": 1, "world_size": 1,
        "higher_is_better": True}])
    assert plan(raw, home, store).cached
    (home / "tok_b" / "tokenizer.json").write_text("{\"b\": 22}")
    assert not plan(raw, home, store).cached


def test_the_judges_files_are_in_a_judged_cells_key(home, tmp_path):
    """Rewriting the judge's folder at the same place judges again; the generations' key
    (what the judge reads) stays."""
    store = ResultStore(str(tmp_path / "store"))
    first = plan(JUDGED, home, store)
    (home / "judge" / "config.json").write_text("{\"changed\": 1}")
    again = plan(JUDGED, home, store)
    assert again.cells[0].key != first.cells[0].key
    assert again.cells[0].generation == first.cells[0].generation
    plain = plan(GEN, home, store)
    assert plain.cells[0].key == first.cells[0].generation     # the same generation's key


@pytest.mark.parametrize("base", ["tensor", "judged", "pairwise"])
def test_a_plans_keys_are_each_cells_own(home, tmp_path, base):
    """The plan computes what an evaluation's cells key alike once (``evaluation_ident``);
    each cell's key, and a judged cell's generations' key, is still what ``cell_key`` and
    ``generation_key`` give that cell alone, for every checkpoint, not the first one's."""
    from rayeval.io.checkpoints import CheckpointRef, expand_checkpoints
    from rayeval.plan.cells import cell_key, checkpoint_fingerprint, generation_key

    raw = copy.deepcopy(BASES[base])
    raw["evals"].append({**raw["evals"][0], "name": "other", "bootstrap": {"seed": 1}})
    sweep = parse_sweep(raw, base_dir=str(home), source="sweep.yaml")
    evaluations = tuple(Evaluation(spec, inspect_dataset(spec.dataset, tasks.get(spec.task)), 4)
                        for spec in sweep.evals)
    ready = [(ref, checkpoint_fingerprint(ref.location))
             for ref in expand_checkpoints(sweep.checkpoints)]
    ready.append((CheckpointRef(ready[0][0].location + "-other", 2), "other-fingerprint"))
    p = make_plan(sweep, evaluations, ResultStore(str(tmp_path / "store")), ready=ready)
    assert len(p.cells) == 2 * len(evaluations)
    by_name = {e.name: e for e in evaluations}
    judges = {e.name: checkpoint_fingerprint(e.spec.judge.model) for e in evaluations
              if e.spec.judge is not None}
    for cell in p.cells:
        ev = by_name[cell.evaluation]
        alone = cell_key(sweep, ev, cell.checkpoint, cell.fingerprint, judges.get(ev.name),
                         cell.baseline)
        assert cell.key == alone
        if ev.spec.judge is not None:
            assert cell.generation == generation_key(sweep, ev, cell.checkpoint,
                                                     cell.fingerprint)
    assert len({c.key for c in p.cells}) == len(p.cells)
