"""The sweep file: loaded once, validated, and turned into frozen, typed objects.

Raw dicts go no further than ``load_sweep``. Every error names the file and the key path at
fault (``dataset.target``, ``metrics[2]``) and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import yaml

from rayeval.io import paths
from rayeval.config import schema
from rayeval.config.schema import (BACKENDS, DATA_FORMATS, DTYPE_NAMES, WATCH_ORDERS, Bootstrap,
                                   CheckpointSpec, DatasetSpec, EvalSpec, Generation,
                                   GroupMetric, GroupSpec, LmEvalSpec, MetricSpec, ModelSpec,
                                   MlflowTracker, Parallelism, Recovery, Sweep, Trackers, WANDB_MODES,
                                   WandbTracker, WatchSpec)
from rayeval.errors import SpecError
from rayeval.core.metrics import parse_metric
from rayeval.core.tasks import TASKS


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
MODEL_KEYS = schema.keys(ModelSpec)
GENERATION_KEYS = schema.keys(Generation)
LM_EVAL_KEYS = schema.keys(LmEvalSpec)
PARALLELISM_KEYS = schema.keys(Parallelism)
TRACKERS_KEYS = schema.keys(Trackers)
MLFLOW_KEYS = schema.keys(MlflowTracker)
WANDB_KEYS = schema.keys(WandbTracker)
CHECKPOINT_KEYS = schema.keys(CheckpointSpec)
RECOVERY_KEYS = schema.keys(Recovery)
BOOTSTRAP_KEYS = schema.keys(Bootstrap)
WATCH_KEYS = schema.keys(WatchSpec)


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
    top = r.mapping(raw, "", SWEEP_KEYS | SINGLE_FORM_KEYS)
    batch_size = r.integer(top, "batch_size", default=EvalSpec.batch_size, minimum=1)
    bootstrap = _bootstrap(r, r.get(top, "bootstrap", default={}), "bootstrap", EvalSpec.bootstrap)
    samples = r.boolean(top, "samples", default=True)   # where the task keeps records
    model = _model(r, top, base_dir)
    rendered = _Rendering(r, top, model, base_dir)
    if "evals" in top:
        both = sorted(k for k in SINGLE_FORM_KEYS if k in top)
        if both:
            r.fail(both[0], "give the evaluations either as evals: or as one top-level "
                            "dataset/task/metrics, not both; move it into an entry of evals")
        evals = _evals(r, top["evals"], base_dir, batch_size, bootstrap, samples, rendered)
    else:
        if top.get("lm_eval") is not None:
            r.fail("lm_eval", "give an lm-eval task as an entry of evals: "
                              "(evals: [{name: N, lm_eval: {task: T}}])")
        missing = [k for k in ("dataset", "task", "metrics") if top.get(k) is None]
        if missing:
            r.fail(missing[0], "missing required key (or list the evaluations under evals:)")
        ds_raw = r.mapping(top["dataset"], "dataset", DATASET_KEYS | SINGLE_FORM_DATASET_KEYS)
        name = r.string(ds_raw, "name", path="dataset.name")
        if name is not None and ("/" in name or name == "aggregate"):
            r.fail("dataset.name", f"{name!r} cannot name an evaluation ('/' separates the "
                                   "evaluation from the metric, 'aggregate' is the suite's "
                                   "mean); choose another name")
        if name is None:
            name = _stem(paths.resolve(r.string(ds_raw, "path", path="dataset.path",
                                                required=True), base_dir))
        evals = (_evaluation(r, {**top, "name": name}, "", base_dir, batch_size, bootstrap,
                             samples, dataset_extra=SINGLE_FORM_DATASET_KEYS),)
    text = [e for e in evals if TASKS[e.task].uses_text]
    if text and not model.hugging_face and model.tokenizer is None:
        r.fail("model.tokenizer", f"task {text[0].task} ({text[0].key_path}) needs a tokenizer:"
                                  " set model.tokenizer to a folder holding one, or drop "
                                  "model.factory to read Hugging Face folders")
    sweep = Sweep(
        name=r.string(top, "name", required=True),
        model=model, checkpoints=_checkpoints(r, top, base_dir), evals=evals,
        workers=r.integer(top, "workers", default=1, minimum=1),
        use_gpu=(use_gpu := r.boolean(top, "use_gpu", default=False)),
        output=paths.resolve(r.string(top, "output", required=True), base_dir),
        base_dir=base_dir, source=source, checkpoint=_checkpoint(r, top),
        recovery=_recovery(r, top), resources_per_worker=_resources(r, top, use_gpu),
        watch=watch_spec(r.get(top, "watch", default={}), source=source),
        parallelism=_parallelism(r, top),
        trackers=trackers_spec(r.get(top, "trackers", default={}), source=source),
        groups=tuple(rendered.groups),
    )
    _backend_fits(r, sweep)
    rendered.write()          # the whole file is valid: the lm-eval tasks' requests are kept
    return sweep


def _backend_fits(r: "_Reader", sweep: Sweep) -> None:
    """What only vLLM does: sampling and tensor-parallel engines; and its engine
    arguments, checked against the installed vLLM's own (before Ray starts)."""
    vllm = sweep.model.backend == "vllm"
    if sweep.parallelism.tensor > 1 and not vllm:
        r.fail("parallelism.tensor", "tensor-parallel engines are vLLM's: set model.backend: "
                                     "vllm, or remove parallelism.tensor")
    for ev in sweep.evals:
        if ev.generation.samples and not vllm:
            if ev.lm_eval is not None:
                r.fail(f"{ev.key_path}.lm_eval.gen_kwargs",
                       f"lm-eval task {ev.name!r} samples (do_sample or temperature > 0), which "
                       "runs on model.backend: vllm (each document seeded); set it, or decode "
                       "greedily: gen_kwargs: {do_sample: false, temperature: 0}")
            r.fail(f"{ev.key_path}.generation.temperature",
                   "sampled generation (temperature above 0) runs on model.backend: vllm, "
                   "which seeds each item; set it, or set temperature: 0")
    if vllm:
        from rayeval.io import engine

        problem = engine.check_arguments(sweep.model.vllm)
        if problem:
            r.fail(*problem)


