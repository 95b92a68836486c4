"""The sweep file: loaded once, validated, and turned into frozen, typed objects.

Raw dicts go no further than ``load_sweep``. Every error names the file and the key path at
fault (``dataset.target``, ``metrics[2]``) and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml

from . import paths
from .errors import SpecError
from .evaluate import Bootstrap
from .loading import DTYPES, CheckpointSpec
from .metrics import TASKS, MetricSpec, parse_metric


@dataclass(frozen=True)
class ModelSpec:
    factory: str                         # "module:callable"
    kwargs: dict = field(default_factory=dict)
    dtype: str | None = None             # evaluation dtype; None: the model's own


@dataclass(frozen=True)
class DatasetSpec:
    path: str                            # resolved location: file, folder or glob
    inputs: str
    target: str
    id: str | None = None
    name: str = ""                       # shown in results; defaults to the path's stem
    ignore_index: int = -100             # language modeling: target ids that are not scored
    pad_id: int = 0                      # language modeling: fills short input sequences


@dataclass(frozen=True)
class Recovery:
    max_restarts: int = 3                # worker-group restarts after a worker dies or stalls
    stall_timeout_s: int = 600           # a rank this late to a sync point fails the group


@dataclass(frozen=True)
class Sweep:
    name: str
    model: ModelSpec
    checkpoints: tuple[str, ...]         # resolved locations or globs
    dataset: DatasetSpec
    task: str
    metrics: tuple[MetricSpec, ...]
    batch_size: int
    workers: int
    use_gpu: bool
    output: str                          # resolved location of the result store
    base_dir: str                        # the sweep file's folder: model modules are found here
    source: str = ""                     # the sweep file, for messages
    bootstrap: Bootstrap = Bootstrap()
    checkpoint: CheckpointSpec = CheckpointSpec()
    recovery: Recovery = Recovery()
    resources_per_worker: tuple[tuple[str, float], ...] = ()   # Ray resources each worker holds

    def with_overrides(self, *, workers: int | None = None, output: str | None = None) -> "Sweep":
        """The CLI's ``--workers`` / ``--output`` (relative output taken from the cwd)."""
        changes: dict[str, Any] = {}
        if workers is not None:
            if workers < 1:
                raise SpecError(f"--workers: must be at least 1, got {workers}")
            changes["workers"] = workers
        if output is not None:
            changes["output"] = paths.resolve(output, os.getcwd())
        return dataclasses.replace(self, **changes)


_TOP_KEYS = {
    "name", "model", "checkpoints", "dataset", "task", "metrics", "batch_size", "workers",
    "use_gpu", "output", "bootstrap", "checkpoint", "recovery", "resources_per_worker",
}


