"""The error tree: structured fields that survive pickling (errors cross Ray's process
boundaries), and reason()/wrap(), the one place a foreign error becomes one line."""

import inspect
import pickle

import pyarrow as pa
import pytest
import torch

from rayeval import errors
from rayeval.errors import (CheckpointError, DataError, MetricError, ModelError, RayevalError,
                            RegistryError)

CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass)
           if issubclass(c, RayevalError)]


def test_the_tree_docstring_names_every_class():
    for cls in CLASSES:
        assert f" {cls.__name__} " in errors.__doc__, cls.__name__


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_message_detail_and_fields_survive_pickling(cls):
    e = cls("evals[0].dataset.path: cannot read 'd.parquet': bad magic", "Traceback ...",
            key_path="evals[0].dataset.path", location="s3://b/d.parquet", row_id=17,
            cause="ArrowInvalid", reason="bad magic")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls
    assert (back.message, str(back), back.detail) == (e.message, e.message, "Traceback ...")
    assert back.fields() == {"key_path": "evals[0].dataset.path", "location": "s3://b/d.parquet",
                             "row_id": 17, "cause": "ArrowInvalid", "reason": "bad magic"}


def test_fields_default_to_none_and_unset_ones_stay_out():
    e = DataError("x", location="/d")
    assert e.key_path is None and e.row_id is None and e.fields() == {"location": "/d"}
    assert pickle.loads(pickle.dumps(DataError("plain"))).fields() == {}


def test_a_misspelt_field_is_a_bug_not_a_lost_field():
    with pytest.raises(TypeError, match="DataError has no field keypath"):
        DataError("x", keypath="a")
    assert RegistryError("x", kind="task", name="t").fields() == {"kind": "task", "name": "t"}


@pytest.mark.parametrize("message, first, last", [
    ("one line", "one line", "one line"),
    ("Error(s) in loading state_dict for Net:\n\tMissing key(s): \"fc.w\".",
     "Error(s) in loading state_dict for Net:", "Missing key(s): \"fc.w\"."),
    ("\n\n   indented first   \nsecond\n\n", "indented first", "second"),
])
def test_reason_is_one_meaningful_line(message, first, last):
    e = RuntimeError(message)
    assert errors.reason(e) == first
    assert errors.reason(e, last=True) == last
    assert errors.reason(e, typed=True) == f"RuntimeError: {first}"


@pytest.mark.parametrize("error", [ValueError(), ValueError(""), ValueError("  \n \n")])
def test_reason_of_an_empty_message_is_the_type(error):
    # str(e).splitlines()[0] raised IndexError here, hiding the error being reported.
    assert errors.reason(error) == "ValueError"
    assert errors.reason(error, typed=True) == "ValueError"
    assert errors.reason(error, last=True) == "ValueError"


def test_reason_of_a_rayeval_error_is_its_message():
    assert errors.reason(DataError("k: first\nsecond")) == "k: first"
    assert errors.line("  \n a \n b ") == "a" and errors.line("") == ""


def test_wrap_keeps_the_foreign_type_and_line_as_fields():
    foreign = pa.ArrowInvalid("Parquet magic bytes not found in footer.\nEither the file is "
                              "corrupted or this is not a parquet file.")
    e = errors.wrap(foreign, DataError, "evals[0].dataset.path: cannot read 'd' as parquet",
                    key_path="evals[0].dataset.path", location="d")
    assert type(e) is DataError and e.detail is None
    assert str(e) == ("evals[0].dataset.path: cannot read 'd' as parquet: Parquet magic bytes "
                      "not found in footer.")
    assert e.fields() == {"key_path": "evals[0].dataset.path", "location": "d",
                          "cause": "ArrowInvalid",
                          "reason": "Parquet magic bytes not found in footer."}
    typed = errors.wrap(KeyError("w"), ModelError, "model.factory: f() raised", typed=True,
                        detail="tb")
    assert (str(typed), typed.detail, typed.reason) == ("model.factory: f() raised: KeyError: "
                                                        "'w'", "tb", "'w'")
    assert pickle.loads(pickle.dumps(typed)).fields() == typed.fields()