def _evals(r: "_Reader", raw: Any, base_dir: str, batch_size: int,
           bootstrap: Bootstrap, samples: bool, rendered: "_Rendering") -> tuple[EvalSpec, ...]:
    if not isinstance(raw, list) or not raw:
        r.fail("evals", f"expected a non-empty list of evaluations, got {_show(raw)}")
    evals: list[EvalSpec] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(raw):
        path = f"evals[{i}]"
        m = r.mapping(item, path, EVAL_KEYS)
        name = r.string(m, "name", path=f"{path}.name", required=True)
        if "/" in name or name == "aggregate":
            r.fail(f"{path}.name", f"{name!r} cannot name an evaluation ('/' separates the "
                                   "evaluation from the metric, 'aggregate' is the suite's "
                                   "mean); choose another name")
        if name in seen:
            r.fail(f"{path}.name", f"{name!r} is used twice (also evals[{seen[name]}].name); "
                                   "give each evaluation its own name")
        seen[name] = i
        if m.get("lm_eval") is not None:
            evals.extend(rendered.evaluation(m, path, batch_size, bootstrap, samples))
        else:
            evals.append(_evaluation(r, m, path, base_dir, batch_size, bootstrap, samples))
    return tuple(evals)


class _Rendering:
    """The ``lm_eval:`` entries: each rendered by lm-eval (plan.harness) into a request table
    that the evaluation reads as its data set; written into the store once the whole sweep file
    is valid."""

    def __init__(self, r: "_Reader", top: dict, model: ModelSpec, base_dir: str):
        self.r, self.top, self.model, self.base_dir = r, top, model, base_dir
        self.pending: list = []
        self.groups: list[GroupSpec] = []
        self._tokenizer = None

    @property
    def output(self) -> str:
        """The result store, which keeps the rendered requests."""
        return paths.resolve(self.r.string(self.top, "output", required=True), self.base_dir)

    def tokenizer(self):
        """The tokenizer a chat template comes from: model.tokenizer, else the first
        checkpoint folder's."""
        if self._tokenizer is None:
            from rayeval.io.hf import load_tokenizer

            folder = self.model.tokenizer
            if folder is None:
                found = [p for pattern in _checkpoints(self.r, self.top, self.base_dir)
                         for p in paths.glob(pattern)]
                if not found:
                    self.r.fail("checkpoints", "no checkpoint matches, so there is no "
                                               "tokenizer for the chat template")
                folder = sorted(found)[0]
            what = "model.tokenizer" if self.model.tokenizer else "checkpoints"
            self._tokenizer = load_tokenizer(folder, what=what).tokenizer
        return self._tokenizer

    def evaluation(self, m: dict, path: str, batch_size: int, bootstrap: Bootstrap,
                   samples: bool) -> list[EvalSpec]:
        from rayeval.plan import harness

        r = self.r
        for key in ("task", "dataset", "metrics", "generation"):
            if m.get(key) is not None:
                r.fail(f"{path}.{key}", "an lm_eval entry takes its data, metrics and decoding "
                                        "from lm-eval; remove the key")
        spec = _lm_eval_spec(r, m["lm_eval"], f"{path}.lm_eval", self.base_dir)
        where = f"{r.source}: {path}.lm_eval"
        tasks, groups = harness.render(spec, where, self.tokenizer()
                                       if spec.apply_chat_template else None)
        batch_size, bootstrap = _own_settings(r, m, path, batch_size, bootstrap)
        common = dict(
            batch_size=batch_size, bootstrap=bootstrap,
            samples=r.boolean(m, "samples", default=samples, path=f"{path}.samples"),
            lm_eval=spec, key_path=path)
        name = m["name"]
        if not groups:                                     # one task: the evaluation NAME
            return [self._one(tasks[0], name, path, common)]
        # A group: its tasks as NAME/TASK, its aggregate as NAME, a subgroup's as NAME/SUB.
        evals = [self._one(t, f"{name}/{t.task}", path, common) for t in tasks]
        by_task = {t.task: t for t in tasks}
        for i, group in enumerate(groups):
            metrics = tuple(GroupMetric(key, tuple((f"{name}/{t}", k) for t, k in parts),
                                        weight, higher)
                            for key, parts, weight, higher in
                            harness.group_metrics(group, by_task))
            if metrics:
                self.groups.append(GroupSpec(
                    name=name if i == 0 else f"{name}/{group.name}",
                    members=tuple(f"{name}/{t}" for t in group.leaves if t in by_task),
                    metrics=metrics, key_path=path))
        return evals

    def _one(self, task, name: str, path: str, common: dict) -> EvalSpec:
        from rayeval.plan import harness

        self.pending.append(task)
        data = f"{harness.location(self.output, task.digest)}/{harness.DOCS_FILE}"
        # The request table's columns, read as they are (the task tokenizes them).
        dataset = DatasetSpec(path=data, inputs=("context", "target", "choices", "instances"),
                              id="doc_id", key_path=f"{path}.lm_eval")
        metrics = tuple(MetricSpec(name=kind, task="lm_eval", key=key,
                                   params=(("column", column), ("higher", higher)))
                        for key, kind, column, higher in task.metrics)
        return EvalSpec(
            name=name, task="lm_eval", dataset=dataset, metrics=metrics,
            generation=Generation(until=task.until, max_new_tokens=max(1, task.max_gen_toks),
                                  temperature=task.sampling[0], top_p=task.sampling[1],
                                  repeats=task.sampling[2]),
            **common)

    def write(self) -> None:
        from rayeval.plan import harness

        for task in self.pending:
            harness.write(self.output, task)


