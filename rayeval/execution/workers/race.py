"""A race on the workers (``select:``, docs/racing.md; its statistics are ``core.racing``).

Rounds are ranges of the bootstrap's row buckets (``racing.bucket_rounds``): round r scores,
for every checkpoint still in, the rows whose bucket lies in its range, on every evaluation of
the suite (each at the same share of its own buckets). The all-reduce of a round's cell gives
every rank the cell's summed states, so every rank adds them to the cell's total and takes the
same decision after the round: no round trip to the driver. A checkpoint is loaded once per
round it survives (the schedule doubles, so about log2(items / first round) loads).

When the top k are separated, the survivors score the buckets left in one more pass, so their
states are the full run's, exactly (integer states, summed bucket by bucket), and they are
published as complete cells. An eliminated checkpoint's cells are published as partial cells
(``PARTIAL``), under their own key, so a complete cell is never taken for them nor they for it.

A group restarted after a lost worker races again from the first round (it publishes nothing
before the race ends): the same rows, the same states, the same decisions.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from rayeval.core import racing
from rayeval.core.evaluate import ROWS, finalize
from rayeval.core.metrics import build_all
from rayeval.errors import RunError
from rayeval.plan.cells import Cell, Evaluation, Plan
from rayeval.ranking.rules import direction, sweep_headline


@dataclass
class Stopped:
    """A partial cell: ``items`` of its ``total`` items scored when its checkpoint left the
    race (its upper bound on the difference to the k-th best on ``metric`` below zero)."""
    items: int
    total: int
    top: int
    confidence: float
    metric: str
    round: int = 0
    below: int = 0          # the cell's evaluation: the buckets below this one were scored

    def __str__(self) -> str:
        return (f"stopped after {self.items} of {self.total} items: below #{self.top} on "
                f"{self.metric} with {self.confidence:.0%} confidence")


class Rounds:
    """The race's state on one rank: the round, the bucket range each evaluation scores in
    it, every cell's summed states, and who is still in."""

    def __init__(self, plan: Plan):
        sel = plan.sweep.select
        self.plan = plan
        self.targets = targets(plan)           # [(evaluation, metric key, metric, weight)]
        self.figure_name = AGGREGATE_NAME if sel.suite else \
            f"{self.targets[0][0]}/{self.targets[0][1]}"
        # The rounds' shares of the buckets come from the smallest evaluation raced: each
        # evaluation then has at least min_items items (expected) in the first round.
        smallest = min((plan.evaluation(t[0]) for t in self.targets),
                       key=lambda e: e.data.num_rows)
        self.of = smallest.spec.bootstrap.k
        total = smallest.data.num_rows
        self.bounds = racing.bucket_rounds(total, self.of, sel.min_items)
        self.groups = plan.by_checkpoint()
        counts = []                 # the expected items after each round, for the budget split
        for b in self.bounds[:-1]:
            counts.append(max(counts[-1] + 1 if counts else 1, total * b // self.of))
        counts.append(max(total, counts[-1] + 1 if counts else total))
        self.race = racing.Race(checkpoints=len(self.groups), schedule=tuple(counts),
                                top=sel.top, confidence=sel.confidence)
        self.min_items = sel.min_items
        self.round = 0
        self.rest = False           # the survivors' last pass over the buckets left
        self.alive = np.ones(len(self.groups), bool)
        self.failed: set[int] = set()
        self.stopped: dict[int, Stopped] = {}
        self.states: dict[str, dict] = {}
        self.added: set[str] = set()        # cells whose round's states came this round
        self.meta: dict[str, tuple] = {}    # cell key -> (step, layout, seconds)

    # --- what a round scores ---------------------------------------------------------------

    def buckets(self, evaluation: str) -> tuple[int, int]:
        """The bucket range [lo, hi) this round scores of ``evaluation``."""
        k = self.plan.evaluation(evaluation).spec.bootstrap.k
        if self.rest:
            return racing.bucket_range(self.bounds, self.round, k, self.of)[1], k
        return racing.bucket_range(self.bounds, self.round, k, self.of)

    def todo(self) -> set[str]:
        """The keys of the cells this round scores: the survivors', where the range holds
        buckets."""
        keys = set()
        for i, (_, _, cells) in enumerate(self.groups):
            if self.alive[i]:
                keys |= {c.key for c in cells if _nonempty(self.buckets(c.evaluation))}
        return keys

    def add(self, cell: Cell, merged: dict, step, layout, seconds: float) -> None:
        total = self.states.get(cell.key)
        self.states[cell.key] = dict(merged) if total is None else \
            {k: total[k] + v for k, v in merged.items()}
        _, _, spent = self.meta.get(cell.key, (None, None, 0.0))
        self.meta[cell.key] = (step, layout, spent + seconds)
        self.added.add(cell.key)

    # --- the decision --------------------------------------------------------------------

    def decide(self, todo: set[str]) -> bool:
        """After a round: drop the checkpoints whose cells failed in it, eliminate those that
        cannot be in the top k. Whether the race is over."""
        for i, (_, _, cells) in enumerate(self.groups):
            if self.alive[i] and any(c.key in todo and c.key not in self.added for c in cells):
                self.alive[i] = False        # failed this round: its outcome says why
                self.failed.add(i)
        self.added = set()
        live = np.flatnonzero(self.alive)
        if len(live) <= self.race.top:
            return True
        parts = [self.part(t, live) for t in self.targets]
        if any(p.n < min(self.min_items, p.total) for p in parts):
            return False            # a hashed round came out below select.min_items
        decision = racing.decide_parts(self.race, parts, self.alive, self.round)
        if any(p.n < p.total for p in parts):   # at the last round every item is scored
            first = parts[0]
            for i in decision.eliminated:
                self.stopped[int(i)] = Stopped(first.n, first.total, self.race.top,
                                               self.race.confidence, self.figure_name,
                                               round=self.round)
        self.alive = np.array(decision.alive)
        return decision.over

    def part(self, target, live) -> racing.Part:
        """One evaluation's share of the figure: each live checkpoint's sum of per-item
        values (its metric's mean times its items) over the items of this round."""
        name, key, metric, weight = target
        ev = self.plan.evaluation(name)
        sums, n = np.zeros(len(self.groups)), None
        for i in live:
            cell = next(c for c in self.groups[i][2] if c.evaluation == name)
            states = self.states[cell.key]
            items = int(states[f"{key}/total"].sum())
            if n is not None and items != n:
                raise RunError(f"racing: checkpoints scored {n} and {items} items of {name} "
                               "in the same round; please report this bug")
            mean = finalize([(key, metric)], states, ev.output_size)[key].value
            sums[i], n = mean * items, items
        lo, hi = metric.race_bounds(key)
        return racing.Part(sums, n, ev.data.num_rows, lo, hi, weight)

    def advance(self, over: bool) -> bool:
        """To the next round (or, once over, to the survivors' last pass); whether anything
        is left to score."""
        last = self.round + 1 >= len(self.bounds)
        if self.rest or (last and not over):
            return False
        if over:
            if last:
                return False
            self.rest = True
            return True
        self.round += 1
        return True

    # --- what is published -------------------------------------------------------------------

    def finished(self):
        """(cell, states, step, layout, seconds, Stopped or None) of every cell that took
        part to the end (survivors: complete; eliminated: partial), in plan order."""
        for i, (_, _, cells) in enumerate(self.groups):
            if i in self.failed:
                continue
            for cell in cells:
                if cell.key in self.states:
                    step, layout, seconds = self.meta[cell.key]
                    stopped = self.stopped.get(i)
                    if stopped is not None:       # this cell's own items, the raced one's why
                        ev = self.plan.evaluation(cell.evaluation)
                        stopped = dataclasses.replace(
                            stopped, items=int(self.states[cell.key][ROWS]),
                            total=ev.data.num_rows, below=racing.bucket_range(
                                self.bounds, stopped.round, ev.spec.bootstrap.k, self.of)[1])
                    yield cell, self.states[cell.key], step, layout, seconds, stopped


class RaceRound:
    """The sink of a race's rounds (``sinks``): each cell's round added to the race's totals
    on every rank; the rows a round scores are its bootstrap buckets."""

    keeps = True

    def __init__(self, rounds: Rounds):
        self.rounds = rounds

    def within(self, cell: Cell, ev: Evaluation):
        return self.rounds.buckets(ev.name)

    def take(self, cell: Cell, ev: Evaluation, merged: dict, step, layout,
             start: float) -> None:
        self.rounds.add(cell, merged, step, layout, time.perf_counter() - start)
        return None


AGGREGATE_NAME = "the suite's aggregate"


def targets(plan: Plan) -> list[tuple[str, str, object, float]]:
    """What is raced, as (evaluation, metric key, metric, weight): the one metric
    ``select.metric`` names (weight +-1 as higher or lower is better), or for ``aggregate``
    every evaluation's headline metric (weight +-1/E), as the leaderboard's aggregate
    (``ranking.rules``)."""
    sel = plan.sweep.select
    if sel.suite:
        chosen = [(e, None) for e in plan.sweep.suite_evaluations()]
    else:
        chosen = [sel.target([e.name for e in plan.evaluations])]
    out = []
    for name, key in chosen:
        metrics = dict(build_all(plan.evaluation(name).spec.metrics))
        key = key or sweep_headline(list(metrics))
        m = metrics[key]
        out.append((name, key, m, direction(m.higher_is_better) / len(chosen)))
    return out


def _nonempty(r: tuple[int, int]) -> bool:
    return r[1] > r[0]


def run_race(plan: Plan, run_checkpoints, forget, publisher, finish,
             outcomes: list) -> None:
    """Race ``plan``'s checkpoints: rounds until the top k are separated or every item is
    scored, then (rank 0) publish every cell. The worker's parts: ``run_checkpoints(plan,
    todo, sink)`` scores a round's cells into a ``sinks.RaceRound``; ``forget(locations)``
    lets go of the checkpoints kept for later rounds; ``publisher`` (``sinks.Publish``)
    writes the cells at the end, ``finish`` takes each outcome and ``outcomes`` holds those
    taken so far (a cell that failed in a round)."""
    race = Rounds(plan)
    sink = RaceRound(race)
    try:
        while True:
            todo = race.todo()
            run_checkpoints(plan, todo, sink)
            if race.rest:
                break
            over = race.decide(todo)
            forget({ref.location for i, (ref, _, _) in enumerate(race.groups)
                    if not race.alive[i]})
            if not race.advance(over):
                break
    finally:                            # a standing group's next poll may not race
        forget({ref.location for ref, _, _ in race.groups})
    if publisher.ctx.rank != 0:
        return
    failed = {o.key for o in outcomes}
    for i in sorted(race.failed):       # a checkpoint whose cell failed: its others too
        ref, _, cells = race.groups[i]
        for cell in cells:
            if cell.key not in failed:
                finish(publisher.ctx.failure(cell, ref.step, (
                    f"{ref.location}: {cell.evaluation}: not published: the checkpoint "
                    "left the race when another of its evaluations failed")))
    for cell, states, step, layout, seconds, stopped in race.finished():
        ev = plan.evaluation(cell.evaluation)
        start = time.perf_counter() - seconds
        finish(publisher.publish(cell, ev, states, step, layout, start, partial=stopped))
