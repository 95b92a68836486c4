"""Plugins through the ``rayeval.plugins`` entry-point group: each loaded once per process, in
name order; a taken name, a plugin that cannot be imported, is not callable or raises, is one
line naming the entry point and its package, raised again by every later load.

Each test's plugins are real installed distributions as importlib.metadata finds them: a
``.dist-info`` folder with the entry point, and the module, in a folder put on ``sys.path``."""

import sys

import pytest

from rayeval.config import plugins
from rayeval.config.registry import Registry
from rayeval.core.tasks import TASKS
from rayeval.core.tasks.base import Classification
from rayeval.errors import RayevalError, RegistryError


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path to install fake plugins into, and a process that has loaded none;
    the plugins' modules are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "_loaded", None)
    monkeypatch.setattr(plugins, "_failure", None)
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("fake_")]:
        del sys.modules[name]


def install(site, package: str, entries: dict[str, str], modules: dict[str, str]) -> None:
    """A distribution ``package`` 0.1 declaring ``entries`` (name -> "module:function") in the
    group, and its ``modules`` (name -> source)."""
    info = site / f"{package.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entries.items())
    (info / "entry_points.txt").write_text(f"[{plugins.GROUP}]\n{lines}")
    for module, source in modules.items():
        (site / f"{module}.py").write_text(source)


def ours(loaded, package):
    return [p for p in loaded if p.package == package]


def test_a_plugin_is_loaded_once_per_process(site):
    install(site, "fake-once", {"once": "fake_once:register"},
            {"fake_once": "CALLS = []\n\ndef register():\n    CALLS.append(1)\n"})
    first = plugins.load_plugins()
    again = plugins.load_plugins()
    assert ours(first, "fake-once") == [
        plugins.Plugin("once", "fake_once:register", "fake-once", "0.1")]
    assert again == first == plugins.loaded()
    assert sys.modules["fake_once"].CALLS == [1], "called once, however often load is asked"
    assert str(first[-1]) == "plugin 'once' (fake_once:register from fake-once 0.1)"


def test_threads_loading_at_once_all_wait_for_the_plugin(site):
    """A Ray Data actor may run its stage in several threads: none may go on (and look a
    plugin's task up) while another thread is still registering it."""
    from concurrent.futures import ThreadPoolExecutor

    install(site, "fake-slow", {"slow": "fake_slow:register"}, {"fake_slow": (
        "import time\n\nDONE = []\n\n"
        "def register():\n    time.sleep(0.3)\n    DONE.append(1)\n")})

    def load_and_look():
        plugins.load_plugins()
        return list(sys.modules["fake_slow"].DONE)

    with ThreadPoolExecutor(4) as pool:
        seen = list(pool.map(lambda _: load_and_look(), range(4)))
    assert seen == [[1]] * 4


def test_plugins_load_in_name_order(site):
    log = "CALLS = []\n"
    plugin = "import fake_order_log\n\ndef register():\n    fake_order_log.CALLS.append({!r})\n"
    install(site, "fake-order", {"zeta": "fake_zeta:register", "alpha": "fake_alpha:register"},
            {"fake_order_log": log, "fake_zeta": plugin.format("zeta"),
             "fake_alpha": plugin.format("alpha")})
    loaded = plugins.load_plugins()
    assert [p.name for p in ours(loaded, "fake-order")] == ["alpha", "zeta"]
    assert sys.modules["fake_order_log"].CALLS == ["alpha", "zeta"]


def test_a_taken_name_is_one_line_naming_the_plugin_and_the_name(site):
    install(site, "fake-clash", {"clash": "fake_clash:register"}, {"fake_clash": (
        "from rayeval.core.tasks import TASKS\n"
        "from rayeval.core.tasks.base import Classification\n\n"
        "def register():\n"
        "    @TASKS.register(instance=True)\n"
        "    class Clash(Classification):\n"
        "        name = 'classification'\n")})
    with pytest.raises(RegistryError) as info:
        plugins.load_plugins()
    assert str(info.value) == (
        "plugin 'clash' (fake_clash:register from fake-clash 0.1): task 'classification' is "
        "registered twice: by rayeval.core.tasks.base.Classification and by "
        "fake_clash.register.<locals>.Clash; give one of them another name")
    assert info.value.fields() == {"kind": "task", "name": "classification"}
    assert type(TASKS.get("classification")) is Classification, "the first one stands"
    with pytest.raises(RegistryError) as again:      # never half a plugin: the same error
        plugins.load_plugins()
    assert again.value is info.value


def test_a_taken_metric_name_is_refused_too(site):
    install(site, "fake-metric", {"metric": "fake_metric:register"}, {"fake_metric": (
        "from rayeval.core import metrics\n\n"
        "def register():\n"
        "    @metrics.register\n"
        "    class MyAccuracy(metrics.Accuracy):\n"
        "        pass\n")})
    with pytest.raises(RegistryError, match=r"^plugin 'metric' \(fake_metric:register from "
                       r"fake-metric 0.1\): metric for task 'classification' 'accuracy' is "
                       r"registered twice: by rayeval.core.metrics.classification.Accuracy and by "
                       r"fake_metric.register.<locals>.MyAccuracy; give one"):
        plugins.load_plugins()