# --- the sites -------------------------------------------------------------------------------

def test_a_metric_raising_an_empty_or_multiline_error_is_one_line():
    from rayeval.core.evaluate import metric_errors

    with pytest.raises(MetricError) as info:
        with metric_errors("mine", "on a batch"):
            raise ZeroDivisionError()
    assert str(info.value) == "metric 'mine' failed on a batch: ZeroDivisionError"
    assert "ZeroDivisionError" in info.value.detail
    with pytest.raises(MetricError) as info:
        with metric_errors("mine", "in compute"):
            raise ValueError("shapes differ\n  (3,) vs (4,)")
    assert str(info.value) == "metric 'mine' failed in compute: ValueError: shapes differ"
    assert info.value.cause == "ValueError"


def test_a_model_that_cannot_take_the_inputs_names_the_key(tmp_path):
    from rayeval.core import tasks
    from rayeval.core.evaluate import output_size

    class Picky(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied\n(2x3 and 4x5)")

    with pytest.raises(ModelError) as info:
        output_size(Picky(), tasks.get("classification"), torch.zeros(2, 3))
    assert str(info.value).endswith(": RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert info.value.key_path == "model.factory" and info.value.detail


def test_parquet_that_is_not_parquet_is_one_line_with_its_location(tmp_path):
    from rayeval.io import data

    bad = tmp_path / "d.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(DataError) as info:
        data.open_dataset([str(bad)], "evals[0].dataset.path")
    e = info.value
    assert str(e).startswith(f"evals[0].dataset.path: cannot read {str(bad)!r} as parquet: ")
    assert "\n" not in str(e)
    assert (e.key_path, e.location, e.cause) == ("evals[0].dataset.path", str(bad),
                                                 "ArrowInvalid")


def test_a_corrupt_checkpoint_keeps_its_location(tmp_path):
    from rayeval.io import layouts

    f = tmp_path / "c.pt"
    f.write_bytes(b"PK\x03\x04" + b"\x00" * 40)        # a zip header and nothing behind it
    with pytest.raises(CheckpointError) as info:
        layouts.read(str(f))
    assert info.value.location == str(f) and info.value.cause
    assert str(info.value).startswith(f"{f}: ") and "\n" not in str(info.value)


def test_user_code_that_raised_reads_as_a_sentence(tmp_path):
    from rayeval.config.schema import ModelSpec
    from rayeval.io.model import build_model, import_callable

    (tmp_path / "boom_models.py").write_text(
        "def build():\n    raise ValueError('no weights\\n  at layer 3')\n")
    (tmp_path / "boom_import.py").write_text("raise KeyError('cfg')\n")
    with pytest.raises(ModelError) as info:
        build_model(ModelSpec(factory="boom_models:build"), str(tmp_path))
    assert str(info.value) == "model.factory: boom_models:build(**{}) raised ValueError: no weights"
    assert info.value.key_path == "model.factory" and "at layer 3" in info.value.detail
    with pytest.raises(ModelError) as info:
        import_callable("boom_import:f", str(tmp_path), what="metrics")
    assert str(info.value) == "metrics: importing 'boom_import' raised KeyError: 'cfg'"


def test_a_transform_that_raised_names_its_key():
    from rayeval.config.schema import DatasetSpec
    from rayeval.core.tasks import base

    def flaky(table):
        raise ValueError("cannot decode row 150\nmore context")

    spec = DatasetSpec(path="d", inputs=("x",), target="y", transform="shapes:flaky",
                       key_path="evals[2].dataset")
    with pytest.raises(DataError) as info:
        base.transformed(flaky, pa.table({"x": [1.0], "y": [0]}), spec)
    assert str(info.value) == ("evals[2].dataset.transform: shapes:flaky raised ValueError: "
                               "cannot decode row 150")
    assert info.value.key_path == "evals[2].dataset.transform"
