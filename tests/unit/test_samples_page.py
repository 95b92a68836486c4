"""Tier 1: per-item records with image thumbnails, and the page a person reads
(``rayeval samples --format html``, the leaderboard's links to it), from a store written the
way workers write one (``ResultStore.write_samples`` + ``write_cell``), without Ray. The
images are real easy-vqa items (the wheel in the test extra)."""

from __future__ import annotations

import base64
import io
import json
import os
from html.parser import HTMLParser

import numpy as np
import pytest

from rayeval.core.evaluate import MetricResult
from rayeval.core.samples import THUMBNAIL_PX, records_table, thumbnail
from rayeval.io.store import ResultStore, cell_rows
from rayeval.ui import cli

easy_vqa = pytest.importorskip("easy_vqa")


def _easy_vqa(n: int) -> list[dict]:
    """The first n easy-vqa test questions with their image files."""
    root = os.path.join(os.path.dirname(easy_vqa.__file__), "data", "test")
    with open(os.path.join(root, "questions.json")) as f:
        questions = json.load(f)[:n]
    return [{"question": q, "answer": a, "image": os.path.join(root, "images", f"{i}.png")}
            for q, a, i in questions]


def _pixels(path: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"))


class Page(HTMLParser):
    """What a browser would fetch and show: tags, image sources, items in order."""

    def __init__(self):
        super().__init__()
        self.tags, self.sources, self.items, self.links = [], [], [], []
        self.titles = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if tag == "img":
            self.sources.append(attrs["src"])
            self.titles.append(attrs.get("title"))
        if tag == "div" and "item" in attrs.get("class", "").split():
            self.items.append(attrs["class"])
        if tag == "a":
            self.links.append(attrs["href"])


def _parse(text: str) -> Page:
    page = Page()
    page.feed(text)
    return page


def test_a_thumbnail_is_a_small_png_of_the_image():
    from PIL import Image

    item = _easy_vqa(1)[0]
    small = Image.open(io.BytesIO(thumbnail(_pixels(item["image"]))))
    assert small.format == "PNG" and small.size == (64, 64)       # 64x64 kept as it is
    assert np.array_equal(np.asarray(small.convert("RGB")), _pixels(item["image"]))
    big = np.zeros((300, 200, 3), np.uint8)
    big[:150] = 255
    shrunk = Image.open(io.BytesIO(thumbnail(big)))
    assert shrunk.size == (43, THUMBNAIL_PX)                        # aspect ratio kept
    top, bottom = np.asarray(shrunk.convert("L"))[[0, -1], 20]
    assert top > 250 and bottom < 5


@pytest.fixture
def store(tmp_path):
    """Two checkpoints' records: ``shapes`` (image questions; the model answers item 1 and 3
    wrong on ckpt-2) and ``sums`` (text generation), as workers write them."""
    items = _easy_vqa(5)
    hostile = items[0]["question"] + " <script>alert(1)</script> & 'x'"
    s = ResultStore(str(tmp_path / "out"))
    for ckpt, wrong in (("/c/ckpt-1", {0}), ("/c/ckpt-2", {1, 3})):
        answers = ["circle" if i in wrong and it["answer"] != "circle" else
                   "square" if i in wrong else it["answer"] for i, it in enumerate(items)]
        batch = {"id": list(range(5)),
                 "context": [hostile] + [it["question"] for it in items[1:]],
                 "target": [it["answer"] for it in items], "response": answers,
                 "images": [[it["image"]] for it in items],
                 "thumbnails": [[thumbnail(_pixels(it["image"]))] for it in items],
                 "exact_match": [0.0 if i in wrong else 1.0 for i in range(5)]}
        for ev, table in (("shapes", records_table([batch])),
                          ("sums", records_table([{"id": [7, 8], "context": ["1+1=", "2+2="],
                                                   "target": ["2", "4"],
                                                   "response": ["2", "5"],
                                                   "exact_match": [1.0, 0.0]}]))):
            cell = f"{ev}{ckpt[-1]}"
            s.write_samples(cell, "tag", 0, 1, table)
            value = float(np.mean(table["exact_match"].to_numpy()))
            s.write_cell(cell, cell_rows(
                sweep="s", checkpoint=ckpt, step=int(ckpt[-1]), evaluation=ev,
                results={"exact_match": MetricResult(value)},
                higher_is_better={"exact_match": True}, num_samples=table.num_rows,
                world_size=1, bootstrap_key="k", samples="tag"))
    return str(tmp_path / "out"), items


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    got = capsys.readouterr()
    return code, got.out, got.err


def test_the_samples_page_shows_images_beside_text_wrong_items_first(store, capsys):
    out, items = store
    code, text, err = run_cli(capsys, "samples", out, "--checkpoint", "ckpt-2", "--eval",
                              "shapes", "--format", "html")
    assert code == 0, err
    page = _parse(text)
    assert page.items == ["item wrong"] * 2 + ["item right"] * 3
    order = [int(t.split("<", 1)[0])
             for t in text.split('<span class="label">id</span>')[1:]]
    assert order == [1, 3, 0, 2, 4]
    # each item's image, as a data URI of the thumbnail of its own easy-vqa file
    assert len(page.sources) == 5 and all(s.startswith("data:image/png;base64,")
                                          for s in page.sources)
    for src, title, i in zip(page.sources, page.titles, order):
        png = base64.b64decode(src.split(",", 1)[1])
        assert png == thumbnail(_pixels(items[i]["image"]))
        assert title == items[i]["image"]          # where it came from, on hover
    # the records' text is escaped: the hostile question is text, not a tag
    assert "script" not in page.tags and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    # self-contained: nothing fetched, nothing run
    assert "http" not in text and set(page.tags) <= {
        "html", "head", "meta", "title", "style", "body", "h1", "p", "div", "span", "pre",
        "code", "img", "ol", "li"}
    assert f"{items[1]['question']}" in text and "5 items, 2 wrong by exact_match" in text


def test_the_samples_page_works_for_text_records_and_json_carries_the_images(store, capsys):
    out, _ = store
    code, text, err = run_cli(capsys, "samples", out, "--checkpoint", "ckpt-1", "--eval",
                              "sums", "--format", "html")
    assert code == 0, err
    page = _parse(text)
    assert page.items == ["item wrong", "item right"] and not page.sources
    assert "<code>5</code>" in text and "2+2=" in text
    code, text, err = run_cli(capsys, "samples", out, "--checkpoint", "ckpt-1", "--eval",
                              "shapes", "--format", "json")
    records = json.loads(text)
    assert code == 0 and [len(r["thumbnails"]) for r in records] == [1] * 5
    assert all(r["thumbnails"][0].startswith("data:image/png;base64,") for r in records)
    assert [r["images"] for r in records] == [[it["image"]] for it in _easy_vqa(5)]
    code, text, err = run_cli(capsys, "samples", out, "--checkpoint", "ckpt-1", "--eval",
                              "shapes")
    assert code == 0 and "thumbnails" not in text and "base64" not in text  # the table: text
    assert "images" in text


def test_the_leaderboard_page_links_each_value_to_its_items(store, capsys, tmp_path,
                                                           monkeypatch):
    out, _ = store
    monkeypatch.chdir(tmp_path)
    code, text, err = run_cli(capsys, "leaderboard", out, "--format", "html",
                              "--samples-dir", "items")
    assert code == 0, err
    links = _parse(text).links
    assert len(links) == 4 and all(h.startswith("items/") for h in links)
    for href in links:                  # each link is a page that exists, of its own cell
        with open(tmp_path / href, encoding="utf-8") as f:
            page = f.read()
        cell = os.path.basename(href)[:-len(".html")]
        ev, ckpt = cell[:-1], f"/c/ckpt-{cell[-1]}"
        assert f"<h1>{ckpt} on {ev}</h1>" in page
    code, _, err = run_cli(capsys, "leaderboard", out, "--samples-dir", "items")
    assert code == 2 and "--samples-dir: only with --format html" in err
    assert len(err.strip().splitlines()) == 1


# --- what a card shows: empty and long answers, the choices, the order ---------------------

def _card_page(table, metric="exact_match"):
    from rayeval.reporting.samples import metric_columns
    from rayeval.reporting.samples_page import samples_page

    return samples_page(table, "c on e", metric_columns(table), metric)


def _fields(text: str) -> dict[str, list[str]]:
    """Each item's labelled fields (answer, target) as the text a browser shows, by item."""
    class Fields(HTMLParser):
        def __init__(self):
            super().__init__()
            self.items, self.label, self.depth, self.take = [], None, 0, None

        def handle_starttag(self, tag, attrs):
            cls = dict(attrs).get("class", "")
            if tag == "div" and "item" in cls.split():
                self.items.append({})
            if tag == "span" and cls == "label":
                self.take = "label"
            if tag == "span" and cls == "value":
                self.take = "value"
                self.items[-1][self.label] = ""

        def handle_endtag(self, tag):
            if tag == "span" and self.take == "label":
                self.take = None
            if tag == "div":
                self.take = None

        def handle_data(self, data):
            if self.take == "label":
                self.label = data
            elif self.take == "value":
                self.items[-1][self.label] += data

    parser = Fields()
    parser.feed(text)
    return parser.items


def test_an_empty_answer_is_shown_empty_and_long_or_multiline_ones_wrap():
    pa = pytest.importorskip("pyarrow")
    long = "x" * 400
    table = pa.table({"id": [1, 2, 3, 4], "context": ["a", "b", "c", "d"],
                      "target": ["t", "two\nlines", "t", long],
                      "response": ["", "one\ntwo", " \n", long],
                      "exact_match": [0.0, 0.0, 0.0, 1.0]})
    text = _card_page(table)
    fields = _fields(text)
    assert [f.get("answer") for f in fields] == [
        "(empty)", "one\ntwo", "(whitespace: ' \\n')", long]       # newlines kept as text
    assert '<code class="empty" title="the empty string">(empty)</code>' in text
    css = text.split("<style>", 1)[1].split("</style>", 1)[0]
    rule = css.split("code, pre {", 1)[1].split("}", 1)[0]
    assert "white-space: pre-wrap" in rule and "overflow-wrap: anywhere" in rule
    assert "font-size: 14px" in rule                 # not the browsers' 13 px monospace
    assert "<code>one\ntwo</code>" in text


def test_a_multiple_choice_card_marks_the_target_both_picks_and_the_log_likelihoods():
    pa = pytest.importorskip("pyarrow")
    # item 1: acc picks "Lyon" (-2.5, the highest), acc_norm the long name (-4.0 over 24
    # characters beats Lyon's -2.5 / 4); the target is "Paris". Item 2: both pick the target.
    long = "Saint-Etienne-du-Rouvray"
    table = pa.table({"id": [1, 2], "context": ["Capital of France?", "2+2?"],
                      "choices": [["Paris", "Lyon", long], ["4", "5"]],
                      "target": ["Paris", "4"], "response": ["Lyon", "4"],
                      "loglikelihoods": [[-3.0, -2.5, -4.0], [-1.0, -3.0]],
                      "acc": [0.0, 1.0], "acc_norm": [0.0, 1.0]})
    text = _card_page(table, "acc")
    first = text.split('<ol class="choices">')[1].split("</ol>")[0]
    lis = first.split("<li")[1:]
    assert lis[0].startswith(' class="target">Paris<span class="tag target">target</span>'
                             '<span class="ll">log-likelihood -3.0000, per character -0.6000')
    assert lis[1].startswith(' class="chosen">Lyon<span class="tag">acc&#x27;s pick</span>'
                             '<span class="ll">log-likelihood -2.5000, per character -0.6250')
    assert lis[2].startswith(f'>{long}<span class="tag norm">acc_norm&#x27;s pick</span>'
                             '<span class="ll">log-likelihood -4.0000, per character -0.1667')
    second = text.split('<ol class="choices">')[2].split("</ol>")[0]
    assert second.count("tag norm") == 0 and second.startswith(
        '<li class="chosen target">4<span class="tag target">target</span>'
        '<span class="tag">acc&#x27;s pick</span>')
    # without log-likelihoods (an older record): the answer's choice and the target only;
    # an lm-eval answer carries the target delimiter (" Lyon")
    bare = pa.table({"id": [1], "context": ["q"], "choices": [["Paris", "Lyon"]],
                     "target": ["Paris"], "response": [" Lyon"], "acc": [0.0]})
    lis = _card_page(bare, "acc").split('<ol class="choices">')[1].split("<li")[1:]
    assert lis[0].startswith(' class="target">Paris<span class="tag target">')
    assert lis[1].startswith(' class="chosen">Lyon<span class="tag">answer</span>')
    assert "log-likelihood" not in lis[0] + lis[1]


def test_perplexity_items_come_worst_first_and_the_summary_says_so():
    pa = pytest.importorskip("pyarrow")
    from rayeval.reporting.samples_page import samples_page

    table = pa.table({"id": [1, 2, 3, 4], "context": ["a", "b", "c", "d"],
                      "word_perplexity": [5.0, 20.0, None, 1.5]})
    text = samples_page(table, "c on docs", ["word_perplexity"], None)
    order = [int(t.split("<", 1)[0]) for t in text.split('<span class="label">id</span>')[1:]]
    assert order == [2, 1, 4, 3]                       # highest first, the missing last
    assert "<p>4 items, sorted by word_perplexity, worst (highest) first</p>" in text
    graded = pa.table({"id": [1, 2, 3], "context": ["a", "b", "c"],
                       "judge": [0.5, 0.25, 0.75]})
    text = samples_page(graded, "c on j", ["judge"], None)
    order = [int(t.split("<", 1)[0]) for t in text.split('<span class="label">id</span>')[1:]]
    assert order == [2, 1, 3] and "worst (lowest) first" in text
    text = samples_page(graded, "c on j", ["judge"], None, higher_is_better={"judge": False})
    assert "worst (highest) first" in text


def test_the_cards_picks_are_the_metrics_own():
    """acc's and acc_norm's picks on a card are those of the metrics that scored the item
    (``core.metrics.text``), ties included (the first of equal ones)."""
    torch = pytest.importorskip("torch")
    from rayeval.core.metrics.text import ChoiceAccuracy, ChoiceAccuracyNorm
    from rayeval.reporting.samples_page import choice_picks

    rng = np.random.default_rng(3)
    for _ in range(200):
        k = int(rng.integers(2, 6))
        choices = ["x" * int(n) for n in rng.integers(1, 12, k)]
        lls = [float(v) for v in rng.integers(-8, 0, k)]          # small integers: ties
        outputs = torch.tensor([[[ll, len(c)] for ll, c in zip(lls, choices)]],
                               dtype=torch.float64)
        _, acc, norm = choice_picks({"choices": choices, "loglikelihoods": lls})
        assert acc == int(ChoiceAccuracy.scores(outputs).argmax(dim=1))
        assert norm == int(ChoiceAccuracyNorm.scores(outputs).argmax(dim=1))


def test_items_of_data_without_an_id_column_are_shown_by_their_row(tmp_path, capsys):
    """Records that carry each item's row (its id is a 64-bit hash of its content) list the
    items in the data's order and name each by its row: the table and the page show the row
    (not the hash), the JSON keeps both."""
    ids, rows = [-9219662817155844128, 2**62 + 1, 7], [2, 0, 1]
    s = ResultStore(str(tmp_path / "out"))
    table = records_table([{"id": ids, "row": rows, "context": ["c2", "c0", "c1"],
                            "target": ["x"] * 3, "response": ["x", "y", "x"],
                            "exact_match": [1.0, 0.0, 1.0]}])
    s.write_samples("c1", "tag", 0, 1, table)
    s.write_cell("c1", cell_rows(sweep="s", checkpoint="/c/ckpt-1", step=1, evaluation="ev",
                                 results={"exact_match": MetricResult(2 / 3)},
                                 higher_is_better={"exact_match": True}, num_samples=3,
                                 world_size=1, bootstrap_key="k", samples="tag"))
    out = str(tmp_path / "out")
    code, text, err = run_cli(capsys, "samples", out, "--checkpoint", "ckpt-1")
    assert code == 0, err
    assert "row" in text and "-9219662817155844128" not in text
    assert text.index("c0") < text.index("c1") < text.index("c2")
    code, text, err = run_cli(capsys, "samples", out, "--checkpoint", "ckpt-1",
                              "--format", "json")
    assert code == 0 and [(r["row"], r["id"]) for r in json.loads(text)] == \
        [(0, 2**62 + 1), (1, 7), (2, -9219662817155844128)]
    code, text, err = run_cli(capsys, "samples", out, "--checkpoint", "ckpt-1",
                              "--format", "html")
    shown = [t.split("<", 1)[0] for t in text.split('<span class="label">row</span>')[1:]]
    assert code == 0 and sorted(shown) == ["0", "1", "2"] and "label\">id<" not in text
