"""A real browser for the report's tests: Debian's Chromium (``apt-get install chromium``, as
.ci/run does) driven by Playwright, with no browser download. Without Chromium a test is
skipped on a developer's machine and fails under CI (CI=true), where it must run.

``store``: one result store holding what the report shows, written by real runs in one local
Ray: the language-model example (multiple choice, perplexity, generation), the image
classification example (records with thumbnails) and a judged generation sweep."""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = os.environ.get("RAYEVAL_CHROMIUM", "/usr/bin/chromium")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# One Chromium for the tier's module, closed after it: as a session fixture its eleven
# processes (and Playwright's driver) stayed up through every later tier of the run.
@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        message = f"no Chromium at {CHROMIUM}: apt-get install chromium (or set RAYEVAL_CHROMIUM)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


class Page:
    """A page that records console errors, page errors and every request it makes."""

    def __init__(self, browser, width: int = 1400):
        self.page = browser.new_page(viewport={"width": width, "height": 900})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error"
                     else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))

    def open(self, url: str) -> None:
        self.page.goto(url)
        self.page.wait_for_selector("body[data-ready]", timeout=30_000)
        self.page.wait_for_selector("body[data-rendered]", timeout=30_000)

    def show(self, hash_: str) -> None:
        """Go to a view and wait until it has rendered."""
        self.page.evaluate(f"location.hash = {hash_!r}")
        self.page.wait_for_selector(f"body[data-rendered={hash_!r}]", timeout=30_000)

    def close(self) -> None:
        self.page.close()


@pytest.fixture
def page(browser):
    made: list[Page] = []

    def make(width: int = 1400) -> Page:
        made.append(Page(browser, width))
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.fixture(scope="session")
def store(tmp_path_factory):
    import rayeval
    from judge_support import build, sweep
    from support import local_ray

    root = tmp_path_factory.mktemp("report_store")
    out = str(root / "store")
    for example in ("lm", "vision"):
        shutil.copytree(os.path.join(REPO, "configs", example), root / example)
    judged = sweep(build(str(root / "judged"), items=24, checkpoints=2))
    with local_ray(num_cpus=4):
        for path in (root / "lm" / "sweep.yaml", root / "vision" / "sweep.yaml", judged):
            report = rayeval.run(str(path), workers=1, output=out)
            assert not report.failures, [o.error for o in report.failures]
    return out
