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
