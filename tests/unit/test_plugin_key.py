"""Tier 1: a plugin's code is in the key of every cell that runs it. For every kind of registry
entry a plugin can add (a task, a metric, a backend, by class or by reference, a checkpoint
layout), a throwaway plugin package written here registers one, marked as the plugin's as
``load_plugins`` marks it (``plugins.registering``); editing the registering module, or a helper
module it imports from its package, changes the key of a cell that uses the entry and leaves
the key of a cell that does not as it was without the plugin. A layout is detected on the
worker, so every cell has every plugin layout in its key. No Ray, no model."""

from __future__ import annotations

import dataclasses
import importlib
import sys

import pytest

from rayeval.config import plugins
from rayeval.config.registry import Registry
from rayeval.config.schema import MetricSpec
from rayeval.core import backends, metrics, tasks
from rayeval.io import layouts
from rayeval.io.checkpoints import CheckpointRef
from rayeval.io.data import DatasetInfo
from rayeval.plan.cells import Evaluation, cell_key, plugin_code
from rayeval.plan.loader import parse_sweep

DIST, VERSION = "fake-pk-dist", "1.2.3"

# kind -> the registering module's source ({pkg}: the package's name). Each reads a constant of
# the package's helper module, as a plugin's class uses its own helpers.
THINGS = {
    "task": (
        "from rayeval.core.tasks import TASKS\n"
        "from rayeval.core.tasks.base import Classification\n"
        "from {pkg} import helper\n\n"
        "@TASKS.register(instance=True)\n"
        "class Throwaway(Classification):\n"
        "    name = '{pkg}'\n"
        "    scale = helper.SCALE\n"),
    "metric": (
        "from rayeval.core import metrics\n"
        "from {pkg} import helper\n\n"
        "@metrics.register\n"
        "class Throwaway(metrics.Accuracy):\n"
        "    name, task = '{pkg}', 'classification'\n"
        "    scale = helper.SCALE\n"),
    "backend": (
        "from rayeval.core.backends import BACKENDS, TorchBackend\n"
        "from {pkg} import helper\n\n"
        "@BACKENDS.register()\n"
        "class Throwaway(TorchBackend):\n"
        "    name = '{pkg}'\n"
        "    scale = helper.SCALE\n"),
    "lazy_backend": (           # registered by reference: not imported by register()
        "from rayeval.core.backends import TorchBackend\n"
        "from {pkg} import helper\n\n"
        "class Throwaway(TorchBackend):\n"
        "    name = '{pkg}'\n"
        "    scale = helper.SCALE\n"),
    "layout": (
        "from rayeval.io import layouts\n"
        "from {pkg} import helper\n\n"
        "@layouts.DETECTORS.register('{pkg}')\n"
        "def detect(path):\n"
        "    return None if helper.SCALE else '{pkg}'\n\n"
        "@layouts.READERS.register('{pkg}')\n"
        "def read(source):\n"
        "    raise ValueError(source.path)\n"),
}
REGISTER = {kind: "def register():\n    from {pkg} import things  # noqa: F401\n"
            for kind in THINGS}
REGISTER["lazy_backend"] = ("from rayeval.core.backends import BACKENDS\n\n"
                            "def register():\n"
                            "    BACKENDS.add_lazy('{pkg}', '{pkg}.things:Throwaway')\n")


def _registries() -> list[Registry]:
    return [tasks.TASKS, backends.BACKENDS, layouts.DETECTORS, layouts.READERS,
            *metrics.REGISTRY.values()]


