"""Tier 1: ``leaderboard --format json`` (the one board, on columns, the aggregate's intervals
from the parts' suite files) writes the text that the rows in hand give row by row (every
row's own replicates, ``results.aggregates``, ``render.to_json``) — on stores with lm-eval
groups, confusion matrices, missing numbers, checkpoints lacking an evaluation, replicate
counts that differ, cells written again."""

import math
import os
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

from rayeval.io.store import ResultStore
from rayeval.io.store.layout import SUITE, list_suites
from rayeval.reporting.render import to_json
from rayeval.ranking import (AGGREGATE, aggregates, columns_of, resolve_metric,
                             stored_aggregates, without_members)
from rayeval.ranking.aggregate import _suites
from rayeval.ranking.board import without_members_table
from rayeval.ranking.stored import stored_rows
from rayeval.ranking.suite import summaries
from rayeval.ui import cli, commands_store

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
EVALUATIONS = ("ood", "val", "grp", "grp/t1", "grp/t2")


def cell(sweep, checkpoint, dataset, step, value, seed, reps=16, stamp=None):
    rng = np.random.default_rng(seed)
    rows = []
    for m, k, higher in (("accuracy", 1.0, True), ("nll", 2.0, False)):
        r = rng.normal(value * k, 0.05, reps).tolist()
        rows.append({"sweep": sweep, "checkpoint": checkpoint, "step": step,
                     "evaluation": dataset, "metric": m, "value": value * k,
                     "ci_low": value * k - 0.01, "ci_high": value * k + 0.01,
                     "num_samples": 40 + seed % 7, "world_size": 1, "higher_is_better": higher,
                     "replicates": r, "bootstrap": f"seed=0;buckets=64;replicates={reps};"
                                                   "confidence=0.95",
                     "created_at": stamp or T0 + timedelta(seconds=seed, microseconds=seed % 2)})
    return rows


def build(root):
    """Two sweeps; an lm-eval group with members; a confusion matrix; a NaN figure and an
    infinite bound; a checkpoint without one evaluation; one cell with other replicate
    counts; a non-ASCII location."""
    store, n = ResultStore(str(root)), 0
    for sweep in ("a", "b"):
        for step in (1, 2, 3):
            ck = f"/ck/{sweep}/step_{step}" + ("-é" if step == 3 else "")
            for d in EVALUATIONS:
                if (sweep, step, d) == ("b", 2, "val"):
                    continue                                  # lacks an evaluation
                n += 1
                rows = cell(sweep, ck, d, step, 0.1 * step + 0.01 * n, seed=n,
                            reps=8 if (sweep, step, d) == ("a", 3, "ood") else 16)
                if n == 4:
                    rows[1]["value"] = math.nan
                if n == 5:
                    rows[0]["ci_high"] = math.inf
                if d == "ood":                        # a lower-is-better headline
                    rows.reverse()
                if d == "val":
                    rows.append({**rows[0], "metric": "confusion_matrix", "value": None,
                                 "ci_low": None, "ci_high": None, "replicates": None,
                                 "matrix": [[n, 1], [2, 3]]})
                store.write_cell(f"{sweep}{step}{d.replace('/', '_')}", rows)
    return store


FLAGS = [(), ("--members",), ("--sweep", "b"), ("--dataset", "ood"), ("--metric", "ood/nll"),
         ("--metric", "aggregate"), ("--metric", "confusion_matrix"),
         ("--checkpoint", "*/step_[12]")]


def rows_in_hand(args) -> list[dict]:
    """The newest rows of the command's filters, with every row's replicates, as dicts."""
    rows = stored_rows(args.store, sweep=args.sweep or None, evaluation=args.evaluation or None,
                       checkpoint=args.checkpoint_glob)
    return rows if args.members else without_members(rows)


def json_rows(args, rows: list[dict]) -> str:
    """``--format json`` of rows in hand, row by row (the reference the board is held to)."""
    summary = aggregates(rows)
    matrices = [r for r in rows if r["metric"] == args.metric and r["matrix"]]
    if matrices:                                  # --metric confusion_matrix
        rows, summary = matrices, []
    elif args.metric and rows:
        column = resolve_metric(args.metric, columns_of(rows))
        rows = [r for r in rows
                if (r["evaluation"], r["metric"]) == (column.evaluation, column.metric)]
        summary = summary if column.name == AGGREGATE else []
    return to_json(rows, aggregates=summary)


def texts(root, flags):
    """(columnar, row by row) text of one board."""
    args = cli._parser().parse_args(["leaderboard", str(root), "--format", "json", *flags])
    columnar = "".join(commands_store._json_board(args))
    return columnar, json_rows(args, rows_in_hand(args))


