"""From a sweep to the cells a run must evaluate: checkpoints x evaluations, each with a content
key, minus those the result store already holds; and what a cell's evaluation came to.

Plain Python (no Ray): the driver builds a Plan, the workers receive it pickled and return a
CellOutcome per cell.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from rayeval.io import paths
from rayeval.core import tasks
from rayeval.io.checkpoints import CheckpointRef, expand_checkpoints, parse_epoch
from rayeval.config.schema import OFF, EvalSpec, Sweep, numbers_of
from rayeval.io.data import DatasetInfo
from rayeval.core.metrics import VERSION as METRICS_VERSION
from rayeval.io.model import source_digest
from rayeval.plan.outcome import CellOutcome  # noqa: F401 - re-exported: the driver's and workers' name
from rayeval.io.store import ResultStore

PARTIAL = "-partial"      # a race's partial cell's store key: the complete cell's key and this


@dataclass(frozen=True)
class Evaluation:
    """An evaluation of the suite with what the driver learned of it before any worker."""
    spec: EvalSpec
    data: DatasetInfo
    output_size: int             # classes, vocabulary or 1: probed on the driver
    # Text tasks: the tokenizer the driver probed with (the first checkpoint's, or
    # model.tokenizer). A Ray Data stage tokenizes with it; a worker whose checkpoint has
    # another tokenizer tokenizes again itself.
    tokenizer: Any = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def row_positions(self) -> bool:
        """Whether its readers add each row's position (``Task.row_positions``)."""
        return tasks.get(self.spec.task).row_positions(self.spec)


@dataclass(frozen=True)
class Cell:
    checkpoint: CheckpointRef
    evaluation: str              # its name
    key: str                     # content key: the store's file name for this cell
    fingerprint: str = ""        # the checkpoint's: a changed file is a new cell
    # A partial cell a race left, or a cell in progress saved (io.store.states): its rows of
    # the buckets below this one are saved (``saved_rows`` rows), so the pass scores the rest.
    # 0: every row.
    resume: int = field(default=0, compare=False)
    saved_rows: int = field(default=0, compare=False)
    # A judged evaluation's cell (docs/judges.md): the key its generations are kept under
    # (``generation_key``), and whether the store holds them already (then only the judge
    # runs: the checkpoint is not loaded).
    generation: str = ""
    generated: bool = field(default=False, compare=False)
    # Pairwise (``judge.baseline``): the key of the baseline checkpoint's generations.
    baseline: str = ""

    def generating(self) -> "Cell":
        """The cell its generation stage scores: under the generations' key."""
        return dataclasses.replace(self, key=self.generation) if self.generation else self


@dataclass(frozen=True)
class Plan:
    sweep: Sweep
    evaluations: tuple[Evaluation, ...]
    cells: tuple[Cell, ...]      # pending: to evaluate in this run, checkpoint by checkpoint
    cached: tuple[Cell, ...]     # already in the store
    failed: tuple[CellOutcome, ...] = ()   # failed before any worker (a checkpoint not fitting)
    # This run's token: its per-item record files are named with it.
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def in_order(self, outcomes) -> list[CellOutcome]:
        """Outcomes in the sweep's checkpoint order (``expand_checkpoints``'), then the
        suite's order of evaluations."""
        evals = {e.name: i for i, e in enumerate(self.evaluations)}
        return sorted(outcomes, key=lambda o: (
            o.step is None, o.step or 0, parse_epoch(o.checkpoint) or 0, o.checkpoint,
            evals.get(o.evaluation, 0)))

    def evaluation(self, name: str) -> Evaluation:
        return next(e for e in self.evaluations if e.name == name)

    def by_checkpoint(self) -> list[tuple[CheckpointRef, str, list[Cell]]]:
        """The pending cells grouped by checkpoint, in plan order: one load serves a group."""
        groups: dict[str, tuple[CheckpointRef, str, list[Cell]]] = {}
        for c in self.cells:
            groups.setdefault(c.checkpoint.location, (c.checkpoint, c.fingerprint, []))[2] \
                .append(c)
        return list(groups.values())


