"""The report's views (rayeval/reporting/report.py), its page and its two commands, on a store
written cell by cell (no Ray): every figure a view carries is the board's or ranking's own,
the page embeds them so that no script block can end early, and bad input is one line before
anything is written. The app itself is tested in a real browser (tests/browser)."""

from __future__ import annotations

import json
import os
import re
import threading
import urllib.error
import urllib.request

import pytest

from rayeval.errors import StoreError
from rayeval.io.store import ResultStore, confidence_of
from rayeval.ranking import board, paired
from rayeval.reporting.report import Report
from rayeval.reporting.report_page import embedded_json, page
from rayeval.ui import cli
from test_leaderboard import SUITE, suite


@pytest.fixture
def store(tmp_path):
    location = str(tmp_path / "out")
    s = ResultStore(location)
    ckpts = {str(tmp_path / "ckpts" / f"step_{n:06d}"): (n, q)
             for n, q in ((20, 0.25), (200, 0.58), (600, 0.72), (900, 0.71))}
    rows = suite(ckpts, SUITE)
    for loc in ckpts:
        for e in SUITE:
            s.write_cell(f"{abs(hash((loc, e)))}",
                         [r for r in rows if (r["checkpoint"], r["evaluation"]) == (loc, e)])
    return location


def test_the_board_view_carries_the_boards_own_values_marks_and_intervals(store):
    made = board(store)
    view = Report(store).board_view()
    assert [e["checkpoint"] for e in view["entries"]] == [e.checkpoint for e in made.entries]
    assert [c["name"] for c in view["columns"]] == [c.name for c in made.columns]
    for c, col in zip(made.columns, view["columns"]):
        assert col["values"] == [e.value(c.name) for e in made.entries]
        assert col["marks"] == "".join(e.marks.get(c.name, "") or "." for e in made.entries)
        assert col["low"] == [e.rows[c.name]["ci_low"] for e in made.entries]
        assert col["higher"] is c.higher_is_better
    assert view["rank_by"] == made.rank_by and view["notes"] == made.notes


def test_paired_differences_are_rankings_paired_bootstrap(store):
    report = Report(store)
    made = board(store)
    for ref in report.references():
        got = report.paired(ref)["columns"]
        base = made.entries[ref]
        for c in made.columns:
            for e, shown in zip(made.entries, got[c.name]):
                want = paired(e.rows[c.name], base.rows[c.name],
                              confidence_of(base.rows[c.name]))
                assert shown == [want.difference, want.ci_low, want.ci_high]
    assert report.references() == [0, 1, 2, 3]           # a small board: every checkpoint
    # what a served page asks: the columns it shows, the same figures as the whole view's
    name = made.columns[-1].name
    some = Report(store, marks=False).view("paired", {"ref": "1", "columns": json.dumps([name])})
    assert some == {"ref": 1, "columns": {name: report.paired(1)["columns"][name]}}
    with pytest.raises(StoreError, match="nope"):
        report.view("paired", {"ref": "1", "columns": '["nope"]'})


def test_meta_says_where_the_figures_come_from(store):
    meta = Report(store).meta()
    assert meta["checkpoints"] == 4 and meta["cells"] == 8 and meta["level"] == 0.95
    assert [e["name"] for e in meta["evaluations"]] == sorted(SUITE)
    assert all(e["rows"] == 1000 and not e["records"] for e in meta["evaluations"])
    assert meta["version"] and meta["store"] == store
    assert meta["sweep_files"] == {}                  # written cell by cell: no sweep file kept
    ResultStore(store).keep_sweep("s", "name: s\n")
    assert Report(store).meta()["sweep_files"] == {"s": "name: s\n"}


def test_embedded_json_cannot_end_its_script_block():
    value = {"context": "</script><script>alert(1)</script> <!-- x", "n": [1, None]}
    text = embedded_json(value)
    assert "</" not in text and "<!--" not in text
    assert json.loads(text) == value
    with pytest.raises(ValueError):
        embedded_json({"v": float("nan")})               # not JSON: never written


def test_the_page_fetches_nothing(store):
    html = page(Report(store).views(), "t")
    assert "default-src 'none'" in html and "connect-src" not in html
    # no address to fetch (the SVG namespace URI is a name, never requested)
    assert not re.search(r"""(src|href)\s*=\s*["']?https?:|url\(\s*["']?https?:|@import""",
                         html)
    assert set(re.findall(r"https?://[^'\"\s]+", html)) == {"http://www.w3.org/2000/svg"}
    assert html.count('id="rayeval-views"') == 1


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    got = capsys.readouterr()
    return code, got.out, got.err


def test_report_writes_one_file_and_bad_input_is_one_line(store, tmp_path, capsys):
    out = tmp_path / "r.html"
    code, _, err = run_cli(capsys, "report", store, "--output", str(out))
    assert code == 0 and "report written" in err
    html = out.read_text()
    assert json.loads(html.split('id="rayeval-views" type="application/json">')[1]
                      .split("</script>")[0])["meta"]["checkpoints"] == 4
    for argv, said in (
            (["report", store, "--output", str(tmp_path / "no" / "r.html")], "--output: no folder"),
            (["report", store, "--output", str(tmp_path)], "is a folder"),
            (["report", str(tmp_path / "nothing"), "--output", str(tmp_path / "x.html")],
             "no result store"),
            (["view", store, "--port", "70000"], "--port: 70000")):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "x.html")
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpts", "out", "r.html"]) or \
        not any(n.endswith(".partial") for n in os.listdir(tmp_path))