@pytest.mark.parametrize("module, message", [
    (None, "plugin 'broken' (fake_broken:register from fake-broken 0.1) cannot be imported "
           "(ModuleNotFoundError: No module named 'fake_broken'); fix it or uninstall "
           "fake-broken"),
    ("register = 42\n",
     "plugin 'broken' (fake_broken:register from fake-broken 0.1) names a int, not a "
     "function; point the entry point at a function taking no arguments that registers what "
     "the package adds"),
    ("def register():\n    raise ValueError('no settings file\\nsecond line')\n",
     "plugin 'broken' (fake_broken:register from fake-broken 0.1) raised ValueError: no "
     "settings file; fix it or uninstall fake-broken"),
], ids=["cannot-import", "not-callable", "raises"])
def test_a_broken_plugin_is_one_line_naming_its_entry_point(site, module, message):
    install(site, "fake-broken", {"broken": "fake_broken:register"},
            {} if module is None else {"fake_broken": module})
    with pytest.raises(RegistryError) as info:
        plugins.load_plugins()
    assert str(info.value) == message and "\n" not in str(info.value)
    assert isinstance(info.value, RayevalError)      # the CLI prints it as its one error line
    assert info.value.kind == "plugin" and info.value.name == "broken"
    if module is None or "raise" in module:
        assert "Traceback" in info.value.detail      # shown with --debug


def test_the_cli_loads_plugins_before_reading_the_sweep(site, capsys):
    from rayeval.ui.cli import EXIT_BAD_INPUT, main

    install(site, "fake-cli", {"cli": "fake_cli:register"},
            {"fake_cli": "def register():\n    raise RuntimeError('plugin says no')\n"})
    assert main(["run", str(site / "no-such-sweep.yaml")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert err == ("error: plugin 'cli' (fake_cli:register from fake-cli 0.1) raised "
                   "RuntimeError: plugin says no; fix it or uninstall fake-cli")


def test_load_sweep_loads_plugins_and_accepts_their_task_and_metric(site, monkeypatch):
    import yaml

    from rayeval import api
    from rayeval.core import metrics

    install(site, "fake-task", {"task": "fake_task:register"}, {"fake_task": (
        "from rayeval.core import metrics\n"
        "from rayeval.core.tasks import TASKS\n"
        "from rayeval.core.tasks.base import Classification\n\n"
        "def register():\n"
        "    @TASKS.register(instance=True)\n"
        "    class Shadow(Classification):\n"
        "        name = 'fake_shadow'\n\n"
        "    @metrics.register\n"
        "    class ShadowAccuracy(metrics.Accuracy):\n"
        "        name, task = 'fake_hits', 'fake_shadow'\n")})
    (site / "sweep.yaml").write_text(yaml.safe_dump({
        "name": "s", "model": {"factory": "m:build"}, "checkpoints": ["c/*"],
        "dataset": {"path": "d.parquet", "inputs": "x", "target": "y"},
        "task": "fake_shadow", "metrics": ["fake_hits"], "output": "out"}))
    # Later tests see rayeval's own names only.
    monkeypatch.setattr(TASKS, "_items", dict(TASKS._items))
    monkeypatch.setattr(metrics, "REGISTRY", dict(metrics.REGISTRY))
    sweep = api.load_sweep(site / "sweep.yaml")     # no load_plugins call before it
    assert [(e.task, [m.name for m in e.metrics]) for e in sweep.evals] == \
        [("fake_shadow", ["fake_hits"])]


def test_a_name_registered_by_reference_is_imported_when_first_asked_for(site):
    (site / "fake_lazy.py").write_text("class Echo:\n    name = 'echo'\n")
    backends = Registry("backend")
    backends.add_lazy("echo", "fake_lazy:Echo")
    backends.add_lazy("echo_instance", "fake_lazy:Echo", instance=True)
    assert "echo" in backends and backends.names() == ["echo", "echo_instance"]
    assert "fake_lazy" not in sys.modules, "nothing imported until the name is used"
    echo = backends.get("echo")
    assert echo is sys.modules["fake_lazy"].Echo and backends.get("echo") is echo
    assert isinstance(backends.get("echo_instance"), echo)
    assert backends.get("echo_instance") is backends.get("echo_instance"), "one instance"
    with pytest.raises(RegistryError, match=r"^backend 'echo' is registered twice: by "
                                            r"fake_lazy.Echo and by other:Echo; give one"):
        backends.add_lazy("echo", "other:Echo")


def test_a_bad_or_missing_reference_is_one_line():
    backends = Registry("backend")
    with pytest.raises(RegistryError) as bad:
        backends.add_lazy("echo", "fake_nowhere.Echo")
    assert str(bad.value) == ("backend 'echo': expected a 'module:Class' reference, got "
                              "'fake_nowhere.Echo'")
    backends.add_lazy("gone", "fake_nowhere:Echo")
    with pytest.raises(RegistryError) as missing:
        backends.values()
    assert str(missing.value) == (
        "backend 'gone' (fake_nowhere:Echo) cannot be loaded (ModuleNotFoundError: No module "
        "named 'fake_nowhere'); install the package that provides it, or fix the reference")
    assert missing.value.fields() == {"kind": "backend", "name": "gone",
                                      "cause": "ModuleNotFoundError",
                                      "reason": "No module named 'fake_nowhere'"}
