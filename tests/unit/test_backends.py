"""Backends beside tasks: a backend registered from outside the package is what a task's
requests reach through the public path (``backends.create`` -> ``evaluate.Pass``). The Hugging
Face backend's log-likelihoods against the model computed directly: tests/models/test_hf_backend.py."""

import ast
import dataclasses
import pathlib

import pytest
import torch

from rayeval.core import backends
from rayeval.core.backends import BACKENDS, Backend, Context
from rayeval.core.evaluate import Pass, compute
from rayeval.core.metrics import REGISTRY
from rayeval.core.tasks.text import TextBatch

# Each choice's log-likelihood, by its continuation tokens: what the tiny backend answers.
TABLE = {(1,): -0.5, (2,): -2.0, (3, 4): -1.0, (5,): -3.0, (6,): -0.1}


@BACKENDS.register()
class TableBackend(Backend):
    """A backend in one class: log-likelihoods looked up in a table, and a forward pass that
    returns fixed logits. It records what it was asked, to show the task came through it."""
    name = "test_table"

    def __init__(self, setup=backends.Setup()):
        super().__init__(setup)
        self.asked = []
        self.contexts = []

    def loglikelihood(self, requests, ctx):
        self.contexts.append(ctx)
        self.asked.extend(requests)
        return [(TABLE[tuple(cont)], False) for _, cont in requests]

    def forward(self, x, ctx):
        self.asked.append(tuple(x.shape))
        return torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, 3.0]])[:x.shape[0]]


def test_a_backend_registered_outside_the_package_answers_a_text_task():
    backend = backends.create("test_table")
    assert isinstance(backend, TableBackend)
    metrics = [(n, cls()) for n, cls in REGISTRY["multiple_choice"].items()
               if n in ("acc", "acc_norm")]
    # two items: [(ctx, cont) per choice], their choices' lengths in characters, the answer
    rows = [[([9], [1]), ([9], [2])], [([8], [3, 4]), ([8], [5]), ([8], [6])]]
    chars = [[1.0, 1.0], [20.0, 1.0, 1.0]]
    p = Pass(backend, metrics, 0, torch.device("cpu"), "multiple_choice")
    p.update(TextBatch(rows, chars), torch.tensor([0, 1]))
    p.finish()
    got = compute(metrics, p.states, 0)
    assert backend.asked == [pair for item in rows for pair in item]
    # the task handed over the pass's frozen context, not the pass
    assert [type(c) for c in backend.contexts] == [Context]
    with pytest.raises(dataclasses.FrozenInstanceError):
        backend.contexts[0].batch = 1
    # item 0: choice 0 (-0.5) is best and right; item 1: choice 2 (-0.1) is best, 1 is right
    assert got["acc"] == 0.5
    # per character, item 1's choice 0 (-1.0 / 20) beats choice 2 (-0.1 / 1): still wrong
    assert got["acc_norm"] == 0.5


def test_a_backend_registered_outside_the_package_answers_a_tensor_task():
    backend = backends.create("test_table")
    metrics = [("accuracy", REGISTRY["classification"]["accuracy"]())]
    p = Pass(backend, metrics, 2, torch.device("cpu"), "classification")
    p.update(torch.zeros((3, 5)), torch.tensor([1, 0, 0]))
    p.finish()
    assert backend.asked == [(3, 5)]
    assert compute(metrics, p.states, 2)["accuracy"] == pytest.approx(2 / 3)


def test_a_backend_name_is_registered_once():
    from rayeval.errors import RegistryError

    with pytest.raises(RegistryError, match="backend 'test_table' is registered twice"):
        BACKENDS.register()(type("Again", (Backend,), {"name": "test_table"}))
    assert list(BACKENDS)[:2] == ["hf", "vllm"]


def test_no_task_module_imports_a_model_an_engine_or_ray():
    """Tasks build requests and score responses: the model side is the backends'."""
    banned = ("torch.distributed", "ray", "vllm", "transformers")
    folder = pathlib.Path(__file__).parents[2] / "rayeval" / "core" / "tasks"
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not any(name == b or name.startswith(b + ".") for b in banned), \
                    f"{path.name} imports {name}"


def _sweep_with_backend(name: str):
    from rayeval.plan.loader import parse_sweep

    return parse_sweep({"name": "s", "model": {"factory": "m:build", "backend": name},
                        "checkpoints": ["c/*.pt"], "output": "out",
                        "evals": [{"name": "v", "task": "classification", "metrics": ["accuracy"],
                                   "dataset": {"path": "d.parquet", "inputs": "x",
                                               "target": "y"}}]},
                       base_dir="/tmp", source="sweep.yaml")


def test_a_registered_backend_is_a_sweep_s_model_backend_and_an_unknown_one_is_one_line():
    # A plugin's backend is chosen like a built-in: model.backend names the registry entry.
    assert _sweep_with_backend("test_table").model.backend == "test_table"
    from rayeval.errors import SpecError

    with pytest.raises(SpecError) as bad:
        _sweep_with_backend("tgi")
    assert str(bad.value).startswith("sweep.yaml: model.backend: unknown backend 'tgi'; "
                                     "choose one of: hf, vllm, ")


def test_a_row_s_outputs_do_not_depend_on_the_rows_beside_it():
    """A batch of a few rows (a shard's or a resumed segment's last) runs padded to MIN_ROWS:
    each row's outputs are the bits it gets inside a full batch. Unpadded, batches of 1-3 rows
    took other kernels here (an AVX-512 EPYC: 566-578 of 594 rows differed), and a resumed
    cell's nll moved in its 11th digit (tests/e2e/test_resume.py)."""
    from rayeval.core.backends.torch import MIN_ROWS, TorchBackend, first_rows, repeat

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    backend = TorchBackend()
    backend.serve(model)
    x = torch.randn(64, 8)
    with torch.no_grad():
        full = backend.forward(x, None)
        for size in range(1, MIN_ROWS + 2):
            for start in range(0, 64 - size + 1, 7):
                part = backend.forward(x[start:start + size], None)
                assert part.shape == (size, 4)
                assert torch.equal(part, full[start:start + size]), (size, start)
    # the padding repeats a batch's rows in turn; the outputs are cut back to its own
    assert repeat({"a": torch.arange(3)}, 8)["a"].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    out = (torch.zeros(8, 2), {"logits": torch.ones(8, 3), "n": 5}, torch.zeros(2))
    cut = first_rows(out, 3, 8)
    assert cut[0].shape == (3, 2) and cut[1]["logits"].shape == (3, 3) and cut[1]["n"] == 5
    assert cut[2].shape == (2,)
