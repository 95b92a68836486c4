"""Reading per-item records back: a cell's items (``rayeval samples``, ``rayeval.samples``) and
the items two checkpoints disagree on (``rayeval compare --items``).

A published cell's rows name the tag of its record files (the store's ``samples`` column);
every worker wrote its own items under that tag (``ResultStore.write_samples``), so the set is
read whole or not at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from rayeval.errors import StoreError
from rayeval.io import paths
from rayeval.ranking import find_checkpoint
from rayeval.io.store import ResultStore, newest

# Record columns that are not metric values (core.samples.COLUMNS, and the id)
RECORD_COLUMNS = ("id", "row", "context", "choices", "target", "response", "responses",
                  "loglikelihoods", "tokens", "probability", "images", "thumbnails",
                  # a judged item's (docs/judges.md): its score is the ``judge`` column
                  "judge_prompt", "judge_output", "judge_failed", "baseline_response",
                  "judge_prompt_swapped", "judge_output_swapped")


# What a cell without records was evaluated with, and the fix: one clause for every message.
HOW_TO_KEEP = ("text and classification evaluations store them unless evaluated with samples: "
               "false (regression and language modeling keep none, nor do cells stored before "
               "their task stored records); to get them, evaluate again with samples on and "
               "--force")


def _evaluations(rows: list[dict]) -> str:
    return ", ".join(dict.fromkeys(r["evaluation"] for r in rows))


def evaluations_with_samples(rows: list[dict]) -> list[str]:
    """The evaluations of one checkpoint's rows whose cells stored per-item records."""
    return list(dict.fromkeys(r["evaluation"] for r in rows if r.get("samples")))


def read_cell_samples(store: str, rows: list[dict], evaluation: str | None,
                      what: str = "--eval") -> tuple[str, pa.Table]:
    """(evaluation, records) of one checkpoint's rows (``find_checkpoint``'s) on one
    evaluation (the only one with records when None), in item order (``in_item_order``)."""
    kept = evaluations_with_samples(rows)
    if evaluation is None:
        if not kept:
            raise StoreError(f"{rows[0]['checkpoint']} stored no per-item records on any of its "
                             f"evaluations ({_evaluations(rows)}); {HOW_TO_KEEP}")
        if len(kept) != 1:
            raise StoreError(f"{what}: name the evaluation; {rows[0]['checkpoint']} has per-item "
                             f"records for {', '.join(kept)}")
        evaluation = kept[0]
    mine = [r for r in rows if r["evaluation"] == evaluation]
    if not mine:
        raise StoreError(f"{what}: no evaluation {evaluation!r} for {rows[0]['checkpoint']} "
                         f"(it has {_evaluations(rows)})")
    row = mine[0]
    if not row.get("samples"):
        raise StoreError(f"{what}: {row['checkpoint']} on {evaluation} stored no per-item records; "
                         f"{HOW_TO_KEEP}")
    table = ResultStore(paths.resolve(os.fspath(store), os.getcwd())).read_samples(
        row["cell"], row["samples"])
    return evaluation, in_item_order(table)


def in_item_order(table: pa.Table) -> pa.Table:
    """Records in their data's order: by ``row`` (the item's position, where its data has no
    id column), else by ``id``."""
    for by in ("row", "id"):
        if by in table.column_names and table.num_rows:
            return table.sort_by(by)
    return table


def checkpoint_rows(store: str | os.PathLike, checkpoint: str, sweep: str | None,
                    what: str = "--checkpoint") -> list[dict]:
    """The newest stored rows of the one checkpoint a user named (no wide columns)."""
    table = newest(store, sweep=sweep, what="STORE")
    columns = ["sweep", "checkpoint", "step", "evaluation", "metric", "value", "cell", "samples"]
    return find_checkpoint(table.select(columns).to_pylist(), checkpoint, what)


def metric_columns(table: pa.Table) -> list[str]:
    return [c for c in table.column_names if c not in RECORD_COLUMNS]


@dataclass
class ItemDifference:
    """The items of one evaluation that one checkpoint gets right and the other wrong."""
    evaluation: str
    metric: str
    a_only: pa.Table        # right in A, wrong in B: id, context, target, A's and B's response
    b_only: pa.Table
    items: int              # items in both