def checkpoint_fingerprint(location: str) -> str:
    """Cheap identity of a checkpoint's bytes: sizes and modification times, not contents."""
    fs, path = paths.filesystem(location)
    info = fs.get_file_info(path)
    parts = [f"{info.size}:{info.mtime_ns}"]
    if info.type == pafs.FileType.Directory:
        for sub in sorted(fs.get_file_info(pafs.FileSelector(path, recursive=True)),
                          key=lambda i: i.path):
            parts.append(f"{sub.path[len(path):]}:{sub.size}:{sub.mtime_ns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def cell_key(sweep: Sweep, evaluation: Evaluation, checkpoint: CheckpointRef,
             fingerprint: str | None = None, judge_print: str | None = None,
             baseline: str = "", ident: dict | None = None) -> str:
    """Everything a cell's numbers depend on: its evaluation's (``evaluation_ident``, or
    ``ident``, the same computed once for the evaluation's cells), the checkpoint's bytes (by
    fingerprint) and, for a pairwise judge, the key of the baseline's generations
    (``baseline``). Not the batch size, the worker count or anything else declared
    ``numbers=False``. The checkpoint's path is in it because the stored rows carry it."""
    ident = dict(ident if ident is not None else evaluation_ident(sweep, evaluation,
                                                                   judge_print))
    ident["checkpoint"] = checkpoint.location
    ident["checkpoint_fingerprint"] = fingerprint or checkpoint_fingerprint(checkpoint.location)
    if baseline and evaluation.spec.judge is not None:
        ident["baseline_generation"] = baseline
    blob = json.dumps(ident, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def evaluation_ident(sweep: Sweep, evaluation: Evaluation, judge_print: str | None = None
                     ) -> dict:
    """What every cell of one evaluation keys alike (``cell_key`` adds the checkpoint): the
    sweep's and the evaluation's fields declared to change the numbers (walked from the
    schema, ``schema.numbers_of``, so a new field cannot be left out), the data set's and the
    tokenizer's fingerprints, the user's code, the installed plugins' code the cell runs
    (``plugin_code``: only when it runs some, so the keys of cells without plugins stay what
    they were) and the version of rayeval's metric code. The sweep name and the evaluation's
    name are in it because the stored rows carry them. A judged evaluation's has its judge's
    settings (walked with the rest) and its judge's files' fingerprint (``judge_print``, else
    taken here).

    A plan computes it once per evaluation: per cell, the user's files were read and hashed,
    the schema walked and the plugins' registries asked again for every checkpoint."""
    spec = evaluation.spec
    text = tasks.get(spec.task).uses_text
    if not spec.bootstrap.enabled:          # without replicates, seed/buckets/confidence unused
        spec = dataclasses.replace(spec, bootstrap=OFF)
    ident = {
        "sweep": numbers_of(sweep, text),
        "evaluation": numbers_of(spec, text),
        "dataset_fingerprint": evaluation.data.fingerprint,
        "code": _code_digests(sweep, spec),
        "metrics_version": METRICS_VERSION,
    }
    plugged = plugin_code(sweep, spec)
    if plugged:
        ident["plugins"] = plugged
    if spec.judge is not None:
        ident["judge_fingerprint"] = judge_print or checkpoint_fingerprint(spec.judge.model)
    if text and sweep.model.tokenizer:
        # The tokenizer's own files: a folder at the same place may be rewritten. (Hugging
        # Face folders' own tokenizers are in the checkpoint's fingerprint.)
        ident["tokenizer_fingerprint"] = checkpoint_fingerprint(sweep.model.tokenizer)
    return ident


def generation_spec(spec: EvalSpec) -> EvalSpec:
    """A judged evaluation's generation stage: its spec without the judge and its metric."""
    from rayeval.core.judge import judged_metrics

    return dataclasses.replace(spec, judge=None, metrics=tuple(judged_metrics(spec.metrics)[0]))


def generation_key(sweep: Sweep, evaluation: Evaluation, checkpoint: CheckpointRef,
                   fingerprint: str | None = None, ident: dict | None = None) -> str:
    """The key a judged evaluation's generations are kept under (``io.store.states``'
    generations folder, and their records): the key of the same evaluation without its judge,
    so changing only the judge finds them, and changing the generation does not. ``ident``:
    ``evaluation_ident`` of ``generation_stage(evaluation)``, computed once for its cells."""
    return cell_key(sweep, generation_stage(evaluation), checkpoint, fingerprint, ident=ident)


def generation_stage(evaluation: Evaluation) -> Evaluation:
    """A judged evaluation's generation stage as an evaluation of its own."""
    return dataclasses.replace(evaluation, spec=generation_spec(evaluation.spec))


def _code_digests(sweep: Sweep, spec: EvalSpec) -> list[str]:
    """The user's code the numbers come from: the factory's, the transform's and each custom
    metric's module source, so editing it is a new cell, not a stale cached number."""
    refs = [(sweep.model.factory, sweep.base_dir)] if sweep.model.factory else []
    if spec.dataset.transform:
        refs.append((spec.dataset.transform, sweep.base_dir))
    refs += [(m.name, m.base_dir) for m in spec.metrics if m.custom]
    return [source_digest(ref, base) for ref, base in refs]


def plugin_code(sweep: Sweep, spec: EvalSpec) -> list[dict[str, str]]:
    """The installed plugins' code a cell of ``spec`` runs, as its key holds it: for each
    registry entry it uses that a plugin registered (``Registry.origin``), its kind and name,
    the plugin's distribution and version and the digest of the plugin package's source
    (``config.plugins.Origin.ident``). The entries used: the evaluation's task, its metrics, the
    sweep's backend (and its judge's), and every layout a plugin registered, since a plugin's
    detector is asked about every checkpoint on the worker, before the built-in layouts (the
    driver does not open the checkpoints). Empty without plugins; rayeval's own entries are
    covered by its metric version and the walked fields."""
    from rayeval.core import backends, metrics
    from rayeval.io import layouts

    used = [("task", tasks.TASKS, spec.task)]
    used += [("metric", metrics.for_task(m.task), m.name) for m in spec.metrics
             if not m.custom]
    names = [sweep.model.backend] + ([spec.judge.backend] if spec.judge is not None and
                                     spec.judge.backend else [])
    used += [("backend", backends.BACKENDS, n) for n in dict.fromkeys(names)]
    used += [(kind, registry, n) for kind, registry in (("layout detector", layouts.DETECTORS),
                                                        ("layout", layouts.READERS))
             for n in registry.names()]
    found = [(kind, name, registry.origin(name)) for kind, registry, name in used]
    return [{"kind": kind, "name": name, **origin.ident()}
            for kind, name, origin in found if origin is not None]


def make_plan(sweep: Sweep, evaluations: tuple[Evaluation, ...], store: ResultStore | None,
              force: bool = False, ready: list[tuple[CheckpointRef, str]] | None = None,
              skip: set[str] = frozenset()) -> Plan:
    """The cells of every checkpoint (the sweep's globs, or ``ready``: (ref, fingerprint)
    pairs `watch` found) x every evaluation; cells in ``skip`` are left out altogether."""
    if ready is None:
        ready = [(ref, checkpoint_fingerprint(ref.location))
                 for ref in expand_checkpoints(sweep.checkpoints)]
    judges = {e.name: checkpoint_fingerprint(e.spec.judge.model) for e in evaluations
              if e.spec.judge is not None}
    staged = {e.name for e in evaluations if e.spec.judge is not None and e.spec.judge.staged}
    bases = {e.name: _baseline(sweep, e, ready) for e in evaluations
             if e.name in staged and e.spec.judge.baseline}
    # what each evaluation's cells key alike, once (none without a checkpoint: a watch poll
    # that found nothing new reads no user file)
    idents = {e.name: evaluation_ident(sweep, e, judges.get(e.name))
              for e in evaluations} if ready else {}
    staged_idents = {e.name: evaluation_ident(sweep, generation_stage(e))
                     for e in evaluations if e.name in staged} if ready else {}
    cells = [Cell(ref, evaluation.name,
                  cell_key(sweep, evaluation, ref, fingerprint,
                           baseline=bases.get(evaluation.name, ""),
                           ident=idents[evaluation.name]),
                  fingerprint,
                  generation=generation_key(sweep, evaluation, ref, fingerprint,
                                            staged_idents[evaluation.name])
                  if evaluation.name in staged else "",
                  baseline=bases.get(evaluation.name, ""))
             for ref, fingerprint in ready for evaluation in evaluations]
    cells = [c for c in cells if c.key not in skip]
    # One look-up of this sweep's keys: their own files, then the sweep's parts.
    stored = store.stored([c.key for c in cells], sweep.name) \
        if not force and store is not None else set()
    pending = [c for c in cells if c.key not in stored]
    cached = [c for c in cells if c.key in stored]
    if not force and store is not None and staged:
        pending = generated(store, pending)
    if not force and store is not None and sweep.select is None:
        pending = resumed(store, pending, evaluations)
    return Plan(sweep=sweep, evaluations=tuple(evaluations), cells=tuple(pending),
                cached=tuple(cached))


def _baseline(sweep: Sweep, evaluation: Evaluation, ready) -> str:
    """The key of a pairwise judge's baseline generations: its checkpoint must be one of the
    sweep's (SpecError otherwise, before any worker)."""
    from rayeval.errors import SpecError

    js = evaluation.spec.judge
    want = js.baseline.rstrip("/")
    found = {ref.location.rstrip("/"): (ref, fp) for ref, fp in ready}
    if want not in found:
        every = {ref.location.rstrip("/"): ref for ref in expand_checkpoints(sweep.checkpoints)}
        if want not in every:
            names = ", ".join(sorted(every)[:5]) + (", ..." if len(every) > 5 else "")
            raise SpecError(f"{sweep.source}: {js.key_path}.baseline: {js.baseline} is not one "
                            f"of the sweep's checkpoints ({names}); name one of them")
        found[want] = (every[want], checkpoint_fingerprint(every[want].location))
    ref, fingerprint = found[want]
    return generation_key(sweep, evaluation, ref, fingerprint)


def run_keys(plan: Plan, outcomes) -> set[str]:
    """The store keys of a run's cells: those it evaluated, found in the store or failed,
    and its race's partial cells (``outcomes``: the run's ``CellOutcome``s so far)."""
    return {c.key for c in plan.cells + plan.cached} | {o.key for o in plan.failed} | \
        {o.key + PARTIAL for o in outcomes if o.partial}


def generated(store: ResultStore, pending: list[Cell]) -> list[Cell]:
    """Judged cells whose generations the store keeps: only their judge runs."""
    from rayeval.io.store import states as store_states

    stored = store_states.saved(store, [c.generation for c in pending if c.generation],
                                store_states.GENERATIONS)
    return [dataclasses.replace(c, generated=True) if c.generation in stored else c
            for c in pending]


def resumed(store: ResultStore, pending: list[Cell], evaluations) -> list[Cell]:
    """Pending cells with states saved (a race left them partial, or a run was stopped while
    it scored them): they score the rest only. One listing of ``states/``, one read per
    cell found."""
    from rayeval.core.evaluate import ROWS
    from rayeval.io.store import states as store_states

    saved = store_states.saved(store, [c.key for c in pending])
    if not saved:
        return pending
    buckets = {e.name: e.spec.bootstrap.k for e in evaluations}
    out = []
    for c in pending:
        if c.key in saved:
            states, below, k = store_states.read(store, c.key)
            if k == buckets[c.evaluation] and 0 < below < k:
                c = dataclasses.replace(c, resume=below, saved_rows=int(states[ROWS]))
        out.append(c)
    return out
