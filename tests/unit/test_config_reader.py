"""Tier 1: the generic reader (``config.reader``) reads a mapping into the schema's frozen
dataclasses from their declarations alone: types, bounds, choices, defaults, unknown keys and
nested key paths, each fault one line naming the file and the key path."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from rayeval.config import schema
from rayeval.config.reader import Reader
from rayeval.config.schema import (Bootstrap, DatasetSpec, Generation, LmEvalSpec, ModelSpec,
                                   Parallelism, Sweep, WatchSpec, setting)
from rayeval.errors import SpecError


@dataclass(frozen=True)
class Inner:
    """A section declared only here: the reader knows nothing of it but its declarations."""
    size: int = setting("A count.", numbers=True, default=4, minimum=1)
    share: float | None = setting("A share.", numbers=True, default=None, above=0, maximum=1)


@dataclass(frozen=True)
class Outer:
    label: str = setting("Required: no default.", numbers=True)
    inner: Inner = setting("A nested section.", numbers=True, default=Inner())
    spare: Inner | None = setting("An optional section.", numbers=True, default=None)
    tags: tuple[str, ...] = setting("One string or a list.", numbers=True, default=())
    amounts: tuple[tuple[str, float], ...] = setting("A mapping as sorted pairs.", numbers=True,
                                                     default=(), minimum=0)
    count: int | float = setting("Kept as given.", numbers=True, default=1)
    hidden: str = setting("Not a sweep-file key.", numbers=False, default="x", yaml=None)


def read(cls, raw, path="", **kw):
    return Reader("s.yaml", resolve=lambda p: f"/base/{p}").build(cls, raw, path, **kw)


def fails(cls, raw, message, path="", **kw):
    with pytest.raises(SpecError, match="^" + re.escape(f"s.yaml: {message}") + "$"):
        read(cls, raw, path, **kw)


def test_types_defaults_and_nested_sections_from_the_declarations():
    got = read(Outer, {"label": "a", "inner": {"share": 1}, "tags": "t",
                       "amounts": {"b": 2, "a": 1}, "count": 3})
    assert got == Outer(label="a", inner=Inner(size=4, share=1.0), spare=None, tags=("t",),
                        amounts=(("a", 1.0), ("b", 2.0)), count=3, hidden="x")
    assert isinstance(got.inner.share, float) and isinstance(got.count, int)
    assert read(Outer, {"label": "a", "spare": {}}).spare == Inner()
    assert read(Outer, {"label": "a", "inner": None}).inner == Inner(), "null: left out"


@pytest.mark.parametrize("raw,message", [
    ({}, "label: missing required key"),
    ({"label": 3}, "label: expected a non-empty string, got 3 (int)"),
    ({"label": "  "}, "label: expected a non-empty string, got '  ' (str)"),
    ({"label": "a", "inner": {"size": "4"}}, "inner.size: expected an integer, got '4' (str)"),
    ({"label": "a", "inner": {"size": True}}, "inner.size: expected an integer, got True (bool)"),
    ({"label": "a", "inner": {"size": 0}}, "inner.size: must be at least 1, got 0"),
    ({"label": "a", "inner": {"share": 0}}, "inner.share: must be in (0, 1], got 0.0"),
    ({"label": "a", "spare": {"share": 2}}, "spare.share: must be in (0, 1], got 2.0"),
    ({"label": "a", "inner": 5}, "inner: expected a mapping, got 5 (int)"),
    ({"label": "a", "tags": ["t", 1]}, "tags: expected a list of non-empty strings, got "
                                       "['t', 1] (list)"),
    ({"label": "a", "amounts": {"a": -1}}, "amounts: expected a mapping of names to numbers, "
                                           "got {'a': -1} (dict)"),
    ({"label": "a", "hidden": "y"}, "hidden: unknown key; allowed keys: amounts, count, "
                                    "inner, label, spare, tags"),
    ({"label": "a", "inner": {"sise": 2}}, "inner.sise: unknown key; did you mean 'size'?"),
])
def test_each_fault_is_one_line_naming_the_key_path(raw, message):
    fails(Outer, raw, message)


@pytest.mark.parametrize("cls,raw,message", [
    (ModelSpec, {"dtype": "float8"}, "model.dtype: unknown dtype 'float8'; choose one of: "
                                     "float32, float16, bfloat16, float64"),
    (ModelSpec, {"factory": "pkg.build"}, "model.factory: expected 'module:callable', got "
                                          "'pkg.build'"),
    (ModelSpec, {"kwargs": [1]}, "model.kwargs: expected a mapping of keyword arguments, got "
                                 "[1] (list)"),
    (ModelSpec, {"max_length": 1}, "model.max_length: must be at least 2, got 1"),
    (DatasetSpec, {"path": "d", "format": "xml"},
     "model.format: unknown format 'xml'; choose one of: parquet, json, csv, hf, images (or "
     "leave it out: the path's suffix says)"),
    (DatasetSpec, {"path": "d", "cpus": 0},
     "model.cpus: expected a positive number of CPUs (e.g. 1 or 0.5), got 0 (int)"),
    (DatasetSpec, {"path": "d", "inputs": []},
     "model.inputs: expected a column name or a list of column names, got [] (list)"),
    (DatasetSpec, {"path": "d", "delimiter": 1},
     "model.delimiter: expected a string (\" \" by default, \"\" for none), got 1 (int)"),
    (Bootstrap, {"confidence": 1}, "model.confidence: expected a number between 0 and 1, got "
                                   "1 (int)"),
    (Generation, {"top_p": -1}, "model.top_p: must be at least 0.0, got -1"),
    (Generation, {"top_p": 1.5}, "model.top_p: must be in (0, 1], got 1.5"),
    (Generation, {"temperature": "hot"}, "model.temperature: expected a number, got 'hot' "
                                         "(str)"),
    (LmEvalSpec, {"task": "t", "limit": 0},
     "model.limit: expected a positive number of documents (or a share below 1), got 0 (int)"),
    (WatchSpec, {"order": "random"}, "model.order: expected one of oldest, newest, bisect, got "
                                     "'random' (str)"),
    (Parallelism, {"wrap": [""]}, "model.wrap: expected module class names (e.g. "
                                  "[DecoderLayer]), got [''] (list)"),
])
def test_the_schemas_declared_checks_and_their_messages(cls, raw, message):
    fails(cls, raw, message, path="model")


def test_sweep_level_defaults_lists_and_locations():
    sweep = Reader("s.yaml", resolve=lambda p: f"/base/{p}").section(
        Sweep, {"name": "n", "checkpoints": "c/*", "output": "out"}, "",
        skip={"evals", "trackers"})
    assert (sweep["workers"], sweep["use_gpu"]) == (1, False), "file_default"
    assert sweep["checkpoints"] == ("/base/c/*",) and sweep["output"] == "/base/out"
    assert sweep["model"] == ModelSpec() and sweep["parallelism"] == Parallelism()
    with pytest.raises(SpecError, match=re.escape("s.yaml: checkpoints[1]: expected a path "
                                                  "or glob, got 7 (int)")):
        Reader("s.yaml").section(Sweep, {"name": "n", "checkpoints": ["a", 7], "output": "o"},
                                 "", skip={"evals", "trackers"})


def test_keys_left_out_come_from_a_base_and_lm_eval_limits_stay_as_given():
    base = Bootstrap(replicates=50, seed=3)
    assert read(Bootstrap, {"buckets": 8}, "b", base=base) == Bootstrap(50, 0.95, 3, 8)
    assert read(LmEvalSpec, {"task": "t", "limit": 5}).limit == 5           # not 5.0: keyed
    assert read(LmEvalSpec, {"task": "t", "limit": 0.5}).limit == 0.5


def test_a_field_declares_only_known_checks():
    with pytest.raises(ValueError, match="unknown checks"):
        setting("x", numbers=True, default=0, minimun=1)
    assert "minimum" in schema.CHECKS
