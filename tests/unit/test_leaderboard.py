"""Tier 1: leaderboards across a suite of evaluations, the aggregate column, compare, checkpoint
names, tables that never crop a number, and plots. Rows are built by hand in the store's shape;
expected numbers are computed here with numpy from the same replicate lists."""

import csv
import io
import json
import math
import os
import re
import sys
from datetime import datetime, timezone

import numpy as np
import pytest
import torch
from rich.console import Console
from rich.text import Text

from rayeval.ui import cli
from rayeval.errors import StoreError
from rayeval.ranking import (aggregate_row, aggregates, build_board, compare,
                                 find_checkpoint, latest_rows, paired)
from rayeval.reporting.board_html import to_html
from rayeval.reporting.render import render_rich, to_csv, to_json, to_markdown
from rayeval.io.store import ResultStore

B = 200
KEY = f"seed=0;buckets=1024;replicates={B};confidence=0.95"
HIGHER = {"accuracy": True, "macro_f1": True, "nll": False, "brier": False}
WHEN = datetime(2026, 1, 1, tzinfo=timezone.utc)


def stored(checkpoint, step, evaluation, metric, value, replicates=None, sweep="s",
           num_samples=1000, bootstrap=KEY):
    """One row as the store holds it."""
    ci = (None, None) if replicates is None else \
        tuple(np.quantile(replicates, [0.025, 0.975]).tolist())
    return {"sweep": sweep, "checkpoint": checkpoint, "step": step, "evaluation": evaluation,
            "metric": metric, "value": value, "ci_low": ci[0], "ci_high": ci[1],
            "num_samples": num_samples, "world_size": 2, "created_at": WHEN,
            "higher_is_better": HIGHER[metric], "cell": f"{sweep}-{checkpoint}-{evaluation}",
            "bootstrap": bootstrap if replicates is not None else None,
            "replicates": None if replicates is None else list(replicates), "matrix": None}


def suite(checkpoints, evaluations, seed=0, noise=0.002, sweep="s"):
    """Rows for ``checkpoints`` {location: (step, quality)} on ``evaluations``
    {name: [metrics in order]}: replicate b of an evaluation shares one resample noise across
    checkpoints (paired), plus a little per-checkpoint noise."""
    g = torch.Generator().manual_seed(seed)
    shared = {(e, m): torch.randn(B, generator=g, dtype=torch.float64) * 0.01
              for e, ms in evaluations.items() for m in ms}
    rows = []
    for loc, (step, q) in checkpoints.items():
        for e, metrics in evaluations.items():
            for m in metrics:
                value = q if HIGHER[m] else 2.5 - 2 * q
                reps = value + shared[(e, m)] + noise * torch.randn(B, generator=g,
                                                                    dtype=torch.float64)
                rows.append(stored(loc, step, e, m, value, reps.tolist(), sweep=sweep))
    return rows


CKPTS = {"/r/ckpts/step_000020.pt": (20, 0.25), "/r/ckpts/step_000200.safetensors": (200, 0.58),
         "/r/ckpts/step_000600": (600, 0.72)}
SUITE = {"val": ["accuracy", "nll"], "ood": ["nll", "accuracy"]}   # ood's first metric: nll


def reps_of(rows, loc, evaluation, metric):
    return np.array(next(r for r in rows if (r["checkpoint"], r["evaluation"], r["metric"])
                         == (loc, evaluation, metric))["replicates"])


# --- board layout --------------------------------------------------------------------------

def test_suite_board_is_one_row_per_checkpoint_with_a_column_per_evaluation_metric():
    rows = suite(CKPTS, SUITE)
    board = build_board(rows)
    assert board.evaluations == ["ood", "val"]                   # by name
    assert board.metrics == ["aggregate", "ood/nll", "ood/accuracy", "val/accuracy", "val/nll"]
    assert board.rank_by == "aggregate" and board.higher_is_better
    assert [e.step for e in board.entries] == [600, 200, 20]
    assert [e.rank for e in board.entries] == [1, 2, 3] and board.entries[0].best
    assert [c.name for c in board.averaged] == ["ood/nll", "val/accuracy"]
    by_nll = build_board(rows, "ood/nll")
    assert by_nll.rank_by == "ood/nll" and not by_nll.higher_is_better
    assert [e.step for e in by_nll.entries] == [600, 200, 20]
    header, cells = to_markdown(board).splitlines()[0], to_markdown(board).splitlines()[2]
    assert header == ("| rank | sweep | checkpoint | step | aggregate | ood/nll | ood/accuracy | "
                      "val/accuracy | val/nll |")
    assert cells.startswith("| 1 * | s | step_000600 | 600 | ")


