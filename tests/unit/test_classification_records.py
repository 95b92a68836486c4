"""Tier 1: a classification's per-item records (the predicted class, its probability, the
target, the per-item metric values, an image item's thumbnails), built as a worker builds them
(``Decoder`` + ``Pass``, a kept shard, the transform's Ray Data stage) without Ray; and the
commands that read them back (``samples``, ``leaderboard --format html --samples-dir``) on a
store written as workers write one, with records and without."""

from __future__ import annotations

import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rayeval.config.schema import DatasetSpec, EvalSpec
from rayeval.core import samples, tasks
from rayeval.core.evaluate import Decoder, MetricResult, Pass, decoded_batches
from rayeval.core.metrics import build_all, parse_metric
from rayeval.errors import SpecError
from rayeval.io.data import inspect_dataset
from rayeval.io.store import ResultStore, cell_rows
from rayeval.plan.loader import load_sweep
from support import CLASSES, FEATURES, make_data, rayeval_main, write_parquet, write_sweep

CLASSIFICATION = tasks.get("classification")
METRICS = ("accuracy", "nll", "macro_f1")


def integer_model(seed: int = 0) -> torch.nn.Module:
    """Integer weights on integer inputs: every logit is exact whatever the batch, so a
    plain loop's figures are the pass's to the bit."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, CLASSES))
    model.load_state_dict({k: torch.randint(-2, 3, v.shape).float()
                           for k, v in model.state_dict().items()})
    return model.eval()


def integer_data(n: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(-3, 4, size=(n, FEATURES)).astype(np.float32),
            rng.integers(0, CLASSES, size=n))


def evaluation(path, samples_on: bool = True, batch_size: int = 7, **dataset) -> EvalSpec:
    spec = DatasetSpec(**{"path": str(path), "inputs": ("x",), "target": "y", **dataset})
    return EvalSpec(name="val", task="classification", dataset=spec,
                    metrics=tuple(parse_metric(m, "classification", "") for m in METRICS),
                    batch_size=batch_size, samples=samples_on)


def records_of(model, ev: EvalSpec, batches) -> pa.Table:
    p = Pass(model, build_all(ev.metrics), CLASSES, torch.device("cpu"), "classification",
             ev.bootstrap.k, ev.dataset, samples=True)
    for x, y, buckets in batches:
        p.update(x, y, buckets)
    p.finish()
    return p.sample_table()


def plain_loop(model, x: np.ndarray, y: np.ndarray) -> dict[str, list]:
    """What each item's record must say, from one forward pass over every row."""
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
    pred = logits.argmax(dim=1)
    prob = torch.softmax(logits.double(), dim=1)
    logp = torch.log_softmax(logits.double(), dim=1)
    target = torch.from_numpy(y)
    return {"response": [str(c) for c in pred.tolist()],
            "probability": prob.max(dim=1).values.tolist(),
            "accuracy": (pred == target).double().tolist(),
            "nll": (-logp.gather(1, target.view(-1, 1)).squeeze(1)).tolist()}


def test_each_item_keeps_its_prediction_probability_target_and_metric_values(tmp_path):
    x, y = integer_data(50)
    write_parquet(str(tmp_path / "d.parquet"), x, y)
    ev = evaluation(tmp_path / "d.parquet", id="row")      # 7 batches of 7, then one row
    info = inspect_dataset(ev.dataset, CLASSIFICATION)
    model = integer_model()
    table = records_of(model, ev, decoded_batches(ev, info))
    want = plain_loop(model, x, y)
    assert table.column_names == ["id", "target", "response", "probability", "accuracy", "nll"]
    assert table.schema.field("probability").type == pa.float64()
    assert table.schema.field("target").type == pa.string()       # as every record's target
    got = table.to_pydict()
    assert got["id"] == list(range(50)) and got["target"] == [str(c) for c in y]
    for name in ("response", "probability", "accuracy", "nll"):
        assert got[name] == want[name], name
    assert 0 < sum(got["accuracy"]) < 50, "some right, some wrong"


def test_without_an_id_column_an_item_is_named_by_its_bootstrap_content_id(tmp_path):
    x, y = integer_data(20)
    write_parquet(str(tmp_path / "d.parquet"), x, y)
    ev = evaluation(tmp_path / "d.parquet")
    info = inspect_dataset(ev.dataset, CLASSIFICATION)
    x_rec, y_rec, _ = Decoder(ev, info, "")(pq.read_table(tmp_path / "d.parquet"))
    raw = x_rec.inputs
    assert x_rec.items["id"] == CLASSIFICATION.row_ids(None, ev.dataset, raw, y_rec).tolist()
    assert torch.equal(CLASSIFICATION.row_ids(None, ev.dataset, x_rec, y_rec),
                       CLASSIFICATION.row_ids(None, ev.dataset, raw, y_rec))


