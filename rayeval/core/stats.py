"""Exact, shard-independent accumulation and the Poisson bootstrap.

Three pieces, all plain torch:

* **Fixed-point sums.** A float contribution of one row is split into four 32-bit limbs
  (weights 2**-64, 2**-32, 2**0, 2**32) and summed as integers, so a sum does not depend on the
  order rows arrive in, nor on how they were sharded: 1, 2 or 3 workers publish identical bits.
* **Row buckets.** Every row id is hashed (with the bootstrap seed) into one of K buckets; each
  worker keeps its states per bucket, which merge by addition like any state.
* **Replicates.** Replicate b gives bucket k the weight Poisson(1) drawn from a hash of
  (seed, k, b). After the one all-reduce, rank 0 forms the B replicate states as weighted sums
  of bucket states (exact integer arithmetic again). The weights depend on row ids only, so the
  resample is the same for every checkpoint (comparisons are paired) and for any world size.
  When the data set has no more rows than buckets this is the row-level Poisson bootstrap; with
  more rows, rows that share a bucket share their weights (a bootstrap over K hashed groups of
  exchangeable rows, which estimates the same variance).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

LIMB_BITS = 32
LIMBS = 4
_LOW = -64                  # exponent of the lowest limb
_MASK = (1 << LIMB_BITS) - 1
_LIMIT = 2.0 ** (LIMB_BITS * (LIMBS - 1) + _LOW + 31)   # |row value| below this is exact enough


def all_finite(t: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or infinity. One reduction and no temporary the size of
    ``t`` (``isfinite(t).all()`` makes one, and costs 20 times as much on a CPU): the sum is
    finite when every value is, unless finite values overflow it, which the exact check then
    settles."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def to_limbs(values: torch.Tensor) -> torch.Tensor:
    """float values (...) -> int64 limbs (..., 4); lower limbs in [0, 2**32), the top one
    signed. Exact up to rounding below 2**-64."""
    v = values.to(torch.float64)
    if v.numel() and not bool(v.abs().max() < _LIMIT):      # NaN compares false as well
        raise ValueError("a metric contribution is not finite or too large (>= 2**63)")
    sign = torch.where(v < 0, -1, 1).to(torch.int64)
    rest = v.abs()                 # digits of |v| are exact: each step removes leading bits
    top_unit = 2.0 ** (LIMB_BITS * (LIMBS - 1) + _LOW)          # 2**32
    hi = torch.floor(rest / top_unit)
    rest = rest - hi * top_unit
    limbs = [hi]
    for i in range(LIMBS - 2, -1, -1):
        unit = 2.0 ** (LIMB_BITS * i + _LOW)
        digit = torch.floor(rest / unit) if i else torch.round(rest / unit)
        rest = rest - digit * unit
        limbs.append(digit)
    limbs.reverse()          # limb 0 (lowest) first
    out = torch.stack(limbs, dim=-1).to(torch.int64) * sign.unsqueeze(-1)
    return normalize(out)


def normalize(limbs: torch.Tensor) -> torch.Tensor:
    """Carry so every limb but the top one is in [0, 2**32); in place, returned."""
    for i in range(LIMBS - 1):
        carry = limbs[..., i] >> LIMB_BITS          # arithmetic shift: floor division
        limbs[..., i] -= carry << LIMB_BITS
        limbs[..., i + 1] += carry
    return limbs


def from_limbs(limbs: torch.Tensor) -> torch.Tensor:
    """int64 limbs (..., 4) -> float64 (...), rounded once."""
    out = torch.zeros(limbs.shape[:-1], dtype=torch.float64, device=limbs.device)
    for i in range(LIMBS - 1, -1, -1):
        out = out + limbs[..., i].to(torch.float64) * 2.0 ** (LIMB_BITS * i + _LOW)
    return out


# --- hashing -------------------------------------------------------------------------------

_M1 = -4658895280553007687      # 0xBF58476D1CE4E5B9 as int64
_M2 = -7723592293110705685      # 0x94D049BB133111EB as int64
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 bit patterns (wrapping arithmetic)."""
    x = x.to(torch.int64)
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def combine(*parts: torch.Tensor | int) -> torch.Tensor:
    """A 64-bit hash of several int64 values (broadcast)."""
    h = None
    for p in parts:
        p = torch.as_tensor(p, dtype=torch.int64)
        h = mix64(p + _GOLDEN) if h is None else mix64(h * 31 + p + _GOLDEN)
    return h


