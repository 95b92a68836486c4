"""The README's Quickstart block holds exactly two commands, and CI makes the second's install
and runs its test command; the sweep
file reference (docs/sweep-file.md) documents exactly the schema's keys in its table; every page
of docs/ is linked from the README, and every relative link of the README and docs/ leads to a
file and a heading that exist."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEP_FILE_DOC = os.path.join(REPO, "docs", "sweep-file.md")


def read(path: str) -> str:
    return open(path, encoding="utf-8").read()


def quickstart_commands() -> list[str]:
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    section = text.split("## Quickstart", 1)[1]
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", section, re.S).group(1)
    return [ln for ln in block.splitlines() if ln.strip()]


def test_quickstart_has_two_commands_pinning_cpu_torch():
    commands = quickstart_commands()
    assert len(commands) == 2
    assert all("torch==2.13.0" in c for c in commands)
    assert "rayeval run configs/digits/sweep.yaml" in commands[0]


def test_ci_runs_the_readme_test_command():
    """The Quickstart's second line is an install and the test command: .ci/run makes the same
    install once (the same torch pin and editable project, its extras with vLLM's CPU build's
    beside the test extra, in one resolution) and runs the test command as a line of its own."""
    ci = open(os.path.join(REPO, ".ci", "run"), encoding="utf-8").read().splitlines()
    install, test = quickstart_commands()[1].split(" && ")
    assert test == "python -m pytest -n 2" and test in ci
    m = re.fullmatch(r"(pip install torch==2\.13\.0 -e )'\.\[([\w,-]+)\]'", install)
    assert m, install
    installs = [ln for ln in ci if ln.startswith(m.group(1))]
    assert len(installs) == 1, installs                  # the project installed once
    extras = re.fullmatch(re.escape(m.group(1)) + r"'\.\[([\w,-]+)\]'", installs[0])
    assert extras and set(m.group(2).split(",")) <= set(extras.group(1).split(",")), installs


WALKED = "walked"


def sweep_file_keys() -> dict[str, object]:
    """Every key the sweep file takes, walked from the schema (``config/schema.py``), as the
    README's table names it, mapped to its ``numbers`` declaration: None for a row of a whole
    section, WALKED for a section whose keys have rows (it needs none itself). Sections are
    walked into once each: a section met again (an evaluation's ``bootstrap``, after the
    sweep's defaults) is one row; a list of sections (``evals``) is a row and its entries'
    keys ``evals[i].KEY``."""
    from rayeval.config import schema

    out: dict[str, object] = {}
    walked: set[type] = set()

    def walk(cls, prefix: str, fields) -> None:
        for key, f in fields:
            path = prefix + key
            held = schema.section(cls, f)
            if held is None or not schema.keys(held[0]):   # a value, or a list of values
                out[path] = f.metadata["numbers"]
            elif held[0] in walked:
                out[path] = None
            else:
                walked.add(held[0])
                out[path] = None if held[1] else WALKED
                walk(held[0], f"{path}[i]." if held[1] else f"{path}.",
                     schema.sweep_fields(held[0]))

    defaults = [(k, f) for k, f in schema.sweep_fields(schema.EvalSpec)
                if f.metadata["sweep_default"]]
    walk(schema.EvalSpec, "", defaults)            # the sweep's batch_size, bootstrap.*
    walk(schema.Sweep, "", schema.sweep_fields(schema.Sweep))
    for _, f in schema.sweep_fields(schema.EvalSpec):
        if f.metadata["single_form"]:
            out[f.metadata["single_form"]] = f.metadata["numbers"]
    return out


def sweep_table_rows() -> dict[str, list[str]]:
    """The sweep file reference's key table: each row's keys (its first cell's `names`) and
    cells. The table is in the page's first part, before its first section (``## ...``)."""
    section = read(SWEEP_FILE_DOC).split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            for key in re.findall(r"`([^`]+)`", cells[0]):
                rows[key] = cells
    return rows


def test_every_sweep_key_is_documented():
    keys = sweep_file_keys()
    assert {"evals[i].dataset.delimiter", "dataset.name", "bootstrap.confidence",
            "trackers.wandb.mode", "evals[i].generation.until"} <= set(keys), "the walk"
    rows = sweep_table_rows()
    text = read(SWEEP_FILE_DOC)
    for key, numbers in keys.items():
        assert numbers == WALKED or f"| `{key}` |" in text, key
    from rayeval.plan.loader import SINGLE_FORM_KEYS

    unknown = set(rows) - set(keys) - SINGLE_FORM_KEYS
    assert not unknown, f"docs/sweep-file.md documents keys the schema does not have: {unknown}"


def test_the_table_says_which_keys_change_a_cells_numbers():
    """The table's "new cell" column agrees with each field's ``numbers`` declaration."""
    from rayeval.config import schema

    words = {True: "yes", False: "no", schema.TEXT: "text tasks"}
    rows = sweep_table_rows()
    for key, numbers in sweep_file_keys().items():
        if numbers not in (None, WALKED):
            assert rows[key][1] == words[numbers], (key, rows[key][1])


# The README and docs/ are one set of pages: a page nobody links is lost, and a link to a
# moved page or a renamed heading is the first thing a newcomer trips over.

def doc_pages() -> list[str]:
    """README.md and every docs/*.md, as paths relative to the repository."""
    docs = sorted(f for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md"))
    return ["README.md"] + [f"docs/{f}" for f in docs]


def prose(text: str) -> str:
    """The text without fenced blocks and inline code, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def relative_links(page: str) -> list[str]:
    """The targets of the page's links that point into the repository (not http:, mailto:)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", prose(read(os.path.join(REPO, page))))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def anchors(page: str) -> set[str]:
    """The anchors of a page's headings, as GitHub makes them: lower case, punctuation dropped,
    spaces as hyphens (``## Experiment trackers (MLflow, Weights & Biases)`` ->
    ``experiment-trackers-mlflow-weights--biases``)."""
    text = re.sub(r"^```.*?^```", "", read(os.path.join(REPO, page)), flags=re.S | re.M)
    out = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


def test_every_docs_page_is_linked_from_the_readme():
    linked = {os.path.normpath(t.split("#", 1)[0]) for t in relative_links("README.md")}
    pages = [p for p in doc_pages() if p != "README.md"]
    assert len(pages) >= 10, pages
    assert [p for p in pages if os.path.normpath(p) not in linked] == []


def test_every_relative_link_leads_to_a_file():
    broken = []
    for page in doc_pages():
        for target in relative_links(page):
            path = target.split("#", 1)[0]
            if path and not os.path.exists(os.path.join(REPO, os.path.dirname(page), path)):
                broken.append(f"{page}: {target}")
    assert broken == []


def test_every_link_to_a_heading_finds_it():
    broken = []
    for page in doc_pages():
        for target in relative_links(page):
            if "#" not in target:
                continue
            path, anchor = target.split("#", 1)
            into = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if into.endswith(".md") and os.path.exists(os.path.join(REPO, into)) \
                    and anchor not in anchors(into):
                broken.append(f"{page}: {target}")
    assert broken == []


def test_the_link_check_sees_links_and_skips_code():
    text = "[a](docs/x.md) `[b](nope.md)` [c](https://example.org)\n```\n[d](gone.md)\n```\n"
    found = re.findall(r"\]\(([^)\s]+)\)", prose(text))
    assert found == ["docs/x.md", "https://example.org"]
    assert "experiment-trackers-mlflow-weights--biases" in anchors("docs/trackers.md")


def test_the_command_table_names_every_command():
    """Every command of ``rayeval --help`` has a row in the README's command table (issue 47:
    store and query had none)."""
    import argparse

    from rayeval.ui.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    table = read(os.path.join(REPO, "README.md")).split("## Commands", 1)[1].split("\n## ")[0]
    first = [ln.split("|")[1] for ln in table.splitlines() if ln.startswith("| `rayeval ")]
    named = {m.group(1) for cell in first for m in re.finditer(r"`rayeval ([a-z0-9]+)", cell)}
    assert sorted(set(sub.choices) - named) == []
