"""A cell scored in segments of its bootstrap buckets and saved in the store as it goes, so that a
later run, on any number of workers and with any batch size, or a worker group restarted inside
this run, scores only the rows left (``resume:`` in the sweep, docs/cluster.md).

Every row belongs to one of the evaluation's ``bootstrap.buckets`` buckets, by a hash of (seed,
row id): which rows a range of buckets holds does not depend on the shards. A cell is scored as
consecutive bucket ranges [a, b), each one pass over every worker's shard that scores only its
rows, and one all-reduce of its states; the states are integer sums per bucket, so adding the
segments' states gives exactly an uninterrupted pass's (figures, intervals). After a segment,
rank 0 writes the cell's states so far with the boundary (``io.store.states``: ``scored_below``)
when ``resume.every`` seconds have passed since the last save; a later plan finds them
(``plan.cells.resumed``) and the cell's pass scores from the boundary on (``sinks.Publish``
adds the saved states before publishing). Per-item records are written segment by segment under
a tag of their own; the published cell names all of them.

How long a segment is comes from what the last one cost (``Schedule``): the first segment of an
evaluation without an estimate scores 1/32 of the buckets; after it, a segment is sized to take
``every`` seconds, and at least 49 times what a segment costs beyond its rows (reading a shard
that is not held in memory again, the all-reduce), so segmenting adds at most 2% to a pass. A
cell expected to take less than ``every`` seconds is one segment, as without ``resume``.

Not segmented: a race's cells (its rounds are bucket ranges already, published at its end), a
judged evaluation's generations, and an evaluation without a bootstrap (one bucket).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from rayeval.core.evaluate import ROWS
from rayeval.errors import RayevalError
from rayeval.execution.workers.rank import RankContext
from rayeval.execution.workers.scorer import CellScorer, Cost
from rayeval.io.store import states as store_states
from rayeval.plan.cells import Cell, CellOutcome, Evaluation

PROBE = 32               # an evaluation's first segment: 1/32 of its buckets
OVERHEAD = 0.02          # at most this share of a pass goes to segmenting
TAIL = 1.5               # a segment left shorter than half a segment joins the one before


@dataclass
class Pace:
    """What a segment of an evaluation costs: seconds per bucket scored, and seconds a
    segment costs whatever its size (its pass over the shard, its all-reduce)."""
    per_bucket: float
    fixed: float

    @classmethod
    def of(cls, cost: Cost, buckets: int) -> "Pace":
        # A pass that read the shard from its source, now held in memory, says nothing of
        # what the next passes cost beyond their rows: the next segment measures it.
        fixed = 0.0 if cost.first_read else max(0.0, cost.wall - cost.busy)
        return cls(per_bucket=cost.busy / max(1, buckets), fixed=fixed)


class Schedule:
    """The bucket ranges of one cell, from ``lo`` to ``k``, decided alike on every rank (from
    reduced costs only)."""

    def __init__(self, every: float, k: int, lo: int, pace: Pace | None):
        self.every, self.k, self.pace = every, k, pace
        self.a = lo

    def next(self) -> tuple[int, int]:
        """The next segment [a, b)."""
        a, k = self.a, self.k
        if self.every <= 0 or k - a <= 1:
            return a, k
        if self.pace is None:
            return a, min(k, a + max(1, k // PROBE))
        if self.pace.per_bucket <= 0:
            return a, k
        seconds = max(self.every, self.pace.fixed * (1 - OVERHEAD) / OVERHEAD)
        span = max(1, math.ceil(seconds / self.pace.per_bucket))
        return a, (k if k - a <= span * TAIL else a + span)

    def done(self, b: int, cost: Cost) -> None:
        self.pace = Pace.of(cost, b - self.a)
        self.a = b


class Resumable:
    """Scores a plain run's cells in segments and keeps each in the store as it goes (rank 0
    writes), then hands the whole to ``publisher`` (``sinks.Publish``). One per worker; it
    remembers each evaluation's pace between cells."""

    def __init__(self, ctx: RankContext, scorer: CellScorer, publisher, every: float):
        self.ctx, self.scorer, self.publisher = ctx, scorer, publisher
        self.every = every
        self.paces: dict[str, Pace] = {}

    def score(self, model, cell: Cell, ev: Evaluation, step, layout, start: float,
              index: int) -> CellOutcome | None:
        ctx, k = self.ctx, ev.spec.bootstrap.k
        earlier = SavedStates(self.publisher.store, cell) if ctx.rank == 0 and cell.resume \
            else None
        plan = Schedule(self.every, k, cell.resume, self.paces.get(ev.name))
        total, tags, done = None, [], 0
        if earlier is not None:
            done = earlier.rows         # the progress counts them on rank 0
        last_save, saved_now = time.monotonic(), False
        while plan.a < k:
            a, b = plan.next()
            whole = a == 0 and b == k
            tag = None
            if ev.spec.samples:
                # a segment's own set: a restarted group (same world) that scores the segment
                # again replaces every file of it before the reduce that lets it be named
                tag = self.scorer.samples_tag if whole else f"{self.scorer.samples_tag}.{a}"
            merged, failed = self.scorer.score(model, cell, step, index,
                                               None if whole else (a, b), tag, done)
            if merged is None:
                return failed
            cost = self.scorer.cost
            done += cost.rows
            plan.done(b, cost)
            self.paces[ev.name] = plan.pace
            total = merged if total is None else {n: total[n] + v for n, v in merged.items()}
            if tag is not None:
                tags.append(tag)
            if b < k and ctx.rank == 0 and time.monotonic() - last_save >= self.every:
                failure = self.save(cell, ev, step, earlier, total, b, tags)
                if failure is not None:
                    return failure
                last_save, saved_now = time.monotonic(), True
        if earlier is not None:         # rank 0: the rows an earlier run scored
            total = earlier.added(total)
        records = _records(earlier, tags)
        outcome = self.publisher.take(cell, ev, total, step, layout, start, records=records,
                                      resumed=0 if earlier is None else earlier.rows)
        if outcome is not None and outcome.error is None and (saved_now or cell.resume):
            try:                   # published whole: what was saved of it is not needed
                store_states.remove(self.publisher.store, cell.key)
            except RayevalError:
                pass               # a later plan never reads a published cell's states
        return outcome

    def save(self, cell: Cell, ev: Evaluation, step, earlier: "SavedStates | None", total: dict,
             below: int, tags: list[str]) -> CellOutcome | None:
        """Rank 0: the cell's states so far (the saved ones added) with their boundary."""
        states = {n: v.numpy() for n, v in (total if earlier is None else
                                            earlier.added(total)).items()}
        records = _records(earlier, tags)
        meta = {"samples": records} if ev.spec.samples and records else {}
        with self.ctx.timer.span("publish", doing=f"keeping {ev.name} so far"):
            try:
                store_states.write(self.publisher.store, cell.key, states, below,
                                   ev.spec.bootstrap.k, meta=meta)
            except RayevalError as e:
                return self.ctx.failure(cell, step, f"{ev.name}: {e.message}")
        return None


class SavedStates:
    """A cell's states saved by an earlier run (rank 0 reads them once): the rows they count
    and the tags of their per-item records (None: saved without records, by a race)."""

    def __init__(self, store, cell: Cell):
        meta: dict = {}
        self.states, self.below, _ = store_states.read(store, cell.key, meta=meta)
        self.rows = int(self.states[ROWS])
        self.records = meta.get("samples")

    def added(self, total: dict) -> dict:
        """``total`` (this run's merged states) with the saved ones added."""
        return {n: v + torch.from_numpy(self.states[n]).to(v.dtype) if n in self.states else v
                for n, v in total.items()}


def _records(earlier: SavedStates | None, tags: list[str]) -> str:
    """The records' tags of a cell so far, joined by "+": the saved part's, then this run's
    segments'; "" where some rows have none (a race saved its states without records)."""
    if earlier is None:
        return "+".join(tags)
    return "+".join([earlier.records] + tags) if earlier.records and tags else ""