@pytest.fixture
def clean(tmp_path, monkeypatch):
    """A folder on sys.path for the fake plugins; every registry, the metric registries' table
    and the source digests put back afterwards, the fake modules forgotten (the unit tier runs
    in one process)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = [(r, dict(r._items), dict(r._registrants)) for r in _registries()]
    table = dict(metrics.REGISTRY)
    plugins.forget_digests()
    yield tmp_path
    for registry, items, registrants in saved:
        registry._items, registry._registrants = items, registrants
    metrics.REGISTRY.clear()
    metrics.REGISTRY.update(table)
    for name in [m for m in sys.modules if m.startswith("fake_pk_")]:
        del sys.modules[name]
    plugins.forget_digests()


def install(site, kind: str, version: str = VERSION) -> str:
    """The fake plugin package for ``kind`` written under ``site``, imported and its register
    function run as ``load_plugins`` runs one; the package's name (also the entry's)."""
    pkg = f"fake_pk_{kind}"
    folder = site / pkg
    folder.mkdir(exist_ok=True)
    (folder / "__init__.py").write_text(REGISTER[kind].format(pkg=pkg))
    (folder / "helper.py").write_text("SCALE = 1.0\n")
    (folder / "things.py").write_text(THINGS[kind].format(pkg=pkg))
    importlib.invalidate_caches()
    with plugins.registering(plugins.Plugin("fake", f"{pkg}:register", DIST, version)):
        importlib.import_module(pkg).register()
    return pkg


def base_sweep(tmp_path):
    return parse_sweep({
        "name": "k", "checkpoints": ["c/*"], "output": "out",
        "evals": [{"name": "e", "task": "classification", "metrics": ["accuracy"],
                   "dataset": {"path": "d.parquet", "inputs": "x", "target": "y"}}]},
        base_dir=str(tmp_path))


def key(sweep, spec=None) -> str:
    spec = spec or sweep.evals[0]
    data = DatasetInfo(files=(), num_rows=1, input_shapes=(), fingerprint="f")
    return cell_key(sweep, Evaluation(spec, data, 4), CheckpointRef("/c/step_1.pt", 1), "fp")


def using(sweep, kind: str, pkg: str):
    """(a sweep, its evaluation) whose cell uses the entry ``pkg`` of ``kind``; None for a
    layout (every cell may be read by one)."""
    spec = sweep.evals[0]
    if kind == "task":
        return sweep, dataclasses.replace(spec, task=pkg)
    if kind == "metric":
        return sweep, dataclasses.replace(spec, metrics=(
            MetricSpec(name=pkg, task="classification", key=pkg),))
    if kind in ("backend", "lazy_backend"):
        return dataclasses.replace(sweep, model=dataclasses.replace(
            sweep.model, backend=pkg)), spec
    return None


@pytest.mark.parametrize("edited", ["things.py", "helper.py"])
@pytest.mark.parametrize("kind", sorted(THINGS))
def test_editing_a_plugin_is_a_new_key_for_the_cells_it_runs_in(clean, kind, edited):
    sweep = base_sweep(clean)
    plain = key(sweep)                                  # no plugin registered yet
    pkg = install(clean, kind)
    used = using(sweep, kind, pkg) or (sweep, None)
    before_used, before_other = key(*used), key(sweep)
    plugins.forget_digests()                            # a new process, nothing edited
    assert [p["package"] for p in plugin_code(used[0], used[1] or sweep.evals[0])] == \
        [DIST] * (2 if kind == "layout" else 1)           # a layout: its detector and reader
    assert (key(*used), key(sweep)) == (before_used, before_other), "stable"
    if kind == "lazy_backend":
        assert f"{pkg}.things" not in sys.modules, "hashed without importing the reference"
    if kind == "layout":
        assert before_other != plain, "a plugin layout may read any checkpoint"
    else:
        assert before_other == plain, "a cell that does not use the entry keeps its key"

    path = clean / pkg / edited
    path.write_text(path.read_text().replace("SCALE = 1.0", "SCALE = 2.0")
                    .replace("helper.SCALE", "helper.SCALE * 2"))
    plugins.forget_digests()                            # what the next process hashes
    assert key(*used) != before_used, f"{kind}: editing {edited} kept the stale key"
    if kind == "layout":
        assert key(sweep) != before_other
    else:
        assert key(sweep) == before_other == plain


def test_the_key_holds_the_distribution_its_version_and_the_source(clean):
    sweep = base_sweep(clean)
    pkg = install(clean, "metric")
    sweep, spec = using(sweep, "metric", pkg)
    (part,) = plugin_code(sweep, spec)
    assert {k: v for k, v in part.items() if k != "source"} == {
        "kind": "metric", "name": pkg, "package": DIST, "version": VERSION}
    assert len(part["source"]) == 16 and int(part["source"], 16) >= 0
    first = key(sweep, spec)
    # The same code from another release of the distribution is another cell.
    metrics.REGISTRY["classification"]._items.pop(pkg)
    sys.modules.pop(f"{pkg}.things")
    with plugins.registering(plugins.Plugin("fake", f"{pkg}:register", DIST, "1.2.4")):
        importlib.import_module(f"{pkg}.things")
    assert plugin_code(sweep, spec)[0]["version"] == "1.2.4"
    assert key(sweep, spec) != first


def test_without_plugins_nothing_is_added_to_the_key(clean):
    sweep = base_sweep(clean)
    assert plugin_code(sweep, sweep.evals[0]) == []
    # rayeval's own objects registered while a plugin's function runs (a built-in module
    # imported on the way) stay rayeval's; so do names registered in-process by a test.
    with plugins.registering(plugins.Plugin("fake", "fake_pk_x:register", DIST, VERSION)):
        assert plugins.registrant("rayeval.core.metrics.classification") is None
        assert plugins.registrant("fake_pk_x.things") is not None
    assert plugins.registrant("fake_pk_x.things") is None


def test_an_installed_plugins_module_registered_outside_its_function_is_still_its(
        clean, monkeypatch):
    """A plugin module imported before ``load_plugins`` (its decorators ran unmarked) is the
    plugin's by its package."""
    pkg = "fake_pk_metric"
    (clean / pkg).mkdir()
    (clean / pkg / "__init__.py").write_text("")
    (clean / pkg / "helper.py").write_text("SCALE = 1.0\n")
    (clean / pkg / "things.py").write_text(THINGS["metric"].format(pkg=pkg))
    importlib.import_module(f"{pkg}.things")              # unmarked
    sweep, spec = using(base_sweep(clean), "metric", pkg)
    assert plugin_code(sweep, spec) == []
    monkeypatch.setattr(plugins, "_loaded", (
        plugins.Plugin("fake", f"{pkg}:register", DIST, VERSION),))
    assert [p["package"] for p in plugin_code(sweep, spec)] == [DIST]


