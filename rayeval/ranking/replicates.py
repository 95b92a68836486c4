"""What a row's bootstrap replicates say, many rows at a time: the replicates of a row, whether
two rows' replicates resample the same rows (so that they pair), and percentile intervals.

Replicate b of an evaluation is one resample of its rows, the same for every checkpoint (the
Poisson weights come from a hash of the seed, the row id and b): two checkpoints' replicates
of one evaluation pair (``compare``), and a checkpoint's replicates of several evaluations
combine (``aggregate``, ``win_rate``). In numpy: a board needs no torch.
"""

from __future__ import annotations

import numpy as np

from rayeval.io.store import bootstrap_params


def replicates_of(row: dict) -> list | object:
    """A row's replicates (a list, or a float64 array read from a store), [] when none."""
    reps = row.get("replicates")
    return [] if reps is None else reps


def same_resamples(a: dict, b: dict) -> bool:
    """Whether two stored rows' replicate b resample the same rows: same data, seed and
    buckets (their replicates need not be read to know)."""
    return resample_key(a) == resample_key(b)


def resample_key(row: dict) -> tuple:
    """What a row's replicates resample: its bootstrap's settings but the confidence, its
    evaluation and its row count."""
    params = bootstrap_params(row.get("bootstrap"))
    params.pop("confidence", None)
    return tuple(sorted(params.items())), row["evaluation"], row["num_samples"]


def percentiles(samples, confidence: float) -> tuple[np.ndarray, np.ndarray]:
    """Each row's percentile bootstrap interval (``samples``: rows x replicates), the same bits
    as ``stats.percentile_interval`` gives row by row: NaNs dropped, torch.quantile's linear
    interpolation at (1 - confidence) / 2 and its complement (rank q * (n - 1), torch's lerp,
    whose fused multiply-add a long double stands in for: 1 of 5,000 random rows differed in
    the last bit, where it rounds twice; numpy's own quantile, ranking at n * q - q, differed
    in 143); NaN where a row has no number. In numpy, rows at once: boards, marks and paired
    differences need no torch (importing it took 7 s of a 14 s board at load 10) and no call
    per pair."""
    x = np.sort(np.asarray(samples, dtype=np.float64).reshape(len(samples), -1), axis=1)
    count = x.shape[1] - np.isnan(x).sum(axis=1)       # NaNs sort last
    rows = np.arange(len(x))
    alpha = (1.0 - confidence) / 2
    found = []
    for q in (alpha, 1 - alpha):
        rank = q * (count - 1).astype(np.float64)
        below = np.maximum(rank.astype(np.int64), 0)
        above = np.maximum(np.ceil(rank).astype(np.int64), 0)
        weight = rank - below
        lo, hi = x[rows, below], x[rows, above]
        with np.errstate(invalid="ignore"):
            step = (hi - lo).astype(np.longdouble)       # in doubles, as torch's lerp
            value = np.where(np.abs(weight) < 0.5, lo + weight * step,
                             hi - step * (1 - weight)).astype(np.float64)
        value[count == 0] = np.nan
        found.append(value)
    return found[0], found[1]


def percentile_pairs(samples: np.ndarray, confidence: float) -> list[tuple[float, float]]:
    """``percentiles`` as (low, high) per row."""
    lo, hi = percentiles(samples, confidence)
    return list(zip(lo.tolist(), hi.tolist()))