def _lm_eval_spec(r: "_Reader", raw: Any, path: str, base_dir: str) -> LmEvalSpec:
    m = r.mapping(raw, path, LM_EVAL_KEYS)
    include = r.string(m, "include_path", path=f"{path}.include_path")
    fewshot = r.get(m, "num_fewshot", path=f"{path}.num_fewshot")
    if fewshot is not None:
        fewshot = r.integer(m, "num_fewshot", default=0, minimum=0, path=f"{path}.num_fewshot")
    gen_kwargs = r.get(m, "gen_kwargs", path=f"{path}.gen_kwargs", default={})
    if not isinstance(gen_kwargs, dict) or not all(isinstance(k, str) for k in gen_kwargs):
        r.fail(f"{path}.gen_kwargs", f"expected a mapping (until, max_gen_toks), got "
                                     f"{_show(gen_kwargs)}")
    limit = r.get(m, "limit", path=f"{path}.limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                              or not limit > 0):
        r.fail(f"{path}.limit", f"expected a positive number of documents (or a share below "
                                f"1), got {_show(limit)}")
    return LmEvalSpec(
        task=r.string(m, "task", path=f"{path}.task", required=True),
        include_path=paths.resolve(include, base_dir) if include else None,
        num_fewshot=fewshot,
        apply_chat_template=r.boolean(m, "apply_chat_template", default=False,
                                      path=f"{path}.apply_chat_template"),
        fewshot_as_multiturn=r.boolean(m, "fewshot_as_multiturn", default=False,
                                       path=f"{path}.fewshot_as_multiturn"),
        system_instruction=r.string(m, "system_instruction", path=f"{path}.system_instruction"),
        gen_kwargs=dict(gen_kwargs), limit=limit,
        fewshot_seed=r.integer(m, "fewshot_seed", default=LmEvalSpec.fewshot_seed, minimum=None,
                               path=f"{path}.fewshot_seed"))


def _evaluation(r: "_Reader", m: dict, path: str, base_dir: str, batch_size: int,
                bootstrap: Bootstrap, samples: bool,
                dataset_extra: frozenset | set = frozenset()) -> EvalSpec:
    """One evaluation; ``path`` is its key path ("" for the top-level single form)."""
    at = (lambda key: f"{path}.{key}" if path else key)
    task = r.string(m, "task", path=at("task"), required=True)
    if task == "lm_eval":
        r.fail(at("task"), "an lm-evaluation-harness task is given as lm_eval: {task: NAME} "
                           "(without task, dataset and metrics)")
    if task not in TASKS:
        r.fail(at("task"), f"unknown task {task!r}; choose one of: {', '.join(TASKS)}")
    dataset = _dataset(r, r.get(m, "dataset", path=at("dataset"), required=True), at("dataset"),
                       task, base_dir, dataset_extra)
    metrics_raw = r.get(m, "metrics", path=at("metrics"), required=True)
    if not isinstance(metrics_raw, list) or not metrics_raw:
        r.fail(at("metrics"), f"expected a non-empty list of metric names, got "
                              f"{_show(metrics_raw)}")
    metrics = []
    seen: dict[str, int] = {}
    for i, item in enumerate(metrics_raw):
        try:
            spec = parse_metric(item, task, base_dir)
        except SpecError as e:
            r.fail(at(f"metrics[{i}]"), e.message)
        if spec.key in seen:
            r.fail(at(f"metrics[{i}]"), f"{spec.key!r} is listed twice (also "
                                        f"{at(f'metrics[{seen[spec.key]}]')}); remove one")
        seen[spec.key] = i
        metrics.append(spec)
    batch_size, bootstrap = _own_settings(r, m, path, batch_size, bootstrap)
    return EvalSpec(
        name=m["name"], task=task, dataset=dataset, metrics=tuple(metrics),
        batch_size=batch_size, bootstrap=bootstrap,
        generation=_generation(r, m, at("generation"), task),
        samples=_samples(r, m, path, task, samples), key_path=path or "(top level)")


def _own_settings(r: "_Reader", m: dict, path: str, batch_size: int, bootstrap: Bootstrap
                  ) -> tuple[int, Bootstrap]:
    """An entry's own ``batch_size`` and ``bootstrap`` over the sweep's (the top-level single
    form, ``path`` "", has the sweep's)."""
    if not path:
        return batch_size, bootstrap
    if m.get("bootstrap") is not None:
        bootstrap = _bootstrap(r, m["bootstrap"], f"{path}.bootstrap", bootstrap)
    return r.integer(m, "batch_size", default=batch_size, minimum=1,
                     path=f"{path}.batch_size"), bootstrap


def _samples(r: "_Reader", m: dict, path: str, task: str, default: bool) -> bool:
    """Whether an evaluation keeps per-item records: text tasks do unless turned off (here or
    by the sweep's top-level ``samples``); other tasks keep none."""
    keeps = TASKS[task].uses_text
    if not path or m.get("samples") is None:
        return default and keeps
    given = r.boolean(m, "samples", default=default, path=f"{path}.samples")
    if given and not keeps:
        r.fail(f"{path}.samples", f"task {task} keeps no per-item records (the text tasks "
                                  "do); remove the key")
    return given


def _generation(r: "_Reader", m: dict, path: str, task: str) -> Generation:
    raw = r.get(m, "generation", path=path)
    if raw is None:
        return Generation()
    if not TASKS[task].generates:
        r.fail(path, f"only a generation task decodes; task {task} takes no generation: key")
    g = r.mapping(raw, path, GENERATION_KEYS)
    until = r.get(g, "until", path=f"{path}.until", default=[])
    if isinstance(until, str):
        until = [until]
    if not isinstance(until, list) or not all(isinstance(u, str) and u for u in until):
        r.fail(f"{path}.until", f"expected a list of non-empty stop strings, got {_show(until)}")
    temperature = r.number(g, "temperature", default=Generation.temperature, minimum=0.0,
                           path=f"{path}.temperature")
    top_p = r.number(g, "top_p", default=Generation.top_p, minimum=0.0,
                     path=f"{path}.top_p")
    if not 0 < top_p <= 1:
        r.fail(f"{path}.top_p", f"must be in (0, 1], got {top_p}")
    repeats = r.integer(g, "repeats", default=Generation.repeats, minimum=1,
                        path=f"{path}.repeats")
    if repeats > 1 and temperature == 0:
        r.fail(f"{path}.repeats", f"{repeats} greedy generations are {repeats} copies of one; "
                                  "set generation.temperature above 0 to sample them")
    return Generation(until=tuple(until),
                      max_new_tokens=r.integer(g, "max_new_tokens",
                                               default=Generation.max_new_tokens, minimum=1,
                                               path=f"{path}.max_new_tokens"),
                      temperature=temperature, top_p=top_p, repeats=repeats,
                      seed=r.integer(g, "seed", default=Generation.seed, minimum=0,
                                     path=f"{path}.seed"))


def _dataset(r: "_Reader", raw: Any, path: str, task: str, base_dir: str,
             extra: frozenset | set) -> DatasetSpec:
    m = r.mapping(raw, path, DATASET_KEYS | set(extra))
    location = paths.resolve(r.string(m, "path", path=f"{path}.path", required=True), base_dir)
    transform = r.string(m, "transform", path=f"{path}.transform")
    if transform is not None:
        module, _, attr = transform.partition(":")
        if not module or not attr:
            r.fail(f"{path}.transform", f"expected 'module:callable', got {transform!r}")
    inputs_raw = r.get(m, "inputs", path=f"{path}.inputs",
                       required=transform is None and TASKS[task].needs_inputs)
    if isinstance(inputs_raw, str):
        inputs_raw = [inputs_raw]
    inputs: tuple[str, ...] = ()
    if inputs_raw is not None:
        if not isinstance(inputs_raw, list) or not inputs_raw or not all(
                isinstance(c, str) and c.strip() for c in inputs_raw):
            r.fail(f"{path}.inputs", f"expected a column name or a list of column names, got "
                                     f"{_show(inputs_raw)}")
        if len(set(inputs_raw)) != len(inputs_raw):
            r.fail(f"{path}.inputs", f"a column is listed twice in {inputs_raw}")
        inputs = tuple(inputs_raw)
    spec = DatasetSpec(
        path=location, inputs=inputs,
        target=r.string(m, "target", path=f"{path}.target", required=TASKS[task].needs_target),
        id=r.string(m, "id", path=f"{path}.id"), transform=transform,
        ignore_index=r.integer(m, "ignore_index", default=DatasetSpec.ignore_index, minimum=None,
                               path=f"{path}.ignore_index"),
        pad_id=r.integer(m, "pad_id", default=DatasetSpec.pad_id, minimum=0,
                         path=f"{path}.pad_id"),
        prompt=r.string(m, "prompt", path=f"{path}.prompt"),
        choices=r.string(m, "choices", path=f"{path}.choices"),
        text=r.string(m, "text", path=f"{path}.text"),
        delimiter=_delimiter(r, m, f"{path}.delimiter"),
        format=_format(r, m, f"{path}.format"),
        cpus=_cpus(r, m, f"{path}.cpus"),
        concurrency=_optional_integer(r, m, "concurrency", f"{path}.concurrency", minimum=1),
        key_path=path)
    problem = TASKS[task].spec_problem(spec)
    if problem:
        r.fail(f"{path}.{problem[0]}", problem[1])
    return spec


def _format(r: "_Reader", m: dict, path: str) -> str | None:
    value = r.string(m, "format", path=path)
    if value is not None and value not in DATA_FORMATS:
        r.fail(path, f"unknown format {value!r}; choose one of: {', '.join(DATA_FORMATS)} "
                     "(or leave it out: the path's suffix says)")
    return value


def _cpus(r: "_Reader", m: dict, path: str) -> float | None:
    value = r.get(m, "cpus", path=path)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        r.fail(path, f"expected a positive number of CPUs (e.g. 1 or 0.5), got {_show(value)}")
    return float(value)


def _optional_integer(r: "_Reader", m: dict, key: str, path: str, minimum: int) -> int | None:
    if r.get(m, key, path=path) is None:
        return None
    return r.integer(m, key, default=None, minimum=minimum, path=path)


def _delimiter(r: "_Reader", m: dict, path: str) -> str:
    value = r.get(m, "delimiter", path=path, default=DatasetSpec.delimiter)
    if not isinstance(value, str):
        r.fail(path, f"expected a string (\" \" by default, \"\" for none), got {_show(value)}")
    return value


def _model(r: "_Reader", top: dict, base_dir: str) -> ModelSpec:
    """Without ``model:`` (or without ``model.factory``) the checkpoints are Hugging Face
    folders."""
    m = r.mapping(r.get(top, "model", default={}), "model", MODEL_KEYS)
    dtype = r.string(m, "dtype", path="model.dtype")
    if dtype is not None and dtype not in DTYPE_NAMES:
        r.fail("model.dtype", f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPE_NAMES)}")
    factory = r.string(m, "factory", path="model.factory")
    if factory is not None:
        module, _, attr = factory.partition(":")
        if not module or not attr:
            r.fail("model.factory", f"expected 'module:callable', got {factory!r}")
    kwargs = r.get(m, "kwargs", default={})
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        r.fail("model.kwargs", f"expected a mapping of keyword arguments, got {_show(kwargs)}")
    if factory is None and kwargs:
        r.fail("model.kwargs", "kwargs are for model.factory; a Hugging Face folder's model "
                               "comes from its config.json (or set model.factory)")
    tokenizer = r.string(m, "tokenizer", path="model.tokenizer")
    max_length = r.get(m, "max_length", path="model.max_length")
    if max_length is not None:
        max_length = r.integer(m, "max_length", default=0, minimum=2, path="model.max_length")
    backend = r.string(m, "backend", path="model.backend") or ModelSpec.backend
    if backend not in BACKENDS:
        r.fail("model.backend", f"unknown backend {backend!r}; choose one of: "
                                f"{', '.join(BACKENDS)}")
    engine = r.get(m, "vllm", default={})
    if not isinstance(engine, dict) or not all(isinstance(k, str) for k in engine):
        r.fail("model.vllm", f"expected a mapping of vLLM engine arguments, got {_show(engine)}")
    if engine and backend != "vllm":
        r.fail("model.vllm", "engine arguments are for model.backend: vllm; set it, or "
                             "remove model.vllm")
    if backend == "vllm" and factory is not None:
        r.fail("model.backend", "vllm serves Hugging Face checkpoint folders (config.json); "
                                "remove model.factory, or use backend: hf")
    return ModelSpec(factory=factory, kwargs=dict(kwargs), dtype=dtype,
                     tokenizer=paths.resolve(tokenizer, base_dir) if tokenizer else None,
                     max_length=max_length, backend=backend, vllm=dict(engine))


