"""Tier 1: the bootstrap. A coverage simulation on synthetic data with known truth (many trials
of the pure torch path, no Ray), and the properties that make intervals shard-independent."""

import math

import numpy as np
import pytest
import torch

from rayeval.core import stats
from rayeval.config.schema import Bootstrap
from rayeval.core.evaluate import Accumulator, finalize
from rayeval.core.metrics import build, parse_metric


def interval(task, name, outputs, targets, boot, ids, size=2):
    spec = parse_metric(name, task)
    metrics = [(spec.key, build(spec))]
    acc = Accumulator(metrics, size, boot.k)
    acc.add(outputs, targets, stats.buckets_of(ids, boot.seed, boot.k))
    r = finalize(metrics, acc.states, size, boot)[spec.key]
    return r.ci_low, r.ci_high


SEEDS = 7          # trial t resamples with bootstrap seed t % 7
CHECKED = 3        # trials per seed whose interval is also taken from finalize itself


def coverage(trials, n, buckets, make, task, name, truth, size=2):
    """The share of trials whose 95% interval holds the truth. Trial t draws its data from
    rng 10_000 + t and resamples with seed t % 7. The trials of one seed are resampled
    together: each trial's bucket states come from the real Accumulator, then one exact
    weighted sum (integer arithmetic, so the same bits as one trial at a time) and one
    quantile per replicate row give every interval at once. The first trials of each seed
    must get from ``finalize`` exactly the interval computed here. One trial at a time this
    took 50-230 s a test on the 2-core machine (a weighted sum and a weight table per trial)."""
    spec = parse_metric(name, task)
    metrics = [(spec.key, build(spec))]
    hits = 0
    for seed in range(SEEDS):
        boot = Bootstrap(replicates=1000, confidence=0.95, seed=seed, buckets=buckets)
        rows = stats.buckets_of(torch.arange(n), seed, boot.k)
        data, states = [], []
        for t in range(seed, trials, SEEDS):
            outputs, targets = make(np.random.default_rng(10_000 + t), n)
            acc = Accumulator(metrics, size, boot.k)
            acc.add(outputs, targets, rows)
            states.append(acc.states)
            data.append((outputs, targets))
        lo, hi = intervals(metrics[0], states, size, boot)
        for i, (outputs, targets) in enumerate(data[:CHECKED]):
            one = interval(task, name, outputs, targets, boot, torch.arange(n), size)
            assert one == (lo[i].item(), hi[i].item()), (seed, i)
        hits += int(((lo <= truth) & (truth <= hi)).sum())
    return hits / trials


def intervals(metric, states, size, boot):
    """The percentile intervals of many trials' states (one bootstrap seed), as finalize
    forms them for one: replicate states are weighted sums of bucket states, a metric value
    per replicate, NaN replicates dropped."""
    key, m = metric
    assert m.batched_compute        # compute() takes a leading replicate dimension
    weights = stats.poisson_weights(boot.seed, boot.k, boot.replicates)
    rep = {}
    for part, template in m.init_state(size).items():
        stacked = torch.stack([s[f"{key}/{part}"] for s in states], dim=1)  # (buckets, trials)
        summed = stats.weighted_sum(weights, stacked)                       # (replicates, trials)
        rep[part] = (stats.from_limbs(stats.normalize(summed))
                     if template.dtype.is_floating_point else summed)
    values = torch.as_tensor(m.compute(rep), dtype=torch.float64)
    alpha = (1.0 - boot.confidence) / 2
    q = torch.tensor([alpha, 1 - alpha], dtype=torch.float64)
    lo, hi = torch.nanquantile(values, q, dim=0)
    return lo, hi


def correct_with_probability(p):
    def make(rng, n):
        y = torch.tensor(rng.integers(0, 2, n))
        right = torch.tensor(rng.random(n) < p)
        pred = torch.where(right, y, 1 - y)
        return torch.nn.functional.one_hot(pred, 2).float(), y
    return make


def gaussian_errors(rng, n):
    y = torch.tensor(rng.normal(size=n))
    return y + torch.tensor(rng.normal(size=n)), y


@pytest.mark.parametrize("n,buckets", [(400, 1024), (20_000, 256)],
                         ids=["row-level", "many-rows-per-bucket"])
def test_accuracy_interval_covers_the_truth_95_percent(n, buckets):
    rate = coverage(1000, n, buckets, correct_with_probability(0.7), "classification",
                    "accuracy", 0.7)
    assert 0.93 <= rate <= 0.97, rate


def test_mae_interval_covers_the_truth_95_percent():
    rate = coverage(1000, 500, 1024, gaussian_errors, "regression", "mae", math.sqrt(2 / math.pi),
                    size=1)
    assert 0.93 <= rate <= 0.97, rate


def test_replicates_do_not_depend_on_sharding():
    boot = Bootstrap(replicates=200, buckets=64, seed=3)
    spec = parse_metric("nll", "classification")
    metrics = [(spec.key, build(spec))]
    rng = np.random.default_rng(0)
    out = torch.tensor(rng.normal(size=(999, 3)))
    y = torch.tensor(rng.integers(0, 3, 999))
    ids = torch.tensor(rng.permutation(10**6)[:999])
    buckets = stats.buckets_of(ids, boot.seed, boot.k)

    def states(parts):
        total = None
        for idx in parts:
            acc = Accumulator(metrics, 3, boot.k)
            acc.add(out[idx], y[idx], buckets[idx])
            total = acc.states if total is None else {k: total[k] + acc.states[k] for k in total}
        return total

    one = finalize(metrics, states([torch.arange(999)]), 3, boot)["nll"]
    perm = torch.tensor(rng.permutation(999))
    three = finalize(metrics, states(perm.tensor_split(3)), 3, boot)["nll"]
    assert one.replicates == three.replicates
    assert (one.value, one.ci_low, one.ci_high) == (three.value, three.ci_low, three.ci_high)


def test_weights_are_poisson_and_fixed_by_seed():
    w = stats.poisson_weights(0, 1024, 1000)
    assert torch.equal(w, stats.poisson_weights(0, 1024, 1000))
    assert not torch.equal(w, stats.poisson_weights(1, 1024, 1000))
    assert abs(w.double().mean().item() - 1) < 0.01 and abs(w.double().var().item() - 1) < 0.02
    assert abs((w == 0).double().mean().item() - math.exp(-1)) < 0.01


def test_fixed_point_sums_are_exact_and_order_free():
    x = torch.tensor(np.random.default_rng(0).normal(size=20_000) * 1e3)
    whole = stats.normalize(stats.to_limbs(x).sum(0))
    shuffled = x[torch.randperm(len(x))]
    parts = sum(stats.to_limbs(p).sum(0) for p in shuffled.tensor_split(7))
    assert torch.equal(stats.normalize(parts), whole)
    assert stats.from_limbs(whole).item() == pytest.approx(math.fsum(x.tolist()), rel=1e-15)


def test_weighted_sum_is_exact():
    w = stats.poisson_weights(5, 300, 40)
    s = torch.randint(-(1 << 45), 1 << 45, (300, 6))
    want = torch.stack([(w[b].view(-1, 1) * s).sum(0) for b in range(40)])
    assert torch.equal(stats.weighted_sum(w, s), want)
