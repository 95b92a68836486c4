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
from html.parser import HTMLParser

import numpy as np
import pytest
from rich.console import Console

import rayeval
from rayeval.reporting.board_html import to_html
from rayeval.reporting.render import render_rich, to_markdown
from rayeval.ranking import AGGREGATE, build_board
from rayeval.ranking.aggregate import scales_note
from rayeval.ranking.columns import Column, shown_interval
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
                              evaluation=args.evaluation, checkpoint=args.checkpoint_glob,
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
    if args.evaluation:                                   # --eval, or --dataset: one evaluation
        assert {e.rows[api.rank_by]["evaluation"] for e in api.entries} == {args.evaluation}

    # markdown, HTML and the terminal's table: the API board's own text
    assert run_cli(tmp_path, "--format", "markdown", *flags) == to_markdown(api)
    assert run_cli(tmp_path, "--format", "html", *flags) == to_html(api)
    shown = Console(file=io.StringIO(), width=400)
    render_rich(api, shown)
    assert run_cli(tmp_path, *flags) == shown.file.getvalue()

    # JSON: the rows shown and the aggregate rows (with --metric, that column's alone), the
    # same values and intervals
    stored = json.loads(run_cli(tmp_path, "--format", "json", *flags))
    by_key = {(r["sweep"], r["checkpoint"], r["evaluation"], r["metric"]): r for r in stored}
    for e in api.entries:
        for c in [api.rank_by] if args.metric else api.metrics:
            row = e.rows.get(c)
            if row is None:
                continue
            key = (e.sweep, e.checkpoint, "*" if c == AGGREGATE else row["evaluation"],
                   AGGREGATE if c == AGGREGATE else row["metric"])
            got = by_key.pop(key)
            for k in ("value", "ci_low", "ci_high"):
                assert same(got[k], None if row.get(k) is None or math.isnan(row[k])
                            else row[k]), (key, k)
    assert all(r.get("matrix") or r["metric"] == "confusion_matrix" for r in by_key.values())


# --- the interval a cell shows, the scales note, the page ----------------------------------

def key_at(confidence, reps=200):
    return f"seed=0;buckets=1024;replicates={reps};confidence={confidence}"


def one(value, low, high, n=40, confidence=0.95, **extra):
    return {"value": value, "ci_low": low, "ci_high": high, "num_samples": n,
            "bootstrap": key_at(confidence), **extra}


@pytest.mark.parametrize("n", [1, 7, 40, 1000])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
@pytest.mark.parametrize("value", [0.0, 1.0])
def test_an_all_0_or_all_1_cell_shows_the_clopper_pearson_interval(n, confidence, value):
    stats = pytest.importorskip("scipy.stats")     # scipy comes with scikit-learn (test extra)
    low, high, kind = shown_interval(one(value, value, value, n, confidence))
    want = stats.binomtest(int(value) * n, n).proportion_ci(confidence_level=confidence,
                                                            method="exact")
    assert kind == "exact"
    assert low == pytest.approx(want.low, abs=1e-12) and high == pytest.approx(want.high,
                                                                               abs=1e-12)


@pytest.mark.parametrize("row", [
    one(0.3, 0.25, 0.35),                       # an ordinary interval
    one(0.0, 0.0, 0.02),                        # 0, but some resample varied
    one(1.0, 0.97, 1.0),
    one(0.5, 0.5, 0.5),                         # every item alike, but not a 0/1 rate
    one(1.0, 1.0, 1.0, n=0),                    # no items to count
    one(0.0, 0.0, 0.0, parts=[{}, {}], confidence=0.9),    # an aggregate: sizes differ
    one(-1.5, -1.6, -1.4),
])
def test_a_stored_interval_passes_through_unchanged(row):
    assert shown_interval(row) == (row["ci_low"], row["ci_high"], "bootstrap")


def test_no_interval_is_said_as_none():
    assert shown_interval(None) == (None, None, "")
    assert shown_interval(one(0.0, None, None)) == (None, None, "")
    assert shown_interval(one(math.nan, None, None)) == (None, None, "")
    assert shown_interval(one(0.0, math.nan, math.nan)) == (None, None, "")


