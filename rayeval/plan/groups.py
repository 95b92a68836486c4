"""lm-eval groups' aggregates, stored as cells of their own.

A group (``mmlu``) is evaluated as its tasks (the evaluations ``NAME/TASK``); its aggregate, the
evaluation ``NAME``, is computed from their stored rows as lm-eval computes it
(``aggregate_subtask_metrics``): the mean of the members' values, each weighted by its number
of documents when ``weight_by_size`` (lm-eval's default), else equally. Over the leaf tasks,
so a subgroup's aggregate (``NAME/SUB``) is not an input of its parent's, as in lm-eval.

The interval combines replicate b of every member the same way and takes the percentile
interval of those combinations: replicate b of each member is a bootstrap resample of its own
documents (see ``boards.aggregate_row`` for why that is sound), so the combination is a draw
from the bootstrap distribution of the aggregate, and it pairs across checkpoints like any
stored metric. An aggregate is written once every member of its checkpoint is stored; its cell
is keyed by the members' cells, so a member evaluated again gives a new aggregate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import TYPE_CHECKING

from rayeval.config.schema import GroupSpec
from rayeval.io.store import ResultStore, confidence_of

if TYPE_CHECKING:      # the plan layer stands on this one (its cells are the store's)
    from rayeval.plan.cells import Plan


def group_rows(group: GroupSpec, stored: dict[str, dict[str, dict]]) -> list[dict] | None:
    """The aggregate's rows for one checkpoint, from its members' stored rows
    (``stored[evaluation][metric]``); None until every member's row is there."""
    out = []
    for gm in group.metrics:
        parts = [stored.get(e, {}).get(k) for e, k in gm.parts]
        if any(p is None for p in parts):
            return None
        weights = [float(p["num_samples"]) if gm.weight_by_size else 1.0 for p in parts]
        values = [math.nan if p["value"] is None else float(p["value"]) for p in parts]
        total = sum(weights)
        row = {k: parts[0].get(k) for k in ("sweep", "checkpoint", "step", "epoch")}
        row.update(evaluation=group.name, metric=gm.key, num_tokens=None, matrix=None,
                   value=sum(w * v for w, v in zip(weights, values)) / total,
                   ci_low=None, ci_high=None, replicates=None, samples=None,
                   num_samples=sum(int(p["num_samples"]) for p in parts),
                   # members scored on a limit: the group's items of all of theirs
                   limited_from=sum(int(p.get("limited_from") or p["num_samples"])
                                    for p in parts)
                   if any(p.get("limited_from") is not None for p in parts) else None,
                   world_size=max(int(p["world_size"]) for p in parts),
                   higher_is_better=gm.higher_is_better,
                   bootstrap=parts[0].get("bootstrap")
                   if len({p.get("bootstrap") for p in parts}) == 1 else None)
        reps = [p.get("replicates") or [] for p in parts]
        if reps[0] and len({len(r) for r in reps}) == 1 and row["bootstrap"]:
            from rayeval.core.stats import combined_interval   # torch: only with intervals

            row["replicates"], row["ci_low"], row["ci_high"] = combined_interval(
                reps, weights, total, confidence_of(parts[0]))
        out.append(row)
    return out


def group_cell_key(group: GroupSpec, member_cells: list[str]) -> str:
    spec = dataclasses.asdict(group)
    spec.pop("key_path")
    blob = json.dumps([spec, sorted(member_cells)], sort_keys=True)
    return "group-" + hashlib.sha256(blob.encode("utf-8")).hexdigest()[:32]


def publish(plan: Plan, store: ResultStore | None = None,
            written_keys: list[str] | None = None) -> int:
    """Write the aggregate of every group and checkpoint of the plan whose members are all
    stored and that is not stored yet; returns how many cells were written. Reads only those
    members' cells, never the whole store: the aggregate's key comes from its members' keys,
    which the plan knows (evaluated in this run or already stored)."""
    sweep = plan.sweep
    if not sweep.groups:
        return 0
    store = store or ResultStore(sweep.output)
    by_checkpoint: dict[str, dict[str, str]] = {}       # checkpoint -> evaluation -> cell key
    for c in (*plan.cached, *plan.cells):
        by_checkpoint.setdefault(c.checkpoint.location, {})[c.evaluation] = c.key
    written = 0
    for cells in by_checkpoint.values():
        for group in sweep.groups:
            members = sorted({e for gm in group.metrics for e, _ in gm.parts})
            if any(e not in cells for e in members):
                continue
            key = group_cell_key(group, sorted({cells[e] for e in members}))
            if store.has(key, sweep.name) or \
                    not all(store.has(cells[e], sweep.name) for e in members):
                continue                # stored already, or a member failed
            stored = {e: {r["metric"]: r for r in store.read_cell(cells[e], sweep=sweep.name)}
                      for e in members}
            rows = group_rows(group, stored)
            if rows is not None:
                store.write_cell(key, rows)
                written += 1
                if written_keys is not None:
                    written_keys.append(key)
    return written
