"""The package's layering, measured by scripts/layers.py: no rayeval module, and no package,
imports one that imports it back (directly or around a longer loop)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "scripts"))

import layers  # noqa: E402


def test_no_import_cycle_between_modules_or_packages():
    found = layers.measure(layers.REPO)
    assert found["module_cycles"] == []
    assert found["package_cycles"] == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert layers.sccs(graph) == [["a", "b", "c"]]
    assert layers.sccs({"a": {"b"}, "b": set()}) == []


def test_test_modules_have_one_name_across_the_tiers():
    # pytest imports each test file under its base name: two tiers with the same file name stop
    # the whole suite at collection ("import file mismatch").
    tests = os.path.join(layers.REPO, "tests")
    seen = {}
    for tier in sorted(os.listdir(tests)):
        folder = os.path.join(tests, tier)
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            if name.startswith("test_") and name.endswith(".py"):
                seen.setdefault(name, []).append(tier)
    assert {name: tiers for name, tiers in seen.items() if len(tiers) > 1} == {}
