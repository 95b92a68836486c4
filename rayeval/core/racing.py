"""Racing: decide after each round which checkpoints cannot be among the top k, with a guarantee.

The statistical core of issue 35, numpy only (no torch, no Ray). The engine scores every
surviving checkpoint on the same items, taken in a uniformly random order fixed by (seed, row
id), in rounds of a fixed schedule (:func:`rounds`); after each round it hands :func:`decide`
the exact sum of each checkpoint's per-item values over the items scored so far.

**The bound** (:func:`radius`). Let x_1..x_N be a finite population in an interval of width w,
mu its mean, and X_1..X_n the first n items of a uniformly random order (sampling without
replacement). For every fixed n < N and delta in (0, 1),

    P( mean(X_1..X_n) - mu >= w * sqrt(rho_n * log(1/delta) / (2 n)) ) <= delta,
    rho_n = min( 1 - (n-1)/N,  (1 - n/N) * (1 + 1/n) ),

the same for the lower tail. The first factor is Serfling's (1974, Corollary 1.1); the second is
Bardenet & Maillard's (2015, Theorem 2.4 and Corollary 2.5), which vanishes at n = N; each holds
for every n, so their minimum does. Only n, N and the sum enter, which is what the engine keeps
exactly. A plainer check of the second factor's shape: the unscored N - n items are themselves
a sample without replacement, and mean_n - mu = -(N-n)/n * (mean_rest - mu), so Hoeffding's
(1963) bound on the rest gives rho = (N-n)/n; Bardenet & Maillard sharpen that by (n+1)/N.
A deterministic bound is intersected for free: whatever the unscored items hold, the population
sum lies within (N - n) * w of what the scored items imply. At n = N both give the exact mean.

**Anytime validity.** The schedule is fixed before any item is scored, so a union bound over
its looks makes the bound hold at every round at once: each of the L rounds with n < N gets
delta / L (the round with n = N is exact and spends nothing). Confidence sequences that need
no schedule (Howard et al. 2021; Waudby-Smith & Ramdas 2020, whose betting sequences for
sampling without replacement are tighter) need each item's value in order, not round sums.

**Paired differences.** Every checkpoint scores the same items, so the difference of two
checkpoints' means is the mean of a finite population of per-item differences in
[lo - hi, hi - lo] (width 2 (hi - lo)), drawn in the same random order: the bound above
applies to it with the difference of the two sums.

**The decision and its family-wise error.** After a round, checkpoint i is eliminated when the
upper bound of its paired difference to the current k-th best survivor is below zero. Take any
true top-k set T (ties broken in any fixed way) and the first round at which a member i of T
is eliminated: all of T still survive, i ranks below the k-th best survivor, so among the k
best survivors there is some a outside T, with mean(a) <= mean(i) and observed difference
d(i, a) <= d(i, k-th) < -radius. So some pair (i in T, a not in T) has its difference's lower
deviation beyond the radius: a union over those k (M - k) pairs and the L looks, each one-sided
with delta = (1 - confidence) / (k (M - k) L), keeps
P(some member of T is eliminated) <= 1 - confidence. For top 1 that is M - 1 comparisons.

References: Serfling, "Probability inequalities for the sum in sampling without replacement",
Ann. Statist. 1974; Bardenet & Maillard, "Concentration inequalities for sampling without
replacement", Bernoulli 2015; Howard, Ramdas, McAuliffe & Sekhon, "Time-uniform, nonparametric,
nonasymptotic confidence sequences", Ann. Statist. 2021; Waudby-Smith & Ramdas, "Confidence
sequences for sampling without replacement", NeurIPS 2020. See docs/racing.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rayeval.io.store import direction

# Each look spends a share of the error budget. Before ~32 items a look can only eliminate a
# checkpoint trailing by most of the range (radius of a [0, 1] difference at 32 items and
# delta = 1e-3: 0.66), so earlier looks cost budget and rarely save items.
FIRST_ROUND_FLOOR = 32


def rounds(total_items: int, first: int, growth: float = 2.0) -> list[int]:
    """Cumulative item counts after each round: the first at least FIRST_ROUND_FLOOR (or all
    items when there are fewer), each next one ``growth`` times the last, the last exactly
    ``total_items``. Geometric growth keeps the number of looks (and the budget split over
    them) logarithmic in the item count."""
    if total_items < 1:
        raise ValueError(f"total_items must be at least 1, got {total_items}")
    if first < 1:
        raise ValueError(f"first must be at least 1, got {first}")
    if not growth > 1.0:
        raise ValueError(f"growth must be above 1, got {growth}")
    n = min(total_items, max(first, FIRST_ROUND_FLOOR))
    schedule = [n]
    while n < total_items:
        n = min(total_items, max(n + 1, math.ceil(n * growth)))
        schedule.append(n)
    return schedule


def bucket_rounds(total_items: int, buckets: int, first: int, growth: float = 2.0
                  ) -> list[int]:
    """The engine's rounds as bucket boundaries: round r scores the rows whose bootstrap
    bucket (a hash of (seed, row id) modulo ``buckets``, ``stats.buckets_of``) lies in
    [b[r-1], b[r]) (b[-1] = 0), the last ending at ``buckets``. The item counts of
    :func:`rounds` become shares of the buckets, rounded up, deduplicated.

    A row's bucket is a uniform hash of its id, so the rows of buckets below b are an
    independent-inclusion sample of the items; given its size, a uniformly random subset of
    that size, nested from round to round: what the bound assumes, with n the number of items
    actually scored (counted exactly in the states). The same rows on any number of workers."""
    out: list[int] = []
    for n in rounds(total_items, first, growth):
        b = min(buckets, math.ceil(buckets * n / total_items))
        if not out or b > out[-1]:
            out.append(b)
    return out


def bucket_range(boundaries: list[int] | tuple[int, ...], round_index: int, buckets: int,
                 of: int) -> tuple[int, int]:
    """Round ``round_index``'s bucket range [lo, hi) for an evaluation with ``buckets``
    buckets, where ``boundaries`` are the raced evaluation's (out of ``of`` buckets): the
    same shares of the hash range. An evaluation with one bucket (no bootstrap) is scored
    whole in the first round."""
    def at(i: int) -> int:
        return 0 if i < 0 else min(buckets, math.ceil(buckets * boundaries[i] / of))
    return at(round_index - 1), at(round_index)


def radius(n: int, total: int, width: float, delta: float) -> float:
    """One-sided deviation bound of the mean of the first n of ``total`` values (in an interval
    of ``width``) drawn without replacement: exceeded with probability at most ``delta``.
    Exactly 0 at n == total. Module-level so that tests can wrap it (too tight, too loose)."""
    if n >= total:
        return 0.0
    rho = min(1.0 - (n - 1) / total, (1.0 - n / total) * (1.0 + 1.0 / n))
    return width * math.sqrt(rho * math.log(1.0 / delta) / (2.0 * n))


def mean_bounds(total_sum: float, n: int, total: int, lo: float, hi: float,
                delta: float) -> tuple[float, float]:
    """Two-sided bounds on the population mean from the sum of the first n values; each side
    fails with probability at most ``delta``. Intersected with what the unscored values
    could add at most or least, so the bounds meet at the exact mean when n == total."""
    r = radius(n, total, hi - lo, delta)
    rest = total - n
    low = max(total_sum / n - r, (total_sum + rest * lo) / total)
    high = min(total_sum / n + r, (total_sum + rest * hi) / total)
    return low, high


def difference_upper(diff_sum: float, n: int, total: int, width: float, delta: float) -> float:
    """Upper bound on the population mean of paired differences from their sum over the first
    n items; fails with probability at most ``delta``. ``width`` = hi - lo of the per-item
    values, so each difference lies in [-width, width]."""
    statistical = diff_sum / n + radius(n, total, 2.0 * width, delta)
    certain = (diff_sum + (total - n) * width) / total     # the rest all won by the first
    return min(statistical, certain)


@dataclass(frozen=True)
class Race:
    """What is raced: ``checkpoints`` score the same items in the rounds of ``schedule``
    (cumulative counts, from :func:`rounds`); the ``top`` best are sought, at ``confidence``,
    on per-item values in [lo, hi] (mean is the figure; ``higher_is_better`` orients it)."""

    checkpoints: int
    schedule: tuple[int, ...]
    top: int = 1
    confidence: float = 0.95
    higher_is_better: bool = True
    lo: float = 0.0
    hi: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "schedule", tuple(int(n) for n in self.schedule))
        if self.checkpoints < 2:
            raise ValueError(f"checkpoints must be at least 2 to race, got {self.checkpoints}")
        if not 1 <= self.top < self.checkpoints:
            raise ValueError(f"top must be at least 1 and below the number of checkpoints "
                             f"({self.checkpoints}), got {self.top}")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence must lie in (0, 1), got {self.confidence}")
        if not self.lo < self.hi:
            raise ValueError(f"lo must be below hi, got lo={self.lo}, hi={self.hi}")
        steps = np.diff(self.schedule)
        if len(self.schedule) == 0 or self.schedule[0] < 1 or (steps <= 0).any():
            raise ValueError(f"schedule must be increasing positive item counts, "
                             f"got {self.schedule}")

    @property
    def total_items(self) -> int:
        return self.schedule[-1]

    @property
    def looks(self) -> int:
        """Rounds that spend error budget: all but the last, where every item is scored."""
        return len(self.schedule) - 1

    @property
    def pair_delta(self) -> float:
        """Error budget of one one-sided paired comparison at one look (see module doc)."""
        comparisons = self.top * (self.checkpoints - self.top)
        return (1.0 - self.confidence) / (comparisons * max(self.looks, 1))

    @property
    def mean_delta(self) -> float:
        """Error budget of one side of one checkpoint's interval at one look: the M
        two-sided intervals hold together at every look with probability >= confidence."""
        return (1.0 - self.confidence) / (2 * self.checkpoints * max(self.looks, 1))


@dataclass(frozen=True)
class Decision:
    """The outcome of one round: who is still in, who left now, and why."""

    round: int                      # index into Race.schedule
    items: int                      # items scored by every survivor so far
    alive: tuple[bool, ...]         # after this round
    eliminated: tuple[int, ...]     # checkpoints eliminated at this round
    reference: int                  # the k-th best survivor the others were compared with
    upper: tuple[float, ...]        # upper bound of each survivor's difference to it (nan: out)
    over: bool                      # top k separated from the rest, or every item scored


@dataclass(frozen=True)
class Part:
    """One evaluation's share of the raced figure: each checkpoint's sum of per-item values
    (in [lo, hi]) over the first ``n`` of ``total`` items, entering the figure with
    ``weight`` (negative: lower is better). One metric is one part of weight +-1; the suite's
    aggregate, the mean over E evaluations, is E parts of weight +-1/E."""
    sums: np.ndarray
    n: int
    total: int
    lo: float = 0.0
    hi: float = 1.0
    weight: float = 1.0


def decide(race: Race, sums, alive, round_index: int, n: int | None = None) -> Decision:
    """Eliminate every survivor whose paired difference to the k-th best survivor has its upper
    bound below zero. ``sums[i]``: checkpoint i's sum of per-item values over the first
    ``n`` items (default ``race.schedule[round_index]``; the engine passes the count its
    hashed rounds actually scored); ignored for those not alive."""
    sums, alive = _checked(race, sums, alive, round_index)
    n = race.schedule[round_index] if n is None else int(n)
    return decide_parts(race, [Part(np.asarray(sums, dtype=np.float64), n, race.total_items,
                                    race.lo, race.hi, direction(race.higher_is_better))],
                        alive, round_index)


def decide_parts(race: Race, parts: list[Part], alive, round_index: int) -> Decision:
    """``decide`` over a weighted sum of parts (the suite's aggregate). The figure's paired
    difference is sum_p w_p d_p, so its upper bound is sum_p |w_p| times each part's oriented
    bound, each at delta / P: if every part's bound holds, the weighted sum's does (a union
    bound over the P parts; the module doc's argument then goes through unchanged with the
    figure's estimate ranking the survivors)."""
    if not parts:
        raise ValueError("parts must hold at least one part")
    for p in parts:
        _checked(race, p.sums, alive, round_index)
        if not 0 < p.n <= p.total:
            raise ValueError(f"n must lie in [1, {p.total}], got {p.n}")
    alive = _checked(race, parts[0].sums, alive, round_index)[1]
    oriented = [np.sign(p.weight) * np.asarray(p.sums, dtype=np.float64) for p in parts]
    estimate = sum(abs(p.weight) * o / p.n for p, o in zip(parts, oriented))
    reference = _kth_best(estimate, alive, race.top)
    delta = race.pair_delta / len(parts)
    upper = np.full(race.checkpoints, np.nan)
    for i in np.flatnonzero(alive):
        upper[i] = sum(abs(p.weight) * difference_upper(o[i] - o[reference], p.n, p.total,
                                                        p.hi - p.lo, delta)
                       for p, o in zip(parts, oriented))
    out = alive & (upper < 0)
    still = alive & ~out
    over = int(still.sum()) <= race.top or all(p.n == p.total for p in parts)
    return Decision(round_index, parts[0].n, tuple(bool(a) for a in still),
                    tuple(int(i) for i in np.flatnonzero(out)), reference,
                    tuple(float(u) for u in upper), over)


def _kth_best(oriented: np.ndarray, alive: np.ndarray, top: int) -> int:
    """Index of the survivor ranked k-th (ties: lowest index first; a tie with the k-th
    leaves every tied checkpoint at difference 0, so which one is picked changes nothing)."""
    idx = np.flatnonzero(alive)
    order = idx[np.lexsort((idx, -oriented[idx]))]
    return int(order[top - 1])


def _checked(race: Race, sums, alive, round_index: int):
    sums = np.asarray(sums, dtype=np.float64)
    alive = np.ones(race.checkpoints, bool) if alive is None else np.asarray(alive, bool)
    if sums.shape != (race.checkpoints,) or alive.shape != (race.checkpoints,):
        raise ValueError(f"sums and alive must hold one entry per checkpoint "
                         f"({race.checkpoints}), got {sums.shape} and {alive.shape}")
    if not 0 <= round_index < len(race.schedule):
        raise ValueError(f"round_index must lie in [0, {len(race.schedule)}), got {round_index}")
    if int(alive.sum()) < race.top:
        raise ValueError(f"alive must keep at least top={race.top} checkpoints, "
                         f"got {int(alive.sum())}")
    if not np.isfinite(sums[alive]).all():
        raise ValueError("sums must be finite for every checkpoint alive")
    return sums, alive


def saved_share(race: Race, items_scored) -> float:
    """Share of item evaluations a race saved against scoring every item for every
    checkpoint; ``items_scored[i]``: items checkpoint i scored before it left (or all)."""
    full = race.checkpoints * race.total_items
    return 1.0 - float(np.sum(items_scored)) / full