def load_sweep(path: str) -> Sweep:
    """Read and validate a sweep file; raises SpecError naming the key path at fault."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise SpecError(f"{source}: sweep file not found; check the path") from None
    except OSError as e:
        raise SpecError(f"{source}: cannot read the sweep file: {e.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise SpecError(f"{source}: not valid YAML{where}: {problem}") from None
    base_dir = os.path.dirname(os.path.abspath(source))
    return parse_sweep(raw, base_dir=base_dir, source=source)


def parse_sweep(raw: Any, *, base_dir: str, source: str = "<sweep>") -> Sweep:
    """Validate an already-parsed sweep mapping (what ``load_sweep`` reads from YAML)."""
    r = _Reader(source)
    top = r.mapping(raw, "", _TOP_KEYS)

    name = r.string(top, "name", required=True)
    model_raw = r.mapping(r.get(top, "model", required=True), "model",
                          {"factory", "kwargs", "dtype"})
    dtype = r.string(model_raw, "dtype", path="model.dtype")
    if dtype is not None and dtype not in DTYPES:
        r.fail("model.dtype", f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    factory = r.string(model_raw, "factory", path="model.factory", required=True)
    module, _, attr = factory.partition(":")
    if not module or not attr:
        r.fail("model.factory", f"expected 'module:callable', got {factory!r}")
    kwargs = r.get(model_raw, "kwargs", default={})
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        r.fail("model.kwargs", f"expected a mapping of keyword arguments, got {_show(kwargs)}")

    ckpts_raw = r.get(top, "checkpoints", required=True)
    if isinstance(ckpts_raw, str):
        ckpts_raw = [ckpts_raw]
    if not isinstance(ckpts_raw, list) or not ckpts_raw:
        r.fail("checkpoints", f"expected a non-empty list of paths or globs, got {_show(ckpts_raw)}")
    checkpoints = []
    for i, item in enumerate(ckpts_raw):
        if not isinstance(item, str) or not item.strip():
            r.fail(f"checkpoints[{i}]", f"expected a path or glob, got {_show(item)}")
        checkpoints.append(paths.resolve(item, base_dir))

    task = r.string(top, "task", required=True)
    if task not in TASKS:
        r.fail("task", f"unknown task {task!r}; choose one of: {', '.join(sorted(TASKS))}")

    ds_raw = r.mapping(r.get(top, "dataset", required=True), "dataset",
                       {"path", "inputs", "target", "id", "name", "ignore_index", "pad_id"})
    ds_path = paths.resolve(r.string(ds_raw, "path", path="dataset.path", required=True), base_dir)
    lm = task == "language_modeling"
    dataset = DatasetSpec(
        path=ds_path,
        inputs=r.string(ds_raw, "inputs", path="dataset.inputs", required=True),
        target=r.string(ds_raw, "target", path="dataset.target", required=not lm),
        id=r.string(ds_raw, "id", path="dataset.id"),
        name=r.string(ds_raw, "name", path="dataset.name") or _stem(ds_path),
        ignore_index=r.integer(ds_raw, "ignore_index", default=-100, minimum=None,
                               path="dataset.ignore_index"),
        pad_id=r.integer(ds_raw, "pad_id", default=0, minimum=0, path="dataset.pad_id"),
    )

    metrics_raw = r.get(top, "metrics", required=True)
    if not isinstance(metrics_raw, list) or not metrics_raw:
        r.fail("metrics", f"expected a non-empty list of metric names, got {_show(metrics_raw)}")
    metrics = []
    for i, item in enumerate(metrics_raw):
        try:
            metrics.append(parse_metric(item, task, base_dir))
        except SpecError as e:
            r.fail(f"metrics[{i}]", e.message)
    seen: dict[str, int] = {}
    for i, m in enumerate(metrics):
        if m.key in seen:
            r.fail(f"metrics[{i}]", f"{m.key!r} is listed twice (also metrics[{seen[m.key]}]); "
                                    "remove one")
        seen[m.key] = i

    batch_size = r.integer(top, "batch_size", default=256, minimum=1)
    workers = r.integer(top, "workers", default=1, minimum=1)
    use_gpu = r.boolean(top, "use_gpu", default=False)
    output = paths.resolve(r.string(top, "output", required=True), base_dir)
    bootstrap = _bootstrap(r, r.get(top, "bootstrap", default={}))
    ck_raw = r.mapping(r.get(top, "checkpoint", default={}), "checkpoint",
                       {"key", "strip_prefix", "trust_pickle"})
    checkpoint = CheckpointSpec(
        key=r.string(ck_raw, "key", path="checkpoint.key"),
        strip_prefix=r.string(ck_raw, "strip_prefix", path="checkpoint.strip_prefix"),
        trust_pickle=r.boolean(ck_raw, "trust_pickle", default=False,
                               path="checkpoint.trust_pickle"),
    )
    res_raw = r.get(top, "resources_per_worker", default={})
    if not isinstance(res_raw, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
            and v >= 0 for k, v in res_raw.items()):
        r.fail("resources_per_worker", f"expected a mapping of resource names to amounts "
                                       f"(e.g. {{CPU: 4, GPU: 1}}), got {_show(res_raw)}")
    if use_gpu and res_raw.get("GPU", 1) == 0:
        r.fail("resources_per_worker", "GPU: 0 with use_gpu: true; give each worker a GPU")
    rec_raw = r.mapping(r.get(top, "recovery", default={}), "recovery",
                        {"max_restarts", "stall_timeout_s"})
    recovery = Recovery(
        max_restarts=r.integer(rec_raw, "max_restarts", default=Recovery.max_restarts,
                               minimum=0, path="recovery.max_restarts"),
        stall_timeout_s=r.integer(rec_raw, "stall_timeout_s", default=Recovery.stall_timeout_s,
                                  minimum=1, path="recovery.stall_timeout_s"),
    )

    return Sweep(
        name=name, model=ModelSpec(factory=factory, kwargs=dict(kwargs), dtype=dtype),
        checkpoints=tuple(checkpoints), dataset=dataset, task=task, metrics=tuple(metrics),
        batch_size=batch_size, workers=workers, use_gpu=use_gpu, output=output,
        base_dir=base_dir, source=source, bootstrap=bootstrap, checkpoint=checkpoint,
        recovery=recovery,
        resources_per_worker=tuple(sorted((k, float(v)) for k, v in res_raw.items())),
    )


def written_locations(raw: dict) -> list[tuple[str, str]]:
    """The data, checkpoint and output locations a sweep file names, as written (before they
    are resolved against its folder), with their key paths: what `submit` and `k8s render`
    check, since relative paths mean this machine's files."""
    out = [("dataset.path", (raw.get("dataset") or {}).get("path"))]
    ckpts = raw.get("checkpoints")
    out += [(f"checkpoints[{i}]", c)
            for i, c in enumerate([ckpts] if isinstance(ckpts, str) else (ckpts or []))]
    out.append(("output", raw.get("output")))
    return [(key, value) for key, value in out if isinstance(value, str)]


