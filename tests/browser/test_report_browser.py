"""The results report in a real browser (docs/report.md): ``rayeval report``'s file and
``rayeval view``'s server, on a store with text, image, classification and judged items
written by real runs. Every count and difference the page shows is checked against the
store read by rayeval's own functions (paired bootstrap, per-item records) or against a
direct count of the records; the page must log no error and fetch nothing from elsewhere."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.browser]


@pytest.fixture(scope="module")
def report_file(store, tmp_path_factory):
    from support import rayeval_cli

    path = str(tmp_path_factory.mktemp("report") / "report.html")
    done = rayeval_cli("report", store, "--output", path)
    assert done.returncode == 0, done.stderr
    return path


def _entries(p) -> dict[str, int]:
    """checkpoint location -> the page's entry number, from the board's rows (every page)."""
    return p.page.evaluate("""() => Object.fromEntries(Array.from(
        document.querySelectorAll('tbody tr[data-checkpoint]')).map(
        r => [r.dataset.checkpoint, +r.dataset.entry]))""")


def _paired_shown_is_the_stores(p, store, a: str, b: str) -> None:
    """The A vs B view's paired bootstrap difference (A - B on facts_mc/acc) is the one
    ranking.paired computes from the store's replicates."""
    from rayeval.io.store import confidence_of
    from rayeval.ranking import board, paired

    rows = {e.checkpoint: e.rows["facts_mc/acc"] for e in board(store).entries
            if "facts_mc/acc" in e.rows}
    want = paired(rows[a], rows[b], confidence_of(rows[b]))
    got = {k: float(p.page.get_attribute(".paired", f"data-{k}"))
           for k in ("difference", "low", "high")}
    assert got == pytest.approx({"difference": want.difference, "low": want.ci_low,
                                 "high": want.ci_high}, abs=1e-12)


def _column(p, name: str) -> list[float | None]:
    idx = p.page.evaluate("""(name) => {
        const ths = Array.from(document.querySelectorAll('thead tr:nth-child(2) th'));
        return ths.findIndex(t => t.dataset.col === name); }""", name)
    assert idx >= 0, f"no column {name}"
    cells = p.page.evaluate(f"""() => Array.from(document.querySelectorAll('tbody tr')).map(
        r => r.querySelectorAll('td')[{idx} + 4].firstChild.textContent)""")
    return [None if c == "-" else float(c) for c in cells]


def test_the_file_is_self_contained_and_loads_without_errors(browser, page, report_file):
    html = open(report_file, encoding="utf-8").read()
    assert not re.search(r"""(src|href)=["']https?:""", html)      # nothing linked outside
    p = page()
    p.open("file://" + report_file)
    for view in ("#curves", "#items", "#compare", "#about"):
        p.show(view)
    assert p.errors == []
    assert {u.split(":", 1)[0] for u in p.requests} <= {"file", "data"}, p.requests


def test_header_cells_sort_the_board_and_filters_narrow_it(browser, page, report_file, store):
    from rayeval.ranking import board

    stored = board(store, marks=False)
    p = page()
    p.open("file://" + report_file)
    name = "facts_mc/acc"
    header = p.page.locator(f"thead th[data-col='{name}']")
    header.click()
    p.page.wait_for_selector(f"thead th[data-col='{name}'][aria-sort=ascending]")
    shown = _column(p, name)
    values = sorted((e.value(name) for e in stored.entries if e.value(name) is not None),
                    reverse=True)                                   # higher is better: best first
    assert [v for v in shown if v is not None] == [round(v, 4) for v in values]
    assert shown.index(None) == len(values) if None in shown else True   # missing last
    header.click()                                                  # again: the other way
    p.page.wait_for_selector(f"thead th[data-col='{name}'][aria-sort=descending]")
    assert [v for v in _column(p, name) if v is not None] == [round(v, 4) for v in values[::-1]]

    p.page.fill("input[name=checkpoint]", "*checkpoint-3*")
    p.page.dispatch_event("input[name=checkpoint]", "change")
    p.page.wait_for_selector("body[data-rendered*='checkpoint=']")
    kept = list(_entries(p))
    assert kept and all(re.search(r"checkpoint-3[^/]*$", c) for c in kept)
    assert len(kept) == sum(1 for e in stored.entries if re.search(r"checkpoint-3", e.checkpoint))

    p.show("#board?sweep=vision")
    assert {e.sweep for e in stored.entries if e.checkpoint in _entries(p)} == {"vision"}
    p.show("#board?metric=*/acc*")
    cols = p.page.eval_on_selector_all("thead th[data-col]", "ts => ts.map(t => t.dataset.col)")
    assert cols and all(re.fullmatch(r".*/acc.*", c) for c in cols)
    assert p.errors == []


