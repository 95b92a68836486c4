"""Tier 1: the data set's inspection and the arrow-to-tensor conversion."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rayeval.core import tasks
from rayeval.config.schema import DatasetSpec, EvalSpec
from rayeval.io.data import inspect_dataset as inspect, number_tensor, target_tensor
from rayeval.errors import DataError
from rayeval.core.evaluate import decoded_batches
from support import make_data, write_parquet

CLASSIFICATION = tasks.get("classification")


def spec(path, inputs="x", target="y", id=None):
    return DatasetSpec(path=str(path), inputs=(inputs,), target=target, id=id)


def inspect_dataset(spec):
    return inspect(spec, CLASSIFICATION)


def to_tensors(table, inputs, target, shape):
    return (number_tensor(table, inputs, shape, "dataset.inputs"),
            target_tensor(table, target, "dataset.target"))


@pytest.mark.parametrize("list_type", ["fixed", "variable"])
def test_inspect_counts_rows_and_reads_back_every_row(tmp_path, list_type):
    x, y = make_data(1001)
    write_parquet(str(tmp_path / "d.parquet"), x, y, row_group_size=100, list_type=list_type)
    info = inspect_dataset(spec(tmp_path / "d.parquet"))
    assert info.num_rows == 1001 and info.shapes == {"x": (8,)}
    ev = EvalSpec(name="d", task="classification", dataset=spec(tmp_path / "d.parquet"),
                  metrics=(), batch_size=64)
    batches = list(decoded_batches(ev, info))
    xs = torch.cat([b[0] for b in batches])
    ys = torch.cat([b[1] for b in batches])
    assert torch.equal(xs, torch.from_numpy(x)) and torch.equal(ys, torch.from_numpy(y))


def test_folder_and_glob_of_files(tmp_path):
    x, y = make_data(30)
    (tmp_path / "parts").mkdir()
    for i in range(3):
        write_parquet(str(tmp_path / "parts" / f"part-{i}.parquet"), x[i::3], y[i::3])
    (tmp_path / "parts" / "_SUCCESS").write_text("")
    assert inspect_dataset(spec(tmp_path / "parts")).num_rows == 30
    assert inspect_dataset(spec(tmp_path / "parts" / "part-[01].parquet")).num_rows == 20


def test_nested_fixed_lists_and_scalar_inputs():
    images = pa.FixedSizeListArray.from_arrays(
        pa.FixedSizeListArray.from_arrays(pa.array(np.arange(12, dtype=np.float32)), 3), 2)
    t = pa.table({"img": images, "v": pa.array([1.5, 2.5]), "y": pa.array([0, 1])})
    x, y = to_tensors(t, "img", "y", (2, 3))
    assert x.shape == (2, 2, 3) and x[1, 1, 2] == 11
    x, _ = to_tensors(t, "v", "y", (1,))
    assert x.tolist() == [[1.5], [2.5]]


@pytest.mark.parametrize("change,match", [
    (dict(inputs="pixels"), r"dataset\.inputs: no column 'pixels' .* columns are: row, x, y"),
    (dict(target="label"), r"dataset\.target: no column 'label'"),
    (dict(id="rid"), r"dataset\.id: no column 'rid'"),
    (dict(target="x"), r"dataset\.target: column 'x' has type fixed_size_list"),
])
def test_bad_columns(tmp_path, change, match):
    x, y = make_data(10)
    write_parquet(str(tmp_path / "d.parquet"), x, y)
    with pytest.raises(DataError, match=match):
        inspect_dataset(spec(tmp_path / "d.parquet", **change))


def test_missing_empty_and_not_parquet(tmp_path):
    with pytest.raises(DataError, match=r"dataset\.path: no parquet file found"):
        inspect_dataset(spec(tmp_path / "nope.parquet"))
    x, y = make_data(0)
    write_parquet(str(tmp_path / "empty.parquet"), x.reshape(0, 8), y)
    with pytest.raises(DataError, match="has no rows"):
        inspect_dataset(spec(tmp_path / "empty.parquet"))
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="cannot read .* as parquet"):
        inspect_dataset(spec(tmp_path / "text.parquet"))


def test_string_inputs_refused(tmp_path):
    pq.write_table(pa.table({"x": ["a", "b"], "y": [0, 1]}), tmp_path / "d.parquet")
    with pytest.raises(DataError, match="holds string; expected numbers"):
        inspect_dataset(spec(tmp_path / "d.parquet"))


def test_ragged_lists_and_nulls_are_errors():
    t = pa.table({"x": pa.array([[1.0, 2.0], [3.0]]), "y": pa.array([0, 1])})
    with pytest.raises(DataError, match="lists of different lengths"):
        to_tensors(t, "x", "y", (2,))
    t = pa.table({"x": pa.array([[1.0, 2.0], None]), "y": pa.array([0, 1])})
    with pytest.raises(DataError, match="null values"):
        to_tensors(t, "x", "y", (2,))
    t = pa.table({"x": pa.array([[1.0, 2.0], [1.0, 2.0]]), "y": pa.array([0, None])})
    with pytest.raises(DataError, match=r"dataset\.target: .* null values"):
        to_tensors(t, "x", "y", (2,))


def test_nan_inputs_name_the_row_and_column(tmp_path):
    x, y = make_data(50)
    x[37, 2] = np.nan
    write_parquet(str(tmp_path / "d.parquet"), x, y)
    ev = EvalSpec(name="d", task="classification", metrics=(), batch_size=16,
                  dataset=DatasetSpec(path=str(tmp_path / "d.parquet"), inputs=("x",),
                                      target="y", id="row", key_path="evals[0].dataset"))
    info = inspect_dataset(ev.dataset)
    with pytest.raises(DataError, match=r"^evals\[0\]\.dataset\.inputs: column 'x' has NaN or "
                                        r"infinite values in the row with row = 37; drop or fill"):
        list(decoded_batches(ev, info))


@pytest.mark.parametrize("world", [1, 2, 3, 7, 64])
def test_row_ranges_read_every_row_exactly_once(tmp_path, world):
    """Each worker's rows, read straight from the files (uneven files, an empty one, row
    groups that straddle the shard boundaries): in order, disjoint, all of them."""
    from rayeval.io.data import RowRange

    offset = 0
    for i, (rows, group) in enumerate([(1001, 100), (7, 3), (0, 10), (5000, 5000), (333, 50)]):
        pq.write_table(pa.table({"i": np.arange(offset, offset + rows), "x": np.ones(rows)}),
                       tmp_path / f"part{i}.parquet", row_group_size=group)
        offset += rows
    spec = DatasetSpec(path=str(tmp_path), inputs=("x",), target="i")
    info = inspect(spec, tasks.get("regression"))
    assert info.num_rows == offset == sum(info.file_rows)
    seen = []
    for rank in range(world):
        start, stop = info.shard_rows(rank, world)
        assert stop - start in (offset // world, offset // world + 1)     # an even split
        mine = []
        for table in RowRange(info, ["i"], start, stop, "dataset.path").iter_batches(97):
            assert 0 < table.num_rows <= 97 and table.column_names == ["i"]
            mine += table.column("i").to_pylist()
        assert mine == list(range(start, stop))
        seen += mine
    assert seen == list(range(offset))


def test_a_row_range_names_a_file_it_cannot_read(tmp_path):
    from rayeval.io.data import RowRange

    write_parquet(tmp_path / "a.parquet", *make_data(50))
    spec = DatasetSpec(path=str(tmp_path / "a.parquet"), inputs=("x",), target="y")
    info = inspect(spec, tasks.get("classification"))
    (tmp_path / "a.parquet").write_bytes(b"not parquet any more")
    with pytest.raises(DataError, match=r"dataset.path: cannot read .*a.parquet"):
        list(RowRange(info, None, 0, 50, "dataset.path").iter_batches(10))


def test_a_kept_shard_is_the_streamed_one_in_one_block_per_tensor(tmp_path):
    """A worker keeps its decoded shard for later passes in one block per tensor (kept
    batches allocated one by one made the first pass's temporaries fault in fresh pages):
    the kept batches are the streamed ones, views of one storage, and a shard that would not
    fit the budget is not kept at all."""
    from rayeval.io.data import RowRange
    from rayeval.core.evaluate import Decoder
    from rayeval.execution.workers.shards import Budget, Shard

    x, y = make_data(1000, seed=3)
    write_parquet(str(tmp_path / "d.parquet"), x, y, row_group_size=128)
    s = spec(tmp_path / "d.parquet", id="row")
    info = inspect_dataset(s)
    ev = EvalSpec(name="d", task="classification", dataset=s, metrics=(), batch_size=64)

    def shard(budget):
        rows = RowRange(info, s.columns, 100, 701, "dataset.path")
        return Shard(rows, Decoder(ev, info, ""), 64, Budget(budget))

    kept = shard(1 << 30)
    streamed = [tuple(t.clone() for t in b) for b in kept]
    kept.agree(any_overflow=False)
    again = list(kept)
    assert len(again) == len(streamed) == 10 and kept.use_cache
    for a, b in zip(again, streamed):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert torch.equal(torch.cat([b[0] for b in again]), torch.from_numpy(x[100:701]))
    for i in range(3):       # inputs, targets, buckets: each one block
        assert len({b[i].untyped_storage().data_ptr() for b in again}) == 1

    full = sum(tasks.nbytes(b[0]) + b[1].nbytes + b[2].nbytes for b in streamed)
    small = shard(full // 2)
    assert len(list(small)) == 10 and small.overflowed        # streamed, not kept
    assert small.budget.left == full // 2
