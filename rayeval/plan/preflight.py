"""Pre-flight: everything a run checks and plans before Ray starts, with no Ray.

Every evaluation's data set is inspected and counted, the model is probed on a few of its real
rows (on the meta device), lm-eval and lmms-eval tasks are rendered into request tables and
checked against the store's, the result store is probe-written, the cells are built with their
content keys, the ones the store holds are set aside (cached), and local checkpoints that do
not fit the model (keys and shapes read from their headers) fail here. Bad input so fails in
seconds, before any cluster starts.

    prepare(sweep, force=...)            -> Plan      what ``rayeval run`` plans
    check_inputs(sweep)                  -> (evaluations, store)   once, for ``watch``
    plan_cells(sweep, evaluations, store, ready=..., skip=..., strict=False)   each poll

``execution.driver`` runs the plan (``RunSequence``); ``integrations`` call these directly.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

from rayeval.io import paths, vision, vllm_preflight
from rayeval.core import tasks
from rayeval.config import constants, entries
from rayeval.config.plugins import load_plugins
from rayeval.config.schema import EvalSpec, Sweep
from rayeval.io.data import inspect_dataset, probe_dataset
from rayeval.io.checkpoints import expand_checkpoints
from rayeval.errors import DataError, RayevalError, SpecError
from rayeval.core.evaluate import Decoder, output_size
from rayeval.io.loading import fit_error
from rayeval.io.model import ModelSource
from rayeval.io.units import units
from rayeval.plan.cells import CellOutcome, Evaluation, Plan, make_plan
from rayeval.io.store import ResultStore

__all__ = ["prepare", "check_inputs", "plan_cells", "inspect_evaluations"]


def inspect_data(sweep: Sweep) -> tuple[Evaluation, ...]:
    """Every evaluation's data set checked and counted, without the model: what the cells'
    keys read (a fully cached run needs no more). ``output_size`` 0 and no tokenizer until
    ``inspect_evaluations``."""
    return tuple(Evaluation(spec=spec, data=inspect_dataset(spec.dataset, tasks.get(spec.task)),
                            output_size=0) for spec in sweep.evals)


def inspect_evaluations(sweep: Sweep, data: tuple[Evaluation, ...] | None = None
                        ) -> tuple[Evaluation, ...]:
    """Every evaluation's data set checked and counted (``data``: ``inspect_data``'s, when
    done already), and the model probed on a few of its real rows: on the meta device (no
    memory), else once on the CPU. Bad columns, inputs the model cannot take, outputs that do
    not fit the task, labels outside the model's classes and a missing tokenizer all fail
    here, in seconds, before any cluster starts."""
    infos = {e.name: e.data for e in data or ()}
    source = ModelSource(sweep.model, sweep.base_dir)
    text = any(tasks.get(e.task).uses_text for e in sweep.evals)
    first = _first_folder(sweep) if sweep.model.hugging_face else None
    meta = source.meta(first)              # imports and calls the factory, or reads config.json
    if sweep.parallelism.sharded:
        units(meta, sweep.parallelism.wrap)    # parallelism.wrap must name classes it has
    tokenizer = source.tokenizer(first, meta) if text else None
    out = []
    for spec in sweep.evals:
        task = tasks.get(spec.task)
        if spec.dataset.images is not None:
            vision.check_image_model(tokenizer, meta, first, spec.dataset.key_path)
        info = infos.get(spec.name) or inspect_dataset(spec.dataset, task)
        size = _probe_output_size(sweep, spec, info, source, meta, tokenizer)
        task.check_values(probe_dataset(info, spec.dataset.key_path), spec.dataset, size)
        if spec.judge is not None and spec.judge.staged:
            _check_judge(sweep, spec, info)
        out.append(Evaluation(spec=spec, data=info, output_size=size,
                              tokenizer=tokenizer if task.uses_text else None))
    return tuple(out)


def _check_judge(sweep: Sweep, spec: EvalSpec, info) -> None:
    """A judged evaluation's judge, before any worker: its template names only columns the
    data set has and renders on the first item; its model is a Hugging Face folder whose
    config and tokenizer load (and whose chat template takes the first prompt)."""
    from rayeval.core import judge as judging
    from rayeval.io import hf

    js = spec.judge
    where = f"{sweep.source}: {js.key_path}"
    columns = list(info.schema.names) if info.schema is not None else []
    try:
        prompts = judging.Prompts(js.prompt, f"{where}.prompt")
        prompts.check(columns, pairwise=js.baseline is not None)
    except SpecError as e:
        raise SpecError(e.message) from None
    head = probe_dataset(info, spec.dataset.key_path).head(1)
    first = head.to_pylist()[0] if head.num_rows else {}
    target = first.get(spec.dataset.target) if spec.dataset.target else None
    try:
        text = prompts.render({**first, "response": "", "target": target, "response_a": "",
                               "response_b": ""})
    except Exception as e:             # noqa: BLE001 - the user's template
        raise SpecError(f"{where}.prompt: does not render on the first item: "
                        f"{type(e).__name__}: {e}") from None
    hf.require()
    try:
        folder = hf.small_files(js.model, os.path.join(tempfile.gettempdir(), "rayeval-judges"))
    except RayevalError as e:
        raise SpecError(f"{where}.model: {e.message}") from None
    if not hf.is_folder(folder):
        raise SpecError(f"{where}.model: {js.model} is not a Hugging Face folder (no "
                        "config.json); give the folder of a causal language model saved with "
                        "save_pretrained")
    try:
        hf.Builder().config(folder)
    except RayevalError as e:
        raise SpecError(f"{where}.model: {e.message}") from None
    try:
        tok = hf.load_tokenizer(folder, what="model.tokenizer")
        judging.chat_tokens(tok, text)
    except RayevalError as e:
        raise SpecError(f"{where}.model: the judge's tokenizer: "
                        f"{e.message.split(': ', 1)[-1]}") from None
    except Exception as e:             # noqa: BLE001 - a chat template that fails
        raise SpecError(f"{where}.model: the judge's chat template fails on the first "
                        f"prompt: {type(e).__name__}: {e}") from None


def _first_folder(sweep: Sweep) -> str:
    """A local folder with the first checkpoint's config (and tokenizer): without a factory,
    the model is built from it."""
    from rayeval.io import hf

    hf.require()
    refs = expand_checkpoints(sweep.checkpoints)
    location = refs[0].location
    if not hf.is_folder(location):
        raise SpecError(f"checkpoints: {location} is not a Hugging Face folder (no config.json)"
                        "; set model.factory to evaluate other checkpoints")
    return hf.small_files(location, os.path.join(tempfile.gettempdir(), "rayeval-checkpoints"))


def _probe_output_size(sweep: Sweep, spec: EvalSpec, info, source: ModelSource, meta,
                       tokenizer) -> int:
    decoder = Decoder(spec, info, sweep.base_dir)
    decoder.use(tokenizer)
    head = probe_dataset(info, spec.dataset.key_path).head(4, columns=spec.dataset.columns)
    x, _, _ = decoder(head)
    task = tasks.get(spec.task)
    try:
        size = output_size(meta, task, x, "meta")
    except RayevalError:
        real = source.real()          # some models cannot run on the meta device
        if real is not None:
            size = output_size(real, task, x, "cpu")
        else:                         # a Hugging Face model: its output layer says
            size = int(meta.get_output_embeddings().weight.shape[0])
    if tokenizer is not None:
        top = max(task.probe_input(x).reshape(-1).tolist())
        if top >= size:
            raise DataError(f"{spec.key_path}: the tokenizer gives token id {top}, outside the "
                            f"model's vocabulary of {size}; the tokenizer does not match the "
                            "model (see model.tokenizer)")
    return size


def check_inputs(sweep: Sweep, force: bool = False) -> tuple[tuple[Evaluation, ...],
                                                             ResultStore]:
    """The evaluations, inspected and probed, and the store, probe-written: what `run` and
    `watch` check before any cluster starts. A request table of lm-eval the store holds must
    be the one rendered here (``force``: written again), before anything reads it."""
    evaluations = inspect_evaluations(sweep, _check_data(sweep, force))
    return evaluations, _writable(sweep)


def _check_data(sweep: Sweep, force: bool) -> tuple[Evaluation, ...]:
    """``check_inputs`` but the model's probe and the store's: the engine's family (read from
    the first checkpoint's config) and the evaluations' data (``inspect_data``)."""
    load_plugins()                # a sweep built in Python may name a plugin's task or metric
    entries.prepare(sweep.evals, force)   # what rendered entries read: in the store, as
                                          # rendered here (lm-eval's request tables)
    if sweep.model.backend == "vllm" and sweep.model.hugging_face:
        why = vllm_preflight.serves_folder(_first_folder(sweep))   # the engine starts from its config
        if why:
            raise SpecError(f"{sweep.source}: model.backend: {why}")
    data = inspect_data(sweep)
    if any(e.data.via_ray_data(e.spec.dataset) for e in data):
        try:
            constants.data_concurrency()        # read by the pipelines, once Ray is up
        except ValueError as error:
            raise SpecError(str(error)) from None
    if sweep.parallelism.tensor > 1:
        for e in data:
            if e.data.via_ray_data(e.spec.dataset):
                raise SpecError(
                    f"{sweep.source}: parallelism.tensor: an engine's {sweep.parallelism.tensor}"
                    f" workers must see the same rows, which {e.spec.dataset.key_path} on Ray "
                    "Data cannot give: use local parquet read directly (no dataset.cpus), or "
                    "parallelism.tensor: 1")
    return data


def _writable(sweep: Sweep) -> ResultStore:
    """The sweep's store, probe-written: the last check, so that bad input writes nothing."""
    store = ResultStore(sweep.output)
    store.check(write=True)
    return store


