"""The mean win rate, the board's default aggregate (``aggregate``: the rows it starts from):
per evaluation, each checkpoint's share of the board's other checkpoints it beats, and the same
on every bootstrap replicate for its interval.

Measured on a 100,000-cell store (100 evaluations x 1,000 checkpoints x 1,000 replicates, 2
cores): the shares on the replicates take ~3 s of the board's ~9 s, 10^8 values sorted
(docs/benchmarks.md, "Boards without a call per pair").
"""

from __future__ import annotations

import math
import os
from typing import Callable

import numpy as np

from rayeval.config.run_schema import WIN_RATE
from rayeval.ranking.replicates import percentile_pairs, replicates_of, resample_key
from rayeval.ranking.rules import direction


def win_shares(values) -> np.ndarray:
    """Each checkpoint's share of the others it beats, along axis 0 of ``values`` (checkpoints
    x anything: one column per bootstrap replicate), values direction-adjusted (higher is
    better): ``(#lower + (#equal - 1) / 2) / (n - 1)`` among the n non-NaN values of its
    column; NaN where its value is NaN or the column holds fewer than two.

    Counted from each column sorted once (O(n log n), not the n x n comparisons): in sorted
    order a run of equal values starts at the count of lower ones and ends before the count of
    lower-or-equal ones. The columns are sorted as rows of the transposed matrix (contiguous
    in memory): 45 ms against 56 ms for 1,000 x 1,000 (the sort itself 21 ms)."""
    x = np.asarray(values, dtype=np.float64)
    flat = x.ndim == 1
    x = x.reshape(len(x), -1)
    n = x.shape[0]
    if n == 0:
        return x.reshape(-1) if flat else x
    t = np.ascontiguousarray(x.T)                         # one row per column of ``values``
    order = np.argsort(t, axis=1)                         # NaNs last
    s = np.take_along_axis(t, order, axis=1)
    at = np.arange(n)
    changes = np.empty(s.shape, dtype=bool)
    changes[:, 0] = True
    np.not_equal(s[:, 1:], s[:, :-1], out=changes[:, 1:])  # NaN != NaN: each a run of its own
    lower = np.maximum.accumulate(np.where(changes, at, 0), axis=1)
    ends = np.empty(s.shape, dtype=bool)
    ends[:, -1] = True
    ends[:, :-1] = changes[:, 1:]
    upto = np.minimum.accumulate(np.where(ends, at + 1, n)[:, ::-1], axis=1)[:, ::-1]
    missing = np.isnan(t)
    counted = n - missing.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        shares = (lower + 0.5 * (upto - lower - 1)) / (counted[:, None] - 1.0)
    out = np.empty_like(t)
    np.put_along_axis(out, order, shares, axis=1)
    out[missing | (counted < 2)[:, None]] = np.nan
    return out.reshape(-1) if flat else out.T


def win_rates(rows: list[dict], reps_of: Callable[[dict], object] = None) -> None:
    """Turn the mean aggregate rows of one board (``aggregate_row``: one per checkpoint, the
    same evaluations) into mean win rates, in place: per evaluation, each checkpoint's share
    of the board's other checkpoints that hold the evaluation's headline and that it beats
    (``win_shares``), averaged over the evaluations where it has another to beat; missing where
    a part is missing, as for the mean. The interval: the same computed on each replicate b
    (``reps_of(part)``: its replicates, default its own), and the percentile interval of those
    means taken as a mean's is (``percentile_pairs``); none unless every checkpoint of every
    evaluation averaged holds replicates of the same resamples.

    One evaluation at a time, summing each checkpoint's shares per replicate: memory of
    checkpoints x replicates, not x evaluations. Fewer than two checkpoints: nothing to beat;
    the rows keep their plain mean."""
    if len(rows) < 2:
        return
    reps_of = reps_of or replicates_of
    n, count = len(rows), len(rows[0]["evaluations"])
    complete = np.array([all(p is not None for p in r["parts"]) for r in rows])
    total, counted = np.zeros(n), np.zeros(n, dtype=np.int64)
    scored = []                 # (parts, values, own) of each evaluation with one to beat
    for k in range(count):
        parts = [r["parts"][k] for r in rows]
        values = [math.nan if p is None or p["value"] is None else
                  direction(p["higher_is_better"]) * p["value"] for p in parts]
        shares = win_shares(values)
        own = complete & ~np.isnan(shares)      # an evaluation where it has another to beat
        total[own] += shares[own]
        counted += own
        if own.any():
            scored.append((parts, values, own))
    summed: np.ndarray | None = None        # checkpoints x B: the shares per replicate, summed
    paired = True
    found = _in_order(lambda job: _replicate_shares(job[0], job[1], reps_of), scored)
    for (_, _, own), replicated in zip(scored, found):
        if replicated is None or (summed is not None and summed.shape[1] !=
                                  replicated.shape[1]):
            paired, summed = False, None
            break
        summed = np.zeros_like(replicated) if summed is None else summed
        # in the evaluations' order (the same bits), in place: a masked copy of
        # checkpoints x replicates per evaluation took ~3 of a 100,000-cell board's seconds
        np.add(summed, replicated, out=summed, where=own[:, None])
    found.close()
    with np.errstate(invalid="ignore", divide="ignore"):
        means = None if not paired or summed is None else summed / counted[:, None]
    bounds = None if means is None else percentile_pairs(means, rows[0]["confidence"])
    for i, row in enumerate(rows):
        row.update(aggregate=WIN_RATE, value=math.nan, ci_low=None, ci_high=None,
                   replicates=None)
        if not complete[i] or not counted[i]:
            continue
        row["value"] = float(total[i] / counted[i])
        if bounds is not None:
            row["replicates"] = means[i].tolist()
            row["ci_low"], row["ci_high"] = bounds[i]


# Threads for the evaluations' replicate shares: numpy's sort and indexing release the GIL. A
# 100,000-cell board (100 evaluations x 1,000 checkpoints x 1,000 replicates) spends most of
# its win rate there; each evaluation in flight holds ~5 matrices of checkpoints x replicates.
SHARE_THREADS = 4


def _in_order(fn, jobs: list):
    """``fn`` of each job on up to SHARE_THREADS threads, yielded in the jobs' order, at most a
    thread's worth ahead of the consumer; closing the generator cancels what is left."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    workers = max(1, min(SHARE_THREADS, os.cpu_count() or 1, len(jobs)))
    if workers == 1:
        yield from map(fn, jobs)
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="rayeval-shares")
    try:
        pending = deque()
        for job in jobs:
            pending.append(pool.submit(fn, job))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _replicate_shares(parts: list[dict | None], values: list[float], reps_of
                      ) -> np.ndarray | None:
    """``win_shares`` of one evaluation on each replicate (checkpoints x B), or None when its
    checkpoints' replicates are missing, of different counts or of other resamples."""
    held = [i for i, v in enumerate(values) if not math.isnan(v)]
    if len(held) < 2:
        return None
    reps = [reps_of(parts[i]) for i in held]
    if any(r is None or not len(r) for r in reps) or len({len(r) for r in reps}) > 1 or \
            len({resample_key(parts[i]) for i in held}) > 1:
        return None
    matrix = np.full((len(parts), len(reps[0])), np.nan)
    for i, r in zip(held, reps):
        matrix[i] = direction(parts[i]["higher_is_better"]) * np.asarray(r, dtype=np.float64)
    return win_shares(matrix)
