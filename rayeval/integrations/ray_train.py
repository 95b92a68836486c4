"""Evaluating while training on Ray Train: a ``ray.train.ValidationConfig`` whose function
evaluates a sweep on each checkpoint the training loop reports with ``validation=True``.

    import ray.train
    from ray.train.torch import TorchTrainer
    from rayeval.integrations.ray_train import validation_config

    trainer = TorchTrainer(train_loop, scaling_config=...,
                           validation_config=validation_config("sweep.yaml", workers=2),
                           run_config=ray.train.RunConfig(storage_path=..., checkpoint_config=
                               ray.train.CheckpointConfig(checkpoint_score_attribute=
                                                          "eval/val/accuracy",
                                                          checkpoint_score_order="max")))

    # in train_loop, after saving model.pt (or a DCP or Hugging Face folder) into `folder`:
    ray.train.report({"loss": loss}, checkpoint=ray.train.Checkpoint.from_directory(folder),
                     checkpoint_dir_name=f"step_{step:06d}",
                     validation=ray.train.ValidationTaskConfig(fn_kwargs={"step": step}))

What Ray Train 2.60 does with it (``ray/train/v2/execution/checkpoint/
validation_manager.py``): after a checkpoint reported with ``validation=`` is persisted, the
controller runs ``fn(checkpoint, **fn_kwargs)`` as a Ray task (``ray_remote_kwargs`` are its
options), one at a time, while training goes on; the task's fn_kwargs are the
``task_config``'s, overridden by those of a ``ValidationTaskConfig`` given to ``report``. The
function gets the persisted ``ray.train.Checkpoint`` and those keyword arguments only, not the
reported metrics: the step comes from ``fn_kwargs`` (``step_key``) or from the checkpoint's
names. The returned dict is merged into that checkpoint's reported metrics (``Result.metrics``
for the latest checkpoint, ``Result.best_checkpoints``, ``get_all_reported_checkpoints()``) and
the checkpoint is ranked again by ``CheckpointConfig.checkpoint_score_attribute``. An
exception in the function is logged by the controller ("Validation failed for checkpoint
...") and the checkpoint's status becomes ``VALIDATION_FAILED`` with its metrics untouched;
training goes on. A task past ``timeout_s`` is cancelled (``VALIDATION_TIMEOUT``). Before
``fit()`` returns, the controller waits for every pending validation.

The function here evaluates the one checkpoint on the sweep's suite in one ``TorchTrainer``
run of rayeval's own (its ``workers`` on the same Ray cluster, with their own resources),
writes the cells to the sweep's result store like ``rayeval run`` does, and returns
``{"eval/<evaluation>/<metric>": value, ...}`` (plus ``eval/aggregate`` for a suite of several
evaluations, as the leaderboard computes it). A checkpoint that cannot be evaluated raises,
so Ray Train marks it ``VALIDATION_FAILED`` and training is not disturbed.

This module imports neither torch nor Ray at import time.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import tempfile
from typing import TYPE_CHECKING, Any, Mapping

from rayeval.config.schema import Sweep
from rayeval.errors import CheckpointError, SpecError

if TYPE_CHECKING:
    import ray.train

__all__ = ["validation_config", "RayevalValidation"]

# Ray Train's name for a checkpoint folder when report() gets no checkpoint_dir_name:
# checkpoint_2026-01-01_12-00-00.123456. Its numbers are a time, not a step.
_RAY_DEFAULT_NAME = re.compile(r"checkpoint_\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}(\.\d+)?")


def validation_config(sweep: Sweep | str | os.PathLike, *, workers: int | None = None,
                      use_gpu: bool | None = None,
                      resources_per_worker: Mapping[str, float] | None = None,
                      output: str | os.PathLike | None = None, timeout_s: float | None = None,
                      step_key: str = "step", epoch_key: str = "epoch",
                      checkpoint_name: str | None = None, prefix: str = "eval",
                      force: bool = False, progress: bool = False, check: bool = True,
                      ray_remote_kwargs: Mapping[str, Any] | None = None
                      ) -> ray.train.ValidationConfig:
    """A ``ray.train.ValidationConfig`` that evaluates ``sweep`` on every checkpoint a
    ``TorchTrainer`` loop reports with ``validation=True`` (or a ``ValidationTaskConfig``).

    ``sweep``: a :class:`rayeval.Sweep` or the path of a sweep file; its ``checkpoints`` are
    not globbed: each reported checkpoint is evaluated instead. ``workers``, ``use_gpu`` and
    ``resources_per_worker`` override the sweep's: the validation's own Ray Train workers,
    which may be other (cheaper) GPUs than the training's, e.g. ``{"GPU": 1, "CPU": 2}`` or a
    custom resource of those nodes. ``output`` overrides the result store (relative: from the
    current folder). ``timeout_s``: a validation that takes longer is cancelled by Ray Train
    (``VALIDATION_TIMEOUT``); default none.

    ``step_key`` (``"step"``) and ``epoch_key`` (``"epoch"``): the ``fn_kwargs`` keys that carry
    the training step and epoch, passed per report with
    ``validation=ValidationTaskConfig(fn_kwargs={"step": step})`` (Ray Train does not hand the
    reported metrics to the function). Without them the step is read from the checkpoint's
    names as ``rayeval run`` reads them: ``checkpoint_dir_name="step_000100"`` gives 100, then
    the model file's name (``model_100.pt``); a Lightning file's ``global_step`` wins over a
    name. Ray's default folder names (a date) give none.

    ``checkpoint_name``: the model checkpoint inside each reported folder, a name or glob
    (``"model.safetensors"``, ``"*.pt"``, ``"model"`` for a DCP sub-folder), or ``"."`` for
    the reported folder itself, whose layout is detected as for any checkpoint folder (one
    ``torch.save``/safetensors file, a DCP folder, a Hugging Face folder). Default: the
    sweep's ``checkpoints`` entry when it is a bare name or glob (``checkpoints: model.pt`` in
    the sweep file), else ``"."``. Name the file when the folder also holds an optimizer's
    state.

    ``prefix``: the returned metrics are ``"{prefix}/{evaluation}/{metric}"`` and, with
    several evaluations, ``"{prefix}/aggregate"``. ``force``: evaluate again cells the store
    holds (default: a cell already stored is returned without evaluating it). ``progress``:
    print rayeval's plan line and progress lines (to the validation task's log).
    ``check``: check the data sets, the model and the store now, before training starts, so
    that bad input fails here rather than in every validation (skipped for Hugging Face sweeps
    without a factory: the model comes from the checkpoints).

    ``ray_remote_kwargs``: options of the validation task (``ray.remote``). Default
    ``{"num_cpus": 0}``: the task only plans and waits while rayeval's workers, which reserve
    their own resources, evaluate; give it resources if it should hold some.

    Raises :class:`rayeval.SpecError` for a bad option or sweep, and with ``check`` the
    ``DataError``/``ModelError``/``StoreError`` that ``rayeval run`` raises before Ray starts.
    """
    import ray.train

    from rayeval import api
    from rayeval.plan.loader import with_overrides

    if isinstance(sweep, (str, os.PathLike)):
        sweep = api.load_sweep(sweep)
    elif not isinstance(sweep, Sweep):
        raise TypeError(f"sweep: expected a rayeval.Sweep or the path of a sweep file, got "
                        f"{type(sweep).__name__}")
    sweep = with_overrides(sweep, workers=workers,
                           output=None if output is None else os.fspath(output))
    changes: dict[str, Any] = {}
    if use_gpu is not None:
        if not isinstance(use_gpu, bool):
            raise SpecError(f"use_gpu: expected true or false, got {use_gpu!r}")
        changes["use_gpu"] = use_gpu
    if resources_per_worker is not None:
        changes["resources_per_worker"] = _resources(resources_per_worker)
    sweep = sweep.replace(**changes)
    if sweep.use_gpu and dict(sweep.resources_per_worker).get("GPU", 1) == 0:
        raise SpecError("resources_per_worker: GPU: 0 with use_gpu: true; give each "
                        "validation worker a GPU")
    if timeout_s is not None and not (isinstance(timeout_s, (int, float))
                                      and not isinstance(timeout_s, bool) and timeout_s > 0):
        raise SpecError(f"timeout_s: expected a number of seconds above 0, got {timeout_s!r}")
    for name, value in (("step_key", step_key), ("epoch_key", epoch_key), ("prefix", prefix)):
        if not isinstance(value, str) or not value:
            raise SpecError(f"{name}: expected a non-empty string, got {value!r}")
    if step_key == epoch_key:
        raise SpecError(f"step_key and epoch_key are both {step_key!r}; give them other names")
    pattern = _inner_pattern(sweep) if checkpoint_name is None else checkpoint_name
    if pattern in (".", "./"):
        pattern = None
    elif pattern is not None and (not isinstance(pattern, str) or not pattern.strip("/")
                                or pattern.startswith("/") or ".." in pattern.split("/")):
        raise SpecError(f"checkpoint_name: expected a name or glob inside the reported "
                        f"checkpoint folder (model.pt, *.safetensors), got {pattern!r}")
    if check:
        _check(sweep)
    fn = RayevalValidation(sweep, pattern=pattern, step_key=step_key, epoch_key=epoch_key,
                           prefix=prefix, force=force, progress=progress)
    return ray.train.ValidationConfig(
        fn, task_config=ray.train.ValidationTaskConfig(timeout_s=timeout_s),
        ray_remote_kwargs={"num_cpus": 0, **dict(ray_remote_kwargs or {})})


def _resources(raw: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    """``resources_per_worker`` as the Sweep holds it, checked as the sweep file's key is."""
    if not isinstance(raw, Mapping) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
            and v >= 0 for k, v in raw.items()):
        raise SpecError(f"resources_per_worker: expected a mapping of resource names to "
                        f"amounts (e.g. {{'CPU': 4, 'GPU': 1}}), got {raw!r}")
    return tuple(sorted((k, float(v)) for k, v in raw.items()))