def scaled(columns: dict[str, list[float]]):
    """Averaged columns named EVAL/METRIC and one row per value."""
    cols = [Column(name, *name.split("/"), True) for name in columns]
    rows = [{"evaluation": c.evaluation, "metric": c.metric, "value": v}
            for c in cols for v in columns[c.name]]
    return cols, rows


@pytest.mark.parametrize("columns, said", [
    ({"docs/word_perplexity": [3.1, 13.2], "val/acc": [0.2, 0.9], "ood/acc": [0.1, 0.4]},
     "(docs/word_perplexity 3.1\u201313.2, the others within 0\u20131)"),
    ({"val/acc": [0.2, 0.9], "ood/nll": [1.44, 2.5]}, "(ood/nll 1.44\u20132.5, val/acc within"),
    ({"docs/word_perplexity": [3.1, 13.2], "docs2/bits_per_byte": [0.8, 1.1]},
     "(docs/word_perplexity 3.1\u201313.2, docs2/bits_per_byte 0.8\u20131.1)"),
    ({"val/acc": [0.2, 0.9], "ood/acc": [0.99, 0.995]}, None),     # one scale, any spread
    ({"docs/word_perplexity": [3.1, 13.2], "ood/nll": [1.44, 2.5]}, None),   # within 10x
    ({"val/acc": [0.5], "ood/acc": [math.nan]}, None),
])
def test_the_scales_note_says_when_the_aggregate_mixes_scales(columns, said):
    note = scales_note(*scaled(columns))
    if said is None:
        assert note is None
    else:
        assert note.startswith("warning: the aggregate averages metrics on different scales ")
        assert said in note and note.endswith("rank by one metric with --metric")


def hand_rows():
    """Four checkpoints on docs (word perplexity, lower is better), val (accuracy) and hard
    (40 items, every one wrong): ``a`` is best on val/acc and worst on perplexity; ``d`` is
    within noise of ``a`` on val/acc. Replicate b is one resample for every checkpoint."""
    rng = np.random.default_rng(5)
    shared = {e: rng.normal(0, s, 200) for e, s in (("docs", 0.05), ("val", 0.01))}
    quality = {"a": (13.2, 0.80), "b": (3.1, 0.60), "c": (8.0, 0.70), "d": (12.0, 0.799)}
    rows = []
    for i, (name, (ppl, acc)) in enumerate(quality.items()):
        for e, m, v, higher, n in (("docs", "word_perplexity", ppl, False, 1000),
                                   ("val", "acc", acc, True, 1000), ("hard", "acc", 0.0, True, 40)):
            reps = np.zeros(200) if e == "hard" else \
                v + shared[e] + rng.normal(0, 0.0005, 200)
            low, high = np.quantile(reps, [0.025, 0.975]).tolist()
            rows.append({"sweep": "s", "checkpoint": f"/runs/{name}", "step": i + 1,
                         "evaluation": e, "metric": m, "value": v, "ci_low": low, "ci_high": high,
                         "num_samples": n, "higher_is_better": higher, "created_at": T0,
                         "bootstrap": key_at(0.95), "replicates": reps.tolist(),
                         "cell": f"{name}{e}", "matrix": None})
    return rows


class Page(HTMLParser):
    """The board's cells as a browser has them: header texts, then per row (classes, text)."""

    def __init__(self):
        super().__init__()
        self.head, self.rows, self.cell, self.tags, self.notes = [], [], None, [], []
        self.where = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "tr":
            self.rows.append([])
        if tag in ("th", "td", "li"):
            self.cell = [tag, attrs.get("class") or "", ""]

    def handle_endtag(self, tag):
        if tag in ("th", "td", "li") and self.cell is not None:
            kind, classes, text = self.cell
            if kind == "th":
                self.head.append((classes, text))
            elif kind == "td":
                self.rows[-1].append((classes, text))
            else:
                self.notes.append((classes, text))
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell[2] += data


def parsed(html) -> Page:
    page = Page()
    page.feed(html)
    page.rows = [r for r in page.rows if r]
    return page