def test_best_cell_of_each_column_is_marked_not_the_best_row(browser, page, report_file, store):
    from rayeval.ranking import board

    stored = board(store)
    p = page()
    p.open("file://" + report_file)
    entries = _entries(p)
    for c in stored.columns:
        best = [e.checkpoint for e in stored.entries if e.marks.get(c.name) == "*"]
        idx = p.page.evaluate("(n) => Array.from(document.querySelectorAll("
                              "'thead tr:nth-child(2) th')).findIndex(t => t.dataset.col === n)",
                              c.name)
        marked = p.page.evaluate(f"""() => Array.from(document.querySelectorAll('tbody tr'))
            .filter(r => r.querySelectorAll('td')[{idx} + 4].classList.contains('best'))
            .map(r => r.dataset.checkpoint)""")
        assert marked == best, c.name
    assert set(entries) == {e.checkpoint for e in stored.entries}


def test_item_search_and_the_wrong_only_filter(browser, page, report_file, store):
    from rayeval.reporting.samples import checkpoint_rows, read_cell_samples

    p = page()
    p.open("file://" + report_file)
    entries = _entries(p)
    ckpt = next(c for c in entries if c.endswith("checkpoint-300"))
    _, records = read_cell_samples(store, checkpoint_rows(store, ckpt, "tiny-lm"), "facts_mc")
    rows = records.to_pylist()
    p.show(f"#items?evaluation=facts_mc&entry={entries[ckpt]}")
    box = p.page.locator("input[type=search]")
    assert re.search("search|filter", box.get_attribute("placeholder"), re.I)
    box.fill("7 +")
    box.dispatch_event("change")
    p.page.wait_for_selector("body[data-rendered*='q=7']")
    ids = p.page.eval_on_selector_all(".item[data-id]", "xs => xs.map(x => +x.dataset.id)")
    assert ids == [r["id"] for r in rows if "7 +" in r["context"]
                   or any("7 +" in c for c in r["choices"])]
    # typing narrows without Enter, and the box keeps the caret for the next key
    p.show(f"#items?evaluation=facts_mc&entry={entries[ckpt]}")
    box = p.page.locator("input[type=search]")
    box.click()
    box.type("8 +", delay=30)
    p.page.wait_for_selector("body[data-rendered*='q=8%20%2B']")
    ids = p.page.eval_on_selector_all(".item[data-id]", "xs => xs.map(x => +x.dataset.id)")
    assert ids and ids == [r["id"] for r in rows if "8 +" in r["context"]
                           or any("8 +" in c for c in r["choices"])]
    assert p.page.evaluate("document.activeElement.name") == "q"
    p.page.keyboard.type("x")                      # still typing into the box
    p.page.wait_for_selector("body[data-rendered*='q=8%20%2Bx']")
    p.show(f"#items?evaluation=facts_mc&entry={entries[ckpt]}&wrong=1")
    ids = p.page.eval_on_selector_all(".item[data-id]", "xs => xs.map(x => +x.dataset.id)")
    assert ids == [r["id"] for r in rows if r["acc"] == 0.0]
    card = p.page.locator(".item").first
    assert card.locator(".tag.target").count() == 1                 # the target is marked
    assert p.errors == []


