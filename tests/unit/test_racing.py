"""Racing's statistical core: the schedule, the bound, the decision, and coverage by simulation.

The coverage tests run thousands of races over fixed synthetic populations (known exact means)
in fresh uniformly random item orders, the randomness the guarantee is about. A wrong race is one
whose survivors hold no true top-k set (ties at the k-th mean broken any way); the guarantee
bounds its rate by 1 - confidence. A rate is judged against CHERNOFF_ETA: a bound that is valid
shows an observed rate above ``threshold`` with probability at most 1e-6, so the same threshold
passes the real radius and catches one made too tight.

Sensitivity factor F = 2: a radius F times too tight shows wrong-race rates above that threshold
on a near-tie scenario built for it (per-item differences of +-1, the variance Hoeffding's bound
assumes), and a radius F times too loose saves at most 3/4 of the real one's item evaluations on
a training-run-like spread. Measured with the seeds below: rates 0.0022 (real) and 0.112 (too
tight) on that scenario; 31.3% (real) and 18.1% (too loose) of item evaluations saved.
"""

import math

import numpy as np
import pytest

from rayeval.core import racing

F = 2.0
CONFIDENCE = 0.95
CHERNOFF_ETA = 1e-6


def threshold(rate: float, races: int, eta: float = CHERNOFF_ETA) -> float:
    """Smallest q with exp(-races * KL(q || rate)) <= eta: by Chernoff's bound, races whose
    true wrong rate is at most ``rate`` show an observed rate above q with probability <= eta."""
    def kl(q):
        tail = 0.0 if q >= 1.0 else (1 - q) * math.log((1 - q) / (1 - rate))
        return q * math.log(q / rate) + tail
    low, high = rate, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if math.exp(-races * kl(mid)) > eta else (low, mid)
    return high


def race_many(race: racing.Race, values: np.ndarray, races: int, seed: int):
    """Run ``races`` races of ``race`` over the population ``values`` (checkpoints x items), each
    in a fresh uniformly random item order. Returns (share of wrong races, share of item
    evaluations saved)."""
    rng = np.random.default_rng(seed)
    m, n_items = values.shape
    schedule = np.asarray(race.schedule)
    orders = np.argsort(rng.random((races, n_items)), axis=1)
    sums = np.cumsum(values[:, orders], axis=2)[:, :, schedule - 1]     # checkpoint, race, round
    totals = values.sum(axis=1)          # exact: populations hold multiples of 1/8 only
    oriented = totals if race.higher_is_better else -totals
    best = np.sort(oriented)[-race.top:].sum()
    wrong, scored = 0, np.zeros((races, m))
    for r in range(races):
        alive = _one_race(race, sums[:, r], scored[r])
        wrong += np.sort(oriented[alive])[-race.top:].sum() != best
    return wrong / races, racing.saved_share(race, scored.sum(axis=0) / races)


def _one_race(race, sums, scored):
    alive = np.ones(race.checkpoints, bool)
    for j, n in enumerate(race.schedule):
        scored[alive] = n
        decision = racing.decide(race, sums[:, j], alive, j)
        alive = np.array(decision.alive)
        if decision.over:
            return alive
    raise AssertionError("a race must be over once every item is scored")


def ranked(counts, items: int, noise: float, seed: int) -> np.ndarray:
    """Bernoulli outcomes with exactly counts[j] correct items for checkpoint j, the items it
    gets right being the easiest ones under a shared difficulty plus its own noise (real
    checkpoints agree on easy items; larger noise, less agreement)."""
    rng = np.random.default_rng(seed)
    difficulty = rng.random(items)
    rows = np.zeros((len(counts), items))
    for j, c in enumerate(counts):
        rows[j, np.argsort(difficulty + noise * rng.random(items))[:c]] = 1.0
    return rows


def opposed(best: int, others: int, items: int, seed: int) -> np.ndarray:
    """Checkpoint 0 right on ``best`` random items, every other one right exactly where it is
    wrong: each paired difference with checkpoint 0 is +-1 on every item, the largest variance
    a [0, 1] metric allows, so no slack hides in Hoeffding's range-only bound."""
    rng = np.random.default_rng(seed)
    first = np.zeros(items)
    first[rng.permutation(items)[:best]] = 1.0
    return np.vstack([first] + [1.0 - first] * others)


def graded(shifts, items: int, lo: float, hi: float, seed: int) -> np.ndarray:
    """Bounded non-Bernoulli values in [lo, hi] (partial credit), on a grid of 1/8 so that
    sums are exact and equal means tie exactly: shared item quality plus noise, shifted."""
    rng = np.random.default_rng(seed)
    quality = rng.random(items)
    unit = np.clip(0.5 * quality[None, :] + 0.5 * rng.random((len(shifts), items))
                   + np.asarray(shifts)[:, None] - 0.25, 0.0, 1.0)
    return lo + np.round(unit * (hi - lo) * 8) / 8