def _checkpoints(r: "_Reader", top: dict, base_dir: str) -> tuple[str, ...]:
    raw = r.get(top, "checkpoints", required=True)
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        r.fail("checkpoints", f"expected a non-empty list of paths or globs, got {_show(raw)}")
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, str) or not item.strip():
            r.fail(f"checkpoints[{i}]", f"expected a path or glob, got {_show(item)}")
        out.append(paths.resolve(item, base_dir))
    return tuple(out)


def _checkpoint(r: "_Reader", top: dict) -> CheckpointSpec:
    m = r.mapping(r.get(top, "checkpoint", default={}), "checkpoint", CHECKPOINT_KEYS)
    return CheckpointSpec(
        key=r.string(m, "key", path="checkpoint.key"),
        strip_prefix=r.string(m, "strip_prefix", path="checkpoint.strip_prefix"),
        trust_pickle=r.boolean(m, "trust_pickle", default=CheckpointSpec.trust_pickle,
                               path="checkpoint.trust_pickle"),
    )


def _resources(r: "_Reader", top: dict, use_gpu: bool) -> tuple[tuple[str, float], ...]:
    raw = r.get(top, "resources_per_worker", default={})
    if not isinstance(raw, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
            and v >= 0 for k, v in raw.items()):
        r.fail("resources_per_worker", f"expected a mapping of resource names to amounts "
                                       f"(e.g. {{CPU: 4, GPU: 1}}), got {_show(raw)}")
    if use_gpu and raw.get("GPU", 1) == 0:
        r.fail("resources_per_worker", "GPU: 0 with use_gpu: true; give each worker a GPU")
    return tuple(sorted((k, float(v)) for k, v in raw.items()))


