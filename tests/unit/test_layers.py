"""The package's layering, measured by scripts/layers.py: no rayeval module imports a module
that imports it back (directly or around a longer loop)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "scripts"))

import layers  # noqa: E402


def test_no_module_import_cycle():
    assert layers.measure(layers.REPO)["module_cycles"] == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert layers.sccs(graph) == [["a", "b", "c"]]
    assert layers.sccs({"a": {"b"}, "b": set()}) == []
