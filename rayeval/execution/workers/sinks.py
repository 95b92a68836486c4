"""What becomes of a cell's merged states: a sink, one per way a worker runs.

    Publish     rank 0 checks the row count against the data set, computes the metrics and
                writes the cell (a partial cell's stored states added first: a later run
                completes it with the rows it lacked)
    RaceRound   every rank adds a race's round to the cell's running total (in ``race``,
                beside the rounds it adds to); the race publishes at its end

A sink says which rows a cell's pass scores (``within``: bootstrap buckets [lo, hi), None for
every row) and whether the checkpoint loop keeps a loaded checkpoint for a later round. A new
way to finish a cell (a judge stage after generation) is a new sink.
"""

from __future__ import annotations

import time

from rayeval.core import tasks
from rayeval.core.evaluate import ROWS, finalize
from rayeval.errors import RayevalError
from rayeval.execution.workers.rank import RankContext, peak_rss
from rayeval.io.store import states as store_states
from rayeval.io.store import ResultStore, cell_rows
from rayeval.plan.cells import PARTIAL, Cell, CellOutcome, Evaluation, Plan


class Publish:
    """Write each cell as it is scored (rank 0)."""

    keeps = False

    def __init__(self, ctx: RankContext, plan: Plan, metrics: dict[str, list], samples_tag: str,
                 loaded_rss=lambda: 0):
        self.ctx, self.plan, self.metrics = ctx, plan, metrics
        self.samples_tag = samples_tag
        self.loaded_rss = loaded_rss
        self.store = ResultStore(plan.sweep.output) if ctx.rank == 0 else None

    def within(self, cell: Cell, ev: Evaluation):
        """Every row (a cell's segments are ``resume.Resumable``'s)."""
        return None

    def take(self, cell: Cell, ev: Evaluation, merged: dict, step, layout,
             start: float, records: str | None = None, resumed: int = 0
             ) -> CellOutcome | None:
        if self.ctx.rank != 0:
            return None
        self.ctx.mark("publish", f"while publishing {cell.checkpoint.location} on {ev.name}")
        with self.ctx.timer.span("publish", doing=f"publishing {ev.name}"):
            return self.publish(cell, ev, merged, step, layout, start, records=records,
                                resumed=resumed)

    def own_aggregations(self, ev: Evaluation, keys: list[str], key: str, tag) -> dict:
        """The task's own aggregation of the cell's records, with what the task runs beside
        the model during a pass (``Task.pass_service``: a judged lmms-eval task's judge,
        which MMBench asks while it aggregates) up around it."""
        task = tasks.get(ev.spec.task)
        records = self.store.read_samples(key, tag)
        service = task.pass_service(ev.spec, self.ctx.device, self.plan.sweep.model)
        try:
            if service is not None:
                service.start()
            return task.own_aggregations(ev.spec, keys, records, ev.spec.bootstrap)
        finally:
            if service is not None:
                service.close()

    def publish(self, cell: Cell, ev: Evaluation, merged, step, layout, start,
                partial=None, metrics=None, records: str | None = None, resumed: int = 0
                ) -> CellOutcome:
        """Write a cell's rows; ``partial`` (``race.Stopped``): a raced checkpoint's cell
        with some of its items, under its own key; ``metrics``: what the states hold when
        not the evaluation's own (a judged cell's: ``judging.metrics_of``); ``records``: the
        tag of its per-item records when not this run's own (a cell scored in segments:
        ``resume.Resumable``; "": none for every row); ``resumed``: the rows of it an
        earlier run scored."""
        ctx = self.ctx
        tag = None if not ev.spec.samples else self.samples_tag if records is None else \
            (records or None)
        counted = int(merged[ROWS])
        expected = ev.data.num_rows if partial is None else partial.items
        if counted != expected:
            return ctx.failure(cell, step, f"{cell.checkpoint.location}: {ev.name}: counted "
                                           f"{counted} rows but the data set has "
                                           f"{expected}; not published (a sharding "
                                           "bug: please report it)")
        metrics = self.metrics[ev.name] if metrics is None else metrics
        try:
            results = finalize(metrics, merged, ev.output_size, ev.spec.bootstrap)
            own = [k for k, m in metrics if getattr(m, "from_items", False)]
            if own:           # the task's own aggregation, over every worker's records
                results.update(self.own_aggregations(ev, own, cell.key, tag))
        except RayevalError as e:          # a custom metric's compute: this cell only
            ctx.details[cell.key] = e.detail
            return ctx.failure(cell, step, f"{ev.name}: {e.message}")
        key = cell.key if partial is None else cell.key + PARTIAL
        if partial is not None:           # so that a later run completes it (io.store.states)
            store_states.write(self.store, cell.key,
                               {k: v.numpy() for k, v in merged.items()}, partial.below,
                               ev.spec.bootstrap.k)
        self.store.write_cell(key, cell_rows(
            sweep=self.plan.sweep.name, checkpoint=cell.checkpoint.location, step=step,
            epoch=cell.checkpoint.epoch, evaluation=ev.name, results=results,
            higher_is_better={k: bool(getattr(m, "higher_is_better", True)) for k, m in metrics},
            num_samples=counted, num_tokens=tasks.get(ev.spec.task).scored_units(merged),
            world_size=ctx.world, bootstrap_key=ev.spec.bootstrap.key,
            samples=tag,
            items_total=None if partial is None else partial.total,
            stopped=None if partial is None else str(partial),
            limited_from=tasks.get(ev.spec.task).limited_from(ev.spec)))
        return CellOutcome(
            key=cell.key, checkpoint=cell.checkpoint.location, evaluation=ev.name, step=step,
            values=tuple((k, r.value) for k, r in results.items()), rows=counted,
            items_total=None if partial is None else partial.total,
            stopped=None if partial is None else str(partial), resumed=resumed,
            seconds=time.perf_counter() - start, layout=layout, attempt=ctx.attempt,
            peak_rss_bytes=peak_rss(), baseline_rss_bytes=ctx.baseline,
            loaded_rss_bytes=self.loaded_rss())
