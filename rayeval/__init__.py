"""rayeval: evaluate many PyTorch checkpoints on a Ray cluster and rank them.

The public API (see the docs/python-api.md)::

    import rayeval

    report = rayeval.run("sweep.yaml")          # evaluate a sweep -> RunReport
    rayeval.results("out").to_pandas()          # newest row per cell -> pyarrow.Table
    rayeval.leaderboard("out").entries          # ranked -> Board
    rayeval.samples("out", checkpoint="600", evaluation="arc")   # per-item records -> Table
    rayeval.query("out", "SELECT ... FROM latest")   # SQL over the store -> pyarrow.Table

``import rayeval`` is cheap: it imports neither torch nor Ray. ``RunReport`` and ``Board`` are
loaded on first use (``RunReport`` lives with the driver, which imports torch).
"""

__version__ = "0.1.0"

# The built-in slices, each registering its task, metrics and sweep-entry kind by reference as a
# plugin does (``config.plugins.builtin``); their functions run when the task registry is first
# imported, not now. Named here, in the root that every import of a rayeval module runs first
# and that stands above every floor, so that no floor names a floor above it.
from rayeval.config import plugins as _plugins

_plugins.builtin("lm_eval", "rayeval.harness:register")
_plugins.builtin("lmms_eval", "rayeval.lmms:register")

from rayeval.api import leaderboard, load_sweep, query, results, run, samples
from rayeval.config.schema import Sweep
from rayeval.errors import (CheckpointError, DataError, EngineError, GroupError, MetricError,
                            ModelError, RayevalError, RegistryError, RunError, SpecError,
                            StoreError, VersionError, WorkerGroupError)

__all__ = [
    "__version__",
    "run", "load_sweep", "results", "query", "leaderboard", "samples",
    "RunReport", "Board", "Sweep",
    "RayevalError", "SpecError", "DataError", "ModelError", "MetricError", "CheckpointError",
    "EngineError", "StoreError", "RunError", "WorkerGroupError", "GroupError", "RegistryError",
    "VersionError",
    "validation_config", "RayevalValidation",
]

# name -> the module holding it, imported on first use (torch or Ray come with those modules).
_LAZY = {
    "RunReport": "rayeval.execution.driver",
    "Board": "rayeval.ranking.board",
    "validation_config": "rayeval.integrations.ray_train",
    "RayevalValidation": "rayeval.integrations.ray_train",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rayeval' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
