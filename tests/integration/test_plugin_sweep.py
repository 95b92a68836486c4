"""Tier 3: a package installed from outside rayeval adds a task, two metrics and a checkpoint
layout through the ``rayeval.plugins`` entry-point group (tests/plugins/rayeval_example_plugin),
and a sweep on a real local Ray uses them (one checkpoint is an .npz archive): the driver and
every worker load the plugin, and the stored numbers equal scikit-learn's."""

import importlib.util
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from rayeval import api
from rayeval.config import plugins
from rayeval.core import metrics
from rayeval.core.tasks import TASKS
from rayeval.execution.driver import run_sweep
from rayeval.io import layouts
from rayeval.io.store import ResultStore
from rayeval.ranking import latest_rows
from support import build_model, make_data, write_model_module, write_parquet

pytestmark = pytest.mark.ray

PLUGIN = os.path.join(os.path.dirname(__file__), os.pardir, "plugins", "rayeval_example_plugin")
DISTRIBUTION = "rayeval-example-plugin"
ROWS, SEEDS, WORKERS = 1_001, (1, 2), 2           # no worker count divides the rows


def _pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def example_plugin(tmp_path_factory):
    """The example plugin installed as a user installs one (not editable: an editable
    install's import hook is set up only when a process starts, and this one has started),
    from a copy (pip's build files stay out of the repository), for this module; uninstalled
    after it, and this process's registries and plugin state put back as they were, so later
    test modules see rayeval's own names only."""
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not installed: this test installs a plugin package with it")
    source = tmp_path_factory.mktemp("plugin") / "rayeval_example_plugin"
    shutil.copytree(PLUGIN, source)
    saved = _registries()
    _pip("install", "--no-deps", "--no-build-isolation", str(source))
    importlib.invalidate_caches()
    # This process may have loaded plugins already (any earlier test that read a sweep), before
    # the install: it loads them again as a process started now would.
    plugins._loaded = plugins._failure = None
    try:
        yield
    finally:
        _pip("uninstall", "-y", DISTRIBUTION)
        _restore(saved)


@pytest.fixture(scope="module")
def plugin_cluster(example_plugin, request):
    """Ray started after the install: its workers start with the plugin on their path."""
    request.getfixturevalue("ray_cluster")


def _registries():
    return (dict(TASKS._items), {t: dict(r._items) for t, r in metrics.REGISTRY.items()},
            plugins._loaded, plugins._failure, dict(layouts.DETECTORS._items),
            dict(layouts.READERS._items))


def _restore(saved) -> None:
    tasks, metric_items, plugins._loaded, plugins._failure, detectors, readers = saved
    layouts.DETECTORS._items, layouts.READERS._items = detectors, readers
    TASKS._items = tasks
    for task in set(metrics.REGISTRY) - set(metric_items):
        del metrics.REGISTRY[task]
    for task, items in metric_items.items():
        metrics.REGISTRY[task]._items = items
    for name in [m for m in sys.modules if m.startswith("rayeval_example_plugin")]:
        del sys.modules[name]


def write_sweep(folder) -> str:
    write_model_module(str(folder))
    x, y = make_data(ROWS, seed=3)
    write_parquet(str(folder / "data.parquet"), x, y, row_group_size=97)
    (folder / "ckpts").mkdir()
    for s in SEEDS[:-1]:
        torch.save(build_model(seed=s).state_dict(), folder / "ckpts" / f"step_{s}.pt")
    # The last checkpoint in the plugin's own layout: numpy's .npz archive.
    np.savez(folder / "ckpts" / f"step_{SEEDS[-1]}.npz",
             **{k: v.numpy() for k, v in build_model(seed=SEEDS[-1]).state_dict().items()})
    dataset = {"path": "data.parquet", "inputs": "x", "target": "y", "id": "row"}
    spec = {
        "name": "plugin", "model": {"factory": "tiny_models:build"}, "checkpoints": ["ckpts/*"],
        "workers": WORKERS, "output": "out", "batch_size": 64,
        "evals": [
            {"name": "classes", "task": "classification", "dataset": dataset,
             "metrics": ["accuracy", "example_hinge"]},
            {"name": "ranks", "task": "example_ranking", "dataset": dataset,
             "metrics": ["example_mrr"]},
        ],
    }
    (folder / "sweep.yaml").write_text(yaml.safe_dump(spec))
    return str(folder / "sweep.yaml")


def references(seed: int) -> dict[str, float]:
    """scikit-learn's hinge loss and label-ranking average precision (for one true label, the
    mean reciprocal rank of the true class) from the model's float64 logits."""
    from sklearn.metrics import hinge_loss, label_ranking_average_precision_score

    x, y = make_data(ROWS, seed=3)
    with torch.no_grad():
        logits = build_model(seed=seed)(torch.from_numpy(x)).double().numpy()
    classes = np.arange(logits.shape[1])
    return {"example_hinge": hinge_loss(y, logits, labels=classes),
            "example_mrr": label_ranking_average_precision_score(y[:, None] == classes, logits),
            "accuracy": float(np.mean(logits.argmax(axis=1) == y))}


