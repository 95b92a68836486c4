"""A misspelt metric name, metric parameter or factory (its module or its attribute) names the
nearest real one, as a misspelt key does (``config.reader.did_you_mean``); with nothing near, the
line is as before."""

import sys

import pytest
import yaml

from rayeval.config.reader import did_you_mean
from rayeval.errors import ModelError, SpecError
from rayeval.plan.loader import load_sweep

SWEEP = {
    "name": "digits",
    "model": {"factory": "my_models:build_mlp"},
    "checkpoints": ["ckpts/step_*"],
    "dataset": {"path": "data/eval.parquet", "inputs": "pixels", "target": "label"},
    "task": "classification",
    "metrics": ["accuracy"],
    "output": "out",
}


def test_the_hint_is_the_nearest_name_or_nothing():
    assert did_you_mean("acuracy", ["accuracy", "nll"]) == "; did you mean 'accuracy'?"
    assert did_you_mean("f2", ["accuracy", "nll"]) == ""
    assert did_you_mean("x", []) == ""


@pytest.mark.parametrize("metrics,message", [
    (["acuracy"], "metrics[0]: unknown metric 'acuracy' for task 'classification'; did you mean "
                  "'accuracy'?; choose from: accuracy, "),
    (["accuracy", "macro_f"], "metrics[1]: unknown metric 'macro_f' for task 'classification'; "
                              "did you mean 'macro_f1'?; choose from: "),
    (["f2"], "metrics[0]: unknown metric 'f2' for task 'classification'; choose from: accuracy"),
    ([{"name": "ece", "bin": 10}], "metrics[0]: metric 'ece' has no parameter 'bin'; did you "
                                   "mean 'bins'? (parameters: bins)"),
])
def test_a_misspelt_metric_names_the_nearest(tmp_path, metrics, message):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({**SWEEP, "metrics": metrics}))
    with pytest.raises(SpecError) as info:
        load_sweep(str(path))
    assert str(info.value).startswith(f"{path}: {message}"), str(info.value)
    assert "\n" not in str(info.value)


@pytest.fixture
def models(tmp_path, monkeypatch):
    # This folder's my_models, not one an earlier test of the run imported (the digits
    # example's has no ConvNet): both put back after the test.
    monkeypatch.delitem(sys.modules, "my_models", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "my_models.py").write_text(
        "import torch\n\n\nclass ConvNet(torch.nn.Module):\n    pass\n\n\n"
        "def build_mlp(hidden=8):\n    return torch.nn.Linear(64, hidden)\n\n\n"
        "class zoo:\n    def resnet(self):\n        pass\n")
    return str(tmp_path)


@pytest.mark.parametrize("ref,message", [
    ("my_models:ConvNett", "model.factory: module 'my_models' has no attribute 'ConvNett'; "
                           "did you mean 'ConvNet'?; check the name after ':'"),
    ("my_models:build_mpl", "model.factory: module 'my_models' has no attribute 'build_mpl'; "
                            "did you mean 'build_mlp'?; check the name after ':'"),
    ("my_models:zoo.resnett", "model.factory: module 'my_models' has no attribute "
                              "'zoo.resnett'; did you mean 'zoo.resnet'?; check the name after "
                              "':'"),
    ("my_models:Transformer", "model.factory: module 'my_models' has no attribute "
                              "'Transformer'; check the name after ':'"),
])
def test_a_misspelt_factory_attribute_names_the_nearest(models, ref, message):
    from rayeval.io.model import import_callable

    with pytest.raises(ModelError) as info:
        import_callable(ref, models)
    assert str(info.value) == message


def test_a_misspelt_factory_module_names_the_nearest_file_beside_the_sweep(models):
    from rayeval.io.model import import_callable

    with pytest.raises(ModelError) as info:
        import_callable("my_modles:build_mlp", models)
    assert str(info.value) == (f"model.factory: cannot import module 'my_modles'; did you mean "
                               f"'my_models'?; put my_modles.py next to the sweep file ({models}) "
                               "or on PYTHONPATH")
