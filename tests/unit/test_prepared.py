"""A text task's rows carried from a Ray Data stage to the worker (core/prepared.py): plain JSON
that keeps every type, and never a pickle, so a data file that carries the column cannot run
code on a worker."""

import math
import os
import pickle

import pyarrow as pa
import pytest

from rayeval.core import prepared
from rayeval.errors import DataError


def test_rows_and_extras_come_back_with_their_types_and_exact_floats():
    rows = [[([1, 2], [3]), ([1, 2], [4, 5])], [(1, 2)], [[7, 8, 9]]]
    extra = [[1.0, 0.1 + 0.2], (3.0, float("nan"), "a b"), (5, b"\x00\xff", {"k": (1,)}, None)]
    table = prepared.attach_text(pa.table({"a": [1, 2, 3]}), rows, extra, "tok")
    got_rows, got_extra, _ = prepared.text_rows(table, "tok")
    assert got_rows == rows and isinstance(got_rows[0][0], tuple)
    assert got_extra[0] == extra[0] and got_extra[2] == extra[2]
    assert math.isnan(got_extra[1][1]) and got_extra[1][2] == "a b"
    assert prepared.text_rows(table, "another tokenizer") is None


class _Plant:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))          # creates the file if ever unpickled


def test_a_pickle_planted_in_the_column_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    field = pa.field(prepared.TEXT, pa.binary(), metadata={b"rayeval.tokenizer": b"tok"})
    table = pa.table([pa.array([pickle.dumps(_Plant(str(marker)))], pa.binary())],
                     schema=pa.schema([field]))
    with pytest.raises(DataError, match=r"holds something rayeval's stages do not write .*"
                                        "rename that column"):
        prepared.text_rows(table, "tok")
    assert not os.path.exists(marker)