def test_a_sweep_on_ray_uses_the_plugin_s_task_and_metrics(plugin_cluster, tmp_path):
    sweep = api.load_sweep(write_sweep(tmp_path))       # loads the plugin in this process
    assert [(p.name, p.package) for p in plugins.loaded()] == [("example", DISTRIBUTION)]
    assert "example_ranking" in TASKS and TASKS.get("example_ranking").name == "example_ranking"

    report = run_sweep(sweep)                           # each worker loads it again

    assert len(report.outcomes) == 2 * len(SEEDS) and all(o.ok for o in report.outcomes), \
        report.failures
    got = {(os.path.basename(r["checkpoint"]), r["metric"]): r
           for r in latest_rows(ResultStore(sweep.output).read())}
    for s in SEEDS:
        for metric, value in references(s).items():
            row = got[(f"step_{s}.{'npz' if s == SEEDS[-1] else 'pt'}", metric)]
            assert row["num_samples"] == ROWS and row["world_size"] == WORKERS
            exact = metric == "accuracy"
            assert row["value"] == pytest.approx(value, rel=0 if exact else 1e-6), (s, metric)


def _as_a_new_process() -> None:
    """This process as a new driver would start: the example plugin's registry entries (found
    by their origin), its modules, the plugins loaded and the source digests hashed gone, so
    the next ``load_sweep`` imports the installed files again."""
    for registry in (TASKS, layouts.DETECTORS, layouts.READERS, *metrics.REGISTRY.values()):
        for name in registry.names():
            origin = registry.origin(name)
            if origin is not None and origin.plugin.package == DISTRIBUTION:
                del registry._items[name]
    for name in [m for m in sys.modules if m.startswith("rayeval_example_plugin")]:
        del sys.modules[name]
    plugins._loaded = plugins._failure = None
    plugins.forget_digests()
    importlib.invalidate_caches()


def test_editing_the_installed_plugin_evaluates_its_cells_again(plugin_cluster, tmp_path):
    """The observed bug: a plugin's metric edited and reinstalled was served stale from the
    store ("1 already in the store", the old number). The cell's key holds the plugin's source
    digest: unchanged, a new driver finds the cell stored; edited (the installed hinge doubled),
    it evaluates the cell again, on workers that load the edited plugin, and stores the new
    number."""
    write_model_module(str(tmp_path))
    x, y = make_data(ROWS, seed=3)
    write_parquet(str(tmp_path / "data.parquet"), x, y, row_group_size=97)
    (tmp_path / "ckpts").mkdir()
    torch.save(build_model(seed=SEEDS[0]).state_dict(), tmp_path / "ckpts" / "step_1.pt")
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({
        "name": "edited", "model": {"factory": "tiny_models:build"}, "checkpoints": ["ckpts/*"],
        "workers": WORKERS, "output": "out", "batch_size": 256,
        "evals": [{"name": "classes", "task": "classification", "metrics": ["example_hinge"],
                   "dataset": {"path": "data.parquet", "inputs": "x", "target": "y",
                               "id": "row"}}]}))
    hinge = references(SEEDS[0])["example_hinge"]

    def run(expect_evaluated: int) -> float:
        _as_a_new_process()
        report = run_sweep(api.load_sweep(str(tmp_path / "sweep.yaml")))
        assert (len(report.plan.cells), len(report.plan.cached)) == \
            (expect_evaluated, 1 - expect_evaluated)
        assert all(o.ok for o in report.outcomes), report.failures
        (row,) = latest_rows(ResultStore(report.plan.sweep.output).read())
        return row["value"]

    assert run(1) == pytest.approx(hinge, rel=1e-6)
    assert run(0) == pytest.approx(hinge, rel=1e-6), "unchanged: served from the store"

    installed = importlib.util.find_spec("rayeval_example_plugin.ranking").origin
    assert not os.path.realpath(installed).startswith(os.path.realpath(PLUGIN)), \
        "the installed copy is edited, not the repository's"
    original = open(installed, encoding="utf-8").read()
    edited = original.replace("return (1.0 + others - true).clamp(min=0.0)",
                              "return 2.0 * (1.0 + others - true).clamp(min=0.0)")
    assert edited != original
    try:
        with open(installed, "w", encoding="utf-8") as f:   # a new size: no stale .pyc
            f.write(edited)
        assert run(1) == pytest.approx(2 * hinge, rel=1e-6), "the edited plugin's number"
    finally:
        with open(installed, "w", encoding="utf-8") as f:
            f.write(original)