def training_run(items: int, seed: int) -> np.ndarray:
    """16 checkpoints whose accuracies rise and plateau as a training run's do (0.32 ... 0.916)."""
    accuracy = 0.92 - 0.6 * np.exp(-np.arange(16) / 3.0)
    return ranked(np.round(accuracy * items).astype(int), items, 0.5, seed)


def _with_tied_clone(values, source, target):
    values = values.copy()
    values[target] = values[source]
    return values


SCENARIOS = {
    # name: (values, top, higher_is_better, lo, hi, races)
    "bernoulli near tie, 6 checkpoints, agreeing items": (
        ranked([208, 200, 200, 200, 200, 200], 400, 1.0, seed=11), 1, True, 0.0, 1.0, 2000),
    "bernoulli near tie, opposed items (max variance)": (
        opposed(204, 1, 400, seed=12), 1, True, 0.0, 1.0, 4000),
    "bernoulli exact tie at the k-th place, top 2": (
        _with_tied_clone(ranked([260, 240, 0, 236, 200], 400, 1.0, seed=13), 1, 2),
        2, True, 0.0, 1.0, 2000),
    "graded in [-1, 2], exact tie at the k-th place, top 2, lower is better": (
        _with_tied_clone(graded([-0.02, 0.0, 0.0, 0.01, 0.1], 300, -1.0, 2.0, seed=14), 1, 2),
        2, False, -1.0, 2.0, 2000),
}


def _race_for(values, top, higher, lo, hi):
    n_items = values.shape[1]
    return racing.Race(values.shape[0], tuple(racing.rounds(n_items, 32)), top=top,
                       confidence=CONFIDENCE, higher_is_better=higher, lo=lo, hi=hi)


def _tight(monkeypatch, factor):
    real = racing.radius
    monkeypatch.setattr(racing, "radius", lambda *args: real(*args) / factor)


def _loose(monkeypatch, factor):
    real = racing.radius
    monkeypatch.setattr(racing, "radius", lambda *args: real(*args) * factor)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_wrong_elimination_rate_stays_within_one_minus_confidence(name, capsys):
    values, top, higher, lo, hi, races = SCENARIOS[name]
    race = _race_for(values, top, higher, lo, hi)
    rate, saved = race_many(race, values, races, seed=1)
    limit = threshold(1 - CONFIDENCE, races)
    with capsys.disabled():
        print(f"\n[racing] {name}: wrong-race rate {rate:.4f} over {races} races "
              f"(limit {limit:.4f}), items saved {saved:.3f}")
    assert rate <= limit


def test_a_radius_too_tight_by_f_shows_wrong_eliminations(monkeypatch, capsys):
    scenario = SCENARIOS["bernoulli near tie, opposed items (max variance)"]
    values, top, higher, lo, hi, races = scenario
    race = _race_for(values, top, higher, lo, hi)
    _tight(monkeypatch, F)
    rate, _ = race_many(race, values, races, seed=1)
    limit = threshold(1 - CONFIDENCE, races)
    with capsys.disabled():
        print(f"\n[racing] radius / {F:g}: wrong-race rate {rate:.4f} over {races} races "
              f"(a valid bound stays under {limit:.4f})")
    assert rate > limit


def test_training_run_spread_saves_items_and_a_loose_radius_saves_clearly_fewer(
        monkeypatch, capsys):
    values = training_run(2000, seed=21)
    race = _race_for(values, 1, True, 0.0, 1.0)
    rate, saved = race_many(race, values, 40, seed=2)
    _loose(monkeypatch, F)
    _, saved_loose = race_many(race, values, 40, seed=2)
    with capsys.disabled():
        print(f"\n[racing] 16 checkpoints like a training run, 2,000 items, top 1: "
              f"{saved:.1%} of item evaluations saved (radius x {F:g}: {saved_loose:.1%}); "
              f"wrong-race rate {rate:.3f}")
    assert rate <= threshold(1 - CONFIDENCE, 40)
    assert saved > 0
    assert saved_loose <= 0.75 * saved


def _hypergeometric_upper_tails(total, successes, n):
    """P(X >= x) for x = 0..n, X the successes among n of ``total`` drawn without replacement."""
    logf = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, total + 1)))])
    x = np.arange(n + 1)
    ok = (x <= successes) & (n - x <= total - successes)
    xs = x[ok]
    logp = (logf[successes] - logf[xs] - logf[successes - xs]
            + logf[total - successes] - logf[n - xs] - logf[total - successes - n + xs]
            - (logf[total] - logf[n] - logf[total - n]))
    pmf = np.zeros(n + 1)
    pmf[ok] = np.exp(logp)
    return np.cumsum(pmf[::-1])[::-1]