def watch_spec(raw: Any, *, source: str = "<sweep>", base: WatchSpec = WatchSpec(),
               prefix: str = "watch.") -> WatchSpec:
    """The ``watch:`` mapping (or the CLI's ``--ready``/``--order`` over ``base``, with
    ``prefix="--"``): keys left out come from ``base``."""
    r = _Reader(source)
    m = r.mapping(raw, prefix.rstrip("."), WATCH_KEYS) if prefix == "watch." else raw
    ready = m.get("ready", base.ready)
    if ready is not None and (not isinstance(ready, str) or not ready.strip() or "/" in ready
                              or ready.count("*") > 1):
        r.fail(f"{prefix}ready", f"expected a file name (COMPLETE: inside a checkpoint folder) "
                                 f"or a pattern with one * for the checkpoint's name (*.done: "
                                 f"beside it), got {_show(ready)}")
    order = m.get("order", base.order) or base.order
    if order not in WATCH_ORDERS:
        r.fail(f"{prefix}order", f"expected one of {', '.join(WATCH_ORDERS)}, got {_show(order)}")
    return WatchSpec(ready=ready, order=order)


def trackers_spec(raw: Any, *, source: str = "<sweep>", base: Trackers = Trackers(),
                  prefix: str = "trackers", removable: bool = False) -> Trackers:
    """The ``trackers:`` mapping (or ``rayeval.run``'s ``trackers=``): each tracker named
    replaces ``base``'s; trackers left out come from ``base``. With ``removable`` (the API),
    ``None`` removes a tracker; in a sweep file, ``mlflow: {}`` is MLflow with its defaults
    and an empty ``mlflow:`` is an error, not a tracker silently left out."""
    r = _Reader(source)
    m = r.mapping(raw, prefix, TRACKERS_KEYS)
    mlflow, wandb = base.mlflow, base.wandb
    if "mlflow" in m:
        mlflow = None if removable and m["mlflow"] is None else \
            _mlflow(r, m["mlflow"], f"{prefix}.mlflow")
    if "wandb" in m:
        wandb = None if removable and m["wandb"] is None else \
            _wandb(r, m["wandb"], f"{prefix}.wandb")
    return Trackers(mlflow=mlflow, wandb=wandb)