def prepare(sweep: Sweep, force: bool = False, ready=None) -> Plan:
    """Everything that can fail on bad input, before any cluster starts, and the plan.
    ``ready``: (CheckpointRef, fingerprint) pairs to plan instead of the sweep's globs.

    The cells' keys read the data and the checkpoints' bytes, not the model: a run whose
    every cell the store holds is planned from the data alone (issue 58: probing the model,
    torch's meta device and transformers' imports, was most of a fully cached run's 3.5 s),
    and its model is not checked, since nothing would run it."""
    data = _check_data(sweep, force)
    planned = make_plan(sweep, data, ResultStore(sweep.output), force=force, ready=ready)
    if not planned.cells:
        return planned
    evaluations = inspect_evaluations(sweep, data)
    _writable(sweep)
    # the same cells: their keys are the data's and the checkpoints', not the model's
    return plan_cells(sweep, evaluations, planned=planned)


def plan_cells(sweep: Sweep, evaluations, store: ResultStore | None = None, *,
               force: bool = False, ready=None, skip: set[str] = frozenset(),
               strict: bool = True, planned: Plan | None = None) -> Plan:
    """The plan, with the cells of local checkpoints that do not fit the model (keys and
    shapes read from their headers, against the model on the meta device) failed here, before
    any worker would load them. ``strict``: ``select.top`` at or above the checkpoints is an
    error (`run`); else (a `watch` poll) they are evaluated whole. ``planned``: the cells
    planned already (from the data alone), given the probed ``evaluations``."""
    plan = make_plan(sweep, evaluations, store, force=force, ready=ready, skip=skip) \
        if planned is None else dataclasses.replace(planned, evaluations=tuple(evaluations))
    if not plan.cells:
        return plan
    source = ModelSource(sweep.model, sweep.base_dir)
    text = any(tasks.get(e.spec.task).uses_text for e in evaluations)
    failed, pending = [], []
    for ref, _, cells in plan.by_checkpoint():
        why = None if paths.is_uri(ref.location) else _local_problem(
            ref.location, source, sweep, text)
        if why is None:
            pending += cells
        else:
            failed += [CellOutcome(key=c.key, checkpoint=ref.location, evaluation=c.evaluation,
                                   step=ref.step, error=why) for c in cells]
    return _raced(dataclasses.replace(plan, cells=tuple(pending), failed=tuple(failed)),
                  strict)


