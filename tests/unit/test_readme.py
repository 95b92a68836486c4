"""The README's Quickstart block holds exactly two commands, and CI runs the second; its sweep
file table documents exactly the schema's keys."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    ci = open(os.path.join(REPO, ".ci", "run"), encoding="utf-8").read().splitlines()
    assert quickstart_commands()[1] in ci


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
    """The README's sweep-file key table: each row's keys (its first cell's `names`) and
    cells."""
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    section = text.split("## The sweep file", 1)[1].split("\n### ", 1)[0]
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
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    for key, numbers in keys.items():
        assert numbers == WALKED or f"| `{key}` |" in text, key
    from rayeval.plan.loader import SINGLE_FORM_KEYS

    unknown = set(rows) - set(keys) - SINGLE_FORM_KEYS
    assert not unknown, f"the README documents keys the schema does not have: {unknown}"


def test_the_table_says_which_keys_change_a_cells_numbers():
    """The table's "new cell" column agrees with each field's ``numbers`` declaration."""
    from rayeval.config import schema

    words = {True: "yes", False: "no", schema.TEXT: "text tasks"}
    rows = sweep_table_rows()
    for key, numbers in sweep_file_keys().items():
        if numbers not in (None, WALKED):
            assert rows[key][1] == words[numbers], (key, rows[key][1])