def right_or_wrong_metric(table: pa.Table, metric: str | None, evaluation: str) -> str:
    """The per-item metric that says right (1) or wrong (0): ``metric``, else the first."""
    names = [m for m in metric_columns(table)
             if table.num_rows == 0 or pc.all(pc.is_in(table[m], pa.array([0.0, 1.0]))).as_py()]
    if metric is not None:
        bare = metric.split("/", 1)[1] if metric.startswith(f"{evaluation}/") else metric
        if bare not in names:
            raise StoreError(f"--metric: {metric!r} is no right-or-wrong metric of "
                             f"{evaluation}'s items; choose one of: {', '.join(names) or 'none'}")
        return bare
    if not names:
        raise StoreError(f"--items: {evaluation}'s items have no right-or-wrong metric "
                         f"(they have {', '.join(metric_columns(table)) or 'none'})")
    return names[0]


def item_differences(a: pa.Table, b: pa.Table, evaluation: str,
                     metric: str | None = None) -> ItemDifference:
    """Join A's and B's records of one evaluation on the item id."""
    name = right_or_wrong_metric(a, metric, evaluation)
    keep = ["id", "context", "target", "response", name]
    left = a.select(keep).rename_columns(["id", "context", "target", "a_response", "a"])
    right = b.select(["id", "response", name]).rename_columns(["id", "b_response", "b"])
    both = left.join(right, "id", join_type="inner").sort_by("id")
    shown = ["id", "context", "target", "a_response", "b_response"]
    a_only = both.filter(pc.and_(pc.equal(both["a"], 1.0), pc.equal(both["b"], 0.0)))
    b_only = both.filter(pc.and_(pc.equal(both["a"], 0.0), pc.equal(both["b"], 1.0)))
    return ItemDifference(evaluation, name, a_only.select(shown), b_only.select(shown),
                          both.num_rows)


# --- a judge whose verdicts could not be read -----------------------------------------------

JUDGE_FAILED_SHARE = 0.5       # above this share of an evaluation's judged items: a warning


def judge_warnings(sweep, rows: list[dict], location: str) -> list[str]:
    """One line per judged evaluation of ``sweep`` whose judge gave no readable verdict for
    more than half of the items judged in ``rows`` (a run's own cells): how many, the
    verdict rule, and one judge text that missed it (from the first such cell's records). A
    verdict rule that never matches gave exit 0 and a blank ``judge`` column before, with
    nothing to say why (issue 56)."""
    rules = {e.name: e.judge.verdict for e in sweep.evals
             if e.judge is not None and e.judge.verdict}
    lines = []
    for name, verdict in rules.items():
        failed = [r for r in rows if r["evaluation"] == name and r["metric"] == "judge_failed"
                  and r.get("value") is not None]
        missed = sum(int(r["value"]) for r in failed)
        judged = sum(int(r["num_samples"] or 0) for r in failed)
        if not judged or missed <= JUDGE_FAILED_SHARE * judged:
            continue
        rule = (f"the pattern {verdict['pattern']!r}'s group" if set(verdict) == {"pattern"}
                else "the first of the words " + ", ".join(repr(str(w)) for w in verdict)
                + " (any case, whole word)")
        said = _a_missed_verdict(location, [r for r in failed if r["value"]])
        lines.append(f"warning: {name}: the judge's verdict could not be read in {missed:,} of "
                     f"{judged:,} items, which count in neither judge nor its interval; the "
                     f"rule: {rule}" + (f"; one judge text: {said!r}" if said else "")
                     + " (docs/judges.md: the verdict)")
    return lines


def _a_missed_verdict(location: str, rows: list[dict]) -> str | None:
    """The first judge text without a readable verdict in the records of ``rows``' cells,
    cut to 160 characters; None when none kept one."""
    for r in rows:
        if not r.get("samples"):
            continue
        try:
            table = ResultStore(location).read_samples(r["cell"], r["samples"])
        except StoreError:
            continue
        if "judge_output" not in table.column_names or "judge_failed" not in table.column_names:
            continue
        for text, why in zip(table["judge_output"].to_pylist(),
                             table["judge_failed"].to_pylist()):
            if why and text:
                return text if len(text) <= 160 else text[:157] + "..."
    return None
