"""Tier 1: the sweep file loader. Every error names the file and the key path."""

import os

import pytest
import yaml

from rayeval.errors import SpecError
from rayeval.plan.loader import load_sweep, with_overrides

VALID = {
    "name": "digits",
    "model": {"factory": "my_models:build_mlp", "kwargs": {"hidden": 32}},
    "checkpoints": ["ckpts/step_*"],
    "dataset": {"path": "data/eval.parquet", "inputs": "pixels", "target": "label", "id": "row"},
    "task": "classification",
    "metrics": ["accuracy", "macro_f1", "nll"],
    "batch_size": 64,
    "workers": 2,
    "use_gpu": False,
    "output": "out",
}


def write(tmp_path, data) -> str:
    path = tmp_path / "sweep.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


def with_change(path: str, value, base=None):
    """VALID (or ``base``) with the value at a dotted path replaced (or removed when value is
    DELETE); a number in the path indexes a list."""
    import copy

    data = copy.deepcopy(VALID if base is None else base)
    keys = [int(k) if k.isdigit() else k for k in path.split(".")]
    node = data
    for k in keys[:-1]:
        node = node[k]
    if value is DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return data


DELETE = object()


def test_valid_sweep_is_typed_and_paths_resolve_from_its_folder(tmp_path):
    sweep = load_sweep(write(tmp_path, VALID))
    assert sweep.name == "digits"
    assert sweep.model.factory == "my_models:build_mlp" and sweep.model.kwargs == {"hidden": 32}
    assert sweep.checkpoints == (os.path.join(tmp_path, "ckpts/step_*"),)
    (ev,) = sweep.evals            # the single form: one evaluation named after the data set
    assert ev.name == "eval" and ev.task == "classification"
    assert ev.dataset.path == os.path.join(tmp_path, "data/eval.parquet")
    assert ev.dataset.id == "row" and ev.dataset.inputs == ("pixels",)
    assert [m.key for m in ev.metrics] == ["accuracy", "macro_f1", "nll"]
    assert (ev.batch_size, sweep.workers, sweep.use_gpu) == (64, 2, False)
    assert sweep.output == os.path.join(tmp_path, "out")
    assert sweep.base_dir == str(tmp_path)


def test_defaults_and_uri_locations_kept(tmp_path):
    data = with_change("batch_size", DELETE)
    data.pop("workers")
    data.pop("use_gpu")
    data["output"] = "s3://bucket/evals"
    data["checkpoints"] = "/abs/ckpts/*.pt"
    sweep = load_sweep(write(tmp_path, data))
    assert sweep.output == "s3://bucket/evals"
    assert sweep.checkpoints == ("/abs/ckpts/*.pt",)
    assert (sweep.evals[0].batch_size, sweep.workers, sweep.use_gpu) == (256, 1, False)


@pytest.mark.parametrize("path,value,expected", [
    ("nmae", "x", r"nmae: unknown key; did you mean 'name'\?"),
    ("dataset.targt", "y", r"dataset\.targt: unknown key; did you mean 'target'\?"),
    ("dataset.target", DELETE, r"dataset\.target: missing required key"),
    ("name", DELETE, r"name: missing required key"),
    ("model", {"kwargs": {"hidden": 3}}, r"model\.kwargs: kwargs are for model\.factory"),
    ("model.max_length", 1, r"model\.max_length: must be at least 2"),
    ("dataset.target", 3, r"dataset\.target: expected a non-empty string, got 3 \(int\)"),
    ("workers", "two", r"workers: expected an integer, got 'two' \(str\)"),
    ("workers", 0, r"workers: must be at least 1, got 0"),
    ("batch_size", 1.5, r"batch_size: expected an integer"),
    ("use_gpu", "yes", r"use_gpu: expected true or false"),
    ("metrics", ["accuracy", "nll", "f2"],
     r"metrics\[2\]: unknown metric 'f2' for task 'classification'; choose from: accuracy"),
    ("metrics", ["accuracy", "accuracy"], r"metrics\[1\]: 'accuracy' is listed twice"),
    ("metrics", [], r"metrics: expected a non-empty list"),
    ("metrics", [{"name": "accuracy", "k": 3}], r"metrics\[0\]: metric 'accuracy' has no "
                                                 r"parameter 'k'"),
    ("task", "segmentation", r"task: unknown task 'segmentation'; choose one of"),
    ("model.factory", "my_models.build", r"model\.factory: expected 'module:callable'"),
    ("model.kwargs", [1, 2], r"model\.kwargs: expected a mapping"),
    ("checkpoints", [], r"checkpoints: expected a non-empty list"),
    ("checkpoints", ["a/*", 7], r"checkpoints\[1\]: expected a path or glob"),
    ("dataset", "data.parquet", r"dataset: expected a mapping"),
])
def test_bad_values_name_the_key_path(tmp_path, path, value, expected):
    source = write(tmp_path, with_change(path, value))
    with pytest.raises(SpecError, match=r"^" + __import__("re").escape(source) + ": " + expected):
        load_sweep(source)


def test_yaml_that_does_not_parse_names_line(tmp_path):
    source = write(tmp_path, "name: x\nmodel: [unclosed\n")
    with pytest.raises(SpecError, match=r"not valid YAML at line \d+, column \d+"):
        load_sweep(source)


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(SpecError, match="must be a YAML mapping"):
        load_sweep(write(tmp_path, "- just\n- a list\n"))


def test_missing_sweep_file(tmp_path):
    with pytest.raises(SpecError, match="sweep file not found"):
        load_sweep(str(tmp_path / "nope.yaml"))