def is_relative_local(value: str) -> bool:
    return not paths.is_uri(value) and not os.path.isabs(os.path.expanduser(value))


def _bootstrap(r: "_Reader", raw) -> Bootstrap:
    m = r.mapping(raw, "bootstrap", {"replicates", "confidence", "seed", "buckets"})
    d = Bootstrap()
    confidence = r.get(m, "confidence", path="bootstrap.confidence", default=d.confidence)
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) \
            or not 0 < confidence < 1:
        r.fail("bootstrap.confidence", f"expected a number between 0 and 1, got {_show(confidence)}")
    return Bootstrap(
        replicates=r.integer(m, "replicates", default=d.replicates, minimum=0,
                             path="bootstrap.replicates"),
        confidence=float(confidence),
        seed=r.integer(m, "seed", default=d.seed, minimum=0, path="bootstrap.seed"),
        buckets=r.integer(m, "buckets", default=d.buckets, minimum=1, path="bootstrap.buckets"),
    )


def _stem(location: str) -> str:
    base = location.rstrip("/").rsplit("/", 1)[-1]
    for suffix in (".parquet", ".pq"):
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def _show(value: Any) -> str:
    if value is None:
        return "nothing"
    return f"{value!r} ({type(value).__name__})"


_MISSING = object()


class _Reader:
    """Small typed accessors that know the key path of what they read."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, problem: str):
        raise SpecError(f"{self.source}: {path}: {problem}")

    def mapping(self, value: Any, path: str, allowed: set[str]) -> dict:
        if not isinstance(value, dict):
            what = path or "the sweep file"
            self.fail(path or "(top level)", f"expected a mapping, got {_show(value)}"
                      if path else f"{what} must be a YAML mapping of keys, got {_show(value)}")
        for key in value:
            if key not in allowed:
                full = f"{path}.{key}" if path else str(key)
                hint = _closest(str(key), allowed)
                self.fail(full, "unknown key" + (f"; did you mean {hint!r}?" if hint else
                                                 f"; allowed keys: {', '.join(sorted(allowed))}"))
        return value

    def get(self, m: dict, key: str, *, path: str | None = None, required: bool = False,
            default: Any = None) -> Any:
        path = path or key
        value = m.get(key, _MISSING)
        if value is _MISSING or value is None:
            if required:
                self.fail(path, "missing required key")
            return default
        return value

    def string(self, m: dict, key: str, *, path: str | None = None, required: bool = False) -> Any:
        value = self.get(m, key, path=path, required=required)
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            self.fail(path or key, f"expected a non-empty string, got {_show(value)}")
        return value

    def integer(self, m: dict, key: str, *, default: int, minimum: int | None,
                path: str | None = None) -> int:
        path = path or key
        value = self.get(m, key, path=path, default=default)
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"expected an integer, got {_show(value)}")
        if minimum is not None and value < minimum:
            self.fail(path, f"must be at least {minimum}, got {value}")
        return value

    def boolean(self, m: dict, key: str, *, default: bool, path: str | None = None) -> bool:
        value = self.get(m, key, path=path, default=default)
        if not isinstance(value, bool):
            self.fail(path or key, f"expected true or false, got {_show(value)}")
        return value


def _closest(word: str, options: set[str]) -> str | None:
    import difflib

    found = difflib.get_close_matches(word, sorted(options), n=1, cutoff=0.7)
    return found[0] if found else None