def _run_id(r: "_Reader", m: dict, path: str) -> None:
    value = m.get("run_id")
    if value is not None and not isinstance(value, str):
        r.fail(f"{path}.run_id", f"expected a run id string, got {_show(value)}; quote it "
                                 "(run_id: \"...\"): YAML reads some ids as numbers")


def _mlflow(r: "_Reader", raw: Any, path: str) -> MlflowTracker:
    m = r.mapping(raw, path, MLFLOW_KEYS)
    _run_id(r, m, path)
    return MlflowTracker(**{k: r.string(m, k, path=f"{path}.{k}") for k in sorted(MLFLOW_KEYS)},
                         key_path=path)


def _wandb(r: "_Reader", raw: Any, path: str) -> WandbTracker:
    m = r.mapping(raw, path, WANDB_KEYS)
    _run_id(r, m, path)
    mode = r.string(m, "mode", path=f"{path}.mode")
    if mode is not None and mode not in WANDB_MODES:
        r.fail(f"{path}.mode", f"expected one of {', '.join(WANDB_MODES)}, got {_show(mode)}")
    return WandbTracker(project=r.string(m, "project", path=f"{path}.project", required=True),
                        entity=r.string(m, "entity", path=f"{path}.entity"),
                        run_id=r.string(m, "run_id", path=f"{path}.run_id"), mode=mode,
                        key_path=path)


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


