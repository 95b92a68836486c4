"""What a board ranks, decided once: an evaluation's headline metric, which rows a board shows
of an lm-eval group, and which way a metric points.

Every reader of results calls these: the board and its aggregate (``ranking.board``,
``ranking.aggregate``), the suite files written beside a store's parts (``ranking.suite``),
the replicates a board reads (``ranking.stored``), racing (``execution.workers.race``) and the sweep's
pre-flight checks (``plan.validation``).

The headline rule. An evaluation's *headline metric* is the one its suite aggregate averages
and a race on ``aggregate`` races: its first metric in the sweep's order. A cell stores its rows
in that order, so in a store the headline is the metric a cell of the evaluation starts with;
when cells disagree (a sweep whose metric list changed, an older cell), the metric most cells
start with wins, ties going to the first seen, so that one odd cell does not move it. A sweep
has one front door (``sweep_headline``), stored rows another (``stored_headlines``); both say
the same of one sweep's cells.

The group-member rule is ``config.names.members`` (the sweep's schema needs it below this
floor); the sign of a lower-is-better metric is ``io.store.direction`` (racing's statistics
need it below this floor); both are named here too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rayeval.config.names import group_of, members
from rayeval.io.store import direction

__all__ = ["AGGREGATE", "direction", "members", "sweep_headline", "stored_headlines", "shown",
           "codes", "shared_evaluations"]

# The metric name of a board's suite aggregate row (evaluation "*"): the aggregate's own module
# and the board's columns both name it, so it lives below them.
AGGREGATE = "aggregate"


def sweep_headline(metrics: Sequence[str]) -> str:
    """The headline of an evaluation of a sweep: its first metric (its key, in the sweep's
    order)."""
    return metrics[0]


def stored_headlines(sweeps, checkpoints, evaluations, metrics) -> dict[str, str]:
    """Each evaluation's headline metric from stored rows (columns in store order, ranked rows
    only: no confusion matrix): the metric that most (sweep, checkpoint, evaluation) keys'
    first row holds, ties to the first seen. Columns: pyarrow arrays or lists of strings."""
    if len(evaluations) == 0:
        return {}
    _, heads = np.unique(codes(sweeps, checkpoints, evaluations), return_index=True)
    heads = pa.array(np.sort(heads))                # the keys' first rows, in store order
    votes: dict[str, dict[str, int]] = {}
    for e, m in zip(_strings(evaluations).take(heads).to_pylist(),
                    _strings(metrics).take(heads).to_pylist()):
        own = votes.setdefault(e, {})
        own[m] = own.get(m, 0) + 1
    return {e: max(own, key=own.get) for e, own in votes.items()}   # max: the first of ties


def shared_evaluations(sweeps, evaluations) -> list[str]:
    """The evaluations every sweep of these rows holds (columns: pyarrow arrays or lists of
    strings): what a suite aggregate may average (``aggregate.suite_parts``), and whether a
    board has an aggregate column (``columns.columns_of``)."""
    if not len(evaluations):
        return []
    pairs = pc.unique(pc.binary_join_element_wise(_strings(sweeps), _strings(evaluations), "\x1f"))
    held: dict[str, set[str]] = {}
    for pair in pairs.to_pylist():
        sweep, _, name = pair.partition("\x1f")
        held.setdefault(sweep, set()).add(name)
    return sorted(set.intersection(*held.values()))


def shown(sweeps, checkpoints, evaluations) -> list[bool]:
    """Which rows a board shows by default: all but an lm-eval group's members (``NAME/TASK``)
    where the same (sweep, checkpoint) holds the group's own aggregate (``NAME``)."""
    evaluations = _strings(evaluations).to_pylist()
    if not members(evaluations):
        return [True] * len(evaluations)
    sweeps, checkpoints = _strings(sweeps).to_pylist(), _strings(checkpoints).to_pylist()
    held = set(zip(sweeps, checkpoints, evaluations))
    return [(s, c, group_of(e)) not in held for s, c, e in zip(sweeps, checkpoints, evaluations)]


def codes(*columns) -> np.ndarray:
    """Keys of the rows' values in these columns, numbered in order of first appearance."""
    columns = [_strings(c) for c in columns]
    joined = columns[0] if len(columns) == 1 else \
        pc.binary_join_element_wise(*columns, "\x1f")
    encoded = pc.dictionary_encode(joined)
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.combine_chunks()
    return encoded.indices.to_numpy(zero_copy_only=False)


def _strings(column) -> pa.Array | pa.ChunkedArray:
    if isinstance(column, (pa.Array, pa.ChunkedArray)):
        return column
    return pa.array(list(column), pa.string())