def _worst_exact_ratio(scale):
    """Largest exact P(mean_n - mu >= scale * radius) / delta over Bernoulli populations."""
    worst = 0.0
    for total in (60, 300):
        for n in sorted({5, total // 10, total // 3, total // 2, total - total // 10, total - 2}):
            for delta in (0.05, 1e-3):
                r = scale * racing.radius(n, total, 1.0, delta)
                for successes in range(0, total + 1, max(1, total // 60)):
                    x = math.ceil(n * (successes / total + r) - 1e-9)
                    tails = _hypergeometric_upper_tails(total, successes, n)
                    worst = max(worst, (tails[x] if x <= n else 0.0) / delta)
    return worst


def test_radius_bounds_exact_hypergeometric_tails_and_half_of_it_does_not():
    assert _worst_exact_ratio(1.0) <= 1.0
    assert _worst_exact_ratio(1.0 / F) > 1.0


def test_rounds_grow_from_the_floor_and_end_exactly_at_the_item_count():
    for total, first, growth in [(2000, 100, 2.0), (500, 10, 1.5), (1000, 999, 3.0), (7, 5, 2.0)]:
        schedule = racing.rounds(total, first, growth)
        assert schedule[-1] == total
        assert all(b > a for a, b in zip(schedule, schedule[1:]))
        assert schedule[0] == min(total, max(first, racing.FIRST_ROUND_FLOOR))
    assert racing.rounds(2000, 100) == [100, 200, 400, 800, 1600, 2000]


def test_radius_is_zero_and_bounds_meet_when_every_item_is_scored():
    assert racing.radius(500, 500, 2.0, 1e-9) == 0.0
    assert racing.radius(499, 500, 2.0, 1e-3) > 0.0
    low, high = racing.mean_bounds(371.5, 500, 500, 0.0, 1.0, 1e-9)
    assert low == high == 371.5 / 500


def test_radius_shrinks_as_items_are_scored():
    radii = [racing.radius(n, 1000, 1.0, 1e-3) for n in (32, 100, 300, 600, 900, 999)]
    assert all(b < a for a, b in zip(radii, radii[1:]))


@pytest.mark.parametrize("higher", [True, False])
def test_decision_at_every_item_is_the_exact_ranking(higher):
    sums = np.array([10, 40, 25, 33, 5, 33, 12, 40, 0, 33, 8, 5], float)   # ties at the 3rd
    race = racing.Race(12, (20, 40, 100), top=3, higher_is_better=higher)
    decision = racing.decide(race, sums, None, 2)
    oriented = sums if higher else -sums
    kth = np.sort(oriented)[-3]
    assert decision.alive == tuple(bool(v) for v in oriented >= kth)
    assert decision.over
    assert decision.upper[decision.reference] == 0.0


def test_a_checkpoint_far_behind_leaves_and_the_race_ends_with_the_top_k():
    race = racing.Race(3, tuple(racing.rounds(2000, 100)), top=1)
    decision = racing.decide(race, [90.0, 30.0, 88.0], [True, True, True], 0)
    assert decision.eliminated == (1,)
    assert decision.alive == (True, False, True) and not decision.over
    decision = racing.decide(race, [1500.0, 0.0, 700.0], decision.alive, 4)
    assert decision.eliminated == (2,) and decision.over


@pytest.mark.parametrize("kwargs, name", [
    (dict(top=3), "top"), (dict(top=0), "top"),
    (dict(confidence=0.0), "confidence"), (dict(confidence=1.0), "confidence"),
    (dict(confidence=1.5), "confidence"),
    (dict(lo=1.0, hi=1.0), "lo"), (dict(lo=2.0, hi=1.0), "lo"),
    (dict(schedule=(100, 50)), "schedule"),
])
def test_bad_race_parameters_raise_naming_the_parameter(kwargs, name):
    fields = dict(checkpoints=3, schedule=(100, 200)) | kwargs
    with pytest.raises(ValueError, match=name):
        racing.Race(**fields)


@pytest.mark.parametrize("args, name", [
    ((0, 10), "total_items"), ((100, 0), "first"), ((100, 10, 1.0), "growth"),
])
def test_bad_schedule_parameters_raise_naming_the_parameter(args, name):
    with pytest.raises(ValueError, match=name):
        racing.rounds(*args)


def test_bad_decision_inputs_raise_naming_the_parameter():
    race = racing.Race(3, (100, 200), top=2)
    with pytest.raises(ValueError, match="alive"):
        racing.decide(race, [1.0, 2.0, 3.0], [True, False, False], 0)
    with pytest.raises(ValueError, match="round_index"):
        racing.decide(race, [1.0, 2.0, 3.0], None, 2)
    with pytest.raises(ValueError, match="sums"):
        racing.decide(race, [1.0, 2.0], None, 0)


def race_hashed(values: np.ndarray, top: int, races: int, seed: int, buckets: int = 1024,
                min_items: int = 32):
    """Races as the engine runs them (``execution.workers.race``): each item in a uniformly random
    bucket (the hash of a seed and its row id, a fresh seed per race), round r scoring the
    buckets below ``bucket_rounds``' r-th boundary, the decision on the items that round
    actually holds (skipped while fewer than ``min_items``). Returns the share of wrong races
    and of item evaluations saved."""
    rng = np.random.default_rng(seed)
    m, n_items = values.shape
    bounds = racing.bucket_rounds(n_items, buckets, min_items)
    counts = [max(i + 1, n_items * b // buckets) for i, b in enumerate(bounds[:-1])] + [n_items]
    race = racing.Race(m, tuple(counts), top=top, confidence=CONFIDENCE)
    best = np.sort(values.sum(axis=1))[-top:].sum()
    wrong, scored = 0, 0
    for _ in range(races):
        bucket = rng.integers(0, buckets, n_items)
        alive, items = np.ones(m, bool), np.zeros(m)
        for r, b in enumerate(bounds):
            held = bucket < b
            n = int(held.sum())
            items[alive] = n
            if n < min_items:
                continue
            decision = racing.decide(race, values[:, held].sum(axis=1), alive, r, n)
            alive = np.array(decision.alive)
            if decision.over:
                items[alive] = n_items               # the survivors' last pass
                break
        scored += items.sum()
        wrong += np.sort(values.sum(axis=1)[alive])[-top:].sum() != best
    return wrong / races, 1.0 - scored / (races * m * n_items)


def test_hashed_rounds_keep_the_guarantee_and_save_items(capsys):
    """The engine's rounds are bucket ranges, so a round's item count is random; the bound is
    applied to the count actually scored. On the max-variance near tie the wrong-race rate
    stays within 1 - confidence, and the training-run spread saves item evaluations."""
    values = SCENARIOS["bernoulli near tie, opposed items (max variance)"][0]
    rate, _ = race_hashed(values, 1, 2000, seed=3)
    limit = threshold(1 - CONFIDENCE, 2000)
    _, saved = race_hashed(training_run(2000, seed=21), 1, 40, seed=4)
    with capsys.disabled():
        print(f"\n[racing] hashed rounds: wrong-race rate {rate:.4f} over 2000 races "
              f"(limit {limit:.4f}); training-run spread: {saved:.1%} saved")
    assert rate <= limit
    assert saved > 0.2


def test_a_suite_aggregate_race_keeps_the_guarantee(capsys):
    """The suite's aggregate (``decide_parts``): two evaluations of 400 items, one higher- and
    one lower-is-better, each a max-variance near tie (opposed items), checkpoint 0 truly best
    on the mean of the two (0.02 and 0.01 ahead). Each evaluation's items in its own random
    order; the wrong-race rate stays within 1 - confidence."""
    first = opposed(204, 1, 400, seed=31)            # higher is better: 0 ahead by 0.02
    rng = np.random.default_rng(32)
    second = np.zeros((2, 400))
    second[0, rng.permutation(400)[:198]] = 1.0       # lower is better: 0 ahead by 0.01
    second[1] = 1.0 - second[0]                       # opposed: 202, behind by 0.01
    assert second[0].sum() == 198 and second[1].sum() == 202
    schedule = tuple(racing.rounds(400, 32))
    race = racing.Race(2, schedule, confidence=CONFIDENCE)
    races, wrong = 2000, 0
    orders = np.random.default_rng(33)
    for _ in range(races):
        o1, o2 = orders.permutation(400), orders.permutation(400)
        alive = np.ones(2, bool)
        for j, n in enumerate(schedule):
            parts = [racing.Part(first[:, o1[:n]].sum(axis=1), n, 400, weight=0.5),
                     racing.Part(second[:, o2[:n]].sum(axis=1), n, 400, weight=-0.5)]
            decision = racing.decide_parts(race, parts, alive, j)
            alive = np.array(decision.alive)
            if decision.over:
                break
        wrong += not alive[0]
    rate, limit = wrong / races, threshold(1 - CONFIDENCE, races)
    with capsys.disabled():
        print(f"\n[racing] suite aggregate of two near ties: wrong-race rate {rate:.4f} over "
              f"{races} races (limit {limit:.4f})")
    assert rate <= limit