def test_records_ride_with_their_rows_through_a_kept_shard_and_a_race_round(tmp_path):
    """The worker keeps a decoded shard for later passes: the items come back with the same
    rows, and a race's round (``take``) keeps each row's own item."""
    from rayeval.execution.workers.shards import Budget, Shard
    from rayeval.io.data import RowRange

    x, y = integer_data(300)
    write_parquet(str(tmp_path / "d.parquet"), x, y, row_group_size=64)
    ev = evaluation(tmp_path / "d.parquet", batch_size=64, id="row")
    info = inspect_dataset(ev.dataset, CLASSIFICATION)
    shard = Shard(RowRange(info, ev.dataset.columns, 10, 250, "dataset.path"),
                  Decoder(ev, info, ""), 64, Budget(1 << 30))
    first = [(b[0].items["id"], b[0].inputs.clone()) for b in shard]
    shard.agree(any_overflow=False)
    again = list(shard)
    assert shard.use_cache and [b[0].items["id"] for b in again] == [f[0] for f in first]
    assert all(torch.equal(b[0].inputs, f[1]) for b, f in zip(again, first))
    assert sum(len(f[0]) for f in first) == 240
    x0, y0, _ = again[0]
    index = torch.tensor([3, 0, 17])
    part = tasks.take(x0, index, tasks.rows_of(x0))
    assert part.items["id"] == [13, 10, 27] and torch.equal(part.inputs, x0.inputs[index])
    assert tasks.nbytes(x0) > tasks.nbytes(x0.inputs)


