"""Tier 1: the data sources without Ray. Each format is found from its path (or
``dataset.format``), counted, and read back row for row as parquet reads it; a source that
cannot be read is one line naming the key and the path; a batch prepared on a Ray Data stage
carries the transform's tensors bit for bit."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rayeval.config.schema import DatasetSpec
from rayeval.core import prepared, tasks
from rayeval.errors import DataError, SpecError
from rayeval.io import sources
from rayeval.io.data import inspect_dataset, read_batches
from rayeval.plan.loader import parse_sweep
from support import make_data, write_parquet, write_source

CLASSIFICATION = tasks.get("classification")
KEY = "evals[0].dataset"


def spec(path, **kw):
    kw.setdefault("inputs", ("x",))
    return DatasetSpec(path=str(path), target="y", key_path=KEY, **kw)


def rows_of(info, ds):
    return pa.concat_tables(list(read_batches(info, ds, 37))).to_pylist()


@pytest.mark.parametrize("form", ["jsonl", "hf"])
def test_a_source_reads_back_the_rows_parquet_holds(tmp_path, form):
    x, y = make_data(211)
    mapping = write_source(str(tmp_path), form, x, y)
    write_parquet(str(tmp_path / "ref.parquet"), x, y)
    ref_spec = spec(tmp_path / "ref.parquet", id="row")
    ref = inspect_dataset(ref_spec, CLASSIFICATION)
    got_spec = spec(tmp_path / mapping["path"], id="row")
    info = inspect_dataset(got_spec, CLASSIFICATION)
    assert info.format == {"jsonl": "json"}.get(form, form)
    assert info.num_rows == 211 and info.shapes == ref.shapes == {"x": (8,)}
    got = rows_of(info, got_spec)
    want = rows_of(ref, ref_spec)
    assert [r["row"] for r in got] == [r["row"] for r in want]
    assert [r["y"] for r in got] == [r["y"] for r in want]
    assert np.array_equal(np.asarray([r["x"] for r in got], np.float32),
                          np.asarray([r["x"] for r in want], np.float32))


def test_csv_counts_and_types_come_from_the_whole_file(tmp_path):
    x, y = make_data(150)
    mapping = write_source(str(tmp_path), "csv", x, y)
    s = spec(tmp_path / mapping["path"], inputs=(), transform=mapping["transform"], id="row")
    info = inspect_dataset(s, CLASSIFICATION)
    assert (info.format, info.num_rows) == ("csv", 150)
    assert info.schema.field("x0").type == pa.float64()
    got = rows_of(info, DatasetSpec(path=s.path, inputs=("x0", "x7"), target="y"))
    assert np.array_equal(np.asarray([[r["x0"], r["x7"]] for r in got], np.float32),
                          x[:, [0, 7]])


def test_a_folder_of_images_is_counted_and_labelled_by_its_subfolders(tmp_path):
    from PIL import Image

    for i, label in enumerate(["cat", "dog", "cat", "owl", "dog"]):
        (tmp_path / "imgs" / label).mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((4, 4), i, np.uint8)).save(tmp_path / "imgs" / label / f"{i}.png")
    s = DatasetSpec(path=str(tmp_path / "imgs"), inputs=("image",), target="label",
                    transform="m:f", key_path=KEY)
    info = inspect_dataset(s, CLASSIFICATION)
    assert (info.format, info.num_rows) == ("images", 5)
    rows = rows_of(info, DatasetSpec(path=s.path, inputs=("image", "path", "class_name"),
                                     target="label"))
    assert [(r["path"], r["label"], r["class_name"]) for r in rows] == [
        ("cat/0.png", 0, "cat"), ("cat/2.png", 0, "cat"), ("dog/1.png", 1, "dog"),
        ("dog/4.png", 1, "dog"), ("owl/3.png", 2, "owl")]
    from PIL import Image as I
    import io

    assert np.asarray(I.open(io.BytesIO(rows[2]["image"])))[0, 0] == 1


def test_numbered_class_folders_are_their_numbers(tmp_path):
    from PIL import Image

    for label in (3, 10):
        (tmp_path / str(label)).mkdir()
        Image.fromarray(np.zeros((2, 2), np.uint8)).save(tmp_path / str(label) / "a.png")
    info = inspect_dataset(DatasetSpec(path=str(tmp_path / "*" / "*.png"), inputs=("image",),
                                       target="label", transform="m:f", key_path=KEY),
                           CLASSIFICATION)
    assert json.loads(info.schema.metadata[b"rayeval.classes"]) == {"10": 10, "3": 3}


def test_format_is_found_from_the_path_or_given(tmp_path):
    (tmp_path / "a.ndjson").write_text("{}")
    assert sources.detect(str(tmp_path / "a.ndjson"), None, KEY) == "json"
    assert sources.detect(str(tmp_path / "x.CSV"), None, KEY) == "csv"
    assert sources.detect(str(tmp_path / "*.parquet"), None, KEY) == "parquet"
    assert sources.detect(str(tmp_path / "data.txt"), "json", KEY) == "json"
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "state.json").write_text("{}")
    assert sources.detect(str(tmp_path / "d"), None, KEY) == "hf"


def one_line_error(s, *fragments):
    with pytest.raises(DataError) as info:
        inspect_dataset(s, CLASSIFICATION)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{KEY}.path: "), text
    for f in fragments:
        assert f in text, text
    return info.value


def test_unreadable_sources_are_one_line_naming_the_key_and_the_path(tmp_path):
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"x": [1.0], "y": 1}\nnot json at all\n')
    e = one_line_error(spec(bad), f"cannot read {str(bad)!r} as JSON lines (one object per line)")
    assert e.location == str(bad)
    ragged = tmp_path / "d.csv"
    ragged.write_text("x,y\n1.0,2\n3.0,4,5\n")
    one_line_error(spec(ragged, inputs=("x",)), f"cannot read {str(ragged)!r} as CSV")
    one_line_error(spec(tmp_path / "nope.jsonl"), "no json file found at", f"{KEY}.format")
    (tmp_path / "empty").mkdir()
    one_line_error(spec(tmp_path / "empty", format="images"), "no image file found at")
    not_arrow = tmp_path / "hf"
    not_arrow.mkdir()
    (not_arrow / "state.json").write_text(json.dumps({"_data_files": [{"filename": "a.arrow"}]}))
    (not_arrow / "a.arrow").write_bytes(b"garbage")
    one_line_error(spec(not_arrow), "as Hugging Face arrow files")


def test_a_hugging_face_folder_of_splits_names_them(tmp_path):
    import datasets

    table = pa.table({"x": [[1.0]], "y": [0]})
    datasets.DatasetDict({"train": datasets.Dataset(table), "test": datasets.Dataset(table)}) \
        .save_to_disk(str(tmp_path / "dd"))
    one_line_error(spec(tmp_path / "dd"), "holds several splits (test, train)",
                   f"e.g. {tmp_path / 'dd'}/test")


def test_an_unknown_format_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match=r"evals\[0\]\.dataset\.format: unknown format 'xml'; "
                                        r"choose one of: parquet, json, csv, hf, images"):
        parse_sweep({"name": "t", "model": {"factory": "m:f"}, "checkpoints": ["c"],
                     "evals": [{"name": "e", "task": "classification", "metrics": ["accuracy"],
                                "dataset": {"path": "d", "inputs": "x", "target": "y",
                                            "format": "xml"}}]}, base_dir=str(tmp_path))
    with pytest.raises(SpecError, match=r"dataset\.cpus: expected a positive number"):
        parse_sweep({"name": "t", "model": {"factory": "m:f"}, "checkpoints": ["c"],
                     "task": "classification", "metrics": ["accuracy"],
                     "dataset": {"path": "d", "inputs": "x", "target": "y", "cpus": 0}},
                    base_dir=str(tmp_path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16, torch.uint8])
def test_a_prepared_batch_carries_the_transforms_tensors_bit_for_bit(dtype):
    t = (torch.randn(10, 3, 2) * 100).to(dtype)
    table = pa.table({"y": list(range(10)), "other": ["a"] * 10})
    out = prepared.attach(table, t, ["y"])
    assert out.column_names == ["y", prepared.INPUTS]
    back = prepared.inputs(out.slice(3, 5))          # a slice: its offset is honoured
    assert back.dtype == dtype and torch.equal(back, t[3:8])
    kw = prepared.attach(table, {"image": t, "mask": torch.ones(10, dtype=torch.bool)}, [])
    got = prepared.inputs(kw)
    assert set(got) == {"image", "mask"} and torch.equal(got["image"], t)
    assert got["mask"].dtype == torch.bool and bool(got["mask"].all())


def test_a_failed_prepared_batch_keeps_its_rows_and_message():
    out = prepared.failed(pa.table({"x": [1, 2, 3]}), DataError("evals[0].dataset.transform: "
                                                                 "m:f raised ValueError: no"))
    assert out.num_rows == 3 and prepared.is_prepared(out)
    with pytest.raises(DataError, match="m:f raised ValueError: no"):
        prepared.inputs(out)


def test_text_tokenized_on_a_stage_is_what_the_worker_would_tokenize():
    """The Tokenize stage's rows equal the worker's own tokenization; a worker whose
    checkpoint has another tokenizer (another key) ignores them and tokenizes itself."""
    import dataclasses
    import pathlib

    from rayeval.execution.pipeline import Tokenize
    from rayeval.config.schema import EvalSpec
    from rayeval.io import hf

    lm = pathlib.Path(__file__).parents[2] / "configs" / "lm"
    tok = hf.load_tokenizer(str(lm / "ckpts" / "checkpoint-30"), what="model.tokenizer")
    table = pq.read_table(lm / "data" / "mc.parquet").slice(0, 9)
    ev = EvalSpec(name="mc", task="multiple_choice", metrics=(),
                  dataset=DatasetSpec(path="x", prompt="prompt", choices="choices",
                                      target="label", id="id"))
    task = tasks.get("multiple_choice")

    class Decoder:
        text = tok
        generation = ev.generation

    staged = Tokenize(ev, tok)(table)
    assert prepared.TEXT in staged.column_names and staged.num_rows == 9
    x_stage, y_stage = task.decode(staged, ev.dataset, {}, None, Decoder)
    x_own, y_own = task.decode(table, ev.dataset, {}, None, Decoder)
    assert x_stage.rows == x_own.rows and x_stage.extra == x_own.extra
    assert torch.equal(y_stage, y_own)
    # the stage's tokens are what the worker uses: its raw prompts are not tokenized again
    i = staged.column_names.index("prompt")
    tampered = staged.set_column(i, "prompt", pa.array(["Elsewhere"] * 9))
    assert task.decode(tampered, ev.dataset, {}, None, Decoder)[0].rows == x_own.rows

    class OtherDecoder(Decoder):
        text = dataclasses.replace(tok, key="another tokenizer")

    again = task.decode(tampered, ev.dataset, {}, None, OtherDecoder)[0]
    assert again.rows != x_own.rows
    assert again.rows == task.decode(table.set_column(i, "prompt", pa.array(["Elsewhere"] * 9)),
                                     ev.dataset, {}, None, OtherDecoder)[0].rows
