"""Changes to a loaded sweep from outside its file: the command line's ``--workers``,
``--output``, ``--mlflow`` and ``--wandb``, and the locations a sweep file names as written,
which ``submit`` and ``k8s render`` check before the file is used on another machine."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from rayeval.config.schema import MlflowTracker, Sweep, WandbTracker
from rayeval.errors import SpecError
from rayeval.io import paths


def with_overrides(sweep: Sweep, *, workers: int | None = None,
                   output: str | None = None) -> Sweep:
    """The CLI's ``--workers`` / ``--output`` (relative output taken from the cwd)."""
    changes: dict[str, Any] = {}
    if workers is not None:
        if workers < 1:
            raise SpecError(f"--workers: must be at least 1, got {workers}")
        shard = sweep.parallelism.shard
        if workers % shard:
            raise SpecError(f"--workers: {workers} is not a multiple of parallelism.shard: "
                            f"{shard} in the sweep; each replica of the model takes {shard} "
                            "workers")
        changes["workers"] = workers
    if output is not None:
        changes["output"] = paths.resolve(output, os.getcwd())
    return sweep.replace(**changes)


def with_trackers(sweep: Sweep, *, mlflow: str | None = None,
                  wandb: str | None = None) -> Sweep:
    """The CLI's ``--mlflow URI`` / ``--wandb PROJECT``: add the tracker, or override the
    sweep's URI / project and keep its other keys (experiment, run id, mode)."""
    t = sweep.trackers
    for flag, value in (("--mlflow", mlflow), ("--wandb", wandb)):
        if value is not None and not value.strip():
            raise SpecError(f"{flag}: expected a non-empty value")
    if mlflow is not None:
        t = dataclasses.replace(t, mlflow=dataclasses.replace(
            t.mlflow or MlflowTracker(), uri=mlflow, key_path="--mlflow"))
    if wandb is not None:
        t = dataclasses.replace(t, wandb=dataclasses.replace(
            t.wandb or WandbTracker(project=wandb), project=wandb, key_path="--wandb"))
    return sweep.replace(trackers=t)


def written_locations(raw: dict) -> list[tuple[str, str]]:
    """The data, checkpoint and output locations a sweep file names, as written (before they
    are resolved against its folder), with their key paths: what `submit` and `k8s render`
    check, since relative paths mean this machine's files."""
    out = [("dataset.path", (raw.get("dataset") or {}).get("path"))]
    evals = raw.get("evals")
    for i, e in enumerate(evals if isinstance(evals, list) else []):
        if isinstance(e, dict) and isinstance(e.get("dataset"), dict):
            out.append((f"evals[{i}].dataset.path", e["dataset"].get("path")))
    ckpts = raw.get("checkpoints")
    out += [(f"checkpoints[{i}]", c)
            for i, c in enumerate([ckpts] if isinstance(ckpts, str) else (ckpts or []))]
    model = raw.get("model")
    if isinstance(model, dict):
        out.append(("model.tokenizer", model.get("tokenizer")))
    out.append(("output", raw.get("output")))
    return [(key, value) for key, value in out if isinstance(value, str)]


def is_relative_local(value: str) -> bool:
    return not paths.is_uri(value) and not os.path.isabs(os.path.expanduser(value))