def test_every_registry_a_plugin_can_add_to_is_walked():
    """A new registry must be added to ``plan.cells.plugin_code`` and to the cases above (or
    named here as one a plugin cannot add to)."""
    cannot = {"evaluation entry kind"}        # config.entries: a field of EvalSpec, not a plugin's
    every = {id(v): v for m in list(sys.modules.values())
             if getattr(m, "__name__", "").startswith("rayeval")
             for v in list(vars(m).values()) if isinstance(v, Registry)}
    walked = {id(r) for r in _registries()}
    missed = [r.kind for i, r in every.items() if i not in walked and r.kind not in cannot]
    assert missed == []


def test_a_text_cells_key_holds_its_tokenizer_folders_chat_template_and_processor(tmp_path):
    """The chat template and the processor are files of the tokenizer's folder (or of the
    checkpoint's): rewriting one at the same place is a new cell."""
    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer.json", "chat_template.jinja", "preprocessor_config.json"):
        (tok / name).write_text("{}")
    sweep = parse_sweep({
        "name": "k", "checkpoints": ["c/*"], "output": "out", "model": {"tokenizer": "tok"},
        "evals": [{"name": "e", "task": "generation", "metrics": ["exact_match"],
                   "dataset": {"path": "d.parquet", "prompt": "p", "target": "a"}}]},
        base_dir=str(tmp_path))
    before = key(sweep)
    for name in ("chat_template.jinja", "preprocessor_config.json"):
        (tok / name).write_text("{\"changed\": \"" + name + "\"}")
        after = key(sweep)
        assert after != before, name
        before = after