def test_one_evaluation_keeps_bare_metric_names_and_no_aggregate():
    rows = [r for r in suite(CKPTS, SUITE) if r["evaluation"] == "val"]       # like --dataset val
    board = build_board(rows)
    assert board.metrics == ["accuracy", "nll"] and board.rank_by == "accuracy"
    assert board.averaged == []
    assert to_markdown(board).splitlines()[0] == \
        "| rank | sweep | evaluation | checkpoint | step | accuracy | nll |"
    assert build_board(rows, "val/nll").rank_by == "nll"      # EVAL/METRIC names it too
    out = Console(file=io.StringIO(), width=200)
    render_rich(board, out)
    assert "sweep s, evaluation val" in out.file.getvalue()


def test_metric_names_resolve_or_fail_with_the_choices():
    rows = suite(CKPTS, {"val": ["accuracy", "brier"], "ood": ["accuracy"]})
    assert build_board(rows, "brier").rank_by == "val/brier"      # only val has it
    assert build_board(rows, "ood/accuracy").rank_by == "ood/accuracy"
    assert build_board(rows, "aggregate").rank_by == "aggregate"
    with pytest.raises(StoreError) as ambiguous:
        build_board(rows, "accuracy")
    assert str(ambiguous.value) == ("--metric: 'accuracy' is stored for several evaluations; "
                                    "choose one of: ood/accuracy, val/accuracy, aggregate")
    with pytest.raises(StoreError, match="no results for metric 'f1'; the store has: "
                                         "aggregate, ood/accuracy, val/accuracy, val/brier"):
        build_board(rows, "f1")
    one = [r for r in rows if r["evaluation"] == "val"]
    with pytest.raises(StoreError, match="aggregate needs results on two or more evaluations; "
                                         "the rows shown hold only val"):
        build_board(one, "aggregate")


# --- the aggregate -------------------------------------------------------------------------

def test_aggregate_value_and_interval_match_a_direct_computation():
    # the mean (aggregate: mean); the default win rate: tests/unit/test_win_rate.py
    rows = suite(CKPTS, SUITE)
    board = build_board(rows, aggregate="mean")
    for loc in CKPTS:
        val_acc = reps_of(rows, loc, "val", "accuracy")
        ood_nll = reps_of(rows, loc, "ood", "nll")          # lower is better: enters negated
        mean = (val_acc - ood_nll) / 2
        lo, hi = np.quantile(mean, [0.025, 0.975])
        step, q = CKPTS[loc]
        agg = next(e for e in board.entries if e.checkpoint == loc).rows["aggregate"]
        assert agg["value"] == pytest.approx((q - (2.5 - 2 * q)) / 2, abs=1e-15)
        assert agg["ci_low"] == pytest.approx(lo, rel=1e-12)
        assert agg["ci_high"] == pytest.approx(hi, rel=1e-12)
        assert np.allclose(agg["replicates"], mean, rtol=0, atol=1e-15)
        assert agg["evaluations"] == ["ood", "val"] and agg["metrics"] == ["nll", "accuracy"]