def test_cli_overrides(tmp_path, monkeypatch):
    sweep = load_sweep(write(tmp_path, VALID))
    monkeypatch.chdir(tmp_path)
    changed = with_overrides(sweep, workers=3, output="elsewhere")
    assert changed.workers == 3 and changed.output == os.path.join(tmp_path, "elsewhere")
    with pytest.raises(SpecError, match="--workers: must be at least 1"):
        with_overrides(sweep, workers=0)


SUITE = {
    **{k: v for k, v in VALID.items() if k not in ("dataset", "task", "metrics")},
    "bootstrap": {"replicates": 200, "seed": 3},
    "evals": [
        {"name": "clean", "task": "classification", "metrics": ["accuracy", "nll"],
         "dataset": {"path": "data/clean.parquet", "inputs": "pixels", "target": "label"}},
        {"name": "noisy", "task": "classification", "metrics": ["accuracy"], "batch_size": 16,
         "bootstrap": {"replicates": 50},
         "dataset": {"path": "data/noisy.parquet", "inputs": ["pixels", "mask"],
                     "target": "label", "id": "row"}},
        {"name": "photos", "task": "classification", "metrics": ["accuracy"],
         "dataset": {"path": "photos.parquet", "transform": "decode:to_inputs",
                     "target": "label"}},
    ],
}


def test_suite_of_evaluations_with_overrides(tmp_path):
    sweep = load_sweep(write(tmp_path, SUITE))
    clean, noisy, photos = sweep.evals
    assert [e.name for e in sweep.evals] == ["clean", "noisy", "photos"]
    assert (clean.batch_size, noisy.batch_size) == (64, 16)
    assert (clean.bootstrap.replicates, clean.bootstrap.seed) == (200, 3)
    assert (noisy.bootstrap.replicates, noisy.bootstrap.seed) == (50, 3), "keys left out inherit"
    assert noisy.dataset.inputs == ("pixels", "mask") and noisy.dataset.id == "row"
    assert noisy.dataset.columns == ["pixels", "mask", "label", "row"]
    assert photos.dataset.transform == "decode:to_inputs" and photos.dataset.inputs == ()
    assert photos.dataset.columns is None, "a transform without inputs sees every column"
    assert noisy.dataset.key_path == "evals[1].dataset"


def suite_with(index, path, value):
    return with_change(f"evals.{index}.{path}", value, SUITE)


@pytest.mark.parametrize("index,path,value,expected", [
    (2, "dataset.target", DELETE, r"evals\[2\]\.dataset\.target: missing required key"),
    (1, "name", "clean", r"evals\[1\]\.name: 'clean' is used twice \(also evals\[0\]\.name\)"),
    (0, "name", DELETE, r"evals\[0\]\.name: missing required key"),
    (0, "name", "a/b", r"evals\[0\]\.name: 'a/b' cannot name an evaluation"),
    (1, "metrics", ["accuracy", "rmse"], r"evals\[1\]\.metrics\[1\]: metric 'rmse' is for task"),
    (1, "bootstrap", {"confidence": 2}, r"evals\[1\]\.bootstrap\.confidence: expected a number"),
    (1, "batch_size", 0, r"evals\[1\]\.batch_size: must be at least 1"),
    (0, "task", "ranking", r"evals\[0\]\.task: unknown task 'ranking'"),
    (0, "dataset.inputs", [], r"evals\[0\]\.dataset\.inputs: expected a column name or a list"),
    (0, "dataset.inputs", DELETE, r"evals\[0\]\.dataset\.inputs: missing required key"),
    (2, "dataset.transform", "decode", r"evals\[2\]\.dataset\.transform: expected 'module:callable'"),
    (0, "dataset.name", "x", r"evals\[0\]\.dataset\.name: unknown key"),
    (0, "extra", 1, r"evals\[0\]\.extra: unknown key"),
])
def test_suite_errors_name_the_key_path(tmp_path, index, path, value, expected):
    source = write(tmp_path, suite_with(index, path, value))
    with pytest.raises(SpecError, match=r"^" + __import__("re").escape(source) + ": " + expected):
        load_sweep(source)


def test_suite_and_single_form_are_exclusive(tmp_path):
    with pytest.raises(SpecError, match=r"task: give the evaluations either as evals: or"):
        load_sweep(write(tmp_path, {**SUITE, "task": "classification"}))
    with pytest.raises(SpecError, match=r"evals: expected a non-empty list"):
        load_sweep(write(tmp_path, {**SUITE, "evals": []}))
    no_task = {k: v for k, v in VALID.items() if k != "task"}
    with pytest.raises(SpecError, match=r"task: missing required key \(or list the"):
        load_sweep(write(tmp_path, no_task))


def test_editing_the_users_code_is_a_new_cell(tmp_path):
    """The content key covers the source of the factory's (and transform's) module: a fixed
    factory never serves the stale cached number of the old one."""
    import importlib
    import sys

    from rayeval.io.checkpoints import CheckpointRef
    from rayeval.io.data import DatasetInfo
    from rayeval.plan.cells import Evaluation, cell_key

    (tmp_path / "my_models_k.py").write_text("def build_mlp(hidden=32):\n    return None\n")
    data = {**VALID, "model": {"factory": "my_models_k:build_mlp"}}
    sweep = load_sweep(write(tmp_path, data))
    ev = Evaluation(sweep.evals[0], DatasetInfo(files=(), num_rows=1, input_shapes=(),
                                                fingerprint="f"), 4)
    ref = CheckpointRef(str(tmp_path / "c.pt"), 1)
    before = cell_key(sweep, ev, ref, "fp")
    assert cell_key(sweep, ev, ref, "fp") == before
    (tmp_path / "my_models_k.py").write_text("def build_mlp(hidden=32):\n    return 1\n")
    sys.modules.pop("my_models_k", None)
    importlib.invalidate_caches()
    assert cell_key(sweep, ev, ref, "fp") != before