def _inner_pattern(sweep: Sweep) -> str | None:
    """The sweep's ``checkpoints`` entry when it is one bare name or glob (the spec resolved
    ``model.pt`` to ``<sweep folder>/model.pt``): the file to take inside each reported
    folder. Anything else (``ckpts/step_*``, an absolute path, a URI) is for ``rayeval run``
    and is ignored here."""
    if len(sweep.checkpoints) != 1:
        return None
    location = sweep.checkpoints[0]
    if "://" in location:
        return None
    if not os.path.isabs(location):             # a Sweep built in Python, not resolved
        return location if "/" not in location.strip("/") else None
    if os.path.dirname(location) != os.path.normpath(sweep.base_dir):
        return None
    return os.path.basename(location)


def _check(sweep: Sweep) -> None:
    """What ``rayeval run`` checks before Ray starts that does not need a checkpoint (the
    plan's pre-flight checks, ``preflight.check_inputs``)."""
    from rayeval.plan import preflight
    from rayeval.io.store import ResultStore

    if sweep.model.hugging_face:            # the model is built from a checkpoint's config
        ResultStore(sweep.output).check(write=True)
        return
    preflight.check_inputs(sweep)


class RayevalValidation:
    """The validation function: ``fn(checkpoint, **fn_kwargs) -> dict`` (see the module
    docstring). Picklable: Ray Train sends it to its controller and to each validation task."""

    def __init__(self, sweep: Sweep, *, pattern: str | None = None, step_key: str = "step",
                 epoch_key: str = "epoch", prefix: str = "eval", force: bool = False,
                 progress: bool = False):
        self.sweep = sweep
        self.pattern = pattern
        self.step_key = step_key
        self.epoch_key = epoch_key
        self.prefix = prefix
        self.force = force
        self.progress = progress

    def __repr__(self) -> str:
        return f"rayeval validation of sweep {self.sweep.name!r} into {self.sweep.output}"

    def __call__(self, checkpoint, **kwargs: Any) -> dict[str, float]:
        unknown = sorted(set(kwargs) - {self.step_key, self.epoch_key})
        if unknown:
            raise SpecError(f"validation fn_kwargs: unknown key(s) {', '.join(unknown)}; "
                            f"rayeval's validation takes {self.step_key!r} and "
                            f"{self.epoch_key!r} (step_key, epoch_key)")
        step = _whole(kwargs.get(self.step_key), self.step_key)
        epoch = _whole(kwargs.get(self.epoch_key), self.epoch_key)
        folder = self.folder(checkpoint)
        location = self.locate(folder)
        return self.evaluate(location, step, epoch)

    # --- where the checkpoint is ---------------------------------------------------------

    def folder(self, checkpoint) -> str:
        """A location rayeval reads the persisted checkpoint folder at, without a copy when it
        can: its own path on a local (or shared) filesystem, an ``s3://``/``gs://`` URI on an
        object store (workers fetch it once per node). Otherwise, or when that URI cannot be
        read with this process's credentials, a copy under the temporary folder named like the
        checkpoint, so the stored name (and the step in it) stays meaningful."""
        import pyarrow.fs as pafs

        from rayeval.io import paths

        fs, path = checkpoint.filesystem, str(checkpoint.path)
        if isinstance(fs, pafs.LocalFileSystem) and os.path.isdir(path):
            return os.path.abspath(path)
        scheme = {"s3": "s3", "gcs": "gs"}.get(getattr(fs, "type_name", ""))
        if scheme:
            uri = f"{scheme}://{path.lstrip('/')}"
            try:
                if paths.is_dir(uri):
                    return uri
            except (OSError, ValueError):
                pass
        # Keyed by where it is and what it holds: a checkpoint rewritten is copied again.
        listing = sorted((i.path, i.size, i.mtime_ns) for i in fs.get_file_info(
            pafs.FileSelector(path, recursive=True)))
        ident = [fs.type_name, getattr(fs, "base_path", ""), path, listing]
        digest = hashlib.sha256(repr(ident).encode()).hexdigest()[:16]
        target = os.path.join(tempfile.gettempdir(), "rayeval-ray-train", digest,
                              path.rstrip("/").rsplit("/", 1)[-1])
        if not os.path.isdir(target):
            import shutil

            partial = target + ".partial"
            shutil.rmtree(partial, ignore_errors=True)      # left by a task that was killed
            checkpoint.to_directory(partial)
            os.replace(partial, target)
        return target

    def locate(self, folder: str) -> str:
        """The checkpoint to evaluate: ``pattern`` inside the folder, else the folder."""
        from rayeval.io import paths
        from rayeval.io.checkpoints import in_progress

        if self.pattern is None:
            return folder
        found = [f for f in paths.glob(f"{folder.rstrip('/')}/{self.pattern}")
                 if not in_progress(f)]
        if len(found) == 1:
            return found[0]
        inside = ", ".join(f.rsplit("/", 1)[-1] for f in found)
        raise CheckpointError(
            f"{folder}: {'no' if not found else 'several'} checkpoint(s) matching "
            f"{self.pattern!r} inside the reported checkpoint{': ' + inside if found else ''}; "
            "save the model under that name, or set validation_config(checkpoint_name=...)")

    # --- evaluating it -------------------------------------------------------------------

    def ref(self, location: str, step: int | None, epoch: int | None):
        """The checkpoint as a run's plan holds it, with the step and epoch from fn_kwargs,
        else from the names of the checkpoint folder and of the model file in it, in that
        order (not Ray's dated folder names)."""
        from rayeval.io.checkpoints import CheckpointRef, parse_epoch, parse_step

        names = [location.rstrip("/")]
        if self.pattern is not None:          # the folder's name first: checkpoint_dir_name
            names.insert(0, location.rstrip("/").rsplit("/", 1)[0])
        names = [n for n in names if not _RAY_DEFAULT_NAME.fullmatch(n.rsplit("/", 1)[-1])]
        if step is None:
            step = next((s for s in map(parse_step, names) if s is not None), None)
        if epoch is None:
            epoch = next((e for e in map(parse_epoch, names) if e is not None), None)
        return CheckpointRef(location, step, epoch)

    def evaluate(self, location: str, step: int | None, epoch: int | None) -> dict[str, float]:
        """``rayeval run`` of the sweep on this one checkpoint (``api.run_sweep``: the trackers
        attached to ``driver.run_sweep``, whose ``RunSequence`` is every run's, with the
        checkpoint and its step given instead of globs), on the Ray this task runs in, which
        it leaves running (or one it starts and shuts down, when called outside Ray); the
        metrics of its cells, read back from the store (cached cells too)."""
        from rayeval.api import run_sweep
        from rayeval.plan.cells import checkpoint_fingerprint
        from rayeval.io.store import ResultStore
        from rayeval.reporting.display import console_callbacks

        sweep = self.sweep.replace(checkpoints=(location,))
        ref = self.ref(location, step, epoch)
        # The run's lifecycle puts the task's signal handlers back if it starts Ray.
        report = run_sweep(sweep, force=self.force,
                           callbacks=console_callbacks(self.progress),
                           say=print if self.progress else None,
                           ready=[(ref, checkpoint_fingerprint(location))])
        plan, outcomes = report.plan, report.outcomes
        store = ResultStore(sweep.output)
        failed = [o for o in outcomes if not o.ok]
        if failed:
            why: dict[str, list[str]] = {}      # one checkpoint error fails every evaluation
            for o in failed:
                why.setdefault(o.error, []).append(o.evaluation)
            total = len(plan.cells) + len(plan.cached) + len(plan.failed)
            raise CheckpointError(
                f"validation failed for {len(failed)} of {total} evaluation(s) of this "
                "checkpoint (any that succeeded are in the store): "
                + "; ".join(f"[{', '.join(evals)}] {error}" for error, evals in why.items()))
        done = {o.key for o in outcomes} | {c.key for c in plan.cached}
        missing = [c for c in plan.cells if c.key not in done]
        if missing:
            raise CheckpointError(f"validation of {location}: the run returned no result for "
                                  f"{', '.join(c.evaluation for c in missing)}")
        return self.metrics(store, [c.key for c in plan.cells + plan.cached])

    def metrics(self, store, keys: list[str]) -> dict[str, float]:
        """``{prefix/evaluation/metric: value}`` from the cells' stored rows (confusion
        matrices left out), and ``prefix/aggregate`` as the leaderboard computes it."""
        from rayeval.ranking import aggregates

        rows = store.read_cells(keys, sweep=self.sweep.name).to_pylist()
        out: dict[str, float] = {}
        for r in rows:
            if r["value"] is not None and not r.get("matrix"):
                out[f"{self.prefix}/{r['evaluation']}/{r['metric']}"] = float(r["value"])
        for agg in aggregates(rows):
            if not math.isnan(agg["value"]):
                out[f"{self.prefix}/aggregate"] = float(agg["value"])
        return out


def _whole(value, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise SpecError(f"validation fn_kwargs[{key!r}]: expected a whole number, got "
                        f"{value!r}")
    return value
