"""The task base class and the tasks whose rows are tensors: classification, regression and
language modeling over token ids.

A task owns everything that used to be tested by string across the code base: the columns it
needs and their checks, turning a pyarrow batch into tensors, row ids for the bootstrap, the
model's output size, aligning outputs with targets, the metrics it allows, and its fields in the
content key, and what its data set needs in the sweep file. Adding a task is adding one class
registered in ``TASKS`` (``@TASKS.register(instance=True)``), with metric classes that name it
as their ``task`` (``@metrics.register``).

Plain torch and pyarrow: the driver uses tasks to check data and probe the model before Ray
starts, the workers to evaluate. A task never touches the model: ``score`` hands its requests
to a backend (``core.backends``) and turns the responses into the metrics' outputs.
"""

from __future__ import annotations

import dataclasses

from typing import ClassVar, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import torch

from rayeval.io import data
from rayeval.core import prepared, stats
from rayeval.config.schema import DatasetSpec
from rayeval import errors
from rayeval.errors import CheckpointError, DataError, ModelError, traceback_of
from rayeval.config.registry import Registry
from rayeval.core import metrics as _metrics
from rayeval.core.metrics import IGNORE
from rayeval.core.backends.base import Backend, Context, Inputs, wrong_output

TOKENS = "_tokens"  # the state of scored target tokens that an LM pass keeps (evaluate.Accumulator)

# Every task, by name, as an instance: ``@TASKS.register(instance=True)`` on a Task subclass.
TASKS: Registry[Task] = Registry("task")


