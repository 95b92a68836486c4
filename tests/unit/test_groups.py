"""Tier 1: an lm-eval group's aggregate from its members' stored rows, as lm-eval's
``aggregate_subtask_metrics`` computes it, and how boards show a group."""

from types import SimpleNamespace

import pytest

from rayeval.config.schema import GroupMetric, GroupSpec
from rayeval.plan.cells import Cell
from rayeval.ranking import aggregates, members, without_members
from rayeval.plan.groups import group_cell_key, group_rows, publish
from rayeval.io.store import ResultStore


def _row(dataset, metric, value, n, reps=None, checkpoint="c1"):
    return {"sweep": "s", "checkpoint": checkpoint, "step": 1, "epoch": None,
            "evaluation": dataset, "metric": metric, "value": value, "num_samples": n,
            "world_size": 2, "higher_is_better": True, "replicates": reps,
            "bootstrap": "seed=0;replicates=3;confidence=0.95" if reps else None,
            "cell": f"cell-{dataset}", "created_at": None, "matrix": None}


def _group(weight):
    return GroupSpec("g", ("g/a", "g/b"),
                     (GroupMetric("acc", (("g/a", "acc"), ("g/b", "acc")), weight, True),))


def test_weighted_by_size_or_not_as_lm_eval():
    from lm_eval.api.metrics import aggregate_subtask_metrics

    stored = {"g/a": {"acc": _row("g/a", "acc", 0.5, 10, [0.4, 0.5, 0.6])},
              "g/b": {"acc": _row("g/b", "acc", 0.9, 30, [0.8, 0.9, 1.0])}}
    for weight in (True, False):
        (row,) = group_rows(_group(weight), stored)
        assert row["value"] == aggregate_subtask_metrics([0.5, 0.9], [10, 30], weight)
        assert row["evaluation"] == "g" and row["num_samples"] == 40
        w = (10, 30) if weight else (1, 1)
        assert row["replicates"] == pytest.approx(
            [(w[0] * a + w[1] * b) / sum(w) for a, b in zip([0.4, 0.5, 0.6], [0.8, 0.9, 1.0])])
        assert row["ci_low"] <= row["value"] <= row["ci_high"]


def test_no_aggregate_until_every_member_is_stored():
    stored = {"g/a": {"acc": _row("g/a", "acc", 0.5, 10)}}
    assert group_rows(_group(True), stored) is None


def test_the_aggregate_cell_follows_its_members_cells():
    g = _group(True)
    assert group_cell_key(g, ["x", "y"]) == group_cell_key(g, ["y", "x"])
    assert group_cell_key(g, ["x", "y"]) != group_cell_key(g, ["x", "z"])
    assert group_cell_key(g, ["x", "y"]) != group_cell_key(_group(False), ["x", "y"])


def test_a_board_shows_the_group_and_counts_it_once():
    rows = [_row("g", "acc", 0.8, 40), _row("g/a", "acc", 0.5, 10),
            _row("g/b", "acc", 0.9, 30), _row("other", "acc", 0.2, 5),
            _row("lone/x", "acc", 0.3, 5)]                 # no group row: shown as it is
    assert members(r["evaluation"] for r in rows) == {"g/a", "g/b"}
    assert sorted(r["evaluation"] for r in without_members(rows)) == ["g", "lone/x", "other"]
    (agg,) = aggregates(rows)
    assert sorted(agg["evaluations"]) == ["g", "lone/x", "other"]
    assert agg["value"] == pytest.approx((0.8 + 0.2 + 0.3) / 3)


def test_publish_reads_only_the_members_cells_and_writes_each_aggregate_once(tmp_path):
    store = ResultStore(str(tmp_path / "store"))
    for key, dataset, value, n in (("c1-a", "g/a", 0.5, 10), ("c1-b", "g/b", 0.9, 30),
                                   ("c2-a", "g/a", 0.1, 10)):
        row = _row(dataset, "acc", value, n, checkpoint=key[:2])
        row.pop("created_at")
        store.write_cell(key, [row])
    # Another sweep's cell the run has nothing to do with, unreadable: never opened.
    (tmp_path / "store" / "results" / "other.parquet").write_bytes(b"not parquet")
    c1, c2 = SimpleNamespace(location="c1"), SimpleNamespace(location="c2")
    plan = SimpleNamespace(
        sweep=SimpleNamespace(name="s", groups=(_group(True),), output=str(tmp_path / "store")),
        cached=(Cell(c1, "g/a", "c1-a"),),                 # stored by an earlier run
        cells=(Cell(c1, "g/b", "c1-b"), Cell(c2, "g/a", "c2-a"),
               Cell(c2, "g/b", "c2-b")))                   # c2-b failed: not stored
    assert publish(plan, store) == 1
    (row,) = store.read_cell(group_cell_key(_group(True), ["c1-a", "c1-b"]))
    assert (row["evaluation"], row["checkpoint"], row["num_samples"]) == ("g", "c1", 40)
    assert row["value"] == pytest.approx((0.5 * 10 + 0.9 * 30) / 40)
    assert publish(plan, store) == 0                       # stored already
