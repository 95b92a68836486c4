"""Tier 1: the sweep file loader. Every error names the file and the key path."""

import os

import pytest
import yaml

from rayeval.errors import SpecError
from rayeval.spec import load_sweep

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


def with_change(path: str, value):
    """VALID with the value at a dotted path replaced (or removed when value is DELETE)."""
    import copy

    data = copy.deepcopy(VALID)
    keys = path.split(".")
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
    assert sweep.dataset.path == os.path.join(tmp_path, "data/eval.parquet")
    assert sweep.dataset.id == "row" and sweep.dataset.name == "eval"
    assert [m.key for m in sweep.metrics] == ["accuracy", "macro_f1", "nll"]
    assert (sweep.batch_size, sweep.workers, sweep.use_gpu) == (64, 2, False)
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
    assert (sweep.batch_size, sweep.workers, sweep.use_gpu) == (256, 1, False)


@pytest.mark.parametrize("path,value,expected", [
    ("nmae", "x", r"nmae: unknown key; did you mean 'name'\?"),
    ("dataset.targt", "y", r"dataset\.targt: unknown key; did you mean 'target'\?"),
    ("dataset.target", DELETE, r"dataset\.target: missing required key"),
    ("name", DELETE, r"name: missing required key"),
    ("model", DELETE, r"model: missing required key"),
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
    changed = sweep.with_overrides(workers=3, output="elsewhere")
    assert changed.workers == 3 and changed.output == os.path.join(tmp_path, "elsewhere")
    with pytest.raises(SpecError, match="--workers: must be at least 1"):
        sweep.with_overrides(workers=0)