class Task:
    """Base class; subclasses set ``name`` and override what differs."""

    name: ClassVar[str] = ""
    needs: ClassVar[str] = ""            # what the model must return, for messages
    counts_tokens: ClassVar[bool] = False  # a pass keeps the TOKENS state (see scored_units)
    needs_target: ClassVar[bool] = True  # dataset.target is required
    needs_inputs: ClassVar[bool] = True  # dataset.inputs is required (without a transform)
    uses_text: ClassVar[bool] = False    # rows are text: a tokenizer turns them into tokens
    generates: ClassVar[bool] = False    # the evaluation's generation: key applies
    group_rows: ClassVar[int] = 0        # >0: a pass scores up to this many rows at once

    def held_rows(self, spec) -> int:
        """Rows a pass holds back to score together (0: each batch as it comes)."""
        return self.group_rows

    @property
    def metrics(self) -> dict:
        """The built-in metrics this task allows, by name."""
        return _metrics.for_task(self.name)

    def spec_problem(self, spec: DatasetSpec) -> tuple[str, str] | None:
        """(key, problem) when the sweep's dataset keys do not suit the task."""
        return None

    # --- the data set, on the driver -----------------------------------------------------

    def check_schema(self, spec: DatasetSpec, schema: pa.Schema) -> None:
        """Column types; raises DataError naming the key."""

    def input_shapes(self, ds: pads.Dataset, spec: DatasetSpec) -> dict[str, tuple[int, ...]]:
        """One row's shape per input column (none with a transform: it decides)."""
        if spec.transform:
            return {}
        return {c: data.input_shape(ds, c, f"{spec.key_path}.inputs") for c in spec.inputs}

    def check_values(self, ds: pads.Dataset, spec: DatasetSpec, size: int) -> None:
        """Cheap checks of the data before any worker: float inputs that are NaN or infinite
        (one scan of the input columns, when they are small enough to scan in seconds)."""
        check_finite_inputs(ds, spec)

    # --- a batch ---------------------------------------------------------------------------

    def decode(self, table, spec: DatasetSpec, shapes: Mapping[str, tuple[int, ...]],
               transform=None, decoder=None) -> tuple[Inputs, torch.Tensor]:
        """One batch as the model's inputs and the targets (``decoder``: the
        ``evaluate.Decoder`` calling, whose tokenizer the text tasks use)."""
        return self.inputs(table, spec, shapes, transform), self.targets(table, spec)

    def targets(self, table, spec: DatasetSpec) -> torch.Tensor:
        raise NotImplementedError

    def inputs(self, table, spec: DatasetSpec, shapes: Mapping[str, tuple[int, ...]],
               transform=None) -> Inputs:
        """The model's inputs: the transform's output, one column's tensor, or keywords."""
        if prepared.is_prepared(table):      # the transform ran on a Ray Data stage
            x = prepared.inputs(table)
        elif transform is not None:
            x = transformed(transform, table, spec)
        elif len(spec.inputs) == 1:
            c = spec.inputs[0]
            x = data.number_tensor(table, c, shapes[c], f"{spec.key_path}.inputs")
        else:
            x = {c: data.number_tensor(table, c, shapes[c], f"{spec.key_path}.inputs")
                 for c in spec.inputs}
        _check_finite(x, table, spec)
        return x

    def row_ids(self, table, spec: DatasetSpec, x: Inputs, y: torch.Tensor) -> torch.Tensor:
        """Each row's id for the bootstrap: the id column, else a hash of the row's content."""
        if spec.id is not None:
            return data.id_values(table, spec.id, f"{spec.key_path}.id")
        return stats.content_ids(_words(x), y)

    # --- scoring: requests to the backend, its responses to outputs ------------------

    def score(self, backend: Backend, x: Inputs, y: torch.Tensor, ctx: Context
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch's requests answered by ``backend``: (outputs, targets) in the shapes the
        task's metrics take. ``ctx``: what the pass scores in (spec, output size, device)."""
        self.check_targets(y, ctx.size, ctx.spec)
        y = y.to(ctx.device, non_blocking=True)
        out = backend.forward(x, ctx)
        if not isinstance(out, torch.Tensor):
            raise self.wrong_output(out)
        if not stats.all_finite(out):     # inputs are checked finite when decoded
            raise CheckpointError("the model produced NaN or infinite outputs with this "
                                  "checkpoint")
        return self.align(out, y)

    def join(self, xs: list) -> Inputs:
        """Several decoded batches' inputs as one (tasks with ``group_rows``)."""
        raise NotImplementedError

    def probe_input(self, x: Inputs) -> Inputs:
        """What the driver's probe feeds the model, from a decoded batch of a few rows."""
        return x

    def idle_input(self, spec: DatasetSpec, shapes: Mapping[str, tuple[int, ...]]
                   ) -> Inputs | None:
        """The smallest input the model takes: what a rank of a sharded replica feeds it while
        its peers still have rows (the output is dropped). One row of zeros in the data
        set's shapes; None when a transform makes the inputs (then the rank's first real
        batch is fed again)."""
        if spec.transform is not None:
            return None
        zeros = {c: torch.zeros((1, *shapes[c]), dtype=torch.float32) for c in spec.inputs}
        return zeros[spec.inputs[0]] if len(spec.inputs) == 1 else zeros

    def scored_tokens(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The tokens a batch scored (tasks that count them, ``counts_tokens``)."""
        return (targets != IGNORE).sum()

    def output_size(self, out: torch.Tensor) -> int:
        """Classes, vocabulary or 1, from one output; ModelError if it does not fit."""
        raise NotImplementedError

    def wrong_output(self, out) -> ModelError:
        return wrong_output(out, self.name, self.needs)

    def check_targets(self, y: torch.Tensor, size: int, spec: DatasetSpec) -> None:
        """Per batch, on the worker: targets the model's output can score."""

    def align(self, out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs and targets in the shapes the task's metrics take."""
        return out.float(), y

    def scored_units(self, states: Mapping[str, torch.Tensor]) -> int | None:
        """How many units were scored, from a cell's merged states, when that is not the row
        count (language modeling: unmasked target tokens); None when the rows are the units."""
        return None


@TASKS.register(instance=True)
class Classification(Task):
    name = "classification"
    needs = "logits of shape (batch, classes)"

    def check_schema(self, spec, schema):
        typ = schema.field(spec.target).type
        if not pa.types.is_integer(typ):
            raise DataError(f"{spec.key_path}.target: column {spec.target!r} has type {typ}; "
                            "expected integer class indices (cast it to int64)")

    def check_values(self, ds, spec, size):
        super().check_values(ds, spec, size)
        lo, hi = _min_max(ds, spec.target)
        if lo is not None:
            self._check_range(lo, hi, size, spec)

    def targets(self, table, spec):
        return data.target_tensor(table, spec.target, f"{spec.key_path}.target")

    def output_size(self, out):
        if isinstance(out, torch.Tensor) and out.dim() == 2:
            return int(out.shape[1])
        raise self.wrong_output(out)

    def check_targets(self, y, size, spec):
        self._check_range(int(y.min()), int(y.max()), size, spec)

    @staticmethod
    def _check_range(lo: int, hi: int, size: int, spec) -> None:
        if lo < 0 or hi >= size:
            bad = lo if lo < 0 else hi
            raise DataError(f"{spec.key_path}.target: class index {bad} is outside the model's "
                            f"{size} classes [0, {size}); fix the labels or the model's output "
                            "size")


@TASKS.register(instance=True)
class Regression(Task):
    name = "regression"
    needs = "one prediction per row, shape (batch,) or (batch, 1)"

    def check_schema(self, spec, schema):
        typ = schema.field(spec.target).type
        if not (pa.types.is_integer(typ) or pa.types.is_floating(typ)):
            raise DataError(f"{spec.key_path}.target: column {spec.target!r} has type {typ}; "
                            "regression needs a numeric target")

    def targets(self, table, spec):
        return data.target_tensor(table, spec.target, f"{spec.key_path}.target", np.float64)

    def output_size(self, out):
        if isinstance(out, torch.Tensor) and out.dim() >= 1 and out.numel() == out.shape[0]:
            return 1
        raise self.wrong_output(out)

    def check_targets(self, y, size, spec):
        if not stats.all_finite(y):
            raise DataError(f"{spec.key_path}.target: NaN or infinite target values; drop or "
                            "fill those rows")

    def align(self, out, y):
        return out.reshape(-1), y


@TASKS.register(instance=True)
class LanguageModeling(Task):
    """Next-token prediction over token-id sequences, right-padded in a batch."""
    name = "language_modeling"
    needs = "logits of shape (batch, positions, vocab)"
    needs_target = False                 # without one, the inputs are the labels

    def spec_problem(self, spec):
        if len(spec.inputs) != 1 or spec.transform:
            return "inputs", "language_modeling takes one column of token ids and no transform"
        return None
    # Rows are sequences, so num_samples says little about a perplexity's support; the count
    # is kept apart from the metrics' own "tokens" states, which exist only for chosen metrics.
    counts_tokens = True

    def idle_input(self, spec, shapes):
        return torch.zeros((1, 1), dtype=torch.int64)         # one token

    def check_schema(self, spec, schema):
        for key, column in ((f"{spec.key_path}.inputs", spec.inputs[0]),
                            (f"{spec.key_path}.target", spec.target)):
            if column is None:
                continue
            leaf, depth = data.leaf_type(schema.field(column).type)
            if depth != 1 or not pa.types.is_integer(leaf):
                raise DataError(f"{key}: column {column!r} has type {schema.field(column).type};"
                                " language modeling needs lists of integer token ids")

    def input_shapes(self, ds, spec):
        return {}

    def decode(self, table, spec, shapes, transform=None, decoder=None):
        return self._tokens(table, spec)

    def _tokens(self, table, spec: DatasetSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs (rows, T) int64 right-padded with pad_id, targets (rows, T) int64 with
        IGNORE at padding and at dataset.ignore_index). Without a target column the targets
        are the inputs themselves (the model predicts the next token)."""
        column = spec.inputs[0]
        tokens = data.column_array(table, column)
        labels = data.column_array(table, spec.target) if spec.target else tokens
        for name, arr in ((column, tokens), (spec.target, labels)):
            if arr.null_count or arr.flatten().null_count:
                raise DataError(f"{spec.key_path}: column {name!r} has null values; fill or "
                                "drop those rows")
        lengths = pc.list_value_length(tokens).to_numpy(zero_copy_only=False).astype(np.int64)
        if spec.target:
            other = pc.list_value_length(labels).to_numpy(zero_copy_only=False)
            if (other != lengths).any():
                raise DataError(f"{spec.key_path}.target: {spec.target!r} sequences differ in "
                                f"length from {column!r}; give one label per input token")
        n, t = len(lengths), int(lengths.max()) if len(lengths) else 0
        positions = np.arange(t).reshape(1, -1) < lengths.reshape(-1, 1)
        x = np.full((n, t), spec.pad_id, dtype=np.int64)
        y = np.full((n, t), IGNORE, dtype=np.int64)
        x[positions] = tokens.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
        y[positions] = labels.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
        y[y == spec.ignore_index] = IGNORE
        return torch.from_numpy(x), torch.from_numpy(y)

    def row_ids(self, table, spec, x, y):
        """Of the tokens only, so padding (which depends on the batch) does not change it."""
        if spec.id is not None:
            return super().row_ids(table, spec, x, y)
        lengths = pc.list_value_length(data.column_array(table, spec.inputs[0]))
        lengths = torch.from_numpy(lengths.to_numpy(zero_copy_only=False).astype(np.int64))
        return stats.content_ids(x, lengths.view(-1, 1), valid=lengths)

    def output_size(self, out):
        if isinstance(out, torch.Tensor) and out.dim() == 3:
            return int(out.shape[2])
        raise self.wrong_output(out)

    def check_targets(self, y, size, spec):
        real = y[y != IGNORE]
        if real.numel() and (int(real.min()) < 0 or int(real.max()) >= size):
            bad = int(real.min()) if int(real.min()) < 0 else int(real.max())
            raise DataError(f"{spec.key_path}: token id {bad} is outside the model's vocabulary "
                            f"of {size}; check the tokenizer or {spec.key_path}.ignore_index")

    def align(self, out, y):
        return out[:, :-1].float(), y[:, 1:]     # position t predicts token t + 1

    def scored_units(self, states):
        return int(states[TOKENS])


def rows_of(x: Inputs) -> int:
    return int(next(iter(x.values())).shape[0]) if isinstance(x, Mapping) else int(x.shape[0])


def take(x: Inputs, index: torch.Tensor, rows: int) -> Inputs:
    """The rows ``index`` of a decoded batch of ``rows`` rows (a race's round scores some of
    them): tensors and mappings of tensors are indexed; a batch object (text, image items) has
    each of its per-row lists (and its ``items`` mapping's) taken, its byte count scaled."""
    if isinstance(x, torch.Tensor):
        return x[index]
    if isinstance(x, Mapping):
        return {k: v[index] for k, v in x.items()}
    keep = index.tolist()

    def part(v):
        if isinstance(v, list) and len(v) == rows:
            return [v[i] for i in keep]
        if isinstance(v, dict) and all(isinstance(w, list) and len(w) == rows
                                       for w in v.values()):
            return {k: [w[i] for i in keep] for k, w in v.items()}
        return v
    changes = {f.name: part(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if "nbytes" in changes:
        changes["nbytes"] = x.nbytes * len(keep) // max(rows, 1)
    return dataclasses.replace(x, **changes)


def nbytes(x: Inputs) -> int:
    return sum(int(t.nbytes) for t in x.values()) if isinstance(x, Mapping) else int(x.nbytes)


def pin(x: Inputs) -> Inputs:
    """In page-locked memory, so copies to a GPU are asynchronous and twice as fast."""
    if isinstance(x, Mapping):
        return {k: v.pin_memory() for k, v in x.items()}
    return x.pin_memory()


def _words(x: Inputs) -> torch.Tensor:
    """All of a row's input values as int64 words, for content ids."""
    if isinstance(x, Mapping):
        n = rows_of(x)
        return torch.cat([stats.as_int64_words(x[k].reshape(n, -1)) for k in sorted(x)], dim=1)
    return x


def _check_finite(x: Inputs, table, spec: DatasetSpec) -> None:
    """NaN or infinite inputs are the data's fault, not the checkpoint's: name the row and the
    column (or the transform's output) before the model sees them."""
    named = x.items() if isinstance(x, Mapping) else [(None, x)]
    for name, t in named:
        if not t.is_floating_point():
            continue
        if spec.transform:
            what = f"{spec.key_path}.transform: {spec.transform} returned"
            what += f" {name!r} with" if name else ""
        else:
            what = f"{spec.key_path}.inputs: column {name or spec.inputs[0]!r} has"
        _raise_if_not_finite(t, table, spec, what)


def _raise_if_not_finite(t: torch.Tensor, table, spec: DatasetSpec, what: str) -> None:
    """One DataError naming the first row (by its id) whose values are NaN or infinite."""
    if stats.all_finite(t):
        return
    bad = ~torch.isfinite(t.reshape(t.shape[0], -1)).all(dim=1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        row_id = None
        if spec.id is not None:
            row_id = data.column_array(table, spec.id)[i].as_py()
            row = f"the row with {spec.id} = {row_id!r}"
        else:
            row = f"a row (set {spec.key_path}.id to name it)"
        raise DataError(f"{what} NaN or infinite values in {row}; drop or fill such rows",
                        key_path=spec.key_path, row_id=row_id)


def transformed(transform, table, spec: DatasetSpec) -> Inputs:
    """The transform's output for a batch, checked: tensors whose first dimension is the
    batch; a DataError naming the key otherwise."""
    key = f"{spec.key_path}.transform"
    try:
        out = transform(table if isinstance(table, pa.Table) else pa.Table.from_batches([table]))
    except DataError:
        raise
    except Exception as e:
        raise errors.wrap(e, DataError, f"{key}: {spec.transform} raised", typed=True, sep=" ",
                          detail=traceback_of(e), key_path=key) from None
    n = table.num_rows

    def tensor(name, value):
        try:
            t = torch.as_tensor(value)
        except Exception:
            raise DataError(f"{key}: {spec.transform} returned {type(value).__name__}"
                            f"{' for ' + repr(name) if name else ''}; return a tensor or a "
                            "mapping of keyword name to tensor") from None
        if t.dim() == 0 or t.shape[0] != n:
            raise DataError(f"{key}: {spec.transform} returned shape {tuple(t.shape)}"
                            f"{' for ' + repr(name) if name else ''} for a batch of {n} rows; "
                            "the first dimension must be the batch")
        return t

    if isinstance(out, Mapping):
        if not out or not all(isinstance(k, str) for k in out):
            raise DataError(f"{key}: {spec.transform} returned an empty mapping or non-string "
                            "keys; return keyword name -> tensor")
        return {k: tensor(k, v) for k, v in out.items()}
    return tensor(None, out)


SCAN_LIMIT_BYTES = 512 << 20     # input columns up to this size are scanned on the driver


def check_finite_inputs(ds: pads.Dataset, spec: DatasetSpec) -> None:
    """NaN or infinite values in float input columns, named by row and column before Ray
    starts. Skipped for a transform's inputs (it decides what they mean) and for columns too
    large to scan in seconds: the workers still check every batch."""
    if spec.transform or not spec.inputs:
        return
    floats = [c for c in spec.inputs
              if pa.types.is_floating(data.leaf_type(ds.schema.field(c).type)[0])]
    if not floats or _column_bytes(ds, floats) > SCAN_LIMIT_BYTES:
        return
    columns = floats + ([spec.id] if spec.id else [])
    for batch in ds.to_batches(columns=columns, batch_size=65536):
        for c in floats:
            arr = data.column_array(batch, c)
            values = arr
            while not pa.types.is_floating(values.type):
                values = values.flatten()
            if pc.all(pc.is_finite(values)).as_py() is not False:
                continue
            t = torch.from_numpy(np.array(values.to_numpy(zero_copy_only=False),
                                          copy=True)).reshape(batch.num_rows, -1)
            _raise_if_not_finite(t, batch, spec, f"{spec.key_path}.inputs: column {c!r} has")


def _column_bytes(ds: pads.Dataset, columns: list[str]) -> int:
    """The uncompressed size of some columns, from the parquet metadata (no data read)."""
    total = 0
    try:
        for fragment in ds.get_fragments():
            meta = fragment.metadata
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                for i in range(group.num_columns):
                    col = group.column(i)
                    if col.path_in_schema.split(".")[0] in columns:
                        total += col.total_uncompressed_size
    except (AttributeError, pa.ArrowInvalid, OSError):
        return SCAN_LIMIT_BYTES + 1          # unknown: do not scan
    return total


def _min_max(ds: pads.Dataset, column: str) -> tuple[int | None, int | None]:
    """A column's min and max: from the parquet statistics when every row group has them,
    else from one scan of that column."""
    lo = hi = None
    try:
        for fragment in ds.get_fragments():
            meta = fragment.metadata
            leaves = [meta.schema.column(i).path for i in range(meta.num_columns)]
            index = leaves.index(column)             # ValueError: not a flat column
            for g in range(meta.num_row_groups):
                st = meta.row_group(g).column(index).statistics
                if st is None or not st.has_min_max:
                    raise LookupError
                lo = st.min if lo is None else min(lo, st.min)
                hi = st.max if hi is None else max(hi, st.max)
        return lo, hi
    except (LookupError, ValueError, AttributeError, pa.ArrowInvalid, OSError):
        pass
    found = pc.min_max(ds.to_table(columns=[column]).column(column))
    return found["min"].as_py(), found["max"].as_py()