def test_the_server_answers_views_and_refuses_bad_ones(store):
    from rayeval.reporting.report_server import make_server

    server = make_server(Report(store, marks=False), 0, "t")
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        with urllib.request.urlopen(base, timeout=10) as r:
            assert "connect-src 'self'" in r.read().decode()
        with urllib.request.urlopen(base + "api/marks?columns=%5B%22aggregate%22%5D",
                                    timeout=10) as r:
            assert set(json.loads(r.read())) == {"aggregate"}
        for bad, said in (("api/paired?ref=9", "no entry 9"), ("api/nope", "no view"),
                          ("api/items?evaluation=val", "stored no per-item records")):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(base + bad, timeout=10)
            assert e.value.code == 400 and said in json.loads(e.value.read())["error"]
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()


def test_served_views_take_columns_whose_names_hold_a_comma(tmp_path):
    """An lm-eval metric with several filters is named ``exact_match,strict-match``: the page
    asks for such a column's marks and paired differences by name, in a JSON list (a
    comma-separated list asked for two columns that do not exist: HTTP 400, no marks)."""
    from urllib.parse import quote

    from rayeval.reporting.report_server import make_server

    location = str(tmp_path / "out")
    s = ResultStore(location)
    ckpts = {f"/c/step_{n:06d}": (n, q) for n, q in ((20, 0.25), (200, 0.58), (600, 0.72))}
    rows = suite(ckpts, {"gen": ["accuracy", "nll"]})
    for r in rows:
        r["metric"] = {"accuracy": "exact_match,strict-match"}.get(r["metric"], r["metric"])
    for loc in ckpts:
        s.write_cell(f"{abs(hash(loc))}", [r for r in rows if r["checkpoint"] == loc])
    made = board(location)
    name = next(c.name for c in made.columns if "strict-match" in c.name)
    other = next(c.name for c in made.columns if c.name.endswith("nll"))
    server = make_server(Report(location, marks=False), 0, "t")
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}/api/"
    wanted = quote(json.dumps([name, other]))
    try:
        with urllib.request.urlopen(base + f"marks?columns={wanted}", timeout=10) as r:
            marks = json.loads(r.read())
        assert marks[name] == "".join(e.marks.get(name, "") or "." for e in made.entries)
        assert set(marks) == {name, other}
        with urllib.request.urlopen(base + f"paired?ref=0&columns={wanted}", timeout=10) as r:
            assert set(json.loads(r.read())["columns"]) == {name, other}
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "marks?columns=" + quote(name), timeout=10)
        assert e.value.code == 400 and "not a JSON list of column names" in \
            json.loads(e.value.read())["error"]
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()


def test_item_ids_travel_as_exact_text(tmp_path):
    """64-bit ids (a data set without an id column gets hashed ones) reach the page as the
    same digits: a JSON number would round them in JavaScript."""
    from rayeval.core.evaluate import MetricResult
    from rayeval.core.samples import records_table
    from rayeval.io.store import cell_rows

    ids = [-9219662817155844128, 2**62 + 1, 7]
    s = ResultStore(str(tmp_path / "out"))
    table = records_table([{"id": ids, "context": ["a", "b", "c"], "target": ["x"] * 3,
                            "response": ["x", "y", "x"], "exact_match": [1.0, 0.0, 1.0]}])
    s.write_samples("c1", "tag", 0, 1, table)
    s.write_cell("c1", cell_rows(sweep="s", checkpoint="/c/ckpt-1", step=1, evaluation="ev",
                                 results={"exact_match": MetricResult(2 / 3)},
                                 higher_is_better={"exact_match": True}, num_samples=3,
                                 world_size=1, bootstrap_key="k", samples="tag"))
    items = Report(str(tmp_path / "out")).items("ev")
    assert items["id"] == [str(i) for i in sorted(ids)]
    sent = json.loads(embedded_json(items))
    assert sent["id"] == ["-9219662817155844128", "7", str(2**62 + 1)]


def test_items_without_an_id_column_are_shown_by_their_row(tmp_path):
    """Records that carry each item's row (its data had no id column, so its id is a content
    hash) show the row, in the data's order; another checkpoint's records, written in
    another order, line up with them by id."""
    from rayeval.core.evaluate import MetricResult
    from rayeval.core.samples import records_table
    from rayeval.io.store import cell_rows

    ids, rows = [-9219662817155844128, 2**62 + 1, 7], [2, 0, 1]
    s = ResultStore(str(tmp_path / "out"))
    for n, order in ((1, [0, 1, 2]), (2, [2, 0, 1])):
        table = records_table([{"id": [ids[k] for k in order], "row": [rows[k] for k in order],
                                "context": [f"text {rows[k]}" for k in order],
                                "target": ["x"] * 3, "response": ["x", "y", "x"],
                                "exact_match": [1.0, 0.0, 1.0]}])
        s.write_samples(f"c{n}", "tag", 0, 1, table)
        s.write_cell(f"c{n}", cell_rows(
            sweep="s", checkpoint=f"/c/ckpt-{n}", step=n, evaluation="ev",
            results={"exact_match": MetricResult(2 / 3)}, higher_is_better={"exact_match": True},
            num_samples=3, world_size=1, bootstrap_key="k", samples="tag"))
    report = Report(str(tmp_path / "out"))
    items = report.items("ev")
    assert items["id"] == ["0", "1", "2"] and items["named"] == "row"
    assert items["context"] == ["text 0", "text 1", "text 2"]
    # ckpt-1 answered x, y, x for the items at rows 2, 0, 1; ckpt-2 x, y, x for rows 1, 2, 0
    shown = {report.board.entries[e].checkpoint: report.cell("ev", e)["response"]
             for e in items["entries"]}
    assert shown == {"/c/ckpt-1": ["y", "x", "x"], "/c/ckpt-2": ["x", "x", "y"]}