def _raced(plan: Plan, strict: bool = True) -> Plan:
    """A race needs more checkpoints than it keeps: ``select.top`` at or above the sweep's
    checkpoints fails here; a plan whose pending checkpoints are no more than ``top`` (the
    others cached) has nothing to race and evaluates them whole."""
    select = plan.sweep.select
    if select is None:
        return plan
    every = {c.checkpoint.location for c in plan.cells + plan.cached} | \
        {o.checkpoint for o in plan.failed}
    if select.top >= len(every) and strict:
        raise SpecError(f"{plan.sweep.source}: select.top: {select.top} keeps every one of the "
                        f"{len(every)} checkpoints; race more checkpoints or lower top")
    if len(plan.by_checkpoint()) <= select.top:
        return dataclasses.replace(plan, sweep=plan.sweep.replace(select=None))
    return plan


def _local_problem(location: str, source: ModelSource, sweep: Sweep, text: bool) -> str | None:
    """Why a local checkpoint cannot be evaluated, from its headers and small files."""
    from rayeval.io import hf

    try:
        meta = source.meta(location)
    except RayevalError as e:
        return e.message if e.message.startswith(location) else f"{location}: {e.message}"
    if text and sweep.model.tokenizer is None and not hf.has_tokenizer(location):
        return (f"{location}: no tokenizer files beside the model; save the tokenizer with the "
                "checkpoint or set model.tokenizer")
    return fit_error(location, meta, sweep.checkpoint)
