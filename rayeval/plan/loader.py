"""The sweep file: loaded once, validated, and turned into frozen, typed objects.

Raw dicts go no further than ``load_sweep``. The values are read by ``config.reader``, which
walks the schema's declarations (type, bounds, choices, default, key path); the rules between
fields are ``plan.validation``'s; the ``lm_eval:`` and ``lmms_eval:`` entries are rendered by
the entry kinds their slices register (``config.entries``: ``harness.entries``,
``lmms.entries``), which the loader calls by the entry's key. What is left here is the file, its shape (one evaluation or a suite)
and the order things are read in. Every error names the file and the key path at fault
(``dataset.target``, ``metrics[2]``) and says how to fix it. Nothing is written.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import yaml

from rayeval.config import schema
from rayeval.config.entries import EntryContext, kinds
from rayeval.config.reader import Reader, join, show as _show
from rayeval.config.run_schema import aggregate_of, check_weights
from rayeval.config.schema import (Bootstrap, DatasetSpec, EvalSpec, Generation, JudgeSpec,
                                   MlflowTracker, ModelSpec, Sweep, Trackers, WandbTracker,
                                   WatchSpec)
from rayeval.core.metrics import parse_metric
from rayeval.core.tasks import TASKS
from rayeval.errors import SpecError
from rayeval.io import paths
from rayeval.plan import validation
# Re-exported: the command line, the API and the integrations take them from the loader.
from rayeval.plan.overrides import (is_relative_local, with_overrides,  # noqa: F401
                                    with_trackers, written_locations)

# The keys each mapping accepts, walked from the schema's fields (``schema.keys``): a field
# added there is a key here. ``evals`` entries' own keys that the top level may give as every
# evaluation's default (``sweep_default``: batch_size, bootstrap) are top-level keys too.
EVAL_KEYS = schema.keys(EvalSpec)
SWEEP_KEYS = schema.keys(Sweep) | {k for k, f in schema.sweep_fields(EvalSpec)
                                   if f.metadata["sweep_default"]}
SINGLE_FORM_KEYS = EVAL_KEYS - SWEEP_KEYS     # the one-evaluation form: dataset, task, ...
SINGLE_FORM_DATASET_KEYS = {f.metadata["single_form"].split(".", 1)[1]   # dataset.name
                            for _, f in schema.sweep_fields(EvalSpec)
                            if f.metadata["single_form"]}
DATASET_KEYS = schema.keys(DatasetSpec)
TRACKERS_KEYS = schema.keys(Trackers)
WATCH_KEYS = schema.keys(WatchSpec)


@dataclasses.dataclass(frozen=True)
class _Defaults:
    """What the sweep's top level gives every evaluation that does not give its own."""
    batch_size: int
    bootstrap: Bootstrap
    samples: bool


def load_sweep(path: str, output: str | None = None) -> Sweep:
    """Read and validate a sweep file; raises SpecError naming the key path at fault.
    ``output``: the result store in place of the file's ``output:`` (``--output``; a relative
    folder is taken from the current one), which the file may then leave out."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8", newline="") as f:   # its line ends as written:
            text = f.read()                                     # the store keeps this text
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
    if output is not None and isinstance(raw, dict):     # before the entries read the store
        raw = {**raw, "output": paths.resolve(os.fspath(output), os.getcwd())}
    return parse_sweep(raw, base_dir=base_dir, source=source).replace(text=text)


def parse_sweep(raw: Any, *, base_dir: str, source: str = "<sweep>") -> Sweep:
    """Validate an already-parsed sweep mapping (what ``load_sweep`` reads from YAML)."""
    r = Reader(source, resolve=lambda location: paths.resolve(location, base_dir))
    top = r.mapping(raw, "", SWEEP_KEYS | SINGLE_FORM_KEYS)
    defaults = _Defaults(
        batch_size=r.field(EvalSpec, "batch_size", top, "batch_size"),
        bootstrap=r.build(Bootstrap, top.get("bootstrap"), "bootstrap"),
        samples=r.field(EvalSpec, "samples", top, "samples", default=True))  # where tasks keep
    model = r.build(ModelSpec, top.get("model"), "model")
    validation.model(r, model)
    entries = EntryContext(r, top, model)      # what the rendered entries share
    validation.one_form(r, top, SINGLE_FORM_KEYS)
    if "evals" in top:
        evals = _evals(r, top["evals"], base_dir, defaults, entries)
    else:
        evals = (_single_form(r, top, base_dir, defaults),)
    validation.tokenizer(r, model, evals)
    given = r.section(Sweep, top, "", extra=SWEEP_KEYS | SINGLE_FORM_KEYS,
                      skip={"model", "evals", "watch", "trackers", "aggregate"})
    given["aggregate"] = aggregate_of(r, top.get("aggregate"))
    given["watch"] = watch_spec(_given(top, "watch"), source=source)
    given["trackers"] = trackers_spec(_given(top, "trackers"), source=source)
    validation.settings(r, given)
    sweep = Sweep(**given, model=model, evals=evals, base_dir=base_dir, source=source,
                  groups=tuple(entries.groups))
    validation.backend_fits(r, sweep)
    check_weights(r, sweep.aggregate, sweep.suite_evaluations())
    if sweep.select is not None:        # select.metric left out: what the board ranks by
        sweep = sweep.replace(select=sweep.select.for_suite(sweep.suite_evaluations()))
    validation.select(r, sweep)
    return sweep


def _given(m: dict, key: str) -> Any:
    """A section's mapping; left out or null, an empty one (its defaults)."""
    value = m.get(key)
    return {} if value is None else value


