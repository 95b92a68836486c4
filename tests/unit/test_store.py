"""Tier 1: the result store and the leaderboard built from it."""

import csv
import io
import json
import os
from datetime import datetime, timedelta, timezone

import pyarrow.dataset as pads
import pytest

from rayeval.errors import StoreError
from rayeval.ranking import build_board, latest_rows
from rayeval.reporting.render import to_csv, to_json, to_markdown
from rayeval.io.store import SCHEMA, ResultStore


def rows(checkpoint, step, values, sweep="s", dataset="d", when=None):
    higher = {"accuracy": True, "nll": False}
    out = []
    for metric, value in values.items():
        r = {"sweep": sweep, "checkpoint": checkpoint, "step": step, "evaluation": dataset,
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
    from rayeval.io.store import SCHEMA as S
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
    # the win rate: a loses x to b, and y has no other checkpoint to beat; the mean: 0.7
    assert a.value("aggregate") == 0.0 and b.value("aggregate") is None
    assert build_board(data, aggregate="mean").entries[0].value("aggregate") == \
        pytest.approx(0.7)
    assert (a.marks, b.marks) == ({"aggregate": "*", "y/accuracy": "*"}, {"x/accuracy": "*"})


def test_json_rows_have_the_store_fields(tmp_path):
    store = ResultStore(str(tmp_path))
    store.write_cell("abc", rows("/c/a.pt", 1, {"accuracy": float("nan")}))
    out = json.loads(to_json(latest_rows(store.read())))
    assert out[0]["value"] is None and out[0]["created_at"].endswith("+00:00")
    assert {"sweep", "checkpoint", "step", "evaluation", "metric", "value", "ci_low", "ci_high",
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
    from rayeval.ranking import paired

    p = paired(data[0], data[2])
    assert p.difference == pytest.approx(0.1) and p.a_better == 1.0
    assert p.ci_low == pytest.approx(0.1) and p.ci_high == pytest.approx(0.1)
    other = dict(data[2], bootstrap="seed=1;buckets=1024;replicates=200;confidence=0.95")
    assert paired(data[0], other) is None          # different resamples: no pairing


def test_files_written_before_epoch_and_num_tokens_read_with_nulls(tmp_path):
    # A store written by an earlier rayeval has neither column: read together with a new
    # file, its rows get nulls there (the dataset is read with SCHEMA).
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rayeval.core.evaluate import MetricResult
    from rayeval.io.store import cell_rows

    old_schema = pa.schema([f for f in SCHEMA if f.name not in ("epoch", "num_tokens")])
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    old = [{**r, "cell": "old", "created_at": now}
           for r in rows("/c/step_1.pt", 1, {"accuracy": 0.5})]
    (tmp_path / "results").mkdir()
    pq.write_table(pa.Table.from_pylist(old, schema=old_schema),
                   tmp_path / "results" / "old.parquet")
    store = ResultStore(str(tmp_path))
    store.write_cell("new", cell_rows(
        sweep="s", checkpoint="/c/epoch=3-step=9.ckpt", step=9, epoch=3, evaluation="d",
        results={"nll": MetricResult(2.0)}, higher_is_better={"nll": False}, num_samples=4,
        num_tokens=57, world_size=1, bootstrap_key="x"))
    table = store.read()
    assert table.schema == SCHEMA
    got = {r["cell"]: (r["step"], r["epoch"], r["num_samples"], r["num_tokens"])
           for r in table.to_pylist()}
    assert got == {"old": (1, None, 10, None), "new": (9, 3, 4, 57)}
    out = json.loads(to_json(latest_rows(table)))
    assert {r["checkpoint"]: r["num_tokens"] for r in out} == {
        "/c/step_1.pt": None, "/c/epoch=3-step=9.ckpt": 57}


def epoch_rows(checkpoint, step, epoch, value, sweep="s"):
    return [{**r, "epoch": epoch} for r in rows(checkpoint, step, {"accuracy": value}, sweep)]


@pytest.mark.parametrize("names,axis,xs", [
    # every point has a step: steps, as before epochs were stored
    ([("step_20.pt", 20, None), ("epoch=1-step=10.ckpt", 10, 1)], "step", [10, 20]),
    # no step anywhere, every point an epoch: the epoch
    ([("epoch_8.pt", None, 8), ("epoch_10.pt", None, 10)], "epoch", [8, 10]),
    # every point has an epoch, only some a step: the epoch shows them all
    ([("epoch_8.pt", None, 8), ("epoch=9-step=90.ckpt", 90, 9)], "epoch", [8, 9]),
    # mixed (one has only a step, one only an epoch): steps only, as before
    ([("step_20.pt", 20, None), ("epoch_8.pt", None, 8)], "step", [20]),
    # no step anywhere, not every point an epoch: what has an epoch
    ([("last.pt", None, None), ("epoch_8.pt", None, 8)], "epoch", [8]),
])
def test_plot_draws_against_the_epoch_when_no_point_has_a_step(names, axis, xs):
    from rayeval.reporting.plot import LABELS, axis_of, series

    data = []
    for i, (name, step, epoch) in enumerate(names):
        data += epoch_rows(f"/c/{name}", step, epoch, 0.5 + i / 10)
    board = build_board(data)
    column = board.column("accuracy")
    assert axis_of(board, column) == axis
    assert [p[0] for p in series(board, [column])["accuracy"]["s"]] == xs
    assert LABELS[axis] == {"step": "training step", "epoch": "epoch"}[axis]


def test_plot_of_several_evaluations_takes_the_epoch_from_the_rows_under_the_aggregate():
    from rayeval.reporting.plot import axis_of, series

    data = []
    for epoch in (1, 2, 3):
        for dataset in ("val", "ood"):
            data += [{**r, "evaluation": dataset, "epoch": epoch}
                     for r in rows(f"/c/epoch_{epoch}.pt", None, {"accuracy": epoch / 10})]
    board = build_board(data)
    assert [axis_of(board, c) for c in board.columns] == ["epoch"] * 3
    got = series(board, board.columns)
    assert [p[0] for p in got["aggregate"]["s"]] == [1, 2, 3]
    assert [p[1] for p in got["val/accuracy"]["s"]] == pytest.approx([0.1, 0.2, 0.3])


def test_plot_labels_an_epoch_axis(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from rayeval.reporting.plot import figure, plot

    data = epoch_rows("/c/epoch_8.pt", None, 8, 0.5) + epoch_rows("/c/epoch_9.pt", None, 9, 0.6)
    board = build_board(data)
    fig = figure(board, board.columns)
    try:
        (ax,) = [a for a in fig.axes if a.get_visible() and a.get_title()]
        assert ax.get_xlabel() == "epoch"
        assert list(ax.get_lines()[0].get_xdata()) == [8, 9]
    finally:
        plt.close(fig)
    assert plot(board, board.columns, str(tmp_path / "p.png")) == 2


def test_per_item_records_of_a_worker_given_no_rows_are_read_with_the_others(tmp_path):
    """A worker the split gave no rows writes a table without columns; reading the cell's
    records takes the other workers' rows (pyarrow cannot concatenate the two schemas)."""
    import pyarrow as pa

    from rayeval.core.samples import records_table

    store = ResultStore(str(tmp_path / "out"))
    rows_of = records_table([{"id": [1, 2], "response": ["a", "b"], "exact_match": [1.0, 0.0]}])
    store.write_samples("cell", "tag", 0, 3, rows_of)
    store.write_samples("cell", "tag", 1, 3, records_table([]))
    store.write_samples("cell", "tag", 2, 3, records_table([]))
    got = store.read_samples("cell", "tag")
    assert got.equals(rows_of) and isinstance(got, pa.Table)


def test_a_damaged_records_file_is_one_line_naming_it(tmp_path):
    """Issue 56: a damaged records file gave "Could not open Parquet input source '<Buffer>'",
    naming no file; the line names it and what brings the records back."""
    from rayeval.core.samples import records_table
    from rayeval.errors import StoreError

    store = ResultStore(str(tmp_path / "out"))
    store.write_samples("cell", "tag", 0, 2, records_table([{"id": [1], "response": ["a"]}]))
    store.write_samples("cell", "tag", 1, 2, records_table([{"id": [2], "response": ["b"]}]))
    assert store.read_samples("cell", "tag").num_rows == 2
    damaged = tmp_path / "out" / "samples" / "cell" / "tag-00001-of-00002.parquet"
    damaged.write_bytes(b"\0" * 200)
    with pytest.raises(StoreError) as error:
        store.read_samples("cell", "tag")
    line = str(error.value)
    assert line.startswith(f"cannot read per-item records: {damaged} is damaged (")
    assert line.endswith("; the cell's results are whole, and `rayeval run --force` writes "
                         "them and their records again")
    assert "\n" not in line and "<Buffer>" not in line
