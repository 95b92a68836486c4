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
    assert found["annotation_cycles"] == []       # TYPE_CHECKING imports counted too


def test_a_cycle_held_by_an_annotation_import_is_found(tmp_path):
    pkg = tmp_path / "rayeval" / "ranking"
    pkg.mkdir(parents=True)
    (tmp_path / "rayeval" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from rayeval.ranking.b import B\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                              "    from rayeval.ranking.a import A\nB = 1\n")
    found = layers.measure(str(tmp_path))
    assert found["module_cycles"] == []
    assert found["annotation_cycles"] == [["rayeval.ranking.a", "rayeval.ranking.b"]]


def test_no_import_up_the_ladder_between_top_level_packages():
    # errors/config < io < core < harness < plan < execution < reporting < api < integrations
    # < ui, at top-level-package granularity: execution and its subpackages are one floor.
    # Strings naming a module count too: core's lazy "rayeval.harness.task:Harness" is up.
    assert layers.upward_imports(layers.REPO) == []


def test_every_top_level_package_has_a_floor():
    tops = {layers.top_of(m) for m in layers.modules_of(layers.REPO)}
    assert all(layers.floor_of(t) >= 0 for t in tops)


def test_the_ladder_check_sees_an_upward_import(tmp_path):
    pkg = tmp_path / "rayeval"
    for name in ("io", "reporting"):
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "reporting" / "boards.py").write_text("")
    (pkg / "io" / "store.py").write_text("def f():\n    from rayeval.reporting import boards\n")
    assert layers.upward_imports(str(tmp_path)) == [
        f"{os.path.join('rayeval', 'io', 'store.py')}:2 -> rayeval.reporting.boards"]


def test_the_ladder_check_sees_an_upward_reference_by_name(tmp_path):
    # A lazy registration ("module:Name", imported when the name is first asked for) from a
    # lower floor names a higher one as surely as an import does; an f-string's module counts.
    pkg = tmp_path / "rayeval"
    for name in ("core", "harness", "plan"):
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "harness" / "task.py").write_text("")
    (pkg / "core" / "tasks.py").write_text(
        'LAZY = "rayeval.harness.task:Harness"\n'
        'MORE = [f"rayeval.harness.task:{n}" for n in "ab"]\n'
        'DOC = "rayeval.harness.task names the task"\n')      # prose, not a reference
    (pkg / "plan" / "x.py").write_text('DOWN = "rayeval.harness.task:Harness"\n')
    where = os.path.join("rayeval", "core", "tasks.py")
    assert layers.upward_imports(str(tmp_path)) == [
        f"{where}:1 -> rayeval.harness.task (by name)",
        f"{where}:2 -> rayeval.harness.task (by name)"]


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