def _single_form(r: Reader, top: dict, base_dir: str, defaults: _Defaults) -> EvalSpec:
    """The one-evaluation form: named by ``dataset.name``, else by its data's file name."""
    ds = r.mapping(top["dataset"], "dataset", DATASET_KEYS | SINGLE_FORM_DATASET_KEYS)
    name = r.field(EvalSpec, "name", ds, "dataset.name", default=None)
    if name is not None:
        validation.evaluation_name(r, name, "dataset.name")
    else:
        name = _stem(r.field(DatasetSpec, "path", ds, "dataset.path"))
    return _evaluation(r, {**top, "name": name}, "", base_dir, defaults,
                       dataset_extra=SINGLE_FORM_DATASET_KEYS)


def _evals(r: Reader, raw: Any, base_dir: str, defaults: _Defaults,
           entries: EntryContext) -> tuple[EvalSpec, ...]:
    validation.evals_list(r, raw)
    evals: list[EvalSpec] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(raw):
        path = f"evals[{i}]"
        m = r.mapping(item, path, EVAL_KEYS)
        name = r.field(EvalSpec, "name", m, f"{path}.name")
        validation.evaluation_name(r, name, f"{path}.name")
        validation.unique_name(r, name, f"{path}.name", seen, i)
        kind = validation.entry_kind(m)
        if kind is not None:                   # lm_eval:, lmms_eval:: rendered by its slice
            batch_size, bootstrap = _own_settings(r, m, path, defaults)
            samples = r.field(EvalSpec, "samples", m, f"{path}.samples",
                              default=defaults.samples)
            validation.rendered_entry(r, m, path, kind)
            rendered = kinds().get(kind).evaluations(entries, m, path, batch_size, bootstrap,
                                                     samples)
            for ev in rendered:      # a judge with its own prompt: checked as a native one's
                if ev.judge is not None and ev.judge.staged:
                    validation.judge(r, ev.judge, ev.task, f"{path}.judge", True,
                                     ev.generation, f"{path}.judge")
            evals.extend(rendered)
        else:
            evals.append(_evaluation(r, m, path, base_dir, defaults))
    return tuple(evals)


def _evaluation(r: Reader, m: dict, path: str, base_dir: str, defaults: _Defaults,
                dataset_extra: frozenset | set = frozenset()) -> EvalSpec:
    """One evaluation; ``path`` is its key path ("" for the top-level single form)."""
    task = r.field(EvalSpec, "task", m, join(path, "task"))
    validation.task_name(r, task, join(path, "task"))
    dataset = _dataset(r, m.get("dataset"), join(path, "dataset"), task, dataset_extra)
    metrics = _metrics(r, m.get("metrics"), join(path, "metrics"), task, base_dir)
    batch_size, bootstrap = _own_settings(r, m, path, defaults)
    generation = _generation(r, m.get("generation"), join(path, "generation"), task)
    judge = _judge(r, m.get("judge"), join(path, "judge"), task, metrics, generation,
                   join(path, "metrics"))
    return EvalSpec(
        name=m["name"], task=task, dataset=dataset, metrics=metrics,
        batch_size=batch_size, bootstrap=bootstrap, generation=generation, judge=judge,
        # a judge reads the stored generations: a judged evaluation keeps its records
        samples=judge is not None or _samples(r, m, path, task, defaults.samples),
        key_path=path or "(top level)")


def _dataset(r: Reader, raw: Any, path: str, task: str, extra: frozenset | set) -> DatasetSpec:
    if raw is None:
        r.fail(path, "missing required key")
    m = r.mapping(raw, path, DATASET_KEYS | set(extra))
    spec = DatasetSpec(**r.section(DatasetSpec, m, path, extra=extra,
                                   required=validation.dataset_required(task, m)),
                       key_path=path)
    validation.dataset(r, spec, task, path)
    return spec