def test_aggregate_is_missing_without_every_evaluation_and_has_no_interval_without_replicates():
    rows = suite(CKPTS, SUITE)
    # step 20 lacks ood; step 200's ood/nll has fewer replicates than its val/accuracy.
    rows = [r for r in rows if not (r["step"] == 20 and r["evaluation"] == "ood")]
    for r in rows:
        if r["step"] == 200 and (r["evaluation"], r["metric"]) == ("ood", "nll"):
            r["replicates"] = r["replicates"][:100]
    board = build_board(rows)
    values = {e.step: e.value("aggregate") for e in board.entries}
    assert values[20] is None and values[200] is not None and values[600] is not None
    uneven = board.entries[[e.step for e in board.entries].index(200)].rows["aggregate"]
    assert uneven["ci_low"] is None and uneven["ci_high"] is None, "a value, no interval"
    assert [e.step for e in board.entries][-1] == 20              # missing last
    text = to_markdown(board)
    assert "| 3 | s | step_000020.pt | 20 | - |" in text
    # Neither headline metric (val/accuracy, ood/nll): still one aggregate row, missing.
    only_tails = [r for r in suite(CKPTS, SUITE) if r["step"] != 20
                  or (r["evaluation"], r["metric"]) in (("val", "nll"), ("ood", "accuracy"))]
    by_step = {a["step"]: a for a in aggregates(only_tails)}
    assert sorted(by_step) == [20, 200, 600] and math.isnan(by_step[20]["value"])
    assert by_step[20]["metrics"] == [None, None]
    # No replicates anywhere: a value without an interval.
    bare = [dict(r, replicates=None, bootstrap=None, ci_low=None, ci_high=None)
            for r in suite(CKPTS, SUITE)]
    agg = build_board(bare, aggregate="mean").entries[0].rows["aggregate"]
    assert agg["value"] == pytest.approx((0.72 - (2.5 - 1.44)) / 2)
    assert agg["ci_low"] is None and agg["replicates"] is None
    agg = build_board(bare).entries[0].rows["aggregate"]           # the win rate: 2 of 2
    assert agg["value"] == 1.0 and agg["ci_low"] is None and agg["replicates"] is None


def test_aggregate_marks_best_and_not_distinguishable_from_paired_replicates():
    # Two checkpoints within noise of each other on the aggregate, one clearly worse.
    ckpts = {"/c/best.pt": (1, 0.700), "/c/tied.pt": (2, 0.6995), "/c/worse.pt": (3, 0.60)}
    rows = suite(ckpts, {"val": ["accuracy"], "ood": ["accuracy"]}, noise=0.004)
    board = build_board(rows)
    marks = {e.checkpoint: e.marks.get("aggregate", "") for e in board.entries}
    assert marks == {"/c/best.pt": "*", "/c/tied.pt": "~", "/c/worse.pt": ""}

    def agg(loc):
        return (reps_of(rows, loc, "val", "accuracy") + reps_of(rows, loc, "ood", "accuracy")) / 2

    for loc, tied in (("/c/tied.pt", True), ("/c/worse.pt", False)):
        lo, hi = np.quantile(agg("/c/best.pt") - agg(loc), [0.025, 0.975])
        assert (lo <= 0 <= hi) == tied
    # Aggregates pair only when every part does.
    best, worse = (next(e for e in board.entries if e.checkpoint == loc).rows["aggregate"]
                   for loc in ("/c/best.pt", "/c/worse.pt"))
    assert paired(best, worse) is not None
    parts = [dict(worse["parts"][0], bootstrap=KEY.replace("seed=0", "seed=1")),
             worse["parts"][1]]
    assert paired(best, aggregate_row(parts, ["ood", "val"])) is None


def test_csv_markdown_html_and_json_carry_the_aggregate():
    rows = suite(CKPTS, SUITE)
    board = build_board(rows)
    parsed = list(csv.DictReader(io.StringIO(to_csv(board))))
    assert parsed[0]["checkpoint"] == "/r/ckpts/step_000600" and parsed[0]["aggregate_mark"] == "*"
    top = board.entries[0].rows["aggregate"]
    assert float(parsed[0]["aggregate"]) == top["value"]
    assert float(parsed[0]["aggregate_ci_low"]) == top["ci_low"]
    assert "evaluation" not in parsed[0] and "ood/nll_ci_high" in parsed[0]
    html = to_html(board)
    # the ranking column underlined, with its n (summed over the evaluations averaged)
    assert '<th class="rank-by">aggregate<span class="n">n = 2,000 in all</span></th>' in html
    assert "aggregate: mean win rate on -ood/nll, val/accuracy (per evaluation, the share of " \
        "the other checkpoints beaten, ties half)" in html
    assert "aggregate: mean of -ood/nll, val/accuracy" in \
        to_html(build_board(rows, aggregate="mean"))
    out = json.loads(to_json(rows, aggregates=[e.rows["aggregate"] for e in board.entries]))
    assert len(out) == len(rows) + 3
    agg = [r for r in out if r["metric"] == "aggregate"]
    assert {r["checkpoint"] for r in agg} == set(CKPTS)
    assert set(agg[0]) == {"sweep", "checkpoint", "step", "evaluation", "metric", "value",
                           "ci_low", "ci_high", "higher_is_better", "num_samples", "created_at",
                           "bootstrap", "confidence", "aggregate", "evaluations", "metrics"}
    assert agg[0]["aggregate"] == "win_rate"
    assert agg[0]["evaluation"] == "*" and agg[0]["higher_is_better"] is True
    assert agg[0]["evaluations"] == ["ood", "val"] and agg[0]["num_samples"] == 2000