def _parallelism(r: "_Reader", top: dict) -> Parallelism:
    m = r.mapping(r.get(top, "parallelism", default={}), "parallelism", PARALLELISM_KEYS)
    shard = r.integer(m, "shard", default=Parallelism.shard, minimum=1,
                      path="parallelism.shard")
    wrap = m.get("wrap", [])
    if isinstance(wrap, str):
        wrap = [wrap]
    if not isinstance(wrap, list) or not all(isinstance(w, str) and w for w in wrap):
        r.fail("parallelism.wrap", f"expected module class names (e.g. [DecoderLayer]), got "
                                   f"{_show(wrap)}")
    workers = top.get("workers", 1)
    if isinstance(workers, int) and workers % shard:
        r.fail("parallelism.shard", f"{shard} does not divide workers: {workers}; make "
                                    "workers a multiple of parallelism.shard (each replica "
                                    "of the model takes shard workers)")
    tensor = r.integer(m, "tensor", default=Parallelism.tensor, minimum=1,
                       path="parallelism.tensor")
    if tensor > 1 and shard > 1:
        r.fail("parallelism.tensor", "a vLLM engine shards its own weights; give "
                                     "parallelism.tensor or parallelism.shard, not both")
    if isinstance(workers, int) and workers % tensor:
        r.fail("parallelism.tensor", f"{tensor} does not divide workers: {workers}; make "
                                     "workers a multiple of parallelism.tensor (each engine "
                                     "takes tensor workers)")
    return Parallelism(shard=shard, wrap=tuple(wrap), tensor=tensor)


