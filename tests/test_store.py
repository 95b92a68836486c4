"""Tier 1: the result store and the leaderboard built from it."""

import csv
import io
import json
import os
from datetime import datetime, timedelta, timezone

import pyarrow.dataset as pads
import pytest

from rayeval.errors import StoreError
from rayeval.leaderboard import build_board, latest_rows, to_csv, to_json, to_markdown
from rayeval.store import SCHEMA, ResultStore


def rows(checkpoint, step, values, sweep="s", dataset="d", when=None):
    higher = {"accuracy": True, "nll": False}
    out = []
    for metric, value in values.items():
        r = {"sweep": sweep, "checkpoint": checkpoint, "step": step, "dataset": dataset,
             "metric": metric, "value": value, "ci_low": None, "ci_high": None,
             "num_samples": 10, "world_size": 2, "higher_is_better": higher[metric]}
        if when:
            r["created_at"] = when
        out.append(r)
    return out


def test_store_roundtrip_is_a_pyarrow_dataset(tmp_path):
    store = ResultStore(str(tmp_path / "out"))
    assert store.read().num_rows == 0 and not store.has("abc")
    store.write_cell("abc", rows("/c/step_1.pt", 1, {"accuracy": 0.5, "nll": 1.0}))
    store.write_cell("def", rows("/c/step_2.pt", 2, {"accuracy": 0.7, "nll": 0.8}))
    assert store.has("abc")
    table = pads.dataset(str(tmp_path / "out" / "results"), format="parquet").to_table()
    assert table.num_rows == 4
    assert set(SCHEMA.names) <= set(table.schema.names)
    assert table.schema.field("value").type == SCHEMA.field("value").type
    assert sorted(os.listdir(tmp_path / "out" / "results")) == ["abc.parquet", "def.parquet"]


def test_rewriting_a_cell_replaces_it_without_duplicates(tmp_path):
    store = ResultStore(str(tmp_path))
    store.write_cell("abc", rows("/c/a.pt", 1, {"accuracy": 0.5}))
    store.write_cell("abc", rows("/c/a.pt", 1, {"accuracy": 0.6}))
    table = store.read()
    assert table.num_rows == 1 and table.column("value").to_pylist() == [0.6]
    assert not [f for f in os.listdir(tmp_path / "results") if f.startswith(".tmp")]


def test_hidden_partial_files_are_ignored(tmp_path):
    store = ResultStore(str(tmp_path))
    store.write_cell("abc", rows("/c/a.pt", 1, {"accuracy": 0.5}))
    (tmp_path / "results" / ".tmp-123-xyz.parquet").write_bytes(b"half a file")
    assert store.read().num_rows == 1


def test_unwritable_store_is_one_clear_error(tmp_path):
    (tmp_path / "file").write_text("x")
    store = ResultStore(str(tmp_path / "file"))
    with pytest.raises(StoreError, match="cannot write to result store"):
        store.write_cell("abc", rows("/c/a.pt", 1, {"accuracy": 0.5}))


def test_latest_row_wins():
    from rayeval.store import SCHEMA as S
    import pyarrow as pa

    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    data = rows("/c/a.pt", 1, {"accuracy": 0.5}, when=t0) + \
        rows("/c/a.pt", 1, {"accuracy": 0.9}, when=t0 + timedelta(seconds=1))
    table = pa.Table.from_pylist([{**r, "cell": "k"} for r in data], schema=S)
    assert [r["value"] for r in latest_rows(table)] == [0.9]


def test_board_ranks_per_metric_direction():
    data = rows("/r/ckpts/step_1.pt", 1, {"accuracy": 0.5, "nll": 1.0}) + \
        rows("/r/ckpts/step_2.pt", 2, {"accuracy": 0.8, "nll": 1.2}) + \
        rows("/r/ckpts/step_3.pt", 3, {"accuracy": 0.7, "nll": 0.4})
    by_acc = build_board(data)
    assert by_acc.rank_by == "accuracy"
    assert [e.step for e in by_acc.entries] == [2, 3, 1]
    assert [e.best for e in by_acc.entries] == [True, False, False]
    by_nll = build_board(data, "nll")
    assert [e.step for e in by_nll.entries] == [3, 1, 2]
    md = to_markdown(by_nll)
    assert md.splitlines()[2].startswith("| 1 * | s | d | step_3.pt | 3 |")
    parsed = list(csv.DictReader(io.StringIO(to_csv(by_nll))))
    assert parsed[0]["checkpoint"] == "/r/ckpts/step_3.pt" and float(parsed[0]["nll"]) == 0.4
    with pytest.raises(StoreError, match="no results for metric 'f1'"):
        build_board(data, "f1")


def test_board_of_several_datasets_has_one_row_per_checkpoint():
    # A store with several data sets (evaluations) is one row per checkpoint, one column per
    # data set and metric, and an aggregate over data sets (ranked first when some
    # checkpoint has every data set).
    data = rows("/a.pt", 1, {"accuracy": 0.5}, dataset="x") + \
        rows("/b.pt", 2, {"accuracy": 0.6}, dataset="x") + \
        rows("/a.pt", 1, {"accuracy": 0.9}, dataset="y")
    board = build_board(data)
    assert board.metrics == ["aggregate", "x/accuracy", "y/accuracy"]
    assert board.rank_by == "aggregate"
    assert [(e.checkpoint, e.rank, e.best) for e in board.entries] == [
        ("/a.pt", 1, True), ("/b.pt", 2, False)]
    a, b = board.entries
    assert a.value("aggregate") == pytest.approx(0.7) and b.value("aggregate") is None
    assert (a.marks, b.marks) == ({"aggregate": "*", "y/accuracy": "*"}, {"x/accuracy": "*"})


def test_json_rows_have_the_store_fields(tmp_path):
    store = ResultStore(str(tmp_path))
    store.write_cell("abc", rows("/c/a.pt", 1, {"accuracy": float("nan")}))
    out = json.loads(to_json(latest_rows(store.read())))
    assert out[0]["value"] is None and out[0]["created_at"].endswith("+00:00")
    assert {"sweep", "checkpoint", "step", "dataset", "metric", "value", "ci_low", "ci_high",
            "num_samples", "world_size", "created_at"} <= set(out[0])


def test_empty_board_is_an_error():
    with pytest.raises(StoreError, match="holds no results"):
        build_board([])


def test_best_and_not_distinguishable_marks_use_paired_replicates():
    import numpy as np

    rng = np.random.default_rng(0)
    base = rng.normal(0.7, 0.02, 200)
    key = "seed=0;buckets=1024;replicates=200;confidence=0.95"

    def row(name, value, reps):
        r = rows(f"/c/{name}", None, {"accuracy": value})[0]
        return {**r, "replicates": list(reps), "bootstrap": key}

    data = [row("best.pt", 0.70, base),
            row("tied.pt", 0.699, base - 0.001 + rng.normal(0, 0.002, 200)),   # within noise
            row("worse.pt", 0.60, base - 0.1)]
    board = build_board(data)
    marks = {e.checkpoint.rsplit("/", 1)[-1]: e.marks.get("accuracy", "") for e in board.entries}
    assert marks == {"best.pt": "*", "tied.pt": "~", "worse.pt": ""}
    from rayeval.leaderboard import paired

    p = paired(data[0], data[2])
    assert p.difference == pytest.approx(0.1) and p.a_better == 1.0
    assert p.ci_low == pytest.approx(0.1) and p.ci_high == pytest.approx(0.1)
    other = dict(data[2], bootstrap="seed=1;buckets=1024;replicates=200;confidence=0.95")
    assert paired(data[0], other) is None          # different resamples: no pairing