def test_compare_needs_a_common_evaluation_and_reports_unpaired_rows():
    rows = suite(CKPTS, SUITE)
    a = [r for r in rows if r["step"] == 600]
    b = [r for r in rows if r["step"] == 200 and r["evaluation"] == "val"]
    assert [c.name for c in compare(a, b)] == ["accuracy", "nll"]     # one shared: bare names
    with pytest.raises(StoreError, match="not evaluated on a common data set"):
        compare([r for r in a if r["evaluation"] == "ood"], b)
    other_seed = [dict(r, bootstrap=KEY.replace("seed=0", "seed=1")) for r in b]
    assert [c.paired for c in compare(a, other_seed)] == [None, None]
    # B holds both evaluations but not ood's first metric: no aggregate to compare.
    b = [r for r in rows if r["step"] == 200 and (r["evaluation"], r["metric"]) != ("ood", "nll")]
    assert [c.name for c in compare(a, b)] == ["ood/accuracy", "val/accuracy", "val/nll"]
    with pytest.raises(StoreError, match="no aggregate to compare: B lacks ood/nll"):
        compare(a, b, "aggregate")


# --- through the CLI, on a real store ------------------------------------------------------

@pytest.fixture
def store(tmp_path):
    """A store written cell by cell: 3 checkpoints x 2 evaluations, plus a confusion matrix."""
    location = str(tmp_path / "out")
    s = ResultStore(location)
    ckpts = {str(tmp_path / "ckpts" / name): v for name, v in
             (("step_000020.pt", (20, 0.25)), ("step_000200.safetensors", (200, 0.58)),
              ("step_000600", (600, 0.72)))}
    rows = suite(ckpts, SUITE)
    for loc in ckpts:
        for e in SUITE:
            cell = [r for r in rows if (r["checkpoint"], r["evaluation"]) == (loc, e)]
            if e == "val":
                cell.append(dict(cell[0], metric="confusion_matrix", value=None, ci_low=None,
                                 ci_high=None, replicates=None, matrix=[[5, 1], [2, 7]]))
            s.write_cell(f"{abs(hash((loc, e)))}", cell)
    return location, ckpts, latest_rows(s.read())


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    got = capsys.readouterr()
    return code, got.out, got.err


def test_cli_json_adds_one_aggregate_row_per_checkpoint(store, capsys):
    location, ckpts, rows = store
    code, out, _ = run_cli(capsys, "leaderboard", location, "--format", "json")
    data = json.loads(out)
    assert code == 0 and len(data) == len(rows) + 3
    assert [r["metric"] for r in data[-3:]] == ["aggregate"] * 3
    assert all("replicates" not in r for r in data)
    _, out, _ = run_cli(capsys, "leaderboard", location, "--format", "json", "--metric",
                        "aggregate", "--replicates")
    data = json.loads(out)
    assert {r["metric"] for r in data} == {"aggregate"} and len(data[0]["replicates"]) == B
    _, out, _ = run_cli(capsys, "leaderboard", location, "--format", "json", "--metric",
                        "ood/accuracy")
    assert {(r["evaluation"], r["metric"]) for r in json.loads(out)} == {("ood", "accuracy")}
    _, out, _ = run_cli(capsys, "leaderboard", location, "--format", "json", "--dataset", "val")
    assert "aggregate" not in {r["metric"] for r in json.loads(out)}
    code, _, err = run_cli(capsys, "leaderboard", location, "--metric", "nll")
    assert code == 2 and err.strip() == ("error: --metric: 'nll' is stored for several "
                                         "evaluations; choose one of: ood/nll, val/nll, "
                                         "aggregate")