def test_the_page_marks_each_columns_best_cell_not_the_best_row():
    board = build_board(hand_rows(), "val/acc")
    page = parsed(to_html(board))
    names = [text for _, text in page.head]
    assert [n.split("n = ")[0] for n in names[4:]] == board.metrics
    assert board.entries[0].checkpoint == "/runs/a"        # ranked first, by val/acc
    for j, column in enumerate(board.columns, start=4):
        cells = [row[j] for row in page.rows]
        values = [float(text.split()[0]) for _, text in cells]
        best = [v for (classes, _), v in zip(cells, values) if "best" in classes.split()]
        marked = [text.endswith("*") for _, text in cells]
        assert [("best" in c.split()) for c, _ in cells] == marked, column.name
        assert [("tied" in c.split()) for c, t in cells] == [t.endswith("~") for _, t in cells]
        if any(marked):           # every cell with the best value, and only those (ties too)
            exact = [e.value(column.name) for e in board.entries]
            top = (min if not column.higher_is_better else max)(
                v for v in exact if v is not None)
            assert marked == [v == top for v in exact], column.name
            assert len(set(best)) == 1, column.name
    ppl = names.index("docs/word_perplexityn = 1,000")
    assert [text.split()[0] for c, text in (row[ppl] for row in page.rows)
            if "best" in c] == ["3.1000"]                   # b's, not the top row's 13.2
    assert "best" not in page.rows[0][ppl][0]
    # a's rival within noise on val/acc is shaded, and the shade is no near-white
    acc = names.index("val/accn = 1,000")
    assert [row[acc][0] for row in page.rows][:2] == ["best", "tied"]
    html = to_html(board)
    shade = html.split("td.tied { background: #", 1)[1][:6]
    assert min(int(shade[i:i + 2], 16) for i in (0, 2, 4)) < 0xE0
    assert "tr.best" not in html and not any(t == "tr" and a for t, a in page.tags)


def test_the_page_states_intervals_exact_cells_notes_and_freezes_the_names():
    stats = pytest.importorskip("scipy.stats")
    board = build_board(hand_rows(), aggregate="mean")     # a plain mean: the scales note
    html = to_html(board)
    page = parsed(html)
    high = stats.binomtest(0, 40).proportion_ci(0.95, method="exact").high
    hard = [text for classes, text in page.head].index("hard/accn = 40")
    # every checkpoint scores 0 on it: all tied at the best, all '*'
    assert {row[hard][1] for row in page.rows} == {f"0.0000 exact [0.0000, {high:.4f}]*"}
    assert "[0.0000, 0.0000]" not in html
    assert "[low, high]: 95% bootstrap interval" in html and "Clopper-Pearson" in html
    assert 'title="n = 40; 95% Clopper-Pearson exact interval' in html
    # the notes under the board: the scales warning (docs' perplexity beside accuracies)
    notes = [text for classes, text in page.notes if classes == "warning"]
    assert notes == board.notes and len(notes) == 1
    assert "(docs/word_perplexity 3.1\u201313.2, the others within 0\u20131)" in notes[0]
    # frozen name columns in a scroll container; long names wrap
    frozen = [text for classes, text in page.head if "frozen" in classes.split()]
    assert frozen == ["rank", "sweep", "checkpoint", "step"]
    assert all("frozen" in row[i][0] for row in page.rows for i in range(4))
    assert ".frozen { position: sticky;" in html and ".f3 { left: 21.5em;" in html
    assert ".scroll { overflow: auto;" in html and "overflow-wrap: anywhere" in html
    assert html.index('<div class="scroll"><table>') < html.index("<tbody>")


def test_the_text_formats_show_the_exact_interval_and_the_scales_note():
    board = build_board(hand_rows(), aggregate="mean")
    assert "| 0.0000 exact [0.0000, 0.0881]* |" in to_markdown(board)    # tied at the best
    shown = Console(file=io.StringIO(), width=400)
    render_rich(board, shown)
    text = shown.file.getvalue()
    assert "0.0000 exact [0.0000, 0.0881]*" in text and "95% bootstrap interval" in text
    assert "the aggregate averages metrics on different scales" in " ".join(text.split())


def test_the_page_of_one_evaluation_names_it(tmp_path):
    store_of(tmp_path)
    for flags in (("--eval", "ood"), ("--dataset", "val", "--sweep", "r")):
        html = run_cli(tmp_path, "--format", "html", *flags)
        assert f"<h1>rayeval leaderboard on {flags[1]}</h1>" in html
        assert f"<title>rayeval leaderboard on {flags[1]}</title>" in html
    assert "<h1>rayeval leaderboard</h1>" in run_cli(tmp_path, "--format", "html")