def test_a_against_b_counts_and_the_paired_difference_match_the_store(
        browser, page, report_file, store):
    from rayeval.reporting.samples import checkpoint_rows, read_cell_samples

    p = page()
    p.open("file://" + report_file)
    entries = _entries(p)
    a = next(c for c in entries if c.endswith("checkpoint-300"))
    b = next(c for c in entries if c.endswith("checkpoint-30"))
    p.show(f"#compare?evaluation=facts_mc&a={entries[a]}&b={entries[b]}")
    shown = {k: int(p.page.text_content(f"[data-count={k}]"))
             for k in ("both_right", "a_only", "b_only", "both_wrong")}
    ra = {r["id"]: r["acc"] for r in read_cell_samples(
        store, checkpoint_rows(store, a, "tiny-lm"), "facts_mc")[1].to_pylist()}
    rb = {r["id"]: r["acc"] for r in read_cell_samples(
        store, checkpoint_rows(store, b, "tiny-lm"), "facts_mc")[1].to_pylist()}
    assert shown == {"both_right": sum(ra[i] == 1 and rb[i] == 1 for i in ra),
                     "a_only": sum(ra[i] == 1 and rb[i] == 0 for i in ra),
                     "b_only": sum(ra[i] == 0 and rb[i] == 1 for i in ra),
                     "both_wrong": sum(ra[i] == 0 and rb[i] == 0 for i in ra)}
    # McNemar's exact test of those counts, as scipy computes it
    from scipy.stats import binomtest

    expected = binomtest(shown["a_only"], shown["a_only"] + shown["b_only"]).pvalue
    assert float(p.page.get_attribute(".mcnemar", "data-p")) == pytest.approx(expected, rel=1e-9)
    _paired_shown_is_the_stores(p, store, a, b)
    flipped = p.page.eval_on_selector_all(".flipped:first-child .item",
                                          "xs => xs.map(x => +x.dataset.id)")
    assert flipped == [i for i in sorted(ra) if ra[i] == 1 and rb[i] == 0][:100]
    assert p.errors == []


def test_classification_items_confusion_cells_and_images(browser, page, report_file, store):
    from rayeval.reporting.samples import checkpoint_rows, read_cell_samples

    p = page()
    p.open("file://" + report_file)
    entries = _entries(p)
    ckpt = next(c for c in entries if "/vision/" in c)
    _, records = read_cell_samples(store, checkpoint_rows(store, ckpt, "vision"), "shapes")
    rows = records.to_pylist()
    p.show(f"#items?evaluation=shapes&entry={entries[ckpt]}")
    assert p.page.locator(".item img[src^='data:image/png']").count() > 0
    wrong = [r for r in rows if r["target"] != r["response"]]
    assert wrong, "the fixture's checkpoint should make some mistakes"
    t, pred = wrong[0]["target"], wrong[0]["response"]
    cell = p.page.locator(f".heat td[data-target='{t}'][data-pred='{pred}']")
    assert int(cell.text_content()) == sum(1 for r in rows if (r["target"], r["response"])
                                           == (t, pred))
    cell.click()
    p.page.wait_for_selector("body[data-rendered*='pred=']")
    ids = p.page.eval_on_selector_all(".item[data-id]", "xs => xs.map(x => x.dataset.id)")
    mine = sorted((r for r in rows if (r["target"], r["response"]) == (t, pred)),
                  key=lambda r: (-r["probability"], r["id"]))
    assert ids == [str(r["id"]) for r in mine]                     # most confident first
    assert p.errors == []


def test_judged_items_show_the_judge(browser, page, report_file):
    p = page()
    p.open("file://" + report_file)
    p.show("#items?evaluation=nq")
    assert p.page.locator(".item >> text=judge said").count() > 0
    assert p.page.locator(".item details summary >> text=judge prompt").count() > 0
    assert p.errors == []


def test_names_stay_in_view_at_800_px(browser, page, report_file):
    p = page(width=800)
    p.open("file://" + report_file)
    p.page.eval_on_selector(".scroll", "s => { s.scrollLeft = s.scrollWidth; }")
    box = p.page.locator("tbody tr td.f2").first.bounding_box()
    assert 0 <= box["x"] and box["x"] + box["width"] <= 800


def test_view_serves_the_same_app_from_the_store_and_stops_on_ctrl_c(browser, page, store):
    proc = subprocess.Popen([sys.executable, "-m", "rayeval", "view", store, "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/", line).group(0)
        p = page()
        p.open(url)
        # A vs B: the counts at once, the paired difference when the server has computed it
        # (it stayed blank while that ran: seconds to a minute on a big store), as the file's
        entries = _entries(p)
        a = next(c for c in entries if c.endswith("checkpoint-300"))
        b = next(c for c in entries if c.endswith("checkpoint-30"))
        p.show(f"#compare?evaluation=facts_mc&a={entries[a]}&b={entries[b]}")
        assert int(p.page.text_content("[data-count=a_only]")) >= 0
        p.page.wait_for_selector(".paired[data-difference]", timeout=60_000)
        _paired_shown_is_the_stores(p, store, a, b)
        p.show("#curves?ref=0")
        assert p.page.locator(".panel svg polyline").count() > 0
        assert p.errors == []
        assert all(u.startswith(url) or u.startswith("data:") for u in p.requests), p.requests
    finally:
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        code = proc.wait(timeout=10)
    assert code == 0 and time.monotonic() - start < 5