@pytest.mark.parametrize("state", ["cell files", "parts with suite files",
                                   "parts without suite files", "a cell written again"])
def test_the_columnar_board_is_the_row_by_row_text(tmp_path, state):
    store = build(tmp_path)
    if state != "cell files":
        store.compact(summarize=None if state == "parts without suite files" else summaries)
    if state == "a cell written again":                # its checkpoint's suite row is stale
        store.write_cell("a2ood", cell("a", "/ck/a/step_2", "ood", 2, 0.9, seed=99,
                                       stamp=T0 + timedelta(days=1)))
    assert bool(list_suites(store.fs, store.root)) == (state in ("parts with suite files",
                                                                 "a cell written again"))
    for flags in FLAGS:
        columnar, row_by_row = texts(tmp_path, flags)
        assert columnar == row_by_row, flags
    assert '"metric": "aggregate"' in texts(tmp_path, ())[0]


def test_suite_files_hold_the_bits_the_replicates_give(tmp_path, monkeypatch):
    store = build(tmp_path)
    store.compact(summarize=summaries)
    table = without_members_table(store.read([c for c in store.read().column_names
                                              if c != "replicates"]))
    kept = _suites(store, None)
    asked = []
    read_replicates = ResultStore.replicates
    monkeypatch.setattr(ResultStore, "replicates",
                        lambda self, wanted, sweep=None: asked.append(wanted)
                        or read_replicates(self, wanted, sweep))
    from_files = stored_aggregates(table, store, how="mean")       # suite files: means
    assert asked == []                   # every complete aggregate came from a suite file
    for path in list_suites(store.fs, store.root):
        os.unlink(path)
    from_replicates = stored_aggregates(table, store, how="mean")
    assert len(asked) == 1 and len(asked[0]) == 5 * 3          # 5 complete x 3 evaluations
    with_interval = [r for r in from_files if r["ci_low"] is not None]
    assert len(kept) == 6 and len(with_interval) == 4     # b/2 lacks val; a/3: 8 vs 16
    for a, b in zip(from_files, from_replicates):
        assert (a["ci_low"], a["ci_high"]) == (b["ci_low"], b["ci_high"])
        assert (a["replicates"] is None) == (b["replicates"] is None)
        if a["replicates"] is not None:
            assert np.array_equal(np.asarray(a["replicates"]), np.asarray(b["replicates"]))


def test_merging_parts_replaces_their_suite_files(tmp_path):
    store = build(tmp_path)
    store.consolidate([f"a{s}{d.replace('/', '_')}" for s in (1, 2) for d in EVALUATIONS],
                      summarize=summaries)
    store.consolidate([f"a3{d.replace('/', '_')}" for d in EVALUATIONS], summarize=summaries)
    before = list_suites(store.fs, store.root, "a")
    assert len(before) == 2
    moved = store.compact(summarize=summaries)
    after = list_suites(store.fs, store.root, "a")
    assert moved.parts_merged == 2 and len(after) == 1 and not set(before) & set(after)
    leftovers = [p for p in os.listdir(os.path.dirname(after[0])) if p.endswith(SUITE)]
    assert len(leftovers) == 1
    columnar, row_by_row = texts(tmp_path, ())
    assert columnar == row_by_row


@pytest.mark.parametrize("width", [50, 90, 400])
def test_a_table_reads_the_replicates_of_the_columns_it_shows_only(tmp_path, monkeypatch,
                                                                   width):
    """A table board sets the marks of the columns it may show (their replicates read alone)
    and prints what the board of every row's replicates prints."""
    import io

    from rich.console import Console

    from rayeval.ranking import build_board
    from rayeval.reporting.render import render_rich

    store = build(tmp_path)
    store.compact(summarize=summaries)
    asked = []
    read_replicates = ResultStore.replicates
    monkeypatch.setattr(ResultStore, "replicates",
                        lambda self, wanted, sweep=None: asked.append(len(wanted))
                        or read_replicates(self, wanted, sweep))
    args = cli._parser().parse_args(["leaderboard", str(tmp_path)])
    lazy, full = (Console(file=io.StringIO(), width=width) for _ in range(2))
    commands_store._leaderboard(args, lazy)
    read_lazy = sum(asked)
    render_rich(build_board(rows_in_hand(args)), full)
    assert lazy.file.getvalue() == full.file.getvalue()
    assert "step_1" in lazy.file.getvalue()
    ranked = sum(asked) - read_lazy                 # every ranked row's, for the full board
    assert ranked >= 50
    if width == 50:                                 # a few columns shown: their rows only
        assert 0 < read_lazy < ranked / 2, read_lazy