@pytest.mark.parametrize("samples_on", [True, False])
def test_a_bucket_range_of_a_kept_shard_is_its_rows_without_a_pass(tmp_path, samples_on):
    """A segment of a resumed cell or a race's round takes the rows of a range of bootstrap
    buckets. From a kept shard they come from an index by bucket made once (issue 56: a pass
    over the whole shard per segment sized the segments to half a big cell): the same rows,
    items and figures as filtering every batch, in full batches, and the pass over them
    touches no other batch."""
    from rayeval.execution.workers.scorer import _within
    from rayeval.execution.workers.shards import Budget, Shard
    from rayeval.io.data import RowRange

    x, y = integer_data(700)
    write_parquet(str(tmp_path / "d.parquet"), x, y, row_group_size=64)
    ev = evaluation(tmp_path / "d.parquet", samples_on=samples_on, batch_size=64, id="row")
    info = inspect_dataset(ev.dataset, CLASSIFICATION)
    shard = Shard(RowRange(info, ev.dataset.columns, 5, 650, "dataset.path"),
                  Decoder(ev, info, ""), 64, Budget(1 << 30))
    assert shard.within(0, 10) is None, "not kept yet: the caller filters each batch"
    streamed = list(shard)
    shard.agree(any_overflow=False)
    k = ev.bootstrap.k
    def joined(batches):
        return [torch.cat([tasks.inputs_of(b[0]) for b in batches]),
                torch.cat([b[1] for b in batches]), torch.cat([b[2] for b in batches])]

    for lo, hi in ((0, k // 32), (k // 3, k // 2), (k - 100, k), (0, k // 2)):
        filtered = [b for b in (_within(*b, lo, hi) for b in streamed) if len(b[2])]
        indexed = list(shard.within(lo, hi))
        assert filtered and all(len(b[2]) == 64 for b in indexed[:-1]), "full batches"
        # the same rows in the same (the shard's) order: inputs, targets, buckets, items
        assert all(torch.equal(a, b) for a, b in zip(joined(indexed), joined(filtered)))
        assert ((joined(indexed)[2] >= lo) & (joined(indexed)[2] < hi)).all()
        if samples_on:
            assert [i for b in indexed for i in b[0].items["id"]] == \
                [i for b in filtered for i in b[0].items["id"]]
            assert records_of(integer_model(), ev, indexed).equals(
                records_of(integer_model(), ev, filtered))
    assert list(shard.within(5, 5)) == []
    # ranges that cover the buckets give every row of the shard once
    parts = [b for a, c in ((0, 100), (100, 513), (513, k)) for b in shard.within(a, c)]
    whole = joined(streamed)
    assert sum(len(b[2]) for b in parts) == 645
    assert sorted(joined(parts)[2].tolist()) == sorted(whole[2].tolist())
    shard.reset()
    assert shard.within(0, k) is None, "forgotten with the kept shard"


def test_without_records_the_batch_is_the_model_inputs_alone(tmp_path):
    x, y = integer_data(10)
    write_parquet(str(tmp_path / "d.parquet"), x, y)
    ev = evaluation(tmp_path / "d.parquet", samples_on=False)
    info = inspect_dataset(ev.dataset, CLASSIFICATION)
    (batch, _, _), = decoded_batches(ev, info, batch_size=64)
    assert isinstance(batch, torch.Tensor)


# --- image classification: thumbnails beside the record ---------------------------------------

DECODE = '''
import io

import numpy as np
import torch
from PIL import Image


def decode(table):
    images = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB").resize((16, 16)))
              for b in table.column("image").to_pylist()]
    return torch.from_numpy(np.stack(images).astype(np.float32) / 255).permute(0, 3, 1, 2)
'''


def _png(array: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def image_table(n: int = 6) -> tuple[pa.Table, list[np.ndarray]]:
    """n images: small RGB ones, one grey, one larger than a thumbnail."""
    rng = np.random.default_rng(4)
    pictures = [rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8) for _ in range(n - 2)]
    pictures += [rng.integers(0, 256, size=(16, 16), dtype=np.uint8),
                 rng.integers(0, 256, size=(120, 90, 3), dtype=np.uint8)]
    return pa.table({"id": pa.array(range(100, 100 + n)),
                     "image": pa.array([_png(p) for p in pictures], pa.binary()),
                     "label": pa.array([i % 3 for i in range(n)], pa.int64())}), pictures


def test_an_image_item_keeps_its_thumbnail_on_the_worker_and_from_the_stage(tmp_path):
    """The thumbnail of each image input, made where the images are: by the worker when it
    runs the transform itself, by the Ray Data stage when that runs it (the worker then never
    sees the images); the same bytes either way."""
    from PIL import Image

    from rayeval.execution.pipeline import Prepare
    from rayeval.io.model import import_callable

    pytest.importorskip("PIL")
    (tmp_path / "shapes_decode.py").write_text(DECODE)
    table, pictures = image_table()
    spec = DatasetSpec(path=str(tmp_path / "d.parquet"), inputs=("image",), target="label",
                       id="id", transform="shapes_decode:decode")
    own = SimpleDecoder()
    fn = import_callable(spec.transform, str(tmp_path), what="dataset.transform")
    x, y = CLASSIFICATION.decode(table, spec, {}, fn, own)
    thumbs = x.items["thumbnails"]
    assert [len(t) for t in thumbs] == [1] * 6
    for png, picture in zip(thumbs, pictures):
        small = Image.open(io.BytesIO(png[0]))
        assert small.format == "PNG" and max(small.size) <= samples.THUMBNAIL_PX
        assert png[0] == samples.thumbnail(Image.open(io.BytesIO(_png(picture))))
    assert Image.open(io.BytesIO(thumbs[4][0])).mode == "L", "a grey image stays grey"
    assert Image.open(io.BytesIO(thumbs[5][0])).size == (48, 64)
    staged = Prepare(spec, str(tmp_path), ["label", "id"], records=True)(table)
    assert "image" not in staged.column_names
    xs, ys = CLASSIFICATION.decode(staged, spec, {}, None, own)
    assert xs.items == x.items and torch.equal(xs.inputs, x.inputs) and torch.equal(ys, y)
    plain = Prepare(spec, str(tmp_path), ["label", "id"])(table)
    assert "thumbnails" not in CLASSIFICATION.decode(plain, spec, {}, None, own)[0].items


def test_a_binary_input_that_is_no_image_gets_no_thumbnail_and_fails_nothing():
    table = pa.table({"blob": pa.array([b"\x00\x01", b"not a png"], pa.binary()),
                      "label": pa.array([0, 1])})
    spec = DatasetSpec(path="d.parquet", inputs=("blob",), target="label",
                       transform="m:f")
    assert samples.image_thumbnails(table, spec) == [[], []]
    plain = pa.table({"x": pa.array([1.0]), "label": pa.array([0])})
    assert samples.image_thumbnails(plain, DatasetSpec(path="d", inputs=("x",))) is None


class SimpleDecoder:
    samples = True


# --- the sweep's default ---------------------------------------------------------------------

def test_classification_keeps_records_by_default_and_regression_cannot(tmp_path):
    write_parquet(str(tmp_path / "data.parquet"), *make_data(10))
    assert load_sweep(write_sweep(str(tmp_path))).evals[0].samples
    off = load_sweep(write_sweep(str(tmp_path), evals=[{
        "name": "v", "task": "classification", "samples": False, "metrics": ["accuracy"],
        "dataset": {"path": "data.parquet", "inputs": "x", "target": "y"}}], task=None,
        dataset=None, metrics=None))
    assert not off.evals[0].samples
    regression = load_sweep(write_sweep(str(tmp_path), task="regression", metrics=["mse"]))
    assert not regression.evals[0].samples
    with pytest.raises(SpecError, match="task regression keeps no per-item records \\(the text "
                                        "tasks and classification do\\)"):
        load_sweep(write_sweep(str(tmp_path), evals=[{
            "name": "v", "task": "regression", "samples": True, "metrics": ["mse"],
            "dataset": {"path": "data.parquet", "inputs": "x", "target": "y"}}], task=None,
            dataset=None, metrics=None))


# --- reading them back: samples and the leaderboard's pages ---------------------------------

def _store(tmp_path, records: bool) -> str:
    """Two checkpoints x two evaluations as workers write them: each cell's records (from a
    pass over the rows) under the run's tag, or none."""
    x, y = integer_data(40)
    write_parquet(str(tmp_path / "d.parquet"), x, y)
    ev = evaluation(tmp_path / "d.parquet", id="row")
    info = inspect_dataset(ev.dataset, CLASSIFICATION)
    s = ResultStore(str(tmp_path / "out"))
    for seed in (1, 2):
        table = records_of(integer_model(seed), ev, decoded_batches(ev, info))
        for name in ("clean", "noisy"):
            cell = f"{name}{seed}"
            if records:
                s.write_samples(cell, "tag", 0, 1, table)
            value = float(np.mean(table["accuracy"].to_numpy()))
            s.write_cell(cell, cell_rows(
                sweep="digits", checkpoint=f"/c/step_{seed}", step=seed, evaluation=name,
                results={"accuracy": MetricResult(value)}, higher_is_better={"accuracy": True},
                num_samples=40, world_size=1, bootstrap_key="k",
                samples="tag" if records else None))
    return str(tmp_path / "out")


def test_a_classification_store_s_pages_and_items(tmp_path):
    out = _store(tmp_path, records=True)
    page = rayeval_main("leaderboard", out, "--format", "html", "--samples-dir", "items",
                        cwd=str(tmp_path))
    assert page.returncode == 0, page.stderr
    written = sorted(os.listdir(tmp_path / "items"))
    assert len(written) == 4 and all(f'href="items/{f}"' in page.stdout for f in written)
    for name in written:
        text = (tmp_path / "items" / name).read_text()
        assert text.count('<div class="item') == 40 and "by accuracy" in text
    both = rayeval_main("samples", out, "--checkpoint", "step_2")
    assert both.returncode == 2 and "has per-item records for clean, noisy" in both.stderr
    one = rayeval_main("samples", out, "--checkpoint", "step_2", "--eval", "noisy",
                       "--format", "csv")
    assert one.returncode == 0, one.stderr
    header = one.stdout.splitlines()[0].split(",")
    assert header == ["id", "target", "response", "probability", "accuracy", "nll"]
    assert len(one.stdout.splitlines()) == 41


def test_a_store_without_records_is_refused_in_one_line_before_anything_is_written(tmp_path):
    out = _store(tmp_path, records=False)
    page = rayeval_main("leaderboard", out, "--format", "html", "--samples-dir", "items",
                        cwd=str(tmp_path))
    lines = page.stderr.strip().splitlines()
    assert page.returncode == 2 and len(lines) == 1 and page.stdout == "", page.stderr
    assert "--samples-dir: no cell of this board stored per-item records (its evaluations: " \
           "clean, noisy)" in lines[0]
    assert "samples on and --force, or leave out --samples-dir" in lines[0]
    assert not (tmp_path / "items").exists(), "no empty folder"
    items = rayeval_main("samples", out, "--checkpoint", "step_1")
    lines = items.stderr.strip().splitlines()
    assert items.returncode == 2 and len(lines) == 1
    assert "/c/step_1 stored no per-item records on any of its evaluations (clean, noisy)" \
        in lines[0] and "--force" in lines[0] and "for none" not in lines[0]