def _recovery(r: "_Reader", top: dict) -> Recovery:
    m = r.mapping(r.get(top, "recovery", default={}), "recovery", RECOVERY_KEYS)
    return Recovery(
        max_restarts=r.integer(m, "max_restarts", default=Recovery.max_restarts,
                               minimum=0, path="recovery.max_restarts"),
        stall_timeout_s=r.integer(m, "stall_timeout_s", default=Recovery.stall_timeout_s,
                                  minimum=1, path="recovery.stall_timeout_s"),
    )


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


def _bootstrap(r: "_Reader", raw, path: str, base: Bootstrap) -> Bootstrap:
    """A ``bootstrap:`` mapping; keys it leaves out come from ``base`` (the sweep's)."""
    m = r.mapping(raw, path, BOOTSTRAP_KEYS)
    confidence = r.get(m, "confidence", path=f"{path}.confidence", default=base.confidence)
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) \
            or not 0 < confidence < 1:
        r.fail(f"{path}.confidence", f"expected a number between 0 and 1, got "
                                     f"{_show(confidence)}")
    return Bootstrap(
        replicates=r.integer(m, "replicates", default=base.replicates, minimum=0,
                             path=f"{path}.replicates"),
        confidence=float(confidence),
        seed=r.integer(m, "seed", default=base.seed, minimum=0, path=f"{path}.seed"),
        buckets=r.integer(m, "buckets", default=base.buckets, minimum=1,
                          path=f"{path}.buckets"),
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

    def number(self, m: dict, key: str, *, default: float, minimum: float | None,
               path: str | None = None) -> float:
        path = path or key
        value = self.get(m, key, path=path, default=default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(path, f"expected a number, got {_show(value)}")
        if minimum is not None and value < minimum:
            self.fail(path, f"must be at least {minimum}, got {value}")
        return float(value)

    def boolean(self, m: dict, key: str, *, default: bool, path: str | None = None) -> bool:
        value = self.get(m, key, path=path, default=default)
        if not isinstance(value, bool):
            self.fail(path or key, f"expected true or false, got {_show(value)}")
        return value


def _closest(word: str, options: set[str]) -> str | None:
    import difflib

    found = difflib.get_close_matches(word, sorted(options), n=1, cutoff=0.7)
    return found[0] if found else None