def test_cli_compare_on_several_evaluations_and_the_aggregate(store, capsys):
    location, ckpts, rows = store
    code, out, _ = run_cli(capsys, "compare", location, "step_000600", "200")
    assert code == 0
    lines = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:-1]]
             for ln in out.splitlines() if ln.startswith("│")}
    assert list(lines) == ["ood/nll", "ood/accuracy", "val/accuracy", "val/nll", "aggregate"]
    # the default aggregate of A and B: the share of the evaluations each wins (600 wins both)
    assert lines["aggregate"][:3] == ["1.0000", "0.0000", "+1.0000"]
    assert "aggregate: share of the evaluations won (ties half) of ood/nll, val/accuracy" in \
        " ".join(out.split())
    code, out, _ = run_cli(capsys, "compare", location, "step_000600", "200", "--aggregate",
                           "mean")
    lines = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:-1]]
             for ln in out.splitlines() if ln.startswith("│")}
    a, b = (next(loc for loc in ckpts if loc.endswith(n)) for n in ("600", "200.safetensors"))

    def agg(loc):
        return (reps_of(rows, loc, "val", "accuracy") - reps_of(rows, loc, "ood", "nll")) / 2

    d = agg(a) - agg(b)
    lo, hi = np.quantile(d, [0.025, 0.975])
    va, vb = ((q - (2.5 - 2 * q)) / 2 for q in (0.72, 0.58))
    assert lines["aggregate"] == [f"{va:.4f}", f"{vb:.4f}", f"{va - vb:+.4f}",
                                  f"[{lo:+.4f}, {hi:+.4f}]", f"{(d > 0).mean():.3f}"]
    assert "aggregate: mean over evaluations of ood/nll, val/accuracy" in " ".join(out.split())
    _, out, _ = run_cli(capsys, "compare", location, "step_000600", "200", "--dataset", "ood")
    names = [ln.split("│")[1].strip() for ln in out.splitlines() if ln.startswith("│")]
    assert names == ["nll", "accuracy"]
    _, out, _ = run_cli(capsys, "compare", location, "600", "20", "--metric", "aggregate")
    names = [ln.split("│")[1].strip() for ln in out.splitlines() if ln.startswith("│")]
    assert names == ["aggregate"]
    code, _, err = run_cli(capsys, "compare", location, "600", "20", "--metric", "accuracy")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "val/accuracy" in err


def test_cli_confusion_takes_a_step_and_the_plot_says_where_it_went(store, capsys, tmp_path):
    location, _, _ = store
    code, out, _ = run_cli(capsys, "confusion", location, "600")
    assert code == 0 and f"{location[:-4]}/ckpts/step_000600 on val (rows: target" in out
    png = tmp_path / "curves.png"
    code, _, err = run_cli(capsys, "leaderboard", location, "--plot", str(png), "--format",
                           "csv")
    assert code == 0 and png.stat().st_size > 0
    assert err.strip() == f"plot written to {png}"


@pytest.mark.parametrize("name, head", [("curves.svg", (b"<?xml", b"<svg")),
                                        ("curves.PDF", (b"%PDF",)),
                                        ("curves.png", (b"\x89PNG",))])
def test_the_plot_is_written_in_the_format_its_name_says(store, capsys, tmp_path, name, head):
    pytest.importorskip("matplotlib")
    location, _, _ = store
    folder = tmp_path / "plots"
    folder.mkdir()
    code, _, err = run_cli(capsys, "leaderboard", location, "--plot", str(folder / name),
                           "--format", "csv")
    assert code == 0, err
    assert (folder / name).read_bytes().startswith(head)
    assert os.listdir(folder) == [name]                 # no temporary file left


@pytest.mark.parametrize("name", ["curves.jpg", "curves", "curves.svg.gz"])
def test_a_plot_name_of_another_format_is_refused_before_anything_is_written(
        store, capsys, tmp_path, name):
    location, _, _ = store
    folder = tmp_path / "plots"
    folder.mkdir()
    code, out, err = run_cli(capsys, "leaderboard", location, "--plot", str(folder / name),
                             "--format", "csv")
    assert code == 2 and out == "" and os.listdir(folder) == []
    assert len(err.strip().splitlines()) == 1
    assert "--plot" in err and ".png, .svg or .pdf" in err


