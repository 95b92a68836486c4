"""Tier 1: one board, every format. ``rayeval.leaderboard()`` and ``rayeval leaderboard`` as a
table, JSON, CSV, markdown and HTML give the same ranks, values, intervals and marks — and
the same as the board of the rows in hand with their own replicates (an independent path: the
aggregate's replicates combined from each row's, the marks from every row's) — on a store with
an lm-eval group, a race's partial cells, several sweeps, parts with suite files and one-cell
files written after them."""

import csv
import io
import json
import math
from datetime import timedelta

import pytest
from rich.console import Console

import rayeval
from rayeval.reporting.render import render_rich, to_html, to_markdown
from rayeval.ranking import AGGREGATE, build_board
from rayeval.ranking.suite import summaries
from rayeval.ui import cli, commands_store

from test_json_board import T0, build, cell, rows_in_hand

WHY = "stopped after 40 of 1000 items: below #1 on aggregate with 95% confidence"


def store_of(root):
    """``test_json_board``'s two sweeps and group, compacted into parts with suite files; then
    a raced sweep ``r`` (one checkpoint's cells partial) and a rewrite, as one-cell files."""
    store = build(root)
    store.compact(summarize=summaries)
    for step, partial in ((1, False), (2, True), (3, False)):
        for n, d in enumerate(("ood", "val")):
            rows = cell("r", f"/ck/r/step_{step}", d, step, 0.2 * step + 0.01 * n,
                        seed=200 + 10 * step + n, stamp=T0 + timedelta(hours=step))
            if partial:
                rows = [dict(r, value=0.99, num_samples=40, items_total=1000, stopped=WHY)
                        for r in rows]
            store.write_cell(f"r{step}{d}", rows)
    store.write_cell("a2ood", cell("a", "/ck/a/step_2", "ood", 2, 0.9, seed=99,
                                   stamp=T0 + timedelta(days=1)))
    return store


def run_cli(root, *flags) -> str:
    args = cli._parser().parse_args(["leaderboard", str(root), *flags])
    out = Console(file=io.StringIO(), width=400)
    if args.format == "table":
        assert commands_store._leaderboard(args, out) == 0
        return out.file.getvalue()
    captured = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(captured):
        assert commands_store._leaderboard(args, out) == 0
    return captured.getvalue()


def figures(board):
    """Every entry's rank, best, and each column's value, interval and mark."""
    return [(e.rank, e.best, e.sweep, e.checkpoint,
             {c: (e.value(c), (e.rows.get(c) or {}).get("ci_low"),
                  (e.rows.get(c) or {}).get("ci_high"), e.marks.get(c, ""))
              for c in board.metrics}) for e in board.entries]


def same(a, b) -> bool:
    return a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("flags", [(), ("--members",), ("--sweep", "r"),
                                   ("--metric", "ood/nll"), ("--eval", "ood"),
                                   ("--dataset", "val", "--checkpoint", "*/step_[12]")])
def test_every_format_and_the_api_give_one_board(tmp_path, flags):
    store_of(tmp_path)
    args = cli._parser().parse_args(["leaderboard", str(tmp_path), *flags])
    api = rayeval.leaderboard(tmp_path, metric=args.metric, sweep=args.sweep,
                              evaluation=args.dataset, checkpoint=args.checkpoint_glob,
                              members=args.members)
    in_hand = build_board(rows_in_hand(args), args.metric)
    assert figures(api) == figures(in_hand)
    assert any(e.stopped for e in api.entries) == (args.sweep in (None, "r"))
    assert [e.checkpoint for e in api.entries if e.stopped] == \
        (["/ck/r/step_2"] if args.sweep in (None, "r") else [])

    # CSV: every digit of every value and bound, the ranks and the marks
    table = list(csv.DictReader(io.StringIO(run_cli(tmp_path, "--format", "csv", *flags))))
    assert len(table) == len(api.entries)
    for line, e in zip(table, api.entries):
        assert (line["rank"], line["best"], line["sweep"], line["checkpoint"]) == \
            (str(e.rank), str(int(e.best)), e.sweep, e.checkpoint)
        for c in api.metrics:
            row = e.rows.get(c) or {}
            for got, want in ((line[c], row.get("value")), (line[f"{c}_ci_low"],
                                                            row.get("ci_low")),
                              (line[f"{c}_ci_high"], row.get("ci_high"))):
                assert got == ("" if want is None or math.isnan(want) else repr(want)), (c, e)
            assert line[f"{c}_mark"] == e.marks.get(c, "")
    assert any(line[f"{c}_mark"] for line in table for c in api.metrics)
    if args.dataset:                                   # --eval, or --dataset: one evaluation
        assert {e.rows[api.rank_by]["dataset"] for e in api.entries} == {args.dataset}

    # markdown, HTML and the terminal's table: the API board's own text
    assert run_cli(tmp_path, "--format", "markdown", *flags) == to_markdown(api)
    assert run_cli(tmp_path, "--format", "html", *flags) == to_html(api)
    shown = Console(file=io.StringIO(), width=400)
    render_rich(api, shown)
    assert run_cli(tmp_path, *flags) == shown.file.getvalue()

    # JSON: the rows shown and the aggregate rows (with --metric, that column's alone), the
    # same values and intervals
    stored = json.loads(run_cli(tmp_path, "--format", "json", *flags))
    by_key = {(r["sweep"], r["checkpoint"], r["dataset"], r["metric"]): r for r in stored}
    for e in api.entries:
        for c in [api.rank_by] if args.metric else api.metrics:
            row = e.rows.get(c)
            if row is None:
                continue
            key = (e.sweep, e.checkpoint, "*" if c == AGGREGATE else row["dataset"],
                   AGGREGATE if c == AGGREGATE else row["metric"])
            got = by_key.pop(key)
            for k in ("value", "ci_low", "ci_high"):
                assert same(got[k], None if row.get(k) is None or math.isnan(row[k])
                            else row[k]), (key, k)
    assert all(r.get("matrix") or r["metric"] == "confusion_matrix" for r in by_key.values())