def _metrics(r: Reader, raw: Any, path: str, task: str, base_dir: str) -> tuple:
    """The ``metrics`` list, each entry parsed by the metric registry (``parse_metric``)."""
    if raw is None:
        r.fail(path, "missing required key")
    if not isinstance(raw, list) or not raw:
        r.fail(path, f"expected a non-empty list of metric names, got {_show(raw)}")
    metrics = []
    seen: dict[str, int] = {}
    for i, item in enumerate(raw):
        try:
            spec = parse_metric(item, task, base_dir)
        except SpecError as e:
            r.fail(f"{path}[{i}]", e.message)
        if spec.key in seen:
            r.fail(f"{path}[{i}]", f"{spec.key!r} is listed twice (also "
                                   f"{path}[{seen[spec.key]}]); remove one")
        seen[spec.key] = i
        metrics.append(spec)
    return tuple(metrics)


def _own_settings(r: Reader, m: dict, path: str, defaults: _Defaults) -> tuple[int, Bootstrap]:
    """An entry's own ``batch_size`` and ``bootstrap`` over the sweep's (the top-level single
    form, ``path`` "", has the sweep's)."""
    if not path:
        return defaults.batch_size, defaults.bootstrap
    bootstrap = defaults.bootstrap
    if m.get("bootstrap") is not None:
        bootstrap = r.build(Bootstrap, m["bootstrap"], f"{path}.bootstrap", base=bootstrap)
    return r.field(EvalSpec, "batch_size", m, f"{path}.batch_size",
                   default=defaults.batch_size), bootstrap


def _samples(r: Reader, m: dict, path: str, task: str, default: bool) -> bool:
    """Whether an evaluation keeps per-item records: the tasks that keep them (text tasks,
    classification: ``Task.keeps_records``) do unless turned off (here or by the sweep's
    top-level ``samples``); other tasks keep none."""
    if not path or m.get("samples") is None:
        return default and TASKS[task].keeps_records
    given = r.field(EvalSpec, "samples", m, f"{path}.samples", default=default)
    validation.samples(r, given, task, f"{path}.samples")
    return given


def _generation(r: Reader, raw: Any, path: str, task: str) -> Generation:
    if raw is None:
        return Generation()
    validation.generation_allowed(r, task, path)
    spec = r.build(Generation, raw, path)
    validation.generation(r, spec, path)
    return spec


def _judge(r: Reader, raw: Any, path: str, task: str, metrics: tuple, generation: Generation,
           metrics_path: str) -> JudgeSpec | None:
    """The ``judge:`` section (docs/judges.md), checked with the metrics that list it."""
    listed = any(m.name == "judge" for m in metrics)
    if raw is None:
        if listed:
            r.fail(metrics_path, "metric 'judge' needs a judge: section beside it (a model, "
                                 "a prompt and a verdict); see docs/judges.md")
        return None
    spec = r.build(JudgeSpec, raw, path, key_path=path)
    validation.judge(r, spec, task, path, listed, generation, metrics_path)
    return spec


def watch_spec(raw: Any, *, source: str = "<sweep>", base: WatchSpec = WatchSpec(),
               prefix: str = "watch.") -> WatchSpec:
    """The ``watch:`` mapping (or the CLI's ``--ready``/``--order`` over ``base``, with
    ``prefix="--"``): keys left out come from ``base``."""
    r = Reader(source)
    if prefix == "watch.":
        r.mapping(raw, "watch", WATCH_KEYS)
    spec = WatchSpec(**{f.name: r.field(WatchSpec, f.name, raw, prefix + key,
                                        default=getattr(base, f.name))
                        for key, f in schema.sweep_fields(WatchSpec)})
    validation.watch(r, spec, prefix)
    return spec


def trackers_spec(raw: Any, *, source: str = "<sweep>", base: Trackers = Trackers(),
                  prefix: str = "trackers", removable: bool = False) -> Trackers:
    """The ``trackers:`` mapping (or ``rayeval.run``'s ``trackers=``): each tracker named
    replaces ``base``'s; trackers left out come from ``base``. With ``removable`` (the API),
    ``None`` removes a tracker; in a sweep file, ``mlflow: {}`` is MLflow with its defaults
    and an empty ``mlflow:`` is an error, not a tracker silently left out."""
    r = Reader(source)
    m = r.mapping(raw, prefix, TRACKERS_KEYS)
    found = {"mlflow": base.mlflow, "wandb": base.wandb}
    for name, cls in (("mlflow", MlflowTracker), ("wandb", WandbTracker)):
        if name in m:
            path = f"{prefix}.{name}"
            found[name] = None if removable and m[name] is None else \
                r.build(cls, _mapping_or_fail(r, m[name], path), path, key_path=path)
    return Trackers(**found)


def _mapping_or_fail(r: Reader, value: Any, path: str) -> dict:
    """An empty section (``mlflow:``) is an error here, not the section's defaults."""
    if not isinstance(value, dict):
        r.fail(path, f"expected a mapping, got {_show(value)}")
    return value


def _stem(location: str) -> str:
    base = location.rstrip("/").rsplit("/", 1)[-1]
    for suffix in (".parquet", ".pq"):
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base