def test_plot_without_matplotlib_names_the_extra_with_its_brackets(store, capsys, tmp_path,
                                                                   monkeypatch):
    location, _, _ = store
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import fails
    code, _, err = run_cli(capsys, "leaderboard", location, "--plot", str(tmp_path / "x.png"))
    assert code == 2
    assert "pip install 'rayeval[plot]'" in err and "\\[" not in err


# --- checkpoint names ----------------------------------------------------------------------

def test_find_checkpoint_by_path_name_stem_step_and_ambiguity():
    rows = [stored(loc, step, "val", "accuracy", 0.5) for loc, step in (
        ("/r/a/step_000600.pt", 600), ("/r/a/step_000200.safetensors", 200),
        ("/r/b/step_000600.pt", 600), ("/r/b/checkpoint-50", 50))]

    def one(name):
        found = {r["checkpoint"] for r in find_checkpoint(rows, name, "A")}
        assert len(found) == 1, found
        return found.pop()

    assert one("/r/b/checkpoint-50") == one("checkpoint-50") == one("50") == "/r/b/checkpoint-50"
    assert one("step_000200") == one("200") == one("a/step_000200.safetensors") == \
        "/r/a/step_000200.safetensors"
    assert one("b/step_000600.pt") == "/r/b/step_000600.pt"
    for name in ("step_000600", "600", "step_000600.pt"):
        with pytest.raises(StoreError) as e:
            find_checkpoint(rows, name, "A")
        assert str(e.value) == (f"A: {name!r} matches 2 checkpoints: /r/a/step_000600.pt, "
                                "/r/b/step_000600.pt; give more of the path")
    with pytest.raises(StoreError, match="no checkpoint '7' in the store"):
        find_checkpoint(rows, "7", "A")
    # The same checkpoint in two sweeps is two checkpoints: --sweep picks one.
    twice = rows[:1] + [dict(rows[0], sweep="t")]
    with pytest.raises(StoreError, match=r"\(sweep s\), /r/a/step_000600.pt \(sweep t\); give "
                                         "more of the path or pick a sweep with --sweep"):
        find_checkpoint(twice, "600", "A")


# --- tables never crop a number ------------------------------------------------------------

WIDE = {e: ["accuracy", "macro_f1", "nll", "brier"] for e in ("val", "ood", "noisy")}
WIDE_CKPTS = {f"/runs/x/step_{s:06d}.safetensors": (s, q)
              for s, q in ((20, 0.25), (200, 0.58), (600, 0.72))}
CELL = re.compile(r"^(-?\d+\.\d{4})(?: \[(-?\d+\.\d{4}), (-?\d+\.\d{4})\])?([*~]?)$")


def printed(board, console) -> str:
    render_rich(board, console)
    return Text.from_ansi(console.file.getvalue()).plain


@pytest.mark.parametrize("width,terminal", [(80, True), (200, True), (80, False), (400, False)])
def test_wide_tables_print_every_shown_number_whole(width, terminal):
    rows = suite(WIDE_CKPTS, WIDE)
    board = build_board(rows)
    stored_by = {(r["checkpoint"].rsplit("/", 1)[-1], f"{r['evaluation']}/{r['metric']}"): r
                 for r in rows}
    for e in board.entries:
        stored_by[(e.checkpoint.rsplit("/", 1)[-1], "aggregate")] = e.rows["aggregate"]
    console = Console(file=io.StringIO(), width=width, force_terminal=terminal,
                      color_system="standard" if terminal else None)
    text = printed(board, console)
    lines = text.splitlines()
    assert max(len(ln) for ln in lines) <= width
    head = next(ln for ln in lines if ln.startswith("┃"))
    header = [h.strip() for h in head.split("┃")[1:-1]]
    data = [[c.strip() for c in ln.split("│")[1:-1]] for ln in lines if ln.startswith("│")]
    assert header[:3] == ["rank", "checkpoint", "step"] and "aggregate" in header
    assert len(data) == 3
    best = {}                                           # column -> best value, from the rows
    for name in header[3:]:
        vals = [r["value"] for (c, n), r in stored_by.items() if n == name]
        higher = name == "aggregate" or HIGHER[name.split("/")[1]]
        best[name] = max(vals) if higher else min(vals)
    for cells in data:
        row = dict(zip(header, cells))
        ckpt = row["checkpoint"]
        assert row["step"] == str(WIDE_CKPTS[f"/runs/x/{ckpt}"][0])
        for name in header[3:]:
            m = CELL.match(row[name])
            assert m, (name, row[name])
            want = stored_by[(ckpt, name)]
            assert m.group(1) == f"{want['value']:.4f}", (name, row[name])
            if m.group(2):
                assert m.group(2) == f"{want['ci_low']:.4f}" and \
                    m.group(3) == f"{want['ci_high']:.4f}"
            assert (m.group(4) == "*") == (want["value"] == best[name]), (name, row[name])
    assert data[0][0] == "1 *" and data[0][1] == "step_000600.safetensors"
    hidden = [c.name for c in board.columns if c.name not in header]
    note = " ".join(text.split())
    if hidden:
        assert f"{len(hidden)} more column(s) not shown" in note
        for name in hidden:
            assert re.search(rf"(?<![\w/]){re.escape(name)}(?![\w/])", note), name
    else:
        assert "not shown" not in note
    if width == 400:
        assert not hidden and "[low, high]" in note