def content_ids(x: torch.Tensor, y: torch.Tensor, valid: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Row ids from a row's content (its inputs' and target's bits), for data sets without an
    id column. Equal rows get equal ids. ``valid`` (rows,) limits each row of ``x`` to its first
    ``valid[i]`` columns (padding excluded)."""
    n = x.shape[0]
    h = torch.zeros(n, dtype=torch.int64)
    block = as_int64_words(x.reshape(n, -1))
    for j in range(block.shape[1]):
        step = mix64(h * 31 + block[:, j] + _GOLDEN)
        h = step if valid is None else torch.where(valid > j, step, h)
    block = as_int64_words(y.reshape(n, -1))
    for j in range(block.shape[1]):
        h = mix64(h * 31 + block[:, j] + _GOLDEN)
    return h


def as_int64_words(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.to(torch.float64).view(torch.int64)
    return t.to(torch.int64)


def buckets_of(row_ids: torch.Tensor, seed: int, k: int) -> torch.Tensor:
    """The bucket of each row: a hash of (seed, row id) modulo k."""
    if k == 1:
        return torch.zeros(row_ids.shape[0], dtype=torch.int64)
    h = combine(seed, row_ids)
    return _shr(h, 1) % k


@functools.cache
def _poisson_cdf() -> torch.Tensor:
    """Poisson(1) inverse CDF on a 53-bit uniform: thresholds P(X <= j)."""
    return torch.tensor([sum(math.exp(-1) / math.factorial(i) for i in range(j + 1))
                         for j in range(20)], dtype=torch.float64)


@functools.lru_cache(maxsize=4)
def poisson_weights(seed: int, buckets: int, replicates: int) -> torch.Tensor:
    """(replicates, buckets) int64 Poisson(1) weights from a hash of (seed, bucket, replicate).
    Cached: the same for every checkpoint of a run (callers must not modify it)."""
    b = torch.arange(replicates, dtype=torch.int64).view(-1, 1)
    k = torch.arange(buckets, dtype=torch.int64).view(1, -1)
    h = combine(seed, 0x5EED, b, k)
    u = _shr(h, 11).to(torch.float64) / float(1 << 53)
    return torch.bucketize(u, _poisson_cdf(), right=True).to(torch.int64)


def weighted_sum(weights: torch.Tensor, bucket_states: torch.Tensor) -> torch.Tensor:
    """sum_k weights[b, k] * bucket_states[k, ...] exactly, for int64 states (counts or limbs).

    Runs as float64 matrix products on 21-bit slices of the states: every partial sum stays an
    integer below 2**53, so the result is exact and does not depend on BLAS's order."""
    flat = bucket_states.reshape(bucket_states.shape[0], -1)
    w = weights.to(torch.float64)
    k = flat.shape[0]
    max_w = int(weights.max()) if weights.numel() else 0
    slice_bits = max(1, min(21, 52 - math.ceil(math.log2(max(1, k * max(1, max_w)))) - 1))
    out = torch.zeros((weights.shape[0], flat.shape[1]), dtype=torch.int64)
    negative = flat < 0
    mag = flat.abs()
    shift = 0
    while bool((mag >> shift).any()) if shift < 63 else False:
        piece = ((mag >> shift) & ((1 << slice_bits) - 1)).to(torch.float64)
        piece = torch.where(negative, -piece, piece)
        out += (w @ piece).round().to(torch.int64) << shift
        shift += slice_bits
    return out.reshape((weights.shape[0],) + tuple(bucket_states.shape[1:]))


def percentile_interval(samples: torch.Tensor, confidence: float) -> tuple[float, float]:
    """The percentile bootstrap interval of replicate values (NaNs dropped)."""
    s = samples[~torch.isnan(samples)]
    if s.numel() == 0:
        return float("nan"), float("nan")
    alpha = (1.0 - confidence) / 2
    lo, hi = torch.quantile(s.to(torch.float64), torch.tensor([alpha, 1 - alpha],
                                                              dtype=torch.float64))
    return float(lo), float(hi)


def combined_intervals(replicates: np.ndarray, weights: np.ndarray, divisor: float,
                       confidence: float) -> tuple[np.ndarray, list[float], list[float]]:
    """``combined_interval`` for C combinations at once (``replicates``: C x parts x B,
    ``weights``: C x parts): bit for bit the same numbers (checked on random inputs: torch
    sums a batch's middle dimension as it sums a single one's first), in one call instead of C
    (a 1,000-checkpoint board: ~1 s of per-call overhead)."""
    combined = (torch.as_tensor(replicates) * torch.as_tensor(weights).unsqueeze(2)) \
        .sum(dim=1) / divisor
    alpha = (1.0 - confidence) / 2
    q = torch.tensor([alpha, 1 - alpha], dtype=torch.float64)
    nan = torch.isnan(combined).any(dim=1)
    bounds = torch.quantile(combined, q, dim=1) if combined.shape[0] else torch.empty(2, 0)
    lows, highs = bounds[0].tolist(), bounds[1].tolist()
    for i in torch.nonzero(nan).flatten().tolist():     # NaNs dropped: one at a time
        lows[i], highs[i] = percentile_interval(combined[i], confidence)
    return combined.numpy(), lows, highs


def combined_intervals_by_shape(items: list, batch: int = 128) -> list:
    """``combined_intervals`` over many combinations of any shapes: ``items`` are
    (replicates: parts x B, weights, confidence); returns (combined, low, high) per item, in
    order. Items of one shape and confidence go together, a batch of rows at a time (128 rows
    of 100 parts x 1,000 replicates is ~100 MB)."""
    shapes: dict[tuple, list[int]] = {}
    for i, (reps, _, confidence) in enumerate(items):
        shapes.setdefault((len(reps), len(reps[0]), confidence), []).append(i)
    out: list = [None] * len(items)
    for (n, _, confidence), members in shapes.items():
        for start in range(0, len(members), batch):
            chunk = members[start:start + batch]
            reps = np.stack([np.asarray(items[i][0], dtype=np.float64) for i in chunk])
            weights = np.asarray([items[i][1] for i in chunk], dtype=np.float64)
            combined, lows, highs = combined_intervals(reps, weights, n, confidence)
            for i, c, lo, hi in zip(chunk, combined, lows, highs):
                out[i] = (c, lo, hi)
    return out


def combined_interval(replicates: list[list[float]], weights: list[float], divisor: float,
                      confidence: float) -> tuple[list[float], float, float]:
    """Replicate b of the combination sum_i weights[i] * metric_i / divisor, from each metric's
    replicate b, and their percentile interval (the suite aggregate and an lm-eval group
    combine their parts' stored replicates so: see ``ranking.aggregate.aggregate_row``)."""
    combined = (torch.as_tensor(np.asarray(replicates, dtype=np.float64))
                * torch.tensor(weights, dtype=torch.float64).unsqueeze(1)).sum(dim=0) / divisor
    low, high = percentile_interval(combined, confidence)
    return combined.tolist(), low, high
