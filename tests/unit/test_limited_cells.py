"""Cells scored on an lm-eval or lmms-eval entry's ``limit:`` (the first n of a task's N
documents): stored as n of N (``num_samples``, ``limited_from``), ranked like any cell, and
marked wherever a figure is shown: the board (every format, a note under it), the trackers'
points, tags and table, and ``rayeval compare``. A store written through ``cell_rows``; no
Ray, no lm-eval run."""

import csv
import io
import json
import re
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
from rich.console import Console

import rayeval
from rayeval.core.evaluate import MetricResult
from rayeval.io.store import ResultStore, cell_rows
from rayeval.ranking import build_board
from rayeval.ranking.columns import LIMITED
from rayeval.reporting.board_html import to_html
from rayeval.reporting.render import render_rich, to_csv, to_markdown
from rayeval.reporting.tracker_sinks import _Sink, board_table, limit_names, limits, points
from rayeval.ui import cli

KEY = "seed=0;buckets=1024;replicates=200;confidence=0.95"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
LIMIT = "limit: 30 of 2,376 items"
NOTE = (f"warning: {LIMITED} arith: limit: 30 of 2,376 items scored, not the whole task (an "
        "entry's limit: is for trying a task; its figures are not the task's)")


def _result(value, seed):
    reps = value + np.random.default_rng(seed).normal(0, 0.01, 200)
    low, high = np.quantile(reps, [0.025, 0.975]).tolist()
    return MetricResult(value, low, high, reps.tolist())


def _write(store, key, checkpoint, step, evaluation, value, n, of=None, seed=0):
    rows = cell_rows(sweep="s", checkpoint=checkpoint, step=step, evaluation=evaluation,
                     results={"acc": _result(value, seed)}, higher_is_better={"acc": True},
                     num_samples=n, world_size=1, bootstrap_key=KEY, limited_from=of)
    store.write_cell(key, [dict(r, created_at=T0 + timedelta(minutes=step)) for r in rows])


@pytest.fixture
def store(tmp_path):
    """arith: a and b on a limit: (30 of 2,376 items), c on the whole task; val: all whole."""
    location = str(tmp_path / "out")
    s = ResultStore(location)
    for i, (name, value, limited) in enumerate((("a", 0.40, True), ("b", 0.55, True),
                                                ("c", 0.50, False))):
        ckpt = f"/r/ckpts/{name}.pt"
        _write(s, f"{name}-arith", ckpt, i + 1, "arith", value, 30 if limited else 2376,
               2376 if limited else None, seed=i)
        _write(s, f"{name}-val", ckpt, i + 1, "val", 0.3 + 0.1 * i, 500, seed=10 + i)
    return location


def test_a_limited_cell_is_stored_as_n_of_n_and_ranked(store):
    rows = {(r["checkpoint"], r["evaluation"]): r for r in rayeval.results(store).to_pylist()}
    a = rows[("/r/ckpts/a.pt", "arith")]
    assert (a["num_samples"], a["limited_from"]) == (30, 2376)
    assert a["items_total"] is None and a["stopped"] is None       # not a race's partial cell
    assert rows[("/r/ckpts/c.pt", "arith")]["limited_from"] is None
    board = rayeval.leaderboard(store, metric="arith/acc")
    assert [e.checkpoint.rsplit("/", 1)[1] for e in board.entries] == ["b.pt", "c.pt", "a.pt"]
    assert [e.rank for e in board.entries] == [1, 2, 3] and board.entries[0].best
    assert not any(e.stopped for e in board.entries)
    by = {e.checkpoint.rsplit("/", 1)[1]: e for e in board.entries}
    assert by["a.pt"].limited == {"arith/acc": LIMIT,
                                  "aggregate": f"averages arith/acc ({LIMIT})"}
    assert by["c.pt"].limited == {}
    assert by["a.pt"].rows["arith/acc"]["limited_from"] == 2376       # the API's rows: data
    assert NOTE + "; ranked here beside cells of the whole task" in board.notes
    assert f"warning: {LIMITED} aggregate: it averages evaluations scored on a limit: where " \
           "marked" in board.notes