@pytest.mark.parametrize("width", [60, 80, 120, 160, 200])
def test_a_table_drops_the_fewest_columns_that_make_it_fit(width):
    """The columns dropped are the fewest (from the right, never the ranking column) that let
    the table fit: what dropping them one at a time and measuring each time finds."""
    from rayeval.reporting.render import _fits, _rich_table

    board = build_board(suite(WIDE_CKPTS, WIDE))
    console = Console(file=io.StringIO(), width=width)
    shown, hidden = list(board.columns), []
    droppable = [c for c in reversed(board.columns) if c.name != board.rank_by]
    table = _rich_table(board, shown, hidden, False, None)
    while not _fits(console, table) and droppable:          # one at a time
        gone = droppable.pop(0)
        shown.remove(gone)
        hidden.insert(0, gone)
        table = _rich_table(board, shown, hidden, False, None)
    one_by_one = Console(file=io.StringIO(), width=width)
    one_by_one.print(table)
    render_rich(board, console)
    assert console.file.getvalue().startswith(one_by_one.file.getvalue())
    if width in (80, 120):                          # some dropped, not all
        assert 0 < len(hidden) < len(board.columns) - 1


# --- plots ---------------------------------------------------------------------------------

def test_plot_keeps_one_colour_per_sweep_and_the_title_clear_of_the_panels():
    pytest.importorskip("matplotlib")
    from rayeval.reporting.plot import figure

    rows = suite(CKPTS, {"val": ["accuracy"], "ood": ["accuracy"]}, sweep="alpha") + \
        suite(CKPTS, {"val": ["accuracy"], "ood": ["accuracy"]}, sweep="beta", seed=1)
    board = build_board(rows)
    fig = figure(board, board.columns, title="rayeval: a store with a long enough name")
    try:
        colours: dict[str, set] = {}
        panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]
        assert [ax.get_title().split(" ")[0] for ax in panels] == \
            ["aggregate", "ood/accuracy", "val/accuracy"]
        for ax in panels:
            labels = [line.get_label() for line in ax.get_lines()]
            assert sorted(labels) == ["alpha", "beta"]
            for line in ax.get_lines():
                colours.setdefault(line.get_label(), set()).add(line.get_color())
        assert all(len(c) == 1 for c in colours.values()), colours
        assert colours["alpha"] != colours["beta"]
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        top = fig._suptitle.get_window_extent(renderer)
        for ax in panels:
            assert not top.overlaps(ax.title.get_window_extent(renderer))
            assert not top.overlaps(ax.get_window_extent(renderer))
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_tiny_data_warns_and_identical_best_values_are_all_marked_best():
    """A 1-row data set gives [1, 1] intervals to every checkpoint that gets the row right:
    both share the best value, so both are marked '*' (issue 56: a tie showed '~' on both and
    '*' on none), the rank's crown goes to neither, and a warning says why the numbers mean
    little."""
    from rich.console import Console
    import io

    from rayeval.ranking import build_board
    from rayeval.reporting.render import render_rich

    def row(ckpt, step, value):
        return {"sweep": "s", "checkpoint": f"/c/{ckpt}", "step": step, "evaluation": "one",
                "metric": "accuracy", "value": value, "ci_low": value, "ci_high": value,
                "num_samples": 1, "world_size": 1, "created_at": None,
                "higher_is_better": True, "cell": ckpt, "bootstrap": None,
                "replicates": None, "matrix": None}

    board = build_board([row("a.pt", 1, 1.0), row("b.pt", 2, 1.0), row("c.pt", 3, 0.0)])
    assert not any(e.best for e in board.entries)
    assert [e.marks.get("accuracy") for e in board.entries] == ["*", "*", None]
    assert board.notes == ["warning: one has only 1 row(s); with fewer than 30 the intervals "
                           "and the ranking on it mean little"]
    out = io.StringIO()
    render_rich(board, Console(file=out, width=120, force_terminal=False))
    text = out.getvalue()
    assert "warning: one has only 1 row(s)" in text
    assert text.count("1.0000 exact [0.0250, 1.0000]*") == 2, text
    unique = build_board([row("a.pt", 1, 1.0), row("c.pt", 3, 0.0)])
    assert unique.entries[0].best and unique.entries[0].marks["accuracy"] == "*"


