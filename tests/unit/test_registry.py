"""Registries: a name registered twice is refused, an unknown name lists the known ones, and the
tasks, metrics and checkpoint layouts are held in them (a new task is one registered class)."""

import os
import pickle

import pytest
import torch

from rayeval.config.registry import Registry
from rayeval.core import metrics, tasks
from rayeval.core.tasks import TASKS
from rayeval.errors import RayevalError, RegistryError
from rayeval.io import layouts


def test_get_and_registration_order():
    reg = Registry("colour")
    reg.add("red", 1)
    reg.add("green", 2)
    reg.add("blue", 3)
    assert reg.get("green") == 2 and reg["blue"] == 3
    assert list(reg) == reg.names() == ["red", "green", "blue"]
    assert reg.items() == [("red", 1), ("green", 2), ("blue", 3)]
    assert "red" in reg and "pink" not in reg and ["unhashable"] not in reg
    assert len(reg) == 3


def test_duplicate_name_is_refused_naming_both():
    reg = Registry("colour")

    @reg.register()
    class Red:
        name = "red"

    with pytest.raises(RegistryError, match=r"colour 'red' is registered twice: by "
                                            r"\S+Red and by \S+Crimson; give one") as info:
        @reg.register()
        class Crimson:
            name = "red"
    assert info.value.fields() == {"kind": "colour", "name": "red"}
    assert reg.get("red") is Red          # the first registration stands


def test_unknown_name_lists_the_known_names_in_one_line():
    reg = Registry("colour")
    reg.add("red", 1)
    reg.add("green", 2)
    with pytest.raises(RegistryError) as info:
        reg.get("rde")
    assert str(info.value) == "unknown colour 'rde'; choose one of: red, green"
    assert "\n" not in str(info.value)
    assert isinstance(info.value, RayevalError)    # the CLI prints it as one line
    assert info.value.name == "rde" and info.value.kind == "colour"
    with pytest.raises(RegistryError, match=r"unknown colour \['red'\]"):
        reg.get(["red"])                  # a YAML list where a name belongs
    assert Registry("colour").unknown("x") == "unknown colour 'x'; choose one of: none"


def test_register_names_an_instance_and_refuses_a_nameless_class():
    reg = Registry("shape")

    @reg.register(instance=True)
    class Circle:
        name = "circle"

    @reg.register("square")
    def make_square():
        return "square"

    assert isinstance(reg.get("circle"), Circle) and reg.get("square") is make_square
    with pytest.raises(RegistryError, match="a shape needs a non-empty name, got None"):
        reg.register()(type("Nameless", (), {}))


def test_tasks_are_registered_instances_in_order():
    assert TASKS.names() == ["classification", "regression", "language_modeling",
                             "multiple_choice", "text_perplexity", "generation", "lm_eval",
                             "lmms_eval"]
    assert tasks.get("regression") is TASKS.get("regression")
    assert isinstance(tasks.get("generation"), tasks.Task)
    with pytest.raises(RegistryError, match="unknown task 'clasification'; choose one of: "
                                            "classification, regression, language_modeling"):
        tasks.get("clasification")


def test_a_second_task_with_a_taken_name_is_refused():
    with pytest.raises(RegistryError, match="task 'regression' is registered twice"):
        @TASKS.register(instance=True)
        class Regression2(tasks.Task):
            name = "regression"
    assert type(TASKS.get("regression")).__name__ == "Regression"


def test_metrics_are_registered_per_task():
    assert metrics.for_task("regression").names() == ["mse", "rmse", "mae", "r2", "pearson"]
    assert tasks.get("classification").metrics.get("macro_f1").name == "macro_f1"
    assert metrics.for_task("no_such_task").names() == []
    assert "no_such_task" not in metrics.REGISTRY     # asking does not create it
    with pytest.raises(RegistryError, match="metric for task 'regression' 'mae' is registered "
                                            "twice"):
        @metrics.register
        class MAE2(metrics.MAE):
            pass
    with pytest.raises(RegistryError, match="names no task; set its task attribute"):
        @metrics.register
        class Orphan(metrics.Metric):
            name = "orphan"
    assert metrics.for_task("regression").get("mae") is metrics.MAE


def test_every_layout_detected_has_a_reader():
    assert set(layouts.READERS) == {"torch", "safetensors", "safetensors-sharded",
                                    "torch-sharded", "dcp"}
    with pytest.raises(RegistryError, match="unknown checkpoint layout 'onnx'"):
        layouts.READERS.get("onnx")


class Toy(tasks.Task):
    """A task that exists only in this test: regression rows, its own metric."""
    name = "toy"


class ToyMean(metrics.Metric):
    name = "toy_mean"
    task = "toy"

    def init_state(self, c):
        return {"sum": torch.zeros((), dtype=torch.float64)}

    def rows(self, outputs, targets):
        return {"sum": outputs.to(torch.float64)}

    def compute(self, s):
        return s["sum"]


@pytest.fixture
def toy_registered(monkeypatch):
    """Toy and ToyMean registered for one test; the registries are put back afterwards."""
    monkeypatch.setattr(TASKS, "_items", dict(TASKS._items))
    monkeypatch.setattr(metrics, "REGISTRY", dict(metrics.REGISTRY))
    TASKS.register(instance=True)(Toy)
    metrics.register(ToyMean)
    yield


def test_a_registered_task_is_all_the_sweep_loader_needs(toy_registered, tmp_path):
    from rayeval.plan.loader import load_sweep

    (tmp_path / "sweep.yaml").write_text(
        "name: s\ncheckpoints: ['ckpt/*.pt']\nmodel: {factory: 'm:f'}\noutput: out\n"
        "evals:\n  - name: t\n    task: toy\n    dataset: {path: d.parquet, inputs: x, "
        "target: y}\n    metrics: [toy_mean]\n")
    sweep = load_sweep(str(tmp_path / "sweep.yaml"))
    assert [(e.task, [m.name for m in e.metrics]) for e in sweep.evals] == [("toy", ["toy_mean"])]
    assert isinstance(metrics.build(sweep.evals[0].metrics[0]), ToyMean)


def test_task_registries_restored_after_a_test_registers_one():
    # The fixture above must not leak the toy task into other tests.
    assert "toy" not in TASKS and "toy" not in metrics.REGISTRY


def test_every_task_module_is_imported():
    import pkgutil
    import sys

    names = [m.name for m in pkgutil.iter_modules(tasks.__path__) if not m.name.startswith("_")]
    assert {"base", "text"} <= set(names)
    assert all(f"rayeval.core.tasks.{n}" in sys.modules for n in names)


def test_registry_error_pickles_with_its_fields():
    e = RegistryError("unknown task 'x'; choose one of: a", kind="task", name="x")
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), str(back), back.kind, back.name) == (RegistryError, str(e), "task", "x")


def test_readme_documents_every_task():
    # The sweep file's key table moved from the README to docs/sweep-file.md.
    readme = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "sweep-file.md")
    row = next(ln for ln in open(readme, encoding="utf-8") if ln.startswith("| `evals[i].task` |"))
    for name in TASKS:
        assert f"`{name}`" in row, name