def test_every_board_format_marks_the_limited_cells(store, capsys):
    board = rayeval.leaderboard(store, metric="arith/acc")
    out = io.StringIO()
    render_rich(board, Console(file=out, width=200))
    text = out.getvalue()
    lines = {name: next(t for t in text.splitlines() if name in t) for name in
             ("a.pt", "b.pt", "c.pt")}
    assert "0.5500 [0.5310, 0.5676]*" + LIMITED in lines["b.pt"]     # the mark, then the dagger
    assert lines["a.pt"].count(LIMITED) == 2 and lines["b.pt"].count(LIMITED) == 2   # + agg
    assert LIMITED not in lines["c.pt"]
    flat = " ".join(text.split())
    assert NOTE in flat
    assert f"{LIMITED}: scored on the first items of its task only (limit:; see the notes)" in flat
    md = to_markdown(board)
    assert md.count(LIMITED) == 4
    table = list(csv.DictReader(io.StringIO(to_csv(board))))
    assert [r["checkpoint"] for r in table] == ["/r/ckpts/b.pt", "/r/ckpts/c.pt",
                                                "/r/ckpts/a.pt"]
    assert [r["arith/acc_limit"] for r in table] == [LIMIT, "", LIMIT]
    assert [r["val/acc_limit"] for r in table] == ["", "", ""]
    assert [r["arith/acc_mark"] for r in table] == ["*", "", ""]    # marks stay * and ~
    html = to_html(board)
    assert html.count(f'<span class="mark limited">{LIMITED}</span>') == 4
    assert f'title="n = 30; 95% bootstrap interval; the best in its column; {LIMIT}"' in html
    assert f'<li class="warning">{NOTE}' in html.replace("&#x27;", "'")
    # JSON: the stored rows, each with its n of N
    assert cli.main(["leaderboard", store, "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    arith = {r["checkpoint"]: (r["num_samples"], r["limited_from"]) for r in got
             if r["evaluation"] == "arith"}
    assert arith == {"/r/ckpts/a.pt": (30, 2376), "/r/ckpts/b.pt": (30, 2376),
                     "/r/ckpts/c.pt": (2376, None)}
    # the command's table: the marks and the note
    assert cli.main(["leaderboard", store, "--metric", "arith/acc"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert NOTE in printed and f"0.5676]*{LIMITED}" in printed


def test_a_board_without_limits_is_unchanged(tmp_path):
    s = ResultStore(str(tmp_path / "out"))
    _write(s, "x", "/r/x.pt", 1, "val", 0.5, 100)
    board = rayeval.leaderboard(str(tmp_path / "out"))
    assert not any(e.limited for e in board.entries)
    assert not any(LIMITED in n for n in board.notes)
    assert "_limit" not in to_csv(board) and LIMITED not in to_html(board)
    out = io.StringIO()
    render_rich(board, Console(file=out, width=200))
    assert LIMITED not in out.getvalue()


def test_the_trackers_log_the_item_counts_tag_the_run_and_mark_the_table(store):
    rows = rayeval.results(store).to_pylist()
    pts, _ = points(rows)
    n_key, of_key = limit_names("arith")
    assert (n_key, of_key) == ("eval/arith/limit_n", "eval/arith/limit_total")
    counts = sorted((p.step, p.key, p.value) for p in pts if p.count)
    assert counts == [(1, n_key, 30.0), (1, of_key, 2376.0), (2, n_key, 30.0),
                      (2, of_key, 2376.0)]                      # a and b, at their steps
    assert limits(rows) == {"arith": LIMIT}
    columns, data = board_table(build_board(rows))
    limited = {d[columns.index("checkpoint")]: d[columns.index("limited")] for d in data}
    both = f"arith/acc: {LIMIT}; aggregate: averages arith/acc ({LIMIT})"
    assert limited == {"/r/ckpts/a.pt": both, "/r/ckpts/b.pt": both, "/r/ckpts/c.pt": None}

    class Recorder(_Sink):          # a tracker without a server: what it is asked to do
        name = "recorder"

        def __init__(self):
            super().__init__("s", lambda line: None)
            self.logged, self.tags = [], []

        def _log(self, pts):
            self.logged += pts
            self.values += sum(p.figure for p in pts)

        def _tag_limits(self, found):
            self.tags.append(found)

    sink = Recorder()
    sink.log(rows)
    sink.log(rows)                  # a second push tags nothing again
    assert sink.tags == [{"arith": LIMIT}]
    assert sink.values == 2 * 6                    # the counts are not counted as values
    assert {p.key for p in sink.logged if p.count} == {n_key, of_key}


def test_the_mlflow_and_wandb_trackers_tag_the_run_with_the_limit():
    from rayeval.config.schema import MlflowTracker, WandbTracker
    from rayeval.reporting.tracker_mlflow import MlflowSink
    from rayeval.reporting.tracker_wandb import WandbSink

    class Client:
        def __init__(self):
            self.tags = {}

        def set_tag(self, run, key, value):
            self.tags[(run, key)] = value

    sink = MlflowSink(MlflowTracker(uri="http://x"), "s", lambda line: None)
    sink.client, sink.run_id = Client(), "r1"
    sink._tag_limits({"grp/arith": LIMIT})
    assert sink.client.tags == {("r1", "rayeval.limit/grp/arith"): LIMIT}

    class Config(dict):
        def update(self, values, allow_val_change=False):
            assert allow_val_change
            super().update(values)

    class Run:
        config = Config()

    sink = WandbSink(WandbTracker(project="p"), "s", lambda line: None)
    sink.run = Run()
    sink._tag_limits({"arith": LIMIT})
    assert sink.run.config == {"rayeval.limit/arith": LIMIT}


def test_compare_marks_limited_values_and_says_what_pairs(store, capsys):
    code = cli.main(["compare", store, "a.pt", "b.pt"])
    got = capsys.readouterr()
    assert code == 0, got.err
    text = " ".join(got.out.split())
    assert f"0.4000{LIMITED}" in text and f"0.5500{LIMITED}" in text      # arith/acc
    # the aggregate (the win rate of A and B: A loses both evaluations), marked too
    assert f"0.0000{LIMITED}" in text and f"1.0000{LIMITED}" in text
    assert re.search(r"val/acc\s+│\s+0\.3000 │\s+0\.4000 │", got.out)        # whole: no mark
    assert f"{LIMITED}: scored on the first items of the task only: A arith ({LIMIT}), " \
           f"B arith ({LIMIT}), A aggregate (averages arith ({LIMIT}))" in text
    # a limited cell and a whole-task one share no resamples: the message says why
    code = cli.main(["compare", store, "a.pt", "c.pt", "--eval", "arith"])
    got = capsys.readouterr()
    assert code != 0 and got.err.count("\n") == 1
    assert f"A (/r/ckpts/a.pt) has cells scored on a limit: (arith: {LIMIT}), which pair " \
           "only with cells of the same items" in got.err