def test_language_modeling_boards_say_how_many_tokens_were_scored():
    from rayeval.ranking import build_board

    row = {"sweep": "s", "checkpoint": "/c/a.pt", "step": 1, "evaluation": "docs",
           "metric": "perplexity", "value": 12.5, "ci_low": None, "ci_high": None,
           "num_samples": 120, "num_tokens": 3456, "world_size": 1, "created_at": None,
           "higher_is_better": False, "cell": "k", "bootstrap": None, "replicates": None,
           "matrix": None}
    assert build_board([row]).notes == ["docs: 120 row(s), 3,456 scored token(s)"]


# --- a race's partial cells ----------------------------------------------------------------

def test_partial_cells_are_unranked_below_every_complete_one_with_why_they_stopped():
    """A race's partial cell (items_total set) is shown below every complete checkpoint,
    whatever its estimate, with '-' for its rank, never marked best or tied, and a note each;
    the trackers' board table carries why it stopped."""
    from rayeval.reporting.tracker_sinks import board_table

    one = {"val": ["accuracy"]}
    rows = suite({"/r/a.pt": (1, 0.60), "/r/b.pt": (2, 0.70), "/r/c.pt": (3, 0.20)}, one)
    why = "stopped after 40 of 1000 items: below #1 on val/accuracy with 95% confidence"
    # c's estimate over its 40 items beats everyone: still below the complete ones
    rows = [dict(r, value=0.9, num_samples=40, items_total=1000, stopped=why)
            if r["checkpoint"] == "/r/c.pt" else r for r in rows]
    board = build_board(rows)
    assert [e.checkpoint for e in board.entries] == ["/r/b.pt", "/r/a.pt", "/r/c.pt"]
    assert board.entries[0].best and not board.entries[2].best
    assert "accuracy" not in board.entries[2].marks
    assert any(n.startswith(f"c.pt: {why}") for n in board.notes)
    out = io.StringIO()
    render_rich(board, Console(file=out, width=200), title="s")
    line = next(t for t in out.getvalue().splitlines() if "c.pt" in t)
    assert re.match(r"^│\s+-\s+│", line), line
    columns, data = board_table(build_board(rows))
    stopped = columns.index("stopped")
    assert [d[stopped] for d in data] == [None, None, why]


def test_compare_with_a_partial_cell_says_how_to_complete_it(tmp_path, capsys):
    location = str(tmp_path / "out")
    s = ResultStore(location)
    rows = suite({"/r/a.pt": (1, 0.60), "/r/b.pt": (2, 0.70)}, {"val": ["accuracy"]})
    s.write_cell("a", [r for r in rows if r["checkpoint"] == "/r/a.pt"])
    s.write_cell("b-partial", [dict(r, num_samples=40, items_total=1000, stopped="stopped after "
                                    "40 of 1000 items") for r in rows
                               if r["checkpoint"] == "/r/b.pt"])
    code, out, err = run_cli(capsys, "compare", location, "a.pt", "b.pt")
    assert code != 0 and err.count("\n") == 1
    assert "B (/r/b.pt) has partial cells from a race (stopped after 40 of 1000 items)" in err
    assert "without select:" in err
